#include "quantize.h"

#include <cstddef>
#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "plans.h"
#include "torch_tensors.h"

#include "shardgather/buffer.h"
#include "shardgather/copy.h"
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

QuantGrid box_grid(const std::string& name, const TensorView& box, const Shape& hull,
                   const Shape& offset) {
  if (hull.size() != box.shape.size() || offset.size() != box.shape.size()) {
    throw InvalidArgument("quantize: a box of " + std::to_string(box.shape.size()) +
                          " dims with a window of " + std::to_string(hull.size()) +
                          " dims and an offset of " + std::to_string(offset.size()));
  }
  return quant_grid(format_of(name), hull, box.dtype, "the window");
}

// The absolute maxima of `box` (at `offset` inside a window of shape `hull`, whose block grid
// is the global tensor's there) per block of the window, in the scales' shape.
at::Tensor fold_amax_py(const at::Tensor& t, const std::string& name, const Shape& hull,
                        const Shape& offset) {
  const at::Tensor input = cpu_tensor(t, "the box");
  TensorView view;
  set_view(input, dtype_of(input.scalar_type(), "the box"), view);
  const QuantGrid grid = box_grid(name, view, hull, offset);
  at::Tensor amax = at::zeros(grid.scale_shape(), at::TensorOptions().dtype(at::kFloat));
  {
    const py::gil_scoped_release unlocked;
    fold_amax(grid, view, offset, {amax.data_ptr<float>(), static_cast<std::size_t>(amax.numel())});
  }
  return amax;
}

// (the box's e4m3fn bytes as uint8 in its shape, the window's encoded scales) from the window's
// agreed amaxes (fold_amax_py's shape, combined with the other ranks' pieces of cut blocks).
// `out`: where the data goes (a contiguous uint8 tensor of the box's shape, reused by a caller
// that quantizes every step), or None for a new one.
std::tuple<at::Tensor, at::Tensor> quantize_box_py(const at::Tensor& t, const std::string& name,
                                                   const Shape& hull, const Shape& offset,
                                                   const at::Tensor& amax,
                                                   const std::optional<at::Tensor>& out) {
  const at::Tensor input = cpu_tensor(t, "the box");
  TensorView view;
  set_view(input, dtype_of(input.scalar_type(), "the box"), view);
  const QuantGrid grid = box_grid(name, view, hull, offset);
  const at::Tensor maxima = cpu_tensor(amax, "the amaxes").contiguous();
  if (maxima.scalar_type() != at::kFloat || maxima.sizes() != at::IntArrayRef(grid.scale_shape())) {
    throw InvalidArgument("quantize: amaxes of " + std::string(at::toString(maxima.scalar_type())) +
                          " " + shape_string(maxima.sizes()) + " (want float32 " +
                          shape_string(grid.scale_shape()) + ")");
  }
  if (out && (!out->device().is_cpu() || out->scalar_type() != at::kByte ||
              out->sizes() != input.sizes() || !out->is_contiguous())) {
    throw InvalidArgument("quantize: out must be a contiguous CPU uint8 tensor of shape " +
                          shape_string(input.sizes()) + ", got " +
                          std::string(at::toString(out->scalar_type())) + " " +
                          shape_string(out->sizes()));
  }
  at::Tensor data = out ? *out : at::empty(input.sizes(), at::TensorOptions().dtype(at::kByte));
  at::Tensor scales =
      at::empty(grid.scale_shape(),
                at::TensorOptions().dtype(grid.scale_size() == 1 ? at::kByte : at::kFloat));
  {
    const py::gil_scoped_release unlocked;
    encode_scales(grid, {maxima.data_ptr<float>(), static_cast<std::size_t>(maxima.numel())},
                  bytes_of(scales));
    quantize_box(grid, view, offset, bytes_of(scales), static_cast<std::byte*>(data.data_ptr()));
  }
  return {data, scales};
}

// Dequantizes a box's e4m3fn bytes (`data`, uint8 in the box's shape) into `out` (f32 or bf16,
// the box's shape, any strides): the box lies at `offset` inside a window of shape `hull`
// whose encoded scales are `scales` (the window's scale shape).
void dequantize_box_py(const at::Tensor& data, const at::Tensor& scales, const std::string& name,
                       const Shape& hull, const Shape& offset, const at::Tensor& out) {
  const at::Tensor codes = cpu_tensor(data, "the data").contiguous();
  const at::Tensor encoded = cpu_tensor(scales, "the scales").contiguous();
  cpu_tensor(out, "the output");
  TensorView view;
  set_view(out, dtype_of(out.scalar_type(), "the output"), view);
  if (codes.element_size() != 1 || codes.sizes() != out.sizes()) {
    throw InvalidArgument("dequantize: data of " + shape_string(codes.sizes()) +
                          " (one byte per element) for an output of " + shape_string(out.sizes()));
  }
  if (hull.size() != view.shape.size()) {
    throw InvalidArgument("dequantize: a window of " + std::to_string(hull.size()) +
                          " dims for an output of " + std::to_string(view.shape.size()));
  }
  if (overlaps_itself(view)) {
    throw InvalidArgument("dequantize: the output's elements share memory");
  }
  const QuantGrid grid = quant_grid(format_of(name), hull, DType::kFloat32, "the window");
  const bool right_type =
      grid.scale_size() == 1 ? encoded.element_size() == 1 : encoded.scalar_type() == at::kFloat;
  if (!right_type || encoded.sizes() != at::IntArrayRef(grid.scale_shape())) {
    throw InvalidArgument(
        "dequantize: scales of " + std::string(at::toString(encoded.scalar_type())) + " " +
        shape_string(encoded.sizes()) + " (want " + shape_string(grid.scale_shape()) + ")");
  }
  const py::gil_scoped_release unlocked;
  dequantize_box(grid, static_cast<const std::byte*>(codes.data_ptr()), offset, bytes_of(encoded),
                 view);
}

// A uint8 CPU tensor of `bytes` over a huge-page-advised AlignedBuffer: the FP8 staging of a
// quantized transfer, written once per call (first touch of 4 KiB pages costs about 40x more
// than of huge pages on the machines this targets; torch's own empty() does not advise them).
at::Tensor host_staging_py(std::int64_t bytes) {
  if (bytes < 0) {
    throw InvalidArgument("quantize: staging of " + std::to_string(bytes) + " bytes");
  }
  auto buffer = std::make_unique<AlignedBuffer>(static_cast<std::uint64_t>(bytes));
  std::byte* data = buffer->data();
  const c10::Storage storage =
      adopt_storage(std::move(buffer), data, static_cast<std::uint64_t>(bytes));
  return at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(storage, 0, {bytes}, {1});
}

}  // namespace

void register_quantize(py::module_& m) {
  m.def("_quantize", &quantize_py, py::arg("tensor"), py::arg("format"));
  m.def("_dequantize", &dequantize_py, py::arg("data"), py::arg("scales"), py::arg("format"),
        py::arg("dtype"));
  m.def("_host_staging", &host_staging_py, py::arg("bytes"));
  m.def("_dequantize_box", &dequantize_box_py, py::arg("data"), py::arg("scales"),
        py::arg("format"), py::arg("window"), py::arg("offset"), py::arg("out"));
  m.def("_fold_amax", &fold_amax_py, py::arg("box"), py::arg("format"), py::arg("window"),
        py::arg("offset"));
  m.def("_quantize_box", &quantize_box_py, py::arg("box"), py::arg("format"), py::arg("window"),
        py::arg("offset"), py::arg("amax"), py::arg("out") = py::none());
}

}  // namespace shardgather::python
