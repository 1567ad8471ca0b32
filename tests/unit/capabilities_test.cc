// The strategy layer adapts to what a transport can do (Communicator::capabilities): the same
// cases as the threads suite, over thread ranks wrapped as a transport with no exact gather-v
// (only the equal-size all_gather: the padded move, as c10d's allgather) and as one that
// gathers exactly but does not scatter (Gloo point to point: rank-major, then a copy-out).
#include <chrono>
#include <string>

#include <gtest/gtest.h>

#include "support/cases.h"
#include "support/limited_communicator.h"
#include "support/plan_cases.h"
#include "support/testing.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

using namespace std::chrono_literals;

using testing::LimitedCommunicator;

constexpr Capabilities kEqualSizeOnly{.reads_peer_memory = false,
                                      .small_messages_in_shared_memory = false,
                                      .gather_v = false,
                                      .scatter = false,
                                      .all_to_all = false};
constexpr Capabilities kNoScatter{.reads_peer_memory = false,
                                  .small_messages_in_shared_memory = false,
                                  .gather_v = true,
                                  .scatter = false};

using Param = std::tuple<int, bool>;  // world, exact gather-v

class Limited : public ::testing::TestWithParam<Param> {
 protected:
  void run(const std::function<void(Communicator&)>& body) {
    const auto [world, gather_v] = GetParam();
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    testing::run_ranks(
        world,
        [&body, gather_v = gather_v](int /*rank*/, Communicator& inner) {
          LimitedCommunicator comm(inner, gather_v ? kNoScatter : kEqualSizeOnly);
          body(comm);
        },
        std::string(info->test_suite_name()) + "." + info->name());
  }
};

TEST_P(Limited, ForeachWithAndWithoutAHint) {
  run([](Communicator& comm) {
    testing::case_fsdp_shapes(comm, true, true);
    testing::case_fsdp_shapes(comm, false, true);
    testing::case_edge_shapes(comm);
    testing::case_mixed_dtypes(comm);
    testing::case_non_contiguous(comm);
  });
}

TEST_P(Limited, RandomListsMatchTheReference) {
  if (!std::get<1>(GetParam())) {
    GTEST_SKIP() << "the reference itself calls all_gather_v";
  }
  run([](Communicator& comm) { testing::case_random_vs_reference(comm, 0xcafe, 20); });
}

TEST_P(Limited, PlansWithEveryStrategy) {
  run([](Communicator& comm) { testing::case_plan_steady_state(comm); });
}

TEST_P(Limited, UnshardAlongEveryDim) {
  run([](Communicator& comm) {
    testing::case_unshard_dims(comm);
    testing::case_unshard_single_dim0(comm);
  });
}

TEST_P(Limited, GatherToOneRankNeedsGatherV) {
  run([](Communicator& comm) {
    if (comm.capabilities().gather_v || comm.size() == 1) {
      testing::case_unshard_to_dst(comm);
      testing::case_unshard_stream(comm);
      return;
    }
    const std::vector<ShardSpec> specs{{DType::kFloat32, {8, 3}, 0, {}, 0}};
    UnshardPlan plan(specs, comm.size(), comm.rank(), {}, 0);
    std::vector<float> shard(static_cast<std::size_t>(plan.shard_shape(comm.rank(), 0)[0]) * 3);
    const TensorView view{shard.data(), DType::kFloat32, plan.shard_shape(comm.rank(), 0), {}};
    std::vector<std::byte> out(plan.receives() ? plan.output_bytes() : 0);
    try {
      plan.execute(std::span(&view, 1), comm, out);
      ADD_FAILURE() << "a gather to one rank ran without gather-v";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("exact gather-v"), std::string::npos) << e.what();
    }
  });
}

TEST_P(Limited, DirectResolvesToWhatTheTransportCanDo) {
  run([](Communicator& comm) {
    const int world = comm.size();
    std::vector<std::vector<Shape>> rows;
    for (int r = 0; r < world; ++r) {
      rows.push_back({{r + 1}});
    }
    AllGatherPlan plan(
        std::vector<DType>{DType::kInt32}, rows, comm.rank(),
        {.timeout = {}, .preflight = true, .strategy = Strategy::kDirect, .copy_threads = 0});
    auto t = testing::make_tensor(DType::kInt32, rows[static_cast<std::size_t>(comm.rank())][0], 3,
                                  comm.rank(), 0);
    std::vector<std::byte> out(plan.output_bytes());
    const ExecStats stats = plan.execute(std::span(&t.view, 1), comm, out);
    const Strategy want = comm.capabilities().gather_v ? Strategy::kDirect : Strategy::kPadded;
    EXPECT_EQ(stats.strategy, want) << strategy_name(stats.strategy);
    if (!comm.capabilities().gather_v) {
      EXPECT_THROW(comm.all_gather_v({}, nullptr,
                                     std::vector<std::uint64_t>(static_cast<std::size_t>(world), 0),
                                     std::vector<std::uint64_t>(static_cast<std::size_t>(world), 0),
                                     Clock::now() + 1s),
                   InvalidArgument);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, Limited,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 7), ::testing::Bool()),
                         [](const auto& param_info) {
                           return "w" + std::to_string(std::get<0>(param_info.param)) +
                                  (std::get<1>(param_info.param) ? "_no_scatter"
                                                                 : "_equal_size_only");
                         });

}  // namespace
}  // namespace shardgather
