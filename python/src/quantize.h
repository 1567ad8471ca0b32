// The host quantizer's Python face (shardgather.quantization): whole tensors in, torch tensors
// out; the GIL is released while the bytes are computed.
#pragma once

#include <pybind11/pybind11.h>

namespace shardgather::python {

void register_quantize(pybind11::module_& m);

}  // namespace shardgather::python
