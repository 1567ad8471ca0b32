// A shardgather Communicator over a torch.distributed ProcessGroup (c10d C++ API), so that a
// whole foreach_all_gather runs in C++ with the GIL released.
//
// Contract:
//  1. Collectives are matched by call order, as for every backend; they are issued on the group
//     itself, so they interleave with the caller's own torch.distributed calls in program order.
//  2. One thread drives it at a time; abort() may come from any thread and wakes a blocked wait
//     within about 50 ms (an in-flight c10d collective cannot be cancelled; point-to-point
//     works are dropped and the group's Gloo context closed, see below).
//  3. Any number may coexist; each keeps its group alive. The Python package caches one per
//     group object (a weak-keyed dict), so sequence numbers and poisoning persist across calls
//     and a destroyed group releases its communicator.
//  4. Host memory at this interface, except all_gather_v_device and all_to_all_v_device. On NCCL
//  groups host bytes are
//     staged through device buffers on `device` (the binding passes torch.cuda.current_device()).
//  5. Device memory (all_gather_v_device, CUDA tensors): the collective is issued on the device
//     bytes themselves (c10d sends CUDA tensors to the group's CUDA backend: NCCL, or Gloo, which
//     stages them), ordered after torch's current stream, which the binding makes the call's
//     stream (params.cc). Uneven counts move in the form the strategy layer passes: one
//     broadcast per rank into its slot (coalesced into one group on NCCL), or one padded
//     all_gather_into_tensor and a copy out (docs/gpu.md). Every number this transport carries is
//     at the top of process_group.cc, with what it bounds.
//
// This transport states facts and holds no strategy: without point to point (NCCL, or
// `p2p=false`) it has only c10d's equal-size allgather (capabilities().gather_v false), and the
// strategy layer pads (src/strategies/padded.cc); it never scatters into strided pieces itself
// (capabilities().scatter false), and the strategies gather rank-major and copy out.
//
// Backends: a torch 2.x group may hold one backend per device type ("cpu:gloo,cuda:nccl"); the
// one for `device` is used (its name is backend_name(), "torch.gloo"), and c10d dispatches each
// call to it by the tensors' device.
//
// Point-to-point gather (Gloo on the host, the default there): Gloo's send/recv post unbound
// buffers over the tensors' own memory, so all_gather_v/all_gather on a Gloo group post one recv
// per peer straight into that peer's slot of the output, copy this rank's bytes once into its
// own slot while those arrive, and post one send per peer from the slot: no padding (a true
// gather-v), no staging, no internal buffer. Scattered destinations (unshard along dim 1, a
// bucket of several parameters), gathers to one rank and the personalised exchange
// (all_to_all_scatter) go through one chunked exchange (exchange_chunked): each pair's bytes
// in chunks of up to 8 MiB cut at the same offsets on both sides, one round per chunk index,
// round c + 1 on the wire while round c is copied out, and a chunk that cannot move in place
// through one of two slots of its stream, reused round after round; the chunk shrinks in large
// groups so that the slots stay within 64 MiB. So the extra memory never grows with the
// gathered bytes. The gathers (scatter_chunked) receive every chunk into a slot; the exchange
// lands a chunk in place where one contiguous run holds it. Without point to point
// (`p2p=false`, or NCCL) an equal-size all_gather is one c10d all_gather_single into the flat
// output.
// Waits are not sliced there: a Gloo unbound-buffer wait that times out signals the failure on
// the whole Gloo context, so each work is waited on until the deadline, and abort() aborts the
// in-flight works (SendWork/RecvWork::abort) to wake the wait. Nor can they be polled: Gloo's
// SendWork/RecvWork mark themselves completed only inside wait(). So a thread with an interrupt
// check (a Python caller, where Ctrl-C must be noticed) hands that wait to a helper thread
// (waiter.h) and keeps checking; an interrupt aborts the works, which ends the helper's wait.
// Aborting a work only wakes its wait: the transfer stays posted, and a peer that sends or
// receives later would still write the receive buffer and read the send bytes (completing its
// own call with an interrupted one). So once a wait has failed (abort, interrupt, Timeout, a
// peer's error) its works are dropped before the call returns, which makes Gloo let go of both
// buffers (destroying an unbound buffer is its cancel), and the Gloo context is closed, as Gloo
// does after its own timeouts: a late peer's call fails with RemoteError, and the group must be
// rebuilt, as the error says. Tags kP2PTag and kCloseTag are reserved on the group.
//
// Errors: a call c10d rejects raises CommunicationError; a Gloo transport exception (a peer's
// connection closed), when issuing or waiting, raises RemoteError. Either poisons.
//
// Deadlines: Work::wait is called in slices until the deadline; past it the call raises Timeout
// and the communicator is poisoned. As with MPI, a c10d collective (not point to point, above)
// cannot be cancelled and may still read the send bytes and write the receive buffer later:
// after a Timeout, rebuild the group (in practice: end the process), exactly what
// torch.distributed itself requires after a timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "copies/device_runtime.h"
#include "transport/backends/torch/waiter.h"
#include "transport/host_mailbox.h"

