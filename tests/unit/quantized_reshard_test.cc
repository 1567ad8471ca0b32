// Quantized plans through the C++ API (ReshardPlan, UnshardPlan, AllGatherPlan). A quantized
// ReshardPlan, on the threads backend: every destination's FP8 data and scales, or its dequantized
// values, bit-identical to quantizing the whole tensor at once, with cuts inside 128 x 128 blocks;
// each execution one call (its header, the all-gather of cut blocks' maxima, the payload) and no
// planning; the views' errors on every rank.
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/alloc_counter.h"
#include "support/testing.h"

#include "shardgather/shardgather.h"

namespace shardgather {
namespace {

using testing::run_ranks;

constexpr std::int64_t kRows = 300;
constexpr std::int64_t kCols = 256;

// The tensor's values: varied magnitudes per block (so that a wrong block maximum shows), a NaN
// in one block and an all-zero block.
std::vector<float> values() {
  std::vector<float> v(static_cast<std::size_t>(kRows * kCols));
  for (std::int64_t r = 0; r < kRows; ++r) {
    for (std::int64_t c = 0; c < kCols; ++c) {
      const double scale = std::pow(2.0, static_cast<double>((r / 37 + c / 29) % 11) - 5.0);
      v[static_cast<std::size_t>(r * kCols + c)] =
          static_cast<float>(scale * std::sin(0.37 * static_cast<double>(r * kCols + c)));
    }
  }
  v[static_cast<std::size_t>(7 * kCols + 9)] = std::nanf("");
  for (std::int64_t r = 256; r < kRows; ++r) {
    for (std::int64_t c = 128; c < kCols; ++c) {
      v[static_cast<std::size_t>(r * kCols + c)] = 0.0F;
    }
  }
  return v;
}

TensorView view_of(void* data, DType dtype, Shape shape, Shape strides = {}) {
  return TensorView{data, dtype, std::move(shape), std::move(strides), kCpu};
}

// Rank r holds rows [100 r, 100 r + 100) (every cut at 100 and 200 falls inside a block); rank 0
// wants columns [0, 128) as FP8 data and scales, rank 1 rows [50, 250) as float32 values, rank 2
// all of it as FP8 (scales of every block).
std::vector<TensorRegions> layout() {
  TensorRegions t{
      .dtype = DType::kFloat32, .shape = {kRows, kCols}, .sources = {}, .destinations = {}};
  for (int r = 0; r < 3; ++r) {
    t.sources.push_back({r, Box{{100 * r, 0}, {100, kCols}}});
  }
  t.destinations = {{0, Box{{0, 0}, {kRows, 128}}},
                    {1, Box{{50, 0}, {200, kCols}}},
                    {2, Box{{0, 0}, {kRows, kCols}}}};
  return {t};
}

struct Reference {
  std::vector<std::uint8_t> data;  // the whole tensor's FP8
  std::vector<float> scales;       // [3, 2]
  std::vector<float> values;       // data times scales, as float32
};

Reference reference(const std::vector<float>& full) {
  const QuantGrid grid =
      quant_grid(QuantFormat::kFp8Block128, {kRows, kCols}, DType::kFloat32, "t");
  Reference ref{std::vector<std::uint8_t>(full.size()),
                std::vector<float>(static_cast<std::size_t>(grid.num_blocks())),
                std::vector<float>(full.size())};
  const TensorView whole =
      view_of(const_cast<float*>(full.data()), DType::kFloat32, {kRows, kCols});
  quantize(grid, whole, std::as_writable_bytes(std::span(ref.scales)),
           reinterpret_cast<std::byte*>(ref.data.data()));
  dequantize_box(grid, reinterpret_cast<const std::byte*>(ref.data.data()), Shape{0, 0},
                 std::as_bytes(std::span(ref.scales)),
                 view_of(ref.values.data(), DType::kFloat32, {kRows, kCols}));
  return ref;
}

bool same_bits(const void* a, const void* b, std::size_t bytes) {
  return std::memcmp(a, b, bytes) == 0;
}

TEST(QuantizedReshard, EveryDestinationIsBitIdenticalToQuantizingTheWholeTensor) {
  const std::vector<float> full = values();
  const Reference ref = reference(full);
  const std::vector<TensorRegions> tensors = layout();
  const std::vector<QuantFormat> formats = {QuantFormat::kFp8Block128};
  run_ranks(
      3,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(tensors, 3, rank, {}, {}, formats);
        ASSERT_TRUE(plan.quantized());
        EXPECT_EQ(plan.amax_row_bytes(), 2 * 2 * sizeof(float));  // two slabs of two blocks
        std::vector<float> mine(full.begin() + 100 * rank * kCols,
                                full.begin() + (100 * rank + 100) * kCols);
        const TensorView source = view_of(mine.data(), DType::kFloat32, {100, kCols});
        const Box want = plan.destination(0).box;
        const std::int64_t rows = want.size[0];
        const std::int64_t cols = want.size[1];
        std::vector<std::uint8_t> data(static_cast<std::size_t>(rows * cols));
        std::vector<float> scales(static_cast<std::size_t>(3 * ((cols + 127) / 128)));
        std::vector<float> out(static_cast<std::size_t>(rows * cols), -1.0F);
        const bool values_here = rank == 1;
        const TensorView dest = values_here ? view_of(out.data(), DType::kFloat32, {rows, cols})
                                            : view_of(data.data(), DType::kUInt8, {rows, cols});
        const TensorView scale_view =
            values_here ? TensorView{}
                        : view_of(scales.data(), DType::kFloat32, {3, (cols + 127) / 128});
        // Every rank built its plan before any execution completes (they are collective), so
        // the process-wide count of plannings holds still across the later ones: none per
        // execution. A steady state allocates no buffer: only the host quantizer's few small
        // vectors of a box's dims (quantize.h), the same number every step.
        std::vector<std::uint64_t> allocations;
        for (int step = 0; step < 3; ++step) {
          const std::uint64_t planned = plan_regions_runs();
          const std::uint64_t issued = comm.collectives_issued();
          const std::uint64_t allocated = testing::thread_allocations();
          const ExecStats stats = plan.execute(std::span(&source, 1), comm, std::span(&dest, 1),
                                               std::span(&scale_view, 1));
          if (step > 0) {
            EXPECT_EQ(plan_regions_runs(), planned) << "an execution planned";
            allocations.push_back(testing::thread_allocations() - allocated);
          }
          EXPECT_EQ(comm.collectives_issued() - issued, 3U);  // header, maxima, payload
          EXPECT_EQ(stats.preflight_collectives, 1U);
          EXPECT_EQ(stats.payload_collectives, 2U);
        }
        EXPECT_EQ(allocations[0], allocations[1]);
        EXPECT_LT(allocations[1], 40U);
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::size_t from = static_cast<std::size_t>((want.offset[0] + r) * kCols);
          const std::size_t at = static_cast<std::size_t>(r * cols);
          if (values_here) {
            EXPECT_TRUE(same_bits(out.data() + at, ref.values.data() + from,
                                  4 * static_cast<std::size_t>(cols)))
                << "row " << r;
          } else {
            EXPECT_TRUE(
                same_bits(data.data() + at, ref.data.data() + from, static_cast<std::size_t>(cols)))
                << "row " << r;
          }
        }
        if (!values_here) {
          const std::int64_t scale_cols = (cols + 127) / 128;
          for (std::int64_t r = 0; r < 3; ++r) {
            EXPECT_TRUE(same_bits(scales.data() + r * scale_cols, ref.scales.data() + r * 2,
                                  4 * static_cast<std::size_t>(scale_cols)))
                << "scale row " << r;
          }
        }
      },
      "bit identical");
}

