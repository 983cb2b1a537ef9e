"""cache/adaln.py, exactly: the schedule refusal texts, the key's parts (sha1 of the bytes written here), the
memo's re-keying rules, the stats and their summary text, the miss bookkeeping, build's timing and signature, the
parking protocol's edges and the H3 size formula.

Oracles written here: struct / hashlib over the bytes, a hand-made fake clock, sizes by arithmetic."""
from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from ditkit.cache import adaln
from ditkit.cache.adaln import (H3_REAL, AdalnScheduleCache, AdalnStats, CachedAdalnProj, ScheduleError,
                                check_schedule, fp32_bits, h3_adaln_sizes, tensor_key)
from ditkit.errors import DitKitError

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


class Proj(torch.nn.Module):
    def __init__(self, t_dim=4, hidden=2, expand=3, modalities=2, apply_silu=True, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.expand, self.modalities, self.hidden, self.apply_silu = expand, modalities, hidden, apply_silu
        self.linear = torch.nn.Linear(t_dim, expand * hidden * modalities)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(self.linear.weight.shape, generator=g))
            self.linear.bias.copy_(torch.randn(self.linear.bias.shape, generator=g))


def _emb(rows=2, t_dim=4, seed=1):
    return torch.randn(rows, t_dim, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ schedule, bits, key

def test_check_schedule_texts_and_result():
    with pytest.raises(ScheduleError) as e:
        check_schedule(torch.tensor([]))
    assert str(e.value) == "AdaLN cache: the sigma schedule is empty"
    assert issubclass(ScheduleError, DitKitError)
    for vals, idx, shown in [([1.0, float("nan"), float("inf")], 1, "nan"), ([float("inf"), 1.0, float("nan")], 0, "inf"),
                             ([0.5, 0.25, -float("inf")], 2, "-inf")]:
        with pytest.raises(ScheduleError) as e:
            check_schedule(torch.tensor(vals))
        assert str(e.value) == (f"AdaLN cache: sigma schedule value #{idx} is {shown}; every sigma must be finite. Fix "
                                "the scheduler/sigmas input; no tables were built and the model is unchanged.")
    s = check_schedule(torch.tensor([[1.0, 0.5], [0.25, 0.0]], dtype=torch.float64).t())
    assert s.dtype == torch.float32 and s.device.type == "cpu" and s.tolist() == [1.0, 0.25, 0.5, 0.0]
    with pytest.raises(ScheduleError, match="#3"):
        check_schedule(torch.tensor([[1.0, 0.5], [0.25, float("nan")]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp32_bits_both_paths(dtype):
    vals = [1.0, -2.5, 0.0, -0.0, 0.1, 65504.0]
    want = tuple(struct.unpack("<i", struct.pack("<f", v))[0] for v in vals)
    assert want[:4] == (0x3F800000, -1071644672, 0, -(2 ** 31))
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    want_t = tuple(struct.unpack("<i", struct.pack("<f", float(v)))[0] for v in t.tolist())
    assert fp32_bits(t) == want_t
    grid = torch.stack([t, t], dim=1)[:, 0]            # a strided view
    assert not grid.is_contiguous() and fp32_bits(grid) == want_t
    assert fp32_bits(t.reshape(2, 3)) == want_t
    assert fp32_bits(vals) == want and fp32_bits(iter(vals)) == want and fp32_bits([]) == ()
    assert all(type(b) is int for b in fp32_bits(t))


@pytest.mark.parametrize("dtype", DTYPES + [torch.int32, torch.bool])
def test_tensor_key_parts(dtype):
    base = torch.tensor([[1.0, 0.0, -2.0], [3.0, 1.0, 0.5]])
    t = (base > 0.5) if dtype is torch.bool else base.to(dtype)
    strided = t.t()                                      # [3, 2], not contiguous
    k = tensor_key(strided)
    host = strided.contiguous()
    raw = host.to(torch.uint8) if dtype is torch.bool else host.view(torch.uint8)
    assert k == (str(dtype), (3, 2), "cpu", hashlib.sha1(raw.numpy().tobytes()).hexdigest())
    assert k[0] == str(dtype) and type(k[1]) is tuple
    assert tensor_key(strided.contiguous()) == k
    if dtype is torch.bool:
        # the bool path hashes 0 / 1 bytes
        assert k[3] == hashlib.sha1(bytes([1, 1, 0, 1, 0, 0])).hexdigest()


def test_tensor_key_of_a_tensor_that_needs_grad():
    t = torch.ones(2, 2, requires_grad=True)
    assert tensor_key(t)[3] == hashlib.sha1(struct.pack("<4f", 1, 1, 1, 1)).hexdigest()


# ------------------------------------------------------------------------------------------------ stats

def test_stats_defaults_summary_and_dict():
    s = AdalnStats()
    assert (s.hits, s.misses, s.rebuilds, s.hot_runs, s.entries, s.table_bytes, s.weight_bytes_parked,
            s.weight_bytes_total, s.park_mode, s.build_seconds, s.miss_keys, s.last_signature) == \
        (0, 0, 0, 0, 0, 0, 0, 0, "device", 0.0, [], "")
    assert AdalnStats().miss_keys is not AdalnStats().miss_keys
    s = AdalnStats(hits=1, misses=2, rebuilds=3, hot_runs=4, entries=5, table_bytes=2 ** 19, weight_bytes_parked=2 ** 20,
                   weight_bytes_total=3 * 2 ** 21, park_mode="host")
    assert s.summary() == ("AdaLN tables: 1 hits, 2 misses, 3 rebuilds, 4 hot runs; 5 entries = 0.500 MiB tables; "
                           "weights parked off-device 1.000 of 6.000 MiB (host)")
    s.miss_keys = [f"k{i}" for i in range(20)]
    d = s.as_dict()
    assert d["miss_keys"] == [f"k{i}" for i in range(16)]
    assert list(d) == ["hits", "misses", "rebuilds", "hot_runs", "entries", "table_bytes", "weight_bytes_parked",
                       "weight_bytes_total", "park_mode", "build_seconds", "miss_keys", "last_signature"]


# ------------------------------------------------------------------------------------------------ the module

@pytest.mark.parametrize("apply_silu", [True, False])
def test_cached_proj_copies_the_contract_and_computes(apply_silu):
    o = Proj(apply_silu=apply_silu)
    cache = AdalnScheduleCache()
    m = cache.wrap(o, "blocks.0")
    m2 = cache.wrap(Proj(seed=2), "final")
    assert (m.slot, m.block_name, m2.slot, m2.block_name) == (0, "blocks.0", 1, "final")
    assert cache.modules == [m, m2] and isinstance(m, CachedAdalnProj)
    assert m.linear is o.linear and (m.expand, m.modalities, m.hidden, m.apply_silu) == (3, 2, 2, apply_silu)
    assert m._cache is cache and "_cache" not in dict(m.named_modules())
    e = _emb()
    inp = torch.nn.functional.silu(e) if apply_silu else e
    want = inp @ o.linear.weight.t() + o.linear.bias
    assert torch.equal(m.compute(e), o.linear(inp))
    assert torch.allclose(m.compute(e), want, atol=1e-6)
    parts = m(e)
    assert len(parts) == 3 and all(p.shape == (2 * 2, 2) for p in parts)
    flat = want.reshape(4, 6)
    for j, p in enumerate(parts):
        assert torch.allclose(p, flat[:, 2 * j:2 * j + 2], atol=1e-6)


# ------------------------------------------------------------------------------------------------ keys, memo

def test_key_of_memo_rules(monkeypatch):
    calls = []
    real = adaln.tensor_key
    monkeypatch.setattr(adaln, "tensor_key", lambda t: calls.append(1) or real(t))
    cache = AdalnScheduleCache()
    e = _emb()
    k = cache.key_of(e)
    assert k == real(e) and len(calls) == 1
    assert cache.key_of(e) is k and len(calls) == 1               # same object, same version, same storage
    assert cache._memo == (e, e._version, e.data_ptr(), k)
    same = e.clone()                                               # equal bytes, another object: keyed again
    assert cache.key_of(same) == k and len(calls) == 2
    same.mul_(2)                                                   # an in-place write: the version moved
    assert cache.key_of(same) == real(same) != k and len(calls) == 3
    assert cache.key_of(same) == real(same) and len(calls) == 3
    v = same._version
    same.data = _emb(seed=5)                                       # new storage, version unchanged: keyed again
    assert same._version == v
    assert cache.key_of(same) == real(_emb(seed=5)) and len(calls) == 4
    with torch.inference_mode():
        inf = _emb(seed=3)
        ki = cache.key_of(inf)
        assert cache._memo[1] is None and cache.key_of(inf) is ki


def test_build_duplicates_timing_signature_and_memo_reset():
    cache = AdalnScheduleCache()
    o = Proj()
    m = cache.wrap(o, "b0")
    e1, e2 = _emb(seed=1), _emb(seed=2)
    cache.key_of(e1)
    ticks = iter([10.0, 12.5])
    assert cache.build(("sig", 1), [e1, e1.clone(), e2], clock=lambda: next(ticks)) is True
    assert cache._memo is None
    assert cache.stats.build_seconds == 2.5
    assert cache.stats.last_signature == hashlib.sha1(repr(("sig", 1)).encode()).hexdigest()[:12]
    assert cache.stats.entries == 2 and len(cache.entries) == 2 and cache.stats.rebuilds == 1
    assert cache.stats.table_bytes == 2 * (2 * 12 * 4)
    assert cache.signature == ("sig", 1)
    assert torch.equal(cache.entries[tensor_key(e2)][0], m.compute(e2))
    # hot: the clock is not read, nothing changes but the count
    assert cache.build(("sig", 1), [e2], clock=lambda: 1 / 0) is False
    assert cache.stats.hot_runs == 1 and cache.stats.build_seconds == 2.5 and cache.stats.rebuilds == 1
    # the default clock: a real, non-negative duration
    assert cache.build(("other",), [e1]) is True and cache.stats.build_seconds >= 0.0
    assert cache.stats.entries == 1 and cache.stats.table_bytes == 2 * 12 * 4


def test_build_does_not_record_autograd():
    cache = AdalnScheduleCache()
    cache.wrap(Proj(), "b0")
    cache.build(("s",), [_emb()])
    (row,) = cache.entries.values()
    assert row[0].requires_grad is False and row[0].grad_fn is None


def test_invalidate_resets_everything():
    cache = AdalnScheduleCache()
    cache.wrap(Proj(), "b0")
    e = _emb()
    cache.build(("s",), [e])
    cache.key_of(e)
    cache.invalidate()
    assert (cache.entries, cache.signature, cache._memo, cache.stats.entries, cache.stats.table_bytes) == \
        ({}, None, None, 0, 0)
    assert cache.build(("s",), [e]) is True         # the same signature builds again after invalidate


# ------------------------------------------------------------------------------------------------ misses

def test_miss_keys_text_limit_and_table_accounting():
    cache = AdalnScheduleCache()
    ms = [cache.wrap(Proj(seed=i), f"blocks.{i}") for i in range(2)]
    cache.build(("s",), [_emb(seed=0)])
    before = cache.stats.table_bytes
    e = _emb(rows=3, seed=7)
    k = tensor_key(e)
    out0 = ms[0](e)
    assert cache.stats.miss_keys == [f"blocks.0:{k[3][:10]}:M=3"]
    assert cache.stats.table_bytes == before + 3 * 12 * 4
    assert cache.stats.entries == 1                     # the new row is not complete yet
    assert cache.entries[k][1] is None and torch.equal(cache.entries[k][0].view(6, 6)[:, :2], out0[0])
    ms[1](e)
    assert cache.stats.entries == 2 and cache.stats.table_bytes == before + 2 * 3 * 12 * 4
    assert cache.stats.misses == 2 and cache.stats.hits == 0
    ms[1](e)
    assert cache.stats.hits == 1 and cache.stats.table_bytes == before + 2 * 3 * 12 * 4
    for i in range(70):
        ms[0](_emb(rows=1, seed=100 + i))
    assert len(cache.stats.miss_keys) == 64 and cache.stats.misses == 72
    assert cache.stats.miss_keys[63] == f"blocks.0:{tensor_key(_emb(rows=1, seed=161))[3][:10]}:M=1"


def test_miss_key_of_a_one_dimensional_input():
    cache = AdalnScheduleCache()
    m = cache.wrap(Proj(t_dim=1), "b")
    v = torch.tensor([0.5])
    m.compute(v)
    cache.project(m, v)
    assert cache.stats.miss_keys[-1].endswith(":M=1")


def test_a_miss_during_a_rebuild_is_not_stored_in_the_new_tables():
    cache = AdalnScheduleCache()
    m = cache.wrap(Proj(), "b")
    cache.build(("a",), [_emb(seed=0)])
    e = _emb(seed=9)
    real_compute = m.compute

    def compute_then_rebuild(t):
        out = real_compute(t)
        cache.entries = {}                               # another thread installed new tables meanwhile
        return out

    m.compute = compute_then_rebuild
    cache.project(m, e)
    assert cache.entries == {} and cache.stats.misses == 1


# ------------------------------------------------------------------------------------------------ parking

def _fake_acc(cache):
    cache.on_accelerator = lambda p: True


def test_on_accelerator_default():
    cache = AdalnScheduleCache()
    assert cache.on_accelerator(torch.zeros(1)) is False
    assert cache.on_accelerator(torch.zeros(1, device="meta")) is False
    assert cache.park_enabled is True and cache.park_events == 0 and cache.unpark_events == 0
    assert cache.stats == AdalnStats() and cache.signature is None and cache.entries == {}


def test_park_counts_bytes_and_skips_subclasses_and_missing_bias():
    cache = AdalnScheduleCache()
    _fake_acc(cache)
    o = Proj()
    o.linear.bias = None
    cache.wrap(o, "b")
    w = o.linear.weight
    assert cache.park() == w.numel() * 4 and cache.stats.weight_bytes_total == w.numel() * 4
    assert cache.park_events == 1 and cache._is_parked(w)
    assert cache._parked[id(w)] == (w.device, w.data.data_ptr())
    assert cache.park() == w.numel() * 4 and cache.park_events == 1     # already parked: counted, not moved

    class Sub(torch.Tensor):
        pass

    c2 = AdalnScheduleCache()
    _fake_acc(c2)
    o2 = Proj()
    c2.wrap(o2, "b")
    o2.linear.weight = torch.nn.Parameter(o2.linear.weight.data.clone().as_subclass(Sub))
    assert type(o2.linear.weight.data) is Sub
    n_b = o2.linear.bias.numel() * 4
    assert c2.park() == n_b and c2.park_events == 1
    assert c2.stats.weight_bytes_parked == n_b
    assert c2.stats.weight_bytes_total == n_b + o2.linear.weight.numel() * 4


def test_unpark_some_and_all():
    cache = AdalnScheduleCache()
    _fake_acc(cache)
    o = Proj()
    cache.wrap(o, "b")
    cache.park()
    w, b = o.linear.weight, o.linear.bias
    cache.unpark([w])
    assert cache.unpark_events == 1 and not cache._is_parked(w) and cache._is_parked(b)
    assert cache.stats.weight_bytes_parked == (w.numel() + b.numel()) * 4      # a partial unpark keeps the figure
    cache.unpark([w])                                                         # not parked: nothing moves
    assert cache.unpark_events == 1
    cache.unpark()
    assert cache.unpark_events == 2 and cache._parked == {} and cache.stats.weight_bytes_parked == 0


def test_a_replaced_parameter_is_not_taken_for_parked():
    cache = AdalnScheduleCache()
    _fake_acc(cache)
    o = Proj()
    cache.wrap(o, "b")
    cache.park()
    w = o.linear.weight
    w.data = w.data.clone()
    assert not cache._is_parked(w)
    cache.unpark([w])                                    # a stale record is dropped without a move
    assert id(w) not in cache._parked and cache.unpark_events == 0
    assert not cache._is_parked(torch.nn.Parameter(torch.zeros(1)))


# ------------------------------------------------------------------------------------------------ sizes

def test_h3_sizes_formula_and_zero_rows():
    assert H3_REAL == {"blocks": 50, "block_out": 96768, "final_out": 10752, "t_dim": 2688, "bytes": 2}
    cfg = {"blocks": 3, "block_out": 10, "final_out": 4, "t_dim": 5, "bytes": 2}
    w = (3 * (10 * 5 + 10) + (4 * 5 + 4)) * 2
    per_row = (3 * 10 + 4) * 2
    assert h3_adaln_sizes(7, cfg) == {"weight_bytes": w, "table_bytes_per_row": per_row, "table_bytes": 7 * per_row,
                                      "rows": 7, "ratio_removed_over_added": w / (7 * per_row)}
    assert h3_adaln_sizes(0, cfg)["ratio_removed_over_added"] == w
    assert h3_adaln_sizes(0, cfg)["table_bytes"] == 0
    assert h3_adaln_sizes(98)["ratio_removed_over_added"] == 26_078_739_456 / (98 * 9_698_304)


# ------------------------------------------------------------------------------------------------ survivors (round 2)

def test_schedule_and_keys_are_read_on_the_host():
    """check_schedule returns a host copy and tensor_key hashes host bytes: a tensor without data (meta) is refused
    where it is copied to the host, before any device-side arithmetic."""
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        check_schedule(torch.zeros(3, device="meta"))
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        tensor_key(torch.zeros(2, 4, device="meta"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_parking_keeps_each_parameters_dtype_and_values(dtype):
    cache = AdalnScheduleCache()
    cache.on_accelerator = lambda p: True
    o = Proj()
    o.linear.to(dtype)
    cache.wrap(o, "b")
    before = [p.detach().clone() for p in o.linear.parameters()]
    cache.park()
    for p, b in zip(o.linear.parameters(), before):
        assert p.dtype == dtype and torch.equal(p.detach(), b)
    cache.unpark()
    for p, b in zip(o.linear.parameters(), before):
        assert p.dtype == dtype and torch.equal(p.detach(), b)


def test_hot_runs_are_counted():
    cache = AdalnScheduleCache()
    cache.wrap(Proj(), "b")
    e = _emb()
    cache.build(("s",), [e])
    cache.build(("s",), [e])
    cache.build(("s",), [e])
    assert cache.stats.hot_runs == 2 and cache.stats.rebuilds == 1


def test_a_stale_park_record_is_dropped_even_when_nothing_is_parked_again():
    cache = AdalnScheduleCache()
    cache.on_accelerator = lambda p: True
    o = Proj()
    cache.wrap(o, "b")
    cache.park()
    w = o.linear.weight
    w.data = w.data.clone()                  # the host moved it back (a reload)
    cache.park_enabled = False
    cache.park()
    assert id(w) not in cache._parked and id(o.linear.bias) in cache._parked


def test_miss_key_of_a_zero_dimensional_input_names_no_rows():
    cache = AdalnScheduleCache()
    m = cache.wrap(Proj(t_dim=1), "b")
    s = torch.tensor(3, dtype=torch.uint8)   # a 0-d tensor tensor_key can key (1-byte elements)
    with pytest.raises(RuntimeError):
        cache.project(m, s)                  # the projection refuses it, after the miss is recorded
    assert cache.stats.miss_keys == [f"b:{tensor_key(s)[3][:10]}:M=0"]
