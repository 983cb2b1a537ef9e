"""Hostile names and planted symlinks against every write and user-named read of the pack (issue #17 item 8), in the
real ComfyUI host: in process for the calibration and coefficient paths, over /prompt on the real server for the
video save. Each test creates the files an attack would clobber first and checks them byte for byte afterwards."""
from __future__ import annotations

import json
import os

import pytest
import torch

from ditkit.errors import CoefficientError

H3 = "h3_tiny_comfy.safetensors"


# ------------------------------------------------------------------------------------------------ in process

@pytest.fixture(scope="module")
def h3_env(comfy, tmp_path_factory):
    import comfy.sd
    import folder_paths

    from ditkit.tiny.checkpoints import generate_all

    ck = tmp_path_factory.mktemp("w_ckpts")
    generate_all(ck, only=["h3_dit"])
    out = tmp_path_factory.mktemp("w_out")
    old = folder_paths.get_output_directory()
    folder_paths.set_output_directory(str(out))
    model = comfy.sd.load_diffusion_model(str(ck / "diffusion_models" / H3))
    yield {"out": out, "model": model, "teacache": out / "ditkit" / "teacache"}
    folder_paths.set_output_directory(old)


def _sample_h3(model, seed=0):
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    g = torch.Generator().manual_seed(seed)
    w = model.model.diffusion_model.condition_proj.weight.shape[1]
    lat = EmptyMiniMaxH3LatentAV.execute(width=64, height=64, length=22).result[0]
    pos = [[torch.randn(1, 8, w, generator=g), {}]]
    neg = [[torch.randn(1, 8, w, generator=g) * 0.5, {}]]
    return nodes.common_ksampler(model, 3, 6, 1.0, "euler", "simple", pos, neg, lat, denoise=1.0)


def _calibrate(model, name, min_prompts=1):
    from ditkit.nodes.teacache import DitKitTeaCacheCalibrate

    return DitKitTeaCacheCalibrate.execute(model=model, name=name, degree=2, min_prompts=min_prompts).result[0]


def _snapshot(p):
    return {str(q.relative_to(p)): (q.read_bytes() if q.is_file() and not q.is_symlink() else
                                    ("->" + os.readlink(q) if q.is_symlink() else "dir")) for q in sorted(p.rglob("*"))}


def test_calibration_never_writes_through_planted_symlinks(h3_env, tmp_path):
    """Symlinks planted as the pair folder, as the coefficient file and as the old fixed temp name: the outside
    files stay byte-identical; the calibration refuses at execute (before sampling) where a link is in the way of
    its own names, and writes only regular files of its own otherwise."""
    tc = h3_env["teacache"]
    tc.mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.json").write_bytes(b"precious victim")
    (outside / "victim.json.tmp").write_bytes(b"precious tmp")
    os.symlink(outside, tc / "w_dirlink")                          # pair folder -> outside folder
    os.symlink(outside / "victim.json", tc / "w_filelink.json")    # coefficient file -> outside file
    os.symlink(outside / "victim.json.tmp", tc / "w_clean.json.tmp")   # the fixed temp name of old versions
    before = _snapshot(outside)
    for name, word in (("w_dirlink", "pair folder"), ("w_filelink", "symlink")):
        with pytest.raises(CoefficientError) as ei:
            _calibrate(h3_env["model"], name)
        assert word in str(ei.value) and "input 'name'" in str(ei.value), str(ei.value)
    cal = _calibrate(h3_env["model"], "w_clean")
    _sample_h3(cal)
    assert _snapshot(outside) == before
    written = tc / "w_clean.json"
    assert written.is_file() and not written.is_symlink()
    assert json.loads(written.read_text())["format"] == "ditkit.teacache.coefficients"
    assert os.path.islink(tc / "w_clean.json.tmp")            # untouched, not followed
    assert [p.name for p in (tc / "w_clean").iterdir() if not p.name.startswith("pairs_")] == []


def test_calibration_name_problems_fail_at_execute_before_sampling(h3_env):
    """Too long, control characters, a folder or a foreign file in the way: refused when the node executes (the
    sampling run is not lost), with the input named."""
    from ditkit.nodes.teacache import DitKitTeaCacheCalibrate

    tc = h3_env["teacache"]
    tc.mkdir(parents=True, exist_ok=True)
    (tc / "w_isdir.json").mkdir()
    (tc / "w_foreign.json").write_text('{"my": "notes"}', encoding="utf-8")
    (tc / "w_pairfile").write_text("not a folder", encoding="utf-8")
    cases = {"x" * 251: "bytes", "a\x00b": "name", "w_isdir": "a folder is in the way",
             "w_foreign": "was not written by", "w_pairfile": "pair folder", "../up": "name"}
    for name, word in cases.items():
        with pytest.raises(CoefficientError) as ei:
            DitKitTeaCacheCalibrate.execute(model=h3_env["model"], name=name, degree=2, min_prompts=1)
        assert word in str(ei.value) and "'name'" in str(ei.value), (name, str(ei.value))
    assert (tc / "w_foreign.json").read_text(encoding="utf-8") == '{"my": "notes"}'
    # 250 bytes + ".json" = 255: the longest name a file system takes, accepted
    DitKitTeaCacheCalibrate.execute(model=h3_env["model"], name="y" * 250, degree=2, min_prompts=1)