TEST(QuantizedReshard, WithoutACutOnlyTheHeaderAndThePayloadTravel) {
  // Rows split at multiples of 128: no block is cut, so no maxima are exchanged.
  TensorRegions t{
      .dtype = DType::kBFloat16, .shape = {256, 128}, .sources = {}, .destinations = {}};
  t.sources = {{0, Box{{0, 0}, {128, 128}}}, {1, Box{{128, 0}, {128, 128}}}};
  t.destinations = {{0, Box{{64, 0}, {128, 128}}}, {1, Box{{0, 0}, {256, 128}}}};
  const std::vector<QuantFormat> formats = {QuantFormat::kFp8Block128};
  run_ranks(
      2,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(std::span(&t, 1), 2, rank, {}, {}, formats);
        EXPECT_EQ(plan.amax_row_bytes(), 0U);
        std::vector<std::uint16_t> mine(128 * 128, 0x3f80);  // bf16 1.0
        const TensorView source = view_of(mine.data(), DType::kBFloat16, {128, 128});
        const Shape size = plan.destination(0).box.size;
        std::vector<std::uint16_t> out(static_cast<std::size_t>(size[0] * size[1]));
        const TensorView dest = view_of(out.data(), DType::kBFloat16, size);
        const std::uint64_t issued = comm.collectives_issued();
        plan.execute(std::span(&source, 1), comm, std::span(&dest, 1));
        EXPECT_EQ(comm.collectives_issued() - issued, 2U);
        for (const std::uint16_t v : out) {
          ASSERT_EQ(v, 0x3f80);  // 1.0 is exact in e4m3 with scale 1/448
        }
      },
      "no cut");
}

