#include "support/plan_cases.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "support/alloc_counter.h"
#include "support/testing.h"

namespace shardgather::testing {

namespace {

constexpr std::uint64_t kSeed = 0x9a11;
constexpr int kFullRank = 1 << 20;  // pattern "rank" of the full (unsharded) tensors

constexpr Strategy kStrategies[] = {Strategy::kAuto,   Strategy::kDirect,
                                    Strategy::kPacked, Strategy::kPerTensor,
                                    Strategy::kShared, Strategy::kHierarchical};

template <typename Error>
void expect_raises(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception class: " << e.what();
  }
}

// Shapes ([r][i]) of an uneven, mixed-dtype list.
std::vector<std::vector<Shape>> plan_shapes(int world) {
  std::vector<std::vector<Shape>> shapes;
  for (int r = 0; r < world; ++r) {
    shapes.push_back({{r + 2, 3}, {}, {(r % 2) * 5}, {7}, {2, r, 2}});
  }
  return shapes;
}
const std::vector<DType> kPlanDTypes = {DType::kFloat32, DType::kFloat64, DType::kInt8,
                                        DType::kBFloat16, DType::kInt32};

std::vector<HostTensor> plan_tensors(const std::vector<std::vector<Shape>>& shapes, int rank) {
  std::vector<HostTensor> tensors;
  for (std::size_t i = 0; i < kPlanDTypes.size(); ++i) {
    tensors.push_back(
        make_tensor(kPlanDTypes[i], shapes[static_cast<std::size_t>(rank)][i], kSeed, rank, i));
  }
  return tensors;
}

// "" when views[i * world + r] holds rank r's pattern of tensor i for every i and r.
std::string check_plan_views(const std::vector<TensorView>& views, int world,
                             std::size_t num_tensors = kPlanDTypes.size()) {
  for (std::size_t i = 0; i < num_tensors; ++i) {
    for (int r = 0; r < world; ++r) {
      const TensorView& v =
          views[i * static_cast<std::size_t>(world) + static_cast<std::size_t>(r)];
      std::vector<std::byte> expect(checked_nbytes(v.dtype, v.shape));
      fill_pattern(expect, kSeed, r, i);
      if (!expect.empty() && std::memcmp(v.data, expect.data(), expect.size()) != 0) {
        return "out[" + std::to_string(i) + "][" + std::to_string(r) + "] differs";
      }
    }
  }
  return "";
}

// The bytes of element range [row_begin, row_end) along `dim` of a full tensor, for every outer
// index, concatenated: the contents of that shard.
std::vector<std::byte> cut(const std::vector<std::byte>& full, const ShardSpec& s,
                           std::int64_t row_begin, std::int64_t rows) {
  const auto d = static_cast<std::size_t>(s.shard_dim);
  std::uint64_t outer = 1;
  for (std::size_t k = 0; k < d; ++k) {
    outer *= static_cast<std::uint64_t>(s.full_shape[k]);
  }
  std::uint64_t inner = dtype_size(s.dtype);
  for (std::size_t k = d + 1; k < s.full_shape.size(); ++k) {
    inner *= static_cast<std::uint64_t>(s.full_shape[k]);
  }
  const auto full_d = static_cast<std::uint64_t>(s.full_shape[d]);
  std::vector<std::byte> out;
  for (std::uint64_t o = 0; o < outer; ++o) {
    const auto* begin = full.data() + (o * full_d + static_cast<std::uint64_t>(row_begin)) * inner;
    out.insert(out.end(), begin, begin + static_cast<std::uint64_t>(rows) * inner);
  }
  return out;
}

struct ShardSet {
  std::vector<std::vector<std::byte>> fulls;    // expected full tensors
  std::vector<std::vector<std::byte>> storage;  // this rank's shards
  std::vector<TensorView> views;
};

// This rank's shards of deterministic full tensors; padded shards get junk padding.
ShardSet make_shards(const UnshardPlan& plan, int rank) {
  ShardSet set;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const ShardSpec& s = plan.spec(i);
    std::vector<std::byte> full(checked_nbytes(s.dtype, s.full_shape));
    fill_pattern(full, kSeed, kFullRank, i);
    std::int64_t begin = 0;
    for (int r = 0; r < rank; ++r) {
      begin += s.sizes[static_cast<std::size_t>(r)];
    }
    const std::int64_t rows = s.sizes[static_cast<std::size_t>(rank)];
    std::vector<std::byte> real = cut(full, s, begin, rows);
    const Shape shape = plan.shard_shape(rank, i);
    std::vector<std::byte> local(checked_nbytes(s.dtype, shape) + 8, std::byte{0xab});
    // Lay the real rows into the (possibly padded) local shard, outer index by outer index.
    const std::int64_t local_d = shape[static_cast<std::size_t>(s.shard_dim)];
    std::uint64_t outer = 1;
    for (std::size_t k = 0; k < static_cast<std::size_t>(s.shard_dim); ++k) {
      outer *= static_cast<std::uint64_t>(s.full_shape[k]);
    }
    const std::uint64_t row_bytes =
        outer == 0 || local_d == 0
            ? 0
            : (checked_nbytes(s.dtype, shape) / outer / static_cast<std::uint64_t>(local_d));
    // rows == 0: an empty shard, nothing to lay out (and real.data() may be null).
    for (std::uint64_t o = 0; o < outer && row_bytes != 0 && rows != 0; ++o) {
      std::memcpy(local.data() + o * static_cast<std::uint64_t>(local_d) * row_bytes,
                  real.data() + o * static_cast<std::uint64_t>(rows) * row_bytes,
                  static_cast<std::uint64_t>(rows) * row_bytes);
    }
    set.fulls.push_back(std::move(full));
    set.storage.push_back(std::move(local));
    set.views.push_back({set.storage.back().data(), s.dtype, shape, {}});
  }
  return set;
}

