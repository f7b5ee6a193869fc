"""Straggler detection, offline: record every heartbeat of the soak's job (with CPU hogs
beside it, with or without slowed ranks), then replay the trace through
``ms_health.detectors.Straggler`` under several settings. A soak gives one number per
10 minutes; a trace tells why a finding came (its score, and how much of the step the
excess was) and what another setting would have found in the same run.

    .venv/bin/python tools/bench/health/straggler_trace.py record [--seconds 600]
        [--burners 2] [--slow-every 0] [--slow-steps 60] [--seed 0] [--interval 0.1]
        [--out PATH]
    .venv/bin/python tools/bench/health/straggler_trace.py replay TRACE [TRACE ...]
        [--setting THRESHOLD:WINDOWS:MIN_SLOWDOWN ...] [--out PATH]

**record**: the soak's job (``soak.py``: ms-train's small test model, width 32, on 2
simulated nodes x 2 ranks under ``--health``, heartbeats every ``--interval`` s, a
checkpoint every 20 steps) with ``--burners`` Python busy loops beside it at its own
priority, for ``--seconds`` from its first metrics line. The driver's ``GET /ranks``
is polled every 20 ms, faster than any rank beats, and every heartbeat seen is kept
as the driver serves it; the ones the poll missed (a rank that beat twice between two
polls, when the busy loops kept the poller from a core) are counted. With
``--slow-every S``, a random rank (seeded) is slowed 1.5x for ``--slow-steps`` steps
every S seconds (the fault tests' ``slow`` fault: before each step it spins for half
the rest of its last step, in CPU time, as a slower processor would compute longer;
before commit 2662f98 the spin counted wall time, which a busy host shortened in
CPU terms, and the README's traces were recorded so); the step it took
the fault at is read from its ``.taken`` file. Also kept: the driver's own findings in
that run. Writes JSON to ``--out`` (default
``bench-results/health/straggler_trace.json``).

**replay**: each trace's heartbeats, in the order they were seen, through a fresh
``Straggler(threshold=, windows=, window_steps=3, min_slowdown=, min_cpu_slowdown=)``
per ``--setting``, whose MIN_SLOWDOWN sets both floors (the traces' ranks train on
the CPU, so ``min_cpu_slowdown`` is the one that acts; default: ``default_detectors``'
setting, 0.4.1's floor, and none: ``1.35:3:0.25``, ``1.35:3:0.1`` and ``1.35:3:0``),
checked after each heartbeat. Per setting: the
findings as episodes (a rank flagged after a check that did not flag it, until a check
does not), each with its first window's steps and the largest score and slowdown
(excess over the peers' median, as a share of the step time) of its windows; per
slowed rank, the steps from its first slow step to the last step of the first window
that flagged it (target: within 10, as the ms-train fault test counts them), and the
episodes that no slow fault explains. A fault explains an episode of its rank with a
window ending from ``windows - 1`` windows after the first slow step (the soonest a
finding can come) to ``windows`` windows after the last one (``explained_span``). A
fault filed but never taken (the recording ended first) is shown as such. Also, per
threshold and windows, the least floor that silences every finding no fault explains
(``silencing_floor``): the margin a floor has over the trace's noise. Prints a table
per trace; with ``--out``, writes the same as JSON.

``--smoke`` (record): 25 s, a slow fault every 7 s (none in the last 10 s): a check
that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import (
    DriverView,
    corpus,
    file_fault,
    free_port,
    job_config,
    read_events,
    taken,
)

import ms_health
from ms_health.detectors import Straggler
from ms_health.record import parse_heartbeat
from ms_testing.bench import machine_info
from ms_testing.faulty_train import FAULTS_ENV, HealthJob
from ms_testing.jobs import wait_gone
from ms_testing.progress import Progress

WINDOW_STEPS = 3
DEFAULT_SETTINGS = ("1.35:3:0.25", "1.35:3:0.1", "1.35:3:0")
SLOW_FACTOR = 1.5
#: No slow fault is filed in the recording's last seconds: a rank must take it.
LAST_FAULT_S = 10.0


# ------------------------------------------------------------------------- record


def record(args: argparse.Namespace) -> dict[str, Any]:
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="ms-health-trace-") as tmp:
        root = Path(tmp)
        config = job_config(root, corpus(root), width=32, ranks=4, every=20, log_every=5)
        out, faults_dir = root / "run", root / "faults"
        faults_dir.mkdir()
        port = free_port()
        rng = random.Random(args.seed)
        burners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.burners)
        ]
        job = HealthJob(
            root,
            config,
            out,
            nnodes=2,
            nproc=2,
            interval_s=args.interval,
            max_restarts=0,
            health_endpoint=f"127.0.0.1:{port}",
            env={FAULTS_ENV: str(faults_dir)},
        )
        driver = DriverView(f"http://127.0.0.1:{port}", out, keep=True)
        slowed: list[dict[str, Any]] = []
        pending: list[tuple[dict[str, Any], Path]] = []
        try:
            watch = Progress(out)
            watch.wait_for(1, timeout=300, alive=job.running)
            t0 = time.time()
            due = t0 + args.slow_every if args.slow_every else float("inf")
            while time.time() - t0 < args.seconds:
                driver.poll()
                if not job.running():
                    raise RuntimeError(f"the job ended early:\n{job.output()[-4000:]}")
                if time.time() >= due and time.time() - t0 < args.seconds - LAST_FAULT_S:
                    fault = {"n": len(slowed), "rank": rng.randrange(4), "t": time.time()}
                    path = file_fault(
                        faults_dir,
                        f"{fault['n']:03d}-slow",
                        "slow",
                        fault["rank"],
                        arg=SLOW_FACTOR,
                        steps=args.slow_steps,
                    )
                    slowed.append(fault)
                    pending.append((fault, path))
                    due = time.time() + args.slow_every
                for fault, path in list(pending):
                    got = taken(path)
                    if got is not None:
                        fault["first_slow_step"] = got["step"]
                        pending.remove((fault, path))
                time.sleep(0.02)
            findings = [
                e["evidence"]["finding"]
                for e in read_events(out)
                if e.get("kind") == "finding" and "finding" in e.get("evidence", {})
            ]
        finally:
            job.kill()
            for b in burners:
                b.kill()
                b.wait(timeout=30)
            wait_gone(job.tag, timeout=30)
    return {
        "benchmark": "health_straggler_trace",
        "started": started.isoformat(timespec="seconds"),
        "machine": machine_info(ms_health=ms_health.__version__),
        "parameters": vars(args),
        "smoke": args.smoke,
        "slow_factor": SLOW_FACTOR,
        "slowed": slowed,
        "driver_findings": findings,
        "driver_poll_failures": driver.failures,
        "missed_heartbeats": driver.missed,
        "heartbeats": driver.heartbeats,
    }


# ------------------------------------------------------------------------- replay


def parse_setting(text: str) -> tuple[float, int, float]:
    """``"1.35:3:0.1"`` -> (threshold, windows, min_slowdown)."""
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError("three fields")
        setting = float(parts[0]), int(parts[1]), float(parts[2])
    except ValueError:
        raise ValueError(f"a setting is THRESHOLD:WINDOWS:MIN_SLOWDOWN, got {text!r}") from None
    threshold, windows, min_slowdown = setting
    # Straggler's own checks, with its words (names the bad field)
    Straggler(
        threshold=threshold,
        windows=windows,
        min_slowdown=min_slowdown,
        min_cpu_slowdown=min_slowdown,
    )
    return setting


def replay(trace: dict[str, Any], setting: tuple[float, int, float]) -> dict[str, Any]:
    """The trace's heartbeats through one ``Straggler``: its episodes, each slowed
    rank's detection in steps, and the episodes no slow fault explains."""
    threshold, windows, min_slowdown = setting
    det = Straggler(
        threshold=threshold,
        windows=windows,
        window_steps=WINDOW_STEPS,
        min_slowdown=min_slowdown,
        min_cpu_slowdown=min_slowdown,
    )
    episodes: list[dict[str, Any]] = []
    open_: dict[int, dict[str, Any]] = {}  # rank -> its episode while it stays flagged
    for raw in trace["heartbeats"]:
        rec = parse_heartbeat(json.dumps(raw))
        det.observe(rec, rec.sent_at)
        flagged: set[int] = set()
        for f in det.check(rec.sent_at):
            for rank in f.ranks:
                flagged.add(rank)
                ep = open_.get(rank)
                if ep is None:
                    ep = {"rank": rank, "steps": f.evidence["steps"], "ends": []}
                    ep["score"] = ep["slowdown"] = None
                    episodes.append(ep)
                    open_[rank] = ep
                end = f.evidence["steps"][1]
                if not ep["ends"] or ep["ends"][-1] != end:
                    ep["ends"].append(end)
                for field, value in (
                    ("score", f.evidence["scores"].get(str(rank))),
                    ("slowdown", f.evidence.get("slowdown", {}).get(str(rank))),
                ):
                    if value is not None and (ep[field] is None or value > ep[field]):
                        ep[field] = value  # the largest over the episode's windows
        open_ = {r: ep for r, ep in open_.items() if r in flagged}
    detected, explained = [], set()
    for fault in trace["slowed"]:
        first = fault.get("first_slow_step")
        if first is None:
            detected.append({"rank": fault["rank"], "first_slow_step": None, "after_steps": None})
            continue
        lo, hi = explained_span(first, trace["parameters"]["slow_steps"], windows)
        ends = [
            (end, i)
            for i, ep in enumerate(episodes)
            if ep["rank"] == fault["rank"]
            for end in ep["ends"]
            if lo <= end <= hi
        ]
        explained.update(i for _, i in ends)
        hit = min(ends)[0] - first if ends else None
        detected.append({"rank": fault["rank"], "first_slow_step": first, "after_steps": hit})
    unexplained = [ep for i, ep in enumerate(episodes) if i not in explained]
    return {
        "setting": {"threshold": threshold, "windows": windows, "min_slowdown": min_slowdown},
        "episodes": episodes,
        "slowed": detected,
        "unexplained": unexplained,
        "unexplained_max_slowdown": max(
            (ep["slowdown"] for ep in unexplained if ep["slowdown"] is not None), default=None
        ),
    }


