// Conversions between torch tensors and the library's non-owning TensorViews, and the way a
// gathered buffer becomes torch tensors: the bytes are adopted as one CPU storage whose deleter
// owns the buffer, and every result tensor is a view of that storage. The buffer therefore
// lives exactly as long as the last result tensor (no copy-out, no leak).
//
// Threading: nothing here touches Python objects; everything may run without the GIL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <ATen/Tensor.h>
#include <c10/core/Storage.h>

#include "shardgather/types.h"

namespace shardgather::python {

// The wire dtype for a torch scalar type; throws InvalidArgument naming `what` (for example
// "params[3]") for types with no wire code (complex, quantized, ...).
DType dtype_of(c10::ScalarType type, const std::string& what);
// The same without throwing: nullopt for types with no wire code.
std::optional<DType> wire_dtype(c10::ScalarType type) noexcept;
// The message dtype_of throws for an unsupported `type`.
std::string unsupported_dtype_message(c10::ScalarType type, const std::string& what);
c10::ScalarType scalar_type_of(DType dtype);

// Fills `view` with a CPU, strided tensor of wire type `dtype` (from dtype_of), reusing its shape
// and stride storage; `data` already includes the storage offset. The caller keeps `t` alive
// while the view is used.
void set_view(const at::Tensor& t, DType dtype, TensorView& view);

// The torch device of a shardgather device.
inline c10::Device torch_device(const Device& device) {
  return device.type == DeviceType::kCuda
             ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device.index))
             : c10::Device(c10::kCPU);
}

// Adopts `bytes` bytes at `data` (on `device`) as a storage; destroying the storage destroys
// `owner`. `owner` must own the memory at `data` (or be the only thing keeping it alive).
template <typename Owner>
c10::Storage adopt_storage(std::unique_ptr<Owner> owner, std::byte* data, std::uint64_t bytes,
                           const Device& device = kCpu) {
  c10::DataPtr ptr(
      data, owner.get(), [](void* ctx) { delete static_cast<Owner*>(ctx); }, torch_device(device));
  owner.release();  // now owned by the DataPtr's context
  return c10::Storage(c10::Storage::use_byte_size_t(), static_cast<std::size_t>(bytes),
                      std::move(ptr), /*allocator=*/nullptr, /*resizable=*/false);
}

// A tensor of `view`'s dtype, shape and strides over `storage`, whose data starts at `base`.
// `view.data` must lie inside the storage at a multiple of the element size from `base`.
at::Tensor tensor_over(const c10::Storage& storage, const std::byte* base, const TensorView& view);

}  // namespace shardgather::python
