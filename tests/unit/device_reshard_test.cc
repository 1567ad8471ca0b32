// The reshard's device path on the host, over the fake CUDA device (support/fake_device.h): the
// packs, the per-part copy tables and their upload, all_to_all_v_device on the threads
// transport, the unpacks into strided destination views. Every execution on fake device memory
// must give the bytes of the reference (reshard_cases.h: the full tensors sliced), touch only
// device memory from the kernel, move exactly the plan's bytes, and hold no pool allocation
// larger than one part of staging. (tools/device-check runs a reshard on a real GPU.)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/fake_device.h"
#include "support/limited_communicator.h"
#include "support/reshard_cases.h"
#include "support/testing.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

// Every rank on its thread, with the suites' watchdog (a hung exchange aborts with "HUNG").
void run_ranks(int world, const std::vector<int>& hosts,
               const std::function<void(int, Communicator&)>& fn) {
  testing::run_ranks_on_hosts(hosts, fn, "device reshard world " + std::to_string(world),
                              std::chrono::seconds(120));
}

std::vector<int> one_host(int world) { return std::vector<int>(static_cast<std::size_t>(world)); }

// A rank's reshard views copied into fake device memory: the same layouts, rebased.
struct DeviceViews {
  testing::ReshardViews host;
  std::vector<std::byte*> memory;  // per storage vector
  std::vector<TensorView> sources;
  std::vector<TensorView> destinations;

  DeviceViews(const ReshardPlan& plan, std::uint64_t seed, int variant)
      : host(testing::make_reshard_views(plan, seed, variant)) {
    for (const std::vector<std::byte>& s : host.storage) {
      auto* p = static_cast<std::byte*>(testing::alloc_fake(s.size()));
      if (!s.empty()) {
        std::memcpy(p, s.data(), s.size());
      }
      memory.push_back(p);
    }
    const auto rebase = [&](TensorView v, std::size_t k) {
      v.data = memory[k] + (static_cast<const std::byte*>(v.data) - host.storage[k].data());
      v.device = cuda_device(0);
      return v;
    };
    for (std::size_t v = 0; v < host.sources.size(); ++v) {
      sources.push_back(rebase(host.sources[v], v));
    }
    for (std::size_t v = 0; v < host.destinations.size(); ++v) {
      destinations.push_back(rebase(host.destinations[v], host.sources.size() + v));
    }
  }
  DeviceViews(const DeviceViews&) = delete;
  DeviceViews& operator=(const DeviceViews&) = delete;
  DeviceViews(DeviceViews&&) = delete;
  DeviceViews& operator=(DeviceViews&&) = delete;
  ~DeviceViews() {
    for (std::byte* p : memory) {
      testing::free_fake(p);
    }
  }

  // The destinations' device bytes back in the host storage, then the reference check.
  std::string check(const ReshardPlan& plan, std::uint64_t seed) {
    for (std::size_t v = 0; v < host.destinations.size(); ++v) {
      std::vector<std::byte>& s = host.storage[host.sources.size() + v];
      if (!s.empty()) {
        std::memcpy(s.data(), memory[host.sources.size() + v], s.size());
      }
    }
    return testing::check_reshard(plan, host, seed);
  }
};

// Random layouts on `world` ranks at `hosts`, each view kind, bit-exact against the reference,
// with the plan's bytes through the transport. Returns how many plans fanned out.
int fuzz(int world, const std::vector<int>& hosts, int iterations, std::uint64_t bucket) {
  std::vector<int> fanned(static_cast<std::size_t>(world));
  run_ranks(world, hosts, [&](int rank, Communicator& comm) {
    for (int it = 0; it < iterations; ++it) {
      const std::uint64_t seed = 7000 + static_cast<std::uint64_t>(it * 13 + world);
      const std::vector<TensorRegions> layout = testing::random_reshard_layout(seed, world);
      RegionOptions regions;
      regions.device_bucket_bytes = bucket;
      PlanOptions options;
      options.timeout = std::chrono::seconds(60);  // a rank that fails alone cannot hang the rest
      ReshardPlan mine = ReshardPlan::for_communicator(layout, comm, options, regions);
      DeviceViews views(mine, seed, it % 4);
      const std::uint64_t received = comm.exchange_bytes_received();
      const ExecStats stats = mine.execute(views.sources, comm, views.destinations, cuda_device(0));
      EXPECT_EQ(views.check(mine, seed), "") << "world " << world << " seed " << seed << "\n"
                                             << testing::describe_layout(layout);
      EXPECT_EQ(comm.exchange_bytes_received() - received, mine.bytes_received()) << seed;
      EXPECT_EQ(stats.payload_collectives,
                world == 1 ? 0 : mine.regions().rounds * mine.regions().device_parts)
          << seed;
      fanned[static_cast<std::size_t>(rank)] += mine.regions().forwarding ? 1 : 0;
    }
  });
  EXPECT_EQ(testing::fake_device_counters().stray, 0U);
  return fanned[0];
}

