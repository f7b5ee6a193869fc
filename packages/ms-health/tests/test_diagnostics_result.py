"""The reports of a diagnosis: JSON round trips, strict parsing, and the verdict."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ms_health.diagnostics import CheckResult, NodeReport, ProcessReport

_text = st.text(max_size=20)
_json_leaf = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | _text
_evidence = st.dictionaries(_text, _json_leaf | st.lists(_json_leaf, max_size=3), max_size=4)
_checks = st.builds(
    CheckResult,
    name=st.sampled_from(["collective", "matmul", "memory_bandwidth"]),
    ok=st.booleans(),
    seconds=st.floats(0, 1e6),
    message=_text,
    evidence=_evidence,
)
_procs = st.builds(
    ProcessReport,
    local_rank=st.integers(0, 7),
    rank=st.integers(0, 63),
    pid=st.integers(1, 2**22),
    device=st.sampled_from(["cpu", "cuda:0", "cuda:7"]),
    checks=st.lists(_checks, max_size=3).map(tuple),
    error=st.none() | _text,
    exitcode=st.none() | st.integers(-15, 255),
)
_nodes = st.builds(
    NodeReport,
    host=_text,
    node_rank=st.integers(0, 3),
    nnodes=st.integers(1, 4),
    nproc=st.integers(1, 3),
    backend=st.sampled_from(["gloo", "nccl"]),
    seconds=st.floats(0, 1e6),
    processes=st.lists(_procs, max_size=3).map(tuple),
)


@given(_nodes)
def test_a_node_report_survives_json(report: NodeReport) -> None:
    wire = json.loads(json.dumps(report.to_json()))
    assert NodeReport.from_json(wire) == report
    assert wire["ok"] == report.ok and wire["failures"] == report.failures()


@given(_nodes)
def test_a_node_passes_only_when_every_process_reported_and_passed(report: NodeReport) -> None:
    every_check = [c for p in report.processes for c in p.checks]
    expected = (
        len(report.processes) == report.nproc
        and all(p.error is None for p in report.processes)
        and all(c.ok for c in every_check)
    )
    assert report.ok == expected
    assert (report.failures() == []) == expected
    assert report.summary().startswith("PASS" if expected else "FAIL")


def test_failures_say_which_check_failed_where() -> None:
    bad = CheckResult("matmul", False, 1.0, "1024x1024 matmul is wrong")
    report = NodeReport(
        host="n7",
        node_rank=1,
        nnodes=2,
        nproc=2,
        backend="nccl",
        seconds=3.0,
        processes=(
            ProcessReport(0, 2, 100, "cuda:0", (CheckResult("matmul", True, 1.0, "fine"),)),
            ProcessReport(1, 3, 101, "cuda:1", (bad,), error="killed at the timeout"),
        ),
    )
    assert report.failures() == [
        "local rank 1 (rank 3, pid 101, cuda:1): matmul: 1024x1024 matmul is wrong",
        "local rank 1 (rank 3, pid 101, cuda:1): killed at the timeout",
    ]
    assert "[FAIL] local rank 1 matmul: 1024x1024 matmul is wrong" in report.summary()


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"ok": "yes"}, "check.ok must be bool"),
        ({"seconds": True}, "check.seconds must be int or float"),
        ({"name": None}, "check.name must be str"),
        ({"evidence": []}, "check.evidence must be dict"),
        ({"seconds": -1.0}, "seconds must be a finite number >= 0"),
    ],
)
def test_a_malformed_check_is_refused_naming_the_field(
    change: dict[str, object], words: str
) -> None:
    good = CheckResult("matmul", True, 1.0, "fine", {"flops": 1.0}).to_json()
    assert CheckResult.from_json(good).ok
    with pytest.raises(ValueError, match=re.escape(words)):
        CheckResult.from_json({**good, **change})


def test_a_malformed_report_is_refused_naming_the_field() -> None:
    good = NodeReport("h", 0, 1, 1, "gloo", 1.0, (ProcessReport(0, 0, 1, "cpu"),)).to_json()
    assert NodeReport.from_json(good).ok
    with pytest.raises(ValueError, match=re.escape("report.processes[] must be a JSON object")):
        NodeReport.from_json({**good, "processes": [3]})
    with pytest.raises(ValueError, match=re.escape("process.pid must be int")):
        NodeReport.from_json({**good, "processes": [{**good["processes"][0], "pid": "1"}]})


def test_importing_the_diagnostics_does_not_import_torch() -> None:
    # The heartbeat sender must stay light; the package's __init__ may re-export these.
    code = "import sys, ms_health.diagnostics; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
