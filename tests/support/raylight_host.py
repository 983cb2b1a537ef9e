"""Raylight's real node classes in the in-process ComfyUI host on CPU (test code only; no Raylight code is copied).

``raylight_node_classes(src)`` imports ``raylight.nodes`` (and ``raylight.comfy_extra_dist.nodes_minimax_h3`` when the
checkout has it) from a Raylight checkout (``src``: the repository root or its ``src/``) with stand-ins for exactly
the imports that need a Ray cluster or CUDA and play no part in a node's schema:

* ``ray`` (a module whose ``remote`` / ``get`` / ``init`` are never called while schemas are read);
* ``raylight.distributed_worker.ray_worker`` (the Ray actor, NCCL tester and actor factory ``nodes.py`` imports by
  name); its real import needs ``ray`` and CUDA-only xFuser pieces.

``yunchang`` is the real package (pure Python; ``XFuser_attention``'s options are its ``AttnType`` members): it must be
importable, e.g. ``pip install --target DIR --no-deps yunchang==0.6.4`` and ``DITKIT_RAYLIGHT_DEPS=DIR``.
``object_info(classes)`` is what ComfyUI's ``/object_info`` serves for those V1 classes (the fields the workflow tools
read), through a JSON round trip as the server sends it.
"""
from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

STUBBED = ("ray", "ray.cloudpickle", "raylight.distributed_worker.ray_worker")


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__ditkit_stub__ = True
    return mod


def raylight_node_classes(src: str | os.PathLike, deps: str | None = None) -> dict[str, type]:
    """``{class_type: class}`` of Raylight's nodes (``raylight.nodes`` + its H3 nodes when present)."""
    root = Path(src)
    root = root / "src" if (root / "src" / "raylight").is_dir() else root
    if not (root / "raylight" / "nodes.py").is_file():
        raise FileNotFoundError(f"{src}: not a Raylight checkout (no src/raylight/nodes.py)")
    for p in (deps, str(root)):
        if p and p not in sys.path:
            sys.path.insert(0, p)
    never = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stand-in: no Ray cluster in a schema test"))  # noqa: E731
    sys.modules.setdefault("ray", _stub("ray", remote=lambda *a, **k: (lambda f: f) if not a else a[0], get=never,
                                        init=never, is_initialized=lambda: False, shutdown=lambda: None))
    sys.modules.setdefault("ray.cloudpickle", _stub("ray.cloudpickle", register_pickle_by_value=lambda m: None))
    sys.modules["ray"].cloudpickle = sys.modules["ray.cloudpickle"]
    sys.modules.setdefault("raylight.distributed_worker.ray_worker", _stub(
        "raylight.distributed_worker.ray_worker", make_ray_actor_fn=never, ensure_fresh_actors=never,
        ray_nccl_tester=never))
    import importlib

    mods = [importlib.import_module("raylight.nodes")]
    if (root / "raylight" / "comfy_extra_dist" / "nodes_minimax_h3.py").is_file():
        mods.append(importlib.import_module("raylight.comfy_extra_dist.nodes_minimax_h3"))
    out = {}
    for m in mods:
        out.update(m.NODE_CLASS_MAPPINGS)
        for k, v in getattr(m, "NODE_DISPLAY_NAME_MAPPINGS", {}).items():
            DISPLAY_NAMES[k] = v
    return out


DISPLAY_NAMES: dict[str, str] = {}   # Raylight's own display names of the classes loaded


def object_info(classes: dict[str, type]) -> dict[str, dict]:
    """``/object_info`` entries of V1 node classes (input, input_order, output, output_name, category)."""
    info = {}
    for name, cls in classes.items():
        spec = cls.INPUT_TYPES()
        info[name] = json.loads(json.dumps({
            "input": spec, "input_order": {k: list(v) for k, v in spec.items()},
            "output": list(cls.RETURN_TYPES), "output_name": list(getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES)),
            "output_is_list": [False] * len(cls.RETURN_TYPES), "name": name,
            "display_name": DISPLAY_NAMES.get(name, name),
            "category": getattr(cls, "CATEGORY", ""), "output_node": bool(getattr(cls, "OUTPUT_NODE", False))},
            default=str))
    return info


def example_object_info(raylight_src: str | os.PathLike, deps: str | None = None) -> dict[str, dict]:
    """The schemas the Raylight example needs: Raylight's real classes (loaded as above), ditkit's Ray nodes (their
    V1 ``/object_info`` form) and, for the host's and ditkit's other nodes, the schemas the main examples embed."""
    from ditkit import workflows as wfm
    from ditkit.nodes import raylight as ray_nodes

    info = dict(wfm.known_schemas())
    for cls in (ray_nodes.DitKitRaySparseAttention, ray_nodes.DitKitRayAdaLNCache, ray_nodes.DitKitRayTeaCache):
        info[cls.GET_SCHEMA().node_id] = json.loads(json.dumps(cls.GET_NODE_INFO_V1(), default=str))  # as served
    info.update(object_info(raylight_node_classes(raylight_src, deps)))
    return info


def sync_example(raylight_src, deps=None, check=False) -> list[str]:
    """Regenerate (``check``: compare) ``example_workflows/raylight/``'s UI twin from its API source."""
    from ditkit import workflows as wfm

    return wfm.sync(wfm.EXAMPLES_DIR / "raylight", object_info=example_object_info(raylight_src, deps), check=check)
