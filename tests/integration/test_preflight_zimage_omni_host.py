"""DitKitPreflight on Z-Image omni editing in the real ComfyUI 0.33 host (in process, CPU): the rows it counts for
reference latents, their captions and SigLIP encodings equal the length of the sequence the host's own
``NextDiT`` feeds its main layers (read by a forward pre-hook on ``layers[0]``), on the tiny Z-Image checkpoint
(no SigLIP embedder) and on a NextDiT built with one (``siglip_feat_dim``, as ComfyUI's model detection sets it
for an omni checkpoint)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ditkit.tiny import ckpt_image


def forward_rows(dm, x, context, refs=(), ref_contexts=(), siglip=()) -> int:
    """The sequence length the host's NextDiT gives its first main layer."""
    seen = []
    h = dm.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            dm(x, torch.tensor([0.5] * x.shape[0]), context, context.shape[1], ref_latents=list(refs),
               ref_contexts=list(ref_contexts), siglip_feats=list(siglip), transformer_options={})
    finally:
        h.remove()
    return seen[0]


def test_omni_rows_equal_the_forward_on_the_tiny_checkpoint(zimage):
    from ditkit.nodes.preflight import DitKitPreflight

    dm = zimage.model.diffusion_model
    assert dm.siglip_embedder is None
    x, ctx = torch.zeros(1, 16, 20, 14), torch.zeros(1, 77, 1024)
    refs = [torch.zeros(1, 16, 16, 12), torch.zeros(1, 16, 8, 8)]
    rctx = [torch.zeros(1, 40, 1024), torch.zeros(1, 33, 1024), torch.zeros(1, 5, 1024)]   # one leftover caption
    for r, c in ((refs[:1], []), (refs, rctx[:1]), (refs, rctx)):
        cond = [[ctx, {"reference_latents": r, "reference_latents_text_embeds": c}]]
        out = DitKitPreflight.execute(zimage, {"samples": x}, limit_gib=1000.0, text_tokens=3, positive=cond)
        tok = out.ui["ditkit_report"][0]["data"]["tokens"]
        want = forward_rows(dm, x, ctx, r, c)
        assert tok["total"] == want and tok["refs"] > 0, (tok, want)
    # without references: the plain count, equal to the forward too
    out = DitKitPreflight.execute(zimage, {"samples": x}, limit_gib=1000.0, text_tokens=3, positive=[[ctx, {}]])
    assert out.ui["ditkit_report"][0]["data"]["tokens"]["total"] == forward_rows(dm, x, ctx)


def test_omni_rows_with_a_siglip_embedder_equal_the_forward(comfy):
    import comfy.ops

    from ditkit.bridge.preflight import zimage_conds
    from ditkit.memory.preflight import zimage_tokens
    from comfy.ldm.lumina.model import NextDiT

    c = ckpt_image.ZIMAGE
    torch.manual_seed(0)
    dm = NextDiT(patch_size=2, in_channels=16, dim=c["dim"], n_layers=1, n_refiner_layers=1, n_heads=c["dim"] // 128,
                 n_kv_heads=c["dim"] // 128, multiple_of=256, ffn_dim_multiplier=8.0 / 3.0, qk_norm=True,
                 cap_feat_dim=64, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0,
                 z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32, siglip_feat_dim=24,
                 operations=comfy.ops.disable_weight_init)
    for p in dm.parameters():
        p.data.normal_(0, 0.02)
    x, ctx = torch.zeros(1, 16, 18, 22), torch.zeros(1, 50, 64)
    cvo = lambda h, w: SimpleNamespace(image_sizes=[(3, h, w)])   # noqa: E731
    refs = [torch.zeros(1, 16, 12, 16), torch.zeros(1, 16, 6, 4)]
    rctx = [torch.zeros(1, 31, 64)]
    unclip = [{"clip_vision_output": cvo(16 * 9, 16 * 7)}]                  # 9 x 7 = 63 SigLIP rows, ref 0 only
    sig = [torch.zeros(1, 9, 7, 24)]
    d = zimage_conds([[ctx, {"reference_latents": refs, "reference_latents_text_embeds": rctx,
                             "unclip_conditioning": unclip}]], 3)[0]
    assert d["siglip"] == [63]
    t = zimage_tokens(tuple(x.shape), d["text"], 2, 32, d["refs"], d["ref_texts"], d["siglip"], siglip_model=True)
    assert t.total == forward_rows(dm, x, ctx, refs, rctx, sig)
    assert t.refs > 0 and t.text == 32 + 32 + 64     # ref 0's 31 -> 32, ref 1 none -> 32 pad, the target's 50 -> 64


def test_sampler_check_counts_the_references_it_gets(zimage):
    """The OUTER_SAMPLE check reads the sampler's converted conditioning: the same rows as the node, and refuses
    before any forward when they do not fit."""
    import comfy.patcher_extension as pe
    import nodes

    from ditkit.bridge.preflight import WRAPPER_KEY
    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.preflight import DitKitPreflight

    x = {"samples": torch.zeros(1, 16, 8, 8)}
    cond = [[torch.zeros(1, 77, 1024), {"reference_latents": [torch.zeros(1, 16, 16, 16)],
                                        "reference_latents_text_embeds": [torch.zeros(1, 40, 1024)]}]]
    out = DitKitPreflight.execute(zimage, x, limit_gib=1000.0, text_tokens=3, positive=cond)
    tok = out.ui["ditkit_report"][0]["data"]["tokens"]
    # target 4 x 4 = 16 -> 32, caption 77 -> 96; ref 8 x 8 = 64, its caption 40 -> 64
    assert tok == {"image": 32, "text": 96 + 64, "refs": 64, "total": 256}
    m = out.args[0]
    m.model_options["transformer_options"][WRAPPER_KEY]["limit_gib"] = 1e-6
    calls = []
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_count", lambda ex, *a, **k: calls.append(1) or ex(*a, **k))
    with pytest.raises(MemoryShortfallError, match=r"256 tokens \(image 32, text 160, refs 64\)"):
        nodes.common_ksampler(m, 3, 1, 1.0, "euler", "simple", cond, cond, x)
    assert not calls
