// AllGatherPlan: the steady-state path. Construction does every allocation and computation that
// depends only on shapes; an execution checks this rank's tensors, agrees through the call,
// builds the send list and the destination pieces into reused scratch, and runs one strategy.
#include "shardgather/plan.h"

#include <algorithm>
#include <string>

#include "copies/device_runtime.h"
#include "copies/local_input.h"
#include "copies/send_stream.h"
#include "ops/call.h"
#include "ops/payload.h"
#include "ops/plan_access.h"
#include "ops/plan_execution.h"
#include "ops/quant_stage.h"
#include "ops/start.h"

#include "shardgather/copy.h"
#include "shardgather/embedding.h"
#include "shardgather/errors.h"

namespace shardgather {

using detail::ExecScratch;

namespace {

// The tensor index i of every rank forms along dim 0 (their shapes equal past it), or
// InvalidArgument naming them.
Shape formed_along_rows(std::size_t i, std::span<const std::vector<Shape>> shapes) {
  Shape formed = shapes[0][i];
  std::string listed;
  bool ok = !formed.empty();
  for (std::size_t r = 0; r < shapes.size(); ++r) {
    const Shape& s = shapes[r][i];
    listed += (r == 0 ? "" : ", ") + detail::shape_str(s);
    ok = ok && s.size() == formed.size() && std::equal(s.begin() + 1, s.end(), formed.begin() + 1);
    if (ok && r != 0) {
      formed[0] += s[0];
    }
  }
  if (!ok) {
    throw InvalidArgument("quantize[" + std::to_string(i) +
                          "]: the ranks' tensors must differ only along dim 0 to form one "
                          "tensor, got [" +
                          listed + "]");
  }
  return formed;
}

// The gather as a reshard, per index: a quantized one is the tensor its ranks' rows form,
// every rank's rows a source and a destination box of every rank; a plain one is a tensor per
// rank, held by that rank and wanted whole by every rank. Each rank's boxes come in the order
// outputs take them: index by index, rank by rank.
std::vector<TensorRegions> gather_regions(std::span<const DType> dtypes,
                                          std::span<const std::vector<Shape>> shapes,
                                          std::span<const QuantFormat> quantize,
                                          std::vector<QuantFormat>& formats) {
  const auto world = static_cast<int>(shapes.size());
  std::vector<TensorRegions> out;
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    if (quantize[i] == QuantFormat::kNone) {
      for (int r = 0; r < world; ++r) {
        const Shape& s = shapes[static_cast<std::size_t>(r)][i];
        const Box whole{Shape(s.size(), 0), s};
        TensorRegions t{
            .dtype = dtypes[i], .shape = s, .sources = {{r, whole}}, .destinations = {}};
        for (int p = 0; p < world; ++p) {
          t.destinations.push_back({p, whole});
        }
        out.push_back(std::move(t));
        formats.push_back(QuantFormat::kNone);
      }
      continue;
    }
    TensorRegions t{.dtype = dtypes[i],
                    .shape = formed_along_rows(i, shapes),
                    .sources = {},
                    .destinations = {}};
    std::int64_t at = 0;
    for (int r = 0; r < world; ++r) {
      Box rows{Shape(t.shape.size(), 0), shapes[static_cast<std::size_t>(r)][i]};
      rows.offset[0] = at;
      at += rows.size[0];
      t.sources.push_back({r, rows});
    }
    for (int p = 0; p < world; ++p) {
      for (const RankBox& b : t.sources) {
        t.destinations.push_back({p, b.box});
      }
    }
    out.push_back(std::move(t));
    formats.push_back(quantize[i]);
  }
  return out;
}

}  // namespace

