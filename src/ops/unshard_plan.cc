// UnshardPlan: shards along any dim into full parameters, received straight into place.
//
// Rank r's wire stream is the real part of each of its shards, parameter by parameter (padding
// never travels). Part (r, i) lands in parameter i's full tensor as `outer` blocks of
// sizes[r] * inner bytes, one per index of the dims before the shard dim, full[d] * inner bytes
// apart, starting at row offset sum(sizes[< r]). For dim 0 (outer == 1) that is one contiguous
// block, so a single dim-0 parameter gathers straight into the full tensor with a plain
// all_gather_v.
#include <algorithm>
#include <string>

#include "copies/box_runs.h"
#include "copies/device_runtime.h"
#include "copies/local_input.h"
#include "copies/send_stream.h"
#include "ops/call.h"
#include "ops/exec_scratch.h"
#include "ops/payload.h"
#include "ops/plan_access.h"
#include "ops/plan_execution.h"
#include "ops/quant_stage.h"
#include "ops/start.h"
#include "vocabulary/checked_math.h"
#include "vocabulary/hash.h"

#include "shardgather/copy.h"
#include "shardgather/embedding.h"
#include "shardgather/errors.h"
#include "shardgather/layout.h"
#include "shardgather/unshard.h"

namespace shardgather {

namespace {

constexpr std::uint64_t kOutputAlignment = 64;

std::string param_prefix(std::size_t i) { return "parameter " + std::to_string(i) + ": "; }

// Bytes of the dims before (outer, as a count) and after (inner, in bytes) the shard dim.
struct Split {
  std::uint64_t outer = 1;
  std::uint64_t inner_bytes = 1;
};

Split split_of(const ShardSpec& s) {
  const auto d = static_cast<std::ptrdiff_t>(s.shard_dim);
  const Shape before(s.full_shape.begin(), s.full_shape.begin() + d);
  const Shape after(s.full_shape.begin() + d + 1, s.full_shape.end());
  return {checked_nbytes(DType::kUInt8, before), checked_nbytes(s.dtype, after)};
}

// Checks the spec's dim and sizes (filling torch.chunk sizes in); returns its full bytes.
std::uint64_t check_spec(ShardSpec& s, std::size_t i, int world_size) {
  const std::string where = param_prefix(i);
  const auto ndim = static_cast<int>(s.full_shape.size());
  if (ndim == 0) {
    throw InvalidArgument(where + "a 0-d parameter has no dim to shard");
  }
  if (s.shard_dim < -ndim || s.shard_dim >= ndim) {
    throw InvalidArgument(where + "shard dim " + std::to_string(s.shard_dim) +
                          " out of range for " + detail::shape_str(s.full_shape));
  }
  if (s.shard_dim < 0) {
    s.shard_dim += ndim;
  }
  std::uint64_t full_bytes = 0;
  try {
    full_bytes = checked_nbytes(s.dtype, s.full_shape);
  } catch (const CountOverflow& e) {
    throw CountOverflow(where + e.what());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(where + e.what());
  }
  const std::int64_t full_d = s.full_shape[static_cast<std::size_t>(s.shard_dim)];
  if (s.sizes.empty()) {
    s.sizes = chunk_sizes(full_d, world_size);
  }
  if (s.sizes.size() != static_cast<std::size_t>(world_size)) {
    throw InvalidArgument(where + std::to_string(s.sizes.size()) + " shard sizes for " +
                          std::to_string(world_size) + " ranks");
  }
  std::uint64_t sum = 0;
  for (const std::int64_t size : s.sizes) {
    if (size < 0) {
      throw InvalidArgument(where + "negative shard size " + std::to_string(size));
    }
    // Checked: sizes near 2^62 must not wrap into a plausible sum.
    sum = detail::add_checked(sum, static_cast<std::uint64_t>(size), "sum of shard sizes");
  }
  if (sum != static_cast<std::uint64_t>(full_d)) {
    throw InvalidArgument(where + "shard sizes sum to " + std::to_string(sum) + " but dim " +
                          std::to_string(s.shard_dim) + " of " + detail::shape_str(s.full_shape) +
                          " is " + std::to_string(full_d));
  }
  const std::int64_t largest = *std::max_element(s.sizes.begin(), s.sizes.end());
  if (s.padded_size != 0 && s.padded_size < largest) {
    throw InvalidArgument(where + "padded size " + std::to_string(s.padded_size) +
                          " is smaller than the largest shard, " + std::to_string(largest));
  }
  return full_bytes;
}

void hash_spec(detail::Hasher& hasher, const ShardSpec& s) {
  hasher.add(static_cast<std::uint64_t>(s.dtype));
  hasher.add(static_cast<std::uint64_t>(s.shard_dim));
  hasher.add(static_cast<std::uint64_t>(s.padded_size));
  for (const std::int64_t dim : s.full_shape) {
    hasher.add(static_cast<std::uint64_t>(dim));
  }
  for (const std::int64_t size : s.sizes) {
    hasher.add(static_cast<std::uint64_t>(size));
  }
}

// An unshard as a reshard: every rank's real rows (its size along the shard dim) are the
// sources, the full tensor on every rank (or on dst) the destinations.
std::vector<TensorRegions> unshard_regions(std::span<const ShardSpec> specs, int world, int dst) {
  std::vector<TensorRegions> out;
  out.reserve(specs.size());
  for (const ShardSpec& s : specs) {
    TensorRegions t{.dtype = s.dtype, .shape = s.full_shape, .sources = {}, .destinations = {}};
    const auto d = static_cast<std::size_t>(s.shard_dim);
    Shape offset(s.full_shape.size(), 0);
    for (int r = 0; r < world; ++r) {
      Shape size = s.full_shape;
      size[d] = s.sizes[static_cast<std::size_t>(r)];
      t.sources.push_back({r, Box{offset, size}});
      offset[d] += size[d];
    }
    const Box whole{Shape(s.full_shape.size(), 0), s.full_shape};
    for (int r = 0; r < world; ++r) {
      if (dst < 0 || r == dst) {
        t.destinations.push_back({r, whole});
      }
    }
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

UnshardPlan UnshardPlan::for_communicator(std::span<const ShardSpec> specs,
                                          const Communicator& comm, const PlanOptions& options) {
  return {specs, comm.size(), comm.rank(), options};
}

UnshardPlan::UnshardPlan(std::span<const ShardSpec> specs, int world_size, int rank,
                         const PlanOptions& options, int dst, std::span<const QuantFormat> quantize)
    : specs_(specs.begin(), specs.end()), world_(world_size), rank_(rank), options_(options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw InvalidArgument("UnshardPlan: rank " + std::to_string(rank) + " of " +
                          std::to_string(world_size));
  }
  for (const int given : {dst, options.dst}) {
    if (given < -1 || given >= world_size) {
      throw InvalidArgument("UnshardPlan: dst " + std::to_string(given) + " is not a rank of " +
                            std::to_string(world_size) + " (or -1: every rank)");
    }
  }
  dst_ = detail::one_dst(dst, options.dst, "UnshardPlan", "options.dst");
  dst = dst_;
  options_.dst = dst_;
  if (dst >= 0 && options.strategy != Strategy::kAuto && options.strategy != Strategy::kDirect) {
    throw InvalidArgument("UnshardPlan: a gather to one rank (dst " + std::to_string(dst) +
                          ") runs kDirect only, not " +
                          std::string(strategy_name(options.strategy)));
  }
  const auto world = static_cast<std::size_t>(world_size);
  const std::size_t n = specs_.size();
  detail::Hasher hasher;
  hasher.add(world);
  hasher.add(n);
  hasher.add(static_cast<std::uint64_t>(static_cast<std::int64_t>(dst) + 1));
  output_offsets_.resize(n);
  part_bytes_.assign(world * n, 0);
  part_pieces_.assign(world * n, RecvPiece{});
  part_offsets_.assign(world * n, 0);
  counts_.assign(world, 0);
  std::uint64_t end = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t full_bytes = add_spec(i, world_size);
    end = detail::align_up_checked(end, kOutputAlignment, "output offset");
    output_offsets_[i] = end;
    end = detail::add_checked(end, full_bytes, "output size");
    hash_spec(hasher, specs_[i]);
    dtypes_.push_back(specs_[i].dtype);
  }
  dtype_hash_ = detail::hash_dtypes(dtypes_);
  output_bytes_ = end;
  for (std::size_t i = 0; i < n; ++i) {
    local_bytes_.push_back(checked_nbytes(specs_[i].dtype, shard_shape(rank, i)));
  }
  fingerprint_ = hasher.value() == 0 ? 1 : hasher.value();
  plan_quantized(quantize);
}

void UnshardPlan::plan_quantized(std::span<const QuantFormat> quantize) {
  if (!detail::plans_quantized("UnshardPlan", quantize, specs_.size(), "specs",
                               options_.strategy)) {
    return;
  }
  PlanOptions reshard = options_;
  reshard.dst = -1;  // a reshard's receivers are its destination boxes
  quantized_.emplace(unshard_regions(specs_, world_, dst_), world_, rank_, reshard, RegionOptions{},
                     quantize);
}

std::vector<TensorView> UnshardPlan::real_rows(std::span<const TensorView> shards) const {
  std::vector<TensorView> rows(shards.begin(), shards.end());
  for (std::size_t i = 0; i < rows.size() && i < specs_.size(); ++i) {
    const ShardSpec& s = specs_[i];
    const auto d = static_cast<std::size_t>(s.shard_dim);
    const std::int64_t real = s.sizes[static_cast<std::size_t>(rank_)];
    TensorView& v = rows[i];
    if (s.padded_size == 0) {
      continue;  // shards_error has checked its shape
    }
    Shape strides;  // a contiguous view's, before its shape shrinks
    detail::resolve_strides(v.shape, v.strides, strides);
    v.strides = std::move(strides);
    v.shape[d] = real;
  }
  return rows;
}

// The call the peers are in: the quantized reshard's, or the plain plan's.
void UnshardPlan::refuse(Communicator& comm, const std::string& message) const {
  fail_call(comm,
            {.op = quantized_ ? Operation::kReshardExecute : Operation::kUnshardExecute,
             .header_exchanged = options_.preflight,
             .timeout = options_.timeout,
             .stage = options_.stage},
            ErrorCode::kInvalidArgument, message);
}

std::uint64_t UnshardPlan::add_spec(std::size_t i, int world_size) {
  ShardSpec& s = specs_[i];
  const std::uint64_t full_bytes = check_spec(s, i, world_size);
  const std::size_t n = specs_.size();
  const Split split = split_of(s);
  const auto full_d =
      static_cast<std::uint64_t>(s.full_shape[static_cast<std::size_t>(s.shard_dim)]);
  const std::uint64_t row_bytes = full_d * split.inner_bytes;
  std::uint64_t row = 0;
  for (std::size_t r = 0; r < static_cast<std::size_t>(world_size); ++r) {
    const auto rows = static_cast<std::uint64_t>(s.sizes[r]);
    const std::uint64_t block = rows * split.inner_bytes;
    const std::size_t k = r * n + i;
    part_bytes_[k] = block * split.outer;
    // An execution sets `data` to the full tensor's address plus the offset.
    part_offsets_[k] = row * split.inner_bytes;
    part_pieces_[k] = RecvPiece{nullptr, block, split.outer, row_bytes};
    counts_[r] = detail::add_checked(counts_[r], part_bytes_[k], "bytes per rank");
    row += rows;
  }
  return full_bytes;
}

Shape UnshardPlan::shard_shape(int rank, std::size_t i) const {
  const ShardSpec& s = specs_.at(i);
  Shape shape = s.full_shape;
  shape[static_cast<std::size_t>(s.shard_dim)] =
      s.padded_size != 0 ? s.padded_size : s.sizes.at(static_cast<std::size_t>(rank));
  return shape;
}

std::vector<TensorView> UnshardPlan::views(std::byte* buffer) const {
  std::vector<TensorView> out;
  out.reserve(specs_.size());
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    out.push_back(TensorView{.data = buffer + output_offsets_[i],
                             .dtype = specs_[i].dtype,
                             .shape = specs_[i].full_shape,
                             .strides = {}});
  }
  return out;
}

std::optional<std::string> UnshardPlan::target_buffer(std::byte* out, std::uint64_t out_size) {
  detail::ExecScratch& x = scratch_.get();
  x.output_device.reset();
  x.outputs.resize(specs_.size());
  if (!receives()) {
    std::fill(x.outputs.begin(), x.outputs.end(), nullptr);
    return std::nullopt;
  }
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    x.outputs[i] = out + output_offsets_[i];
  }
  if (out_size < output_bytes_) {
    return "the output holds " + std::to_string(out_size) + " bytes, the plan needs " +
           std::to_string(output_bytes_);
  }
  return std::nullopt;
}

