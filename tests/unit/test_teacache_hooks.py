"""TeaCache block hooks on small stand-in models (plain torch, no ComfyUI).

The stand-ins copy only the *interfaces* the hooks rely on (H3: ``blocks[i].norm1`` / ``adaln_proj`` and the
``double_block`` replace args; Z-Image: ``layers`` called as ``layer(x, mask, freqs, adaln_input, ...)``).
Oracles: the plain (unhooked) block loop, and the modulated input re-derived by hand.
"""
from __future__ import annotations

import torch

from ditkit.cache.coefficients import StreamCoefficients
from ditkit.bridge.blocks import (CALL_KEY, HOLDER_KEY, CallCtx, H3Adapter, HookedLayers, TeaCacheHolder,
                                diffusion_model_wrapper, make_block_replace)
from ditkit.cache.teacache import TeaCacheConfig, TeaCacheState

D = 8


class FakeAdaln(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 6 * D)

    def forward(self, t_emb):
        return self.linear(t_emb).chunk(6, dim=-1)


class FakeH3Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.RMSNorm(D)
        self.adaln_proj = FakeAdaln()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x, t_emb, mod_segments):
        shift, scale = self.adaln_proj(t_emb)[:2]
        h = self.norm1(x)
        for a, b, row in mod_segments:
            h[a:b] = h[a:b] * (1 + scale[row]) + shift[row]
        return x.add_(torch.tanh(self.lin(h)))  # in place, like H3's gated residual


