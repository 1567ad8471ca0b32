// The one call protocol on the threads backend: disagreements that shape the wire pattern are
// caught from the header on every rank, before any payload moves (docs/reliability.md, D).
#include <chrono>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "ops/call.h"
#include "ops/preflight.h"
#include "support/test_name.h"
#include "support/testing.h"
#include "transport/graveyard.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

using namespace std::chrono_literals;
using testing::run_ranks;

using testing::test_name;

using testing::outcome;

std::vector<std::vector<Shape>> rows(int world) {
  std::vector<std::vector<Shape>> r;
  for (int q = 0; q < world; ++q) {
    r.push_back({{q + 1, 2}, {3}});
  }
  return r;
}

const std::vector<DType> kDTypes{DType::kFloat32, DType::kInt32};

std::vector<testing::HostTensor> tensors(int world, int rank) {
  const auto shapes = rows(world);
  std::vector<testing::HostTensor> t;
  for (std::size_t i = 0; i < kDTypes.size(); ++i) {
    t.push_back(
        testing::make_tensor(kDTypes[i], shapes[static_cast<std::size_t>(rank)][i], 7, rank, i));
  }
  return t;
}

// After a Mismatch or InvalidArgument, the next call on the communicator works.
void expect_usable(Communicator& comm, int world) {
  const auto t = tensors(world, comm.rank());
  const GatherResult out = foreach_all_gather(testing::views_of(t), comm, rows(world));
  EXPECT_EQ(testing::verify_gather(out, rows(world), kDTypes, 7), "");
}

class ProtocolWorld : public ::testing::TestWithParam<int> {};

TEST_P(ProtocolWorld, PlansMovingThePayloadTwoWaysRaiseMismatchBeforeAnythingMoves) {
  const int world = GetParam();
  if (world < 2) {
    GTEST_SKIP() << "one rank cannot disagree with itself";
  }
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const Strategy mine = rank == 0 ? Strategy::kPerTensor : Strategy::kDirect;
        AllGatherPlan plan(kDTypes, rows(world), rank,
                           {.timeout = {}, .preflight = true, .strategy = mine, .copy_threads = 0});
        const auto t = tensors(world, rank);
        std::vector<std::byte> out(plan.output_bytes(), std::byte{0xee});
        const std::uint64_t before = comm.collectives_issued();
        const auto [cls, what] =
            outcome([&] { (void)plan.execute(testing::views_of(t), comm, out); });
        EXPECT_EQ(cls, "Mismatch") << what;
        EXPECT_NE(what.find("strategy differs"), std::string::npos) << what;
        EXPECT_EQ(comm.collectives_issued(), before + 1) << "only the header may have moved";
        for (const std::byte b : out) {
          ASSERT_EQ(b, std::byte{0xee}) << "nothing may be written on a mismatch";
        }
        expect_usable(comm, world);
      },
      test_name());
}

TEST_P(ProtocolWorld, APlanBuiltForAnotherWorldSizeFailsOnEveryRankNamingIt) {
  const int world = GetParam();
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const int bad = world - 1;
        const int planned = rank == bad ? world + 1 : world;
        AllGatherPlan plan(kDTypes, rows(planned), rank);
        const auto t = tensors(world, rank);
        std::vector<std::byte> out(plan.output_bytes());
        const auto start = Clock::now();
        const auto [cls, what] =
            outcome([&] { (void)plan.execute(testing::views_of(t), comm, out); });
        EXPECT_EQ(cls, "InvalidArgument") << what;
        EXPECT_NE(what.find("the plan was built for rank " + std::to_string(bad) + " of " +
                            std::to_string(world + 1)),
                  std::string::npos)
            << what;
        EXPECT_LT(Clock::now() - start, 5s);
        expect_usable(comm, world);
      },
      test_name());
}

TEST_P(ProtocolWorld, TooManyDimsWithoutAHintAreRejectedBeforeThePayload) {
  const int world = GetParam();
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const Shape shape(rank == 0 ? 65 : 2, 1);
        auto t = testing::make_tensor(DType::kUInt8, shape, 1, rank, 0);
        const std::uint64_t before = comm.collectives_issued();
        const auto [cls, what] =
            outcome([&] { (void)foreach_all_gather(std::span(&t.view, 1), comm); });
        EXPECT_EQ(cls, "InvalidArgument") << what;
        EXPECT_NE(what.find("65 dims"), std::string::npos) << what;
        EXPECT_LE(comm.collectives_issued(), before + 1) << "the payload must not have moved";
        expect_usable(comm, world);
      },
      test_name());
}

