// The threads backend's communicator: one per rank over a shared GroupState.
// Public contract: include/shardgather/threads.h.
//
// Design: a gather is "publish, meet, copy, meet". Each rank publishes pointers to its send
// segments in its slot, waits at a barrier, copies every peer's bytes straight from the
// peer's memory into its own recv buffer (the only copy), and meets again so that no rank
// returns, and lets its caller free or reuse the send memory, while a peer still reads it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "copies/device_runtime.h"

#include "shardgather/communicator.h"
#include "shardgather/errors.h"

namespace shardgather::detail {

struct GroupState {
  // hosts[r]: rank r's simulated host (make_thread_group's `hosts`).
  GroupState(int world, std::vector<int> host_of_rank);

  struct Slot {
    std::span<const ConstSegment> segments;  // all_gather_v, all_to_all_scatter
    std::span<const std::byte> flat;         // all_gather
    std::uint64_t bytes = 0;                 // what this rank sends
    std::span<const std::uint64_t> counts;   // all_gather_v: what this rank expects
    // all_to_all_scatter: segments[send_first[p] ..] go to p; pieces[first[q] ..] come from q.
    std::span<const std::size_t> send_first{};
    std::span<const RecvPiece> pieces{};
    std::span<const std::size_t> first{};
    // all_to_all_v_device: what this rank expects from each peer (`counts`: what it sends).
    std::span<const std::uint64_t> expects{};
    // The device calls: this rank's device failed before it could publish ready bytes.
    bool failed = false;
    // The device calls: marks this rank's bytes written (`ready`) and its copies from the
    // peers enqueued (`done`); the rank's own events, recorded on its stream.
    const DeviceEvent* ready = nullptr;
    const DeviceEvent* done = nullptr;
  };

  const int world_size;
  const std::vector<int> hosts;
  const std::vector<int> ranks_on_host;  // per rank: how many ranks share its host
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;               // guarded by mu
  std::uint64_t generation = 0;  // guarded by mu
  bool aborted = false;          // guarded by mu
  ErrorCode abort_code = ErrorCode::kOk;
  std::string abort_reason;
  std::vector<Slot> slots;  // slot r: written by rank r before a barrier, read after it
};

class ThreadsCommunicator final : public Communicator {
 public:
  ThreadsCommunicator(std::shared_ptr<GroupState> group, int rank)
      : group_(std::move(group)),
        rank_(rank),
        peer_done_(static_cast<std::size_t>(group_->world_size)) {}
  ThreadsCommunicator(const ThreadsCommunicator&) = delete;
  ThreadsCommunicator& operator=(const ThreadsCommunicator&) = delete;
  ThreadsCommunicator(ThreadsCommunicator&&) = delete;
  ThreadsCommunicator& operator=(ThreadsCommunicator&&) = delete;
  ~ThreadsCommunicator() override { finish_operations(); }

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return group_->world_size; }
  [[nodiscard]] std::string_view backend_name() const noexcept override { return "threads"; }
  [[nodiscard]] int ranks_on_host() const noexcept override {
    return group_->ranks_on_host[static_cast<std::size_t>(rank_)];
  }
  [[nodiscard]] std::span<const int> hosts() const noexcept override { return group_->hosts; }
  [[nodiscard]] Capabilities capabilities() const noexcept override {
    return {.reads_peer_memory = true,
            .small_messages_in_shared_memory = false,
            .device_memory = cuda_built()};
  }

 protected:
  void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                     Deadline deadline) override;
  void do_all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                       std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                       Deadline deadline) override;
  // Each rank copies every peer's device bytes with cudaMemcpyAsync on its own stream (peer
  // access or staging is the driver's business), ordered by events, never by the host: the
  // copies wait for the sender's copy-in, and the sender's later work waits for the copies, so
  // no buffer is reused early. Returns once the copies are enqueued. That is the one way here:
  // `form` is ignored.
  void do_all_gather_v_device(std::span<const ConstSegment> send, std::byte* recv,
                              std::span<const std::uint64_t> counts,
                              std::span<const std::uint64_t> displs, DeviceGatherForm form,
                              const Device& device, void* stream, Deadline deadline) override;
  // The same ordering for the personal exchange: each rank copies from each peer's send buffer
  // the block addressed to it.
  void do_all_to_all_v_device(const std::byte* send, std::span<const std::uint64_t> send_counts,
                              std::byte* recv, std::span<const std::uint64_t> recv_counts,
                              const Device& device, void* stream, Deadline deadline) override;
  void do_all_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                             std::span<const std::size_t> first,
                             std::span<const std::uint64_t> counts, Deadline deadline) override;
  void do_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                         std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                         int root, Deadline deadline) override;
  void do_all_to_all_scatter(std::span<const ConstSegment> send,
                             std::span<const std::size_t> send_first,
                             std::span<const RecvPiece> pieces, std::span<const std::size_t> first,
                             Deadline deadline) override;
  void do_barrier(Deadline deadline) override { meet(deadline, "barrier"); }
  void do_abort() noexcept override;

 private:
  // Publishes this rank's send, meets, checks that every rank agrees on every count (the same
  // verdict on every rank), runs `copy(peer)` for each peer starting after this rank, meets.
  template <typename CopyFn>
  // `copy` runs on every rank, or on `root` only (>= 0): the others just publish and wait.
  void exchange(std::span<const ConstSegment> send, std::span<const std::uint64_t> counts,
                Deadline deadline, const char* what, int root, CopyFn&& copy);
  // After the first meeting: the first rank whose counts disagree with a sender's bytes, as a
  // message every rank words the same; empty when all agree.
  [[nodiscard]] std::string count_error(const char* what) const;
  // The group barrier: returns when every rank arrived, or throws Timeout / Aborted.
  void meet(Deadline deadline, const char* what);
  // The device calls' skeleton: records `ready_` and publishes `slot`, meets; unless
  // `verdict()` (a message every rank words the same) or a peer's failed device stops it, runs
  // `copy()` (device copies on `stream`, each after its peer's `ready`) and records `done_`;
  // meets again, and orders `stream` after every reader's `done`.
  template <typename Verdict, typename Copy>
  void device_exchange(GroupState::Slot slot, const Device& device, void* stream, Deadline deadline,
                       const char* what, Verdict&& verdict, Copy&& copy);
  // all_gather_v_device's copies: each peer's bytes into `recv` on `stream`.
  void copy_from_peers(std::byte* recv, std::span<const std::uint64_t> displs, void* stream);

  std::shared_ptr<GroupState> group_;
  int rank_;
  // all_gather_v_device's events (recorded on this rank's stream) and the peers' `done`, taken
  // from their slots before the second meeting.
  DeviceEvent ready_;
  DeviceEvent done_;
  std::vector<const DeviceEvent*> peer_done_;
};

}  // namespace shardgather::detail
