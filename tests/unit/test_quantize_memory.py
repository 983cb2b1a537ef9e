"""Host memory of quantize-while-loading (issue #20): kept tensors in their own mappings, outputs written into the
allocator's tensors, rows read straight into their converted order, and the peak RSS of streaming a generated
H3 through the quantizer within ``quantized size + 2 largest tensors``.

The peak is measured in a fresh subprocess (RSS sampled by a thread); without the fix the streamed state dict
sat on a fragmented C heap at about twice its size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ditkit.kernels import quant as Q
from ditkit.loaders import h3 as L
from ditkit.loaders import host_memory as H
from ditkit.loaders import safetensors_io as sio
from ditkit.tiny import ckpt_h3

REPO = Path(__file__).resolve().parents[2]
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
linux = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")


def _mappings() -> dict[int, int]:
    out = {}
    with open("/proc/self/maps") as f:
        for line in f:
            a, b = line.split()[0].split("-")
            out[int(a, 16)] = int(b, 16) - int(a, 16)
    return out


def _covering(addr: int) -> tuple[int, int] | None:
    """The mapping that holds ``addr`` as (start, end), or None: adjacent anonymous mappings with the same flags
    are merged by the kernel into one line of /proc/self/maps, so a mapping is found by containment."""
    for a, n in _mappings().items():
        if a <= addr < a + n:
            return a, a + n
    return None


@linux
def test_empty_tensor_is_its_own_mapping_and_unmapped_with_its_last_view():
    n = H.MIN_BYTES + 3 * PAGE + 6                      # not a page multiple
    t = H.empty((n // 2,), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (n // 2,) and t.is_contiguous()
    start = t.data_ptr()
    end = start + -(-t.numel() * 2 // PAGE) * PAGE
    assert start % PAGE == 0                            # a mapping of its own starts on a page
    a, b = _covering(start)
    assert a <= start and b >= end                      # all its pages are mapped (possibly merged with a neighbour)
    v = t[1:5].view(torch.int16)
    del t
    assert _covering(start) is not None                 # a view keeps it
    v.fill_(7)
    del v
    assert _covering(start) is None and _covering(end - 1) is None    # unmapped with its last view


def test_small_empty_is_plain_and_shapes_dtypes_hold():
    for shape, dt in (((), torch.float32), ((3, 5), torch.float8_e4m3fn), ((1 << 17,), torch.int8),
                      ((1024, 512), torch.uint8), ((0, 4), torch.bfloat16)):
        t = H.empty(shape, dt)
        assert t.shape == shape and t.dtype == dt and t.is_contiguous()


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4"])
def test_quantize_writes_into_the_allocator_with_the_same_bits(fmt, monkeypatch):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 200, generator=g) * 0.05).to(torch.bfloat16)
    ref_data, ref_scales = Q.quantize(w, fmt)
    made = []

    def alloc(shape, dtype):
        made.append(torch.empty(shape, dtype=dtype))
        return made[-1]

    released = []
    monkeypatch.setattr(Q, "CHUNK_ELEMS", 1)            # several 128-row slices
    data, scales = Q.quantize(w, fmt, empty=alloc, release=lambda: released.append(1))
    assert any(data.data_ptr() == m.data_ptr() for m in made)
    if fmt in ("mxfp8", "nvfp4"):
        assert any(scales["weight_scale"].data_ptr() == m.data_ptr() for m in made)
    assert len(released) == 3                           # 300 rows in 128-row slices
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    for k, r in ref_scales.items():
        got = scales[k]
        assert (torch.equal(got, r) if r.dim() == 0 else torch.equal(got.view(torch.uint8), r.view(torch.uint8))), k


def test_per_tensor_scale_in_slices_equals_whole_tensor_amax(monkeypatch):
    w = torch.randn(1000, 64).to(torch.float16)
    w[777, 3] = -9.5                                    # the amax sits in a late slice
    monkeypatch.setattr(Q, "CHUNK_ELEMS", 1)
    for fmt in ("float8_e4m3fn", "int8_tensorwise", "nvfp4"):
        got = Q.per_tensor_scale(w, fmt)
        amax = w.float().abs().max()
        want = {"float8_e4m3fn": 1.0 / torch.clamp(1.0 / (amax / 448.0), min=-65504.0, max=65504.0),
                "int8_tensorwise": amax / 127.0,
                "nvfp4": (torch.tensor(-9.5, dtype=torch.float16).abs() / (448.0 * 6.0)).float()}[fmt]
        assert torch.equal(got, want.to(torch.float32)), fmt


def test_reconstruction_error_leaves_a_float32_weight_untouched():
    w = torch.randn(256, 64)
    keep = w.clone()
    data, scales = Q.quantize(w, "float8_e4m3fn")
    e2, r2 = Q.reconstruction_error(w, data, scales, "float8_e4m3fn")
    assert torch.equal(w, keep)
    rec = data.float() * scales["weight_scale"]
    assert e2 == pytest.approx(float(((rec - w) ** 2).sum()), rel=1e-6)
    assert r2 == pytest.approx(float((w ** 2).sum()), rel=1e-6)


def test_read_rows_into_permutes_rows_from_the_file(tmp_path):
    x = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)
    p = tmp_path / "r.safetensors"
    sio.save_file({"x": x, "b": torch.ones(2, dtype=torch.bfloat16)}, p)
    out = torch.empty(12, 3)
    with sio.SafeFile(p) as f:
        f.read_rows_into("x", out, [(8, 4, 0), (0, 8, 4)])
        assert torch.equal(out, torch.cat([x[8:], x[:8]]))
        with pytest.raises(ValueError, match="outside"):
            f.read_rows_into("x", out, [(10, 4, 0)])
        with pytest.raises(ValueError, match="float32"):
            f.read_rows_into("x", torch.empty(12, 3, dtype=torch.float64), [(0, 12, 0)])
        got = f.get("x", alloc=lambda shape, dtype: torch.full(shape, -1.0, dtype=dtype))
        assert torch.equal(got, x)


def test_official_qkv_is_read_into_its_allocated_tensor(tmp_path):
    c = dict(ckpt_h3.CONFIG)
    base = ckpt_h3.base_state_dict(c)
    ckpt_h3.write_sharded(ckpt_h3.official_state_dict(base, c), tmp_path / "off", "model",
                          "model.safetensors.index.json", 2, ckpt_h3.official_config(c))
    plan = L.plan_h3(tmp_path / "off")
    made = {}

    def alloc(shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        made[t.data_ptr()] = t
        return t

    n = 0
    for k, t in L.iter_h3_tensors(plan, alloc=alloc):
        if k.endswith("attn.qkv_proj.weight"):
            n += 1
            assert t.data_ptr() in made, k              # no second copy after the read
        assert torch.equal(t, base[k]), k               # ComfyUI layout, as the generator writes it
    assert n == plan.converted["qkv de-interleaved"] > 0


CHILD = r"""
import json, os, sys, threading
import torch
torch.set_num_threads(1)
from ditkit.loaders import quantize as qc
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
src = qc.open_source(sys.argv[1])
plan = qc.make_plan("h3", sys.argv[2], src.inventory)
rep = qc.QuantReport("h3", sys.argv[2], "")
for k, _ in qc.quantize_stream(src.reader(), plan, rep, "warm"):  # warm-up: torch's first-use allocations
    if k.endswith(".comfy_quant"):                                  # (one quantized layer done)
        break
