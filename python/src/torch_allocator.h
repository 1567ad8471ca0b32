// torch's CUDA caching allocator as the library's device allocator (device_allocator.h), so that
// every CUDA result and staging buffer of a call is torch memory: counted by
// torch.cuda.memory_allocated, served from torch's cache, given back to it on the call's stream.
// No CUDA headers: the memory is an at::empty byte tensor's storage, made while the call's stream
// is torch's current stream on the tensors' device.
#pragma once

#include <string>

#include <c10/core/Stream.h>

#include "shardgather/errors.h"

namespace shardgather::python {

// Installs the allocator, process-wide (the module does at import).
void use_torch_device_allocator();

// Tells the allocator which torch stream a native stream handle is (params.cc, whenever a call
// takes torch's current stream): a started call allocates on its communicator's progress thread,
// whose torch stream is another, and the allocator makes the call's stream current there first.
void remember_torch_stream(const c10::Stream& stream);

// A torch stream's native handle (the cudaStream_t), without CUDA's headers: torch 2.11 has
// c10::Stream::native_handle, 2.9 does not (there only c10/cuda's CUDAStream knows it, which
// needs the CUDA toolkit's headers), so on such a torch the binding gathers CPU tensors only.
// The same rule as the torch backend's (torch_compat.h), which this layer cannot include.
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

}  // namespace shardgather::python
