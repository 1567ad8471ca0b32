// Delta records (include/shardgather/delta.h states the format and the contract).
//
// encode() reads both inputs once, 32 bytes at a time: the same four words feed the checksum's
// lanes and the diff, so `after` comes from memory once. Equal stretches cost one OR of four
// XORs per block; a differing block becomes a bit mask of its changed elements (branch-free), and
// is walked once per stretch of set bits. Changed elements are kept as maximal runs in a
// per-thread scratch vector, and what the runs encoding would cost after merging is tallied as
// they are found, so the choice needs no second pass; once both sparse sizes pass the dense limit
// (they only grow) the scan stops recording and only counts. Measured on one core (EPYC, 256 MiB
// bf16, bench/python/bench_delta_kernel.py): about 3.3 GB/s at 1% random density, 1.4 at 10%.
//
// apply() validates the whole record before the first write, then walks the destination view
// with a mixed-radix cursor over its coalesced dims: a contiguous view is one memcpy (dense) or a
// copy per run, a strided one is decomposed once and then stepped.
#include "shardgather/delta.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "shardgather/errors.h"

namespace shardgather::delta {
namespace {

using Uint128 = __uint128_t;  // GCC's and Clang's builtin (no -Wpedantic warning)

// Arbitrary odd constants, drawn at random once (any odd values would do; never change them:
// records carry the checksum across machines and versions).
constexpr std::array<std::uint64_t, 4> kLaneSeed = {0xc570473443bd8df5U, 0x872ad3a01af8cef7U,
                                                    0xf0a14e35238c3573U, 0x9e30a088602ef529U};
constexpr std::array<std::uint64_t, 4> kLaneKey = {0xf937e956fee5cad5U, 0x85fdc0507b18e0fbU,
                                                   0x867a021e8cf38607U, 0xa20eda6e32625881U};
constexpr std::uint64_t kMulA = 0xadb3674eb6a70ec1U;
constexpr std::uint64_t kMulB = 0xf12f38803e43da5fU;
constexpr std::uint64_t kMulC = 0x93fd3dc3aa38482bU;
constexpr std::uint64_t kMulD = 0xa032fffe6de8bbb3U;
constexpr std::size_t kBlock = 32;

std::uint64_t load64(const std::byte* p) noexcept {
  std::uint64_t v = 0;
  std::memcpy(&v, p, sizeof v);
  if constexpr (std::endian::native == std::endian::big) {
    v = __builtin_bswap64(v);
  }
  return v;
}

std::uint32_t load32(const std::byte* p) noexcept {
  std::uint32_t v = 0;
  std::memcpy(&v, p, sizeof v);
  if constexpr (std::endian::native == std::endian::big) {
    v = __builtin_bswap32(v);
  }
  return v;
}

void store64(std::byte* p, std::uint64_t v) noexcept {
  if constexpr (std::endian::native == std::endian::big) {
    v = __builtin_bswap64(v);
  }
  std::memcpy(p, &v, sizeof v);
}

void store32(std::byte* p, std::uint32_t v) noexcept {
  if constexpr (std::endian::native == std::endian::big) {
    v = __builtin_bswap32(v);
  }
  std::memcpy(p, &v, sizeof v);
}

constexpr std::uint64_t round_up8(std::uint64_t v) noexcept { return (v + 7) & ~std::uint64_t{7}; }

// The high and low halves of the 128-bit product folded together: every bit of either factor
// reaches every bit of the result (a 64-bit product only carries upwards).
inline std::uint64_t fold_mul(std::uint64_t a, std::uint64_t b) noexcept {
  const Uint128 p = static_cast<Uint128>(a) * b;
  return static_cast<std::uint64_t>(p) ^ static_cast<std::uint64_t>(p >> 64);
}

// One lane's step over 8 bytes. The chain through `acc` is a rotate, a multiply and an add, a
// bijection of acc (no block can erase what came before, and blocks in another order give
// another value); the multiply that mixes `v` is off the chain, so the four lanes overlap.
inline std::uint64_t lane_step(std::uint64_t acc, std::uint64_t v, std::uint64_t key) noexcept {
  return std::rotl(acc, 29) * kMulA + fold_mul(v ^ key, kMulB);
}

struct Lanes {
  std::uint64_t a0 = kLaneSeed[0];
  std::uint64_t a1 = kLaneSeed[1];
  std::uint64_t a2 = kLaneSeed[2];
  std::uint64_t a3 = kLaneSeed[3];

  void block(std::uint64_t w0, std::uint64_t w1, std::uint64_t w2, std::uint64_t w3) noexcept {
    a0 = lane_step(a0, w0, kLaneKey[0]);
    a1 = lane_step(a1, w1, kLaneKey[1]);
    a2 = lane_step(a2, w2, kLaneKey[2]);
    a3 = lane_step(a3, w3, kLaneKey[3]);
  }

  void blocks(const std::byte* p, std::size_t count) noexcept {
    Lanes l = *this;  // in registers for the loop
    for (std::size_t b = 0; b < count; ++b, p += kBlock) {
      l.block(load64(p), load64(p + 8), load64(p + 16), load64(p + 24));
    }
    *this = l;
  }

