"""DitKitSparseAttention in the real ComfyUI 0.33 host (in process, CPU) on the tiny FastH3 checkpoint.

Sampling with the node must equal an oracle-backed run (dense float64 SDPA with the equivalent token mask and
an independently computed tile selection) and differ from dense sampling only by that approximation.
"""
from __future__ import annotations

import logging
import math
import types

import pytest
import torch

W, H, LENGTH, TEXT = 256, 256, 22, 10           # -> video grid (7, 8, 8) = 8 cubes; audio 37 -> 74 rows
KEEP = 0.25


@pytest.fixture(scope="module")
def env(comfy, tmp_path_factory):
    import comfy.sd
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from ditkit.tiny.checkpoints import generate_all
    from ditkit.tiny.ckpt_h3 import CONFIG

    torch.set_num_threads(1)
    out = generate_all(tmp_path_factory.mktemp("vsa_ckpt"), only=["h3_dit_fasth3"])
    path = out["h3_dit_fasth3"][0]
    model = comfy.sd.load_diffusion_model(str(path))
    latent = EmptyMiniMaxH3LatentAV.execute(W, H, LENGTH).result[0]
    cond = [[torch.randn(1, TEXT, CONFIG["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    return types.SimpleNamespace(model=model, latent=latent, cond=cond, path=path)


def _sample(env, model, steps=2):
    import nodes

    r = nodes.common_ksampler(model, 7, steps, 1.0, "euler", "simple", env.cond, env.cond, env.latent)[0]
    return [t.clone() for t in r["samples"].unbind()]


def _tile_ids(prefix, grid):
    """Tile of each packed row, from the VSA-H3 definition (independent of ditkit.kernels)."""
    ids, n = [], 0
    for seg in prefix:
        ids += [n + j // 64 for j in range(seg)]
        n += math.ceil(seg / 64)
    t, h, w = grid
    nh, nw = math.ceil(h / 4), math.ceil(w / 4)
    ids += [n + (a // 4) * nh * nw + (b // 4) * nw + c // 4 for a in range(t) for b in range(h) for c in range(w)]
    return torch.tensor(ids), n, math.ceil(t / 4) * nh * nw


def _oracle_override(keep, prefix, grid, seen):
    tid, npre, nvid = _tile_ids(prefix, grid)
    S = tid.numel()
    T = npre + nvid
    onehot = torch.zeros(T, S, dtype=torch.float64)
    onehot[tid, torch.arange(S)] = 1.0
    onehot /= onehot.sum(1, keepdim=True)
    sparsity = (100 - keep * 100) / 100                   # FastVideo VSA_sparsity for the node's keep_percent
    k_vid = max(1, min(nvid, math.ceil((1 - sparsity) * nvid)))   # FastVideo compute_topk, unrounded

    def override(func, q, k, v, heads, *a, mask=None, skip_reshape=False, transformer_options=None, **kw):
        if q.shape[2] != S:
            return func(q, k, v, heads, *a, mask=mask, skip_reshape=skip_reshape,
                        transformer_options=transformer_options, **kw)
        seen["calls"] += 1
        qd, kd, vd = (x.double() for x in (q, k, v))
        sc = (onehot @ qd) @ (onehot @ kd).transpose(-1, -2) / math.sqrt(q.shape[-1])
        m = torch.zeros(sc.shape, dtype=torch.bool)
        # FastVideo's set (CUDA topk): the k largest, ties to the lowest index
        m.scatter_(-1, sc[..., npre:].sort(dim=-1, descending=True, stable=True).indices[..., :k_vid] + npre, True)
        m[..., :npre] = True
        m[:, :, :npre, :] = True
        out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=m[:, :, tid][:, :, :, tid])
        gate = (transformer_options or {}).get("ditkit_vsa_gate")
        if gate is not None:
            out = out + (torch.softmax(sc, -1) @ (onehot @ vd))[:, :, tid] * gate.double()
        B, Hh, _, D = out.shape
        return out.to(q.dtype).transpose(1, 2).reshape(B, S, Hh * D)

    return override


def _maxdiff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _triton_here(request) -> bool:
    """True when the Triton kernels can run in this process (GPU, or the CPU interpreter set up before triton
    was imported). Otherwise re-runs this very test in a fresh pytest process with TRITON_INTERPRET=1 and
    returns False (the caller then stops)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import _kernels_interp

    _kernels_interp.ensure_interpreted()
    why = _kernels_interp.interpreter_ok()
    if why is None:
        return True
    if "not installed" in why:
        pytest.skip(why)
    if os.environ.get("DITKIT_VSA_SUBPROCESS"):
        pytest.fail(f"triton interpreter unusable even in a fresh process: {why}")
    env = dict(os.environ, TRITON_INTERPRET="1", DITKIT_VSA_SUBPROCESS="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", request.node.nodeid],
                       cwd=str(Path(__file__).resolve().parents[2]), env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, f"fresh-process run failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    assert " passed" in r.stdout and " skipped" not in r.stdout, r.stdout[-2000:]
    return False


@pytest.mark.parametrize("with_gate,backend", [(False, "reference"), (True, "reference"), (False, "cpu_batched"),
                                               (True, "cpu_batched"), (True, "cpu_native"), (False, "triton")])
def test_sparse_sampling_equals_oracle(request, env, caplog, with_gate, backend):
    from ditkit.loaders.safetensors_io import load_file
    from ditkit.nodes.sparse_attention import GATE_ATTACHMENT, DitKitSparseAttention

    if backend == "triton" and not _triton_here(request):
        return  # verified in a fresh process above
    if backend == "cpu_native":
        from ditkit.kernels.block_sparse_cpu_native import load_extension

        try:
            load_extension()
        except RuntimeError as e:
            pytest.skip(f"cpu_native extension unavailable here: {e}")

    base = env.model
    if with_gate:
        base = env.model.clone()
        sd = load_file(env.path, keys=[f"blocks.{i}.attn.to_gate_compress.weight" for i in range(2)])
        base.set_attachments(GATE_ATTACHMENT, {i: sd[f"blocks.{i}.attn.to_gate_compress.weight"].float()
                                               for i in range(2)})
    before = repr(base.model_options)
    with caplog.at_level(logging.INFO, logger="ditkit"):
        sparse_model = DitKitSparseAttention.execute(base, recipe="custom", keep_percent=KEEP * 100,
                                                     backend=backend).result[0]
        assert repr(base.model_options) == before, "the input model must not change"
        dense = _sample(env, base)
        sparse = _sample(env, sparse_model)
    oracle_model = sparse_model.clone()
    seen = {"calls": 0}
    prefix, grid = (TEXT, 74), (7, 8, 8)
    oracle_model.model_options["transformer_options"]["optimized_attention_override"] = _oracle_override(
        KEEP, prefix, grid, seen)
    oracle = _sample(env, oracle_model)
    assert seen["calls"] == 2 * 2, "oracle must have handled every packed DiT attention call (2 blocks x 2 steps)"
    d_or = _maxdiff(sparse, oracle)
    d_dense = _maxdiff(oracle, dense)
    assert d_or < 1e-4, f"sparse vs oracle {d_or}"
    assert d_dense > 100 * max(d_or, 1e-7), f"sparse approximation too small to test (dense vs oracle {d_dense})"
    run = [r for r in caplog.records if "DitKitSparseAttention" in r.getMessage() and " run:" in r.getMessage()]
    assert run, "the run report must be logged"
    msg = run[-1].getMessage()
    assert f"backend {backend}" in msg and "steps sparse 2 / dense 0" in msg
    assert ("gate to_gate_compress (loader attachment)" in msg) == with_gate


def test_sigma_window_chaining_and_refiner(env, caplog):
    """start_percent makes early steps dense; those calls go to the override that was already installed."""
    from ditkit.nodes.sparse_attention import DitKitSparseAttention

    base = env.model.clone()
    calls = {"n": 0}

    def prior(func, *a, **kw):
        calls["n"] += 1
        return func(*a, **kw)

    base.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = prior
    with caplog.at_level(logging.INFO, logger="ditkit"):
        m = DitKitSparseAttention.execute(base, recipe="FastH3 8-step V2 (keep 20%)", start_percent=0.5,
                                          backend="auto").result[0]
        _sample(env, m, steps=4)
    msgs = [r.getMessage() for r in caplog.records if "DitKitSparseAttention" in r.getMessage()]
    assert any("chains previous attention override" in s for s in msgs)
    run = [s for s in msgs if " run:" in s][-1]
    import comfy.samplers

    ms = base.get_model_object("model_sampling")
    sig = comfy.samplers.calculate_sigmas(ms, "simple", 4)[:-1]
    n_dense = int((sig > ms.percent_to_sigma(0.5) + 1e-6).sum())
    assert 0 < n_dense < 4
    assert f"steps sparse {4 - n_dense} / dense {n_dense}" in run
    assert f"outside start/end percent: {2 * n_dense}" in run
    assert calls["n"] == 2 * n_dense, "dense calls must reach the previously installed override"


def test_runs_and_clones_do_not_share_counters(env, caplog, monkeypatch):
    """Each sampling run counts on its own clone of the installed runtime: a run of a clone of the same patched
    model that starts while the first run is in progress (its OUTER_SAMPLE wrappers entered from the first run's
    step callback; ComfyUI cannot run a whole nested sampling of one model) neither resets nor adds to the first
    run's counts, and neither run writes into the model's options."""
    import comfy.patcher_extension as pe
    import latent_preview

    from ditkit.nodes.sparse_attention import DitKitSparseAttention

    m = DitKitSparseAttention.execute(env.model, recipe="custom", keep_percent=KEEP * 100).result[0]
    other = m.clone()
    before = repr(m.model_options)

    class Executor:               # what ComfyUI hands an OUTER_SAMPLE wrapper: callable, with the guider
        def __init__(self, guider, body):
            self.class_obj, self.body = guider, body

        def __call__(self, *a, **kw):
            return self.body()

    def other_run():
        guider = types.SimpleNamespace(model_options=other.model_options)
        wrappers = pe.get_all_wrappers(pe.WrappersMP.OUTER_SAMPLE, {"wrappers": other.wrappers})
        assert wrappers, "the node installs an OUTER_SAMPLE wrapper"
        for w in wrappers:
            w(Executor(guider, lambda: None))

    state = {"nested": 0}

    def prepare_callback(model, steps, x0_output_dict=None):
        def callback(step, x0, x, total_steps):
            if not state["nested"]:
                state["nested"] += 1
                other_run()             # between the first run's two steps
        return callback

    monkeypatch.setattr(latent_preview, "prepare_callback", prepare_callback)
    with caplog.at_level(logging.INFO, logger="ditkit"):
        _sample(env, m)
    runs = [r.getMessage() for r in caplog.records
            if "DitKitSparseAttention" in r.getMessage() and " run:" in r.getMessage()]
    assert state["nested"] == 1 and len(runs) == 2, runs
    assert "steps sparse 0 / dense 0" in runs[0] and "attention calls sparse 0," in runs[0], runs[0]
    assert "steps sparse 2 / dense 0" in runs[1] and "attention calls sparse 4," in runs[1], runs[1]
    assert repr(m.model_options) == before, "a sampling run must not write into the model's options"


def test_refuses_non_h3_and_bad_backend(env):
    from ditkit.errors import BackendError, UnsupportedModelError
    from ditkit.nodes.sparse_attention import DitKitSparseAttention

    fake = types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=torch.nn.Linear(2, 2)))
    with pytest.raises(UnsupportedModelError, match="MiniMax H3"):
        DitKitSparseAttention.execute(fake)
    before = repr(env.model.model_options)
    with pytest.raises(BackendError, match="flashinfer"):
        DitKitSparseAttention.execute(env.model, backend="flashinfer")
    assert repr(env.model.model_options) == before
    once = DitKitSparseAttention.execute(env.model).result[0]
    with pytest.raises(BackendError, match="already has VSA-H3"):
        DitKitSparseAttention.execute(once)


def test_example_workflow_reports_backend(comfy_server):
    """The shipped API workflow samples H3 with the node on a real server; the run report names the backend."""
    import json

    from ditkit.run import REPO

    graph = json.loads((REPO / "example_workflows/api/h3_sparse_attention_tiny.json").read_text(encoding="utf-8"))
    entry = comfy_server.run(graph)
    assert entry["status"]["status_str"] == "success"
    log = comfy_server.log_text()
    runs = [ln for ln in log.splitlines() if "DitKitSparseAttention" in ln and " run: " in ln]
    assert runs, "no VSA-H3 run report in the server log"
    assert "VSA-H3 backend cpu_batched" in runs[-1] and "steps sparse 4 / dense 0" in runs[-1]
    installs = [ln for ln in log.splitlines() if "DitKitSparseAttention" in ln and " install: " in ln]
    assert installs and "keep 25%" in installs[-1]


def test_an_unverified_backend_is_explicit_only_and_reported(env, monkeypatch):
    """FlashInfer has never been run: auto never picks it, and an explicit choice is reported as UNVERIFIED at
    install and after the run (its capability check is mocked to pass; nothing is sampled with it)."""
    from ditkit.kernels import REGISTRY
    from ditkit.kernels.vsa_h3_runtime import VSAH3Config, VSAH3Runtime
    from ditkit.nodes import sparse_attention as sa

    impl = REGISTRY.ops["block_sparse_attn"].impls["flashinfer"]
    monkeypatch.setattr(impl, "check", lambda q, explicit: None)
    REGISTRY.clear_cache()
    try:
        auto = REGISTRY.resolve("block_sparse_attn", "cpu", torch.float32, 16)
        assert auto.backend != "flashinfer" and "never run" in dict(auto.rejected)["flashinfer"]
        out = sa.DitKitSparseAttention.execute(env.model, backend="flashinfer")
        rep = out.ui["ditkit_report"][0]
        assert "backend flashinfer (chosen explicitly, UNVERIFIED" in rep["summary"], rep["summary"]
        assert rep["data"]["backend_unverified"]
    finally:
        REGISTRY.clear_cache()
    rt = VSAH3Runtime(VSAH3Config(keep=KEEP, backend="flashinfer"))
    rt.backends["flashinfer"] += 2
    rt.calls["sparse"] += 2
    summary, data = sa._run_report(rt)
    assert "UNVERIFIED backend flashinfer" in summary and data["unverified_backends"]["flashinfer"]
    rt.backends.clear()
    rt.backends["cpu_batched"] += 2
    summary, data = sa._run_report(rt)
    assert "UNVERIFIED" not in summary and data["unverified_backends"] == {}
