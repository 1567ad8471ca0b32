// Plans: build once from every rank's shapes and dtypes, execute every step.
//
//   auto plan = AllGatherPlan::create(params, comm, shapes_hint);  // once (collective without
//   hint) std::vector<std::byte> out(plan.output_bytes());                // or any caller memory
//   for (step...) plan.execute(params, comm, out);                  // no allocation, no metadata
//   plan.views(out.data())[i * world + r]                            // rank r's tensor i
//
// An execution validates this rank's tensors against the plan (shape, dtype, data), optionally
// exchanges the fixed-size pre-flight header (sequence number, count, dtypes, plan fingerprint,
// local status: a check, not metadata), and moves the payload in one collective. Steady state:
// zero heap allocations and zero metadata collectives per execution (tests count both).
//
// A plan is a value: copyable, movable, usable with any communicator of the same world size and
// rank. It is not thread-safe: one thread executes a plan at a time (it holds scratch space).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "shardgather/communicator.h"
#include "shardgather/export.h"
#include "shardgather/layout.h"
#include "shardgather/types.h"

namespace shardgather {

// How the payload moves. kAuto picks by backend and size (docs/benchmarking.md has the table
// measured on the target machine).
enum class Strategy : std::uint8_t {
  kAuto = 0,
  // One collective, sent straight from the tensors and received straight into the final layout
  // (MPI derived datatypes; the threads backend copies peer memory directly). No copy-in, no
  // copy-out.
  kDirect = 1,
  // Copy-in to one contiguous buffer (all cores for large lists), one collective, copy-out when
  // the final layout is not the gathered one.
  kPacked = 2,
  // One collective per tensor: the baseline.
  kPerTensor = 3,
  // Every rank on one host: one copy into a node-shared window, a barrier, one copy out.
  // Falls back to kDirect when the ranks span hosts.
  kShared = 4,
};

SHARDGATHER_API std::string_view strategy_name(Strategy strategy) noexcept;
// InvalidArgument for an unknown name. Accepts "auto", "direct", "packed", "per_tensor",
// "shared".
SHARDGATHER_API Strategy parse_strategy(std::string_view name);

struct PlanOptions {
  // Deadline of each execution; unset: the communicator's timeout().
  std::optional<std::chrono::milliseconds> timeout;
  // Exchange the fixed-size pre-flight header on each execution (a check, never metadata).
  bool preflight = true;
  Strategy strategy = Strategy::kAuto;
  // Threads for copy-in and copy-out; 0: this host's cores divided by the ranks on it.
  int copy_threads = 0;
};

struct ExecStats {
  std::uint64_t preflight_collectives = 0;
  std::uint64_t metadata_collectives = 0;  // always 0 for an execution
  std::uint64_t payload_collectives = 0;
  // One-time setup on a first execution (kShared: creating the node-shared window).
  std::uint64_t setup_collectives = 0;
  std::uint64_t staged_bytes = 0;       // bytes copied into staging before sending
  Strategy strategy = Strategy::kAuto;  // the one that ran
};

namespace detail {
struct ExecScratch;
// Owns an execution's scratch space. Copies get their own, empty scratch: a plan copied to
// another thread never shares mutable state with the original.
class SHARDGATHER_API ScratchHolder {
 public:
  ScratchHolder();
  ~ScratchHolder();
  ScratchHolder(const ScratchHolder& other);
  ScratchHolder& operator=(const ScratchHolder& other);
  ScratchHolder(ScratchHolder&& other) noexcept;
  ScratchHolder& operator=(ScratchHolder&& other) noexcept;
  // Created on first use (also after a move left this holder empty).
  [[nodiscard]] ExecScratch& get();
  // After a communication failure: gives the scratch up without freeing it, since a posted
  // collective may still read or write it; the next execution starts with fresh scratch.
  void leak() noexcept;

 private:
  std::unique_ptr<ExecScratch> scratch_;
};
}  // namespace detail

class SHARDGATHER_API AllGatherPlan {
 public:
  AllGatherPlan() = default;
  // Pure: from the dtypes (one per tensor index) and every rank's shapes ([r][i]).
  AllGatherPlan(std::span<const DType> dtypes,
                std::span<const std::vector<Shape>> shapes_across_group, int rank,
                const PlanOptions& options = {});

  // From this rank's tensors: with a hint, no communication (this rank's row is checked);
  // without, one pre-flight header and one exchange of the shape records (both collective:
  // every rank calls create). Errors are raised on every rank, as for foreach_all_gather.
  static AllGatherPlan create(std::span<const TensorView> params, Communicator& comm,
                              std::span<const std::vector<Shape>> shapes_across_group = {},
                              const PlanOptions& options = {});

  [[nodiscard]] const LayoutPlan& layout() const noexcept { return layout_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] std::uint64_t output_bytes() const noexcept { return layout_.total_bytes; }
  [[nodiscard]] const PlanOptions& options() const noexcept { return options_; }

  // Views of the gathered tensors over a buffer laid out by this plan: element i * world + r is
  // rank r's tensor i.
  // The views are writable only if `buffer` is (execute_shared's memory is read-only).
  [[nodiscard]] std::vector<TensorView> views(const std::byte* buffer) const;

  // Gathers `params` (this rank's tensors, matching the plan) into `out` (output_bytes() bytes,
  // caller-owned, must not overlap an input except as this rank's exact slot). Blocking.
  ExecStats execute(std::span<const TensorView> params, Communicator& comm,
                    std::span<std::byte> out);

  // Gathers into plan-owned memory and returns it (output_bytes(), laid out as for execute()).
  // When every rank is on this host the memory is a node-shared window: each rank copies its
  // tensors in once and reads everyone's in place, so nothing is copied out (the seed's output
  // form: views into the gathered buffer). The bytes stay valid until the next execute_shared
  // of this plan on any rank; read them, do not write them. Elsewhere it is execute() into a
  // plan-owned buffer.
  std::span<const std::byte> execute_shared(std::span<const TensorView> params, Communicator& comm,
                                            ExecStats* stats = nullptr);

 private:
  // Validates, exchanges the header, builds the send stream and the destinations in `out`
  // (none when out is null) into the scratch.
  void prepare(std::span<const TensorView> params, Communicator& comm, std::byte* out,
               std::uint64_t out_size, ExecStats& stats, Deadline deadline);

  LayoutPlan layout_;
  int rank_ = 0;
  PlanOptions options_;
  std::uint64_t fingerprint_ = 0;  // of the layout, compared in the pre-flight header
  std::uint64_t dtype_hash_ = 0;
  detail::ScratchHolder scratch_;
};

}  // namespace shardgather
