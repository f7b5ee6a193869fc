"""``Checkpointer``: two-stage save (host copy, then a background writer process),
atomic commit through a manifest, verified in-place load. Layout: docs/format.md."""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import socket
import subprocess
import sys
import warnings
import weakref
from collections.abc import Callable, Collection
from multiprocessing.connection import Connection
from typing import Any, Literal

import fsspec
import torch
import torch.distributed as dist

from ms_ckpt import _layout as L
from ms_ckpt import _load, _plan, _reader, _tree
from ms_ckpt._pool import HostPool, stage1_copy
from ms_ckpt._writer import Hook, apply_retention, describe, run_job, write_error_fragment
from ms_ckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError

__all__ = ["Checkpointer", "SaveHandle", "committed_steps"]

_JOIN_TIMEOUT = 30.0


class SaveHandle:
    """The outcome of one ``save``: ``wait()`` blocks until it is committed and raises
    ``CheckpointWriteError`` if stage 2 failed; ``skipped`` saves are done at once."""

    def __init__(self, step: int, owner: Checkpointer | None, *, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self._owner = owner
        self._finished = skipped
        self._error: CheckpointWriteError | None = None
        self._observed = False

    def done(self) -> bool:
        if not self._finished and self._owner is not None:
            self._owner._poll(self, timeout=0.0)
        return self._finished

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed (or ``timeout`` seconds pass: ``TimeoutError``)."""
        if not self._finished and self._owner is not None:
            self._owner._poll(self, timeout=timeout)
            if not self._finished:
                raise TimeoutError(f"save of step {self.step} still running after {timeout} s")
        self._observed = True
        if self._error is not None:
            raise self._error

    def _finish(self, error: CheckpointWriteError | None) -> None:
        self._finished = True
        self._error = error

    def __repr__(self) -> str:
        state = (
            "skipped"
            if self.skipped
            else "failed"
            if self._error
            else ("committed" if self._finished else "in flight")
        )
        return f"SaveHandle(step={self.step}, {state})"


class Checkpointer:
    """Saves and loads training state under ``url`` (any fsspec URL).

    With several processes every rank of ``group`` constructs it and calls ``save`` and
    ``load`` with the same steps (both are collective). The ranks of one data-parallel
    group (``dp_group``) hold the same state, except values marked ``per_rank``,
    ``DTensor`` pieces and ``Sharded`` slices (see ``ms_ckpt.placement``): each replicated
    tensor, and each distinct piece of a DTensor, is copied and written by one rank, and
    on load read by one rank of the DP group and broadcast to the ranks that need it.

    Args:
        url: root of the checkpoints; step ``N`` lives in ``<url>/step-0000000N/``. Every
            rank must see the same storage.
        group: the process group that saves together (default: the default group when
            ``torch.distributed`` is initialized, else this process alone).
        dp_group: this rank's data-parallel group, a subgroup of ``group`` (default:
            ``group``: every rank a replica, as with DDP). Each DP group of ``group``
            is one part of the checkpoint (a tensor/pipeline-parallel partition).
        mesh: a ``DeviceMesh`` over the whole world instead of ``group``/``dp_group``;
            ``dp_dim`` names its data-parallel dimension.
        dp_dim: the mesh dimension that is data parallel (a name or an index).
        keep_last: after each commit keep this many newest committed steps (None: all).
            The newest committed step is never deleted; partial steps older than it are.
        compression: ``"zstd"`` or ``"none"``.
        level: zstd level (1..19; 3 is fast and already shrinks optimizer state).
        policy: a save while one is in flight ``"wait"``s for it, or is ``"skip"``ped.
        stage2: ``"process"`` writes from a background process (the default);
            ``"inline"`` writes inside ``save`` (the default for memory://, whose store
            another process cannot see).
        fs: an fsspec filesystem to use instead of the one ``url`` names (``url`` is then a
            path on it). It is pickled to the writer process.
        commit_timeout: with several ranks, how long rank 0's writer waits for the other
            ranks' parts of a save before it fails the step (seconds).
        nice: the writer process's niceness above the trainer's (0..19): stage 2 yields
            the CPU to training threads and data loaders, and uses what is idle.
        hook: ``hook(point, step)`` is called by stage 2 at ``"stage2"`` (before anything
            is written), ``"record"`` (before each record) and ``"manifest"`` (the
            manifest is durable under a temporary name; the rename that commits the step
            comes next): to trace stage 2, or, in fault-injection tests, to hold or fail
            it at those points. It runs in the writer process, so it must pickle (a
            module-level function, or an instance of a module-level class); an exception
            it raises fails the save like any stage-2 error.
    """

    def __init__(
        self,
        url: str,
        *,
        keep_last: int | None = None,
        compression: Literal["zstd", "none"] = "zstd",
        level: int = 3,
        policy: Literal["wait", "skip"] = "wait",
        stage2: Literal["process", "inline"] | None = None,
        fs: Any = None,
        group: Any = None,
        dp_group: Any = None,
        mesh: Any = None,
        dp_dim: str | int = "dp",
        commit_timeout: float = 600.0,
        nice: int = 10,
        hook: Hook | None = None,
    ) -> None:
        if type(nice) is not int or not 0 <= nice <= 19:
            raise ValueError(f"nice must be an int in [0, 19], got {nice!r}")
        if not (isinstance(commit_timeout, (int, float)) and commit_timeout > 0):
            raise ValueError(f"commit_timeout must be a number > 0 seconds, got {commit_timeout!r}")
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        if compression not in ("zstd", "none"):
            raise ValueError(f"compression must be 'zstd' or 'none', got {compression!r}")
        if type(level) is not int or not 1 <= level <= 22:
            raise ValueError(f"level must be an int in [1, 22], got {level!r}")
        if policy not in ("wait", "skip"):
            raise ValueError(f"policy must be 'wait' or 'skip', got {policy!r}")
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url)
        else:
            root = fs._strip_protocol(url)
        in_memory = (
            "memory" in fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol == "memory")
        )
        if stage2 is None:
            stage2 = "inline" if in_memory else "process"
        if stage2 not in ("process", "inline"):
            raise ValueError(f"stage2 must be 'process' or 'inline', got {stage2!r}")
        if stage2 == "process" and in_memory:
            raise ValueError(
                "stage2='process' cannot write memory://: another process "
                "cannot see this process's memory filesystem; use 'inline'"
            )
        if hook is not None:
            if not callable(hook):
                raise TypeError(f"hook must be callable as hook(point, step), got {hook!r}")
            if stage2 == "process":
                # The writer is its own interpreter (python -c): a hook from the user's
                # script pickles as __main__.<name> but cannot be found there.
                owner = getattr(hook, "__module__", None) or type(hook).__module__
                if owner == "__main__" or type(hook).__module__ == "__main__":
                    raise TypeError(
                        f"hook must be importable from a module, since it runs in the writer "
                        f"process, which does not run your script; got {hook!r} from "
                        "__main__ (move it into a module, or use stage2='inline')"
                    )
                try:
                    pickle.dumps(hook)
                except Exception as e:
                    raise TypeError(
                        f"hook must pickle, since it runs in the writer process (a "
                        f"module-level function or class instance), got {hook!r}: {e}"
                    ) from e
        self._layout = _make_layout(group, dp_group, mesh, dp_dim)
        if self._layout.distributed and in_memory:
            raise ValueError(
                f"url {url!r}: memory:// lives in one process; {self._layout.world_size} "
                "ranks need storage they all see (file://, an object store)"
            )
        self.commit_timeout = float(commit_timeout)
        self.nice = nice
        self.hook = hook
        self._seq = 0
        self.url = url
        self.keep_last = keep_last
        self.compression = compression
        self.level = level
        self.policy = policy
        self.stage2 = stage2
        self._fs = fs
        self._root = root.rstrip("/")
        self._pool = HostPool()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Any = None
        self._inflight: SaveHandle | None = None
        self._inflight_job: dict[str, Any] = {}
        self._last: SaveHandle | None = None
        self._last_step: int | None = None
        self._closed = False
        ref = weakref.ref(self)
        self._atexit: Callable[[], None] = lambda: _finalize_ref(ref)
        atexit.register(self._atexit)

    # ---------------------------------------------------------------- save

    def save(self, step: int, state: dict[str, Any]) -> SaveHandle:
        """Stage 1 now (flatten, copy tensors to the host buffer); stage 2 in background.

        After it returns, changing the live tensors does not change what is written.
        Raises ``CheckpointWriteError`` of an earlier save whose failure nobody waited for.
        """
        if self._closed:
            raise CheckpointError("save() after finalize()")
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        lay = self._layout
        inflight = self._inflight
        if self.policy == "skip":
            busy = inflight is not None and not inflight.done()
            if _plan.any_rank(busy, lay):  # collective: every rank skips, or none
                return SaveHandle(step, None, skipped=True)
        if lay.distributed and step == self._last_step:
            # The other ranks' writers are done with a step before rank 0 commits it (and
            # removes their fragments): saving the same step again must wait for that
            # commit on every rank, or their new parts would race the old commit.
            if inflight is not None:
                self._poll(inflight, timeout=None)
            _plan.any_rank(False, lay)
        self._last_step = step
        # Numbered before anything that can fail on one rank only, so that the ranks'
        # numbers (which match their parts at the commit) never drift apart.
        self._seq += 1
        ident = {"step": step, "rank": lay.rank, "nonce": lay.nonce, "seq": self._seq}
        try:
            if inflight is not None:
                self._poll(inflight, timeout=None)
            self._raise_unobserved()
            job = self._stage1(step, state, lay)
        except BaseException as e:
            if lay.distributed:  # so that rank 0 fails this step now, not at its timeout
                write_error_fragment(self._fs, self._root, ident, f"rank {lay.rank}: {e}")
            raise
        handle = SaveHandle(step, self)
        self._last = handle
        if self.stage2 == "inline":
            buf = self._pool.view() if job["pool"] else memoryview(b"")
            try:
                run_job(self._fs, self._root, job, buf, L.always, self.hook)
            except Exception as e:
                handle._finish(_write_error(step, describe(e), getattr(e, "errno", None)))
            else:
                handle._finish(None)
            return handle
        self._ensure_worker()
        self._inflight = handle
        self._inflight_job = ident
        self._conn.send(job)
        return handle

    def _stage1(self, step: int, state: dict[str, Any], lay: _plan.Layout) -> dict[str, Any]:
        """Flatten, copy this rank's tensors into the host pool, and describe the job.

        Of a DTensor only the local shard is copied, and only where this rank writes it:
        each distinct piece of the global tensor is written by one rank (the replicas
        along its Replicate mesh dimensions, and across DP when the mesh lies inside one
        DP replica, leave it to one of them)."""
        flat = _tree.flatten(state)
        part_of = {r: p for p, ranks in enumerate(lay.groups) for r in ranks}
        across: set[str] = set()  # DTensor pieces that this rank's DP peers hold too
        for it in flat.items:
            if it.scope == "dtensor":
                parts, dp_copies = _plan.dtensor_scope(it.key, it.mesh_ranks, lay, part_of)
                assert it.shard is not None
                it.shard["parts"] = parts
                if dp_copies and it.replica_writer:
                    across.add(it.key)
        owner = _plan.assign(
            [
                (it.key, it.nbytes, isinstance(it.value, torch.Tensor))
                for it in flat.items
                if it.scope == "replicated" or it.key in across
            ],
            lay.dp_size,
        )

        def writes(it: _tree.Item) -> bool:
            if it.scope == "replicated" or it.key in across:
                return owner[it.key] == lay.dp_rank
            return it.scope != "dtensor" or it.replica_writer

        mine = [it for it in flat.items if writes(it)]
        tensor_items = [it for it in mine if isinstance(it.value, torch.Tensor)]
        records = stage1_copy(
            self._pool,
            [(it.key, it.value) for it in tensor_items],  # type: ignore[misc]
        )
        for rec, it in zip(records, tensor_items, strict=True):
            rec.update(_placement(it, lay))
        return {
            "step": step,
            "rank": lay.rank,
            "part": lay.part,
            "dp_rank": lay.dp_rank,
            "world": lay.describe(),
            "coordinator": lay.coordinator,
            "nonce": lay.nonce,
            "seq": self._seq,
            "commit_timeout": self.commit_timeout,
            "pool": self._pool.name if tensor_items else "",
            "tensors": records,
            "blobs": [
                ({"key": it.key} | _placement(it, lay), it.value)
                for it in mine
                if not isinstance(it.value, torch.Tensor)
            ],
            "tree": flat.tree,
            "per_rank": flat.per_rank,
            "compression": self.compression,
            "level": self.level,
            "keep_last": self.keep_last,
        }

    def _raise_unobserved(self) -> None:
        last = self._last
        if last is not None and last._error is not None and not last._observed:
            last._observed = True
            raise last._error

    def _ensure_worker(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._stop_writer()  # a writer that died between saves
        ours, theirs = socket.socketpair()
        # The writer imports what this process imports (ms_ckpt, a custom fs class).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # SIGINT and SIGTERM are ignored before anything else runs: Ctrl-C reaches the
        # terminal's whole process group and torchrun signals a rank's whole group, but
        # the writer's fate is its trainer's (a trainer stopping on a signal still
        # commits its last save); the writer stops when the trainer is gone.
        code = (
            "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "import sys; from ms_ckpt._worker import run; "
            "run(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), str(os.getpid()), str(self.nice)],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        conn = Connection(ours.detach())
        conn.send((self._fs, self._root, self.hook))
        self._proc, self._conn = proc, conn

    def _stop_writer(self) -> None:
        """Ask the writer to exit (it finishes nothing: call between saves), then reap it."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(None)
            conn.close()
        if proc is not None:
            try:
                proc.wait(_JOIN_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(_JOIN_TIMEOUT)

    @property
    def writer_pid(self) -> int | None:
        """The stage-2 writer process's pid while it runs (None before the first save)."""
        return None if self._proc is None else self._proc.pid

    def _poll(self, handle: SaveHandle, timeout: float | None) -> None:
        """Collect the writer's answer for the in-flight ``handle`` if it comes in time."""
        if handle is not self._inflight or self._proc is None:
            return
        proc = self._proc
        waited = 0.0
        while True:
            slice_s = 0.1 if timeout is None else min(0.1, max(0.0, timeout - waited))
            if self._conn.poll(slice_s):
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    msg = None
                break
            waited += slice_s
            if proc.poll() is not None:
                msg = None
                break
            if timeout is not None and waited >= timeout:
                return
        self._inflight = None
        if msg is None:
            self._stop_writer()
            if self._layout.distributed:  # so that rank 0 fails the step now, not at timeout
                write_error_fragment(
                    self._fs,
                    self._root,
                    self._inflight_job,
                    f"writer of rank {self._layout.rank} died",
                )
            handle._finish(
                _write_error(
                    handle.step,
                    f"the stage-2 writer process (pid {proc.pid}) died with exit code "
                    f"{proc.returncode}",
                    None,
                )
            )
        elif msg[0] == "ok":
            handle._finish(None)
        else:
            handle._finish(_write_error(handle.step, msg[2], msg[3]))

    # ---------------------------------------------------------------- load

    def steps(self) -> dict[int, bool]:
        """Every step directory under the root: step -> committed (False: partial)."""
        return dict(sorted(L.list_steps(self._fs, self._root).items()))

    def latest_step(self) -> int | None:
        """The newest committed step (the one ``load(state)`` restores), or None when no
        step is committed yet, e.g. after a crash during the first save::

            start = ckpt.load(state) if ckpt.latest_step() is not None else 0

        It lists storage on this rank, with no collective: with several ranks call it
        while no save is in flight (at start-up), when every rank sees the same steps.
        """
        return max(committed_steps(self._root, fs=self._fs), default=None)

    def load(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        fallback: bool = False,
        broadcast: bool = True,
        per_rank: Literal["refuse", "keep"] = "refuse",
        optional: Collection[str] = (),
    ) -> int:
        """Restore ``state`` in place from the newest committed checkpoint (or ``step``).

        Every checksum is verified before anything is restored. A corrupt checkpoint
        raises ``CheckpointCorruptError`` naming the file and key; with ``fallback=True``
        the previous committed checkpoint is tried instead, with a warning. Returns the
        step loaded.

        Collective with several ranks: rank 0 picks the step and reads the manifest;
        each replicated record is read by one rank of each DP group and broadcast to
        the group (``broadcast=False``: every rank reads everything it needs itself).
        A live ``DTensor`` (or ``Sharded``) gets the region of the saved global tensor
        its local shard covers, whatever data-parallel size, mesh or placements saved
        it; a plain tensor gets the whole tensor. A layout that cannot take the
        checkpoint, or a different global shape or dtype, raises ``CheckpointError``
        naming what changed.

        With another number of model-parallel parts (a changed tensor- or
        pipeline-parallel size) every part loads the state that all saved parts hold
        alike: DTensors whose mesh spans the parts, and values every part saved the same
        (plain values, replicated tensors); state that differs between the saved parts
        (a DTensor on a mesh inside each part, such as ZeRO buckets per TP rank) is
        refused, naming the key.

        Per-rank values (``per_rank``, ``rng_state()``) have no counterpart on the ranks
        of a different data-parallel size or number of parts. ``per_rank="refuse"``
        raises ``CheckpointError`` naming them; ``per_rank="keep"`` loads everything else
        and leaves every live per-rank value as it is (a Stateful's ``load_state_dict`` is
        not called), for the caller to derive each new rank's own, e.g. to seed its RNG.
        With the same layout both load the per-rank values.

        ``optional`` names top-level keys of ``state`` that a checkpoint may lack (state
        added to a job after older checkpoints were written): a checkpoint without one
        leaves that entry as it is; any other key missing is an error.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if isinstance(optional, str) or not all(isinstance(k, str) for k in optional):
            raise TypeError(f"optional must be a collection of key names, got {optional!r}")
        if per_rank not in ("refuse", "keep"):
            raise ValueError(f"per_rank must be 'refuse' or 'keep', got {per_rank!r}")
        lay = self._layout
        found: tuple[list[int], str | None] = ([], None)
        if lay.coordinator:
            found = self._candidates(step)
        committed, error = _plan.broadcast_object(found, lay)
        if error is not None:
            raise CheckpointError(error)
        for i, s in enumerate(committed):
            got: tuple[dict[str, Any] | None, str | None] = (None, None)
            if lay.coordinator:
                try:
                    got = (_reader.read_manifest(self._fs, self._root, s), None)
                except CheckpointCorruptError as e:
                    got = (None, str(e))
                except Exception as e:  # the others wait for this answer: never skip it
                    got = (None, f"{type(e).__name__}: {e}")
            manifest, error = _plan.broadcast_object(got, lay)
            if manifest is not None:
                live = state
                if optional:
                    saved = _saved_keys(manifest)
                    live = {k: v for k, v in state.items() if k not in optional or k in saved}
                try:
                    _load.load_step(
                        self._fs,
                        self._root,
                        manifest,
                        live,
                        lay,
                        broadcast=broadcast,
                        keep_per_rank=per_rank == "keep",
                    )
                    if live is not state:
                        state.update(live)  # plain values are replaced, not updated
                    return int(s)
                except CheckpointCorruptError as e:
                    error = str(e)
            assert error is not None
            if not fallback:
                raise CheckpointCorruptError(error)
            if i + 1 == len(committed):
                raise CheckpointCorruptError(
                    f"no intact committed checkpoint under {self.url}; last error: {error}"
                )
            warnings.warn(f"{error}; falling back to step {committed[i + 1]}", stacklevel=2)
        raise AssertionError("unreachable")

    def _candidates(self, step: int | None) -> tuple[list[int], str | None]:
        """Committed steps to try, newest first, or why there are none (rank 0 only)."""
        try:
            steps = L.list_steps(self._fs, self._root)
        except Exception as e:
            return [], f"cannot list {self.url}: {type(e).__name__}: {e}"
        committed = sorted((s for s, ok in steps.items() if ok), reverse=True)
        if step is not None:
            if step not in committed:
                return [], (
                    f"step {step} has no committed checkpoint under "
                    f"{self.url} (committed: {sorted(committed)})"
                )
            committed = committed[committed.index(step) :]
        if not committed:
            return [], f"no committed checkpoint under {self.url}"
        return committed, None

    # ---------------------------------------------------------------- shutdown

    def clean(self) -> None:
        """Apply retention now (``keep_last``), e.g. after a crash left partial steps."""
        if self.keep_last is not None:
            apply_retention(self._fs, self._root, self.keep_last)

    def finalize(self) -> None:
        """Wait for the save in flight, stop the writer process, free the host buffer.

        Raises the in-flight save's ``CheckpointWriteError`` if nobody waited for it.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        try:
            if self._inflight is not None:
                self._poll(self._inflight, timeout=None)
            self._raise_unobserved()
        finally:
            self._stop_writer()
            self._pool.close()

    def abort(self) -> None:
        """Stop now, without waiting: kill the writer process (a save in flight stays
        uncommitted, a partial step that retention removes later), free the host buffer.

        For a job told to stop at once (a second Ctrl-C); safe from a signal handler. The
        committed checkpoints and ``latest`` are untouched: a commit is one rename.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._inflight = None
        try:
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(_JOIN_TIMEOUT)
            if conn is not None:
                conn.close()
        finally:
            self._pool.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.finalize()
        else:  # do not hide the exception in flight behind a save error
            try:
                self.finalize()
            except CheckpointWriteError as e:
                warnings.warn(str(e), stacklevel=2)


def _saved_keys(manifest: dict[str, Any]) -> set[str]:
    """The top-level keys of the state a manifest's parts saved."""
    keys: set[str] = set()
    for part in manifest.get("parts", []):
        keys.update(k for k, _ in part.get("tree", {}).get("d", []))
    return keys


def _finalize_ref(ref: weakref.ref[Checkpointer]) -> None:
    ckpt = ref()
    if ckpt is not None:
        try:
            ckpt.finalize()
        except CheckpointError as e:
            warnings.warn(f"ms-ckpt at exit: {e}", stacklevel=1)


def _write_error(step: int, message: str, errno: int | None) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"saving step {step} failed in stage 2: {message}. The step is partial; "
        "'latest' and the committed checkpoints are untouched, training can continue",
        step=step,
        errno=errno,
    )