  // The value of the bytes hashed so far (`length` of them, the last block zero-padded).
  [[nodiscard]] std::uint64_t finish(std::uint64_t length) const noexcept {
    const std::array<std::uint64_t, 4> lanes = {a0, a1, a2, a3};
    std::uint64_t h = length * kMulC;
    for (std::size_t i = 0; i < 4; ++i) {
      h = std::rotl(h, 23) * kMulA + fold_mul(lanes[i] ^ kLaneKey[i], kMulD);
    }
    h ^= h >> 31;
    h *= kMulC;
    h ^= h >> 29;
    h *= kMulD;
    h ^= h >> 32;
    return h;
  }
};

Lanes lanes_of(const std::array<std::uint64_t, 4>& a) noexcept { return {a[0], a[1], a[2], a[3]}; }

// ---------------------------------------------------------------------------------------------
// encode

struct Run {
  std::uint32_t start = 0;
  std::uint32_t length = 0;
};

// The top bit of every element of es bytes in a word.
constexpr std::uint64_t high_bits(std::size_t es) noexcept {
  switch (es) {
    case 1:
      return 0x8080808080808080U;
    case 2:
      return 0x8000800080008000U;
    case 4:
      return 0x8000000080000000U;
    default:
      return 0x8000000000000000U;
  }
}

// f(std::integral_constant<std::size_t, Es>{}) for the element size es (1, 2, 4, or 8 for any
// other: callers have validated es), so that each loop is instantiated per width once.
template <typename F>
decltype(auto) with_es(std::size_t es, F&& f) {
  switch (es) {
    case 1:
      return f(std::integral_constant<std::size_t, 1>{});
    case 2:
      return f(std::integral_constant<std::size_t, 2>{});
    case 4:
      return f(std::integral_constant<std::size_t, 4>{});
    default:
      return f(std::integral_constant<std::size_t, 8>{});
  }
}

// The changed elements of an XOR word, as the top bit of each nonzero element: the low bits of
// an element added to all ones carry into its top bit exactly when one is set, and never past it.
template <std::size_t Es>
inline std::uint64_t changed_mask(std::uint64_t x) noexcept {
  constexpr std::uint64_t kHigh = high_bits(Es);
  constexpr std::uint64_t kLow = ~kHigh;
  return (((x & kLow) + kLow) | x) & kHigh;
}

// What the scan found: the maximal runs of changed elements (in the scratch vector), and what
// the runs encoding costs once runs separated by a gap of at most 8 / es elements are merged
// (the gap's values cost no more than the run header they save). add_run() has no
// data-dependent branch: at 10% density whether a stretch extends a run or merges is a coin toss,
// and a mispredicted branch per changed element cost more than the rest of the scan.
template <std::size_t Es>
class Tracker {
 public:
  static constexpr std::uint64_t kPerWord = 8 / Es;
  static constexpr std::uint64_t kMaxGap = 8 / Es;
  static constexpr std::size_t kBlockElems = kBlock / Es;

  // `raw` is the scratch: its size is its usable capacity (grown here, never shrunk).
  Tracker(std::vector<Run>& raw, std::uint64_t limit) : raw_(raw), limit_(limit) {
    if (raw_.size() < kBlockElems + 2) {
      raw_.resize(kBlockElems + 2);
    }
  }

  // Room for every run one block can close (called before each block() and close()).
  void reserve_block() {
    if (used_ + kBlockElems + 1 > raw_.size()) {
      raw_.resize(2 * raw_.size());
    }
  }

  // The block whose four XOR words these are; element `first` is its first element. The loop
  // runs once per stretch of changed elements in the block, not once per element or word.
  void block(std::uint64_t x0, std::uint64_t x1, std::uint64_t x2, std::uint64_t x3,
             std::uint64_t first) noexcept {
    std::uint64_t m = compact(x0) | (compact(x1) << kPerWord) | (compact(x2) << (2 * kPerWord)) |
                      (compact(x3) << (3 * kPerWord));
    while (m != 0) {
      const int at = std::countr_zero(m);
      const int length = std::countr_one(m >> at);
      add_run(first + static_cast<std::uint64_t>(at), static_cast<std::uint64_t>(length));
      m &= ~std::uint64_t{0} << (at + length);  // at + length <= 32: no overflow
    }
  }

  void count(std::uint64_t x) noexcept {
    changed_ += static_cast<std::uint64_t>(std::popcount(changed_mask<Es>(x)));
  }

  // Both sparse payloads are larger than the limit (they only grow: the result is dense).
  [[nodiscard]] bool over_limit() const noexcept {
    return std::min(pairs_bytes(), runs_bytes()) > limit_;
  }

  // The raw runs, once the scan is over (the first slot holds the empty run that the first
  // add_run() closed).
  [[nodiscard]] std::span<const Run> close() {
    reserve_block();
    add_run_end();
    return std::span<const Run>(raw_).subspan(1, used_ - 1);
  }

  [[nodiscard]] std::uint64_t changed() const noexcept { return changed_; }
  [[nodiscard]] std::uint64_t runs() const noexcept { return runs_; }
  [[nodiscard]] std::uint64_t pairs_bytes() const noexcept { return changed_ * (4 + Es); }
  [[nodiscard]] std::uint64_t runs_bytes() const noexcept { return runs_ * 8 + run_elements_ * Es; }

 private:
  // Far enough below any index that no element looks close to it (unsigned differences).
  static constexpr std::uint64_t kFar = std::uint64_t{1} << 63;

  // A word's changed elements as its low kPerWord bits (bit j: element j). The multiply moves
  // each element's flag (changed_mask's top bit, shifted down to the element's bit 0) into the
  // top kPerWord bits; every other partial product lands at a distinct position below them or
  // past bit 63, so nothing carries into them.
  static std::uint64_t compact(std::uint64_t x) noexcept {
    constexpr std::uint64_t kWidth = 8 * Es;
    constexpr std::uint64_t kGather = [] {
      std::uint64_t g = 0;
      for (std::uint64_t j = 0; j < kPerWord; ++j) {
        g |= std::uint64_t{1} << (64 - kPerWord - (kWidth - 1) * j);
      }
      return g;
    }();
    return ((changed_mask<Es>(x) >> (kWidth - 1)) * kGather) >> (64 - kPerWord);
  }

