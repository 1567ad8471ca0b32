// Delta records: every encoding round-trips bit for bit (element sizes 1 to 8, densities from
// none to all, clustered changes, the first and last element), the chosen encoding is the
// smallest the contract allows, the bytes follow the wire format (read here by a parser of the
// test's own), strided destinations keep every byte around the bucket, and every malformed record
// is refused before anything is written.
#include "shardgather/delta.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/alloc_counter.h"

#include "shardgather/errors.h"

namespace shardgather::delta {
namespace {

using Bytes = std::vector<std::byte>;
using Sizes = std::initializer_list<std::size_t>;

constexpr std::uint32_t kSeed = 20240611;

Bytes random_bytes(std::size_t count, std::mt19937_64& rng) {
  Bytes out(count);
  for (auto& b : out) {
    b = static_cast<std::byte>(rng());
  }
  return out;
}

// Flips bits of element i (never none, so the element changes).
void change(Bytes& data, std::size_t es, std::size_t i, std::mt19937_64& rng) {
  const std::size_t k = rng() % es;
  data[i * es + k] ^= static_cast<std::byte>(1U + rng() % 255U);
}

std::uint64_t round_up8(std::uint64_t v) { return (v + 7) / 8 * 8; }

std::uint32_t get32(const Bytes& b, std::size_t at) {
  std::uint32_t v = 0;
  for (std::size_t k = 0; k < 4; ++k) {
    v |= std::to_integer<std::uint32_t>(b[at + k]) << (8 * k);
  }
  return v;
}

std::uint64_t get64(const Bytes& b, std::size_t at) {
  return get32(b, at) | (std::uint64_t{get32(b, at + 4)} << 32);
}

void put32(Bytes& b, std::size_t at, std::uint32_t v) {
  for (std::size_t k = 0; k < 4; ++k) {
    b[at + k] = static_cast<std::byte>(v >> (8 * k));
  }
}

void put64(Bytes& b, std::size_t at, std::uint64_t v) {
  put32(b, at, static_cast<std::uint32_t>(v));
  put32(b, at + 4, static_cast<std::uint32_t>(v >> 32));
}

// What the contract says the encoder must pick, from the changed elements alone.
struct Expected {
  std::uint64_t changed = 0;
  std::uint64_t pairs_bytes = 0;
  std::uint64_t runs = 0;
  std::uint64_t runs_bytes = 0;
  Encoding encoding = Encoding::kNone;
};

Expected expect(const Bytes& before, const Bytes& after, std::size_t es, double dense_ratio) {
  const std::size_t n = after.size() / es;
  Expected e;
  std::uint64_t run_elements = 0;
  std::uint64_t end = 0;  // of the last merged run
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(before.data() + i * es, after.data() + i * es, es) == 0) {
      continue;
    }
    ++e.changed;
    if (e.runs > 0 && (i - end) * es <= 8) {
      run_elements += i + 1 - end;
    } else {
      ++e.runs;
      ++run_elements;
    }
    end = i + 1;
  }
  e.pairs_bytes = e.changed * (4 + es);
  e.runs_bytes = e.runs * 8 + run_elements * es;
  const std::uint64_t sparse = std::min(e.pairs_bytes, e.runs_bytes);
  if (e.changed == 0) {
    e.encoding = Encoding::kNone;
  } else if (static_cast<double>(sparse) >
             std::min(dense_ratio, 1.0) * static_cast<double>(n * es)) {  // above 1 acts as 1
    e.encoding = Encoding::kDense;
  } else {
    e.encoding = e.runs_bytes <= e.pairs_bytes ? Encoding::kRuns : Encoding::kPairs;
  }
  return e;
}

// The test's own reading of the wire format (not apply()'s): `target` updated by the record,
// checking every field and the padding. Returns the record's length.
std::size_t decode(const Bytes& rec, std::size_t es, std::uint32_t bucket, Bytes& target) {
  const std::size_t n = target.size() / es;
  EXPECT_EQ(get32(rec, 0), 0x4C444753U);
  EXPECT_EQ(std::to_integer<char>(rec[0]), 'S');
  EXPECT_EQ(std::to_integer<char>(rec[3]), 'L');
  EXPECT_EQ(get32(rec, 4), bucket);
  const auto encoding = std::to_integer<std::uint8_t>(rec[8]);
  EXPECT_EQ(std::to_integer<std::size_t>(rec[9]), es);
  EXPECT_EQ(rec[10], std::byte{0});
  EXPECT_EQ(rec[11], std::byte{0});
  const std::uint32_t count = get32(rec, 12);
  EXPECT_EQ(get64(rec, 16), n);
  const std::uint64_t payload = get64(rec, 32);
  EXPECT_EQ(payload % 8, 0U);
  const std::size_t p = 40;
  std::uint64_t used = 0;
  if (encoding == 1) {
    EXPECT_EQ(count, n);
    std::memcpy(target.data(), rec.data() + p, n * es);
    used = n * es;
  } else if (encoding == 2) {
    for (std::size_t k = 0; k < count; ++k) {
      const std::uint32_t index = get32(rec, p + 4 * k);
      EXPECT_LT(index, n);
      if (k > 0) {
        EXPECT_GT(index, get32(rec, p + 4 * (k - 1)));
      }
      std::memcpy(target.data() + index * es, rec.data() + p + 4 * count + k * es, es);
    }
    used = std::uint64_t{count} * (4 + es);
  } else {
    EXPECT_EQ(encoding, 3);
    std::size_t values = p + 8 * std::size_t{count};
    std::uint64_t end = 0;
    for (std::size_t k = 0; k < count; ++k) {
      const std::uint32_t start = get32(rec, p + 8 * k);
      const std::uint32_t length = get32(rec, p + 8 * k + 4);
      EXPECT_GE(length, 1U);
      EXPECT_GE(start, end);
      EXPECT_LE(std::uint64_t{start} + length, n);
      std::memcpy(target.data() + std::size_t{start} * es, rec.data() + values, length * es);
      values += length * es;
      end = std::uint64_t{start} + length;
    }
    used = values - p;
  }
  EXPECT_EQ(payload, round_up8(used));
  for (std::uint64_t i = p + used; i < p + payload; ++i) {
    EXPECT_EQ(rec[i], std::byte{0}) << "padding byte " << i;
  }
  EXPECT_EQ(get64(rec, 24), checksum(target.data(), target.size()));
  return p + payload;
}

