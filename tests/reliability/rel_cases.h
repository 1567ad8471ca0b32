// Reliability cases (docs/reliability.md) that run unchanged on any backend: bad inputs
// (B) and cross-rank mismatches (M). A case runs on one rank's communicator and returns that
// rank's Outcome; the threads suite (one thread per rank) and the MPI case binary (one process
// per rank) join the outcomes of all ranks and judge them with check_case().
//
// "Nothing corrupted" as checked here. foreach_all_gather() allocates and owns its output
// (GatherResult), so a failed call has no output of its own to compare with a sentinel fill.
// The caller-visible state that a faulty library could still damage is checked instead:
//  - in_changed: a checksum of every input's bytes, before and after the call;
//  - sentinel_ok: 0xEE guard bytes around every input allocation are intact, and the output of
//    an earlier successful call (which a buffer-reusing library might overwrite) is unchanged;
//  - out_mismatch_bytes: on success, the bytes that differ from what rank r really holds (a
//    tensor whose shape is wrong counts as wholly different);
//  - followup_ok: a valid call right after succeeds bit-exact, or, if the communicator was
//    poisoned, fails fast (< 10 ms) with CommAborted.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardgather/shardgather.h"

namespace shardgather::reliability {

struct Outcome {
  std::string case_id;
  std::string backend;
  int rank = 0;
  int world = 0;
  bool naked = false;     // run with the pre-flight check off: recorded, never gated
  std::string expect;     // the class this rank must end with: "Ok", "Mismatch", ...
  std::string outcome;    // "ok", "error" or "skipped"
  std::string err_class;  // what the call raised ("Ok" when it returned)
  std::string err_msg;
  double t_err_s = 0;  // seconds from the call to its return or raise
  std::uint64_t out_mismatch_bytes = 0;
  bool in_changed = false;
  bool sentinel_ok = true;
  bool msg_ok = true;  // the message names the fields the case expects
  bool followup_ok = true;
  std::string note;
};

std::string to_json(const Outcome& o);

// Appends one JSON line to the file named by $SHARDGATHER_RESULTS, when it is set.
void append_result(const Outcome& o);

// Backend-specific pieces a few cases need.
struct CaseContext {
  std::string backend;
  bool preflight = true;
  std::chrono::milliseconds timeout{2000};
  // B13: a communicator of world size 1.
  std::function<std::unique_ptr<Communicator>()> make_self;
  // B14: tries each invalid construction and returns the class each raised ("none" if none).
  std::function<std::vector<std::string>()> bad_inits;
};

using CaseFn = Outcome (*)(Communicator& comm, const CaseContext& ctx);

struct CaseDef {
  const char* id;
  CaseFn fn;
  int min_world;
  bool naked_variant;  // M cases: also run once with the pre-flight check off
  const char* what;
};

// Every B and M case, in plan order.
std::span<const CaseDef> bm_cases();
// The generated disagreement family D: one case per (parameter, disagreeing value).
std::span<const CaseDef> d_cases();
const CaseDef* find_case(std::string_view id);

// A case's verdict from all ranks' outcomes: empty when it passes. Naked runs only fail when
// an outcome is missing.
std::vector<std::string> check_case(std::span<const Outcome> outcomes, int world);

// Checksums of memory regions (FNV-1a 64), shared by the fault and soak suites.
std::uint64_t checksum(std::span<const std::byte> bytes) noexcept;

// Resident set size and open file descriptors of this process, from /proc/self.
std::uint64_t rss_bytes();
std::uint64_t peak_rss_bytes();
int open_fds();
int thread_count();

}  // namespace shardgather::reliability
