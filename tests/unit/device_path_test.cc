// The device path end to end on the host, over a fake CUDA device (support/fake_device.h):
// the operations, the deferred packs, the copy tables and their uploads, the device strategy and
// the threads transport's device gather, everything but the CUDA calls themselves. Each call on
// fake device memory must give the bytes of the same call on host memory, touch nothing but
// device memory from the kernel, and, in a plan's steady state, launch at most three kernels,
// upload nothing and allocate nothing. (tools/device-check runs the same calls on a real GPU.)
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "support/fake_device.h"
#include "support/limited_communicator.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

using testing::fake_device_counters;

void run_ranks(int world, const std::function<void(int, Communicator&)>& fn) {
  auto comms = make_thread_group(world);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, *comms[static_cast<std::size_t>(r)]);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (const auto& e : errors) {
    if (e) {
      std::rethrow_exception(e);
    }
  }
}

// A host tensor and its copy in fake device memory.
struct Pair {
  std::vector<std::byte> host;
  std::byte* device = nullptr;
  TensorView host_view;
  TensorView device_view;
  Pair() = default;
  Pair(const Pair&) = delete;
  Pair& operator=(const Pair&) = delete;
  Pair(Pair&&) = delete;
  Pair& operator=(Pair&&) = delete;
  ~Pair() { testing::free_fake(device); }

  void make(DType dtype, const Shape& shape, const Shape& strides, std::size_t elems,
            std::uint64_t seed) {
    host.resize(elems * dtype_size(dtype));
    for (auto& b : host) {
      seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
      b = static_cast<std::byte>(seed >> 56U);
    }
    device = static_cast<std::byte*>(testing::alloc_fake(host.size()));
    if (!host.empty()) {
      std::memcpy(device, host.data(), host.size());
    }
    host_view = TensorView{host.data(), dtype, shape, strides};
    device_view = TensorView{device, dtype, shape, strides, cuda_device(0)};
  }
};

bool same_bytes(const void* a, const void* b, std::uint64_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

std::uint64_t bytes_of(const TensorView& v) {
  std::uint64_t n = dtype_size(v.dtype);
  for (const auto e : v.shape) {
    n *= static_cast<std::uint64_t>(e);
  }
  return n;
}

// Every tensor of two gathers (the gaps between them are undefined, docs/layout.md).
bool same_tensors(std::span<const TensorView> a, std::span<const TensorView> b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (std::size_t k = 0; k < a.size(); ++k) {
    if (a[k].shape != b[k].shape || !same_bytes(a[k].data, b[k].data, bytes_of(b[k]))) {
      return false;
    }
  }
  return true;
}

bool same_gathers(const GatherResult& a, const GatherResult& b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!same_tensors(a[i], b[i])) {
      return false;
    }
  }
  return true;
}

// Rank r: [r + 2, 3] f32 (transposed storage on odd ranks), [5 r] bf16 (empty on rank 0), [7] i8.
std::vector<std::vector<Shape>> hint(int world) {
  std::vector<std::vector<Shape>> h;
  for (int r = 0; r < world; ++r) {
    h.push_back({{r + 2, 3}, {5 * r}, {7}});
  }
  return h;
}

// One rank's list of hint(world) (transposed storage on odd ranks), on the fake device and on
// the host.
struct RankList {
  explicit RankList(int rank) {
    const std::int64_t rows = rank + 2;
    const auto seed = static_cast<std::uint64_t>(rank);
    t[0].make(DType::kFloat32, {rows, 3}, rank % 2 == 1 ? Shape{1, rows} : Shape{},
              static_cast<std::size_t>(rows * 3), 11 + seed);
    t[1].make(DType::kBFloat16, {5 * rank}, {}, static_cast<std::size_t>(5 * rank), 21 + seed);
    t[2].make(DType::kInt8, {7}, {}, 7, 31 + seed);
    for (const Pair& p : t) {
      dv.push_back(p.device_view);
      hv.push_back(p.host_view);
    }
  }
  Pair t[3];
  std::vector<TensorView> dv;
  std::vector<TensorView> hv;
};