std::optional<std::string> UnshardPlan::target_outputs(std::span<const TensorView> outputs) {
  detail::ExecScratch& x = scratch_.get();
  x.output_device = detail::call_device(outputs);
  x.outputs.resize(specs_.size());
  if (!receives()) {
    std::fill(x.outputs.begin(), x.outputs.end(), nullptr);
    return std::nullopt;
  }
  if (outputs.size() != specs_.size()) {
    return "the plan has " + std::to_string(specs_.size()) + " parameters, got " +
           std::to_string(outputs.size()) + " outputs";
  }
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    const TensorView& o = outputs[i];
    const ShardSpec& s = specs_[i];
    if (o.dtype != s.dtype || o.shape != s.full_shape || !is_contiguous(o)) {
      return "output " + std::to_string(i) + ": needs a contiguous " +
             std::string(dtype_name(s.dtype)) + " tensor of " + detail::shape_str(s.full_shape) +
             ", got " + std::string(dtype_name(o.dtype)) + " " + detail::shape_str(o.shape);
    }
    if (o.data == nullptr && checked_nbytes(s.dtype, s.full_shape) != 0) {
      return "output " + std::to_string(i) + ": null data";
    }
    if (o.device != *x.output_device) {
      return "output " + std::to_string(i) + ": on " + device_name(o.device) + ", output 0 on " +
             device_name(*x.output_device) + " (a call's outputs are on one device)";
    }
    x.outputs[i] = static_cast<std::byte*>(o.data);
  }
  return std::nullopt;
}

