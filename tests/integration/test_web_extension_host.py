"""ComfyUI's own custom-node loader serves web/js/ditkit.js exactly once, whatever the pack folder is called.

ComfyUI 0.33 (``nodes.load_custom_node``) registers a web folder from the module's ``WEB_DIRECTORY`` under the
folder's name and from pyproject ``[tool.comfy] web`` under the project name; ``/extensions`` then lists every
``.js`` file of every registered folder. The test servers link the pack as ``ditkit`` (both keys are 'ditkit', so
a duplicate hides); here it is loaded from a link named ``ditkit-main`` (a plain ``git clone`` into a folder of
another name) in a fresh host interpreter, and the ``/extensions`` listing is built from the loader's table the
way ComfyUI's server builds it. A fresh host interpreter imports ComfyUI and the whole pack: 155 s measured on
a busy 2-core machine (not marked slow: it is the only check of what ComfyUI's loader does with the pack).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, glob, json, os, sys, urllib.parse
comfy, link = sys.argv[1], sys.argv[2]
sys.path.insert(0, comfy)
os.chdir(comfy)
sys.argv = [sys.argv[0], "--cpu"]
from comfy.cli_args import args
args.cpu = True
import nodes
ok = asyncio.run(nodes.load_custom_node(link))
urls = []
for name, d in nodes.EXTENSION_WEB_DIRS.items():   # server.py get_extensions
    for f in glob.glob(os.path.join(glob.escape(d), "**/*.js"), recursive=True):
        urls.append("/extensions/" + urllib.parse.quote(name) + "/" + os.path.relpath(f, d).replace(os.sep, "/"))
print("RESULT " + json.dumps({"loaded": ok, "dirs": nodes.EXTENSION_WEB_DIRS, "urls": urls}))
"""


def _python(comfyui_path: Path) -> str:
    for cand in (os.environ.get("COMFYUI_PYTHON"), comfyui_path / "venv" / "bin" / "python",
                 comfyui_path / ".venv" / "bin" / "python"):
        if cand and Path(cand).exists():
            return str(cand)
    return sys.executable


def test_extension_is_served_once_from_a_folder_not_named_ditkit(comfyui_path, tmp_path):
    link = tmp_path / "ditkit-main"
    link.symlink_to(REPO, target_is_directory=True)
    r = subprocess.run([_python(comfyui_path), "-c", SCRIPT, str(comfyui_path), str(link)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["loaded"], r.stderr[-3000:]
    ours = [u for u in res["urls"] if u.endswith("/js/ditkit.js")]
    assert ours == ["/extensions/ditkit-main/js/ditkit.js"], (ours, res["dirs"])
