"""The heartbeat sender against a real driver on loopback: what arrives, and how the
loop's calls (steps, phases, events, log lines) turn into heartbeat fields."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ms_health.driver import Driver
from ms_health.executor import Heartbeat
from ms_health.record import MAX_LOG_LINE_CHARS, MAX_LOG_LINES, MAX_LOSSES, HeartbeatRecord

sys.path.insert(0, str(Path(__file__).parent))
from _driver_support import TOKEN, Recorder, wait_until


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def driver(recorder: Recorder) -> Iterator[Driver]:
    with Driver(TOKEN, detectors=[recorder], tick_s=None) as d:
        yield d


def latest(
    recorder: Recorder,
    rank: int,
    what: str,
    pred: Callable[[HeartbeatRecord], bool] | None = None,
) -> HeartbeatRecord:
    """The newest heartbeat of ``rank`` that satisfies ``pred`` (waiting for one)."""

    def find() -> HeartbeatRecord | None:
        for record in reversed(recorder.of(rank)):
            if pred is None or pred(record):
                return record
        return None

    return wait_until(find, what)


def enter_train(hb: Heartbeat, recorder: Recorder) -> HeartbeatRecord:
    """Switch ``hb`` to the ``train`` phase; the heartbeat that says so, once it came."""
    hb.set_phase("train")
    return latest(recorder, 0, "the phase's heartbeat", lambda r: r.phase == "train")


def test_heartbeats_arrive_with_the_process_facts(driver: Driver, recorder: Recorder) -> None:
    with Heartbeat(
        driver.url,
        TOKEN,
        job="job-1",
        interval_s=0.05,
        rank=1,
        world_size=2,
        local_rank=1,
        node="node-b",
        mesh={"dp": 1, "tp": 0},
    ) as hb:
        wait_until(lambda: len(recorder.of(1)) >= 3, "three heartbeats")
        assert hb.running
    records = recorder.of(1)
    first = records[0]
    assert (first.job, first.rank, first.world_size, first.local_rank) == ("job-1", 1, 2, 1)
    assert first.node == "node-b" and first.host == socket.gethostname()
    assert first.pid == os.getpid() and first.mesh == {"dp": 1, "tp": 0}
    assert first.status == "running" and first.phase == "init" and first.step is None
    assert first.hardware["cpu_cores"] == os.cpu_count()
    assert first.hardware["memory_bytes"] > 0
    assert "gpu_model" not in first.hardware  # torch is imported here, but there is no CUDA
    assert [r.seq for r in records] == list(range(len(records)))
    # stop() sends a last heartbeat saying so, and ends the thread
    assert records[-1].status == "stopping"
    assert not hb.running and hb.failures == 0 and hb.rejected == 0
    assert hb.sent == len(records)


def test_rank_node_and_restart_default_from_torchrun_variables(
    driver: Driver, recorder: Recorder
) -> None:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "2",
        "TORCHELASTIC_RESTART_COUNT": "5",
    }
    with Heartbeat(driver.url, TOKEN, job="j", interval_s=0.05, environ=env):
        record = latest(recorder, 3, "rank 3's heartbeat")
    assert (record.rank, record.world_size, record.local_rank) == (3, 4, 1)
    assert record.node == f"{socket.gethostname()}/2" and record.restart == 5


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "x"}, "RANK must be an integer, got 'x'"),
        ({"RANK": "-1"}, "RANK must be an int >= 0, got -1"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank must be in [0, world_size), got rank 2"),
    ],
)
def test_bad_torchrun_variables_are_refused_by_name(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Heartbeat("http://127.0.0.1:1", TOKEN, job="j", environ=env)


def test_from_env(tmp_path: Path, driver: Driver, recorder: Recorder) -> None:
    assert Heartbeat.from_env({}) is None
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {
        "MS_HEALTH_URL": driver.url,
        "MS_HEALTH_TOKEN_FILE": str(token_file),
        "TORCHELASTIC_RUN_ID": "run-7",
        "RANK": "1",
        "WORLD_SIZE": "2",
    }
    hb = Heartbeat.from_env(env, interval_s=0.05)
    assert hb is not None and hb.job == "run-7" and hb.rank == 1
    with hb:
        latest(recorder, 1, "a heartbeat from the environment's sender")
    with pytest.raises(ValueError, match="MS_HEALTH_TOKEN or MS_HEALTH_TOKEN_FILE"):
        Heartbeat.from_env({"MS_HEALTH_URL": driver.url, "MS_HEALTH_JOB": "j"})
    with pytest.raises(ValueError, match="MS_HEALTH_JOB"):
        Heartbeat.from_env({"MS_HEALTH_URL": driver.url, "MS_HEALTH_TOKEN": TOKEN})
    with pytest.raises(ValueError, match="MS_HEALTH_TOKEN_FILE"):
        Heartbeat.from_env(
            {"MS_HEALTH_URL": driver.url, "MS_HEALTH_TOKEN_FILE": str(tmp_path / "none")}
        )


def test_a_phase_change_is_sent_at_once_and_the_previous_phase_comes_back(
    driver: Driver, recorder: Recorder
) -> None:
    # An interval far longer than the wait: only the prompt send can deliver in time.
    with Heartbeat(driver.url, TOKEN, job="j", interval_s=3600) as hb:
        latest(recorder, 0, "the first heartbeat")
        with hb.phase("train"):
            latest(recorder, 0, "phase train", lambda r: r.phase == "train")
            with hb.phase("checkpoint"):
                latest(recorder, 0, "phase checkpoint", lambda r: r.phase == "checkpoint")
            latest(recorder, 0, "back to train", lambda r: r.phase == "train" and r.seq > 2)
        latest(recorder, 0, "back to init", lambda r: r.phase == "init" and r.seq > 3)
        with pytest.raises(ValueError, match="phase must be a non-empty string"), hb.phase(""):
            pass
    assert [r.phase for r in recorder.of(0)][:5] == ["init", "train", "checkpoint", "train", "init"]


def test_steps_and_events_give_step_time_tokens_per_s_wait_and_last_op(
    driver: Driver, recorder: Recorder
) -> None:
    with Heartbeat(driver.url, TOKEN, job="j", interval_s=3600) as hb:
        hb.step(0, loss=9.0, tokens=100)  # no clock yet: no step time, no rate
        with hb.phase("train"):  # starts the step clock
            # Event times are the caller's clock; these are made up, so the sums are known.
            hb.on_event("all_gather", "issue", 10.0, group="dp", bytes=1024)
            hb.on_event("all_gather", "wait_begin", 10.0)
            hb.on_event("all_gather", "wait_end", 10.25)
            # two overlapping waits count once: 11.0 to 11.5
            hb.on_event("a", "wait_begin", 11.0)
            hb.on_event("b", "wait_begin", 11.1)
            hb.on_event("a", "wait_end", 11.3)
            hb.on_event("b", "wait_end", 11.5)
            hb.on_event("reduce_scatter", "wait_end", 12.0)  # never began here: ignored
            hb.on_event("b", "issue", 12.5, group="tp")
            hb.on_event("b", "complete", 13.0)  # the backend's, not the loop's
            time.sleep(0.01)
            hb.step(1, loss=2.5, tokens=4096)
            with hb.phase("eval"):  # a send, with the step's figures
                record = latest(recorder, 0, "step 1", lambda r: r.step == 1)
    assert record.loss == 2.5 and record.step_at is not None
    assert record.step_time_s is not None and record.step_time_s >= 0.01
    assert record.tokens_per_s == 4096 / record.step_time_s
    assert record.wait_s == pytest.approx(0.25 + 0.5)
    assert record.last_op == {"name": "b", "kind": "issue", "t": 12.5, "group": "tp"}


def test_tokens_per_s_covers_the_steps_since_the_last_heartbeat(
    driver: Driver, recorder: Recorder
) -> None:
    with Heartbeat(driver.url, TOKEN, job="j", interval_s=3600) as hb:
        hb.set_phase("train")
        for step in range(3):
            time.sleep(0.005)
            hb.step(step, tokens=1000)
        hb.set_phase("other")
        record = latest(recorder, 0, "step 2", lambda r: r.step == 2)
        assert record.tokens_per_s is not None and record.step_time_s is not None
        # three steps' tokens over their summed time: not the last step's own rate
        assert record.tokens_per_s < 3000 / record.step_time_s
        hb.set_phase("train")  # a heartbeat without new steps keeps the last rate
        again = latest(recorder, 0, "the next heartbeat", lambda r: r.seq > record.seq)
        assert again.tokens_per_s == record.tokens_per_s


def test_a_heartbeat_carries_every_steps_loss_since_the_last_one(
    driver: Driver, recorder: Recorder
) -> None:
    torch = pytest.importorskip("torch")
    with Heartbeat(driver.url, TOKEN, job="j", interval_s=3600) as hb:
        hb.set_phase("train")
        # The phase change sends a beat; on a busy machine the sender can collect it
        # after the first steps, which would then (rightly) ride on it, not on step 5's.
        latest(recorder, 0, "the train phase", lambda r: r.phase == "train")
        for step in range(5):
            hb.step(step, loss=torch.tensor(2.0 + step))  # a tensor, read on the sender
        hb.step(5)  # no loss: nothing to carry
        hb.set_phase("other")
        first = latest(recorder, 0, "step 5", lambda r: r.step == 5)
        for step in range(6, 6 + MAX_LOSSES + 10):
            hb.step(step, loss=float(step))
        hb.set_phase("train")
        second = latest(recorder, 0, "the next steps", lambda r: r.seq > first.seq)
    assert first.losses == tuple((s, 2.0 + s) for s in range(5))
    # no step twice, and the newest MAX_LOSSES when more came
    newest = range(16, 6 + MAX_LOSSES + 10)
    assert second.losses == tuple((s, float(s)) for s in newest)


class _CountingHeartbeat(Heartbeat):
    """Counts the sender's wakes that looked at a new loss."""

    checks = 0

    def _saw_nonfinite(self) -> bool:
        self.checks += 1
        return super()._saw_nonfinite()


