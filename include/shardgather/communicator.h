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
//  4. Buffers are host memory (the *_device calls' are device memory); the caller keeps them
//     alive and unmodified until the call returns.
//  5. Operations started asynchronously (Work, work.h) run on this communicator's progress
//     thread, one after another in the order they were started; a blocking operation runs on
//     the calling thread once every operation started before it has completed. The raw
//     collectives of this interface are not ordered with started operations: wait for them
//     first.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "shardgather/export.h"
#include "shardgather/types.h"

namespace shardgather {

namespace detail {
class OpQueue;
}  // namespace detail

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// Facts a backend states about its transport (never tuning numbers: thresholds live with
// strategy selection).
struct Capabilities {
  // Each byte is copied straight from the sender's memory by the receiver (threads): a
  // node-shared window could only add copies.
  bool reads_peer_memory = false;
  // Small all_gathers and barriers travel through host shared memory (the torch backend's host
  // mailbox), so a node-shared window's barriers cost a futex rendezvous, not a network round
  // trip.
  bool small_messages_in_shared_memory = false;
  // all_gather_v moves exactly each rank's bytes (threads, MPI, Gloo point to point). False: the
  // transport has only the equal-size all_gather (c10d's allgather), all_gather_v and
  // all_gather_scatter raise InvalidArgument, and the strategy layer pads
  // (src/strategies/padded.cc).
  bool gather_v = true;
  // all_gather_scatter lands bytes in strided pieces itself (threads, MPI derived datatypes).
  // False: the strategy layer gathers rank-major and copies out.
  bool scatter = true;
  // all_to_all_scatter moves each pair's bytes point to point (threads, MPI, Gloo point to
  // point). False: it raises InvalidArgument, and kHierarchical runs kDirect (kPadded without
  // gather_v) instead.
  bool all_to_all = true;
  // all_gather_v_device and all_to_all_v_device move device (CUDA) memory: threads in a CUDA build
  // (cudaMemcpyAsync between the ranks' buffers on one process's devices), torch groups (NCCL on
  // the tensors themselves; Gloo stages them). False: a call on CUDA tensors raises InvalidArgument
  // on every rank (MPI: this build does not assume a CUDA-aware MPI).
  bool device_memory = false;
  // How all_to_all_scatter moves where a backend has several ways that do not pair with each
  // other (MPI: 0 point to point, 1 one MPI_Ialltoallw; MpiOptions::exchange); 0 elsewhere. The
  // pre-flight header carries it, so ranks that differ raise Mismatch before anything moves.
  std::uint8_t exchange_form = 0;
};

// Which collectives all_gather_v_device issues where a transport has a choice (torch groups,
// whose device collectives are c10d's: an all-gather of equal blocks and broadcasts). The
// strategy layer chooses (src/strategies/device.cc), the same on every rank; a transport with
// one way of moving device bytes (threads: copies between the ranks' buffers) ignores it.
enum class DeviceGatherForm : std::uint8_t {
  // Every rank's block padded to the widest count, one all-gather of equal blocks, each rank's
  // real bytes copied out (no copy where the blocks are equal and adjacent in `recv`).
  kPadded = 0,
  // One broadcast per rank with bytes, straight into its slot of `recv`.
  kBroadcast = 1,
};

// Used when neither the call nor the communicator sets a timeout. Gloo uses 30 s; a large
// checkpoint gather can legitimately take longer, so the default is generous.
inline constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(10)};

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
  // cores): copy kernels size their thread count from it, and the node-shared window needs all.
  [[nodiscard]] virtual int ranks_on_host() const noexcept = 0;
  // Which host each rank is on: element r is rank r's host, numbered 0, 1, ... in the order of
  // each host's lowest rank, the same on every rank. Empty where the backend cannot tell (the
  // hierarchical strategy then does not run). Consistent with ranks_on_host().
  [[nodiscard]] virtual std::span<const int> hosts() const noexcept = 0;
  // Facts about how this transport moves bytes; the strategy layer (src/strategies/select.cc)
  // turns them into choices. Must be the same on every rank.
  [[nodiscard]] virtual Capabilities capabilities() const noexcept = 0;

  // Equal-size gather: rank r's `send` lands at recv[r * send.size()]. recv.size() must be
  // size() * send.size(), and send.size() the same on every rank.
  void all_gather(std::span<const std::byte> send, std::span<std::byte> recv, Deadline deadline);

  // Variable-size gather (where capabilities().gather_v): rank r's bytes (the concatenation of
  // its segments, counts[r] bytes in all) land at recv + displs[r]. counts and displs have size()
  // entries and must be the same on every rank; the sum of this rank's segment sizes must equal
  // counts[rank()]. Blocks may not overlap; gaps between them are left untouched.
  void all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                    std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                    Deadline deadline);

  // The device path's one collective (where capabilities().device_memory): all_gather_v over
  // device memory on `device`, ordered on `stream` (a cudaStream_t; nullptr the legacy default
  // stream): it reads `send` after the work enqueued there before it, and work enqueued after it
  // sees `recv` filled. It returns once the collective is enqueued, without waiting for the
  // device (a transport whose collective runs on the host, Gloo, returns after that ran); it
  // never synchronises a stream on the host. `form` says which collectives move the bytes where
  // the transport has a choice; every rank must pass the same.
  void all_gather_v_device(std::span<const ConstSegment> send, std::byte* recv,
                           std::span<const std::uint64_t> counts,
                           std::span<const std::uint64_t> displs, DeviceGatherForm form,
                           const Device& device, void* stream, Deadline deadline);

  // The device path's personal exchange (where capabilities().device_memory): `send` holds, in
  // rank order and adjacent, send_counts[p] bytes for each peer p; from each peer q
  // recv_counts[q] bytes land in `recv`, adjacent in rank order. This rank's own counts must be 0
  // (its own bytes are the caller's copy). What q sends to r must be exactly what r expects from
  // q (the threads backend checks every pair and raises Mismatch on every rank). Device memory
  // on `device`, ordered on `stream` as all_gather_v_device; returns once enqueued.
  void all_to_all_v_device(const std::byte* send, std::span<const std::uint64_t> send_counts,
                           std::byte* recv, std::span<const std::uint64_t> recv_counts,
                           const Device& device, void* stream, Deadline deadline);

  // Variable-size gather into scattered destinations (where capabilities().scatter): rank r's
  // counts[r] bytes fill, in order,
  // the pieces pieces[first[r]] .. pieces[first[r + 1] - 1] (first has size() + 1 entries and
  // the pieces of rank r hold exactly counts[r] bytes). Pieces must not overlap.
  void all_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                          std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                          Deadline deadline);

  // Variable-size gather to one rank (where capabilities().gather_v): rank r's counts[r] bytes
  // fill root's pieces as for all_gather_scatter; every other rank only sends, and its `pieces`
  // and `first` may be empty (they are not read). Every backend lands the bytes in place at the
  // root, scattered or not (MPI: derived datatypes; threads: the root copies from each sender;
  // torch groups: point to point through bounded chunks), and sends nothing to the non-roots.
  void gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                      std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                      int root, Deadline deadline);

  // Personalised exchange (where capabilities().all_to_all): this rank sends peer p the segments
  // send[send_first[p] .. send_first[p + 1]) in order, and receives from peer q into the pieces
  // pieces[first[q] .. first[q + 1]) in order; send_first and first have size() + 1 entries.
  // Pairs with nothing to move cost nothing, and this rank's own entry is copied locally. What q
  // sends to r must be exactly what r's pieces from q hold: callers derive both sides from facts
  // every rank shares (the pre-flight header's counts). The threads backend checks every pair
  // and raises Mismatch on every rank; MPI raises on a receive too small for its message (and a
  // sender whose message is never matched waits to its deadline); Gloo fails the pair's works.
  void all_to_all_scatter(std::span<const ConstSegment> send,
                          std::span<const std::size_t> send_first,
                          std::span<const RecvPiece> pieces, std::span<const std::size_t> first,
                          Deadline deadline);

  void barrier(Deadline deadline);

  // Wakes every blocked call of this communicator (threads backend: of the whole group) with
  // Aborted and poisons it. Thread-safe, idempotent, never blocks.
  void abort() noexcept;

  [[nodiscard]] bool is_poisoned() const noexcept { return poisoned_.load(); }

  // Collectives issued through this communicator (all kinds), for tests and benchmarks.
  [[nodiscard]] std::uint64_t collectives_issued() const noexcept {
    return collectives_.load(std::memory_order_relaxed);
  }

  // Operations (calls) made on this communicator, each with its sequence number: a compound
  // operation that is one call counts once, whatever its collectives. For tests and benchmarks.
  [[nodiscard]] std::uint64_t calls_issued() const noexcept;

  // Bytes all_to_all_scatter moved to and from the other ranks of this communicator (this rank's
  // own entry, copied locally, excluded), counted when each exchange completed: what a reshard
  // puts on the wire, for tests and benchmarks.
  [[nodiscard]] std::uint64_t exchange_bytes_sent() const noexcept {
    return p2p_sent_.load(std::memory_order_relaxed);
  }
  [[nodiscard]] std::uint64_t exchange_bytes_received() const noexcept {
    return p2p_received_.load(std::memory_order_relaxed);
  }

  // An interrupt check for embedders (the Python binding turns Ctrl-C into KeyboardInterrupt
  // with it), for the calling thread: the blocking waits of this thread (on any communicator)
  // call it about every 100 ms, and when it returns true the wait ends with Aborted and that
  // communicator is poisoned. Other threads (a progress thread) never run it. An empty
  // function removes it.
  static void set_interrupt_check(std::function<bool()> check);
  // Whether the calling thread has an interrupt check: a backend whose waits cannot be sliced
  // then waits on a helper thread so that this one can run the check.
  [[nodiscard]] static bool has_interrupt_check() noexcept;
  // Runs the calling thread's interrupt check (at most every 100 ms) and raises Aborted, after
  // aborting this communicator, when it asks to stop. Backends call it from their wait loops.
  void check_interrupt();

  // Per-communicator default timeout for operations that do not set their own. Thread-safe.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed));
  }
  void set_timeout(std::chrono::milliseconds timeout) noexcept {
    timeout_ms_.store(timeout.count(), std::memory_order_relaxed);
  }
  [[nodiscard]] Deadline deadline_after(std::chrono::milliseconds timeout) const noexcept;

  // The operation layer's state for this communicator: the order of its operations and the
  // progress thread that runs started (asynchronous) ones. Not for direct use.
  [[nodiscard]] detail::OpQueue& operations() noexcept { return *ops_; }

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
  virtual void do_gather_scatter(std::span<const ConstSegment> send,
                                 std::span<const RecvPiece> pieces,
                                 std::span<const std::size_t> first,
                                 std::span<const std::uint64_t> counts, int root,
                                 Deadline deadline) = 0;
  virtual void do_all_to_all_scatter(std::span<const ConstSegment> send,
                                     std::span<const std::size_t> send_first,
                                     std::span<const RecvPiece> pieces,
                                     std::span<const std::size_t> first, Deadline deadline) = 0;
  // Default: raises InvalidArgument (no device memory); see Capabilities::device_memory.
  virtual void do_all_gather_v_device(std::span<const ConstSegment> send, std::byte* recv,
                                      std::span<const std::uint64_t> counts,
                                      std::span<const std::uint64_t> displs, DeviceGatherForm form,
                                      const Device& device, void* stream, Deadline deadline);
  // Default: raises InvalidArgument (no device memory); see Capabilities::device_memory.
  virtual void do_all_to_all_v_device(const std::byte* send,
                                      std::span<const std::uint64_t> send_counts, std::byte* recv,
                                      std::span<const std::uint64_t> recv_counts,
                                      const Device& device, void* stream, Deadline deadline);
  virtual void do_barrier(Deadline deadline) = 0;
  virtual void do_abort() noexcept = 0;

  // Every backend's destructor calls this first: an operation started on this communicator and
  // still running uses the backend's members, so it must end before they are destroyed.
  // Waits for started operations (each bounded by its deadline); idempotent.
  void finish_operations() noexcept;

  // Backends call this when they discover the communicator is unusable (a peer aborted).
  void poison(std::string_view reason) noexcept;

 private:
  template <typename Fn>
  void run_collective(std::string_view what, Fn&& fn);
  // InvalidArgument unless counts, displs and the send segments fit a gather-v of this group.
  void check_gather_v(std::string_view what, std::span<const ConstSegment> send,
                      std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                      const std::byte* recv) const;

  std::atomic<bool> poisoned_{false};
  std::atomic<std::uint64_t> collectives_{0};
  std::atomic<std::uint64_t> p2p_sent_{0};
  std::atomic<std::uint64_t> p2p_received_{0};
  std::atomic<std::chrono::milliseconds::rep> timeout_ms_{kDefaultTimeout.count()};
  mutable std::mutex reason_mu_;
  std::string poison_reason_;  // the first reason; guarded by reason_mu_
  std::unique_ptr<detail::OpQueue> ops_;
};

}  // namespace shardgather
