"""Triton launchers with non-contiguous inputs (issue 29 gap class): the VSA pack / unpack-combine and block-sparse
attention launchers get ``[B, S, H, D]`` tensors viewed as ``[B, H, S, D]`` (what an attention layer hands over
after ``.transpose(1, 2)``), tensors strided in the last dim, and every other head, in fp16, bf16 (pack and
unpack are copies/adds: exact in every dtype) and fp32. Oracle: an explicit loop over the tile map (pack), the
float64 gather-plus-add written here (unpack) and, for attention, the launcher's own result on the contiguous
copy of the same values (validated against float64 in test_kernels_vsa.py): the layout must not change a bit."""
from __future__ import annotations

import pytest
import torch

from _kernels_interp import DEVICE, ensure_interpreted, need_triton  # noqa: E402  (tests/unit on sys.path)

ensure_interpreted()

from ditkit.kernels.vsa_layout import build_h3_layout  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _view(shape, dtype, seed, layout):
    """Values of a [B, H, S, D] tensor as a non-contiguous view of the given kind."""
    B, H, S, D = shape
    g = torch.Generator().manual_seed(seed)
    if layout == "bshd":
        base = torch.randn(B, S, H, D, generator=g).to(dtype)
        x = base.transpose(1, 2)
    elif layout == "strided_d":
        base = torch.randn(B, H, S, 2 * D, generator=g).to(dtype)
        x = base[..., ::2]
    else:                                                     # "head_slice": every other head
        base = torch.randn(B, 2 * H, S, D, generator=g).to(dtype)
        x = base[:, ::2]
    assert not x.is_contiguous()
    return x.to(DEVICE)


@pytest.mark.parametrize("layout", ["bshd", "strided_d", "head_slice"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_and_unpack_of_non_contiguous_inputs(dtype, layout):
    need_triton("triton")
    from ditkit.kernels import tile_pack

    lay = build_h3_layout((70,), (4, 4, 4))
    x = _view((2, 3, lay.seq_len, 16), dtype, 1, layout)
    xt = tile_pack.pack_triton(x, lay.tile_src.to(DEVICE))
    exp = torch.zeros(2, 3, lay.tile_src.numel(), 16, dtype=dtype)
    for p, s in enumerate(lay.tile_src.tolist()):
        if s >= 0:
            exp[:, :, p] = x.cpu()[:, :, s]
    assert torch.equal(xt.cpu(), exp)
    back = tile_pack.unpack_combine_triton(_view(tuple(xt.shape), dtype, 9, layout).copy_(xt),
                                           lay.untile_index.to(DEVICE))
    assert torch.equal(back.cpu(), x.cpu())
    coarse = _view((2, 3, lay.n_tiles, 16), dtype, 2, layout)
    gate = _view((2, 3, lay.seq_len, 16), dtype, 3, layout)
    got = tile_pack.unpack_combine_triton(xt, lay.untile_index.to(DEVICE), coarse, gate)
    tid = lay.untile_index // 64
    want = (x.cpu().double() + coarse.cpu().double()[:, :, tid] * gate.cpu().double())
    ref = tile_pack.unpack_combine_triton(xt, lay.untile_index.to(DEVICE), coarse.contiguous(), gate.contiguous())
    assert torch.equal(got, ref)                                         # layout changes no bit
    tol = {torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6, torch.float32: 1e-6}[dtype]
    assert ((got.cpu().double() - want).abs() <= tol * want.abs() + tol).all()


@pytest.mark.parametrize("layout", ["bshd", "strided_d", "head_slice"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_block_sparse_attention_of_non_contiguous_inputs(dtype, layout):
    need_triton("triton")
    from ditkit.kernels.block_sparse_triton import block_sparse_attn_triton

    B, H, T, D = 1, 2, 2, 16
    vbs = torch.tensor((64, 40), dtype=torch.int32).to(DEVICE)
    q, k, v = (_view((B, H, T * 64, D), dtype, s, layout) for s in (4, 5, 6))
    idx = torch.tensor([[[1, 0], [0, 1]]] * H, dtype=torch.int32).reshape(B, H, T, T).to(DEVICE)
    num = torch.tensor([[[2, 1]] * H], dtype=torch.int32).to(DEVICE)
    out, lse = block_sparse_attn_triton(q, k, v, idx, num, vbs)
    o_ref, l_ref = block_sparse_attn_triton(q.contiguous(), k.contiguous(), v.contiguous(), idx, num, vbs)
    assert torch.equal(out, o_ref) and torch.equal(lse, l_ref)
    # and the selection itself non-contiguous (a transposed view of the same indices)
    idx_t = idx.transpose(-1, -2).contiguous().transpose(-1, -2)
    out2, _ = block_sparse_attn_triton(q, k, v, idx_t, num, vbs)
    assert torch.equal(out2, o_ref)
