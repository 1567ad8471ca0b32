// kPadded: for transports whose only variable-size move is an equal-size all_gather (c10d's
// allgather; Gloo without point to point): every rank's stream is padded with zeros to the
// largest rank's, gathered with one all_gather, and each rank's real bytes are copied to its
// pieces. The padding goes on the wire (the cost of not having a gather-v). Equal blocks that
// land adjacent in one destination are received in place, with no copy-out.
#include <algorithm>
#include <cstring>

#include "copies/parallel_copy.h"
#include "strategies/strategy.h"

#include "shardgather/copy.h"

namespace shardgather::detail {

namespace {

// This rank's stream as one block of `width` bytes: its one segment when that is exactly it,
// else packed into scratch with zero padding (so no stale bytes of an earlier call travel).
std::span<const std::byte> padded_send(std::span<const ConstSegment> send, std::uint64_t mine,
                                       std::uint64_t width, StrategyScratch& scratch) {
  const ConstSegment* only = nullptr;
  std::size_t nonempty = 0;
  for (const ConstSegment& s : send) {
    if (s.size != 0) {
      ++nonempty;
      only = &s;
    }
  }
  if (nonempty == 1 && only->size == width) {
    return {only->data, width};
  }
  scratch.padded.resize(width);  // capacity kept across executions
  copy_segments(send, scratch.padded.data());
  std::memset(scratch.padded.data() + mine, 0, width - mine);
  return {scratch.padded.data(), width};
}

}  // namespace

void gather_padded(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                   std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                   int copy_threads, Communicator& comm, Deadline deadline,
                   StrategyScratch& scratch) {
  const std::uint64_t width = *std::max_element(counts.begin(), counts.end());
  if (width == 0) {
    return;  // counts are the same on every rank: every rank skips
  }
  const std::size_t world = counts.size();
  const auto me = static_cast<std::size_t>(comm.rank());
  const std::span<const std::byte> mine = padded_send(send, counts[me], width, scratch);
  std::byte* base = nullptr;
  const bool equal =
      std::all_of(counts.begin(), counts.end(), [width](std::uint64_t c) { return c == width; });
  if (equal && contiguous_per_rank(pieces, first, counts, base, scratch.displs)) {
    bool adjacent = true;
    for (std::size_t r = 0; r < world; ++r) {
      adjacent = adjacent && scratch.displs[r] == r * width;
    }
    if (adjacent) {
      comm.all_gather(mine, std::span(base, world * width), deadline);
      return;
    }
  }
  scratch.gathered.resize(world * width);
  comm.all_gather(mine, scratch.gathered, deadline);
  for (std::size_t r = 0; r < world; ++r) {
    const ConstSegment block{scratch.gathered.data() + r * width, counts[r]};
    copy_stream_parallel(std::span(&block, 1), rank_part(pieces, first, r), copy_threads);
  }
}

}  // namespace shardgather::detail