class DevicePath : public ::testing::TestWithParam<int> {};

TEST_P(DevicePath, ForeachWithHintGivesTheHostBytes) {
  const int world = GetParam();
  const std::uint64_t stray_before = fake_device_counters().stray;
  run_ranks(world, [world](int rank, Communicator& comm) {
    const RankList list(rank);
    const std::vector<TensorView>& dv = list.dv;
    const std::vector<TensorView>& hv = list.hv;
    const GatherResult d = foreach_all_gather(dv, comm, hint(world));
    const GatherResult h = foreach_all_gather(hv, comm, hint(world));
    EXPECT_EQ(d.buffer().device(), cuda_device(0));
    EXPECT_EQ(d[0][0].device, cuda_device(0));
    EXPECT_EQ(d.stats().strategy, Strategy::kPacked);
    ASSERT_EQ(d.buffer().size(), h.buffer().size());
    EXPECT_TRUE(same_gathers(d, h)) << "rank " << rank;
  });
  EXPECT_EQ(fake_device_counters().stray, stray_before) << "a kernel touched host memory";
}

TEST_P(DevicePath, PlanSteadyStateLaunchesAtMostThreeKernelsAndUploadsNothing) {
  const int world = GetParam();
  run_ranks(world, [world](int rank, Communicator& comm) {
    const RankList list(rank);
    const std::vector<TensorView>& dv = list.dv;
    const std::vector<TensorView>& hv = list.hv;
    const std::vector<DType> dtypes{DType::kFloat32, DType::kBFloat16, DType::kInt8};
    AllGatherPlan plan(dtypes, hint(world), rank);
    std::vector<std::byte> want(plan.output_bytes());
    (void)plan.execute(hv, comm, want);
    auto* out = static_cast<std::byte*>(testing::alloc_fake(plan.output_bytes()));
    for (int i = 0; i < 4; ++i) {
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      const testing::FakeDeviceCounters before = fake_device_counters();
      const ExecStats stats = plan.execute(dv, comm, std::span(out, plan.output_bytes()));
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      const testing::FakeDeviceCounters after = fake_device_counters();
      EXPECT_TRUE(same_tensors(plan.views(out), plan.views(want.data()))) << "execution " << i;
      EXPECT_EQ(stats.strategy, Strategy::kPacked);
      if (i > 0) {
        // Counters are process-wide: every rank's execution is between the two barriers.
        EXPECT_EQ(after.allocations, before.allocations) << "execution " << i;
        EXPECT_EQ(after.frees, before.frees) << "execution " << i;
        EXPECT_EQ(after.host_to_device, before.host_to_device) << "execution " << i;
        EXPECT_LE(after.launches - before.launches, 3U * static_cast<unsigned>(world));
        // Stream-ordered: the host never looks at the device's progress; the threads transport
        // orders the ranks' streams with events.
        EXPECT_EQ(after.host_waits, before.host_waits) << "execution " << i;
        const auto w = static_cast<std::uint64_t>(world);
        EXPECT_EQ(after.event_waits - before.event_waits, world == 1 ? 0 : 2 * w * w);
      }
    }
    // Every rank has read its counters before any plan (and its scratch) goes.
    comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
    testing::free_fake(out);
  });
}

// Counts what it hands out and gets back, on the stream it was asked for, over fake memory.
class CountingAllocator final : public DeviceAllocator {
 public:
  DeviceAllocation allocate(std::uint64_t bytes, const Device& device, void* stream) override {
    EXPECT_EQ(device, cuda_device(0));
    EXPECT_EQ(stream, expected_stream.load()) << "memory for another stream than the call's";
    allocated.fetch_add(1);
    return {.data = static_cast<std::byte*>(testing::alloc_fake(bytes)),
            .release =
                [](std::byte* data, void* self) noexcept {
                  static_cast<CountingAllocator*>(self)->released.fetch_add(1);
                  testing::free_fake(data);
                },
            .context = this};
  }
  std::atomic<int> allocated{0};
  std::atomic<int> released{0};
  std::atomic<void*> expected_stream{nullptr};
};