def silencing_floor(trace: dict[str, Any], threshold: float, windows: int) -> float | None:
    """The least ``min_slowdown`` (to 0.1% of the step) at which ``threshold`` and
    ``windows`` raise no finding in ``trace`` that no slow fault explains: 0 when none
    comes without a floor, None when even 50% leaves one. A higher floor only takes
    strikes away, so a bisection finds it; this is the margin a floor has over the
    trace's noise, which the largest share in one window overstates (a strike needs
    ``windows`` windows in a row)."""

    def quiet(floor: float) -> bool:
        return not replay(trace, (threshold, windows, floor))["unexplained"]

    if quiet(0.0):
        return 0.0
    lo, hi = 0.0, 0.5
    if not quiet(hi):
        return None
    while hi - lo > 0.001:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if quiet(mid) else (mid, hi)
    return round(hi, 3)


def explained_span(first: int, slow_steps: int, windows: int) -> tuple[int, int]:
    """The last steps of the windows whose finding a rank slowed from step ``first`` for
    ``slow_steps`` steps can explain: a window ending at ``first`` or later can be a
    strike, so the ``windows``-th ends ``windows - 1`` windows later at the soonest; the
    last window holding a slow step ends within a window of the last slow step, and a
    finding may still name it ``windows`` windows after (strikes clear one window late
    when the steps come in sparse heartbeats)."""
    last = first + slow_steps - 1
    return first + (windows - 1) * WINDOW_STEPS, last + windows * WINDOW_STEPS