TEST(QuantizedReshard, ABadDestinationOnOneRankFailsOnEveryRankNamingIt) {
  const std::vector<float> full = values();
  const std::vector<TensorRegions> tensors = layout();
  const std::vector<QuantFormat> formats = {QuantFormat::kFp8Block128};
  run_ranks(
      3,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(tensors, 3, rank, {}, {}, formats);
        std::vector<float> mine(full.begin() + 100 * rank * kCols,
                                full.begin() + (100 * rank + 100) * kCols);
        const TensorView source = view_of(mine.data(), DType::kFloat32, {100, kCols});
        const Shape size = plan.destination(0).box.size;
        std::vector<std::int32_t> wrong(static_cast<std::size_t>(size[0] * size[1]));
        std::vector<float> right(wrong.size());
        // Rank 2 passes int32 values: neither FP8 data with scales nor float32 / bfloat16 values.
        const TensorView dest = rank == 2 ? view_of(wrong.data(), DType::kInt32, size)
                                          : view_of(right.data(), DType::kFloat32, size);
        try {
          plan.execute(std::span(&source, 1), comm, std::span(&dest, 1));
          ADD_FAILURE() << "rank " << rank << ": no error";
        } catch (const InvalidArgument& e) {
          const std::string what = e.what();
          EXPECT_NE(what.find("rank 2"), std::string::npos) << what;
          EXPECT_NE(what.find("destination 0 (tensor 0"), std::string::npos) << what;
          EXPECT_NE(what.find("to dequantize into"), std::string::npos) << what;
        }
      },
      "bad destination");
}

TEST(QuantizedReshard, SourcesThatDoNotSplitOneDimAreRefusedNamingTheTensor) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {256, 256}, .sources = {}, .destinations = {}};
  t.sources = {{0, Box{{0, 0}, {256, 256}}}, {1, Box{{0, 0}, {256, 256}}}};  // replicas
  t.destinations = {{0, Box{{0, 0}, {128, 128}}}};
  const std::vector<QuantFormat> formats = {QuantFormat::kFp8Block128};
  try {
    ReshardPlan plan(std::span(&t, 1), 2, 0, {}, {}, formats);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("quantize[0]: the sources must split one dim"),
              std::string::npos)
        << e.what();
  }
}

TEST(QuantizedReshard, ARankPastTheWorldIsRefusedBeforeAnythingIsRead) {
  const std::vector<TensorRegions> tensors = layout();
  const std::vector<QuantFormat> formats = {QuantFormat::kFp8Block128};
  EXPECT_THROW(ReshardPlan(tensors, 3, 5, {}, {}, formats), InvalidArgument);
  EXPECT_THROW(ReshardPlan(tensors, 3, -1, {}, {}, formats), InvalidArgument);
}

