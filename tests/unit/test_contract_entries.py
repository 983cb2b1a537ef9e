"""The host contract's 0.33 entries (``bridge/contract_entries.py``) without a host: the probe helpers on both sides
of each rule, every node id named exists, and every ComfyUI module ``bridge/`` imports is covered by an entry."""
from __future__ import annotations

import ast

import pytest

from ditkit.bridge import contract
from ditkit.bridge import contract_entries as ce
from ditkit.bridge.contract import Probe
from tests.support.pack_scan import PACK_ROOT, node_declarations
from tests.unit.test_host_layer import host_imports


# ------------------------------------------------------------------------------------------------ check_params

def f_exact(x, t_emb, mod_segments, rope_freqs, transformer_options={}):
    pass


def f_new_optional(x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
    pass


def f_new_required(x, t_emb, mod_segments, rope_freqs, transformer_options, attention):
    pass


def f_renamed(x, t_emb, segments, rope_freqs, transformer_options={}):
    pass


def f_reordered(x, mod_segments, t_emb, rope_freqs, transformer_options={}):
    pass


def f_varargs(x, t_emb, mod_segments, rope_freqs, transformer_options={}, *args, **kwargs):
    pass


class Host:
    def method(self, sd, metadata=None):
        pass


NAMES = ("x", "t_emb", "mod_segments", "rope_freqs", "transformer_options")


@pytest.mark.parametrize("fn, state, note", [
    (f_exact, "holds", ""),
    (f_new_optional, "holds", ""),           # a host adding an optional parameter keeps ditkit's calls valid
    (f_varargs, "holds", ""),
    (f_new_required, "broken", "new required parameters ['attention']"),
    (f_renamed, "broken", "parameters ['mod_segments'] missing"),
    (f_reordered, "broken", "parameters in order ['x', 'mod_segments', 't_emb'"),
])
def test_check_params(fn, state, note):
    p = ce.check_params(fn, NAMES)
    assert p.state == state and note in p.note, p


def test_check_params_skips_self_and_reads_builtins_safely():
    assert ce.check_params(Host.method, ("sd", "metadata")) == Probe.holds()
    assert ce.check_params(Host().method, ("sd", "metadata")) == Probe.holds()
    p = ce.check_params(Host.method, ("metadata", "sd"))
    assert p.state == "broken" and "order" in p.note
    assert ce.check_params(dict.get, ("key",)).state in ("holds", "broken")   # never raises


def test_check_attrs():
    class Obj:
        a = 1

        def b(self):
            pass

    assert ce.check_attrs(Obj, ("a", "b")) == Probe.holds()
    p = ce.check_attrs(Obj, ("a", "_c", "d"))
    assert p == Probe.broken("attributes ['_c', 'd'] missing on Obj")


def test_resolve_walks_modules_then_attributes():
    import os.path

    assert ce.resolve("os.path.join") is os.path.join
    assert ce.resolve("ditkit.bridge.contract.Probe.holds") == Probe.holds
    with pytest.raises(AttributeError):
        ce.resolve("os.path.no_such_name")
    with pytest.raises(ImportError):
        ce.resolve("no_such_top_level_module_xyz.thing")


# ------------------------------------------------------------------------------------------------ the registry

def test_entries_are_registered_once_loaded():
    contract._load_entry_modules()
    assert "contract_entries" in contract.ENTRY_MODULES
    syms = [e.symbol for e in contract.entries() if e.probe.__module__ == ce.__name__]
    assert len(syms) == len(set(syms)) >= 50
    assert len(syms) == len(ce.SIGNATURES) + len(ce.ATTRIBUTES) + 7   # + the hand-written probes


def test_every_entry_names_existing_nodes():
    contract._load_entry_modules()
    ids = {d.node_id for d in node_declarations()}
    assert set(ce.ALL_NODES) == ids, set(ce.ALL_NODES) ^ ids   # the groups cover every node exactly
    for e in contract.entries():
        assert e.nodes, e.symbol
        assert set(e.nodes) <= ids, (e.symbol, set(e.nodes) - ids)
        assert e.what in ("symbol", "signature", "attributes", "behaviour", "feature"), e.symbol


def _bridge_host_modules() -> dict[str, list[str]]:
    """ComfyUI modules imported anywhere in bridge/ (but the contract's own probes) -> files."""
    out: dict[str, list[str]] = {}
    for p in sorted((PACK_ROOT / "bridge").glob("*.py")):
        if p.name.startswith("contract"):
            continue
        for _, m in host_imports(ast.parse(p.read_text(encoding="utf-8"))):
            if m != "comfyui_version":
                out.setdefault(m, []).append(p.name)
    return out


def test_every_host_module_bridge_imports_has_an_entry():
    """A new ``import comfy.x`` in bridge/ without a contract entry for comfy.x fails here."""
    contract._load_entry_modules()
    syms = [e.symbol for e in contract.entries()]
    mods = _bridge_host_modules()
    assert {"comfy.sd", "comfy.ldm.minimax.model", "folder_paths", "server"} <= set(mods)   # the scan sees them
    missing = {m: f for m, f in mods.items() if not any(s == m or s.startswith(m + ".") for s in syms)}
    assert not missing, f"host modules bridge/ imports without a host-contract entry: {missing}"
