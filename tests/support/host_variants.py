"""Host variants: the recorded ComfyUI 0.35-0.38 changes that touch ditkit, reproduced IN PROCESS on the real 0.33
classes (no newer tree can be obtained here; docs/compat.md). Written for these tests from the behaviour recorded in
the cited upstream files; no upstream code is copied. Each variant is a context manager that installs the change on
the live 0.33 host (class attributes / module functions, restored on exit) so the real 0.33 host runs with the newer
semantics, and ``contract.check_all(refresh=True)`` can be asked which entries it adapts to.

Sources (read with the search tools, never copied):

* ``zhongzichang/ComfyUI`` @ ``03faf555c9bba807fd3e5fb8d5ceeb6d698f5237`` (0.38.0):
  ``comfy/ldm/minimax/model.py`` (``DiTBlock.forward(..., attention=None)``, ``block_wrap`` passing
  ``attention=args.get("attention")``, ``transformer_options["minimax_h3_layout"]`` / ``["block_index"]``,
  ``Attention(gate_compress=...)`` building ``to_gate_compress``, ``Attention.comfy_attention`` passed as
  ``preferred_attention``), ``comfy/ldm/minimax/vae.py`` (``tiled_decode`` blending against already-blended
  neighbours, ``_decode_tile_row`` batching, ``MiniMaxH3VideoVAE(num_layers=36)``);
* ``zhongzichang/ComfyUI`` @ ``caa096493d3bbda968ef20d9cabf93f1a4fdad0e``: ``comfy/ldm/modules/attention.py``
  (``wrap_attn`` pops ``preferred_attention``; uses it only when no override is installed);
* ``Comfy-Org/ComfyUI`` @ ``01dafad3aa6ccf46e7b6f8b7b61a8138cd8b0261``: ``comfy_extras/nodes_sparse_attention.py``
  (``BlockSparseAttention``: ``("double_block", i)`` replaces that set ``args["attention"]``, installed with
  ``set_model_patch_replace`` over existing ones; its override re-installed on top at every ``ON_PREPARE_STATE``);
* ComfyUI PR 16148 (``comfy.model_prefetch.pause_malloc_graph``), as described in
  ``/work/shared/reference/comfyui_current.md`` (no source readable: the variant records calls only).
"""
from __future__ import annotations

import contextlib
import sys
import types

import torch

LAYOUT = "_".join(("minimax", "h3", "layout"))  # spelled so that only the publishing variant's source names it


@contextlib.contextmanager
def _patched(obj, **attrs):
    """Set attributes on ``obj`` (a class or module) and restore (or remove) them on exit."""
    missing = object()
    old = {k: obj.__dict__.get(k, missing) if isinstance(obj, type) else getattr(obj, k, missing) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is missing:
                delattr(obj, k)
            else:
                setattr(obj, k, v)


def _refresh():
    from ditkit.bridge import contract

    contract.reset()


@contextlib.contextmanager
def refreshed(cm):
    """Enter a variant with the contract table forgotten before and after (the next check sees the host as is)."""
    _refresh()
    try:
        with cm:
            yield
    finally:
        _refresh()


# ================================================================================================ model.py (0.35+)

def dit_block_attention_kwarg():
    """0.35+ ``DiTBlock.forward(x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None)``: runs
    ``attention`` instead of ``self.attn`` when given; the model's ``block_wrap`` passes ``args.get("attention")``.
    On the 0.33 model the block loop calls ``block(...)`` positionally and its ``block_wrap`` does not pass
    ``attention``: the variant's forward reads ``args["attention"]`` through the replace call instead, by wrapping
    the replace's ``original_block`` (see :func:`_model_forward_variant`)."""
    import comfy.ldm.minimax.model as M

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):  # noqa: B006
        att = self.attn if attention is None else attention
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
        h = M._mod_scale_shift(self.norm1(x), shift_msa, scale_msa, mod_segments)
        x = M._mod_gate(x, gate_msa, att(h, rope_freqs=rope_freqs, transformer_options=transformer_options),
                        mod_segments)
        h = M._mod_scale_shift(self.norm2(x), shift_mlp, scale_mlp, mod_segments)
        return M._mod_gate(x, gate_mlp, self.mlp(h), mod_segments)

    return _both(_patched(M.DiTBlock, forward=forward), _model_forward_variant(publish_layout=False))


