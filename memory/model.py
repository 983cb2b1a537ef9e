"""The memory model: peak device and host bytes of one DiT sampling step, from the model's dimensions and weight
inventory, the packed token count, the compute dtype and the active ditkit options.

Plain python / torch; nothing is allocated. The activation terms follow what ComfyUI 0.33's MiniMax H3 forward
(``comfy/ldm/minimax/model.py``) keeps alive at its two peaks per block, in units of one token row:

* **persistent** through the block loop: the residual stream ``x`` [S, D], the video/audio/text embeddings the
  forward keeps as locals (another [S, D]), the rope rotation table [S, 192] in the compute dtype and the fp32
  patch rows and float64 positions (small); LTX-2 (``comfy/ldm/lightricks/av_model.py``): the residual, the split
  rope's cos + sin of the inner width ([S, D] together) and the a/v cross-attention rope (``extra_cols`` =
  audio_cross_attention_dim);
* **attention** (at the output projection): ``h = norm1(x)`` [S, D], the qkv projection [S, 3I] (q and k are views
  rotated in place), ``v.clone()`` [S, I], the attention output [S, I] and its head-merged copy [S, I], the
  projection's output [S, D]: ``S * (2D + 6I)``, plus the backend's score workspace (``ATTENTION``: 0 for flash /
  SDPA / sage / sparse, whose working set is per tile; ``H * S^2 * 4`` bytes per call for ``math``, which
  materialises fp32 scores);
* **feed-forward** (at fc2): ``h = norm2(x)`` [S, D], fc1's output [S, 2F], ``silu(gate) * up`` [S, F] and fc2's
  output [S, D]: ``S * (2D + 3F)``; chunked over tokens (``memory/chunking.py``) the intermediates exist for one
  chunk: ``S * 2D + c * (3F + D)``;
* a dequantizing format (fp8 / int8 / mxfp8 / nvfp4 computed in bf16) adds the largest linear weight cast to the
  compute dtype (ComfyUI casts one layer at a time).

Weights: the resident bytes of the inventory in the chosen format (``kernels/quant.quantized_nbytes`` for the
layers the family's recipe quantizes). Streaming keeps the non-block weights plus ``window`` blocks on the device
and every weight on the host. VAE decode is a separate phase (after sampling): its peak is ``vae_decode_bytes``.

The constants were checked against measured peak RSS on CPU in a fresh subprocess
(``benchmarks/bench_memory.py``; docs/memory.md has the table): every prediction within +-15 %.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..errors import DitKitError

GIB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FORMATS = ("bf16", "float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4")
ATTENTION = ("flash", "sub_quad", "math")
SUB_QUAD_CHUNKS = (4096, 2048, 1024, 512, 256)   # ComfyUI attention_sub_quad query chunks, largest first
ROPE_COLS = 192           # H3 rope rotation table per token: 48 pairs x 2 x 2 (compute dtype)
MAX_TOKENS = 50_000_000   # a packed sequence beyond this is refused as absurd (H3 10 s at 1920x1088 is ~0.2 M)


class MemoryModelError(DitKitError):
    """A memory prediction asked for with impossible inputs (absurd sizes, non-finite limits, unknown options)."""


@dataclass(frozen=True)
class DiTDims:
    family: str
    hidden: int            # D: residual width
    heads: int
    head_dim: int
    ffn: int               # F: width of the activation's output (SwiGLU: fc1 is 2F wide)
    layers: int
    ffn_kind: str = "swiglu"   # "swiglu" (fc1 2F -> F) | "gelu" (F -> F)
    extra_cols: int = ROPE_COLS  # persistent columns per token besides 2D (H3: its rope table; LTX-2: the a/v
    #                              cross-attention rope, audio_cross_attention_dim wide; Z-Image / FLUX.2: the fp32
    #                              rope table, 8 * head_dim bytes a row, in compute-dtype columns)
    single_layers: int = 0       # FLUX.2: single-stream blocks after the ``layers`` double-stream blocks
    latent_row_bytes: int = 0    # FLUX.2: bytes per image row held outside the blocks (the sampler's and the
    #                              model boundary's copies of the fp32 latent; bridge: LATENT_COPIES x C x 4)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class Weights:
    """Bytes of the model's tensors: ``blocks`` per block (list), ``other`` (embeddings, final layer, refiner),
    ``largest_linear`` (elements of the largest 2-D weight)."""
    blocks: tuple[int, ...]
    other: int
    largest_linear: int

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.other


@dataclass(frozen=True)
class Tokens:
    """Packed rows of one forward. ``video`` holds the latent's own rows: frames x area for a video model, the
    image's area for an image model (``image=True``: Z-Image, FLUX.2), so every report names them right."""
    video: int
    audio: int = 0
    text: int = 0
    refs: int = 0
    keyframes: int = 0
    image: bool = False

    @property
    def total(self) -> int:
        return self.video + self.audio + self.text + self.refs + self.keyframes

    @property
    def latent_name(self) -> str:
        """What the latent's rows are: "image" or "video"."""
        return "image" if self.image else "video"

    def describe(self) -> str:
        """The rows by part, named for the model: an image model has image and text rows only."""
        if self.image:
            refs = f", refs {self.refs:,}" if self.refs else ""
            return f"{self.total:,} tokens (image {self.video:,}, text {self.text:,}{refs})"
        return (f"{self.total:,} tokens (video {self.video:,}, audio {self.audio:,}, text {self.text:,}, "
                f"refs {self.refs:,}, keyframes {self.keyframes:,})")

    def as_dict(self) -> dict:
        if self.image:
            return {"image": self.video, "text": self.text, **({"refs": self.refs} if self.refs else {}),
                    "total": self.total}
        return {"video": self.video, "audio": self.audio, "text": self.text, "refs": self.refs,
                "keyframes": self.keyframes, "total": self.total}


