#include "transport/backends/torch/process_group.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <new>
#include <numeric>
#include <string>
#include <string_view>
#include <thread>

#include <ATen/Functions.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "copies/device_runtime.h"
#include "transport/backends/torch/torch_compat.h"
#include "transport/graveyard.h"
#include <unistd.h>

#include "shardgather/copy.h"
#include "shardgather/errors.h"
#include "shardgather/torch.h"

namespace shardgather::detail {

namespace {

// Every number this transport carries, with what it bounds. All are mechanism: how soon the
// transport notices an event, or how much memory of its own it holds while it moves the bytes it
// is handed; nothing above the transport sees either. Which of two moves of the same bytes is
// faster is policy, the strategy layer's (the device gather's form: src/strategies/device.cc).
namespace numbers {

// Work::wait is called in slices of this length so that abort() and the deadline are noticed
// while c10d blocks (and an interrupt while a helper thread waits on Gloo); a slice that expires
// costs one c10::Error, cheap at this period.
constexpr std::chrono::milliseconds kWaitSlice{50};
// How often a device collective's completion is polled against the deadline (wait_polled).
constexpr std::chrono::microseconds kDevicePoll{100};
// close_p2p_context's receive on kCloseTag exists only to time out, which closes the context.
constexpr std::chrono::milliseconds kCloseWait{1};

// The chunked exchange (exchange_chunked, both scatters): a pair's bytes move in chunks of at
// most kMaxChunk, smaller in large groups so that every slot a rank may hold (two chunks per
// stream) fits in kSlotBudget, but never below kMinChunk: in a group so large that the budget
// would cut chunks smaller, the slots exceed it instead. They bound the transport's own
// staging, whatever the bytes moved: where a chunk is cut is the transport's business, and both
// sides of a pair derive it from facts both hold.
constexpr std::uint64_t kMaxChunk = std::uint64_t{8} << 20;
constexpr std::uint64_t kMinChunk = std::uint64_t{256} << 10;
constexpr std::uint64_t kSlotBudget = std::uint64_t{64} << 20;

}  // namespace numbers

// The chunk for an exchange in which a rank may hold up to `slots` slots of one chunk each.
constexpr std::uint64_t chunk_within_budget(std::uint64_t slots) {
  return std::min(
      numbers::kMaxChunk,
      std::max(numbers::kMinChunk, numbers::kSlotBudget / std::max<std::uint64_t>(slots, 1)));
}

// How many bytes of a stream of `bytes` chunk c holds (0 past its end).
constexpr std::uint64_t chunk_bytes(std::uint64_t bytes, std::uint64_t chunk, std::uint64_t c) {
  const std::uint64_t begin = c * chunk;
  return begin >= bytes ? 0 : std::min(chunk, bytes - begin);
}

// The one run a sliced chunk is, if it is one (else nullptr): it can move in place.
std::byte* one_run(const std::vector<RecvPiece>& run) {
  return run.size() == 1 && run[0].count == 1 ? run[0].data : nullptr;
}

// c10d rejects a call with c10::Error; Gloo's transport throws its own exceptions (IoException,
// a std::runtime_error) straight through c10d when a peer's connection is gone. (Newer torch
// may wrap transport failures in c10::Error subclasses: those raise CommunicationError, which
// poisons all the same.)
[[noreturn]] void raise_not_issued(const std::exception& e, int rank, const char* what,
                                   const std::string& name) {
  const std::string where =
      "rank " + std::to_string(rank) + ": " + what + " on " + name + " could not be issued: ";
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    throw CommunicationError(where + c10_error->what_without_backtrace());
  }
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    // Some works may already be posted: poisoned like any failed issue, not a peer's fault.
    throw CommunicationError(where + e.what());
  }
  throw RemoteError(where + e.what());
}

// A torch 2.x group holds one backend per device type (the default "cpu:gloo,cuda:nccl"): the
// one that carries this communicator's tensors is the one that matters.
std::string backend_for(c10d::ProcessGroup& group, c10::DeviceType device) {
  return backend_name_for(group, device);
}

}  // namespace

ProcessGroupCommunicator::ProcessGroupCommunicator(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::Device device, bool p2p,
    bool host_mailbox, std::chrono::milliseconds setup_timeout)
    : group_(group),
      rank_(group->getRank()),
      size_(group->getSize()),
      name_("torch." + backend_for(*group, device.type())),
      device_(device),
      staged_on_device_(!device.is_cpu()),
      device_nccl_(backend_for(*group, c10::kCUDA) == "nccl"),
      p2p_(p2p && device.is_cpu() && name_ == "torch.gloo") {
  const Deadline setup = deadline_after(setup_timeout);
  ranks_on_host_ = count_ranks_on_host(setup);
  if (host_mailbox) {
    // The pre-flight header is all latency, and over Gloo each exchange is a rendezvous through
    // the loop thread of both sides: on one host it goes through shared memory instead.
    mailbox_ = detail::HostMailbox::create(*this, setup);
  }
}

ProcessGroupCommunicator::~ProcessGroupCommunicator() {
  finish_operations();
  release_works();  // before the members their transfers point into (chunk_slots_) go
}

at::Tensor ProcessGroupCommunicator::host_bytes(const std::byte* data, std::uint64_t size) const {
  // c10d takes non-const tensors; the send side is only read.
  return at::from_blob(const_cast<std::byte*>(data), {static_cast<std::int64_t>(size)},
                       at::TensorOptions().dtype(at::kByte));
}

