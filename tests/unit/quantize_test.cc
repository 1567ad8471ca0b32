// The host quantizer: element conversions against a brute-force nearest-value search, and the
// property quantized transfers rest on: a tensor quantized in boxes (any cuts, blocks split
// across boxes, their amaxes combined) gives the bytes it gives whole. The torch references
// (to_mxfp, the FP8 block formula) are checked from Python (tests/python/test_quantize.py).
#include "shardgather/quantize.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "copies/quant_desc.h"

#include "shardgather/errors.h"

namespace shardgather {
namespace {

std::size_t u(std::int64_t v) { return static_cast<std::size_t>(v); }

constexpr std::array<QuantFormat, 3> kFormats = {QuantFormat::kFp8Block128, QuantFormat::kFp8Row128,
                                                 QuantFormat::kMxfp8};

// The e4m3fn code nearest to x (|x| <= 448), ties to the even code, by trying every code.
std::uint8_t nearest_e4m3(float x) {
  int best = -1;
  double best_gap = 0;
  for (int code = 0; code < 0x7F; ++code) {  // the non-negative finite codes
    const double gap = std::fabs(std::fabs(static_cast<double>(x)) -
                                 float_from_e4m3(static_cast<std::uint8_t>(code)));
    if (best < 0 || gap < best_gap || (gap == best_gap && (code & 1) == 0)) {
      best = code;
      best_gap = gap;
    }
  }
  return static_cast<std::uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

TEST(E4m3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(float_from_e4m3(static_cast<std::uint8_t>(code))));
      continue;
    }
    EXPECT_EQ(e4m3_from_float(float_from_e4m3(static_cast<std::uint8_t>(code))), code) << code;
  }
  EXPECT_EQ(float_from_e4m3(0x7E), 448.0F);
  EXPECT_EQ(float_from_e4m3(0x01), std::ldexp(1.0F, -9));
}