StridedView flat_view(Bytes& data, std::size_t es) {
  return {.data = data.data(),
          .es = es,
          .sizes = {static_cast<std::int64_t>(data.size() / es)},
          .strides = {1}};
}

// Encodes before -> after, checks the choice and the bytes, applies the record to a copy of
// `before`, and checks that the copy is `after`, bit for bit.
Encoding round_trip(const Bytes& before, const Bytes& after, std::size_t es, double dense_ratio) {
  const std::size_t n = after.size() / es;
  const std::uint32_t bucket = 0xB0000000U + static_cast<std::uint32_t>(n);
  Bytes rec(max_record_bytes(n, es), std::byte{0xEE});
  const EncodeResult r = encode(before.data(), after.data(), n, es, bucket, dense_ratio, rec);
  const Expected e = expect(before, after, es, dense_ratio);
  EXPECT_EQ(r.encoding, e.encoding);
  EXPECT_EQ(r.changed, e.changed);
  if (e.encoding == Encoding::kNone) {
    EXPECT_EQ(r.bytes, 0U);
    EXPECT_EQ(rec[0], std::byte{0xEE});  // nothing written
    return r.encoding;
  }
  const std::uint64_t payload = e.encoding == Encoding::kDense   ? n * es
                                : e.encoding == Encoding::kPairs ? e.pairs_bytes
                                                                 : e.runs_bytes;
  EXPECT_EQ(r.bytes, 40 + round_up8(payload));
  Bytes decoded = before;
  EXPECT_EQ(decode(rec, es, bucket, decoded), r.bytes);
  EXPECT_EQ(decoded, after);

  Bytes dst = before;
  const ApplyResult a =
      apply(std::span<const std::byte>(rec).first(r.bytes), flat_view(dst, es), 0, n);
  EXPECT_EQ(a.bucket, bucket);
  EXPECT_TRUE(a.checksum_ok);
  EXPECT_EQ(a.record_bytes, r.bytes);
  EXPECT_EQ(a.changed, e.encoding == Encoding::kDense   ? n
                       : e.encoding == Encoding::kPairs ? e.changed
                                                        : (e.runs_bytes - 8 * e.runs) / es);
  EXPECT_TRUE(dst == after) << "es " << es << " n " << n;
  return r.encoding;
}

struct Case {
  std::size_t es;
  std::size_t n;
};

class DeltaRoundTrip : public ::testing::TestWithParam<Case> {};

TEST_P(DeltaRoundTrip, RandomDensities) {
  const auto [es, n] = GetParam();
  std::mt19937_64 rng(kSeed + es * 7919 + n);
  for (const double density : {0.0, 0.001, 0.01, 0.1, 0.5, 1.0}) {
    SCOPED_TRACE("seed " + std::to_string(kSeed) + " density " + std::to_string(density));
    const Bytes before = random_bytes(n * es, rng);
    Bytes after = before;
    std::bernoulli_distribution pick(density);
    for (std::size_t i = 0; i < n; ++i) {
      if (pick(rng)) {
        change(after, es, i, rng);
      }
    }
    for (const double ratio : {0.0, 0.25, 0.5, 1.0, 1e9}) {
      round_trip(before, after, es, ratio);
    }
  }
}

TEST_P(DeltaRoundTrip, ClusteredRuns) {
  const auto [es, n] = GetParam();
  std::mt19937_64 rng(kSeed + es + n);
  const Bytes before = random_bytes(n * es, rng);
  Bytes after = before;
  for (std::size_t cluster = 0; cluster < std::max<std::size_t>(1, n / 300); ++cluster) {
    const std::size_t first = rng() % n;
    const std::size_t length = 1 + rng() % 40;
    for (std::size_t i = first; i < std::min(n, first + length); ++i) {
      change(after, es, i, rng);
    }
  }
  const Encoding chosen = round_trip(before, after, es, 0.5);
  if (n > 1000) {
    EXPECT_EQ(chosen, Encoding::kRuns);
  }
  round_trip(before, after, es, 1.0);
}

TEST_P(DeltaRoundTrip, FirstAndLastElement) {
  const auto [es, n] = GetParam();
  std::mt19937_64 rng(kSeed + 3 * es + n);
  const Bytes before = random_bytes(n * es, rng);
  for (const std::size_t i : {std::size_t{0}, n - 1}) {
    Bytes after = before;
    change(after, es, i, rng);
    const Encoding chosen = round_trip(before, after, es, 1.0);
    // One element: a pair (4 + es bytes) beats a run (8 + es); dense (es) wins only for n = 1,
    // or n * es < 4 + es.
    EXPECT_EQ(chosen, (4 + es) > n * es ? Encoding::kDense : Encoding::kPairs);
  }
  Bytes both = before;
  change(both, es, 0, rng);
  change(both, es, n - 1, rng);
  round_trip(before, both, es, 1.0);
}

TEST_P(DeltaRoundTrip, NoBeforeIsDense) {
  const auto [es, n] = GetParam();
  std::mt19937_64 rng(kSeed + 5 * es + n);
  const Bytes after = random_bytes(n * es, rng);
  Bytes rec(max_record_bytes(n, es));
  const EncodeResult r = encode(nullptr, after.data(), n, es, 9, 0.5, rec);
  EXPECT_EQ(r.encoding, Encoding::kDense);
  EXPECT_EQ(r.changed, n);
  EXPECT_EQ(r.bytes, max_record_bytes(n, es));
  Bytes dst = random_bytes(n * es, rng);  // whatever was there
  const ApplyResult a = apply(rec, flat_view(dst, es), 0, n);
  EXPECT_TRUE(a.checksum_ok);
  EXPECT_EQ(a.changed, n);
  EXPECT_EQ(dst, after);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const std::size_t es : Sizes{1, 2, 4, 8}) {
    for (const std::size_t n : Sizes{1, 7, 4096 + 3}) {
      out.push_back({es, n});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Delta, DeltaRoundTrip, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return "es" + std::to_string(param_info.param.es) + "_n" +
                                  std::to_string(param_info.param.n);
                         });

