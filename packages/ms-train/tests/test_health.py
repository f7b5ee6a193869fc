"""ms-health around ms-train, the hard way: 2 simulated nodes x 2 ranks (two launchers
on localhost, c10d rendezvous, one health driver), ms-train's small model, real faults:

- a rank SIGKILLed mid-run, then a NaN at a later step, at DP 2 x TP 2: the crash is
  detected and the job restarted from the newest checkpoint; the NaN is detected at its
  step and the job rolls back to the checkpoint before it; training completes;
- a rank SIGSTOPped (a hang), then in the same job a rank spinning in C with the GIL
  held: each is named as the suspect (the one that cannot answer for its stacks, the
  one that answers from inside its step), ended (the stopped one is gone afterwards;
  the spinning one only dies by SIGKILL), and the job recovers both times;
- with ``--health-diagnose`` and a floor no node reaches, a killed rank's node fails
  its diagnostics: the host is blocklisted, the job stops gracefully, and a new launch
  there is refused;
- a rank slowed 1.5x: flagged as a straggler within 10 steps; another rank's brief
  jitter (2x for two steps) is not flagged, and nothing is killed.

Every decision is read back from the driver's event log (``<out>/health/events.jsonl``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from ms_data import build_shards
from ms_data.build import BuildConfig
from ms_testing.faulty_train import HealthJob, free_port
from ms_testing.jobs import wait_gone
from ms_testing.progress import Progress
from ms_testing.train import write_train_config

pytestmark = pytest.mark.slow

DEADLINE = 300.0
MS_TRAIN = (sys.executable, "-m", "ms_train.cli")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import argparse
    import textwrap

    out = tmp_path_factory.mktemp("corpus") / "shards"
    build_shards(
        [argparse.__file__, textwrap.__file__], out, BuildConfig(tokenizer="bytes"), progress=False
    )
    return out


class Job(HealthJob):
    """Two launchers of ``ms_testing.faulty_train`` (2 ranks each) training one job."""

    def __init__(
        self,
        tmp: Path,
        corpus: Path,
        steps: int,
        *faults: str,
        interval_s: float = 0.5,
        width: int = 32,
        log_every: int = 1,
        every: int = 5,
        tp: int = 1,
        **kwargs: Any,
    ) -> None:
        config = write_train_config(
            tmp / "run.toml",
            shards=corpus,
            out_dir=tmp / "run",
            steps=steps,
            every=every,
            width=width,
            micro_batch=width // 16 * tp,  # global batch = micro-batch x 4 / tp replicas
            log_every=log_every,
            tp=tp,
        )
        super().__init__(tmp, config, tmp / "run", faults, interval_s=interval_s, **kwargs)
        self.progress = Progress(self.out)

    def wait_step(self, step: int) -> None:
        self.progress.wait_for(step, DEADLINE, alive=self.running)

    def finish(self) -> str:
        codes = self.wait(DEADLINE)
        text = self.output()
        assert codes == [0, 0], text
        assert not wait_gone(self.tag, timeout=60), "processes of the job were left behind"
        return text


def _kinds(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


@pytest.mark.timeout(600)
def test_a_killed_rank_and_a_nan_are_recovered(corpus: Path, tmp_path: Path) -> None:
    # At DP 2 x TP 2 (each node one TP pair): recovered as at DP 4, which the other
    # tests here run.
    steps, nan_at = 40, 27
    job = Job(tmp_path, corpus, steps, f"nan:2:{nan_at}", tp=2)
    job.wait_step(12)
    os.kill(job.rank_pid(3, DEADLINE), signal.SIGKILL)
    output = job.finish()
    events = job.events()
    crash = [e for e in _kinds(events, "finding") if "crash" in e["message"] and e["ranks"] == [3]]
    assert crash, [e["message"] for e in _kinds(events, "finding")]
    nonfinite = [
        e["evidence"]["finding"]
        for e in _kinds(events, "finding")
        if e["evidence"]["finding"]["kind"] == "nonfinite"
    ]
    assert nonfinite and nonfinite[0]["step"] == nan_at, nonfinite
    assert _kinds(events, "rollback"), [e["message"] for e in events]
    # Two restarts: after the kill (from a step before 12), after the NaN (from the
    # newest checkpoint before step 27 that committed: 25, or 20 if 25 was in flight).
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+) under", output)]
    assert len(resumed) == 2 and resumed[0] <= 12 and nan_at - 10 < resumed[1] < nan_at, output
    assert job.metrics_steps()[-1] == steps


@pytest.mark.timeout(600)
def test_a_stopped_rank_then_a_rank_holding_the_gil_are_named_ended_and_recovered(
    corpus: Path, tmp_path: Path
) -> None:
    """Two hangs in one job: rank 2 SIGSTOPped after step 12, then, after that recovery,
    rank 1 spinning in C with the GIL held from step 25 (once per job)."""
    steps, gil_at = 40, 25
    job = Job(tmp_path, corpus, steps, f"gil:1:{gil_at}")
    job.wait_step(12)
    stopped = job.rank_pid(2, DEADLINE)
    os.kill(stopped, signal.SIGSTOP)
    output = job.finish()
    events = job.events()
    diagnoses = _kinds(events, "diagnosis")
    assert [d["ranks"] for d in diagnoses] == [[2], [1]], [d["message"] for d in diagnoses]
    assert diagnoses[0]["evidence"]["silent"] == [2]
    results = [e["evidence"]["result"] for e in _kinds(events, "action_result")]
    escalations = [r["escalation"] for r in results if "escalation" in r]
    assert len(escalations) == 2, escalations
    halted, spinning = escalations
    # The stopped process can neither dump nor handle SIGTERM: SIGKILL at once.
    assert halted["pid"] == stopped and halted["state"] == "T"
    assert halted["outcome"] == "killed"
    assert not Path(f"/proc/{stopped}").exists()
    # The spinning one answers the dump (faulthandler needs no GIL), ignores SIGTERM
    # (Python's handler needs the GIL) and dies by SIGKILL.
    assert spinning["outcome"] == "killed"
    assert [s[0] for s in spinning["steps"]] == ["dump", "SIGTERM", "SIGKILL"]
    assert "train_step" in spinning["dump"]
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+) under", output)]
    assert len(resumed) == 2 and resumed[0] <= 12 and gil_at - 10 < resumed[1] <= gil_at, output
    assert job.metrics_steps()[-1] == steps, output


@pytest.mark.timeout(600)
def test_a_slow_rank_is_flagged_as_a_straggler_and_nothing_else(
    corpus: Path, tmp_path: Path
) -> None:
    steps, slow_from, jitter_at = 40, 15, 28
    # A wider model and a metrics line every 10 steps: rank 0's own per-step work must
    # stay small against a step, as it is in real training, or rank 0 is the busiest.
    # Heartbeats every 0.1 s: each carries about one step.
    job = Job(
        tmp_path,
        corpus,
        steps,
        f"slow:3:{slow_from}:1.5",
        f"slow:1:{jitter_at}:2:2",  # brief jitter: 2x for two steps on another rank
        interval_s=0.1,
        width=64,
        log_every=10,
    )
    job.finish()
    events = job.events()
    findings = [e["evidence"]["finding"] for e in _kinds(events, "finding")]
    stragglers = [f for f in findings if f["kind"] == "straggler"]
    assert stragglers and all(f["ranks"] == [3] for f in stragglers), findings
    last = re.search(r"last steps \d+-(\d+)", stragglers[0]["message"])
    assert last is not None and int(last.group(1)) <= slow_from + 10, stragglers[0]
    assert not [f for f in findings if f["kind"] in ("crash", "hang", "nonfinite")], findings
    assert not _kinds(events, "order")  # nothing was killed for it
    # What heartbeats cost rank 0 over its timed steps (2..40), measured in the run.
    cost = json.loads((job.out / "summary.json").read_text())["health_cost"]
    assert cost["loop_calls"] > steps - 1 and cost["heartbeats"] >= 1, cost
    spent = cost["loop_s"] + cost["sender_cpu_s"]
    assert 0 < spent == pytest.approx(cost["share"] * cost["wall_s"])
    assert cost["share"] < 0.5, cost


@pytest.mark.timeout(600)
def test_a_node_failing_its_diagnostics_is_blocklisted_and_the_job_stops(
    corpus: Path, tmp_path: Path
) -> None:
    """``--health-diagnose`` with a matmul floor no CPU reaches: after rank 3 is killed,
    its node is diagnosed, fails, and this host goes on the blocklist; both launchers
    (both on this host) stop their ranks as SIGTERM would, and a new launch here is
    refused, naming the entry and how to clear it."""
    steps = 3000  # the stop, not the end of training, ends the job
    job = Job(tmp_path, corpus, steps, health_diagnose=True, health_min_flops=1e18)
    job.wait_step(12)
    os.kill(job.rank_pid(3, DEADLINE), signal.SIGKILL)
    codes = job.wait(DEADLINE)
    text = job.output()
    assert codes == [128 + signal.SIGTERM] * 2, text
    assert text.count("was put on the blocklist") == 2, text  # once per launcher
    assert not wait_gone(job.tag, timeout=60), "processes of the job were left behind"
    assert job.metrics_steps()[-1] < steps
    events = job.events()
    failed = [e for e in events if e["kind"] == "diagnostics"]
    assert failed and "FAILED" in failed[0]["message"], [e["message"] for e in events]
    listed = _kinds(events, "blocklist")
    host = listed[0]["evidence"]["host"]
    blocklist = tmp_path / "run" / "health" / "blocklist.json"
    assert [n["node"] for n in json.loads(blocklist.read_text())["nodes"]] == [host]

    again = subprocess.run(
        [*MS_TRAIN, "--config", str(tmp_path / "run.toml"), "--nproc", "2", "--health"],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert again.returncode == 2, again.stdout + again.stderr
    err = again.stderr.strip().splitlines()
    assert len(err) == 1 and "this host is on the health blocklist" in err[0], again.stderr
    assert f"ms-health blocklist --file {blocklist} remove {host}" in err[0]


@pytest.mark.timeout(600)
def test_a_stop_while_the_ranks_of_two_nodes_start_up_ends_the_job_without_a_restart(
    corpus: Path, tmp_path: Path
) -> None:
    """SIGTERM to both launchers as soon as all four ranks exist (importing, joining
    the process group). A rank killed by it would make its elastic agent restart the
    ranks, and an agent whose ranks had stopped well would wait in its exit barrier for
    one waiting in a new rendezvous. Every rank instead starts, trains a step and stops
    with the others: both launchers give the account, and no rank is restarted."""
    job = Job(tmp_path, corpus, 3000)
    deadline = time.monotonic() + DEADLINE
    while len(ranks := job.rank_pids()) < 4 or any(len(p) != 1 for p in ranks.values()):
        assert job.running_any() and time.monotonic() < deadline, job.output()
        time.sleep(0.02)
    for launcher in job.launchers:
        os.kill(launcher.pid, signal.SIGTERM)
    seen = {r: set(p) for r, p in ranks.items()}
    while job.running_any() and time.monotonic() < deadline:
        for r, pids in job.rank_pids().items():
            seen.setdefault(r, set()).update(pids)
        time.sleep(0.05)
    codes = job.wait(max(1.0, deadline - time.monotonic()))
    text = job.output()
    assert codes == [128 + signal.SIGTERM] * 2, text
    accounts = re.findall(r"ms-train: stopped at step (\d+); checkpoint step \1 committed", text)
    assert len(accounts) == 2 and accounts[0] == accounts[1], text
    assert all(len(pids) == 1 for pids in seen.values()), (seen, text)
    assert not wait_gone(job.tag, timeout=60), "processes of the job were left behind"


class OutsideDriver:
    """``ms-health driver`` as a process of its own (default detectors, the recovery
    policy), on a fixed port with a state file, so that it can die and come back."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.token = uuid.uuid4().hex
        self.token_file = tmp / "driver-token"
        self.token_file.write_text(self.token)
        self.state, self.events = tmp / "driver-state.json", tmp / "driver-events.jsonl"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / "driver.log"
        self.starts = 0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "ms_health.cli", "driver", "--port", str(self.port)]
        cmd += ["--token-file", str(self.token_file), "--state", str(self.state)]
        cmd += ["--events", str(self.events), "--detectors", "default", "--recovery"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.starts += 1
        deadline = time.monotonic() + DEADLINE
        while self.log.read_bytes().count(b"listening on") < self.starts:
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the driver did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)

    def ranks(self) -> dict[int, dict[str, Any]]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/ranks",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            return {r["rank"]: r for r in json.load(reply)["ranks"]}

    def all_events(self) -> list[dict[str, Any]]:
        if not self.events.exists():
            return []
        lines = self.events.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def _until(what: str, ready: Any, job: Job) -> Any:
    """Poll ``ready()`` until it returns something true while the job runs."""
    deadline = time.monotonic() + DEADLINE
    while True:
        found = ready()
        if found:
            return found
        assert job.running(), f"the job ended before {what}:\n{job.output()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE:g} s"
        time.sleep(0.1)


