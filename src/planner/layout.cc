#include "shardgather/layout.h"

#include <algorithm>
#include <string>

#include "vocabulary/checked_math.h"

#include "shardgather/errors.h"

namespace shardgather {

using detail::add_checked;
using detail::align_up_checked;
using detail::mul_checked;

std::uint64_t checked_nbytes(DType dtype, std::span<const std::int64_t> shape) {
  if (!is_valid_dtype(dtype)) {
    throw InvalidArgument("invalid dtype code " + std::to_string(static_cast<int>(dtype)));
  }
  bool has_zero = false;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 0) {
      throw InvalidArgument("negative size " + std::to_string(shape[d]) + " in dim " +
                            std::to_string(d));
    }
    has_zero = has_zero || shape[d] == 0;
  }
  // A zero anywhere makes the tensor empty, however large the other dims.
  if (has_zero) {
    return 0;
  }
  std::uint64_t bytes = dtype_size(dtype);
  for (const std::int64_t dim : shape) {
    bytes = mul_checked(bytes, static_cast<std::uint64_t>(dim), "tensor size in bytes");
  }
  return bytes;
}

std::uint64_t block_alignment(std::span<const DType> dtypes, const LayoutOptions& options) {
  std::uint64_t alignment = options.with_records ? 8 : 1;
  for (const DType dtype : dtypes) {
    alignment = std::max<std::uint64_t>(alignment, dtype_size(dtype));
  }
  return alignment;
}

std::uint64_t record_bytes(std::span<const Shape> shapes) {
  std::uint64_t words = shapes.size();
  for (const Shape& shape : shapes) {
    words = add_checked(words, shape.size(), "shape records");
  }
  return mul_checked(words, 8, "shape records");
}

std::uint64_t place_blocks(std::span<const std::uint64_t> counts, std::uint64_t alignment,
                           std::span<std::uint64_t> displs) {
  std::uint64_t end = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    displs[r] = align_up_checked(end, alignment, "block displacement");
    end = add_checked(displs[r], counts[r], "gathered size");
  }
  return end;
}

BlockLayout plan_block(std::span<const DType> dtypes, std::span<const Shape> shapes,
                       const LayoutOptions& options) {
  if (dtypes.size() != shapes.size()) {
    throw InvalidArgument("plan_block: " + std::to_string(dtypes.size()) + " dtypes but " +
                          std::to_string(shapes.size()) + " shapes");
  }
  BlockLayout block;
  block.record_bytes = options.with_records ? record_bytes(shapes) : 0;
  block.offsets.resize(dtypes.size());
  block.sizes.resize(dtypes.size());
  std::uint64_t end = block.record_bytes;
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    const std::uint64_t size = checked_nbytes(dtypes[i], shapes[i]);
    // Empty tensors take no space and no alignment padding, so they never add wire bytes.
    if (size != 0) {
      end = align_up_checked(end, dtype_size(dtypes[i]), "tensor offset");
    }
    block.offsets[i] = end;
    block.sizes[i] = size;
    end = add_checked(end, size, "block size");
  }
  block.bytes = end;
  return block;
}

LayoutPlan plan_layout(std::span<const DType> dtypes, std::span<const Shape> shapes, int world_size,
                       const LayoutOptions& options) {
  if (world_size < 1) {
    throw InvalidArgument("plan_layout: world size " + std::to_string(world_size) + " < 1");
  }
  const std::size_t n = dtypes.size();
  const auto world = static_cast<std::size_t>(world_size);
  if (shapes.size() != world * n) {
    throw InvalidArgument("plan_layout: expected " + std::to_string(world * n) + " shapes (world " +
                          std::to_string(world_size) + " x " + std::to_string(n) +
                          " tensors), got " + std::to_string(shapes.size()));
  }
  LayoutPlan plan;
  plan.world_size = world_size;
  plan.num_tensors = n;
  plan.with_records = options.with_records;
  plan.alignment = block_alignment(dtypes, options);
  plan.dtypes.assign(dtypes.begin(), dtypes.end());
  plan.shapes.assign(shapes.begin(), shapes.end());
  plan.offsets.resize(world * n);
  plan.sizes.resize(world * n);
  plan.counts.resize(world);
  plan.displs.resize(world);
  for (std::size_t r = 0; r < world; ++r) {
    const BlockLayout block = plan_block(dtypes, shapes.subspan(r * n, n), options);
    plan.counts[r] = block.bytes;
    for (std::size_t i = 0; i < n; ++i) {
      plan.offsets[r * n + i] = block.offsets[i];
      plan.sizes[r * n + i] = block.sizes[i];
    }
  }
  const std::uint64_t end = place_blocks(plan.counts, plan.alignment, plan.displs);
  for (std::size_t r = 0; r < world; ++r) {
    for (std::size_t i = 0; i < n; ++i) {
      plan.offsets[r * n + i] = add_checked(plan.displs[r], plan.offsets[r * n + i], "offset");
    }
  }
  plan.total_bytes = end;
  return plan;
}

}  // namespace shardgather
