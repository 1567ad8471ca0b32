// Plans: build once from every rank's shapes and dtypes, execute every step.
//
//   auto plan = AllGatherPlan::create(params, comm, shapes_hint);  // once (collective without
//   hint) std::vector<std::byte> out(plan.output_bytes());                // or any caller memory
//   for (step...) plan.execute(params, comm, out);                  // no allocation, no metadata
//   plan.views(out.data())[i * world + r]                            // rank r's tensor i
//
// An execution validates this rank's tensors against the plan (shape, dtype, data), optionally
// exchanges the fixed-size pre-flight header (sequence number, count, dtypes, plan fingerprint,
// local status: a check, not metadata), and moves the payload in one collective. Steady state:
// zero heap allocations and zero metadata collectives per execution (tests count both).
//
// A plan is a value: copyable, movable, usable with any communicator of the same world size and
// rank. It is not thread-safe: one thread executes a plan at a time (it holds scratch space), and
// executions started asynchronously (start()) must all be on one communicator, whose progress
// thread runs them one after another.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "shardgather/communicator.h"
#include "shardgather/export.h"
#include "shardgather/layout.h"
#include "shardgather/stage.h"
#include "shardgather/stats.h"
#include "shardgather/strategy.h"
#include "shardgather/types.h"
#include "shardgather/work.h"

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

class SHARDGATHER_API AllGatherPlan {
 public:
  AllGatherPlan() = default;
  // Pure: from the dtypes (one per tensor index) and every rank's shapes ([r][i]).
  AllGatherPlan(std::span<const DType> dtypes,
                std::span<const std::vector<Shape>> shapes_across_group, int rank,
                const PlanOptions& options = {});

  // From this rank's tensors: with a hint, no communication (this rank's row is checked);
  // without, one pre-flight header and one exchange of the shape records (both collective:
  // every rank calls create). Errors are raised on every rank, as for foreach_all_gather.
  static AllGatherPlan create(std::span<const TensorView> params, Communicator& comm,
                              std::span<const std::vector<Shape>> shapes_across_group = {},
                              const PlanOptions& options = {});
  // create under the name every plan's communicator constructor has (ReshardPlan's and
  // UnshardPlan's for_communicator); create stays, the seed's name.
  static AllGatherPlan for_communicator(
      std::span<const TensorView> params, Communicator& comm,
      std::span<const std::vector<Shape>> shapes_across_group = {},
      const PlanOptions& options = {}) {
    return create(params, comm, shapes_across_group, options);
  }

  [[nodiscard]] const LayoutPlan& layout() const noexcept { return layout_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] std::uint64_t output_bytes() const noexcept { return layout_.total_bytes; }
  [[nodiscard]] const PlanOptions& options() const noexcept { return options_; }

  // Views of the gathered tensors over a buffer laid out by this plan: element i * world + r is
  // rank r's tensor i.
  // The views are writable only if `buffer` is (execute_shared's memory is read-only).
  [[nodiscard]] std::vector<TensorView> views(const std::byte* buffer) const;

  // Gathers `params` (this rank's tensors, matching the plan) into `out` (output_bytes() bytes,
  // caller-owned, must not overlap an input except as this rank's exact slot). Blocking.
  ExecStats execute(std::span<const TensorView> params, Communicator& comm,
                    std::span<std::byte> out);

  // Gathers into plan-owned memory and returns it (output_bytes(), laid out as for execute()).
  // When every rank is on this host the memory is a node-shared window: each rank copies its
  // tensors in once and reads everyone's in place, so nothing is copied out (the seed's output
  // form: views into the gathered buffer). The bytes stay valid until the next execute_shared
  // of this plan on any rank; read them, do not write them. Elsewhere it is execute() into a
  // plan-owned buffer.
  std::span<const std::byte> execute_shared(std::span<const TensorView> params, Communicator& comm,
                                            ExecStats* stats = nullptr);

  // execute(), started: returns at once; the gather runs on the communicator's progress thread
  // (work.h). `params` is copied; the tensors, `out` and this plan stay alive until it completed.
  Work<ExecStats> start(std::span<const TensorView> params, Communicator& comm,
                        std::span<std::byte> out);

 private:
  friend struct detail::PlanAccess;
  ExecStats execute_now(std::span<const TensorView> params, Communicator& comm,
                        std::span<std::byte> out);
  // This plan's part of `call` up to the payload (detail::prepare_execution with its facts, its
  // checks and its regions), moving with `forced` or the strategy the plan resolves. Returns the
  // job (over the scratch).
  detail::ExchangeJob prepare(detail::Call& call, std::span<const TensorView> params,
                              std::byte* out, std::uint64_t out_size,
                              std::optional<Strategy> forced, ExecStats& stats);
  // The local checks: world, count, output size, each tensor, aliasing; sizes the staging.
  void check_params(const Communicator& comm, std::span<const TensorView> params,
                    const std::byte* out, std::uint64_t out_size, ExecStats& stats);
  // This rank's send stream and the destinations in `out` (none when out is null), in the
  // scratch: the plan's region arithmetic.
  detail::ExchangeJob bind_job(std::span<const TensorView> params, std::byte* out,
                               detail::Stager& stager);

  LayoutPlan layout_;
  int rank_ = 0;
  PlanOptions options_;
  std::uint64_t fingerprint_ = 0;  // of the layout, compared in the pre-flight header
  std::uint64_t dtype_hash_ = 0;
  detail::ScratchHolder scratch_;
};

}  // namespace shardgather