std::string check_fulls(const std::vector<TensorView>& got, const ShardSet& set) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!set.fulls[i].empty() &&
        std::memcmp(got[i].data, set.fulls[i].data(), set.fulls[i].size()) != 0) {
      return "parameter " + std::to_string(i) + " differs from the full tensor";
    }
  }
  return "";
}

std::vector<ShardSpec> unshard_specs(int world) {
  std::vector<ShardSpec> specs;
  specs.push_back({DType::kFloat32, {17, 5}, 0, {}, 0});      // chunk along dim 0
  specs.push_back({DType::kBFloat16, {3, 19}, 1, {}, 0});     // chunk along dim 1
  specs.push_back({DType::kFloat64, {2, 3, 11}, -1, {}, 0});  // last dim
  specs.push_back({DType::kInt8, {1, 4}, 0, {}, 0});          // fewer rows than ranks
  specs.push_back({DType::kFloat16, {9, 2}, 0, {}, (9 + world - 1) / world});    // padded
  specs.push_back({DType::kFloat32, {4, 10}, 1, {}, (10 + world - 1) / world});  // padded dim 1
  std::vector<std::int64_t> uneven(static_cast<std::size_t>(world), 0);
  for (int r = 0; r < world; ++r) {
    uneven[static_cast<std::size_t>(r)] = r % 3;  // explicit sizes, some empty
  }
  std::int64_t total = 0;
  for (const std::int64_t v : uneven) {
    total += v;
  }
  specs.push_back({DType::kInt32, {total, 6}, 0, uneven, 0});
  specs.push_back({DType::kFloat32, {0, 3}, 0, {}, 0});  // an empty parameter
  return specs;
}

}  // namespace

void case_plan_steady_state(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const auto shapes = plan_shapes(world);
  const std::vector<HostTensor> tensors = plan_tensors(shapes, rank);
  const std::vector<TensorView> params = views_of(tensors);
  for (const bool with_hint : {true, false}) {
    for (const Strategy strategy : kStrategies) {
      for (const bool preflight : {true, false}) {
        if (!with_hint && !preflight) {
          continue;
        }
        const PlanOptions options{.timeout = {}, .preflight = preflight, .strategy = strategy};
        AllGatherPlan plan =
            AllGatherPlan::create(params, comm,
                                  with_hint ? std::span<const std::vector<Shape>>(shapes)
                                            : std::span<const std::vector<Shape>>(),
                                  options);
        std::vector<std::byte> out(plan.output_bytes());
        const std::vector<TensorView> views = plan.views(out.data());
        // kAuto may measure a window against kDirect on its first executions (each candidate's
        // first run sizes its scratch, the last trial settles): steady state begins after.
        const int settled = strategy == Strategy::kAuto ? kAutoTrialRuns : 1;
        for (int step = 0; step < settled + 4; ++step) {
          std::fill(out.begin(), out.end(), std::byte{0xee});
          const std::uint64_t allocs = thread_allocations();
          const std::uint64_t before = comm.collectives_issued();
          const ExecStats stats = plan.execute(params, comm, out);
          const std::uint64_t used = thread_allocations() - allocs;
          const std::uint64_t issued = comm.collectives_issued() - before;
          const std::string what = std::string("strategy ") + std::string(strategy_name(strategy)) +
                                   ", hint " + std::to_string(with_hint) + ", step " +
                                   std::to_string(step);
          if (step >= settled) {  // the first may size scratch (datatype caches, staging)
            EXPECT_EQ(used, 0U) << what;
          }
          EXPECT_EQ(stats.preflight_collectives, world > 1 && preflight ? 1U : 0U) << what;
          EXPECT_EQ(issued, stats.preflight_collectives + stats.payload_collectives +
                                stats.setup_collectives)
              << what;
          if (step >= settled) {
            EXPECT_EQ(stats.setup_collectives, 0U) << what;
          }
          if (world > 1 && strategy != Strategy::kPerTensor) {
            // A window without the header needs one barrier more: nobody may still read the
            // window when a rank overwrites it. kHierarchical is an exchange and a barrier.
            const bool hierarchical = stats.strategy == Strategy::kHierarchical;
            const bool windowed = stats.strategy == Strategy::kShared || hierarchical;
            const bool extra = windowed && !preflight && step > 0;
            EXPECT_EQ(stats.payload_collectives, (hierarchical ? 2U : 1U) + (extra ? 1U : 0U))
                << what;
          }
          ASSERT_EQ(check_plan_views(views, world), "") << what;
        }
      }
    }
  }
}

