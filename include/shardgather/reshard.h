// reshard: every destination rank receives exactly the bytes of its own boxes, straight from the
// source ranks that hold them, in one personal exchange per execution.
//
//   ReshardPlan plan(layout, comm.size(), comm.rank());   // once, pure (regions.h's planner)
//   for (step...) plan.execute(my_sources, comm, my_destinations);
//
// Source and destination ranks are any subsets of one communicator: disjoint (a trainer's ranks
// send, an engine's receive), overlapping or the same (a re-layout inside one group). Every rank
// of the communicator calls execute, also one with nothing to send or receive. A rank passes
// its views in the layout's order (tensor by tensor, that tensor's entries of this rank in their
// order): a source view has its box's shape and is only read; a destination view has its box's
// shape and is written in place, and may be a strided view into a larger tensor (a fused
// parameter's rows or columns), where its elements land directly.
//
// Steady state: no allocation and no metadata collective per execution after the first (the
// header is a check carrying the plan's fingerprint: ranks holding different plans raise
// Mismatch on every rank before a byte moves).
//
// Device (CUDA) views: every view of a call on one device, on a transport that moves device
// memory (torch groups: NCCL or Gloo; threads in a CUDA build; MPI refuses on every rank). Each
// exchange is packed by the fused copy kernel into a contiguous buffer, moved by one
// all_to_all_v_device per part (RegionOptions::device_bucket_bytes bounds a part's staging) and
// unpacked into the destination views; all of it stream-ordered on the caller's current stream
// (torch's), the call returning once enqueued (docs/gpu.md, "Streams").
//
// Threading, lifetime: as AllGatherPlan (plan.h): one thread executes a plan at a time; a
// started execution's views stay alive and unmodified until its Work completed.
//
// A failed execution (a peer killed, a deadline) leaves each destination view partly written:
// some of its bytes new, the others as they were; nothing outside the views is written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "shardgather/communicator.h"
#include "shardgather/device.h"
#include "shardgather/export.h"
#include "shardgather/plan_options.h"
#include "shardgather/quantize.h"
#include "shardgather/regions.h"
#include "shardgather/stats.h"
#include "shardgather/types.h"
#include "shardgather/work.h"

namespace shardgather {

namespace detail {
class QuantStage;
struct PlanAccess;
}  // namespace detail

class SHARDGATHER_API ReshardPlan {
 public:
  ReshardPlan() = default;
  // Pure: plans every tensor (plan_regions; InvalidArgument for a bad layout or an element no
  // source holds). options.strategy: kAuto or kDirect (the personal exchange runs direct);
  // options.dst must be -1.
  //
  // `quantize[i]` (missing entries: kNone): FP8 on the wire for tensor i, quantized on send and
  // bit-identical to quantizing the whole tensor (docs/quantization.md). Its sources must split
  // one dim into disjoint pieces, one per rank; its destinations receive either the FP8 data
  // (uint8 views of their boxes) with the scales of every block the box touches (the scales
  // view of execute), or the dequantized values (float32 or bfloat16 views). Every execution is
  // still one call: its header, one all-gather of the maxima of blocks that ranks' pieces cut
  // (none where no block is cut), the payload; the planner runs here, never per execution.
  // Host or CUDA tensors: on a device the quantizer's steps are kernels on the caller's stream
  // (element for element the host's arithmetic), and the host waits once per execution for its
  // box's block maxima, from which it encodes the scales.
  ReshardPlan(std::span<const TensorRegions> tensors, int world_size, int rank,
              const PlanOptions& options = {}, const RegionOptions& regions = {},
              std::span<const QuantFormat> quantize = {});
  // The same, with the communicator's size, rank and hosts (each destination byte then prefers a
  // source on its own host; regions.hosts is replaced by them). Pure: nothing is exchanged.
  static ReshardPlan for_communicator(std::span<const TensorRegions> tensors,
                                      const Communicator& comm, const PlanOptions& options = {},
                                      RegionOptions regions = {},
                                      std::span<const QuantFormat> quantize = {});

  // The exchange's plan: for a quantized plan, that of its payload (per quantized tensor its
  // data, then its scales, as tensors of their own).
  [[nodiscard]] const RegionPlan& regions() const noexcept { return regions_; }
  // The caller's tensors, as the plan was made with them.
  [[nodiscard]] std::size_t tensors() const noexcept;
  [[nodiscard]] const TensorRegions& tensor(std::size_t i) const;
  [[nodiscard]] int world_size() const noexcept { return regions_.world_size; }
  [[nodiscard]] int rank() const noexcept { return regions_.rank; }
  [[nodiscard]] std::uint64_t fingerprint() const noexcept { return fingerprint_; }
  [[nodiscard]] bool quantized() const noexcept { return quant_ != nullptr; }
  // Bytes of each rank's row of cut blocks' maxima, all-gathered by every quantized execution
  // (0: none travels).
  [[nodiscard]] std::uint64_t amax_row_bytes() const noexcept;
  // This rank's views, in the order execute takes them: their tensor (and entry), dtype and box.
  [[nodiscard]] std::size_t source_count() const noexcept;
  [[nodiscard]] std::size_t destination_count() const noexcept;
  [[nodiscard]] ViewRef source_ref(std::size_t v) const;
  [[nodiscard]] ViewRef destination_ref(std::size_t v) const;
  [[nodiscard]] const RankBox& source(std::size_t v) const;
  [[nodiscard]] const RankBox& destination(std::size_t v) const;
  // The payload's (a quantized plan's row of maxima not counted).
  [[nodiscard]] std::uint64_t bytes_sent() const noexcept;      // by this rank, to other ranks
  [[nodiscard]] std::uint64_t bytes_received() const noexcept;  // by this rank, from others

