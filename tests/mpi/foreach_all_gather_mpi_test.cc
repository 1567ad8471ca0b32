// End-to-end on the MPI backend: the shared cases on MPI_COMM_WORLD, on sub-communicators
// (reverse order and odd/even split, after UCC's team variants) and on the chunked path.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <mpi.h>

#include "support/cases.h"
#include "support/plan_cases.h"
#include "support/reshard_cases.h"
#include "support/testing.h"
#include "transport/host_mailbox.h"
#include "transport/shared_buffer.h"

#include "shardgather/mpi.h"
#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

enum class Team { kWorld, kReverse, kOddEven };

// A communicator over MPI_COMM_WORLD or a split of it; the split is freed with the fixture.
class MpiTeam {
 public:
  explicit MpiTeam(Team team, MpiOptions options = {}) {
    int rank = 0;
    int size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (team == Team::kReverse) {
      MPI_Comm_split(MPI_COMM_WORLD, 0, size - rank, &split_);
    } else if (team == Team::kOddEven) {
      MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &split_);
    }
    comm_ = make_mpi_communicator(split_ == MPI_COMM_NULL ? MPI_COMM_WORLD : split_, options);
  }
  ~MpiTeam() {
    comm_.reset();
    if (split_ != MPI_COMM_NULL) {
      MPI_Comm_free(&split_);
    }
  }
  MpiTeam(const MpiTeam&) = delete;
  MpiTeam& operator=(const MpiTeam&) = delete;
  MpiTeam(MpiTeam&&) = delete;
  MpiTeam& operator=(MpiTeam&&) = delete;
  Communicator& comm() { return *comm_; }

 private:
  MPI_Comm split_ = MPI_COMM_NULL;
  std::unique_ptr<Communicator> comm_;
};

class MpiTeams : public ::testing::TestWithParam<Team> {
 protected:
  MpiTeam team_{GetParam()};
};

TEST_P(MpiTeams, FsdpShapesNoHint) { testing::case_fsdp_shapes(team_.comm(), false, true); }
TEST_P(MpiTeams, FsdpShapesWithHint) { testing::case_fsdp_shapes(team_.comm(), true, true); }
TEST_P(MpiTeams, FsdpShapesWithHintNoPreflight) {
  testing::case_fsdp_shapes(team_.comm(), true, false);
}
TEST_P(MpiTeams, EdgeShapes) { testing::case_edge_shapes(team_.comm()); }
TEST_P(MpiTeams, EmptyList) { testing::case_empty_list(team_.comm()); }
TEST_P(MpiTeams, SingleTensorUnevenNoHint) {
  testing::case_single_tensor_uneven(team_.comm(), false);
}
TEST_P(MpiTeams, SingleTensorUnevenWithHint) {
  testing::case_single_tensor_uneven(team_.comm(), true);
}
TEST_P(MpiTeams, MixedDtypes) { testing::case_mixed_dtypes(team_.comm()); }
TEST_P(MpiTeams, NonContiguous) { testing::case_non_contiguous(team_.comm()); }
TEST_P(MpiTeams, WrongHintRaisesOnEveryRank) { testing::case_wrong_hint(team_.comm()); }
TEST_P(MpiTeams, CountMismatchRaisesOnEveryRank) { testing::case_count_mismatch(team_.comm()); }
TEST_P(MpiTeams, DtypeMismatchRaisesOnEveryRank) { testing::case_dtype_mismatch(team_.comm()); }
TEST_P(MpiTeams, RandomListsMatchPerTensorReference) {
  const std::uint64_t seed = std::uint64_t{0xa11ca7e5};
  testing::case_random_vs_reference(team_.comm(), seed, 30);
}

