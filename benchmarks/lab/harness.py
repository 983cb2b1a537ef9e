"""Quality lab harness: speed and quality of ditkit / native features on the TRAINED tiny H3 lab models.

    COMFYUI_PATH=/path/to/ComfyUI nice -n 10 python benchmarks/lab/harness.py [--smoke] [--features a,b] [--cfg 3]
        [--engine comfy|ref] [--adherence-only --adherence-cfgs 1,2,3,4 --strip /tmp/strip.png]

Two engines (``--engine``; default ``comfy`` when ``COMFYUI_PATH`` is set, else ``ref``; the header names it):

* ``comfy``: everything runs in-process on ComfyUI (CPU): the lab DiT is loaded by the stock diffusion-model loader
  (``comfy.sd.load_diffusion_model_state_dict``, detected from shapes), sampled with ComfyUI's own KSampler
  (``euler`` / ``simple``, H3's video/audio shifts 12/3), and each feature NODE is applied to a clone of the model
  exactly as a workflow would (inputs = the node's schema defaults plus the overrides listed below). ComfyUI-side
  code lives in ``lab_comfy.py`` and the ``ComfyLab`` class here.
* ``ref``: no ComfyUI (CI): the pure-torch lab references ``benchmarks.lab.lab_ref_dit`` / ``lab_ref_sample`` /
  ``lab_ref_vae`` (proven equal to ComfyUI's DiT, KSampler and VAE by ``tests/integration/
  test_lab_ref_equivalence_*.py``) and ditkit's feature CORES (TeaCache calibration + runtime, VSA-H3 runtime, T=1
  repeat-decode) installed as the nodes install them (``lab_ref.py``). Native ComfyUI nodes (EasyCache) print
  ``not available``. ``--smoke`` is the CI smoke (``tests/unit/test_lab_harness_ref.py``).

Sampling is on a fixed prompt set, with classifier-free guidance (``--cfg``, negative = the null prompt: an all-zero
text context, which the DiT saw in training through conditioning dropout; cfg 1 = conditional only). Each feature
is compared with the exact path on the same seeds:

* speed ratio = exact wall time / feature wall time (sampling only, same process, same run);
* skip ratio = 1 - (transformer passes with the feature / passes on the exact path), counted by a forward
  hook on ``blocks[0]`` (measurement only);
* video: PSNR and SSIM of the decoded frames vs the exact path's decoded frames;
* audio: log-spectral distance (dB) and SNR (dB) of the decoded waveform vs the exact path's.

The T=1 rows encode single held-out frames (H3's T=1 encode) and compare decodes with the original frame:
native single-token decode, repeat-decode (duplicate to T=2, decode, keep frame 0; lab reference code), and
ditkit's path: ``DitKitH3VAEDecode`` through ``DitKitH3VAELoader`` (comfy engine, when that code exists) or
ditkit's core ``vae.t1_decode.repeat_decode_t1`` called on the reference VAE (through ``bridge/vae.py``) (ref engine).

Prompt adherence: colour and direction read back from the decoded pixels of the exact-path samples
(``lab_data.describe_video``), on ``ADHERENCE_PROMPTS`` (12 prompts: every colour and every direction 3 times,
every shape 4 times) x ``--adherence-seeds`` seeds, for each guidance scale in ``--adherence-cfgs``.

A feature whose code is missing prints a ``not available`` row; one that raises prints ``error: ...``.

Rows (``--rows FILE``, ``benchmarks/_harness.py``): every figure of the printed tables is also a data row. Case =
the table row's label, metrics ``status`` (``measured`` / ``not available`` / ``error``, the reason in ``note``),
``speed`` (x), ``skip`` (fraction of passes), ``video_psnr`` / ``audio_lsd`` / ``audio_snr`` (dB; ``inf`` when
identical), ``ssim``, ``passes``, ``samples``, ``steps``, ``seconds``, ``frames``, ``gain_db`` (T=1 rows vs native),
``offset_free_psnr``; case ``run``: ``engine``, ``prompts``, ``seeds``, ``samples``, ``steps``, ``cfg``; case
``TeaCache calibration``: ``outcome`` (``calibrated`` / ``failed``, spec or error in ``note``); case ``adherence``
(exact samples): ``colour``, ``direction``, ``n``; cases ``adherence <label>``: ``colour``, ``direction``,
``both``, ``n``. The smoke tests read these rows, not the printed text.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
import lab_comfy as L  # noqa: E402

from benchmarks._harness import Rows, add_rows_argument  # noqa: E402
from benchmarks.lab import lab_data as D  # noqa: E402
from benchmarks.lab.lab_metrics import (  # noqa: E402
    log_spectral_distance, paired_gain_ci, psnr, psnr_offset_free, snr, ssim)

PROMPTS = ("red circle right", "blue square left", "green triangle up", "yellow circle down",
           "blue triangle right", "red square up")
CALIB_PROMPTS = ("green circle left", "yellow square right", "red triangle down", "blue circle up",
                 "green square down", "yellow triangle left")
# 12 prompts: colour i % 4, shape i % 3, direction (i + i // 4) % 4 -> each colour meets 3 directions
ADHERENCE_PROMPTS = tuple(f"{tuple(D.COLOURS)[i % 4]} {D.SHAPES[i % 3]} {D.DIRECTIONS[(i + i // 4) % 4]}"
                          for i in range(12))
# Guidance of the shipped lab DiT (run 3, conditioning dropout 0.15), 12 prompts x 4 seeds, colour / direction read
# back through the phase D decoder: cfg 1 30/48 34/48, cfg 3 41/48 46/48, cfg 4 36/48 46/48, cfg 5 35/48 44/48
# (real clips through the VAE: 42/48 47/48). 3 reads back best on colour, with the fewest over-saturation artifacts
# (the phase C decoder gave the same order).
DEFAULT_CFG = 3.0
HELDOUT_SEED = 7_000_000  # never used by the training scripts (VAE: 10k.., 500k..; DiT: 900k..)
FRAMES, H, W = 22, 64, 96


@dataclasses.dataclass
class Feature:
    name: str  # row label
    module: str  # python module holding the node
    node_id: str
    overrides: dict = dataclasses.field(default_factory=dict)
    group: str = "cache"  # cache | sparse


FEATURES = [
    Feature("TeaCache (ditkit, defaults)", "ditkit.nodes.teacache", "DitKitTeaCache"),
    Feature("TeaCache (ditkit, threshold 0.4)", "ditkit.nodes.teacache", "DitKitTeaCache",
            {"threshold": 0.4, "audio_threshold": 0.4}),
    Feature("EasyCache (native, defaults)", "comfy_extras.nodes_easycache", "EasyCache"),
    Feature("EasyCache (native, reuse 0.4)", "comfy_extras.nodes_easycache", "EasyCache", {"reuse_threshold": 0.4}),
    Feature("Sparse attention (ditkit, defaults)", "ditkit.nodes.sparse_attention", "DitKitSparseAttention",
            group="sparse"),
    # keep_percent is read only with recipe "custom" (the default recipe pins keep 10%)
    Feature("Sparse attention (ditkit, keep 50%)", "ditkit.nodes.sparse_attention", "DitKitSparseAttention",
            {"recipe": "custom", "keep_percent": 50.0}, group="sparse"),
]


# ------------------------------------------------------------------------------------------------ node plumbing

def find_node(module: str, node_id: str):
    """The V3 node class ``node_id`` in ``module`` or ``(None, why)``."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        return None, f"not available ({module} missing: {e.name})"
    candidates = list(getattr(mod, "NODES", [])) or [getattr(mod, n) for n in dir(mod)]
    for cls in candidates:
        try:
            if isinstance(cls, type) and hasattr(cls, "define_schema") and cls.define_schema().node_id == node_id:
                return cls, ""
        except Exception:  # noqa: BLE001 - a schema that fails to build just is not our node
            continue
    return None, f"not available (no node {node_id} in {module})"


