"""The jobs, faults and observers the health benchmarks share.

- :func:`corpus` and :func:`job_config`: ms-train's small test model over byte shards
  of two standard-library modules, as the fault tests train it;
- :class:`TorchrunJob`: the baseline, one ``torch.distributed.run`` agent per simulated
  node, running the same rank code as ms-health's job
  (``ms_testing.faulty_train.HealthJob``), so that both take the same faults;
- :func:`signal_fault` and :func:`file_fault`: a fault from outside (SIGKILL, SIGSTOP)
  or through the ranks' fault folder (``MS_FAULTS_DIR``: nan, slow), and
  :func:`taken`, when and at which step a rank took a file fault;
- :class:`LogTail`: the launchers' output, each line stamped with the wall time it was
  first read (the ``resumed from step`` lines carry no time of their own), and the
  elastic agent's own log lines, which do (torchrun's "closing signal" lines);
- :class:`DriverView`: the driver's ``GET /ranks``, polled (each rank's newest
  heartbeat: pid, restart round, phase, when it was sent);
- :func:`start_wall` and :func:`left_behind`: the job's processes from ``/proc``.

Every time here is wall clock (``time.time()``), as the driver stamps its events.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ms_data import build_shards
from ms_data.build import BuildConfig
from ms_testing.faulty_train import MODULE, Job
from ms_testing.jobs import tag_env, tagged_processes
from ms_testing.train import write_train_config

__all__ = [
    "RESUMED",
    "DriverView",
    "LogTail",
    "TorchrunJob",
    "corpus",
    "file_fault",
    "free_port",
    "job_config",
    "left_behind",
    "read_events",
    "signal_fault",
    "start_wall",
    "taken",
]

RESUMED = re.compile(r"checkpoint: resumed from step (\d+) under")
#: torch.distributed.elastic's log lines: ``W1126 06:14:45.223000 30324 torch/...] msg``
#: (local time, no year).
ELASTIC = re.compile(
    r"^([IWE])(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) \d+ (torch/distributed/elastic/\S+)\] (.*)$"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def corpus(root: Path) -> Path:
    """Byte shards of two standard-library modules (what the fault tests train on)."""
    import argparse
    import textwrap

    out = root / "shards"
    build_shards(
        [argparse.__file__, textwrap.__file__], out, BuildConfig(tokenizer="bytes"), progress=False
    )
    return out


def job_config(
    root: Path,
    shards: Path,
    *,
    width: int,
    ranks: int,
    every: int,
    log_every: int,
    keep_all: bool = False,
) -> Path:
    """``root/run.toml`` for a run under ``root/run`` that never finishes: the global
    batch ``width // 4`` split over ``ranks`` (micro-batch ``width // 4 // ranks``), a
    checkpoint every ``every`` steps; ``keep_all``: retention off (``keep_last`` 10**6),
    so that every committed step must still be there at the end."""
    global_batch = width // 4
    if global_batch % ranks:
        raise ValueError(f"width // 4 = {global_batch} must be a multiple of ranks={ranks}")
    path = write_train_config(
        root / "run.toml",
        shards=shards,
        out_dir=root / "run",
        steps=10**7,
        every=every,
        width=width,
        micro_batch=global_batch // ranks,
        log_every=log_every,
    )
    if keep_all:
        # write_train_config ends with the [checkpoint] table.
        path.write_text(path.read_text() + "keep_last = 1000000\n")
    return path


class TorchrunJob(Job):
    """``nnodes`` ``torch.distributed.run`` agents on localhost (``--max-restarts``,
    c10d rendezvous), each running ``nproc`` ranks of ``ms_testing.faulty_train``
    (plain ms-train ranks that also take file faults); no ms-health. The interface is
    the part of ``HealthJob`` the benchmarks use."""

    def __init__(
        self,
        folder: Path,
        config: Path,
        out_dir: Path,
        *,
        nnodes: int,
        nproc: int,
        max_restarts: int = 3,
        env: dict[str, str] | None = None,
    ) -> None:
        self.out = out_dir
        self.tag = f"torchrun-{uuid.uuid4().hex[:8]}"
        port, run_id = free_port(), uuid.uuid4().hex[:12]
        full = {**tag_env(self.tag), "OMP_NUM_THREADS": "1", **(env or {})}
        # ms-train's launcher sets this too: without a store per rendezvous round, a
        # restarted round's gloo ranks on 2 nodes find the old round's addresses.
        full["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            full.pop(name, None)
        self.logs = [folder / f"node{i}.log" for i in range(nnodes)]
        self.launchers: list[subprocess.Popen[bytes]] = []
        for log in self.logs:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}"]
            cmd += [f"--nproc-per-node={nproc}", "--rdzv-backend=c10d"]
            cmd += [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}"]
            cmd += [f"--max-restarts={max_restarts}", "--monitor-interval=0.1"]
            # faulty_train runs the rank itself when WORLD_SIZE is set (the node
            # arguments are unused then).
            cmd += ["-m", MODULE, str(config), "{}"]
            with open(log, "wb") as out:
                self.launchers.append(
                    subprocess.Popen(
                        cmd, env=full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )


# ---------------------------------------------------------------------- faults


def signal_fault(kind: str, pid: int) -> float:
    """SIGKILL (``kill``) or SIGSTOP (``hang``) ``pid``; the wall time just before."""
    sig = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}[kind]
    t = time.time()
    os.kill(pid, sig)
    return t


def file_fault(folder: Path, name: str, kind: str, rank: int, **spec: Any) -> Path:
    """Drop a fault for ``rank`` into the job's fault folder (written aside, then
    renamed, so that a rank never reads half of it); the path its ``.taken`` will have."""
    folder.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"kind": kind, "rank": rank, **spec})
    tmp = folder / f".{name}.tmp"
    tmp.write_text(body)
    path = folder / f"{name}.json"
    os.replace(tmp, path)
    return Path(f"{path}.taken")


def taken(path: Path) -> dict[str, Any] | None:
    """A taken fault: ``wall`` (the file's modification time: the rank wrote it just
    before applying the fault), ``step`` (the step it was applied at: that step's loss
    is the NaN, or that step is the first slow one) and ``pid``; None while not taken
    (or being written)."""
    try:
        body = json.loads(path.read_text())
        wall = path.stat().st_mtime
    except (OSError, ValueError):
        return None
    if "step" not in body:
        return None
    return {"wall": wall, "step": int(body["step"]), "pid": body.get("pid")}


# ---------------------------------------------------------------------- logs, events


def read_events(out_dir: Path) -> list[dict[str, Any]]:
    """The driver's events (``<out>/health/events.jsonl``), a torn last line left out."""
    path = out_dir / "health" / "events.jsonl"
    events = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def _elastic_wall(m: re.Match[str], now: float) -> float:
    """The wall time of an elastic log line (local time, the year of ``now``; a line
    dated after ``now`` belongs to the year before)."""
    month, day, hh, mm, ss, frac = (m.group(i) for i in range(2, 8))
    year = datetime.datetime.fromtimestamp(now).year
    stamp = datetime.datetime(year, int(month), int(day), int(hh), int(mm), int(ss))
    t = stamp.timestamp() + float(f"0.{frac}")
    if t > now + 86400:
        t = stamp.replace(year=year - 1).timestamp() + float(f"0.{frac}")
    return t


