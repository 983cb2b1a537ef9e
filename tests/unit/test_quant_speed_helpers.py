"""The helpers that made quantize-on-load fast (issue #34), each called directly.

Oracles are written here: the e2m1 round-to-nearest-even onto its eight magnitudes (ties to the even code) over
float64 distances; ``torch.amax(|x|)`` per block; torch's own fp8 -> float32 conversion; the strided nibble pack
``(c[:, 0::2] << 4) | c[:, 1::2]``; the kernel's documented contract for the reused buffers."""
from __future__ import annotations

import mmap
import threading

import pytest
import torch
from safetensors import torch as st

from ditkit.kernels import quant as Q
from ditkit.loaders import host_memory as HM
from ditkit.loaders import quantize as QC
from ditkit.loaders import safetensors_io as sio
from ditkit.loaders.safetensors_io import save_file
from ditkit.tiny import ckpt_h3, ckpt_image

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e2m1_oracle(v: torch.Tensor) -> torch.Tensor:
    """Round |v| to the nearest of the eight e2m1 magnitudes, ties to the even code; saturate above 6; the sign bit
    is bit 3 (kept for values that round to zero)."""
    a = v.double().abs()
    d = (a.unsqueeze(-1) - GRID).abs()
    best = d.min(-1, keepdim=True).values
    tie = d == best
    idx = torch.arange(8)
    # among the (at most two adjacent) nearest codes, the even one; a single nearest code is itself
    even = torch.where(tie & (idx % 2 == 0), idx, torch.full_like(idx, 99)).min(-1).values
    code = torch.where(tie.sum(-1) == 1, tie.to(torch.int64).argmax(-1), even)
    code = torch.where(a > 6.0, torch.full_like(code, 7), code)
    return (code | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)


def _class_points() -> torch.Tensor:
    """Four float32s of each of the 4096 bit classes (top 11 bits): its low end, low end + 1 ulp, middle, top."""
    hi = torch.arange(2048, dtype=torch.int64) << 21
    pts = torch.stack([hi, hi | 1, hi | 0x100000, hi | 0x1FFFFF], 1).reshape(-1)
    return torch.where(pts >= 1 << 31, pts - (1 << 32), pts).to(torch.int32).view(torch.float32)


def test_e2m1_bits_table_equals_rounding_on_every_class_end_and_inside():
    v = _class_points()
    nan = torch.isnan(v)
    got = Q._e2m1_codes_finite(v)
    assert torch.equal(got[~nan], _e2m1_oracle(v[~nan]))
    assert torch.equal(got[nan], Q.e2m1_codes(v[nan]))       # NaN: the code of its class, as documented
    assert Q._e2m1_bits_lut().shape == (4096,) and torch.equal(Q._e2m1_bits_lut(), Q._E2M1_BITS_LUT)


def test_e2m1_codes_equal_rounding_on_thresholds_and_neighbours():
    th = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 6.0])
    up, dn = torch.nextafter(th, torch.full_like(th, 9)), torch.nextafter(th, torch.full_like(th, -9))
    v = torch.cat([th, up, dn]).clamp(0, 6)
    v = torch.cat([v, -v])
    assert torch.equal(Q.e2m1_codes(v), _e2m1_oracle(v))
    assert torch.equal(Q._e2m1_codes_finite(v), _e2m1_oracle(v))


def test_unclamped_codes_equal_the_clamped_ones_beyond_six():
    """The finite nvfp4 path skips the clamp: e2m1 saturates and keeps the sign."""
    big = torch.tensor([6.0, 6.000001, 7.0, 1e3, 3.4e38, float("inf")])
    v = torch.cat([big, -big, torch.nextafter(torch.tensor([6.0]), torch.tensor([0.0]))])
    assert torch.equal(Q._e2m1_codes_finite(v), Q.e2m1_codes(v.clamp(-6, 6)))
    assert torch.equal(Q._e2m1_codes_finite(v), _e2m1_oracle(v.clamp(-6, 6)))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_e2m1_finite_codes_of_non_contiguous_input(layout):
    g = torch.Generator().manual_seed(3)
    base = torch.rand(64, 48, generator=g) * 14 - 7
    v = {"contiguous": base, "transposed": base.t(), "strided": base[::2, 1::3]}[layout]
    assert torch.equal(Q._e2m1_codes_finite(v), _e2m1_oracle(v.clamp(-6, 6)))


def test_pack_nibbles_every_pair_high_nibble_first():
    hi, lo = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    c = torch.stack([hi.reshape(-1), lo.reshape(-1)], 1).to(torch.uint8)     # [256, 2]
    got = Q._pack_nibbles(c)
    assert got.dtype == torch.uint8 and got.shape == (256, 1)
    assert got.reshape(-1).tolist() == [(h << 4) | l for h in range(16) for l in range(16)]


