// UnshardStream: a BucketStream (src/ops/bucket_stream.cc) over UnshardPlans. What is its own:
// cutting the parameters into buckets, one plan per bucket, the fingerprint of the cut, the check
// of each shard against its bucket's plan, and the large scratch the plans take turns with.
#include "shardgather/unshard_stream.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>

#include "copies/local_input.h"
#include "ops/call.h"
#include "ops/exec_scratch.h"
#include "ops/payload.h"
#include "ops/plan_access.h"
#include "ops/preflight.h"
#include "ops/start.h"
#include "transport/graveyard.h"
#include "transport/op_queue.h"
#include "vocabulary/checked_math.h"
#include "vocabulary/hash.h"

#include "shardgather/embedding.h"

namespace shardgather {

namespace {

constexpr std::uint64_t kParamAlignment = 64;  // as UnshardPlan lays out its buffer

std::uint64_t aligned(std::uint64_t bytes) {
  return detail::align_up_checked(bytes, kParamAlignment, "parameter size");
}

// The grid of parameter i under `format`, its error naming the parameter.
QuantGrid grid_of(const ShardSpec& spec, QuantFormat format, std::size_t i) {
  return quant_grid(format, spec.full_shape, spec.dtype,
                    "UnshardStream: parameter " + std::to_string(i));
}

// What parameter i takes of a bucket's buffer: its full bytes, or quantized its FP8 data and its
// scales, each aligned.
std::uint64_t param_bytes(const ShardSpec& spec, QuantFormat format, std::size_t i) {
  if (format == QuantFormat::kNone) {
    return aligned(checked_nbytes(spec.dtype, spec.full_shape));
  }
  const QuantGrid grid = grid_of(spec, format, i);
  return aligned(checked_nbytes(DType::kUInt8, spec.full_shape)) +
         aligned(static_cast<std::uint64_t>(grid.num_blocks()) * grid.scale_size());
}

QuantFormat format_of(std::span<const QuantFormat> formats, std::size_t i) {
  return i < formats.size() ? formats[i] : QuantFormat::kNone;
}

// Parameter boundaries of the buckets: greedy, in order, at most `limit` aligned bytes each (a
// larger parameter alone).
std::vector<std::size_t> cut_buckets(std::span<const ShardSpec> specs,
                                     std::span<const QuantFormat> formats, std::uint64_t limit) {
  std::vector<std::size_t> firsts{0};
  std::uint64_t used = 0;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const std::uint64_t bytes = param_bytes(specs[i], format_of(formats, i), i);
    if (i != firsts.back() && used + bytes > limit) {
      firsts.push_back(i);
      used = 0;
    }
    used += bytes;
  }
  if (!specs.empty()) {
    firsts.push_back(specs.size());
  }
  return firsts;
}

// The options a stream runs with: its checks, dst given once, and the plan options every bucket
// shares.
StreamOptions stream_options(StreamOptions options) {
  if (options.bucket_bytes == 0) {
    throw InvalidArgument("UnshardStream: bucket_bytes must be > 0");
  }
  if (options.prefetch < 0) {
    throw InvalidArgument("UnshardStream: prefetch must be >= 0, got " +
                          std::to_string(options.prefetch));
  }
  options.dst = detail::one_dst(options.dst, options.plan.dst, "UnshardStream", "plan.dst");
  options.plan.dst = options.dst;
  options.plan.preflight = true;  // a failure on one rank travels in the next header
  // A node-shared window is per plan, so one per bucket would hold the whole model; kDirect
  // lands every bucket in place with no memory of its own.
  options.plan.strategy = detail::one_shot_strategy(options.plan.strategy);
  // A bucket is a step of the stream, never a pairing for another rank's UnshardPlan::execute.
  if (options.plan.stage.empty()) {
    options.plan.stage = Stage("UnshardStream: bucket");
  }
  return options;
}

}  // namespace

UnshardStream::UnshardStream(std::span<const ShardSpec> specs, int world_size, int rank,
                             const StreamOptions& options, std::span<const QuantFormat> quantize)
    : options_(stream_options(options)),
      rank_(rank),
      formats_(quantize.begin(), quantize.end()),
      firsts_(cut_buckets(specs, quantize, options.bucket_bytes)),
      lent_(std::make_unique<detail::LentScratch>()) {
  if (!formats_.empty() && formats_.size() != specs.size()) {
    throw InvalidArgument("UnshardStream: " + std::to_string(formats_.size()) +
                          " quantize formats for " + std::to_string(specs.size()) + " specs");
  }
  detail::Hasher hasher;
  hasher.add(options.bucket_bytes);
  hasher.add(static_cast<std::uint64_t>(options.prefetch));
  hasher.add(static_cast<std::uint64_t>(static_cast<std::int64_t>(options_.dst) + 1));
  hasher.add(static_cast<std::uint64_t>(options.plan.strategy));
  // The bucket plans' fingerprints leave the formats out; ranks that quantize differently must
  // raise at begin(), before a bucket moves.
  for (std::size_t i = 0; i < specs.size(); ++i) {
    hasher.add(static_cast<std::uint64_t>(format_of(formats_, i)));
  }
  const std::uint64_t buffer_bytes = build_plans(specs, world_size, hasher);
  detail::BucketedPlans& plans = *this;  // a private base: converted here, where it is visible
  stream_ = std::make_unique<detail::BucketStream>(
      plans, detail::BucketStreamFacts{.world = world_size,
                                       .rank = rank,
                                       .prefetch = options_.prefetch,
                                       .timeout = options_.plan.timeout,
                                       .fingerprint = hasher.value() == 0 ? 1 : hasher.value(),
                                       .buffer_bytes = buffer_bytes});
}

