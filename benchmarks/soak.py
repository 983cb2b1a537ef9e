"""API-queue soak: N prompts on one real ComfyUI host (tiny checkpoints), valid example workflows mixed with invalid
prompts and bad files from the corpus.

    python benchmarks/soak.py --comfyui /work/ComfyUI [-n 200] [--seed 0]

* ``--cache-none``: every prompt executes every node again (no output reuse between prompts);
* valid: every ``example_workflows/api/*.json`` plus an LTX text-encoder graph (so every DitKit node runs). Each is
  run twice during warm-up; when the two runs' output files hash the same the workflow is *deterministic* and every
  later run must reproduce those hashes (``--disable-metadata``, so files carry no prompt text);
* invalid: the corpus prompt cases (HTTP 400 node errors or a node execution error of the manifest type) and the
  corpus files placed in the server's model folders (node error of the manifest type and words);
* the server must stay alive; its resident memory (VmRSS of the server pid from /proc) after warm-up and at the end
  is printed, growth must stay under ``--max-rss-growth`` (10 %).

Prints ``prompts ok / failed-as-expected / unexpected`` (unexpected must be 0) and ``RSS start/end``; exit status 1
when anything unexpected happened. The ordering is a seeded shuffle, so a run is reproducible.

Rows (``--rows FILE``, ``benchmarks/_harness.py``; what the smoke test reads): case ``soak`` metrics ``prompts``,
``ok``, ``failed_as_expected``, ``unexpected``, ``server_alive`` (1/0), ``valid_workflows``,
``deterministic_workflows``, ``invalid_cases``, ``rss_boot`` / ``rss_start`` / ``rss_end`` (MiB), ``rss_growth``
(fraction after warm-up), ``wall`` (s); case ``warm-up <name>`` metric ``s_per_run`` (note: deterministic or not
compared); case ``unexpected #<k>`` metric ``what`` (the description in ``note``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

from benchmarks._harness import Rows, add_rows_argument  # noqa: E402
from ditkit.run import ComfyServer, WorkflowFailed, history_messages, output_files  # noqa: E402
from tests.support import corpus  # noqa: E402

CORPUS = REPO / "tests" / "corpus"
EXTRA_VALID = {
    "ltx_te_encode": {
        "1": {"class_type": "DitKitLTXTextEncoderLoader",
              "inputs": {"text_encoder": "gemma_tiny_ltx.safetensors", "streaming": "layerwise", "prefetch": 1}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": "a lighthouse in the fog"}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
    },
}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def file_hashes(entry, out_dir, temp_dir) -> list[str]:
    out = []
    for p in output_files(entry, out_dir, temp_dir):
        p = Path(p)
        out.append(hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else f"missing:{p.name}")
    return sorted(out)


def valid_workflows() -> dict[str, dict]:
    wfs = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted((REPO / "example_workflows" / "api").glob("*.json"))}
    wfs.update(EXTRA_VALID)
    return wfs


def invalid_cases(server) -> list[dict]:
    """Corpus prompts + corpus files placed where their node reads them (as tests/integration/test_corpus_host.py)."""
    sys.path.insert(0, str(REPO / "tests" / "integration"))
    from test_corpus_host import graph_for  # noqa: E402  (same graphs as the host test)

    from ditkit.loaders.safetensors_io import load_file, read_header, save_file

    cases = json.loads((CORPUS / corpus.MANIFEST).read_text(encoding="utf-8"))["cases"]
    teacache = server.out_dir / "ditkit" / "teacache"
    teacache.mkdir(parents=True, exist_ok=True)
    image_vae = load_file(server.models_dir / "vae" / corpus.H3_IMAGE_VAE)
    out = []
    for c in cases:
        if c["consumer"] == "prompt":
            graph = json.loads((CORPUS / c["file"]).read_text(encoding="utf-8"))
            out.append({"id": c["id"], "graph": graph, "expect": c["host"]["expect"], "error": c["error"],
                        "words": c["words"], "node": c["host"]["node"]})
            continue
        if c["host"] is None:
            continue
        name = "soak__" + c["file"]
        folder = c["host"]["folder"]
        dst = (teacache if folder.startswith("output:") else server.models_dir / folder) / name
        if c["host"].get("as"):  # a folder holding the file under the name the node looks for (as the host test)
            dst.mkdir(exist_ok=True)
            shutil.copyfile(CORPUS / c["file"], dst / c["host"]["as"])
        elif c["consumer"] == "vae_metadata":
            save_file(image_vae, dst, metadata=read_header(CORPUS / c["file"]).metadata)
        else:
            shutil.copyfile(CORPUS / c["file"], dst)
        out.append({"id": c["id"], "graph": graph_for(c["consumer"], name), "expect": "execution", "error": c["error"],
                    "words": c["words"], "node": None})
    return out


def check_invalid(server, case) -> str | None:
    """None when the prompt failed exactly as expected, else what happened."""
    client = server.client
    if case["expect"] == "validation":
        status, body = client.post_prompt(case["graph"])
        errs = ((body or {}).get("node_errors") or {}).get(case["node"], {}).get("errors") or []
        if status != 400 or not errs:
            return f"HTTP {status}, node errors {str(body)[:200]}"
        if case["error"] != "*" and not any(e.get("type") == case["error"] for e in errs):
            return f"node error types {[e.get('type') for e in errs]}"
        return None if all(w in json.dumps(errs) for w in case["words"]) else f"words {case['words']} not in {errs}"
    try:
        entry = client.run(case["graph"], timeout=600)
    except WorkflowFailed as e:
        msgs = history_messages(e.entry, "execution_error") if e.entry else []
        if not msgs:
            return f"not an execution error: {str(e)[:200]}"
        etype, msg = msgs[0]["exception_type"].rsplit(".", 1)[-1], msgs[0]["exception_message"]
        if etype != case["error"] or not all(w in msg for w in case["words"]):
            return f"{etype}: {msg[:200]}"
        return None
    return f"succeeded: {list((entry.get('outputs') or {}))}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfyui", required=True)
    ap.add_argument("-n", type=int, default=200, help="prompts after warm-up (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--invalid-fraction", type=float, default=0.5)
    ap.add_argument("--max-rss-growth", type=float, default=0.10)
    ap.add_argument("--python", default=None, help="interpreter of the host (default: the checkout's venv)")
    ap.add_argument("--only", nargs="*", help="valid workflow names to use (default: all)")
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    rows = Rows(a.rows, "soak")

    work = Path(tempfile.mkdtemp(prefix="ditkit_soak_"))
    server = ComfyServer(a.comfyui, python=a.python, out_dir=work / "output", log_path=work / "server.log",
                         extra_args=["--disable-metadata", "--cache-none"], only_ditkit=True, quiet=True)
    t0 = time.monotonic()
    try:
        server.start(timeout=300)
        pid = server.proc.pid
        rss_boot = rss_kib(pid)
        valid = valid_workflows()
        if a.only:
            valid = {k: v for k, v in valid.items() if k in a.only}
        invalid = invalid_cases(server)
        ref: dict[str, list[str] | None] = {}
        unexpected: list[str] = []
        warm_s = {}
        for name, g in valid.items():  # warm-up: two runs each, reference hashes where deterministic
            hs = []
            for _ in range(2):
                t = time.monotonic()
                try:
                    entry = server.client.run(g, timeout=900)
                    hs.append(file_hashes(entry, server.out_dir, server.temp_dir))
                except WorkflowFailed as e:
                    unexpected.append(f"warm-up {name}: {str(e)[:300]}")
                    hs.append(None)
                warm_s[name] = round(time.monotonic() - t, 1)
            ref[name] = hs[0] if hs[0] is not None and hs[0] == hs[1] else None
            print(f"warm-up {name}: {warm_s[name]} s/run, {'deterministic' if ref[name] else 'not compared'} "
                  f"({len(hs[0] or [])} files)", flush=True)
            rows.add(f"warm-up {name}", "s_per_run", warm_s[name], "s",
                     note=f"{'deterministic' if ref[name] else 'not compared'}, {len(hs[0] or [])} files")
        rss_start = rss_kib(pid)
        rng = random.Random(a.seed)
        plan = []
        for _ in range(a.n):
            if invalid and rng.random() < a.invalid_fraction:
                plan.append(("invalid", rng.choice(invalid)))
            else:
                plan.append(("valid", rng.choice(sorted(valid))))
        ok = failed_ok = 0
        rss_trace = []
        for i, (kind, item) in enumerate(plan):
            if kind == "valid":
                try:
                    entry = server.client.run(valid[item], timeout=900)
                    hs = file_hashes(entry, server.out_dir, server.temp_dir)
                    if ref.get(item) is not None and hs != ref[item]:
                        unexpected.append(f"#{i} {item}: outputs differ from the first run ({hs} vs {ref[item]})")
                    else:
                        ok += 1
                except WorkflowFailed as e:
                    unexpected.append(f"#{i} {item}: {str(e)[:300]}")
            else:
                why = check_invalid(server, item)
                if why is None:
                    failed_ok += 1
                else:
                    unexpected.append(f"#{i} invalid {item['id']}: {why}")
            if server.proc.poll() is not None:
                unexpected.append(f"#{i}: server died (exit {server.proc.returncode})")
                break
            if i % 20 == 19:
                rss_trace.append(rss_kib(pid))
                print(f"[{i + 1}/{a.n}] ok {ok} failed-as-expected {failed_ok} unexpected {len(unexpected)} "
                      f"RSS {rss_trace[-1] / 1024:.0f} MiB", flush=True)
        alive = server.proc.poll() is None
        rss_end = rss_kib(pid) if alive else -1
        growth = (rss_end - rss_start) / rss_start if alive else float("inf")
        if growth > a.max_rss_growth:
            unexpected.append(f"RSS grew {growth * 100:.1f} % after warm-up (limit {a.max_rss_growth * 100:.0f} %)")
        n_det = sum(1 for v in ref.values() if v)
        print(f"valid workflows: {len(valid)} ({n_det} deterministic, outputs compared); invalid cases: {len(invalid)}")
        print(f"prompts ok / failed-as-expected / unexpected: {ok} / {failed_ok} / {len(unexpected)}")
        print(f"RSS boot {rss_boot / 1024:.0f} MiB, start (after warm-up) {rss_start / 1024:.0f} MiB, "
              f"end {rss_end / 1024:.0f} MiB, growth {growth * 100:+.1f} %; trace MiB "
              f"{[round(r / 1024) for r in rss_trace]}")
        wall = time.monotonic() - t0
        print(f"server alive: {alive}; wall {wall:.0f} s")
        for u in unexpected:
            print("UNEXPECTED:", u)
        for k, v, unit in (("prompts", a.n, ""), ("ok", ok, ""), ("failed_as_expected", failed_ok, ""),
                           ("unexpected", len(unexpected), ""), ("server_alive", int(alive), ""),
                           ("valid_workflows", len(valid), ""), ("deterministic_workflows", n_det, ""),
                           ("invalid_cases", len(invalid), ""), ("rss_boot", rss_boot / 1024, "MiB"),
                           ("rss_start", rss_start / 1024, "MiB"), ("rss_end", rss_end / 1024, "MiB"),
                           ("rss_growth", growth, "fraction"), ("wall", wall, "s")):
            rows.add("soak", k, v, unit)
        for k, u in enumerate(unexpected):
            rows.add(f"unexpected #{k}", "what", 1, note=u)
        return 0 if not unexpected and alive else 1
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
