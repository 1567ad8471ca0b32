// The single validated entry path: validate -> pre-flight -> plan -> one all_gather_v -> views.
// Everything after check_headers() trusts the plan (NCCL's ncclEnqueueCheck discipline).
#include "shardgather/foreach_all_gather.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <string>

#include "preflight.h"
#include "records.h"

#include "shardgather/copy.h"
#include "shardgather/errors.h"

namespace shardgather {

namespace {

// Alignment gaps inside a block are sent from here, so no gap ever needs a copy.
alignas(8) constexpr std::byte kZeros[8] = {};

constexpr std::uint64_t kHugePageBytes = std::uint64_t{2} << 20;

std::string shape_str(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    s += (d == 0 ? "" : ", ") + std::to_string(shape[d]);
  }
  return s + "]";
}

// What this rank contributes, validated.
struct LocalInput {
  std::vector<DType> dtypes;
  std::vector<Shape> shapes;
  std::vector<std::uint64_t> nbytes;
  std::uint64_t strided_bytes = 0;  // staging needed for non-contiguous inputs
};

LocalInput validate_params(std::span<const TensorView> params) {
  LocalInput in;
  in.dtypes.reserve(params.size());
  in.shapes.reserve(params.size());
  in.nbytes.reserve(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const TensorView& t = params[i];
    const std::string where = "tensor " + std::to_string(i) + ": ";
    std::uint64_t bytes = 0;
    try {
      bytes = checked_nbytes(t.dtype, t.shape);
    } catch (const CountOverflow& e) {
      throw CountOverflow(where + e.what());
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(where + e.what());
    }
    if (!t.strides.empty() && t.strides.size() != t.shape.size()) {
      throw InvalidArgument(where + std::to_string(t.strides.size()) + " strides for " +
                            std::to_string(t.shape.size()) + " dims");
    }
    if (t.data == nullptr && bytes != 0) {
      throw InvalidArgument(where + "null data pointer with " + std::to_string(bytes) +
                            " bytes of shape " + shape_str(t.shape));
    }
    if (!is_contiguous(t)) {
      in.strided_bytes += bytes;
    }
    in.dtypes.push_back(t.dtype);
    in.shapes.push_back(t.shape);
    in.nbytes.push_back(bytes);
  }
  return in;
}

// The hint's shape for every (rank, tensor), rank-major; checks this rank's row.
std::vector<Shape> check_hint(std::span<const std::vector<Shape>> hint, const LocalInput& in,
                              int rank, int world) {
  const std::size_t n = in.shapes.size();
  if (hint.size() != static_cast<std::size_t>(world)) {
    throw InvalidArgument("shapes hint has " + std::to_string(hint.size()) +
                          " rows for world size " + std::to_string(world));
  }
  std::vector<Shape> flat;
  flat.reserve(hint.size() * n);
  for (std::size_t r = 0; r < hint.size(); ++r) {
    if (hint[r].size() != n) {
      throw InvalidArgument("shapes hint row " + std::to_string(r) + " has " +
                            std::to_string(hint[r].size()) + " shapes, this rank passes " +
                            std::to_string(n) + " tensors");
    }
    flat.insert(flat.end(), hint[r].begin(), hint[r].end());
  }
  const auto& row = hint[static_cast<std::size_t>(rank)];
  for (std::size_t i = 0; i < n; ++i) {
    if (row[i] != in.shapes[i]) {
      throw InvalidArgument("tensor " + std::to_string(i) + ": shapes hint for rank " +
                            std::to_string(rank) + " says " + shape_str(row[i]) +
                            " but the tensor is " + shape_str(in.shapes[i]));
    }
  }
  return flat;
}

// This rank's send: records (no-hint path), zero gaps and each tensor's bytes, straight from
// the tensor when it is contiguous, from `staging` when it had to be packed.
std::vector<ConstSegment> build_segments(std::span<const TensorView> params, const LocalInput& in,
                                         const BlockLayout& block,
                                         std::span<const std::byte> records, std::byte* staging) {
  std::vector<ConstSegment> segments;
  segments.reserve(params.size() + 2);
  std::uint64_t end = 0;
  if (!records.empty()) {
    segments.push_back({records.data(), records.size()});
    end = records.size();
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (in.nbytes[i] == 0) {
      continue;
    }
    if (block.offsets[i] > end) {
      segments.push_back({kZeros, block.offsets[i] - end});
    }
    if (is_contiguous(params[i])) {
      segments.push_back({static_cast<const std::byte*>(params[i].data), in.nbytes[i]});
    } else {
      pack(params[i], staging);
      segments.push_back({staging, in.nbytes[i]});
      staging += in.nbytes[i];
    }
    end = block.offsets[i] + in.nbytes[i];
  }
  return segments;
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
  const int rank = comm.rank();
  const int world = comm.size();
  const Deadline deadline = comm.deadline_after(options.timeout.value_or(comm.timeout()));
  const bool has_hint = !shapes_across_group.empty();
  // At world size 1 nothing can disagree: no header, no collective, a local copy.
  const bool send_header = world > 1 && (options.preflight || !has_hint);
  const LayoutOptions layout_options{.with_records = !has_hint};
  const std::uint64_t seq = comm.next_op_seq();

  detail::PreflightHeader header;
  header.world_size = static_cast<std::uint32_t>(world);
  header.seq = seq;
  header.flags = has_hint ? detail::kHasHint : 0U;

  LocalInput in;
  std::vector<Shape> hint_flat;
  LayoutPlan plan;
  BlockLayout block;
  AlignedBuffer out;
  std::vector<std::byte> records;
  std::vector<std::byte> staging;
  // Local checks and allocations come before the header so that their failure travels in it.
  try {
    try {
      in = validate_params(params);
      detail::set_dtypes(header, in.dtypes);
      if (has_hint) {
        hint_flat = check_hint(shapes_across_group, in, rank, world);
        header.hint_hash = detail::hash_hint(hint_flat, world);
        plan = plan_layout(in.dtypes, hint_flat, world, layout_options);
        out = AlignedBuffer(plan.total_bytes);
      } else if (world == 1) {
        plan = plan_layout(in.dtypes, in.shapes, world, layout_options);
        out = AlignedBuffer(plan.total_bytes);
      }
      block = plan_block(in.dtypes, in.shapes, layout_options);
      header.payload_bytes = block.bytes;
      if (layout_options.with_records) {
        records.resize(block.record_bytes);
        detail::encode_records(in.shapes, records.data());
      }
      staging.resize(in.strided_bytes);
    } catch (const std::bad_alloc&) {
      throw OutOfMemory("allocation failed while preparing the call");
    }
  } catch (const Error& e) {
    if (!send_header) {
      throw_error(e.code(), "rank " + std::to_string(rank) + ": " + e.what());
    }
    detail::set_status(header, e.code(), e.what());
  }

  CallStats stats;
  stats.staged_bytes = in.strided_bytes;
  std::vector<detail::PreflightHeader> headers;
  if (send_header) {
    std::vector<std::byte> gathered(sizeof header * static_cast<std::size_t>(world));
    comm.all_gather(std::as_bytes(std::span(&header, 1)), gathered, deadline);
    (has_hint ? stats.preflight_collectives : stats.metadata_collectives) += 1;
    headers.resize(static_cast<std::size_t>(world));
    detail::check_headers(gathered, headers, rank);
  }

  std::vector<std::uint64_t> counts;
  std::vector<std::uint64_t> displs;
  if (has_hint || world == 1) {
    counts = plan.counts;
    displs = plan.displs;
    for (std::size_t r = 0; r < headers.size(); ++r) {
      if (headers[r].payload_bytes != counts[r]) {
        throw Mismatch("rank " + std::to_string(rank) + ": foreach_all_gather op seq " +
                       std::to_string(seq) + ": rank " + std::to_string(r) + " sends " +
                       std::to_string(headers[r].payload_bytes) + " bytes, the shapes hint says " +
                       std::to_string(counts[r]));
      }
    }
  } else {
    counts.resize(headers.size());
    displs.resize(headers.size());
    for (std::size_t r = 0; r < headers.size(); ++r) {
      counts[r] = headers[r].payload_bytes;
    }
    const std::uint64_t total =
        place_blocks(counts, block_alignment(in.dtypes, layout_options), displs);
    out = AlignedBuffer(total);
  }

  const std::vector<ConstSegment> segments =
      build_segments(params, in, block, records, staging.data());
  const std::uint64_t total_bytes = counts.empty() ? 0 : displs.back() + counts.back();
  if (world == 1) {
    copy_segments(segments, out.data());
  } else if (total_bytes != 0) {
    comm.all_gather_v(segments, out.data(), counts, displs, deadline);
    stats.payload_collectives += 1;
  }

  if (!has_hint && world > 1) {
    // Shapes arrived inside the payload: decode every block's records, then plan.
    std::vector<Shape> shapes;
    shapes.reserve(in.dtypes.size() * static_cast<std::size_t>(world));
    for (std::size_t r = 0; r < counts.size(); ++r) {
      std::vector<Shape> rank_shapes =
          detail::decode_records(std::span<const std::byte>(out.data() + displs[r], counts[r]),
                                 in.dtypes.size(), static_cast<int>(r));
      std::move(rank_shapes.begin(), rank_shapes.end(), std::back_inserter(shapes));
    }
    plan = plan_layout(in.dtypes, shapes, world, layout_options);
    for (std::size_t r = 0; r < counts.size(); ++r) {
      if (plan.counts[r] != counts[r]) {
        throw Mismatch("rank " + std::to_string(rank) + ": foreach_all_gather op seq " +
                       std::to_string(seq) + ": rank " + std::to_string(r) + " sent " +
                       std::to_string(counts[r]) + " bytes but its shapes need " +
                       std::to_string(plan.counts[r]));
      }
    }
  }
  return {std::move(plan), std::move(out), stats};
}

}  // namespace shardgather
