// The host mailbox (src/transport/host_mailbox.h) on thread ranks: every rank maps the shared
// object itself, so the slots, the futex and the parity reuse are the ones processes use
// (tests/mpi runs it across processes, tests/python through Gloo groups, with a peer that exits).
#include "transport/host_mailbox.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "support/cases.h"
#include "support/testing.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

using namespace std::chrono_literals;
using detail::HostMailbox;
using testing::run_ranks;

// fn(rank, comm, mailbox) on `world` thread ranks, each with its own mailbox over its rank.
void with_mailboxes(int world, const std::function<void(int, Communicator&, HostMailbox&)>& fn) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  run_ranks(
      world,
      [&fn](int rank, Communicator& comm) {
        const auto box = HostMailbox::create(comm, Clock::now() + 10s);
        ASSERT_NE(box, nullptr);
        fn(rank, comm, *box);
      },
      std::string(info->test_suite_name()) + "." + info->name());
}

// A communicator that forwards to a thread rank but composes the mailbox, as the torch
// ProcessGroup backend does: small all_gathers and barriers go through it.
class MailboxCommunicator final : public Communicator {
 public:
  // The mailbox's setup exchanges go over `inner` (mailbox_ is still null while they run).
  explicit MailboxCommunicator(Communicator& inner) : inner_(inner) {
    mailbox_ = HostMailbox::create(*this, Clock::now() + 10s);
  }
  MailboxCommunicator(const MailboxCommunicator&) = delete;
  MailboxCommunicator& operator=(const MailboxCommunicator&) = delete;
  MailboxCommunicator(MailboxCommunicator&&) = delete;
  MailboxCommunicator& operator=(MailboxCommunicator&&) = delete;
  ~MailboxCommunicator() override { finish_operations(); }
  [[nodiscard]] bool uses_host_mailbox() const noexcept { return mailbox_ != nullptr; }
  [[nodiscard]] int rank() const noexcept override { return inner_.rank(); }
  [[nodiscard]] int size() const noexcept override { return inner_.size(); }
  [[nodiscard]] std::string_view backend_name() const noexcept override { return "forwarding"; }
  [[nodiscard]] int ranks_on_host() const noexcept override { return inner_.ranks_on_host(); }
  [[nodiscard]] std::span<const int> hosts() const noexcept override { return inner_.hosts(); }
  [[nodiscard]] Capabilities capabilities() const noexcept override {
    return {.reads_peer_memory = false, .small_messages_in_shared_memory = mailbox_ != nullptr};
  }

 protected:
  void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                     Deadline deadline) override {
    if (mailbox_ != nullptr && send.size() <= HostMailbox::kSlotBytes) {
      mailbox_->all_gather(send, recv, deadline, [this] { check_interrupt(); });
      return;
    }
    inner_.all_gather(send, recv, deadline);
  }
  void do_all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                       std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                       Deadline deadline) override {
    inner_.all_gather_v(send, recv, counts, displs, deadline);
  }
  void do_all_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                             std::span<const std::size_t> first,
                             std::span<const std::uint64_t> counts, Deadline deadline) override {
    inner_.all_gather_scatter(send, pieces, first, counts, deadline);
  }
  void do_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                         std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                         int root, Deadline deadline) override {
    inner_.gather_scatter(send, pieces, first, counts, root, deadline);
  }
  void do_all_to_all_scatter(std::span<const ConstSegment> send,
                             std::span<const std::size_t> send_first,
                             std::span<const RecvPiece> pieces, std::span<const std::size_t> first,
                             Deadline deadline) override {
    inner_.all_to_all_scatter(send, send_first, pieces, first, deadline);
  }
  void do_barrier(Deadline deadline) override {
    if (mailbox_ != nullptr) {
      mailbox_->all_gather({}, {}, deadline, [this] { check_interrupt(); });
      return;
    }
    inner_.barrier(deadline);
  }
  void do_abort() noexcept override {
    if (mailbox_ != nullptr) {
      mailbox_->interrupt();
    }
    inner_.abort();
  }

 private:
  Communicator& inner_;
  std::unique_ptr<HostMailbox> mailbox_;
};

TEST(HostMailbox, NotCreatedForOneRank) {
  run_ranks(
      1,
      [](int, Communicator& comm) {
        EXPECT_EQ(HostMailbox::create(comm, Clock::now() + 10s), nullptr);
      },
      "HostMailbox.NotCreatedForOneRank");
}

class HostMailboxWorld : public ::testing::TestWithParam<int> {};

