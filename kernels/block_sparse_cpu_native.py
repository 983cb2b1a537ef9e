"""``cpu_native``: the exact CPU block-sparse attention with its per-query-tile part in one fused C++ pass.

Same contract as :func:`.block_sparse.block_sparse_attn_reference`. It is :func:`.block_sparse_cpu.block_sparse_attn_cpu`
(dense query tiles and key tiles common to every query tile as large ATen flash calls, merged by log-sum-exp)
with the remaining per-query-tile key tiles handled by ``csrc/tile_attn.cpp``: for each 64-row query tile the live
rows of its selected key/value tiles are gathered into thread-local buffers, then one sgemm for the scores, an
exact vectorised row softmax, one sgemm for the output. ATen's flash kernel splits a 64-row query into 32-row
blocks, which re-reads K/V and runs its GEMMs at about three quarters of the dense rate; the fused pass avoids
that and the separate gather (``benchmarks/bench_vsa_cpu.py``).

The extension is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler and the torch headers
are needed; about a minute, then cached in torch's extension directory, keyed by a hash of the source). Because
of that first-use build it is **explicit only**: ``auto`` never picks it (``cpu_batched`` stays the CPU default),
and a failed build is a reported rejection, never a silent switch. fp32 only (the kernel accumulates and stores in
fp32; half inputs use ``cpu_batched``).

Liger-style layout: kernel (``csrc/tile_attn.cpp``), launcher (:func:`tile_attn`), pure-torch reference of the
same contract (:func:`tile_attn_reference`), tests in ``tests/unit/test_kernels_cpu_native.py``, benchmark in
``benchmarks/bench_vsa_cpu.py``.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from typing import Optional

import torch

from .block_sparse import OP
from .block_sparse_cpu import block_sparse_attn_cpu
from .registry import REGISTRY, Impl, Query

NAME = "cpu_native"
SOURCE = Path(__file__).with_name("csrc") / "tile_attn.cpp"
log = logging.getLogger("ditkit.kernels")

_lock = threading.Lock()
_state: dict = {}


def _cpu_fingerprint() -> bytes:
    """What ``-march=native`` compiled for: the machine and its CPU feature flags (Linux), so a build cached in a
    home folder shared by different CPUs is never loaded on one that lacks its instructions."""
    flags = b""
    try:
        for line in Path("/proc/cpuinfo").read_bytes().splitlines():
            if line.startswith((b"flags", b"Features")):
                flags = line
                break
    except OSError:
        pass
    return platform.machine().encode() + b"|" + flags


def extension_name() -> str:
    """Module name of the compiled extension: changes with the source and the CPU, so an edited kernel or another
    CPU gets its own build."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(_cpu_fingerprint())
    return "ditkit_tile_attn_" + h.hexdigest()[:12]


def stable_source(name: str, cpp_extension) -> Path:
    """The kernel source as the build sees it: a copy named after the extension in torch's extension root, not the
    file inside this checkout. The build folder is keyed by the extension name only, and torch rewrites its build
    file (and ninja recompiles) whenever the source path in it changes: with the checkout's own path, two
    checkouts of the same source (worktrees, a CI clone) rebuilt the shared extension each time the other had
    loaded it. The copy is written only when missing or different (its mtime is what ninja compares), through
    ``loaders/safe_fs`` (no symlink followed, temp file + atomic publish); an existing different file is replaced
    only when it is one of these kernel sources (its first line is the source's)."""
    from ..errors import DitKitError
    from ..loaders import safe_fs

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    fname = f"{name}.cpp"
    src = SOURCE.read_bytes()
    head = src.split(b"\n", 1)[0]
    what = "cpu_native kernel source copy"
    try:
        old, _ = safe_fs.read_inside(root, ("ditkit_sources", fname), max_bytes=4 * len(src) + 4096, what=what)
    except DitKitError:
        old = None                           # missing (or not a readable regular file: write_file says which)
    if old != src:
        d = safe_fs.SafeDir.open_root(root, ("ditkit_sources",), create=True, what="torch extensions folder")
        try:
            safe_fs.write_file(d, fname, src, replace_if=lambda blob: blob.split(b"\n", 1)[0] == head)
        finally:
            d.close()
    return Path(os.path.realpath(root)) / "ditkit_sources" / fname


# Called as ``hook(event, message)`` with event "start" (before the first build/load of the process), "done" or
# "failed": the host layer (nodes/_native_build.py) shows the message on the node that is waiting.
BUILD_HOOKS: list = []


