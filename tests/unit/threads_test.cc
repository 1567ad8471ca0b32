// End-to-end on the threads backend: every shared case at world sizes {1, 2, 3, 4, 7}, plus
// what only threads can show cheaply (deadlines, abort, poisoning).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "support/cases.h"
#include "support/plan_cases.h"
#include "support/testing.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

using namespace std::chrono_literals;
using testing::run_ranks;

class ThreadsWorld : public ::testing::TestWithParam<int> {
 protected:
  void run(const std::function<void(Communicator&)>& fn) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    run_ranks(
        GetParam(), [&](int, Communicator& comm) { fn(comm); },
        std::string(info->test_suite_name()) + "." + info->name());
  }
};

TEST_P(ThreadsWorld, FsdpShapesNoHint) {
  run([](Communicator& c) { testing::case_fsdp_shapes(c, false, true); });
}
TEST_P(ThreadsWorld, FsdpShapesWithHint) {
  run([](Communicator& c) { testing::case_fsdp_shapes(c, true, true); });
}
TEST_P(ThreadsWorld, FsdpShapesWithHintNoPreflight) {
  run([](Communicator& c) { testing::case_fsdp_shapes(c, true, false); });
}
TEST_P(ThreadsWorld, EdgeShapes) { run(testing::case_edge_shapes); }
TEST_P(ThreadsWorld, EmptyList) { run(testing::case_empty_list); }
TEST_P(ThreadsWorld, SingleTensorUnevenNoHint) {
  run([](Communicator& c) { testing::case_single_tensor_uneven(c, false); });
}
TEST_P(ThreadsWorld, SingleTensorUnevenWithHint) {
  run([](Communicator& c) { testing::case_single_tensor_uneven(c, true); });
}
TEST_P(ThreadsWorld, MixedDtypes) { run(testing::case_mixed_dtypes); }
TEST_P(ThreadsWorld, NonContiguous) { run(testing::case_non_contiguous); }
TEST_P(ThreadsWorld, WrongHintRaisesOnEveryRank) { run(testing::case_wrong_hint); }
TEST_P(ThreadsWorld, CountMismatchRaisesOnEveryRank) { run(testing::case_count_mismatch); }
TEST_P(ThreadsWorld, DtypeMismatchRaisesOnEveryRank) { run(testing::case_dtype_mismatch); }
TEST_P(ThreadsWorld, RandomListsMatchPerTensorReference) {
  const std::uint64_t seed = std::uint64_t{0x5eed0000} + static_cast<std::uint64_t>(GetParam());
  std::printf("property test seed %llu\n", static_cast<unsigned long long>(seed));
  run([seed](Communicator& c) { testing::case_random_vs_reference(c, seed, 40); });
}

TEST_P(ThreadsWorld, PlanSteadyState) { run(testing::case_plan_steady_state); }
TEST_P(ThreadsWorld, PlanExecuteShared) { run(testing::case_plan_execute_shared); }
TEST_P(ThreadsWorld, PlanRejectsMismatchedTensors) {
  run(testing::case_plan_rejects_mismatched_tensors);
}
TEST_P(ThreadsWorld, UnshardDims) { run(testing::case_unshard_dims); }
TEST_P(ThreadsWorld, UnshardSingleDim0) { run(testing::case_unshard_single_dim0); }
TEST_P(ThreadsWorld, UnshardAliasing) { run(testing::case_unshard_aliasing); }
TEST_P(ThreadsWorld, UnshardToDst) { run(testing::case_unshard_to_dst); }
TEST_P(ThreadsWorld, DstInPlanOptions) { run(testing::case_dst_in_plan_options); }
TEST_P(ThreadsWorld, UnshardStream) { run(testing::case_unshard_stream); }
TEST_P(ThreadsWorld, UnshardStreamErrors) { run(testing::case_unshard_stream_errors); }
TEST_P(ThreadsWorld, UnshardStreamTimeout) { run(testing::case_unshard_stream_timeout); }

TEST_P(ThreadsWorld, AllToAllScatter) { run(testing::case_all_to_all_scatter); }
TEST_P(ThreadsWorld, HierarchicalFallsBackOnOneHost) { run(testing::case_hierarchical); }
TEST_P(ThreadsWorld, AutoByRule) { run(testing::case_auto_measures); }
TEST_P(ThreadsWorld, ForeachStrategies) { run(testing::case_foreach_strategies); }

