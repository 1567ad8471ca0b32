// unshard_stream: a whole model's full parameters, bucket by bucket, in bounded memory.
//
//   UnshardStream stream(specs, comm.size(), comm.rank(), {.bucket_bytes = 1 << 30});
//   stream.begin(shards, comm);              // collective: agrees, then starts the first buckets
//   while (auto bucket = stream.next()) {    // blocks until bucket k's gather completed
//     write(bucket->full);                   // bucket k + 1 .. k + prefetch gather meanwhile
//   }                                        // after the last: one more agreement, then nullopt
//
// Parameters are cut, in order, into buckets of at most `bucket_bytes` of full tensors (a
// parameter larger than that is a bucket of its own). Each bucket is an UnshardPlan executed on
// the communicator's progress thread into one of prefetch + 1 buffers, allocated on the first
// round and reused: a stream's extra memory is (prefetch + 1) x the largest bucket on a rank
// that receives, and no buffer at all on the others (dst set).
//
// Errors: begin() raises, on every rank alike and before any payload moves, when the ranks'
// specs, bucket cut, prefetch or dst differ, or a shard does not match its spec. A failure in
// the middle (a bucket's gather, or fail() on a rank whose consumer raised) ends the stream on
// every rank with the same error: the bucket that fails fails on every rank, and every rank
// then skips the buckets it had started, so the ranks stay matched. Buffers a failed collective
// may still write are parked, never freed.
//
// Strategy: kAuto means kDirect here (a node-shared window is per plan: one per bucket would
// hold the whole model), landing each bucket in place.
//
// Threading: one thread drives a stream; the shards stay alive and unmodified until the stream
// ended (next() returned nullopt or raised, or the stream was destroyed). Every bucket is
// exchanged with the pre-flight header, whatever options.plan says: that is how a failure on
// one rank reaches the others.
//
// CUDA shards (docs/gpu.md, "Streams"): the buffers are device memory made for the stream
// current at begin(), and every bucket runs on that stream. next() returns once the bucket's work
// is enqueued and makes the caller's current stream wait for it; when the caller consumes on
// another stream, the buffers' stream waits for that stream before a buffer handed back is
// written again, and before the buffers are reused by the next begin() or given back.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "shardgather/buffer.h"
#include "shardgather/communicator.h"
#include "shardgather/embedding.h"
#include "shardgather/errors.h"
#include "shardgather/export.h"
#include "shardgather/quantize.h"
#include "shardgather/types.h"
#include "shardgather/unshard.h"
#include "shardgather/work.h"

namespace shardgather {

struct StreamOptions {
  // Full bytes of the parameters of one bucket (each parameter aligned to 64 bytes; a quantized
  // one counts its FP8 data and its scales, each aligned).
  std::uint64_t bucket_bytes = std::uint64_t{1} << 30;
  // Buckets gathering while the caller holds one (>= 0; 0: one bucket at a time, nothing
  // overlapped).
  int prefetch = 1;
  // >= 0: only this rank receives the full parameters; -1: every rank. The same setting as
  // plan.dst (PlanOptions::dst), given here for existing callers: either may be set, and
  // InvalidArgument when both are and differ.
  int dst = -1;
  PlanOptions plan{};
};

struct StreamBucket {
  std::size_t index = 0;        // 0 .. num_buckets() - 1
  std::size_t first_param = 0;  // its parameters: [first_param, first_param + num_params)
  std::size_t num_params = 0;
  // The full parameters, valid until the next call to next() (or the stream's end); empty on a
  // rank that does not receive.
  std::vector<TensorView> full;
  ExecStats stats;
};

namespace detail {

class Hasher;
struct LentScratch;

// What a bucketed stream needs of its plans, one per bucket. UnshardStream's are UnshardPlans; a
// stream over another plan (a reshard's buckets) implements this and reuses BucketStream whole.
class SHARDGATHER_API BucketedPlans {
 public:
  BucketedPlans() = default;
  BucketedPlans(const BucketedPlans&) = delete;
  BucketedPlans& operator=(const BucketedPlans&) = delete;
  BucketedPlans(BucketedPlans&&) = delete;
  BucketedPlans& operator=(BucketedPlans&&) = delete;
  virtual ~BucketedPlans() = default;

