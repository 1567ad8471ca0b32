// The pybind11 module shardgather._shardgather: bindings and argument conversion only; the
// semantics live in the core (src/) and in python/shardgather/__init__.py.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include "delta.h"
#include "params.h"
#include "plans.h"
#include "quantize.h"
#include "reshard.h"
#include "round_call.h"
#include "stream.h"
#include "torch_allocator.h"
#include "torch_tensors.h"
#include "work.h"

#include "shardgather/communicator.h"
#include "shardgather/copy.h"
#include "shardgather/errors.h"
#include "shardgather/foreach_all_gather.h"
#include "shardgather/plan.h"
#include "shardgather/threads.h"
#include "shardgather/torch.h"
#include "shardgather/unshard.h"
#include "shardgather/version.h"

#ifdef SHARDGATHER_PYTHON_WITH_MPI
#include <mpi.h>

#include "shardgather/mpi.h"
#endif

namespace py = pybind11;

namespace shardgather::python {

namespace {

using CommPtr = std::shared_ptr<Communicator>;

// out[i][r] over the result's buffer, which the tensors keep alive together.
py::list result_lists(std::unique_ptr<GatherResult> result) {
  const GatherResult& gathered = *result;
  const std::size_t n = gathered.size();
  const auto world = static_cast<std::size_t>(gathered.world_size());
  std::byte* base = gathered.buffer().data();
  // Torch's own storage where torch's allocator gave the buffer (the result goes when this
  // returns; the tensors keep the block), else a storage that keeps the result.
  const std::optional<c10::Storage> block = torch_storage_of(gathered.buffer().allocation());
  const c10::Storage storage =
      block ? *block
            : adopt_storage(std::move(result), base, gathered.buffer().size(),
                            gathered.buffer().device());
  py::list out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::span<const TensorView> views = gathered[i];
    py::list per_rank(world);
    for (std::size_t r = 0; r < world; ++r) {
      PyObject* t = THPVariable_Wrap(tensor_over(storage, base, views[r]));
      if (t == nullptr) {
        throw py::error_already_set();
      }
      PyList_SET_ITEM(per_rank.ptr(), static_cast<Py_ssize_t>(r), t);  // steals the reference
    }
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), per_rank.release().ptr());
  }
  return out;
}

// The options of a collective call; a bad strategy name or timeout fails the call on every rank.
PlanOptions collective_plan_options(Communicator& comm, const std::string& strategy, bool preflight,
                                    std::optional<double> timeout, const CallShape& call) {
  try {
    return plan_options(strategy, preflight, timeout);
  } catch (const InvalidArgument& e) {
    fail_call(comm, {LocalError::kValue, 0, e.what()}, call);
  }
}

py::object foreach_all_gather_py(py::handle params, const CommPtr& comm_ptr, py::handle hint_obj,
                                 std::optional<double> timeout, bool preflight,
                                 const std::string& strategy, bool async_op,
                                 const std::string& stage) {
  Communicator& comm = *comm_ptr;
  const CallShape shape{Operation::kForeachAllGather,
                        header_exchanged(hint_given(hint_obj), preflight), std::nullopt,
                        Stage(stage)};
  const ForeachAllGatherOptions options{
      .timeout = timeout_or_fail(comm, timeout, shape),
      .preflight = preflight,
      .strategy = collective_plan_options(comm, strategy, preflight, timeout, shape).strategy,
      .stage = shape.stage};
  auto in = std::make_shared<CallInputs>(
      parse_call_or_fail(params, hint_obj, comm, Operation::kForeachAllGather, options));
  if (async_op) {
    Work<GatherResult> work = start_foreach_all_gather(in->params.views, comm, in->hint, options);
    auto result = [in](GatherResult r) -> py::object {
      in->params.tensors.clear();
      return result_lists(std::make_unique<GatherResult>(std::move(r)));
    };
    return py::cast(std::make_unique<PyWork>(comm_ptr, std::move(work), result, py::none()));
  }
  auto result = std::make_unique<GatherResult>();
  call_interruptible(
      [&] { *result = foreach_all_gather(in->params.views, comm, in->hint, options); });
  in->params.tensors.clear();
  return result_lists(std::move(result));
}

