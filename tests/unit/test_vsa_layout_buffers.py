"""Per-geometry index buffers reused by every VSA-H3 call (kernels/vsa_layout.layout_buffers): the values are those
of the layout (checked against definitions written here), built once per layout, and reusing them changes no output
bit (reference and cpu_batched, with and without the gate branch)."""
from __future__ import annotations

import pytest
import torch

from ditkit.kernels import build_h3_layout, vsa
from ditkit.kernels.tile_pack import pack_reference, unpack_combine_reference
from ditkit.kernels.vsa_layout import layout_buffers


def test_buffers_are_the_layouts_and_cached():
    lay = build_h3_layout((10, 74), (7, 8, 8))
    b = layout_buffers(lay)
    assert layout_buffers(lay) is b and build_h3_layout((10, 74), (7, 8, 8)) is lay
    src = lay.tile_src.tolist()
    assert b.gather.tolist() == [max(0, s) for s in src]
    assert b.pad.tolist() == [p for p, s in enumerate(src) if s == -1]
    assert b.sizes_f32.dtype == torch.float32 and b.sizes_f32.tolist() == [float(s) for s in lay.sizes.tolist()]
    assert b.untile_tiles.tolist() == [u // 64 for u in lay.untile_index.tolist()]


def test_reference_ops_with_buffers_equal_without():
    lay = build_h3_layout((10, 74), (7, 8, 8))
    b = layout_buffers(lay)
    x = torch.randn(1, 2, lay.seq_len, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pack_reference(x, lay.tile_src, b.gather, b.pad), pack_reference(x, lay.tile_src))
    fine = pack_reference(x, lay.tile_src)
    coarse = torch.randn(1, 2, lay.n_tiles, 16)
    gate = torch.randn_like(x)
    assert torch.equal(unpack_combine_reference(fine, lay.untile_index, coarse, gate, untile_tiles=b.untile_tiles),
                       unpack_combine_reference(fine, lay.untile_index, coarse, gate))


@pytest.mark.parametrize("backend", ["reference", "cpu_batched"])
@pytest.mark.parametrize("with_gate", [False, True])
def test_reuse_is_bit_identical(backend, with_gate):
    lay = build_h3_layout((300, 65), (7, 8, 16))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, lay.seq_len, 32, generator=g) for _ in range(3))
    gate = torch.randn(1, 2, lay.seq_len, 32, generator=g) if with_gate else None
    try:
        vsa.REUSE_LAYOUT_BUFFERS = False
        lay.extra.pop("buffers", None)
        a, _ = vsa.vsa_h3_attention(q, k, v, lay, 0.25, gate=gate, backend=backend)
        assert "buffers" not in lay.extra
        vsa.REUSE_LAYOUT_BUFFERS = True
        b1, _ = vsa.vsa_h3_attention(q, k, v, lay, 0.25, gate=gate, backend=backend)
        buf = lay.extra["buffers"]
        b2, _ = vsa.vsa_h3_attention(q, k, v, lay, 0.25, gate=gate, backend=backend)
        assert lay.extra["buffers"] is buf, "the second call must reuse the buffers"
    finally:
        vsa.REUSE_LAYOUT_BUFFERS = True
    assert torch.equal(a, b1) and torch.equal(a, b2)