@contextlib.contextmanager
def _both(*cms):
    with contextlib.ExitStack() as st:
        for cm in cms:
            st.enter_context(cm)
        yield


class _ReplaceView(dict):
    """``patches_replace["dit"]`` as the 0.38 block loop sees it: each replace gets ``"layout"`` in its args and an
    ``original_block`` that forwards ``args.get("attention")`` to the block (0.38 ``block_wrap``); the block index is
    published before each block."""

    def __init__(self, base: dict, to: dict, layout, blocks, publish: bool):
        super().__init__(base)
        self._to, self._layout, self._blocks, self._publish = to, layout, blocks, publish

    def __getitem__(self, key):
        fn = dict.__getitem__(self, key)
        kind, i = key
        blk = self._blocks[i]
        to, layout, publish = self._to, self._layout, self._publish
        if publish:
            to["block_index"] = i  # 0.38 publishes it before each block
        def call(args, extra):
            if publish:
                args = dict(args, layout=layout)

            def block_wrap(a):
                return {"img": blk(a["img"], a["t_emb"], a["mod_segments"], a["rope_freqs"],
                                   transformer_options=a["transformer_options"], attention=a.get("attention"))}
            return fn(args, {"original_block": block_wrap})

        return call


@contextlib.contextmanager
def _model_forward_variant(publish_layout: bool, published=None):
    """0.38 ``MiniMaxH3Model._forward`` block-loop protocol on the 0.33 model: (``publish_layout``) the forward's
    ``PackedLayout`` under ``transformer_options["minimax_h3_layout"]`` and ``["block_index"] = i`` before each
    block; the double-block replace args gain ``"layout"``; ``block_wrap`` passes ``attention=``. Done by wrapping
    the 0.33 ``_forward`` (same layout construction as the host's) and the ``("double_block", i)`` lookups; the
    block index is published for blocks that have a replace (the ones ditkit's checks look at)."""
    import comfy.ldm.common_dit
    import comfy.ldm.minimax.model as M

    orig = M.MiniMaxH3Model._forward

    def _forward(self, x, timestep, context, transformer_options={}, minimax_payload=None, **kw):  # noqa: B006
        payload = minimax_payload or {}
        video = comfy.ldm.common_dit.pad_to_patch_size(x[0], self.patch_size)
        sig = (context.shape[1], video.shape[2], video.shape[3], video.shape[4], x[1].shape[-1])
        layout = payload.get("layout")
        if layout is None or tuple(layout.signature) != sig:
            layout = M.PackedLayout(*sig, keyframes=payload.get("keyframes"), refs=payload.get("refs"))
        to = transformer_options
        if publish_layout:
            to[LAYOUT] = layout if published is None else published(layout)
        pr = to.get("patches_replace")
        if pr is not None and "dit" in pr:
            view = dict(pr)
            view["dit"] = _ReplaceView(pr["dit"], to, layout, self.blocks, publish_layout)
            to["patches_replace"] = view
        try:
            return orig(self, x, timestep, context, transformer_options=to, minimax_payload=minimax_payload, **kw)
        finally:
            if pr is not None:
                to["patches_replace"] = pr

    def _forward_publishing(self, *a, **kw):  # writes transformer_options["minimax_h3_layout"] (0.38 source)
        return _forward(self, *a, **kw)

    with _patched(M.MiniMaxH3Model, _forward=_forward_publishing if publish_layout else _forward):
        yield


def published_layout(published=None):
    """0.38: the forward publishes ``minimax_h3_layout`` / ``block_index``; replace args carry ``"layout"``.
    ``published(layout)``: what is published instead (a drifted host), for the refusal test."""
    return _model_forward_variant(publish_layout=True, published=published)


