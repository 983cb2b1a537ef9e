"""One naming scheme for every ditkit node (schema declarations, by AST; the live /object_info is checked in
tests/integration/test_node_naming_host.py with the same rules): display name ``<Thing> (ditkit)``, a category
from a fixed list, loaders of one family in one category, distinct names and search aliases for the two TeaCache
nodes. Node ids never change (the set is pinned here)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NODES_DIR = ROOT / "nodes"

CATEGORIES = {"ditkit/loaders", "ditkit/attention", "ditkit/cache", "ditkit/vae", "ditkit/sampling", "ditkit/latent"}
NODE_IDS = {"DitKitActivationChunking", "DitKitAdapterLoader", "DitKitPreflight", "DitKitRayAdaLNCache", "DitKitRaySparseAttention",
            "DitKitRayTeaCache", "DitKitRayFastH3Schedule", "DitKitFastH3Schedule", "DitKitH3AdaLNCache", "DitKitH3EmptyImageLatent", "DitKitH3EncodeImage",
            "DitKitH3ModelLoader", "DitKitH3TextEncoderLoader", "DitKitLTX2ModelLoader", "DitKitFlux2ModelLoader", "DitKitH3VAEDecode", "DitKitH3VAELoader",
            "DitKitLTXTextEncoderLoader", "DitKitLoKrLoader", "DitKitSaveVideo", "DitKitSparseAttention",
            "DitKitStepCache", "DitKitTeaCache", "DitKitTeaCacheCalibrate", "DitKitZImageLoader"}
NAME = re.compile(r"^(?!DitKit)[A-Z][A-Za-z0-9.\-/ ]*[A-Za-z0-9] \(ditkit\)$")


def declared() -> dict[str, dict]:
    out = {}
    for path in sorted(NODES_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        consts = {t.id: st.value.value for st in tree.body if isinstance(st, ast.Assign)
                  and isinstance(st.value, ast.Constant) for t in st.targets if isinstance(t, ast.Name)}
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "Schema":
                kw = {k.arg: k.value for k in call.keywords}

                def lit(v):
                    if isinstance(v, ast.Constant):
                        return v.value
                    if isinstance(v, ast.Name):
                        return consts.get(v.id)
                    if isinstance(v, ast.List):
                        return [lit(e) for e in v.elts]
                    return None

                out[lit(kw["node_id"])] = {k: lit(kw.get(k)) for k in ("display_name", "category", "search_aliases",
                                                                        "is_experimental", "description")}
    return out


def naming_problems(nodes: dict[str, dict]) -> list[str]:
    out = []
    for nid, s in sorted(nodes.items()):
        name, cat = s.get("display_name") or "", s.get("category") or ""
        if not NAME.match(name):
            out.append(f"{nid}: display name {name!r} is not '<Thing> (ditkit)'")
        if cat not in CATEGORIES:
            out.append(f"{nid}: category {cat!r} not in {sorted(CATEGORIES)}")
        if nid.endswith(("Loader",)) and cat != "ditkit/loaders":
            out.append(f"{nid}: a loader outside ditkit/loaders ({cat!r})")
    names = [s.get("display_name") for s in nodes.values()]
    if len(set(names)) != len(names):
        out.append(f"duplicate display names: {sorted(names)}")
    tc, cal = nodes.get("DitKitTeaCache"), nodes.get("DitKitTeaCacheCalibrate")
    if tc and cal:
        shared = set(tc.get("search_aliases") or []) & set(cal.get("search_aliases") or [])
        if shared:
            out.append(f"TeaCache and TeaCache Calibrate share search aliases {sorted(shared)}")
        strip = lambda n: re.sub(r"[^a-z]", "", (n or "").lower())  # noqa: E731
        if strip(tc["display_name"]).startswith(strip(cal["display_name"])[:-len("ditkit")]) \
                or strip(cal["display_name"]).startswith(strip(tc["display_name"])[:-len("ditkit")]):
            out.append("one TeaCache display name is a prefix of the other")
        for s, nid in ((tc, "DitKitTeaCache"), (cal, "DitKitTeaCacheCalibrate")):
            if s.get("is_experimental") and "xperimental" not in (s.get("description") or ""):
                out.append(f"{nid} is experimental without saying why in its description")
    sc = nodes.get("DitKitStepCache")
    if sc:
        for other, nid in ((tc, "DitKitTeaCache"), (cal, "DitKitTeaCacheCalibrate")):
            shared = set(sc.get("search_aliases") or []) & set((other or {}).get("search_aliases") or [])
            if shared:
                out.append(f"DitKitStepCache and {nid} share search aliases {sorted(shared)}")
        if sc.get("is_experimental") and "xperimental" not in (sc.get("description") or ""):
            out.append("DitKitStepCache is experimental without saying why in its description")
    return out


def test_node_ids_do_not_change():
    assert set(declared()) == NODE_IDS


def test_display_names_and_categories_follow_the_scheme():
    nodes = declared()
    problems = naming_problems(nodes)
    assert not problems, "\n".join(problems)
    assert nodes["DitKitH3VAELoader"]["category"] == nodes["DitKitH3ModelLoader"]["category"]


def test_the_rules_can_fail():
    bad = {"DitKitA": {"display_name": "DitKit H3 Text Encoder Loader", "category": "ditkit/loaders"},
           "DitKitBLoader": {"display_name": "B (strict) (ditkit)", "category": "ditkit/h3"},
           "DitKitTeaCache": {"display_name": "TeaCache (calibrated, ditkit)", "category": "ditkit/cache",
                              "search_aliases": ["cache"], "is_experimental": True, "description": "x"},
           "DitKitTeaCacheCalibrate": {"display_name": "TeaCache Calibrate (ditkit)", "category": "ditkit/cache",
                                       "search_aliases": ["cache"]},
           "DitKitStepCache": {"display_name": "Step Cache (ditkit)", "category": "ditkit/cache",
                               "search_aliases": ["cache"], "is_experimental": True, "description": "y"}}
    p = "\n".join(naming_problems(bad))
    for needle in ("DitKitA: display name", "DitKitBLoader: display name", "'ditkit/h3' not in",
                   "a loader outside", "share search aliases", "without saying why",
                   "DitKitStepCache and DitKitTeaCache share", "DitKitStepCache is experimental without"):
        assert needle in p, (needle, p)
