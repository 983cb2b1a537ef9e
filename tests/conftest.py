"""Shared pytest fixtures.

* ``comfyui_path``: the real ComfyUI host: ``COMFYUI_PATH``, else ditkit's cached host
  (``python -m ditkit.host setup``); tests that need it skip with a clear reason when there is none.
* ``import ditkit`` always means this checkout (see ``_import_this_checkout_as_ditkit``).
* Tests marked ``slow`` skip unless ``DITKIT_SLOW=1``.
* ``comfy``: ComfyUI imported in-process on CPU (``args.cpu = True`` before ``comfy.model_management``), for
  node-level tests that call ``Node.execute`` directly. Skips when ComfyUI or its requirements are missing
  from this interpreter (run the suite with the ComfyUI venv's python to enable it).
* ``tiny_ckpts``: the deterministic tiny checkpoints (``python -m ditkit.tiny.checkpoints``), generated
  once per session into a temp dir.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _import_this_checkout_as_ditkit() -> None:
    """Make ``import ditkit`` mean *this* checkout, in this process and in every subprocess a test starts, without
    ever putting the checkout's own folder on ``sys.path``.

    The repository root is the package, so the root on ``sys.path`` would make ``nodes`` (ComfyUI's own module
    name), ``kernels`` or ``vae`` top-level names (``python -m pytest`` puts the current folder there: it is
    removed). Instead a view folder holds exactly three links, ``ditkit`` -> the checkout, ``tests`` and
    ``benchmarks``, and goes first on ``sys.path`` and ``PYTHONPATH``: a ``ditkit`` installed from another checkout
    (a host venv's editable install, a CI clone next to a developer tree) would otherwise be tested instead,
    silently. The session fails at once if the import still resolves elsewhere.
    """
    import tempfile

    view = Path(tempfile.gettempdir()) / f"ditkit-view-{os.getuid()}-{abs(hash(str(REPO))) % 10**10}"
    view.mkdir(exist_ok=True)
    for name, target in (("ditkit", REPO), ("tests", REPO / "tests"), ("benchmarks", REPO / "benchmarks")):
        link = view / name
        if not (link.is_symlink() and Path(os.readlink(link)) == target):
            tmp = view / f".{name}.{os.getpid()}"
            os.symlink(target, tmp, target_is_directory=True)
            os.replace(tmp, link)
    sys.path[:] = [str(view)] + [p for p in sys.path if Path(os.path.abspath(p or ".")) != REPO]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(view)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and Path(os.path.abspath(p)) != REPO])
    # a checkout whose folder is named `ditkit` (a plain clone, mutation testing's staged copy) has this very file
    # imported by pytest as `ditkit.tests.conftest`: pytest looks that name up right after this runs, so it stays
    for name in [m for m in sys.modules if (m == "ditkit" or m.startswith("ditkit."))
                 and not (m == "ditkit.tests" or m.startswith("ditkit.tests."))]:
        del sys.modules[name]
    import ditkit

    where = Path(ditkit.__file__).resolve().parent
    if where != REPO:
        raise RuntimeError(f"`import ditkit` resolves to {where}, not the checkout under test ({REPO})")


_import_this_checkout_as_ditkit()


def _drop_the_checkout_from_sys_path() -> None:
    """pytest's default import mode puts a package's root folder on ``sys.path`` when it sets the package up (the
    checkout itself when its folder name is not an identifier, e.g. ``ComfyUI-ditkit``): taken off again before any
    fixture or test runs (the autouse fixtures below), so ``nodes`` is always ComfyUI's."""
    sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")) != REPO]


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _no_checkout_on_sys_path_session():
    """Session-scoped autouse: set up before any other session fixture (``comfy`` imports ComfyUI's ``nodes``)."""
    _drop_the_checkout_from_sys_path()


@pytest.fixture(autouse=True)
def _no_checkout_on_sys_path():
    _drop_the_checkout_from_sys_path()

# Without a GPU the Triton kernels are tested through the Triton interpreter. The flag must be set before
# triton is first imported, so it is set here (pytest imports this file before any test module).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _host():
    """COMFYUI_PATH, else ditkit's cached host (``python -m ditkit.host setup``); None when neither exists."""
    from ditkit.host import find_host

    return find_host()


HOST = _host()


def _comfyui_path() -> Path | None:
    return HOST.root.resolve() if HOST is not None and HOST.usable else None


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (soak, long lab runs) run only with ``DITKIT_SLOW=1``, so the default run, CI's
    included, stays short; the skip reason says how to run them."""
    if os.environ.get("DITKIT_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="marked slow (soak / long run): set DITKIT_SLOW=1 to run it")
    for it in items:
        if "slow" in it.keywords:
            it.add_marker(skip)


def pytest_report_header(config):
    if HOST is None:
        return "ditkit host: none (COMFYUI_PATH unset, no cached host): integration tests skip"
    return f"ditkit host: {HOST.describe()}" + ("" if HOST.usable else " -- NOT usable: " + "; ".join(HOST.problems))


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    path = _comfyui_path()
    if path is None:
        why = ("COMFYUI_PATH is unset and there is no cached host (python -m ditkit.host setup)" if HOST is None
               else f"{HOST.root} ({HOST.origin}) is not usable: " + "; ".join(HOST.problems))
        pytest.skip(f"needs a real ComfyUI host: {why}")
    return path


@pytest.fixture(scope="session")
def comfy(comfyui_path):
    """ComfyUI modules imported in this process, CPU only."""
    if str(comfyui_path) not in sys.path:
        sys.path.insert(0, str(comfyui_path))
    try:
        from comfy.cli_args import args

        args.cpu = True
        import comfy.model_management  # noqa: F401
        import comfy.sd  # noqa: F401
        import comfy.utils  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"ComfyUI at {comfyui_path} is not importable from this interpreter ({type(e).__name__}: {e}); "
                    "run pytest with the ComfyUI venv's python")
    import comfy as comfy_pkg

    return comfy_pkg


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> Path:
    from ditkit.tiny.checkpoints import generate_all

    out = tmp_path_factory.mktemp("tiny_ckpts")
    generate_all(out)
    return out
