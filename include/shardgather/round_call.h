// A compound operation as one call of several rounds, for embedders that run a protocol of their
// own between the rounds (the Python weight sync: state, payload sizes, payload, vote).
//
//   RoundCall call(comm, Operation::kWeightSync, "WeightSync.sync", timeout, /*width=*/7);
//   call.open("state");                              // the pre-flight header, as any call's
//   auto table = call.rows(my_state, "state");       // every rank's row, [world x width]
//   ... a local step fails: call.fail(code, text) ... the next round raises it on every rank
//   auto got = call.messages(outgoing, "payload", receive_buffer);
//   auto votes = call.rows(my_vote, "vote");
//
// One call: one sequence number (taken when it is made), one operation in the pre-flight header,
// and every round is one all-gather of every rank's header followed by its row, so that
//  - a rank whose local step failed between two rounds makes every rank raise its error (class
//    and text, naming it) at the next round, not a deadline later;
//  - ranks in different rounds (or calls) raise Mismatch naming both steps ("<name>: <round>");
//  - a round whose collective fails (a timeout, an abort, a peer gone) raises that class with the
//    round named ("... (in round '<name>: <round>')").
// Every round gathers the same number of bytes (width() int64 per rank after the header), so
// ranks in different rounds always complete the gather and meet the header check. The opening is
// the plain 400-byte header exchange of every call, so a rank making any other operation raises
// Mismatch ("operation differs") there.
//
// One deadline for the whole call: `timeout` (the communicator's when unset) from when the call
// is made. Every round, the opening included, ends by it, however long the embedder's own steps
// between rounds take, so a stalled peer costs a caller at most one timeout per call.
// A round runs as a blocking operation of the communicator (after every operation started before
// it). World size 1: nothing travels, and fail() raises at once.
//
// Threading: one thread drives a call, like any blocking operation; the communicator's other
// operations may run between its rounds only if every rank orders them alike (its contract).
// Ownership: a rows() table stays valid until the next round of this call, a messages() round's
// sizes until the next messages() round. After a CommunicationError the call's buffers are
// parked (a failed collective may still touch them); the outgoing bytes and the receive buffer
// are the caller's to park.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "shardgather/communicator.h"
#include "shardgather/embedding.h"
#include "shardgather/errors.h"
#include "shardgather/export.h"

namespace shardgather {

namespace detail {
class Call;
struct PreflightHeader;
}  // namespace detail

class SHARDGATHER_API RoundCall {
 public:
  // `name` prefixes every round's stage ("<name>: <round>", at most Stage::kMaxBytes bytes).
  // `width`: the int64 values of the longest row a round sends (a messages() round's is the world
  // size plus one, so width() is at least that); every rank must pass the same (open() checks).
  // Nothing travels until open().
  RoundCall(Communicator& comm, Operation op, std::string_view name,
            std::optional<std::chrono::milliseconds> timeout, std::size_t width);
  RoundCall(const RoundCall&) = delete;
  RoundCall& operator=(const RoundCall&) = delete;
  RoundCall(RoundCall&&) = delete;
  RoundCall& operator=(RoundCall&&) = delete;
  ~RoundCall();

  [[nodiscard]] std::size_t width() const noexcept { return width_; }

  // The call's header exchange, with the stage "<name>: <round>": raises on every rank a failure
  // recorded before it or a disagreement (another operation, step, sequence number or width).
  // Every round comes after it (InvalidArgument, on this rank, for a round before it).
  void open(std::string_view round);

  // Records this rank's failure: the next round (or open) raises it on every rank. The first one
  // recorded is the one raised. At world size 1 it raises at once.
  void fail(ErrorCode code, std::string_view message);

  // Every rank's `row` (at most width() values; zero-padded) as a row-major [world x width()]
  // table, the same on every rank. Raises on every rank the first failure any rank recorded.
  std::span<const std::int64_t> rows(std::span<const std::int64_t> row, std::string_view round);

  struct Messages {
    // [world x width()]: sizes[s * width() + d] is what rank s sent rank d (its own included);
    // column world is rank s's receive capacity.
    std::span<const std::int64_t> sizes;
    // What every other rank sent this one, in rank order, adjacent (this rank's own message is
    // not copied here: the caller has it).
    std::span<std::byte> received;
  };
  // One personal exchange: outgoing[p] (world entries) goes to rank p. Its sizes travel first, as
  // the round "<round> sizes", with each rank's receive `capacity`; then `receive(n)` is asked for
  // at least n bytes (n: what the others send this rank, 0 included) and every other rank's
  // message lands there. Where some rank's n exceeds its capacity, every rank runs `receive` as a
  // local step (what it throws, bad_alloc included, is recorded) and a header-only round
  // "<round> ready" raises it on every rank before any byte moves; within the capacity,
  // `receive` must not fail (nothing tells the peers). When no rank sends another anything, only
  // the sizes travel. The caller keeps the outgoing bytes and the receive buffer alive, and
  // after a CommunicationError parks them (a failed exchange may still touch them).
  Messages messages(std::span<const std::span<const std::byte>> outgoing, std::string_view round,
                    std::size_t capacity,
                    const std::function<std::span<std::byte>(std::size_t)>& receive);

 private:
  struct Buffers;
  struct Incoming {
    std::size_t total = 0;  // bytes the others send this rank
    bool cross = false;     // whether any rank sends another anything
    bool grows = false;     // whether some rank receives more than its capacity
  };
  void check_open(std::string_view round) const;
  void gather(std::string_view round);
  [[nodiscard]] Incoming incoming(std::span<const std::int64_t> sizes,
                                  std::string_view round) const;
  void exchange(std::span<const std::span<const std::byte>> outgoing,
                std::span<const std::int64_t> sizes, std::span<std::byte> recv,
                std::string_view round);
  [[noreturn]] void raise_in_round(const CommunicationError& e, std::string_view round) const;
  void name_round(detail::PreflightHeader& header, std::string_view round);

  Communicator& comm_;
  std::string name_;
  std::size_t width_;
  bool opened_ = false;
  std::unique_ptr<detail::Call> call_;
  std::unique_ptr<Buffers> buffers_;
};

}  // namespace shardgather
