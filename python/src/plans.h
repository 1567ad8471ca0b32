// AllGatherPlan and UnshardPlan for Python: the core plans plus a plan-owned output buffer (a
// torch uint8 tensor) and the result tensors over it, both built once and reused by every
// execution, so a steady-state execution allocates no output and creates no tensor objects (nor
// lists: see ResultLists).
// Results of execution k are therefore overwritten by execution k + 1, like FSDP's reused
// unshard buffers; clone what must outlive the next execution.
//
// Threading: executions release the GIL. A plan holds scratch space, so one thread executes it
// at a time; a second thread entering execute() meanwhile gets a RuntimeError, not a data race.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <ATen/Tensor.h>
#include <pybind11/pybind11.h>

#include "params.h"

#include "shardgather/communicator.h"
#include "shardgather/plan.h"
#include "shardgather/unshard.h"

namespace shardgather::python {

// ExecStats as a dict: strategy (its name), preflight/payload/setup_collectives, staged_bytes.
pybind11::dict stats_dict(const ExecStats& stats);

// PlanOptions from the Python keywords.
PlanOptions plan_options(const std::string& strategy, bool preflight,
                         std::optional<double> timeout);

// The result lists an execution returns: built once, then returned again by every later
// execution. Creating n + 1 new lists per step makes CPython run its cyclic GC about once per
// call, which cost more than the whole gather of 1000 small tensors. A caller that edited the
// lists it was given gets new ones (checked by identity, O(tensors)).
class ResultLists {
 public:
  // [[tensors[i * per_list + r] for r ...] for i ...], or the flat list when per_list is 0.
  pybind11::list get(const std::vector<pybind11::object>& tensors, std::size_t per_list);
  void reset() { lists_ = pybind11::object(); }

 private:
  [[nodiscard]] bool intact(const std::vector<pybind11::object>& tensors,
                            std::size_t per_list) const;
  pybind11::object lists_;
};

class PyAllGatherPlan {
 public:
  explicit PyAllGatherPlan(AllGatherPlan plan) : plan_(std::move(plan)) {}

  // shapes_across_group None: gather the shapes (collective). Errors raise on every rank.
  static std::unique_ptr<PyAllGatherPlan> create(pybind11::handle params, Communicator& comm,
                                                 pybind11::handle shapes_across_group,
                                                 const PlanOptions& options);

  // out[i][r]: rank r's params[i], views of `out` (a contiguous CPU tensor of at least
  // output_bytes bytes) or, when none, of the plan's own buffer.
  // `async_op`: returns a Work whose wait() returns the lists (`self` is kept alive until then).
  pybind11::object execute(pybind11::handle params, const std::shared_ptr<Communicator>& comm,
                           std::optional<at::Tensor> out, bool async_op,
                           const pybind11::object& self);

  [[nodiscard]] const AllGatherPlan& plan() const noexcept { return plan_; }
  [[nodiscard]] const ExecStats& last_stats() const noexcept { return last_; }
  // The plan-owned output buffer (undefined until the first execution without `out`).
  [[nodiscard]] const at::Tensor& buffer() const noexcept { return buffer_; }

 private:
  // The result lists over `target` (cached per buffer: rebuilt only when the buffer changes).
  pybind11::list results_over(const at::Tensor& target);

  AllGatherPlan plan_;
  std::mutex busy_;
  Params parsed_;  // reused by every execution (no per-tensor allocation after the first)
  at::Tensor buffer_;
  at::Tensor cached_for_;                 // the buffer `cached_` views
  std::vector<pybind11::object> cached_;  // [i * world + r]
  ResultLists lists_;                     // what execute() returns
  ExecStats last_;
  std::shared_ptr<detail::WorkState> started_;  // the last started execution
  const Communicator* started_on_ = nullptr;
};

class PyUnshardPlan {
 public:
  // (UnshardPlan does not expose its options; the wrapper keeps a copy.)
  PyUnshardPlan(UnshardPlan plan, const PlanOptions& options)
      : plan_(std::move(plan)), options_(options) {}

  // The full parameters: `outputs` (contiguous tensors of each full shape and dtype, returned
  // as a new list) or, when none, views of the plan's own buffer.
  pybind11::object execute(pybind11::handle shards, const std::shared_ptr<Communicator>& comm,
                           std::optional<pybind11::handle> outputs, bool async_op,
                           const pybind11::object& self);

  [[nodiscard]] const UnshardPlan& plan() const noexcept { return plan_; }
  [[nodiscard]] const PlanOptions& options() const noexcept { return options_; }
  [[nodiscard]] const ExecStats& last_stats() const noexcept { return last_; }
  [[nodiscard]] const at::Tensor& buffer() const noexcept { return buffer_; }

 private:
  UnshardPlan plan_;
  PlanOptions options_;
  std::mutex busy_;
  Params parsed_;   // the shards, reused by every execution
  Params outputs_;  // the caller's outputs, when given
  at::Tensor buffer_;
  std::vector<pybind11::object> cached_;  // the full tensors over buffer_
  ResultLists lists_;                     // what execute() returns
  ExecStats last_;
  std::shared_ptr<detail::WorkState> started_;  // the last started execution
  const Communicator* started_on_ = nullptr;
};

// One-shot unshard: plan, allocate (a torch-owned buffer), execute; returns the full tensors.
pybind11::object unshard_py(pybind11::handle shards, const std::shared_ptr<Communicator>& comm,
                            const std::vector<ShardSpec>& specs, const PlanOptions& options,
                            bool async_op);

}  // namespace shardgather::python
