#include "shardgather/round_call.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ops/call.h"
#include "ops/preflight.h"
#include "ops/start.h"
#include "transport/graveyard.h"

namespace shardgather {

// A collective's failure (a timeout, an abort, a peer gone) with the round it ended, of the same
// class: which step of a compound operation a stalled peer never came to.
[[noreturn]] void RoundCall::raise_in_round(const CommunicationError& e,
                                            std::string_view round) const {
  throw_error(e.code(),
              std::string(e.what()) + " (in round '" + name_ + ": " + std::string(round) + "')");
}

// Every round's bytes: what this rank sends ([header | row]), every rank's, their headers laid
// out for the header check, and the table of rows handed out.
struct RoundCall::Buffers {
  std::vector<std::byte> mine;
  std::vector<std::byte> gathered;
  std::vector<std::byte> headers;
  std::vector<detail::PreflightHeader> decoded;
  std::vector<std::int64_t> table;
  std::vector<std::int64_t> sizes;  // a messages() round's, kept past its "ready" round
};

namespace {

std::size_t checked_width(std::size_t width, const Communicator& comm) {
  // A messages() round sends one size per rank and this rank's receive capacity.
  return std::max(width, static_cast<std::size_t>(comm.size()) + 1);
}

}  // namespace

RoundCall::RoundCall(Communicator& comm, Operation op, std::string_view name,
                     std::optional<std::chrono::milliseconds> timeout, std::size_t width)
    : comm_(comm),
      name_(name),
      width_(checked_width(width, comm)),
      buffers_(std::make_unique<Buffers>()) {
  detail::run_blocking(comm, [&] {
    call_ = std::make_unique<detail::Call>(comm, op, Stage(), timeout, /*exchange=*/true);
  });
}

RoundCall::~RoundCall() = default;

void RoundCall::fail(ErrorCode code, std::string_view message) { call_->fail(code, message); }

void RoundCall::open(std::string_view round) {
  name_round(call_->header(), round);
  // What every round sends after its header: ranks that would send rows of other widths would
  // mis-size every gather, so the opening compares it.
  call_->header().payload_bytes = width_ * sizeof(std::int64_t);
  std::span<const detail::PreflightHeader> headers;
  detail::run_blocking(comm_, [&] {
    try {
      headers = call_->agree();
    } catch (const CommunicationError& e) {  // the call parked its own buffers
      raise_in_round(e, round);
    }
  });
  for (std::size_t r = 1; r < headers.size(); ++r) {
    if (headers[r].payload_bytes != headers[0].payload_bytes) {
      throw Mismatch("rank " + std::to_string(comm_.rank()) + ": " + name_ +
                     ": the call's rows differ: rank 0 sends " +
                     std::to_string(headers[0].payload_bytes / sizeof(std::int64_t)) +
                     " values per round, rank " + std::to_string(r) + " sends " +
                     std::to_string(headers[r].payload_bytes / sizeof(std::int64_t)));
    }
  }
  opened_ = true;
}

void RoundCall::check_open(std::string_view round) const {
  if (!opened_) {  // the embedder's bug, the same on every rank that runs the same code
    throw InvalidArgument("round '" + std::string(round) + "' of " + name_ +
                          " before the call was opened");
  }
}

// Sets `header`'s stage to "<name>: <round>", even after a failure (which the peers meet in this
// round, so it must name it); a name too long is this rank's failure.
void RoundCall::name_round(detail::PreflightHeader& header, std::string_view round) {
  try {
    detail::set_stage(header, Stage(name_ + ": " + std::string(round)));
  } catch (const Error& e) {
    call_->fail(e.code(), e.what());
    header = call_->header();  // a no-op for the opening, whose header is the call's
  }
}

std::span<const std::int64_t> RoundCall::rows(std::span<const std::int64_t> row,
                                              std::string_view round) {
  check_open(round);
  const auto world = static_cast<std::size_t>(comm_.size());
  Buffers& b = *buffers_;
  b.table.assign(world * width_, 0);
  if (row.size() > width_) {  // at world size 1 this raises at once
    call_->fail(ErrorCode::kInvalidArgument,
                "round '" + std::string(round) + "' sends " + std::to_string(row.size()) +
                    " values, more than the call's width " + std::to_string(width_));
  }
  if (!call_->exchanges()) {
    // World size 1: a failure was raised when recorded; the table is this rank's row.
    std::copy_n(row.begin(), std::min(row.size(), width_), b.table.begin());
    return b.table;
  }
  const std::size_t stride = sizeof(detail::PreflightHeader) + width_ * sizeof(std::int64_t);
  b.mine.assign(stride, std::byte{0});
  // A copy, not memcpy: an empty row (a header-only round) may have no data pointer.
  const std::span<const std::byte> values = std::as_bytes(row.first(std::min(row.size(), width_)));
  std::copy(values.begin(), values.end(),
            b.mine.begin() + static_cast<std::ptrdiff_t>(sizeof(detail::PreflightHeader)));
  gather(round);
  for (std::size_t r = 0; r < world; ++r) {
    std::memcpy(b.table.data() + r * width_,
                b.gathered.data() + r * stride + sizeof(detail::PreflightHeader),
                width_ * sizeof(std::int64_t));
  }
  return b.table;
}

// One round's all-gather of [header | row] (b.mine holds the row), then the header check.
void RoundCall::gather(std::string_view round) {
  Buffers& b = *buffers_;
  const auto world = static_cast<std::size_t>(comm_.size());
  const std::size_t stride = b.mine.size();
  detail::PreflightHeader header = call_->header();
  name_round(header, round);
  std::memcpy(b.mine.data(), &header, sizeof header);
  b.gathered.resize(world * stride);
  b.headers.resize(world * sizeof(detail::PreflightHeader));
  b.decoded.resize(world);
  detail::run_blocking(comm_, [&] {
    try {
      comm_.all_gather(b.mine, b.gathered, call_->deadline());
    } catch (const CommunicationError& e) {
      detail::park(b.mine);
      detail::park(b.gathered);
      raise_in_round(e, round);
    }
  });
  for (std::size_t r = 0; r < world; ++r) {
    std::memcpy(b.headers.data() + r * sizeof(detail::PreflightHeader),
                b.gathered.data() + r * stride, sizeof(detail::PreflightHeader));
  }
  detail::check_headers(b.headers, b.decoded, comm_.rank());
}

RoundCall::Messages RoundCall::messages(
    std::span<const std::span<const std::byte>> outgoing, std::string_view round,
    std::size_t capacity, const std::function<std::span<std::byte>(std::size_t)>& receive) {
  check_open(round);
  const auto world = static_cast<std::size_t>(comm_.size());
  std::vector<std::int64_t> counts(world + 1, 0);
  counts[world] = static_cast<std::int64_t>(capacity);  // after the sizes
  if (outgoing.size() != world) {
    call_->fail(ErrorCode::kInvalidArgument,
                "round '" + std::string(round) + "' has " + std::to_string(outgoing.size()) +
                    " messages for " + std::to_string(world) + " ranks");
  } else {
    std::transform(
        outgoing.begin(), outgoing.end(), counts.begin(),
        [](std::span<const std::byte> m) { return static_cast<std::int64_t>(m.size()); });
  }
  const std::span<const std::int64_t> table = rows(counts, std::string(round) + " sizes");
  buffers_->sizes.assign(table.begin(), table.end());
  const std::span<const std::int64_t> sizes = buffers_->sizes;
  const Incoming in = incoming(sizes, round);
  if (!in.cross) {
    return {sizes, {}};
  }
  if (!comm_.capabilities().all_to_all) {  // the same on every rank: every rank raises
    throw InvalidArgument("round '" + std::string(round) +
                          "' sends each pair its own bytes, which the " +
                          std::string(comm_.backend_name()) +
                          " transport cannot (no point-to-point exchange on this group)");
  }
  std::span<std::byte> recv;
  const auto take = [&] {
    recv = receive(in.total);
    if (recv.size() < in.total) {
      throw InvalidArgument("round '" + std::string(round) + "': a receive buffer of " +
                            std::to_string(recv.size()) + " bytes for " + std::to_string(in.total));
    }
    recv = recv.first(in.total);
  };
  if (in.grows) {
    // A buffer grows (a first or dense round): its allocation may fail on one rank, so it is a
    // local step, and a header-only round tells every rank before any byte moves.
    call_->check(take);
    (void)rows({}, std::string(round) + " ready");
  } else {
    take();  // within the capacity every rank stated: nothing to allocate
  }
  exchange(outgoing, sizes, recv, round);
  return {sizes, recv};
}

// Checks every size (a negative one is a corrupt peer's) and sums this rank's receives.
RoundCall::Incoming RoundCall::incoming(std::span<const std::int64_t> sizes,
                                        std::string_view round) const {
  const auto world = static_cast<std::size_t>(comm_.size());
  const auto me = static_cast<std::size_t>(comm_.rank());
  Incoming in;
  for (std::size_t d = 0; d < world; ++d) {
    std::int64_t need = 0;
    for (std::size_t s = 0; s < world; ++s) {
      need += s == d ? 0 : sizes[s * width_ + d];
    }
    in.grows = in.grows || need > sizes[d * width_ + world];
  }
  for (std::size_t s = 0; s < world; ++s) {
    for (std::size_t d = 0; d < world; ++d) {
      const std::int64_t n = sizes[s * width_ + d];
      if (n < 0) {
        throw Mismatch("rank " + std::to_string(me) + ": round '" + std::string(round) +
                       "': rank " + std::to_string(s) + " sends " + std::to_string(n) +
                       " bytes to rank " + std::to_string(d));
      }
      in.cross = in.cross || (s != d && n > 0);
      in.total += (d == me && s != me) ? static_cast<std::size_t>(n) : 0;
    }
  }
  return in;
}

// One all_to_all_scatter: outgoing[p] to each other rank p, what each sends here adjacent in
// rank order in `recv`.
void RoundCall::exchange(std::span<const std::span<const std::byte>> outgoing,
                         std::span<const std::int64_t> sizes, std::span<std::byte> recv,
                         std::string_view round) {
  const auto world = static_cast<std::size_t>(comm_.size());
  const auto me = static_cast<std::size_t>(comm_.rank());
  std::vector<ConstSegment> send;
  std::vector<std::size_t> send_first(world + 1, 0);
  std::vector<RecvPiece> pieces;
  std::vector<std::size_t> first(world + 1, 0);
  std::size_t at = 0;
  for (std::size_t p = 0; p < world; ++p) {
    if (p != me && !outgoing[p].empty()) {
      send.push_back({outgoing[p].data(), outgoing[p].size()});
    }
    send_first[p + 1] = send.size();
    const auto n = static_cast<std::uint64_t>(sizes[p * width_ + me]);
    if (p != me && n > 0) {
      pieces.push_back({recv.data() + at, n, 1, n});
      at += n;
    }
    first[p + 1] = pieces.size();
  }
  detail::run_blocking(comm_, [&] {
    try {
      comm_.all_to_all_scatter(send, send_first, pieces, first, call_->deadline());
    } catch (const CommunicationError& e) {
      // A failed exchange may still read what it was handed (the bytes are the caller's).
      detail::park(send);
      detail::park(send_first);
      detail::park(pieces);
      detail::park(first);
      raise_in_round(e, round);
    }
  });
}

}  // namespace shardgather