// Every byte of device memory a call takes (its output, its staging, the copy tables) comes from
// the device allocator, for the call's stream, and goes back to it: a one-shot call, and a
// started one on its stream. The default pool's count stays where it was while another
// allocator is installed; with the default back, one-shot calls take from the pool and give
// everything back.
TEST_P(DevicePath, DeviceMemoryComesFromTheAllocatorAndGoesBack) {
  const int world = GetParam();
  const auto counting = std::make_shared<CountingAllocator>();
  const testing::FakeDeviceCounters before = fake_device_counters();
  set_device_allocator(counting);
  run_ranks(world, [world](int rank, Communicator& comm) {
    const RankList list(rank);
    const GatherResult d = foreach_all_gather(list.dv, comm, hint(world));
    EXPECT_TRUE(same_gathers(d, foreach_all_gather(list.hv, comm, hint(world))));
  });
  // Started where a side stream is current: the progress thread allocates for that stream.
  int stream_token = 0;
  counting->expected_stream = &stream_token;
  run_ranks(world, [&](int rank, Communicator& comm) {
    const RankList list(rank);
    const CudaStreamGuard on(&stream_token);
    const GatherResult started = start_foreach_all_gather(list.dv, comm, hint(world)).wait();
    EXPECT_TRUE(same_gathers(started, foreach_all_gather(list.hv, comm, hint(world))));
  });
  set_device_allocator(nullptr);
  const testing::FakeDeviceCounters during = fake_device_counters();
  EXPECT_EQ(during.allocations, before.allocations) << "the default pool was used";
  EXPECT_EQ(during.host_waits, before.host_waits) << "a one-shot call waited for the device";
  EXPECT_GT(counting->allocated.load(), 0);
  EXPECT_EQ(counting->released.load(), counting->allocated.load()) << "memory not given back";
  run_ranks(world, [world](int rank, Communicator& comm) {
    const RankList list(rank);
    const GatherResult d = foreach_all_gather(list.dv, comm, hint(world));
    EXPECT_TRUE(same_gathers(d, foreach_all_gather(list.hv, comm, hint(world))));
  });
  const testing::FakeDeviceCounters after = fake_device_counters();
  EXPECT_GT(after.allocations, during.allocations);
  EXPECT_EQ(after.allocations - during.allocations, after.frees - during.frees);
}

TEST_P(DevicePath, UnshardAlongEveryDimGivesTheHostBytes) {
  const int world = GetParam();
  for (int dim = 0; dim < 3; ++dim) {
    for (const bool padded : {false, true}) {
      run_ranks(world, [=](int rank, Communicator& comm) {
        const Shape full{6, 10, 4 * world - 1};
        ShardSpec spec{.dtype = DType::kFloat32, .full_shape = full, .shard_dim = dim, .sizes = {}};
        if (padded) {
          spec.padded_size = (full[static_cast<std::size_t>(dim)] + world - 1) / world;
        }
        const std::vector<ShardSpec> specs{
            spec, {.dtype = DType::kInt16, .full_shape = {9}, .shard_dim = 0, .sizes = {}}};
        const UnshardPlan plan(specs, world, rank);
        Pair shards[2];
        for (std::size_t i = 0; i < 2; ++i) {
          const Shape s = plan.shard_shape(rank, i);
          std::size_t n = 1;
          for (const auto e : s) {
            n *= static_cast<std::size_t>(e);
          }
          // A transposed last-two-dims storage for the 3-D shard on odd ranks: a strided input.
          Shape strides;
          if (i == 0 && rank % 2 == 1) {
            strides = {s[1] * s[2], 1, s[1]};
          }
          shards[i].make(specs[i].dtype, s, strides, n,
                         41 + 7 * static_cast<std::uint64_t>(rank) + i);
        }
        const std::vector<TensorView> dv{shards[0].device_view, shards[1].device_view};
        const std::vector<TensorView> hv{shards[0].host_view, shards[1].host_view};
        const UnshardResult d = unshard(dv, comm, specs);
        const UnshardResult h = unshard(hv, comm, specs);
        for (std::size_t i = 0; i < 2; ++i) {
          std::uint64_t bytes = dtype_size(specs[i].dtype);
          for (const auto e : specs[i].full_shape) {
            bytes *= static_cast<std::uint64_t>(e);
          }
          EXPECT_EQ(d[i].device, cuda_device(0));
          EXPECT_TRUE(same_bytes(d[i].data, h[i].data, bytes))
              << "dim " << dim << (padded ? " padded" : "") << " rank " << rank << " param " << i;
        }
      });
    }
  }
}

