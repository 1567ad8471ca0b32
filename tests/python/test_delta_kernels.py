"""The delta kernels' binding (shardgather._C._delta_*) and ReshardPlan.transfers: records round-
trip through torch tensors of every element size, strided destinations and checksums of views
agree with the packed bytes, errors arrive as InvalidArgumentError. The kernels themselves are
tested in tests/unit/delta_test.cc."""

import pytest
import torch

import shardgather
from shardgather import _C

DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.float64]


def _bits(t):
    """The tensor's bytes, comparable with torch.equal whatever the dtype (NaNs included)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _pair(dtype, n, density, seed):
    g = torch.Generator().manual_seed(seed)
    before = torch.randint(0, 256, (n * torch.tensor([], dtype=dtype).element_size(),),
                           dtype=torch.uint8, generator=g).view(dtype)
    after = before.clone()
    changed = torch.rand(n, generator=g) < density
    raw = after.view(torch.uint8).view(n, -1)
    raw[changed, 0] ^= 0x5A
    return before, after


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5])
def test_round_trip(dtype, density):
    n = 4099
    before, after = _pair(dtype, n, density, 7)
    out = torch.empty(_C._delta_max_record_bytes(n, before.element_size()), dtype=torch.uint8)
    nbytes, encoding, changed = _C._delta_encode(before, after, out, 12, 0.5)
    want = int((_bits(before).view(n, -1) != _bits(after).view(n, -1)).any(1).sum())
    assert changed == want
    if want == 0:
        assert (nbytes, encoding) == (0, 0)
        return
    assert nbytes % 8 == 0 and encoding in (1, 2, 3)
    dst = before.clone()
    bucket, ok, record_bytes, _ = _C._delta_apply(out[:nbytes], dst, 0, n)
    assert (bucket, ok, record_bytes) == (12, True, nbytes)
    assert torch.equal(_bits(dst), _bits(after))
    assert _C._delta_checksum(after, 0, n) == _C._delta_checksum(dst, 0, n)


def test_no_before_is_dense_and_records_chain():
    n = 1000
    before, after = _pair(torch.bfloat16, n, 0.01, 3)
    out = torch.zeros(2 * _C._delta_max_record_bytes(n, 2), dtype=torch.uint8)
    first, encoding, changed = _C._delta_encode(None, after, out, 1, 0.5)
    assert (first, encoding, changed) == (_C._delta_max_record_bytes(n, 2), 1, n)
    second, encoding, _ = _C._delta_encode(before, after, out[first:], 2, 0.5)
    assert encoding in (2, 3)
    dst = torch.zeros(n, dtype=torch.bfloat16)
    assert _C._delta_apply(out, dst, 0, n)[:3] == (1, True, first)  # reads one record only
    assert torch.equal(_bits(dst), _bits(after))
    dst = before.clone()
    assert _C._delta_apply(out[first:first + second], dst, 0, n)[:3] == (2, True, second)
    assert torch.equal(_bits(dst), _bits(after))


def test_strided_destination():
    rows, cols = 10, 300
    before, _ = _pair(torch.float32, rows * 100, 0.0, 5)
    after = before.clone()
    after.view(torch.int32)[[150, 151, 400, 650]] ^= 1
    big = torch.full((rows, cols), 7.0)
    view = big[:, 50:150]  # a column block: flat element i is view[i // 100, i % 100]
    view.copy_(before.view(rows, 100))
    assert _C._delta_checksum(view, 0, view.numel()) == _C._delta_checksum(before, 0, 1000)
    assert _C._delta_checksum(view, 120, 300) == _C._delta_checksum(before[120:420], 0, 300)
    out = torch.empty(_C._delta_max_record_bytes(600, 4), dtype=torch.uint8)
    nbytes, encoding, changed = _C._delta_encode(before[100:700], after[100:700], out, 9, 0.5)
    assert (encoding, changed) == (2, 4)  # pairs
    _, ok, _, _ = _C._delta_apply(out[:nbytes], view, 100, 600)
    assert ok
    assert torch.equal(_bits(view), _bits(after.view(rows, 100)))
    assert bool((big[:, :50] == 7.0).all()) and bool((big[:, 150:] == 7.0).all())
    # A destination that did not hold `before` at an element the record does not write (300):
    # written as asked, and the checksum says so.
    view.copy_(before.view(rows, 100))
    view[3, 0] = -view[3, 0]
    _, ok, _, _ = _C._delta_apply(out[:nbytes], view, 100, 600)
    assert not ok


def test_errors_are_invalid_argument():
    before, after = _pair(torch.bfloat16, 64, 0.2, 1)
    out = torch.empty(_C._delta_max_record_bytes(64, 2), dtype=torch.uint8)
    with pytest.raises(shardgather.InvalidArgumentError, match="want 168"):
        _C._delta_encode(before, after, out[:100], 0, 0.5)
    with pytest.raises(shardgather.InvalidArgumentError):
        _C._delta_encode(before.float(), after, out, 0, 0.5)
    with pytest.raises(shardgather.InvalidArgumentError):
        _C._delta_encode(before, after, out.view(torch.int8), 0, 0.5)
    nbytes, _, _ = _C._delta_encode(before, after, out, 44, 0.5)
    bad = out[:nbytes].clone()
    bad[0] ^= 1
    dst = before.clone()
    with pytest.raises(shardgather.InvalidArgumentError, match="bucket 44: bad magic"):
        _C._delta_apply(bad, dst, 0, 64)
    with pytest.raises(shardgather.InvalidArgumentError, match="elem_size 2"):
        _C._delta_apply(out[:nbytes], dst.view(torch.uint8), 0, 64)
    with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError
        _C._delta_apply(out[:nbytes], dst, 1, 64)
    assert torch.equal(_bits(dst), _bits(before))


def test_reshard_plan_transfers():
    # Tensor 0 (4 x 6 f32): rank 0 holds rows [0, 2), rank 1 rows [2, 4); rank 0 wants columns
    # [0, 3), rank 1 columns [3, 6). Tensor 1 (8 bf16): rank 0 holds it, both want it.
    layouts = [
        (torch.float32, [4, 6], [(0, [0, 0], [2, 6]), (1, [2, 0], [2, 6])],
         [(0, [0, 0], [4, 3]), (1, [0, 3], [4, 3])]),
        (torch.bfloat16, [8], [(0, [0], [8])], [(1, [0], [8]), (0, [0], [8])]),
    ]
    plans = [_C.ReshardPlan(layouts, 2, r, fan_out=False) for r in range(2)]
    sends0, receives0 = plans[0].transfers
    sends1, receives1 = plans[1].transfers
    assert sends0 == [(0, 0, 0, 0, (0, 0), (2, 3)), (0, 1, 1, 1, (0,), (8,)),
                      (1, 0, 0, 0, (0, 3), (2, 3)), (1, 1, 1, 1, (0,), (8,))]
    assert receives0 == [(0, 0, 0, 0, (0, 0), (2, 3)), (0, 1, 1, 1, (0,), (8,)),
                         (1, 0, 0, 0, (2, 0), (2, 3))]
    assert sends1 == [(0, 0, 0, 0, (2, 0), (2, 3)), (1, 0, 0, 0, (2, 3), (2, 3))]
    # What rank r sends to rank p, rank p receives from rank r, in the same order.
    for r, (sends, _) in enumerate([(sends0, receives0), (sends1, receives1)]):
        for p, receives in enumerate([receives0, receives1]):
            mine = [t[1:] for t in sends if t[0] == p]
            theirs = [t[1:] for t in receives if t[0] == r]
            assert mine == theirs
