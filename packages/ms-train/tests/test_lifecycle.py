"""A job's life on real processes and real signals (``ms-train --nproc 2``): killing the
launcher leaves nothing alive; SIGINT and SIGTERM, mid-step and mid-save, stop with a
committed checkpoint and one line, and the rerun continues with the losses of an
uninterrupted run; a second signal stops at once; a rank's JobError is printed once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from ms_data import build_shards
from ms_data.build import BuildConfig
from ms_testing.train import write_train_config
from ms_train._lock import lock_run
from ms_train.report import read_metrics

HERE = Path(__file__).parent
STEPS = 40
ACCOUNT = re.compile(
    r"^ms-train: stopped at step (\d+); checkpoint step \1 committed at (\S+); "
    r"run the same command to resume$",
    re.M,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import argparse
    import json
    import textwrap

    out = tmp_path_factory.mktemp("corpus") / "shards"
    build_shards(
        [argparse.__file__, json.__file__, textwrap.__file__],
        out,
        BuildConfig(tokenizer="bytes"),
        progress=False,
    )
    return out


def _write_config(path: Path, corpus: Path, out: Path, every: int, steps: int = STEPS) -> Path:
    return write_train_config(path, shards=corpus, out_dir=out, steps=steps, every=every)


def _env() -> dict[str, str]:
    # The held-save helpers (_held_rank, _save_hooks) import from this folder, in the
    # ranks and in their checkpoint writers.
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def _start(*args: str) -> subprocess.Popen[str]:
    """The launcher in a process group of its own, as a shell starts a job."""
    return subprocess.Popen(
        [sys.executable, *args],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _cli(config: Path, *extra: str) -> list[str]:
    return ["-m", "ms_train.cli", "--config", str(config), "--nproc", "2", *extra]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def _losses(out: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(out / "metrics.jsonl")]


def _reached(out: Path) -> int:
    with suppress(OSError, ValueError, KeyError):
        return max((s for s, _, _ in _losses(out)), default=0)
    return 0


def _committed(out: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in (out / "ckpt").glob("step-*/manifest.json"))


def _wait_for(what: str, ready: object, job: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        assert job.poll() is None, f"the job ended before {what}: {job.communicate()[0]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def _descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid``: pid -> command line."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        with suppress(OSError):
            found[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        todo += children.get(p, [])
    return found


def _segments(pids: Iterator[int] | list[int]) -> set[str]:
    """The /dev/shm files the processes ``pids`` have mapped."""
    names: set[str] = set()
    for p in pids:
        with suppress(OSError):
            for line in Path(f"/proc/{p}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    names.add(line.split("/dev/shm/", 1)[1].split(" ")[0])
    return names


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _snapshot(job: subprocess.Popen[str], saving: bool = True) -> tuple[dict[int, str], set[str]]:
    """The run's processes and segments while it trains: 2 ranks, rank 0's data reader
    and, once ``saving``, each rank's checkpoint writer. A writer between its fork and
    its exec still shows its rank's command line, and one rank may start its writer a
    moment after the other's save is seen: the count is polled until it settles."""
    want = (2, 2 if saving else 0, 1)
    deadline = time.monotonic() + 20
    while True:
        tree = _descendants(job.pid)
        ranks = [
            p
            for p, cmd in tree.items()
            if ("ms_train.cli" in cmd or "_held_rank" in cmd) and "torch.distributed.run" not in cmd
        ]
        writers = [p for p, cmd in tree.items() if "ms_ckpt._worker" in cmd]
        readers = [p for p, cmd in tree.items() if "ms_data._reader" in cmd]
        found = (len(ranks), len(writers), len(readers))
        if found == want or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert found == want, tree
    segments = _segments(tree)
    assert saving == any(s.startswith("ms_ckpt_") for s in segments), segments
    assert any(s.startswith("ms_data_") for s in segments), segments
    return tree, segments


