"""cpu_native: the fused C++ per-query-tile attention, against a float64 reference, and its dispatch rules.

The whole block-sparse / VSA-H3 paths of ``cpu_native`` are checked against the token-level oracle in
``test_kernels_vsa.py`` (parametrised with the other backends); here: the kernel contract itself (ragged tiles,
empty selections, zero-live tiles, several head dims) and the registry rules (explicit only, fp32 only, a failed
build is a stated rejection). Tests skip, with the reason, where the extension cannot be built (no compiler).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ditkit.errors import BackendError
from ditkit.kernels import block_sparse_cpu_native as N
from ditkit.kernels import registry, vsa  # noqa: F401  (vsa registers every backend)
from ditkit.kernels.registry import REGISTRY

OP = "block_sparse_attn"


@pytest.fixture(scope="module")
def ext():
    try:
        return N.load_extension()
    except RuntimeError as e:
        pytest.skip(f"cpu_native extension unavailable here: {e}")


def _oracle(q, k, v, sel, cnt, live, scale):
    """float64, written from the definition: softmax over the concatenated live rows of the selected tiles."""
    n = q.shape[0]
    outs, lses = [], []
    for i in range(n):
        rows = [(int(t), r) for t in sel[i, : int(cnt[i])].tolist() for r in range(int(live[t]))]
        if not rows:
            outs.append(torch.zeros(q.shape[1:], dtype=torch.float64))
            lses.append(torch.full((q.shape[1],), float("-inf"), dtype=torch.float64))
            continue
        kk = torch.stack([k[t, r] for t, r in rows]).double()
        vv = torch.stack([v[t, r] for t, r in rows]).double()
        s = q[i].double() @ kk.T * scale
        outs.append(torch.softmax(s, -1) @ vv)
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("D", [16, 64, 128])
@pytest.mark.parametrize("seed", [0, 1])
def test_tile_attn_vs_float64(ext, D, seed):
    g = torch.Generator().manual_seed(seed)
    Tk, n, cmax = 9, 6, 5
    k = torch.randn(Tk, 64, D, generator=g)
    v = torch.randn(Tk, 64, D, generator=g)
    q = torch.randn(n, 64, D, generator=g) * 2          # peaky softmax rows
    live = torch.tensor([64, 17, 64, 1, 64, 0, 40, 64, 64])   # ragged, single-row and empty tiles
    sel = torch.zeros(n, cmax, dtype=torch.long)
    cnt = torch.tensor([5, 1, 0, 3, 2, 1])                 # an empty selection; a tile with 0 live rows alone
    for i in range(n):
        sel[i, : int(cnt[i])] = torch.randperm(Tk, generator=g)[: int(cnt[i])].sort().values
    sel[5, 0] = 5
    scale = D ** -0.5
    out, lse = N.tile_attn(q, k, v, sel, cnt, live, scale)
    o_ref, l_ref = _oracle(q, k, v, sel, cnt, live, scale)
    torch.testing.assert_close(out.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), l_ref, atol=1e-5, rtol=1e-5)
    assert bool((out[2] == 0).all()) and bool(torch.isinf(lse[2]).all()) and bool((lse[2] < 0).all())
    assert bool((out[5] == 0).all()) and bool(torch.isinf(lse[5]).all())
    # the pure-torch reference of the launcher contract agrees too (it is what the docs point readers to)
    o2, l2 = N.tile_attn_reference(q, k, v, sel, cnt, live, scale)
    torch.testing.assert_close(o2.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l2.double(), l_ref, atol=1e-5, rtol=1e-5)


def test_tile_attn_rejects_bad_input(ext):
    q = torch.randn(2, 64, 16)
    k = torch.randn(3, 64, 16)
    sel = torch.tensor([[0, 1], [2, 0]])
    cnt = torch.tensor([2, 1])
    live = torch.tensor([64, 64, 64])
    with pytest.raises(TypeError, match="fp32"):
        N.tile_attn(q.half(), k.half(), k.half(), sel, cnt, live, 0.25)
    with pytest.raises(RuntimeError, match="tile id out of range"):
        N.tile_attn(q, k, k, torch.tensor([[0, 7], [2, 0]]), cnt, live, 0.25)
    with pytest.raises(RuntimeError, match="live rows"):
        N.tile_attn(q, k, k, sel, cnt, torch.tensor([64, 65, 64]), 0.25)


def test_auto_never_picks_cpu_native_and_explicit_rules(monkeypatch):
    REGISTRY.clear_cache()
    try:
        auto = REGISTRY.resolve(OP, "cpu", torch.float32, 128)
        assert auto.backend == "cpu_batched"
        assert "explicit only" in dict(auto.rejected)["cpu_native"]
        with pytest.raises(BackendError, match="fp32 only"):
            REGISTRY.resolve(OP, "cpu", torch.float16, 128, backend="cpu_native")
        monkeypatch.setattr(registry, "device_capability", lambda dev: (9, 0) if dev.type == "cuda" else None)
        with pytest.raises(BackendError, match="CPU only"):
            REGISTRY.resolve(OP, "cuda", torch.float32, 128, backend="cpu_native")
        # a failed build is remembered and stated, never swapped for another backend
        monkeypatch.setitem(N._state, "error", "building the C++ extension failed: CalledProcessError: boom")
        REGISTRY.clear_cache()
        with pytest.raises(BackendError, match="boom"):
            REGISTRY.resolve(OP, "cpu", torch.float32, 128, backend="cpu_native")
        monkeypatch.delitem(N._state, "error")
        monkeypatch.setattr(N, "_compiler_present", lambda: False)
        REGISTRY.clear_cache()
        with pytest.raises(BackendError, match="no C\\+\\+ compiler"):
            REGISTRY.resolve(OP, "cpu", torch.float32, 128, backend="cpu_native")
    finally:
        REGISTRY.clear_cache()


def test_explicit_cpu_native_resolves(ext):
    REGISTRY.clear_cache()
    try:
        sel = REGISTRY.resolve(OP, "cpu", torch.float32, 64, backend="cpu_native")
        assert sel.backend == "cpu_native" and sel.exact
    finally:
        REGISTRY.clear_cache()


def test_two_checkouts_give_the_build_the_same_source_path(tmp_path, monkeypatch):
    """The build folder is keyed by the extension name only and torch recompiles when the source path in its build
    file changes: two checkouts of the same kernel (worktrees, a CI clone) must hand the build the same file, or
    each rebuilds the shared extension after the other loaded it. The compiler is a stub here; the file handed
    over holds the kernel's bytes and is not rewritten (its mtime is what the build compares) on a later load."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(N.shutil, "which", lambda name: "/usr/bin/" + name)
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(kw) or object())
    sources, stamps = [], []
    for checkout in ("a", "b", "a"):
        src = tmp_path / checkout / "csrc" / "tile_attn.cpp"
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_bytes(N.SOURCE.read_bytes())
        monkeypatch.setattr(N, "SOURCE", src)
        monkeypatch.setattr(N, "_state", {})
        N.load_extension()
        (path,) = seen[-1]["sources"]
        sources.append(path)
        stamps.append(Path(path).stat().st_mtime_ns)
        assert Path(path).read_bytes() == src.read_bytes()
    assert len(set(sources)) == 1, sources
    assert not Path(sources[0]).is_relative_to(tmp_path / "a") and not Path(sources[0]).is_relative_to(tmp_path / "b")
    assert len(set(stamps)) == 1, stamps
    assert {kw["name"] for kw in seen} == {N.extension_name()}