def test_coefficient_check_and_open_are_one_step(h3_env, tmp_path, monkeypatch):
    """A symlink swapped in right after the path was checked must not be followed: the file read is the file the
    check saw (or nothing)."""
    import ditkit.bridge.teacache as T   # where the coefficient file is located and opened
    from ditkit.cache import coefficients as coef

    tc = h3_env["teacache"]
    tc.mkdir(parents=True, exist_ok=True)
    cf = coef.CoefficientFile("h3", {"video": coef.StreamCoefficients("video", (1.0, 0.0)),
                                     "audio": coef.StreamCoefficients("audio", (1.0, 0.0))},
                              {"family": "h3"}, {"source": "inside", "kind": "calibrated"})
    coef.save(cf, tc / "swap.json")
    secret = tmp_path / "outside_secret.json"
    coef.save(coef.CoefficientFile("h3", cf.streams, {"family": "h3"}, {"source": "OUTSIDE-7f3a", "kind": "calibrated"}), secret)
    check = "locate_coefficients" if hasattr(T, "locate_coefficients") else "resolve_coefficients"
    real = getattr(T, check)

    def check_then_swap(spec):
        out = real(spec)
        os.unlink(tc / "swap.json")
        os.symlink(secret, tc / "swap.json")
        return out

    monkeypatch.setattr(T, check, check_then_swap)
    params = {"spec": "swap.json", "family": "h3", "strict": False, "model_fp": None, "threshold": 0.2,
              "audio_threshold": 0.2, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "model"}
    with pytest.raises(CoefficientError, match="symlink"):
        T.build_state(params)


def test_control_characters_in_a_coefficient_path_are_refused(h3_env):
    from ditkit.nodes.teacache import build_state

    for spec in ("a\x00.json", "sub/\x00", "x\n.json", str(h3_env["teacache"] / "a\x00")):
        params = {"spec": spec, "family": "h3", "strict": False, "model_fp": None, "threshold": 0.2,
                  "audio_threshold": 0.2, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "model"}
        with pytest.raises(CoefficientError, match="control character"):
            build_state(params)


# ------------------------------------------------------------------------------------------------ over /prompt

def _save_graph(prefix, fps=24.0):
    return {"1": {"class_type": "DitKitH3VAELoader", "inputs": {"vae_name": "h3_video_vae_tiny.safetensors"}},
            "2": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 5, "color": 0}},
            "3": {"class_type": "VAEEncode", "inputs": {"pixels": ["2", 0], "vae": ["1", 0]}},
            "4": {"class_type": "DitKitSaveVideo", "inputs": {"vae": ["1", 0], "samples": ["3", 0], "fps": fps,
                                                              "filename_prefix": prefix, "codec": "h264", "crf": -1}}}


def _error_text(err) -> str:
    from ditkit.run import history_messages

    msgs = history_messages(err.entry, "execution_error")
    assert msgs, str(err)
    return msgs[0]["exception_type"] + ": " + msgs[0]["exception_message"]


def test_save_video_prefix_cannot_clobber_over_prompt(comfy_server, tmp_path):
    """NUL / control characters / over-long names / a symlinked sub-folder in ``filename_prefix``: every file that
    was there before (a video, a latent, a coefficient file, a file outside reached by a link) is byte-identical
    afterwards, no new file appeared, the error names the input, and the server keeps serving."""
    out = comfy_server.output_dir
    (out / "video").mkdir(parents=True, exist_ok=True)
    (out / "ditkit" / "teacache").mkdir(parents=True, exist_ok=True)
    victims = {out / "video" / "existing.mp4": b"an existing video",
               out / "video" / "existing_00001_.mp4": b"an existing counter video",
               out / "video" / "z.latent": b"an existing latent",
               out / "ditkit" / "teacache" / "h3.json": b'{"an": "existing coefficient file"}'}
    for p, data in victims.items():
        p.write_bytes(data)
    outside = tmp_path / "outside"
    outside.mkdir()
    if not (out / "linked").exists():
        os.symlink(outside, out / "linked")
    before = _snapshot(out)
    prefixes = {"video/existing.mp4\x00": "U+0000", "video/z.latent\x00x": "U+0000",
                "ditkit/teacache/h3.json\x00": "U+0000", "video/existing\x00": "U+0000",
                "video/line\nbreak": "U+000A", "video/" + "n" * 250: "bytes", "linked/x": "symlink",
                "../escape": "'..'", "/abs/x": "absolute"}
    for prefix, word in prefixes.items():
        err = comfy_server.run_expect_failure(_save_graph(prefix))
        text = _error_text(err)
        assert "DitKitError" in text and "filename_prefix" in text and word in text, (prefix, text)
        assert comfy_server.alive(), comfy_server.log_tail()
    assert _snapshot(out) == before, "a hostile filename_prefix changed the output folder"
    assert list(outside.iterdir()) == []
    entry = comfy_server.run(_save_graph("video/existing"))   # the same prefix without the NUL: a new file
    files = [f for f in comfy_server.output_files(entry) if str(f).endswith(".mp4")]
    assert [f.name for f in files] == ["existing_00002_.mp4"], files
    for p, data in victims.items():
        assert p.read_bytes() == data, p
