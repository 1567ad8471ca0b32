// The CUDA build of copies/device_runtime.h: the fused copy kernel and thin, checked wrappers
// over the CUDA runtime.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "copies/device_runtime.h"
#include <cuda_runtime.h>

#include "shardgather/errors.h"

namespace shardgather {

bool cuda_built() noexcept { return true; }

namespace detail {

namespace {

void check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) {
    return;
  }
  const std::string message = std::string(what) + ": CUDA error " + cudaGetErrorName(status) +
                              " (" + cudaGetErrorString(status) + ")";
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // not sticky: clear it so the device stays usable
    throw OutOfMemory(message);
  }
  throw CommunicationError(message);
}

cudaStream_t as_stream(void* stream) noexcept { return static_cast<cudaStream_t>(stream); }

// One unit of `width` bytes, with the widest load and store the width allows.
__device__ __forceinline__ void move_unit(std::uint64_t dst, std::uint64_t src,
                                          std::uint32_t width) {
  switch (width) {
    case 16:
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      break;
    case 8:
      *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
      break;
    case 4:
      *reinterpret_cast<unsigned*>(dst) = *reinterpret_cast<const unsigned*>(src);
      break;
    case 2:
      *reinterpret_cast<unsigned short*>(dst) = *reinterpret_cast<const unsigned short*>(src);
      break;
    default:
      *reinterpret_cast<unsigned char*>(dst) = *reinterpret_cast<const unsigned char*>(src);
      break;
  }
}

// Block b copies units [k * kCopyUnitsPerBlock, (k + 1) * kCopyUnitsPerBlock) of the
// descriptor it falls in (k = b - first_block); thread t takes every kCopyThreads-th unit, so
// a warp's accesses are adjacent. run_on_host (copy_table.cc) is the same loop on the host.
__global__ void __launch_bounds__(kCopyThreads)
    fused_copy(const CopyDesc* descs, std::size_t count) {
  const std::uint64_t block = blockIdx.x;
  const CopyDesc& d = descs[find_desc(descs, count, block)];
  const std::uint64_t base = (block - d.first_block) * kCopyUnitsPerBlock;
  const std::uint64_t units = units_of(d);
#pragma unroll
  for (unsigned i = 0; i < kCopyUnroll; ++i) {
    const std::uint64_t u = base + std::uint64_t{i} * kCopyThreads + threadIdx.x;
    if (u < units) {
      const UnitAddress a = unit_address(d, u);
      move_unit(a.dst, a.src, d.width);
    }
  }
}

// Thread t of block b takes elements b * blockDim + t, then every gridDim * blockDim-th after.
__global__ void __launch_bounds__(kCopyThreads) quant_kernel(QuantBoxDesc desc) {
  const std::int64_t step = std::int64_t{gridDim.x} * blockDim.x;
  for (std::int64_t e = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < desc.elements;
       e += step) {
    quant_element(desc, e);
  }
}

}  // namespace

namespace {

// A pool's release threshold is 0 by default: every synchronisation would hand its memory back
// to the driver, and the next call would map fresh memory. Kept instead, once per device.
void keep_pool_memory(int device) {
  static std::mutex mu;
  static std::vector<bool> kept;
  const std::lock_guard<std::mutex> lock(mu);
  const auto d = static_cast<std::size_t>(device);
  if (d < kept.size() && kept[d]) {
    return;
  }
  cudaMemPool_t pool = nullptr;
  check(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool");
  std::uint64_t keep_all = UINT64_MAX;
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all),
        "cudaMemPoolSetAttribute");
  kept.resize(std::max(kept.size(), d + 1));
  kept[d] = true;
}

}  // namespace

void* pool_allocate(std::uint64_t bytes, int device, void* stream) {
  const CurrentDevice on(device);
  keep_pool_memory(device);
  void* p = nullptr;
  check(cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, as_stream(stream)), "cudaMallocAsync");
  return p;
}

void pool_free(void* data, int device, void* stream) noexcept {
  if (data == nullptr) {
    return;
  }
  int current = 0;
  const bool switched = cudaGetDevice(&current) == cudaSuccess && current != device &&
                        cudaSetDevice(device) == cudaSuccess;
  (void)cudaFreeAsync(data, as_stream(stream));
  if (switched) {
    (void)cudaSetDevice(current);
  }
}

CurrentDevice::CurrentDevice(int device) {
  int current = 0;
  check(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    previous_ = current;
  }
}

CurrentDevice::~CurrentDevice() {
  if (previous_ >= 0) {
    (void)cudaSetDevice(previous_);
  }
}

Device device_of(const void* p) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, p);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return kCpu;
  }
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) {
    return cuda_device(attributes.device);
  }
  return kCpu;
}

void copy_async(void* dst, const void* src, std::uint64_t bytes, void* stream) {
  if (bytes == 0) {
    return;
  }
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)), "cudaMemcpyAsync");
}

void launch_copies(const CopyDesc* device_descs, std::size_t count, std::uint64_t blocks,
                   void* stream) {
  if (blocks == 0) {
    return;
  }
  if (blocks > 0x7fffffffULL) {
    throw InvalidArgument("launch_copies: " + std::to_string(blocks) +
                          " blocks exceed one launch's grid");
  }
  fused_copy<<<static_cast<unsigned>(blocks), kCopyThreads, 0, as_stream(stream)>>>(device_descs,
                                                                                    count);
  check(cudaGetLastError(), "fused_copy launch");
}

void launch_quant(const QuantBoxDesc& desc, void* stream) {
  if (desc.elements == 0) {
    return;
  }
  constexpr std::int64_t kMaxBlocks = 65536;  // then each thread takes several elements
  const std::int64_t blocks =
      std::min<std::int64_t>((desc.elements + kCopyThreads - 1) / kCopyThreads, kMaxBlocks);
  quant_kernel<<<static_cast<unsigned>(blocks), kCopyThreads, 0, as_stream(stream)>>>(desc);
  check(cudaGetLastError(), "quant_kernel launch");
}

DeviceEvent::DeviceEvent(DeviceEvent&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)) {}

DeviceEvent& DeviceEvent::operator=(DeviceEvent&& other) noexcept {
  std::swap(event_, other.event_);
  return *this;
}

DeviceEvent::~DeviceEvent() {
  if (event_ != nullptr) {
    (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  }
}

void DeviceEvent::record(void* stream) {
  if (event_ == nullptr) {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    event_ = e;
  }
  check(cudaEventRecord(static_cast<cudaEvent_t>(event_), as_stream(stream)), "cudaEventRecord");
}

void DeviceEvent::order_after(void* stream) const {
  if (event_ != nullptr) {
    check(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(event_), 0),
          "cudaStreamWaitEvent");
  }
}

DeviceStream::DeviceStream(DeviceStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

DeviceStream& DeviceStream::operator=(DeviceStream&& other) noexcept {
  std::swap(stream_, other.stream_);
  return *this;
}

DeviceStream::~DeviceStream() {
  if (stream_ != nullptr) {
    (void)cudaStreamDestroy(as_stream(stream_));
  }
}

void* DeviceStream::get(int device) {
  if (stream_ == nullptr) {
    const CurrentDevice on(device);
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    stream_ = s;
  }
  return stream_;
}

bool DeviceEvent::query() const {
  if (event_ == nullptr) {
    return true;
  }
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (status == cudaErrorNotReady) {
    return false;  // not an error: the runtime does not record it as the last error
  }
  check(status, "cudaEventQuery");
  return true;
}

}  // namespace detail
}  // namespace shardgather
