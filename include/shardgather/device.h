// Where a tensor's memory lives. Part of the vocabulary: a TensorView names its device, and a
// call's tensors must all be on one device (checked on every rank, docs/gpu.md).
#pragma once

#include <cstdint>
#include <string>

#include "shardgather/export.h"

namespace shardgather {

// The codes travel in the pre-flight header (two ranks gathering from different kinds of memory
// is a disagreement), so never renumber; append only.
enum class DeviceType : std::uint8_t {
  kCpu = 0,
  kCuda = 1,
};

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;  // the CUDA device ordinal; 0 for the host

  friend bool operator==(const Device&, const Device&) = default;
};

inline constexpr Device kCpu{};
inline Device cuda_device(int index) noexcept { return {DeviceType::kCuda, index}; }

// "cpu", "cuda:0", ...
SHARDGATHER_API std::string device_name(const Device& device);

// Whether this build has the CUDA path (SHARDGATHER_WITH_CUDA): without it every call on a CUDA
// tensor raises InvalidArgument on every rank.
SHARDGATHER_API bool cuda_built() noexcept;

}  // namespace shardgather