  [[nodiscard]] virtual std::size_t num_buckets() const noexcept = 0;
  // Bucket b's inputs are the stream's [bucket_first(b), bucket_first(b + 1)); b may be
  // num_buckets() (the end).
  [[nodiscard]] virtual std::size_t bucket_first(std::size_t b) const = 0;
  // begin()'s local check of this rank's inputs against the plans (InvalidArgument naming the
  // input); the count and the communicator were checked before.
  virtual void check_inputs(std::span<const TensorView> inputs) const = 0;
  // Bucket b into `out` (empty where nothing arrives), on a thread that drives the communicator
  // (the progress thread): one plan execution, with its own header.
  virtual ExecStats execute_bucket(std::size_t b, Communicator& comm,
                                   std::span<const TensorView> inputs,
                                   std::span<std::byte> out) = 0;
  // Bucket b's outputs over `buffer` (the bucket's views; their device is set by the stream).
  [[nodiscard]] virtual std::vector<TensorView> bucket_views(std::size_t b,
                                                             std::byte* buffer) const = 0;
  // The operation bucket b's call names (fail() fails that call on its peers).
  [[nodiscard]] virtual Operation bucket_operation(std::size_t b) const noexcept = 0;
};

// What a BucketStream is, fixed when its plans were built.
struct BucketStreamFacts {
  const char* name = "UnshardStream";  // the user's class, as its messages name it (static)
  int world = 1;
  int rank = 0;
  int prefetch = 1;
  std::optional<std::chrono::milliseconds> timeout;
  std::uint64_t fingerprint = 1;   // of everything the ranks must agree on (never 0)
  std::uint64_t buffer_bytes = 0;  // each ring buffer's; 0 where nothing arrives
};

// The bucketed stream over any plans: the ring of prefetch + 1 buffers, the buckets started on
// the progress thread, the agreements before the first bucket and after the last
// (Operation::kUnshardStream), and the failure rules of UnshardStream's header comment.
// `plans` must outlive it. Threading: one thread drives it.
class SHARDGATHER_API BucketStream {
 public:
  BucketStream(BucketedPlans& plans, const BucketStreamFacts& facts);
  BucketStream(const BucketStream&) = delete;
  BucketStream& operator=(const BucketStream&) = delete;
  BucketStream(BucketStream&&) = delete;
  BucketStream& operator=(BucketStream&&) = delete;
  ~BucketStream();

  [[nodiscard]] const BucketStreamFacts& facts() const noexcept { return facts_; }
  void begin(std::span<const TensorView> inputs, Communicator& comm);
  std::optional<StreamBucket> next();
  [[noreturn]] void fail(ErrorCode code, std::string_view message);
  [[nodiscard]] bool running() const noexcept { return state_ == State::kRunning; }
  void settle() noexcept;

 private:
  struct Shared {
    // Set by the first bucket that raises: the later ones skip, alike on every rank.
    std::atomic<bool> broken{false};
  };
  [[nodiscard]] std::size_t num_inputs() const { return plans_.bucket_first(plans_.num_buckets()); }
  void start_bucket(std::size_t b);
  // Waits for the oldest started bucket, running the interrupt check.
  ExecStats wait_oldest();
  // Ends the stream after a failure: waits for the rest, parks the buffers a failed collective
  // may still write, and raises `error`.
  [[noreturn]] void broke(const std::exception_ptr& error);
  // The stream's header exchange (begin() and the end), after this rank's local `check`.
  void agree_stream(const std::function<void()>& check);
  // begin()'s local step: the inputs against the plans, and the ring made on their device.
  void check_and_ready(std::span<const TensorView> inputs, Communicator& comm);
  // Device buckets: orders buffers_stream_ after what consumer_stream_ did with the buckets
  // handed out so far (nothing to do when that is buffers_stream_, or none was).
  void order_after_consumer();

  BucketedPlans& plans_;
  BucketStreamFacts facts_;
  std::vector<AlignedBuffer> buffers_;
  void* buffers_stream_ = nullptr;   // the stream device buckets were allocated for, and run on
  void* consumer_stream_ = nullptr;  // the stream current at the latest next()
  bool consumer_unordered_ = false;  // a bucket was handed out since the last order_after_consumer
  // A copies/ DeviceEvent (type-erased: a private type): where a consumer on another stream than
  // buffers_stream_ handed a bucket's buffer back, for buffers_stream_ to wait for before the
  // buffer is written again or given back.
  std::shared_ptr<void> handed_back_;
  std::vector<TensorView> inputs_;
  Communicator* comm_ = nullptr;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  std::deque<Work<ExecStats>> inflight_;  // buckets started_ - size() .. started_ - 1
  std::size_t started_ = 0;
  std::size_t yielded_ = 0;
  enum class State : std::uint8_t { kNew, kRunning, kEnded, kFailed } state_ = State::kNew;
};

}  // namespace detail

// The buckets of a whole model's unshard: a BucketStream over UnshardPlans.
//
// Quantized (`quantize`: one format per spec, kNone for a parameter that travels as it is): each
// bucket is a quantized UnshardPlan (docs/quantization.md), one call per bucket that quantizes
// the shards' current values on send, bit-identical to quantizing the full tensors, on the host
// or a CUDA device alike. A quantized parameter arrives as two views, its FP8 data (uint8 of the
// full shape: e4m3fn bytes) then its scales (float32, or uint8 E8M0 for mxfp8, of the format's
// scale shape), and counts towards bucket_bytes with both; a bucket's `full` then holds more
// views than it has parameters. Formats that differ across ranks raise Mismatch from begin().
// Memory: besides the ring, the buckets' plans take turns with one set of the large buffers of an
// execution (they run one at a time), as large as the largest bucket needs: a quantized stream's
// FP8 data and scales of this rank's shards, and on CUDA shards the exchange's send and gather
// buffers, in device memory (on the ring's stream).
class SHARDGATHER_API UnshardStream final : private detail::BucketedPlans {
 public:
  // Pure: cuts the buckets and builds their plans (InvalidArgument as UnshardPlan, or for a
  // bucket_bytes of 0, a negative prefetch, formats that are neither none nor one per spec, a
  // format that cannot quantize its parameter, or a quantized stream's strategy other than kAuto
  // or kDirect).
  UnshardStream(std::span<const ShardSpec> specs, int world_size, int rank,
                const StreamOptions& options = {}, std::span<const QuantFormat> quantize = {});
  UnshardStream(const UnshardStream&) = delete;
  UnshardStream& operator=(const UnshardStream&) = delete;
  UnshardStream(UnshardStream&&) = delete;
  UnshardStream& operator=(UnshardStream&&) = delete;
  // Waits for the buckets still gathering (each bounded by its deadline); see settle().
  ~UnshardStream() override;