  // Elements [i, i + length) changed (ascending, after every earlier call's).
  void add_run(std::uint64_t i, std::uint64_t length) noexcept {
    changed_ += length;
    // The run being grown ends unless this one extends it; it is stored either way, and kept
    // (used_ moves past it) only when it ends.
    const bool extend = i == cur_end_;
    raw_[used_] = {static_cast<std::uint32_t>(cur_start_),
                   static_cast<std::uint32_t>(cur_end_ - cur_start_)};
    used_ += extend ? 0 : 1;
    cur_start_ = extend ? cur_start_ : i;
    cur_end_ = i + length;
    const bool merge = i - merged_end_ <= kMaxGap;
    run_elements_ += merge ? i + length - merged_end_ : length;
    runs_ += merge ? 0 : 1;
    merged_end_ = i + length;
  }

  void add_run_end() noexcept {
    raw_[used_] = {static_cast<std::uint32_t>(cur_start_),
                   static_cast<std::uint32_t>(cur_end_ - cur_start_)};
    ++used_;
  }

  std::vector<Run>& raw_;
  std::uint64_t limit_;
  std::size_t used_ = 0;  // closed runs in raw_
  std::uint64_t changed_ = 0;
  std::uint64_t runs_ = 0;          // merged
  std::uint64_t run_elements_ = 0;  // in merged runs, gaps included
  std::uint64_t merged_end_ = kFar;
  std::uint64_t cur_start_ = kFar;  // the raw run being grown: [cur_start_, cur_end_)
  std::uint64_t cur_end_ = kFar;
};

struct Scan {
  std::uint64_t checksum = 0;
  std::uint64_t changed = 0;
  std::uint64_t runs = 0;
  std::uint64_t pairs_bytes = 0;
  std::uint64_t runs_bytes = 0;
  bool dense = false;        // both sparse sizes passed the limit
  std::span<const Run> raw;  // the maximal runs of changed elements (when not dense)
};

// Diffs `after` against `before` and checksums `after` in one pass.
template <std::size_t Es>
Scan scan(const std::byte* before, const std::byte* after, std::uint64_t n, std::uint64_t limit,
          std::vector<Run>& raw) {
  constexpr std::uint64_t kPerWord = 8 / Es;
  const std::uint64_t bytes = n * Es;
  const std::uint64_t blocks = bytes / kBlock;
  Tracker<Es> tracker(raw, limit);
  Lanes lanes;
  std::uint64_t b = 0;
  bool dense = false;
  for (; b < blocks; ++b) {
    const std::byte* a = after + b * kBlock;
    const std::byte* p = before + b * kBlock;
    const std::uint64_t w0 = load64(a);
    const std::uint64_t w1 = load64(a + 8);
    const std::uint64_t w2 = load64(a + 16);
    const std::uint64_t w3 = load64(a + 24);
    lanes.block(w0, w1, w2, w3);
    const std::uint64_t x0 = w0 ^ load64(p);
    const std::uint64_t x1 = w1 ^ load64(p + 8);
    const std::uint64_t x2 = w2 ^ load64(p + 16);
    const std::uint64_t x3 = w3 ^ load64(p + 24);
    if ((x0 | x1 | x2 | x3) == 0) {
      continue;
    }
    const std::uint64_t first = b * 4 * kPerWord;
    tracker.reserve_block();
    tracker.block(x0, x1, x2, x3, first);
    if (tracker.over_limit()) {
      dense = true;
      ++b;
      break;
    }
  }
  for (; b < blocks; ++b) {  // dense already: count only
    const std::byte* a = after + b * kBlock;
    const std::byte* p = before + b * kBlock;
    const std::uint64_t w0 = load64(a);
    const std::uint64_t w1 = load64(a + 8);
    const std::uint64_t w2 = load64(a + 16);
    const std::uint64_t w3 = load64(a + 24);
    lanes.block(w0, w1, w2, w3);
    tracker.count(w0 ^ load64(p));
    tracker.count(w1 ^ load64(p + 8));
    tracker.count(w2 ^ load64(p + 16));
    tracker.count(w3 ^ load64(p + 24));
  }
  const std::uint64_t rest = bytes - blocks * kBlock;
  if (rest > 0) {  // both zero-padded: the padding never differs
    std::array<std::byte, kBlock> a{};
    std::array<std::byte, kBlock> p{};
    std::memcpy(a.data(), after + blocks * kBlock, rest);
    std::memcpy(p.data(), before + blocks * kBlock, rest);
    lanes.blocks(a.data(), 1);
    std::array<std::uint64_t, 4> x{};
    for (std::size_t w = 0; w < 4; ++w) {
      x[w] = load64(a.data() + 8 * w) ^ load64(p.data() + 8 * w);
    }
    if (dense) {
      for (const std::uint64_t word : x) {
        tracker.count(word);
      }
    } else {
      tracker.reserve_block();
      tracker.block(x[0], x[1], x[2], x[3], blocks * 4 * kPerWord);
    }
  }
  dense = dense || tracker.over_limit();
  return {.checksum = lanes.finish(bytes),
          .changed = tracker.changed(),
          .runs = tracker.runs(),
          .pairs_bytes = tracker.pairs_bytes(),
          .runs_bytes = tracker.runs_bytes(),
          .dense = dense,
          .raw = dense ? std::span<const Run>() : tracker.close()};
}

Scan scan_es(const std::byte* before, const std::byte* after, std::uint64_t n, std::size_t es,
             std::uint64_t limit, std::vector<Run>& raw) {
  return with_es(es, [&](auto w) { return scan<w()>(before, after, n, limit, raw); });
}

void put_header(std::byte* out, std::uint32_t bucket, Encoding encoding, std::size_t es,
                std::uint64_t count, std::uint64_t n, std::uint64_t sum, std::uint64_t payload) {
  store32(out, kMagic);
  store32(out + 4, bucket);
  out[8] = static_cast<std::byte>(encoding);
  out[9] = static_cast<std::byte>(es);
  out[10] = std::byte{0};
  out[11] = std::byte{0};
  store32(out + 12, static_cast<std::uint32_t>(count));
  store64(out + 16, n);
  store64(out + 24, sum);
  store64(out + 32, payload);
}

// Zeros from `used` payload bytes up to the padded size; returns the record's length.
std::size_t pad(std::byte* out, std::uint64_t used) noexcept {
  const std::uint64_t padded = round_up8(used);
  std::memset(out + kHeaderBytes + used, 0, padded - used);
  return kHeaderBytes + padded;
}

std::size_t write_dense(std::byte* out, const std::byte* after, std::uint64_t n, std::size_t es,
                        std::uint32_t bucket, std::uint64_t sum) {
  const std::uint64_t bytes = n * es;
  put_header(out, bucket, Encoding::kDense, es, n, n, sum, round_up8(bytes));
  if (bytes > 0) {
    std::memcpy(out + kHeaderBytes, after, bytes);
  }
  return pad(out, bytes);
}

// Copies `count` elements: short runs (most of them, at low densities) without a call.
template <std::size_t Es>
inline void copy_elements(std::byte* dst, const std::byte* src, std::uint64_t count) noexcept {
  if (count <= 4) {
    for (std::uint64_t k = 0; k < count; ++k) {
      std::memcpy(dst + k * Es, src + k * Es, Es);
    }
  } else {
    std::memcpy(dst, src, count * Es);
  }
}

template <std::size_t Es>
std::size_t write_pairs(std::byte* out, const std::byte* after, std::uint64_t n,
                        std::uint32_t bucket, const Scan& s) {
  const std::uint64_t used = s.pairs_bytes;
  put_header(out, bucket, Encoding::kPairs, Es, s.changed, n, s.checksum, round_up8(used));
  std::byte* index = out + kHeaderBytes;
  std::byte* values = index + 4 * s.changed;
  for (const Run& r : s.raw) {
    for (std::uint32_t k = 0; k < r.length; ++k, index += 4) {
      store32(index, r.start + k);
    }
    copy_elements<Es>(values, after + std::size_t{r.start} * Es, r.length);
    values += std::size_t{r.length} * Es;
  }
  return pad(out, used);
}

template <std::size_t Es>
std::size_t write_runs(std::byte* out, const std::byte* after, std::uint64_t n,
                       std::uint32_t bucket, const Scan& s) {
  const std::uint64_t used = s.runs_bytes;
  put_header(out, bucket, Encoding::kRuns, Es, s.runs, n, s.checksum, round_up8(used));
  std::byte* head = out + kHeaderBytes;
  std::byte* values = head + 8 * s.runs;
  constexpr std::uint64_t kMaxGap = 8 / Es;  // the scan's merge rule, applied to its raw runs
  auto emit = [&](std::uint64_t start, std::uint64_t end) {
    store32(head, static_cast<std::uint32_t>(start));
    store32(head + 4, static_cast<std::uint32_t>(end - start));
    head += 8;
    copy_elements<Es>(values, after + start * Es, end - start);
    values += (end - start) * Es;
  };
  std::uint64_t start = s.raw.front().start;
  std::uint64_t end = start + s.raw.front().length;
  for (const Run& r : s.raw.subspan(1)) {
    if (r.start - end > kMaxGap) {
      emit(start, end);
      start = r.start;
    }
    end = std::uint64_t{r.start} + r.length;
  }
  emit(start, end);
  return pad(out, used);
}

// The sparse record the scan chose.
std::pair<Encoding, std::size_t> write_sparse(std::byte* out, const std::byte* after,
                                              std::uint64_t n, std::size_t es, std::uint32_t bucket,
                                              const Scan& s) {
  const bool runs = s.runs_bytes <= s.pairs_bytes;  // a tie: runs apply with copies
  return with_es(es, [&](auto w) {
    return runs ? std::pair{Encoding::kRuns, write_runs<w()>(out, after, n, bucket, s)}
                : std::pair{Encoding::kPairs, write_pairs<w()>(out, after, n, bucket, s)};
  });
}

// What an error message names: the record's bucket, or the call. Text only on the way to a throw
// (a call that succeeds allocates nothing).
struct Who {
  const char* call = "delta";
  bool has_bucket = true;
  std::uint32_t bucket = 0;