TEST(Delta, ComparesBits) {
  const std::vector<float> zeros = {0.0F, 1.0F, std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> same = zeros;
  Bytes rec(max_record_bytes(3, 4));
  EXPECT_EQ(encode(zeros.data(), same.data(), 3, 4, 0, 1.0, rec).encoding, Encoding::kNone);
  same[0] = -0.0F;  // == 0.0F, other bits
  EncodeResult r = encode(zeros.data(), same.data(), 3, 4, 0, 1.0, rec);
  EXPECT_EQ(r.changed, 1U);
  same[0] = 0.0F;
  same[2] = std::bit_cast<float>(std::bit_cast<std::uint32_t>(zeros[2]) | 1U);  // another NaN
  r = encode(zeros.data(), same.data(), 3, 4, 0, 1.0, rec);
  EXPECT_EQ(r.changed, 1U);
  std::vector<float> dst = zeros;
  apply(std::span<const std::byte>(rec).first(r.bytes),
        {.data = dst.data(), .es = 4, .sizes = {3}, .strides = {1}}, 0, 3);
  EXPECT_EQ(std::memcmp(dst.data(), same.data(), sizeof(float) * 3), 0);
}

TEST(Delta, DenseRatioBoundary) {
  // 96 bf16 elements (192 bytes dense); 10 isolated changes: pairs 60 bytes, runs 100.
  std::mt19937_64 rng(kSeed);
  const Bytes before = random_bytes(192, rng);
  Bytes after = before;
  for (std::size_t i = 0; i < 96; i += 10) {
    change(after, 2, i, rng);
  }
  Bytes rec(max_record_bytes(96, 2));
  auto chosen = [&](double ratio) {
    return encode(before.data(), after.data(), 96, 2, 0, ratio, rec).encoding;
  };
  EXPECT_EQ(chosen(0.3125), Encoding::kPairs);  // 60 > 0.3125 * 192 = 60 is false
  EXPECT_EQ(chosen(0.3124), Encoding::kDense);
  EXPECT_EQ(chosen(0.0), Encoding::kDense);
  EXPECT_EQ(chosen(std::numeric_limits<double>::infinity()), Encoding::kPairs);
  // Every element changed: sparse would outgrow the dense record, whatever the ratio.
  Bytes all = before;
  for (std::size_t i = 0; i < 96; ++i) {
    change(all, 2, i, rng);
  }
  EXPECT_EQ(encode(before.data(), all.data(), 96, 2, 0, 1e9, rec).encoding, Encoding::kDense);
}

TEST(Delta, MergesRunsAcrossSmallGaps) {
  // es 2: a gap of 4 elements (8 bytes) merges, a gap of 5 does not.
  std::mt19937_64 rng(kSeed);
  const Bytes before = random_bytes(2 * 64, rng);
  Bytes after = before;
  for (const std::size_t i : Sizes{0, 1, 2, 7, 8, 9, 15, 16, 17}) {
    change(after, 2, i, rng);
  }
  Bytes rec(max_record_bytes(64, 2));
  const EncodeResult r = encode(before.data(), after.data(), 64, 2, 0, 1.0, rec);
  ASSERT_EQ(r.encoding, Encoding::kRuns);  // runs [0, 10) and [15, 18): 16 + 26 < 9 * 6
  EXPECT_EQ(get32(rec, 12), 2U);
  EXPECT_EQ(get32(rec, 40), 0U);
  EXPECT_EQ(get32(rec, 44), 10U);
  EXPECT_EQ(get32(rec, 48), 15U);
  EXPECT_EQ(get32(rec, 52), 3U);
}

// A 2-d array of rows x cols elements with a sentinel pattern everywhere.
Bytes sentinel(std::size_t count) {
  Bytes out(count);
  for (std::size_t i = 0; i < count; ++i) {
    out[i] = static_cast<std::byte>(0xA5U ^ (i * 131U));
  }
  return out;
}

// Reads flat elements of a view (row-major over sizes) into a packed vector.
Bytes read_view(const StridedView& v) {
  std::size_t count = 1;
  for (const std::int64_t s : v.sizes) {
    count *= static_cast<std::size_t>(s);
  }
  Bytes out(count * v.es);
  std::vector<std::int64_t> idx(v.sizes.size(), 0);
  for (std::size_t f = 0; f < count; ++f) {
    std::int64_t offset = 0;
    for (std::size_t d = 0; d < idx.size(); ++d) {
      offset += idx[d] * v.strides[d];
    }
    std::memcpy(out.data() + f * v.es,
                static_cast<const std::byte*>(v.data) + offset * static_cast<std::int64_t>(v.es),
                v.es);
    for (std::size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < v.sizes[d]) {
        break;
      }
      idx[d] = 0;
    }
  }
  return out;
}

void write_view(const StridedView& v, const Bytes& packed) {
  std::vector<std::int64_t> idx(v.sizes.size(), 0);
  for (std::size_t f = 0; f < packed.size() / v.es; ++f) {
    std::int64_t offset = 0;
    for (std::size_t d = 0; d < idx.size(); ++d) {
      offset += idx[d] * v.strides[d];
    }
    std::memcpy(static_cast<std::byte*>(v.data) + offset * static_cast<std::int64_t>(v.es),
                packed.data() + f * v.es, v.es);
    for (std::size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < v.sizes[d]) {
        break;
      }
      idx[d] = 0;
    }
  }
}

