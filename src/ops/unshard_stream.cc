// UnshardStream: a BucketStream (src/ops/bucket_stream.cc) over UnshardPlans. What is its own:
// cutting the parameters into buckets, one plan per bucket, the fingerprint of the cut, and the
// check of each shard against its bucket's plan.
#include "shardgather/unshard_stream.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>

#include "copies/local_input.h"
#include "ops/call.h"
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

// Parameter boundaries of the buckets: greedy, in order, at most `limit` aligned full bytes each
// (a larger parameter alone).
std::vector<std::size_t> cut_buckets(std::span<const ShardSpec> specs, std::uint64_t limit) {
  std::vector<std::size_t> firsts{0};
  std::uint64_t used = 0;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const std::uint64_t bytes = detail::align_up_checked(
        checked_nbytes(specs[i].dtype, specs[i].full_shape), kParamAlignment, "parameter size");
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
                             const StreamOptions& options)
    : options_(stream_options(options)),
      rank_(rank),
      firsts_(cut_buckets(specs, options.bucket_bytes)) {
  detail::Hasher hasher;
  hasher.add(options.bucket_bytes);
  hasher.add(static_cast<std::uint64_t>(options.prefetch));
  hasher.add(static_cast<std::uint64_t>(static_cast<std::int64_t>(options_.dst) + 1));
  hasher.add(static_cast<std::uint64_t>(options.plan.strategy));
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
    try {
      plans_.emplace_back(bucket, world_size, rank_, options_.plan);
    } catch (const InvalidArgument& e) {
      // The plan numbers parameters within its bucket; the caller's index is what helps.
      throw InvalidArgument("UnshardStream: bucket " + std::to_string(b) + " (parameters " +
                            std::to_string(firsts_[b]) + ".." + std::to_string(firsts_[b + 1] - 1) +
                            "): " + e.what());
    }
    hasher.add(firsts_[b]);
    hasher.add(plans_.back().fingerprint());
    if (plans_.back().receives()) {
      buffer_bytes = std::max(buffer_bytes, plans_.back().output_bytes());
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
  return detail::PlanAccess::execute(plans_[b], comm, shards, out);
}

std::vector<TensorView> UnshardStream::bucket_views(std::size_t b, std::byte* buffer) const {
  return plans_[b].views(buffer);
}

}  // namespace shardgather
