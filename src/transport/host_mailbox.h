// A small all-gather among the processes of one host through shared memory: each rank writes
// its bytes into its own slot, then sleeps on a futex until every peer's slot holds the same
// call number. It stands in for a backend round trip on the messages that are all latency (the
// pre-flight header, setup records): over Gloo such a round trip is two hops through the loop
// thread of each side, here it is one store and, when a peer sleeps, one futex wake.
//
// Protocol. Slots come in two sets used by call-number parity. A rank writes call k + 2 into
// the set of call k only after its call k + 1 completed, which needs every peer's k + 1, which
// each peer writes only after it has read all of call k: no slot is overwritten while a peer may
// still read it. Calls are matched by order, as for every collective of a communicator.
//
// Blocking: a wait spins briefly, then sleeps on the futex in slices of at most 20 ms, and
// between slices checks the deadline (Timeout, naming every rank that did not come),
// interrupt() (Aborted), the caller's poll function, and whether a missing peer's process still
// exists (RemoteError: a dead peer is seen within about 100 ms, as a backend sees a closed
// connection). Ranks that send different byte counts all raise Mismatch.
//
// Threading: one thread drives a mailbox at a time; interrupt() may come from any thread.
// Ownership: the mapping belongs to the mailbox; the /dev/shm name is gone once every rank has
// mapped it (see SharedBuffer).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "transport/shared_buffer.h"

#include "shardgather/communicator.h"
#include "shardgather/errors.h"

namespace shardgather::detail {

class HostMailbox {
 public:
  // The most bytes one rank contributes to one call.
  static constexpr std::size_t kSlotBytes = 1024;

  // Collective over `comm`, whose own all_gather carries the setup. nullptr, on every rank,
  // when the ranks are not all on this host or cannot map one shared object (a container with
  // its own /dev/shm, a host name shared by two machines): the caller then keeps using `comm`.
  static std::unique_ptr<HostMailbox> create(Communicator& comm, Deadline deadline);

  HostMailbox(const HostMailbox&) = delete;
  HostMailbox& operator=(const HostMailbox&) = delete;
  HostMailbox(HostMailbox&&) = delete;
  HostMailbox& operator=(HostMailbox&&) = delete;
  ~HostMailbox();

  // send.size() <= kSlotBytes (else InvalidArgument) and the same on every rank (else Mismatch
  // on every rank); rank r's bytes land at recv[r * send.size()]. `poll` runs on this thread
  // between sleeps and may throw.
  void all_gather(std::span<const std::byte> send, std::span<std::byte> recv, Deadline deadline,
                  const std::function<void()>& poll);

  // Wakes this rank's wait, which raises Aborted; every later call raises Aborted at once.
  void interrupt() noexcept;

 private:
  struct Layout;
  HostMailbox(std::unique_ptr<SharedBuffer> buffer, int rank, int size);

  // The first rank in [0, size) other than this one whose slot does not yet hold `call`, or
  // size when all have it.
  [[nodiscard]] int first_missing(std::uint64_t call, int from) const noexcept;
  // Throws RemoteError when the process of a rank from `from` on that has not written `call`
  // is gone (checked at most every 100 ms).
  // `now_or_never`: check even if the last check was less than 100 ms ago.
  void check_alive(std::uint64_t call, int from, const char* what, bool now_or_never = false);
  // Returns once every peer's slot holds `call`; throws Timeout, Aborted, RemoteError (a peer
  // exited or gave up on an exchange up to `call`), or what `poll` throws.
  void wait_for_peers(std::uint64_t call, Deadline deadline, const std::function<void()>& poll);
  // Marks `call` as given up by this rank, with the class it raises, and wakes the waiters.
  void give_up(std::uint64_t call, ErrorCode code) noexcept;
  // When a peer gave up on an exchange up to `call`: Timeout if its deadline passed, else
  // RemoteError, naming the ranks still missing from `missing` on.
  void check_abandoned(std::uint64_t call, int missing);

  std::unique_ptr<SharedBuffer> buffer_;
  int rank_;
  int size_;
  std::uint64_t calls_ = 0;
  std::atomic<bool> interrupted_{false};
  Clock::time_point last_liveness_check_{};
};

}  // namespace shardgather::detail