py::object buffer_or_none(const at::Tensor& buffer) {
  return buffer.defined() ? py::cast(buffer) : py::none();
}

py::object dtype_to_py(DType dtype) {
  return py::reinterpret_borrow<py::object>(
      reinterpret_cast<PyObject*>(torch::getTHPDtype(scalar_type_of(dtype))));
}

ShardSpec make_shard_spec(py::handle dtype, Shape full_shape, int shard_dim,
                          std::optional<std::vector<std::int64_t>> sizes,
                          std::int64_t padded_size) {
  return ShardSpec{.dtype = dtype_from_py(dtype, "ShardSpec dtype"),
                   .full_shape = std::move(full_shape),
                   .shard_dim = shard_dim,
                   .sizes = sizes.value_or(std::vector<std::int64_t>{}),
                   .padded_size = padded_size};
}

std::unique_ptr<PyAllGatherPlan> make_all_gather_plan(
    const std::vector<py::handle>& dtypes,
    const std::vector<std::vector<Shape>>& shapes_across_group, int rank,
    const std::string& strategy, bool preflight, std::optional<double> timeout,
    const std::vector<std::optional<std::string>>& quantize, const std::string& stage) {
  std::vector<DType> wire;
  wire.reserve(dtypes.size());
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    wire.push_back(dtype_from_py(dtypes[i], "dtypes[" + std::to_string(i) + "]"));
  }
  PlanOptions options = plan_options(strategy, preflight, timeout);
  options.stage = Stage(stage);
  return std::make_unique<PyAllGatherPlan>(
      AllGatherPlan(wire, shapes_across_group, rank, options, quant_formats(quantize)), options);
}

py::list make_thread_group_py(int world_size) {
  std::vector<std::unique_ptr<Communicator>> comms = make_thread_group(world_size);
  py::list out;
  for (auto& c : comms) {
    out.append(py::cast(CommPtr(std::move(c))));
  }
  return out;
}

// The communicator may hold the last reference to its c10d group, and destroying a Gloo group
// joins its worker threads, one of which may be releasing a Python-owned tensor and so waits
// for the GIL: deleting it with the GIL held deadlocked at the end of a benchmark run. Torch's
// own binding holds ProcessGroup objects the same way (released without the GIL).
void delete_without_gil(Communicator* comm) {
  if (PyGILState_Check() != 0) {
    const py::gil_scoped_release release;
    delete comm;
  } else {
    delete comm;
  }
}

// Collective over the group: built with the GIL released (the peers may be Python threads of
// this process), within `timeout` seconds (None: the default), and interruptible by Ctrl-C.
CommPtr process_group_communicator(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   const std::string& device, bool p2p, bool host_mailbox,
                                   std::optional<double> timeout) {
  const std::chrono::milliseconds setup = to_timeout(timeout).value_or(kDefaultTimeout);
  const c10::Device dev(device);
  std::unique_ptr<Communicator> comm;
  call_interruptible([&] {
    comm = make_torch_communicator(
        group, dev, {.p2p = p2p, .host_mailbox = host_mailbox, .setup_timeout = setup});
  });
  return {comm.release(), &delete_without_gil};
}

#ifdef SHARDGATHER_PYTHON_WITH_MPI
bool mpi_is_initialized() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized != 0 && finalized == 0;
}

// MPI_Init_thread, only when asked (the library itself never initialises MPI). Returns whether
// this call initialised it (then the caller finalises it, see shardgather.mpi_init).
bool mpi_init() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized != 0) {
    return false;
  }
  int provided = 0;
  // SERIALIZED: Python threads may take turns driving a communicator.
  if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    throw CommunicationError("MPI_Init_thread failed");
  }
  return true;
}

void mpi_finalize() {
  if (mpi_is_initialized()) {
    MPI_Finalize();
  }
}

// MPI_Comm is a pointer in Open MPI and an integer in MPICH.
template <typename Comm>
Comm comm_from_handle(std::uintptr_t handle) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(handle);
  } else {
    return static_cast<Comm>(handle);
  }
}

