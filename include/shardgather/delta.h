// Delta records for weight sync: a bucket (a contiguous range of n elements of es bytes) is sent
// as only the elements that changed since the last sync, and the receiver checks that it ends
// up holding exactly the sender's bytes.
//
//   std::vector<std::byte> rec(max_record_bytes(n, 2));
//   EncodeResult e = encode(last_sent, now, n, 2, /*bucket=*/7, /*dense_ratio=*/0.5, rec);
//   ... send rec[0, e.bytes) (nothing when e.encoding == Encoding::kNone) ...
//   ApplyResult a = apply(received, view, start, n);  // a.checksum_ok, or resync densely
//
// Record format (wire format: never change a field's meaning; little-endian; a record is a
// multiple of 8 bytes long, so records laid end to end each start 8-byte aligned if the first
// does):
//
//   u32 magic = kMagic ("SGDL")   u32 bucket (the caller's id, echoed)
//   u8 encoding (Encoding)        u8 elem_size (1, 2, 4 or 8)   u16 zero
//   u32 count (dense: n; pairs: pairs; runs: runs)
//   u64 elements (n)
//   u64 checksum (checksum() of the bucket's n * es new bytes)
//   u64 payload_bytes (what follows the 40-byte header, padding included; a multiple of 8)
//   payload:
//     dense: the n * es new bytes
//     pairs: count u32 indices (strictly ascending, < n), then count * es value bytes
//     runs:  count (u32 start, u32 length) (ascending, non-overlapping, length >= 1, in range),
//            then the values of every run concatenated (sum(length) * es bytes)
//     then zeros up to a multiple of 8.
//
// Elements compare bitwise (their bytes): two NaNs with the same bits are equal, +0 and -0
// differ. The checksum is not cryptographic: it catches corruption and missed updates (a
// receiver whose bucket did not hold the sender's previous bytes), not an adversary.
//
// Every function is pure computation on the caller's thread over host memory; concurrent calls
// on distinct outputs are safe. encode() keeps a per-thread scratch list of changed ranges
// (about 8 bytes per changed range of the largest sparse bucket the thread encoded), so the
// steady state does not allocate; apply() and view_checksum() never allocate.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "shardgather/export.h"

namespace shardgather::delta {

inline constexpr std::uint32_t kMagic = 0x4C444753U;  // "SGDL" in little-endian bytes
inline constexpr std::size_t kHeaderBytes = 40;
// A view's dims after coalescing (apply, view_checksum): more is InvalidArgument.
inline constexpr std::size_t kMaxDims = 64;

// Wire codes: never renumber.
enum class Encoding : std::uint8_t { kNone = 0, kDense = 1, kPairs = 2, kRuns = 3 };

// A 64-bit checksum of `bytes` bytes: four independent multiply-xor lanes over 32-byte blocks
// (the last block zero-padded), the length mixed in, then an avalanche. Not cryptographic.
// About 10 GB/s per core on AVX2-class machines (memory bound beyond the caches).
[[nodiscard]] SHARDGATHER_API std::uint64_t checksum(const void* p, std::size_t bytes) noexcept;

// checksum() computed in pieces: update() with the bytes in order, split anywhere, then finish()
// gives checksum() of their concatenation. finish() does not change the state (update() may go
// on after it).
class SHARDGATHER_API Hasher {
 public:
  Hasher() noexcept;
  void update(const void* p, std::size_t bytes) noexcept;
  [[nodiscard]] std::uint64_t finish() const noexcept;