INSTANTIATE_TEST_SUITE_P(Worlds, ThreadsWorld, ::testing::Values(1, 2, 3, 4, 7),
                         [](const auto& p) { return "w" + std::to_string(p.param); });

// Simulated hosts (make_thread_group's `hosts`): what depends on which ranks share a host.
class ThreadsHosts : public ::testing::TestWithParam<std::vector<int>> {
 protected:
  void run(const std::function<void(Communicator&)>& fn) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    testing::run_ranks_on_hosts(
        GetParam(), [&](int, Communicator& comm) { fn(comm); },
        std::string(info->test_suite_name()) + "." + info->name());
  }
};

TEST_P(ThreadsHosts, HostsAndRanksOnHost) {
  run([](Communicator& comm) {
    const std::vector<int>& want = GetParam();
    ASSERT_EQ(std::vector<int>(comm.hosts().begin(), comm.hosts().end()), want);
    const int mine = want[static_cast<std::size_t>(comm.rank())];
    EXPECT_EQ(comm.ranks_on_host(), std::count(want.begin(), want.end(), mine));
  });
}
TEST_P(ThreadsHosts, Hierarchical) { run(testing::case_hierarchical); }
TEST_P(ThreadsHosts, HierarchicalDisagreementRaisesOnEveryRank) {
  run(testing::case_hierarchical_disagreement);
}
TEST_P(ThreadsHosts, AutoByRule) { run(testing::case_auto_measures); }
TEST_P(ThreadsHosts, ForeachStrategies) { run(testing::case_foreach_strategies); }
TEST_P(ThreadsHosts, AllToAllScatter) { run(testing::case_all_to_all_scatter); }
TEST_P(ThreadsHosts, PlanSteadyState) { run(testing::case_plan_steady_state); }
TEST_P(ThreadsHosts, UnshardDims) { run(testing::case_unshard_dims); }
TEST_P(ThreadsHosts, UnshardStream) { run(testing::case_unshard_stream); }

// Two hosts of two, interleaved ranks, uneven hosts, one rank per host (kDirect), three hosts.
INSTANTIATE_TEST_SUITE_P(Layouts, ThreadsHosts,
                         ::testing::Values(std::vector<int>{0, 0, 1, 1},
                                           std::vector<int>{0, 1, 0, 1}, std::vector<int>{0, 0, 1},
                                           std::vector<int>{0, 1},
                                           std::vector<int>{0, 0, 0, 1, 1, 2, 2}),
                         [](const auto& p) {
                           std::string name = "h";
                           for (const int h : p.param) {
                             name += std::to_string(h);
                           }
                           return name;
                         });

TEST(ThreadsGroup, RejectsBadHosts) {
  EXPECT_THROW(make_thread_group(2, {0}), InvalidArgument);
  EXPECT_THROW(make_thread_group(2, {1, 0}), InvalidArgument);
  EXPECT_THROW(make_thread_group(3, {0, 2, 1}), InvalidArgument);
  EXPECT_THROW(make_thread_group(2, {0, -1}), InvalidArgument);
}

// Every pair is checked on every rank: a pair whose sizes disagree raises Mismatch everywhere.
TEST(ThreadsGroup, AllToAllScatterMismatchRaisesOnEveryRank) {
  run_ranks(
      3,
      [](int rank, Communicator& comm) {
        std::vector<std::byte> out(8);
        std::vector<std::byte> in(8);
        const ConstSegment seg{out.data(), rank == 2 ? 4U : 8U};
        const RecvPiece piece{in.data(), 8, 1, 0};
        // Rank 0 sends 8 bytes (rank 2: 4) to rank 1, which expects 8 from each.
        const std::vector<ConstSegment> send = {seg};
        const std::vector<std::size_t> to_one = {0, 0, 1, 1};
        const std::vector<std::size_t> to_none = {0, 0, 0, 0};
        std::vector<RecvPiece> pieces;
        std::vector<std::size_t> first = {0, 0, 0, 0};
        if (rank == 1) {
          pieces = {piece, piece};
          first = {0, 1, 1, 2};
        }
        try {
          comm.all_to_all_scatter(rank == 1 ? std::span<const ConstSegment>() : send,
                                  rank == 1 ? to_none : to_one, pieces, first,
                                  comm.deadline_after(std::chrono::seconds(10)));
          ADD_FAILURE() << "rank " << rank << " did not raise";
        } catch (const Mismatch& e) {
          EXPECT_NE(std::string(e.what()).find("rank 2 sends 4 bytes to rank 1, which expects 8"),
                    std::string::npos)
              << e.what();
        }
      },
      "AllToAllScatterMismatch");
}

