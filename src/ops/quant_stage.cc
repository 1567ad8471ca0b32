#include "ops/quant_stage.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>

#include "copies/box_runs.h"
#include "copies/device_runtime.h"
#include "copies/local_input.h"

#include "shardgather/copy.h"
#include "shardgather/errors.h"
#include "shardgather/layout.h"

namespace shardgather::detail {

namespace {

constexpr std::uint64_t kAlign = 64;

std::uint64_t aligned(std::uint64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

std::string name(std::size_t i) { return "quantize[" + std::to_string(i) + "]"; }

// The block's extent along each dim of a tensor of `ndim` dims.
Shape block_extents(QuantFormat format, std::size_t ndim) {
  Shape extent(ndim, 1);
  if (ndim == 0) {
    return extent;
  }
  extent.back() = format == QuantFormat::kMxfp8 ? 32 : 128;
  if (format == QuantFormat::kFp8Block128) {
    extent.front() = 128;
  }
  return extent;
}

DType scale_dtype(QuantFormat format) {
  return format == QuantFormat::kMxfp8 ? DType::kUInt8 : DType::kFloat32;
}

// The scales of every block `box` touches, as a box of the scale tensor (the scale shape keeps
// the tensor's dims for the row formats, and is [rows, cols] of blocks for 128 x 128).
Box scale_box(QuantFormat format, const Box& box) {
  const Shape extent = block_extents(format, box.size.size());
  Box out;
  for (std::size_t d = 0; d < box.size.size(); ++d) {
    const std::int64_t lo = box.offset[d] / extent[d];
    out.offset.push_back(lo);
    out.size.push_back(box.size[d] == 0 ? 0
                                        : ceil_div(box.offset[d] + box.size[d], extent[d]) - lo);
  }
  return out;
}

// (window shape, the box's offset inside it): the box widened to block edges.
std::pair<Shape, Shape> window_of(QuantFormat format, const Shape& shape, const Box& box) {
  const Shape extent = block_extents(format, shape.size());
  Shape window, inside;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    const std::int64_t lo = box.offset[d] / extent[d] * extent[d];
    const std::int64_t hi =
        box.size[d] == 0
            ? lo
            : std::min(ceil_div(box.offset[d] + box.size[d], extent[d]) * extent[d], shape[d]);
    window.push_back(hi - lo);
    inside.push_back(box.offset[d] - lo);
  }
  return {window, inside};
}

bool empty(const Shape& shape) {
  return std::any_of(shape.begin(), shape.end(), [](std::int64_t n) { return n == 0; });
}

std::int64_t numel(const Shape& shape) {
  std::int64_t n = 1;
  for (const std::int64_t s : shape) {
    n *= s;
  }
  return n;
}

// Where the held pieces of a tensor lie along the one dim they split: (dim, sizes, offsets) per
// rank. InvalidArgument unless they split one dim into disjoint pieces covering it.
std::tuple<int, std::vector<std::int64_t>, std::vector<std::int64_t>> split_of(
    std::size_t i, const TensorRegions& t, int world) {
  std::vector<const RankBox*> held(static_cast<std::size_t>(world), nullptr);
  std::vector<int> split;
  for (const RankBox& b : t.sources) {
    if (empty(b.box.size)) {
      continue;
    }
    auto& slot = held[static_cast<std::size_t>(b.rank)];
    if (slot != nullptr) {
      throw InvalidArgument(name(i) + ": rank " + std::to_string(b.rank) +
                            " holds two source boxes (a quantized reshard needs one per rank)");
    }
    slot = &b;
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      if (b.box.size[d] != t.shape[d] &&
          std::find(split.begin(), split.end(), static_cast<int>(d)) == split.end()) {
        split.push_back(static_cast<int>(d));
      }
    }
  }
  const int dim = split.empty() ? 0 : *std::min_element(split.begin(), split.end());
  std::vector<std::tuple<std::int64_t, std::int64_t, int>> pieces;  // (offset, size, rank)
  std::string listed;
  for (int r = 0; r < world; ++r) {
    if (const RankBox* b = held[static_cast<std::size_t>(r)]) {
      const auto d = static_cast<std::size_t>(dim);
      pieces.emplace_back(b->box.offset[d], b->box.size[d], r);
      listed += (listed.empty() ? "" : ", ") + std::string("(") + std::to_string(r) + ", " +
                shape_str(b->box.offset) + ", " + shape_str(b->box.size) + ")";
    }
  }
  std::sort(pieces.begin(), pieces.end());
  std::int64_t at = 0;
  for (const auto& [offset, size, r] : pieces) {
    at = at == offset && at >= 0 ? at + size : -1;
  }
  const bool replicas = split.empty() && pieces.size() > 1;
  if (split.size() > 1 || replicas || at != t.shape[static_cast<std::size_t>(dim)]) {
    throw InvalidArgument(name(i) +
                          ": the sources must split one dim into disjoint pieces that cover it "
                          "(as FSDP's rows or a column or row split do), got [" +
                          listed + "]");
  }
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(world), 0);
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(world), 0);
  for (const auto& [offset, size, r] : pieces) {
    sizes[static_cast<std::size_t>(r)] = size;
    offsets[static_cast<std::size_t>(r)] = offset;
  }
  return {dim, sizes, offsets};
}

}  // namespace

