// unshard(): an UnshardPlan built from the specs and executed once into a fresh buffer, in one
// call (one header covers the specs' checks and the shards').
#include "shardgather/unshard.h"

#include <algorithm>
#include <string>

#include "copies/local_input.h"
#include "ops/call.h"
#include "ops/payload.h"
#include "ops/plan_access.h"
#include "ops/start.h"

#include "shardgather/errors.h"

namespace shardgather {

namespace {

UnshardResult unshard_now(std::span<const TensorView> shards, Communicator& comm,
                          std::span<const ShardSpec> specs, const PlanOptions& options) {
  detail::Call call(comm, Operation::kUnshard, options.stage, options.timeout, options.preflight);
  PlanOptions one_shot = options;
  one_shot.strategy = detail::one_shot_strategy(options.strategy);
  UnshardPlan plan;
  AlignedBuffer buffer;
  call.check([&] {
    plan = UnshardPlan(specs, comm.size(), comm.rank(), one_shot);
    // A gather to one rank (options.dst): the others only send, and get no tensors back.
    buffer = detail::output_buffer(plan.receives() ? plan.output_bytes() : 0,
                                   detail::call_device(shards));
  });
  call.guard(buffer);
  const ExecStats stats = detail::PlanAccess::run(plan, call, shards, buffer.data(), buffer.size());
  std::vector<TensorView> views;
  if (plan.receives()) {
    views = plan.views(buffer.data());
  }
  for (TensorView& view : views) {
    view.device = buffer.device();
  }
  return {std::move(views), std::move(buffer), stats};
}

}  // namespace

std::vector<std::int64_t> chunk_sizes(std::int64_t full, int world_size) {
  if (world_size < 1 || full < 0) {
    throw InvalidArgument("chunk_sizes: " + std::to_string(full) + " over " +
                          std::to_string(world_size) + " ranks");
  }
  // ceil(full / world) without full + world - 1, which overflows near INT64_MAX (found by Z4).
  const std::int64_t chunk = full / world_size + (full % world_size != 0 ? 1 : 0);
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(world_size));
  std::int64_t left = full;
  for (auto& size : sizes) {
    size = std::min(chunk, left);
    left -= size;
  }
  return sizes;
}

UnshardResult unshard(std::span<const TensorView> shards, Communicator& comm,
                      std::span<const ShardSpec> specs, const PlanOptions& options) {
  return detail::run_blocking(comm, [&] { return unshard_now(shards, comm, specs, options); });
}

Work<UnshardResult> start_unshard(std::span<const TensorView> shards, Communicator& comm,
                                  std::span<const ShardSpec> specs, const PlanOptions& options) {
  return detail::start_on<UnshardResult>(
      comm, [&comm, views = std::vector<TensorView>(shards.begin(), shards.end()),
             copied = std::vector<ShardSpec>(specs.begin(), specs.end()),
             options] { return unshard_now(views, comm, copied, options); });
}

}  // namespace shardgather
