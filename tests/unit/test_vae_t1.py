"""T=1 decode core on a duck-typed fake H3 VAE (no ComfyUI). The oracle decodes every frame of every tile, blends
the full tiles, THEN takes the frame (what slicing-before-blending must reproduce exactly). The latents it decodes
are un-whitened here, by the inverse of H3's whitening (reference h3.md: encode ``z = (x - latents_mean) /
latents_std`` per channel; decode first ``x = z * latents_std + latents_mean``), not by the code under test."""
from __future__ import annotations


import pytest
import torch

from ditkit.errors import DitKitError
from ditkit.bridge.vae import direct_decode_t1, repeat_decode_t1, tiled_decode_frame, unwhiten

from _fake_h3 import FakeH3, full_tiled_decode  # noqa: E402  (tests/unit on sys.path; the oracle decode is
#   benchmarks/_fakes.py's, shared with gpu_check.py)


def raw_latents(m, z):
    """Oracle un-whitening: per channel (dim 1) ``z * latents_std + latents_mean`` in z's dtype (a multiply, then
    an add, each rounded once: the decode tests compare bit for bit; test_unwhiten_is_the_inverse_of_h3_whitening
    checks the same formula against a float64 round trip)."""
    c = z.shape[1]
    std = m.latents_std.to(z.dtype).reshape(1, c, 1, 1, 1)
    mean = m.latents_mean.to(z.dtype).reshape(1, c, 1, 1, 1)
    return z * std + mean


@pytest.mark.parametrize("hw", [(3, 3), (6, 5), (11, 7)])
@pytest.mark.parametrize("batch", [1, 3])
def test_repeat_decode_equals_full_clip_frame(hw, batch):
    m = FakeH3()
    z = torch.randn(batch, 24, 1, *hw, generator=torch.Generator().manual_seed(hw[0] * 10 + batch))
    out, rep = repeat_decode_t1(m, z)
    clip = raw_latents(m, z).repeat(1, 1, 7, 1, 1)
    ref = m._finalize_pixels(full_tiled_decode(m, clip)[:, :, 3:4])
    assert out.shape == (batch, 3, 1, hw[0] * 2, hw[1] * 2)
    assert torch.equal(out, ref)
    assert rep.tokens_decoded == 7 and rep.kept_raw_frame == 3
    assert rep.canvas_bytes == batch * 3 * 1 * hw[0] * 2 * hw[1] * 2 * 4  # one frame, not 28
    # context matters: the 7-token clip is not the same function as one token
    assert not torch.equal(out, m._finalize_pixels(full_tiled_decode(m, raw_latents(m, z))[:, :, 3:4]))


@pytest.mark.parametrize("s", [0, 1, 2, 3])
def test_direct_decode_takes_declared_slice(s):
    m = FakeH3(seed=1)
    z = torch.randn(2, 24, 1, 9, 6, generator=torch.Generator().manual_seed(s))
    out, rep = direct_decode_t1(m, z, s)
    ref = m._finalize_pixels(full_tiled_decode(m, raw_latents(m, z))[:, :, s:s + 1])
    assert torch.equal(out, ref) and rep.kept_raw_frame == s and rep.tokens_decoded == 1


def test_untiled_model_and_bad_inputs():
    m = FakeH3()
    m.tiling = False
    z = torch.randn(1, 24, 1, 6, 6)
    out = tiled_decode_frame(m, raw_latents(m, z), 2)
    assert torch.equal(out, m._decode_pixels(raw_latents(m, z))[:, :, 2:3])
    with pytest.raises(DitKitError, match="16 channels"):
        repeat_decode_t1(m, torch.randn(1, 16, 1, 4, 4))
    with pytest.raises(DitKitError, match="T=2"):
        repeat_decode_t1(m, torch.randn(1, 24, 2, 4, 4))
    with pytest.raises(DitKitError, match="5-D"):
        repeat_decode_t1(m, torch.randn(24, 1, 4, 4))
    with pytest.raises(DitKitError, match="output_slice 4"):
        direct_decode_t1(m, torch.randn(1, 24, 1, 4, 4), 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unwhiten_is_the_inverse_of_h3_whitening(dtype):
    m = FakeH3(seed=3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 24, 3, 4, 5, generator=g, dtype=torch.float64) * 3 + 1  # raw latents
    c = (1, 24, 1, 1, 1)
    z = ((x - m.latents_mean.double().reshape(c)) / m.latents_std.double().reshape(c)).to(dtype)  # encode side
    got = unwhiten(m, z)
    assert got.dtype == dtype and got.shape == z.shape
    torch.testing.assert_close(got.double(), x, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)
    # channel c uses mean[c] and std[c]: a channel permutation or a swapped mean/std would differ
    one = torch.zeros(1, 24, 1, 1, 1, dtype=dtype)
    torch.testing.assert_close(unwhiten(m, one).reshape(24).double(), m.latents_mean.double(), rtol=0, atol=1e-6)
    one[:, 7] = 1
    want = m.latents_mean.double().clone()
    want[7] += m.latents_std.double()[7]
    torch.testing.assert_close(unwhiten(m, one).reshape(24).double(), want, rtol=0, atol=1e-6)
