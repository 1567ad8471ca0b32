#include "ops/payload.h"

#include <algorithm>
#include <string>

#include "copies/parallel.h"
#include "transport/graveyard.h"

#include "shardgather/copy.h"
#include "shardgather/errors.h"

namespace shardgather::detail {

ScratchHolder::ScratchHolder() = default;
ScratchHolder::~ScratchHolder() = default;
ScratchHolder::ScratchHolder(const ScratchHolder& /*other*/) {}
ScratchHolder& ScratchHolder::operator=(const ScratchHolder& /*other*/) { return *this; }
ScratchHolder::ScratchHolder(ScratchHolder&& other) noexcept = default;
ScratchHolder& ScratchHolder::operator=(ScratchHolder&& other) noexcept = default;

ExecScratch& ScratchHolder::get() {
  if (!scratch_) {
    scratch_ = std::make_unique<ExecScratch>();
  }
  return *scratch_;
}

void ScratchHolder::leak() noexcept {
  if (scratch_) {
    park(scratch_);
  }
}

void size_scratch(ExecScratch& x, int world, std::size_t n) {
  const auto w = static_cast<std::size_t>(world);
  if (x.first.size() == w + 1 && x.pieces.size() == w * n) {
    return;
  }
  x.segments.reserve(2 * n + 1);
  x.send_first.reserve(n + 1);
  x.pieces.resize(w * n);
  x.first.resize(w + 1);
  x.part_first.resize(w * n + 1);
  x.part_bytes.resize(w * n);
  x.headers.gathered.resize(w * sizeof(PreflightHeader));
  x.headers.decoded.resize(w);
  x.strategy.displs.reserve(w);
  x.strategy.counts.reserve(w);
  x.strategy.first.reserve(w + 1);
  x.strategy.pieces.reserve(w);
}

void check_call_device(Call& call, const Device& device) {
  set_device_type(call.header(), device.type);
  if (device.type == DeviceType::kCpu) {
    return;
  }
  set_device_gather_request(call.header(), device_gather());
  (void)device_wait();  // an unknown SHARDGATHER_DEVICE_WAIT fails here, before the header
  if (call.comm().capabilities().device_memory) {
    return;
  }
  throw InvalidArgument("rank " + std::to_string(call.comm().rank()) + ": tensors on " +
                        device_name(device) + ", but the " +
                        std::string(call.comm().backend_name()) +
                        " transport moves host memory only (CUDA tensors need a torch group, NCCL "
                        "or Gloo, or the threads backend of a CUDA build)");
}

void reserve_device_scratch(ExecScratch& x, const Device& device, std::uint64_t staged,
                            void* stream) {
  if (device.type == DeviceType::kCpu) {
    return;
  }
  StrategyScratch& s = x.strategy;
  if (s.device_zeros.reserve(sizeof kZeroBytes, device.index, stream)) {  // new memory: fill it
    copy_async(s.device_zeros.data(), kZeroBytes, sizeof kZeroBytes, stream);
  }
  s.device_staging.reserve(staged, device.index, stream);
}

Stager stager_for(ExecScratch& x, const Device& device) {
  if (device.type == DeviceType::kCpu) {
    return Stager{.at = x.staging.data()};
  }
  StrategyScratch& s = x.strategy;
  s.copy_stage.clear();
  return Stager{
      .at = s.device_staging.data(), .deferred = &s.copy_stage, .zeros = s.device_zeros.data()};
}

Strategy one_shot_strategy(Strategy requested) noexcept {
  return requested == Strategy::kAuto ? Strategy::kDirect : requested;
}

void run_payload(Call& call, Strategy requested, Strategy strategy, const ExchangeJob& job,
                 StrategyScratch& scratch, ExecStats& stats) {
  Communicator& comm = call.comm();
  stats.strategy = strategy;
  // Nothing moves anywhere: the stream shapes' counts are every rank's, the same on every rank,
  // so every rank skips alike. A personal job's counts are only what this rank receives (it may
  // still send), so it never skips.
  const bool empty =
      job.shape != ExchangeShape::kPersonal &&
      std::all_of(job.counts.begin(), job.counts.end(), [](std::uint64_t c) { return c == 0; });
  if (job.device.type != DeviceType::kCpu) {
    stats.strategy = Strategy::kPacked;
    if (empty) {
      return;
    }
    const std::uint64_t before = comm.collectives_issued();
    const DeviceGather request = device_gather_request_of(call.header());
    call.transfer([&] { run_device(job, request, comm, call.deadline(), scratch); });
    stats.payload_collectives = comm.collectives_issued() - before;
    return;
  }
  if (comm.size() == 1) {
    copy_stream(job.send, job.pieces);
    return;
  }
  if (empty) {
    return;
  }
  const std::uint64_t before = comm.collectives_issued();
  const std::uint64_t setup_before = scratch.setup_collectives;
  const auto run = [&] {
    call.transfer([&] { run_strategy(stats.strategy, job, comm, call.deadline(), scratch); });
  };
  const Clock::time_point t0 = Clock::now();
  try {
    run();
  } catch (const OutOfMemory&) {
    // kAuto chose a node-shared window and it could not be reserved (a small /dev/shm, as in
    // a container): SharedBuffer::create raises that on every rank alike, after its collectives
    // completed, so every rank takes the transport path instead, now and for every later
    // execution (select_strategy reads shared_unavailable). An explicit kShared keeps the error.
    const bool windowed =
        stats.strategy == Strategy::kShared || stats.strategy == Strategy::kHierarchical;
    if (requested != Strategy::kAuto || !windowed || scratch.window) {
      throw;
    }
    scratch.shared_unavailable = true;
    stats.strategy = select_strategy(requested, job.shape, job.counts, comm, true);
    run();
  }
  if (requested == Strategy::kAuto) {
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const std::uint64_t settle_before = comm.collectives_issued();
    call.transfer([&] { record_auto(stats.strategy, seconds, comm, call.deadline(), scratch); });
    scratch.setup_collectives += comm.collectives_issued() - settle_before;
  }
  stats.setup_collectives = scratch.setup_collectives - setup_before;
  stats.payload_collectives = comm.collectives_issued() - before - stats.setup_collectives;
}

BlockJob::BlockJob(std::span<const ConstSegment> send, std::byte* base,
                   std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                   bool entry_synchronized)
    : pieces(counts.size()), first(counts.size() + 1, counts.size()), whole{0, send.size()} {
  for (std::size_t r = 0; r < counts.size(); ++r) {
    pieces[r] = RecvPiece{base + displs[r], counts[r], 1, 0};
    first[r] = r;
  }
  job = ExchangeJob{.send = send,
                    .pieces = pieces,
                    .first = first,
                    .counts = counts,
                    .parts = {.count = 1, .bytes = counts, .first = first, .send_first = whole},
                    .copy_threads = 1,
                    .stream_displs = {},
                    .entry_synchronized = entry_synchronized};
}

AlignedBuffer output_buffer(std::uint64_t bytes, const Device& device) {
  if (device.type == DeviceType::kCpu) {
    return AlignedBuffer(bytes);
  }
  DeviceMemory memory(bytes, device.index, current_cuda_stream());
  return {memory.release(), bytes, device};
}

std::vector<TensorView> layout_views(const LayoutPlan& layout, const std::byte* buffer,
                                     const Device& device) {
  const auto world = static_cast<std::size_t>(layout.world_size);
  std::vector<TensorView> out(layout.num_tensors * world);
  for (std::size_t i = 0; i < layout.num_tensors; ++i) {
    for (std::size_t r = 0; r < world; ++r) {
      const std::size_t k = layout.index(static_cast<int>(r), i);
      // Writable views over read-only memory only where the caller's buffer is writable.
      out[i * world + r] = TensorView{.data = const_cast<std::byte*>(buffer) + layout.offsets[k],
                                      .dtype = layout.dtypes[i],
                                      .shape = layout.shapes[k],
                                      .strides = {},
                                      .device = device};
    }
  }
  return out;
}

void check_plan_world(const Communicator& comm, int world, int rank) {
  if (comm.size() != world || comm.rank() != rank) {
    throw InvalidArgument("the plan was built for rank " + std::to_string(rank) + " of " +
                          std::to_string(world) + ", the communicator is rank " +
                          std::to_string(comm.rank()) + " of " + std::to_string(comm.size()));
  }
}

int one_dst(int apart, int in_options, const char* who, const char* options_name) {
  if (apart != -1 && in_options != -1 && apart != in_options) {
    throw InvalidArgument(std::string(who) + ": dst " + std::to_string(apart) + " and " +
                          options_name + " " + std::to_string(in_options) +
                          " differ (give it once)");
  }
  return apart != -1 ? apart : in_options;
}

int copy_threads(const PlanOptions& options, const Communicator& comm) {
  return options.copy_threads > 0 ? options.copy_threads
                                  : default_copy_threads(comm.ranks_on_host());
}

}  // namespace shardgather::detail
