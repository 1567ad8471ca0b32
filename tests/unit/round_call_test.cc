// A compound operation's call of rounds (round_call.h) on the threads backend: one call per
// operation however many rounds, every rank's row and message delivered, and a failure recorded
// between rounds raised by every rank at the next round.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
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
using testing::outcome;
using testing::run_ranks;

using testing::test_name;

// What rank s sends rank d: (s * 7 + d) % 5 * 100 + s bytes (some empty), each byte s ^ d.
std::size_t message_bytes(int s, int d) {
  const int n = ((s * 7 + d) % 5) * 100 + s;
  return static_cast<std::size_t>(n);
}

// Row r, column c of a round's [world x width] table.
std::int64_t cell(std::span<const std::int64_t> table, std::size_t width, int r, int c) {
  return table[static_cast<std::size_t>(r) * width + static_cast<std::size_t>(c)];
}

class RoundCallWorld : public ::testing::TestWithParam<int> {};

TEST_P(RoundCallWorld, EveryRoundIsOneCallsAndEveryRankGetsEveryRowAndMessage) {
  const int world = GetParam();
  run_ranks(
      world,
      [&](int rank, Communicator& comm) {
        std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(world));
        std::vector<std::span<const std::byte>> outgoing;
        for (int d = 0; d < world; ++d) {
          auto& m = out[static_cast<std::size_t>(d)];
          m.assign(message_bytes(rank, d), static_cast<std::byte>(rank ^ d));
          outgoing.emplace_back(m);
        }
        std::vector<std::byte> recv;
        for (int step = 0; step < 3; ++step) {
          const std::uint64_t calls = comm.calls_issued();
          const std::uint64_t collectives = comm.collectives_issued();
          RoundCall call(comm, Operation::kWeightSync, "test", 5s, 3);
          EXPECT_GE(call.width(), static_cast<std::size_t>(world));
          call.open("first");
          const std::vector<std::int64_t> row{rank, 10 * rank + step};
          const auto table = call.rows(row, "state");
          for (int r = 0; r < world; ++r) {
            EXPECT_EQ(cell(table, call.width(), r, 0), r);
            EXPECT_EQ(cell(table, call.width(), r, 1), 10 * r + step);
            EXPECT_EQ(cell(table, call.width(), r, 2), 0) << "zero-padded";
          }
          const auto got = call.messages(outgoing, "payload", recv.size(), [&](std::size_t n) {
            recv.resize(n);
            return std::span<std::byte>(recv);
          });
          std::size_t at = 0;
          for (int s = 0; s < world; ++s) {
            for (int d = 0; d < world; ++d) {
              EXPECT_EQ(cell(got.sizes, call.width(), s, d),
                        static_cast<std::int64_t>(message_bytes(s, d)));
            }
            if (s == rank) {
              continue;
            }
            for (std::size_t k = 0; k < message_bytes(s, rank); ++k) {
              ASSERT_EQ(got.received[at + k], static_cast<std::byte>(s ^ rank)) << s;
            }
            at += message_bytes(s, rank);
          }
          EXPECT_EQ(got.received.size(), at);
          EXPECT_EQ(comm.calls_issued() - calls, 1U) << "one call, whatever its rounds";
          // open, state, payload sizes and the payload; the first time, a buffer grows, and a
          // header-only round ("payload ready") lets its allocation fail on every rank
          const std::uint64_t want = world == 1 ? 0U : step == 0 ? 5U : 4U;
          EXPECT_EQ(comm.collectives_issued() - collectives, want) << step;
        }
      },
      test_name());
}

