"""House items of issue #28 (registry and review checks): the license file and its table, no merge leftovers, node
modules small enough to review (host code lives in bridge/, helpers in the core)."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.support.pack_scan import REPO_ROOT

MAX_NODE_MODULE_LINES = 300


def test_license_file_is_the_apache_2_text():
    text = (REPO_ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for n, title in enumerate(["Definitions", "Grant of Copyright License", "Grant of Patent License",
                               "Redistribution", "Submission of Contributions", "Trademarks",
                               "Disclaimer of Warranty", "Limitation of Liability",
                               "Accepting Warranty or Additional Liability"], start=1):
        assert f"{n}. {title}." in text, title
    assert "END OF TERMS AND CONDITIONS" in text and "http://www.apache.org/licenses/LICENSE-2.0" in text
    assert len(text.split()) > 1500   # the whole text, not a pointer to it


def test_license_is_declared_and_tabled():
    assert re.search(r'^license = "Apache-2.0"$', (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## License", 1)[1]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    assert len(rows) >= 4 and rows[1].replace(" ", "").startswith("|---|---|"), rows
    assert any("Apache-2.0" in r for r in rows) and any("(LICENSE)" in r for r in rows)


def _tracked() -> list[str]:
    r = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("not a git checkout")
    return r.stdout.splitlines()


def test_no_merge_leftovers_are_tracked_or_trackable():
    assert not [f for f in _tracked() if f.endswith((".orig", ".rej"))]
    assert "*.orig" in (REPO_ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()


NODE_MODULES = sorted((REPO_ROOT / "nodes").glob("*.py"))


@pytest.mark.parametrize("path", NODE_MODULES, ids=[p.name for p in NODE_MODULES])
def test_node_modules_stay_small(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_NODE_MODULE_LINES, (f"nodes/{path.name} has {n} lines (> {MAX_NODE_MODULE_LINES}): move host code "
                                        "to bridge/ and helpers to the core")


def test_the_size_check_sees_the_node_modules():
    assert {"h3_vae.py", "text_encoders.py", "teacache.py"} <= {p.name for p in NODE_MODULES}
