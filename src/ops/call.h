// The one call protocol. Every operation is a short client of it:
//
//   Call call(comm, Operation::kPlanExecute, options.stage, options.timeout, options.preflight,
//             &scratch.hb);
//   call.check([&] { validate(...); call.header().payload_bytes = ...; });  // local steps
//   call.agree();                                     // header exchange + every check, all ranks
//   call.guard(out);                                  // what a failed collective may touch
//   call.transfer([&] { run_payload(...); });         // the payload
//
// It owns the deadline (one for the whole call), the operation's sequence number, the capture of
// local failures (Error and bad_alloc: recorded in the header so every rank raises the same
// class from agree(), or raised at once where no header travels), the header exchange and its
// checks, and the guard that parks every buffer a failed collective may still touch.
//
// Threading: a Call lives on the stack of one operation on one thread.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <new>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "ops/preflight.h"

#include "shardgather/buffer.h"
#include "shardgather/communicator.h"
#include "shardgather/embedding.h"
#include "shardgather/errors.h"
#include "shardgather/strategy.h"

namespace shardgather::detail {

class ScratchHolder;
struct StrategyScratch;

// The header exchange's buffers. Plans keep theirs in their scratch so that a steady-state
// execution allocates nothing; a one-shot call uses the Call's own.
struct HeaderBuffers {
  std::vector<std::byte> mine;  // this rank's header as sent: a failed exchange may still read it
  std::vector<std::byte> gathered;
  std::vector<PreflightHeader> decoded;
};

class Call {
 public:
  // `exchange`: whether the header travels (it never does at world size 1). A negative timeout
  // is a local failure of the call (the communicator's timeout bounds its header). `stage`: the
  // step of a compound operation this call is (stage.h), carried in the header.
  Call(Communicator& comm, Operation op, const Stage& stage,
       std::optional<std::chrono::milliseconds> timeout, bool exchange,
       HeaderBuffers* buffers = nullptr);
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  Call(Call&&) = delete;
  Call& operator=(Call&&) = delete;
  ~Call() = default;

  [[nodiscard]] Communicator& comm() const noexcept { return comm_; }
  [[nodiscard]] Deadline deadline() const noexcept { return deadline_; }
  [[nodiscard]] bool exchanges() const noexcept { return exchange_; }
  [[nodiscard]] bool failed() const noexcept { return header_.status != 0; }
  // The operation fills its fields (dtypes, bytes, fingerprint, strategy) in its check steps.
  [[nodiscard]] PreflightHeader& header() noexcept { return header_; }

  // Runs a local step unless an earlier one failed. What it throws (an Error, bad_alloc, any
  // std::exception) is recorded for agree(); where no header travels it is raised here, naming
  // this rank. Allocations after agree() (the no-hint output) are outside this: a failure there
  // is raised on its rank only, and the peers meet it at their deadline.
  template <typename Step>
  void check(Step&& step) {
    if (failed()) {
      return;
    }
    try {
      step();
    } catch (const Error& e) {
      fail(e.code(), e.what());
    } catch (const std::bad_alloc&) {
      fail(ErrorCode::kOutOfMemory, "allocation failed while preparing the call");
    } catch (const std::exception& e) {  // a length_error from a resize, ...
      fail(ErrorCode::kInvalidArgument, e.what());
    }
  }

  // Records a local failure (as check does).
  void fail(ErrorCode code, std::string_view message);

  // Exchanges the header and raises, identically on every rank, the first failed local check or
  // disagreement (operation, strategy, world size, sequence number, count, hint, dtypes).
  // Returns every rank's header; empty when no header travels.
  std::span<const PreflightHeader> agree();

  // Buffers a collective of this call may still touch after a CommunicationError: transfer()
  // parks them instead of letting them be freed. Guarded objects must outlive the transfer.
  // Any number may be guarded: the first few (2 aligned buffers, 8 vectors: every operation so
  // far) take no allocation, more spill to the heap, where a bad_alloc is raised by guard() on
  // this rank, before the transfer: never a buffer left unguarded.
  void guard(AlignedBuffer& buffer) { aligned_.add(&buffer); }
  void guard(std::vector<std::byte>& buffer) { vectors_.add(&buffer); }
  void guard(ScratchHolder& scratch) noexcept { scratch_ = &scratch; }
  // A one-shot job's strategy scratch, whole: its staging (packed, padded, gathered) and the
  // node-shared window an explicit strategy makes during the transfer.
  void guard(StrategyScratch& scratch) noexcept { strategy_ = &scratch; }

  // Runs a collective of this call; on a CommunicationError parks everything guarded and
  // rethrows.
  template <typename Fn>
  decltype(auto) transfer(Fn&& fn) {
    try {
      return fn();
    } catch (const CommunicationError&) {
      park_guarded();
      throw;
    }
  }

 private:
  // Pointers to what a call guards: N inline (enough for every operation so far, so a steady
  // state allocates nothing), the rest in `more`.
  template <typename T, std::size_t N>
  struct Guarded {
    std::array<T*, N> first{};
    std::size_t n = 0;
    std::vector<T*> more;
    void add(T* p) {
      if (n < N) {
        first[n++] = p;
      } else {
        more.push_back(p);
      }
    }
    template <typename Fn>
    void each(Fn&& fn) const noexcept {
      for (std::size_t k = 0; k < n; ++k) {
        fn(*first[k]);
      }
      for (T* p : more) {
        fn(*p);
      }
    }
    void clear() noexcept {
      n = 0;
      more.clear();
    }
  };
  void park_guarded() noexcept;
  [[noreturn]] void raise_local() const;

  Communicator& comm_;
  Operation op_;
  Deadline deadline_;
  bool exchange_;
  HeaderBuffers own_;
  HeaderBuffers* buffers_;
  PreflightHeader header_;
  Guarded<AlignedBuffer, 2> aligned_;
  Guarded<std::vector<std::byte>, 8> vectors_;
  ScratchHolder* scratch_ = nullptr;
  StrategyScratch* strategy_ = nullptr;
};

// The operations' sequence numbers come from here (tests skew them through it).
std::uint64_t next_op_seq(Communicator& comm) noexcept;

}  // namespace shardgather::detail