void case_plan_execute_shared(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const auto shapes = plan_shapes(world);
  const std::vector<HostTensor> tensors = plan_tensors(shapes, rank);
  const std::vector<TensorView> params = views_of(tensors);
  AllGatherPlan plan(kPlanDTypes, shapes, rank);
  // Where no window spans the group (ranks on several hosts) it is an ordinary kAuto execution,
  // which may measure kHierarchical against kDirect first: steady state begins after that.
  const int settled = comm.ranks_on_host() == world ? 1 : kAutoTrialRuns;
  for (int step = 0; step < settled + 5; ++step) {
    const std::uint64_t allocs = thread_allocations();
    ExecStats stats;
    const std::span<const std::byte> gathered = plan.execute_shared(params, comm, &stats);
    if (step >= settled) {
      EXPECT_EQ(thread_allocations() - allocs, 0U) << "step " << step;
    }
    ASSERT_EQ(gathered.size(), plan.output_bytes());
    const std::vector<TensorView> views = plan.views(gathered.data());
    ASSERT_EQ(check_plan_views(views, world), "") << "step " << step;
  }
}

void case_plan_rejects_mismatched_tensors(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const auto shapes = plan_shapes(world);
  const std::vector<HostTensor> tensors = plan_tensors(shapes, rank);
  std::vector<TensorView> params = views_of(tensors);
  AllGatherPlan plan(kPlanDTypes, shapes, rank);
  std::vector<std::byte> out(plan.output_bytes());
  // Rank 0 passes a tensor of another shape: every rank raises, naming tensor 3.
  std::vector<TensorView> wrong = params;
  if (rank == 0) {
    wrong[3].shape = {6};
  }
  if (world > 1) {
    expect_raises<InvalidArgument>([&] { plan.execute(wrong, comm, out); }, "tensor 3");
  }
  // An output that is too small.
  std::vector<std::byte> small(plan.output_bytes() - 1);
  if (world > 1 || plan.output_bytes() > 0) {
    expect_raises<InvalidArgument>([&] { plan.execute(params, comm, small); }, "output holds");
  }
  // An input that overlaps the output outside its own slot.
  std::vector<TensorView> aliased = params;
  aliased[0].data = out.data() + out.size() - 4;
  aliased[0].shape = {1};
  aliased[0].dtype = DType::kFloat32;
  const std::vector<DType> one = {DType::kFloat32};
  const std::vector<std::vector<Shape>> one_shapes(static_cast<std::size_t>(world),
                                                   std::vector<Shape>{{1}});
  AllGatherPlan small_plan(one, one_shapes, rank);
  std::vector<std::byte> small_out(small_plan.output_bytes());
  const TensorView alias{
      small_out.data() + (rank == 0 && world > 1 ? 4 : 0), DType::kFloat32, {1}, {}};
  if (world > 1) {
    expect_raises<InvalidArgument>(
        [&] { small_plan.execute(std::span(&alias, 1), comm, small_out); }, "aliasing");
  }
  // In place: each rank's input is exactly its own slot.
  float value = static_cast<float>(rank) + 0.5F;
  std::memcpy(small_out.data() + small_plan.layout().offsets[static_cast<std::size_t>(rank)],
              &value, sizeof value);
  const TensorView in_place{
      small_out.data() + small_plan.layout().offsets[static_cast<std::size_t>(rank)],
      DType::kFloat32,
      {1},
      {}};
  small_plan.execute(std::span(&in_place, 1), comm, small_out);
  for (int r = 0; r < world; ++r) {
    float got = 0;
    std::memcpy(&got, small_out.data() + small_plan.layout().offsets[static_cast<std::size_t>(r)],
                sizeof got);
    EXPECT_EQ(got, static_cast<float>(r) + 0.5F);
  }
  // Still usable afterwards, with no collective beyond the header and the payload.
  const std::uint64_t before = comm.collectives_issued();
  const ExecStats stats = plan.execute(params, comm, out);
  EXPECT_EQ(comm.collectives_issued() - before,
            stats.preflight_collectives + stats.payload_collectives + stats.setup_collectives);
}

void case_unshard_dims(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const std::vector<ShardSpec> specs = unshard_specs(world);
  for (const Strategy strategy : kStrategies) {
    const PlanOptions options{.timeout = {}, .preflight = true, .strategy = strategy};
    UnshardPlan plan(specs, world, rank, options);
    const ShardSet set = make_shards(plan, rank);
    // Into caller memory, twice (the second run must not depend on the first).
    std::vector<std::byte> buffer(plan.output_bytes());
    for (int step = 0; step < 2; ++step) {
      std::memset(buffer.data(), 0xee, buffer.size());
      plan.execute(set.views, comm, buffer);
      EXPECT_EQ(check_fulls(plan.views(buffer.data()), set), "")
          << "strategy " << strategy_name(strategy) << " step " << step;
    }
    // Into separate full tensors.
    std::vector<std::vector<std::byte>> fulls;
    std::vector<TensorView> outputs;
    for (std::size_t i = 0; i < plan.size(); ++i) {
      fulls.emplace_back(checked_nbytes(specs[i].dtype, specs[i].full_shape) + 1);
      outputs.push_back({fulls.back().data(), specs[i].dtype, specs[i].full_shape, {}});
    }
    plan.execute(set.views, comm, std::span<const TensorView>(outputs));
    EXPECT_EQ(check_fulls(outputs, set), "") << "strategy " << strategy_name(strategy);
  }
  // One-shot.
  UnshardPlan plan(specs, world, rank);
  const ShardSet set = make_shards(plan, rank);
  const UnshardResult result = unshard(set.views, comm, specs);
  std::vector<TensorView> got;
  for (std::size_t i = 0; i < result.size(); ++i) {
    got.push_back(result[i]);
    EXPECT_EQ(result[i].shape, specs[i].full_shape);
  }
  EXPECT_EQ(check_fulls(got, set), "");
}

