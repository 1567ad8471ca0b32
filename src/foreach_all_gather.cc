// The single validated entry path: validate -> pre-flight -> plan -> one all_gather_v -> views.
// Everything after check_headers() trusts the plan (NCCL's ncclEnqueueCheck discipline).
#include "shardgather/foreach_all_gather.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <string>

#include "detail/local_input.h"
#include "detail/plan_common.h"
#include "detail/send_stream.h"
#include "preflight.h"
#include "records.h"

#include "shardgather/copy.h"
#include "shardgather/errors.h"
#include "shardgather/plan.h"

namespace shardgather {

namespace {

constexpr std::uint64_t kHugePageBytes = std::uint64_t{2} << 20;

// The hint path: a plan from the hint, executed once into a fresh buffer.
GatherResult gather_with_hint(std::span<const TensorView> params, Communicator& comm,
                              std::span<const std::vector<Shape>> hint,
                              const ForeachAllGatherOptions& options) {
  // kDirect, not kAuto: a one-shot call must not create a node-shared window it uses once.
  const PlanOptions plan_options{
      .timeout = options.timeout, .preflight = options.preflight, .strategy = Strategy::kDirect};
  const Deadline deadline = comm.deadline_after(options.timeout.value_or(comm.timeout()));
  const bool exchange = comm.size() > 1 && options.preflight;
  AllGatherPlan plan;
  AlignedBuffer out;
  try {
    try {
      const detail::LocalInput in = detail::validate_params(params);
      detail::check_hint(hint, in, comm.rank(), comm.size());
      plan = AllGatherPlan(in.dtypes, hint, comm.rank(), plan_options);
      out = AlignedBuffer(plan.output_bytes());
    } catch (const std::bad_alloc&) {
      throw OutOfMemory("allocation failed while preparing the call");
    }
  } catch (const Error& e) {
    detail::raise_through_header(comm, e, exchange, deadline);
  }
  const ExecStats exec = plan.execute(params, comm, std::span<std::byte>(out.data(), out.size()));
  const CallStats stats{.preflight_collectives = exec.preflight_collectives,
                        .metadata_collectives = 0,
                        .payload_collectives = exec.payload_collectives,
                        .staged_bytes = exec.staged_bytes};
  return {plan.layout(), std::move(out), stats};
}

}  // namespace

AlignedBuffer::AlignedBuffer(std::uint64_t bytes) : size_(bytes) {
  if (bytes == 0) {
    return;
  }
  // Large buffers get 2 MiB alignment and transparent huge pages: first touch of a 4 KiB page
  // costs about 40x more than of its share of a huge page on the machines this targets.
  const std::uint64_t alignment = bytes >= 2 * kHugePageBytes ? kHugePageBytes : 64;
  const std::uint64_t rounded = (bytes + alignment - 1) / alignment * alignment;
  if (rounded < bytes) {
    throw OutOfMemory("cannot allocate " + std::to_string(bytes) + " bytes");
  }
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) {
    throw OutOfMemory("cannot allocate " + std::to_string(bytes) + " bytes for the output");
  }
  if (alignment == kHugePageBytes) {
    (void)::madvise(p, rounded, MADV_HUGEPAGE);  // advisory: failure only costs speed
  }
  data_.reset(static_cast<std::byte*>(p));
}

void AlignedBuffer::Free::operator()(std::byte* p) const noexcept { std::free(p); }

GatherResult::GatherResult(LayoutPlan plan, AlignedBuffer buffer, CallStats stats)
    : plan_(std::move(plan)), buffer_(std::move(buffer)), stats_(stats) {
  const auto world = static_cast<std::size_t>(plan_.world_size);
  views_.resize(plan_.num_tensors * world);
  for (std::size_t i = 0; i < plan_.num_tensors; ++i) {
    for (std::size_t r = 0; r < world; ++r) {
      const std::size_t k = plan_.index(static_cast<int>(r), i);
      views_[i * world + r] = TensorView{.data = buffer_.data() + plan_.offsets[k],
                                         .dtype = plan_.dtypes[i],
                                         .shape = plan_.shapes[k],
                                         .strides = {}};
    }
  }
}

std::span<const TensorView> GatherResult::operator[](std::size_t i) const {
  if (i >= plan_.num_tensors) {
    throw InvalidArgument("GatherResult: tensor index " + std::to_string(i) + " out of range (" +
                          std::to_string(plan_.num_tensors) + " tensors)");
  }
  const auto world = static_cast<std::size_t>(plan_.world_size);
  return std::span<const TensorView>(views_).subspan(i * world, world);
}

