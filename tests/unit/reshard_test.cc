// Reshard on the threads backend: the region planner's answers, then fuzzed layouts bit-exact
// against the full tensors (worlds 1-8), the layouts NCCL's M2N refuses, fused destinations, the
// started form, the steady state and the errors every rank must see.
#include <algorithm>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/alloc_counter.h"
#include "support/reshard_cases.h"
#include "support/testing.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

using testing::check_reshard;
using testing::describe_layout;
using testing::make_reshard_views;
using testing::outcome;
using testing::run_ranks;

Box box(Shape offset, Shape size) { return Box{std::move(offset), std::move(size)}; }

// Rows [lo, hi) of a 2-D tensor of `cols` columns.
Box rows(std::int64_t lo, std::int64_t hi, std::int64_t cols) {
  return box({lo, 0}, {hi - lo, cols});
}

// `parts` uneven (torch.chunk) pieces of dim `dim` of `shape`, piece p to ranks[p].
std::vector<RankBox> chunked(const Shape& shape, std::size_t dim, const std::vector<int>& ranks) {
  const auto parts = static_cast<std::int64_t>(ranks.size());
  const std::int64_t step = (shape[dim] + parts - 1) / parts;
  std::vector<RankBox> out;
  for (std::int64_t p = 0; p < parts; ++p) {
    Box b{Shape(shape.size(), 0), shape};
    b.offset[dim] = std::min(p * step, shape[dim]);
    b.size[dim] = std::min(step, shape[dim] - b.offset[dim]);
    out.push_back({ranks[static_cast<std::size_t>(p)], b});
  }
  return out;
}

// Runs one layout on `world` threads with views of `variant`, each rank checked byte by byte.
void run_layout(const std::vector<TensorRegions>& layout, int world, std::uint64_t seed,
                int variant, const std::string& name) {
  run_ranks(
      world,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(layout, world, rank);
        testing::ReshardViews views = make_reshard_views(plan, seed, variant);
        plan.execute(views.sources, comm, views.destinations);
        const std::string problem = check_reshard(plan, views, seed);
        EXPECT_EQ(problem, "") << describe_layout(layout);
      },
      name);
}

TEST(RegionPlanner, FsdpRowsToTensorParallelColumnsSendExactlyEachBox) {
  // 4 sources hold dim-0 quarters of [8, 6]; ranks 4..7 want TP 2 column halves, twice (2 x 2).
  TensorRegions t{.dtype = DType::kFloat32, .shape = {8, 6}, .sources = {}, .destinations = {}};
  t.sources = chunked(t.shape, 0, {0, 1, 2, 3});
  for (int replica = 0; replica < 2; ++replica) {
    for (int tp = 0; tp < 2; ++tp) {
      t.destinations.push_back({4 + replica * 2 + tp, box({0, tp * 3}, {8, 3})});
    }
  }
  const RegionPlan plan = plan_regions(std::span(&t, 1), 8, 5);
  EXPECT_EQ(plan.rank_received[5], 8 * 3 * 4U);
  EXPECT_EQ(plan.receives.size(), 4U);  // one piece from each source
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(plan.recv_counts[static_cast<std::size_t>(r)], 2 * 3 * 4U);
    EXPECT_EQ(plan.rank_sent[static_cast<std::size_t>(r)], 4 * 2 * 3 * 4U);  // to 4 destinations
  }
  EXPECT_EQ(plan.sends.size(), 0U);
  EXPECT_EQ(plan.destination_views.size(), 1U);
}

TEST(RegionPlanner, ReplicasShareTheSendingAndPreferTheDestinationsOwnRank) {
  // Every rank of 4 holds the whole tensor; each wants a quarter: each takes its own (no bytes
  // move). A fifth rank wants the whole: it is split among the four replicas.
  TensorRegions t{
      .dtype = DType::kBFloat16, .shape = {1024, 1024}, .sources = {}, .destinations = {}};
  for (int r = 0; r < 4; ++r) {
    t.sources.push_back({r, box({0, 0}, {1024, 1024})});
  }
  t.destinations = chunked(t.shape, 0, {0, 1, 2, 3});
  t.destinations.push_back({4, box({0, 0}, {1024, 1024})});
  const RegionPlan plan = plan_regions(std::span(&t, 1), 5, 4);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(plan.rank_sent[static_cast<std::size_t>(r)], 2 * 256 * 1024U + 2 * 256 * 1024U)
        << "rank " << r << " sends its own quarter to itself and a quarter to rank 4";
    EXPECT_EQ(plan.rank_local[static_cast<std::size_t>(r)], 2 * 256 * 1024U);
    EXPECT_EQ(plan.recv_counts[static_cast<std::size_t>(r)], 2 * 256 * 1024U);
  }
}

