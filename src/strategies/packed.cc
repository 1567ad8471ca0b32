// kPacked: copy-in to one contiguous buffer, one collective, copy-out when the final layout is
// not the gathered one. The classic foreach (the seed's algorithm); copies use the copy pool.
#include "copies/parallel_copy.h"
#include "strategies/strategy.h"

namespace shardgather::detail {

void run_packed(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                StrategyScratch& scratch) {
  const auto me = static_cast<std::size_t>(comm.rank());
  const std::uint64_t mine = job.counts[me];
  scratch.packed.resize(mine);  // capacity kept across executions
  const RecvPiece packed_piece{scratch.packed.data(), mine, 1, 0};
  copy_stream_parallel(job.send, std::span(&packed_piece, 1), job.copy_threads);
  const ConstSegment packed{scratch.packed.data(), mine};
  const std::span<const ConstSegment> send(&packed, mine == 0 ? 0 : 1);

  // No scatter by the transport: the copy-out, when the final layout is not rank-major, runs on
  // the copy pool.
  gather_into_pieces(send, job.pieces, job.first, job.counts, false, job.copy_threads, comm,
                     deadline, scratch);
}

}  // namespace shardgather::detail
