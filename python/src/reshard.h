// ReshardPlan's Python class (PyReshardPlan, plans.h): layouts from Python tuples, this rank's
// boxes, the planner's byte counts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <pybind11/pybind11.h>

#include "plans.h"

#include "shardgather/reshard.h"

namespace shardgather::python {

// A box as Python passes it: (rank, offset, size).
using PyRankBox = std::tuple<int, Shape, Shape>;
// One tensor's layouts as Python passes them: (dtype, shape, sources, destinations).
using PyTensorRegions =
    std::tuple<pybind11::handle, Shape, std::vector<PyRankBox>, std::vector<PyRankBox>>;

void register_reshard_plan(pybind11::module_& m);

}  // namespace shardgather::python
