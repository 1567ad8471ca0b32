#include "transport/op_queue.h"

#include <chrono>
#include <utility>

namespace shardgather::detail {

namespace {
thread_local bool t_progress_thread = false;
}  // namespace

bool OpQueue::on_progress_thread() noexcept { return t_progress_thread; }

void OpQueue::submit(std::function<void()> job) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (!thread_.joinable()) {
    // Before the job is queued: a thread that cannot start leaves no job that nothing runs.
    stopping_ = false;
    thread_ = std::thread([this] { run(); });
  }
  jobs_.push_back(std::move(job));
  cv_.notify_all();
}

void OpQueue::drain(const std::function<void()>& poll) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::milliseconds(100),
                       [this] { return jobs_.empty() && !busy_; })) {
    if (poll) {
      lock.unlock();
      poll();
      lock.lock();
    }
  }
}

void OpQueue::stop() noexcept {
  std::thread thread;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return jobs_.empty() && !busy_; });
    stopping_ = true;
    cv_.notify_all();
    thread = std::move(thread_);
  }
  if (thread.joinable()) {
    thread.join();
  }
}

void OpQueue::run() {
  t_progress_thread = true;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) {
      return;  // stopping, and nothing left
    }
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    lock.unlock();
    {
      const std::unique_lock<std::mutex> driving = drive();
      job();
    }
    job = nullptr;  // whatever the job held is released before it counts as done
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace shardgather::detail