// Applies records of every encoding to flat elements [start, start + n) of `view` over
// `backing`, and checks the view's bucket and every byte outside it.
void check_strided(Bytes& backing, const StridedView& view, std::size_t start, std::size_t n) {
  const std::size_t es = view.es;
  std::mt19937_64 rng(kSeed + start + n);
  const Bytes whole = read_view(view);
  const Bytes before(whole.begin() + static_cast<std::ptrdiff_t>(start * es),
                     whole.begin() + static_cast<std::ptrdiff_t>((start + n) * es));
  EXPECT_EQ(view_checksum(view, start, n), checksum(before.data(), before.size()));
  struct Variant {
    const char* name;
    double density;
    bool clustered;
    double ratio;
    Encoding want;
  };
  for (const Variant& variant : {Variant{"pairs", 0.05, false, 1.0, Encoding::kPairs},
                                 Variant{"runs", 0.0, true, 1.0, Encoding::kRuns},
                                 Variant{"dense", 0.5, false, 0.0, Encoding::kDense}}) {
    SCOPED_TRACE(variant.name);
    Bytes after = before;
    if (variant.clustered) {
      for (std::size_t i = 3; i < n; i += 17) {
        for (std::size_t k = i; k < std::min(n, i + 6); ++k) {
          change(after, es, k, rng);
        }
      }
    } else {
      std::bernoulli_distribution pick(variant.density);
      for (std::size_t i = 0; i < n; ++i) {
        if (pick(rng)) {
          change(after, es, i, rng);
        }
      }
    }
    Bytes rec(max_record_bytes(n, es));
    const EncodeResult r = encode(before.data(), after.data(), n, es, 3, variant.ratio, rec);
    ASSERT_EQ(r.encoding, variant.want);
    const Bytes old = backing;
    const ApplyResult a = apply(std::span<const std::byte>(rec).first(r.bytes), view, start, n);
    EXPECT_TRUE(a.checksum_ok);
    Bytes want_whole = whole;
    std::memcpy(want_whole.data() + start * es, after.data(), after.size());
    EXPECT_EQ(read_view(view), want_whole);
    // Every byte outside the bucket is as it was: with the old bucket put back, all are.
    write_view(view, whole);
    EXPECT_EQ(backing, old);
  }
}

TEST(Delta, AppliesIntoAColumnBlock) {
  for (const std::size_t es : Sizes{1, 2, 4, 8}) {
    SCOPED_TRACE("es " + std::to_string(es));
    const std::int64_t rows = 37;
    const std::int64_t cols = 29;
    Bytes backing = sentinel(static_cast<std::size_t>(rows * cols) * es);
    const Bytes untouched = backing;
    // Columns [5, 5 + 11) of every row.
    const StridedView view{
        .data = backing.data() + 5 * es, .es = es, .sizes = {rows, 11}, .strides = {cols, 1}};
    // The bucket starts mid-row and ends mid-row.
    check_strided(backing, view, 7, 11 * 30 + 2);
    EXPECT_EQ(backing, untouched);
    const Bytes before = read_view(view);
    Bytes after = before;
    std::mt19937_64 rng(kSeed);
    change(after, es, 100, rng);
    Bytes rec(max_record_bytes(before.size() / es, es));
    const EncodeResult r = encode(before.data(), after.data(), before.size() / es, es, 4, 1.0, rec);
    apply(std::span<const std::byte>(rec).first(r.bytes), view, 0, before.size() / es);
    for (std::size_t i = 0; i < backing.size(); ++i) {
      const std::size_t elem = i / es;
      const bool in_view =
          elem % static_cast<std::size_t>(cols) >= 5 && elem % static_cast<std::size_t>(cols) < 16;
      if (!in_view) {
        ASSERT_EQ(backing[i], untouched[i]) << "byte " << i << " outside the view changed";
      }
    }
    EXPECT_EQ(read_view(view), after);
  }
}

TEST(Delta, AppliesIntoANonCoalescibleView) {
  for (const std::size_t es : Sizes{1, 2, 4, 8}) {
    SCOPED_TRACE("es " + std::to_string(es));
    // sizes [3, 4, 5], strides [70, 13, 2]: no two dims merge, the inner one is strided.
    Bytes backing = sentinel(188 * es);
    const StridedView view{
        .data = backing.data(), .es = es, .sizes = {3, 4, 5}, .strides = {70, 13, 2}};
    const Bytes untouched = backing;
    check_strided(backing, view, 0, 60);
    check_strided(backing, view, 9, 40);
    EXPECT_EQ(backing, untouched);
    // A write through the view changes only its elements.
    const Bytes before = read_view(view);
    Bytes after = before;
    std::mt19937_64 rng(kSeed);
    for (std::size_t i = 0; i < 60; i += 3) {
      change(after, es, i, rng);
    }
    Bytes rec(max_record_bytes(60, es));
    const EncodeResult r = encode(before.data(), after.data(), 60, es, 4, 1.0, rec);
    apply(std::span<const std::byte>(rec).first(r.bytes), view, 0, 60);
    EXPECT_EQ(read_view(view), after);
    write_view(view, before);
    EXPECT_EQ(backing, untouched);
  }
}

// One record of each encoding to corrupt.
struct Records {
  Bytes before;
  Bytes after;
  Bytes pairs;
  Bytes runs;
  Bytes dense;
};

constexpr std::size_t kN = 100;
constexpr std::uint32_t kBucket = 77;

Records records() {
  std::mt19937_64 rng(kSeed);
  Records r;
  r.before = random_bytes(kN * 2, rng);
  Bytes sparse = r.before;
  for (const std::size_t i : Sizes{3, 20, 50, 99}) {
    change(sparse, 2, i, rng);
  }
  Bytes clustered = r.before;
  for (std::size_t i = 10; i < 30; ++i) {
    change(clustered, 2, i, rng);
  }
  for (std::size_t i = 60; i < 70; ++i) {
    change(clustered, 2, i, rng);
  }
  auto make = [&](const Bytes& after, double ratio, Encoding want) {
    Bytes rec(max_record_bytes(kN, 2));
    const EncodeResult e = encode(r.before.data(), after.data(), kN, 2, kBucket, ratio, rec);
    EXPECT_EQ(e.encoding, want);
    rec.resize(e.bytes);
    return rec;
  };
  r.pairs = make(sparse, 1.0, Encoding::kPairs);
  r.runs = make(clustered, 1.0, Encoding::kRuns);
  r.dense = make(sparse, 0.0, Encoding::kDense);
  r.after = sparse;
  return r;
}

