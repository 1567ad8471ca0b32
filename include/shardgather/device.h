// Where a tensor's memory lives. Part of the vocabulary: a TensorView names its device, and a
// call's tensors must all be on one device (checked on every rank, docs/gpu.md).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

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

// "cpu", "cuda"; "invalid" for a code that is not a DeviceType.
SHARDGATHER_API std::string_view device_type_name(DeviceType type) noexcept;
// "cpu", "cuda:0", ...
SHARDGATHER_API std::string device_name(const Device& device);

// Whether this build has the CUDA path (SHARDGATHER_WITH_CUDA): without it every call on a CUDA
// tensor raises InvalidArgument on every rank.
SHARDGATHER_API bool cuda_built() noexcept;

// The CUDA stream (a cudaStream_t) that this thread's calls on CUDA tensors enqueue on, as
// PyTorch's "current stream"; nullptr (the default) is the device's legacy default stream. An
// operation started asynchronously (start_*) runs on the stream current when it was started.
// Thread-local; never dereferenced on a host-only call.
SHARDGATHER_API void* current_cuda_stream() noexcept;
SHARDGATHER_API void set_current_cuda_stream(void* stream) noexcept;

// Sets the current stream for a scope and restores the previous one.
class CudaStreamGuard {
 public:
  explicit CudaStreamGuard(void* stream) noexcept : previous_(current_cuda_stream()) {
    set_current_cuda_stream(stream);
  }
  CudaStreamGuard(const CudaStreamGuard&) = delete;
  CudaStreamGuard& operator=(const CudaStreamGuard&) = delete;
  CudaStreamGuard(CudaStreamGuard&&) = delete;
  CudaStreamGuard& operator=(CudaStreamGuard&&) = delete;
  ~CudaStreamGuard() { set_current_cuda_stream(previous_); }

 private:
  void* previous_;
};

}  // namespace shardgather