class DeviceReshardFuzz : public ::testing::TestWithParam<int> {};

TEST_P(DeviceReshardFuzz, RandomLayoutsAreBitExactAgainstTheFullTensors) {
  const int world = GetParam();
  (void)fuzz(world, one_host(world), 24, RegionOptions{}.device_bucket_bytes);
}

INSTANTIATE_TEST_SUITE_P(Worlds, DeviceReshardFuzz, ::testing::Range(1, 7));

// Two hosts: the fan-out's later exchanges forward from device destination views.
TEST(DeviceReshard, FannedOutPlansForwardFromDeviceViews) {
  const int fanned = fuzz(4, {0, 0, 1, 1}, 40, RegionOptions{}.device_bucket_bytes);
  EXPECT_GE(fanned, 3);
}

// A small bucket cuts every exchange into parts: the same bytes, every part's copies ordered
// after the peers' events, and no pool allocation larger than one part's send or receive buffer
// (half the bucket, + 16 bytes per peer of rounding), where one part would need 192 KiB each. The
// views are laid out so that the copy tables stay small (one descriptor per peer and side).
TEST(DeviceReshard, PartsBoundTheStaging) {
  constexpr std::uint64_t kBucket = std::uint64_t{96} << 10;
  TensorRegions t{.dtype = DType::kFloat32, .shape = {512, 512}, .sources = {}, .destinations = {}};
  for (int r = 0; r < 4; ++r) {
    t.sources.push_back({r, Box{{0, 128 * r}, {512, 128}}});
    t.destinations.push_back({3 - r, Box{{128 * r, 0}, {128, 512}}});
  }
  testing::reset_fake_device_counters();
  run_ranks(4, one_host(4), [&](int rank, Communicator& comm) {
    RegionOptions regions;
    regions.device_bucket_bytes = kBucket;
    ReshardPlan plan(std::span(&t, 1), 4, rank, {}, regions);
    // Every rank sends and receives 3/4 of 128 x 512 floats: 384 KiB over a 96 KiB bucket.
    EXPECT_EQ(plan.regions().device_parts, 4U);
    DeviceViews views(plan, 31, 0);
    const ExecStats stats = plan.execute(views.sources, comm, views.destinations, cuda_device(0));
    EXPECT_EQ(stats.payload_collectives, 4U);
    EXPECT_EQ(views.check(plan, 31), "");
  });
  const testing::FakeDeviceCounters c = testing::fake_device_counters();
  EXPECT_LE(c.largest_allocation, kBucket / 2 + 16 * 4);
  EXPECT_GE(c.largest_allocation, kBucket / 2 - 16 * 4);  // the part, not something smaller
  // Per part and rank: a wait on each of 3 peers' `ready`, and on each of 4 ranks' `done`.
  EXPECT_GE(c.event_waits, 4U * 4 * (3 + 4));
  EXPECT_EQ(c.stray, 0U);
}

// Many parts of a few hundred bytes, with every view kind and, on two hosts, the fan-out's
// later exchanges cut into parts too.
TEST(DeviceReshard, ManySmallPartsAreBitExact) {
  (void)fuzz(3, one_host(3), 12, 300);
  EXPECT_GE(fuzz(4, {0, 0, 1, 1}, 40, 200), 3);
}

