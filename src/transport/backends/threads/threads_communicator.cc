#include "transport/backends/threads/threads_communicator.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <numeric>
#include <string>

#include "copies/device_runtime.h"

#include "shardgather/copy.h"
#include "shardgather/threads.h"

namespace shardgather {

namespace detail {

namespace {

std::vector<int> count_per_host(const std::vector<int>& hosts) {
  std::vector<int> counts(hosts.size());
  for (std::size_t r = 0; r < hosts.size(); ++r) {
    counts[r] = static_cast<int>(std::count(hosts.begin(), hosts.end(), hosts[r]));
  }
  return counts;
}

}  // namespace

GroupState::GroupState(int world, std::vector<int> host_of_rank)
    : world_size(world),
      hosts(std::move(host_of_rank)),
      ranks_on_host(count_per_host(hosts)),
      slots(static_cast<std::size_t>(world)) {}

void ThreadsCommunicator::meet(Deadline deadline, const char* what) {
  GroupState& g = *group_;
  std::unique_lock<std::mutex> lock(g.mu);
  const auto fail = [&]() {
    throw_error(g.abort_code,
                "rank " + std::to_string(rank_) + ": " + what + " failed: " + g.abort_reason);
  };
  if (g.aborted) {
    fail();
  }
  const std::uint64_t generation = g.generation;
  if (++g.arrived == g.world_size) {
    g.arrived = 0;
    ++g.generation;
    g.cv.notify_all();
    return;
  }
  while (g.generation == generation && !g.aborted) {
    // Wake at least every 100 ms for the interrupt check, which runs without the group lock.
    const Deadline slice = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
    if (g.cv.wait_until(lock, slice) != std::cv_status::timeout || g.generation != generation ||
        g.aborted) {
      continue;
    }
    if (Clock::now() < deadline) {
      lock.unlock();
      check_interrupt();
      lock.lock();
      continue;
    }
    {
      // Poison the group so the peers wake now with the same class instead of each waiting
      // out its own deadline (and so a late rank cannot pair with a stale barrier).
      const int arrived = g.arrived;
      g.aborted = true;
      g.abort_code = ErrorCode::kTimeout;
      g.abort_reason = "rank " + std::to_string(rank_) + " timed out in " + what + " with " +
                       std::to_string(arrived) + " of " + std::to_string(g.world_size) +
                       " ranks arrived";
      g.cv.notify_all();
      fail();
    }
  }
  if (g.generation == generation) {
    fail();
  }
}

void ThreadsCommunicator::do_abort() noexcept {
  GroupState& g = *group_;
  const std::lock_guard<std::mutex> lock(g.mu);
  if (!g.aborted) {
    g.aborted = true;
    g.abort_code = ErrorCode::kAborted;
    g.abort_reason = "abort() was called on rank " + std::to_string(rank_);
  }
  g.cv.notify_all();
}

void ThreadsCommunicator::do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                                        Deadline deadline) {
  GroupState& g = *group_;
  const auto me = static_cast<std::size_t>(rank_);
  g.slots[me] = GroupState::Slot{.segments = {}, .flat = send, .bytes = send.size(), .counts = {}};
  meet(deadline, "all_gather");
  // Every rank reaches the same verdict from the same slots, so all raise or none does.
  std::string error;
  for (std::size_t r = 1; r < g.slots.size(); ++r) {
    if (g.slots[r].bytes != g.slots[0].bytes) {
      error = "rank " + std::to_string(rank_) + ": all_gather: rank " + std::to_string(r) +
              " sends " + std::to_string(g.slots[r].bytes) + " bytes, rank 0 sends " +
              std::to_string(g.slots[0].bytes);
      break;
    }
  }
  if (error.empty()) {
    for (std::size_t k = 0; k < g.slots.size(); ++k) {
      const std::size_t r = (me + k) % g.slots.size();
      if (!send.empty()) {
        std::memcpy(recv.data() + r * send.size(), g.slots[r].flat.data(), send.size());
      }
    }
  }
  meet(deadline, "all_gather");
  if (!error.empty()) {
    throw Mismatch(error);
  }
}

std::string ThreadsCommunicator::count_error(const char* what) const {
  const GroupState& g = *group_;
  for (std::size_t q = 0; q < g.slots.size(); ++q) {
    for (std::size_t r = 0; r < g.slots.size(); ++r) {
      if (g.slots[q].counts[r] != g.slots[r].bytes) {
        return "rank " + std::to_string(rank_) + ": " + what + ": rank " + std::to_string(q) +
               " expects " + std::to_string(g.slots[q].counts[r]) + " bytes from rank " +
               std::to_string(r) + ", which sends " + std::to_string(g.slots[r].bytes);
      }
    }
  }
  return {};
}

template <typename CopyFn>
void ThreadsCommunicator::exchange(std::span<const ConstSegment> send,
                                   std::span<const std::uint64_t> counts, Deadline deadline,
                                   const char* what, int root, CopyFn&& copy) {
  GroupState& g = *group_;
  const auto me = static_cast<std::size_t>(rank_);
  g.slots[me] =
      GroupState::Slot{.segments = send, .flat = {}, .bytes = counts[me], .counts = counts};
  meet(deadline, what);
  const std::string error = count_error(what);
  if (error.empty() && (root < 0 || root == rank_)) {
    // Start at a different peer on every rank so the readers spread over the sources.
    for (std::size_t k = 0; k < g.slots.size(); ++k) {
      const std::size_t r = (me + k) % g.slots.size();
      copy(r, g.slots[r].segments);
    }
  }
  meet(deadline, what);
  if (!error.empty()) {
    throw Mismatch(error);
  }
}

void ThreadsCommunicator::do_all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                                          std::span<const std::uint64_t> counts,
                                          std::span<const std::uint64_t> displs,
                                          Deadline deadline) {
  exchange(send, counts, deadline, "all_gather_v", -1,
           [&](std::size_t r, std::span<const ConstSegment> segments) {
             copy_segments(segments, recv + displs[r]);
           });
}

