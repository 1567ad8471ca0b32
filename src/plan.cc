// AllGatherPlan: the steady-state path. Construction does every allocation and every
// computation that depends only on shapes; execute() validates, optionally checks the header,
// builds the send list and destination pieces into reused scratch, and runs one strategy.
#include "shardgather/plan.h"

#include <algorithm>
#include <mutex>
#include <string>

#include "detail/exec_scratch.h"
#include "detail/local_input.h"
#include "detail/parallel.h"
#include "detail/plan_common.h"
#include "detail/send_stream.h"
#include "preflight.h"
#include "records.h"

#include "shardgather/copy.h"
#include "shardgather/errors.h"

namespace shardgather {

namespace detail {

ScratchHolder::ScratchHolder() = default;
ScratchHolder::~ScratchHolder() = default;
ScratchHolder::ScratchHolder(const ScratchHolder& /*other*/) {}
ScratchHolder& ScratchHolder::operator=(const ScratchHolder& /*other*/) { return *this; }
ScratchHolder::ScratchHolder(ScratchHolder&& other) noexcept = default;
ScratchHolder& ScratchHolder::operator=(ScratchHolder&& other) noexcept = default;
ExecScratch& ScratchHolder::get() {
  if (!scratch_) {
    scratch_ = std::make_unique<ExecScratch>();
  }
  return *scratch_;
}

void size_scratch(ExecScratch& x, int world, std::size_t n) {
  const auto w = static_cast<std::size_t>(world);
  if (x.first.size() == w + 1 && x.pieces.size() == w * n) {
    return;
  }
  x.segments.reserve(2 * n + 1);
  x.send_first.reserve(n + 1);
  x.pieces.resize(w * n);
  x.first.resize(w + 1);
  x.part_first.resize(w * n + 1);
  x.part_bytes.resize(w * n);
  x.counts.resize(w);
  x.header_bytes.resize(w * sizeof(PreflightHeader));
  x.headers.resize(w);
  x.strategy.displs.reserve(w);
  x.strategy.counts.reserve(w);
  x.strategy.first.reserve(w + 1);
  x.strategy.pieces.reserve(w);
}

std::string rank_prefix(int rank) { return "rank " + std::to_string(rank) + ": "; }

namespace {

// Buffers a failed collective may still touch. Kept reachable (never freed) so leak checkers
// see them as intentional.
struct Graveyard {
  std::mutex mu;
  std::vector<AlignedBuffer> aligned;
  std::vector<std::vector<std::byte>> vectors;
  std::vector<std::unique_ptr<ExecScratch>> scratch;
};

Graveyard& graveyard() {
  static auto* g = new Graveyard;  // never destroyed: outlives any late write
  return *g;
}

}  // namespace

void leak(AlignedBuffer& buffer) noexcept {
  try {
    const std::lock_guard<std::mutex> lock(graveyard().mu);
    graveyard().aligned.push_back(std::move(buffer));
  } catch (...) {
    static_cast<void>(new (std::nothrow) AlignedBuffer(std::move(buffer)));
  }
}

void leak(std::vector<std::byte>& buffer) noexcept {
  try {
    const std::lock_guard<std::mutex> lock(graveyard().mu);
    graveyard().vectors.push_back(std::move(buffer));
  } catch (...) {
    static_cast<void>(new (std::nothrow) std::vector<std::byte>(std::move(buffer)));
  }
}

std::vector<std::byte> gather_or_leak(Communicator& comm, std::span<const std::byte> mine,
                                      Deadline deadline) {
  std::vector<std::byte> all(mine.size() * static_cast<std::size_t>(comm.size()));
  try {
    comm.all_gather(mine, all, deadline);
  } catch (const CommunicationError&) {
    leak(all);  // a posted collective may still write it
    throw;
  }
  return all;
}

void ScratchHolder::leak() noexcept {
  if (!scratch_) {
    return;
  }
  try {
    const std::lock_guard<std::mutex> lock(graveyard().mu);
    graveyard().scratch.push_back(std::move(scratch_));
  } catch (...) {
    static_cast<void>(scratch_.release());
  }
}

void exchange_plan_header(Communicator& comm, const PreflightHeader& header, ScratchHolder& scratch,
                          Deadline deadline) {
  ExecScratch& x = scratch.get();
  try {
    exchange_headers(comm, header, x.header_bytes, x.headers, deadline);
  } catch (const CommunicationError&) {
    scratch.leak();
    throw;
  }
}

void run_payload(Strategy requested, const GatherJob& job, Communicator& comm, Deadline deadline,
                 ScratchHolder& scratch, ExecStats& stats) {
  ExecScratch& x = scratch.get();
  stats.strategy = select_strategy(requested, job, comm, x.strategy.shared_unavailable);
  if (comm.size() == 1) {
    copy_stream(job.send, job.pieces);
    return;
  }
  if (std::all_of(job.counts.begin(), job.counts.end(), [](std::uint64_t c) { return c == 0; })) {
    return;
  }
  const std::uint64_t before = comm.collectives_issued();
  const std::uint64_t setup_before = x.strategy.setup_collectives;
  const auto run = [&] {
    try {
      run_strategy(stats.strategy, job, comm, deadline, x.strategy);
    } catch (const CommunicationError&) {
      scratch.leak();  // staging and windows may still be read by a posted collective
      throw;
    }
  };
  try {
    run();
  } catch (const OutOfMemory&) {
    // kAuto chose the node-shared window and it could not be reserved (a small /dev/shm, as in
    // a container): SharedBuffer::create raises that on every rank alike, after its collectives
    // completed, so every rank takes the transport path instead, now and for every later
    // execution (select_strategy reads shared_unavailable). An explicit kShared keeps the error.
    if (requested != Strategy::kAuto || stats.strategy != Strategy::kShared || x.strategy.window) {
      throw;
    }
    x.strategy.shared_unavailable = true;
    stats.strategy = select_strategy(requested, job, comm, true);
    run();
  }
  stats.setup_collectives = x.strategy.setup_collectives - setup_before;
  stats.payload_collectives = comm.collectives_issued() - before - stats.setup_collectives;
}

void raise_through_header(Communicator& comm, const Error& error, bool exchange,
                          Deadline deadline) {
  if (!exchange) {
    throw_error(error.code(), rank_prefix(comm.rank()) + error.what());
  }
  PreflightHeader header;
  header.world_size = static_cast<std::uint32_t>(comm.size());
  header.seq = comm.next_op_seq();
  set_status(header, error.code(), error.what());
  std::vector<std::byte> gathered(sizeof header * static_cast<std::size_t>(comm.size()));
  std::vector<PreflightHeader> decoded(static_cast<std::size_t>(comm.size()));
  try {
    exchange_headers(comm, header, gathered, decoded, deadline);
  } catch (const CommunicationError&) {
    leak(gathered);
    throw;
  }
  throw Error(ErrorCode::kCommunicationError, "unreachable: a failed status always raises");
}

}  // namespace detail

namespace {

using detail::ExecScratch;

void check_world(const Communicator& comm, int world, int rank) {
  if (comm.size() != world || comm.rank() != rank) {
    throw InvalidArgument("the plan was built for rank " + std::to_string(rank) + " of " +
                          std::to_string(world) + ", the communicator is rank " +
                          std::to_string(comm.rank()) + " of " + std::to_string(comm.size()));
  }
}

}  // namespace

AllGatherPlan::AllGatherPlan(std::span<const DType> dtypes,
                             std::span<const std::vector<Shape>> shapes_across_group, int rank,
                             const PlanOptions& options)
    : rank_(rank), options_(options) {
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
}

AllGatherPlan AllGatherPlan::create(std::span<const TensorView> params, Communicator& comm,
                                    std::span<const std::vector<Shape>> shapes_across_group,
                                    const PlanOptions& options) {
  const int rank = comm.rank();
  const int world = comm.size();
  const Deadline deadline = comm.deadline_after(options.timeout.value_or(comm.timeout()));
  const bool has_hint = !shapes_across_group.empty();
  const bool exchange = world > 1 && (options.preflight || !has_hint);

  detail::PreflightHeader header;
  header.world_size = static_cast<std::uint32_t>(world);
  header.seq = comm.next_op_seq();
  header.flags = has_hint ? detail::kHasHint : 0U;
  detail::LocalInput in;
  std::vector<Shape> flat;
  std::vector<std::byte> records;
  try {
    in = detail::validate_params(params);
    detail::set_dtypes(header, in.dtypes);
    if (has_hint) {
      flat = detail::check_hint(shapes_across_group, in, rank, world);
      header.hint_hash = detail::hash_hint(flat, world);
    } else {
      records.resize(record_bytes(in.shapes));
      detail::encode_records(in.shapes, records.data());
      header.payload_bytes = records.size();
    }
  } catch (const Error& e) {
    if (!exchange) {
      throw_error(e.code(), detail::rank_prefix(rank) + e.what());
    }
    detail::set_status(header, e.code(), e.what());
  }
  std::vector<detail::PreflightHeader> headers(static_cast<std::size_t>(world));
  if (exchange) {
    std::vector<std::byte> gathered(sizeof header * static_cast<std::size_t>(world));
    try {
      detail::exchange_headers(comm, header, gathered, headers, deadline);
    } catch (const CommunicationError&) {
      detail::leak(gathered);
      throw;
    }
  }
  if (has_hint) {
    return {in.dtypes, shapes_across_group, rank, options};
  }
  if (world == 1) {
    const std::vector<Shape> row = in.shapes;
    return {in.dtypes, std::span(&row, 1), rank, options};
  }
  // Without a hint: the header said how many record bytes each rank has; gather them.
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(world));
  std::vector<std::uint64_t> displs(counts.size());
  for (std::size_t r = 0; r < counts.size(); ++r) {
    counts[r] = headers[r].payload_bytes;
  }
  std::vector<std::byte> all(place_blocks(counts, 1, displs));
  const ConstSegment mine{records.data(), records.size()};
  comm.all_gather_v(std::span(&mine, records.empty() ? 0 : 1), all.data(), counts, displs,
                    deadline);
  std::vector<std::vector<Shape>> shapes;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    shapes.push_back(detail::decode_records(std::span(all).subspan(displs[r], counts[r]),
                                            in.dtypes.size(), static_cast<int>(r)));
  }
  return {in.dtypes, shapes, rank, options};
}