TEST_P(ProtocolWorld, ANegativeTimeoutOnOneRankFailsTheCallOnEveryRank) {
  const int world = GetParam();
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const auto t = tensors(world, rank);
        const ForeachAllGatherOptions options{.timeout = rank == world - 1 ? std::optional(-5ms)
                                                                           : std::optional(30s)};
        const auto start = Clock::now();
        const auto [cls, what] = outcome(
            [&] { (void)foreach_all_gather(testing::views_of(t), comm, rows(world), options); });
        EXPECT_EQ(cls, "InvalidArgument") << what;
        EXPECT_NE(what.find("timeout must be >= 0"), std::string::npos) << what;
        EXPECT_LT(Clock::now() - start, 5s) << "the peers must not wait out their deadline";
        expect_usable(comm, world);
      },
      test_name());
}

TEST_P(ProtocolWorld, AnEmbeddersFailureReachesEveryRankWithItsMessage) {
  const int world = GetParam();
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const auto t = tensors(world, rank);
        const auto [cls, what] = outcome([&] {
          if (rank == world - 1) {
            fail_call(comm,
                      {.op = Operation::kForeachAllGather, .header_exchanged = true, .timeout = {}},
                      ErrorCode::kInvalidType, "params[3] is a str, not a torch.Tensor");
          }
          (void)foreach_all_gather(testing::views_of(t), comm);
        });
        EXPECT_EQ(cls, "InvalidType") << what;
        EXPECT_NE(what.find("rank " + std::to_string(world - 1)), std::string::npos) << what;
        EXPECT_NE(what.find("params[3] is a str"), std::string::npos) << what;
        expect_usable(comm, world);
      },
      test_name());
}

// A step of a compound operation (Stage) against the same call made on its own, and against
// another step: Mismatch on every rank naming both, before anything moves; an embedder failing
// a step fails the peers' call at that step. The 0-stage and 1-stage cases of every operation
// are in the reliability D rows (D-stage-*).
TEST_P(ProtocolWorld, AStepNeverPairsWithAnotherCallOrStep) {
  const int world = GetParam();
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const auto t = tensors(world, rank);
        const bool odd = rank == world - 1;
        for (const auto& [mine, theirs] :
             {std::pair{"", "quantized unshard: amax"}, std::pair{"a: one", "a: two"}}) {
          const Stage stage(odd ? theirs : mine);
          const std::uint64_t before = comm.collectives_issued();
          const auto [cls, what] = outcome([&] {
            (void)foreach_all_gather(
                testing::views_of(t), comm, rows(world),
                {.timeout = {}, .preflight = true, .strategy = Strategy::kAuto, .stage = stage});
          });
          if (world == 1) {
            EXPECT_EQ(cls, "Ok") << what;
            continue;
          }
          EXPECT_EQ(cls, "Mismatch") << what;
          EXPECT_NE(what.find("operation differs"), std::string::npos) << what;
          EXPECT_NE(what.find(std::string("'") + theirs + "'"), std::string::npos) << what;
          if (*mine != '\0') {
            EXPECT_NE(what.find(std::string("'") + mine + "'"), std::string::npos) << what;
          }
          EXPECT_EQ(comm.collectives_issued() - before, 1U) << "the header alone";
          expect_usable(comm, world);
        }
        const Stage step("WeightSync.sync: state");
        const auto [cls, what] = outcome([&] {
          if (rank == world - 1) {
            fail_call(comm,
                      {.op = Operation::kForeachAllGather,
                       .header_exchanged = true,
                       .timeout = {},
                       .stage = step},
                      ErrorCode::kCountOverflow, "version 2^63 does not fit");
          }
          (void)foreach_all_gather(
              testing::views_of(t), comm, rows(world),
              {.timeout = {}, .preflight = true, .strategy = Strategy::kAuto, .stage = step});
        });
        EXPECT_EQ(cls, "CountOverflow") << what;
        EXPECT_NE(what.find("version 2^63"), std::string::npos) << what;
        expect_usable(comm, world);
      },
      test_name());
}

