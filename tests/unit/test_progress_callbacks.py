"""Progress callbacks of the core (no ComfyUI): ``done`` strictly increases, reaches ``total`` exactly once at the
end, ``total`` never changes and equals the work counted independently (decoder calls x batch, tensors in the
header, layers); results are bit-identical with and without a callback."""
from __future__ import annotations


import pytest
import torch

from ditkit.loaders.read_progress import load_with_progress
from ditkit.loaders.safetensors_io import load_with_metadata, read_header, save_file
from ditkit.offload.streamer import LayerwiseStreamer, StreamedLayer
from ditkit.bridge.vae import direct_decode_t1, repeat_decode_t1, tiled_decode_frame, unwhiten

from _fake_h3 import FakeH3 as _FakeH3  # noqa: E402  (tests/unit on sys.path)


def check_calls(calls, total):
    assert calls, "progress was never called"
    dones = [d for d, _ in calls]
    assert all(t == total for _, t in calls), calls
    assert all(b > a for a, b in zip(dones, dones[1:])), dones
    assert dones[-1] == total and all(0 < d <= total for d in dones)


class FakeH3(_FakeH3):
    """The shared fake H3 VAE (tests/unit/_fake_h3.py), counting its decoder calls."""

    def __init__(self, c=24, seed=0):
        super().__init__(c, seed)
        self.calls = 0

    def _decode_pixels(self, z):
        self.calls += 1
        return super()._decode_pixels(z)


@pytest.mark.parametrize("hw", [(3, 3), (6, 5), (11, 7)])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("path", ["repeat", "direct"])
def test_t1_decode_progress_counts_tiles_times_batch(hw, batch, path):
    z = torch.randn(batch, 24, 1, *hw, generator=torch.Generator().manual_seed(hw[0] + batch))
    ref_model, model = FakeH3(), FakeH3()
    run = (lambda m, **kw: repeat_decode_t1(m, z, **kw)) if path == "repeat" else \
        (lambda m, **kw: direct_decode_t1(m, z, 2, **kw))
    ref, _ = run(ref_model)
    calls = []
    out, rep = run(model, progress=lambda d, t: calls.append((d, t)))
    assert torch.equal(out, ref)                              # the callback changes nothing
    check_calls(calls, model.calls * batch)                   # oracle: decoder calls counted by the fake
    assert len(calls) == model.calls == rep.tiles
    assert [d for d, _ in calls] == [batch * (k + 1) for k in range(model.calls)]


def test_untiled_decode_progress():
    m = FakeH3()
    m.tiling = False
    z = unwhiten(m, torch.randn(2, 24, 1, 6, 6))
    calls = []
    out = tiled_decode_frame(m, z, 1, progress=lambda d, t: calls.append((d, t)))
    assert torch.equal(out, m._decode_pixels(z)[:, :, 1:2])
    check_calls(calls, 2)
    assert len(calls) == 1


def test_load_with_progress_matches_safe_reader(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(i + 1, 3, generator=g).to(dt)
               for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16] * 3)}
    tensors["empty"] = torch.empty(0, 4)
    p = tmp_path / "x.safetensors"
    save_file(tensors, p, metadata={"k": "v"})
    calls = []
    sd, meta = load_with_progress(p, lambda d, t: calls.append((d, t)))
    ref, ref_meta = load_with_metadata(p)
    assert list(sd) == list(ref) and meta == ref_meta == {"k": "v"}
    assert all(torch.equal(sd[k], ref[k]) and sd[k].dtype == ref[k].dtype for k in ref)
    check_calls(calls, len(read_header(p).tensors))
    assert len(calls) == len(tensors)
    assert load_with_progress(p)[0].keys() == ref.keys()      # no callback: same result


class Block(torch.nn.Module):
    def __init__(self, d, g):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.bf = torch.nn.Linear(d, d).to(torch.bfloat16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.3)

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) + self.bf(x.to(torch.bfloat16)).float()


def _layers(n=6, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.ModuleList([Block(d, g) for _ in range(n)])


def _run(layers, x):
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("n", [1, 6])
def test_streamer_pack_and_pass_progress(n):
    ref_layers, layers = _layers(n), _layers(n)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    ref = _run(ref_layers, x)
    pack_calls, pass_calls = [], []
    st = LayerwiseStreamer(list(layers), "cpu", prefetch=1, pin=False,
                           progress=lambda d, t: pack_calls.append((d, t)))
    check_calls(pack_calls, n)
    assert len(st.packs) == n
    st.on_layer_done = lambda d, t: pass_calls.append((d, t))
    wrapped = torch.nn.ModuleList([StreamedLayer(st, i) for i in range(n)])
    for _ in range(2):
        pass_calls.clear()
        assert torch.equal(_run(wrapped, x), ref)
        check_calls(pass_calls, n)


def test_streamer_interrupt_from_layer_callback_drops_device_copies():
    layers = _layers(4)
    st = LayerwiseStreamer(list(layers), "cpu", prefetch=2, pin=False)

    class Stop(Exception):
        pass

    def cb(done, total):
        if done == 2:
            raise Stop

    st.on_layer_done = cb
    wrapped = torch.nn.ModuleList([StreamedLayer(st, i) for i in range(4)])
    with pytest.raises(Stop):
        _run(wrapped, torch.randn(2, 8))
    assert not st._resident and not st._inflight and st.stats.live_device_bytes == 0
    st.on_layer_done = None
    assert torch.equal(_run(wrapped, torch.ones(2, 8)), _run(_layers(4), torch.ones(2, 8)))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_load_with_progress_puts_every_tensor_on_the_device_asked(tmp_path, device):
    # The device argument reaches every tensor read (dropped, the reader's own default "cpu" would be used).
    p = tmp_path / "d.safetensors"
    save_file({"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.float16)}, p)
    calls = []
    sd, meta = load_with_progress(p, lambda d, t: calls.append((d, t)), device=device)
    assert [t.device.type for t in sd.values()] == [device, device]
    assert [tuple(t.shape) for t in sd.values()] == [(2, 3), (4,)] and sd["b"].dtype == torch.float16
    assert calls == [(1, 2), (2, 2)] and meta == {}
