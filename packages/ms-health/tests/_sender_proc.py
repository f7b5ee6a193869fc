"""A stand-in for a training process: a Heartbeat configured from the environment
(``MS_HEALTH_URL``, ``MS_HEALTH_TOKEN``, ``MS_HEALTH_JOB``, ``RANK``, ``WORLD_SIZE``) and a
loop of short steps, until it is killed. Prints ``ready`` once the sender runs.

    python _sender_proc.py [hold-gil]

With ``hold-gil`` it takes 20 steps, prints ``holding`` and then runs a regular
expression with exponential backtracking, which keeps the GIL for longer than any test
lasts (``re`` never releases it): its heartbeat thread is alive but cannot run.
"""

from __future__ import annotations

import re
import sys
import time

from ms_health.executor import Heartbeat


def _step_loop_marker(hb: Heartbeat, steps: int | None = None) -> None:
    step = 0
    while steps is None or step < steps:
        hb.on_event("all_reduce", "wait_begin", time.perf_counter(), step=step)
        time.sleep(0.01)
        hb.on_event("all_reduce", "wait_end", time.perf_counter(), step=step)
        time.sleep(0.01)
        hb.step(step, loss=1.0 / (step + 1), tokens=256)
        step += 1


def main() -> None:
    hb = Heartbeat.from_env(interval_s=0.1)
    if hb is None:
        raise SystemExit("MS_HEALTH_URL is not set")
    with hb, hb.phase("train"):
        print("ready", flush=True)
        if sys.argv[1:] == ["hold-gil"]:
            _step_loop_marker(hb, 20)
            print("holding", flush=True)
            re.match(r"(a+)+$", "a" * 64 + "b")
        _step_loop_marker(hb)


if __name__ == "__main__":
    main()
