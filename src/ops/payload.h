// What every operation does once its call agreed: move an ExchangeJob through the strategy layer.
// Shared by the operations in src/ops/ (foreach, plans, unshard).
#pragma once

#include <cstddef>
#include <vector>

#include "copies/send_stream.h"
#include "ops/call.h"
#include "ops/exec_scratch.h"
#include "strategies/strategy.h"

#include "shardgather/communicator.h"
#include "shardgather/layout.h"
#include "shardgather/plan.h"

namespace shardgather::detail {

// The device half of a call's checks, run inside call.check once its tensors are validated:
// InvalidArgument unless the communicator can move memory of `device` (capabilities()
// .device_memory) and unless SHARDGATHER_DEVICE_GATHER is a known request; records the device
// type and, on a device, the request in the header, where ranks that differ disagree.
void check_call_device(Call& call, const Device& device);

// A device call's scratch that its checks must size (inside call.check, so that a failed
// allocation travels in the header): device staging of `staged` bytes for strided inputs, and
// the zero bytes gaps are sent from, on `device` (written on `stream`). No-op on the host.
void reserve_device_scratch(ExecScratch& x, const Device& device, std::uint64_t staged,
                            void* stream);

// Where this execution stages strided inputs and takes gap bytes from: the host staging, or on a
// CUDA device the reserved device staging and zeros, with the deferred pack table (cleared).
// Allocates nothing.
Stager stager_for(ExecScratch& x, const Device& device);

// Sizes the scratch for world ranks of n tensors (no-op when already sized).
void size_scratch(ExecScratch& x, int world, std::size_t n);

// What a one-shot call (foreach_all_gather, unshard, a stream's buckets) asks the strategy layer
// for: kAuto becomes kDirect, since a node-shared window would be created for one use and a
// trial needs executions to compare; an explicit strategy is kept.
Strategy one_shot_strategy(Strategy requested) noexcept;

// Moves the job's payload with `strategy` (from select_strategy; `requested` is what the caller
// asked for, which decides the kAuto window fallback): a device job through run_device (it moves
// as kPacked), a local copy at world size 1, nothing when no rank sends a byte, else the strategy,
// inside call.transfer (the caller guards what the collective may touch). Fills stats.strategy and
// the collective counts.
void run_payload(Call& call, Strategy requested, Strategy strategy, const ExchangeJob& job,
                 StrategyScratch& scratch, ExecStats& stats);

// A payload whose every rank's stream lands as one contiguous block at base + displs[r] (the
// no-hint foreach, a plan's record exchange): the pieces and the job over them. Filled in place
// (the job's spans point into it), so neither copied nor moved.
struct BlockJob {
  BlockJob(std::span<const ConstSegment> send, std::byte* base,
           std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
           bool entry_synchronized);
  BlockJob(const BlockJob&) = delete;
  BlockJob& operator=(const BlockJob&) = delete;
  BlockJob(BlockJob&&) = delete;
  BlockJob& operator=(BlockJob&&) = delete;
  ~BlockJob() = default;

  std::vector<RecvPiece> pieces;
  std::vector<std::size_t> first;
  std::vector<std::size_t> whole;  // this rank's stream is one part
  StrategyScratch scratch;         // a padded or rank-major move stages here
  ExchangeJob job;
};

// Views of a layout's tensors over `buffer` (on `device`): element i * world + r is rank r's
// tensor i.
std::vector<TensorView> layout_views(const LayoutPlan& layout, const std::byte* buffer,
                                     const Device& device = kCpu);

// A one-shot call's output: host memory, or memory on the tensors' CUDA device from the device
// allocator, for work on this thread's current stream (the call's).
AlignedBuffer output_buffer(std::uint64_t bytes, const Device& device);

// InvalidArgument unless `comm` is rank `rank` of `world`, as the plan was built.
void check_plan_world(const Communicator& comm, int world, int rank);

// The copy kernels' thread count for these options on this communicator.
int copy_threads(const PlanOptions& options, const Communicator& comm);

// The one dst of a call given `apart` (an older argument) and in PlanOptions::dst (`in_options`,
// named `options_name` in the message): either may be -1; InvalidArgument, naming `who`, when
// both are set and differ.
int one_dst(int apart, int in_options, const char* who, const char* options_name);

}  // namespace shardgather::detail