TEST(RegionPlanner, HostsMakeADestinationPreferAReplicaOnItsHost) {
  TensorRegions t{.dtype = DType::kUInt8, .shape = {64}, .sources = {}, .destinations = {}};
  t.sources = {{0, box({0}, {64})}, {2, box({0}, {64})}};
  t.destinations = {{3, box({0}, {64})}, {1, box({0}, {64})}};
  RegionOptions options;
  options.hosts = {0, 0, 1, 1};
  const RegionPlan plan = plan_regions(std::span(&t, 1), 4, 3, options);
  ASSERT_EQ(plan.receives.size(), 1U);
  EXPECT_EQ(plan.recv_counts[2], 64U);  // rank 3 reads from rank 2, on its host
  const RegionPlan other = plan_regions(std::span(&t, 1), 4, 1, options);
  EXPECT_EQ(other.recv_counts[0], 64U);
}

TEST(RegionPlanner, AnElementNoSourceHoldsIsNamed) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {4, 4}, .sources = {}, .destinations = {}};
  t.sources = {{0, box({0, 0}, {4, 2})}, {1, box({0, 3}, {4, 1})}};
  t.destinations = {{1, box({1, 0}, {2, 4})}};
  const auto [code, message] = outcome([&] { (void)plan_regions(std::span(&t, 1), 2, 0); });
  EXPECT_EQ(code, "InvalidArgument");
  EXPECT_NE(message.find("tensor 0: destination 0 (rank 1)"), std::string::npos) << message;
  EXPECT_NE(message.find("element (1, 2)"), std::string::npos) << message;
}

TEST(RegionPlanner, BoxesThatDoNotFitAreRefusedNamingTheEntry) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {4, 4}, .sources = {}, .destinations = {}};
  t.sources = {{0, box({0, 0}, {4, 4})}, {1, box({2, 0}, {3, 4})}};
  auto [code, message] = outcome([&] { (void)plan_regions(std::span(&t, 1), 2, 0); });
  EXPECT_EQ(code, "InvalidArgument");
  EXPECT_NE(message.find("tensor 0: source 1 (rank 1)"), std::string::npos) << message;
  t.sources[1] = {2, box({0, 0}, {4, 4})};
  std::tie(code, message) = outcome([&] { (void)plan_regions(std::span(&t, 1), 2, 0); });
  EXPECT_NE(message.find("rank is not in [0, 2)"), std::string::npos) << message;
  t.sources[1] = {1, box({0}, {4})};
  std::tie(code, message) = outcome([&] { (void)plan_regions(std::span(&t, 1), 2, 0); });
  EXPECT_NE(message.find("1 offsets"), std::string::npos) << message;
}

TEST(RegionPlanner, TheFingerprintCoversBoxesRanksAndOptions) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {4, 4}, .sources = {}, .destinations = {}};
  t.sources = chunked(t.shape, 0, {0, 1});
  t.destinations = chunked(t.shape, 1, {1, 0});
  const std::uint64_t base = plan_regions(std::span(&t, 1), 2, 0).fingerprint;
  EXPECT_EQ(plan_regions(std::span(&t, 1), 2, 1).fingerprint, base);  // the same on every rank
  TensorRegions moved = t;
  moved.destinations[0].rank = 0;
  EXPECT_NE(plan_regions(std::span(&moved, 1), 2, 0).fingerprint, base);
  moved = t;
  moved.dtype = DType::kInt32;
  EXPECT_NE(plan_regions(std::span(&moved, 1), 2, 0).fingerprint, base);
  RegionOptions hosts;
  hosts.hosts = {0, 1};
  EXPECT_NE(plan_regions(std::span(&t, 1), 2, 0, hosts).fingerprint, base);
  RegionOptions flat = hosts;
  flat.fan_out = false;
  EXPECT_NE(plan_regions(std::span(&t, 1), 2, 0, flat).fingerprint,
            plan_regions(std::span(&t, 1), 2, 0, hosts).fingerprint);
  RegionOptions one_wave = hosts;
  one_wave.fan_out_waves = 1;
  EXPECT_NE(plan_regions(std::span(&t, 1), 2, 0, one_wave).fingerprint,
            plan_regions(std::span(&t, 1), 2, 0, hosts).fingerprint);
}

