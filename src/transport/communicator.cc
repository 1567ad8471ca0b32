#include "shardgather/communicator.h"

#include <numeric>
#include <string>

#include "transport/op_queue.h"

#include "shardgather/errors.h"

namespace shardgather {

Communicator::Communicator() : ops_(std::make_unique<detail::OpQueue>()) {}
Communicator::~Communicator() = default;

void Communicator::finish_operations() noexcept { ops_->stop(); }

std::uint64_t Communicator::calls_issued() const noexcept { return ops_->seqs_taken(); }

Deadline Communicator::deadline_after(std::chrono::milliseconds timeout) const noexcept {
  const Deadline now = Clock::now();
  // Saturate: "a very long timeout" must not wrap into the past.
  if (timeout >= std::chrono::duration_cast<std::chrono::milliseconds>(Deadline::max() - now)) {
    return Deadline::max();
  }
  return now + timeout;
}

void Communicator::poison(std::string_view reason) noexcept {
  {
    const std::lock_guard<std::mutex> lock(reason_mu_);
    if (poison_reason_.empty()) {
      poison_reason_ = reason;
    }
  }
  poisoned_.store(true);
}

template <typename Fn>
void Communicator::run_collective(std::string_view what, Fn&& fn) {
  if (poisoned_.load()) {
    std::string reason;
    {
      const std::lock_guard<std::mutex> lock(reason_mu_);
      reason = poison_reason_;
    }
    throw CommAborted("rank " + std::to_string(rank()) + ": " + std::string(what) + " on a " +
                      std::string(backend_name()) + " communicator poisoned earlier (" + reason +
                      "); create a new communicator");
  }
  collectives_.fetch_add(1, std::memory_order_relaxed);
  try {
    fn();
  } catch (const CommunicationError& e) {
    poison(e.what());
    throw;
  }
}

void Communicator::all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                              Deadline deadline) {
  if (recv.size() != send.size() * static_cast<std::size_t>(size())) {
    throw InvalidArgument("rank " + std::to_string(rank()) + ": all_gather: recv holds " +
                          std::to_string(recv.size()) + " bytes, expected " +
                          std::to_string(send.size()) + " x " + std::to_string(size()));
  }
  run_collective("all_gather", [&] { do_all_gather(send, recv, deadline); });
}

void Communicator::check_gather_v(std::string_view what, std::span<const ConstSegment> send,
                                  std::span<const std::uint64_t> counts,
                                  std::span<const std::uint64_t> displs,
                                  const std::byte* recv) const {
  const auto world = static_cast<std::size_t>(size());
  if (counts.size() != world || displs.size() != world) {
    throw InvalidArgument("rank " + std::to_string(rank()) + ": " + std::string(what) + ": " +
                          std::to_string(counts.size()) + " counts and " +
                          std::to_string(displs.size()) + " displs for world size " +
                          std::to_string(world));
  }
  std::uint64_t total = 0;
  for (const ConstSegment& segment : send) {
    if (segment.data == nullptr && segment.size != 0) {
      throw InvalidArgument("rank " + std::to_string(rank()) + ": " + std::string(what) +
                            ": null send segment");
    }
    total += segment.size;
  }
  const auto me = static_cast<std::size_t>(rank());
  if (total != counts[me]) {
    throw InvalidArgument("rank " + std::to_string(rank()) + ": " + std::string(what) + ": sends " +
                          std::to_string(total) + " bytes but counts[" + std::to_string(me) +
                          "] is " + std::to_string(counts[me]));
  }
  if (recv == nullptr && std::accumulate(counts.begin(), counts.end(), std::uint64_t{0}) != 0) {
    throw InvalidArgument("rank " + std::to_string(rank()) + ": " + std::string(what) +
                          ": null recv buffer");
  }
}

void Communicator::all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                                std::span<const std::uint64_t> counts,
                                std::span<const std::uint64_t> displs, Deadline deadline) {
  if (!capabilities().gather_v) {
    throw InvalidArgument("rank " + std::to_string(rank()) + ": all_gather_v: the " +
                          std::string(backend_name()) +
                          " transport has no exact gather-v (capabilities().gather_v is false); "
                          "the operations pad through all_gather");
  }
  check_gather_v("all_gather_v", send, counts, displs, recv);
  run_collective("all_gather_v", [&] { do_all_gather_v(send, recv, counts, displs, deadline); });
}

void Communicator::all_gather_v_device(std::span<const ConstSegment> send, std::byte* recv,
                                       std::span<const std::uint64_t> counts,
                                       std::span<const std::uint64_t> displs, DeviceGatherForm form,
                                       const Device& device, void* stream, Deadline deadline) {
  if (!capabilities().device_memory) {
    throw InvalidArgument("rank " + std::to_string(rank()) + ": all_gather_v_device: the " +
                          std::string(backend_name()) +
                          " transport moves host memory only (capabilities().device_memory is "
                          "false)");
  }
  check_gather_v("all_gather_v_device", send, counts, displs, recv);
  run_collective("all_gather_v_device", [&] {
    do_all_gather_v_device(send, recv, counts, displs, form, device, stream, deadline);
  });
}

