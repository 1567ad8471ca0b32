// Memory that every rank of a single-host communicator maps: a POSIX shared-memory object
// created by rank 0, mapped by all, unlinked once all have mapped it (so nothing is left in
// /dev/shm once the ranks unmap it, or die). Creation is collective; destruction is local.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "shardgather/communicator.h"

namespace shardgather::detail {

class SharedBuffer {
 public:
  // Collective over `comm`, whose ranks must all be on this host. OutOfMemory when /dev/shm
  // cannot hold `bytes` (reserved with posix_fallocate, so it never faults later).
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