QuantStage::QuantStage(std::span<const TensorRegions> tensors, std::span<const QuantFormat> formats,
                       int world, int rank)
    : tensors_(tensors.begin(), tensors.end()), world_(world) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw InvalidArgument("plan_regions: rank " + std::to_string(rank) + " of " +
                          std::to_string(world));
  }
  check_regions(tensors, world);
  if (formats.size() > tensors.size()) {
    throw InvalidArgument("quantize: " + std::to_string(formats.size()) + " formats for " +
                          std::to_string(tensors.size()) + " tensors");
  }
  formats_.assign(formats.begin(), formats.end());
  formats_.resize(tensors.size(), QuantFormat::kNone);
  quant_of_.assign(tensors.size(), SIZE_MAX);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    for (std::size_t j = 0; j < tensors[i].sources.size(); ++j) {
      if (tensors[i].sources[j].rank == rank) {
        source_views_.push_back({i, j});
      }
    }
    for (std::size_t k = 0; k < tensors[i].destinations.size(); ++k) {
      if (tensors[i].destinations[k].rank == rank) {
        destination_views_.push_back({i, k});
      }
    }
    if (formats_[i] == QuantFormat::kNone) {
      payload_.push_back(tensors[i]);
      continue;
    }
    quant_of_[i] = quant_.size();
    quant_.push_back(plan_tensor(i, formats_[i], world, rank));
    add_payload(quant_.back(), world);
  }
  index_views();
  plan_destinations();
}

// Per tensor its first view of each side; each quantized tensor's non-empty source view.
void QuantStage::index_views() {
  source_first_.assign(tensors_.size() + 1, 0);
  destination_first_.assign(tensors_.size() + 1, 0);
  for (const ViewRef& ref : source_views_) {
    ++source_first_[ref.tensor + 1];
  }
  for (const ViewRef& ref : destination_views_) {
    ++destination_first_[ref.tensor + 1];
  }
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    source_first_[i + 1] += source_first_[i];
    destination_first_[i + 1] += destination_first_[i];
  }
  for (std::size_t v = 0; v < source_views_.size(); ++v) {
    const std::size_t q = quant_of_[source_views_[v].tensor];
    const RankBox& held = tensors_[source_views_[v].tensor].sources[source_views_[v].entry];
    if (q != SIZE_MAX && !empty(held.box.size)) {
      quant_[q].source_view = v;
    }
  }
}

// Each destination of a quantized tensor: its window (its box widened to block edges), its
// scale box and the window's grid.
void QuantStage::plan_destinations() {
  destinations_.resize(destination_views_.size());
  for (std::size_t v = 0; v < destination_views_.size(); ++v) {
    const ViewRef& ref = destination_views_[v];
    Destination& d = destinations_[v];
    d.tensor = quant_of_[ref.tensor];
    if (d.tensor == SIZE_MAX) {
      continue;
    }
    const Box& box = tensors_[ref.tensor].destinations[ref.entry].box;
    std::tie(d.window, d.inside) = window_of(formats_[ref.tensor], tensors_[ref.tensor].shape, box);
    d.scale_size = scale_box(formats_[ref.tensor], box).size;
    if (!empty(box.size)) {
      d.grid = quant_grid(formats_[ref.tensor], d.window, DType::kFloat32, name(ref.tensor));
    }
  }
}

