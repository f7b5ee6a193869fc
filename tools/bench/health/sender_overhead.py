"""What the heartbeat sender costs the training loop: ``hb.step()`` and ``hb.on_event()``
per call, and the sender thread's CPU per heartbeat.

    .venv/bin/python tools/bench/health/sender_overhead.py [--reps 7] [--calls 200000]
        [--interval 1.0] [--events-per-step 40] [--out PATH] [--smoke]

A real driver listens on loopback in this process and a real ``Heartbeat`` posts to it
every ``--interval`` seconds while the loop API is timed, so its lock is contended as it
is in training. Candidates, each ``--calls`` calls in a tight loop timed with
``time.perf_counter``:

1. ``hb.step(i, loss=x, tokens=n)``, inside ``hb.phase("train")``;
2. ``hb.on_event(name, kind, t, group=..., bytes=...)``, alternating ``wait_begin`` and
   ``wait_end`` of one collective (the kinds that do the most work);
3. the floors: the same calls on an object whose methods only ``pass``, which is what
   any Python hook costs (the call, its arguments, the loop). The added cost is the
   candidate minus its floor.

Within each repetition the four run back to back, the order rotated between
repetitions; reported are the median ns per call, the min-max over repetitions and the
added cost. From those, the loop API's cost per step at ``--events-per-step`` events
(one ``step()`` plus that many events) and the step time at which that cost is 1%.

Then the sender thread itself: posting every 20 ms for a few seconds (``--smoke``: less),
its CPU time (``/proc/self/task/<tid>/stat``, user + system) over the heartbeats it
sent, which is its CPU cost per heartbeat (record building, JSON, HTTP), and that cost
as a share of one core at ``--interval``. The driver's threads run in the same process
but are not counted.

Prints a table and writes JSON (machine, parameters, every repetition) to ``--out``
(default ``bench-results/health/sender_overhead.json``). ``--smoke``: 2000 calls, one
repetition, a 0.3 s sender run: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ms_health
from ms_health.driver import Driver
from ms_health.executor import Heartbeat
from ms_testing.bench import cpu_seconds, machine_info

TOKEN = "bench-token"


class NoOp:
    """The floor: methods with the loop API's signatures that do nothing."""

    def step(self, step: int, loss: Any = None, tokens: float | None = None) -> None:
        pass

    def on_event(self, name: str, kind: str, t: float, **attrs: Any) -> None:
        pass


def time_steps(target: Any, calls: int) -> float:
    """ns per ``step()`` call."""
    step = target.step
    t0 = time.perf_counter()
    for i in range(calls):
        step(i, loss=2.5, tokens=4096)
    return (time.perf_counter() - t0) / calls * 1e9


