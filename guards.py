"""Checks every ditkit node gets at execute, without per-node code.

ComfyUI validates a FLOAT widget against its ``min``/``max`` only, and every comparison with NaN is false, so
``NaN`` (valid in the JSON ``/prompt`` accepts) passes, and a linked float (e.g. from a primitive node) is not
range-checked at all. :func:`guard_node` wraps a node class's ``execute`` so that every FLOAT input declared in its
schema is checked for finiteness before the node's own code runs; the error names the node and the input.

``nodes/__init__.py`` applies it to every registered node class (:func:`discover_nodes`), so a new node is covered
without doing anything. Plain Python, no ComfyUI: the schema is read by duck typing (``schema.inputs``, each with
``id`` and ``io_type``), which is what the unit tests use.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Any, Callable, Iterable

from .errors import DitKitError

GUARD_ATTR = "_ditkit_float_guard"   # the FLOAT input names a guarded class checks
BEFORE_ATTR = "_ditkit_guard_before"  # the check run before them (the host contract's require)


def float_inputs(schema) -> tuple[str, ...]:
    """Ids of the FLOAT inputs of a V3 schema, in schema order (nested inputs of dynamic types included)."""
    out: list[str] = []

    def walk(inputs: Iterable[Any]) -> None:
        for inp in inputs or ():
            if getattr(inp, "io_type", None) == "FLOAT" and inp.id not in out:
                out.append(inp.id)
            walk(nested_inputs(inp))

    walk(getattr(schema, "inputs", None))
    return tuple(out)


def nested_inputs(inp) -> list:
    """The inputs a dynamic input carries (``inp`` itself excluded). Every V3 input of ComfyUI has ``get_all()``:
    ``[self]``, or ``[self] +`` what a dynamic input carries (Autogrow: one input per template name, the template
    being an object, not a list; DynamicCombo: every option's inputs; DynamicSlot: the slot and its inputs).
    Duck-typed schemas without it (the unit tests') carry plain lists under ``inputs`` / ``template``."""
    get_all = getattr(inp, "get_all", None)
    if callable(get_all):
        subs = list(get_all())
    else:
        subs = [x for attr in ("inputs", "template") if isinstance(getattr(inp, attr, None), (list, tuple))
                for x in getattr(inp, attr)]
    return [x for x in subs if x is not inp]


def non_finite(value) -> bool:
    """True for NaN / +-Inf (also inside lists and tuples, as INPUT_IS_LIST nodes receive them, and dicts)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):           # int, float and numpy's scalars (np.float16(inf) included)
        try:
            return not math.isfinite(value)
        except OverflowError:                     # an int beyond float's range: it becomes inf in the node
            return True
    if isinstance(value, (list, tuple)):
        return any(non_finite(v) for v in value)
    if isinstance(value, dict):                   # an Autogrow input arrives as {name: value}
        return any(non_finite(v) for v in value.values())
    return False


def check_finite_inputs(node_id: str, names: Iterable[str], values: dict) -> None:
    """Raise :class:`DitKitError` naming the first FLOAT input whose value is NaN or infinite."""
    for n in names:
        for value in _values_named(values, n):
            if non_finite(value):
                raise DitKitError(f"{node_id}: input '{n}' is {value!r}; it must be a finite number (NaN and "
                                  "Infinity pass ComfyUI's min/max check, so ditkit refuses them here)")


def _values_named(values: dict, name: str):
    """``values[name]``, and the value of ``name`` inside nested dicts: ComfyUI hands the inputs of a dynamic input
    (DynamicCombo, Autogrow, DynamicSlot) to ``execute`` as ``{top_id: {inner_id: value, ...}}`` (built from the
    prompt's JSON: finite depth, no cycles)."""
    if name in values:
        yield values[name]
    for v in values.values():
        if isinstance(v, dict):
            yield from _values_named(v, name)


def guard_node(cls, node_id: str, names: Iterable[str], before: Callable[[], None] | None = None):
    """Wrap ``cls.execute`` (a classmethod, sync or async) so :func:`check_finite_inputs` runs first, after
    ``before()`` (if given: a check that may refuse the node outright, e.g. the host contract's
    ``require(node_id)``, called with nothing else run yet). Idempotent; returns ``cls``."""
    names = tuple(names)
    if getattr(cls, GUARD_ATTR, None) == names and GUARD_ATTR in cls.__dict__ \
            and cls.__dict__.get(BEFORE_ATTR) is before:
        return cls
    raw = inspect.getattr_static(cls, "execute")
    func = raw.__func__ if isinstance(raw, classmethod) else getattr(cls.execute, "__func__", None)
    if func is None:
        raise TypeError(f"{cls.__name__}.execute is not a classmethod")
    inner = getattr(func, "__wrapped_by_ditkit__", func)
    sig = inspect.signature(inner)

    def values_of(klass, args, kwargs) -> dict:
        try:
            bound = sig.bind_partial(klass, *args, **kwargs)
        except TypeError:
            return dict(kwargs)
        return bound.arguments

    if inspect.iscoroutinefunction(inner):
        @functools.wraps(inner)
        async def execute(klass, *args, **kwargs):
            if before is not None:
                before()
            check_finite_inputs(node_id, names, values_of(klass, args, kwargs))
            return await inner(klass, *args, **kwargs)
    else:
        @functools.wraps(inner)
        def execute(klass, *args, **kwargs):
            if before is not None:
                before()
            check_finite_inputs(node_id, names, values_of(klass, args, kwargs))
            return inner(klass, *args, **kwargs)

    execute.__wrapped_by_ditkit__ = inner
    cls.execute = classmethod(execute)
    setattr(cls, GUARD_ATTR, names)
    setattr(cls, BEFORE_ATTR, before)
    return cls