TEST(QuantizedReshard, ADecodedDestinationOverlappingAnotherIsRefusedOnEveryRank) {
  // Rank 0 wants rows [0, 128) as values and rows [128, 256) as FP8 data whose bytes lie
  // inside the values' buffer: the decode would overwrite what the payload delivered.
  TensorRegions t{.dtype = DType::kFloat32, .shape = {256, 128}, .sources = {}, .destinations = {}};
  t.sources = {{0, Box{{0, 0}, {100, 128}}}, {1, Box{{100, 0}, {156, 128}}}};
  t.destinations = {{0, Box{{0, 0}, {128, 128}}}, {0, Box{{128, 0}, {128, 128}}}};
  const std::vector<QuantFormat> formats = {QuantFormat::kFp8Block128};
  std::vector<float> full(256 * 128, 1.0F);
  run_ranks(
      2,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(std::span(&t, 1), 2, rank, {}, {}, formats);
        const TensorView source = view_of(full.data() + (rank == 0 ? 0 : 100 * 128),
                                          DType::kFloat32, {rank == 0 ? 100 : 156, 128});
        std::vector<float> values(128 * 128);
        std::vector<float> scales(1);
        std::vector<TensorView> dests;
        std::vector<TensorView> scale_views;
        if (rank == 0) {
          dests = {view_of(values.data(), DType::kFloat32, {128, 128}),
                   view_of(values.data(), DType::kUInt8, {128, 128})};
          scale_views = {TensorView{}, view_of(scales.data(), DType::kFloat32, {1, 1})};
        }
        try {
          plan.execute(std::span(&source, 1), comm, dests, scale_views);
          ADD_FAILURE() << "rank " << rank << ": no error";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("overlap"), std::string::npos) << e.what();
        }
      },
      "decoded overlap");
}

TEST(QuantizedReshard, APlanWhoseFormatsQuantizeNothingIsAPlainPlan) {
  TensorRegions t{.dtype = DType::kFloat32, .shape = {8, 4}, .sources = {}, .destinations = {}};
  t.sources = {{0, Box{{0, 0}, {8, 4}}}};
  t.destinations = {{1, Box{{0, 0}, {8, 4}}}};
  const std::vector<QuantFormat> none = {QuantFormat::kNone};
  run_ranks(
      2,
      [&](int rank, Communicator& comm) {
        ReshardPlan plan(std::span(&t, 1), 2, rank, {}, {}, none);
        EXPECT_FALSE(plan.quantized());
        std::vector<float> src(32, 2.5F);
        std::vector<float> dst(32, 0.0F);
        std::vector<TensorView> sources;
        std::vector<TensorView> dests;
        std::vector<TensorView> scales;
        if (rank == 0) {
          sources = {view_of(src.data(), DType::kFloat32, {8, 4})};
        } else {
          dests = {view_of(dst.data(), DType::kFloat32, {8, 4})};
          scales = {TensorView{}};  // "values", as a quantized plan's caller would say
        }
        plan.execute(sources, comm, dests, scales);
        if (rank == 1) {
          EXPECT_EQ(dst, src);
        }
      },
      "nothing quantized");
}

// The full tensor of `shape` quantized at once: its FP8 data, scales and values (float32).
Reference reference_of(const std::vector<float>& full, const Shape& shape) {
  const QuantGrid grid = quant_grid(QuantFormat::kFp8Block128, shape, DType::kFloat32, "t");
  Reference ref{std::vector<std::uint8_t>(full.size()),
                std::vector<float>(static_cast<std::size_t>(grid.num_blocks())),
                std::vector<float>(full.size())};
  quantize(grid, view_of(const_cast<float*>(full.data()), DType::kFloat32, shape),
           std::as_writable_bytes(std::span(ref.scales)),
           reinterpret_cast<std::byte*>(ref.data.data()));
  dequantize_box(grid, reinterpret_cast<const std::byte*>(ref.data.data()), Shape{0, 0},
                 std::as_bytes(std::span(ref.scales)),
                 view_of(ref.values.data(), DType::kFloat32, shape));
  return ref;
}

