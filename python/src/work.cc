#include "work.h"

#include "shardgather/embedding.h"

namespace py = pybind11;

namespace shardgather::python {

PyWork::~PyWork() {
  if (!test_ || done_) {
    return;
  }
  const py::gil_scoped_release release;
  (void)test_(std::chrono::milliseconds(-1));
}

void PyWork::block() {
  constexpr std::chrono::milliseconds kSlice{100};
  const AwaitingStarted awaiting(*comm_);  // the transport may hurry
  for (;;) {
    bool completed = false;
    {
      const py::gil_scoped_release release;
      completed = test_(kSlice);
    }
    if (completed) {
      done_ = true;
      return;
    }
    if (PyErr_CheckSignals() != 0) {
      {
        const py::gil_scoped_release release;
        comm_->abort();  // the running operation ends with Aborted; the peers see it fail
        (void)test_(std::chrono::milliseconds(-1));
      }
      done_ = true;
      throw py::error_already_set();
    }
  }
}

py::object PyWork::wait() {
  if (!waited_) {
    block();
  }
  // Checked again with the GIL: another thread's wait() may have taken the result meanwhile.
  if (!waited_) {
    waited_ = true;
    try {
      value_ = finish_();  // the operation's error is rethrown here
    } catch (...) {
      error_ = std::current_exception();
    }
    finish_ = nullptr;  // releases the inputs it held
    keep_ = py::object();
  }
  if (error_) {
    std::rethrow_exception(error_);  // translated to its Python class by pybind11
  }
  order_();
  return value_;
}

}  // namespace shardgather::python
