// B (bad inputs) and M (mismatch) on the threads backend at W = 2 and 3, each M case also once
// "naked" (pre-flight off) to record what the transport alone does.
#include <algorithm>
#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include "threads_harness.h"

namespace shardgather::reliability {
namespace {

using Param = std::tuple<std::string, int, bool>;  // case id, world, naked

class ThreadsBM : public ::testing::TestWithParam<Param> {};

TEST_P(ThreadsBM, UniformAndIntact) {
  const auto& [id, world, naked] = GetParam();
  const CaseDef* def = find_case(id);
  ASSERT_NE(def, nullptr);
  if (world < def->min_world) {
    GTEST_SKIP() << id << " needs world >= " << def->min_world;
  }
  CaseContext ctx = threads_context();
  ctx.preflight = !naked;
  const std::vector<Outcome> outcomes =
      run_threads_case(*def, world, ctx, id + "_w" + std::to_string(world));
  const std::vector<std::string> problems = check_case(outcomes, world);
  EXPECT_TRUE(problems.empty()) << def->what << "\n" << join(problems);
  if (naked) {
    for (const Outcome& o : outcomes) {
      std::printf("naked %s rank %d: %s %s %s (%llu bytes differ)\n", id.c_str(), o.rank,
                  o.outcome.c_str(), o.err_class.c_str(), o.err_msg.c_str(),
                  static_cast<unsigned long long>(o.out_mismatch_bytes));
    }
  }
}

std::vector<Param> params() {
  std::vector<Param> out;
  for (const CaseDef& c : bm_cases()) {
    for (const int world : {2, 3}) {
      out.emplace_back(c.id, world, false);
      if (c.naked_variant) {
        out.emplace_back(c.id, world, true);
      }
    }
  }
  return out;
}

std::vector<Param> d_params() {
  std::vector<Param> out;
  for (const CaseDef& c : d_cases()) {
    for (const int world : {2, 3, 4}) {
      out.emplace_back(c.id, world, false);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Disagree, ThreadsBM, ::testing::ValuesIn(d_params()), [](const auto& p) {
  std::string id = std::get<0>(p.param);
  std::replace(id.begin(), id.end(), '-', '_');
  return id + "_w" + std::to_string(std::get<1>(p.param));
});

INSTANTIATE_TEST_SUITE_P(Cases, ThreadsBM, ::testing::ValuesIn(params()), [](const auto& p) {
  return std::get<0>(p.param) + "_w" + std::to_string(std::get<1>(p.param)) +
         (std::get<2>(p.param) ? "_naked" : "");
});

}  // namespace
}  // namespace shardgather::reliability
