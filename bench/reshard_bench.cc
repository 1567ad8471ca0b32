#include "reshard_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "presets.h"
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "shardgather/shardgather.h"
#ifdef SHARDGATHER_BENCH_WITH_MPI
#include <mpi.h>

#include "shardgather/mpi.h"
#endif

namespace shardgather::bench {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kSeed = 20261203;

struct Config {
  std::string backend = "threads";
  int sources = 4;
  int tp = 2;
  int replicas = 2;
  std::string model = "qwen3-8b";
  // "engine": FSDP sources into a TP engine on other ranks; "unshard": every source rank wants
  // every full tensor (the unshard, as a reshard), against UnshardPlan.
  std::string layout = "engine";
  int layers = 1;
  int iters = 5;
  int warmup = 1;
  std::vector<std::string> methods = {"reshard",      "reshard_flat", "reshard_a2aw",
                                      "gather_bcast", "owner_bcast",  "slice_p2p"};
  std::string json;
  bool mpi_yield = false;
  DType dtype = DType::kBFloat16;
  std::size_t waves = 4;
  [[nodiscard]] bool unshard() const { return layout == "unshard"; }
  [[nodiscard]] bool gather() const { return layout == "gather"; }
  // The layouts of the full tensors (every rank, or rank 0): the sources are the whole world.
  [[nodiscard]] bool full() const { return unshard() || gather(); }
  [[nodiscard]] int world() const { return full() ? sources : sources + tp * replicas; }
};

// How an engine splits a tensor over its TP ranks.
enum class Split : std::uint8_t { kColumn, kRow, kReplicated };

struct Tensor {
  std::string name;
  Shape shape;
  Split split;
};

// Qwen3-8B's decoder layers (hidden 4096, 32 q and 8 kv heads of 128, MLP 12288), or a
// mixture-of-experts model of many small tensors (hidden 256, 64 experts of MLP 64 per layer: 199
// tensors per layer, 32 layers by default).
std::vector<Tensor> make_model(const Config& cfg) {
  std::vector<Tensor> out;
  const bool moe = cfg.model == "qwen3-moe";
  const std::int64_t hidden = moe ? 256 : 4096;
  const std::int64_t kv = moe ? 64 : 1024;
  for (int l = 0; l < cfg.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    out.push_back({p + "self_attn.q_proj", {hidden, hidden}, Split::kColumn});
    out.push_back({p + "self_attn.k_proj", {kv, hidden}, Split::kColumn});
    out.push_back({p + "self_attn.v_proj", {kv, hidden}, Split::kColumn});
    out.push_back({p + "self_attn.o_proj", {hidden, hidden}, Split::kRow});
    out.push_back({p + "input_layernorm", {hidden}, Split::kReplicated});
    out.push_back({p + "post_attention_layernorm", {hidden}, Split::kReplicated});
    if (!moe) {
      out.push_back({p + "self_attn.q_norm", {128}, Split::kReplicated});
      out.push_back({p + "self_attn.k_norm", {128}, Split::kReplicated});
      out.push_back({p + "mlp.gate_proj", {12288, hidden}, Split::kColumn});
      out.push_back({p + "mlp.up_proj", {12288, hidden}, Split::kColumn});
      out.push_back({p + "mlp.down_proj", {hidden, 12288}, Split::kRow});
      continue;
    }
    out.push_back({p + "mlp.gate", {64, hidden}, Split::kReplicated});
    for (int e = 0; e < 64; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      out.push_back({x + "gate_proj", {64, hidden}, Split::kColumn});
      out.push_back({x + "up_proj", {64, hidden}, Split::kColumn});
      out.push_back({x + "down_proj", {hidden, 64}, Split::kRow});
    }
  }
  return out;
}

// torch.chunk piece `k` of `n` along `dim`.
Box chunk_box(const Shape& shape, std::size_t dim, int k, int n) {
  Box b{Shape(shape.size(), 0), shape};
  const std::int64_t step = (shape[dim] + n - 1) / n;
  b.offset[dim] = std::min(step * k, shape[dim]);
  b.size[dim] = std::min(step, shape[dim] - b.offset[dim]);
  return b;
}

// FSDP dim-0 shards on ranks 0..M-1; the engine's TP layout on ranks M.., replica by replica.
std::vector<TensorRegions> make_layout(const Config& cfg, const std::vector<Tensor>& model) {
  std::vector<TensorRegions> layout;
  for (const Tensor& t : model) {
    TensorRegions r{.dtype = cfg.dtype, .shape = t.shape, .sources = {}, .destinations = {}};
    for (int s = 0; s < cfg.sources; ++s) {
      r.sources.push_back({s, chunk_box(t.shape, 0, s, cfg.sources)});
    }
    for (int s = 0; cfg.full() && s < (cfg.gather() ? 1 : cfg.sources); ++s) {
      r.destinations.push_back({s, Box{Shape(t.shape.size(), 0), t.shape}});
    }
    for (int rep = 0; rep < cfg.replicas && !cfg.full(); ++rep) {
      for (int j = 0; j < cfg.tp; ++j) {
        const int rank = cfg.sources + rep * cfg.tp + j;
        const bool whole =
            t.split == Split::kReplicated || (t.split == Split::kRow && t.shape.size() < 2);
        r.destinations.push_back(
            {rank, whole ? Box{Shape(t.shape.size(), 0), t.shape}
                         : chunk_box(t.shape, t.split == Split::kColumn ? 0 : 1, j, cfg.tp)});
      }
    }
    layout.push_back(std::move(r));
  }
  return layout;
}

std::uint64_t box_bytes(const Box& b, DType dtype) { return checked_nbytes(dtype, b.size); }

// Calls fn(row offset in the full tensor in elements, offset inside the box in elements,
// elements) for each contiguous row of a box of a 0-, 1- or 2-d tensor.
template <typename Fn>
void for_each_row(const Shape& shape, const Box& b, Fn&& fn) {
  if (box_elements(b) == 0) {
    return;
  }
  if (shape.size() < 2) {
    fn(shape.empty() ? 0 : b.offset[0], 0, shape.empty() ? 1 : b.size[0]);
    return;
  }
  for (std::int64_t r = 0; r < b.size[0]; ++r) {
    fn((b.offset[0] + r) * shape[1] + b.offset[1], r * b.size[1], b.size[1]);
  }
}

// One rank's tensors: its source boxes filled from the full tensors' pattern, its destination
// boxes (contiguous), and the views over them.
struct RankData {
  std::vector<std::vector<std::byte>> src;
  std::vector<std::vector<std::byte>> dst;
  std::vector<TensorView> src_views;
  std::vector<TensorView> dst_views;