void Communicator::do_all_gather_v_device(std::span<const ConstSegment> /*send*/,
                                          std::byte* /*recv*/,
                                          std::span<const std::uint64_t> /*counts*/,
                                          std::span<const std::uint64_t> /*displs*/,
                                          DeviceGatherForm /*form*/, const Device& /*device*/,
                                          void* /*stream*/, Deadline /*deadline*/) {
  throw InvalidArgument("all_gather_v_device: the " + std::string(backend_name()) +
                        " backend does not move device memory");
}

void Communicator::all_to_all_v_device(const std::byte* send,
                                       std::span<const std::uint64_t> send_counts, std::byte* recv,
                                       std::span<const std::uint64_t> recv_counts,
                                       const Device& device, void* stream, Deadline deadline) {
  const auto fail = [this](const std::string& what) {
    throw InvalidArgument("rank " + std::to_string(rank()) + ": all_to_all_v_device: " + what);
  };
  if (!capabilities().device_memory) {
    fail("the " + std::string(backend_name()) +
         " transport moves host memory only (capabilities().device_memory is false)");
  }
  const auto world = static_cast<std::size_t>(size());
  const auto me = static_cast<std::size_t>(rank());
  if (send_counts.size() != world || recv_counts.size() != world) {
    fail(std::to_string(send_counts.size()) + " send and " + std::to_string(recv_counts.size()) +
         " receive counts for " + std::to_string(world) + " ranks");
  }
  if (send_counts[me] != 0 || recv_counts[me] != 0) {
    fail("this rank's own counts are " + std::to_string(send_counts[me]) + " and " +
         std::to_string(recv_counts[me]) + " (its own bytes are the caller's copy: 0 expected)");
  }
  const std::uint64_t sent = std::accumulate(send_counts.begin(), send_counts.end(), 0ULL);
  const std::uint64_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), 0ULL);
  if ((sent != 0 && send == nullptr) || (received != 0 && recv == nullptr)) {
    fail("a null buffer for " + std::to_string(sent) + " bytes sent and " +
         std::to_string(received) + " received");
  }
  run_collective("all_to_all_v_device", [&] {
    do_all_to_all_v_device(send, send_counts, recv, recv_counts, device, stream, deadline);
  });
  p2p_sent_.fetch_add(sent, std::memory_order_relaxed);
  p2p_received_.fetch_add(received, std::memory_order_relaxed);
}

void Communicator::do_all_to_all_v_device(const std::byte* /*send*/,
                                          std::span<const std::uint64_t> /*send_counts*/,
                                          std::byte* /*recv*/,
                                          std::span<const std::uint64_t> /*recv_counts*/,
                                          const Device& /*device*/, void* /*stream*/,
                                          Deadline /*deadline*/) {
  throw InvalidArgument("all_to_all_v_device: the " + std::string(backend_name()) +
                        " backend does not move device memory");
}

namespace {

// InvalidArgument unless pieces[first[r] .. first[r + 1]) hold exactly counts[r] bytes for every
// rank (`check_pieces`) and this rank's segments hold counts[rank].
void check_gather_args(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                       std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                       int rank, int world_size, bool check_pieces, const char* what) {
  // Built only on failure: a steady-state call allocates nothing.
  const auto where = [&] { return "rank " + std::to_string(rank) + ": " + what + ": "; };
  const auto world = static_cast<std::size_t>(world_size);
  if (counts.size() != world) {
    throw InvalidArgument(where() + std::to_string(counts.size()) + " counts for world size " +
                          std::to_string(world));
  }
  if (check_pieces) {
    if (first.size() != world + 1 || first[0] != 0 || first[world] != pieces.size()) {
      throw InvalidArgument(where() + "counts/first do not describe " + std::to_string(world) +
                            " ranks over " + std::to_string(pieces.size()) + " pieces");
    }
    for (std::size_t r = 0; r < world; ++r) {
      if (first[r + 1] < first[r]) {
        throw InvalidArgument(where() + "first is not monotone at rank " + std::to_string(r));
      }
      std::uint64_t bytes = 0;
      for (std::size_t k = first[r]; k < first[r + 1]; ++k) {
        bytes += pieces[k].block * pieces[k].count;
      }
      if (bytes != counts[r]) {
        throw InvalidArgument(where() + "the pieces of rank " + std::to_string(r) + " hold " +
                              std::to_string(bytes) + " bytes, counts says " +
                              std::to_string(counts[r]));
      }
    }
  }
  std::uint64_t total = 0;
  for (const ConstSegment& segment : send) {
    total += segment.size;
  }
  const auto me = static_cast<std::size_t>(rank);
  if (total != counts[me]) {
    throw InvalidArgument(where() + "sends " + std::to_string(total) + " bytes but counts[" +
                          std::to_string(me) + "] is " + std::to_string(counts[me]));
  }
}

}  // namespace

