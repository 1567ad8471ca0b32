// DeviceMemory over device_allocate / device_free, whichever runtime this build links
// (device_cuda.cu, device_none.cc, or the CPU tests' fake).
#include <utility>

#include "copies/device_runtime.h"

namespace shardgather::detail {

DeviceMemory::DeviceMemory(std::uint64_t bytes, int device)
    : data_(static_cast<std::byte*>(device_allocate(bytes, device))),
      size_(bytes),
      device_(device) {}

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      device_(other.device_) {}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(size_, other.size_);
  std::swap(device_, other.device_);
  return *this;
}

DeviceMemory::~DeviceMemory() { device_free(data_); }

void DeviceMemory::reserve(std::uint64_t bytes, int device) {
  if (data_ != nullptr && bytes <= size_ && device == device_) {
    return;
  }
  DeviceMemory fresh(bytes, device);
  *this = std::move(fresh);
}

}  // namespace shardgather::detail
