// Pieces shared by the plan types (src/plan.cc, src/unshard.cc).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "detail/exec_scratch.h"
#include "strategies/strategy.h"

#include "shardgather/communicator.h"
#include "shardgather/errors.h"
#include "shardgather/foreach_all_gather.h"
#include "shardgather/plan.h"

namespace shardgather::detail {

std::string rank_prefix(int rank);

// Resolves `requested` and moves the job's payload: a local copy at world size 1, nothing when
// no rank sends a byte, else the strategy. Fills stats.strategy and the collective counts. On a
// CommunicationError it gives up the scratch (a posted collective may still use it) and
// rethrows.
void run_payload(Strategy requested, const GatherJob& job, Communicator& comm, Deadline deadline,
                 ScratchHolder& scratch, ExecStats& stats);

// A plan's pre-flight: exchange_headers into the scratch's buffers. On a CommunicationError it
// gives up the scratch (the header buffer may still be written) and rethrows.
void exchange_plan_header(Communicator& comm, const PreflightHeader& header, ScratchHolder& scratch,
                          Deadline deadline);

// Sizes the scratch for world ranks of n tensors (no-op when already sized).
void size_scratch(ExecScratch& x, int world, std::size_t n);

// For an operation whose local preparation failed before it could build its header: sends a
// header that carries the failure (with the next op sequence number), so that every rank,
// this one included, raises the same error from the same call. With no exchange (world 1 or
// pre-flight off) it raises locally.
// MPI cannot cancel a posted collective: after a Timeout or abort it may still write the
// receive buffers and read the send buffers. Callers catch CommunicationError around the
// payload and hand their buffers here, which moves them to heap storage that is never freed
// (a deliberate leak: the process is expected to end, see docs/errors.md).
void leak(AlignedBuffer& buffer) noexcept;
void leak(std::vector<std::byte>& buffer) noexcept;

// comm.all_gather of `mine` into a new vector (world * mine.size() bytes); on a
// CommunicationError the vector is leaked before the error propagates.
std::vector<std::byte> gather_or_leak(Communicator& comm, std::span<const std::byte> mine,
                                      Deadline deadline);

[[noreturn]] void raise_through_header(Communicator& comm, const Error& error, bool exchange,
                                       Deadline deadline);

}  // namespace shardgather::detail
