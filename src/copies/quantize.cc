// The host quantizer. Every element goes through the same fp32 operations as the references
// named in docs/quantization.md, in the same order, so that a block quantized in pieces on
// several ranks gives the bytes it gives whole. The inner loops are branch-free over one block
// segment of one row (a constant scale), which the compiler vectorises.
#include "shardgather/quantize.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#include "copies/quant_desc.h"

#include "shardgather/errors.h"

namespace shardgather {
namespace {

// Element loads as fp32, exactly (every bf16 and f16 value is an fp32 value).
struct LoadF32 {
  using T = float;
  static float get(float v) noexcept { return v; }
};
struct LoadBf16 {
  using T = std::uint16_t;
  static float get(std::uint16_t v) noexcept { return detail::float_of_bf16(v); }
};
struct LoadF16 {
  using T = std::uint16_t;
  static float get(std::uint16_t h) noexcept { return detail::float_of_f16(h); }
};

using detail::abs_bits;
using detail::bf16_from_float;
using detail::e4m3_code;
using detail::e4m3_saturated;
using detail::kE8m0Bias;

// The strides of a view in elements (a contiguous view's when it has none).
Shape strides_of(const TensorView& view) {
  if (!view.strides.empty()) {
    return view.strides;
  }
  Shape strides(view.shape.size(), 1);
  for (std::size_t d = view.shape.size(); d-- > 1;) {
    strides[d - 1] = strides[d] * view.shape[d];
  }
  return strides;
}

std::string shape_text(std::span<const std::int64_t> dims) {
  std::string text = "[";
  for (std::size_t d = 0; d < dims.size(); ++d) {
    text += (d == 0 ? "" : ", ") + std::to_string(dims[d]);
  }
  return text + "]";
}

// A box's rows: each leading index of the box, its row in the grid and its first element.
struct BoxRows {
  std::int64_t count = 1;     // rows of the box
  std::int64_t cols = 0;      // elements per row
  std::int64_t col0 = 0;      // the box's first column in the grid
  std::int64_t col_step = 1;  // elements between neighbours in a row
  Shape lead_shape;           // the box's leading dims
  Shape lead_strides;         // their strides in the view
  Shape lead_grid;            // and in grid rows
  Shape lead_offset;          // the box's offset along them
};

BoxRows box_rows(const QuantGrid& grid, const TensorView& box,
                 std::span<const std::int64_t> offset) {
  if (box.device.type != DeviceType::kCpu) {
    throw InvalidArgument("quantize: the host quantizer reads host memory only (a box on " +
                          std::string(device_type_name(box.device.type)) + ")");
  }
  detail::check_quant_box(grid, box, offset);
  const std::size_t ndim = grid.shape.size();
  const Shape strides = strides_of(box);
  BoxRows rows;
  rows.cols = box.shape[ndim - 1];
  rows.col0 = offset[ndim - 1];
  rows.col_step = strides[ndim - 1];
  std::int64_t grid_step = 1;
  for (std::size_t d = ndim - 1; d-- > 0;) {
    rows.lead_shape.insert(rows.lead_shape.begin(), box.shape[d]);
    rows.lead_strides.insert(rows.lead_strides.begin(), strides[d]);
    rows.lead_grid.insert(rows.lead_grid.begin(), grid_step);
    rows.lead_offset.insert(rows.lead_offset.begin(), offset[d]);
    rows.count *= box.shape[d];
    grid_step *= grid.shape[d];
  }
  if (rows.cols == 0) {
    rows.count = 0;
  }
  return rows;
}

// Calls fn(box_row, grid_row, element_offset) for every row of the box, in row-major order.
// Not inlined into its caller (it runs once per box): GCC 12 at -O2 then misreads the index
// vector's lifetime (a false -Wfree-nonheap-object).
template <typename Fn>
[[gnu::noinline]] void for_each_row(const BoxRows& rows, Fn&& fn) {
  const std::size_t lead = rows.lead_shape.size();
  Shape index(lead, 0);
  for (std::int64_t r = 0; r < rows.count; ++r) {
    std::int64_t grid_row = 0;
    std::int64_t element = 0;
    for (std::size_t d = 0; d < lead; ++d) {
      grid_row += (rows.lead_offset[d] + index[d]) * rows.lead_grid[d];
      element += index[d] * rows.lead_strides[d];
    }
    fn(r, grid_row, element);
    for (std::size_t d = lead; d-- > 0;) {
      if (++index[d] < rows.lead_shape[d]) {
        break;
      }
      index[d] = 0;
    }
  }
}

// Calls fn(block, first, count) for each block segment of a row: `count` elements of the box
// row starting at `first`, all in block `block` of the grid.
template <typename Fn>
void for_each_segment(const QuantGrid& grid, const BoxRows& rows, std::int64_t grid_row, Fn&& fn) {
  const std::int64_t first_block = grid_row / grid.block_rows * grid.scale_cols();
  const std::int64_t end = rows.col0 + rows.cols;
  std::int64_t block_col = rows.col0 / grid.block_cols;  // one division per row, not per block
  std::int64_t col = rows.col0;
  while (col < end) {
    const std::int64_t stop = std::min(end, (block_col + 1) * grid.block_cols);
    fn(static_cast<std::size_t>(first_block + block_col), col - rows.col0, stop - col);
    col = stop;
    ++block_col;
  }
}

// Runs `kernel.template operator()<Load, Step>` with the box's element type and, where the
// row is contiguous, a compile-time step of 1.
template <typename Kernel>
void dispatch(DType dtype, std::int64_t step, Kernel&& kernel) {
  const auto run = [&]<typename Load>() {
    if (step == 1) {
      kernel.template operator()<Load, 1>();
    } else {
      kernel.template operator()<Load, 0>();
    }
  };
  switch (dtype) {
    case DType::kFloat32:
      run.template operator()<LoadF32>();
      return;
    case DType::kBFloat16:
      run.template operator()<LoadBf16>();
      return;
    case DType::kFloat16:
      run.template operator()<LoadF16>();
      return;
    default:
      throw InvalidArgument(std::string("quantize: a tensor of dtype ") +
                            std::string(dtype_name(dtype)) + " cannot be quantized");
  }
}

void check_scales(const QuantGrid& grid, std::size_t bytes) {
  const auto want = static_cast<std::size_t>(grid.num_blocks()) * grid.scale_size();
  if (bytes != want) {
    throw InvalidArgument("quantize: " + std::to_string(bytes) + " bytes of scales for " +
                          std::to_string(grid.num_blocks()) + " blocks of " +
                          std::string(quant_format_name(grid.format)) + " (want " +
                          std::to_string(want) + ")");
  }
}

// The fp32 factor a block's elements are multiplied by (MXFP8) or divided by (fp8 blocks),
// and the one a dequantizer multiplies by, from its encoded scale.
float block_scale(const QuantGrid& grid, std::span<const std::byte> scales, std::size_t block) {
  return detail::quantize_factor(grid.format == QuantFormat::kMxfp8, scales.data(),
                                 static_cast<std::int64_t>(block));
}

float decoded_scale(const QuantGrid& grid, std::span<const std::byte> scales, std::size_t block) {
  return detail::dequantize_factor(grid.format == QuantFormat::kMxfp8, scales.data(),
                                   static_cast<std::int64_t>(block));
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (std::size_t code = 0; code < values.size(); ++code) {
      values[code] = detail::e4m3_value(static_cast<std::uint8_t>(code));
    }
    return values;
  }();
  return table;
}

// The inner loops, over one block segment of one row: free functions with unaliased
// pointers, so that the compiler vectorises them (kStep 1: a contiguous row).
template <typename Load, int kStep>
[[gnu::always_inline]] inline std::int32_t amax_loop(const typename Load::T* __restrict src,
                                                     std::int64_t step, std::int64_t count) {
  if constexpr (kStep == 1) {
    step = 1;
  }
  std::int32_t top = 0;
  for (std::int64_t j = 0; j < count; ++j) {
    top = std::max(top, abs_bits(Load::get(src[j * step])));
  }
  return top;
}

template <typename Load, int kStep, bool kMultiply>
[[gnu::always_inline]] inline void quantize_loop(const typename Load::T* __restrict src,
                                                 std::int64_t step, std::int64_t count, float s,
                                                 std::uint8_t* __restrict dst) {
  if constexpr (kStep == 1) {
    step = 1;
  }
  for (std::int64_t j = 0; j < count; ++j) {
    const float x = Load::get(src[j * step]);
    dst[j] = e4m3_saturated(kMultiply ? x * s : x / s);
  }
}

// A run of one row inside one block: `count` elements from column `first` of the row, all
// quantized with `scale`.
struct Segment {
  std::int64_t first = 0;
  std::int64_t count = 0;
  float scale = 1.0F;
};

// Each loop for the baseline (SSE2) and for AVX2, and the quantize loop of contiguous rows also
// written with AVX-512 intrinsics (GCC's own vectorisation of it spills; the intrinsics narrow
// with one vpmovdb), chosen at run time by what the CPU has. All compute the same IEEE
// operations (no FMA), so they give the same bytes. SHARDGATHER_QUANTIZE_ISA=sse2 or avx2 caps
// the choice; the tests run each.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHARDGATHER_QUANTIZE_AVX2 1

enum class Isa : std::uint8_t { kSse2, kAvx2, kAvx512 };

Isa isa() noexcept {
  static const Isa chosen = [] {
    Isa best = Isa::kSse2;
    if (__builtin_cpu_supports("avx2")) {
      best = Isa::kAvx2;
    }
    if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
      best = Isa::kAvx512;
    }
    const char* cap = std::getenv("SHARDGATHER_QUANTIZE_ISA");
    const std::string_view name = cap == nullptr ? "" : cap;
    if (name == "sse2") {
      return Isa::kSse2;
    }
    return name == "avx2" ? std::min(best, Isa::kAvx2) : best;
  }();
  return chosen;
}

