#include "plans.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/Functions.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include "params.h"
#include "torch_allocator.h"
#include "torch_tensors.h"
#include "work.h"

#include "shardgather/errors.h"
#include "shardgather/quantize.h"

namespace py = pybind11;

namespace shardgather::python {

namespace {

// Anything but a multiple of 8 would leave some dtype's views at a fractional element offset.
constexpr std::uintptr_t kOutAlignment = 8;

// A plan's execution (and unshard) carries its shapes as a hint would: peers are told only when
// they will read a header, i.e. when the pre-flight is on.
[[noreturn]] void fail_locally(Communicator& comm, const LocalError& error, Operation op,
                               const PlanOptions& options) {
  fail_call(comm, error, {op, options.preflight, options.timeout, options.stage});
}

py::object wrap(at::Tensor t) {
  PyObject* obj = THPVariable_Wrap(std::move(t));
  if (obj == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(obj);
}

// One torch tensor per view, each a view of `storage` (the views point into it).
std::vector<py::object> wrap_views(const c10::Storage& storage,
                                   const std::vector<TensorView>& views) {
  const auto* base = static_cast<const std::byte*>(storage.data());
  std::vector<py::object> tensors;
  tensors.reserve(views.size());
  for (const TensorView& v : views) {
    tensors.push_back(wrap(tensor_over(storage, base, v)));
  }
  return tensors;
}

// A uint8 tensor of `bytes` bytes owned by torch's allocator (64-byte aligned).
at::Tensor new_buffer(std::uint64_t bytes) {
  return at::empty({static_cast<std::int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
}

std::optional<LocalError> check_out(const at::Tensor& out) {
  if (!out.device().is_cpu() || out.layout() != c10::kStrided || !out.is_contiguous()) {
    return LocalError{LocalError::kValue, 0,
                      "out must be a contiguous CPU tensor, got one on " + out.device().str() +
                          (out.is_contiguous() ? "" : " (not contiguous)")};
  }
  const auto base = reinterpret_cast<std::uintptr_t>(out.storage().data());
  const auto data = reinterpret_cast<std::uintptr_t>(out.data_ptr());
  if ((data - base) % kOutAlignment != 0) {
    return LocalError{LocalError::kValue, 0,
                      "out must start at a multiple of 8 bytes into its storage"};
  }
  return std::nullopt;
}

// A new list of items[0 .. count).
py::list list_of(const py::object* items, std::size_t count) {
  py::list list(count);
  for (std::size_t k = 0; k < count; ++k) {
    PyList_SET_ITEM(list.ptr(), static_cast<Py_ssize_t>(k), items[k].inc_ref().ptr());
  }
  return list;
}

// A new list of the first `count` items of the sequence `seq` (whatever sequence the caller
// passed its outputs in, execute returns them as a list).
py::list first_items(py::handle seq, std::size_t count) {
  const auto items = py::reinterpret_borrow<py::sequence>(seq);
  py::list list(count);
  for (std::size_t i = 0; i < count; ++i) {
    list[i] = items[i];
  }
  return list;
}

// Whether `list` is a list of exactly items[0 .. count), by identity.
bool list_holds(PyObject* list, const py::object* items, std::size_t count) {
  if (!PyList_CheckExact(list) || static_cast<std::size_t>(PyList_GET_SIZE(list)) != count) {
    return false;
  }
  for (std::size_t k = 0; k < count; ++k) {
    if (PyList_GET_ITEM(list, static_cast<Py_ssize_t>(k)) != items[k].ptr()) {
      return false;
    }
  }
  return true;
}

// Drops the references parse_params_into took once the call is over (success or not), so a
// plan never keeps the caller's arguments alive between executions; the vectors stay for reuse.
class ArgumentsHeld {
 public:
  ArgumentsHeld(Params& inputs, Params& outputs, Params& scales)
      : inputs_(inputs), outputs_(outputs), scales_(scales) {}
  ArgumentsHeld(const ArgumentsHeld&) = delete;
  ArgumentsHeld& operator=(const ArgumentsHeld&) = delete;
  ArgumentsHeld(ArgumentsHeld&&) = delete;
  ArgumentsHeld& operator=(ArgumentsHeld&&) = delete;
  ~ArgumentsHeld() {
    inputs_.tensors.clear();
    outputs_.tensors.clear();
    scales_.tensors.clear();
  }

 private:
  Params& inputs_;
  Params& outputs_;
  Params& scales_;
};

// The bytes of `t`; none for an undefined tensor (a rank that does not receive has no buffer).
std::span<std::byte> bytes_of(const at::Tensor& t) {
  return {static_cast<std::byte*>(t.defined() ? t.data_ptr() : nullptr),
          t.defined() ? t.nbytes() : 0};
}

}  // namespace

py::list ResultLists::get(const std::vector<py::object>& tensors, std::size_t per_list) {
  if (!lists_ || !intact(tensors, per_list)) {
    if (per_list == 0) {
      lists_ = list_of(tensors.data(), tensors.size());
    } else {
      const std::size_t n = tensors.size() / per_list;
      py::list outer(n);
      for (std::size_t i = 0; i < n; ++i) {
        PyList_SET_ITEM(outer.ptr(), static_cast<Py_ssize_t>(i),
                        list_of(&tensors[i * per_list], per_list).release().ptr());
      }
      lists_ = std::move(outer);
    }
  }
  return py::reinterpret_borrow<py::list>(lists_);
}

bool ResultLists::intact(const std::vector<py::object>& tensors, std::size_t per_list) const {
  if (per_list == 0) {
    return list_holds(lists_.ptr(), tensors.data(), tensors.size());
  }
  const std::size_t n = tensors.size() / per_list;
  if (!PyList_CheckExact(lists_.ptr()) ||
      static_cast<std::size_t>(PyList_GET_SIZE(lists_.ptr())) != n) {
    return false;
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (!list_holds(PyList_GET_ITEM(lists_.ptr(), static_cast<Py_ssize_t>(i)),
                    &tensors[i * per_list], per_list)) {
      return false;
    }
  }
  return true;
}

py::object seconds_or_none(std::optional<std::chrono::milliseconds> timeout) {
  return timeout ? py::cast(std::chrono::duration<double>(*timeout).count()) : py::none();
}

DType dtype_from_py(py::handle dtype, const std::string& what) {
  if (!THPDtype_Check(dtype.ptr())) {
    throw py::type_error(what + " must be a torch.dtype, got " +
                         std::string(Py_TYPE(dtype.ptr())->tp_name));
  }
  return dtype_of(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type, what);
}

py::dict stats_dict(const ExecStats& stats) {
  py::dict d;
  d["strategy"] = std::string(strategy_name(stats.strategy));
  d["preflight_collectives"] = stats.preflight_collectives;
  d["payload_collectives"] = stats.payload_collectives;
  d["setup_collectives"] = stats.setup_collectives;
  d["why"] = std::string(stats.why);
  d["staged_bytes"] = stats.staged_bytes;
  return d;
}

PlanOptions plan_options(const std::string& strategy, bool preflight,
                         std::optional<double> timeout) {
  return PlanOptions{.timeout = to_timeout(timeout),
                     .preflight = preflight,
                     .strategy = parse_strategy(strategy),
                     .copy_threads = 0};
}

template <typename Plan>
std::unique_lock<std::mutex> PyPlan<Plan>::claim(const Communicator& comm) {
  std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
  if (!lock.owns_lock()) {
    throw std::runtime_error(std::string(names_.plan) +
                             ".execute: the plan is being executed by another thread (a plan "
                             "holds scratch space: use one plan per thread)");
  }
  // The last started execution still running on another communicator is the same conflict:
  // that one's queue does not order this call.
  if (started_ && started_on_ != &comm && !started_->wait_for(std::chrono::milliseconds(0))) {
    throw std::runtime_error(std::string(names_.plan) +
                             ".execute: an execution of this plan started on another "
                             "communicator is still running (a plan runs one at a time)");
  }
  return lock;
}

template <typename Plan>
void PyPlan<Plan>::fail_locally(Communicator& comm, const LocalError& error) const {
  shardgather::python::fail_locally(comm, error, names_.op, options_);
}

template <typename Plan>
void PyPlan<Plan>::parse_or_fail(py::handle args, const char* what, Params& into,
                                 Communicator& comm) const {
  parse_params_into(args, what, into);
  if (into.error.kind != LocalError::kNone) {
    fail_locally(comm, into.error);
  }
}

template <typename Plan>
template <typename Prepare>
py::object PyPlan<Plan>::run(py::handle inputs, const std::shared_ptr<Communicator>& comm_ptr,
                             bool async_op, const py::object& self, Prepare prepare) {
  Communicator& comm = *comm_ptr;
  const auto lock = claim(comm);
  const auto started = async_op ? std::make_shared<Parsed>() : nullptr;
  Parsed& parsed = async_op ? *started : parsed_;
  const ArgumentsHeld held(parsed_.inputs, parsed_.outputs, parsed_.scales);
  parse_or_fail(inputs, names_.inputs, parsed.inputs, comm);
  auto output = prepare(parsed, comm);
  if (async_op) {
    return start(comm_ptr, started, std::move(output), self);
  }
  const std::span<const TensorView> views(parsed.inputs.views);
  ExecStats stats;
  call_interruptible([&] {
    stats = output.into([&](auto... into) { return plan_.execute(views, comm, into...); });
  });
  last_ = stats;  // with the GIL, as a started execution's wait() writes it
  return output.results();
}

template <typename Plan>
template <typename Output>
py::object PyPlan<Plan>::start(const std::shared_ptr<Communicator>& comm,
                               std::shared_ptr<Parsed> parsed, Output output,
                               const py::object& self) {
  const std::span<const TensorView> views(parsed->inputs.views);
  Work<ExecStats> work =
      output.into([&](auto... into) { return plan_.start(views, *comm, into...); });
  started_ = work.shared_state();
  started_on_ = comm.get();
  auto finish = [this, parsed = std::move(parsed),
                 results = std::move(output.results)](ExecStats stats) -> py::object {
    last_ = stats;
    parsed->inputs.tensors.clear();
    parsed->outputs.tensors.clear();
    parsed->scales.tensors.clear();
    return results();
  };
  return py::cast(std::make_unique<PyWork>(comm, std::move(work), std::move(finish), self));
}

std::unique_ptr<PyAllGatherPlan> PyAllGatherPlan::create(py::handle params, Communicator& comm,
                                                         py::handle hint_obj,
                                                         const PlanOptions& options) {
  // create() exchanges a header unless a hint is given with the pre-flight off, as does a
  // foreach call with these options: the peers learn of a local error the same way.
  const CallInputs in = parse_call_or_fail(
      params, hint_obj, comm, Operation::kPlanCreate,
      {.timeout = options.timeout, .preflight = options.preflight, .stage = options.stage});
  return call_interruptible([&] {
    return std::make_unique<PyAllGatherPlan>(
        AllGatherPlan::create(in.params.views, comm, in.hint, options), options);
  });
}

py::object PyAllGatherPlan::execute(py::handle params, const std::shared_ptr<Communicator>& comm,
                                    py::handle out, bool async_op, py::handle scales,
                                    py::handle returned, const py::object& self) {
  if (plan_.quantized()) {
    return run(params, comm, async_op, self, [&](Parsed& parsed, Communicator& c) {
      return into_quantized(out, scales, returned, parsed, c);
    });
  }
  return run(params, comm, async_op, self, [&](Parsed& /*parsed*/, Communicator& c) {
    if (!scales.is_none()) {
      fail_locally(c, {LocalError::kValue, 0, "scales given to a plan that quantizes nothing"});
    }
    std::optional<at::Tensor> given;
    if (!out.is_none()) {
      if (!THPVariable_Check(out.ptr())) {
        fail_locally(c, {LocalError::kType, 0,
                         "out must be a torch.Tensor or None, got " +
                             std::string(py::str(py::type::of(out).attr("__name__")))});
      }
      given = py::cast<at::Tensor>(out);
    }
    const at::Tensor dest = target(given, c);
    return PlanOutput{[bytes = bytes_of(dest)](auto method) { return method(bytes); },
                      [this, dest]() -> py::object { return results_over(dest); }};
  });
}

at::Tensor PyAllGatherPlan::target(const std::optional<at::Tensor>& out, Communicator& comm) {
  if (out) {
    if (auto error = check_out(*out)) {
      fail_locally(comm, *error);
    }
    return *out;
  }
  if (!buffer_.defined()) {
    buffer_ = new_buffer(plan_.output_bytes());  // once: every later execution reuses it
  }
  return buffer_;
}

py::list PyAllGatherPlan::results_over(const at::Tensor& target) {
  const bool cached = cached_for_.defined() &&
                      cached_for_.unsafeGetTensorImpl() == target.unsafeGetTensorImpl() &&
                      cached_for_.data_ptr() == target.data_ptr() &&
                      cached_for_.storage().is_alias_of(target.storage());
  if (!cached) {
    cached_for_ = at::Tensor();  // set again only once every view is built
    cached_.clear();
    lists_.reset();
    cached_ = wrap_views(target.storage(), plan_.views(static_cast<std::byte*>(target.data_ptr())));
    cached_for_ = target;
  }
  return lists_.get(cached_, static_cast<std::size_t>(plan_.layout().world_size));
}

py::object PyUnshardPlan::execute(py::handle shards, const std::shared_ptr<Communicator>& comm,
                                  std::optional<py::handle> outputs, bool async_op,
                                  py::handle scales, py::handle returned, const py::object& self) {
  if (plan_.quantized()) {
    return run(shards, comm, async_op, self, [&](Parsed& parsed, Communicator& c) {
      return into_quantized(outputs ? *outputs : py::handle(py::list()), scales, returned, parsed,
                            c);
    });
  }
  return run(shards, comm, async_op, self, [&](Parsed& parsed, Communicator& c) {
    // A rank that does not receive (dst set) takes no outputs and returns an empty list.
    const bool receives = plan_.receives();
    const bool given = receives && outputs && !outputs->is_none();
    py::list result;
    if (!receives) {
      cached_.clear();
    } else if (given) {
      parse_or_fail(*outputs, "outputs", parsed.outputs, c);
      result = first_items(*outputs, parsed.outputs.views.size());
    } else if (!buffer_.defined()) {
      build_buffer();
    }
    const std::span<const TensorView> views(parsed.outputs.views);
    return PlanOutput{
        [given, views, bytes = bytes_of(buffer_)](auto method) {
          return given ? method(views) : method(bytes);
        },
        [this, given, result]() -> py::object { return given ? result : lists_.get(cached_, 0); }};
  });
}

py::object PyReshardPlan::execute(py::handle sources, py::handle destinations,
                                  const std::shared_ptr<Communicator>& comm, bool async_op,
                                  std::optional<Device> device, py::handle scales,
                                  py::handle returned, const py::object& self) {
  return run(sources, comm, async_op, self, [&](Parsed& parsed, Communicator& c) {
    parse_or_fail(destinations, "destinations", parsed.outputs, c);
    parse_scales(scales, parsed, c);
    const py::object result =
        returned.is_none() ? py::object(first_items(destinations, parsed.outputs.views.size()))
                           : py::reinterpret_borrow<py::object>(returned);
    const std::span<const TensorView> views(parsed.outputs.views);
    const std::span<const TensorView> scale_views(parsed.scale_views);
    return PlanOutput{
        [views, scale_views, device](auto method) { return method(views, scale_views, device); },
        [result]() -> py::object { return result; }};
  });
}

template <typename Plan>
void PyPlan<Plan>::parse_scales(py::handle scales, Parsed& parsed, Communicator& comm) const {
  parsed.scale_views.clear();
  if (scales.is_none()) {
    return;
  }
  const auto items = py::reinterpret_borrow<py::sequence>(scales);
  py::list given;
  for (const py::handle item : items) {
    if (!item.is_none()) {
      given.append(item);
    }
  }
  parse_or_fail(given, "scales", parsed.scales, comm);
  std::size_t k = 0;
  for (const py::handle item : items) {
    parsed.scale_views.push_back(item.is_none() ? TensorView{} : parsed.scales.views[k++]);
  }
}

std::vector<QuantFormat> quant_formats(const std::vector<std::optional<std::string>>& names) {
  std::vector<QuantFormat> formats;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto format = names[i] ? quant_format_from_name(*names[i])
                                 : std::optional<QuantFormat>(QuantFormat::kNone);
    if (!format) {
      throw InvalidArgument("quantize[" + std::to_string(i) + "]: unknown format '" + *names[i] +
                            "' (fp8_e4m3_128x128, fp8_e4m3_1x128 or mxfp8)");
    }
    formats.push_back(*format);
  }
  return formats;
}

void PyUnshardPlan::build_buffer() {
  // Kept only when every tensor was built, so a failure here is retried by the next call.
  at::Tensor buffer = new_buffer(plan_.output_bytes());
  cached_ = wrap_views(buffer.storage(), plan_.views(static_cast<std::byte*>(buffer.data_ptr())));
  buffer_ = std::move(buffer);
}

namespace {

// The full tensors over the result's buffer, which they keep alive together.
py::list full_tensors(std::unique_ptr<UnshardResult> result) {
  const std::size_t n = result->size();
  if (n == 0) {
    return py::list();
  }
  // Parameter 0 sits at offset 0 of the result's buffer; the storage covers every view.
  auto* base = static_cast<std::byte*>((*result)[0].data);
  std::uint64_t end = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const TensorView& v = (*result)[i];
    const std::uint64_t bytes = checked_nbytes(v.dtype, v.shape);
    end = std::max<std::uint64_t>(
        end, static_cast<std::uint64_t>(static_cast<std::byte*>(v.data) - base) + bytes);
  }
  const UnshardResult& full = *result;
  const Device device = full.buffer().device();
  // As for a gather's result (module.cc): torch's own storage where torch's allocator gave it.
  const std::optional<c10::Storage> block = torch_storage_of(full.buffer().allocation());
  const c10::Storage storage = block ? *block : adopt_storage(std::move(result), base, end, device);
  py::list out(n);
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = wrap(tensor_over(storage, base, full[i]));
  }
  return out;
}

}  // namespace

py::object unshard_py(py::handle shards, const std::shared_ptr<Communicator>& comm_ptr,
                      const std::vector<ShardSpec>& specs, const PlanOptions& options,
                      bool async_op) {
  Communicator& comm = *comm_ptr;
  auto parsed = std::make_shared<Params>(parse_params(shards, "shards"));
  if (parsed->error.kind != LocalError::kNone) {
    fail_locally(comm, parsed->error, Operation::kUnshard, options);
  }
  if (async_op) {
    Work<UnshardResult> work = start_unshard(parsed->views, comm, specs, options);
    auto result = [parsed](UnshardResult r) -> py::object {
      parsed->tensors.clear();
      return full_tensors(std::make_unique<UnshardResult>(std::move(r)));
    };
    return py::cast(std::make_unique<PyWork>(comm_ptr, std::move(work), result, py::none()));
  }
  auto result = std::make_unique<UnshardResult>();
  call_interruptible([&] { *result = unshard(parsed->views, comm, specs, options); });
  parsed->tensors.clear();
  return full_tensors(std::move(result));
}

}  // namespace shardgather::python
