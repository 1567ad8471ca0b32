// Strategy names and the automatic choice.
#include <algorithm>
#include <string>

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
  }
  return "invalid";
}

Strategy parse_strategy(std::string_view name) {
  for (const Strategy s : {Strategy::kAuto, Strategy::kDirect, Strategy::kPacked,
                           Strategy::kPerTensor, Strategy::kShared}) {
    if (strategy_name(s) == name) {
      return s;
    }
  }
  throw InvalidArgument("unknown strategy \"" + std::string(name) +
                        "\" (auto, direct, packed, per_tensor, shared)");
}

namespace detail {

Strategy select_strategy(Strategy requested, const GatherJob& job, const Communicator& comm,
                         bool shared_unavailable) {
  if (requested == Strategy::kShared && !shared_available(comm)) {
    return Strategy::kDirect;  // documented fallback: ranks on several hosts
  }
  if (requested != Strategy::kAuto) {
    return requested;
  }
  // The backend states where the window starts to beat its transport (measured per backend,
  // docs/benchmarking.md). Every input here, shared_unavailable included (see run_payload), is
  // the same on every rank, so every rank picks the same strategy.
  const std::uint64_t largest = *std::max_element(job.counts.begin(), job.counts.end());
  if (shared_available(comm) && !shared_unavailable && largest >= comm.shared_window_min_bytes()) {
    return Strategy::kShared;
  }
  return Strategy::kDirect;
}

void run_strategy(Strategy strategy, const GatherJob& job, Communicator& comm, Deadline deadline,
                  StrategyScratch& scratch) {
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
    case Strategy::kAuto:
    case Strategy::kDirect:
      run_direct(job, comm, deadline, scratch);
      return;
  }
}

}  // namespace detail
}  // namespace shardgather
