// One plan execution, whatever the plan: the header's fields, the checks, the agreement, the job
// bound to this call's addresses, the payload. AllGatherPlan and UnshardPlan are short clients:
// each gives only what is its own (PlanFacts, its argument checks, its region arithmetic in
// `bind`), so that the next plan (a reshard, the reduce-scatter) adds only those.
//
// Threading: on the thread that drives the communicator (run_blocking, or a started job).
// Blocking: agree() waits for every rank's header; the payload for the transfer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "ops/call.h"
#include "ops/exec_scratch.h"
#include "ops/payload.h"
#include "strategies/strategy.h"

#include "shardgather/device.h"
#include "shardgather/plan.h"

namespace shardgather::detail {

// What a plan is, as the execution needs it: fixed when the plan was built.
struct PlanFacts {
  const PlanOptions& options;
  ExchangeShape shape = ExchangeShape::kAllGather;
  int world = 1;
  int rank = 0;
  int root = -1;                          // kGather's receiver
  std::size_t tensors = 0;                // the header's count, and the scratch's per-tensor parts
  std::span<const std::uint64_t> counts;  // every rank's stream bytes
  std::uint64_t fingerprint = 0;          // the plan's, compared in the header
  std::span<const DType> dtypes;
  std::uint64_t dtype_hash = 0;
  // kPersonal: what this rank sends (`counts` is then what it receives from each peer).
  std::uint64_t personal_sent = 0;
};

// The header's plan fields: the hint (its fingerprint), the dtypes and the strategy.
void fill_plan_header(PreflightHeader& header, const PlanFacts& plan, Strategy strategy);

// The job's fields every plan fills alike, around what its `bind` returned.
void finish_job(ExchangeJob& job, const PlanFacts& plan, const Call& call, const ExecScratch& x,
                void* stream);

// The execution up to the payload: the scratch sized and guarded; the strategy (`forced`, else
// plan_strategy, which measures where kAuto may pick a window), in stats.strategy once agreed;
// the header; inside call.check the plan's `check(stats)` (its arguments: it sets x.device and
// stats.staged_bytes), the device checks, the device scratch and the plan's `late_check`
// (checks that need the device checks first); the agreement; then
// `bind(stager)`, which fills the scratch's segments and pieces for this call's addresses and
// returns the job over them. Allocates nothing in a steady state (the scratch keeps its capacity).
// A plan check that does nothing (prepare_execution's `late_check` by default).
struct NoCheck {
  void operator()(ExecStats& /*stats*/) const noexcept {}
};

template <typename Check, typename Bind, typename LateCheck = NoCheck>
ExchangeJob prepare_execution(Call& call, ScratchHolder& scratch, const PlanFacts& plan,
                              std::optional<Strategy> forced, ExecStats& stats, Check&& check,
                              Bind&& bind, LateCheck&& late_check = {}) {
  ExecScratch& x = scratch.get();
  size_scratch(x, plan.world, plan.tensors);
  call.guard(scratch);
  const Strategy strategy = forced ? *forced
                                   : plan_strategy(plan.options.strategy, plan.shape, plan.counts,
                                                   call.comm(), x.strategy, stats.why);
  fill_plan_header(call.header(), plan, strategy);
  void* stream = current_cuda_stream();
  call.check([&] {
    check(stats);
    check_call_device(call, x.device);
    reserve_device_scratch(x, x.device, stats.staged_bytes, stream);
    late_check(stats);  // what needs the device checks first
    call.header().payload_bytes = plan.shape == ExchangeShape::kPersonal
                                      ? plan.personal_sent
                                      : plan.counts[static_cast<std::size_t>(plan.rank)];
  });
  call.agree();
  stats.strategy = strategy;  // only once the call agreed: a failed call reports none
  stats.preflight_collectives = call.exchanges() ? 1 : 0;
  Stager stager = stager_for(x, x.device);
  ExchangeJob job = bind(stager);
  finish_job(job, plan, call, x, stream);
  return job;
}

// The payload of a prepared execution, with the strategy prepare_execution chose.
inline void run_execution(Call& call, ScratchHolder& scratch, const PlanFacts& plan,
                          const ExchangeJob& job, ExecStats& stats) {
  run_payload(call, plan.options.strategy, stats.strategy, job, scratch.get().strategy, stats);
}

}  // namespace shardgather::detail