AllGatherPlan::AllGatherPlan(std::span<const DType> dtypes,
                             std::span<const std::vector<Shape>> shapes_across_group, int rank,
                             const PlanOptions& options, std::span<const QuantFormat> quantize)
    : rank_(rank), options_(options) {
  if (options.dst != -1) {
    throw InvalidArgument("AllGatherPlan: dst " + std::to_string(options.dst) +
                          ": an all-gather gives every rank every tensor (a gather to one rank "
                          "is unshard's)");
  }
  const auto world = static_cast<int>(shapes_across_group.size());
  if (world < 1 || rank < 0 || rank >= world) {
    throw InvalidArgument("AllGatherPlan: rank " + std::to_string(rank) + " of " +
                          std::to_string(world) + " ranks of shapes");
  }
  std::vector<Shape> flat;
  flat.reserve(shapes_across_group.size() * dtypes.size());
  for (std::size_t r = 0; r < shapes_across_group.size(); ++r) {
    if (shapes_across_group[r].size() != dtypes.size()) {
      throw InvalidArgument("AllGatherPlan: rank " + std::to_string(r) + " has " +
                            std::to_string(shapes_across_group[r].size()) + " shapes for " +
                            std::to_string(dtypes.size()) + " dtypes");
    }
    flat.insert(flat.end(), shapes_across_group[r].begin(), shapes_across_group[r].end());
  }
  layout_ = plan_layout(dtypes, flat, world);
  fingerprint_ = detail::hash_hint(flat, world);
  dtype_hash_ = detail::hash_dtypes(dtypes);
  plan_quantized(dtypes, shapes_across_group, quantize);
}

void AllGatherPlan::plan_quantized(std::span<const DType> dtypes,
                                   std::span<const std::vector<Shape>> shapes_across_group,
                                   std::span<const QuantFormat> quantize) {
  if (!detail::plans_quantized("AllGatherPlan", quantize, dtypes.size(), "tensors",
                               options_.strategy)) {
    return;
  }
  std::vector<QuantFormat> formats;
  const std::vector<TensorRegions> regions =
      gather_regions(dtypes, shapes_across_group, quantize, formats);
  quantized_.emplace(regions, layout_.world_size, rank_, options_, RegionOptions{}, formats);
}

void AllGatherPlan::refuse(Communicator& comm, const std::string& message) const {
  fail_call(comm,
            {.op = quantized_ ? Operation::kReshardExecute : Operation::kPlanExecute,
             .header_exchanged = options_.preflight,
             .timeout = options_.timeout,
             .stage = options_.stage},
            ErrorCode::kInvalidArgument, message);
}

std::vector<TensorView> AllGatherPlan::views(const std::byte* buffer) const {
  return detail::layout_views(layout_, buffer);
}

void AllGatherPlan::check_params(const Communicator& comm, std::span<const TensorView> params,
                                 const std::byte* out, std::uint64_t out_size, ExecStats& stats) {
  const int world = layout_.world_size;
  const std::size_t n = layout_.num_tensors;
  detail::check_plan_world(comm, world, rank_);
  if (params.size() != n) {
    throw InvalidArgument("the plan has " + std::to_string(n) + " tensors, got " +
                          std::to_string(params.size()));
  }
  if (out_size < layout_.total_bytes) {
    throw InvalidArgument("the output holds " + std::to_string(out_size) +
                          " bytes, the plan needs " + std::to_string(layout_.total_bytes));
  }
  const auto me = static_cast<std::size_t>(rank_);
  ExecScratch& x = scratch_.get();
  x.device = detail::call_device(params);
  const auto out_begin = reinterpret_cast<std::uintptr_t>(out);
  const std::uintptr_t out_end = out == nullptr ? 0 : out_begin + layout_.total_bytes;
  std::uint64_t staged = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t k = me * n + i;
    detail::check_tensor_matches(params[i], i, layout_.dtypes[i], layout_.shapes[k],
                                 layout_.sizes[k]);
    detail::check_device(params[i], i, x.device);
    const bool contiguous = is_contiguous(params[i]);
    const detail::Extent e = detail::extent_of(params[i], layout_.sizes[k]);
    const bool overlaps = e.begin < out_end && out_begin < e.end;
    const bool in_place = out != nullptr && params[i].data == out + layout_.offsets[k];
    if (overlaps && !(in_place && contiguous)) {
      throw InvalidArgument("tensor " + std::to_string(i) +
                            ": aliasing: the input overlaps the output outside its own slot");
    }
    if (overlaps || !contiguous) {
      staged += layout_.sizes[k];
    }
  }
  if (x.device.type != DeviceType::kCpu && out != nullptr && layout_.total_bytes != 0 &&
      detail::device_of(out) != x.device) {
    throw InvalidArgument("the output is on " + device_name(detail::device_of(out)) +
                          ", the tensors on " + device_name(x.device) +
                          " (a call's tensors and output are on one device)");
  }
  if (x.device.type == DeviceType::kCpu && x.staging.size() < staged) {
    x.staging.resize(staged);  // once: later executions reuse it
  }
  stats.staged_bytes = staged;
}

