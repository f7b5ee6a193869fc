"""The stop request of one rank, with real signals to this process; the account."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ms_train._stop import Stopped, StopRequest
from ms_train.config import ConfigError, load_config


class _AtOnce(Exception):
    pass


def test_the_first_signal_asks_the_second_stops_at_once() -> None:
    calls: list[int] = []

    def at_once(first: int) -> None:
        calls.append(first)
        raise _AtOnce

    before = signal.getsignal(signal.SIGTERM)
    before_int = signal.getsignal(signal.SIGINT)
    stop = StopRequest(30.0, at_once).install()
    try:
        assert stop.agreed() == 0
        os.kill(os.getpid(), signal.SIGTERM)  # handled before the next line runs
        assert stop.agreed() == signal.SIGTERM and calls == []
        assert stop.received_at is not None
        assert stop.deadline() == pytest.approx(stop.received_at + 30.0)
        with pytest.raises(_AtOnce):
            os.kill(os.getpid(), signal.SIGINT)
        assert calls == [signal.SIGTERM]  # exit status from the first signal
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGINT) is before_int


def test_the_launchers_stop_file_is_the_first_signal(tmp_path: Path) -> None:
    calls: list[int] = []

    def at_once(first: int) -> None:
        calls.append(first)
        raise _AtOnce

    stop_file = tmp_path / "stop"
    stop = StopRequest(30.0, at_once, stop_file=stop_file).install()
    try:
        assert stop.agreed() == 0  # no file yet
        stop_file.write_text(f"{int(signal.SIGINT)} 1")
        os.utime(stop_file, (time.time() - 5, time.time() - 5))  # written 5 s ago
        assert stop.agreed() == signal.SIGINT and stop.received_at is not None
        assert stop.deadline() == pytest.approx(time.monotonic() + 25.0, abs=0.5)
        with pytest.raises(_AtOnce):  # a signal after it is the second: stop now
            os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGINT]
    finally:
        stop.restore()


def test_a_signal_beside_the_stop_file_is_the_same_stop_until_the_file_says_two(
    tmp_path: Path,
) -> None:
    """A scheduler may signal the launcher and every rank at once: a rank's signal that
    comes with the launcher's file (before its step has read it) is not a second."""
    calls: list[int] = []

    def at_once(first: int) -> None:
        calls.append(first)
        raise _AtOnce

    stop_file = tmp_path / "stop"
    stop_file.write_text(f"{int(signal.SIGTERM)} 1")
    stop = StopRequest(30.0, at_once, stop_file=stop_file).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [] and stop.agreed() == signal.SIGTERM
    finally:
        stop.restore()
    stop_file.write_text(f"{int(signal.SIGTERM)} 2")  # the launcher had a second signal
    stop = StopRequest(30.0, at_once, stop_file=stop_file).install()
    try:
        with pytest.raises(_AtOnce):
            os.kill(os.getpid(), signal.SIGINT)
        assert calls == [signal.SIGTERM]
    finally:
        stop.restore()


def test_the_account() -> None:
    done = Stopped(signal.SIGINT, 12, 12, "runs/x/ckpt/")
    assert done.exit_status == 130
    assert done.account() == (
        "stopped at step 12; checkpoint step 12 committed at runs/x/ckpt/step-00000012; "
        "run the same command to resume"
    )
    late = Stopped(signal.SIGTERM, 12, 10, "runs/x/ckpt", "not committed within 5 s")
    assert late.exit_status == 143
    assert late.account() == (
        "stopped at step 12; the final checkpoint did not commit (not committed within 5 s); "
        "newest committed checkpoint: step 10 at runs/x/ckpt/step-00000010; "
        "run the same command to resume"
    )
    none = Stopped(signal.SIGTERM, 3, None, "c", "disk full")
    assert "no checkpoint is committed under c, a rerun starts fresh" in none.account()


def test_grace_is_validated() -> None:
    assert load_config(None, preset="tiny").checkpoint.grace_s == 60.0
    with pytest.raises(ConfigError, match=r"checkpoint.grace_s must be a number > 0.0, got 0"):
        load_config(None, preset="tiny", overrides=["checkpoint.grace_s=0"])