TEST(E4m3, RoundsToNearestEvenAgainstBruteForce) {
  std::vector<float> values;
  for (std::uint32_t hi = 0; hi < 0x10000; ++hi) {  // every bf16 value within +-448
    const float v = std::bit_cast<float>(hi << 16);
    if (std::fabs(v) <= 448.0F) {
      values.push_back(v);
    }
  }
  for (int code = 0; code < 0x7E; ++code) {  // every midpoint and its neighbours
    const float mid = (float_from_e4m3(static_cast<std::uint8_t>(code)) +
                       float_from_e4m3(static_cast<std::uint8_t>(code + 1))) /
                      2;
    for (const float v : {mid, std::nextafter(mid, 0.0F), std::nextafter(mid, 1000.0F)}) {
      values.push_back(v);
      values.push_back(-v);
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> any(-448.0F, 448.0F);
  for (int i = 0; i < 200000; ++i) {
    values.push_back(any(rng) * std::ldexp(1.0F, -static_cast<int>(rng() % 20)));
  }
  for (const float v : values) {
    ASSERT_EQ(e4m3_from_float(v), nearest_e4m3(v)) << v;
  }
}

TEST(E4m3, NanAndPastTheRangeGiveNan) {
  EXPECT_EQ(e4m3_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(e4m3_from_float(-std::numeric_limits<float>::quiet_NaN()), 0xFF);
  EXPECT_EQ(e4m3_from_float(464.0F), 0x7E);  // the tie rounds to even, 448
  EXPECT_EQ(e4m3_from_float(480.0F), 0x7F);
}

TEST(E8m0, FollowsTheRceilRule) {
  EXPECT_EQ(e8m0_from_amax(448.0F), 127);  // descale 1: 2^0
  EXPECT_EQ(e8m0_from_amax(449.0F), 128);  // just above: rounds the exponent up
  EXPECT_EQ(e8m0_from_amax(224.0F), 126);
  EXPECT_EQ(e8m0_from_amax(0.0F), 0);
  EXPECT_EQ(e8m0_from_amax(std::numeric_limits<float>::infinity()), 254);
  EXPECT_EQ(e8m0_from_amax(std::numeric_limits<float>::quiet_NaN()), 255);
  // log2 within half an fp32 ulp above 5 rounds to 5 first (to_mxfp's fp32 log2).
  EXPECT_EQ(e8m0_from_amax(448.0F * 32.0F * (1.0F + 0x1p-23F)), 127 + 5);
  EXPECT_EQ(e8m0_from_amax(448.0F * 2.0F * (1.0F + 0x1p-23F)), 127 + 2);
}

// A tensor's values as bytes of `dtype`, with zero blocks, NaN, Inf and large values mixed in
// where `specials`.
std::vector<std::byte> random_tensor(std::int64_t numel, DType dtype, bool specials,
                                     std::mt19937& rng) {
  std::vector<std::byte> bytes(static_cast<std::size_t>(numel) * dtype_size(dtype));
  std::normal_distribution<float> normal(0.0F, 1.0F);
  const float scale = std::ldexp(1.0F, static_cast<int>(rng() % 30) - 20);
  for (std::int64_t i = 0; i < numel; ++i) {
    float v = normal(rng) * scale;
    if (specials) {
      const auto pick = rng() % 400;
      if (pick == 0) {
        v = std::numeric_limits<float>::quiet_NaN();
      } else if (pick == 1) {
        v = -std::numeric_limits<float>::infinity();
      } else if (pick == 2) {
        v = 1e30F;
      } else if (pick < 80) {
        v = 0.0F;
      }
    }
    const std::uint32_t u = std::bit_cast<std::uint32_t>(v);
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + i * 4, &v, 4);
    } else if (dtype == DType::kBFloat16) {
      const auto h = static_cast<std::uint16_t>(u >> 16);  // truncation is a bf16 value too
      std::memcpy(bytes.data() + i * 2, &h, 2);
    } else {  // f16: random bit patterns, NaN and Inf included
      const auto h = static_cast<std::uint16_t>(rng());
      std::memcpy(bytes.data() + i * 2, &h, 2);
    }
  }
  return bytes;
}

// The first index where two byte vectors differ, or -1 (gtest's diff of large vectors is slow).
std::int64_t first_difference(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  if (a.size() != b.size()) {
    return static_cast<std::int64_t>(std::min(a.size(), b.size()));
  }
  const auto at = std::mismatch(a.begin(), a.end(), b.begin());
  return at.first == a.end() ? -1 : at.first - a.begin();
}

struct Cut {
  Shape offset;
  Shape size;
};

// Random boxes tiling `shape`: each dim cut at random points (possibly inside blocks).
std::vector<Cut> random_tiling(const Shape& shape, std::mt19937& rng) {
  std::vector<std::vector<std::int64_t>> edges(shape.size());
  for (std::size_t d = 0; d < shape.size(); ++d) {
    edges[d] = {0, shape[d]};
    const auto cuts = shape[d] > 1 ? rng() % 3 : 0;
    for (std::uint64_t c = 0; c < cuts; ++c) {
      edges[d].push_back(
          static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(shape[d] + 1)));
    }
    std::sort(edges[d].begin(), edges[d].end());
  }
  std::vector<Cut> tiles(1);
  for (std::size_t d = 0; d < shape.size(); ++d) {
    std::vector<Cut> next;
    for (const Cut& tile : tiles) {
      for (std::size_t e = 0; e + 1 < edges[d].size(); ++e) {
        Cut cut = tile;
        cut.offset.push_back(edges[d][e]);
        cut.size.push_back(edges[d][e + 1] - edges[d][e]);
        next.push_back(cut);
      }
    }
    tiles = next;
  }
  return tiles;
}

std::int64_t numel_of(const Shape& shape) {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) {
    n *= d;
  }
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) {
    strides[d - 1] = strides[d] * shape[d];
  }
  return strides;
}

// The box `cut` of the full tensor as a strided view into it.
TensorView box_view(std::vector<std::byte>& full, DType dtype, const Shape& shape, const Cut& cut) {
  const Shape strides = contiguous_strides(shape);
  if (numel_of(cut.size) == 0) {  // its place may be past the end: no pointer to it
    return {nullptr, dtype, cut.size, strides};
  }
  std::int64_t first = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    first += cut.offset[d] * strides[d];
  }
  return {full.data() + first * static_cast<std::int64_t>(dtype_size(dtype)), dtype, cut.size,
          strides};
}