@dataclass
class LogTail:
    """New lines of growing log files; keeps the lines that matter, stamped."""

    paths: list[Path]
    #: (wall time first read, file name, step) of each ``resumed from step`` line.
    resumed: list[tuple[float, str, int]] = field(default_factory=list)
    #: (wall time the line carries, file name, text) of the elastic agent's lines.
    elastic: list[tuple[float, str, str]] = field(default_factory=list)
    _offsets: dict[Path, int] = field(default_factory=dict)
    _partial: dict[Path, bytes] = field(default_factory=dict)

    def poll(self) -> None:
        for path in self.paths:
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            now = time.time()
            self._offsets[path] = self._offsets.get(path, 0) + len(chunk)
            lines = (self._partial.get(path, b"") + chunk).split(b"\n")
            self._partial[path] = lines.pop()
            for raw in lines:
                line = raw.decode("utf-8", "replace").rstrip("\r")
                if (m := RESUMED.search(line)) is not None:
                    self.resumed.append((now, path.name, int(m.group(1))))
                elif (e := ELASTIC.match(line)) is not None:
                    self.elastic.append((_elastic_wall(e, now), path.name, e.group(9)))

    def text(self, limit: int = 60000) -> dict[str, str]:
        """The end of each file, for the record of a trial that went wrong."""
        out = {}
        for path in self.paths:
            with contextlib.suppress(OSError):
                out[path.name] = path.read_text("utf-8", "replace")[-limit:]
        return out


