"""A stand-in for one rank of a training job, for the recovery tests: a Heartbeat from
the environment, a faulthandler dump file under ``MS_HEALTH_DUMP_DIR`` (what the node
agent's escalation reads), and a loop of short steps until it is ended.

    python _worker_proc.py [--nan-at K] [--hold-gil-at K] [--mute-at K]

``--nan-at K``: the loss is NaN from step K on (a model that went bad stays bad).
``--hold-gil-at K``: at step K it enters one long C call that keeps the GIL and never
checks for signals (``sum`` over a huge range; a backtracking regular expression would
not do: ``re`` runs Python's signal handlers), so neither its heartbeat thread nor its
SIGTERM handler runs again; only faulthandler (C) and SIGKILL reach it.
``--mute-at K``: at step K its heartbeat sender thread dies (an error it does not catch)
while the loop goes on: a monitoring fault, not a training one.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from ms_health.agent import dump_file
from ms_health.escalate import install_dump_handler
from ms_health.executor import Heartbeat


def _die(*args: object, **kwargs: object) -> None:
    raise SystemExit  # not an Exception: the sender's guard lets it end the thread


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nan-at", type=int)
    parser.add_argument("--hold-gil-at", type=int)
    parser.add_argument("--mute-at", type=int)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    dumps = install_dump_handler(dump_file(os.environ["MS_HEALTH_DUMP_DIR"], rank))
    # Like ms-train: SIGTERM asks for a graceful end (which a held GIL never runs).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    hb = Heartbeat.from_env(interval_s=0.2)
    if hb is None:
        raise SystemExit("MS_HEALTH_URL is not set")
    with hb, hb.phase("train"):
        print("ready", flush=True)
        step = 0
        while True:
            if args.hold_gil_at is not None and step == args.hold_gil_at:
                sum(range(10**15))
            if args.mute_at is not None and step == args.mute_at:
                hb._send = _die  # type: ignore[method-assign]
            time.sleep(0.05)
            step += 1
            bad = args.nan_at is not None and step >= args.nan_at
            hb.step(step, loss=float("nan") if bad else 1.0 / step, tokens=256)
    dumps.close()


if __name__ == "__main__":
    main()
