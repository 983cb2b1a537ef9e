"""Layerwise weight streaming for modules built from a list of layers (text encoders, optionally a DiT).

Each layer's parameters and buffers are packed once into one host buffer per dtype (pinned when the target is
CUDA; offsets aligned to :data:`ALIGN` bytes). The host pack is the source of truth: the module's own tensors
are re-pointed at views of it, so packing costs no second host copy and releasing a layer never copies back.

At run time :meth:`LayerwiseStreamer.acquire` makes layer ``i`` device-resident (waiting for its copy) and
queues copies of the next ``prefetch`` layers; :meth:`LayerwiseStreamer.release` points the layer back at the
host pack and drops the device buffer. On CUDA the copies run on a dedicated stream with one event per layer;
on any other device (and in the CPU tests) copies are synchronous. Embedding tables stay on the host
(:class:`HostEmbedding`): token ids go to the host, the looked-up rows come back.

Accounting (:class:`LayerStreamStats`): bytes copied host->device, layers streamed, peak device-resident streamed
bytes (sum of live device packs), prefetch hits (copy already issued when the layer was needed).

The CUDA path (streams, events, ``record_stream``) is written for GPUs but was only exercised on CPU here.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ..report import ProgressFn, Report

ALIGN = 256  # bytes; >= the 32 B fused kernels need, and the CUDA allocator's own granularity


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class LayerStreamStats(Report):
    bytes_h2d: int = 0
    layers_streamed: int = 0
    prefetch_hits: int = 0
    sync_loads: int = 0
    peak_device_bytes: int = 0
    live_device_bytes: int = 0
    host_embedding_bytes_read: int = 0
    passes: int = 0

    def note_alloc(self, n: int) -> None:
        self.live_device_bytes += n
        self.peak_device_bytes = max(self.peak_device_bytes, self.live_device_bytes)

    def note_free(self, n: int) -> None:
        self.live_device_bytes -= n

    def reset(self) -> None:
        live = self.live_device_bytes
        self.__init__()
        self.live_device_bytes = live
        self.peak_device_bytes = live


@dataclass
class _Slot:
    name: str
    owner: torch.nn.Module
    attr: str
    is_param: bool
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int  # bytes into the dtype pack
    nbytes: int


@dataclass
class LayerPack:
    """Host-side packed storage of one layer: one uint8 buffer per dtype plus the tensor slots."""
    index: int
    host: dict = field(default_factory=dict)        # dtype -> uint8 host buffer
    slots: list = field(default_factory=list)       # [_Slot]
    nbytes: int = 0

    def views(self, bufs: dict) -> list[torch.Tensor]:
        out = []
        for s in self.slots:
            flat = bufs[s.dtype][s.offset:s.offset + s.nbytes].view(s.dtype)
            out.append(flat.as_strided(s.shape, s.stride))
        return out


def _tensors_of(layer: torch.nn.Module):
    for mod_name, mod in layer.named_modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None:
                yield f"{mod_name}.{attr}" if mod_name else attr, mod, attr, True, p
        for attr, b in list(mod._buffers.items()):
            if b is not None:
                yield f"{mod_name}.{attr}" if mod_name else attr, mod, attr, False, b


def pack_layer(index: int, layer: torch.nn.Module, pin: bool) -> LayerPack:
    """Copy every tensor of ``layer`` into per-dtype host packs and re-point the layer at views of them."""
    pack = LayerPack(index)
    sizes: dict = {}
    items = []
    seen: dict[int, _Slot] = {}
    for name, owner, attr, is_param, t in _tensors_of(layer):
        if t.device.type == "meta":
            raise ValueError(f"layer {index}: tensor {name!r} is on the meta device (weights not loaded)")
        if id(t) in seen:  # shared tensor (tied weights): one slot, several owners handled at bind time
            items.append((name, owner, attr, is_param, t, seen[id(t)]))
            continue
        t_c = t.detach()
        nbytes = t_c.numel() * t_c.element_size()
        off = sizes.get(t_c.dtype, 0)
        slot = _Slot(name, owner, attr, is_param, t_c.dtype, tuple(t_c.shape),
                     tuple(t_c.contiguous().stride()), off, nbytes)
        sizes[t_c.dtype] = _align(off + nbytes)
        seen[id(t)] = slot
        items.append((name, owner, attr, is_param, t, slot))
    for dt, n in sizes.items():
        buf = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=pin)
        pack.host[dt] = buf
    unique = []
    for name, owner, attr, is_param, t, slot in items:
        if slot.name == name:
            dst = pack.host[slot.dtype][slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
            dst.copy_(t.detach().to("cpu"))
            unique.append(slot)
    pack.slots = unique
    pack.nbytes = sum(s.nbytes for s in unique)
    # aliases (tied tensors) follow their first slot
    pack._aliases = [(owner, attr, is_param, slot) for name, owner, attr, is_param, t, slot in items
                     if slot.name != name]
    bind(pack, pack.host)
    return pack


def bind(pack: LayerPack, bufs: dict) -> None:
    """Point the layer's tensors at ``bufs`` (host packs or device packs)."""
    views = pack.views(bufs)
    by_slot = {}
    for s, v in zip(pack.slots, views):
        _assign(s.owner, s.attr, s.is_param, v)
        by_slot[id(s)] = v
    for owner, attr, is_param, slot in getattr(pack, "_aliases", []):
        _assign(owner, attr, is_param, by_slot[id(slot)])


