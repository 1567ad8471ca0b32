// The order of operations on one communicator: their sequence numbers, and the progress thread
// that runs started (asynchronous) operations one after another.
//
// Ordering: jobs run in the order they were submitted, one at a time, on one thread per queue
// (created on the first submit). A blocking operation drain()s first and then runs on its
// caller's thread, so it too runs after every operation started before it. Every rank numbers
// its operations alike (one number per operation, taken when it runs), which the pre-flight
// header compares.
//
// Threading: one thread should drive a communicator; when two do anyway, their operations are
// serialised (each runs under the drive lock, blocking or started), never interleaved: the
// ranks may then pair different calls, which the pre-flight header reports as a Mismatch, but
// no two operations share the communicator's state at once. A job runs on the progress thread
// and must not throw (it stores its own failure).
// Blocking: submit() never blocks on a job; drain() and stop() wait for the jobs, each bounded by
// its own deadline (abort() on the communicator ends them early).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace shardgather::detail {

class OpQueue {
 public:
  OpQueue() = default;
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;
  OpQueue(OpQueue&&) = delete;
  OpQueue& operator=(OpQueue&&) = delete;
  ~OpQueue() { stop(); }

  // The next operation's sequence number (1, 2, ...).
  std::uint64_t next_seq() noexcept { return seq_.fetch_add(1, std::memory_order_relaxed) + 1; }
  // How many sequence numbers were taken (any thread may read it).
  [[nodiscard]] std::uint64_t seqs_taken() const noexcept {
    return seq_.load(std::memory_order_relaxed);
  }

  // Runs `job` on the progress thread after every job submitted before it.
  void submit(std::function<void()> job);

  // Returns once every job submitted so far has run; `poll` (may throw, which ends the wait)
  // runs on this thread about every 100 ms meanwhile.
  void drain(const std::function<void()>& poll = {});

  // Held by every operation while it runs (jobs take it on the progress thread).
  [[nodiscard]] std::unique_lock<std::mutex> drive() {
    return std::unique_lock<std::mutex>(drive_);
  }

  // drain(), then ends the progress thread. Later submits start a new one. Idempotent.
  void stop() noexcept;

  // Whether the calling thread is a progress thread: backends sleep between polls there rather
  // than spin, so that the caller's own work keeps its core.
  static bool on_progress_thread() noexcept;

  // Whether a caller is blocked waiting for a started operation of this queue (a stream's next
  // bucket): the progress thread then has nothing to share its core with, and polls at full
  // speed (a transport that moves bytes only inside its calls, as Open MPI over shared memory,
  // would otherwise move them only between sleeps).
  [[nodiscard]] bool awaited() const noexcept {
    return awaited_.load(std::memory_order_relaxed) > 0;
  }
  // +1 when a thread starts waiting for the started operations, -1 when it stops (Awaiting, or
  // the embedding interface's AwaitingStarted, pair them).
  void awaiting(int delta) noexcept { awaited_.fetch_add(delta); }
  // Marks this thread as waiting for the queue's started operations while it lives.
  class Awaiting {
   public:
    explicit Awaiting(OpQueue& ops) noexcept : ops_(ops) { ops_.awaiting(1); }
    Awaiting(const Awaiting&) = delete;
    Awaiting& operator=(const Awaiting&) = delete;
    Awaiting(Awaiting&&) = delete;
    Awaiting& operator=(Awaiting&&) = delete;
    ~Awaiting() { ops_.awaiting(-1); }

   private:
    OpQueue& ops_;
  };

 private:
  void run();

  // Taken by whichever thread runs the current operation; atomic so that a test may read it.
  std::atomic<std::uint64_t> seq_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;  // guarded by mu_
  bool busy_ = false;                       // a job is running; guarded by mu_
  bool stopping_ = false;                   // guarded by mu_
  std::thread thread_;
  std::mutex drive_;  // one operation at a time on the communicator
  std::atomic<int> awaited_{0};
};

}  // namespace shardgather::detail
