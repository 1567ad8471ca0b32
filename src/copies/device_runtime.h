// The device half of the copies layer: device memory, stream-ordered copies and the fused copy
// kernel. With SHARDGATHER_WITH_CUDA these are CUDA runtime calls (device_cuda.cu); without it
// every function raises InvalidArgument saying the build has no CUDA (device_none.cc), so the
// layers above need no #if.
//
// Streams are opaque (a cudaStream_t); nullptr is the device's legacy default stream. Every
// function here enqueues on the stream and returns without waiting (the host looks at the
// device's progress only through DeviceEvent::query, and never blocks on a stream). CUDA
// failures raise OutOfMemory (allocation) or CommunicationError (any other: a sticky device error
// leaves the device unusable, as a failed backend does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "copies/copy_desc.h"
#include "copies/quant_desc.h"

#include "shardgather/device.h"
#include "shardgather/device_allocator.h"

namespace shardgather::detail {

// Owning device memory on one device, from device_allocator() (device_allocator.h), for work on
// one stream. Movable, not copyable; giving it back is stream-ordered (the allocator's release),
// so it may happen while work enqueued on that stream still uses it.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(std::uint64_t bytes, int device, void* stream);
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  ~DeviceMemory();

  [[nodiscard]] std::byte* data() const noexcept { return memory_.data; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] void* stream() const noexcept { return stream_; }
  // Makes room for `bytes` on `device` for work on `stream`: keeps the memory when it is large
  // enough and was allocated for that device and stream, else gives it back and allocates anew
  // (the old contents are lost). Returns whether it allocated.
  bool reserve(std::uint64_t bytes, int device, void* stream);
  // Hands the memory over (to an AlignedBuffer); this is empty afterwards.
  [[nodiscard]] DeviceAllocation release() noexcept;

 private:
  DeviceAllocation memory_{};
  std::uint64_t size_ = 0;
  int device_ = 0;
  void* stream_ = nullptr;
};

// The default allocator's runtime calls: stream-ordered memory from `device`'s default pool
// (cudaMallocAsync, 256-byte aligned; OutOfMemory on failure; the pool keeps what is given back
// instead of returning it to the driver at every synchronisation) and its release
// (cudaFreeAsync on `stream`, with `device` current for the legacy default stream's sake).
void* pool_allocate(std::uint64_t bytes, int device, void* stream);
void pool_free(void* data, int device, void* stream) noexcept;

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

// One launch of the quantizer kernel over the box `desc` describes (every pointer in it device
// memory): quant_element for each of its elements. Launches nothing for an empty box.
void launch_quant(const QuantBoxDesc& desc, void* stream);

// A stream of the library's own on one device (cudaStreamNonBlocking: no implicit ordering with
// the legacy default stream), for work that must queue behind nobody else's: created at the first
// get(), destroyed with the object (cudaStreamDestroy lets what it holds finish). Movable, not
// copyable; one thread uses it at a time.
class DeviceStream {
 public:
  DeviceStream() = default;
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;
  DeviceStream(DeviceStream&& other) noexcept;
  DeviceStream& operator=(DeviceStream&& other) noexcept;
  ~DeviceStream();

  // The stream (a cudaStream_t), created on `device` the first time.
  void* get(int device);

 private:
  void* stream_ = nullptr;
};

// A CUDA event without timing, for ordering one stream after another's work without the host
// waiting. Created at its first record, on the device current then; destroyed with the object.
// Movable, not copyable. One thread records it; any thread may make a stream wait on it once
// the record has been enqueued (the caller orders the two on the host).
class DeviceEvent {
 public:
  DeviceEvent() = default;
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  DeviceEvent(DeviceEvent&& other) noexcept;
  DeviceEvent& operator=(DeviceEvent&& other) noexcept;
  ~DeviceEvent();

  // Marks the point `stream` has reached: what is enqueued on it so far.
  void record(void* stream);
  // Work enqueued on `stream` after this runs after the work the latest record marked (nothing,
  // if it was never recorded).
  void order_after(void* stream) const;
  // Whether the device has run the work the latest record marked (true if never recorded); does
  // not wait. Raises what that work raised.
  [[nodiscard]] bool query() const;

 private:
  void* event_ = nullptr;  // a cudaEvent_t
};

}  // namespace shardgather::detail