template <typename Load, int kStep>
[[gnu::target("avx2")]] std::int32_t amax_avx2(const typename Load::T* src, std::int64_t step,
                                               std::int64_t count) {
  return amax_loop<Load, kStep>(src, step, count);
}

template <typename Load, int kStep, bool kMultiply>
[[gnu::target("avx2")]] void quantize_avx2(const typename Load::T* src, std::int64_t step,
                                           std::int64_t count, float s, std::uint8_t* dst) {
  quantize_loop<Load, kStep, kMultiply>(src, step, count, s, dst);
}

#define SG_AVX512 gnu::target("avx512f,avx512bw,avx512vl")
// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*(), which its
// -Wmaybe-uninitialized reports once inlined (GCC bug 105593); nothing here reads one.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// 16 elements as fp32, exactly as Load::get gives them; lanes outside `mask` are 0.
template <typename Load>
[[SG_AVX512]] inline __m512 load16(const typename Load::T* src, __mmask16 mask) noexcept {
  if constexpr (std::is_same_v<Load, LoadF32>) {
    return _mm512_maskz_loadu_ps(mask, src);
  } else {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, src));
    if constexpr (std::is_same_v<Load, LoadBf16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    } else {  // LoadF16's bit rule, lane by lane
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x8000)), 16);
      const __m512i exp = _mm512_and_si512(_mm512_srli_epi32(h, 10), _mm512_set1_epi32(0x1F));
      const __m512i man = _mm512_and_si512(h, _mm512_set1_epi32(0x3FF));
      const __m512i sub =
          _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(man), _mm512_set1_ps(0x1p-24F)));
      const __m512i man_bits = _mm512_slli_epi32(man, 13);
      const __m512i normal = _mm512_or_si512(
          _mm512_slli_epi32(_mm512_add_epi32(exp, _mm512_set1_epi32(127 - 15)), 23), man_bits);
      const __m512i special = _mm512_or_si512(_mm512_set1_epi32(0x7F800000), man_bits);
      __m512i bits = _mm512_mask_mov_epi32(
          normal, _mm512_cmpeq_epi32_mask(exp, _mm512_set1_epi32(0x1F)), special);
      bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(exp, _mm512_setzero_si512()), sub);
      return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
    }
  }
}

