"""Pure-torch reference of the quality lab's MiniMax H3 DiT (no ComfyUI): forward pass and strict loader.

The lab DiT (``benchmarks/lab/weights/h3lab_dit.safetensors``, ComfyUI key layout) is MiniMax H3 at tiny width.
This module re-implements the H3 forward for the text-to-audio-video task the lab samples, so the lab harness and
its CI smoke run without ComfyUI; ``tests/integration/test_lab_ref_equivalence_dit.py`` proves it equal to
ComfyUI's ``MiniMaxH3Model`` on the same weights and inputs.

What the forward does (H3's maths):

* packed sequence ``[text | audio | video]``: text = refined prompt states, audio = the stereo 32-channel latent as
  ``2 x T`` rows (channel 0 frames then channel 1 frames), video = 1x2x2 patches of the 24-channel latent
  (row order t, h, w; feature order c, pt, ph, pw);
* text conditioning: ``condition_proj`` then the token refiner (RMSNorm pre-norm attention + SwiGLU blocks, final
  RMSNorm); ComfyUI runs it once per sampling (``preprocess_text_embeds``), the forward skips it when the context
  already has the hidden width;
* timesteps: the sampler passes ``sigma * 1000`` of the video stream; video and text rows run at
  ``t = 1 - sigma_v``, audio rows at ``1 - sigma_a`` with ``sigma_a`` the video sigma moved from the video shift (12)
  to the audio shift (3) schedule. Each distinct ``t`` gets one sinusoidal embedding (cos first) -> MLP;
* AdaLN: each block projects ``silu(t_emb)`` to 6 vectors x 3 modalities (video 0, text 1, audio 2); modulation row
  = ``t_index * 3 + modality``; ``mod_segments`` = ``[(start, stop, row)]`` per packed segment (text, audio, video);
* MM-RoPE on 3 axes (t, h, w) with per-axis ``inv_freq``; the rotation covers the first ``6 * len(inv_freq)`` of
  each head's dims in split-half pairing, after per-head RMSNorm of q and k;
* final layer: RMSNorm, (shift, scale) per stream timestep, fp32 video / audio heads; the output is the negated
  prediction (H3 predicts ``x0 - noise``; ComfyUI's flow convention wants ``noise - x0``);
* the AV latent as the sampler carries it: audio is carried scaled onto the video schedule
  (``x_audio * sigma_v / sigma_a``); :meth:`LabH3DiT.forward` undoes that before the network and maps the velocity
  back (``minimax_payload["audio_scale"]`` = video shift / audio shift, as ComfyUI's ``MiniMaxH3`` model class sets it).

Hook protocol (the same as ComfyUI's ``MiniMaxH3Model._forward``, so ditkit's TeaCache / VSA cores run unchanged):
module and attribute names equal ComfyUI's (``blocks[i].adaln_proj``, ``.norm1``, ``.attn.heads`` ...);
``transformer_options["patches_replace"]["dit"][("double_block", i)](args, {"original_block": fn})`` with
``args = {img, t_emb, mod_segments, rope_freqs, transformer_options}``; attention calls go through
``transformer_options["optimized_attention_override"](func, q, k, v, heads, mask=None, skip_reshape=True,
transformer_options=...)`` with ``q, k, v`` as ``[1, heads, S, head_dim]`` and a ``[1, S, heads * head_dim]`` result;
``transformer_options["wrappers"]["diffusion_model"]`` wrappers are called as ``wrapper(executor, x, timestep,
context, transformer_options, **kwargs)`` around the inner forward (``executor.class_obj`` = the model).

Only the t2va layout is implemented (no keyframes, references, denoise masks or text modality tags): such inputs
raise :class:`NotImplementedError` naming them.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ditkit.errors import CheckpointError
from ditkit.loaders.safetensors_io import load_file

LAB_DIR = Path(__file__).resolve().parent
DIT_FILE = LAB_DIR / "weights" / "h3lab_dit.safetensors"
TEXT_FILE = LAB_DIR / "weights" / "h3lab_text_embed.safetensors"

# the lab DiT (benchmarks/lab/lab_comfy.py DIT_CONFIG); checked against the file at load time
LAB_DIT_CONFIG = dict(hidden_size=96, num_layers=4, token_refiner_num_layers=2, num_attention_heads=4,
                      attention_head_dim=32, ffn_hidden_size=256, latents_dim=24, audio_latents_dim=32,
                      patch_size=(1, 2, 2), text_dim=32, timestep_input_dim=64, time_embed_hidden_size=96,
                      time_embed_dim=48, rope_inv_freq_len=4)
SHIFT_VIDEO, SHIFT_AUDIO = 12.0, 3.0
EPS = 1e-5
# temporal span of each video latent frame on the RoPE time axis: first token 1 pixel frame, then 4, x 5/3
_TOKEN_FRAMES = (1, 4, 4, 4, 4)
_FRAME_SCALE = 5.0 / 3.0
MODALITY = {"video": 0, "text": 1, "audio": 2}


def shift_sigma(sigma, shift_from: float, shift_to: float):
    """``sigma`` on the ``shift_from`` flow schedule -> the same base time on the ``shift_to`` schedule."""
    base = sigma / (shift_from + sigma * (1.0 - shift_from))  # inverse of s*b / (1 + (s-1)*b)
    return shift_to * base / (1.0 + (shift_to - 1.0) * base)


# ================================================================================================ layout

def _centred_axis(n_lat: int, sqrt_area: float) -> torch.Tensor:
    """Area-normalised coordinates of the ``n_lat // 2`` patch positions along one latent axis (float64)."""
    n = n_lat // 2
    frac = n_lat / sqrt_area
    return (torch.arange(n, dtype=torch.float64) * (frac / n) + (1.0 - frac) / 2.0) * 32.0


