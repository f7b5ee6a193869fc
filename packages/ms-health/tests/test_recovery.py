"""The recovery chain on real processes: a driver with the default detectors and the
Recovery policy, a node agent reporting two worker processes, and a fault in one:
SIGKILL, SIGSTOP, a held GIL, a NaN. The policy must name the right rank, end exactly
the faulty processes through the agent (or every rank for a NaN rollback), and record
each decision with its evidence. (The elastic restart that follows is torch's; the
ms-train tests run it end to end.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ms_health.agent import NodeAgent
from ms_health.blocklist import Blocklist
from ms_health.detectors import default_detectors
from ms_health.diagnostics.config import DiagnosticsConfig
from ms_health.driver import Driver
from ms_health.escalate import process_state
from ms_health.recovery import Recovery

pytestmark = pytest.mark.slow  # real processes and real timeouts, ~10 s each

HERE = Path(__file__).parent
TOKEN = "recovery-test-token"
DEADLINE = 60.0


class Job:
    """Two worker processes on one simulated node, its agent, and the driver."""

    def __init__(
        self,
        tmp: Path,
        *worker_args: list[str],
        blocklist: Blocklist | None = None,
        diagnostics: DiagnosticsConfig | None = None,
        in_process: bool = False,
    ) -> None:
        self.driver = Driver(TOKEN, detectors=default_detectors(0.2), job="job", tick_s=0.1)
        self.driver.on_finding = Recovery(
            self.driver,
            dump_timeout_s=1.0,
            action_timeout_s=20,
            diagnose=blocklist is not None,
            blocklist=blocklist,
        )
        self.driver.start()
        self.dumps = tmp / "dumps"
        self.dumps.mkdir()
        self.procs: list[subprocess.Popen[str]] = []
        for rank, extra in enumerate(worker_args):
            env = {
                **os.environ,
                "MS_HEALTH_URL": self.driver.url,
                "MS_HEALTH_TOKEN": TOKEN,
                "MS_HEALTH_JOB": "job",
                "MS_HEALTH_DUMP_DIR": str(self.dumps),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(len(worker_args)),
                "GROUP_RANK": "0",
            }
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "_worker_proc.py"), *extra],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            self.procs.append(proc)
        self.agent = NodeAgent(
            self.driver.url,
            TOKEN,
            job="job",
            node=self._node(),
            workers=self.workers,
            dump_dir=self.dumps,
            interval_s=0.1,
            term_timeout_s=1.0,
            kill_timeout_s=5.0,
            diagnostics=diagnostics,
            # beside its driver, as in the launcher that hosts it: by a call, not HTTP
            driver=self.driver if in_process else None,
        ).start()

    def _node(self) -> str:
        deadline = time.monotonic() + DEADLINE
        while True:
            records = self.driver.last_records()
            if len(records) == len(self.procs):
                (node,) = {r.node for r in records.values()}
                return node
            assert time.monotonic() < deadline, "the workers' heartbeats did not arrive"
            time.sleep(0.05)

    def workers(self) -> dict[int, int]:
        return {
            rank: p.pid
            for rank, p in enumerate(self.procs)
            if process_state(p.pid) not in (None, "Z")
        }

    def wait_event(self, kind: str, contains: str = "") -> dict[str, Any]:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            for e in self.driver.events():
                if e.kind == kind and contains in e.message:
                    return e.to_json()
            time.sleep(0.05)
        kinds = [(e.kind, e.message) for e in self.driver.events()]
        raise AssertionError(f"no {kind!r} event containing {contains!r}: {kinds}")

    def close(self) -> None:
        self.agent.stop()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        self.driver.stop()


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Any]:
    jobs: list[Job] = []

    def make(*worker_args: list[str], **kwargs: Any) -> Job:
        job = Job(tmp_path, *worker_args, **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


@pytest.mark.parametrize("agent", ["http", "in-process"])
def test_a_stopped_rank_is_named_and_killed_and_its_peer_is_left_alone(
    make_job: Any, agent: str
) -> None:
    job = make_job([], [], in_process=agent == "in-process")
    job.procs[1].send_signal(signal.SIGSTOP)
    diagnosis = job.wait_event("diagnosis")
    assert diagnosis["ranks"] == [1], diagnosis
    assert diagnosis["evidence"]["silent"] == [1] and diagnosis["evidence"]["answered"] == [0]
    result = job.wait_event("action_result", "(escalate): rank 1")
    escalation = result["evidence"]["result"]["escalation"]
    assert escalation["state"] == "T" and escalation["outcome"] == "killed"
    assert job.procs[1].wait(timeout=DEADLINE) == -signal.SIGKILL
    assert job.procs[0].poll() is None  # the live rank was not touched
    job.wait_event("recovery", "the elastic agents restart")


def test_a_rank_holding_the_gil_takes_the_hard_kill_path(make_job: Any) -> None:
    job = make_job([], ["--hold-gil-at", "10"])
    result = job.wait_event("action_result", "(escalate): rank 1")
    escalation = result["evidence"]["result"]["escalation"]
    assert escalation["outcome"] == "killed", escalation  # SIGTERM's handler never ran
    assert [s[0] for s in escalation["steps"]] == ["dump", "SIGTERM", "SIGKILL"]
    assert "_worker_proc.py" in escalation["dump"]  # faulthandler answered without the GIL
    assert job.procs[1].wait(timeout=DEADLINE) == -signal.SIGKILL
    assert job.procs[0].poll() is None


def test_a_rank_that_lost_its_heartbeat_sender_is_a_monitoring_fault_and_left_alone(
    make_job: Any,
) -> None:
    job = make_job([], ["--mute-at", "10"])
    fault = job.wait_event("monitoring_fault")
    assert fault["ranks"] == [1], fault
    assert fault["evidence"]["pid"] == job.procs[1].pid
    assert "_worker_proc.py" in fault["evidence"]["stacks"]  # it answered for its stacks
    # The crash finding came first, and nothing was ordered but the stack dump.
    assert any(e.kind == "finding" and e.ranks == (1,) for e in job.driver.events())
    time.sleep(1.0)  # a while longer: still nothing ended
    kinds = [(e.kind, e.evidence.get("kind")) for e in job.driver.events() if e.kind == "order"]
    assert kinds and all(k == "dump" for _, k in kinds), kinds
    assert not [e for e in job.driver.events() if e.kind in ("diagnosis", "rollback")]
    assert all(p.poll() is None for p in job.procs)


def test_a_killed_rank_is_found_gone(make_job: Any) -> None:
    job = make_job([], [])
    job.procs[1].kill()
    job.procs[1].wait(timeout=DEADLINE)
    finding = job.wait_event("finding", "crash")
    assert finding["ranks"] == [1]
    diagnosis = job.wait_event("diagnosis")
    assert 1 in diagnosis["ranks"] and 0 not in diagnosis["ranks"]
    # Its pid is no worker of the node any more: the agent refuses to signal it.
    result = job.wait_event("action_result", "escalate")
    assert "is not a worker of node" in result["evidence"]["result"]["summary"]
    assert job.procs[0].poll() is None


def test_a_node_below_its_floor_is_diagnosed_and_its_host_blocklisted(
    make_job: Any, tmp_path: Path
) -> None:
    # A floor no CPU reaches: the node's measured matmul rate really is below it.
    blocklist = Blocklist(tmp_path / "blocklist.json")
    job = make_job([], [], blocklist=blocklist, diagnostics=DiagnosticsConfig(min_flops=1e18))
    deadline = time.monotonic() + DEADLINE
    while len(getattr(job.driver.agents().get(job.agent.node), "workers", {})) < 2:
        assert time.monotonic() < deadline, "the agent never reported both workers"
        time.sleep(0.05)
    job.procs[1].kill()
    job.procs[1].wait(timeout=DEADLINE)
    job.wait_event("diagnosis")
    failed = job.wait_event("diagnostics", "FAILED")
    assert failed["evidence"]["result"]["ok"] is False
    listed = job.wait_event("blocklist")
    host = socket.gethostname()
    assert listed["evidence"] == {"node": failed["evidence"]["node"], "host": host}
    # Through the file, as a launcher on this host reads it.
    entry = Blocklist(tmp_path / "blocklist.json").blocked(host)
    assert entry is not None and "diagnostics failed after crash of ranks [1]: " in entry.reason
    assert "matmul" in entry.reason and "\n" not in entry.reason  # the failed check, one line
    assert entry.evidence["node"] == failed["evidence"]["node"]


def test_a_nan_rolls_back_every_rank_at_its_step(make_job: Any) -> None:
    job = make_job(["--nan-at", "30"], [])
    finding = job.wait_event("finding", "nonfinite")
    assert finding["evidence"]["finding"]["step"] == 30  # the first bad step, exactly
    rollback = job.wait_event("rollback")
    assert rollback["ranks"] == [0, 1]
    for p in job.procs:
        assert p.wait(timeout=DEADLINE) in (0, -signal.SIGKILL, -signal.SIGTERM)
