// The one stats type every call returns: how many collectives it issued, by purpose, and how
// its payload moved. GatherResult::stats(), every plan execution, unshard results and stream
// buckets all carry it (CallStats is its older name).
#pragma once

#include <cstdint>

#include "shardgather/strategy.h"

namespace shardgather {

struct ExecStats {
  // The pre-flight header, when it served only as a check.
  std::uint64_t preflight_collectives = 0;
  // The header, when it carried what the call needed (foreach_all_gather without a hint).
  std::uint64_t metadata_collectives = 0;
  std::uint64_t payload_collectives = 0;
  // One-time setup on a first execution (kShared, kHierarchical: creating the window).
  std::uint64_t setup_collectives = 0;
  std::uint64_t staged_bytes = 0;       // bytes copied into staging before sending
  Strategy strategy = Strategy::kAuto;  // the one that ran
  // What decided it (a static string): "requested"; for kAuto, "rule" (select.cc's facts: no
  // window applies), "rule: the window could not be reserved", "measuring" (one of the first
  // executions that time the node-shared window against direct), or "measured: ..." (the one
  // that was faster for the slowest rank); "a gather to one rank moves direct" (dst set), "a
  // personal exchange moves direct".
  // Empty from one-shot calls and execute_shared.
  const char* why = "";
};

using CallStats = ExecStats;

}  // namespace shardgather