class Layout:
    """The packed ``[text | audio | video]`` sequence: ``segments`` = ``[(start, stop, kind)]`` (ComfyUI's
    ``PackedLayout.segments`` format), ``position_ids`` ``[S, 3]`` float64 (t, h, w), ``seq_len``."""

    def __init__(self, text_len: int, latent_t: int, lat_h: int, lat_w: int, audio_t: int):
        sqrt_area = math.sqrt(lat_h * lat_w)
        ys, xs = _centred_axis(lat_h, sqrt_area), _centred_axis(lat_w, sqrt_area)
        text = torch.zeros(text_len, 3, dtype=torch.float64)
        text[:, 0] = torch.arange(text_len, dtype=torch.float64)
        t0 = float(text_len)
        audio = torch.zeros(2 * audio_t, 3, dtype=torch.float64)
        audio[:, 0] = (t0 + torch.arange(audio_t, dtype=torch.float64)).repeat(2)
        audio[:audio_t, 2] = xs[0]  # stereo channel 0 at the left edge of the frame grid, channel 1 at the right
        audio[audio_t:, 2] = xs[-1]
        spans = [_FRAME_SCALE * _TOKEN_FRAMES[k % len(_TOKEN_FRAMES)] for k in range(latent_t)]
        starts = [t0 + sum(spans[:k]) for k in range(latent_t)]
        yy, xx = torch.meshgrid(ys, xs, indexing="ij")
        n_frame = yy.numel()
        video = torch.empty(latent_t, n_frame, 3, dtype=torch.float64)
        video[:, :, 0] = torch.tensor(starts, dtype=torch.float64)[:, None]
        video[:, :, 1] = yy.reshape(-1)[None]
        video[:, :, 2] = xx.reshape(-1)[None]
        self.position_ids = torch.cat([text, audio, video.reshape(-1, 3)])
        n_text, n_audio, n_video = text_len, 2 * audio_t, latent_t * n_frame
        self.segments = [(0, n_text, "text"), (n_text, n_text + n_audio, "audio"),
                         (n_text + n_audio, n_text + n_audio + n_video, "video")]
        self.seq_len = n_text + n_audio + n_video
        self.signature = (text_len, latent_t, lat_h, lat_w, audio_t)


