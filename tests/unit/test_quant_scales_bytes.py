"""bridge/quant_scales._same_bytes: the bit-for-bit check before a layer's cloned block scales are swapped for the
state dict's own tensor (issue #34: compared 8 bytes at a time where the layout allows). Oracle: Python's bytes of
each tensor."""
from __future__ import annotations

import pytest
import torch

from ditkit.bridge.quant_scales import _same_bytes


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())


BYTE_DTYPES = [torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu]


@pytest.mark.parametrize("dtype", BYTE_DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 64, 1000, 4096])
def test_same_bytes_sees_one_differing_byte_anywhere(dtype, n):
    a = (torch.arange(n, dtype=torch.int64) * 37 % 251).to(torch.uint8)
    assert _same_bytes(a.view(dtype), a.clone().view(dtype)) is True
    for pos in sorted({0, n // 2, n - 1}):
        b = a.clone()
        b[pos] ^= 1                                       # one bit of one byte
        assert _raw(a) != _raw(b)
        assert _same_bytes(a.view(dtype), b.view(dtype)) is False


def test_same_bytes_is_about_bytes_not_values():
    nan = torch.full((16,), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)    # e4m3fn NaN: NaN != NaN
    assert not torch.equal(nan, nan.clone())
    assert _same_bytes(nan, nan.clone()) is True
    z, nz = torch.zeros(8, dtype=torch.uint8), torch.full((8,), 0x80, dtype=torch.uint8)   # +0.0 and -0.0
    assert torch.equal(z.view(torch.float8_e4m3fn), nz.view(torch.float8_e4m3fn))
    assert _same_bytes(z.view(torch.float8_e4m3fn), nz.view(torch.float8_e4m3fn)) is False


@pytest.mark.parametrize("start", [0, 1, 3, 8, 11])
def test_same_bytes_on_slices_at_any_offset_and_strided_views(start):
    base = (torch.arange(200, dtype=torch.int64) * 13 % 256).to(torch.uint8)
    a = base[start:start + 64]
    b = base.clone()[start:start + 64]
    assert a.storage_offset() == start
    assert _same_bytes(a, b) is True
    c = b.clone()
    c[63] ^= 0x80
    assert _same_bytes(a, c) is False
    m = base[:128].reshape(16, 8)
    mt, mt2 = m.t(), m.clone().t()                        # transposed, not contiguous
    assert not mt.is_contiguous()
    assert _same_bytes(mt, mt2) is True
    mt3 = mt2.clone()
    mt3[7, 15] ^= 4
    assert _same_bytes(mt, mt3) is False
    assert _same_bytes(mt, m) is False                    # same bytes in memory, other shape


def test_same_bytes_refuses_other_shapes_sizes_and_compares_wider_dtypes_by_value_and_dtype():
    a = torch.zeros(16, dtype=torch.uint8)
    assert _same_bytes(a, torch.zeros(8, 2, dtype=torch.uint8)) is False
    assert _same_bytes(a, torch.zeros(17, dtype=torch.uint8)) is False
    assert _same_bytes(torch.zeros(4, dtype=torch.int16), torch.zeros(4, dtype=torch.uint8)) is False
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.arange(8, dtype=dt)
        assert _same_bytes(x, x.clone()) is True
        y = x.clone()
        y[5] += 1
        assert _same_bytes(x, y) is False
    assert _same_bytes(torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.bfloat16)) is False
    assert _same_bytes(torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.float32)) is False


# ---------------------------------------------------------------- the heap trims of ScaleSharing (every TRIM_BYTES)

def test_trim_at_the_threshold_on_both_sides_and_forced_only_when_something_was_freed(monkeypatch):
    from ditkit.bridge import quant_scales as QS

    calls = []
    monkeypatch.setattr(QS.host_memory, "release_free_heap", lambda: calls.append(1))
    s = QS.ScaleSharing({})
    s.untrimmed = QS.TRIM_BYTES - 1
    s.trim(force=False)
    assert calls == [] and s.untrimmed == QS.TRIM_BYTES - 1
    s.untrimmed = QS.TRIM_BYTES
    s.trim(force=False)
    assert calls == [1] and s.untrimmed == 0
    s.trim(force=True)                                   # nothing freed since: no call
    assert calls == [1]
    s.untrimmed = 1
    s.trim(force=True)
    assert calls == [1, 1] and s.untrimmed == 0
    assert QS.TRIM_BYTES == 4 << 20


def _qparam(data, scale):
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Params:
        scale: torch.Tensor
        block_scale: torch.Tensor

    p = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    p._qdata = data
    p._params = Params(torch.ones(()), scale.clone())
    return p


def test_share_block_scales_trims_once_per_threshold_and_once_at_the_end(monkeypatch):
    from ditkit.bridge import quant_scales as QS

    calls = []
    monkeypatch.setattr(QS.host_memory, "release_free_heap", lambda: calls.append(1))
    monkeypatch.setattr(QS, "TRIM_BYTES", 3000)
    sd = {}
    for i in range(5):                                   # 5 layers of 1024-byte block scales
        sd[f"l{i}.weight"] = torch.full((8, 8), i, dtype=torch.uint8)
        sd[f"l{i}.weight_scale"] = torch.full((32, 32), i + 1, dtype=torch.uint8).view(torch.float8_e4m3fn)
    m = torch.nn.Module()
    with QS.share_block_scales(sd) as sharing:
        for i in range(5):
            m.register_parameter(f"w{i}", _qparam(sd[f"l{i}.weight"], sd[f"l{i}.weight_scale"]))
            assert len(calls) == (i + 1) // 3           # 3 x 1024 >= 3000 after the 3rd layer, not before
        assert sharing.untrimmed == 2048
    assert sharing.shared == 5 and sharing.shared_bytes == 5 * 1024
    assert len(calls) == 2 and sharing.untrimmed == 0   # the rest, once, when the context ends