@dataclass(frozen=True)
class Options:
    compute: str = "bfloat16"          # activation dtype
    weight_format: str = "bf16"        # resident format of the quantizable linears
    chunk: int | None = None           # feed-forward chunk in tokens (None: off)
    streaming: bool = False            # blocks streamed: `window` blocks device-resident
    window: int = 2
    attention: str = "flash"           # "flash" (SDPA / flash / sage / sparse), "sub_quad" (ComfyUI's CPU default), "math"
    free_bytes: int = 0                # free memory the sub_quad backend sizes its query chunk from
    upcast_attention: bool = False
    batch: int = 1                     # cond/uncond rows run together (ComfyUI batches CFG when memory allows)
    head_group: int | None = None      # attention over groups of this many heads (None: all heads per call)

    def describe(self) -> str:
        parts = [f"format {self.weight_format}", f"chunk {self.chunk if self.chunk else 'off'}",
                 f"streaming {'on' if self.streaming else 'off'}"]
        if self.head_group is not None:
            parts.append(f"attention {self.head_group} heads per call")
        return ", ".join(parts)


@dataclass
class Prediction:
    device: int
    host: int
    parts: dict = field(default_factory=dict)

    def gib(self) -> float:
        return self.device / GIB


def check_tokens(tokens: Tokens) -> None:
    for k, v in tokens.as_dict().items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise MemoryModelError(f"token count {k} must be an int >= 0, got {v!r}")
    if tokens.total <= 0:
        raise MemoryModelError("the packed sequence is empty (0 tokens)")
    if tokens.total > MAX_TOKENS:
        raise MemoryModelError(f"the packed sequence would be {tokens.total:,} tokens (> {MAX_TOKENS:,}): the latent "
                               "size is absurd for any device; check the latent's frames / width / height")


def _bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise MemoryModelError(f"unknown compute dtype {dtype!r} (one of {sorted(DTYPE_BYTES)})")
    return DTYPE_BYTES[dtype]


