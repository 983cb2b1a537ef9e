"""Rank-consistent cache decisions.

A cache that decides from a tensor metric (TeaCache's relative L1 change, a first-block residual change) sees only
its rank's sequence shard under sequence parallelism: computed per shard, the ranks can disagree on a skip (1 step
in 9 on a toy) and the next collective deadlocks. A :class:`Reducer` turns the local figures into the global ones:
:meth:`Reducer.sum` adds vectors of partial sums over the sequence-parallel group (the metric's numerator and
denominator, pad rows excluded by the caller through :meth:`Reducer.valid`), and :meth:`Reducer.agree` makes a
boolean decision identical on every rank of the world group (skip only when every rank would skip). Every cache
calls both exactly once per decision, whatever its local state, so the collectives always pair up.

:data:`LOCAL` is the single-process reducer (no communication; the figures are the rank's own).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..report import Report
from .ulysses import valid_rows


class Reducer:
    """Single process: nothing to reduce."""

    distributed = False

    def sum(self, v: torch.Tensor) -> torch.Tensor:
        return v

    def agree(self, decision: bool) -> bool:
        return bool(decision)

    def valid(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``x`` without the rows of the sequence dimension ``dim`` that are padding (none in one process)."""
        return x

    def describe(self) -> str:
        return "single process"


LOCAL = Reducer()


class FnReducer(Reducer):
    """A plain function on the sums tensor as a reducer (what a pack or a test hands in: an all-reduce, a fake);
    decisions stay this process's."""

    distributed = True

    def __init__(self, fn):
        self.fn = fn

    def sum(self, v: torch.Tensor) -> torch.Tensor:
        return self.fn(v)

    def describe(self) -> str:
        return getattr(self.fn, "__name__", "custom")


def as_reducer(r) -> Reducer:
    """``None`` -> :data:`LOCAL`; a :class:`Reducer` as is; a callable -> :class:`FnReducer`."""
    if r is None:
        return LOCAL
    if isinstance(r, Reducer):
        return r
    if callable(r):
        return FnReducer(r)
    raise TypeError(f"a reducer is a Reducer or a callable on the sums tensor, not {type(r).__name__}")


class LazyGroup:
    """A process group resolved at its first use (on a Raylight actor the groups exist only once Raylight has
    initialised xFuser there): ``resolve()`` is called once, its result kept."""

    def __init__(self, resolve):
        self._resolve, self._group = resolve, None

    def get(self):
        if self._group is None:
            self._group = self._resolve()
        return self._group


def resolve_group(group):
    """``group`` itself, or what a :class:`LazyGroup` resolves to (None = the default group)."""
    return group.get() if isinstance(group, LazyGroup) else group


@dataclass
class DistReducer(Reducer):
    """Sums over ``sp_group`` (float64, so the order of the ranks' partial sums does not matter for a decision
    threshold), decisions over ``world_group`` (MIN of 0/1); either may be a :class:`LazyGroup`. ``seq_len`` is
    the real (unpadded) length of the sequence this rank holds a shard of, for :meth:`valid`; None when the shards
    are not padded (or the caller's tensors hold real rows only). ``device``: where the decision flag is made
    (NCCL groups reduce CUDA tensors only; None = CPU, gloo)."""

    sp_group: Optional[object] = None
    world_group: Optional[object] = None
    seq_len: Optional[int] = None
    device: Optional[object] = None

    distributed = True

    def sum(self, v: torch.Tensor) -> torch.Tensor:
        dev = v.device if self.device is None else self.device
        out = v.detach().to(device=dev, dtype=torch.float64).clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=resolve_group(self.sp_group))
        return out

    def agree(self, decision: bool) -> bool:
        flag = torch.tensor([1 if decision else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=resolve_group(self.world_group))
        return bool(flag.item())

    def valid(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self.seq_len is None:
            return x
        g = resolve_group(self.sp_group)
        return x.narrow(dim, 0, valid_rows(self.seq_len, dist.get_rank(g), dist.get_world_size(g)))

    def describe(self) -> str:
        return (f"sequence-parallel x{dist.get_world_size(resolve_group(self.sp_group))} (sums all-reduced, "
                f"decisions MIN over {dist.get_world_size(resolve_group(self.world_group))} ranks)")


def gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank of ``group`` (a :class:`LazyGroup` too)."""
    g = resolve_group(group)
    out = [None] * dist.get_world_size(g)
    dist.all_gather_object(out, obj, group=g)
    return out


@dataclass
class RanksReport(Report):
    """One run's figures of every rank, for the single report rank 0 sends. ``ranks[r]`` are rank r's figures
    (name -> value); ``must_agree`` the names whose values every rank must share (decisions, step counts): a
    difference is named in the summary (it means the ranks did not run the same program)."""

    ranks: list
    must_agree: tuple = ()

    KEYS = ("ranks", "disagree")
    VALUES = {"disagree": lambda r: r.disagree}

    @property
    def disagree(self) -> list:
        return [k for k in self.must_agree if len({repr(f.get(k)) for f in self.ranks}) > 1]

    def summary(self) -> str:
        per = "; ".join(f"rank {r}: {self.kv_list(f, ', ')}" for r, f in enumerate(self.ranks))
        bad = self.disagree
        return (f"{len(self.ranks)} ranks ({per})" + (f"; WARNING: the ranks disagree on {', '.join(bad)}" if bad
                                                     else (f"; ranks agree on {', '.join(self.must_agree)}"
                                                           if self.must_agree else "")))
