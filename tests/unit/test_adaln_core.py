"""AdaLN schedule tables (plain torch): exact keys, hits/misses, rebuilds, bit-identity, sizes, bad schedules."""
from __future__ import annotations

import math

import pytest
import torch

from ditkit.errors import DitKitError
from ditkit.cache.adaln import (AdalnScheduleCache, ScheduleError, check_schedule, fp32_bits, h3_adaln_sizes,
                                  tensor_key)


class Proj(torch.nn.Module):
    """Same contract as ComfyUI's H3 AdalnProj (linear over silu(t_emb), view, chunk)."""

    def __init__(self, t_dim, hidden, expand, modalities, apply_silu=True, seed=0, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.expand, self.modalities, self.hidden, self.apply_silu = expand, modalities, hidden, apply_silu
        self.linear = torch.nn.Linear(t_dim, expand * hidden * modalities).to(dtype)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(self.linear.weight.shape, generator=g))
            self.linear.bias.copy_(torch.randn(self.linear.bias.shape, generator=g))

    def forward(self, t_emb):
        x = self.linear(torch.nn.functional.silu(t_emb) if self.apply_silu else t_emb)
        x = x.view(x.shape[0] * self.modalities, self.expand * self.hidden)
        return x.chunk(self.expand, dim=-1)


def t_embed(ts, t_dim=8, dtype=torch.float32):
    ts = torch.tensor(ts, dtype=torch.float32)
    half = t_dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    a = ts[:, None] * freqs[None]
    return torch.cat([torch.cos(a), torch.sin(a)], -1).to(dtype)


def _setup(dtype=torch.float32, apply_silu=True):
    origs = [Proj(8, 4, 6, 3, apply_silu, seed=i, dtype=dtype) for i in range(3)] + \
            [Proj(8, 4, 2, 1, apply_silu, seed=9, dtype=dtype)]
    cache = AdalnScheduleCache()
    wrapped = [cache.wrap(o, f"m{i}") for i, o in enumerate(origs)]
    return origs, cache, wrapped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("apply_silu", [True, False])
def test_hits_are_bit_identical_to_uncached(dtype, apply_silu):
    origs, cache, wrapped = _setup(dtype, apply_silu)
    sched = [[0.1, 0.5], [0.3, 0.7], [0.9]]
    embs = [t_embed(s, dtype=dtype) for s in sched]
    assert cache.build(("s1",), embs) is True
    for e in embs:
        live = e.clone()  # a different tensor object with the same bytes (as the model rebuilds it per forward)
        for o, w in zip(origs, wrapped):
            ref = o(live)
            got = w(live)
            assert len(ref) == len(got)
            for a, b in zip(ref, got):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b)
    assert cache.stats.hits == 3 * 4 and cache.stats.misses == 0
    assert cache.stats.entries == 3 and cache.stats.rebuilds == 1
    # table bytes independently: per entry sum of M * out_features * itemsize over modules
    item = torch.empty((), dtype=dtype).element_size()
    expect = sum(len(s) * (3 * 6 * 4 * 3 + 2 * 4) * item for s in sched)
    assert cache.stats.table_bytes == expect


def test_one_ulp_difference_is_a_miss_and_still_exact():
    origs, cache, wrapped = _setup()
    e = t_embed([0.25, 0.5])
    cache.build(("s",), [e])
    e2 = e.clone()
    flat = e2.view(-1).view(torch.int32)
    flat[3] += 1  # one ulp
    for o, w in zip(origs, wrapped):
        for a, b in zip(o(e2), w(e2)):
            assert torch.equal(a, b)
    assert cache.stats.misses == 4 and cache.stats.hits == 0
    assert len(cache.stats.miss_keys) == 4
    # the miss result was kept: a second call hits
    for w in wrapped:
        w(e2)
    assert cache.stats.hits == 4


def test_signed_zero_and_row_count_are_distinct_keys():
    a = torch.tensor([[0.0, 1.0]])
    b = torch.tensor([[-0.0, 1.0]])
    assert tensor_key(a) != tensor_key(b)
    assert tensor_key(torch.zeros(1, 4)) != tensor_key(torch.zeros(2, 2))
    assert tensor_key(torch.zeros(2, dtype=torch.float16)) != tensor_key(torch.zeros(1, dtype=torch.float32))


def test_same_signature_is_hot_new_signature_rebuilds_and_drops_old_entries():
    origs, cache, wrapped = _setup()
    e1, e2 = t_embed([0.1, 0.2]), t_embed([0.3, 0.4])
    assert cache.build(("A",), [e1]) is True
    assert cache.build(("A",), [e2]) is False          # hot: nothing recomputed, e2 not added
    assert cache.stats.hot_runs == 1 and cache.stats.entries == 1
    assert cache.build(("B",), [e2]) is True
    assert cache.stats.rebuilds == 2 and cache.stats.entries == 1
    wrapped[0](e1)                                     # old schedule's entry is gone -> miss
    assert cache.stats.misses == 1
    wrapped[0](e2)
    assert cache.stats.hits == 1


def test_weights_changed_then_rebuilt_never_stale():
    origs, cache, wrapped = _setup()
    e = t_embed([0.4, 0.6])
    cache.build(("w0",), [e])
    with torch.no_grad():
        origs[0].linear.weight.add_(1.0)   # e.g. a LoRA patched in place by the host
    # a caller that rebuilds on an identity change sees the new weights
    cache.build(("w1",), [e])
    for a, b in zip(origs[0](e), wrapped[0](e)):
        assert torch.equal(a, b)