TEST_P(HostMailboxWorld, EverySizeBitExactOverManyCalls) {
  const int world = GetParam();
  with_mailboxes(world, [world](int rank, Communicator&, HostMailbox& box) {
    const std::array<std::size_t, 6> sizes{0, 1, 7, 352, HostMailbox::kSlotBytes, 0};
    std::vector<std::byte> send;
    std::vector<std::byte> recv;
    std::vector<std::byte> want;
    for (int call = 0; call < 600; ++call) {
      const std::size_t n = call % 7 == 6
                                ? static_cast<std::size_t>(call) % (HostMailbox::kSlotBytes + 1)
                                : sizes[static_cast<std::size_t>(call) % sizes.size()];
      send.resize(n);
      testing::fill_pattern(send, static_cast<std::uint64_t>(call), rank, 0);
      recv.assign(n * static_cast<std::size_t>(world), std::byte{0xEE});
      // Skew, so that some waits spin and some sleep on the futex, and a fast rank comes
      // back to a slot set its peers may still be reading.
      if ((call + rank) % 37 == 0) {
        std::this_thread::sleep_for(2ms);
      }
      box.all_gather(send, recv, Clock::now() + 10s, {});
      for (int r = 0; r < world; ++r) {
        want.resize(n);
        testing::fill_pattern(want, static_cast<std::uint64_t>(call), r, 0);
        ASSERT_TRUE(
            std::equal(want.begin(), want.end(), recv.data() + static_cast<std::size_t>(r) * n))
            << "rank " << rank << " call " << call << ": the bytes of rank " << r << " differ";
      }
    }
  });
}

TEST_P(HostMailboxWorld, TimeoutNamesTheMissingRank) {
  const int world = GetParam();
  std::atomic<int> timeouts{0};
  // A rank whose deadline passes marks its call abandoned, and the ranks still waiting then
  // raise Timeout at once (the same class everywhere), so a rank that started later may raise
  // before its own deadline; none raises before the earliest deadline.
  std::vector<Clock::time_point> starts(static_cast<std::size_t>(world), Clock::time_point::max());
  std::vector<Clock::time_point> raised(static_cast<std::size_t>(world), Clock::time_point::max());
  with_mailboxes(world, [&](int rank, Communicator&, HostMailbox& box) {
    if (rank == world - 1) {
      return;  // never calls
    }
    const std::byte mine{1};
    std::vector<std::byte> all(static_cast<std::size_t>(world));
    const auto start = Clock::now();
    starts[static_cast<std::size_t>(rank)] = start;
    try {
      box.all_gather(std::span(&mine, 1), all, start + 200ms, {});
      ADD_FAILURE() << "rank " << rank << ": no Timeout";
    } catch (const Timeout& e) {
      ++timeouts;
      const std::string text = e.what();
      EXPECT_NE(text.find("rank " + std::to_string(rank) + ":"), std::string::npos) << text;
      // Every rank that did not come is named; the absent one always is.
      const std::string named = text.substr(text.find("waiting for rank(s) "));
      EXPECT_NE(named.find(std::to_string(world - 1) + " ("), std::string::npos) << text;
    }
    raised[static_cast<std::size_t>(rank)] = Clock::now();
  });
  EXPECT_EQ(timeouts.load(), world - 1);
  const Clock::time_point first = *std::min_element(starts.begin(), starts.end());
  for (int r = 0; r + 1 < world; ++r) {
    EXPECT_GE(raised[static_cast<std::size_t>(r)] - first, 200ms) << "rank " << r;
  }
}

// A rank that arrives after the others gave up must fail too (Timeout, their class), not read
// the slots they wrote before giving up as a completed exchange: with zero bytes (an empty
// list's header) nothing else would catch it.
TEST_P(HostMailboxWorld, ALateRankFailsInsteadOfReadingTheAbandonedSlots) {
  const int world = GetParam();
  std::atomic<int> timeouts{0};
  with_mailboxes(world, [&](int rank, Communicator&, HostMailbox& box) {
    const bool late = rank == world - 1;
    if (late) {
      std::this_thread::sleep_for(400ms);
    }
    const auto start = Clock::now();
    try {
      box.all_gather({}, {}, start + (late ? 10s : 200ms), {});
      ADD_FAILURE() << "rank " << rank << ": the exchange returned";
    } catch (const Timeout& e) {
      ++timeouts;
      if (late) {
        EXPECT_NE(std::string(e.what()).find("gave up"), std::string::npos) << e.what();
        EXPECT_LT(Clock::now() - start, 1s) << "the late rank must not wait out its deadline";
      }
    }
  });
  EXPECT_EQ(timeouts.load(), world);
}

