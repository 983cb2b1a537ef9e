"""Turbo LoRA AdaLN pairs on a curve-form H3 base, on ComfyUI (core: ``loaders/h3_turbo_curve.py``).

Both modes object-patch ``diffusion_model.adaln_t_table`` with the widened table (the host's ``_forward`` lerps
its rows into ``t_emb``, which every ``adaln_proj`` receives). Then:

* fuse: each carried ``adaln_proj.linear.weight`` is object-patched with ``[W | 0 .. s B .. 0]`` (the host's
  ``AdalnProj.forward`` is ``linear(t_emb)`` without SiLU on curve bases, so nothing else changes and ModelSave
  writes a curve-form file whose table and AdaLN widths agree);
* bypass: the weights stay; each carried ``adaln_proj.linear``'s forward is replaced (while the clone is loaded)
  by ``linear(t_emb[..., :k]) + s B t_emb[..., cols]`` plus the loader's other bypass deltas on that linear (one
  wrapper per linear: two nested forward wrappers would not eject in the right order, the host ejects in
  injection order). Every caller of the linear sees it: the host's ``AdalnProj.forward`` and
  ``DitKitH3AdaLNCache``'s lookup module. The injection lives under :data:`INJECTION_KEY`.

The carry is kept on the clone (attachment :data:`ATTACHMENT`): a second Turbo LoRA in the same mode is merged into
it (each layer's columns contiguous, factors concatenated: the deltas add), rebuilt as one table and one hook /
widened weight per layer. A carry in the other mode, a later adapter fused onto a widened AdaLN weight and a later
non-Turbo bypass delta on a carried AdaLN linear are refused by name.
"""
from __future__ import annotations

import os

import torch

from ..errors import AdapterError
from ..loaders import h3_turbo_curve as core
from .contract import Probe, entry

ATTACHMENT = "ditkit_turbo_curve"
INJECTION_KEY = "ditkit_turbo_curve"
TABLE_KEY = "diffusion_model.adaln_t_table"
NODES = ("DitKitAdapterLoader",)


def carried_keys(model) -> set[str]:
    carry = model.get_attachment(ATTACHMENT)
    return set(carry.columns) if carry is not None else set()


def make_carry(model, plan, strength: float, source: str, grid_path: str | None, ckpt_path: str | None,
               grid_name: str | None = None, ckpt_name: str | None = None, mode: str = "bypass") -> core.CurveCarry:
    """The carry of ``plan.curve`` on ``model`` (validated; nothing registered), merged with the carry an earlier
    loader put on it (same mode only). Refuses a missing / ambiguous / invalid grid."""
    prev = model.get_attachment(ATTACHMENT)
    if prev is None and TABLE_KEY in model.object_patches:
        raise AdapterError(f"{source}: the model's adaln_t_table is already replaced (another node's object patch); "
                           "a Turbo carry on top of it is not supported")
    if prev is not None and prev.mode != mode:
        raise AdapterError(f"{source}: the model already carries Turbo AdaLN curve columns in mode {prev.mode} (an "
                           f"earlier DitKitAdapterLoader); stacking one in mode {mode} mixes the two modes on the AdaLN "
                           f"layers. Set 'mode' to {prev.mode} on this loader too")
    table = prev.table[:, : prev.base_width] if prev is not None else model.get_model_object(TABLE_KEY)
    table = getattr(table, "data", table)
    rows = int(table.shape[0])
    width = int(plan.curve[0].down.shape[1])
    if grid_path and ckpt_path:
        raise AdapterError(f"{source}: both '{core.GRID_INPUT}' ({grid_name}) and '{core.CKPT_INPUT}' ({ckpt_name}) are "
                           "set; choose one source of silu(t_emb) (set the other to none)")
    if grid_path:
        where = f"silu(t_emb) grid file '{grid_name or os.path.basename(grid_path)}' (input '{core.GRID_INPUT}')"
        grid = core.read_grid_file(grid_path, rows, width, where)
        what = f"grid file {grid_name or os.path.basename(grid_path)}"
    elif ckpt_path:
        where = f"checkpoint '{ckpt_name or os.path.basename(ckpt_path)}' (input '{core.CKPT_INPUT}')"
        te = core.read_time_embedder(ckpt_path, where)
        grid = core.silu_grid_from_time_embedder(te, rows, where)
        if grid.shape[1] != width:
            raise AdapterError(f"{where}: its time embedder gives silu(t_emb) {grid.shape[1]} wide, the LoRA's AdaLN "
                               f"pairs act on {width}: a checkpoint of another model size")
        what = f"the time embedder of {ckpt_name or os.path.basename(ckpt_path)} (float64, {rows}-point grid)"
    else:
        grid, what = None, ""
    carry = core.build_carry(table.detach().cpu(), plan.curve, grid, strength, what, source)
    carry.mode = mode
    return carry if prev is None else core.merge_carries(prev, carry)


def check_fuse(model, carry: core.CurveCarry, source: str) -> dict[str, torch.nn.Parameter]:
    """Widened AdaLN weights for fuse mode (float weights only; a quantized AdaLN is refused naming bypass)."""
    out = {}
    prev = carried_keys(model)
    for k in carry.columns:
        if k in model.patches or (k in model.object_patches and k not in prev):
            raise AdapterError(f"{source}: '{k}' already carries a fused adapter; widening it for the Turbo curve "
                               "columns would drop it. Put this loader first, or use mode bypass")
        w = model.get_model_object(k)
        w = getattr(w, "data", w)
        if type(w).__name__ == "QuantizedTensor" or not w.is_floating_point() or w.element_size() < 2:
            raise AdapterError(f"{source}: '{k}' is stored quantized ({type(w).__name__} {w.dtype}); widening it for "
                               "the Turbo curve columns is done on float AdaLN weights only. Set 'mode' to bypass")
        if k in prev:                      # widened by the earlier carry: its first columns are the base weight
            w = w[:, : carry.base_width]
        out[k] = torch.nn.Parameter(core.widened_weight(w.detach().cpu(), carry, k).to(w.device), requires_grad=False)
    return out