std::vector<TensorView> AllGatherPlan::views(const std::byte* buffer) const {
  const auto world = static_cast<std::size_t>(layout_.world_size);
  std::vector<TensorView> out(layout_.num_tensors * world);
  for (std::size_t i = 0; i < layout_.num_tensors; ++i) {
    for (std::size_t r = 0; r < world; ++r) {
      const std::size_t k = layout_.index(static_cast<int>(r), i);
      out[i * world + r] = TensorView{.data = const_cast<std::byte*>(buffer) + layout_.offsets[k],
                                      .dtype = layout_.dtypes[i],
                                      .shape = layout_.shapes[k],
                                      .strides = {}};
    }
  }
  return out;
}

void AllGatherPlan::prepare(std::span<const TensorView> params, Communicator& comm, std::byte* out,
                            std::uint64_t out_size, ExecStats& stats, Deadline deadline) {
  ExecScratch& x = scratch_.get();
  const int world = layout_.world_size;
  const std::size_t n = layout_.num_tensors;
  detail::size_scratch(x, world, n);
  const auto me = static_cast<std::size_t>(rank_);
  const bool exchange = world > 1 && options_.preflight;

  detail::PreflightHeader header;
  header.world_size = static_cast<std::uint32_t>(world);
  header.seq = comm.next_op_seq();
  header.flags = detail::kHasHint;
  header.hint_hash = fingerprint_;
  header.payload_bytes = layout_.counts[me];
  detail::set_dtypes(header, layout_.dtypes, dtype_hash_);
  const auto in_place = [&](std::size_t i) {
    return out != nullptr && params[i].data == out + layout_.offsets[me * n + i];
  };
  std::uint64_t staged = 0;
  try {
    check_world(comm, world, rank_);
    if (params.size() != n) {
      throw InvalidArgument("the plan has " + std::to_string(n) + " tensors, got " +
                            std::to_string(params.size()));
    }
    if (out_size < layout_.total_bytes) {
      throw InvalidArgument("the output holds " + std::to_string(out_size) +
                            " bytes, the plan needs " + std::to_string(layout_.total_bytes));
    }
    const auto out_begin = reinterpret_cast<std::uintptr_t>(out);
    const std::uintptr_t out_end = out == nullptr ? 0 : out_begin + layout_.total_bytes;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t k = me * n + i;
      detail::check_tensor_matches(params[i], i, layout_.dtypes[i], layout_.shapes[k],
                                   layout_.sizes[k]);
      const bool contiguous = is_contiguous(params[i]);
      const detail::Extent e = detail::extent_of(params[i], layout_.sizes[k]);
      const bool overlaps = e.begin < out_end && out_begin < e.end;
      if (overlaps && !(in_place(i) && contiguous)) {
        throw InvalidArgument("tensor " + std::to_string(i) +
                              ": aliasing: the input overlaps the output outside its own slot");
      }
      if (overlaps || !contiguous) {
        staged += layout_.sizes[k];
      }
    }
    if (x.staging.size() < staged) {
      x.staging.resize(staged);  // once: later executions reuse it
    }
  } catch (const Error& e) {
    if (!exchange) {
      throw_error(e.code(), detail::rank_prefix(rank_) + e.what());
    }
    detail::set_status(header, e.code(), e.what());
  } catch (const std::bad_alloc&) {
    if (!exchange) {
      throw OutOfMemory(detail::rank_prefix(rank_) + "staging allocation failed");
    }
    detail::set_status(header, ErrorCode::kOutOfMemory, "staging allocation failed");
  }
  if (exchange) {
    detail::exchange_plan_header(comm, header, scratch_, deadline);
    stats.preflight_collectives = 1;
  }

  // This rank's stream: gaps and tensors, in place or staged.
  detail::append_block(
      params, std::span(layout_.offsets).subspan(me * n, n), layout_.displs[me],
      std::span(layout_.sizes).subspan(me * n, n), {}, x.staging.data(),
      [&](std::size_t i) { return in_place(i); }, x.segments, x.send_first);
  stats.staged_bytes = staged;
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
}

