// Started (asynchronous) operations on the threads backend: results, ordering, the error
// contract on wait(), abort waking a waiter, and the handle's lifetime rules. Also run under
// TSan (label threads): the progress thread and the caller share plans and communicators.
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "support/test_name.h"
#include "support/testing.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

using namespace std::chrono_literals;
using testing::make_tensor;
using testing::run_ranks;

using testing::test_name;

// Rank r's shapes: uneven rows, so every rank's block differs.
std::vector<std::vector<Shape>> shapes_for(int world) {
  std::vector<std::vector<Shape>> shapes;
  for (int r = 0; r < world; ++r) {
    shapes.push_back({{r + 1, 3}, {2 * r}, {4}});
  }
  return shapes;
}

const std::vector<DType> kDTypes{DType::kFloat32, DType::kBFloat16, DType::kInt64};

std::vector<testing::HostTensor> tensors_for(int world, int rank, std::uint64_t seed) {
  std::vector<testing::HostTensor> t;
  const auto shapes = shapes_for(world);
  for (std::size_t i = 0; i < kDTypes.size(); ++i) {
    t.push_back(make_tensor(kDTypes[i], shapes[static_cast<std::size_t>(rank)][i], seed, rank, i));
  }
  return t;
}

class AsyncWorld : public ::testing::TestWithParam<int> {};

TEST_P(AsyncWorld, StartedForeachAndUnshardMatchBlockingCalls) {
  const int world = GetParam();
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const auto tensors = tensors_for(world, rank, 11);
        const std::vector<TensorView> views = testing::views_of(tensors);
        Work<GatherResult> with_hint = start_foreach_all_gather(views, comm, shapes_for(world));
        Work<GatherResult> without = start_foreach_all_gather(views, comm);
        const GatherResult a = with_hint.wait();
        const GatherResult b = without.wait();
        EXPECT_EQ(testing::verify_gather(a, shapes_for(world), kDTypes, 11), "");
        EXPECT_EQ(testing::verify_gather(b, shapes_for(world), kDTypes, 11), "");
        EXPECT_FALSE(with_hint.valid());
        EXPECT_THROW((void)with_hint.wait(), InvalidArgument);  // waited once already

        const std::vector<ShardSpec> specs{{DType::kFloat32, {5, 2 * world}, 1, {}, 0}};
        const UnshardPlan plan(specs, world, rank);
        auto shard = make_tensor(DType::kFloat32, plan.shard_shape(rank, 0), 5, rank, 0);
        const UnshardResult blocking = unshard(std::span(&shard.view, 1), comm, specs);
        const UnshardResult started = start_unshard(std::span(&shard.view, 1), comm, specs).wait();
        EXPECT_EQ(std::memcmp(blocking[0].data, started[0].data,
                              static_cast<std::size_t>(5 * 2 * world * 4)),
                  0);
      },
      test_name());
}

TEST_P(AsyncWorld, StartedPlanExecutionsCompleteInOrderAndOverlapTheCaller) {
  const int world = GetParam();
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const AllGatherPlan plan(kDTypes, shapes_for(world), rank);
        AllGatherPlan& p = const_cast<AllGatherPlan&>(plan);
        constexpr int kSteps = 6;
        std::vector<std::vector<testing::HostTensor>> inputs;
        std::vector<std::vector<std::byte>> outs;
        for (int k = 0; k < kSteps; ++k) {
          inputs.push_back(tensors_for(world, rank, 100 + static_cast<std::uint64_t>(k)));
          outs.emplace_back(plan.output_bytes());
        }
        std::vector<Work<ExecStats>> works;
        for (std::size_t k = 0; k < kSteps; ++k) {
          const std::vector<TensorView> views = testing::views_of(inputs[k]);
          works.push_back(p.start(views, comm, outs[k]));
        }
        // The caller is free meanwhile; a blocking call queues behind the started ones.
        const auto extra = tensors_for(world, rank, 999);
        const GatherResult after = foreach_all_gather(testing::views_of(extra), comm);
        for (auto& w : works) {
          EXPECT_TRUE(w.test(0ms));  // every started one completed before the blocking call ran
          EXPECT_TRUE(w.is_completed());  // the poll says the same
          (void)w.wait();
          EXPECT_TRUE(w.is_completed()) << "an empty handle has nothing left to complete";
        }
        EXPECT_EQ(testing::verify_gather(after, shapes_for(world), kDTypes, 999), "");
        for (int k = 0; k < kSteps; ++k) {
          const std::vector<TensorView> got = plan.views(outs[static_cast<std::size_t>(k)].data());
          for (int r = 0; r < world; ++r) {
            for (std::size_t i = 0; i < kDTypes.size(); ++i) {
              const auto want =
                  make_tensor(kDTypes[i], shapes_for(world)[static_cast<std::size_t>(r)][i],
                              100 + static_cast<std::uint64_t>(k), r, i);
              const TensorView& v =
                  got[i * static_cast<std::size_t>(world) + static_cast<std::size_t>(r)];
              const std::uint64_t bytes = checked_nbytes(kDTypes[i], want.view.shape);
              ASSERT_EQ(std::memcmp(v.data, want.view.data, bytes), 0)
                  << "step " << k << " rank " << r << " tensor " << i;
            }
          }
        }
      },
      test_name());
}

