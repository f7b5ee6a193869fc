"""``ms-train --nproc N``: the launcher, and what each rank does under it.

The launcher runs torch's elastic agent (``torch.distributed.launcher.api``, what
``torchrun --standalone`` runs) in a thread of its own process, so that its main thread
keeps the signals and the waiting:

- the ranks are children of the launcher and die with it, whatever kills it
  (``_procs.die_with_parent``); their helpers die with them;
- the first SIGINT or SIGTERM is passed to every rank, which finishes its step, commits
  a checkpoint within ``checkpoint.grace_s`` and exits; a rank still there 15 s after
  the grace period is killed. A second signal is passed on too (the ranks stop at
  once) and ranks still there 5 s later are killed. The launcher returns only once no
  process of the ranks' sessions is left, and exits 130 (SIGINT) or 143 (SIGTERM),
  like a process ended by that signal, after one line that accounts for the stop;
- a ``JobError`` on the ranks is printed once, ``ms-train: error: [rank N] ...``, and
  the launcher exits 2 (``EXIT_USAGE``) as one process would.

The ranks report to the launcher through files in a folder it names in the
environment (``MS_TRAIN_REPORT_DIR``), and print nothing of their own about a stop or
an expected error.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from ms_train import _health, _procs
from ms_train._fail import report_failure
from ms_train._launcher_env import LAUNCHER_PID, REPORT_DIR, launched
from ms_train._nodes import Nodes
from ms_train._stop import STOP_FILE, Stopped, newest_committed
from ms_train.config import Config
from ms_train.errors import EXIT_USAGE, JobError

__all__ = ["launch", "run_rank"]

_FRESH_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# After the grace period, the ranks' own teardown (loader, process group) and a step
# longer than usual; after a second signal, the time to kill a writer and unlink.
_TEARDOWN_S = 15.0
_AT_ONCE_S = 5.0
# How long the launcher waits for the helpers of killed ranks to notice and exit.
_DRAIN_S = 10.0


def run_rank(
    config: Config,
    peak_flops: float | None = None,
    *,
    trainer_cls: Any = None,
    debug: bool = False,
) -> int:
    """Train this process's rank (one process, or one rank under a launcher); the exit
    status. ``trainer_cls`` replaces ``Trainer`` (tests hold saves through it); ``debug``
    prints an expected failure's traceback too."""
    if trainer_cls is None:
        from ms_train.trainer import Trainer as trainer_cls
    under = launched()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if under is not None:
        _procs.die_with_parent(under[0])
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        _procs.die_with_parent(os.getppid())  # torchrun's agent
    if world > 1:
        # `kill -USR1 <pid>` prints every thread's stack, even from a rank stuck in C
        # with the GIL held (faulthandler's handler needs no GIL), as py-spy dump would;
        # under ms-health into the file its node agent reads.
        _health.install_dump_handler(rank)
    try:
        # This process ends with the trainer: its stop handlers stay (see Trainer).
        with trainer_cls(config, peak_flops=peak_flops, keep_signal_handlers=True) as trainer:
            trainer.train()
    except JobError as e:
        if under is None:
            return report_failure(e, debug=debug, who=f"[rank {rank}] " if world > 1 else "")
        if debug:
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        _report(under[1], rank, {"error": str(e)})
        # An expected failure is the same on a rerun: exit 0 so that the elastic agent
        # does not restart the ranks into it (--max-restarts); the launcher prints the
        # report and exits 2.
        return 0 if world > 1 else EXIT_USAGE
    except Stopped as s:
        if under is not None:
            _report(under[1], rank, {"stopped": s.step, "account": s.account()})
        elif rank == 0:
            print(f"ms-train: {s.account()}", file=sys.stderr, flush=True)
        # Under an agent every rank exits 0: a rank that exits otherwise makes the agent
        # signal the others, which may still be committing the checkpoint.
        return 0 if world > 1 else s.exit_status
    except KeyboardInterrupt:  # Ctrl-C before the trainer took the signals over
        return 0 if world > 1 else 128 + signal.SIGINT
    return 0


def _report(folder: Path, rank: int, body: dict[str, Any]) -> None:
    tmp = folder / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(body))
    tmp.replace(folder / f"rank-{rank}.json")


def _reports(folder: Path) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for path in folder.glob("rank-*.json"):
        with contextlib.suppress(OSError, ValueError):
            found[int(path.stem[5:])] = json.loads(path.read_text())
    return found