def node_defaults(cls) -> dict:
    out = {}
    for inp in cls.define_schema().inputs:
        d = getattr(inp, "default", None)
        if d is not None:
            out[inp.id] = d
    return out


def apply_node(cls, model, overrides: dict):
    kwargs = node_defaults(cls)
    kwargs.update(overrides)
    kwargs["model"] = model
    res = cls.execute(**kwargs)
    out = res.args[0] if hasattr(res, "args") else res[0]
    return out


# ------------------------------------------------------------------------------------------------ the lab

class ComfyLab:
    """The comfy engine: ComfyUI's DiT loader, KSampler and VAE; features through their nodes."""

    engine = "comfy"
    engine_desc = "comfy (ComfyUI in-process: KSampler, feature nodes)"

    def __init__(self, steps: int, dit=L.DIT_FILE, vae=L.VAE_FILE, text=L.TEXT_FILE, cfg: float = DEFAULT_CFG):
        self.comfy = L.import_comfy()
        import comfy.sd
        import nodes as comfy_nodes  # ComfyUI's nodes.py (KSampler)
        from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

        from ditkit.loaders.safetensors_io import load_file

        self.nodes = comfy_nodes
        self.empty_latent = EmptyMiniMaxH3LatentAV
        self.steps = steps
        self.cfg = float(cfg)
        self.vae_path = str(vae)
        self.dit = comfy.sd.load_diffusion_model_state_dict(load_file(str(dit)))
        self.embed = load_file(str(text))["embed.weight"]
        self.vae = L.load_vae(vae)
        self.scratch = None

    def conditioning(self, prompt: str):
        ctx = self.embed[D.tokenize(prompt)][None].clone()
        return [[ctx, {}]]

    def null_conditioning(self):
        """The null prompt (all-zero text context): the unconditional branch the DiT learned by dropout."""
        return [[torch.zeros(1, D.PROMPT_LEN, self.embed.shape[1]), {}]]

    def sample(self, model, prompt: str, seed: int, cfg: float | None = None):
        """(video latent, audio latent, seconds, transformer passes); ``cfg`` defaults to the lab's."""
        latent = self.empty_latent.execute(W, H, FRAMES).args[0]
        dm = model.model.diffusion_model
        count = [0]
        hook = dm.blocks[0].register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        pos = self.conditioning(prompt)
        neg = self.null_conditioning()
        cfg = self.cfg if cfg is None else float(cfg)
        try:
            t0 = time.perf_counter()
            out = self.nodes.common_ksampler(model, seed, self.steps, cfg, "euler", "simple", pos, neg, latent,
                                             denoise=1.0)[0]
            dt = time.perf_counter() - t0
        finally:
            hook.remove()
        video, audio = out["samples"].unbind()
        return video, audio, dt, count[0]

    def decode(self, video, audio):
        with torch.inference_mode():
            frames = self.vae.decode(video.float())[0]  # [3, F, H, W] in [0, 1]
        return frames, D.audio_decode(audio.float())

    def t1_ditkit(self):
        """(row label, decode(z) -> [3, H, W] in [0, 1] or None, why not): DitKitH3VAEDecode's path."""
        label = "T=1 decode: DitKitH3VAEDecode"
        try:
            from ditkit.nodes.h3_vae import h3_decode, load_h3_vae

            ditkit_vae, _ = load_h3_vae(self.vae_path)
        except ModuleNotFoundError as e:
            return label, None, f"not available ({e.name} missing)"
        except Exception as e:  # noqa: BLE001
            return label, None, f"error: {type(e).__name__}: {e}"

        def decode(z):
            img, _ = h3_decode(ditkit_vae, z)
            return img[0].movedim(-1, 0).float()

        return label, decode, ""

    def calibrate_teacache(self, calib_prompts) -> tuple[str, str]:
        """DitKitTeaCacheCalibrate (the node) into a scratch output directory: (coefficients spec, where)."""
        import tempfile

        import folder_paths

        # calibration/coefficient files go to a scratch output directory, not the host's
        self.scratch = tempfile.mkdtemp(prefix="h3lab_out_")
        folder_paths.set_output_directory(self.scratch)
        return calibrate_teacache(self, calib_prompts), f"(in {self.scratch})"

    def feature_unavailable(self, feat) -> str:
        """Why ``feat`` cannot run here ('' when it can)."""
        return find_node(feat.module, feat.node_id)[1]

    def feature_model(self, feat, base):
        """A clone of ``base`` with the feature node applied (schema defaults + the row's overrides)."""
        cls, why = find_node(feat.module, feat.node_id)
        if cls is None:
            raise RuntimeError(why)
        return apply_node(cls, base.clone(), feat.overrides)

    def close(self) -> None:
        import shutil

        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


