"""Public functions of the core that were only reached through other functions (issue 29: every public function is
called directly by a unit test). Each oracle is written here from the function's contract, not from its code."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from ditkit.kernels import delta_fuse, quant
from ditkit.loaders import lokr_math, safe_fs
from ditkit.loaders.safetensors_io import header_bytes
from ditkit.sampling import fasth3
from ditkit.vae.preflight import fmt_bytes

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


# ---- loaders/lokr_math
@pytest.mark.parametrize("dtype", DTYPES)
def test_rebuild_w1_w2_full_and_decomposed(dtype):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 2, generator=g), torch.randn(2, 4, generator=g)
    full = torch.randn(3, 4, generator=g)
    assert torch.equal(lokr_math.rebuild_w1({"lokr_w1": full.to(dtype)}), full.to(dtype).float())
    assert lokr_math.rebuild_w1({"lokr_w1": full.to(dtype)}, torch.float64).dtype == torch.float64
    got = lokr_math.rebuild_w1({"lokr_w1_a": a.to(dtype), "lokr_w1_b": b.to(dtype)}, torch.float64)
    assert torch.allclose(got, a.to(dtype).double() @ b.to(dtype).double(), rtol=0, atol=1e-12)
    got2 = lokr_math.rebuild_w2({"lokr_w2_a": a.to(dtype).t().contiguous().t(), "lokr_w2_b": b.to(dtype)},
                                torch.float64)                          # a transposed (non-contiguous) factor
    assert torch.allclose(got2, a.to(dtype).double() @ b.to(dtype).double(), rtol=0, atol=1e-12)
    assert torch.equal(lokr_math.rebuild_w2({"lokr_w2": full.to(dtype)}, torch.float64), full.to(dtype).double())


def test_rebuild_w2_tucker_matches_the_einsum_definition():
    g = torch.Generator().manual_seed(2)
    r, out_k, in_n, k = 2, 3, 4, 3
    t2 = torch.randn(r, r, k, k, generator=g, dtype=torch.float64)
    w2a = torch.randn(r, out_k, generator=g, dtype=torch.float64)
    w2b = torch.randn(r, in_n, generator=g, dtype=torch.float64)
    want = torch.zeros(out_k, in_n, k, k, dtype=torch.float64)
    for i in range(r):
        for j in range(r):
            want += w2a[i][:, None, None, None] * w2b[j][None, :, None, None] * t2[i, j][None, None]
    got = lokr_math.rebuild_w2({"lokr_w2_a": w2a, "lokr_w2_b": w2b, "lokr_t2": t2}, torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


# ---- kernels/delta_fuse.delta_sum_rows, kernels/quant
def test_delta_sum_rows_places_each_delta_on_its_rows():
    g = torch.Generator().manual_seed(3)
    up1, dn1 = torch.randn(4, 2, generator=g), torch.randn(2, 5, generator=g)
    d2 = torch.randn(3, 5, generator=g)
    deltas = [delta_fuse.Delta("lowrank", (up1, dn1), 0.5, rows=(2, 6)),
              delta_fuse.Delta("dense", (d2,), -2.0, row_map=torch.tensor([2, 0, 1]), rows=(5, 8))]
    want = torch.zeros(8, 5, dtype=torch.float64)
    want[2:6] += 0.5 * (up1.double() @ dn1.double())
    want[5:8] += -2.0 * d2.double()[[2, 0, 1]]
    for r0, r1 in ((0, 8), (0, 2), (3, 7), (6, 8), (5, 6)):
        got = delta_fuse.delta_sum_rows(deltas, r0, r1, 5)
        assert got.dtype == torch.float64 and got.shape == (r1 - r0, 5)
        assert torch.allclose(got, want[r0:r1], rtol=0, atol=1e-12), (r0, r1)


@pytest.mark.parametrize("rows,chunk,want", [
    (0, 1, []), (1, 1, [(0, 1)]), (128, 128, [(0, 128)]), (129, 128, [(0, 128), (128, 129)]),
    (300, 129, [(0, 256), (256, 300)]), (300, 1, [(0, 128), (128, 256), (256, 300)]), (256, 256, [(0, 256)])])
def test_requantize_spans_whole_128_row_tiles(rows, chunk, want):
    assert quant.requantize_spans(rows, chunk) == want


def test_get_format_known_and_unknown():
    for name in ("float8_e4m3fn", "int8_tensorwise"):
        assert quant.get_format(name) is quant.FORMATS[name]
    with pytest.raises(ValueError, match="unknown quantization format 'nope'"):
        quant.get_format("nope")


# ---- vae/preflight.fmt_bytes: the GiB boundary on both sides
def test_fmt_bytes_boundary():
    assert fmt_bytes((1 << 30) - 1) == "1024.0 MiB"
    assert fmt_bytes(1 << 30) == "1.00 GiB"
    assert fmt_bytes(3 << 29) == "1.50 GiB"
    assert fmt_bytes(0) == "0.0 MiB"


# ---- loaders/safetensors_io.header_bytes: the format's own layout, parsed here
def test_header_bytes_layout():
    hb = header_bytes({"a": ((2, 3), "F16"), "b": ((5,), "F32"), "c": ((), "BF16")}, {"k": 1})
    (n,) = struct.unpack("<Q", hb[:8])
    assert n == len(hb) - 8 and n % 8 == 0
    obj = json.loads(hb[8:].decode())
    assert obj["__metadata__"] == {"k": "1"}
    assert obj["a"] == {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 12]}
    assert obj["b"] == {"dtype": "F32", "shape": [5], "data_offsets": [12, 32]}
    assert obj["c"] == {"dtype": "BF16", "shape": [], "data_offsets": [32, 34]}
    assert "__metadata__" not in json.loads(header_bytes({"a": ((1,), "U8")})[8:])


# ---- loaders/safe_fs: write_new_temp, open_model_file, read_fd
def test_write_new_temp_read_fd_open_model_file(tmp_path):
    with safe_fs.SafeDir.open_root(tmp_path) as d:
        tmp = safe_fs.write_new_temp(d, "x.bin", b"0123456789")
    assert tmp.startswith(safe_fs.TEMP_PREFIX) and (tmp_path / tmp).read_bytes() == b"0123456789"
    fd = safe_fs.open_model_file(str(tmp_path / tmp))
    try:
        assert safe_fs.read_fd(fd, 10) == b"0123456789"                # exactly the limit: all of it
        os.lseek(fd, 0, 0)
        assert safe_fs.read_fd(fd, 9) == b"0123456789"                 # one byte over the limit: limit + 1 bytes
        os.lseek(fd, 0, 0)
        assert safe_fs.read_fd(fd, 3) == b"0123"
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        safe_fs.open_model_file(str(tmp_path / "missing"))             # never created
    assert not (tmp_path / "missing").exists()


# ---- sampling/fasth3: shifted_sigmas / audio_from_video against the formulas in float64
@pytest.mark.parametrize("shift", [1.0, 3.0, 10.0])
def test_shifted_sigmas_formula(shift):
    grid = [1.0, 0.874, 0.5, 0.125, 0.0]
    got = fasth3.shifted_sigmas(grid, shift)
    assert got.dtype == torch.float32
    want = [shift * b / (1 + (shift - 1) * b) for b in grid]
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    assert got[0] == 1.0 and got[-1] == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_audio_from_video_formula_and_dtype(dtype):
    sv = torch.tensor([1.0, 0.9, 0.5, 0.1, 0.0], dtype=dtype)
    got = fasth3.audio_from_video(sv, 10.0, 3.0)
    assert got.dtype == torch.float32
    out = []
    for s in sv.float().tolist():
        s = max(s, 1e-6)
        base = s / (10.0 + s * (1 - 10.0))
        out.append(3.0 * base / (1 + (3.0 - 1) * base))
    assert torch.allclose(got.double(), torch.tensor(out, dtype=torch.float64), rtol=1e-5, atol=1e-9)
    assert 0 < float(got[-1]) < 1e-6                                    # the clamp at 1e-6, not exactly 0
