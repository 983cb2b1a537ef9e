"""Quality-lab engine without ComfyUI (``harness.py --engine ref``): the pure-torch lab references and ditkit's cores.

* DiT: :mod:`benchmarks.lab.lab_ref_dit` (same parameter names and hook protocol as ComfyUI's ``MiniMaxH3Model``),
  sampled by :mod:`benchmarks.lab.lab_ref_sample` (KSampler ``euler`` / ``simple`` with CFG, same noise per seed);
  both are proven equal to ComfyUI by ``tests/integration/test_lab_ref_equivalence_dit.py``.
* VAE: :mod:`benchmarks.lab.lab_ref_vae` (proven equal by ``tests/integration/test_lab_ref_equivalence_vae.py``).
* Features: the SAME core objects the ditkit nodes build (``bridge.blocks`` / ``cache.teacache`` / ``cache.calibrate``
  / ``cache.coefficients`` for TeaCache, ``kernels.vsa_h3_runtime`` + ``bridge.attention`` for VSA-H3), installed by a thin replica of the
  node's install step into ``transformer_options`` (block replaces, attention override, diffusion-model wrapper)
  plus a per-sampling begin/end around each run (the nodes' ``OUTER_SAMPLE`` wrappers). Node defaults are mirrored
  in ``TEACACHE_DEFAULTS`` / ``SPARSE_DEFAULTS`` (a host test checks them against the node schemas).
* Native ComfyUI nodes (EasyCache) are not available here.

Nothing here imports ComfyUI.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

import torch

from ditkit.cache import coefficients as coef
from ditkit.cache.calibrate import CalibrationRecorder, collect_pair_files, fit_files, write_pair_file
from ditkit.bridge.blocks import HOLDER_KEY, TeaCacheHolder, diffusion_model_wrapper, make_block_replace
from ditkit.cache.teacache import state_from_coefficients
from ditkit.bridge.attention import CTX_KEY as VSA_CTX_KEY
from ditkit.bridge.attention import HOLDER_KEY as VSA_HOLDER_KEY
from ditkit.bridge.attention import VSAAttentionOverride, VSAHolder, prefix_segments_from_spans
from ditkit.kernels.vsa_h3_runtime import VSAH3Config, VSAH3Runtime
from benchmarks.lab import lab_data as D
from benchmarks.lab import lab_ref_dit as R
from benchmarks.lab import lab_ref_sample as S

ENGINE = "ref"
ENGINE_DESC = "ref (pure-torch lab references + ditkit cores, no ComfyUI)"
NATIVE_ONLY = "not available (native ComfyUI node; run with COMFYUI_PATH)"
# node schema defaults (nodes/teacache.py DitKitTeaCache, nodes/sparse_attention.py DitKitSparseAttention)
TEACACHE_DEFAULTS = dict(threshold=0.2, audio_threshold=0.2, start_percent=0.0, end_percent=1.0, cache_device="model",
                         strict=False)
CALIBRATE_DEFAULTS = dict(degree=4)
SPARSE_RECIPES = {"FastH3 Preview v1 (keep 10%)": 10.0, "FastH3 8-step V2 (keep 20%)": 20.0, "custom": None,
                  "auto (from the checkpoint)": "auto"}   # the node's table; auto is refused here (no checkpoint)
SPARSE_DEFAULTS = dict(recipe="FastH3 Preview v1 (keep 10%)", keep_percent=10.0, start_percent=0.0, end_percent=1.0,
                       backend="auto", min_tokens=0, gate="auto")
TEACACHE_WRAPPER_KEY = "ditkit_teacache"
VSA_KEY = "ditkit_vsa_h3"


@dataclasses.dataclass
class RefModel:
    """What a ComfyUI ModelPatcher clone is to the comfy engine: the shared DiT + hooks for sampling runs.
    ``outer`` wrappers are called ``w(run, transformer_options, sigmas)`` around each sampling run."""

    dit: R.LabH3DiT
    transformer_options: dict = dataclasses.field(default_factory=dict)
    outer: list = dataclasses.field(default_factory=list)
    reports: list = dataclasses.field(default_factory=list)

    def clone(self) -> "RefModel":
        to = dict(self.transformer_options)
        if "patches_replace" in to:
            to["patches_replace"] = {k: dict(v) for k, v in to["patches_replace"].items()}
        if "wrappers" in to:
            to["wrappers"] = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in to["wrappers"].items()}
        return RefModel(self.dit, to, list(self.outer), self.reports)

    def add_dm_wrapper(self, key: str, fn) -> None:
        self.transformer_options.setdefault("wrappers", {}).setdefault("diffusion_model", {}).setdefault(key, []).append(fn)

    def set_block_replace(self, fn, kind: str, idx: int) -> None:
        self.transformer_options.setdefault("patches_replace", {}).setdefault("dit", {})[(kind, idx)] = fn


def model_fingerprint(dit) -> dict:
    fp = coef.weights_fingerprint(dit.state_dict().items())
    fp["class"] = type(dit).__name__
    return fp


def run_fingerprint(lab: "RefLab", sigmas, cfg: float) -> dict:
    """The node's ``run_fingerprint`` for this engine's sampler (euler, H3 model sampling, no guidance input)."""
    return {"family": "h3", "sampler": "euler", "steps": len(sigmas) - 1,
            "sigmas": coef.sigmas_list(sigmas.flatten().tolist()), "shifts": {"model_sampling": float(lab.ms.shift)},
            "cfg": float(cfg), "guidance": None}


# ------------------------------------------------------------------------------------------------ TeaCache

def install_teacache(model: RefModel, holder: TeaCacheHolder, sample_wrapper) -> None:
    """The node's ``_install`` (nodes/teacache.py) on a RefModel: holder, diffusion-model wrapper, block replaces
    chaining any replace already there, and the per-sampling wrapper."""
    model.transformer_options[HOLDER_KEY] = holder
    model.outer.append(sample_wrapper)
    model.add_dm_wrapper(TEACACHE_WRAPPER_KEY, diffusion_model_wrapper)
    stack = holder.adapter.stack(model.dit)
    existing = model.transformer_options.get("patches_replace", {}).get("dit", {})
    for pos, (kind, idx) in enumerate(stack):
        model.set_block_replace(make_block_replace(pos, len(stack), kind, holder.adapter,
                                                   prev=existing.get((kind, idx))), kind, idx)


def _fresh_holder(to: dict) -> tuple[dict, TeaCacheHolder]:
    to = dict(to)
    holder = to[HOLDER_KEY].clone()
    to[HOLDER_KEY] = holder
    return to, holder


def calibrate_teacache(lab: "RefLab", prompts, scratch: str, name: str = "h3lab") -> str:
    """DitKitTeaCacheCalibrate on the lab model: one full-compute sampling per prompt through the calibration
    recorder; each run writes a pair file, the fit runs once ``min_prompts`` (= len(prompts)) distinct prompts are
    recorded, as the node does. Returns the coefficient file path."""
    base = os.path.join(scratch, "ditkit", "teacache")
    pair_dir = os.path.join(base, name)
    mfp = model_fingerprint(lab.base)
    holder = TeaCacheHolder("h3", "calibrate", recorder=CalibrationRecorder("h3"),
                            info={"name": name, "degree": CALIBRATE_DEFAULTS["degree"], "min_prompts": len(prompts),
                                  "model_fp": mfp})
    out_path = os.path.join(base, f"{name}.json")

    def sample_wrapper(run, to, sigmas):
        to, h = _fresh_holder(to)
        run_fp = run_fingerprint(lab, sigmas, lab.cfg)
        run_fp["model"] = mfp
        h.begin(sigmas.flatten().tolist())
        out = run(to)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}_{int(time.time() * 1e6) % 1000000:06d}"
        write_pair_file(h.recorder.to_pair_file(run_fp), os.path.join(pair_dir, f"pairs_{stamp}.json"))
        h.recorder.release()
        objs, _, ignored = collect_pair_files(pair_dir, "h3", run_fp)
        if ignored:
            raise RuntimeError(f"calibration pair files not used: {ignored}")
        n_prompts = len({p for o in objs for p in (o.get("prompt_ids") or [])})
        if n_prompts >= h.info["min_prompts"]:
            cf = fit_files(objs, degree=h.info["degree"], min_prompts=h.info["min_prompts"],
                           source=f"lab ref engine calibration '{name}' ({len(objs)} full-compute runs)")
            coef.save(cf, out_path)
        return out

    model = lab.base_model.clone()
    install_teacache(model, holder, sample_wrapper)
    for i, p in enumerate(prompts):
        lab.sample(model, p, 100 + i)
    if not os.path.isfile(out_path):
        raise RuntimeError(f"calibration wrote no coefficient file ({out_path})")
    return out_path


def teacache_model(lab: "RefLab", base: RefModel, overrides: dict) -> RefModel:
    """DitKitTeaCache with the node's defaults + ``overrides`` (``coefficients`` = a calibrated file path)."""
    p = dict(TEACACHE_DEFAULTS, **overrides)
    path = p.get("coefficients")
    if not path:
        raise RuntimeError("no coefficient file (the TeaCache calibration did not run or failed)")
    cf = coef.load(path)
    state, fp_warnings, stream_warnings = state_from_coefficients(cf, "h3", model_fingerprint(base.dit), p)
    holder = TeaCacheHolder("h3", "teacache", state=state,
                            info=dict(p, coefficient_file=cf, model_warnings=fp_warnings + stream_warnings))

    def sample_wrapper(run, to, sigmas):
        to, h = _fresh_holder(to)
        warnings = list(h.info["model_warnings"]) + coef.check_run(cf, run_fingerprint(lab, sigmas, lab.cfg)).warnings()
        h.begin(sigmas.flatten().tolist(), warnings)
        try:
            return run(to)
        finally:
            if h.state.calls:
                base.reports.append(("teacache", h.state.report().summary()))
            h.state.release()

    model = base.clone()
    install_teacache(model, holder, sample_wrapper)
    return model