// apply() must throw InvalidArgument naming the bucket and leave dst as it was.
void expect_refused(const Bytes& rec, const Bytes& before, const char* what, std::size_t es = 2,
                    std::uint64_t n = kN, std::uint64_t start = 0) {
  SCOPED_TRACE(what);
  Bytes dst = before;
  try {
    apply(rec,
          {.data = dst.data(),
           .es = es,
           .sizes = {static_cast<std::int64_t>(dst.size() / es)},
           .strides = {1}},
          start, n);
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("bucket 77"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dst, before);
}

TEST(Delta, RefusesMalformedRecords) {
  const Records r = records();
  for (const Bytes* valid : {&r.pairs, &r.runs, &r.dense}) {
    Bytes rec = *valid;
    put32(rec, 0, 0x4C444754U);
    expect_refused(rec, r.before, "bad magic");
    rec = *valid;
    rec[8] = std::byte{4};
    expect_refused(rec, r.before, "bad encoding");
    rec = *valid;
    rec[9] = std::byte{4};
    expect_refused(rec, r.before, "elem_size field");
    rec = *valid;
    rec[10] = std::byte{1};
    expect_refused(rec, r.before, "reserved field");
    expect_refused(*valid, r.before, "wrong es", 4, kN / 2);
    expect_refused(*valid, r.before, "elements != n", 2, kN - 1);
    expect_refused(*valid, r.before, "past the view", 2, kN, 1);
    rec = *valid;
    rec.resize(rec.size() - 8);
    expect_refused(rec, r.before, "truncated payload");
    rec = *valid;
    put64(rec, 32, get64(rec, 32) + 8);
    rec.resize(rec.size() + 8);
    expect_refused(rec, r.before, "payload_bytes too large");
    rec = *valid;
    put64(rec, 32, get64(rec, 32) - 8);
    expect_refused(rec, r.before, "payload_bytes too small");
    rec = *valid;
    put64(rec, 32, get64(rec, 32) + 1);
    rec.resize(rec.size() + 8);
    expect_refused(rec, r.before, "payload_bytes not a multiple of 8");
    rec = *valid;
    put64(rec, 32, std::numeric_limits<std::uint64_t>::max() - 7);
    expect_refused(rec, r.before, "payload_bytes huge");
    rec = *valid;
    put32(rec, 12, get32(rec, 12) + 1);
    expect_refused(rec, r.before, "count lies");
  }
  {  // pairs: 4 pairs of 6 bytes = 24, no padding; bf16 indices at 40, 44, 48, 52
    Bytes rec = r.pairs;
    put32(rec, 52, kN);
    expect_refused(rec, r.before, "index out of range");
    rec = r.pairs;
    put32(rec, 44, 51);  // 3, 51, 50, 99
    expect_refused(rec, r.before, "unsorted pairs");
    rec = r.pairs;
    put32(rec, 48, 20);  // 3, 20, 20, 99
    expect_refused(rec, r.before, "repeated index");
  }
  {  // runs [10, 30) and [60, 70): heads at 40 and 48, 16 + 60 = 76 bytes, 4 of padding
    Bytes rec = r.runs;
    put32(rec, 48, 25);
    expect_refused(rec, r.before, "overlapping runs");
    rec = r.runs;
    put32(rec, 40, 60);
    put32(rec, 48, 10);
    expect_refused(rec, r.before, "unsorted runs");
    rec = r.runs;
    put32(rec, 48, 95);
    expect_refused(rec, r.before, "run past n");
    rec = r.runs;
    put32(rec, 52, 0);
    expect_refused(rec, r.before, "empty run");
    rec = r.runs;
    put32(rec, 44, 25);  // five more values than the payload holds
    expect_refused(rec, r.before, "run lengths disagree with payload_bytes");
    rec = r.runs;
    rec[rec.size() - 1] = std::byte{1};
    expect_refused(rec, r.before, "nonzero padding");
  }
  {
    Bytes rec = r.pairs;
    rec.resize(39);
    Bytes dst = r.before;
    EXPECT_THROW(apply(rec, flat_view(dst, 2), 0, kN), InvalidArgument);
    EXPECT_EQ(dst, r.before);
  }
  {  // 2^32 elements, through a view that repeats one element (stride 0)
    Bytes rec = r.pairs;
    const std::uint64_t n = std::uint64_t{1} << 32;
    put64(rec, 16, n);
    Bytes dst = r.before;
    EXPECT_THROW(
        apply(rec, {.data = dst.data(), .es = 2, .sizes = {1LL << 32}, .strides = {0}}, 0, n),
        InvalidArgument);
    EXPECT_EQ(dst, r.before);
  }
  // The record's length is what the header says, whatever follows it in the span.
  Bytes two = r.pairs;
  two.insert(two.end(), r.runs.begin(), r.runs.end());
  Bytes dst = r.before;
  const ApplyResult a = apply(two, flat_view(dst, 2), 0, kN);
  EXPECT_EQ(a.record_bytes, r.pairs.size());
  EXPECT_TRUE(a.checksum_ok);
  EXPECT_EQ(dst, r.after);
}

TEST(Delta, ChecksumCatchesAStaleDestination) {
  const Records r = records();
  Bytes stale = r.before;
  stale[2 * 40] ^= std::byte{1};  // element 40: no record writes it
  for (const Bytes* rec : {&r.pairs, &r.runs}) {
    Bytes dst = stale;
    EXPECT_FALSE(apply(*rec, flat_view(dst, 2), 0, kN).checksum_ok);
  }
  Bytes dst = stale;
  EXPECT_TRUE(apply(r.dense, flat_view(dst, 2), 0, kN).checksum_ok);  // writes everything
  EXPECT_EQ(dst, r.after);
}

TEST(Delta, EncodeRefusesBadArguments) {
  Bytes data(64);
  Bytes rec(max_record_bytes(32, 2));
  EXPECT_THROW(encode(data.data(), data.data(), 32, 3, 0, 1.0, rec), InvalidArgument);
  EXPECT_THROW(encode(data.data(), data.data(), 32, 2, 0, -1.0, rec), InvalidArgument);
  EXPECT_THROW(encode(data.data(), data.data(), 32, 2, 0, std::nan(""), rec), InvalidArgument);
  EXPECT_THROW(encode(data.data(), data.data(), 32, 2, 0, 1.0,
                      std::span<std::byte>(rec).first(rec.size() - 1)),
               InvalidArgument);
  EXPECT_THROW(encode(nullptr, nullptr, std::size_t{1} << 32, 1, 0, 1.0, rec), InvalidArgument);
  EXPECT_EQ(max_record_bytes(0, 8), 40U);
  EXPECT_EQ(max_record_bytes(3, 1), 48U);
  EXPECT_EQ(max_record_bytes(4, 2), 48U);
  EXPECT_EQ(max_record_bytes(5, 2), 56U);
}

TEST(Delta, SteadyStateDoesNotAllocate) {
  std::mt19937_64 rng(kSeed);
  const std::size_t n = 1 << 16;
  const Bytes before = random_bytes(n * 2, rng);
  Bytes after = before;
  for (std::size_t i = 0; i < n; i += 97) {
    change(after, 2, i, rng);
  }
  Bytes rec(max_record_bytes(n, 2));
  Bytes dst = before;
  const StridedView view = flat_view(dst, 2);
  encode(before.data(), after.data(), n, 2, 1, 0.5, rec);  // the scratch grows once
  const std::uint64_t allocations = testing::thread_allocations();
  const EncodeResult r = encode(before.data(), after.data(), n, 2, 1, 0.5, rec);
  const ApplyResult a = apply(std::span<const std::byte>(rec).first(r.bytes), view, 0, n);
  EXPECT_EQ(testing::thread_allocations(), allocations);
  EXPECT_TRUE(a.checksum_ok);
  EXPECT_EQ(dst, after);
}

TEST(Delta, HasherSplitsAnywhere) {
  std::mt19937_64 rng(kSeed);
  for (const std::size_t size : Sizes{0, 1, 7, 31, 32, 33, 64, 100, 1000, 4099, 70000}) {
    const Bytes data = random_bytes(size, rng);
    const std::uint64_t whole = checksum(data.data(), data.size());
    for (int trial = 0; trial < 20; ++trial) {
      Hasher h;
      std::size_t at = 0;
      while (at < size) {
        const std::size_t max_piece = trial % 2 == 0 ? 40 : 5000;
        const std::size_t piece = std::min(size - at, rng() % max_piece);
        h.update(data.data() + at, piece);
        at += piece;
        if (trial == 3) {
          (void)h.finish();  // finish() does not change the state
        }
      }
      EXPECT_EQ(h.finish(), whole) << "size " << size << " trial " << trial;
    }
  }
}

TEST(Delta, ChecksumSeesLengthOrderAndEveryBit) {
  std::vector<std::uint64_t> seen;
  const Bytes zeros(96);
  for (std::size_t len = 0; len <= zeros.size(); ++len) {
    seen.push_back(checksum(zeros.data(), len));  // zero padding is not zeros
  }
  std::mt19937_64 rng(kSeed);
  Bytes data = random_bytes(256, rng);
  const std::uint64_t base = checksum(data.data(), data.size());
  for (std::size_t bit = 0; bit < data.size() * 8; ++bit) {
    data[bit / 8] ^= static_cast<std::byte>(1U << (bit % 8));
    seen.push_back(checksum(data.data(), data.size()));
    data[bit / 8] ^= static_cast<std::byte>(1U << (bit % 8));
  }
  Bytes swapped = data;  // blocks 0 and 2 traded (the same lane, another order)
  std::swap_ranges(swapped.begin(), swapped.begin() + 32, swapped.begin() + 64);
  seen.push_back(checksum(swapped.data(), swapped.size()));
  seen.push_back(base);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end());
}

