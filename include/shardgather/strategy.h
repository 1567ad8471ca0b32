// Strategies: how one gather's bytes move (src/strategies/ has one file each). Every
// operation that moves a payload takes one; kAuto lets src/strategies/select.cc choose from the
// backend's facts (Communicator::capabilities) and the sizes.
#pragma once

#include <cstdint>
#include <string_view>

#include "shardgather/export.h"

namespace shardgather {

// How the payload moves. kAuto picks by backend and size (docs/benchmarking.md has the table
// measured on the target machine), and plans measure where a window is in question (below).
enum class Strategy : std::uint8_t {
  kAuto = 0,
  // One collective, sent straight from the tensors and received straight into the final layout
  // (MPI derived datatypes; the threads backend copies peer memory directly). No copy-in, no
  // copy-out.
  kDirect = 1,
  // Copy-in to one contiguous buffer (all cores for large lists), one collective, copy-out when
  // the final layout is not the gathered one.
  kPacked = 2,
  // One collective per tensor: the baseline.
  kPerTensor = 3,
  // Every rank on one host: one copy into a node-shared window, a barrier, one copy out.
  // Falls back to kDirect when the ranks span hosts.
  kShared = 4,
  // Every rank's stream padded to the largest rank's (the padding goes on the wire), one
  // equal-size all_gather, each rank's real bytes copied out. What kDirect becomes on a
  // transport without an exact gather-v (Communicator::capabilities().gather_v false).
  kPadded = 5,
  // Ranks on several hosts, some host with more than one: each rank copies its stream into its
  // host's node-shared window and sends it once to one rank of every other host, which receives
  // it into that host's window; after a barrier every rank copies out from its window. Each
  // byte crosses the network once per receiving host instead of once per receiving rank. Falls
  // back to kDirect (kPadded without an exact gather-v) where it cannot apply: one host, one
  // rank per host, hosts unknown, a transport without capabilities().all_to_all. A gather to
  // one rank (UnshardPlan's dst) takes only kAuto or kDirect.
  kHierarchical = 6,
};

// A plan asked for kAuto whose rule picks a node-shared window (kShared on one host,
// kHierarchical across hosts) measures it: its first kAutoTrialRuns executions alternate the
// window and kDirect (the window first; the first run of each is a warm-up), then every rank
// agrees, in one all_gather counted as setup, on the one that was faster for the slowest rank,
// and later executions run that one (ExecStats::why says which happened). An explicit
// strategy pins the choice. One-shot calls and stream buckets do not measure: they use kDirect.
inline constexpr int kAutoTrialRuns = 10;

// How an uneven gather of CUDA tensors moves on a torch group, whose device collectives are an
// all-gather of equal blocks and broadcasts (Communicator's DeviceGatherForm). kAuto: one padded
// all-gather when padding adds at most 1/8 of the bytes, else one broadcast per rank
// (docs/gpu.md); the others force a form, so that both can be measured on a cluster. Equal
// blocks are one all-gather whatever is asked. A process asks through
// SHARDGATHER_DEVICE_GATHER=auto|padded|broadcast, read once, at its first CUDA call, or through
// set_device_gather. The pre-flight header carries the request: ranks asking differently raise
// Mismatch on every rank before a byte moves (not checked with the header switched off).
enum class DeviceGather : std::uint8_t { kAuto = 0, kPadded = 1, kBroadcast = 2 };
inline constexpr DeviceGather kLastDeviceGather = DeviceGather::kBroadcast;

// This process's request; InvalidArgument naming an unknown SHARDGATHER_DEVICE_GATHER. Thread-safe.
SHARDGATHER_API DeviceGather device_gather();
// Replaces the request for later calls, process-wide. Every rank must ask alike.
SHARDGATHER_API void set_device_gather(DeviceGather request);
// "auto", "padded", "broadcast"; "invalid" for any other value.
SHARDGATHER_API std::string_view device_gather_name(DeviceGather request) noexcept;
// InvalidArgument for an unknown name.
SHARDGATHER_API DeviceGather parse_device_gather(std::string_view name);

// When a call on CUDA tensors returns to the host (docs/gpu.md). kStream, the default, is c10d's
// NCCL semantics: a blocking call returns once its copy-in, collective and copy-out are enqueued
// on the current stream (current_cuda_stream()), and Work::wait() makes the waiter's current
// stream wait for a started call; the host never waits for the GPU. kHost: the host also waits
// until the call's work has run on the device, polled against the call's deadline (a stalled
// peer raises Timeout there instead of stalling the stream), for callers that read the results
// on another stream or time calls on the host. A process asks through
// SHARDGATHER_DEVICE_WAIT=stream|host, read once, or through set_device_wait. Local to each rank:
// ranks may differ.
enum class DeviceWait : std::uint8_t { kStream = 0, kHost = 1 };

// This process's mode; InvalidArgument naming an unknown SHARDGATHER_DEVICE_WAIT. Thread-safe.
SHARDGATHER_API DeviceWait device_wait();
// Replaces the mode for later calls, process-wide.
SHARDGATHER_API void set_device_wait(DeviceWait mode);
// "stream", "host"; "invalid" for any other value.
SHARDGATHER_API std::string_view device_wait_name(DeviceWait mode) noexcept;
// InvalidArgument for an unknown name.
SHARDGATHER_API DeviceWait parse_device_wait(std::string_view name);

SHARDGATHER_API std::string_view strategy_name(Strategy strategy) noexcept;
// InvalidArgument for an unknown name. Accepts "auto", "direct", "packed", "per_tensor",
// "shared", "padded", "hierarchical".
SHARDGATHER_API Strategy parse_strategy(std::string_view name);

}  // namespace shardgather
