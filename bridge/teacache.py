"""TeaCache / TeaCache calibration on ComfyUI: install on a clone, per-run state, coefficient files in the output
folder (the nodes are ``nodes/teacache.py``; the block hooks ``bridge/blocks.py``; the decisions, fit and file
format the plain-torch ``cache/``).

On a clone the nodes install, through ComfyUI hooks only:

* ``WrappersMP.OUTER_SAMPLE`` (key ``ditkit_teacache``): each sampling run gets a clone of the holder (fresh
  state / recorder) in a cloned ``model_options``, restored in ``finally`` (as EasyCache does); it checks the run
  fingerprint, and sends the report / writes the pair file and fits at the end of the run;
* ``WrappersMP.DIFFUSION_MODEL``: per-call context (condition UUIDs, sigma) for the block hooks;
* ``patches_replace["dit"]`` block replaces on every block of the stack (H3, LTX-2, FLUX.2), or, for Z-Image
  (whose NextDiT layer loop has no block-replace hook in ComfyUI 0.33), an object patch of
  ``diffusion_model.layers`` by a ModuleList of the same modules that routes each call through the replace.

Coefficient files live in ``<output>/ditkit/teacache/`` (calibration writes ``<name>.json`` there and its
pair files under ``<name>/``); shipped defaults (borrowed, with provenance) are addressed as ``shipped:<name>``.
"""
from __future__ import annotations

import json
import logging
import os
import time

import comfy.model_patcher
import comfy.patcher_extension
import comfy.utils
import folder_paths

from ..cache import coefficients as coef
from ..cache.calibrate import CalibrationRecorder, collect_pair_files, fit_files, pair_file_bytes
from ..cache.teacache import TeaCacheState, state_from_coefficients
from ..errors import CacheStackError, CoefficientError, UnsupportedModelError
from ..loaders import safe_fs
from .reports import ReportTarget, current_graph
from . import audio_watch, fingerprint
from .blocks import HOLDER_KEY, HookedLayers, TeaCacheHolder, diffusion_model_wrapper, install_memo, make_block_replace
from .models import teacache_family

log = logging.getLogger("ditkit")

NODE_TEACACHE = "DitKitTeaCache"
NODE_CALIBRATE = "DitKitTeaCacheCalibrate"
WRAPPER_KEY = "ditkit_teacache"
FOREIGN_CACHE_KEYS = ("easycache", "lazycache")
# ditkit step caches (skip whole model calls / block stacks). Not the H3 AdaLN schedule cache
# ("ditkit_h3_adaln_cache"), which computes the same values faster and composes with TeaCache.
DITKIT_STEP_CACHE_KEYS = (WRAPPER_KEY,)


# ================================================================================================ helpers

def teacache_dir() -> str:
    return os.path.join(folder_paths.get_output_directory(), "ditkit", "teacache")


detect_family = teacache_family  # bridge/models.py


def check_not_stacked(model, node_id: str) -> None:
    to = model.model_options.get("transformer_options", {})
    found = []
    for k in FOREIGN_CACHE_KEYS:
        if k in to:
            found.append(f"transformer_options['{k}'] (native EasyCache/LazyCache)")
    for wtype, by_key in getattr(model, "wrappers", {}).items():
        for k in by_key:
            if k in FOREIGN_CACHE_KEYS:
                found.append(f"{wtype} wrapper '{k}' (native EasyCache/LazyCache)")
            elif k in DITKIT_STEP_CACHE_KEYS:
                found.append(f"{wtype} wrapper '{k}' (a ditkit step cache: DitKitTeaCache, DitKitTeaCacheCalibrate or DitKitStepCache)")
    if HOLDER_KEY in to:
        found.append(f"transformer_options['{HOLDER_KEY}'] (a ditkit cache)")
    if found:
        raise CacheStackError(
            f"{node_id}: this model already has a step cache installed ({'; '.join(sorted(set(found)))}). Step caches "
            "skip the same computation and cannot be stacked; feed this node the model before EasyCache/LazyCache/"
            "DitKitTeaCache(Calibrate)/DitKitStepCache, and use one cache only.")


model_fingerprint = fingerprint.model_fingerprint  # one scheme, weakly cached


