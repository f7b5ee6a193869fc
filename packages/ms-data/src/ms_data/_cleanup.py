"""Unlink this process's shared-memory segments when SIGINT or SIGTERM arrives.

Normal exit is covered by ``weakref.finalize`` (it runs at interpreter exit); a
signal is not: SIGTERM's default action kills the process without running atexit,
and Ctrl-C raises KeyboardInterrupt wherever the main thread happens to be. The
handler runs every registered cleanup, then hands the signal on to whatever was
installed before (Python's KeyboardInterrupt, a framework's handler, or the default
action, re-raised with the default disposition so that the exit status still says
which signal it was). Handlers are only installed from the main thread (Python's
rule) and are put back once no segment is left.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["on_signal", "remove"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Re-entrant: the handler may interrupt the main thread inside on_signal or remove.
_lock = threading.RLock()
_cleanups: dict[int, Callable[[], None]] = {}
_previous: dict[int, Any] = {}
_keys = itertools.count()


def on_signal(cleanup: Callable[[], None]) -> int:
    """Run ``cleanup`` (fast, no waiting) on SIGINT/SIGTERM; return a key for :func:`remove`."""
    with _lock:
        key = next(_keys)
        _cleanups[key] = cleanup
        if not _previous and threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                _previous[sig] = signal.getsignal(sig)
                signal.signal(sig, _handler)
    return key


def remove(key: int) -> None:
    with _lock:
        _cleanups.pop(key, None)
        if _cleanups or not _previous:
            return
        if threading.current_thread() is not threading.main_thread():
            return  # put back later, by whoever removes the last one from the main thread
        for sig, prev in _previous.items():
            # Someone installed their own handler after ours: leave theirs alone.
            if signal.getsignal(sig) is _handler:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        _previous.clear()


def _handler(signum: int, frame: FrameType | None) -> None:
    prev = _previous.get(signum, signal.SIG_DFL)
    with _lock:
        cleanups = list(_cleanups.values())
    for cleanup in cleanups:
        with contextlib.suppress(Exception):  # the signal must still be delivered
            cleanup()
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_IGN:
        return
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
