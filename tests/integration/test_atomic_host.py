"""Atomic patching: a node that patches a model works on a clone; when it fails midway (a bad layer in a LoKr file,
ComfyUI refusing a patch, a kernel backend that cannot run, a coefficient file for another model, a hook install
that raises) the INPUT model is exactly as before: weights (state-dict bytes), weight patches, model_options,
object patches, wrappers/callbacks/attachments and the module tree. In-process with the ``comfy`` fixture and the
tiny checkpoints (skips without ComfyUI)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from ditkit.errors import DitKitError


def _freeze(x, depth=0):
    """Structure of a ComfyUI options/patch container: containers recursed, leaves by value or identity."""
    if depth > 12:
        return ("deep", id(x))
    if isinstance(x, dict):
        return ("dict", tuple((k if isinstance(k, (str, int, tuple)) else id(k), _freeze(v, depth + 1))
                              for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_freeze(v, depth + 1) for v in x))
    if isinstance(x, set):
        return ("set", tuple(sorted(repr(v) for v in x)))
    if isinstance(x, (str, int, float, bool, type(None))):
        return x
    return ("obj", type(x).__name__, id(x))


def snapshot(m) -> dict:
    h = {}
    for k, v in m.model.state_dict().items():
        t = v.detach().to("cpu").contiguous()
        h[k] = (tuple(t.shape), str(t.dtype), hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
    mods = tuple((n, id(mod), "forward" in vars(mod)) for n, mod in m.model.named_modules())
    out = {"weights": h, "modules": mods, "patches": _freeze(m.patches), "patches_uuid": m.patches_uuid,
           "model_options": _freeze(m.model_options), "object_patches": _freeze(m.object_patches),
           "object_patches_backup": _freeze(m.object_patches_backup)}
    for attr in ("wrappers", "callbacks", "attachments", "additional_models", "injections", "hook_patches",
                 "weight_wrapper_patches"):
        if hasattr(m, attr):
            out[attr] = _freeze(getattr(m, attr))
    return out


def assert_unchanged(before: dict, m):
    after = snapshot(m)
    diff = [k for k in before if before[k] != after[k]]
    assert not diff, f"input model changed by a failed node: {diff}"


@pytest.fixture(scope="module")
def models(comfy, tiny_ckpts):
    import comfy.sd

    torch.set_num_threads(1)
    flux2 = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "flux2_tiny.safetensors"))
    h3 = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))
    return {"flux2": flux2, "h3": h3}


def _lokr_file(tmp_path, bad: bool):
    from ditkit.loaders.safetensors_io import save_file

    good = "diffusion_model.double_blocks.0.img_attn.proj"
    second = "diffusion_model.double_blocks.0.txt_attn.proj"
    w2 = torch.full((16, 16), 0.01)
    if bad:
        w2[1, 2] = float("nan")
    p = tmp_path / ("bad.safetensors" if bad else "good.safetensors")
    save_file({f"{good}.lokr_w1": torch.full((8, 8), 0.01), f"{good}.lokr_w2": torch.full((16, 16), 0.01),
               f"{second}.lokr_w1": torch.full((8, 8), 0.01), f"{second}.lokr_w2": w2}, p)
    return p


def test_lokr_bad_second_layer_leaves_input_untouched(models, tmp_path):
    from ditkit.nodes.lokr import apply_lokr

    m = models["flux2"]
    good, _ = apply_lokr(m, str(_lokr_file(tmp_path, bad=False)), 1.0)  # the valid twin patches both layers
    assert len(good.patches) == len(m.patches) + 2
    before = snapshot(m)
    with pytest.raises(DitKitError, match="NaN"):
        apply_lokr(m, str(_lokr_file(tmp_path, bad=True)), 1.0)
    assert_unchanged(before, m)


def test_lokr_comfy_refusing_a_patch_midway_leaves_input_untouched(models, tmp_path, monkeypatch):
    """ComfyUI's add_patches fails after registering the first patch: only the clone saw it."""
    import comfy.model_patcher as mp

    from ditkit.nodes.lokr import apply_lokr

    m = models["flux2"]
    before = snapshot(m)
    real = mp.ModelPatcher.add_patches

    def half_then_fail(self, patches, strength_patch=1.0, strength_model=1.0):
        first = dict([next(iter(patches.items()))])
        real(self, first, strength_patch, strength_model)
        raise RuntimeError("simulated failure inside ModelPatcher.add_patches")

    monkeypatch.setattr(mp.ModelPatcher, "add_patches", half_then_fail)
    with pytest.raises(RuntimeError, match="simulated"):
        apply_lokr(m, str(_lokr_file(tmp_path, bad=False)), 1.0)
    monkeypatch.undo()
    assert_unchanged(before, m)


