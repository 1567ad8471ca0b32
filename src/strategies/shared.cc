// kShared: one copy into a node-shared window, a barrier, one copy out (or none: the caller
// can read the window itself, see AllGatherPlan::execute_shared). The MPI-3 shared-window idea
// done with a POSIX shared-memory object, so it serves every backend whose ranks share a host.
// One window per plan, as large as the gathered bytes. A rank may overwrite its region for
// call k + 1 only once every rank has entered call k + 1 (and so is done reading call k): the
// pre-flight header already proves that; without it, one extra barrier does.
#include <cstring>

#include "copies/parallel_copy.h"
#include "strategies/strategy.h"

#include "shardgather/copy.h"
#include "shardgather/layout.h"

namespace shardgather::detail {

bool shared_available(const Communicator& comm) noexcept {
  return comm.size() > 1 && comm.ranks_on_host() == comm.size();
}

std::span<const std::uint64_t> window_displs(const ExchangeJob& job, StrategyScratch& scratch) {
  if (!job.stream_displs.empty()) {
    return job.stream_displs;
  }
  scratch.displs.resize(job.counts.size());
  place_blocks(job.counts, 8, scratch.displs);
  return scratch.displs;
}

std::byte* window_round(const ExchangeJob& job, std::span<const std::uint64_t> displs,
                        Communicator& comm, Deadline deadline, StrategyScratch& scratch) {
  const std::size_t world = job.counts.size();
  const std::uint64_t round_bytes = displs[world - 1] + job.counts[world - 1];
  if (!scratch.window || scratch.window_bytes != round_bytes) {
    // Collective: every rank reaches this on its first windowed execution of this plan, and a
    // fresh window has no reader yet.
    scratch.window.reset();
    const std::uint64_t before = comm.collectives_issued();
    try {
      scratch.window = SharedBuffer::create(comm, round_bytes, deadline);
    } catch (...) {
      // Counted even when it fails: kAuto then falls back and reports these as setup.
      scratch.setup_collectives += comm.collectives_issued() - before;
      throw;
    }
    scratch.setup_collectives += comm.collectives_issued() - before;
    scratch.window_bytes = round_bytes;
  } else if (!job.entry_synchronized) {
    comm.barrier(deadline);  // nobody may still be reading the previous call's bytes
  }
  std::byte* base = scratch.window->data();
  const auto me = static_cast<std::size_t>(comm.rank());
  const RecvPiece mine{base + displs[me], job.counts[me], 1, 0};
  copy_stream_parallel(job.send, std::span(&mine, 1), job.copy_threads);
  return base;
}

void copy_out_window(const ExchangeJob& job, const std::byte* base,
                     std::span<const std::uint64_t> displs) {
  for (std::size_t r = 0; r < job.counts.size(); ++r) {
    const ConstSegment stream{base + displs[r], job.counts[r]};
    copy_stream_parallel(std::span(&stream, 1), rank_part(job.pieces, job.first, r),
                         job.copy_threads);
  }
}

std::byte* shared_copy_in(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                          StrategyScratch& scratch) {
  std::byte* base = window_round(job, window_displs(job, scratch), comm, deadline, scratch);
  comm.barrier(deadline);
  return base;
}

void run_shared(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                StrategyScratch& scratch) {
  const std::byte* base = shared_copy_in(job, comm, deadline, scratch);
  copy_out_window(job, base, window_displs(job, scratch));
}

}  // namespace shardgather::detail