// e4m3_saturated, 16 lanes at a time.
[[SG_AVX512]] inline __m512i e4m3_16(__m512 y) noexcept {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i k448 = _mm512_set1_epi32(0x43E00000);
  __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __mmask16 over = _mm512_cmpgt_epi32_mask(mag, k448) &
                         _mm512_cmple_epi32_mask(mag, _mm512_set1_epi32(0x7F800000));
  mag = _mm512_mask_mov_epi32(mag, over, k448);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(16384.0F))),
      _mm512_set1_epi32(0x46800000));
  const __m512i round = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_srai_epi32(
      _mm512_add_epi32(_mm512_sub_epi32(mag, _mm512_set1_epi32(0x3C000000 - 0x7FFFF)), round), 20);
  __m512i code = _mm512_mask_mov_epi32(
      normal, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(0x3C800000)), sub);
  code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epi32_mask(mag, _mm512_set1_epi32(0x43F00000)),
                               _mm512_set1_epi32(0x7F));
  return _mm512_or_si512(code, sign);
}

// quantize_loop over the block segments of one contiguous row, in one call (MXFP8's segments
// are 32 elements: a call per segment would cost as much as its work).
template <typename Load, bool kMultiply>
[[SG_AVX512]] void quantize_row_avx512(const typename Load::T* row,
                                       std::span<const Segment> segments, std::uint8_t* dst) {
  for (const Segment& segment : segments) {
    const __m512 scale = _mm512_set1_ps(segment.scale);
    const typename Load::T* src = row + segment.first;
    std::uint8_t* out = dst + segment.first;
    for (std::int64_t j = 0; j < segment.count; j += 16) {
      const std::int64_t left = segment.count - j;
      const auto mask = static_cast<__mmask16>(left >= 16 ? 0xFFFFU : (1U << left) - 1U);
      const __m512 x = load16<Load>(src + j, mask);
      const __m512 y = kMultiply ? _mm512_mul_ps(x, scale) : _mm512_div_ps(x, scale);
      _mm512_mask_cvtepi32_storeu_epi8(out + j, mask, e4m3_16(y));
    }
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#undef SG_AVX512
#endif

template <typename Load, int kStep>
std::int32_t block_amax(const typename Load::T* src, std::int64_t step, std::int64_t count) {
#ifdef SHARDGATHER_QUANTIZE_AVX2
  if (isa() != Isa::kSse2) {
    return amax_avx2<Load, kStep>(src, step, count);
  }
#endif
  return amax_loop<Load, kStep>(src, step, count);
}

// Quantizes one row's block segments (`step`: the row's element stride).
template <typename Load, int kStep, bool kMultiply>
void quantize_row(const typename Load::T* row, std::int64_t step, std::span<const Segment> segments,
                  std::uint8_t* dst) {
#ifdef SHARDGATHER_QUANTIZE_AVX2
  const Isa chosen = isa();
  if (kStep == 1 && chosen == Isa::kAvx512) {
    quantize_row_avx512<Load, kMultiply>(row, segments, dst);
    return;
  }
  if (chosen != Isa::kSse2) {
    for (const Segment& g : segments) {
      quantize_avx2<Load, kStep, kMultiply>(row + g.first * step, step, g.count, g.scale,
                                            dst + g.first);
    }
    return;
  }
#endif
  for (const Segment& g : segments) {
    quantize_loop<Load, kStep, kMultiply>(row + g.first * step, step, g.count, g.scale,
                                          dst + g.first);
  }
}

}  // namespace

namespace detail {

void check_quant_box(const QuantGrid& grid, const TensorView& box,
                     std::span<const std::int64_t> offset) {
  const std::size_t ndim = grid.shape.size();
  if (grid.format == QuantFormat::kNone || ndim == 0) {
    throw InvalidArgument("quantize: a grid that quant_grid did not make (no format or no dims)");
  }
  if (!box.strides.empty() && box.strides.size() != box.shape.size()) {
    throw InvalidArgument("quantize: a box of shape " + shape_text(box.shape) + " with strides " +
                          shape_text(box.strides));
  }
  if (box.shape.size() != ndim || offset.size() != ndim) {
    throw InvalidArgument("quantize: a box of shape " + shape_text(box.shape) + " at offset " +
                          shape_text(offset) + " does not have the " + std::to_string(ndim) +
                          " dims of the tensor " + shape_text(grid.shape));
  }
  for (std::size_t d = 0; d < ndim; ++d) {
    if (offset[d] < 0 || box.shape[d] < 0 || box.shape[d] > grid.shape[d] ||
        offset[d] > grid.shape[d] - box.shape[d]) {
      throw InvalidArgument("quantize: a box of shape " + shape_text(box.shape) + " at offset " +
                            shape_text(offset) + " does not lie inside the tensor " +
                            shape_text(grid.shape) + " (dim " + std::to_string(d) + ")");
    }
  }
}

}  // namespace detail

std::string_view quant_format_name(QuantFormat format) noexcept {
  switch (format) {
    case QuantFormat::kNone:
      return "none";
    case QuantFormat::kFp8Block128:
      return "fp8_e4m3_128x128";
    case QuantFormat::kFp8Row128:
      return "fp8_e4m3_1x128";
    case QuantFormat::kMxfp8:
      return "mxfp8";
  }
  return "invalid";
}

std::optional<QuantFormat> quant_format_from_name(std::string_view name) noexcept {
  for (const QuantFormat format : {QuantFormat::kNone, QuantFormat::kFp8Block128,
                                   QuantFormat::kFp8Row128, QuantFormat::kMxfp8}) {
    if (quant_format_name(format) == name) {
      return format;
    }
  }
  return std::nullopt;
}

Shape QuantGrid::scale_shape() const {
  if (format == QuantFormat::kFp8Block128) {
    return {scale_rows(), scale_cols()};
  }
  Shape out(shape.begin(), shape.end() - 1);
  out.push_back(scale_cols());
  return out;
}

QuantGrid quant_grid(QuantFormat format, const Shape& shape, DType dtype, std::string_view what) {
  const std::string where = std::string(what) + " (" + std::string(quant_format_name(format)) +
                            ", shape " + shape_text(shape) + ", " + std::string(dtype_name(dtype)) +
                            ")";
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    throw InvalidArgument("quantize " + where + ": only f32, bf16 and f16 tensors are quantized");
  }
  QuantGrid grid;
  grid.format = format;
  grid.shape = shape;
  switch (format) {
    case QuantFormat::kFp8Block128:
      if (shape.size() != 2) {
        throw InvalidArgument("quantize " + where + ": 128 x 128 blocks need a 2-d tensor");
      }
      grid.block_rows = 128;
      grid.block_cols = 128;
      break;
    case QuantFormat::kFp8Row128:
      grid.block_cols = 128;
      break;
    case QuantFormat::kMxfp8:
      grid.block_cols = 32;
      if (!shape.empty() && shape.back() % 32 != 0) {
        throw InvalidArgument("quantize " + where +
                              ": MXFP8 needs a last dim that is a multiple of 32");
      }
      break;
    default:
      throw InvalidArgument("quantize " + where + ": not a quantization format");
  }
  if (shape.empty()) {
    throw InvalidArgument("quantize " + where + ": a 0-d tensor has no blocks");
  }
  if (std::any_of(shape.begin(), shape.end(), [](std::int64_t d) { return d < 0; })) {
    throw InvalidArgument("quantize " + where + ": a negative dim");
  }
  grid.cols = shape.back();
  grid.rows = 1;
  for (std::size_t d = 0; d + 1 < shape.size(); ++d) {
    grid.rows *= shape[d];
  }
  return grid;
}

