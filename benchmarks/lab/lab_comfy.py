"""ComfyUI-side helpers for the quality lab (benchmarks only: this file imports ComfyUI from COMFYUI_PATH).

* :func:`import_comfy` puts ComfyUI on ``sys.path`` and imports it on CPU.
* ``VAE_CONFIG`` / ``DIT_CONFIG``: the lab models' sizes (H3 structure, tiny width).
* :func:`build_vae` / :func:`build_dit`: ComfyUI's own ``MiniMaxH3VideoVAE`` / ``MiniMaxH3Model`` at those sizes.
* :func:`training_mode`: ComfyUI's H3 modules update their residual streams in place and use comfy-kitchen RoPE
  ops without an autograd formula, which is right for inference and refuses backward. For training only, this
  context manager swaps those few helpers for out-of-place twins with the same maths (checked against the
  originals on random inputs every time it is entered), and sets ``comfy.model_management.in_training``.
  The module tree, parameter names and inference code are untouched.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WEIGHTS = HERE / "weights"
VAE_FILE = WEIGHTS / "h3lab_video_vae.safetensors"
DIT_FILE = WEIGHTS / "h3lab_dit.safetensors"
TEXT_FILE = WEIGHTS / "h3lab_text_embed.safetensors"

# H3 video VAE at tiny width: same 6-level causal 3D CNN encoder (x16 space, x4 time), ViT3D decoder.
VAE_CONFIG = dict(ch=32, ch_mult=(1, 1, 2, 2, 2, 2), num_res_blocks=1)
VAE_DECODER = dict(num_layers=3, heads=2, dim_head=64)  # dim 128; dim_head 64 as in H3 (rope on 48 of 64 dims)

# H3 DiT at tiny width; heads*head_dim (128) != hidden (96) like the real 7168 != 5376.
DIT_CONFIG = dict(hidden_size=96, num_layers=4, token_refiner_num_layers=2, num_attention_heads=4,
                  attention_head_dim=32, ffn_hidden_size=256, latents_dim=24, audio_latents_dim=32,
                  patch_size=(1, 2, 2), text_dim=32, timestep_input_dim=64, time_embed_hidden_size=96,
                  time_embed_dim=48, rope_inv_freq_len=4)
SHIFT_VIDEO, SHIFT_AUDIO = 12.0, 3.0

comfy = None


def import_comfy(path: str | os.PathLike | None = None):
    """Import ComfyUI (CPU) from ``path`` or ``$COMFYUI_PATH``; returns the ``comfy`` package."""
    global comfy
    if comfy is not None:
        return comfy
    path = Path(path or os.environ.get("COMFYUI_PATH", "")).expanduser()
    if not (path / "main.py").is_file():
        raise SystemExit(f"set COMFYUI_PATH to a ComfyUI checkout (got {str(path)!r}, which has no main.py)")
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    from comfy.cli_args import args

    args.cpu = True
    import comfy as _comfy
    import comfy.ldm.minimax.model  # noqa: F401
    import comfy.ldm.minimax.vae  # noqa: F401
    import comfy.model_management  # noqa: F401
    import comfy.ops  # noqa: F401
    import comfy.sd  # noqa: F401

    comfy = _comfy
    return comfy


def _reset(module: torch.nn.Module) -> None:
    """Default PyTorch initialisation for ComfyUI's ``disable_weight_init`` layers."""
    for m in module.modules():
        for base in (torch.nn.Linear, torch.nn.Conv3d, torch.nn.Conv1d, torch.nn.Conv2d):
            if isinstance(m, base):
                base.reset_parameters(m)
                break
        else:
            if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                torch.nn.init.ones_(m.weight)
                torch.nn.init.zeros_(m.bias)
            elif isinstance(m, torch.nn.RMSNorm) and m.weight is not None:
                torch.nn.init.ones_(m.weight)