@pytest.mark.timeout(600)
def test_no_false_alarms_a_dead_sender_a_long_checkpoint_and_a_driver_restart(
    corpus: Path, tmp_path: Path
) -> None:
    """Rank 1's heartbeat sender dies at step 10 while it trains on; once the driver
    has called that a monitoring fault, the driver is killed and comes back 2 s later
    on its state file; every rank's checkpoint of step 200 takes 10x a step. Nothing is
    ended, the job never restarts, and the live senders report to the new driver."""
    steps = 300
    driver = OutsideDriver(tmp_path)
    driver.start()
    try:
        job = Job(
            tmp_path,
            corpus,
            steps,
            "mute:1:10",
            "slowsave:*:200:10",
            every=50,
            log_every=10,
            health_endpoint=f"127.0.0.1:{driver.port}",
            env={"MS_HEALTH_TOKEN": driver.token},
        )
        _until(
            "the monitoring fault",
            lambda: [e for e in driver.all_events() if e["kind"] == "monitoring_fault"],
            job,
        )
        driver.kill()
        time.sleep(2.0)
        driver.start()

        def heard_again() -> bool:  # the new driver hears every live sender
            ranks = driver.ranks()
            return all(r in ranks and ranks[r]["heartbeats"] > 0 for r in (0, 2, 3))

        _until("heartbeats at the restarted driver", heard_again, job)
        output = job.finish()
    finally:
        driver.stop()
    events = driver.all_events()
    muted = [e for e in events if e["kind"] == "monitoring_fault"]
    assert muted and all(e["ranks"] == [1] for e in muted), [e["message"] for e in events]
    findings = [e["evidence"]["finding"] for e in events if e["kind"] == "finding"]
    # Rank 1's silence, as the missing heartbeat and the stalled step see it: nothing else
    assert all(f["kind"] in ("crash", "hang") and f["ranks"] == [1] for f in findings), findings
    orders = [e["evidence"]["kind"] for e in events if e["kind"] == "order"]
    assert orders and set(orders) == {"dump"}, orders  # asked for stacks, ended nothing
    assert not [e for e in events if e["kind"] in ("diagnosis", "rollback")]
    assert sum(1 for e in events if e["kind"] == "start") == 2  # the driver came back
    assert "resumed from step" not in output  # never restarted
    assert job.metrics_steps()[-1] == steps
