"""Reports: what a core operation tells the node that ran it (plain Python: no ComfyUI, no torch import).

Every report is a dataclass deriving from :class:`Report`; the node sends it with ``nodes/_common.send_report``
(a log line, a ``ditkit.report`` websocket event drawn as a badge by ``web/js/ditkit.js``, the node's ``ui``).

* ``as_dict()``: the dataclass fields in declaration order, each value made plain by :func:`plain` (nested
  reports / dataclasses -> dicts, tuples -> lists, tensors -> ``tolist()``, paths -> ``str``; dicts and lists
  are copies, so the dict never aliases the report's mutable state). A class whose dict differs from its fields
  says so with two class attributes:

  - ``KEYS``: the output keys in order; ``"key"`` is the attribute of that name (a field or a property),
    ``"key=attr.path"`` another attribute, ``"**attr"`` merges the items of a dict attribute in;
  - ``VALUES``: ``{key: fn(report) -> value}`` for a key whose value is computed (rounded, truncated, ...).

* ``summary()``: the one-line text (badge, log line, progress text), a short method of each class that has one
  (the texts hold conditions, counts and unit conversions that a format template would only hide); the
  ``"k: v"`` lists inside them come from :meth:`Report.kv_list`.

:func:`jsonable` is what ``send_report`` applies to a payload's ``data`` (whatever ``json.dumps`` refuses becomes
its ``str``; NaN/Infinity floats, which ``json.dumps`` accepts, are left as they are). :data:`ProgressFn` is the
other thing a core operation reports along the way: ``progress(done, total)``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Callable, ClassVar

ProgressFn = Callable[[int, int], None]


def plain(v: Any) -> Any:
    """``v`` as plain dicts / lists / scalars (see the module docstring); anything else is returned as it is."""
    if isinstance(v, Report):
        return v.as_dict()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    torch = sys.modules.get("torch")      # a tensor can only exist once torch is imported
    if torch is not None and isinstance(v, torch.Tensor):
        return v.tolist()
    return v


def _attr(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


class Report:
    """Base of every ditkit report dataclass: ``as_dict()`` and ``summary()`` (see the module docstring)."""

    KEYS: ClassVar[tuple[str, ...] | None] = None
    VALUES: ClassVar[dict[str, Callable[[Any], Any]]] = {}

    def as_dict(self) -> dict:
        keys = self.KEYS if self.KEYS is not None else tuple(f.name for f in dataclasses.fields(self))
        out: dict = {}
        for spec in keys:
            if spec.startswith("**"):
                out.update(plain(_attr(self, spec[2:])))
                continue
            key, _, path = spec.partition("=")
            fmt = self.VALUES.get(key)
            out[key] = plain(fmt(self) if fmt is not None else _attr(self, path or key))
        return out

    @staticmethod
    def kv_list(items, sep: str = "; ") -> str:
        """``"k: v"`` for each pair of ``items`` (a dict or a sequence of pairs), joined by ``sep``."""
        if isinstance(items, dict):
            items = items.items()
        return sep.join(f"{k}: {v}" for k, v in items)

    def summary(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no summary text (it is sent inside another report)")


def jsonable(obj: Any) -> Any:
    """``obj`` if ``json.dumps`` takes it, else a copy where what it refuses is replaced by its ``str``
    (dict keys too); dicts, lists and tuples are walked."""
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        if isinstance(obj, dict):
            return {str(k): jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [jsonable(v) for v in obj]
        return str(obj)
