// kPerTensor: one collective per tensor, the baseline every benchmark compares against.
#include "strategies/strategy.h"

namespace shardgather::detail {

void run_per_tensor(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                    StrategyScratch& scratch) {
  const std::size_t world = job.counts.size();
  const std::size_t n = job.parts.count;
  scratch.counts.resize(world);
  scratch.first.resize(world + 1);
  for (std::size_t i = 0; i < n; ++i) {
    scratch.pieces.clear();
    scratch.first[0] = 0;
    bool any = false;
    for (std::size_t r = 0; r < world; ++r) {
      const std::size_t part = r * n + i;
      scratch.counts[r] = job.parts.bytes[part];
      any = any || scratch.counts[r] != 0;
      for (std::size_t k = job.parts.first[part]; k < job.parts.first[part + 1]; ++k) {
        scratch.pieces.push_back(job.pieces[k]);
      }
      scratch.first[r + 1] = scratch.pieces.size();
    }
    if (!any) {
      continue;
    }
    const auto send = job.send.subspan(job.parts.send_first[i],
                                       job.parts.send_first[i + 1] - job.parts.send_first[i]);
    gather_into_pieces(send, scratch.pieces, scratch.first, scratch.counts, true, job.copy_threads,
                       comm, deadline, scratch);
  }
}

}  // namespace shardgather::detail
