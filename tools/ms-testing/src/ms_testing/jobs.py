"""Find what a job left behind: its processes and its shared-memory segments.

A job started with ``tag_env(tag)`` passes the tag to every process it starts (ranks,
loader readers, checkpoint writers, resource trackers inherit the environment), so its
processes are found by the tag in ``/proc/PID/environ`` whatever session or process
group they moved to. Linux only; reading another user's environ needs root or the same
user, which is what tests and benchmarks here run as.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

__all__ = [
    "SHM_PREFIXES",
    "TAG_ENV",
    "JobWatch",
    "process_starttime",
    "rank_processes",
    "segments_held",
    "shm_segments",
    "tag_env",
    "tagged_processes",
    "wait_gone",
]

#: The environment variable that carries a job's tag.
TAG_ENV = "MS_TESTING_JOB"

#: Name prefixes of the segments ms packages create in /dev/shm (ms-data's loader ring,
#: ms-ckpt's host buffer).
SHM_PREFIXES = ("ms_data_", "ms_ckpt_")


def tag_env(tag: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the job tag set."""
    return {**(os.environ if base is None else base), TAG_ENV: tag}


def tagged_processes(tag: str) -> dict[int, str]:
    """Live processes carrying ``tag``: pid -> command line (zombies count as gone)."""
    needle = f"{TAG_ENV}={tag}".encode()
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            found[int(proc.name)] = cmd.strip()
    return found


def wait_gone(tag: str, timeout: float) -> dict[int, str]:
    """Poll until no process carries ``tag`` or ``timeout`` seconds pass; the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = tagged_processes(tag)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def shm_segments(prefixes: tuple[str, ...] = SHM_PREFIXES) -> set[str]:
    """Names of the /dev/shm segments that start with one of ``prefixes``."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return {n for n in names if n.startswith(prefixes)}


def rank_processes(tag: str, module: str = "ms_train.cli") -> dict[int, list[int]]:
    """The job's ranks by global rank: rank -> pids of live processes carrying ``tag``
    that run ``module`` with ``RANK`` in their environment (a launcher has none; after a
    restart a rank may briefly have two, the old one dying).

    A child that a rank forks (a checkpoint writer or loader reader between its fork and
    its exec) briefly shows the rank's command line and environment; it is not counted,
    since its parent is the same rank."""
    found: dict[int, tuple[int, int]] = {}  # pid -> (rank, parent pid)
    for pid, cmd in tagged_processes(tag).items():
        if module not in cmd:
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        ranks = [int(v[5:]) for v in env if v.startswith(b"RANK=") and v[5:].isdigit()]
        if ranks:
            found[pid] = (ranks[0], parent)
    by_rank: dict[int, list[int]] = {}
    for pid, (rank, parent) in found.items():
        if parent not in found or found[parent][0] != rank:
            by_rank.setdefault(rank, []).append(pid)
    return {r: sorted(p) for r, p in sorted(by_rank.items())}


def _shm_name(path: str) -> str:
    """The segment name in a /proc maps or fd target path (an unlinked one carries
    " (deleted)")."""
    return path.split("/dev/shm/", 1)[1].split(" ")[0]


def segments_held(pids: set[int] | list[int]) -> set[str]:
    """The /dev/shm names that the processes ``pids`` map or hold open."""
    held: set[str] = set()
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        try:
            for line in (proc / "maps").read_text(errors="replace").splitlines():
                if "/dev/shm/" in line:
                    held.add(_shm_name(line))
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("/dev/shm/"):
                held.add(_shm_name(target))
    return held


def process_starttime(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot (field 22 of /proc/PID/stat), the
    number ms-ckpt puts in its segment names beside the pid; None if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class JobWatch:
    """Samples, on a thread every ``interval`` seconds, the processes carrying ``tag``
    and the /dev/shm segments they hold, so that segments left after the job can be told
    from those of other jobs on the machine (a test running beside, another soak):
    :meth:`owned` keeps the segments the job was seen holding, and ms-ckpt's host
    buffers named after one of its processes (``ms_ckpt_<ns>_<pid>_...``).

    Use as a context manager around the job's life; :meth:`sample` may also be called
    directly (just before killing the job, say). An error on the sampling thread is
    raised again by :meth:`owned` and on leaving the context, not lost."""

    def __init__(self, tag: str, interval: float = 0.1) -> None:
        self.tag, self.interval = tag, interval
        #: (pid, start time) of every process of the job seen so far.
        self.processes: set[tuple[int, int]] = set()
        self.segments: set[str] = set()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-watch", daemon=True)

    def __enter__(self) -> JobWatch:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if kind is None:  # else the body's own error is the one to see
            self._raise_thread_error()

    @property
    def pids(self) -> set[int]:
        with self._lock:
            return {pid for pid, _ in self.processes}

    def sample(self) -> None:
        pids = set(tagged_processes(self.tag))
        seen = {(pid, start) for pid in pids if (start := process_starttime(pid)) is not None}
        held = segments_held(pids)
        with self._lock:
            self.processes |= seen
            self.segments |= held

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.sample()
                self._stop.wait(self.interval)
        except BaseException as e:  # kept for the caller; the thread has no one to tell
            self._error = e

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"JobWatch({self.tag!r}) stopped sampling") from self._error

    def owned(self, names: set[str] | list[str]) -> list[str]:
        """Those of ``names`` that are the job's, sorted."""
        self._raise_thread_error()
        with self._lock:
            segments, processes = set(self.segments), set(self.processes)
        mine = []
        for name in names:
            # ms_ckpt_<pid namespace>_<pid>_<start time>_<random>
            parts = name.split("_")
            maker = None
            digits = len(parts) > 4 and parts[3].isdigit() and parts[4].isdigit()
            if name.startswith("ms_ckpt_") and digits:
                maker = (int(parts[3]), int(parts[4]))
            if name in segments or maker in processes:
                mine.append(name)
        return sorted(mine)
