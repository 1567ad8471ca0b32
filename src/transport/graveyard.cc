#include "transport/graveyard.h"

#include <mutex>

#include "shardgather/errors.h"

namespace shardgather::detail {

namespace {

struct Graveyard {
  std::mutex mu;
  std::vector<std::shared_ptr<void>> kept;
};

Graveyard& graveyard() {
  static auto* g = new Graveyard;  // never destroyed: outlives any late write
  return *g;
}

}  // namespace

void park_shared(std::shared_ptr<void> keep) noexcept {
  try {
    Graveyard& g = graveyard();
    const std::lock_guard<std::mutex> lock(g.mu);
    g.kept.push_back(std::move(keep));
  } catch (...) {
    static_cast<void>(new (std::nothrow) std::shared_ptr<void>(std::move(keep)));
  }
}

std::size_t parked_count() noexcept {
  Graveyard& g = graveyard();
  const std::lock_guard<std::mutex> lock(g.mu);
  return g.kept.size();
}

std::vector<std::byte> gather_or_park(Communicator& comm, std::span<const std::byte> mine,
                                      Deadline deadline) {
  std::vector<std::byte> all(mine.size() * static_cast<std::size_t>(comm.size()));
  try {
    comm.all_gather(mine, all, deadline);
  } catch (const CommunicationError&) {
    park(all);
    throw;
  }
  return all;
}

}  // namespace shardgather::detail
