// The weight sync's call of rounds (shardgather/round_call.h) for the Python package:
// shardgather._shardgather._RoundCall. Rows and messages are CPU tensors; the GIL is released
// while a round moves.
#pragma once

#include <pybind11/pybind11.h>

namespace shardgather::python {

void register_round_call(pybind11::module_& m);

}  // namespace shardgather::python
