"""The lab harness's two engines agree feature by feature (needs ComfyUI): what ``--engine ref`` installs from
ditkit's cores (``benchmarks/lab/lab_ref.py``) does what the ditkit NODES do on ComfyUI (``--engine comfy``).

Same prompt, seed, steps and guidance on both engines: the TeaCache calibration records the same (x, y) pairs,
and every ditkit feature row of the harness gives the same number of transformer passes and the same latents.
The mirrored node defaults of the ref engine equal the nodes' schema defaults.
"""
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

LAB = Path(__file__).resolve().parents[2] / "benchmarks" / "lab"
STEPS, PROMPT, SEED = 8, "blue square left", 3


@pytest.fixture(scope="module")
def harness(comfy):
    if str(LAB) not in sys.path:
        sys.path.insert(0, str(LAB))
    import harness as hz

    return hz


@pytest.fixture(scope="module")
def labs(harness, comfyui_path, monkeypatch_module):
    import folder_paths

    import lab_ref

    monkeypatch_module.setenv("COMFYUI_PATH", str(comfyui_path))
    out_dir = folder_paths.get_output_directory()
    feats = [f for f in harness.FEATURES if f.module.startswith("ditkit.")]
    clab = harness.make_lab("comfy", STEPS, harness.L.DIT_FILE, harness.L.VAE_FILE, harness.L.TEXT_FILE, 3.0)
    rlab = lab_ref.RefLab(STEPS, cfg=3.0)
    cfeats = [dataclasses.replace(f, overrides=dict(f.overrides)) for f in feats]
    rfeats = [dataclasses.replace(f, overrides=dict(f.overrides)) for f in feats]
    try:
        harness.attach_teacache_coefficients(clab, cfeats, harness.CALIB_PROMPTS[:2])
        harness.attach_teacache_coefficients(rlab, rfeats, harness.CALIB_PROMPTS[:2])
        yield clab, rlab, cfeats, rfeats
    finally:
        clab.close()
        rlab.close()
        folder_paths.set_output_directory(out_dir)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_mirrored_node_defaults(harness):
    import lab_ref

    tea, _ = harness.find_node("ditkit.nodes.teacache", "DitKitTeaCache")
    cal, _ = harness.find_node("ditkit.nodes.teacache", "DitKitTeaCacheCalibrate")
    vsa, _ = harness.find_node("ditkit.nodes.sparse_attention", "DitKitSparseAttention")
    d = harness.node_defaults(tea)
    assert {k: d[k] for k in lab_ref.TEACACHE_DEFAULTS} == lab_ref.TEACACHE_DEFAULTS
    assert harness.node_defaults(cal)["degree"] == lab_ref.CALIBRATE_DEFAULTS["degree"]
    d = harness.node_defaults(vsa)
    assert {k: d[k] for k in lab_ref.SPARSE_DEFAULTS} == lab_ref.SPARSE_DEFAULTS
    from ditkit.nodes import sparse_attention as sa

    assert sa.RECIPES == lab_ref.SPARSE_RECIPES


def _pairs(scratch: str) -> dict:
    """All recorded (x, y, step, sigma) pairs per stream, sorted (the condition column is a per-run index of
    first appearance, which depends on the cond/uncond call order: left out)."""
    out = {}
    for f in sorted((Path(scratch) / "ditkit" / "teacache" / "h3lab").glob("pairs_*.json")):
        for s, rows in json.loads(f.read_text())["pairs"].items():
            out.setdefault(s, []).extend(tuple(r[:4]) for r in rows)
    return {s: sorted(v, key=lambda r: (r[2], r[0])) for s, v in out.items()}


def test_calibration_records_the_same_pairs(labs):
    clab, rlab, cfeats, rfeats = labs
    pc, pr = _pairs(clab.scratch), _pairs(rlab.scratch)
    assert set(pc) == set(pr) == {"video", "audio"}
    for s in pc:
        assert len(pc[s]) == len(pr[s]) > 0, s
        a, b = torch.tensor(pc[s], dtype=torch.float64), torch.tensor(pr[s], dtype=torch.float64)
        assert torch.equal(a[:, 2], b[:, 2]) and torch.allclose(a[:, 3], b[:, 3], atol=1e-6), s
        assert torch.allclose(a[:, :2], b[:, :2], rtol=1e-3, atol=1e-5), (s, (a - b).abs().max())


@pytest.mark.parametrize("index", range(4))
def test_feature_rows_agree(labs, index):
    clab, rlab, cfeats, rfeats = labs
    cf, rf = cfeats[index], rfeats[index]
    assert cf.name == rf.name
    vc, ac, _, nc = clab.sample(clab.feature_model(cf, clab.dit), PROMPT, SEED)
    vr, ar, _, nr = rlab.sample(rlab.feature_model(rf, rlab.dit), PROMPT, SEED)
    exact_c, _, _, n_exact = clab.sample(clab.dit, PROMPT, SEED)
    err = max((vc - vr).abs().max().item(), (ac - ar).abs().max().item())
    moved = (vc - exact_c).abs().max().item()
    print(f"{cf.name}: passes comfy {nc} / ref {nr} (exact {n_exact}), max abs latent diff {err:.3g} "
          f"(feature vs exact path: {moved:.3g})")
    assert nc == nr
    assert err <= 1e-3
    assert nc < n_exact or moved > 1e-3, "the feature changed nothing: the comparison would be vacuous"
