// One entry of a fused copy launch, and the index arithmetic both the CUDA kernel and its host
// twin (copy_table.cc, run_on_host) use, so the CPU tests exercise the mapping the GPU runs.
//
// A descriptor copies `runs` runs of `run` contiguous bytes; run k's source and destination
// are found by reading k as an index over `extent` (innermost last) with byte strides. A
// contiguous copy has ndim 0 (one run). The work is cut into units of `width` bytes (16, 8, 4,
// 2 or 1: the widest that every address, run and stride allows, so loads and stores are
// vectorised where alignment permits), and units into blocks of kCopyUnitsPerBlock.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define SG_HOST_DEVICE __host__ __device__
#else
#define SG_HOST_DEVICE
#endif

namespace shardgather::detail {

inline constexpr int kCopyMaxDims = 4;         // outer dims after merging
inline constexpr unsigned kCopyThreads = 256;  // threads per block
inline constexpr unsigned kCopyUnroll = 4;     // units per thread
inline constexpr std::uint64_t kCopyUnitsPerBlock = std::uint64_t{kCopyThreads} * kCopyUnroll;

struct CopyDesc {
  std::uint64_t src = 0;  // address of the first byte read
  std::uint64_t dst = 0;  // address of the first byte written
  std::uint64_t run = 0;  // bytes per contiguous run, a multiple of width
  std::uint64_t runs = 1;
  std::int64_t extent[kCopyMaxDims] = {1, 1, 1, 1};
  std::int64_t src_stride[kCopyMaxDims] = {};
  std::int64_t dst_stride[kCopyMaxDims] = {};
  std::uint64_t first_block = 0;  // this descriptor's first block in the launch
  std::uint32_t ndim = 0;
  std::uint32_t width = 1;

  friend bool operator==(const CopyDesc&, const CopyDesc&) = default;
};

SG_HOST_DEVICE inline std::uint64_t units_of(const CopyDesc& d) {
  return d.runs * (d.run / d.width);
}

// The descriptor that block `block` belongs to: the last one whose first_block <= block.
SG_HOST_DEVICE inline std::size_t find_desc(const CopyDesc* table, std::size_t n,
                                            std::uint64_t block) {
  std::size_t lo = 0;
  std::size_t hi = n;
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (table[mid].first_block <= block) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

struct UnitAddress {
  std::uint64_t src;
  std::uint64_t dst;
};

// q = n / d and n - q * d, in 32 bits where both fit: a 64-bit divide costs the GPU several
// times a 32-bit one, and this runs once per unit of a strided descriptor.
SG_HOST_DEVICE inline std::uint64_t div_rem(std::uint64_t n, std::uint64_t d, std::uint64_t& rem) {
  if (((n | d) >> 32U) == 0) {
    const auto n32 = static_cast<std::uint32_t>(n);
    const auto d32 = static_cast<std::uint32_t>(d);
    const std::uint32_t q32 = n32 / d32;
    rem = n32 - q32 * d32;
    return q32;
  }
  const std::uint64_t q = n / d;
  rem = n - q * d;
  return q;
}

// Where unit u of a descriptor reads and writes.
SG_HOST_DEVICE inline UnitAddress unit_address(const CopyDesc& d, std::uint64_t u) {
  if (d.ndim == 0) {
    return {d.src + u * d.width, d.dst + u * d.width};
  }
  std::uint64_t within = 0;
  std::uint64_t r = div_rem(u, d.run / d.width, within);
  within *= d.width;
  std::int64_t src_off = 0;
  std::int64_t dst_off = 0;
  // Innermost outer dim first; the outermost takes what is left (r < extent[0] there).
  for (int k = static_cast<int>(d.ndim) - 1; k > 0; --k) {
    std::uint64_t i = 0;
    r = div_rem(r, static_cast<std::uint64_t>(d.extent[k]), i);
    src_off += static_cast<std::int64_t>(i) * d.src_stride[k];
    dst_off += static_cast<std::int64_t>(i) * d.dst_stride[k];
  }
  src_off += static_cast<std::int64_t>(r) * d.src_stride[0];
  dst_off += static_cast<std::int64_t>(r) * d.dst_stride[0];
  return {d.src + static_cast<std::uint64_t>(src_off) + within,
          d.dst + static_cast<std::uint64_t>(dst_off) + within};
}

}  // namespace shardgather::detail
