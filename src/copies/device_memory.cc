// The device allocator in use (device_allocator.h), its default over the runtime's stream-ordered
// pool (device_cuda.cu, device_none.cc, or the CPU tests' fake), and DeviceMemory over it.
#include <memory>
#include <mutex>
#include <utility>

#include "copies/device_runtime.h"

namespace shardgather {

DeviceAllocator::~DeviceAllocator() = default;

namespace detail {
namespace {

// The pool takes memory back on the stream it was allocated for, on its device: both travel as
// the release's context.
struct PoolBlock {
  int device;
  void* stream;
};

class PoolAllocator final : public DeviceAllocator {
 public:
  DeviceAllocation allocate(std::uint64_t bytes, const Device& device, void* stream) override {
    auto block = std::make_unique<PoolBlock>(PoolBlock{device.index, stream});
    auto* data = static_cast<std::byte*>(pool_allocate(bytes, device.index, stream));
    return {.data = data,
            .release =
                [](std::byte* p, void* context) noexcept {
                  const std::unique_ptr<PoolBlock> b(static_cast<PoolBlock*>(context));
                  pool_free(p, b->device, b->stream);
                },
            .context = block.release()};
  }
};

struct Installed {
  std::mutex mu;
  std::shared_ptr<DeviceAllocator> allocator;  // null: the pool
};

Installed& installed() {
  static Installed i;
  return i;
}

std::shared_ptr<DeviceAllocator> pool_allocator() {
  static const std::shared_ptr<DeviceAllocator> pool = std::make_shared<PoolAllocator>();
  return pool;
}

}  // namespace

DeviceMemory::DeviceMemory(std::uint64_t bytes, int device, void* stream)
    : memory_(device_allocator()->allocate(bytes == 0 ? 1 : bytes, cuda_device(device), stream)),
      size_(bytes),
      device_(device),
      stream_(stream) {}

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : memory_(std::exchange(other.memory_, {})),
      size_(std::exchange(other.size_, 0)),
      device_(other.device_),
      stream_(other.stream_) {}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  std::swap(memory_, other.memory_);
  std::swap(size_, other.size_);
  std::swap(device_, other.device_);
  std::swap(stream_, other.stream_);
  return *this;
}

DeviceMemory::~DeviceMemory() {
  if (memory_.data != nullptr && memory_.release != nullptr) {
    memory_.release(memory_.data, memory_.context);
  }
}

bool DeviceMemory::reserve(std::uint64_t bytes, int device, void* stream) {
  if (memory_.data != nullptr && bytes <= size_ && device == device_ && stream == stream_) {
    return false;
  }
  // Given back first, on its own stream: the pool may then hand the same bytes out again.
  *this = DeviceMemory();
  *this = DeviceMemory(bytes, device, stream);
  return true;
}

DeviceAllocation DeviceMemory::release() noexcept {
  size_ = 0;
  return std::exchange(memory_, {});
}

}  // namespace detail

void set_device_allocator(std::shared_ptr<DeviceAllocator> allocator) {
  detail::Installed& i = detail::installed();
  const std::lock_guard<std::mutex> lock(i.mu);
  i.allocator = std::move(allocator);
}

std::shared_ptr<DeviceAllocator> device_allocator() {
  detail::Installed& i = detail::installed();
  {
    const std::lock_guard<std::mutex> lock(i.mu);
    if (i.allocator) {
      return i.allocator;
    }
  }
  return detail::pool_allocator();
}

}  // namespace shardgather
