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

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Tensor.h>
#include <pybind11/pybind11.h>

#include "params.h"

#include "shardgather/communicator.h"
#include "shardgather/embedding.h"
#include "shardgather/plan.h"
#include "shardgather/reshard.h"
#include "shardgather/unshard.h"
#include "shardgather/work.h"

namespace shardgather::python {

// ExecStats as a dict: strategy (its name), preflight/payload/setup_collectives, staged_bytes.
pybind11::dict stats_dict(const ExecStats& stats);

// The timeout in seconds, or None.
pybind11::object seconds_or_none(std::optional<std::chrono::milliseconds> timeout);

// torch.dtype -> wire dtype (TypeError naming `what` for anything else).
DType dtype_from_py(pybind11::handle dtype, const std::string& what);

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

// What an execution hands the core plan and what it returns, as the per-plan part of PyPlan::run
// builds them: `into(method)` calls method(destination...) once (the destination, and for a
// reshard the device its views are on), `method` being the plan's execute
// or start bound to the inputs, and `results()` builds the return value (with the GIL, once the
// execution succeeded). A started execution's Work keeps `results` until wait(), so it must
// hold values (the output tensor, the caller's list), never references to this call's locals.
template <typename Into, typename Results>
struct PlanOutput {
  Into into;
  Results results;
};

// The execution path both plan wrappers share: one thread at a time, the inputs parsed into
// storage the plan reuses (a local error fails the call on every rank that will hear of it),
// then the core plan's execute with the GIL released, or its start behind a Work that keeps
// `self` alive. The wrappers differ only in where an execution writes and what it returns.
template <typename Plan>
class PyPlan {
 public:
  [[nodiscard]] const Plan& plan() const noexcept { return plan_; }
  // (UnshardPlan does not expose its options, so every wrapper keeps a copy.)
  [[nodiscard]] const PlanOptions& options() const noexcept { return options_; }
  [[nodiscard]] const ExecStats& last_stats() const noexcept { return last_; }
  // The plan-owned output buffer (undefined until the first execution that needed one).
  [[nodiscard]] const at::Tensor& buffer() const noexcept { return buffer_; }

 protected:
  // How the wrapper is named in messages: the class, its inputs argument, the operation.
  struct Names {
    const char* plan;
    const char* inputs;
    Operation op;
  };
  // One execution's parsed arguments: the plan's own for a blocking one (no allocation after
  // the first step), a started one's own, which it holds until it ends.
  struct Parsed {
    Params inputs;
    Params outputs;  // the caller's output tensors, where the plan takes them
    Params scales;   // a quantized reshard's destination scales (the given ones)
    std::vector<TensorView> scale_views;  // one per destination, or none
  };

  PyPlan(Plan&& plan, const PlanOptions& options, Names names)
      : plan_(std::move(plan)), options_(options), names_(names) {}

  // `prepare(parsed, comm)` runs once the inputs are parsed: it checks the outputs (failing
  // like a bad input) and returns a PlanOutput.
  template <typename Prepare>
  pybind11::object run(pybind11::handle inputs, const std::shared_ptr<Communicator>& comm,
                       bool async_op, const pybind11::object& self, Prepare prepare);

  [[noreturn]] void fail_locally(Communicator& comm, const LocalError& error) const;
  void parse_or_fail(pybind11::handle args, const char* what, Params& into,
                     Communicator& comm) const;
  // A quantized plan's scales: None, or one entry per output (None: that output receives
  // values), parsed as the outputs are.
  void parse_scales(pybind11::handle scales, Parsed& parsed, Communicator& comm) const;
  // A quantized plan's `outputs` and `scales` parsed as above, and what its execution hands
  // the plan (method(outputs, scales)) and returns (`returned`, as it is).
  auto into_quantized(pybind11::handle outputs, pybind11::handle scales, pybind11::handle returned,
                      Parsed& parsed, Communicator& comm) const {
    parse_or_fail(outputs, "outputs", parsed.outputs, comm);
    parse_scales(scales, parsed, comm);
    const auto result = pybind11::reinterpret_borrow<pybind11::object>(returned);
    const std::span<const TensorView> views(parsed.outputs.views);
    const std::span<const TensorView> scale_views(parsed.scale_views);
    return PlanOutput{[views, scale_views](auto method) { return method(views, scale_views); },
                      [result]() -> pybind11::object { return result; }};
  }

  Plan plan_;
  at::Tensor buffer_;

 private:
  std::unique_lock<std::mutex> claim(const Communicator& comm);
  template <typename Output>
  pybind11::object start(const std::shared_ptr<Communicator>& comm, std::shared_ptr<Parsed> parsed,
                         Output output, const pybind11::object& self);

