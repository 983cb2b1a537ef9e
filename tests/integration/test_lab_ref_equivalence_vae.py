"""The pure-torch lab VAE reference (``benchmarks.lab.lab_ref_vae``) equals ComfyUI's own ``MiniMaxH3VideoVAE`` on
the committed lab weights (the oracle is ComfyUI, in-process, fp32, CPU): encode, decode, raw decoder, tiling,
the T=1 repeat decode. This is what lets the lab harness run its VAE without ComfyUI (CI).

It also checks that the small golden file the CI unit test compares against (``tests/data/lab_ref_vae_golden``,
ComfyUI's outputs on fixed inputs) still is what ComfyUI computes; ``DITKIT_WRITE_LAB_VAE_GOLDEN=1`` rewrites it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from ditkit.loaders.safetensors_io import load_file, save_file
from benchmarks.lab.lab_data import make_clip
from benchmarks.lab.lab_ref_vae import DEFAULT_VAE_FILE, load_lab_vae
from ditkit.bridge.vae import repeat_decode_t1

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "data" / "lab_ref_vae_golden.safetensors"
TOL = 1e-4


@pytest.fixture(scope="module")
def lab_comfy(comfy, comfyui_path):
    sys.path.insert(0, str(REPO / "benchmarks" / "lab"))
    try:
        import lab_comfy as lc
    finally:
        sys.path.remove(str(REPO / "benchmarks" / "lab"))
    lc.import_comfy(comfyui_path)
    return lc


@pytest.fixture(scope="module")
def pair(lab_comfy):
    torch.set_grad_enabled(False)
    cv = lab_comfy.load_vae(DEFAULT_VAE_FILE)
    return cv, load_lab_vae()


@pytest.fixture(scope="module")
def clip() -> torch.Tensor:
    return make_clip(7_000_100, 39, 64, 96).video[None]


@pytest.fixture(scope="module")
def latent(pair, clip) -> torch.Tensor:
    with torch.no_grad():
        return pair[0].encode(clip[:, :, :22].clone())


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("frames", [1, 5, 17, 22, 30, 39])
def test_encode_matches(pair, clip, frames):
    cv, rv = pair
    x = clip[:, :, :frames]
    with torch.no_grad():
        want, got = cv.encode(x.clone()), rv.encode(x.clone())
    err = _diff(want, got)
    print(f"encode T={frames} -> {tuple(want.shape)}: max abs diff {err:.3g}")
    assert want.abs().max().item() > 0.1
    assert err <= TOL


@pytest.mark.parametrize("t_lat", [1, 2, 3, 7, 12])
def test_decode_matches(pair, latent, t_lat):
    cv, rv = pair
    z = latent[:, :, :t_lat] if t_lat <= latent.shape[2] else torch.cat(
        [latent, latent.flip(2)], dim=2)[:, :, :t_lat]
    with torch.no_grad():
        want, got = cv.decode(z.clone()), rv.decode(z.clone())
    err = _diff(want, got)
    print(f"decode T_lat={t_lat} -> {tuple(want.shape)}: max abs diff {err:.3g}")
    assert want.std().item() > 0.01
    assert err <= TOL


@pytest.mark.parametrize("t_lat", [1, 3, 7])
def test_decoder_pixels_match(pair, latent, t_lat):
    cv, rv = pair
    g = torch.Generator().manual_seed(t_lat)
    raw = latent[:, :, :t_lat] * cv.latents_std.view(1, -1, 1, 1, 1) + cv.latents_mean.view(1, -1, 1, 1, 1)
    raw = torch.cat([raw, raw + 0.3 * torch.randn(raw.shape, generator=g)], dim=0)  # batch 2
    with torch.no_grad():
        want, got = cv._decode_pixels(raw.clone()), rv._decode_pixels(raw.clone())
    err = _diff(want, got)
    print(f"_decode_pixels T={t_lat} B=2 -> {tuple(want.shape)}: max abs diff {err:.3g}")
    assert err <= TOL


def test_tiled_paths_match(pair, clip, latent):
    """Small tiles (48 px, overlap >= 16) so the 64x96 lab frame is cut 2 x 3: blends in latent and pixel space."""
    cv, _ = pair
    rv = load_lab_vae(tile_size=48, tile_overlap_min=16)
    saved = cv.tile_size, cv.tile_overlap_min
    cv.tile_size, cv.tile_overlap_min = 48, 16
    try:
        assert cv.split_tiles(96) == rv.split_tiles(96) and cv.split_tiles(64) == rv.split_tiles(64)
        with torch.no_grad():
            errs = {
                "encode T=1": _diff(cv.encode(clip[:, :, :1].clone()), rv.encode(clip[:, :, :1].clone())),
                "encode T=22": _diff(cv.encode(clip[:, :, :22].clone()), rv.encode(clip[:, :, :22].clone())),
                "decode T_lat=1": _diff(cv.decode(latent[:, :, :1].clone()), rv.decode(latent[:, :, :1].clone())),
                "decode T_lat=7": _diff(cv.decode(latent.clone()), rv.decode(latent.clone())),
                "repeat_decode_t1": _diff(repeat_decode_t1(cv, latent[:, :, 3:4].clone())[0],
                                          repeat_decode_t1(rv, latent[:, :, 3:4].clone())[0]),
            }
    finally:
        cv.tile_size, cv.tile_overlap_min = saved
    print("tiled (48/16):", {k: f"{v:.3g}" for k, v in errs.items()})
    assert max(errs.values()) <= TOL


def test_repeat_decode_t1_matches(pair, latent):
    cv, rv = pair
    with torch.no_grad():
        want, rep_c = repeat_decode_t1(cv, latent[:, :, 4:5].clone())
        got, rep_r = repeat_decode_t1(rv, latent[:, :, 4:5].clone())
    assert rep_c.as_dict() == rep_r.as_dict()
    err = _diff(want, got)
    print(f"repeat_decode_t1: max abs diff {err:.3g}")
    assert err <= TOL


def test_plan_attributes_match(pair):
    cv, rv = pair
    for name in ("vae_ratio", "vae_ratio_t", "clip_length", "token_drop", "frame_pre_padding", "tokens_chunk_size",
                 "token_overlap", "frame_overlap", "tiling", "tile_size", "tile_overlap_min"):
        assert getattr(cv, name) == getattr(rv, name), name
    for t in range(1, 30):
        assert cv.decode_output_shape((1, 24, t, 4, 6)) == rv.decode_output_shape((1, 24, t, 4, 6)), t
        if t > 1:
            assert cv._decode_temporal_chunks(t) == rv._decode_temporal_chunks(t), t
    assert torch.equal(cv.pixel_mean, rv.pixel_mean) and torch.equal(cv.pixel_std, rv.pixel_std)


# ------------------------------------------------------------------------------------ golden file for the CI test

def golden_inputs() -> torch.Tensor:
    """The clip the golden outputs are computed on (the CI unit test rebuilds it the same way)."""
    return make_clip(7_000_200, 22, 64, 96).video[None]


def compute_golden(cv) -> dict[str, torch.Tensor]:
    x = golden_inputs()
    saved = cv.tile_size, cv.tile_overlap_min
    with torch.no_grad():
        enc22 = cv.encode(x.clone())
        out = {
            "clip_stats": torch.stack([x.double().sum(), x.double().abs().sum()]).float(),
            "enc22": enc22,
            "enc5": cv.encode(x[:, :, :5].clone()),
            "enc1": cv.encode(x[:, :, 9:10].clone()),
            "dec1": cv.decode(enc22[:, :, 2:3].clone()),
            "dec7_s3": cv.decode(enc22.clone())[..., ::3, ::3].contiguous(),
        }
        try:
            cv.tile_size, cv.tile_overlap_min = 48, 16
            out["dec2_tiled48_s3"] = cv.decode(enc22[:, :, :2].clone())[..., ::3, ::3].contiguous()
        finally:
            cv.tile_size, cv.tile_overlap_min = saved
    return out


def test_golden_file_is_comfyuis_output(pair):
    cv, _ = pair
    fresh = compute_golden(cv)
    if os.environ.get("DITKIT_WRITE_LAB_VAE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        save_file(fresh, str(GOLDEN), metadata={"what": "ComfyUI MiniMaxH3VideoVAE outputs on the lab VAE weights",
                                                "made_by": "tests/integration/test_lab_ref_equivalence_vae.py"})
    stored = load_file(str(GOLDEN))
    assert set(stored) == set(fresh)
    errs = {k: _diff(fresh[k], stored[k]) for k in fresh}
    print("golden vs fresh ComfyUI:", {k: f"{v:.3g}" for k, v in errs.items()})
    assert max(errs.values()) <= 1e-5
