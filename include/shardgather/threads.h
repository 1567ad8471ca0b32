// The threads backend: N ranks inside one process, one thread per rank, sharing memory.
//
// Contract:
//  1. Collectives are matched by call order, as for every backend.
//  2. Each communicator is driven by one thread (normally rank r's thread); abort() from any.
//  3. Any number of groups may coexist; a group lives while any of its communicators does.
//  4. Host memory: a gather copies each peer's bytes straight from the peer's own buffers (one
//     copy, done by the receiving thread): no staging buffer. In a CUDA build also device
//     memory (capabilities().device_memory): each receiver copies with cudaMemcpyAsync on its
//     own call's stream, after the sender's stream was synchronised.
// A Timeout or abort on one rank poisons the whole group: the peers wake at once with the
// same class (Timeout or Aborted), instead of each waiting out its own deadline.
#pragma once

#include <memory>
#include <vector>

#include "shardgather/communicator.h"
#include "shardgather/export.h"

namespace shardgather {

// One communicator per rank; element r is rank r. InvalidArgument unless world_size >= 1.
SHARDGATHER_API std::vector<std::unique_ptr<Communicator>> make_thread_group(int world_size);
// The same with simulated hosts, for testing what depends on them (the hierarchical strategy):
// hosts[r] is rank r's host, numbered 0, 1, ... in the order of each host's lowest rank. Only
// hosts() and ranks_on_host() change: the memory is still one process's.
SHARDGATHER_API std::vector<std::unique_ptr<Communicator>> make_thread_group(
    int world_size, std::vector<int> hosts);

}  // namespace shardgather
