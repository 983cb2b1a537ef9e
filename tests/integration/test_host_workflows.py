"""Every example workflow runs to completion on the real host, and its UI twin matches the live schemas."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ditkit.run import REPO
from ditkit import workflows as wfm

TEST_GRAPHS = REPO / "tests" / "data" / "workflows"   # test and smoke graphs (not examples), same layout
API = wfm.api_workflows() + wfm.api_workflows(TEST_GRAPHS)
IDS = [("test:" if TEST_GRAPHS in p.parents else "") + p.stem for p in API]
EXAMPLES = wfm.api_workflows()


@pytest.mark.parametrize("path", API, ids=IDS)
def test_example_workflow_runs(comfy_server, path):
    graph = json.loads(path.read_text(encoding="utf-8"))
    entry = comfy_server.run(graph)
    assert entry["status"]["status_str"] == "success"
    assert entry.get("outputs"), f"{path.name}: no output node produced anything"
    for f in comfy_server.output_files(entry):
        assert f.is_file() and f.stat().st_size > 0, f"{path.name}: output {f} missing or empty"
    errors = [m for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
    assert not errors


@pytest.mark.parametrize("path", API, ids=IDS)
def test_ui_twin_converts_back_with_live_schemas(comfy_server, path):
    twin = wfm.twin_path(path)
    assert twin.is_file(), f"{twin} missing: run `python -m ditkit.workflows sync`"
    api = json.loads(path.read_text(encoding="utf-8"))
    ui = json.loads(twin.read_text(encoding="utf-8"))
    info = comfy_server.object_info()
    assert wfm.strip_meta(wfm.ui_to_api(ui, info)) == wfm.as_ui_would_send(api, info)
    assert wfm.twin_of(path, info) == ui, "twin differs from a conversion with live schemas"


def test_twins_embed_the_live_schemas(comfy_server):
    if not API:
        pytest.skip("no example workflows")
    info = comfy_server.object_info()
    drift = wfm.schema_drift(info) + wfm.schema_drift(info, TEST_GRAPHS)
    assert not drift, f"twins embed outdated node schemas (run sync --comfyui PATH): {drift}"


def _runner(*args, timeout=300):
    """``python -m ditkit.run ...`` with this interpreter (ditkit installed with ``pip install -e .``)."""
    return subprocess.run([sys.executable, "-m", "ditkit.run", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=str(REPO))


SMOKE = {"1": {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 24, "batch_size": 1, "color": 255}},
         "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "runner/smoke"}}}


def test_runner_cli_against_running_server(comfy_server, tmp_path):
    wf = tmp_path / "smoke.json"
    wf.write_text(json.dumps(SMOKE))
    r = _runner(wf, "--server", comfy_server.url, "--out", tmp_path / "dl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: workflow finished" in r.stdout
    pngs = list((tmp_path / "dl" / "runner").glob("smoke_*.png"))
    assert len(pngs) == 1 and pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stdout


def test_runner_cli_runs_ui_format(comfy_server, tmp_path):
    info = comfy_server.object_info()
    wf = tmp_path / "smoke_ui.json"
    wf.write_text(json.dumps(wfm.api_to_ui(SMOKE, info, name="smoke")))
    r = _runner(wf, "--server", comfy_server.url)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "runner/smoke_" in r.stdout


def test_runner_cli_reports_validation_errors(comfy_server, tmp_path):
    bad = json.loads(json.dumps(SMOKE))
    bad["1"]["inputs"]["width"] = -3
    wf = tmp_path / "bad.json"
    wf.write_text(json.dumps(bad))
    r = _runner(wf, "--server", comfy_server.url)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "node 1 (EmptyImage) input 'width'" in r.stderr, r.stderr


def _readme_main_command() -> list[str]:
    """The README's main job, as written there: the ``python -m ditkit.run ...`` part of its install line."""
    import shlex

    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if "python -m ditkit.run " in ln and "&&" in ln]
    assert len(lines) == 1, f"README: expected one install + run line, found {lines}"
    part = [p.strip() for p in lines[0].split("&&") if "python -m ditkit.run " in p][0]
    argv = shlex.split(part)
    assert argv[:3] == ["python", "-m", "ditkit.run"], argv
    return argv[3:]


