"""loaders/host_memory: empty_like directly, the mapping being private (not MAP_SHARED's shmem), and how the glibc
malloc_trim lookup is made and cached (a C library without it, one without glibc's version call, one that cannot
be loaded)."""
from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from ditkit.loaders import host_memory as HM

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_like_keeps_shape_and_dtype_on_both_sides_of_the_limit(dtype):
    item = torch.empty((), dtype=dtype).element_size()
    for n in (HM.MIN_BYTES // item - 1, HM.MIN_BYTES // item):
        src = torch.zeros(n, 1, dtype=dtype).t()                  # non-contiguous source: the copy is contiguous
        out = HM.empty_like(src)
        assert out.shape == src.shape and out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu"
        out.fill_(1)
        assert float(out.double().sum()) == n


def _mapping_of(ptr: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return line
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_a_large_tensor_lives_in_a_private_anonymous_mapping():
    t = HM.empty((HM.MIN_BYTES,), torch.uint8)
    line = _mapping_of(t.data_ptr())
    perms = line.split()[1]
    assert perms.startswith("rw") and perms.endswith("p"), line      # MAP_SHARED would read "rw-s" (/dev/zero)
    assert "/dev/zero" not in line and "SYSV" not in line, line


class _Lib:
    def __init__(self, **fns):
        for k, v in fns.items():
            setattr(self, k, v)


def _fn():
    def f(n):
        return 1
    return f


def test_malloc_trim_lookup_is_made_once_and_cached(monkeypatch):
    monkeypatch.setattr(HM, "_TRIM", None)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _Lib(malloc_trim=_fn()))          # musl-like: no glibc call
    assert HM._malloc_trim() is False and HM._TRIM is False and HM.release_free_heap() is False
    monkeypatch.setattr(HM, "_TRIM", None)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _Lib(gnu_get_libc_version=_fn()))  # glibc without it
    assert HM._malloc_trim() is False and HM._TRIM is False

    def broken(name):
        raise OSError("no C library")
    monkeypatch.setattr(HM, "_TRIM", None)
    monkeypatch.setattr(ctypes, "CDLL", broken)
    assert HM._malloc_trim() is False and HM._TRIM is False and HM.release_free_heap() is False
    calls = []
    monkeypatch.setattr(ctypes, "CDLL", lambda name: calls.append(name) or _Lib())
    assert HM._malloc_trim() is False and calls == []                 # cached: not looked up again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_the_real_malloc_trim_is_declared_as_glibc_has_it(monkeypatch):
    monkeypatch.setattr(HM, "_TRIM", None)
    fn = HM._malloc_trim()
    if fn is False:
        pytest.skip("not glibc")
    assert fn.argtypes == [ctypes.c_size_t] and fn.restype is ctypes.c_int and HM._TRIM is fn
    assert HM.release_free_heap() is True
