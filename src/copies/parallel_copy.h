// Copies split over the copy pool in chunks, for copy-in and copy-out of large lists.
#pragma once

#include <cstdint>
#include <span>

#include "shardgather/types.h"

namespace shardgather::detail {

// Copies bytes [begin, end) of the concatenation of `src` to the same bytes of the
// concatenation of `dst`'s blocks.
void copy_stream_range(std::span<const ConstSegment> src, std::span<const RecvPiece> dst,
                       std::uint64_t begin, std::uint64_t end) noexcept;

// copy_stream on up to `threads` threads (serial below a few MiB). Allocates nothing.
void copy_stream_parallel(std::span<const ConstSegment> src, std::span<const RecvPiece> dst,
                          int threads);

}  // namespace shardgather::detail