def make_lab(engine: str, steps: int, dit, vae, text, cfg: float):
    if engine == "comfy":
        return ComfyLab(steps, dit, vae, text, cfg=cfg)
    import lab_ref

    return lab_ref.RefLab(steps, dit, vae, text, cfg=cfg, frames=FRAMES, height=H, width=W)


def fmt(x, unit="", nd=2):
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{nd}f}{unit}"


METRICS = ("speed", "skip", "video_psnr", "ssim", "audio_lsd", "audio_snr")
UNITS = {"speed": "x", "skip": "fraction", "video_psnr": "dB", "audio_lsd": "dB", "audio_snr": "dB", "gain_db": "dB",
         "offset_free_psnr": "dB", "seconds": "s"}


def record(out: Rows, label: str, status: str = "measured", note: str = "", **values) -> None:
    """The data rows of one table row: its ``status`` (the reason in ``note``) and each measured value."""
    out.add(label, "status", status, note=note)
    for k, v in values.items():
        if v is not None:
            out.add(label, k, v, UNITS.get(k, ""))


def run_t1(lab, n_clips: int, rows: list, out: Rows | None = None):
    """Native single-token decode vs repeat-decode on held-out frames."""
    out = out if out is not None else Rows(None, "lab_harness")
    V = lab.vae
    frame_ids = (0, 8, 16)
    res = {k: [] for k in ("native", "repeat", "clip", "ditkit", "native_ssim", "repeat_ssim", "ditkit_ssim",
                           "clip_ssim", "native_of", "repeat_of", "clip_of", "clip_index")}
    dk_label, dk_decode, why = lab.t1_ditkit()
    with torch.inference_mode():
        for i in range(n_clips):
            clip = D.make_clip(HELDOUT_SEED + i, FRAMES, H, W)
            full = V.decode(V.encode(clip.video[None]))[0]  # in-context reconstruction (7-token window)
            for f in frame_ids:
                ref = (clip.video[:, f] + 1) / 2  # [3, H, W]
                z = V.encode(clip.video[None, :, f:f + 1])  # H3's T=1 encode -> [1, 24, 1, h, w]
                native = V.decode(z)[0, :, 0]
                rep = V.decode(torch.cat([z, z], dim=2))[0, :, 0]
                res["clip_index"].append(i)
                for k, img in (("native", native), ("repeat", rep), ("clip", full[:, f])):
                    res[k].append(psnr(ref, img))
                    res[k + "_ssim"].append(ssim(ref, img))
                    res[k + "_of"].append(psnr_offset_free(ref, img))
                if dk_decode is not None:
                    try:
                        dk = dk_decode(z)
                        res["ditkit"].append(psnr(ref, dk))
                        res["ditkit_ssim"].append(ssim(ref, dk))
                    except Exception as e:  # noqa: BLE001
                        why = f"error: {type(e).__name__}: {e}"
                        dk_decode = None
    n = len(res["native"])

    def mean(k):
        return sum(res[k]) / len(res[k]) if res[k] else None

    better = sum(r > nv for r, nv in zip(res["repeat"], res["native"]))
    gain, lo, hi = paired_gain_ci(res["repeat"], res["native"], res["clip_index"])
    note = f"{n} held-out frames; offset-free PSNR {fmt(mean('native_of'), ' dB')}"
    record(out, "T=1 decode: native single token", video_psnr=mean("native"), ssim=mean("native_ssim"), frames=n,
           offset_free_psnr=mean("native_of"))
    record(out, "T=1 decode: repeat-decode (lab ref)", video_psnr=mean("repeat"), ssim=mean("repeat_ssim"), frames=n,
           gain_db=gain, offset_free_psnr=mean("repeat_of"))
    if res["ditkit"]:
        record(out, dk_label, video_psnr=mean("ditkit"), ssim=mean("ditkit_ssim"), frames=len(res["ditkit"]),
               gain_db=mean("ditkit") - mean("native"))
    else:
        why_dk = why or "not available"
        record(out, dk_label, "error" if why_dk.startswith("error") else "not available", why_dk)
    record(out, "(same frames decoded inside their clip)", video_psnr=mean("clip"), ssim=mean("clip_ssim"), frames=n,
           offset_free_psnr=mean("clip_of"))
    rows.append(("T=1 decode: native single token", "-", "-", fmt(mean("native"), " dB"), fmt(mean("native_ssim"),
                 nd=3), "-", "-", note))
    rows.append(("T=1 decode: repeat-decode (lab ref)", "-", "-", fmt(mean("repeat"), " dB"),
                 fmt(mean("repeat_ssim"), nd=3), "-", "-",
                 f"gain {gain:+.2f} dB vs native (95 % CI {lo:+.2f}..{hi:+.2f} dB, clip bootstrap; better on "
                 f"{better}/{n} frames); "
                 f"offset-free PSNR {fmt(mean('repeat_of'), ' dB')}"))
    if res["ditkit"]:
        rows.append((dk_label, "-", "-", fmt(mean("ditkit"), " dB"),
                     fmt(mean("ditkit_ssim"), nd=3), "-", "-",
                     f"gain {mean('ditkit') - mean('native'):+.2f} dB vs native"))
    else:
        rows.append((dk_label, "-", "-", "-", "-", "-", "-", why or "not available"))
    rows.append(("(same frames decoded inside their clip)", "-", "-", fmt(mean("clip"), " dB"),
                 fmt(mean("clip_ssim"), nd=3), "-", "-",
                 f"7-token window upper bound; offset-free PSNR {fmt(mean('clip_of'), ' dB')}"))
    return res