  [[nodiscard]] std::string text() const {
    return has_bucket ? "delta: bucket " + std::to_string(bucket) : std::string(call);
  }
};

bool valid_es(std::size_t es) noexcept { return es == 1 || es == 2 || es == 4 || es == 8; }

// ---------------------------------------------------------------------------------------------
// views

// A view's dims with size-1 dims dropped and neighbours merged where one steps over the other
// whole (stride[d] == stride[d + 1] * size[d + 1]); always at least one dim.
struct Layout {
  std::size_t dims = 0;
  std::array<std::int64_t, kMaxDims> size{};
  std::array<std::int64_t, kMaxDims> stride{};
  std::uint64_t elements = 1;
};

Layout coalesce(const StridedView& v, const Who& who) {
  if (!valid_es(v.es)) {
    throw InvalidArgument(who.text() + ": a view of " + std::to_string(v.es) +
                          "-byte elements (1, 2, 4 or 8)");
  }
  if (v.sizes.size() != v.strides.size()) {
    throw InvalidArgument(who.text() + ": a view of " + std::to_string(v.sizes.size()) +
                          " sizes and " + std::to_string(v.strides.size()) + " strides");
  }
  Layout l;
  std::int64_t elements = 1;
  std::int64_t extent = 0;  // the farthest element from `data`, in elements
  bool empty = false;
  for (std::size_t d = 0; d < v.sizes.size(); ++d) {
    const std::int64_t size = v.sizes[d];
    const std::int64_t stride = v.strides[d];
    if (size < 0) {
      throw InvalidArgument(who.text() + ": a view with size " + std::to_string(size) + " in dim " +
                            std::to_string(d));
    }
    std::int64_t reach = 0;
    if (stride == std::numeric_limits<std::int64_t>::min() ||
        __builtin_mul_overflow(size, elements, &elements) ||
        (size > 0 && __builtin_mul_overflow(size - 1, stride < 0 ? -stride : stride, &reach)) ||
        __builtin_add_overflow(extent, reach, &extent)) {
      throw CountOverflow(who.text() + ": a view whose elements or extent overflow 64 bits (dim " +
                          std::to_string(d) + ")");
    }
    empty = empty || size == 0;
    if (size == 1) {
      continue;
    }
    if (l.dims > 0 && l.stride[l.dims - 1] == stride * size) {
      l.size[l.dims - 1] *= size;
      l.stride[l.dims - 1] = stride;
      continue;
    }
    if (l.dims == kMaxDims) {
      throw InvalidArgument(who.text() + ": a view of more than " + std::to_string(kMaxDims) +
                            " dims that do not coalesce");
    }
    l.size[l.dims] = size;
    l.stride[l.dims] = stride;
    ++l.dims;
  }
  std::int64_t extent_bytes = 0;
  if (__builtin_mul_overflow(extent, static_cast<std::int64_t>(v.es), &extent_bytes)) {
    throw CountOverflow(who.text() + ": a view whose extent overflows 64 bits");
  }
  if (empty) {
    l.dims = 1;
    l.size[0] = 0;
    l.stride[0] = 1;
  } else if (l.dims == 0) {
    l.dims = 1;
    l.size[0] = 1;
    l.stride[0] = 1;
  }
  l.elements = static_cast<std::uint64_t>(elements);
  return l;
}

void check_range(const Layout& l, const StridedView& v, std::uint64_t start, std::uint64_t n,
                 const Who& who) {
  if (start > l.elements || n > l.elements - start) {
    throw InvalidArgument(who.text() + ": elements [" + std::to_string(start) + ", " +
                          std::to_string(start) + " + " + std::to_string(n) + ") of a view of " +
                          std::to_string(l.elements) + " elements");
  }
  if (n > 0 && v.data == nullptr) {
    throw InvalidArgument(who.text() + ": a view with null data");
  }
}

// A position in a view, as a mixed-radix index over the coalesced dims and the element offset
// it names. Moves forward only.
class Cursor {
 public:
  Cursor(const Layout& l, std::uint64_t flat) noexcept : l_(l) {
    auto rest = static_cast<std::int64_t>(flat);
    for (std::size_t d = l.dims - 1; d > 0; --d) {
      idx_[d] = rest % l.size[d];
      rest /= l.size[d];
      offset_ += idx_[d] * l.stride[d];
    }
    idx_[0] = rest;
    offset_ += rest * l.stride[0];
  }

