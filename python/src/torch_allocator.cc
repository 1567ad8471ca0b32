#include "torch_allocator.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "torch_tensors.h"

#include "shardgather/errors.h"
#include "shardgather/torch.h"

namespace shardgather::python {
namespace {

// A block's release: drops the storage handle that kept the block (tensors over the same storage
// keep it alive after).
void release_torch_block(std::byte* /*data*/, void* context) noexcept {
  delete static_cast<c10::Storage*>(context);
}

class TorchCachingAllocator final : public DeviceAllocator {
 public:
  DeviceAllocation allocate(std::uint64_t bytes, const Device& device, void* stream) override {
    const c10::Device dev = torch_device(device);
    at::Tensor block;
    try {
      const TorchStreamScope on(dev, stream);
      block = at::empty({static_cast<std::int64_t>(bytes)},
                        at::TensorOptions().dtype(at::kByte).device(dev));
    } catch (const c10::OutOfMemoryError& e) {
      throw OutOfMemory("torch's CUDA allocator: " + std::string(e.what_without_backtrace()));
    } catch (const c10::Error& e) {
      throw CommunicationError("torch's CUDA allocator: " +
                               std::string(e.what_without_backtrace()));
    }
    // The storage keeps the block; dropping the last handle gives the block back to torch's
    // cache, filed under the stream it was made on.
    auto* held = new c10::Storage(block.storage());
    return {.data = static_cast<std::byte*>(held->mutable_data()),
            .release = &release_torch_block,
            .context = held};
  }
};

}  // namespace

void use_torch_device_allocator() {
  set_device_allocator(std::make_shared<TorchCachingAllocator>());
}

std::optional<c10::Storage> torch_storage_of(const DeviceAllocation& memory) {
  if (memory.release != &release_torch_block) {
    return std::nullopt;
  }
  return *static_cast<const c10::Storage*>(memory.context);
}

}  // namespace shardgather::python