ExecStats UnshardPlan::execute(std::span<const TensorView> shards, Communicator& comm,
                               std::span<std::byte> out) {
  if (quantized_) {
    refuse(comm,
           "UnshardPlan::execute: a quantized plan writes its parameters into outputs (FP8 "
           "data and scales, or values), not into one buffer");
  }
  return detail::run_blocking(comm, [&] {
    const std::optional<std::string> error = target_buffer(out.data(), out.size());
    return execute_now(shards, comm, error, true);
  });
}

ExecStats UnshardPlan::execute(std::span<const TensorView> shards, Communicator& comm,
                               std::span<const TensorView> outputs) {
  if (quantized_) {
    return execute(shards, comm, outputs, std::span<const TensorView>{});
  }
  return detail::run_blocking(comm, [&] {
    const std::optional<std::string> error = target_outputs(outputs);
    return execute_now(shards, comm, error, false);
  });
}

Work<ExecStats> UnshardPlan::start(std::span<const TensorView> shards, Communicator& comm,
                                   std::span<std::byte> out) {
  if (quantized_) {
    refuse(comm,
           "UnshardPlan::start: a quantized plan writes its parameters into outputs (FP8 "
           "data and scales, or values), not into one buffer");
  }
  return detail::start_on<ExecStats>(
      comm, [this, &comm, views = std::vector<TensorView>(shards.begin(), shards.end()), out] {
        const std::optional<std::string> error = target_buffer(out.data(), out.size());
        return execute_now(views, comm, error, true);
      });
}

