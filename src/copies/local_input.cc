#include "copies/local_input.h"

#include <algorithm>

#include "copies/device_runtime.h"

#include "shardgather/copy.h"
#include "shardgather/errors.h"
#include "shardgather/layout.h"

namespace shardgather::detail {

std::string shape_str(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    s += (d == 0 ? "" : ", ") + std::to_string(shape[d]);
  }
  return s + "]";
}

Device call_device(std::span<const TensorView> views) noexcept {
  return views.empty() ? kCpu : views.front().device;
}

void check_device(const TensorView& t, std::size_t i, const Device& device, const char* what) {
  const auto where = [&] { return std::string(what) + " " + std::to_string(i) + ": "; };
  if (t.device != device) {
    throw InvalidArgument(where() + "on " + device_name(t.device) +
                          ", but the call's first is on " + device_name(device) +
                          " (a call's tensors are on one device)");
  }
  if (t.device.type == DeviceType::kCpu) {
    return;
  }
  if (t.device.type != DeviceType::kCuda || t.device.index < 0) {
    throw InvalidArgument(where() + "unknown device " + device_name(t.device));
  }
  if (!cuda_built()) {
    throw InvalidArgument(where() + "on " + device_name(t.device) +
                          ": shardgather was built without CUDA (SHARDGATHER_WITH_CUDA=OFF)");
  }
  // An empty view's pointer is never read, and may lie one past its storage's end.
  const bool empty =
      std::any_of(t.shape.begin(), t.shape.end(), [](std::int64_t e) { return e == 0; });
  if (t.data != nullptr && !empty) {
    const Device actual = device_of(t.data);
    if (actual != t.device) {
      throw InvalidArgument(where() + "the view says " + device_name(t.device) +
                            " but its memory is on " + device_name(actual));
    }
  }
}

std::uint64_t check_tensor(const TensorView& t, std::size_t i) {
  // The prefix is built only on failure: this runs once per tensor per call.
  const auto where = [i] { return "tensor " + std::to_string(i) + ": "; };
  std::uint64_t bytes = 0;
  try {
    bytes = checked_nbytes(t.dtype, t.shape);
  } catch (const CountOverflow& e) {
    throw CountOverflow(where() + e.what());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(where() + e.what());
  }
  if (!t.strides.empty() && t.strides.size() != t.shape.size()) {
    throw InvalidArgument(where() + std::to_string(t.strides.size()) + " strides for " +
                          std::to_string(t.shape.size()) + " dims");
  }
  if (t.data == nullptr && bytes != 0) {
    throw InvalidArgument(where() + "null data pointer with " + std::to_string(bytes) +
                          " bytes of shape " + shape_str(t.shape));
  }
  return bytes;
}

void check_tensor_matches(const TensorView& t, std::size_t i, DType dtype,
                          std::span<const std::int64_t> shape, std::uint64_t bytes) {
  if (t.dtype != dtype) {
    throw InvalidArgument("tensor " + std::to_string(i) + ": dtype " +
                          std::string(dtype_name(t.dtype)) + ", the plan has " +
                          std::string(dtype_name(dtype)));
  }
  if (!std::equal(t.shape.begin(), t.shape.end(), shape.begin(), shape.end())) {
    throw InvalidArgument("tensor " + std::to_string(i) + ": shape " + shape_str(t.shape) +
                          ", the plan has " + shape_str(shape));
  }
  if (!t.strides.empty() && t.strides.size() != t.shape.size()) {
    throw InvalidArgument("tensor " + std::to_string(i) + ": " + std::to_string(t.strides.size()) +
                          " strides for " + std::to_string(t.shape.size()) + " dims");
  }
  if (t.data == nullptr && bytes != 0) {
    throw InvalidArgument("tensor " + std::to_string(i) + ": null data pointer with " +
                          std::to_string(bytes) + " bytes");
  }
}