// `handle`: mpi4py's MPI._handleof(comm); none: MPI_COMM_WORLD.
CommPtr mpi_communicator(std::optional<std::uintptr_t> handle) {
  if (!mpi_is_initialized()) {
    throw InvalidArgument(
        "MPI is not initialised: import mpi4py.MPI first, or call shardgather.mpi_init()");
  }
  const MPI_Comm comm = handle ? comm_from_handle<MPI_Comm>(*handle) : MPI_COMM_WORLD;
  const py::gil_scoped_release release;  // MPI_Comm_dup is collective
  return make_mpi_communicator(comm);
}
#endif

void register_exceptions(py::module_& m) {
  // Translators run newest first, so bases are registered before the classes derived from them.
  // Several classes also derive from the built-in exception their callers expect.
  const py::handle runtime(PyExc_RuntimeError);
  auto& base = py::register_exception<Error>(m, "ShardgatherError", runtime);
  auto& invalid = py::register_exception<InvalidArgument>(
      m, "InvalidArgumentError", py::make_tuple(base, py::handle(PyExc_ValueError)));
  py::register_exception<InvalidType>(m, "InvalidTypeError",
                                      py::make_tuple(invalid, py::handle(PyExc_TypeError)));
  py::register_exception<CountOverflow>(m, "CountOverflowError", invalid);
  py::register_exception<Mismatch>(m, "MismatchError", base);
  py::register_exception<OutOfMemory>(m, "OutOfMemoryError",
                                      py::make_tuple(base, py::handle(PyExc_MemoryError)));
  auto& comm = py::register_exception<CommunicationError>(m, "CommunicationError", base);
  py::register_exception<Timeout>(m, "CollectiveTimeout",
                                  py::make_tuple(comm, py::handle(PyExc_TimeoutError)));
  py::register_exception<Aborted>(m, "AbortedError", comm);
  py::register_exception<RemoteError>(m, "RemoteError", comm);
  py::register_exception<CommAborted>(m, "CommAbortedError", comm);
}

void register_attributes(py::module_& m) {
  m.doc() = "shardgather's C++ core; use the shardgather package, not this module";
  m.attr("__version__") = SHARDGATHER_VERSION_STRING;
  // An "auto" plan's first executions that measure the window against direct
  // (shardgather/strategy.h).
  m.attr("AUTO_TRIAL_RUNS") = kAutoTrialRuns;
  m.attr("_torch_version") = SHARDGATHER_TORCH_VERSION;
#ifdef SHARDGATHER_PYTHON_WITH_MPI
  m.attr("_has_mpi") = true;
#else
  m.attr("_has_mpi") = false;
#endif
}

void barrier(Communicator& c, std::optional<double> timeout) {
  const auto deadline = c.deadline_after(to_timeout(timeout).value_or(c.timeout()));
  // In the communicator's operation order: after every started call, never beside one.
  call_interruptible([&] { run_in_order(c, [&] { c.barrier(deadline); }); });
}

std::string communicator_repr(const Communicator& c) {
  return "<shardgather.Communicator " + std::string(c.backend_name()) + " rank " +
         std::to_string(c.rank()) + " of " + std::to_string(c.size()) + ">";
}

void register_communicator(py::module_& m) {
  py::class_<Communicator, CommPtr>(m, "Communicator",
                                    "One rank's end of a group (threads, MPI or a torch group). "
                                    "One thread drives it at a time; abort() from any.")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("backend_name",
                             [](const Communicator& c) { return std::string(c.backend_name()); })
      .def_property(
          "timeout",
          [](const Communicator& c) { return std::chrono::duration<double>(c.timeout()).count(); },
          [](Communicator& c, double seconds) {
            c.set_timeout(to_timeout(seconds).value_or(kDefaultTimeout));
          },
          "Default deadline of a call, in seconds")
      .def_property_readonly("is_poisoned", &Communicator::is_poisoned)
      .def_property_readonly("collectives_issued", &Communicator::collectives_issued)
      .def_property_readonly("calls_issued", &Communicator::calls_issued,
                             "Operations made on this communicator (one per call, whatever its "
                             "collectives)")
      .def_property_readonly("ranks_on_host", &Communicator::ranks_on_host,
                             "How many ranks of the group share this rank's host")
      .def_property_readonly(
          "hosts",
          [](const Communicator& c) {
            return std::vector<int>(c.hosts().begin(), c.hosts().end());
          },
          "hosts[r]: rank r's host, numbered in the order of each host's lowest rank (empty "
          "where the backend cannot tell)")
      .def_property_readonly(
          "uses_host_mailbox", [](const Communicator& c) { return torch_uses_host_mailbox(c); },
          "Whether small exchanges (the pre-flight header) go through shared memory on this "
          "host instead of the backend")
      .def("barrier", &barrier, py::arg("timeout") = py::none())
      .def("abort", &Communicator::abort)
      .def("__repr__", &communicator_repr);
}