// After the first execution: nothing allocated, nothing uploaded, no host wait; also for a plan
// that fans out (one table upload per exchange, each kept).
TEST(DeviceReshard, SteadyStateAllocatesAndUploadsNothing) {
  TensorRegions t{.dtype = DType::kBFloat16, .shape = {40, 24}, .sources = {}, .destinations = {}};
  for (int r = 0; r < 4; ++r) {
    t.sources.push_back({r, Box{{10 * r, 0}, {10, 24}}});
    t.destinations.push_back({(r + 1) % 4, Box{{0, 6 * r}, {40, 6}}});
  }
  // Held on host 0, wanted alike by both ranks of host 1: relayed once, then forwarded.
  TensorRegions fan{.dtype = DType::kFloat32, .shape = {64, 64}, .sources = {}, .destinations = {}};
  fan.sources.push_back({0, Box{{0, 0}, {64, 64}}});
  fan.destinations.push_back({2, Box{{0, 0}, {64, 64}}});
  fan.destinations.push_back({3, Box{{0, 0}, {64, 64}}});
  for (const bool fans : {false, true}) {
    const std::vector<TensorRegions> layout =
        fans ? std::vector<TensorRegions>{t, fan} : std::vector<TensorRegions>{t};
    run_ranks(4, {0, 0, 1, 1}, [&](int rank, Communicator& comm) {
      RegionOptions regions;
      regions.split_bytes = 1024;
      ReshardPlan plan = ReshardPlan::for_communicator(layout, comm, {}, regions);
      EXPECT_EQ(plan.regions().forwarding, fans);
      DeviceViews views(plan, 5, 1);
      plan.execute(views.sources, comm, views.destinations, cuda_device(0));
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      if (rank == 0) {
        testing::reset_fake_device_counters();
      }
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      const ExecStats stats = plan.execute(views.sources, comm, views.destinations, cuda_device(0));
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      EXPECT_EQ(views.check(plan, 5), "");
      EXPECT_EQ(stats.payload_collectives, plan.regions().rounds);
      EXPECT_EQ(stats.metadata_collectives, 0U);
      if (rank == 0) {
        const testing::FakeDeviceCounters c = testing::fake_device_counters();
        EXPECT_EQ(c.allocations, 0U) << "fan-out " << fans;
        EXPECT_EQ(c.host_to_device, 0U) << "fan-out " << fans;
        EXPECT_EQ(c.host_waits, 0U);
      }
    });
  }
}

// A torch NCCL group's facts (no host point to point, device memory): the reshard needs only
// all_to_all_v_device. A transport without device memory (MPI) refuses on every rank.
TEST(DeviceReshard, TheTransportNeedsOnlyTheDeviceExchange) {
  TensorRegions t{.dtype = DType::kInt32, .shape = {12, 8}, .sources = {}, .destinations = {}};
  for (int r = 0; r < 3; ++r) {
    t.sources.push_back({r, Box{{4 * r, 0}, {4, 8}}});
  }
  t.destinations.push_back({0, Box{{0, 0}, {12, 8}}});
  t.destinations.push_back({2, Box{{0, 4}, {12, 4}}});
  for (const bool device_memory : {true, false}) {
    std::vector<std::string> errors(3);
    run_ranks(3, one_host(3), [&](int rank, Communicator& inner) {
      testing::LimitedCommunicator comm(inner, {.reads_peer_memory = false,
                                                .small_messages_in_shared_memory = false,
                                                .gather_v = false,
                                                .scatter = false,
                                                .all_to_all = false,
                                                .device_memory = device_memory});
      ReshardPlan plan(std::span(&t, 1), 3, rank);
      DeviceViews views(plan, 11, 0);
      try {
        plan.execute(views.sources, comm, views.destinations, cuda_device(0));
        EXPECT_EQ(views.check(plan, 11), "");
      } catch (const InvalidArgument& e) {
        errors[static_cast<std::size_t>(rank)] = e.what();
      }
    });
    for (const std::string& e : errors) {
      if (device_memory) {
        EXPECT_EQ(e, "");
      } else {
        EXPECT_NE(e.find("moves host memory only"), std::string::npos) << e;
      }
    }
  }
}

// ---- Quantize on send, on the device ----

// A quantized tensor on 3 ranks: the sources split `dim` at `cuts` (inside blocks, so that maxima
// are combined across ranks); rank 0 wants it whole as float32 values, rank 1 a box as FP8 data
// and scales, rank 2 a box as bfloat16 values.
struct QuantCase {
  QuantFormat format;
  DType dtype;
  Shape shape;
  int dim;
  std::int64_t cuts[2];
};

std::int64_t numel(const Shape& shape) {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) {
    n *= d;
  }
  return n;
}

Box box_along(const Shape& shape, std::size_t dim, std::int64_t lo, std::int64_t hi) {
  Box b{Shape(shape.size(), 0), shape};
  b.offset[dim] = lo;
  b.size[dim] = hi - lo;
  return b;
}

