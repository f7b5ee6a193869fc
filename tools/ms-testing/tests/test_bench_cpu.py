"""cpu_seconds reads a process's or one thread's CPU time from /proc."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ms_testing.bench import cpu_seconds


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_thread_counts_for_itself_and_its_process_and_an_idle_one_does_not() -> None:
    idle_started, stop = threading.Event(), threading.Event()

    def idle() -> None:
        idle_started.set()
        stop.wait(30)

    sleeper = threading.Thread(target=idle)
    sleeper.start()
    idle_started.wait(10)
    assert sleeper.native_id is not None
    try:
        me = threading.get_native_id()
        process0, thread0 = cpu_seconds(), cpu_seconds(thread=me)
        idle0 = cpu_seconds(os.getpid(), thread=sleeper.native_id)
        _spin(0.3)
        # /proc counts in clock ticks (10 ms here): allow one tick of rounding each way
        assert cpu_seconds(thread=me) - thread0 >= 0.28
        assert cpu_seconds(os.getpid()) - process0 >= 0.28
        assert cpu_seconds(os.getpid(), thread=sleeper.native_id) - idle0 <= 0.02
    finally:
        stop.set()
        sleeper.join(10)


def test_a_process_that_is_not_there_is_an_error() -> None:
    with pytest.raises(FileNotFoundError):
        cpu_seconds(2**22 + 1)  # above the kernel's largest pid
