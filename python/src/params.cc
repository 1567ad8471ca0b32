#include "params.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <torch/csrc/autograd/python_variable.h>

#include "torch_tensors.h"

#include "shardgather/errors.h"
#include "shardgather/torch.h"

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
  set_current_cuda_stream(torch_current_stream(index));
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

// Messages are built only on failure: the checks below run once per tensor on every call.
std::string item_name(const char* what, std::size_t i) {
  return std::string(what) + "[" + std::to_string(i) + "]";
}

// The tensor `item` stands for: itself, or a DTensor's local shard where `what` takes one.
LocalError unpack_tensor(PyObject* item, const char* what, std::size_t i, at::Tensor& t) {
  if (!THPVariable_Check(item)) {
    return {LocalError::kType, i,
            item_name(what, i) + " is a " + std::string(Py_TYPE(item)->tp_name) +
                ", not a torch.Tensor"};
  }
  if (THPVariable_CheckExact(item) || !unwraps_dtensors(what)) {
    t = THPVariable_Unpack(item);
  } else if (std::string error; !unpack_subclass(item, t, error)) {
    return {LocalError::kValue, i, item_name(what, i) + ": " + error};
  }
  return {};
}

// One call moves tensors of one device, CPU or CUDA: that of `first` (the list's first
// tensor; null while `t` is the first).
LocalError check_device(const at::Tensor& t, const at::Tensor* first, const char* what,
                        std::size_t i) {
  if (first != nullptr && t.device() != first->device()) {
    return {LocalError::kValue, i,
            item_name(what, i) + " is on " + t.device().str() + " but " + what + "[0] is on " +
                first->device().str() + ": all tensors must be on one device"};
  }
  if (!t.device().is_cpu() && !t.device().is_cuda()) {
    return {LocalError::kValue, i,
            item_name(what, i) + " is on " + t.device().str() +
                ": shardgather gathers CPU and CUDA tensors"};
  }
  return {};
}

// A view needs memory of the tensor's own, laid out by strides, of a type on the wire.
LocalError check_memory(const at::Tensor& t, PyObject* item, const char* what, std::size_t i) {
  if (!t.has_storage()) {  // a wrapper subclass (a DTensor among outputs, say)
    return {LocalError::kValue, i,
            item_name(what, i) + " is a " + std::string(Py_TYPE(item)->tp_name) +
                " without storage of its own: pass plain tensors" +
                (unwraps_dtensors(what) ? "" : " (DTensors are accepted as inputs only)")};
  }
  if (t.layout() != c10::kStrided) {
    return {LocalError::kValue, i, item_name(what, i) + " is not a strided (dense) tensor"};
  }
  if (!wire_dtype(t.scalar_type())) {
    return {LocalError::kValue, i, unsupported_dtype_message(t.scalar_type(), item_name(what, i))};
  }
  return {};
}

bool failed(const LocalError& error) { return error.kind != LocalError::kNone; }

