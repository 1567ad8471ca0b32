#include "copies/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace shardgather::detail {

namespace {

class Pool {
 public:
  explicit Pool(int workers) {
    for (int w = 0; w < workers; ++w) {
      threads_.emplace_back([this] { work(); });
    }
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  Pool(Pool&&) = delete;
  Pool& operator=(Pool&&) = delete;
  ~Pool() {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) {
      t.join();
    }
  }

  void run(std::size_t tasks, int threads, void (*fn)(void*, std::size_t), void* ctx) {
    const std::lock_guard<std::mutex> serial(run_mu_);
    {
      const std::lock_guard<std::mutex> lock(mu_);
      fn_ = fn;
      ctx_ = ctx;
      tasks_ = tasks;
      next_.store(0);
      helpers_ = std::min<int>(threads - 1, static_cast<int>(threads_.size()));
      active_ = helpers_;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return active_ == 0; });
  }

 private:
  void drain() {
    for (std::size_t k = next_.fetch_add(1); k < tasks_; k = next_.fetch_add(1)) {
      fn_(ctx_, k);
    }
  }

  void work() {
    std::uint64_t seen = 0;
    int id = 0;
    {
      const std::lock_guard<std::mutex> lock(mu_);
      id = joined_++;
    }
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || (generation_ != seen && id < helpers_); });
        if (stop_) {
          return;
        }
        seen = generation_;
      }
      drain();
      const std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) {
        done_.notify_all();
      }
    }
  }

  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
  int joined_ = 0;
  std::uint64_t generation_ = 0;
  int helpers_ = 0;
  int active_ = 0;
  void (*fn_)(void*, std::size_t) = nullptr;
  void* ctx_ = nullptr;
  std::size_t tasks_ = 0;
  std::atomic<std::size_t> next_{0};
};

int hardware_threads() noexcept {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

}  // namespace

int default_copy_threads(int ranks_here) noexcept {
  return std::max(1, hardware_threads() / std::max(1, ranks_here));
}

void parallel_for(std::size_t tasks, int threads, void (*fn)(void*, std::size_t), void* ctx) {
  if (threads <= 1 || tasks <= 1) {
    for (std::size_t k = 0; k < tasks; ++k) {
      fn(ctx, k);
    }
    return;
  }
  static Pool pool(hardware_threads() - 1);
  pool.run(tasks, threads, fn, ctx);
}

}  // namespace shardgather::detail
