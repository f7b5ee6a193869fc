"""Bounded waits on collectives: a peer that stops participating is an error that
names the operation, never a silent hang."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["CollectiveTimeout", "describe_group", "wait_bounded"]


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within its timeout.

    Attributes:
        op: the collective, e.g. ``"all_gather"``.
        group: the process group's name and ranks.
        rank: this process's global rank.
        where: what the collective was for, e.g. ``"chunk 3, bucket 5"``.
        timeout_s: the bound that passed.
        waited_s: how long the wait lasted, when the backend ended it later than
            ``timeout_s`` (gloo's reduce-scatter ignores ``wait(timeout)``: only the
            process group's own timeout ends it); else None.
    """

    def __init__(
        self,
        op: str,
        group: str,
        rank: int,
        where: str,
        timeout_s: float,
        waited_s: float | None = None,
    ) -> None:
        self.op = op
        self.group = group
        self.rank = rank
        self.where = where
        self.timeout_s = timeout_s
        self.waited_s = waited_s
        late = (
            ""
            if waited_s is None
            else f" (the backend gave up only after {waited_s:.1f} s, at the process "
            "group's own timeout: it does not honour a shorter wait for this op)"
        )
        super().__init__(
            f"{op} ({where}) on process group {group} did not complete within "
            f"{timeout_s:g} s on rank {rank}{late}: a peer in the group stopped "
            "participating (crashed, hung, or took another code path)"
        )


def describe_group(group: dist.ProcessGroup) -> str:
    """A group's name and its global ranks, for error messages."""
    try:
        name = str(group.group_name)
    except (RuntimeError, AttributeError):
        name = "?"
    try:
        ranks: list[object] = list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return repr(name)
    shown = ranks if len(ranks) <= 8 else [*ranks[:4], "...", *ranks[-2:]]
    return f"{name!r} (ranks {', '.join(map(str, shown))})"


def wait_bounded(
    work: dist.Work, *, op: str, group: dist.ProcessGroup, where: str, timeout_s: float
) -> None:
    """``work.wait()`` that raises :class:`CollectiveTimeout` after ``timeout_s``.

    gloo honours ``wait(timeout)`` for most ops, but not for its reduce-scatter, which
    only the group's own timeout ends (the error then says how long it took: set the
    group's timeout to the bound you want, as ms-train does); NCCL's watchdog also
    aborts at the group's own timeout, which should not be shorter than this one.

    A work that refuses a finite timeout (a process group written in Python hands out
    works made from futures, whose ``wait`` raises "... with finite timeout not
    implemented") is waited through its future instead, with the bound kept by a
    timed wait on the future's completion: the refusal itself is not a timeout.
    """
    start = time.monotonic()
    try:
        done = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        if _refuses_timed_wait(e):
            _wait_future(work, op=op, group=group, where=where, timeout_s=timeout_s, start=start)
            return
        if not _is_timeout(e):
            raise
        waited = time.monotonic() - start
        raise CollectiveTimeout(
            op,
            describe_group(group),
            dist.get_rank(),
            where,
            timeout_s,
            waited_s=waited if waited > timeout_s + max(1.0, 0.5 * timeout_s) else None,
        ) from e
    if done is False:
        raise CollectiveTimeout(op, describe_group(group), dist.get_rank(), where, timeout_s)


def _refuses_timed_wait(e: RuntimeError) -> bool:
    # torch's FutureWrappingWork: "FutureWrappingWork::wait() with finite timeout not
    # implemented". Said before anything was waited for.
    text = str(e).lower()
    return "not implemented" in text and "timeout" in text


def _is_timeout(e: RuntimeError) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text or "did not complete within" in text


def _wait_future(
    work: dist.Work,
    *,
    op: str,
    group: dist.ProcessGroup,
    where: str,
    timeout_s: float,
    start: float,
) -> None:
    """Wait for ``work``'s future, at most what is left of ``timeout_s`` since ``start``."""
    future = work.get_future()
    finished = threading.Event()
    # Runs at once when the future is already done, else on whichever thread completes it.
    future.add_done_callback(lambda _: finished.set())
    left = max(0.0, timeout_s - (time.monotonic() - start))
    if not finished.wait(left):
        raise CollectiveTimeout(op, describe_group(group), dist.get_rank(), where, timeout_s)
    future.wait()  # raises the op's own error, if it failed