def patchify(latent: torch.Tensor, patch) -> torch.Tensor:
    """``[1, C, T, H, W]`` -> ``[t*h*w, C*pt*ph*pw]`` rows (t, h, w order; features c, pt, ph, pw)."""
    b, c, T, H, W = latent.shape
    pt, ph, pw = patch
    x = latent.reshape(b, c, T // pt, pt, H // ph, ph, W // pw, pw)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # b, t, h, w, c, pt, ph, pw
    return x.reshape(-1, c * pt * ph * pw)


def unpatchify(rows: torch.Tensor, t: int, h: int, w: int, c: int, patch) -> torch.Tensor:
    pt, ph, pw = patch
    x = rows.reshape(-1, t, h, w, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)  # b, c, t, pt, h, ph, w, pw
    return x.reshape(-1, c, t * pt, h * ph, w * pw)


def audio_rows(latent: torch.Tensor) -> torch.Tensor:
    """``[1, C, 2, T]`` -> ``[2*T, C]`` (channel 0 frames, then channel 1 frames)."""
    return latent[0].permute(1, 2, 0).reshape(-1, latent.shape[1])


def audio_from_rows(rows: torch.Tensor, channels: int = 2) -> torch.Tensor:
    return rows.reshape(channels, rows.shape[0] // channels, rows.shape[1]).permute(2, 0, 1)[None]


def rope_table(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[S, 3]`` positions -> ``[1, S, 1, R, 2, 2]`` rotation matrices, R = 3 * len(inv_freq) pair angles
    (axis t's frequencies, then h's, then w's)."""
    ang = position_ids.to(torch.float32)[:, :, None] * inv_freq.to(torch.float32)[None, None, :]
    ang = ang.reshape(ang.shape[0], -1)  # [S, 3 * F], axis-major
    c, s = ang.cos(), ang.sin()
    return torch.stack([c, -s, s, c], dim=-1).reshape(1, ang.shape[0], 1, ang.shape[1], 2, 2)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Split-half RoPE on the first ``2 * R`` dims of ``x`` ``[S, heads, D]``: pair k = (x[k], x[k + R])."""
    R = table.shape[-3]
    rot, rest = x[..., :2 * R], x[..., 2 * R:]
    a, b = rot[..., :R], rot[..., R:]
    m = table[0]  # [S, 1, R, 2, 2]
    ra = m[..., 0, 0] * a + m[..., 0, 1] * b
    rb = m[..., 1, 0] * a + m[..., 1, 1] * b
    return torch.cat([ra, rb, rest], dim=-1)


def dense_attention(q, k, v, heads, mask=None, skip_reshape=True, **kwargs):
    """Default attention: ``[1, H, S, D]`` q/k/v -> ``[1, S, H*D]`` (the ``func`` an override receives)."""
    if mask is not None or not skip_reshape:
        raise NotImplementedError("lab reference attention: only unmasked [B, H, S, D] calls")
    out = F.scaled_dot_product_attention(q, k, v)
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


# ================================================================================================ modules

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv_proj = nn.Linear(hidden, 3 * heads * head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim)
        self.k_norm = RMSNorm(head_dim)
        self.out_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, rope_freqs=None, transformer_options={}):
        S = x.shape[0]
        q, k, v = self.qkv_proj(x).view(S, 3, self.heads, self.head_dim).unbind(1)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope_freqs is not None:
            q, k = apply_rope(q, rope_freqs), apply_rope(k, rope_freqs)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, S, D]
        override = (transformer_options or {}).get("optimized_attention_override")
        kw = dict(mask=None, skip_reshape=True, transformer_options=transformer_options)
        out = override(dense_attention, q, k, v, self.heads, **kw) if override is not None else \
            dense_attention(q, k, v, self.heads, **kw)
        return self.out_proj(out[0])


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class RefinerBlock(nn.Module):
    def __init__(self, hidden, heads, head_dim, ffn):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.attn = Attention(hidden, heads, head_dim)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x, transformer_options={}):
        x = x + self.attn(self.norm1(x), transformer_options=transformer_options)
        return x + self.mlp(self.norm2(x))


class TokenRefiner(nn.Module):
    def __init__(self, n, hidden, heads, head_dim, ffn):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(hidden, heads, head_dim, ffn) for _ in range(n))
        self.final_norm = RMSNorm(hidden)

    def forward(self, x, transformer_options={}):
        for blk in self.blocks:
            x = blk(x, transformer_options=transformer_options)
        return self.final_norm(x)


class TimeEmbedder(nn.Module):
    def __init__(self, freq_dim, hidden, out):
        super().__init__()
        self.freq_dim = freq_dim
        self.proj_in = nn.Linear(freq_dim, hidden)
        self.proj_out = nn.Linear(hidden, out)

    def forward(self, t):
        n = self.freq_dim // 2
        freqs = torch.exp(torch.arange(n, dtype=torch.float32) * (-math.log(10000.0) / n))
        args = t.float()[:, None] * freqs[None]
        return self.proj_out(F.silu(self.proj_in(torch.cat([args.cos(), args.sin()], dim=-1))))


class AdalnProj(nn.Module):
    """``silu(t_emb)`` ``[M, t_dim]`` -> ``expand`` tensors ``[M * modalities, hidden]`` (row = t * modalities + m)."""

    def __init__(self, t_dim, hidden, expand, modalities):
        super().__init__()
        self.expand, self.modalities, self.hidden = expand, modalities, hidden
        self.linear = nn.Linear(t_dim, expand * hidden * modalities)

    def forward(self, t_emb):
        y = self.linear(F.silu(t_emb)).reshape(t_emb.shape[0] * self.modalities, self.expand * self.hidden)
        return y.chunk(self.expand, dim=-1)


def modulate(h, shift, scale, segments):
    return torch.cat([h[a:b] * (1.0 + scale[row]) + shift[row] for a, b, row in segments])


def gated(x, gate, y, segments):
    return x + torch.cat([y[a:b] * gate[row] for a, b, row in segments])


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, head_dim, ffn, t_dim):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.attn = Attention(hidden, heads, head_dim)
        self.mlp = MLP(hidden, ffn)
        self.adaln_proj = AdalnProj(t_dim, hidden, 6, 3)

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}):
        sh1, sc1, g1, sh2, sc2, g2 = self.adaln_proj(t_emb)
        x = gated(x, g1, self.attn(modulate(self.norm1(x), sh1, sc1, mod_segments), rope_freqs=rope_freqs,
                                   transformer_options=transformer_options), mod_segments)
        return gated(x, g2, self.mlp(modulate(self.norm2(x), sh2, sc2, mod_segments)), mod_segments)


class FinalLayer(nn.Module):
    def __init__(self, hidden, t_dim, video_dim, audio_dim):
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.adaln_proj = AdalnProj(t_dim, hidden, 2, 1)
        self.video_out = nn.Linear(hidden, video_dim)
        self.audio_out = nn.Linear(hidden, audio_dim)

    def forward(self, x, t_emb, video_seg, audio_seg):
        shift, scale = self.adaln_proj(t_emb)

        def head(seg, lin):
            a, b, row = seg
            return lin(self.norm(x[a:b]) * (1.0 + scale[row]) + shift[row])

        return head(video_seg, self.video_out), head(audio_seg, self.audio_out)


class _Executor:
    """Calls wrapper ``i`` with an executor for the rest of the chain (ComfyUI's wrapper calling convention)."""

    def __init__(self, fn, class_obj, wrappers, i=0):
        self.fn, self.class_obj, self.wrappers, self.i = fn, class_obj, wrappers, i

    def __call__(self, *args, **kwargs):
        if self.i >= len(self.wrappers):
            return self.fn(*args, **kwargs)
        return self.wrappers[self.i](_Executor(self.fn, self.class_obj, self.wrappers, self.i + 1), *args, **kwargs)

    execute = __call__


def diffusion_model_wrappers(transformer_options: dict) -> list:
    """Wrappers registered under ``transformer_options["wrappers"]["diffusion_model"]`` (``{key: [fn, ...]}``)."""
    by_key = ((transformer_options or {}).get("wrappers") or {}).get("diffusion_model") or {}
    return [fn for fns in by_key.values() for fn in fns]


class LabH3DiT(nn.Module):
    """MiniMax H3 DiT (t2va) in plain torch, ComfyUI ``MiniMaxH3Model`` parameter names and call protocol."""

    def __init__(self, hidden_size, num_layers, token_refiner_num_layers, num_attention_heads, attention_head_dim,
                 ffn_hidden_size, latents_dim, audio_latents_dim, patch_size, text_dim, timestep_input_dim,
                 time_embed_hidden_size, time_embed_dim, rope_inv_freq_len,
                 sigma_shift_video=SHIFT_VIDEO, sigma_shift_audio=SHIFT_AUDIO):
        super().__init__()
        self.hidden_size = hidden_size
        self.patch_size = tuple(patch_size)
        self.latents_dim = latents_dim
        self.audio_latents_dim = audio_latents_dim
        self.sigma_shift_video, self.sigma_shift_audio = float(sigma_shift_video), float(sigma_shift_audio)
        self.dtype = torch.float32
        patch_dim = latents_dim * math.prod(self.patch_size)
        self.video_patch_proj = nn.Linear(patch_dim, hidden_size)
        self.audio_patch_proj = nn.Linear(audio_latents_dim, hidden_size)
        self.condition_proj = nn.Linear(text_dim, hidden_size)
        self.time_embedder = TimeEmbedder(timestep_input_dim, time_embed_hidden_size, time_embed_dim)
        self.rope = nn.Module()
        self.rope.register_buffer("inv_freq", torch.zeros(rope_inv_freq_len))
        self.token_refiner = TokenRefiner(token_refiner_num_layers, hidden_size, num_attention_heads,
                                          attention_head_dim, ffn_hidden_size)
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_attention_heads, attention_head_dim, ffn_hidden_size,
                                             time_embed_dim) for _ in range(num_layers))
        self.final_layer = FinalLayer(hidden_size, time_embed_dim, patch_dim, audio_latents_dim)

    # ---------------------------------------------------------------------------------------------- text
    def preprocess_text_embeds(self, text_states: torch.Tensor) -> torch.Tensor:
        """``[1, L, text_dim]`` prompt states -> ``[1, L, hidden]`` refined states (once per sampling)."""
        if text_states.shape[-1] == self.hidden_size:
            return text_states
        return self.token_refiner(self.condition_proj(text_states[0]))[None]

    # ---------------------------------------------------------------------------------------------- forward
    def shifts(self, transformer_options: dict) -> tuple[float, float]:
        to = transformer_options or {}
        return (float(to.get("minimax_h3_sigma_shift_video", self.sigma_shift_video)),
                float(to.get("minimax_h3_sigma_shift_audio", self.sigma_shift_audio)))

    def forward(self, x, timestep, context, transformer_options={}, minimax_payload=None, **kwargs):
        """``x`` = ``[video [1,24,T,H,W], audio [1,32,2,Ta]]`` as the sampler carries them, ``timestep`` = video
        sigma * 1000, ``context`` ``[1, L, text_dim or hidden]``. Returns ``[video, audio]`` flow outputs."""
        scale = float((minimax_payload or {}).get("audio_scale", 1.0))
        carried = x[1]
        if scale != 1.0:
            sv, sa = self.shifts(transformer_options)
            sigma_v = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
            sigma_a = shift_sigma(sigma_v, sv, sa)
            ratio = (sigma_a / sigma_v).to(carried.dtype)
            x = [x[0], carried * ratio]
        wrappers = diffusion_model_wrappers(transformer_options)
        out = _Executor(self._forward, self, wrappers)(x, timestep, context, transformer_options,
                                                       minimax_payload=minimax_payload, **kwargs)
        if scale != 1.0:
            # the carried variable y = x_a * sigma_v / sigma_a: its velocity in sigma_v from the stream's own
            out = [out[0], (1.0 - scale) * x[1] + (1.0 + (scale - 1.0) * sigma_a).to(out[1].dtype) * out[1]]
        return out

    def _forward(self, x, timestep, context, transformer_options={}, minimax_payload=None, denoise_mask=None,
                 audio_denoise_mask=None, **kwargs):
        payload = minimax_payload or {}
        for key in ("keyframes", "refs", "text_token_tags", "cond_video_latents", "cond_audio_latents"):
            if payload.get(key):
                raise NotImplementedError(f"lab reference H3 DiT: {key} (only text-to-audio-video is implemented)")
        if denoise_mask is not None or audio_denoise_mask is not None:
            raise NotImplementedError("lab reference H3 DiT: denoise masks are not implemented")
        video, audio = x[0], x[1]
        if video.shape[0] != 1:
            raise ValueError("MiniMax H3 supports batch size 1")
        T0, H0, W0 = video.shape[2:]
        pt, ph, pw = self.patch_size
        video = F.pad(video, (0, -W0 % pw, 0, -H0 % ph, 0, -T0 % pt), mode="circular") \
            if (-W0 % pw or -H0 % ph or -T0 % pt) else video
        T, H, W = video.shape[2:]
        text = context[0]
        if text.shape[-1] != self.hidden_size:
            text = self.token_refiner(self.condition_proj(text), transformer_options=transformer_options)
        layout = Layout(text.shape[0], T, H, W, audio.shape[-1])

        sv, sa = self.shifts(transformer_options)
        sigma_v = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
        t_video = float(1.0 - sigma_v)
        t_audio = float(1.0 - shift_sigma(sigma_v, sv, sa))
        levels = sorted({t_video, t_audio})
        index = {t: i for i, t in enumerate(levels)}
        seg_t = {"text": t_video, "audio": t_audio, "video": t_video}
        mod_segments = [(a, b, index[seg_t[kind]] * 3 + MODALITY[kind]) for a, b, kind in layout.segments]
        t_emb = self.time_embedder(torch.tensor(levels, dtype=torch.float32))

        h = torch.cat([text.float(), self.audio_patch_proj(audio_rows(audio.float())),
                       self.video_patch_proj(patchify(video.float(), self.patch_size))])
        rope_freqs = rope_table(layout.position_ids, self.rope.inv_freq)

        replace = ((transformer_options or {}).get("patches_replace") or {}).get("dit") or {}
        for i, block in enumerate(self.blocks):
            fn = replace.get(("double_block", i))
            if fn is None:
                h = block(h, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options)
                continue

            def original(args, block=block):
                return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                     transformer_options=args["transformer_options"])}

            h = fn({"img": h, "t_emb": t_emb, "mod_segments": mod_segments, "rope_freqs": rope_freqs,
                    "transformer_options": transformer_options}, {"original_block": original})["img"]

        (ta, tb, _), (aa, ab, _), (va, vb, _) = layout.segments
        v, a = self.final_layer(h, t_emb, (va, vb, index[t_video]), (aa, ab, index[t_audio]))
        v = unpatchify(v, T // pt, H // ph, W // pw, self.latents_dim, self.patch_size)[:, :, :T0, :H0, :W0]
        return [-v.to(x[0].dtype), -audio_from_rows(a).to(x[1].dtype)]


# ================================================================================================ loading

def load_lab_dit(path=None, config: dict | None = None) -> LabH3DiT:
    """Build the lab DiT and load ``path`` (default: the committed lab weights) strictly: every key of the file
    must be a parameter/buffer of the model with the same shape, and every parameter/buffer must be in the file."""
    path = Path(path or DIT_FILE)
    if not path.is_file():
        raise CheckpointError(f"lab DiT weights {path} do not exist (train them with benchmarks/lab/train_dit.py)")
    sd = load_file(str(path))
    cfg = dict(LAB_DIT_CONFIG, **(config or {}))
    model = LabH3DiT(**cfg)
    own = model.state_dict()
    unexpected = sorted(set(sd) - set(own))
    missing = sorted(set(own) - set(sd))
    if unexpected or missing:
        raise CheckpointError(f"{path}: not the lab H3 DiT layout: unexpected keys {unexpected[:5]}"
                              f"{' ...' if len(unexpected) > 5 else ''}, missing keys {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    for k, t in own.items():
        if tuple(sd[k].shape) != tuple(t.shape):
            raise CheckpointError(f"{path}: key {k!r} has shape {tuple(sd[k].shape)}, the lab H3 DiT config "
                                  f"{cfg} expects {tuple(t.shape)}")
        if not sd[k].is_floating_point():
            raise CheckpointError(f"{path}: key {k!r} has dtype {sd[k].dtype}, expected a floating tensor")
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return model.eval().requires_grad_(False)


def load_text_embed(path=None) -> torch.Tensor:
    """The lab's word-embedding table ``[vocab, text_dim]`` (prompt states = rows of the prompt's token ids)."""
    path = Path(path or TEXT_FILE)
    sd = load_file(str(path))
    if set(sd) != {"embed.weight"}:
        raise CheckpointError(f"{path}: expected exactly one key 'embed.weight', got {sorted(sd)[:5]}")
    return sd["embed.weight"].float()