std::vector<TensorRegions> quant_layout(const QuantCase& c) {
  TensorRegions t{.dtype = c.dtype, .shape = c.shape, .sources = {}, .destinations = {}};
  const auto d = static_cast<std::size_t>(c.dim);
  const std::int64_t at[4] = {0, c.cuts[0], c.cuts[1], c.shape[d]};
  for (int r = 0; r < 3; ++r) {
    t.sources.push_back({r, box_along(c.shape, d, at[r], at[r + 1])});
  }
  const std::int64_t cols = c.shape.back();
  t.destinations = {{0, Box{Shape(c.shape.size(), 0), c.shape}},
                    {1, box_along(c.shape, 0, 0, c.shape[0] > 8 ? c.shape[0] / 2 + 3 : 3)},
                    {2, box_along(c.shape, c.shape.size() - 1, cols / 2 - 32, cols)}};
  return {t};
}

// The scales of every block a box touches: quantize.h's scale layout.
Shape scale_shape_of(QuantFormat format, const Box& box) {
  Shape out;
  for (std::size_t d = 0; d < box.size.size(); ++d) {
    const bool blocked =
        d + 1 == box.size.size() || (format == QuantFormat::kFp8Block128 && d == 0);
    const std::int64_t e = !blocked ? 1 : format == QuantFormat::kMxfp8 ? 32 : 128;
    out.push_back((box.offset[d] + box.size[d] + e - 1) / e - box.offset[d] / e);
  }
  return out;
}

// Element i of the tensor as its dtype's bits: magnitudes varied by block, a NaN, an infinity,
// and (f32) an all-zero stretch; f16 also subnormals.
std::vector<std::byte> quant_values(DType dtype, std::int64_t n) {
  const std::size_t size = dtype_size(dtype);
  std::vector<std::byte> out(static_cast<std::size_t>(n) * size);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto x = static_cast<float>(
        std::ldexp(std::sin(0.37 * static_cast<double>(i)), static_cast<int>((i / 37) % 11) - 5));
    std::uint32_t bits = 0;
    std::memcpy(&bits, &x, 4);
    std::uint16_t half = 0;
    if (dtype == DType::kFloat16) {
      const auto u = static_cast<std::uint32_t>(i) * 2654435761U;
      half = static_cast<std::uint16_t>(((u >> 31) << 15) | (((i / 41) % 24) << 10) | (u & 0x3FFU));
    }
    half = dtype == DType::kBFloat16 ? static_cast<std::uint16_t>(bits >> 16) : half;
    if (i == 1234) {
      bits = 0xFFC00000U;  // a negative NaN: its block's maximum and scale are NaN
      half = 0xFE00U;
    }
    if (i == 2345) {  // +inf, in another block: an infinite scale, NaNs made of no NaN
      bits = 0x7F800000U;
      half = dtype == DType::kFloat16 ? 0x7C00U : 0x7F80U;
    }
    if (dtype == DType::kFloat32 && i >= n - 600) {
      bits = 0;
    }
    std::memcpy(out.data() + static_cast<std::size_t>(i) * size,
                dtype == DType::kFloat32 ? static_cast<const void*>(&bits) : &half, size);
  }
  return out;
}

// One rank's views of a quantized case, on the host or copied to fake device memory: its source
// (2-d sources column-major, so the kernel reads a strided view), its three destinations'
// buffers and the FP8 destination's scales.
struct QuantViews {
  std::vector<std::vector<std::byte>> host;  // source, destination, scales
  std::vector<std::byte*> memory;            // their fake device copies
  TensorView source;
  TensorView destination;
  TensorView scales;  // default: values
  bool on_device = false;

