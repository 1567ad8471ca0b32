#include "shardgather/types.h"

#include <string>

namespace shardgather {

std::string_view dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBool:
      return "bool";
    case DType::kUInt8:
      return "u8";
    case DType::kInt8:
      return "i8";
    case DType::kInt16:
      return "i16";
    case DType::kInt32:
      return "i32";
    case DType::kInt64:
      return "i64";
    case DType::kFloat16:
      return "f16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat32:
      return "f32";
    case DType::kFloat64:
      return "f64";
  }
  return "invalid";
}

std::string_view device_type_name(DeviceType type) noexcept {
  switch (type) {
    case DeviceType::kCpu:
      return "cpu";
    case DeviceType::kCuda:
      return "cuda";
  }
  return "invalid";
}

namespace {
thread_local void* current_stream = nullptr;
}  // namespace

void* current_cuda_stream() noexcept { return current_stream; }
void set_current_cuda_stream(void* stream) noexcept { current_stream = stream; }

std::string device_name(const Device& device) {
  switch (device.type) {
    case DeviceType::kCpu:
      return "cpu";
    case DeviceType::kCuda:
      return "cuda:" + std::to_string(device.index);
  }
  return "device type " + std::to_string(static_cast<int>(device.type));
}

}  // namespace shardgather
