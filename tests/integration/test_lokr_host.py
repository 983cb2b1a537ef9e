"""DitKitLoKrLoader in the real host (in-process ComfyUI, CPU): exact patched weights through ComfyUI's own
patch path, unpatching, bad input leaving the model untouched, sampling, native comparison, and files
written by the real third-party writers (``lycoris-lora``, ``peft``) when they are installed.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

from ditkit.errors import AdapterError, CheckpointError, DitKitError
from ditkit.loaders.safetensors_io import load_file, save_file
from ditkit.tiny import ckpt_image as ci
from tests.support.quant_oracle import bits as _bits
from tests.support.quant_oracle import host_requant_oracle, json_format, saved_weights

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(comfy, tiny_ckpts):
    import comfy.sd

    from ditkit.nodes.image_loaders import load_zimage

    torch.set_num_threads(1)
    z, _, _ = load_zimage(str(tiny_ckpts / "diffusion_models" / "zimage_tiny.safetensors"))
    f = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "flux2_tiny.safetensors"))
    return {"zimage": z, "flux2": f}


def lokr_path(tiny_ckpts, fam):
    return tiny_ckpts / "loras" / f"{fam}_lokr_tiny.safetensors"


def patched(m, key):
    return m.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)


def base_sd(m):
    return {k: v.detach().clone() for k, v in m.model_state_dict(filter_prefix="diffusion_model.").items()}


def kron64(a, b):
    a, b = a.double(), b.double()
    return (a[:, None, :, None] * b[None, :, None, :]).reshape(a.shape[0] * b.shape[0], a.shape[1] * b.shape[1])


def oracle_tiny_file(fam, sd, base, strength):
    """Expected patched weights for the tiny example LoKr files (their naming is known to the test)."""
    out = {}
    d = ci.ZIMAGE["dim"]
    mods = sorted({k.rsplit(".", 1)[0] for k in sd})
    for m in mods:
        if "lokr_w2" in {k.rsplit(".", 1)[1] for k in sd if k.startswith(m + ".")}:
            w2, scale = sd[m + ".lokr_w2"], 1.0  # full-rank: LyCORIS scale 1 (placeholder alpha ignored)
        else:
            w2 = sd[m + ".lokr_w2_a"].double() @ sd[m + ".lokr_w2_b"].double()
            scale = float(sd[m + ".alpha"]) / sd[m + ".lokr_w2_b"].shape[0]
        delta = kron64(sd[m + ".lokr_w1"], w2) * scale * strength
        name = m[len("diffusion_model."):]
        rows = None
        if fam == "zimage" and name.endswith(("to_q", "to_k", "to_v")):
            j = "qkv".index(name[-1])
            rows, name = (j * d, (j + 1) * d), name.rsplit(".", 1)[0] + ".qkv"
        elif fam == "zimage" and name.endswith("to_out.0"):
            name = name.replace("to_out.0", "out")
        wk = f"diffusion_model.{name}.weight"
        cur = out.get(wk, base[wk].double().clone())
        if rows is None:
            cur += delta
        else:
            cur[rows[0]:rows[1]] += delta
        out[wk] = cur
    return out


@pytest.mark.parametrize("fam", ["zimage", "flux2"])
def test_tiny_file_exact_through_comfy_patch_path(models, tiny_ckpts, fam):
    from ditkit.nodes.lokr import apply_lokr, report_text

    model = models[fam]
    base = base_sd(model)
    assert all(v.dtype == torch.float32 for k, v in base.items() if v.dim() == 2)
    m, plan = apply_lokr(model, str(lokr_path(tiny_ckpts, fam)), 0.8)
    assert not plan.unused and not plan.refused
    assert "0 keys unused" in report_text(plan, "x", 0.8)
    ref = oracle_tiny_file(fam, load_file(lokr_path(tiny_ckpts, fam)), base, 0.8)
    assert ref
    worst = 0.0
    for wk, r in ref.items():
        got = patched(m, wk).double()
        worst = max(worst, (got - r).abs().max().item() / r.abs().max().item())
    assert worst <= 1e-6, worst
    assert model.patches == {} or all(k not in model.patches for k in ref)  # input untouched


def test_unpatch_and_strength(models, tiny_ckpts):
    from ditkit.nodes.lokr import apply_lokr

    model = models["flux2"]
    base = base_sd(model)
    k = "diffusion_model.single_blocks.0.linear1.weight"
    m1, _ = apply_lokr(model, str(lokr_path(tiny_ckpts, "flux2")), 1.0)
    m2, _ = apply_lokr(model, str(lokr_path(tiny_ckpts, "flux2")), -0.5)
    d1 = patched(m1, k).double() - base[k].double()
    d2 = patched(m2, k).double() - base[k].double()
    assert d1.abs().max() > 0
    assert torch.allclose(d2, -0.5 * d1, rtol=1e-5, atol=1e-6)
    m1.patch_model(device_to=torch.device("cpu"))
    live = m1.model_state_dict()[k]
    assert torch.allclose(live.double(), base[k].double() + d1, rtol=0, atol=1e-6)
    m1.unpatch_model(device_to=torch.device("cpu"))
    assert torch.equal(m1.model_state_dict()[k], base[k])


def test_sampling_with_lokr(models, tiny_ckpts, comfy):
    import nodes as cn
    from comfy_extras.nodes_flux import EmptyFlux2LatentImage
    from comfy_extras.nodes_lotus import LotusConditioning
    from comfy_extras.nodes_sd3 import EmptySD3LatentImage

    from ditkit.nodes.lokr import apply_lokr

    cond = LotusConditioning.execute().result[0]
    for fam, lat in (("zimage", EmptySD3LatentImage.execute(64, 64).result[0]),
                     ("flux2", EmptyFlux2LatentImage.execute(64, 64).result[0])):
        m, _ = apply_lokr(models[fam], str(lokr_path(tiny_ckpts, fam)), 1.0)
        a = cn.common_ksampler(models[fam], 0, 2, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"]
        b = cn.common_ksampler(m, 0, 2, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"]
        c = cn.common_ksampler(models[fam], 0, 2, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"]
        assert torch.isfinite(b).all()
        assert not torch.equal(a, b)
        assert torch.equal(a, c)  # the base model is unaffected after sampling the patched clone


def _write(tmp_path, name, sd):
    p = tmp_path / name
    save_file(sd, p)
    return p


def _zimage_module(prefix="diffusion_model.layers.0.attention.to_q", rows=None, cols=None, alpha=2.0):
    d = ci.ZIMAGE["dim"]
    g = torch.Generator().manual_seed(5)
    rows, cols = rows or d, cols or d
    return {f"{prefix}.lokr_w1": torch.randn(8, 8, generator=g), f"{prefix}.lokr_w2_a": torch.randn(rows // 8, 4, generator=g),
            f"{prefix}.lokr_w2_b": torch.randn(4, cols // 8, generator=g), f"{prefix}.alpha": torch.tensor(alpha)}


BAD = {
    "shape": (lambda: _zimage_module(rows=2 * ci.ZIMAGE["dim"]), AdapterError, r"to_q.*shape"),
    "family": (lambda: _zimage_module("lora_unet_down_blocks_0_attentions_0_proj_in"), AdapterError, "no LoKr module applies"),
    "nan": (lambda: {**_zimage_module(), "diffusion_model.layers.0.attention.to_q.lokr_w1": torch.full((8, 8), float("nan"))},
            AdapterError, r"to_q\.lokr_w1.*NaN"),
    "alpha0": (lambda: _zimage_module(alpha=0.0), AdapterError, r"to_q\.alpha"),
    # a declared size no layer of the model has: refused from the header, before the file's tensors are read
    "absurd": (lambda: {**_zimage_module(), "diffusion_model.layers.0.attention.to_q.lokr_w2_b": torch.zeros(4, 100000)},
               AdapterError, r"input 'lokr_name'.*lokr_w2_b.*dimension of 100000.*nothing was read"),
}


@pytest.mark.parametrize("case", [*BAD, "truncated"])
def test_bad_input_leaves_model_unchanged(models, tmp_path, case):
    from ditkit.nodes.lokr import apply_lokr

    model = models["zimage"]
    before_w = base_sd(model)
    before_p = {k: list(v) for k, v in model.patches.items()}
    before_uuid = model.patches_uuid
    if case == "truncated":
        p = _write(tmp_path, "t.safetensors", _zimage_module())
        data = p.read_bytes()
        p.write_bytes(data[: len(data) - 100])
        exc, pat = CheckpointError, r"t\.safetensors"
    else:
        make, exc, pat = BAD[case]
        p = _write(tmp_path, f"{case}.safetensors", make())
    with pytest.raises(exc, match=pat):
        apply_lokr(model, str(p), 1.0)
    assert model.patches == before_p and model.patches_uuid == before_uuid
    after = base_sd(model)
    assert all(torch.equal(before_w[k], after[k]) for k in before_w)


def _comfy_quant(sd, fmt):
    """ComfyUI mixed-precision layout: per-layer fp8/int8 weight + weight_scale + comfy_quant JSON."""
    import json

    out = {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.dim() == 2 and k.startswith(("double_blocks", "single_blocks")):
            p, w = k[: -len("weight")], v.float()
            if fmt in ("float8_e4m3fn", "float8_e5m2"):
                dt = getattr(torch, fmt)
                s = w.abs().max() / torch.finfo(dt).max
                out[k] = (w / s).to(dt)
            else:
                s = w.abs().max() / 127.0
                out[k] = torch.round(w / s).clamp(-127, 127).to(torch.int8)
            out[p + "weight_scale"] = s.reshape(())
            out[p + "comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("fmt", ["plain-fp8", "mxfp8-flagged"])
def test_quantized_base_refused_with_layer_and_format(comfy, tiny_ckpts, fmt):
    import comfy.sd
    import comfy.utils

    from ditkit.nodes.lokr import apply_lokr

    path = tiny_ckpts / "diffusion_models" / "flux2_tiny.safetensors"
    if fmt == "plain-fp8":
        q = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float8_e4m3fn})
        pat = r"float8_e4m3fn"
    else:  # a layout ditkit has not verified: flag one layer of an fp8 comfy_quant model as mxfp8
        q = comfy.sd.load_diffusion_model_state_dict(_comfy_quant(load_file(path), "float8_e4m3fn"))
        comfy.utils.get_attr(q.model, "diffusion_model.single_blocks.1.linear1").quant_format = "mxfp8"
        pat = r"comfy_quant format mxfp8, layout \w+Layout"
    before = dict(q.patches)
    before_w = {k: v.float().clone() for k, v in q.model_state_dict().items() if isinstance(v, torch.Tensor) and v.dim() == 2}
    with pytest.raises(AdapterError, match=r"layer 'diffusion_model\.[a-z_0-9.]+\.weight' is stored quantized/packed \(.*" + pat):
        apply_lokr(q, str(lokr_path(tiny_ckpts, "flux2")), 1.0)
    assert q.patches == before
    after = q.model_state_dict()
    assert all(torch.equal(before_w[k], after[k].float()) for k in before_w)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "int8_tensorwise"])
def test_quantized_base_requantized_bit_exact_and_saved_same_scheme(comfy, tiny_ckpts, tmp_path, fmt):
    """comfy_quant per-tensor fp8 / int8: ditkit dequantizes, adds ΔW and requantizes in row chunks into the SAME
    layout; what ModelSave writes equals, bit for bit, the host's own layout quantize of (float64 dequant(base) +
    float64 ΔW) rounded to float32 (ΔW from the file's factors, math in the test). The input model is untouched."""
    import comfy.model_management
    import comfy.quant_ops
    import comfy.sd
    import comfy.utils

    from ditkit.nodes.lokr import apply_lokr, report_text

    if fmt not in comfy.quant_ops.QUANT_ALGOS:
        pytest.skip(f"this host's QUANT_ALGOS has no {fmt}")
    path = tiny_ckpts / "diffusion_models" / "flux2_tiny.safetensors"
    q = comfy.sd.load_diffusion_model_state_dict(_comfy_quant(load_file(path), fmt))
    names = ("single_blocks.0.linear1", "double_blocks.1.txt_attn.qkv", "double_blocks.0.img_attn.proj")
    keys = [f"diffusion_model.{n}.weight" for n in names]
    base = {k: comfy.utils.get_attr(q.model, k) for k in keys}
    before = {k: w._qdata.clone() for k, w in base.items()}
    m, plan = apply_lokr(q, str(lokr_path(tiny_ckpts, "flux2")), 0.75)
    lsd = load_file(lokr_path(tiny_ckpts, "flux2"))
    saved = saved_weights(m, tmp_path, names)
    comfy.model_management.unload_all_models()   # the clone shares q's modules while it is loaded
    for name, k in zip(names, keys):
        pre = f"diffusion_model.{name}"
        w0q = base[k]
        w2 = lsd[pre + ".lokr_w2_a"].double() @ lsd[pre + ".lokr_w2_b"].double()
        d = kron64(lsd[pre + ".lokr_w1"], w2) * float(lsd[pre + ".alpha"]) / lsd[pre + ".lokr_w2_b"].shape[0] * 0.75
        want, want_scale = host_requant_oracle(w0q, d)
        got = saved[name]
        assert json_format(got["comfy_quant"]) == fmt   # the same scheme on disk
        assert got["weight"].dtype == w0q._qdata.dtype and got["weight"].shape == w0q._qdata.shape
        assert torch.equal(_bits(got["weight"]), _bits(want)), name
        assert torch.equal(_bits(got["weight_scale"].float().reshape(())), _bits(want_scale.float().reshape(()))), name
        assert torch.equal(comfy.utils.get_attr(q.model, k)._qdata, before[k])   # input model untouched
    assert not q.object_patches and not q.patches
    text = report_text(plan, "f", 0.75)
    assert f"single_blocks.0.linear1.weight: requantized {fmt} in 1 row chunks, reference quantize" in text
    assert not any(k in m.patches for k in keys) and all(k in m.object_patches for k in keys)


def test_quantized_base_failure_leaves_no_partial_patch(comfy, tiny_ckpts, monkeypatch):
    """A failure on the second quantized layer: AdapterError naming it, nothing registered anywhere."""
    import comfy.sd

    from ditkit.kernels import delta_fuse
    from ditkit.nodes.lokr import apply_lokr

    path = tiny_ckpts / "diffusion_models" / "flux2_tiny.safetensors"
    q = comfy.sd.load_diffusion_model_state_dict(_comfy_quant(load_file(path), "float8_e4m3fn"))
    real, calls = delta_fuse.requantize_fuse, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("injected")
        return real(*a, **k)

    monkeypatch.setattr(delta_fuse, "requantize_fuse", flaky)
    with pytest.raises(AdapterError, match=r"quantized layer 'diffusion_model\.[a-z_0-9.]+\.weight' \(float8_e4m3fn\): injected"):
        apply_lokr(q, str(lokr_path(tiny_ckpts, "flux2")), 1.0)
    assert len(calls) == 2 and not q.patches and not q.object_patches


def test_node_execute_report(models, tiny_ckpts, comfy):
    import folder_paths

    from ditkit.nodes.lokr import DitKitLoKrLoader

    folder_paths.add_model_folder_path("loras", str(tiny_ckpts / "loras"))
    out = DitKitLoKrLoader.execute(models["flux2"], "flux2_lokr_tiny.safetensors", 1.0)
    m, report = out.result
    assert m is not models["flux2"] and m.patches
    assert "0 keys unused, 0 refused" in report and "single_blocks.0.linear1" in report


def test_native_comparison_and_gaps(models, tiny_ckpts, comfy, tmp_path):
    """Where ComfyUI's native LoKr path applies the same keys it must agree with ditkit (independent
    implementation); FLUX.2 diffusers-named global modulation / 6h proj_mlp are gaps natively."""
    import comfy.lora
    import comfy.sd

    from ditkit.nodes.lokr import apply_lokr

    model = models["flux2"]
    sd = load_file(lokr_path(tiny_ckpts, "flux2"))
    native, _ = comfy.sd.load_lora_for_models(model, None, {k: v.clone() for k, v in sd.items()}, 1.0, 0)
    ours, _ = apply_lokr(model, str(lokr_path(tiny_ckpts, "flux2")), 1.0)
    for k in ("diffusion_model.double_blocks.0.img_attn.qkv.weight", "diffusion_model.single_blocks.1.linear1.weight"):
        assert torch.allclose(patched(native, k), patched(ours, k), rtol=1e-5, atol=1e-6)
    # diffusers names onto FLUX.2 globals and the FLUX.2 proj_mlp width
    h = ci.FLUX2["hidden"]
    g = torch.Generator().manual_seed(9)
    extra = {}
    for name, rows in (("double_stream_modulation_img.linear", 6 * h), ("single_transformer_blocks.0.proj_mlp", 6 * h)):
        extra |= {f"transformer.{name}.lokr_w1": torch.randn(4, 4, generator=g),
                  f"transformer.{name}.lokr_w2": torch.randn(rows // 4, h // 4, generator=g) * 0.01}
    p = _write(tmp_path, "gaps.safetensors", extra)
    ours, plan = apply_lokr(model, str(p), 1.0)
    assert len(plan.items) == 2 and not plan.unused
    native, _ = comfy.sd.load_lora_for_models(model, None, {k: v.clone() for k, v in extra.items()}, 1.0, 0)
    base = base_sd(model)
    for k in ("diffusion_model.double_stream_modulation_img.lin.weight", "diffusion_model.single_blocks.0.linear1.weight"):
        assert not torch.equal(patched(ours, k), base[k])
        assert torch.equal(patched(native, k), base[k]), f"native now applies {k}: gap closed upstream?"


# ---------------------------------------------------------------------------------------------- third-party writers
@contextlib.contextmanager
def _clean_path():
    """The repo root holds a top-level ``kernels`` package name that shadows HF ``kernels`` for transformers."""
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")) != REPO]
    try:
        yield
    finally:
        sys.path[:] = saved


def _optional(name):
    """The writer package (the `dev` extra installs it): skips with the reason without it, fails under CI."""
    return _unit_suite().writer(name)


class _Att(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.to_q = torch.nn.Linear(d, d, bias=False)
        self.to_k = torch.nn.Linear(d, d, bias=False)
        self.to_v = torch.nn.Linear(d, d, bias=False)


def _diffusers_like_zimage(base):
    """Diffusers-named Z-Image attention (split to_q/k/v) carrying the tiny model's own qkv rows."""
    d = ci.ZIMAGE["dim"]
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList()
    for i in range(ci.ZIMAGE["n_layers"]):
        blk = torch.nn.Module()
        blk.attention = _Att(d)
        qkv = base[f"diffusion_model.layers.{i}.attention.qkv.weight"]
        for j, n in enumerate("qkv"):
            getattr(blk.attention, f"to_{n}").weight.data.copy_(qkv[j * d:(j + 1) * d])
        root.layers.append(blk)
    return root


def _bfl_like_flux2(base):
    root = torch.nn.Module()
    for k, v in base.items():
        if v.dim() != 2 or not k.startswith(("diffusion_model.double_blocks", "diffusion_model.single_blocks",
                                             "diffusion_model.double_stream_modulation", "diffusion_model.single_stream")):
            continue
        parts = k[len("diffusion_model."):-len(".weight")].split(".")
        mod = root
        for p in parts[:-1]:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        lin = torch.nn.Linear(v.shape[1], v.shape[0], bias=False)
        lin.weight.data.copy_(v)
        mod.add_module(parts[-1], lin)
    return root


def _check_forward(ours_model, tree, fwd_mods, base, rows_of):
    """Adapted layer forward by the writer's own module vs x @ W_patched[rows]^T."""
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for name, mod in fwd_mods:
        wk, rows = rows_of(name)
        w = patched(ours_model, wk).double()
        if rows is not None:
            w = w[rows[0]:rows[1]]
        x = torch.randn(5, w.shape[1], generator=g)
        with torch.no_grad():
            y_writer = mod(x).double()
        y_ours = x.double() @ w.T
        worst = max(worst, ((y_writer - y_ours).abs().max() / y_ours.abs().max()).item())
    return worst


@pytest.mark.parametrize("fam", ["zimage", "flux2"])
def test_lycoris_written_files(models, tmp_path, fam):
    lycoris = _optional("lycoris")
    from ditkit.nodes.lokr import apply_lokr

    model = models[fam]
    base = base_sd(model)
    tree = _diffusers_like_zimage(base) if fam == "zimage" else _bfl_like_flux2(base)
    d = ci.ZIMAGE["dim"]
    worst_all = 0.0
    seen_kinds: set = set()
    for cfg in ({"factor": 8, "linear_dim": 4, "linear_alpha": 2}, {"factor": -1, "linear_dim": 4, "linear_alpha": 1},
                {"factor": 16, "linear_dim": 100000, "linear_alpha": 1, "full_matrix": True},
                {"factor": 16, "linear_dim": 2, "linear_alpha": 3, "decompose_both": True}):
        with _clean_path():
            lycoris.LycorisNetwork.apply_preset({"target_name": [".*"], "target_module": []})
            net = lycoris.create_lycoris(tree, 1.0, algo="lokr", **cfg)
            net.apply_to()
            g = torch.Generator().manual_seed(11)
            for p in net.parameters():
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
            f = tmp_path / f"lyco_{fam}_{cfg['factor']}.safetensors"
            net.save_weights(str(f), torch.float32, None)
        m, plan = apply_lokr(model, str(f), 1.0)
        assert not plan.unused and not plan.refused and plan.writer == "lycoris"
        mods = [(n, mod) for n, mod in tree.named_modules() if isinstance(mod, torch.nn.Linear)]
        assert len(plan.items) == len(mods) > 0
        kinds = {tuple(sorted(k for k in it.module.factors)) for it in plan.items}
        seen_kinds.update(kinds)

        def rows_of(name):
            if fam == "zimage":
                i, j = int(name.split(".")[1]), "qkv".index(name[-1])
                return f"diffusion_model.layers.{i}.attention.qkv.weight", (j * d, (j + 1) * d)
            return f"diffusion_model.{name}.weight", None

        worst_all = max(worst_all, _check_forward(m, tree, mods, base, rows_of))
        net.restore()
    assert worst_all <= 1e-5, worst_all
    assert ("lokr_w1", "lokr_w2") in seen_kinds  # full-rank factors were exercised
    assert ("lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b") in seen_kinds  # decompose_both


def test_peft_written_files(models, tmp_path):
    peft = _optional("peft")
    from ditkit.nodes.lokr import apply_lokr

    model = models["zimage"]
    base = base_sd(model)
    d = ci.ZIMAGE["dim"]
    for k, (r, alpha, factor, both) in enumerate(((4, 8, 8, False), (2, 3, -1, True), (4, 4, 16, False))):
        tree = _diffusers_like_zimage(base)
        with _clean_path():
            cfg = peft.LoKrConfig(r=r, alpha=alpha, target_modules=["to_q", "to_k", "to_v"], decompose_factor=factor,
                                  decompose_both=both, init_weights=False)
            pm = peft.get_peft_model(tree, cfg)
            out = tmp_path / f"peft{k}"
            pm.save_pretrained(str(out))
        m, plan = apply_lokr(model, str(out / "adapter_model.safetensors"), 1.0)
        assert not plan.unused and not plan.refused and plan.writer == "peft"
        assert plan.items and all(it.module.scale == alpha / r for it in plan.items)
        mods = [(n, mod) for n, mod in pm.base_model.model.named_modules() if n.endswith(("to_q", "to_k", "to_v"))]
        assert len(mods) == len(plan.items) == 3 * ci.ZIMAGE["n_layers"]

        def rows_of(name):
            i, j = int(name.split(".")[1]), "qkv".index(name[-1])
            return f"diffusion_model.layers.{i}.attention.qkv.weight", (j * d, (j + 1) * d)

        worst = _check_forward(m, tree, mods, base, rows_of)
        assert worst <= 1e-5, worst


def test_errors_are_ditkit_errors():
    assert issubclass(AdapterError, DitKitError) and issubclass(CheckpointError, DitKitError)


@pytest.mark.parametrize("name,fam", [("zimage_lokr_tiny", "zimage"), ("flux2_lokr_tiny", "flux2")])
def test_example_workflow_report_on_real_server(comfy_server, name, fam):
    import json

    graph = json.loads((REPO / "example_workflows" / "api" / f"{name}.json").read_text(encoding="utf-8"))
    entry = comfy_server.run(graph)
    assert entry["status"]["status_str"] == "success"
    rep = entry["outputs"]["2"]["ditkit_report"][0]
    assert rep["node_type"] == "DitKitLoKrLoader" and rep["data"]["family"] == fam
    assert "0 keys unused, 0 refused" in rep["summary"]
    assert rep["data"]["unused"] == {} and rep["data"]["refused"] == {}
    n_mods = len({k.rsplit(".", 1)[0] for k in load_file(comfy_server.models_dir / "loras" / f"{name}.safetensors")})
    assert len(rep["data"]["applied"]) == n_mods
    # the example ends in a PNG (the tiny VAE through the stock VAELoader / VAEDecode / SaveImage)
    images = [im for out in entry["outputs"].values() for im in out.get("images", []) if im.get("type") == "output"]
    assert [im["filename"].endswith(".png") for im in images] == [True], images
    from PIL import Image

    with Image.open(comfy_server.output_dir / images[0]["subfolder"] / images[0]["filename"]) as im:
        assert im.size == (64, 64) and im.mode == "RGB"


def test_lowvram_prefetch_path(models, tiny_ckpts):
    """Dynamic VRAM / lowvram: ComfyUI copies each patch's tensors into a gathered buffer and rebuilds the
    adapter as ``type(p)(p.loaded_keys, weights)`` before applying it per cast — must give the same weight."""
    import comfy.model_patcher

    from ditkit.nodes.lokr import apply_lokr

    model = models["zimage"]
    m, _ = apply_lokr(model, str(lokr_path(tiny_ckpts, "zimage")), 0.9)
    k = "diffusion_model.layers.0.attention.qkv.weight"  # three row-offset patches (to_q, to_k, to_v)
    assert len(m.patches[k]) == 3
    lvp = comfy.model_patcher.LowVramPatch(k, m.patches)
    need = lvp.memory_required()
    assert need > 0
    lvp.prepare(torch.empty(need, dtype=torch.uint8), None, copy=True)
    w = lvp(base_sd(model)[k].clone())
    assert torch.allclose(w, patched(m, k), rtol=0, atol=1e-6)
    assert not torch.equal(w, base_sd(model)[k])


def _unit_suite():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_lokr_unit_suite", REPO / "tests" / "unit" / "test_lokr.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("fam", ["zimage", "flux2"])
@pytest.mark.parametrize("fmt", ["lycoris", "kohya", "musubi", "onetrainer", "peft", "aitoolkit", "simpletuner", "bare"])
def test_every_format_exact_through_comfy(models, tmp_path, fam, fmt):
    """The unit suite's files (every writer naming; full / decomposed / both / Tucker factors, misaligned
    power-of-two factors) through DitKitLoKrLoader's real path: ComfyUI add_patches + patch_weight_to_device."""
    import json

    from ditkit.nodes.lokr import apply_lokr

    u = _unit_suite()
    sd, expect = u.build_file(fam, fmt, u.KINDS, (8, 16))
    f = _write(tmp_path, "adapter_model.safetensors" if fmt == "peft" else f"{fmt}.safetensors", sd)
    if fmt == "peft":
        (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LOKR", "r": 4, "alpha": 8}))
    model = models[fam]
    base = base_sd(model)
    m, plan = apply_lokr(model, str(f), 0.6)
    assert not plan.unused and not plan.refused and len(plan.items) == len(expect)
    ref = u.expected({k: base[k] for k, _, _ in expect}, expect, 0.6)
    worst = max((patched(m, k).double() - r).abs().max().item() / r.abs().max().item() for k, r in ref.items())
    assert worst <= 1e-6, worst


def test_node_scale_input_and_undetermined_scale(models, comfy, tmp_path):
    """A PEFT-layout file without its adapter_config.json: the node refuses it (naming the file's problem and the
    'scale' input) and leaves the model alone; with scale set, the patched weight is base + strength * scale *
    kron(w1, w2) (float64 oracle from the file's tensors). Non-finite strength / scale are refused."""
    import folder_paths

    from ditkit.nodes.lokr import DitKitLoKrLoader

    d = ci.ZIMAGE["dim"]
    sd = _zimage_module("base_model.model.layers.0.attention.to_k")
    sd.pop("base_model.model.layers.0.attention.to_k.alpha")
    loras = tmp_path / "loras"
    loras.mkdir()
    save_file(sd, loras / "peft_noconfig.safetensors")
    folder_paths.add_model_folder_path("loras", str(loras))
    model = models["zimage"]
    before = base_sd(model)
    with pytest.raises(AdapterError, match=r"adapter_config\.json.*'scale' input"):
        DitKitLoKrLoader.execute(model, "peft_noconfig.safetensors", 1.0)
    for bad in ({"strength": float("nan")}, {"strength": 1.0, "scale": float("inf")}):
        with pytest.raises(DitKitError, match="finite"):  # the node-wide float guard (guards.py) refuses first
            DitKitLoKrLoader.execute(model, "peft_noconfig.safetensors", **bad)
    assert model.patches == {} or "diffusion_model.layers.0.attention.qkv.weight" not in model.patches
    m, report = DitKitLoKrLoader.execute(model, "peft_noconfig.safetensors", -0.8, scale=0.25).result
    assert "scale 0.25 (node input)" in report
    k = "diffusion_model.layers.0.attention.qkv.weight"
    pre = "base_model.model.layers.0.attention.to_k"
    w2 = sd[pre + ".lokr_w2_a"].double() @ sd[pre + ".lokr_w2_b"].double()
    ref = before[k].double().clone()
    ref[d:2 * d] += -0.8 * 0.25 * kron64(sd[pre + ".lokr_w1"], w2)
    got = patched(m, k).double()
    assert (got - ref).abs().max().item() / ref.abs().max().item() <= 1e-6


@pytest.mark.parametrize("fam", ["zimage", "flux2"])
def test_diffusers_pipeline_file_through_comfy(models, tmp_path, fam):
    """A file written by diffusers' pipeline-level save_lora_weights (metadata 'transformer.r', 'transformer.alpha',
    rank/alpha patterns) through ComfyUI's patch path: each patched row range minus the base equals PEFT's own merge
    of the adapter it trained (the old reader found no r/alpha in that metadata and merged at 1.0)."""
    from ditkit.nodes.lokr import apply_lokr

    u = _unit_suite()
    peft = _optional("peft")
    with _clean_path():
        from diffusers.loaders.lora_pipeline import Flux2LoraLoaderMixin, ZImageLoraLoaderMixin
    mixin = ZImageLoraLoaderMixin if fam == "zimage" else Flux2LoraLoaderMixin
    mods = u.zimage_writer_modules() if fam == "zimage" else u.flux2_writer_modules()
    leaves = sorted({n.rsplit(".", 1)[-1] if not n.endswith(".0") else "to_out.0" for n, _ in mods})
    tree = u.make_tree(mods)
    w0 = u.linear_weights(tree)
    with _clean_path():
        pc = peft.LoKrConfig(r=4, alpha=6, target_modules=leaves, decompose_factor=8, init_weights=False,
                             rank_pattern={leaves[0]: 2}, alpha_pattern={leaves[0]: 5})
        peft.inject_adapter_in_model(pc, tree)
        state = peft.get_peft_model_state_dict(tree)
        mixin.save_lora_weights(str(tmp_path), transformer_lora_layers=state,
                                transformer_lora_adapter_metadata=pc.to_dict())
        for mod in tree.modules():
            if isinstance(mod, peft.tuners.lokr.LoKrLayer):
                mod.merge()
    by_peft = {n: w - w0[n] for n, w in u.linear_weights(tree).items()}
    model = models[fam]
    base = base_sd(model)
    m, plan = apply_lokr(model, str(tmp_path / "pytorch_lora_weights.safetensors"), 1.0)
    assert not plan.unused and not plan.refused and len(plan.items) == len(mods)
    assert any(it.module.scale not in (1.0,) for it in plan.items)
    worst = 0.0
    for it in plan.items:
        t = it.target
        got = patched(m, t.weight_key).double() - base[t.weight_key].double()
        if t.rows is not None:
            got = got[t.rows[0]:t.rows[1]]
        ref = by_peft[it.name]
        worst = max(worst, (got - ref).abs().max().item() / ref.abs().max().item())
    assert worst <= 1e-5, worst
