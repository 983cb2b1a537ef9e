"""Layerwise streamer: scheduling, accounting, bit-equality (cpu -> cpu copies; the CUDA path is not run here)."""
from __future__ import annotations

import pytest
import torch

from ditkit.offload.streamer import (ALIGN, HostEmbedding, LayerwiseStreamer, StreamedLayer, find_layer_stacks,
                                     pack_layer)


class Block(torch.nn.Module):
    def __init__(self, d, g):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d, bias=False)
        self.fc_half = torch.nn.Linear(d, d).to(torch.bfloat16)   # a second dtype in the same layer
        self.register_buffer("scale", torch.rand(d, generator=g) + 0.5)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.2)

    def forward(self, x, mul=1.0):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        h = h + self.fc_half(x.to(torch.bfloat16)).float()
        return x + h * self.scale * mul


class Decoder(torch.nn.Module):
    def __init__(self, n=5, d=16, vocab=50, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed_tokens = torch.nn.Embedding(vocab, d)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(vocab, d, generator=g))
        self.layers = torch.nn.ModuleList([Block(d, g) for _ in range(n)])

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, mul=0.5)
        return x


def _install(model: Decoder, prefetch: int):
    st = LayerwiseStreamer(list(model.layers), "cpu", prefetch=prefetch, pin=False)
    st.trace = True
    for i in range(len(model.layers)):
        model.layers[i] = StreamedLayer(st, i)
    emb = HostEmbedding(model.embed_tokens, st.stats)
    model.embed_tokens = emb
    return st


def _layer_nbytes(layer):
    return sum(t.numel() * t.element_size() for t in list(layer.parameters()) + list(layer.buffers()))


@pytest.mark.parametrize("prefetch", [0, 1, 2, 7])
def test_streamed_output_bit_equal_and_peak_bounded(prefetch):
    torch.manual_seed(0)
    ref_model = Decoder()
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(ids)
    model = Decoder()  # same seed -> same weights, streamed
    n = len(model.layers)
    per_layer = max(_layer_nbytes(m) for m in model.layers)
    st = _install(model, prefetch)
    with torch.no_grad():
        out = model(ids)
        out2 = model(ids)
    assert torch.equal(out, ref)
    assert torch.equal(out2, ref)
    # peak device-resident streamed bytes: the layer in use + `prefetch` queued ones (plus alignment padding)
    n_tensors = len(list(model.layers[0].real_layer.parameters())) + len(list(model.layers[0].real_layer.buffers()))
    bound = min(prefetch + 1, n) * (per_layer + n_tensors * ALIGN)
    assert 0 < st.stats.peak_device_bytes <= bound
    assert st.stats.live_device_bytes == 0          # nothing left on the "device" after a pass
    assert st.stats.layers_streamed == 2 * n
    assert st.stats.passes == 2
    assert st.stats.bytes_h2d == 2 * st.host_bytes
    if prefetch == 0:
        assert st.stats.prefetch_hits == 0 and st.stats.sync_loads == 2 * n
    else:
        assert st.stats.sync_loads == 2 and st.stats.prefetch_hits == 2 * (n - 1)
    assert st.stats.host_embedding_bytes_read == 2 * ids.numel() * 16 * 4


def test_prefetch_order_trace():
    model = Decoder(n=4)
    st = _install(model, 1)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    ev = st.events
    # layer i+1's copy is issued right after layer i is acquired, before layer i is released
    for i in range(3):
        a = ev.index(("acquire", i))
        assert ev[a + 1] == ("copy", i + 1)
        assert ev.index(("copy", i + 1)) < ev.index(("release", i))
    # at most two layers ever live: count from the trace independently of the stats
    live, peak = set(), 0
    for kind, i in ev:
        if kind == "copy":
            live.add(i)
        elif kind == "release":
            live.discard(i)
        peak = max(peak, len(live))
    assert peak == 2


def test_host_pack_is_source_of_truth_and_aliases_module():
    model = Decoder(n=2)
    before = {k: v.clone() for k, v in model.layers[0].state_dict().items()}
    pack = pack_layer(0, model.layers[0], pin=False)
    after = model.layers[0].state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
        assert after[k].dtype == v.dtype and after[k].shape == v.shape
    # module tensors are views into the pack (no second host copy)
    hosts = {dt: (b.data_ptr(), b.data_ptr() + b.numel()) for dt, b in pack.host.items()}
    for name, p in model.layers[0].named_parameters():
        lo, hi = hosts[p.dtype]
        assert lo <= p.data_ptr() < hi, name
    # offsets are aligned
    for s in pack.slots:
        assert s.offset % ALIGN == 0


def test_exception_inside_layer_drops_device_copies():
    model = Decoder(n=3)
    st = _install(model, 2)

    class Boom(Exception):
        pass

    real = model.layers[1].real_layer
    orig = real.forward

    def bad(*a, **k):
        raise Boom()

    real.forward = bad
    with pytest.raises(Boom):
        with torch.no_grad():
            model(torch.tensor([[1]]))
    assert st.stats.live_device_bytes == 0
    assert not st._resident and not st._inflight
    real.forward = orig
    with torch.no_grad():
        model(torch.tensor([[1]]))  # usable again
    assert st.stats.live_device_bytes == 0


