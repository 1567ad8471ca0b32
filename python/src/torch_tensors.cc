#include "torch_tensors.h"

#include <ATen/core/TensorBody.h>
#include <c10/core/TensorImpl.h>

#include "shardgather/errors.h"

namespace shardgather::python {

std::optional<DType> wire_dtype(c10::ScalarType type) noexcept {
  switch (type) {
    case c10::ScalarType::Bool:
      return DType::kBool;
    case c10::ScalarType::Byte:
      return DType::kUInt8;
    case c10::ScalarType::Char:
      return DType::kInt8;
    case c10::ScalarType::Short:
      return DType::kInt16;
    case c10::ScalarType::Int:
      return DType::kInt32;
    case c10::ScalarType::Long:
      return DType::kInt64;
    case c10::ScalarType::Half:
      return DType::kFloat16;
    case c10::ScalarType::BFloat16:
      return DType::kBFloat16;
    case c10::ScalarType::Float:
      return DType::kFloat32;
    case c10::ScalarType::Double:
      return DType::kFloat64;
    default:
      return std::nullopt;
  }
}

std::string unsupported_dtype_message(c10::ScalarType type, const std::string& what) {
  return what + " has dtype " + std::string(c10::toString(type)) +
         ", which shardgather cannot gather (bool, integer and floating types only)";
}

DType dtype_of(c10::ScalarType type, const std::string& what) {
  if (const std::optional<DType> dtype = wire_dtype(type)) {
    return *dtype;
  }
  throw InvalidArgument(unsupported_dtype_message(type, what));
}

c10::ScalarType scalar_type_of(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return c10::ScalarType::Bool;
    case DType::kUInt8:
      return c10::ScalarType::Byte;
    case DType::kInt8:
      return c10::ScalarType::Char;
    case DType::kInt16:
      return c10::ScalarType::Short;
    case DType::kInt32:
      return c10::ScalarType::Int;
    case DType::kInt64:
      return c10::ScalarType::Long;
    case DType::kFloat16:
      return c10::ScalarType::Half;
    case DType::kBFloat16:
      return c10::ScalarType::BFloat16;
    case DType::kFloat32:
      return c10::ScalarType::Float;
    case DType::kFloat64:
      return c10::ScalarType::Double;
  }
  throw InvalidArgument("invalid dtype code " + std::to_string(static_cast<int>(dtype)));
}

void set_view(const at::Tensor& t, DType dtype, TensorView& view) {
  view.data = t.data_ptr();
  view.dtype = dtype;
  view.device = t.is_cuda() ? cuda_device(t.device().index()) : kCpu;
  view.shape.assign(t.sizes().begin(), t.sizes().end());
  if (t.is_contiguous()) {
    view.strides.clear();
  } else {
    view.strides.assign(t.strides().begin(), t.strides().end());
  }
}

at::Tensor tensor_over(const c10::Storage& storage, const std::byte* base, const TensorView& view) {
  const auto type = scalar_type_of(view.dtype);
  const auto elem = static_cast<std::int64_t>(dtype_size(view.dtype));
  const auto offset = (static_cast<const std::byte*>(view.data) - base) / elem;
  // Built the way at::from_blob builds its tensor, but sharing one storage: a plain CPU or CUDA
  // TensorImpl (the constructor adds the autograd keys), no grad, no graph.
  const c10::DispatchKey key =
      view.device.type == DeviceType::kCuda ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(key), c10::scalarTypeToTypeMeta(type));
  c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(view.shape);
  impl->set_storage_offset(offset);
  return tensor;
}

}  // namespace shardgather::python