void fold_amax(const QuantGrid& grid, const TensorView& box, std::span<const std::int64_t> offset,
               std::span<float> amax) {
  if (std::cmp_not_equal(amax.size(), grid.num_blocks())) {
    throw InvalidArgument("quantize: " + std::to_string(amax.size()) + " amaxes for " +
                          std::to_string(grid.num_blocks()) + " blocks");
  }
  const BoxRows rows = box_rows(grid, box, offset);
  dispatch(box.dtype, rows.col_step, [&]<typename Load, int kStep>() {
    const auto* base = static_cast<const typename Load::T*>(box.data);
    const std::int64_t step = kStep == 1 ? 1 : rows.col_step;
    for_each_row(rows, [&](std::int64_t, std::int64_t grid_row, std::int64_t element) {
      const auto* row = base + element;
      for_each_segment(
          grid, rows, grid_row, [&](std::size_t block, std::int64_t first, std::int64_t count) {
            const std::int32_t top = block_amax<Load, kStep>(row + first * step, step, count);
            amax[block] = std::bit_cast<float>(std::max(abs_bits(amax[block]), top));
          });
    });
  });
}

void combine_amax(std::span<float> into, std::span<const float> other) {
  if (into.size() != other.size()) {
    throw InvalidArgument("quantize: combining " + std::to_string(other.size()) + " amaxes into " +
                          std::to_string(into.size()));
  }
  for (std::size_t b = 0; b < into.size(); ++b) {
    into[b] = std::bit_cast<float>(std::max(abs_bits(into[b]), abs_bits(other[b])));
  }
}