void register_work(py::module_& m) {
  py::class_<PyWork>(m, "Work",
                     "The handle of an async_op=True call: wait() returns what the blocking call "
                     "returns (or raises its error, on every rank); is_completed() polls.")
      .def("wait", &PyWork::wait)
      .def("is_completed", &PyWork::is_completed);
  // The Work of an operation that runs on a Python thread of its own (WeightSync.start): the
  // thread calls `done()` when it has ended, and wait() then returns `result()` (which raises
  // what the thread raised). Ctrl-C in wait() aborts `comm`, as for any Work: the thread's
  // rounds on it end with Aborted.
  m.def(
      "_thread_work",
      [](const CommPtr& comm, py::function result) {
        auto state = std::make_shared<shardgather::detail::WorkResult<bool>>();
        state->value = true;
        // The last reference may go on the thread that calls done(): the state holds no Python
        // object, so that needs no GIL.
        py::cpp_function done([state] { shardgather::detail::WorkState::finish(state, nullptr); });
        auto work = std::make_unique<PyWork>(
            comm, Work<bool>(std::move(state)),
            [result = std::move(result)](bool /*ended*/) { return result(); }, py::none());
        return py::make_tuple(py::cast(std::move(work)), std::move(done));
      },
      py::arg("comm"), py::arg("result"));
}

std::string shard_spec_repr(const ShardSpec& s) {
  return "ShardSpec(dtype=" + std::string(py::str(dtype_to_py(s.dtype))) +
         ", full_shape=" + std::string(py::str(py::tuple(py::cast(s.full_shape)))) +
         ", shard_dim=" + std::to_string(s.shard_dim) +
         ", sizes=" + std::string(py::str(py::cast(s.sizes))) +
         ", padded_size=" + std::to_string(s.padded_size) + ")";
}

void register_shard_spec(py::module_& m) {
  py::class_<ShardSpec>(m, "ShardSpec",
                        "How one parameter is sharded: full shape, shard dim (negative allowed), "
                        "per-rank sizes (None: torch.chunk) and the padded local size (0: none)")
      .def(py::init(&make_shard_spec), py::arg("dtype"), py::arg("full_shape"),
           py::arg("shard_dim") = 0, py::arg("sizes") = py::none(), py::arg("padded_size") = 0)
      .def_property_readonly("dtype", [](const ShardSpec& s) { return dtype_to_py(s.dtype); })
      .def_property_readonly("full_shape",
                             [](const ShardSpec& s) { return py::tuple(py::cast(s.full_shape)); })
      .def_readonly("shard_dim", &ShardSpec::shard_dim)
      .def_readonly("sizes", &ShardSpec::sizes)
      .def_readonly("padded_size", &ShardSpec::padded_size)
      .def("__repr__", &shard_spec_repr);
  m.def("chunk_sizes", &chunk_sizes, py::arg("full"), py::arg("world_size"));
  m.def(
      "set_device_wait", [](const std::string& mode) { set_device_wait(parse_device_wait(mode)); },
      py::arg("mode"),
      "When calls on CUDA tensors return, process-wide: \"stream\" (the default, c10d's NCCL "
      "semantics: once enqueued on torch's current stream; Work.wait() makes the current stream "
      "wait) or \"host\" (the host also waits until the GPU ran the call, within its timeout). "
      "SHARDGATHER_DEVICE_WAIT sets the first value.");
  m.def(
      "device_wait", [] { return std::string(device_wait_name(device_wait())); },
      "The mode set_device_wait set (\"stream\" or \"host\").");
}