QuantStage::Tensor QuantStage::plan_tensor(std::size_t i, QuantFormat format, int world, int rank) {
  const TensorRegions& regions = tensors_[i];
  const QuantGrid global = quant_grid(format, regions.shape, regions.dtype, name(i));
  Tensor t;
  t.index = i;
  t.format = format;
  std::tie(t.dim, t.sizes, t.offsets) = split_of(i, regions, world);
  const auto dim = static_cast<std::size_t>(t.dim);
  t.block = block_extents(format, regions.shape.size())[dim];
  // The scale shape has the tensor's dims (row formats) or [rows, cols] of blocks (128 x 128,
  // 2-d): either way its dim `dim` is the slabs along the split.
  const Shape scales = global.scale_shape();
  for (std::size_t d = 0; d < scales.size(); ++d) {
    if (d < dim) {
      t.outer *= scales[d];
    } else if (d > dim) {
      t.inner *= scales[d];
    }
  }
  t.slot = t.outer * t.inner;
  const auto me = static_cast<std::size_t>(rank);
  const std::int64_t lo = t.offsets[me];
  const std::int64_t n = t.sizes[me];
  t.owned = ceil_div(lo + n, t.block) - ceil_div(lo, t.block);
  if (n != 0) {
    Box rows{Shape(regions.shape.size(), 0), regions.shape};
    rows.offset[dim] = lo;
    rows.size[dim] = n;
    std::tie(t.window, t.inside) = window_of(format, regions.shape, rows);
    t.grid = quant_grid(format, t.window, regions.dtype, name(i));
    const Shape window_scales = t.grid.scale_shape();
    t.slabs = window_scales[dim];
    // The scales this rank sends: the last `owned` slabs of its window's, a view over them.
    resolve_strides(window_scales, {}, t.owned_strides);
    t.owned_shape = window_scales;
    t.owned_shape[dim] = t.owned;
    t.data_at = fixed_bytes_;
    fixed_bytes_ += aligned(static_cast<std::uint64_t>(numel(rows.size)));
    t.scales_at = fixed_bytes_;
    fixed_bytes_ += aligned(static_cast<std::uint64_t>(t.grid.num_blocks()) * t.grid.scale_size());
    t.amax_at = amax_floats_;
    amax_floats_ += static_cast<std::uint64_t>(t.grid.num_blocks());
  }
  find_cuts(t, world, rank);
  return t;
}

// The slabs rank r shares with other ranks (its first and last, where a cut falls inside
// them), the ranks it shares each with, and the tensor's columns in a row of maxima (two slots
// per tensor where any rank has a cut).
void QuantStage::find_cuts(Tensor& t, int world, int rank) {
  const std::int64_t extent = tensors_[t.index].shape[static_cast<std::size_t>(t.dim)];
  const auto slab_end = [&](std::int64_t k) { return std::min((k + 1) * t.block, extent); };
  const auto first = [&](int r) { return t.offsets[static_cast<std::size_t>(r)] / t.block; };
  const auto last = [&](int r) {
    const auto q = static_cast<std::size_t>(r);
    return (t.offsets[q] + t.sizes[q] - 1) / t.block;
  };
  const auto cut_slabs = [&](int r) {
    std::vector<std::pair<int, std::int64_t>> out;  // (slot, slab)
    const auto q = static_cast<std::size_t>(r);
    if (t.sizes[q] == 0 || t.block == 1) {
      return out;
    }
    const std::int64_t lo = t.offsets[q];
    const std::int64_t hi = lo + t.sizes[q];
    if (lo > first(r) * t.block || hi < slab_end(first(r))) {
      out.emplace_back(0, first(r));
    }
    if (last(r) != first(r) && hi < slab_end(last(r))) {
      out.emplace_back(1, last(r));
    }
    return out;
  };
  bool any = false;
  for (int r = 0; r < world && !any; ++r) {
    any = !cut_slabs(r).empty();
  }
  if (!any) {
    return;
  }
  t.column = row_floats_;
  row_floats_ += static_cast<std::size_t>(2 * t.slot);
  for (const auto& [slot, k] : cut_slabs(rank)) {
    Cut cut{.slot = slot, .sharers = {}};
    for (int q = 0; q < world; ++q) {
      const auto p = static_cast<std::size_t>(q);
      if (q != rank && t.sizes[p] != 0 && t.offsets[p] < slab_end(k) &&
          t.offsets[p] + t.sizes[p] > k * t.block) {
        cut.sharers.emplace_back(q, first(q) == k ? 0 : 1);
      }
    }
    t.cuts.push_back(std::move(cut));
  }
}

