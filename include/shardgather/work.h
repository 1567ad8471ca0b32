// Work: the handle of an operation started asynchronously (the c10d Work contract, smaller).
//
//   Work<ExecStats> work = plan.start(params, comm, out);   // returns at once
//   ... compute while the gather moves ...
//   ExecStats stats = work.wait();                          // the result, or the error
//
// Semantics, as equivalent code:
//   bool is_completed()     { return test(0); }  // the poll: c10d's name, and the binding's
//   bool test(timeout = 0)  { wait up to `timeout` for completion; return whether complete }
//   T wait()                { test(forever); if (failed) rethrow(error);
//                             order_stream(current_cuda_stream()); return move(result); }
//   ~Work()                 { test(forever); }  // an incomplete operation is waited for; its
//                                              // error, if any, is dropped
//
// WARNING: destroying a Work whose operation has not completed BLOCKS until it completes (up to
// the call's deadline) and DROPS its error. c10d's Work does neither (its destructor returns at
// once). Here the operation reads the caller's tensors and writes its outputs, so letting it run
// on after its handle is gone would write memory the caller may already have freed. Call wait()
// on every handle you start, or keep it while you do other work.
//
// wait() returns (or rethrows) once: the handle is empty afterwards, and wait() on an empty
// handle (default-constructed, moved from, waited) raises InvalidArgument; test() on one
// returns true.
//
// Progress: started operations on one communicator run on its progress thread, one after
// another in the order they were started, with no polling by the caller; a blocking call on
// the same communicator runs after them. Every error contract of the blocking call holds: the
// same class is rethrown on every rank's wait(), the call's deadline bounds it, abort() on the
// communicator ends a running operation with Aborted (and those queued behind it with
// CommAborted).
// CUDA tensors (docs/gpu.md): completion means the operation's device work is enqueued on the
// stream that was current where it was started (and, under DeviceWait::kHost, has run). wait()
// makes the waiter's current stream (current_cuda_stream()) wait for that work, with an event, as
// c10d's Work::wait() does; the host does not wait for the GPU. Work enqueued on that stream
// after wait() sees the outputs. (Unlike c10d's NCCL work, is_completed() says enqueued, not run.)
// Device outputs the operation allocated belong to the stream it was started on: a consumer on
// another stream orders itself with wait() and keeps them with record_stream, as with c10d.
// Lifetime: the memory of the tensors (inputs and outputs) and the plan an operation was
// started from stay alive and unmodified until it completed (test() true or wait() returned).
// The lists of views and shapes passed to start are copied.
// Threading: one thread at a time uses a handle, any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "shardgather/device.h"
#include "shardgather/errors.h"
#include "shardgather/export.h"

namespace shardgather {

namespace detail {

// Completion shared by a handle and the operation's job on the progress thread.
class SHARDGATHER_API WorkState {
 public:
  // The job, once: `error` null on success. Gives up `owner` (the job's reference) first, so
  // that the waiter, who holds another, is the one that destroys the state.
  static void finish(std::shared_ptr<WorkState> owner, std::exception_ptr error) noexcept;
  // Waits up to `timeout` (forever when negative); true once complete.
  bool wait_for(std::chrono::milliseconds timeout) noexcept;
  // After completion: the failure, or null.
  [[nodiscard]] std::exception_ptr error() const noexcept;

  // Set by an operation's job before finish() when it enqueued device work on CUDA device
  // `device`: `order(stream)` makes `stream` wait for the end of that work.
  void set_device_order(std::function<void(void*)> order, int device) noexcept {
    order_ = std::move(order);
    device_ = device;
  }
  // After completion: whether the operation left device work, and on which device (-1: none).
  [[nodiscard]] int device() const noexcept { return device_; }
  // After completion: makes `stream` (a cudaStream_t) wait for the operation's device work; does
  // nothing for a host operation. Raises CommunicationError when CUDA fails.
  void order_stream(void* stream) const {
    if (order_) {
      order_(stream);
    }
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;                 // guarded by mu_
  std::exception_ptr error_;          // written before done_
  std::function<void(void*)> order_;  // written before done_
  int device_ = -1;                   // written before done_
};

template <typename T>
struct WorkResult final : WorkState {
  std::optional<T> value;  // written by the job before finish()
};

}  // namespace detail

template <typename T>
class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkResult<T>> state) : state_(std::move(state)) {}
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  Work(Work&&) noexcept = default;
  Work& operator=(Work&& other) noexcept {
    if (this != &other) {
      settle();
      state_ = std::move(other.state_);
    }
    return *this;
  }
  ~Work() { settle(); }

  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }

  // The shared completion, for embedders that wait from several threads (the Python binding):
  // wait_for() on it, then value / error(). Null for an empty handle.
  [[nodiscard]] std::shared_ptr<detail::WorkResult<T>> shared_state() const noexcept {
    return state_;
  }

  // Whether the operation completed, without waiting (the poll). Never throws.
  [[nodiscard]] bool is_completed() const noexcept { return test(); }

  // Whether the operation completed, waiting up to `timeout` for it. Never throws.
  [[nodiscard]] bool test(
      std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) const noexcept {
    return state_ == nullptr || state_->wait_for(timeout);
  }

  // Blocks until the operation completed; returns its result or rethrows its error.
  T wait() {
    if (state_ == nullptr) {
      throw InvalidArgument(
          "Work::wait: the handle is empty (default-constructed, moved from, "
          "or already waited)");
    }
    const std::shared_ptr<detail::WorkResult<T>> state = std::move(state_);
    state->wait_for(std::chrono::milliseconds(-1));
    if (const std::exception_ptr error = state->error()) {
      std::rethrow_exception(error);
    }
    state->order_stream(current_cuda_stream());
    return std::move(*state->value);
  }

 private:
  void settle() noexcept {
    if (state_ != nullptr) {
      state_->wait_for(std::chrono::milliseconds(-1));
    }
  }
  std::shared_ptr<detail::WorkResult<T>> state_;
};

}  // namespace shardgather
