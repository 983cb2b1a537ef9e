"""The cpu_native kernel build says so on the node that waits for it (progress text through ComfyUI's
PromptServer), before the build starts and when it is done; a failed build says why. The compiler is replaced by
a stub here (the real build is covered by tests/unit/test_kernels_cpu_native.py)."""
from __future__ import annotations

import pytest


@pytest.fixture
def sent(comfy, monkeypatch):
    import server
    from torch.utils import cpp_extension

    from ditkit.kernels import block_sparse_cpu_native as native
    from ditkit.nodes import _native_build

    got = []

    class Inst:
        def send_progress_text(self, text, node_id, sid=None):
            got.append((node_id, text))

    monkeypatch.setattr(server.PromptServer, "instance", Inst(), raising=False)
    monkeypatch.setattr(_native_build, "_executing", lambda: ("prompt", "9"))
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native.shutil, "which", lambda name: "/usr/bin/" + name)
    return got, native, cpp_extension


def test_build_start_and_end_reach_the_executing_node(sent, monkeypatch):
    got, native, cpp_extension = sent
    seen_during = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen_during.append(list(got)) or object())
    native.load_extension()
    assert seen_during == [[("9", "cpu_native: building the CPU kernel, about a minute, once (cached afterwards)")]]
    assert got[-1] == ("9", "cpu_native: CPU kernel ready")
    native.load_extension()          # built: nothing more is said
    assert len(got) == 2


def test_a_failed_build_says_why(sent, monkeypatch):
    got, native, cpp_extension = sent

    def fail(**kw):
        raise OSError("ninja is required")

    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.raises(RuntimeError, match="ninja is required"):
        native.load_extension()
    assert got[-1][0] == "9" and "ninja is required" in got[-1][1], got