std::uint8_t e8m0_from_amax(float amax) noexcept {
  const float descale = std::fabs(amax) / kE4m3Max;  // an amax is not negative; never UB
  if (std::isnan(descale)) {
    return 0xFF;
  }
  // ceil of log2 rounded to fp32 first, as to_mxfp computes it: an exact ceil would differ
  // where log2 lies within half an fp32 ulp above an integer.
  const auto log2_f32 = static_cast<float>(std::log2(static_cast<double>(descale)));
  const float exponent = std::clamp(std::ceil(log2_f32), static_cast<float>(-kE8m0Bias),
                                    static_cast<float>(kE8m0Bias));
  return static_cast<std::uint8_t>(static_cast<int>(exponent) + kE8m0Bias);
}

void encode_scales(const QuantGrid& grid, std::span<const float> amax,
                   std::span<std::byte> scales) {
  check_scales(grid, scales.size());
  if (std::cmp_not_equal(amax.size(), grid.num_blocks())) {
    throw InvalidArgument("quantize: " + std::to_string(amax.size()) + " amaxes for " +
                          std::to_string(grid.num_blocks()) + " blocks");
  }
  for (std::size_t b = 0; b < amax.size(); ++b) {
    if (std::signbit(amax[b]) && !std::isnan(amax[b]) && amax[b] != 0.0F) {
      throw InvalidArgument("quantize: block " + std::to_string(b) + " has a negative amax (" +
                            std::to_string(amax[b]) + "): amaxes are maxima of |x|");
    }
    if (grid.format == QuantFormat::kMxfp8) {
      scales[b] = std::byte{e8m0_from_amax(amax[b])};
    } else {
      // A NaN amax's payload depends on which NaN the block held; the scale is the one quiet
      // NaN, as torch's amax gives it. A scale that is 0 (an all-zero block, or an amax below
      // 448 x 2^-150 whose quotient underflows) is 1: x / 0 would make NaN of every zero.
      const float quotient = amax[b] / kE4m3Max;
      const float s = std::isnan(amax[b]) ? std::numeric_limits<float>::quiet_NaN()
                      : quotient == 0.0F  ? 1.0F
                                          : quotient;
      std::memcpy(scales.data() + b * 4, &s, 4);
    }
  }
}

