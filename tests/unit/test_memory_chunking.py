"""memory/chunking.py: the chunk plan's exact boundaries, and a SwiGLU feed-forward (written here from its
definition: fc2(silu(gate) * value), fc1 = [gate; value]) on chunks equal to the whole call with ``torch.equal``:
bf16 / fp16 at any thread count, fp32 / fp64 single-threaded (MKL's row blocking; docs/memory.md)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditkit.errors import DitKitError
from ditkit.memory.chunking import ROW_ALIGN, ChunkSizeError, apply_rows, auto_chunk, check_chunk, plan_chunks


def swiglu(w1, w2):
    def f(x):
        g, v = F.linear(x, w1).chunk(2, dim=-1)
        return F.linear(F.silu(g) * v, w2)
    return f


def test_plan_boundaries():
    assert plan_chunks(0, 16) == [(0, 0)]
    assert plan_chunks(16, 16) == [(0, 16)]
    assert plan_chunks(17, 16) == [(0, 17)]            # 1-row tail folded
    assert plan_chunks(31, 16) == [(0, 31)]            # 15-row tail folded
    assert plan_chunks(32, 16) == [(0, 16), (16, 32)]  # 16-row tail kept
    assert plan_chunks(100, 40) == [(0, 32), (32, 64), (64, 100)]   # 40 -> 32; tail 4 folded
    assert plan_chunks(100, 15) == [(a, a + 16) for a in range(0, 80, 16)] + [(80, 100)]   # < 16 -> 16
    assert plan_chunks(100, 1 << 20) == [(0, 100)]
    for rows in range(0, 200, 7):
        for c in (1, 16, 17, 33, 64):
            spans = plan_chunks(rows, c)
            assert spans[0][0] == 0 and spans[-1][1] == rows
            assert all(a == pb for (a, _), (_, pb) in zip(spans[1:], spans[:-1]))
            if len(spans) > 1:
                assert all(b - a >= ROW_ALIGN for a, b in spans)


@pytest.mark.parametrize("bad", [0, -1, -16, True, False, 1.0, "16", None, float("nan")])
def test_bad_chunk_sizes_are_named_errors(bad):
    with pytest.raises(ChunkSizeError, match="chunk_tokens"):
        check_chunk(bad)
    with pytest.raises(DitKitError):
        plan_chunks(10, bad)


def test_bad_rows_and_shapes():
    with pytest.raises(ChunkSizeError):
        plan_chunks(-1, 16)
    with pytest.raises(ChunkSizeError):
        apply_rows(lambda t: t, torch.zeros(5), 16)
    with pytest.raises(ChunkSizeError):
        auto_chunk(10, 0, 100)


def test_auto_chunk():
    assert auto_chunk(1000, 10, 10 * 64) == 64
    assert auto_chunk(1000, 10, 10 * 64 - 1) == 48
    assert auto_chunk(1000, 10, 10**9) == 1008           # whole (rounded up): one span
    assert auto_chunk(1000, 10, 0) == ROW_ALIGN
    assert auto_chunk(1000, 10, -5) == ROW_ALIGN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(300, 64), (2, 257, 64)])
@pytest.mark.parametrize("chunk", [16, 40, 100, 299])
def test_swiglu_chunks_are_bit_identical(dtype, shape, chunk):
    threads = torch.get_num_threads()
    if dtype in (torch.float32, torch.float64):
        torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(*shape, generator=g).to(dtype)
        w1 = (torch.randn(256, 64, generator=g) * 0.1).to(dtype)
        w2 = (torch.randn(64, 128, generator=g) * 0.1).to(dtype)
        f = swiglu(w1, w2)
        out = apply_rows(f, x, chunk)
        assert out.dtype == dtype and out.shape == shape[:-1] + (64,)
        if dtype == torch.float64 and len(shape) == 3:
            # batched fp64: MKL blocks the strided chunk differently (measured max |diff| ~1e-16 relative)
            ref = f(x)
            assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-14
        else:
            assert torch.equal(out, f(x))
    finally:
        torch.set_num_threads(threads)


def test_non_contiguous_input():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(64, 300, generator=g).to(torch.bfloat16)
    x = base.t()                    # [300, 64], strided
    w1 = (torch.randn(256, 64, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(64, 128, generator=g) * 0.1).to(torch.bfloat16)
    f = swiglu(w1, w2)
    assert not x.is_contiguous()
    assert torch.equal(apply_rows(f, x, 32), f(x))


def test_chunks_really_split():
    seen = []

    def f(t):
        seen.append(t.shape[0])
        return t * 2

    x = torch.arange(100.0).reshape(50, 2)
    assert torch.equal(apply_rows(f, x, 16), x * 2)
    assert seen == [16, 16, 18]
