#include "shardgather/buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <string>

#include "shardgather/errors.h"

namespace shardgather {

namespace {
constexpr std::uint64_t kHugePageBytes = std::uint64_t{2} << 20;
}  // namespace

AlignedBuffer::AlignedBuffer(std::uint64_t bytes) : size_(bytes) {
  if (bytes == 0) {
    return;
  }
  // Large buffers get 2 MiB alignment and transparent huge pages: first touch of a 4 KiB page
  // costs about 40x more than of its share of a huge page on the machines this targets.
  const std::uint64_t alignment = bytes >= 2 * kHugePageBytes ? kHugePageBytes : 64;
  const std::uint64_t rounded = (bytes + alignment - 1) / alignment * alignment;
  if (rounded < bytes) {
    throw OutOfMemory("cannot allocate " + std::to_string(bytes) + " bytes");
  }
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) {
    throw OutOfMemory("cannot allocate " + std::to_string(bytes) + " bytes for the output");
  }
  if (alignment == kHugePageBytes) {
    (void)::madvise(p, rounded, MADV_HUGEPAGE);  // advisory: failure only costs speed
  }
  data_.reset(static_cast<std::byte*>(p));
}

AlignedBuffer::AlignedBuffer(DeviceAllocation memory, std::uint64_t bytes, Device device) noexcept
    : data_(memory.data, Free{memory.release, memory.context}), size_(bytes), device_(device) {
  if (memory.data != nullptr && memory.release == nullptr) {
    // Nothing to give back: not std::free's either.
    data_.get_deleter().release = [](std::byte* /*data*/, void* /*context*/) noexcept {};
  }
}

void AlignedBuffer::Free::operator()(std::byte* p) const noexcept {
  if (release != nullptr) {
    release(p, context);
  } else {
    std::free(p);
  }
}

}  // namespace shardgather