def attach_teacache_coefficients(lab, feats, calib_prompts, out: Rows | None = None) -> None:
    """Calibrate TeaCache on the lab model (the engine's ``calibrate_teacache``) and give every TeaCache row the
    coefficients; a failed calibration is printed and those rows then report their own error."""
    out = out if out is not None else Rows(None, "lab_harness")
    if not any(f.module == "ditkit.nodes.teacache" for f in feats):
        return
    try:
        spec, where = lab.calibrate_teacache(calib_prompts)
    except Exception as e:  # noqa: BLE001
        print(f"TeaCache calibration failed: {type(e).__name__}: {e}")
        out.add("TeaCache calibration", "outcome", "failed", note=f"{type(e).__name__}: {e}")
        return
    for f in feats:
        if f.module == "ditkit.nodes.teacache":
            f.overrides.setdefault("coefficients", spec)
    print(f"TeaCache calibrated on the lab model -> {spec} {where}")
    out.add("TeaCache calibration", "outcome", "calibrated", note=f"{spec} {where}")


def calibrate_teacache(lab: ComfyLab, prompts, name: str = "h3lab") -> str:
    """Run ditkit's TeaCache calibration on the lab model (full-compute sampling of ``prompts``); returns the
    coefficient spec for DitKitTeaCache, or raises when the calibration node is missing."""
    cls, why = find_node("ditkit.nodes.teacache", "DitKitTeaCacheCalibrate")
    if cls is None:
        raise RuntimeError(why)
    for i, p in enumerate(prompts):
        model = cls.execute(model=lab.dit.clone(), name=name, degree=4, min_prompts=len(prompts)).args[0]
        lab.sample(model, p, 100 + i)
    return f"{name}.json"


