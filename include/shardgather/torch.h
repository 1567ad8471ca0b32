// The torch backend: a Communicator over a torch.distributed ProcessGroup (c10d's C++ API), so
// that a whole call runs in C++ with the GIL released. It needs torch's headers and libraries,
// so it is compiled into the Python extension, not into libshardgather; the transport's contract
// (ordering, abort, memory, deadlines, Gloo point to point) is stated in
// src/transport/backends/torch/process_group.h.
//
// Threading: as for every communicator, one driving thread at a time; abort() from any.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "shardgather/communicator.h"
#include "shardgather/errors.h"

namespace shardgather {

struct TorchGroupOptions {
  // Use the point-to-point gather where the group supports it (Gloo, host memory).
  bool p2p = true;
  // When every rank is on this host, exchange headers, small all_gathers and barriers through
  // shared memory (the host mailbox) instead of the group.
  bool host_mailbox = true;
  // Construction is collective over the group (the host count, the mailbox) and bounded by this.
  std::chrono::milliseconds setup_timeout = kDefaultTimeout;
};

// Collective over `group`. `device`: where host bytes are staged on a group without a host
// backend (NCCL), and the device of the group's device collectives.
std::unique_ptr<Communicator> make_torch_communicator(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::Device device,
    const TorchGroupOptions& options = {});

// A torch stream's native handle (the cudaStream_t), without CUDA's headers: torch 2.11 has
// c10::Stream::native_handle, 2.9 does not (there only c10/cuda's CUDAStream knows it, which
// needs the CUDA toolkit's headers), so on such a torch CUDA tensors raise InvalidArgument and
// the binding gathers CPU tensors only.
template <typename Stream>
void* native_stream(const Stream& stream) {
  if constexpr (requires { stream.native_handle(); }) {
    return stream.native_handle();
  } else {
    throw InvalidArgument(std::string("CUDA tensors need torch >= 2.11 (c10::Stream::"
                                      "native_handle); shardgather was built against torch ") +
                          SHARDGATHER_TORCH_VERSION);
  }
}

// Torch's current stream on CUDA device `index`, as a native handle (the stream a call on that
// device's tensors enqueues on, as torch.distributed's do).
inline void* torch_current_stream(c10::DeviceIndex index) {
  return native_stream(
      c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(c10::Device(c10::kCUDA, index)));
}

// Makes `device` current and `stream` (a native handle) torch's current stream on it, for a
// scope; restores both after. Work torch enqueues in the scope (c10d collectives, tensor copies,
// allocations of the caching allocator) goes on `stream`. The handle becomes a torch stream the
// way torch's own getStreamFromExternal makes one (its id is the handle; nullptr is the default
// stream); the caching allocator files blocks by the handle, so a stream torch knows under
// another id is the same stream to it. Through c10's device-guard registry: no CUDA headers.
class TorchStreamScope {
 public:
  TorchStreamScope(const c10::Device& device, void* stream)
      : impl_(c10::impl::getDeviceGuardImpl(c10::kCUDA)), device_(impl_->exchangeDevice(device)) {
    // cudaStreamLegacy (0x1) names the legacy default stream, torch's id 0 (its low bit would
    // read as one of torch's own stream ids).
    void* const wanted = reinterpret_cast<std::uintptr_t>(stream) == 1 ? nullptr : stream;
    try {
      if (native_stream(impl_->getStream(device)) != wanted) {
        previous_ = impl_->exchangeStream(
            c10::Stream(c10::Stream::UNSAFE, device, reinterpret_cast<c10::StreamId>(wanted)));
      }
    } catch (...) {
      impl_->uncheckedSetDevice(device_);
      throw;
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

// Whether small exchanges of a communicator this backend made go through the host mailbox
// (false for any other communicator).
bool torch_uses_host_mailbox(const Communicator& comm) noexcept;

}  // namespace shardgather
