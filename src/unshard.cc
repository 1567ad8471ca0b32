// unshard: shards along any dim into full parameters, received straight into place.
//
// Rank r's wire stream is the real part of each of its shards, parameter by parameter (padding
// never travels). Part (r, i) lands in parameter i's full tensor as `outer` blocks of
// sizes[r] * inner bytes, one per index of the dims before the shard dim, full[d] * inner bytes
// apart, starting at row offset sum(sizes[< r]). For dim 0 (outer == 1) that is one contiguous
// block, so a single dim-0 parameter gathers straight into the full tensor with a plain
// all_gather_v.
#include "shardgather/unshard.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "detail/checked_math.h"
#include "detail/exec_scratch.h"
#include "detail/hash.h"
#include "detail/local_input.h"
#include "detail/parallel.h"
#include "detail/plan_common.h"
#include "detail/send_stream.h"

#include "shardgather/copy.h"
#include "shardgather/errors.h"
#include "shardgather/layout.h"

namespace shardgather {

namespace {

constexpr std::uint64_t kOutputAlignment = 64;

std::string param_prefix(std::size_t i) { return "parameter " + std::to_string(i) + ": "; }

// Bytes of the dims before (outer, as a count) and after (inner, in bytes) the shard dim.
struct Split {
  std::uint64_t outer = 1;
  std::uint64_t inner_bytes = 1;
};

Split split_of(const ShardSpec& s) {
  const auto d = static_cast<std::size_t>(s.shard_dim);
  Split split;
  const Shape before(s.full_shape.begin(), s.full_shape.begin() + static_cast<std::ptrdiff_t>(d));
  const Shape after(s.full_shape.begin() + static_cast<std::ptrdiff_t>(d) + 1, s.full_shape.end());
  split.outer = checked_nbytes(DType::kUInt8, before);
  split.inner_bytes = checked_nbytes(s.dtype, after);
  return split;
}

}  // namespace

std::vector<std::int64_t> chunk_sizes(std::int64_t full, int world_size) {
  if (world_size < 1 || full < 0) {
    throw InvalidArgument("chunk_sizes: " + std::to_string(full) + " over " +
                          std::to_string(world_size) + " ranks");
  }
  const std::int64_t chunk = full == 0 ? 0 : (full + world_size - 1) / world_size;
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(world_size));
  std::int64_t left = full;
  for (auto& size : sizes) {
    size = std::min(chunk, left);
    left -= size;
  }
  return sizes;
}