def _assign(owner: torch.nn.Module, attr: str, is_param: bool, v: torch.Tensor) -> None:
    if is_param:
        p = owner._parameters[attr]
        p.data = v  # keep the Parameter object (ComfyUI's patch/backup bookkeeping holds it)
    else:
        owner._buffers[attr] = v


class _Copier:
    """Synchronous copier (CPU targets, or devices without streams)."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self, host: dict) -> tuple[dict, object]:
        return {dt: b.to(self.device, copy=True) for dt, b in host.items()}, None

    def wait(self, token) -> None:
        return None

    def retire(self, bufs: dict) -> None:
        return None


class _CudaCopier(_Copier):
    """Copies on a dedicated CUDA stream; one event per issued copy; buffers retired with ``record_stream``.

    UNTESTED ON GPU in this repository's CI (no GPU was available); the logic mirrors the documented
    stream/event protocol: the copy stream waits for the compute stream before allocating (so a buffer freed by
    compute is not overwritten early), compute waits for the layer's event before use, and every device buffer
    is ``record_stream``-ed on the compute stream before its last reference is dropped.
    """

    def __init__(self, device: torch.device, cuda=None, alloc_device=None):
        super().__init__(device)
        # ``cuda``: the torch.cuda namespace (injectable so the call protocol can be checked without a GPU);
        # ``alloc_device``: where device buffers are allocated (the device itself unless a test overrides it)
        self.cuda = cuda if cuda is not None else torch.cuda
        self.alloc_device = alloc_device if alloc_device is not None else device
        self.stream = self.cuda.Stream(device=device)

    def start(self, host: dict):
        compute = self.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with self.cuda.stream(self.stream):
            bufs = {dt: torch.empty(b.numel(), dtype=torch.uint8, device=self.alloc_device) for dt, b in host.items()}
            for dt, b in host.items():
                bufs[dt].copy_(b, non_blocking=True)
            ev = self.cuda.Event()
            ev.record(self.stream)
        return bufs, ev

    def wait(self, token) -> None:
        if token is not None:
            self.cuda.current_stream(self.device).wait_event(token)

    def retire(self, bufs: dict) -> None:
        compute = self.cuda.current_stream(self.device)
        for b in bufs.values():
            self.record_stream(b, compute)

    def record_stream(self, buf: torch.Tensor, stream) -> None:
        buf.record_stream(stream)


class LayerwiseStreamer:
    """Streams ``layers`` (a list of modules) to ``device`` one layer at a time with ``prefetch`` lookahead.

    ``prefetch`` is the number of layers copied ahead of the one in use (0 = load each layer when it is needed).
    The peak of device-resident streamed weights is at most ``(1 + prefetch)`` layers. Wrap-around: after the
    last layer the first ``prefetch`` layers of the next pass are queued (``wrap=True``), which suits a DiT run
    every step; text encoders run once per prompt and keep ``wrap=False``.

    ``progress(done, total)`` (optional) is called after each layer is packed in ``__init__`` (1..n layers); the
    optional attribute ``on_layer_done(done, total)`` is called after each layer ran (``done`` = index + 1).
    """

    def __init__(self, layers, device, prefetch: int = 1, pin: bool | None = None, wrap: bool = False,
                 name: str = "layers", progress: ProgressFn | None = None):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.device = torch.device(device)
        self.layers = list(layers)
        self.prefetch = int(prefetch)
        self.wrap = bool(wrap)
        self.name = name
        cuda = self.device.type == "cuda"
        self.pin = (cuda and torch.cuda.is_available()) if pin is None else bool(pin)
        self.packs = []
        for i, layer in enumerate(self.layers):   # packing a large encoder takes long: report each layer
            self.packs.append(pack_layer(i, layer, self.pin))
            if progress is not None:
                progress(i + 1, len(self.layers))
        self.copier = _CudaCopier(self.device) if cuda else _Copier(self.device)
        self.stats = LayerStreamStats()
        self._inflight: dict[int, tuple[dict, object]] = {}   # issued, not yet acquired
        self._resident: dict[int, dict] = {}                   # acquired (bound to device views)
        self._lock = threading.RLock()
        self.events: list[tuple[str, int]] = []                # ("copy"/"acquire"/"release", index): test trace
        self.trace = False
        self.on_pass_end = None                                # callable() after the last layer of a pass
        self.on_layer_done = None                              # callable(done, total) after each layer ran
        self.last_pass: dict | None = None                     # stats snapshot taken at the end of each pass

    # -- sizes ---------------------------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        return sum(sum(b.numel() for b in p.host.values()) for p in self.packs)

    def layer_bytes(self, i: int) -> int:
        return sum(b.numel() for b in self.packs[i].host.values())

    @property
    def max_layer_bytes(self) -> int:
        return max((self.layer_bytes(i) for i in range(len(self.packs))), default=0)

    # -- protocol ------------------------------------------------------------------------------------------
    def _issue(self, i: int) -> None:
        if i in self._inflight or i in self._resident:
            return
        bufs, tok = self.copier.start(self.packs[i].host)
        n = sum(b.numel() for b in bufs.values())
        self.stats.note_alloc(n)
        self.stats.bytes_h2d += n
        self._inflight[i] = (bufs, tok)
        if self.trace:
            self.events.append(("copy", i))

    def acquire(self, i: int) -> None:
        with self._lock:
            if i in self._resident:
                return
            if i == 0:
                self.stats.passes += 1
            if i in self._inflight:
                self.stats.prefetch_hits += 1
            else:
                self.stats.sync_loads += 1
                self._issue(i)
            bufs, tok = self._inflight.pop(i)
            self.copier.wait(tok)
            bind(self.packs[i], bufs)
            self._resident[i] = bufs
            self.stats.layers_streamed += 1
            if self.trace:
                self.events.append(("acquire", i))
            n = len(self.packs)
            for k in range(1, self.prefetch + 1):
                j = i + k
                if j >= n:
                    if not self.wrap:
                        break
                    j %= n
                if j == i:
                    break
                self._issue(j)

    def release(self, i: int) -> None:
        with self._lock:
            bufs = self._resident.pop(i, None)
            if bufs is None:
                return
            bind(self.packs[i], self.packs[i].host)
            self.copier.retire(bufs)
            self.stats.note_free(sum(b.numel() for b in bufs.values()))
            if self.trace:
                self.events.append(("release", i))

    def drop_all(self) -> None:
        """Release every resident and in-flight layer (end of a pass, an error, or uninstall)."""
        with self._lock:
            for i in list(self._resident):
                self.release(i)
            for i, (bufs, tok) in list(self._inflight.items()):
                self.copier.wait(tok)
                self.copier.retire(bufs)
                self.stats.note_free(sum(b.numel() for b in bufs.values()))
            self._inflight.clear()

    def run_layer(self, i: int, fn, *args, **kwargs):
        """``acquire(i)``, call ``fn``, ``release(i)``; on an exception every device copy is dropped."""
        try:
            self.acquire(i)
            out = fn(*args, **kwargs)
        except BaseException:
            self.drop_all()
            raise
        self.release(i)
        if self.on_layer_done is not None:
            try:
                self.on_layer_done(i + 1, len(self.packs))
            except BaseException:   # e.g. the host's interrupt, raised from its progress hook
                self.drop_all()
                raise
        if i == len(self.packs) - 1:
            if not self.wrap:
                self.drop_all()
            self.last_pass = self.stats.as_dict()
            if self.on_pass_end is not None:
                self.on_pass_end()
        return out


class StreamedLayer(torch.nn.Module):
    """Stands in for layer ``index`` inside its ModuleList; the real layer is held unregistered, so the host
    framework's loader never moves it, and every call runs it through the streamer."""

    def __init__(self, streamer: LayerwiseStreamer, index: int, guard=None):
        super().__init__()
        object.__setattr__(self, "_streamer", streamer)
        object.__setattr__(self, "_real", streamer.layers[index])
        object.__setattr__(self, "_guard", guard)
        self.index = index

    @property
    def real_layer(self) -> torch.nn.Module:
        return self._real

    def forward(self, *args, **kwargs):
        if self._guard is not None:
            try:
                self._guard(self.index)
            except BaseException:
                self._streamer.drop_all()
                raise
        return self._streamer.run_layer(self.index, self._real, *args, **kwargs)