def test_teacache_coefficients_for_another_model_leave_input_untouched(models):
    from ditkit.errors import CoefficientError
    from ditkit.nodes.teacache import DitKitTeaCache

    m = models["h3"]
    before = snapshot(m)
    with pytest.raises(CoefficientError, match="Z-Image"):
        DitKitTeaCache.execute(m, "shipped:zimage_borrowed_qwen_image", 0.2, 0.2, 0.0, 1.0, "model", False)
    assert_unchanged(before, m)


def test_sparse_attention_backend_that_cannot_run_leaves_input_untouched(models):
    from ditkit.errors import BackendError
    from ditkit.nodes.sparse_attention import DitKitSparseAttention

    m = models["h3"]
    before = snapshot(m)
    with pytest.raises(BackendError):
        DitKitSparseAttention.execute(m, backend="flashinfer")  # no flashinfer / CUDA here
    assert_unchanged(before, m)


def test_sparse_attention_failing_after_full_install_leaves_input_untouched(models, monkeypatch):
    """Everything is installed on the clone (override, wrappers, gate replaces), then the report raises."""
    import ditkit.nodes.sparse_attention as sa

    m = models["h3"]
    before = snapshot(m)

    def fail(*a, **k):
        raise RuntimeError("simulated failure after the install")

    monkeypatch.setattr(sa, "send_report", fail)
    with pytest.raises(RuntimeError, match="simulated"):
        sa.DitKitSparseAttention.execute(m, backend="reference")
    monkeypatch.undo()
    assert_unchanged(before, m)


def test_adaln_cache_install_raising_midway_leaves_input_untouched(models, monkeypatch):
    import comfy.model_patcher as mp

    from ditkit.nodes.adaln_cache import DitKitH3AdaLNCache

    m = models["h3"]
    before = snapshot(m)
    real = mp.ModelPatcher.add_object_patch
    calls = []

    def second_fails(self, name, obj):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("simulated failure on the second object patch")
        return real(self, name, obj)

    monkeypatch.setattr(mp.ModelPatcher, "add_object_patch", second_fails)
    with pytest.raises(RuntimeError, match="simulated"):
        DitKitH3AdaLNCache.execute(m, True)
    monkeypatch.undo()
    assert len(calls) == 2
    assert_unchanged(before, m)


def test_adaln_cache_twice_refused_leaves_first_output_untouched(models):
    from ditkit.errors import UnsupportedModelError
    from ditkit.nodes.adaln_cache import DitKitH3AdaLNCache

    out = DitKitH3AdaLNCache.execute(models["h3"], True)
    once = out.args[0] if hasattr(out, "args") else out.result[0]
    before = snapshot(once)
    with pytest.raises(UnsupportedModelError, match="already has AdaLN"):
        DitKitH3AdaLNCache.execute(once, True)
    assert_unchanged(before, once)


def test_snapshot_sees_changes(models):
    """The snapshot must notice a weight patch, an option and an object patch (else the tests above prove nothing)."""
    m = models["flux2"].clone()
    before = snapshot(m)
    k = next(iter(m.model.state_dict()))
    m.add_patches({k: (torch.zeros(1),)}, 1.0)
    m.model_options.setdefault("transformer_options", {})["x"] = 1
    m.add_object_patch("diffusion_model.img_in", torch.nn.Identity())
    after = snapshot(m)
    assert {k for k in before if before[k] != after[k]} >= {"patches", "model_options", "object_patches"}
    w = m.model.state_dict()[k]
    orig = w.detach().clone()
    with torch.no_grad():
        w.view(-1)[0] += 1
    try:
        assert snapshot(m)["weights"] != before["weights"]
    finally:
        with torch.no_grad():
            w.copy_(orig)
