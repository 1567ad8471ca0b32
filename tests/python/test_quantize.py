"""The host quantizer against the references docs/quantization.md names: MXFP8 against
torch.testing._internal.common_quantized.to_mxfp, the FP8 block formats against the formula (s =
amax / 448 in fp32, 1 for an all-zero block; x / s clamped to +-448, rounded to e4m3fn by
torch), dequantized outputs against code x scale. Bit for bit, NaN included: a NaN's sign and
payload follow the same IEEE operations on both sides."""

import math

import pytest
import torch
from torch.testing._internal.common_quantized import to_mxfp

import shardgather
from shardgather.quantization import FORMATS, dequantize, quantize

BLOCKS = {"fp8_e4m3_128x128": (128, 128), "fp8_e4m3_1x128": (1, 128)}


def _values(shape, dtype, seed, specials=False, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    if specials and x.numel():
        flat = x.view(-1)
        pick = torch.rand(flat.shape, generator=g)
        flat[pick < 0.2] = 0.0
        flat[(pick > 0.5) & (pick < 0.502)] = float("nan")
        flat[(pick > 0.6) & (pick < 0.601)] = float("-inf")
        flat[(pick > 0.7) & (pick < 0.705)] = 1e30 if dtype != torch.float16 else 60000.0
        if x.dim() >= 1 and x.shape[-1] >= 32:  # a whole zero block
            x.reshape(-1, x.shape[-1])[0, :32] = 0.0
    return x.to(dtype)


def _fp8_reference(x, block_rows, block_cols):
    """The FP8 block formula on the full tensor, in torch."""
    cols = x.shape[-1]
    xf = x.float().reshape(-1, cols)
    rows = xf.shape[0]
    pr, pc = -rows % block_rows, -cols % block_cols
    padded = torch.nn.functional.pad(xf, (0, pc, 0, pr))  # zeros leave every amax as it is
    blocks = padded.reshape(padded.shape[0] // block_rows, block_rows,
                            padded.shape[1] // block_cols, block_cols)
    amax = blocks.abs().amax(dim=(1, 3))
    quotient = amax / 448.0
    s = torch.where(quotient == 0, torch.ones_like(amax), quotient)
    full_s = s.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]
    q = (xf / full_s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    scale_shape = list(s.shape) if block_rows > 1 else list(x.shape[:-1]) + [s.shape[1]]
    return q.reshape(x.shape), s.reshape(scale_shape)


def _same_bits(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else \
        torch.equal(a.view(torch.int32), b.view(torch.int32))


SHAPES_2D = [(1, 1), (3, 5), (128, 128), (129, 257), (300, 130), (256, 384), (0, 7)]


@pytest.mark.parametrize("fmt", ["fp8_e4m3_128x128", "fp8_e4m3_1x128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("specials", [False, True])
def test_fp8_blocks_match_the_formula(fmt, dtype, specials):
    for i, shape in enumerate(SHAPES_2D):
        # 1e-44: f32 blocks whose amax / 448 underflows to 0 (their scale is 1, as a zero
        # block's), and fp32 subnormals on the way.
        for scale in (1e-44, 1e-6, 1.0, 3e3) if dtype == torch.float32 else (1e-6, 1.0, 3e3):
            x = _values(shape, dtype, seed=i, specials=specials, scale=scale)
            data, scales = quantize(x, fmt)
            want_data, want_scales = _fp8_reference(x, *BLOCKS[fmt])
            _same_bits(data, want_data)
            _same_bits(scales, want_scales)


def test_row_blocks_take_any_leading_dims_and_strides():
    x = _values((4, 3, 300), torch.bfloat16, seed=3, specials=True)
    data, scales = quantize(x, "fp8_e4m3_1x128")
    want_data, want_scales = _fp8_reference(x, 1, 128)
    assert scales.shape == (4, 3, 3)
    _same_bits(data, want_data)
    _same_bits(scales, want_scales)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = _values((300, 130), dtype, seed=4, specials=True).t()  # a transposed view
        for fmt, blocks in BLOCKS.items():
            for got, want in zip(quantize(t, fmt), _fp8_reference(t.contiguous(), *blocks)):
                _same_bits(got, want)
        m = _values((64, 128), dtype, seed=6, specials=True)[:, ::2]  # every other column
        ref = m.contiguous().float() if dtype == torch.float16 else m.contiguous()
        for got, want in zip(quantize(m, "mxfp8"), reversed(to_mxfp(ref, 32, "mxfp8"))):
            _same_bits(got, want)


def test_f16_subnormals_survive_flush_to_zero():
    # Under a DAZ/FTZ mode (torch.set_flush_denormal) the quantizer still reads f16 subnormals
    # as torch's conversion does (exactly); the rest flushes as the references' own ops do.
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.float16).reshape(-1, 64)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        want_scales, want_data = to_mxfp(x.float(), 32, "mxfp8")
        want_fp8 = _fp8_reference(x, 1, 128)
        data, scales = quantize(x, "mxfp8")
        fp8 = quantize(x, "fp8_e4m3_1x128")
    finally:
        torch.set_flush_denormal(False)
    _same_bits(data, want_data)
    _same_bits(scales, want_scales)
    for got, want in zip(fp8, want_fp8):
        _same_bits(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("specials", [False, True])
def test_mxfp8_matches_to_mxfp(dtype, specials):
    for i, shape in enumerate([(32,), (5, 64), (33, 96), (2, 3, 160), (0, 32), (256, 1024)]):
        # 1e-37: blocks whose E8M0 exponent is 0 though not all zero (their factor is 1).
        for scale in (1e-37, 1e-30, 1e-6, 1.0, 3e3, 1e30):
            if dtype == torch.float16 and not 1e-6 <= scale <= 3e3:
                continue
            x = _values(shape, dtype, seed=10 + i, specials=specials, scale=scale)
            data, scales = quantize(x, "mxfp8")
            # to_mxfp takes bf16 and fp32; an f16 tensor is its fp32 values.
            ref = x.float() if dtype == torch.float16 else x
            want_scales, want_data = to_mxfp(ref, block_size=32, format="mxfp8")
            _same_bits(data, want_data)
            _same_bits(scales, want_scales)


def test_mxfp8_scale_where_log2_rounds_to_an_integer():
    # amax / 448 = 2^k (1 + 2^-23): its fp32 log2 is k exactly for |k| >= 4, so to_mxfp's scale
    # is 2^k and the amax element saturates; for small |k| it is 2^(k+1).
    rows = []
    for k in range(-20, 21):
        amax = 448.0 * math.ldexp(1.0, k) * (1 + 2**-23)
        row = torch.linspace(-1, 1, 32) * amax
        row[7] = torch.tensor(amax, dtype=torch.float32)
        rows.append(row)
    x = torch.stack(rows).float()
    data, scales = quantize(x, "mxfp8")
    want_scales, want_data = to_mxfp(x, block_size=32, format="mxfp8")
    _same_bits(data, want_data)
    _same_bits(scales, want_scales)


def test_e4m3_rounding_matches_torch_over_the_fp32_range():
    # Blocks whose amax is 448 have scale 1, so the data is x rounded to e4m3fn by itself.
    bits = torch.arange(0, 0x43E00000, 97, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.cat([x, -x])
    x = torch.nn.functional.pad(x, (0, -x.numel() % 127)).reshape(-1, 127)
    x = torch.cat([x, torch.full((x.shape[0], 1), 448.0)], dim=1)
    data, scales = quantize(x, "fp8_e4m3_1x128")
    assert torch.all(scales == 1.0)
    _same_bits(data, x.to(torch.float8_e4m3fn))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_dequantize_is_code_times_scale(fmt, out):
    x = _values((256, 320), torch.bfloat16, seed=5, specials=True)
    data, scales = quantize(x, fmt)
    got = dequantize(data, scales, fmt, out)
    if fmt == "mxfp8":
        s = scales.float().repeat_interleave(32, 1)
    else:
        br, bc = BLOCKS[fmt]
        s = scales.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:256, :320]
    want = (data.float() * s).to(out)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)  # a NaN's bits are not part of the contract
    assert torch.equal(got[~nan], want[~nan])


def test_bad_arguments_raise_invalid_argument():
    with pytest.raises(shardgather.InvalidArgumentError, match="2-d tensor"):
        quantize(torch.zeros(2, 2, 128), "fp8_e4m3_128x128")
    with pytest.raises(shardgather.InvalidArgumentError, match="multiple of 32"):
        quantize(torch.zeros(4, 48), "mxfp8")
    with pytest.raises(shardgather.InvalidArgumentError, match="f32, bf16 and f16"):
        quantize(torch.zeros(4, 128, dtype=torch.float64), "fp8_e4m3_1x128")
    with pytest.raises(shardgather.InvalidArgumentError, match="unknown format"):
        quantize(torch.zeros(4, 128), "fp4")
    data, scales = quantize(torch.ones(4, 128), "fp8_e4m3_1x128")
    with pytest.raises(shardgather.InvalidArgumentError, match="scales of"):
        dequantize(data, scales[:2], "fp8_e4m3_1x128")
    data, scales = quantize(torch.ones(256, 384), "fp8_e4m3_128x128")
    with pytest.raises(shardgather.InvalidArgumentError, match=r"want float32 \[2, 3\]"):
        dequantize(data, scales.t().contiguous(), "fp8_e4m3_128x128")  # transposed scales
    with pytest.raises(shardgather.InvalidArgumentError, match="float8_e4m3fn"):
        dequantize(data.view(torch.float8_e5m2), scales, "fp8_e4m3_128x128")
    data, scales = quantize(torch.ones(4, 64), "mxfp8")
    with pytest.raises(shardgather.InvalidArgumentError, match="want float8_e8m0fnu"):
        dequantize(data, scales.view(-1), "mxfp8")  # flattened scales
    with pytest.raises(shardgather.InvalidArgumentError, match="0-d"):
        quantize(torch.tensor(1.0), "fp8_e4m3_1x128")