def _assert_nothing_left(tree: dict[int, str], segments: set[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        alive = {p: cmd for p, cmd in tree.items() if _alive(p)}
        left = {s for s in segments if os.path.exists(f"/dev/shm/{s}")}
        if not alive and not left:
            return
        assert time.monotonic() < deadline, f"left alive: {alive}; left in /dev/shm: {left}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[tuple[int, float, float]]:
    """The losses of an uninterrupted run (checkpoints every 10 steps)."""
    tmp = tmp_path_factory.mktemp("whole")
    done = _run(*_cli(_write_config(tmp / "c.toml", corpus, tmp / "out", every=10)))
    assert done.returncode == 0, done.stdout + done.stderr
    losses = _losses(tmp / "out")
    assert [s for s, _, _ in losses] == list(range(1, STEPS + 1))
    return losses


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("target", ["group", "launcher"])
def test_sigkill_of_the_launcher_leaves_nothing(corpus: Path, tmp_path: Path, target: str) -> None:
    """SIGKILL of the launcher's process group (``kill -9 -PGID``), or of the launcher
    alone: no rank, reader or writer lives on, no segment of the run stays in /dev/shm."""
    # Steps enough that orphans would still train when the test gives up on them.
    config = _write_config(tmp_path / "c.toml", corpus, tmp_path / "out", every=2, steps=10**6)
    job = _start(*_cli(config))
    tree: dict[int, str] = {}
    try:
        _wait_for("a committed checkpoint", lambda: _committed(tmp_path / "out"), job)
        tree, segments = _snapshot(job)
        if target == "group":
            os.killpg(job.pid, signal.SIGKILL)
        else:
            os.kill(job.pid, signal.SIGKILL)
        job.communicate(timeout=60)
        _assert_nothing_left(tree, segments)
    finally:
        for p in [*_descendants(job.pid), *tree]:  # what a failed test would leave
            with suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        with suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize(
    ("sig", "when"),
    [
        # No SIGINT mid-step: SIGINT reaches every process of the group (ranks, loader
        # readers) at once, and mid-save it does so with the writers busy as well, a
        # superset; once the ranks have it, mid-step takes SIGTERM's path.
        pytest.param(signal.SIGTERM, "mid-step", id="SIGTERM-mid-step"),
        pytest.param(signal.SIGINT, "mid-save", id="SIGINT-mid-save"),
        pytest.param(signal.SIGTERM, "mid-save", id="SIGTERM-mid-save"),
    ],
)
def test_a_signal_stops_with_a_checkpoint_and_the_rerun_continues(
    corpus: Path,
    tmp_path: Path,
    reference: list[tuple[int, float, float]],
    sig: signal.Signals,
    when: str,
) -> None:
    """SIGINT as a terminal sends it (to the launcher's process group) or SIGTERM as a
    scheduler does (to the launcher): the ranks finish the step, commit it, and the
    launcher prints one account, no traceback, exits 128 + the signal, and leaves
    nothing; the rerun resumes there and every loss equals the uninterrupted run's.
    Mid-save: stage 2 of the save at step 10 is held for 3 s and the signal sent
    while it is held."""
    out = tmp_path / "out"
    every = 10 if when == "mid-save" else 100  # mid-step: no periodic save before the stop
    config = _write_config(tmp_path / "c.toml", corpus, out, every=every)
    marker = tmp_path / "holding"
    if when == "mid-save":
        job = _start("-m", "_held_rank", str(config), "10", "3", str(marker))
        _wait_for("a held save", marker.exists, job)
    else:
        job = _start(*_cli(config))
        _wait_for("step 8", lambda: _reached(out) >= 8, job)
    try:
        tree, segments = _snapshot(job, saving=when == "mid-save")
        if sig == signal.SIGINT:
            os.killpg(job.pid, sig)
        else:
            os.kill(job.pid, sig)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=60)
    assert job.returncode == 128 + sig, output
    accounts = ACCOUNT.findall(output)
    assert len(accounts) == 1 and output.count("ms-train: stopped") == 1, output
    step = int(accounts[0][0])
    assert accounts[0][1] == str(out / "ckpt" / f"step-{step:08d}")
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert "leaked" not in output, output  # the resource tracker's complaint
    assert step < STEPS and max(_committed(out)) == step
    assert _reached(out) == step
    _assert_nothing_left(tree, segments)

    again = _run(*_cli(config))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from step {step}" in again.stdout, again.stdout[:600]
    assert _losses(out) == reference  # before and after the stop, exactly


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stop_while_the_ranks_start_up_is_a_graceful_stop(corpus: Path, tmp_path: Path) -> None:
    """SIGTERM to the launcher as soon as its ranks exist, while they import and join
    the process group: they do not die of it. Each starts, trains one step, and the
    job stops there with a committed checkpoint and the usual account."""
    out = tmp_path / "out"
    config = _write_config(tmp_path / "c.toml", corpus, out, every=100)
    job = _start(*_cli(config))
    try:

        def ranks_exist() -> bool:
            tree = _descendants(job.pid)
            return (
                sum("ms_train.cli" in c and "torch.distributed" not in c for c in tree.values())
                == 2
            )

        _wait_for("the ranks", ranks_exist, job)
        os.kill(job.pid, signal.SIGTERM)
        output, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, output
    accounts = ACCOUNT.findall(output)
    assert len(accounts) == 1 and output.count("ms-train: stopped") == 1, output
    step = int(accounts[0][0])
    assert 1 <= step < STEPS and _committed(out) == [step], output
    assert "Traceback" not in output, output


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_second_signal_stops_at_once(corpus: Path, tmp_path: Path) -> None:
    """Ctrl-C twice while the final save is held: the job ends without that save, names
    the newest committed step, exits 130 and leaves nothing."""
    out = tmp_path / "out"
    config = _write_config(tmp_path / "c.toml", corpus, out, every=5)
    marker = tmp_path / "holding"
    # Saves from step 10 on hang (up to 200 s): the stop's save cannot commit.
    job = _start("-m", "_held_rank", str(config), "10", "200", str(marker))
    try:
        _wait_for("a held save", marker.exists, job)
        tree, segments = _snapshot(job)
        os.killpg(job.pid, signal.SIGINT)
        time.sleep(1)  # two signals at once may reach a rank as one; either way it ends
        os.killpg(job.pid, signal.SIGINT)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=60)
    assert job.returncode == 130, output
    line = (
        "ms-train: stopped at once on a second signal; newest committed checkpoint: "
        f"step 5 at {out / 'ckpt' / 'step-00000005'}; run the same command to resume"
    )
    assert output.count("ms-train: stopped") == 1 and line in output.splitlines(), output
    assert "Traceback" not in output, output
    assert _committed(out) == [5]
    _assert_nothing_left(tree, segments)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_error_on_the_ranks_is_printed_once(corpus: Path, tmp_path: Path) -> None:
    """Both ranks raise the same JobError, which only the ranks can meet (preflight in
    the launcher passes: the out dir is writable; the ranks then find it locked by
    another run): one line naming a rank, exit 2, as one process would."""
    out = tmp_path / "out"
    out.mkdir()
    config = _write_config(tmp_path / "c.toml", corpus, out, every=10)
    held = lock_run([("train.out_dir", str(out))], log=print, command=["another run"])
    try:
        done = _run(*_cli(config))
    finally:
        held.release()
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert re.fullmatch(
        rf"ms-train: error: \[rank [01]\] train\.out_dir {re.escape(str(out))} is in use by "
        rf"another run \(pid {os.getpid()} on host .*\n",
        done.stderr,
    ), done.stderr


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_one_process_stops_on_ctrl_c(corpus: Path, tmp_path: Path) -> None:
    """``ms-train`` without ``--nproc``: Ctrl-C reaches the trainer, its data reader and
    its checkpoint writer (one process group); one account, exit 130, no traceback.

    The data reader is held (SIGSTOP) until the trainer has used every prefetched batch,
    so the step the trainer finishes after Ctrl-C needs a batch the reader has yet to
    make: the reader must outlive the first Ctrl-C (it was killed with the segment's
    cleanup, and the step failed with "the NodeLoader reader process ... is gone")."""
    out = tmp_path / "out"
    config = _write_config(tmp_path / "c.toml", corpus, out, every=5)
    job = _start("-m", "ms_train.cli", "--config", str(config))
    reader = None
    try:
        _wait_for("step 8", lambda: _reached(out) >= 8, job)
        tree = _descendants(job.pid)
        assert any("ms_ckpt._worker" in cmd for cmd in tree.values()), tree
        (reader,) = [p for p, cmd in tree.items() if "ms_data._reader" in cmd]
        os.kill(reader, signal.SIGSTOP)
        seen, since = _reached(out), time.monotonic()
        while time.monotonic() - since < 1.5:  # no new step for 1.5 s: the ring is empty
            assert job.poll() is None and _reached(out) < STEPS, "the run ended"
            if _reached(out) != seen:
                seen, since = _reached(out), time.monotonic()
            time.sleep(0.05)
        os.killpg(job.pid, signal.SIGINT)
        time.sleep(0.5)
        with suppress(ProcessLookupError):  # gone: the Ctrl-C killed it
            os.kill(reader, signal.SIGCONT)
        output, _ = job.communicate(timeout=120)
    finally:
        if reader is not None:
            with suppress(ProcessLookupError):
                os.kill(reader, signal.SIGCONT)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=60)
    assert job.returncode == 130, output
    accounts = ACCOUNT.findall(output)
    assert len(accounts) == 1 and output.count("ms-train: stopped") == 1, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert max(_committed(out)) == int(accounts[0][0]) == _reached(out)
    _assert_nothing_left(tree, set())


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_rank_whose_peer_dies_during_a_save_ends_without_waiting_for_it(
    corpus: Path, tmp_path: Path
) -> None:
    """Rank 1 is SIGKILLed while both ranks' saves of step 10 are held in stage 2. Rank 0's
    next collective fails; it must then end at once, not wait at close for a save that
    needs the dead rank's part (its writer would wait up to ms-ckpt's commit timeout)
    while SIGTERM, with a grace period of 600 s here, does not end it either. The step
    stays uncommitted; step 5 is intact."""
    out = tmp_path / "out"
    config = _write_config(tmp_path / "c.toml", corpus, out, every=5)
    with open(config, "a") as f:
        f.write("grace_s = 600\n")  # [checkpoint] is the file's last table
    marker = tmp_path / "holding"
    job = _start("-m", "_held_rank", str(config), "10", "150", str(marker))
    try:
        _wait_for("a held save", marker.exists, job)
        tree = _descendants(job.pid)
        (victim,) = [
            p
            for p, cmd in tree.items()
            if "_held_rank" in cmd
            and b"RANK=1" in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        ]
        os.kill(victim, signal.SIGKILL)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=60)
    assert job.returncode == 1, output
    assert "rank 1 (killed by SIGKILL)" in output, output
    assert "rank 0 (killed" not in output, output  # it ended on its own
    assert _committed(out) == [5]
    _assert_nothing_left(tree, set())
