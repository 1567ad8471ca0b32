// Strategy names and the automatic choice.
#include <algorithm>
#include <string>
#include <vector>

#include "strategies/strategy.h"

#include "shardgather/errors.h"

namespace shardgather {

std::string_view strategy_name(Strategy strategy) noexcept {
  switch (strategy) {
    case Strategy::kAuto:
      return "auto";
    case Strategy::kDirect:
      return "direct";
    case Strategy::kPacked:
      return "packed";
    case Strategy::kPerTensor:
      return "per_tensor";
    case Strategy::kShared:
      return "shared";
    case Strategy::kPadded:
      return "padded";
    case Strategy::kHierarchical:
      return "hierarchical";
  }
  return "invalid";
}

Strategy parse_strategy(std::string_view name) {
  for (const Strategy s :
       {Strategy::kAuto, Strategy::kDirect, Strategy::kPacked, Strategy::kPerTensor,
        Strategy::kShared, Strategy::kPadded, Strategy::kHierarchical}) {
    if (strategy_name(s) == name) {
      return s;
    }
  }
  throw InvalidArgument("unknown strategy \"" + std::string(name) +
                        "\" (auto, direct, packed, per_tensor, shared, padded, hierarchical)");
}

namespace detail {

bool runs_shape(Strategy strategy, ExchangeShape shape) noexcept {
  return shape == ExchangeShape::kAllGather || strategy == Strategy::kDirect;
}

Strategy select_strategy(Strategy requested, ExchangeShape shape,
                         std::span<const std::uint64_t> counts, const Communicator& comm,
                         bool shared_unavailable) {
  if (shape != ExchangeShape::kAllGather) {
    return Strategy::kDirect;  // the one strategy that runs every shape (runs_shape)
  }
  const Capabilities caps = comm.capabilities();
  // kDirect needs an exact gather-v; without one the same job moves padded.
  const auto direct = [&caps] { return caps.gather_v ? Strategy::kDirect : Strategy::kPadded; };
  if (requested == Strategy::kShared && !shared_available(comm)) {
    return direct();  // documented fallback: ranks on several hosts
  }
  if (requested == Strategy::kHierarchical && !hierarchical_available(comm)) {
    return direct();  // documented fallback: one host, or one rank per host
  }
  if (requested == Strategy::kDirect) {
    return direct();
  }
  if (requested != Strategy::kAuto) {
    return requested;
  }
  // A window is the candidate wherever one can exist, at every size: no fixed threshold was right
  // on every backend and topology (docs/benchmarking.md), so plans measure it against kDirect
  // (plan_strategy). Never where the transport reads peer memory itself (threads: the window
  // could only add copies), nor for a payload of nothing.
  const std::uint64_t largest =
      counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  if (shared_unavailable || largest == 0 || caps.reads_peer_memory) {
    return direct();
  }
  if (shared_available(comm)) {
    return Strategy::kShared;
  }
  if (hierarchical_available(comm)) {
    return Strategy::kHierarchical;
  }
  return direct();
}

Strategy plan_strategy(Strategy requested, ExchangeShape shape,
                       std::span<const std::uint64_t> counts, const Communicator& comm,
                       StrategyScratch& scratch, const char*& why) {
  const Strategy rule = select_strategy(requested, shape, counts, comm, scratch.shared_unavailable);
  AutoTrial& t = scratch.trial;
  if (shape != ExchangeShape::kAllGather) {
    why = shape == ExchangeShape::kGather ? "a gather to one rank moves direct"
                                          : "a personal exchange moves direct";
    return rule;
  }
  if (requested != Strategy::kAuto) {
    why = "requested";
    return rule;
  }
  if (rule != Strategy::kShared && rule != Strategy::kHierarchical) {
    why = scratch.shared_unavailable ? "rule: the window could not be reserved" : "rule";
    return rule;
  }
  if (t.candidates[0] != Strategy::kAuto && t.candidates[0] != rule) {
    t = AutoTrial{};  // executed over a communicator of another topology: measure afresh
  }
  if (t.settled) {
    why = t.why;
    return t.chosen;
  }
  t.candidates = {rule, comm.capabilities().gather_v ? Strategy::kDirect : Strategy::kPadded};
  why = "measuring";
  return t.candidates[static_cast<std::size_t>(t.runs % 2)];
}

void record_auto(Strategy ran, double seconds, Communicator& comm, Deadline deadline,
                 StrategyScratch& scratch) {
  AutoTrial& t = scratch.trial;
  if (t.settled || t.candidates[0] == Strategy::kAuto) {
    return;
  }
  if (scratch.shared_unavailable) {
    // The window failed on some rank, so on every rank (SharedBuffer::create): no trial.
    t.settled = true;
    t.chosen = t.candidates[1];
    t.why = "rule: the window could not be reserved";
    return;
  }
  const auto k = static_cast<std::size_t>(t.runs % 2);
  if (ran != t.candidates[k]) {
    return;  // not a trial of this plan's (cannot happen: the same sequence on every rank)
  }
  if (++t.runs > 2) {
    t.best[k] = std::min(t.best[k], seconds);
  }
  if (t.runs < kAutoTrialRuns) {
    return;
  }
  const auto world = static_cast<std::size_t>(comm.size());
  std::vector<double> all(2 * world);
  comm.all_gather(std::as_bytes(std::span(t.best)), std::as_writable_bytes(std::span(all)),
                  deadline);
  for (std::size_t r = 0; r < world; ++r) {
    t.slowest[0] = std::max(t.slowest[0], all[2 * r]);
    t.slowest[1] = std::max(t.slowest[1], all[2 * r + 1]);
  }
  // The window has to win: on a tie kDirect, which holds no window.
  const bool window = t.slowest[0] < t.slowest[1];
  t.chosen = t.candidates[window ? 0 : 1];
  t.why = window ? "measured: the window was faster" : "measured: direct was faster";
  t.settled = true;
  if (!window) {
    // Its memory goes back: every rank has finished the last windowed trial (this one ran
    // direct), nothing still writes into it, and each rank unmaps only its own mapping.
    scratch.window.reset();
    scratch.window_bytes = 0;
  }
}

void run_strategy(Strategy strategy, const ExchangeJob& job, Communicator& comm, Deadline deadline,
                  StrategyScratch& scratch) {
  if (job.combine.op != Combine::Op::kNone) {
    throw InvalidArgument("no strategy combines what it receives yet");
  }
  if (!runs_shape(strategy, job.shape)) {
    throw InvalidArgument(std::string(strategy_name(strategy)) +
                          " runs all-gather-shaped exchanges only");
  }
  switch (strategy) {
    case Strategy::kPacked:
      run_packed(job, comm, deadline, scratch);
      return;
    case Strategy::kPerTensor:
      run_per_tensor(job, comm, deadline, scratch);
      return;
    case Strategy::kShared:
      run_shared(job, comm, deadline, scratch);
      return;
    case Strategy::kHierarchical:
      run_hierarchical(job, comm, deadline, scratch);
      return;
    case Strategy::kPadded:
      gather_padded(job.send, job.pieces, job.first, job.counts, job.copy_threads, comm, deadline,
                    scratch);
      return;
    case Strategy::kAuto:
    case Strategy::kDirect:
      run_direct(job, comm, deadline, scratch);
      return;
  }
}

}  // namespace detail
}  // namespace shardgather
