"""MiniMax H3 VAE key layouts (ComfyUI naming), the stock source config, and config detection from shapes.

Plain torch/python. ``video_vae_plan(cfg)`` gives key -> shape of a ComfyUI H3 video VAE for a (possibly scaled)
config; with the stock config it is the 562-key inventory of h3.md §4.4. ``detect_video_config(shapes)`` reads
the config back from a file's shapes (dim_head is fixed at the stock 64, so heads = dim / 64).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import CheckpointError

# The stock AutoencoderKLLegacy source config (h3.md §4.1/§4.6; the `source_config` carried by the released image
# VAE's `minimax_h3_video_vae` metadata). `_class_name` must match too; `_diffusers_version` is not compared.
STOCK_SOURCE_CONFIG = {
    "_class_name": "AutoencoderKLLegacy", "_diffusers_version": "0.32.2",
    "causal_decoder": False, "causal_encoder": True, "ch": 128, "ch_mult": [1, 2, 2, 4, 4, 8], "embed_dim": 24,
    "in_channels": 3, "num_res_blocks": 2, "num_res_blocks_decoder": None, "out_ch": 3, "padding_mode": "reflect",
    "padding_mode_t": None, "pixel_norm_type": "imagenet", "scaling_factor": 1.0, "shift_factor": 0.0,
    "space_down": [2, 2, 2, 2, 1, 1], "space_up": [1, 2, 2, 2, 2, 1], "time_down": [1, 2, 2, 1, 1, 1],
    "time_up": None, "use_3d_conv": True, "use_t_isolated_gn": True, "use_vit_decoder": True, "vae_ratio": 16,
    "vae_ratio_t": 4,
    "vit_decoder_kwargs": {"dim_head": 64, "ffn_activation_fn": "silu", "ffn_use_gated": True, "heads": 32,
                           "norm_affine": True, "norm_type": "rms_norm", "num_layers": 36, "qk_norm_affine": False,
                           "qk_norm_type": "rms_norm", "rope_dim_ratio": 0.75, "rope_theta": 100.0},
    "z_channels": 24, "zq_ch_decoder": None, "zq_ch_encoder": None,
}
SOURCE_CONFIG_IGNORED = frozenset({"_diffusers_version"})

def video_vae_plan(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a ComfyUI H3 video VAE state dict for the given (possibly scaled) config."""
    ch, mult, nrb = cfg["ch"], cfg["ch_mult"], cfg["num_res_blocks"]
    z, emb = cfg["z_channels"], cfg["embed_dim"]
    mid = [ch * m for m in mult]
    cin = [mid[0]] + mid[:-1]
    p: dict[str, tuple[int, ...]] = {}
    p["encoder.conv_in.weight"] = (mid[0], 3, 3, 3, 3)
    p["encoder.conv_in.bias"] = (mid[0],)
    for lvl in range(len(mult)):
        for i in range(nrb):
            ci = cin[lvl] if i == 0 else mid[lvl]
            co = mid[lvl]
            pre = f"encoder.down.{lvl}.block.{i}."
            p[pre + "norm1.weight"] = (ci,)
            p[pre + "norm1.bias"] = (ci,)
            p[pre + "conv1.weight"] = (co, ci, 3, 3, 3)
            p[pre + "conv1.bias"] = (co,)
            p[pre + "norm2.weight"] = (co,)
            p[pre + "norm2.bias"] = (co,)
            p[pre + "conv2.weight"] = (co, co, 3, 3, 3)
            p[pre + "conv2.bias"] = (co,)
            if ci != co:
                p[pre + "nin_shortcut.weight"] = (co, ci, 1, 1, 1)
                p[pre + "nin_shortcut.bias"] = (co,)
        if cfg["space_down"][lvl] * cfg["time_down"][lvl] > 1:
            p[f"encoder.down.{lvl}.downsample.conv.weight"] = (mid[lvl], mid[lvl], 3, 3, 3)
            p[f"encoder.down.{lvl}.downsample.conv.bias"] = (mid[lvl],)
    p["encoder.norm_out.weight"] = (mid[-1],)
    p["encoder.norm_out.bias"] = (mid[-1],)
    p["encoder.conv_out.weight"] = (2 * z, mid[-1], 3, 3, 3)
    p["encoder.conv_out.bias"] = (2 * z,)
    p["quant_conv.weight"] = (2 * emb, 2 * z, 1, 1, 1)
    p["quant_conv.bias"] = (2 * emb,)
    p["post_quant_conv.weight"] = (z, emb, 1, 1, 1)
    p["post_quant_conv.bias"] = (z,)
    dim = cfg["dec_heads"] * cfg["dec_dim_head"]
    inner = dim * cfg["ffn_mult"]
    p["decoder.x_embedder.weight"] = (dim, z)
    p["decoder.x_embedder.bias"] = (dim,)
    p["decoder.register_tokens"] = (1, cfg["num_register_tokens"], dim)
    p["decoder.mask_token"] = (1, 1, dim)
    for k in range(cfg["dec_layers"]):
        pre = f"decoder.transformer_blocks.{k}."
        p[pre + "norm1.weight"] = (dim,)
        p[pre + "attn.to_qkv.weight"] = (3 * dim, dim)
        p[pre + "attn.to_qkv.bias"] = (3 * dim,)
        p[pre + "attn.to_out.weight"] = (dim, dim)
        p[pre + "attn.to_out.bias"] = (dim,)
        p[pre + "scale1"] = (dim,)
        p[pre + "norm2.weight"] = (dim,)
        p[pre + "ff.w1.weight"] = (2 * inner, dim)
        p[pre + "ff.w1.bias"] = (2 * inner,)
        p[pre + "ff.w2.weight"] = (dim, inner)
        p[pre + "ff.w2.bias"] = (dim,)
        p[pre + "scale2"] = (dim,)
    p["decoder.norm_out.weight"] = (dim,)
    p["decoder.norm_out.bias"] = (dim,)
    npix = cfg["out_channels"] * cfg["patch_size_t"] * cfg["patch_size"] ** 2
    p["decoder.proj_out.weight"] = (npix, dim)
    p["decoder.proj_out.bias"] = (npix,)
    p["latents_mean"] = (z,)
    p["latents_std"] = (z,)
    return p