Shape random_shape(QuantFormat format, std::mt19937& rng) {
  const std::size_t ndim = format == QuantFormat::kFp8Block128 ? 2 : 1 + rng() % 3;
  Shape shape(ndim);
  for (std::size_t d = 0; d < ndim; ++d) {
    shape[d] = static_cast<std::int64_t>(rng() % (ndim == 1 ? 400 : ndim == 2 ? 300 : 12));
  }
  if (format == QuantFormat::kMxfp8) {
    shape.back() = 32 * static_cast<std::int64_t>(rng() % 9);
  }
  return shape;
}

TEST(QuantizeBoxes, PiecesGiveTheBytesOfTheWhole) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const QuantFormat format = kFormats[static_cast<std::size_t>(trial % 3)];
    const DType dtype = std::array{DType::kFloat32, DType::kBFloat16, DType::kFloat16}[rng() % 3U];
    const Shape shape = random_shape(format, rng);
    const QuantGrid grid = quant_grid(format, shape, dtype, "t");
    const std::int64_t numel = numel_of(shape);
    std::vector<std::byte> full = random_tensor(numel, dtype, trial % 2 == 0, rng);
    const TensorView whole{full.data(), dtype, shape, {}};

    std::vector<std::byte> want_scales(u(grid.num_blocks()) * grid.scale_size());
    std::vector<std::byte> want(u(numel));
    quantize(grid, whole, want_scales, want.data());

    // Each box folds its own amaxes, as a rank does; then they are combined.
    const std::vector<Cut> tiles = random_tiling(shape, rng);
    std::vector<float> amax(u(grid.num_blocks()), 0.0F);
    for (const Cut& cut : tiles) {
      std::vector<float> mine(u(grid.num_blocks()), 0.0F);
      fold_amax(grid, box_view(full, dtype, shape, cut), cut.offset, mine);
      combine_amax(amax, mine);
    }
    std::vector<std::byte> scales(want_scales.size());
    encode_scales(grid, amax, scales);
    ASSERT_EQ(first_difference(scales, want_scales), -1) << "trial " << trial;

    // Each box quantized alone, its bytes put back in place.
    std::vector<std::byte> got(u(numel));
    const Shape strides = contiguous_strides(shape);
    for (const Cut& cut : tiles) {
      std::vector<std::byte> part(u(numel_of(cut.size)));
      quantize_box(grid, box_view(full, dtype, shape, cut), cut.offset, scales, part.data());
      std::vector<std::byte> scatter = part;  // as a uint8 "tensor" to walk with a view
      const Shape part_strides = contiguous_strides(cut.size);
      for (std::int64_t i = 0; i < numel_of(cut.size); ++i) {
        std::int64_t rest = i;
        std::int64_t at = 0;
        for (std::size_t d = 0; d < shape.size(); ++d) {
          at += (cut.offset[d] + rest / part_strides[d]) * strides[d];
          rest %= part_strides[d];
        }
        got[u(at)] = scatter[u(i)];
      }
    }
    ASSERT_EQ(first_difference(got, want), -1)
        << "trial " << trial << " format " << quant_format_name(format);
  }
}

TEST(QuantizeBoxes, ZeroBlockScaleIsOneAndNanPoisonsItsBlock) {
  const QuantGrid grid = quant_grid(QuantFormat::kFp8Row128, {2, 128}, DType::kFloat32, "t");
  std::vector<float> values(256, 0.0F);
  values[128] = std::numeric_limits<float>::quiet_NaN();
  values[129] = 3.0F;
  std::vector<std::byte> scales(8);
  std::vector<std::byte> out(256);
  quantize(grid, {values.data(), DType::kFloat32, {2, 128}, {}}, scales, out.data());
  float s0 = 0;
  float s1 = 0;
  std::memcpy(&s0, scales.data(), 4);
  std::memcpy(&s1, scales.data() + 4, 4);
  EXPECT_EQ(s0, 1.0F);
  EXPECT_EQ(std::to_integer<int>(out[0]), 0);
  EXPECT_TRUE(std::isnan(s1));
  EXPECT_EQ(std::to_integer<int>(out[129]) & 0x7F, 0x7F);
}

