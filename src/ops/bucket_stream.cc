// BucketStream: the buckets of any plans, pipelined on the progress thread over a ring of
// prefetch + 1 buffers. A bucket's execution is an ordinary plan execution (its own call, with
// its header); the stream adds one header-only call before the first bucket and one after the
// last (Operation::kUnshardStream), so that a disagreement is caught before anything moves and a
// failure on one rank during the last buckets still reaches the others.
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "copies/device_runtime.h"
#include "copies/local_input.h"
#include "ops/call.h"
#include "ops/payload.h"
#include "ops/preflight.h"
#include "ops/start.h"
#include "transport/graveyard.h"
#include "transport/op_queue.h"

#include "shardgather/embedding.h"
#include "shardgather/unshard_stream.h"

namespace shardgather::detail {

BucketStream::BucketStream(BucketedPlans& plans, const BucketStreamFacts& facts)
    : plans_(plans), facts_(facts) {}

BucketStream::~BucketStream() {
  settle();
  try {
    order_after_consumer();  // the buffers go back on their stream: after the consumer's reads
  } catch (...) {  // NOLINT(bugprone-empty-catch): a failed CUDA call leaves nothing to order
  }
}

void BucketStream::check_and_ready(std::span<const TensorView> inputs, Communicator& comm) {
  check_plan_world(comm, facts_.world, facts_.rank);
  if (inputs.size() != num_inputs()) {
    throw InvalidArgument("the stream has " + std::to_string(num_inputs()) + " parameters, got " +
                          std::to_string(inputs.size()) + " shards");
  }
  plans_.check_inputs(inputs);
  // The buckets live where the inputs do (device memory for CUDA tensors, for the call's
  // stream), made once; a begin() on another device, or on another stream, makes them again.
  const Device device = call_device(inputs);
  void* stream = device.type == DeviceType::kCpu ? nullptr : current_cuda_stream();
  // Reused or given back, the buffers wait for the last round's consumer first.
  order_after_consumer();
  if (!buffers_.empty() && (buffers_.front().device() != device || buffers_stream_ != stream)) {
    buffers_.clear();
    handed_back_.reset();  // an event of the old device
  }
  buffers_stream_ = stream;
  consumer_stream_ = stream;
  if (buffers_.empty() && facts_.buffer_bytes != 0) {
    const auto ring = static_cast<std::size_t>(facts_.prefetch) + 1;
    for (std::size_t k = 0; k < std::min(ring, plans_.num_buckets()); ++k) {
      buffers_.push_back(output_buffer(facts_.buffer_bytes, device));
    }
  }
}

void BucketStream::settle() noexcept {
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
      park(buffer);
    }
    buffers_.clear();
  }
}

void BucketStream::agree_stream(const std::function<void()>& check) {
  run_blocking(*comm_, [&] {
    Call call(*comm_, Operation::kUnshardStream, Stage{}, facts_.timeout, true);
    PreflightHeader& header = call.header();
    header.flags |= kHasHint;
    header.hint_hash = facts_.fingerprint;
    header.num_tensors = num_inputs();
    call.check(check);
    call.agree();
  });
}

void BucketStream::begin(std::span<const TensorView> inputs, Communicator& comm) {
  if (state_ == State::kRunning) {
    throw InvalidArgument(std::string(facts_.name) +
                          "::begin: the stream is running (drain it first)");
  }
  comm_ = &comm;
  if (state_ == State::kFailed) {
    // Through the header: a peer whose stream did not fail is in this call too, and hears it.
    fail_call(
        comm,
        {.op = Operation::kUnshardStream, .header_exchanged = true, .timeout = facts_.timeout},
        ErrorCode::kInvalidArgument,
        std::string(facts_.name) + "::begin: the stream failed earlier; build a new one");
  }
  state_ = State::kFailed;  // until the agreement passed
  started_ = 0;
  yielded_ = 0;
  inputs_.assign(inputs.begin(), inputs.end());
  agree_stream([&] { check_and_ready(inputs, comm); });
  state_ = State::kRunning;
  const std::size_t ring = static_cast<std::size_t>(facts_.prefetch) + 1;
  while (started_ < std::min(ring, plans_.num_buckets())) {
    start_bucket(started_);
  }
}

