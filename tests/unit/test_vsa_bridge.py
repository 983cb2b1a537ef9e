"""bridge/attention.py: ComfyUI's attention-override convention around the VSA-H3 runtime (no ComfyUI needed:
the host's ``func`` is replaced by a recording stand-in with the same contract)."""
from __future__ import annotations

import torch

from ditkit.bridge.attention import CTX_KEY, HOLDER_KEY, VSAAttentionOverride, VSAHolder
from ditkit.kernels.vsa_h3_runtime import VSAH3Config, VSAH3Runtime

PREFIX, GRID = (10, 74), (7, 8, 8)
S = sum(PREFIX) + 7 * 8 * 8
B, H, D = 1, 2, 16


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(3)]


def _host_attention(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kw):
    """ComfyUI's attention contract for skip_reshape=True inputs [B, H, S, D]: output [B, S, H*D], or [B, H, S, D]
    with skip_output_reshape (comfy/ldm/modules/attention.py attention_pytorch)."""
    assert skip_reshape
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(q.shape[0], -1, heads * q.shape[-1])


def test_skip_output_reshape_is_honoured_on_sparse_calls():
    rt = VSAH3Runtime(VSAH3Config(keep=0.25))
    override = VSAAttentionOverride()
    to = {HOLDER_KEY: VSAHolder(rt), CTX_KEY: rt.begin_forward(PREFIX, GRID, 0.5)}
    q, k, v = _qkv()
    flat = override(_host_attention, q, k, v, H, skip_reshape=True, transformer_options=to)
    heads_first = override(_host_attention, q, k, v, H, skip_reshape=True, skip_output_reshape=True,
                           transformer_options=to)
    assert flat.shape == (B, S, H * D)
    assert heads_first.shape == (B, H, S, D)
    torch.testing.assert_close(heads_first, flat.view(B, S, H, D).transpose(1, 2), rtol=0, atol=0)
    assert rt.calls["sparse"] == 2


def test_skip_output_reshape_reaches_the_host_on_dense_calls():
    rt = VSAH3Runtime(VSAH3Config(keep=0.25, sigma_start=0.4))         # sigma 0.5 is outside the window: dense
    override = VSAAttentionOverride()
    to = {HOLDER_KEY: VSAHolder(rt), CTX_KEY: rt.begin_forward(PREFIX, GRID, 0.5)}
    q, k, v = _qkv(1)
    out = override(_host_attention, q, k, v, H, skip_reshape=True, skip_output_reshape=True, transformer_options=to)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert rt.calls == {"outside start/end percent": 1}