void case_unshard_single_dim0(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const std::vector<ShardSpec> specs = {{DType::kBFloat16, {4 * world + 3, 64}, 0, {}, 0}};
  // kDirect pinned: the case is about its path (kAuto might measure a window, which copies).
  UnshardPlan plan(specs, world, rank,
                   PlanOptions{.timeout = {}, .preflight = true, .strategy = Strategy::kDirect});
  const ShardSet set = make_shards(plan, rank);
  std::vector<std::byte> buffer(plan.output_bytes());
  for (int step = 0; step < 4; ++step) {
    const std::uint64_t allocs = thread_allocations();
    const ExecStats stats = plan.execute(set.views, comm, buffer);
    if (step > 0) {
      EXPECT_EQ(thread_allocations() - allocs, 0U);
    }
    EXPECT_EQ(stats.staged_bytes, 0U);
    EXPECT_EQ(stats.payload_collectives, world > 1 ? 1U : 0U);
  }
  EXPECT_EQ(check_fulls(plan.views(buffer.data()), set), "");
}

void case_unshard_aliasing(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const std::vector<ShardSpec> specs = {{DType::kFloat32, {2 * world, 4}, 0, {}, 0}};
  UnshardPlan plan(specs, world, rank);
  const ShardSet set = make_shards(plan, rank);
  std::vector<std::byte> buffer(plan.output_bytes() + 64);
  std::vector<TensorView> shards = set.views;
  if (rank == world - 1) {
    shards[0].data = buffer.data() + 4;  // overlaps the full tensor, not at its slot
  }
  expect_raises<InvalidArgument>(
      [&] { plan.execute(shards, comm, std::span(buffer).first(plan.output_bytes())); },
      "aliasing");
  // The plan and the communicator stay usable.
  plan.execute(set.views, comm, std::span(buffer).first(plan.output_bytes()));
  EXPECT_EQ(check_fulls(plan.views(buffer.data()), set), "");
}

void case_unshard_to_dst(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const std::vector<ShardSpec> specs = unshard_specs(world);
  for (int dst = 0; dst < world; ++dst) {
    UnshardPlan plan(specs, world, rank, {}, dst);
    const ShardSet set = make_shards(plan, rank);
    EXPECT_EQ(plan.receives(), rank == dst);
    std::vector<std::byte> buffer(plan.receives() ? plan.output_bytes() : 0);
    for (int step = 0; step < 2; ++step) {
      if (!buffer.empty()) {  // empty where this rank receives nothing (data() is null)
        std::memset(buffer.data(), 0xee, buffer.size());
      }
      const ExecStats stats = plan.execute(set.views, comm, buffer);
      EXPECT_EQ(stats.strategy, Strategy::kDirect);
      if (plan.receives()) {
        EXPECT_EQ(check_fulls(plan.views(buffer.data()), set), "") << "dst " << dst;
      }
    }
    // Into separate full tensors on dst; no outputs elsewhere.
    std::vector<std::vector<std::byte>> fulls;
    std::vector<TensorView> outputs;
    for (std::size_t i = 0; i < plan.size() && plan.receives(); ++i) {
      fulls.emplace_back(checked_nbytes(specs[i].dtype, specs[i].full_shape) + 1);
      outputs.push_back({fulls.back().data(), specs[i].dtype, specs[i].full_shape, {}});
    }
    plan.execute(set.views, comm, std::span<const TensorView>(outputs));
    if (plan.receives()) {
      EXPECT_EQ(check_fulls(outputs, set), "") << "dst " << dst;
    }
  }
  PlanOptions packed;
  packed.strategy = Strategy::kPacked;
  EXPECT_THROW(UnshardPlan(specs, world, rank, packed, 0), InvalidArgument);
  EXPECT_THROW(UnshardPlan(specs, world, rank, {}, world), InvalidArgument);
}

// PlanOptions::dst is the one place a gather to one rank is asked for: the one-shot unshard, a
// plan and a stream read it; the plan's trailing dst agrees with it or is refused; an all-gather
// plan refuses it.
void case_dst_in_plan_options(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const std::vector<ShardSpec> specs = unshard_specs(world);
  for (int dst = 0; dst < world; ++dst) {
    PlanOptions options;
    options.dst = dst;
    const UnshardPlan plan(specs, world, rank, options);
    EXPECT_EQ(plan.dst(), dst);
    EXPECT_EQ(plan.receives(), rank == dst);
    const ShardSet set = make_shards(plan, rank);
    const UnshardResult result = unshard(set.views, comm, specs, options);
    if (rank == dst) {
      std::vector<TensorView> views;
      for (std::size_t i = 0; i < result.size(); ++i) {
        views.push_back(result[i]);
      }
      EXPECT_EQ(check_fulls(views, set), "") << "dst " << dst;
    } else {
      EXPECT_EQ(result.size(), 0U) << "a rank that only sends gets no tensors";
      EXPECT_EQ(result.buffer().size(), 0U);
    }
    EXPECT_EQ(UnshardPlan(specs, world, rank, options, dst).dst(), dst);
    UnshardStream stream(specs, world, rank, {.bucket_bytes = 256, .plan = options});
    stream.begin(set.views, comm);
    std::size_t buckets = 0;
    while (const auto bucket = stream.next()) {
      EXPECT_EQ(bucket->full.empty(), rank != dst) << "bucket " << bucket->index;
      ++buckets;
    }
    EXPECT_EQ(buckets, stream.num_buckets());
    if (world > 1) {  // given twice, differently
      const int other = (dst + 1) % world;
      EXPECT_THROW((void)UnshardPlan(specs, world, rank, options, other), InvalidArgument);
      EXPECT_THROW((void)UnshardStream(specs, world, rank, {.dst = other, .plan = options}),
                   InvalidArgument);
    }
  }
  PlanOptions to_one;
  to_one.dst = 0;
  EXPECT_THROW(AllGatherPlan(std::vector<DType>{DType::kFloat32},
                             std::vector<std::vector<Shape>>(static_cast<std::size_t>(world),
                                                             std::vector<Shape>{{2}}),
                             rank, to_one),
               InvalidArgument);
}

