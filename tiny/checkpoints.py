"""Deterministic tiny checkpoints with the real key names, layouts and dtypes, scaled down.

``python -m ditkit.tiny.checkpoints OUTDIR [--only NAME ...]`` writes every registered checkpoint.
Each family module registers generators with :func:`register`; a generator takes the output directory
and writes its files there (under the ComfyUI model-folder layout: ``diffusion_models/``, ``vae/``,
``text_encoders/``, ``loras/``, ``checkpoints/`` ...), returning the written paths.

Seeds are fixed per generator, so two runs produce byte-identical files.
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Callable

GENERATORS: dict[str, Callable[[Path], list[Path]]] = {}

# family modules that register generators (imported lazily, in this order)
FAMILY_MODULES = ("ckpt_h3", "ckpt_h3_quant", "ckpt_h3_vae", "ckpt_text", "ckpt_ltx", "ckpt_image", "ckpt_image_vae",
                  "ckpt_ltx_vae")


def register(name: str):
    def deco(fn):
        GENERATORS[name] = fn
        return fn

    return deco


def write_one(out: Path, rel: str, sd: dict) -> list[Path]:
    """Save one generated state dict as ``out/rel`` (folders made) -> ``[path]``, a generator's return value."""
    from ..loaders.safetensors_io import save_file   # torch needed only here

    path = Path(out) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, path)
    return [path]


def _load_families() -> None:
    for mod in FAMILY_MODULES:
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{mod}":
                raise


def generate_all(outdir, only: list[str] | None = None) -> dict[str, list[Path]]:
    _load_families()
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[Path]] = {}
    for name, fn in GENERATORS.items():
        if only and name not in only:
            continue
        written[name] = [Path(p) for p in fn(outdir)]
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ditkit.tiny.checkpoints", description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--only", nargs="*", help="generator names (default: all)")
    ap.add_argument("--list", action="store_true", help="list generator names and exit")
    a = ap.parse_args(argv)
    _load_families()
    if a.list:
        for n in GENERATORS:
            print(n)
        return 0
    for name, paths in generate_all(a.outdir, a.only).items():
        for p in paths:
            print(f"{name}: {p}")
    return 0


if __name__ == "__main__":
    # Under ``python -m`` this file runs as ``__main__``; the family modules register into the importable
    # ``<pkg>.testing.checkpoints`` module, so delegate to that one.
    from . import checkpoints as _registry_module

    from .._cli import run_cli

    raise SystemExit(run_cli(_registry_module.main, None, "python -m ditkit.tiny.checkpoints"))
