#include "copies/parallel_copy.h"

#include <algorithm>
#include <cstring>

#include "copies/parallel.h"

namespace shardgather::detail {

namespace {

constexpr std::uint64_t kChunkBytes = std::uint64_t{1} << 20;
constexpr std::uint64_t kParallelThreshold = std::uint64_t{4} << 20;

struct RangeCopy {
  std::span<const ConstSegment> src;
  std::span<const RecvPiece> dst;
  std::uint64_t total;
};

}  // namespace

void copy_stream_range(std::span<const ConstSegment> src, std::span<const RecvPiece> dst,
                       std::uint64_t begin, std::uint64_t end) noexcept {
  // Position both streams at `begin`.
  std::size_t s = 0;
  std::uint64_t s_pos = begin;
  while (s < src.size() && s_pos >= src[s].size) {
    s_pos -= src[s].size;
    ++s;
  }
  std::size_t d = 0;
  std::uint64_t d_pos = begin;  // offset inside dst[d]'s blocks
  while (d < dst.size() && d_pos >= dst[d].block * dst[d].count) {
    d_pos -= dst[d].block * dst[d].count;
    ++d;
  }
  std::uint64_t left = end - begin;
  while (left != 0) {
    while (src[s].size == s_pos) {
      ++s;
      s_pos = 0;
    }
    while (dst[d].block * dst[d].count == d_pos) {
      ++d;
      d_pos = 0;
    }
    const RecvPiece& p = dst[d];
    const std::uint64_t k = d_pos / p.block;
    const std::uint64_t in_block = d_pos % p.block;
    const std::uint64_t n = std::min({left, src[s].size - s_pos, p.block - in_block});
    std::memcpy(p.data + k * p.stride + in_block, src[s].data + s_pos, n);
    s_pos += n;
    d_pos += n;
    left -= n;
  }
}

void copy_stream_parallel(std::span<const ConstSegment> src, std::span<const RecvPiece> dst,
                          int threads) {
  std::uint64_t total = 0;
  for (const ConstSegment& segment : src) {
    total += segment.size;
  }
  if (threads <= 1 || total < kParallelThreshold) {
    copy_stream_range(src, dst, 0, total);
    return;
  }
  RangeCopy job{src, dst, total};
  const auto tasks = static_cast<std::size_t>((total + kChunkBytes - 1) / kChunkBytes);
  parallel_for(
      tasks, threads,
      [](void* ctx, std::size_t k) {
        const auto& j = *static_cast<const RangeCopy*>(ctx);
        const std::uint64_t begin = k * kChunkBytes;
        copy_stream_range(j.src, j.dst, begin, std::min(j.total, begin + kChunkBytes));
      },
      &job);
}

}  // namespace shardgather::detail