#include "shardgather/communicator.h"

namespace shardgather::detail {

class ProcessGroupCommunicator final : public Communicator {
 public:
  // `p2p`: use the point-to-point gather where the group supports it (Gloo, host memory).
  // `host_mailbox`: when every rank is on this host, exchange the pre-flight header (and any
  // all_gather of at most 1 KiB per rank, and barriers) through shared memory (the host
  // mailbox, src/transport/host_mailbox.h); otherwise, or when false, they go over the group like
  // the payload.
  // Construction is collective (the host count, the mailbox) and bounded by `setup_timeout`.
  ProcessGroupCommunicator(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::Device device,
                           bool p2p = true, bool host_mailbox = true,
                           std::chrono::milliseconds setup_timeout = kDefaultTimeout);
  ProcessGroupCommunicator(const ProcessGroupCommunicator&) = delete;
  ProcessGroupCommunicator& operator=(const ProcessGroupCommunicator&) = delete;
  ProcessGroupCommunicator(ProcessGroupCommunicator&&) = delete;
  ProcessGroupCommunicator& operator=(ProcessGroupCommunicator&&) = delete;
  ~ProcessGroupCommunicator() override;

  // The send/recv tag the point-to-point gather uses on the group.
  static constexpr int kP2PTag = 0x5347;  // "SG"
  // Reserved as well: a receive nobody sends to, whose timed-out wait closes the Gloo context
  // after a failed transfer (close_p2p_context). ProcessGroupGloo picks a tag's context as
  // contexts[tag % count]: 840 apart, both tags share one for any count up to 8.
  static constexpr int kCloseTag = kP2PTag + 840;

  // Whether small all_gathers and barriers travel through the host mailbox.
  [[nodiscard]] bool uses_host_mailbox() const noexcept { return mailbox_ != nullptr; }

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  // "torch.gloo", "torch.nccl", ...
  [[nodiscard]] std::string_view backend_name() const noexcept override { return name_; }
  // Counted once at construction by gathering every rank's host-name hash and LOCAL_WORLD_SIZE
  // over the group (the variable wins when every rank has the same value): constructing one is
  // collective (also for the host mailbox: one /dev/shm object of about 2 KiB per rank,
  // unlinked once mapped).
  [[nodiscard]] int ranks_on_host() const noexcept override { return ranks_on_host_; }
  // From the same exchange: ranks with the same host name share a host (empty when
  // LOCAL_WORLD_SIZE overrode the count and disagrees with the names).
  [[nodiscard]] std::span<const int> hosts() const noexcept override { return hosts_; }
  // Point to point (Gloo, host memory) is an exact gather-v, and scatters through bounded
  // chunks (scatter_chunked); otherwise only c10d's equal-size allgather, and the strategy layer
  // pads.
  [[nodiscard]] Capabilities capabilities() const noexcept override {
    return {.reads_peer_memory = false,
            .small_messages_in_shared_memory = mailbox_ != nullptr,
            .gather_v = p2p_,
            .scatter = p2p_,
            .all_to_all = p2p_,
            .device_memory = true};
  }

