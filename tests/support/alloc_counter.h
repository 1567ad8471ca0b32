// Counts heap allocations made by the calling thread (global operator new is replaced in
// alloc_counter.cc), so tests can assert that a steady-state execution allocates nothing.
#pragma once

#include <cstdint>

namespace shardgather::testing {

std::uint64_t thread_allocations() noexcept;

}  // namespace shardgather::testing
