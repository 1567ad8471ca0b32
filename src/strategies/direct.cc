// kDirect: one collective from the tensors' own memory straight into the final layout.
// No copy-in, no copy-out: the backend reads the send segments and writes the receive pieces
// (threads: one memcpy per byte per receiver; MPI: derived datatypes over absolute addresses).
#include <cstdint>
#include <functional>

#include "copies/parallel_copy.h"
#include "strategies/strategy.h"

#include "shardgather/copy.h"

namespace shardgather::detail {

bool contiguous_per_rank(std::span<const RecvPiece> pieces, std::span<const std::size_t> first,
                         std::span<const std::uint64_t> counts, std::byte*& base,
                         std::vector<std::uint64_t>& displs) {
  const std::size_t world = counts.size();
  displs.resize(world);
  std::byte* lowest = nullptr;
  for (std::size_t r = 0; r < world; ++r) {
    std::byte* expect = nullptr;
    for (std::size_t k = first[r]; k < first[r + 1]; ++k) {
      const RecvPiece& p = pieces[k];
      if (p.block == 0 || p.count == 0) {
        continue;
      }
      if (p.count != 1 && p.stride != p.block) {
        return false;
      }
      if (expect != nullptr && p.data != expect) {
        return false;
      }
      if (expect == nullptr) {
        displs[r] = reinterpret_cast<std::uintptr_t>(p.data);
        if (lowest == nullptr || std::less<>()(p.data, lowest)) {
          lowest = p.data;
        }
      }
      expect = p.data + p.block * p.count;
    }
  }
  base = lowest;
  const auto low = reinterpret_cast<std::uintptr_t>(lowest);
  for (std::size_t r = 0; r < world; ++r) {
    displs[r] = counts[r] == 0 ? 0 : displs[r] - low;
  }
  return true;
}

void gather_into_pieces(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                        std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                        bool may_scatter, int copy_threads, Communicator& comm, Deadline deadline,
                        StrategyScratch& scratch) {
  const Capabilities caps = comm.capabilities();
  if (!caps.gather_v) {
    gather_padded(send, pieces, first, counts, copy_threads, comm, deadline, scratch);
    return;
  }
  std::byte* base = nullptr;
  if (contiguous_per_rank(pieces, first, counts, base, scratch.displs)) {
    comm.all_gather_v(send, base, counts, scratch.displs, deadline);
    return;
  }
  if (may_scatter && caps.scatter) {
    comm.all_gather_scatter(send, pieces, first, counts, deadline);
    return;
  }
  // Rank-major into scratch, then every rank's stream out to its pieces.
  scratch.displs.resize(counts.size());
  std::uint64_t total = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    scratch.displs[r] = total;
    total += counts[r];
  }
  scratch.gathered.resize(total);  // capacity kept across executions
  comm.all_gather_v(send, scratch.gathered.data(), counts, scratch.displs, deadline);
  for (std::size_t r = 0; r < counts.size(); ++r) {
    const ConstSegment stream{scratch.gathered.data() + scratch.displs[r], counts[r]};
    copy_stream_parallel(std::span(&stream, 1), rank_part(pieces, first, r), copy_threads);
  }
}

void run_direct(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                StrategyScratch& scratch) {
  switch (job.shape) {
    case ExchangeShape::kGather:
      comm.gather_scatter(job.send, job.pieces, job.first, job.counts, job.root, deadline);
      return;
    case ExchangeShape::kPersonal:
      comm.all_to_all_scatter(job.send, job.send_first, job.pieces, job.first, deadline);
      return;
    case ExchangeShape::kAllGather:
      gather_into_pieces(job.send, job.pieces, job.first, job.counts, true, job.copy_threads, comm,
                         deadline, scratch);
      return;
  }
}

}  // namespace shardgather::detail