std::uint8_t e4m3_from_float(float value) noexcept { return e4m3_code(value); }

float float_from_e4m3(std::uint8_t code) noexcept { return e4m3_table()[code]; }

void quantize_box(const QuantGrid& grid, const TensorView& box,
                  std::span<const std::int64_t> offset, std::span<const std::byte> scales,
                  std::byte* out) {
  check_scales(grid, scales.size());
  const BoxRows rows = box_rows(grid, box, offset);
  const bool multiply = grid.format == QuantFormat::kMxfp8;
  std::vector<Segment> segments;
  dispatch(box.dtype, rows.col_step, [&]<typename Load, int kStep>() {
    const auto* base = static_cast<const typename Load::T*>(box.data);
    const std::int64_t step = kStep == 1 ? 1 : rows.col_step;
    for_each_row(rows, [&](std::int64_t r, std::int64_t grid_row, std::int64_t element) {
      segments.clear();
      for_each_segment(grid, rows, grid_row,
                       [&](std::size_t block, std::int64_t first, std::int64_t count) {
                         segments.push_back({first, count, block_scale(grid, scales, block)});
                       });
      auto* dst = reinterpret_cast<std::uint8_t*>(out) + r * rows.cols;
      if (multiply) {
        quantize_row<Load, kStep, true>(base + element, step, segments, dst);
      } else {
        quantize_row<Load, kStep, false>(base + element, step, segments, dst);
      }
    });
  });
}