@pytest.mark.parametrize("little", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_pack_nibbles_equals_the_strided_form(layout, little, monkeypatch):
    monkeypatch.setattr(Q, "_LITTLE_ENDIAN", little)
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 16, (40, 64), generator=g, dtype=torch.uint8)
    c = {"contiguous": base, "transposed": base.t().contiguous().t()[:, :40], "sliced": base[:, 2:34]}[layout]
    want = (c[:, 0::2] << 4) | c[:, 1::2]
    assert torch.equal(Q._pack_nibbles(c), want)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_blocks_f32_equals_float_copy_and_block_amax(block, dtype):
    g = torch.Generator().manual_seed(block)
    x = (torch.randn(24, 4 * block, generator=g, dtype=torch.float64) * 3).to(dtype)
    x[0, :block] = -0.0
    x[1, 3] = float("nan")
    x[2, block + 1] = float("-inf")
    x[3, -1] = -7e4 if dtype == torch.float16 else -1e30
    keep = x.clone()
    f, amax = Q._blocks_f32(x, block)
    want_f = x.float().reshape(24, 4, block)
    want_a = torch.amax(torch.abs(x.float().reshape(24, 4, block)), dim=-1)
    assert f.dtype == amax.dtype == torch.float32 and amax.shape == (24, 4)
    assert torch.equal(f.view(torch.int32), want_f.view(torch.int32))
    assert torch.equal(amax.isnan(), want_a.isnan()) and bool(amax[1, 0].isnan()) and amax[2, 1] == float("inf")
    assert torch.equal(amax.nan_to_num(), want_a.nan_to_num())
    f.div_(2.0)                                          # the caller divides in place: the source stays
    assert torch.equal(x.view(-1).view(torch.uint8), keep.view(-1).view(torch.uint8))


def test_blocks_f32_of_a_transposed_source():
    base = torch.randn(64, 20, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x = base.t()                                         # [20, 64], not contiguous
    f, amax = Q._blocks_f32(x, 16)
    assert torch.equal(f.reshape(20, 64), x.float())
    assert torch.equal(amax, x.float().abs().reshape(20, 4, 16).amax(-1))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "float8_e4m3fn", "int8_tensorwise"])
def test_quantize_leaves_a_float32_source_untouched(fmt):
    """Regression: the block formats divided a float32 source's own rows in place (``xb.float()`` is ``xb``)."""
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(1)) * 0.02
    keep = w.clone()
    Q.quantize(w, fmt)
    Q.quantize(w, fmt, finite=True) if fmt == "nvfp4" else None
    assert torch.equal(w, keep)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_to_f32_every_fp8_code_bit_equal_to_torch(dtype):
    q = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(16, 16)
    out = torch.empty(16, 16)
    Q._to_f32(q, out)
    assert torch.equal(out.view(torch.int32), q.float().view(torch.int32))   # NaN payloads and -0.0 included
    t = q.t()                                                                 # not contiguous: torch's copy
    out2 = torch.empty(16, 16)
    Q._to_f32(t, out2)
    assert torch.equal(out2.view(torch.int32), t.float().view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float16, torch.uint8])
def test_to_f32_other_dtypes_copy(dtype):
    q = torch.arange(-8, 8).to(dtype).reshape(4, 4)
    out = torch.empty(4, 4)
    Q._to_f32(q, out)
    assert torch.equal(out, q.float())


def test_work_buffers_are_reused_grown_and_per_thread():
    a = Q._work_f32("t_slot", torch.empty(8, 4))
    b = Q._work_f32("t_slot", torch.empty(2, 3))
    assert b.shape == (2, 3) and b.dtype == torch.float32 and b.data_ptr() == a.data_ptr()
    c = Q._work_f32("t_slot", torch.empty(33))
    assert c.numel() == 33 and Q._work_f32("t_slot", torch.empty(33)).data_ptr() == c.data_ptr()
    i1 = Q._work_int("t_i", 10)
    i2 = Q._work_int("t_i", 10)
    assert i1.dtype == torch.int32 and i1.shape == (10,) and i1.data_ptr() == i2.data_ptr()
    assert Q._work_int("t_i", 11).numel() == 11
    h = Q._work_int("t_i", 10, torch.int16)
    assert h.dtype == torch.int16 and h.data_ptr() != i1.data_ptr()
    other = []
    th = threading.Thread(target=lambda: other.append(Q._work_f32("t_slot", torch.empty(33)).data_ptr()))
    th.start()
    th.join()
    assert other[0] != c.data_ptr()