TEST(Dequantize, IsCodeTimesScaleInTheOutputDtype) {
  std::mt19937 rng(3);
  for (const QuantFormat format : kFormats) {
    const Shape shape{130, 160};
    const QuantGrid grid = quant_grid(format, shape, DType::kFloat32, "t");
    std::vector<std::byte> full = random_tensor(numel_of(shape), DType::kFloat32, false, rng);
    std::vector<std::byte> scales(u(grid.num_blocks()) * grid.scale_size());
    std::vector<std::byte> data(u(numel_of(shape)));
    quantize(grid, {full.data(), DType::kFloat32, shape, {}}, scales, data.data());
    std::vector<float> out(u(numel_of(shape)));
    const Shape origin{0, 0};
    dequantize_box(grid, data.data(), origin, scales, {out.data(), DType::kFloat32, shape, {}});
    std::vector<float> in(u(numel_of(shape)));
    std::memcpy(in.data(), full.data(), full.size());
    for (std::size_t i = 0; i < out.size(); ++i) {
      // within half an e4m3 step (relative 1/16) of the input, or the subnormal quantum
      const std::int64_t row = static_cast<std::int64_t>(i) / 160;
      const std::int64_t col = static_cast<std::int64_t>(i) % 160;
      const std::size_t block =
          u((row / grid.block_rows) * grid.scale_cols() + col / grid.block_cols);
      const float s = format == QuantFormat::kMxfp8
                          ? std::ldexp(1.0F, std::to_integer<int>(scales[block]) - 127)
                          : std::bit_cast<float>(std::array<std::byte, 4>{
                                scales[block * 4], scales[block * 4 + 1], scales[block * 4 + 2],
                                scales[block * 4 + 3]});
      EXPECT_EQ(out[i], float_from_e4m3(std::to_integer<std::uint8_t>(data[i])) * s);
      EXPECT_LE(std::fabs(out[i] - in[i]), std::fabs(in[i]) / 16 + std::ldexp(s, -10)) << i;
    }
  }
}

TEST(Dequantize, BoxesLandAtTheirOffsetsInStridedOutputs) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 60; ++trial) {
    const QuantFormat format = kFormats[static_cast<std::size_t>(trial % 3)];
    const Shape shape = random_shape(format, rng);
    const QuantGrid grid = quant_grid(format, shape, DType::kBFloat16, "t");
    const std::int64_t numel = numel_of(shape);
    std::vector<std::byte> full = random_tensor(numel, DType::kBFloat16, true, rng);
    std::vector<std::byte> scales(u(grid.num_blocks()) * grid.scale_size());
    std::vector<std::byte> data(u(numel));
    quantize(grid, {full.data(), DType::kBFloat16, shape, {}}, scales, data.data());
    std::vector<std::byte> want(u(numel) * 4);
    const Shape origin(shape.size(), 0);
    dequantize_box(grid, data.data(), origin, scales, {want.data(), DType::kFloat32, shape, {}});
    // Each tile's codes (row-major in the tile) dequantized into its place of one output.
    std::vector<std::byte> got(u(numel) * 4, std::byte{0x55});
    for (const Cut& cut : random_tiling(shape, rng)) {
      std::vector<std::byte> codes(u(numel_of(cut.size)));
      quantize_box(grid, box_view(full, DType::kBFloat16, shape, cut), cut.offset, scales,
                   codes.data());
      dequantize_box(grid, codes.data(), cut.offset, scales,
                     box_view(got, DType::kFloat32, shape, cut));
    }
    ASSERT_EQ(first_difference(got, want), -1) << "trial " << trial;
  }
}

TEST(QuantizeBoxes, RefusesBoxesAndAmaxesOutsideTheContract) {
  const QuantGrid grid = quant_grid(QuantFormat::kFp8Row128, {4, 128}, DType::kFloat32, "t");
  std::vector<float> values(4 * 128);
  std::vector<float> amax(4);
  const Shape origin{0, 0};
  TensorView on_gpu{values.data(), DType::kFloat32, {4, 128}, {}, Device{DeviceType::kCuda, 0}};
  EXPECT_THROW(fold_amax(grid, on_gpu, origin, amax), InvalidArgument);
  EXPECT_THROW(fold_amax(grid, {values.data(), DType::kFloat32, {4, 128}, {1}}, origin, amax),
               InvalidArgument);  // strides for one dim of two
  const Shape far{std::numeric_limits<std::int64_t>::max(), 0};
  EXPECT_THROW(fold_amax(grid, {values.data(), DType::kFloat32, {1, 128}, {}}, far, amax),
               InvalidArgument);
  EXPECT_THROW(fold_amax(QuantGrid{}, {values.data(), DType::kFloat32, {4, 128}, {}}, origin, amax),
               InvalidArgument);
  EXPECT_THROW(quant_grid(QuantFormat::kFp8Row128, {-4, 128}, DType::kFloat32, "t"),
               InvalidArgument);
  std::vector<std::byte> scales(16);
  const std::vector<float> negative{1.0F, -2.0F, 0.0F, 3.0F};
  EXPECT_THROW(encode_scales(grid, negative, scales), InvalidArgument);
  EXPECT_EQ(e8m0_from_amax(-448.0F), e8m0_from_amax(448.0F));  // no UB on a bad value
}