py::object unshard_call(py::handle shards, const CommPtr& comm, const std::vector<ShardSpec>& specs,
                        const std::string& strategy, bool preflight, std::optional<double> timeout,
                        bool async_op, std::optional<int> dst, const std::string& stage) {
  const CallShape call{Operation::kUnshard, preflight, {}, Stage(stage)};
  PlanOptions options = collective_plan_options(*comm, strategy, preflight, timeout, call);
  options.dst = dst.value_or(-1);  // a rank outside the group fails the call on every rank
  options.stage = call.stage;
  return unshard_py(shards, comm, specs, options, async_op);
}

// After ShardSpec: a signature names the Python class only of a type registered before it.
void register_one_shot_calls(py::module_& m) {
  m.def("foreach_all_gather", &foreach_all_gather_py, py::arg("params"), py::arg("comm"),
        py::arg("params_shapes_across_group") = py::none(), py::arg("timeout") = py::none(),
        py::arg("preflight") = true, py::arg("strategy") = "auto", py::arg("async_op") = false,
        py::arg("stage") = "");
  m.def("unshard", &unshard_call, py::arg("shards"), py::arg("comm"), py::arg("specs"),
        py::arg("strategy") = "auto", py::arg("preflight") = true, py::arg("timeout") = py::none(),
        py::arg("async_op") = false, py::arg("dst") = py::none(), py::arg("stage") = "");
}

std::unique_ptr<PyAllGatherPlan> create_all_gather_plan(py::handle params, Communicator& comm,
                                                        py::handle hint,
                                                        const std::string& strategy, bool preflight,
                                                        std::optional<double> timeout) {
  const CallShape call{Operation::kPlanCreate, header_exchanged(!hint.is_none(), preflight), {}};
  return PyAllGatherPlan::create(params, comm, hint,
                                 collective_plan_options(comm, strategy, preflight, timeout, call));
}

// `self` travels with the call: a started execution keeps its plan alive until waited for.
py::object execute_all_gather_plan(const py::object& self, py::handle params, const CommPtr& comm,
                                   py::handle out, bool async_op, py::handle scales,
                                   py::handle returned) {
  return self.cast<PyAllGatherPlan&>().execute(params, comm, out, async_op, scales, returned, self);
}

void register_all_gather_plan(py::module_& m) {
  using P = PyAllGatherPlan;
  py::class_<P>(m, "AllGatherPlan")
      .def(py::init(&make_all_gather_plan), py::arg("dtypes"), py::arg("shapes_across_group"),
           py::arg("rank"), py::arg("strategy") = "auto", py::arg("preflight") = true,
           py::arg("timeout") = py::none(),
           py::arg("quantize") = std::vector<std::optional<std::string>>{}, py::arg("stage") = "")
      .def_static("create", &create_all_gather_plan, py::arg("params"), py::arg("comm"),
                  py::arg("params_shapes_across_group") = py::none(), py::arg("strategy") = "auto",
                  py::arg("preflight") = true, py::arg("timeout") = py::none())
      .def("execute", &execute_all_gather_plan, py::arg("params"), py::arg("comm"),
           py::arg("out") = py::none(), py::arg("async_op") = false, py::arg("scales") = py::none(),
           py::arg("returned") = py::none())
      .def_property_readonly("quantized", [](const P& p) { return p.plan().quantized(); })
      .def_property_readonly("output_bytes", [](const P& p) { return p.plan().output_bytes(); })
      .def_property_readonly("world_size", [](const P& p) { return p.plan().layout().world_size; })
      .def_property_readonly("rank", [](const P& p) { return p.plan().rank(); })
      .def_property_readonly("timeout",
                             [](const P& p) { return seconds_or_none(p.plan().options().timeout); })
      .def_property_readonly("num_tensors",
                             [](const P& p) { return p.plan().layout().num_tensors; })
      .def_property_readonly(
          "strategy",
          [](const P& p) { return std::string(strategy_name(p.plan().options().strategy)); })
      .def_property_readonly("last_stats", [](const P& p) { return stats_dict(p.last_stats()); })
      .def_property_readonly("buffer", [](const P& p) { return buffer_or_none(p.buffer()); });
}

