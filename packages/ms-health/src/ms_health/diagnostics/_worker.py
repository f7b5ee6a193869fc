"""One diagnostic process: join the diagnosis's own rendezvous, run the collective check
with its peers, then this device's checks; report each result to the runner as it comes.

The runner started this process in a fresh interpreter (nothing of a training job's
state, CUDA context or process group is inherited) and kills its process group at the
deadline; this process also dies with the runner.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import attrs

from ms_health.diagnostics.compute import matmul_check, memory_bandwidth_check
from ms_health.diagnostics.config import DiagnosticsConfig
from ms_health.diagnostics.result import CheckResult

__all__: list[str] = []

_PR_SET_PDEATHSIG = 1
_WATCH_EVERY_S = 0.5


@attrs.frozen
class WorkerSpec:
    local_rank: int
    nproc: int
    node_rank: int
    nnodes: int
    store_host: str
    store_port: int
    backend: str
    device: str
    config: DiagnosticsConfig
    parent: int

    @property
    def rank(self) -> int:
        return self.node_rank * self.nproc + self.local_rank

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc


class _Reporter:
    """JSON messages to the runner, one per ``send_bytes``."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def stage(self, name: str) -> None:
        self._send({"type": "stage", "stage": name})

    def check(self, result: CheckResult) -> None:
        self._send({"type": "check", "check": result.to_json()})

    def error(self, message: str) -> None:
        self._send({"type": "error", "message": message})

    def done(self) -> None:
        self._send({"type": "done"})

    def _send(self, obj: dict[str, Any]) -> None:
        self.conn.send_bytes(json.dumps(obj, default=str).encode())


def main(spec: WorkerSpec, conn: Any) -> None:
    """The process's entry point; it ends with ``os._exit`` and never returns."""
    # Own process group: the runner kills the group, so whatever this process starts
    # (a compiler, a helper) goes with it.
    os.setpgrp()
    _die_with_parent(spec.parent)
    # The runner's stdout may carry its JSON report; whatever a library prints here
    # goes to stderr instead.
    os.dup2(2, 1)
    report = _Reporter(conn)
    code = 0
    try:
        _run(spec, report)
    except BaseException:
        report.error(f"raised:\n{traceback.format_exc(limit=12)}")
        code = 1
    # No process-group teardown: after a failed collective it can block on the peer
    # that caused the failure, and the process is done.
    conn.close()
    os._exit(code)


def _run(spec: WorkerSpec, report: _Reporter) -> None:
    if spec.store_host in ("127.0.0.1", "localhost", "::1"):
        # Everything is on this host: keep gloo on loopback rather than on whatever
        # interface the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch

    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))
    report.stage("rendezvous")
    store, failed = _rendezvous(spec)
    if failed is not None:
        report.check(failed)
    else:
        report.stage("collective")
        report.check(_collectives(spec, store))
    # The device checks run whatever became of the collectives: a node whose peer
    # never came may still be fit, and one with a bad device is not.
    cfg = spec.config
    on_cuda = spec.device.startswith("cuda")
    if on_cuda or spec.local_rank == 0:  # CPU: the host is one device, checked once
        report.stage("matmul")
        report.check(
            matmul_check(
                spec.device,
                cfg.matmul_size,
                cfg.matmul_dtype or ("bfloat16" if on_cuda else "float32"),
                min_flops=cfg.min_flops,
            )
        )
    if spec.local_rank == 0:
        report.stage("memory_bandwidth")
        report.check(memory_bandwidth_check(cfg.memory_mb, cfg.min_gbps))
    report.done()


