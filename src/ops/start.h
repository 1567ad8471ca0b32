// How an operation runs: blocking (on the caller's thread, after every operation started before
// it on the communicator) or started (on the communicator's progress thread, returning a Work).
#pragma once

#include <exception>
#include <memory>
#include <utility>

#include "strategies/strategy.h"
#include "transport/op_queue.h"

#include "shardgather/communicator.h"
#include "shardgather/work.h"

namespace shardgather::detail {

template <typename Fn>
decltype(auto) run_blocking(Communicator& comm, Fn&& op) {
  OpQueue& ops = comm.operations();
  ops.drain([&comm] { comm.check_interrupt(); });  // Ctrl-C while queued behind started ones
  const std::unique_lock<std::mutex> driving = ops.drive();
  return op();
}

// `op` (copied into the job) returns the operation's result; it must hold copies of whatever the
// caller may free before the work completes (lists of views, hints, options).
template <typename T, typename Fn>
Work<T> start_on(Communicator& comm, Fn op) {
  auto state = std::make_shared<WorkResult<T>>();
  // A call on CUDA tensors enqueues on the stream that was current where it was started, and its
  // handle's wait() orders the waiter's stream after that work (work.h).
  comm.operations().submit(
      [state, op = std::move(op), stream = current_cuda_stream()]() mutable noexcept {
        const CudaStreamGuard on_stream(stream);
        // The job lets go of the state before it completes it: the handle (which always holds one,
        // its destructor waits) is then the last owner, so the state and a stored exception are
        // destroyed on the waiter's thread, never under its reading of them.
        std::shared_ptr<WorkResult<T>> mine = std::move(state);
        std::exception_ptr error;
        try {
          // Device work marks its end here, so that the waiter's stream can wait for it; kept
          // (on the heap) only where some was enqueued.
          DeviceCompletion end;
          {
            const DeviceCompletionScope collect(end);
            mine->value.emplace(op());
          }
          if (end.recorded) {
            auto done = std::make_shared<DeviceCompletion>(std::move(end));
            mine->set_device_order(
                [done](void* s) {
                  // With the call's device current: nullptr names the legacy default stream of
                  // the current device.
                  const CurrentDevice on(done->device);
                  done->event.order_after(s);
                },
                done->device);
          }
        } catch (...) {
          error = std::current_exception();
        }
        WorkState::finish(std::move(mine), std::move(error));
      });
  return Work<T>(std::move(state));
}

}  // namespace shardgather::detail