def test_guard_runs_before_layer_and_can_refuse():
    model = Decoder(n=2)
    st = LayerwiseStreamer(list(model.layers), "cpu", prefetch=1, pin=False)
    calls = []

    def guard(i):
        calls.append(i)
        if i == 1:
            raise RuntimeError("refused")

    for i in range(2):
        model.layers[i] = StreamedLayer(st, i, guard=guard)
    with pytest.raises(RuntimeError, match="refused"):
        with torch.no_grad():
            model(torch.tensor([[1]]))
    assert calls == [0, 1]
    assert st.stats.live_device_bytes == 0


def test_streamed_layers_are_hidden_from_module_tree():
    model = Decoder(n=2)
    st = _install(model, 1)
    names = [n for n, _ in model.named_parameters()]
    assert names == []  # neither layers nor the embedding table are visible to a framework loader
    assert st.layers[0] is model.layers[0].real_layer


def test_find_layer_stacks():
    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = torch.nn.Module()
            self.transformer.model = Decoder(n=2)

    found = find_layer_stacks(Wrap())
    assert [n for n, _ in found] == ["transformer.model"]


def test_negative_prefetch_rejected():
    with pytest.raises(ValueError, match="prefetch"):
        LayerwiseStreamer([torch.nn.Linear(2, 2)], "cpu", prefetch=-1)


def test_wraparound_prefetch_for_dit_use():
    model = Decoder(n=3)
    st = LayerwiseStreamer(list(model.layers), "cpu", prefetch=1, pin=False, wrap=True)
    for i in range(3):
        model.layers[i] = StreamedLayer(st, i)
    with torch.no_grad():
        model(torch.tensor([[1]]))
    # after the last layer the first layer of the next pass is already queued
    assert set(st._inflight) == {0}
    with torch.no_grad():
        model(torch.tensor([[1]]))
    assert st.stats.prefetch_hits == 5 and st.stats.sync_loads == 1
    st.drop_all()
    assert st.stats.live_device_bytes == 0


# --- the CUDA copier's stream/event protocol, checked with a recording fake of torch.cuda (no GPU here) ------
class FakeCuda:
    def __init__(self):
        self.log = []
        outer = self

        class Stream:
            def __init__(self, device=None):
                self.name = "copy"

            def wait_stream(self, other):
                outer.log.append(("copy.wait_stream", other.name))

        class Event:
            n = 0

            def __init__(self):
                Event.n += 1
                self.id = Event.n

            def record(self, stream):
                outer.log.append(("event.record", self.id, stream.name))

        class _Ctx:
            def __init__(self, s):
                self.s = s

            def __enter__(self):
                outer.log.append(("enter", self.s.name))

            def __exit__(self, *a):
                outer.log.append(("exit", self.s.name))

        class Current:
            name = "compute"

            def wait_event(self, ev):
                outer.log.append(("compute.wait_event", ev.id))

        self.Stream, self.Event = Stream, Event
        self._ctx, self._current = _Ctx, Current()

    def current_stream(self, device=None):
        return self._current

    def stream(self, s):
        return self._ctx(s)


def test_cuda_copier_protocol_with_fake_streams():
    from ditkit.offload import streamer as sm

    fake = FakeCuda()
    model = Decoder(n=3)
    st = LayerwiseStreamer(list(model.layers), "cpu", prefetch=1, pin=False)
    cop = sm._CudaCopier(torch.device("cpu"), cuda=fake, alloc_device="cpu")
    recorded = []
    cop.record_stream = lambda buf, stream: recorded.append((buf.data_ptr(), id(stream)))
    st.copier = cop
    st.trace = True
    for i in range(3):
        model.layers[i] = StreamedLayer(st, i)
    ref = Decoder(n=3)
    ids = torch.tensor([[1, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
    log = fake.log
    # every copy: copy stream waits for compute first, then copies inside the copy-stream context, then an event
    starts = [i for i, e in enumerate(log) if e == ("copy.wait_stream", "compute")]
    assert len(starts) == 3
    for i in starts:
        assert log[i + 1] == ("enter", "copy")
        assert log[i + 2][0] == "event.record" and log[i + 2][2] == "copy"
        assert log[i + 3] == ("exit", "copy")
    # compute waits on each layer's own event, in layer order, and never before that event was recorded
    waits = [e[1] for e in log if e[0] == "compute.wait_event"]
    assert waits == [1, 2, 3]
    for ev in waits:
        rec = log.index(next(e for e in log if e[0] == "event.record" and e[1] == ev))
        assert rec < log.index(("compute.wait_event", ev))
    # every device buffer is record_stream-ed on the compute stream before being dropped (one dtype pack x2)
    n_dtypes = len(st.packs[0].host)
    assert len(recorded) == 3 * n_dtypes
    assert st.stats.live_device_bytes == 0
