#include "shardgather/work.h"

namespace shardgather::detail {

void WorkState::finish(std::exception_ptr error) noexcept {
  {
    const std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    done_ = true;
  }
  cv_.notify_all();
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