class _DeviceLoss:
    """A loss on a device, as a CUDA tensor looks to the sender: reading it could wait
    for the device, so the loop must not; it records the thread that read it."""

    device = type("Device", (), {"type": "cuda"})()

    def __init__(self, value: float) -> None:
        self.value, self.read_on = value, None

    def __float__(self) -> float:
        self.read_on = threading.get_ident()
        return self.value


def test_a_finite_host_loss_does_not_wake_the_sender(driver: Driver, recorder: Recorder) -> None:
    torch = pytest.importorskip("torch")
    with _CountingHeartbeat(driver.url, TOKEN, job="j", interval_s=3600) as hb:
        first = enter_train(hb, recorder)
        checks = hb.checks
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            for step in range(40):  # numbers and CPU tensors, read in step() at no wait
                # a loss that still requires grad is read without autograd's warning
                loss = torch.tensor(float(step), requires_grad=True) * 1.0
                hb.step(step, loss=float(step) if step % 2 else loss)
                time.sleep(0.002)  # as a step would, free the GIL: a woken sender would run
        assert [str(w.message) for w in warned] == []
        hb.set_phase("other")  # one wake, which sends
        record = latest(recorder, 0, "the next heartbeat", lambda r: r.seq > first.seq)
        assert hb.checks - checks <= 1  # one per step before: a wake and a GIL handoff
    assert record.step == 39 and record.nonfinite_step is None
    assert record.losses == tuple((s, float(s)) for s in range(40))


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_nonfinite_loss_is_sent_at_once_with_its_step(
    driver: Driver, recorder: Recorder, where: str
) -> None:
    with Heartbeat(driver.url, TOKEN, job="j", interval_s=3600) as hb:
        first = enter_train(hb, recorder)
        hb.step(1, loss=1.5 if where == "host" else _DeviceLoss(1.5))
        nan = float("nan") if where == "host" else _DeviceLoss(float("nan"))
        hb.step(2, loss=nan)  # the next heartbeat is an hour away: only the NaN sends
        record = latest(recorder, 0, "the NaN's heartbeat", lambda r: r.seq > first.seq)
    assert record.nonfinite_step == 2 and record.losses[0] == (1, 1.5)
    if isinstance(nan, _DeviceLoss):  # read on the sender's thread, never the loop's
        assert nan.read_on not in (None, threading.get_ident())


