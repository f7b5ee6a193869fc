"""Detection and recovery from one fault, by fault class, for ms-health and for plain
torchrun: how soon each notices, how soon the job makes new progress, what it leaves.

    .venv/bin/python tools/bench/health/recovery.py [--faults kill,hang,nan,slow]
        [--candidates ms-health,torchrun] [--trials 1] [--nnodes 2] [--nproc 2]
        [--give-up 120] [--interval 0.5] [--out PATH] [--smoke]

ms-train's small test model (``ms_testing.train.write_train_config``: width 32, a
checkpoint every 4 steps, a metrics line every step) trains on ``--nnodes`` simulated
nodes of ``--nproc`` gloo ranks each on localhost, meeting through torch's c10d
rendezvous as real nodes would. Every rank runs ``ms_testing.faulty_train`` (ms-train's
trainer, which also takes faults dropped into a folder while it runs). Candidates:

- **ms-health**: ``ms_testing.faulty_train.HealthJob``: one ms-train launcher per node
  with ``--health`` (the driver with the default detectors and the ``Recovery`` policy
  in one launcher, a node agent in each, heartbeats every ``--interval`` s) and
  ``--max-restarts 3``;
- **torchrun**: one ``python -m torch.distributed.run --max-restarts 3
  --rdzv-backend c10d --monitor-interval 0.1`` agent per node, what users get for free
  (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as ms-train's launcher sets, without
  which a restarted round on 2 nodes cannot connect).

Once the run has passed step 6 and committed a checkpoint, rank 1 gets one fault:

- ``kill``: SIGKILL from outside (a crashed process);
- ``hang``: SIGSTOP from outside (alive, silent, holding its peers in a collective);
- ``nan``: a fault file: rank 1 poisons its weights before its next step, whose loss
  is then NaN (the ``.taken`` file says which step);
- ``slow``: a fault file: every step of rank 1 from then on takes 1.5x as long.
  Measured with the fault tests' straggler set-up instead of the one above (width 64, a
  metrics line every 10 steps, heartbeats every 0.1 s): a heartbeat carries the last
  step's time only, so heartbeats must come about once a step, as the 0.5 s default
  does for real steps of a second or more; and rank 0's own per-step work (the metrics
  line) must stay small against a step, as it is in real training.

The fault's time is the wall clock just before the signal, or the ``.taken`` file's
modification time (the rank writes it just before applying the fault). Measured:

- **detection**: ms-health: the first ``finding`` event in ``<out>/health/events.jsonl``
  that names rank 1 (kill, hang: kind crash or hang; slow: straggler) or, for nan, the
  first ``nonfinite`` finding; its ``time`` is the driver's ``time.time()``. torchrun:
  the first line its elastic agent logs after the fault (its log lines carry their
  time, to the millisecond); for a hang or a NaN it logs nothing;
- **regained**: from ``metrics.jsonl`` (polled every 20 ms): the first step, after the
  restart's rewind of the metrics, above every finite-loss step seen before it;
- **resumed from** (the ``resumed from step`` line), **steps lost** (the furthest
  finite-loss step before the fault minus the resumed-from step), whether the faulted
  process is gone 2 s after regained progress, and the job's processes **left behind**
  then (alive but no longer under a launcher, or stopped);
- nan: the step the finding names against the ``.taken`` step; slow: the last step of
  the straggler finding's windows minus the first slow step, other ranks flagged and
  processes ended (both must be none).

torchrun and a NaN: run like the others, watched for 30 s after the NaN (the loss
stays NaN; nothing is detected). torchrun and a slow rank: not run, nothing in torchrun
looks at step times.

Targets (issue 16), for ms-health: a crash detected within 2 s; a hang within the
``train`` phase's hang timeout + 2 s (the timeout the hang finding about rank 1 says it
applied; without one, the timeout the driver's saved state held before the fault, which
can lag what it has learned); a NaN at its step; a straggler within 10 steps.
And no slower than torchrun to regain progress after a crash. Prints a table and
writes a JSON record (machine info, parameters, every trial) to ``--out`` (default
``bench-results/health/recovery.json``). ``--smoke``: the kill fault only (unless
``--faults`` says otherwise), 1 trial, 1 node of 2 ranks, give up at 60 s: a check that
the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _harness import (
    LogTail,
    TorchrunJob,
    corpus,
    file_fault,
    free_port,
    job_config,
    left_behind,
    read_events,
    signal_fault,
    taken,
)
from _timeline import (
    Record,
    finite_loss,
    first_event,
    first_finding,
    furthest_good,
    regained,
)

import ms_health
from ms_ckpt import committed_steps
from ms_testing.bench import machine_info
from ms_testing.faulty_train import FAULTS_ENV, HealthJob
from ms_testing.jobs import wait_gone
from ms_testing.progress import Progress

WARM_STEP = 6  # the fault comes after this step and a committed checkpoint
EVERY = 4
VICTIM = 1
SETTLE_S = 2.0  # after regained progress, before looking for what was left
NAN_WATCH_S = 30.0  # torchrun and a NaN: how long to watch nothing happen
SLOW_WATCH_STEPS = 40  # a slow rank: steps to wait for the straggler finding
FAULTS = ("kill", "hang", "nan", "slow")
CANDIDATES = ("ms-health", "torchrun")
#: Finding kinds that detect each fault.
EXPECTED = {
    "kill": ("crash", "hang"),
    "hang": ("crash", "hang"),
    "nan": ("nonfinite",),
    "slow": ("straggler",),
}
NOT_RUN = {
    ("torchrun", "slow"): "n/a: torchrun has no straggler detection (nothing looks at step times)"
}


@dataclass(frozen=True)
class Setup:
    width: int
    log_every: int
    interval_s: float


def setup_for(fault: str, interval_s: float) -> Setup:
    if fault == "slow":
        return Setup(width=64, log_every=10, interval_s=0.1)
    return Setup(width=32, log_every=1, interval_s=interval_s)


def learned_hang_timeout(out: Path, interval_s: float) -> float | None:
    """The ``train`` phase's hang timeout the driver holds now (its saved state loaded
    into the default hang detector), or None before it saved one."""
    from ms_health.detectors import Hang, default_detectors

    try:
        state = json.loads((out / "health" / "driver-state.json").read_text())
        hang = next(d for d in default_detectors(interval_s) if isinstance(d, Hang))
        hang.load_state_dict(state["detectors"]["hang"])
    except (OSError, ValueError, KeyError, StopIteration):
        return None
    return hang.timeout_for("train")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _seen(watch: Progress, offset: float) -> list[Record]:
    return [(s, t + offset, r) for s, t, r in watch.seen]


def _warm(job: Any, watch: Progress, out: Path) -> None:
    watch.wait_for(WARM_STEP, timeout=300, alive=job.running)
    deadline = time.monotonic() + 120
    while not committed_steps(str(out / "ckpt")):
        if time.monotonic() > deadline or not job.running():
            raise TimeoutError("no committed checkpoint")
        watch.poll()
        time.sleep(0.05)


def trial(candidate: str, fault: str, shards: Path, args: argparse.Namespace) -> dict[str, Any]:
    setup = setup_for(fault, args.interval)
    with tempfile.TemporaryDirectory(prefix="ms-health-bench-") as tmp:
        root = Path(tmp)
        out, faults = root / "run", root / "faults"
        ranks = args.nnodes * args.nproc
        config = job_config(
            root, shards, width=setup.width, ranks=ranks, every=EVERY, log_every=setup.log_every
        )
        env = {FAULTS_ENV: str(faults)}
        job: Any
        if candidate == "ms-health":
            job = HealthJob(
                root,
                config,
                out,
                nnodes=args.nnodes,
                nproc=args.nproc,
                interval_s=setup.interval_s,
                max_restarts=3,
                health_endpoint=f"127.0.0.1:{free_port()}",
                env=env,
            )
        else:
            job = TorchrunJob(
                root, config, out, nnodes=args.nnodes, nproc=args.nproc, max_restarts=3, env=env
            )
        offset = time.time() - time.monotonic()
        watch, tail = Progress(out), LogTail(list(job.logs))
        result: dict[str, Any] = {"candidate": candidate, "fault": fault, "setup": vars(setup)}
        t_fault: float | None = None
        try:
            _warm(job, watch, out)
            victim = job.rank_pid(VICTIM, 60)
            if candidate == "ms-health":
                result["hang_timeout_s"] = learned_hang_timeout(out, setup.interval_s)
            result["newest_committed_before"] = max(committed_steps(str(out / "ckpt")))
            watch.poll()
            fault_step: int | None = None
            if fault in ("kill", "hang"):
                t_fault = signal_fault(fault, victim)
            else:
                spec = {"arg": 1.5} if fault == "slow" else {}
                path = file_fault(faults, f"{fault}-0", fault, VICTIM, **spec)
                deadline = time.monotonic() + 60
                while (got := taken(path)) is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {VICTIM} did not take the {fault} fault")
                    watch.poll()
                    time.sleep(0.02)
                t_fault, fault_step = got["wall"], got["step"]
            result.update(victim_pid=victim, fault_wall=t_fault, fault_step=fault_step)
            t_fault_mono = t_fault - offset
            give_up = args.give_up
            if candidate == "torchrun" and fault == "nan":
                give_up = min(give_up, NAN_WATCH_S)
            gone_at = None
            rec = None
            read_at = 0.0
            while time.monotonic() - t_fault_mono < give_up:
                watch.poll()
                tail.poll()
                if gone_at is None and not _alive(victim):
                    gone_at = time.time()
                if fault == "slow":
                    if time.monotonic() - read_at < 0.25:
                        time.sleep(0.02)
                        continue
                    read_at = time.monotonic()
                    found = first_finding(read_events(out), t_fault, ("straggler",))
                    assert fault_step is not None
                    if found is not None or watch.furthest >= fault_step + SLOW_WATCH_STEPS:
                        break
                else:
                    rec = regained(_seen(watch, offset), t_fault)
                    if rec is not None and rec["regained_t"] is not None:
                        break
                time.sleep(0.02)
            settle = time.monotonic() + SETTLE_S
            while time.monotonic() < settle:
                watch.poll()
                tail.poll()
                if gone_at is None and not _alive(victim):
                    gone_at = time.time()
                time.sleep(0.05)
            result["left_behind"] = left_behind(job.tag, [p.pid for p in job.launchers])
            result["faulted_process_gone_s"] = None if gone_at is None else gone_at - t_fault
            result["faulted_process_gone"] = not _alive(victim)
            before = furthest_good(_seen(watch, offset), t_fault)
            if fault == "nan" and fault_step is not None:
                # The step before the NaN's was good even if rank 0 logged it only after
                # rank 1 took the fault.
                before = max(before, fault_step - 1)
            result["furthest_before"] = before
            result["regained"] = rec
        except TimeoutError as e:
            result["error"] = str(e)
        finally:
            job.kill()
            result["cleanup_left"] = len(wait_gone(job.tag, timeout=30))
            tail.poll()
        if t_fault is not None:
            analyse(result, t_fault, read_events(out), tail, _seen(watch, offset))
        if result.get("error") or (result.get("regained_s") is None and fault != "slow"):
            result["logs"] = tail.text()
        return result


def analyse(
    result: dict[str, Any],
    t_fault: float,
    events: list[dict[str, Any]],
    tail: LogTail,
    seen: list[Record],
) -> None:
    """Fill ``result`` in from what the trial saw (wall times, relative to the fault)."""
    fault, candidate = result["fault"], result["candidate"]

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t_fault, 3)

    findings = [
        {
            "s": rel(float(e["time"])),
            "kind": e["evidence"]["finding"]["kind"],
            "ranks": e["ranks"],
            "step": e["evidence"]["finding"].get("step"),
            "message": e["message"][:300],
        }
        for e in events
        if e["kind"] == "finding" and float(e["time"]) >= t_fault
    ]
    result["findings"] = findings
    rank = None if fault == "nan" else VICTIM
    found = first_finding(events, t_fault, EXPECTED[fault], rank=rank)
    detection: dict[str, Any] | None = None
    if found is not None:
        f = found["evidence"]["finding"]
        detection = {
            "s": rel(float(found["time"])),
            "by": f"ms-health {f['kind']}",
            "ranks": found["ranks"],
            "step": f.get("step"),
            "message": found["message"][:300],
        }
    hang = first_finding(events, t_fault, ("hang",), rank=VICTIM)
    if hang is not None:
        # The timeout the hang detector applied (its saved state, read before the
        # fault, can lag what it has learned by then).
        shown = hang["evidence"]["finding"]["evidence"].get("ranks", {})
        result["hang_finding_timeout_s"] = shown.get(str(VICTIM), {}).get("timeout_s")
    agent = next(((t, n, m) for t, n, m in tail.elastic if t >= t_fault - 0.001), None)
    if agent is not None:
        result["agent_log"] = {"s": rel(agent[0]), "file": agent[1], "line": agent[2][:300]}
        if candidate == "torchrun" and fault == "kill":
            detection = {"s": rel(agent[0]), "by": "torchrun agent log", "line": agent[2][:300]}
    result["detection"] = detection
    diagnosis = first_event(events, "diagnosis", t_fault)
    if diagnosis is not None:
        result["diagnosis"] = {
            "s": rel(float(diagnosis["time"])),
            "suspects": diagnosis["ranks"],
            "silent": diagnosis["evidence"].get("silent"),
        }
    result["rollback"] = first_event(events, "rollback", t_fault) is not None
    result["orders"] = sum(1 for e in events if e["kind"] == "order" and e["time"] >= t_fault)
    result["resumed"] = [step for _, _, step in tail.resumed]
    resumed = result["resumed"][-1] if result["resumed"] else None
    result["resumed_from"] = resumed
    before = result.get("furthest_before")
    result["steps_lost"] = None if resumed is None or before is None else before - resumed
    rec = result.get("regained")
    if rec is not None:
        for key, name in (
            ("rewind_t", "rewind_s"),
            ("first_step_t", "first_step_s"),
            ("regained_t", "regained_s"),
        ):
            rec[name] = rel(rec.pop(key))
    result["regained_s"] = None if rec is None else rec.get("regained_s")
    if fault == "nan":
        nan_steps = [s for s, t, r in seen if t >= t_fault and not finite_loss(r)]
        result["nan_steps_logged"] = len(nan_steps)
        if detection is not None:
            result["nan_same_step"] = detection["step"] == result["fault_step"]
    if fault == "slow" and detection is not None and detection["step"] is not None:
        result["straggler_steps"] = detection["step"] - result["fault_step"]
    if fault == "slow":
        result["others_flagged"] = sorted(
            {r for f in findings if f["kind"] == "straggler" for r in f["ranks"] if r != VICTIM}
        )
        result["other_findings"] = [f for f in findings if f["kind"] != "straggler"]
    result["target"] = target(result)


def target(r: dict[str, Any]) -> dict[str, Any] | None:
    """Issue 16's target for the fault class, and whether this trial met it."""
    if r["candidate"] != "ms-health":
        return None
    det = r.get("detection")
    latency = None if det is None else det["s"]
    if r["fault"] == "kill":
        return {"what": "crash detected within 2 s", "met": latency is not None and latency <= 2.0}
    if r["fault"] == "hang":
        timeout = r.get("hang_finding_timeout_s") or r.get("hang_timeout_s")
        bound = None if timeout is None else round(timeout + 2.0, 2)
        met = latency is not None and bound is not None and latency <= bound
        return {"what": f"hang detected within the train timeout + 2 s = {bound} s", "met": met}
    if r["fault"] == "nan":
        return {"what": "NaN detected at its step", "met": bool(r.get("nan_same_step"))}
    steps = r.get("straggler_steps")
    met = steps is not None and steps <= 10 and not r.get("others_flagged") and not r["orders"]
    return {"what": "straggler flagged within 10 steps, nobody else, nothing ended", "met": met}


