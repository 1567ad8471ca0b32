// foreach_all_gather: gather a list of tensors from every rank in one coalesced collective.
//
//   GatherResult out = foreach_all_gather(params, comm);
//   out[i][r]   // rank r's params[i], in rank r's shape and dtype
//
// Semantics (docs/design.md has the flow, docs/errors.md the error model):
//  - Every rank passes the same number of tensors with the same dtype per index; shapes may
//    differ across ranks (uneven shards, 0-d, empty, (n, 0)). An empty list is a no-op.
//  - shapes_across_group[r][i] is the shape of tensor i on rank r. Given, no metadata moves:
//    the only exchange besides the payload is the fixed-size pre-flight header, which can be
//    switched off. This rank's row is checked against its tensors; a wrong row raises
//    InvalidArgument on every rank (through the header).
//  - Not given, shapes travel inside the payload, and the one metadata collective is the
//    fixed-size header (tensor count, dtype hash, bytes per rank).
//  - By default the payload moves in exactly one all_gather_v, sent straight from the tensors'
//    memory: no copy-in for contiguous inputs (strided inputs are packed first) and no padding.
//    options.strategy asks for another way to move it (strategy.h), with the same fallbacks as
//    a plan's; kAuto means direct here, since a window would be created for one use.
//  - Outputs are views into one gathered buffer that the result owns (no copy-out).
//
// Blocking: returns when the gather is complete on this rank, or raises. Inputs are only read.
// start_foreach_all_gather() is the same call started asynchronously (work.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "shardgather/buffer.h"
#include "shardgather/communicator.h"
#include "shardgather/export.h"
#include "shardgather/layout.h"
#include "shardgather/stage.h"
#include "shardgather/stats.h"
#include "shardgather/strategy.h"
#include "shardgather/types.h"
#include "shardgather/work.h"

namespace shardgather {

// shapes_across_group[r][i]: the shape of tensor i on rank r.
using ShapesHint = std::vector<std::vector<Shape>>;

struct ForeachAllGatherOptions {
  // Deadline for the whole call; unset: the communicator's timeout().
  std::optional<std::chrono::milliseconds> timeout;
  // Exchange the fixed-size pre-flight header (sequence number, count, dtype hash, hint hash,
  // bytes, local status) so that mismatches and local errors raise on every rank. Without a
  // shapes hint the header is also the metadata exchange and is always sent.
  bool preflight = true;
  // How the payload moves. kAuto: direct (padded without an exact gather-v), because a one-shot
  // call must not create a node-shared window it uses once. An explicit kShared or
  // kHierarchical creates one for this call (collective setup, and its first touch) and falls
  // back to direct where it cannot apply, as a plan's does. Without a hint this rank's block
  // (records and tensors) is one part, so kPerTensor issues one collective there. Must be the
  // same on every rank: with the pre-flight header (always sent without a hint) a difference
  // raises Mismatch on every rank; with the header switched off it is not checked.
  Strategy strategy = Strategy::kAuto;
  // The step of a compound operation this call is (stage.h); empty for a call of its own.
  Stage stage{};
};

// The gathered tensors. Owns the gathered buffer; the views stay valid while the result lives.
class SHARDGATHER_API GatherResult {
 public:
  GatherResult() = default;
  GatherResult(LayoutPlan plan, AlignedBuffer buffer, CallStats stats);

  [[nodiscard]] std::size_t size() const noexcept { return plan_.num_tensors; }
  [[nodiscard]] bool empty() const noexcept { return plan_.num_tensors == 0; }
  [[nodiscard]] int world_size() const noexcept { return plan_.world_size; }
  // out[i][r]: rank r's tensor i.
  [[nodiscard]] std::span<const TensorView> operator[](std::size_t i) const;
  [[nodiscard]] const LayoutPlan& plan() const noexcept { return plan_; }
  [[nodiscard]] const AlignedBuffer& buffer() const noexcept { return buffer_; }
  [[nodiscard]] const CallStats& stats() const noexcept { return stats_; }

 private:
  LayoutPlan plan_;
  AlignedBuffer buffer_;
  CallStats stats_;
  std::vector<TensorView> views_;  // [i * world + r]
};

SHARDGATHER_API GatherResult
foreach_all_gather(std::span<const TensorView> params, Communicator& comm,
                   std::span<const std::vector<Shape>> shapes_across_group = {},
                   const ForeachAllGatherOptions& options = {});

// foreach_all_gather, started: returns at once; the gather runs on the communicator's progress
// thread (work.h). `params` and the hint are copied; the tensors' memory stays alive until the
// work completed.
SHARDGATHER_API Work<GatherResult> start_foreach_all_gather(
    std::span<const TensorView> params, Communicator& comm,
    std::span<const std::vector<Shape>> shapes_across_group = {},
    const ForeachAllGatherOptions& options = {});

}  // namespace shardgather
