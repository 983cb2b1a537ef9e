"""Optional (not in the default run): ditkit's processor behind Raylight's **real** xFuser Ulysses path and
inner-attention dispatcher, 2 gloo ranks on CPU, against single-process VSA-H3 (bit for bit).

Needs a Raylight checkout with the inner-attention registry (commit 55ea37bb or later) in ``DITKIT_RAYLIGHT_SRC`` and
a folder with ``xfuser==0.4.5``, ``distvae`` and ``yunchang`` (``pip install --target DIR --no-deps ...``) in
``DITKIT_RAYLIGHT_DEPS``; ``tools/raylight_real_check.sh`` prepares both and runs this file. Two CPU workarounds,
here only (``../shared/reference/raylight.md``): CUDA is reported available while xFuser's attention module is
imported (otherwise its attention class derives from ``object``), and the xFuser shim's process-group backend is
forced to ``gloo``. Raylight's own code runs unchanged: its xFuser shim, ``make_xfuser_attention``, the dispatcher
and the registry ditkit registers in.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_parallel_gloo import CASES, GRID, HEADS, _qkv, _run, _shard_rows, _single

SRC = os.environ.get("DITKIT_RAYLIGHT_SRC", "")
DEPS = os.environ.get("DITKIT_RAYLIGHT_DEPS", "")
HAS = bool(SRC and DEPS) and any(
    (Path(SRC) / p / "raylight" / "distributed_modules" / "inner_attention" / "dispatcher.py").is_file()
    for p in ("src", "."))
pytestmark = pytest.mark.skipif(not HAS, reason="optional: set DITKIT_RAYLIGHT_SRC (Raylight >= 55ea37bb) and "
                                                "DITKIT_RAYLIGHT_DEPS (xfuser 0.4.5, distvae, yunchang); see "
                                                "tools/raylight_real_check.sh")


def _raylight_attention(src, deps, world):
    root = str(Path(src) / "src") if (Path(src) / "src" / "raylight").is_dir() else str(src)
    sys.path[:0] = [deps, root]
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True          # workaround 1 (import time only)
    try:
        import raylight  # noqa: F401  (installs Raylight's minimal xFuser shim)
        from raylight.distributed_modules import attention as ra
    finally:
        torch.cuda.is_available = real
    sys.modules["xfuser.envs"].get_torch_distributed_backend = lambda: "gloo"   # workaround 2
    from xfuser.core.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(rank=dist.get_rank(), world_size=world, local_rank=dist.get_rank(), backend="gloo")
    initialize_model_parallel(sequence_parallel_degree=world, ulysses_degree=world, ring_degree=1)
    return ra.make_xfuser_attention("TORCH_MATH", False)


def _rank_real(rank, world, prefix, src, deps):
    from ditkit.bridge import raylight as rl
    from ditkit.bridge.attention import CTX_KEY, GATE_KEY, HOLDER_KEY, VSAHolder
    from ditkit.kernels.vsa_h3_runtime import VSAH3Config, VSAH3Runtime

    attn = _raylight_attention(src, deps, world)
    first = rl.register()
    again = rl.register()                           # a reload on the actor: guarded
    out = {"registered": torch.tensor([first.endswith(" registered"), again.endswith("already registered")])}
    proc = rl.VSAInnerAttention(gate_group=rl.LazyGroup(), ring_degree=rl.ring_degree)
    for i, (dtype, with_gate) in enumerate(CASES):
        q, k, v, gate = _qkv(prefix, dtype)
        shard = lambda t: _shard_rows(t.transpose(1, 2), rank, world).transpose(1, 2)   # noqa: E731  BHSD shard
        rt = VSAH3Runtime(VSAH3Config(keep=0.25, backend="cpu_batched"))
        to = {rl.OPTIONS_KEY: proc, HOLDER_KEY: VSAHolder(rt), CTX_KEY: rt.begin_forward(prefix, GRID, 0.5)}
        if with_gate:
            to[GATE_KEY] = shard(gate)
        o = attn(shard(q), shard(k), shard(v), HEADS, skip_reshape=True, skip_output_reshape=True,
                 transformer_options=to)                                     # [1, H, S_shard, D]
        parts = [torch.empty_like(o) for _ in range(world)]
        dist.all_gather(parts, o.contiguous())
        out[f"out{i}"] = torch.cat(parts, dim=2)[:, :, :q.shape[2]]
        out[f"sparse{i}"] = torch.tensor(rt.calls["sparse"])
    return out


def test_ditkit_processor_behind_raylights_real_dispatcher_is_bit_identical():
    prefix, world = (37, 10), 2                        # 303 tokens: one pad row on 2 ranks
    outs = _run(world, _rank_real, prefix, SRC, DEPS)
    for o in outs:
        assert o["registered"].tolist() == [True, True]
    for i, (dtype, with_gate) in enumerate(CASES):
        ref = _single(prefix, dtype, "cpu_batched", with_gate)
        for r, o in enumerate(outs):
            assert int(o[f"sparse{i}"]) == 1, "the dispatcher must hand the call to ditkit's processor"
            assert o[f"out{i}"].dtype == dtype
            assert torch.equal(o[f"out{i}"], ref), (r, dtype, with_gate, (o[f"out{i}"].float() - ref.float()).abs().max())