  PlanOptions options_;
  Names names_;
  std::mutex busy_;
  Parsed parsed_;
  ExecStats last_;
  std::shared_ptr<detail::WorkState> started_;  // the last started execution
  const Communicator* started_on_ = nullptr;
};

class PyAllGatherPlan : public PyPlan<AllGatherPlan> {
 public:
  // `options`: those `plan` was built with.
  // A quantized plan's calls are its reshard's, whose operation a local error names.
  PyAllGatherPlan(AllGatherPlan&& plan, const PlanOptions& options)
      : PyPlan(std::move(plan), options,
               {"AllGatherPlan", "params",
                plan.quantized() ? Operation::kReshardExecute : Operation::kPlanExecute}) {}

  // shapes_across_group None: gather the shapes (collective). Errors raise on every rank.
  static std::unique_ptr<PyAllGatherPlan> create(pybind11::handle params, Communicator& comm,
                                                 pybind11::handle shapes_across_group,
                                                 const PlanOptions& options);

  // out[i][r]: rank r's params[i], views of `out` (a contiguous CPU tensor of at least
  // output_bytes bytes) or, when none, of the plan's own buffer.
  // `async_op`: returns a Work whose wait() returns the lists (`self` is kept alive until then).
  // A quantized plan takes `out` as the list of its outputs (entry i * world + r: FP8 data as
  // uint8, or a tensor to dequantize into) with `scales` as a quantized reshard does, and
  // returns `returned` as it is.
  pybind11::object execute(pybind11::handle params, const std::shared_ptr<Communicator>& comm,
                           pybind11::handle out, bool async_op, pybind11::handle scales,
                           pybind11::handle returned, const pybind11::object& self);

 private:
  // `out` once checked, else the plan's buffer (allocated by the first execution).
  at::Tensor target(const std::optional<at::Tensor>& out, Communicator& comm);
  // The result lists over `target` (cached per buffer: rebuilt only when the buffer changes).
  pybind11::list results_over(const at::Tensor& target);

  at::Tensor cached_for_;                 // the buffer `cached_` views
  std::vector<pybind11::object> cached_;  // [i * world + r]
  ResultLists lists_;                     // what execute() returns
};

class PyUnshardPlan : public PyPlan<UnshardPlan> {
 public:
  // A quantized plan's calls are its reshard's, whose operation a local error names.
  PyUnshardPlan(UnshardPlan&& plan, const PlanOptions& options)
      : PyPlan(std::move(plan), options,
               {"UnshardPlan", "shards",
                plan.quantized() ? Operation::kReshardExecute : Operation::kUnshardExecute}) {}

  // The full parameters: `outputs` (contiguous tensors of each full shape and dtype, returned
  // as a new list) or, when none, views of the plan's own buffer.
  // A quantized plan takes `outputs` (a quantized parameter's FP8 data as uint8, or a tensor
  // to dequantize into) with `scales` as a quantized reshard does, and returns `returned` as it
  // is.
  pybind11::object execute(pybind11::handle shards, const std::shared_ptr<Communicator>& comm,
                           std::optional<pybind11::handle> outputs, bool async_op,
                           pybind11::handle scales, pybind11::handle returned,
                           const pybind11::object& self);

 private:
  // The buffer and the full tensors over it, built by the first execution without outputs.
  void build_buffer();

  std::vector<pybind11::object> cached_;  // the full tensors over buffer_
  ResultLists lists_;                     // what execute() returns
};

class PyReshardPlan : public PyPlan<ReshardPlan> {
 public:
  PyReshardPlan(ReshardPlan plan, const PlanOptions& options)
      : PyPlan(std::move(plan), options, {"ReshardPlan", "sources", Operation::kReshardExecute}) {}

  // Writes this rank's `destinations` (tensors of its boxes, any strides, in place) from every
  // rank's sources; returns them as a new list. `device`: where this rank's tensors are (unset:
  // the first one's; a rank with none in a CUDA reshard passes it).
  // A quantized plan's `scales`: None, or per destination None (values) or the tensor its
  // scales land in, `destinations` then holding the FP8 data as uint8. `returned`: what
  // execute returns, as it is (None: `destinations` as a new list).
  pybind11::object execute(pybind11::handle sources, pybind11::handle destinations,
                           const std::shared_ptr<Communicator>& comm, bool async_op,
                           std::optional<Device> device, pybind11::handle scales,
                           pybind11::handle returned, const pybind11::object& self);
};

// Per tensor None (it travels as it is) or a format's name ("fp8_e4m3_128x128", ...), as the
// plans take them; InvalidArgument naming the index of an unknown one.
std::vector<QuantFormat> quant_formats(const std::vector<std::optional<std::string>>& names);

// One-shot unshard: plan, allocate (a torch-owned buffer), execute; returns the full tensors.
pybind11::object unshard_py(pybind11::handle shards, const std::shared_ptr<Communicator>& comm,
                            const std::vector<ShardSpec>& specs, const PlanOptions& options,
                            bool async_op);

}  // namespace shardgather::python
