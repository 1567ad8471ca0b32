// Owning host memory for gathered results: the library's one output allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "shardgather/export.h"

namespace shardgather {

// 64-byte aligned host memory. Owning, movable, not copyable.
class SHARDGATHER_API AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // OutOfMemory when the allocation fails.
  explicit AlignedBuffer(std::uint64_t bytes);
  [[nodiscard]] std::byte* data() const noexcept { return data_.get(); }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

 private:
  struct Free {
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte, Free> data_;
  std::uint64_t size_ = 0;
};

}  // namespace shardgather