# ---------------------------------------------------------------------- report


def _fmt(x: float | None, unit: str = "") -> str:
    return "none" if x is None else f"{x:.2f}{unit}"


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _span(values: list[Any], spec: str = ".2f") -> str:
    """Median (min-max) of the values that are not None."""
    got = [v for v in values if v is not None]
    if not got:
        return "none"
    med = statistics.median(got)
    if len(got) == 1:
        return format(med, spec)
    return f"{format(med, spec)} ({format(min(got), spec)}-{format(max(got), spec)})"


def _gone(r: dict[str, Any]) -> str:
    if r["fault"] == "slow":
        return "n/a"
    gone_s = r.get("faulted_process_gone_s")
    after = "" if gone_s is None else f" after {gone_s:.2f} s"
    return f"{r.get('faulted_process_gone')}{after}"


def line(r: dict[str, Any]) -> str:
    if "not_run" in r:
        return f"  {r['fault']:<5} {r['candidate']:<10} {r['not_run']}"
    if r.get("error"):
        return f"  {r['fault']:<5} {r['candidate']:<10} ERROR: {r['error']}"
    det = r.get("detection")
    detected = "not detected" if det is None else f"detected {det['s']:.2f} s ({det['by']})"
    parts = [
        f"  trial {r['trial']} {r['fault']:<5} {r['candidate']:<10} {detected}",
        f"regained {_fmt(r.get('regained_s'), ' s')}",
        f"resumed from {r.get('resumed_from')}, lost {r.get('steps_lost')}",
        f"faulted gone {_gone(r)}",
        f"left {len(r.get('left_behind', []))}+{r.get('cleanup_left')}",
    ]
    if r.get("diagnosis"):
        parts.append(f"named {r['diagnosis']['suspects']} at {r['diagnosis']['s']:.2f} s")
    if r["fault"] == "hang" and r.get("target"):
        parts.append(r["target"]["what"])
    if r["fault"] == "nan":
        step = None if det is None else det.get("step")
        parts.append(f"finding step {step} vs taken {r.get('fault_step')}")
    if r["fault"] == "slow":
        parts.append(
            f"straggler after {r.get('straggler_steps')} steps, others {r.get('others_flagged')}"
        )
    return ", ".join(parts)