at::Tensor& ProcessGroupCommunicator::scratch(at::Tensor& buffer, std::uint64_t size) {
  const auto n = static_cast<std::int64_t>(size);
  if (!buffer.defined() || buffer.numel() < n) {
    // Grown, never shrunk: a training loop gathers the same sizes every step, and fresh pages
    // cost more than the copy they serve.
    buffer = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device_));
  }
  return buffer;
}

void ProcessGroupCommunicator::wait(const c10::intrusive_ptr<c10d::Work>& work, Deadline deadline,
                                    const char* what) {
  for (;;) {
    check_interrupt();
    if (abort_requested_.load()) {
      throw Aborted("rank " + std::to_string(rank_) + ": abort() while in " + what + " on " +
                    name_ + "; the c10d work cannot be cancelled, rebuild the group");
    }
    const auto now = Clock::now();
    if (now >= deadline && !work->isCompleted()) {
      throw Timeout("rank " + std::to_string(rank_) + ": " + what + " on " + name_ +
                    " passed its deadline waiting for peers (the c10d work cannot be cancelled: "
                    "the communicator is poisoned; rebuild the group or end the process)");
    }
    auto slice = numbers::kWaitSlice;
    if (deadline != Deadline::max()) {
      slice = std::clamp(std::chrono::ceil<std::chrono::milliseconds>(deadline - now),
                         std::chrono::milliseconds(1), numbers::kWaitSlice);
    }
    try {
      work->wait(slice);
      return;
    } catch (const std::exception& e) {
      // An expired slice and a failed collective both throw c10::Error; only the latter
      // leaves the work completed.
      if (!work->isCompleted()) {
        continue;
      }
      throw RemoteError("rank " + std::to_string(rank_) + ": " + what + " on " + name_ +
                        " failed: " + e.what());
    }
  }
}

void ProcessGroupCommunicator::allgather(at::Tensor& input, at::Tensor& output, Deadline deadline,
                                         const char* what) {
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = all_gather_single(*group_, output, input);
  } catch (const std::exception& e) {
    raise_not_issued(e, rank_, what, name_);
  }
  if (staged_on_device_) {
    // A device collective: sliced waits would abort NCCL's communicator (wait_polled).
    wait_polled(work, deadline, what);
  } else {
    wait(work, deadline, what);
  }
}

void ProcessGroupCommunicator::do_all_gather(std::span<const std::byte> send,
                                             std::span<std::byte> recv, Deadline deadline) {
  if (mailbox_ != nullptr && send.size() <= detail::HostMailbox::kSlotBytes) {
    mailbox_->all_gather(send, recv, deadline, [this] { check_interrupt(); });
    return;
  }
  if (send.empty()) {
    return;  // the same size on every rank by contract: every rank skips
  }
  const auto world = static_cast<std::size_t>(size_);
  if (p2p_) {
    const ConstSegment mine{send.data(), send.size()};
    p2p_displs_.resize(world);
    std::vector<std::uint64_t> counts(world, send.size());
    for (std::size_t r = 0; r < world; ++r) {
      p2p_displs_[r] = r * send.size();
    }
    gather_p2p(std::span(&mine, 1), recv.data(), counts, p2p_displs_, deadline, "all_gather");
    return;
  }
  // all_gather_single into one flat output: no per-rank output list, nothing to copy out here.
  if (!staged_on_device_) {
    at::Tensor input = host_bytes(send.data(), send.size());
    at::Tensor output = host_bytes(recv.data(), recv.size());
    allgather(input, output, deadline, "all_gather");
    return;
  }
  // Host bytes through device staging (a group whose only backend is NCCL: the headers of calls
  // across hosts), on a stream of the communicator's own: the staging copies queue behind no
  // stream of the caller's (torch's pool streams are shared with torch.cuda.Stream()). The
  // collective still queues behind NCCL's earlier ones (docs/gpu.md).
  const TorchStreamScope on(device_, staging_stream_.get(device_.index()));
  at::Tensor input =
      scratch(send_staging_, send.size()).narrow(0, 0, static_cast<std::int64_t>(send.size()));
  input.copy_(host_bytes(send.data(), send.size()));
  at::Tensor output =
      scratch(recv_staging_, recv.size()).narrow(0, 0, static_cast<std::int64_t>(recv.size()));
  allgather(input, output, deadline, "all_gather");
  host_bytes(recv.data(), recv.size()).copy_(output);
}

namespace {

at::Tensor device_bytes(const std::byte* data, std::uint64_t size, const c10::Device& device) {
  return at::from_blob(const_cast<std::byte*>(data), {static_cast<std::int64_t>(size)},
                       at::TensorOptions().dtype(at::kByte).device(device));
}

at::Tensor& grown(at::Tensor& buffer, std::uint64_t size, const c10::Device& device) {
  const auto n = static_cast<std::int64_t>(size);
  if (!buffer.defined() || buffer.numel() < n || buffer.device() != device) {
    buffer = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device));
  }
  return buffer;
}

}  // namespace

