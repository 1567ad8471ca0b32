// Validation of this rank's tensors: the local half of the "one validated entry path".
// Every failure is an InvalidArgument (or CountOverflow) naming the tensor index and values.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shardgather/types.h"

namespace shardgather::detail {

std::string shape_str(std::span<const std::int64_t> shape);

// Checks one tensor on its own (dtype, dims, size, strides, data); returns its bytes.
std::uint64_t check_tensor(const TensorView& t, std::size_t i);

// Checks a tensor against what a plan expects of it.
void check_tensor_matches(const TensorView& t, std::size_t i, DType dtype,
                          std::span<const std::int64_t> shape, std::uint64_t bytes);

// [lowest, highest) byte addresses a tensor's elements occupy.
struct Extent {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;
};
Extent extent_of(const TensorView& t, std::uint64_t bytes);

// An extent read (written false) or written by a call.
struct TaggedExtent {
  Extent extent;
  bool written = false;
};
// InvalidArgument when a written extent overlaps any other non-empty one. Sorts `extents`.
void check_no_overlap(std::vector<TaggedExtent>& extents);

struct LocalInput {
  std::vector<DType> dtypes;
  std::vector<Shape> shapes;
  std::uint64_t strided_bytes = 0;  // staging needed for non-contiguous inputs
};

LocalInput validate_params(std::span<const TensorView> params);

// The hint's shapes rank-major (world * n); checks its size and this rank's row.
std::vector<Shape> check_hint(std::span<const std::vector<Shape>> hint, const LocalInput& in,
                              int rank, int world);

}  // namespace shardgather::detail