def audio_vae_plan(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a ComfyUI H3 audio VAE state dict (weight-norm folded) for the given config."""
    p: dict[str, tuple[int, ...]] = {}
    c = cfg["latent_channels"]
    lat = cfg["latent_dim"]
    p["latents_mean"] = (c,)
    p["latents_std"] = (c,)
    d = cfg["encoder_dim"]
    p["encoder.block.0.weight"] = (d, 1, 7)
    p["encoder.block.0.bias"] = (d,)
    for bi, stride in enumerate(cfg["encoder_rates"], start=1):
        half, d = d, d * 2
        pre = f"encoder.block.{bi}.block."
        for r in range(3):
            p[f"{pre}{r}.block.0.alpha"] = (1, half, 1)
            p[f"{pre}{r}.block.1.weight"] = (half, half, 7)
            p[f"{pre}{r}.block.1.bias"] = (half,)
            p[f"{pre}{r}.block.2.alpha"] = (1, half, 1)
            p[f"{pre}{r}.block.3.weight"] = (half, half, 1)
            p[f"{pre}{r}.block.3.bias"] = (half,)
        p[f"{pre}3.alpha"] = (1, half, 1)
        p[f"{pre}4.weight"] = (d, half, 2 * stride)
        p[f"{pre}4.bias"] = (d,)
    nb = len(cfg["encoder_rates"]) + 1
    p[f"encoder.block.{nb}.alpha"] = (1, d, 1)
    p[f"encoder.block.{nb + 1}.weight"] = (lat, d, 3)
    p[f"encoder.block.{nb + 1}.bias"] = (lat,)
    pb = "pre_block."
    p[pb + "norm1.weight"] = (lat,)
    p[pb + "norm1.bias"] = (lat,)
    p[pb + "attn.q_bias"] = (lat,)
    p[pb + "attn.v_bias"] = (lat,)
    p[pb + "attn.zero_k_bias"] = (lat,)
    p[pb + "attn.qkv.weight"] = (3 * lat, lat)
    p[pb + "attn.proj.weight"] = (c, c)
    p[pb + "attn.proj.bias"] = (c,)
    p[pb + "proj.weight"] = (c, lat)
    p[pb + "proj.bias"] = (c,)
    p[pb + "norm3.weight"] = (lat,)
    p[pb + "norm3.bias"] = (lat,)
    p[pb + "norm2.weight"] = (c,)
    p[pb + "norm2.bias"] = (c,)
    p[pb + "mlp.norm.weight"] = (c,)
    p[pb + "mlp.norm.bias"] = (c,)
    p[pb + "mlp.w0.weight"] = (2 * c, c)
    p[pb + "mlp.w0.bias"] = (2 * c,)
    p[pb + "mlp.w1.weight"] = (2 * c, c)
    p[pb + "mlp.w1.bias"] = (2 * c,)
    p[pb + "mlp.w2.weight"] = (c, 2 * c)
    p[pb + "mlp.w2.bias"] = (c,)
    for n in ("mean_proj", "logs_proj"):
        p[n + ".weight"] = (c, c, 1)
        p[n + ".bias"] = (c,)
    p["dec_in_proj.weight"] = (lat, c, 1)
    p["dec_in_proj.bias"] = (lat,)
    dd = cfg["decoder_dim"]
    p["decoder.conv_pre.weight"] = (dd, lat, 7)
    p["decoder.conv_pre.bias"] = (dd,)
    for i, k in enumerate(cfg["upsample_kernel_sizes"]):
        ci, co = dd // 2 ** i, dd // 2 ** (i + 1)
        p[f"decoder.ups.{i}.0.weight"] = (ci, co, k)
        p[f"decoder.ups.{i}.0.bias"] = (co,)
    rb = 0
    nd = len(cfg["resblock_dilations"])
    for i in range(len(cfg["upsample_rates"])):
        chn = dd // 2 ** (i + 1)
        for k in cfg["resblock_kernel_sizes"]:
            pre = f"decoder.resblocks.{rb}."
            for j in range(nd):
                for conv in ("convs1", "convs2"):
                    p[f"{pre}{conv}.{j}.weight"] = (chn, chn, k)
                    p[f"{pre}{conv}.{j}.bias"] = (chn,)
            for a in range(2 * nd):
                _snake_beta_act(p, f"{pre}activations.{a}.", chn)
            rb += 1
    chn = dd // 2 ** len(cfg["upsample_rates"])
    _snake_beta_act(p, "decoder.activation_post.", chn)
    p["decoder.conv_post.weight"] = (1, chn, 7)
    return p


def _snake_beta_act(p: dict, pre: str, chn: int) -> None:
    p[pre + "act.alpha"] = (chn,)
    p[pre + "act.beta"] = (chn,)
    p[pre + "upsample.filter"] = (1, 1, 12)
    p[pre + "downsample.lowpass.filter"] = (1, 1, 12)




# ---------------------------------------------------------------------------------------------- detection

STOCK_VIDEO_CONFIG = {
    "ch": 128, "ch_mult": [1, 2, 2, 4, 4, 8], "num_res_blocks": 2, "z_channels": 24, "embed_dim": 24,
    "space_down": [2, 2, 2, 2, 1, 1], "time_down": [1, 2, 2, 1, 1, 1],
    "dec_layers": 36, "dec_heads": 32, "dec_dim_head": 64, "num_register_tokens": 4, "ffn_mult": 4,
    "patch_size": 16, "patch_size_t": 4, "out_channels": 3,
}

# keys that identify a family (the same keys ComfyUI's VAE wrapper detects on)
H3_VIDEO_KEYS = ("decoder.transformer_blocks.0.scale1", "encoder.down.5.block.0.conv1.weight")
H3_AUDIO_KEY = "pre_block.attn.zero_k_bias"
LTX_VIDEO_KEYS = ("decoder.up_blocks.0.res_blocks.0.conv1.conv.weight", "per_channel_statistics.mean-of-means",
                  "vae.per_channel_statistics.mean-of-means", "decoder.conv_in.conv.weight")


def classify_vae_keys(keys) -> str:
    """'h3_video', 'h3_audio', 'ltx_video' or 'unknown' from the tensor names of a VAE file."""
    ks = set(keys)
    if all(k in ks for k in H3_VIDEO_KEYS):
        return "h3_video"
    if H3_AUDIO_KEY in ks:
        return "h3_audio"
    if any(k in ks for k in LTX_VIDEO_KEYS) or any(k.startswith("vae.decoder.") for k in ks):
        return "ltx_video"
    return "unknown"


@dataclass(frozen=True)
class H3VideoVAEConfig:
    """A (possibly scaled) H3 video VAE config, as detected from a file's shapes."""
    ch: int
    ch_mult: tuple[int, ...]
    num_res_blocks: int
    dec_layers: int
    dec_heads: int
    dec_dim_head: int = 64
    z_channels: int = 24
    embed_dim: int = 24
    num_register_tokens: int = 4
    ffn_mult: int = 4

    def plan_cfg(self) -> dict:
        cfg = dict(STOCK_VIDEO_CONFIG)
        cfg.update(ch=self.ch, ch_mult=list(self.ch_mult), num_res_blocks=self.num_res_blocks,
                   dec_layers=self.dec_layers, dec_heads=self.dec_heads, dec_dim_head=self.dec_dim_head,
                   z_channels=self.z_channels, embed_dim=self.embed_dim,
                   num_register_tokens=self.num_register_tokens, ffn_mult=self.ffn_mult)
        return cfg

    @property
    def is_stock(self) -> bool:
        c = self.plan_cfg()
        return all(c[k] == STOCK_VIDEO_CONFIG[k] for k in STOCK_VIDEO_CONFIG)

    def describe(self) -> str:
        return (f"ch {self.ch} ch_mult {list(self.ch_mult)} decoder {self.dec_layers} layers x {self.dec_heads} heads x "
                f"{self.dec_dim_head}" + (" (stock size)" if self.is_stock else " (scaled)"))


def detect_video_config(shapes: dict[str, tuple[int, ...]], where: str) -> H3VideoVAEConfig:
    """Read the config back from the shapes and check the whole key inventory against it (exact key set and
    shapes). Everything except the widths (ch, ch_mult values, decoder layers/heads) must be stock."""
    def need(key):
        if key not in shapes:
            raise CheckpointError(f"{where}: not an H3 video VAE: tensor {key!r} is missing")
        return shapes[key]

    ch = need("encoder.conv_in.weight")[0]
    mids = []
    while f"encoder.down.{len(mids)}.block.0.conv1.weight" in shapes:
        mids.append(shapes[f"encoder.down.{len(mids)}.block.0.conv1.weight"][0])
    if len(mids) != len(STOCK_VIDEO_CONFIG["ch_mult"]):
        raise CheckpointError(f"{where}: H3 video VAE encoder has {len(mids)} levels, expected "
                              f"{len(STOCK_VIDEO_CONFIG['ch_mult'])}")
    if ch <= 0 or any(m % ch for m in mids):
        raise CheckpointError(f"{where}: encoder widths {mids} are not multiples of ch={ch}")
    nrb = 0
    while f"encoder.down.0.block.{nrb}.conv1.weight" in shapes:
        nrb += 1
    z = need("encoder.conv_out.weight")[0] // 2
    emb = need("quant_conv.weight")[0] // 2
    if z != 24 or emb != 24:
        raise CheckpointError(f"{where}: H3 video VAE must have 24 latent channels; "
                              f"'encoder.conv_out.weight' gives {z}, 'quant_conv.weight' gives {emb}")
    dim = need("decoder.x_embedder.weight")[0]
    if dim % 64:
        raise CheckpointError(f"{where}: 'decoder.x_embedder.weight' width {dim} is not a multiple of the stock "
                              "head dim 64")
    layers = 0
    while f"decoder.transformer_blocks.{layers}.scale1" in shapes:
        layers += 1
    regs = need("decoder.register_tokens")
    w2 = need("decoder.transformer_blocks.0.ff.w2.weight")
    if len(regs) != 3 or len(w2) != 2 or w2[1] % dim:
        raise CheckpointError(f"{where}: unexpected decoder shapes register_tokens {regs}, ff.w2 {w2}")
    cfg = H3VideoVAEConfig(ch=ch, ch_mult=tuple(m // ch for m in mids), num_res_blocks=nrb, dec_layers=layers,
                           dec_heads=dim // 64, num_register_tokens=regs[1], ffn_mult=w2[1] // dim)
    plan = video_vae_plan(cfg.plan_cfg())
    missing = [k for k in plan if k not in shapes]
    extra = [k for k in shapes if k not in plan]
    wrong = [f"{k} {tuple(shapes[k])} (expected {plan[k]})" for k in plan if k in shapes and tuple(shapes[k]) != plan[k]]
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensors (e.g. {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} unexpected tensors (e.g. {extra[:3]}; quantized or pruned files are not "
                         "supported here)")
        if wrong:
            parts.append(f"{len(wrong)} shapes inconsistent with the detected config (e.g. {wrong[:2]})")
        raise CheckpointError(f"{where}: H3 video VAE inventory does not match its detected config "
                              f"[{cfg.describe()}]: " + "; ".join(parts))
    return cfg
