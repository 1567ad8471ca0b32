// kDirect: one collective from the tensors' own memory straight into the final layout.
// No copy-in, no copy-out: the backend reads the send segments and writes the receive pieces
// (threads: one memcpy per byte per receiver; MPI: derived datatypes over absolute addresses).
#include <cstdint>
#include <functional>

#include "strategies/strategy.h"

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

void run_direct(const GatherJob& job, Communicator& comm, Deadline deadline,
                StrategyScratch& scratch) {
  std::byte* base = nullptr;
  if (contiguous_per_rank(job.pieces, job.first, job.counts, base, scratch.displs)) {
    comm.all_gather_v(job.send, base, job.counts, scratch.displs, deadline);
  } else {
    comm.all_gather_scatter(job.send, job.pieces, job.first, job.counts, deadline);
  }
}

}  // namespace shardgather::detail