TEST_P(DevicePath, UnshardToOneRank) {
  const int world = GetParam();
  run_ranks(world, [world](int rank, Communicator& comm) {
    const std::vector<ShardSpec> specs{
        {.dtype = DType::kFloat32, .full_shape = {5, 2 * world + 1}, .shard_dim = 1, .sizes = {}}};
    UnshardPlan plan(specs, world, rank, {}, world - 1);
    Pair shard;
    const Shape s = plan.shard_shape(rank, 0);
    shard.make(DType::kFloat32, s, {}, static_cast<std::size_t>(s[0] * s[1]),
               5 + static_cast<std::uint64_t>(rank));
    const std::uint64_t bytes = plan.output_bytes();
    auto* out = static_cast<std::byte*>(testing::alloc_fake(bytes));
    std::vector<std::byte> want(bytes);
    const std::vector<TensorView> dv{shard.device_view};
    const std::vector<TensorView> hv{shard.host_view};
    (void)plan.execute(hv, comm, want);
    (void)plan.execute(dv, comm, std::span(out, bytes));
    if (rank == world - 1) {
      EXPECT_TRUE(same_bytes(out, want.data(), bytes));
    }
    testing::free_fake(out);
  });
}

TEST_P(DevicePath, ManySmallTensors) {
  const int world = GetParam();
  run_ranks(world, [world](int rank, Communicator& comm) {
    constexpr int kTensors = 1000;
    std::vector<Pair> t(kTensors);
    std::vector<TensorView> dv;
    std::vector<TensorView> hv;
    std::vector<std::vector<Shape>> h(static_cast<std::size_t>(world));
    for (int i = 0; i < kTensors; ++i) {
      for (int r = 0; r < world; ++r) {
        h[static_cast<std::size_t>(r)].push_back({1 + (i * 7 + r) % 61});
      }
      const std::int64_t n = 1 + (i * 7 + rank) % 61;
      t[static_cast<std::size_t>(i)].make(DType::kFloat32, {n}, {}, static_cast<std::size_t>(n),
                                          static_cast<std::uint64_t>(i * 131 + rank));
      dv.push_back(t[static_cast<std::size_t>(i)].device_view);
      hv.push_back(t[static_cast<std::size_t>(i)].host_view);
    }
    const GatherResult d = foreach_all_gather(dv, comm, h);
    const GatherResult c = foreach_all_gather(hv, comm, h);
    EXPECT_TRUE(same_gathers(d, c));
  });
}

// A started call's wait() makes the waiter's current stream wait for the call's device work (one
// event, recorded at the end of the work, waited on once per wait()); the host looks at the
// device's progress nowhere. The threads transport's own events between the ranks are 2 W^2
// waits and 2 W records per call (none at W = 1).
TEST_P(DevicePath, WaitOrdersTheWaitersStreamWithoutAHostWait) {
  const int world = GetParam();
  run_ranks(world, [world](int rank, Communicator& comm) {
    const RankList list(rank);
    const GatherResult want = foreach_all_gather(list.hv, comm, hint(world));
    int call_stream = 0;
    int waiter_stream = 0;
    for (int i = 0; i < 2; ++i) {  // the second round: everything warm
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      const testing::FakeDeviceCounters before = fake_device_counters();
      Work<GatherResult> work = [&] {
        const CudaStreamGuard on(&call_stream);
        return start_foreach_all_gather(list.dv, comm, hint(world));
      }();
      const CudaStreamGuard on(&waiter_stream);
      const GatherResult got = work.wait();
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      const testing::FakeDeviceCounters after = fake_device_counters();
      EXPECT_TRUE(same_gathers(got, want)) << "rank " << rank;
      EXPECT_EQ(after.host_waits, before.host_waits);
      if (i == 1) {
        const auto ww = static_cast<std::uint64_t>(world);
        const std::uint64_t transport_waits = world == 1 ? 0 : 2 * ww * ww;
        const std::uint64_t transport_records = world == 1 ? 0 : 2 * ww;
        EXPECT_EQ(after.event_waits - before.event_waits, transport_waits + ww);
        EXPECT_EQ(after.event_records - before.event_records, transport_records + ww);
      }
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
    }
  });
}

