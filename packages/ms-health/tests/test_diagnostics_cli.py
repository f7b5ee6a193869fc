"""``python -m ms_health.diagnostics``: its exit codes and its JSON, and two of them on
one host standing in for two nodes that test the all-reduce between them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

import pytest

SMALL = ["--matmul-size", "128", "--memory-mb", "4"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ms_health.diagnostics", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _popen(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ms_health.diagnostics", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_passing_node_exits_0_with_its_report() -> None:
    out = _cli("--nproc", "2", "--timeout", "90", "--json", *SMALL)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["failures"] == []
    assert [len(p["checks"]) for p in report["processes"]] == [3, 1]


@pytest.mark.slow
def test_a_failing_node_exits_1_naming_the_check_and_its_figure() -> None:
    out = _cli("--nproc", "1", "--timeout", "90", "--min-gbps", "1e12", *SMALL)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.startswith("FAIL: node 0 of 1")
    (line,) = [x for x in out.stdout.splitlines() if "[FAIL]" in x]
    assert "memory_bandwidth: host copy of 4 MiB too slow" in line and "GB/s" in line


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--nproc", "0"], "nproc must be an int >= 1"),
        (["--memory-mb", "0"], "memory_mb must be a finite number > 0"),
        (["--nnodes", "2"], "endpoint must be given"),
    ],
)
def test_a_bad_argument_exits_2_with_one_line(args: list[str], words: str) -> None:
    out = _cli(*args, timeout=60)
    assert out.returncode == 2
    assert out.stdout == "" and out.stderr.count("\n") == 1 and words in out.stderr


@pytest.mark.slow
def test_two_runners_test_the_all_reduce_across_their_nodes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--nproc", "2", "--nnodes", "2", "--endpoint", f"127.0.0.1:{port}"]
    common += ["--timeout", "120", "--json", *SMALL]
    nodes = [_popen(*common, "--node-rank", str(n)) for n in (1, 0)]  # node 1 first: it waits
    reports: list[dict[str, Any]] = []
    try:
        for proc in nodes:
            stdout, stderr = proc.communicate(timeout=180)
            assert proc.returncode == 0, stdout + stderr
            reports.append(json.loads(stdout))
    finally:
        for proc in nodes:
            proc.kill()
            proc.wait()
    by_node = {r["node_rank"]: r for r in reports}
    for node, report in by_node.items():
        assert report["ok"] and report["nnodes"] == 2
        for p in report["processes"]:
            assert p["rank"] == node * 2 + p["local_rank"]
            collective = p["checks"][0]["evidence"]
            assert collective["all_reduce"]["ranks"] == [0, 1, 2, 3]
            assert collective["all_to_all"]["ranks"] == [node * 2, node * 2 + 1]
