"""vae/t1_decode (issue 29 gap classes): a latent of every float dtype keeps its dtype through the un-whitening (a
bf16 latent must not come back float32: the audit's planted ``.to(z)`` removal did exactly that), non-contiguous
latents decode to the same pixels as contiguous ones, and ``output_slice`` is checked on both sides of each bound.
Oracle: ``z * std + mean`` per channel, in z's dtype, written here (reference h3.md)."""
from __future__ import annotations

import pytest
import torch

from ditkit.bridge.vae import h3_vae_ops
from ditkit.errors import DitKitError
from ditkit.vae.t1_decode import direct_decode_t1, repeat_decode_t1, unwhiten

from _fake_h3 import FakeH3  # noqa: E402  (tests/unit on sys.path)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _oracle(m, z):
    c = z.shape[1]
    return z * m.latents_std.to(z.dtype).reshape(1, c, 1, 1, 1) + m.latents_mean.to(z.dtype).reshape(1, c, 1, 1, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unwhiten_keeps_the_latent_dtype_and_rounds_in_it(dtype):
    m = FakeH3(seed=3)
    z = torch.randn(2, 24, 1, 4, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = unwhiten(m, z)
    assert got.dtype == dtype
    assert torch.equal(got, _oracle(m, z))                          # bit for bit: computed in z's dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_unwhiten_of_a_transposed_latent(dtype):
    m = FakeH3(seed=3)
    z = torch.randn(2, 24, 1, 5, 4, generator=torch.Generator().manual_seed(2)).to(dtype).transpose(-1, -2)
    assert not z.is_contiguous()
    got = unwhiten(m, z)
    assert got.dtype == dtype and torch.equal(got, _oracle(m, z.contiguous()))


@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_decode_of_a_non_contiguous_latent_equals_the_contiguous_one(layout):
    m = h3_vae_ops(FakeH3(seed=1))
    g = torch.Generator().manual_seed(4)
    if layout == "transposed":
        z = torch.randn(1, 24, 1, 6, 9, generator=g).transpose(-1, -2)
    else:
        z = torch.randn(1, 48, 1, 9, 6, generator=g)[:, ::2]
    assert not z.is_contiguous()
    a, _ = direct_decode_t1(m, z, 1)
    b, _ = direct_decode_t1(m, z.contiguous(), 1)
    assert torch.equal(a, b)
    a, _ = repeat_decode_t1(m, z)
    b, _ = repeat_decode_t1(m, z.contiguous())
    assert torch.equal(a, b)


def test_output_slice_bounds_both_sides():
    m = h3_vae_ops(FakeH3(seed=1))
    pt = int(m.patch_size_t)
    z = torch.randn(1, 24, 1, 4, 4, generator=torch.Generator().manual_seed(5))
    for ok in (0, pt - 1):
        out, rep = direct_decode_t1(m, z, ok)
        assert rep.kept_raw_frame == ok
    for bad in (-1, pt):
        with pytest.raises(DitKitError, match=f"output_slice {bad} is outside the {pt} frames"):
            direct_decode_t1(m, z, bad)


def test_checked_skips_the_latent_checks_only_when_told():
    m = h3_vae_ops(FakeH3(seed=1))
    with pytest.raises(DitKitError, match="T=2"):
        direct_decode_t1(m, torch.randn(1, 24, 2, 4, 4), 0)
    with pytest.raises(DitKitError, match="5-D"):
        direct_decode_t1(m, torch.randn(24, 1, 4, 4), 0)


def test_report_summary_says_which_path_ran():
    from ditkit.vae.t1_decode import T1DecodeReport

    r = T1DecodeReport("repeat_decode", 2, (9, 6), 7, 3, tiles=4, tiled=True, canvas_bytes=3 << 19)
    assert r.summary() == ("T=1 decode (duplicated to a 7-token clip, kept first valid frame): batch 2, 4 tile(s), "
                           "canvas 1.50 MiB")
    r = T1DecodeReport("direct_image_vae", 1, (4, 4), 1, 2, tiles=1, tiled=False, canvas_bytes=0)
    assert r.summary() == "T=1 decode (image VAE direct, h3_t1_output_slice 2): batch 1, 1 tile(s) (untiled), " \
                          "canvas 0.00 MiB"


def test_reports_of_both_paths_carry_what_ran():
    m = h3_vae_ops(FakeH3(seed=1))
    z = torch.randn(2, 24, 1, 9, 6, generator=torch.Generator().manual_seed(6))
    out, rep = direct_decode_t1(m, z, 1)
    assert (rep.path, rep.batch, rep.latent_hw, rep.tokens_decoded, rep.kept_raw_frame) == \
        ("direct_image_vae", 2, (9, 6), 1, 1)
    assert rep.tiled and rep.tiles >= 1 and rep.canvas_bytes == out.numel() * out.element_size()
    out, rep = repeat_decode_t1(m, z)
    assert (rep.path, rep.batch, rep.latent_hw) == ("repeat_decode", 2, (9, 6))
    assert rep.tokens_decoded >= 2 and rep.max_tile_bytes > 0 and rep.canvas_bytes > 0