// DeviceWait::kHost: the host waits for every device call's work (a blocking call's, and a
// started one's on the progress thread), looking at it once here (the fake has run it); back in
// the default mode it never does.
TEST_P(DevicePath, HostWaitModeWaitsOnTheHost) {
  const int world = GetParam();
  const auto w = static_cast<std::uint64_t>(world);
  set_device_wait(DeviceWait::kHost);
  const testing::FakeDeviceCounters before = fake_device_counters();
  run_ranks(world, [world](int rank, Communicator& comm) {
    const RankList list(rank);
    const GatherResult want = foreach_all_gather(list.hv, comm, hint(world));
    EXPECT_TRUE(same_gathers(foreach_all_gather(list.dv, comm, hint(world)), want));
    EXPECT_TRUE(same_gathers(start_foreach_all_gather(list.dv, comm, hint(world)).wait(), want));
  });
  const testing::FakeDeviceCounters hosted = fake_device_counters();
  EXPECT_EQ(hosted.host_waits - before.host_waits, 2 * w);
  set_device_wait(DeviceWait::kStream);
  run_ranks(world, [world](int rank, Communicator& comm) {
    const RankList list(rank);
    EXPECT_TRUE(same_gathers(foreach_all_gather(list.dv, comm, hint(world)),
                             foreach_all_gather(list.hv, comm, hint(world))));
  });
  EXPECT_EQ(fake_device_counters().host_waits, hosted.host_waits);
}

TEST_P(DevicePath, StartedOnAStream) {
  const int world = GetParam();
  run_ranks(world, [world](int rank, Communicator& comm) {
    const RankList list(rank);
    const std::vector<TensorView>& dv = list.dv;
    const std::vector<TensorView>& hv = list.hv;
    int stream_token = 0;
    const CudaStreamGuard on(&stream_token);
    Work<GatherResult> work = start_foreach_all_gather(dv, comm, hint(world));
    const GatherResult d = work.wait();
    const GatherResult h = foreach_all_gather(hv, comm, hint(world));
    EXPECT_TRUE(same_gathers(d, h));
  });
}

TEST_P(DevicePath, WithoutAHintEveryRankIsToldToPassOne) {
  const int world = GetParam();
  run_ranks(world, [](int rank, Communicator& comm) {
    const RankList list(rank);
    const std::vector<TensorView>& dv = list.dv;
    try {
      (void)foreach_all_gather(dv, comm);
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("needs shapes_across_group"), std::string::npos)
          << e.what();
    }
  });
}

