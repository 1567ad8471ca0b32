// Element types and non-owning tensor views: the vocabulary every layer shares.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "shardgather/device.h"
#include "shardgather/export.h"

namespace shardgather {

// Element types. The numeric codes are part of the wire format (the pre-flight header and the
// per-tensor records carry them), so never renumber; append only.
enum class DType : std::uint8_t {
  kBool = 0,
  kUInt8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat16 = 6,
  kBFloat16 = 7,
  kFloat32 = 8,
  kFloat64 = 9,
};

inline constexpr int kNumDTypes = 10;

// Bytes per element; 0 for a code that is not a DType (a corrupt or foreign value).
constexpr std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBool:
    case DType::kUInt8:
    case DType::kInt8:
      return 1;
    case DType::kInt16:
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
    case DType::kFloat32:
      return 4;
    case DType::kInt64:
    case DType::kFloat64:
      return 8;
  }
  return 0;
}

constexpr bool is_valid_dtype(DType dtype) noexcept { return dtype_size(dtype) != 0; }

// "f32", "bf16", ...; "invalid" for a code that is not a DType.
SHARDGATHER_API std::string_view dtype_name(DType dtype) noexcept;

using Shape = std::vector<std::int64_t>;

// A non-owning view of a tensor on `device` (host memory unless it says otherwise). The caller
// keeps `data` alive for the duration of every call that receives the view. `strides` are in
// elements; empty means contiguous row-major. Inputs are only ever read through a view; `data`
// is non-const so that one type serves inputs and outputs. A call's views are all on one device.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kUInt8;
  Shape shape;
  Shape strides;
  Device device{};
};

// A read-only run of bytes: one piece of a rank's contribution. A send is a list of these, so a
// backend can send straight from the caller's tensors (no copy-in).
struct ConstSegment {
  const std::byte* data = nullptr;
  std::uint64_t size = 0;
};

// Where received bytes land: `count` blocks of `block` bytes, block k at data + k * stride.
// A contiguous destination is one block (count 1). Strided pieces let a gather write a shard
// straight into its place inside a full tensor sharded along any dim.
struct RecvPiece {
  std::byte* data = nullptr;
  std::uint64_t block = 0;
  std::uint64_t count = 1;
  std::uint64_t stride = 0;
};

}  // namespace shardgather