# ------------------------------------------------------------------------------------------------ VSA-H3

def sparse_model(lab: "RefLab", base: RefModel, overrides: dict) -> RefModel:
    """DitKitSparseAttention with the node's defaults + ``overrides``: a VSAH3Runtime (in a VSAHolder) behind the
    attention override (calls it declines run dense), per-forward layout from the packed segments, a fresh holder
    clone per sampling run."""
    p = dict(SPARSE_DEFAULTS, **overrides)
    if SPARSE_RECIPES[p["recipe"]] == "auto":
        raise ValueError("the lab reference engine has no loaded checkpoint to take a recipe from: use an explicit "
                         "recipe (the lab DiT is not a FastH3 release)")
    keep = (SPARSE_RECIPES[p["recipe"]] if SPARSE_RECIPES[p["recipe"]] is not None else float(p["keep_percent"])) / 100
    if p["gate"] != "auto" and p["gate"] != "none":
        raise RuntimeError(f"unknown gate option {p['gate']!r}")
    cfg = VSAH3Config(keep=keep, sigma_start=float(lab.ms.percent_to_sigma(p["start_percent"])),
                      sigma_end=float(lab.ms.percent_to_sigma(p["end_percent"])),
                      backend=None if p["backend"] == "auto" else p["backend"], min_tokens=int(p["min_tokens"]))
    # the lab DiT has no to_gate_compress weights: pure sparse (as the node reports for such a model)
    holder = VSAHolder(VSAH3Runtime(cfg, gate_source="none (model has no to_gate_compress) -> pure sparse"))
    model = base.clone()
    to = model.transformer_options
    prev = to.get("optimized_attention_override")

    def forward_wrapper(executor, x, timestep, context, transformer_options, **kwargs):
        video = x[0]
        pt, ph, pw = executor.class_obj.patch_size
        T, Hh, Ww = (video.shape[2] + (-video.shape[2] % pt), video.shape[3] + (-video.shape[3] % ph),
                     video.shape[4] + (-video.shape[4] % pw))
        layout = R.Layout(context.shape[1], T, Hh, Ww, x[1].shape[-1])
        prefix, _ = prefix_segments_from_spans(layout.segments)
        sig = transformer_options.get("sigmas")
        sigma = float(sig.flatten()[0]) if isinstance(sig, torch.Tensor) and sig.numel() else None
        t = dict(transformer_options)
        rt = t[VSA_HOLDER_KEY].runtime
        t[VSA_CTX_KEY] = rt.begin_forward(prefix, (T // pt, Hh // ph, Ww // pw), sigma)
        return executor(x, timestep, context, t, **kwargs)

    def sample_wrapper(run, t, sigmas):
        t = dict(t)
        run_holder = t[VSA_HOLDER_KEY] = t[VSA_HOLDER_KEY].clone()     # the node's per-run clone
        try:
            return run(t)
        finally:
            base.reports.append(("sparse", run_holder.runtime.summary()))

    to[VSA_HOLDER_KEY] = holder
    to["optimized_attention_override"] = VSAAttentionOverride(prev)
    model.add_dm_wrapper(VSA_KEY, forward_wrapper)
    model.outer.append(sample_wrapper)
    return model


FEATURE_CORES = {"ditkit.nodes.teacache": teacache_model, "ditkit.nodes.sparse_attention": sparse_model}


# ------------------------------------------------------------------------------------------------ the lab

class RefLab:
    """The harness's Lab on the reference engine (same interface as the comfy engine's)."""

    engine = ENGINE
    engine_desc = ENGINE_DESC

    def __init__(self, steps: int, dit=None, vae=None, text=None, cfg: float = 3.0, frames=22, height=64, width=96):
        self.steps = steps
        self.cfg = float(cfg)
        self.base = R.load_lab_dit(dit)
        self.base_model = RefModel(self.base)
        self.dit = self.base_model
        self.embed = R.load_text_embed(text)
        self.vae_path = vae
        self._vae = None
        self.ms = S.FlowSampling(self.base.sigma_shift_video, self.base.sigma_shift_audio)
        self.shapes = S.av_latent_shapes(width, height, frames)
        self.scratch = tempfile.mkdtemp(prefix="h3lab_ref_")

    @property
    def vae(self):
        """The reference lab VAE (loaded on first use: DiT-only uses need no VAE)."""
        if self._vae is None:
            from benchmarks.lab.lab_ref_vae import load_lab_vae

            self._vae = load_lab_vae(self.vae_path)
        return self._vae

    def conditioning(self, prompt: str):
        return self.embed[D.tokenize(prompt)][None].clone()

    def null_conditioning(self):
        return torch.zeros(1, D.PROMPT_LEN, self.embed.shape[1])

    def sample(self, model: RefModel, prompt: str, seed: int, cfg: float | None = None):
        """(video latent, audio latent, seconds, transformer passes), as the comfy engine's ``Lab.sample``."""
        cfg = self.cfg if cfg is None else float(cfg)
        sigmas = S.simple_sigmas(self.ms, self.steps)
        pos, neg = self.conditioning(prompt), self.null_conditioning()

        def run(to):
            return S.sample(model.dit, pos, neg, seed, self.steps, cfg, self.shapes, transformer_options=to, ms=self.ms)

        fn = run
        for w in reversed(model.outer):
            fn = (lambda w, nxt: (lambda to: w(nxt, to, sigmas)))(w, fn)
        count = [0]
        hook = model.dit.blocks[0].register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        try:
            t0 = time.perf_counter()
            res = fn(model.transformer_options)
            dt = time.perf_counter() - t0
        finally:
            hook.remove()
        return res.video, res.audio, dt, count[0]

    def decode(self, video, audio):
        with torch.inference_mode():
            frames = self.vae.decode(video.float())[0]
        return frames, D.audio_decode(audio.float())

    # -- feature rows
    def t1_ditkit(self):
        """(row label, decode(z) -> [3, H, W] in [0, 1] or None, why not)."""
        from ditkit.bridge.vae import repeat_decode_t1

        def decode(z):
            return repeat_decode_t1(self.vae, z)[0][0, :, 0].float()

        return "T=1 decode: ditkit core repeat_decode_t1 (ref VAE)", decode, ""

    def calibrate_teacache(self, calib_prompts) -> tuple[str, str]:
        """TeaCache calibration through ditkit's calibration core: (coefficient file, where)."""
        return calibrate_teacache(self, calib_prompts, self.scratch), "(ditkit calibration core)"

    def feature_unavailable(self, feat) -> str:
        """Why ``feat`` cannot run here ('' when it can): only ditkit features have cores to install."""
        return "" if feat.module in FEATURE_CORES else NATIVE_ONLY

    def feature_model(self, feat, base: RefModel) -> RefModel:
        """A clone of ``base`` with the feature's core installed (node defaults + the row's overrides)."""
        return FEATURE_CORES[feat.module](self, base, feat.overrides)

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
