// One helper thread that runs a blocking wait while the calling thread keeps polling, for waits
// that can neither be sliced nor polled (Gloo point-to-point works, see process_group.h): the
// calling thread is where Python runs its signal handlers, so it must not be the one blocked.
//
// Contract:
//  1. One caller at a time (the communicator's driving thread); run() is not reentrant.
//  2. `wait` runs on the helper thread and must return on its own (its deadline) or when
//     `poll` makes it return (by aborting what it waits on).
//  3. The helper thread starts on the first run() and is joined by the destructor; between
//     runs it sleeps on a condition variable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace shardgather::detail {

class Waiter {
 public:
  Waiter() = default;
  Waiter(const Waiter&) = delete;
  Waiter& operator=(const Waiter&) = delete;
  ~Waiter();

  // Runs `wait` on the helper thread and, until it returns, calls `poll` on this thread about
  // every `period`. Returns, or rethrows, what `wait` did. If `poll` throws, waits for `wait` to
  // return (poll must have made it return) and rethrows poll's exception instead.
  void run(const std::function<void()>& wait, const std::function<void()>& poll,
           std::chrono::milliseconds period);

 private:
  void loop();
  // Blocks until the current job has finished; mu_ held through `lock`.
  void await_done(std::unique_lock<std::mutex>& lock);

  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void()>* job_ = nullptr;  // guarded by mu_; set while a run() is active
  bool done_ = false;                           // guarded by mu_
  bool stop_ = false;                           // guarded by mu_
  std::exception_ptr error_;                    // guarded by mu_
  std::thread thread_;                          // started by the first run()
};

}  // namespace shardgather::detail