  RankData(const ReshardPlan& plan, DType dtype) {
    const std::size_t elem = dtype_size(dtype);
    for (std::size_t v = 0; v < plan.source_count(); ++v) {
      const std::size_t i = plan.regions().source_views[v].tensor;
      const Box& b = plan.source(v).box;
      src.emplace_back(box_bytes(b, dtype));
      for_each_row(plan.tensor(i).shape, b,
                   [&](std::int64_t full, std::int64_t in, std::int64_t n) {
                     fill_full_range(std::span(src.back())
                                         .subspan(static_cast<std::size_t>(in) * elem,
                                                  static_cast<std::size_t>(n) * elem),
                                     kSeed, i, static_cast<std::uint64_t>(full) * elem);
                   });
      src_views.push_back({src.back().data(), dtype, b.size, {}, kCpu});
    }
    for (std::size_t v = 0; v < plan.destination_count(); ++v) {
      dst.emplace_back(box_bytes(plan.destination(v).box, dtype));
      dst_views.push_back({dst.back().data(), dtype, plan.destination(v).box.size, {}, kCpu});
    }
  }

  // Bytes of the destinations that differ from the full tensors; zeroes them for the next method.
  std::uint64_t check_and_clear(const ReshardPlan& plan, DType dtype) {
    const std::size_t elem = dtype_size(dtype);
    std::uint64_t wrong = 0;
    std::vector<std::byte> want;
    for (std::size_t v = 0; v < dst.size(); ++v) {
      const std::size_t i = plan.regions().destination_views[v].tensor;
      for_each_row(plan.tensor(i).shape, plan.destination(v).box,
                   [&](std::int64_t full, std::int64_t in, std::int64_t n) {
                     want.resize(static_cast<std::size_t>(n) * elem);
                     fill_full_range(want, kSeed, i, static_cast<std::uint64_t>(full) * elem);
                     const std::byte* got = dst[v].data() + static_cast<std::size_t>(in) * elem;
                     for (std::size_t k = 0; k < want.size(); ++k) {
                       wrong += got[k] != want[k] ? 1U : 0U;
                     }
                   });
      std::fill(dst[v].begin(), dst[v].end(), std::byte{0});
    }
    return wrong;
  }
};

struct Result {
  std::string method;
  std::vector<double> times_ms;
  double median_ms = 0;
  double min_ms = 0;
  std::uint64_t wrong = 0;
  double received_ratio = 0;  // reshard: the worst destination's bytes received / its boxes' bytes
  double allocations = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The transport under a method: timing across ranks and the anchors' own collectives.
struct Backend {
  Communicator* comm = nullptr;
  std::function<double(double)> slowest;  // max over ranks
  std::function<std::uint64_t(std::uint64_t)> sum;
#ifdef SHARDGATHER_BENCH_WITH_MPI
  MPI_Comm mpi = MPI_COMM_NULL;
  // The same ranks with MpiOptions::Exchange::kAlltoallw: the reshard_a2aw method's.
  Communicator* alltoallw = nullptr;
#endif
};

// A method: prepare once (allocations), then run once per iteration.
struct Method {
  std::string name;
  std::function<void()> run;
};

// The unshard and gather layouts' own operation: an UnshardPlan (dim-0 shards of the sources,
// torch.chunk; to rank 0 only for the gather) executed into the destination views, which are the
// full tensors.
struct Unshard {
  std::optional<UnshardPlan> plan;
  Strategy strategy;