def build_vae(seed: int = 0, decoder_layers: int | None = None, decoder_heads: int | None = None):
    """ComfyUI's ``MiniMaxH3VideoVAE`` at lab width, freshly initialised (fp32, CPU)."""
    dec = dict(VAE_DECODER, num_layers=decoder_layers or VAE_DECODER["num_layers"],
               heads=decoder_heads or VAE_DECODER["heads"])
    import_comfy()
    V = comfy.ldm.minimax.vae
    # the stock constructor always builds the 36x2048 decoder: build on meta, swap in the lab-width one
    with torch.device("meta"):
        vae = V.MiniMaxH3VideoVAE(**VAE_CONFIG)
        vae.decoder = V.ViT3DDecoder(patch_size=vae.vae_ratio, patch_size_t=vae.vae_ratio_t, in_channels=24,
                                     out_channels=3, **dec)
    vae = vae.to_empty(device="cpu")
    torch.manual_seed(seed)
    _reset(vae)
    for blk in vae.decoder.transformer_blocks:
        torch.nn.init.constant_(blk.scale1, 0.1)
        torch.nn.init.constant_(blk.scale2, 0.1)
    torch.nn.init.normal_(vae.decoder.register_tokens, std=0.02)
    vae.decoder.mask_token.zero_()
    vae.latents_mean.zero_()
    vae.latents_std.fill_(1.0)
    vae.pixel_mean.copy_(torch.tensor(V.IMAGENET_MEAN).view(1, 3, 1, 1, 1))
    vae.pixel_std.copy_(torch.tensor(V.IMAGENET_STD).view(1, 3, 1, 1, 1))
    vae.decoder.pos_embed.inv_freq = 1 / vae.decoder.pos_embed.inv_freq.new_tensor(100.0) ** torch.arange(
        0, 1, 2 * 3 / int(dec["dim_head"] * 0.75), dtype=torch.float32)
    return vae


def load_vae(path=VAE_FILE):
    """Build the lab VAE and load ``path`` (ComfyUI key layout) strictly."""
    from ditkit.loaders.safetensors_io import load_file

    sd = load_file(str(path))
    layers = len({k.split(".")[2] for k in sd if k.startswith("decoder.transformer_blocks.")})
    heads = sd["decoder.register_tokens"].shape[-1] // VAE_DECODER["dim_head"]
    vae = build_vae(decoder_layers=layers, decoder_heads=heads)
    sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}  # fp16 files run in fp32
    missing, unexpected = vae.load_state_dict(sd, strict=True), None
    del missing, unexpected
    return vae.eval()


def build_dit(seed: int = 0):
    """ComfyUI's ``MiniMaxH3Model`` at lab width, freshly initialised (fp32, CPU)."""
    import_comfy()
    torch.manual_seed(seed)
    m = comfy.ldm.minimax.model.MiniMaxH3Model(**DIT_CONFIG, dtype=torch.float32,
                                               operations=comfy.ops.disable_weight_init)
    _reset(m)
    n = DIT_CONFIG["rope_inv_freq_len"]
    m.rope.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))
    # adaLN-zero style start: gates and modulation begin at zero, outputs at zero
    for blk in m.blocks:
        torch.nn.init.zeros_(blk.adaln_proj.linear.weight)
        torch.nn.init.zeros_(blk.adaln_proj.linear.bias)
    torch.nn.init.zeros_(m.final_layer.adaln_proj.linear.weight)
    torch.nn.init.zeros_(m.final_layer.adaln_proj.linear.bias)
    torch.nn.init.zeros_(m.final_layer.video_out.weight)
    torch.nn.init.zeros_(m.final_layer.video_out.bias)
    torch.nn.init.zeros_(m.final_layer.audio_out.weight)
    torch.nn.init.zeros_(m.final_layer.audio_out.bias)
    return m


# ------------------------------------------------------------------------------------------------------------
# training mode: out-of-place twins of ComfyUI's in-place inference helpers
# ------------------------------------------------------------------------------------------------------------

def _rope_split_half_torch(x, table):
    # kitchen split-half RoPE: pair k = (x[k], x[k + d/2]); table [..., d/2, 2, 2]
    t_ = x.reshape(*x.shape[:-1], 2, -1).movedim(-2, -1).unsqueeze(-2).to(table.dtype)
    out = table[..., 0] * t_[..., 0] + table[..., 1] * t_[..., 1]
    return out.movedim(-1, -2).reshape(*x.shape).type_as(x)