TEST(QuantGrid, RefusesWhatAFormatCannotCarry) {
  EXPECT_THROW(quant_grid(QuantFormat::kFp8Block128, {4, 4, 4}, DType::kFloat32, "t"),
               InvalidArgument);
  EXPECT_THROW(quant_grid(QuantFormat::kMxfp8, {4, 33}, DType::kFloat32, "t"), InvalidArgument);
  EXPECT_THROW(quant_grid(QuantFormat::kFp8Row128, {4}, DType::kFloat64, "t"), InvalidArgument);
  EXPECT_THROW(quant_grid(QuantFormat::kFp8Row128, {}, DType::kFloat32, "t"), InvalidArgument);
  EXPECT_THROW(quant_grid(QuantFormat::kNone, {4}, DType::kFloat32, "t"), InvalidArgument);
  const QuantGrid grid = quant_grid(QuantFormat::kFp8Block128, {300, 129}, DType::kBFloat16, "t");
  EXPECT_EQ(grid.scale_shape(), (Shape{3, 2}));
  EXPECT_EQ(quant_grid(QuantFormat::kMxfp8, {2, 3, 64}, DType::kFloat32, "t").scale_shape(),
            (Shape{2, 3, 2}));
  std::vector<float> values(300 * 129);
  std::vector<float> amax(6);
  const Shape outside{200, 0};
  EXPECT_THROW(fold_amax(grid, {values.data(), DType::kBFloat16, {101, 129}, {}}, outside, amax),
               InvalidArgument);
  std::vector<float> short_amax(5);
  const Shape origin{0, 0};
  EXPECT_THROW(fold_amax(grid, {values.data(), DType::kBFloat16, {1, 1}, {}}, origin, short_amax),
               InvalidArgument);
  std::vector<std::byte> scales(23);
  EXPECT_THROW(encode_scales(grid, amax, scales), InvalidArgument);
  EXPECT_EQ(quant_format_from_name("mxfp8"), QuantFormat::kMxfp8);
  EXPECT_FALSE(quant_format_from_name("fp4").has_value());
}

// The device kernel's NaN rule (copies/quant_desc.h, x86_nan): a NaN result is the first NaN
// operand quietened, or the default NaN 0xFFC00000 where no operand was NaN, whatever the GPU's
// arithmetic gave (its canonical 0x7FFFFFFF); and on this host that is what the arithmetic gives.
TEST(QuantDesc, NanResultsAreChosenAsX86ChoosesThem) {
  using detail::bits_of;
  using detail::float_of;
  using detail::x86_nan;
  const float gpu_nan = float_of(0x7FFFFFFFU);
  const float inf = std::numeric_limits<float>::infinity();
  const float snan = float_of(0xFF800001U);  // negative, signalling
  EXPECT_EQ(bits_of(x86_nan(snan, 2.0F, gpu_nan)), 0xFFC00001U);
  EXPECT_EQ(bits_of(x86_nan(2.0F, float_of(0x7FC00000U), gpu_nan)), 0x7FC00000U);
  EXPECT_EQ(bits_of(x86_nan(inf, inf, gpu_nan)), 0xFFC00000U);
  EXPECT_EQ(bits_of(x86_nan(0.0F, inf, gpu_nan)), 0xFFC00000U);
  EXPECT_EQ(x86_nan(2.0F, 3.0F, 6.0F), 6.0F);
#if defined(__x86_64__)
  volatile float a = inf;  // computed at run time, by this CPU
  volatile float zero = 0.0F;
  EXPECT_EQ(bits_of(a / a), 0xFFC00000U);
  EXPECT_EQ(bits_of(zero * a), 0xFFC00000U);
  EXPECT_EQ(bits_of(snan * a), 0xFFC00001U);
#endif
}

}  // namespace
}  // namespace shardgather