  QuantViews(const QuantCase& c, const ReshardPlan& plan, int rank, bool device)
      : on_device(device) {
    const TensorRegions& t = plan.tensor(0);
    const Box& src = plan.source(0).box;
    const std::vector<std::byte> full = quant_values(c.dtype, numel(t.shape));
    const std::size_t esize = dtype_size(c.dtype);
    host.emplace_back(static_cast<std::size_t>(numel(src.size)) * esize);
    const bool transposed = src.size.size() == 2;
    Shape strides = transposed ? Shape{1, src.size[0]} : Shape{};
    Shape dense(src.size.size(), 1);
    for (std::size_t d = src.size.size(); d-- > 1;) {
      dense[d - 1] = dense[d] * src.size[d];
    }
    const Shape& lay = transposed ? strides : dense;
    for (std::int64_t e = 0; e < numel(src.size); ++e) {  // element e of the box, row-major
      std::int64_t rest = e;
      std::int64_t global = 0;
      std::int64_t at = 0;
      std::int64_t step = 1;
      for (std::size_t d = src.size.size(); d-- > 0;) {
        const std::int64_t i = rest % src.size[d];
        rest /= src.size[d];
        at += i * lay[d];
        global += (src.offset[d] + i) * step;
        step *= t.shape[d];
      }
      std::memcpy(host[0].data() + static_cast<std::size_t>(at) * esize,
                  full.data() + static_cast<std::size_t>(global) * esize, esize);
    }
    const Box& want = plan.destination(0).box;
    const DType out = rank == 0 ? DType::kFloat32 : rank == 1 ? DType::kUInt8 : DType::kBFloat16;
    host.emplace_back(static_cast<std::size_t>(numel(want.size)) * dtype_size(out),
                      std::byte{0x5A});
    const Shape scale_shape = scale_shape_of(c.format, want);
    const DType sdtype = c.format == QuantFormat::kMxfp8 ? DType::kUInt8 : DType::kFloat32;
    host.emplace_back(rank == 1 ? static_cast<std::size_t>(numel(scale_shape)) * dtype_size(sdtype)
                                : 0);
    std::vector<void*> at;
    for (std::vector<std::byte>& h : host) {
      if (device) {
        memory.push_back(static_cast<std::byte*>(testing::alloc_fake(h.size())));
        std::copy(h.begin(), h.end(), memory.back());
      }
      at.push_back(device ? static_cast<void*>(memory.back()) : h.data());
    }
    const Device where = device ? cuda_device(0) : kCpu;
    source = TensorView{at[0], c.dtype, src.size, strides, where};
    destination = TensorView{at[1], out, want.size, {}, where};
    if (rank == 1) {
      scales = TensorView{at[2], sdtype, scale_shape, {}, where};
    }
  }
  QuantViews(const QuantViews&) = delete;
  QuantViews& operator=(const QuantViews&) = delete;
  QuantViews(QuantViews&&) = delete;
  QuantViews& operator=(QuantViews&&) = delete;
  ~QuantViews() {
    for (std::byte* p : memory) {
      testing::free_fake(p);
    }
  }

  // The destination's and the scales' bytes as they are now.
  std::vector<std::byte> result() const {
    std::vector<std::byte> out;
    for (std::size_t k = 1; k < host.size(); ++k) {
      const std::byte* from = on_device ? memory[k] : host[k].data();
      out.insert(out.end(), from, from + host[k].size());
    }
    return out;
  }
};

const QuantCase kQuantCases[] = {
    {QuantFormat::kFp8Block128, DType::kFloat32, {300, 256}, 0, {100, 200}},
    {QuantFormat::kFp8Row128, DType::kBFloat16, {4, 50, 384}, 2, {100, 250}},
    {QuantFormat::kMxfp8, DType::kFloat16, {96, 256}, 1, {80, 176}},
    {QuantFormat::kFp8Row128, DType::kFloat16, {130, 200}, 0, {33, 90}},
};

// The same plan's executions on host and on fake device memory give the same bytes (the host
// path is held to quantizing the whole tensor by quantized_reshard_test), through the quantizer
// kernel's element code; a steady state allocates nothing and touches only device memory.
TEST(DeviceQuantizedReshard, IsBitIdenticalToTheHostPath) {
  for (const QuantCase& c : kQuantCases) {
    const std::vector<TensorRegions> layout = quant_layout(c);
    const std::vector<QuantFormat> formats = {c.format};
    run_ranks(3, one_host(3), [&](int rank, Communicator& comm) {
      PlanOptions options;
      options.timeout = std::chrono::seconds(60);
      ReshardPlan plan(layout, 3, rank, options, {}, formats);
      QuantViews host(c, plan, rank, false);
      QuantViews device(c, plan, rank, true);
      plan.execute(std::span(&host.source, 1), comm, std::span(&host.destination, 1),
                   std::span(&host.scales, 1));
      plan.execute(std::span(&device.source, 1), comm, std::span(&device.destination, 1),
                   std::span(&device.scales, 1), cuda_device(0));
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      if (rank == 0) {
        testing::reset_fake_device_counters();
      }
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      const std::uint64_t planned = plan_regions_runs();
      const ExecStats stats =
          plan.execute(std::span(&device.source, 1), comm, std::span(&device.destination, 1),
                       std::span(&device.scales, 1), cuda_device(0));
      EXPECT_EQ(plan_regions_runs(), planned);
      // The maxima's all-gather (where a block is cut across ranks), the payload.
      EXPECT_EQ(stats.payload_collectives, plan.amax_row_bytes() != 0 ? 2U : 1U);
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      EXPECT_EQ(device.result(), host.result())
          << quant_format_name(c.format) << " " << dtype_name(c.dtype) << " rank " << rank;
      EXPECT_NE(host.result(), std::vector<std::byte>(host.result().size(), std::byte{0x5A}));
      if (rank == 0) {
        const testing::FakeDeviceCounters n = testing::fake_device_counters();
        EXPECT_EQ(n.allocations, 0U);
        EXPECT_EQ(n.stray, 0U);
        // Per rank: its fold, its quantize, and a dequantize where it wants values.
        EXPECT_GE(n.launches, 3U + 3U + 2U);
        EXPECT_GE(n.host_waits, 3U);  // each rank's maxima
      }
    });
  }
}