namespace {

// The stream's cases: unshard_specs three times over, so buckets hold several parameters.
std::vector<ShardSpec> stream_specs(int world) {
  std::vector<ShardSpec> specs;
  for (int k = 0; k < 3; ++k) {
    for (const ShardSpec& s : unshard_specs(world)) {
      specs.push_back(s);
    }
  }
  specs.push_back({DType::kFloat32, {64, 33}, 1, {}, 0});  // larger than any bucket below
  return specs;
}

// Runs the stream to its end; checks every bucket against the full tensors and that the buckets
// reuse at most prefetch + 1 buffers. Returns the number of buckets seen.
std::size_t drain_stream(UnshardStream& stream, const ShardSet& set, Communicator& comm) {
  stream.begin(set.views, comm);
  std::vector<const void*> bases;
  std::size_t seen = 0;
  std::size_t next_param = 0;
  while (std::optional<StreamBucket> bucket = stream.next()) {
    EXPECT_EQ(bucket->index, seen);
    EXPECT_EQ(bucket->first_param, next_param);
    next_param += bucket->num_params;
    ++seen;
    const bool receives = stream.bucket_plan(bucket->index).receives();
    EXPECT_EQ(bucket->full.size(), receives ? bucket->num_params : 0);
    for (std::size_t j = 0; j < bucket->full.size(); ++j) {
      const std::vector<std::byte>& want = set.fulls[bucket->first_param + j];
      EXPECT_TRUE(want.empty() || std::memcmp(bucket->full[j].data, want.data(), want.size()) == 0)
          << "parameter " << bucket->first_param + j;
    }
    if (!bucket->full.empty() &&
        std::find(bases.begin(), bases.end(), bucket->full[0].data) == bases.end()) {
      bases.push_back(bucket->full[0].data);
    }
  }
  EXPECT_EQ(next_param, stream.num_params());
  EXPECT_LE(bases.size(), static_cast<std::size_t>(stream.options().prefetch) + 1);
  return seen;
}

}  // namespace

void case_unshard_stream(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const std::vector<ShardSpec> specs = stream_specs(world);
  const ShardSet set = make_shards(UnshardPlan(specs, world, rank), rank);
  for (const int dst : {-1, 0, world - 1}) {
    for (const int prefetch : {0, 1, 2}) {
      for (const std::uint64_t bucket_bytes : {std::uint64_t{512}, std::uint64_t{1} << 20}) {
        UnshardStream stream(specs, world, rank,
                             {.bucket_bytes = bucket_bytes, .prefetch = prefetch, .dst = dst});
        const std::size_t buckets = drain_stream(stream, set, comm);
        EXPECT_EQ(buckets, stream.num_buckets());
        if (bucket_bytes == 512) {
          EXPECT_GT(buckets, 4U);  // several buckets, one of them the large parameter alone
          // An ended stream runs again over the same buffers (every step of a weight sync).
          EXPECT_EQ(drain_stream(stream, set, comm), buckets);
        }
        EXPECT_THROW((void)stream.next(), InvalidArgument);  // ended
      }
    }
  }
}

void case_unshard_stream_errors(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const std::vector<ShardSpec> specs = stream_specs(world);
  const ShardSet set = make_shards(UnshardPlan(specs, world, rank), rank);
  if (world > 1) {
    // A bucket size that differs on the last rank: every rank raises before anything moves.
    const std::uint64_t before = comm.collectives_issued();
    UnshardStream stream(specs, world, rank,
                         {.bucket_bytes = rank == world - 1 ? 1024U : 512U, .prefetch = 1});
    expect_raises<Mismatch>([&] { stream.begin(set.views, comm); }, "");
    EXPECT_EQ(comm.collectives_issued() - before, 1U);  // the stream's header, no payload
  }
  // A shard of the wrong shape: every rank raises at begin().
  {
    ShardSet bad = make_shards(UnshardPlan(specs, world, rank), rank);
    if (rank == world - 1) {
      bad.views[2].shape[0] += 1;
    }
    UnshardStream stream(specs, world, rank, {.bucket_bytes = 512});
    expect_raises<InvalidArgument>([&] { stream.begin(bad.views, comm); },
                                   "rank " + std::to_string(world - 1));
  }
  // A consumer failing on the last rank, in the middle and at the last bucket: every rank
  // raises its error, and the communicator stays usable.
  for (const int prefetch : {0, 1, 2}) {
    UnshardStream probe(specs, world, rank, {.bucket_bytes = 512, .prefetch = prefetch});
    const std::size_t total = probe.num_buckets();
    for (const std::size_t at : {std::size_t{1}, total - 1}) {
      UnshardStream stream(specs, world, rank, {.bucket_bytes = 512, .prefetch = prefetch});
      stream.begin(set.views, comm);
      const std::string needle = "consumer failed at bucket " + std::to_string(at);
      expect_raises<InvalidArgument>(
          [&] {
            while (std::optional<StreamBucket> bucket = stream.next()) {
              if (rank == world - 1 && bucket->index == at) {
                stream.fail(ErrorCode::kInvalidArgument, needle);
              }
            }
          },
          needle);
      EXPECT_THROW((void)stream.next(), InvalidArgument);
      // A failed stream cannot begin again: every rank raises, through the header.
      expect_raises<InvalidArgument>([&] { stream.begin(set.views, comm); }, "failed earlier");
    }
  }
  const UnshardResult after = unshard(set.views, comm, specs);
  std::vector<TensorView> got;
  for (std::size_t i = 0; i < after.size(); ++i) {
    got.push_back(after[i]);
  }
  EXPECT_EQ(check_fulls(got, set), "");
}