void ProcessGroupCommunicator::wait_polled(const c10::intrusive_ptr<c10d::Work>& work,
                                           Deadline deadline, const char* what) {
  // WorkNCCL::wait(timeout) measures the timeout from the work's start and aborts the NCCL
  // communicator when it passes: slices would kill any collective slower than one. So poll
  // completion (an event query) against the deadline, then wait without a timeout, which only
  // makes torch's current stream wait on the collective.
  while (!work->isCompleted()) {
    check_interrupt();
    if (abort_requested_.load()) {
      throw Aborted("rank " + std::to_string(rank_) + ": abort() while in " + what + " on " +
                    name_ + "; the c10d work cannot be cancelled, rebuild the group");
    }
    if (Clock::now() >= deadline) {
      throw Timeout("rank " + std::to_string(rank_) + ": " + what + " on " + name_ +
                    " passed its deadline waiting for peers (the c10d work cannot be cancelled: "
                    "the communicator is poisoned; rebuild the group or end the process)");
    }
    std::this_thread::sleep_for(numbers::kDevicePoll);
  }
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw RemoteError("rank " + std::to_string(rank_) + ": " + what + " on " + name_ +
                      " failed: " + e.what());
  }
}

void ProcessGroupCommunicator::wait_device(const c10::intrusive_ptr<c10d::Work>& work,
                                           Deadline deadline, const char* what) {
  if (device_nccl_) {
    // NCCL: wait() without a timeout returns at once, having made the current stream wait for
    // the collective (the host waits only under TORCH_NCCL_BLOCKING_WAIT=1). The collective's
    // progress on the device is NCCL's, bounded by the group's timeout and torch's watchdog.
    try {
      work->wait();
    } catch (const std::exception& e) {
      throw RemoteError("rank " + std::to_string(rank_) + ": " + what + " on " + name_ +
                        " failed: " + e.what());
    }
    return;
  }
  // Gloo runs the collective on the host (staging the device bytes): waited for against the
  // deadline; its wait() then orders the current stream after the copies back to the device.
  wait_polled(work, deadline, what);
}

void ProcessGroupCommunicator::do_all_gather_v_device(std::span<const ConstSegment> send,
                                                      std::byte* recv,
                                                      std::span<const std::uint64_t> counts,
                                                      std::span<const std::uint64_t> displs,
                                                      DeviceGatherForm form, const Device& device,
                                                      void* stream, Deadline deadline) {
  const c10::Device dev(c10::kCUDA, static_cast<c10::DeviceIndex>(device.index));
  // c10d orders a collective after torch's current stream, and its work's wait() makes that
  // stream wait for it: with the call's stream current (a blocking call's is already; a started
  // one runs on the progress thread, whose is another), copy-in, collective, the copies here and
  // copy-out stay in stream order, with no host wait.
  const TorchStreamScope on(dev, stream);
  if ((padded_send_.defined() || padded_recv_.defined()) && padded_stream_ != stream) {
    // Made for another stream's work: let the caching allocator give them back in its order.
    padded_send_ = at::Tensor();
    padded_recv_ = at::Tensor();
  }
  padded_stream_ = stream;
  const std::byte* mine = send.empty() ? nullptr : send.front().data;  // one segment (device.cc)
  if (form == DeviceGatherForm::kPadded) {
    gather_device_padded(mine, recv, counts, displs, dev, deadline);
  } else {
    gather_device_broadcast(mine, recv, counts, displs, dev, deadline);
  }
}

void ProcessGroupCommunicator::do_all_to_all_v_device(const std::byte* send,
                                                      std::span<const std::uint64_t> send_counts,
                                                      std::byte* recv,
                                                      std::span<const std::uint64_t> recv_counts,
                                                      const Device& device, void* stream,
                                                      Deadline deadline) {
  const char* what = "all_to_all_v_device";
  const c10::Device dev(c10::kCUDA, static_cast<c10::DeviceIndex>(device.index));
  const TorchStreamScope on(dev, stream);  // as do_all_gather_v_device: stream order, no host wait
  std::vector<std::int64_t> input_splits(send_counts.begin(), send_counts.end());
  std::vector<std::int64_t> output_splits(recv_counts.begin(), recv_counts.end());
  const std::uint64_t sent = std::accumulate(send_counts.begin(), send_counts.end(), 0ULL);
  const std::uint64_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), 0ULL);
  // c10d wants tensors on the device even where this rank moves nothing: an empty one (no
  // memory) stands in for a null pointer.
  const auto bytes_on = [&](const std::byte* data, std::uint64_t size) {
    return size != 0 ? device_bytes(data, size, dev)
                     : at::empty({0}, at::TensorOptions().dtype(at::kByte).device(dev));
  };
  at::Tensor input = bytes_on(send, sent);
  at::Tensor output = bytes_on(recv, received);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = all_to_all_single(*group_, output, input, output_splits, input_splits);
  } catch (const std::exception& e) {
    raise_not_issued(e, rank_, what, name_);
  }
  wait_device(work, deadline, what);
}

namespace {

// The widest rank's count, and whether every rank has it.
struct CountsShape {
  std::uint64_t widest;
  bool even;
};

CountsShape shape_of(std::span<const std::uint64_t> counts) {
  const std::uint64_t widest = *std::max_element(counts.begin(), counts.end());
  return {widest, std::all_of(counts.begin(), counts.end(),
                              [widest](std::uint64_t c) { return c == widest; })};
}

}  // namespace