def run_fingerprint(guider, sampler, sigmas, family: str) -> dict:
    fn = getattr(sampler, "sampler_function", None)
    sampler_name = getattr(fn, "__name__", type(sampler).__name__)
    if sampler_name.startswith("sample_"):
        sampler_name = sampler_name[len("sample_"):]
    shifts = {}
    try:
        ms = guider.model_patcher.get_model_object("model_sampling")
        if hasattr(ms, "shift"):
            shifts["model_sampling"] = float(ms.shift)
    except Exception:  # noqa: BLE001
        pass
    to = guider.model_options.get("transformer_options", {})
    if family == "h3":
        for k in ("minimax_h3_sigma_shift_video", "minimax_h3_sigma_shift_audio"):
            if k in to:
                shifts[k] = float(to[k])
    guidance = None
    try:
        for c in (getattr(guider, "original_conds", {}) or {}).get("positive", []) or []:
            if isinstance(c, dict) and c.get("guidance") is not None:
                guidance = float(c["guidance"])
                break
    except Exception:  # noqa: BLE001
        guidance = None
    cfg = getattr(guider, "cfg", None)
    sig = coef.sigmas_list(sigmas.flatten().tolist())
    return {"family": family, "sampler": sampler_name, "steps": len(sig) - 1, "sigmas": sig, "shifts": shifts or None,
            "cfg": float(cfg) if isinstance(cfg, (int, float)) else None, "guidance": guidance}


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([root, path]) == root


TEACACHE_PARTS = ("ditkit", "teacache")  # teacache_dir() below the output folder


def _check_spec_chars(spec: str) -> None:
    bad = next((i for i, ch in enumerate(spec) if ord(ch) < 32 or 0x7F <= ord(ch) <= 0x9F or 0xD800 <= ord(ch) <= 0xDFFF), None)
    if bad is not None:
        raise CoefficientError(f"{NODE_TEACACHE}: coefficient path contains the control character "
                               f"U+{ord(spec[bad]):04X} at position {bad}; file names with NUL or other control "
                               "characters are refused")


def locate_coefficients(spec: str) -> tuple[str, str, list[str]]:
    """``(path shown to the user, root, components below root)`` of a coefficient file.

    Only files inside ditkit's TeaCache folders are read: ``<output>/ditkit/teacache`` (a name relative to it, or an
    absolute path inside it) and the shipped ``cache/defaults`` (``shipped:<name>`` or its absolute path). Names are
    checked lexically first (no ``..`` escape, no absolute path elsewhere: nothing outside is touched, so there is no
    existence oracle); below the root every component is looked up without following symlinks, and the file is
    later read through ``coef.load_inside`` the same way, opened once (``loaders/safe_fs.py``): whoever can queue a
    prompt must not make the server open (and report on) arbitrary files, also not by swapping a symlink in."""
    spec = (spec or "").strip()
    base = teacache_dir()
    where = (f"coefficient files must live in {base} (give a file name relative to it, as written by "
             f"{NODE_CALIBRATE}) or be a shipped file ('shipped:<name>')")
    if not spec:
        raise CoefficientError(f"{NODE_TEACACHE}: no coefficient file given. {available_coefficients()}")
    _check_spec_chars(spec)
    out_dir = folder_paths.get_output_directory()
    if spec.startswith("shipped:"):
        name = spec[len("shipped:"):]
        shipped = coef.shipped_defaults()
        if name not in shipped:
            raise CoefficientError(f"{NODE_TEACACHE}: no shipped coefficient file {name!r}. {available_coefficients()}")
        return str(shipped[name]), str(coef.DEFAULTS_DIR), [shipped[name].name]
    # (lexical folder, root opened by the reader, components from that root to the folder)
    folders = [(os.path.abspath(base), out_dir, list(TEACACHE_PARTS)),
               (os.path.join(os.path.realpath(out_dir), *TEACACHE_PARTS), out_dir, list(TEACACHE_PARTS)),
               (os.path.abspath(coef.DEFAULTS_DIR), str(coef.DEFAULTS_DIR), []),
               (os.path.realpath(coef.DEFAULTS_DIR), str(coef.DEFAULTS_DIR), [])]
    if os.path.isabs(spec):
        path = os.path.normpath(spec)
        hit = next((f for f in folders if _inside(path, f[0]) and path != f[0]), None)
        if hit is None:
            raise CoefficientError(f"{NODE_TEACACHE}: coefficient path {spec!r} is outside ditkit's TeaCache folders; {where}")
    else:
        path = os.path.normpath(os.path.join(base, spec))
        if not _inside(os.path.abspath(path), os.path.abspath(base)) or os.path.abspath(path) == os.path.abspath(base):
            raise CoefficientError(f"{NODE_TEACACHE}: coefficient path {spec!r} leaves {base}; {where}")
        hit = folders[0]
        path = os.path.abspath(path)
    rel = os.path.relpath(path, hit[0]).split(os.sep)
    for part in rel:
        if len(part.encode("utf-8", "surrogatepass")) > 255:
            raise CoefficientError(f"{NODE_TEACACHE}: coefficient path {spec!r} has a name part of "
                                   f"{len(part.encode('utf-8', 'surrogatepass'))} bytes (file systems allow 255)")
    root, parts = hit[1], hit[2] + rel
    kind, _ = safe_fs.stat_inside(root, parts)
    if kind == "missing" and not parts[-1].endswith(".json"):
        k2, _ = safe_fs.stat_inside(root, parts[:-1] + [parts[-1] + ".json"])
        if k2 != "missing":
            kind, parts, path = k2, parts[:-1] + [parts[-1] + ".json"], path + ".json"
    if kind == "symlink":
        raise CoefficientError(f"{NODE_TEACACHE}: coefficient path {spec!r} goes through a symlink; ditkit does not "
                               f"follow symlinks in its TeaCache folders (a link could lead outside them); {where}")
    if kind == "missing":
        raise CoefficientError(f"{NODE_TEACACHE}: coefficient file '{path}' does not exist. {available_coefficients()}")
    if kind != "file":
        raise CoefficientError(f"{NODE_TEACACHE}: coefficient path '{path}' is not a regular file")
    return path, root, parts


