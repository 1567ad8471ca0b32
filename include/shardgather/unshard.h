// unshard: every rank holds, per parameter, a shard along a shard dim; the result is the full
// parameters, param-major, in caller memory or memory the library owns.
//
// Shards are torch.chunk-style by default (ceil(full / world) along the shard dim per rank, the
// last ranks smaller or empty) or have explicit per-rank sizes. A shard may be padded to the
// same size on every rank (as FSDP does): only its real part goes on the wire.
// Bytes are received straight into the full tensors (no temporary full copy); for a single
// dim-0 parameter the gathered bytes *are* the full tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardgather/communicator.h"
#include "shardgather/export.h"
#include "shardgather/foreach_all_gather.h"
#include "shardgather/plan.h"
#include "shardgather/quantize.h"
#include "shardgather/reshard.h"
#include "shardgather/types.h"
#include "shardgather/work.h"

namespace shardgather {

struct ShardSpec {
  DType dtype = DType::kFloat32;
  Shape full_shape;
  int shard_dim = 0;
  // Per-rank sizes along shard_dim (must sum to full_shape[shard_dim]); empty: torch.chunk.
  std::vector<std::int64_t> sizes;
  // Every rank's local shard has padded_size rows along shard_dim (>= its real size); 0: not
  // padded. FSDP pads to ceil(full / world).
  std::int64_t padded_size = 0;
};

// torch.chunk sizes of `full` over `world` ranks: ceil(full / world) each, the last smaller or 0.
SHARDGATHER_API std::vector<std::int64_t> chunk_sizes(std::int64_t full, int world_size);

class SHARDGATHER_API UnshardPlan {
 public:
  UnshardPlan() = default;
  // Pure: checks every spec (InvalidArgument names the parameter and the values).
  // options.dst >= 0: only rank dst receives the full parameters (a gather to one rank, as for a
  // checkpoint export); the others only send, and their executions take no outputs (pass an
  // empty buffer or list; whatever is passed is not touched). Only kAuto and kDirect can gather
  // to one rank. The trailing `dst` is the same setting given apart (kept for existing callers):
  // InvalidArgument when both are set and differ.
  //
  // `quantize`: empty, or one format per spec (QuantFormat::kNone: that parameter travels as
  // it is). A plan that quantizes a parameter moves it as FP8 on the wire, quantized on send and
  // bit-identical to quantizing the full tensor (docs/quantization.md): the plan holds a
  // quantized ReshardPlan from every rank's real rows to the full tensors (planned here, once),
  // and each execution is one call of it. Its executions take `outputs` and `scales`
  // (execute's last overloads): InvalidArgument for a format that cannot quantize a spec's
  // tensor or a shard dim a block cannot split, naming the parameter.
  UnshardPlan(std::span<const ShardSpec> specs, int world_size, int rank,
              const PlanOptions& options = {}, int dst = -1,
              std::span<const QuantFormat> quantize = {});
  // The same, with the communicator's size and rank (every plan is built from a communicator by
  // its for_communicator). Pure: nothing is exchanged.
  static UnshardPlan for_communicator(std::span<const ShardSpec> specs, const Communicator& comm,
                                      const PlanOptions& options = {});

  [[nodiscard]] std::size_t size() const noexcept { return specs_.size(); }
  [[nodiscard]] int world_size() const noexcept { return world_; }
  [[nodiscard]] int dst() const noexcept { return dst_; }
  // A hash of everything the ranks must agree on (world, specs, dst), as the header carries it.
  [[nodiscard]] std::uint64_t fingerprint() const noexcept { return fingerprint_; }
  // Whether this rank receives the full parameters (every rank unless dst is set).
  [[nodiscard]] bool receives() const noexcept { return dst_ < 0 || dst_ == rank_; }
  [[nodiscard]] const ShardSpec& spec(std::size_t i) const { return specs_.at(i); }
  // The local shard shape rank r passes for parameter i (padded if the spec is padded).
  [[nodiscard]] Shape shard_shape(int rank, std::size_t i) const;
  // One buffer holding every full parameter, param-major, each aligned to 64 bytes.
  [[nodiscard]] std::uint64_t output_bytes() const noexcept { return output_bytes_; }
  [[nodiscard]] std::uint64_t output_offset(std::size_t i) const { return output_offsets_.at(i); }
  // Views of the full parameters over such a buffer.
  [[nodiscard]] std::vector<TensorView> views(std::byte* buffer) const;
  // Whether a parameter travels quantized; then reshard() is the plan each execution runs (its
  // byte figures, transfers and last stats), else null.
  [[nodiscard]] bool quantized() const noexcept { return quantized_.has_value(); }
  [[nodiscard]] const ReshardPlan* reshard() const noexcept {
    return quantized_ ? &*quantized_ : nullptr;
  }

  // Gathers this rank's shards into the full parameters. `outputs[i]` is contiguous caller memory
  // of full_shape and dtype of parameter i; outputs must not overlap each other or any shard.
  ExecStats execute(std::span<const TensorView> shards, Communicator& comm,
                    std::span<const TensorView> outputs);
  // Same, into one buffer of output_bytes().
  ExecStats execute(std::span<const TensorView> shards, Communicator& comm,
                    std::span<std::byte> out);

  // The executions, started: they return at once and run on the communicator's progress thread
  // (work.h). The lists of views are copied; the tensors' memory, `out` and this plan stay
  // alive until the work completed.
  Work<ExecStats> start(std::span<const TensorView> shards, Communicator& comm,
                        std::span<const TensorView> outputs);
  Work<ExecStats> start(std::span<const TensorView> shards, Communicator& comm,
                        std::span<std::byte> out);