def _check_options(tokens: Tokens, opts: Options) -> None:
    check_tokens(tokens)
    if opts.attention not in ATTENTION:
        raise MemoryModelError(f"unknown attention backend class {opts.attention!r} (one of {ATTENTION})")
    if opts.chunk is not None and (isinstance(opts.chunk, bool) or not isinstance(opts.chunk, int) or opts.chunk <= 0):
        raise MemoryModelError(f"chunk must be None (off) or a positive number of tokens, got {opts.chunk!r}")


def activation_parts(d: DiTDims, tokens: Tokens, opts: Options) -> dict:
    """Peak activation bytes of one forward, by phase (module docstring; FLUX.2: :func:`flux2_activation_parts`)."""
    if d.family == "flux2":
        return flux2_activation_parts(d, tokens, opts)
    _check_options(tokens, opts)
    b = _bytes(opts.compute)
    s = tokens.total * max(1, int(opts.batch))
    D, I, F = d.hidden, d.inner, d.ffn
    fc1 = 2 * F if d.ffn_kind == "swiglu" else F
    persistent = s * (2 * D + int(d.extra_cols)) * b
    bh = d.heads * max(1, int(opts.batch))
    g = d.heads if opts.head_group is None else int(opts.head_group)
    if g <= 0:
        raise MemoryModelError(f"head_group must be None (off) or a positive number of heads, got {opts.head_group!r}")
    sb = 4 if (opts.upcast_attention or b == 4) else b
    if opts.attention == "flash":
        attn = s * (2 * D + 6 * I) * b
    elif opts.attention == "sub_quad":
        # q/k/v reshaped to [B*H, S, hd] (three copies), the output and its head-merged copy; scores + softmax of one
        # query chunk ([B*H, q, S] twice); the chunk is ComfyUI's rule on the free memory
        if g < d.heads:   # per group: its q/k/v copies and output; one [S, I] output filled group by group
            bg = g * max(1, int(opts.batch))
            q = sub_quad_chunk(bg, sb, tokens.total, opts.free_bytes)
            attn = max(s * (D + 5 * I) * b + s * 4 * I * g // d.heads * b
                       + 2 * bg * min(q, tokens.total) * tokens.total * sb, s * (D + 6 * I) * b)
        else:
            q = sub_quad_chunk(bh, sb, tokens.total, opts.free_bytes)
            attn = s * (D + 8 * I) * b + 2 * bh * min(q, tokens.total) * tokens.total * sb
    else:
        attn = s * (2 * D + 6 * I) * b + 2 * min(g, d.heads) * max(1, int(opts.batch)) * tokens.total ** 2 * sb
    if opts.chunk is None or opts.chunk >= tokens.total:
        ff = s * (2 * D + fc1 + F) * b
    else:
        from .chunking import plan_chunks

        c = max(b2 - a2 for a2, b2 in plan_chunks(tokens.total, opts.chunk)) * max(1, int(opts.batch))
        ff = (s * 2 * D + c * (fc1 + F + D)) * b
    return {"persistent": persistent, "attention": attn, "feed_forward": ff,
            "block_peak": persistent + max(attn, ff)}