def test_host_memory_maps_private_memory():
    assert HM.MAP_FLAGS & mmap.MAP_PRIVATE and not HM.MAP_FLAGS & mmap.MAP_SHARED
    assert HM.MAP_FLAGS & mmap.MAP_ANONYMOUS
    t = HM.empty((HM.MIN_BYTES // 4,), torch.float32)
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * (HM.MIN_BYTES // 4)


def test_scratch_boundary_reuse_growth_and_release():
    s = HM.Scratch()
    small = s.take((HM.MIN_BYTES - 1,), torch.uint8)         # one byte below: a plain tensor, no buffer
    assert small.shape == (HM.MIN_BYTES - 1,) and s.nbytes == 0 and s.grown == 0
    a = s.take((HM.MIN_BYTES,), torch.uint8)                  # at the bound: the buffer
    assert s.nbytes == HM.MIN_BYTES and s.grown == 1
    b = s.take((HM.MIN_BYTES // 4, 2), torch.bfloat16)
    assert b.shape == (HM.MIN_BYTES // 4, 2) and b.dtype == torch.bfloat16
    assert b.data_ptr() == a.data_ptr() and s.grown == 1     # reused: the same memory
    c = s.take((HM.MIN_BYTES // 4 + 1,), torch.float32)      # larger than any before: grown
    assert s.grown == 2 and s.nbytes == (HM.MIN_BYTES // 4 + 1) * 4
    c.fill_(2.0)
    assert float(c.sum()) == 2.0 * c.numel()
    s.take((HM.MIN_BYTES // 4 + 1,), torch.float32)
    assert s.grown == 2
    s.release()
    assert s.nbytes == 0


def test_prefetch_asks_for_the_tensor_bytes(tmp_path, monkeypatch):
    p = tmp_path / "m.safetensors"
    st.save_file({"a": torch.ones(64), "e": torch.zeros(0)}, str(p))
    calls = []
    real = sio.os.posix_fadvise
    monkeypatch.setattr(sio.os, "posix_fadvise", lambda *a: (calls.append(a[1:]), real(*a))[1])
    with sio.SafeFile(p) as f:
        ti = f.info("a")
        assert f.prefetch("a") is True
        assert calls == [(f.header.data_start + ti.begin, 256, sio.os.POSIX_FADV_WILLNEED)]
        assert f.prefetch("e") is False                          # nothing to read
        with pytest.raises(Exception, match="nope"):
            f.prefetch("nope")
    assert f.prefetch("a") is False                              # closed: nothing asked
    monkeypatch.setattr(sio.os, "posix_fadvise", lambda *a: (_ for _ in ()).throw(OSError(22, "x")))
    with sio.SafeFile(p) as f:
        assert f.prefetch("a") is False
    monkeypatch.delattr(sio.os, "posix_fadvise")
    with sio.SafeFile(p) as f:
        assert f.prefetch("a") is False


def test_quantized_keys_are_the_planned_weights():
    inv = {"blocks.0.attn.qkv_proj.weight": ((96, 32), "BF16"), "blocks.0.attn.qkv_proj.bias": ((96,), "BF16"),
           "blocks.0.mlp.fc1.weight": ((64, 32), "BF16")}
    plan = QC.make_plan("h3", "float8_e4m3fn", inv)
    want = frozenset(k for k, (_, q, _) in plan.decisions.items() if q)
    assert plan.quantized_keys() == want
    assert "blocks.0.attn.qkv_proj.bias" not in want and "blocks.0.mlp.fc1.weight" in want


@pytest.mark.parametrize("family", ["h3", "zimage"])
def test_reader_with_scratch_yields_the_same_tensors(tmp_path, family):
    """Each scratch tensor is the file's until the next item; the tensors not named stay valid after the loop."""
    sd = ckpt_h3.base_state_dict() if family == "h3" else ckpt_image.zimage_state_dict()
    p = tmp_path / "m.safetensors"
    save_file(sd, p)
    src = QC.open_source(str(p))
    plan = QC.make_plan(src.family, "float8_e4m3fn", src.inventory, src.prefix)
    keys = plan.quantized_keys()
    assert keys
    plain = {k: t.clone() for k, t in src.reader()}
    kept, n = {}, 0
    for k, t in src.reader(scratch_keys=keys):
        assert torch.equal(t.reshape(-1).view(torch.uint8), plain[k].reshape(-1).view(torch.uint8)), k
        if k not in keys:
            kept[k] = t
        n += 1
    assert n == len(plain) and kept
    for k, t in kept.items():
        assert torch.equal(t, plain[k]), k
