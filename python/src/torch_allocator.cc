#include "torch_allocator.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "torch_tensors.h"

#include "shardgather/device_allocator.h"
#include "shardgather/errors.h"

namespace shardgather::python {
namespace {

// The streams calls took lately, by native handle. A handful are in use at once (the default
// stream, a copy stream or two): the oldest entry makes room for a new one.
class KnownStreams {
 public:
  void remember(const c10::Stream& stream) {
    const std::lock_guard<std::mutex> lock(mu_);
    for (const auto& known : streams_) {
      if (known && *known == stream) {
        return;
      }
    }
    streams_[next_++ % streams_.size()] = stream;
  }
  std::optional<c10::Stream> find(void* native, c10::DeviceIndex device) {
    const std::lock_guard<std::mutex> lock(mu_);
    for (const auto& known : streams_) {
      if (known && known->device_index() == device && native_stream(*known) == native) {
        return known;
      }
    }
    return std::nullopt;
  }

 private:
  std::mutex mu_;
  std::array<std::optional<c10::Stream>, 32> streams_{};
  std::size_t next_ = 0;
};

KnownStreams& known_streams() {
  static KnownStreams k;
  return k;
}

// Makes `device` current and `stream` (a native handle) torch's current stream on it, for a
// scope; restores both after. A handle torch was never seen to use stays as it is: the memory
// is then filed under torch's current stream (for the legacy default stream, torch's default).
class TorchStreamScope {
 public:
  TorchStreamScope(const c10::Device& device, void* stream)
      : impl_(c10::impl::getDeviceGuardImpl(c10::kCUDA)), device_(impl_->exchangeDevice(device)) {
    if (native_stream(impl_->getStream(device)) != stream) {
      if (const auto known = known_streams().find(stream, device.index())) {
        previous_ = impl_->exchangeStream(*known);
      }
    }
  }
  TorchStreamScope(const TorchStreamScope&) = delete;
  TorchStreamScope& operator=(const TorchStreamScope&) = delete;
  TorchStreamScope(TorchStreamScope&&) = delete;
  TorchStreamScope& operator=(TorchStreamScope&&) = delete;
  ~TorchStreamScope() {
    if (previous_) {
      try {
        (void)impl_->exchangeStream(*previous_);
      } catch (...) {  // NOLINT(bugprone-empty-catch): CUDA's stream guard cannot fail here
      }
    }
    impl_->uncheckedSetDevice(device_);
  }

 private:
  const c10::impl::DeviceGuardImplInterface* impl_;
  c10::Device device_;
  std::optional<c10::Stream> previous_;
};

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
    // The storage keeps the block; dropping it gives the block back to torch's cache, filed
    // under the stream it was made on.
    auto* held = new c10::Storage(block.storage());
    return {.data = static_cast<std::byte*>(held->mutable_data()),
            .release = [](std::byte* /*data*/,
                          void* context) noexcept { delete static_cast<c10::Storage*>(context); },
            .context = held};
  }
};

}  // namespace

void use_torch_device_allocator() {
  set_device_allocator(std::make_shared<TorchCachingAllocator>());
}

void remember_torch_stream(const c10::Stream& stream) { known_streams().remember(stream); }

}  // namespace shardgather::python
