"""Read and check a workflow file before any server is involved (size, encoding, strict JSON, structure).

A file that fails here makes the runner exit 2 with one line, before a server is started or contacted.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable

from .. import strict_json
from ..errors import DitKitError
from .common import WorkflowFileError
from .workflows import check_ui_workflow, ui_to_api


def is_ui_format(wf: Any) -> bool:
    return isinstance(wf, dict) and isinstance(wf.get("nodes"), list) and "links" in wf


MAX_WORKFLOW_BYTES = 64 * 2**20
MAX_WORKFLOW_DEPTH = 64


def _name(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _read_workflow_bytes(p: Path) -> bytes:
    """The file's bytes, opened once (non-blocking, so a FIFO cannot hang the runner) and checked on the opened
    descriptor: a regular file of at most MAX_WORKFLOW_BYTES."""
    where = f"workflow file '{p}'"
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise WorkflowFileError(f"{where} does not exist") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise WorkflowFileError(f"{where} cannot be opened ({getattr(e, 'strerror', None) or e})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise WorkflowFileError(f"{where} is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise WorkflowFileError(f"{where} is not a regular file")
        if st.st_size > MAX_WORKFLOW_BYTES:
            raise WorkflowFileError(f"{where} is {st.st_size} bytes; the limit is {MAX_WORKFLOW_BYTES} bytes")
        chunks, n = [], 0
        while n <= MAX_WORKFLOW_BYTES:
            chunk = os.read(fd, min(1 << 20, MAX_WORKFLOW_BYTES + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > MAX_WORKFLOW_BYTES:
            raise WorkflowFileError(f"{where} grew past the limit of {MAX_WORKFLOW_BYTES} bytes while being read")
        return b"".join(chunks)
    except OSError as e:
        raise WorkflowFileError(f"{where} cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def _depth_over(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > limit:
                return True
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return False


def parse_workflow_json(data: bytes, where: str) -> Any:
    """Strict JSON (UTF-8, optional BOM; no NaN/Infinity, no duplicate keys, at most MAX_WORKFLOW_DEPTH levels)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise WorkflowFileError(f"{where} is not UTF-8 text (byte {e.start})") from None
    try:
        obj = strict_json.loads(text)   # duplicate keys / NaN / Infinity: ValueError naming them
    except RecursionError:
        raise WorkflowFileError(f"{where} is nested deeper than {MAX_WORKFLOW_DEPTH} levels") from None
    except ValueError as e:
        raise WorkflowFileError(f"{where} is not readable JSON ({' '.join(str(e).split())[:200]})") from None
    if _depth_over(obj, MAX_WORKFLOW_DEPTH):
        raise WorkflowFileError(f"{where} is nested deeper than {MAX_WORKFLOW_DEPTH} levels")
    return obj


def check_api_workflow(wf: dict, where: str) -> None:
    """API format: every node an object with a string ``class_type`` and an object ``inputs``; every link
    ``[node_id, slot]`` names a node of the graph (as a string) and a slot >= 0."""
    bad = [k for k, v in wf.items() if not (isinstance(v, dict) and isinstance(v.get("class_type"), str))]
    if bad:
        raise WorkflowFileError(f"{where}: entries {', '.join(_name(k) for k in bad[:5])} have no 'class_type' "
                                "(neither API format nor UI format)")
    for k, v in wf.items():
        inputs = v.get("inputs", {})
        if not isinstance(inputs, dict):
            raise WorkflowFileError(f"{where}: node {_name(k)} 'inputs' is a {type(inputs).__name__}; "
                                    "expected an object")
        for name, val in inputs.items():
            if not (isinstance(val, list) and len(val) == 2 and isinstance(val[1], int)
                    and not isinstance(val[1], bool)):
                continue
            src, slot = val
            if not isinstance(src, str):
                raise WorkflowFileError(f"{where}: node {_name(k)} input {_name(name)} links to {_name(src)}; a "
                                        "link names its source node by its id string, e.g. [\"4\", 0]")
            if src not in wf:
                raise WorkflowFileError(f"{where}: node {_name(k)} input {_name(name)} links to missing node "
                                        f"{_name(src)}")
            if slot < 0:
                raise WorkflowFileError(f"{where}: node {_name(k)} input {_name(name)} links to output slot {slot}")


def load_workflow_file(path) -> dict:
    """Read and check a workflow file before any server is involved; raises :class:`WorkflowFileError`."""
    p = Path(path)
    where = f"workflow file '{p}'"
    wf = parse_workflow_json(_read_workflow_bytes(p), where)
    if not isinstance(wf, dict):
        raise WorkflowFileError(f"{where}: expected a JSON object, got {type(wf).__name__}")
    if isinstance(wf.get("prompt"), dict) and not is_ui_format(wf):  # a saved /prompt body
        wf = wf["prompt"]
    if is_ui_format(wf):
        try:
            check_ui_workflow(wf)
        except DitKitError as e:
            raise WorkflowFileError(f"{where}: {e}") from None
    else:
        check_api_workflow(wf, where)
    return wf


def to_api(wf: dict, object_info: Callable[[], dict]) -> dict:
    """API-format graph of ``wf`` (UI-format workflows are converted with the server's node schemas)."""
    if not is_ui_format(wf):
        return wf
    return ui_to_api(wf, object_info())

