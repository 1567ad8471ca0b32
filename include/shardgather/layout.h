// The layout planner: from every rank's shapes and dtypes to the byte layout of one gather.
// Pure functions: no communication, no I/O, deterministic. All size arithmetic is in 64 bits
// and overflow-checked (CountOverflow); nothing is ever narrowed to int here.
//
// The gathered buffer is rank-major: rank r's block starts at displs[r] and holds, in order,
//   [records]  only when LayoutOptions::with_records: per tensor one int64 ndim then its dims,
//   tensor 0, tensor 1, ...  each at an offset (from the block start) aligned to its element
//                            size, the gap bytes being zero.
// Blocks start at multiples of the list's largest element size (8 with records), so a block
// boundary never adds bytes on the wire: counts[r] is exactly what rank r sends.
// docs/layout.md has a worked example.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "shardgather/export.h"
#include "shardgather/types.h"

namespace shardgather {

struct LayoutOptions {
  // Prefix every block with the shape records (the no-hint path ships shapes in the payload).
  bool with_records = false;
};

// One rank's block, relative to the block start.
struct BlockLayout {
  std::uint64_t record_bytes = 0;
  std::vector<std::uint64_t> offsets;  // per tensor
  std::vector<std::uint64_t> sizes;    // per tensor, bytes
  std::uint64_t bytes = 0;             // end of the last tensor: what this rank sends
};

// A whole gather. Plans are values: copy, cache and reuse them.
struct LayoutPlan {
  int world_size = 0;
  std::size_t num_tensors = 0;
  bool with_records = false;
  std::uint64_t alignment = 1;         // of every block start
  std::vector<DType> dtypes;           // per tensor index (the same on every rank)
  std::vector<Shape> shapes;           // [rank * num_tensors + i]
  std::vector<std::uint64_t> offsets;  // [rank * num_tensors + i], from the buffer start
  std::vector<std::uint64_t> sizes;    // [rank * num_tensors + i], bytes
  std::vector<std::uint64_t> counts;   // per rank: bytes on the wire
  std::vector<std::uint64_t> displs;   // per rank: block start in the gathered buffer
  std::uint64_t total_bytes = 0;       // gathered buffer size

  [[nodiscard]] std::size_t index(int rank, std::size_t tensor) const noexcept {
    return static_cast<std::size_t>(rank) * num_tensors + tensor;
  }
};

// Bytes of a tensor of `shape`; InvalidArgument for a negative dim or a bad dtype,
// CountOverflow when the product overflows 64 bits.
SHARDGATHER_API std::uint64_t checked_nbytes(DType dtype, std::span<const std::int64_t> shape);

// The block alignment of a list: its largest element size, at least 8 with records.
SHARDGATHER_API std::uint64_t block_alignment(std::span<const DType> dtypes,
                                              const LayoutOptions& options = {});

// Bytes of the records prefix for these shapes: 8 * (n + sum of ndims).
SHARDGATHER_API std::uint64_t record_bytes(std::span<const Shape> shapes);

// Places blocks of `counts` bytes one after another, each start aligned to `alignment` (a power
// of two); writes the starts to `displs` (same size as counts) and returns the total size.
SHARDGATHER_API std::uint64_t place_blocks(std::span<const std::uint64_t> counts,
                                           std::uint64_t alignment,
                                           std::span<std::uint64_t> displs);

// One rank's block; `shapes` has one entry per dtype.
SHARDGATHER_API BlockLayout plan_block(std::span<const DType> dtypes, std::span<const Shape> shapes,
                                       const LayoutOptions& options = {});

// The whole gather; `shapes` is rank-major, world_size * dtypes.size() entries.
SHARDGATHER_API LayoutPlan plan_layout(std::span<const DType> dtypes, std::span<const Shape> shapes,
                                       int world_size, const LayoutOptions& options = {});

}  // namespace shardgather