// Host 0 (ranks 0-1) holds a [8, 4] float tensor in row halves; host 1's three ranks all want it
// whole, a fourth wants rows 2-5 only.
TensorRegions fan_out_tensor() {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {8, 4}, .sources = {}, .destinations = {}};
  t.sources = chunked(t.shape, 0, {0, 1});
  t.destinations = {{2, rows(0, 8, 4)}, {3, rows(0, 8, 4)}, {4, rows(0, 8, 4)}, {5, rows(2, 6, 4)}};
  return t;
}

TEST(RegionPlanner, BytesSeveralRanksOfAHostWantCrossToItOnce) {
  const TensorRegions t = fan_out_tensor();
  RegionOptions options;
  options.hosts = {0, 0, 1, 1, 1, 1};
  const RegionPlan plan = plan_regions(std::span(&t, 1), 6, 2, options);
  EXPECT_TRUE(plan.forwarding);
  // The whole box once for ranks 2-4, and rank 5's rows 2-5 (a box of its own).
  EXPECT_EQ(plan.host_received[1], 128U + 64U);
  EXPECT_EQ(plan.host_sent[0], 128U + 64U);
  // Each half went to one of ranks 2-4 (the least loaded), which forwards it to the other two.
  std::uint64_t relayed = 0;
  for (int r = 2; r <= 4; ++r) {
    const RegionPlan seen = plan_regions(std::span(&t, 1), 6, r, options);
    relayed += seen.recv_counts[0] + seen.recv_counts[1];
    std::uint64_t forwarded = 0;
    for (const std::uint64_t c : seen.forward_counts) {
      forwarded += c;
    }
    EXPECT_EQ(forwarded, 2 * (seen.recv_counts[0] + seen.recv_counts[1])) << "rank " << r;
    EXPECT_EQ(seen.rank_received[static_cast<std::size_t>(r)], 128U) << "rank " << r;
  }
  EXPECT_EQ(relayed, 128U);
  options.fan_out = false;
  const RegionPlan flat = plan_regions(std::span(&t, 1), 6, 2, options);
  EXPECT_FALSE(flat.forwarding);
  EXPECT_EQ(flat.host_received[1], 3 * 128U + 64U);
}

TEST(RegionPlanner, ABigPieceIsRelayedBySeveralRanksOfTheHost) {
  // One 4 MiB source on host 0; four ranks of host 1 want it: each relays a quarter.
  TensorRegions t{
      .dtype = DType::kFloat32, .shape = {1024, 1024}, .sources = {}, .destinations = {}};
  t.sources = {{0, rows(0, 1024, 1024)}};
  for (int r = 1; r <= 4; ++r) {
    t.destinations.push_back({r, rows(0, 1024, 1024)});
  }
  RegionOptions options;
  options.hosts = {0, 1, 1, 1, 1};
  for (int r = 1; r <= 4; ++r) {
    const RegionPlan plan = plan_regions(std::span(&t, 1), 5, r, options);
    EXPECT_EQ(plan.recv_counts[0], 1024U * 1024U) << "rank " << r;
    EXPECT_EQ(plan.host_received[1], 4U * 1024U * 1024U);
  }
}

TEST(RegionPlanner, RelayedPiecesMoveInWavesWhoseForwardsFollowThemByOneExchange) {
  // 8 tensors, each wanted whole by ranks 1-2 (host 1) from rank 0 (host 0): 8 relayed units.
  std::vector<TensorRegions> layout;
  for (int i = 0; i < 8; ++i) {
    TensorRegions t{.dtype = DType::kFloat32, .shape = {4, 4}, .sources = {}, .destinations = {}};
    t.sources = {{0, rows(0, 4, 4)}};
    t.destinations = {{1, rows(0, 4, 4)}, {2, rows(0, 4, 4)}};
    layout.push_back(t);
  }
  RegionOptions options;
  options.hosts = {0, 1, 1};
  for (const std::size_t waves : {1U, 3U, 4U, 20U}) {
    options.fan_out_waves = waves;
    const RegionPlan plan = plan_regions(layout, 3, 1, options);
    EXPECT_EQ(plan.rounds, std::min<std::size_t>(waves, 8) + 1) << waves << " waves";
    // Every relayed piece this rank receives in round e, it forwards in round e + 1.
    std::vector<std::size_t> relayed(plan.rounds, 0);
    std::vector<std::size_t> forwarded(plan.rounds, 0);
    for (const Transfer& x : plan.receives) {
      ++relayed[x.round];
    }
    for (const Transfer& x : plan.forwards) {
      ASSERT_GE(x.round, 1U);
      ++forwarded[x.round - 1];
    }
    EXPECT_EQ(relayed, forwarded) << waves << " waves";
    EXPECT_EQ(relayed.back(), 0U);
  }
  options.fan_out_waves = 0;
  const auto [code, message] = outcome([&] { (void)plan_regions(layout, 3, 0, options); });
  EXPECT_EQ(code, "InvalidArgument");
  EXPECT_NE(message.find("fan_out_waves is 0"), std::string::npos) << message;
}

