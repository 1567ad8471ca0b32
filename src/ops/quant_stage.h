// The quantize stage of a reshard's one call: FP8 on the wire (docs/quantization.md), as steps of
// the plan execution rather than calls of their own.
//
//   built once with the plan: each quantized tensor's split, block arithmetic and the payload
//     tensors (its FP8 data, uint8 of the tensor's boxes; its scales, the scale tensor's boxes
//     of every block a destination box touches), which the plan's region planner plans once;
//   prepare (in the call's checks): the caller's views checked, this call's payload views
//     built over the staging (the arena: host memory, or device memory for device tensors);
//   fold (in the call's checks, after the device checks): the block maxima of this rank's
//     source box folded (on a device, by a kernel, then copied to the host once the host has
//     waited for it) and its row of the cut blocks' maxima written;
//   the header exchange, then one all-gather of those rows (the combine = max job; none where
//     no block is cut across ranks);
//   encode (after the rows arrived): the maxima combined, the scales encoded (on the host: a
//     few bytes per block, uploaded to a device arena), the source box quantized into the
//     arena: what the payload sends;
//   the payload: the plan's personal exchange over the payload views;
//   decode: the destinations given as values receive the dequantized box.
//
// On a device every step over elements is a launch of the quantizer kernel (copies/quant_desc.h,
// element for element the host quantizer's arithmetic) on the caller's stream. The host waits
// once per execution where this rank holds a quantized source box: its maxima come to the host,
// where the scales are encoded (a few bytes per block), polled against the call's deadline.
//
// A quantized tensor's sources split one dim into disjoint pieces, one per rank (FSDP's rows, a
// column or row split), so that each block's maximum is a max over at most the few ranks whose
// pieces cut it. Host or CUDA tensors: every view of a call on one device.
//
// Threading: const after construction; an execution's state is the plan's scratch
// (QuantScratch), used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "copies/device_runtime.h"
#include "copies/local_input.h"

#include "shardgather/buffer.h"
#include "shardgather/quantize.h"
#include "shardgather/regions.h"
#include "shardgather/strategy.h"
#include "shardgather/types.h"

namespace shardgather::detail {

// One execution's quantize state, kept by the plan's scratch (a steady state allocates nothing).
struct QuantScratch {
  // The FP8 data of this rank's source boxes, then their windows' encoded scales, then what the
  // destinations decoded here receive (their data and scales).
  AlignedBuffer arena;
  std::vector<float> amax;                        // every source window's block maxima
  std::vector<float> slab;                        // one cut slab's maxima, gathered to combine
  std::vector<std::byte> row;                     // this rank's row of the cut blocks' maxima
  std::vector<std::byte> table;                   // every rank's row
  std::vector<TensorView> sources, destinations;  // this call's payload views
  std::vector<std::size_t> decoded;               // destinations decoded here, by view index
  std::vector<std::uint64_t> decoded_at;          // their data's place in the arena
  // A call on a device: the arena in device memory (the host one unused), the maxima's bits
  // folded there, the scales encoded on the host before their upload, and the caller's stream.
  Device device = kCpu;
  void* stream = nullptr;
  DeviceMemory device_arena;
  DeviceMemory device_amax;
  std::vector<std::byte> host_scales;
};

class QuantStage {
 public:
  // `formats[i]`: tensor i's format, kNone to move it as it is (missing entries: kNone).
  // InvalidArgument naming `quantize[i]` where a format does not apply (quant_grid's rules) or
  // the sources do not split one dim; plain tensors are planned as they are.
  QuantStage(std::span<const TensorRegions> tensors, std::span<const QuantFormat> formats,
             int world, int rank);

  // What the payload moves: per tensor, itself (plain) or its data and scales tensors.
  [[nodiscard]] std::span<const TensorRegions> payload() const noexcept { return payload_; }
  [[nodiscard]] std::span<const TensorRegions> tensors() const noexcept { return tensors_; }
  [[nodiscard]] std::span<const QuantFormat> formats() const noexcept { return formats_; }
  // The caller's views, in the order execute takes them.
  [[nodiscard]] std::span<const ViewRef> source_views() const noexcept { return source_views_; }
  [[nodiscard]] std::span<const ViewRef> destination_views() const noexcept {
    return destination_views_;
  }
  // Bytes of each rank's row of cut blocks' maxima (0: no block is cut, no all-gather).
  [[nodiscard]] std::uint64_t row_bytes() const noexcept { return row_floats_ * sizeof(float); }
  // "quantize spec <hash of the formats>: <n> of <m> tensors": a quantized plan's stage.
  [[nodiscard]] std::string stage_text() const;
  // The plan's fingerprint with the formats in it.
  [[nodiscard]] std::uint64_t fingerprint(std::uint64_t payload) const noexcept;

  // In the call's checks. `scales`: empty, or one per destination (a view whose data is null
  // and shape empty: that destination receives values). `device`: every view's; a device's
  // arena is reserved on `stream`. Throws InvalidArgument naming the view.
  void prepare(std::span<const TensorView> sources, std::span<const TensorView> destinations,
               std::span<const TensorView> scales, const Device& device, void* stream,
               QuantScratch& q) const;
  // After prepare and the device checks. On a device `wait_for_stream` is called once, after
  // the fold's launches, to wait until the device has run them.
  void fold(std::span<const TensorView> sources, QuantScratch& q,
            const std::function<void()>& wait_for_stream) const;
  // After every rank's row arrived in q.table.
  void encode(std::span<const TensorView> sources, QuantScratch& q) const;
  // After the payload landed.
  void decode(std::span<const TensorView> destinations, QuantScratch& q) const;
  // After prepare: the extents of the destinations decoded here (the caller's views, which the
  // payload's views do not show), for the check that no written view overlaps another.
  void add_decoded_extents(std::span<const TensorView> destinations, const QuantScratch& q,
                           std::vector<ViewExtent>& out) const;

