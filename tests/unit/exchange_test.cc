// The exchange job (src/strategies/strategy.h): the three shapes through the strategy layer on
// the threads backend, each byte checked. The personal shape is what a reshard will build; here
// it is built by hand, with uneven pairs, empty pairs, and pieces that are strided.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ops/call.h"
#include "ops/payload.h"
#include "strategies/strategy.h"
#include "support/test_name.h"
#include "support/testing.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

using detail::ExchangeJob;
using detail::ExchangeShape;
using testing::run_ranks;

using testing::test_name;

// Bytes rank `from` sends rank `to`: uneven, and nothing for some pairs (including to oneself).
std::uint64_t pair_bytes(int from, int to) {
  return static_cast<std::uint64_t>((from * 7 + to * 3) % 5) * 24;
}

std::byte pattern(int from, int to, std::uint64_t k) {
  return static_cast<std::byte>((from * 37 + to * 11 + static_cast<int>(k)) & 0xff);
}

// One rank's side of a personal exchange: to each peer one or two send segments; from each peer
// a strided piece (half the bytes, in blocks of 8 every 16) and a contiguous one (the rest).
struct PersonalSide {
  std::vector<std::vector<std::byte>> outgoing;  // per peer
  std::vector<ConstSegment> send;
  std::vector<std::size_t> send_first;
  std::vector<std::byte> landing;  // per peer: 2 * strided half + rest, back to back
  std::vector<std::uint64_t> landing_at;
  std::vector<RecvPiece> pieces;
  std::vector<std::size_t> first;
  std::vector<std::uint64_t> counts;

  PersonalSide(int me, int world) {
    outgoing.resize(static_cast<std::size_t>(world));
    for (int p = 0; p < world; ++p) {
      send_first.push_back(send.size());
      auto& bytes = outgoing[static_cast<std::size_t>(p)];
      for (std::uint64_t k = 0; k < pair_bytes(me, p); ++k) {
        bytes.push_back(pattern(me, p, k));
      }
      const std::size_t half = bytes.size() / 2;
      if (half != 0) {
        send.push_back({bytes.data(), half});
        send.push_back({bytes.data() + half, bytes.size() - half});
      }
    }
    send_first.push_back(send.size());
    std::uint64_t total = 0;
    for (int q = 0; q < world; ++q) {
      landing_at.push_back(total);
      total += 2 * pair_bytes(q, me);
    }
    landing.assign(total, std::byte{0});
    for (int q = 0; q < world; ++q) {
      first.push_back(pieces.size());
      const std::uint64_t n = pair_bytes(q, me);
      counts.push_back(n);
      std::byte* at = landing.data() + landing_at[static_cast<std::size_t>(q)];
      const std::uint64_t strided = n / 2;  // a multiple of 8: n is a multiple of 24... or 0
      if (strided != 0) {
        pieces.push_back({at, 4, strided / 4, 8});
      }
      if (n - strided != 0) {
        pieces.push_back({at + 2 * strided, n - strided, 1, 0});
      }
    }
    first.push_back(pieces.size());
  }

  [[nodiscard]] ExchangeJob job() const {
    return ExchangeJob{.shape = ExchangeShape::kPersonal,
                       .send = send,
                       .send_first = send_first,
                       .pieces = pieces,
                       .first = first,
                       .counts = counts};
  }

  // Every byte from every peer where its pieces say, and the strided gaps untouched.
  [[nodiscard]] std::string verify(int me, int world) const {
    for (int q = 0; q < world; ++q) {
      const std::uint64_t n = pair_bytes(q, me);
      const std::byte* at = landing.data() + landing_at[static_cast<std::size_t>(q)];
      const std::uint64_t strided = n / 2;
      for (std::uint64_t k = 0; k < n; ++k) {
        const std::uint64_t where = k < strided ? (k / 4) * 8 + k % 4 : 2 * strided + k - strided;
        if (at[where] != pattern(q, me, k)) {
          return "rank " + std::to_string(me) + ": byte " + std::to_string(k) + " from rank " +
                 std::to_string(q) + " is wrong";
        }
      }
      for (std::uint64_t k = 0; k < strided; ++k) {
        if (at[(k / 4) * 8 + 4 + k % 4] != std::byte{0}) {
          return "rank " + std::to_string(me) + ": a gap of the strided piece was written";
        }
      }
    }
    return "";
  }
};

class Exchange : public ::testing::TestWithParam<int> {};

TEST_P(Exchange, PersonalMovesEachPairsBytesIntoStridedPieces) {
  run_ranks(
      GetParam(),
      [](int me, Communicator& comm) {
        const PersonalSide side(me, comm.size());
        detail::StrategyScratch scratch;
        const Strategy s = detail::select_strategy(Strategy::kAuto, ExchangeShape::kPersonal,
                                                   side.counts, comm, false);
        EXPECT_EQ(s, Strategy::kDirect);
        detail::run_strategy(s, side.job(), comm, comm.deadline_after(comm.timeout()), scratch);
        EXPECT_EQ(side.verify(me, comm.size()), "");
      },
      test_name());
}

