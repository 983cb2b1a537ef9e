"""How ditkit's command-line tools end on Ctrl-C and SIGTERM: as one line, after their cleanup ran.

:func:`run_cli` runs a CLI's ``main``: SIGTERM is raised in the main thread as :class:`Terminated` (a
``BaseException``, like ``KeyboardInterrupt``), so every ``finally`` / ``except BaseException`` cleanup runs (temp
files removed, servers stopped); a second signal during that cleanup is ignored. The tool then prints one line to
stderr and exits 130 (Ctrl-C) or 143 (SIGTERM); never a traceback. (``host.py`` keeps its own copy: it is
standard-library Python run as a script before the pack is installed.)
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Callable


class Terminated(BaseException):
    """SIGTERM arrived (raised where the main thread was, so cleanup code runs)."""


def _on_signal(signum, frame):
    for s in (signal.SIGINT, signal.SIGTERM):  # the cleanup that follows is not interrupted again
        signal.signal(s, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated


def run_cli(main: Callable[..., int], argv=None, prog: str = "ditkit", cleanup: str = "") -> int:
    """``main(argv)`` with SIGINT / SIGTERM turned into one line and exit status 130 / 143; ``cleanup`` says what
    the tool's own cleanup did (e.g. "partial output removed")."""
    main_thread = threading.current_thread() is threading.main_thread()
    old = {}
    if main_thread:
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, _on_signal)
    try:
        return main(argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C)" + (f"; {cleanup}" if cleanup else ""), file=sys.stderr, flush=True)
        return 130
    except Terminated:
        print(f"{prog}: stopped by SIGTERM" + (f"; {cleanup}" if cleanup else ""), file=sys.stderr, flush=True)
        return 143
    finally:
        for s, h in old.items():
            signal.signal(s, h)
