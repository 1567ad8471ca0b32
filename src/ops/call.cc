#include "ops/call.h"

#include <cstring>
#include <string>

#include "ops/exec_scratch.h"
#include "ops/start.h"
#include "transport/graveyard.h"
#include "transport/op_queue.h"

#include "shardgather/plan.h"

namespace shardgather {

std::string_view operation_name(Operation op) noexcept {
  switch (op) {
    case Operation::kForeachAllGather:
      return "foreach_all_gather";
    case Operation::kPlanCreate:
      return "AllGatherPlan::create";
    case Operation::kPlanExecute:
      return "AllGatherPlan::execute";
    case Operation::kUnshard:
      return "unshard";
    case Operation::kUnshardExecute:
      return "UnshardPlan::execute";
    case Operation::kUnshardStream:
      return "UnshardStream";
    case Operation::kReshardExecute:
      return "ReshardPlan::execute";
    case Operation::kWeightSync:
      return "WeightSync::sync";
    case Operation::kEnd:
      break;
  }
  return "unknown operation";
}

void fail_call(Communicator& comm, const CallShape& call, ErrorCode code,
               std::string_view message) {
  detail::run_blocking(comm, [&] {
    detail::Call c(comm, call.op, call.stage, call.timeout, call.header_exchanged);
    c.fail(code == ErrorCode::kOk ? ErrorCode::kInvalidArgument : code, message);
    c.agree();
  });
  throw Error(ErrorCode::kCommunicationError, "unreachable: a failed call always raises");
}

namespace detail {

std::uint64_t next_op_seq(Communicator& comm) noexcept { return comm.operations().next_seq(); }

Call::Call(Communicator& comm, Operation op, const Stage& stage,
           std::optional<std::chrono::milliseconds> timeout, bool exchange, HeaderBuffers* buffers)
    : comm_(comm),
      op_(op),
      deadline_(comm.deadline_after(comm.timeout())),
      exchange_(exchange && comm.size() > 1),
      buffers_(buffers != nullptr ? buffers : &own_) {
  header_.op = static_cast<std::uint8_t>(op);
  set_stage(header_, stage);
  header_.world_size = static_cast<std::uint32_t>(comm.size());
  header_.seq = next_op_seq(comm);
  set_exchange_form(header_, comm.capabilities().exchange_form);
  if (timeout && timeout->count() < 0) {
    // Told to the peers like any local check: they would otherwise wait out their deadline.
    fail(ErrorCode::kInvalidArgument,
         "timeout must be >= 0, got " + std::to_string(timeout->count()) + " ms");
  } else if (timeout) {
    deadline_ = comm.deadline_after(*timeout);
  }
}

void Call::fail(ErrorCode code, std::string_view message) {
  if (failed()) {
    return;  // the first failure is the one every rank raises
  }
  set_status(header_, code, message);
  if (!exchange_) {
    raise_local();
  }
}

void Call::raise_local() const {
  throw_error(static_cast<ErrorCode>(header_.status),
              "rank " + std::to_string(comm_.rank()) + ": " + header_.status_text);
}

std::span<const PreflightHeader> Call::agree() {
  if (!exchange_) {
    if (failed()) {
      raise_local();
    }
    return {};
  }
  const auto world = static_cast<std::size_t>(comm_.size());
  HeaderBuffers& b = *buffers_;
  b.mine.resize(sizeof(PreflightHeader));  // no-ops once sized
  std::memcpy(b.mine.data(), &header_, sizeof header_);
  b.gathered.resize(world * sizeof(PreflightHeader));
  b.decoded.resize(world);
  try {
    comm_.all_gather(b.mine, b.gathered, deadline_);
  } catch (const CommunicationError&) {
    if (buffers_ == &own_) {
      park(own_);  // the vectors' memory moves with them, so what MPI may touch stays valid
    }
    park_guarded();  // a plan's header buffers live in its scratch
    throw;
  }
  check_headers(b.gathered, b.decoded, comm_.rank());
  return b.decoded;
}

void Call::park_guarded() noexcept {
  aligned_.each([](AlignedBuffer& b) { park(b); });
  vectors_.each([](std::vector<std::byte>& v) { park(v); });
  if (scratch_ != nullptr) {
    scratch_->leak();
  }
  if (strategy_ != nullptr) {
    park(*strategy_);  // moves its buffers and window out; the emptied scratch is freed as usual
  }
  aligned_.clear();
  vectors_.clear();
  scratch_ = nullptr;
  strategy_ = nullptr;
}

}  // namespace detail
}  // namespace shardgather
