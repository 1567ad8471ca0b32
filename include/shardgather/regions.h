// The region planner: which bytes of which tensor go from which rank to which, for a reshard
// between two layouts of the same tensors. Pure functions: no communication, no I/O,
// deterministic (every rank computes the same answer from the same layout). Size arithmetic is
// in 64 bits and overflow-checked (CountOverflow).
//
// A layout gives, per tensor, its global shape and dtype and per rank the boxes it holds
// (sources) and the boxes it wants (destinations). A box is an N-d sub-array of the global tensor
// (an offset and a size per dim). Sources may overlap (replicas): each destination byte is taken
// from exactly one of them. Destinations may overlap too (every replica of a TP rank wants the
// same box). docs/reshard.md has the model and the planner's rules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "shardgather/export.h"
#include "shardgather/types.h"

namespace shardgather {

// An N-d box of a global tensor: the elements offset[d] <= x[d] < offset[d] + size[d]. A 0-d
// tensor's only box has no dims (one element). A box with a zero size holds nothing.
struct Box {
  Shape offset;
  Shape size;
  friend bool operator==(const Box&, const Box&) = default;
};

// A box that rank `rank` holds (a source) or wants (a destination).
struct RankBox {
  int rank = 0;
  Box box;
  friend bool operator==(const RankBox&, const RankBox&) = default;
};

// One tensor's two layouts.
struct TensorRegions {
  DType dtype = DType::kFloat32;
  Shape shape;  // global
  std::vector<RankBox> sources;
  std::vector<RankBox> destinations;
};

// Options of the planner that change its answer (so they are part of a plan's fingerprint).
struct RegionOptions {
  // Where the ranks are: element r is rank r's host. Empty: unknown. A destination byte held by
  // several sources is then taken from a source on its own rank, else on its own host, else the
  // least-loaded one.
  std::vector<int> hosts;
  // A piece of at least this many bytes held by several sources (none on the destination's rank)
  // is split along its first splittable dim among them, so that a replicated tensor's bytes
  // leave from every replica.
  std::uint64_t split_bytes = std::uint64_t{1} << 20;
  // With hosts known: destination boxes that several ranks of one host want alike (replicas of
  // an engine's TP rank on one host, a replicated norm, an unshard) take their bytes held only
  // on other hosts across the network once per host. One rank of the host receives each piece
  // (big pieces are split among the host's ranks) and forwards it to the others inside the host
  // in the next exchange of the same execution, while the next wave crosses (RegionPlan::rounds).
  // Off: every destination rank receives its own copy, in one exchange.
  bool fan_out = true;
  // The relayed pieces move in up to this many waves of about equal bytes: exchange e carries
  // wave e into the hosts and wave e - 1's forwards inside them, so that the forwards overlap
  // the link (all but the last wave's). 1: every forward after the whole first exchange.
  std::size_t fan_out_waves = 4;
  // Device tensors: a rank stages what it sends and receives in one exchange (the fused copy
  // kernel packs and unpacks it), so each exchange moves in RegionPlan::device_parts parts of
  // about this many bytes sent plus received on the busiest rank, and no rank holds more than
  // about one part of staging (+ 2 bytes per peer of rounding). Host tensors need no staging.
  std::uint64_t device_bucket_bytes = std::uint64_t{256} << 20;
};

// One move: the elements of `box` (global coordinates) of tensor `tensor`, from its source entry
// `src` to its destination entry `dst`. src_view and dst_view: the entries' positions among the
// views of their own ranks (a rank passes its sources, and its destinations, in the layout's
// order: tensor by tensor, each tensor's entries of that rank in their order). In a forward (the
// fan-out inside a host), `src` and `src_view` name a *destination* entry and view of the
// forwarding rank, which holds the box once the first exchange completed.
struct Transfer {
  std::size_t tensor = 0;
  std::size_t src = 0;
  std::size_t dst = 0;
  std::size_t src_view = 0;
  std::size_t dst_view = 0;
  Box box;
  std::uint64_t bytes = 0;
  std::size_t round = 0;  // the exchange of an execution it moves in (RegionPlan::rounds)
};

// Where a rank's views sit in the layout: view v of that rank is entry `entry` of tensor
// `tensor` (sources or destinations).
struct ViewRef {
  std::size_t tensor = 0;
  std::size_t entry = 0;
};

// The plan, seen from one rank. Transfers of a (source rank, destination rank) pair are in one
// canonical order (tensor, destination entry, source entry, box offset), the same on both sides,
// so the sender's bytes and the receiver's pieces line up without any metadata. Forwards are
// ordered alike.
struct RegionPlan {
  int world_size = 0;
  int rank = 0;
  // Exchanges per execution: 1, or with a fan-out its waves + 1 (exchange e carries wave e's
  // pieces into a host and wave e - 1's forwards inside it; RegionOptions::fan_out_waves).
  std::size_t rounds = 1;
  // This rank's, grouped by round, then destination rank: rounds * world + 1 entries; its sends
  // to rank p in round e are [send_first[e * world + p], send_first[e * world + p + 1]).
  std::vector<Transfer> sends;
  std::vector<std::size_t> send_first;
  std::vector<Transfer> receives;          // grouped by round, then source rank
  std::vector<std::size_t> recv_first;     // rounds * world + 1
  std::vector<std::uint64_t> send_counts;  // per peer: bytes this rank sends it (every round)
  std::vector<std::uint64_t> recv_counts;  // per peer: bytes this rank receives from it
  // Every rank's totals (the same on every rank): what a bench compares with the links. Sent
  // and received include what a rank copies to itself, which is also in rank_local.
  std::vector<std::uint64_t> rank_sent;
  std::vector<std::uint64_t> rank_received;
  std::vector<std::uint64_t> rank_local;
  // Per host, numbered 0 to the largest in RegionOptions::hosts (empty without hosts): bytes
  // that leave it for, and reach it from, other hosts.
  std::vector<std::uint64_t> host_sent;
  std::vector<std::uint64_t> host_received;
  // The fan-out (RegionOptions::fan_out): this rank's forwards, grouped by round (1 and up) then
  // destination rank, and what it receives forwarded, grouped by round then forwarding rank.
  // `forwarding`: some rank forwards (the same on every rank; rounds > 1 then), so every rank
  // joins every exchange. Forwards are in rank_sent, rank_received and rank_local too.
  bool forwarding = false;
  std::vector<Transfer> forwards;
  std::vector<std::size_t> forward_first;  // rounds * world + 1
  std::vector<Transfer> forwarded;
  std::vector<std::size_t> forwarded_first;     // rounds * world + 1
  std::vector<std::uint64_t> forward_counts;    // per peer: bytes this rank forwards to it
  std::vector<std::uint64_t> forwarded_counts;  // per peer: bytes it forwards to this rank
  std::vector<ViewRef> source_views;            // this rank's, in the order it passes them
  std::vector<ViewRef> destination_views;       // this rank's
  // Parts per exchange on a device (RegionOptions::device_bucket_bytes): the busiest rank's
  // bytes sent plus received to and from other ranks, over the bucket, rounded up; at least 1.
  std::uint64_t device_parts = 1;
  // A hash of everything the ranks must agree on: world, every tensor's dtype, shape and boxes,
  // the options. Never 0.
  std::uint64_t fingerprint = 0;
};

// Elements in a box (CountOverflow past 64 bits).
SHARDGATHER_API std::uint64_t box_elements(const Box& box);

// The intersection of two boxes of the same rank; a box of zero size where they do not meet.
SHARDGATHER_API Box intersect(const Box& a, const Box& b);

// InvalidArgument, naming tensor `tensor` and the entry, unless every box fits its tensor (dims,
// offsets >= 0, sizes >= 0, offset + size <= shape) and every rank is in [0, world).
SHARDGATHER_API void check_regions(std::span<const TensorRegions> tensors, int world_size);

// The whole reshard for rank `rank`. InvalidArgument for a bad layout (check_regions) or a
// destination element that no source holds (naming the tensor, the destination rank and the
// element). Cost: every rank plans every tensor's pieces (O(pieces of the whole reshard)) and
// keeps its own.
// How many times plan_regions ran in this process: a plan plans when it is built, never per
// execution, which tests and tools/count-collectives check with it. Thread-safe.
SHARDGATHER_API std::uint64_t plan_regions_runs() noexcept;

SHARDGATHER_API RegionPlan plan_regions(std::span<const TensorRegions> tensors, int world_size,
                                        int rank, const RegionOptions& options = {});

}  // namespace shardgather
