"""``ms-train`` on simulated nodes under ms-health, whose ranks take faults from inside:
the fault-injection tests and benchmarks of ms-health.

    python -m ms_testing.faulty_train CONFIG NODE_ARGS_JSON [FAULT ...]

launches this node (``ms_train._launch.launch(..., module="ms_testing.faulty_train")``
with the ``Nodes`` of NODE_ARGS_JSON); each rank trains CONFIG with a
:class:`FaultyTrainer` that applies the FAULTs meant for it. A FAULT is
``kind:rank:step[:arg]``, where rank ``*`` means every rank:

- ``nan:R:K``: rank R's loss is NaN at step K (its weights poisoned), once per job: a
  marker file beside the config records that it happened, so the rolled-back rerun of
  step K is clean;
- ``gil:R:K``: rank R enters, at step K and once per job, a C call that holds the GIL
  and never checks for signals (``sum`` over a huge range);
- ``slow:R:K:F[:N]``: from step K on (for N steps; without N, to the end), rank R's
  steps take F times as long, or longer on a busy host (it spins for F - 1 times the
  rest of its last step, in CPU time, as a slower processor would compute longer);
  with N, brief jitter;
- ``mute:R:K``: at step K, once per job, rank R's heartbeat sender thread dies (as an
  uncaught error in it would end it) while the rank trains on;
- ``slowsave:R:K:F``: rank R's checkpoint of step K takes F step times longer (it
  sleeps inside the checkpoint phase), once per job.

Faults can also come while the job runs (the chaos soak): with ``MS_FAULTS_DIR`` set,
each rank looks in that folder before every step for ``*.json`` files
``{"kind": ..., "rank": R, "arg": F, "steps": N}`` (``steps``: how long a ``slow``
lasts, default forever) and takes one meant for it by renaming it to
``<name>.taken`` with the step it applied it at. Kinds as above, applied at once.

Crashes and hangs (SIGKILL, SIGSTOP) come from outside: :class:`HealthJob` starts the
job and finds its ranks' pids.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from ms_train.trainer import Trainer

__all__ = ["FAULTS_ENV", "MODULE", "FaultyTrainer", "HealthJob", "Job", "parse_fault"]

#: The module the job's launchers and ranks run (for ``rank_processes``).
MODULE = "ms_testing.faulty_train"
#: Names the folder of faults that arrive while the job runs.
FAULTS_ENV = "MS_FAULTS_DIR"
KINDS = ("nan", "gil", "slow", "mute", "slowsave")

#: kind, rank (None: every rank), step, arg, steps (how long a slow lasts; None: on)
Fault = tuple[str, int | None, int, float, int | None]


def parse_fault(text: str) -> Fault:
    """``kind:rank:step[:arg[:steps]]`` as a tuple; rank ``*`` is None (every rank)."""
    kind, rank, step, *rest = text.split(":")
    if kind not in KINDS:
        raise ValueError(f"fault kind must be one of {KINDS}, got {kind!r} in {text!r}")
    if len(rest) > 2 or (len(rest) == 2 and kind != "slow"):
        raise ValueError(f"only a slow fault takes a step count, got {text!r}")
    arg = float(rest[0]) if rest else 0.0
    steps = int(rest[1]) if len(rest) == 2 else None
    return kind, None if rank == "*" else int(rank), int(step), arg, steps


class FaultyTrainer(Trainer):
    """A ``Trainer`` that applies the faults meant for its rank (see the module doc)."""

    faults: ClassVar[list[Fault]] = []
    markers: ClassVar[Path] = Path(".")
    _last_start: float | None = None
    _slow_until: int | None = None
    _slow = 1.0
    _save_extra = 0.0
    _step_s = 0.0

    def _mine(self, rank: int | None) -> bool:
        return rank is None or rank == self.rank

    def _once(self, kind: str, rank: int | None, at: int) -> bool:
        """True the first time this job reaches this fault (a marker file)."""
        who = "all" if rank is None else str(rank)
        marker = self.markers / f"{kind}-{who}-{at}-{self.rank}.done"
        if marker.exists():
            return False
        marker.write_text(str(os.getpid()))
        return True

    def _apply(self, kind: str, arg: float, done: int, steps: int | None) -> None:
        if kind == "nan":
            import torch

            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))
        elif kind == "gil":
            sum(range(10**15))
        elif kind == "mute":
            _silence_sender(self.health)
        elif kind == "slow":
            self._slow = arg
            self._slow_until = None if steps is None else done + steps
        elif kind == "slowsave":
            self._save_extra = arg

    def _incoming(self, done: int) -> None:
        folder = os.environ.get(FAULTS_ENV)
        if not folder:
            return
        with contextlib.suppress(FileNotFoundError):
            for entry in sorted(os.scandir(folder), key=lambda e: e.name):
                if not entry.name.endswith(".json"):
                    continue
                try:
                    spec = json.loads(Path(entry.path).read_text())
                except (OSError, ValueError):
                    continue  # being written: next step
                if spec.get("rank") != self.rank:
                    continue
                taken = f"{entry.path}.taken"
                try:
                    os.rename(entry.path, taken)
                except FileNotFoundError:
                    continue
                Path(taken).write_text(json.dumps({**spec, "step": done, "pid": os.getpid()}))
                self._apply(spec["kind"], float(spec.get("arg", 0.0)), done, spec.get("steps"))

    def train_step(self, step: int) -> Any:
        done = step + 1
        if self._slow_until is not None and done >= self._slow_until:
            self._slow, self._slow_until = 1.0, None
        slow = self._slow  # from a fault that came while the job runs
        for kind, rank, at, arg, steps in self.faults:
            if not self._mine(rank):
                continue
            if kind == "slow":  # after a restart past K as well
                if done >= at and (steps is None or done < at + steps):
                    slow = max(slow, arg)
            elif done == at and self._once(kind, rank, at):
                self._apply(kind, arg, done, None)
        self._incoming(done)
        slow = max(slow, self._slow)
        now = time.perf_counter()
        if self._last_start is not None:
            self._step_s = now - self._last_start
            if slow > 1.0:
                # The whole step slower, as a slower processor would be: F - 1 times the
                # rest of the step as more CPU work, before the step's compute, where its
                # peers then wait for it in the collectives. A spin on this thread's CPU
                # time, not the clock's: on a busy host the work takes longer, as a slower
                # processor's would, rather than shrinking to what the scheduler allows.
                end = time.thread_time() + self._step_s * (slow - 1.0)
                while time.thread_time() < end:
                    pass
        self._last_start = time.perf_counter()
        return super().train_step(step)

    def _phase(self, name: str) -> contextlib.AbstractContextManager[object]:
        inner = super()._phase(name)
        if name != "checkpoint" or not self._save_extra:
            return inner
        extra, self._save_extra = self._save_extra * self._step_s, 0.0
        return _slowed(inner, extra)


@contextlib.contextmanager
def _slowed(inner: contextlib.AbstractContextManager[object], seconds: float) -> Iterator[None]:
    with inner:
        time.sleep(seconds)
        yield


def _silence_sender(hb: Any) -> None:
    """End ``hb``'s sender thread as an uncaught error would: no last heartbeat."""
    if hb is None:
        return

    def _die(*args: object, **kwargs: object) -> None:
        raise SystemExit  # not an Exception: the sender's guard does not catch it

    hb._send = _die
    hb._wake.set()


