// The reshard's device path on the host, over the fake CUDA device (support/fake_device.h): the
// packs, the per-part copy tables and their upload, all_to_all_v_device on the threads
// transport, the unpacks into strided destination views. Every execution on fake device memory
// must give the bytes of the reference (reshard_cases.h: the full tensors sliced), touch only
// device memory from the kernel, move exactly the plan's bytes, and hold no pool allocation
// larger than one part of staging. (tools/device-check runs a reshard on a real GPU.)
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
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

}  // namespace
}  // namespace shardgather