 private:
  std::array<std::uint64_t, 4> lanes_;
  std::array<std::byte, 32> pending_{};  // a partial block, waiting for the rest of its bytes
  std::size_t pending_bytes_ = 0;
  std::uint64_t length_ = 0;
};

// The largest record of a bucket (its dense record): 40 + n * es rounded up to 8.
[[nodiscard]] SHARDGATHER_API std::size_t max_record_bytes(std::size_t n, std::size_t es) noexcept;

struct EncodeResult {
  std::size_t bytes = 0;  // of the record written at the start of `out` (0: none)
  Encoding encoding = Encoding::kNone;
  std::uint64_t changed = 0;  // elements whose bytes differ (n when there is no `before`)
};

// Writes the record of bucket `bucket` that turns `before` into `after` (n elements of es bytes
// each) at the start of `out`:
//  - nothing, and {0, kNone, 0}, when no element changed;
//  - dense when `before` is null, or when the smaller sparse payload (pairs: changed * (4 + es);
//    runs: runs * 8 + elements in runs * es, where two runs merge when the gap between them costs
//    no more than a run header: gap * es <= 8) is larger than dense_ratio * n * es;
//  - else the smaller of pairs and runs (runs on a tie: they apply with copies, not scatters).
// The sizes compared are the payloads' before padding. dense_ratio >= 0 (0: always dense when
// anything changed; 1: sparse unless it would be larger than dense); a ratio above 1 acts as 1,
// so that no record is larger than max_record_bytes(n, es).
// InvalidArgument (naming the bucket) when es is not 1, 2, 4 or 8, n >= 2^32, dense_ratio is
// negative or NaN, `out` is smaller than max_record_bytes(n, es), or a pointer is null with
// n > 0. `before`, `after` and `out` must not overlap. One pass over both inputs (the diff and
// the checksum together) plus the writes.
SHARDGATHER_API EncodeResult encode(const void* before, const void* after, std::size_t n,
                                    std::size_t es, std::uint32_t bucket, double dense_ratio,
                                    std::span<std::byte> out);

// An N-d view of elements of es bytes at `data`: sizes and strides (in elements, any sign) per
// dim. Its elements are numbered ("flat" indices) in row-major order over `sizes`, whatever the
// strides. No dims: one element.
struct StridedView {
  void* data = nullptr;
  std::size_t es = 0;
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> strides;
};

struct ApplyResult {
  std::uint32_t bucket = 0;  // the record's
  // Whether the n elements read back from the view after the writes have the record's checksum:
  // false when the view did not hold the sender's `before` where the record wrote nothing, or
  // when a written element aliases another (a stride of 0).
  bool checksum_ok = false;
  std::size_t record_bytes = 0;  // 40 + payload_bytes: where the next record starts
  std::uint64_t changed = 0;     // elements the record wrote (dense: n; runs: gaps included)
};

// Applies the one record at the start of `record` to flat elements [start, start + n) of `dst`,
// then reads those n elements back and compares their checksum with the record's.
// The record is validated whole before anything is written: InvalidArgument, naming the bucket
// and the offending values, with `dst` untouched, for a truncated record or payload, a bad magic,
// encoding or zero field, elem_size != dst.es, elements != n, n >= 2^32, a count above n (or,
// dense, other than n), payload_bytes that is not exactly the encoding's size rounded up to 8 (or
// exceeds the span), nonzero padding, pair indices not strictly ascending or >= n, runs of length
// 0, overlapping, unsorted or past n; also for a view whose sizes and strides disagree, with a
// negative size, more than kMaxDims dims (after coalescing) or fewer than start + n elements, or
// null data with n > 0. A record followed by more bytes in `record` is fine (record_bytes says
// where the next one starts).
// `verify` false skips the checksum (checksum_ok is then true): for a record applied again to
// bytes it was already verified against (a staged buffer catching up), not for bytes received.
// A `dst` whose elements share memory is not refused here (the check would allocate, and apply
// never does): the caller's contract, as overlaps_itself (copy.h) states it; the weight sync
// refuses such destinations when it is built, before anything moves.
SHARDGATHER_API ApplyResult apply(std::span<const std::byte> record, const StridedView& dst,
                                  std::uint64_t start, std::uint64_t n, bool verify = true);

// What apply() would check, writing nothing: InvalidArgument (as apply() raises it) for a record
// or a view it refuses; else the record's bytes (where the next one starts).
SHARDGATHER_API std::size_t check(std::span<const std::byte> record, const StridedView& dst,
                                  std::uint64_t start, std::uint64_t n);

// checksum() of flat elements [start, start + n) of `view`, as if packed. InvalidArgument for a
// view apply() rejects.
[[nodiscard]] SHARDGATHER_API std::uint64_t view_checksum(const StridedView& view,
                                                          std::uint64_t start, std::uint64_t n);

// Messages: what a weight sync sends one peer is segments laid end to end (wire format, as the
// records'; little-endian):
//
//   u32 origin (the source rank whose buckets the records are)   u32 zero
//   u64 records_bytes (what follows the 24-byte header)
//   u64 checksum() of those records (headers included: a record's own checksum covers its
//       bucket's values, not which bucket it names)
//   records_bytes bytes of records (each a multiple of 8 bytes long)
inline constexpr std::size_t kSegmentHeaderBytes = 24;

// Pairs. What one source sends one destination in a sync is the transfers between them (the
// reshard plan's, in its order), each cut into buckets of chunk_bytes (at least one element, the
// last one shorter), numbered in that order across the pair: both sides number them alike from
// the same transfers, so a record names its bucket by that number alone.
struct Bucket {
  std::size_t transfer = 0;  // index into the pair's transfers
  std::uint64_t start = 0;   // its first element in the transfer
  std::uint64_t n = 0;
};

// The buckets of a pair whose transfer k has elements[k] elements of es[k] bytes. InvalidArgument
// for chunk_bytes 0, spans of different lengths, an element size 0, or more than 2^32 buckets
// (a record names its bucket in 32 bits).
SHARDGATHER_API std::vector<Bucket> pair_buckets(std::span<const std::uint64_t> elements,
                                                 std::span<const std::size_t> es,
                                                 std::size_t chunk_bytes);

// One transfer of a pair, as a message encodes it: n elements of es bytes, each side contiguous.
// `after` null: none of its buckets is sent. `before` null: each is sent dense.
struct PairTransfer {
  const void* after = nullptr;
  const void* before = nullptr;
  std::uint64_t n = 0;
  std::size_t es = 0;
};

struct PairEncoded {
  std::uint64_t records = 0;        // records written (a bucket sent dense, or one that changed)
  std::uint64_t dense_records = 0;  // of which dense
  std::uint64_t changed = 0;        // elements that changed, summed over the records
};

// The applied records of one segment (apply_pair).
struct PairApplied {
  std::vector<std::uint32_t> failed;  // buckets whose checksum failed, in the records' order
  std::vector<std::size_t> touched;   // transfers written, ascending
  std::uint64_t changed = 0;          // elements written (ApplyResult::changed, summed)
};

// Applies the records of one segment (records laid end to end) to the pair's transfers, `views`
// in the pair's order (each view its transfer's elements, as apply() takes them). Every record is
// checked first (its magic, its bucket one of the pair's, then as check() does), so that
// InvalidArgument, naming the record's byte offset in the segment, leaves every view as it was.
// `verify`: as apply()'s.
SHARDGATHER_API PairApplied apply_pair(std::span<const std::byte> records,
                                       std::span<const StridedView> views, std::size_t chunk_bytes,
                                       bool verify = true);

// One peer's message, built segment by segment with records encoded straight into it. Its
// buffer is kept for the next message (clear()): a steady state of alike messages allocates
// nothing, while a buffer more than 4 times the size of the message it last held (a dense
// first sync's, once deltas are small) is let go by clear(). Each growth makes a new buffer (twice
// the size), so a view of finish()'s bytes stays readable while its owner (`storage()`) is held;
// its bytes hold until the next clear(), which writes the next message over them.
// Threading: one thread at a time.
class SHARDGATHER_API Message {
 public:
  // Closes the open segment (an empty one is dropped) and opens one for `origin`'s records.
  void segment(std::uint32_t origin);
  // encode() into the open segment (InvalidArgument when none is open; encode()'s own errors).
  EncodeResult record(const void* before, const void* after, std::size_t n, std::size_t es,
                      std::uint32_t bucket, double dense_ratio);
  // The records of every bucket of a pair (`transfers`, chunk_bytes: pair_buckets()) into the
  // open segment, each numbered by its place in the pair: a delta of `before` (dense_ratio as
  // encode() takes it), dense where `before` is null, none where `after` is. `only` given: those
  // buckets alone, in its order (InvalidArgument naming the first that is not one of the pair's,
  // before anything is written). encode()'s own errors, naming the bucket.
  PairEncoded pair(std::span<const PairTransfer> transfers, std::size_t chunk_bytes,
                   double dense_ratio,
                   std::optional<std::span<const std::uint32_t>> only = std::nullopt);
  // This message becomes a copy of `other`'s bytes (closed first); its open segment is closed.
  void copy_from(Message& other);
  // Closes the open segment; the message's bytes.
  std::span<const std::byte> finish();
  // Empties the message, keeping its buffer unless it is oversized (above).
  void clear() noexcept;
  // The buffer's size (what the message holds between uses).
  [[nodiscard]] std::size_t held_bytes() const noexcept {
    return bytes_ == nullptr ? 0 : bytes_->size();
  }
  // The buffer's owner, for views of finish()'s bytes that must outlive a growth.
  [[nodiscard]] const std::shared_ptr<std::vector<std::byte>>& storage() const noexcept {
    return bytes_;
  }

 private:
  void reserve(std::size_t more);
  void close();

  std::shared_ptr<std::vector<std::byte>> bytes_;
  std::size_t used_ = 0;
  std::optional<std::size_t> open_at_;  // the open segment's header
  std::uint32_t origin_ = 0;
};

struct Segment {
  std::uint32_t origin = 0;
  std::size_t offset = 0;  // of its records in the message
  std::size_t bytes = 0;
  bool intact = false;  // its records have the header's checksum
};

// The segments of one message. InvalidArgument (naming the byte) for a truncated header, a
// nonzero zero field, or records past the end. A segment whose checksum fails is returned with
// intact false (damaged in flight: the caller asks for its buckets again).
SHARDGATHER_API std::vector<Segment> segments(std::span<const std::byte> message);

}  // namespace shardgather::delta
