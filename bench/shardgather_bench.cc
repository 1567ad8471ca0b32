// shardgather-bench: nccl-tests-style benchmark of foreach_all_gather and unshard.
//
// Every case is measured in one process on the same buffers, side by side with the limit (one
// all-gather of the same bytes from one contiguous buffer on the same backend: MPI_Allgather
// under MPI; limit_v: MPI_Allgatherv of each rank's exact bytes) and the per-tensor loop. Timing
// rule: barrier (not timed), time one call, the iteration's time is the slowest rank's; report the
// median and the minimum. Buffers are allocated and touched before timing. Every result is verified
// after timing.
//
//   shardgather-bench --preset llama-layer --ranks 4              (threads backend, in-process)
//   mpirun -np 2 shardgather-bench --backend mpi --preset tiny-1000 --json out.json
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "compute.h"
#include "presets.h"
#include "reshard_bench.h"
#include "support/alloc_counter.h"
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "shardgather/shardgather.h"
#ifdef SHARDGATHER_BENCH_WITH_MPI
#include <mpi.h>

#include "shardgather/mpi.h"
#endif

namespace sg = shardgather;
using sg::bench::Param;

namespace {

// The inputs are a pattern of each full tensor's byte positions from this seed: every rank can
// make its own shards and check every other rank's bytes without holding the full tensors.
constexpr std::uint64_t kSeed = 20261130;
// Cases that gather at most this many bytes per rank get an untimed call before each timed one
// (see RankBench::time_case).
constexpr std::uint64_t kWarmCallBytes = std::uint64_t{16} << 20;

// What the command line asks for (parse(), --help).
struct Config {
  std::string preset = "llama-layer";
  sg::DType dtype = sg::DType::kBFloat16;
  std::string backend = "threads";
  int ranks = 4;
  int iters = 20;
  int warmup = 3;
  std::string json;
  std::vector<std::string> ops = {"limit", "foreach_all_gather", "unshard", "per_tensor"};
  std::vector<sg::Strategy> strategies = {sg::Strategy::kAuto, sg::Strategy::kDirect,
                                          sg::Strategy::kPacked, sg::Strategy::kShared};
  bool in_place = true;  // also time execute_shared (the views-into-the-window form)
  bool preflight = true;
  int copy_threads = 0;
  std::uint64_t bucket_mib = 256;  // op "stream"
  bool mpi_yield = false;          // MpiOptions::Wait::kYield
};

struct Result {
  std::string op;
  std::string strategy;
  std::string why{};               // what decided the strategy (ExecStats::why)
  std::vector<double> times_us{};  // each timed iteration's slowest rank, in order
  std::size_t tensors = 0;
  std::uint64_t bytes_per_rank = 0;  // the largest rank's shard bytes
  std::uint64_t gathered_bytes = 0;  // bytes each rank ends up with
  double time_us = 0;                // median over iterations of the slowest rank
  double min_us = 0;
  double algbw = 0;  // GB/s: gathered bytes / time
  double busbw = 0;  // GB/s: algbw * (world - 1) / world
  std::uint64_t wrong = 0;
  std::uint64_t metadata_collectives = 0;
  std::uint64_t preflight_collectives = 0;
  std::uint64_t payload_collectives = 0;
  double allocations = 0;  // per timed call, the largest rank's
  // op "overlap", strategy "both" only: time(both) / max(time(gather), time(compute)).
  double overlap_ratio = 0;
};

// What one rank holds: its shards of every parameter, and what every rank's shard looks like.
struct Setup {
  std::vector<Param> params;
  std::vector<sg::ShardSpec> specs;
  std::vector<sg::DType> dtypes;
  std::vector<std::vector<sg::Shape>> shapes;       // [r][i]
  std::vector<std::vector<std::uint64_t>> offsets;  // [r][i]: byte offset in the full tensor
  std::vector<std::vector<std::byte>> storage;
  std::vector<sg::TensorView> views;
  std::uint64_t max_bytes_per_rank = 0;
};

Setup make_setup(const Config& cfg, int world, int rank) {
  Setup s;
  s.params = sg::bench::make_preset(cfg.preset, cfg.dtype, world);
  s.shapes.resize(static_cast<std::size_t>(world));
  s.offsets.resize(static_cast<std::size_t>(world));
  std::vector<std::uint64_t> rank_bytes(static_cast<std::size_t>(world), 0);
  for (std::size_t i = 0; i < s.params.size(); ++i) {
    const sg::Shape& full = s.params[i].full;
    s.specs.push_back({cfg.dtype, full, 0, sg::chunk_sizes(full[0], world), 0});
    s.dtypes.push_back(cfg.dtype);
    const std::uint64_t row_bytes =
        full[0] == 0 ? 0
                     : sg::checked_nbytes(cfg.dtype, full) / static_cast<std::uint64_t>(full[0]);
    std::uint64_t row = 0;
    for (int r = 0; r < world; ++r) {
      sg::Shape shape = full;
      shape[0] = s.specs.back().sizes[static_cast<std::size_t>(r)];
      s.shapes[static_cast<std::size_t>(r)].push_back(shape);
      s.offsets[static_cast<std::size_t>(r)].push_back(row * row_bytes);
      row += static_cast<std::uint64_t>(shape[0]);
      rank_bytes[static_cast<std::size_t>(r)] += sg::checked_nbytes(cfg.dtype, shape);
    }
  }
  s.max_bytes_per_rank = *std::max_element(rank_bytes.begin(), rank_bytes.end());
  const auto me = static_cast<std::size_t>(rank);
  for (std::size_t i = 0; i < s.params.size(); ++i) {
    s.storage.emplace_back(sg::checked_nbytes(cfg.dtype, s.shapes[me][i]));
    sg::bench::fill_full_range(s.storage.back(), kSeed, i, s.offsets[me][i]);
    s.views.push_back({s.storage.back().data(), cfg.dtype, s.shapes[me][i], {}});
  }
  return s;
}

// Counts elements of `got` that differ from bytes [offset, offset + size) of full tensor i.
std::uint64_t count_wrong(const std::byte* got, std::uint64_t size, std::size_t i,
                          std::uint64_t offset, std::size_t elem, std::vector<std::byte>& buf) {
  constexpr std::uint64_t kChunk = std::uint64_t{1} << 20;
  std::uint64_t wrong = 0;
  for (std::uint64_t pos = 0; pos < size; pos += kChunk) {
    const std::uint64_t n = std::min(kChunk, size - pos);
    buf.resize(n);
    sg::bench::fill_full_range(buf, kSeed, i, offset + pos);
    if (std::memcmp(got + pos, buf.data(), n) != 0) {
      for (std::uint64_t e = 0; e < n; e += elem) {
        wrong += std::memcmp(got + pos + e, buf.data() + e, elem) != 0 ? 1U : 0U;
      }
    }
  }
  return wrong;
}

// The backend's own collectives that the cases are measured against: an equal-size all-gather
// (padded to the largest rank) and a variable-size one (exact bytes, back to back).
struct Limits {
  std::function<void(std::span<const std::byte>, std::span<std::byte>)> all_gather;
  std::function<void(std::span<const std::byte>, std::byte*, std::span<const std::uint64_t>,
                     std::span<const std::uint64_t>)>
      all_gather_v;
};

bool is_strategy_name(const std::string& name) {
  try {
    sg::parse_strategy(name);
    return true;
  } catch (const sg::InvalidArgument&) {
    return false;  // a case's own label (execute_shared, serial, ...)
  }
}

// The benchmark body every rank runs: it builds the cases, times them, verifies them and
// returns every case's result.
class RankBench {
 public:
  RankBench(sg::Communicator& comm, const Config& cfg, Limits limits)
      : comm_(comm),
        cfg_(cfg),
        limits_(std::move(limits)),
        setup_(make_setup(cfg, comm.size(), comm.rank())) {}

