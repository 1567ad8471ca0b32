// shardgather-gpu-copy-bench: the fused copy kernel against the CUDA copies it replaces, on the
// device (docs/gpu.md, docs/benchmarking.md). For a preset gathered from `--ranks` ranks and
// sharded along `--dim`, it times the copy-out of an unshard (every rank's shard of every
// parameter from the rank-major gathered buffer into its full tensor):
//   fused:   one launch over the whole descriptor table (what the device path runs);
//   memcpy:  one cudaMemcpyAsync device to device of the same number of bytes (the bandwidth
//            bar: fused must reach 0.85x of it on llama-layer);
//   loop:    one cudaMemcpyAsync (or cudaMemcpy2DAsync, for strided blocks) per piece, as a
//            per-tensor copy loop would (tiny-1000: fused must be 20x faster).
// Medians of --iters timed runs after --warmup, with CUDA events; the result is checked
// bit-exact against the loop's. Prints one JSON object. Needs only the CUDA runtime (it runs on
// a bare GPU machine, tools/device-check).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "copies/copy_table.h"
#include "copies/device_runtime.h"
#include "presets.h"
#include <cuda_runtime.h>

namespace sg = shardgather;

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

struct Piece {
  std::byte* src;
  std::byte* dst;
  std::uint64_t block;
  std::uint64_t count;
  std::uint64_t dst_stride;
};

