// Pieces shared by the plan types (src/plan.cc, src/unshard.cc).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "detail/exec_scratch.h"

#include "shardgather/communicator.h"
#include "shardgather/errors.h"
#include "shardgather/foreach_all_gather.h"

namespace shardgather::detail {

std::string rank_prefix(int rank);

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

[[noreturn]] void raise_through_header(Communicator& comm, const Error& error, bool exchange,
                                       Deadline deadline);

}  // namespace shardgather::detail
