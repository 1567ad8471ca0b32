// Strategies: how one exchange's bytes move. Each is one file (after Gloo and UCC); operations
// build an ExchangeJob, which says *what* moves, and select_strategy() picks *how*, among the
// strategies that run the job's shape.
//
// An exchange job is, for each peer, what this rank sends it and where what it receives from it
// lands (the shape Communicator::all_to_all_scatter takes). Three shapes cover the operations
// (docs/design.md, "The exchange job"):
//   kAllGather  every rank sends one stream, the same to every peer (foreach_all_gather, the
//               plans, unshard): every strategy runs it;
//   kGather     every rank sends one stream to `root` only (unshard's dst): kDirect;
//   kPersonal   each pair its own bytes (a reshard between two layouts; the exchange of a
//               reduce-scatter): kDirect.
// A combine step (what a reduction does with what arrives) has its place in the job; no operation
// builds one yet, and every strategy refuses one it does not run.

#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "copies/copy_table.h"
#include "copies/device_runtime.h"
#include "transport/shared_buffer.h"

#include "shardgather/communicator.h"
#include "shardgather/strategy.h"

namespace shardgather::detail {

enum class ExchangeShape : std::uint8_t { kAllGather, kGather, kPersonal };

// What a receiver does with the bytes it receives. kNone: they land in the pieces as they arrive.
// A reduce-scatter will add an operator (sum, ...) applied in `dtype` over what several peers send
// to one piece.
struct Combine {
  enum class Op : std::uint8_t { kNone };
  Op op = Op::kNone;
  DType dtype = DType::kUInt8;
};

// A stream's split into tensors (kAllGather, kGather), which only kPerTensor reads: rank r's part
// i has bytes[r * n + i] bytes and owns the pieces [first[r * n + i], first[r * n + i + 1]); this
// rank's part i is the send segments [send_first[i], send_first[i + 1]).
struct StreamParts {
  std::size_t count = 0;  // n, the tensors
  std::span<const std::uint64_t> bytes{};
  std::span<const std::size_t> first{};
  std::span<const std::size_t> send_first{};
};

struct ExchangeJob {
  ExchangeShape shape = ExchangeShape::kAllGather;
  // What this rank sends. kAllGather, kGather: its one stream, for every receiver. kPersonal: to
  // peer p the segments [send_first[p], send_first[p + 1]) (send_first has size() + 1 entries).
  std::span<const ConstSegment> send{};
  std::span<const std::size_t> send_first{};
  // Where what arrives from peer q lands: pieces [first[q], first[q + 1]) (size() + 1 entries).
  // kGather: read on the root only.
  std::span<const RecvPiece> pieces{};
  std::span<const std::size_t> first{};
  // size(). kAllGather, kGather: every rank's stream bytes (the same on every rank). kPersonal: the
  // bytes this rank receives from each peer.
  std::span<const std::uint64_t> counts{};
  int root = -1;  // kGather: the one receiver
  Combine combine{};
  StreamParts parts{};
  int copy_threads = 1;
  // kShared: where each rank's stream sits in the shared window (empty: back to back, 8-byte
  // aligned), and the window's size per round.
  std::span<const std::uint64_t> stream_displs{};
  // Every rank has entered this call (the pre-flight header was exchanged): kShared may then
  // overwrite the window without another barrier.
  bool entry_synchronized = false;
  // kCuda: every byte the job names (segments and pieces) is memory on this device, and the
  // payload moves through run_device on `stream`, whatever strategy was asked for.
  Device device{};
  void* stream = nullptr;
  // kPersonal on a device: the exchange moves in this many parts (the same on every rank), part
  // k carrying slice k of every pair's bytes, so that its staging is about 1/parts of this
  // rank's bytes sent and received.
  std::uint64_t device_parts = 1;
  // Which of the scratch's table uploads this job's launches reuse (one per exchange of a call).
  std::size_t upload_slot = 0;
};

// Whether `strategy` runs jobs of `shape` (kDirect: every shape; the others: kAllGather).
bool runs_shape(Strategy strategy, ExchangeShape shape) noexcept;

// kAuto measuring its two candidates on a plan's first executions (select.cc, plan_strategy).
struct AutoTrial {
  // The rule's windowed choice (kShared or kHierarchical) and kDirect; kAuto: not measuring.
  std::array<Strategy, 2> candidates{Strategy::kAuto, Strategy::kAuto};
  int runs = 0;  // trial executions recorded so far
  // This rank's fastest trial of each, in seconds (a candidate's first run is its warm-up).
  std::array<double, 2> best{std::numeric_limits<double>::infinity(),
                             std::numeric_limits<double>::infinity()};
  std::array<double, 2> slowest{};  // after settling: the slowest rank's best of each
  bool settled = false;
  Strategy chosen = Strategy::kAuto;
  const char* why = "";
};

// Scratch a strategy may need; owned by the plan so executions allocate nothing.
struct StrategyScratch {
  std::vector<std::byte> packed;      // kPacked: this rank's stream, contiguous
  std::vector<std::byte> padded;      // padded moves: this rank's stream, padded to the widest
  std::vector<std::byte> gathered;    // every rank's stream, rank-major, before a copy-out
  std::vector<std::uint64_t> displs;  // size()
  std::vector<std::uint64_t> counts;  // size()
  std::vector<std::size_t> first;     // size() + 1
  std::vector<RecvPiece> pieces;
  // kShared: the node-shared window.
  std::unique_ptr<SharedBuffer> window;
  std::uint64_t window_bytes = 0;
  std::uint64_t setup_collectives = 0;  // issued so far for one-time setup (the window)
  // The window could not be reserved on some rank: kAuto uses kDirect from then on.
  bool shared_unavailable = false;
  // kHierarchical: which ranks share each host, and the exchange between hosts.
  std::vector<std::size_t> host_start;    // hosts + 1
  std::vector<std::size_t> host_members;  // size()
  std::vector<std::size_t> host_local;    // size()
  std::vector<ConstSegment> a2a_send;
  std::vector<std::size_t> a2a_send_first;  // size() + 1
  std::vector<RecvPiece> a2a_pieces;
  std::vector<std::size_t> a2a_first;     // size() + 1
  std::vector<std::uint64_t> a2a_counts;  // size(): bytes from each peer
  AutoTrial trial;
  // The device path (device.cc): staging for strided inputs and the zero bytes gaps are sent
  // from (filled by the operation, send_stream.h's Stager), the contiguous send and gather
  // buffers, the three tables of its launches (the operation's packs into staging, copy-in,
  // copy-out) and their one upload (redone only when an address changes).
  DeviceMemory device_staging;
  DeviceMemory device_zeros;
  DeviceMemory device_send;
  DeviceMemory device_gathered;
  CopyTable copy_stage;
  CopyTable copy_in;
  CopyTable copy_out;
  // The tables' uploads: one per ExchangeJob::upload_slot (a fan-out's exchanges each have
  // their own tables, so that none re-uploads another's every execution).
  struct Upload {
    DeviceMemory memory;
    std::vector<CopyDesc> descs;  // what `memory` holds
  };
  std::vector<Upload> uploads;
  std::vector<CopyDesc> upload_staging;  // the next upload, assembled
  // The personal exchange on a device: per part, its copy-in and copy-out tables and its send
  // and receive counts (size() each); the tables' device copies, in upload order.
  std::vector<CopyTable> part_tables;  // 2 per part: copy-in, copy-out
  std::vector<std::uint64_t> part_counts;
  std::vector<ConstSegment> part_segments;  // one slice of a peer's send stream
  std::vector<std::uint64_t> pair_bytes;    // 2 * size(): sent to, then received from, each peer
  struct Cursor {                           // where slicing a peer's list stands
    std::size_t item = 0;
    std::uint64_t at = 0;  // the byte at which `item` starts
  };
  std::vector<Cursor> send_cursors;          // size()
  std::vector<Cursor> recv_cursors;          // size()
  std::vector<const CopyTable*> table_list;  // the launches' tables, in upload order
  std::vector<const CopyDesc*> on_device;
};

// When every rank's pieces form one contiguous run, fills scratch.displs relative to *base and
// returns true: the job can use all_gather_v (a plain MPI_Iallgatherv).
bool contiguous_per_rank(std::span<const RecvPiece> pieces, std::span<const std::size_t> first,
                         std::span<const std::uint64_t> counts, std::byte*& base,
                         std::vector<std::uint64_t>& displs);

// One collective moving `send` (this rank's stream) into every rank's pieces: straight into
// place where the transport can (all_gather_v into contiguous blocks; all_gather_scatter where
// it scatters and `may_scatter`), else rank-major into scratch.gathered and copied out, and
// padded (gather_padded) where it has no exact gather-v. Copy-outs run on `copy_threads`.
// Leaves scratch.counts, .first and .pieces alone (kPerTensor's per-tensor views live there).
void gather_into_pieces(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                        std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                        bool may_scatter, int copy_threads, Communicator& comm, Deadline deadline,
                        StrategyScratch& scratch);
// The padded move: every rank's stream padded to the largest count, one all_gather, each rank's
// real bytes copied to its pieces (received in place when the blocks are equal and adjacent).
void gather_padded(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                   std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                   int copy_threads, Communicator& comm, Deadline deadline,
                   StrategyScratch& scratch);

void run_direct(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                StrategyScratch& scratch);
void run_packed(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                StrategyScratch& scratch);
void run_per_tensor(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                    StrategyScratch& scratch);
// Where each rank's stream sits in the window: job.stream_displs, or back to back in scratch.
std::span<const std::uint64_t> window_displs(const ExchangeJob& job, StrategyScratch& scratch);
// Makes the window on a first execution (collective; the barrier of the reuse rule otherwise)
// and copies this rank's stream into its region; returns the window's base.
std::byte* window_round(const ExchangeJob& job, std::span<const std::uint64_t> displs,
                        Communicator& comm, Deadline deadline, StrategyScratch& scratch);
// Every rank's stream from the window into this rank's pieces.
void copy_out_window(const ExchangeJob& job, const std::byte* base,
                     std::span<const std::uint64_t> displs);
// window_round, then meets the others; returns the round's base (every rank's stream at its
// stream_displs).
std::byte* shared_copy_in(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                          StrategyScratch& scratch);
void run_shared(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                StrategyScratch& scratch);
// Whether kShared can run here: every rank on this host, more than one rank.
bool shared_available(const Communicator& comm) noexcept;
void run_hierarchical(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                      StrategyScratch& scratch);
// Whether kHierarchical can run here: hosts known, more than one, some with several ranks, and
// a transport with all_to_all_scatter.
bool hierarchical_available(const Communicator& comm) noexcept;

// `requested` resolved for a job of `shape` moving `counts` bytes per rank on this backend: a
// strategy that does not run the shape (runs_shape) resolves to kDirect; kAuto from the
// backend's facts (a window wherever one can exist; plans then measure it, plan_strategy), kShared
// and kHierarchical to kDirect where they cannot run. `shared_unavailable`: the plan's window could
// not be reserved, so kAuto never picks kShared. Every input is the same on every rank, and so is
// the answer (the pre-flight header compares it).
Strategy select_strategy(Strategy requested, ExchangeShape shape,
                         std::span<const std::uint64_t> counts, const Communicator& comm,
                         bool shared_unavailable);

// The strategy for one execution of a plan: select_strategy's, except where kAuto chose a
// node-shared window (kShared, kHierarchical): that choice is measured against kDirect. The
// first kAutoTrialRuns (strategy.h) executions alternate the two (the window first), then every
// rank settles, in record_auto, on the one that was faster for the slowest rank, and later
// executions run it. `why` says which of these decided (a static string). Every input is the
// same on every rank and so is the answer, execution by execution.
Strategy plan_strategy(Strategy requested, ExchangeShape shape,
                       std::span<const std::uint64_t> counts, const Communicator& comm,
                       StrategyScratch& scratch, const char*& why);
// After an execution's payload ran with `ran` in `seconds` (this rank's time): records a trial,
// and after the last one agrees with every rank on the choice (one all_gather, which the caller
// counts as setup). Collective while measuring; does nothing otherwise.
void record_auto(Strategy ran, double seconds, Communicator& comm, Deadline deadline,
                 StrategyScratch& scratch);

// The form for every rank's `counts` (the same on every rank, so every rank issues the same
// collectives): equal counts pad nothing and are one all-gather whatever was asked; else the
// request, and under kAuto one padded all-gather when the padding adds at most
// 1/kPaddingDivisor of the bytes, one broadcast per rank otherwise.
DeviceGatherForm device_gather_form(std::span<const std::uint64_t> counts,
                                    DeviceGather request) noexcept;

// The device path: the operation's deferred packs of strided inputs (scratch.copy_stage, filled
// before this), one fused copy-in into a contiguous device buffer (skipped when the stream is
// one contiguous run already), one all_gather_v_device, one fused copy-out into the pieces
// (skipped when every rank's pieces are one run: the gather lands in place), all enqueued on
// job.stream. Returns once they are enqueued (DeviceWait::kStream) or, under DeviceWait::kHost,
// once the device has run them (polled against `deadline`: Timeout, or Aborted after abort()).
// Launches at most three kernels, never waits for a stream on the host in the first mode, and
// after the first execution of a plan allocates nothing and uploads nothing while the tensors stay
// where they were. `request` is the one every rank agreed on (the header's).
// kPersonal (a reshard): the packs, then per part (job.device_parts) one fused copy-in of that
// part's slice of each peer's segments into a contiguous send buffer (this rank's own bytes go
// straight to its pieces, in part 0's), one all_to_all_v_device and one fused copy-out into the
// pieces; the send and receive buffers hold one part at a time (stream order makes the reuse
// safe), 1 + 2 x parts launches. A job of more than one part allocates host vectors for its
// slices of strided pieces.
void run_device(const ExchangeJob& job, DeviceGather request, Communicator& comm, Deadline deadline,
                StrategyScratch& scratch);

// The host waits until the device has run what `stream` holds, polling against `deadline`
// (Timeout), the communicator's abort (Aborted) and an interrupt. The enqueued work cannot be
// called back: after Timeout or Aborted it still runs, into memory released in stream order.
void wait_on_host(void* stream, Communicator& comm, Deadline deadline);

// The personal exchange's parts on a device: slice k of `parts` of a pair's `bytes` (both sides
// of the pair cut it alike; every slice but the last a multiple of 16 bytes), and the largest
// part over pairs of those byte counts (the send or receive buffer's size), which the operation
// also reserves before the agreement.
std::pair<std::uint64_t, std::uint64_t> device_part_slice(std::uint64_t bytes, std::uint64_t parts,
                                                          std::uint64_t k);
std::uint64_t device_part_room(std::span<const std::uint64_t> pair_bytes, std::uint64_t parts);

// Where run_device marks the end of its work for a started operation (ops/start.h): while a scope
// is open on a thread, every run_device on it records `event` on its stream after its last
// launch, so that the operation's waiter can make its own stream wait for that point.
struct DeviceCompletion {
  DeviceEvent event;
  bool recorded = false;
  int device = -1;  // the CUDA device of the stream it was recorded on
};

class DeviceCompletionScope {
 public:
  explicit DeviceCompletionScope(DeviceCompletion& slot) noexcept;
  DeviceCompletionScope(const DeviceCompletionScope&) = delete;
  DeviceCompletionScope& operator=(const DeviceCompletionScope&) = delete;
  DeviceCompletionScope(DeviceCompletionScope&&) = delete;
  DeviceCompletionScope& operator=(DeviceCompletionScope&&) = delete;
  ~DeviceCompletionScope();

 private:
  DeviceCompletion* previous_;
};

// Runs the job with `strategy` (already resolved; InvalidArgument where it does not run the job's
// shape or combine step).
void run_strategy(Strategy strategy, const ExchangeJob& job, Communicator& comm, Deadline deadline,
                  StrategyScratch& scratch);

}  // namespace shardgather::detail