  std::vector<Result> run() {
    build_cases();
    settle_auto();
    return summarize(time_cases());
  }

  const Setup& setup() const { return setup_; }

 private:
  struct Case {
    Result result;
    std::function<void()> call;
    std::function<std::uint64_t()> verify;  // wrong elements on this rank
    const sg::ExecStats* stats = nullptr;
    std::uint64_t issued = 0;  // collectives of the last timed call on this rank
  };

  // kAuto measures its candidates on a plan's first executions: run those untimed, so that the
  // timed iterations see what it settled on (the same number of calls on every rank: `why`
  // is the same everywhere).
  void settle_auto() {
    for (Case& k : cases_) {
      for (int n = 0; n < 16 && k.result.strategy == "auto" && k.stats != nullptr &&
                      (n == 0 || std::strcmp(k.stats->why, "measuring") == 0);
           ++n) {
        comm_.barrier(deadline());
        k.call();
      }
    }
  }

  // This rank's measurements are one row per case: the timed iterations' times (us), then the
  // heap allocations per timed call, then the wrong elements its verification found. Rows of
  // doubles, so that one all_gather brings every rank's to every rank.
  std::size_t row_size() const { return static_cast<std::size_t>(cfg_.iters) + 2; }

  // Cases are interleaved: each iteration runs every case once, so slow drift of the machine
  // (page collapsing, neighbours) hits all cases alike and the ratios stay side by side.
  std::vector<double> time_cases() {
    const int total = cfg_.warmup + cfg_.iters;
    std::vector<double> mine(cases_.size() * row_size(), 0.0);
    const auto start = std::chrono::steady_clock::now();
    auto last_note = start;
    for (int it = 0; it < total; ++it) {
      for (std::size_t c = 0; c < cases_.size(); ++c) {
        time_case(cases_[c], it, std::span(mine).subspan(c * row_size(), row_size()));
      }
      note_progress(it + 1, total, start, last_note);
    }
    return mine;
  }

  // Iteration `it` of one case: a barrier (not timed), then one timed call. Cases of one op
  // share one output buffer, so each case's result is verified right after its last timed
  // call, before another case overwrites it.
  void time_case(Case& k, int it, std::span<double> row) {
    // A small case runs once untimed first, so its buffers are as warm as they would be in
    // a loop of its own: otherwise the previous case's bytes decide its cache state.
    if (k.result.gathered_bytes <= kWarmCallBytes) {
      comm_.barrier(deadline());
      k.call();
    }
    comm_.barrier(deadline());
    const std::uint64_t a0 = sg::testing::thread_allocations();
    const std::uint64_t c0 = comm_.collectives_issued();
    const auto t0 = std::chrono::steady_clock::now();
    k.call();
    const auto t1 = std::chrono::steady_clock::now();
    const std::uint64_t a1 = sg::testing::thread_allocations();
    k.issued = comm_.collectives_issued() - c0;
    if (it >= cfg_.warmup) {
      const auto timed = static_cast<std::size_t>(it - cfg_.warmup);
      row[timed] = std::chrono::duration<double, std::micro>(t1 - t0).count();
      row[row.size() - 2] += static_cast<double>(a1 - a0) / cfg_.iters;
    }
    if (it == cfg_.warmup + cfg_.iters - 1) {
      row[row.size() - 1] = static_cast<double>(k.verify());
    }
  }

  // A long run says how far it is (rank 0, on stderr), so that it is not taken for a hang;
  // short runs stay quiet.
  void note_progress(int done, int total, std::chrono::steady_clock::time_point start,
                     std::chrono::steady_clock::time_point& last_note) const {
    const auto now = std::chrono::steady_clock::now();
    if (comm_.rank() == 0 && now - start > std::chrono::seconds(3) &&
        now - last_note > std::chrono::seconds(2)) {
      std::fprintf(stderr, "# ... iteration %d of %d (%zu cases each)\n", done, total,
                   cases_.size());
      last_note = now;
    }
  }