TEST(Stage, NamesFitTheHeaderOrAreRefused) {
  EXPECT_TRUE(Stage().empty());
  EXPECT_EQ(Stage("ReshardPlan(quantize): payload").name(), "ReshardPlan(quantize): payload");
  EXPECT_EQ(Stage(std::string(Stage::kMaxBytes, 'x')).name().size(), Stage::kMaxBytes);
  EXPECT_THROW(Stage(std::string(Stage::kMaxBytes + 1, 'x')), InvalidArgument);
  EXPECT_THROW(Stage(std::string_view("a\0b", 3)), InvalidArgument);
  EXPECT_EQ(Stage("a"), Stage("a"));
  EXPECT_FALSE(Stage("a") == Stage("b"));
  // A header whose stage is not terminated is corrupt (never read past its field).
  detail::PreflightHeader h;
  std::memset(h.stage, 'x', sizeof h.stage);
  std::vector<std::byte> bytes(sizeof h);
  std::memcpy(bytes.data(), &h, sizeof h);
  try {
    (void)detail::decode_header(bytes, 0);
    ADD_FAILURE() << "an unterminated stage was decoded";
  } catch (const Mismatch& e) {
    EXPECT_NE(std::string(e.what()).find("unterminated stage"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ProtocolWorld, ::testing::Values(1, 2, 3, 4, 7),
                         [](const auto& param_info) {
                           return "w" + std::to_string(param_info.param);
                         });

// A one-shot call with a hint whose collective fails (a peer never comes: Timeout) parks its
// output, its header buffers and its plan's scratch instead of freeing them: MPI may still
// write them. (The one-shot hint path used to free its output here.)
TEST(FailedCalls, ParkWhatTheirCollectivesMayTouch) {
  run_ranks(
      2,
      [](int rank, Communicator& comm) {
        if (rank == 1) {
          return;  // never calls
        }
        const auto t = tensors(2, rank);
        const std::size_t before = detail::parked_count();
        const ForeachAllGatherOptions options{.timeout = 200ms, .preflight = true};
        EXPECT_THROW((void)foreach_all_gather(testing::views_of(t), comm, rows(2), options),
                     Timeout);
        EXPECT_GE(detail::parked_count(), before + 3) << "output, header buffers, plan scratch";
      },
      test_name());
}

// Call::guard keeps every buffer it is given, however many: a failed transfer parks all of them
// (it used to drop a third aligned buffer and a ninth vector without a word).
TEST(FailedCalls, ParkEveryGuardedBufferHoweverMany) {
  run_ranks(
      1,
      [](int, Communicator& comm) {
        constexpr std::size_t kAligned = 5;
        constexpr std::size_t kVectors = 12;
        std::vector<AlignedBuffer> aligned(kAligned);
        std::vector<std::vector<std::byte>> vectors(kVectors);
        detail::Call call(comm, Operation::kForeachAllGather, Stage{}, std::nullopt, false);
        for (auto& b : aligned) {
          call.guard(b);
        }
        for (auto& v : vectors) {
          v.resize(64);
          call.guard(v);
        }
        const std::size_t before = detail::parked_count();
        EXPECT_THROW(call.transfer([] { throw CommunicationError("a peer went away"); }),
                     CommunicationError);
        EXPECT_EQ(detail::parked_count(), before + kAligned + kVectors);
        for (const auto& v : vectors) {
          EXPECT_TRUE(v.empty()) << "a guarded vector was moved to the graveyard";
        }
      },
      test_name());
}

// torch.chunk sizes of a dim near INT64_MAX: ceil(full / world) must not overflow (Z4 found it).
TEST(UnshardSpecs, ChunkSizesNearTheInt64Limit) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  for (const int world : {2, 3, 7}) {
    const std::vector<std::int64_t> sizes = chunk_sizes(kMax, world);
    std::int64_t left = kMax;
    for (const std::int64_t s : sizes) {
      ASSERT_GE(s, 0);
      ASSERT_LE(s, left);
      left -= s;
    }
    EXPECT_EQ(left, 0) << "world " << world;
  }
}

TEST(UnshardSpecs, SizesThatWouldWrapAreACountOverflow) {
  constexpr std::int64_t kHuge = std::int64_t{1} << 62;
  const std::vector<ShardSpec> specs{
      {DType::kFloat32, {4}, 0, {kHuge, kHuge, kHuge, kHuge + 4}, 0}};
  EXPECT_THROW(UnshardPlan(specs, 4, 0), CountOverflow);
}

}  // namespace
}  // namespace shardgather
