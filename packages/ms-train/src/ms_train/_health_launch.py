"""``ms-train --health``: the launcher's side of ms-health.

One launcher of the job hosts the driver (:class:`ms_health.Driver`, in a thread of
the launcher, with the default detectors and the :class:`ms_health.recovery.Recovery`
policy); every launcher runs a node agent (:class:`ms_health.agent.NodeAgent`) that
reports its node's ranks (its own child processes) and carries out the driver's
escalations on them. The ranks get the driver's address in their environment and send
heartbeats (``ms_train._health``). The restart after a fault is the elastic agent's
(``--max-restarts``, 3 by default with ``--health``).

Where the driver lives: on one node, the launcher's own, on a free loopback port.
With several nodes, ``--health-endpoint HOST:PORT``: the launcher that can bind it
hosts the driver, the others report to it (as c10d's rendezvous picks its host). The
token is random, written to ``<train.out_dir>/health/token`` (mode 0600) by the host
and read from there by the others (the out dir is shared by the nodes, as the
checkpoints are), or taken from ``MS_HEALTH_TOKEN`` when that is set. The driver's
events go to ``<train.out_dir>/health/events.jsonl`` and its learned state to
``driver-state.json`` beside it.

With ``--health-diagnose`` the recovery also tests the suspects' node after a crash or
hang (``ms_health.diagnostics``, with the floors ``--health-min-gflops`` and
``--health-min-gbps``); a host that fails goes on ``<train.out_dir>/health/
blocklist.json``. Every launcher watches that file: one listed during its launch stops
the job as SIGTERM would (the ranks save), since the job cannot go on without the node;
a launcher on a listed host refuses to start, saying how to clear it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from ms_train import _procs
from ms_train._health import INTERVAL_ENV
from ms_train.config import Config
from ms_train.errors import JobError

__all__ = ["HealthSide"]

#: Heartbeat interval (``MS_HEALTH_INTERVAL`` in the launcher's environment overrides):
#: the detectors are tuned to it. Steps much shorter than it are sampled, not all seen.
_INTERVAL_S = 0.5
_TOKEN_WAIT_S = 60.0


class HealthSide:
    """The driver (when this launcher hosts it) and this node's agent, for one launch."""

    def __init__(
        self,
        config: Config,
        run_id: str,
        *,
        endpoint: str | None,
        nnodes: int,
        diagnose: bool = False,
        min_flops: float | None = None,
        min_gbps: float | None = None,
    ) -> None:
        try:
            self.interval_s = float(os.environ.get(INTERVAL_ENV, _INTERVAL_S))
        except ValueError:
            self.interval_s = -1.0
        if not 0.01 <= self.interval_s <= 60:
            raise JobError(
                f"{INTERVAL_ENV} must be a number of seconds in [0.01, 60], got "
                f"{os.environ.get(INTERVAL_ENV)!r}"
            )
        self.folder = Path(config.train.out_dir) / "health"
        self.run_id = run_id
        self.endpoint = endpoint
        self.nnodes = nnodes
        self.diagnose = diagnose
        self.min_flops, self.min_gbps = min_flops, min_gbps
        self.blocklist_path = self.folder / "blocklist.json"
        self.blocklist: Any = None
        self.started_at = 0.0
        self._next_check = 0.0
        self.driver: Any = None
        self.agent: Any = None
        self.url = ""
        self._token = ""

    def start(self) -> dict[str, str]:
        """Start the driver (if this launcher hosts it) and the node agent; the
        environment the ranks need."""
        from ms_health.agent import NodeAgent

        self.folder.mkdir(parents=True, exist_ok=True)
        self._refuse_if_blocked()
        host, port = _parse(self.endpoint) if self.endpoint else ("127.0.0.1", 0)
        if self.nnodes > 1 and self.endpoint is None:
            raise JobError("--health with --nnodes > 1 needs --health-endpoint HOST:PORT")
        self.driver = self._host_driver(host, port)
        if self.driver is not None:
            self.url = self.driver.url
        else:
            self.url = f"http://{host}:{port}"
            self._token = self._read_token()
        node = f"{socket.gethostname()}/launcher-{os.getpid()}"
        dumps = self.folder / "dumps" / f"launcher-{os.getpid()}"
        dumps.mkdir(parents=True, exist_ok=True)
        ranks = _Ranks()
        self.agent = NodeAgent(
            self.url,
            self._token,
            job=self.run_id,
            node=node,
            workers=ranks.ranks,
            restart=ranks.restart_round,
            dump_dir=dumps,
            interval_s=self.interval_s,
            # SIGTERM lets a rank save; one whose peers are gone or that is hung cannot,
            # and the restart should not wait long for it.
            term_timeout_s=5.0,
            diagnostics=self._diagnostics(),
            driver=self.driver,  # in this process when this launcher hosts it
        ).start()
        return {
            "MS_HEALTH_URL": self.url,
            "MS_HEALTH_TOKEN": self._token,
            "MS_HEALTH_JOB": self.run_id,
            "MS_HEALTH_DUMP_DIR": str(dumps),
            INTERVAL_ENV: str(self.interval_s),
        }

    def stop(self) -> list[str]:
        """Stop the agent and the driver; one line per action the driver took."""
        if self.agent is not None:
            self.agent.stop()
        lines: list[str] = []
        if self.driver is not None:
            for event in self.driver.events():
                if event.kind in ("finding", "diagnosis", "rollback", "recovery"):
                    lines.append(f"ms-health: {event.message}")
            self.driver.stop()
        return lines

    def stop_reason(self) -> str | None:
        """Why the job must stop, if it must: a host was put on the blocklist during this
        launch (a node of this job failed its diagnostics; the job cannot go on with
        fewer nodes). Reads the file at most every 0.5 s."""
        now = time.monotonic()
        if self.blocklist is None or now < self._next_check:
            return None
        self._next_check = now + 0.5
        try:
            entries = self.blocklist.entries()
        except (OSError, ValueError):
            return None  # being replaced, or damaged: the driver's own write reports it
        for entry in entries:
            if entry.since >= self.started_at:
                return (
                    f"host {entry.node} was put on the blocklist ({entry.reason}); the job "
                    f"stops, and no launch starts there until `ms-health blocklist --file "
                    f"{self.blocklist_path} remove {entry.node}` clears it"
                )
        return None

    # ------------------------------------------------------------------ helpers

    def _refuse_if_blocked(self) -> None:
        from ms_health.blocklist import Blocklist, describe

        try:
            self.blocklist = Blocklist(self.blocklist_path)
            host = socket.gethostname()
            entry = self.blocklist.blocked(host)
        except (OSError, ValueError) as e:
            raise JobError(f"health blocklist {self.blocklist_path}: {e}") from e
        if entry is not None:
            raise JobError(
                f"this host is on the health blocklist {self.blocklist_path}: "
                f"{describe(entry)}; once it is repaired, clear it with `ms-health "
                f"blocklist --file {self.blocklist_path} remove {host}`"
            )
        self.started_at = time.time()

    def _diagnostics(self) -> Any:
        if self.min_flops is None and self.min_gbps is None:
            return None
        from ms_health.diagnostics.config import DiagnosticsConfig

        return DiagnosticsConfig(min_flops=self.min_flops, min_gbps=self.min_gbps)

    def _host_driver(self, host: str, port: int) -> Any:
        """A started driver, or None when another launcher already hosts it (the
        endpoint is in use)."""
        from ms_health.detectors import default_detectors
        from ms_health.driver import Driver
        from ms_health.recovery import Recovery

        if port and not _free(host, port):
            return None  # another launcher hosts it; don't touch its state or events
        token = os.environ.get("MS_HEALTH_TOKEN") or secrets.token_hex(16)
        state = self.folder / "driver-state.json"
        with contextlib.suppress(OSError, ValueError, AttributeError):
            # A state is the job's own (its ranks, restart rounds, what the detectors
            # learned); an earlier launch of this out dir was another job.
            if json.loads(state.read_text()).get("job") != self.run_id:
                state.unlink()
        driver = Driver(
            token,
            host=host,
            port=port,
            job=self.run_id,
            detectors=default_detectors(self.interval_s),
            state_path=state,
            events_path=self.folder / "events.jsonl",
        )
        driver.on_finding = Recovery(
            driver, diagnose=self.diagnose, blocklist=self.blocklist if self.diagnose else None
        )
        try:
            driver.start()
        except OSError as e:
            if e.errno != errno.EADDRINUSE or port == 0:
                raise
            return None
        self._token = token
        if not os.environ.get("MS_HEALTH_TOKEN"):
            path = self.folder / "token"
            fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"job": self.run_id, "token": token}, f)
            os.replace(path.with_suffix(".tmp"), path)
        return driver

    def _read_token(self) -> str:
        given = os.environ.get("MS_HEALTH_TOKEN")
        if given:
            return given
        path = self.folder / "token"
        deadline = time.monotonic() + _TOKEN_WAIT_S
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                body = json.loads(path.read_text())
                if body["job"] == self.run_id:
                    return str(body["token"])
            if time.monotonic() > deadline:
                raise JobError(
                    f"--health-endpoint {self.endpoint}: another launcher hosts the driver, "
                    f"but its token did not appear in {path} within {_TOKEN_WAIT_S:g} s (is "
                    "train.out_dir shared by the nodes? else set MS_HEALTH_TOKEN on each)"
                )
            time.sleep(0.1)