// A host view in a device call is refused on every rank, naming it, before anything moves.
TEST(DeviceQuantizedReshard, AHostViewInADeviceCallFailsEveryRank) {
  const QuantCase& c = kQuantCases[0];
  const std::vector<TensorRegions> layout = quant_layout(c);
  const std::vector<QuantFormat> formats = {c.format};
  std::vector<std::string> errors(3);
  run_ranks(3, one_host(3), [&](int rank, Communicator& comm) {
    ReshardPlan plan(layout, 3, rank, {}, {}, formats);
    QuantViews device(c, plan, rank, true);
    QuantViews host(c, plan, rank, false);
    const TensorView& out = rank == 2 ? host.destination : device.destination;
    try {
      plan.execute(std::span(&device.source, 1), comm, std::span(&out, 1),
                   std::span(&device.scales, 1), cuda_device(0));
    } catch (const InvalidArgument& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("rank 2"), std::string::npos) << e;
    EXPECT_NE(e.find("destination 0"), std::string::npos) << e;
  }
}

// A quantized UnshardPlan (FSDP's padded shards, rows cut inside blocks) on fake device memory,
// executed and started: every rank's dequantized full tensor has the bytes of the same plan's
// call on host memory.
TEST(DeviceQuantizedReshard, AQuantizedUnshardOnTheDeviceIsBitIdenticalToTheHostOne) {
  const Shape full{300, 256};
  const std::vector<ShardSpec> specs = {{DType::kBFloat16, full, 0, {}, 110}};
  const std::vector<QuantFormat> formats = {QuantFormat::kFp8Block128};
  const std::vector<std::byte> values = quant_values(DType::kBFloat16, numel(full));
  run_ranks(3, one_host(3), [&](int rank, Communicator& comm) {
    UnshardPlan plan(specs, 3, rank, {}, -1, formats);
    const std::size_t row = 256 * 2;
    std::vector<std::byte> shard(110 * row, std::byte{0x7F});  // the padding: garbage
    std::memcpy(shard.data(), values.data() + static_cast<std::size_t>(100 * rank) * row,
                100 * row);
    std::vector<std::byte> host_out(300 * 256 * 4);
    auto* dev_shard = static_cast<std::byte*>(testing::alloc_fake(shard.size()));
    auto* dev_out = static_cast<std::byte*>(testing::alloc_fake(host_out.size()));
    std::memcpy(dev_shard, shard.data(), shard.size());
    const TensorView host_in{shard.data(), DType::kBFloat16, {110, 256}, {}, kCpu};
    const TensorView host_to{host_out.data(), DType::kFloat32, full, {}, kCpu};
    const TensorView dev_in{dev_shard, DType::kBFloat16, {110, 256}, {}, cuda_device(0)};
    const TensorView dev_to{dev_out, DType::kFloat32, full, {}, cuda_device(0)};
    const std::vector<TensorView> no_scales(1);
    (void)plan.execute(std::span(&host_in, 1), comm, std::span(&host_to, 1), no_scales);
    for (const bool started : {false, true}) {
      std::memset(dev_out, 0, host_out.size());
      if (started) {
        (void)plan.start(std::span(&dev_in, 1), comm, std::span(&dev_to, 1), no_scales).wait();
      } else {
        (void)plan.execute(std::span(&dev_in, 1), comm, std::span(&dev_to, 1), no_scales);
      }
      EXPECT_EQ(std::memcmp(dev_out, host_out.data(), host_out.size()), 0)
          << "rank " << rank << (started ? " started" : "");
    }
    testing::free_fake(dev_shard);
    testing::free_fake(dev_out);
  });
  EXPECT_EQ(testing::fake_device_counters().stray, 0U);
}

// Drains a stream over device shards and the same stream over host shards, bucket by bucket:
// every view of a device bucket is on the device, with the host bucket's bytes (`what` names the
// rank). Returns the views seen.
std::size_t expect_same_buckets(UnshardStream& on_device, UnshardStream& on_host,
                                const std::string& what) {
  std::size_t views = 0;
  for (;;) {
    std::optional<StreamBucket> d = on_device.next();
    std::optional<StreamBucket> h = on_host.next();
    EXPECT_EQ(d.has_value(), h.has_value()) << what;
    if (!d || !h) {
      return views;
    }
    EXPECT_EQ(d->full.size(), h->full.size()) << what << " bucket " << d->index;
    for (std::size_t j = 0; j < std::min(d->full.size(), h->full.size()); ++j) {
      EXPECT_EQ(d->full[j].device, cuda_device(0));
      const auto bytes =
          static_cast<std::size_t>(numel(h->full[j].shape)) * dtype_size(h->full[j].dtype);
      EXPECT_EQ(std::memcmp(d->full[j].data, h->full[j].data, bytes), 0)
          << what << " bucket " << d->index << " view " << j;
    }
    views += d->full.size();
  }
}

// A quantized UnshardStream over fake device shards (FSDP's padded rows, cut inside blocks, and
// an mxfp8 parameter split by columns), two parameters to a bucket or one: every bucket's device
// views (FP8 data and scales) have the bytes of the same stream's buckets over host shards.
TEST(DeviceQuantizedReshard, AQuantizedStreamOnTheDeviceIsBitIdenticalToTheHostOne) {
  const std::vector<ShardSpec> specs = {{DType::kBFloat16, {300, 256}, 0, {}, 110},
                                        {DType::kFloat32, {4, 192}, 1, {64, 64, 64}, 0}};
  const std::vector<QuantFormat> formats = {QuantFormat::kFp8Block128, QuantFormat::kMxfp8};
  const std::vector<std::byte> rows = quant_values(DType::kBFloat16, 300 * 256);
  const std::vector<std::byte> cols = quant_values(DType::kFloat32, 4 * 192);
  for (const std::uint64_t bucket_bytes : {std::uint64_t{1}, std::uint64_t{1} << 20}) {
    run_ranks(3, one_host(3), [&](int rank, Communicator& comm) {
      std::vector<std::byte> a(110 * 256 * 2, std::byte{0x7F});  // the padding: garbage
      std::memcpy(a.data(), rows.data() + static_cast<std::size_t>(100 * rank) * 512, 100 * 512);
      std::vector<std::byte> b(4 * 64 * 4);
      for (std::size_t r = 0; r < 4; ++r) {
        std::memcpy(b.data() + r * 256,
                    cols.data() + (r * 192 + 64 * static_cast<std::size_t>(rank)) * 4, 256);
      }
      auto* dev_a = static_cast<std::byte*>(testing::alloc_fake(a.size()));
      auto* dev_b = static_cast<std::byte*>(testing::alloc_fake(b.size()));
      std::memcpy(dev_a, a.data(), a.size());
      std::memcpy(dev_b, b.data(), b.size());
      const std::vector<TensorView> host = {{a.data(), DType::kBFloat16, {110, 256}, {}, kCpu},
                                            {b.data(), DType::kFloat32, {4, 64}, {}, kCpu}};
      const std::vector<TensorView> dev = {
          {dev_a, DType::kBFloat16, {110, 256}, {}, cuda_device(0)},
          {dev_b, DType::kFloat32, {4, 64}, {}, cuda_device(0)}};
      const StreamOptions options{.bucket_bytes = bucket_bytes, .prefetch = 0, .dst = -1};
      UnshardStream on_host(specs, 3, rank, options, formats);
      UnshardStream on_device(specs, 3, rank, options, formats);
      on_host.begin(host, comm);
      on_device.begin(dev, comm);
      EXPECT_EQ(expect_same_buckets(on_device, on_host, "rank " + std::to_string(rank)), 4U)
          << "data and scales of each";
      testing::free_fake(dev_a);
      testing::free_fake(dev_b);
    });
  }
  EXPECT_EQ(testing::fake_device_counters().stray, 0U);
}

// Tracks the device memory it has handed out and not yet got back (fake memory).
class LiveBytes final : public DeviceAllocator {
 public:
  DeviceAllocation allocate(std::uint64_t bytes, const Device& /*device*/,
                            void* /*stream*/) override {
    auto* data = static_cast<std::byte*>(testing::alloc_fake(bytes));
    const std::lock_guard<std::mutex> lock(mutex_);
    held_[data] = bytes;
    live_ += bytes;
    ++allocations_;
    return {.data = data,
            .release =
                [](std::byte* p, void* self) noexcept {
                  auto& me = *static_cast<LiveBytes*>(self);
                  const std::lock_guard<std::mutex> guard(me.mutex_);
                  me.live_ -= me.held_.at(p);
                  me.held_.erase(p);
                  testing::free_fake(p);
                },
            .context = this};
  }
  std::uint64_t live() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return live_;
  }
  std::uint64_t allocations() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return allocations_;
  }

 private:
  std::mutex mutex_;
  std::map<std::byte*, std::uint64_t> held_;
  std::uint64_t live_ = 0;
  std::uint64_t allocations_ = 0;
};