detail::ExchangeJob AllGatherPlan::prepare(detail::Call& call, std::span<const TensorView> params,
                                           std::byte* out, std::uint64_t out_size,
                                           std::optional<Strategy> forced, ExecStats& stats) {
  const detail::PlanFacts facts{.options = options_,
                                .shape = detail::ExchangeShape::kAllGather,
                                .world = layout_.world_size,
                                .rank = rank_,
                                .tensors = layout_.num_tensors,
                                .counts = layout_.counts,
                                .fingerprint = fingerprint_,
                                .dtypes = layout_.dtypes,
                                .dtype_hash = dtype_hash_};
  const auto check = [&](ExecStats& st) { check_params(call.comm(), params, out, out_size, st); };
  const auto bind = [&](detail::Stager& stager) { return bind_job(params, out, stager); };
  // After the device checks, as before: a transport without device memory names itself first.
  const auto shared_is_host = [&](ExecStats& /*st*/) {
    if (out == nullptr && scratch_.get().device.type != DeviceType::kCpu) {
      throw InvalidArgument(
          "execute_shared gathers host memory; execute CUDA tensors into an "
          "output on their device");
    }
  };
  return detail::prepare_execution(call, scratch_, facts, forced, stats, check, bind,
                                   shared_is_host);
}

detail::ExchangeJob AllGatherPlan::bind_job(std::span<const TensorView> params, std::byte* out,
                                            detail::Stager& stager) {
  ExecScratch& x = scratch_.get();
  const int world = layout_.world_size;
  const std::size_t n = layout_.num_tensors;
  const auto me = static_cast<std::size_t>(rank_);
  // This rank's stream: gaps and tensors, in place or staged.
  const auto in_place = [&](std::size_t i) {
    return out != nullptr && params[i].data == out + layout_.offsets[me * n + i];
  };
  detail::append_block(params, std::span(layout_.offsets).subspan(me * n, n), layout_.displs[me],
                       std::span(layout_.sizes).subspan(me * n, n), {}, stager, in_place,
                       x.segments, x.send_first);
  // Destinations: one piece per (rank, tensor), the tensor and the gap before it.
  for (std::size_t r = 0; r < static_cast<std::size_t>(world); ++r) {
    std::uint64_t end = layout_.displs[r];
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t k = r * n + i;
      const std::uint64_t part_end =
          layout_.sizes[k] == 0 ? end : layout_.offsets[k] + layout_.sizes[k];
      x.pieces[k] = RecvPiece{out == nullptr ? nullptr : out + end, part_end - end, 1, 0};
      x.part_bytes[k] = part_end - end;
      x.part_first[k] = k;
      end = part_end;
    }
    x.first[r] = r * n;
  }
  x.first[static_cast<std::size_t>(world)] = static_cast<std::size_t>(world) * n;
  x.part_first[static_cast<std::size_t>(world) * n] = static_cast<std::size_t>(world) * n;
  return detail::ExchangeJob{
      .send = x.segments,
      .pieces = x.pieces,
      .first = x.first,
      .parts = {.count = n,
                .bytes = x.part_bytes,
                .first = x.part_first,
                .send_first = x.send_first},
      .stream_displs = layout_.displs,
  };
}