def _tell(event: str, message: str) -> None:
    for h in list(BUILD_HOOKS):
        try:
            h(event, message)
        except Exception:  # noqa: BLE001 - a display hook never breaks the build
            log.debug("[ditkit] cpu_native build hook failed", exc_info=True)


def load_extension():
    """Build (first use) or load the extension; returns the module or raises RuntimeError with the reason.
    The outcome is remembered for the process, so a failing compiler is tried once."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        if "error" in _state:
            raise RuntimeError(_state["error"])
        try:
            if shutil.which("c++") is None and shutil.which("g++") is None:
                raise RuntimeError("no C++ compiler (c++/g++) on PATH")
            from torch.utils import cpp_extension

            log.info("[ditkit] building/loading the cpu_native tile-attention extension (first build takes about "
                     "a minute; cached afterwards)")
            _tell("start", "cpu_native: building the CPU kernel, about a minute, once (cached afterwards)")
            name = extension_name()
            mod = cpp_extension.load(name=name, sources=[str(stable_source(name, cpp_extension))],
                                     extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                     verbose=False)
        except Exception as e:  # noqa: BLE001 - any build/load failure is a capability verdict, stated once
            _state["error"] = f"building the C++ extension failed: {type(e).__name__}: {str(e).strip()[:300]}"
            _tell("failed", f"cpu_native: {_state['error']}")
            raise RuntimeError(_state["error"]) from e
        _state["module"] = mod
        _tell("done", "cpu_native: CPU kernel ready")
        return mod


def tile_attn(q, k, v, sel, cnt, live, scale: float):
    """Launcher: per query tile i, attention of ``q[i]`` ([64, D]) over the live rows of key/value tiles
    ``sel[i, :cnt[i]]`` of ``k``/``v`` ([Tk, 64, D]) -> (out [n, 64, D] fp32, natural lse [n, 64] fp32)."""
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        raise TypeError(f"cpu_native tile attention is fp32 only (got {q.dtype}/{k.dtype}/{v.dtype})")
    mod = load_extension()
    return tuple(mod.tile_attn_fwd(q.contiguous(), k.contiguous(), v.contiguous(), sel.long().contiguous(),
                                   cnt.long().contiguous(), live.long().contiguous(), float(scale)))


def tile_attn_reference(q, k, v, sel, cnt, live, scale: float):
    """Pure-torch reference of :func:`tile_attn` (float64 internally)."""
    n, M, D = q.shape
    out = torch.zeros(n, M, D, dtype=torch.float32)
    lse = torch.full((n, M), float("-inf"), dtype=torch.float32)
    for i in range(n):
        tiles = sel[i, : int(cnt[i])].long()
        rows = [k[t, : int(live[t])] for t in tiles.tolist()]
        if not rows or sum(r.shape[0] for r in rows) == 0:
            continue
        kk = torch.cat(rows).double()
        vv = torch.cat([v[t, : int(live[t])] for t in tiles.tolist()]).double()
        s = (q[i].double() @ kk.T) * scale
        m = torch.logsumexp(s, dim=-1)
        out[i] = (torch.softmax(s, dim=-1) @ vv).float()
        lse[i] = m.float()
    return out, lse


def block_sparse_attn_cpu_native(q, k, v, q2k_index, q2k_num, variable_block_sizes, need_lse: bool = True):
    return block_sparse_attn_cpu(q, k, v, q2k_index, q2k_num, variable_block_sizes, need_lse=need_lse,
                                 rest_kernel=tile_attn)


@functools.lru_cache(maxsize=None)
def _compiler_present() -> bool:
    return shutil.which("c++") is not None or shutil.which("g++") is not None


def _native_check(q: Query, explicit: bool) -> Optional[str]:
    if q.device_type != "cpu":
        return f"CPU only (got {q.device_type})"
    if q.dtype != torch.float32:
        return f"fp32 only (got {str(q.dtype).replace('torch.', '')}); cpu_batched handles half inputs"
    if not explicit:
        return "explicit only: compiles a C++ extension on first use (about a minute); request 'cpu_native'"
    if "error" in _state:
        return _state["error"]
    if not _compiler_present():
        return "no C++ compiler (c++/g++) on PATH to build the extension"
    return None                  # built on the first call (load_extension); a failed build raises there


REGISTRY.impl(OP, Impl(NAME, block_sparse_attn_cpu_native, _native_check, priority=39, explicit_only=True,
                       note="CPU, explicit: cpu_batched with the per-query-tile part as one fused C++ pass"))