TEST_P(RoundCallWorld, AFailureBetweenRoundsIsRaisedByEveryRankAtTheNextRound) {
  const int world = GetParam();
  run_ranks(
      world,
      [&](int rank, Communicator& comm) {
        const bool odd = rank == world - 1;
        for (const char* where : {"open", "rows", "messages"}) {
          const auto [cls, what] = outcome([&] {
            RoundCall call(comm, Operation::kWeightSync, "test", 5s, 2);
            const std::string w = where;
            if (odd && w == "open") {
              call.fail(ErrorCode::kCountOverflow, "version 2^63 does not fit");
            }
            call.open("state");
            const std::vector<std::int64_t> row{1};
            (void)call.rows(row, "state");
            if (odd && w == "rows") {
              call.fail(ErrorCode::kInvalidType, "sources[2] is a str");
            }
            (void)call.rows(row, "vote");
            if (odd && w == "messages") {
              call.fail(ErrorCode::kOutOfMemory, "no room for the records");
            }
            const std::vector<std::span<const std::byte>> none(static_cast<std::size_t>(world));
            (void)call.messages(none, "payload", 0,
                                [](std::size_t) { return std::span<std::byte>(); });
          });
          const std::string w = where;
          const char* want = w == "open"   ? "CountOverflow"
                             : w == "rows" ? "InvalidType"
                                           : "OutOfMemory";
          EXPECT_EQ(cls, want) << where << ": " << what;
          const char* text = w == "open"   ? "version 2^63"
                             : w == "rows" ? "sources[2] is a str"
                                           : "no room for the records";
          EXPECT_NE(what.find(text), std::string::npos) << what;
          if (world > 1) {
            EXPECT_NE(what.find("rank " + std::to_string(world - 1)), std::string::npos) << what;
            const char* step = w == "open"   ? "'test: state'"
                               : w == "rows" ? "'test: vote'"
                                             : "'test: payload sizes'";
            EXPECT_NE(what.find(step), std::string::npos) << what;
          }
        }
        // The communicator works after each.
        RoundCall call(comm, Operation::kWeightSync, "test", 5s, 1);
        call.open("state");
        const std::vector<std::int64_t> row{rank};
        EXPECT_EQ(call.rows(row, "state")[0], 0);
      },
      test_name());
}

TEST_P(RoundCallWorld, RanksInDifferentRoundsOrOperationsRaiseMismatchNamingTheSteps) {
  const int world = GetParam();
  if (world == 1) {
    GTEST_SKIP() << "nothing to disagree with";
  }
  run_ranks(
      world,
      [&](int rank, Communicator& comm) {
        const bool odd = rank == world - 1;
        const std::vector<std::int64_t> row{rank};
        {  // the last rank skipped a round
          const auto [cls, what] = outcome([&] {
            RoundCall call(comm, Operation::kWeightSync, "test", 5s, 1);
            call.open("state");
            (void)call.rows(row, odd ? "vote" : "payload sizes");
          });
          EXPECT_EQ(cls, "Mismatch") << what;
          EXPECT_NE(what.find("'test: vote'"), std::string::npos) << what;
          EXPECT_NE(what.find("'test: payload sizes'"), std::string::npos) << what;
        }
        {  // the last rank makes a call of rounds, the others a gather of their own
          const std::vector<testing::HostTensor> t{
              testing::make_tensor(DType::kFloat32, {2}, 7, rank, 0)};
          const auto [cls, what] = outcome([&] {
            if (odd) {
              RoundCall call(comm, Operation::kWeightSync, "test", 5s, 1);
              call.open("state");
            } else {
              (void)foreach_all_gather(testing::views_of(t), comm);
            }
          });
          EXPECT_EQ(cls, "Mismatch") << what;
          EXPECT_NE(what.find("operation differs"), std::string::npos) << what;
          EXPECT_NE(what.find("WeightSync::sync (as the step 'test: state')"), std::string::npos)
              << what;
        }
        RoundCall call(comm, Operation::kWeightSync, "test", 5s, 1);
        call.open("state");
        EXPECT_EQ(call.rows(row, "state")[0], 0) << "usable after";
      },
      test_name());
}