TEST_P(Exchange, StrategiesThatRunOnlyAllGathersResolveToDirectForOtherShapes) {
  run_ranks(
      GetParam(),
      [](int, Communicator& comm) {
        const std::vector<std::uint64_t> counts(static_cast<std::size_t>(comm.size()), 8);
        for (const Strategy asked :
             {Strategy::kAuto, Strategy::kPacked, Strategy::kPerTensor, Strategy::kShared,
              Strategy::kPadded, Strategy::kHierarchical, Strategy::kDirect}) {
          for (const ExchangeShape shape : {ExchangeShape::kGather, ExchangeShape::kPersonal}) {
            EXPECT_EQ(detail::select_strategy(asked, shape, counts, comm, false), Strategy::kDirect)
                << strategy_name(asked);
            EXPECT_EQ(detail::runs_shape(asked, shape), asked == Strategy::kDirect);
          }
          EXPECT_TRUE(detail::runs_shape(asked, ExchangeShape::kAllGather));
        }
      },
      test_name());
}

TEST_P(Exchange, AStrategyGivenAShapeItDoesNotRunRefusesBeforeMovingAByte) {
  run_ranks(
      GetParam(),
      [](int me, Communicator& comm) {
        PersonalSide side(me, comm.size());
        detail::StrategyScratch scratch;
        EXPECT_THROW(detail::run_strategy(Strategy::kPacked, side.job(), comm,
                                          comm.deadline_after(comm.timeout()), scratch),
                     InvalidArgument);
        for (const std::byte b : side.landing) {
          ASSERT_EQ(b, std::byte{0});
        }
      },
      test_name());
}

// A gather to one rank: only the root's pieces are written; its why names the shape.
TEST_P(Exchange, GatherLandsEveryStreamAtTheRootOnly) {
  run_ranks(
      GetParam(),
      [](int me, Communicator& comm) {
        const int world = comm.size();
        const int root = world - 1;
        std::vector<std::uint64_t> counts;
        for (int r = 0; r < world; ++r) {
          counts.push_back(static_cast<std::uint64_t>(r + 1) * 16);
        }
        std::vector<std::byte> mine(counts[static_cast<std::size_t>(me)]);
        for (std::uint64_t k = 0; k < mine.size(); ++k) {
          mine[k] = pattern(me, root, k);
        }
        const ConstSegment send{mine.data(), mine.size()};
        std::vector<std::byte> out(
            me == root ? static_cast<std::size_t>(16 * world * (world + 1) / 2) : 0);
        std::vector<RecvPiece> pieces;
        std::vector<std::size_t> first;
        std::uint64_t at = 0;
        for (int r = 0; r < world; ++r) {
          first.push_back(pieces.size());
          if (me == root) {
            pieces.push_back({out.data() + at, counts[static_cast<std::size_t>(r)], 1, 0});
          }
          at += counts[static_cast<std::size_t>(r)];
        }
        first.push_back(pieces.size());
        detail::StrategyScratch scratch;
        const char* why = "";
        const Strategy s = detail::plan_strategy(Strategy::kAuto, ExchangeShape::kGather, counts,
                                                 comm, scratch, why);
        EXPECT_STREQ(why, "a gather to one rank moves direct");
        const ExchangeJob job{.shape = ExchangeShape::kGather,
                              .send = std::span(&send, 1),
                              .pieces = pieces,
                              .first = first,
                              .counts = counts,
                              .root = root};
        detail::run_strategy(s, job, comm, comm.deadline_after(comm.timeout()), scratch);
        if (me == root) {
          std::uint64_t k = 0;
          for (int r = 0; r < world; ++r) {
            for (std::uint64_t j = 0; j < counts[static_cast<std::size_t>(r)]; ++j, ++k) {
              ASSERT_EQ(out[k], pattern(r, root, j)) << "from rank " << r;
            }
          }
        }
      },
      test_name());
}

// Through run_payload, as a plan will run it: rank 0 receives nothing but sends to the last
// rank. Its counts (what it receives) are all zero, yet it must not skip the exchange, or the
// last rank would wait for it until the deadline.
TEST_P(Exchange, APersonalJobRunsOnARankThatOnlySends) {
  run_ranks(
      GetParam(),
      [](int me, Communicator& comm) {
        const int world = comm.size();
        const int last = world - 1;
        const std::vector<std::byte> mine(40, std::byte{0x5a});
        std::vector<ConstSegment> send;
        std::vector<std::size_t> send_first;
        std::vector<std::byte> landing(me == last ? mine.size() : 0);
        std::vector<RecvPiece> pieces;
        std::vector<std::size_t> first;
        std::vector<std::uint64_t> counts(static_cast<std::size_t>(world), 0);
        for (int p = 0; p < world; ++p) {
          send_first.push_back(send.size());
          if (me == 0 && p == last) {
            send.push_back({mine.data(), mine.size()});
          }
          first.push_back(pieces.size());
          if (me == last && p == 0) {
            pieces.push_back({landing.data(), landing.size(), 1, 0});
            counts[0] = landing.size();
          }
        }
        send_first.push_back(send.size());
        first.push_back(pieces.size());
        const ExchangeJob job{.shape = ExchangeShape::kPersonal,
                              .send = send,
                              .send_first = send_first,
                              .pieces = pieces,
                              .first = first,
                              .counts = counts};
        detail::Call call(comm, Operation::kForeachAllGather, Stage{},
                          std::chrono::milliseconds(5000), false);
        detail::StrategyScratch scratch;
        ExecStats stats;
        detail::run_payload(call, Strategy::kAuto, Strategy::kDirect, job, scratch, stats);
        if (me == last) {
          EXPECT_EQ(landing, mine);
        }
      },
      test_name());
}

INSTANTIATE_TEST_SUITE_P(Worlds, Exchange, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return "w" + std::to_string(param_info.param);
                         });

}  // namespace
}  // namespace shardgather