def install(clone, carry: core.CurveCarry, mode: str, widened: dict | None = None,
            entries: dict | None = None) -> list[str]:
    """Register the carry on ``clone``. bypass: ``entries`` (module key -> ditkit bypass entries of this loader on
    a carried AdaLN linear, ``bridge/adapter_bypass.Entry``) run inside the same hook, so one wrapper per linear."""
    clone.add_object_patch(TABLE_KEY, carry.table)
    clone.set_attachments(ATTACHMENT, carry)
    lines = []
    if mode == "fuse":
        for k, w in (widened or {}).items():
            clone.add_object_patch(k, w)
        extra = sum(int(w.numel()) - int(w.shape[0]) * carry.base_width for w in (widened or {}).values())
        how = (f"fused: AdaLN weights widened with the extra columns (+{extra * 4 / 2**20:.1f} MiB fp32; ModelSave "
               "writes a consistent curve-form file)")
    else:
        for mod, es in (entries or {}).items():
            if es:
                carry.entries[mod] = tuple(carry.entries.get(mod, ())) + tuple(es)
        entries = carry.entries
        clone.set_injections(INJECTION_KEY, [_injection(clone, carry, k, entries.get(k[: -len(".weight")], ()))
                                             for k in carry.columns])
        how = "bypass: AdaLN weights untouched, s·B·t_emb[cols] added to each adaln_proj.linear's output"
        lines = [f"bypass layer {k[len('diffusion_model.'):-len('.weight')]}: {len(v)} other delta(s) in the curve hook "
                 f"[{'; '.join(e.describe() for e in v)}]" for k, v in entries.items() if v]
    return [carry.summary() + f"; {how}"] + carry.lines + lines


def _linear_forward(orig, carry: core.CurveCarry, key: str, entries, out_features: int):
    from .adapter_bypass import h_sum

    on_device: dict = {}          # s·B moved once per device while injected, not on every call

    def forward(x):
        xk = x[..., : carry.base_width]
        y = orig(xk)
        w = on_device.get(x.device)
        if w is None:
            w = on_device[x.device] = carry.extra[key].to(x.device)
        y = y + core.curve_delta(x, carry, key, w).to(y.dtype)
        if entries:
            y = y + h_sum(entries, xk, out_features, y.dtype)
        return y
    return forward


def _injection(clone, carry: core.CurveCarry, key: str, entries=()):
    """Replace ``adaln_proj.linear.forward`` while the clone is loaded: every caller of the linear (the host's
    ``AdalnProj.forward``, ``DitKitH3AdaLNCache``'s lookup module) gets the carried delta."""
    import comfy.utils
    from comfy.patcher_extension import PatcherInjection

    lin = comfy.utils.get_attr(clone.model, key[: -len(".weight")])
    out_features = int(carry.extra[key].shape[0])
    state = {}

    def inject(_mp):
        if "orig" not in state:
            state["orig"] = lin.forward
            lin.forward = _linear_forward(state["orig"], carry, key, tuple(entries), out_features)

    def eject(_mp):
        if "orig" in state:
            lin.forward = state.pop("orig")

    return PatcherInjection(inject=inject, eject=eject)


# ------------------------------------------------------------------------------------------------ contract
@entry("comfy.ldm.minimax.model.AdalnProj.forward + MiniMaxH3Model curve lerp", nodes=NODES, what="behaviour")
def _curve_contract():
    """On curve-form bases the AdaLN reads ``lerp(table[i0], table[i0+1], frac)`` without SiLU, and
    ``AdalnProj.forward`` is ``linear(t_emb).view(M·modalities, expand·hidden).chunk(expand)``."""
    import inspect

    import comfy.ops
    from comfy.ldm.minimax import model as mm

    # the model module's own source (not ``_forward`` itself, which a pack or a newer host may wrap around the
    # same body: the wrapper's source would not show the lerp that still runs inside it)
    src = inspect.getsource(mm)
    if "torch.lerp(table[i0], table[i0 + 1]" not in src or "pos = t_vals.clamp(0.0, 1.0) * (table.shape[0] - 1)" not in src:
        return Probe.broken("comfy.ldm.minimax.model no longer lerps adaln_t_table rows at t·(grid−1)")
    p = mm.AdalnProj(3, 2, 6, 3, apply_silu=False, operations=comfy.ops.disable_weight_init)
    with torch.no_grad():
        p.linear.weight.copy_(torch.arange(36 * 3, dtype=torch.float32).view(36, 3) / 50)
        p.linear.bias.copy_(torch.arange(36, dtype=torch.float32) / 7)
    x = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])
    got = p(x)
    ref = (x @ p.linear.weight.T + p.linear.bias).view(2 * 3, 6 * 2).chunk(6, dim=-1)
    if len(got) != 6 or not all(torch.equal(a, b) for a, b in zip(got, ref)):
        return Probe.broken("AdalnProj.forward is no longer linear(t_emb).view(M*modalities, expand*hidden).chunk")
    if (p.expand, p.modalities, p.hidden) != (6, 3, 2):
        return Probe.broken("AdalnProj no longer keeps expand / modalities / hidden")
    return Probe.holds()