// One float32 tensor per size, held whole by rank 0 (host 0) and wanted whole by ranks 1 and 2
// (host 1): each is relayed by one of them, or split between them from split_bytes up.
std::vector<TensorRegions> wanted_by_host_one(std::initializer_list<std::int64_t> sizes) {
  std::vector<TensorRegions> layout;
  for (const std::int64_t n : sizes) {
    TensorRegions t{.dtype = DType::kFloat32, .shape = {n}, .sources = {}, .destinations = {}};
    t.sources = {{0, box({0}, {n})}};
    t.destinations = {{1, box({0}, {n})}, {2, box({0}, {n})}};
    layout.push_back(t);
  }
  return layout;
}

TEST(RegionPlanner, WavesLeftEmptyByOneLargeUnitAreDropped) {
  // Relayed units of 100, 4, 4 and 4 bytes in 4 waves of 28: the small ones all fall in the
  // last wave, so the plan has two waves (3 exchanges), not four.
  const std::vector<TensorRegions> layout = wanted_by_host_one({25, 1, 1, 1});
  RegionOptions options;
  options.hosts = {0, 1, 1};
  EXPECT_EQ(plan_regions(layout, 3, 1, options).rounds, 3U);
}

TEST(RegionPlanner, RelayedBytesPastSixtyFourBitsAreCountOverflow) {
  // Four relayed units of 2^62 bytes (no memory is involved: the planner sees only boxes).
  const std::int64_t n = std::int64_t{1} << 61;
  const std::vector<TensorRegions> layout = wanted_by_host_one({n, n});
  RegionOptions options;
  options.hosts = {0, 1, 1};
  options.split_bytes = std::uint64_t{1} << 63;
  const auto [code, message] = outcome([&] { (void)plan_regions(layout, 3, 1, options); });
  EXPECT_EQ(code, "CountOverflow") << message;
}

TEST(RegionPlanner, HostsMustBeNumberedBelowTheWorld) {
  const TensorRegions t = fan_out_tensor();
  RegionOptions options;
  options.hosts = {0, 0, 1, 1, 1, 9};
  const auto [code, message] =
      outcome([&] { (void)plan_regions(std::span(&t, 1), 6, 0, options); });
  EXPECT_EQ(code, "InvalidArgument");
  EXPECT_NE(message.find("rank 5's host is 9"), std::string::npos) << message;
}

class ReshardFuzz : public ::testing::TestWithParam<int> {};

