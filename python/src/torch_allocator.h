// torch's CUDA caching allocator as the library's device allocator (device_allocator.h), so that
// every CUDA result and staging buffer of a call is torch memory: counted by
// torch.cuda.memory_allocated, served from torch's cache, given back to it on the call's stream.
// No CUDA headers: the memory is an at::empty byte tensor's storage, made while the call's stream
// is torch's current stream on the tensors' device (a started call allocates on a progress
// thread, where the call's stream is made current for the allocation).
#pragma once

#include <optional>

#include <c10/core/Storage.h>

#include "shardgather/device_allocator.h"

namespace shardgather::python {

// Installs the allocator, process-wide (the module does at import).
void use_torch_device_allocator();

// The torch storage of a block this allocator gave (nullopt for any other memory), so that
// results are tensors over torch's own storage: record_stream and torch's statistics see them.
std::optional<c10::Storage> torch_storage_of(const DeviceAllocation& memory);

}  // namespace shardgather::python