def _placement(item: _tree.Item, layout: _plan.Layout) -> dict[str, Any]:
    """The record fields that say whose value an item is (docs/format.md)."""
    if item.scope == "replicated":
        return {}
    if item.scope == "rank":
        return {"dp_rank": layout.dp_rank}
    if item.scope == "dtensor":
        return {"dp_rank": layout.dp_rank, "dtensor": item.shard}
    return {"dp_rank": layout.dp_rank, "shard": item.shard}


def _make_layout(group: Any, dp_group: Any, mesh: Any, dp_dim: str | int) -> _plan.Layout:
    """The ranks' layout (collective over ``group`` when torch.distributed is in use)."""
    if mesh is not None:
        if group is not None or dp_group is not None:
            raise ValueError("pass either mesh or group/dp_group, not both")
        if not dist.is_initialized() or mesh.size() != dist.get_world_size():
            raise ValueError(
                f"mesh must span every rank of the initialized default group "
                f"(mesh size {mesh.size()}); pass group= and dp_group= otherwise"
            )
        try:
            dp_group = mesh.get_group(dp_dim)
        except (KeyError, RuntimeError, IndexError, ValueError) as e:
            raise ValueError(
                f"dp_dim must name a dimension of the mesh "
                f"{getattr(mesh, 'mesh_dim_names', None)}, got {dp_dim!r}"
            ) from e
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None or dp_group is not None:
            raise ValueError("group/dp_group given but torch.distributed is not initialized")
        return _plan.single()
    world = dist.group.WORLD
    group = world if group is None else group
    dp_group = group if dp_group is None else dp_group
    if dist.get_world_size(group) == 1:
        return _plan.single(dist.get_rank())
    return _plan.discover(group, dp_group)


def committed_steps(url: str, *, fs: Any = None) -> list[int]:
    """The committed steps under ``url``, oldest first (partial steps left out), without
    a ``Checkpointer``: no process group, no collective, nothing started. For a launcher
    or a preflight check that asks what a run would resume from (the last one), on any
    rank, at any time; it lists storage as this process sees it.

    Args:
        url: the checkpoint root, as given to ``Checkpointer``.
        fs: an fsspec filesystem to use instead of the one ``url`` names.
    """
    if fs is None:
        fs, root = fsspec.core.url_to_fs(url)
    else:
        root = fs._strip_protocol(url)
    return sorted(step for step, ok in L.list_steps(fs, root).items() if ok)