  // Every rank's rows to every rank, then one Result per case.
  std::vector<Result> summarize(const std::vector<double>& mine) {
    const auto world = static_cast<std::size_t>(comm_.size());
    std::vector<double> all(mine.size() * world);
    comm_.all_gather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)),
                     deadline());
    std::vector<Result> results;
    for (std::size_t c = 0; c < cases_.size(); ++c) {
      results.push_back(summarize_case(c, all, mine.size()));
    }
    return results;
  }

  // Case c's result from every rank's rows (rank q's start at all[q * per_rank]). An
  // iteration's time is the slowest rank's: a collective is done when its last rank is.
  Result summarize_case(std::size_t c, const std::vector<double>& all, std::size_t per_rank) const {
    Result r = cases_[c].result;
    const std::size_t n = row_size();
    std::vector<double> slowest(static_cast<std::size_t>(cfg_.iters), 0.0);
    double wrong = 0;
    for (std::size_t q = 0; q < static_cast<std::size_t>(comm_.size()); ++q) {
      const double* row = all.data() + q * per_rank + c * n;
      for (std::size_t it = 0; it < slowest.size(); ++it) {
        slowest[it] = std::max(slowest[it], row[it]);
      }
      r.allocations = std::max(r.allocations, row[n - 2]);
      wrong += row[n - 1];
    }
    r.times_us = slowest;  // in iteration order, for the variance (the JSON's times_us)
    std::sort(slowest.begin(), slowest.end());
    r.time_us = slowest[slowest.size() / 2];
    r.min_us = slowest.front();
    r.wrong = static_cast<std::uint64_t>(wrong);
    r.tensors = setup_.params.size();
    r.bytes_per_rank = setup_.max_bytes_per_rank;
    const double w = comm_.size();
    r.algbw = static_cast<double>(r.gathered_bytes) / (r.time_us * 1e3);
    r.busbw = r.algbw * (w - 1) / w;
    if (cases_[c].stats != nullptr) {
      add_exec_stats(r, cases_[c]);
    }
    return r;
  }

  // What the library reported about the case's last timed call on this rank.
  static void add_exec_stats(Result& r, const Case& k) {
    const sg::ExecStats& st = *k.stats;
    // What the call issued beyond its header, payload and one-time setup: metadata.
    r.metadata_collectives =
        k.issued - st.preflight_collectives - st.payload_collectives - st.setup_collectives;
    r.preflight_collectives = st.preflight_collectives;
    r.payload_collectives = st.payload_collectives;
    r.why = st.why;
    // What ran, where it is not the strategy asked for (auto's choice, or a fallback).
    if (is_strategy_name(r.strategy) && r.strategy != sg::strategy_name(st.strategy)) {
      r.strategy += ":" + std::string(sg::strategy_name(st.strategy));
    }
  }

  sg::Deadline deadline() const { return comm_.deadline_after(std::chrono::minutes(5)); }

  sg::PlanOptions plan_options(sg::Strategy strategy) const {
    return {.timeout = {},
            .preflight = cfg_.preflight,
            .strategy = strategy,
            .copy_threads = cfg_.copy_threads};
  }

  void build_cases() {
    for (const std::string& op : cfg_.ops) {
      if (op == "limit") {
        add_limit();
      } else if (op == "limit_v") {
        add_limit_v();
      } else if (op == "per_tensor") {
        add_foreach(sg::Strategy::kPerTensor, "per_tensor");
      } else if (op == "overlap") {
        add_overlap();
      } else if (op == "stream") {
        add_stream(0, -1, "serial");     // the gathers alone, one after another
        add_stream(1, -1, "prefetch1");  // bucket k + 1 in flight while bucket k is held
        add_stream(1, 0, "to_rank0");    // a gather to one rank (checkpoint export)
      } else {
        for (const sg::Strategy strategy : cfg_.strategies) {
          if (op == "unshard") {
            add_unshard(strategy);
          } else {
            add_foreach(strategy, "foreach_all_gather");
          }
        }
        if (op == "foreach_all_gather" && cfg_.in_place) {
          add_foreach_shared();
        }
      }
    }
  }

  void add_limit() {
    const std::uint64_t n = setup_.max_bytes_per_rank;
    limit_send_.assign(n, std::byte{0});
    std::size_t pos = 0;
    for (const auto& shard : setup_.storage) {
      std::memcpy(limit_send_.data() + pos, shard.data(), shard.size());
      pos += shard.size();
    }
    limit_recv_.assign(n * static_cast<std::size_t>(comm_.size()), std::byte{0xee});
    Case k;
    k.result = Result{.op = "limit", .strategy = "-"};
    k.result.gathered_bytes = limit_recv_.size();
    k.call = [this] { limits_.all_gather(limit_send_, limit_recv_); };
    k.verify = [this, n] {
      return wrong_in_blocks(limit_recv_.data(), [n](std::size_t q) { return q * n; });
    };
    cases_.push_back(std::move(k));
  }

  // Wrong elements of a limit's result: rank q's shards back to back from recv + block_at(q).
  std::uint64_t wrong_in_blocks(const std::byte* recv,
                                const std::function<std::uint64_t(std::size_t)>& block_at) const {
    std::uint64_t wrong = 0;
    std::vector<std::byte> buf;
    for (std::size_t q = 0; q < static_cast<std::size_t>(comm_.size()); ++q) {
      std::uint64_t at = block_at(q);
      for (std::size_t i = 0; i < setup_.params.size(); ++i) {
        const std::uint64_t bytes = sg::checked_nbytes(cfg_.dtype, setup_.shapes[q][i]);
        wrong +=
            count_wrong(recv + at, bytes, i, setup_.offsets[q][i], sg::dtype_size(cfg_.dtype), buf);
        at += bytes;
      }
    }
    return wrong;
  }

  // Each rank's exact bytes, back to back: MPI_Allgatherv of what foreach_all_gather moves.
  void add_limit_v() {
    const auto world = static_cast<std::size_t>(comm_.size());
    limit_counts_.assign(world, 0);
    limit_displs_.assign(world, 0);
    std::uint64_t total = 0;
    for (std::size_t q = 0; q < world; ++q) {
      for (std::size_t i = 0; i < setup_.params.size(); ++i) {
        limit_counts_[q] += sg::checked_nbytes(cfg_.dtype, setup_.shapes[q][i]);
      }
      limit_displs_[q] = total;
      total += limit_counts_[q];
    }
    limit_v_send_.clear();
    for (const auto& shard : setup_.storage) {
      limit_v_send_.insert(limit_v_send_.end(), shard.begin(), shard.end());
    }
    limit_v_recv_.assign(total, std::byte{0xee});
    Case k;
    k.result = Result{.op = "limit_v", .strategy = "-"};
    k.result.gathered_bytes = total;
    k.call = [this] {
      limits_.all_gather_v(limit_v_send_, limit_v_recv_.data(), limit_counts_, limit_displs_);
    };
    k.verify = [this] {
      return wrong_in_blocks(limit_v_recv_.data(),
                             [this](std::size_t q) { return limit_displs_[q]; });
    };
    cases_.push_back(std::move(k));
  }

  // Wrong elements in views[i * world + q] (rank q's tensor i of a foreach result).
  std::uint64_t count_wrong_views(const std::vector<sg::TensorView>& views) const {
    const auto world = static_cast<std::size_t>(comm_.size());
    std::uint64_t wrong = 0;
    std::vector<std::byte> buf;
    for (std::size_t i = 0; i < setup_.params.size(); ++i) {
      for (std::size_t q = 0; q < world; ++q) {
        const sg::TensorView& v = views[i * world + q];
        wrong +=
            count_wrong(static_cast<const std::byte*>(v.data), sg::checked_nbytes(v.dtype, v.shape),
                        i, setup_.offsets[q][i], sg::dtype_size(cfg_.dtype), buf);
      }
    }
    return wrong;
  }

  void add_foreach(sg::Strategy strategy, const char* op) {
    auto& plan = gather_plans_.emplace_back(std::make_unique<sg::AllGatherPlan>(
        setup_.dtypes, setup_.shapes, comm_.rank(), plan_options(strategy)));
    foreach_out_.resize(plan->output_bytes(), std::byte{0xee});
    auto& stats = stats_.emplace_back(std::make_unique<sg::ExecStats>());
    Case k;
    k.result = Result{.op = op, .strategy = std::string(sg::strategy_name(strategy))};
    k.result.gathered_bytes = plan->output_bytes();
    k.stats = stats.get();
    k.call = [this, p = plan.get(), st = stats.get()] {
      *st = p->execute(setup_.views, comm_, foreach_out_);
    };
    k.verify = [this, p = plan.get()] {
      const std::vector<sg::TensorView> views = p->views(foreach_out_.data());
      const std::uint64_t wrong = count_wrong_views(views);
      std::memset(foreach_out_.data(), 0xee, foreach_out_.size());  // the next case starts dirty
      return wrong;
    };
    cases_.push_back(std::move(k));
  }

  // The overlap cases: a planned gather alone (execute), the stand-in compute alone, and both
  // (start, compute, wait). The compute is sized on every rank to about the gather's time,
  // and the same on every rank (the largest rank's count).
  void add_overlap() {
    auto& plan = gather_plans_.emplace_back(std::make_unique<sg::AllGatherPlan>(
        setup_.dtypes, setup_.shapes, comm_.rank(), plan_options(sg::Strategy::kAuto)));
    sg::AllGatherPlan* p = plan.get();
    overlap_out_.resize(p->output_bytes(), std::byte{0xee});
    const double gather_us =
        median_us(3, [&] { (void)p->execute(setup_.views, comm_, overlap_out_); });
    const double unit_us = median_us(3, [&] { compute_.run(1); });
    std::uint64_t units =
        std::max<std::uint64_t>(1, static_cast<std::uint64_t>(gather_us / unit_us));
    std::vector<std::uint64_t> all(static_cast<std::size_t>(comm_.size()));
    comm_.all_gather(std::as_bytes(std::span(&units, 1)), std::as_writable_bytes(std::span(all)),
                     deadline());
    overlap_units_ = *std::max_element(all.begin(), all.end());
    auto& stats = stats_.emplace_back(std::make_unique<sg::ExecStats>());
    const auto verify = [this, p] {
      const std::uint64_t wrong = count_wrong_views(p->views(overlap_out_.data()));
      std::memset(overlap_out_.data(), 0xee, overlap_out_.size());
      return wrong;
    };
    const auto add = [&](const char* what, std::function<void()> call, bool gathers) {
      Case k;
      k.result = Result{.op = "overlap", .strategy = what};
      k.result.gathered_bytes = p->output_bytes();
      k.stats = gathers ? stats.get() : nullptr;
      k.call = std::move(call);
      k.verify = gathers ? std::function<std::uint64_t()>(verify) : [] { return std::uint64_t{0}; };
      cases_.push_back(std::move(k));
    };
    add(
        "gather",
        [this, p, st = stats.get()] { *st = p->execute(setup_.views, comm_, overlap_out_); }, true);
    add(
        "compute", [this] { compute_.run(overlap_units_); }, false);
    add(
        "both",
        [this, p, st = stats.get()] {
          sg::Work<sg::ExecStats> work = p->start(setup_.views, comm_, overlap_out_);
          compute_.run(overlap_units_);
          *st = work.wait();
        },
        true);
  }

  // Median wall time of `n` barrier-separated calls on this rank, in microseconds.
  double median_us(int n, const std::function<void()>& fn) {
    std::vector<double> t;
    for (int k = 0; k < n; ++k) {
      comm_.barrier(deadline());
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      t.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }

  // execute_shared: the gathered bytes are read in place; nothing is copied out.
  void add_foreach_shared() {
    auto& plan = gather_plans_.emplace_back(std::make_unique<sg::AllGatherPlan>(
        setup_.dtypes, setup_.shapes, comm_.rank(), plan_options(sg::Strategy::kAuto)));
    auto& stats = stats_.emplace_back(std::make_unique<sg::ExecStats>());
    Case k;
    k.result = Result{.op = "foreach_all_gather", .strategy = "execute_shared"};
    k.result.gathered_bytes = plan->output_bytes();
    k.stats = stats.get();
    k.call = [this, p = plan.get(), st = stats.get()] {
      shared_result_ = p->execute_shared(setup_.views, comm_, st);
    };
    k.verify = [this, p = plan.get()] {
      const std::vector<sg::TensorView> views = p->views(shared_result_.data());
      const std::uint64_t wrong = count_wrong_views(views);
      return wrong;
    };
    cases_.push_back(std::move(k));
  }

  void add_unshard(sg::Strategy strategy) {
    auto& plan = unshard_plans_.emplace_back(std::make_unique<sg::UnshardPlan>(
        setup_.specs, comm_.size(), comm_.rank(), plan_options(strategy)));
    unshard_out_.resize(plan->output_bytes(), std::byte{0xee});
    auto& stats = stats_.emplace_back(std::make_unique<sg::ExecStats>());
    Case k;
    k.result = Result{.op = "unshard", .strategy = std::string(sg::strategy_name(strategy))};
    for (const auto& spec : setup_.specs) {
      k.result.gathered_bytes += sg::checked_nbytes(spec.dtype, spec.full_shape);
    }
    k.stats = stats.get();
    k.call = [this, p = plan.get(), st = stats.get()] {
      *st = p->execute(setup_.views, comm_, unshard_out_);
    };
    k.verify = [this, p = plan.get()] {
      std::uint64_t wrong = 0;
      std::vector<std::byte> buf;
      const std::vector<sg::TensorView> views = p->views(unshard_out_.data());
      for (std::size_t i = 0; i < views.size(); ++i) {
        wrong += count_wrong(static_cast<const std::byte*>(views[i].data),
                             sg::checked_nbytes(views[i].dtype, views[i].shape), i, 0,
                             sg::dtype_size(cfg_.dtype), buf);
      }
      std::memset(unshard_out_.data(), 0xee, unshard_out_.size());
      return wrong;
    };
    cases_.push_back(std::move(k));
  }

  // One whole UnshardStream per call (begin, every bucket, the end), the buckets consumed by
  // nothing: what the stream adds to the gathers themselves. Verified bucket by bucket.
  void add_stream(int prefetch, int dst, const char* name) {
    sg::StreamOptions options;
    options.bucket_bytes = cfg_.bucket_mib << 20U;
    options.prefetch = prefetch;
    options.dst = dst;
    options.plan = plan_options(sg::Strategy::kAuto);
    auto& stream = streams_.emplace_back(
        std::make_unique<sg::UnshardStream>(setup_.specs, comm_.size(), comm_.rank(), options));
    Case k;
    k.result = Result{.op = "stream", .strategy = name};
    for (const auto& spec : setup_.specs) {
      k.result.gathered_bytes += sg::checked_nbytes(spec.dtype, spec.full_shape);
    }
    k.call = [this, st = stream.get()] {
      st->begin(setup_.views, comm_);
      while (st->next()) {
      }
    };
    k.verify = [this, st = stream.get()] {
      std::uint64_t wrong = 0;
      std::vector<std::byte> buf;
      st->begin(setup_.views, comm_);
      while (const std::optional<sg::StreamBucket> bucket = st->next()) {
        for (std::size_t j = 0; j < bucket->full.size(); ++j) {
          const sg::TensorView& v = bucket->full[j];
          wrong += count_wrong(static_cast<const std::byte*>(v.data),
                               sg::checked_nbytes(v.dtype, v.shape), bucket->first_param + j, 0,
                               sg::dtype_size(cfg_.dtype), buf);
        }
      }
      return wrong;
    };
    cases_.push_back(std::move(k));
  }

  sg::Communicator& comm_;
  const Config& cfg_;
  Limits limits_;
  Setup setup_;
  std::vector<Case> cases_;
  std::vector<std::unique_ptr<sg::AllGatherPlan>> gather_plans_;
  std::vector<std::unique_ptr<sg::UnshardPlan>> unshard_plans_;
  std::vector<std::unique_ptr<sg::ExecStats>> stats_;
  std::vector<std::unique_ptr<sg::UnshardStream>> streams_;
  std::vector<std::byte> limit_send_;
  std::vector<std::byte> limit_recv_;
  std::vector<std::byte> limit_v_send_;
  std::vector<std::byte> limit_v_recv_;
  std::vector<std::uint64_t> limit_counts_;
  std::vector<std::uint64_t> limit_displs_;
  std::vector<std::byte> foreach_out_;
  std::vector<std::byte> unshard_out_;
  std::vector<std::byte> overlap_out_;
  std::span<const std::byte> shared_result_;
  sg::bench::Compute compute_;
  std::uint64_t overlap_units_ = 1;
};

