// Validation of this rank's tensors: the local half of the "one validated entry path".
// Every failure is an InvalidArgument (or CountOverflow) naming the tensor index and values.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shardgather/device.h"
#include "shardgather/types.h"

namespace shardgather::detail {

std::string shape_str(std::span<const std::int64_t> shape);

// Checks one tensor on its own (dtype, dims, size, strides, data); returns its bytes.
std::uint64_t check_tensor(const TensorView& t, std::size_t i);

// The device a call's views are on: the first one's (the host when there are none).
Device call_device(std::span<const TensorView> views) noexcept;

// InvalidArgument, naming `what` i ("tensor 3", "output 0"), unless the view is on `device`, the
// build can reach it (a CUDA view needs SHARDGATHER_WITH_CUDA) and, for a CUDA view, its memory
// really is on the device it names (a host pointer passed as a CUDA view would fault the kernel).
void check_device(const TensorView& t, std::size_t i, const Device& device,
                  const char* what = "tensor");

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

// A view's extent for check_views_apart; `side` and `index` name it ("destination", 3).
struct ViewExtent {
  Extent extent;
  bool written = false;
  bool strided = false;
  const char* side = "";
  std::size_t index = 0;
};
// InvalidArgument naming both views when a written view's extent overlaps another's, unless both
// are strided: interleaved views of one tensor (a fused parameter's column blocks) share an
// extent without sharing an element, so there the caller's contract stands. Sorts `views`.
void check_views_apart(std::vector<ViewExtent>& views);

struct LocalInput {
  Device device;  // of every tensor
  std::vector<DType> dtypes;
  std::vector<Shape> shapes;
  std::uint64_t strided_bytes = 0;  // staging needed for non-contiguous inputs
};

LocalInput validate_params(std::span<const TensorView> params);

// The hint's shapes rank-major (world * n); checks its size and this rank's row.
std::vector<Shape> check_hint(std::span<const std::vector<Shape>> hint, const LocalInput& in,
                              int rank, int world);

}  // namespace shardgather::detail
