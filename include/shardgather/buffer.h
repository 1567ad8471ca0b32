// Owning memory for gathered results: the library's one output allocation (host memory, or
// device memory for a call on device tensors, from the device allocator: device_allocator.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "shardgather/device.h"
#include "shardgather/device_allocator.h"
#include "shardgather/export.h"

namespace shardgather {

// 64-byte aligned memory. Owning, movable, not copyable.
class SHARDGATHER_API AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Host memory. OutOfMemory when the allocation fails.
  explicit AlignedBuffer(std::uint64_t bytes);
  // Takes `memory` (`bytes` bytes on `device`), given back through its release on destruction.
  AlignedBuffer(DeviceAllocation memory, std::uint64_t bytes, Device device) noexcept;
  [[nodiscard]] std::byte* data() const noexcept { return data_.get(); }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  [[nodiscard]] Device device() const noexcept { return device_; }
  // The memory and how it will be given back (release null for host memory from std::free's
  // side): an embedder recognises its own allocator's blocks by their release.
  [[nodiscard]] DeviceAllocation allocation() const noexcept {
    return {data_.get(), data_.get_deleter().release, data_.get_deleter().context};
  }

 private:
  struct Free {
    // Null (value-initialised): std::free.
    void (*release)(std::byte* data, void* context) noexcept;
    void* context;
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte, Free> data_;
  std::uint64_t size_ = 0;
  Device device_{};
};

}  // namespace shardgather
