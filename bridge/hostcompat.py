"""What changed in the host after ComfyUI 0.33, detected by feature (never by version string), and how ditkit follows.

Every function here works on the 0.33 semantics ditkit was built on AND on the newer semantics recorded in the
0.35-0.38 sources (``docs/compat.md`` names file and commit per item). Each adaptation is also a host-contract entry
(:mod:`.contract`): ``holds`` on 0.33 semantics, ``adapted`` (with a note saying what ditkit does) on the newer ones,
``broken`` for a shape ditkit does not know. Symbols carry a ``[feature]`` suffix: the entry is about one feature of
that symbol, next to the plain-symbol entries of ``contract_entries.py``.

* block replaces and ``args["attention"]`` (0.35+: ``DiTBlock.forward(..., attention=None)``, ``block_wrap`` passes
  ``args.get("attention")``): :func:`block_attention`, :func:`foreign_attention_name`;
* core's ``BlockSparseAttention`` (``comfy_extras/nodes_sparse_attention.py``): :func:`is_block_sparse_patch`,
  :func:`check_replaces_kept` (a ditkit block replace overwritten by a later patch is a named refusal);
* the packed layout / block index published in ``transformer_options`` (0.38): :func:`check_published_layout`;
* the checkpoint's attention choice popped by 0.38's ``wrap_attn``: :func:`preferred_attention_functions`;
* tensors kept across steps under the Comfy Compiler's malloc graph: :func:`persistent_alloc`;
* VAE constructor / patcher keywords (``num_layers``, ``fast_disk``): :func:`vae_model_kwargs`, :func:`patcher_kwargs`;
* the H3 video VAE's tile blending and its T = 1 path: :func:`host_tiled_decode_frame`, :func:`host_t1_path`.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch

from ..errors import DitKitError
from .contract import Probe, entry

# node ids (strings, so nothing of nodes/ is imported here)
TEACACHE = ("DitKitTeaCache", "DitKitTeaCacheCalibrate")
VSA = ("DitKitSparseAttention",)
ADALN = ("DitKitH3AdaLNCache",)
VAE_DECODE = ("DitKitH3VAEDecode",)
VAE_LOADER = ("DitKitH3VAELoader",)

LAYOUT_KEY = "minimax_h3_layout"    # 0.38: transformer_options[...] = the forward's PackedLayout
BLOCK_INDEX_KEY = "block_index"     # 0.38: transformer_options[...] = index of the running block
BSA_NODE = "BlockSparseAttention"   # core's "Model Sparse Attention" node id (ComfyUI PR 16072)
BSA_MODULE = "comfy_extras.nodes_sparse_attention"


class CompositionError(DitKitError):
    """Two patches on one model that cannot both run as installed; the message names both nodes."""


# ================================================================================================ feature detection

def _params(fn) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def dit_block_takes_attention() -> bool:
    """0.35+: ``DiTBlock.forward`` takes ``attention=`` (the attention module a block replace asks it to run)."""
    from comfy.ldm.minimax.model import DiTBlock

    return "attention" in _params(DiTBlock.forward)


def block_attention(args: dict, blk):
    """The attention a block runs for this replace call: ``args["attention"]`` when a replace earlier in the chain
    put one there (0.35+ protocol: core's sparse node, other packs), else the block's own ``attn``."""
    att = args.get("attention")
    return blk.attn if att is None else att


def is_block_sparse_patch(fn) -> bool:
    """``fn`` (a block replace or an attention override) was made by core's ``BlockSparseAttention`` node: its
    closures live in ``comfy_extras.nodes_sparse_attention`` (detected by that marker, not by a version)."""
    mod = getattr(fn, "__module__", None) or ""
    return mod == BSA_MODULE or mod.endswith(".nodes_sparse_attention")


def foreign_attention_name(fn) -> str:
    """Who made an attention callable passed as ``args["attention"]`` (for reports): core's node or a module."""
    if fn is None:
        return "block's own attention"
    if is_block_sparse_patch(fn):
        return BSA_NODE
    mod = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{mod}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def patch_owner(fn) -> str:
    """Node / module that installed a block replace ``fn`` (for refusals that name both nodes)."""
    if is_block_sparse_patch(fn):
        return f"{BSA_NODE} (ComfyUI's Model Sparse Attention)"
    mod = getattr(fn, "__module__", None) or type(fn).__module__
    return f"a patch from {mod}"


def check_replaces_kept(transformer_options: dict, marker: str, node_id: str, keys) -> None:
    """Raise :class:`CompositionError` naming both nodes when a ditkit block replace (one carrying the attribute
    ``marker``) installed on ``keys`` is no longer the replace of that block: a node applied after ditkit's
    overwrote it instead of chaining (core's ``BlockSparseAttention`` does). Chained replaces (ditkit's on top of
    another's) pass."""
    dit = ((transformer_options or {}).get("patches_replace") or {}).get("dit") or {}
    for key in keys:
        fn = dit.get(key)
        if fn is None or not getattr(fn, marker, False):
            who = patch_owner(fn) if fn is not None else "a later patch that removed it"
            raise CompositionError(
                f"{node_id}'s block replace of {key} was overwritten by {who}, applied after {node_id}: both were "
                f"installed but only one would run. Apply {who.split(' (')[0]} BEFORE {node_id} in the workflow (then "
                f"{node_id} chains it and its attention runs inside ditkit's blocks), or remove one of them.")


def block_sparse_installed(transformer_options: dict) -> bool:
    """Whether core's ``BlockSparseAttention`` is on a model with these ``transformer_options`` (its block replaces
    or its attention override, recognised by :func:`is_block_sparse_patch`)."""
    to = transformer_options or {}
    dit = (to.get("patches_replace") or {}).get("dit") or {}
    if any(is_block_sparse_patch(f) for f in dit.values()):
        return True
    return is_block_sparse_patch(to.get("optimized_attention_override"))


def refuse_with_block_sparse(transformer_options: dict, node_id: str) -> None:
    """Two sparse attentions of one H3 block cannot both run (core's replaces swap the block's attention for its
    own producer and its override sits on top of ditkit's): refuse, naming both nodes, in either order."""
    if block_sparse_installed(transformer_options):
        raise CompositionError(
            f"{node_id} and {BSA_NODE} (ComfyUI's Model Sparse Attention) are both on this model: both replace H3's "
            "self-attention, so only one of them would run. Use one of the two.")


def refuse_with_block_sparse_on(model, node_id: str) -> None:
    """:func:`refuse_with_block_sparse` on a ModelPatcher's own ``transformer_options``."""
    refuse_with_block_sparse(model.model_options.get("transformer_options", {}), node_id)


def check_published_layout(transformer_options: dict, seq_len: int, prefix: tuple, grid: tuple,
                           prefix_of_spans, patch_size=(1, 2, 2)) -> str:
    """0.38 publishes the forward's ``PackedLayout``: ditkit rebuilt the same layout from the inputs before the
    forward; a difference would make its sparse pattern silently wrong, so it is a named refusal. Returns
    ``"published"`` (checked equal) or ``"rebuilt"`` (0.33: nothing published). ``prefix_of_spans``: the span ->
    prefix-segment mapping the layout was rebuilt with."""
    layout = (transformer_options or {}).get(LAYOUT_KEY)
    if layout is None:
        return "rebuilt"
    got_prefix, _ = prefix_of_spans(layout.segments)   # attention.prefix_segments_from_spans (no import cycle)
    sig = tuple(layout.signature)
    got_grid = (int(sig[1]) // patch_size[0], int(sig[2]) // patch_size[1], int(sig[3]) // patch_size[2])
    if int(layout.seq_len) != int(seq_len) or tuple(got_prefix) != tuple(prefix) or got_grid != tuple(grid):
        raise DitKitError(
            f"DitKitSparseAttention: the host's published H3 layout (transformer_options['{LAYOUT_KEY}']: "
            f"{int(layout.seq_len)} rows, prefix {tuple(got_prefix)}, grid {got_grid}) differs from the layout ditkit "
            f"rebuilt ({int(seq_len)} rows, prefix {tuple(prefix)}, grid {tuple(grid)}); refusing rather than running "
            "a wrong sparse pattern. See docs/compat.md.")
    return "published"


def check_block_index(transformer_options: dict, idx: int) -> None:
    """0.38 publishes the running block's index; a ditkit replace installed for block ``idx`` must see ``idx``."""
    got = (transformer_options or {}).get(BLOCK_INDEX_KEY)
    if got is not None and int(got) != int(idx):
        raise DitKitError(f"host published block_index {got} while ditkit's replace of block {idx} ran; the host's "
                          "block loop differs from what ditkit relies on (see docs/compat.md)")


def preferred_attention_functions(dm) -> list | None:
    """Per block, the checkpoint's attention choice (0.38: ``blk.attn.comfy_attention.function``, a
    ``ComfyAttention`` stored in the state dict) or None; None when the host has no such choice (0.33)."""
    fns = []
    any_attr = False
    for blk in getattr(dm, "blocks", ()):
        ca = getattr(getattr(blk, "attn", None), "comfy_attention", None)
        any_attr = any_attr or ca is not None
        fns.append(getattr(ca, "function", None) if ca is not None else None)
    return fns if any_attr else None


def dense_attention_for(func, transformer_options: dict, choices: list | None):
    """The function a dense fallback runs: the checkpoint's choice for the running block (0.38 pops it before an
    override is called, so an override that called ``func`` would lose it), else the host's ``func``."""
    if not choices:
        return func
    idx = (transformer_options or {}).get(BLOCK_INDEX_KEY)
    if idx is not None and 0 <= int(idx) < len(choices):
        fn = choices[int(idx)]
    else:
        distinct = {id(f): f for f in choices if f is not None}
        fn = next(iter(distinct.values())) if len(distinct) == 1 else None
    return func if fn is None else fn


def stock_keeps_gates() -> bool:
    """0.35+: the host's H3 ``Attention`` takes ``gate_compress`` and builds ``attn.to_gate_compress`` when the
    checkpoint has it, so a stock load keeps FastH3's gates (0.33 dropped them as unexpected keys)."""
    from comfy.ldm.minimax.model import Attention

    return "gate_compress" in _params(Attention.__init__)


def model_gates_equal(model_patcher, gates: dict) -> bool:
    """Every gate of the file is the loaded model's ``attn.to_gate_compress.weight`` of that block (same values)."""
    dm = model_patcher.model.diffusion_model
    for i, w in gates.items():
        mod = getattr(dm.blocks[i].attn, "to_gate_compress", None)
        weight = getattr(mod, "weight", None)
        if weight is None or weight.is_meta or tuple(weight.shape) != tuple(w.shape):
            return False
        if not torch.equal(weight.detach().to(device="cpu", dtype=w.dtype), w.to("cpu")):
            return False
    return True


def drop_model_gates(model_patcher) -> None:
    """Gate modules the host built but did not load from the file are not the checkpoint's gates: removed, so that
    only the file's gates (the loader's attachment) are ever used."""
    for blk in model_patcher.model.diffusion_model.blocks:
        if getattr(blk.attn, "to_gate_compress", None) is not None:
            blk.attn.to_gate_compress = None


def persistent_alloc():
    """Context for tensors ditkit keeps across steps (caches, tables, layout buffers): the host's
    ``comfy.model_prefetch.pause_malloc_graph()`` when it has one (Comfy Compiler, ComfyUI PR 16148), else a
    no-op."""
    try:
        import comfy.model_prefetch as mp
    except Exception:  # noqa: BLE001 - no prefetch module: nothing to pause
        return contextlib.nullcontext()
    pause = getattr(mp, "pause_malloc_graph", None)
    return pause() if callable(pause) else contextlib.nullcontext()


def vae_model_kwargs(cls, dec_layers: int) -> dict:
    """Extra keywords for building ``MiniMaxH3VideoVAE``: 0.38 takes ``num_layers`` (decoder depth; 36 by
    default) - ditkit passes the depth it counted in the file."""
    return {"num_layers": int(dec_layers)} if "num_layers" in _params(cls.__init__) else {}


def patcher_kwargs(cls, like=None) -> dict:
    """Extra keywords for a model patcher ditkit builds: 0.38's ``ModelPatcher(..., fast_disk=False)`` - ditkit
    passes the value of the patcher it replaces when that one records it."""
    if "fast_disk" not in _params(cls.__init__):
        return {}
    val = getattr(like, "fast_disk", None) if like is not None else None
    return {} if val is None else {"fast_disk": bool(val)}


# ================================================================================================ H3 VAE tiles / T=1

class _FrameView:
    """The host VAE ``vae`` seen through one decoder frame: ``_decode_pixels`` returns only frame ``frame`` of each
    decoded tile; every other method is the host class's own, bound to this view (so the host's tiled decode, its
    tile batching and its blending run unchanged, on one frame). Blending is elementwise per frame, so the result
    equals frame ``frame`` of the host's tiled decode (the contract entry checks this on the host in use)."""

    def __init__(self, vae, frame: int, on_tile: Callable | None = None):
        object.__setattr__(self, "_vae", vae)
        object.__setattr__(self, "_frame", int(frame))
        object.__setattr__(self, "_on_tile", on_tile)

    def _decode_pixels(self, z):
        raw = self._vae._decode_pixels(z)
        if self._on_tile is not None:
            self._on_tile(raw)
        out = raw[:, :, self._frame:self._frame + 1].clone()
        del raw
        return out

    def __getattr__(self, name):
        attr = getattr(type(self._vae), name, None)
        if inspect.isfunction(attr):
            return attr.__get__(self, type(self))
        return getattr(self._vae, name)


def host_tiled_decode_frame(vae, z: torch.Tensor, frame: int, on_tile: Callable | None = None) -> torch.Tensor:
    """Frame ``frame`` of the host's own ``tiled_decode(z)`` (its tiles, blending and canvas), decoded one frame per
    tile: raw decoder pixels [B, 3, 1, H, W]. ``on_tile(raw)`` sees every decoder output (for reports)."""
    return type(vae).tiled_decode(_FrameView(vae, frame, on_tile), z)


class _DecodeRecorder:
    """Stands in for a ``MiniMaxH3VideoVAE`` while its ``decode`` runs on a T = 1 latent: records which decode steps
    the host's method calls (no decoder runs)."""

    def __init__(self, ratio: int = 16, channels: int = 24):
        self.calls: list[tuple[str, tuple]] = []
        self.latents_mean = torch.zeros(channels)
        self.latents_std = torch.ones(channels)
        self.vae_ratio = ratio
        self.vae_ratio_t = 4
        self.tiling = True

    def _adaptive_decode(self, z):
        self.calls.append(("_adaptive_decode", tuple(z.shape)))
        b, _, t, h, w = z.shape
        return torch.zeros(b, 3, 4 * t, h * self.vae_ratio, w * self.vae_ratio)

    def tiled_decode(self, z):
        return self._adaptive_decode(z)

    def _decode_pixels(self, z):
        return self._adaptive_decode(z)

    def decode_temporal(self, z, output_buffer=None):
        self.calls.append(("decode_temporal", tuple(z.shape)))
        b, _, t, h, w = z.shape
        return torch.zeros(b, 3, 1, h * self.vae_ratio, w * self.vae_ratio)

    def _finalize_pixels(self, part):
        return part.float()

    def __getattr__(self, name):  # any other helper a newer decode calls: recorded, then refused
        if name.startswith("__"):
            raise AttributeError(name)
        self.calls.append((name, ()))
        raise AttributeError(name)


def host_t1_path(vae_cls=None) -> str:
    """What the host's ``MiniMaxH3VideoVAE.decode`` does with a single latent frame, observed on a recorder (no
    decoder runs): ``"last_of_one"`` (0.33-0.38: the last of the 4 frames one token decodes to, which ditkit's
    repeat-decode replaces), ``"host_single_image"`` (another sequence of decode steps that returns one frame: the
    host's own path, announced for 0.40; ditkit defers to it) or ``"unknown"`` (it failed on the recorder or
    returned something else)."""
    if vae_cls is None:
        from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE as vae_cls
    rec = _DecodeRecorder()
    try:
        out = vae_cls.decode(rec, torch.zeros(1, 24, 1, 2, 2))
    except Exception:  # noqa: BLE001 - a decode the recorder cannot stand in for
        return "unknown"
    if not torch.is_tensor(out) or tuple(out.shape) != (1, 3, 1, 32, 32) or not rec.calls:
        return "unknown"
    if rec.calls == [("_adaptive_decode", (1, 24, 1, 2, 2))]:
        return "last_of_one"
    return "host_single_image"


# ================================================================================================ contract entries

@entry("comfy.ldm.minimax.model.DiTBlock.forward[attention]", nodes=TEACACHE + VSA, what="signature")
def _dit_block_attention():
    """ditkit's block replaces run the attention a replace earlier in the chain passes (args['attention'])."""
    from comfy.ldm.minimax.model import DiTBlock

    p = _params(DiTBlock.forward)
    base = ["self", "x", "t_emb", "mod_segments", "rope_freqs", "transformer_options"]
    if p == base:
        return Probe.holds("0.33: (x, t_emb, mod_segments, rope_freqs, transformer_options)")
    if p == base + ["attention"]:
        return Probe.adapted("0.35+: takes attention=; ditkit's block paths run args['attention'] and pass it on")
    return Probe.broken(f"DiTBlock.forward parameters {p[1:]} (ditkit knows {base[1:]} [+ attention])")


@entry("comfy_extras.nodes_sparse_attention.BlockSparseAttention[composition]", nodes=TEACACHE + VSA,
       what="feature")
def _block_sparse_attention():
    """Composition with core's sparse attention node: chained under ditkit's replaces, or refused naming both."""
    try:
        import importlib

        mod = importlib.import_module(BSA_MODULE)
    except ImportError:
        return Probe.holds("absent (0.33)")
    if not hasattr(mod, "BlockSparseAttention"):
        return Probe.holds(f"{BSA_MODULE} has no BlockSparseAttention")
    return Probe.adapted("present: applied before ditkit's TeaCache/AdaLN/gates it is chained (its attention runs in "
                         "ditkit's blocks); applied after, or stacked with DitKitSparseAttention, it is refused with "
                         "both nodes named")


@entry("comfy.ldm.minimax.model.MiniMaxH3Model._forward[minimax_h3_layout]", nodes=VSA, what="feature")
def _published_layout():
    """VSA-H3 reads the published packed layout and block index when present and checks them against its own."""
    from comfy.ldm.minimax.model import MiniMaxH3Model

    try:
        src = inspect.getsource(MiniMaxH3Model._forward)
    except (OSError, TypeError):
        return Probe.holds("source unreadable: the published layout is read and checked at run time when present")
    if LAYOUT_KEY in src:
        return Probe.adapted("0.38: the forward publishes minimax_h3_layout / block_index; ditkit reads them and "
                             "refuses when they differ from its rebuilt layout")
    return Probe.holds("0.33: no layout published; ditkit rebuilds it from the forward's inputs")


@entry("comfy.ldm.minimax.model.Attention[to_gate_compress]", nodes=VSA, what="attributes")
def _stock_gates():
    """Stock-loaded FastH3 models carry to_gate_compress (0.35+); ditkit uses the model's gates first."""
    from comfy.ldm.minimax.model import Attention

    if "gate_compress" in _params(Attention.__init__):
        return Probe.adapted("0.35+: a stock load keeps attn.to_gate_compress; DitKitSparseAttention uses it")
    return Probe.holds("0.33: a stock load drops to_gate_compress; ditkit's loader keeps it as an attachment")


@entry("comfy.ldm.modules.attention.wrap_attn[preferred_attention]", nodes=VSA, what="behaviour")
def _preferred_attention():
    """The dense fallback of an override honours the checkpoint's ComfyAttention choice (0.38 pops it)."""
    import comfy.ldm.minimax.model as hm

    seen: dict = {}

    def override(func, *a, **kw):
        seen.update(kw)
        return a[0]

    class Choice:
        function = None

    q = torch.zeros(1, 1, 2, 4)
    hm.optimized_attention(q, q, q, 1, preferred_attention=Choice(), skip_reshape=True,
                           transformer_options={"optimized_attention_override": override})
    if "preferred_attention" in seen:
        return Probe.holds("0.33: no checkpoint attention choice is popped before an override")
    return Probe.adapted("0.38: wrap_attn pops preferred_attention before the override; ditkit's dense fallback "
                         "runs the block's comfy_attention.function itself")


@entry("comfy.model_prefetch.pause_malloc_graph", nodes=TEACACHE + VSA + ADALN, what="feature")
def _pause_malloc_graph():
    """Tensors ditkit keeps across steps are allocated outside the Comfy Compiler's malloc graph."""
    try:
        import comfy.model_prefetch as mp
    except ImportError:
        return Probe.holds("no comfy.model_prefetch")
    if callable(getattr(mp, "pause_malloc_graph", None)):
        return Probe.adapted("present: caches, tables and layout buffers are allocated under pause_malloc_graph()")
    return Probe.holds("0.33: no malloc graph; nothing to pause")


@entry("comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.tiled_decode[frame view]", nodes=VAE_DECODE, what="behaviour")
def _tiled_decode_frame_view():
    """T=1 decode runs the host's own tiled_decode on one frame per tile (its blending, not a copy)."""
    from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE as V

    class Fake:  # what tiled_decode reads of its VAE, with a cheap decoder: 3 x 3 tiles of 4 frames
        vae_ratio = 16
        tile_size = 64
        tile_overlap_min = 32
        tiling = True

        def _decode_pixels(self, z):
            b, _, t, h, w = z.shape
            seed = int((z.double().sum() * 1e6).round().item()) % (2 ** 31)
            return torch.rand(b, 3, 4 * t, h * 16, w * 16, generator=torch.Generator().manual_seed(seed))

    for name in ("split_tiles", "blend", "tiled_decode") + (("_decode_tile_row",) if hasattr(V, "_decode_tile_row")
                                                             else ()):
        setattr(Fake, name, getattr(V, name))
    fake = Fake()
    z = torch.randn(1, 2, 1, 10, 10, generator=torch.Generator().manual_seed(0))
    full = fake.tiled_decode(z)
    for f in range(4):
        got = host_tiled_decode_frame(fake, z, f)
        if not torch.equal(got, full[:, :, f:f + 1]):
            return Probe.broken(f"the host's tiled_decode is not separable per frame (frame {f} differs by "
                                f"{(got - full[:, :, f:f + 1]).abs().max().item():.3g}); ditkit's T=1 decode would "
                                "differ from the host's")
    if hasattr(V, "_decode_tile_row"):
        return Probe.adapted("0.38: tiles blended against already-blended neighbours, batched per row; ditkit's "
                             "T=1 decode calls it per frame")
    return Probe.holds("0.33: tiles blended against raw neighbours; ditkit's T=1 decode calls it per frame")


@entry("comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.decode[T=1]", nodes=VAE_DECODE, what="behaviour")
def _t1_path():
    """Single-frame decode: ditkit repeat-decodes while the host keeps the last of one token's frames."""
    path = host_t1_path()
    if path == "last_of_one":
        return Probe.holds("0.33-0.38: the host keeps the last frame of a 1-token decode; ditkit repeat-decodes")
    if path == "unknown":
        return Probe.broken("MiniMaxH3VideoVAE.decode of a single latent frame does neither the 0.33 steps nor a "
                            "recognisable single-image path")
    return Probe.adapted("the host has its own single-image path (announced for 0.40); ditkit defers to it and "
                         "says so")


@entry("comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.__init__[num_layers]", nodes=VAE_LOADER, what="signature")
def _vae_num_layers():
    """ditkit builds scaled H3 VAEs with the decoder depth of the file."""
    from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE

    if "num_layers" in _params(MiniMaxH3VideoVAE.__init__):
        return Probe.adapted("0.38: takes num_layers; ditkit passes the depth counted in the file")
    return Probe.holds("0.33: the decoder depth is set on the ViT3DDecoder ditkit builds")


@entry("comfy.model_patcher.ModelPatcher.__init__[fast_disk]", nodes=VAE_LOADER, what="signature")
def _patcher_fast_disk():
    """Patchers ditkit builds keep the host's fast_disk setting when it has one."""
    from comfy.model_patcher import ModelPatcher

    if "fast_disk" in _params(ModelPatcher.__init__):
        return Probe.adapted("0.38: takes fast_disk; the H3 VAE patcher ditkit rebuilds keeps the replaced "
                             "patcher's value when it records one; ditkit's Z-Image patcher is built without it "
                             "(only comfy.storage's fast-disk loading is lost)")
    return Probe.holds("0.33: no fast_disk")