// A quantized UnshardPlan through the C++ API: two parameters split inside 128 x 128 blocks,
// one along dim 0 and one along dim 1, both padded (FSDP's shards: 110 rows or columns of which
// 100 are real, the rest garbage that must not travel); every rank's full tensors are
// bit-identical to quantizing each whole, as FP8 data and scales or as values; each execution is
// the reshard's one call (3 collectives), plans nothing, also started.
TEST(QuantizedUnshard, EveryRanksFullTensorsAreBitIdenticalToQuantizingThem) {
  const std::vector<float> rows_full = values();   // [300, 256], split along dim 0
  std::vector<float> cols_full(rows_full.size());  // its transpose, [256, 300], along dim 1
  for (std::int64_t r = 0; r < kRows; ++r) {
    for (std::int64_t c = 0; c < kCols; ++c) {
      cols_full[static_cast<std::size_t>(c * kRows + r)] =
          rows_full[static_cast<std::size_t>(r * kCols + c)];
    }
  }
  const Reference refs[2] = {reference_of(rows_full, {kRows, kCols}),
                             reference_of(cols_full, {kCols, kRows})};
  const std::vector<ShardSpec> specs = {{DType::kFloat32, {kRows, kCols}, 0, {}, 110},
                                        {DType::kFloat32, {kCols, kRows}, 1, {}, 110}};
  const std::vector<QuantFormat> formats(2, QuantFormat::kFp8Block128);
  run_ranks(
      3,
      [&](int rank, Communicator& comm) {
        const UnshardPlan plan = UnshardPlan::for_communicator(specs, comm);
        UnshardPlan mine(specs, 3, rank, {}, -1, formats);
        ASSERT_FALSE(plan.quantized());
        ASSERT_TRUE(mine.quantized());
        // Padded shards: the real 100 rows (columns) then 10 of garbage.
        std::vector<float> a(110 * kCols, 1e30F);
        std::vector<float> b(static_cast<std::size_t>(kCols) * 110, 1e30F);
        for (std::int64_t r = 0; r < 100; ++r) {
          for (std::int64_t c = 0; c < kCols; ++c) {
            a[static_cast<std::size_t>(r * kCols + c)] =
                rows_full[static_cast<std::size_t>((100 * rank + r) * kCols + c)];
            b[static_cast<std::size_t>(c * 110 + r)] =
                cols_full[static_cast<std::size_t>(c * kRows + 100 * rank + r)];
          }
        }
        const std::vector<TensorView> shards = {view_of(a.data(), DType::kFloat32, {110, kCols}),
                                                view_of(b.data(), DType::kFloat32, {kCols, 110})};
        // Rank 0 takes both as FP8 data and scales, rank 1 both as values, rank 2 one of each.
        const bool raw[2] = {rank != 1, rank == 0};
        std::vector<std::uint8_t> data[2];
        std::vector<float> scales[2];
        std::vector<float> got[2];
        std::vector<TensorView> outs;
        std::vector<TensorView> scale_views;
        for (int k = 0; k < 2; ++k) {
          const Shape shape = specs[static_cast<std::size_t>(k)].full_shape;
          data[k].assign(rows_full.size(), 0);
          scales[k].assign(refs[k].scales.size(), 0.0F);
          got[k].assign(rows_full.size(), 0.0F);
          outs.push_back(raw[k] ? view_of(data[k].data(), DType::kUInt8, shape)
                                : view_of(got[k].data(), DType::kFloat32, shape));
          scale_views.push_back(raw[k] ? view_of(scales[k].data(), DType::kFloat32,
                                                 {(shape[0] + 127) / 128, (shape[1] + 127) / 128})
                                       : TensorView{});
        }
        for (int step = 0; step < 3; ++step) {
          const std::uint64_t planned = plan_regions_runs();
          const std::uint64_t issued = comm.collectives_issued();
          if (step == 2) {
            (void)mine.start(shards, comm, outs, scale_views).wait();
          } else {
            (void)mine.execute(shards, comm, outs, scale_views);
          }
          EXPECT_EQ(comm.collectives_issued() - issued, 3U);  // header, maxima, payload
          if (step > 0) {  // every rank had built its plan before the first call completed
            EXPECT_EQ(plan_regions_runs(), planned) << "an execution planned";
          }
          for (int k = 0; k < 2; ++k) {
            const std::size_t n = rows_full.size();
            EXPECT_TRUE(raw[k] ? same_bits(data[k].data(), refs[k].data.data(), n)
                               : same_bits(got[k].data(), refs[k].values.data(), 4 * n))
                << "parameter " << k << " step " << step;
            if (raw[k]) {
              EXPECT_TRUE(same_bits(scales[k].data(), refs[k].scales.data(), 4 * scales[k].size()))
                  << "parameter " << k << " scales";
            }
          }
        }
        // Into one buffer: refused on every rank (the others are in the call it would make).
        std::vector<std::byte> buffer(static_cast<std::size_t>(mine.output_bytes()));
        const bool odd = rank == 2;
        try {
          if (odd) {
            (void)mine.execute(shards, comm, std::span(buffer));
          } else {
            (void)mine.execute(shards, comm, outs, scale_views);
          }
          ADD_FAILURE() << "one buffer on rank 2 must fail on every rank";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("not into one buffer"), std::string::npos)
              << e.what();
        }
        (void)mine.execute(shards, comm, outs, scale_views);  // usable after
      },
      "quantized unshard");
}

