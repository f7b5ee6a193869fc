"""Diagnose a node from outside the training job, within a bound.

:func:`diagnose_node` starts ``nproc`` fresh processes on this machine, joined by a
rendezvous of their own (a TCP store this runner hosts, never the training job's), runs
the collective check in all of them and the device checks after it, and kills any
process still running at the deadline together with its process group. Two runners on
two nodes given the same ``endpoint`` test the links between the nodes: their processes
form one group, node 0's runner hosts the store, and each runner reports its own node.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs

from ms_health.diagnostics._worker import WorkerSpec, main
from ms_health.diagnostics.config import DiagnosticsConfig
from ms_health.diagnostics.result import CheckResult, NodeReport, ProcessReport

__all__ = ["diagnose_node", "parse_endpoint"]

# Joining a process that has already reported, or that was just SIGKILLed.
_JOIN_S = 10.0
BACKENDS = ("gloo", "nccl")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) as ``(host, port)``."""
    host, sep, port = endpoint.rpartition(":") if isinstance(endpoint, str) else ("", "", "")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint must be 'host:port' with a port in 1..65535, got {endpoint!r}")
    return host, int(port)


def diagnose_node(
    nproc: int = 2,
    timeout_s: float = 120.0,
    backend: str | None = None,
    *,
    node_rank: int = 0,
    nnodes: int = 1,
    endpoint: str | None = None,
    config: DiagnosticsConfig | None = None,
    on_spawn: Callable[[int, int], None] | None = None,
) -> NodeReport:
    """Run the diagnostics on this node and report which check failed where.

    Args:
        nproc: processes to start here, one per device (GPU) on CUDA.
        timeout_s: bound on the whole diagnosis; a process still running then is
            killed with its process group and reported. Must exceed
            ``config.collective_timeout_s``, so that a failed collective is reported
            by the processes themselves before the deadline.
        backend: ``gloo`` (CPU) or ``nccl`` (one GPU per process); None picks NCCL
            where CUDA is available.
        node_rank, nnodes: this node's place among the nodes tested together.
        endpoint: ``host:port`` of the rendezvous store, which node 0 hosts; needed
            when ``nnodes > 1``. For one node, None puts it on a free loopback port.
        config: sizes, bounds and floors of the checks.
        on_spawn: called with ``(local_rank, pid)`` as each process starts, e.g. to
            record the pids of the diagnosis in the driver's events.
    """
    counts = (("nproc", nproc, 1), ("nnodes", nnodes, 1), ("node_rank", node_rank, 0))
    for name, value, low in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if node_rank >= nnodes:
        raise ValueError(f"node_rank must be < nnodes ({nnodes}), got {node_rank}")
    cfg = DiagnosticsConfig() if config is None else config
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a finite number, got {timeout_s!r}")
    if not timeout_s > cfg.collective_timeout_s:
        raise ValueError(
            f"timeout_s must exceed config.collective_timeout_s ({cfg.collective_timeout_s:g}),"
            f" got {timeout_s!r}"
        )
    if endpoint is None and nnodes > 1:
        raise ValueError(f"endpoint must be given when nnodes > 1, got nnodes={nnodes}")
    host, port = ("127.0.0.1", 0) if endpoint is None else parse_endpoint(endpoint)
    chosen, devices = _devices(backend, nproc)

    store = None
    if node_rank == 0:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        # Bound before any process starts, so that no two diagnoses race for a port.
        store = TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        port = store.port
    try:
        return _run(nproc, timeout_s, chosen, devices, node_rank, nnodes, host, port, cfg, on_spawn)
    finally:
        del store


def _devices(backend: str | None, nproc: int) -> tuple[str, list[str]]:
    import torch

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "gloo":
        return backend, ["cpu"] * nproc
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc > count:
        raise ValueError(f"nproc must be <= the {count} CUDA device(s) for nccl, got {nproc}")
    return backend, [f"cuda:{i}" for i in range(nproc)]