  Unshard(const Config& cfg, const ReshardPlan& reshard, Strategy requested) : strategy(requested) {
    std::vector<ShardSpec> specs;
    for (std::size_t i = 0; i < reshard.tensors(); ++i) {
      specs.push_back({cfg.dtype, reshard.tensor(i).shape, 0, {}, 0});
    }
    PlanOptions options;
    options.strategy = requested;
    options.dst = cfg.gather() ? 0 : -1;
    plan.emplace(specs, cfg.world(), reshard.rank(), options);
  }

  void run(RankData& data, Communicator& comm) {
    plan->execute(data.src_views, comm, data.dst_views);
  }

  // auto's trial executions (strategy.h, kAutoTrialRuns), untimed, so that the timed calls run
  // the strategy it settled on.
  void settle(RankData& data, Communicator& comm) {
    for (int k = 0; k < kAutoTrialRuns && strategy == Strategy::kAuto && plan->dst() < 0; ++k) {
      run(data, comm);
    }
  }
};

#ifdef SHARDGATHER_BENCH_WITH_MPI
// Copies box `b` from `src` (box `from`, contiguous) to `dst` (box `to`, contiguous), 0-2 dims.
void copy_box(const std::byte* src, const Box& from, std::byte* dst, const Box& to, const Box& b,
              std::size_t elem) {
  const auto at = [&](const Box& in, std::int64_t row, std::int64_t col) {
    if (in.size.empty()) {
      return std::int64_t{0};
    }
    return in.size.size() == 1 ? row - in.offset[0]
                               : (row - in.offset[0]) * in.size[1] + (col - in.offset[1]);
  };
  const std::int64_t rows = b.size.empty() ? 1 : b.size[0];
  const std::int64_t cols = b.size.size() < 2 ? (b.size.empty() ? 1 : b.size[0]) : b.size[1];
  const std::int64_t row0 = b.offset.empty() ? 0 : b.offset[0];
  const std::int64_t col0 = b.offset.size() < 2 ? 0 : b.offset[1];
  if (box_elements(b) == 0) {
    return;
  }
  if (b.size.size() < 2) {
    std::memcpy(dst + at(to, row0, 0) * static_cast<std::int64_t>(elem),
                src + at(from, row0, 0) * static_cast<std::int64_t>(elem),
                static_cast<std::size_t>(cols) * elem);
    return;
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + at(to, row0 + r, col0) * static_cast<std::int64_t>(elem),
                src + at(from, row0 + r, col0) * static_cast<std::int64_t>(elem),
                static_cast<std::size_t>(cols) * elem);
  }
}

// MPI_Bcast of any size, in chunks an int counts.
void bcast(std::byte* data, std::uint64_t bytes, int root, MPI_Comm comm) {
  constexpr std::uint64_t kChunk = std::uint64_t{1} << 30;
  for (std::uint64_t at = 0; at < bytes; at += kChunk) {
    MPI_Bcast(data + at, static_cast<int>(std::min(kChunk, bytes - at)), MPI_BYTE, root, comm);
  }
}

// (a) vLLM's, SGLang's and verl's default update: the sources gather every full tensor to rank 0
// (one gather to one rank, this library's own, the fastest the transport has), rank 0
// broadcasts the full model to the destinations (MPI_Bcast on their communicator), and each
// destination copies its boxes out of the full tensors.
struct GatherBroadcast {
  std::vector<ShardSpec> specs;
  std::optional<UnshardPlan> gather;
  std::vector<TensorView> shards;
  std::vector<std::byte> full;
  MPI_Comm group = MPI_COMM_NULL;

  GatherBroadcast(const Config& cfg, const ReshardPlan& plan, RankData& data, MPI_Comm world) {
    const int rank = plan.rank();
    for (std::size_t i = 0; i < plan.tensors(); ++i) {
      ShardSpec s{cfg.dtype, plan.tensor(i).shape, 0, {}, 0};
      for (int r = 0; r < cfg.world(); ++r) {
        s.sizes.push_back(r < cfg.sources ? chunk_box(s.full_shape, 0, r, cfg.sources).size[0] : 0);
      }
      specs.push_back(s);
    }
    PlanOptions to_root;
    to_root.dst = 0;
    gather.emplace(specs, cfg.world(), rank, to_root);
    for (std::size_t i = 0; i < plan.tensors(); ++i) {
      if (rank < cfg.sources) {
        shards.push_back(data.src_views[i]);
      } else {
        shards.push_back({nullptr, cfg.dtype, gather->shard_shape(rank, i), {}, kCpu});
      }
    }
    const bool member = rank == 0 || rank >= cfg.sources;
    MPI_Comm_split(world, member ? 0 : MPI_UNDEFINED, rank, &group);
    if (member) {
      full.resize(gather->output_bytes());
    }
  }
  GatherBroadcast(const GatherBroadcast&) = delete;
  GatherBroadcast& operator=(const GatherBroadcast&) = delete;
  GatherBroadcast(GatherBroadcast&&) = delete;
  GatherBroadcast& operator=(GatherBroadcast&&) = delete;
  ~GatherBroadcast() {
    if (group != MPI_COMM_NULL) {
      MPI_Comm_free(&group);
    }
  }