// A quantized UnshardStream through the C++ API: a [300, 256] parameter split along dim 0 and its
// transpose along dim 1 (both padded, cut inside 128 x 128 blocks), with a plain bf16 parameter
// between them. One parameter per bucket and all in one bucket, to every rank and to rank 1
// only; each run quantizes the shards' current values (the second run's are negated): every
// bucket's FP8 data and scales are bit-identical to quantizing the full tensors, the plain one
// exact.
TEST(QuantizedStream, EveryBucketIsBitIdenticalToQuantizingTheFullTensors) {
  std::vector<float> rows_full = values();
  std::vector<float> cols_full(rows_full.size());
  for (std::int64_t r = 0; r < kRows; ++r) {
    for (std::int64_t c = 0; c < kCols; ++c) {
      cols_full[static_cast<std::size_t>(c * kRows + r)] =
          rows_full[static_cast<std::size_t>(r * kCols + c)];
    }
  }
  std::vector<std::uint16_t> plain_full(9 * 4);
  for (std::size_t i = 0; i < plain_full.size(); ++i) {
    plain_full[i] = static_cast<std::uint16_t>(0x3F80U + i);
  }
  const std::vector<ShardSpec> specs = {{DType::kFloat32, {kRows, kCols}, 0, {}, 110},
                                        {DType::kBFloat16, {9, 4}, 0, {3, 3, 3}, 0},
                                        {DType::kFloat32, {kCols, kRows}, 1, {}, 110}};
  const std::vector<QuantFormat> formats = {QuantFormat::kFp8Block128, QuantFormat::kNone,
                                            QuantFormat::kFp8Block128};
  for (const std::uint64_t bucket_bytes : {std::uint64_t{1}, std::uint64_t{1} << 30}) {
    for (const int dst : {-1, 1}) {
      run_ranks(
          3,
          [&](int rank, Communicator& comm) {
            const StreamOptions options{.bucket_bytes = bucket_bytes, .prefetch = 1, .dst = dst};
            UnshardStream stream(specs, 3, rank, options, formats);
            EXPECT_EQ(stream.num_buckets(), bucket_bytes == 1 ? 3U : 1U);
            std::vector<float> a(110 * kCols, 1e30F);  // padded: 10 rows of garbage
            std::vector<float> b(static_cast<std::size_t>(kCols) * 110, 1e30F);
            std::vector<std::uint16_t> p(plain_full.begin() + 12 * rank,
                                         plain_full.begin() + 12 * rank + 12);
            const std::vector<TensorView> shards = {
                view_of(a.data(), DType::kFloat32, {110, kCols}),
                view_of(p.data(), DType::kBFloat16, {3, 4}),
                view_of(b.data(), DType::kFloat32, {kCols, 110})};
            for (int run = 0; run < 2; ++run) {
              const float sign = run == 0 ? 1.0F : -1.0F;
              for (std::int64_t r = 0; r < 100; ++r) {
                for (std::int64_t c = 0; c < kCols; ++c) {
                  a[static_cast<std::size_t>(r * kCols + c)] =
                      sign * rows_full[static_cast<std::size_t>((100 * rank + r) * kCols + c)];
                  b[static_cast<std::size_t>(c * 110 + r)] =
                      sign * cols_full[static_cast<std::size_t>(c * kRows + 100 * rank + r)];
                }
              }
              std::vector<float> rows_now(rows_full);
              std::vector<float> cols_now(cols_full);
              for (std::size_t i = 0; i < rows_now.size(); ++i) {
                rows_now[i] *= sign;
                cols_now[i] *= sign;
              }
              const Reference refs[2] = {reference_of(rows_now, {kRows, kCols}),
                                         reference_of(cols_now, {kCols, kRows})};
              // Checked as they arrive: a later bucket may reuse an earlier one's buffer.
              const auto check = [&](const StreamBucket& bucket) {
                std::size_t v = 0;
                for (std::size_t i = bucket.first_param; i < bucket.first_param + bucket.num_params;
                     ++i) {
                  const TensorView& t = bucket.full.at(v++);
                  if (i == 1) {
                    EXPECT_TRUE(same_bits(t.data, plain_full.data(), 2 * plain_full.size()));
                    continue;
                  }
                  const Reference& ref = refs[i / 2];
                  const TensorView& scales = bucket.full.at(v++);
                  EXPECT_EQ(t.dtype, DType::kUInt8);
                  EXPECT_EQ(t.shape, specs[i].full_shape);
                  EXPECT_EQ(scales.dtype, DType::kFloat32);
                  EXPECT_EQ(scales.shape, i == 0 ? (Shape{3, 2}) : (Shape{2, 3}));
                  EXPECT_TRUE(same_bits(t.data, ref.data.data(), ref.data.size()))
                      << "parameter " << i << " run " << run;
                  EXPECT_TRUE(same_bits(scales.data, ref.scales.data(), 4 * ref.scales.size()))
                      << "parameter " << i << " scales, run " << run;
                }
                EXPECT_EQ(v, bucket.full.size());
              };
              std::size_t buckets = 0;
              stream.begin(shards, comm);
              while (std::optional<StreamBucket> bucket = stream.next()) {
                ++buckets;
                if (dst >= 0 && rank != dst) {
                  EXPECT_TRUE(bucket->full.empty());
                } else {
                  check(*bucket);
                }
              }
              EXPECT_EQ(buckets, stream.num_buckets());
            }
          },
          "quantized stream");
    }
  }
}

