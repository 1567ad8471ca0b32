// Building a rank's send stream (a list of segments) without copying what need not be copied.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "copies/copy_table.h"

#include "shardgather/copy.h"
#include "shardgather/types.h"

namespace shardgather::detail {

// Alignment gaps are sent from here, so a gap never needs a copy.
inline constexpr std::byte kZeroBytes[8] = {};

// Where a tensor that cannot be sent from its own memory is packed, and where gaps come from.
// On the host: packed now, by pack(), into `at`. On a device: `at` and `zeros` are device memory,
// and each pack is recorded in `deferred`, which the device path runs as its first launch.
struct Stager {
  std::byte* at = nullptr;
  CopyTable* deferred = nullptr;
  const std::byte* zeros = kZeroBytes;  // at least 8 zero bytes

  // Packs `view` (`bytes` bytes) at `at`, which then advances past it; returns where it went.
  std::byte* stage(const TensorView& view, std::uint64_t bytes) {
    std::byte* to = at;
    if (deferred != nullptr) {
      deferred->add_pack(view, to);
    } else {
      pack(view, to);
    }
    at += bytes;
    return to;
  }
};

// Appends the bytes of `view` to `out`: straight from the tensor when it is contiguous and not
// `force_stage`d, else staged.
inline void append_tensor(const TensorView& view, std::uint64_t bytes, bool force_stage,
                          Stager& stager, std::vector<ConstSegment>& out) {
  if (bytes == 0) {
    return;
  }
  if (!force_stage && is_contiguous(view)) {
    out.push_back({static_cast<const std::byte*>(view.data), bytes});
    return;
  }
  out.push_back({stager.stage(view, bytes), bytes});
}

// Appends a rank-major block: `records` (may be empty), then each tensor at its offset inside
// the block (offsets[i] - base), preceded by zero gap bytes. send_first gets n + 1 entries: tensor
// i's segments are [send_first[i], send_first[i + 1]) (the records go with tensor 0).
template <typename ForceStage>
void append_block(std::span<const TensorView> params, std::span<const std::uint64_t> offsets,
                  std::uint64_t base, std::span<const std::uint64_t> sizes,
                  std::span<const std::byte> records, Stager& stager, ForceStage&& force_stage,
                  std::vector<ConstSegment>& out, std::vector<std::size_t>& send_first) {
  out.clear();
  send_first.clear();
  std::uint64_t end = 0;
  if (!records.empty()) {
    out.push_back({records.data(), records.size()});
    end = records.size();
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    send_first.push_back(i == 0 ? 0 : out.size());
    if (sizes[i] == 0) {
      continue;
    }
    const std::uint64_t offset = offsets[i] - base;
    if (offset > end) {
      out.push_back({stager.zeros, offset - end});
    }
    append_tensor(params[i], sizes[i], force_stage(i), stager, out);
    end = offset + sizes[i];
  }
  send_first.push_back(out.size());
}

}  // namespace shardgather::detail
