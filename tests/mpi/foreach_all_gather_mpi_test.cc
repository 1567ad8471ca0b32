// End-to-end on the MPI backend: the shared cases on MPI_COMM_WORLD, on sub-communicators
// (reverse order and odd/even split, after UCC's team variants) and on the chunked path.
#include <cstdio>
#include <memory>

#include <gtest/gtest.h>
#include <mpi.h>

#include "support/cases.h"
#include "support/plan_cases.h"
#include "support/testing.h"

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
TEST_P(MpiTeams, UnshardDims) { testing::case_unshard_dims(team_.comm()); }
TEST_P(MpiTeams, UnshardSingleDim0) { testing::case_unshard_single_dim0(team_.comm()); }
TEST_P(MpiTeams, UnshardAliasing) { testing::case_unshard_aliasing(team_.comm()); }

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
  testing::case_plan_steady_state(team.comm());
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

}  // namespace
}  // namespace shardgather
