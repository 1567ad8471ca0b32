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
#pragma once

#include <atomic>
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
#include "shardgather/errors.h"
#include "shardgather/export.h"
#include "shardgather/unshard.h"
#include "shardgather/work.h"

namespace shardgather {

struct StreamOptions {
  // Full bytes of the parameters of one bucket (each parameter aligned to 64 bytes).
  std::uint64_t bucket_bytes = std::uint64_t{1} << 30;
  // Buckets gathering while the caller holds one (>= 0; 0: one bucket at a time, nothing
  // overlapped).
  int prefetch = 1;
  // >= 0: only this rank receives the full parameters (UnshardPlan's dst); -1: every rank.
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

class SHARDGATHER_API UnshardStream {
 public:
  // Pure: cuts the buckets and builds their plans (InvalidArgument as UnshardPlan, or for a
  // bucket_bytes of 0 or a negative prefetch).
  UnshardStream(std::span<const ShardSpec> specs, int world_size, int rank,
                const StreamOptions& options = {});
  UnshardStream(const UnshardStream&) = delete;
  UnshardStream& operator=(const UnshardStream&) = delete;
  UnshardStream(UnshardStream&&) = delete;
  UnshardStream& operator=(UnshardStream&&) = delete;
  // Waits for the buckets still gathering (each bounded by its deadline); see settle().
  ~UnshardStream();

  [[nodiscard]] std::size_t num_buckets() const noexcept { return plans_.size(); }
  [[nodiscard]] std::size_t num_params() const noexcept { return firsts_.back(); }
  [[nodiscard]] const UnshardPlan& bucket_plan(std::size_t b) const { return plans_.at(b); }
  [[nodiscard]] std::size_t bucket_first(std::size_t b) const { return firsts_.at(b); }
  // Bytes of each of the prefetch + 1 buffers (the largest bucket, at least 64 so that a bucket
  // of empty parameters has views too); 0 where nothing arrives.
  [[nodiscard]] std::uint64_t buffer_bytes() const noexcept { return buffer_bytes_; }
  [[nodiscard]] const StreamOptions& options() const noexcept { return options_; }

  // Collective: one header exchange that checks the stream agrees on every rank, then starts the
  // first prefetch + 1 buckets. `shards` (one per spec) are kept by reference. A stream that
  // ended may begin again (every step of a weight sync): it reuses its buffers, so only its
  // first run allocates them. A stream that failed raises InvalidArgument from begin() on every
  // rank of the call (through its header, so a peer whose stream did not fail is told too).
  void begin(std::span<const TensorView> shards, Communicator& comm);
  // The next bucket, once its gather completed (the interrupt check runs while it waits), or
  // nullopt after the last one. Starts the bucket that reuses the previous one's buffer first.
  std::optional<StreamBucket> next();
  // This rank cannot go on (its consumer failed): waits for its started buckets, then fails
  // the call its peers make next, so every rank raises `code`'s class with `message`, naming
  // this rank. Raises that error (or the stream's own, if it broke first).
  [[noreturn]] void fail(ErrorCode code, std::string_view message);

  // Whether the stream is between begin() and its end (next() returned nullopt or raised).
  [[nodiscard]] bool running() const noexcept { return state_ == State::kRunning; }
  // Waits for the buckets started so far (each bounded by its deadline), without yielding
  // them, and parks the buffers if the communicator broke: for an owner about to let go of the
  // shards (the destructor does the same). The stream cannot go on afterwards.
  void settle() noexcept;

 private:
  struct Shared {
    // Set by the first bucket that raises: the later ones skip, alike on every rank.
    std::atomic<bool> broken{false};
  };
  void start_bucket(std::size_t b);
  // Waits for the oldest started bucket, running the interrupt check.
  ExecStats wait_oldest();
  // Ends the stream after a failure: waits for the rest, parks the buffers a failed collective
  // may still write, and raises `error`.
  [[noreturn]] void broke(const std::exception_ptr& error);
  // The stream's header exchange (begin() and the end), after this rank's local `check`.
  void agree_stream(const std::function<void()>& check);

  std::vector<UnshardPlan> plans_;
  std::vector<std::size_t> firsts_;  // num_buckets() + 1
  StreamOptions options_;
  int world_ = 1;
  int rank_ = 0;
  std::uint64_t fingerprint_ = 0;
  std::uint64_t buffer_bytes_ = 0;
  std::vector<AlignedBuffer> buffers_;
  std::vector<TensorView> shards_;
  Communicator* comm_ = nullptr;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  std::deque<Work<ExecStats>> inflight_;  // buckets started_ - size() .. started_ - 1
  std::size_t started_ = 0;
  std::size_t yielded_ = 0;
  enum class State : std::uint8_t { kNew, kRunning, kEnded, kFailed } state_ = State::kNew;
};

}  // namespace shardgather
