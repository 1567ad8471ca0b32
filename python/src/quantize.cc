#include "quantize.h"

#include <cstddef>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "plans.h"
#include "torch_tensors.h"

#include "shardgather/errors.h"
#include "shardgather/quantize.h"

namespace py = pybind11;

namespace shardgather::python {
namespace {

QuantFormat format_of(const std::string& name) {
  const auto format = quant_format_from_name(name);
  if (!format || *format == QuantFormat::kNone) {
    throw InvalidArgument("quantize: unknown format '" + name +
                          "' (fp8_e4m3_128x128, fp8_e4m3_1x128 or mxfp8)");
  }
  return *format;
}

at::Tensor cpu_tensor(const at::Tensor& t, const char* what) {
  if (!t.device().is_cpu()) {
    throw InvalidArgument(std::string("quantize: ") + what +
                          " must be a CPU tensor (the host quantizer)");
  }
  return t;
}

std::string shape_string(at::IntArrayRef dims) {
  std::string text = "[";
  for (std::size_t d = 0; d < dims.size(); ++d) {
    text += (d == 0 ? "" : ", ") + std::to_string(dims[d]);
  }
  return text + "]";
}

std::span<std::byte> bytes_of(const at::Tensor& t) {
  return {static_cast<std::byte*>(t.data_ptr()), static_cast<std::size_t>(t.nbytes())};
}

// (data as uint8 in t's shape, encoded scales as f32 or uint8 in the grid's scale shape).
std::tuple<at::Tensor, at::Tensor> quantize_py(const at::Tensor& t, const std::string& name) {
  const at::Tensor input = cpu_tensor(t, "the tensor");
  TensorView view;
  set_view(input, dtype_of(input.scalar_type(), "the tensor"), view);
  const QuantGrid grid = quant_grid(format_of(name), view.shape, view.dtype, "the tensor");
  at::Tensor data = at::empty(input.sizes(), at::TensorOptions().dtype(at::kByte));
  at::Tensor scales =
      at::empty(grid.scale_shape(),
                at::TensorOptions().dtype(grid.scale_size() == 1 ? at::kByte : at::kFloat));
  {
    const py::gil_scoped_release unlocked;
    quantize(grid, view, bytes_of(scales), static_cast<std::byte*>(data.data_ptr()));
  }
  return {data, scales};
}

at::Tensor dequantize_py(const at::Tensor& data, const at::Tensor& scales, const std::string& name,
                         py::handle dtype) {
  const at::Tensor codes = cpu_tensor(data, "the data").contiguous();
  const at::Tensor encoded = cpu_tensor(scales, "the scales").contiguous();
  if (codes.element_size() != 1) {
    throw InvalidArgument("dequantize: the data must be one byte per element (e4m3fn or uint8)");
  }
  const DType out_dtype = dtype_from_py(dtype, "dtype");
  at::Tensor out = at::empty(codes.sizes(), at::TensorOptions().dtype(scalar_type_of(out_dtype)));
  TensorView view;
  set_view(out, out_dtype, view);
  const QuantGrid grid = quant_grid(format_of(name), view.shape, DType::kFloat32, "the data");
  const Shape want = grid.scale_shape();
  const bool right_type = grid.scale_size() == 1 ? encoded.scalar_type() == at::kByte
                                                 : encoded.scalar_type() == at::kFloat;
  if (!right_type || encoded.sizes() != at::IntArrayRef(want)) {
    throw InvalidArgument(
        "dequantize: scales of " + std::string(at::toString(encoded.scalar_type())) + " " +
        shape_string(encoded.sizes()) + " for " + name + " data of shape " +
        shape_string(codes.sizes()) + " (want " +
        (grid.scale_size() == 1 ? "float8_e8m0fnu " : "float32 ") + shape_string(want) + ")");
  }
  const Shape origin(view.shape.size(), 0);
  {
    const py::gil_scoped_release unlocked;
    dequantize_box(grid, static_cast<const std::byte*>(codes.data_ptr()), origin, bytes_of(encoded),
                   view);
  }
  return out;
}

}  // namespace

void register_quantize(py::module_& m) {
  m.def("_quantize", &quantize_py, py::arg("tensor"), py::arg("format"));
  m.def("_dequantize", &dequantize_py, py::arg("data"), py::arg("scales"), py::arg("format"),
        py::arg("dtype"));
}

}  // namespace shardgather::python