def _free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (the driver's own bind decides races)."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _parse(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise JobError(f"--health-endpoint must be HOST:PORT, got {endpoint!r}")
    return host, int(port)


class _Ranks:
    """This launcher's ranks (its children with a ``RANK``) and their restart round,
    from /proc, for the node agent, which asks at every report. A process's environment
    is fixed once it has exec'd, so each rank's is parsed once, keyed by its pid and
    start time (a reused pid is another process); other children are looked at again
    each time. Between fork and exec a child still has the launcher's environment: a
    launcher that has a ``RANK`` itself (started by another launcher) caches nothing."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[int, int, int]] = {}  # pid -> (start, rank, round)
        self._cache = "RANK" not in os.environ

    def ranks(self) -> dict[int, int]:
        """Global rank -> pid."""
        return {rank: pid for pid, (rank, _) in self._scan().items()}

    def restart_round(self) -> int:
        """The newest torchelastic restart round among the ranks (0 before any)."""
        return max((round_ for _, round_ in self._scan().values()), default=0)

    def _scan(self) -> dict[int, tuple[int, int]]:
        found: dict[int, tuple[int, int]] = {}
        known: dict[int, tuple[int, int, int]] = {}
        for pid in _procs.children():
            start = _procs.starttime(pid)
            if start is None:
                continue  # gone, or dead and not yet reaped
            cached = self._known.get(pid) if self._cache else None
            if cached is not None and cached[0] == start:
                known[pid] = cached
                found[pid] = cached[1:]
                continue
            env = _procs.environ(pid)
            rank = env.get(b"RANK")
            if rank is None or not rank.isdigit():
                continue
            value = env.get(b"TORCHELASTIC_RESTART_COUNT", b"")
            known[pid] = (start, int(rank), int(value) if value.isdigit() else 0)
            found[pid] = known[pid][1:]
        self._known = known
        return found