template <typename Verdict, typename Copy>
void ThreadsCommunicator::device_exchange(GroupState::Slot slot, const Device& device, void* stream,
                                          Deadline deadline, const char* what, Verdict&& verdict,
                                          Copy&& copy) {
  GroupState& g = *group_;
  const auto me = static_cast<std::size_t>(rank_);
  // Streams, not the host, keep the order: a reader's copies wait for the sender's `ready`
  // (its copy-in has written `send`), and the sender's stream waits for every reader's `done`
  // before anything it enqueues later (a reuse of `send`, its release). A CUDA failure must
  // still reach every rank and must not leave this one between the two meetings: a rank that
  // could not mark its bytes ready says so in its slot.
  std::exception_ptr failure;
  try {
    const CurrentDevice on(device.index);
    ready_.record(stream);
  } catch (...) {
    failure = std::current_exception();
  }
  slot.failed = !!failure;
  slot.ready = &ready_;
  slot.done = &done_;
  g.slots[me] = slot;
  meet(deadline, what);
  const std::string mismatch = verdict();
  std::string peer_failed;
  for (std::size_t q = 0; q < g.slots.size() && peer_failed.empty(); ++q) {
    if (g.slots[q].failed) {
      peer_failed = "rank " + std::to_string(rank_) + ": " + what + ": rank " + std::to_string(q) +
                    "'s device failed before it could send";
    }
  }
  const bool copies = mismatch.empty() && peer_failed.empty();
  if (copies) {
    try {
      const CurrentDevice on(device.index);
      copy();
      done_.record(stream);
    } catch (...) {
      failure = failure ? failure : std::current_exception();
    }
  }
  // The slots are read only between the meetings: after the second, a peer may already be
  // publishing its next call's.
  for (std::size_t q = 0; q < g.slots.size(); ++q) {
    peer_done_[q] = g.slots[q].done;
  }
  // The second meeting says every reader has enqueued its copies and recorded its `done` (a
  // reader whose enqueue failed raises alone, as the transport cannot undo what it enqueued)
  // before any sender orders its stream after them.
  meet(deadline, what);
  if (copies) {
    try {
      const CurrentDevice on(device.index);
      for (const DeviceEvent* done : peer_done_) {
        done->order_after(stream);
      }
    } catch (...) {
      failure = failure ? failure : std::current_exception();
    }
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
  if (!mismatch.empty()) {
    throw Mismatch(mismatch);
  }
  if (!peer_failed.empty()) {
    throw CommunicationError(peer_failed);
  }
}

void ThreadsCommunicator::do_all_gather_v_device(
    std::span<const ConstSegment> send, std::byte* recv, std::span<const std::uint64_t> counts,
    std::span<const std::uint64_t> displs, DeviceGatherForm /*form: one way here*/,
    const Device& device, void* stream, Deadline deadline) {
  const char* what = "all_gather_v_device";
  device_exchange(
      GroupState::Slot{.segments = send,
                       .flat = {},
                       .bytes = counts[static_cast<std::size_t>(rank_)],
                       .counts = counts},
      device, stream, deadline, what, [&] { return count_error(what); },
      [&] { copy_from_peers(recv, displs, stream); });
}

void ThreadsCommunicator::copy_from_peers(std::byte* recv, std::span<const std::uint64_t> displs,
                                          void* stream) {
  GroupState& g = *group_;
  const auto me = static_cast<std::size_t>(rank_);
  for (std::size_t k = 0; k < g.slots.size(); ++k) {
    const std::size_t r = (me + k) % g.slots.size();
    g.slots[r].ready->order_after(stream);
    std::byte* to = recv + displs[r];
    for (const ConstSegment& segment : g.slots[r].segments) {
      copy_async(to, segment.data, segment.size, stream);
      to += segment.size;
    }
  }
}

void ThreadsCommunicator::do_all_to_all_v_device(const std::byte* send,
                                                 std::span<const std::uint64_t> send_counts,
                                                 std::byte* recv,
                                                 std::span<const std::uint64_t> recv_counts,
                                                 const Device& device, void* stream,
                                                 Deadline deadline) {
  const char* what = "all_to_all_v_device";
  GroupState& g = *group_;
  const auto me = static_cast<std::size_t>(rank_);
  const std::uint64_t sent = std::accumulate(send_counts.begin(), send_counts.end(), 0ULL);
  const auto verdict = [&]() -> std::string {
    // Every pair, on every rank: the same verdict everywhere. A peer in another collective
    // publishes no counts.
    for (std::size_t q = 0; q < g.slots.size(); ++q) {
      if (g.slots[q].counts.size() != g.slots.size() ||
          g.slots[q].expects.size() != g.slots.size()) {
        return "rank " + std::to_string(rank_) + ": " + what + ": rank " + std::to_string(q) +
               " is in another collective";
      }
    }
    for (std::size_t q = 0; q < g.slots.size(); ++q) {
      for (std::size_t r = 0; r < g.slots.size(); ++r) {
        const std::uint64_t out = g.slots[q].counts[r];
        const std::uint64_t in = g.slots[r].expects[q];
        if (out != in) {
          return "rank " + std::to_string(rank_) + ": " + what + ": rank " + std::to_string(q) +
                 " sends " + std::to_string(out) + " bytes to rank " + std::to_string(r) +
                 ", which expects " + std::to_string(in);
        }
      }
    }
    return {};
  };
  const auto copy = [&] {
    std::byte* to = recv;
    for (std::size_t q = 0; q < g.slots.size(); ++q) {
      const GroupState::Slot& peer = g.slots[q];
      if (recv_counts[q] == 0) {
        continue;
      }
      const std::uint64_t at = std::accumulate(
          peer.counts.begin(), peer.counts.begin() + static_cast<std::ptrdiff_t>(me), 0ULL);
      peer.ready->order_after(stream);
      copy_async(to, peer.flat.data() + at, recv_counts[q], stream);
      to += recv_counts[q];
    }
  };
  device_exchange(GroupState::Slot{.segments = {},
                                   .flat = {send, static_cast<std::size_t>(sent)},
                                   .bytes = sent,
                                   .counts = send_counts,
                                   .expects = recv_counts},
                  device, stream, deadline, what, verdict, copy);
}

void ThreadsCommunicator::do_all_gather_scatter(std::span<const ConstSegment> send,
                                                std::span<const RecvPiece> pieces,
                                                std::span<const std::size_t> first,
                                                std::span<const std::uint64_t> counts,
                                                Deadline deadline) {
  exchange(send, counts, deadline, "all_gather_scatter", -1,
           [&](std::size_t r, std::span<const ConstSegment> segments) {
             copy_stream(segments, rank_part(pieces, first, r));
           });
}

void ThreadsCommunicator::do_gather_scatter(std::span<const ConstSegment> send,
                                            std::span<const RecvPiece> pieces,
                                            std::span<const std::size_t> first,
                                            std::span<const std::uint64_t> counts, int root,
                                            Deadline deadline) {
  exchange(send, counts, deadline, "gather_scatter", root,
           [&](std::size_t r, std::span<const ConstSegment> segments) {
             copy_stream(segments, rank_part(pieces, first, r));
           });
}

void ThreadsCommunicator::do_all_to_all_scatter(std::span<const ConstSegment> send,
                                                std::span<const std::size_t> send_first,
                                                std::span<const RecvPiece> pieces,
                                                std::span<const std::size_t> first,
                                                Deadline deadline) {
  GroupState& g = *group_;
  const auto me = static_cast<std::size_t>(rank_);
  g.slots[me] = GroupState::Slot{.segments = send,
                                 .flat = {},
                                 .bytes = 0,
                                 .counts = {},
                                 .send_first = send_first,
                                 .pieces = pieces,
                                 .first = first};
  meet(deadline, "all_to_all_scatter");
  const auto sent = [&](std::size_t q, std::size_t r) {
    const GroupState::Slot& s = g.slots[q];
    return rank_part(s.segments, s.send_first, r);
  };
  const auto received = [&](std::size_t r, std::size_t q) {
    const GroupState::Slot& s = g.slots[r];
    return rank_part(s.pieces, s.first, q);
  };
  // Every pair, on every rank: the same verdict everywhere.
  std::string error;
  for (std::size_t q = 0; q < g.slots.size() && error.empty(); ++q) {
    for (std::size_t r = 0; r < g.slots.size(); ++r) {
      const std::uint64_t out = stream_bytes(sent(q, r));
      const std::uint64_t in = stream_bytes(received(r, q));
      if (out != in) {
        error = "rank " + std::to_string(rank_) + ": all_to_all_scatter: rank " +
                std::to_string(q) + " sends " + std::to_string(out) + " bytes to rank " +
                std::to_string(r) + ", which expects " + std::to_string(in);
        break;
      }
    }
  }
  if (error.empty()) {
    for (std::size_t k = 0; k < g.slots.size(); ++k) {
      const std::size_t q = (me + k) % g.slots.size();
      copy_stream(sent(q, me), received(me, q));
    }
  }
  meet(deadline, "all_to_all_scatter");
  if (!error.empty()) {
    throw Mismatch(error);
  }
}

}  // namespace detail

