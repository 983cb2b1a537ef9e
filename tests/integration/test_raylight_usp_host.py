"""The tiny H3 end to end under a per-rank driver of Raylight's USP forward (gloo, 2 CPU processes, real 0.33 host).

Each rank samples the same tiny FastH3 model (a 4-head variant of the tiny H3: Ulysses needs the heads to divide
the ranks) with ``DitKitSparseAttention`` and ditkit's Raylight processor (``ditkit:vsa_h3``) installed as the Ray
node does, under a USP driver written here from Raylight's description (``../shared/reference/raylight.md``,
``diffusion_models/minimax/xdit_context_parallel.py`` at 55ea37bb); no Raylight, xFuser or yunchang code runs:

* the packed sequence, the rope table and the modulation segments are zero-padded to a multiple of the ranks and
  split into contiguous shards before the blocks (here: by an outer ``("double_block", i)`` replace, so ditkit's
  FastH3 gate replace runs on the rank's **shard**, as under Raylight), gathered after the last block;
* every DiT block's ``attn.forward`` is replaced: q, k, v of the shard -> the whole padded sequence for ``H/N``
  heads (written here with an all-gather: the oracle of yunchang's seq -> head all-to-all), the inner processor
  called as Raylight's dispatcher calls it, the heads gathered back to the rank's sequence shard.

The final latents must equal the single-process run (ditkit's attention override on the whole sequence) within
fp32 rounding; one of the three steps is dense (``end_percent``), so the processor's dense path on a padded
sequence is covered too. The ranks must agree bit for bit.

The same spawn runs TeaCache stacked on it (its run reports and the sparse attention's come from rank 0 alone,
with both ranks' figures), installed as ``DitKitRayTeaCache`` does on each actor (the block-0
decision on the shard through the rank reducer): every rank's decisions equal and equal to the single-process
``DitKitTeaCache``'s; a twin of each rank's state deciding alone (no reducer, same inputs) disagrees across the
ranks, which is what deadlocks Raylight without the reducer (the test can fail).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import types

import pytest
import torch

W, H, LENGTH, TEXT = 256, 256, 22, 11
STEPS, END = 3, 0.5          # the last step is dense (outside start/end percent)
BOUND = 2e-6                 # relative max error vs the single process (fp32 rounding): measured 1.6e-7; a dense
                             # step that attends the pad rows gives 1.3e-5


def _ckpt(path):
    from ditkit.loaders.safetensors_io import save_file
    from ditkit.tiny.ckpt_h3 import CONFIG, base_state_dict, fasth3_state_dict

    cfg = dict(CONFIG, num_attention_heads=4)
    save_file(fasth3_state_dict(base_state_dict(cfg), cfg), path)


def _import_host(comfyui_path):
    if comfyui_path not in sys.path:
        sys.path.insert(0, comfyui_path)
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_management  # noqa: F401


TEA = dict(coefficients="shipped:h3_tiny_calibrated", threshold=0.1, audio_threshold=0.1, start_percent=0.0,
           end_percent=1.0, cache_device="model", strict=False)
TEA_STEPS = 10


def _model(path, sp, teacache=False):
    from ditkit.nodes.h3_loaders import load_h3_model
    from ditkit.nodes.sparse_attention import DitKitSparseAttention
    from ditkit.nodes.teacache import DitKitTeaCache

    m = load_h3_model(path)[0]
    vsa = dict(recipe="custom", keep_percent=25.0, end_percent=END, backend="cpu_batched")
    if not sp:
        m = DitKitSparseAttention.execute(m, **vsa).args[0]
        return DitKitTeaCache.execute(model=m, **TEA).args[0] if teacache else m
    _stub_xfuser()
    from ditkit.nodes import raylight as ray_nodes      # the Ray nodes' per-actor patches, as @ray_patch runs them

    m = ray_nodes._sparse_patch(m, **vsa)
    return ray_nodes._teacache_patch(m, **TEA) if teacache else m


def _stub_xfuser():
    """xFuser's group accessors on an actor, stood in for: the Ulysses group is the world group, ring degree 1."""
    ps = types.SimpleNamespace(get_ulysses_parallel_group=lambda: None, get_ring_parallel_world_size=lambda: 1)
    for name in ("xfuser", "xfuser.core", "xfuser.core.distributed"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["xfuser.core.distributed.parallel_state"] = ps
    sys.modules["xfuser.core.distributed"].parallel_state = ps


def _log_decisions(log, twins=None):
    """Record every TeaCache decision (and, with ``twins``, the decision of a twin state with no reducer fed the
    same inputs: what this rank would decide alone)."""
    from ditkit.cache.teacache import TeaCacheState
    from ditkit.parallel.reduce import LOCAL

    orig = TeaCacheState.decide

    def decide(self, keys, sigma, mods, shapes=None, force=None):
        skip = orig(self, keys, sigma, mods, shapes, force)
        log.append(skip)
        if twins is not None:
            if id(self) not in twins:
                twins[id(self)] = (TeaCacheState(self.config, reducer=LOCAL), [])
                twins[id(self)][0].begin(self.sigmas)
            tw, tlog = twins[id(self)]
            tskip = orig(tw, keys, sigma, mods, shapes, force)
            tlog.append(tskip)
            if not tskip:
                z = [torch.zeros(len(keys), *sh) for sh in shapes]
                tw.store(keys, z, z)
        return skip
    TeaCacheState.decide = decide
    return orig


def _sample(model, steps=STEPS):
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from ditkit.tiny.ckpt_h3 import CONFIG

    latent = EmptyMiniMaxH3LatentAV.execute(W, H, LENGTH).result[0]
    cond = [[torch.randn(1, TEXT, CONFIG["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    r = nodes.common_ksampler(model, 7, steps, 1.0, "euler", "simple", cond, cond, latent)[0]
    return [t.clone() for t in r["samples"].unbind()]


def _counters(model):
    from ditkit.bridge.attention import HOLDER_KEY

    runs = []
    holder = model.model_options["transformer_options"][HOLDER_KEY]
    prev = holder.on_run_end

    def on_end(rt):
        runs.append(dict(rt.calls))
        if prev is not None:
            prev(rt)
    holder.on_run_end = on_end
    return runs


# ------------------------------------------------------------------------------------ the USP driver (test only)
def _pad_split(x, dim, rank, world):
    s = x.shape[dim]
    sp = -(-s // world) * world
    if sp > s:
        shape = list(x.shape)
        shape[dim] = sp - s
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    n = sp // world
    return x.narrow(dim, rank * n, n).contiguous()


def _local_segments(segments, s, rank, world):
    n = -(-s // world)
    lo, hi = rank * n, (rank + 1) * n
    out = []
    for a, b, row in segments:
        a2, b2 = max(a, lo), min(b, hi)
        if a2 < b2:
            out.append((a2 - lo, b2 - lo, row[a2 - a:b2 - a] if isinstance(row, torch.Tensor) else row))
    return out


def _gather(x, dim):
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _usp_attn_forward(self, x, rope_freqs=None, transformer_options={}):
    """The block's attention on a sequence shard, as Raylight's USP runs it (q/k norm + rope as the host does)."""
    import comfy.model_management
    import comfy.quant_ops
    import torch.distributed as dist

    from ditkit.bridge.raylight import OPTIONS_KEY

    s, heads, hd = x.shape[0], self.heads, self.head_dim
    q, k, v = self.qkv_proj(x).split(heads * hd, dim=-1)
    v = v.reshape(1, s, heads, hd).clone()
    q, k = q.reshape(1, s, heads, hd), k.reshape(1, s, heads, hd)
    qw = comfy.model_management.cast_to(self.q_norm.weight, device=x.device)
    kw = comfy.model_management.cast_to(self.k_norm.weight, device=x.device)
    comfy.quant_ops.ck.rms_rope_split_half_(q, k, rope_freqs, qw, kw, epsilon=self.q_norm.eps,
                                            rot_dim=rope_freqs.shape[-3] * 2)
    world, rank = dist.get_world_size(), dist.get_rank()
    hn = heads // world
    # seq -> head (oracle of yunchang's all_to_all_4D): the whole padded sequence, this rank's heads, BSHD
    qh, kh, vh = (_gather(t, 1)[:, :, rank * hn:(rank + 1) * hn] for t in (q, k, v))

    def dense(q_, k_, v_, **kw):
        o = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q_, k_, v_)),
                                                             scale=kw.get("softmax_scale"))
        return o.transpose(1, 2)
    proc = transformer_options[OPTIONS_KEY]
    out = proc(dense, qh, kh, vh, transformer_options=transformer_options, softmax_scale=hd ** -0.5,
               causal=False, group=None)
    assert out.shape == qh.shape
    full = _gather(out, 2)                                  # head -> seq: all heads, then this rank's rows
    out = full[:, rank * s:(rank + 1) * s]
    return self.out_proj(out.reshape(s, heads * hd))


def _install_usp(m, rank, world, seen):
    dm = m.model.diffusion_model
    for blk in dm.blocks:
        blk.attn.forward = types.MethodType(_usp_attn_forward, blk.attn)
    dit = m.model_options["transformer_options"].get("patches_replace", {}).get("dit", {})
    last = len(dm.blocks) - 1
    for i in range(last + 1):
        prev = dit.get(("double_block", i))

        def replace(args, extra, i=i, prev=prev):
            s = args["rope_freqs"].shape[1]                 # the loop passes the whole sequence's tables
            x = args["img"]
            if i == 0:
                assert x.shape[0] == s
                x = _pad_split(x, 0, rank, world)
                seen.append(s)
            args = dict(args, img=x, rope_freqs=_pad_split(args["rope_freqs"], 1, rank, world),
                        mod_segments=_local_segments(args["mod_segments"], s, rank, world))
            h = (prev(args, extra) if prev is not None else extra["original_block"](args))["img"]
            if i == last:
                h = _gather(h, 0)[:s]
            return {"img": h}
        m.set_model_patch_replace(replace, "dit", "double_block", i)


def _rank(rank, world, init, td, ckpt, comfyui_path):
    import torch.distributed as dist

    from ditkit.loaders.safetensors_io import save_file

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        _import_host(comfyui_path)
        m = _model(ckpt, True)
        runs, seen = _counters(m), []
        _install_usp(m, rank, world, seen)
        lat = _sample(m)
        c = runs[-1]
        out = {"video": lat[0], "audio": lat[1], "seq": torch.tensor(seen),
               "sparse": torch.tensor(c.get("sparse", 0)),
               "dense": torch.tensor(c.get("outside start/end percent", 0))}
        m = _model(ckpt, True, teacache=True)
        log, twins, sent = [], {}, []
        _log_decisions(log, twins)
        _install_usp(m, rank, world, [])
        from ditkit.bridge.reports import ReportTarget

        ReportTarget.send = lambda self, kind, summary, data=None: sent.append(   # what reaches a node's sink
            {"node": self.node_type, "kind": kind, "summary": summary, "data": data}) or {}
        lat = _sample(m, TEA_STEPS)
        out.update(tc_video=lat[0], tc_audio=lat[1], tc_dec=torch.tensor(log),
                   tc_alone=torch.tensor([d for _, tl in twins.values() for d in tl]),
                   reports=torch.tensor(list(json.dumps(sent, default=str).encode()), dtype=torch.uint8))
    except Exception:
        out = {"error": torch.tensor(list(traceback.format_exc().encode()), dtype=torch.uint8)}
    save_file({k: t.contiguous() for k, t in out.items()}, os.path.join(td, f"out{rank}.safetensors"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def usp(comfy, comfyui_path, tmp_path_factory):
    """One 2-rank spawn: the VSA run and the VSA + TeaCache run under the USP driver."""
    import torch.multiprocessing as mp

    from ditkit.loaders.safetensors_io import load_file

    torch.set_num_threads(1)
    ckpt = str(tmp_path_factory.mktemp("usp") / "h3_tiny_fasth3_4heads.safetensors")
    _ckpt(ckpt)
    world = 2
    td = str(tmp_path_factory.mktemp("usp_ranks"))
    mp.start_processes(_rank, args=(world, f"file://{td}/rendezvous", td, ckpt, str(comfyui_path)),
                       nprocs=world, join=True, start_method="spawn")
    outs = [load_file(os.path.join(td, f"out{r}.safetensors")) for r in range(world)]
    for o in outs:
        if "error" in o:
            raise AssertionError(bytes(o["error"].tolist()).decode())
    return types.SimpleNamespace(outs=outs, ckpt=ckpt, world=world)


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def test_tiny_h3_under_a_usp_driver_equals_the_single_process_run(usp):
    outs, world = usp.outs, usp.world
    m = _model(usp.ckpt, False)
    runs = _counters(m)
    ref = _sample(m)
    seq = outs[0]["seq"].tolist()
    assert len(seq) == STEPS and seq[0] % world == 1, f"the packed sequence ({seq}) must need padding on {world} ranks"
    for r, o in enumerate(outs):
        # 2 blocks x the sparse steps on every rank, and the dense step through the processor's dense path
        assert int(o["sparse"]) == 2 * (STEPS - 1) and int(o["dense"]) == 2, (r, o["sparse"], o["dense"])
        assert torch.equal(o["video"], outs[0]["video"]) and torch.equal(o["audio"], outs[0]["audio"])
    assert runs[-1]["sparse"] == 2 * (STEPS - 1)
    errs = [_rel(outs[0]["video"], ref[0]), _rel(outs[0]["audio"], ref[1])]
    assert max(errs) <= BOUND, f"USP x{world} vs one process: relative max error {errs}"


def test_ray_teacache_ranks_agree_and_equal_the_single_process_decisions(usp, monkeypatch):
    from ditkit.cache.teacache import TeaCacheState

    outs = usp.outs
    m = _model(usp.ckpt, False, teacache=True)
    log = []
    monkeypatch.setattr(TeaCacheState, "decide", TeaCacheState.decide)   # restored after the test
    _log_decisions(log)
    ref = _sample(m, TEA_STEPS)
    assert any(log) and not all(log), f"the single-process run must skip some calls and compute others: {log}"
    dec = [o["tc_dec"].tolist() for o in outs]
    assert dec[0] == dec[1], dec                            # strict: the ranks never disagree
    assert dec[0] == log, (dec[0], log)                     # and decide as one process does
    alone = [o["tc_alone"].tolist() for o in outs]
    assert alone[0] != alone[1], f"each rank deciding alone must disagree somewhere (the deadlock case): {alone}"
    for o in outs:
        assert torch.equal(o["tc_video"], outs[0]["tc_video"]) and torch.equal(o["tc_audio"], outs[0]["tc_audio"])
    errs = [_rel(outs[0]["tc_video"], ref[0]), _rel(outs[0]["tc_audio"], ref[1])]
    assert max(errs) <= BOUND, f"USP x2 + TeaCache vs one process: relative max error {errs}"


def test_ray_run_reports_come_from_rank_0_with_every_ranks_figures(usp):
    sent = [json.loads(bytes(o["reports"].tolist()).decode()) for o in usp.outs]
    assert sent[1] == [], "only rank 0 sends the nodes' run reports"
    by = {r["node"]: r for r in sent[0]}
    assert set(by) == {"DitKitSparseAttention", "DitKitTeaCache"} and len(sent[0]) == 2
    dec = usp.outs[0]["tc_dec"].tolist()
    tc = by["DitKitTeaCache"]["data"]["ranks"]
    assert tc["disagree"] == [] and len(tc["ranks"]) == 2
    assert all(f == {"calls": len(dec), "computed": dec.count(False), "skipped": dec.count(True)} for f in tc["ranks"])
    vsa = by["DitKitSparseAttention"]["data"]["ranks"]
    assert vsa["disagree"] == [] and vsa["ranks"][0]["sparse_calls"] > 0
    # every computed forward runs both blocks' attention, sparse or dense (end_percent): skipped ones none
    assert all(f["sparse_calls"] + f["dense_calls"] == 2 * dec.count(False) for f in vsa["ranks"])
    assert "2 ranks (rank 0: " in by["DitKitTeaCache"]["summary"] and "rank 1: " in by["DitKitTeaCache"]["summary"]
    assert "ranks agree on calls, computed, skipped" in by["DitKitTeaCache"]["summary"]
