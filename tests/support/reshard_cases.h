// Reshard test cases shared by the threads and MPI suites: random layouts (the same on every
// rank for a seed), each rank's views over owning storage, and the check of every destination
// byte against the reference: the full tensor, whose element bytes are a pattern of (seed, tensor,
// flat index), sliced to the destination's box.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shardgather/shardgather.h"

namespace shardgather::testing {

// What destination storage holds before a reshard writes it.
inline constexpr std::byte kCanary{0xA5};

// A random layout for `world` ranks: 1-5 dims (sometimes 0-d), small uneven shapes, mixed dtypes,
// sources as grids of uneven cuts along one or two dims with replicas and extra overlapping
// boxes, destinations likewise or single boxes, on rank sets that are disjoint, overlapping or
// the same. Every destination element is held by some source.
std::vector<TensorRegions> random_reshard_layout(std::uint64_t seed, int world);

// How a rank's views are laid out in memory.
enum class ViewKind : std::uint8_t {
  kContiguous,
  kEmbedded,    // a sub-box of a larger tensor (a fused parameter), strided
  kTransposed,  // 2-D and larger: the last two dims swapped in memory
};

// One rank's views of a plan, over storage it owns; sources hold the reference bytes,
// destination storage starts as a canary byte everywhere.
struct ReshardViews {
  std::vector<std::vector<std::byte>> storage;  // one per view: sources first
  std::vector<TensorView> sources;
  std::vector<TensorView> destinations;
};

// `variant` picks each view's kind (0: all contiguous).
ReshardViews make_reshard_views(const ReshardPlan& plan, std::uint64_t seed, int variant);

// "" when every destination byte equals the reference and every other byte of a destination's
// storage is still the canary; else the first difference, named.
std::string check_reshard(const ReshardPlan& plan, const ReshardViews& views, std::uint64_t seed);

// A layout in words, for failure messages.
std::string describe_layout(const std::vector<TensorRegions>& tensors);

// Cases for any backend, run by every rank of `comm` (GoogleTest assertions):
// `iterations` random layouts, each planned for the communicator (its hosts too) and checked
// byte by byte on every rank, with every kind of view, and the transport's count of what reached
// each rank checked against the plan; returns how many of the plans fanned out inside a host;
int case_reshard_fuzz(Communicator& comm, int iterations, std::uint64_t seed);
// a plan that differs on the last rank: Mismatch on every rank, and the destinations untouched.
void case_reshard_mismatch(Communicator& comm);

}  // namespace shardgather::testing