template <typename Fn>
double median_ms(int warmup, int iters, cudaStream_t stream, Fn&& run) {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < warmup; ++i) {
    run();
  }
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    run();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float t = 0;
    check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "llama-layer";
  std::string dtype_name = "bf16";
  int ranks = 8;
  int dim = 0;
  int warmup = 5;
  int iters = 50;
  try {
    // --preset NAME --dtype NAME --ranks N --dim D --warmup N --iters N (no CLI11 on the GPU
    // machine).
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string flag = argv[i];
      const std::string value = argv[i + 1];
      if (flag == "--preset") {
        preset = value;
      } else if (flag == "--dtype") {
        dtype_name = value;
      } else if (flag == "--ranks") {
        ranks = std::stoi(value);
      } else if (flag == "--dim") {
        dim = std::stoi(value);
      } else if (flag == "--warmup") {
        warmup = std::stoi(value);
      } else if (flag == "--iters") {
        iters = std::stoi(value);
      } else {
        throw std::invalid_argument("unknown option " + flag);
      }
    }
    const sg::DType dtype = sg::bench::parse_dtype(dtype_name);
    const auto elem = sg::dtype_size(dtype);
    const std::vector<sg::bench::Param> params = sg::bench::make_preset(preset, dtype, ranks);
    // Sizes: every parameter's full bytes, one after the other, in both buffers.
    std::uint64_t total = 0;
    for (const auto& p : params) {
      std::uint64_t n = elem;
      for (const auto e : p.full) {
        n *= static_cast<std::uint64_t>(e);
      }
      total += (n + 255) / 256 * 256;
    }
    std::byte* gathered = nullptr;
    std::byte* full = nullptr;
    std::byte* check_full = nullptr;
    check(cudaMalloc(&gathered, total), "cudaMalloc");
    check(cudaMalloc(&full, total), "cudaMalloc");
    check(cudaMalloc(&check_full, total), "cudaMalloc");
    std::vector<std::byte> pattern(total);
    for (std::uint64_t i = 0; i < total; ++i) {
      pattern[i] = static_cast<std::byte>((i * 2654435761U) >> 13);
    }
    check(cudaMemcpy(gathered, pattern.data(), total, cudaMemcpyHostToDevice), "cudaMemcpy");
    // Pageable copies and memsets may still be in flight on the legacy stream, which does not
    // order with the non-blocking stream the runs use: wait for them.
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

    // The pieces: rank r's shard of parameter p, torch.chunk sizes along `dim`.
    std::vector<Piece> pieces;
    std::uint64_t at = 0;
    for (const auto& p : params) {
      const auto d =
          static_cast<std::size_t>(std::min<int>(dim, static_cast<int>(p.full.size()) - 1));
      std::uint64_t outer = 1;
      std::uint64_t inner = elem;
      for (std::size_t k = 0; k < d; ++k) {
        outer *= static_cast<std::uint64_t>(p.full[k]);
      }
      for (std::size_t k = d + 1; k < p.full.size(); ++k) {
        inner *= static_cast<std::uint64_t>(p.full[k]);
      }
      const std::vector<std::int64_t> sizes = sg::chunk_sizes(p.full[d], ranks);
      const std::uint64_t row = static_cast<std::uint64_t>(p.full[d]) * inner;
      std::uint64_t src = at;
      std::uint64_t offset = 0;
      for (const auto s : sizes) {
        const std::uint64_t block = static_cast<std::uint64_t>(s) * inner;
        if (block != 0) {
          pieces.push_back({gathered + src, full + at + offset, block, outer, row});
        }
        src += block * outer;
        offset += block;
      }
      at += (outer * row + 255) / 256 * 256;
    }
    sg::detail::CopyTable table;
    for (const Piece& p : pieces) {
      const sg::ConstSegment from{p.src, p.block * p.count};
      const sg::RecvPiece to{p.dst, p.block, p.count, p.dst_stride};
      table.add_stream(std::span(&from, 1), std::span(&to, 1));
    }
    table.finish();
    cudaStream_t stream = nullptr;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    // For the legacy default stream, which the synchronous cudaMemcpy below is ordered on.
    sg::detail::DeviceMemory on_device(table.descs().size() * sizeof(sg::detail::CopyDesc), 0,
                                       nullptr);
    check(cudaMemcpy(on_device.data(), table.descs().data(), on_device.size(),
                     cudaMemcpyHostToDevice),
          "cudaMemcpy");
    const auto* descs = reinterpret_cast<const sg::detail::CopyDesc*>(on_device.data());
    const std::uint64_t bytes = table.bytes();

    const auto fused = [&] {
      sg::detail::launch_copies(descs, table.descs().size(), table.blocks(), stream);
    };
    const auto memcpy_same_bytes = [&] {
      check(cudaMemcpyAsync(full, gathered, bytes, cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync");
    };
    const auto loop_into = [&](std::byte* base) {
      for (const Piece& p : pieces) {
        std::byte* dst = base + (p.dst - full);
        if (p.count == 1) {
          check(cudaMemcpyAsync(dst, p.src, p.block, cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpyAsync");
        } else {
          check(cudaMemcpy2DAsync(dst, p.dst_stride, p.src, p.block, p.block, p.count,
                                  cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpy2DAsync");
        }
      }
    };
    // Bit-exact against the loop.
    check(cudaMemset(full, 0, total), "cudaMemset");
    check(cudaMemset(check_full, 0, total), "cudaMemset");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    fused();
    loop_into(check_full);
    check(cudaStreamSynchronize(stream), "sync");
    std::vector<std::byte> a(total);
    std::vector<std::byte> b(total);
    check(cudaMemcpy(a.data(), full, total, cudaMemcpyDeviceToHost), "cudaMemcpy");
    check(cudaMemcpy(b.data(), check_full, total, cudaMemcpyDeviceToHost), "cudaMemcpy");
    const bool exact = a == b;

    const double fused_ms = median_ms(warmup, iters, stream, fused);
    const double memcpy_ms = median_ms(warmup, iters, stream, memcpy_same_bytes);
    const double loop_ms = median_ms(warmup, iters, stream, [&] { loop_into(full); });
    std::printf(
        "{\"preset\": \"%s\", \"dtype\": \"%s\", \"ranks\": %d, \"dim\": %d, \"bytes\": %llu, "
        "\"pieces\": %zu, \"descriptors\": %zu, \"blocks\": %llu, \"bit_exact\": %s, "
        "\"fused_ms\": %.5f, \"memcpy_ms\": %.5f, \"loop_ms\": %.5f, \"fused_gbps\": %.1f, "
        "\"memcpy_gbps\": %.1f, \"fused_over_memcpy_bandwidth\": %.3f, "
        "\"loop_over_fused_time\": %.2f}\n",
        preset.c_str(), dtype_name.c_str(), ranks, dim, static_cast<unsigned long long>(bytes),
        pieces.size(), table.descs().size(), static_cast<unsigned long long>(table.blocks()),
        exact ? "true" : "false", fused_ms, memcpy_ms, loop_ms,
        static_cast<double>(bytes) / fused_ms / 1e6, static_cast<double>(bytes) / memcpy_ms / 1e6,
        memcpy_ms / fused_ms, loop_ms / fused_ms);
    cudaFree(gathered);
    cudaFree(full);
    cudaFree(check_full);
    return exact ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardgather-gpu-copy-bench: %s\n", e.what());
    return 2;
  }
}
