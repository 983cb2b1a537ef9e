"""Shows the cpu_native kernel build on the graph: the first sampling with ``backend = cpu_native`` compiles a C++
extension (about a minute, once per machine and kernel source), during which the sampler seems to hang. The
kernel module calls :data:`BUILD_HOOKS` (``kernels/block_sparse_cpu_native.py``, plain torch); this hook sends the
message as progress text to the node that is executing (the sampler waiting for the build) and logs it."""
from __future__ import annotations

import logging

from ..kernels import block_sparse_cpu_native as native
from ..bridge.reports import _executing, send_progress_text

log = logging.getLogger("ditkit")


def show_build(event: str, message: str) -> None:
    _pid, node = _executing()
    log.info("[ditkit] %s", message)
    if node is None:
        return
    send_progress_text(message, str(node))


def install() -> None:
    if show_build not in native.BUILD_HOOKS:
        native.BUILD_HOOKS.append(show_build)


install()