class _Agent(threading.Thread):
    """torch's elastic agent for one node, run to the end in this thread."""

    def __init__(self, launch_config: Any, args: list[str]) -> None:
        super().__init__(name="ms-train-agent", daemon=True)
        self.launch_config, self.args = launch_config, args
        self.error: BaseException | None = None

    def run(self) -> None:
        from torch.distributed.launcher.api import elastic_launch

        try:
            elastic_launch(self.launch_config, sys.executable)(*self.args)
        except BaseException as e:
            self.error = e


def launch(
    nproc: int,
    argv: list[str],
    config: Config,
    *,
    module: str = "ms_train.cli",
    nodes: Nodes | None = None,
) -> int:
    """Run ``python -m module *argv`` as ``nproc`` ranks on this machine, one node of
    ``nodes`` (default: the only one); the exit status."""
    nodes = Nodes() if nodes is None else nodes
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    grace = config.checkpoint.grace_s
    folder = Path(tempfile.mkdtemp(prefix="ms-train-launch-"))
    # The ranks inherit this process's environment, set here for the launch only.
    ours = [REPORT_DIR, LAUNCHER_PID]
    # Everything the launch sets up is undone in the finally, whatever ends it (a start
    # the health side refuses, a signal, an error).
    health: Any = None
    previous: dict[int, Any] = {}
    # `kill -USR1 <launcher pid>` prints the launcher's threads (the elastic agent's
    # included) as it does a rank's: where a job that does not end is waiting.
    dumps = False
    with contextlib.suppress(AttributeError, ValueError, OSError):  # stderr without a fd
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        dumps = True
    try:
        if "OMP_NUM_THREADS" not in os.environ:
            # One share of the cores per rank (the agent would otherwise force 1, with a warning).
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
            ours.append("OMP_NUM_THREADS")
        os.environ[REPORT_DIR], os.environ[LAUNCHER_PID] = str(folder), str(os.getpid())
        if _FRESH_STORE not in os.environ:
            # A store of its own for each rendezvous round (rank 0 hosts it), instead of the
            # agent's one store for the job's life: there a restarted round's gloo ranks
            # found the previous round's addresses and failed with "connectFullMesh ...
            # Connection refused" (a per-round key prefix cannot fix it: the agents of
            # different nodes count their restarts differently).
            os.environ[_FRESH_STORE] = "1"
            ours.append(_FRESH_STORE)
        run_id = nodes.run_id or uuid.uuid4().hex
        if nodes.health:
            from ms_train._health_launch import HealthSide

            health = HealthSide(
                config,
                run_id,
                endpoint=nodes.health_endpoint,
                nnodes=nodes.nnodes,
                diagnose=nodes.health_diagnose,
                min_flops=nodes.health_min_flops,
                min_gbps=nodes.health_min_gbps,
            )
            for name, value in health.start().items():
                os.environ[name] = value
                ours.append(name)
        # The agent, on a thread, cannot take the signals and says so; it reports failures
        # as logged tracebacks. The launcher does both itself.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        standalone = nodes.nnodes == 1 and nodes.endpoint is None
        launch_config = LaunchConfig(
            min_nodes=nodes.nnodes,
            max_nodes=nodes.nnodes,
            nproc_per_node=nproc,
            run_id=run_id,
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0" if standalone else str(nodes.endpoint),
            max_restarts=nodes.max_restarts,
            monitor_interval=0.1,
            logs_specs=DefaultLogsSpecs(log_dir=str(folder / "logs")),
            # The agent's own wait when it ends workers, consistent with the launcher's.
            shutdown_timeout=int(grace + _TEARDOWN_S),
        )
        agent = _Agent(launch_config, ["-u", "-m", module, *argv])
        signals: list[int] = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            signals.append(signum)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        stop_reason = None if health is None else health.stop_reason
        sessions = _supervise(agent, signals, grace, folder, stop_reason)
        _drain(sessions)
        if health is not None:
            for line in health.stop():
                print(line, file=sys.stderr, flush=True)
            health = None
        return _outcome(agent, signals, _reports(folder), config)
    finally:
        if health is not None:
            health.stop()
        for s, prev in previous.items():
            signal.signal(s, prev)
        if dumps:
            faulthandler.unregister(signal.SIGUSR1)
        for name in ours:
            os.environ.pop(name, None)
        shutil.rmtree(folder, ignore_errors=True)