def stock_gates(build: bool = False):
    """0.35+: ``Attention(..., gate_compress=False, ...)`` builds ``attn.to_gate_compress`` (Linear hidden -> inner,
    no bias) when the checkpoint has it, so a stock load of a FastH3 file carries its gates. On 0.33:
    ``Attention.__init__`` gains the keyword; with ``build`` every H3 ``DiTBlock`` built meanwhile gets the module
    (as 0.38's model detection does for a checkpoint with gate keys: use it with FastH3 files only), and the host's
    own state-dict load fills it."""
    import comfy.ldm.minimax.model as M

    orig_attn = M.Attention.__init__
    orig_block = M.DiTBlock.__init__

    def attn_init(self, hidden, heads, head_dim, eps, gate_compress=False, dtype=None, device=None,
                  operations=None):
        orig_attn(self, hidden, heads, head_dim, eps, dtype=dtype, device=device, operations=operations)
        self.to_gate_compress = None
        if gate_compress:
            self.to_gate_compress = operations.Linear(hidden, heads * head_dim, bias=False, dtype=dtype,
                                                      device=device)

    def block_init(self, hidden, heads, head_dim, ffn, t_dim, eps, qk_eps, *a, dtype=None, device=None,
                   operations=None, **kw):
        orig_block(self, hidden, heads, head_dim, ffn, t_dim, eps, qk_eps, *a, dtype=dtype, device=device,
                   operations=operations, **kw)
        if build:
            self.attn.to_gate_compress = operations.Linear(hidden, heads * head_dim, bias=False, dtype=dtype,
                                                           device=device)

    return _both(_patched(M.Attention, __init__=attn_init), _patched(M.DiTBlock, __init__=block_init))


def add_stock_gates(model_patcher, gates: dict) -> None:
    """What a 0.35+ stock load leaves on the model: ``attn.to_gate_compress`` modules holding the file's gates."""
    dm = model_patcher.model.diffusion_model
    for i, w in gates.items():
        attn = dm.blocks[i].attn
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
        attn.to_gate_compress = lin


# ================================================================================================ attention.py

class ComfyAttentionChoice:
    """0.38's ``ComfyAttention``: the checkpoint's attention choice; ``.function`` is the attention to run (None:
    the host's default)."""

    def __init__(self, function=None):
        self.function = function


def wrap_attn_preferred(choice_function):
    """0.38 ``wrap_attn`` + ``Attention.forward``: the H3 attention passes ``preferred_attention=
    self.comfy_attention``; ``wrap_attn`` pops it, calls an installed override WITHOUT it, and uses
    ``preferred_attention.function`` only when no override is installed. On 0.33: ``optimized_attention`` as
    imported by ``comfy.ldm.minimax.model`` is replaced by a function with that protocol, and every H3 attention
    module gets ``comfy_attention`` = :class:`ComfyAttentionChoice(choice_function)`."""
    import comfy.ldm.minimax.model as M
    from comfy.ldm.modules.attention import AttentionTensorContainer

    base = M.optimized_attention

    def optimized_attention(q, k, v, heads, *args, preferred_attention=None, **kwargs):
        to = kwargs.get("transformer_options") or {}
        if "optimized_attention_override" in to or preferred_attention is None \
                or preferred_attention.function is None:
            return base(q, k, v, heads, *args, **kwargs)  # 0.33's wrapper: the override gets no preferred_attention
        q, k, v = (t.take() if isinstance(t, AttentionTensorContainer) else t for t in (q, k, v))
        return preferred_attention.function(q, k, v, heads, *args, **kwargs)

    attn_fwd = M.Attention.forward

    def forward(self, x, rope_freqs=None, transformer_options={}):  # noqa: B006
        choice = getattr(self, "comfy_attention", None)
        if choice is None:
            return attn_fwd(self, x, rope_freqs=rope_freqs, transformer_options=transformer_options)
        with _patched(M, optimized_attention=lambda *a, **kw: optimized_attention(*a, preferred_attention=choice,
                                                                                   **kw)):
            return attn_fwd(self, x, rope_freqs=rope_freqs, transformer_options=transformer_options)

    @contextlib.contextmanager
    def cm():
        with _patched(M, optimized_attention=optimized_attention), _patched(M.Attention, forward=forward):
            yield

    return cm()


def set_comfy_attention(model_patcher, function) -> None:
    for blk in model_patcher.model.diffusion_model.blocks:
        blk.attn.comfy_attention = ComfyAttentionChoice(function)


# ================================================================================================ model_prefetch

