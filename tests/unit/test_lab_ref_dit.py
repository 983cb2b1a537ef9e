"""Lab H3 DiT reference (no ComfyUI): strict loading errors name the bad key; hook protocol plumbing; sampler basics.
Numerical equality with ComfyUI is the host test ``tests/integration/test_lab_ref_equivalence_dit.py``."""
import pytest
import torch

from ditkit.errors import CheckpointError
from ditkit.loaders.safetensors_io import load_file, save_file
from benchmarks.lab import lab_ref_dit as R
from benchmarks.lab import lab_ref_sample as S


@pytest.fixture(scope="module")
def sd():
    return load_file(str(R.DIT_FILE))


@pytest.fixture(scope="module")
def dit():
    return R.load_lab_dit()


def _write(tmp_path, sd):
    p = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(p))
    return p


def test_missing_key_is_named(tmp_path, sd):
    bad = dict(sd)
    del bad["blocks.2.attn.q_norm.weight"]
    with pytest.raises(CheckpointError, match=r"missing keys \['blocks\.2\.attn\.q_norm\.weight'\]"):
        R.load_lab_dit(_write(tmp_path, bad))


def test_unexpected_key_is_named(tmp_path, sd):
    bad = dict(sd, **{"blocks.0.attn.to_gate_compress.weight": torch.zeros(128, 96)})
    with pytest.raises(CheckpointError, match=r"unexpected keys \['blocks\.0\.attn\.to_gate_compress\.weight'\]"):
        R.load_lab_dit(_write(tmp_path, bad))


def test_bad_shape_is_named(tmp_path, sd):
    bad = dict(sd, **{"final_layer.audio_out.weight": torch.zeros(16, 96)})
    with pytest.raises(CheckpointError, match=r"'final_layer\.audio_out\.weight' has shape \(16, 96\).*\(32, 96\)"):
        R.load_lab_dit(_write(tmp_path, bad))


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="do not exist"):
        R.load_lab_dit(tmp_path / "nope.safetensors")


def _inputs():
    g = torch.Generator().manual_seed(0)
    return ([torch.randn(1, 24, 7, 4, 6, generator=g), torch.randn(1, 32, 2, 37, generator=g)],
            torch.tensor([600.0]), torch.randn(1, 3, 32, generator=g))


def test_hooks_are_called_and_can_change_the_output(dit):
    x, t, ctx = _inputs()
    with torch.no_grad():
        plain = dit(x, t, ctx, transformer_options={}, minimax_payload={"audio_scale": 4.0})
        calls, blocks = [], []

        def override(func, q, k, v, heads, *a, **kw):
            calls.append((tuple(q.shape), heads, kw["skip_reshape"]))
            return func(q, k, v, heads, *a, **kw)

        def skip_block_1(args, extra):
            blocks.append(sorted(args))
            return {"img": args["img"]} if len(blocks) == 2 else extra["original_block"](args)

        to = {"optimized_attention_override": override,
              "patches_replace": {"dit": {("double_block", i): skip_block_1 for i in range(4)}}}
        hooked = dit(x, t, ctx, transformer_options=to, minimax_payload={"audio_scale": 4.0})
    S_len = 3 + 2 * 37 + 7 * 2 * 3
    # 2 refiner blocks (context not yet refined) + 3 computed DiT blocks
    assert calls == [((1, 4, 3, 32), 4, True)] * 2 + [((1, 4, S_len, 32), 4, True)] * 3
    assert blocks == [["img", "mod_segments", "rope_freqs", "t_emb", "transformer_options"]] * 4
    assert (hooked[0] - plain[0]).abs().max() > 1e-3  # skipping block 1 changed the result: the replace was used


def test_diffusion_model_wrappers_wrap_the_inner_forward(dit):
    x, t, ctx = _inputs()
    seen = []

    def wrapper(executor, *args, **kwargs):
        seen.append((executor.class_obj is dit, len(args), sorted(kwargs)))
        return executor(*args, **kwargs)

    with torch.no_grad():
        dit(x, t, ctx, transformer_options={"wrappers": {"diffusion_model": {"k": [wrapper, wrapper]}}},
            minimax_payload={"audio_scale": 4.0})
    assert seen == [(True, 4, ["minimax_payload"])] * 2


def test_noise_is_the_seeded_global_stream():
    shapes = S.av_latent_shapes(96, 64, 22)
    assert shapes == ((1, 24, 7, 4, 6), (1, 32, 2, 37))
    torch.manual_seed(77)
    want = [torch.randn(s) for s in shapes]  # one generator, video then audio
    got = S.prepare_noise(shapes, 77)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_simple_schedule():
    ms = S.FlowSampling(12.0, 3.0)
    sig = S.simple_sigmas(ms, 4)
    # float64 oracle of shift 12 at t = 1, 0.75, 0.5, 0.25, then 0
    want = [12 * t / (1 + 11 * t) for t in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    assert torch.allclose(sig.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert ms.audio_scale == 4.0 and ms.percent_to_sigma(0.0) == 1.0 and ms.percent_to_sigma(1.0) == 0.0