class FakeH3(torch.nn.Module):
    def __init__(self, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([FakeH3Block() for _ in range(n)])

    def run(self, h, t_emb, segs, to):
        reps = to.get("patches_replace", {}).get("dit", {})
        for i, blk in enumerate(self.blocks):
            if ("double_block", i) in reps:
                def wrap(args, blk=blk):
                    return {"img": blk(args["img"], args["t_emb"], args["mod_segments"])}
                h = reps[("double_block", i)]({"img": h, "t_emb": t_emb, "mod_segments": segs, "transformer_options": to},
                                              {"original_block": wrap})["img"]
            else:
                h = blk(h, t_emb, segs)
        return h


def _holder(thr):
    sc = {s: StreamCoefficients(s, (1.0, 0.0), None) for s in ("video", "audio")}  # y = x
    st = TeaCacheState(TeaCacheConfig("h3", sc, {"video": thr, "audio": thr}))
    return TeaCacheHolder("h3", "teacache", state=st)


class _Exec:
    def __init__(self, fn, obj):
        self.fn = fn
        self.class_obj = obj

    def __call__(self, *a, **k):
        return self.fn(*a, **k)


def _setup(model, holder):
    n = len(model.blocks)
    reps = {("double_block", i): make_block_replace(i, n, "double_block", H3Adapter()) for i in range(n)}
    return {"patches_replace": {"dit": reps}, HOLDER_KEY: holder}


def _call(model, to, h, t_emb, segs, sigma, sample_sigmas):
    to = dict(to, sigmas=torch.tensor([sigma]), sample_sigmas=torch.tensor(sample_sigmas), uuids=["u"], cond_or_uncond=[0])
    return diffusion_model_wrapper(_Exec(lambda hh, te, sg, to_: model.run(hh, te, sg, to_), model), h, t_emb, segs, to)


SEGS = [(0, 3, 1), (3, 7, 2), (7, 15, 0)]  # text | audio | video (target audio then video last)


def test_modulated_input_matches_hand_formula():
    model = FakeH3()
    g = torch.Generator().manual_seed(1)
    h = torch.randn(15, D, generator=g)
    t_emb = torch.randn(3, 4, generator=g)
    ctx = CallCtx(None, model, ["u"], 0.5)
    mods = H3Adapter().modulated_inputs(model, {"img": h, "t_emb": t_emb, "mod_segments": SEGS}, 1, ctx)
    blk = model.blocks[0]
    shift, scale = blk.adaln_proj(t_emb)[:2]
    want_v = blk.norm1(h[7:15]) * (1 + scale[0]) + shift[0]
    want_a = blk.norm1(h[3:7]) * (1 + scale[2]) + shift[2]
    torch.testing.assert_close(mods["video"][0], want_v)
    torch.testing.assert_close(mods["audio"][0], want_a)


def test_threshold_zero_is_bit_identical_to_plain_loop():
    model = FakeH3()
    sig = [1.0, 0.75, 0.5, 0.25, 0.0]
    holder = _holder(0.0)
    holder.begin(sig)
    to = _setup(model, holder)
    g = torch.Generator().manual_seed(2)
    t_emb = torch.randn(3, 4, generator=g)
    for s in sig[:-1]:
        x = torch.randn(15, D, generator=g)
        with torch.no_grad():
            got = _call(model, to, x.clone(), t_emb * s, SEGS, s, sig)
            want = model.run(x.clone(), t_emb * s, SEGS, {})
        assert torch.equal(got, want)
    assert holder.state.report().skipped == 0


def test_skip_returns_input_plus_residual_of_last_computed_call():
    model = FakeH3()
    sig = [1.0, 0.75, 0.5, 0.25, 0.0]
    holder = _holder(1e9)  # skip whenever allowed
    holder.begin(sig)
    to = _setup(model, holder)
    g = torch.Generator().manual_seed(3)
    t_emb = torch.randn(3, 4, generator=g)
    x0 = torch.randn(15, D, generator=g)
    x1 = x0 + 0.01 * torch.randn(15, D, generator=g)
    with torch.no_grad():
        out0 = _call(model, to, x0.clone(), t_emb, SEGS, sig[0], sig)
        ref0 = model.run(x0.clone(), t_emb, SEGS, {})
        out1 = _call(model, to, x1.clone(), t_emb, SEGS, sig[1], sig)
    assert torch.equal(out0, ref0)
    torch.testing.assert_close(out1, x1 + (ref0 - x0))
    rep = holder.state.report()
    assert rep.skipped == 1 and rep.computed == 1 and rep.streams["audio"]["skipped"] == 1
    # the wrapper removed its per-call context
    assert CALL_KEY not in to


def test_calibration_mode_records_pairs_and_never_skips():
    from ditkit.cache.calibrate import CalibrationRecorder

    model = FakeH3()
    sig = [1.0, 0.75, 0.5, 0.25, 0.0]
    holder = TeaCacheHolder("h3", "calibrate", recorder=CalibrationRecorder("h3"))
    holder.begin(sig)
    to = _setup(model, holder)
    g = torch.Generator().manual_seed(4)
    t_emb = torch.randn(3, 4, generator=g)
    for s in sig[:-1]:
        x = torch.randn(15, D, generator=g)
        with torch.no_grad():
            got = _call(model, to, x.clone(), t_emb * s, SEGS, s, sig)
            assert torch.equal(got, model.run(x.clone(), t_emb * s, SEGS, {}))
    assert len(holder.recorder.pairs["video"]) == 3 and len(holder.recorder.pairs["audio"]) == 3


def test_chained_previous_replace_still_runs():
    model = FakeH3(n=2)
    seen = []

    def prev(args, extra):
        seen.append(1)
        return extra["original_block"](args)

    holder = _holder(0.0)
    sig = [1.0, 0.0]
    holder.begin(sig)
    reps = {("double_block", 0): make_block_replace(0, 2, "double_block", H3Adapter(), prev=prev),
            ("double_block", 1): make_block_replace(1, 2, "double_block", H3Adapter())}
    to = {"patches_replace": {"dit": reps}, HOLDER_KEY: holder}
    with torch.no_grad():
        _call(model, to, torch.randn(15, D), torch.randn(3, 4), SEGS, 1.0, sig)
    assert seen == [1]


class FakeZLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x, mask, freqs, adaln_input=None, timestep_zero_index=None, transformer_options={}):
        return x + self.lin(x)


def test_hooked_layers_keep_state_dict_and_route_calls():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([FakeZLayer() for _ in range(3)])
    calls = []

    def rep(args, extra):
        calls.append(args["transformer_options"].get("tag"))
        return extra["original_block"](args)

    hooked = HookedLayers(layers, [rep] * 3)
    assert list(hooked.state_dict()) == list(layers.state_dict())
    assert all(a is b for a, b in zip(hooked._modules.values(), layers._modules.values()))
    assert hooked[0] is layers[0] and len(hooked) == 3
    x = torch.randn(2, 5, D)
    y = x
    for layer in hooked:
        y = layer(y, None, None, None, timestep_zero_index=None, transformer_options={"tag": "t"})
    z = x
    for layer in layers:
        z = layer(z, None, None)
    assert torch.equal(y, z) and calls == ["t"] * 3
    # re-hooking an already hooked list wraps the original modules, not the call objects
    again = HookedLayers(hooked, [rep] * 3)
    assert all(a is b for a, b in zip(again._modules.values(), layers._modules.values()))
