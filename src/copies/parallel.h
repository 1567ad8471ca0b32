// A process-wide pool of copy workers, so copy-in and copy-out of large lists use every core the
// rank may use. Created on first use, never resized; parallel_for allocates nothing.
#pragma once

#include <cstddef>

namespace shardgather::detail {

// Runs fn(ctx, k) for k in [0, tasks) on up to `threads` threads (the caller included) and
// returns when all are done. Reentrant calls from different threads serialise on the pool.
void parallel_for(std::size_t tasks, int threads, void (*fn)(void* ctx, std::size_t k), void* ctx);

// How many copy threads a rank should use when `ranks_here` ranks share this host.
int default_copy_threads(int ranks_here) noexcept;

}  // namespace shardgather::detail
