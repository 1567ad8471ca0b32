#include "shardgather/layout.h"

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "shardgather/errors.h"

namespace shardgather {
namespace {

TEST(CheckedNbytes, CountsElementsTimesSize) {
  EXPECT_EQ(checked_nbytes(DType::kFloat32, Shape{3, 5}), 60U);
  EXPECT_EQ(checked_nbytes(DType::kBFloat16, Shape{}), 2U);  // 0-d: one element
  EXPECT_EQ(checked_nbytes(DType::kFloat64, Shape{4, 0}), 0U);
}

TEST(CheckedNbytes, ZeroDimWinsOverHugeDims) {
  EXPECT_EQ(checked_nbytes(DType::kFloat32, Shape{std::int64_t{1} << 40, std::int64_t{1} << 40, 0}),
            0U);
}

TEST(CheckedNbytes, OverflowIsCountOverflow) {
  // B10: [2^32, 2^32] f32 needs 2^66 bytes.
  EXPECT_THROW(checked_nbytes(DType::kFloat32, Shape{std::int64_t{1} << 32, std::int64_t{1} << 32}),
               CountOverflow);
}

TEST(CheckedNbytes, RejectsNegativeDimsAndBadDtypes) {
  EXPECT_THROW(checked_nbytes(DType::kFloat32, Shape{3, -1}), InvalidArgument);
  EXPECT_THROW(checked_nbytes(static_cast<DType>(200), Shape{3}), InvalidArgument);
}

TEST(CheckedNbytes, LargeCountsDoNotNarrow) {
  // X1: element counts around 2^31 and 2^32 keep every bit.
  for (const std::int64_t n :
       {(std::int64_t{1} << 31) - 1, std::int64_t{1} << 31, (std::int64_t{1} << 31) + 1,
        (std::int64_t{1} << 32) + 5, std::int64_t{1} << 40}) {
    EXPECT_EQ(checked_nbytes(DType::kFloat64, Shape{n}), static_cast<std::uint64_t>(n) * 8);
  }
}

// The worked example of docs/layout.md.
TEST(PlanLayout, WorkedExample) {
  const std::vector<DType> dtypes = {DType::kInt8, DType::kFloat32, DType::kFloat16};
  const std::vector<Shape> shapes = {{3}, {2}, {1},   // rank 0
                                     {1}, {0}, {5}};  // rank 1
  const LayoutPlan plan = plan_layout(dtypes, shapes, 2);
  EXPECT_EQ(plan.alignment, 4U);
  // rank 0: i8 at 0 (3 B), f32 at 4 (8 B), f16 at 12 (2 B) -> 14 B
  // rank 1 starts at 16: i8 at 16 (1 B), f32 empty at 17, f16 at 18 (10 B) -> 12 B
  EXPECT_EQ(plan.counts, (std::vector<std::uint64_t>{14, 12}));
  EXPECT_EQ(plan.displs, (std::vector<std::uint64_t>{0, 16}));
  EXPECT_EQ(plan.offsets, (std::vector<std::uint64_t>{0, 4, 12, 16, 17, 18}));
  EXPECT_EQ(plan.sizes, (std::vector<std::uint64_t>{3, 8, 2, 1, 0, 10}));
  EXPECT_EQ(plan.total_bytes, 28U);
}

TEST(PlanLayout, RecordsPrefixEveryBlock) {
  const std::vector<DType> dtypes = {DType::kFloat32};
  const std::vector<Shape> shapes = {{2, 3}, {1, 3}};
  const LayoutPlan plan = plan_layout(dtypes, shapes, 2, {.with_records = true});
  // records: ndim + 2 dims = 24 B, then 24 B / 12 B of data
  EXPECT_EQ(plan.counts, (std::vector<std::uint64_t>{48, 36}));
  EXPECT_EQ(plan.displs, (std::vector<std::uint64_t>{0, 48}));
  EXPECT_EQ(plan.offsets, (std::vector<std::uint64_t>{24, 72}));
}

TEST(PlanLayout, RejectsBadArguments) {
  const std::vector<DType> dtypes = {DType::kFloat32};
  const std::vector<Shape> shapes = {{2}};
  EXPECT_THROW(plan_layout(dtypes, shapes, 0), InvalidArgument);
  EXPECT_THROW(plan_layout(dtypes, shapes, 2), InvalidArgument);  // one shape for 2 ranks
}

TEST(PlanLayout, SumAcrossRanksOverflowIsCountOverflow) {
  // B11: each rank fits in 64 bits, the gathered total does not.
  const std::vector<DType> dtypes = {DType::kUInt8};
  const std::int64_t big = std::int64_t{1} << 62;
  const std::vector<Shape> shapes = {{big}, {big}, {big}, {big}};
  EXPECT_THROW(plan_layout(dtypes, shapes, 4), CountOverflow);
}

TEST(PlanLayout, OffsetsPastTwoToThe32KeepEveryBit) {
  // X6-style: three tensors whose sum crosses 2^31 elements, each below it.
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32, DType::kFloat32};
  const std::int64_t n = (std::int64_t{1} << 30) + 3;
  const std::vector<Shape> shapes = {{n}, {n}, {n}, {n}, {n}, {n}};
  const LayoutPlan plan = plan_layout(dtypes, shapes, 2);
  const std::uint64_t t = static_cast<std::uint64_t>(n) * 4;
  EXPECT_EQ(plan.offsets[5], 5 * t);
  EXPECT_EQ(plan.total_bytes, 6 * t);
}

class PlanLayoutWorld : public ::testing::TestWithParam<int> {};

TEST_P(PlanLayoutWorld, BlocksAreOrderedAlignedAndDisjoint) {
  const int world = GetParam();
  const std::vector<DType> dtypes = {DType::kUInt8, DType::kFloat64, DType::kInt16, DType::kFloat32,
                                     DType::kBool};
  std::vector<Shape> shapes;
  for (int r = 0; r < world; ++r) {
    for (std::size_t i = 0; i < dtypes.size(); ++i) {
      shapes.push_back({static_cast<std::int64_t>((static_cast<std::size_t>(r) * 3 + i) % 4), 3});
    }
  }
  const LayoutPlan plan = plan_layout(dtypes, shapes, world);
  std::uint64_t prev_end = 0;
  std::uint64_t wire = 0;
  for (int r = 0; r < world; ++r) {
    const auto rr = static_cast<std::size_t>(r);
    EXPECT_EQ(plan.displs[rr] % plan.alignment, 0U);
    EXPECT_GE(plan.displs[rr], prev_end);
    EXPECT_LT(plan.displs[rr] - prev_end, plan.alignment);
    std::uint64_t end = plan.displs[rr];
    for (std::size_t i = 0; i < dtypes.size(); ++i) {
      const std::size_t k = plan.index(r, i);
      EXPECT_GE(plan.offsets[k], end);
      if (plan.sizes[k] != 0) {
        EXPECT_EQ(plan.offsets[k] % dtype_size(dtypes[i]), 0U);
      }
      end = plan.offsets[k] + plan.sizes[k];
    }
    EXPECT_EQ(end - plan.displs[rr], plan.counts[rr]);
    prev_end = end;
    wire += plan.counts[rr];
  }
  EXPECT_EQ(plan.total_bytes, prev_end);
  EXPECT_LE(wire, plan.total_bytes);
}

INSTANTIATE_TEST_SUITE_P(Worlds, PlanLayoutWorld, ::testing::Values(1, 2, 3, 4, 7));

TEST(PlanLayout, SameDtypeListHasNoGaps) {
  // No padding anywhere: the wire bytes are exactly the tensor bytes.
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32};
  const std::vector<Shape> shapes = {{3}, {1}, {0}, {5}, {2}, {2}};
  const LayoutPlan plan = plan_layout(dtypes, shapes, 3);
  EXPECT_EQ(plan.counts, (std::vector<std::uint64_t>{16, 20, 16}));
  EXPECT_EQ(plan.displs, (std::vector<std::uint64_t>{0, 16, 36}));
  EXPECT_EQ(plan.total_bytes, 52U);
}

TEST(PlanLayout, EmptyListAndEmptyTensors) {
  const LayoutPlan empty = plan_layout({}, {}, 3);
  EXPECT_EQ(empty.total_bytes, 0U);
  EXPECT_EQ(empty.counts, (std::vector<std::uint64_t>{0, 0, 0}));
  const std::vector<DType> dtypes = {DType::kFloat32};
  const std::vector<Shape> shapes = {{0}, {4, 0}};
  EXPECT_EQ(plan_layout(dtypes, shapes, 2).total_bytes, 0U);
}

}  // namespace
}  // namespace shardgather
