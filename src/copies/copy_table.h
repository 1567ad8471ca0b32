// The descriptor table of one fused copy launch, built on the host from the planner's views and
// the strategy layer's streams (the same inputs the host copies take), then uploaded and run by
// one kernel (copies/device_runtime.h). Building it is pure: no device, no allocation once its
// vector has grown to size (a plan reuses one table across executions).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "copies/copy_desc.h"

#include "shardgather/types.h"

namespace shardgather::detail {

class CopyTable {
 public:
  // Forgets every copy; keeps the capacity.
  void clear() noexcept;

  // `bytes` contiguous bytes from src to dst.
  void add_bytes(const std::byte* src, std::byte* dst, std::uint64_t bytes);
  // Every element of `src` (any strides, zero and negative included) in row-major order to the
  // contiguous `dst`: pack(), as one or a few descriptors.
  void add_pack(const TensorView& src, std::byte* dst);
  // The concatenation of `src` into the concatenation of the pieces' blocks (copy_stream()):
  // whole strided blocks inside one segment become one two-dimensional descriptor.
  void add_stream(std::span<const ConstSegment> src, std::span<const RecvPiece> dst);

  // Sets every descriptor's width and first block; call once after the last add.
  void finish() noexcept;

  [[nodiscard]] std::span<const CopyDesc> descs() const noexcept { return descs_; }
  [[nodiscard]] std::uint64_t blocks() const noexcept { return blocks_; }
  [[nodiscard]] std::uint64_t bytes() const noexcept;

 private:
  void add_strided(std::uint64_t src, std::uint64_t dst, std::uint64_t run, int ndim,
                   const std::int64_t* extent, const std::int64_t* src_stride,
                   const std::int64_t* dst_stride);

  std::vector<CopyDesc> descs_;
  std::uint64_t blocks_ = 0;
};

// Runs a finished table on the host, block by block and thread by thread exactly as the kernel
// partitions it (the CPU tests' oracle for the kernel's index arithmetic; memory must be host).
void run_on_host(const CopyTable& table) noexcept;
// The same over a table's descriptors and block count.
void run_on_host(std::span<const CopyDesc> descs, std::uint64_t blocks) noexcept;

}  // namespace shardgather::detail
