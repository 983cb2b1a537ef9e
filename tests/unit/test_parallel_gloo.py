"""Sequence parallelism on CPU with gloo (real processes, real collectives): ditkit's VSA-H3 as a Raylight
inner-attention processor behind the Ulysses all-to-all, and TeaCache decisions through the rank reducer.

Oracles written here, independent of ``ditkit.parallel``: the sequence shard of a rank is rows
``[r·S/N, (r+1)·S/N)`` of the zero-padded sequence, and after the seq -> head exchange rank ``r`` holds heads
``[r·H/N, (r+1)·H/N)`` of the whole padded sequence (yunchang's ``all_to_all_4D`` layout); the single-process
result is VSA-H3 on the unsplit tensors, and the single-process TeaCache decision is the one of a state that
sees the whole sequence.
"""
from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from ditkit.bridge.attention import CTX_KEY, GATE_KEY, HOLDER_KEY, VSAHolder
from ditkit.bridge.raylight import VSAInnerAttention
from ditkit.cache.coefficients import StreamCoefficients
from ditkit.cache.teacache import TeaCacheConfig, TeaCacheState
from ditkit.errors import BackendError, DitKitError
from ditkit.kernels.vsa_h3_runtime import VSAH3Config, VSAH3Runtime
from ditkit.parallel import ulysses
from ditkit.parallel.reduce import LOCAL, DistReducer

HEADS, HEAD_DIM, GRID = 6, 16, (4, 8, 8)   # 6 heads: divisible by 2 and 3 ranks; 256 video tokens (4 tiles)


def _run(world: int, fn, *args):
    """Spawn ``world`` gloo ranks running ``fn(rank, world, *args)``; each returns a dict saved to a file."""
    with tempfile.TemporaryDirectory() as td:
        init = f"file://{td}/rendezvous"
        mp.start_processes(_entry, args=(world, init, td, fn, args), nprocs=world, join=True, start_method="spawn")
        outs = [load_file(os.path.join(td, f"out{r}.safetensors")) for r in range(world)]
    for o in outs:
        if "error" in o:
            raise AssertionError(bytes(o["error"].tolist()).decode())
    return outs


def _entry(rank, world, init, td, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args)
    except Exception:
        out = {"error": torch.tensor(list(traceback.format_exc().encode()), dtype=torch.uint8)}
    save_file({k: t.contiguous() for k, t in out.items()}, os.path.join(td, f"out{rank}.safetensors"))
    dist.destroy_process_group()