void case_unshard_stream_timeout(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  if (world == 1) {
    return;
  }
  const std::vector<ShardSpec> specs = stream_specs(world);
  const ShardSet set = make_shards(UnshardPlan(specs, world, rank), rank);
  StreamOptions options{.bucket_bytes = 512, .prefetch = 1, .dst = -1};
  options.plan.timeout = std::chrono::milliseconds(300);
  UnshardStream stream(specs, world, rank, options);
  stream.begin(set.views, comm);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    while (std::optional<StreamBucket> bucket = stream.next()) {
      if (rank == world - 1 && bucket->index == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(900));  // a stalled consumer
      }
    }
    ADD_FAILURE() << "the stream ended without an error";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected Timeout, got: " << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));  // no hang
  EXPECT_THROW((void)stream.next(), InvalidArgument);                          // ended
}

namespace {

// What an explicit kHierarchical runs on `comm`: itself where the ranks span hosts and some host
// has several, kDirect otherwise.
Strategy hierarchical_runs(const Communicator& comm) {
  const std::span<const int> hosts = comm.hosts();
  if (!comm.capabilities().all_to_all || hosts.size() != static_cast<std::size_t>(comm.size()) ||
      comm.size() == 1) {
    return Strategy::kDirect;
  }
  const int num_hosts = *std::max_element(hosts.begin(), hosts.end()) + 1;
  return num_hosts > 1 && comm.size() > num_hosts ? Strategy::kHierarchical : Strategy::kDirect;
}

// An AllGatherPlan of one float32 tensor, rank r's shard `rows(r)` long: `steps` executions,
// each bit-exact and run with `want`.
void expect_plan_runs(Communicator& comm, const std::function<std::int64_t(int)>& rows,
                      Strategy strategy, Strategy want, bool preflight, const std::string& what) {
  const int world = comm.size();
  std::vector<std::vector<Shape>> shapes;
  for (int r = 0; r < world; ++r) {
    shapes.push_back({{rows(r)}});
  }
  std::vector<HostTensor> tensors;  // moved in: a copy's view would point at the original
  tensors.push_back(make_tensor(DType::kFloat32, shapes[static_cast<std::size_t>(comm.rank())][0],
                                kSeed, comm.rank(), 0));
  const std::vector<TensorView> params = views_of(tensors);
  const PlanOptions options{.timeout = {}, .preflight = preflight, .strategy = strategy};
  const std::vector<DType> dtypes = {DType::kFloat32};
  AllGatherPlan plan(dtypes, shapes, comm.rank(), options);
  std::vector<std::byte> out(plan.output_bytes());
  for (int step = 0; step < 3; ++step) {
    std::fill(out.begin(), out.end(), std::byte{0xee});
    EXPECT_EQ(plan.execute(params, comm, out).strategy, want) << what << ", step " << step;
    ASSERT_EQ(check_plan_views(plan.views(out.data()), world, 1), "") << what << ", step " << step;
  }
}

}  // namespace

void case_hierarchical(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  const Strategy want = hierarchical_runs(comm);
  // Uneven shapes, mixed dtypes, a rank with an empty tensor: every step bit-exact.
  const auto shapes = plan_shapes(world);
  const std::vector<HostTensor> tensors = plan_tensors(shapes, rank);
  const std::vector<TensorView> params = views_of(tensors);
  for (const bool preflight : {true, false}) {
    const PlanOptions options{
        .timeout = {}, .preflight = preflight, .strategy = Strategy::kHierarchical};
    AllGatherPlan plan(kPlanDTypes, shapes, rank, options);
    std::vector<std::byte> out(plan.output_bytes());
    for (int step = 0; step < 4; ++step) {
      std::fill(out.begin(), out.end(), std::byte{0xee});
      const ExecStats stats = plan.execute(params, comm, out);
      const std::string what =
          "preflight " + std::to_string(preflight) + ", step " + std::to_string(step);
      EXPECT_EQ(stats.strategy, want) << what;
      ASSERT_EQ(check_plan_views(plan.views(out.data()), world), "") << what;
    }
  }
  // A rank that sends nothing still receives everything; a rank that alone sends.
  expect_plan_runs(
      comm, [](int r) { return r == 0 ? 0 : 5 + r; }, Strategy::kHierarchical, want, true,
      "rank 0 empty");
  expect_plan_runs(
      comm, [world](int r) { return r == world - 1 ? 4099 : 0; }, Strategy::kHierarchical, want,
      true, "only the last rank sends");
}

