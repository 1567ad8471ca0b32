#include "copies/copy_table.h"

#include <algorithm>
#include <cstring>

#include "shardgather/copy.h"

namespace shardgather::detail {

namespace {

struct Dim {
  std::int64_t extent;
  std::int64_t src_stride;  // bytes
  std::int64_t dst_stride;  // bytes
};

std::uint64_t address(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p); }

// Descriptors hold addresses as integers, the form the kernel reads them in.
void* as_pointer(std::uint64_t a) noexcept {
  // NOLINTNEXTLINE(performance-no-int-to-ptr)
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(a));
}

// The widest unit that every address and step of `d` is a multiple of.
std::uint32_t widest_unit(const CopyDesc& d) noexcept {
  std::uint64_t bits = d.src | d.dst | d.run;
  for (std::uint32_t k = 0; k < d.ndim; ++k) {
    bits |=
        static_cast<std::uint64_t>(d.src_stride[k]) | static_cast<std::uint64_t>(d.dst_stride[k]);
  }
  std::uint32_t width = 16;
  while (width > 1 && (bits & (width - 1)) != 0) {
    width /= 2;
  }
  return width;
}

}  // namespace

void CopyTable::clear() noexcept {
  descs_.clear();
  blocks_ = 0;
}

void CopyTable::add_bytes(const std::byte* src, std::byte* dst, std::uint64_t bytes) {
  if (bytes == 0) {
    return;
  }
  // A copy that starts where the last one ended, on both sides, extends it.
  if (!descs_.empty()) {
    CopyDesc& last = descs_.back();
    if (last.ndim == 0 && last.src + last.run == address(src) &&
        last.dst + last.run == address(dst)) {
      last.run += bytes;
      return;
    }
  }
  CopyDesc d;
  d.src = address(src);
  d.dst = address(dst);
  d.run = bytes;
  descs_.push_back(d);
}

void CopyTable::add_strided(std::uint64_t src, std::uint64_t dst, std::uint64_t run, int ndim,
                            const std::int64_t* extent, const std::int64_t* src_stride,
                            const std::int64_t* dst_stride) {
  if (ndim > kCopyMaxDims) {
    // More outer dims than a descriptor holds: one descriptor set per index of the outermost.
    for (std::int64_t i = 0; i < extent[0]; ++i) {
      add_strided(src + static_cast<std::uint64_t>(i * src_stride[0]),
                  dst + static_cast<std::uint64_t>(i * dst_stride[0]), run, ndim - 1, extent + 1,
                  src_stride + 1, dst_stride + 1);
    }
    return;
  }
  CopyDesc d;
  d.src = src;
  d.dst = dst;
  d.run = run;
  d.ndim = static_cast<std::uint32_t>(ndim);
  for (int k = 0; k < ndim; ++k) {
    d.extent[k] = extent[k];
    d.src_stride[k] = src_stride[k];
    d.dst_stride[k] = dst_stride[k];
    d.runs *= static_cast<std::uint64_t>(extent[k]);
  }
  descs_.push_back(d);
}

void CopyTable::add_pack(const TensorView& src, std::byte* dst) {
  const auto elem = static_cast<std::int64_t>(dtype_size(src.dtype));
  std::int64_t numel = 1;
  for (const std::int64_t e : src.shape) {
    numel *= e;
  }
  if (numel == 0) {
    return;
  }
  if (is_contiguous(src)) {
    add_bytes(static_cast<const std::byte*>(src.data), dst,
              static_cast<std::uint64_t>(numel * elem));
    return;
  }
  // Size-1 dims dropped, neighbours merged where both sides step as one dim; innermost last.
  std::vector<Dim> dims;
  dims.reserve(src.shape.size());
  std::int64_t dst_step = numel * elem;
  for (std::size_t k = 0; k < src.shape.size(); ++k) {
    dst_step /= src.shape[k];
    if (src.shape[k] == 1) {
      continue;
    }
    const Dim dim{src.shape[k], src.strides[k] * elem, dst_step};
    if (!dims.empty() && dims.back().src_stride == dim.src_stride * dim.extent &&
        dims.back().dst_stride == dim.dst_stride * dim.extent) {
      dims.back() = {dims.back().extent * dim.extent, dim.src_stride, dim.dst_stride};
    } else {
      dims.push_back(dim);
    }
  }
  auto run = static_cast<std::uint64_t>(elem);
  if (dims.back().src_stride == elem) {
    run = static_cast<std::uint64_t>(dims.back().extent * elem);
    dims.pop_back();
  }
  std::vector<std::int64_t> extent;
  std::vector<std::int64_t> src_stride;
  std::vector<std::int64_t> dst_stride;
  for (const Dim& dim : dims) {
    extent.push_back(dim.extent);
    src_stride.push_back(dim.src_stride);
    dst_stride.push_back(dim.dst_stride);
  }
  add_strided(address(src.data), address(dst), run, static_cast<int>(dims.size()), extent.data(),
              src_stride.data(), dst_stride.data());
}

