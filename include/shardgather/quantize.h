// Block-scaled FP8 quantization on the host: the exact quantizer that quantized transfers build
// on (docs/quantization.md states the contract this header implements).
//
//   QuantGrid grid = quant_grid(QuantFormat::kFp8Block128, {4096, 4096}, "weight");
//   std::vector<float> amax(grid.num_blocks());        // zeros
//   fold_amax(grid, shard, offset, amax);              // each rank: the blocks its box touches
//   ... the ranks sharing a block combine their amaxes (max, NaN wins) ...
//   encode_scales(grid, amax, scales);
//   quantize_box(grid, shard, offset, scales, fp8_bytes);
//
// A tensor is seen as a matrix of grid.rows x grid.cols elements: the last dim is the columns,
// the other dims are flattened into rows. Blocks tile that matrix from (0, 0); the last block of
// a row or column may be partial (fp8 formats; MXFP8 needs whole blocks). A box is a rank's
// N-d piece of the global tensor at `offset` (one value per dim): every function here gives
// the same bytes for a block whether it sees the block whole or in pieces, which is what makes
// a quantize on send bit-identical to quantizing the unsharded tensor.
//
// Formats (wire codes, never renumber):
//  - kFp8Block128: e4m3fn data, 128 x 128 blocks, fp32 inverse scales (scale = amax / 448):
//    Hugging Face FP8 checkpoints' `weight` and `weight_scale_inv`, `weight_block_size: [128,
//    128]`. The tensor must have 2 dims.
//  - kFp8Row128: e4m3fn data, 1 x 128 blocks along the last dim, fp32 inverse scales.
//  - kMxfp8: e4m3fn data, 1 x 32 blocks along the last dim, E8M0 scales (one byte, 2^(e-127)),
//    chosen as torch.testing._internal.common_quantized.to_mxfp chooses them (RCEIL).
//
// Inputs are host views of f32, bf16 or f16, any strides. Everything is pure computation on the
// caller's thread, no blocking; a call allocates only small vectors of the box's dims (quantize()
// also its amaxes); concurrent calls on distinct outputs are safe. Host views only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "shardgather/export.h"
#include "shardgather/types.h"

namespace shardgather {

enum class QuantFormat : std::uint8_t {
  kNone = 0,
  kFp8Block128 = 1,
  kFp8Row128 = 2,
  kMxfp8 = 3,
};

// "none", "fp8_e4m3_128x128", "fp8_e4m3_1x128", "mxfp8"; "invalid" for another code.
SHARDGATHER_API std::string_view quant_format_name(QuantFormat format) noexcept;
// The format a name gives, or nullopt.
SHARDGATHER_API std::optional<QuantFormat> quant_format_from_name(std::string_view name) noexcept;

// The largest finite e4m3fn magnitude, the value an amax maps to.
inline constexpr float kE4m3Max = 448.0F;

// A tensor's blocks under a format.
struct QuantGrid {
  QuantFormat format = QuantFormat::kNone;
  std::int64_t rows = 0;  // product of every dim but the last (1 for a 1-d tensor)
  std::int64_t cols = 0;  // the last dim
  std::int64_t block_rows = 1;
  std::int64_t block_cols = 1;
  Shape shape;  // the global shape, for mapping a box's offset to rows

  [[nodiscard]] std::int64_t scale_rows() const noexcept {
    return (rows + block_rows - 1) / block_rows;
  }
  [[nodiscard]] std::int64_t scale_cols() const noexcept {
    return (cols + block_cols - 1) / block_cols;
  }
  [[nodiscard]] std::int64_t num_blocks() const noexcept { return scale_rows() * scale_cols(); }
  // Bytes of one encoded scale: 4 (fp32) or 1 (E8M0).
  [[nodiscard]] std::size_t scale_size() const noexcept {
    return format == QuantFormat::kMxfp8 ? 1 : 4;
  }
  // The encoded scales' shape as torch and the checkpoints lay them out: [scale_rows,
  // scale_cols] for 128 x 128, shape[:-1] + [scale_cols] for the row formats.
  [[nodiscard]] SHARDGATHER_API Shape scale_shape() const;
};

// The grid of a tensor of `shape` and `dtype`. Throws InvalidArgument naming `what` (for
// example "params[3]") where the format does not apply: kNone, a dtype other than f32, bf16 or
// f16, 128 x 128 on a tensor that has not 2 dims, a 0-d tensor, MXFP8 on a last dim that is not
// a multiple of 32.
SHARDGATHER_API QuantGrid quant_grid(QuantFormat format, const Shape& shape, DType dtype,
                                     std::string_view what);

// Folds the absolute values of `box`'s elements into `amax` (one float per block, row-major
// over the grid; the caller zeroes it once), block by block: max, and a NaN wins (the block's
// amax becomes NaN). `offset` is the box's place in the global tensor. Throws InvalidArgument
// where the box does not lie inside the global shape or amax has not num_blocks() entries.
SHARDGATHER_API void fold_amax(const QuantGrid& grid, const TensorView& box,
                               std::span<const std::int64_t> offset, std::span<float> amax);

// Combines the amaxes of another piece of the same blocks into `into` (the same max).
SHARDGATHER_API void combine_amax(std::span<float> into, std::span<const float> other);

// The encoded scale of every block from its amax: fp32 amax / 448 (1 where that is 0: an all-zero
// block, or an amax that small; the quiet NaN for a NaN amax) or
// the E8M0 byte. `scales` holds num_blocks() * scale_size() bytes.
SHARDGATHER_API void encode_scales(const QuantGrid& grid, std::span<const float> amax,
                                   std::span<std::byte> scales);

// Quantizes `box` with the encoded scales into `out`: one e4m3fn byte per element, row-major in
// the box's shape.
SHARDGATHER_API void quantize_box(const QuantGrid& grid, const TensorView& box,
                                  std::span<const std::int64_t> offset,
                                  std::span<const std::byte> scales, std::byte* out);

// The inverse: e4m3fn bytes of a box (row-major in out's shape) times their block's scale,
// rounded to out's dtype (f32 or bf16; any strides).
SHARDGATHER_API void dequantize_box(const QuantGrid& grid, const std::byte* data,
                                    std::span<const std::int64_t> offset,
                                    std::span<const std::byte> scales, const TensorView& out);

// The whole tensor at once: fold_amax, encode_scales and quantize_box over one box.
SHARDGATHER_API void quantize(const QuantGrid& grid, const TensorView& full,
                              std::span<std::byte> scales, std::byte* out);

// One element's conversions, exposed for tests: an f32 (already within +-448, or NaN) to
// e4m3fn by round to nearest even; e4m3fn to f32; the E8M0 byte of an amax.
SHARDGATHER_API std::uint8_t e4m3_from_float(float value) noexcept;
SHARDGATHER_API float float_from_e4m3(std::uint8_t code) noexcept;
SHARDGATHER_API std::uint8_t e8m0_from_amax(float amax) noexcept;

}  // namespace shardgather