void ProcessGroupCommunicator::gather_device_padded(const std::byte* mine, std::byte* recv,
                                                    std::span<const std::uint64_t> counts,
                                                    std::span<const std::uint64_t> displs,
                                                    const c10::Device& dev, Deadline deadline) {
  const char* what = "all_gather_v_device";
  const auto me = static_cast<std::size_t>(rank_);
  const auto world = static_cast<std::size_t>(size_);
  const auto [widest, even] = shape_of(counts);
  const auto padded_len = static_cast<std::int64_t>(world * widest);
  // Equal blocks already adjacent in `recv` are the padded output itself: no copy out.
  bool in_place = even;
  for (std::size_t r = 0; r < world && in_place; ++r) {
    in_place = displs[r] == displs[0] + r * widest;
  }
  at::Tensor input = device_bytes(mine, widest, dev);
  if (!even) {
    input = grown(padded_send_, widest, dev).narrow(0, 0, static_cast<std::int64_t>(widest));
    if (counts[me] != 0) {
      input.narrow(0, 0, static_cast<std::int64_t>(counts[me]))
          .copy_(device_bytes(mine, counts[me], dev));
    }
  }
  at::Tensor output = in_place ? device_bytes(recv + displs[0], world * widest, dev)
                               : grown(padded_recv_, world * widest, dev).narrow(0, 0, padded_len);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = all_gather_single(*group_, output, input);
  } catch (const std::exception& e) {
    raise_not_issued(e, rank_, what, name_);
  }
  wait_device(work, deadline, what);
  for (std::size_t r = 0; r < world && !in_place; ++r) {
    if (counts[r] != 0) {
      device_bytes(recv + displs[r], counts[r], dev)
          .copy_(output.narrow(0, static_cast<std::int64_t>(r * widest),
                               static_cast<std::int64_t>(counts[r])));
    }
  }
}

void ProcessGroupCommunicator::gather_device_broadcast(const std::byte* mine, std::byte* recv,
                                                       std::span<const std::uint64_t> counts,
                                                       std::span<const std::uint64_t> displs,
                                                       const c10::Device& dev, Deadline deadline) {
  // One broadcast per rank, each straight into its slot; this rank's own bytes by a copy. On
  // NCCL the broadcasts are one coalesced group (one ncclGroupStart/End), which NCCL >= 2.29
  // can run as one all-gather-v kernel, and only the group's work is waited for.
  const char* what = "all_gather_v_device";
  const auto me = static_cast<std::size_t>(rank_);
  if (counts[me] != 0) {
    device_bytes(recv + displs[me], counts[me], dev).copy_(device_bytes(mine, counts[me], dev));
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  try {
    if (device_nccl_) {
      group_->startCoalescing(c10::kCUDA);
    }
    for (std::size_t r = 0; r < static_cast<std::size_t>(size_); ++r) {
      if (counts[r] == 0) {
        continue;
      }
      std::vector<at::Tensor> tensors{r == me ? device_bytes(mine, counts[r], dev)
                                              : device_bytes(recv + displs[r], counts[r], dev)};
      c10d::BroadcastOptions options;
      options.rootRank = static_cast<std::int64_t>(r);
      works.push_back(group_->broadcast(tensors, options));
    }
    if (device_nccl_) {
      works.assign(1, group_->endCoalescing(c10::kCUDA));
    }
  } catch (const std::exception& e) {
    raise_not_issued(e, rank_, what, name_);
  }
  for (const auto& work : works) {
    wait_device(work, deadline, what);
  }
}

void ProcessGroupCommunicator::do_all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                                               std::span<const std::uint64_t> counts,
                                               std::span<const std::uint64_t> displs,
                                               Deadline deadline) {
  // Reached only where capabilities().gather_v (point to point); the base checks it.
  gather_p2p(send, recv, counts, displs, deadline, "all_gather_v");
}

void ProcessGroupCommunicator::check_not_aborted_before(const char* what) const {
  if (abort_requested_.load()) {
    throw Aborted("rank " + std::to_string(rank_) + ": abort() before " + what + " on " + name_);
  }
}

void ProcessGroupCommunicator::gather_p2p(std::span<const ConstSegment> send, std::byte* recv,
                                          std::span<const std::uint64_t> counts,
                                          std::span<const std::uint64_t> displs, Deadline deadline,
                                          const char* what) {
  const auto me = static_cast<std::size_t>(rank_);
  check_not_aborted_before(what);
  // Receives are posted first (Gloo sends a peer's bytes only once their receive is posted, so
  // each peer can start at once), then this rank's bytes are copied into its own slot while the
  // peers' bytes arrive (the receives write only the other slots), then the slot is the one
  // contiguous send buffer for every peer.
  std::byte* slot = recv + displs[me];
  post(
      [&] {
        inflight_.clear();
        for (int step = 1; step < size_; ++step) {
          const int from = (rank_ + size_ - step) % size_;
          const auto f = static_cast<std::size_t>(from);
          if (counts[f] != 0) {
            p2p_tensors_.assign(1, host_bytes(recv + displs[f], counts[f]));
            inflight_.push_back(group_->recv(p2p_tensors_, from, kP2PTag));
          }
        }
      },
      what);
  std::uint64_t at = 0;
  for (const ConstSegment& s : send) {
    if (s.size != 0 && s.data != slot + at) {
      std::memmove(slot + at, s.data, s.size);
    }
    at += s.size;
  }
  post(
      [&] {
        for (int step = 1; step < size_ && counts[me] != 0; ++step) {
          p2p_tensors_.assign(1, host_bytes(slot, counts[me]));
          inflight_.push_back(group_->send(p2p_tensors_, (rank_ + step) % size_, kP2PTag));
        }
      },
      what);
  wait_p2p(deadline, what);
}