def flux2_activation_parts(d: DiTDims, tokens: Tokens, opts: Options) -> dict:
    """Peak activation bytes of one FLUX.2 forward (ComfyUI 0.33 ``comfy/ldm/flux``: ``Flux.forward_orig``,
    ``DoubleStreamBlock``, ``SingleStreamBlock``, gated SiLU MLP ``SiLUActivation``), in rows of the joint sequence
    ``S`` = text + image + reference rows (``Si`` = image + reference rows, ``St`` = text rows), ``D`` = hidden
    (= heads x head_dim), ``F`` = MLP width (3D: the gated MLP's first linear is 2F wide):

    * **persistent**: the residual streams (double blocks: img [Si, D] + txt [St, D]; single blocks: the joint x
      [S, D] plus the txt [St, D] the forward keeps), the fp32 rope table ``pe`` (``extra_cols``) and, outside the
      blocks, the copies of the latent the sampler and the model boundary hold (``latent_row_bytes`` per image
      row: noise, latent, x, the CFG batch and its output buffers, the model input, padded and patchified);
    * **double attention** (q/k/v concatenated over txt + img and handed to the attention): q, k, v [S, D], the
      roped q and k [S, D] each, the output and its head-merged copy: ``7 S D`` plus the backend's scores (as the
      other families); before it, both streams' qkv [S, 3D] + normed q, k [S, 2D] + one concatenated [S, D]
      (``6 S D``, never above the attention's);
    * **double feed-forward** (img stream, the larger): the joint attention output [S, D] still alive (the txt
      half is a view of it) and the MLP's input [Si, D], ``linear 0`` [Si, 2F], ``silu(gate)`` [Si, F] and the
      product [Si, F]: ``S D + Si (D + 4F)``; chunked (DitKitActivationChunking chunks ``img_mlp`` / ``txt_mlp``):
      the input and the output [Si, D] whole, the intermediates of one chunk ``c (4F + D)``;
    * **single attention**: the fused ``linear1`` output [S, 3D + 2F] (q, k, v and the MLP half are views of
      it), normed q, k, roped q, k, the output and its merged copy: ``S (9D + 2F)`` plus the scores;
    * **single MLP** (not chunkable: fused into ``linear1``): ``linear1``'s output [S, 3D + 2F], the attention
      output [S, D], ``silu(gate)`` [S, F] and the product [S, F]: ``S (4D + 4F)``;
    * **head groups** (DitKitActivationChunking's ``attention_heads_per_call`` reaches FLUX.2's ``[B, H, S, hd]``
      attention calls): the scores of one group of ``g`` heads, plus that group's output ``S D g / H`` beside the
      full output.

    ``block_peak`` is the larger of the double and the single blocks' peaks (persistent included)."""
    _check_options(tokens, opts)
    b = _bytes(opts.compute)
    batch = max(1, int(opts.batch))
    s = tokens.total * batch
    st = tokens.text * batch
    si = s - st
    D, F = d.hidden, d.ffn
    if d.inner != D:
        raise MemoryModelError(f"FLUX.2 dims: heads x head_dim ({d.heads} x {d.head_dim}) must equal hidden {D}")
    g = d.heads if opts.head_group is None else int(opts.head_group)
    if g <= 0:
        raise MemoryModelError(f"head_group must be None (off) or a positive number of heads, got {opts.head_group!r}")
    g = min(g, d.heads)
    sb = 4 if (opts.upcast_attention or b == 4) else b
    bh = g * batch          # heads per attention call (HeadGroupAttention: one group at a time)
    if opts.attention == "flash":
        scores = 0
    elif opts.attention == "sub_quad":
        scores = 2 * bh * min(sub_quad_chunk(bh, sb, tokens.total, opts.free_bytes), tokens.total) * tokens.total * sb
    else:
        scores = 2 * bh * tokens.total ** 2 * sb
    # head groups: the full [S, D] output is filled group by group, one group's output [S, D g / H] beside it
    part = s * D * g // d.heads * b if g < d.heads else 0
    rope = s * int(d.extra_cols) * b + tokens.video * batch * int(d.latent_row_bytes)
    persistent_double = s * D * b + rope
    persistent_single = (s + st) * D * b + rope
    attn_double = 7 * s * D * b + part + scores
    rows = max(si, st)
    spans = [(0, rows // batch)]
    if opts.chunk is not None:   # apply_rows: one span is the module called whole
        from .chunking import plan_chunks

        spans = plan_chunks(rows // batch, opts.chunk)
    if len(spans) == 1:
        ff_rows = rows * (D + 4 * F)
    else:
        c = max(b2 - a2 for a2, b2 in spans) * batch
        ff_rows = 2 * rows * D + c * (4 * F + D)
    ff_double = (s * D + ff_rows) * b
    attn_single = s * (9 * D + 2 * F) * b + part + scores
    mlp_single = s * (4 * D + 4 * F) * b
    double = persistent_double + max(attn_double, ff_double) if d.layers else 0
    single = persistent_single + max(attn_single, mlp_single) if d.single_layers else 0
    return {"persistent": max(persistent_double, persistent_single), "attention": max(attn_double, attn_single),
            "feed_forward": max(ff_double, mlp_single), "double_block_peak": double, "single_block_peak": single,
            "block_peak": max(double, single)}


def sub_quad_chunk(batch_heads: int, score_bytes: int, k_tokens: int, free_bytes: int) -> int:
    """ComfyUI 0.33 ``attention_sub_quad``'s query chunk: the largest of 4096..256 with
    ``free / (B*H * bytes * chunk * 4) >= k_tokens``, else 512."""
    for x in SUB_QUAD_CHUNKS:
        if free_bytes / (batch_heads * score_bytes * x * 4.0) >= k_tokens:
            return x
    return 512


def weight_parts(w: Weights, opts: Options, quantized_fraction_bytes: int | None = None) -> dict:
    """Device / host weight bytes (``w`` already in ``opts.weight_format``)."""
    if opts.streaming:
        window = max(1, int(opts.window))
        dev = w.other + sum(sorted(w.blocks, reverse=True)[:window])
    else:
        dev = w.total
    cast = 0
    if opts.weight_format != "bf16":
        cast = w.largest_linear * _bytes(opts.compute)
    return {"weights_device": dev, "weights_host": w.total if opts.streaming else 0, "cast_workspace": cast}


def predict(d: DiTDims, w: Weights, tokens: Tokens, opts: Options, host_extra: int = 0) -> Prediction:
    """Peak device bytes of one sampling step and the host bytes it needs besides (streamed weights)."""
    act = activation_parts(d, tokens, opts)
    wp = weight_parts(w, opts)
    dev = wp["weights_device"] + wp["cast_workspace"] + act["block_peak"]
    parts = {**act, **wp}
    return Prediction(dev, wp["weights_host"] + int(host_extra), parts)


# ------------------------------------------------------------------------------------------------ weights

def weights_from_inventory(family: str, inv: dict, fmt: str, block_prefix) -> Weights:
    """``inv``: ``{key: (shape, dtype name "BF16"/"F32"/...)}`` (ComfyUI keys without the model prefix). Bytes in
    ``fmt`` (``"bf16"``: as stored) per block (keys under ``block_prefix`` + index; a tuple of prefixes: the
    blocks of each in turn, FLUX.2's double then single blocks) and the rest."""
    from ..kernels.quant import quantized_nbytes
    from ..loaders import quantize as qc

    sizes = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "U8": 1}
    if fmt not in FORMATS:
        raise MemoryModelError(f"unknown weight format {fmt!r} (one of {FORMATS})")
    prefixes = (block_prefix,) if isinstance(block_prefix, str) else tuple(block_prefix)
    blocks: dict[tuple[int, int], int] = {}
    other = 0
    largest = 0
    for k, (shape, dt) in inv.items():
        n = math.prod(shape)
        if fmt != "bf16" and qc.classify(family, k, tuple(shape))[1]:
            nb = quantized_nbytes(tuple(shape), fmt) + len(qc.marker_tensor(fmt))
        else:
            nb = n * sizes.get(dt, 2)
        if len(shape) == 2:
            largest = max(largest, n)
        j = next((j for j, pre in enumerate(prefixes) if k.startswith(pre)), None)
        if j is not None:
            i = (j, int(k[len(prefixes[j]):].split(".", 1)[0]))
            blocks[i] = blocks.get(i, 0) + nb
        else:
            other += nb
    return Weights(tuple(blocks[i] for i in sorted(blocks)), other, largest)


def with_format(opts: Options, **kw) -> Options:
    return replace(opts, **kw)
