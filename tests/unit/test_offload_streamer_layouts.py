"""offload/streamer (issue 29 gap classes): a layer whose tensors are transposed or strided views, in every float
dtype, packs and streams with every value in place, and the layer's output is bit-equal to the same layer with
contiguous copies of its tensors (the streamer packs contiguously: with a transposed weight the GEMM then takes
its contiguous path, which may round differently from the unstreamed transposed layer by an ulp; that layout
change is the streamer's documented behaviour, not checked bit-equal against the transposed original).
Oracle: the original tensors (cloned before packing) and forwards of contiguous copies made here."""
from __future__ import annotations

import pytest
import torch

from ditkit.offload.streamer import LayerwiseStreamer, StreamedLayer, pack_layer

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


class Odd(torch.nn.Module):
    """A linear whose weight is a transposed view, a bias that is a strided view, a strided buffer."""

    def __init__(self, dtype, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(6, 6, generator=g) * 0.3).to(dtype)          # stored [in, out]: used as its transpose
        self.weight = torch.nn.Parameter(w.t())                        # [6, 6], stride (1, 6)
        wide = torch.randn(6, 2, generator=g).to(dtype)
        self.bias = torch.nn.Parameter(wide[:, 1])                     # stride (2,), offset 1
        big = torch.randn(6, 3, generator=g).to(dtype)
        self.register_buffer("gain", big[:, ::3].squeeze(1) + 1)      # a copy: contiguous; plus a strided one
        self.register_buffer("mix", big.t()[1])                        # stride (3,), offset 1

    def forward(self, x):
        return torch.nn.functional.linear(x * self.gain * self.mix, self.weight, self.bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_layer_keeps_every_value_of_non_contiguous_tensors(dtype):
    layer = Odd(dtype)
    assert not layer.weight.is_contiguous() and not layer.mix.is_contiguous()
    before = {n: t.detach().clone() for n, t in list(layer.named_parameters()) + list(layer.named_buffers())}
    pack = pack_layer(0, layer, pin=False)
    after = dict(list(layer.named_parameters()) + list(layer.named_buffers()))
    for n, t in before.items():
        assert after[n].dtype == dtype and after[n].shape == t.shape
        assert torch.equal(after[n], t), n
    assert pack.nbytes == sum(t.numel() * t.element_size() for t in before.values())


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_non_contiguous_layers_are_bit_equal(dtype, prefetch):
    layers = [Odd(dtype, seed=s) for s in range(3)]
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(9)).to(dtype).t()   # a non-contiguous input
    want = x
    for s in range(3):
        ref = Odd(dtype, seed=s)
        with torch.no_grad():
            for name, t in list(ref.named_parameters()) + list(ref.named_buffers()):
                setattr(ref, name, torch.nn.Parameter(t.contiguous().clone()) if isinstance(t, torch.nn.Parameter)
                        else t.contiguous().clone())
        assert ref.weight.is_contiguous()
        want = ref(want)
    st = LayerwiseStreamer(layers, "cpu", prefetch=prefetch, pin=False)
    wrapped = [StreamedLayer(st, i) for i in range(len(layers))]
    got = x
    assert not got.is_contiguous()
    for w in wrapped:
        got = w(got)
    assert got.dtype == dtype and torch.equal(got, want)