def summary(trials: list[dict[str, Any]], faults: list[str], candidates: list[str]) -> list[str]:
    rows = [
        "| fault | candidate | detected | detection s | regained s | steps lost | "
        "resumed from | faulted gone | left behind | target (ms-health) |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for fault in faults:
        for cand in candidates:
            ts = [t for t in trials if t["fault"] == fault and t["candidate"] == cand]
            if not ts:
                continue
            if "not_run" in ts[0]:
                rows.append(f"| {fault} | {cand} | {ts[0]['not_run']} | | | | | | | |")
                continue
            ok = [t for t in ts if not t.get("error")]
            det = [t["detection"]["s"] for t in ok if t.get("detection")]
            tgt = [t["target"] for t in ok if t.get("target")]
            met = (
                f"{tgt[0]['what']}: {'met' if all(x['met'] for x in tgt) else 'NOT met'} "
                f"({sum(x['met'] for x in tgt)}/{len(tgt)})"
                if tgt
                else ""
            )
            regained = (
                "n/a (no restart)" if fault == "slow" else _span([t.get("regained_s") for t in ok])
            )
            gone = (
                "n/a"
                if fault == "slow"
                else f"{sum(bool(t.get('faulted_process_gone')) for t in ok)}/{len(ok)}"
            )
            rows.append(
                f"| {fault} | {cand} | {len(det)}/{len(ts)} | {_span(list(det))} | {regained} | "
                f"{_span([t.get('steps_lost') for t in ok], 'g')} | "
                f"{[t.get('resumed_from') for t in ok]} | {gone} | "
                f"{sum(len(t.get('left_behind', [])) for t in ok)} | {met} |"
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--faults", default=None, help=f"default: {','.join(FAULTS)}")
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--give-up", type=float, default=120.0)
    parser.add_argument("--interval", type=float, default=0.5, help="heartbeats, s")
    parser.add_argument("--out", default="bench-results/health/recovery.json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.faults = args.faults or "kill"
        args.trials, args.nnodes, args.give_up = 1, 1, 60.0
        print("smoke: not a measurement")
    faults = (args.faults or ",".join(FAULTS)).split(",")
    candidates = args.candidates.split(",")
    for f in faults:
        if f not in FAULTS:
            parser.error(f"--faults: unknown fault {f!r} ({', '.join(FAULTS)})")
    for c in candidates:
        if c not in CANDIDATES:
            parser.error(f"--candidates: unknown candidate {c!r} ({', '.join(CANDIDATES)})")
    started = datetime.datetime.now(datetime.timezone.utc)
    trials: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ms-health-corpus-") as tmp:
        shards = corpus(Path(tmp))
        print(
            f"{args.nnodes} node(s) x {args.nproc} ranks on localhost, fault on rank {VICTIM} "
            f"after step {WARM_STEP} and a checkpoint (every {EVERY} steps); give up at "
            f"{args.give_up:g} s; ms-health heartbeats every {args.interval:g} s (slow: 0.1 s)",
            flush=True,
        )
        for i in range(args.trials):
            for fault in faults:
                # The candidates alternate which goes first, trial by trial.
                order = candidates[i % len(candidates) :] + candidates[: i % len(candidates)]
                for cand in order:
                    if (cand, fault) in NOT_RUN:
                        r: dict[str, Any] = {
                            "candidate": cand,
                            "fault": fault,
                            "trial": i,
                            "not_run": NOT_RUN[(cand, fault)],
                        }
                    else:
                        r = trial(cand, fault, shards, args)
                        r["trial"] = i
                    trials.append(r)
                    print(line(r), flush=True)
    print()
    for row in summary(trials, faults, candidates):
        print(row)
    if "kill" in faults and set(CANDIDATES) <= set(candidates):
        ours = _median(
            [
                t.get("regained_s")
                for t in trials
                if t["fault"] == "kill" and t["candidate"] == "ms-health"
            ]
        )
        base = _median(
            [
                t.get("regained_s")
                for t in trials
                if t["fault"] == "kill" and t["candidate"] == "torchrun"
            ]
        )
        if ours is not None and base is not None:
            verdict = "no slower: met" if ours <= base else "slower: NOT met"
            print(
                f"crash, time to regained progress: ms-health {ours:.2f} s, torchrun "
                f"{base:.2f} s, ratio {ours / base:.2f} ({verdict})"
            )
    record = {
        "benchmark": "health_recovery",
        "smoke": args.smoke,
        "started": started.isoformat(timespec="seconds"),
        "machine": machine_info(ms_health=ms_health.__version__),
        "parameters": vars(args),
        "trials": trials,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