// A stream over CUDA shards gathers every bucket into device memory (RL weight sync), and two
// begin()s reuse the buckets.
TEST_P(DevicePath, StreamBucketsOnTheDevice) {
  const int world = GetParam();
  run_ranks(world, [world](int rank, Communicator& comm) {
    std::vector<ShardSpec> specs;
    for (int i = 0; i < 6; ++i) {
      specs.push_back({.dtype = i % 2 == 0 ? DType::kFloat32 : DType::kBFloat16,
                       .full_shape = {3 + i, 2 * world + i},
                       .shard_dim = i % 2,
                       .sizes = {}});
    }
    std::vector<Pair> shards(specs.size());
    std::vector<TensorView> dv;
    std::vector<TensorView> hv;
    const UnshardPlan shapes(specs, world, rank);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const Shape s = shapes.shard_shape(rank, i);
      shards[i].make(specs[i].dtype, s, {}, static_cast<std::size_t>(s[0] * s[1]),
                     3 + 17 * i + static_cast<std::uint64_t>(rank));
      dv.push_back(shards[i].device_view);
      hv.push_back(shards[i].host_view);
    }
    const StreamOptions options{.bucket_bytes = 256, .prefetch = 1, .dst = -1};
    UnshardStream host(specs, world, rank, options);
    UnshardStream device(specs, world, rank, options);
    // Round 2 consumes on another stream than begin()'s: each bucket started into a buffer the
    // consumer handed back, and the end of the round (after which the buffers are reused or
    // given back), wait for the consumer's stream: one event record more per such bucket and
    // rank, and one at the end, than round 1, which consumes on begin()'s stream.
    int consumer_stream = 0;
    std::array<std::uint64_t, 3> records{};
    std::size_t buckets = 0;
    for (int round = 0; round < 3; ++round) {
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      const std::uint64_t before = fake_device_counters().event_records;
      host.begin(hv, comm);
      device.begin(dv, comm);
      buckets = 0;
      for (;;) {
        // Interleaved on one communicator: the two streams' operations alternate in order.
        const CudaStreamGuard on(round == 2 ? &consumer_stream : nullptr);
        std::optional<StreamBucket> d = device.next();
        std::optional<StreamBucket> h = host.next();
        ASSERT_EQ(d.has_value(), h.has_value());
        if (!d) {
          break;
        }
        ++buckets;
        ASSERT_EQ(d->full.size(), h->full.size());
        for (std::size_t j = 0; j < d->full.size(); ++j) {
          EXPECT_EQ(d->full[j].device, cuda_device(0));
          EXPECT_TRUE(same_bytes(d->full[j].data, h->full[j].data, bytes_of(h->full[j])))
              << "round " << round << " bucket " << d->index << " param " << j;
        }
      }
      EXPECT_GT(buckets, 1U);
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
      records[static_cast<std::size_t>(round)] = fake_device_counters().event_records - before;
      comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
    }
    const std::uint64_t handed_back = (buckets - 2 + 1) * static_cast<std::uint64_t>(world);
    EXPECT_EQ(records[2], records[1] + handed_back) << "rank " << rank;
  });
}

// A transport that moves host memory only (MPI here) refuses CUDA tensors on every rank, from
// the header, and stays usable.
TEST_P(DevicePath, AHostOnlyTransportRefusesOnEveryRank) {
  const int world = GetParam();
  run_ranks(world, [world](int rank, Communicator& inner) {
    testing::LimitedCommunicator comm(inner, Capabilities{});
    const RankList list(rank);
    const std::vector<TensorView>& dv = list.dv;
    const std::vector<TensorView>& hv = list.hv;
    try {
      (void)foreach_all_gather(dv, comm, hint(world));
      ADD_FAILURE() << "no error on rank " << rank;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("transport moves host memory only"), std::string::npos)
          << e.what();
    }
    const GatherResult h = foreach_all_gather(hv, comm, hint(world));
    EXPECT_EQ(h.size(), 3U);
  });
}

// A torch group's facts (NCCL: no gather-v, no scatter, device memory): the device path needs
// only all_gather_v_device from it.
TEST_P(DevicePath, AnNcclLikeTransportNeedsOnlyTheDeviceGather) {
  const int world = GetParam();
  run_ranks(world, [world](int rank, Communicator& inner) {
    testing::LimitedCommunicator comm(inner, {.reads_peer_memory = false,
                                              .small_messages_in_shared_memory = false,
                                              .gather_v = false,
                                              .scatter = false,
                                              .all_to_all = false,
                                              .device_memory = true});
    const RankList list(rank);
    const std::vector<TensorView>& dv = list.dv;
    const std::vector<TensorView>& hv = list.hv;
    const GatherResult d = foreach_all_gather(dv, comm, hint(world));
    const GatherResult h = foreach_all_gather(hv, comm, hint(world));
    EXPECT_TRUE(same_gathers(d, h));
  });
}

