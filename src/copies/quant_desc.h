// One quantizer step over one box, for the CUDA kernel (device_cuda.cu) and its host twin
// (run_quant_on_host): the element arithmetic both run, so that the CPU tests over the fake
// device exercise the code the GPU runs, element by element, against the host quantizer
// (quantize.cc, which takes its scalar rules from here too).
//
// A box is a strided N-d view at `offset` in a window's grid (quantize.h: the last dim is the
// columns, the other dims are flattened into rows). Element e of the box is its e-th in
// row-major order over `shape`; its FP8 code is byte e of `codes`, as quantize_box lays them out.
// Every operation is the IEEE one the host quantizer does, in its order, with no fused
// multiply-add (the CUDA side uses the _rn intrinsics, which nvcc never contracts).
#pragma once

#include <cstdint>
#include <cstring>

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

#include "copies/copy_desc.h"  // SG_HOST_DEVICE

#if !defined(__CUDACC__)
#include <cstddef>
#include <span>

#include "shardgather/quantize.h"
#include "shardgather/types.h"
#endif

namespace shardgather::detail {

inline constexpr int kQuantMaxDims = 8;

enum class QuantStep : std::uint8_t {
  kFoldAmax,    // |x| folded into `scales` (uint32 bits of each block's fp32 maximum)
  kQuantize,    // `view` (f32, bf16 or f16) to `codes` with the encoded `scales`
  kDequantize,  // `codes` times the encoded `scales` into `view` (f32 or bf16)
};

// Element types, as shardgather::DType numbers them (types.h): checked where a desc is made.
enum class QuantElement : std::uint8_t { kF32, kBf16, kF16 };

struct QuantBoxDesc {
  QuantStep step = QuantStep::kFoldAmax;
  QuantElement element = QuantElement::kF32;
  bool mxfp8 = false;  // E8M0 scales, multiplied by; else fp32 scales, divided by
  std::int32_t ndim = 0;
  std::int64_t elements = 0;  // product of shape
  std::int64_t shape[kQuantMaxDims] = {};
  std::int64_t strides[kQuantMaxDims] = {};    // the view's, in elements
  std::int64_t grid_rows[kQuantMaxDims] = {};  // grid rows per index along each leading dim
  std::int64_t offset[kQuantMaxDims] = {};     // the box's place in the grid
  std::int64_t block_rows = 1;
  std::int64_t block_cols = 1;
  std::int64_t scale_cols = 1;
  void* view = nullptr;           // the box's elements
  std::uint8_t* codes = nullptr;  // its FP8 bytes, row-major in `shape`
  void* scales = nullptr;         // amax bits (kFoldAmax) or encoded scales
};

SG_HOST_DEVICE inline std::uint32_t bits_of(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<std::uint32_t>(x);
#endif
}

SG_HOST_DEVICE inline float float_of(std::uint32_t u) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

SG_HOST_DEVICE inline float add_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

SG_HOST_DEVICE inline float mul_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

SG_HOST_DEVICE inline float div_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// bf16 and f16 bits as fp32, exactly. f16 is branch-free, and with no fp32 subnormal on the way
// (a DAZ/FTZ mode, which torch's own conversion ignores, would flush it): a subnormal is its
// mantissa, a normal fp32, times 2^-24; a normal is rebiased (15 to 127) on the bits; Inf and NaN
// keep their payload.
SG_HOST_DEVICE inline float float_of_bf16(std::uint16_t v) noexcept {
  return float_of(static_cast<std::uint32_t>(v) << 16);
}

SG_HOST_DEVICE inline float float_of_f16(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1FU;
  const std::uint32_t man = h & 0x3FFU;
  const std::uint32_t sub = bits_of(mul_rn(static_cast<float>(man), 0x1p-24F));
  const std::uint32_t normal = ((exp + (127U - 15U)) << 23) | (man << 13);
  const std::uint32_t special = 0x7F800000U | (man << 13);
  const std::uint32_t bits = exp == 0 ? sub : (exp == 0x1FU ? special : normal);
  return float_of(bits | sign);
}

// |x|'s bits: their order as integers is the order of |x|, and every NaN is above +inf, so a
// max over them is the max of |x| with a NaN winning.
SG_HOST_DEVICE inline std::int32_t abs_bits(float x) noexcept {
  return static_cast<std::int32_t>(bits_of(x) & 0x7FFFFFFFU);
}

// f32 (within +-448, or NaN) to e4m3fn, round to nearest even. Signed 32-bit lanes throughout:
// SSE2 compares and shifts them, not unsigned ones.
SG_HOST_DEVICE inline std::uint8_t e4m3_code(float value) noexcept {
  const auto bits = static_cast<std::int32_t>(bits_of(value));
  const std::int32_t mag = bits & 0x7FFFFFFF;
  const std::int32_t sign = (bits >> 24) & 0x80;
  constexpr std::int32_t kNanFrom = 0x43F00000;     // 480: rounds past 448
  constexpr std::int32_t kNormalFrom = 0x3C800000;  // 2^-6, the least normal e4m3
  // Below 2^-6 the quantum is 2^-9: adding 2^14 (whose ulp is 2^-9) rounds to it, to even.
  const std::int32_t sub = static_cast<std::int32_t>(bits_of(
                               add_rn(float_of(static_cast<std::uint32_t>(mag)), 16384.0F))) -
                           0x46800000;
  // Above it, rebias the exponent (127 to 7) and round the 20 dropped bits to even.
  const std::int32_t normal = ((mag - (120 << 23)) + 0x7FFFF + ((mag >> 20) & 1)) >> 20;
  const std::int32_t code = mag >= kNanFrom ? 0x7F : (mag < kNormalFrom ? sub : normal);
  return static_cast<std::uint8_t>(code | sign);
}

// clamp(x, -448, 448) (a NaN kept, as torch.clamp keeps it), then e4m3_code: the clamp done on
// the bits, where the compiler can vectorise it.
SG_HOST_DEVICE inline std::uint8_t e4m3_saturated(float x) noexcept {
  const auto bits = static_cast<std::int32_t>(bits_of(x));
  const std::int32_t mag = bits & 0x7FFFFFFF;
  constexpr std::int32_t k448 = 0x43E00000;
  const std::int32_t clamped = mag > k448 && mag <= 0x7F800000 ? k448 : mag;
  return e4m3_code(float_of(static_cast<std::uint32_t>(clamped | (bits & ~0x7FFFFFFF))));
}

// 2^k for k in [-149, 127], exactly, from its bits.
SG_HOST_DEVICE inline float pow2(int k) noexcept {
  if (k >= -126) {
    return float_of(static_cast<std::uint32_t>(k + 127) << 23);
  }
  return float_of(1U << static_cast<unsigned>(k + 149));  // subnormal
}

// An e4m3fn code's value: every one is a small integer times a power of two, so this is exact.
SG_HOST_DEVICE inline float e4m3_value(std::uint8_t code) noexcept {
  const int exp = (code >> 3) & 0xF;
  const int man = code & 0x7;
  float mag = exp == 0 ? mul_rn(static_cast<float>(man), 0x1p-9F)
                       : mul_rn(static_cast<float>(8 + man), pow2(exp - 10));
  if ((code & 0x7F) == 0x7F) {
    mag = float_of(0x7FC00000U);  // the quiet NaN
  }
  return (code & 0x80) != 0 ? -mag : mag;
}

// f32 to bf16, round to nearest even; NaN to a quiet NaN.
SG_HOST_DEVICE inline std::uint16_t bf16_from_float(float x) noexcept {
  const std::uint32_t u = bits_of(x);
  if ((u & 0x7FFFFFFFU) > 0x7F800000U) {
    return static_cast<std::uint16_t>((u >> 16) | 0x40U);
  }
  return static_cast<std::uint16_t>((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16);
}

inline constexpr int kE8m0Bias = 127;

// Block b's fp32 scale (the host's scales may be any caller's bytes, so read unaligned there).
SG_HOST_DEVICE inline float fp32_scale(const void* scales, std::int64_t block) noexcept {
#if defined(__CUDA_ARCH__)
  return static_cast<const float*>(scales)[block];
#else
  float s = 0;
  std::memcpy(&s, static_cast<const unsigned char*>(scales) + block * 4, 4);
  return s;
#endif
}

// The fp32 factor a block's elements are multiplied by (MXFP8) or divided by (fp8 blocks), and
// the one a dequantizer multiplies by, from the encoded scales.
SG_HOST_DEVICE inline float quantize_factor(bool mxfp8, const void* scales,
                                            std::int64_t block) noexcept {
  if (mxfp8) {
    const int e = static_cast<const std::uint8_t*>(scales)[block];
    return e == 0 ? 1.0F : pow2(kE8m0Bias - e);  // to_mxfp's descale_fp
  }
  return fp32_scale(scales, block);
}

SG_HOST_DEVICE inline float dequantize_factor(bool mxfp8, const void* scales,
                                              std::int64_t block) noexcept {
  if (mxfp8) {
    const int e = static_cast<const std::uint8_t*>(scales)[block];
    return e == 0xFF ? float_of(0x7FC00000U) : pow2(e - kE8m0Bias);
  }
  return fp32_scale(scales, block);
}

// Where element e of the box lies: its place in the view (elements) and its block in the grid.
struct QuantPlace {
  std::int64_t at = 0;
  std::int64_t block = 0;
};

SG_HOST_DEVICE inline QuantPlace quant_place(const QuantBoxDesc& d, std::int64_t e) noexcept {
  const int last = d.ndim - 1;
  const std::int64_t col = e % d.shape[last];
  std::int64_t rest = e / d.shape[last];
  std::int64_t at = col * d.strides[last];
  std::int64_t row = 0;
  for (int k = last - 1; k >= 0; --k) {
    const std::int64_t i = rest % d.shape[k];
    rest /= d.shape[k];
    at += i * d.strides[k];
    row += (d.offset[k] + i) * d.grid_rows[k];
  }
  const std::int64_t block =
      row / d.block_rows * d.scale_cols + (d.offset[last] + col) / d.block_cols;
  return {at, block};
}

SG_HOST_DEVICE inline float quant_load(const QuantBoxDesc& d, std::int64_t at) noexcept {
  switch (d.element) {
    case QuantElement::kBf16:
      return float_of_bf16(static_cast<const std::uint16_t*>(d.view)[at]);
    case QuantElement::kF16:
      return float_of_f16(static_cast<const std::uint16_t*>(d.view)[at]);
    default:
      return static_cast<const float*>(d.view)[at];
  }
}

// Folds |x| into its block's maximum: an atomic max on the GPU, a plain one in the host twin
// (which runs the elements one after another).
SG_HOST_DEVICE inline void fold_into(std::uint32_t* amax, std::int64_t block,
                                     std::int32_t bits) noexcept {
#if defined(__CUDA_ARCH__)
  atomicMax(amax + block, static_cast<unsigned>(bits));
#else
  amax[block] = amax[block] > static_cast<std::uint32_t>(bits) ? amax[block]
                                                               : static_cast<std::uint32_t>(bits);
#endif
}

// r = a op b as x86 gives it where r is NaN: the first NaN operand, quietened, or where neither
// operand is NaN (inf / inf, 0 x inf) the default NaN, 0xFFC00000. The GPU's arithmetic gives its
// one canonical NaN (0x7FFFFFFF) instead; choosing here makes the bytes agree with the host
// quantizer on x86 (another host ISA's own default NaN may differ: the host loops use the CPU's).
SG_HOST_DEVICE inline float x86_nan(float a, float b, float r) noexcept {
  if (abs_bits(a) > 0x7F800000) {
    return float_of(bits_of(a) | 0x00400000U);
  }
  if (abs_bits(b) > 0x7F800000) {
    return float_of(bits_of(b) | 0x00400000U);
  }
  return abs_bits(r) > 0x7F800000 ? float_of(0xFFC00000U) : r;
}

// Element e's work in step d.step.
SG_HOST_DEVICE inline void quant_element(const QuantBoxDesc& d, std::int64_t e) noexcept {
  const QuantPlace p = quant_place(d, e);
  switch (d.step) {
    case QuantStep::kFoldAmax:
      fold_into(static_cast<std::uint32_t*>(d.scales), p.block, abs_bits(quant_load(d, p.at)));
      return;
    case QuantStep::kQuantize: {
      const float x = quant_load(d, p.at);
      const float s = quantize_factor(d.mxfp8, d.scales, p.block);
      d.codes[e] = e4m3_saturated(x86_nan(x, s, d.mxfp8 ? mul_rn(x, s) : div_rn(x, s)));
      return;
    }
    case QuantStep::kDequantize: {
      const float v = e4m3_value(d.codes[e]);
      const float s = dequantize_factor(d.mxfp8, d.scales, p.block);
      const float value = x86_nan(v, s, mul_rn(v, s));
      if (d.element == QuantElement::kBf16) {
        static_cast<std::uint16_t*>(d.view)[p.at] = bf16_from_float(value);
      } else {
        static_cast<float*>(d.view)[p.at] = value;
      }
      return;
    }
  }
}

#if !defined(__CUDACC__)
// The step over `box` at `offset` in `grid`'s tensor (quantize.h's box, any device): its
// codes and scales (or amax bits) in the memory given. InvalidArgument where quantize.h's
// functions would refuse the box, or where it has more than kQuantMaxDims dims.
QuantBoxDesc quant_box_desc(QuantStep step, const QuantGrid& grid, const TensorView& box,
                            std::span<const std::int64_t> offset, std::byte* codes, void* scales);

// quantize.h's checks of a box against its grid (its dims, its place inside the tensor).
void check_quant_box(const QuantGrid& grid, const TensorView& box,
                     std::span<const std::int64_t> offset);

// The kernel's work on the host, element after element (the fake device's launch).
void run_quant_on_host(const QuantBoxDesc& d) noexcept;
#endif

}  // namespace shardgather::detail