void BucketStream::start_bucket(std::size_t b) {
  const std::span<const TensorView> inputs(inputs_.data() + plans_.bucket_first(b),
                                           plans_.bucket_first(b + 1) - plans_.bucket_first(b));
  std::span<std::byte> out;
  if (!buffers_.empty()) {
    AlignedBuffer& buffer = buffers_[b % buffers_.size()];
    out = std::span<std::byte>(buffer.data(), buffer.size());
  }
  // Every bucket runs on the stream its buffers were made for, whichever stream next() runs on.
  const CudaStreamGuard on(buffers_stream_);
  inflight_.push_back(start_on<ExecStats>(
      *comm_, [plans = &plans_, b, inputs, out, comm = comm_, shared = shared_]() -> ExecStats {
        if (shared->broken.load()) {
          // An earlier bucket failed, on every rank alike: every rank skips this one. Its
          // error is never the one the caller sees (the earlier bucket's is waited first).
          throw CommAborted("the bucket was skipped: an earlier bucket of the stream failed");
        }
        try {
          return plans->execute_bucket(b, *comm, inputs, out);
        } catch (...) {
          shared->broken.store(true);
          throw;
        }
      }));
  ++started_;
}

void BucketStream::order_after_consumer() {
  if (!consumer_unordered_ || buffers_.empty() ||
      buffers_.front().device().type == DeviceType::kCpu || consumer_stream_ == buffers_stream_) {
    consumer_unordered_ = false;
    return;
  }
  if (handed_back_ == nullptr) {
    handed_back_ = std::make_shared<DeviceEvent>();
  }
  const CurrentDevice on(buffers_.front().device().index);
  auto& event = *std::static_pointer_cast<DeviceEvent>(handed_back_);
  event.record(consumer_stream_);
  event.order_after(buffers_stream_);
  consumer_unordered_ = false;
}

ExecStats BucketStream::wait_oldest() {
  Work<ExecStats>& work = inflight_.front();
  const OpQueue::Awaiting awaiting(comm_->operations());
  while (!work.test(std::chrono::milliseconds(100))) {
    comm_->check_interrupt();  // Aborted: the bucket's gather then ends too
  }
  ExecStats stats = work.wait();
  inflight_.pop_front();
  return stats;
}

std::optional<StreamBucket> BucketStream::next() {
  if (state_ == State::kNew) {
    throw InvalidArgument(std::string(facts_.name) + "::next: begin() was not called");
  }
  if (state_ != State::kRunning) {
    throw InvalidArgument(std::string(facts_.name) + "::next: the stream has ended");
  }
  try {
    // The stream the caller read the last bucket on, and reads the next one on.
    consumer_stream_ = current_cuda_stream();
    if (yielded_ > 0 && started_ < plans_.num_buckets()) {
      order_after_consumer();
      start_bucket(started_);  // into the buffer the caller just gave back
    }
    if (yielded_ == plans_.num_buckets()) {
      order_after_consumer();  // the next begin() reuses the buffers
      agree_stream([] {});
      state_ = State::kEnded;
      return std::nullopt;
    }
    StreamBucket bucket;
    // A later bucket may have failed already; this one completed, so it is whole.
    bucket.stats = wait_oldest();
    const std::size_t b = yielded_++;
    consumer_unordered_ = true;
    bucket.index = b;
    bucket.first_param = plans_.bucket_first(b);
    bucket.num_params = plans_.bucket_first(b + 1) - bucket.first_param;
    if (!buffers_.empty()) {
      AlignedBuffer& buffer = buffers_[b % buffers_.size()];
      bucket.full = plans_.bucket_views(b, buffer.data());
      for (TensorView& view : bucket.full) {
        view.device = buffer.device();
      }
    }
    return bucket;
  } catch (...) {
    broke(std::current_exception());
  }
}

void BucketStream::fail(ErrorCode code, std::string_view message) {
  if (state_ != State::kRunning) {
    throw_error(code, "rank " + std::to_string(facts_.rank) + ": " + std::string(message));
  }
  try {
    while (!inflight_.empty()) {
      (void)wait_oldest();
    }
    // The peers' next call: the bucket after this rank's last started one, or the end.
    const bool bucket_next = started_ < plans_.num_buckets();
    state_ = State::kFailed;
    shared_->broken.store(true);
    fail_call(*comm_,
              {.op = bucket_next ? plans_.bucket_operation(started_) : Operation::kUnshardStream,
               .header_exchanged = true,
               .timeout = facts_.timeout},
              code, message);
  } catch (...) {
    broke(std::current_exception());
  }
}

void BucketStream::broke(const std::exception_ptr& error) {
  state_ = State::kFailed;
  shared_->broken.store(true);
  settle();  // the rest skip, or fail fast on a poisoned communicator
  std::rethrow_exception(error);
}

}  // namespace shardgather::detail