TEST_P(MpiTeams, PlanSteadyState) { testing::case_plan_steady_state(team_.comm()); }
TEST_P(MpiTeams, PlanExecuteShared) { testing::case_plan_execute_shared(team_.comm()); }
TEST_P(MpiTeams, PlanRejectsMismatchedTensors) {
  testing::case_plan_rejects_mismatched_tensors(team_.comm());
}
TEST_P(MpiTeams, ReshardRandomLayouts) { testing::case_reshard_fuzz(team_.comm(), 25, 900); }
TEST_P(MpiTeams, ReshardRandomLayoutsOverAlltoallw) {
  MpiTeam team(GetParam(), MpiOptions{.exchange = MpiOptions::Exchange::kAlltoallw});
  testing::case_reshard_fuzz(team.comm(), 25, 950);
}
// Ranks whose communicators move personal exchanges two ways (one rank alltoallw, the others
// point to point) would never pair: Mismatch on every rank before anything moves, also for a
// foreach, whose header carries the same field.
TEST_P(MpiTeams, ExchangeFormThatDiffersRaisesMismatchOnEveryRank) {
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MpiOptions options;
  options.exchange =
      world_rank == 0 ? MpiOptions::Exchange::kAlltoallw : MpiOptions::Exchange::kPointToPoint;
  MpiTeam team(GetParam(), options);
  Communicator& comm = team.comm();
  if (comm.size() == 1) {
    GTEST_SKIP() << "one rank";
  }
  int first = 0;  // whether world rank 0 is in this team: only then do the forms differ
  const int mine = world_rank == 0 ? 1 : 0;
  std::vector<std::byte> buf(sizeof(int) * static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::as_bytes(std::span(&mine, 1)), buf,
                  comm.deadline_after(std::chrono::seconds(30)));
  for (int r = 0; r < comm.size(); ++r) {
    int v = 0;
    std::memcpy(&v, buf.data() + sizeof(int) * static_cast<std::size_t>(r), sizeof v);
    first |= v;
  }
  std::vector<float> data(4, 1.0F);
  const std::vector<TensorView> views{TensorView{data.data(), DType::kFloat32, {4}, {}}};
  try {
    (void)foreach_all_gather(views, comm,
                             std::vector<std::vector<Shape>>(static_cast<std::size_t>(comm.size()),
                                                             std::vector<Shape>{{4}}));
    EXPECT_EQ(first, 0) << "the forms differed and the call went through";
  } catch (const Mismatch& e) {
    EXPECT_EQ(first, 1);
    EXPECT_NE(std::string(e.what()).find("transport exchange differs"), std::string::npos)
        << e.what();
  }
}
TEST_P(MpiTeams, ReshardPlanMismatchRaisesOnEveryRank) {
  testing::case_reshard_mismatch(team_.comm());
}
TEST_P(MpiTeams, UnshardDims) { testing::case_unshard_dims(team_.comm()); }
TEST_P(MpiTeams, UnshardSingleDim0) { testing::case_unshard_single_dim0(team_.comm()); }
TEST_P(MpiTeams, UnshardAliasing) { testing::case_unshard_aliasing(team_.comm()); }
TEST_P(MpiTeams, UnshardToDst) { testing::case_unshard_to_dst(team_.comm()); }
TEST_P(MpiTeams, DstInPlanOptions) { testing::case_dst_in_plan_options(team_.comm()); }
TEST_P(MpiTeams, UnshardStream) { testing::case_unshard_stream(team_.comm()); }
TEST_P(MpiTeams, UnshardStreamErrors) { testing::case_unshard_stream_errors(team_.comm()); }
TEST_P(MpiTeams, AllToAllScatter) { testing::case_all_to_all_scatter(team_.comm()); }
TEST_P(MpiTeams, Hierarchical) { testing::case_hierarchical(team_.comm()); }
TEST_P(MpiTeams, HierarchicalDisagreement) {
  testing::case_hierarchical_disagreement(team_.comm());
}
TEST_P(MpiTeams, AutoMeasures) { testing::case_auto_measures(team_.comm()); }
TEST_P(MpiTeams, ForeachStrategies) { testing::case_foreach_strategies(team_.comm()); }

INSTANTIATE_TEST_SUITE_P(Teams, MpiTeams,
                         ::testing::Values(Team::kWorld, Team::kReverse, Team::kOddEven),
                         [](const auto& p) {
                           switch (p.param) {
                             case Team::kWorld:
                               return std::string("world");
                             case Team::kReverse:
                               return std::string("reverse");
                             case Team::kOddEven:
                               return std::string("odd_even");
                           }
                           return std::string("unknown");
                         });