class _BrokenLoss:
    @property
    def device(self) -> object:
        raise RuntimeError("no device")


@pytest.mark.parametrize("loss", [10**400, _BrokenLoss()], ids=["too-large", "broken"])
def test_a_loss_that_cannot_be_read_still_counts_the_step(
    driver: Driver, recorder: Recorder, loss: object
) -> None:
    with Heartbeat(driver.url, TOKEN, job="j", interval_s=3600) as hb:
        first = enter_train(hb, recorder)
        hb.step(3, loss=loss, tokens=100.0)
        hb.set_phase("other")
        record = latest(recorder, 0, "the next heartbeat", lambda r: r.seq > first.seq)
    assert record.step == 3 and record.loss is None and record.losses == ()


def test_cost_counts_the_loops_calls_and_the_senders_cpu(
    driver: Driver, recorder: Recorder
) -> None:
    with Heartbeat(driver.url, TOKEN, job="j", interval_s=3600) as hb:
        before = hb.cost()
        enter_train(hb, recorder)
        for step in range(3):
            hb.on_event("all_reduce", "wait_begin", float(step))
            hb.on_event("all_reduce", "wait_end", step + 0.5)
            hb.step(step, loss=1.0)
        hb.set_phase("other")
        latest(recorder, 0, "step 2", lambda r: r.step == 2)
        wait_until(lambda: hb.cost()["heartbeats"] >= before["heartbeats"] + 2, "2 beats")
        after = hb.cost()
    assert after["loop_calls"] - before["loop_calls"] == 9
    assert after["loop_s"] > before["loop_s"] and after["sender_cpu_s"] > before["sender_cpu_s"]