// What an explicit strategy asked of a one-shot foreach moves as on this communicator (the
// fallbacks are strategy.h's; kAuto is direct for a one-shot call).
Strategy one_shot_runs(Strategy asked, const Communicator& comm) {
  const Strategy direct = comm.capabilities().gather_v ? Strategy::kDirect : Strategy::kPadded;
  switch (asked) {
    case Strategy::kAuto:
    case Strategy::kDirect:
      return direct;
    case Strategy::kShared:
      return comm.size() > 1 && comm.ranks_on_host() == comm.size() ? Strategy::kShared : direct;
    case Strategy::kHierarchical:
      return hierarchical_runs(comm) == Strategy::kHierarchical ? Strategy::kHierarchical : direct;
    default:
      return asked;
  }
}

void case_foreach_strategies(Communicator& comm) {
  const int world = comm.size();
  const auto shapes = plan_shapes(world);
  const std::vector<HostTensor> tensors = plan_tensors(shapes, comm.rank());
  const std::vector<TensorView> params = views_of(tensors);
  for (const Strategy s :
       {Strategy::kAuto, Strategy::kDirect, Strategy::kPacked, Strategy::kPerTensor,
        Strategy::kShared, Strategy::kPadded, Strategy::kHierarchical}) {
    for (const bool hint : {true, false}) {
      const std::string what =
          std::string(strategy_name(s)) + (hint ? ", with the hint" : ", without a hint");
      const GatherResult out = foreach_all_gather(
          params, comm, hint ? std::span<const std::vector<Shape>>(shapes) : ShapesHint{},
          ForeachAllGatherOptions{.timeout = {}, .preflight = true, .strategy = s});
      // At world 1 nothing moves: the strategy is reported as resolved all the same.
      const Strategy ran = one_shot_runs(s, comm);
      EXPECT_EQ(out.stats().strategy, ran) << what;
      // A window is made for the call (collectively) wherever one runs, and nowhere else.
      const bool window = world > 1 && (ran == Strategy::kShared || ran == Strategy::kHierarchical);
      EXPECT_EQ(out.stats().setup_collectives > 0, window) << what;
      std::vector<TensorView> views;
      for (std::size_t i = 0; i < out.size(); ++i) {
        views.insert(views.end(), out[i].begin(), out[i].end());
      }
      ASSERT_EQ(check_plan_views(views, world), "") << what;
    }
  }
  // The header compares the resolved strategy, with and without a hint: a rank that asks for
  // another raises with the rest. Packed and direct would move the same bytes into the same
  // places, so without the comparison this pair would succeed silently.
  const Strategy mine = comm.rank() == world - 1 ? Strategy::kPacked : Strategy::kDirect;
  if (world > 1) {
    for (const bool hint : {true, false}) {
      expect_raises<Mismatch>(
          [&] {
            (void)foreach_all_gather(
                params, comm, hint ? std::span<const std::vector<Shape>>(shapes) : ShapesHint{},
                {.timeout = {}, .preflight = true, .strategy = mine});
          },
          "strategy differs");
    }
  }
}

void case_hierarchical_disagreement(Communicator& comm) {
  if (hierarchical_runs(comm) != Strategy::kHierarchical) {
    return;  // one host, or one rank per host: both requests move direct, nothing disagrees
  }
  // The last rank's plan moves direct, the others' hierarchical: the header compares the
  // strategy, so every rank raises Mismatch before anything moves, and nobody hangs.
  const int world = comm.size();
  const auto shapes = plan_shapes(world);
  const std::vector<HostTensor> tensors = plan_tensors(shapes, comm.rank());
  const std::vector<TensorView> params = views_of(tensors);
  const Strategy mine = comm.rank() == world - 1 ? Strategy::kDirect : Strategy::kHierarchical;
  AllGatherPlan plan(kPlanDTypes, shapes, comm.rank(),
                     PlanOptions{.timeout = {}, .preflight = true, .strategy = mine});
  std::vector<std::byte> out(plan.output_bytes());
  expect_raises<Mismatch>([&] { plan.execute(params, comm, out); }, "strategy differs");
}