// The large-count path (chunked broadcasts) on small data: chunks of 1000 bytes make every
// gather above a few hundred elements take it, segment boundaries inside chunks included.
TEST(MpiChunked, SameResultsAsTheSingleCollective) {
  MpiTeam team(Team::kWorld, MpiOptions{.max_chunk_bytes = 1000});
  testing::case_fsdp_shapes(team.comm(), false, true);
  testing::case_fsdp_shapes(team.comm(), true, true);
  testing::case_mixed_dtypes(team.comm());
  testing::case_non_contiguous(team.comm());
  testing::case_random_vs_reference(team.comm(), 77, 10);
  testing::case_unshard_dims(team.comm());
  testing::case_unshard_to_dst(team.comm());  // gathers to one rank, sender by sender
  testing::case_unshard_stream(team.comm());
  testing::case_plan_steady_state(team.comm());
  testing::case_all_to_all_scatter(team.comm());  // pairs above 1000 bytes go in chunks
  testing::case_hierarchical(team.comm());
  testing::case_reshard_fuzz(team.comm(), 10, 960);
}

// MPI_Ialltoallw for the personal exchange, with pairs above 1000 bytes point to point after it.
TEST(MpiChunked, AlltoallwCarriesThePairsUpToAChunk) {
  MpiTeam team(Team::kWorld,
               MpiOptions{.max_chunk_bytes = 1000, .exchange = MpiOptions::Exchange::kAlltoallw});
  testing::case_all_to_all_scatter(team.comm());
  testing::case_reshard_fuzz(team.comm(), 10, 970);
}

TEST(MpiCommunicator, RejectsBadOptions) {
  EXPECT_THROW(make_mpi_communicator(MPI_COMM_WORLD, MpiOptions{.max_chunk_bytes = 0}),
               InvalidArgument);
  EXPECT_THROW(make_mpi_communicator(MPI_COMM_NULL), InvalidArgument);
}

TEST(MpiCommunicator, RepeatedGathersReuseTheSendType) {
  // The same tensors every step (FSDP): results stay bit-exact across the type cache.
  MpiTeam team(Team::kWorld);
  for (int step = 0; step < 20; ++step) {
    testing::case_fsdp_shapes(team.comm(), step % 2 == 0, true);
  }
}

// RLIMIT_FSIZE lowered for this process while alive, with SIGXFSZ ignored (EFBIG instead of
// the signal); both restored however the test body ends.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    if (getrlimit(RLIMIT_FSIZE, &saved_) != 0) {
      return;
    }
    rlimit small = saved_;
    small.rlim_cur = std::min<rlim_t>(bytes, saved_.rlim_max);
    handler_ = std::signal(SIGXFSZ, SIG_IGN);
    active_ = setrlimit(RLIMIT_FSIZE, &small) == 0;
    if (!active_) {
      std::signal(SIGXFSZ, handler_);
    }
  }
  ~FileSizeLimit() {
    if (active_) {
      setrlimit(RLIMIT_FSIZE, &saved_);
      std::signal(SIGXFSZ, handler_);
    }
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;
  FileSizeLimit(FileSizeLimit&&) = delete;
  FileSizeLimit& operator=(FileSizeLimit&&) = delete;
  [[nodiscard]] bool active() const { return active_; }

 private:
  rlimit saved_{};
  void (*handler_)(int) = SIG_DFL;
  bool active_ = false;
};

// A plan's output after execute: every rank's tensors of make_tensor(seed), bit-exact.
void expect_gathered(const AllGatherPlan& plan, const std::vector<std::byte>& out,
                     const std::vector<DType>& dtypes,
                     const std::vector<std::vector<Shape>>& shapes, std::uint64_t seed) {
  const int world = static_cast<int>(shapes.size());
  const std::vector<TensorView> views = plan.views(const_cast<std::byte*>(out.data()));
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    for (int r = 0; r < world; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      const testing::HostTensor want = testing::make_tensor(dtypes[i], shapes[ur][i], seed, r, i);
      const TensorView& got = views[i * static_cast<std::size_t>(world) + ur];
      ASSERT_EQ(got.shape, shapes[ur][i]);
      ASSERT_EQ(std::memcmp(got.data, want.storage.data(), want.storage.size()), 0)
          << "tensor " << i << " rank " << r;
    }
  }
}