def time_events(target: Any, calls: int) -> float:
    """ns per ``on_event()`` call, wait_begin and wait_end alternating."""
    hook = target.on_event
    t = 0.0
    t0 = time.perf_counter()
    for _ in range(calls // 2):
        hook("reduce_scatter/bucket3", "wait_begin", t, group="dp", bytes=1 << 20)
        t += 1e-6
        hook("reduce_scatter/bucket3", "wait_end", t, group="dp", bytes=1 << 20)
    return (time.perf_counter() - t0) / (calls // 2 * 2) * 1e9


def sender_cpu(url: str, seconds: float) -> dict[str, float]:
    """CPU seconds of the sender thread per heartbeat, posting every 20 ms."""
    with Heartbeat(url, TOKEN, job="bench", interval_s=0.02) as hb, hb.phase("train"):
        time.sleep(0.2)  # connected, facts read
        thread = next(t for t in threading.enumerate() if t.name.startswith("ms-health-heart"))
        assert thread.native_id is not None
        cpu0, sent0 = cpu_seconds(thread=thread.native_id), hb.sent
        deadline = time.monotonic() + seconds
        step = 0
        while time.monotonic() < deadline:
            hb.step(step, loss=1.0, tokens=4096)
            step += 1
            time.sleep(0.001)
        cpu, sent = cpu_seconds(thread=thread.native_id) - cpu0, hb.sent - sent0
    return {"cpu_s": cpu, "heartbeats": sent, "cpu_s_per_heartbeat": cpu / max(sent, 1)}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, s")
    ap.add_argument("--events-per-step", type=int, default=40)
    ap.add_argument("--sender-seconds", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=Path("bench-results/health/sender_overhead.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny run: a check, not a measurement")
    args = ap.parse_args()
    if args.smoke:
        args.reps, args.calls, args.sender_seconds = 1, 2000, 0.3
        print("smoke: not a measurement")
    load_before = os.getloadavg()
    noop = NoOp()
    results: dict[str, list[float]] = {}
    with Driver(TOKEN, tick_s=None) as driver:
        with Heartbeat(driver.url, TOKEN, job="bench", interval_s=args.interval) as hb:
            hb.set_phase("train")
            cases: list[tuple[str, Callable[[], float]]] = [
                ("hb.step()", lambda: time_steps(hb, args.calls)),
                ("floor: no-op step()", lambda: time_steps(noop, args.calls)),
                ("hb.on_event()", lambda: time_events(hb, args.calls)),
                ("floor: no-op on_event()", lambda: time_events(noop, args.calls)),
            ]
            results = {name: [] for name, _ in cases}
            for _, run in cases:  # warm-up
                run()
            for rep in range(args.reps):
                k = rep % len(cases)
                for name, run in cases[k:] + cases[:k]:
                    results[name].append(run())
            heartbeats_during = hb.sent
        sender = sender_cpu(driver.url, args.sender_seconds)
    load_after = os.getloadavg()

    med = {name: statistics.median(v) for name, v in results.items()}
    added_step = med["hb.step()"] - med["floor: no-op step()"]
    added_event = med["hb.on_event()"] - med["floor: no-op on_event()"]
    per_step_ns = med["hb.step()"] + args.events_per_step * med["hb.on_event()"]
    one_percent_step_ms = per_step_ns * 100 / 1e6
    sender_share = sender["cpu_s_per_heartbeat"] / args.interval

    print(
        f"sender overhead: {args.calls:,} calls x {args.reps} reps, heartbeats every "
        f"{args.interval:g} s to a driver on loopback ({heartbeats_during} sent while timing); "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, "
        f"{os.cpu_count()} cores"
    )
    print("| call | ns per call, median (min-max) | added over its floor, ns |")
    print("|---|---:|---:|")
    for name, values in results.items():
        s = spread(values)
        added = (
            f"{added_step:.0f}"
            if name == "hb.step()"
            else (f"{added_event:.0f}" if name == "hb.on_event()" else "")
        )
        print(f"| {name} | {s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}) | {added} |")
    print(
        f"per step with {args.events_per_step} events: {per_step_ns / 1e3:.1f} us of loop "
        f"API, 1% of a {one_percent_step_ms:.2f} ms step"
    )
    print(
        f"sender thread: {sender['cpu_s_per_heartbeat'] * 1e3:.2f} ms CPU per heartbeat "
        f"({sender['heartbeats']:.0f} heartbeats), {sender_share * 100:.3f}% of a core at one "
        f"heartbeat per {args.interval:g} s"
    )
    record: dict[str, Any] = {
        "benchmark": "sender_overhead",
        "smoke": args.smoke,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(ms_health=ms_health.__version__),
        "parameters": {
            "reps": args.reps,
            "calls": args.calls,
            "interval_s": args.interval,
            "events_per_step": args.events_per_step,
            "sender_seconds": args.sender_seconds,
        },
        "load_average_1_5_15_min": {"before": load_before, "after": load_after},
        "ns_per_call": results,
        "median_ns_per_call": med,
        "added_ns": {"step": added_step, "on_event": added_event},
        "loop_api_ns_per_step": per_step_ns,
        "step_ms_at_which_loop_api_is_1_percent": one_percent_step_ms,
        "heartbeats_sent_while_timing": heartbeats_during,
        "sender_thread": {**sender, "share_of_a_core_at_interval": sender_share},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