// Fills in the overlap ratio of the "both" row from the medians of the three overlap rows.
void add_overlap_ratio(std::vector<Result>& results) {
  double gather = 0;
  double compute = 0;
  Result* both = nullptr;
  for (Result& r : results) {
    if (r.op != "overlap") {
      continue;
    }
    if (r.strategy == "gather" || r.strategy.rfind("gather", 0) == 0) {
      gather = r.time_us;
    } else if (r.strategy == "compute") {
      compute = r.time_us;
    } else {
      both = &r;
    }
  }
  if (both != nullptr && std::max(gather, compute) > 0) {
    both->overlap_ratio = both->time_us / std::max(gather, compute);
  }
}

// The lines above the table: what ran, how it was measured, and the column names.
void print_header(const Config& cfg, int world, const Setup& setup,
                  const std::string& mpi_library) {
  std::printf("# shardgather-bench %s\n", SHARDGATHER_VERSION_STRING);
  std::printf("# preset %s, dtype %s, backend %s%s, world %d, iters %d (+%d warmup), seed %llu\n",
              cfg.preset.c_str(), std::string(sg::dtype_name(cfg.dtype)).c_str(),
              cfg.backend.c_str(), mpi_library.empty() ? "" : (" (" + mpi_library + ")").c_str(),
              world, cfg.iters, cfg.warmup, static_cast<unsigned long long>(kSeed));
  std::printf(
      "# %zu tensors, dim-0 shards (torch.chunk), %llu bytes on the largest rank, "
      "pre-flight check %s\n",
      setup.params.size(), static_cast<unsigned long long>(setup.max_bytes_per_rank),
      cfg.preflight ? "on" : "off");
  std::printf(
      "# time: median over iterations of the slowest rank; algbw = gathered bytes per "
      "rank / time; busbw = algbw * (world-1)/world\n#\n");
  std::printf("# %18s %20s %13s %8s %11s %11s %11s %11s %7s %8s %6s %6s\n", "op", "strategy",
              "bytes/rank", "tensors", "time(us)", "min(us)", "algbw(GB/s)", "busbw(GB/s)",
              "#wrong", "vs_limit", "meta", "allocs");
}

