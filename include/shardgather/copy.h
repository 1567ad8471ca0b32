// Host copy kernels: packing strided views and concatenating segments.
// Each call reads only through its source views and writes only its destination range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "shardgather/export.h"
#include "shardgather/types.h"

namespace shardgather {

// True when the view's strides describe row-major contiguous storage (size-1 and size-0 dims
// are ignored, as in PyTorch). An empty strides vector is contiguous.
SHARDGATHER_API bool is_contiguous(const TensorView& view) noexcept;

// True when two elements of the view share memory: a stride of 0 over a dim of 2 or more (an
// expanded view), or strides that map two indices to one element (as_strided can make them).
// Writing such a view writes one element twice, with whichever value lands last, so every
// operation that writes into caller memory refuses it. Exact for views of up to 2^20 elements;
// a larger view whose strides are not ordered apart (sorted by size, each past the extent of
// the ones below it, as every slice, transpose and narrow of a tensor is) counts as overlapping.
SHARDGATHER_API bool overlaps_itself(const TensorView& view);

// Copies every element of `src` in row-major order to `dst`, which holds numel * elem bytes.
// Strides may be any values (zero and negative included). Never reads an element twice.
SHARDGATHER_API void pack(const TensorView& src, std::byte* dst);

// Copies the concatenation of `src` into the concatenation of the pieces' blocks, in order.
// The two must hold the same number of bytes.
SHARDGATHER_API void copy_stream(std::span<const ConstSegment> src,
                                 std::span<const RecvPiece> dst) noexcept;

// Copies the concatenation of `segments` to `dst`.
SHARDGATHER_API void copy_segments(std::span<const ConstSegment> segments, std::byte* dst) noexcept;

// Rank r's part of a list that `first` (one offset per rank, and one past the end) splits by
// rank: items[first[r] .. first[r + 1]).
template <typename Items, typename First>
[[nodiscard]] auto rank_part(const Items& items, const First& first, std::size_t r) noexcept {
  return items.subspan(first[r], first[r + 1] - first[r]);
}

// How many bytes the segments, or the pieces' blocks, hold in all.
SHARDGATHER_API std::uint64_t stream_bytes(std::span<const ConstSegment> segments) noexcept;
SHARDGATHER_API std::uint64_t stream_bytes(std::span<const RecvPiece> pieces) noexcept;

// The pieces covering bytes [begin, end) of the concatenation of `pieces`' blocks (a transport
// that moves a stream in chunks lands each chunk with these).
SHARDGATHER_API std::vector<RecvPiece> slice_pieces(std::span<const RecvPiece> pieces,
                                                    std::uint64_t begin, std::uint64_t end);
// The same over send segments, as pieces (only read through, never written).
SHARDGATHER_API std::vector<RecvPiece> slice_segments(std::span<const ConstSegment> segments,
                                                      std::uint64_t begin, std::uint64_t end);

}  // namespace shardgather