std::unique_ptr<PyUnshardPlan> make_unshard_plan(
    const std::vector<ShardSpec>& specs, int world_size, int rank, const std::string& strategy,
    bool preflight, std::optional<double> timeout, std::optional<int> dst,
    const std::vector<std::optional<std::string>>& quantize, const std::string& stage) {
  PlanOptions options = plan_options(strategy, preflight, timeout);
  options.stage = Stage(stage);
  return std::make_unique<PyUnshardPlan>(
      UnshardPlan(specs, world_size, rank, options, dst.value_or(-1), quant_formats(quantize)),
      options);
}

py::object execute_unshard_plan(const py::object& self, py::handle shards, const CommPtr& comm,
                                std::optional<py::handle> outputs, bool async_op, py::handle scales,
                                py::handle returned) {
  return self.cast<PyUnshardPlan&>().execute(shards, comm, outputs, async_op, scales, returned,
                                             self);
}

std::vector<ShardSpec> unshard_plan_specs(const PyUnshardPlan& p) {
  std::vector<ShardSpec> specs;
  for (std::size_t i = 0; i < p.plan().size(); ++i) {
    specs.push_back(p.plan().spec(i));
  }
  return specs;
}

void register_unshard_plan(py::module_& m) {
  using P = PyUnshardPlan;
  py::class_<P>(m, "UnshardPlan")
      .def(py::init(&make_unshard_plan), py::arg("specs"), py::arg("world_size"), py::arg("rank"),
           py::arg("strategy") = "auto", py::arg("preflight") = true,
           py::arg("timeout") = py::none(), py::arg("dst") = py::none(),
           py::arg("quantize") = std::vector<std::optional<std::string>>{}, py::arg("stage") = "")
      .def("execute", &execute_unshard_plan, py::arg("shards"), py::arg("comm"),
           py::arg("outputs") = py::none(), py::arg("async_op") = false,
           py::arg("scales") = py::none(), py::arg("returned") = py::none())
      .def_property_readonly("quantized", [](const P& p) { return p.plan().quantized(); })
      .def(
          "shard_shape",
          [](const P& p, int rank, std::size_t i) {
            return py::tuple(py::cast(p.plan().shard_shape(rank, i)));
          },
          py::arg("rank"), py::arg("index"))
      .def_property_readonly("specs", &unshard_plan_specs)
      .def_property_readonly("output_bytes", [](const P& p) { return p.plan().output_bytes(); })
      .def_property_readonly("receives", [](const P& p) { return p.plan().receives(); })
      .def_property_readonly("world_size", [](const P& p) { return p.plan().world_size(); })
      .def_property_readonly("timeout",
                             [](const P& p) { return seconds_or_none(p.options().timeout); })
      .def_property_readonly(
          "strategy", [](const P& p) { return std::string(strategy_name(p.options().strategy)); })
      .def_property_readonly("last_stats", [](const P& p) { return stats_dict(p.last_stats()); })
      .def_property_readonly("buffer", [](const P& p) { return buffer_or_none(p.buffer()); });
}

std::unique_ptr<PyUnshardStream> make_unshard_stream(
    const std::vector<ShardSpec>& specs, int world_size, int rank, std::uint64_t bucket_bytes,
    int prefetch, std::optional<int> dst, const std::string& strategy,
    std::optional<double> timeout, const std::vector<std::optional<std::string>>& quantize) {
  StreamOptions options;
  options.bucket_bytes = bucket_bytes;
  options.prefetch = prefetch;
  options.dst = dst.value_or(-1);
  options.plan = plan_options(strategy, true, timeout);
  return std::make_unique<PyUnshardStream>(specs, world_size, rank, options,
                                           quant_formats(quantize));
}

