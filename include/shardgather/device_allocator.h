// Where a call's device memory comes from: its CUDA outputs and its device staging (a plan's
// scratch, the packed send, the gathered buffer, the copy tables). An embedder hands the library
// its own allocator (the Python binding: torch's caching allocator, so that every CUDA result is
// ordinary torch memory on the call's stream, counted in torch's statistics and cache). Without
// one, memory comes from the device's default stream-ordered pool (cudaMallocAsync /
// cudaFreeAsync): the library never calls cudaMalloc or cudaFree per call, which would
// synchronise the device.
//
// Stream-ordered contract: memory allocated for `stream` is used only by work enqueued on that
// stream (and by the host before anything is enqueued), and is given back, through `release`,
// after the last work that uses it was enqueued there, possibly before that work has run. An
// allocator may hand it out again only to work ordered after that (the same stream, as torch's
// caching allocator and CUDA's pools do). The default pool gives memory back on the stream it
// was allocated for, so that stream must outlive it: a plan keeps its device scratch for the
// stream of its latest execution until it is destroyed (or runs on another stream).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "shardgather/device.h"
#include "shardgather/export.h"

namespace shardgather {

// One block of device memory and how to give it back.
struct DeviceAllocation {
  std::byte* data = nullptr;
  // Called once with `data` and `context`, from whichever thread ends the memory's use; must not
  // throw. Null: nothing to give back.
  void (*release)(std::byte* data, void* context) noexcept = nullptr;
  void* context = nullptr;
};

// Thread-safe: calls may come from any thread (the calling thread, a communicator's progress
// thread) at once.
class SHARDGATHER_API DeviceAllocator {
 public:
  DeviceAllocator() = default;
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;
  DeviceAllocator(DeviceAllocator&&) = delete;
  DeviceAllocator& operator=(DeviceAllocator&&) = delete;
  virtual ~DeviceAllocator();
  // `bytes` (> 0) on `device`, 256-byte aligned, for work on `stream` (a cudaStream_t; nullptr
  // the legacy default stream). Raises OutOfMemory (or any shardgather Error) when it cannot;
  // the call then fails on every rank, as a failed local check does.
  virtual DeviceAllocation allocate(std::uint64_t bytes, const Device& device, void* stream) = 0;
};

// The allocator of every later call's device memory, process-wide (nullptr: the default pool).
// Memory already handed out is given back through the release it came with, so whatever that
// release needs (the allocator, if its context points there) must outlive the memory.
SHARDGATHER_API void set_device_allocator(std::shared_ptr<DeviceAllocator> allocator);
// The one in use (the default pool's when none was set).
SHARDGATHER_API std::shared_ptr<DeviceAllocator> device_allocator();

}  // namespace shardgather
