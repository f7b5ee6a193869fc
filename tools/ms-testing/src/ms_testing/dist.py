"""Run one function on N gloo ranks, each in its own process, under a hard deadline.

The parent process holds the rendezvous store (a TCP store on a free localhost
port), so there is no window in which two test runs can race for the same port.
Every rank runs in its own process group; when a rank does not finish in time the
parent asks it for a faulthandler stack dump (SIGUSR1), then SIGKILLs its whole
process group, so that nothing a test started can outlive it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any, Literal

import torch.distributed as dist

# TCPStore is public API that torch's stubs do not re-export.
from torch.distributed import TCPStore  # type: ignore[attr-defined]

__all__ = ["RankFailure", "RankOutcome", "RunReport", "launch", "run_ranks"]

Status = Literal["ok", "raised", "died", "hung"]
StartMethod = Literal["forkserver", "spawn"]

# How long the parent waits for a faulthandler dump after sending SIGUSR1.
_DUMP_WAIT_S = 2.0
# Upper bound on joining a rank that has already reported its result.
_EXIT_WAIT_S = 10.0


@dataclass(frozen=True)
class RankOutcome:
    """What became of one rank."""

    rank: int
    #: ``ok`` returned a value; ``raised`` raised an exception; ``died`` exited
    #: without reporting (killed by a signal, ``os._exit``); ``hung`` was still
    #: running at the deadline and was killed.
    status: Status
    #: The function's return value (``ok`` only).
    value: Any = None
    #: The formatted traceback (``raised``) or an explanation (``died``, ``hung``).
    error: str | None = None
    #: The process exit code; negative for a signal, as in ``subprocess``.
    exitcode: int | None = None
    #: Python stacks of every thread at the moment the rank was declared hung.
    stack: str | None = None

    def describe(self) -> str:
        if self.status == "ok":
            return f"rank {self.rank}: ok"
        if self.status == "raised":
            return f"rank {self.rank} raised:\n{_indent(self.error or '')}"
        if self.status == "died":
            return f"rank {self.rank} died: {self.error}"
        where = self.stack if self.stack else "(no stack dump arrived)"
        return f"rank {self.rank} hung: {self.error}\n  where it was:\n{_indent(where, 4)}"


@dataclass(frozen=True)
class RunReport:
    """Outcome of every rank of one :func:`launch`."""

    world_size: int
    timeout: float
    elapsed: float
    outcomes: tuple[RankOutcome, ...]

    @property
    def ok(self) -> bool:
        return all(o.status == "ok" for o in self.outcomes)

    @property
    def values(self) -> list[Any]:
        """Return values in rank order; raises :class:`RankFailure` unless every rank succeeded."""
        self.raise_for_failure()
        return [o.value for o in self.outcomes]

    def ranks(self, status: Status) -> list[int]:
        return [o.rank for o in self.outcomes if o.status == status]

    def describe(self) -> str:
        failed = [o for o in self.outcomes if o.status != "ok"]
        head = (
            f"{len(failed)} of {self.world_size} ranks failed after {self.elapsed:.1f}s "
            f"(deadline {self.timeout:.1f}s); hung: {self.ranks('hung')}, "
            f"raised: {self.ranks('raised')}, died: {self.ranks('died')}"
        )
        return "\n".join([head, *(o.describe() for o in failed)])

    def raise_for_failure(self) -> None:
        if not self.ok:
            raise RankFailure(self)


class RankFailure(RuntimeError):
    """One or more ranks raised, died or hung. ``report`` holds every rank's outcome."""

    def __init__(self, report: RunReport) -> None:
        super().__init__(report.describe())
        self.report = report


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    backend: str = "gloo",
    init_process_group: bool = True,
    env: Mapping[str, str] | None = None,
    grace: float = 5.0,
    start_method: StartMethod = "forkserver",
) -> list[Any]:
    """Like :func:`launch`, but return the per-rank values or raise :class:`RankFailure`."""
    return launch(
        fn,
        world_size,
        args=args,
        kwargs=kwargs,
        timeout=timeout,
        backend=backend,
        init_process_group=init_process_group,
        env=env,
        grace=grace,
        start_method=start_method,
    ).values


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    backend: str = "gloo",
    init_process_group: bool = True,
    env: Mapping[str, str] | None = None,
    grace: float = 5.0,
    start_method: StartMethod = "forkserver",
) -> RunReport:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and report what each one did.

    Args:
        fn: a module-level function (it is looked up by module and name in each rank;
            test modules that are not importable by name are loaded from their file).
        world_size: number of ranks, >= 1.
        timeout: hard deadline in seconds for the whole run, process start-up included.
        backend: process-group backend; ``gloo`` on CPU.
        init_process_group: join the ranks into the default process group before
            calling ``fn`` (and destroy it afterwards). With ``False`` the rank only
            gets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
            style variables and sets itself up.
        env: extra environment variables for the ranks.
        grace: once a rank has failed, how long the others get to finish before they
            are declared hung; a rank that waits in a collective for a dead peer
            would otherwise hold the run until the deadline.
        start_method: how the rank processes start. ``forkserver`` (the default):
            forked from a server process that has imported torch once, so a rank
            starts in a fraction of a second instead of importing torch again; the
            ranks still get this process's environment as it is at the call (the
            server's own is older), and a fresh interpreter state otherwise, as with
            ``spawn``. ``spawn``: a new interpreter per rank.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if not grace >= 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace!r}")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    fn_ref = _function_ref(fn)
    try:
        payload = pickle.dumps((tuple(args), dict(kwargs or {})))
    except Exception as e:
        raise TypeError(f"args and kwargs must be picklable to reach the ranks: {e}") from e

    start = time.monotonic()
    deadline = start + timeout
    ctx: Any = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # Read when the server starts (once per process): torch is imported there, not
        # in every rank. Nothing in the server runs torch code, so no thread pool
        # exists to be broken by the fork.
        ctx.set_forkserver_preload([__name__])
    # The parent owns the store: its port is bound before any rank starts.
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    procs: list[Any] = []  # the context's Process objects
    conns: list[multiprocessing.connection.Connection] = []
    outcomes: dict[int, RankOutcome] = {}
    with tempfile.TemporaryDirectory(prefix="ms-ranks-") as tmp:
        dump_paths = [os.path.join(tmp, f"stack-rank{r}.txt") for r in range(world_size)]
        try:
            for rank in range(world_size):
                recv, send = ctx.Pipe(duplex=False)
                spec = _RankSpec(
                    fn_ref=fn_ref,
                    payload=payload,
                    rank=rank,
                    world_size=world_size,
                    store_port=store.port,
                    backend=backend,
                    init_process_group=init_process_group,
                    timeout=timeout,
                    environ=dict(os.environ),
                    env=dict(env or {}),
                    dump_path=dump_paths[rank],
                )
                proc = ctx.Process(target=_rank_main, args=(spec, send), name=f"ms-rank{rank}")
                proc.start()
                send.close()
                procs.append(proc)
                conns.append(recv)

            first_failure: float | None = None
            while len(outcomes) < world_size:
                now = time.monotonic()
                until = deadline if first_failure is None else min(deadline, first_failure + grace)
                if now >= until:
                    break
                pending = [r for r in range(world_size) if r not in outcomes]
                handles: list[Any] = [conns[r] for r in pending] + [
                    procs[r].sentinel for r in pending
                ]
                multiprocessing.connection.wait(handles, timeout=until - now)
                for r in pending:
                    outcome = _collect(r, conns[r], procs[r])
                    if outcome is not None:
                        outcomes[r] = outcome
                        if outcome.status != "ok" and first_failure is None:
                            first_failure = time.monotonic()

            hung = [r for r in range(world_size) if r not in outcomes]
            if hung:
                failed = sorted(r for r, o in outcomes.items() if o.status != "ok")
                reason = (
                    f"still running {grace:.1f}s after rank(s) {failed} failed"
                    if failed
                    else f"did not finish within the {timeout:.1f}s deadline"
                )
                stacks = _dump_stacks([procs[r] for r in hung], [dump_paths[r] for r in hung])
                for r, stack in zip(hung, stacks, strict=True):
                    _kill_group(procs[r])
                    procs[r].join(_EXIT_WAIT_S)
                    outcomes[r] = RankOutcome(
                        rank=r, status="hung", error=reason, exitcode=procs[r].exitcode, stack=stack
                    )
            for proc in procs:
                proc.join(_EXIT_WAIT_S)
        finally:
            # Whatever happened (a KeyboardInterrupt, pytest's own timeout), no rank
            # and nothing a rank started outlives this call.
            for proc in procs:
                if proc.exitcode is None:
                    _kill_group(proc)
                    proc.join(_EXIT_WAIT_S)
            for conn in conns:
                conn.close()
            del store
    return RunReport(
        world_size=world_size,
        timeout=timeout,
        elapsed=time.monotonic() - start,
        outcomes=tuple(outcomes[r] for r in range(world_size)),
    )