TEST_P(ReshardFuzz, RandomLayoutsAreBitExactAgainstTheFullTensors) {
  const int world = GetParam();
  for (int iter = 0; iter < 40; ++iter) {
    const auto seed = static_cast<std::uint64_t>(world * 1000 + iter);
    const std::vector<TensorRegions> layout = testing::random_reshard_layout(seed, world);
    run_layout(layout, world, seed, iter % 3, "ReshardFuzz w" + std::to_string(world));
    if (HasFailure()) {
      FAIL() << "seed " << seed << "\n" << describe_layout(layout);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReshardFuzz, ::testing::Range(1, 9));

TEST(ReshardFuzzOnHosts, PlansForTheCommunicatorPreferReplicasOnTheirHost) {
  testing::run_ranks_on_hosts(
      {0, 0, 1, 1, 1},
      [](int /*rank*/, Communicator& comm) {
        EXPECT_GE(testing::case_reshard_fuzz(comm, 80, 7000), 5) << "too few layouts fanned out";
      },
      "FuzzOnHosts");
}

TEST(ReshardOnHosts, FannedOutBytesLandInPlaceAndCrossTheHostsOnce) {
  // fan_out_tensor() and a 4 MiB tensor that host 1's ranks relay in quarters, into strided
  // destinations (column blocks of larger tensors), on 2 hosts.
  TensorRegions big{
      .dtype = DType::kBFloat16, .shape = {512, 2048}, .sources = {}, .destinations = {}};
  big.sources = chunked(big.shape, 0, {0, 1});
  for (int r = 2; r <= 5; ++r) {
    big.destinations.push_back({r, rows(0, 512, 2048)});
  }
  const std::vector<TensorRegions> layout{fan_out_tensor(), big};
  for (const int variant : {0, 1, 2, 3}) {
    testing::run_ranks_on_hosts(
        {0, 0, 1, 1, 1, 1},
        [&](int rank, Communicator& comm) {
          // Six relayed units (two halves, four quarters) in four waves: five exchanges; in
          // one wave (variant 3), two.
          RegionOptions options;
          options.fan_out_waves = variant == 3 ? 1 : 4;
          ReshardPlan plan = ReshardPlan::for_communicator(layout, comm, {}, options);
          ASSERT_TRUE(plan.regions().forwarding);
          const std::size_t rounds = variant == 3 ? 2 : 5;
          EXPECT_EQ(plan.regions().rounds, rounds);
          EXPECT_EQ(plan.regions().host_received[1], 128U + 64U + 2U * 512U * 2048U);
          testing::ReshardViews views = make_reshard_views(plan, 77, variant % 3);
          for (int step = 0; step < 2; ++step) {
            for (std::size_t v = plan.source_count(); v < views.storage.size(); ++v) {
              std::fill(views.storage[v].begin(), views.storage[v].end(), testing::kCanary);
            }
            const ExecStats stats = plan.execute(views.sources, comm, views.destinations);
            EXPECT_EQ(stats.payload_collectives, rounds) << "rank " << rank;
            EXPECT_EQ(check_reshard(plan, views, 77), "") << "rank " << rank;
          }
        },
        "FanOut");
  }
}

TEST(Reshard, APlanThatDiffersOnTheLastRankWritesNothing) {
  for (const int world : {1, 2, 5}) {
    run_ranks(
        world, [](int /*rank*/, Communicator& comm) { testing::case_reshard_mismatch(comm); },
        "MismatchCase");
  }
}

// The layouts NCCL's M2N refuses (docs/reshard.md): more than 3 dims, uneven shards, two shard
// axes on one side, more than 16 sources per destination shard.
TEST(ReshardBeyondM2N, FiveDimensionalTensors) {
  TensorRegions t{
      .dtype = DType::kBFloat16, .shape = {3, 4, 2, 5, 6}, .sources = {}, .destinations = {}};
  t.sources = chunked(t.shape, 3, {0, 1, 2});
  t.destinations = chunked(t.shape, 1, {2, 0, 1, 0});
  run_layout({t}, 3, 51, 1, "FiveDims");
}

TEST(ReshardBeyondM2N, UnevenShardsBothSides) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {13, 7}, .sources = {}, .destinations = {}};
  t.sources = {{0, rows(0, 6, 7)}, {1, rows(6, 6, 7)}, {2, rows(6, 13, 7)}};
  t.destinations = {{3, box({0, 0}, {13, 2})}, {1, box({0, 2}, {13, 5})}};
  run_layout({t}, 4, 52, 1, "Uneven");
}

TEST(ReshardBeyondM2N, TwoShardAxesOnOneSide) {
  // FSDP x TP on the source (2 x 2 grid of [10, 12]), TP 3 columns on the destination.
  TensorRegions t{.dtype = DType::kFloat64, .shape = {10, 12}, .sources = {}, .destinations = {}};
  int r = 0;
  for (std::int64_t fsdp = 0; fsdp < 2; ++fsdp) {
    for (std::int64_t tp = 0; tp < 2; ++tp) {
      t.sources.push_back({r++, box({fsdp * 5, tp * 6}, {5, 6})});
    }
  }
  t.destinations = chunked(t.shape, 1, {4, 5, 6});
  run_layout({t}, 7, 53, 2, "TwoAxes");
}