 private:
  struct Cut {
    int slot = 0;                              // 0: this rank's first slab, 1: its last
    std::vector<std::pair<int, int>> sharers;  // (rank, that rank's slot) meeting the slab
  };
  // One quantized tensor's arithmetic: the same on every rank, but for the `mine` part.
  struct Tensor {
    std::size_t index = 0;
    QuantFormat format = QuantFormat::kNone;
    int dim = 0;
    std::int64_t block = 1;                    // the block's extent along dim
    std::vector<std::int64_t> sizes, offsets;  // each rank's rows along dim
    std::size_t column = 0;                    // its slots in a row of maxima
    std::int64_t slot = 0;                     // maxima in one slab (the blocks at one index)
    // This rank: its source view (or none), its window (its rows widened to block edges).
    std::size_t source_view = SIZE_MAX;
    Shape window, inside;
    QuantGrid grid;                                // the window's
    std::int64_t outer = 1, slabs = 0, inner = 1;  // the window's scale grid around dim
    std::int64_t owned = 0;                        // slabs whose first row is this rank's
    Shape owned_shape, owned_strides;  // the view of those slabs' scales in the window's
    std::uint64_t data_at = 0, scales_at = 0, amax_at = 0;
    std::vector<Cut> cuts;
  };
  // A destination box of a quantized tensor: the window its scales cover.
  struct Destination {
    std::size_t tensor = 0;  // into quant_
    Shape window, inside, scale_size;
    QuantGrid grid;
  };

  Tensor plan_tensor(std::size_t i, QuantFormat format, int world, int rank);
  void index_views();
  void plan_destinations();
  void find_cuts(Tensor& t, int world, int rank);
  static void gather_slab(const Tensor& t, int slot, std::span<const float> amax,
                          std::span<float> slab);
  static void scatter_slab(const Tensor& t, int slot, std::span<const float> slab,
                           std::span<float> amax);
  void add_payload(const Tensor& t, int world);
  void check_source(std::size_t v, const TensorView& view, const Device& device) const;
  void check_destination(std::size_t v, const TensorView& view, const TensorView* scales,
                         const Device& device) const;
  std::span<float> amax_of(const Tensor& t, QuantScratch& q) const;
  static std::byte* arena(QuantScratch& q) noexcept;
  void fold_on_device(std::span<const TensorView> sources, QuantScratch& q,
                      const std::function<void()>& wait_for_stream) const;
  void encode_tensor(const Tensor& t, const TensorView& source, QuantScratch& q) const;
  static bool gives_scales(std::span<const TensorView> scales, std::size_t v) noexcept;
  void place_decoded(std::span<const TensorView> destinations, std::span<const TensorView> scales,
                     QuantScratch& q) const;
  void build_views(std::span<const TensorView> sources, std::span<const TensorView> destinations,
                   std::span<const TensorView> scales, QuantScratch& q) const;
  void add_source_views(const Tensor& t, std::span<const TensorView> sources, QuantScratch& q,
                        std::size_t& n) const;
  void add_destination_views(const Tensor& t, std::span<const TensorView> destinations,
                             std::span<const TensorView> scales, QuantScratch& q, std::size_t& n,
                             std::size_t& decoded) const;

  std::vector<TensorRegions> tensors_;
  int world_ = 1;
  std::vector<QuantFormat> formats_;
  std::vector<TensorRegions> payload_;
  std::vector<ViewRef> source_views_, destination_views_;
  // Per tensor: its first source and destination view (tensors + 1 entries).
  std::vector<std::size_t> source_first_, destination_first_;
  std::vector<std::size_t> quant_of_;  // per tensor: its index in quant_, or SIZE_MAX
  std::vector<Tensor> quant_;
  std::vector<Destination> destinations_;  // per destination view (tensor SIZE_MAX: plain)
  std::size_t row_floats_ = 0;
  std::uint64_t fixed_bytes_ = 0;  // the arena's data and scales of the sources
  std::uint64_t amax_floats_ = 0;
};

// Whether a plan given one format per tensor (`quantize`; empty: none) quantizes anything: where
// every format is none it is a plain plan. Throws InvalidArgument, named by `plan`, where there
// are not `count` formats (`what` names the tensors), or where a quantized plan's strategy is
// neither auto nor direct (it moves as one personal exchange). AllGatherPlan's and UnshardPlan's.
[[nodiscard]] bool plans_quantized(std::string_view plan, std::span<const QuantFormat> quantize,
                                   std::size_t count, std::string_view what, Strategy strategy);

// A reshard's view against its box and its tensor's dtype; returns its bytes (reshard_plan.cc).
std::uint64_t check_reshard_view(const TensorView& t, const char* side, std::size_t v, DType dtype,
                                 std::size_t i, const RankBox& box, const Device& device);

}  // namespace shardgather::detail