def test_readme_main_command_makes_an_mp4_with_its_audio_track(comfyui_path, tmp_path):
    """The README's main job exactly as written (no --models, no --out, no --server): it starts ComfyUI itself,
    generates the tiny checkpoints, queues the t2va example, prints the output files and stops the server by pid.
    The MP4 it names holds a video stream and an audio stream with decodable frames (PyAV). On ditkit's cached
    host no --comfyui is given either (a host given by COMFYUI_PATH is passed on)."""
    import av

    from ditkit.host import read_marker

    cached = read_marker(comfyui_path) is not None and not os.environ.get("COMFYUI_PATH")
    where = [] if cached else ["--comfyui", comfyui_path]
    r = _runner(*_readme_main_command(), *where, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    origin = "cached host" if cached else "--comfyui"
    assert f"ComfyUI host: {comfyui_path} (from {origin})" in r.stdout, r.stdout
    assert "OK: workflow finished" in r.stdout, r.stdout
    m = [ln for ln in r.stderr.splitlines() if "stopped (exit status" in ln]
    assert m, r.stderr
    pid = int(m[0].split("server pid ")[1].split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    listed = r.stdout.split("output files:", 1)[1].split()
    mp4s = [Path(p) for p in listed if p.endswith(".mp4")]
    assert len(mp4s) == 1 and mp4s[0].is_file(), r.stdout
    try:
        with av.open(str(mp4s[0])) as c:
            assert len(c.streams.video) == 1 and len(c.streams.audio) == 1, (c.streams.video, c.streams.audio)
            v, a = c.streams.video[0], c.streams.audio[0]
            assert (v.codec_context.width, v.codec_context.height) == (64, 64)
            frames = sum(1 for _ in c.decode(v))
        with av.open(str(mp4s[0])) as c:
            samples = sum(f.samples for f in c.decode(c.streams.audio[0]))
    finally:
        mp4s[0].unlink(missing_ok=True)  # written into the host's output folder, as the README's run does
    assert frames == 22, frames
    assert a.codec_context.name == "aac" and samples > 0, (a.codec_context.name, samples)


def test_ltx2_example_ends_in_a_playable_mp4(comfy_server, tmp_path):
    """The LTX-2 example (the tiny LTX-2 DiT quantized to float8_e4m3fn while loading by DitKitLTX2ModelLoader,
    ditkit's LTX text encoder, the tiny LTX-2 video VAE through the stock VAELoader, DitKitSaveVideo) queued by the
    runner: the loader reports the fp8 load of the LTX-2 config, and one MP4 whose video stream decodes to the 17
    frames of the 17-frame latent request, 64 x 64 (PyAV)."""
    import av

    r = _runner(REPO / "example_workflows" / "api" / "ltx2_t2v_tiny.json", "--server", comfy_server.url,
                "--out", tmp_path / "dl", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    loads = [ln for ln in (r.stdout + r.stderr).splitlines() if "DitKitLTX2ModelLoader" in ln and "LTX-2 (ltxav)" in ln]
    assert loads and "quantized float8_e4m3fn (weight-only): quantized block attention" in loads[-1], r.stdout
    mp4s = [Path(p) for p in r.stdout.split("output files:", 1)[1].split() if p.endswith(".mp4")]
    assert len(mp4s) == 1 and mp4s[0].is_file(), r.stdout
    with av.open(str(mp4s[0])) as c:
        assert len(c.streams.video) == 1 and not c.streams.audio, (c.streams.video, c.streams.audio)
        v = c.streams.video[0]
        assert (v.codec_context.width, v.codec_context.height) == (64, 64)
        assert sum(1 for _ in c.decode(v)) == 17


def test_template_browser_lists_the_examples_with_previews(comfy_server):
    """ComfyUI serves the pack's example_workflows/*.json to its template browser (/workflow_templates lists the
    names per pack folder) and the preview the frontend asks for (<name>.jpg under /api/workflow_templates/)."""
    import urllib.request

    with urllib.request.urlopen(f"{comfy_server.url}/workflow_templates", timeout=30) as r:  # noqa: S310 - loopback
        listing = json.loads(r.read())
    names = sorted(p.stem for p in EXAMPLES)
    packs = [k for k, v in listing.items() if set(names) <= set(v)]
    assert packs, listing
    assert not [n for n in listing[packs[0]] if n not in names], "test graphs are listed as templates"
    for n in names:
        with urllib.request.urlopen(f"{comfy_server.url}/api/workflow_templates/{packs[0]}/{n}.jpg", timeout=30) as r:  # noqa: S310
            assert r.headers.get("Content-Type", "").startswith("image/jpeg") and r.read()[:3] == b"\xff\xd8\xff"


def test_live_node_names_and_categories_follow_the_scheme(comfy_server):
    """The same naming rules as tests/unit/test_node_naming.py, on what the real server serves (/object_info)."""
    from tests.unit.test_node_naming import NODE_IDS, naming_problems

    info = comfy_server.object_info()
    live = {k: {"display_name": v.get("display_name"), "category": v.get("category"),
                "is_experimental": v.get("experimental"), "description": v.get("description"),
                "search_aliases": v.get("search_aliases")} for k, v in info.items() if k.startswith("DitKit")}
    import importlib.util

    # the Ray variants are registered only when Raylight is installed (nodes/raylight.py)
    ray_only = {"DitKitRaySparseAttention", "DitKitRayAdaLNCache", "DitKitRayTeaCache", "DitKitRayFastH3Schedule"}
    assert set(live) == (NODE_IDS if importlib.util.find_spec("raylight") else NODE_IDS - ray_only)
    problems = naming_problems(live)
    assert not problems, "\n".join(problems)


def test_teacache_example_skips_out_of_the_box(comfy_server):
    """The TeaCache example uses the shipped coefficients of the tiny H3 the runner generates: it skips steps and
    the fingerprint guard finds nothing to warn about (same weights, steps, schedule, sampler, cfg)."""
    import re

    graph = json.loads((REPO / "example_workflows" / "api" / "h3_teacache_tiny.json").read_text(encoding="utf-8"))
    assert graph["5"]["inputs"]["coefficients"] == "shipped:h3_tiny_calibrated"
    before = len(re.findall(r"TeaCache h3: computed", comfy_server.log_text()))
    entry = comfy_server.run(graph)
    assert entry["status"]["status_str"] == "success"
    lines = [ln for ln in comfy_server.log_text().splitlines() if "TeaCache h3: computed" in ln][before:]
    assert lines, "no TeaCache run report"
    m = re.search(r"computed (\d+)/(\d+) calls, skipped (\d+)", lines[-1])
    assert m and int(m[3]) >= 1 and int(m[2]) == 8, lines[-1]
    assert "WARNING" not in lines[-1] and "mismatch" not in lines[-1], lines[-1]


def test_stepcache_example_skips_and_its_audio_is_clean(comfy_server):
    """The first-block step cache example needs no file: it skips calls on the tiny H3, and its MP4's audio passes
    the audio guard (the save node is set to refuse, so a faulty track would fail the run)."""
    import re

    graph = json.loads((REPO / "example_workflows" / "api" / "h3_stepcache_tiny.json").read_text(encoding="utf-8"))
    assert graph["5"]["class_type"] == "DitKitStepCache" and graph["5"]["inputs"]["mode"] == "first_block"
    assert graph["23"]["inputs"]["audio_guard"] == "refuse"
    before = len(re.findall(r"Step cache \(first-block residual\) h3: computed", comfy_server.log_text()))
    entry = comfy_server.run(graph)
    assert entry["status"]["status_str"] == "success"
    log = comfy_server.log_text()
    lines = [ln for ln in log.splitlines() if "Step cache (first-block residual) h3: computed" in ln][before:]
    assert lines, "no step cache run report"
    m = re.search(r"computed (\d+)/(\d+) calls, skipped (\d+)", lines[-1])
    assert m and int(m[3]) >= 1 and int(m[2]) == 8, lines[-1]
    assert [ln for ln in log.splitlines() if "audio guard: clean" in ln], "no clean audio-guard report"
    files = comfy_server.output_files(entry)
    assert any(str(f).endswith(".mp4") and f.stat().st_size > 0 for f in files)


def test_preflight_example_badge_shows_predicted_vs_available(comfy_server):
    """The preflight example: DitKitActivationChunking (16-token chunks, 1 head per call) then DitKitPreflight on the
    tiny H3; the preflight's badge (its ui report, kept in /history) shows the predicted peak against the free RAM,
    the packed token count is the one the latent holds (independent count: 64x64 px / 16 VAE / 2x2 patch = 2x2
    patches per latent frame, 22 frames = 7 latent frames (5k+2), audio round(22/24*40) = 37 latents x 2 channels),
    the sampler-time check ran with the real conditioning, and an MP4 is written."""
    import re

    graph = json.loads((REPO / "example_workflows" / "api" / "h3_preflight_tiny.json").read_text(encoding="utf-8"))
    assert graph["8"]["class_type"] == "DitKitPreflight" and graph["8"]["inputs"]["model"] == ["5", 0]
    assert graph["5"]["class_type"] == "DitKitActivationChunking" and graph["6"]["inputs"]["model"] == ["8", 0]
    before = len(re.findall(r"DitKitPreflight #\S+ preflight: sampler check", comfy_server.log_text()))
    entry = comfy_server.run(graph)
    assert entry["status"]["status_str"] == "success"
    rep = entry["outputs"]["8"]["ditkit_report"][0]
    d = rep["data"]
    assert d["fits"] is True and 0 < d["predicted_bytes"] <= d["available_bytes"], d
    m = re.search(r"predicted peak ([\d.]+) GiB vs ([\d.]+) GiB (.*?) \[", rep["summary"])
    assert m, rep["summary"]
    assert abs(float(m[1]) - d["predicted_bytes"] / 2**30) < 0.01 and abs(float(m[2]) - d["available_bytes"] / 2**30) < 0.01
    assert "chunk 16" in rep["summary"] and rep["summary"].endswith(": fits"), rep["summary"]
    assert graph["8"]["inputs"]["vae"] == ["20", 0] and d["decode_bytes"] > 0 and "VAE decode" in rep["summary"]
    assert d["predicted_bytes"] == max(d["step_bytes"], d["decode_bytes"])
    assert d["tokens"]["video"] == 7 * 2 * 2 and d["tokens"]["audio"] == 2 * 37, d["tokens"]
    assert 0 < d["tokens"]["text"] != 512 and d["tokens"]["refs"] == 0 and d["tokens"]["keyframes"] == 0
    chunk = entry["outputs"]["5"]["ditkit_report"][0]["summary"]
    assert "feed-forwards chunked, 16 tokens" in chunk and "groups of 1 heads" in chunk, chunk
    lines = [ln for ln in comfy_server.log_text().splitlines()
             if re.search(r"DitKitPreflight #\S+ preflight: sampler check", ln)][before:]
    assert lines and ": fits" in lines[-1], lines
    # the node counted the prompt's rows from its positive input: the sampler check (real conditioning) agrees
    assert f"{d['tokens']['total']:,} tokens (video 28, audio 74, text {d['tokens']['text']:,}," in lines[-1], lines[-1]
    files = comfy_server.output_files(entry)
    assert any(str(f).endswith(".mp4") and f.stat().st_size > 0 for f in files)
