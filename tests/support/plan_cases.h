// Plan and unshard cases, shared by the threads and MPI suites like support/cases.h.
#pragma once

#include "shardgather/shardgather.h"

namespace shardgather::testing {

// An AllGatherPlan built with and without a hint, executed many times into one buffer with
// every strategy: bit-exact each time, 0 metadata collectives, 0 allocations per execution.
void case_plan_steady_state(Communicator& comm);
// execute_shared: gathered bytes read in place (node-shared window), bit-exact every step,
// no allocation in steady state.
void case_plan_execute_shared(Communicator& comm);
// A plan rejects tensors that do not match it, on every rank, and stays usable.
void case_plan_rejects_mismatched_tensors(Communicator& comm);
// unshard over dims 0, 1 and last; chunk, explicit uneven, padded and empty shards; every
// strategy; against the full tensors the shards were cut from.
void case_unshard_dims(Communicator& comm);
// One dim-0 parameter: gathered straight into the full tensor, nothing staged; steady state
// allocates nothing.
void case_unshard_single_dim0(Communicator& comm);
// An output overlapping a shard is an InvalidArgument on every rank.
void case_unshard_aliasing(Communicator& comm);

// A gather to one rank (UnshardPlan's dst) for every dst: bit-exact there, nothing elsewhere.
void case_unshard_to_dst(Communicator& comm);
void case_dst_in_plan_options(Communicator& comm);
// UnshardStream over many buckets, every prefetch depth, to every rank and to one: bucket by
// bucket bit-exact, in order, over at most prefetch + 1 buffers.
void case_unshard_stream(Communicator& comm);
// A stream that disagrees or gets a wrong shard raises on every rank before anything moves; a
// consumer failing on one rank ends the stream with its error on every rank.
void case_unshard_stream_errors(Communicator& comm);

// A rank stalling past the deadline mid-stream: every rank raises Timeout, nothing hangs. Poisons
// the communicator (threads: a fresh group per test).
void case_unshard_stream_timeout(Communicator& comm);

// kHierarchical: plans bit-exact over uneven, empty and one-sided lists, with and without the
// header; it runs where the ranks span hosts and some host has several (kDirect elsewhere).
void case_hierarchical(Communicator& comm);
// A one-shot foreach_all_gather with every strategy, with and without the hint: bit-exact, and
// run as asked or by the documented fallback (kAuto: direct); ranks asking for different
// strategies raise Mismatch on every rank.
void case_foreach_strategies(Communicator& comm);
// Ranks spanning hosts whose plans disagree (hierarchical on some, direct on one): Mismatch
// ("strategy differs") on every rank from the header, no hang (docs/reliability.md, D).
void case_hierarchical_disagreement(Communicator& comm);
// kAuto past the window's threshold: the first kAutoTrialRuns executions alternate the window
// (kShared on one host, kHierarchical across hosts) and kDirect, then one choice stays and why
// says "measured: ..."; where no window applies, kDirect by the rule. An explicit strategy pins.
void case_auto_measures(Communicator& comm);
// Communicator::all_to_all_scatter: per-pair sizes (some zero, the own pair included), two
// segments out, a strided and a plain piece in, twice (the second from any datatype cache).
void case_all_to_all_scatter(Communicator& comm);

}  // namespace shardgather::testing