Work<ExecStats> UnshardPlan::start(std::span<const TensorView> shards, Communicator& comm,
                                   std::span<const TensorView> outputs) {
  if (quantized_) {
    return start(shards, comm, outputs, std::span<const TensorView>{});
  }
  return detail::start_on<ExecStats>(
      comm, [this, &comm, views = std::vector<TensorView>(shards.begin(), shards.end()),
             outs = std::vector<TensorView>(outputs.begin(), outputs.end())] {
        const std::optional<std::string> error = target_outputs(outs);
        return execute_now(views, comm, error, false);
      });
}

ExecStats UnshardPlan::execute(std::span<const TensorView> shards, Communicator& comm,
                               std::span<const TensorView> outputs,
                               std::span<const TensorView> scales) {
  if (!quantized_) {
    if (!scales.empty()) {
      refuse(comm, "UnshardPlan::execute: scales given to a plan that quantizes nothing");
    }
    return execute(shards, comm, outputs);
  }
  if (const std::optional<std::string> wrong = shards_error(shards)) {
    refuse(comm, "UnshardPlan::execute: " + *wrong);
  }
  // A rank that receives nothing passes whatever it likes, untouched, as for a plain plan.
  const std::span<const TensorView> none;
  return quantized_->execute(real_rows(shards), comm, receives() ? outputs : none,
                             receives() ? scales : none);
}

