"""The H3 audio clock at few steps, measured in ComfyUI 0.33 with an oracle denoiser (in-process, tiny H3).

H3 integrates audio on its own shifted clock inside the video sampler. A conversion that advances the audio
latent with the local derivative d(sigma_audio)/d(sigma_video) over a finite video step over-advances audio
(stable-diffusion.cpp PR 1908). ComfyUI 0.33 instead carries the audio stream as y = (sigma_v / sigma_a) * x_a
(``ModelSamplingAV.audio_scale``, ``MiniMaxH3Model.forward``). Written out here (not taken from ComfyUI): with
x_a = (1 - sigma_a) x0 + sigma_a eps and sigma = s*b / (1 + (s-1)*b) for both streams on one base grid b,
sigma_a / (1 - sigma_a) = (s_a / s_v) * sigma_v / (1 - sigma_v), so

    y = (1 - sigma_v) * (s_v / s_a) * x0 + sigma_v * eps,

a straight line in sigma_v: Euler with the exact velocity is exact at any step count.

The measurement: a model wrapper returns the exact per-stream velocity for a known x0 and noise (the oracle), the
real sampler runs (KSampler ``euler`` at 4 / 8 / 20 steps on the base shifts; SamplerCustom on the FastH3 ladders
from DitKitFastH3Schedule), and the final video and audio latents are compared with x0. Two oracles:

* ``diffusion_model``: a DIFFUSION_MODEL wrapper replacing the network inside ``MiniMaxH3Model.forward``. It
  sees each stream's own latent and returns each stream's own velocity in the network's output convention
  (``_forward`` returns ``eps - x0`` per stream: x0 = x - sigma * out), so ComfyUI's carry, its velocity
  conversion, ``calculate_denoised``, ``process_latent_in/out`` and the sampler all run for real.
* ``apply_model``: a ``set_model_unet_function_wrapper`` wrapper returning what ``apply_model`` returns, the
  denoised packed latent in the sampler's convention, built from the line above: denoised = x - sigma * v with
  v = [eps_v - x0_v, eps_a - (s_v / s_a) x0_a].

Both must end at x0 to float32 rounding. A deliberately wrong integrator written here (audio advanced by the
local derivative over each video step) shows the test can tell the difference; the same loop with the exact
finite-step audio interval gives ~0.
"""
from __future__ import annotations

import pytest
import torch

BASE = (12.0, 3.0)
STEPS = (4, 8, 20)
TOL = 2e-5  # float32 rounding over <= 20 steps of O(1) latents; the local-derivative error is > 0.1
RESULTS: list[str] = []


def shift(b, s):
    return s * b / (1 + (s - 1) * b)


def sigma_audio(sv, s_v, s_a):
    b = sv / (s_v + sv * (1 - s_v))
    return shift(b, s_a)


def dsa_dsv(sv, s_v, s_a):
    b = sv / (s_v + sv * (1 - s_v))
    return (s_a / (1 + (s_a - 1) * b) ** 2) * (s_v / (s_v + sv * (1 - s_v)) ** 2)


@pytest.fixture(scope="module")
def h3(comfy, tiny_ckpts):
    import comfy.sd

    torch.set_num_threads(1)
    return comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))


@pytest.fixture(scope="module")
def problem(comfy):
    """Known x0 (the target) and the noise the sampler draws for seed 3."""
    import comfy.nested_tensor
    import comfy.sample
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    v0, a0 = EmptyMiniMaxH3LatentAV.execute(64, 64, 5)[0]["samples"].unbind()
    g = torch.Generator().manual_seed(7)
    x0 = (torch.randn(v0.shape, generator=g), torch.randn(a0.shape, generator=g))
    target = comfy.nested_tensor.NestedTensor((x0[0].clone(), x0[1].clone()))
    eps = tuple(t.clone() for t in comfy.sample.prepare_noise(target, 3).unbind())
    return {"x0": x0, "eps": eps, "seed": 3}


def with_oracle(model, problem, where, shifts, calls):
    import comfy.patcher_extension as pe
    import comfy.utils

    m = model.clone()
    (x0v, x0a), (ev, ea) = problem["x0"], problem["eps"]
    if where == "diffusion_model":
        def oracle(executor, x, timestep, context, transformer_options, **kwargs):
            calls.append(float(timestep.flatten()[0]) / 1000.0)
            return [(ev - x0v).to(x[0].dtype), (ea - x0a).to(x[1].dtype)]

        m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "audio_clock_oracle", oracle)
    else:
        scale = shifts[0] / shifts[1]
        vel = comfy.utils.pack_latents([ev - x0v, ea - scale * x0a])[0]

        def oracle(apply_model, args):
            x, t = args["input"], args["timestep"]
            calls.append(float(t.flatten()[0]))
            return x - t.view(-1, 1, 1).to(x.dtype) * vel.to(x.dtype)

        m.set_model_unet_function_wrapper(oracle)
    return m


def _target(problem):
    import comfy.nested_tensor

    return {"samples": comfy.nested_tensor.NestedTensor(tuple(t.clone() for t in problem["x0"]))}


def _cond():
    return [[torch.zeros(1, 7, 48), {}]]


