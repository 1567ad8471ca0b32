// The device half of the one validated entry path, on the host: a call's tensors are on one
// device, a CUDA view must really be device memory (a host pointer would fault the kernel), a
// transport that moves host memory only refuses CUDA tensors, and two ranks on different kinds
// of memory disagree in the header. Every case raises on every rank, and the communicator stays
// usable. (On a machine without a GPU every CUDA view is over host memory, which is the point.)
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ops/preflight.h"
#include "strategies/strategy.h"
#include "support/testing.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

using testing::run_ranks;

using testing::outcome;

const std::vector<std::vector<Shape>> kHint{{{4}, {3}}, {{4}, {3}}};

std::vector<TensorView> views(std::vector<float>& a, std::vector<float>& b) {
  return {TensorView{a.data(), DType::kFloat32, {4}, {}},
          TensorView{b.data(), DType::kFloat32, {3}, {}}};
}

TEST(DeviceChecks, HostMemoryPassedAsCudaFailsOnEveryRank) {
  run_ranks(
      2,
      [](int rank, Communicator& comm) {
        std::vector<float> a(4, 1.0F);
        std::vector<float> b(3, 2.0F);
        std::vector<TensorView> v = views(a, b);
        if (rank == 1) {
          v[0].device = cuda_device(0);
          v[1].device = cuda_device(0);
        }
        const auto [cls, what] = outcome([&] { (void)foreach_all_gather(v, comm, kHint); });
        EXPECT_EQ(cls, "InvalidArgument") << what;
        EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
        EXPECT_NE(what.find("tensor 0"), std::string::npos) << what;
        // A CUDA build checks where the memory is; a build without CUDA refuses CUDA outright.
        EXPECT_NE(what.find(cuda_built() ? "its memory is on cpu" : "built without CUDA"),
                  std::string::npos)
            << what;
        // Still usable: a host call after it works.
        const std::vector<TensorView> host = views(a, b);
        const GatherResult out = foreach_all_gather(host, comm, kHint);
        EXPECT_EQ(static_cast<const float*>(out[0][1].data)[0], 1.0F);
      },
      "device");
}

TEST(DeviceChecks, OneCallsTensorsAreOnOneDevice) {
  run_ranks(
      2,
      [](int rank, Communicator& comm) {
        std::vector<float> a(4, 1.0F);
        std::vector<float> b(3, 2.0F);
        std::vector<TensorView> v = views(a, b);
        if (rank == 0) {
          v[1].device = cuda_device(1);
        }
        const auto [cls, what] = outcome([&] { (void)foreach_all_gather(v, comm); });
        EXPECT_EQ(cls, "InvalidArgument") << what;
        EXPECT_NE(what.find("tensor 1: on cuda:1, but the call's first is on cpu"),
                  std::string::npos)
            << what;
      },
      "device");
}

TEST(DeviceChecks, UnshardOutputsOnAnotherDeviceThanTheShards) {
  run_ranks(
      2,
      [](int /*rank*/, Communicator& comm) {
        const std::vector<ShardSpec> specs{
            ShardSpec{.dtype = DType::kFloat32, .full_shape = {4, 2}, .shard_dim = 0, .sizes = {}}};
        UnshardPlan p(specs, 2, comm.rank());
        std::vector<float> shard(4, 1.0F);
        std::vector<float> full(8, 0.0F);
        const std::vector<TensorView> shards{TensorView{shard.data(), DType::kFloat32, {2, 2}, {}}};
        std::vector<TensorView> outputs{TensorView{full.data(), DType::kFloat32, {4, 2}, {}}};
        outputs[0].device = cuda_device(0);
        const auto [cls, what] = outcome([&] { (void)p.execute(shards, comm, outputs); });
        EXPECT_EQ(cls, "InvalidArgument") << what;
        EXPECT_NE(what.find("cuda:0"), std::string::npos) << what;
      },
      "device");
}

TEST(DeviceChecks, HeadersOnDifferentKindsOfMemoryDisagree) {
  std::vector<detail::PreflightHeader> sent(2);
  for (auto& h : sent) {
    h.world_size = 2;
  }
  detail::set_device_type(sent[1], DeviceType::kCuda);
  std::vector<std::byte> gathered(sizeof(detail::PreflightHeader) * 2);
  std::memcpy(gathered.data(), sent.data(), gathered.size());
  std::vector<detail::PreflightHeader> decoded(2);
  try {
    detail::check_headers(gathered, decoded, 0);
    ADD_FAILURE() << "no error";
  } catch (const Mismatch& e) {
    EXPECT_NE(std::string(e.what()).find("device differs: rank 0 gathers cpu tensors, rank 1 cuda"),
              std::string::npos)
        << e.what();
  }
  // An unknown device code is a corrupt header, not a device.
  sent[1].flags |= 0x7fU << detail::kDeviceShift;
  std::memcpy(gathered.data(), sent.data(), gathered.size());
  EXPECT_THROW(detail::check_headers(gathered, decoded, 0), Mismatch);
}