// Appends the tensor `item` stands for to `out` (its view at `i`), or says why it cannot.
LocalError take_tensor(PyObject* item, const char* what, std::size_t i, Params& out) {
  at::Tensor t;
  if (LocalError error = unpack_tensor(item, what, i, t); failed(error)) {
    return error;
  }
  const at::Tensor* first = out.tensors.empty() ? nullptr : &out.tensors.front();
  if (LocalError error = check_device(t, first, what, i); failed(error)) {
    return error;
  }
  if (t.device().is_cuda() && first == nullptr) {
    // The call enqueues on torch's current stream of that device, as torch.distributed does.
    use_torch_stream(t.device().index());
  }
  if (LocalError error = check_memory(t, item, what, i); failed(error)) {
    return error;
  }
  if (t.is_neg()) {
    t = t.resolve_neg();  // a lazily negated view: materialise the values it stands for
  }
  set_view(t, *wire_dtype(t.scalar_type()), out.views[i]);
  out.tensors.push_back(std::move(t));
  return {};
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
  for (std::size_t i = 0; i < n; ++i) {
    const auto at = static_cast<Py_ssize_t>(i);
    PyObject* item =
        is_list ? PyList_GET_ITEM(params.ptr(), at) : PyTuple_GET_ITEM(params.ptr(), at);
    if (LocalError error = take_tensor(item, what, i, out); failed(error)) {
      out.views.resize(i);
      out.error = std::move(error);
      return;
    }
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

constexpr const char* kHintName = "params_shapes_across_group";

py::handle item_of(const py::object& seq, std::size_t k) {
  return PySequence_Fast_ITEMS(seq.ptr())[k];
}

std::size_t size_of(const py::object& seq) {
  return static_cast<std::size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
}

// Dimension d of tensor i in the row named `row_name`: an int or anything with __index__ (a
// numpy integer), never a float. As for the tensors, messages are built only on failure.
LocalError parse_dim(py::handle dim, const std::string& row_name, std::size_t i, std::size_t d,
                     std::int64_t& out) {
  const py::object index = py::reinterpret_steal<py::object>(
      PyLong_Check(dim.ptr()) != 0 ? py::handle(dim).inc_ref().ptr() : PyNumber_Index(dim.ptr()));
  int overflow = 0;
  const long long value = index ? PyLong_AsLongLongAndOverflow(index.ptr(), &overflow) : -1;
  if (!index || overflow != 0 || (value == -1 && PyErr_Occurred() != nullptr)) {
    PyErr_Clear();
    return {index ? LocalError::kValue : LocalError::kType, i,
            row_name + "[" + std::to_string(i) + "][" + std::to_string(d) + "] is " +
                (index ? "out of the int64 range" : "a " + type_name(dim) + ", not an int")};
  }
  out = value;
  return {};
}

// Rank r's row of the hint: one shape per tensor.
LocalError parse_hint_row(py::handle obj, std::size_t r, std::vector<Shape>& out) {
  const std::string row_name = std::string(kHintName) + "[" + std::to_string(r) + "]";
  const py::object row = fast_sequence(obj);
  if (!row) {
    return {LocalError::kType, 0, row_name + " is a " + type_name(obj) + ", not a list of shapes"};
  }
  out.resize(size_of(row));
  for (std::size_t i = 0; i < out.size(); ++i) {
    const py::object dims = fast_sequence(item_of(row, i));
    if (!dims) {
      return {LocalError::kType, i,
              row_name + "[" + std::to_string(i) + "] is a " + type_name(item_of(row, i)) +
                  ", not a shape (a torch.Size, tuple or list of ints)"};
    }
    out[i].resize(size_of(dims));
    for (std::size_t d = 0; d < out[i].size(); ++d) {
      if (LocalError error = parse_dim(item_of(dims, d), row_name, i, d, out[i][d]);
          failed(error)) {
        return error;
      }
    }
  }
  return {};
}

}  // namespace

LocalError parse_hint(py::handle hint, ShapesHint& out) {
  out.clear();
  if (hint.is_none()) {
    return {};
  }
  const py::object rows = fast_sequence(hint);
  if (!rows) {
    return {LocalError::kType, 0,
            std::string(kHintName) +
                " must be a list (per rank) of lists (per tensor) of shapes, got " +
                type_name(hint)};
  }
  out.resize(size_of(rows));
  for (std::size_t r = 0; r < out.size(); ++r) {
    if (LocalError error = parse_hint_row(item_of(rows, r), r, out[r]); failed(error)) {
      return error;
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

void fail_call(Communicator& comm, ErrorCode code, const std::string& message,
               const CallShape& call) {
  // Waits for the peers' headers like the call it fails: interruptible like that call.
  call_interruptible([&] { shardgather::fail_call(comm, call, code, message); });
  throw InvalidArgument(message);  // not reached: fail_call always raises
}

void fail_call(Communicator& comm, const LocalError& error, const CallShape& call) {
  fail_call(comm,
            error.kind == LocalError::kType ? ErrorCode::kInvalidType : ErrorCode::kInvalidArgument,
            error.message, call);
}

// The operation operation_name() calls `name` (an unknown name is this binding's own bug).
Operation operation_named(const std::string& name) {
  for (auto code = static_cast<std::uint8_t>(Operation::kForeachAllGather);
       code < static_cast<std::uint8_t>(Operation::kEnd); ++code) {
    if (operation_name(static_cast<Operation>(code)) == name) {
      return static_cast<Operation>(code);
    }
  }
  throw std::invalid_argument("no operation is called " + name);
}

// The error class error_code_name() calls `name` (an unknown name is this binding's own bug).
ErrorCode error_code_named(const std::string& name) {
  for (auto code = static_cast<std::uint8_t>(ErrorCode::kInvalidArgument);
       code <= static_cast<std::uint8_t>(kLastErrorCode); ++code) {
    if (error_code_name(static_cast<ErrorCode>(code)) == name) {
      return static_cast<ErrorCode>(code);
    }
  }
  throw std::invalid_argument("no error class is called " + name);
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
    fail_call(comm, hint_error,
              {op, header_exchanged(true, options.preflight), options.timeout, options.stage});
  }
  in.params = parse_params(params);
  if (in.params.error.kind != LocalError::kNone) {
    fail_call(comm, in.params.error,
              {op, header_exchanged(!in.hint.empty(), options.preflight), options.timeout,
               options.stage});
  }
  return in;
}

}  // namespace shardgather::python