TEST_P(HostMailboxWorld, DifferentCountsRaiseMismatchOnEveryRankThenStayInStep) {
  const int world = GetParam();
  std::atomic<int> mismatches{0};
  with_mailboxes(world, [&](int rank, Communicator&, HostMailbox& box) {
    const std::size_t n = rank == 1 ? 16 : 8;
    std::vector<std::byte> send(n, std::byte{3});
    std::vector<std::byte> recv(n * static_cast<std::size_t>(world));
    try {
      box.all_gather(send, recv, Clock::now() + 10s, {});
    } catch (const Mismatch& e) {
      ++mismatches;
      EXPECT_NE(std::string(e.what()).find("sends"), std::string::npos) << e.what();
    }
    // The next calls agree and succeed.
    for (int call = 0; call < 3; ++call) {
      const std::byte mine{static_cast<std::uint8_t>(rank + call)};
      std::vector<std::byte> all(static_cast<std::size_t>(world));
      box.all_gather(std::span(&mine, 1), all, Clock::now() + 10s, {});
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(all[static_cast<std::size_t>(r)], static_cast<std::byte>(r + call));
      }
    }
    std::vector<std::byte> too_big(HostMailbox::kSlotBytes + 1);
    std::vector<std::byte> out(too_big.size() * static_cast<std::size_t>(world));
    EXPECT_THROW(box.all_gather(too_big, out, Clock::now() + 10s, {}), InvalidArgument);
  });
  EXPECT_EQ(mismatches.load(), world);
}

INSTANTIATE_TEST_SUITE_P(World, HostMailboxWorld, ::testing::Values(2, 3, 4, 7),
                         [](const auto& p) { return "w" + std::to_string(p.param); });

TEST(HostMailbox, InterruptWakesAWaitAndLaterCallsFail) {
  std::array<std::atomic<HostMailbox*>, 2> boxes{};
  std::atomic<bool> waiting{false};
  std::string what;
  with_mailboxes(2, [&](int rank, Communicator& comm, HostMailbox& box) {
    boxes[static_cast<std::size_t>(rank)] = &box;
    const std::byte mine{1};
    std::array<std::byte, 2> all{};
    if (rank == 1) {  // never calls: interrupts rank 0's wait instead
      while (!waiting.load()) {
        std::this_thread::yield();
      }
      std::this_thread::sleep_for(200ms);  // rank 0 is asleep in the mailbox by now
      boxes[0].load()->interrupt();
      comm.barrier(Clock::now() + 10s);  // keeps rank 0's mailbox alive until it returned
      return;
    }
    const auto start = Clock::now();
    waiting = true;
    try {
      box.all_gather(std::span(&mine, 1), all, start + 30s, {});
    } catch (const Aborted& e) {
      what = e.what();
    }
    EXPECT_LT(Clock::now() - start, 5s);
    EXPECT_THROW(box.all_gather(std::span(&mine, 1), all, Clock::now() + 30s, {}), Aborted);
    comm.barrier(Clock::now() + 10s);
  });
  EXPECT_NE(what.find("while in"), std::string::npos) << "not woken from a wait: '" << what << "'";
}

TEST(HostMailbox, PollRunsWhileWaitingAndItsExceptionEndsTheWait) {
  with_mailboxes(2, [](int rank, Communicator&, HostMailbox& box) {
    if (rank == 1) {
      return;
    }
    int polls = 0;
    const std::byte mine{1};
    std::array<std::byte, 2> all{};
    EXPECT_THROW(box.all_gather(std::span(&mine, 1), all, Clock::now() + 30s,
                                [&polls] {
                                  if (++polls == 3) {
                                    throw Aborted("poll asked to stop");
                                  }
                                }),
                 Aborted);
    EXPECT_EQ(polls, 3);
  });
}

// Through Communicator: all_gather of at most kSlotBytes per rank takes the mailbox (the
// backend sees no collective), larger ones and the other collectives take the backend, and
// abort() wakes a rank waiting in the mailbox.
TEST(HostMailbox, CommunicatorRoutesSmallAllGathersThroughIt) {
  run_ranks(
      3,
      [](int rank, Communicator& inner) {
        MailboxCommunicator comm(inner);
        ASSERT_TRUE(comm.uses_host_mailbox());
        const std::uint64_t before = inner.collectives_issued();
        std::vector<std::byte> small(HostMailbox::kSlotBytes, static_cast<std::byte>(rank));
        std::vector<std::byte> all(small.size() * 3);
        comm.all_gather(small, all, Clock::now() + 10s);
        EXPECT_EQ(inner.collectives_issued(), before);
        for (std::size_t k = 0; k < all.size(); ++k) {
          ASSERT_EQ(all[k], static_cast<std::byte>(k / small.size()));
        }
        std::vector<std::byte> large(HostMailbox::kSlotBytes + 1, std::byte{7});
        std::vector<std::byte> all_large(large.size() * 3);
        comm.all_gather(large, all_large, Clock::now() + 10s);
        EXPECT_EQ(inner.collectives_issued(), before + 1);
        // A whole foreach call: its pre-flight header is the one exchange that takes the
        // mailbox; the payload goes to the backend.
        testing::case_fsdp_shapes(comm, true, true);
        EXPECT_GT(inner.collectives_issued(), before + 1);
      },
      "HostMailbox.CommunicatorRoutesSmallAllGathersThroughIt");
}

