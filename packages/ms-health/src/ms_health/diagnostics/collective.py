"""The collective self-test: an all-reduce across a group and an all-to-all inside a node,
each verified element by element and each bounded by a timeout.

MegaScale's diagnostics test a suspect node's links this way: the all-to-all exercises
every pair of devices inside the node (NVLink/PCIe here), the all-reduce with the
neighbour nodes the NICs and the network. A collective that does not complete in time, or
that returns wrong values, fails the check with the op and the ranks it ran over.

The waits poll ``Work.is_completed()`` against a deadline rather than trusting
``wait(timeout)``: gloo ignores that bound for some ops, and NCCL's blocking wait is off
by default. torch 2.13's gloo implements ``all_to_all_single`` (checked in the tests), so
gloo and NCCL run the same code.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ms_health.diagnostics.result import CheckResult

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = ["collective_check"]

_POLL_S = 0.002


class _Failed(Exception):
    """One op's failure; the message names the op and its ranks."""

    def __init__(self, message: str, **evidence: Any) -> None:
        super().__init__(message)
        self.evidence = evidence


def collective_check(
    group: dist.ProcessGroup,
    node_group: dist.ProcessGroup | None = None,
    *,
    device: str = "cpu",
    timeout_s: float = 30.0,
    numel: int = 1 << 18,
    repeats: int = 2,
) -> CheckResult:
    """Run on every rank of ``group``: an all-reduce over ``group``, then an all-to-all
    over ``node_group`` (the ranks of this node; ``group`` itself when None).

    Each op runs ``repeats`` times on ``numel`` float64 elements (exact integers, so
    every element of every result is checked for equality) and each run must complete
    within ``timeout_s``. The first failure ends the check: a collective that timed out
    leaves its group unusable. Every rank of the groups must call this with the same
    arguments. The backend follows the groups: gloo with ``device="cpu"``, NCCL with
    ``"cuda"`` or ``"cuda:<index>"`` (the device this rank's NCCL communicator uses).
    """
    import torch.distributed as dist

    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    for name, value in (("numel", numel), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    node = group if node_group is None else node_group
    for name, g in (("group", group), ("node_group", node)):
        if dist.get_rank(g) < 0:
            raise ValueError(f"{name} must contain this process (rank {dist.get_rank()})")
        _check_device(name, str(dist.get_backend(g)), device)

    start = time.perf_counter()
    evidence: dict[str, Any] = {"device": device, "timeout_s": timeout_s, "numel": numel}
    try:
        evidence["all_reduce"] = _all_reduce(group, device, numel, repeats, timeout_s)
        evidence["all_to_all"] = _all_to_all(node, device, numel, repeats, timeout_s)
    except _Failed as e:
        evidence.update(e.evidence)
        return CheckResult("collective", False, time.perf_counter() - start, str(e), evidence)
    ar, a2a = evidence["all_reduce"], evidence["all_to_all"]
    message = (
        f"all_reduce over ranks {ar['ranks']}: {ar['busbw_gbps']:.3g} GB/s bus; "
        f"all_to_all over ranks {a2a['ranks']}: {a2a['busbw_gbps']:.3g} GB/s bus "
        f"({numel * 8 / (1 << 20):.2g} MiB, best of {repeats})"
    )
    return CheckResult("collective", True, time.perf_counter() - start, message, evidence)


def _check_device(name: str, backend: str, device: str) -> None:
    kind = device.split(":", 1)[0] if isinstance(device, str) else None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {device!r}")
    if backend == "nccl" and kind != "cuda":
        raise ValueError(f"{name} uses NCCL, which needs device 'cuda', got {device!r}")
    if backend == "gloo" and kind != "cpu":
        raise ValueError(f"{name} uses gloo: the check runs it on device 'cpu', got {device!r}")


def _all_reduce(
    group: dist.ProcessGroup, device: str, numel: int, repeats: int, timeout_s: float
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ranks = list(dist.get_process_group_ranks(group))
    me = dist.get_rank()
    # Rank r adds (r + 1) * pattern: the sum is known exactly, and a peer that adds
    # nothing, adds twice or adds garbage changes it.
    pattern = torch.arange(numel, dtype=torch.float64, device=device).remainder_(7).add_(1)
    expected = pattern * float(sum(r + 1 for r in ranks))
    times = []
    for k in range(repeats):
        buf = pattern * float(me + 1)
        t0 = time.perf_counter()
        with _issuing("all_reduce", ranks, me, k):
            work = dist.all_reduce(buf, group=group, async_op=True)
        _wait(work, "all_reduce", ranks, me, timeout_s, k)
        times.append(time.perf_counter() - t0)
        bad = (buf != expected).nonzero()
        if len(bad):
            i = int(bad[0])
            raise _Failed(
                f"all_reduce over ranks {ranks} returned wrong values (rank {me}, repeat "
                f"{k}): {len(bad)} of {numel} elements differ, the first at {i}: got "
                f"{float(buf[i])}, expected {float(expected[i])}",
                op="all_reduce",
                ranks=ranks,
                rank=me,
            )
    n, best = len(ranks), min(times)
    busbw = 2 * (n - 1) / n * numel * 8 / best / 1e9 if n > 1 else 0.0
    return {"ranks": ranks, "times_s": times, "busbw_gbps": busbw}


def _all_to_all(
    group: dist.ProcessGroup, device: str, numel: int, repeats: int, timeout_s: float
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ranks = list(dist.get_process_group_ranks(group))
    me, n = dist.get_rank(group), len(ranks)
    chunk = max(1, numel // n)
    # The chunk from group member i to member j holds (i * n + j) * 8 + (k % 8): every
    # chunk differs from every other, so a swapped, stale or corrupted one shows, and
    # names its sender.
    ramp = torch.arange(chunk, dtype=torch.float64, device=device).remainder_(8)

    def code(src: int, dst: int) -> torch.Tensor:
        return ramp + float((src * n + dst) * 8)

    send = torch.cat([code(me, j) for j in range(n)])
    expected = torch.cat([code(i, me) for i in range(n)])
    times = []
    for k in range(repeats):
        recv = torch.empty_like(expected).fill_(-1.0)
        t0 = time.perf_counter()
        with _issuing("all_to_all", ranks, ranks[me], k):
            work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        _wait(work, "all_to_all", ranks, ranks[me], timeout_s, k)
        times.append(time.perf_counter() - t0)
        wrong = (recv != expected).view(n, chunk).any(dim=1).nonzero().flatten().tolist()
        if wrong:
            senders = [ranks[i] for i in wrong]
            raise _Failed(
                f"all_to_all over ranks {ranks} returned wrong values (rank {ranks[me]}, "
                f"repeat {k}): the chunks from rank(s) {senders} differ from what they "
                "must have sent",
                op="all_to_all",
                ranks=ranks,
                rank=ranks[me],
                wrong_senders=senders,
            )
    best = min(times)
    busbw = (n - 1) / n * chunk * n * 8 / best / 1e9 if n > 1 else 0.0
    return {"ranks": ranks, "times_s": times, "busbw_gbps": busbw}


@contextlib.contextmanager
def _issuing(op: str, ranks: list[int], me: int, k: int) -> Iterator[None]:
    # NCCL sets up its communicator inside the first op's call, which then blocks until
    # every peer arrives or the group's own timeout passes: that failure names the op too.
    try:
        yield
    except Exception as e:
        raise _Failed(
            f"{op} over ranks {ranks} could not be issued (rank {me}, repeat {k}): {e!r}"[:800],
            op=op,
            ranks=ranks,
            rank=me,
        ) from e


def _wait(work: Any, op: str, ranks: list[int], me: int, timeout_s: float, k: int) -> None:
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise _Failed(
                f"{op} over ranks {ranks} did not complete within {timeout_s:g} s (rank "
                f"{me}, repeat {k}): a peer did not join it, hung, or is unreachable",
                op=op,
                ranks=ranks,
                rank=me,
                timed_out=True,
            )
        time.sleep(_POLL_S)
    try:
        work.wait()  # surfaces the backend's error, if the op completed with one
    except Exception as e:
        raise _Failed(
            f"{op} over ranks {ranks} failed (rank {me}, repeat {k}): {e!r}"[:800],
            op=op,
            ranks=ranks,
            rank=me,
        ) from e
