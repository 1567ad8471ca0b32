// The plans' parts of a call, for the one-shot operations built on them (a foreach with a hint
// is a plan executed once; unshard() an UnshardPlan executed once) so that one call, with one
// header, covers both the one-shot's own checks and the plan's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "ops/call.h"

#include "shardgather/plan.h"
#include "shardgather/unshard.h"

namespace shardgather::detail {

struct LentScratch;

struct PlanAccess {
  // The plan's checks, agreement and payload inside `call` (which may already hold a failure).
  static ExecStats run(AllGatherPlan& plan, Call& call, std::span<const TensorView> params,
                       std::byte* out, std::uint64_t out_size);
  static ExecStats run(UnshardPlan& plan, Call& call, std::span<const TensorView> shards,
                       std::byte* out, std::uint64_t out_size);
  // UnshardPlan::execute into one buffer, on a thread that already drives the communicator
  // (a stream's bucket), with the large buffers `lent` lends it (exec_scratch.h).
  static ExecStats execute(UnshardPlan& plan, Communicator& comm,
                           std::span<const TensorView> shards, std::span<std::byte> out,
                           LentScratch& lent);
  // A quantized UnshardPlan's execution (outputs and scales as its execute takes them), the
  // same way. The shards were checked against the plan (a stream's begin()).
  static ExecStats execute(UnshardPlan& plan, Communicator& comm,
                           std::span<const TensorView> shards, std::span<const TensorView> outputs,
                           std::span<const TensorView> scales, LentScratch& lent);
};

}  // namespace shardgather::detail