void ProcessGroupCommunicator::post(const std::function<void()>& issue, const char* what) {
  // Posting happens under inflight_mu_, so abort() either sees the works or sets its flag
  // before they are posted (checked below, after posting); copies run without the lock, so
  // abort() never waits for them. Works posted before a failure are released (nothing waits on
  // them yet).
  std::unique_lock<std::mutex> lock(inflight_mu_);
  try {
    issue();
  } catch (const std::exception& e) {
    lock.unlock();
    release_works();
    raise_not_issued(e, rank_, what, name_);
  }
  if (abort_requested_.load()) {
    lock.unlock();
    release_works();
    throw Aborted("rank " + std::to_string(rank_) + ": abort() while posting " + what + " on " +
                  name_ + "; the Gloo context is aborted, rebuild the group");
  }
}

void ProcessGroupCommunicator::do_all_gather_scatter(std::span<const ConstSegment> send,
                                                     std::span<const RecvPiece> pieces,
                                                     std::span<const std::size_t> first,
                                                     std::span<const std::uint64_t> counts,
                                                     Deadline deadline) {
  // Reached only where capabilities().scatter (point to point); the base checks it.
  scatter_chunked(send, pieces, first, counts, -1, deadline, "all_gather_scatter");
}

void ProcessGroupCommunicator::do_gather_scatter(std::span<const ConstSegment> send,
                                                 std::span<const RecvPiece> pieces,
                                                 std::span<const std::size_t> first,
                                                 std::span<const std::uint64_t> counts, int root,
                                                 Deadline deadline) {
  // Reached only where capabilities().gather_v (point to point); the base checks it.
  scatter_chunked(send, pieces, first, counts, root, deadline, "gather_scatter");
}

// What one chunked exchange moves: each stream between this rank and its peers, cut into chunks
// of `chunk` bytes at the same offsets on both sides of the pair (both sides know its length).
struct ProcessGroupCommunicator::ChunkedExchange {
  // A stream this rank sends, the same bytes to each of `peers` (a gather's shard goes to every
  // receiver, and each of its chunks is packed once).
  struct Outgoing {
    std::span<const ConstSegment> segments;
    std::uint64_t bytes = 0;
    std::vector<int> peers;      // in posting order
    std::byte* slots = nullptr;  // two chunks, where a chunk may span segments
    ConstSegment now;            // this round's chunk: in `segments`, or packed into a slot
  };
  // A stream this rank receives from `peer`.
  struct Incoming {
    std::span<const RecvPiece> pieces;
    std::uint64_t bytes = 0;
    int peer = 0;
    std::byte* slots = nullptr;  // two chunks, where a chunk may not land in one run
    std::byte* now = nullptr;    // where this round's chunk lands: in `pieces`, or a slot
    // For chunk c in slot c % 2: the pieces it is copied to once it has arrived.
    std::array<std::vector<RecvPiece>, 2> staged;
  };

  std::uint64_t chunk = 1;
  bool receive_in_slots = false;  // even a chunk that could land in place
  std::vector<Outgoing> out;
  std::vector<Incoming> in;

  // Adds a stream this rank receives from `peer`, or one it sends (to the peers the caller
  // adds, in posting order).
  void receive(std::span<const RecvPiece> pieces, std::uint64_t bytes, int peer) {
    Incoming& i = in.emplace_back();
    i.pieces = pieces;
    i.bytes = bytes;
    i.peer = peer;
  }
  Outgoing& send(std::span<const ConstSegment> segments, std::uint64_t bytes) {
    Outgoing& o = out.emplace_back();
    o.segments = segments;
    o.bytes = bytes;
    return o;
  }

  [[nodiscard]] std::uint64_t rounds() const;
  // The bytes the slots of every stream that needs them take in all.
  [[nodiscard]] std::uint64_t slot_bytes() const;
  // Lays the slots out from `base`, two chunks (at most the stream) per stream that needs them.
  void place_slots(std::byte* base);
  // Chunk c of every stream: where it is sent from and where it lands.
  void prepare(std::uint64_t c);
  // Copies round c's chunks that arrived in slots out to their pieces.
  void land(std::uint64_t c);

 private:
  // A stream of one run (one segment, one unstrided piece) never does: each chunk of it is one.
  [[nodiscard]] bool needs_slots(const Outgoing& o) const;
  [[nodiscard]] bool needs_slots(const Incoming& i) const;
  // Chunk c's slot: slot c % 2; its last user, chunk c - 2, was sent or copied out before
  // round c - 1 was waited for, and round c is posted only after that wait.
  [[nodiscard]] std::byte* slot(std::byte* slots, std::uint64_t bytes, std::uint64_t c) const {
    return slots + (c % 2) * std::min(chunk, bytes);
  }
  void prepare(Outgoing& o, std::uint64_t c);
  void prepare(Incoming& i, std::uint64_t c);
};

std::uint64_t ProcessGroupCommunicator::ChunkedExchange::rounds() const {
  std::uint64_t longest = 0;
  for (const Outgoing& o : out) {
    longest = std::max(longest, o.peers.empty() ? 0 : o.bytes);
  }
  for (const Incoming& i : in) {
    longest = std::max(longest, i.bytes);
  }
  return (longest + chunk - 1) / chunk;
}

bool ProcessGroupCommunicator::ChunkedExchange::needs_slots(const Outgoing& o) const {
  return std::count_if(o.segments.begin(), o.segments.end(),
                       [](const ConstSegment& s) { return s.size != 0; }) > 1;
}