UnshardPlan::UnshardPlan(std::span<const ShardSpec> specs, int world_size, int rank,
                         const PlanOptions& options)
    : specs_(specs.begin(), specs.end()), world_(world_size), rank_(rank), options_(options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw InvalidArgument("UnshardPlan: rank " + std::to_string(rank) + " of " +
                          std::to_string(world_size));
  }
  const auto world = static_cast<std::size_t>(world_size);
  const std::size_t n = specs_.size();
  detail::Hasher hasher;
  hasher.add(world);
  hasher.add(n);
  std::uint64_t end = 0;
  output_offsets_.resize(n);
  part_bytes_.assign(world * n, 0);
  part_pieces_.assign(world * n, RecvPiece{});
  part_offsets_.assign(world * n, 0);
  counts_.assign(world, 0);
  for (std::size_t i = 0; i < n; ++i) {
    ShardSpec& s = specs_[i];
    const std::string where = param_prefix(i);
    const auto ndim = static_cast<int>(s.full_shape.size());
    if (ndim == 0) {
      throw InvalidArgument(where + "a 0-d parameter has no dim to shard");
    }
    if (s.shard_dim < -ndim || s.shard_dim >= ndim) {
      throw InvalidArgument(where + "shard dim " + std::to_string(s.shard_dim) +
                            " out of range for " + detail::shape_str(s.full_shape));
    }
    if (s.shard_dim < 0) {
      s.shard_dim += ndim;
    }
    std::uint64_t full_bytes = 0;
    try {
      full_bytes = checked_nbytes(s.dtype, s.full_shape);
    } catch (const CountOverflow& e) {
      throw CountOverflow(where + e.what());
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(where + e.what());
    }
    const std::int64_t full_d = s.full_shape[static_cast<std::size_t>(s.shard_dim)];
    if (s.sizes.empty()) {
      s.sizes = chunk_sizes(full_d, world_size);
    }
    if (s.sizes.size() != world) {
      throw InvalidArgument(where + std::to_string(s.sizes.size()) + " shard sizes for " +
                            std::to_string(world) + " ranks");
    }
    std::int64_t sum = 0;
    for (const std::int64_t size : s.sizes) {
      if (size < 0) {
        throw InvalidArgument(where + "negative shard size " + std::to_string(size));
      }
      sum += size;
    }
    if (sum != full_d) {
      throw InvalidArgument(where + "shard sizes sum to " + std::to_string(sum) + " but dim " +
                            std::to_string(s.shard_dim) + " of " + detail::shape_str(s.full_shape) +
                            " is " + std::to_string(full_d));
    }
    const std::int64_t largest = *std::max_element(s.sizes.begin(), s.sizes.end());
    if (s.padded_size != 0 && s.padded_size < largest) {
      throw InvalidArgument(where + "padded size " + std::to_string(s.padded_size) +
                            " is smaller than the largest shard, " + std::to_string(largest));
    }
    const Split split = split_of(s);
    const std::uint64_t row_bytes = static_cast<std::uint64_t>(full_d) * split.inner_bytes;
    std::uint64_t row = 0;
    for (std::size_t r = 0; r < world; ++r) {
      const auto rows = static_cast<std::uint64_t>(s.sizes[r]);
      const std::uint64_t block = rows * split.inner_bytes;
      const std::size_t k = r * n + i;
      part_bytes_[k] = block * split.outer;
      // execute() sets `data` to the full tensor's address plus the offset.
      part_offsets_[k] = row * split.inner_bytes;
      part_pieces_[k] = RecvPiece{nullptr, block, split.outer, row_bytes};
      counts_[r] = detail::add_checked(counts_[r], part_bytes_[k], "bytes per rank");
      row += rows;
    }
    end = detail::align_up_checked(end, kOutputAlignment, "output offset");
    output_offsets_[i] = end;
    end = detail::add_checked(end, full_bytes, "output size");
    hasher.add(static_cast<std::uint64_t>(s.dtype));
    hasher.add(static_cast<std::uint64_t>(s.shard_dim));
    hasher.add(static_cast<std::uint64_t>(s.padded_size));
    for (const std::int64_t dim : s.full_shape) {
      hasher.add(static_cast<std::uint64_t>(dim));
    }
    for (const std::int64_t size : s.sizes) {
      hasher.add(static_cast<std::uint64_t>(size));
    }
  }
  output_bytes_ = end;
  for (std::size_t i = 0; i < n; ++i) {
    local_bytes_.push_back(checked_nbytes(specs_[i].dtype, shard_shape(rank, i)));
  }
  fingerprint_ = hasher.value() == 0 ? 1 : hasher.value();
}

Shape UnshardPlan::shard_shape(int rank, std::size_t i) const {
  const ShardSpec& s = specs_.at(i);
  Shape shape = s.full_shape;
  shape[static_cast<std::size_t>(s.shard_dim)] =
      s.padded_size != 0 ? s.padded_size : s.sizes.at(static_cast<std::size_t>(rank));
  return shape;
}

std::vector<TensorView> UnshardPlan::views(std::byte* buffer) const {
  std::vector<TensorView> out;
  out.reserve(specs_.size());
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    out.push_back(TensorView{.data = buffer + output_offsets_[i],
                             .dtype = specs_[i].dtype,
                             .shape = specs_[i].full_shape,
                             .strides = {}});
  }
  return out;
}

ExecStats UnshardPlan::execute(std::span<const TensorView> shards, Communicator& comm,
                               std::span<std::byte> out) {
  detail::ExecScratch& x = scratch_.get();
  x.outputs.resize(specs_.size());
  std::optional<std::string> error;
  if (out.size() < output_bytes_) {
    error = "the output holds " + std::to_string(out.size()) + " bytes, the plan needs " +
            std::to_string(output_bytes_);
  }
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    x.outputs[i] = out.data() + output_offsets_[i];
  }
  return execute_into(shards, comm, error, true);
}

ExecStats UnshardPlan::execute(std::span<const TensorView> shards, Communicator& comm,
                               std::span<const TensorView> outputs) {
  detail::ExecScratch& x = scratch_.get();
  x.outputs.resize(specs_.size());
  std::optional<std::string> error;
  if (outputs.size() != specs_.size()) {
    error = "the plan has " + std::to_string(specs_.size()) + " parameters, got " +
            std::to_string(outputs.size()) + " outputs";
  }
  for (std::size_t i = 0; i < specs_.size() && !error; ++i) {
    const TensorView& o = outputs[i];
    const ShardSpec& s = specs_[i];
    if (o.dtype != s.dtype || o.shape != s.full_shape || !is_contiguous(o)) {
      error = "output " + std::to_string(i) + ": needs a contiguous " +
              std::string(dtype_name(s.dtype)) + " tensor of " + detail::shape_str(s.full_shape) +
              ", got " + std::string(dtype_name(o.dtype)) + " " + detail::shape_str(o.shape);
    } else if (o.data == nullptr && checked_nbytes(s.dtype, s.full_shape) != 0) {
      error = "output " + std::to_string(i) + ": null data";
    }
    x.outputs[i] = static_cast<std::byte*>(o.data);
  }
  return execute_into(shards, comm, error, false);
}

