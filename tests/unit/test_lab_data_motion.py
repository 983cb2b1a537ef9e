"""Lab data: the optional fast-motion knobs of ``make_clip`` (speed_scale, bounce) used by VAE training."""
import pytest
import torch

from benchmarks.lab import lab_data as D


def _centroid_x(video, f):
    """x centre (fraction of width) of the saturated shape pixels in frame ``f``."""
    v = (video[:, f] + 1) / 2
    mask = (v.amax(0) - v.amin(0)) > 0.42
    xs = torch.arange(v.shape[-1], dtype=torch.float64).view(1, -1)
    return float((mask * xs).sum() / mask.sum().clamp(min=1)) / v.shape[-1]


def test_defaults_are_the_plain_clip():
    a = D.make_clip(5)
    b = D.make_clip(5, speed_scale=1.0, bounce=False)
    assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio) and a.spec == b.spec
    assert a.spec.bounce is False


def test_speed_scale_multiplies_the_displacement():
    base = D.make_clip(9, prompt="red circle right")
    fast = D.make_clip(9, prompt="red circle right", speed_scale=2.0)
    assert fast.spec.speed == pytest.approx(2 * base.spec.speed)
    # independent read-back from pixels: displacement over 6 frames doubles (shape still in frame)
    d_base = _centroid_x(base.video, 6) - _centroid_x(base.video, 0)
    d_fast = _centroid_x(fast.video, 6) - _centroid_x(fast.video, 0)
    assert d_base > 0.02
    assert d_fast == pytest.approx(2 * d_base, rel=0.2)


def test_bounce_keeps_fast_shapes_in_frame_and_reflects():
    t = torch.linspace(0, 3, 301)
    spec = D.make_clip(3, prompt="blue square left", speed_scale=4.0, bounce=True).spec
    x, y, _, _ = D.trajectory(spec, t)
    assert float(x.min()) >= 0.15 - 1e-6 and float(x.max()) <= 0.85 + 1e-6
    # oracle: float64 reflection of the unbounded path about the walls 0.15 / 0.85
    free = spec.x0 - spec.speed * t.double()
    ref = free.clone()
    for _ in range(20):
        ref = torch.where(ref < 0.15, 0.3 - ref, ref)
        ref = torch.where(ref > 0.85, 1.7 - ref, ref)
    assert torch.allclose(x.double(), ref, atol=1e-5)
    assert float(free.min()) < 0.15  # it did hit a wall
    unb = D.make_clip(3, prompt="blue square left", speed_scale=4.0)
    xu, _, _, _ = D.trajectory(unb.spec, t)
    assert float(xu.min()) < 0.0  # without bounce the same clip leaves the frame


def test_bad_speed_scale_is_refused():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="speed_scale"):
            D.make_clip(1, speed_scale=bad)