void CopyTable::add_stream(std::span<const ConstSegment> src, std::span<const RecvPiece> dst) {
  std::size_t s = 0;
  std::uint64_t s_off = 0;
  for (const RecvPiece& piece : dst) {
    std::uint64_t k = 0;      // block of the piece
    std::uint64_t b_off = 0;  // byte within it
    while (k < piece.count && piece.block != 0) {
      while (s_off == src[s].size) {
        ++s;
        s_off = 0;
      }
      const std::uint64_t left = src[s].size - s_off;
      std::byte* to = piece.data + k * piece.stride + b_off;
      const std::byte* from = src[s].data + s_off;
      if (b_off == 0 && left >= piece.block) {
        // Whole blocks from one segment: one descriptor, strided on the destination side.
        const std::uint64_t n = std::min(piece.count - k, left / piece.block);
        if (n == 1 || piece.stride == piece.block) {
          add_bytes(from, to, n * piece.block);
        } else {
          const auto extent = static_cast<std::int64_t>(n);
          const auto src_stride = static_cast<std::int64_t>(piece.block);
          const auto dst_stride = static_cast<std::int64_t>(piece.stride);
          add_strided(address(from), address(to), piece.block, 1, &extent, &src_stride,
                      &dst_stride);
        }
        k += n;
        s_off += n * piece.block;
        continue;
      }
      const std::uint64_t m = std::min(left, piece.block - b_off);
      add_bytes(from, to, m);
      s_off += m;
      b_off += m;
      if (b_off == piece.block) {
        ++k;
        b_off = 0;
      }
    }
  }
}

void CopyTable::finish() noexcept {
  blocks_ = 0;
  for (CopyDesc& d : descs_) {
    d.width = widest_unit(d);
    d.first_block = blocks_;
    blocks_ += (units_of(d) + kCopyUnitsPerBlock - 1) / kCopyUnitsPerBlock;
  }
}

std::uint64_t CopyTable::bytes() const noexcept {
  std::uint64_t total = 0;
  for (const CopyDesc& d : descs_) {
    total += d.run * d.runs;
  }
  return total;
}

void run_on_host(const CopyTable& table) noexcept { run_on_host(table.descs(), table.blocks()); }

void run_on_host(std::span<const CopyDesc> descs, std::uint64_t blocks) noexcept {
  for (std::uint64_t block = 0; block < blocks; ++block) {
    const CopyDesc& d = descs[find_desc(descs.data(), descs.size(), block)];
    const std::uint64_t base = (block - d.first_block) * kCopyUnitsPerBlock;
    const std::uint64_t units = units_of(d);
    for (unsigned i = 0; i < kCopyUnroll; ++i) {
      for (unsigned t = 0; t < kCopyThreads; ++t) {
        const std::uint64_t u = base + std::uint64_t{i} * kCopyThreads + t;
        if (u < units) {
          const UnitAddress a = unit_address(d, u);
          std::memcpy(as_pointer(a.dst), as_pointer(a.src), d.width);
        }
      }
    }
  }
}

}  // namespace shardgather::detail
