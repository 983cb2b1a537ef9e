"""bridge/quant_scales._same_bytes: the bit-for-bit check before a layer's cloned block scales are swapped for the
state dict's own tensor (issue #34: compared 8 bytes at a time where the layout allows). Oracle: Python's bytes of
each tensor."""
from __future__ import annotations

import dataclasses

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


# ------------------------------------------------ written from the mutation survivors (tools/mutation.py, 2026-12-05)
@pytest.mark.parametrize("x_off, y_off", [(0, 1), (0, 3), (0, 9), (9, 0), (1, 0), (8, 8), (0, 0)])
def test_same_bytes_on_unequal_offsets_of_the_two_tensors(x_off, y_off):
    """Each side's alignment decides the 8-byte comparison on its own: a misaligned side is compared byte by byte
    (never viewed as int64, which would raise), whatever the other side's offset."""
    base = (torch.arange(64, dtype=torch.int64) * 29 % 256).to(torch.uint8)
    data = base[:16]
    x = torch.zeros(40, dtype=torch.uint8)
    y = torch.zeros(40, dtype=torch.uint8)
    x[x_off:x_off + 16] = data
    y[y_off:y_off + 16] = data
    a, b = x[x_off:x_off + 16], y[y_off:y_off + 16]
    assert (a.storage_offset(), b.storage_offset()) == (x_off, y_off)
    assert _same_bytes(a, b) is True
    y[y_off + 15] ^= 1
    assert _same_bytes(a, b) is False


@dataclasses.dataclass(frozen=True)
class _Both:
    block_scale: object
    scale: object


@dataclasses.dataclass(frozen=True)
class _ScaleOnly:
    scale: object


def _param(qdata, params):
    p = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    if qdata is not _MISSING:
        p._qdata = qdata
    if params is not _MISSING:
        p._params = params
    return p


_MISSING = object()


def _sharing(orig, data):
    from ditkit.bridge.quant_scales import ScaleSharing

    return ScaleSharing({data.data_ptr(): orig})


def test_hook_shares_the_original_and_counts_its_bytes_exactly():
    data = torch.zeros(4, 4, dtype=torch.uint8)
    orig = torch.arange(8, dtype=torch.float32)                         # 32 bytes: 4 per element
    s = _sharing(orig, data)
    assert (s.candidates, s.shared, s.shared_bytes, s.untrimmed) == (1, 0, 0, 0)
    params = _Both(orig.clone(), torch.ones(()))
    assert s.hook(None, "w", _param(data, params)) is None
    assert params.block_scale.data_ptr() == orig.data_ptr() and params.block_scale.dtype == torch.float32
    assert (s.shared, s.shared_bytes, s.untrimmed) == (1, 32, 32)
    assert s.originals == {}                                             # the layer is done: popped by its key


@pytest.mark.parametrize("qdata, params", [
    (_MISSING, _MISSING),                                                # a plain parameter
    ("tensor", _MISSING),                                                # _qdata without _params
    (5, "dataclass"),                                                    # _qdata not a tensor
    ("tensor", "namespace"),                                             # _params not a dataclass
    ("tensor", "scale only, wrong bytes"),                              # a dataclass without block_scale
])
def test_hook_leaves_what_it_does_not_recognise(qdata, params):
    import types

    data = torch.zeros(4, 4, dtype=torch.uint8)
    orig = torch.arange(8, dtype=torch.uint8)
    s = _sharing(orig, data)
    q = data if qdata == "tensor" else qdata
    clone = orig.clone()
    p = {"dataclass": _Both(clone, torch.ones(())), "namespace": types.SimpleNamespace(block_scale=clone, scale=clone),
         "scale only, wrong bytes": _ScaleOnly(clone + 1), _MISSING: _MISSING}[params]
    assert s.hook(None, "w", _param(q, p)) is None
    assert (s.shared, s.shared_bytes, s.untrimmed) == (0, 0, 0) and len(s.originals) == 1
    if p is not _MISSING and hasattr(p, "block_scale"):
        assert p.block_scale is clone


def test_hook_skips_a_field_that_is_not_a_tensor_or_differs_and_shares_the_next():
    data = torch.zeros(4, 4, dtype=torch.uint8)
    orig = torch.arange(8, dtype=torch.uint8)
    for first in (None, orig.clone() + 1, torch.ones(())):             # not a tensor / other bytes / 0-d
        s = _sharing(orig, data)
        params = _Both(first, orig.clone())
        s.hook(None, "w", _param(data, params))
        assert params.block_scale is first and params.scale.data_ptr() == orig.data_ptr(), first
        assert (s.shared, s.shared_bytes) == (1, 8)


def test_hook_never_shares_across_element_sizes_or_zero_dim():
    data = torch.zeros(4, 4, dtype=torch.uint8)
    orig = torch.arange(32, dtype=torch.uint8)
    same_bytes_wider = orig.clone().view(torch.float32)                  # the same 32 bytes as 8 float32
    s = _sharing(orig, data)
    params = _ScaleOnly(same_bytes_wider)
    s.hook(None, "w", _param(data, params))
    assert params.scale is same_bytes_wider and s.shared == 0
    zero = torch.tensor(7, dtype=torch.uint8)                            # a 0-d original and a 0-d clone
    s = _sharing(zero, data)
    params = _ScaleOnly(zero.clone())
    s.hook(None, "w", _param(data, params))
    assert s.shared == 0 and params.scale.data_ptr() != zero.data_ptr()


def test_record_writes_the_report_only_for_a_quantized_load_with_candidates():
    import types

    from ditkit.bridge.quant_scales import ScaleSharing

    s = ScaleSharing({1: torch.zeros(2), 2: torch.zeros(2), 3: torch.zeros(2)})
    s.shared, s.shared_bytes = 2, 96
    q = types.SimpleNamespace()
    s.record(q)
    assert q.block_scales == {"layers_kept": 2, "layers": 3, "bytes_not_copied": 96}
    s.record(None)                                                       # a load as stored: nothing to write into
    empty = types.SimpleNamespace()
    ScaleSharing({}).record(empty)
    assert not hasattr(empty, "block_scales")
