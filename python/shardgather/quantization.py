"""Block-scaled FP8 on the host, with the quantizer quantized transfers use.

    data, scale_inv = quantize(weight, "fp8_e4m3_128x128")   # float8_e4m3fn, float32
    weight_again = dequantize(data, scale_inv, "fp8_e4m3_128x128", torch.bfloat16)

Formats (docs/quantization.md states each one's rule and its exactness):

- ``"fp8_e4m3_128x128"``: 2-d tensors, 128 x 128 blocks, float32 inverse scales of shape
  ``[ceil(rows/128), ceil(cols/128)]``: Hugging Face FP8 checkpoints' ``weight`` and
  ``weight_scale_inv`` (``weight_block_size: [128, 128]``);
- ``"fp8_e4m3_1x128"``: 1 x 128 blocks along the last dim, float32 inverse scales of shape
  ``shape[:-1] + [ceil(cols/128)]``;
- ``"mxfp8"``: 32-element blocks along the last dim (a multiple of 32), float8_e8m0fnu scales
  of shape ``shape[:-1] + [cols/32]``, bit-identical to
  ``torch.testing._internal.common_quantized.to_mxfp`` (which returns them in the other order).

Inputs are CPU tensors of float32, bfloat16 or float16, any strides. An argument of the wrong
kind (a format that is no str, data that is no tensor) raises InvalidTypeError (a TypeError),
a bad value InvalidArgumentError (a ValueError). The work runs without the GIL.
"""

import torch

from . import _shardgather as _C
from ._shardgather import InvalidArgumentError, InvalidTypeError

FORMATS = ("fp8_e4m3_128x128", "fp8_e4m3_1x128", "mxfp8")

__all__ = ["FORMATS", "dequantize", "quantize"]


def quantize(tensor, format):  # noqa: A002  (the name the docs use)
    """(data, scales): ``tensor`` quantized in ``format``, as float8_e4m3fn data of its shape and
    the format's scales."""
    _check_kinds(format, tensor=tensor)
    data, scales = _C._quantize(tensor, format)
    data = data.view(torch.float8_e4m3fn)
    if format == "mxfp8":
        scales = scales.view(torch.float8_e8m0fnu)
    return data, scales


def dequantize(data, scales, format, dtype=torch.bfloat16):  # noqa: A002
    """The tensor of ``dtype`` (float32 or bfloat16) that ``data`` and ``scales`` encode: each
    element's e4m3fn value times its block's scale in float32, then rounded to ``dtype``."""
    _check_kinds(format, data=data, scales=scales)
    if not isinstance(dtype, torch.dtype):
        raise InvalidTypeError("dequantize: dtype must be a torch.dtype, got %s"
                               % type(dtype).__name__)
    if data.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise InvalidArgumentError(
            f"dequantize: data of {data.dtype} (float8_e4m3fn, or its bytes as uint8)")
    if scales.dtype in (torch.float8_e8m0fnu, torch.int8):
        scales = scales.view(torch.uint8)
    return _C._dequantize(data.view(torch.uint8), scales, format, dtype)


def _check_kinds(format, **tensors):  # noqa: A002
    """InvalidTypeError for a format that is no str or an argument that is no tensor (the
    extension would refuse them with its own message, naming neither)."""
    if not isinstance(format, str):
        raise InvalidTypeError("format must be a str (%s), got %s"
                               % (", ".join(FORMATS), type(format).__name__))
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError("%s must be a torch.Tensor, got %s" % (name, type(t).__name__))