def resolve_coefficients(spec: str) -> str:
    """Path of a coefficient file (see :func:`locate_coefficients`)."""
    return locate_coefficients(spec)[0]


def available_coefficients() -> str:
    base = teacache_dir()
    files = sorted(f for f in os.listdir(base) if f.endswith(".json")) if os.path.isdir(base) else []
    shipped = [f"shipped:{n}" for n in coef.shipped_defaults()]
    return (f"Calibrated files in {base}: {files or 'none (run DitKitTeaCacheCalibrate first)'}; "
            f"shipped (borrowed, uncalibrated): {shipped}")


def install(model, holder: TeaCacheHolder, sample_wrapper) -> None:
    """Install the hooks on ``model`` (already a clone)."""
    model.model_options["transformer_options"][HOLDER_KEY] = holder
    model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, sample_wrapper)
    model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, diffusion_model_wrapper)
    dm = model.model.diffusion_model
    adapter = holder.adapter
    stack = adapter.stack(dm)
    n = len(stack)
    if n == 0:
        raise UnsupportedModelError("TeaCache: the model has no transformer blocks")
    existing = model.model_options["transformer_options"].get("patches_replace", {}).get("dit", {})
    if holder.family == "h3":
        install_memo(model, dm)  # block 0's modulation: computed once per forward for the decision and the block
    if holder.family == "zimage":
        reps = [make_block_replace(i, n, kind, adapter) for i, (kind, _) in enumerate(stack)]
        model.add_object_patch("diffusion_model.layers", HookedLayers(dm.layers, reps))
        return
    for pos, (kind, idx) in enumerate(stack):
        prev = existing.get((kind, idx))
        model.set_model_patch_replace(make_block_replace(pos, n, kind, adapter, prev=prev), "dit", kind, idx)


def _sampling_begin(executor, args):
    guider = executor.class_obj
    orig = guider.model_options
    guider.model_options = comfy.model_patcher.create_model_options_clone(orig)
    to = guider.model_options["transformer_options"]
    for k in FOREIGN_CACHE_KEYS:
        if k in to:
            guider.model_options = orig
            raise CacheStackError(f"TeaCache: EasyCache/LazyCache ('{k}') was applied on top of a ditkit TeaCache model; "
                                  "step caches cannot be stacked, use one of them")
    holder: TeaCacheHolder = to[HOLDER_KEY].clone()
    to[HOLDER_KEY] = holder
    return guider, orig, holder