def run_ksampler(model, problem, steps, sampler="euler"):
    import nodes

    out = nodes.common_ksampler(model, problem["seed"], steps, 1.0, sampler, "simple", _cond(), _cond(),
                                _target(problem))[0]["samples"]
    return out.unbind()


def run_custom(model, problem, sigmas, sampler="euler"):
    from comfy_extras.nodes_custom_sampler import KSamplerSelect, SamplerCustom

    s = KSamplerSelect.execute(sampler)[0]
    out = SamplerCustom.execute(model, True, problem["seed"], 1.0, _cond(), _cond(), s, sigmas, _target(problem))[0]
    return out["samples"].unbind()


def wrong_and_exact_integrators(problem, sigmas, shifts):
    """Plain Euler over the video sigmas with the oracle velocity, audio carried in its own variable and advanced
    by (a) the local derivative d sigma_a / d sigma_v times the video step, (b) the exact audio interval."""
    x0a, ea = problem["x0"][1], problem["eps"][1]
    s_v, s_a = shifts
    sig = [float(v) for v in sigmas]
    va = ea.double() - x0a.double()
    sa0 = sigma_audio(sig[0], s_v, s_a)
    start = sa0 * ea.double() + (1 - sa0) * x0a.double()
    local, exact = start.clone(), start.clone()
    for s, n in zip(sig[:-1], sig[1:]):
        local = local + va * dsa_dsv(s, s_v, s_a) * (n - s)
        exact = exact + va * (sigma_audio(n, s_v, s_a) - sigma_audio(s, s_v, s_a))
    advance = sum(dsa_dsv(s, s_v, s_a) * (n - s) for s, n in zip(sig[:-1], sig[1:])) / (0 - sa0)
    return (float((local - x0a.double()).abs().max()), float((exact - x0a.double()).abs().max()), advance)


def _record(label, steps, ev_, ea_, local, exact, advance):
    RESULTS.append(f"{label:<40} {steps:>3}  video {ev_:.2e}  audio {ea_:.2e}  | local-derivative audio {local:.3f} "
                   f"(advance x{advance:.3f})  exact-interval audio {exact:.1e}")
    print("\n[audio clock] " + RESULTS[-1])


@pytest.mark.parametrize("where", ["diffusion_model", "apply_model"])
@pytest.mark.parametrize("steps", STEPS)
def test_comfy_euler_is_exact_on_the_audio_clock(h3, problem, where, steps):
    import comfy.samplers

    calls = []
    m = with_oracle(h3, problem, where, BASE, calls)
    v, a = run_ksampler(m, problem, steps)
    err_v = float((v - problem["x0"][0]).abs().max())
    err_a = float((a - problem["x0"][1]).abs().max())
    sigmas = comfy.samplers.calculate_sigmas(h3.get_model_object("model_sampling"), "simple", steps)
    assert len(calls) == steps and abs(calls[0] - float(sigmas[0])) < 1e-6  # the oracle answered every step
    local, exact, advance = wrong_and_exact_integrators(problem, sigmas, BASE)
    _record(f"KSampler euler/simple 12/3 [{where}]", steps, err_v, err_a, local, exact, advance)
    assert err_v < TOL and err_a < TOL, f"ComfyUI's H3 path is not exact: video {err_v:.3e}, audio {err_a:.3e}"
    assert exact < 1e-9 and advance > 1.1 and local > 0.1 and local > 1000 * err_a  # the test can tell them apart


@pytest.mark.parametrize("recipe", ["fasth3_preview_4step", "fasth3_8step_v2"])
@pytest.mark.parametrize("sampler", ["euler", "res_multistep"])
def test_fasth3_ladders_are_exact_on_the_audio_clock(h3, problem, recipe, sampler):
    from ditkit.nodes.fasth3 import DitKitFastH3Schedule

    out = DitKitFastH3Schedule.execute(h3, recipe, "")
    model, sigmas = out.args[0], out.args[1]
    ms = model.get_model_object("model_sampling")
    shifts = (float(ms.shift), float(ms.audio_shift))
    for where in ("diffusion_model", "apply_model"):
        calls = []
        v, a = run_custom(with_oracle(model, problem, where, shifts, calls), problem, sigmas, sampler)
        err_v = float((v - problem["x0"][0]).abs().max())
        err_a = float((a - problem["x0"][1]).abs().max())
        assert len(calls) == sigmas.numel() - 1
        local, exact, advance = wrong_and_exact_integrators(problem, sigmas, shifts)
        _record(f"SamplerCustom {sampler} {recipe} [{where}]", sigmas.numel() - 1, err_v, err_a, local, exact,
                advance)
        assert err_v < TOL and err_a < TOL, f"{recipe} {sampler}: video {err_v:.3e}, audio {err_a:.3e}"
        assert local > 0.1 and local > 1000 * err_a


def test_the_oracle_detects_a_wrong_audio_velocity(h3, problem):
    """Guard on the harness: an oracle whose audio velocity is off by 10 % must show up as an audio error."""
    import comfy.patcher_extension as pe

    (x0v, x0a), (ev, ea) = problem["x0"], problem["eps"]
    m = h3.clone()
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "bad_oracle",
                           lambda ex, x, *a, **k: [ev - x0v, 1.1 * (ea - x0a)])
    v, a = run_ksampler(m, problem, 4)
    assert float((v - x0v).abs().max()) < TOL and float((a - x0a).abs().max()) > 0.05
