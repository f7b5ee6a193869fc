"""One run per directory: a second run on a run's out dir or checkpoint dir is refused
at once, naming the live one, on every rank; a lock left by a SIGKILLed run is taken
over and the takeover logged. Real processes, real signals, real files."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ms_data import build_shards
from ms_data.build import BuildConfig
from ms_testing.dist import run_ranks
from ms_testing.train import write_train_config
from ms_train._lock import LOCK_NAME, RunLockedError, lock_run
from ms_train.config import ConfigError, load_config
from ms_train.errors import JobError
from ms_train.report import read_metrics
from ms_train.trainer import Trainer

DEADLINE = 120.0  # for every wait on a process or a file


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-level shards of a few standard-library modules (about 300 KB)."""
    import argparse
    import json as json_mod
    import textwrap

    out = tmp_path_factory.mktemp("corpus") / "shards"
    sources = [argparse.__file__, json_mod.__file__, textwrap.__file__]
    build_shards(sources, out, BuildConfig(tokenizer="bytes"), progress=False)
    return out


def _toml(path: Path, corpus: Path, out: Path, *, steps: int, ckpt: Path | None = None) -> Path:
    return write_train_config(
        path, shards=corpus, out_dir=out, steps=steps, every=20, width=32, checkpoint_dir=ckpt
    )


def _cli(config: Path) -> list[str]:
    return [sys.executable, "-m", "ms_train.cli", "--config", str(config), "--peak-tflops", "0.1"]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
for _name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
    ENV.pop(_name, None)


