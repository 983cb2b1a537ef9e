"""Turbo / step-distillation LoRAs on curve-form (pruned) H3 bases: AdaLN pairs carried as extra curve columns
(plain torch; no ComfyUI imports).

A Turbo LoRA (lightx2v, larryvrh) has low-rank pairs on every ``adaln_proj.linear`` whose ``lora_down`` acts on the
``time_embed_dim``-wide ``silu(t_emb)`` (2688 on the real model): on an unpruned base the AdaLN delta at model time
``t`` is ``s · B (A silu(t_emb(t)))``. A curve-form base (Comfy-Org "pruned") has no time embedder: ComfyUI
computes ``t_emb = lerp(table[i0], table[i0+1], frac)`` with ``pos = clamp(t, 0, 1) · (grid − 1)`` and feeds it to
AdaLN linears ``[out, k]`` without SiLU (``comfy/ldm/minimax/model.py`` ``MiniMaxH3Model._forward``), so the AdaLN
output is linear in a lerp of table rows. The delta sampled on the base's own grid,
``C_b[i] = A_b silu(t_emb(t_i))`` with ``t_i = i / (grid − 1)``, is therefore carried exactly as ``r_b`` extra
columns of the table: the AdaLN then computes ``W table_k(t) + b + s B_b lerp(C_b)(t)``, which equals the unpruned
delta at every grid point and between them is interpolated exactly as the host interpolates the base.

``silu(t_emb)`` on the grid comes from (a) the time embedder of an unpruned checkpoint (``time_embedder.proj_in`` /
``proj_out``, evaluated here in float64 with the host's embedding: cos before sin, t not x1000) or (b) a grid
file holding ``silu_t_emb_grid [grid, D]`` (optionally ``t_grid [grid]``, which must be the host's
``linspace(0, 1, grid)``). Without either, :func:`build_carry` refuses naming the file to supply.

One table is shared by every block and the final layer: a file with pairs on ``n`` layers of rank ``r`` adds
``n · r`` columns. Fuse mode widens each carried AdaLN weight to ``[out, k + n r]`` (zeros outside its own columns;
ModelSave then writes a curve-form file the host loads as is); bypass mode leaves the weights and adds
``s B_b x[..., cols_b]`` beside each AdaLN projection.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import AdapterError
from ..report import Report

GRID_KEY = "silu_t_emb_grid"
T_GRID_KEY = "t_grid"
T_GRID_TOL = 1e-6
TE_KEYS = ("time_embedder.proj_in.weight", "time_embedder.proj_in.bias", "time_embedder.proj_out.weight",
           "time_embedder.proj_out.bias")
TE_PREFIXES = ("", "diffusion_model.", "model.diffusion_model.")
GRID_INPUT = "silu_t_emb_grid"
CKPT_INPUT = "time_embedder_checkpoint"


@dataclass
class CurvePair:
    """One AdaLN pair of a Turbo LoRA on a curve-form base (``up`` [out, r], ``down`` [r, D], float32)."""
    prefix: str
    keys: list[str]
    target: str                        # ComfyUI weight key, e.g. diffusion_model.blocks.0.adaln_proj.linear.weight
    up: torch.Tensor
    down: torch.Tensor
    scale: float
    rule: str

    def describe(self) -> str:
        return (f"{self.prefix} (AdaLN pair on silu(t_emb), rank {self.down.shape[0]}) -> "
                f"{self.target[len('diffusion_model.'):]} as {self.down.shape[0]} curve columns (scale {self.scale:g}: "
                f"{self.rule})")


def host_grid(rows: int) -> torch.Tensor:
    """Model times of the host's table rows: row ``i`` is read at ``t = i / (rows − 1)``."""
    return torch.linspace(0.0, 1.0, int(rows), dtype=torch.float64)


