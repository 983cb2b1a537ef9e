"""Pure-torch reference of the quality lab's H3 video VAE (no ComfyUI import).

The lab (``benchmarks/lab/``) trains a tiny VAE with MiniMax H3's structure using ComfyUI's own
``MiniMaxH3VideoVAE``; its weights (``benchmarks/lab/weights/h3lab_video_vae.safetensors``) use ComfyUI's key
layout. This module is an independent functional implementation of that model (written from the maths, not from
ComfyUI's code) so the lab harness can run where ComfyUI is absent (CI). It is proven equal to ComfyUI's model on
the lab weights by the host test ``tests/integration/test_lab_ref_equivalence_vae.py`` (fp32, max abs <= 1e-4).

What it computes (same semantics as ComfyUI's object, whose duck-typed interface it also exposes so
``ditkit.bridge.vae.repeat_decode_t1`` (the core through the host bridge) runs on it unchanged):

* encoder: 6-level causal 3D CNN (reflect spatial padding, zero front temporal padding, single-frame inputs use only
  the last temporal tap), per-frame GroupNorm, then ``quant_conv``; the latent is the first half of the moments,
  whitened with ``latents_mean/std``. Pixels are mapped [-1, 1] -> ImageNet-normalised first.
* decoder: ``post_quant_conv`` then a ViT over the latent tokens + register tokens + one zero token, 3-axis RoPE on
  coordinates normalised per extent to (-1, 1), per-head interleaved qkv, gated SiLU FFN, LayerNorm, ``proj_out``
  to 4 x 16 x 16 x 3 pixels per token.
* ``encode``: T = 1 -> one token (``moments[:, :, -1:]``); else 17-frame clips (last one padded by repeating its last
  frame), ``token_drop`` trailing tokens dropped.
* ``decode``: T = 1 -> one token decoded, last of its 4 frames kept; else 5-token chunks (+2 overlap tokens, the
  latent padded by repeating its last token), ``frame_pre_padding`` frames cut, overlapping frames blended linearly.
* spatial tiling with linear blends, in pixel space (decode) and latent space (encode).

API: ``load_lab_vae(path=None) -> LabVAE``; ``LabVAE.encode(x)`` (x [B, 3, T, H, W] in [-1, 1] -> normalised
latents), ``LabVAE.decode(z)`` (-> float32 pixels [B, 3, T, H, W] in [0, 1]); ``LabVAE.from_state_dict(sd)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ditkit.errors import CheckpointError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VAE_FILE = REPO_ROOT / "benchmarks" / "lab" / "weights" / "h3lab_video_vae.safetensors"
VAE_FILE = DEFAULT_VAE_FILE  # same name as lab_comfy.VAE_FILE / lab_ref_dit.DIT_FILE

# pixel normalisation of the H3 VAE (ImageNet statistics; not stored in the checkpoint)
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)

GN_GROUPS, GN_EPS = 32, 1e-6
DEC_EPS = 1e-5


@dataclass(frozen=True)
class LabVAEConfig:
    ch: int = 32
    ch_mult: tuple = (1, 1, 2, 2, 2, 2)
    num_res_blocks: tuple = (1, 1, 1, 1, 1, 1)  # per level
    space_down: tuple = (2, 2, 2, 2, 1, 1)
    time_down: tuple = (1, 2, 2, 1, 1, 1)
    in_channels: int = 3
    out_channels: int = 3
    z_channels: int = 24
    embed_dim: int = 24
    dec_layers: int = 3
    dec_heads: int = 2
    dec_dim_head: int = 64
    ffn_inner: int = 512
    num_register_tokens: int = 4
    rope_theta: float = 100.0
    rope_dim_ratio: float = 0.75
    clip_length: int = 17
    token_drop: int = 3
    tile_size: int = 256
    tile_overlap_min: int = 64
    tiling: bool = True
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def spatial_ratio(self) -> int:
        return int(math.prod(self.space_down))

    @property
    def temporal_ratio(self) -> int:
        return int(math.prod(self.time_down))

    @property
    def dec_dim(self) -> int:
        return self.dec_heads * self.dec_dim_head


def expected_shapes(cfg: LabVAEConfig) -> dict[str, tuple[int, ...]]:
    """Every key of the lab VAE state dict (ComfyUI layout) -> its shape, for ``cfg``."""
    out: dict[str, tuple[int, ...]] = {}

    def conv(name, cout, cin, k):
        out[name + ".weight"] = (cout, cin, k, k, k)
        out[name + ".bias"] = (cout,)

    def affine(name, n, bias=True):
        out[name + ".weight"] = (n,)
        if bias:
            out[name + ".bias"] = (n,)

    widths = [cfg.ch * m for m in cfg.ch_mult]
    conv("encoder.conv_in", widths[0], cfg.in_channels, 3)
    c_prev = widths[0]
    for lvl, w in enumerate(widths):
        for b in range(cfg.num_res_blocks[lvl]):
            p = f"encoder.down.{lvl}.block.{b}"
            affine(p + ".norm1", c_prev)
            conv(p + ".conv1", w, c_prev, 3)
            affine(p + ".norm2", w)
            conv(p + ".conv2", w, w, 3)
            if c_prev != w:
                conv(p + ".nin_shortcut", w, c_prev, 1)
            c_prev = w
        if cfg.space_down[lvl] * cfg.time_down[lvl] > 1:
            conv(f"encoder.down.{lvl}.downsample.conv", w, w, 3)
    affine("encoder.norm_out", c_prev)
    conv("encoder.conv_out", 2 * cfg.z_channels, c_prev, 3)
    conv("quant_conv", 2 * cfg.embed_dim, 2 * cfg.z_channels, 1)
    conv("post_quant_conv", cfg.z_channels, cfg.embed_dim, 1)
    d = cfg.dec_dim
    out["decoder.x_embedder.weight"] = (d, cfg.z_channels)
    out["decoder.x_embedder.bias"] = (d,)
    out["decoder.register_tokens"] = (1, cfg.num_register_tokens, d)
    out["decoder.mask_token"] = (1, 1, d)
    for i in range(cfg.dec_layers):
        p = f"decoder.transformer_blocks.{i}"
        affine(p + ".norm1", d, bias=False)
        affine(p + ".norm2", d, bias=False)
        out[p + ".attn.to_qkv.weight"] = (3 * d, d)
        out[p + ".attn.to_qkv.bias"] = (3 * d,)
        out[p + ".attn.to_out.weight"] = (d, d)
        out[p + ".attn.to_out.bias"] = (d,)
        out[p + ".ff.w1.weight"] = (2 * cfg.ffn_inner, d)
        out[p + ".ff.w1.bias"] = (2 * cfg.ffn_inner,)
        out[p + ".ff.w2.weight"] = (d, cfg.ffn_inner)
        out[p + ".ff.w2.bias"] = (d,)
        out[p + ".scale1"] = (d,)
        out[p + ".scale2"] = (d,)
    affine("decoder.norm_out", d)
    n_pix = cfg.out_channels * cfg.temporal_ratio * cfg.spatial_ratio ** 2
    out["decoder.proj_out.weight"] = (n_pix, d)
    out["decoder.proj_out.bias"] = (n_pix,)
    out["latents_mean"] = (cfg.z_channels,)
    out["latents_std"] = (cfg.z_channels,)
    return out


def _need(sd: dict, key: str, ndim: int, where: str) -> tuple[int, ...]:
    if key not in sd:
        raise CheckpointError(f"{where}: missing key '{key}' (needed to infer the VAE size); is this an H3 lab video "
                              "VAE in ComfyUI key layout?")
    shape = tuple(sd[key].shape)
    if len(shape) != ndim:
        raise CheckpointError(f"{where}: key '{key}' has shape {shape}, expected a {ndim}-D tensor")
    return shape


def config_from_state_dict(sd: dict, where: str = "lab VAE state dict", dec_dim_head: int = 64,
                           space_down: tuple = (2, 2, 2, 2, 1, 1), time_down: tuple = (1, 2, 2, 1, 1, 1),
                           **overrides) -> LabVAEConfig:
    """Infer the sizes from tensor shapes. ``dec_dim_head`` and the down-sampling factors are not visible in shapes
    (H3 values by default); the downsample convs present must agree with the factors."""
    ch = _need(sd, "encoder.conv_in.weight", 5, where)[0]
    in_ch = _need(sd, "encoder.conv_in.weight", 5, where)[1]
    levels = sorted({int(k.split(".")[2]) for k in sd if k.startswith("encoder.down.")})
    if levels != list(range(len(levels))) or not levels:
        raise CheckpointError(f"{where}: encoder levels {levels} are not 0..N-1")
    if len(levels) != len(space_down) or len(levels) != len(time_down):
        raise CheckpointError(f"{where}: {len(levels)} encoder levels but down-sampling factors for "
                              f"{len(space_down)}/{len(time_down)} levels")
    mult, nrb = [], []
    for lvl in levels:
        blocks = sorted({int(k.split(".")[4]) for k in sd if k.startswith(f"encoder.down.{lvl}.block.")})
        if not blocks or blocks != list(range(len(blocks))):
            raise CheckpointError(f"{where}: encoder level {lvl} has res blocks {blocks} (expected 0..N-1, N >= 1)")
        w = _need(sd, f"encoder.down.{lvl}.block.0.conv1.weight", 5, where)[0]
        if w % ch:
            raise CheckpointError(f"{where}: 'encoder.down.{lvl}.block.0.conv1.weight' width {w} is not a multiple "
                                  f"of ch={ch}")
        mult.append(w // ch)
        nrb.append(len(blocks))
    z2 = _need(sd, "encoder.conv_out.weight", 5, where)[0]
    emb = _need(sd, "post_quant_conv.weight", 5, where)[1]
    d, zc = _need(sd, "decoder.x_embedder.weight", 2, where)
    if d % dec_dim_head:
        raise CheckpointError(f"{where}: decoder width {d} ('decoder.x_embedder.weight') is not a multiple of "
                              f"dim_head={dec_dim_head}")
    layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("decoder.transformer_blocks.")})
    if layers != list(range(len(layers))):
        raise CheckpointError(f"{where}: decoder blocks {layers} are not 0..N-1")
    ffn = _need(sd, "decoder.transformer_blocks.0.ff.w2.weight", 2, where)[1] if layers else 4 * d
    regs = _need(sd, "decoder.register_tokens", 3, where)[1]
    n_pix = _need(sd, "decoder.proj_out.weight", 2, where)[0]
    per_ch = int(math.prod(time_down)) * int(math.prod(space_down)) ** 2
    if n_pix % per_ch:
        raise CheckpointError(f"{where}: 'decoder.proj_out.weight' has {n_pix} outputs, not a multiple of "
                              f"{per_ch} (4 x 16 x 16 pixels per token)")
    cfg = dict(ch=ch, ch_mult=tuple(mult), num_res_blocks=tuple(nrb), space_down=tuple(space_down),
               time_down=tuple(time_down), in_channels=in_ch, out_channels=n_pix // per_ch, z_channels=z2 // 2,
               embed_dim=emb, dec_layers=len(layers), dec_heads=d // dec_dim_head, dec_dim_head=dec_dim_head,
               ffn_inner=ffn, num_register_tokens=regs)
    if zc != z2 // 2:
        raise CheckpointError(f"{where}: 'decoder.x_embedder.weight' takes {zc} channels but the encoder makes "
                              f"{z2 // 2} ('encoder.conv_out.weight' has {z2} = 2 x z outputs)")
    cfg.update(overrides)
    return LabVAEConfig(**cfg)


def check_state_dict(sd: dict, cfg: LabVAEConfig, where: str = "lab VAE state dict") -> None:
    """Exactly the expected keys with exactly the expected shapes, else a CheckpointError naming the key."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    if missing:
        raise CheckpointError(f"{where}: missing key(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                              f"({len(missing)} in all) for the inferred config")
    if extra:
        raise CheckpointError(f"{where}: unexpected key(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} "
                              f"({len(extra)} in all): not part of the H3 lab video VAE")
    for k, shape in want.items():
        got = tuple(sd[k].shape)
        if got != shape:
            raise CheckpointError(f"{where}: key '{k}' has shape {got}, expected {shape}")
        if not sd[k].is_floating_point():
            raise CheckpointError(f"{where}: key '{k}' has dtype {sd[k].dtype}, expected a float tensor")


# ---------------------------------------------------------------------------------------------- encoder maths

def _causal_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, pad_t: int, pad_s: int,
                 stride: tuple = (1, 1, 1)) -> torch.Tensor:
    """Reflect-pad space by ``pad_s``; causal time: 2*pad_t zero frames in front, or, for one frame, only the last
    temporal tap of the kernel (what convolving the zero frames would give)."""
    if pad_t == 0 and pad_s == 0:
        return F.conv3d(x, w, b, stride=stride)
    if pad_s:
        x = F.pad(x, (pad_s, pad_s, pad_s, pad_s, 0, 0), mode="reflect")
    if x.shape[2] == 1:
        return F.conv3d(x, w[:, :, -1:], b, stride=stride)
    x = F.pad(x, (0, 0, 0, 0, 2 * pad_t, 0))
    return F.conv3d(x, w, b, stride=stride)