def _vae_attn_forward(self, x, rotary_pos_emb=None):
    import comfy.rmsnorm

    B, S, _ = x.shape
    qkv = self.to_qkv(x).view(B, S, -1, 3 * self.dim_head)
    q, k, v = torch.chunk(qkv, 3, dim=-1)
    q = comfy.rmsnorm.rms_norm(q, self.norm_q.weight, self.norm_q.eps)
    k = comfy.rmsnorm.rms_norm(k, self.norm_k.weight, self.norm_k.eps)
    if rotary_pos_emb is not None:
        rot = rotary_pos_emb.shape[-3] * 2
        q = torch.cat([_rope_split_half_torch(q[..., :rot], rotary_pos_emb), q[..., rot:]], dim=-1)
        k = torch.cat([_rope_split_half_torch(k[..., :rot], rotary_pos_emb), k[..., rot:]], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return self.to_out(out.transpose(1, 2).reshape(B, S, -1))


def _vae_block_forward(self, x, rotary_pos_emb=None):
    import comfy.rmsnorm

    x = x + self.attn(comfy.rmsnorm.rms_norm(x, self.norm1.weight, self.norm1.eps), rotary_pos_emb) * self.scale1
    return x + self.ff(comfy.rmsnorm.rms_norm(x, self.norm2.weight, self.norm2.eps)) * self.scale2


def _vae_ff_forward(self, x):
    gate, x = self.w1(x).chunk(2, dim=-1)
    return self.w2(torch.nn.functional.silu(gate) * x)


def _mod_scale_shift(h, shift, scale, segments):
    parts = [h[a:b] * (1.0 + scale[row].to(h.dtype)) + shift[row].to(h.dtype) for a, b, row in segments]
    return torch.cat(parts, dim=0)


def _mod_gate(x, gate, other, segments):
    parts = [other[a:b] * gate[row].to(x.dtype) for a, b, row in segments]
    return x + torch.cat(parts, dim=0)


def _dit_attn_forward(self, x, rope_freqs=None, transformer_options={}):
    from comfy.ldm.modules.attention import optimized_attention

    s = x.shape[0]
    q, k, v = self.qkv_proj(x).split(self.heads * self.head_dim, dim=-1)
    q = torch.nn.functional.rms_norm(q.view(s, self.heads, self.head_dim), (self.head_dim,), self.q_norm.weight,
                                     self.q_norm.eps)
    k = torch.nn.functional.rms_norm(k.view(s, self.heads, self.head_dim), (self.head_dim,), self.k_norm.weight,
                                     self.k_norm.eps)
    v = v.reshape(s, self.heads, self.head_dim)
    if rope_freqs is not None:
        rot = rope_freqs.shape[-3] * 2
        table = rope_freqs[0]  # [S, 1, rot/2, 2, 2]
        q = torch.cat([_rope_split_half_torch(q[..., :rot], table), q[..., rot:]], dim=-1)
        k = torch.cat([_rope_split_half_torch(k[..., :rot], table), k[..., rot:]], dim=-1)
    out = optimized_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                              v.transpose(0, 1).unsqueeze(0), self.heads, mask=None, skip_reshape=True,
                              transformer_options=transformer_options)
    return self.out_proj(out.squeeze(0))


def _refiner_forward(self, x, transformer_options={}):
    x = x + self.attn(self.norm1(x), transformer_options=transformer_options)
    return x + self.mlp(self.norm2(x))


@contextlib.contextmanager
def training_mode(check: bool = True):
    """Swap ComfyUI's in-place H3 helpers for autograd-safe twins (same maths) while the block runs."""
    import_comfy()
    V = comfy.ldm.minimax.vae
    M = comfy.ldm.minimax.model
    mm = comfy.model_management
    swaps = [(V.Attention, "forward", _vae_attn_forward), (V.TransformerBlock, "forward", _vae_block_forward),
             (V.FeedForward, "forward", _vae_ff_forward), (M, "_mod_scale_shift", _mod_scale_shift),
             (M, "_mod_gate", _mod_gate), (M.RefinerBlock, "forward", _refiner_forward),
             (M.Attention, "forward", _dit_attn_forward)]
    if check:
        _check_twins()
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in swaps]
    old_training = mm.in_training
    try:
        for obj, name, fn in swaps:
            setattr(obj, name, fn)
        mm.in_training = True
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        mm.in_training = old_training