TEST(ReshardBeyondM2N, TwentySourcesFeedOneDestinationShard) {
  TensorRegions t{.dtype = DType::kInt32, .shape = {40, 3}, .sources = {}, .destinations = {}};
  std::vector<int> sources(20);
  std::iota(sources.begin(), sources.end(), 0);
  t.sources = chunked(t.shape, 0, sources);
  t.destinations = {{20, box({0, 0}, {40, 3})}, {3, box({1, 1}, {38, 2})}};
  run_layout({t}, 21, 54, 0, "TwentySources");
}

TEST(Reshard, FusedQkvWithGroupedQueryHeadsLandsInPlace) {
  // q [8 heads x 2, 4], k and v [2 heads x 2, 4], FSDP rows on ranks 0-1; TP 2 engine on ranks
  // 2-3, each with one fused [ (4 + 1 + 1) x 2, 4 ] qkv tensor: its q rows, then k, then v.
  const std::int64_t hd = 2;
  const std::int64_t hidden = 4;
  std::vector<TensorRegions> layout;
  for (const std::int64_t heads : {8, 2, 2}) {
    TensorRegions t{.dtype = DType::kBFloat16,
                    .shape = {heads * hd, hidden},
                    .sources = {},
                    .destinations = {}};
    t.sources = chunked(t.shape, 0, {0, 1});
    t.destinations = chunked(t.shape, 0, {2, 3});
    layout.push_back(t);
  }
  run_ranks(
      4,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(layout, 4, rank);
        testing::ReshardViews views = make_reshard_views(plan, 77, 0);
        std::vector<std::byte> fused;
        if (rank >= 2) {
          ASSERT_EQ(plan.destination_count(), 3U);
          fused.assign(static_cast<std::size_t>((4 + 1 + 1) * hd * hidden * 2), std::byte{0});
          std::int64_t row = 0;
          for (std::size_t v = 0; v < 3; ++v) {
            TensorView& d = views.destinations[v];
            d.data = fused.data() + row * hidden * 2;
            row += d.shape[0];
          }
        }
        plan.execute(views.sources, comm, views.destinations);
        if (rank < 2) {
          return;
        }
        // Each block of the fused tensor equals the reference written through the same view.
        std::int64_t row = 0;
        for (std::size_t v = 0; v < 3; ++v) {
          const std::int64_t n = views.destinations[v].shape[0] * hidden * 2;
          std::vector<std::byte> want(views.storage[plan.source_count() + v].size());
          const std::byte* got = fused.data() + row * hidden * 2;
          views.destinations[v].data = views.storage[plan.source_count() + v].data();
          std::copy(got, got + n, views.storage[plan.source_count() + v].begin());
          row += views.destinations[v].shape[0];
        }
        EXPECT_EQ(check_reshard(plan, views, 77), "");
      },
      "FusedQkv");
}

TEST(Reshard, StartedExecutionsCompleteInOrder) {
  const std::vector<TensorRegions> layout = testing::random_reshard_layout(4242, 3);
  run_ranks(
      3,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(layout, 3, rank);
        testing::ReshardViews views = make_reshard_views(plan, 4242, 1);
        Work<ExecStats> first = plan.start(views.sources, comm, views.destinations);
        first.wait();
        Work<ExecStats> second = plan.start(views.sources, comm, views.destinations);
        second.wait();
        EXPECT_EQ(check_reshard(plan, views, 4242), "");
      },
      "Started");
}

TEST(Reshard, SteadyStateAllocatesNothingAndExchangesNoMetadata) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {64, 32}, .sources = {}, .destinations = {}};
  t.sources = chunked(t.shape, 0, {0, 1, 2, 3});
  t.destinations = chunked(t.shape, 1, {3, 2, 1, 0});
  run_ranks(
      4,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(std::span(&t, 1), 4, rank);
        testing::ReshardViews views = make_reshard_views(plan, 9, 1);
        plan.execute(views.sources, comm, views.destinations);
        const std::uint64_t before = testing::thread_allocations();
        const std::uint64_t received = comm.exchange_bytes_received();
        const std::uint64_t sent = comm.exchange_bytes_sent();
        ExecStats stats;
        for (int step = 0; step < 3; ++step) {
          stats = plan.execute(views.sources, comm, views.destinations);
        }
        EXPECT_EQ(testing::thread_allocations() - before, 0U);
        // The transport's count: exactly the plan's bytes, each step.
        EXPECT_EQ(comm.exchange_bytes_received() - received, 3 * plan.bytes_received());
        EXPECT_EQ(comm.exchange_bytes_sent() - sent, 3 * plan.bytes_sent());
        EXPECT_EQ(stats.metadata_collectives, 0U);
        EXPECT_EQ(stats.preflight_collectives, 1U);
        EXPECT_EQ(stats.payload_collectives, 1U);
        EXPECT_EQ(stats.strategy, Strategy::kDirect);
        EXPECT_EQ(check_reshard(plan, views, 9), "");
        EXPECT_EQ(plan.bytes_received(), 64U * 8 * 4 * 3 / 4);
      },
      "SteadyState");
}