def _frame_group_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """GroupNorm with statistics per frame."""
    bs, c, t, h, wd = x.shape
    y = x.transpose(1, 2).reshape(bs * t, c, h, wd)
    y = F.group_norm(y, GN_GROUPS, w, b, GN_EPS)
    return y.reshape(bs, t, c, h, wd).transpose(1, 2)


# ---------------------------------------------------------------------------------------------- decoder maths

def _token_coords(extents: tuple[int, int, int], device, dtype) -> torch.Tensor:
    """[N, 3] token centre coordinates, each axis mapped to (-1, 1): (2 i + 1) / n - 1, in (t, h, w) order."""
    axes = [(torch.arange(n, device=device, dtype=dtype) + 0.5) / n * 2.0 - 1.0 for n in extents]
    grid = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([g.reshape(-1) for g in grid], dim=-1)


def _rope_angles(coords: torch.Tensor, dim_rot: int, theta: float) -> torch.Tensor:
    """[N, 3] coords -> [N, dim_rot/2] angles: per axis 2*pi*coord*theta^(-j/n_freq), axes concatenated."""
    n_freq = dim_rot // 6
    exps = torch.arange(n_freq, dtype=torch.float32, device=coords.device) * (6.0 / dim_rot)
    inv = 1.0 / theta ** exps
    ang = 2.0 * math.pi * coords.float()[:, :, None] * inv[None, None, :]  # [N, 3, n_freq]
    return ang.reshape(coords.shape[0], -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation on the first 2*len(cos) dims of ``x`` [B, H, N, D]; the rest pass through."""
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, rest], dim=-1)


class _Decoder:
    """Tiny shim so duck-typed callers reading ``model.decoder.patch_size_t`` / ``out_channels`` work."""

    def __init__(self, cfg: LabVAEConfig):
        self.patch_size = cfg.spatial_ratio
        self.patch_size_t = cfg.temporal_ratio
        self.out_channels = cfg.out_channels
        self.num_register_tokens = cfg.num_register_tokens


class LabVAE:
    """The lab H3 video VAE, functional torch over a ComfyUI-layout state dict (see the module docstring)."""

    def __init__(self, sd: dict, cfg: LabVAEConfig, dtype: torch.dtype = torch.float32,
                 where: str = "lab VAE state dict"):
        check_state_dict(sd, cfg, where)
        self.cfg = cfg
        self.params = {k: v.detach().to(dtype).clone().contiguous() for k, v in sd.items()}
        self.latents_mean = self.params["latents_mean"]
        self.latents_std = self.params["latents_std"]
        self.pixel_mean = torch.tensor(PIXEL_MEAN, dtype=dtype).view(1, 3, 1, 1, 1)
        self.pixel_std = torch.tensor(PIXEL_STD, dtype=dtype).view(1, 3, 1, 1, 1)
        self.decoder = _Decoder(cfg)
        # temporal / spatial plan (names as on ComfyUI's object, read by vae/t1_decode.py)
        self.vae_ratio = cfg.spatial_ratio
        self.vae_ratio_t = cfg.temporal_ratio
        self.clip_length = cfg.clip_length
        self.token_drop = cfg.token_drop
        self.frame_pre_padding = (-cfg.clip_length) % self.vae_ratio_t
        self.tokens_chunk_size = -(-cfg.clip_length // self.vae_ratio_t)
        self.token_overlap = (-cfg.token_drop) % self.tokens_chunk_size
        self.frame_overlap = max(self.token_overlap * self.vae_ratio_t - self.frame_pre_padding, 0)
        self.tiling = cfg.tiling
        self.tile_size = cfg.tile_size
        self.tile_overlap_min = cfg.tile_overlap_min

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_state_dict(cls, sd: dict, cfg: LabVAEConfig | None = None, dtype: torch.dtype = torch.float32,
                        where: str = "lab VAE state dict") -> LabVAE:
        return cls(sd, cfg if cfg is not None else config_from_state_dict(sd, where), dtype=dtype, where=where)

    def to(self, device=None, dtype=None) -> LabVAE:
        for k, v in self.params.items():
            self.params[k] = v.to(device=device, dtype=dtype)
        self.latents_mean, self.latents_std = self.params["latents_mean"], self.params["latents_std"]
        self.pixel_mean = self.pixel_mean.to(device=device, dtype=dtype)
        self.pixel_std = self.pixel_std.to(device=device, dtype=dtype)
        return self

    def eval(self) -> LabVAE:
        return self

    @property
    def device(self) -> torch.device:
        return self.latents_mean.device

    @property
    def dtype(self) -> torch.dtype:
        return self.latents_mean.dtype

    def state_dict(self) -> dict:
        return dict(self.params)

    # ------------------------------------------------------------------ encoder
    def _resblock(self, x: torch.Tensor, p: str) -> torch.Tensor:
        P = self.params
        h = F.silu(_frame_group_norm(x, P[p + "norm1.weight"], P[p + "norm1.bias"]))
        h = _causal_conv(h, P[p + "conv1.weight"], P[p + "conv1.bias"], 1, 1)
        h = F.silu(_frame_group_norm(h, P[p + "norm2.weight"], P[p + "norm2.bias"]))
        h = _causal_conv(h, P[p + "conv2.weight"], P[p + "conv2.bias"], 1, 1)
        if p + "nin_shortcut.weight" in P:
            x = F.conv3d(x, P[p + "nin_shortcut.weight"], P[p + "nin_shortcut.bias"])
        return x + h

    def _encode_moments(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised pixels [B, 3, T, H, W] -> moments [B, 2*embed, T', H/16, W/16] (encoder + quant_conv)."""
        P, cfg = self.params, self.cfg
        h = _causal_conv(x, P["encoder.conv_in.weight"], P["encoder.conv_in.bias"], 1, 1)
        for lvl in range(len(cfg.ch_mult)):
            for b in range(cfg.num_res_blocks[lvl]):
                h = self._resblock(h, f"encoder.down.{lvl}.block.{b}.")
            s, t = cfg.space_down[lvl], cfg.time_down[lvl]
            if s * t > 1:
                if s == 2:
                    h = F.pad(h, (0, 1, 0, 1, 0, 0), mode="reflect")
                p = f"encoder.down.{lvl}.downsample.conv."
                h = _causal_conv(h, P[p + "weight"], P[p + "bias"], 1, 0, stride=(t, s, s))
        h = F.silu(_frame_group_norm(h, P["encoder.norm_out.weight"], P["encoder.norm_out.bias"]))
        h = _causal_conv(h, P["encoder.conv_out.weight"], P["encoder.conv_out.bias"], 1, 1)
        return F.conv3d(h, P["quant_conv.weight"], P["quant_conv.bias"])

    # ------------------------------------------------------------------ decoder
    def _block(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        P, cfg = self.params, self.cfg
        p = f"decoder.transformer_blocks.{i}."
        bsz, n, d = x.shape
        nh, dh = cfg.dec_heads, cfg.dec_dim_head
        y = F.rms_norm(x, (d,), P[p + "norm1.weight"], DEC_EPS)
        qkv = F.linear(y, P[p + "attn.to_qkv.weight"], P[p + "attn.to_qkv.bias"])
        qkv = qkv.view(bsz, n, nh, 3, dh).permute(3, 0, 2, 1, 4)  # per head: [q | k | v]
        q = F.rms_norm(qkv[0], (dh,), None, DEC_EPS)
        k = F.rms_norm(qkv[1], (dh,), None, DEC_EPS)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, qkv[2]).nan_to_num(0.0)
        a = F.linear(a.transpose(1, 2).reshape(bsz, n, d), P[p + "attn.to_out.weight"], P[p + "attn.to_out.bias"])
        x = x + a * P[p + "scale1"]
        y = F.rms_norm(x, (d,), P[p + "norm2.weight"], DEC_EPS)
        gate, up = F.linear(y, P[p + "ff.w1.weight"], P[p + "ff.w1.bias"]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, P[p + "ff.w2.weight"], P[p + "ff.w2.bias"])
        return x + y * P[p + "scale2"]

    def _decode_pixels(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents [B, z, T, h, w] -> raw (ImageNet-normalised) pixels [B, 3, 4T, 16h, 16w]."""
        P, cfg = self.params, self.cfg
        z = F.conv3d(z, P["post_quant_conv.weight"], P["post_quant_conv.bias"])
        bsz, _, t, hh, ww = z.shape
        n = t * hh * ww
        tok = F.linear(z.flatten(2).transpose(1, 2), P["decoder.x_embedder.weight"], P["decoder.x_embedder.bias"])
        suffix = torch.cat([P["decoder.register_tokens"].to(tok).expand(bsz, -1, -1),
                            tok.new_zeros(bsz, 1, tok.shape[-1])], dim=1)
        x = torch.cat([tok, suffix], dim=1)
        coords = torch.cat([_token_coords((t, hh, ww), z.device, z.dtype),
                            z.new_zeros(suffix.shape[1], 3)], dim=0)
        ang = _rope_angles(coords, int(cfg.dec_dim_head * cfg.rope_dim_ratio), cfg.rope_theta)
        cos, sin = torch.cos(ang).to(z.dtype), torch.sin(ang).to(z.dtype)
        for i in range(cfg.dec_layers):
            x = self._block(x, i, cos, sin)
        x = F.layer_norm(x, (x.shape[-1],), P["decoder.norm_out.weight"], P["decoder.norm_out.bias"], DEC_EPS)
        x = F.linear(x[:, :n], P["decoder.proj_out.weight"], P["decoder.proj_out.bias"])
        r, rt, co = cfg.spatial_ratio, cfg.temporal_ratio, cfg.out_channels
        x = x.reshape(bsz, t, hh, ww, co, rt, r, r).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(bsz, co, t * rt, hh * r, ww * r)

    # ------------------------------------------------------------------ pixels / whitening
    def _normalize_pixels(self, x: torch.Tensor) -> torch.Tensor:
        return ((x + 1.0) * 0.5 - self.pixel_mean.to(x)) / self.pixel_std.to(x)

    def _finalize_pixels(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw decoder output -> float32 pixels in [0, 1]."""
        std = self.pixel_std.to(device=raw.device, dtype=torch.float32)
        mean = self.pixel_mean.to(device=raw.device, dtype=torch.float32)
        return (raw * std + mean).clamp(0.0, 1.0)

    # ------------------------------------------------------------------ spatial tiling
    def split_tiles(self, length: int) -> tuple[list[int], list[int], list[int]]:
        """(starts, lengths, overlaps) of the tiles along one pixel axis of ``length``."""
        size = self.tile_size
        if length <= size:
            return [0], [length], []
        n = -(-length // size)
        while size * n - self.tile_overlap_min * (n - 1) < length:
            n += 1
        overlaps = [self.tile_overlap_min] * (n - 1)
        spare_units = (size * n - sum(overlaps) - length) // self.vae_ratio
        for u in range(spare_units):
            overlaps[u % (n - 1)] += self.vae_ratio
        starts = [0]
        for ov in overlaps:
            starts.append(starts[-1] + size - ov)
        return starts, [size] * n, overlaps

    def blend(self, prev: torch.Tensor, cur: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
        """Linear cross-fade of the tail of ``prev`` into the head of ``cur`` along ``dim``; returns ``cur``'s
        extent (blended head + untouched rest)."""
        extent = min(prev.shape[dim], cur.shape[dim], extent)
        ramp = torch.arange(extent, device=cur.device, dtype=cur.dtype) / extent
        shape = [1] * cur.ndim
        shape[dim] = extent
        ramp = ramp.view(shape)
        head = prev.narrow(dim, prev.shape[dim] - extent, extent) * (1 - ramp) + cur.narrow(dim, 0, extent) * ramp
        if extent < cur.shape[dim]:
            return torch.cat([head, cur.narrow(dim, extent, cur.shape[dim] - extent)], dim=dim)
        return head

    def _stitch(self, tiles: list[list[torch.Tensor]], ov_y: list[int], ov_x: list[int]) -> torch.Tensor:
        """Blend each tile with its raw upper / left neighbours, trim the parts the next tiles cover, concatenate."""
        rows = []
        for i, row in enumerate(tiles):
            parts = []
            for j, t in enumerate(row):
                if i > 0:
                    t = self.blend(tiles[i - 1][j], t, ov_y[i - 1], dim=-2)
                if j > 0:
                    t = self.blend(row[j - 1], t, ov_x[j - 1], dim=-1)
                if i < len(tiles) - 1:
                    t = t[..., : t.shape[-2] - ov_y[i], :]
                if j < len(row) - 1:
                    t = t[..., : t.shape[-1] - ov_x[j]]
                parts.append(t)
            rows.append(torch.cat(parts, dim=-1))
        return torch.cat(rows, dim=-2)

    def _tiled(self, fn, x: torch.Tensor, pixel_h: int, pixel_w: int, in_scale: int, out_scale: int):
        ys, yl, yo = self.split_tiles(pixel_h)
        xs, xl, xo = self.split_tiles(pixel_w)
        tiles = [[fn(x[..., y0 // in_scale:(y0 + h) // in_scale, x0 // in_scale:(x0 + w) // in_scale])
                  for x0, w in zip(xs, xl)] for y0, h in zip(ys, yl)]
        return self._stitch(tiles, [o // out_scale for o in yo], [o // out_scale for o in xo])

    def tiled_encode(self, x: torch.Tensor) -> torch.Tensor:
        return self._tiled(self._encode_moments, x, x.shape[-2], x.shape[-1], 1, self.vae_ratio)

    def tiled_decode(self, z: torch.Tensor) -> torch.Tensor:
        r = self.vae_ratio
        return self._tiled(self._decode_pixels, z, z.shape[-2] * r, z.shape[-1] * r, r, 1)

    def _adaptive_encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.tiled_encode(x) if self.tiling else self._encode_moments(x)

    def _adaptive_decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.tiled_decode(z) if self.tiling else self._decode_pixels(z)

    # ------------------------------------------------------------------ encode
    def encode_temporal(self, x: torch.Tensor, device=None) -> torch.Tensor:
        """Video in [-1, 1] -> moments: ``clip_length``-frame clips (last padded with its last frame), trailing
        ``token_drop`` tokens dropped."""
        device = x.device if device is None else device
        out = []
        for s in range(0, x.shape[2], self.clip_length):
            clip = x[:, :, s:s + self.clip_length].to(device)
            short = self.clip_length - clip.shape[2]
            if short > 0:
                clip = torch.cat([clip, clip[:, :, -1:].expand(-1, -1, short, -1, -1)], dim=2)
            out.append(self._adaptive_encode(self._normalize_pixels(clip)))
        z = torch.cat(out, dim=2)
        return z[:, :, : z.shape[2] - self.token_drop] if self.token_drop > 0 else z

    def encode(self, x: torch.Tensor, device=None) -> torch.Tensor:
        """[B, 3, T, H, W] (or [B, 3, H, W]) in [-1, 1] -> whitened latents [B, z, T_lat, H/16, W/16]."""
        if x.ndim == 4:
            x = x.unsqueeze(2)
        device = x.device if device is None else device
        if x.shape[2] == 1:
            moments = self._adaptive_encode(self._normalize_pixels(x.to(device)))[:, :, -1:]
        else:
            moments = self.encode_temporal(x, device)
        mean = moments.float()[:, : moments.shape[1] // 2]
        return (mean - self.latents_mean.view(1, -1, 1, 1, 1).to(mean)) / self.latents_std.view(1, -1, 1, 1, 1).to(mean)

    # ------------------------------------------------------------------ decode
    def _decode_temporal_chunks(self, t_lat: int) -> tuple[int, int]:
        """(tokens of padding appended, chunks decoded) for a latent of ``t_lat`` tokens."""
        total = t_lat + self.token_drop
        pad = (-total) % self.tokens_chunk_size
        chunks = (total + pad) // self.tokens_chunk_size - (1 if self.token_drop > 0 else 0)
        if chunks < 1:
            pad += self.tokens_chunk_size
            chunks += 1
        return pad, chunks

    def _pad_frames(self, t_padded: int, pad: int) -> int:
        """Output frames that belong to the ``pad`` repeated tokens (cut from the end)."""
        if pad <= 0:
            return 0
        tail = self.clip_length % self.vae_ratio_t
        if tail == 0:
            return pad * self.vae_ratio_t
        first = t_padded - pad
        return sum(tail if (first + k) % self.tokens_chunk_size == 0 else self.vae_ratio_t for k in range(pad))

    def _temporal_parts(self, z: torch.Tensor, pad: int, chunks: int):
        """Yield raw decoder frame blocks in output order (chunk bodies, blended overlaps, the final overlap)."""
        frames_per_chunk = self.tokens_chunk_size * self.vae_ratio_t
        keep_overlap = self.token_drop > 0
        carried = None
        for c in range(chunks):
            t0 = c * self.tokens_chunk_size
            dec = self._adaptive_decode(z[:, :, t0:t0 + self.tokens_chunk_size + self.token_overlap])
            body = dec[:, :, :frames_per_chunk][:, :, self.frame_pre_padding:]
            if carried is not None:
                body = self.blend(carried, body, self.frame_overlap, dim=-3)
                carried = None
            yield body
            if keep_overlap:
                carried = dec[:, :, frames_per_chunk:2 * frames_per_chunk][:, :, self.frame_pre_padding:]
            if c == chunks - 1 and carried is not None:
                yield carried

    def decode_output_shape(self, shape) -> tuple[int, ...]:
        b, _, t, h, w = shape
        if t == 1:
            frames = 1
        else:
            pad, chunks = self._decode_temporal_chunks(t)
            frames = self._planned_frames(t + pad, pad, chunks)
        return (b, self.cfg.out_channels, frames, h * self.vae_ratio, w * self.vae_ratio)

    def _planned_frames(self, t_padded: int, pad: int, chunks: int) -> int:
        per_chunk = self.tokens_chunk_size * self.vae_ratio_t
        total, last_overlap = 0, 0
        for c in range(chunks):
            t0 = c * self.tokens_chunk_size
            n_frames = max(0, min(t0 + self.tokens_chunk_size + self.token_overlap, t_padded) - min(t0, t_padded))
            n_frames *= self.vae_ratio_t
            total += max(0, min(per_chunk, n_frames) - self.frame_pre_padding)
            if self.token_drop > 0:
                last_overlap = max(0, min(2 * per_chunk, n_frames) - per_chunk - self.frame_pre_padding)
        return total + last_overlap - self._pad_frames(t_padded, pad)

    def decode_temporal(self, z: torch.Tensor, output_buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Raw latents with T > 1 -> float32 pixels in [0, 1]."""
        pad, chunks = self._decode_temporal_chunks(z.shape[2])
        if pad > 0:
            z = torch.cat([z, z[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
        n_out = self._planned_frames(z.shape[2], pad, chunks)
        parts, have = [], 0
        for part in self._temporal_parts(z, pad, chunks):
            if have >= n_out:
                break
            part = self._finalize_pixels(part[:, :, : n_out - have])
            have += part.shape[2]
            parts.append(part)
        out = torch.cat(parts, dim=2)
        if output_buffer is not None:
            output_buffer[:, :, : out.shape[2]].copy_(out)
            return output_buffer
        return out

    def decode(self, z: torch.Tensor, output_buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Whitened latents [B, z, T_lat, h, w] -> float32 pixels [B, 3, T, 16h, 16w] in [0, 1]."""
        z = z * self.latents_std.view(1, -1, 1, 1, 1).to(z) + self.latents_mean.view(1, -1, 1, 1, 1).to(z)
        if z.shape[2] == 1:
            out = self._finalize_pixels(self._adaptive_decode(z)[:, :, -1:])
            if output_buffer is not None:
                output_buffer.copy_(out)
                return output_buffer
            return out
        return self.decode_temporal(z, output_buffer)


def load_lab_vae(path: str | Path | None = None, dtype: torch.dtype = torch.float32, **cfg_overrides) -> LabVAE:
    """The lab VAE from ``path`` (default: the committed ``benchmarks/lab/weights/h3lab_video_vae.safetensors``).
    ``cfg_overrides`` (e.g. ``tile_size``, ``tiling``) change the runtime plan, never the weights' shapes."""
    from ditkit.loaders.safetensors_io import load_file

    path = Path(path) if path is not None else DEFAULT_VAE_FILE
    if not path.is_file():
        raise CheckpointError(f"lab VAE weights not found at '{path}' (expected the committed "
                              "benchmarks/lab/weights/h3lab_video_vae.safetensors)")
    sd = load_file(str(path))
    where = f"lab VAE file '{path.name}'"
    cfg = config_from_state_dict(sd, where, **cfg_overrides)
    return LabVAE(sd, cfg, dtype=dtype, where=where)