@dataclass(frozen=True)
class _FunctionRef:
    module: str
    file: str | None
    qualname: str


@dataclass(frozen=True)
class _RankSpec:
    fn_ref: _FunctionRef
    payload: bytes
    rank: int
    world_size: int
    store_port: int
    backend: str
    init_process_group: bool
    timeout: float
    #: The caller's environment at the call: a forkserver's children inherit the
    #: server's, which dates from its start.
    environ: dict[str, str]
    env: dict[str, str]
    dump_path: str


def _function_ref(fn: Callable[..., Any]) -> _FunctionRef:
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not callable(fn) or qualname is None or module is None or "<locals>" in qualname:
        raise TypeError(
            f"fn must be a module-level function so that each rank can look it up, got {fn!r}"
        )
    mod = sys.modules.get(module)
    return _FunctionRef(module=module, file=getattr(mod, "__file__", None), qualname=qualname)


def _resolve(ref: _FunctionRef) -> Callable[..., Any]:
    try:
        mod: ModuleType = importlib.import_module(ref.module)
    except ImportError:
        # pytest's importlib mode gives test modules names that are not importable;
        # load the file under the same name so pickled references to it resolve too.
        if ref.file is None:
            raise
        spec = importlib.util.spec_from_file_location(ref.module, ref.file)
        if spec is None or spec.loader is None:
            raise
        mod = importlib.util.module_from_spec(spec)
        sys.modules[ref.module] = mod
        spec.loader.exec_module(mod)
    obj: Any = mod
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _rank_main(spec: _RankSpec, conn: multiprocessing.connection.Connection) -> None:
    # Own process group: the parent kills the group, so anything this rank starts dies too.
    os.setpgrp()
    dump_file = open(spec.dump_path, "w")  # noqa: SIM115 - must stay open for the handler
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    os.environ.clear()
    os.environ.update(spec.environ)
    os.environ.update(
        {
            "RANK": str(spec.rank),
            "LOCAL_RANK": str(spec.rank),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_WORLD_SIZE": str(spec.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(spec.store_port),
        }
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(spec.env)
    _apply_thread_count()
    try:
        fn = _resolve(spec.fn_ref)
        args, kwargs = pickle.loads(spec.payload)
        if spec.init_process_group:
            store = TCPStore(
                "127.0.0.1",
                spec.store_port,
                is_master=False,
                timeout=timedelta(seconds=spec.timeout),
            )
            dist.init_process_group(
                spec.backend,
                store=store,
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=timedelta(seconds=spec.timeout),
            )
            # Every rank's group is whole before any rank runs fn: gloo's connection
            # set-up can still be under way on a slow rank when a fast one has returned
            # from init, and a fast rank whose fn ends at once would then close its side
            # under it ("Connection closed by peer" on a loaded machine). Through the
            # store, so that no collective of the backend under test is issued.
            store.set(f"ms_testing/ready/{spec.rank}", "1")
            store.wait([f"ms_testing/ready/{r}" for r in range(spec.world_size)])
        try:
            value = fn(*args, **kwargs)
        finally:
            if spec.init_process_group and dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:
        conn.send_bytes(pickle.dumps(("raised", traceback.format_exc())))
        return
    # Plain pickle, not the connection's own: torch's multiprocessing reductions would
    # pass tensors through shared memory that vanishes when this process exits.
    try:
        message = pickle.dumps(("ok", value))
    except Exception as e:
        message = pickle.dumps(
            ("raised", f"rank {spec.rank} returned a value that cannot be pickled: {e!r}")
        )
    conn.send_bytes(message)


def _apply_thread_count() -> None:
    """Honour ``OMP_NUM_THREADS`` as a fresh interpreter would: the OpenMP runtime read
    it when torch was loaded, which under a forkserver was in the server, before this
    rank's environment was set."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        import torch

        if torch.get_num_threads() != int(value):
            torch.set_num_threads(int(value))


def _collect(
    rank: int,
    conn: multiprocessing.connection.Connection,
    proc: multiprocessing.process.BaseProcess,
) -> RankOutcome | None:
    # Sample liveness before polling: a rank that sends its result and exits between
    # the two checks must be read, not declared dead.
    alive = proc.is_alive()
    if conn.poll():
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            pass  # the pipe closed without a message: the rank died; see below
        else:
            try:
                kind, body = pickle.loads(data)
            except Exception as e:
                kind, body = "raised", f"rank {rank}'s result could not be unpickled: {e!r}"
            proc.join(_EXIT_WAIT_S)
            if kind == "ok":
                return RankOutcome(rank=rank, status="ok", value=body, exitcode=proc.exitcode)
            return RankOutcome(rank=rank, status="raised", error=body, exitcode=proc.exitcode)
    if alive:
        return None
    proc.join(_EXIT_WAIT_S)
    code = proc.exitcode
    how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else None
    return RankOutcome(
        rank=rank,
        status="died",
        error=f"exited with code {code} without reporting a result" + (f" ({how})" if how else ""),
        exitcode=code,
    )


def _dump_stacks(
    procs: Sequence[multiprocessing.process.BaseProcess], paths: Sequence[str]
) -> list[str | None]:
    for proc in procs:
        if proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
    # The handler writes from inside the signal handler; give it a moment, and stop
    # early once every file has content that has stopped growing.
    sizes = [-1] * len(paths)
    end = time.monotonic() + _DUMP_WAIT_S
    while time.monotonic() < end:
        time.sleep(0.1)
        now = [os.path.getsize(p) if os.path.exists(p) else 0 for p in paths]
        if all(n > 0 for n in now) and now == sizes:
            break
        sizes = now
    stacks: list[str | None] = []
    for p in paths:
        try:
            with open(p) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        stacks.append(text or None)
    return stacks


def _kill_group(proc: multiprocessing.process.BaseProcess) -> None:
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        # The rank died before it became a group leader, or is already gone.
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)


def _indent(text: str, n: int = 2) -> str:
    pad = " " * n
    return "\n".join(pad + line for line in text.splitlines())
