// foreach_all_gather: with a hint, a plan built from it and executed once; without one, the
// header carries each rank's byte count, the shapes travel as records at the head of each
// rank's block in the same payload, and the layout is built from the received records. Both go
// through one call (one header) and the strategy layer.
#include <string>

#include "copies/local_input.h"
#include "copies/send_stream.h"
#include "ops/call.h"
#include "ops/payload.h"
#include "ops/plan_access.h"
#include "ops/records.h"
#include "ops/start.h"

#include "shardgather/errors.h"
#include "shardgather/foreach_all_gather.h"
#include "shardgather/plan.h"

namespace shardgather {

namespace {

constexpr LayoutOptions kWithRecords{.with_records = true};

GatherResult gather_with_hint(std::span<const TensorView> params, Communicator& comm,
                              std::span<const std::vector<Shape>> hint,
                              const ForeachAllGatherOptions& options) {
  detail::Call call(comm, Operation::kForeachAllGather, options.stage, options.timeout,
                    options.preflight);
  AllGatherPlan plan;
  AlignedBuffer out;
  call.check([&] {
    const detail::LocalInput in = detail::validate_params(params);
    detail::check_hint(hint, in, comm.rank(), comm.size());
    plan = AllGatherPlan(in.dtypes, hint, comm.rank(),
                         {.timeout = options.timeout,
                          .preflight = options.preflight,
                          .strategy = detail::one_shot_strategy(options.strategy)});
    out = detail::output_buffer(plan.output_bytes(), in.device);
  });
  call.guard(out);
  const ExecStats exec = detail::PlanAccess::run(plan, call, params, out.data(), out.size());
  const CallStats stats{.preflight_collectives = exec.preflight_collectives,
                        .metadata_collectives = 0,
                        .payload_collectives = exec.payload_collectives,
                        .setup_collectives = exec.setup_collectives,
                        .staged_bytes = exec.staged_bytes,
                        .strategy = exec.strategy};
  return {plan.layout(), std::move(out), stats};
}

// The layout of every rank's shapes, read from the records at the head of each block.
LayoutPlan layout_from_records(const detail::Call& call, const AlignedBuffer& out,
                               std::span<const DType> dtypes, std::span<const std::uint64_t> counts,
                               std::span<const std::uint64_t> displs) {
  std::vector<Shape> shapes;
  shapes.reserve(dtypes.size() * counts.size());
  for (std::size_t r = 0; r < counts.size(); ++r) {
    std::vector<Shape> rank_shapes =
        detail::decode_records(std::span<const std::byte>(out.data() + displs[r], counts[r]),
                               dtypes.size(), static_cast<int>(r));
    std::move(rank_shapes.begin(), rank_shapes.end(), std::back_inserter(shapes));
  }
  const int world = call.comm().size();
  LayoutPlan layout = plan_layout(dtypes, shapes, world, kWithRecords);
  for (std::size_t r = 0; r < counts.size(); ++r) {
    if (layout.counts[r] != counts[r]) {
      throw Mismatch("rank " + std::to_string(call.comm().rank()) + ": foreach_all_gather: rank " +
                     std::to_string(r) + " sent " + std::to_string(counts[r]) +
                     " bytes but its shapes need " + std::to_string(layout.counts[r]));
    }
  }
  return layout;
}

GatherResult gather_without_hint(std::span<const TensorView> params, Communicator& comm,
                                 const ForeachAllGatherOptions& options) {
  detail::Call call(comm, Operation::kForeachAllGather, options.stage, options.timeout, true);
  // Known before the counts are: an explicit strategy, or its fallback on this communicator.
  const Strategy requested = detail::one_shot_strategy(options.strategy);
  const Strategy strategy =
      detail::select_strategy(requested, detail::ExchangeShape::kAllGather, {}, comm, false);
  detail::set_strategy(call.header(), strategy);
  detail::LocalInput in;
  BlockLayout block;
  std::vector<std::byte> records;
  std::vector<std::byte> staging;
  call.check([&] {
    in = detail::validate_params(params);
    detail::check_call_device(call, in.device);
    if (in.device.type != DeviceType::kCpu) {
      // The shapes travel at the head of each rank's block, and the layout is read from them
      // on the host; a device call needs them known up front.
      throw InvalidArgument("foreach_all_gather on " + device_name(in.device) +
                            " tensors needs shapes_across_group (or a plan); the Python binding "
                            "gathers the shapes first");
    }
    detail::set_dtypes(call.header(), in.dtypes);
    detail::check_record_dims(in.shapes);
    block = plan_block(in.dtypes, in.shapes, kWithRecords);
    call.header().payload_bytes = block.bytes;
    records.resize(block.record_bytes);
    detail::encode_records(in.shapes, records.data());
    staging.resize(in.strided_bytes);
  });
  const std::span<const detail::PreflightHeader> headers = call.agree();

  // The header said what each rank sends: every block lands as one piece at its place.
  const auto world = static_cast<std::size_t>(comm.size());
  std::vector<std::uint64_t> counts(world, block.bytes);
  std::vector<std::uint64_t> displs(world);
  for (std::size_t r = 0; r < headers.size(); ++r) {
    counts[r] = headers[r].payload_bytes;
  }
  AlignedBuffer out(place_blocks(counts, block_alignment(in.dtypes, kWithRecords), displs));
  call.guard(out);
  call.guard(staging);
  call.guard(records);
  std::vector<ConstSegment> segments;
  std::vector<std::size_t> send_first;
  detail::Stager stager{.at = staging.data()};
  detail::append_block(
      params, block.offsets, 0, block.sizes, records, stager,
      [](std::size_t /*i*/) { return false; }, segments, send_first);
  detail::BlockJob blocks(segments, out.data(), counts, displs, call.exchanges());
  call.guard(blocks.scratch);
  ExecStats exec;
  detail::run_payload(call, requested, strategy, blocks.job, blocks.scratch, exec);
  const CallStats stats{.preflight_collectives = 0,
                        .metadata_collectives = call.exchanges() ? 1U : 0U,
                        .payload_collectives = exec.payload_collectives,
                        .setup_collectives = exec.setup_collectives,
                        .staged_bytes = in.strided_bytes,
                        .strategy = exec.strategy};
  LayoutPlan layout = layout_from_records(call, out, in.dtypes, counts, displs);
  return {std::move(layout), std::move(out), stats};
}

GatherResult gather_now(std::span<const TensorView> params, Communicator& comm,
                        std::span<const std::vector<Shape>> hint,
                        const ForeachAllGatherOptions& options) {
  return hint.empty() ? gather_without_hint(params, comm, options)
                      : gather_with_hint(params, comm, hint, options);
}

}  // namespace

GatherResult::GatherResult(LayoutPlan plan, AlignedBuffer buffer, CallStats stats)
    : plan_(std::move(plan)),
      buffer_(std::move(buffer)),
      stats_(stats),
      views_(detail::layout_views(plan_, buffer_.data(), buffer_.device())) {}

std::span<const TensorView> GatherResult::operator[](std::size_t i) const {
  if (i >= plan_.num_tensors) {
    throw InvalidArgument("GatherResult: tensor index " + std::to_string(i) + " out of range (" +
                          std::to_string(plan_.num_tensors) + " tensors)");
  }
  const auto world = static_cast<std::size_t>(plan_.world_size);
  return std::span<const TensorView>(views_).subspan(i * world, world);
}

GatherResult foreach_all_gather(std::span<const TensorView> params, Communicator& comm,
                                std::span<const std::vector<Shape>> shapes_across_group,
                                const ForeachAllGatherOptions& options) {
  return detail::run_blocking(
      comm, [&] { return gather_now(params, comm, shapes_across_group, options); });
}

Work<GatherResult> start_foreach_all_gather(std::span<const TensorView> params, Communicator& comm,
                                            std::span<const std::vector<Shape>> shapes_across_group,
                                            const ForeachAllGatherOptions& options) {
  return detail::start_on<GatherResult>(
      comm, [&comm, views = std::vector<TensorView>(params.begin(), params.end()),
             hint = ShapesHint(shapes_across_group.begin(), shapes_across_group.end()),
             options] { return gather_now(views, comm, hint, options); });
}

}  // namespace shardgather