void Communicator::all_gather_scatter(std::span<const ConstSegment> send,
                                      std::span<const RecvPiece> pieces,
                                      std::span<const std::size_t> first,
                                      std::span<const std::uint64_t> counts, Deadline deadline) {
  if (!capabilities().scatter) {
    throw InvalidArgument("rank " + std::to_string(rank()) + ": all_gather_scatter: the " +
                          std::string(backend_name()) +
                          " transport does not scatter (capabilities().scatter is false); the "
                          "operations gather rank-major and copy out");
  }
  check_gather_args(send, pieces, first, counts, rank(), size(), true, "all_gather_scatter");
  run_collective("all_gather_scatter",
                 [&] { do_all_gather_scatter(send, pieces, first, counts, deadline); });
}

void Communicator::gather_scatter(std::span<const ConstSegment> send,
                                  std::span<const RecvPiece> pieces,
                                  std::span<const std::size_t> first,
                                  std::span<const std::uint64_t> counts, int root,
                                  Deadline deadline) {
  const auto where = [this] { return "rank " + std::to_string(rank()) + ": gather_scatter: "; };
  if (!capabilities().gather_v) {
    throw InvalidArgument(where() + "the " + std::string(backend_name()) +
                          " transport has no exact gather-v (capabilities().gather_v is false), "
                          "so it cannot gather to one rank");
  }
  if (root < 0 || root >= size()) {
    throw InvalidArgument(where() + "root " + std::to_string(root) + " is not a rank of " +
                          std::to_string(size()));
  }
  check_gather_args(send, pieces, first, counts, rank(), size(), rank() == root, "gather_scatter");
  run_collective("gather_scatter",
                 [&] { do_gather_scatter(send, pieces, first, counts, root, deadline); });
}

namespace {

// InvalidArgument unless `first` splits `entries` items over `world` ranks, in order.
void check_split(std::span<const std::size_t> first, std::size_t entries, std::size_t world,
                 int rank, const char* name) {
  // Built only on failure: a steady-state call allocates nothing.
  const auto fail = [&](const std::string& what) {
    throw InvalidArgument("rank " + std::to_string(rank) + ": all_to_all_scatter: " + name + " " +
                          what);
  };
  if (first.size() != world + 1 || first[0] != 0 || first[world] != entries) {
    fail("does not split " + std::to_string(entries) + " entries over " + std::to_string(world) +
         " ranks");
  }
  for (std::size_t r = 0; r < world; ++r) {
    if (first[r + 1] < first[r]) {
      fail("is not monotone at rank " + std::to_string(r));
    }
  }
}

}  // namespace

void Communicator::all_to_all_scatter(std::span<const ConstSegment> send,
                                      std::span<const std::size_t> send_first,
                                      std::span<const RecvPiece> pieces,
                                      std::span<const std::size_t> first, Deadline deadline) {
  if (!capabilities().all_to_all) {
    throw InvalidArgument("rank " + std::to_string(rank()) + ": all_to_all_scatter: the " +
                          std::string(backend_name()) +
                          " transport has no point-to-point exchange (capabilities().all_to_all "
                          "is false)");
  }
  const auto world = static_cast<std::size_t>(size());
  check_split(send_first, send.size(), world, rank(), "send_first");
  check_split(first, pieces.size(), world, rank(), "first");
  run_collective("all_to_all_scatter",
                 [&] { do_all_to_all_scatter(send, send_first, pieces, first, deadline); });
  // Counted once the exchange completed: what went to and came from the other ranks.
  std::uint64_t sent = 0;
  std::uint64_t received = 0;
  const auto me = static_cast<std::size_t>(rank());
  for (std::size_t p = 0; p < world; ++p) {
    if (p == me) {
      continue;
    }
    for (std::size_t k = send_first[p]; k < send_first[p + 1]; ++k) {
      sent += send[k].size;
    }
    for (std::size_t k = first[p]; k < first[p + 1]; ++k) {
      received += pieces[k].block * pieces[k].count;
    }
  }
  p2p_sent_.fetch_add(sent, std::memory_order_relaxed);
  p2p_received_.fetch_add(received, std::memory_order_relaxed);
}

void Communicator::barrier(Deadline deadline) {
  run_collective("barrier", [&] { do_barrier(deadline); });
}

namespace {
// The calling thread's interrupt check and when it last ran (see set_interrupt_check).
thread_local std::function<bool()> t_interrupt_check;
thread_local Clock::time_point t_last_interrupt_check{};
}  // namespace

void Communicator::set_interrupt_check(std::function<bool()> check) {
  t_interrupt_check = std::move(check);
}

bool Communicator::has_interrupt_check() noexcept { return static_cast<bool>(t_interrupt_check); }

void Communicator::check_interrupt() {
  if (!t_interrupt_check) {
    return;
  }
  const Clock::time_point now = Clock::now();
  if (now - t_last_interrupt_check < std::chrono::milliseconds(100)) {
    return;
  }
  t_last_interrupt_check = now;
  if (t_interrupt_check()) {
    poison("interrupted on rank " + std::to_string(rank()));
    do_abort();
    throw Aborted("rank " + std::to_string(rank()) +
                  ": interrupted (a signal arrived while the "
                  "call waited); the communicator is poisoned");
  }
}

void Communicator::abort() noexcept {
  poison("abort() was called on rank " + std::to_string(rank()));
  do_abort();
}

}  // namespace shardgather