// One line per case; vs_limit compares each case with the limit measured in the same run.
void print_rows(const std::vector<Result>& results) {
  double limit_us = 0;
  for (const Result& r : results) {
    if (r.op == "limit") {
      limit_us = r.time_us;
    }
  }
  for (const Result& r : results) {
    std::printf("  %18s %20s %13llu %8zu %11.1f %11.1f %11.3f %11.3f %7llu %8.3f %6llu %6.1f\n",
                r.op.c_str(), r.strategy.c_str(), static_cast<unsigned long long>(r.bytes_per_rank),
                r.tensors, r.time_us, r.min_us, r.algbw, r.busbw,
                static_cast<unsigned long long>(r.wrong), limit_us > 0 ? limit_us / r.time_us : 0.0,
                static_cast<unsigned long long>(r.metadata_collectives), r.allocations);
  }
}

// The lines under the table: the overlap ratio, the verification's verdict, the average bus
// bandwidth (as nccl-tests ends its output) and what the columns mean.
void print_summary(const std::vector<Result>& results) {
  std::uint64_t wrong = 0;
  double busbw_sum = 0;
  for (const Result& r : results) {
    wrong += r.wrong;
    busbw_sum += r.busbw;
  }
  for (const Result& r : results) {
    if (r.overlap_ratio > 0) {
      std::printf(
          "# overlap: time(both) / max(time(gather), time(compute)) = %.3f (1.0: full overlap, "
          "2.0: none)\n",
          r.overlap_ratio);
    }
  }
  std::printf("# Out of bounds values : %llu %s\n", static_cast<unsigned long long>(wrong),
              wrong == 0 ? "OK" : "FAILED");
  std::printf("# Avg bus bandwidth    : %.3f GB/s\n#\n",
              results.empty() ? 0.0 : busbw_sum / static_cast<double>(results.size()));
  std::printf(
      "# vs_limit = limit time / this time (1.0 = as fast as one contiguous all-gather); "
      "meta = metadata collectives per call; allocs = heap allocations per call\n");
}