std::uint64_t UnshardStream::build_plans(std::span<const ShardSpec> specs, int world_size,
                                         detail::Hasher& hasher) {
  std::uint64_t buffer_bytes = 0;
  for (std::size_t b = 0; b + 1 < firsts_.size(); ++b) {
    const auto from = static_cast<std::ptrdiff_t>(firsts_[b]);
    const auto to = static_cast<std::ptrdiff_t>(firsts_[b + 1]);
    std::vector<ShardSpec> bucket(specs.begin() + from, specs.begin() + to);
    std::vector<QuantFormat> formats;
    if (!formats_.empty()) {
      formats.assign(formats_.begin() + from, formats_.begin() + to);
    }
    try {
      plans_.emplace_back(bucket, world_size, rank_, options_.plan, -1, formats);
    } catch (const InvalidArgument& e) {
      // The plan numbers parameters within its bucket; the caller's index is what helps.
      throw InvalidArgument("UnshardStream: bucket " + std::to_string(b) + " (parameters " +
                            std::to_string(firsts_[b]) + ".." + std::to_string(firsts_[b + 1] - 1) +
                            "): " + e.what());
    }
    hasher.add(firsts_[b]);
    hasher.add(plans_.back().fingerprint());
    const std::uint64_t bytes =
        plans_.back().quantized() ? lay_out_quantized(b, specs) : plans_.back().output_bytes();
    slots_.resize(plans_.size());
    if (plans_.back().receives()) {
      buffer_bytes = std::max(buffer_bytes, bytes);
    }
  }
  if (std::any_of(plans_.begin(), plans_.end(),
                  [](const UnshardPlan& p) { return p.receives(); })) {
    // Never 0 where buckets arrive: a bucket of empty parameters still has views, which carry
    // its parameters' shapes (and, in the bindings, their names).
    buffer_bytes = std::max(buffer_bytes, kParamAlignment);
  }
  return buffer_bytes;
}

std::uint64_t UnshardStream::lay_out_quantized(std::size_t b, std::span<const ShardSpec> specs) {
  slots_.resize(b + 1);
  std::vector<Slot>& slots = slots_[b];
  std::uint64_t at = 0;
  for (std::size_t i = firsts_[b]; i < firsts_[b + 1]; ++i) {
    const ShardSpec& spec = specs[i];
    const QuantFormat format = format_of(formats_, i);
    if (format == QuantFormat::kNone) {
      slots.push_back({.offset = at, .dtype = spec.dtype, .shape = spec.full_shape});
      at += aligned(checked_nbytes(spec.dtype, spec.full_shape));
      continue;
    }
    const QuantGrid grid = grid_of(spec, format, i);
    slots.push_back({.offset = at, .dtype = DType::kUInt8, .shape = spec.full_shape});
    at += aligned(checked_nbytes(DType::kUInt8, spec.full_shape));
    const DType scale = grid.scale_size() == 1 ? DType::kUInt8 : DType::kFloat32;
    slots.push_back({.offset = at, .dtype = scale, .shape = grid.scale_shape(), .scales = true});
    at += aligned(static_cast<std::uint64_t>(grid.num_blocks()) * grid.scale_size());
  }
  return at;
}

UnshardStream::~UnshardStream() = default;

void UnshardStream::check_inputs(std::span<const TensorView> shards) const {
  for (std::size_t b = 0; b < plans_.size(); ++b) {
    for (std::size_t j = 0; j < plans_[b].size(); ++j) {
      const TensorView& t = shards[firsts_[b] + j];
      const Shape want = plans_[b].shard_shape(rank_, j);
      if (t.dtype != plans_[b].spec(j).dtype || t.shape != want) {
        throw InvalidArgument("tensor " + std::to_string(firsts_[b] + j) + ": rank " +
                              std::to_string(rank_) + " should pass a " +
                              std::string(dtype_name(plans_[b].spec(j).dtype)) + " shard of " +
                              detail::shape_str(want) + ", got " +
                              std::string(dtype_name(t.dtype)) + " " + detail::shape_str(t.shape));
      }
    }
  }
}

ExecStats UnshardStream::execute_bucket(std::size_t b, Communicator& comm,
                                        std::span<const TensorView> shards,
                                        std::span<std::byte> out) {
  if (!plans_[b].quantized()) {
    return detail::PlanAccess::execute(plans_[b], comm, shards, out, *lent_);
  }
  // One output and one scales view per parameter (a default one for a plain parameter); on a
  // rank that receives nothing, none.
  std::vector<TensorView> outputs;
  std::vector<TensorView> scales;
  if (!out.empty()) {
    for (const Slot& s : slots_[b]) {
      TensorView v{.data = out.data() + s.offset,
                   .dtype = s.dtype,
                   .shape = s.shape,
                   .strides = {},
                   .device = shards.front().device};  // the ring is made on the shards' device
      if (s.scales) {
        scales.back() = std::move(v);
      } else {
        outputs.push_back(std::move(v));
        scales.emplace_back();
      }
    }
  }
  return detail::PlanAccess::execute(plans_[b], comm, shards, outputs, scales, *lent_);
}

std::vector<TensorView> UnshardStream::bucket_views(std::size_t b, std::byte* buffer) const {
  if (!plans_[b].quantized()) {
    return plans_[b].views(buffer);
  }
  std::vector<TensorView> out;
  for (const Slot& s : slots_[b]) {
    out.push_back({.data = buffer + s.offset, .dtype = s.dtype, .shape = s.shape, .strides = {}});
  }
  return out;
}

}  // namespace shardgather