// The tensor's data (its boxes as uint8) and scales (each rank's owned slabs; each destination's
// scale box) in the payload.
void QuantStage::add_payload(const Tensor& t, int world) {
  const TensorRegions& regions = tensors_[t.index];
  payload_.push_back({DType::kUInt8, regions.shape, regions.sources, regions.destinations});
  const QuantGrid global = quant_grid(t.format, regions.shape, regions.dtype, name(t.index));
  TensorRegions scales{scale_dtype(t.format), global.scale_shape(), {}, {}};
  const auto dim = static_cast<std::size_t>(t.dim);
  for (int r = 0; r < world; ++r) {
    const auto q = static_cast<std::size_t>(r);
    const std::int64_t lo = t.offsets[q];
    const std::int64_t owned = ceil_div(lo + t.sizes[q], t.block) - ceil_div(lo, t.block);
    if (owned > 0) {
      Box box{Shape(scales.shape.size(), 0), scales.shape};
      box.offset[dim] = ceil_div(lo, t.block);
      box.size[dim] = owned;
      scales.sources.push_back({r, box});
    }
  }
  for (const RankBox& d : regions.destinations) {
    scales.destinations.push_back({d.rank, scale_box(t.format, d.box)});
  }
  payload_.push_back(std::move(scales));
}

std::uint64_t QuantStage::fingerprint(std::uint64_t payload) const noexcept {
  std::uint64_t h = payload;
  for (const QuantFormat f : formats_) {
    h = (h ^ static_cast<std::uint64_t>(f)) * 0x100000001b3ULL;
  }
  return h;
}

std::string QuantStage::stage_text() const {
  const std::uint64_t h = fingerprint(0xcbf29ce484222325ULL);
  std::string hex(8, '0');
  for (std::size_t k = 0; k < 8; ++k) {
    hex[7 - k] = "0123456789abcdef"[(h >> (4 * k)) & 0xfU];
  }
  return "quantize spec " + hex + ": " + std::to_string(quant_.size()) + " of " +
         std::to_string(tensors_.size()) + " tensors";
}

void QuantStage::check_source(std::size_t v, const TensorView& view, const Device& device) const {
  const ViewRef& ref = source_views_[v];
  const TensorRegions& t = tensors_[ref.tensor];
  (void)check_reshard_view(view, "source", v, t.dtype, ref.tensor, t.sources[ref.entry], device);
}

// A destination of a plain tensor; of a quantized one given as values (float32 or bfloat16)
// or as FP8 data (uint8) with `scales` (the scale box's shape, float32 or E8M0's uint8).
void QuantStage::check_destination(std::size_t v, const TensorView& view, const TensorView* scales,
                                   const Device& device) const {
  const ViewRef& ref = destination_views_[v];
  const TensorRegions& t = tensors_[ref.tensor];
  const RankBox& box = t.destinations[ref.entry];
  const Destination& d = destinations_[v];
  const auto where = [&] {
    return "destination " + std::to_string(v) + " (tensor " + std::to_string(ref.tensor) +
           ", box " + shape_str(box.box.offset) + " + " + shape_str(box.box.size) + "): ";
  };
  DType want = t.dtype;
  if (d.tensor != SIZE_MAX) {
    const bool values = view.dtype == DType::kFloat32 || view.dtype == DType::kBFloat16;
    if (scales == nullptr && !values) {
      throw InvalidArgument(where() + "a (data, scales) pair, or a float32 / bfloat16 " +
                            "tensor to dequantize into, got " +
                            std::string(dtype_name(view.dtype)));
    }
    want = scales == nullptr ? view.dtype : DType::kUInt8;
  }
  (void)check_reshard_view(view, "destination", v, want, ref.tensor, box, device);
  if (scales != nullptr) {
    const DType scale = scale_dtype(formats_[ref.tensor]);
    if (scales->dtype != scale || scales->shape != d.scale_size) {
      throw InvalidArgument(where() + "its scales are " + std::string(dtype_name(scales->dtype)) +
                            " " + shape_str(scales->shape) + ", want " +
                            std::string(dtype_name(scale)) + " " + shape_str(d.scale_size) +
                            " (the blocks the box touches)");
    }
    check_device(*scales, v, device, "destination scales");
    if (scales->data == nullptr && !empty(scales->shape)) {
      throw InvalidArgument(where() + "its scales have a null data pointer");
    }
  }
  for (const TensorView* part : {&view, scales}) {
    if (part != nullptr && !empty(part->shape) && overlaps_itself(*part)) {
      throw InvalidArgument(where() +
                            "its elements share memory (a stride of 0, or strides that map two "
                            "indices to one element): a write would land twice");
    }
  }
}