TEST(ThreadsGroup, RejectsBadWorldSize) {
  EXPECT_THROW(make_thread_group(0), InvalidArgument);
  EXPECT_THROW(make_thread_group(-3), InvalidArgument);
}

TEST(ThreadsGroup, StalledPeerGivesTimeoutThenCommAborted) {
  auto comms = make_thread_group(3);
  std::atomic<int> timeouts{0};
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (int r = 0; r < 2; ++r) {  // rank 2 never enters
    threads.emplace_back([&, r] {
      Communicator& c = *comms[static_cast<std::size_t>(r)];
      c.set_timeout(300ms);
      try {
        foreach_all_gather({}, c);
      } catch (const Timeout&) {
        ++timeouts;
      }
      // Poisoned: fails fast, without waiting.
      const auto t0 = Clock::now();
      EXPECT_THROW(foreach_all_gather({}, c), CommAborted);
      EXPECT_LT(Clock::now() - t0, 10ms);
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  const auto elapsed = Clock::now() - start;
  EXPECT_EQ(timeouts.load(), 2);
  EXPECT_GE(elapsed, 150ms);  // 0.5 T
  EXPECT_LT(elapsed, 5s);
  // A new group works.
  run_ranks(
      3, [](int, Communicator& c) { testing::case_fsdp_shapes(c, false, true); },
      "fresh group after timeout");
}

TEST(ThreadsGroup, AbortWakesBlockedRanks) {
  auto comms = make_thread_group(3);
  std::atomic<int> aborted{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        comms[static_cast<std::size_t>(r)]->barrier(Clock::now() + 30s);
      } catch (const Aborted&) {
        ++aborted;
      }
    });
  }
  std::this_thread::sleep_for(50ms);
  const auto t0 = Clock::now();
  comms[2]->abort();
  for (auto& t : threads) {
    t.join();
  }
  EXPECT_LT(Clock::now() - t0, 1s);
  EXPECT_EQ(aborted.load(), 2);
  EXPECT_TRUE(comms[2]->is_poisoned());
}

TEST(ThreadsGroup, CollectiveCountsAreObservable) {
  run_ranks(
      2,
      [](int, Communicator& c) {
        const auto before = c.collectives_issued();
        c.barrier(c.deadline_after(5s));
        EXPECT_EQ(c.collectives_issued() - before, 1U);
      },
      "counts");
}

// Every plan is built from a communicator by its for_communicator: the same plan as the pure
// constructor given the communicator's size and rank (and, for AllGatherPlan, create's).
TEST_P(ThreadsWorld, EveryPlanIsBuiltFromACommunicatorAlike) {
  run([](Communicator& comm) {
    const int world = comm.size();
    const std::vector<ShardSpec> specs{{DType::kFloat32, {3, 2 * world}, 1, {}, 0}};
    PlanOptions to_last;
    to_last.dst = world - 1;
    const UnshardPlan pure(specs, world, comm.rank(), to_last);
    const UnshardPlan from = UnshardPlan::for_communicator(specs, comm, to_last);
    EXPECT_EQ(from.fingerprint(), pure.fingerprint());
    EXPECT_EQ(from.receives(), comm.rank() == world - 1);
    EXPECT_EQ(from.shard_shape(comm.rank(), 0), pure.shard_shape(comm.rank(), 0));

    std::vector<std::vector<Shape>> shapes(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) {
      shapes[static_cast<std::size_t>(r)] = {Shape{r + 1, 2}};
    }
    auto mine = testing::make_tensor(DType::kFloat32, {comm.rank() + 1, 2}, 7, comm.rank(), 0);
    const AllGatherPlan gather = AllGatherPlan::for_communicator(std::span(&mine.view, 1), comm);
    const std::array<DType, 1> dtypes{DType::kFloat32};
    const AllGatherPlan hinted(dtypes, shapes, comm.rank());
    EXPECT_EQ(gather.output_bytes(), hinted.output_bytes());
    EXPECT_EQ(gather.layout().shapes, hinted.layout().shapes);
    EXPECT_EQ(gather.layout().offsets, hinted.layout().offsets);
  });
}

}  // namespace
}  // namespace shardgather