GatherResult foreach_all_gather(std::span<const TensorView> params, Communicator& comm,
                                std::span<const std::vector<Shape>> shapes_across_group,
                                const ForeachAllGatherOptions& options) {
  if (!shapes_across_group.empty()) {
    return gather_with_hint(params, comm, shapes_across_group, options);
  }
  // No hint: the header is the one metadata exchange (bytes per rank), and the shapes travel
  // as records at the head of each rank's block, in the same payload collective.
  const int rank = comm.rank();
  const int world = comm.size();
  const Deadline deadline = comm.deadline_after(options.timeout.value_or(comm.timeout()));
  const LayoutOptions layout_options{.with_records = true};

  detail::PreflightHeader header;
  header.world_size = static_cast<std::uint32_t>(world);
  header.seq = comm.next_op_seq();
  detail::LocalInput in;
  BlockLayout block;
  std::vector<std::byte> records;
  std::vector<std::byte> staging;
  try {
    try {
      in = detail::validate_params(params);
      detail::set_dtypes(header, in.dtypes);
      block = plan_block(in.dtypes, in.shapes, layout_options);
      header.payload_bytes = block.bytes;
      records.resize(block.record_bytes);
      detail::encode_records(in.shapes, records.data());
      staging.resize(in.strided_bytes);
    } catch (const std::bad_alloc&) {
      throw OutOfMemory("allocation failed while preparing the call");
    }
  } catch (const Error& e) {
    if (world == 1) {
      throw_error(e.code(), detail::rank_prefix(rank) + e.what());
    }
    detail::set_status(header, e.code(), e.what());
  }

  CallStats stats;
  stats.staged_bytes = in.strided_bytes;
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(world));
  std::vector<std::uint64_t> displs(counts.size());
  if (world > 1) {
    std::vector<std::byte> gathered(sizeof header * static_cast<std::size_t>(world));
    std::vector<detail::PreflightHeader> headers(static_cast<std::size_t>(world));
    try {
      detail::exchange_headers(comm, header, gathered, headers, deadline);
    } catch (const CommunicationError&) {
      detail::leak(gathered);
      throw;
    }
    stats.metadata_collectives = 1;
    for (std::size_t r = 0; r < counts.size(); ++r) {
      counts[r] = headers[r].payload_bytes;
    }
  } else {
    counts[0] = block.bytes;
  }
  AlignedBuffer out(place_blocks(counts, block_alignment(in.dtypes, layout_options), displs));

  std::vector<ConstSegment> segments;
  std::vector<std::size_t> send_first;
  segments.reserve(2 * params.size() + 1);
  detail::append_block(
      params, block.offsets, 0, block.sizes, records, staging.data(),
      [](std::size_t /*i*/) { return false; }, segments, send_first);
  if (world == 1) {
    copy_segments(segments, out.data());
  } else if (out.size() != 0) {
    try {
      comm.all_gather_v(segments, out.data(), counts, displs, deadline);
    } catch (const CommunicationError&) {
      detail::leak(out);
      detail::leak(staging);
      detail::leak(records);
      throw;
    }
    stats.payload_collectives = 1;
  }

  // Decode every block's records (validated), then plan from them.
  std::vector<Shape> shapes;
  shapes.reserve(in.dtypes.size() * counts.size());
  for (std::size_t r = 0; r < counts.size(); ++r) {
    std::vector<Shape> rank_shapes =
        detail::decode_records(std::span<const std::byte>(out.data() + displs[r], counts[r]),
                               in.dtypes.size(), static_cast<int>(r));
    std::move(rank_shapes.begin(), rank_shapes.end(), std::back_inserter(shapes));
  }
  LayoutPlan plan = plan_layout(in.dtypes, shapes, world, layout_options);
  for (std::size_t r = 0; r < counts.size(); ++r) {
    if (plan.counts[r] != counts[r]) {
      throw Mismatch(detail::rank_prefix(rank) + "foreach_all_gather op seq " +
                     std::to_string(header.seq) + ": rank " + std::to_string(r) + " sent " +
                     std::to_string(counts[r]) + " bytes but its shapes need " +
                     std::to_string(plan.counts[r]));
    }
  }
  return {std::move(plan), std::move(out), stats};
}

}  // namespace shardgather