Work<ExecStats> UnshardPlan::start(std::span<const TensorView> shards, Communicator& comm,
                                   std::span<const TensorView> outputs,
                                   std::span<const TensorView> scales) {
  if (!quantized_) {
    if (!scales.empty()) {
      refuse(comm, "UnshardPlan::start: scales given to a plan that quantizes nothing");
    }
    return start(shards, comm, outputs);
  }
  if (const std::optional<std::string> wrong = shards_error(shards)) {
    refuse(comm, "UnshardPlan::start: " + *wrong);
  }
  const std::span<const TensorView> none;
  return quantized_->start(real_rows(shards), comm, receives() ? outputs : none,
                           receives() ? scales : none);
}

ExecStats UnshardPlan::execute_now(std::span<const TensorView> shards, Communicator& comm,
                                   const std::optional<std::string>& output_error,
                                   bool one_buffer) {
  detail::Call call(comm, Operation::kUnshardExecute, options_.stage, options_.timeout,
                    options_.preflight, &scratch_.get().headers);
  return run(call, shards, output_error, one_buffer);
}

void UnshardPlan::check_shards(const Communicator& comm, std::span<const TensorView> shards,
                               bool one_buffer, ExecStats& stats) {
  detail::ExecScratch& x = scratch_.get();
  const std::size_t n = specs_.size();
  detail::check_plan_world(comm, world_, rank_);
  if (const std::optional<std::string> wrong = shards_error(shards)) {
    throw InvalidArgument(*wrong);
  }
  x.device = detail::call_device(shards);
  check_output_device();
  // Aliasing: against the one output buffer (O(n)), or across every extent, shards read and
  // outputs written (sorted, O(n log n)).
  const auto out_begin =
      reinterpret_cast<std::uintptr_t>(x.outputs.empty() ? nullptr : x.outputs[0]);
  const std::uintptr_t out_end = out_begin + output_bytes_;
  std::uint64_t staged = 0;
  x.extents.clear();
  for (std::size_t i = 0; i < n; ++i) {
    const ShardSpec& s = specs_[i];
    const TensorView& t = shards[i];
    detail::check_tensor_matches(t, i, s.dtype, t.shape, local_bytes_[i]);
    detail::check_device(t, i, x.device, "shard");
    if (!is_contiguous(t)) {
      staged += local_bytes_[i];
    }
    const detail::Extent e = detail::extent_of(t, local_bytes_[i]);
    if (!receives()) {
      continue;  // nothing is written on this rank
    }
    if (one_buffer) {
      if (e.begin < e.end && e.begin < out_end && out_begin < e.end) {
        throw InvalidArgument("tensor " + std::to_string(i) +
                              ": aliasing: the shard overlaps the output (in-place unshard is "
                              "not supported; keep shards and full tensors apart)");
      }
      continue;
    }
    const auto o = reinterpret_cast<std::uintptr_t>(x.outputs[i]);
    x.extents.push_back({e, false});
    x.extents.push_back({{o, o + checked_nbytes(s.dtype, s.full_shape)}, true});
  }
  detail::check_no_overlap(x.extents);
  if (x.device.type == DeviceType::kCpu && x.staging.size() < staged) {
    x.staging.resize(staged);
  }
  stats.staged_bytes = staged;
}

