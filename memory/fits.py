"""The "what fits" table: for real-size MiniMax H3 and LTX-2 jobs, the first ditkit settings (fewest changes:
chunking, then streaming, then a lower-precision format) whose predicted peak fits each card, computed by
:mod:`ditkit.memory.model` from the real key inventories (the tiny generators' shape functions at real
dimensions). Computed, not measured; see docs/memory.md for what the model was checked against."""
from __future__ import annotations

from .model import GIB, DiTDims, Options, Tokens, weights_from_inventory
from .preflight import plan

# H3: /work/shared/reference/h3.md config table (= benchmarks/bench_quantize.py REAL["h3"], checked against the
# public config by tests/integration/test_real_dims_host.py). LTX-2 19B: diffusers convert_ltx2_to_diffusers.py "2.0"
# (same source and test).
H3_REAL = {"hidden_size": 5376, "num_attention_heads": 56, "attention_head_dim": 128, "num_layers": 50,
           "token_refiner_num_layers": 2, "ffn_hidden_size": 14336, "latents_dim": 24, "audio_latents_dim": 32,
           "patch_size": [1, 2, 2], "text_dim": 5120, "timestep_input_dim": 256, "time_embed_hidden_size": 5376,
           "time_embed_dim": 2688, "rope_inv_freq_len": 16}
LTX2_REAL = {"num_layers": 48, "num_attention_heads": 32, "attention_head_dim": 128, "cross_attention_dim": 4096,
             "audio_num_attention_heads": 32, "audio_attention_head_dim": 64, "audio_cross_attention_dim": 2048,
             "caption_channels": 3840, "connector_num_attention_heads": 30, "connector_attention_head_dim": 128,
             "connector_num_layers": 2, "in_channels": 128, "audio_in_channels": 128}
CARDS_GB = (24, 32, 48, 80, 141)
TEXT_TOKENS = 512          # assumed prompt rows (H3: Qwen3-VL states); stated in the table
FORMATS = ("bf16", "float8_e4m3fn", "nvfp4")


def h3_jobs() -> list[tuple[str, Tokens]]:
    """(label, tokens): T2VA at 24 fps (ComfyUI's 17k+5 frame grid, latent T = (frames-5)//17*5+2, audio 40 Hz
    stereo), video tokens T x H/32 x W/32 (VAE /16, patch 2x2)."""
    out = []
    for secs, frames in ((5, 124), (10, 243)):
        lt = (frames - 5) // 17 * 5 + 2
        audio = round(frames / 24 * 40)
        for w, h in ((1344, 768), (1920, 1088)):
            out.append((f"H3 T2VA {secs} s {w}x{h}", Tokens(video=lt * (h // 32) * (w // 32), audio=2 * audio,
                                                          text=TEXT_TOKENS)))
    return out


def ltx2_jobs() -> list[tuple[str, Tokens]]:
    """LTX-2 video tokens ((frames-1)/8+1) x H/32 x W/32 (VAE 32x spatial, 8x temporal, patch 1) at 24 fps; the
    audio stream's rows are not counted (a few hundred)."""
    out = []
    for secs, frames in ((5, 121), (10, 241)):
        for w, h in ((1280, 704), (1920, 1088)):
            out.append((f"LTX-2 {secs} s {w}x{h}", Tokens(video=((frames - 1) // 8 + 1) * (h // 32) * (w // 32),
                                                        text=TEXT_TOKENS)))
    return out


def _h3_model():
    from ..tiny import ckpt_h3

    c = dict(ckpt_h3.CONFIG, **H3_REAL)
    inv = {k: (tuple(s), "F32" if k.startswith(ckpt_h3.FP32_PREFIXES) else "BF16")
           for k, s in ckpt_h3.comfy_shapes(c).items()}
    dims = DiTDims("h3", 5376, 56, 128, 14336, 50)
    return dims, {f: weights_from_inventory("h3", inv, f, "blocks.") for f in FORMATS}


def _ltx_model():
    from ..tiny import ckpt_ltx

    c = dict(ckpt_ltx.CONFIG, **LTX2_REAL)
    inv = {k: (tuple(s), "BF16") for k, s in ckpt_ltx.ltxav_shapes(c).items()}
    dims = DiTDims("ltx2", 4096, 32, 128, 16384, 48, ffn_kind="gelu", extra_cols=LTX2_REAL["audio_cross_attention_dim"])
    return dims, {f: weights_from_inventory("ltx2", inv, f, "transformer_blocks.") for f in FORMATS}


def _first_fit(dims, weights, tok, avail, gb, streaming: bool) -> tuple[str, float | None]:
    base = Options(compute="bfloat16", weight_format="bf16", attention="flash", streaming=streaming)
    p = plan(dims, weights, tok, base, avail, f"of a {gb} GB card", streaming_possible=False, max_suggestions=1)
    if p.fits:
        return "bf16 as is", p.prediction.device / GIB
    if p.suggestions and "video_tokens" not in p.suggestions[0].settings:
        s = p.suggestions[0]
        return ", ".join(f"{k} {v}" for k, v in s.settings.items()), s.prediction.device / GIB
    return "does not fit", None


def fits_rows() -> list[dict]:
    """Per job and card: the first fitting settings with every weight resident, and with the blocks streamed
    (ComfyUI's partial loading / dynamic VRAM keeping the non-block weights + 2 blocks on the device: the model's
    lower bound of streaming, not a ditkit setting)."""
    rows = []
    for model, jobs in ((_h3_model, h3_jobs()), (_ltx_model, ltx2_jobs())):
        dims, weights = model()
        for label, tok in jobs:
            for gb in CARDS_GB:
                avail = int(gb * 1e9 * 0.95)   # 5 % for the CUDA context and the allocator
                resident = _first_fit(dims, weights, tok, avail, gb, False)
                streamed = _first_fit(dims, weights, tok, avail, gb, True)
                rows.append({"job": label, "tokens": tok.total, "card_gb": gb, "resident": resident,
                             "streamed": streamed})
    return rows


def _cell(c) -> str:
    return c[0] if c[1] is None else f"{c[0]} ({c[1]:.1f} GiB)"


def fits_table() -> str:
    lines = ["| job | tokens | card | weights resident: settings (predicted peak) | blocks streamed: settings "
             "(predicted peak) |", "|---|---|---|---|---|"]
    for r in fits_rows():
        lines.append(f"| {r['job']} | {r['tokens']:,} | {r['card_gb']} GB | {_cell(r['resident'])} | "
                     f"{_cell(r['streamed'])} |")
    return "\n".join(lines)