def _collectives(spec: WorkerSpec, store: Any) -> CheckResult:
    import torch.distributed as dist

    from ms_health.diagnostics.collective import collective_check

    cfg = spec.config
    world = _group(dist.group.WORLD)
    node = world
    start = time.perf_counter()
    try:
        if spec.nnodes > 1:
            # new_group is collective over the whole world: every rank makes every
            # node's group, in the same order, and keeps its own.
            for n in range(spec.nnodes):
                g = dist.new_group(list(range(n * spec.nproc, (n + 1) * spec.nproc)))
                if n == spec.node_rank:
                    node = _group(g)
    except Exception as e:
        message = f"new_group of each node's ranks failed on rank {spec.rank}: {e!r}"[:800]
        evidence = {"op": "new_group", "rank": spec.rank}
        return CheckResult("collective", False, time.perf_counter() - start, message, evidence)
    result = collective_check(
        world,
        node,
        device=spec.device,
        timeout_s=cfg.collective_timeout_s,
        numel=cfg.collective_numel,
    )
    if result.ok:
        # Leave only once every peer is through its collectives too: a process that
        # exits closes its sockets under a peer still reading from them.
        _store_barrier(store, spec, "collective-done", cfg.collective_timeout_s)
    return result


def _group(group: Any) -> Any:
    if group is None:
        raise RuntimeError("this process is not in the process group it just made")
    return group


def _rendezvous(spec: WorkerSpec) -> tuple[Any, CheckResult | None]:
    """Join this diagnosis's store and process group: the store, and a failed check
    (naming the ranks that did not arrive in time) or None."""
    import torch.distributed as dist

    # Public API that torch's stubs do not re-export.
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    start = time.perf_counter()
    timeout = spec.config.collective_timeout_s
    where = f"{spec.store_host}:{spec.store_port}"
    evidence: dict[str, Any] = {"op": "rendezvous", "endpoint": where, "timeout_s": timeout}
    try:
        store = TCPStore(
            spec.store_host,
            spec.store_port,
            is_master=False,
            timeout=timedelta(seconds=timeout),
        )
    except Exception as e:
        message = f"rendezvous store at {where} unreachable within {timeout:g} s: {e!r}"
        return None, CheckResult(
            "collective", False, time.perf_counter() - start, message, evidence
        )
    missing = _store_barrier(store, spec, "joined", timeout)
    if missing:
        evidence["missing_ranks"] = missing
        message = (
            f"rendezvous of {spec.world_size} ranks at {where} incomplete after {timeout:g} s "
            f"(rank {spec.rank}): rank(s) {missing} never joined"
        )
        return store, CheckResult(
            "collective", False, time.perf_counter() - start, message, evidence
        )
    kwargs: dict[str, Any] = {}
    if spec.backend == "nccl":
        import torch

        # Eager NCCL communicator set-up, bounded by the timeout below, instead of a
        # lazy one inside the first collective.
        kwargs["device_id"] = torch.device(spec.device)
    try:
        dist.init_process_group(
            spec.backend,
            store=PrefixStore("pg", store),
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=timeout),
            **kwargs,
        )
    except Exception as e:
        message = f"init_process_group ({spec.backend}) failed on rank {spec.rank}: {e!r}"[:800]
        return store, CheckResult(
            "collective", False, time.perf_counter() - start, message, evidence
        )
    return store, None


def _store_barrier(store: Any, spec: WorkerSpec, name: str, timeout: float) -> list[int]:
    """Mark this rank at ``name`` and wait for every rank; the ranks that did not come."""
    keys = [f"{name}/{r}" for r in range(spec.world_size)]
    try:
        store.set(keys[spec.rank], str(os.getpid()))
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:
        with contextlib.suppress(Exception):
            return [r for r, k in enumerate(keys) if not store.check([k])]
        return [r for r in range(spec.world_size) if r != spec.rank]
    return []


def _die_with_parent(parent: int) -> None:
    """SIGKILL from the kernel when the runner dies, so no diagnostic outlives it."""
    armed = False
    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    if not armed:
        threading.Thread(target=_watch, args=(parent,), name="ms-diag-parent", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_EVERY_S)
    os.kill(os.getpid(), signal.SIGKILL)