// A cut slab's maxima (the window's first or last along dim) to and from `slab`, in the order a
// row of maxima carries them.
void QuantStage::gather_slab(const Tensor& t, int slot, std::span<const float> amax,
                             std::span<float> slab) {
  const std::int64_t j = slot == 0 ? 0 : t.slabs - 1;
  for (std::int64_t o = 0; o < t.outer; ++o) {
    for (std::int64_t k = 0; k < t.inner; ++k) {
      slab[static_cast<std::size_t>(o * t.inner + k)] =
          amax[static_cast<std::size_t>((o * t.slabs + j) * t.inner + k)];
    }
  }
}

void QuantStage::scatter_slab(const Tensor& t, int slot, std::span<const float> slab,
                              std::span<float> amax) {
  const std::int64_t j = slot == 0 ? 0 : t.slabs - 1;
  for (std::int64_t o = 0; o < t.outer; ++o) {
    for (std::int64_t k = 0; k < t.inner; ++k) {
      amax[static_cast<std::size_t>((o * t.slabs + j) * t.inner + k)] =
          slab[static_cast<std::size_t>(o * t.inner + k)];
    }
  }
}

std::span<float> QuantStage::amax_of(const Tensor& t, QuantScratch& q) const {
  return {q.amax.data() + t.amax_at, static_cast<std::size_t>(t.grid.num_blocks())};
}

void QuantStage::prepare(std::span<const TensorView> sources,
                         std::span<const TensorView> destinations,
                         std::span<const TensorView> scales, const Device& device, void* stream,
                         QuantScratch& q) const {
  if (sources.size() != source_views_.size() || destinations.size() != destination_views_.size() ||
      (!scales.empty() && scales.size() != destinations.size())) {
    throw InvalidArgument(
        "this rank holds " + std::to_string(source_views_.size()) + " source and " +
        std::to_string(destination_views_.size()) + " destination boxes in the plan, got " +
        std::to_string(sources.size()) + " sources and " + std::to_string(destinations.size()) +
        " destinations" +
        (scales.empty() ? std::string() : " with " + std::to_string(scales.size()) + " scales"));
  }
  for (std::size_t v = 0; v < sources.size(); ++v) {
    check_source(v, sources[v], device);
  }
  for (std::size_t v = 0; v < destinations.size(); ++v) {
    const bool given = gives_scales(scales, v);
    if (given && destinations_[v].tensor == SIZE_MAX) {
      throw InvalidArgument("destination " + std::to_string(v) + " (tensor " +
                            std::to_string(destination_views_[v].tensor) +
                            "): scales for a tensor that moves unquantized");
    }
    check_destination(v, destinations[v], given ? &scales[v] : nullptr, device);
  }
  for (const Tensor& t : quant_) {
    const std::size_t ndim = tensors_[t.index].shape.size();
    if (device.type != DeviceType::kCpu && ndim > static_cast<std::size_t>(kQuantMaxDims)) {
      throw InvalidArgument(name(t.index) + ": a tensor of " + std::to_string(ndim) +
                            " dims; the device quantizer takes at most " +
                            std::to_string(kQuantMaxDims));
    }
  }
  q.device = device;
  q.stream = stream;
  build_views(sources, destinations, scales, q);
  q.amax.assign(amax_floats_, 0.0F);  // no allocation once sized
  q.row.assign(row_bytes(), std::byte{0});
  // Every rank's rows arrive after the header: sized here, where a failed allocation is an
  // error every rank hears of.
  q.table.resize(static_cast<std::size_t>(row_bytes()) * static_cast<std::size_t>(world_));
}