bool ProcessGroupCommunicator::ChunkedExchange::needs_slots(const Incoming& i) const {
  const auto filled = [](const RecvPiece& p) { return p.block * p.count != 0; };
  const auto at = std::find_if(i.pieces.begin(), i.pieces.end(), filled);
  return receive_in_slots || at == i.pieces.end() || at->count != 1 ||
         std::any_of(at + 1, i.pieces.end(), filled);
}

std::uint64_t ProcessGroupCommunicator::ChunkedExchange::slot_bytes() const {
  std::uint64_t bytes = 0;
  for (const Outgoing& o : out) {
    bytes += needs_slots(o) ? 2 * std::min(chunk, o.bytes) : 0;
  }
  for (const Incoming& i : in) {
    bytes += needs_slots(i) ? 2 * std::min(chunk, i.bytes) : 0;
  }
  return bytes;
}

void ProcessGroupCommunicator::ChunkedExchange::place_slots(std::byte* base) {
  for (Outgoing& o : out) {
    if (needs_slots(o)) {
      o.slots = base;
      base += 2 * std::min(chunk, o.bytes);
    }
  }
  for (Incoming& i : in) {
    if (needs_slots(i)) {
      i.slots = base;
      base += 2 * std::min(chunk, i.bytes);
    }
  }
}

void ProcessGroupCommunicator::ChunkedExchange::prepare(std::uint64_t c) {
  for (Outgoing& o : out) {
    prepare(o, c);
  }
  for (Incoming& i : in) {
    prepare(i, c);
  }
}

void ProcessGroupCommunicator::ChunkedExchange::prepare(Outgoing& o, std::uint64_t c) {
  const std::uint64_t len = chunk_bytes(o.bytes, chunk, c);
  o.now = {};
  if (len == 0) {
    return;
  }
  const std::vector<RecvPiece> run = slice_segments(o.segments, c * chunk, c * chunk + len);
  if (const std::byte* at = one_run(run); at != nullptr) {
    o.now = {at, len};
    return;
  }
  std::vector<ConstSegment> from;
  from.reserve(run.size());
  for (const RecvPiece& p : run) {
    for (std::uint64_t k = 0; k < p.count; ++k) {
      from.push_back({p.data + k * p.stride, p.block});
    }
  }
  const RecvPiece into{slot(o.slots, o.bytes, c), len, 1, 0};
  copy_stream(from, std::span(&into, 1));
  o.now = {into.data, len};
}

void ProcessGroupCommunicator::ChunkedExchange::prepare(Incoming& i, std::uint64_t c) {
  const std::uint64_t len = chunk_bytes(i.bytes, chunk, c);
  i.now = nullptr;
  if (len == 0) {
    return;
  }
  std::vector<RecvPiece> run = slice_pieces(i.pieces, c * chunk, c * chunk + len);
  i.now = receive_in_slots ? nullptr : one_run(run);
  if (i.now == nullptr) {
    i.now = slot(i.slots, i.bytes, c);
    i.staged[c % 2] = std::move(run);
  }
}

void ProcessGroupCommunicator::ChunkedExchange::land(std::uint64_t c) {
  for (Incoming& i : in) {
    std::vector<RecvPiece>& into = i.staged[c % 2];
    if (!into.empty()) {
      const ConstSegment got{slot(i.slots, i.bytes, c), chunk_bytes(i.bytes, chunk, c)};
      copy_stream(std::span(&got, 1), into);
      into.clear();
    }
  }
}

void ProcessGroupCommunicator::exchange_chunked(ChunkedExchange& x, Deadline deadline,
                                                const char* what) {
  const std::uint64_t rounds = x.rounds();
  if (rounds == 0) {
    return;
  }
  if (const std::uint64_t bytes = x.slot_bytes(); bytes != 0) {
    x.place_slots(static_cast<std::byte*>(scratch(chunk_slots_, bytes).data_ptr()));
  }
  // Packing runs before posting, outside inflight_mu_: abort() never waits for a copy.
  const auto post_round = [&](std::uint64_t c) {
    x.prepare(c);
    post([&] { issue_round(x, c); }, what);
  };
  post_round(0);
  wait_p2p(deadline, what);
  for (std::uint64_t c = 0; c < rounds; ++c) {
    // Round c + 1 is on the wire while round c is copied out.
    if (c + 1 < rounds) {
      post_round(c + 1);
    }
    x.land(c);
    if (c + 1 < rounds) {
      wait_p2p(deadline, what);
    }
  }
}

void ProcessGroupCommunicator::issue_round(const ChunkedExchange& x, std::uint64_t c) {
  // Receives first: Gloo sends a peer's bytes only once their receive is posted.
  inflight_.clear();
  for (const ChunkedExchange::Incoming& i : x.in) {
    if (i.now != nullptr) {
      p2p_tensors_.assign(1, host_bytes(i.now, chunk_bytes(i.bytes, x.chunk, c)));
      inflight_.push_back(group_->recv(p2p_tensors_, i.peer, kP2PTag));
    }
  }
  for (const ChunkedExchange::Outgoing& o : x.out) {
    for (const int to : o.peers) {
      if (o.now.size != 0) {
        p2p_tensors_.assign(1, host_bytes(o.now.data, o.now.size));
        inflight_.push_back(group_->send(p2p_tensors_, to, kP2PTag));
      }
    }
  }
}