def run_sampling(lab, prompts, seeds, features, rows: list, adherence: dict, out: Rows | None = None):
    out = out if out is not None else Rows(None, "lab_harness")
    base = lab.dit
    exact = {}
    t_exact = 0.0
    n_exact = 0
    hits = {"colour": 0, "direction": 0, "n": 0}
    for p in prompts:
        for s in seeds:
            v, a, dt, n = lab.sample(base, p, s)
            frames, wave = lab.decode(v, a)
            exact[(p, s)] = (frames, wave)
            t_exact += dt
            n_exact += n
            colour, direction = D.describe_video(frames)
            words = p.split()
            hits["colour"] += colour == words[0]
            hits["direction"] += direction == words[2]
            hits["n"] += 1
    adherence.update(hits)
    record(out, "exact path (reference)", speed=1.0, skip=0.0, video_psnr=math.inf, ssim=1.0, audio_lsd=0.0,
           audio_snr=math.inf, samples=len(exact), steps=lab.steps, passes=n_exact, seconds=t_exact)
    rows.append(("exact path (reference)", "1.00x", "0.00", "inf", "1.000", "0.00 dB", "inf",
                 f"{len(exact)} samples, {lab.steps} steps, {n_exact} passes, {t_exact:.2f}s"))
    for feat in features:
        why = lab.feature_unavailable(feat)
        if why:
            rows.append((feat.name, "-", "-", "-", "-", "-", "-", why))
            record(out, feat.name, "not available", why)
            continue
        try:
            t_feat = 0.0
            n_feat = 0
            ps, ss, ls, sn = [], [], [], []
            for p in prompts:
                for s in seeds:
                    model = lab.feature_model(feat, base)
                    v, a, dt, n = lab.sample(model, p, s)
                    frames, wave = lab.decode(v, a)
                    rf, rw = exact[(p, s)]
                    t_feat += dt
                    n_feat += n
                    ps.append(psnr(rf, frames))
                    ss.append(ssim(rf.movedim(1, 0), frames.movedim(1, 0)))
                    ls.append(log_spectral_distance(rw, wave))
                    sn.append(snr(rw, wave))
            k = len(ps)
            rows.append((feat.name, f"{t_exact / t_feat:.2f}x", f"{1 - n_feat / n_exact:.2f}",
                         fmt(sum(ps) / k, " dB"), fmt(sum(ss) / k, nd=3), fmt(sum(ls) / k, " dB"),
                         fmt(sum(sn) / k, " dB"), f"{n_feat} passes"))
            record(out, feat.name, speed=t_exact / t_feat, skip=1 - n_feat / n_exact, video_psnr=sum(ps) / k,
                   ssim=sum(ss) / k, audio_lsd=sum(ls) / k, audio_snr=sum(sn) / k, samples=k, passes=n_feat,
                   seconds=t_feat)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append((feat.name, "-", "-", "-", "-", "-", "-", f"error: {type(e).__name__}: {e}"[:160]))
            record(out, feat.name, "error", f"error: {type(e).__name__}: {e}"[:160])


