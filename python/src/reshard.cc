#include "reshard.h"

#include <memory>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "shardgather/errors.h"
#include "shardgather/quantize.h"

namespace py = pybind11;

namespace shardgather::python {

namespace {

std::vector<RankBox> rank_boxes(const std::vector<PyRankBox>& boxes) {
  std::vector<RankBox> out;
  out.reserve(boxes.size());
  for (const auto& [rank, offset, size] : boxes) {
    out.push_back({rank, Box{offset, size}});
  }
  return out;
}

std::vector<TensorRegions> tensor_regions(const std::vector<PyTensorRegions>& layouts) {
  std::vector<TensorRegions> out;
  out.reserve(layouts.size());
  for (std::size_t i = 0; i < layouts.size(); ++i) {
    const auto& [dtype, shape, sources, destinations] = layouts[i];
    out.push_back({.dtype = dtype_from_py(dtype, "layout " + std::to_string(i) + " dtype"),
                   .shape = shape,
                   .sources = rank_boxes(sources),
                   .destinations = rank_boxes(destinations)});
  }
  return out;
}

std::unique_ptr<PyReshardPlan> make_reshard_plan(
    const std::vector<PyTensorRegions>& layouts, int world_size, int rank,
    std::optional<std::vector<int>> hosts, bool fan_out, const std::string& strategy,
    bool preflight, std::optional<double> timeout, std::optional<std::uint64_t> device_bucket_bytes,
    const std::string& stage, const std::vector<std::optional<std::string>>& quantize) {
  PlanOptions options = plan_options(strategy, preflight, timeout);
  options.stage = Stage(stage);
  RegionOptions regions;
  regions.hosts = hosts.value_or(std::vector<int>{});
  regions.fan_out = fan_out;
  regions.device_bucket_bytes = device_bucket_bytes.value_or(regions.device_bucket_bytes);
  return std::make_unique<PyReshardPlan>(ReshardPlan(tensor_regions(layouts), world_size, rank,
                                                     options, regions, quant_formats(quantize)),
                                         options);
}

py::object execute_reshard_plan(const py::object& self, py::handle sources,
                                const std::shared_ptr<Communicator>& comm, py::handle destinations,
                                bool async_op, std::optional<int> cuda_index, py::handle scales,
                                py::handle returned) {
  // The Python layer resolves the device: None (the tensors say), -1 (the host), or a CUDA index.
  std::optional<Device> device;
  if (cuda_index) {
    device = *cuda_index < 0 ? kCpu : cuda_device(*cuda_index);
  }
  return self.cast<PyReshardPlan&>().execute(sources, destinations, comm, async_op, device, scales,
                                             returned, self);
}

// This rank's boxes of one side: [(tensor index, offset, size)] in the order execute takes them.
py::list local_boxes(const ReshardPlan& plan, bool sources) {
  const std::size_t n = sources ? plan.source_count() : plan.destination_count();
  py::list out;
  for (std::size_t v = 0; v < n; ++v) {
    const ViewRef ref = sources ? plan.source_ref(v) : plan.destination_ref(v);
    const Box& box = sources ? plan.source(v).box : plan.destination(v).box;
    out.append(
        py::make_tuple(ref.tensor, py::tuple(py::cast(box.offset)), py::tuple(py::cast(box.size))));
  }
  return out;
}

// This rank's transfers of the first exchange on one side, in the plan's order: [(peer, tensor
// index, source view, destination view, box offset, box size)]. The peer is the rank at the other
// end (this rank itself for a local copy); it comes from the grouping (send_first, recv_first),
// since a Transfer's src and dst are entries of the layout, not ranks.
py::list round0_transfers(const RegionPlan& regions, bool sends) {
  const std::vector<Transfer>& transfers = sends ? regions.sends : regions.receives;
  const std::vector<std::size_t>& first = sends ? regions.send_first : regions.recv_first;
  py::list out;
  for (int peer = 0; peer < regions.world_size; ++peer) {
    const auto p = static_cast<std::size_t>(peer);
    for (std::size_t k = first[p]; k < first[p + 1]; ++k) {
      const Transfer& t = transfers[k];
      if (t.round == 0) {
        out.append(py::make_tuple(peer, t.tensor, t.src_view, t.dst_view,
                                  py::tuple(py::cast(t.box.offset)),
                                  py::tuple(py::cast(t.box.size))));
      }
    }
  }
  return out;
}

}  // namespace

void register_reshard_plan(py::module_& m) {
  using P = PyReshardPlan;
  py::class_<P>(m, "ReshardPlan")
      .def(py::init(&make_reshard_plan), py::arg("layouts"), py::arg("world_size"), py::arg("rank"),
           py::arg("hosts") = py::none(), py::arg("fan_out") = true, py::arg("strategy") = "auto",
           py::arg("preflight") = true, py::arg("timeout") = py::none(),
           py::arg("device_bucket_bytes") = py::none(), py::arg("stage") = "",
           py::arg("quantize") = std::vector<std::optional<std::string>>{})
      .def("execute", &execute_reshard_plan, py::arg("sources"), py::arg("comm"),
           py::arg("destinations"), py::arg("async_op") = false, py::arg("cuda_index") = py::none(),
           py::arg("scales") = py::none(), py::arg("returned") = py::none())
      .def_property_readonly("quantized", [](const P& p) { return p.plan().quantized(); })
      .def_property_readonly("amax_row_bytes", [](const P& p) { return p.plan().amax_row_bytes(); })
      .def_property_readonly("source_boxes", [](const P& p) { return local_boxes(p.plan(), true); })
      .def_property_readonly("destination_boxes",
                             [](const P& p) { return local_boxes(p.plan(), false); })
      .def_property_readonly("bytes_sent", [](const P& p) { return p.plan().bytes_sent(); })
      .def_property_readonly("bytes_received", [](const P& p) { return p.plan().bytes_received(); })
      .def_property_readonly("rank_sent", [](const P& p) { return p.plan().regions().rank_sent; })
      .def_property_readonly("rank_received",
                             [](const P& p) { return p.plan().regions().rank_received; })
      .def_property_readonly("host_sent", [](const P& p) { return p.plan().regions().host_sent; })
      .def_property_readonly("host_received",
                             [](const P& p) { return p.plan().regions().host_received; })
      .def_property_readonly("forwarding", [](const P& p) { return p.plan().regions().forwarding; })
      .def_property_readonly("rounds", [](const P& p) { return p.plan().regions().rounds; })
      .def_property_readonly(
          "transfers",
          [](const P& p) {
            const RegionPlan& regions = p.plan().regions();
            return py::make_tuple(round0_transfers(regions, true),
                                  round0_transfers(regions, false));
          },
          "(sends, receives): this rank's transfers of the first exchange, in the plan's order, "
          "each (peer, tensor, src_view, dst_view, offset, size)")
      .def_property_readonly("device_parts",
                             [](const P& p) { return p.plan().regions().device_parts; })
      .def_property_readonly("fingerprint", [](const P& p) { return p.plan().fingerprint(); })
      .def_property_readonly("world_size", [](const P& p) { return p.plan().world_size(); })
      .def_property_readonly("rank", [](const P& p) { return p.plan().rank(); })
      .def_property_readonly("timeout",
                             [](const P& p) { return seconds_or_none(p.options().timeout); })
      .def_property_readonly(
          "strategy", [](const P& p) { return std::string(strategy_name(p.options().strategy)); })
      .def_property_readonly("last_stats", [](const P& p) { return stats_dict(p.last_stats()); });
}

}  // namespace shardgather::python