# ================================================================================================ TeaCache

def audio_latent_check(out, latent_shapes=None) -> dict | None:
    """The sampled audio latent's NaN/Inf count (the audio guard on the H3 / LTX-2 audio stream at the end of
    sampling; :func:`~ditkit.bridge.audio_watch.latent_check`; the per-step check is ``audio_watch.watch``, the
    waveform checks run where audio is decoded, DitKitSaveVideo). ``out`` is what the sampler returns inside
    ``OUTER_SAMPLE``: the flat pack of ``latent_shapes`` (video, audio) for audio-video latents. None when there is
    no audio part."""
    return audio_watch.latent_check(out, latent_shapes)


def teacache_sample_wrapper(executor, *args, **kwargs):
    guider, orig, holder = _sampling_begin(executor, args)
    sampler, sigmas = args[2], args[3]
    try:
        if holder.state is None:  # deferred coefficient file: load and check it now
            try:
                holder.state, holder.info = build_state(holder.info)
            except CoefficientError as e:
                w = holder.info.get("writers") or []
                raise CoefficientError(f"{e} (deferred by {NODE_TEACACHE} #{holder.info.get('node_id')}: expected "
                                       f"from {NODE_CALIBRATE} #{', #'.join(w)}, which writes it once it has seen "
                                       "min_prompts distinct prompts)") from e
        info = holder.info
        run_fp = run_fingerprint(guider, sampler, sigmas, holder.family)
        cf: coef.CoefficientFile = info["coefficient_file"]
        g = coef.check_run(cf, run_fp)
        warnings = list(info.get("model_warnings", [])) + g.warnings()
        if g.mismatches and info.get("strict"):
            raise CoefficientError(f"{NODE_TEACACHE}: this sampling does not match the coefficient file {cf.describe()}: "
                                   + "; ".join(g.warnings()) + " (strict mode; calibrate for this setup or turn strict off)")
        for w in g.warnings():
            log.warning("[ditkit] %s: coefficient fingerprint mismatch: %s (file %s)", NODE_TEACACHE, w, cf.describe())
        holder.begin(sigmas.flatten().tolist(), warnings)
        args, aw = audio_watch.watch(args, kwargs, holder.family)
        out = executor(*args, **kwargs)
        al = audio_latent_check(out, kwargs.get("latent_shapes"))
        holder.info["audio_latent"] = aw.finish(al) if aw is not None else al
        return out
    finally:
        try:
            al = holder.info.pop("audio_latent", None)
            if holder.state is not None and holder.state.calls:
                rep = holder.state.report()
                data, summary = rep.as_dict(), rep.summary()
                if holder.attention_seen:  # another patch's attention (args["attention"]) ran inside ditkit's blocks
                    data["attention"] = dict(holder.attention_seen)
                    summary += "; attention run in blocks: " + ", ".join(
                        f"{k} ({v} block calls)" for k, v in sorted(holder.attention_seen.items()))
                if al is not None:
                    data["audio_latent"] = al
                    summary += audio_watch.summary_suffix(al)
                    audio_watch.remember(NODE_TEACACHE, holder.info.get("node_id"), al)
                _sink(holder.info, NODE_TEACACHE).send("teacache", summary, data)
            if holder.state is not None:
                holder.state.release()
        finally:
            guider.model_options = orig


def _sink(info: dict, node_type: str) -> ReportTarget:
    """The report sink the node handed over (``info["report_to"]``, a :class:`~ditkit.bridge.reports.ReportTarget`);
    a holder made without one reports on no node."""
    target = info.get("report_to")
    return target if target is not None else ReportTarget(None, node_type, None, None)


def deferrable(spec: str) -> str | None:
    """A plain file name in the teacache dir that does not exist yet (deferred to sampling start)."""
    spec = (spec or "").strip()
    if not spec or spec.startswith("shipped:") or os.path.isabs(spec) or os.sep in spec or "/" in spec:
        return None
    base = teacache_dir()
    name = spec if spec.endswith(".json") else spec + ".json"
    if os.path.isfile(os.path.join(base, spec)) or os.path.isfile(os.path.join(base, name)):
        return None
    if not all(ch.isalnum() or ch in "-_." for ch in name) or name.startswith("."):
        return None
    return name


