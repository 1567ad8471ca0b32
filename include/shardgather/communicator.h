// The narrow, byte-typed communicator interface that every backend implements.
//
// Contract (all backends):
//  1. Collectives are matched by call order: every rank of the group calls the same sequence of
//     collectives with compatible arguments. foreach_all_gather() verifies this with its
//     pre-flight header; raw use of this interface does not.
//  2. One thread at a time drives a communicator. abort() is the exception: it may be called
//     from any thread, at any time, and wakes a blocked call.
//  3. Every blocking call takes a deadline. Past it the call raises Timeout; after a Timeout,
//     an abort or a backend failure the communicator is poisoned and every later call raises
//     CommAborted at once (nothing is sent). Build a new communicator to continue.
//  4. Buffers are host memory; the caller keeps them alive and unmodified until the call returns.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "shardgather/export.h"

namespace shardgather {

namespace detail {
class HostMailbox;
}  // namespace detail

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// Used when neither the call nor the communicator sets a timeout. Gloo uses 30 s; a large
// checkpoint gather can legitimately take longer, so the default is generous.
inline constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(10)};

// A read-only run of bytes: one piece of a rank's contribution. A send is a list of these, so a
// backend can send straight from the caller's tensors (no copy-in).
struct ConstSegment {
  const std::byte* data = nullptr;
  std::uint64_t size = 0;
};

// Where received bytes land: `count` blocks of `block` bytes, block k at data + k * stride.
// A contiguous destination is one block (count 1). Strided pieces let a gather write a shard
// straight into its place inside a full tensor sharded along any dim.
struct RecvPiece {
  std::byte* data = nullptr;
  std::uint64_t block = 0;
  std::uint64_t count = 1;
  std::uint64_t stride = 0;
};

class SHARDGATHER_API Communicator {
 public:
  Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  Communicator(Communicator&&) = delete;
  Communicator& operator=(Communicator&&) = delete;
  virtual ~Communicator();

  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int size() const noexcept = 0;
  // "threads", "mpi", ...
  [[nodiscard]] virtual std::string_view backend_name() const noexcept = 0;
  // How many ranks of this communicator share this rank's host (its memory bandwidth and
  // cores): copy kernels size their thread count from it.
  [[nodiscard]] virtual int ranks_on_host() const noexcept = 0;
  // Per-rank bytes from which a plan's kAuto gathers through a node-shared window (one copy in,
  // one out, a barrier) instead of through this transport, when every rank is on one host.
  // kNeverShared where the transport already copies each byte straight from the sender's memory
  // (threads): a window could then only add copies. Must be the same on every rank.
  static constexpr std::uint64_t kNeverShared = std::numeric_limits<std::uint64_t>::max();
  [[nodiscard]] virtual std::uint64_t shared_window_min_bytes() const noexcept = 0;

  // Equal-size gather: rank r's `send` lands at recv[r * send.size()]. recv.size() must be
  // size() * send.size(), and send.size() the same on every rank.
  void all_gather(std::span<const std::byte> send, std::span<std::byte> recv, Deadline deadline);

  // Variable-size gather: rank r's bytes (the concatenation of its segments, counts[r] bytes in
  // all) land at recv + displs[r]. counts and displs have size() entries and must be the same
  // on every rank; the sum of this rank's segment sizes must equal counts[rank()].
  // Blocks may not overlap; gaps between them are left untouched.
  void all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                    std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                    Deadline deadline);

  // Variable-size gather into scattered destinations: rank r's counts[r] bytes fill, in order,
  // the pieces pieces[first[r]] .. pieces[first[r + 1] - 1] (first has size() + 1 entries and
  // the pieces of rank r hold exactly counts[r] bytes). Pieces must not overlap.
  void all_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                          std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                          Deadline deadline);

  void barrier(Deadline deadline);

  // Wakes every blocked call of this communicator (threads backend: of the whole group) with
  // Aborted and poisons it. Thread-safe, idempotent, never blocks.
  void abort() noexcept;

  [[nodiscard]] bool is_poisoned() const noexcept { return poisoned_.load(); }

  // Whether small all_gathers travel through host shared memory (see enable_host_mailbox).
  [[nodiscard]] bool uses_host_mailbox() const noexcept { return mailbox_ != nullptr; }

  // Collectives issued through this communicator (all kinds), for tests and benchmarks.
  [[nodiscard]] std::uint64_t collectives_issued() const noexcept {
    return collectives_.load(std::memory_order_relaxed);
  }

  // An interrupt check for embedders (the Python binding turns Ctrl-C into KeyboardInterrupt
  // with it). Blocking waits call it on the waiting thread about every 100 ms; when it returns
  // true the wait ends with Aborted and the communicator is poisoned. Set it only while no call
  // is running; an empty function removes it.
  void set_interrupt_check(std::function<bool()> check) { interrupt_check_ = std::move(check); }

  // Per-communicator default timeout for operations that do not set their own.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  void set_timeout(std::chrono::milliseconds timeout) noexcept { timeout_ = timeout; }
  [[nodiscard]] Deadline deadline_after(std::chrono::milliseconds timeout) const noexcept;

  // Operation sequence numbers: every foreach call takes the next one and puts it in its
  // pre-flight header, so skewed call sequences are detected instead of mis-paired.
  std::uint64_t next_op_seq() noexcept { return ++op_seq_; }

 protected:
  virtual void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                             Deadline deadline) = 0;
  virtual void do_all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                               std::span<const std::uint64_t> counts,
                               std::span<const std::uint64_t> displs, Deadline deadline) = 0;
  virtual void do_all_gather_scatter(std::span<const ConstSegment> send,
                                     std::span<const RecvPiece> pieces,
                                     std::span<const std::size_t> first,
                                     std::span<const std::uint64_t> counts, Deadline deadline) = 0;
  virtual void do_barrier(Deadline deadline) = 0;
  virtual void do_abort() noexcept = 0;

  // Collective; a backend's constructor may call it once. When every rank is on this host and
  // all can map one /dev/shm object, all_gather() of at most 1 KiB per rank (the pre-flight
  // header, setup records) and barrier() then go through that shared memory instead of
  // do_all_gather() and do_barrier(): for backends whose small-message latency is high (a Gloo
  // round trip through its loop thread). Otherwise nothing changes. Waits there honour the
  // deadline, abort(), the interrupt check, and see a peer process that exited. Returns whether it
  // is in use.
  bool enable_host_mailbox(Deadline deadline);

  // Backends call this when they discover the communicator is unusable (a peer aborted).
  void poison(std::string_view reason) noexcept;

  // Backends call this from their wait loops; it runs the interrupt check at most every 100 ms
  // and raises Aborted (after do_abort()) when it asks to stop.
  void check_interrupt();

 private:
  template <typename Fn>
  void run_collective(std::string_view what, Fn&& fn);
  // Through mailbox_ (set), with this communicator's interrupt check between sleeps.
  void gather_in_mailbox(std::span<const std::byte> send, std::span<std::byte> recv,
                         Deadline deadline);

  std::atomic<bool> poisoned_{false};
  std::atomic<std::uint64_t> collectives_{0};
  std::chrono::milliseconds timeout_{kDefaultTimeout};
  std::uint64_t op_seq_ = 0;
  std::function<bool()> interrupt_check_;
  Clock::time_point last_interrupt_check_{};
  mutable std::mutex reason_mu_;
  std::string poison_reason_;                     // the first reason; guarded by reason_mu_
  std::unique_ptr<detail::HostMailbox> mailbox_;  // set once, by the backend's constructor
};

}  // namespace shardgather
