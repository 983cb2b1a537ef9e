"""The H3 VAE paths under the recorded 0.38 / announced 0.40 variants (tests/support/host_variants.py), real 0.33
host, tiny VAEs, CPU:

* T=1 decode is built on the host's own tiled decode: equal to the host's decode of the duplicated latent at 2 x 2
  tiles both on 0.33 semantics and with 0.38's blended-neighbour ``tiled_decode`` (the copied 0.33 blending
  differs from the variant there);
* a host with its own single-image path is detected and deferred to, and the report says so;
* VAE constructor / patcher keywords (``num_layers``, ``fast_disk``) reach what ditkit builds.
"""
from __future__ import annotations

import contextlib
import importlib
from pathlib import Path

import pytest
import torch

from ditkit.tiny import ckpt_h3_vae as ck
from tests.support import host_variants as hv

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def h3(comfy):
    return importlib.import_module("ditkit.nodes.h3_vae")


@pytest.fixture(scope="module")
def video(h3, tiny_ckpts):
    vae, _ = h3.load_h3_vae(str(Path(tiny_ckpts) / "vae" / ck.VIDEO_VAE_NAME))
    return vae


def _z(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("semantics", ["0.33", "0.38"])
def test_t1_equals_the_hosts_decode_of_the_duplicated_latent(h3, video, semantics):
    z = _z((2, 24, 1, 20, 18))  # 320 x 288 px: 2 x 2 tiles of 256 px
    cm = contextlib.nullcontext() if semantics == "0.33" else hv.blended_neighbour_tiled_decode()
    with hv.refreshed(cm):
        img, data = h3.h3_decode(video, z)
        ref = video.decode(z.repeat(1, 1, 2, 1, 1))[:, 0]
    assert torch.equal(img, ref), (img - ref).abs().max()
    assert data["path"] == "repeat_decode" and data["tiles"] == 4 and data["blending"] == "host tiled_decode"


def test_the_variant_blends_differently_from_033(h3, video):
    """The variant is a real change at 2 x 2 tiles (else the test above could not fail without the change)."""
    z = _z((1, 24, 7, 20, 18), seed=1)
    m = video.first_stage_model
    raw = z * m.latents_std.view(1, -1, 1, 1, 1) + m.latents_mean.view(1, -1, 1, 1, 1)
    with torch.inference_mode():
        old = m.tiled_decode(raw)
        with hv.blended_neighbour_tiled_decode():
            new = m.tiled_decode(raw)
    assert old.shape == new.shape and not torch.equal(old, new)


def test_a_host_single_image_path_is_deferred_to_and_reported(h3, video):
    z = _z((1, 24, 1, 20, 18), seed=2)
    from ditkit.bridge import vae as bv

    bv._t1_path.cache_clear()
    try:
        with hv.refreshed(hv.host_single_image_decode()):
            img, data = h3.h3_decode(video, z)
            ref = video.decode(z)[:, 0]
    finally:
        bv._t1_path.cache_clear()
    assert data["path"] == "host_single_image"
    assert torch.equal(img, ref)
    _, data33 = h3.h3_decode(video, z)  # back on 0.33: ditkit's own repeat-decode again
    assert data33["path"] == "repeat_decode"


def test_vae_constructor_and_patcher_keywords(h3, tiny_ckpts):
    path = str(Path(tiny_ckpts) / "vae" / ck.VIDEO_VAE_NAME)
    with hv.refreshed(hv.vae_num_layers()), hv.patcher_fast_disk(host_default=True):
        vae, _ = h3.load_h3_vae(path)
    m = vae.first_stage_model
    assert m._hv_num_layers == ck.TINY_VIDEO_CONFIG["dec_layers"] == 2  # not the constructor's default 36
    assert vae.patcher.fast_disk is True  # the rebuilt patcher keeps the host's setting