@attrs.define
class _Proc:
    """The runner's view of one process while it runs."""

    spec: WorkerSpec
    proc: Any  # a spawn-context Process
    conn: multiprocessing.connection.Connection
    checks: list[CheckResult] = attrs.Factory(list)
    stage: str = "start-up"
    error: str | None = None
    finished: bool = False  # reported "done" or "error"

    def read(self) -> None:
        """Take every message waiting on the pipe."""
        with contextlib.suppress(EOFError, OSError):
            while self.conn.poll():
                data = self.conn.recv_bytes()
                try:
                    self._take(json.loads(data))
                except (ValueError, KeyError, TypeError) as e:
                    self.error = f"{self.stage}: sent a message the runner cannot read: {e!r}"

    def _take(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "stage":
            self.stage = str(msg["stage"])
        elif kind == "check":
            self.checks.append(CheckResult.from_json(msg["check"]))
        elif kind == "error":
            self.error = f"{self.stage}: {msg['message']}"[-2000:]
            self.finished = True
        elif kind == "done":
            self.finished = True

    def report(self) -> ProcessReport:
        return ProcessReport(
            local_rank=self.spec.local_rank,
            rank=self.spec.rank,
            pid=self.proc.pid or 0,
            device=self.spec.device,
            checks=tuple(self.checks),
            error=self.error,
            exitcode=self.proc.exitcode,
        )


def _run(
    nproc: int,
    timeout_s: float,
    backend: str,
    devices: list[str],
    node_rank: int,
    nnodes: int,
    host: str,
    port: int,
    cfg: DiagnosticsConfig,
    on_spawn: Callable[[int, int], None] | None,
) -> NodeReport:
    ctx = multiprocessing.get_context("spawn")
    start = time.monotonic()
    deadline = start + timeout_s
    procs: list[_Proc] = []
    try:
        for local_rank in range(nproc):
            spec = WorkerSpec(
                local_rank=local_rank,
                nproc=nproc,
                node_rank=node_rank,
                nnodes=nnodes,
                store_host=host,
                store_port=port,
                backend=backend,
                device=devices[local_rank],
                config=cfg,
                parent=os.getpid(),
            )
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=main, args=(spec, send), name=f"ms-diag{local_rank}")
            proc.start()
            send.close()
            procs.append(_Proc(spec, proc, recv))
            if on_spawn is not None and proc.pid is not None:
                on_spawn(local_rank, proc.pid)

        while True:
            running = [p for p in procs if p.proc.exitcode is None]
            if not running or time.monotonic() >= deadline:
                break
            handles: list[Any] = [p.conn for p in running] + [p.proc.sentinel for p in running]
            multiprocessing.connection.wait(handles, timeout=max(0.0, deadline - time.monotonic()))
            for p in running:
                p.read()

        for p in procs:
            if p.proc.exitcode is None:
                p.read()
                _kill_group(p.proc)
                p.proc.join(_JOIN_S)
                p.error = (
                    f"still running at the {timeout_s:g} s timeout, in {p.stage}: killed "
                    "with its process group"
                )
            else:
                p.proc.join(_JOIN_S)
                p.read()  # what it sent just before exiting
                if not p.finished:
                    p.error = f"exited during {p.stage} without reporting: {_exit(p.proc.exitcode)}"
    finally:
        # Whatever happened (an exception in on_spawn, a KeyboardInterrupt), no
        # process of this diagnosis outlives the call.
        for p in procs:
            if p.proc.exitcode is None:
                _kill_group(p.proc)
                p.proc.join(_JOIN_S)
            p.conn.close()
    return NodeReport(
        host=socket.gethostname(),
        node_rank=node_rank,
        nnodes=nnodes,
        nproc=nproc,
        backend=backend,
        seconds=time.monotonic() - start,
        processes=tuple(p.report() for p in procs),
    )


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _kill_group(proc: Any) -> None:
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        # Killed before it made its own process group, or already gone.
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