void print_table(const Config& cfg, int world, const Setup& setup,
                 const std::vector<Result>& results, const std::string& mpi_library) {
  print_header(cfg, world, setup, mpi_library);
  print_rows(results);
  print_summary(results);
}

// The --json document: nlohmann's ordered_json keeps the keys in the order they are written,
// the order the file has always had.
using Json = nlohmann::ordered_json;

// `x` with `decimals` digits after the point, as the file has always shown it: more digits of a
// timing would be noise, and the writer prints the shortest form that reads back as this value.
double rounded(double x, int decimals) {
  const double scale = std::pow(10.0, decimals);
  return std::round(x * scale) / scale;
}

// Where and when the run was made, what was built, and how the run was set up.
Json json_context(const Config& cfg, int world, const std::string& mpi_library) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  char date[64] = {};
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return {{"host", host},
          {"date", date},
          {"num_cpus", std::thread::hardware_concurrency()},
          {"library_version", SHARDGATHER_VERSION_STRING},
          {"build_type", SHARDGATHER_BENCH_BUILD_TYPE},
          {"backend", cfg.backend},
          {"mpi_library", mpi_library},
          {"preset", cfg.preset},
          {"world_size", world},
          {"iters", cfg.iters},
          {"warmup", cfg.warmup},
          {"preflight", cfg.preflight}};
}

// One case's row; each row repeats the run's set-up so that rows of several files can be pooled.
Json json_result(const Config& cfg, int world, const Result& r) {
  Json times = Json::array();
  for (const double t : r.times_us) {
    times.push_back(rounded(t, 1));
  }
  return {{"preset", cfg.preset},
          {"backend", cfg.backend},
          {"world_size", world},
          {"dtype", std::string(sg::dtype_name(cfg.dtype))},
          {"tensors", r.tensors},
          {"bytes_per_rank", r.bytes_per_rank},
          {"gathered_bytes", r.gathered_bytes},
          {"op", r.op},
          {"strategy", r.strategy},
          {"why", r.why},
          {"time_us", rounded(r.time_us, 3)},
          {"min_us", rounded(r.min_us, 3)},
          {"algbw_gbps", rounded(r.algbw, 4)},
          {"busbw_gbps", rounded(r.busbw, 4)},
          {"wrong", r.wrong},
          {"metadata_collectives", r.metadata_collectives},
          {"preflight_collectives", r.preflight_collectives},
          {"payload_collectives", r.payload_collectives},
          {"allocations", rounded(r.allocations, 2)},
          {"overlap_ratio", rounded(r.overlap_ratio, 4)},
          {"times_us", std::move(times)}};
}

// Writes the results as JSON (schema_version 1, docs/benchmarking.md "Definitions").
void write_json(const Config& cfg, int world, const std::vector<Result>& results,
                const std::string& mpi_library) {
  Json rows = Json::array();
  for (const Result& r : results) {
    rows.push_back(json_result(cfg, world, r));
  }
  const Json doc = {{"schema_version", 1},
                    {"context", json_context(cfg, world, mpi_library)},
                    {"results", std::move(rows)}};
  std::ofstream out(cfg.json);
  // Bytes that are not UTF-8 (in a host name, or the MPI library's string) are replaced: the
  // run's results are worth more than those bytes.
  out << doc.dump(2, ' ', false, Json::error_handler_t::replace) << '\n';
  out.close();
  if (!out) {
    throw sg::InvalidArgument("cannot write " + cfg.json);
  }
}