  void run(const ReshardPlan& plan, RankData& data, Communicator& comm, DType dtype) {
    gather->execute(shards, comm, std::span(full));
    if (group == MPI_COMM_NULL) {
      return;
    }
    bcast(full.data(), full.size(), 0, group);
    const std::size_t elem = dtype_size(dtype);
    for (std::size_t v = 0; v < plan.destination_count(); ++v) {
      const std::size_t i = plan.regions().destination_views[v].tensor;
      const Box whole{Shape(plan.tensor(i).shape.size(), 0), plan.tensor(i).shape};
      copy_box(full.data() + gather->output_offset(i), whole, data.dst[v].data(),
               plan.destination(v).box, plan.destination(v).box, elem);
    }
  }
};

// (b) checkpoint-engine's: each source in turn broadcasts its whole shard to the destinations,
// which copy out what they need.
struct OwnerBroadcast {
  std::vector<MPI_Comm> groups;             // per source: it and the destinations
  std::vector<std::uint64_t> shard_offset;  // per tensor: in a source's shard buffer
  std::vector<std::byte> staging;           // a source's shards, back to back

  OwnerBroadcast(const Config& cfg, const ReshardPlan& plan, MPI_Comm world) {
    const int rank = plan.rank();
    for (int s = 0; s < cfg.sources; ++s) {
      MPI_Comm g = MPI_COMM_NULL;
      const bool member = rank == s || rank >= cfg.sources;
      MPI_Comm_split(world, member ? 0 : MPI_UNDEFINED, rank == s ? -1 : rank, &g);
      groups.push_back(g);
    }
    std::uint64_t largest = 0;
    for (int s = 0; s < cfg.sources; ++s) {
      std::uint64_t at = 0;
      for (std::size_t i = 0; i < plan.tensors(); ++i) {
        at += box_bytes(plan.tensor(i).sources[static_cast<std::size_t>(s)].box, cfg.dtype);
      }
      largest = std::max(largest, at);
    }
    staging.resize(largest);
  }
  OwnerBroadcast(const OwnerBroadcast&) = delete;
  OwnerBroadcast& operator=(const OwnerBroadcast&) = delete;
  OwnerBroadcast(OwnerBroadcast&&) = delete;
  OwnerBroadcast& operator=(OwnerBroadcast&&) = delete;
  ~OwnerBroadcast() {
    for (MPI_Comm& g : groups) {
      if (g != MPI_COMM_NULL) {
        MPI_Comm_free(&g);
      }
    }
  }

  void run(const Config& cfg, const ReshardPlan& plan, RankData& data) {
    const std::size_t elem = dtype_size(cfg.dtype);
    const int rank = plan.rank();
    for (int s = 0; s < cfg.sources; ++s) {
      if (groups[static_cast<std::size_t>(s)] == MPI_COMM_NULL) {
        continue;
      }
      std::uint64_t at = 0;
      for (std::size_t i = 0; i < plan.tensors(); ++i) {  // the owner packs its shards
        const std::uint64_t n =
            box_bytes(plan.tensor(i).sources[static_cast<std::size_t>(s)].box, cfg.dtype);
        if (rank == s) {
          std::memcpy(staging.data() + at, data.src[i].data(), n);
        }
        at += n;
      }
      bcast(staging.data(), at, 0, groups[static_cast<std::size_t>(s)]);
      if (rank == s) {
        continue;
      }
      std::uint64_t offset = 0;
      for (std::size_t i = 0; i < plan.tensors(); ++i) {
        const Box& held = plan.tensor(i).sources[static_cast<std::size_t>(s)].box;
        for (std::size_t v = 0; v < plan.destination_count(); ++v) {
          if (plan.regions().destination_views[v].tensor != i) {
            continue;
          }
          const Box& want = plan.destination(v).box;
          copy_box(staging.data() + offset, held, data.dst[v].data(), want, intersect(held, want),
                   elem);
        }
        offset += box_bytes(held, cfg.dtype);
      }
    }
  }
};

// (c) Awex's: one message per overlapping slice, each slice packed into its own buffer, posted
// as nonblocking sends and receives.
struct SliceP2P {
  std::vector<std::byte> out;
  std::vector<std::byte> in;
  std::vector<MPI_Request> requests;

  explicit SliceP2P(const ReshardPlan& plan) {
    std::uint64_t sent = 0;
    for (const Transfer& t : plan.regions().sends) {
      sent += t.bytes;
    }
    std::uint64_t received = 0;
    for (const Transfer& t : plan.regions().receives) {
      received += t.bytes;
    }
    out.resize(sent);
    in.resize(received);
    requests.reserve(plan.regions().sends.size() + plan.regions().receives.size());
  }