  [[nodiscard]] std::size_t num_buckets() const noexcept override { return plans_.size(); }
  [[nodiscard]] std::size_t num_params() const noexcept { return firsts_.back(); }
  [[nodiscard]] const UnshardPlan& bucket_plan(std::size_t b) const { return plans_.at(b); }
  [[nodiscard]] std::size_t bucket_first(std::size_t b) const override { return firsts_.at(b); }
  // Bytes of each of the prefetch + 1 buffers (the largest bucket, at least 64 so that a bucket
  // of empty parameters has views too); 0 where nothing arrives.
  [[nodiscard]] std::uint64_t buffer_bytes() const noexcept {
    return stream_->facts().buffer_bytes;
  }
  [[nodiscard]] const StreamOptions& options() const noexcept { return options_; }

  // Collective: one header exchange that checks the stream agrees on every rank, then starts the
  // first prefetch + 1 buckets. `shards` (one per spec) are kept by reference. A stream that
  // ended may begin again (every step of a weight sync): it reuses its buffers, so only its
  // first run allocates them. A stream that failed raises InvalidArgument from begin() on every
  // rank of the call (through its header, so a peer whose stream did not fail is told too).
  void begin(std::span<const TensorView> shards, Communicator& comm) {
    stream_->begin(shards, comm);
  }
  // The next bucket, once its gather completed (the interrupt check runs while it waits), or
  // nullopt after the last one. Starts the bucket that reuses the previous one's buffer first.
  std::optional<StreamBucket> next() { return stream_->next(); }
  // This rank cannot go on (its consumer failed): waits for its started buckets, then fails
  // the call its peers make next, so every rank raises `code`'s class with `message`, naming
  // this rank. Raises that error (or the stream's own, if it broke first).
  [[noreturn]] void fail(ErrorCode code, std::string_view message) { stream_->fail(code, message); }

  // Whether the stream is between begin() and its end (next() returned nullopt or raised).
  [[nodiscard]] bool running() const noexcept { return stream_->running(); }
  // Waits for the buckets started so far (each bounded by its deadline), without yielding
  // them, and parks the buffers if the communicator broke: for an owner about to let go of the
  // shards (the destructor does the same). The stream cannot go on afterwards.
  void settle() noexcept { stream_->settle(); }

 private:
  // BucketedPlans: the stream's view of the bucket plans.
  void check_inputs(std::span<const TensorView> inputs) const override;
  ExecStats execute_bucket(std::size_t b, Communicator& comm, std::span<const TensorView> inputs,
                           std::span<std::byte> out) override;
  [[nodiscard]] std::vector<TensorView> bucket_views(std::size_t b,
                                                     std::byte* buffer) const override;
  [[nodiscard]] Operation bucket_operation(std::size_t b) const noexcept override {
    return plans_[b].quantized() ? Operation::kReshardExecute : Operation::kUnshardExecute;
  }

  // One plan per bucket, each folded into `hasher`; returns the ring buffers' size.
  std::uint64_t build_plans(std::span<const ShardSpec> specs, int world_size,
                            detail::Hasher& hasher);
  // A quantized bucket's views over its buffer (data and scales of each quantized parameter);
  // returns the bytes they take.
  std::uint64_t lay_out_quantized(std::size_t b, std::span<const ShardSpec> specs);

  // Where a quantized bucket's views lie in its buffer.
  struct Slot {
    std::uint64_t offset = 0;
    DType dtype = DType::kUInt8;
    Shape shape;
    bool scales = false;  // the scales of the parameter before it
  };

  StreamOptions options_;
  int rank_ = 0;
  std::vector<QuantFormat> formats_;  // one per spec, or empty
  std::vector<std::size_t> firsts_;   // num_buckets() + 1
  std::vector<UnshardPlan> plans_;
  std::vector<std::vector<Slot>> slots_;  // per bucket; empty for a plain one
  // The large scratch the buckets' plans take turns with; outlives stream_, whose progress thread
  // may be lending it out until stream_ is settled.
  std::unique_ptr<detail::LentScratch> lent_;
  std::unique_ptr<detail::BucketStream> stream_;  // last: destroyed (settled) first
};

}  // namespace shardgather
