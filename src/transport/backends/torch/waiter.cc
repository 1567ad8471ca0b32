#include "transport/backends/torch/waiter.h"

#include <utility>

namespace shardgather::detail {

Waiter::~Waiter() {
  {
    const std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
}

void Waiter::run(const std::function<void()>& wait, const std::function<void()>& poll,
                 std::chrono::milliseconds period) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!thread_.joinable()) {
    thread_ = std::thread([this] { loop(); });
  }
  job_ = &wait;
  done_ = false;
  error_ = nullptr;
  cv_.notify_all();
  while (!done_) {
    if (cv_.wait_for(lock, period, [this] { return done_; })) {
      break;
    }
    lock.unlock();
    try {
      poll();
    } catch (...) {
      lock.lock();
      await_done(lock);
      throw;
    }
    lock.lock();
  }
  job_ = nullptr;
  if (error_ != nullptr) {
    std::rethrow_exception(std::exchange(error_, nullptr));
  }
}

void Waiter::await_done(std::unique_lock<std::mutex>& lock) {
  cv_.wait(lock, [this] { return done_; });
  job_ = nullptr;
  error_ = nullptr;  // poll's exception is the cause; the wait's is its consequence
}

void Waiter::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || (job_ != nullptr && !done_); });
    if (stop_) {
      return;
    }
    const std::function<void()>* job = job_;
    lock.unlock();
    std::exception_ptr error;
    try {
      (*job)();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    error_ = error;
    done_ = true;
    cv_.notify_all();
  }
}

}  // namespace shardgather::detail
