"""Model-file names for ditkit's loaders: a loader lists exactly what it then loads.

Like the stock loaders (``folder_paths.get_full_path``: the name joined to each folder of the kind, ``isfile``), a
symlink the user placed inside a model folder is followed: it is the user's choice what the folder holds. What a
NAME cannot do is leave the folders by its path: absolute names, ``..`` components and NUL bytes are refused
before the file system is touched. The name is resolved once (``os.path.realpath``) and ditkit's safe reader opens
that path once and checks the opened file (``loaders/safetensors_io.py``: a regular file, header against its
size), so a FIFO or device placed there is refused instead of read.

Only ``.safetensors`` / ``.sft`` files are listed: ditkit never unpickles ``.ckpt`` / ``.pt`` / ``.bin`` files,
so listing them would only offer a choice that fails. Dangling symlinks and non-regular files are not listed.
"""
from __future__ import annotations

import os
import re
import stat

from ..bridge.files import filename_list, folder_roots
from ..errors import CheckpointError

SAFETENSORS_EXT = (".safetensors", ".sft")
_DRIVE = re.compile(r"^[A-Za-z]:")


def relative_name(name, node_id: str, folder: str) -> str:
    """``name`` as a relative path inside a model folder, or CheckpointError (nothing on disk is looked at)."""
    where = f"{node_id}: {name!r} is not a checkpoint name inside models/{folder}"
    if not isinstance(name, str) or not name.strip():
        raise CheckpointError(f"{where} (empty)")
    if "\x00" in name:
        raise CheckpointError(f"{where} (NUL byte)")
    parts = re.split(r"[\\/]", name) if os.name == "nt" else name.split("/")
    if name.startswith(("/", "\\")) or os.path.isabs(name) or _DRIVE.match(name):
        raise CheckpointError(f"{where}: absolute paths are refused (choose a name from the list)")
    if ".." in parts:
        raise CheckpointError(f"{where}: '..' components are refused (choose a name from the list)")
    return os.path.normpath(name)


def is_regular_file(path: str) -> bool:
    """``path`` (symlinks followed) is a regular file; False for dangling links, FIFOs, devices, directories."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def is_safetensors_name(name: str) -> bool:
    return name.lower().endswith(SAFETENSORS_EXT)


def safetensors_files(folder: str) -> list[str]:
    """The stock file list of ``folder`` restricted to what ditkit can load: ``.safetensors``/``.sft`` names that
    are regular files (through symlinks) in one of the folder's paths."""
    roots = folder_roots(folder)
    out = []
    for n in filename_list(folder):
        if is_safetensors_name(n) and any(is_regular_file(os.path.join(r, n)) for r in roots):
            out.append(n)
    return out


def find(folder: str, name: str, node_id: str, accept=is_regular_file) -> str | None:
    """Real path of the first ``<root>/<name>`` that ``accept`` takes, over the folder's paths; None if none."""
    rel = relative_name(name, node_id, folder)
    for root in folder_roots(folder):
        cand = os.path.join(root, rel)
        if accept(cand):
            return os.path.realpath(cand)
    return None


def safetensors_path(folder: str, name: str, node_id: str) -> str:
    """The file a listed ``name`` of ``folder`` means (resolved once), or CheckpointError naming it."""
    rel = relative_name(name, node_id, folder)
    if not is_safetensors_name(rel):
        raise CheckpointError(f"{node_id}: {name!r} is not a checkpoint ditkit reads: only .safetensors / .sft files "
                              "(ditkit never unpickles .ckpt/.pt/.bin files; convert it to safetensors)")
    path = find(folder, rel, node_id)
    if path is None:
        raise CheckpointError(f"{node_id}: {name!r} is not a checkpoint file in models/{folder}: it was not found "
                              f"as a regular file in {folder_roots(folder)} (a dangling link, FIFO "
                              "or device is not one); refresh the list or copy the file there")
    return path
