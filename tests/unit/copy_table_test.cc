// The fused copy kernel's descriptor tables (src/copies/copy_table.h), checked on the host: a
// table is built from the same views and streams the host copies take, run block by block and
// thread by thread as the kernel partitions it (run_on_host), and compared byte for byte with
// pack() and copy_stream(). The CUDA kernel shares unit_address and find_desc with run_on_host,
// so what these tests pass is the index arithmetic the GPU runs.
#include "copies/copy_table.h"

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "shardgather/copy.h"

namespace shardgather::detail {
namespace {

std::vector<std::byte> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) {
    b = static_cast<std::byte>(rng());
  }
  return v;
}

std::int64_t numel(const Shape& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

// A random view into `storage` with `ndim` dims: a permuted, sliced, sometimes negative or
// broadcast layout; returns the view and how many bytes of storage it may reach.
struct RandomView {
  TensorView view;
  std::vector<std::byte> storage;
};

RandomView random_view(std::mt19937& rng, int ndim) {
  const DType dtypes[] = {DType::kUInt8, DType::kFloat16, DType::kFloat32, DType::kFloat64};
  const DType dtype = dtypes[rng() % 4];
  const auto elem = static_cast<std::int64_t>(dtype_size(dtype));
  Shape shape(static_cast<std::size_t>(ndim));
  for (auto& e : shape) {
    e = 1 + static_cast<std::int64_t>(rng() % 5);
  }
  // Strides of a bigger row-major tensor (so slices leave gaps), in a random order of dims.
  Shape strides(shape.size());
  std::vector<std::size_t> order(shape.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::int64_t step = 1 + static_cast<std::int64_t>(rng() % 2);
  for (const std::size_t d : order) {
    strides[d] = step;
    step *= shape[d] + static_cast<std::int64_t>(rng() % 2);
  }
  std::int64_t reach = 1;
  std::int64_t offset = static_cast<std::int64_t>(rng() % 3);
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (rng() % 7 == 0) {
      strides[d] = 0;  // broadcast
    } else if (rng() % 5 == 0) {
      strides[d] = -strides[d];
      offset += -strides[d] * (shape[d] - 1);
    }
    reach += std::abs(strides[d]) * (shape[d] - 1);
  }
  RandomView out;
  out.storage =
      pattern(static_cast<std::size_t>((offset + reach) * elem), static_cast<std::uint32_t>(rng()));
  out.view = TensorView{out.storage.data() + offset * elem, dtype, shape, strides};
  return out;
}

TEST(CopyTable, PackMatchesHostPackOnRandomStridedViews) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    RandomView in = random_view(rng, 1 + trial % 7);
    const auto bytes = static_cast<std::size_t>(numel(in.view.shape)) * dtype_size(in.view.dtype);
    std::vector<std::byte> want(bytes);
    std::vector<std::byte> got(bytes);
    pack(in.view, want.data());
    CopyTable table;
    table.add_pack(in.view, got.data());
    table.finish();
    EXPECT_EQ(table.bytes(), bytes);
    run_on_host(table);
    ASSERT_EQ(got, want) << "trial " << trial;
  }
}

TEST(CopyTable, ContiguousViewIsOneVectorisedDescriptor) {
  alignas(16) static std::byte src[4096];
  alignas(16) static std::byte dst[4096];
  CopyTable table;
  table.add_pack(TensorView{src, DType::kFloat32, {32, 32}, {}}, dst);
  table.finish();
  ASSERT_EQ(table.descs().size(), 1U);
  EXPECT_EQ(table.descs()[0].ndim, 0U);
  EXPECT_EQ(table.descs()[0].width, 16U);
  EXPECT_EQ(table.blocks(), 1U);  // 256 units of 16 bytes
  // One byte off on either side: the widest unit both addresses allow.
  table.clear();
  table.add_bytes(src + 1, dst, 64);
  table.add_bytes(src + 130, dst + 258, 64);
  table.finish();
  ASSERT_EQ(table.descs().size(), 2U);
  EXPECT_EQ(table.descs()[0].width, 1U);
  EXPECT_EQ(table.descs()[1].width, 2U);
}