def test_invalidate_clears_tables():
    origs, cache, wrapped = _setup()
    e = t_embed([0.4])
    cache.build(("x",), [e])
    cache.invalidate()
    assert cache.entries == {} and cache.signature is None and cache.stats.table_bytes == 0
    wrapped[1](e)
    assert cache.stats.misses == 1


def test_cpu_weights_are_not_parked():
    origs, cache, wrapped = _setup()
    cache.build(("x",), [t_embed([0.5])])
    assert cache.stats.weight_bytes_parked == 0
    expect = sum(p.numel() * p.element_size() for o in origs for p in o.linear.parameters())
    assert cache.stats.weight_bytes_total == expect


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_bad_schedule_rejected(bad):
    with pytest.raises(ScheduleError, match="finite") as ei:
        check_schedule(torch.tensor([1.0, bad, 0.0]))
    assert isinstance(ei.value, DitKitError)
    assert "#1" in str(ei.value)
    with pytest.raises(ScheduleError, match="empty"):
        check_schedule(torch.tensor([]))


def test_fp32_bits_exact():
    assert fp32_bits([1.0]) == (0x3F800000,)
    assert fp32_bits(torch.tensor([-0.0])) == (-(2 ** 31),)
    assert fp32_bits(torch.tensor([0.5, 0.25])) == fp32_bits([0.5, 0.25])


def test_h3_real_sizes_from_shapes():
    s = h3_adaln_sizes(98)
    # 50 x [96768, 2688] + [96768] bias, final [10752, 2688] + [10752], bf16
    w = (50 * (96768 * 2688 + 96768) + 10752 * 2688 + 10752) * 2
    assert s["weight_bytes"] == w
    assert w == 26_078_739_456  # = 13,039,369,728 params (h3.md §2.1) x 2 B
    per_row = (50 * 96768 + 10752) * 2
    assert s["table_bytes_per_row"] == per_row == 9_698_304
    assert s["table_bytes"] == 98 * per_row


def test_inference_mode_tensors_are_keyed():
    origs, cache, wrapped = _setup()
    with torch.inference_mode():
        e = t_embed([0.2, 0.6])
        cache.build(("inf",), [e])
        live = e.clone()
        for o, w in zip(origs, wrapped):
            for a, b in zip(o(live), w(live)):
                assert torch.equal(a, b)
    assert cache.stats.hits == 4 and cache.stats.misses == 0


def test_in_place_write_to_t_emb_is_rekeyed():
    origs, cache, wrapped = _setup()
    e = t_embed([0.2, 0.6])
    cache.build(("v",), [e])
    live = e.clone()
    wrapped[0](live)
    live.add_(1.0)  # version counter moves -> new key -> miss, computed exactly
    for a, b in zip(origs[0](live), wrapped[0](live)):
        assert torch.equal(a, b)
    assert cache.stats.hits == 1 and cache.stats.misses == 1


def _fake_accelerator(cache):
    """Treat every weight as device-resident so the park/unpark bookkeeping runs on a CPU-only machine
    (the 'host copy' is then another CPU tensor; the protocol is what is checked)."""
    cache.on_accelerator = lambda p: True


def test_parking_bookkeeping_hits_miss_rebuild():
    origs, cache, wrapped = _setup()
    _fake_accelerator(cache)
    total = sum(p.numel() * p.element_size() for o in origs for p in o.linear.parameters())
    n_params = sum(1 for o in origs for _ in o.linear.parameters())
    e1, e2 = t_embed([0.1, 0.3]), t_embed([0.7])
    ref = {id(e): [tuple(t.clone() for t in o(e)) for o in origs] for e in (e1, e2)}
    cache.build(("A",), [e1])
    assert cache.stats.weight_bytes_parked == total == cache.stats.weight_bytes_total
    assert cache.park_events == n_params and cache.unpark_events == 0
    # hits never touch the weights
    for w in wrapped:
        w(e1.clone())
    assert cache.unpark_events == 0 and cache.park_events == n_params
    # a miss brings back (and re-parks) only the projection it runs, and is exact
    got = wrapped[2](e2)
    for a, b in zip(ref[id(e2)][2], got):
        assert torch.equal(a, b)
    per_mod = sum(1 for _ in origs[2].linear.parameters())
    assert cache.unpark_events == per_mod and cache.park_events == n_params + per_mod
    assert cache.stats.weight_bytes_parked == total
    # hot build: nothing moves; rebuild: everything comes back once, then is parked again
    cache.build(("A",), [e1])
    assert cache.unpark_events == per_mod
    cache.build(("B",), [e2])
    assert cache.unpark_events == per_mod + n_params and cache.park_events == 2 * n_params + per_mod
    for o, w in zip(origs, wrapped):
        for a, b in zip(ref[id(e2)][origs.index(o)], w(e2.clone())):
            assert torch.equal(a, b)
    # host reload: if the framework replaces a parked tensor (moves it back), the next park catches it
    p0 = origs[0].linear.weight
    before = p0.detach().clone()
    p0.data = p0.data.clone()
    assert cache.park() == total and cache.park_events == 2 * n_params + per_mod + 1
    # only the replaced tensor was parked again, and with its values intact (data_ptr comparisons are
    # allocator-dependent: a freed block can come back at the same address, so they are not used here)
    assert torch.equal(origs[0].linear.weight.detach(), before)


def test_parking_disabled_moves_nothing():
    origs, cache, wrapped = _setup()
    _fake_accelerator(cache)
    cache.park_enabled = False
    cache.build(("A",), [t_embed([0.5])])
    assert cache.park_events == 0 and cache.stats.weight_bytes_parked == 0