// SHARDGATHER_DEVICE_GATHER travels in a device call's header: ranks asking for different forms
// would pair one rank's broadcasts with another's all-gather, so they disagree before a byte
// moves, naming both requests.
TEST(DeviceChecks, HeadersAskingForDifferentDeviceGathersDisagree) {
  std::vector<detail::PreflightHeader> sent(3);
  for (auto& h : sent) {
    h.world_size = 3;
    detail::set_device_type(h, DeviceType::kCuda);
  }
  detail::set_device_gather_request(sent[2], DeviceGather::kBroadcast);
  std::vector<std::byte> gathered(sizeof(detail::PreflightHeader) * 3);
  std::memcpy(gathered.data(), sent.data(), gathered.size());
  std::vector<detail::PreflightHeader> decoded(3);
  const auto [cls, what] = outcome([&] { detail::check_headers(gathered, decoded, 1); });
  EXPECT_EQ(cls, "Mismatch") << what;
  EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
  EXPECT_NE(what.find("device gather differs: rank 0 asks for auto, rank 2 for broadcast"),
            std::string::npos)
      << what;
  // Alike on every rank: agreed, and each header keeps its request.
  detail::set_device_gather_request(sent[0], DeviceGather::kBroadcast);
  detail::set_device_gather_request(sent[1], DeviceGather::kBroadcast);
  std::memcpy(gathered.data(), sent.data(), gathered.size());
  detail::check_headers(gathered, decoded, 1);
  EXPECT_EQ(detail::device_gather_request_of(decoded[1]), DeviceGather::kBroadcast);
  // An unknown request is a corrupt header.
  sent[2].flags |= 0x7fU << detail::kDeviceGatherShift;
  std::memcpy(gathered.data(), sent.data(), gathered.size());
  const auto [cls2, what2] = outcome([&] { detail::check_headers(gathered, decoded, 1); });
  EXPECT_EQ(cls2, "Mismatch") << what2;
  EXPECT_NE(what2.find("corrupt pre-flight header from rank 2: unknown device gather request"),
            std::string::npos)
      << what2;
}

// The rule, on counts every rank shares: equal counts are one all-gather whatever was asked;
// otherwise a request forces its form, and kAuto pads only where padding adds at most 1/8.
TEST(DeviceChecks, TheDeviceGatherFormFollowsTheCountsAndTheRequest) {
  using detail::device_gather_form;

  const std::vector<std::uint64_t> even{64, 64, 64};
  const std::vector<std::uint64_t> slightly{64, 64, 56};  // padding 8 of 184: 8 * 8 <= 184
  const std::vector<std::uint64_t> skewed{64, 0, 8};      // padding 120 of 72
  const std::vector<std::uint64_t> edge{8, 7, 7, 7, 7, 7, 7, 7, 7};  // padding 8 of 64: 8 * 8 = 64
  for (const DeviceGather r :
       {DeviceGather::kAuto, DeviceGather::kPadded, DeviceGather::kBroadcast}) {
    EXPECT_EQ(device_gather_form(even, r), DeviceGatherForm::kPadded);
  }
  EXPECT_EQ(device_gather_form(slightly, DeviceGather::kAuto), DeviceGatherForm::kPadded);
  EXPECT_EQ(device_gather_form(edge, DeviceGather::kAuto), DeviceGatherForm::kPadded);
  EXPECT_EQ(device_gather_form(skewed, DeviceGather::kAuto), DeviceGatherForm::kBroadcast);
  EXPECT_EQ(device_gather_form(skewed, DeviceGather::kPadded), DeviceGatherForm::kPadded);
  EXPECT_EQ(device_gather_form(slightly, DeviceGather::kBroadcast), DeviceGatherForm::kBroadcast);
  const std::vector<std::uint64_t> past_edge{9, 7, 7, 7, 7, 7, 7, 7, 7};  // padding 16 of 65
  EXPECT_EQ(device_gather_form(past_edge, DeviceGather::kAuto), DeviceGatherForm::kBroadcast);
}

TEST(DeviceChecks, AnAdoptedBufferIsGivenBackItsOwnWay) {
  static int released = 0;
  released = 0;
  static std::byte storage[16];
  {
    const DeviceAllocation memory{.data = storage,
                                  .release =
                                      [](std::byte* p, void* context) noexcept {
                                        released += p == storage && context == &released ? 1 : 100;
                                      },
                                  .context = &released};
    const AlignedBuffer buffer(memory, sizeof storage, cuda_device(0));
    EXPECT_EQ(buffer.device(), cuda_device(0));
    EXPECT_EQ(buffer.size(), 16U);
  }
  EXPECT_EQ(released, 1);
  EXPECT_EQ(device_name(cuda_device(3)), "cuda:3");
  EXPECT_EQ(device_name(kCpu), "cpu");
}

TEST(DeviceChecks, TheStreamGuardRestoresThePreviousStream) {
  // start_on captures the current stream and runs the job under this guard.
  int a = 0;
  int b = 0;
  EXPECT_EQ(current_cuda_stream(), nullptr);
  {
    const CudaStreamGuard outer(&a);
    EXPECT_EQ(current_cuda_stream(), &a);
    {
      const CudaStreamGuard inner(&b);
      EXPECT_EQ(current_cuda_stream(), &b);
    }
    EXPECT_EQ(current_cuda_stream(), &a);
  }
  EXPECT_EQ(current_cuda_stream(), nullptr);
}

}  // namespace
}  // namespace shardgather
