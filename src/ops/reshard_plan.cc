// ReshardPlan: the region planner's transfers bound to this call's views, moved as one personal
// exchange. To each peer this rank sends the runs of its transfers' boxes from its source views
// (strided views whose innermost dim is not contiguous are staged first); from each peer it
// receives into the runs of the same boxes inside its destination views. Both sides walk the
// transfers of a pair in the planner's canonical order, so the bytes line up without metadata.
#include <algorithm>
#include <string>
#include <vector>

#include "copies/box_runs.h"
#include "copies/local_input.h"
#include "copies/send_stream.h"
#include "ops/call.h"
#include "ops/payload.h"
#include "ops/plan_execution.h"
#include "ops/preflight.h"
#include "ops/quant_stage.h"
#include "ops/start.h"

#include "shardgather/copy.h"
#include "shardgather/errors.h"
#include "shardgather/layout.h"
#include "shardgather/reshard.h"

namespace shardgather {

namespace {

std::string view_name(const char* side, std::size_t v, std::size_t tensor) {
  return std::string(side) + " " + std::to_string(v) + " (tensor " + std::to_string(tensor) + ")";
}

// Whether the view's innermost dim of more than one element is not contiguous: its runs would be
// single elements, so a source is packed first.
bool inner_strided(const TensorView& t) {
  if (t.strides.empty()) {
    return false;
  }
  for (std::size_t d = t.shape.size(); d-- > 0;) {
    if (t.shape[d] > 1) {
      return t.strides[d] != 1;
    }
  }
  return false;
}

std::shared_ptr<const detail::QuantStage> quant_stage(std::span<const TensorRegions> tensors,
                                                      std::span<const QuantFormat> quantize,
                                                      int world, int rank) {
  if (std::all_of(quantize.begin(), quantize.end(),
                  [](QuantFormat f) { return f == QuantFormat::kNone; })) {
    return nullptr;
  }
  return std::make_shared<const detail::QuantStage>(tensors, quantize, world, rank);
}

}  // namespace

namespace detail {

// Checks one view against its box; returns its bytes.
std::uint64_t check_reshard_view(const TensorView& t, const char* side, std::size_t v, DType dtype,
                                 std::size_t i, const RankBox& box, const Device& device) {
  const auto where = [&] { return view_name(side, v, i) + ": "; };
  if (t.dtype != dtype) {
    throw InvalidArgument(where() + "dtype " + std::string(dtype_name(t.dtype)) +
                          ", the plan has " + std::string(dtype_name(dtype)));
  }
  if (t.shape != box.box.size) {
    throw InvalidArgument(where() + "shape " + shape_str(t.shape) + ", its box in the plan is " +
                          shape_str(box.box.size) + " at offset " + shape_str(box.box.offset));
  }
  if (!t.strides.empty() && t.strides.size() != t.shape.size()) {
    throw InvalidArgument(where() + std::to_string(t.strides.size()) + " strides for " +
                          std::to_string(t.shape.size()) + " dims");
  }
  const std::uint64_t bytes = checked_nbytes(t.dtype, t.shape);
  if (t.data == nullptr && bytes != 0) {
    throw InvalidArgument(where() + "null data pointer with " + std::to_string(bytes) + " bytes");
  }
  check_device(t, v, device, side);
  return bytes;
}

}  // namespace detail

ReshardPlan::ReshardPlan(std::span<const TensorRegions> tensors, int world_size, int rank,
                         const PlanOptions& options, const RegionOptions& regions,
                         std::span<const QuantFormat> quantize)
    : quant_(quant_stage(tensors, quantize, world_size, rank)),
      tensors_(quant_ ? quant_->payload().begin() : tensors.begin(),
               quant_ ? quant_->payload().end() : tensors.end()),
      regions_(plan_regions(tensors_, world_size, rank, regions)),
      fingerprint_(quant_ ? quant_->fingerprint(regions_.fingerprint) : regions_.fingerprint),
      options_(options) {
  if (options.strategy != Strategy::kAuto && options.strategy != Strategy::kDirect) {
    throw InvalidArgument("ReshardPlan: strategy is " +
                          std::string(strategy_name(options.strategy)) +
                          "; a reshard moves as one personal exchange (auto or direct)");
  }
  if (options.dst != -1) {
    throw InvalidArgument("ReshardPlan: options.dst is " + std::to_string(options.dst) +
                          "; a reshard's receivers are its destination boxes (leave dst -1)");
  }
  // The header names the caller's tensors (their count and dtypes); the fingerprint covers the
  // payload and the formats, and a quantized plan's stage names its quantize spec, so that a
  // rank whose spec differs raises a mismatch that says so.
  for (const TensorRegions& t : quant_ ? quant_->tensors() : std::span(tensors_)) {
    dtypes_.push_back(t.dtype);
  }
  if (quant_ && options_.stage.empty()) {
    options_.stage = Stage(quant_->stage_text());
  }
  dtype_hash_ = detail::hash_dtypes(dtypes_);
  size_device_rooms();
}

// The device path's buffers hold one part of an exchange: the largest over exchanges, from
// what this rank sends each peer and receives from it in each (its moves and its forwards).
void ReshardPlan::size_device_rooms() {
  const auto world = static_cast<std::size_t>(regions_.world_size);
  const auto me = static_cast<std::size_t>(regions_.rank);
  std::vector<std::uint64_t> sent(world);
  std::vector<std::uint64_t> received(world);
  const auto total = [&](std::span<const Transfer> list, std::span<const std::size_t> first,
                         std::size_t g) {
    std::uint64_t bytes = 0;
    for (std::size_t n = first[g]; n < first[g + 1]; ++n) {
      bytes += list[n].bytes;
    }
    return bytes;
  };
  for (std::size_t e = 0; e < regions_.rounds && world != 0; ++e) {
    for (std::size_t p = 0; p < world; ++p) {
      const std::size_t g = e * world + p;
      sent[p] = p == me ? 0
                        : total(regions_.sends, regions_.send_first, g) +
                              total(regions_.forwards, regions_.forward_first, g);
      received[p] = p == me ? 0
                            : total(regions_.receives, regions_.recv_first, g) +
                                  total(regions_.forwarded, regions_.forwarded_first, g);
    }
    device_send_room_ =
        std::max(device_send_room_, detail::device_part_room(sent, regions_.device_parts));
    device_recv_room_ =
        std::max(device_recv_room_, detail::device_part_room(received, regions_.device_parts));
  }
}

ReshardPlan ReshardPlan::for_communicator(std::span<const TensorRegions> tensors,
                                          const Communicator& comm, const PlanOptions& options,
                                          RegionOptions regions,
                                          std::span<const QuantFormat> quantize) {
  regions.hosts.assign(comm.hosts().begin(), comm.hosts().end());
  return {tensors, comm.size(), comm.rank(), options, regions, quantize};
}

std::size_t ReshardPlan::tensors() const noexcept {
  return quant_ ? quant_->tensors().size() : tensors_.size();
}

const TensorRegions& ReshardPlan::tensor(std::size_t i) const {
  if (quant_) {
    return quant_->tensors()[i < tensors() ? i : throw std::out_of_range("ReshardPlan::tensor")];
  }
  return tensors_.at(i);
}

std::uint64_t ReshardPlan::amax_row_bytes() const noexcept {
  return quant_ ? quant_->row_bytes() : 0;
}

std::size_t ReshardPlan::source_count() const noexcept {
  return quant_ ? quant_->source_views().size() : regions_.source_views.size();
}

std::size_t ReshardPlan::destination_count() const noexcept {
  return quant_ ? quant_->destination_views().size() : regions_.destination_views.size();
}

ViewRef ReshardPlan::source_ref(std::size_t v) const {
  return quant_ ? quant_->source_views()[v < source_count() ? v : throw std::out_of_range("source")]
                : regions_.source_views.at(v);
}

ViewRef ReshardPlan::destination_ref(std::size_t v) const {
  return quant_ ? quant_->destination_views()[v < destination_count()
                                                  ? v
                                                  : throw std::out_of_range("destination")]
                : regions_.destination_views.at(v);
}

const RankBox& ReshardPlan::source(std::size_t v) const {
  const ViewRef ref = source_ref(v);
  return tensor(ref.tensor).sources[ref.entry];
}

const RankBox& ReshardPlan::destination(std::size_t v) const {
  const ViewRef ref = destination_ref(v);
  return tensor(ref.tensor).destinations[ref.entry];
}

std::uint64_t ReshardPlan::bytes_sent() const noexcept {
  const auto me = static_cast<std::size_t>(regions_.rank);
  return regions_.world_size == 0 ? 0 : regions_.rank_sent[me] - regions_.rank_local[me];
}

std::uint64_t ReshardPlan::bytes_received() const noexcept {
  const auto me = static_cast<std::size_t>(regions_.rank);
  return regions_.world_size == 0 ? 0 : regions_.rank_received[me] - regions_.rank_local[me];
}

ExecStats ReshardPlan::execute(std::span<const TensorView> sources, Communicator& comm,
                               std::span<const TensorView> destinations,
                               std::optional<Device> device) {
  return execute(sources, comm, destinations, {}, device);
}

ExecStats ReshardPlan::execute(std::span<const TensorView> sources, Communicator& comm,
                               std::span<const TensorView> destinations,
                               std::span<const TensorView> scales, std::optional<Device> device) {
  return detail::run_blocking(
      comm, [&] { return execute_now(sources, comm, destinations, scales, device); });
}

Work<ExecStats> ReshardPlan::start(std::span<const TensorView> sources, Communicator& comm,
                                   std::span<const TensorView> destinations,
                                   std::optional<Device> device) {
  return start(sources, comm, destinations, {}, device);
}

Work<ExecStats> ReshardPlan::start(std::span<const TensorView> sources, Communicator& comm,
                                   std::span<const TensorView> destinations,
                                   std::span<const TensorView> scales,
                                   std::optional<Device> device) {
  return detail::start_on<ExecStats>(
      comm, [this, &comm, srcs = std::vector<TensorView>(sources.begin(), sources.end()),
             dsts = std::vector<TensorView>(destinations.begin(), destinations.end()),
             scls = std::vector<TensorView>(scales.begin(), scales.end()),
             device] { return execute_now(srcs, comm, dsts, scls, device); });
}

// The call's checks: the caller's views, and for a quantized plan its prepare stage (the
// payload views of this call over its staging, on the views' device), then the payload views.
void ReshardPlan::check_call(detail::Call& call, std::span<const TensorView> sources,
                             std::span<const TensorView> destinations,
                             std::span<const TensorView> scales, std::optional<Device> device,
                             ExecStats& stats) {
  const Communicator& comm = call.comm();
  if (!quant_) {
    const auto given = [](const TensorView& t) { return t.data != nullptr || !t.shape.empty(); };
    if (std::any_of(scales.begin(), scales.end(), given)) {
      throw InvalidArgument("scales: given to a plan that quantizes no tensor (it takes none)");
    }
    check_views(comm, sources, destinations, device, stats);
    return;
  }
  detail::check_plan_world(comm, regions_.world_size, regions_.rank);
  const Device on = device             ? *device
                    : !sources.empty() ? sources.front().device
                                       : detail::call_device(destinations);
  // Before the stage touches device memory: the build and the transport carry device tensors.
  detail::check_call_device(call, on);
  detail::QuantScratch& q = scratch_.get().quant;
  quant_->prepare(sources, destinations, scales, on,
                  on.type == DeviceType::kCpu ? nullptr : current_cuda_stream(), q);
  check_views(comm, q.sources, q.destinations, on, stats);
  // The destinations decoded here are not among the payload's views: checked against them too.
  detail::ExecScratch& x = scratch_.get();
  const std::size_t payload_views = x.view_extents.size();
  quant_->add_decoded_extents(destinations, q, x.view_extents);
  if (x.view_extents.size() != payload_views) {
    detail::check_views_apart(x.view_extents);
  }
}

std::span<const TensorView> ReshardPlan::moved_sources(std::span<const TensorView> sources) {
  return quant_ ? std::span<const TensorView>(scratch_.get().quant.sources) : sources;
}

std::span<const TensorView> ReshardPlan::moved_destinations(
    std::span<const TensorView> destinations) {
  return quant_ ? std::span<const TensorView>(scratch_.get().quant.destinations) : destinations;
}

// After the header: every rank's row of cut blocks' maxima (one all-gather of the call), then
// the sources quantized into the staging the payload sends.
void ReshardPlan::encode_stage(detail::Call& call, std::span<const TensorView> sources) {
  detail::QuantScratch& q = scratch_.get().quant;
  if (quant_->row_bytes() != 0) {  // q.table was sized by the checks
    call.transfer([&] { call.comm().all_gather(q.row, q.table, call.deadline()); });
  }
  quant_->encode(sources, q);
}

void ReshardPlan::check_views(const Communicator& comm, std::span<const TensorView> sources,
                              std::span<const TensorView> destinations,
                              std::optional<Device> device, ExecStats& stats) {
  detail::ExecScratch& x = scratch_.get();
  detail::check_plan_world(comm, regions_.world_size, regions_.rank);
  const std::size_t holds_sources = regions_.source_views.size();
  const std::size_t holds_destinations = regions_.destination_views.size();
  if (sources.size() != holds_sources || destinations.size() != holds_destinations) {
    throw InvalidArgument("rank " + std::to_string(regions_.rank) + " holds " +
                          std::to_string(holds_sources) + " source and " +
                          std::to_string(holds_destinations) +
                          " destination boxes in the plan, got " + std::to_string(sources.size()) +
                          " sources and " + std::to_string(destinations.size()) + " destinations");
  }
  x.device = device             ? *device
             : !sources.empty() ? sources.front().device
                                : detail::call_device(destinations);
  // Device bytes move through all_to_all_v_device (the payload's device checks say where a
  // transport has none); host bytes point to point.
  if (x.device.type == DeviceType::kCpu && comm.size() > 1 && !comm.capabilities().all_to_all) {
    throw InvalidArgument("reshard sends each pair its own bytes, which the " +
                          std::string(comm.backend_name()) +
                          " transport cannot (no point-to-point exchange on this group)");
  }
  std::uint64_t staged = 0;
  x.view_extents.clear();
  for (std::size_t v = 0; v < sources.size(); ++v) {
    const ViewRef& ref = regions_.source_views[v];
    const TensorView& t = sources[v];
    const std::uint64_t bytes =
        detail::check_reshard_view(t, "source", v, tensors_[ref.tensor].dtype, ref.tensor,
                                   tensors_[ref.tensor].sources[ref.entry], x.device);
    staged += inner_strided(t) ? bytes : 0;
    x.view_extents.push_back({detail::extent_of(t, bytes), false, !is_contiguous(t), "source", v});
  }
  for (std::size_t v = 0; v < destinations.size(); ++v) {
    const ViewRef& ref = regions_.destination_views[v];
    const TensorView& t = destinations[v];
    const std::uint64_t bytes =
        detail::check_reshard_view(t, "destination", v, tensors_[ref.tensor].dtype, ref.tensor,
                                   tensors_[ref.tensor].destinations[ref.entry], x.device);
    if (bytes != 0 && overlaps_itself(t)) {
      throw InvalidArgument(view_name("destination", v, ref.tensor) +
                            ": its elements share memory (a stride of 0, or strides that map "
                            "two indices to one element): a write would land twice");
    }
    x.view_extents.push_back(
        {detail::extent_of(t, bytes), true, !is_contiguous(t), "destination", v});
  }
  detail::check_views_apart(x.view_extents);
  if (x.staging.size() < staged) {
    x.staging.resize(staged);
  }
  stats.staged_bytes = staged;
}

void ReshardPlan::build_job(std::span<const TensorView> sources,
                            std::span<const TensorView> destinations, detail::Stager& stager) {
  detail::ExecScratch& x = scratch_.get();
  x.sent_from.resize(sources.size());
  for (std::size_t v = 0; v < sources.size(); ++v) {
    const TensorView& t = sources[v];
    x.sent_from[v] = inner_strided(t) ? stager.stage(t, checked_nbytes(t.dtype, t.shape))
                                      : static_cast<const std::byte*>(t.data);
  }
  bind_round(0, sources, destinations);
}

// The walk over one transfer's box inside one view that holds `held`: emit(BoxRun) per run.
template <typename Emit>
void ReshardPlan::walk(const Transfer& tr, const RankBox& held, const TensorView& view, bool packed,
                       Emit&& emit) {
  detail::ExecScratch& x = scratch_.get();
  const std::uint64_t elem = dtype_size(view.dtype);
  detail::resolve_strides(
      view.shape, packed ? std::span<const std::int64_t>{} : std::span(view.strides), x.strides);
  x.local_offset.resize(held.box.offset.size());
  for (std::size_t d = 0; d < held.box.offset.size(); ++d) {
    x.local_offset[d] = tr.box.offset[d] - held.box.offset[d];
  }
  detail::for_each_box_run(x.local_offset, tr.box.size, x.strides, elem, x.runs, emit);
}

// Round e's job in the scratch: to each peer its moves of round e (from this rank's sources, as
// staged in sent_from), then its forwards of round e (from this rank's destinations, which hold
// those boxes since round e - 1); from each peer the same two lists into the destinations.
void ReshardPlan::bind_round(std::size_t e, std::span<const TensorView> sources,
                             std::span<const TensorView> destinations) {
  detail::ExecScratch& x = scratch_.get();
  const auto world = static_cast<std::size_t>(regions_.world_size);
  x.segments.clear();
  x.send_first.clear();
  for (std::size_t p = 0; p < world; ++p) {
    x.send_first.push_back(x.segments.size());
    append_sends(regions_.sends, regions_.send_first, e * world + p, sources, false);
    append_sends(regions_.forwards, regions_.forward_first, e * world + p, destinations, true);
  }
  x.send_first.push_back(x.segments.size());
  x.pieces.clear();
  x.first.clear();
  for (std::size_t q = 0; q < world; ++q) {
    x.first.push_back(x.pieces.size());
    append_receives(regions_.receives, regions_.recv_first, e * world + q, destinations);
    append_receives(regions_.forwarded, regions_.forwarded_first, e * world + q, destinations);
  }
  x.first.push_back(x.pieces.size());
}

// Appends the send segments of group g of `sends` (its transfers [first[g], first[g + 1])) to
// the scratch's current peer, out of `views`: sources, or for forwards destinations.
void ReshardPlan::append_sends(std::span<const Transfer> sends, std::span<const std::size_t> first,
                               std::size_t g, std::span<const TensorView> views, bool forward) {
  detail::ExecScratch& x = scratch_.get();
  for (std::size_t n = first[g]; n < first[g + 1]; ++n) {
    const Transfer& tr = sends[n];
    const TensorView& view = views[tr.src_view];
    const std::byte* base =
        forward ? static_cast<const std::byte*>(view.data) : x.sent_from[tr.src_view];
    const RankBox& held =
        forward ? tensors_[tr.tensor].destinations[tr.src] : tensors_[tr.tensor].sources[tr.src];
    walk(tr, held, view, base != view.data, [&](const detail::BoxRun& run) {
      for (std::uint64_t k = 0; k < run.count; ++k) {
        const std::byte* at = base + run.offset + static_cast<std::int64_t>(k * run.stride);
        ConstSegment* last = x.segments.size() > x.send_first.back() ? &x.segments.back() : nullptr;
        if (last != nullptr && last->data + last->size == at) {
          last->size += run.block;  // adjacent to the previous run: one segment
        } else {
          x.segments.push_back({at, run.block});
        }
      }
    });
  }
}

// Appends the receive pieces of group g of `receives` to the scratch's current peer.
void ReshardPlan::append_receives(std::span<const Transfer> receives,
                                  std::span<const std::size_t> first, std::size_t g,
                                  std::span<const TensorView> destinations) {
  detail::ExecScratch& x = scratch_.get();
  for (std::size_t n = first[g]; n < first[g + 1]; ++n) {
    const Transfer& tr = receives[n];
    const TensorView& view = destinations[tr.dst_view];
    auto* base = static_cast<std::byte*>(view.data);
    walk(tr, tensors_[tr.tensor].destinations[tr.dst], view, false, [&](const detail::BoxRun& run) {
      std::byte* at = base + run.offset;
      RecvPiece* last = x.pieces.size() > x.first.back() ? &x.pieces.back() : nullptr;
      if (last != nullptr && last->count == 1 && run.count == 1 && last->data + last->block == at) {
        last->block += run.block;
      } else {
        x.pieces.push_back({at, run.block, run.count, run.stride});
      }
    });
  }
}

// A fan-out's later exchange e (>= 1): every rank joins (a personal exchange is collective on
// some transports), once exchange e - 1 landed every box a rank forwards in it.
void ReshardPlan::run_round(std::size_t e, detail::Call& call, std::span<const TensorView> sources,
                            std::span<const TensorView> destinations, void* stream,
                            ExecStats& stats) {
  bind_round(e, sources, destinations);
  const detail::ExecScratch& x = scratch_.get();
  const detail::ExchangeJob job{.shape = detail::ExchangeShape::kPersonal,
                                .send = x.segments,
                                .send_first = x.send_first,
                                .pieces = x.pieces,
                                .first = x.first,
                                .counts = regions_.recv_counts,
                                .copy_threads = detail::copy_threads(options_, call.comm()),
                                .entry_synchronized = true,
                                .device = x.device,
                                .stream = stream,
                                .device_parts = regions_.device_parts,
                                .upload_slot = e};
  ExecStats round;
  scratch_.get().strategy.copy_stage.clear();  // the device's packs ran with the first exchange
  detail::run_payload(call, Strategy::kDirect, Strategy::kDirect, job, scratch_.get().strategy,
                      round);
  stats.payload_collectives += round.payload_collectives;
}

ExecStats ReshardPlan::execute_now(std::span<const TensorView> sources, Communicator& comm,
                                   std::span<const TensorView> destinations,
                                   std::span<const TensorView> scales,
                                   std::optional<Device> device) {
  detail::Call call(comm, Operation::kReshardExecute, options_.stage, options_.timeout,
                    options_.preflight, &scratch_.get().headers);
  const auto me = static_cast<std::size_t>(regions_.rank);
  const detail::PlanFacts facts{
      .options = options_,
      .shape = detail::ExchangeShape::kPersonal,
      .world = regions_.world_size,
      .rank = regions_.rank,
      .root = -1,
      .tensors = tensors_.size(),
      .counts = regions_.recv_counts,
      .fingerprint = fingerprint_,
      .dtypes = dtypes_,
      .dtype_hash = dtype_hash_,
      .personal_sent = regions_.rank_sent.empty() ? 0 : regions_.rank_sent[me]};
  ExecStats stats;
  const auto check = [&](ExecStats& s) {
    check_call(call, sources, destinations, scales, device, s);
  };
  // On a device the exchange's buffers are reserved before the agreement, so that a failed
  // allocation travels in the header to every rank; a quantized plan's maxima are folded there
  // too, so that a failed fold (or the host's wait for it) does.
  const auto reserve = [&](ExecStats& /*stats*/) {
    if (quant_) {
      detail::QuantScratch& q = scratch_.get().quant;
      quant_->fold(sources, q,
                   [&] { detail::wait_on_host(q.stream, call.comm(), call.deadline()); });
    }
    detail::StrategyScratch& s = scratch_.get().strategy;
    const Device& on = scratch_.get().device;
    if (on.type != DeviceType::kCpu && regions_.world_size > 1) {
      void* stream = current_cuda_stream();
      s.device_send.reserve(device_send_room_, on.index, stream);
      s.device_gathered.reserve(device_recv_room_, on.index, stream);
    }
  };
  const auto bind = [&](detail::Stager& stager) {
    if (quant_) {
      encode_stage(call, sources);
    }
    build_job(moved_sources(sources), moved_destinations(destinations), stager);
    const detail::ExecScratch& x = scratch_.get();
    return detail::ExchangeJob{.shape = detail::ExchangeShape::kPersonal,
                               .send = x.segments,
                               .send_first = x.send_first,
                               .pieces = x.pieces,
                               .first = x.first};
  };
  detail::ExchangeJob job =
      detail::prepare_execution(call, scratch_, facts, std::nullopt, stats, check, bind, reserve);
  job.device_parts = regions_.device_parts;
  detail::run_execution(call, scratch_, facts, job, stats);
  if (quant_ && quant_->row_bytes() != 0) {
    ++stats.payload_collectives;  // the maxima's all-gather, before the payload
  }
  for (std::size_t e = 1; e < regions_.rounds; ++e) {
    run_round(e, call, moved_sources(sources), moved_destinations(destinations), job.stream, stats);
  }
  if (quant_) {
    quant_->decode(destinations, scratch_.get().quant);
  }
  return stats;
}

}  // namespace shardgather