// A stream's buckets take turns with one set of large scratch: after a run of 8 one-parameter
// buckets (of 4 sizes, so the shared buffers grow, and move, within the first run), the device
// memory a quantized stream holds besides its ring is about one bucket's (the FP8 staging, the
// exchange's send and gather buffers), not eight (each bucket's plan kept its own before: the
// whole model's, twice over); a second run, over changed values, allocates nothing. Every
// bucket of both runs has the bytes of the same stream over host shards. Plain and quantized.
TEST(DeviceQuantizedReshard, AStreamHoldsOneBucketsScratch) {
  constexpr std::size_t kParams = 8;
  constexpr std::int64_t kCols = 512;
  const auto rows = [](std::size_t i) { return 128 * static_cast<std::int64_t>(1 + i % 4); };
  std::vector<ShardSpec> specs;
  for (std::size_t i = 0; i < kParams; ++i) {
    specs.push_back({DType::kBFloat16, {rows(i), kCols}, 0, {}, 0});
  }
  const std::vector<std::byte> values = quant_values(DType::kBFloat16, 2 * 512 * kCols);
  for (const QuantFormat format : {QuantFormat::kNone, QuantFormat::kFp8Block128}) {
    const auto live = std::make_shared<LiveBytes>();
    set_device_allocator(live);
    run_ranks(2, one_host(2), [&](int rank, Communicator& comm) {
      std::vector<std::vector<std::byte>> host(kParams);
      std::vector<TensorView> host_shards;
      std::vector<TensorView> dev_shards;
      for (std::size_t i = 0; i < kParams; ++i) {
        host[i].resize(static_cast<std::size_t>(rows(i) / 2 * kCols * 2));
        const Shape shape{rows(i) / 2, kCols};
        host_shards.push_back({host[i].data(), DType::kBFloat16, shape, {}, kCpu});
        dev_shards.push_back(host_shards.back());
        dev_shards.back().data = testing::alloc_fake(host[i].size());
        dev_shards.back().device = cuda_device(0);
      }
      const StreamOptions options{.bucket_bytes = 1, .prefetch = 1, .dst = -1};
      const std::vector<QuantFormat> formats(kParams, format);
      UnshardStream on_host(specs, 2, rank, options, formats);
      UnshardStream on_device(specs, 2, rank, options, formats);
      ASSERT_EQ(on_device.num_buckets(), kParams);
      std::uint64_t after_first = 0;
      for (std::size_t run = 0; run < 2; ++run) {
        for (std::size_t i = 0; i < kParams; ++i) {  // every run, other values
          const std::size_t from = (run * 7 + i + static_cast<std::size_t>(rank) * 3) * 1024;
          std::memcpy(host[i].data(), values.data() + from, host[i].size());
          std::memcpy(dev_shards[i].data, host[i].data(), host[i].size());
        }
        on_host.begin(host_shards, comm);
        on_device.begin(dev_shards, comm);
        const std::size_t views = expect_same_buckets(
            on_device, on_host, "rank " + std::to_string(rank) + " run " + std::to_string(run));
        EXPECT_EQ(views, format == QuantFormat::kNone ? kParams : 2 * kParams);
        comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
        if (rank == 0) {
          // Both ranks' device streams are in this process: two rings of 2 buffers (each the
          // largest bucket's), and two sets of scratch, each less than 3 such buffers (and some
          // small scratch per plan: the maxima, the copy tables). Kept per plan, a quantized
          // stream's came to about 8.
          const std::uint64_t bucket = on_device.buffer_bytes();
          EXPECT_LT(live->live(), 2 * (2 * bucket + 3 * bucket)) << "run " << run;
          if (run == 0) {
            after_first = live->allocations();
          } else {
            EXPECT_EQ(live->allocations(), after_first) << "the second run allocated";
          }
        }
        comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      }
      for (const TensorView& t : dev_shards) {
        testing::free_fake(t.data);
      }
    });
    set_device_allocator(nullptr);
    EXPECT_EQ(live->live(), 0U) << "memory not given back";
  }
}

}  // namespace
}  // namespace shardgather
