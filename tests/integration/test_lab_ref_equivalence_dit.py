"""The pure-torch lab H3 DiT reference (``benchmarks.lab.lab_ref_dit``) and its sampler (``lab_ref_sample``) equal
ComfyUI's own ``MiniMaxH3Model`` / KSampler on the committed lab weights (the oracle is ComfyUI, in-process).

These tests are what lets the lab harness run its ``--engine ref`` (and the CI smoke) without ComfyUI.
"""
import pytest
import torch

from ditkit.loaders.safetensors_io import load_file
from benchmarks.lab import lab_data as D
from benchmarks.lab import lab_ref_dit as R
from benchmarks.lab import lab_ref_sample as S

FRAMES, H, W = 22, 64, 96  # the harness's clip size


@pytest.fixture(scope="module")
def models(comfy):
    import comfy.sd

    cm = comfy.sd.load_diffusion_model_state_dict(load_file(str(R.DIT_FILE)))
    ref = R.load_lab_dit()
    return cm, ref


def _inputs(seed, shape_v=(1, 24, 7, 4, 6), audio_t=37, text_dim=32):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape_v, generator=g)
    a = torch.randn(1, 32, 2, audio_t, generator=g)
    ctx = torch.randn(1, D.PROMPT_LEN, text_dim, generator=g)
    return v, a, ctx


def _maxdiff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("sigma,scale,shape_v,audio_t", [
    (0.7, 4.0, (1, 24, 7, 4, 6), 37),      # the lab latent, audio carried on the video schedule
    (1.0, 4.0, (1, 24, 7, 4, 6), 37),      # sigma 1: video and audio timesteps coincide (one t_emb row)
    (0.05, 1.0, (1, 24, 2, 5, 3), 3),      # odd latent h/w (padded to the 2x2 patch), no audio carry
])
def test_dit_forward_matches_comfyui(models, sigma, scale, shape_v, audio_t):
    cm, ref = models
    dm = cm.model.diffusion_model
    v, a, ctx = _inputs(1, shape_v, audio_t)
    t = torch.tensor([sigma * 1000.0])
    payload = {"audio_scale": scale}
    with torch.no_grad():
        want = dm([v.clone(), a.clone()], t, ctx.clone(), transformer_options={}, minimax_payload=payload)
        got = ref([v, a], t, ctx, transformer_options={}, minimax_payload=payload)
        # the refined context path (what sampling uses: refiner once per run) as well
        want_pre = dm([v.clone(), a.clone()], t, dm.preprocess_text_embeds(ctx.clone()), transformer_options={},
                      minimax_payload=payload)
        got_pre = ref([v, a], t, ref.preprocess_text_embeds(ctx), transformer_options={}, minimax_payload=payload)
    assert [w.shape for w in want] == [g.shape for g in got]
    err = max(_maxdiff(want, got), _maxdiff(want_pre, got_pre))
    scale_out = max(w.abs().max().item() for w in want)
    print(f"sigma {sigma}: max abs diff {err:.3g} (output max {scale_out:.3g})")
    assert scale_out > 1e-2  # a trained model: a non-trivial output
    assert err <= 1e-4


def test_hook_protocol_matches_comfyui(models):
    """Block replaces and the attention override are called the same way (same args, same number of calls) by
    both models, and pass-through hooks leave the output unchanged."""
    cm, ref = models
    dm = cm.model.diffusion_model
    v, a, ctx = _inputs(2)
    t = torch.tensor([400.0])

    def hooks(log):
        def override(func, q, k, v, heads, *args, **kw):
            log.append(("attn", tuple(q.shape), heads, kw.get("skip_reshape"), kw.get("mask")))
            return func(q, k, v, heads, *args, **kw)

        def replace(args, extra):
            log.append(("block", tuple(args["img"].shape), [tuple(s) if not torch.is_tensor(s[2]) else s
                                                            for s in args["mod_segments"]],
                        tuple(args["rope_freqs"].shape), tuple(args["t_emb"].shape)))
            return extra["original_block"](args)

        return {"optimized_attention_override": override,
                "patches_replace": {"dit": {("double_block", i): replace for i in range(len(dm.blocks))}}}

    log_c, log_r = [], []
    with torch.no_grad():
        ctx_c = dm.preprocess_text_embeds(ctx.clone())
        want = dm([v.clone(), a.clone()], t, ctx_c, transformer_options=hooks(log_c),
                  minimax_payload={"audio_scale": 4.0})
        got = ref([v, a], t, ref.preprocess_text_embeds(ctx), transformer_options=hooks(log_r),
                  minimax_payload={"audio_scale": 4.0})
    assert _maxdiff(want, got) <= 1e-4
    assert len(log_c) == 2 * len(dm.blocks)
    assert log_c == log_r


def test_sampler_matches_ksampler(models, comfy):
    import comfy.sample
    import comfy.samplers
    import nodes as comfy_nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    cm, ref = models
    steps, seed, cfg = 3, 1234, 3.0
    latent = EmptyMiniMaxH3LatentAV.execute(W, H, FRAMES).args[0]
    shapes = S.av_latent_shapes(W, H, FRAMES)
    assert [tuple(t.shape) for t in latent["samples"].unbind()] == [tuple(s) for s in shapes]
    # noise: the same seed gives the same noise
    noise_c = comfy.sample.prepare_noise(latent["samples"], seed).unbind()
    noise_r = S.prepare_noise(shapes, seed)
    assert all(torch.equal(x, y) for x, y in zip(noise_c, noise_r))
    # schedule
    ms = cm.get_model_object("model_sampling")
    sig_c = comfy.samplers.calculate_sigmas(ms, "simple", steps)
    sig_r = S.simple_sigmas(S.FlowSampling(), steps)
    assert torch.equal(sig_c.float(), sig_r), (sig_c, sig_r)
    assert S.FlowSampling().audio_scale == ms.audio_scale

    embed = R.load_text_embed()
    ctx = embed[D.tokenize("red circle right")][None].clone()
    null = torch.zeros(1, D.PROMPT_LEN, embed.shape[1])
    count = [0]
    hook = cm.model.diffusion_model.blocks[0].register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
    try:
        out = comfy_nodes.common_ksampler(cm, seed, steps, cfg, "euler", "simple", [[ctx, {}]], [[null, {}]], latent,
                                          denoise=1.0)[0]
    finally:
        hook.remove()
    vc, ac = out["samples"].unbind()
    res = S.sample(ref, ctx, null, seed, steps, cfg, shapes)
    assert res.calls == count[0] == steps * 2
    err_v = (vc - res.video).abs().max().item()
    err_a = (ac - res.audio).abs().max().item()
    print(f"KSampler vs ref sampler ({steps} steps, cfg {cfg}): video max abs {err_v:.3g}, audio max abs {err_a:.3g}; "
          f"latent max {vc.abs().max().item():.3g} / {ac.abs().max().item():.3g}")
    assert vc.abs().max().item() > 0.1 and ac.abs().max().item() > 0.1
    assert err_v <= 1e-3 and err_a <= 1e-3