std::optional<std::string> UnshardPlan::shards_error(std::span<const TensorView> shards) const {
  const std::size_t n = specs_.size();
  if (shards.size() != n) {
    return "the plan has " + std::to_string(n) + " parameters, got " +
           std::to_string(shards.size()) + " shards";
  }
  const auto me = static_cast<std::size_t>(rank_);
  for (std::size_t i = 0; i < n; ++i) {
    const ShardSpec& s = specs_[i];
    const TensorView& t = shards[i];
    if (t.dtype != s.dtype || t.shape.size() != s.full_shape.size()) {
      return "tensor " + std::to_string(i) + ": expected a " + std::string(dtype_name(s.dtype)) +
             " shard of rank " + std::to_string(s.full_shape.size()) + ", got " +
             std::string(dtype_name(t.dtype)) + " " + detail::shape_str(t.shape);
    }
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      const std::int64_t want = d != static_cast<std::size_t>(s.shard_dim) ? s.full_shape[d]
                                : s.padded_size != 0                       ? s.padded_size
                                                                           : s.sizes[me];
      if (t.shape[d] != want) {
        return "tensor " + std::to_string(i) + ": shard shape " + detail::shape_str(t.shape) +
               ", rank " + std::to_string(rank_) + " should pass dim " + std::to_string(d) + " = " +
               std::to_string(want) + " (full " + detail::shape_str(s.full_shape) + ", shard dim " +
               std::to_string(s.shard_dim) + ")";
      }
    }
  }
  return std::nullopt;
}

void UnshardPlan::check_output_device() {
  const detail::ExecScratch& x = scratch_.get();
  if (!receives() || x.outputs.empty()) {
    return;
  }
  const Device claimed = x.output_device.value_or(x.device);
  if (claimed != x.device) {
    throw InvalidArgument("the outputs are on " + device_name(claimed) + ", the shards on " +
                          device_name(x.device) + " (a call's tensors are on one device)");
  }
  // A host pointer where device memory is expected would fault the copy kernel: check where the
  // outputs really are (only on a device call: a host call never touches the CUDA runtime). One
  // buffer is checked at its base; output views one by one.
  if (x.device.type == DeviceType::kCpu || output_bytes_ == 0) {
    return;
  }
  const std::size_t checked = x.output_device ? x.outputs.size() : 1;
  for (std::size_t i = 0; i < checked; ++i) {
    if (x.outputs[i] != nullptr && detail::device_of(x.outputs[i]) != x.device) {
      throw InvalidArgument("output " + std::to_string(i) + " is on " +
                            device_name(detail::device_of(x.outputs[i])) + ", the shards on " +
                            device_name(x.device));
    }
  }
}

void UnshardPlan::build_job(std::span<const TensorView> shards, detail::Stager& stager) {
  detail::ExecScratch& x = scratch_.get();
  const std::size_t n = specs_.size();
  const auto world = static_cast<std::size_t>(world_);
  const auto me = static_cast<std::size_t>(rank_);
  x.segments.clear();
  x.send_first.clear();
  for (std::size_t i = 0; i < n; ++i) {
    x.send_first.push_back(x.segments.size());
    const ShardSpec& s = specs_[i];
    const auto real = static_cast<std::uint64_t>(s.sizes[me]);
    const auto local = static_cast<std::uint64_t>(s.padded_size != 0 ? s.padded_size : s.sizes[me]);
    const std::uint64_t bytes = part_bytes_[me * n + i];
    if (bytes == 0) {
      continue;
    }
    if (real == local) {
      detail::append_tensor(shards[i], bytes, false, stager, x.segments);
      continue;
    }
    // Padded: the real rows of every outer index, from the shard (packed first if strided).
    const Split split = split_of(s);
    const auto* base = static_cast<const std::byte*>(shards[i].data);
    if (!is_contiguous(shards[i])) {
      base = stager.stage(shards[i], split.outer * local * split.inner_bytes);
    }
    for (std::uint64_t o = 0; o < split.outer; ++o) {
      x.segments.push_back({base + o * local * split.inner_bytes, real * split.inner_bytes});
    }
  }
  x.send_first.push_back(x.segments.size());
  for (std::size_t k = 0; k < world * n; ++k) {
    const RecvPiece& p = part_pieces_[k];
    std::byte* full = x.outputs[k % n];  // null where this rank does not receive
    x.pieces[k] =
        RecvPiece{full == nullptr ? nullptr : full + part_offsets_[k], p.block, p.count, p.stride};
    x.part_bytes[k] = part_bytes_[k];
    x.part_first[k] = k;
  }
  for (std::size_t r = 0; r <= world; ++r) {
    x.first[r] = r * n;
  }
  x.part_first[world * n] = world * n;
}