void QuantStage::fold(std::span<const TensorView> sources, QuantScratch& q,
                      const std::function<void()>& wait_for_stream) const {
  if (q.device.type != DeviceType::kCpu) {
    fold_on_device(sources, q, wait_for_stream);
  }
  for (const Tensor& t : quant_) {
    if (t.source_view == SIZE_MAX) {
      continue;
    }
    if (q.device.type == DeviceType::kCpu) {
      fold_amax(t.grid, sources[t.source_view], t.inside, amax_of(t, q));
    }
    auto* row = reinterpret_cast<float*>(q.row.data());
    for (const Cut& cut : t.cuts) {
      const std::size_t at = t.column + static_cast<std::size_t>(cut.slot * t.slot);
      gather_slab(t, cut.slot, amax_of(t, q), {row + at, static_cast<std::size_t>(t.slot)});
    }
  }
}

// The maxima's bits zeroed on the device, folded by one launch per source box, and brought to
// q.amax once the device has run the launches (amaxes are maxima of |x|: their bits as unsigned
// integers order as the values, a NaN above all).
void QuantStage::fold_on_device(std::span<const TensorView> sources, QuantScratch& q,
                                const std::function<void()>& wait_for_stream) const {
  const std::uint64_t bytes = amax_floats_ * sizeof(float);
  if (bytes == 0) {
    return;
  }
  const CurrentDevice on(q.device.index);
  q.device_amax.reserve(bytes, q.device.index, q.stream);
  auto* bits = reinterpret_cast<std::uint32_t*>(q.device_amax.data());
  copy_async(bits, q.amax.data(), bytes, q.stream);  // zeros
  for (const Tensor& t : quant_) {
    if (t.source_view != SIZE_MAX) {
      launch_quant(quant_box_desc(QuantStep::kFoldAmax, t.grid, sources[t.source_view], t.inside,
                                  nullptr, bits + t.amax_at),
                   q.stream);
    }
  }
  // The fold waits behind whatever the caller queued first: that wait is the bounded one. The
  // copy back is then the stream's only work, waited for again before q.amax is read.
  wait_for_stream();
  copy_async(q.amax.data(), bits, bytes, q.stream);
  wait_for_stream();
}

namespace {

// Writes `view` as element n of `list` (assigned where one is there, so that a steady state
// reuses the shapes' memory), then n + 1.
void put(std::vector<TensorView>& list, std::size_t& n, const TensorView& view) {
  if (n < list.size()) {
    list[n] = view;
  } else {
    list.push_back(view);
  }
  ++n;
}

}  // namespace

bool QuantStage::gives_scales(std::span<const TensorView> scales, std::size_t v) noexcept {
  return !scales.empty() && (scales[v].data != nullptr || !scales[v].shape.empty());
}

// Which destinations this rank decodes (those given as values) and where their data and scales
// land in the arena, after the sources' part; the arena grown to hold them.
void QuantStage::place_decoded(std::span<const TensorView> destinations,
                               std::span<const TensorView> scales, QuantScratch& q) const {
  q.decoded.clear();
  q.decoded_at.clear();
  std::uint64_t need = fixed_bytes_;
  for (std::size_t v = 0; v < destinations.size(); ++v) {
    const Destination& d = destinations_[v];
    if (d.tensor == SIZE_MAX || gives_scales(scales, v)) {
      continue;
    }
    q.decoded.push_back(v);
    q.decoded_at.push_back(need);
    need += aligned(static_cast<std::uint64_t>(numel(destinations[v].shape))) +
            aligned(static_cast<std::uint64_t>(numel(d.scale_size)) *
                    dtype_size(scale_dtype(quant_[d.tensor].format)));
  }
  if (q.device.type != DeviceType::kCpu) {
    q.device_arena.reserve(need, q.device.index, q.stream);
    q.host_scales.resize(fixed_bytes_);
  } else if (q.arena.size() < need) {
    q.arena = AlignedBuffer(need);
  }
}

