// A weight sync's messages: segments of delta records (shardgather/delta.h).
#include <algorithm>
#include <cstring>
#include <string>

#include "shardgather/delta.h"
#include "shardgather/errors.h"

namespace shardgather::delta {
namespace {

// The first buffer: small messages (a sparse delta) never grow past it.
constexpr std::size_t kFirstBytes = std::size_t{1} << 16;

void put_u32(std::byte* at, std::uint32_t v) noexcept { std::memcpy(at, &v, sizeof v); }
void put_u64(std::byte* at, std::uint64_t v) noexcept { std::memcpy(at, &v, sizeof v); }

template <typename T>
T get(const std::byte* at) noexcept {
  T v{};
  std::memcpy(&v, at, sizeof v);
  return v;
}

}  // namespace

void Message::reserve(std::size_t more) {
  if (bytes_ != nullptr && bytes_->size() >= used_ + more) {
    return;
  }
  // A new buffer, not a resize: views of the old one (a message handed out) stay valid.
  auto grown = std::make_shared<std::vector<std::byte>>(std::max(2 * (used_ + more), kFirstBytes));
  if (bytes_ != nullptr) {
    std::copy_n(bytes_->begin(), used_, grown->begin());
  }
  bytes_ = std::move(grown);
}

void Message::close() {
  if (!open_at_) {
    return;
  }
  const std::size_t at = *open_at_;
  open_at_.reset();
  const std::size_t records = used_ - at - kSegmentHeaderBytes;
  if (records == 0) {
    used_ = at;  // an empty segment is dropped
    return;
  }
  std::byte* head = bytes_->data() + at;
  put_u32(head, origin_);
  put_u32(head + 4, 0);
  put_u64(head + 8, records);
  put_u64(head + 16, checksum(head + kSegmentHeaderBytes, records));
}

void Message::segment(std::uint32_t origin) {
  close();
  reserve(kSegmentHeaderBytes);
  open_at_ = used_;
  origin_ = origin;
  used_ += kSegmentHeaderBytes;
}

EncodeResult Message::record(const void* before, const void* after, std::size_t n, std::size_t es,
                             std::uint32_t bucket, double dense_ratio) {
  if (!open_at_) {
    throw InvalidArgument("delta: bucket " + std::to_string(bucket) +
                          ": a record needs an open segment");
  }
  const std::size_t room = max_record_bytes(n, es);
  reserve(room);
  const EncodeResult r = encode(before, after, n, es, bucket, dense_ratio,
                                std::span<std::byte>(bytes_->data() + used_, room));
  used_ += r.bytes;
  return r;
}

void Message::copy_from(Message& other) {
  if (&other == this) {
    close();
    return;
  }
  const std::span<const std::byte> theirs = other.finish();
  close();
  used_ = 0;
  reserve(theirs.size());
  std::copy(theirs.begin(), theirs.end(), bytes_->begin());
  used_ = theirs.size();
}

std::span<const std::byte> Message::finish() {
  close();
  if (bytes_ == nullptr) {
    return {};
  }
  return {bytes_->data(), used_};
}

void Message::clear() noexcept {
  if (held_bytes() > 4 * std::max(used_, kFirstBytes)) {
    bytes_.reset();  // views handed out keep their buffer; this message lets it go
  }
  used_ = 0;
  open_at_.reset();
}

std::vector<Segment> segments(std::span<const std::byte> message) {
  std::vector<Segment> out;
  std::size_t at = 0;
  while (at < message.size()) {
    const std::size_t left = message.size() - at;
    if (left < kSegmentHeaderBytes) {
      throw InvalidArgument("a truncated segment header: " + std::to_string(left) +
                            " bytes at byte " + std::to_string(at));
    }
    const std::byte* head = message.data() + at;
    const auto records = get<std::uint64_t>(head + 8);
    if (get<std::uint32_t>(head + 4) != 0 || records > left - kSegmentHeaderBytes) {
      throw InvalidArgument("a segment at byte " + std::to_string(at) + " of " +
                            std::to_string(records) + " bytes where " +
                            std::to_string(left - kSegmentHeaderBytes) + " remain");
    }
    const std::size_t offset = at + kSegmentHeaderBytes;
    out.push_back({get<std::uint32_t>(head), offset, records,
                   checksum(message.data() + offset, records) == get<std::uint64_t>(head + 16)});
    at = offset + records;
  }
  return out;
}

}  // namespace shardgather::delta
