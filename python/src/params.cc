#include "params.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include "torch_tensors.h"

#include "shardgather/errors.h"

namespace py = pybind11;

namespace shardgather::python {

SignalWatch::SignalWatch() {
  Communicator::set_interrupt_check([this]() noexcept {
    const PyGILState_STATE state = PyGILState_Ensure();
    const int rc = PyErr_CheckSignals();
    if (rc != 0) {
      PyErr_Fetch(&type_, &value_, &traceback_);
    }
    PyGILState_Release(state);
    return rc != 0;
  });
}

SignalWatch::~SignalWatch() {
  Communicator::set_interrupt_check({});
  if (type_ != nullptr) {  // never restored: drop the references (the GIL is held here)
    Py_XDECREF(type_);
    Py_XDECREF(value_);
    Py_XDECREF(traceback_);
  }
}

void SignalWatch::restore() noexcept {
  PyErr_Restore(type_, value_, traceback_);
  type_ = value_ = traceback_ = nullptr;
}

std::optional<std::chrono::milliseconds> to_timeout(std::optional<double> seconds) {
  if (!seconds) {
    return std::nullopt;
  }
  if (!(*seconds >= 0.0) || !std::isfinite(*seconds)) {
    throw InvalidArgument("timeout must be a finite number of seconds >= 0, got " +
                          std::to_string(*seconds));
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(*seconds * 1000.0)));
}

namespace {

// Makes torch's current stream of CUDA device `index` this thread's stream for the call that
// follows (shardgather/device.h), through c10's device-guard registry: no CUDA headers here.
void use_torch_stream(c10::DeviceIndex index) {
  const c10::Device device(c10::kCUDA, index);
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device);
  set_current_cuda_stream(stream.native_handle());
}

// Inputs (not outputs) accept DTensors: what this rank holds of one is its local shard.
bool unwraps_dtensors(const char* what) { return std::string_view(what) != "outputs"; }

// A tensor subclass: a DTensor (torch.distributed.tensor) stands for its local shard; any other
// subclass for itself. Plain tensors never come here. DTensor's module is looked up in
// sys.modules, never imported here: no DTensor exists before it is imported, and an import
// (or a function-local static) would run Python bytecode while other rank threads wait for the
// GIL.
bool unpack_subclass(PyObject* item, at::Tensor& t, std::string& error) {
  try {
    const py::handle obj(item);
    PyObject* module = PyImport_GetModule(py::str("torch.distributed.tensor").ptr());
    if (module == nullptr) {
      PyErr_Clear();
    } else {
      const py::object dtensor = py::reinterpret_steal<py::object>(module).attr("DTensor");
      if (py::isinstance(obj, dtensor)) {
        py::object local = obj.attr("to_local")();
        if (py::hasattr(local, "trigger_wait")) {  // an AsyncCollectiveTensor: its values
          local = local.attr("trigger_wait")();
        }
        t = THPVariable_Unpack(local.ptr());
        return true;
      }
    }
    t = THPVariable_Unpack(item);
    return true;
  } catch (const py::error_already_set& e) {
    error = std::string("its local shard could not be read: ") + e.what();
    return false;
  }
}

}  // namespace