def main(argv: list[str]) -> int:
    from ms_train._launch import launch, run_rank
    from ms_train._nodes import Nodes
    from ms_train.config import load_config

    config_path, node_args, *faults = argv
    config = load_config(config_path)
    if "WORLD_SIZE" not in os.environ:
        spec = json.loads(node_args)
        nproc = spec.pop("nproc")
        return int(launch(nproc, argv, config, module=MODULE, nodes=Nodes(**spec)))
    FaultyTrainer.faults = [parse_fault(f) for f in faults]
    FaultyTrainer.markers = Path(config_path).parent
    return int(run_rank(config, 1e9, trainer_cls=FaultyTrainer))


def _proc_state(pid: int) -> str:
    """A process's state letter and the kernel function it sleeps in, from /proc."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
    except OSError:
        return "gone"
    return f"{state} {wchan}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """A job of launcher processes on localhost training ``out`` (its train.out_dir),
    found by ``tag`` (``ms_testing.jobs``); ``launchers`` write into ``logs``. Subclasses
    start them (:class:`HealthJob` here, the benchmarks' plain torchrun job)."""

    out: Path
    tag: str
    logs: list[Path]
    launchers: list[subprocess.Popen[bytes]]

    def running(self) -> bool:
        return all(p.poll() is None for p in self.launchers)

    def rank_pids(self) -> dict[int, list[int]]:
        from ms_testing.jobs import rank_processes

        return rank_processes(self.tag, module=MODULE)

    def rank_pid(self, rank: int, timeout: float) -> int:
        """The one live process of ``rank`` (waits through a restart)."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self.rank_pids().get(rank, [])
            if len(pids) == 1:
                return pids[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: no single live process in {timeout:g} s: {pids}")
            time.sleep(0.05)

    #: The job's processes and their states when :meth:`wait` timed out, else "".
    stuck = ""

    def output(self) -> str:
        """The launchers' output, then what :meth:`wait` found stuck and the stacks
        that ranks wrote to files."""
        parts = [log.read_text("utf-8", "replace") for log in self.logs]
        if self.stuck:
            parts.append(self.stuck)
            for dump in sorted(self.out.glob("health/dumps/*/rank-*.stacks")):
                parts.append(f"--- {dump}:\n{dump.read_text('utf-8', 'replace')[-20000:]}")
        return "\n".join(parts)

    def wait(self, timeout: float) -> list[int | None]:
        """Wait for the launchers to exit; exit codes. When one is still running after
        ``timeout``, every process of the job is listed with its state into
        :attr:`stuck` and asked for its stacks (SIGUSR1: ranks and launchers print every
        thread's), and then the job is killed: :meth:`output` says who was stuck where."""
        from ms_testing.jobs import tagged_processes

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running_any():
            time.sleep(0.1)
        if self.running_any():
            alive = tagged_processes(self.tag)
            lines = [f"still running after {timeout:g} s:"]
            for pid, cmd in sorted(alive.items()):
                lines.append(f"  pid {pid} [{_proc_state(pid)}] {cmd[:200]}")
            self.stuck = "\n".join(lines)
            for pid in {*alive, *(p.pid for p in self.launchers if p.poll() is None)}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
        self.kill()
        return [p.returncode for p in self.launchers]

    def running_any(self) -> bool:
        return any(p.poll() is None for p in self.launchers)

    def kill(self) -> None:
        """End everything of the job now."""
        from ms_testing.jobs import tagged_processes

        for p in self.launchers:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for pid in tagged_processes(self.tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.launchers:
            p.wait(timeout=60)

    def metrics_steps(self) -> list[int]:
        lines = (self.out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["step"] for line in lines if line.strip()]

    def events(self) -> list[dict[str, Any]]:
        """The health driver's events (none without one)."""
        return []


class HealthJob(Job):
    """``nnodes`` launchers of this module (``nproc`` ranks each) training one job under
    ``ms-train --health`` on localhost, their output in files under ``folder``.

    ``config``: a training config (``ms_testing.train.write_train_config``);
    ``faults``: FAULT strings for every rank; ``interval_s``: the heartbeat interval;
    ``health_endpoint``: the driver's address (default: a free port, hosted by a
    launcher); ``env``: more environment for the launchers (``MS_HEALTH_TOKEN`` for an
    outside driver, ``MS_FAULTS_DIR``); ``node_options``: more ``ms_train._nodes.Nodes``
    fields (``health_diagnose``, ``health_min_flops``).
    """

    def __init__(
        self,
        folder: Path,
        config: Path,
        out_dir: Path,
        faults: Sequence[str] = (),
        *,
        nnodes: int = 2,
        nproc: int = 2,
        interval_s: float = 0.5,
        max_restarts: int = 3,
        health_endpoint: str | None = None,
        env: dict[str, str] | None = None,
        **node_options: Any,
    ) -> None:
        from ms_testing.jobs import tag_env

        self.out = out_dir
        self.tag = f"health-{uuid.uuid4().hex[:8]}"
        nodes = {
            "nproc": nproc,
            "nnodes": nnodes,
            "endpoint": f"127.0.0.1:{free_port()}",
            "run_id": self.tag,
            "max_restarts": max_restarts,
            "health": True,
            "health_endpoint": health_endpoint or f"127.0.0.1:{free_port()}",
            **node_options,
        }
        full = {**tag_env(self.tag), "OMP_NUM_THREADS": "1", "MS_HEALTH_INTERVAL": str(interval_s)}
        full.update(env or {})
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            full.pop(name, None)
        cmd = [sys.executable, "-m", MODULE, str(config), json.dumps(nodes), *faults]
        # Output to files, not pipes: a pipe nobody reads while another launcher is
        # waited for fills up with a restart's tracebacks and blocks the job.
        self.logs = [folder / f"launcher-{i}.log" for i in range(nnodes)]
        self.launchers: list[subprocess.Popen[bytes]] = []
        for log in self.logs:
            with open(log, "wb") as out:
                self.launchers.append(
                    subprocess.Popen(
                        cmd, env=full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )

    def events(self) -> list[dict[str, Any]]:
        """The driver's events (a launcher-hosted driver's file)."""
        path = self.out / "health" / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
