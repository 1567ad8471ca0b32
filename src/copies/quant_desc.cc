#include "copies/quant_desc.h"

#include <string>

#include "copies/box_runs.h"

#include "shardgather/errors.h"

namespace shardgather::detail {

namespace {

QuantElement element_of(QuantStep step, DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return QuantElement::kF32;
    case DType::kBFloat16:
      return QuantElement::kBf16;
    case DType::kFloat16:
      if (step != QuantStep::kDequantize) {
        return QuantElement::kF16;
      }
      break;
    default:
      break;
  }
  throw InvalidArgument(
      std::string(step == QuantStep::kDequantize ? "dequantize" : "quantize") +
      ": a box of dtype " + std::string(dtype_name(dtype)) +
      (step == QuantStep::kDequantize ? " (f32 or bf16 only)" : " (f32, bf16 or f16 only)"));
}

}  // namespace

QuantBoxDesc quant_box_desc(QuantStep step, const QuantGrid& grid, const TensorView& box,
                            std::span<const std::int64_t> offset, std::byte* codes, void* scales) {
  check_quant_box(grid, box, offset);
  const std::size_t ndim = box.shape.size();
  if (ndim > static_cast<std::size_t>(kQuantMaxDims)) {
    throw InvalidArgument("quantize: a device box of " + std::to_string(ndim) + " dims (at most " +
                          std::to_string(kQuantMaxDims) + ")");
  }
  QuantBoxDesc d;
  d.step = step;
  d.element = element_of(step, box.dtype);
  d.mxfp8 = grid.format == QuantFormat::kMxfp8;
  d.ndim = static_cast<std::int32_t>(ndim);
  d.block_rows = grid.block_rows;
  d.block_cols = grid.block_cols;
  d.scale_cols = grid.scale_cols();
  d.view = box.data;
  d.codes = reinterpret_cast<std::uint8_t*>(codes);
  d.scales = scales;
  Shape strides;
  resolve_strides(box.shape, box.strides, strides);
  d.elements = 1;
  std::int64_t rows = 1;
  for (std::size_t k = ndim; k-- > 0;) {
    d.shape[k] = box.shape[k];
    d.strides[k] = strides[k];
    d.offset[k] = offset[k];
    d.elements *= box.shape[k];
    if (k + 1 < ndim) {  // a leading dim: the grid's rows it steps over
      d.grid_rows[k] = rows;
      rows *= grid.shape[k];
    }
  }
  return d;
}

void run_quant_on_host(const QuantBoxDesc& d) noexcept {
  for (std::int64_t e = 0; e < d.elements; ++e) {
    quant_element(d, e);
  }
}

}  // namespace shardgather::detail