def _qkv(prefix, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = sum(prefix) + GRID[0] * GRID[1] * GRID[2]
    q, k, v, gate = (torch.randn(1, HEADS, s, HEAD_DIM, generator=g).to(dtype) for _ in range(4))
    return q, k, v, gate.sigmoid()


def _runtime(backend):
    return VSAH3Runtime(VSAH3Config(keep=0.25, backend=backend))


def _single(prefix, dtype, backend, with_gate):
    q, k, v, gate = _qkv(prefix, dtype)
    rt = _runtime(backend)
    ctx = rt.begin_forward(prefix, GRID, 0.5)
    return rt.attention(q, k, v, ctx, gate=gate if with_gate else None)     # [1, H, S, D]


def _shard_rows(x_bshd, rank, world):
    """Rows of rank ``rank`` of the zero-padded sequence (the oracle of Raylight's split)."""
    s = x_bshd.shape[1]
    sp = -(-s // world) * world
    pad = torch.cat([x_bshd, x_bshd.new_zeros(x_bshd.shape[0], sp - s, *x_bshd.shape[2:])], dim=1)
    n = sp // world
    return pad[:, rank * n:(rank + 1) * n].contiguous()


def _vsa_rank(rank, world, prefix, dtype, backend, with_gate):
    q, k, v, gate = _qkv(prefix, dtype)
    to_bshd = lambda t: t.transpose(1, 2)  # noqa: E731
    shards = [_shard_rows(to_bshd(t), rank, world) for t in (q, k, v)]
    heads = [ulysses.seq_to_head(t) for t in shards]                      # [1, S_pad, H/N, D]
    hn = HEADS // world
    # oracle: rank r holds heads [r*H/N, (r+1)*H/N) of the whole padded sequence
    oracle = _shard_rows(to_bshd(q), 0, 1)
    sp = ulysses.padded_len(q.shape[2], world)
    oracle = torch.cat([oracle, oracle.new_zeros(1, sp - q.shape[2], HEADS, HEAD_DIM)], 1)[:, :, rank * hn:(rank + 1) * hn]
    exchange_exact = torch.equal(heads[0], oracle)
    rt = _runtime(backend)
    holder = VSAHolder(rt)
    ctx = rt.begin_forward(prefix, GRID, 0.5)
    to = {HOLDER_KEY: holder, CTX_KEY: ctx}
    if with_gate:  # the block replace makes the gate on this rank's sequence shard, [1, H, S_shard, D]
        to[GATE_KEY] = _shard_rows(to_bshd(gate), rank, world).transpose(1, 2)
    dense_calls = []
    out = VSAInnerAttention()(lambda *a, **kw: dense_calls.append(1), *heads, transformer_options=to)
    back = ulysses.head_to_seq(out)                                       # [1, S_pad/N, H, D]
    gathered = [torch.empty_like(back) for _ in range(world)]
    dist.all_gather(gathered, back)
    full = torch.cat(gathered, dim=1)[:, :q.shape[2]].transpose(1, 2)     # [1, H, S, D]
    return {"out": full, "exchange_exact": torch.tensor(exchange_exact), "dense": torch.tensor(len(dense_calls)),
            "sparse_calls": torch.tensor(rt.calls["sparse"])}


CASES = [(dt, g) for dt in (torch.float32, torch.bfloat16) for g in (False, True)]


def _vsa_all(rank, world, prefix):
    out = {}
    for i, (dt, g) in enumerate(CASES):   # one spawn per world size: the process start dominates on CPU
        out.update({f"{k}{i}": t for k, t in _vsa_rank(rank, world, prefix, dt, "cpu_batched", g).items()})
    return out


@pytest.mark.parametrize("world,prefix", [(2, (37, 10)), (3, (37, 11))], ids=["2ranks-pad1", "3ranks-pad2"])
def test_ulysses_vsa_processor_is_bit_identical_to_single_process(world, prefix):
    """fp32 and bf16, with and without the FastH3 gate; padding needed in every case (303 tokens on 2 ranks, 304
    on 3); the gate crosses the same all-to-all as q."""
    assert (sum(prefix) + 256) % world
    outs = _run(world, _vsa_all, prefix)
    for i, (dtype, with_gate) in enumerate(CASES):
        ref = _single(prefix, dtype, "cpu_batched", with_gate)
        for r, o in enumerate(outs):
            assert bool(o[f"exchange_exact{i}"]), f"rank {r}: seq->head exchange differs from the yunchang layout"
            assert int(o[f"dense{i}"]) == 0 and int(o[f"sparse_calls{i}"]) == 1
            got = o[f"out{i}"]
            assert got.dtype == dtype
            assert torch.equal(got, ref), (r, dtype, with_gate, (got.float() - ref.float()).abs().max())


def test_processor_refuses_ring_attention_by_name():
    with pytest.raises(BackendError, match="ring degree 2.*Ulysses"):
        VSAInnerAttention(ring_degree=lambda: 2)(None, None, None, None, transformer_options={})


def test_processor_counts_calls_it_cannot_take_and_runs_them_dense():
    rt = _runtime("reference")
    holder = VSAHolder(rt)
    ctx = rt.begin_forward((37, 10), GRID, 0.5)
    q = torch.zeros(1, 200, 3, HEAD_DIM)   # shorter than the layout: the token refiner's call
    ran = []
    out = VSAInnerAttention()(lambda *a, **kw: ran.append(kw) or "dense", q, q, q,
                              transformer_options={HOLDER_KEY: holder, CTX_KEY: ctx}, softmax_scale=0.25)
    assert out == "dense" and ran == [{"softmax_scale": 0.25}]
    assert rt.calls["token refiner / non-packed"] == 1 and not rt.steps_dense
    assert VSAInnerAttention()(lambda *a, **kw: "dense", q, q, q, transformer_options={}) == "dense"


def _heads_body(rank, world):
    try:
        ulysses.seq_to_head(torch.zeros(1, 4, 3, 2))
    except DitKitError as e:
        return {"msg_ok": torch.tensor("3 attention heads cannot be split over 2" in str(e))}
    return {"msg_ok": torch.tensor(False)}


def _tc_both(rank, world):
    return {"synced": _tc_rank(rank, world, True)["dec"], "unsynced": _tc_rank(rank, world, False)["dec"],
            **_heads_body(rank, world)}


def test_ulysses_refuses_heads_that_do_not_divide_the_ranks(tc_runs):
    assert all(bool(o["msg_ok"]) for o in tc_runs)


@pytest.mark.parametrize("s,world,expect", [(303, 2, [152, 151]), (304, 3, [102, 102, 100]), (4, 3, [2, 2, 0]),
                                            (6, 3, [2, 2, 2]), (0, 2, [0, 0])])
def test_padded_len_and_valid_rows(s, world, expect):
    assert ulysses.padded_len(s, world) == -(-s // world) * world
    assert [ulysses.valid_rows(s, r, world) for r in range(world)] == expect
    assert sum(expect) == s


def test_padded_len_refuses_bad_sizes():
    with pytest.raises(DitKitError):
        ulysses.padded_len(-1, 2)
    with pytest.raises(DitKitError):
        ulysses.padded_len(4, 0)


# ----------------------------------------------------------------------------------------------------- TeaCache
STEPS = [1.0 - i / 9 for i in range(10)]
SEQ = 101            # video tokens, padded to 102 on 2 ranks


def _mods(step):
    """Modulated inputs whose change is concentrated on one half of the sequence in some steps, so that a shard's
    own metric disagrees with the other shard's (the deadlock case) while the global metric is in between."""
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(SEQ, 8, generator=g)
    x = base.clone()
    for i in range(step + 1):
        h = torch.Generator().manual_seed(99 + i)
        amp = 0.15 if i % 2 else 0.02
        lo, hi = (0, SEQ // 2) if i % 3 else (SEQ // 2, SEQ)
        x[lo:hi] += amp * torch.randn(hi - lo, 8, generator=h)
    return x


def _state(reducer):
    sc = StreamCoefficients("video", (1.0, 0.0))   # rescale = identity: the threshold is on the raw change
    st = TeaCacheState(TeaCacheConfig("h3", {"video": sc}, {"video": 0.06}), reducer=reducer)
    st.begin(STEPS)
    return st


def _decisions(state, shard_fn):
    out = []
    for i, sig in enumerate(STEPS):
        cur = shard_fn(_mods(i))
        skip = state.decide(["c"], sig, {"video": [cur]})
        if not skip:
            state.store(["c"], [cur], [cur + 1])
        out.append(skip)
    return out


def _tc_rank(rank, world, synced):
    reducer = DistReducer(seq_len=SEQ) if synced else LOCAL
    st = _state(reducer)
    dec = _decisions(st, lambda x: _shard_rows(x[None, :, None], rank, world)[0, :, 0])
    return {"dec": torch.tensor(dec)}


@pytest.fixture(scope="module")
def tc_runs():
    """One 2-rank spawn for the TeaCache runs (synced and unsynced) and the head-count refusal."""
    return _run(2, _tc_both)


def test_teacache_ranks_agree_and_equal_the_single_process_decisions(tc_runs):
    single = _decisions(_state(LOCAL), lambda x: x)
    assert any(single) and not all(single)
    outs = [o["synced"].tolist() for o in tc_runs]
    assert outs[0] == outs[1], outs                      # strict: the ranks never disagree
    assert outs[0] == single, (outs[0], single)          # and equal the single-process choice


def test_teacache_without_the_reducer_diverges(tc_runs):
    """The same run with each rank deciding on its own shard: the ranks disagree (what deadlocks Raylight), so
    the agreement test above can fail."""
    outs = [o["unsynced"].tolist() for o in tc_runs]
    assert outs[0] != outs[1], outs


def test_reduced_metric_equals_the_single_process_relative_l1_within_rounding():
    from ditkit.cache.teacache import rel_l1

    a, b = _mods(3), _mods(2)
    st = TeaCacheState(TeaCacheConfig("h3", {"video": StreamCoefficients("video", (1.0, 0.0))}, {"video": 1.0}))

    class _Pad(type(LOCAL)):
        distributed = True

        def valid(self, x, dim=0):
            return x[:SEQ]
    st.reducer = _Pad()
    conds = [type("C", (), {"prev": {"video": torch.cat([b, torch.zeros(1, 8)])}})()]
    got = st._reduced_changes(conds, {"video": [torch.cat([a, torch.full((1, 8), 9.0)])]})  # the pad row excluded
    assert got[(0, "video")] == pytest.approx(rel_l1(a, b), rel=1e-6)


def test_processor_dense_step_excludes_raylight_pad_rows():
    """A dense step (outside start/end percent) of a padded packed forward: the dense attention gets the layout's
    rows only (Raylight's pad rows would be attended as keys), the output is padded back with zero rows."""
    rt = VSAH3Runtime(VSAH3Config(keep=0.25, backend="reference", sigma_start=0.9, sigma_end=0.1))
    ctx = rt.begin_forward((37, 10), GRID, 0.95)
    assert not ctx.sparse
    n = ctx.layout.seq_len
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 3, n + 2, HEAD_DIM, generator=g).transpose(1, 2) for _ in range(3))  # BSHD views
    seen = []

    def dense(q_, k_, v_, **kw):
        seen.append((q_.shape[1], k_.shape[1], v_.shape[1], kw))
        return q_ * 2
    out = VSAInnerAttention()(dense, q, k, v, transformer_options={HOLDER_KEY: VSAHolder(rt), CTX_KEY: ctx},
                              causal=False)
    assert seen == [(n, n, n, {"causal": False})]
    assert out.shape == q.shape and torch.equal(out[:, :n], q[:, :n] * 2)
    assert torch.equal(out[:, n:], torch.zeros_like(out[:, n:]))
    assert rt.calls[ctx.reason] == 1 and rt.steps_dense
    exact = VSAInnerAttention()(dense, q[:, :n], k[:, :n], v[:, :n],
                                transformer_options={HOLDER_KEY: VSAHolder(rt), CTX_KEY: ctx})
    assert exact.shape[1] == n                                          # unpadded: as is, no zero rows added


# ------------------------------------------------------------------------------ TeaCache on Raylight's shards
def test_lazy_group_resolves_once_and_resolve_group_passes_plain_groups():
    from ditkit.parallel.reduce import LazyGroup, resolve_group

    calls = []
    g = LazyGroup(lambda: calls.append(1) or "ulysses")
    assert resolve_group(g) == "ulysses" and resolve_group(g) == "ulysses" and calls == [1]
    assert resolve_group(None) is None and resolve_group("world") == "world"


@pytest.mark.parametrize("rank,span,expect", [(0, (250, 303), (152, 152)), (1, (250, 303), (98, 151)),
                                              (0, (0, 152), (0, 152)), (1, (0, 152), (0, 0)),
                                              (0, (151, 153), (151, 152)), (1, (151, 153), (0, 1))])
def test_shard_plan_places_global_rows_on_the_shard(rank, span, expect):
    from ditkit.bridge.raylight import ShardPlan

    plan = ShardPlan(303, {}, rank, 2)       # 303 tokens on 2 ranks: shards of 152, one pad row on rank 1
    assert plan.shard == 152 and plan.local(*span) == expect


def _fake_block(hidden, rows):
    g = torch.Generator().manual_seed(5)
    mods = tuple(torch.randn(rows, hidden, generator=g) for _ in range(6))
    return type("Blk", (), {"adaln_proj": staticmethod(lambda t: mods),
                            "norm1": staticmethod(lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))})()


def test_sharded_h3_adapter_covers_the_streams_exactly_once_without_pad_rows():
    """The ranks' stream rows put together are the whole streams, modulated as one process does (oracle: the
    modulation formula of H3's block on the unsplit rows); pad rows never enter."""
    from ditkit.bridge.blocks import CallCtx
    from ditkit.bridge.raylight import SHARD_KEY, ShardPlan, ShardedH3Adapter

    s, hidden, world = 45, 8, 2                  # text 0..10, audio 10..21 (row 2), video 21..45 (row 0)
    segs = [(0, 10, 1), (10, 21, 2), (21, 45, 0)]
    blk = _fake_block(hidden, 3)
    h = torch.randn(s, hidden, generator=torch.Generator().manual_seed(6))
    shift, scale = blk.adaln_proj(None)[:2]

    def oracle(a, b, row):
        x = blk.norm1(h[a:b])
        return x * (1 + scale[row]) + shift[row]
    got = {"video": [], "audio": []}
    for r in range(world):
        shard = _shard_rows(h[None, :, None], r, world)[0, :, 0]
        lo = r * shard.shape[0]
        local = [(max(a, lo) - lo, min(b, lo + shard.shape[0]) - lo, row) for a, b, row in segs
                 if max(a, lo) < min(b, lo + shard.shape[0])]
        plan = ShardPlan(s, {"video": (21, 45), "audio": (10, 21)}, r, world)
        ctx = CallCtx(None, None, ["c"], 0.5, meta={"expect_rows": (24, 11)})
        args = {"img": shard, "t_emb": None, "mod_segments": local, "transformer_options": {SHARD_KEY: plan}}
        out = ShardedH3Adapter().modulated_inputs(type("M", (), {"blocks": [blk]})(), args, 1, ctx)
        for k in got:
            got[k].append(out[k][0])
    assert torch.allclose(torch.cat(got["video"]), oracle(21, 45, 0), atol=1e-6)
    assert torch.allclose(torch.cat(got["audio"]), oracle(10, 21, 2), atol=1e-6)
    assert got["audio"][1].shape == (0, hidden)        # rank 1 holds no audio row: an empty part, not a pad row


def test_sharded_h3_adapter_refuses_a_forward_without_plan_or_with_other_rows():
    from ditkit.bridge.blocks import CallCtx
    from ditkit.bridge.raylight import SHARD_KEY, ShardPlan, ShardedH3Adapter

    ctx = CallCtx(None, None, ["c"], 0.5, meta={"expect_rows": (24, 12)})
    with pytest.raises(BackendError, match="no shard plan"):
        ShardedH3Adapter().prepare(None, {"transformer_options": {}}, ctx)
    plan = ShardPlan(45, {"video": (21, 45), "audio": (10, 21)}, 0, 2)
    with pytest.raises(RuntimeError, match=r"\(24, 11\) rows .* imply \(24, 12\)"):
        ShardedH3Adapter().prepare(None, {"transformer_options": {SHARD_KEY: plan}}, ctx)


def test_shard_plan_wrapper_leaves_other_models_alone():
    from ditkit.bridge.raylight import shard_plan_wrapper

    ex = lambda *a, **kw: ("ran", a, kw)   # noqa: E731
    assert shard_plan_wrapper(ex, 1, 2, 3, {}, k=1) == ("ran", (1, 2, 3, {}), {"k": 1})


# --------------------------------------------------------------------------------------------- rank-0 reports
def test_ranks_report_names_what_the_ranks_disagree_on():
    from ditkit.parallel.reduce import RanksReport

    ok = RanksReport([{"computed": 3, "skipped": 2}, {"computed": 3, "skipped": 2}], ("computed", "skipped"))
    assert ok.disagree == [] and ok.as_dict() == {"ranks": ok.ranks, "disagree": []}
    assert ok.summary() == ("2 ranks (rank 0: computed: 3, skipped: 2; rank 1: computed: 3, skipped: 2); ranks agree "
                            "on computed, skipped")
    bad = RanksReport([{"computed": 3, "skipped": 2}, {"computed": 4, "skipped": 2}], ("computed", "skipped"))
    assert bad.disagree == ["computed"] and "WARNING: the ranks disagree on computed" in bad.summary()
    assert "agree" not in RanksReport([{"a": 1}]).summary()


def test_figures_of_the_ray_reports():
    from ditkit.bridge.raylight import teacache_figures, vsa_figures

    assert vsa_figures({"calls": {"sparse": 4, "outside start/end percent": 2, "token refiner / non-packed": 1},
                        "steps_sparse": 2, "steps_dense": 1, "measured_density": 0.25}) == {
        "steps_sparse": 2, "steps_dense": 1, "sparse_calls": 4, "dense_calls": 3, "density": 0.25}
    assert teacache_figures({"calls": 5, "computed": 3, "skipped": 2, "streams": {}}) == {
        "calls": 5, "computed": 3, "skipped": 2}


def test_rank_target_sends_once_from_rank_0_with_the_gathered_figures(tmp_path):
    from ditkit.bridge.raylight import RankTarget
    from ditkit.parallel.reduce import gather_objects
    from ditkit.report import Report

    class Sink:
        sent = []

        def send(self, kind, summary, data=None):
            self.sent.append((kind, summary, data))
            return {"ok": 1}

    class Rep(Report):
        def as_dict(self):
            return {"computed": 1}

        def summary(self):
            return "one computed"

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rv", rank=0, world_size=1)
    try:
        assert gather_objects({"x": 1}) == [{"x": 1}]
        t = RankTarget(Sink(), lambda d: {"computed": d["computed"]}, ("computed",))
        assert t.send("teacache", Rep(), {"extra": 2}) == {"ok": 1}
    finally:
        dist.destroy_process_group()
    kind, summary, data = Sink.sent[0]
    assert kind == "teacache" and summary == "one computed | 1 ranks (rank 0: computed: 1); ranks agree on computed"
    assert data == {"computed": 1, "extra": 2, "ranks": {"ranks": [{"computed": 1}], "disagree": []}}


def test_reports_from_rank0_swap_the_sinks_for_rank_targets():
    import functools
    import types

    from ditkit.bridge.attention import HOLDER_KEY as VSA_KEY
    from ditkit.bridge.blocks import HOLDER_KEY as TC_KEY
    from ditkit.bridge.raylight import (RankTarget, teacache_figures, teacache_reports_from_rank0, vsa_figures,
                                        vsa_reports_from_rank0)

    def send_run_report(target, rt):
        return target, rt
    target = object()
    vsa = types.SimpleNamespace(on_run_end=functools.partial(send_run_report, target))
    tc = types.SimpleNamespace(info={"report_to": target})
    m = types.SimpleNamespace(model_options={"transformer_options": {VSA_KEY: vsa, TC_KEY: tc}})
    vsa_reports_from_rank0(m)
    teacache_reports_from_rank0(m)
    rt_target, rt = vsa.on_run_end("runtime")
    assert rt == "runtime" and isinstance(rt_target, RankTarget) and rt_target.target is target
    assert rt_target.figures is vsa_figures and "sparse_calls" in rt_target.must_agree
    t = tc.info["report_to"]
    assert isinstance(t, RankTarget) and t.target is target and t.figures is teacache_figures
    assert t.must_agree == ("calls", "computed", "skipped")