void dequantize_box(const QuantGrid& grid, const std::byte* data,
                    std::span<const std::int64_t> offset, std::span<const std::byte> scales,
                    const TensorView& out) {
  check_scales(grid, scales.size());
  if (out.dtype != DType::kFloat32 && out.dtype != DType::kBFloat16) {
    throw InvalidArgument(std::string("dequantize: an output of dtype ") +
                          std::string(dtype_name(out.dtype)) + " (f32 or bf16 only)");
  }
  const BoxRows rows = box_rows(grid, out, offset);
  const auto& table = e4m3_table();
  const auto* codes = reinterpret_cast<const std::uint8_t*>(data);
  for_each_row(rows, [&](std::int64_t r, std::int64_t grid_row, std::int64_t element) {
    const std::uint8_t* src = codes + r * rows.cols;
    for_each_segment(grid, rows, grid_row,
                     [&](std::size_t block, std::int64_t first, std::int64_t count) {
                       const float s = decoded_scale(grid, scales, block);
                       for (std::int64_t j = first; j < first + count; ++j) {
                         const float value = table[src[j]] * s;
                         const std::int64_t at = element + j * rows.col_step;
                         if (out.dtype == DType::kFloat32) {
                           static_cast<float*>(out.data)[at] = value;
                         } else {
                           static_cast<std::uint16_t*>(out.data)[at] = bf16_from_float(value);
                         }
                       }
                     });
  });
}

void quantize(const QuantGrid& grid, const TensorView& full, std::span<std::byte> scales,
              std::byte* out) {
  std::vector<float> amax(static_cast<std::size_t>(grid.num_blocks()), 0.0F);
  const Shape origin(grid.shape.size(), 0);
  fold_amax(grid, full, origin, amax);
  encode_scales(grid, amax, scales);
  quantize_box(grid, full, origin, scales, out);
}

}  // namespace shardgather