before = rss(); peak = [before]; stop = threading.Event()
def poll():
    while not stop.is_set():
        peak[0] = max(peak[0], rss()); stop.wait(0.0005)
th = threading.Thread(target=poll, daemon=True); th.start()
rep = qc.QuantReport("h3", sys.argv[2], "")
sd = dict(qc.quantize_stream(src.reader(), plan, rep, "x"))        # what the loader node hands to ComfyUI
stop.set(); th.join()
kept = sum(t.numel() * t.element_size() for t in sd.values())
print(json.dumps({"peak": max(peak[0], rss()) - before, "kept": kept}))
"""


@linux
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_streamed_quantization_peak_rss_within_quantized_size_plus_two_tensors(fmt, tmp_path):
    c = dict(ckpt_h3.CONFIG, hidden_size=1024, num_attention_heads=8, attention_head_dim=128, ffn_hidden_size=2816,
             text_dim=1024, time_embed_hidden_size=1024, time_embed_dim=512, num_layers=1)
    base = ckpt_h3.base_state_dict(c)
    largest = sum(sorted((t.numel() * t.element_size() for t in base.values()), reverse=True)[:2])
    ckpt_h3.write_sharded(ckpt_h3.official_state_dict(base, c), tmp_path / "off", "model",
                          "model.safetensors.index.json", 2, ckpt_h3.official_config(c))
    src_bytes = sum(t.numel() * t.element_size() for t in base.values())
    del base
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                       .split(os.pathsep) if p]))
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "off"), fmt], cwd=str(REPO), env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert src_bytes > 24 << 20 and r["kept"] < src_bytes * 0.7
    assert r["peak"] <= r["kept"] + largest, (f"{fmt}: peak RSS growth {r['peak'] / 2**20:.1f} MiB > kept "
                                              f"{r['kept'] / 2**20:.1f} MiB + two largest {largest / 2**20:.1f} MiB")


# ------------------------------------------------------- block scales kept by the model ComfyUI builds (no copy)

def _quantized_param(data, scale, clone=True):
    """A parameter shaped like comfy_kitchen's QuantizedTensor after nn.Parameter: ``_qdata`` shares the state
    dict's data, ``_params`` a frozen dataclass whose block scale is a clone (what its detach does)."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Params:
        scale: torch.Tensor
        block_scale: torch.Tensor

    p = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    p._qdata = data
    p._params = Params(torch.ones(()), scale.clone() if clone else scale)
    return p


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_share_block_scales_puts_the_state_dicts_tensor_back(fmt):
    from ditkit.bridge.quant_scales import share_block_scales

    w = torch.randn(256, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    data, scales = Q.quantize(w, fmt)
    sd = {"l.weight": data, "l.weight_scale": scales["weight_scale"]}
    ref = scales["weight_scale"].view(torch.uint8).clone()
    lin = torch.nn.Module()
    with share_block_scales(sd) as sharing:
        lin.register_parameter("weight", _quantized_param(data, scales["weight_scale"]))
    got = lin.weight._params.block_scale
    assert got.data_ptr() == scales["weight_scale"].data_ptr()           # the very tensor, not the clone
    assert torch.equal(got.view(torch.uint8), ref)
    assert sharing.shared == 1 and sharing.shared_bytes == ref.numel()
    # outside the context nothing is swapped (the hook is removed)
    other = torch.nn.Module()
    other.register_parameter("weight", _quantized_param(data, scales["weight_scale"]))
    assert other.weight._params.block_scale.data_ptr() != scales["weight_scale"].data_ptr()


def test_share_block_scales_leaves_other_values_and_other_weights_alone():
    from ditkit.bridge.quant_scales import share_block_scales

    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    data, scales = Q.quantize(w, "nvfp4")
    sd = {"l.weight": data, "l.weight_scale": scales["weight_scale"]}
    changed = scales["weight_scale"].view(torch.uint8).clone()
    changed[0, 0] ^= 1                                                  # a clone whose bytes differ: kept as is
    m = torch.nn.Module()
    with share_block_scales(sd) as sharing:
        m.register_parameter("a", _quantized_param(data, changed.view(scales["weight_scale"].dtype), clone=False))
        m.register_parameter("b", _quantized_param(data.clone(), scales["weight_scale"]))  # not the sd's data
    assert m.a._params.block_scale.data_ptr() == changed.data_ptr()
    assert m.b._params.block_scale.data_ptr() != scales["weight_scale"].data_ptr()
    assert sharing.shared == 0