std::byte* QuantStage::arena(QuantScratch& q) noexcept {
  return q.device.type == DeviceType::kCpu ? q.arena.data() : q.device_arena.data();
}

// The payload's views of this call, in the payload plan's order: per tensor its own views, or
// for a quantized one its data views then its scales views.
void QuantStage::build_views(std::span<const TensorView> sources,
                             std::span<const TensorView> destinations,
                             std::span<const TensorView> scales, QuantScratch& q) const {
  place_decoded(destinations, scales, q);
  std::size_t ns = 0;
  std::size_t nd = 0;
  std::size_t decoded = 0;  // into q.decoded
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (quant_of_[i] == SIZE_MAX) {
      for (std::size_t v = source_first_[i]; v < source_first_[i + 1]; ++v) {
        put(q.sources, ns, sources[v]);
      }
      for (std::size_t v = destination_first_[i]; v < destination_first_[i + 1]; ++v) {
        put(q.destinations, nd, destinations[v]);
      }
      continue;
    }
    const Tensor& t = quant_[quant_of_[i]];
    add_source_views(t, sources, q, ns);
    add_destination_views(t, destinations, scales, q, nd, decoded);
  }
  q.sources.resize(ns);
  q.destinations.resize(nd);
}

// A quantized tensor's source views: its data (this rank's FP8 in the staging; empty boxes
// none), then the scales of the slabs that start in its rows (the last ones of its window's).
void QuantStage::add_source_views(const Tensor& t, std::span<const TensorView> sources,
                                  QuantScratch& q, std::size_t& n) const {
  std::byte* base = arena(q);
  for (std::size_t v = source_first_[t.index]; v < source_first_[t.index + 1]; ++v) {
    put(q.sources, n,
        {v == t.source_view ? base + t.data_at : nullptr,
         DType::kUInt8,
         sources[v].shape,
         {},
         q.device});
  }
  if (t.owned > 0) {
    const DType sdtype = scale_dtype(t.format);
    const std::uint64_t skip =
        static_cast<std::uint64_t>((t.slabs - t.owned) * t.inner) * dtype_size(sdtype);
    put(q.sources, n,
        {base + t.scales_at + skip, sdtype, t.owned_shape, t.owned_strides, q.device});
  }
}

// A quantized tensor's destination views: each one's data (the caller's, as uint8, or the
// arena's where it is decoded here), then each one's scales (the caller's, or the arena's).
void QuantStage::add_destination_views(const Tensor& t, std::span<const TensorView> destinations,
                                       std::span<const TensorView> scales, QuantScratch& q,
                                       std::size_t& n, std::size_t& decoded) const {
  std::byte* base = arena(q);
  const std::size_t first = destination_first_[t.index];
  const std::size_t end = destination_first_[t.index + 1];
  const std::size_t first_decoded = decoded;
  for (std::size_t v = first; v < end; ++v) {
    if (decoded < q.decoded.size() && q.decoded[decoded] == v) {
      put(q.destinations, n,
          {base + q.decoded_at[decoded], DType::kUInt8, destinations[v].shape, {}, q.device});
      ++decoded;
    } else {
      put(q.destinations, n, destinations[v]);
      q.destinations[n - 1].dtype = DType::kUInt8;
    }
  }
  for (std::size_t v = first, k = first_decoded; v < end; ++v) {
    if (k < q.decoded.size() && q.decoded[k] == v) {
      const std::uint64_t at =
          q.decoded_at[k] + aligned(static_cast<std::uint64_t>(numel(destinations[v].shape)));
      put(q.destinations, n,
          {base + at, scale_dtype(t.format), destinations_[v].scale_size, {}, q.device});
      ++k;
    } else {
      put(q.destinations, n, scales[v]);
    }
  }
}

