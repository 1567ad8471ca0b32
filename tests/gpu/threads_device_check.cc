// GPU check of the core's device path on one GPU, with no test framework (the GPU machine has
// none): the threads backend at 2, 3 and 4 ranks, every rank on device 0 with a stream of its
// own. Each call on device memory is compared byte for byte with the same call on host memory
// (the path the CPU suites cover): foreach_all_gather with a hint (mixed dtypes, uneven shapes,
// a transposed input, empty tensors), a plan executed three times, unshard along dim 0, 1 and
// the last (uneven and padded specs), 1000 small tensors, and a reshard into strided destinations
// in one part and in many. Prints "N passed, M failed".
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "shardgather/shardgather.h"

namespace sg = shardgather;

namespace {

std::atomic<int> passed{0};
std::atomic<int> failed{0};

void expect(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

void cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// A host tensor and its copy on device 0 (same bytes, same strides).
struct Pair {
  std::vector<std::byte> host;
  std::byte* device = nullptr;
  sg::TensorView host_view;
  sg::TensorView device_view;
  Pair() = default;
  Pair(const Pair&) = delete;
  Pair& operator=(const Pair&) = delete;
  ~Pair() { cudaFree(device); }
};

void fill(std::vector<std::byte>& bytes, std::uint64_t seed) {
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    bytes[i] = static_cast<std::byte>(seed >> 56U);
  }
}

// storage_elems elements of storage, viewed with `shape` and `strides` (empty: contiguous).
void make(Pair& p, sg::DType dtype, const sg::Shape& shape, const sg::Shape& strides,
          std::size_t storage_elems, std::uint64_t seed) {
  p.host.resize(storage_elems * sg::dtype_size(dtype));
  fill(p.host, seed);
  cuda(cudaMalloc(&p.device, p.host.size() + 1), "cudaMalloc");
  cuda(cudaMemcpy(p.device, p.host.data(), p.host.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  // A pageable copy may still be landing on the legacy stream, which does not order with the
  // ranks' non-blocking streams.
  cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  p.host_view = sg::TensorView{p.host.data(), dtype, shape, strides};
  p.device_view = sg::TensorView{p.device, dtype, shape, strides, sg::cuda_device(0)};
}

std::vector<std::byte> to_host(const void* device, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  if (bytes != 0) {
    cuda(cudaMemcpy(out.data(), device, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
  return out;
}

bool same(const std::vector<std::byte>& device_bytes, const std::byte* host, std::size_t bytes) {
  return device_bytes.size() == bytes &&
         (bytes == 0 || std::memcmp(device_bytes.data(), host, bytes) == 0);
}

void run_world(int world, const std::function<void(int, sg::Communicator&)>& fn) {
  auto comms = sg::make_thread_group(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        cuda(cudaSetDevice(0), "cudaSetDevice");
        cudaStream_t stream = nullptr;
        cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        {
          const sg::CudaStreamGuard on(stream);
          fn(r, *comms[static_cast<std::size_t>(r)]);
        }
        cudaStreamDestroy(stream);
      } catch (const std::exception& e) {
        expect(false,
               "world " + std::to_string(world) + " rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
}

// Rank r's shapes: [r + 2, 3] f32 (transposed storage on odd ranks), [5 * r] bf16, [7] i8.
std::vector<std::vector<sg::Shape>> hint(int world) {
  std::vector<std::vector<sg::Shape>> h;
  for (int r = 0; r < world; ++r) {
    h.push_back({{r + 2, 3}, {5 * r}, {7}});
  }
  return h;
}

void foreach_case(int rank, sg::Communicator& comm, int world) {
  Pair t[3];
  const std::int64_t rows = rank + 2;
  if (rank % 2 == 1) {
    make(t[0], sg::DType::kFloat32, {rows, 3}, {1, rows}, static_cast<std::size_t>(rows * 3),
         11U + static_cast<unsigned>(rank));
  } else {
    make(t[0], sg::DType::kFloat32, {rows, 3}, {}, static_cast<std::size_t>(rows * 3),
         11U + static_cast<unsigned>(rank));
  }
  make(t[1], sg::DType::kBFloat16, {5 * rank}, {}, static_cast<std::size_t>(5 * rank),
       21U + static_cast<unsigned>(rank));
  make(t[2], sg::DType::kInt8, {7}, {}, 7, 31U + static_cast<unsigned>(rank));
  const std::vector<sg::TensorView> dv{t[0].device_view, t[1].device_view, t[2].device_view};
  const std::vector<sg::TensorView> hv{t[0].host_view, t[1].host_view, t[2].host_view};
  const auto h = hint(world);
  const sg::GatherResult d = sg::foreach_all_gather(dv, comm, h);
  const sg::GatherResult c = sg::foreach_all_gather(hv, comm, h);
  const std::string where =
      "foreach world " + std::to_string(world) + " rank " + std::to_string(rank);
  expect(d.buffer().device() == sg::cuda_device(0), where + ": result on the device");
  expect(same(to_host(d.buffer().data(), d.buffer().size()), c.buffer().data(), c.buffer().size()),
         where + ": bytes equal the host call's");

  // A plan, three executions into one device buffer.
  const std::vector<sg::DType> dtypes{sg::DType::kFloat32, sg::DType::kBFloat16, sg::DType::kInt8};
  sg::AllGatherPlan plan(dtypes, h, rank);
  std::byte* out = nullptr;
  cuda(cudaMalloc(&out, plan.output_bytes() + 1), "cudaMalloc");
  for (int i = 0; i < 3; ++i) {
    cuda(cudaMemset(out, 0xff, plan.output_bytes()), "cudaMemset");
    cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const sg::ExecStats stats = plan.execute(dv, comm, std::span(out, plan.output_bytes()));
    expect(same(to_host(out, plan.output_bytes()), c.buffer().data(), plan.output_bytes()),
           where + ": plan execution " + std::to_string(i));
    expect(stats.strategy == sg::Strategy::kPacked, where + ": a device job moves packed");
  }
  cudaFree(out);
}

void unshard_case(int rank, sg::Communicator& comm, int world, int dim, bool padded) {
  const sg::Shape full{6, 10, 4 * world - 1};
  sg::ShardSpec spec{
      .dtype = sg::DType::kFloat32, .full_shape = full, .shard_dim = dim, .sizes = {}};
  if (padded) {
    spec.padded_size = (full[static_cast<std::size_t>(dim)] + world - 1) / world;
  }
  const std::vector<sg::ShardSpec> specs{
      spec, {.dtype = sg::DType::kInt16, .full_shape = {9}, .shard_dim = 0, .sizes = {}}};
  sg::UnshardPlan plan(specs, world, rank);
  Pair shards[2];
  for (std::size_t i = 0; i < 2; ++i) {
    const sg::Shape s = plan.shard_shape(rank, i);
    std::size_t n = 1;
    for (const auto e : s) {
      n *= static_cast<std::size_t>(e);
    }
    make(shards[i], specs[i].dtype, s, {}, n,
         41U + 7U * static_cast<unsigned>(rank) + static_cast<unsigned>(i));
  }
  const std::vector<sg::TensorView> dv{shards[0].device_view, shards[1].device_view};
  const std::vector<sg::TensorView> hv{shards[0].host_view, shards[1].host_view};
  const sg::UnshardResult d = sg::unshard(dv, comm, specs);
  const sg::UnshardResult c = sg::unshard(hv, comm, specs);
  const std::string where = "unshard dim " + std::to_string(dim) + (padded ? " padded" : "") +
                            " world " + std::to_string(world) + " rank " + std::to_string(rank);
  for (std::size_t i = 0; i < 2; ++i) {
    std::size_t bytes = sg::dtype_size(specs[i].dtype);
    for (const auto e : specs[i].full_shape) {
      bytes *= static_cast<std::size_t>(e);
    }
    expect(d[i].device == sg::cuda_device(0), where + ": full tensor on the device");
    expect(same(to_host(d[i].data, bytes), static_cast<const std::byte*>(c[i].data), bytes),
           where + ": parameter " + std::to_string(i) + " equals the host unshard");
  }
}

void tiny_case(int rank, sg::Communicator& comm, int world) {
  constexpr int kTensors = 1000;
  std::vector<Pair> t(kTensors);
  std::vector<sg::TensorView> dv;
  std::vector<sg::TensorView> hv;
  std::vector<std::vector<sg::Shape>> h(static_cast<std::size_t>(world));
  for (int i = 0; i < kTensors; ++i) {
    for (int r = 0; r < world; ++r) {
      h[static_cast<std::size_t>(r)].push_back({1 + (i * 7 + r) % 61});
    }
    const std::int64_t n = 1 + (i * 7 + rank) % 61;
    make(t[static_cast<std::size_t>(i)], sg::DType::kFloat32, {n}, {}, static_cast<std::size_t>(n),
         static_cast<std::uint64_t>(i * 131 + rank));
    dv.push_back(t[static_cast<std::size_t>(i)].device_view);
    hv.push_back(t[static_cast<std::size_t>(i)].host_view);
  }
  const sg::GatherResult d = sg::foreach_all_gather(dv, comm, h);
  const sg::GatherResult c = sg::foreach_all_gather(hv, comm, h);
  expect(same(to_host(d.buffer().data(), d.buffer().size()), c.buffer().data(), c.buffer().size()),
         "tiny-1000 world " + std::to_string(world) + " rank " + std::to_string(rank));
}

// A reshard: row shards of a [24, 20] f32 into column blocks landing in a wider buffer's
// columns (strided destinations), and an i16 [9, 7] held transposed by rank 0 wanted whole by
// every rank; in one part and in many (a 256-byte device bucket). The destination buffers,
// untouched bytes included, must equal the same reshard's on host memory.
void reshard_case(int rank, sg::Communicator& comm, int world, std::uint64_t bucket) {
  const auto w = static_cast<std::int64_t>(world);
  sg::TensorRegions a{
      .dtype = sg::DType::kFloat32, .shape = {24, 20}, .sources = {}, .destinations = {}};
  sg::TensorRegions b{.dtype = sg::DType::kInt16,
                      .shape = {9, 7},
                      .sources = {{0, {{0, 0}, {9, 7}}}},
                      .destinations = {}};
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t lo = 20 * r / w;
    a.sources.push_back(
        {static_cast<int>(r), {{24 * r / w, 0}, {24 * (r + 1) / w - 24 * r / w, 20}}});
    a.destinations.push_back(
        {static_cast<int>((r + 1) % w), {{0, lo}, {24, 20 * (r + 1) / w - lo}}});
    b.destinations.push_back({static_cast<int>(r), {{0, 0}, {9, 7}}});
  }
  const std::vector<sg::TensorRegions> layout{a, b};
  sg::RegionOptions regions;
  regions.device_bucket_bytes = bucket;
  sg::ReshardPlan plan(layout, world, rank, {}, regions);
  std::vector<Pair> src(plan.source_count());
  std::vector<Pair> dst(plan.destination_count());
  std::vector<sg::TensorView> ds;
  std::vector<sg::TensorView> hs;
  std::vector<sg::TensorView> dd;
  std::vector<sg::TensorView> hd;
  for (std::size_t v = 0; v < src.size(); ++v) {
    const sg::Shape& size = plan.source(v).box.size;
    const std::size_t n = static_cast<std::size_t>(size[0] * size[1]);
    const bool transposed = plan.regions().source_views[v].tensor == 1;
    make(src[v], layout[plan.regions().source_views[v].tensor].dtype, size,
         transposed ? sg::Shape{1, size[0]} : sg::Shape{}, n,
         900U + 17U * v + 5U * static_cast<std::uint64_t>(rank));
    ds.push_back(src[v].device_view);
    hs.push_back(src[v].host_view);
  }
  for (std::size_t v = 0; v < dst.size(); ++v) {
    const sg::Shape& size = plan.destination(v).box.size;
    // Inside a [rows, cols + 12] buffer at column 5: a fused parameter's columns.
    const std::int64_t width = size[1] + 12;
    make(dst[v], layout[plan.regions().destination_views[v].tensor].dtype, size, {width, 1},
         static_cast<std::size_t>(size[0] * width), 700U + v);
    const std::int64_t elem = static_cast<std::int64_t>(sg::dtype_size(dst[v].host_view.dtype));
    dst[v].host_view.data = dst[v].host.data() + 5 * elem;
    dst[v].device_view.data = dst[v].device + 5 * elem;
    dd.push_back(dst[v].device_view);
    hd.push_back(dst[v].host_view);
  }
  plan.execute(ds, comm, dd, sg::cuda_device(0));
  plan.execute(hs, comm, hd);
  cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(sg::current_cuda_stream())),
       "cudaStreamSynchronize");
  const std::string where = "reshard bucket " + std::to_string(bucket) + " world " +
                            std::to_string(world) + " rank " + std::to_string(rank);
  expect(bucket > 4096 || world == 1 || plan.regions().device_parts > 1, where + ": parts");
  for (std::size_t v = 0; v < dst.size(); ++v) {
    expect(same(to_host(dst[v].device, dst[v].host.size()), dst[v].host.data(), dst[v].host.size()),
           where + ": destination " + std::to_string(v) + " equals the host reshard");
  }
}

// A quantized reshard on the device against the same plan on the host: random bytes as the
// values (NaNs, infinities and subnormals among them), rows cut inside blocks; every rank wants
// the whole tensor dequantized (float32 on even ranks, bfloat16 on odd ones), rank 0 also its
// first 100 rows as FP8 data and scales. The quantizer kernel's bytes must be the host's.
void quantized_case(int rank, sg::Communicator& comm, int world, sg::QuantFormat format,
                    sg::DType dtype) {
  const auto w = static_cast<std::int64_t>(world);
  const sg::Shape shape{256, 160};
  sg::TensorRegions t{.dtype = dtype, .shape = shape, .sources = {}, .destinations = {}};
  std::int64_t at = 0;
  for (std::int64_t r = 0; r < w; ++r) {  // uneven rows: cuts inside 32- and 128-row blocks
    const std::int64_t end = r + 1 == w ? 256 : 256 * (r + 1) / w + 3;
    t.sources.push_back({static_cast<int>(r), {{at, 0}, {end - at, 160}}});
    t.destinations.push_back({static_cast<int>(r), {{0, 0}, shape}});
    at = end;
  }
  const sg::Box rows{{0, 0}, {100, 160}};
  t.destinations.push_back({0, rows});
  const std::vector<sg::TensorRegions> layout{t};
  const std::vector<sg::QuantFormat> formats{format};
  sg::ReshardPlan plan(layout, world, rank, {}, {}, formats);
  Pair src;
  const sg::Shape& size = plan.source(0).box.size;
  make(src, dtype, size, {}, static_cast<std::size_t>(size[0] * size[1]),
       4000U + 31U * static_cast<std::uint64_t>(rank) + static_cast<std::uint64_t>(format));
  std::vector<Pair> dst(plan.destination_count());
  std::vector<Pair> scales(dst.size());
  std::vector<sg::TensorView> dd, hd, ds, hs;
  const bool mx = format == sg::QuantFormat::kMxfp8;
  for (std::size_t v = 0; v < dst.size(); ++v) {
    const sg::Box& box = plan.destination(v).box;
    const bool raw = box.size[0] == 100;
    const sg::DType out = raw             ? sg::DType::kUInt8
                          : rank % 2 == 0 ? sg::DType::kFloat32
                                          : sg::DType::kBFloat16;
    make(dst[v], out, box.size, {}, static_cast<std::size_t>(box.size[0] * box.size[1]), 5U + v);
    dd.push_back(dst[v].device_view);
    hd.push_back(dst[v].host_view);
    if (raw) {
      const std::int64_t block_rows = format == sg::QuantFormat::kFp8Block128 ? 128 : 1;
      const sg::Shape s{(100 + block_rows - 1) / block_rows, mx ? 160 / 32 : 2};
      make(scales[v], mx ? sg::DType::kUInt8 : sg::DType::kFloat32, s, {},
           static_cast<std::size_t>(s[0] * s[1]), 9U + v);
      ds.push_back(scales[v].device_view);
      hs.push_back(scales[v].host_view);
    } else {
      ds.emplace_back();
      hs.emplace_back();
    }
  }
  plan.execute(std::span(&src.device_view, 1), comm, dd, ds, sg::cuda_device(0));
  plan.execute(std::span(&src.host_view, 1), comm, hd, hs);
  cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(sg::current_cuda_stream())),
       "cudaStreamSynchronize");
  const std::string where = "quantized reshard " + std::string(sg::quant_format_name(format)) +
                            " " + std::string(sg::dtype_name(dtype)) + " world " +
                            std::to_string(world) + " rank " + std::to_string(rank);
  for (std::size_t v = 0; v < dst.size(); ++v) {
    expect(same(to_host(dst[v].device, dst[v].host.size()), dst[v].host.data(), dst[v].host.size()),
           where + ": destination " + std::to_string(v) + " equals the host's");
    if (!scales[v].host.empty()) {
      expect(same(to_host(scales[v].device, scales[v].host.size()), scales[v].host.data(),
                  scales[v].host.size()),
             where + ": the scales of destination " + std::to_string(v) + " equal the host's");
    }
  }
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: 0 passed, 1 failed\n");
    return 1;
  }
  for (int world = 2; world <= 4; ++world) {
    run_world(world,
              [world](int rank, sg::Communicator& comm) { foreach_case(rank, comm, world); });
    for (int dim = 0; dim < 3; ++dim) {
      for (const bool padded : {false, true}) {
        run_world(world, [=](int rank, sg::Communicator& comm) {
          unshard_case(rank, comm, world, dim, padded);
        });
      }
    }
    run_world(world, [world](int rank, sg::Communicator& comm) { tiny_case(rank, comm, world); });
    for (const std::uint64_t bucket : {std::uint64_t{256} << 20, std::uint64_t{256}}) {
      run_world(world,
                [=](int rank, sg::Communicator& comm) { reshard_case(rank, comm, world, bucket); });
    }
    for (const sg::QuantFormat format :
         {sg::QuantFormat::kFp8Block128, sg::QuantFormat::kFp8Row128, sg::QuantFormat::kMxfp8}) {
      for (const sg::DType dtype :
           {sg::DType::kFloat32, sg::DType::kBFloat16, sg::DType::kFloat16}) {
        run_world(world, [=](int rank, sg::Communicator& comm) {
          quantized_case(rank, comm, world, format, dtype);
        });
      }
    }
  }
  // A CUDA view over host memory is refused on every rank, the device still usable after.
  run_world(2, [](int rank, sg::Communicator& comm) {
    std::vector<float> host(4, 1.0F);
    const std::vector<sg::TensorView> v{
        sg::TensorView{host.data(), sg::DType::kFloat32, {4}, {}, sg::cuda_device(0)}};
    bool refused = false;
    try {
      const std::vector<std::vector<sg::Shape>> h{{{4}}, {{4}}};
      (void)sg::foreach_all_gather(v, comm, h);
    } catch (const sg::InvalidArgument& e) {
      refused = std::string(e.what()).find("its memory is on cpu") != std::string::npos ||
                std::string(e.what()).find("failed on rank") != std::string::npos;
    }
    expect(refused, "host memory passed as cuda:0 refused on rank " + std::to_string(rank));
  });
  std::printf("%d passed, %d failed\n", passed.load(), failed.load());
  return failed.load() == 0 ? 0 : 1;
}
