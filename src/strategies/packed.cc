// kPacked: copy-in to one contiguous buffer, one collective, copy-out when the final layout is
// not the gathered one. The classic foreach (the seed's algorithm); copies use the copy pool.
#include "detail/parallel_copy.h"
#include "strategies/strategy.h"

namespace shardgather::detail {

void run_packed(const GatherJob& job, Communicator& comm, Deadline deadline,
                StrategyScratch& scratch) {
  const auto me = static_cast<std::size_t>(comm.rank());
  const std::uint64_t mine = job.counts[me];
  scratch.packed.resize(mine);  // capacity kept across executions
  const RecvPiece packed_piece{scratch.packed.data(), mine, 1, 0};
  copy_stream_parallel(job.send, std::span(&packed_piece, 1), job.copy_threads);
  const ConstSegment packed{scratch.packed.data(), mine};
  const std::span<const ConstSegment> send(&packed, mine == 0 ? 0 : 1);

  std::byte* base = nullptr;
  if (contiguous_per_rank(job.pieces, job.first, job.counts, base, scratch.displs)) {
    comm.all_gather_v(send, base, job.counts, scratch.displs, deadline);
    return;
  }
  // Gather rank-major into scratch, then copy every rank's stream out to its pieces.
  std::uint64_t total = 0;
  scratch.displs.resize(job.counts.size());
  for (std::size_t r = 0; r < job.counts.size(); ++r) {
    scratch.displs[r] = total;
    total += job.counts[r];
  }
  scratch.gathered.resize(total);
  comm.all_gather_v(send, scratch.gathered.data(), job.counts, scratch.displs, deadline);
  for (std::size_t r = 0; r < job.counts.size(); ++r) {
    const ConstSegment stream{scratch.gathered.data() + scratch.displs[r], job.counts[r]};
    copy_stream_parallel(std::span(&stream, 1),
                         job.pieces.subspan(job.first[r], job.first[r + 1] - job.first[r]),
                         job.copy_threads);
  }
}

}  // namespace shardgather::detail