void register_unshard_stream(py::module_& m) {
  using S = PyUnshardStream;
  py::class_<S>(m, "UnshardStream")
      .def(py::init(&make_unshard_stream), py::arg("specs"), py::arg("world_size"), py::arg("rank"),
           py::arg("bucket_bytes"), py::arg("prefetch") = 1, py::arg("dst") = py::none(),
           py::arg("strategy") = "auto", py::arg("timeout") = py::none(),
           py::arg("quantize") = std::vector<std::optional<std::string>>{})
      .def("begin", &S::begin, py::arg("shards"), py::arg("comm"))
      .def("next", &S::next)
      .def("fail", &S::fail, py::arg("message"), py::arg("is_type_error") = false)
      .def_property_readonly("running", &S::running)
      .def_property_readonly("num_buckets", [](const S& s) { return s.stream().num_buckets(); })
      .def_property_readonly("buffer_bytes", [](const S& s) { return s.stream().buffer_bytes(); })
      .def("bucket_params", [](const S& s, std::size_t b) {
        const std::size_t first = s.stream().bucket_first(b);
        return py::make_tuple(first, first + s.stream().bucket_plan(b).size());
      });
}

// A local error in a Python-level wrapper (full_tensors, streams, the export, a compound
// operation's step) fails the call the peers are making (`op`, as operation_name() spells it,
// and `stage`) with this message, instead of leaving them waiting for their deadline. The class
// every rank raises: `code` (error_code_name()'s), else InvalidType or InvalidArgument.
void fail_call_py(const CommPtr& comm, const std::string& op, const std::string& message,
                  bool is_type_error, bool preflight, std::optional<double> timeout,
                  const std::string& stage, const std::string& code) {
  const Operation operation = operation_named(op);
  CallShape call{operation, preflight, {}, Stage(stage)};
  call.timeout = timeout_or_fail(*comm, timeout, call);
  fail_call(*comm,
            !code.empty()   ? error_code_named(code)
            : is_type_error ? ErrorCode::kInvalidType
                            : ErrorCode::kInvalidArgument,
            message, call);
}

// Entry points of the Python package's own plumbing and of the tests, not of its users.
void register_hooks(py::module_& m) {
  m.def("_plan_regions_runs", &plan_regions_runs,
        "How many times the region planner ran in this process (a plan plans when built).");
  m.def("_fail_call", &fail_call_py, py::arg("comm"), py::arg("op"), py::arg("message"),
        py::arg("is_type_error") = false, py::arg("preflight") = true,
        py::arg("timeout") = py::none(), py::arg("stage") = "", py::arg("code") = "");
  m.def("_make_thread_group", &make_thread_group_py, py::arg("world_size"));
  // Whether two elements of a tensor share memory (shardgather::overlaps_itself): the Python
  // entry points that write into caller tensors refuse those before anything moves.
  m.def(
      "_overlaps_itself",
      [](const at::Tensor& t) {
        TensorView view;
        view.shape.assign(t.sizes().begin(), t.sizes().end());
        view.strides.assign(t.strides().begin(), t.strides().end());
        return overlaps_itself(view);
      },
      py::arg("tensor"));
  // For tests: the process's device-gather request (SHARDGATHER_DEVICE_GATHER's), by name.
  m.def("_set_device_gather",
        [](const std::string& name) { set_device_gather(parse_device_gather(name)); });
  m.def("_process_group_communicator", &process_group_communicator, py::arg("group"),
        py::arg("device") = "cpu", py::arg("p2p") = true, py::arg("host_mailbox") = true,
        py::arg("timeout") = py::none());
#ifdef SHARDGATHER_PYTHON_WITH_MPI
  m.def("_mpi_init", &mpi_init);
  m.def("_mpi_finalize", &mpi_finalize);
  m.def("_mpi_is_initialized", &mpi_is_initialized);
  m.def("_mpi_communicator", &mpi_communicator, py::arg("handle") = py::none());
#endif
}

}  // namespace

}  // namespace shardgather::python

// The order matters only where a signature names a class: that class is registered first.
PYBIND11_MODULE(_shardgather, m) {
  using namespace shardgather::python;  // NOLINT(google-build-using-namespace)
  use_torch_device_allocator();
  register_exceptions(m);
  register_attributes(m);
  register_communicator(m);
  register_work(m);
  register_shard_spec(m);
  register_one_shot_calls(m);
  register_all_gather_plan(m);
  register_unshard_plan(m);
  register_reshard_plan(m);
  register_unshard_stream(m);
  register_quantize(m);
  register_delta(m);
  register_round_call(m);
  register_hooks(m);
}
