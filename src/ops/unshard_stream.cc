// UnshardStream: buckets of UnshardPlans, pipelined on the progress thread over a ring of
// prefetch + 1 buffers. A bucket's execution is an ordinary plan execution (its own call, with
// its header); the stream adds one header-only call before the first bucket and one after the
// last (Operation::kUnshardStream), so that a disagreement is caught before anything moves and a
// failure on one rank during the last buckets still reaches the others.
#include "shardgather/unshard_stream.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>

#include "vocabulary/checked_math.h"
#include "transport/graveyard.h"
#include "vocabulary/hash.h"
#include "copies/local_input.h"
#include "transport/op_queue.h"
#include "ops/call.h"
#include "ops/payload.h"
#include "ops/plan_access.h"
#include "ops/preflight.h"
#include "ops/start.h"

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

}  // namespace

UnshardStream::UnshardStream(std::span<const ShardSpec> specs, int world_size, int rank,
                             const StreamOptions& options)
    : options_(options), world_(world_size), rank_(rank) {
  if (options.bucket_bytes == 0) {
    throw InvalidArgument("UnshardStream: bucket_bytes must be > 0");
  }
  if (options.prefetch < 0) {
    throw InvalidArgument("UnshardStream: prefetch must be >= 0, got " +
                          std::to_string(options.prefetch));
  }
  options_.plan.preflight = true;  // a failure on one rank travels in the next header
  // A node-shared window is per plan, so one per bucket would hold the whole model; kDirect
  // lands every bucket in place with no memory of its own.
  options_.plan.strategy = detail::one_shot_strategy(options_.plan.strategy);
  firsts_ = cut_buckets(specs, options.bucket_bytes);
  detail::Hasher hasher;
  hasher.add(options.bucket_bytes);
  hasher.add(static_cast<std::uint64_t>(options.prefetch));
  hasher.add(static_cast<std::uint64_t>(static_cast<std::int64_t>(options.dst) + 1));
  hasher.add(static_cast<std::uint64_t>(options.plan.strategy));
  for (std::size_t b = 0; b + 1 < firsts_.size(); ++b) {
    const auto from = static_cast<std::ptrdiff_t>(firsts_[b]);
    const auto to = static_cast<std::ptrdiff_t>(firsts_[b + 1]);
    std::vector<ShardSpec> bucket(specs.begin() + from, specs.begin() + to);
    try {
      plans_.emplace_back(bucket, world_size, rank, options_.plan, options.dst);
    } catch (const InvalidArgument& e) {
      // The plan numbers parameters within its bucket; the caller's index is what helps.
      throw InvalidArgument("UnshardStream: bucket " + std::to_string(b) + " (parameters " +
                            std::to_string(firsts_[b]) + ".." + std::to_string(firsts_[b + 1] - 1) +
                            "): " + e.what());
    }
    hasher.add(firsts_[b]);
    hasher.add(plans_.back().fingerprint());
    if (plans_.back().receives()) {
      buffer_bytes_ = std::max(buffer_bytes_, plans_.back().output_bytes());
    }
  }
  if (std::any_of(plans_.begin(), plans_.end(),
                  [](const UnshardPlan& p) { return p.receives(); })) {
    // Never 0 where buckets arrive: a bucket of empty parameters still has views, which carry
    // its parameters' shapes (and, in the bindings, their names).
    buffer_bytes_ = std::max(buffer_bytes_, kParamAlignment);
  }
  fingerprint_ = hasher.value() == 0 ? 1 : hasher.value();
}

UnshardStream::~UnshardStream() { settle(); }

void UnshardStream::settle() noexcept {
  const bool started = !inflight_.empty();
  for (Work<ExecStats>& work : inflight_) {
    (void)work.test(std::chrono::milliseconds(-1));  // bounded by the bucket's deadline
  }
  inflight_.clear();
  if (started && state_ == State::kRunning) {
    state_ = State::kFailed;  // its buckets were never yielded: it cannot go on
    shared_->broken.store(true);
  }
  if (comm_ != nullptr && comm_->is_poisoned()) {
    // A bucket whose collective failed (a timeout) may still be written by it.
    for (AlignedBuffer& buffer : buffers_) {
      detail::park(buffer);
    }
    buffers_.clear();
  }
}

void UnshardStream::agree_stream(const std::function<void()>& check) {
  detail::run_blocking(*comm_, [&] {
    detail::Call call(*comm_, Operation::kUnshardStream, options_.plan.timeout, true);
    detail::PreflightHeader& header = call.header();
    header.flags |= detail::kHasHint;
    header.hint_hash = fingerprint_;
    header.num_tensors = num_params();
    call.check(check);
    call.agree();
  });
}