ExecStats UnshardPlan::execute_into(std::span<const TensorView> shards, Communicator& comm,
                                    const std::optional<std::string>& output_error,
                                    bool one_buffer) {
  detail::ExecScratch& x = scratch_.get();
  const std::size_t n = specs_.size();
  const auto world = static_cast<std::size_t>(world_);
  const auto me = static_cast<std::size_t>(rank_);
  detail::size_scratch(x, world_, n);
  const Deadline deadline = comm.deadline_after(options_.timeout.value_or(comm.timeout()));
  const bool exchange = world_ > 1 && options_.preflight;
  ExecStats stats;

  detail::PreflightHeader header;
  header.world_size = static_cast<std::uint32_t>(world_);
  header.seq = comm.next_op_seq();
  header.flags = detail::kHasHint;
  header.hint_hash = fingerprint_;
  header.payload_bytes = counts_[me];
  header.num_tensors = n;
  std::uint64_t staged = 0;
  try {
    if (comm.size() != world_ || comm.rank() != rank_) {
      throw InvalidArgument("the plan was built for rank " + std::to_string(rank_) + " of " +
                            std::to_string(world_) + ", the communicator is rank " +
                            std::to_string(comm.rank()) + " of " + std::to_string(comm.size()));
    }
    if (output_error) {
      throw InvalidArgument(*output_error);
    }
    if (shards.size() != n) {
      throw InvalidArgument("the plan has " + std::to_string(n) + " parameters, got " +
                            std::to_string(shards.size()) + " shards");
    }
    // Every shard against its spec, then aliasing: against the one output buffer (O(n)), or
    // across every extent, shards read and outputs written (sorted, O(n log n)).
    const auto out_begin =
        reinterpret_cast<std::uintptr_t>(x.outputs.empty() ? nullptr : x.outputs[0]);
    const std::uintptr_t out_end = out_begin + output_bytes_;
    x.extents.clear();
    for (std::size_t i = 0; i < n; ++i) {
      const ShardSpec& s = specs_[i];
      const TensorView& t = shards[i];
      if (t.dtype != s.dtype || t.shape.size() != s.full_shape.size()) {
        throw InvalidArgument("tensor " + std::to_string(i) + ": expected a " +
                              std::string(dtype_name(s.dtype)) + " shard of rank " +
                              std::to_string(s.full_shape.size()) + ", got " +
                              std::string(dtype_name(t.dtype)) + " " + detail::shape_str(t.shape));
      }
      for (std::size_t d = 0; d < t.shape.size(); ++d) {
        const std::int64_t want = d != static_cast<std::size_t>(s.shard_dim) ? s.full_shape[d]
                                  : s.padded_size != 0                       ? s.padded_size
                                                                             : s.sizes[me];
        if (t.shape[d] != want) {
          throw InvalidArgument("tensor " + std::to_string(i) + ": shard shape " +
                                detail::shape_str(t.shape) + ", rank " + std::to_string(rank_) +
                                " should pass dim " + std::to_string(d) + " = " +
                                std::to_string(want) + " (full " + detail::shape_str(s.full_shape) +
                                ", shard dim " + std::to_string(s.shard_dim) + ")");
        }
      }
      const std::uint64_t bytes = local_bytes_[i];
      detail::check_tensor_matches(t, i, s.dtype, t.shape, bytes);
      if (!is_contiguous(t)) {
        staged += bytes;
      }
      const detail::Extent e = detail::extent_of(t, bytes);
      if (one_buffer) {
        if (e.begin < e.end && e.begin < out_end && out_begin < e.end) {
          throw InvalidArgument("tensor " + std::to_string(i) +
                                ": aliasing: the shard overlaps the output (in-place unshard is "
                                "not supported; keep shards and full tensors apart)");
        }
        continue;
      }
      x.extents.push_back({e, false});
      const auto o = reinterpret_cast<std::uintptr_t>(x.outputs[i]);
      x.extents.push_back({{o, o + checked_nbytes(s.dtype, s.full_shape)}, true});
    }
    std::sort(x.extents.begin(), x.extents.end(),
              [](const auto& a, const auto& b) { return a.extent.begin < b.extent.begin; });
    std::uintptr_t write_end = 0;  // end of the furthest output so far
    std::uintptr_t any_end = 0;    // end of the furthest extent so far
    for (const auto& e : x.extents) {
      if (e.extent.begin == e.extent.end) {
        continue;
      }
      if (e.extent.begin < write_end || (e.written && e.extent.begin < any_end)) {
        throw InvalidArgument(
            "aliasing: an output overlaps a shard or another output (in-place unshard is not "
            "supported; keep shards and full tensors apart)");
      }
      any_end = std::max(any_end, e.extent.end);
      if (e.written) {
        write_end = std::max(write_end, e.extent.end);
      }
    }
    if (x.staging.size() < staged) {
      x.staging.resize(staged);
    }
  } catch (const Error& e) {
    if (!exchange) {
      throw_error(e.code(), detail::rank_prefix(rank_) + e.what());
    }
    detail::set_status(header, e.code(), e.what());
  }
  if (exchange) {
    detail::exchange_plan_header(comm, header, scratch_, deadline);
    stats.preflight_collectives = 1;
  }

  // This rank's stream: the real part of each shard.
  x.segments.clear();
  x.send_first.clear();
  std::byte* staging = x.staging.data();
  for (std::size_t i = 0; i < n; ++i) {
    x.send_first.push_back(x.segments.size());
    const ShardSpec& s = specs_[i];
    const TensorView& t = shards[i];
    const auto real = static_cast<std::uint64_t>(s.sizes[me]);
    const auto local = static_cast<std::uint64_t>(s.padded_size != 0 ? s.padded_size : s.sizes[me]);
    const std::uint64_t bytes = part_bytes_[me * n + i];
    if (bytes == 0) {
      continue;
    }
    if (real == local) {
      detail::append_tensor(t, bytes, false, staging, x.segments);
      continue;
    }
    // Padded: the real rows of every outer index, from the shard (packed first if strided).
    const Split split = split_of(s);
    const auto* base = static_cast<const std::byte*>(t.data);
    if (!is_contiguous(t)) {
      pack(t, staging);
      base = staging;
      staging += split.outer * local * split.inner_bytes;
    }
    for (std::uint64_t o = 0; o < split.outer; ++o) {
      x.segments.push_back({base + o * local * split.inner_bytes, real * split.inner_bytes});
    }
  }
  x.send_first.push_back(x.segments.size());
  stats.staged_bytes = staged;

  for (std::size_t k = 0; k < world * n; ++k) {
    const RecvPiece& p = part_pieces_[k];
    x.pieces[k] = RecvPiece{x.outputs[k % n] + part_offsets_[k], p.block, p.count, p.stride};
    x.part_bytes[k] = part_bytes_[k];
    x.part_first[k] = k;
  }
  for (std::size_t r = 0; r <= world; ++r) {
    x.first[r] = r * n;
  }
  x.part_first[world * n] = world * n;

  const detail::GatherJob job{
      .send = x.segments,
      .pieces = x.pieces,
      .first = x.first,
      .counts = counts_,
      .num_tensors = n,
      .part_bytes = x.part_bytes,
      .part_first = x.part_first,
      .send_first = x.send_first,
      .copy_threads = options_.copy_threads > 0
                          ? options_.copy_threads
                          : detail::default_copy_threads(comm.ranks_on_host()),
      .stream_displs = {},
      .entry_synchronized = exchange,
  };
  detail::run_payload(options_.strategy, job, comm, deadline, scratch_, stats);
  return stats;
}