def run_adherence(lab, prompts, seeds, cfgs, strip: str | None = None) -> list:
    """Colour / direction read back from the exact-path samples of ``prompts`` x ``seeds`` at each guidance scale.
    The first row is the ceiling the VAE allows: the same read-back on real clips of the same prompts, encoded
    and decoded by the lab VAE. Returns rows ``(cfg, colour hits, direction hits, both, n, seconds)``; ``strip``
    writes a PNG of every 3rd frame of the first 4 real clips and of the first 4 samples per cfg (one row
    each), to look at the samples."""
    out, strips = [], []
    # ceiling: the same read-back on real clips of the same prompts passed through the lab VAE (encode + decode)
    hits = {"colour": 0, "direction": 0, "both": 0}
    n = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            words = p.split()
            for s in seeds:
                clip = D.make_clip(HELDOUT_SEED + 500 + 31 * i + s, FRAMES, H, W, prompt=p)
                rec = lab.vae.decode(lab.vae.encode(clip.video[None]))[0]
                colour, direction = D.describe_video(rec)
                if strip and n < 4:
                    strips.append(torch.cat(list(rec[:, ::3].unbind(1)), dim=2))
                hits["colour"] += colour == words[0]
                hits["direction"] += direction == words[2]
                hits["both"] += colour == words[0] and direction == words[2]
                n += 1
    out.append(("real clips via VAE", hits["colour"], hits["direction"], hits["both"], n, time.perf_counter() - t0))
    for cfg in cfgs:
        hits = {"colour": 0, "direction": 0, "both": 0}
        n = 0
        t = 0.0
        for p in prompts:
            words = p.split()
            for s in seeds:
                v, a, dt, _ = lab.sample(lab.dit, p, 1000 + s, cfg=cfg)
                frames, _ = lab.decode(v, a)
                t += dt
                colour, direction = D.describe_video(frames)
                hits["colour"] += colour == words[0]
                hits["direction"] += direction == words[2]
                hits["both"] += colour == words[0] and direction == words[2]
                n += 1
                if strip and n <= 4:
                    strips.append(torch.cat(list(frames[:, ::3].unbind(1)), dim=2))  # [3, H, W * k]
        out.append((cfg, hits["colour"], hits["direction"], hits["both"], n, t))
    if strip and strips:
        from PIL import Image

        img = torch.cat(strips, dim=1).clamp(0, 1).mul(255).round().byte().permute(1, 2, 0).numpy()
        Image.fromarray(img).save(strip)
        print(f"frame strip (every 3rd frame; rows: 4 real clips via the VAE, then 4 samples per cfg {cfgs}) "
              f"-> {strip}")
    return out


