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
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include "process_group.h"
#include "torch_tensors.h"

#include "shardgather/communicator.h"
#include "shardgather/errors.h"
#include "shardgather/foreach_all_gather.h"
#include "shardgather/threads.h"
#include "shardgather/version.h"

#ifdef SHARDGATHER_PYTHON_WITH_MPI
#include <mpi.h>

#include "shardgather/mpi.h"
#endif

namespace py = pybind11;

namespace shardgather::python {

namespace {

using CommPtr = std::shared_ptr<Communicator>;

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

// A problem the binding finds before the core runs: raised here as TypeError or ValueError
// after the peers have been told (see notify_peers).
struct LocalError {
  enum Kind { kNone, kType, kValue } kind = kNone;
  std::size_t index = 0;
  std::string message;
};

// The parsed argument list: views into `tensors`, which hold the inputs alive during the call.
struct Params {
  std::vector<at::Tensor> tensors;
  std::vector<TensorView> views;
  LocalError error;
};

Params parse_params(py::handle params) {
  Params out;
  if (!py::isinstance<py::list>(params) && !py::isinstance<py::tuple>(params)) {
    out.error = {LocalError::kType, 0,
                 "params must be a list of torch.Tensor, got " +
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
    const std::string what = "params[" + std::to_string(i) + "]";
    if (!THPVariable_Check(item)) {
      out.error = {LocalError::kType, i,
                   what + " is a " + std::string(Py_TYPE(item)->tp_name) + ", not a torch.Tensor"};
      return out;
    }
    at::Tensor t = THPVariable_Unpack(item);
    if (!out.tensors.empty() && t.device() != out.tensors.front().device()) {
      out.error = {LocalError::kValue, i,
                   what + " is on " + t.device().str() + " but params[0] is on " +
                       out.tensors.front().device().str() + ": all tensors must be on one device"};
      return out;
    }
    if (!t.device().is_cpu()) {
      out.error = {LocalError::kValue, i,
                   what + " is on " + t.device().str() +
                       ": shardgather gathers host (CPU) tensors; the device path is not built"};
      return out;
    }
    if (t.layout() != c10::kStrided) {
      out.error = {LocalError::kValue, i, what + " is not a strided (dense) tensor"};
      return out;
    }
    DType dtype{};
    try {
      dtype = dtype_of(t.scalar_type(), what);
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

// Makes the peers fail from the same call: the core is called with a view it rejects, so the
// rejection travels in the pre-flight header and every rank raises InvalidArgument, instead of
// the peers waiting for this rank until their deadline. This rank then raises its own, more
// precise, Python error.
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

py::list foreach_all_gather_py(py::handle params, Communicator& comm,
                               const std::optional<std::vector<std::vector<Shape>>>& hint,
                               std::optional<double> timeout, bool preflight) {
  const ForeachAllGatherOptions options{.timeout = to_timeout(timeout), .preflight = preflight};
  const std::span<const std::vector<Shape>> hint_span =
      hint ? std::span<const std::vector<Shape>>(*hint) : std::span<const std::vector<Shape>>();
  Params parsed = parse_params(params);
  if (parsed.error.kind != LocalError::kNone) {
    if (comm.size() > 1) {
      notify_peers(comm, parsed.error, hint_span, options);
    }
    if (parsed.error.kind == LocalError::kType) {
      throw py::type_error("rank " + std::to_string(comm.rank()) + ": " + parsed.error.message);
    }
    throw py::value_error("rank " + std::to_string(comm.rank()) + ": " + parsed.error.message);
  }

  auto result = std::make_unique<GatherResult>();
  {
    const py::gil_scoped_release release;
    *result = foreach_all_gather(parsed.views, comm, hint_span, options);
  }
  parsed.tensors.clear();

  const GatherResult& gathered = *result;
  const std::size_t n = gathered.size();
  const auto world = static_cast<std::size_t>(gathered.world_size());
  std::byte* base = gathered.buffer().data();
  const c10::Storage storage = adopt_storage(std::move(result), base, gathered.buffer().size());
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

py::list make_thread_group_py(int world_size) {
  std::vector<std::unique_ptr<Communicator>> comms = make_thread_group(world_size);
  py::list out;
  for (auto& c : comms) {
    out.append(py::cast(CommPtr(std::move(c))));
  }
  return out;
}

CommPtr process_group_communicator(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   const std::string& device) {
  return std::make_shared<ProcessGroupCommunicator>(group, c10::Device(device));
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

}  // namespace

}  // namespace shardgather::python

PYBIND11_MODULE(_shardgather, m) {
  using namespace shardgather;          // NOLINT(google-build-using-namespace)
  using namespace shardgather::python;  // NOLINT(google-build-using-namespace)
  m.doc() = "shardgather's C++ core; use the shardgather package, not this module";
  register_exceptions(m);
  m.attr("__version__") = SHARDGATHER_VERSION_STRING;
  m.attr("_torch_version") = SHARDGATHER_TORCH_VERSION;

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
      .def(
          "barrier",
          [](Communicator& c, std::optional<double> timeout) {
            const auto deadline = c.deadline_after(to_timeout(timeout).value_or(c.timeout()));
            const py::gil_scoped_release release;
            c.barrier(deadline);
          },
          py::arg("timeout") = py::none())
      .def("abort", &Communicator::abort)
      .def("__repr__", [](const Communicator& c) {
        return "<shardgather.Communicator " + std::string(c.backend_name()) + " rank " +
               std::to_string(c.rank()) + " of " + std::to_string(c.size()) + ">";
      });

  m.def("foreach_all_gather", &foreach_all_gather_py, py::arg("params"), py::arg("comm"),
        py::arg("params_shapes_across_group") = py::none(), py::arg("timeout") = py::none(),
        py::arg("preflight") = true);
  m.def("_make_thread_group", &make_thread_group_py, py::arg("world_size"));
  m.def("_process_group_communicator", &process_group_communicator, py::arg("group"),
        py::arg("device") = "cpu");
#ifdef SHARDGATHER_PYTHON_WITH_MPI
  m.attr("_has_mpi") = true;
  m.def("_mpi_init", &mpi_init);
  m.def("_mpi_finalize", &mpi_finalize);
  m.def("_mpi_is_initialized", &mpi_is_initialized);
  m.def("_mpi_communicator", &mpi_communicator, py::arg("handle") = py::none());
#else
  m.attr("_has_mpi") = false;
#endif
}