void parse_params_into(py::handle params, const char* what, Params& out) {
  out.tensors.clear();  // keeps the capacity (and every view's shape storage) for the next call
  out.error = {};
  if (!py::isinstance<py::list>(params) && !py::isinstance<py::tuple>(params)) {
    out.views.clear();
    out.error = {LocalError::kType, 0,
                 std::string(what) + " must be a list of torch.Tensor, got " +
                     std::string(py::str(py::type::handle_of(params).attr("__name__")))};
    return;
  }
  const bool is_list = PyList_Check(params.ptr()) != 0;
  const auto n = static_cast<std::size_t>(is_list ? PyList_GET_SIZE(params.ptr())
                                                  : PyTuple_GET_SIZE(params.ptr()));
  out.tensors.reserve(n);
  out.views.resize(n);
  // Messages are built only on failure: this loop runs once per tensor on every call.
  const auto name = [what](std::size_t i) {
    return std::string(what) + "[" + std::to_string(i) + "]";
  };
  const auto fail = [&](LocalError::Kind kind, std::size_t i, std::string message) {
    out.views.resize(i);
    out.error = {kind, i, std::move(message)};
  };
  for (std::size_t i = 0; i < n; ++i) {
    const auto at = static_cast<Py_ssize_t>(i);
    PyObject* item =
        is_list ? PyList_GET_ITEM(params.ptr(), at) : PyTuple_GET_ITEM(params.ptr(), at);
    if (!THPVariable_Check(item)) {
      return fail(
          LocalError::kType, i,
          name(i) + " is a " + std::string(Py_TYPE(item)->tp_name) + ", not a torch.Tensor");
    }
    at::Tensor t;
    if (THPVariable_CheckExact(item) || !unwraps_dtensors(what)) {
      t = THPVariable_Unpack(item);
    } else if (std::string error; !unpack_subclass(item, t, error)) {
      return fail(LocalError::kValue, i, name(i) + ": " + error);
    }
    if (!out.tensors.empty() && t.device() != out.tensors.front().device()) {
      return fail(LocalError::kValue, i,
                  name(i) + " is on " + t.device().str() + " but " + what + "[0] is on " +
                      out.tensors.front().device().str() + ": all tensors must be on one device");
    }
    if (!t.device().is_cpu() && !t.device().is_cuda()) {
      return fail(
          LocalError::kValue, i,
          name(i) + " is on " + t.device().str() + ": shardgather gathers CPU and CUDA tensors");
    }
    if (t.device().is_cuda() && out.tensors.empty()) {
      // The call enqueues on torch's current stream of that device, as torch.distributed does.
      use_torch_stream(t.device().index());
    }
    if (!t.has_storage()) {  // a wrapper subclass (a DTensor among outputs, say)
      return fail(LocalError::kValue, i,
                  name(i) + " is a " + std::string(Py_TYPE(item)->tp_name) +
                      " without storage of its own: pass plain tensors" +
                      (unwraps_dtensors(what) ? "" : " (DTensors are accepted as inputs only)"));
    }
    if (t.layout() != c10::kStrided) {
      return fail(LocalError::kValue, i, name(i) + " is not a strided (dense) tensor");
    }
    const std::optional<DType> dtype = wire_dtype(t.scalar_type());
    if (!dtype) {
      return fail(LocalError::kValue, i, unsupported_dtype_message(t.scalar_type(), name(i)));
    }
    if (t.is_neg()) {
      t = t.resolve_neg();  // a lazily negated view: materialise the values it stands for
    }
    set_view(t, *dtype, out.views[i]);
    out.tensors.push_back(std::move(t));
  }
}

Params parse_params(py::handle params, const char* what) {
  Params out;
  parse_params_into(params, what, out);
  return out;
}