TEST_P(RoundCallWorld, AReceiveBufferThatCannotGrowFailsEveryRankBeforeAnyByteMoves) {
  const int world = GetParam();
  if (world == 1) {
    GTEST_SKIP() << "nothing is received";
  }
  run_ranks(
      world,
      [&](int rank, Communicator& comm) {
        const bool odd = rank == world - 1;
        const std::vector<std::byte> m(1000, std::byte{7});
        const std::vector<std::span<const std::byte>> outgoing(static_cast<std::size_t>(world), m);
        const std::uint64_t moved = comm.exchange_bytes_received();
        const auto [cls, what] = outcome([&] {
          RoundCall call(comm, Operation::kWeightSync, "test", 5s, 1);
          call.open("state");
          (void)call.messages(outgoing, "payload", 0, [&](std::size_t n) -> std::span<std::byte> {
            if (odd) {
              throw std::bad_alloc();
            }
            static thread_local std::vector<std::byte> recv;
            recv.resize(n);
            return recv;
          });
        });
        EXPECT_EQ(cls, "OutOfMemory") << what;
        EXPECT_NE(what.find("failed on rank " + std::to_string(world - 1)), std::string::npos)
            << what;
        EXPECT_NE(what.find("'test: payload ready'"), std::string::npos) << what;
        EXPECT_EQ(comm.exchange_bytes_received(), moved) << "no byte moved";
        // A width that differs, and a round before the opening: refused, the group usable.
        const auto [cls2, what2] = outcome([&] {
          RoundCall call(comm, Operation::kWeightSync, "test", 5s,
                         odd ? static_cast<std::size_t>(world) + 2 : 1);
          call.open("state");
        });
        EXPECT_EQ(cls2, "Mismatch") << what2;
        EXPECT_NE(what2.find("the call's rows differ"), std::string::npos) << what2;
        RoundCall early(comm, Operation::kWeightSync, "test", 5s, 1);
        EXPECT_THROW((void)early.rows({}, "state"), InvalidArgument);
        early.open("state");
        const std::vector<std::int64_t> row{rank};
        EXPECT_EQ(early.rows(row, "state")[0], 0) << "usable after";
      },
      test_name());
}

INSTANTIATE_TEST_SUITE_P(Worlds, RoundCallWorld, ::testing::Values(1, 2, 3, 5));

// The call has one deadline, from when it is made: a round after a long local step waits only
// for what is left of it (per round, it would wait a whole timeout again). Rank 1 never comes to
// the second round; rank 0 enters it 60% into the timeout and must raise at the call's deadline.
TEST(RoundCallDeadline, EveryRoundEndsByTheCallsOneDeadline) {
  constexpr auto kTimeout = 2000ms;
  std::atomic<bool> done{false};
  run_ranks(
      2,
      [&](int rank, Communicator& comm) {
        if (rank == 1) {
          RoundCall call(comm, Operation::kWeightSync, "test", kTimeout, 1);
          call.open("state");
          const auto until = std::chrono::steady_clock::now() + 4 * kTimeout;
          while (!done && std::chrono::steady_clock::now() < until) {
            std::this_thread::sleep_for(10ms);
          }
          return;
        }
        const auto made = std::chrono::steady_clock::now();
        const auto [cls, what] = outcome([&] {
          RoundCall call(comm, Operation::kWeightSync, "test", kTimeout, 1);
          call.open("state");
          std::this_thread::sleep_for(kTimeout * 6 / 10);  // the embedder's own step
          (void)call.rows({}, "vote");
        });
        const auto took = std::chrono::steady_clock::now() - made;
        done = true;
        EXPECT_EQ(cls, "Timeout") << what;
        EXPECT_NE(what.find("(in round 'test: vote')"), std::string::npos) << what;
        // By the call's deadline (2 s), not the vote's own (3.2 s); the margin is for a slow
        // sanitized run.
        EXPECT_GE(took, kTimeout * 9 / 10);
        EXPECT_LT(took, kTimeout * 14 / 10);
      },
      test_name());
}

}  // namespace
}  // namespace shardgather