def test_a_connection_the_driver_closed_while_idle_is_replaced_without_a_failure(
    recorder: Recorder,
) -> None:
    # The driver closes a kept-alive connection after io_timeout_s of silence; a sender
    # beating more slowly finds it closed at every heartbeat and reconnects at once.
    with (
        Driver(TOKEN, detectors=[recorder], tick_s=None, io_timeout_s=0.05) as driver,
        Heartbeat(driver.url, TOKEN, job="j", interval_s=0.3) as hb,
    ):
        wait_until(lambda: len(recorder.of(0)) >= 4, "four heartbeats")
        assert hb.failures == 0 and hb.rejected == 0
        assert "ms_health_rejected_requests_total{" not in driver.metrics()


def test_the_loop_api_never_raises(driver: Driver, recorder: Recorder) -> None:
    with Heartbeat(driver.url, TOKEN, job="j", interval_s=3600) as hb:
        hb.set_phase("train")
        hb.step("seven", loss=object(), tokens="many")  # type: ignore[arg-type]
        hb.step(-4, loss=float("nan"), tokens=None)
        hb.on_event(object(), "wait_end", "late", weird=object())  # type: ignore[arg-type]
        hb.set_phase("x")
        record = latest(recorder, 0, "a heartbeat after garbage", lambda r: r.phase == "x")
    # what could not be read is left out; the heartbeat itself is accepted
    assert record.step is None and record.loss is not None and record.loss != record.loss
    assert record.last_op is not None and record.last_op["kind"] == "wait_end"
    assert hb.rejected == 0


def test_warning_lines_matching_a_keyword_travel_with_heartbeats(
    driver: Driver, recorder: Recorder
) -> None:
    log = logging.getLogger("test.train")
    root = logging.getLogger()
    before = list(root.handlers)
    with Heartbeat(driver.url, TOKEN, job="j", interval_s=0.05, log_keywords=("nccl", "oom")):
        assert len(root.handlers) == len(before) + 1
        log.warning("NCCL watchdog timeout on rank 3")
        log.warning("a harmless note")
        log.info("nccl at INFO is below WARNING")
        try:
            raise MemoryError("CUDA OOM")
        except MemoryError:
            log.exception("step failed")  # matches through its exception
        log.error("oom " + "x" * 2000)
        wait_until(lambda: any("step failed" in s for r in recorder.of(0) for s in r.logs), "logs")
        for i in range(MAX_LOG_LINES + 5):
            log.warning("nccl burst %d", i)
        wait_until(
            lambda: any(f"burst {MAX_LOG_LINES + 4}" in s for r in recorder.of(0) for s in r.logs),
            "the burst",
        )
    assert root.handlers == before  # the tap is gone with the sender
    lines = [line for r in recorder.of(0) for line in r.logs]
    assert "WARNING test.train: NCCL watchdog timeout on rank 3" in lines
    assert not any("harmless" in s or "below WARNING" in s for s in lines)
    assert any("step failed [MemoryError: CUDA OOM]" in s for s in lines)
    long = [s for s in lines if s.startswith("ERROR test.train: oom")]
    assert len(long) == 1 and len(long[0]) == MAX_LOG_LINE_CHARS
    # each line is sent once; a burst keeps its latest lines
    assert len(lines) == len(set(lines))
    burst = [s for s in lines if "burst" in s]
    assert len(burst) >= MAX_LOG_LINES and burst[-1].endswith(f"burst {MAX_LOG_LINES + 4}")


def _train_loop_marker(stop: threading.Event) -> None:
    stop.wait(DEADLINE)


DEADLINE = 60.0


