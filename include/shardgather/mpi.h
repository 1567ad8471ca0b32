// The MPI backend. The only public header that includes <mpi.h>.
//
// Contract (following ProcessGroupMPI):
//  1. Collectives are matched by call order on the communicator, as MPI requires.
//  2. MPI must be initialised by the caller (the library never calls MPI_Init) with at least
//     MPI_THREAD_FUNNELED, and one thread drives the communicator; MPI_THREAD_SERIALIZED if
//     different threads take turns. abort() only sets a flag and may be called from any thread.
//  3. Any number may coexist: each duplicates the caller's MPI_Comm (MPI_Comm_dup), so its
//     traffic never matches the caller's. The duplicate is freed by the destructor, which must
//     run before MPI_Finalize.
//  4. Host memory only (no CUDA-aware paths yet).
// Deadlines are enforced by posting nonblocking collectives (MPI_Iallgatherv) and testing them.
// MPI cannot cancel a posted collective: after a Timeout the communicator is poisoned and the
// process should end (a killed or stalled rank cannot be recovered from in MPI-3).
// Transfers above INT_MAX bytes per rank or in total switch to chunked broadcasts of at most
// max_chunk_bytes, so no count is narrowed to int.
#pragma once

#include <cstdint>
#include <memory>

#include <mpi.h>

#include "shardgather/communicator.h"
#include "shardgather/export.h"

namespace shardgather {

struct MpiOptions {
  // Largest message the chunked path sends at once (and the threshold that selects it).
  // Tests lower it to exercise the chunked path on small data.
  // Must be the same on every rank: the chunks of one transfer are matched message by message.
  std::uint64_t max_chunk_bytes = std::uint64_t{1} << 30;
  // How a blocked call polls MPI_Test. Open MPI progresses only inside MPI calls, so a waiting
  // rank spins; kAuto yields the core between tests (sched_yield) only when this host has more
  // ranks than cores. kYield always yields: for ranks that share cores in a way the host count
  // cannot see (several simulated hosts, containers, on one machine's cores). kSpin never does.
  enum class Wait : std::uint8_t { kAuto, kYield, kSpin };
  Wait wait = Wait::kAuto;
  // How a personal exchange (a reshard's) moves. kPointToPoint: one nonblocking send and receive
  // per pair that has bytes (a rank with nothing to move posts nothing). kAlltoallw: one
  // MPI_Ialltoallw over the same datatypes, with pairs above max_chunk_bytes sent point to point
  // after it. Must be the same on every rank: the collective and the point-to-point messages do
  // not match each other.
  enum class Exchange : std::uint8_t { kPointToPoint, kAlltoallw };
  // Every rank must make its communicator with the same one: the pre-flight header carries it
  // (Capabilities::exchange_form), and ranks that differ raise Mismatch before anything moves.
  Exchange exchange = Exchange::kPointToPoint;
};

SHARDGATHER_API std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm,
                                                                    const MpiOptions& options = {});

}  // namespace shardgather
