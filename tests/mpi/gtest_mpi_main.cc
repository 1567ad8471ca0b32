// GoogleTest main for MPI suites. Every rank runs every test; a test's verdict is the logical
// AND over ranks (MPI_Allreduce), so a failure on any rank fails the run and the exit code.
// Failure messages are printed by the rank that saw them, prefixed with its number; only
// rank 0 prints the progress lines, so the log stays readable.
#include <cstdio>

#include <gtest/gtest.h>
#include <mpi.h>

namespace {

class RankPrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankPrinter(int rank) : rank_(rank) {}

  void OnTestStart(const ::testing::TestInfo& info) override {
    if (rank_ == 0) {
      std::printf("[ RUN      ] %s.%s\n", info.test_suite_name(), info.name());
      std::fflush(stdout);
    }
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed()) {
      std::printf("[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name(), result.line_number(),
                  result.summary());
      std::fflush(stdout);
    }
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    // 2 passed, 1 skipped (a test that needs another world size), 0 failed; the worst rank wins.
    int local = info.result()->Skipped() ? 1 : 0;
    if (info.result()->Passed()) {
      local = 2;
    }
    int all = 0;
    MPI_Allreduce(&local, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank_ == 0) {
      const char* tag = all == 2 ? "[       OK ]" : all == 1 ? "[  SKIPPED ]" : "[  FAILED  ]";
      std::printf("%s %s.%s\n", tag, info.test_suite_name(), info.name());
      std::fflush(stdout);
    }
    failed_ = failed_ || all == 0;
  }
  [[nodiscard]] bool failed() const { return failed_; }

 private:
  int rank_;
  bool failed_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  ::testing::InitGoogleTest(&argc, argv);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  auto* printer = new RankPrinter(rank);
  listeners.Append(printer);
  const int local_rc = RUN_ALL_TESTS();
  int rc = 0;
  MPI_Allreduce(&local_rc, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  const bool failed = printer->failed() || rc != 0;
  if (rank == 0) {
    std::printf("%s: %d ranks, %d tests\n", failed ? "FAILED" : "PASSED", size,
                ::testing::UnitTest::GetInstance()->test_to_run_count());
  }
  MPI_Finalize();
  return failed ? 1 : 0;
}
