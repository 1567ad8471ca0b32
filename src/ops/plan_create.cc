// AllGatherPlan::create: a plan from this rank's tensors. With a hint nothing but the header
// travels; without one the header says how many record bytes each rank has, and one exchange
// of the shape records follows.
#include <optional>
#include <string>

#include "copies/local_input.h"
#include "ops/call.h"
#include "ops/payload.h"
#include "ops/records.h"
#include "ops/start.h"

#include "shardgather/errors.h"
#include "shardgather/layout.h"
#include "shardgather/plan.h"

namespace shardgather {

namespace {

// Every rank's records, gathered after the header said how many bytes each has.
std::vector<std::vector<Shape>> gather_shapes(detail::Call& call,
                                              std::span<const detail::PreflightHeader> headers,
                                              std::vector<std::byte>& records,
                                              std::size_t num_tensors) {
  Communicator& comm = call.comm();
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(comm.size()));
  std::vector<std::uint64_t> displs(counts.size());
  for (std::size_t r = 0; r < counts.size(); ++r) {
    counts[r] = headers[r].payload_bytes;
  }
  std::vector<std::byte> all(place_blocks(counts, 1, displs));
  call.guard(records);
  call.guard(all);
  const ConstSegment mine{records.data(), records.size()};
  const std::span<const ConstSegment> send(&mine, records.empty() ? 0 : 1);
  detail::BlockJob blocks(send, all.data(), counts, displs, true);
  call.guard(blocks.scratch);
  ExecStats stats;
  const Strategy strategy = detail::select_strategy(
      Strategy::kDirect, detail::ExchangeShape::kAllGather, counts, comm, false);
  detail::run_payload(call, Strategy::kDirect, strategy, blocks.job, blocks.scratch, stats);
  std::vector<std::vector<Shape>> shapes;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    shapes.push_back(detail::decode_records(std::span(all).subspan(displs[r], counts[r]),
                                            num_tensors, static_cast<int>(r)));
  }
  return shapes;
}

AllGatherPlan create_now(std::span<const TensorView> params, Communicator& comm,
                         std::span<const std::vector<Shape>> hint, const PlanOptions& options) {
  const bool has_hint = !hint.empty();
  detail::Call call(comm, Operation::kPlanCreate, options.stage, options.timeout,
                    options.preflight || !has_hint);
  detail::PreflightHeader& header = call.header();
  header.flags = has_hint ? detail::kHasHint : 0U;
  detail::set_strategy(header, options.strategy);
  detail::LocalInput in;
  std::vector<std::byte> records;
  std::optional<AllGatherPlan> plan;
  call.check([&] {
    in = detail::validate_params(params);
    detail::set_dtypes(header, in.dtypes);
    if (has_hint) {
      const std::vector<Shape> flat = detail::check_hint(hint, in, comm.rank(), comm.size());
      header.hint_hash = detail::hash_hint(flat, comm.size());
      plan.emplace(in.dtypes, hint, comm.rank(), options);
    } else if (comm.size() == 1) {
      plan.emplace(in.dtypes, std::span(&in.shapes, 1), comm.rank(), options);
    } else {
      detail::check_record_dims(in.shapes);
      records.resize(record_bytes(in.shapes));
      detail::encode_records(in.shapes, records.data());
      header.payload_bytes = records.size();
    }
  });
  const std::span<const detail::PreflightHeader> headers = call.agree();
  if (plan) {
    return std::move(*plan);
  }
  return {in.dtypes, gather_shapes(call, headers, records, in.dtypes.size()), comm.rank(), options};
}

}  // namespace

AllGatherPlan AllGatherPlan::create(std::span<const TensorView> params, Communicator& comm,
                                    std::span<const std::vector<Shape>> shapes_across_group,
                                    const PlanOptions& options) {
  return detail::run_blocking(
      comm, [&] { return create_now(params, comm, shapes_across_group, options); });
}

}  // namespace shardgather