TEST(CopyTable, TransposedViewIsOneStridedDescriptorOfElements) {
  std::vector<std::byte> src = pattern(6 * 4 * 4, 3);
  std::vector<std::byte> want(src.size());
  std::vector<std::byte> got(src.size());
  const TensorView t{src.data(), DType::kFloat32, {4, 6}, {1, 4}};  // a transpose
  pack(t, want.data());
  CopyTable table;
  table.add_pack(t, got.data());
  table.finish();
  ASSERT_EQ(table.descs().size(), 1U);
  EXPECT_EQ(table.descs()[0].ndim, 2U);
  EXPECT_EQ(table.descs()[0].run, 4U);
  run_on_host(table);
  EXPECT_EQ(got, want);
}

TEST(CopyTable, MoreDimsThanADescriptorHoldsSplitTheOutermost) {
  // Seven dims of extent 2, every one strided by 2: nothing merges, and each element is a run
  // of its own, so seven outer dims.
  Shape shape(7, 2);
  Shape strides(7);
  std::int64_t step = 2;
  for (std::size_t d = 7; d-- > 0;) {
    strides[d] = step;
    step *= 4;
  }
  std::vector<std::byte> src = pattern(static_cast<std::size_t>(step), 5);
  const TensorView t{src.data(), DType::kUInt8, shape, strides};
  std::vector<std::byte> want(128);
  std::vector<std::byte> got(128);
  pack(t, want.data());
  CopyTable table;
  table.add_pack(t, got.data());
  table.finish();
  EXPECT_EQ(table.descs().size(), 8U);  // 2 x 2 x 2 outermost indices, 4 dims each
  run_on_host(table);
  EXPECT_EQ(got, want);
}

// Random segment lists and strided pieces of the same total: add_stream against copy_stream.
TEST(CopyTable, StreamMatchesCopyStream) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<RecvPiece> pieces;
    std::vector<std::byte> want(1 << 14);
    std::vector<std::byte> got(want.size());
    std::uint64_t at = 0;
    std::uint64_t total = 0;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int p = 0; p < n; ++p) {
      const std::uint64_t block = rng() % 9 == 0 ? 0 : 1 + rng() % 40;
      const std::uint64_t count = 1 + rng() % 6;
      const std::uint64_t stride = block + rng() % 3 * (rng() % 8);
      at += rng() % 4;
      pieces.push_back(RecvPiece{nullptr, block, count, stride});
      pieces.back().data = reinterpret_cast<std::byte*>(at);  // an offset for now
      at += stride * count + block;
      total += block * count;
    }
    ASSERT_LT(at, want.size());
    std::vector<RecvPiece> to_want = pieces;
    std::vector<RecvPiece> to_got = pieces;
    for (std::size_t p = 0; p < pieces.size(); ++p) {
      const auto offset = reinterpret_cast<std::uintptr_t>(pieces[p].data);
      to_want[p].data = want.data() + offset;
      to_got[p].data = got.data() + offset;
    }
    const std::vector<std::byte> source = pattern(total, static_cast<std::uint32_t>(rng()));
    std::vector<ConstSegment> segments;
    for (std::uint64_t s = 0; s < total;) {
      const std::uint64_t size =
          std::min<std::uint64_t>(total - s, rng() % 3 == 0 ? 0 : 1 + rng() % 90);
      segments.push_back(ConstSegment{source.data() + s, size});
      s += size;
    }
    copy_stream(segments, to_want);
    CopyTable table;
    table.add_stream(segments, to_got);
    table.finish();
    EXPECT_EQ(table.bytes(), total);
    run_on_host(table);
    ASSERT_EQ(got, want) << "trial " << trial;
  }
}

