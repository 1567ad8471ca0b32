// What every plan takes (PlanOptions) and holds (its scratch), apart from the plans themselves
// (plan.h, unshard.h, reshard.h), so that a plan may hold another: a quantized AllGatherPlan or
// UnshardPlan holds the ReshardPlan each of its executions runs.
#pragma once

#include <chrono>
#include <memory>
#include <optional>

#include "shardgather/export.h"
#include "shardgather/stage.h"
#include "shardgather/strategy.h"

namespace shardgather {

struct PlanOptions {
  // Deadline of each execution; unset: the communicator's timeout().
  std::optional<std::chrono::milliseconds> timeout;
  // Exchange the fixed-size pre-flight header on each execution (a check, never metadata).
  bool preflight = true;
  Strategy strategy = Strategy::kAuto;
  // Threads for copy-in and copy-out; 0: this host's cores divided by the ranks on it.
  int copy_threads = 0;
  // >= 0: a gather to one rank: only rank `dst` receives (unshard, UnshardPlan, UnshardStream:
  // the one place every operation reads it from). -1: every rank receives. The all-gathers
  // (AllGatherPlan, and so foreach_all_gather's plan) refuse it: every rank gets every tensor.
  int dst = -1;
  // The step of a compound operation every execution of the plan is (stage.h); empty for a
  // plan of its own. Part of what the ranks must agree on: it travels in each header.
  Stage stage{};
};

namespace detail {
struct ExecScratch;
struct ExchangeJob;
struct Stager;
class Call;
struct PlanAccess;
// Owns an execution's scratch space. Copies get their own, empty scratch: a plan copied to
// another thread never shares mutable state with the original.
class SHARDGATHER_API ScratchHolder {
 public:
  ScratchHolder();
  ~ScratchHolder();
  ScratchHolder(const ScratchHolder& other);
  ScratchHolder& operator=(const ScratchHolder& other);
  ScratchHolder(ScratchHolder&& other) noexcept;
  ScratchHolder& operator=(ScratchHolder&& other) noexcept;
  // Created on first use (also after a move left this holder empty).
  [[nodiscard]] ExecScratch& get();
  [[nodiscard]] const ExecScratch* peek() const noexcept { return scratch_.get(); }
  // After a communication failure: gives the scratch up without freeing it, since a posted
  // collective may still read or write it; the next execution starts with fresh scratch.
  void leak() noexcept;

 private:
  std::unique_ptr<ExecScratch> scratch_;
};
}  // namespace detail

}  // namespace shardgather
