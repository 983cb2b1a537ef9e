"""FastVideo's own top-k kernel as a test oracle, loaded from the fastvideo-kernel 0.3.5 sdist (nothing vendored).

``fastvideo-kernel`` is an sdist that builds CUDA/C++ extensions (torch==2.12 as a build requirement), so it is
never installed. Its ``triton_kernels/fused_compress_topk.py`` imports only torch and triton, and runs under
``TRITON_INTERPRET=1`` on CPU. The tests load that one file from a test-time cache directory and skip, with the
reason, when it is not there:

* cache: ``$DITKIT_TEST_REFS`` (default ``~/.cache/ditkit/test-refs``) holding ``fastvideo_kernel-0.3.5.tar.gz``
  (PyPI's sdist, sha256 pinned below), or the file already extracted from it (sha256 pinned too);
* fill it once (CI: ``.ci/run`` does this before the tests; set ``DITKIT_CI_NO_REFS=1`` to skip)::

      python tests/unit/_fastvideo_ref.py fetch

  which runs ``pip download --no-deps --no-binary :all: --no-build-isolation fastvideo-kernel==0.3.5`` from a
  throwaway venv holding only scikit-build-core and cmake: pip prepares an sdist's metadata before it saves it,
  and with build isolation that would install the package's pinned torch build requirement. Nothing is built
  or installed into the test environment; only the one .py member is read out of the archive.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import venv
from pathlib import Path

PACKAGE = "fastvideo-kernel"
VERSION = "0.3.5"
SDIST = f"fastvideo_kernel-{VERSION}.tar.gz"
SDIST_SHA256 = "f2c865cde78d6b218ca4f8695cad96464d79d73f144f142f51bba0920976dcb4"
MEMBER = f"fastvideo_kernel-{VERSION}/python/fastvideo_kernel/triton_kernels/fused_compress_topk.py"
MEMBER_SHA256 = "0d9f203cbd8961b8bca2c50435f0c570ad1bf09ab453c76fd2e4b9933f01b9a9"


def refs_dir() -> Path:
    return Path(os.environ.get("DITKIT_TEST_REFS") or Path.home() / ".cache" / "ditkit" / "test-refs")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _extracted() -> Path:
    return refs_dir() / f"fastvideo_kernel-{VERSION}" / "fused_compress_topk.py"


def member_file() -> Path:
    """Path of the verified ``fused_compress_topk.py``; raises LookupError with the reason when unavailable."""
    out = _extracted()
    if out.is_file() and _sha256(out.read_bytes()) == MEMBER_SHA256:
        return out
    sdist = refs_dir() / SDIST
    if not sdist.is_file():
        raise LookupError(f"{SDIST} is not in {refs_dir()} (fill it with `python tests/unit/_fastvideo_ref.py "
                          "fetch`, or set DITKIT_TEST_REFS)")
    blob = sdist.read_bytes()
    if _sha256(blob) != SDIST_SHA256:
        raise LookupError(f"{sdist} has sha256 {_sha256(blob)}, not PyPI's {SDIST_SHA256}")
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tf:
        try:
            f = tf.extractfile(MEMBER)
        except KeyError as e:
            raise LookupError(f"{sdist} has no {MEMBER}") from e
        data = f.read() if f is not None else b""
    if _sha256(data) != MEMBER_SHA256:
        raise LookupError(f"{MEMBER} in {sdist} has sha256 {_sha256(data)}, expected {MEMBER_SHA256}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return out


_MODULE = {}


def load_fused_compress_topk():
    """FastVideo's ``fused_compress_topk`` module, or raise LookupError (no sdist, no triton, no interpreter)."""
    if "mod" in _MODULE:
        return _MODULE["mod"]
    if importlib.util.find_spec("triton") is None:
        raise LookupError("triton is not installed")
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise LookupError("no GPU and TRITON_INTERPRET is not 1: FastVideo's Triton kernel cannot run here")
    path = member_file()
    spec = importlib.util.spec_from_file_location("fastvideo_ref_fused_compress_topk", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _MODULE["mod"] = mod
    return mod


def fetch() -> Path:
    """Download the sdist into :func:`refs_dir` (see the module docstring) and extract the one file."""
    dest = refs_dir()
    dest.mkdir(parents=True, exist_ok=True)
    if not (dest / SDIST).is_file():
        with tempfile.TemporaryDirectory(prefix="ditkit-fvk-") as td:
            env_dir = Path(td) / "venv"
            venv.create(env_dir, with_pip=True)
            py = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
            subprocess.run([str(py), "-m", "pip", "install", "--quiet", "scikit-build-core", "cmake"], check=True)
            subprocess.run([str(py), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--no-build-isolation", f"{PACKAGE}=={VERSION}", "-d", str(dest)], check=True)
    return member_file()


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch"]:
        sys.exit("usage: python tests/unit/_fastvideo_ref.py fetch")
    try:
        print(f"fastvideo-kernel reference: {fetch()}")
    except (LookupError, subprocess.CalledProcessError, OSError) as e:
        sys.exit(f"fastvideo-kernel reference unavailable: {e}")