// kAuto picks the node-shared window for a plan on one host at >= 1 MiB per rank. Where that
// window cannot be reserved (a container's 64 MiB /dev/shm; here a file-size limit, which makes
// posix_fallocate fail with EFBIG the way a full tmpfs fails with ENOSPC), every rank must fall
// back to kDirect alike and stay bit-exact; an explicit kShared keeps the error on every rank.
TEST(MpiSharedWindow, AutoFallsBackToDirectWhenTheWindowCannotBeReserved) {
  MpiTeam team(Team::kWorld);
  Communicator& comm = team.comm();
  const int world = comm.size();
  const int rank = comm.rank();
  const auto me = static_cast<std::size_t>(rank);
  if (world < 2 || comm.ranks_on_host() != world) {
    GTEST_SKIP() << "needs several ranks on one host";
  }
  const std::vector<DType> dtypes{DType::kUInt8, DType::kFloat32};
  std::vector<std::vector<Shape>> shapes;
  for (int r = 0; r < world; ++r) {
    shapes.push_back({{(std::int64_t{1} << 20) + 8 * r}, {3}});
  }
  std::vector<testing::HostTensor> tensors;
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    tensors.push_back(testing::make_tensor(dtypes[i], shapes[me][i], 41, rank, i));
  }
  const std::vector<TensorView> params = testing::views_of(tensors);
  const auto check = [&](const AllGatherPlan& plan, const std::vector<std::byte>& out) {
    expect_gathered(plan, out, dtypes, shapes, 41);
  };

  {
    const FileSizeLimit limit(64 << 10);
    ASSERT_TRUE(limit.active());
    AllGatherPlan plan(dtypes, shapes, rank);
    std::vector<std::byte> out(plan.output_bytes());
    for (int step = 0; step < 3; ++step) {
      std::fill(out.begin(), out.end(), std::byte{0xee});
      const ExecStats stats = plan.execute(params, comm, out);
      EXPECT_EQ(stats.strategy, Strategy::kDirect) << "step " << step;
      // The failed window's collectives are setup (step 0 only); direct is one collective.
      EXPECT_EQ(stats.payload_collectives, 1U) << "step " << step;
      EXPECT_EQ(stats.setup_collectives > 0, step == 0) << "step " << step;
      check(plan, out);
    }
    AllGatherPlan forced(
        dtypes, shapes, rank,
        PlanOptions{
            .timeout = {}, .preflight = true, .strategy = Strategy::kShared, .copy_threads = 0});
    std::string what;
    try {
      (void)forced.execute(params, comm, out);
    } catch (const OutOfMemory& e) {
      what = e.what();
    }
    EXPECT_NE(what.find("shared buffer"), std::string::npos)
        << "explicit kShared: '" << what << "'";
  }
  // With room again, a new plan uses the window.
  AllGatherPlan plan(dtypes, shapes, rank);
  std::vector<std::byte> out(plan.output_bytes());
  EXPECT_EQ(plan.execute(params, comm, out).strategy, Strategy::kShared);
  check(plan, out);
}

