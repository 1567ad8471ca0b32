#include "shardgather/work.h"

namespace shardgather::detail {

void WorkState::finish(std::shared_ptr<WorkState> owner, std::exception_ptr error) noexcept {
  WorkState* state = owner.get();
  owner.reset();  // a handle holds another reference until it has seen done_
  // Notified under the lock: once it is released this thread never touches the state again,
  // and the waiter may destroy it.
  const std::lock_guard<std::mutex> lock(state->mu_);
  state->error_ = std::move(error);
  state->done_ = true;
  state->cv_.notify_all();
}

bool WorkState::wait_for(std::chrono::milliseconds timeout) noexcept {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout.count() < 0) {
    cv_.wait(lock, [this] { return done_; });
    return true;
  }
  return cv_.wait_for(lock, timeout, [this] { return done_; });
}

std::exception_ptr WorkState::error() const noexcept {
  const std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

}  // namespace shardgather::detail