namespace {

// PySequence_Fast of `obj` (a new reference), or null for anything that is not a sequence, a
// str or bytes included; never leaves a Python error set.
py::object fast_sequence(py::handle obj) {
  if (PyUnicode_Check(obj.ptr()) || PyBytes_Check(obj.ptr())) {
    return {};
  }
  PyObject* seq = PySequence_Fast(obj.ptr(), "");
  if (seq == nullptr) {
    PyErr_Clear();
  }
  return py::reinterpret_steal<py::object>(seq);
}

std::string type_name(py::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

}  // namespace

LocalError parse_hint(py::handle hint, ShapesHint& out) {
  out.clear();
  if (hint.is_none()) {
    return {};
  }
  static constexpr const char* kName = "params_shapes_across_group";
  const py::object rows = fast_sequence(hint);
  if (!rows) {
    return {LocalError::kType, 0,
            std::string(kName) +
                " must be a list (per rank) of lists (per tensor) of shapes, got " +
                type_name(hint)};
  }
  const auto at = [](const py::object& seq, std::size_t k) {
    return py::handle(PySequence_Fast_ITEMS(seq.ptr())[k]);
  };
  const auto size = [](const py::object& seq) {
    return static_cast<std::size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
  };
  out.resize(size(rows));
  for (std::size_t r = 0; r < out.size(); ++r) {
    const std::string row_name = std::string(kName) + "[" + std::to_string(r) + "]";
    const py::object row = fast_sequence(at(rows, r));
    if (!row) {
      return {LocalError::kType, 0,
              row_name + " is a " + type_name(at(rows, r)) + ", not a list of shapes"};
    }
    out[r].resize(size(row));
    for (std::size_t i = 0; i < out[r].size(); ++i) {
      const py::object dims = fast_sequence(at(row, i));
      if (!dims) {
        return {LocalError::kType, i,
                row_name + "[" + std::to_string(i) + "] is a " + type_name(at(row, i)) +
                    ", not a shape (a torch.Size, tuple or list of ints)"};
      }
      Shape& shape = out[r][i];
      shape.resize(size(dims));
      for (std::size_t d = 0; d < shape.size(); ++d) {
        const py::handle dim = at(dims, d);
        // int, or anything with __index__ (a numpy integer); never a float.
        const py::object index = py::reinterpret_steal<py::object>(
            PyLong_Check(dim.ptr()) != 0 ? py::handle(dim).inc_ref().ptr()
                                         : PyNumber_Index(dim.ptr()));
        int overflow = 0;
        const long long value = index ? PyLong_AsLongLongAndOverflow(index.ptr(), &overflow) : -1;
        if (!index || overflow != 0 || (value == -1 && PyErr_Occurred() != nullptr)) {
          PyErr_Clear();
          return {index ? LocalError::kValue : LocalError::kType, i,
                  row_name + "[" + std::to_string(i) + "][" + std::to_string(d) + "] is " +
                      (index ? "out of the int64 range" : "a " + type_name(dim) + ", not an int")};
        }
        shape[d] = value;
      }
    }
  }
  return {};
}

bool hint_given(py::handle hint) {
  if (hint.is_none()) {
    return false;
  }
  const Py_ssize_t n = PyObject_Length(hint.ptr());
  if (n < 0) {
    PyErr_Clear();
    return true;
  }
  return n > 0;
}

void fail_call(Communicator& comm, const LocalError& error, const CallShape& call) {
  const ErrorCode code =
      error.kind == LocalError::kType ? ErrorCode::kInvalidType : ErrorCode::kInvalidArgument;
  // Waits for the peers' headers like the call it fails: interruptible like that call.
  call_interruptible([&] { shardgather::fail_call(comm, call, code, error.message); });
  throw InvalidArgument(error.message);  // not reached: fail_call always raises
}

std::optional<std::chrono::milliseconds> timeout_or_fail(Communicator& comm,
                                                         std::optional<double> seconds,
                                                         CallShape call) {
  try {
    return to_timeout(seconds);
  } catch (const InvalidArgument& e) {
    call.timeout.reset();  // the peers' deadline bounds the header that tells them
    fail_call(comm, {LocalError::kValue, 0, e.what()}, call);
  }
}

CallInputs parse_call_or_fail(py::handle params, py::handle hint, Communicator& comm, Operation op,
                              const ForeachAllGatherOptions& options) {
  CallInputs in;
  const LocalError hint_error = parse_hint(hint, in.hint);
  if (hint_error.kind != LocalError::kNone) {
    fail_call(comm, hint_error, {op, header_exchanged(true, options.preflight), options.timeout});
  }
  in.params = parse_params(params);
  if (in.params.error.kind != LocalError::kNone) {
    fail_call(comm, in.params.error,
              {op, header_exchanged(!in.hint.empty(), options.preflight), options.timeout});
  }
  return in;
}

}  // namespace shardgather::python