// The strategy layer tells the transport which collectives move an uneven device gather, the
// same on every rank: the rule (RankList's uneven streams pad more than 1/8: broadcasts), or the
// process's request (SHARDGATHER_DEVICE_GATHER, here set_device_gather); equal streams
// are one all-gather whatever was asked. Bytes as on the host every time.
TEST_P(DevicePath, TheTransportIsToldTheDeviceGathersForm) {
  const int world = GetParam();
  const Capabilities nccl_like{
      .gather_v = false, .scatter = false, .all_to_all = false, .device_memory = true};
  const auto run = [&](DeviceGather request, bool even, DeviceGatherForm want) {
    set_device_gather(request);
    run_ranks(world, [&](int rank, Communicator& inner) {
      testing::LimitedCommunicator comm(inner, nccl_like);
      const RankList list(even ? 0 : rank);
      const auto h =
          even ? std::vector<std::vector<Shape>>(static_cast<std::size_t>(world), hint(1)[0])
               : hint(world);
      const GatherResult d = foreach_all_gather(list.dv, comm, h);
      EXPECT_TRUE(same_gathers(d, foreach_all_gather(list.hv, comm, h))) << "rank " << rank;
      const std::vector<DeviceGatherForm> forms(world == 1 ? 0 : 1, want);
      EXPECT_EQ(comm.device_forms, forms)
          << "rank " << rank << " asked " << device_gather_name(request);
    });
  };
  run(DeviceGather::kAuto, false, DeviceGatherForm::kBroadcast);
  run(DeviceGather::kPadded, false, DeviceGatherForm::kPadded);
  run(DeviceGather::kBroadcast, false, DeviceGatherForm::kBroadcast);
  run(DeviceGather::kAuto, true, DeviceGatherForm::kPadded);
  run(DeviceGather::kBroadcast, true, DeviceGatherForm::kPadded);
  set_device_gather(DeviceGather::kAuto);
}

// An unknown value of a device setting's variable fails every device call on every rank,
// naming the value, and leaves host calls alone. The variables are read once per process: ctest
// runs these tests in processes of their own with them set (device_gather_unknown_request,
// device_wait_unknown_mode); elsewhere they skip.
void expect_unknown_value_fails_device_calls(const char* variable, const char* value) {
  const char* env = std::getenv(variable);
  if (env == nullptr || std::string(env) != value) {
    GTEST_SKIP() << "runs with " << variable << "=" << value << " (ctest)";
  }
  const std::string named = std::string(variable) + "=" + value;
  run_ranks(2, [&named](int rank, Communicator& comm) {
    const RankList list(rank);
    try {
      (void)foreach_all_gather(list.dv, comm, hint(2));
      ADD_FAILURE() << "no error on rank " << rank;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
    EXPECT_EQ(foreach_all_gather(list.hv, comm, hint(2)).size(), 3U);
  });
}

TEST(DeviceGatherRequest, AnUnknownValueFailsEveryDeviceCall) {
  expect_unknown_value_fails_device_calls("SHARDGATHER_DEVICE_GATHER", "pipelined");
}

TEST(DeviceWaitMode, AnUnknownValueFailsEveryDeviceCall) {
  expect_unknown_value_fails_device_calls("SHARDGATHER_DEVICE_WAIT", "spin");
  if (!::testing::Test::IsSkipped()) {
    EXPECT_THROW((void)device_wait(), InvalidArgument);
  }
}

TEST(DeviceWaitMode, NamesRoundTrip) {
  for (const DeviceWait mode : {DeviceWait::kStream, DeviceWait::kHost}) {
    EXPECT_EQ(parse_device_wait(device_wait_name(mode)), mode);
  }
  EXPECT_THROW((void)parse_device_wait("blocking"), InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Worlds, DevicePath, ::testing::Values(1, 2, 3, 4),
                         [](const auto& p) { return "w" + std::to_string(p.param); });

}  // namespace
}  // namespace shardgather