class HostEmbedding(torch.nn.Module):
    """Runs an embedding module on the host: ids go to the table's device (host), rows come back.

    The wrapped module is held unregistered (it never moves to the device). ``weight`` is exposed for code that
    reads the table's device or shape."""

    def __init__(self, embedding: torch.nn.Module, stats: LayerStreamStats | None = None):
        super().__init__()
        object.__setattr__(self, "_emb", embedding)
        object.__setattr__(self, "_stats", stats)

    @property
    def weight(self):
        return self._emb.weight

    @property
    def real_embedding(self) -> torch.nn.Module:
        return self._emb

    def forward(self, input_ids, *args, **kwargs):
        host = self._emb.weight.device
        out = self._emb(input_ids.to(host), *args, **kwargs)
        if self._stats is not None:
            self._stats.host_embedding_bytes_read += out.numel() * self._emb.weight.element_size()
        return out.to(input_ids.device, non_blocking=input_ids.device.type == "cuda")


def find_layer_stacks(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Submodules that own a ``layers`` ModuleList and an ``embed_tokens`` (llama-style decoders)."""
    out = []
    for name, mod in root.named_modules():
        layers = getattr(mod, "_modules", {}).get("layers")
        if isinstance(layers, torch.nn.ModuleList) and "embed_tokens" in mod._modules and len(layers) > 0:
            out.append((name, mod))
    return out