def test_a_dump_request_is_answered_with_every_threads_stack(
    driver: Driver, recorder: Recorder
) -> None:
    stop = threading.Event()
    trainer = threading.Thread(target=_train_loop_marker, args=(stop,), name="trainer")
    trainer.start()
    try:
        with Heartbeat(driver.url, TOKEN, job="j", interval_s=0.05) as hb:
            hb.on_event("all_reduce", "wait_begin", 5.0, bucket=3)
            hb.set_phase("train")
            hb.step(41)
            latest(recorder, 0, "step 41", lambda r: r.step == 41)
            request = driver.request_dumps([0])
            dumps = driver.wait_dumps(request, timeout_s=DEADLINE)
            seen = len(recorder.of(0))
            wait_until(lambda: len(recorder.of(0)) > seen + 3, "more heartbeats")
            assert hb.dumps_answered == 1  # answered once, not at every heartbeat
    finally:
        stop.set()
        trainer.join()
    dump = dumps[0]
    assert dump.rank == 0 and dump.pid == os.getpid() and dump.request == request
    assert dump.step == 41
    assert dump.last_op == {"name": "all_reduce", "kind": "wait_begin", "t": 5.0, "bucket": 3}
    assert '"trainer"' in dump.stacks and "_train_loop_marker" in dump.stacks
    assert "the heartbeat sender, answering this dump" in dump.stacks
    events = [e for e in driver.events() if e.kind == "dump"]
    assert len(events) == 1 and "_train_loop_marker" in events[0].evidence["stacks"]


def test_a_driver_that_is_down_costs_the_loop_nothing_and_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    caplog.set_level(logging.INFO, logger="ms_health.executor")
    with Heartbeat(f"http://127.0.0.1:{port}", TOKEN, job="j", interval_s=0.02) as hb:
        for step in range(50):
            hb.step(step, loss=1.0, tokens=10)
        wait_until(lambda: hb.failures >= 5, "failed heartbeats")
    assert hb.sent == 0 and not hb.running
    warnings = [r for r in caplog.records if r.name == "ms_health.executor"]
    assert len(warnings) == 1 and "cannot reach the driver" in warnings[0].getMessage()


def test_a_refused_token_is_logged_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ms_health.executor")
    with (
        Driver(TOKEN, tick_s=None) as driver,
        Heartbeat(driver.url, "wrong", job="j", interval_s=0.02) as hb,
    ):
        wait_until(lambda: hb.rejected >= 3, "refused heartbeats")
    assert hb.sent == 0
    mine = [r.getMessage() for r in caplog.records if r.name == "ms_health.executor"]
    assert len(mine) == 1 and "HTTP 401" in mine[0]


def test_the_sender_does_not_import_torch() -> None:
    code = (
        "import sys, ms_health.executor, ms_health.driver\n"
        "h = ms_health.executor.Heartbeat('http://127.0.0.1:1', 't', job='j')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_sender_thread_is_found_in_the_process_stacks_until_it_ends(
    driver: Driver, recorder: Recorder, tmp_path: Path
) -> None:
    import faulthandler

    from ms_health.executor import sender_in_stacks

    def stacks() -> str:
        path = tmp_path / "stacks.txt"
        with open(path, "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        return path.read_text()

    hb = Heartbeat(driver.url, TOKEN, job="job", interval_s=0.05, rank=0, world_size=1)
    assert not sender_in_stacks(stacks())
    with hb:
        wait_until(lambda: len(recorder.of(0)) >= 2, "two heartbeats")
        assert sender_in_stacks(stacks())
    assert not hb.running
    assert not sender_in_stacks(stacks())


def test_a_step_carries_the_cpu_time_of_the_loops_thread(
    driver: Driver, recorder: Recorder
) -> None:
    with Heartbeat(driver.url, TOKEN, job="job", interval_s=0.05, rank=0, world_size=1) as hb:
        hb.step(0)
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:  # a step that computes
            pass
        hb.step(1)
        busy = latest(recorder, 0, "the computing step", lambda r: r.step == 1)
        time.sleep(0.3)  # a step that waits
        hb.step(2)
        idle = latest(recorder, 0, "the waiting step", lambda r: r.step == 2)
    assert busy.step_cpu_s is not None and idle.step_cpu_s is not None
    assert busy.step_cpu_s > idle.step_cpu_s
    assert idle.step_cpu_s < idle.step_time_s  # type: ignore[operator]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="kernel thread names: Linux")
def test_every_thread_of_ms_health_carries_its_name_for_the_kernel(
    driver: Driver, recorder: Recorder
) -> None:
    # top -H, ps -L and a benchmark reading /proc see "ms-health-*", not "python"
    from ms_health.agent import NodeAgent

    def names() -> set[str]:
        found = set()
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                found.add(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        return found

    agent = NodeAgent(driver.url, TOKEN, job="j", node="n0", workers=dict, interval_s=0.05)
    with agent, Heartbeat(driver.url, TOKEN, job="j", interval_s=0.05):
        wanted = {f"ms-health-{r}" for r in ("serve", "act", "send", "agent", "http")}
        wait_until(lambda: wanted <= names(), f"threads named {sorted(wanted)}")
    mine = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
    assert not mine.startswith("ms-health-")  # the calling thread keeps its own