ExecStats UnshardPlan::run(detail::Call& call, std::span<const TensorView> shards,
                           const std::optional<std::string>& output_error, bool one_buffer) {
  const detail::PlanFacts facts{
      .options = options_,
      // A gather to one rank is kDirect's (the constructor refused any other request).
      .shape = dst_ >= 0 ? detail::ExchangeShape::kGather : detail::ExchangeShape::kAllGather,
      .world = world_,
      .rank = rank_,
      .root = dst_,
      .tensors = specs_.size(),
      .counts = counts_,
      .fingerprint = fingerprint_,
      .dtypes = dtypes_,
      .dtype_hash = dtype_hash_};
  const auto check = [&](ExecStats& stats) {
    if (output_error) {
      throw InvalidArgument(*output_error);
    }
    if (dst_ >= 0 && world_ > 1 && !call.comm().capabilities().gather_v) {
      throw InvalidArgument("a gather to one rank (dst " + std::to_string(dst_) + ") needs an " +
                            "exact gather-v, which the " + std::string(call.comm().backend_name()) +
                            " transport lacks");
    }
    check_shards(call.comm(), shards, one_buffer, stats);
  };
  const auto bind = [&](detail::Stager& stager) {
    build_job(shards, stager);
    const detail::ExecScratch& x = scratch_.get();
    return detail::ExchangeJob{.send = x.segments,
                               .pieces = x.pieces,
                               .first = x.first,
                               .parts = {.count = specs_.size(),
                                         .bytes = x.part_bytes,
                                         .first = x.part_first,
                                         .send_first = x.send_first}};
  };
  ExecStats stats;
  const detail::ExchangeJob job =
      detail::prepare_execution(call, scratch_, facts, std::nullopt, stats, check, bind);
  detail::run_execution(call, scratch_, facts, job, stats);
  return stats;
}

namespace detail {

ExecStats PlanAccess::run(UnshardPlan& plan, Call& call, std::span<const TensorView> shards,
                          std::byte* out, std::uint64_t out_size) {
  const std::optional<std::string> error = plan.target_buffer(out, out_size);
  return plan.run(call, shards, error, true);
}

ExecStats PlanAccess::execute(UnshardPlan& plan, Communicator& comm,
                              std::span<const TensorView> shards, std::span<std::byte> out,
                              LentScratch& lent) {
  const std::optional<std::string> error = plan.target_buffer(out.data(), out.size());
  ExecScratch& x = plan.scratch_.get();
  lend(lent, x);
  // A throw leaves the memory with the plan's scratch (LentScratch says why).
  const ExecStats stats = plan.execute_now(shards, comm, error, true);
  lend(lent, x);
  return stats;
}

ExecStats PlanAccess::execute(UnshardPlan& plan, Communicator& comm,
                              std::span<const TensorView> shards,
                              std::span<const TensorView> outputs,
                              std::span<const TensorView> scales, LentScratch& lent) {
  const std::span<const TensorView> none;
  const std::optional<Device> device =
      shards.empty() ? std::nullopt : std::optional<Device>(shards.front().device);
  ExecScratch& x = plan.quantized_->scratch_.get();
  lend(lent, x);
  // A throw leaves the memory with the plan's scratch (LentScratch says why).
  const ExecStats stats =
      plan.quantized_->execute_now(plan.real_rows(shards), comm, plan.receives() ? outputs : none,
                                   plan.receives() ? scales : none, device);
  lend(lent, x);
  return stats;
}

}  // namespace detail
}  // namespace shardgather