// Two sources' segments to one peer, as a weight sync frames them: each segment's records apply
// back to the new bytes, an empty segment is dropped, and the checksum marks a damaged one.
TEST(DeltaMessage, SegmentsCarryTheirOriginAndRecords) {
  std::mt19937_64 rng(kSeed);
  const std::size_t n = 1000;
  const Bytes before = random_bytes(n * 4, rng);
  Bytes after = before;
  for (std::size_t i = 0; i < n; i += 31) {
    change(after, 4, i, rng);
  }
  Message m;
  m.segment(3);
  EXPECT_EQ(m.record(before.data(), after.data(), n, 4, 0, 1.0).encoding, Encoding::kPairs);
  EXPECT_EQ(m.record(nullptr, after.data(), n, 4, 1, 1.0).encoding, Encoding::kDense);
  m.segment(4);  // nothing changed: no record, and the segment is dropped
  EXPECT_EQ(m.record(before.data(), before.data(), n, 4, 0, 1.0).bytes, 0U);
  m.segment(5);
  m.record(nullptr, before.data(), n, 4, 7, 1.0);
  const std::span<const std::byte> bytes = m.finish();
  const std::vector<Segment> got = segments(bytes);
  ASSERT_EQ(got.size(), 2U);
  EXPECT_EQ(got[0].origin, 3U);
  EXPECT_EQ(got[1].origin, 5U);
  EXPECT_EQ(got[0].offset, kSegmentHeaderBytes);
  EXPECT_EQ(got[1].offset, got[0].offset + got[0].bytes + kSegmentHeaderBytes);
  EXPECT_EQ(got[1].offset + got[1].bytes, bytes.size());
  Bytes dst = before;
  const StridedView view = flat_view(dst, 4);
  const std::span<const std::byte> first = bytes.subspan(got[0].offset, got[0].bytes);
  const ApplyResult pairs = apply(first, view, 0, n);
  EXPECT_TRUE(pairs.checksum_ok);
  EXPECT_EQ(dst, after);
  const ApplyResult dense = apply(first.subspan(pairs.record_bytes), view, 0, n);
  EXPECT_TRUE(dense.checksum_ok);
  EXPECT_EQ(dense.bucket, 1U);
  EXPECT_TRUE(got[0].intact && got[1].intact);

  Bytes damaged(bytes.begin(), bytes.end());
  damaged[got[1].offset + 4] ^= std::byte{1};  // the bucket id of source 5's record
  const std::vector<Segment> again = segments(damaged);
  EXPECT_TRUE(again[0].intact);
  EXPECT_FALSE(again[1].intact);
}