def _wait_for(cond: Any, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    end = time.monotonic() + DEADLINE
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the first run ended (rc {proc.returncode}) before {what}")
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {DEADLINE} s waiting for {what}")
        time.sleep(0.02)


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl")]


def _holder(directory: Path) -> dict[str, Any]:
    text = (directory / LOCK_NAME).read_text()
    return json.loads(text) if text else {}


def test_a_second_lock_is_refused_naming_the_holder_until_it_is_released(tmp_path: Path) -> None:
    """In one process: flock conflicts between two opens of the same file, so this is
    the same refusal another process gets."""
    out, ckpt, other = tmp_path / "run", tmp_path / "run" / "ckpt", tmp_path / "other"
    logs: list[str] = []
    first = lock_run(
        [("train.out_dir", str(out)), ("checkpoint.dir", str(ckpt))],
        log=logs.append,
        command=["ms-train", "--preset", "tiny"],
    )
    holder = _holder(out)
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    who = f"pid {os.getpid()} on host {socket.gethostname()}, started {holder['started']}"
    with pytest.raises(RunLockedError) as e:
        lock_run([("train.out_dir", str(out))], log=logs.append)
    assert str(e.value).startswith(f"train.out_dir {out} is in use by another run ({who}")
    assert "command: ms-train --preset tiny" in str(e.value)
    # Another out dir with the same checkpoint dir (spelled as a file:// URL): refused
    # too, and the other out dir it had locked is let go again.
    with pytest.raises(RunLockedError, match=f"checkpoint.dir {ckpt} is in use .*{who}"):
        lock_run(
            [("train.out_dir", str(other)), ("checkpoint.dir", f"file://{ckpt}")], log=logs.append
        )
    lock_run([("train.out_dir", str(other))], log=logs.append).release()
    first.release()
    assert _holder(out) == {} and _holder(ckpt) == {}  # a clean end leaves no stale lock
    again = lock_run(
        [("train.out_dir", str(out)), ("checkpoint.dir", "s3://b/ck")], log=logs.append
    )
    assert again.paths == [str(out / LOCK_NAME)]  # an object store is not locked
    again.release()
    assert logs == []  # no takeover: every lock was released


def test_an_unwritable_out_dir_is_a_job_error_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(JobError, match=f"train.out_dir: cannot create the run lock {blocker}"):
        lock_run([("train.out_dir", str(blocker / "run"))], log=print)


def test_a_trainer_that_fails_to_start_lets_its_lock_go(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = load_config(None, overrides=[f"train.out_dir={out}", "model.vocab_size=100"])
    try:  # refused after it took the lock: the tokenizer has 257 tokens
        Trainer(config, peak_flops=1e9, stream=io.StringIO())
    except ConfigError as e:
        kept = e  # the half-built trainer lives on in its traceback
    logs: list[str] = []
    lock_run(
        [("train.out_dir", str(out)), ("checkpoint.dir", str(out / "ckpt"))], log=logs.append
    ).release()
    assert "model.vocab_size (100)" in str(kept) and logs == []


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize("shared", ["out_dir", "checkpoint_dir"])
def test_a_second_run_is_refused_naming_the_first_which_finishes_unharmed(
    corpus: Path, tmp_path: Path, shared: str
) -> None:
    """The first run is stopped (SIGSTOP) while it holds the lock, so that the second
    surely meets it alive; the second, on the same out dir or on another out dir with the
    same checkpoint.dir, exits 2 with one line naming the first's host, pid and start
    time; the first then goes on and finishes, its metrics.jsonl whole."""
    steps = 200
    out = tmp_path / "first"
    first_cfg = _toml(tmp_path / "first.toml", corpus, out, steps=steps)
    if shared == "out_dir":
        second_out, field, locked = out, "train.out_dir", out
    else:
        second_out, field, locked = tmp_path / "second", "checkpoint.dir", out / "ckpt"
    second_cfg = _toml(tmp_path / "second.toml", corpus, second_out, steps=steps, ckpt=out / "ckpt")
    first = subprocess.Popen(
        _cli(first_cfg), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    stopped = False
    try:
        _wait_for(lambda: len(_steps(out)) >= 1, "the first run's first metrics line", first)
        os.kill(first.pid, signal.SIGSTOP)
        stopped = True
        holder = _holder(locked)
        assert holder.get("pid") == first.pid, "the first run ended before it was stopped"
        before = read_metrics(out / "metrics.jsonl")

        second = subprocess.run(
            _cli(second_cfg), env=ENV, capture_output=True, text=True, timeout=DEADLINE
        )
        assert second.returncode == 2, second.stdout + second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith(f"ms-train: error: {field} {locked} is in use by another run")
        assert (
            f"(pid {first.pid} on host {socket.gethostname()}, started {holder['started']}, "
            f"command: " in lines[0]
        )
        assert "first.toml" in lines[0]
        assert read_metrics(out / "metrics.jsonl") == before  # the second wrote nothing
        if shared == "checkpoint_dir":
            assert not (second_out / "metrics.jsonl").exists()
            assert _holder(second_out) == {}  # its own out dir, locked first, let go

        os.kill(first.pid, signal.SIGCONT)
        stopped = False
        output, _ = first.communicate(timeout=DEADLINE * 2)
    finally:
        if first.poll() is None:
            first.kill()
            if stopped:
                os.kill(first.pid, signal.SIGCONT)
            first.wait(timeout=30)
    assert first.returncode == 0, output.decode()[-2000:]
    assert _steps(out) == list(range(1, steps + 1))
    assert _holder(out) == {} and _holder(out / "ckpt") == {}


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_the_lock_of_a_sigkilled_run_is_taken_over_and_logged(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = _toml(tmp_path / "run.toml", corpus, out, steps=400)
    # Its own session: the kill takes the run with its loader's reader and ckpt writer.
    first = subprocess.Popen(
        _cli(config),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_for(
            lambda: (out / "ckpt" / "step-00000020" / "manifest.json").exists(),
            "a checkpoint",
            first,
        )
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    stale = _holder(out)
    assert stale["pid"] == first.pid  # the file still names it; its flock died with it

    again = subprocess.run(
        _cli(_toml(tmp_path / "again.toml", corpus, out, steps=60)),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    for field, directory in (("train.out_dir", out), ("checkpoint.dir", out / "ckpt")):
        assert (
            f"ms-train: {field} {directory}: took over the lock of a run that is gone "
            f"(pid {first.pid} on host {socket.gethostname()}, started {stale['started']}"
        ) in again.stdout
    assert "resumed from step" in again.stdout
    assert _steps(out)[-1] == 60
    assert _holder(out) == {}


def _construct(config: Any) -> tuple[str, str]:
    """A rank's attempt to start a run: the error it raised, by type and message."""
    try:
        with Trainer(config, peak_flops=1e9, stream=io.StringIO()):
            return ("started", "")
    except JobError as e:
        return (type(e).__name__, str(e))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_refusal_reaches_every_rank(corpus: Path, tmp_path: Path) -> None:
    """This process holds the out dir; a 2-rank job on it fails on both ranks with the
    same RunLockedError naming this process, and neither rank writes anything."""
    out = tmp_path / "run"
    config = load_config(
        _toml(tmp_path / "run.toml", corpus, out, steps=10),
        overrides=["checkpoint.every=0"],
    )
    held = lock_run([("train.out_dir", str(out))], log=print)
    try:
        results = run_ranks(
            _construct, 2, args=(config,), timeout=150, env={"OMP_NUM_THREADS": "1"}
        )
    finally:
        held.release()
    assert results[0] == results[1], results
    kind, message = results[0]
    assert kind == "RunLockedError"
    assert message.startswith(f"train.out_dir {out} is in use by another run (pid {os.getpid()} ")
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def _construct_owning_the_group(config: Any) -> tuple[str, bool]:
    """As :func:`_construct`, with the process group left to the Trainer (as under
    torchrun): the error, and whether a group is still up afterwards."""
    import torch.distributed as dist

    try:
        with Trainer(config, peak_flops=1e9, stream=io.StringIO()):
            return ("started", dist.is_initialized())
    except JobError as e:
        return (type(e).__name__, dist.is_initialized())


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_refused_trainer_leaves_the_process_group_it_created(
    corpus: Path, tmp_path: Path
) -> None:
    """A Trainer that created the process group and then fails (here: the run is locked)
    destroys it before the error leaves the constructor. A rank that exits with a live
    gloo group may die in C++ ("terminate called without an active exception"), which
    ms-train's launcher then printed under the one-line error."""
    out = tmp_path / "run"
    config = load_config(
        _toml(tmp_path / "run.toml", corpus, out, steps=10),
        overrides=["checkpoint.every=0"],
    )
    # The ranks' env:// rendezvous joins the store this test's launcher already owns,
    # as torchrun's workers join their agent's.
    env = {
        "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    held = lock_run([("train.out_dir", str(out))], log=print)
    try:
        results = run_ranks(
            _construct_owning_the_group,
            2,
            args=(config,),
            timeout=150,
            env=env,
            init_process_group=False,
        )
    finally:
        held.release()
    assert results == [("RunLockedError", False)] * 2