TEST_P(AsyncWorld, ALocalErrorIsRethrownOnEveryRanksWait) {
  const int world = GetParam();
  if (world < 2) {
    GTEST_SKIP() << "needs peers";
  }
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        auto tensors = tensors_for(world, rank, 3);
        std::vector<TensorView> views = testing::views_of(tensors);
        if (rank == world - 1) {
          views[1].shape = {99};  // not this rank's row of the hint: a local check fails
        }
        Work<GatherResult> work = start_foreach_all_gather(views, comm, shapes_for(world));
        try {
          (void)work.wait();
          ADD_FAILURE() << "rank " << rank << ": wait() returned";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("failed on rank " + std::to_string(world - 1)),
                    std::string::npos)
              << e.what();
        }
        // The communicator stays usable after an argument error.
        const auto good = tensors_for(world, rank, 4);
        const GatherResult ok = start_foreach_all_gather(testing::views_of(good), comm).wait();
        EXPECT_EQ(testing::verify_gather(ok, shapes_for(world), kDTypes, 4), "");
      },
      test_name());
}

TEST_P(AsyncWorld, AbortWakesAWaiterAndFailsWhatIsQueued) {
  const int world = GetParam();
  if (world < 2) {
    GTEST_SKIP() << "needs peers";
  }
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const auto tensors = tensors_for(world, rank, 8);
        const std::vector<TensorView> views = testing::views_of(tensors);
        if (rank == 0) {
          // Rank 0 never joins: the others' started calls block until rank 1 aborts.
          std::this_thread::sleep_for(300ms);
          comm.abort();
          return;
        }
        const ForeachAllGatherOptions options{.timeout = 60s};
        Work<GatherResult> first = start_foreach_all_gather(views, comm, {}, options);
        Work<GatherResult> queued = start_foreach_all_gather(views, comm, {}, options);
        EXPECT_FALSE(first.test(50ms));
        const auto begin = Clock::now();
        if (rank == 1) {
          std::this_thread::sleep_for(200ms);
          comm.abort();
        }
        EXPECT_THROW((void)first.wait(), CommunicationError);
        EXPECT_THROW((void)queued.wait(), CommunicationError);
        EXPECT_LT(Clock::now() - begin, 10s) << "abort must wake the waiter, not the deadline";
      },
      test_name());
}

TEST_P(AsyncWorld, DestroyingAnIncompleteHandleWaitsForIt) {
  const int world = GetParam();
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const AllGatherPlan plan(kDTypes, shapes_for(world), rank);
        AllGatherPlan& p = const_cast<AllGatherPlan&>(plan);
        for (int k = 0; k < 20; ++k) {
          const auto tensors = tensors_for(world, rank, static_cast<std::uint64_t>(k));
          std::vector<std::byte> out(plan.output_bytes());
          {
            Work<ExecStats> dropped = p.start(testing::views_of(tensors), comm, out);
          }  // waits: `out` and `tensors` are freed only after the gather completed
          const std::vector<TensorView> got = plan.views(out.data());
          const auto want =
              make_tensor(kDTypes[0], shapes_for(world)[0][0], static_cast<std::uint64_t>(k), 0, 0);
          ASSERT_EQ(
              std::memcmp(got[0].data, want.view.data, checked_nbytes(kDTypes[0], want.view.shape)),
              0);
        }
      },
      test_name());
}

// Misuse, but never a crash: two threads calling on one communicator at once are serialised.
// Rank 0's calls come from two threads, its peers' from one; every call gathers the same shapes,
// so every pairing is a correct gather.
TEST_P(AsyncWorld, TwoThreadsOnOneCommunicatorAreSerialised) {
  const int world = GetParam();
  constexpr int kPerThread = 40;
  run_ranks(
      world,
      [world](int rank, Communicator& comm) {
        const auto tensors = tensors_for(world, rank, 21);
        const std::vector<TensorView> views = testing::views_of(tensors);
        const auto calls = [&](int n) {
          for (int k = 0; k < n; ++k) {
            const GatherResult out = foreach_all_gather(views, comm, shapes_for(world));
            ASSERT_EQ(testing::verify_gather(out, shapes_for(world), kDTypes, 21), "");
          }
        };
        if (rank != 0) {
          calls(2 * kPerThread);
          return;
        }
        std::thread other([&] { calls(kPerThread); });
        calls(kPerThread);
        other.join();
      },
      test_name());
}

INSTANTIATE_TEST_SUITE_P(Worlds, AsyncWorld, ::testing::Values(1, 2, 3, 4, 7),
                         [](const auto& param_info) {
                           return "w" + std::to_string(param_info.param);
                         });

}  // namespace
}  // namespace shardgather