void ProcessGroupCommunicator::scatter_chunked(std::span<const ConstSegment> send,
                                               std::span<const RecvPiece> pieces,
                                               std::span<const std::size_t> first,
                                               std::span<const std::uint64_t> counts, int root,
                                               Deadline deadline, const char* what) {
  check_not_aborted_before(what);
  const auto world = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  const bool receives = root < 0 || root == rank_;
  const bool sends = root != rank_ && counts[me] != 0;
  ChunkedExchange x;
  // The same on every rank (counts are): a receiver holds 2 x world slots (two for its own
  // chunks), and no chunk need be larger than the largest stream.
  const std::uint64_t largest = *std::max_element(counts.begin(), counts.end());
  x.chunk = std::max<std::uint64_t>(1, std::min(chunk_within_budget(2 * world), largest));
  // Every chunk through a slot, as docs/python.md describes it; landing a contiguous chunk in
  // place, as the all-to-all does, would save a copy and is a change of its own.
  x.receive_in_slots = true;
  if (receives) {
    copy_stream(send, rank_part(pieces, first, me));
    for (std::size_t r = 0; r < world; ++r) {
      if (r != me && counts[r] != 0) {
        x.receive(rank_part(pieces, first, r), counts[r], static_cast<int>(r));
      }
    }
  }
  if (sends) {
    ChunkedExchange::Outgoing& mine = x.send(send, counts[me]);
    for (std::size_t step = 1; step < world; ++step) {
      const std::size_t to = (me + step) % world;
      if (root < 0 || to == static_cast<std::size_t>(root)) {
        mine.peers.push_back(static_cast<int>(to));
      }
    }
  }
  exchange_chunked(x, deadline, what);
}

void ProcessGroupCommunicator::wait_p2p(Deadline deadline, const char* what) {
  try {
    if (!Communicator::has_interrupt_check()) {
      wait_p2p_here(deadline, what);
      return;
    }
    // This thread runs the interrupt check (Python's signal handlers), so the unsliceable wait
    // moves to the helper thread; an interrupt aborts the works, which ends that wait.
    waiter_.run([&] { wait_p2p_here(deadline, what); }, [this] { check_interrupt(); },
                numbers::kWaitSlice);
  } catch (...) {
    // An aborted wait leaves its transfers posted: a peer that came later would still move the
    // caller's bytes after this call returned (into freed memory, or pairing with a call that
    // raised). No thread waits on the works any more (the helper has returned), so drop them.
    release_works();
    throw;
  }
}

void ProcessGroupCommunicator::release_works() noexcept {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  {
    const std::lock_guard<std::mutex> lock(inflight_mu_);
    works.swap(inflight_);
  }
  if (works.empty()) {
    return;
  }
  // Destroyed outside the lock: a Gloo unbound buffer's destructor waits for the transport
  // thread to let go of it, and abort() from another thread must not wait for that.
  works.clear();
  close_p2p_context();
}

void ProcessGroupCommunicator::close_p2p_context() noexcept {
  // A peer's late message for a dropped receive would stay unread, and Gloo's transport thread
  // would spin on it until the group is destroyed. A receive that times out makes Gloo close
  // every pair of its context, as after its own timeouts: one on kCloseTag (nobody sends on
  // it), waited on for a millisecond. The peers then see the connection closed at once.
  try {
    std::vector<at::Tensor> one{at::empty({1}, at::TensorOptions().dtype(at::kByte))};
    const c10::intrusive_ptr<c10d::Work> work = group_->recv(one, (rank_ + 1) % size_, kCloseTag);
    (void)work->wait(numbers::kCloseWait);
  } catch (...) {  // NOLINT(bugprone-empty-catch): the expected outcome (closed, or already)
  }
}

void ProcessGroupCommunicator::wait_p2p_here(Deadline deadline, const char* what) {
  std::size_t done = 0;
  for (;;) {
    c10::intrusive_ptr<c10d::Work> work;
    {
      const std::lock_guard<std::mutex> lock(inflight_mu_);
      if (done == inflight_.size()) {
        inflight_.clear();
        return;
      }
      work = inflight_[done];
    }
    std::chrono::milliseconds left = ::kNoTimeout;  // Work.hpp declares it outside c10d
    if (deadline != Deadline::max()) {
      left = std::max(std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()),
                      std::chrono::milliseconds(1));
    }
    bool completed = false;
    std::string failure;
    try {
      completed = work->wait(left);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (abort_requested_.load()) {
      throw Aborted("rank " + std::to_string(rank_) + ": abort() while in " + what + " on " +
                    name_ + "; the Gloo context is aborted, rebuild the group");
    }
    if (!failure.empty() || !completed) {
      if (Clock::now() >= deadline) {
        throw Timeout("rank " + std::to_string(rank_) + ": " + what + " on " + name_ +
                      " passed its deadline waiting for peers (the communicator is poisoned; "
                      "rebuild the group or end the process)");
      }
      throw RemoteError("rank " + std::to_string(rank_) + ": " + what + " on " + name_ +
                        " failed: " + (failure.empty() ? "not completed" : failure));
    }
    ++done;
  }
}

namespace {

// Each rank's host, hosts numbered in the order of their lowest rank, from every rank's host
// facts (the name's hash first).
std::vector<int> hosts_by_name(const std::vector<std::array<std::uint64_t, 2>>& all) {
  std::vector<int> hosts;
  std::vector<std::uint64_t> names;
  for (const auto& r : all) {
    const auto at = std::find(names.begin(), names.end(), r[0]);
    hosts.push_back(static_cast<int>(at - names.begin()));
    if (at == names.end()) {
      names.push_back(r[0]);
    }
  }
  return hosts;
}

}  // namespace

