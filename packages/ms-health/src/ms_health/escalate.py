"""End one process for sure: dump its stacks, SIGTERM, SIGKILL, each wait bounded.

A rank found hung or faulty must be gone before its peers can be restarted, whatever
state it is in: a rank in a collective answers SIGTERM by saving and exiting (ms-train
does), one that is SIGSTOPped or holds the GIL in a C loop never runs its handler, and
only SIGKILL ends it. :func:`escalate` walks that ladder on a pid of this machine and
says which step ended the process, with what it saw on the way.

The dump step is a signal too: a process that registered ``faulthandler`` for
``dump_signal`` (see :func:`install_dump_handler`, which ms-train's ranks call) writes
every thread's Python stack from the signal handler itself, without the GIL, so even a
process spinning in C with the GIL held answers. A stopped process cannot; its dump is
empty, and that is evidence too.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Literal

import attrs

__all__ = [
    "DUMP_SIGNAL",
    "Escalation",
    "escalate",
    "install_dump_handler",
    "process_state",
    "request_dump",
]

#: The signal that asks a process for its stacks (faulthandler's, not Python's handler).
DUMP_SIGNAL = signal.SIGUSR1

Outcome = Literal["gone", "exited", "terminated", "killed", "survived"]

# Process states of a stopped process (job control, or a tracer's stop).
_STOPPED = ("T", "t")

# How often the ladder looks at the process while it waits.
_POLL_S = 0.02


@attrs.frozen
class Escalation:
    """What :func:`escalate` did to one process."""

    pid: int
    #: ``gone``: not there when asked; ``exited``: ended before any signal but the
    #: dump; ``terminated``: ended after SIGTERM; ``killed``: after SIGKILL;
    #: ``survived``: still there after SIGKILL's wait (a process in uninterruptible
    #: sleep, or not ours to signal).
    outcome: Outcome
    #: The process state letter seen first (``R``, ``S``, ``T`` for stopped, ...).
    state: str | None
    #: Each step taken, ``(name, seconds since the start)``.
    steps: tuple[tuple[str, float], ...]
    #: What the dump step got (empty when the process could not answer, or no dump
    #: file was given).
    dump: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "outcome": self.outcome,
            "state": self.state,
            "steps": [list(s) for s in self.steps],
            "dump": self.dump,
            "seconds": self.seconds,
        }


def install_dump_handler(path: str | os.PathLike[str], sig: int = DUMP_SIGNAL) -> IO[str]:
    """In the process to be watched: write every thread's stack to ``path`` on ``sig``.

    Returns the open file, which must stay open for the process's life (faulthandler
    writes to its descriptor from the signal handler). Each dump is appended.
    """
    handle = open(path, "a")  # noqa: SIM115 - held open on purpose, see above
    faulthandler.register(sig, file=handle, all_threads=True, chain=False)
    return handle


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` from /proc (``R``, ``S``, ``D``, ``T``, ``Z``, ...), or
    None when there is no such process. A zombie has ended: only its parent's wait is
    missing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0] if fields else None


def _alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def escalate(
    pid: int,
    *,
    dump_file: str | os.PathLike[str] | None = None,
    dump_timeout_s: float = 2.0,
    term_timeout_s: float = 10.0,
    kill_timeout_s: float = 5.0,
    dump_signal: int = DUMP_SIGNAL,
    on_step: Callable[[str, float], None] | None = None,
) -> Escalation:
    """Dump (when ``dump_file`` is given), SIGTERM, then SIGKILL ``pid``, moving on when a
    step's wait runs out; returns as soon as the process is gone. A stopped process
    (state ``T``) gets SIGKILL at once: it could neither dump nor handle SIGTERM.

    Args:
        pid: a process of this machine that this process may signal.
        dump_file: where the process's faulthandler writes on ``dump_signal`` (see
            :func:`install_dump_handler`); None skips the dump.
        dump_timeout_s: how long to wait for the dump to grow.
        term_timeout_s: how long SIGTERM gets (a rank saving its checkpoint needs a
            while).
        kill_timeout_s: how long SIGKILL gets before the outcome is ``survived``.
        on_step: called with ``(step, seconds)`` as each step is taken, for the event log.
    """
    for name, value in (
        ("dump_timeout_s", dump_timeout_s),
        ("term_timeout_s", term_timeout_s),
        ("kill_timeout_s", kill_timeout_s),
    ):
        if not (isinstance(value, (int, float)) and value >= 0):
            raise ValueError(f"{name} must be a number >= 0 seconds, got {value!r}")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        raise ValueError(f"pid must be an int > 1, got {pid!r}")
    if pid == os.getpid():
        raise ValueError(f"pid {pid} is this process")
    start = time.monotonic()
    steps: list[tuple[str, float]] = []
    state = process_state(pid)

    def step(name: str) -> None:
        t = time.monotonic() - start
        steps.append((name, round(t, 4)))
        if on_step is not None:
            on_step(name, t)

    def result(outcome: Outcome, dump: str = "") -> Escalation:
        return Escalation(
            pid, outcome, state, tuple(steps), dump, round(time.monotonic() - start, 4)
        )

    if not _alive(pid):
        return result("gone")
    ladder: list[tuple[int, Outcome, float]] = [
        (signal.SIGTERM, "terminated", term_timeout_s),
        (signal.SIGKILL, "killed", kill_timeout_s),
    ]
    dump = ""
    if state in _STOPPED:
        # A stopped process runs no handler: its dump never comes, and SIGTERM waits
        # pending until it is continued. Only SIGKILL acts on it, at once.
        ladder = ladder[1:]
    elif dump_file is not None:
        step("dump")
        dump = request_dump(pid, dump_file, timeout_s=dump_timeout_s, sig=dump_signal)
        if not _alive(pid):
            return result("exited", dump)
    for sig, outcome, wait in ladder:
        step(signal.Signals(sig).name)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return result("exited", dump)
        except PermissionError:
            step("not permitted")
            return result("survived", dump)
        if _wait_gone(pid, wait):
            return result(outcome, dump)
    return result("survived", dump)


def request_dump(
    pid: int,
    dump_file: str | os.PathLike[str],
    *,
    timeout_s: float = 2.0,
    sig: int = DUMP_SIGNAL,
) -> str:
    """Signal ``pid`` for its stacks and return what it appended to ``dump_file`` within
    ``timeout_s`` (empty: it could not answer, as a stopped process cannot). The
    process is left running."""
    if not (isinstance(timeout_s, (int, float)) and timeout_s >= 0):
        raise ValueError(f"timeout_s must be a number >= 0 seconds, got {timeout_s!r}")
    path = Path(dump_file)
    try:
        before = path.stat().st_size
    except OSError:
        before = 0
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return ""
    deadline = time.monotonic() + timeout_s
    size, settled_at = before, None
    while time.monotonic() < deadline:
        try:
            now = path.stat().st_size
        except OSError:
            now = before
        if now > size:
            size, settled_at = now, time.monotonic()
        elif settled_at is not None and time.monotonic() - settled_at > 0.1:
            break  # the dump stopped growing: it is complete
        if not _alive(pid):
            break
        time.sleep(_POLL_S)
    if size <= before:
        return ""
    with open(path, "rb") as f:
        f.seek(before)
        return f.read(size - before).decode(errors="replace")


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if not _alive(pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
