// Buffers that a failed collective may still touch. MPI cannot cancel a posted collective, and a
// c10d work cannot be cancelled either: after a Timeout or an abort the backend may still write
// the receive buffers and read the send buffers. Whoever owns such a buffer parks it here
// instead of freeing it: moved to storage that is never freed (a deliberate leak, kept
// reachable so leak checkers see it as intentional; the process is expected to end, see
// docs/errors.md).
//
// The bottom of the library: it depends on nothing but the standard library, and every layer
// may park what it owns (the transport's setup exchanges, the operations' buffers and scratch).
// Threading: park() may be called from any thread.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include "shardgather/communicator.h"

namespace shardgather::detail {

// Keeps `keep` alive forever. Never throws: if even that allocation fails, the object leaks.
void park_shared(std::shared_ptr<void> keep) noexcept;

// How many objects were parked so far (tests check that a failed call parks what it must).
std::size_t parked_count() noexcept;

// Moves `value` (a buffer, a vector, a unique_ptr to scratch) into the graveyard.
template <typename T>
void park(T& value) noexcept {
  try {
    park_shared(std::make_shared<T>(std::move(value)));
  } catch (...) {
    static_cast<void>(new (std::nothrow) T(std::move(value)));
  }
}

// comm.all_gather of `mine` into a new vector (world * mine.size() bytes); on a
// CommunicationError the vector is parked before the error propagates. For setup exchanges
// (records, tokens) of the transport and the operations.
std::vector<std::byte> gather_or_park(Communicator& comm, std::span<const std::byte> mine,
                                      Deadline deadline);

}  // namespace shardgather::detail