def _table(name: str, trace: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    steps = [h["step"] for h in trace["heartbeats"] if h.get("phase") == "train" and h.get("step")]
    params = trace["parameters"]
    lines = [
        f"\n## {name}: {len(trace['heartbeats'])} heartbeats, steps up to {max(steps, default=0)}, "
        f"{params['burners']} busy loops, {len(trace['slowed'])} slowed rank(s); the "
        f"driver found {len(trace['driver_findings'])} finding(s) in the run",
        "",
        "| threshold | windows | min_slowdown | episodes | not explained by a fault "
        "(largest excess in a window, share of the step) | least floor that silences "
        "them | slowed ranks flagged, steps after the first slow step |",
        "|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in results:
        s = r["setting"]
        top = r["unexplained_max_slowdown"]
        shown = "-" if top is None else f"{top:.1%}"
        after = ", ".join(
            "not taken"
            if d["first_slow_step"] is None
            else "missed"
            if d["after_steps"] is None
            else str(d["after_steps"])
            for d in r["slowed"]
        )
        floor = r["silencing_floor"]
        silences = "over 50%" if floor is None else f"{floor:.1%}"
        lines.append(
            f"| {s['threshold']:g} | {s['windows']} | {s['min_slowdown']:g} | "
            f"{len(r['episodes'])} | {len(r['unexplained'])} ({shown}) | {silences} | "
            f"{after or '-'} |"
        )
    return lines


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the job and keep every heartbeat")
    rec.add_argument("--seconds", type=float, default=600.0)
    rec.add_argument("--burners", type=int, default=2)
    rec.add_argument("--slow-every", type=float, default=0.0, help="s between slow faults")
    rec.add_argument("--slow-steps", type=int, default=60)
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--interval", type=float, default=0.1, help="heartbeats, s")
    rec.add_argument("--out", default="bench-results/health/straggler_trace.json")
    rec.add_argument("--smoke", action="store_true")
    rep = sub.add_parser("replay", help="run Straggler settings over recorded traces")
    rep.add_argument("traces", nargs="+")
    rep.add_argument("--setting", action="append", default=None)
    rep.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    if args.command == "record":
        if args.smoke:
            print("smoke: not a measurement", flush=True)
            args.seconds, args.slow_every, args.slow_steps = 25.0, 7.0, 20
        if args.seconds <= 0 or args.burners < 0 or args.slow_every < 0 or args.slow_steps < 1:
            parser.error(
                "--seconds and --slow-steps must be > 0, --burners and --slow-every >= 0; "
                f"got {args.seconds}, {args.slow_steps}, {args.burners}, {args.slow_every}"
            )
        trace = record(args)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(trace, default=str))
        print(
            f"recorded {len(trace['heartbeats'])} heartbeats, {len(trace['slowed'])} slow "
            f"fault(s), {len(trace['driver_findings'])} driver finding(s); wrote {out}"
        )
        return 0

    try:
        settings = [parse_setting(t) for t in (args.setting or DEFAULT_SETTINGS)]
    except ValueError as e:
        parser.error(f"--setting: {e}")
    report = {}
    for path in args.traces:
        trace = json.loads(Path(path).read_text())
        results = []
        floors: dict[tuple[float, int], float | None] = {}
        for setting in settings:
            result = replay(trace, setting)
            key = setting[:2]
            if key not in floors:
                floors[key] = silencing_floor(trace, *key)
            result["silencing_floor"] = floors[key]
            results.append(result)
        report[path] = results
        print("\n".join(_table(path, trace, results)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