void case_auto_measures(Communicator& comm) {
  const int world = comm.size();
  // The window kAuto would consider here: kShared on one host, kHierarchical across hosts; none
  // where the transport reads peer memory itself (threads: a window only adds copies).
  const bool one_host = comm.ranks_on_host() == world;
  const Strategy window = comm.capabilities().reads_peer_memory || world == 1 ? Strategy::kDirect
                          : one_host                                          ? Strategy::kShared
                                     : hierarchical_runs(comm);
  std::vector<std::vector<Shape>> shapes;
  for (int r = 0; r < world; ++r) {
    shapes.push_back({{(std::int64_t{1} << 18) + 3 * r}});  // 1 MiB of float32: past the threshold
  }
  std::vector<HostTensor> tensors;
  tensors.push_back(make_tensor(DType::kFloat32, shapes[static_cast<std::size_t>(comm.rank())][0],
                                kSeed, comm.rank(), 0));
  const std::vector<TensorView> params = views_of(tensors);
  const std::vector<DType> dtypes = {DType::kFloat32};
  AllGatherPlan plan(dtypes, shapes, comm.rank());
  std::vector<std::byte> out(plan.output_bytes());
  Strategy settled = Strategy::kAuto;
  for (int step = 0; step < 10; ++step) {
    std::fill(out.begin(), out.end(), std::byte{0xee});
    const ExecStats stats = plan.execute(params, comm, out);
    const std::string what = "step " + std::to_string(step) + ", ran " +
                             std::string(strategy_name(stats.strategy)) + " (" + stats.why + ")";
    ASSERT_EQ(check_plan_views(plan.views(out.data()), world, 1), "") << what;
    if (window == Strategy::kDirect) {
      EXPECT_EQ(stats.strategy, Strategy::kDirect) << what;
      EXPECT_STREQ(stats.why, "rule") << what;
      continue;
    }
    if (step < kAutoTrialRuns) {
      // The trials alternate, the window first; the last one's settling is one setup collective.
      EXPECT_EQ(stats.strategy, step % 2 == 0 ? window : Strategy::kDirect) << what;
      EXPECT_STREQ(stats.why, "measuring") << what;
      if (step == kAutoTrialRuns - 1) {
        EXPECT_EQ(stats.setup_collectives, 1U) << what;
      }
      continue;
    }
    // Then one choice, the same at every step (and on every rank: the header compares it).
    if (step == kAutoTrialRuns) {
      settled = stats.strategy;
      EXPECT_TRUE(settled == window || settled == Strategy::kDirect) << what;
    }
    EXPECT_EQ(stats.strategy, settled) << what;
    EXPECT_EQ(std::string(stats.why).rfind("measured: ", 0), 0U) << what;
    EXPECT_EQ(stats.setup_collectives, 0U) << what;
  }
  // An explicit strategy pins the choice: no trial.
  const PlanOptions pinned{.timeout = {}, .preflight = true, .strategy = window};
  AllGatherPlan fixed(dtypes, shapes, comm.rank(), pinned);
  for (int step = 0; step < 3; ++step) {
    const ExecStats stats = fixed.execute(params, comm, out);
    EXPECT_EQ(stats.strategy, window) << "pinned, step " << step;
    EXPECT_STREQ(stats.why, "requested");
  }
}

void case_all_to_all_scatter(Communicator& comm) {
  const int world = comm.size();
  const auto w = static_cast<std::size_t>(world);
  const auto me = static_cast<std::size_t>(comm.rank());
  // q sends r bytes(q, r) bytes of pattern (q, tensor r): two segments, received into two
  // pieces, the first strided (every other 3-byte block).
  const auto bytes = [](std::size_t q, std::size_t r) -> std::uint64_t {
    return (q * 7 + r * 5) % 4 == 0 ? 0 : 300 * ((q + 2 * r) % 5 + 1);  // up to 1500
  };
  std::vector<std::vector<std::byte>> outgoing(w);
  std::vector<ConstSegment> send;
  std::vector<std::size_t> send_first{0};
  for (std::size_t p = 0; p < w; ++p) {
    outgoing[p].resize(bytes(me, p));
    fill_pattern(outgoing[p], kSeed, comm.rank(), p);
    const std::uint64_t half = outgoing[p].size() / 2;
    send.push_back({outgoing[p].data(), half});
    send.push_back({outgoing[p].data() + half, outgoing[p].size() - half});
    send_first.push_back(send.size());
  }
  std::vector<std::vector<std::byte>> incoming(w);
  std::vector<RecvPiece> pieces;
  std::vector<std::size_t> first{0};
  for (std::size_t q = 0; q < w; ++q) {
    const std::uint64_t n = bytes(q, me);
    const std::uint64_t blocks = n / 6;  // half of n as blocks of 3, 6 apart, then the rest
    incoming[q].assign(2 * n, std::byte{0xee});
    if (n != 0) {
      pieces.push_back({incoming[q].data(), 3, blocks, 6});
      pieces.push_back({incoming[q].data() + 6 * blocks, n - 3 * blocks, 1, 0});
    }
    first.push_back(pieces.size());
  }
  const Deadline deadline = comm.deadline_after(std::chrono::seconds(30));
  for (int round = 0; round < 2; ++round) {  // the second from the datatype caches
    comm.all_to_all_scatter(send, send_first, pieces, first, deadline);
    for (std::size_t q = 0; q < w; ++q) {
      const std::uint64_t n = bytes(q, me);
      std::vector<std::byte> expect(n);
      fill_pattern(expect, kSeed, static_cast<int>(q), me);
      const std::uint64_t blocks = n / 6;
      std::vector<std::byte> got;
      for (std::uint64_t k = 0; k < blocks; ++k) {
        got.insert(got.end(), incoming[q].begin() + static_cast<std::ptrdiff_t>(6 * k),
                   incoming[q].begin() + static_cast<std::ptrdiff_t>(6 * k + 3));
      }
      got.insert(got.end(), incoming[q].begin() + static_cast<std::ptrdiff_t>(6 * blocks),
                 incoming[q].begin() + static_cast<std::ptrdiff_t>(6 * blocks + n - 3 * blocks));
      EXPECT_EQ(got, expect) << "rank " << me << " from rank " << q << ", round " << round;
    }
  }
}

}  // namespace shardgather::testing
