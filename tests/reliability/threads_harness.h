// H1 for the reliability suites: runs a case on W rank threads under the watchdog of
// support/testing.h (a hang aborts the process with "HUNG <case>"), collects one Outcome per
// rank and records them in $SHARDGATHER_RESULTS.
#pragma once

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "rel_cases.h"
#include "support/testing.h"

#include "shardgather/shardgather.h"

namespace shardgather::reliability {

// How much slower an instrumented build (ASan, TSan) runs the suites: the bounds that check that
// a call does not wait (F4's "at once") are scaled by it there, and the soaks divide their
// iteration counts by it; the uninstrumented runs keep the documented bounds.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr int kSanitizerSlowdown = 5;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr int kSanitizerSlowdown = 5;
#else
inline constexpr int kSanitizerSlowdown = 1;
#endif
#else
inline constexpr int kSanitizerSlowdown = 1;
#endif

// T: the per-call deadline of the suites (docs/reliability.md: 2 s); the watchdog fires at 5 T.
inline std::chrono::milliseconds suite_timeout() {
  const char* env = std::getenv("SHARDGATHER_REL_TIMEOUT_MS");
  return std::chrono::milliseconds(env != nullptr ? std::atoi(env) : 2000);
}

inline CaseContext threads_context() {
  CaseContext ctx;
  ctx.backend = "threads";
  ctx.timeout = suite_timeout();
  ctx.make_self = [] { return std::move(make_thread_group(1)[0]); };
  ctx.bad_inits = [] {
    std::vector<std::string> classes;
    for (const int world : {0, -1}) {
      try {
        (void)make_thread_group(world);
        classes.emplace_back("none");
      } catch (const Error& e) {
        classes.emplace_back(error_code_name(e.code()));
      }
    }
    return classes;
  };
  return ctx;
}

inline std::vector<Outcome> run_threads_case(const CaseDef& def, int world, const CaseContext& ctx,
                                             const std::string& name) {
  std::vector<Outcome> outcomes(static_cast<std::size_t>(world));
  testing::run_ranks(
      world,
      [&](int rank, Communicator& comm) {
        outcomes[static_cast<std::size_t>(rank)] = def.fn(comm, ctx);
      },
      name, 5 * ctx.timeout);
  for (const Outcome& o : outcomes) {
    append_result(o);
  }
  return outcomes;
}

inline std::string join(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) {
    s += l + "\n";
  }
  return s;
}

}  // namespace shardgather::reliability