class DriverView:
    """``GET /ranks`` of a driver whose token ``<out>/health/token`` holds; for each
    (rank, pid), the ``sent_at`` of the first heartbeat seen and of the first in phase
    ``train`` (the first beat of a process comes once its model is built; phase
    ``train`` once the checkpoint is loaded). With ``keep``, also every heartbeat seen
    (:attr:`heartbeats`, each once), and :attr:`missed`, the ones a poll did not see
    (a rank beat twice between two polls: each process numbers its heartbeats)."""

    def __init__(self, url: str, out_dir: Path, *, keep: bool = False) -> None:
        self.url = url.rstrip("/")
        self.token_path = out_dir / "health" / "token"
        self._token: str | None = None
        #: (rank, pid) -> {"restart", "first_beat", "first_train"} (sender wall times).
        self.processes: dict[tuple[int, int], dict[str, Any]] = {}
        self.failures = 0
        self.keep = keep
        #: Every heartbeat seen, as the driver serves it (``keep``), oldest first.
        self.heartbeats: list[dict[str, Any]] = []
        self.missed = 0
        self._last_seq: dict[tuple[int, int], int] = {}

    def poll(self) -> None:
        if self._token is None:
            try:
                self._token = str(json.loads(self.token_path.read_text())["token"])
            except (OSError, ValueError, KeyError):
                return
        req = urllib.request.Request(
            f"{self.url}/ranks", headers={"Authorization": f"Bearer {self._token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=1.0) as resp:
                ranks = json.loads(resp.read())["ranks"]
        except (OSError, ValueError, KeyError):
            self.failures += 1
            return
        for entry in ranks:
            rec = entry.get("record")
            if not rec:
                continue
            key = (int(rec["rank"]), int(rec["pid"]))
            seen = self.processes.setdefault(
                key, {"restart": rec.get("restart"), "first_beat": rec.get("sent_at")}
            )
            if rec.get("phase") == "train" and "first_train" not in seen:
                seen["first_train"] = rec.get("sent_at")
            seq, last = int(rec["seq"]), self._last_seq.get(key)
            if self.keep and seq != last:
                if last is not None and seq > last + 1:
                    self.missed += seq - last - 1
                self._last_seq[key] = seq
                self.heartbeats.append(rec)


# ---------------------------------------------------------------------- processes

_BOOT: float | None = None


def start_wall(pid: int) -> float | None:
    """When process ``pid`` started, wall clock (10 ms ticks), or None if gone."""
    global _BOOT
    if _BOOT is None:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                _BOOT = float(line.split()[1])
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    assert _BOOT is not None
    return _BOOT + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, str] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0]


def left_behind(tag: str, launchers: list[int]) -> list[dict[str, Any]]:
    """The job's processes that nobody will end: alive (not zombies) but no longer
    descended from a live launcher (orphans, adopted by init or a subreaper), or
    stopped (state T: a SIGSTOPped rank its launcher did not end)."""
    live_launchers = {p for p in launchers if _stat(p) is not None}
    found = []
    for pid, cmd in tagged_processes(tag).items():
        st = _stat(pid)
        if st is None or pid in live_launchers:
            continue
        ancestor, attached, hops = st[0], False, 0
        while ancestor > 1 and hops < 64:
            if ancestor in live_launchers:
                attached = True
                break
            up = _stat(ancestor)
            if up is None:
                break
            ancestor, hops = up[0], hops + 1
        if not attached or st[1] == "T":
            found.append({"pid": pid, "state": st[1], "orphan": not attached, "cmd": cmd[:200]})
    return found
