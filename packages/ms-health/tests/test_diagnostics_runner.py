"""The runner on real processes: a healthy node passes; a peer node that never comes, a
process that hangs (SIGSTOP) or dies (SIGKILL) fails the node within the timeout, and
nothing of the diagnosis is left running afterwards."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from ms_health.diagnostics import DiagnosticsConfig, NodeReport, diagnose_node, parse_endpoint

# Small checks: the runner's behaviour, not this machine's speed, is under test.
SMALL = DiagnosticsConfig(collective_timeout_s=20.0, matmul_size=128, memory_mb=4.0)
SHORT = DiagnosticsConfig(collective_timeout_s=3.0, matmul_size=128, memory_mb=4.0)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _children() -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        found += [int(p) for p in task.read_text().split()]
    return found


def _assert_nothing_left(report: NodeReport) -> None:
    for p in report.processes:
        assert _gone(p.pid), f"local rank {p.local_rank} (pid {p.pid}) outlived the diagnosis"
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)  # nor anything in its process group
    assert not set(_children()) & {p.pid for p in report.processes}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_healthy_node_passes() -> None:
    spawned: list[tuple[int, int]] = []
    report = diagnose_node(2, 120.0, config=SMALL, on_spawn=lambda r, pid: spawned.append((r, pid)))
    assert report.ok, "\n".join(report.failures())
    assert report.backend == "gloo" and report.nnodes == 1 and len(report.processes) == 2
    assert [(p.local_rank, p.pid) for p in report.processes] == spawned
    first, second = report.processes
    # Collectives in every process; the host's device checks once, in local rank 0.
    assert [c.name for c in first.checks] == ["collective", "matmul", "memory_bandwidth"]
    assert [c.name for c in second.checks] == ["collective"]
    assert first.checks[1].evidence["size"] == 128
    assert first.checks[2].evidence["bytes"] == 4 << 20
    assert NodeReport.from_json(report.to_json()) == report
    _assert_nothing_left(report)


@pytest.mark.slow
def test_a_peer_node_that_never_comes_fails_the_rendezvous_and_leaves_nothing() -> None:
    report = diagnose_node(
        2, 60.0, node_rank=0, nnodes=2, endpoint=f"127.0.0.1:{free_port()}", config=SHORT
    )
    assert not report.ok
    for p in report.processes:
        assert p.error is None  # each process reported the failure itself, in time
        check = p.checks[0]
        assert not check.ok and check.name == "collective"
        assert check.evidence["op"] == "rendezvous"
        assert check.evidence["missing_ranks"] == [2, 3]
        assert "rank(s) [2, 3] never joined" in check.message
    # The node's own devices were still checked, and passed.
    assert [(c.name, c.ok) for c in report.processes[0].checks[1:]] == [
        ("matmul", True),
        ("memory_bandwidth", True),
    ]
    assert [line.split(": ")[1] for line in report.failures()] == ["collective"] * 2
    _assert_nothing_left(report)


@pytest.mark.slow
def test_a_hung_process_is_killed_at_the_timeout() -> None:
    def stop_second(local_rank: int, pid: int) -> None:
        if local_rank == 1:
            os.kill(pid, signal.SIGSTOP)

    report = diagnose_node(2, 15.0, config=SHORT, on_spawn=stop_second)
    assert not report.ok
    hung = report.processes[1]
    assert hung.checks == ()
    assert hung.error is not None and "still running at the 15 s timeout" in hung.error
    assert "killed with its process group" in hung.error
    assert hung.exitcode == -signal.SIGKILL
    # Its peer gave up on it on its own, naming the rank that never came.
    check = report.processes[0].checks[0]
    assert not check.ok and check.evidence["missing_ranks"] == [1]
    _assert_nothing_left(report)


@pytest.mark.slow
def test_a_process_that_dies_is_reported_with_its_signal() -> None:
    def kill_second(local_rank: int, pid: int) -> None:
        if local_rank == 1:
            os.kill(pid, signal.SIGKILL)

    report = diagnose_node(2, 30.0, config=SHORT, on_spawn=kill_second)
    assert not report.ok
    dead = report.processes[1]
    assert dead.error is not None and "without reporting: killed by SIGKILL" in dead.error
    assert "local rank 1" in report.failures()[-1] and "SIGKILL" in report.failures()[-1]
    _assert_nothing_left(report)


@pytest.mark.slow
def test_processes_already_started_die_when_the_runner_fails() -> None:
    pids: list[int] = []

    def fail_on_second(local_rank: int, pid: int) -> None:
        pids.append(pid)
        if local_rank == 1:
            raise RuntimeError("the driver could not record the diagnosis")

    with pytest.raises(RuntimeError, match="could not record"):
        diagnose_node(2, 30.0, config=SHORT, on_spawn=fail_on_second)
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        ((0,), {}, "nproc must be an int >= 1"),
        ((2, 10.0), {"config": DiagnosticsConfig(collective_timeout_s=10.0)}, "must exceed"),
        ((2, 60.0, "mpi"), {}, "backend must be one of"),
        ((2, 60.0, "nccl"), {}, "nproc must be <= the"),
        ((2,), {"nnodes": 2}, "endpoint must be given when nnodes > 1"),
        ((2,), {"nnodes": 2, "node_rank": 2, "endpoint": "h:1"}, "node_rank must be < nnodes"),
        ((2,), {"endpoint": "localhost"}, "endpoint must be 'host:port'"),
    ],
)
def test_bad_arguments_are_refused(
    args: tuple[object, ...], kwargs: dict[str, object], words: str
) -> None:
    if "nccl" in args:
        import torch

        if torch.cuda.device_count() >= 2:
            pytest.skip("this machine has the devices")
    with pytest.raises(ValueError, match=words):
        diagnose_node(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [("10.0.0.7:29500", ("10.0.0.7", 29500)), ("[::1]:80", ("::1", 80)), ("n-3:1", ("n-3", 1))],
)
def test_parse_endpoint(endpoint: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["", ":29500", "host:", "host:0", "host:70000", "host:x"])
def test_parse_endpoint_refuses(endpoint: str) -> None:
    with pytest.raises(ValueError, match="endpoint must be 'host:port'"):
        parse_endpoint(endpoint)


@pytest.mark.gpu
@pytest.mark.slow
def test_a_healthy_gpu_node_passes_on_nccl() -> None:
    import torch

    n = min(2, torch.cuda.device_count())
    report = diagnose_node(n, 300.0, "nccl", config=DiagnosticsConfig(collective_timeout_s=120))
    assert report.ok, "\n".join(report.failures())
    for p in report.processes:
        assert [c.name for c in p.checks][:2] == ["collective", "matmul"]  # matmul per GPU