// The copy-out of an unshard: rank r's shard of a [6, 10, 8] f32 tensor sharded along `dim`
// lands as strided blocks of the full tensor; whole blocks from one segment are one descriptor.
TEST(CopyTable, UnshardCopyOutAlongEveryDim) {
  const Shape full{6, 10, 8};
  for (std::size_t dim = 0; dim < 3; ++dim) {
    const std::uint64_t world = 2;
    const auto elem = sizeof(float);
    std::uint64_t outer = 1;
    std::uint64_t inner = elem;
    for (std::size_t d = 0; d < dim; ++d) {
      outer *= static_cast<std::uint64_t>(full[d]);
    }
    for (std::size_t d = dim + 1; d < 3; ++d) {
      inner *= static_cast<std::uint64_t>(full[d]);
    }
    const std::uint64_t shard_extent = static_cast<std::uint64_t>(full[dim]) / world;
    const std::uint64_t block = shard_extent * inner;
    const std::uint64_t row = static_cast<std::uint64_t>(full[dim]) * inner;
    const std::vector<std::byte> gathered = pattern(outer * row, static_cast<std::uint32_t>(dim));
    std::vector<std::byte> want(outer * row);
    std::vector<std::byte> got(outer * row);
    std::vector<ConstSegment> send;
    std::vector<RecvPiece> to_want;
    std::vector<RecvPiece> to_got;
    for (std::uint64_t r = 0; r < world; ++r) {
      send.push_back({gathered.data() + r * outer * block, outer * block});
      to_want.push_back({want.data() + r * block, block, outer, row});
      to_got.push_back({got.data() + r * block, block, outer, row});
    }
    copy_stream(send, to_want);
    CopyTable table;
    table.add_stream(send, to_got);
    table.finish();
    EXPECT_EQ(table.descs().size(), dim == 0 ? 1U : 2U) << "dim " << dim;
    run_on_host(table);
    EXPECT_EQ(got, want) << "dim " << dim;
  }
}

// tiny-1000: a thousand small tensors are a thousand descriptors of one launch, each its own
// block, and every block finds its descriptor.
TEST(CopyTable, ManySmallTensorsAreOneLaunch) {
  std::vector<std::vector<std::byte>> tensors;
  std::vector<std::byte> want;
  for (int i = 0; i < 1000; ++i) {
    tensors.push_back(
        pattern(4 + static_cast<std::size_t>(i % 13) * 4, static_cast<std::uint32_t>(i)));
    want.resize((want.size() + 15) / 16 * 16 + 16);  // a gap keeps the copies apart
    want.insert(want.end(), tensors.back().begin(), tensors.back().end());
  }
  std::vector<std::byte> got(want.size());
  CopyTable table;
  std::size_t at = 0;
  for (const auto& t : tensors) {
    at = (at + 15) / 16 * 16 + 16;
    table.add_bytes(t.data(), got.data() + at, t.size());
    std::copy(t.begin(), t.end(), want.begin() + static_cast<std::ptrdiff_t>(at));
    at += t.size();
  }
  table.finish();
  EXPECT_EQ(table.descs().size(), 1000U);
  EXPECT_EQ(table.blocks(), 1000U);
  run_on_host(table);
  for (std::size_t b = 0; b < table.blocks(); ++b) {
    EXPECT_EQ(find_desc(table.descs().data(), table.descs().size(), b), b);
  }
  EXPECT_EQ(got, want);
}

TEST(CopyTable, LargeCopySpansManyBlocksOfOneDescriptor) {
  const std::vector<std::byte> src = pattern(1 << 20, 9);
  std::vector<std::byte> got(src.size() + 16);
  CopyTable table;
  table.add_bytes(src.data(), got.data() + 16, src.size());
  table.finish();
  ASSERT_EQ(table.descs().size(), 1U);
  const std::uint64_t units = (1U << 20) / table.descs()[0].width;
  EXPECT_EQ(table.blocks(), (units + kCopyUnitsPerBlock - 1) / kCopyUnitsPerBlock);
  run_on_host(table);
  EXPECT_TRUE(std::equal(src.begin(), src.end(), got.begin() + 16));
}

}  // namespace
}  // namespace shardgather::detail
