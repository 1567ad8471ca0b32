// shardgather._shardgather.Work: the handle an `async_op=True` call returns (c10d's Work, for
// Python). wait() returns what the blocking call returns, or raises its error; is_completed()
// polls. The operation runs on the communicator's progress thread without the GIL. On CUDA
// tensors each wait() makes torch's current stream wait for the operation's device work, as
// c10d's does, without the host waiting for the GPU (unless shardgather.set_device_wait("host"));
// unlike c10d's NCCL work, is_completed() is true once that work is enqueued, not run.
//
// Ctrl-C: wait() sleeps with the GIL released in slices of 100 ms and runs Python's signal
// handlers between them (on the main thread); a KeyboardInterrupt aborts the communicator (the
// running operation ends with Aborted and the communicator is poisoned), waits for the
// operation to end, and is raised.
// Lifetime: the handle holds the inputs (and the plan it came from) until the operation ended;
// dropping an incomplete handle waits for it, with the GIL released.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <utility>

#include <pybind11/pybind11.h>

#include "shardgather/communicator.h"
#include "shardgather/torch.h"
#include "shardgather/work.h"

namespace shardgather::python {

class PyWork {
 public:
  // `result(value)` runs with the GIL held, once, and builds what wait() returns.
  template <typename T, typename Result>
  PyWork(std::shared_ptr<Communicator> comm, Work<T> work, Result result, pybind11::object keep)
      : comm_(std::move(comm)), keep_(std::move(keep)) {
    // Waits go to the shared completion (any thread, any number at once); the result is taken
    // once, with the GIL, by the first wait() that finds it complete.
    auto state = work.shared_state();
    auto owner = std::make_shared<Work<T>>(std::move(work));  // its destructor waits, too
    test_ = [state](std::chrono::milliseconds timeout) { return state->wait_for(timeout); };
    // c10d's Work.wait(): torch's current stream waits for the call's device work, at every
    // wait(), on whichever stream is current then.
    order_ = [state] {
      if (state->device() >= 0) {
        state->order_stream(torch_current_stream(static_cast<c10::DeviceIndex>(state->device())));
      }
    };
    finish_ = [state, owner, result = std::move(result)]() mutable -> pybind11::object {
      if (const std::exception_ptr error = state->error()) {
        std::rethrow_exception(error);
      }
      return result(std::move(*state->value));
    };
  }
  PyWork(const PyWork&) = delete;
  PyWork& operator=(const PyWork&) = delete;
  PyWork(PyWork&&) = default;
  PyWork& operator=(PyWork&&) = delete;
  ~PyWork();

  [[nodiscard]] bool is_completed() const { return done_ || test_(std::chrono::milliseconds(0)); }
  pybind11::object wait();

 private:
  // Until the operation completed, with the GIL released and Ctrl-C checked between slices.
  void block();

  std::shared_ptr<Communicator> comm_;
  pybind11::object keep_;  // what the operation reads (a plan); released after it ended
  std::function<bool(std::chrono::milliseconds)> test_;
  std::function<pybind11::object()> finish_;
  std::function<void()> order_;
  bool done_ = false;
  // wait()'s outcome, kept so that a second wait() returns (or raises) it again.
  pybind11::object value_;
  std::exception_ptr error_;
  bool waited_ = false;
};

}  // namespace shardgather::python
