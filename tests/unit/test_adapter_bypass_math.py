"""bridge/adapter_bypass: the per-call ``h(x) = Σ s·ΔW x`` (no host needed for the math).

Oracle: ΔW built whole in float64 here (``B @ A``, an explicit Kronecker product, the Hadamard product, dense),
rows permuted by a row map written here, placed at a row slice of the output; ``h`` must equal ``x @ ΔWᵀ`` within
float32 rounding for every kind, input dtype, strided input, and leading batch dims.
"""
from __future__ import annotations

import pytest
import torch

from ditkit.bridge import adapter_bypass as ab


def _kron64(a, b):
    a, b = a.double(), b.double()
    return (a[:, None, :, None] * b[None, :, None, :]).reshape(a.shape[0] * b.shape[0], a.shape[1] * b.shape[1])


def _case(kind, g, m=12, n=8, r=3):
    if kind == "lowrank":
        up, down = torch.randn(m, r, generator=g), torch.randn(r, n, generator=g)
        return (up, down), up.double() @ down.double()
    if kind == "kron":
        w1, w2 = torch.randn(3, 2, generator=g), torch.randn(m // 3, n // 2, generator=g)
        return (w1, w2), _kron64(w1, w2)
    if kind == "hadamard":
        a1, b1 = torch.randn(m, r, generator=g), torch.randn(r, n, generator=g)
        a2, b2 = torch.randn(m, 2, generator=g), torch.randn(2, n, generator=g)   # r1 != r2: Khatri-Rao r1*r2
        return (a1, b1, a2, b2), (a1.double() @ b1.double()) * (a2.double() @ b2.double())
    d = torch.randn(m, n, generator=g)
    return (d,), d.double()


KINDS = ("lowrank", "kron", "hadamard", "dense")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("mapped", [False, True])
def test_h_equals_float64_delta_times_x(kind, dtype, mapped):
    g = torch.Generator().manual_seed(hash((kind, str(dtype), mapped)) % 1000)
    parts, d = _case(kind, g)
    rmap = torch.randperm(d.shape[0], generator=g) if mapped else None
    rows = (4, 4 + d.shape[0])
    out_features = rows[1] + 3
    e = ab.Entry("weight", kind, parts, -0.7, rmap, rows, "t")
    x = torch.randn(2, 5, 2 * d.shape[1], generator=g).to(dtype)[..., ::2]       # strided, batch dims
    assert not x.is_contiguous()
    got = ab.h_sum([e], x, out_features, torch.float64)
    dd = d[rmap] if mapped else d
    want = torch.zeros(2, 5, out_features, dtype=torch.float64)
    want[..., rows[0]:rows[1]] = -0.7 * (x.double() @ dd.T)
    assert got.dtype == torch.float64 and got.shape == want.shape
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= 1e-5, err
    assert torch.count_nonzero(got[..., : rows[0]]) == 0 and torch.count_nonzero(got[..., rows[1]:]) == 0


def test_bias_entry_adds_to_every_token_and_sums_with_weight_entries():
    g = torch.Generator().manual_seed(3)
    (up, down), d = _case("lowrank", g)
    bias = torch.randn(d.shape[0], 1, generator=g)
    x = torch.randn(7, d.shape[1], generator=g)
    es = [ab.Entry("weight", "lowrank", (up, down), 2.0, None, None, "w"),
          ab.Entry("bias", "dense", (bias,), 0.5, None, None, "b")]
    got = ab.h_sum(es, x, d.shape[0], torch.float32)
    want = 2.0 * (x.double() @ d.T) + 0.5 * bias.double().reshape(1, -1)
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_khatri_rao_is_the_hadamard_product_exactly():
    g = torch.Generator().manual_seed(5)
    a1, b1, a2, b2 = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((6, 2), (2, 4), (6, 3), (3, 4)))
    up, down = ab._khatri_rao(a1, b1, a2, b2)
    assert up.shape == (6, 6) and down.shape == (6, 4)
    assert torch.allclose(up @ down, (a1 @ b1) * (a2 @ b2), rtol=0, atol=1e-12)


def test_entry_describe_names_rows_and_source():
    e = ab.Entry("weight", "lowrank", (), 0.5, None, (96, 192), "f.safetensors: transformer_blocks.0.attn.to_k")
    assert e.describe() == "lowrank on weight rows 96:192 (scale 0.5; f.safetensors: transformer_blocks.0.attn.to_k)"