class MallocGraph:
    """``comfy.model_prefetch.pause_malloc_graph()`` (ComfyUI PR 16148) as a recorder: ``paused`` is True inside it.
    ``allocs_in_graph`` counts tensors ditkit creates while NOT paused through :meth:`track`."""

    def __init__(self):
        self.paused = 0
        self.entered = 0

    @contextlib.contextmanager
    def pause_malloc_graph(self):
        self.paused += 1
        self.entered += 1
        try:
            yield
        finally:
            self.paused -= 1


def malloc_graph(mg: MallocGraph):
    import comfy.model_prefetch as mp

    return _patched(mp, pause_malloc_graph=mg.pause_malloc_graph)


# ================================================================================================ vae.py (0.38)

def blended_neighbour_tiled_decode():
    """0.38 ``MiniMaxH3VideoVAE.tiled_decode``: tiles are decoded a row at a time through ``_decode_tile_row``
    (several tiles per decoder call, concatenated on the batch dimension) and each tile is blended against its
    neighbours AS ALREADY BLENDED (the canvas strip above, the blended left tail), not their raw decodes. Own code
    from the recorded behaviour."""
    from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE as V

    def _decode_tile_row(self, z_row, x_idx, x_len):
        parts = [z_row[..., p // self.vae_ratio:(p + n) // self.vae_ratio] for p, n in zip(x_idx, x_len)]
        for k in range(0, len(parts), 2):  # two tiles per decoder call
            group = parts[k:k + 2]
            yield from self._decode_pixels(torch.cat(group)).chunk(len(group))

    def tiled_decode(self, z):
        r = self.vae_ratio
        height, width = z.shape[-2] * r, z.shape[-1] * r
        ys, yl, yo = self.split_tiles(height)
        xs, xl, xo = self.split_tiles(width)
        canvas = None
        for i, (y0, ylen) in enumerate(zip(ys, yl)):
            row = self._decode_tile_row(z[..., y0 // r:(y0 + ylen) // r, :], xs, xl)
            left = None
            for j, (x0, xlen) in enumerate(zip(xs, xl)):
                tile = next(row)
                if canvas is None:
                    canvas = torch.zeros(*tile.shape[:-2], height, width, dtype=tile.dtype, device=tile.device)
                if i > 0:  # the canvas above already holds the blended result of the previous row
                    above = canvas[..., y0:y0 + yo[i - 1], x0:x0 + xlen]
                    tile = self.blend(above, tile, yo[i - 1], dim=-2)
                if j > 0:
                    tile = self.blend(left, tile, xo[j - 1], dim=-1)
                left = tile[..., :, -xo[j]:].clone() if j < len(xs) - 1 else None
                canvas[..., y0:y0 + tile.shape[-2], x0:x0 + tile.shape[-1]] = tile
        return canvas

    return _patched(V, tiled_decode=tiled_decode, _decode_tile_row=_decode_tile_row)


def host_single_image_decode():
    """Announced for 0.40 (ComfyUI PR 16881, not readable here): ``decode`` of a single latent frame repeats it into
    a short clip, decodes that through the temporal path and keeps the valid first frame."""
    from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE as V

    orig = V.decode

    def decode(self, z, output_buffer=None):
        if z.shape[2] != 1:
            return orig(self, z, output_buffer)
        mean = self.latents_mean.view(1, -1, 1, 1, 1).to(z)
        std = self.latents_std.view(1, -1, 1, 1, 1).to(z)
        clip = (z * std + mean).repeat(1, 1, 2, 1, 1)
        dec = self.decode_temporal(clip)[:, :, :1]
        if output_buffer is None:
            return dec
        output_buffer.copy_(dec)
        return output_buffer

    return _patched(V, decode=decode)



def _with_keyword(new, orig, name: str, default):
    """``new`` (a ``(self, *a, <name>=..., **kw)`` wrapper) carries ``orig``'s signature plus the keyword ``name``,
    as the upstream method has it (0.38 adds a keyword; every parameter ditkit passes keeps its name)."""
    import inspect

    sig = inspect.signature(orig)
    params = list(sig.parameters.values())
    kw = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
    at = next((i for i, p in enumerate(params) if p.kind == inspect.Parameter.VAR_KEYWORD), len(params))
    new.__signature__ = sig.replace(parameters=params[:at] + [kw] + params[at:])
    return new

def vae_num_layers():
    """0.38 ``MiniMaxH3VideoVAE.__init__(..., num_layers=36, operations=ops)``: the decoder depth as a keyword."""
    from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE as V

    orig = V.__init__

    def __init__(self, *a, num_layers=36, **kw):
        orig(self, *a, **kw)
        self._hv_num_layers = num_layers  # what the 0.38 decoder would be built with

    return _patched(V, __init__=_with_keyword(__init__, orig, "num_layers", 36))


def patcher_fast_disk(host_default: bool = True):
    """0.38 ``ModelPatcher.__init__(..., fast_disk=False)``: the keyword defaults to False; the host's own call
    sites in ``comfy.sd`` pass what ``comfy.storage`` decided, here ``host_default`` (as when a fast disk is
    found). A patcher built elsewhere without the keyword gets False."""
    from comfy.model_patcher import ModelPatcher

    orig = ModelPatcher.__init__

    def __init__(self, *a, fast_disk=None, **kw):
        orig(self, *a, **kw)
        if fast_disk is None:  # not passed: the host's comfy.sd passes its decision, anyone else gets the default
            fast_disk = host_default if sys._getframe(1).f_globals.get("__name__") == "comfy.sd" else False
        self.fast_disk = fast_disk

    return _patched(ModelPatcher, __init__=_with_keyword(__init__, orig, "fast_disk", False))


# ================================================================================================ core sparse node

BSA_MODULE = "comfy_extras.nodes_sparse_attention"


def _as_bsa(fn):
    fn.__module__ = BSA_MODULE  # the marker a patch of core's node carries (its closures live in that module)
    return fn


def _bsa_block_patch(block, counter):
    def attention(h, rope_freqs=None, transformer_options={}):  # noqa: B006
        counter["attention"] = counter.get("attention", 0) + 1
        return block.attn(h, rope_freqs=rope_freqs, transformer_options=transformer_options)

    def block_patch(args, extra):
        return extra["original_block"]({**args, "attention": attention})

    _as_bsa(attention)
    return _as_bsa(block_patch)


def _bsa_install_override(installed: set, to: dict, counter: dict) -> None:
    cur = to.get("optimized_attention_override")
    if cur in installed:
        return

    def override(func, *a, **kw):
        counter["override"] = counter.get("override", 0) + 1
        return func(*a, **kw) if cur is None else cur(func, *a, **kw)

    installed.add(_as_bsa(override))
    to["optimized_attention_override"] = override


class BlockSparseAttention:
    """Stand-in for core's node (``comfy_extras/nodes_sparse_attention.py`` @ 01dafad3): ``apply`` clones the model,
    installs its override (re-installed on top at every ``ON_PREPARE_STATE``) and puts ``("double_block", i)``
    replaces on every H3 block with ``set_model_patch_replace``, OVERWRITING existing ones; each replace passes its
    own attention (dense math here, counted in ``counter["attention"]``) as ``args["attention"]``."""

    @classmethod
    def apply(cls, model, counter: dict):
        import comfy.patcher_extension as pe

        m = model.clone()
        installed: set = set()
        _bsa_install_override(installed, m.model_options["transformer_options"], counter)
        m.add_callback_with_key(pe.CallbacksMP.ON_PREPARE_STATE, "block_sparse_attention",
                                lambda mp, t, mo: _bsa_install_override(installed, mo["transformer_options"], counter))
        dm = model.get_model_object("diffusion_model")
        for i, block in enumerate(dm.blocks):
            m.set_model_patch_replace(_bsa_block_patch(block, counter), "dit", "double_block", i)
        return m


def block_sparse_module():
    """``comfy_extras.nodes_sparse_attention`` present in ``sys.modules`` with a ``BlockSparseAttention`` (what the
    contract's feature check imports)."""
    mod = types.ModuleType(BSA_MODULE)
    mod.BlockSparseAttention = BlockSparseAttention

    @contextlib.contextmanager
    def cm():
        old = sys.modules.get(BSA_MODULE)
        sys.modules[BSA_MODULE] = mod
        try:
            yield mod
        finally:
            if old is None:
                sys.modules.pop(BSA_MODULE, None)
            else:
                sys.modules[BSA_MODULE] = old

    return cm()
