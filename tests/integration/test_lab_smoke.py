"""Fast smoke of the quality-lab harness on the committed trained lab weights (needs COMFYUI_PATH).

Runs ``benchmarks/lab/harness.py --smoke`` in a subprocess (it points ComfyUI's output directory at a scratch
folder, so it must not share this process) and checks that the table has every required row and that the
T=1 rows are measured. The smoke decodes one held-out clip (3 frames), too few to size the T=1 gap; the gap itself
is asserted on 24 clips by tests/unit/test_lab_ref_vae.py. Here what is asserted is that ditkit's
DitKitH3VAEDecode, when present, matches the lab's own repeat-decode reference figure (same algorithm,
independent code).
"""
import os
import re
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "benchmarks" / "lab"
WEIGHTS = [LAB / "weights" / n for n in ("h3lab_video_vae.safetensors", "h3lab_dit.safetensors",
                                         "h3lab_text_embed.safetensors")]


def _row(out: str, label: str) -> list[str]:
    for line in out.splitlines():
        if line.startswith(label) and " | " in line:
            return [c.strip() for c in line.split("|")]
    raise AssertionError(f"row {label!r} missing from the harness table:\n{out}")


def _db(cell: str) -> float:
    m = re.match(r"(-?[\d.]+) dB", cell)
    assert m, f"expected a dB figure, got {cell!r}"
    return float(m.group(1))


def test_lab_harness_smoke(comfyui_path):
    missing = [str(p) for p in WEIGHTS if not p.is_file()]
    assert not missing, f"lab weights missing: {missing} (run benchmarks/lab/train_vae.py and train_dit.py)"
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path))
    proc = subprocess.run([sys.executable, str(LAB / "harness.py"), "--smoke"], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, f"harness failed ({proc.returncode}):\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    native = _row(out, "T=1 decode: native single token")
    repeat = _row(out, "T=1 decode: repeat-decode")
    in_clip = _row(out, "(same frames decoded inside their clip)")
    for r in (native, repeat, in_clip):
        assert 10.0 < _db(r[3]) < 60.0, r  # a trained decoder: far above noise, below identity
    dk = _row(out, "T=1 decode: DitKitH3VAEDecode")
    if dk[3] != "-":
        assert abs(_db(dk[3]) - _db(repeat[3])) < 0.05, (dk, repeat)
    exact = _row(out, "exact path (reference)")
    assert exact[3] == "inf"
    # classifier-free guidance really runs: two transformer passes (prompt, null prompt) per step when cfg != 1
    head = re.search(r"(\d+) prompt\(s\) x (\d+) seed\(s\), (\d+) euler steps, cfg ([\d.]+)", out)
    assert head, f"harness header missing:\n{out}"
    samples, steps, cfg = int(head.group(1)) * int(head.group(2)), int(head.group(3)), float(head.group(4))
    passes = re.search(r"(\d+) samples, (\d+) steps, (\d+) passes", exact[-1])
    assert passes and int(passes.group(1)) == samples and int(passes.group(2)) == steps, exact
    assert int(passes.group(3)) == samples * steps * (1 if cfg == 1 else 2), (exact, cfg)
    for label in ("T=1 decode: DitKitH3VAEDecode", "TeaCache", "EasyCache", "Sparse attention"):
        row = _row(out, label)
        notes = row[-1]
        # either measured figures, or an explicit reason why not
        assert row[3] != "-" or notes.startswith(("not available", "error")), row
    ease = _row(out, "EasyCache")
    assert ease[3] != "-", f"stock EasyCache must always be measurable: {ease}"
    assert "prompt adherence" in out