 protected:
  void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                     Deadline deadline) override;
  void do_all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                       std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                       Deadline deadline) override;
  void do_all_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                             std::span<const std::size_t> first,
                             std::span<const std::uint64_t> counts, Deadline deadline) override;
  // Both scatter forms: scatter_chunked.
  void do_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                         std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                         int root, Deadline deadline) override;
  // Point to point (Gloo, host memory), through exchange_chunked; a chunk is staged only where
  // it spans segments or strided pieces.
  void do_all_to_all_scatter(std::span<const ConstSegment> send,
                             std::span<const std::size_t> send_first,
                             std::span<const RecvPiece> pieces, std::span<const std::size_t> first,
                             Deadline deadline) override;
  void do_all_gather_v_device(std::span<const ConstSegment> send, std::byte* recv,
                              std::span<const std::uint64_t> counts,
                              std::span<const std::uint64_t> displs, DeviceGatherForm form,
                              const Device& device, void* stream, Deadline deadline) override;
  // One c10d all_to_all_single on the device bytes themselves (NCCL: grouped send/recv; Gloo
  // stages them), waited for as the device gather is.
  void do_all_to_all_v_device(const std::byte* send, std::span<const std::uint64_t> send_counts,
                              std::byte* recv, std::span<const std::uint64_t> recv_counts,
                              const Device& device, void* stream, Deadline deadline) override;
  void do_barrier(Deadline deadline) override;
  void do_abort() noexcept override;

 private:
  // The streams of one chunked exchange and their slots (process_group.cc).
  struct ChunkedExchange;

  // Posts works under inflight_mu_ (abort() sees them, or its flag is seen right after).
  void post(const std::function<void()>& issue, const char* what);
  // A scatter over point to point, to every rank (root < 0) or to `root`: a sender's shard goes
  // to each receiver through exchange_chunked, packed once per chunk where it must be, and a
  // receiver takes every chunk into one of two slots per sender. The extra memory is within
  // the slot budget on a receiver and two chunks on a rank that only sends.
  void scatter_chunked(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                       std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                       int root, Deadline deadline, const char* what);
  // Moves every stream of `x` in rounds of one chunk (see the header comment); the slots live in
  // chunk_slots_, grown, never shrunk, and reused by every round and call.
  void exchange_chunked(ChunkedExchange& x, Deadline deadline, const char* what);
  // Issues round c's works (prepared: every receive and send of chunk c); inflight_mu_ held.
  void issue_round(const ChunkedExchange& x, std::uint64_t c);
  // The device gather's two forms (DeviceGatherForm).
  void gather_device_padded(const std::byte* mine, std::byte* recv,
                            std::span<const std::uint64_t> counts,
                            std::span<const std::uint64_t> displs, const c10::Device& dev,
                            Deadline deadline);
  void gather_device_broadcast(const std::byte* mine, std::byte* recv,
                               std::span<const std::uint64_t> counts,
                               std::span<const std::uint64_t> displs, const c10::Device& dev,
                               Deadline deadline);
  // Raises Aborted when abort() came before a point-to-point call posts anything.
  void check_not_aborted_before(const char* what) const;
  // Waits for a device collective: polls completion against the deadline, then waits without a
  // timeout (NCCL aborts its communicator when a wait's timeout passes).
  void wait_polled(const c10::intrusive_ptr<c10d::Work>& work, Deadline deadline, const char* what);
  // Waits for a device gather's work: on NCCL only orders the current stream after it (no host
  // wait, no polling); on Gloo, which runs it on the host, wait_polled.
  void wait_device(const c10::intrusive_ptr<c10d::Work>& work, Deadline deadline, const char* what);
  // One c10d all_gather_single of `input` (the same byte count on every rank) into the flat
  // `output` (world x that), waited on until `deadline`.
  void allgather(at::Tensor& input, at::Tensor& output, Deadline deadline, const char* what);
  void wait(const c10::intrusive_ptr<c10d::Work>& work, Deadline deadline, const char* what);
  // The point-to-point gather into `recv` (every rank's block at recv + displs[r]).
  void gather_p2p(std::span<const ConstSegment> send, std::byte* recv,
                  std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                  Deadline deadline, const char* what);
  // Waits for every in-flight p2p work until `deadline` (unsliced, see the header comment): on
  // waiter_'s thread when this thread has an interrupt check, so that the check keeps running.
  void wait_p2p(Deadline deadline, const char* what);
  void wait_p2p_here(Deadline deadline, const char* what);
  // Aborts every in-flight p2p work (wakes their waits); inflight_mu_ held.
  void abort_works_locked() noexcept;
  // Drops every in-flight p2p work, if any, and then closes the Gloo context; call only when no
  // thread waits on them. Destroying a Gloo work's unbound buffer is Gloo's cancel: afterwards
  // the transfer neither reads the send bytes nor writes the receive buffer (see the header
  // comment).
  void release_works() noexcept;
  // Closes every Gloo pair of the p2p context (a timed-out receive on kCloseTag).
  void close_p2p_context() noexcept;
  int count_ranks_on_host(Deadline deadline);
  // Byte tensors over host memory (borrowed), or on device_ (owned) for device-only backends.
  at::Tensor host_bytes(const std::byte* data, std::uint64_t size) const;
  at::Tensor& scratch(at::Tensor& buffer, std::uint64_t size);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int size_;
  std::string name_;
  c10::Device device_;
  bool staged_on_device_;
  bool device_nccl_;  // CUDA tensors go to NCCL (else to Gloo, which stages them on the host)
  int ranks_on_host_ = 1;
  std::vector<int> hosts_;
  bool p2p_ = false;
  std::atomic<bool> abort_requested_{false};
  std::mutex inflight_mu_;  // guards inflight_ against abort() from another thread
  // Empty between calls: a wait that succeeds clears it, one that fails releases it.
  std::vector<c10::intrusive_ptr<c10d::Work>> inflight_;
  std::vector<at::Tensor> p2p_tensors_;  // reused: one-element lists for send/recv
  std::vector<std::uint64_t> p2p_displs_;
  at::Tensor padded_send_;         // reused: all_gather_v_device's padded send, on its device
  at::Tensor padded_recv_;         // reused: its padded receive
  void* padded_stream_ = nullptr;  // the stream both were made for (their work's)
  // The stream of the device staging below (declared first: it outlives the staging's memory).
  detail::DeviceStream staging_stream_;
  at::Tensor send_staging_;  // reused: device staging of an all_gather's send
  at::Tensor recv_staging_;  // reused: device staging of an all_gather's receive
  at::Tensor chunk_slots_;   // reused: exchange_chunked's slots
  std::unique_ptr<detail::HostMailbox> mailbox_;  // set once, by the constructor
  Waiter waiter_;  // idle between calls; last, so it is joined before the rest goes
};

}  // namespace shardgather::detail