void UnshardStream::begin(std::span<const TensorView> shards, Communicator& comm) {
  if (state_ == State::kRunning) {
    throw InvalidArgument("UnshardStream::begin: the stream is running (drain it first)");
  }
  comm_ = &comm;
  if (state_ == State::kFailed) {
    // Through the header: a peer whose stream did not fail is in this call too, and hears it.
    fail_call(comm,
              {.op = Operation::kUnshardStream,
               .header_exchanged = true,
               .timeout = options_.plan.timeout},
              ErrorCode::kInvalidArgument,
              "UnshardStream::begin: the stream failed earlier; build a new one");
  }
  state_ = State::kFailed;  // until the agreement passed
  started_ = 0;
  yielded_ = 0;
  shards_.assign(shards.begin(), shards.end());
  agree_stream([&] {
    detail::check_plan_world(comm, world_, rank_);
    if (shards.size() != num_params()) {
      throw InvalidArgument("the stream has " + std::to_string(num_params()) + " parameters, got " +
                            std::to_string(shards.size()) + " shards");
    }
    for (std::size_t b = 0; b < plans_.size(); ++b) {
      for (std::size_t j = 0; j < plans_[b].size(); ++j) {
        const TensorView& t = shards[firsts_[b] + j];
        const Shape want = plans_[b].shard_shape(rank_, j);
        if (t.dtype != plans_[b].spec(j).dtype || t.shape != want) {
          throw InvalidArgument(
              "tensor " + std::to_string(firsts_[b] + j) + ": rank " + std::to_string(rank_) +
              " should pass a " + std::string(dtype_name(plans_[b].spec(j).dtype)) + " shard of " +
              detail::shape_str(want) + ", got " + std::string(dtype_name(t.dtype)) + " " +
              detail::shape_str(t.shape));
        }
      }
    }
    // The buckets live where the shards do (device memory for CUDA shards), made once; a
    // begin() on another device makes them again.
    const Device device = detail::call_device(shards);
    if (!buffers_.empty() && buffers_.front().device() != device) {
      buffers_.clear();
    }
    if (buffers_.empty() && buffer_bytes_ != 0) {
      const auto ring = static_cast<std::size_t>(options_.prefetch) + 1;
      for (std::size_t k = 0; k < std::min(ring, plans_.size()); ++k) {
        buffers_.push_back(detail::output_buffer(buffer_bytes_, device));
      }
    }
  });
  state_ = State::kRunning;
  const std::size_t ring = static_cast<std::size_t>(options_.prefetch) + 1;
  while (started_ < std::min(ring, plans_.size())) {
    start_bucket(started_);
  }
}

void UnshardStream::start_bucket(std::size_t b) {
  UnshardPlan* plan = &plans_[b];
  const std::span<const TensorView> shards(shards_.data() + firsts_[b], plan->size());
  std::span<std::byte> out;
  if (!buffers_.empty()) {
    AlignedBuffer& buffer = buffers_[b % buffers_.size()];
    out = std::span<std::byte>(buffer.data(), buffer.size());
  }
  inflight_.push_back(detail::start_on<ExecStats>(
      *comm_, [plan, shards, out, comm = comm_, shared = shared_]() -> ExecStats {
        if (shared->broken.load()) {
          // An earlier bucket failed, on every rank alike: every rank skips this one. Its
          // error is never the one the caller sees (the earlier bucket's is waited first).
          throw CommAborted("the bucket was skipped: an earlier bucket of the stream failed");
        }
        try {
          return detail::PlanAccess::execute(*plan, *comm, shards, out);
        } catch (...) {
          shared->broken.store(true);
          throw;
        }
      }));
  ++started_;
}

ExecStats UnshardStream::wait_oldest() {
  Work<ExecStats>& work = inflight_.front();
  const detail::OpQueue::Awaiting awaiting(comm_->operations());
  while (!work.test(std::chrono::milliseconds(100))) {
    comm_->check_interrupt();  // Aborted: the bucket's gather then ends too
  }
  ExecStats stats = work.wait();
  inflight_.pop_front();
  return stats;
}

std::optional<StreamBucket> UnshardStream::next() {
  if (state_ == State::kNew) {
    throw InvalidArgument("UnshardStream::next: begin() was not called");
  }
  if (state_ != State::kRunning) {
    throw InvalidArgument("UnshardStream::next: the stream has ended");
  }
  try {
    if (yielded_ > 0 && started_ < plans_.size()) {
      start_bucket(started_);  // into the buffer the caller just gave back
    }
    if (yielded_ == plans_.size()) {
      agree_stream([] {});
      state_ = State::kEnded;
      return std::nullopt;
    }
    StreamBucket bucket;
    // A later bucket may have failed already; this one completed, so it is whole.
    bucket.stats = wait_oldest();
    const std::size_t b = yielded_++;
    bucket.index = b;
    bucket.first_param = firsts_[b];
    bucket.num_params = plans_[b].size();
    if (!buffers_.empty()) {
      const AlignedBuffer& buffer = buffers_[b % buffers_.size()];
      bucket.full = plans_[b].views(buffer.data());
      for (TensorView& view : bucket.full) {
        view.device = buffer.device();
      }
    }
    return bucket;
  } catch (...) {
    broke(std::current_exception());
  }
}

void UnshardStream::fail(ErrorCode code, std::string_view message) {
  if (state_ != State::kRunning) {
    throw_error(code, "rank " + std::to_string(rank_) + ": " + std::string(message));
  }
  try {
    while (!inflight_.empty()) {
      (void)wait_oldest();
    }
    // The peers' next call: the bucket after this rank's last started one, or the end.
    const bool bucket_next = started_ < plans_.size();
    state_ = State::kFailed;
    shared_->broken.store(true);
    fail_call(*comm_,
              {.op = bucket_next ? Operation::kUnshardExecute : Operation::kUnshardStream,
               .header_exchanged = true,
               .timeout = options_.plan.timeout},
              code, message);
  } catch (...) {
    broke(std::current_exception());
  }
}

void UnshardStream::broke(const std::exception_ptr& error) {
  state_ = State::kFailed;
  shared_->broken.store(true);
  settle();  // the rest skip, or fail fast on a poisoned communicator
  std::rethrow_exception(error);
}

}  // namespace shardgather
