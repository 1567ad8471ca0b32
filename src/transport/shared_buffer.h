// Memory that the ranks of one host map together: a POSIX shared-memory object per host,
// created by the host's lowest rank, mapped by that host's ranks, unlinked once every rank has
// mapped its host's (so nothing is left in /dev/shm once the ranks unmap it, or die). Creation
// is collective over the whole communicator; destruction is local.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "shardgather/communicator.h"

namespace shardgather::detail {

class SharedBuffer {
 public:
  // Collective over `comm`: every rank gets `bytes` shared with the ranks of its host
  // (Communicator::hosts(); all of them where that is empty and every rank is on this host).
  // OutOfMemory on every rank when some host's /dev/shm cannot hold `bytes` (reserved with
  // posix_fallocate, so it never faults later); InvalidArgument where hosts are unknown.
  static std::unique_ptr<SharedBuffer> create(Communicator& comm, std::uint64_t bytes,
                                              Deadline deadline);
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;
  SharedBuffer(SharedBuffer&&) = delete;
  SharedBuffer& operator=(SharedBuffer&&) = delete;
  ~SharedBuffer();

  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

 private:
  SharedBuffer(std::byte* data, std::uint64_t size) : data_(data), size_(size) {}
  std::byte* data_;
  std::uint64_t size_;
};

}  // namespace shardgather::detail