def _supervise(
    agent: _Agent,
    signals: list[int],
    grace: float,
    folder: Path,
    stop_reason: Callable[[], str | None] | None = None,
) -> set[int]:
    """Run the agent to its end, passing stops on to the ranks and killing ranks that
    outstay them; the ranks' sessions (each rank leads one). ``stop_reason``, polled:
    a reason to stop the job as a SIGTERM would (ms-health's blocklist).

    The first stop is the stop file in ``folder`` (``ms_train._stop``), which every rank
    reads after each step, those that start later included; a signal could kill a rank
    that is still starting up, and its agent would restart the ranks. A second signal
    is passed on to the ranks: to a rank that has read the file, it means stop now.
    """
    agent.start()
    ranks: set[int] = set()
    told: set[int] = set()  # rank pids the second signal was passed to
    kill_at: float | None = None
    handled = 0
    while agent.is_alive():
        agent.join(0.05)
        # The ranks only: a node diagnosis the health agent runs in this process is not
        # interrupted (a diagnosis killed by a stop would read as a failed node).
        now = _procs.worker_children()
        ranks.update(now)
        if stop_reason is not None and not signals and (why := stop_reason()):
            print(f"ms-health: {why}", file=sys.stderr, flush=True)
            signals.append(signal.SIGTERM)
        if len(signals) > handled:
            # "<first signal> <stops asked>": a rank that reads 2 stops at once
            tmp = folder / f".{STOP_FILE}.tmp"
            tmp.write_text(f"{signals[0]} {min(len(signals), 2)}")
            tmp.replace(folder / STOP_FILE)
            handled = len(signals)
            bound = grace + _TEARDOWN_S if handled == 1 else _AT_ONCE_S
            kill_at = min(kill_at or float("inf"), time.monotonic() + bound)
        if handled > 1:
            for pid in [p for p in now if p not in told]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signals[1])
                told.add(pid)
        if kill_at is not None and time.monotonic() > kill_at:
            for pid in now:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return ranks


def _drain(sessions: set[int]) -> None:
    """Wait until no process of the ranks' sessions is left (their helpers watch their
    parent and exit soon after it); kill what remains after a bound."""
    deadline = time.monotonic() + _DRAIN_S
    while time.monotonic() < deadline:
        if not _procs.session_members(sessions):
            return
        time.sleep(0.05)
    for pid in _procs.session_members(sessions):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _outcome(
    agent: _Agent, signals: list[int], reports: dict[int, dict[str, Any]], config: Config
) -> int:
    """Print the one line the run ends with, if any; the exit status."""
    if signals:
        first = signals[0]
        # The lowest of this launcher's ranks that gave an account (on a node without
        # rank 0, its own ranks'; every rank of a graceful stop gives the same step).
        stop = next((reports[r] for r in sorted(reports) if "account" in reports[r]), {})
        if len(signals) == 1 and "account" in stop:
            print(f"ms-train: {stop['account']}", file=sys.stderr, flush=True)
        else:
            how = "at once on a second signal" if len(signals) > 1 else "before a step ended"
            line = newest_committed(*_latest(config))
            print(
                f"ms-train: stopped {how}; {line}; run the same command to resume",
                file=sys.stderr,
                flush=True,
            )
        return 128 + first
    errors = sorted((r, rep["error"]) for r, rep in reports.items() if "error" in rep)
    if errors:
        rank, message = errors[0]
        print(f"ms-train: error: [rank {rank}] {message}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if agent.error is not None:
        print(f"ms-train: error: {_describe(agent.error)}", file=sys.stderr, flush=True)
        return 1
    return 0


def _latest(config: Config) -> tuple[int | None, str]:
    from ms_ckpt import committed_steps

    root = config.checkpoint.dir or str(Path(config.train.out_dir) / "ckpt")
    return max(committed_steps(root), default=None), root


def _describe(error: BaseException) -> str:
    """A failed rank in one line (its traceback, if any, is in the output above)."""
    failures = getattr(error, "failures", None)
    if not failures:
        return f"the launcher failed: {type(error).__name__}: {error}"
    parts = []
    for rank, failure in sorted(failures.items()):
        code = failure.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        parts.append(f"rank {rank} ({how})")
    return f"{', '.join(parts)} failed; see the output above"
