"""Fault injection on real processes and real files. Each fault must leave the previous
committed checkpoint loadable, ``latest`` on it, and the next save working.

The stage-2 test hook ``MS_CKPT_TEST_PAUSE`` (checkpointer.py) holds the writer at a
named point so that a kill lands there. Every subprocess runs under a deadline.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ms_ckpt import CheckpointCorruptError, Checkpointer, CheckpointWriteError

HERE = Path(__file__).parent
if str(HERE) not in sys.path:  # the writer process imports FaultyFileSystem by name
    sys.path.insert(0, str(HERE))
from _ckpt_support import FaultyFileSystem, big_state  # noqa: E402

DEADLINE = 60.0


def wait_for(cond: Any, what: str, timeout: float = DEADLINE) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def latest(root: Path) -> str:
    return (root / "latest").read_text().strip()


def assert_loads_step(root: Path, step: int, **kw: Any) -> None:
    got = {f"t{i}": torch.empty(64, 64) for i in range(12)}
    with Checkpointer(str(root), stage2="process") as ckpt:
        assert ckpt.load(got, **kw) == step
    want = big_state()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_sigkill_writer_mid_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = big_state()
    with Checkpointer(str(tmp_path), keep_last=3) as ckpt:
        ckpt.save(1, state).wait()
        monkeypatch.setenv("MS_CKPT_TEST_PAUSE", "record:0.3")
        handle = ckpt.save(2, state)
        shard = tmp_path / "step-00000002" / "rank-00000.bin"
        wait_for(lambda: shard.exists() and shard.stat().st_size > 0, "the first record")
        pid = ckpt.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(CheckpointWriteError, match=r"writer process \(pid \d+\) died") as e:
            handle.wait(timeout=DEADLINE)
        assert e.value.step == 2
        assert ckpt.steps() == {1: True, 2: False} and latest(tmp_path) == "step-00000001"
        assert_loads_step(tmp_path, 1)
        monkeypatch.delenv("MS_CKPT_TEST_PAUSE")
        ckpt.save(3, state).wait()  # a new writer process; step 2's partial is cleaned
        assert ckpt.writer_pid != pid
        assert ckpt.steps() == {1: True, 3: True} and latest(tmp_path) == "step-00000003"
    assert_loads_step(tmp_path, 3)


def run_hanging_trainer(root: Path, point: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_ckpt_support.py"), "hang", str(root), point],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the trainer prints once stage 1 of step 2 returned
    if not line:
        proc.kill()
        proc.wait(DEADLINE)
        pytest.fail(f"trainer exited with {proc.wait(DEADLINE)} before saving")
    return proc, json.loads(line)


def kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(DEADLINE)
    if proc.stdout is not None:
        proc.stdout.close()


def test_kill_trainer_between_stage1_and_stage2(tmp_path: Path) -> None:
    proc, info = run_hanging_trainer(tmp_path, "stage2")
    try:
        kill(proc)
        # The orphaned writer notices and stops without committing; the trainer's
        # resource tracker removes the host buffer.
        wait_for(lambda: pid_gone(info["writer"]), "the orphaned writer to exit", 20)
        wait_for(lambda: not Path("/dev/shm", info["pool"]).exists(), "the segment", 20)
    finally:
        if not pid_gone(info["writer"]):
            os.kill(info["writer"], signal.SIGKILL)
    assert not (tmp_path / "step-00000002" / "manifest.json").exists()
    assert latest(tmp_path) == "step-00000001"
    assert_loads_step(tmp_path, 1)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(2, big_state()).wait()
    assert_loads_step(tmp_path, 2)


def test_kill_during_manifest_write(tmp_path: Path) -> None:
    proc, info = run_hanging_trainer(tmp_path, "manifest")
    step_dir = tmp_path / "step-00000002"
    try:
        wait_for(lambda: any(step_dir.glob("manifest.json.tmp-*")), "the temporary manifest")
        os.kill(info["writer"], signal.SIGKILL)
        kill(proc)
    finally:
        if not pid_gone(info["writer"]):
            os.kill(info["writer"], signal.SIGKILL)
    (tmp,) = step_dir.glob("manifest.json.tmp-*")
    assert tmp.stat().st_size > 0  # half a manifest on disk, never renamed
    assert not (step_dir / "manifest.json").exists()
    assert latest(tmp_path) == "step-00000001"
    assert_loads_step(tmp_path, 1)
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.steps() == {1: True, 2: False}
        ckpt.save(2, big_state()).wait()
        assert not any(step_dir.glob("manifest.json.tmp-*"))
    assert_loads_step(tmp_path, 2)


def record(root: Path, step: int, key: str) -> dict[str, Any]:
    manifest = json.loads((root / f"step-{step:08d}" / "manifest.json").read_text())
    (rec,) = [r for r in manifest["records"] if r["key"] == key]
    return rec  # type: ignore[no-any-return]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_shard_names_file_and_key(tmp_path: Path, damage: str) -> None:
    with Checkpointer(str(tmp_path), stage2="inline") as ckpt:
        ckpt.save(1, big_state()).wait()
        ckpt.save(2, big_state()).wait()
    shard = tmp_path / "step-00000002" / "rank-00000.bin"
    rec = record(tmp_path, 2, "t5")
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[rec["offset"] + rec["length"] // 2] ^= 0x10
        shard.write_bytes(bytes(data))
        match = r"rank-00000\.bin: record 't5': crc32"
    else:
        shard.write_bytes(bytes(data[: rec["offset"] + 3]))
        match = r"rank-00000\.bin: record 't5' needs bytes .* \(truncated\)"
    got = {f"t{i}": torch.full((64, 64), -1.0) for i in range(12)}
    with Checkpointer(str(tmp_path), stage2="inline") as ckpt:
        with pytest.raises(CheckpointCorruptError, match=match):
            ckpt.load(got)
        # Verified before restoring: a failed load leaves the live state untouched.
        assert all(torch.equal(t, torch.full((64, 64), -1.0)) for t in got.values())
        with pytest.warns(UserWarning, match="falling back to step 1"):
            assert ckpt.load(got, fallback=True) == 1
        ckpt.save(3, big_state()).wait()
    assert_loads_step(tmp_path, 3)


@pytest.mark.parametrize("damage", ["garbage", "edited"])
def test_corrupted_manifest(tmp_path: Path, damage: str) -> None:
    with Checkpointer(str(tmp_path), stage2="inline") as ckpt:
        ckpt.save(1, big_state()).wait()
        ckpt.save(2, big_state()).wait()
    path = tmp_path / "step-00000002" / "manifest.json"
    if damage == "garbage":
        path.write_bytes(b"\x00{not json")
        match = "manifest.json: manifest is not valid JSON"
    else:  # valid JSON, but a field changed: the manifest's own checksum catches it
        text = path.read_text()
        edited = text.replace('"shape": [\n    64,', '"shape": [\n    32,', 1)
        assert edited != text
        path.write_text(edited)
        match = "manifest.json: manifest checksum mismatch"
    with pytest.raises(CheckpointCorruptError, match=match):
        assert_loads_step(tmp_path, 2)
    with pytest.warns(UserWarning, match="falling back to step 1"):
        assert_loads_step(tmp_path, 1, fallback=True)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES])
def test_write_error_is_clear_and_training_continues(tmp_path: Path, err: int) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    flag = tmp_path / "fail"
    # EACCES for real needs a read-only directory, but root ignores permission bits (these
    # tests run as root in CI): there the fault-injecting filesystem raises it instead.
    use_chmod = err == errno.EACCES and os.geteuid() != 0
    fs = None if use_chmod else FaultyFileSystem(str(flag), err)
    state = big_state()

    def fail(on: bool) -> None:
        if use_chmod:
            root.chmod(0o555 if on else 0o755)
        elif on:
            flag.touch()
        else:
            flag.unlink()

    with Checkpointer(str(root), fs=fs, keep_last=1) as ckpt:
        ckpt.save(1, state).wait()
        fail(True)
        handle = ckpt.save(2, state)
        with pytest.raises(CheckpointWriteError, match=os.strerror(err)) as e:
            handle.wait()
        assert e.value.errno == err and e.value.step == 2
        assert "'latest' and the committed checkpoints are untouched" in str(e.value)
        assert latest(root) == "step-00000001" and ckpt.steps() == {1: True}
        # An error nobody waited for surfaces on the next save, once.
        third = ckpt.save(3, state)
        wait_for(third.done, "step 3 to fail")  # done() collects, it does not raise
        fail(False)
        with pytest.raises(CheckpointWriteError, match="saving step 3 failed"):
            ckpt.save(4, state)
        ckpt.save(4, state).wait()
        assert latest(root) == "step-00000004" and ckpt.steps() == {4: True}