// --ops and --strategies take comma-separated lists. An empty item is kept, so that "a,,b" is
// refused by name like any other unknown item rather than skipped.
std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t begin = 0;
  while (begin <= s.size()) {
    const std::size_t end = std::min(s.find(',', begin), s.size());
    out.push_back(s.substr(begin, end - begin));
    begin = end + 1;
  }
  return out;
}

// A CLI11 transform for the integer options. CLI11 2.1 reads integers with base 0, as C's
// strtoll does ("010" is 8, "0x10" is 16); the bench has always read them in decimal. So a value
// must be decimal digits after an optional sign, and its leading zeros are dropped before CLI11
// converts it.
std::string as_decimal(std::string& value) {
  const std::size_t sign = !value.empty() && (value[0] == '-' || value[0] == '+') ? 1 : 0;
  if (value.size() == sign || value.find_first_not_of("0123456789", sign) != std::string::npos) {
    return "not a decimal integer: " + value;
  }
  const std::size_t first_digit = std::min(value.find_first_not_of('0', sign), value.size() - 1);
  value.erase(sign, first_digit - sign);
  return {};
}

// An integer option, read in decimal and shown as N in the help.
template <typename T>
void add_number(CLI::App& app, const std::string& names, T& value, const std::string& help) {
  app.add_option(names, value, help)->transform(CLI::Validator(as_decimal, ""))->option_text("N");
}

// The options that choose what is measured. Names (--dtype, --strategies) go through the
// library's own parsers, so that a bad one gets the message it gets everywhere else.
void add_case_options(CLI::App& app, Config& cfg) {
  app.add_option("-p,--preset", cfg.preset,
                 "llama-layer (default), tiny-1000, single-64m, llama-model;\n"
                 "single-<N>m: one tensor of N MiB per rank")
      ->option_text("NAME");
  app.add_option_function<std::string>(
         "-d,--dtype",
         [&cfg](const std::string& name) { cfg.dtype = sg::bench::parse_dtype(name); },
         "bf16 (default), f16, f32, f64, ...")
      ->option_text("NAME");
  app.add_option("-b,--backend", cfg.backend, "threads (default, in-process) or mpi (under mpirun)")
      ->option_text("NAME");
  add_number(app, "-r,--ranks", cfg.ranks, "ranks of the threads backend (default 4)");
  add_number(app, "-n,--iters", cfg.iters, "timed iterations per case (default 20)");
  add_number(app, "-w,--warmup", cfg.warmup, "untimed iterations first (default 3)");
  app.add_option_function<std::string>(
         "-o,--ops", [&cfg](const std::string& list) { cfg.ops = split(list); },
         "limit,foreach_all_gather,unshard,per_tensor (default: these),\n"
         "limit_v (MPI_Allgatherv of each rank's exact bytes),\n"
         "overlap (a started gather while this thread computes),\n"
         "stream (a whole UnshardStream per call: serial, prefetch 1,\n"
         "to rank 0)")
      ->option_text("LIST");
  add_number(app, "--bucket-mib", cfg.bucket_mib, "the stream op's bucket size (default 256)");
  app.add_option_function<std::string>(
         "-s,--strategies",
         [&cfg](const std::string& list) {
           cfg.strategies.clear();
           for (const std::string& name : split(list)) {
             cfg.strategies.push_back(sg::parse_strategy(name));
           }
         },
         "auto,direct,packed,shared (default: all four), hierarchical;\n"
         "a case that ran another shows requested:ran")
      ->option_text("LIST");
}

// The options that change how the cases run, and the output.
void add_run_options(CLI::App& app, Config& cfg) {
  app.add_flag_callback(
      "--no-in-place", [&cfg] { cfg.in_place = false; },
      "skip the execute_shared case (views into the window)");
  app.add_flag_callback(
      "--no-preflight", [&cfg] { cfg.preflight = false; }, "skip the pre-flight header check");
  add_number(app, "--copy-threads", cfg.copy_threads,
             "threads for copy-in/out (default: cores / ranks on host)");
  app.add_flag_callback(
      "--mpi-yield", [&cfg] { cfg.mpi_yield = true; },
      "MPI waits yield the core between tests (MpiOptions::Wait::kYield:\n"
      "ranks of several simulated hosts share one machine's cores)");
  app.add_option("-J,--json", cfg.json, "also write the results as JSON (schema_version 1)")
      ->option_text("FILE");
}

// What the option types cannot check, with the messages the bench has always printed.
void validate(const Config& cfg) {
  static const std::vector<std::string> known_ops = {
      "limit", "limit_v", "foreach_all_gather", "unshard", "per_tensor", "overlap", "stream"};
  for (const std::string& op : cfg.ops) {
    if (std::find(known_ops.begin(), known_ops.end(), op) == known_ops.end()) {
      throw sg::InvalidArgument("unknown op " + op);
    }
  }
  if (cfg.iters < 1 || cfg.warmup < 0 || cfg.ranks < 1) {
    throw sg::InvalidArgument("iters >= 1, warmup >= 0 and ranks >= 1 please");
  }
  sg::bench::make_preset(cfg.preset, cfg.dtype, 1);  // validates the name
}

// The command line, or nullopt once --help has been printed. Every mistake throws
// InvalidArgument, so that main reports it the one way (exit 2, one line on stderr).
std::optional<Config> parse(int argc, char** argv) {
  Config cfg;
  CLI::App app("", "shardgather-bench");
  // Repeating an option overrides it, as it always has (CLI11 refuses repeats by default).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // The description column where the hand-written --help had it.
  app.get_formatter()->column_width(25);
  // Unknown arguments are collected rather than thrown, to name the first one as before.
  app.allow_extras();
  add_case_options(app, cfg);
  add_run_options(app, cfg);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help
    app.exit(e);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    throw sg::InvalidArgument(e.what());
  }
  if (!app.remaining().empty()) {
    throw sg::InvalidArgument("unknown option " + app.remaining().front() + " (--help lists them)");
  }
  validate(cfg);
  return cfg;
}