// Runs fn(rank, comm) on `world` ranks; returns each rank's outcome.
template <typename Fn>
std::vector<std::pair<std::string, std::string>> outcomes(int world, Fn fn,
                                                          const std::string& name) {
  std::vector<std::pair<std::string, std::string>> got(static_cast<std::size_t>(world));
  std::mutex mu;
  run_ranks(
      world,
      [&](int rank, Communicator& comm) {
        auto o = outcome([&] { fn(rank, comm); });
        const std::lock_guard<std::mutex> lock(mu);
        got[static_cast<std::size_t>(rank)] = std::move(o);
      },
      name);
  return got;
}

TEST(Reshard, APlanThatDiffersOnOneRankFailsOnEveryRankBeforeAnythingMoves) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {8, 4}, .sources = {}, .destinations = {}};
  t.sources = chunked(t.shape, 0, {0, 1, 2});
  t.destinations = chunked(t.shape, 1, {2, 1});
  const auto got = outcomes(
      3,
      [&](int rank, Communicator& comm) {
        TensorRegions mine = t;
        if (rank == 1) {
          mine.destinations = chunked(t.shape, 1, {1, 2});
        }
        ReshardPlan plan(std::span(&mine, 1), 3, rank);
        testing::ReshardViews views = make_reshard_views(plan, 5, 0);
        plan.execute(views.sources, comm, views.destinations);
      },
      "Mismatch");
  for (const auto& [code, message] : got) {
    EXPECT_EQ(code, "Mismatch") << message;
  }
}

TEST(Reshard, ABadViewOnOneRankFailsOnEveryRankNamingIt) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {8, 4}, .sources = {}, .destinations = {}};
  t.sources = chunked(t.shape, 0, {0, 1, 2});
  t.destinations = chunked(t.shape, 1, {2, 1});
  const auto got = outcomes(
      3,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(std::span(&t, 1), 3, rank);
        testing::ReshardViews views = make_reshard_views(plan, 5, 0);
        if (rank == 2) {
          views.destinations[0].shape = {8, 3};
        }
        plan.execute(views.sources, comm, views.destinations);
      },
      "BadView");
  for (const auto& [code, message] : got) {
    EXPECT_EQ(code, "InvalidArgument") << message;
    EXPECT_NE(message.find("rank 2"), std::string::npos) << message;
    EXPECT_NE(message.find("destination 0 (tensor 0): shape [8, 3]"), std::string::npos) << message;
  }
}

TEST(Reshard, ADestinationOverlappingASourceIsRefused) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {4, 4}, .sources = {}, .destinations = {}};
  t.sources = {{0, box({0, 0}, {4, 4})}};
  t.destinations = {{0, box({0, 0}, {4, 4})}};
  run_ranks(
      1,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(std::span(&t, 1), 1, rank);
        testing::ReshardViews views = make_reshard_views(plan, 5, 0);
        const auto [code, message] =
            outcome([&] { plan.execute(views.sources, comm, views.sources); });
        EXPECT_EQ(code, "InvalidArgument");
        EXPECT_NE(message.find("aliasing"), std::string::npos) << message;
      },
      "Aliasing");
}

TEST(Reshard, OnlyTheDirectStrategyAndNoDstAreAccepted) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {4}, .sources = {}, .destinations = {}};
  t.sources = {{0, box({0}, {4})}};
  PlanOptions packed;
  packed.strategy = Strategy::kPacked;
  EXPECT_EQ(outcome([&] { ReshardPlan(std::span(&t, 1), 1, 0, packed); }).first, "InvalidArgument");
  PlanOptions dst;
  dst.dst = 0;
  EXPECT_EQ(outcome([&] { ReshardPlan(std::span(&t, 1), 1, 0, dst); }).first, "InvalidArgument");
}

}  // namespace
}  // namespace shardgather