TEST(DeltaMessage, MalformedFramingIsRefusedNamingTheByte) {
  const std::vector<std::byte> rec(40);
  Message m;
  m.segment(1);
  m.record(nullptr, rec.data(), 5, 8, 0, 1.0);
  const std::span<const std::byte> bytes = m.finish();
  const auto refused = [](const Bytes& b, const std::string& needle) {
    try {
      (void)segments(b);
      return std::string("accepted");
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      return what.find(needle) == std::string::npos ? what : std::string();
    }
  };
  Bytes b(bytes.begin(), bytes.end());
  b.resize(b.size() + 10);  // a second, truncated header
  EXPECT_EQ(
      refused(b, "truncated segment header: 10 bytes at byte " + std::to_string(bytes.size())), "");
  b.assign(bytes.begin(), bytes.end() - 8);  // records past the end
  EXPECT_EQ(
      refused(b, "where " + std::to_string(bytes.size() - 8 - kSegmentHeaderBytes) + " remain"),
      "");
  b.assign(bytes.begin(), bytes.end());
  b[4] = std::byte{1};  // the zero field
  EXPECT_EQ(refused(b, "segment at byte 0"), "");
  EXPECT_THROW(Message().record(nullptr, rec.data(), 5, 8, 0, 1.0), InvalidArgument);
}

TEST(DeltaMessage, ItsBufferServesTheNextMessageAndAnOversizedOneIsLetGo) {
  std::mt19937_64 rng(kSeed);
  const std::size_t big = 1 << 20;
  const Bytes dense = random_bytes(big, rng);
  Message m;
  m.segment(0);
  m.record(nullptr, dense.data(), 100, 1, 0, 1.0);
  const std::span<const std::byte> small = m.finish();
  const Bytes small_bytes(small.begin(), small.end());
  const auto kept = m.storage();  // a view handed out holds its buffer
  m.segment(1);
  m.record(nullptr, dense.data(), big, 1, 1, 1.0);  // grows into a new buffer
  EXPECT_NE(m.storage(), kept);
  EXPECT_TRUE(std::equal(small.begin(), small.end(), small_bytes.begin(), small_bytes.end()))
      << "the old view still reads its bytes";
  (void)m.finish();
  m.clear();
  EXPECT_GE(m.held_bytes(), big) << "kept after its own (large) message";
  m.segment(0);
  m.record(nullptr, dense.data(), 100, 1, 0, 1.0);
  (void)m.finish();
  m.clear();
  EXPECT_EQ(m.held_bytes(), 0U) << "more than 4 times its last message: let go";
  m.segment(0);
  m.record(nullptr, dense.data(), 100, 1, 0, 1.0);
  (void)m.finish();
  m.clear();
  const std::uint64_t allocations = testing::thread_allocations();
  for (int step = 0; step < 3; ++step) {
    m.segment(0);
    m.record(nullptr, dense.data(), 100, 1, 0, 1.0);
    (void)m.finish();
    m.clear();
  }
  EXPECT_EQ(testing::thread_allocations(), allocations) << "alike messages allocate nothing";
  Message other;
  m.segment(9);
  m.record(nullptr, dense.data(), 100, 1, 0, 1.0);
  other.copy_from(m);
  const std::span<const std::byte> a = m.finish();
  const std::span<const std::byte> b = other.finish();
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end()));
}

TEST(DeltaPair, BucketsNumberThePairsTransfersInOrder) {
  const std::vector<std::uint64_t> elements = {5, 0, 9};
  const std::vector<std::size_t> es = {4, 2, 1};
  const std::vector<Bucket> b = pair_buckets(elements, es, 8);
  const std::vector<std::array<std::uint64_t, 3>> want = {
      {0, 0, 2}, {0, 2, 2}, {0, 4, 1}, {2, 0, 8}, {2, 8, 1}};
  ASSERT_EQ(b.size(), want.size());
  for (std::size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ((std::array<std::uint64_t, 3>{b[i].transfer, b[i].start, b[i].n}), want[i]) << i;
  }
  EXPECT_EQ(pair_buckets(elements, es, 1).size(), 14U) << "a chunk below an element: one each";
  EXPECT_THROW((void)pair_buckets(elements, es, 0), InvalidArgument);
  EXPECT_THROW((void)pair_buckets(elements, std::vector<std::size_t>{4, 0, 1}, 8), InvalidArgument);
  EXPECT_THROW((void)pair_buckets(elements, std::vector<std::size_t>{4}, 8), InvalidArgument);
  // A record names its bucket in 32 bits: a pair of more buckets is refused, not wrapped.
  const std::vector<std::uint64_t> huge = {5, (std::uint64_t{1} << 32) - 4};
  const std::vector<std::size_t> bytes = {1, 1};
  EXPECT_THROW((void)pair_buckets(huge, bytes, 1), InvalidArgument);
}

