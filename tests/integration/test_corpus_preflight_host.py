"""Errors that came late or raw (issue #17 item 10), in the real host: each bad request is refused by the node with a
DitKitError naming the input and the limit BEFORE any heavy work (the decoder / encoder is instrumented to fail the
test if it runs). The prompt-level variants are corpus cases (tests/corpus, test_corpus_host.py)."""
from __future__ import annotations

import importlib

import pytest
import torch

from ditkit.errors import DitKitError


@pytest.fixture(scope="module")
def vaes(comfy, tmp_path_factory):
    from ditkit.tiny import ckpt_h3_vae as ck
    from ditkit.tiny.checkpoints import generate_all

    out = tmp_path_factory.mktemp("pf_vae")
    generate_all(out, only=["h3_video_vae_tiny"])
    h3 = importlib.import_module("ditkit.nodes.h3_vae")
    video, _ = h3.load_h3_vae(str(out / "vae" / ck.VIDEO_VAE_NAME))
    return video


@pytest.fixture
def no_heavy_work(vaes, monkeypatch):
    """Any decoder / encoder call fails the test: refusals must come first."""
    m = vaes.first_stage_model

    def boom(*a, **k):
        raise AssertionError("heavy work started before the request was refused")

    for name in ("decode", "_decode_pixels", "encode", "_adaptive_decode", "_adaptive_encode"):
        if hasattr(m, name):
            monkeypatch.setattr(m, name, boom)
    return vaes


def _budget(monkeypatch, nbytes):
    import comfy.model_management as mm

    monkeypatch.setattr(mm, "get_free_memory", lambda *a, **k: nbytes)
    monkeypatch.setattr(mm, "get_total_memory", lambda *a, **k: nbytes)


def test_t1_decode_of_a_16384px_latent_is_refused_with_the_figure(no_heavy_work, monkeypatch):
    h3 = importlib.import_module("ditkit.nodes.h3_vae")
    _budget(monkeypatch, 8 * 2 ** 30)
    z = torch.zeros(1, 24, 1, 1024, 1024)           # a 16384 x 16384 image latent (100 MiB)
    with pytest.raises(DitKitError) as ei:
        h3.h3_decode(no_heavy_work, z)
    msg = str(ei.value)
    assert "DitKitH3VAEDecode: input 'samples'" in msg and "(1, 24, 1, 1024, 1024)" in msg
    assert "canvas 3.00 GiB" in msg and "8.00 GiB of RAM free" in msg, msg


def test_video_save_of_a_huge_latent_is_refused_before_any_file(no_heavy_work, monkeypatch, tmp_path):
    sv = importlib.import_module("ditkit.nodes.save_video")
    _budget(monkeypatch, 8 * 2 ** 30)
    z = torch.zeros(1, 24, 2, 1024, 1024)
    with pytest.raises(DitKitError) as ei:
        sv.stream_save(no_heavy_work, z, str(tmp_path / "x.mp4"), 24.0)
    assert "DitKitSaveVideo: input 'samples'" in str(ei.value) and "one decoded chunk" in str(ei.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("shape,word", [((0, 24, 2, 3, 4), "B=0"), ((1, 24, 0, 3, 4), "T=0"), ((1, 24, 2, 0, 4), "H=0")])
def test_empty_latents_are_refused_by_save_and_decode(no_heavy_work, tmp_path, shape, word):
    sv = importlib.import_module("ditkit.nodes.save_video")
    h3 = importlib.import_module("ditkit.nodes.h3_vae")
    with pytest.raises(DitKitError, match=f"input 'samples'.*empty latent.*{word}"):
        sv.stream_save(no_heavy_work, torch.zeros(shape), str(tmp_path / "x.mp4"), 24.0)
    t1 = (shape[0], 24, 1) + shape[3:] if shape[2] else shape
    for s in (shape, t1):
        with pytest.raises(DitKitError, match="empty latent"):
            h3.h3_decode(no_heavy_work, torch.zeros(s))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rate,n,word", [(7, 100, "7 Hz"), (44100, 0, "0 samples"), (192000, 10, "192000 Hz")])
def test_bad_audio_is_refused_before_the_decode(no_heavy_work, tmp_path, rate, n, word):
    sv = importlib.import_module("ditkit.nodes.save_video")
    audio = {"waveform": torch.zeros(1, 2, n), "sample_rate": rate}
    with pytest.raises(DitKitError, match=f"input 'audio'.*{word}"):
        sv.stream_save(no_heavy_work, torch.zeros(1, 24, 2, 3, 4), str(tmp_path / "x.mp4"), 24.0, audio=audio)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("hw", [(1, 1), (15, 15), (31, 64), (64, 16)])
def test_too_small_images_are_refused_before_the_encoder(no_heavy_work, hw):
    h3 = importlib.import_module("ditkit.nodes.h3_vae")
    img = torch.rand(1, hw[0], hw[1], 3)
    with pytest.raises(DitKitError, match=rf"input 'image' is {hw[1]}x{hw[0]} pixels.*at least 32x32"):
        h3.DitKitH3EncodeImage.execute(image=img, vae=no_heavy_work, layout="video")


def test_smallest_accepted_image_encodes(vaes, monkeypatch):
    """The limit is the real one: 32 x 32 encodes on the H3 VAE (and 31 x 31 failed in the encoder before)."""
    from types import SimpleNamespace

    h3 = importlib.import_module("ditkit.nodes.h3_vae")
    monkeypatch.setattr(h3.DitKitH3EncodeImage, "hidden", SimpleNamespace(unique_id=None))
    out = h3.DitKitH3EncodeImage.execute(image=torch.rand(1, 32, 32, 3), vae=vaes, layout="video").result[0]
    assert tuple(out["samples"].shape) == (1, 24, 1, 2, 2)
    with pytest.raises(Exception) as ei:       # what the refused size does in the stock encoder
        vaes.encode(torch.rand(1, 31, 31, 3))
    assert not isinstance(ei.value, DitKitError)


def test_a_huge_t1_decode_is_refused_over_prompt(comfy_server):
    """Over /prompt on the real host: a 16384 x 16384 single-frame latent into DitKitH3VAEDecode. Refused with the
    figures when the server machine cannot hold it (skipped on a machine that could)."""
    import psutil

    need = 3 * 16384 * 16384 * 4 * 2      # canvas + output image alone (fp32)
    if psutil.virtual_memory().available * 0.9 > 4 * need:
        pytest.skip(f"{psutil.virtual_memory().available / 2**30:.0f} GiB free: this machine could decode it")
    g = {"1": {"class_type": "DitKitH3VAELoader", "inputs": {"vae_name": "h3_video_vae_tiny.safetensors"}},
         "2": {"class_type": "DitKitH3EmptyImageLatent", "inputs": {"width": 16384, "height": 16384, "batch_size": 1,
                                                                     "layout": "video"}},
         "3": {"class_type": "DitKitH3VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
         "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}}}
    err = comfy_server.run_expect_failure(g)
    from ditkit.run import history_messages

    msg = history_messages(err.entry, "execution_error")[0]["exception_message"]
    assert "input 'samples'" in msg and "needs about" in msg and "of RAM free" in msg, msg
    assert comfy_server.alive()
