"""Bypass mode for DitKitAdapterLoader: the adapter runs beside the untouched (quantized) weight at run time,
``y = base(x) + s·ΔW x`` (LoRA ``B(A x)``, LoKr ``w1 X w2ᵀ`` on the reshaped input, LoHa through its exact
rank-r1·r2 Khatri-Rao factorization, dense ``.diff`` ``D x``, bias deltas added to the output), on the host's own
bypass mechanism (``comfy.weight_adapter.bypass.BypassInjectionManager`` / ``BypassForwardHook``: the adapter's
``h(x, base_out)`` is added to the module's forward, installed as a ``PatcherInjection`` while the clone is
loaded), with ditkit's key mapping: row slices of the fused qkv (``to_q/k/v``), the de-interleave and half-swap
row maps become column selections of ``h``'s output, which the host's bypass (``load_bypass_lora_for_models``)
skips ("Adapter key not in model state_dict").

One thing the host's bypass misses besides offsets: H3's ``MLP.forward`` is
``comfy.ops.linear_input_act(fc2, fc1(x), "swiglu")``, which for an int8 weight calls the int8 kernel on
``fc2.weight`` directly, never ``fc2.forward``: a hook on ``fc2`` is silently not run on the int8 / ConvRot bases.
ditkit therefore hooks the parent ``mlp``: ``fc1(x)`` (with its own hook), the host's ``linear_input_act`` as is,
plus ``h_fc2(swiglu(a))`` with the host's own eager swiglu (``comfy.ops.INPUT_ACT_EAGER``); a contract probe
checks that ``MLP.forward`` is still that one call.

All ditkit bypass adapters of a model live in one attachment (``ditkit_bypass``: module key -> entries) and one
injection list (``ditkit_bypass``), rebuilt from the attachment when another loader adds to it, so stacked
loaders inject and eject in a consistent order.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .contract import Probe, entry

ATTACHMENT = "ditkit_bypass"
INJECTION_KEY = "ditkit_bypass"
NODES = ("DitKitAdapterLoader",)


@dataclasses.dataclass(frozen=True)
class Entry:
    param: str                          # "weight" | "bias"
    kind: str                           # lowrank | kron | hadamard | dense
    parts: tuple
    scale: float                        # module scale x strength
    row_map: Optional[torch.Tensor]
    rows: Optional[tuple[int, int]]
    source: str                         # "<file>: <module>" for the report

    def describe(self) -> str:
        r = "" if self.rows is None else f" rows {self.rows[0]}:{self.rows[1]}"
        return f"{self.kind} on {self.param}{r} (scale {self.scale:g}; {self.source})"


def _khatri_rao(a1, b1, a2, b2):
    """(a1 @ b1) * (a2 @ b2) == up @ down with up [m, r1 r2], down [r1 r2, n] (exact factorization)."""
    up = (a1[:, :, None] * a2[:, None, :]).reshape(a1.shape[0], -1)
    down = (b1[:, None, :] * b2[None, :, :]).reshape(-1, b1.shape[1])
    return up, down


def delta_out(e: Entry, x: torch.Tensor) -> torch.Tensor:
    """``ΔW x`` (or the bias delta) for one entry, float32, last dim = the entry's ΔW rows (row map applied)."""
    p = [t.to(device=x.device, dtype=torch.float32) for t in e.parts]
    if e.param == "bias":
        t = p[0].reshape(-1)
    elif e.kind == "lowrank":
        t = (x @ p[1].T) @ p[0].T
    elif e.kind == "hadamard":
        up, down = _khatri_rao(*p)
        t = (x @ down.T) @ up.T
    elif e.kind == "kron":
        w1, w2 = p
        lead = x.shape[:-1]
        xr = x.reshape(-1, w1.shape[1], w2.shape[1])
        t = torch.einsum("ab,nbq,pq->nap", w1, xr, w2).reshape(*lead, w1.shape[0] * w2.shape[0])
    else:
        t = x @ p[0].T
    if e.row_map is not None:
        t = t.index_select(-1, e.row_map.to(t.device))
    return t


def h_sum(entries, x: torch.Tensor, out_features: int, out_dtype: torch.dtype) -> torch.Tensor:
    xf = x.float()
    out = torch.zeros(*x.shape[:-1], out_features, dtype=torch.float32, device=x.device)
    for e in entries:
        t = delta_out(e, xf)
        r0, r1 = e.rows if e.rows is not None else (0, out_features)
        out[..., r0:r1] += float(e.scale) * t
    return out.to(out_dtype)


def _adapter_class():
    from comfy.weight_adapter.base import WeightAdapterBase

    class DitKitBypassAdapter(WeightAdapterBase):
        """One module's ditkit deltas as a host bypass adapter (``h`` = their sum; ``weights`` None: nothing for
        the host hook to move or cast)."""

        name = "ditkit_bypass"

        def __init__(self, entries, out_features):
            self.loaded_keys = set()
            self.weights = None
            self.entries = tuple(entries)
            self.out_features = int(out_features)

        def h(self, x, base_out):
            return h_sum(self.entries, x, self.out_features, base_out.dtype)

    return DitKitBypassAdapter


def _mlp_injection(mlp, adapter):
    """Hook the H3 MLP so fc2's deltas run whatever path the host's ``linear_input_act`` takes."""
    import comfy.ops

    state = {}

    def forward(x):
        a = mlp.fc1(x)
        out = comfy.ops.linear_input_act(mlp.fc2, a, "swiglu")
        return out + adapter.h(comfy.ops.INPUT_ACT_EAGER["swiglu"](a), out)

    def inject(_mp):
        if "orig" not in state:
            state["orig"] = mlp.forward
            mlp.forward = forward

    def eject(_mp):
        if "orig" in state:
            mlp.forward = state.pop("orig")

    return inject, eject


