// torch's CUDA caching allocator as the library's device allocator (device_allocator.h), so that
// every CUDA result and staging buffer of a call is torch memory: counted by
// torch.cuda.memory_allocated, served from torch's cache, given back to it on the call's stream.
// No CUDA headers: the memory is an at::empty byte tensor's storage, made while the call's stream
// is torch's current stream on the tensors' device.
#pragma once

#include <c10/core/Stream.h>

namespace shardgather::python {

// Installs the allocator, process-wide (the module does at import).
void use_torch_device_allocator();

// Tells the allocator which torch stream a native stream handle is (params.cc, whenever a call
// takes torch's current stream): a started call allocates on its communicator's progress thread,
// whose torch stream is another, and the allocator makes the call's stream current there first.
void remember_torch_stream(const c10::Stream& stream);

}  // namespace shardgather::python