  void run(const ReshardPlan& plan, RankData& data, DType dtype, MPI_Comm world) {
    const std::size_t elem = dtype_size(dtype);
    const RegionPlan& r = plan.regions();
    requests.clear();
    std::uint64_t at = 0;
    for (int q = 0; q < r.world_size; ++q) {
      for (std::size_t k = r.recv_first[static_cast<std::size_t>(q)];
           k < r.recv_first[static_cast<std::size_t>(q) + 1]; ++k) {
        requests.emplace_back();
        MPI_Irecv(in.data() + at, static_cast<int>(r.receives[k].bytes), MPI_BYTE, q,
                  static_cast<int>((k - r.recv_first[static_cast<std::size_t>(q)]) % 32000), world,
                  &requests.back());
        at += r.receives[k].bytes;
      }
    }
    at = 0;
    for (int p = 0; p < r.world_size; ++p) {
      for (std::size_t k = r.send_first[static_cast<std::size_t>(p)];
           k < r.send_first[static_cast<std::size_t>(p) + 1]; ++k) {
        const Transfer& t = r.sends[k];
        copy_box(data.src[t.src_view].data(), plan.source(t.src_view).box, out.data() + at, t.box,
                 t.box, elem);
        requests.emplace_back();
        MPI_Isend(out.data() + at, static_cast<int>(t.bytes), MPI_BYTE, p,
                  static_cast<int>((k - r.send_first[static_cast<std::size_t>(p)]) % 32000), world,
                  &requests.back());
        at += t.bytes;
      }
    }
    MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    at = 0;
    for (const Transfer& t : r.receives) {
      copy_box(in.data() + at, t.box, data.dst[t.dst_view].data(), plan.destination(t.dst_view).box,
               t.box, elem);
      at += t.bytes;
    }
  }
};

// A host link's rate in bytes/s: rank 0 sends 128 MiB to the last rank, best of 3
// (a smaller message reads low: the shaper's and TCP's ramp weigh in).
double link_rate(const Config& cfg, MPI_Comm world, int rank) {
  constexpr int kBytes = 128 << 20;
  std::vector<std::byte> buf(kBytes);
  const int peer = cfg.world() - 1;
  double best = 1e30;
  for (int k = 0; k < 3; ++k) {
    MPI_Barrier(world);
    const Clock::time_point t0 = Clock::now();
    if (rank == 0) {
      MPI_Send(buf.data(), kBytes, MPI_BYTE, peer, 7, world);
      MPI_Recv(buf.data(), 1, MPI_BYTE, peer, 8, world, MPI_STATUS_IGNORE);
    } else if (rank == peer) {
      MPI_Recv(buf.data(), kBytes, MPI_BYTE, 0, 7, world, MPI_STATUS_IGNORE);
      MPI_Send(buf.data(), 1, MPI_BYTE, 0, 8, world);
    }
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  MPI_Bcast(&best, 1, MPI_DOUBLE, 0, world);
  return kBytes / best;
}
#endif

// Times `run` (barrier, one call, the slowest rank) iters times after warmup calls.
Result time_method(const Config& cfg, const std::string& name, Backend& b,
                   const std::function<void()>& run) {
  Result res;
  res.method = name;
  for (int k = 0; k < cfg.warmup + cfg.iters; ++k) {
    b.comm->barrier(b.comm->deadline_after(std::chrono::minutes(5)));
    const Clock::time_point t0 = Clock::now();
    run();
    const double mine = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    const double slowest = b.slowest(mine);
    if (k >= cfg.warmup) {
      res.times_ms.push_back(slowest);
    }
  }
  res.median_ms = median(res.times_ms);
  res.min_ms = *std::min_element(res.times_ms.begin(), res.times_ms.end());
  return res;
}

struct Run {
  std::vector<Result> results;
  std::vector<std::uint64_t> rank_sent;
  std::vector<std::uint64_t> rank_received;
  std::vector<std::uint64_t> rank_local;  // copied to itself: on no link
  // Per host, between hosts (the fan-out plan's; empty on one host): what each host's link
  // carries out and in.
  std::vector<std::uint64_t> host_sent;
  std::vector<std::uint64_t> host_received;
  std::vector<std::uint64_t> flat_host_received;  // the same without the fan-out
  std::uint64_t wanted_bytes = 0;                 // every destination box's bytes, summed
  double link_rate = 0;                           // bytes/s, 0 where not measured
  std::size_t tensors = 0;
};

Run run_rank(const Config& cfg, Backend& b) {
  Communicator& comm = *b.comm;
  const std::vector<Tensor> model = make_model(cfg);
  const std::vector<TensorRegions> layout = make_layout(cfg, model);
  RegionOptions options;
  options.fan_out_waves = cfg.waves;
  ReshardPlan plan = ReshardPlan::for_communicator(layout, comm, {}, options);
  options.fan_out = false;
  ReshardPlan flat = ReshardPlan::for_communicator(layout, comm, {}, options);
  RankData data(plan, cfg.dtype);
  Run run;
  run.tensors = layout.size();
  run.rank_sent = plan.regions().rank_sent;
  run.rank_received = plan.regions().rank_received;
  run.rank_local = plan.regions().rank_local;
  const auto& hosts = plan.regions().host_sent;
  if (std::any_of(hosts.begin(), hosts.end(), [](std::uint64_t n) { return n != 0; })) {
    run.host_sent = plan.regions().host_sent;
    run.host_received = plan.regions().host_received;
    run.flat_host_received = flat.regions().host_received;
  }
  for (const TensorRegions& t : layout) {
    for (const RankBox& d : t.destinations) {
      run.wanted_bytes += box_bytes(d.box, cfg.dtype);
    }
  }
#ifdef SHARDGATHER_BENCH_WITH_MPI
  std::optional<GatherBroadcast> gb;
  std::optional<OwnerBroadcast> ob;
  std::optional<SliceP2P> sp;
  if (b.mpi != MPI_COMM_NULL) {
    run.link_rate = link_rate(cfg, b.mpi, comm.rank());
  }
#endif
  std::optional<Unshard> un;
  for (const std::string& m : cfg.methods) {
    std::function<void()> fn;
    if (m == "reshard") {
      fn = [&] { plan.execute(data.src_views, comm, data.dst_views); };
    }
    if (m == "reshard_flat") {
      fn = [&] { flat.execute(data.src_views, comm, data.dst_views); };
    }
    Communicator* used = &comm;
#ifdef SHARDGATHER_BENCH_WITH_MPI
    if (m == "reshard_a2aw" && b.alltoallw != nullptr) {
      used = b.alltoallw;
      fn = [&] { plan.execute(data.src_views, *b.alltoallw, data.dst_views); };
    }
#endif
    if (cfg.full() && (m == "unshard" || m == "unshard_direct")) {
      un.emplace(cfg, plan, m == "unshard" ? Strategy::kAuto : Strategy::kDirect);
      un->settle(data, comm);
      fn = [&] { un->run(data, comm); };
    }
#ifdef SHARDGATHER_BENCH_WITH_MPI
    if (b.mpi == MPI_COMM_NULL || cfg.full()) {
      // the anchors' methods are the engine layout's, over MPI
    } else if (m == "gather_bcast") {
      gb.emplace(cfg, plan, data, b.mpi);
      fn = [&] { gb->run(plan, data, comm, cfg.dtype); };
    } else if (m == "owner_bcast") {
      ob.emplace(cfg, plan, b.mpi);
      fn = [&] { ob->run(cfg, plan, data); };
    } else if (m == "slice_p2p") {
      sp.emplace(flat);  // one message per slice: the flat plan's slices, no relay
      fn = [&] { sp->run(flat, data, cfg.dtype, b.mpi); };
    }
#endif
    if (!fn) {
      continue;  // not a method of this layout or backend
    }
    const std::uint64_t before = used->exchange_bytes_received();
    Result res = time_method(cfg, m, b, fn);
    const std::uint64_t got = used->exchange_bytes_received() - before;
    if (m.starts_with("reshard")) {
      // What reached this rank from others per call, with its local copies, against the plan.
      const RegionPlan& r = (m == "reshard" ? plan : flat).regions();
      const auto me = static_cast<std::size_t>(comm.rank());
      const std::uint64_t mine = r.rank_received[me];
      const std::uint64_t per_call = got / static_cast<std::uint64_t>(cfg.warmup + cfg.iters);
      const double ratio =
          mine == 0 ? 1.0
                    : static_cast<double>(per_call + r.recv_counts[me] + r.forwarded_counts[me]) /
                          static_cast<double>(mine);
      res.received_ratio = 1.0 + b.slowest(std::abs(ratio - 1.0));  // the worst rank's
    }
    res.wrong = b.sum(data.check_and_clear(plan, cfg.dtype));
    run.results.push_back(res);
    un.reset();
#ifdef SHARDGATHER_BENCH_WITH_MPI
    gb.reset();
    ob.reset();
    sp.reset();
#endif
  }
  return run;
}

// The busiest link's bytes over the measured rate: a host's link where the ranks span hosts (its
// ranks share it), else a rank's.
double link_floor_ms(const Run& run, int world) {
  if (run.link_rate <= 0) {
    return 0;
  }
  std::uint64_t worst = 0;
  for (std::size_t h = 0; h < run.host_sent.size(); ++h) {
    worst = std::max({worst, run.host_sent[h], run.host_received[h]});
  }
  for (std::size_t r = 0; run.host_sent.empty() && r < static_cast<std::size_t>(world); ++r) {
    worst = std::max(
        {worst, run.rank_sent[r] - run.rank_local[r], run.rank_received[r] - run.rank_local[r]});
  }
  return 1e3 * static_cast<double>(worst) / run.link_rate;
}

int report(const Config& cfg, const Run& run) {
  const double floor = link_floor_ms(run, cfg.world());
  const std::string dtype(dtype_name(cfg.dtype));
  if (cfg.full()) {
    std::printf("# reshard as %s: %s x %d layers, %zu tensors, %d ranks, %s\n",
                cfg.unshard() ? "unshard" : "gather to rank 0", cfg.model.c_str(), cfg.layers,
                run.tensors, cfg.sources, dtype.c_str());
  } else {
    std::printf(
        "# reshard: %s x %d layers, %zu tensors, %d FSDP sources -> TP %d x %d replicas, %s\n",
        cfg.model.c_str(), cfg.layers, run.tensors, cfg.sources, cfg.tp, cfg.replicas,
        dtype.c_str());
  }
  if (!run.host_sent.empty()) {
    std::uint64_t between = 0;
    for (const std::uint64_t b : run.host_received) {
      between += b;
    }
    std::uint64_t flat = 0;
    for (const std::uint64_t b : run.flat_host_received) {
      flat += b;
    }
    std::printf("# between hosts %.1f MB per call with the fan-out inside hosts, %.1f MB without\n",
                static_cast<double>(between) / 1e6, static_cast<double>(flat) / 1e6);
  }
  std::printf("# destination boxes %.1f MB; link rate %.1f MB/s; link floor %.1f ms\n",
              static_cast<double>(run.wanted_bytes) / 1e6, run.link_rate / 1e6, floor);
  std::printf("%-14s %12s %12s %12s %12s %10s %8s\n", "method", "median_ms", "min_ms", "x_reshard",
              "x_floor", "recv/want", "wrong");
  double reshard_ms = 0;
  for (const Result& r : run.results) {
    if (r.method == "reshard") {
      reshard_ms = r.median_ms;
    }
  }
  int rc = 0;
  nlohmann::json rows = nlohmann::json::array();
  for (const Result& r : run.results) {
    const double x = reshard_ms > 0 ? r.median_ms / reshard_ms : 0;
    const double xf = floor > 0 ? r.median_ms / floor : 0;
    std::printf("%-14s %12.1f %12.1f %12.2f %12.2f %10s %8llu\n", r.method.c_str(), r.median_ms,
                r.min_ms, x, xf,
                r.method.starts_with("reshard")
                    ? std::to_string(r.received_ratio).substr(0, 5).c_str()
                    : "-",
                static_cast<unsigned long long>(r.wrong));
    rc = r.wrong != 0 ? 1 : rc;
    rows.push_back({{"method", r.method},
                    {"median_ms", r.median_ms},
                    {"min_ms", r.min_ms},
                    {"times_ms", r.times_ms},
                    {"vs_reshard", x},
                    {"vs_link_floor", xf},
                    {"received_over_wanted", r.received_ratio},
                    {"wrong", r.wrong}});
  }
  if (!cfg.json.empty()) {
    nlohmann::json doc{{"schema_version", 1},
                       {"op", "reshard"},
                       {"model", cfg.model},
                       {"layout", cfg.layout},
                       {"layers", cfg.layers},
                       {"tensors", run.tensors},
                       {"sources", cfg.sources},
                       {"tp", cfg.tp},
                       {"replicas", cfg.replicas},
                       {"waves", cfg.waves},
                       {"backend", cfg.backend},
                       {"link_rate_bytes_per_s", run.link_rate},
                       {"link_floor_ms", floor},
                       {"rank_sent", run.rank_sent},
                       {"rank_received", run.rank_received},
                       {"rank_local", run.rank_local},
                       {"host_sent", run.host_sent},
                       {"host_received", run.host_received},
                       {"host_received_flat", run.flat_host_received},
                       {"results", rows}};
    std::ofstream(cfg.json) << doc.dump(2) << "\n";
  }
  return rc;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::size_t begin = 0;
  while (begin <= s.size()) {
    const std::size_t end = std::min(s.find(',', begin), s.size());
    out.push_back(s.substr(begin, end - begin));
    begin = end + 1;
  }
  return out;
}

std::optional<Config> parse(int argc, char** argv) {
  Config cfg;
  CLI::App app("the reshard bench (docs/benchmarking.md, \"Reshard\")",
               "shardgather-bench reshard");
  app.add_option("-b,--backend", cfg.backend,
                 "threads (default, in-process) or mpi (under mpirun)");
  app.add_option("--sources", cfg.sources, "FSDP source ranks, 0..M-1 (default 4)");
  app.add_option("--tp", cfg.tp, "the engine's tensor-parallel degree (default 2)");
  app.add_option("--replicas", cfg.replicas, "engine replicas (default 2)");
  app.add_option("--model", cfg.model, "qwen3-8b (default) or qwen3-moe");
  app.add_option("--layout", cfg.layout,
                 "engine (default: sources into a TP engine on other ranks), unshard\n"
                 "(every source wants every full tensor) or gather (rank 0 wants them);\n"
                 "these two: methods reshard, unshard, unshard_direct (UnshardPlan with dst 0\n"
                 "for the gather)");
  app.add_option("--layers", cfg.layers, "decoder layers (default 1)");
  app.add_option("--waves", cfg.waves,
                 "the reshard's fan-out waves (RegionOptions::fan_out_waves, default 4)");
  app.add_option("-n,--iters", cfg.iters, "timed iterations (default 5)");
  app.add_option("-w,--warmup", cfg.warmup, "untimed iterations first (default 1)");
  app.add_option_function<std::string>(
      "--methods", [&cfg](const std::string& list) { cfg.methods = split_list(list); },
      "reshard,reshard_flat,reshard_a2aw,gather_bcast,owner_bcast,slice_p2p (default: all;\n"
      "reshard_a2aw and the anchors need mpi; reshard_flat: the reshard without its fan-out\n"
      "inside hosts; reshard_a2aw: the reshard with MPI_Ialltoallw exchanges)");
  app.add_flag_callback(
      "--mpi-yield", [&cfg] { cfg.mpi_yield = true; },
      "MPI waits yield the core (many simulated hosts on few cores)");
  app.add_option("-J,--json", cfg.json, "also write the results as JSON");
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    app.exit(e);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    throw InvalidArgument(e.what());
  }
  for (const std::string& m : cfg.methods) {
    if (m != "reshard" && m != "reshard_flat" && m != "reshard_a2aw" && m != "gather_bcast" &&
        m != "owner_bcast" && m != "slice_p2p" && m != "unshard" && m != "unshard_direct") {
      throw InvalidArgument("unknown method " + m);
    }
  }
  if (cfg.layout != "engine" && cfg.layout != "unshard" && cfg.layout != "gather") {
    throw InvalidArgument("unknown layout " + cfg.layout + " (engine, unshard, gather)");
  }
  if (cfg.model != "qwen3-8b" && cfg.model != "qwen3-moe") {
    throw InvalidArgument("unknown model " + cfg.model + " (qwen3-8b, qwen3-moe)");
  }
  if (cfg.sources < 1 || cfg.tp < 1 || cfg.replicas < 1 || cfg.layers < 1 || cfg.iters < 1 ||
      cfg.warmup < 0 || cfg.waves < 1) {
    throw InvalidArgument(
        "sources, tp, replicas, layers, iters and waves >= 1, warmup >= 0 please");
  }
  return cfg;
}

int run_threads(const Config& cfg) {
  auto comms = make_thread_group(cfg.world());
  std::vector<std::optional<Run>> runs(static_cast<std::size_t>(cfg.world()));
  std::vector<double> slots(static_cast<std::size_t>(cfg.world()));
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(cfg.world()));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<std::size_t>(cfg.world()));
  for (int r = 0; r < cfg.world(); ++r) {
    threads.emplace_back([&, r] {
      Communicator& comm = *comms[static_cast<std::size_t>(r)];
      const auto me = static_cast<std::size_t>(r);
      const auto meet = [&comm] { comm.barrier(comm.deadline_after(std::chrono::minutes(5))); };
      Backend b;
      b.comm = &comm;
      b.slowest = [&, me](double mine) {
        slots[me] = mine;
        meet();
        const double worst = *std::max_element(slots.begin(), slots.end());
        meet();
        return worst;
      };
      b.sum = [&, me](std::uint64_t mine) {
        counts[me] = mine;
        meet();
        std::uint64_t total = 0;
        for (const std::uint64_t c : counts) {
          total += c;
        }
        meet();
        return total;
      };
      try {
        runs[me] = run_rank(cfg, b);
      } catch (const std::exception& e) {
        errors[me] = e.what();
        comm.abort();
      }
    });
  }
  for (std::thread& t : threads) {
    t.join();
  }
  for (const std::string& e : errors) {
    if (!e.empty()) {
      throw std::runtime_error(e);
    }
  }
  return report(cfg, *runs[0]);
}

