// Scratch space of one plan execution, reused across executions so a steady-state execution
// allocates nothing (vectors are cleared, never shrunk).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "copies/box_runs.h"
#include "copies/local_input.h"
#include "ops/call.h"
#include "ops/quant_stage.h"
#include "strategies/strategy.h"

#include "shardgather/communicator.h"

namespace shardgather::detail {

struct ExecScratch {
  Device device;  // this execution's tensors' (set by the operation's checks)
  // unshard into output views: the device they say they are on (unset for one output buffer).
  std::optional<Device> output_device;
  std::vector<ConstSegment> segments;   // this rank's wire stream
  std::vector<std::size_t> send_first;  // per tensor: its first segment; n + 1 entries
  std::vector<RecvPiece> pieces;        // one per (rank, tensor), rank-major
  std::vector<std::size_t> first;       // per rank: its first piece; world + 1 entries
  std::vector<std::size_t> part_first;  // per (rank, tensor): its piece; world * n + 1
  std::vector<std::uint64_t> part_bytes;
  std::vector<std::byte> staging;  // packed non-contiguous (or in-place) inputs
  std::vector<std::byte> owned;    // execute_shared's output where no window can exist
  HeaderBuffers headers;           // the pre-flight exchange's
  StrategyScratch strategy;
  // unshard: each parameter's full tensor, and the extents checked for aliasing.
  std::vector<std::byte*> outputs;
  std::vector<TaggedExtent> extents;
  // reshard: each source view's bytes as sent (its memory, or its staged copy), the views'
  // extents for the aliasing check, and the walk over a box's runs.
  std::vector<const std::byte*> sent_from;
  std::vector<ViewExtent> view_extents;
  std::vector<std::int64_t> strides;
  std::vector<std::int64_t> local_offset;
  BoxRunScratch runs;
  QuantScratch quant;  // a quantized reshard's stage
};

// The large buffers of an execution's scratch (the device exchange's staging, send and gather
// buffers, the quantize arena), lent to plans that run one after another on one thread: a
// stream's buckets, which then hold one set between them, as large as the largest bucket needs,
// instead of one each (a model's worth). An execution borrows them (lend before it, again after
// it); a failed one keeps them, since a collective may still be posted over them: its scratch
// is parked with them, and the next execution allocates anew. On a device every borrower runs on
// one stream (the stream's), which orders one bucket's use after the previous one's.
struct LentScratch {
  AlignedBuffer quant_arena;
  DeviceMemory quant_device_arena;
  DeviceMemory device_staging;
  DeviceMemory device_send;
  DeviceMemory device_gathered;
};

// Swaps `lent` with what `x` holds.
inline void lend(LentScratch& lent, ExecScratch& x) noexcept {
  std::swap(lent.quant_arena, x.quant.arena);
  std::swap(lent.quant_device_arena, x.quant.device_arena);
  std::swap(lent.device_staging, x.strategy.device_staging);
  std::swap(lent.device_send, x.strategy.device_send);
  std::swap(lent.device_gathered, x.strategy.device_gathered);
}

}  // namespace shardgather::detail