void QuantStage::add_decoded_extents(std::span<const TensorView> destinations,
                                     const QuantScratch& q, std::vector<ViewExtent>& out) const {
  for (const std::size_t v : q.decoded) {
    const TensorView& t = destinations[v];
    const std::uint64_t bytes = checked_nbytes(t.dtype, t.shape);
    if (bytes != 0) {
      out.push_back({extent_of(t, bytes), true, !is_contiguous(t), "destination", v});
    }
  }
}

void QuantStage::encode(std::span<const TensorView> sources, QuantScratch& q) const {
  const auto* table = reinterpret_cast<const float*>(q.table.data());
  for (const Tensor& t : quant_) {
    if (t.source_view == SIZE_MAX) {
      continue;
    }
    const std::span<float> amax = amax_of(t, q);
    q.slab.resize(static_cast<std::size_t>(t.slot));
    for (const Cut& cut : t.cuts) {
      gather_slab(t, cut.slot, amax, q.slab);
      for (const auto& [peer, theirs] : cut.sharers) {
        const float* from = table + static_cast<std::size_t>(peer) * row_floats_ + t.column +
                            static_cast<std::size_t>(theirs * t.slot);
        combine_amax(q.slab, {from, static_cast<std::size_t>(t.slot)});
      }
      scatter_slab(t, cut.slot, q.slab, amax);
    }
    encode_tensor(t, sources[t.source_view], q);
  }
}

// The scales from the combined maxima, then the source box quantized with them: on the host
// into the arena, or uploaded to the device arena and quantized there by one launch.
void QuantStage::encode_tensor(const Tensor& t, const TensorView& source, QuantScratch& q) const {
  const std::size_t bytes = static_cast<std::size_t>(t.grid.num_blocks()) * t.grid.scale_size();
  const bool host = q.device.type == DeviceType::kCpu;
  std::byte* scales = (host ? q.arena.data() : q.host_scales.data()) + t.scales_at;
  encode_scales(t.grid, amax_of(t, q), {scales, bytes});
  if (host) {
    quantize_box(t.grid, source, t.inside, {scales, bytes}, q.arena.data() + t.data_at);
    return;
  }
  const CurrentDevice on(q.device.index);
  std::byte* on_device = q.device_arena.data();
  copy_async(on_device + t.scales_at, scales, bytes, q.stream);
  launch_quant(quant_box_desc(QuantStep::kQuantize, t.grid, source, t.inside, on_device + t.data_at,
                              on_device + t.scales_at),
               q.stream);
}

void QuantStage::decode(std::span<const TensorView> destinations, QuantScratch& q) const {
  for (std::size_t k = 0; k < q.decoded.size(); ++k) {
    const std::size_t v = q.decoded[k];
    const Destination& d = destinations_[v];
    const TensorView& out = destinations[v];
    if (empty(out.shape)) {
      continue;  // no element, and its window no block to read
    }
    std::byte* data = arena(q) + q.decoded_at[k];
    std::byte* scales = data + aligned(static_cast<std::uint64_t>(numel(out.shape)));
    if (q.device.type != DeviceType::kCpu) {
      const CurrentDevice on(q.device.index);
      launch_quant(quant_box_desc(QuantStep::kDequantize, d.grid, out, d.inside, data, scales),
                   q.stream);
      continue;
    }
    const std::size_t bytes = static_cast<std::size_t>(numel(d.scale_size)) * d.grid.scale_size();
    dequantize_box(d.grid, data, d.inside, {scales, bytes}, out);
  }
}

bool plans_quantized(std::string_view plan, std::span<const QuantFormat> quantize,
                     std::size_t count, std::string_view what, Strategy strategy) {
  if (quantize.empty()) {
    return false;
  }
  if (quantize.size() != count) {
    throw InvalidArgument(std::string(plan) + ": " + std::to_string(quantize.size()) +
                          " quantize formats for " + std::to_string(count) + " " +
                          std::string(what));
  }
  if (std::all_of(quantize.begin(), quantize.end(),
                  [](QuantFormat f) { return f == QuantFormat::kNone; })) {
    return false;
  }
  if (strategy != Strategy::kAuto && strategy != Strategy::kDirect) {
    throw InvalidArgument(std::string(plan) +
                          ": a quantized plan moves as one personal exchange (auto or direct), "
                          "not " +
                          std::string(strategy_name(strategy)));
  }
  return true;
}

}  // namespace shardgather::detail
