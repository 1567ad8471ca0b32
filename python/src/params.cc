#include "params.h"

#include <cmath>
#include <cstdint>
#include <utility>

#include <torch/csrc/autograd/python_variable.h>

#include "torch_tensors.h"

#include "shardgather/errors.h"

namespace py = pybind11;

namespace shardgather::python {

SignalWatch::SignalWatch(Communicator& comm) : comm_(comm) {
  comm_.set_interrupt_check([this]() noexcept {
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
  comm_.set_interrupt_check({});
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

Params parse_params(py::handle params, const char* what) {
  Params out;
  if (!py::isinstance<py::list>(params) && !py::isinstance<py::tuple>(params)) {
    out.error = {LocalError::kType, 0,
                 std::string(what) + " must be a list of torch.Tensor, got " +
                     std::string(py::str(py::type::handle_of(params).attr("__name__")))};
    return out;
  }
  const auto seq = py::reinterpret_borrow<py::sequence>(params);
  const std::size_t n = seq.size();
  out.tensors.reserve(n);
  out.views.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    PyObject* item = PyList_Check(params.ptr()) ? PyList_GET_ITEM(params.ptr(), i)
                                                : PyTuple_GET_ITEM(params.ptr(), i);
    const std::string name = std::string(what) + "[" + std::to_string(i) + "]";
    if (!THPVariable_Check(item)) {
      out.error = {LocalError::kType, i,
                   name + " is a " + std::string(Py_TYPE(item)->tp_name) + ", not a torch.Tensor"};
      return out;
    }
    at::Tensor t = THPVariable_Unpack(item);
    if (!out.tensors.empty() && t.device() != out.tensors.front().device()) {
      out.error = {LocalError::kValue, i,
                   name + " is on " + t.device().str() + " but " + what + "[0] is on " +
                       out.tensors.front().device().str() + ": all tensors must be on one device"};
      return out;
    }
    if (!t.device().is_cpu()) {
      out.error = {LocalError::kValue, i,
                   name + " is on " + t.device().str() +
                       ": shardgather gathers host (CPU) tensors; the device path is not built"};
      return out;
    }
    if (t.layout() != c10::kStrided) {
      out.error = {LocalError::kValue, i, name + " is not a strided (dense) tensor"};
      return out;
    }
    DType dtype{};
    try {
      dtype = dtype_of(t.scalar_type(), name);
    } catch (const InvalidArgument& e) {
      out.error = {LocalError::kValue, i, e.what()};
      return out;
    }
    if (t.is_neg()) {
      t = t.resolve_neg();  // a lazily negated view: materialise the values it stands for
    }
    out.views.push_back(view_of(t, dtype));
    out.tensors.push_back(std::move(t));
  }
  return out;
}

void notify_peers(Communicator& comm, const LocalError& error,
                  std::span<const std::vector<Shape>> hint,
                  const ForeachAllGatherOptions& options) {
  std::vector<TensorView> views(error.index + 1);
  views.back().dtype = static_cast<DType>(0xff);  // no wire code: rejected by validation
  try {
    const py::gil_scoped_release release;
    (void)foreach_all_gather(views, comm, hint, options);
  } catch (const Error&) {
    // expected: the peers got the same call's failure
  }
}

void raise_local(const Communicator& comm, const LocalError& error) {
  const std::string text = "rank " + std::to_string(comm.rank()) + ": " + error.message;
  if (error.kind == LocalError::kType) {
    throw py::type_error(text);
  }
  throw py::value_error(text);
}

}  // namespace shardgather::python
