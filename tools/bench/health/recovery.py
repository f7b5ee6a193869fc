"""Recovery from one fault, by fault class, for each launcher: time to regained progress.

    .venv/bin/python tools/bench/health/recovery.py [--faults kill,hang] [--trials 1]
        [--nnodes 2] [--nproc 2] [--give-up 120] [--out PATH] [--smoke]

ms-train's small test model (``ms_testing.train.write_train_config``, width 32, a
checkpoint every 4 steps, a metrics line every step) trains on ``--nnodes`` simulated
nodes of ``--nproc`` gloo ranks each: one launcher process per node on localhost, all
meeting through torch's c10d rendezvous, as real nodes would. Once the run has passed
step 6 and committed a checkpoint, rank 1 gets the fault from outside:

- ``kill``: SIGKILL (a crashed process);
- ``hang``: SIGSTOP (a hung process: alive, silent, holding its peers in a collective).

Measured from the fault (``time.monotonic()`` in this script): the time until a step
beyond the furthest one reached before the fault first appears in ``metrics.jsonl``
(regained progress; polled every 20 ms), or none within ``--give-up`` seconds; the steps
lost (the furthest step before the fault minus the step the job resumed from); and
whether the faulted process is gone afterwards. Then everything of the job is killed.

Candidates (``CANDIDATES``): **torchrun** ``--max-restarts 3``, what users get for free:
``python -m torch.distributed.run --nnodes N --nproc-per-node P --rdzv-backend c10d
--max-restarts 3 -m ms_train.cli ...`` per node. (ms-health's launcher joins this table
when it lands.)

Prints a table and writes a JSON record (machine info, parameters, every trial) to
``--out`` (default ``bench-results/health_recovery.json``). ``--smoke``: the kill fault
only, 1 trial, 1 node of 2 ranks, give-up 60 s: a check that the script works.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ms_data import build_shards
from ms_data.build import BuildConfig
from ms_testing.bench import machine_info
from ms_testing.jobs import rank_processes, tag_env, tagged_processes, wait_gone
from ms_testing.progress import Progress
from ms_testing.train import write_train_config

WARM_STEP = 6  # the fault comes after this step and a committed checkpoint
EVERY = 4
RESUMED = re.compile(r"checkpoint: resumed from step (\d+) under")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_job(
    config: Path, tag: str, nnodes: int, nproc: int, logs: Path
) -> list[subprocess.Popen[bytes]]:
    """One ``torch.distributed.run`` agent per simulated node."""
    port, run_id = _free_port(), uuid.uuid4().hex[:12]
    env = {**tag_env(tag), "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    jobs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}"]
        cmd += [f"--nproc-per-node={nproc}", "--rdzv-backend=c10d"]
        cmd += [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}"]
        cmd += ["--max-restarts=3", "--monitor-interval=0.1"]
        cmd += ["-m", "ms_train.cli", "--config", str(config), "--peak-tflops", "0.1"]
        with open(logs / f"node{node}.log", "wb") as log:
            jobs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    return jobs


CANDIDATES: dict[str, Callable[..., list[subprocess.Popen[bytes]]]] = {
    "torchrun": torchrun_job,
}


def _inject(fault: str, pid: int) -> None:
    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)


def _resumed_from(logs: Path) -> int | None:
    found = [
        int(m) for p in logs.glob("*.log") for m in RESUMED.findall(p.read_text("utf-8", "replace"))
    ]
    return max(found) if found else None


def trial(
    candidate: str, fault: str, corpus: Path, nnodes: int, nproc: int, give_up: float
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ms-health-bench-") as tmp:
        root = Path(tmp)
        out = root / "run"
        config = write_train_config(
            root / "run.toml", shards=corpus, out_dir=out, steps=100_000, every=EVERY, width=32
        )
        tag = f"health-bench-{uuid.uuid4().hex[:8]}"
        jobs = CANDIDATES[candidate](config, tag, nnodes, nproc, root)
        watch = Progress(out)
        result: dict[str, Any] = {"candidate": candidate, "fault": fault}
        try:
            watch.wait_for(
                WARM_STEP, timeout=300, alive=lambda: all(j.poll() is None for j in jobs)
            )
            ckpt = out / "ckpt"
            while not list(ckpt.glob("step-*/manifest.json")):
                watch.poll()
                time.sleep(0.02)
            victim = rank_processes(tag)[1][0]
            watch.poll()
            before = watch.furthest
            t_fault = time.monotonic()
            _inject(fault, victim)
            regained = None
            while time.monotonic() - t_fault < give_up:
                watch.poll()
                regained = watch.first_beyond(before, after=t_fault)
                if regained is not None:
                    break
                time.sleep(0.02)
            resumed = _resumed_from(root)
            if regained is None or regained - t_fault > 15:  # keep the nodes' output
                result["logs"] = {
                    path.name: path.read_text("utf-8", "replace")[-60000:]
                    for path in sorted(root.glob("*.log"))
                }
            result.update(
                {
                    "furthest_before": before,
                    "regained_s": None if regained is None else round(regained - t_fault, 3),
                    "resumed_from": resumed,
                    "steps_lost": None if resumed is None else before - resumed,
                    "faulted_process_gone": not Path(f"/proc/{victim}").exists()
                    or _state(victim) == "Z",
                }
            )
        finally:
            for pid in tagged_processes(tag):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for job in jobs:
                job.wait(timeout=60)
            left = wait_gone(tag, timeout=30)
            result["left_behind"] = len(left)
        return result


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _corpus(root: Path) -> Path:
    import argparse as argparse_mod
    import textwrap

    out = root / "shards"
    build_shards(
        [argparse_mod.__file__, textwrap.__file__],
        out,
        BuildConfig(tokenizer="bytes"),
        progress=False,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default="kill,hang")
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--give-up", type=float, default=120.0)
    parser.add_argument("--out", default="bench-results/health_recovery.json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.faults, args.trials, args.nnodes, args.give_up = "kill", 1, 1, 60.0
    faults = args.faults.split(",")
    candidates = args.candidates.split(",")
    for f in faults:
        if f not in ("kill", "hang"):
            parser.error(f"--faults: unknown fault {f!r} (kill, hang)")
    for c in candidates:
        if c not in CANDIDATES:
            parser.error(f"--candidates: unknown candidate {c!r} ({', '.join(CANDIDATES)})")
    started = datetime.datetime.now(datetime.timezone.utc)
    trials: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ms-health-corpus-") as tmp:
        corpus = _corpus(Path(tmp))
        print(
            f"{args.nnodes} node(s) x {args.nproc} ranks on localhost, fault on rank 1 after "
            f"step {WARM_STEP} and a checkpoint (every {EVERY} steps); give up at "
            f"{args.give_up:g} s",
            flush=True,
        )
        for i in range(args.trials):
            for fault in faults:
                for candidate in candidates:
                    r = trial(candidate, fault, corpus, args.nnodes, args.nproc, args.give_up)
                    r["trial"] = i
                    trials.append(r)
                    regained = "none" if r["regained_s"] is None else f"{r['regained_s']:.2f} s"
                    print(
                        f"  trial {i} {fault:<5} {candidate:<10} regained {regained:>9}  "
                        f"steps lost {r['steps_lost']}  faulted process gone "
                        f"{r['faulted_process_gone']}  left behind {r['left_behind']}",
                        flush=True,
                    )
    print("\nmedian time to regained progress (s), by fault:")
    for fault in faults:
        for candidate in candidates:
            times = [
                t["regained_s"]
                for t in trials
                if t["fault"] == fault
                and t["candidate"] == candidate
                and t["regained_s"] is not None
            ]
            n = sum(1 for t in trials if t["fault"] == fault and t["candidate"] == candidate)
            med = f"{statistics.median(times):.2f}" if times else "none"
            print(f"  {fault:<5} {candidate:<10} {med:>8}  ({len(times)} of {n} recovered)")
    record = {
        "benchmark": "health_recovery",
        "started": started.isoformat(),
        "machine": machine_info(),
        "params": vars(args),
        "trials": trials,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