namespace {

detail::GatherJob make_job(const LayoutPlan& layout, ExecScratch& x, const PlanOptions& options,
                           const Communicator& comm) {
  return detail::GatherJob{
      .send = x.segments,
      .pieces = x.pieces,
      .first = x.first,
      .counts = layout.counts,
      .num_tensors = layout.num_tensors,
      .part_bytes = x.part_bytes,
      .part_first = x.part_first,
      .send_first = x.send_first,
      .copy_threads = options.copy_threads > 0 ? options.copy_threads
                                               : detail::default_copy_threads(comm.ranks_on_host()),
      .stream_displs = layout.displs,
      .entry_synchronized = options.preflight,
  };
}

}  // namespace

ExecStats AllGatherPlan::execute(std::span<const TensorView> params, Communicator& comm,
                                 std::span<std::byte> out) {
  const Deadline deadline = comm.deadline_after(options_.timeout.value_or(comm.timeout()));
  ExecStats stats;
  prepare(params, comm, out.data(), out.size(), stats, deadline);
  ExecScratch& x = scratch_.get();
  const detail::GatherJob job = make_job(layout_, x, options_, comm);
  detail::run_payload(options_.strategy, job, comm, deadline, scratch_, stats);
  return stats;
}

std::span<const std::byte> AllGatherPlan::execute_shared(std::span<const TensorView> params,
                                                         Communicator& comm, ExecStats* stats) {
  ExecScratch& x = scratch_.get();
  ExecStats local;
  ExecStats& st = stats != nullptr ? *stats : local;
  if (!detail::shared_available(comm) || layout_.total_bytes == 0) {
    x.owned.resize(layout_.total_bytes);
    st = execute(params, comm, x.owned);
    return x.owned;
  }
  const Deadline deadline = comm.deadline_after(options_.timeout.value_or(comm.timeout()));
  st = ExecStats{};
  prepare(params, comm, nullptr, layout_.total_bytes, st, deadline);
  const detail::GatherJob job = make_job(layout_, x, options_, comm);
  st.strategy = Strategy::kShared;
  const std::uint64_t before = comm.collectives_issued();
  const std::uint64_t setup_before = x.strategy.setup_collectives;
  const std::byte* base = nullptr;
  try {
    base = detail::shared_copy_in(job, comm, deadline, x.strategy);
  } catch (const CommunicationError&) {
    scratch_.leak();
    throw;
  }
  st.setup_collectives = x.strategy.setup_collectives - setup_before;
  st.payload_collectives = comm.collectives_issued() - before - st.setup_collectives;
  return {base, layout_.total_bytes};
}

}  // namespace shardgather