  // Moves this rank's sources into every destination. `sources` and `destinations` are this
  // rank's views (source_count() and destination_count() of them, each of its box's shape and
  // its tensor's dtype, any strides; destinations must not overlap each other or a source, which
  // is checked where one of the two is contiguous). `device`: where this call's views are, every
  // one of them; unset, the first view's (the host for a rank with no views, which in a device
  // reshard must pass it: every rank of a call moves the same kind of memory). Blocking.
  //
  // A quantized plan's `scales`: empty (every quantized destination receives values), or one
  // per destination: a default TensorView (values), or for a quantized tensor's destination
  // given as FP8 data (a uint8 view) the view its scales land in (float32, or uint8 E8M0 for
  // mxfp8, of the scale box's shape).
  ExecStats execute(std::span<const TensorView> sources, Communicator& comm,
                    std::span<const TensorView> destinations,
                    std::optional<Device> device = std::nullopt);
  ExecStats execute(std::span<const TensorView> sources, Communicator& comm,
                    std::span<const TensorView> destinations, std::span<const TensorView> scales,
                    std::optional<Device> device = std::nullopt);
  // execute(), started (work.h): the lists are copied; the memory stays alive until it completed.
  Work<ExecStats> start(std::span<const TensorView> sources, Communicator& comm,
                        std::span<const TensorView> destinations,
                        std::optional<Device> device = std::nullopt);
  Work<ExecStats> start(std::span<const TensorView> sources, Communicator& comm,
                        std::span<const TensorView> destinations,
                        std::span<const TensorView> scales,
                        std::optional<Device> device = std::nullopt);

 private:
  friend struct detail::PlanAccess;  // a quantized UnshardPlan's execution on a running job
  ExecStats execute_now(std::span<const TensorView> sources, Communicator& comm,
                        std::span<const TensorView> destinations,
                        std::span<const TensorView> scales, std::optional<Device> device);
  // The views the exchange moves: the caller's, or a quantized plan's payload views.
  void check_call(detail::Call& call, std::span<const TensorView> sources,
                  std::span<const TensorView> destinations, std::span<const TensorView> scales,
                  std::optional<Device> device, ExecStats& stats);
  [[nodiscard]] std::span<const TensorView> moved_sources(std::span<const TensorView> sources);
  [[nodiscard]] std::span<const TensorView> moved_destinations(
      std::span<const TensorView> destinations);
  void encode_stage(detail::Call& call, std::span<const TensorView> sources);
  void check_views(const Communicator& comm, std::span<const TensorView> sources,
                   std::span<const TensorView> destinations, std::optional<Device> device,
                   ExecStats& stats);
  void build_job(std::span<const TensorView> sources, std::span<const TensorView> destinations,
                 detail::Stager& stager);
  template <typename Emit>
  void walk(const Transfer& tr, const RankBox& held, const TensorView& view, bool packed,
            Emit&& emit);
  void bind_round(std::size_t e, std::span<const TensorView> sources,
                  std::span<const TensorView> destinations);
  void append_sends(std::span<const Transfer> sends, std::span<const std::size_t> first,
                    std::size_t g, std::span<const TensorView> views, bool forward);
  void append_receives(std::span<const Transfer> receives, std::span<const std::size_t> first,
                       std::size_t g, std::span<const TensorView> destinations);
  void size_device_rooms();
  void run_round(std::size_t e, detail::Call& call, std::span<const TensorView> sources,
                 std::span<const TensorView> destinations, void* stream, ExecStats& stats);

  // The quantize stage, or null (shared: a copied plan shares this const part).
  std::shared_ptr<const detail::QuantStage> quant_;
  std::vector<TensorRegions> tensors_;  // what the exchange moves (a quantized plan's payload)
  RegionPlan regions_;
  std::uint64_t fingerprint_ = 0;
  PlanOptions options_;
  std::vector<DType> dtypes_;  // per tensor, for the header
  std::uint64_t dtype_hash_ = 0;
  // The device path's send and receive buffers: the largest part of any exchange, this rank's.
  std::uint64_t device_send_room_ = 0;
  std::uint64_t device_recv_room_ = 0;
  detail::ScratchHolder scratch_;
};

}  // namespace shardgather