std::vector<std::unique_ptr<Communicator>> make_thread_group(int world_size) {
  return make_thread_group(world_size,
                           std::vector<int>(static_cast<std::size_t>(std::max(world_size, 0)), 0));
}

std::vector<std::unique_ptr<Communicator>> make_thread_group(int world_size,
                                                             std::vector<int> hosts) {
  if (world_size < 1) {
    throw InvalidArgument("make_thread_group: world size " + std::to_string(world_size) + " < 1");
  }
  if (hosts.size() != static_cast<std::size_t>(world_size)) {
    throw InvalidArgument("make_thread_group: " + std::to_string(hosts.size()) +
                          " hosts for world size " + std::to_string(world_size));
  }
  int next = 0;  // numbered in the order of each host's lowest rank, as Communicator::hosts()
  for (std::size_t r = 0; r < hosts.size(); ++r) {
    if (hosts[r] < 0 || hosts[r] > next) {
      throw InvalidArgument("make_thread_group: hosts[" + std::to_string(r) + "] is " +
                            std::to_string(hosts[r]) +
                            "; hosts are numbered 0, 1, ... in the order of their lowest rank");
    }
    next = std::max(next, hosts[r] + 1);
  }
  auto group = std::make_shared<detail::GroupState>(world_size, std::move(hosts));
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(static_cast<std::size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    comms.push_back(std::make_unique<detail::ThreadsCommunicator>(group, r));
  }
  return comms;
}

}  // namespace shardgather