TEST(HostMailbox, AbortWakesACommunicatorWaitingInTheMailbox) {
  std::array<std::atomic<Communicator*>, 2> comms{};
  std::atomic<bool> waiting{false};
  std::atomic<bool> abort_returned{false};
  std::atomic<bool> aborted{false};
  run_ranks(
      2,
      [&](int rank, Communicator& inner) {
        MailboxCommunicator comm(inner);
        ASSERT_TRUE(comm.uses_host_mailbox());
        comms[static_cast<std::size_t>(rank)] = &comm;
        inner.barrier(Clock::now() + 10s);
        if (rank == 1) {
          while (!waiting.load()) {
            std::this_thread::yield();
          }
          std::this_thread::sleep_for(200ms);  // rank 0 is asleep in the mailbox by now
          comms[0].load()->abort();
          abort_returned = true;
          return;
        }
        const std::byte mine{1};
        std::array<std::byte, 2> all{};
        const auto start = Clock::now();
        waiting = true;
        try {
          comm.all_gather(std::span(&mine, 1), all, start + 30s);
        } catch (const Aborted&) {
          aborted = true;
        }
        EXPECT_LT(Clock::now() - start, 5s);
        EXPECT_TRUE(comm.is_poisoned());
        while (!abort_returned.load()) {  // abort() may still touch this rank's mailbox
          std::this_thread::yield();
        }
      },
      "HostMailbox.AbortWakesACommunicatorWaitingInTheMailbox");
  EXPECT_TRUE(aborted.load());
}

// A plan through the node-shared window on such a communicator (kShared, which kAuto measures
// against kDirect here at any size): even a few bytes per rank go through the window, and once it
// exists every synchronisation (the header, the barriers) takes the mailbox, so the backend's
// transport carries nothing at all.
TEST(HostMailbox, SmallPlanGathersThroughTheWindowWithoutTheTransport) {
  constexpr int kWorld = 3;
  run_ranks(
      kWorld,
      [](int rank, Communicator& inner) {
        MailboxCommunicator comm(inner);
        ASSERT_TRUE(comm.uses_host_mailbox());
        const std::vector<DType> dtypes{DType::kUInt8, DType::kFloat32};
        const std::vector<std::vector<Shape>> shapes{{{5}, {3}}, {{6}, {3}}, {{7}, {3}}};
        const auto me = static_cast<std::size_t>(rank);
        for (const bool preflight : {true, false}) {
          AllGatherPlan plan(
              dtypes, shapes, rank,
              PlanOptions{.timeout = {}, .preflight = preflight, .strategy = Strategy::kShared});
          std::vector<std::byte> out(plan.output_bytes());
          std::uint64_t after_setup = 0;
          for (int call = 0; call < 50; ++call) {
            const auto seed = static_cast<std::uint64_t>(call);
            std::vector<testing::HostTensor> tensors;
            for (std::size_t i = 0; i < dtypes.size(); ++i) {
              tensors.push_back(testing::make_tensor(dtypes[i], shapes[me][i], seed, rank, i));
            }
            std::fill(out.begin(), out.end(), std::byte{0xEE});
            ASSERT_EQ(plan.execute(testing::views_of(tensors), comm, out).strategy,
                      Strategy::kShared);
            if (call == 0) {
              after_setup = inner.collectives_issued();
            }
            const std::vector<TensorView> views = plan.views(out.data());
            for (std::size_t i = 0; i < dtypes.size(); ++i) {
              for (int r = 0; r < kWorld; ++r) {
                const auto ur = static_cast<std::size_t>(r);
                const testing::HostTensor want =
                    testing::make_tensor(dtypes[i], shapes[ur][i], seed, r, i);
                ASSERT_EQ(std::memcmp(views[i * kWorld + ur].data, want.storage.data(),
                                      want.storage.size()),
                          0)
                    << "preflight " << preflight << " call " << call << " tensor " << i << " rank "
                    << r;
              }
            }
          }
          EXPECT_EQ(inner.collectives_issued(), after_setup) << "preflight " << preflight;
        }
      },
      "HostMailbox.SmallPlanGathersThroughTheWindowWithoutTheTransport");
}

}  // namespace
}  // namespace shardgather