  // A quantized plan's execution (a plain plan's, with `scales` empty): `outputs[i]` receives
  // parameter i whole, a plain one as above; a quantized one as its FP8 data (a uint8 view of
  // the full shape) with `scales[i]` the scales of its every block (float32, or uint8 E8M0 for
  // mxfp8, of the format's scale shape), or, where `scales` is empty or scales[i] a default
  // view, as its values dequantized into a float32 or bfloat16 view. Padded shards travel
  // their real rows. A rank that receives nothing (dst set) may pass anything: untouched. A
  // quantized plan's executions that take one buffer raise InvalidArgument on every rank.
  ExecStats execute(std::span<const TensorView> shards, Communicator& comm,
                    std::span<const TensorView> outputs, std::span<const TensorView> scales);
  Work<ExecStats> start(std::span<const TensorView> shards, Communicator& comm,
                        std::span<const TensorView> outputs, std::span<const TensorView> scales);

 private:
  friend struct detail::PlanAccess;
  // Checks one spec, fills in its sizes and this plan's parts of it; returns its full bytes.
  std::uint64_t add_spec(std::size_t i, int world_size);
  // Points x.outputs at `out`'s parameters; the error, if any, for the call to record.
  std::optional<std::string> target_buffer(std::byte* out, std::uint64_t out_size);
  std::optional<std::string> target_outputs(std::span<const TensorView> outputs);
  ExecStats execute_now(std::span<const TensorView> shards, Communicator& comm,
                        const std::optional<std::string>& output_error, bool one_buffer);
  // This plan's part of a call: x.outputs are set; `one_buffer` when they lie in one buffer laid
  // out by this plan, so only the shards need checking against it for aliasing.
  ExecStats run(detail::Call& call, std::span<const TensorView> shards,
                const std::optional<std::string>& output_error, bool one_buffer);
  // The local checks: world, count, each shard against its spec, aliasing; sizes the staging.
  void check_shards(const Communicator& comm, std::span<const TensorView> shards, bool one_buffer,
                    ExecStats& stats);
  // This rank's stream (the real part of each shard) and every rank's destination pieces.
  // Raises unless the outputs are on the shards' device.
  void check_output_device();
  void build_job(std::span<const TensorView> shards, detail::Stager& stager);
  // Plans the quantized reshard where a format quantizes (the constructor's last step).
  void plan_quantized(std::span<const QuantFormat> quantize);
  // What is wrong with the shards' count, dtypes or shapes against the specs (the first thing),
  // in the unshard's words; nothing when they fit.
  [[nodiscard]] std::optional<std::string> shards_error(std::span<const TensorView> shards) const;
  // A quantized plan's shards as its reshard's sources: each padded shard's real rows.
  [[nodiscard]] std::vector<TensorView> real_rows(std::span<const TensorView> shards) const;
  // Fails a quantized plan's call on every rank (the peers are in its reshard's call).
  [[noreturn]] void refuse(Communicator& comm, const std::string& message) const;

  std::vector<ShardSpec> specs_;  // sizes filled in
  int world_ = 1;
  int rank_ = 0;
  int dst_ = -1;
  PlanOptions options_;
  std::uint64_t output_bytes_ = 0;
  std::vector<std::uint64_t> output_offsets_;
  std::uint64_t fingerprint_ = 0;
  // The header names a dtype that differs, not just a fingerprint (one list, hashed once).
  std::vector<DType> dtypes_;
  std::uint64_t dtype_hash_ = 0;
  // Per (rank, param), rank-major: bytes on the wire, and the destination relative to the
  // param's full tensor (offset of the first block, block bytes, blocks, stride).
  std::vector<std::uint64_t> part_bytes_;
  std::vector<RecvPiece> part_pieces_;       // data unset: see part_offsets_
  std::vector<std::uint64_t> part_offsets_;  // of each piece inside its full tensor
  std::vector<std::uint64_t> counts_;        // per rank
  std::vector<std::uint64_t> local_bytes_;   // per param: this rank's local (padded) shard
  detail::ScratchHolder scratch_;
  // A quantized plan's reshard (a copy of the plan copies it, with scratch of its own).
  std::optional<ReshardPlan> quantized_;
};

// The full parameters, owned.
class SHARDGATHER_API UnshardResult {
 public:
  UnshardResult() = default;
  UnshardResult(std::vector<TensorView> views, AlignedBuffer buffer, ExecStats stats)
      : views_(std::move(views)), buffer_(std::move(buffer)), stats_(stats) {}
  [[nodiscard]] std::size_t size() const noexcept { return views_.size(); }
  [[nodiscard]] const TensorView& operator[](std::size_t i) const { return views_.at(i); }
  [[nodiscard]] const ExecStats& stats() const noexcept { return stats_; }
  [[nodiscard]] const AlignedBuffer& buffer() const noexcept { return buffer_; }

 private:
  std::vector<TensorView> views_;
  AlignedBuffer buffer_;
  ExecStats stats_;
};

// One-shot: plan, allocate, execute. Shard shapes are checked against the specs on every rank.
// With options.dst >= 0 only rank dst gets the full parameters; the others get an empty result.
SHARDGATHER_API UnshardResult unshard(std::span<const TensorView> shards, Communicator& comm,
                                      std::span<const ShardSpec> specs,
                                      const PlanOptions& options = {});

// unshard(), started (work.h): `shards` and `specs` are copied; the shards' memory stays alive
// until the work completed.
SHARDGATHER_API Work<UnshardResult> start_unshard(std::span<const TensorView> shards,
                                                  Communicator& comm,
                                                  std::span<const ShardSpec> specs,
                                                  const PlanOptions& options = {});

}  // namespace shardgather
