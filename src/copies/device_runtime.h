// The device half of the copies layer: device memory, stream-ordered copies and the fused copy
// kernel. With SHARDGATHER_WITH_CUDA these are CUDA runtime calls (device_cuda.cu); without it
// every function raises InvalidArgument saying the build has no CUDA (device_none.cc), so the
// layers above need no #if.
//
// Streams are opaque (a cudaStream_t); nullptr is the device's legacy default stream. Every
// function here enqueues on the stream and returns without waiting, except sync_stream and the
// allocation calls. CUDA failures raise OutOfMemory (allocation) or CommunicationError (any
// other: a sticky device error leaves the device unusable, as a failed backend does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "copies/copy_desc.h"

#include "shardgather/device.h"

namespace shardgather::detail {

// Owning device memory on one device. Movable, not copyable; freeing waits for nothing (free
// only what no enqueued work still touches: cudaFree synchronises the device itself).
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(std::uint64_t bytes, int device);
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  ~DeviceMemory();

  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  // Makes room for `bytes` (keeps the memory when it is large enough; the old contents are lost
  // otherwise).
  void reserve(std::uint64_t bytes, int device);

 private:
  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
  int device_ = 0;
};

// Frees memory from device_allocate (the deleter of a device AlignedBuffer).
void device_free(void* data) noexcept;
// `bytes` of memory on `device`, 256-byte aligned; OutOfMemory on failure.
void* device_allocate(std::uint64_t bytes, int device);

// Makes `device` current on the calling thread (CUDA's per-thread current device) for a scope,
// and restores the caller's current device after it: a gather on cuda:1 must not move the
// caller's later allocations there.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device);
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  CurrentDevice(CurrentDevice&&) = delete;
  CurrentDevice& operator=(CurrentDevice&&) = delete;
  ~CurrentDevice();

 private:
  int previous_ = -1;  // -1: nothing to restore
};

// The device the memory at `p` is on: kCpu for memory CUDA does not know (plain host memory)
// or host memory it maps, so a caller's claim about a view can be checked.
Device device_of(const void* p);

// `bytes` from src to dst on `stream`; either side may be host or device memory.
void copy_async(void* dst, const void* src, std::uint64_t bytes, void* stream);

// One launch of the fused copy kernel over `count` descriptors already in device memory,
// `blocks` blocks in all (CopyTable::blocks()). Launches nothing when blocks is 0.
void launch_copies(const CopyDesc* device_descs, std::size_t count, std::uint64_t blocks,
                   void* stream);

// Waits until everything enqueued on `stream` has run; raises what it raised.
void sync_stream(void* stream);

}  // namespace shardgather::detail
