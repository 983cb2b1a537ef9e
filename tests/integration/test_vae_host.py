"""H3 VAE nodes against real ComfyUI: T=1 decode vs the native duplicated-latent oracle, image-VAE slice, strict
loader rejects, streaming video save vs native VAEDecode -> SaveVideo frames."""
from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path

import pytest
import torch

from ditkit.errors import CheckpointError, DitKitError, MetadataError, UnsupportedModelError
from ditkit.loaders.safetensors_io import load_file, save_file
from ditkit.tiny import ckpt_h3_vae as ck

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def h3(comfy):
    return importlib.import_module("ditkit.nodes.h3_vae")


@pytest.fixture(scope="module")
def vaes(h3, tiny_ckpts):
    d = Path(tiny_ckpts) / "vae"
    video, _ = h3.load_h3_vae(str(d / ck.VIDEO_VAE_NAME))
    image, _ = h3.load_h3_vae(str(d / ck.IMAGE_VAE_NAME))
    return video, image


def _z(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_t1_equals_frame0_of_native_duplicated_decode(h3, vaes):
    video, _ = vaes
    z = _z((2, 24, 1, 20, 18))  # 320x288 px: 2x2 tiles of 256 px, batch 2
    img, data = h3.h3_decode(video, z)
    ref = video.decode(z.repeat(1, 1, 2, 1, 1))  # native: [B, 5, H, W, 3]
    assert ref.shape[1] == 5
    assert img.shape == (2, 320, 288, 3)
    assert torch.equal(img, ref[:, 0]), (img - ref[:, 0]).abs().max()
    assert data["path"] == "repeat_decode" and data["tiles"] == 4
    # the canvas holds ONE frame per batch item (not the 28 frames a 7-token tile decodes to)
    assert data["canvas_bytes"] == 2 * 3 * 1 * 320 * 288 * 4
    # and it differs from the native single-token decode (the artifact path)
    assert not torch.equal(img, video.decode(z)[:, 0])


@pytest.mark.parametrize("which", ["video", "image"])
def test_t1_decode_checks_the_latent_once(h3, vaes, monkeypatch, which):
    # the node checks the latent (5-D, channels, no empty dimension) before the memory pre-flight; the T=1 core
    # must not run the same checks again on the same tensor
    from ditkit.vae import preflight, t1_decode

    seen = []
    real = preflight.check_latent_shape

    def counting(shape, *a, **k):
        seen.append(tuple(shape))
        return real(shape, *a, **k)

    monkeypatch.setattr(preflight, "check_latent_shape", counting)
    monkeypatch.setattr(t1_decode, "check_latent_shape", counting)
    vae = vaes[0] if which == "video" else vaes[1]
    h3.h3_decode(vae, _z((1, 24, 1, 4, 4)))
    assert seen == [(1, 24, 1, 4, 4)]
    seen.clear()
    m = vae.first_stage_model                    # called directly, the core still checks
    with pytest.raises(DitKitError, match="H3 T=1 decode"):
        t1_decode.repeat_decode_t1(m, _z((1, 24, 1, 0, 4)))
    assert seen == [(1, 24, 1, 0, 4)]


def test_t_gt_1_is_native(h3, vaes):
    video, _ = vaes
    z = _z((1, 24, 7, 8, 8), 1)
    img, data = h3.h3_decode(video, z)
    ref = video.decode(z)
    assert data["path"] == "native"
    assert torch.equal(img, ref.reshape(-1, *ref.shape[-3:]))


def test_nested_latent_and_node(h3, vaes, comfy):
    import comfy.nested_tensor

    video, _ = vaes
    z = _z((1, 24, 1, 8, 8), 2)
    nested = {"samples": comfy.nested_tensor.NestedTensor((z, torch.zeros(1, 32, 2, 2)))}
    lat = h3._video_part(nested["samples"])
    assert torch.equal(lat, z)


def test_image_vae_direct_slice_3_equals_native_single_token(h3, vaes):
    _, image = vaes
    z = _z((1, 24, 1, 20, 8), 3)
    img, data = h3.h3_decode(image, z)
    assert data["path"] == "direct_image_vae" and data["kept_raw_frame"] == 3
    assert torch.equal(img, image.decode(z)[:, 0])  # stock T=1 keeps [-1:] = slice 3


def test_image_vae_honours_output_slice(h3, tiny_ckpts, tmp_path):
    src = Path(tiny_ckpts) / "vae" / ck.IMAGE_VAE_NAME
    sd = load_file(src)
    p = tmp_path / "slice0.safetensors"
    save_file(sd, p, metadata=ck.image_vae_metadata(sd, output_slice="0"))
    vae, info = h3.load_h3_vae(str(p))
    assert info["t1_output_slice"] == 0
    z = _z((1, 24, 1, 20, 8), 4)
    img, _ = h3.h3_decode(vae, z)
    m = vae.first_stage_model
    with torch.inference_mode():
        zz = z * m.latents_std.view(1, -1, 1, 1, 1) + m.latents_mean.view(1, -1, 1, 1, 1)
        ref = m._finalize_pixels(m.tiled_decode(zz)[:, :, 0:1])  # native tiled decode, frame 0
    assert torch.equal(img, ref.movedim(1, -1)[:, 0])
    assert not torch.equal(img, vae.decode(z)[:, 0])


def test_image_vae_refuses_video(h3, vaes):
    _, image = vaes
    with pytest.raises(DitKitError, match="IMAGE VAE"):
        h3.h3_decode(image, _z((1, 24, 2, 8, 8)))


def test_wrong_channel_latent(h3, vaes):
    video, _ = vaes
    with pytest.raises(DitKitError, match="16 channels"):
        h3.h3_decode(video, _z((1, 16, 1, 8, 8)))


@pytest.mark.parametrize("key,value", [
    ("h3_t1_direct", "false"), ("h3_t1_direct", "True"), ("h3_t1_format", "full_decoder_v2"),
    ("h3_t1_output_slice", "03"), ("h3_t1_output_slice", "4"), ("minimax_h3_video_vae", "{}"),
    ("minimax_h3_video_vae", '{"a":1,"a":2}'),
])
def test_loader_rejects_bad_metadata_naming_key(h3, tiny_ckpts, tmp_path, key, value):
    sd = load_file(Path(tiny_ckpts) / "vae" / ck.IMAGE_VAE_NAME)
    meta = ck.image_vae_metadata(sd)
    meta[key] = value
    p = tmp_path / "bad.safetensors"
    save_file(sd, p, metadata=meta)
    with pytest.raises(MetadataError) as ei:
        h3.load_h3_vae(str(p))
    assert key in str(ei.value) and repr(value)[:20] in str(ei.value)


def test_loader_rejects_corrupt_and_other_families(h3, tiny_ckpts, tmp_path):
    d = Path(tiny_ckpts) / "vae"
    with pytest.raises(UnsupportedModelError, match="AUDIO"):
        h3.load_h3_vae(str(d / ck.AUDIO_VAE_NAME))
    raw = (d / ck.VIDEO_VAE_NAME).read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        h3.load_h3_vae(str(tmp_path / "trunc.safetensors"))
    (tmp_path / "hdr.safetensors").write_bytes(struct.pack("<Q", 40) + b'{"a": {"dtype": "F16", "shape": [1]')
    with pytest.raises(CheckpointError):
        h3.load_h3_vae(str(tmp_path / "hdr.safetensors"))
    sd = load_file(d / ck.VIDEO_VAE_NAME)
    del sd["decoder.transformer_blocks.1.ff.w2.bias"]
    save_file(sd, tmp_path / "pruned.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        h3.load_h3_vae(str(tmp_path / "pruned.safetensors"))


def _decode_mp4(path):
    import av
    import numpy as np

    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def test_streaming_save_matches_native_savevideo(h3, vaes, tmp_path, comfy):
    import numpy as np
    from comfy_api.latest import InputImpl, Types

    sv = importlib.import_module("ditkit.nodes.save_video")
    video, _ = vaes
    z = _z((1, 24, 7, 6, 8), 5)  # 22 frames, 96x128
    out = tmp_path / "ditkit.mp4"
    data = sv.stream_save(video, z, str(out), 24.0)
    assert data["frames"] == 22 and data["chunks"] >= 2
    assert data["peak_chunk_float_bytes"] < data["full_float_video_bytes"]
    images = video.decode(z).reshape(-1, 96, 128, 3)
    ref_path = tmp_path / "native.mp4"
    vid = InputImpl.VideoFromComponents(Types.VideoComponents(images=images, audio=None, frame_rate=24))
    vid.save_to(str(ref_path), format=Types.VideoContainer.MP4, codec=Types.VideoCodec.H264)
    a, b = _decode_mp4(out), _decode_mp4(ref_path)
    assert a.shape == b.shape == (22, 96, 128, 3)
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
    # and the uint8 stream itself equals the native quantisation of the native float frames
    sink_frames = []
    from ditkit.vae.video_stream import Uint8FrameSink

    m = video.first_stage_model
    shape = m.decode_output_shape(z.shape)
    sink = Uint8FrameSink(shape, sink_frames.append, out_dtype=video.vae_output_dtype(), process=video.process_output)
    with torch.inference_mode():
        m.decode(z.to(video.vae_dtype), output_buffer=sink)
    got = torch.cat(sink_frames)
    assert torch.equal(got, (images * 255).clamp(0, 255).byte())


def test_streaming_save_rejects(h3, vaes, tmp_path):
    sv = importlib.import_module("ditkit.nodes.save_video")
    video, image = vaes
    with pytest.raises(DitKitError, match="IMAGE VAE"):
        sv.stream_save(image, _z((1, 24, 2, 4, 4)), str(tmp_path / "x.mp4"), 24.0)
    with pytest.raises(DitKitError, match="channels"):
        sv.stream_save(video, _z((1, 16, 2, 4, 4)), str(tmp_path / "x.mp4"), 24.0)
    assert not (tmp_path / "x.mp4").exists()


# ------------------------------------------------------------------------------------------------ real server

def _wf(name):
    return json.loads((Path(__file__).resolve().parents[2] / "example_workflows" / "api" / name).read_text())


def test_server_roundtrip_and_rejects(comfy_server):
    entry = comfy_server.run(_wf("h3_image_roundtrip_tiny.json"))
    assert entry["status"]["status_str"] == "success"
    files = comfy_server.output_files(entry)
    assert files and all(f.stat().st_size > 0 for f in files)
    bad = {"1": {"class_type": "DitKitH3VAELoader", "inputs": {"vae_name": ck.AUDIO_VAE_NAME}},
           "2": {"class_type": "DitKitH3EmptyImageLatent",
                 "inputs": {"width": 64, "height": 64, "batch_size": 1, "layout": "video"}},
           "3": {"class_type": "DitKitH3VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
           "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}}}
    err = comfy_server.run_expect_failure(bad)
    assert "AUDIO" in str(err)
    assert comfy_server.alive()
    vdir = comfy_server.models_dir / "vae"
    raw = (vdir / ck.VIDEO_VAE_NAME).read_bytes()
    (vdir / "h3_truncated.safetensors").write_bytes(raw[: len(raw) // 3])
    sd = load_file(vdir / ck.IMAGE_VAE_NAME)
    meta = ck.image_vae_metadata(sd)
    meta["h3_t1_output_slice"] = "3x"
    save_file(sd, vdir / "h3_badslice.safetensors", metadata=meta)
    for name, needle in (("h3_truncated.safetensors", "truncated"), ("h3_badslice.safetensors", "h3_t1_output_slice")):
        g = json.loads(json.dumps(bad))
        g["1"]["inputs"]["vae_name"] = name
        assert needle in str(comfy_server.run_expect_failure(g))
        assert comfy_server.alive()
    entry = comfy_server.run(_wf("h3_save_video_tiny.json"))
    files = comfy_server.output_files(entry)
    assert any(str(f).endswith(".mp4") and f.stat().st_size > 0 for f in files)


def _tiny_ltx_vae():
    """A small random LTX video VAE (ComfyUI's VideoVAE at base width 16, stock 32x/8x ratios, 128 latent channels),
    built through the stock wrapper with its config in the metadata (from ComfyUI's own module, independent of
    tiny/ckpt_ltx_vae.py)."""
    import comfy.sd
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    res = ["res_x", {"num_layers": 1, "inject_noise": False}]
    up = ["compress_all", {"residual": True, "multiplier": 2}]
    cfg = {"dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
           "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 2}],
                              ["compress_all_res", {"multiplier": 2}], ["compress_all_res", {"multiplier": 2}]],
           "decoder_blocks": [res, up, res, up, up, res], "encoder_base_channels": 16, "decoder_base_channels": 16,
           "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
           "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False}
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, v in VideoVAE(config=cfg).state_dict().items():
        if "std-of-means" in k:
            sd[k] = torch.rand(v.shape, generator=g) + 0.5
        elif v.ndim <= 1:
            sd[k] = 0.01 * torch.randn(v.shape, generator=g)
        else:
            sd[k] = torch.randn(v.shape, generator=g) / v[0].numel() ** 0.5
    return comfy.sd.VAE(sd=sd, metadata={"config": json.dumps({"vae": cfg})})


def test_streaming_save_ltx_matches_native(comfy, tmp_path):
    import numpy as np
    from comfy_api.latest import InputImpl, Types

    sv = importlib.import_module("ditkit.nodes.save_video")
    vae = _tiny_ltx_vae()
    z = _z((1, 128, 4, 2, 3), 6)
    data = sv.stream_save(vae, z, str(tmp_path / "ltx.mp4"), 25.0)
    with torch.inference_mode():
        images = vae.decode(z).reshape(-1, 64, 96, 3)
    assert data["frames"] == images.shape[0] == 25
    vid = InputImpl.VideoFromComponents(Types.VideoComponents(images=images, audio=None, frame_rate=25))
    vid.save_to(str(tmp_path / "native.mp4"), format=Types.VideoContainer.MP4, codec=Types.VideoCodec.H264)
    a, b = _decode_mp4(tmp_path / "ltx.mp4"), _decode_mp4(tmp_path / "native.mp4")
    assert a.shape == b.shape == (25, 64, 96, 3)
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1


def test_streaming_save_with_audio(h3, vaes, tmp_path):
    import av

    sv = importlib.import_module("ditkit.nodes.save_video")
    video, _ = vaes
    audio = {"waveform": 0.1 * torch.randn(1, 2, 32000), "sample_rate": 32000}
    out = tmp_path / "av.mp4"
    sv.stream_save(video, _z((1, 24, 2, 4, 4), 7), str(out), 24.0, audio=audio)
    with av.open(str(out)) as c:
        assert len(c.streams.video) == 1 and len(c.streams.audio) == 1
        assert sum(1 for _ in c.decode(video=0)) == 5