def test_source_copy_never_follows_a_symlink_nor_replaces_a_foreign_file(tmp_path, monkeypatch):
    """The source copy is a write of the server side: a symlink planted at its name is not followed (the file it
    points to is untouched) and a file that is not a kernel source is not replaced; both are refused by name."""
    from torch.utils import cpp_extension

    from ditkit.errors import DitKitError

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    name = N.extension_name()
    d = tmp_path / "ext" / "ditkit_sources"
    d.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not yours\n")
    (d / f"{name}.cpp").symlink_to(victim)
    with pytest.raises(DitKitError, match="not a regular file"):
        N.stable_source(name, cpp_extension)
    assert victim.read_bytes() == b"not yours\n"
    (d / f"{name}.cpp").unlink()
    (d / f"{name}.cpp").write_bytes(b"someone else's file\n")
    with pytest.raises(DitKitError, match="never replaces"):
        N.stable_source(name, cpp_extension)
    assert (d / f"{name}.cpp").read_bytes() == b"someone else's file\n"
    # a stale copy of a kernel source (same first line, other bytes) is replaced atomically by the current one
    stale = N.SOURCE.read_bytes().split(b"\n", 1)[0] + b"\n// older kernel\n"
    (d / f"{name}.cpp").write_bytes(stale)
    path = N.stable_source(name, cpp_extension)
    assert path == d / f"{name}.cpp" and path.read_bytes() == N.SOURCE.read_bytes()
