// Unshards one Llama-2-7B decoder layer (bf16) across 4 in-process ranks: every rank holds
// a dim-0 shard of each of the 9 parameters, gathers all of them in one coalesced call, and
// checks every byte it received. Run: build/<preset>/examples/llama_layer_gather
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "shardgather/shardgather.h"

namespace sg = shardgather;

namespace {

constexpr int kWorld = 4;
constexpr int kIterations = 5;

struct Param {
  const char* name;
  sg::Shape full;
};

// q, k, v, o, gate, up, down, input_layernorm, post_attention_layernorm
const std::vector<Param> kLayer = {
    {"self_attn.q_proj", {4096, 4096}},  {"self_attn.k_proj", {4096, 4096}},
    {"self_attn.v_proj", {4096, 4096}},  {"self_attn.o_proj", {4096, 4096}},
    {"mlp.gate_proj", {11008, 4096}},    {"mlp.up_proj", {11008, 4096}},
    {"mlp.down_proj", {4096, 11008}},    {"input_layernorm", {4096}},
    {"post_attention_layernorm", {4096}}};

// The value of element j of parameter i's full tensor: a bf16 bit pattern.
std::uint16_t value(std::size_t param, std::uint64_t j) {
  std::uint64_t x = (param + 1) * 0x9e3779b97f4a7c15ULL + j * 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 29U;
  return static_cast<std::uint16_t>(x);
}

std::int64_t row_elems(const sg::Shape& full) {
  std::int64_t n = 1;
  for (std::size_t d = 1; d < full.size(); ++d) {
    n *= full[d];
  }
  return n;
}

}  // namespace

int main() {
  auto comms = sg::make_thread_group(kWorld);
  std::vector<double> seconds(kIterations);
  std::vector<std::uint64_t> wrong(kWorld, 0);
  std::uint64_t bytes_per_rank = 0;
  std::vector<std::thread> threads;
  std::vector<std::vector<double>> rank_seconds(kWorld, std::vector<double>(kIterations));
  for (int rank = 0; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      // This rank's dim-0 shards, torch.chunk-style.
      std::vector<std::vector<std::uint16_t>> shards;
      std::vector<sg::TensorView> views;
      for (std::size_t i = 0; i < kLayer.size(); ++i) {
        const sg::Shape& full = kLayer[i].full;
        const std::int64_t chunk = (full[0] + kWorld - 1) / kWorld;
        const std::int64_t begin = std::min<std::int64_t>(chunk * rank, full[0]);
        const std::int64_t rows = std::min<std::int64_t>(chunk, full[0] - begin);
        sg::Shape shape = full;
        shape[0] = rows;
        const std::int64_t per_row = row_elems(full);
        std::vector<std::uint16_t> data(static_cast<std::size_t>(rows * per_row));
        for (std::size_t k = 0; k < data.size(); ++k) {
          data[k] = value(i, static_cast<std::uint64_t>(begin * per_row) + k);
        }
        shards.push_back(std::move(data));
        views.push_back({shards.back().data(), sg::DType::kBFloat16, shape, {}});
      }
      for (int it = 0; it < kIterations; ++it) {
        comms[static_cast<std::size_t>(rank)]->barrier(sg::Clock::now() + std::chrono::minutes(1));
        const auto t0 = std::chrono::steady_clock::now();
        const sg::GatherResult out =
            sg::foreach_all_gather(views, *comms[static_cast<std::size_t>(rank)]);
        rank_seconds[static_cast<std::size_t>(rank)][static_cast<std::size_t>(it)] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (it != kIterations - 1) {
          continue;
        }
        // Check every gathered element against the full parameter's values.
        std::uint64_t bad = 0;
        for (std::size_t i = 0; i < kLayer.size(); ++i) {
          std::uint64_t j = 0;
          for (int r = 0; r < kWorld; ++r) {
            const sg::TensorView& v = out[i][static_cast<std::size_t>(r)];
            const auto* p = static_cast<const std::uint16_t*>(v.data);
            const std::uint64_t n = sg::checked_nbytes(v.dtype, v.shape) / 2;
            for (std::uint64_t k = 0; k < n; ++k, ++j) {
              bad += p[k] != value(i, j) ? 1U : 0U;
            }
          }
        }
        wrong[static_cast<std::size_t>(rank)] = bad;
        if (rank == 0) {
          bytes_per_rank = out.plan().total_bytes;
        }
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (int it = 0; it < kIterations; ++it) {
    double slowest = 0;
    for (int r = 0; r < kWorld; ++r) {
      slowest = std::max(slowest,
                         rank_seconds[static_cast<std::size_t>(r)][static_cast<std::size_t>(it)]);
    }
    seconds[static_cast<std::size_t>(it)] = slowest;
  }
  std::vector<double> sorted = seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  std::uint64_t total_wrong = 0;
  for (const std::uint64_t w : wrong) {
    total_wrong += w;
  }
  std::printf("shardgather %s: Llama-2-7B decoder layer, 9 bf16 parameters, dim-0 shards\n",
              SHARDGATHER_VERSION_STRING);
  std::printf("  %d in-process ranks (threads backend), one foreach_all_gather per step\n", kWorld);
  std::printf("  gathered %.1f MB per rank; step times (slowest rank):",
              static_cast<double>(bytes_per_rank) / 1e6);
  for (const double s : seconds) {
    std::printf(" %.1f", s * 1e3);
  }
  std::printf(
      " ms\n  median %.1f ms, %.2f GB/s received per rank (first step includes first "
      "touch of fresh output memory)\n",
      median * 1e3, static_cast<double>(bytes_per_rank) / median / 1e9);
  std::printf("  verification: %llu wrong elements across %d ranks -> %s\n",
              static_cast<unsigned long long>(total_wrong), kWorld,
              total_wrong == 0 ? "bit-exact" : "WRONG");
  return total_wrong == 0 ? 0 : 1;
}
