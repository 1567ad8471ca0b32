#include "shardgather/copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

namespace shardgather {
namespace {

std::vector<std::int32_t> packed(const TensorView& view, std::size_t numel) {
  std::vector<std::int32_t> out(numel, -1);
  pack(view, reinterpret_cast<std::byte*>(out.data()));
  return out;
}

TEST(IsContiguous, IgnoresSizeOneAndEmptyDims) {
  EXPECT_TRUE(is_contiguous({nullptr, DType::kFloat32, {2, 3}, {}}));
  EXPECT_TRUE(is_contiguous({nullptr, DType::kFloat32, {2, 3}, {3, 1}}));
  EXPECT_TRUE(is_contiguous({nullptr, DType::kFloat32, {2, 1}, {1, 99}}));
  EXPECT_TRUE(is_contiguous({nullptr, DType::kFloat32, {0, 3}, {7, 7}}));
  EXPECT_FALSE(is_contiguous({nullptr, DType::kFloat32, {2, 3}, {1, 2}}));
  EXPECT_FALSE(is_contiguous({nullptr, DType::kFloat32, {4}, {2}}));
  EXPECT_FALSE(is_contiguous({nullptr, DType::kFloat32, {6, 1}, {2, 1}}));  // a column
}

TEST(OverlapsItself, SlicesTransposesAndNarrowsDoNot) {
  EXPECT_FALSE(overlaps_itself({nullptr, DType::kFloat32, {2, 3}, {}}));
  EXPECT_FALSE(overlaps_itself({nullptr, DType::kFloat32, {2, 3}, {3, 1}}));
  EXPECT_FALSE(overlaps_itself({nullptr, DType::kFloat32, {2, 3}, {1, 2}}));  // transposed
  EXPECT_FALSE(overlaps_itself({nullptr, DType::kFloat32, {4, 2}, {8, 1}}));  // a column block
  EXPECT_FALSE(overlaps_itself({nullptr, DType::kFloat32, {4}, {-3}}));       // negative
  EXPECT_FALSE(overlaps_itself({nullptr, DType::kFloat32, {5, 1}, {1, 0}}));  // size-1 dim
  EXPECT_FALSE(overlaps_itself({nullptr, DType::kFloat32, {0, 4}, {0, 0}}));  // empty
  EXPECT_FALSE(overlaps_itself({nullptr, DType::kFloat32, {}, {}}));          // 0-d
  // Interleaved but apart: offsets {0, 2, 4} + {0, 3}: no order proves it, the count does.
  EXPECT_FALSE(overlaps_itself({nullptr, DType::kFloat32, {3, 2}, {2, 3}}));
}

TEST(OverlapsItself, ViewsThatWriteOneElementTwiceDo) {
  EXPECT_TRUE(overlaps_itself({nullptr, DType::kFloat32, {4, 5}, {0, 1}}));  // expanded rows
  EXPECT_TRUE(overlaps_itself({nullptr, DType::kFloat32, {4, 4}, {1, 1}}));  // as_strided
  EXPECT_TRUE(overlaps_itself({nullptr, DType::kFloat32, {3, 4}, {2, 1}}));  // rows overlap
  EXPECT_TRUE(overlaps_itself({nullptr, DType::kFloat32, {2, 3}, {3, -3}}));
  EXPECT_TRUE(overlaps_itself({nullptr, DType::kFloat32, {3, 2}, {2, 4}}));  // {0,2,4}+{0,4}
  // Too large to enumerate and not ordered apart: counted as overlapping (documented).
  EXPECT_TRUE(overlaps_itself({nullptr, DType::kFloat32, {1 << 11, 1 << 11}, {2, 3}}));
  EXPECT_TRUE(overlaps_itself({nullptr, DType::kFloat32, {3, 3}, {INT64_MAX, INT64_MAX}}));
}

// Against counting distinct offsets, over random small views of 1-4 dims.
TEST(OverlapsItself, AgreesWithBruteForce) {
  std::mt19937 rng(7);
  int overlapping = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const int ndim = 1 + static_cast<int>(rng() % 4);
    Shape shape, strides;
    std::int64_t numel = 1;
    for (int d = 0; d < ndim; ++d) {
      shape.push_back(static_cast<std::int64_t>(rng() % 5));
      strides.push_back(static_cast<std::int64_t>(rng() % 13) - 6);
      numel *= shape.back();
    }
    std::set<std::int64_t> offsets;
    std::vector<std::int64_t> idx(static_cast<std::size_t>(ndim), 0);
    for (std::int64_t k = 0; k < numel; ++k) {
      std::int64_t at = 0;
      for (int d = 0; d < ndim; ++d) {
        at += idx[static_cast<std::size_t>(d)] * strides[static_cast<std::size_t>(d)];
      }
      offsets.insert(at);
      for (int d = ndim - 1; d >= 0; --d) {
        auto& i = idx[static_cast<std::size_t>(d)];
        if (++i < shape[static_cast<std::size_t>(d)]) {
          break;
        }
        i = 0;
      }
    }
    const bool want = static_cast<std::int64_t>(offsets.size()) != numel;
    overlapping += want ? 1 : 0;
    EXPECT_EQ(overlaps_itself({nullptr, DType::kFloat32, shape, strides}), want)
        << "trial " << trial;
  }
  EXPECT_GT(overlapping, 400);  // both kinds are common
}

TEST(Pack, Transposed) {
  std::vector<std::int32_t> storage(6);
  std::iota(storage.begin(), storage.end(), 0);  // column-major 2x3: [[0,2,4],[1,3,5]]
  const TensorView view{storage.data(), DType::kInt32, {2, 3}, {1, 2}};
  EXPECT_EQ(packed(view, 6), (std::vector<std::int32_t>{0, 2, 4, 1, 3, 5}));
}

TEST(Pack, EveryOtherNegativeAndZeroStrides) {
  std::vector<std::int32_t> storage(8);
  std::iota(storage.begin(), storage.end(), 0);
  EXPECT_EQ(packed({storage.data(), DType::kInt32, {4}, {2}}, 4),
            (std::vector<std::int32_t>{0, 2, 4, 6}));
  EXPECT_EQ(packed({storage.data() + 7, DType::kInt32, {3}, {-1}}, 3),
            (std::vector<std::int32_t>{7, 6, 5}));
  EXPECT_EQ(packed({storage.data() + 1, DType::kInt32, {2, 3}, {4, 0}}, 6),
            (std::vector<std::int32_t>{1, 1, 1, 5, 5, 5}));
}

TEST(Pack, ZeroDimAndEmpty) {
  std::int32_t scalar = 42;
  EXPECT_EQ(packed({&scalar, DType::kInt32, {}, {}}, 1), (std::vector<std::int32_t>{42}));
  EXPECT_EQ(packed({nullptr, DType::kInt32, {3, 0}, {0, 1}}, 0), std::vector<std::int32_t>{});
}

TEST(Pack, ThreeDimsInnerStrided) {
  std::vector<std::int32_t> storage(2 * 3 * 4);
  std::iota(storage.begin(), storage.end(), 0);
  // [2, 3, 2] over a [2, 3, 4] buffer, every other element of the last dim
  const TensorView view{storage.data(), DType::kInt32, {2, 3, 2}, {12, 4, 2}};
  EXPECT_EQ(packed(view, 12),
            (std::vector<std::int32_t>{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22}));
}

TEST(CopySegments, ConcatenatesAndSkipsEmpty) {
  const std::byte a[] = {std::byte{1}, std::byte{2}};
  const std::byte b[] = {std::byte{3}};
  const ConstSegment segments[] = {{a, 2}, {nullptr, 0}, {b, 1}};
  std::byte out[3] = {};
  copy_segments(segments, out);
  EXPECT_EQ(out[0], std::byte{1});
  EXPECT_EQ(out[2], std::byte{3});
}

}  // namespace
}  // namespace shardgather