// A pair of three transfers: a delta (4-byte elements), a dense one (2-byte), one not sent.
struct PairCase {
  std::mt19937_64 rng{kSeed};
  Bytes before0 = random_bytes(1000 * 4, rng), after0 = before0;
  Bytes after1 = random_bytes(300 * 2, rng), before1 = random_bytes(300 * 2, rng);
  Bytes third = random_bytes(64, rng);
  std::vector<PairTransfer> transfers;
  static constexpr std::size_t kChunk = 256;  // buckets: 16 of t0, 3 of t1, 1 of t2

  PairCase() {
    for (std::size_t i = 0; i < 1000; i += 97) {
      change(after0, 4, i, rng);  // one element in 11 of its 16 buckets
    }
    transfers = {{.after = after0.data(), .before = before0.data(), .n = 1000, .es = 4},
                 {.after = after1.data(), .before = nullptr, .n = 300, .es = 2},
                 {.after = nullptr, .before = nullptr, .n = 64, .es = 1}};
  }
};

TEST(DeltaPair, EncodesAndAppliesAWholePair) {
  PairCase c;
  Message m;
  m.segment(2);
  const PairEncoded e = m.pair(c.transfers, PairCase::kChunk, 1.0);
  EXPECT_EQ(e.dense_records, 3U);
  EXPECT_EQ(e.records, 3U + 11U);
  EXPECT_EQ(e.changed, 300U + 11U);
  const std::span<const std::byte> bytes = m.finish();
  const std::vector<Segment> seg = segments(bytes);
  ASSERT_EQ(seg.size(), 1U);
  EXPECT_EQ(seg[0].origin, 2U);
  Bytes dst0 = c.before0, dst1 = c.before1, dst2 = c.third;
  const std::vector<StridedView> views = {flat_view(dst0, 4), flat_view(dst1, 2),
                                          flat_view(dst2, 1)};
  const PairApplied a =
      apply_pair(bytes.subspan(seg[0].offset, seg[0].bytes), views, PairCase::kChunk);
  EXPECT_TRUE(a.failed.empty());
  EXPECT_EQ(a.touched, (std::vector<std::size_t>{0, 1}));
  EXPECT_EQ(dst0, c.after0);
  EXPECT_EQ(dst1, c.after1);
  EXPECT_EQ(dst2, c.third);

  // Only buckets 17 and 3 (a resend), in that order; dense since no `before` is given.
  Message again;
  again.segment(2);
  std::vector<PairTransfer> dense = c.transfers;
  dense[0].before = nullptr;
  const std::vector<std::uint32_t> only = {17, 3};
  const PairEncoded r = again.pair(dense, PairCase::kChunk, 1.0, std::span(only));
  EXPECT_EQ(r.records, 2U);
  EXPECT_EQ(r.dense_records, 2U);
  const std::span<const std::byte> resent = again.finish().subspan(kSegmentHeaderBytes);
  Bytes scratch = c.before1;
  const ApplyResult first = apply(resent, flat_view(scratch, 2), 128, 128);
  EXPECT_EQ(first.bucket, 17U);
  EXPECT_EQ(apply(resent.subspan(first.record_bytes), views[0], 192, 64).bucket, 3U);

  Message refused;
  refused.segment(2);
  const std::vector<std::uint32_t> beyond = {3, 20};
  try {
    (void)refused.pair(dense, PairCase::kChunk, 1.0, std::span(beyond));
    ADD_FAILURE() << "bucket 20 of 20 was encoded";
  } catch (const InvalidArgument& err) {
    EXPECT_NE(std::string(err.what()).find("bucket 20, of a pair of 20 buckets"), std::string::npos)
        << err.what();
  }
  EXPECT_TRUE(refused.finish().empty()) << "nothing written before the refusal";
}

TEST(DeltaPair, ApplyChecksEveryRecordBeforeWritingAny) {
  PairCase c;
  Message m;
  m.segment(0);
  (void)m.pair(c.transfers, PairCase::kChunk, 1.0);
  const std::span<const std::byte> bytes = m.finish().subspan(kSegmentHeaderBytes);
  const Bytes good(bytes.begin(), bytes.end());
  const std::size_t second = 40 + get64(good, 32);  // the second record's offset
  const auto untouched_after = [&](Bytes records, const std::string& needle) {
    Bytes dst0 = c.before0, dst1 = c.before1, dst2 = c.third;
    const std::vector<StridedView> views = {flat_view(dst0, 4), flat_view(dst1, 2),
                                            flat_view(dst2, 1)};
    std::string what = "accepted";
    try {
      (void)apply_pair(records, views, PairCase::kChunk);
    } catch (const InvalidArgument& e) {
      what = e.what();
    }
    EXPECT_NE(what.find(needle), std::string::npos) << what;
    EXPECT_TRUE(dst0 == c.before0 && dst1 == c.before1 && dst2 == c.third)
        << needle << ": a view was written";
  };
  Bytes b = good;
  put32(b, second, 0x12345678);  // the second record's magic
  untouched_after(b, "bad magic");
  b = good;
  put32(b, second + 4, 99);  // the second record's bucket
  untouched_after(
      b, "the record at byte " + std::to_string(second) + ": bucket 99, of a pair of 20 buckets");
  b = good;
  b.resize(good.size() + 16);  // a truncated third header
  untouched_after(b, "16 bytes, shorter than the 40-byte header");

  // A destination that did not hold `before` in a bucket the delta leaves partly alone: its
  // checksum fails (reported, not thrown), and what was written is told.
  Bytes dst0 = c.before0, dst1 = c.before1, dst2 = c.third;
  dst0[4 * 300 + 1] ^= std::byte{1};  // bucket 4 (elements 256..319), element 300 unchanged
  const std::vector<StridedView> views = {flat_view(dst0, 4), flat_view(dst1, 2),
                                          flat_view(dst2, 1)};
  const PairApplied a = apply_pair(good, views, PairCase::kChunk);
  EXPECT_EQ(a.failed, (std::vector<std::uint32_t>{4}));
  EXPECT_EQ(a.touched, (std::vector<std::size_t>{0, 1}));
}

}  // namespace
}  // namespace shardgather::delta