UnshardResult unshard(std::span<const TensorView> shards, Communicator& comm,
                      std::span<const ShardSpec> specs, const PlanOptions& options) {
  const Deadline deadline = comm.deadline_after(options.timeout.value_or(comm.timeout()));
  const bool exchange = comm.size() > 1 && options.preflight;
  // A one-shot call must not create a node-shared window it uses once: kAuto means kDirect.
  PlanOptions one_shot = options;
  if (one_shot.strategy == Strategy::kAuto) {
    one_shot.strategy = Strategy::kDirect;
  }
  UnshardPlan plan;
  AlignedBuffer buffer;
  try {
    try {
      plan = UnshardPlan(specs, comm.size(), comm.rank(), one_shot);
      buffer = AlignedBuffer(plan.output_bytes());
    } catch (const std::bad_alloc&) {
      throw OutOfMemory("allocation failed while planning unshard");
    }
  } catch (const Error& e) {
    detail::raise_through_header(comm, e, exchange, deadline);
  }
  ExecStats stats;
  try {
    stats = plan.execute(shards, comm, std::span<std::byte>(buffer.data(), buffer.size()));
  } catch (const CommunicationError&) {
    detail::leak(buffer);
    throw;
  }
  std::vector<TensorView> views = plan.views(buffer.data());
  return {std::move(views), std::move(buffer), stats};
}

}  // namespace shardgather
