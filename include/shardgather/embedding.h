// For embedders (language bindings) that check arguments of their own before they call an
// operation: how to fail that call on every rank, as the core's own local checks do.
//
//   if (!is_tensor(params[3]))  // found by the binding, before any core call
//     fail_call(comm, {.op = Operation::kForeachAllGather, .header_exchanged = true, .timeout =
//     {}},
//               ErrorCode::kInvalidType, "params[3] is a str, not a torch.Tensor");
//
// The peers, which are making that call, raise the same class with the same message naming this
// rank; this rank raises it too. No payload moves, and the communicator stays usable.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "shardgather/communicator.h"
#include "shardgather/errors.h"
#include "shardgather/export.h"
#include "shardgather/stage.h"

namespace shardgather {

// The operations, as the pre-flight header names them (wire codes: never renumber). Ranks that
// call different operations raise Mismatch.
enum class Operation : std::uint8_t {
  kForeachAllGather = 1,
  kPlanCreate = 2,      // AllGatherPlan::create
  kPlanExecute = 3,     // AllGatherPlan::execute and execute_shared
  kUnshard = 4,         // the one-shot unshard()
  kUnshardExecute = 5,  // UnshardPlan::execute (also each bucket of an UnshardStream)
  kUnshardStream = 6,   // UnshardStream's agreements: before its first bucket, after its last
  kReshardExecute = 7,  // ReshardPlan::execute
  kWeightSync = 8,      // a weight sync's call of rounds (round_call.h)
  // Not an operation: one past the last. A new operation goes above it, so the header check
  // (which refuses codes outside [kForeachAllGather, kEnd)) knows it without being told.
  kEnd,
};

SHARDGATHER_API std::string_view operation_name(Operation op) noexcept;

// What the peers are doing in the call this rank fails.
struct CallShape {
  Operation op = Operation::kForeachAllGather;
  // Whether that call exchanges the pre-flight header: always without a shapes hint; with one (and
  // for plan executions) when the pre-flight is on. Where it does not, the peers cannot be told,
  // and only this rank raises.
  bool header_exchanged = true;
  // The call's timeout (unset: the communicator's).
  std::optional<std::chrono::milliseconds> timeout;
  // The step of a compound operation that call is (stage.h): the peers' call carries it too.
  Stage stage{};
};

// Raises `code`'s class with `message` on every rank of the call (collective when the header is
// exchanged: the peers wait for this rank's header). Blocks like the call's pre-flight.
[[noreturn]] SHARDGATHER_API void fail_call(Communicator& comm, const CallShape& call,
                                            ErrorCode code, std::string_view message);

// Runs `fn` as a blocking operation of `comm`: after every operation started before it on the
// communicator, and with this thread its only driver while it runs (an embedder's own
// collective, a barrier, keeps its place in the communicator's order this way).
SHARDGATHER_API void run_in_order(Communicator& comm, const std::function<void()>& fn);

// While one lives, `comm`'s transport is told that a thread is waiting for its started
// operations (Work::wait, a binding's polling loop), so it may stop slicing its waits.
class SHARDGATHER_API AwaitingStarted {
 public:
  explicit AwaitingStarted(Communicator& comm) noexcept;
  AwaitingStarted(const AwaitingStarted&) = delete;
  AwaitingStarted& operator=(const AwaitingStarted&) = delete;
  AwaitingStarted(AwaitingStarted&&) = delete;
  AwaitingStarted& operator=(AwaitingStarted&&) = delete;
  ~AwaitingStarted();

 private:
  Communicator& comm_;
};

}  // namespace shardgather