// Ranks that quantize differently (a format on one rank only, or another format) raise
// MismatchError on every rank from begin(), before any bucket moves; the communicator stays
// usable.
TEST(QuantizedStream, FormatsThatDifferAcrossRanksRaiseAtBegin) {
  const std::vector<ShardSpec> specs = {{DType::kFloat32, {256, 128}, 0, {}, 0},
                                        {DType::kFloat32, {256, 128}, 0, {}, 0}};
  for (const QuantFormat odd : {QuantFormat::kNone, QuantFormat::kFp8Row128}) {
    run_ranks(
        2,
        [&](int rank, Communicator& comm) {
          const std::vector<QuantFormat> formats = {QuantFormat::kNone,
                                                    rank == 1 ? odd : QuantFormat::kFp8Block128};
          UnshardStream stream(specs, 2, rank, {.bucket_bytes = 1}, formats);
          std::vector<float> a(128 * 128, 1.0F);
          std::vector<float> b(128 * 128, 2.0F);
          const std::vector<TensorView> shards = {view_of(a.data(), DType::kFloat32, {128, 128}),
                                                  view_of(b.data(), DType::kFloat32, {128, 128})};
          const std::uint64_t calls = comm.calls_issued();
          EXPECT_THROW(stream.begin(shards, comm), Mismatch) << "rank " << rank;
          EXPECT_EQ(comm.calls_issued() - calls, 1U) << "only begin()'s header";
          comm.barrier(comm.deadline_after(std::chrono::seconds(30)));
        },
        "quantize formats that differ");
  }
}

TEST(QuantizedUnshard, FormatsMustMatchTheSpecsAndAStrategyThatMovesOnce) {
  const std::vector<ShardSpec> specs = {{DType::kFloat32, {256, 128}, 0, {}, 0}};
  const std::vector<QuantFormat> two(2, QuantFormat::kFp8Block128);
  EXPECT_THROW(UnshardPlan(specs, 2, 0, {}, -1, two), InvalidArgument);
  PlanOptions packed;
  packed.strategy = Strategy::kPacked;
  const std::vector<QuantFormat> one(1, QuantFormat::kFp8Block128);
  EXPECT_THROW(UnshardPlan(specs, 2, 0, packed, -1, one), InvalidArgument);
  const std::vector<QuantFormat> none(1, QuantFormat::kNone);
  EXPECT_FALSE(UnshardPlan(specs, 2, 0, packed, -1, none).quantized());
}

