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
#include <string>
#include <string_view>
#include <vector>

#include "shardgather/communicator.h"
#include "shardgather/export.h"
#include "shardgather/layout.h"
#include "shardgather/plan_options.h"
#include "shardgather/quantize.h"
#include "shardgather/reshard.h"
#include "shardgather/stage.h"
#include "shardgather/stats.h"
#include "shardgather/strategy.h"
#include "shardgather/types.h"
#include "shardgather/work.h"

namespace shardgather {

class SHARDGATHER_API AllGatherPlan {
 public:
  AllGatherPlan() = default;
  // Pure: from the dtypes (one per tensor index) and every rank's shapes ([r][i]).
  //
  // `quantize`: empty, or one format per tensor index (QuantFormat::kNone: that index travels
  // as it is). A quantized index is read as one tensor, its ranks' tensors the rows of it along
  // dim 0 (FSDP's reading: they must differ only along dim 0), quantized on send and
  // bit-identical to quantizing that tensor whole (docs/quantization.md). The plan then holds a
  // quantized ReshardPlan (planned here, once) from every rank's tensors to every rank's
  // entries, and each execution is one call of it, through the overloads that take `outputs`
  // and `scales` (the buffer forms are refused on every rank): output i * world + r is rank
  // r's rows of quantized index i (its FP8 data as uint8, with `scales[i * world + r]` the
  // scales of every block those rows touch, or a float32 / bfloat16 view that receives the
  // dequantized rows when that scales view is a default TensorView), or rank r's tensor i of a
  // plain index. Host or CUDA tensors; strategy kAuto or kDirect. InvalidArgument where a
  // format cannot quantize its index (quant_grid's rules on the formed tensor) or the ranks'
  // tensors do not form one.
  AllGatherPlan(std::span<const DType> dtypes,
                std::span<const std::vector<Shape>> shapes_across_group, int rank,
                const PlanOptions& options = {}, std::span<const QuantFormat> quantize = {});

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
  // Whether an index travels quantized; then reshard() is the plan each execution runs.
  [[nodiscard]] bool quantized() const noexcept { return quantized_.has_value(); }
  [[nodiscard]] const ReshardPlan* reshard() const noexcept {
    return quantized_ ? &*quantized_ : nullptr;
  }
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

  // A quantized plan's execution (see the constructor): `outputs` and `scales` hold
  // num_tensors() * world entries each (`scales` may be empty: every output receives values).
  // Refused on every rank for a plan that quantizes nothing. Blocking, or started.
  ExecStats execute(std::span<const TensorView> params, Communicator& comm,
                    std::span<const TensorView> outputs, std::span<const TensorView> scales);
  Work<ExecStats> start(std::span<const TensorView> params, Communicator& comm,
                        std::span<const TensorView> outputs, std::span<const TensorView> scales);

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

  void plan_quantized(std::span<const DType> dtypes,
                      std::span<const std::vector<Shape>> shapes_across_group,
                      std::span<const QuantFormat> quantize);
  // The quantized reshard, or the call refused on every rank (a plan that quantizes nothing).
  ReshardPlan& quantized_plan(Communicator& comm);
  // Fails this rank's part of the call its peers are in (the quantized reshard's or the
  // gather's) with `message`, on every rank.
  [[noreturn]] void refuse(Communicator& comm, const std::string& message) const;

  LayoutPlan layout_;
  std::optional<ReshardPlan> quantized_;
  int rank_ = 0;
  PlanOptions options_;
  std::uint64_t fingerprint_ = 0;  // of the layout, compared in the pre-flight header
  std::uint64_t dtype_hash_ = 0;
  detail::ScratchHolder scratch_;
};

}  // namespace shardgather