def calibrators_writing(name: str) -> list[str]:
    """Ids of the DitKitTeaCacheCalibrate nodes of the executing prompt that write ``<name>`` (a ``.json`` file
    name): same name after the node's own normalisation, or a name fed by a link (unknown until it runs)."""
    view = current_graph()
    if view is None:
        return []
    get, ids = view
    stem = name[:-5] if name.endswith(".json") else name
    out = []
    for nid in ids:
        node = get(nid) or {}
        if node.get("class_type") != NODE_CALIBRATE:
            continue
        v = (node.get("inputs") or {}).get("name")
        if isinstance(v, list) or (isinstance(v, str) and v.strip().removesuffix(".json") == stem):
            out.append(str(nid))
    return out


def build_state(params: dict) -> tuple[TeaCacheState, dict]:
    """Load + check the coefficient file and build the runtime state (raises on bad files / other families)."""
    path, root, parts = locate_coefficients(params["spec"])
    cf = coef.load_inside(root, parts, display=path)   # opened once, no symlink followed: the checked file is read
    state, fp_warnings, stream_warnings = state_from_coefficients(cf, params["family"], params["model_fp"], params,
                                                                  NODE_TEACACHE, NODE_CALIBRATE)
    for w in fp_warnings:
        log.warning("[ditkit] %s: coefficient fingerprint mismatch: %s (file %s)", NODE_TEACACHE, w, cf.describe())
    info = dict(params, coefficient_file=cf, model_warnings=fp_warnings + stream_warnings, deferred=False)
    return state, info


# ================================================================================================ calibration

def calibrate_sample_wrapper(executor, *args, **kwargs):
    guider, orig, holder = _sampling_begin(executor, args)
    info = holder.info
    sampler, sigmas = args[2], args[3]
    ok = False
    try:
        run_fp = run_fingerprint(guider, sampler, sigmas, holder.family)
        run_fp["model"] = info["model_fp"]
        holder.begin(sigmas.flatten().tolist())
        if holder.recorder is not None:
            sink, name = _sink(info, NODE_CALIBRATE), info.get("name")

            def on_step(pairs: int, step: int, steps: int) -> None:
                sink.send("teacache_calibration_progress",
                            f"TeaCache calibration '{name}': recording, {pairs} pairs (step {step}/{steps})",
                            {"pairs": pairs, "step": step, "steps": steps})

            holder.recorder.on_step = on_step
        out = executor(*args, **kwargs)
        ok = True
        return out
    finally:
        try:
            if ok and holder.recorder is not None:
                _finish_calibration(holder, run_fp)
            if holder.recorder is not None:
                holder.recorder.release()
        finally:
            guider.model_options = orig


def calibration_name(name) -> str:
    """The validated calibration name (without ``.json``); raises :class:`CoefficientError` naming the input."""
    raw = name if isinstance(name, str) else ""
    name = raw.strip()
    if name.endswith(".json"):
        name = name[:-5]
    if not name or not all(ch.isalnum() or ch in "-_." for ch in name) or name.startswith("."):
        shown = repr(raw) if len(raw) <= 80 else repr(raw[:80]) + "..."
        raise CoefficientError(f"{NODE_CALIBRATE}: input 'name' {shown} must be non-empty, must not start with '.' "
                               "and may use only letters, digits, '-', '_', '.'")
    safe_fs.validate_name(name + ".json", f"{NODE_CALIBRATE}: input 'name' ({len(name.encode())} bytes)",
                          CoefficientError)
    return name


def _written_by_calibration(name: str):
    """``replace_if`` for ``<name>.json``: only a coefficient file this node wrote for ``name`` is replaced."""
    src = f"{NODE_CALIBRATE} '{name}'"

    def ok(data: bytes) -> bool:
        try:
            cf = coef.parse_bytes(data, "(existing)")
        except CoefficientError:
            return False
        return cf.kind == "calibrated" and str(cf.provenance.get("source", "")).startswith(src)

    return ok


