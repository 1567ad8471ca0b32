// The delta kernels' Python face (shardgather._shardgather._delta_*): CPU tensors in, the
// record's facts out as tuples; the GIL is released while bytes are compared, copied or hashed.
#pragma once

#include <pybind11/pybind11.h>

namespace shardgather::python {

void register_delta(pybind11::module_& m);

}  // namespace shardgather::python
