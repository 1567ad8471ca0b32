// A shardgather Communicator over a torch.distributed ProcessGroup (c10d C++ API), so that a
// whole foreach_all_gather runs in C++ with the GIL released.
//
// Contract:
//  1. Collectives are matched by call order, as for every backend; they are issued on the group
//     itself, so they interleave with the caller's own torch.distributed calls in program order.
//  2. One thread drives it at a time; abort() may come from any thread and wakes a blocked wait
//     within about 50 ms (the in-flight c10d work itself cannot be cancelled).
//  3. Any number may coexist; each keeps its group alive. The Python package caches one per
//     group object (a weak-keyed dict), so sequence numbers and poisoning persist across calls
//     and a destroyed group releases its communicator.
//  4. Host memory at this interface. On NCCL groups the bytes are staged through device buffers
//     on `device` (the binding passes torch.cuda.current_device()); untested here (no CUDA).
//
// Gather-v: c10d's allgather needs the same size on every rank and Gloo has no gather-v, so
// all_gather_v pads every rank's bytes to the largest rank's count (the padding does go on the
// wire) and, unless the blocks are already equal and adjacent, receives into a reused scratch
// buffer and copies each block to its place. Equal blocks from one segment (one tensor, or any
// list after foreach packs it) are sent and received with no copy on our side; several segments
// are packed into a reused staging buffer first (Gloo takes one input tensor).
//
// Deadlines: Work::wait is called in slices until the deadline; past it the call raises Timeout
// and the communicator is poisoned. As with MPI, the c10d work cannot be cancelled and may still
// read the send bytes and write the receive buffer later: after a Timeout, rebuild the group (in
// practice: end the process), exactly what torch.distributed itself requires after a timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "shardgather/communicator.h"

namespace shardgather::python {

class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::Device device);

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  // "torch.gloo", "torch.nccl", ...
  [[nodiscard]] std::string_view backend_name() const noexcept override { return name_; }
  // From LOCAL_WORLD_SIZE (torchrun sets it), else counted once at construction by gathering a
  // hash of every rank's host name over the group: constructing one is collective.
  [[nodiscard]] int ranks_on_host() const noexcept override { return ranks_on_host_; }

 protected:
  void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                     Deadline deadline) override;
  void do_all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                       std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                       Deadline deadline) override;
  void do_all_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                             std::span<const std::size_t> first,
                             std::span<const std::uint64_t> counts, Deadline deadline) override;
  void do_barrier(Deadline deadline) override;
  void do_abort() noexcept override;

 private:
  // One c10d allgather of `input` (the same byte count on every rank) into `outputs`, waited on
  // until `deadline`.
  void allgather(at::Tensor& input, std::vector<at::Tensor>& outputs, Deadline deadline,
                 const char* what);
  void wait(const c10::intrusive_ptr<c10d::Work>& work, Deadline deadline, const char* what);
  // Every rank's bytes padded to the largest count: block r at r * max(counts). Received in
  // place at `recv` when given and the blocks are equal; otherwise into recv_staging_ (on the
  // host). Returns the host address of block 0, or nullptr when nothing was sent.
  const std::byte* gather_padded(std::span<const ConstSegment> send,
                                 std::span<const std::uint64_t> counts, std::byte* recv,
                                 Deadline deadline, const char* what);
  int count_ranks_on_host();
  // Byte tensors over host memory (borrowed), or on device_ (owned) for device-only backends.
  at::Tensor host_bytes(const std::byte* data, std::uint64_t size) const;
  at::Tensor& scratch(at::Tensor& buffer, std::uint64_t size);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int size_;
  std::string name_;
  c10::Device device_;
  bool staged_on_device_;
  int ranks_on_host_ = 1;
  std::atomic<bool> abort_requested_{false};
  at::Tensor send_staging_;  // reused: packed, padded send bytes
  at::Tensor recv_staging_;  // reused: padded gather, when blocks are not equal and adjacent
  at::Tensor recv_host_;     // device staging only: the gathered bytes copied back to the host
};

}  // namespace shardgather::python
