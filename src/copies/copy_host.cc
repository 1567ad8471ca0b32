#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "copies/parallel_copy.h"

#include "shardgather/copy.h"

namespace shardgather {

bool is_contiguous(const TensorView& view) noexcept {
  if (view.strides.empty()) {
    return true;
  }
  if (view.strides.size() != view.shape.size()) {
    return false;
  }
  for (const std::int64_t dim : view.shape) {
    if (dim == 0) {
      return true;
    }
  }
  std::int64_t expected = 1;
  for (std::size_t d = view.shape.size(); d-- > 0;) {
    if (view.shape[d] != 1 && view.strides[d] != expected) {
      return false;
    }
    expected *= view.shape[d];
  }
  return true;
}

namespace {

constexpr std::uint64_t kExactOverlapLimit = std::uint64_t{1} << 20;

std::uint64_t saturating_mul(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? UINT64_MAX : out;
}

std::uint64_t saturating_add(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? UINT64_MAX : out;
}

// Every element offset of the view (in elements), sorted: equal neighbours share memory.
bool offsets_collide(std::span<const std::pair<std::uint64_t, std::uint64_t>> dims,
                     std::uint64_t numel) {
  std::vector<std::uint64_t> offsets{0};
  offsets.reserve(numel);
  for (const auto& [stride, size] : dims) {
    const std::size_t n = offsets.size();
    for (std::uint64_t i = 1; i < size; ++i) {
      for (std::size_t k = 0; k < n; ++k) {
        offsets.push_back(offsets[k] + i * stride);  // numel <= 2^20 and a real view's strides
      }
    }
  }
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end();
}

}  // namespace

bool overlaps_itself(const TensorView& view) {
  if (view.strides.empty()) {
    return false;  // contiguous by definition
  }
  // (|stride|, size) of every dim that has more than one index; none for an empty view. Held
  // inline for up to kInlineDims dims: a plan checks its destinations every execution, which
  // allocates nothing for views ordered apart (every slice, narrow and transpose). A view that
  // is not (interleaved strides) is enumerated, up to 8 MiB of offsets, on every check.
  constexpr std::size_t kInlineDims = 16;
  std::array<std::pair<std::uint64_t, std::uint64_t>, kInlineDims> inline_dims{};
  std::vector<std::pair<std::uint64_t, std::uint64_t>> more;
  const bool spill = view.shape.size() > kInlineDims;
  if (spill) {
    more.resize(view.shape.size());
  }
  const std::span<std::pair<std::uint64_t, std::uint64_t>> room =
      spill ? std::span(more) : std::span(inline_dims);
  std::size_t n = 0;
  std::uint64_t numel = 1;
  for (std::size_t d = 0; d < view.shape.size() && d < view.strides.size(); ++d) {
    if (view.shape[d] == 0) {
      return false;
    }
    if (view.shape[d] > 1) {
      const std::int64_t s = view.strides[d];
      room[n++] = {s < 0 ? 0 - static_cast<std::uint64_t>(s) : static_cast<std::uint64_t>(s),
                   static_cast<std::uint64_t>(view.shape[d])};
      numel = saturating_mul(numel, static_cast<std::uint64_t>(view.shape[d]));
    }
  }
  const auto dims = room.first(n);
  std::sort(dims.begin(), dims.end());
  // Ordered apart: each stride past the farthest offset the smaller ones reach.
  std::uint64_t reach = 0;
  bool apart = true;
  for (const auto& [stride, size] : dims) {
    if (stride == 0) {
      return true;
    }
    apart = apart && stride > reach;
    reach = saturating_add(reach, saturating_mul(stride, size - 1));
  }
  if (apart) {
    return false;
  }
  if (numel > kExactOverlapLimit || reach == UINT64_MAX) {
    return true;  // not proven apart, and too large to enumerate
  }
  return offsets_collide(dims, numel);
}

void pack(const TensorView& src, std::byte* dst) {
  const auto elem = static_cast<std::int64_t>(dtype_size(src.dtype));
  const std::size_t ndim = src.shape.size();
  for (const std::int64_t dim : src.shape) {
    if (dim == 0) {
      return;
    }
  }
  const auto* base = static_cast<const std::byte*>(src.data);
  if (ndim == 0) {
    std::memcpy(dst, base, static_cast<std::size_t>(elem));
    return;
  }
  if (src.strides.empty()) {  // contiguous: one copy
    std::int64_t elements = 1;
    for (const std::int64_t dim : src.shape) {
      elements *= dim;
    }
    std::memcpy(dst, base, static_cast<std::size_t>(elements * elem));
    return;
  }
  const std::span<const std::int64_t> strides(src.strides);
  // The odometer's index: inline for the dims tensors have (a plan's steady state allocates
  // nothing), on the heap beyond.
  constexpr std::size_t kInlineDims = 16;
  std::array<std::int64_t, kInlineDims> inline_index{};
  std::vector<std::int64_t> heap_index(ndim > kInlineDims ? ndim : 0, 0);
  const std::span<std::int64_t> index =
      ndim > kInlineDims ? std::span(heap_index) : std::span(inline_index).first(ndim);
  const std::int64_t inner = src.shape[ndim - 1];
  const std::int64_t inner_stride = strides[ndim - 1];
  const auto row_bytes = static_cast<std::size_t>(inner * elem);
  for (;;) {
    std::int64_t offset = 0;
    for (std::size_t d = 0; d + 1 < ndim; ++d) {
      offset += index[d] * strides[d];
    }
    const std::byte* row = base + offset * elem;
    if (inner_stride == 1) {
      std::memcpy(dst, row, row_bytes);
      dst += row_bytes;
    } else {
      for (std::int64_t k = 0; k < inner; ++k) {
        std::memcpy(dst, row + k * inner_stride * elem, static_cast<std::size_t>(elem));
        dst += elem;
      }
    }
    std::size_t d = ndim - 1;
    for (;;) {
      if (d == 0) {
        return;
      }
      --d;
      if (++index[d] < src.shape[d]) {
        break;
      }
      index[d] = 0;
    }
  }
}

void copy_stream(std::span<const ConstSegment> src, std::span<const RecvPiece> dst) noexcept {
  std::uint64_t total = 0;
  for (const ConstSegment& segment : src) {
    total += segment.size;
  }
  detail::copy_stream_range(src, dst, 0, total);
}

void copy_segments(std::span<const ConstSegment> segments, std::byte* dst) noexcept {
  for (const ConstSegment& segment : segments) {
    if (segment.size != 0) {
      std::memcpy(dst, segment.data, segment.size);
      dst += segment.size;
    }
  }
}

std::vector<RecvPiece> slice_pieces(std::span<const RecvPiece> pieces, std::uint64_t begin,
                                    std::uint64_t end) {
  std::vector<RecvPiece> out;
  std::uint64_t pos = 0;
  for (const RecvPiece& p : pieces) {
    const std::uint64_t total = p.block * p.count;
    if (pos >= end) {
      break;
    }
    if (pos + total > begin && total != 0) {
      const std::uint64_t lo = std::max(begin, pos) - pos;
      const std::uint64_t hi = std::min(end, pos + total) - pos;
      const std::uint64_t kb = lo / p.block;
      const std::uint64_t ob = lo % p.block;
      const std::uint64_t ke = (hi - 1) / p.block;
      const std::uint64_t oe = (hi - 1) % p.block + 1;
      if (kb == ke) {
        out.push_back({p.data + kb * p.stride + ob, oe - ob, 1, 0});
      } else {
        out.push_back({p.data + kb * p.stride + ob, p.block - ob, 1, 0});
        if (ke - kb > 1) {
          out.push_back({p.data + (kb + 1) * p.stride, p.block, ke - kb - 1, p.stride});
        }
        out.push_back({p.data + ke * p.stride, oe, 1, 0});
      }
    }
    pos += total;
  }
  return out;
}

std::uint64_t stream_bytes(std::span<const ConstSegment> segments) noexcept {
  std::uint64_t bytes = 0;
  for (const ConstSegment& s : segments) {
    bytes += s.size;
  }
  return bytes;
}

std::uint64_t stream_bytes(std::span<const RecvPiece> pieces) noexcept {
  std::uint64_t bytes = 0;
  for (const RecvPiece& p : pieces) {
    bytes += p.block * p.count;
  }
  return bytes;
}

std::vector<RecvPiece> slice_segments(std::span<const ConstSegment> segments, std::uint64_t begin,
                                      std::uint64_t end) {
  std::vector<RecvPiece> pieces;
  pieces.reserve(segments.size());
  for (const ConstSegment& s : segments) {
    // Only read through: a datatype or a copy source.
    pieces.push_back({const_cast<std::byte*>(s.data), s.size, 1, 0});
  }
  return slice_pieces(pieces, begin, end);
}

}  // namespace shardgather
