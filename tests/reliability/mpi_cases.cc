// H2 case binary: `mpi_cases [--naked] [--timeout-ms N] [--out-dir D] <case-id>...`, run under
// mpirun by run_mpi_cases.py. Every rank writes one JSON line per case (rel_cases.h's Outcome)
// to D/rank<r>.jsonl (stdout without --out-dir).
// Case ids: the B and M ids of rel_cases.cc, and the MPI-only F5-*, F6-*, F7-*, F8, F9,
// F12-link, F13-host (across simulated hosts), L1, L2,
// L4, OVH, X2 and X3 below. A rank whose communicator ends up poisoned (Timeout: MPI cannot
// cancel the posted collective) ends the job with MPI_Abort after printing its lines: that is
// the documented way out (docs/errors.md).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <mpi.h>

#include "rel_cases.h"
#include "support/testing.h"
#include <unistd.h>

#include "shardgather/mpi.h"
#include "shardgather/shardgather.h"

namespace shardgather::reliability {
namespace {

using namespace std::chrono_literals;
using Rows = std::vector<std::vector<Shape>>;

bool g_poisoned = false;
std::FILE* g_out = stdout;  // --out-dir D: D/rank<r>.jsonl, since mpirun interleaves stdout

// Flushed line by line: a rank may be killed or abort right after.
void emit(const Outcome& o) {
  std::fprintf(g_out, "%s\n", to_json(o).c_str());
  std::fflush(g_out);
}

Outcome base(const std::string& id, const Communicator& comm, const CaseContext& ctx,
             const std::string& expect) {
  Outcome o;
  o.case_id = id;
  o.backend = "mpi";
  o.rank = comm.rank();
  o.world = comm.size();
  o.naked = !ctx.preflight;
  o.expect = expect;
  o.note = "T=" + std::to_string(ctx.timeout.count()) + "ms";
  return o;
}

void capture(Outcome& o, const std::function<void()>& fn) {
  const Clock::time_point t0 = Clock::now();
  try {
    fn();
    o.outcome = "ok";
    o.err_class = "Ok";
  } catch (const Error& e) {
    o.outcome = "error";
    o.err_class = std::string(error_code_name(e.code()));
    o.err_msg = e.what();
  } catch (const std::exception& e) {
    o.outcome = "error";
    o.err_class = "std::exception";
    o.err_msg = e.what();
  }
  o.t_err_s = std::chrono::duration<double>(Clock::now() - t0).count();
}

bool under_asan() {
#if defined(__SANITIZE_ADDRESS__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  return true;
#endif
#endif
  return false;
}

// A small FSDP-like list with a hint, the payload of the fault cases.
struct Payload {
  Rows rows;
  std::vector<DType> dtypes;
  std::vector<testing::HostTensor> tensors;
  std::vector<TensorView> views;
  Payload(int world, int rank, std::int64_t rows_per_rank) {
    rows.assign(static_cast<std::size_t>(world), std::vector<Shape>{{rows_per_rank, 64}, {7}});
    dtypes = {DType::kFloat32, DType::kInt64};
    for (std::size_t i = 0; i < dtypes.size(); ++i) {
      tensors.push_back(testing::make_tensor(dtypes[i], rows[0][i], 3, rank, i));
    }
    views = testing::views_of(tensors);
  }
  [[nodiscard]] bool exact(const GatherResult& out) const {
    return testing::verify_gather(out, rows, dtypes, 3).empty();
  }
};

// F5: rank 1 dies at iteration 10 of a loop; mpirun must end the job (checked by the launcher).
void f5_kill(Communicator& comm, const CaseContext& ctx, const std::string& how) {
  Outcome o = base("F5-" + how, comm, ctx, "Killed");
  const Payload p(comm.size(), comm.rank(), 256);
  capture(o, [&] {
    for (int it = 0; it < 1000; ++it) {
      if (comm.rank() == 1 && it == 10) {
        if (how == "kill") {
          std::raise(SIGKILL);
        } else if (how == "exit") {
          std::exit(3);
        } else if (how == "abort") {
          std::abort();
        } else {
          std::raise(SIGSEGV);
        }
      }
      if (!p.exact(foreach_all_gather(
              p.views, comm, p.rows,
              ForeachAllGatherOptions{.timeout = ctx.timeout, .preflight = true}))) {
        throw std::runtime_error("iteration " + std::to_string(it) + " not bit-exact");
      }
    }
  });
  // Reaching here with "ok" means a survivor finished iterations its dead peer never joined.
  emit(o);
}

// F6/F7: rank 1 stalls (SIGSTOP or sleep) before the payload (pre-flight off, so the first
// collective is the payload) or before the pre-flight; "mid": a helper thread stops rank 1
// at a random point of a gather loop.
void stall(Communicator& comm, const CaseContext& ctx, const std::string& id) {
  const bool payload_phase = id.rfind("F6", 0) == 0;
  const bool use_stop = id.find("stop") != std::string::npos;
  const bool mid = id.find("mid") != std::string::npos;
  Outcome o = base(id, comm, ctx, comm.rank() == 1 ? "Stalled" : "Timeout");
  const Payload p(comm.size(), comm.rank(), mid ? 4096 : 64);
  const ForeachAllGatherOptions opts{.timeout = ctx.timeout, .preflight = mid || !payload_phase};
  if (comm.rank() == 1) {
    if (mid) {
      std::thread([] {
        std::this_thread::sleep_for(300ms);
        std::raise(SIGSTOP);
      }).detach();
    } else {
      o.outcome = "stalled";
      o.err_class = "Stalled";
      emit(o);
      if (use_stop) {
        std::raise(SIGSTOP);
      }
      std::this_thread::sleep_for(1000s);
      return;
    }
  }
  capture(o, [&] {
    for (int it = 0; it < (mid ? 1'000'000 : 1); ++it) {
      if (!p.exact(foreach_all_gather(p.views, comm, p.rows, opts))) {
        throw std::runtime_error("not bit-exact");
      }
    }
  });
  const char* phase = payload_phase && !mid ? "all_gather_v" : "all_gather ";
  o.msg_ok = mid || o.err_msg.find(phase) != std::string::npos;
  emit(o);
}

// F12/F13, across simulated hosts (tools/netns-mpirun, SHARDGATHER_TEST_RANKS_PER_HOST set):
// a plan gathers 1 MiB per rank in a loop (kAuto: kHierarchical with several ranks per host)
// while, 300 ms in, the first rank of host 1 cuts its host's link for 3 T ("F12-link": `ip link
// set eth0 down` inside the host, a pulled cable) or kills its host's processes ("F13-host": its
// launch daemon and every rank of its host, SIGKILL). F12: every rank raises Timeout within
// [0.5, 2] T of the call that could not finish. F13: the survivors raise or Open MPI's runtime
// ends the job; the launcher checks that the job ends and nothing is left.
void host_fault(Communicator& comm, const CaseContext& ctx, const std::string& id) {
  const bool cut = id == "F12-link";
  Outcome o = base(id, comm, ctx, cut ? "Timeout" : "Killed");
  const char* per_host = std::getenv("SHARDGATHER_TEST_RANKS_PER_HOST");
  const int k = per_host == nullptr ? 0 : std::atoi(per_host);
  if (k < 1 || comm.size() < 2 * k) {
    o.outcome = "skipped";
    o.err_class = o.expect;
    o.note += "; needs 2 simulated hosts (SHARDGATHER_TEST_RANKS_PER_HOST)";
    emit(o);
    return;
  }
  const std::int64_t elems = std::int64_t{1} << 18;  // 1 MiB of float32 per rank
  const Rows rows(static_cast<std::size_t>(comm.size()), std::vector<Shape>{{elems}});
  const std::vector<DType> dtypes{DType::kFloat32};
  std::vector<testing::HostTensor> tensors;
  tensors.push_back(testing::make_tensor(DType::kFloat32, {elems}, 5, comm.rank(), 0));
  const std::vector<TensorView> views = testing::views_of(tensors);
  AllGatherPlan plan(dtypes, rows, comm.rank(),
                     PlanOptions{.timeout = ctx.timeout, .preflight = true});
  std::vector<std::byte> out(plan.output_bytes());
  if (comm.rank() == k) {
    std::thread([cut, t = ctx.timeout] {
      std::this_thread::sleep_for(300ms);
      // The cut comes back once every rank has raised (within 2 T), so the launcher can reach
      // the host again and end the job; a shell of its own does it, since this rank may be
      // gone by then (MPI_Abort). Cut for good, Open MPI's mpirun retries the lost daemon for
      // the kernel's TCP timeout (minutes); tools/netns-mpirun's cleanup bounds that.
      // Killing: the host's launch daemon is this rank's parent; its children (this host's
      // ranks, this one too) first, while they are still its children, then the daemon.
      const std::string daemon = std::to_string(::getppid());
      const std::string outage =
          std::to_string(3 * t.count() / 1000) + "." + std::to_string(3 * t.count() % 1000 / 100);
      const std::string cmd = cut ? "setsid sh -c 'ip link set eth0 down; sleep " + outage +
                                        "; ip link set eth0 up' >/dev/null 2>&1 </dev/null &"
                                  : "pkill -KILL -P " + daemon + "; kill -KILL " + daemon;
      (void)std::system(cmd.c_str());
    }).detach();
  }
  Clock::time_point call_start = Clock::now();
  capture(o, [&] {
    for (int it = 0; it < 1'000'000; ++it) {
      call_start = Clock::now();
      const ExecStats stats = plan.execute(views, comm, out);
      o.note = "T=" + std::to_string(ctx.timeout.count()) + "ms; strategy " +
               std::string(strategy_name(stats.strategy)) + ", " + std::to_string(it + 1) +
               " gathers before the fault";
    }
  });
  // From the start of the call that failed, not of the loop.
  o.t_err_s = std::chrono::duration<double>(Clock::now() - call_start).count();
  o.msg_ok = o.err_msg.find("rank " + std::to_string(comm.rank())) != std::string::npos;
  emit(o);
}

// F8: rank 1 cannot allocate its output (RLIMIT_AS); every rank must raise OutOfMemory.
void f8_oom(Communicator& comm, const CaseContext& ctx) {
  Outcome o = base("F8", comm, ctx, "OutOfMemory");
  if (under_asan()) {
    o.outcome = "skipped";
    o.err_class = "OutOfMemory";
    o.note += "; RLIMIT_AS cannot be used under ASan";
    emit(o);
    return;
  }
  const std::int64_t elems = std::int64_t{64} << 20;  // 64 MiB of uint8 per rank
  std::vector<std::byte> in(static_cast<std::size_t>(elems), static_cast<std::byte>(comm.rank()));
  const std::uint64_t in_sum = checksum(in);
  const Rows rows(static_cast<std::size_t>(comm.size()), std::vector<Shape>{{elems}});
  const TensorView v{in.data(), DType::kUInt8, {elems}, {}};
  rlimit old{};
  getrlimit(RLIMIT_AS, &old);
  if (comm.rank() == 1) {
    std::ifstream f("/proc/self/status");
    std::string line;
    std::uint64_t vm_kib = 0;
    while (std::getline(f, line)) {
      if (line.rfind("VmSize:", 0) == 0) {
        vm_kib = std::strtoull(line.c_str() + 7, nullptr, 10);
      }
    }
    const rlimit lim{(vm_kib << 10) + (std::uint64_t{32} << 20), old.rlim_max};
    setrlimit(RLIMIT_AS, &lim);
  }
  capture(o, [&] {
    foreach_all_gather(std::span(&v, 1), comm, rows,
                       ForeachAllGatherOptions{.timeout = ctx.timeout, .preflight = true});
  });
  if (comm.rank() == 1) {
    setrlimit(RLIMIT_AS, &old);
  }
  o.in_changed = checksum(in) != in_sum;
  o.msg_ok = o.err_msg.find("rank 1") != std::string::npos;
  // The communicator stays usable: a small call right after is bit-exact.
  const Payload p(comm.size(), comm.rank(), 8);
  try {
    o.followup_ok = p.exact(foreach_all_gather(p.views, comm, p.rows));
  } catch (const std::exception& e) {
    o.followup_ok = false;
    o.note += std::string("; follow-up: ") + e.what();
  }
  emit(o);
}

// F9: rank 1 frees its communicator and finalizes MPI while rank 0 is in the operation.
void f9_finalize(std::unique_ptr<Communicator>& comm, const CaseContext& ctx) {
  Outcome o = base("F9", *comm, ctx, comm->rank() == 1 ? "Finalized" : "Timeout");
  if (comm->rank() == 1) {
    comm.reset();
    o.outcome = "finalized";
    o.err_class = "Finalized";
    emit(o);
    MPI_Finalize();
    std::exit(0);
  }
  const Payload p(comm->size(), comm->rank(), 64);
  capture(o, [&] {
    foreach_all_gather(p.views, *comm, p.rows,
                       ForeachAllGatherOptions{.timeout = ctx.timeout, .preflight = true});
  });
  emit(o);
}

// L1 (FSDP shapes, every iteration bit-exact, RSS/fds flat) and L2 (random lists).
void soak(Communicator& comm, const CaseContext& ctx, const std::string& id) {
  const char* env = std::getenv("SHARDGATHER_SOAK_ITERS");
  const int iters = env != nullptr ? std::atoi(env) : 2000;
  Outcome o = base(id, comm, ctx, "Ok");
  std::uint64_t bad = 0;
  std::vector<std::uint64_t> rss;
  const int fds0 = open_fds();
  const Clock::time_point t0 = Clock::now();
  capture(o, [&] {
    if (id == "L1") {
      const Payload sets[2] = {Payload(comm.size(), comm.rank(), 17 + comm.rank()),
                               Payload(comm.size(), comm.rank(), 17 + comm.rank())};
      Rows rows(static_cast<std::size_t>(comm.size()));
      for (int r = 0; r < comm.size(); ++r) {
        rows[static_cast<std::size_t>(r)] = {{17 + r, 64}, {7}};
      }
      for (int it = 0; it < iters; ++it) {
        const Payload& p = sets[it % 2];
        const GatherResult out = foreach_all_gather(p.views, comm, rows);
        if (!testing::verify_gather(out, rows, p.dtypes, 3).empty()) {
          ++bad;
        }
        if ((it + 1) % 100 == 0) {
          rss.push_back(rss_bytes());
        }
      }
    } else {
      for (int it = 0; it < iters / 20; ++it) {
        const testing::RandomList list = testing::random_list(0x12a2, it, comm.size(), 1000);
        std::vector<testing::HostTensor> tensors;
        for (std::size_t i = 0; i < list.dtypes.size(); ++i) {
          tensors.push_back(testing::make_tensor(
              list.dtypes[i], list.shapes[static_cast<std::size_t>(comm.rank())][i],
              static_cast<std::uint64_t>(it), comm.rank(), i));
        }
        const std::vector<TensorView> views = testing::views_of(tensors);
        const GatherResult out = it % 2 == 0 ? foreach_all_gather(views, comm)
                                             : foreach_all_gather(views, comm, list.shapes);
        const auto ref = testing::reference_gather(views, comm);
        for (std::size_t i = 0; i < ref.size(); ++i) {
          for (std::size_t r = 0; r < ref[i].size(); ++r) {
            if (out[i][r].shape != list.shapes[r][i] ||
                (!ref[i][r].empty() &&
                 std::memcmp(out[i][r].data, ref[i][r].data(), ref[i][r].size()) != 0)) {
              ++bad;
            }
          }
        }
      }
    }
  });
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  o.out_mismatch_bytes = bad;
  if (bad != 0) {
    o.err_class = "Corrupt";
  }
  // Growth over the second half only (the first is warm-up), by the floor of the last quarter
  // against the third: a leak raises the floor, malloc's map/trim of outputs moves the peaks.
  double growth = 0;
  if (rss.size() >= 4) {
    const auto q = static_cast<std::ptrdiff_t>(rss.size() / 4);
    growth = (static_cast<double>(*std::min_element(rss.begin() + 3 * q, rss.end())) -
              static_cast<double>(*std::min_element(rss.begin() + 2 * q, rss.begin() + 3 * q))) /
             (1 << 20);
  }
  char note[200];
  std::snprintf(note, sizeof note,
                "; %d iters in %.2f s, rss floor growth %.3f MiB 3rd->4th quarter, fds %d->%d",
                id == "L1" ? iters : iters / 20, secs, growth, fds0, open_fds());
  o.note += note;
  // Under ASan the quarantine keeps freed memory resident: RSS grows by design there.
  if ((growth >= 1.0 && !under_asan()) || open_fds() != fds0) {
    o.err_class = "Leak";
  }
  emit(o);
}

// L4: peak RSS of one call over this rank's inputs + outputs.
void l4_memory(Communicator& comm, const CaseContext& ctx) {
  Outcome o = base("L4", comm, ctx, "Ok");
  const char* env = std::getenv("SHARDGATHER_L4_MIB");
  const std::uint64_t bytes = static_cast<std::uint64_t>(env != nullptr ? std::atoi(env) : 256)
                              << 20;
  std::ofstream("/proc/self/clear_refs") << "5";
  const std::uint64_t base_rss = rss_bytes();
  double ratio = 0;
  // Outside the capture: after a Timeout a peer may still read it (MPI cannot cancel).
  std::vector<std::byte> in(bytes, static_cast<std::byte>(comm.rank() + 1));
  capture(o, [&] {
    const Rows rows(static_cast<std::size_t>(comm.size()),
                    std::vector<Shape>{{static_cast<std::int64_t>(bytes)}});
    const TensorView v{in.data(), DType::kUInt8, rows[0][0], {}};
    const GatherResult out =
        foreach_all_gather(std::span(&v, 1), comm, rows,
                           ForeachAllGatherOptions{.timeout = ctx.timeout, .preflight = true});
    for (int r = 0; r < comm.size(); ++r) {
      const auto* d = static_cast<const std::byte*>(out[0][static_cast<std::size_t>(r)].data);
      if (d[0] != static_cast<std::byte>(r + 1) || d[bytes - 1] != static_cast<std::byte>(r + 1)) {
        ++o.out_mismatch_bytes;
      }
    }
    ratio = static_cast<double>(peak_rss_bytes() - base_rss) /
            static_cast<double>(bytes * (1 + static_cast<std::uint64_t>(comm.size())));
  });
  char note[120];
  std::snprintf(note, sizeof note, "; %llu MiB per rank, peak/(in+out) = %.3f",
                static_cast<unsigned long long>(bytes >> 20), ratio);
  o.note += note;
  o.t_err_s = ratio;
  if (ratio > 1.1) {
    o.err_class = "TooMuchMemory";
  }
  emit(o);
}

// Pre-flight overhead: p50 per call with the check on and off at 1 KiB, 1 MiB, 64 MiB.
void overhead(Communicator& comm, const CaseContext& ctx) {
  for (const std::uint64_t bytes :
       {std::uint64_t{1} << 10, std::uint64_t{1} << 20, std::uint64_t{64} << 20}) {
    const auto elems = static_cast<std::int64_t>(bytes / 4);
    std::vector<float> in(static_cast<std::size_t>(elems), 1.0F);
    const Rows rows(static_cast<std::size_t>(comm.size()), std::vector<Shape>{{elems}});
    const TensorView v{in.data(), DType::kFloat32, {elems}, {}};
    const int reps = bytes >= (std::uint64_t{64} << 20) ? 15 : 301;
    double p50[2] = {0, 0};
    for (const bool preflight : {true, false}) {
      std::vector<double> t;
      for (int k = 0; k < reps + 5; ++k) {
        comm.barrier(comm.deadline_after(ctx.timeout));
        const Clock::time_point t0 = Clock::now();
        const GatherResult out = foreach_all_gather(
            std::span(&v, 1), comm, rows,
            ForeachAllGatherOptions{.timeout = ctx.timeout, .preflight = preflight});
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        double max_us = 0;
        // Per-call time is the max over ranks (CONVENTIONS' timing rule).
        MPI_Allreduce(&us, &max_us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (k >= 5) {
          t.push_back(max_us);
        }
      }
      std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
      p50[preflight ? 0 : 1] = t[t.size() / 2];
    }
    Outcome o = base("OVH", comm, ctx, "Ok");
    o.outcome = "ok";
    o.err_class = "Ok";
    char note[160];
    std::snprintf(note, sizeof note, "bytes=%llu p50_on_us=%.2f p50_off_us=%.2f delta_us=%.2f",
                  static_cast<unsigned long long>(bytes), p50[0], p50[1], p50[0] - p50[1]);
    o.note = note;
    emit(o);
  }
}

// The same measurement on the threads backend (W = 2 threads in this process; run at np 1).
void overhead_threads(const CaseContext& ctx) {
  for (const std::uint64_t bytes :
       {std::uint64_t{1} << 10, std::uint64_t{1} << 20, std::uint64_t{64} << 20}) {
    const auto elems = static_cast<std::int64_t>(bytes / 4);
    const Rows rows(2, std::vector<Shape>{{elems}});
    const int reps = bytes >= (std::uint64_t{64} << 20) ? 15 : 301;
    double p50[2] = {0, 0};
    for (const bool preflight : {true, false}) {
      std::vector<double> per_rank[2];
      testing::run_ranks(
          2,
          [&](int rank, Communicator& comm) {
            std::vector<float> in(static_cast<std::size_t>(elems), 1.0F);
            const TensorView v{in.data(), DType::kFloat32, {elems}, {}};
            for (int k = 0; k < reps + 5; ++k) {
              comm.barrier(comm.deadline_after(ctx.timeout));
              const Clock::time_point t0 = Clock::now();
              const GatherResult out = foreach_all_gather(
                  std::span(&v, 1), comm, rows,
                  ForeachAllGatherOptions{.timeout = ctx.timeout, .preflight = preflight});
              if (k >= 5) {
                per_rank[rank].push_back(
                    std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
              }
            }
          },
          "OVH-threads", std::chrono::minutes(5));
      std::vector<double> t(per_rank[0].size());
      for (std::size_t k = 0; k < t.size(); ++k) {
        t[k] = std::max(per_rank[0][k], per_rank[1][k]);
      }
      std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
      p50[preflight ? 0 : 1] = t[t.size() / 2];
    }
    Outcome o;
    o.case_id = "OVH-threads";
    o.backend = "threads";
    o.world = 2;
    o.expect = "Ok";
    o.outcome = "ok";
    o.err_class = "Ok";
    char note[160];
    std::snprintf(note, sizeof note, "bytes=%llu p50_on_us=%.2f p50_off_us=%.2f delta_us=%.2f",
                  static_cast<unsigned long long>(bytes), p50[0], p50[1], p50[0] - p50[1]);
    o.note = note;
    emit(o);
  }
}

// X2 / X3: large transfers (np 2). X2: 1.2e9 bytes per rank (2.4 GB gathered, counts < INT_MAX
// per rank, displacements past it); X3: 2^31 + 1 elements per rank (> INT_MAX). Bit-exact over
// every byte, with the bytes around every 2^31 boundary and the tail reported separately.
void large(Communicator& comm, const CaseContext& ctx, const std::string& id) {
  Outcome o = base(id, comm, ctx, "Ok");
  const std::uint64_t per_rank =
      id == "X2" ? std::uint64_t{1'200'000'000} : (std::uint64_t{1} << 31) + 1;
  const auto value = [](int rank, std::uint64_t i) {
    return static_cast<std::byte>((i * 131 + static_cast<std::uint64_t>(rank) * 7 + 1) & 0xffU);
  };
  std::uint64_t bad = 0;
  std::uint64_t boundary_bad = 0;
  capture(o, [&] {
    std::vector<std::byte> in(per_rank);
    for (std::uint64_t i = 0; i < per_rank; ++i) {
      in[i] = value(comm.rank(), i);
    }
    const Rows rows(static_cast<std::size_t>(comm.size()),
                    std::vector<Shape>{{static_cast<std::int64_t>(per_rank)}});
    const TensorView v{in.data(), DType::kUInt8, rows[0][0], {}};
    const GatherResult out =
        foreach_all_gather(std::span(&v, 1), comm, rows,
                           ForeachAllGatherOptions{.timeout = ctx.timeout, .preflight = true});
    for (int r = 0; r < comm.size(); ++r) {
      const auto* d = static_cast<const std::byte*>(out[0][static_cast<std::size_t>(r)].data);
      for (std::uint64_t i = 0; i < per_rank; ++i) {
        bad += d[i] != value(r, i) ? 1U : 0U;
      }
      // Every 2^31 boundary of the gathered buffer that falls in this block, and the tail.
      const std::uint64_t block = static_cast<std::uint64_t>(d - out.buffer().data());
      for (std::uint64_t b = std::uint64_t{1} << 31; b < out.buffer().size();
           b += std::uint64_t{1} << 31) {
        for (std::uint64_t k = b - 64; k < b + 64; ++k) {
          if (k >= block && k < block + per_rank) {
            boundary_bad += d[k - block] != value(r, k - block) ? 1U : 0U;
          }
        }
      }
      for (std::uint64_t k = per_rank - 64; k < per_rank; ++k) {
        boundary_bad += d[k] != value(r, k) ? 1U : 0U;
      }
    }
  });
  o.out_mismatch_bytes = bad;
  o.note += "; per_rank=" + std::to_string(per_rank) +
            " boundary_bad=" + std::to_string(boundary_bad) +
            " peak_rss_gib=" + std::to_string(static_cast<double>(peak_rss_bytes()) / (1 << 30));
  if (bad != 0 || boundary_bad != 0) {
    o.err_class = "Corrupt";
  }
  emit(o);
}

CaseContext mpi_context(bool preflight, std::chrono::milliseconds timeout) {
  CaseContext ctx;
  ctx.backend = "mpi";
  ctx.preflight = preflight;
  ctx.timeout = timeout;
  ctx.make_self = [] { return make_mpi_communicator(MPI_COMM_SELF); };
  ctx.bad_inits = [] {
    std::vector<std::string> classes;
    const auto attempt = [&](MPI_Comm c, std::uint64_t chunk) {
      try {
        (void)make_mpi_communicator(c, MpiOptions{.max_chunk_bytes = chunk});
        classes.emplace_back("none");
      } catch (const Error& e) {
        classes.emplace_back(error_code_name(e.code()));
      }
    };
    attempt(MPI_COMM_NULL, 1 << 20);
    attempt(MPI_COMM_WORLD, 0);
    attempt(MPI_COMM_WORLD, std::uint64_t{1} << 40);
    return classes;
  };
  return ctx;
}

int run(int argc, char** argv) {
  bool naked = false;
  std::chrono::milliseconds timeout{2000};
  std::vector<std::string> ids;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--naked") {
      naked = true;
    } else if (a == "--out-dir" && i + 1 < argc) {
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      const std::string path = std::string(argv[++i]) + "/rank" + std::to_string(rank) + ".jsonl";
      g_out = std::fopen(path.c_str(), "a");
      if (g_out == nullptr) {
        std::perror(path.c_str());
        return 2;
      }
    } else if (a == "--timeout-ms" && i + 1 < argc) {
      timeout = std::chrono::milliseconds(std::atoi(argv[++i]));
    } else {
      ids.push_back(a);
    }
  }
  const CaseContext ctx = mpi_context(!naked, timeout);
  std::unique_ptr<Communicator> comm = make_mpi_communicator(MPI_COMM_WORLD);
  comm->set_timeout(timeout);
  for (const std::string& id : ids) {
    if (const CaseDef* def = find_case(id)) {
      if (comm->size() < def->min_world) {
        continue;
      }
      // A fresh communicator per case (as the threads suite has a fresh group): an earlier
      // case may have left it poisoned (naked runs) or with a skewed op sequence (M7a).
      g_poisoned = g_poisoned || comm->is_poisoned();
      comm = make_mpi_communicator(MPI_COMM_WORLD);
      try {
        emit(def->fn(*comm, ctx));
      } catch (const std::exception& e) {
        Outcome o = base(id, *comm, ctx, "Ok");
        o.outcome = "error";
        o.err_class = "Uncaught";
        o.err_msg = e.what();
        emit(o);
      }
    } else if (id.rfind("F5-", 0) == 0) {
      f5_kill(*comm, mpi_context(true, 30s), id.substr(3));
    } else if (id.rfind("F6-", 0) == 0 || id.rfind("F7-", 0) == 0) {
      stall(*comm, ctx, id);
    } else if (id == "F8") {
      f8_oom(*comm, ctx);
    } else if (id == "F12-link" || id == "F13-host") {
      host_fault(*comm, ctx, id);
    } else if (id == "F9") {
      f9_finalize(comm, ctx);
    } else if (id == "L1" || id == "L2") {
      soak(*comm, ctx, id);
    } else if (id == "L4") {
      l4_memory(*comm, mpi_context(true, 60s));
    } else if (id == "OVH-threads") {
      overhead_threads(ctx);
    } else if (id == "OVH") {
      overhead(*comm, ctx);
    } else if (id == "X2" || id == "X3") {
      large(*comm, mpi_context(true, 600s), id);
    } else {
      std::fprintf(stderr, "unknown case %s\n", id.c_str());
      return 2;
    }
  }
  if (g_poisoned || comm->is_poisoned()) {
    // A posted collective cannot be cancelled, so MPI_Finalize could block forever: give the
    // peers a moment to print their lines, then end the job.
    std::this_thread::sleep_for(500ms);
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  comm.reset();
  return 0;
}

}  // namespace
}  // namespace shardgather::reliability

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--list-d") {
    // The generated family's ids, for run_mpi_cases.py (no MPI needed).
    for (const auto& c : shardgather::reliability::d_cases()) {
      std::printf("%s %d\n", c.id, c.min_world);
    }
    return 0;
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  // Open MPI 4.1 reports an error found while progressing a nonblocking collective (for
  // example MPI_ERR_TRUNCATE in a naked mismatch) through MPI_COMM_WORLD's handler, not the
  // communicator's: with the default MPI_ERRORS_ARE_FATAL the job dies before the library can
  // raise CommunicationError. Applications that want the error set this too (docs/errors.md).
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  const int rc = shardgather::reliability::run(argc, argv);
  MPI_Finalize();
  return rc;
}