ExecStats AllGatherPlan::execute_now(std::span<const TensorView> params, Communicator& comm,
                                     std::span<std::byte> out) {
  detail::Call call(comm, Operation::kPlanExecute, options_.stage, options_.timeout,
                    options_.preflight, &scratch_.get().headers);
  return detail::PlanAccess::run(*this, call, params, out.data(), out.size());
}

constexpr const char* kIntoOutputs =
    "AllGatherPlan: a quantized plan writes each rank's rows into outputs (FP8 data with its "
    "scales, or values), not into one buffer";

ExecStats AllGatherPlan::execute(std::span<const TensorView> params, Communicator& comm,
                                 std::span<std::byte> out) {
  if (quantized_) {
    refuse(comm, kIntoOutputs);
  }
  return detail::run_blocking(comm, [&] { return execute_now(params, comm, out); });
}

ReshardPlan& AllGatherPlan::quantized_plan(Communicator& comm) {
  if (!quantized_) {
    refuse(comm, "AllGatherPlan: outputs and scales given to a plan that quantizes nothing");
  }
  return *quantized_;
}

ExecStats AllGatherPlan::execute(std::span<const TensorView> params, Communicator& comm,
                                 std::span<const TensorView> outputs,
                                 std::span<const TensorView> scales) {
  return quantized_plan(comm).execute(params, comm, outputs, scales);
}

Work<ExecStats> AllGatherPlan::start(std::span<const TensorView> params, Communicator& comm,
                                     std::span<const TensorView> outputs,
                                     std::span<const TensorView> scales) {
  return quantized_plan(comm).start(params, comm, outputs, scales);
}

Work<ExecStats> AllGatherPlan::start(std::span<const TensorView> params, Communicator& comm,
                                     std::span<std::byte> out) {
  if (quantized_) {
    refuse(comm, kIntoOutputs);
  }
  return detail::start_on<ExecStats>(
      comm, [this, &comm, views = std::vector<TensorView>(params.begin(), params.end()), out] {
        return execute_now(views, comm, out);
      });
}

std::span<const std::byte> AllGatherPlan::execute_shared(std::span<const TensorView> params,
                                                         Communicator& comm, ExecStats* stats) {
  if (quantized_) {
    refuse(comm, kIntoOutputs);
  }
  ExecStats local;
  ExecStats& st = stats != nullptr ? *stats : local;
  st = ExecStats{};
  return detail::run_blocking(comm, [&]() -> std::span<const std::byte> {
    ExecScratch& x = scratch_.get();
    if (!detail::shared_available(comm) || layout_.total_bytes == 0) {
      x.owned.resize(layout_.total_bytes);
      st = execute_now(params, comm, x.owned);
      return x.owned;
    }
    detail::Call call(comm, Operation::kPlanExecute, options_.stage, options_.timeout,
                      options_.preflight, &x.headers);
    const detail::ExchangeJob job =
        prepare(call, params, nullptr, layout_.total_bytes, Strategy::kShared, st);
    const std::uint64_t before = comm.collectives_issued();
    const std::uint64_t setup_before = x.strategy.setup_collectives;
    const std::byte* base = call.transfer(
        [&] { return detail::shared_copy_in(job, comm, call.deadline(), x.strategy); });
    st.setup_collectives = x.strategy.setup_collectives - setup_before;
    st.payload_collectives = comm.collectives_issued() - before - st.setup_collectives;
    return {base, layout_.total_bytes};
  });
}

namespace detail {

ExecStats PlanAccess::run(AllGatherPlan& plan, Call& call, std::span<const TensorView> params,
                          std::byte* out, std::uint64_t out_size) {
  ExecStats stats;
  const ExchangeJob job = plan.prepare(call, params, out, out_size, std::nullopt, stats);
  run_payload(call, plan.options_.strategy, stats.strategy, job, plan.scratch_.get().strategy,
              stats);
  return stats;
}

}  // namespace detail
}  // namespace shardgather
