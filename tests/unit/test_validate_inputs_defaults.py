"""Every ``validate_inputs`` of a DitKit node takes each input as an optional parameter (issue 29): ComfyUI calls
it with only the inputs the prompt has, so a parameter without a default turns a missing input into a raw
TypeError instead of the host's "required input missing" naming it. Read by AST (no ComfyUI needed)."""
from __future__ import annotations

import ast
from pathlib import Path

NODES = Path(__file__).resolve().parents[2] / "nodes"


def _validators():
    for path in sorted(NODES.glob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(cls, ast.ClassDef):
                for fn in cls.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name in ("validate_inputs", "VALIDATE_INPUTS"):
                        yield f"{path.name}:{cls.name}", fn


def test_every_validate_inputs_parameter_has_a_default():
    found = list(_validators())
    assert found, "no validate_inputs found: the scan is broken"
    bad = []
    for where, fn in found:
        args = fn.args.args[1:]                    # after cls
        missing = len(args) - len(fn.args.defaults)
        bad += [f"{where}({a.arg})" for a in args[:missing]]
        bad += [f"{where}({a.arg})" for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is None]
    assert not bad, f"validate_inputs parameters without a default (a missing input becomes a TypeError): {bad}"