int ProcessGroupCommunicator::count_ranks_on_host(Deadline deadline) {
  if (size_ == 1) {
    hosts_ = {0};
    return 1;
  }
  // Every rank exchanges its host name's hash and its LOCAL_WORLD_SIZE (torchrun sets it), so
  // that every rank decides alike even when the environment differs between ranks: the
  // variable is believed only when every rank has the same one.
  std::array<char, 256> name{};
  (void)::gethostname(name.data(), name.size() - 1);
  const char* env = std::getenv("LOCAL_WORLD_SIZE");
  const std::array<std::uint64_t, 2> mine{
      std::hash<std::string_view>{}(std::string_view(name.data())),
      env != nullptr && std::atoi(env) > 0 ? static_cast<std::uint64_t>(std::atoi(env)) : 0};
  // Parked on failure: an interrupted or timed-out receive may still write into it.
  const std::vector<std::byte> bytes =
      detail::gather_or_park(*this, std::as_bytes(std::span(mine)), deadline);
  std::vector<std::array<std::uint64_t, 2>> all(static_cast<std::size_t>(size_));
  std::memcpy(all.data(), bytes.data(), bytes.size());
  const bool env_agrees =
      std::all_of(all.begin(), all.end(), [&](const auto& r) { return r[1] == all[0][1]; });
  hosts_ = hosts_by_name(all);
  if (env_agrees && all[0][1] != 0) {
    const auto local = static_cast<int>(all[0][1]);
    // Decided from the table every rank holds, so every rank decides alike: where some host's
    // name count differs from the variable, which rank is where is unknown.
    if (std::any_of(hosts_.begin(), hosts_.end(),
                    [&](int h) { return std::count(hosts_.begin(), hosts_.end(), h) != local; })) {
      hosts_.clear();
    }
    return local;
  }
  return static_cast<int>(
      std::count_if(all.begin(), all.end(), [&](const auto& r) { return r[0] == mine[0]; }));
}

void ProcessGroupCommunicator::do_all_to_all_scatter(std::span<const ConstSegment> send,
                                                     std::span<const std::size_t> send_first,
                                                     std::span<const RecvPiece> pieces,
                                                     std::span<const std::size_t> first,
                                                     Deadline deadline) {
  // Reached only where capabilities().all_to_all (point to point); the base checks it.
  const char* what = "all_to_all_scatter";
  check_not_aborted_before(what);
  const auto world = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  copy_stream(rank_part(send, send_first, me), rank_part(pieces, first, me));
  ChunkedExchange x;
  // The same on every rank (the group's size is): two slots each way per peer at most.
  x.chunk = chunk_within_budget(4 * (world - 1));
  for (std::size_t step = 1; step < world; ++step) {
    const std::size_t q = (me + world - step) % world;
    const std::span<const RecvPiece> from = rank_part(pieces, first, q);
    if (const std::uint64_t bytes = stream_bytes(from); bytes != 0) {
      x.receive(from, bytes, static_cast<int>(q));
    }
  }
  for (std::size_t step = 1; step < world; ++step) {
    const std::size_t p = (me + step) % world;
    const std::span<const ConstSegment> to = rank_part(send, send_first, p);
    if (const std::uint64_t bytes = stream_bytes(to); bytes != 0) {
      x.send(to, bytes).peers.push_back(static_cast<int>(p));
    }
  }
  exchange_chunked(x, deadline, what);
}

void ProcessGroupCommunicator::do_barrier(Deadline deadline) {
  if (mailbox_ != nullptr) {  // a zero-byte gather returns once every rank has arrived
    mailbox_->all_gather({}, {}, deadline, [this] { check_interrupt(); });
    return;
  }
  c10d::BarrierOptions options;
  options.device = device_;  // the backend this communicator uses, on a group with several
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = group_->barrier(options);
  } catch (const std::exception& e) {
    raise_not_issued(e, rank_, "barrier", name_);
  }
  wait(work, deadline, "barrier");
}

void ProcessGroupCommunicator::do_abort() noexcept {
  abort_requested_.store(true);
  if (mailbox_ != nullptr) {
    mailbox_->interrupt();
  }
  const std::lock_guard<std::mutex> lock(inflight_mu_);
  abort_works_locked();  // wakes a p2p wait (Gloo aborts the unbound buffer's wait)
}

void ProcessGroupCommunicator::abort_works_locked() noexcept {
  // Not cleared here: wait_p2p walks inflight_ by index from another thread.
  for (auto& work : inflight_) {
    try {
      work->abort();
    } catch (...) {  // NOLINT(bugprone-empty-catch): abort never throws to its caller
    }
  }
}

}  // namespace shardgather::detail

namespace shardgather {

std::unique_ptr<Communicator> make_torch_communicator(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::Device device,
    const TorchGroupOptions& options) {
  return std::make_unique<detail::ProcessGroupCommunicator>(
      group, device, options.p2p, options.host_mailbox, options.setup_timeout);
}

bool torch_uses_host_mailbox(const Communicator& comm) noexcept {
  const auto* pg = dynamic_cast<const detail::ProcessGroupCommunicator*>(&comm);
  return pg != nullptr && pg->uses_host_mailbox();
}

}  // namespace shardgather