def _float_tensor(t, key: str, ndim: int, where: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise AdapterError(f"{where}: '{key}' must be a floating-point tensor, got "
                           f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != ndim or t.numel() == 0:
        raise AdapterError(f"{where}: '{key}' must be a non-empty {ndim}-D tensor, got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise AdapterError(f"{where}: '{key}' contains NaN or Inf values")
    return t


def silu_grid_from_time_embedder(te: dict[str, torch.Tensor], rows: int, where: str) -> torch.Tensor:
    """``silu(t_emb(t_i))`` [rows, D] in float64 from an unpruned time embedder (keys :data:`TE_KEYS`)."""
    missing = [k for k in TE_KEYS if k not in te]
    if missing:
        raise AdapterError(f"{where}: no {missing[0]!r}: not an unpruned H3 checkpoint (the time embedder is what "
                           f"gives silu(t_emb) on the grid); choose an unpruned file in '{CKPT_INPUT}' or a grid file "
                           f"in '{GRID_INPUT}'")
    w1, b1, w2, b2 = (te[k] for k in TE_KEYS)
    for k, t, n in zip(TE_KEYS, (w1, b1, w2, b2), (2, 1, 2, 1)):
        _float_tensor(t, k, n, where)
    freq = int(w1.shape[1])
    if freq % 2 or b1.shape[0] != w1.shape[0] or w2.shape[1] != w1.shape[0] or b2.shape[0] != w2.shape[0]:
        raise AdapterError(f"{where}: time embedder shapes proj_in {tuple(w1.shape)} / {tuple(b1.shape)}, proj_out "
                           f"{tuple(w2.shape)} / {tuple(b2.shape)} do not chain (even frequency width needed)")
    half = freq // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    args = host_grid(rows)[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    h = torch.nn.functional.silu(emb @ w1.double().T + b1.double())
    return torch.nn.functional.silu(h @ w2.double().T + b2.double())


def check_silu_grid(grid, rows: int, width: int, where: str, t_grid=None) -> torch.Tensor:
    """A user-supplied ``silu_t_emb_grid``, validated against the base's grid: 2-D float, finite, ``rows`` rows
    (the base's ``adaln_t_table`` rows), ``width`` columns (the LoRA's AdaLN ``lora_down`` width); a ``t_grid``
    given with it must equal ``linspace(0, 1, rows)`` within 1e-6. Returns float64."""
    _float_tensor(grid, GRID_KEY, 2, where)
    if tuple(grid.shape) != (rows, width):
        raise AdapterError(f"{where}: '{GRID_KEY}' has shape {tuple(grid.shape)}, expected ({rows}, {width}): "
                           f"{rows} rows = the base's adaln_t_table grid, {width} columns = the LoRA's AdaLN "
                           "lora_down width (silu(t_emb)); a grid made for another base or model size")
    if t_grid is not None:
        _float_tensor(t_grid, T_GRID_KEY, 1, where)
        if t_grid.shape[0] != rows:
            raise AdapterError(f"{where}: '{T_GRID_KEY}' has {t_grid.shape[0]} points, the base's table {rows}")
        dev = (t_grid.double() - host_grid(rows)).abs().max().item()
        if dev > T_GRID_TOL:
            raise AdapterError(f"{where}: '{T_GRID_KEY}' differs from the base's grid linspace(0, 1, {rows}) by "
                               f"{dev:.3g} (> {T_GRID_TOL:g}): the rows were sampled at other model times")
    return grid.double()


def read_time_embedder(path: str, where: str) -> dict[str, torch.Tensor]:
    """Only the four time-embedder tensors of an (unpruned) checkpoint, any of :data:`TE_PREFIXES`."""
    from .safetensors_io import SafeFile

    with SafeFile(path) as f:
        names = set(f.keys())
        for p in TE_PREFIXES:
            if all(p + k in names for k in TE_KEYS):
                return {k: f.get(p + k) for k in TE_KEYS}
    if "adaln_t_table" in names or "diffusion_model.adaln_t_table" in names:
        raise AdapterError(f"{where}: this checkpoint is itself curve-form (pruned: adaln_t_table, no time embedder); "
                           f"choose the UNPRUNED checkpoint of the same model in '{CKPT_INPUT}'")
    return {}


def read_grid_file(path: str, rows: int, width: int, where: str) -> torch.Tensor:
    from .safetensors_io import SafeFile

    with SafeFile(path) as f:
        names = set(f.keys())
        if GRID_KEY not in names:
            raise AdapterError(f"{where}: no '{GRID_KEY}' tensor (has {sorted(names)[:4]}): a silu(t_emb) grid file "
                               f"holds '{GRID_KEY}' [grid, D] and optionally '{T_GRID_KEY}' [grid]")
        extra = sorted(names - {GRID_KEY, T_GRID_KEY})
        if extra:
            raise AdapterError(f"{where}: unexpected tensors {extra[:4]} next to '{GRID_KEY}'")
        info = f.info(GRID_KEY)
        if tuple(info.shape) != (rows, width):
            raise AdapterError(f"{where}: '{GRID_KEY}' has shape {tuple(info.shape)}, expected ({rows}, {width}): "
                               f"{rows} rows = the base's adaln_t_table grid, {width} columns = the LoRA's AdaLN "
                               "lora_down width (silu(t_emb)); a grid made for another base or model size")
        grid = f.get(GRID_KEY)
        t_grid = f.get(T_GRID_KEY) if T_GRID_KEY in names else None
    return check_silu_grid(grid, rows, width, where, t_grid)


@dataclass
class CurveCarry(Report):
    """The widened table and, per carried AdaLN weight, its columns and its extra factor ``s·B`` [out, r]."""
    table: torch.Tensor
    base_width: int
    columns: dict[str, tuple[int, int]]
    extra: dict[str, torch.Tensor]
    grid_source: str
    lines: list[str] = field(default_factory=list)
    mode: str = ""                              # fuse | bypass, set when registered on a model
    entries: dict = field(default_factory=dict)  # bypass: module -> other bypass deltas run in the curve hook

    KEYS = ("grid_source", "base_width", "width", "columns", "lines")
    VALUES = {"width": lambda c: int(c.table.shape[1])}

    def summary(self) -> str:
        return (f"Turbo AdaLN pairs on a curve-form base: {len(self.columns)} AdaLN layers carried as "
                f"{self.table.shape[1] - self.base_width} extra curve columns (table {self.base_width} -> "
                f"{self.table.shape[1]} wide), silu(t_emb) from {self.grid_source}")


def refuse_missing_grid(pairs: list[CurvePair], rows: int, source: str) -> AdapterError:
    k = pairs[0].keys[0]
    return AdapterError(
        f"{source}: key {k!r} is an AdaLN pair of a Turbo / step-distillation LoRA: its factors act on the "
        f"{pairs[0].down.shape[1]}-wide silu(t_emb) space, but this base is curve-form (pruned: its AdaLN reads the "
        f"adaln_t_table and has no time embedder). ditkit applies it exactly as extra curve columns once it has "
        f"silu(t_emb) on the base's {rows}-point grid: choose a grid file ({GRID_KEY} [{rows}, "
        f"{pairs[0].down.shape[1]}], e.g. h3_silu_temb_grid.safetensors) in the DitKitAdapterLoader input "
        f"'{GRID_INPUT}', or the unpruned checkpoint of the same model (e.g. minimax_h3_fl2va_int8_convrot."
        f"safetensors) in '{CKPT_INPUT}'; nothing was applied")


def build_carry(base_table: torch.Tensor, pairs: list[CurvePair], silu_grid: torch.Tensor | None, strength: float,
                grid_source: str, source: str) -> CurveCarry:
    """Columns ``C_b = silu_grid @ A_bᵀ`` (float64, stored float32) appended to ``base_table`` in pair order;
    ``extra[target] = strength · scale · B`` (float32)."""
    rows, k = int(base_table.shape[0]), int(base_table.shape[1])
    if silu_grid is None:
        raise refuse_missing_grid(pairs, rows, source)
    widths = {int(p.down.shape[1]) for p in pairs}
    if len(widths) != 1:
        raise AdapterError(f"{source}: the AdaLN pairs act on different widths {sorted(widths)}; one silu(t_emb) space")
    grid = silu_grid.double()
    if tuple(grid.shape) != (rows, widths.pop()):
        raise AdapterError(f"{source}: silu(t_emb) grid {tuple(grid.shape)} does not fit the base's table rows {rows} "
                           f"and the LoRA's width {pairs[0].down.shape[1]}")
    if not math.isfinite(float(strength)):
        raise AdapterError(f"{source}: strength {strength!r} is not finite")
    cols, extra, parts, lines = {}, {}, [base_table.double()], []
    at = k
    for p in pairs:
        if p.target in cols:
            raise AdapterError(f"{source}: two AdaLN pairs on '{p.target}' ({p.keys[0]!r})")
        c = grid @ p.down.double().T
        parts.append(c)
        r = int(c.shape[1])
        cols[p.target] = (at, at + r)
        extra[p.target] = (float(strength) * float(p.scale) * p.up.double()).float()
        lines.append(f"{p.describe()}: table columns {at}:{at + r}")
        at += r
    table = torch.cat(parts, dim=1).to(torch.float32).contiguous()
    return CurveCarry(table, k, cols, extra, grid_source, lines)


def merge_carries(prev: CurveCarry, new: CurveCarry) -> CurveCarry:
    """Two carries on one base (stacked Turbo LoRAs): every layer's columns made contiguous again, ``prev``'s
    before ``new``'s, and its ``s·B`` factors concatenated in the same order, so each layer's delta is the sum of
    the two (columns and factors copied bit for bit)."""
    k = prev.base_width
    if new.base_width != k or new.table.shape[0] != prev.table.shape[0]:
        raise AdapterError(f"curve carries of different bases (table {tuple(prev.table.shape)} with base width {k} vs "
                           f"{tuple(new.table.shape)} with {new.base_width})")
    if not torch.equal(prev.table[:, :k], new.table[:, :k]):
        raise AdapterError("curve carries of different bases (their adaln_t_table columns differ)")
    parts, cols, extra, at = [prev.table[:, :k]], {}, {}, k
    for key in list(prev.columns) + [x for x in new.columns if x not in prev.columns]:
        blocks, factors = [], []
        for c in (prev, new):
            if key in c.columns:
                c0, c1 = c.columns[key]
                blocks.append(c.table[:, c0:c1])
                factors.append(c.extra[key])
        w = sum(int(b.shape[1]) for b in blocks)
        parts += blocks
        cols[key] = (at, at + w)
        extra[key] = torch.cat(factors, dim=1)
        at += w
    entries = {m: tuple(prev.entries.get(m, ())) + tuple(new.entries.get(m, ()))
               for m in list(prev.entries) + [m for m in new.entries if m not in prev.entries]}
    return CurveCarry(torch.cat(parts, dim=1).contiguous(), k, cols, extra,
                      f"{prev.grid_source}; then {new.grid_source}", prev.lines + new.lines, new.mode or prev.mode,
                      entries)


def widened_weight(base: torch.Tensor, carry: CurveCarry, key: str) -> torch.Tensor:
    """Fuse mode: ``[W | 0 .. s B .. 0]`` of width ``carry.table.shape[1]`` in ``base``'s dtype."""
    if tuple(base.shape) != (carry.extra[key].shape[0], carry.base_width):
        raise AdapterError(f"'{key}' has shape {tuple(base.shape)}; the carry expects "
                           f"({carry.extra[key].shape[0]}, {carry.base_width})")
    out = torch.zeros(base.shape[0], carry.table.shape[1], dtype=base.dtype)
    out[:, : carry.base_width] = base
    c0, c1 = carry.columns[key]
    out[:, c0:c1] = carry.extra[key].to(base.dtype)
    return out


def curve_delta(t_emb: torch.Tensor, carry: CurveCarry, key: str, extra: torch.Tensor | None = None) -> torch.Tensor:
    """Bypass mode: ``s B x[..., cols]`` for the widened ``t_emb`` (float32, the AdaLN linear's output width);
    ``extra``: ``carry.extra[key]`` already on ``t_emb``'s device (the caller's copy), else moved here."""
    c0, c1 = carry.columns[key]
    x = t_emb[..., c0:c1].float()
    w = carry.extra[key] if extra is None else extra
    return x @ w.to(device=x.device).T