int report(const Config& cfg, int world, const Setup& setup, std::vector<Result> results,
           const std::string& mpi_library) {
  add_overlap_ratio(results);
  print_table(cfg, world, setup, results, mpi_library);
  if (!cfg.json.empty()) {
    write_json(cfg, world, results, mpi_library);
  }
  for (const Result& r : results) {
    if (r.wrong != 0) {
      return 1;
    }
  }
  return 0;
}

// The threads backend's limits: its own all_gather and all_gather_v on the rank's communicator.
Limits thread_limits(sg::Communicator& comm) {
  const auto deadline = [&comm] { return comm.deadline_after(std::chrono::minutes(5)); };
  Limits limits;
  limits.all_gather = [&comm, deadline](std::span<const std::byte> send,
                                        std::span<std::byte> recv) {
    comm.all_gather(send, recv, deadline());
  };
  limits.all_gather_v = [&comm, deadline](std::span<const std::byte> send, std::byte* recv,
                                          std::span<const std::uint64_t> counts,
                                          std::span<const std::uint64_t> displs) {
    const sg::ConstSegment segment{send.data(), send.size()};
    comm.all_gather_v(std::span(&segment, 1), recv, counts, displs, deadline());
  };
  return limits;
}

// Every rank on a thread of this process. A rank that fails aborts the group, so that the
// others leave their collectives instead of waiting for it.
int run_threads(const Config& cfg) {
  auto comms = sg::make_thread_group(cfg.ranks);
  std::vector<std::vector<Result>> results(static_cast<std::size_t>(cfg.ranks));
  std::optional<Setup> setup0;
  std::vector<std::string> errors(static_cast<std::size_t>(cfg.ranks));
  std::vector<std::thread> threads;
  std::mutex mu;
  for (int r = 0; r < cfg.ranks; ++r) {
    threads.emplace_back([&, r] {
      sg::Communicator& comm = *comms[static_cast<std::size_t>(r)];
      try {
        RankBench bench(comm, cfg, thread_limits(comm));
        results[static_cast<std::size_t>(r)] = bench.run();
        if (r == 0) {
          const std::lock_guard<std::mutex> lock(mu);
          setup0 = bench.setup();
        }
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
        comm.abort();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (const std::string& e : errors) {
    if (!e.empty()) {
      std::fprintf(stderr, "shardgather-bench: %s\n", e.c_str());
      return 2;
    }
  }
  return report(cfg, cfg.ranks, *setup0, results[0], "");
}

#ifdef SHARDGATHER_BENCH_WITH_MPI
// The MPI library's name and version for the table and the JSON: its string up to the first
// comma or line break (Open MPI's goes on with its repository and release date).
std::string mpi_library_version() {
  char library[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(library, &len);
  std::string lib(library, static_cast<std::size_t>(len));
  return lib.substr(0, lib.find_first_of(",\n"));
}

// MPI's own collectives as the limits. MPI_Allgatherv takes int arrays: `counts` and `displs`
// belong to the caller and are reused, so that the limit allocates nothing per call, like the
// cases.
Limits mpi_limits(std::vector<int>& counts, std::vector<int>& displs) {
  Limits limits;
  limits.all_gather = [](std::span<const std::byte> send, std::span<std::byte> recv) {
    MPI_Allgather(send.data(), static_cast<int>(send.size()), MPI_BYTE, recv.data(),
                  static_cast<int>(send.size()), MPI_BYTE, MPI_COMM_WORLD);
  };
  limits.all_gather_v = [&counts, &displs](std::span<const std::byte> send, std::byte* recv,
                                           std::span<const std::uint64_t> c,
                                           std::span<const std::uint64_t> d) {
    counts.assign(c.begin(), c.end());
    displs.assign(d.begin(), d.end());
    MPI_Allgatherv(send.data(), static_cast<int>(send.size()), MPI_BYTE, recv, counts.data(),
                   displs.data(), MPI_BYTE, MPI_COMM_WORLD);
  };
  return limits;
}

// One rank per process, under mpirun. Rank 0 reports; its exit code is broadcast, so that every
// rank, and so mpirun, exits with it.
int run_mpi(const Config& cfg, int argc, char** argv) {
  int provided = 0;
  // SERIALIZED: started operations (the overlap op) call MPI from the progress thread.
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0;
  int world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const std::string lib = mpi_library_version();
  int rc = 0;
  {
    auto comm = sg::make_mpi_communicator(
        MPI_COMM_WORLD, sg::MpiOptions{.max_chunk_bytes = sg::MpiOptions{}.max_chunk_bytes,
                                       .wait = cfg.mpi_yield ? sg::MpiOptions::Wait::kYield
                                                             : sg::MpiOptions::Wait::kAuto});
    try {
      std::vector<int> counts;
      std::vector<int> displs;
      RankBench bench(*comm, cfg, mpi_limits(counts, displs));
      const std::vector<Result> results = bench.run();
      if (rank == 0) {
        rc = report(cfg, world, bench.setup(), results, lib);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shardgather-bench: rank %d: %s\n", rank, e.what());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return rc;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 1 && std::string(argv[1]) == "reshard") {
      return sg::bench::reshard_main(argc - 1, argv + 1);
    }
    const std::optional<Config> parsed = parse(argc, argv);
    if (!parsed) {
      return 0;  // --help
    }
    const Config& cfg = *parsed;
    if (cfg.backend == "threads") {
      return run_threads(cfg);
    }
    if (cfg.backend == "mpi") {
#ifdef SHARDGATHER_BENCH_WITH_MPI
      return run_mpi(cfg, argc, argv);
#else
      throw sg::InvalidArgument("this build has no MPI backend");
#endif
    }
    throw sg::InvalidArgument("unknown backend " + cfg.backend + " (threads, mpi)");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardgather-bench: %s\n", e.what());
    return 2;
  }
}