def _check_twins() -> None:
    """The twins must match the stock inference code on random inputs (fp32, 1e-5)."""
    V = comfy.ldm.minimax.vae
    g = torch.Generator().manual_seed(1234)
    with torch.device("meta"):
        blk = V.TransformerBlock(heads=2, dim_head=32)
    blk = blk.to_empty(device="cpu")
    for p in blk.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    rope = V.RotaryEmbeddingND(24, 100.0, 3)
    rope.inv_freq = 1 / 100.0 ** torch.arange(0, 1, 6 / 24, dtype=torch.float32)
    ids = V.create_token_ids((3, 2, 2), "cpu", torch.float32)
    table = rope(ids)
    x = torch.randn(1, 12, 64, generator=g)
    with torch.no_grad():
        ref = blk(x.clone(), table)
        twin_attn = _vae_attn_forward(blk.attn, x, table)
        ref_attn = blk.attn(x.clone(), table)
        got = _vae_block_forward(blk, x.clone(), table)
    # _vae_block_forward calls blk.attn/ff, still the stock ones here: check the attention twin separately
    err = max((got - ref).abs().max().item(), (twin_attn - ref_attn).abs().max().item())
    M = comfy.ldm.minimax.model
    h = torch.randn(10, 8, generator=g)
    sh = torch.randn(6, 8, generator=g)
    sc = torch.randn(6, 8, generator=g)
    segs = [(0, 3, 1), (3, 10, 4)]
    err = max(err, (M._mod_scale_shift(h.clone(), sh, sc, segs) - _mod_scale_shift(h, sh, sc, segs)).abs().max().item())
    o = torch.randn(10, 8, generator=g)
    err = max(err, (M._mod_gate(h.clone(), sc, o, segs) - _mod_gate(h, sc, o, segs)).abs().max().item())
    att = M.Attention(64, 3, 32, 1e-5, dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    for p in att.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    att.requires_grad_(False)
    pos = torch.randn(9, 3, generator=g).double() * 5
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    per = pos.float().unsqueeze(-1) * inv.view(1, 1, -1)
    half = torch.cat(per.unbind(1), dim=-1)
    freqs = M.rope_rotation_table(torch.cat([half, half], -1), torch.float32)
    xa = torch.randn(9, 64, generator=g)
    with torch.no_grad():
        err = max(err, (att(xa.clone(), rope_freqs=freqs) - _dit_attn_forward(att, xa, rope_freqs=freqs)).abs().max().item())
    if err > 1e-5:
        raise RuntimeError(f"training twins differ from ComfyUI's inference helpers by {err:.3g}")


def rope_check_ok() -> float:
    """Max abs difference between the pure-torch split-half RoPE and comfy-kitchen's (for the model card)."""
    import_comfy()
    import comfy.quant_ops

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 7, 2, 24, generator=g)
    k = torch.randn(1, 7, 2, 24, generator=g)
    ang = torch.randn(1, 7, 1, 12, generator=g)
    c, s = torch.cos(ang), torch.sin(ang)
    table = torch.stack([c, -s, s, c], -1).reshape(1, 7, 1, 12, 2, 2)
    a, b = comfy.quant_ops.ck.apply_rope_split_half(q, k, table)
    return max((a - _rope_split_half_torch(q, table)).abs().max().item(),
               (b - _rope_split_half_torch(k, table)).abs().max().item())


def save_state(module: torch.nn.Module, path, metadata: dict | None = None, prefix: str = "",
               dtype: torch.dtype | None = None) -> None:
    """``module.state_dict()`` to ``path`` (floating tensors cast to ``dtype`` when given)."""
    from ditkit.loaders.safetensors_io import save_file

    sd = {prefix + k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype)
          .contiguous().clone() for k, v in module.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata=metadata or {})


def count_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def cosine_lr(step: int, total: int, base: float, warmup: int = 50) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))
