// Argument conversion shared by every entry point of the module: Python lists of tensors to
// TensorViews, timeouts, and the way a rank's local argument error is made to fail the same
// call on its peers.
//
// Threading: everything here runs with the GIL held.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <ATen/Tensor.h>
#include <pybind11/pybind11.h>

#include "shardgather/communicator.h"
#include "shardgather/foreach_all_gather.h"
#include "shardgather/types.h"

namespace shardgather::python {

// Seconds (None: unset) to the core's milliseconds; InvalidArgument for negative or non-finite.
std::optional<std::chrono::milliseconds> to_timeout(std::optional<double> seconds);

// A problem the binding finds before the core runs: raised here as TypeError or ValueError
// after the peers have been told (see notify_peers).
struct LocalError {
  enum Kind { kNone, kType, kValue } kind = kNone;
  std::size_t index = 0;
  std::string message;
};

// A parsed list of tensors: views into `tensors`, which hold the inputs alive during the call.
struct Params {
  std::vector<at::Tensor> tensors;
  std::vector<TensorView> views;
  LocalError error;
};

// `what` names the argument in messages ("params", "shards", "outputs").
Params parse_params(pybind11::handle params, const char* what = "params");

// Makes the peers fail from the same call: the core is called with a view it rejects, so the
// rejection travels in the pre-flight header and every rank raises InvalidArgument, instead of
// the peers waiting for this rank until their deadline. Releases the GIL while it runs.
void notify_peers(Communicator& comm, const LocalError& error,
                  std::span<const std::vector<Shape>> hint, const ForeachAllGatherOptions& options);

// Raises `error` as the Python TypeError or ValueError it stands for, naming this rank.
[[noreturn]] void raise_local(const Communicator& comm, const LocalError& error);

}  // namespace shardgather::python