def check_calibration_target(name: str) -> None:
    """Before sampling: nothing may be in the way of ``<name>.json`` and the pair folder ``<name>/`` (a folder,
    symlink or foreign file where a file goes, a file or symlink where the folder goes). Raises CoefficientError."""
    out_dir = folder_paths.get_output_directory()
    base = teacache_dir()
    kind, _ = safe_fs.stat_inside(out_dir, list(TEACACHE_PARTS))
    if kind not in ("missing", "dir"):
        raise CoefficientError(f"{NODE_CALIBRATE}: '{base}' is {'a symlink' if kind == 'symlink' else 'not a folder'}; "
                               "calibration writes only into a real folder (ditkit does not follow symlinks there)")
    target = os.path.join(base, name + ".json")
    kind, _ = safe_fs.stat_inside(out_dir, [*TEACACHE_PARTS, name + ".json"])
    if kind == "file":
        data, _ = safe_fs.read_inside(out_dir, [*TEACACHE_PARTS, name + ".json"], max_bytes=coef.MAX_FILE_BYTES,
                                      what="coefficient file", error=CoefficientError)
        if not _written_by_calibration(name)(data):
            raise CoefficientError(f"{NODE_CALIBRATE}: input 'name' {name!r}: '{target}' already exists and was not "
                                   f"written by {NODE_CALIBRATE} for this name; choose another name or move the file "
                                   "(ditkit never replaces a file it did not write)")
    elif kind != "missing":
        what = {"dir": "a folder", "symlink": "a symlink"}.get(kind, "a special file")
        raise CoefficientError(f"{NODE_CALIBRATE}: input 'name' {name!r}: {what} is in the way at '{target}'; "
                               "choose another name or move it")
    kind, _ = safe_fs.stat_inside(out_dir, [*TEACACHE_PARTS, name])
    if kind not in ("missing", "dir"):
        what = {"file": "a file", "symlink": "a symlink"}.get(kind, "a special file")
        raise CoefficientError(f"{NODE_CALIBRATE}: input 'name' {name!r}: the pair folder '{os.path.join(base, name)}' "
                               f"is {what}; choose another name or move it")


def _finish_calibration(holder: TeaCacheHolder, run_fp: dict) -> None:
    info = holder.info
    name = info["name"]
    try:
        _write_calibration(holder, run_fp)
    except CoefficientError as e:  # checked at execute; only a change made during sampling gets here: keep its output
        log.warning("[ditkit] %s '%s': nothing written: %s", NODE_CALIBRATE, name, e)
        _sink(info, NODE_CALIBRATE).send("teacache_calibration",
                    f"TeaCache calibration '{name}': WRITE FAILED, nothing written: {e}", {"error": str(e)})


def _write_calibration(holder: TeaCacheHolder, run_fp: dict) -> None:
    info = holder.info
    rec: CalibrationRecorder = holder.recorder
    name = info["name"]
    base_path = teacache_dir()
    with safe_fs.SafeDir.open_root(folder_paths.get_output_directory(), TEACACHE_PARTS, create=True,
                                   error=CoefficientError, what="TeaCache folder") as base:
        with base.subdir(name, create=True) as pair_dir:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            blob = pair_file_bytes(rec.to_pair_file(run_fp))
            for attempt in range(8):
                fname = f"pairs_{stamp}_{(int(time.time() * 1e6) + attempt) % 1000000:06d}.json"
                if pair_dir.lstat(fname) is None:
                    break
            pair_path = safe_fs.write_file(pair_dir, fname, blob)
            objs, used, ignored = collect_pair_files(pair_dir, holder.family, run_fp)
        prompts = {p for o in objs for p in (o.get("prompt_ids") or [])}
        data = {"pair_file": pair_path, "pairs_this_run": rec.n_pairs(), "runs": len(objs), "prompts": len(prompts),
                "min_prompts": info["min_prompts"], "ignored_pair_files": ignored, "pair_files": used}
        if len(prompts) < info["min_prompts"]:
            summary = (f"TeaCache calibration '{name}': recorded {rec.n_pairs()} pairs ({len(prompts)}/{info['min_prompts']} "
                       f"distinct prompts so far; run more prompts with the same model/sampler/steps to fit)")
            _sink(info, NODE_CALIBRATE).send("teacache_calibration", summary, data)
            return
        try:
            cf = fit_files(objs, degree=info["degree"], min_prompts=info["min_prompts"],
                           source=f"{NODE_CALIBRATE} '{name}' ({len(objs)} full-compute runs)")
        except CoefficientError as e:  # the sampling itself succeeded: keep its output, report the failed fit loudly
            log.warning("[ditkit] %s '%s': fit failed: %s", NODE_CALIBRATE, name, e)
            data["error"] = str(e)
            _sink(info, NODE_CALIBRATE).send("teacache_calibration",
                        f"TeaCache calibration '{name}': FIT FAILED, no coefficient file written: {e}", data)
            return
        out_path = os.path.join(base_path, f"{name}.json")
        blob = (json.dumps(cf.as_dict(), indent=1, allow_nan=False) + "\n").encode("utf-8")
        safe_fs.write_file(base, f"{name}.json", blob, replace_if=_written_by_calibration(name),
                           max_existing_bytes=coef.MAX_FILE_BYTES)
        cf.path = out_path
    fits = {s: st.fit for s, st in cf.streams.items()}
    data.update({"coefficients": out_path, "fit": fits, "x_range": {s: st.x_range for s, st in cf.streams.items()}})
    summary = (f"TeaCache calibration '{name}': wrote {out_path} from {len(prompts)} prompts / {len(objs)} runs; "
               + ", ".join(f"{s} R2 {f['r2']:.3f} (n={f['n_pairs']})"
                           + (f" degree {f['degree']} (degree {f['degree_requested']} was negative inside its x range)"
                              if f.get("degree_requested") else "") for s, f in fits.items()))
    _sink(info, NODE_CALIBRATE).send("teacache_calibration", summary, data)