def current(model) -> dict[str, tuple]:
    return dict(model.get_attachment(ATTACHMENT) or {})


HOST_INJECTION_KEY = "bypass_lora"   # ComfyUI's LoraLoaderBypass (comfy.sd.load_bypass_lora_for_models)


def host_bypass_modules(model) -> set[str] | None:
    """Module keys (``diffusion_model.X``) that ComfyUI's own LoraLoaderBypass runs an adapter beside on this
    model: the ``BypassInjectionManager`` its ``bypass_lora`` injection closes over (``adapters`` keys). None when
    an injection does not expose one (the caller refuses rather than guess)."""
    from comfy.weight_adapter.bypass import BypassInjectionManager

    out: set[str] = set()
    for inj in model.get_injections(HOST_INJECTION_KEY) or ():
        mgr = None
        for cell in getattr(getattr(inj, "inject", None), "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:   # an empty cell
                continue
            if isinstance(v, BypassInjectionManager):
                mgr = v
        if mgr is None:
            return None
        out |= set(mgr.adapters)
    return out


def install(clone, new: dict[str, list[Entry]]) -> list[str]:
    """Merge ``new`` (weight key ``diffusion_model.X.weight|bias`` -> entries) into the clone's bypass attachment
    and (re)build its injection. Returns one report line per module."""
    import comfy.utils
    from comfy.patcher_extension import PatcherInjection
    from comfy.weight_adapter.bypass import BypassInjectionManager

    by_mod = current(clone)
    for key, ents in new.items():
        mod = key.rsplit(".", 1)[0]
        by_mod[mod] = tuple(by_mod.get(mod, ())) + tuple(ents)
    cls = _adapter_class()
    manager = BypassInjectionManager()
    extra, lines = [], []
    for mod, ents in by_mod.items():
        lin = comfy.utils.get_attr(clone.model, mod)
        w = lin.weight
        out_features = int(w.shape[0])
        adapter = cls(ents, out_features)
        fmt = getattr(lin, "quant_format", None) or str(getattr(w, "dtype", ""))
        if mod.endswith(".mlp.fc2"):
            inj, ej = _mlp_injection(comfy.utils.get_attr(clone.model, mod[: -len(".fc2")]), adapter)
            extra.append(PatcherInjection(inject=inj, eject=ej))
            how = "hooked on the parent mlp (the host's linear_input_act skips fc2.forward on int8 weights)"
        else:
            manager.add_adapter(mod, adapter, strength=1.0)
            how = "host BypassForwardHook"
        lines.append(f"bypass layer {mod[len('diffusion_model.'):]} ({fmt}, weight untouched): {len(ents)} "
                     f"delta{'s' if len(ents) != 1 else ''} [{'; '.join(e.describe() for e in ents)}], {how}")
    injections = manager.create_injections(clone.model) + extra
    clone.set_injections(INJECTION_KEY, injections)
    clone.set_attachments(ATTACHMENT, by_mod)
    return lines


# ------------------------------------------------------------------------------------------------ contract
@entry("comfy.weight_adapter.bypass.BypassInjectionManager + comfy.ldm.minimax.model.MLP.forward", nodes=NODES,
       what="behaviour")
def _bypass_contract():
    """The host's bypass manager runs an adapter's ``h`` beside a Linear's forward, and H3's MLP.forward is
    ``linear_input_act(fc2, fc1(x), "swiglu")`` (ditkit's mlp hook reproduces it, plus h)."""
    import inspect

    import comfy.ops
    from comfy.ldm.minimax import model as mm
    from comfy.weight_adapter.bypass import BypassInjectionManager

    src = inspect.getsource(mm.MLP.forward)
    if 'comfy.ops.linear_input_act(self.fc2, self.fc1(x), "swiglu")' not in src:
        return Probe.broken("MLP.forward is no longer linear_input_act(fc2, fc1(x), 'swiglu')")
    if "swiglu" not in getattr(comfy.ops, "INPUT_ACT_EAGER", {}):
        return Probe.broken("comfy.ops.INPUT_ACT_EAGER has no 'swiglu'")
    lin = torch.nn.Linear(4, 3, bias=False)
    root = torch.nn.Module()
    root.lin = lin
    e = Entry("weight", "dense", (torch.ones(3, 4),), 2.0, None, None, "probe")
    mgr = BypassInjectionManager()
    mgr.add_adapter("lin", _adapter_class()([e], 3), strength=1.0)
    inj = mgr.create_injections(root)
    x = torch.ones(1, 4)
    base = lin(x)
    for i in inj:
        i.inject(None)
    got = lin(x)
    for i in inj:
        i.eject(None)
    if not torch.allclose(got, base + 8.0) or not torch.equal(lin(x), base):
        return Probe.broken("the bypass hook did not add h(x) to the forward, or eject did not restore it")

    class _Holder:   # a ModelPatcher's get_injections, for host_bypass_modules
        def get_injections(self, key):
            return inj if key == HOST_INJECTION_KEY else []

    if host_bypass_modules(_Holder()) != {"lin"}:
        return Probe.broken("the host's bypass injection no longer closes over its BypassInjectionManager (ditkit "
                            "reads its adapters to refuse fusing onto a layer LoraLoaderBypass bypasses)")
    return Probe.holds()