// Launched across simulated hosts (tools/netns-mpirun, with SHARDGATHER_TEST_RANKS_PER_HOST
// set to its --per-host): each rank counts only the ranks of its own host and knows every
// rank's host, and nothing node-shared spans hosts: no host mailbox, a shared buffer is shared
// only within a host, an explicit kShared runs kDirect, and kAuto runs kHierarchical (one window
// per host) when a host has several ranks, all bit-exact.
TEST(MpiHosts, RanksOnHostAndNothingSharedAcrossHosts) {
  const char* per_host = std::getenv("SHARDGATHER_TEST_RANKS_PER_HOST");
  if (per_host == nullptr) {
    GTEST_SKIP() << "not launched across test hosts";
  }
  MpiTeam team(Team::kWorld);
  Communicator& comm = team.comm();
  const int world = comm.size();
  const int rank = comm.rank();
  EXPECT_EQ(comm.ranks_on_host(), std::atoi(per_host)) << "rank " << rank;
  ASSERT_LT(comm.ranks_on_host(), world) << "the launch put every rank on one host";
  EXPECT_EQ(detail::HostMailbox::create(comm, comm.deadline_after(std::chrono::seconds(30))),
            nullptr);
  const int k = std::atoi(per_host);
  ASSERT_EQ(comm.hosts().size(), static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(comm.hosts()[static_cast<std::size_t>(r)], r / k) << "rank " << r << "'s host";
  }
  {
    // Each rank marks its slot of its host's buffer: it sees the marks of its host's ranks and
    // none of another host's.
    const auto buffer = detail::SharedBuffer::create(comm, 8 * static_cast<std::uint64_t>(world),
                                                     comm.deadline_after(std::chrono::seconds(30)));
    auto* slots = reinterpret_cast<std::uint64_t*>(buffer->data());
    slots[rank] = 1000 + static_cast<std::uint64_t>(rank);
    comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
    for (int r = 0; r < world; ++r) {
      const bool same_host = r / k == rank / k;
      EXPECT_EQ(slots[r], same_host ? 1000 + static_cast<std::uint64_t>(r) : 0U)
          << "rank " << rank << " reads rank " << r << "'s slot";
    }
    comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
  }

  const std::vector<DType> dtypes{DType::kUInt8, DType::kFloat32};
  std::vector<std::vector<Shape>> shapes;
  for (int r = 0; r < world; ++r) {
    shapes.push_back({{(std::int64_t{1} << 20) + 8 * r}, {3}});  // past the window's threshold
  }
  std::vector<testing::HostTensor> tensors;
  const auto me = static_cast<std::size_t>(rank);
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    tensors.push_back(testing::make_tensor(dtypes[i], shapes[me][i], 43, rank, i));
  }
  const std::vector<TensorView> params = testing::views_of(tensors);
  const Strategy windowed = k > 1 ? Strategy::kHierarchical : Strategy::kDirect;
  for (const auto& [strategy, runs] :
       {std::pair{Strategy::kAuto, windowed}, std::pair{Strategy::kShared, Strategy::kDirect},
        std::pair{Strategy::kHierarchical, windowed}}) {
    AllGatherPlan plan(
        dtypes, shapes, rank,
        PlanOptions{.timeout = {}, .preflight = true, .strategy = strategy, .copy_threads = 0});
    std::vector<std::byte> out(plan.output_bytes());
    for (int step = 0; step < 2; ++step) {
      std::fill(out.begin(), out.end(), std::byte{0xee});
      // kAuto's first executions measure: the window, then kDirect (case_auto_measures).
      const bool trial_direct =
          strategy == Strategy::kAuto && runs != Strategy::kDirect && step == 1;
      EXPECT_EQ(plan.execute(params, comm, out).strategy, trial_direct ? Strategy::kDirect : runs)
          << "requested " << strategy_name(strategy) << ", step " << step;
      expect_gathered(plan, out, dtypes, shapes, 43);
    }
  }
}

// The host mailbox across processes: real process-shared futexes and mappings, ranks that
// arrive skewed (some waits spin, some sleep), every size up to a full slot, bit-exact.
TEST(MpiHostMailbox, ProcessesGatherBitExact) {
  MpiTeam team(Team::kWorld);
  Communicator& comm = team.comm();
  const int world = comm.size();
  const int rank = comm.rank();
  const auto box = detail::HostMailbox::create(comm, Clock::now() + std::chrono::seconds(30));
  if (world == 1 || comm.ranks_on_host() != world) {
    EXPECT_EQ(box, nullptr) << "the mailbox is for groups on one host";  // MpiHosts covers it
    return;
  }
  ASSERT_NE(box, nullptr) << "every rank of a local mpirun is on this host";
  std::vector<std::byte> send;
  std::vector<std::byte> recv;
  std::vector<std::byte> want;
  for (int call = 0; call < 2000; ++call) {
    const std::size_t n =
        static_cast<std::size_t>(call * 131) % (detail::HostMailbox::kSlotBytes + 1);
    send.resize(n);
    testing::fill_pattern(send, static_cast<std::uint64_t>(call), rank, 0);
    recv.assign(n * static_cast<std::size_t>(world), std::byte{0xEE});
    if ((call + rank) % 101 == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
    }
    box->all_gather(send, recv, Clock::now() + std::chrono::seconds(30), {});
    for (int r = 0; r < world; ++r) {
      want.resize(n);
      testing::fill_pattern(want, static_cast<std::uint64_t>(call), r, 0);
      ASSERT_TRUE(
          std::equal(want.begin(), want.end(), recv.data() + static_cast<std::size_t>(r) * n))
          << "call " << call << ": the bytes of rank " << r << " differ";
    }
  }
}

// Where /dev/shm cannot hold the mailbox, no rank gets one (and nothing is left behind).
TEST(MpiHostMailbox, NotCreatedWhenSharedMemoryIsUnavailable) {
  MpiTeam team(Team::kWorld);
  if (team.comm().size() < 2) {
    GTEST_SKIP() << "needs several ranks";
  }
  const FileSizeLimit limit(1024);
  ASSERT_TRUE(limit.active());
  EXPECT_EQ(detail::HostMailbox::create(team.comm(), Clock::now() + std::chrono::seconds(30)),
            nullptr);
}

}  // namespace
}  // namespace shardgather