// A quantized AllGatherPlan through the C++ API: index 0 is every rank's 100 rows of one
// [300, 256] tensor (cuts inside 128 x 128 blocks), index 1 an int32 tensor per rank of its own
// shape. Every rank's entry of every rank's rows is bit-identical to quantizing the formed tensor
// whole (FP8 data and the scales of the blocks the rows touch on rank 0, values elsewhere), the
// plain index exact; each execution is one call of 3 collectives and plans nothing, started
// too; the buffer form is refused on every rank, naming the outputs.
TEST(QuantizedGather, EveryRanksRowsAreBitIdenticalToQuantizingTheFormedTensor) {
  const std::vector<float> full = values();
  const Reference ref = reference(full);
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kInt32};
  std::vector<std::vector<Shape>> shapes;
  for (int r = 0; r < 3; ++r) {
    shapes.push_back({{100, kCols}, {r + 1, 3}});
  }
  const std::vector<QuantFormat> formats = {QuantFormat::kFp8Block128, QuantFormat::kNone};
  EXPECT_THROW(
      AllGatherPlan(dtypes,
                    std::vector<std::vector<Shape>>{{{100, kCols}, {1, 3}}, {{100, 128}, {1, 3}}},
                    0, {}, formats),
      InvalidArgument);  // rows that do not form one tensor
  run_ranks(
      3,
      [&](int rank, Communicator& comm) {
        AllGatherPlan plan(dtypes, shapes, rank, {}, formats);
        ASSERT_TRUE(plan.quantized());
        std::vector<float> mine(full.begin() + 100 * rank * kCols,
                                full.begin() + (100 * rank + 100) * kCols);
        std::vector<std::int32_t> ints(static_cast<std::size_t>(3 * (rank + 1)), 7 * rank);
        const std::vector<TensorView> params = {view_of(mine.data(), DType::kFloat32, {100, kCols}),
                                                view_of(ints.data(), DType::kInt32, {rank + 1, 3})};
        const bool raw = rank == 0;
        std::vector<std::vector<std::uint8_t>> data(3);
        std::vector<std::vector<float>> got(3);
        std::vector<std::vector<float>> scales(3);
        std::vector<std::vector<std::int32_t>> plain(3);
        std::vector<TensorView> outs(6);
        std::vector<TensorView> scale_views(6);
        for (std::size_t r = 0; r < 3; ++r) {
          const std::int64_t blocks = (100 * static_cast<std::int64_t>(r) + 99) / 128 -
                                      100 * static_cast<std::int64_t>(r) / 128 + 1;
          data[r].assign(100 * kCols, 0);
          got[r].assign(100 * kCols, 0.0F);
          scales[r].assign(static_cast<std::size_t>(blocks * 2), 0.0F);
          plain[r].assign(3 * (r + 1), -1);
          outs[r] = raw ? view_of(data[r].data(), DType::kUInt8, {100, kCols})
                        : view_of(got[r].data(), DType::kFloat32, {100, kCols});
          if (raw) {
            scale_views[r] = view_of(scales[r].data(), DType::kFloat32, {blocks, 2});
          }
          outs[3 + r] =
              view_of(plain[r].data(), DType::kInt32, {static_cast<std::int64_t>(r) + 1, 3});
        }
        for (int step = 0; step < 2; ++step) {
          const std::uint64_t planned = plan_regions_runs();
          const std::uint64_t issued = comm.collectives_issued();
          if (step == 1) {
            (void)plan.start(params, comm, outs, scale_views).wait();
          } else {
            (void)plan.execute(params, comm, outs, scale_views);
          }
          EXPECT_EQ(comm.collectives_issued() - issued, 3U);  // header, maxima, payload
          if (step > 0) {  // every rank had built its plan before the first call completed
            EXPECT_EQ(plan_regions_runs(), planned) << "an execution planned";
          }
          for (std::size_t r = 0; r < 3; ++r) {
            const std::size_t from = r * 100 * kCols;
            EXPECT_TRUE(raw ? same_bits(data[r].data(), ref.data.data() + from, 100 * kCols)
                            : same_bits(got[r].data(), ref.values.data() + from, 4 * 100 * kCols))
                << "rank " << rank << " rows of " << r;
            if (raw) {
              const std::size_t first = 2 * (100 * r / 128);
              EXPECT_TRUE(
                  same_bits(scales[r].data(), ref.scales.data() + first, 4 * scales[r].size()))
                  << "scales of rank " << r << "'s rows";
            }
            EXPECT_EQ(plain[r], std::vector<std::int32_t>(3 * (r + 1), 7 * static_cast<int>(r)));
          }
        }
        std::vector<std::byte> buffer(static_cast<std::size_t>(plan.output_bytes()));
        try {
          if (rank == 1) {
            (void)plan.execute(params, comm, std::span(buffer));
          } else {
            (void)plan.execute(params, comm, outs, scale_views);
          }
          ADD_FAILURE() << "one buffer on rank 1 must fail on every rank";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("not into one buffer"), std::string::npos)
              << e.what();
        }
      },
      "quantized gather");
}

}  // namespace
}  // namespace shardgather