def record_adherence(out: Rows, rows) -> None:
    for cfg, c, d, b, n, _ in rows:
        label = "adherence " + (cfg if isinstance(cfg, str) else f"DiT, cfg {cfg:g}")
        for k, v in (("colour", c), ("direction", d), ("both", b), ("n", n)):
            out.add(label, k, v)


def print_adherence(rows, prompts, seeds):
    print(f"prompt adherence (read back from pixels, {len(prompts)} prompts x {len(seeds)} seeds, exact path):")
    print("samples            | colour      | direction   | both")
    for cfg, c, d, b, n, _ in rows:
        label = cfg if isinstance(cfg, str) else f"DiT, cfg {cfg:g}"
        print(f"{label:<18} | {c:>2}/{n} {100 * c / n:3.0f}% | {d:>2}/{n} {100 * d / n:3.0f}% | "
              f"{b:>2}/{n} {100 * b / n:3.0f}%")


HEAD = ("row", "speed", "skip", "video PSNR", "SSIM", "audio LSD", "audio SNR", "notes")


def print_table(rows):
    widths = [max(len(str(r[i])) for r in rows + [HEAD]) for i in range(len(HEAD))]
    line = " | ".join(h.ljust(w) for h, w in zip(HEAD, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one prompt, few steps, one held-out clip (CI)")
    ap.add_argument("--steps", type=int, default=None, help="sampling steps (default 20, smoke 6)")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per prompt")
    ap.add_argument("--t1-clips", type=int, default=None, help="held-out clips for the T=1 rows (default 24)")
    ap.add_argument("--dit", default=str(L.DIT_FILE))
    ap.add_argument("--vae", default=str(L.VAE_FILE))
    ap.add_argument("--text", default=str(L.TEXT_FILE))
    ap.add_argument("--features", default="", help="comma-separated substrings selecting feature rows")
    ap.add_argument("--cfg", type=float, default=DEFAULT_CFG,
                    help=f"guidance scale of every sampled row (negative = null prompt; 1 = conditional only; "
                         f"default {DEFAULT_CFG:g})")
    ap.add_argument("--adherence-cfgs", default=None,
                    help="comma-separated guidance scales for the adherence table (default '1,<cfg>'; smoke: none)")
    ap.add_argument("--adherence-seeds", type=int, default=2, help="seeds per adherence prompt")
    ap.add_argument("--adherence-only", action="store_true", help="only the adherence table (no T=1 / feature rows)")
    ap.add_argument("--strip", default=None, help="write a PNG frame strip of adherence samples here")
    ap.add_argument("--engine", choices=("comfy", "ref"), default=None,
                    help="comfy: ComfyUI in-process (needs COMFYUI_PATH); ref: pure-torch lab references + ditkit "
                         "cores, no ComfyUI (default: comfy when COMFYUI_PATH is set, else ref)")
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    out = Rows(a.rows, "lab_harness")
    engine = a.engine or ("comfy" if os.environ.get("COMFYUI_PATH") else "ref")
    torch.set_num_threads(1)
    steps = a.steps or (6 if a.smoke else 20)
    prompts = PROMPTS[:1] if a.smoke else PROMPTS
    seeds = list(range(a.seeds))
    feats = FEATURES
    if a.features:
        keys = [k.strip().lower() for k in a.features.split(",") if k.strip()]
        feats = [f for f in FEATURES if any(k in f.name.lower() for k in keys)]
    if a.smoke:
        # one row per feature family keeps CI to minutes
        seen, keep = set(), []
        for f in feats:
            fam = f.name.split("(")[0] + f.module
            if fam not in seen:
                seen.add(fam)
                keep.append(f)
        feats = keep
    if a.adherence_cfgs is None:
        adh_cfgs = [] if a.smoke else sorted({1.0, a.cfg})
    else:
        adh_cfgs = [float(c) for c in a.adherence_cfgs.split(",") if c.strip()]
    adh_seeds = list(range(a.adherence_seeds))
    t0 = time.time()
    lab = make_lab(engine, steps, a.dit, a.vae, a.text, a.cfg)
    print(f"engine: {lab.engine_desc}")
    out.add("run", "engine", lab.engine, note=lab.engine_desc)
    out.add("run", "steps", steps)
    out.add("run", "cfg", a.cfg)
    if a.adherence_only:
        adh = run_adherence(lab, ADHERENCE_PROMPTS, adh_seeds, adh_cfgs, a.strip)
        print(f"H3 quality lab: {steps} euler steps, {FRAMES}x{H}x{W} px, CPU, torch threads 1, engine {lab.engine}")
        print_adherence(adh, ADHERENCE_PROMPTS, adh_seeds)
        record_adherence(out, adh)
        print(f"total {time.time() - t0:.0f}s")
        lab.close()
        return 0
    out.add("run", "prompts", len(prompts))
    out.add("run", "seeds", len(seeds))
    out.add("run", "samples", len(prompts) * len(seeds))
    rows: list = []
    run_t1(lab, a.t1_clips or (1 if a.smoke else 24), rows, out)
    attach_teacache_coefficients(lab, feats, CALIB_PROMPTS[:2] if a.smoke else CALIB_PROMPTS, out)
    adherence: dict = {}
    run_sampling(lab, prompts, seeds, feats, rows, adherence, out)
    for k in ("colour", "direction", "n"):
        out.add("adherence", k, adherence[k])
    adh = run_adherence(lab, ADHERENCE_PROMPTS, adh_seeds, adh_cfgs, a.strip) if adh_cfgs else []
    record_adherence(out, adh)
    print()
    print(f"H3 quality lab: {len(prompts)} prompt(s) x {len(seeds)} seed(s), {steps} euler steps, cfg {a.cfg:g} "
          f"(negative: null prompt), {FRAMES}x{H}x{W} px, CPU, torch threads 1, engine {lab.engine}")
    print_table(rows)
    print(f"prompt adherence of exact samples (read back from pixels): colour {adherence['colour']}/"
          f"{adherence['n']}, direction {adherence['direction']}/{adherence['n']}")
    if adh:
        print_adherence(adh, ADHERENCE_PROMPTS, adh_seeds)
    print(f"total {time.time() - t0:.0f}s")
    lab.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
