// A weight sync's pairs (shardgather/delta.h): one source's transfers to one destination, cut
// into numbered buckets, encoded into a message and applied from one, a whole segment per call.
#include <algorithm>
#include <cstring>
#include <string>

#include "shardgather/delta.h"
#include "shardgather/errors.h"

namespace shardgather::delta {
namespace {

constexpr std::uint64_t kMaxBuckets = std::uint64_t{1} << 32;

// `where()` prefixes the error (a callable: its text is built only when a bucket is refused).
template <typename Where>
void check_bucket(std::uint32_t bucket, std::size_t count, const Where& where) {
  if (bucket >= count) {
    throw InvalidArgument("delta: " + where() + "bucket " + std::to_string(bucket) +
                          ", of a pair of " + std::to_string(count) + " buckets");
  }
}

std::uint64_t view_elements(const StridedView& v) {
  std::uint64_t n = 1;
  for (const std::int64_t s : v.sizes) {
    if (s < 0) {
      throw InvalidArgument("delta: a view of size " + std::to_string(s));
    }
    n *= static_cast<std::uint64_t>(s);
  }
  return n;
}

std::vector<Bucket> buckets_of(std::span<const StridedView> views, std::size_t chunk_bytes) {
  std::vector<std::uint64_t> elements;
  std::vector<std::size_t> es;
  elements.reserve(views.size());
  es.reserve(views.size());
  for (const StridedView& v : views) {
    elements.push_back(view_elements(v));
    es.push_back(v.es);
  }
  return pair_buckets(elements, es, chunk_bytes);
}

// Each record's place in `records`, checked against its bucket's view before anything is written.
std::vector<std::pair<std::size_t, const Bucket*>> check_all(std::span<const std::byte> records,
                                                             std::span<const StridedView> views,
                                                             std::span<const Bucket> buckets) {
  std::vector<std::pair<std::size_t, const Bucket*>> found;
  std::size_t at = 0;
  while (at < records.size()) {
    // Built only for an error: this loop runs once per record received.
    const auto where = [at] { return "the record at byte " + std::to_string(at) + ": "; };
    if (records.size() - at < kHeaderBytes) {
      throw InvalidArgument("delta: " + where() + std::to_string(records.size() - at) +
                            " bytes, shorter than the 40-byte header");
    }
    std::uint32_t magic = 0;
    std::uint32_t bucket = 0;
    std::memcpy(&magic, records.data() + at, sizeof magic);
    std::memcpy(&bucket, records.data() + at + 4, sizeof bucket);
    if (magic != kMagic) {
      throw InvalidArgument("delta: " + where() + "not a record (bad magic)");
    }
    check_bucket(bucket, buckets.size(), where);
    const Bucket& b = buckets[bucket];
    std::size_t bytes = 0;
    try {
      bytes = check(records.subspan(at), views[b.transfer], b.start, b.n);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(where() + e.what());
    }
    found.emplace_back(at, &b);
    at += bytes;
  }
  return found;
}

}  // namespace

std::vector<Bucket> pair_buckets(std::span<const std::uint64_t> elements,
                                 std::span<const std::size_t> es, std::size_t chunk_bytes) {
  if (chunk_bytes == 0 || elements.size() != es.size()) {
    throw InvalidArgument("delta: pair_buckets of chunk_bytes " + std::to_string(chunk_bytes) +
                          " over " + std::to_string(elements.size()) + " transfers and " +
                          std::to_string(es.size()) + " element sizes");
  }
  std::vector<Bucket> out;
  for (std::size_t k = 0; k < elements.size(); ++k) {
    if (es[k] == 0) {
      throw InvalidArgument("delta: transfer " + std::to_string(k) + " has 0-byte elements");
    }
    const std::uint64_t step = std::max<std::uint64_t>(1, chunk_bytes / es[k]);
    const std::uint64_t count = elements[k] / step + (elements[k] % step != 0 ? 1 : 0);
    if (count > kMaxBuckets - out.size()) {  // refused before it is allocated
      throw InvalidArgument("delta: a pair of more than 2^32 buckets (chunk_bytes " +
                            std::to_string(chunk_bytes) +
                            "): a record names its bucket in 32 bits");
    }
    for (std::uint64_t at = 0; at < elements[k]; at += step) {
      out.push_back({.transfer = k, .start = at, .n = std::min(step, elements[k] - at)});
    }
  }
  return out;
}

PairEncoded Message::pair(std::span<const PairTransfer> transfers, std::size_t chunk_bytes,
                          double dense_ratio, std::optional<std::span<const std::uint32_t>> only) {
  std::vector<std::uint64_t> elements;
  std::vector<std::size_t> es;
  for (const PairTransfer& t : transfers) {
    elements.push_back(t.n);
    es.push_back(t.es);
  }
  const std::vector<Bucket> buckets = pair_buckets(elements, es, chunk_bytes);
  for (const std::uint32_t b : only.value_or(std::span<const std::uint32_t>{})) {
    check_bucket(b, buckets.size(), [] { return std::string("asked again for "); });
  }
  PairEncoded out;
  const auto encode_one = [&](std::uint32_t id) {
    const Bucket& b = buckets[id];
    const PairTransfer& t = transfers[b.transfer];
    if (t.after == nullptr) {
      return;
    }
    const auto* after = static_cast<const std::byte*>(t.after) + b.start * t.es;
    const auto* before =
        t.before == nullptr ? nullptr : static_cast<const std::byte*>(t.before) + b.start * t.es;
    const EncodeResult r = record(before, after, b.n, t.es, id, dense_ratio);
    out.records += r.bytes != 0 ? 1 : 0;
    out.dense_records += r.encoding == Encoding::kDense ? 1 : 0;
    out.changed += r.changed;
  };
  if (only) {
    std::for_each(only->begin(), only->end(), encode_one);
  } else {
    for (std::size_t id = 0; id < buckets.size(); ++id) {
      encode_one(static_cast<std::uint32_t>(id));
    }
  }
  return out;
}

PairApplied apply_pair(std::span<const std::byte> records, std::span<const StridedView> views,
                       std::size_t chunk_bytes, bool verify) {
  const std::vector<Bucket> buckets = buckets_of(views, chunk_bytes);
  PairApplied out;
  std::vector<bool> touched(views.size(), false);
  for (const auto& [at, b] : check_all(records, views, buckets)) {
    const ApplyResult r = apply(records.subspan(at), views[b->transfer], b->start, b->n, verify);
    touched[b->transfer] = true;
    out.changed += r.changed;
    if (!r.checksum_ok) {
      out.failed.push_back(r.bucket);
    }
  }
  for (std::size_t k = 0; k < touched.size(); ++k) {
    if (touched[k]) {
      out.touched.push_back(k);
    }
  }
  return out;
}

}  // namespace shardgather::delta
