// kHierarchical: ranks on several hosts. The node-shared window of kShared, one per host, and
// between the hosts each stream crosses the network once per receiving host:
//   1. every rank copies its stream into its host's window (for the ranks of its host);
//   2. one personal exchange (an ExchangeJob of shape kPersonal, run by kDirect): every rank
//      sends its stream, from its region of the window, to one rank of every other host (the
//      one whose local index is the sender's, modulo that host's rank count, so all ranks of a
//      host share the receiving), which lands it in that host's window;
//   3. a barrier: every window now holds every rank's stream;
//   4. every rank copies out from its window.
// Flat kDirect moves each stream once per receiving *rank*: with K ranks on each host, K times
// the bytes over the same links. The reuse rule is kShared's: a rank overwrites its window for
// call k + 1 only once every rank has entered call k + 1 (the pre-flight header proves it;
// without it, one barrier more).
#include <algorithm>

#include "strategies/strategy.h"

namespace shardgather::detail {

namespace {

// Fills scratch's exchange lists: this rank's stream to its receiver on every other host, and,
// into the window, every stream this rank receives for its host. O(world), and allocation-free
// once the vectors have their sizes.
void plan_exchange(const ExchangeJob& job, std::span<const int> hosts, std::size_t me,
                   std::byte* base, std::span<const std::uint64_t> displs,
                   StrategyScratch& scratch) {
  const std::size_t world = hosts.size();
  const auto num_hosts =
      static_cast<std::size_t>(*std::max_element(hosts.begin(), hosts.end()) + 1);
  // members[start[h] ..): host h's ranks in order; local[r]: r's index among them.
  std::vector<std::size_t>& start = scratch.host_start;
  std::vector<std::size_t>& members = scratch.host_members;
  std::vector<std::size_t>& local = scratch.host_local;
  start.assign(num_hosts + 1, 0);
  local.resize(world);
  members.resize(world);
  for (std::size_t r = 0; r < world; ++r) {
    local[r] = start[static_cast<std::size_t>(hosts[r]) + 1]++;
  }
  for (std::size_t h = 0; h < num_hosts; ++h) {
    start[h + 1] += start[h];
  }
  for (std::size_t r = 0; r < world; ++r) {
    members[start[static_cast<std::size_t>(hosts[r])] + local[r]] = r;
  }
  // The rank of host h that receives the streams of local index l.
  const auto receiver = [&](std::size_t h, std::size_t l) {
    return members[start[h] + l % (start[h + 1] - start[h])];
  };
  const auto mine = static_cast<std::size_t>(hosts[me]);
  scratch.a2a_send.clear();
  scratch.a2a_send_first.resize(world + 1);
  scratch.a2a_pieces.clear();
  scratch.a2a_first.resize(world + 1);
  scratch.a2a_counts.assign(world, 0);
  for (std::size_t p = 0; p < world; ++p) {
    const auto theirs = static_cast<std::size_t>(hosts[p]);
    scratch.a2a_send_first[p] = scratch.a2a_send.size();
    if (theirs != mine && job.counts[me] != 0 && receiver(theirs, local[me]) == p) {
      // From this rank's region of the window, which window_round has filled: one contiguous
      // run however many tensors the stream has (no staging on transports that need that).
      scratch.a2a_send.push_back(ConstSegment{base + displs[me], job.counts[me]});
    }
    scratch.a2a_first[p] = scratch.a2a_pieces.size();
    if (theirs != mine && job.counts[p] != 0 && receiver(mine, local[p]) == me) {
      scratch.a2a_pieces.push_back(RecvPiece{base + displs[p], job.counts[p], 1, 0});
      scratch.a2a_counts[p] = job.counts[p];
    }
  }
  scratch.a2a_send_first[world] = scratch.a2a_send.size();
  scratch.a2a_first[world] = scratch.a2a_pieces.size();
}

}  // namespace

bool hierarchical_available(const Communicator& comm) noexcept {
  const std::span<const int> hosts = comm.hosts();
  if (!comm.capabilities().all_to_all || hosts.size() != static_cast<std::size_t>(comm.size()) ||
      hosts.empty()) {
    return false;
  }
  const int num_hosts = *std::max_element(hosts.begin(), hosts.end()) + 1;
  return num_hosts > 1 && comm.size() > num_hosts;
}

void run_hierarchical(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                      StrategyScratch& scratch) {
  const std::span<const std::uint64_t> displs = window_displs(job, scratch);
  std::byte* base = window_round(job, displs, comm, deadline, scratch);
  plan_exchange(job, comm.hosts(), static_cast<std::size_t>(comm.rank()), base, displs, scratch);
  const ExchangeJob between_hosts{.shape = ExchangeShape::kPersonal,
                                  .send = scratch.a2a_send,
                                  .send_first = scratch.a2a_send_first,
                                  .pieces = scratch.a2a_pieces,
                                  .first = scratch.a2a_first,
                                  .counts = scratch.a2a_counts};
  run_direct(between_hosts, comm, deadline, scratch);
  comm.barrier(deadline);
  copy_out_window(job, base, displs);
}

}  // namespace shardgather::detail
