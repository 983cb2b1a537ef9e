"""Progress-bar callbacks for core functions that know their total only once they start (tile plans, tensor
counts, layer counts). Not a node module (the leading underscore keeps it out of node discovery)."""
from __future__ import annotations

from typing import Callable

from ._common import progress


def lazy_bar(node_id: str | None) -> Callable[[int, int], None]:
    """A ``cb(done, total)`` that creates this node's ComfyUI progress bar on its first call. A new bar starts
    whenever ``done`` goes back (a new phase or pass), so each phase runs from 0 to its own total. With
    ``node_id=None`` ComfyUI attributes the bar to the node executing at that moment."""
    bar = None
    last = None

    def cb(done: int, total: int) -> None:
        nonlocal bar, last
        if bar is None or last is None or done < last:
            bar = progress(total, node_id)
        last = done
        bar(done, total)

    return cb


def offset_bar(cb: Callable[[int, int], None], offset: int, total: int) -> Callable[[int, int], None]:
    """``cb`` seen from one part of a larger job: part-local ``done`` maps to ``offset + done`` of ``total``."""
    def part(done: int, _part_total: int) -> None:
        cb(offset + done, total)

    return part
