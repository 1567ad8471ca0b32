// Where a box of elements lies inside a strided view: its runs in row-major order, as the
// reshard's send segments and receive pieces address them (no copy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace shardgather::detail {

// `count` runs of `block` bytes, run k at `offset + k * stride` bytes from the view's data.
struct BoxRun {
  std::int64_t offset = 0;
  std::uint64_t block = 0;
  std::uint64_t count = 1;
  std::uint64_t stride = 0;
};

// The dims of a view, resolved: a contiguous view's strides filled in.
inline void resolve_strides(std::span<const std::int64_t> shape,
                            std::span<const std::int64_t> strides, std::vector<std::int64_t>& out) {
  out.assign(strides.begin(), strides.end());
  if (!strides.empty()) {
    return;
  }
  out.assign(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) {
    out[d - 1] = out[d] * shape[d];
  }
}

// Calls emit(BoxRun) for the elements local_offset[d] <= x[d] < local_offset[d] + size[d] of a
// view with `strides` (elements, resolved) and `elem`-byte elements, in row-major order of the
// box. The innermost dims that are contiguous in the view make one run's block; the next dim
// with a positive stride is the run count; the rest are enumerated. A view whose innermost
// stride is not 1 yields runs of one element. Allocates nothing once `scratch` has grown.
struct BoxRunScratch {
  std::vector<std::size_t> dims;
  std::vector<std::int64_t> at;
};

template <typename Emit>
void for_each_box_run(std::span<const std::int64_t> local_offset,
                      std::span<const std::int64_t> size, std::span<const std::int64_t> strides,
                      std::uint64_t elem, BoxRunScratch& scratch, Emit&& emit) {
  std::int64_t base = 0;
  std::vector<std::size_t>& dims = scratch.dims;
  dims.clear();
  for (std::size_t d = 0; d < size.size(); ++d) {
    if (size[d] == 0) {
      return;
    }
    base += local_offset[d] * strides[d];
    if (size[d] > 1) {
      dims.push_back(d);
    }
  }
  const auto e = static_cast<std::int64_t>(elem);
  base *= e;
  BoxRun run{base, elem, 1, 0};
  // The block: the innermost dims while they nest contiguously.
  if (!dims.empty() && strides[dims.back()] == 1) {
    run.block = static_cast<std::uint64_t>(size[dims.back()]) * elem;
    dims.pop_back();
    while (!dims.empty() && strides[dims.back()] * e == static_cast<std::int64_t>(run.block)) {
      run.block *= static_cast<std::uint64_t>(size[dims.back()]);
      dims.pop_back();
    }
  }
  // The count: the next dim, where its stride is positive (RecvPiece strides are unsigned).
  if (!dims.empty() && strides[dims.back()] > 0) {
    run.count = static_cast<std::uint64_t>(size[dims.back()]);
    run.stride = static_cast<std::uint64_t>(strides[dims.back()] * e);
    dims.pop_back();
  }
  if (dims.empty()) {
    emit(run);
    return;
  }
  // The remaining dims, an odometer over them (outermost first).
  std::vector<std::int64_t>& at = scratch.at;
  at.assign(dims.size(), 0);
  while (true) {
    BoxRun r = run;
    for (std::size_t k = 0; k < dims.size(); ++k) {
      r.offset += at[k] * strides[dims[k]] * e;
    }
    emit(r);
    std::size_t k = dims.size();
    while (k-- > 0) {
      if (++at[k] < size[dims[k]]) {
        break;
      }
      at[k] = 0;
    }
    if (k == static_cast<std::size_t>(-1)) {
      return;
    }
  }
}

}  // namespace shardgather::detail