#ifdef SHARDGATHER_BENCH_WITH_MPI
int run_mpi(const Config& cfg, int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0;
  int world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int rc = 0;
  if (world != cfg.world()) {
    if (rank == 0) {
      std::fprintf(stderr,
                   "shardgather-bench reshard: %d sources + %d x %d engine ranks need %d "
                   "ranks, mpirun gave %d\n",
                   cfg.sources, cfg.tp, cfg.replicas, cfg.world(), world);
    }
    MPI_Finalize();
    return 2;
  }
  {
    MpiOptions options{.max_chunk_bytes = MpiOptions{}.max_chunk_bytes,
                       .wait = cfg.mpi_yield ? MpiOptions::Wait::kYield : MpiOptions::Wait::kAuto};
    auto comm = make_mpi_communicator(MPI_COMM_WORLD, options);
    options.exchange = MpiOptions::Exchange::kAlltoallw;
    auto alltoallw = make_mpi_communicator(MPI_COMM_WORLD, options);
    Backend b;
    b.comm = comm.get();
    b.mpi = MPI_COMM_WORLD;
    b.alltoallw = alltoallw.get();
    b.slowest = [](double mine) {
      double worst = 0;
      MPI_Allreduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      return worst;
    };
    b.sum = [](std::uint64_t mine) {
      unsigned long long total = 0;
      unsigned long long m = mine;
      MPI_Allreduce(&m, &total, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
      return static_cast<std::uint64_t>(total);
    };
    try {
      const Run run = run_rank(cfg, b);
      if (rank == 0) {
        rc = report(cfg, run);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shardgather-bench reshard: rank %d: %s\n", rank, e.what());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return rc;
}
#endif

}  // namespace

int reshard_main(int argc, char** argv) {
  const std::optional<Config> parsed = parse(argc, argv);
  if (!parsed) {
    return 0;
  }
  if (parsed->backend == "threads") {
    return run_threads(*parsed);
  }
#ifdef SHARDGATHER_BENCH_WITH_MPI
  if (parsed->backend == "mpi") {
    return run_mpi(*parsed, argc, argv);
  }
#endif
  throw InvalidArgument("unknown backend " + parsed->backend + " (threads, mpi)");
}

}  // namespace shardgather::bench