# ================================================================================================ what the nodes install

def teacache_holder(model, params: dict) -> tuple[TeaCacheHolder, str, dict]:
    """The holder DitKitTeaCache installs for ``params`` (its inputs + family / fingerprint / report target), with
    the install report's summary and data. A coefficient file that a DitKitTeaCacheCalibrate of this workflow
    writes later is deferred to sampling start; any other file is loaded and checked now."""
    family, spec = params["family"], params["spec"]
    deferred = deferrable(spec)
    writers = calibrators_writing(deferred) if deferred else []
    if deferred and not writers:
        # checked here, on this node: deferring would make the sampler fail with this node's problem
        raise CoefficientError(
            f"{NODE_TEACACHE}: coefficient file '{os.path.join(teacache_dir(), deferred)}' does not exist and no "
            f"{NODE_CALIBRATE} in this workflow writes it (name '{deferred[:-5]}'). {available_coefficients()}")
    if deferred:
        holder = TeaCacheHolder(family, "teacache", state=None, info=dict(params, deferred=True, writers=writers))
        summary = (f"TeaCache on {coef.FAMILY_NAMES[family]}: coefficient file '{deferred}' does not exist yet; "
                   f"{NODE_CALIBRATE} #{', #'.join(writers)} in this workflow writes it; it is loaded and checked "
                   "when sampling starts")
        return holder, summary, {"family": family, "coefficients": deferred, "deferred": True, "writers": writers}
    state, info = build_state(params)
    holder = TeaCacheHolder(family, "teacache", state=state, info=info)
    cf = info["coefficient_file"]
    warnings = info["model_warnings"]
    summary = (f"TeaCache on {coef.FAMILY_NAMES[family]}: {cf.describe()}, thresholds {state.config.thresholds}, "
               f"steps {params['start_percent']:.2f}-{params['end_percent']:.2f}, cache on {params['cache_device']}"
               + (f" | WARNING: {'; '.join(warnings)}" if warnings else ""))
    data = {"family": family, "coefficients": cf.path, "kind": cf.kind, "thresholds": state.config.thresholds,
            "warnings": warnings, "fit": {s: st.fit for s, st in state.config.streams.items()}}
    return holder, summary, data


def calibration_holder(family: str, info: dict) -> TeaCacheHolder:
    """The holder DitKitTeaCacheCalibrate installs (its recorder is replaced by a fresh one per sampling run)."""
    return TeaCacheHolder(family, "calibrate", recorder=CalibrationRecorder(family), info=info)


def coefficients_signature(spec: str) -> str:
    """Changes when the coefficient file changes on disk (the node re-executes after a new calibration)."""
    try:
        path = resolve_coefficients(spec)
        st = os.stat(path)
        return f"{path}|{st.st_mtime_ns}|{st.st_size}"
    except Exception:  # noqa: BLE001 - a missing/bad file is reported by execute
        return f"missing|{spec}|{time.time()}"
