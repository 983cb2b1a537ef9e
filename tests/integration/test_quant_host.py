"""kernels/quant.py against the real host's own layout quantize / dequantize (comfy/quant_ops.py +
comfy_kitchen), bit for bit, for every format of QUANT_ALGOS that ditkit writes."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def qops(comfy):
    import comfy.quant_ops as q

    return q


def _host_formats():
    # the formats are decided by the running host; collected lazily through the fixture below
    from ditkit.kernels.quant import FORMATS

    return list(FORMATS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8)


def _weights(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 2)).to(dtype)
    w.view(-1)[:5] = torch.tensor([0.0, -0.0, 1e-6, -1e-7, 3.0]).to(dtype)
    return w


def _host_sd(q, w, fmt, scale="recalculate"):
    conf = q.QUANT_ALGOS[fmt]
    cls = q.get_layout_class(conf["comfy_tensor_layout"])
    qd, params = cls.quantize(w.clone(), scale=scale)
    qt = q.QuantizedTensor(qd, conf["comfy_tensor_layout"], params)
    return qt, qt.state_dict("weight")


@pytest.mark.parametrize("fmt", _host_formats())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 96), (130, 200), (33, 17)])
def test_reference_equals_host_layout_quantize(qops, fmt, dtype, shape):
    from ditkit.kernels import quant as Q

    if fmt not in qops.QUANT_ALGOS:
        pytest.skip(f"this host's QUANT_ALGOS has no {fmt}")
    w = _weights(shape, dtype, seed=sum(shape))
    _, host = _host_sd(qops, w, fmt)
    data, scales = Q.quantize(w, fmt)
    mine = {"weight": data, **{f"{k}": v for k, v in scales.items()}}
    assert set(mine) == set(host)
    for k in host:
        assert mine[k].dtype == host[k].dtype, k
        assert tuple(mine[k].shape) == tuple(host[k].shape), k
        assert torch.equal(_bits(mine[k]), _bits(host[k])), k
    # and the same layout on disk: storage_layout predicts it from the shape
    lay = Q.storage_layout(shape, fmt)
    assert {k: (tuple(v.shape), v.dtype) for k, v in host.items()} == lay


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group_elems", [1, 40 * 32, 1 << 19])
def test_finite_cpu_path_in_row_groups_equals_host(qops, fmt, dtype, group_elems, monkeypatch):
    """What the loader runs (``finite=True``: nvfp4's in-place CPU rows) in row groups of one row, of 40 blocks and
    the default size, on a contiguous and a transposed source: the host's bits."""
    from ditkit.kernels import quant as Q

    if fmt not in qops.QUANT_ALGOS:
        pytest.skip(f"this host's QUANT_ALGOS has no {fmt}")
    monkeypatch.setattr(Q, "GROUP_ELEMS", group_elems)
    w = _weights((260, 200), dtype, seed=7)
    w[9, :16] = 0.0                                       # an all-zero block
    _, host = _host_sd(qops, w, fmt)
    for src in (w, w.t().contiguous().t()):
        data, scales = Q.quantize(src, fmt, finite=True)
        mine = {"weight": data, **scales}
        assert set(mine) == set(host)
        for k in host:
            assert mine[k].dtype == host[k].dtype, k
            assert torch.equal(_bits(mine[k]), _bits(host[k])), k


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "nvfp4"])
def test_all_zero_weight_equals_host_with_scale_one(qops, fmt):
    from ditkit.kernels import quant as Q

    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    _, host = _host_sd(qops, w, fmt, scale=1.0)
    data, scales = Q.quantize(w, fmt)
    for k, v in {"weight": data, **scales}.items():
        assert torch.equal(_bits(v), _bits(host[k])), k


@pytest.mark.parametrize("fmt", _host_formats())
def test_dequantize_equals_host_dequantize(qops, fmt):
    from ditkit.kernels import quant as Q

    w = _weights((130, 200), torch.float32, seed=5)
    qt, host = _host_sd(qops, w, fmt)
    ref = qt.dequantize().float()
    data, scales = Q.quantize(w, fmt)
    got = Q.dequantize(data, scales, fmt, (130, 200))
    assert got.shape == ref.shape
    assert torch.equal(got, ref)