  [[nodiscard]] std::int64_t offset() const noexcept { return offset_; }
  // Elements left in the innermost dim's row, this one included.
  [[nodiscard]] std::uint64_t row_left() const noexcept {
    return static_cast<std::uint64_t>(l_.size[l_.dims - 1] - idx_[l_.dims - 1]);
  }

  // k elements on in flat order (one past the view's end at most).
  void advance(std::uint64_t k) noexcept {
    std::size_t d = l_.dims - 1;
    auto carry = static_cast<std::int64_t>(k);
    while (true) {
      idx_[d] += carry;
      offset_ += carry * l_.stride[d];
      if (idx_[d] < l_.size[d] || d == 0) {
        return;
      }
      carry = idx_[d] / l_.size[d];
      const std::int64_t rem = idx_[d] % l_.size[d];
      offset_ += (rem - idx_[d]) * l_.stride[d];
      idx_[d] = rem;
      --d;
    }
  }

 private:
  const Layout& l_;
  std::array<std::int64_t, kMaxDims> idx_{};
  std::int64_t offset_ = 0;
};

// f(element offset, inner stride, elements) for each piece of flat elements [flat, flat + count)
// that lies along the innermost dim, in flat order. The cursor ends `count` elements on.
template <typename F>
void for_each_segment(const Layout& l, Cursor& c, std::uint64_t count, F&& f) {
  const std::int64_t inner = l.stride[l.dims - 1];
  while (count > 0) {
    const std::uint64_t len = std::min(count, c.row_left());
    f(c.offset(), inner, len);
    c.advance(len);
    count -= len;
  }
}

template <std::size_t Es>
void scatter(std::byte* base, std::int64_t offset, std::int64_t stride, std::uint64_t len,
             const std::byte* src) noexcept {
  if (stride == 1) {
    std::memcpy(base + offset * static_cast<std::int64_t>(Es), src, len * Es);
    return;
  }
  for (std::uint64_t k = 0; k < len; ++k) {
    std::memcpy(
        base + (offset + static_cast<std::int64_t>(k) * stride) * static_cast<std::int64_t>(Es),
        src + k * Es, Es);
  }
}

template <std::size_t Es>
void hash_view(const Layout& l, const std::byte* base, std::uint64_t start, std::uint64_t n,
               Hasher& h) {
  if (n == 0) {
    return;
  }
  if (l.dims == 1 && l.stride[0] == 1) {
    h.update(base + start * Es, n * Es);
    return;
  }
  // Strided rows and short contiguous ones are gathered here first: one update per 4 KiB, not
  // per element or per short row.
  std::array<std::byte, 4096> buffer{};
  constexpr std::uint64_t kCapacity = sizeof buffer / Es;
  constexpr std::uint64_t kDirect = 256;  // a contiguous row of this many elements goes direct
  std::uint64_t used = 0;                 // elements in the buffer
  Cursor c(l, start);
  for_each_segment(l, c, n, [&](std::int64_t offset, std::int64_t stride, std::uint64_t len) {
    if (stride == 1 && len >= kDirect) {
      h.update(buffer.data(), used * Es);
      used = 0;
      h.update(base + offset * static_cast<std::int64_t>(Es), len * Es);
      return;
    }
    for (std::uint64_t k = 0; k < len; ++k, ++used) {
      if (used == kCapacity) {
        h.update(buffer.data(), used * Es);
        used = 0;
      }
      std::memcpy(
          buffer.data() + used * Es,
          base + (offset + static_cast<std::int64_t>(k) * stride) * static_cast<std::int64_t>(Es),
          Es);
    }
  });
  h.update(buffer.data(), used * Es);
}

std::uint64_t hash_view_es(const Layout& l, const StridedView& v, std::uint64_t start,
                           std::uint64_t n) {
  Hasher h;
  const auto* base = static_cast<const std::byte*>(v.data);
  with_es(v.es, [&](auto w) { hash_view<w()>(l, base, start, n, h); });
  return h.finish();
}

// ---------------------------------------------------------------------------------------------
// apply

struct Header {
  std::uint32_t magic = 0;
  std::uint32_t bucket = 0;
  std::uint8_t encoding = 0;
  std::uint8_t es = 0;
  std::uint16_t zero = 0;
  std::uint32_t count = 0;
  std::uint64_t elements = 0;
  std::uint64_t checksum = 0;
  std::uint64_t payload_bytes = 0;
};

Header read_header(const std::byte* p) noexcept {
  return {.magic = load32(p),
          .bucket = load32(p + 4),
          .encoding = std::to_integer<std::uint8_t>(p[8]),
          .es = std::to_integer<std::uint8_t>(p[9]),
          .zero = static_cast<std::uint16_t>(std::to_integer<unsigned>(p[10]) |
                                             (std::to_integer<unsigned>(p[11]) << 8)),
          .count = load32(p + 12),
          .elements = load64(p + 16),
          .checksum = load64(p + 24),
          .payload_bytes = load64(p + 32)};
}

std::string hex(std::uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string text;
  do {
    text.insert(text.begin(), kDigits[v & 0xF]);
    v >>= 4;
  } while (v != 0);
  return "0x" + text;
}

// The record's payload, validated: what apply() writes.
struct Payload {
  Encoding encoding = Encoding::kNone;
  std::uint64_t count = 0;
  const std::byte* table = nullptr;   // pair indices or run headers
  const std::byte* values = nullptr;  // the new values, packed
  std::uint64_t written = 0;          // elements the values fill
};

[[noreturn]] void fail_record(const Header& h, const std::string& what) {
  throw InvalidArgument(Who{.bucket = h.bucket}.text() + ": " + what);
}

// The header's fields against the destination and the bytes that follow it.
void check_header(const Header& h, const StridedView& dst, std::uint64_t n,
                  std::uint64_t available) {
  if (h.magic != kMagic) {
    fail_record(h, "bad magic " + hex(h.magic) + " (want " + hex(kMagic) + ")");
  }
  if (h.encoding < 1 || h.encoding > 3) {
    fail_record(h,
                "unknown encoding " + std::to_string(h.encoding) + " (1 dense, 2 pairs, 3 runs)");
  }
  if (h.zero != 0) {
    fail_record(h, "the reserved field is " + std::to_string(h.zero) + ", not 0");
  }
  if (h.es != dst.es) {
    fail_record(h, "elem_size " + std::to_string(h.es) + " for a destination of " +
                       std::to_string(dst.es) + "-byte elements");
  }
  if (h.elements != n) {
    fail_record(h, "a record of " + std::to_string(h.elements) + " elements applied as " +
                       std::to_string(n));
  }
  if (n > std::numeric_limits<std::uint32_t>::max()) {
    fail_record(h, "a bucket of " + std::to_string(n) + " elements (fewer than 2^32)");
  }
  if (h.payload_bytes % 8 != 0) {
    fail_record(h, "payload_bytes " + std::to_string(h.payload_bytes) + " is not a multiple of 8");
  }
  if (h.payload_bytes > available) {
    fail_record(h, "payload_bytes " + std::to_string(h.payload_bytes) + " but only " +
                       std::to_string(available) + " bytes follow the header (truncated)");
  }
  if (h.count > n) {
    fail_record(h, "count " + std::to_string(h.count) + " in a bucket of " + std::to_string(n) +
                       " elements");
  }
}

// payload_bytes must be the `used` bytes of an encoding rounded up to 8.
void check_size(const Header& h, std::uint64_t used, const char* what) {
  if (h.payload_bytes != round_up8(used)) {
    fail_record(h, "payload_bytes " + std::to_string(h.payload_bytes) + " for " + what + " of " +
                       std::to_string(h.count) + " (want " + std::to_string(round_up8(used)) + ")");
  }
}

// Pairs: a table of strictly increasing 32-bit indices below n, then the values.
std::uint64_t check_pairs(const Header& h, const std::byte* payload, std::uint64_t n) {
  const std::uint64_t used = h.count * (4 + std::uint64_t{h.es});
  check_size(h, used, "pairs");
  std::uint64_t next = 0;  // the lowest index the next pair may have
  for (std::uint64_t k = 0; k < h.count; ++k) {
    const std::uint32_t index = load32(payload + 4 * k);
    if (index < next || index >= n) {
      fail_record(h,
                  "pair " + std::to_string(k) + " has index " + std::to_string(index) +
                      (index >= n ? " past the bucket's " + std::to_string(n) + " elements"
                                  : ", not above the previous pair's " + std::to_string(next - 1)));
    }
    next = std::uint64_t{index} + 1;
  }
  return used;
}

// Runs: (start, length) headers of non-empty, ordered, disjoint runs inside the bucket, then the
// values. Returns the bytes used; `total` is the elements the runs cover.
std::uint64_t check_runs(const Header& h, const std::byte* payload, std::uint64_t n,
                         std::uint64_t& total) {
  const std::uint64_t heads = 8 * std::uint64_t{h.count};
  if (heads > h.payload_bytes) {
    fail_record(h, "payload_bytes " + std::to_string(h.payload_bytes) + " cannot hold " +
                       std::to_string(h.count) + " run headers");
  }
  std::uint64_t next = 0;  // where the next run may start
  total = 0;
  for (std::uint64_t k = 0; k < h.count; ++k) {
    const std::uint64_t start = load32(payload + 8 * k);
    const std::uint64_t length = load32(payload + 8 * k + 4);
    if (length == 0 || start < next || start + length > n) {
      fail_record(h,
                  "run " + std::to_string(k) + " [" + std::to_string(start) + ", +" +
                      std::to_string(length) + ") " +
                      (length == 0    ? std::string("is empty")
                       : start < next ? "overlaps or precedes the previous run, which ends at " +
                                            std::to_string(next)
                                      : "passes the bucket's " + std::to_string(n) + " elements"));
    }
    next = start + length;
    total += length;
  }
  const std::uint64_t used = heads + total * h.es;
  check_size(h, used, "runs");
  return used;
}

Payload validate(std::span<const std::byte> record, const Header& h, const StridedView& dst,
                 std::uint64_t n) {
  check_header(h, dst, n, record.size() - kHeaderBytes);
  Payload p{.encoding = static_cast<Encoding>(h.encoding), .count = h.count};
  const std::byte* payload = record.data() + kHeaderBytes;
  std::uint64_t used = 0;
  switch (p.encoding) {
    case Encoding::kDense:
      if (h.count != n) {
        fail_record(h, "a dense record with count " + std::to_string(h.count) + " for " +
                           std::to_string(n) + " elements");
      }
      used = n * h.es;
      check_size(h, used, "a dense record");
      p.values = payload;
      p.written = n;
      break;
    case Encoding::kPairs:
      used = check_pairs(h, payload, n);
      p.table = payload;
      p.values = payload + 4 * std::uint64_t{h.count};
      p.written = h.count;
      break;
    default:  // runs
      used = check_runs(h, payload, n, p.written);
      p.table = payload;
      p.values = payload + 8 * std::uint64_t{h.count};
      break;
  }
  for (std::uint64_t i = used; i < h.payload_bytes; ++i) {
    if (payload[i] != std::byte{0}) {
      fail_record(h, "padding byte " + std::to_string(i - used) + " is " +
                         std::to_string(std::to_integer<unsigned>(payload[i])) + ", not 0");
    }
  }
  return p;
}

template <std::size_t Es>
void write_values(const Payload& p, const Layout& l, std::byte* base, std::uint64_t start,
                  std::uint64_t n) {
  const bool flat = l.dims == 1;  // one dim: element i is at i * stride, no cursor
  const std::int64_t stride0 = l.stride[0];
  switch (p.encoding) {
    case Encoding::kDense: {
      if (flat) {
        scatter<Es>(base, static_cast<std::int64_t>(start) * stride0, stride0, n, p.values);
        return;
      }
      Cursor c(l, start);
      const std::byte* src = p.values;
      for_each_segment(l, c, n, [&](std::int64_t offset, std::int64_t stride, std::uint64_t len) {
        scatter<Es>(base, offset, stride, len, src);
        src += len * Es;
      });
      return;
    }
    case Encoding::kPairs: {
      const std::byte* src = p.values;
      if (flat) {
        for (std::uint64_t k = 0; k < p.count; ++k, src += Es) {
          const std::uint64_t i = start + load32(p.table + 4 * k);
          std::memcpy(base + static_cast<std::int64_t>(i) * stride0 * std::int64_t{Es}, src, Es);
        }
        return;
      }
      Cursor c(l, start);
      std::uint64_t at = 0;  // the cursor's index in the bucket
      for (std::uint64_t k = 0; k < p.count; ++k, src += Es) {
        const std::uint64_t i = load32(p.table + 4 * k);
        c.advance(i - at);
        at = i;
        std::memcpy(base + c.offset() * std::int64_t{Es}, src, Es);
      }
      return;
    }
    default: {
      const std::byte* src = p.values;
      if (flat) {
        for (std::uint64_t k = 0; k < p.count; ++k) {
          const std::uint64_t first = start + load32(p.table + 8 * k);
          const std::uint64_t len = load32(p.table + 8 * k + 4);
          scatter<Es>(base, static_cast<std::int64_t>(first) * stride0, stride0, len, src);
          src += len * Es;
        }
        return;
      }
      Cursor c(l, start);
      std::uint64_t at = 0;
      for (std::uint64_t k = 0; k < p.count; ++k) {
        const std::uint64_t first = load32(p.table + 8 * k);
        const std::uint64_t len = load32(p.table + 8 * k + 4);
        c.advance(first - at);
        for_each_segment(l, c, len,
                         [&](std::int64_t offset, std::int64_t stride, std::uint64_t seg) {
                           scatter<Es>(base, offset, stride, seg, src);
                           src += seg * Es;
                         });
        at = first + len;
      }
      return;
    }
  }
}

}  // namespace

std::uint64_t checksum(const void* p, std::size_t bytes) noexcept {
  Hasher h;
  h.update(p, bytes);
  return h.finish();
}

Hasher::Hasher() noexcept : lanes_(kLaneSeed) {}

void Hasher::update(const void* p, std::size_t bytes) noexcept {
  if (bytes == 0) {
    return;
  }
  const auto* in = static_cast<const std::byte*>(p);
  length_ += bytes;
  Lanes lanes = lanes_of(lanes_);
  if (pending_bytes_ > 0) {
    const std::size_t take = std::min(bytes, kBlock - pending_bytes_);
    std::memcpy(pending_.data() + pending_bytes_, in, take);
    pending_bytes_ += take;
    in += take;
    bytes -= take;
    if (pending_bytes_ < kBlock) {
      return;
    }
    lanes.blocks(pending_.data(), 1);
    pending_bytes_ = 0;
  }
  const std::size_t blocks = bytes / kBlock;
  lanes.blocks(in, blocks);
  in += blocks * kBlock;
  bytes -= blocks * kBlock;
  if (bytes > 0) {
    std::memcpy(pending_.data(), in, bytes);
    pending_bytes_ = bytes;
  }
  lanes_ = {lanes.a0, lanes.a1, lanes.a2, lanes.a3};
}

std::uint64_t Hasher::finish() const noexcept {
  Lanes lanes = lanes_of(lanes_);
  if (pending_bytes_ > 0) {
    std::array<std::byte, kBlock> last{};
    std::memcpy(last.data(), pending_.data(), pending_bytes_);
    lanes.blocks(last.data(), 1);
  }
  return lanes.finish(length_);
}

std::size_t max_record_bytes(std::size_t n, std::size_t es) noexcept {
  return kHeaderBytes + round_up8(n * es);
}

EncodeResult encode(const void* before, const void* after, std::size_t n, std::size_t es,
                    std::uint32_t bucket, double dense_ratio, std::span<std::byte> out) {
  const Who who{.bucket = bucket};
  if (!valid_es(es)) {
    throw InvalidArgument(who.text() + ": elem_size " + std::to_string(es) + " (1, 2, 4 or 8)");
  }
  if (n > std::numeric_limits<std::uint32_t>::max()) {
    throw InvalidArgument(who.text() + ": " + std::to_string(n) +
                          " elements (a bucket holds < 2^32)");
  }
  if (std::isnan(dense_ratio) || dense_ratio < 0) {
    throw InvalidArgument(who.text() + ": dense_ratio " + std::to_string(dense_ratio) +
                          " (want >= 0)");
  }
  if (out.size() < max_record_bytes(n, es)) {
    throw InvalidArgument(who.text() + ": an output of " + std::to_string(out.size()) +
                          " bytes for " + std::to_string(n) + " elements of " + std::to_string(es) +
                          " bytes (want " + std::to_string(max_record_bytes(n, es)) + ")");
  }
  if (n > 0 && after == nullptr) {
    throw InvalidArgument(who.text() + ": null `after`");
  }
  const auto* now = static_cast<const std::byte*>(after);
  if (before == nullptr) {
    const std::size_t bytes = write_dense(out.data(), now, n, es, bucket, checksum(now, n * es));
    return {.bytes = bytes, .encoding = Encoding::kDense, .changed = n};
  }
  // sparse > ratio * dense exactly when sparse > floor(ratio * dense), sparse being an integer.
  // A ratio above 1 acts as 1: no record is larger than the dense one (max_record_bytes).
  const std::uint64_t limit = static_cast<std::uint64_t>(
      std::floor(std::min(dense_ratio, 1.0) * static_cast<double>(n * es)));
  // The scan's scratch: kept between calls, so that the steady state does not allocate.
  thread_local std::vector<Run> raw;
  const Scan s = scan_es(static_cast<const std::byte*>(before), now, n, es, limit, raw);
  if (s.changed == 0) {
    return {};
  }
  if (s.dense) {
    return {.bytes = write_dense(out.data(), now, n, es, bucket, s.checksum),
            .encoding = Encoding::kDense,
            .changed = s.changed};
  }
  const auto [encoding, bytes] = write_sparse(out.data(), now, n, es, bucket, s);
  return {.bytes = bytes, .encoding = encoding, .changed = s.changed};
}

namespace {

// What apply() and check() both refuse: the record's header, payload and destination range.
struct Checked {
  Header h;
  Layout l;
  Payload p;
};

Checked check_record(std::span<const std::byte> record, const StridedView& dst, std::uint64_t start,
                     std::uint64_t n) {
  if (record.size() < kHeaderBytes) {
    throw InvalidArgument("delta: a record of " + std::to_string(record.size()) +
                          " bytes (shorter than the 40-byte header)");
  }
  const Header h = read_header(record.data());
  const Who who{.bucket = h.bucket};
  const Layout l = coalesce(dst, who);
  check_range(l, dst, start, n, who);
  return {.h = h, .l = l, .p = validate(record, h, dst, n)};
}

}  // namespace

std::size_t check(std::span<const std::byte> record, const StridedView& dst, std::uint64_t start,
                  std::uint64_t n) {
  return kHeaderBytes + check_record(record, dst, start, n).h.payload_bytes;
}

ApplyResult apply(std::span<const std::byte> record, const StridedView& dst, std::uint64_t start,
                  std::uint64_t n, bool verify) {
  const Checked c = check_record(record, dst, start, n);
  auto* base = static_cast<std::byte*>(dst.data);
  if (n > 0) {
    with_es(dst.es, [&](auto w) { write_values<w()>(c.p, c.l, base, start, n); });
  }
  return {.bucket = c.h.bucket,
          .checksum_ok = !verify || hash_view_es(c.l, dst, start, n) == c.h.checksum,
          .record_bytes = kHeaderBytes + c.h.payload_bytes,
          .changed = c.p.written};
}

std::uint64_t view_checksum(const StridedView& view, std::uint64_t start, std::uint64_t n) {
  const Who who{.call = "delta: view_checksum", .has_bucket = false};
  const Layout l = coalesce(view, who);
  check_range(l, view, start, n, who);
  return hash_view_es(l, view, start, n);
}

}  // namespace shardgather::delta