Extent extent_of(const TensorView& t, std::uint64_t bytes) {
  const auto base = reinterpret_cast<std::uintptr_t>(t.data);
  if (bytes == 0) {
    return {base, base};
  }
  if (t.strides.empty()) {
    return {base, base + bytes};
  }
  const auto elem = static_cast<std::int64_t>(dtype_size(t.dtype));
  std::int64_t lo = 0;
  std::int64_t hi = 0;
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    const std::int64_t span = (t.shape[d] - 1) * t.strides[d] * elem;
    (span < 0 ? lo : hi) += span;
  }
  return {static_cast<std::uintptr_t>(static_cast<std::int64_t>(base) + lo),
          static_cast<std::uintptr_t>(static_cast<std::int64_t>(base) + hi + elem)};
}

LocalInput validate_params(std::span<const TensorView> params) {
  LocalInput in;
  in.device = call_device(params);
  in.dtypes.reserve(params.size());
  in.shapes.reserve(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::uint64_t bytes = check_tensor(params[i], i);
    check_device(params[i], i, in.device);
    if (!is_contiguous(params[i])) {
      in.strided_bytes += bytes;
    }
    in.dtypes.push_back(params[i].dtype);
    in.shapes.push_back(params[i].shape);
  }
  return in;
}

std::vector<Shape> check_hint(std::span<const std::vector<Shape>> hint, const LocalInput& in,
                              int rank, int world) {
  const std::size_t n = in.shapes.size();
  if (hint.size() != static_cast<std::size_t>(world)) {
    throw InvalidArgument("shapes hint has " + std::to_string(hint.size()) +
                          " rows for world size " + std::to_string(world));
  }
  std::vector<Shape> flat;
  flat.reserve(hint.size() * n);
  for (std::size_t r = 0; r < hint.size(); ++r) {
    if (hint[r].size() != n) {
      throw InvalidArgument("shapes hint row " + std::to_string(r) + " has " +
                            std::to_string(hint[r].size()) + " shapes, this rank passes " +
                            std::to_string(n) + " tensors");
    }
    flat.insert(flat.end(), hint[r].begin(), hint[r].end());
  }
  const auto& row = hint[static_cast<std::size_t>(rank)];
  for (std::size_t i = 0; i < n; ++i) {
    if (row[i] != in.shapes[i]) {
      throw InvalidArgument("tensor " + std::to_string(i) + ": shapes hint for rank " +
                            std::to_string(rank) + " says " + shape_str(row[i]) +
                            " but the tensor is " + shape_str(in.shapes[i]));
    }
  }
  return flat;
}

void check_no_overlap(std::vector<TaggedExtent>& extents) {
  std::sort(extents.begin(), extents.end(),
            [](const auto& a, const auto& b) { return a.extent.begin < b.extent.begin; });
  std::uintptr_t write_end = 0;  // end of the furthest written extent so far
  std::uintptr_t any_end = 0;    // end of the furthest extent so far
  for (const TaggedExtent& e : extents) {
    if (e.extent.begin == e.extent.end) {
      continue;
    }
    if (e.extent.begin < write_end || (e.written && e.extent.begin < any_end)) {
      throw InvalidArgument(
          "aliasing: an output overlaps a shard or another output (in-place unshard is not "
          "supported; keep shards and full tensors apart)");
    }
    any_end = std::max(any_end, e.extent.end);
    if (e.written) {
      write_end = std::max(write_end, e.extent.end);
    }
  }
}

void check_views_apart(std::vector<ViewExtent>& views) {
  std::sort(views.begin(), views.end(),
            [](const auto& a, const auto& b) { return a.extent.begin < b.extent.begin; });
  for (std::size_t a = 0; a < views.size(); ++a) {
    const ViewExtent& va = views[a];
    if (va.extent.begin == va.extent.end) {
      continue;
    }
    for (std::size_t b = a + 1; b < views.size() && views[b].extent.begin < va.extent.end; ++b) {
      const ViewExtent& vb = views[b];
      if (vb.extent.begin == vb.extent.end || (!va.written && !vb.written) ||
          (va.strided && vb.strided)) {
        continue;
      }
      throw InvalidArgument("aliasing: " + std::string(va.side) + " " + std::to_string(va.index) +
                            " and " + vb.side + " " + std::to_string(vb.index) +
                            " overlap in memory (a destination must not share bytes with a "
                            "source or another destination)");
    }
  }
}

}  // namespace shardgather::detail
