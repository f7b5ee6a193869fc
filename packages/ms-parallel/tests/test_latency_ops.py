"""The latency backend on 2 gloo ranks: every op gives gloo's result, sync and async, and
completes no earlier than issue + L of its type, in issue order; timeouts, errors and
shutdown behave.

One launch runs the op-by-op checks (each op on a latency group and on the plain gloo
WORLD group, same inputs) and returns what the tests below assert on; the checks that
need a process of their own (shutdown, a group that is never destroyed) launch apart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ms_parallel.events import EventLog
from ms_parallel.latency import OP_TYPES, register_latency_backend
from ms_testing import launch, run_ranks

pytestmark = pytest.mark.slow  # every test starts 2 rank processes

NAME = "mstest_latency"
# A different latency per op type, so that a wrong mapping shows in the bounds.
LATENCY = {
    "all_reduce": 0.020,
    "all_gather": 0.025,
    "reduce_scatter": 0.030,
    "broadcast": 0.035,
    "all_to_all": 0.040,
    "p2p": 0.045,
    "barrier": 0.050,
    "default": 0.055,
}
WORLD = 2

Op = Callable[[dist.ProcessGroup, bool, int], list[torch.Tensor]]


def _wait(work: Any, async_op: bool) -> None:
    # A synchronous call returns None (it waited inside); an async one returns the work.
    if async_op:
        assert work is not None
        work.wait()
    else:
        assert work is None


def _data(rank: int, n: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(n, generator=g)


def op_all_reduce_sum(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    t = _data(rank, 7, 1)
    _wait(dist.all_reduce(t, group=g, async_op=a), a)
    return [t]


def op_all_reduce_max(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    t = _data(rank, 5, 2)
    _wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g, async_op=a), a)
    return [t]


def op_all_reduce_coalesced(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    ts = [_data(rank, 3, 3), _data(rank, 4, 4)]
    _wait(dist.all_reduce_coalesced(ts, group=g, async_op=a), a)
    return ts


def op_broadcast(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    t = _data(rank, 6, 5)
    _wait(dist.broadcast(t, src=1, group=g, async_op=a), a)
    return [t]


def op_reduce(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    t = _data(rank, 4, 6)
    _wait(dist.reduce(t, dst=0, group=g, async_op=a), a)
    return [t] if rank == 0 else []  # only the destination's result is defined


def op_all_gather(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    out = [torch.empty(3) for _ in range(WORLD)]
    _wait(dist.all_gather(out, _data(rank, 3, 7), group=g, async_op=a), a)
    return out


def op_all_gather_single(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    out = torch.empty(WORLD * 5)
    _wait(dist.all_gather_single(out, _data(rank, 5, 8), group=g, async_op=a), a)
    return [out]


def op_gather(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    out = [torch.empty(2) for _ in range(WORLD)] if rank == 0 else None
    _wait(dist.gather(_data(rank, 2, 9), out, dst=0, group=g, async_op=a), a)
    return out or []


def op_scatter(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    out = torch.empty(4)
    parts = [_data(r, 4, 10) for r in range(WORLD)] if rank == 0 else None
    _wait(dist.scatter(out, parts, src=0, group=g, async_op=a), a)
    return [out]


def op_reduce_scatter(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    out = torch.empty(3)
    parts = [_data(rank, 3, 11 + r) for r in range(WORLD)]
    _wait(dist.reduce_scatter(out, parts, group=g, async_op=a), a)
    return [out]


def op_reduce_scatter_single(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    out = torch.empty(4)
    _wait(dist.reduce_scatter_single(out, _data(rank, 4 * WORLD, 13), group=g, async_op=a), a)
    return [out]


def op_all_to_all_single(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    # Uneven splits: rank r sends r + 1 + j elements to rank j.
    send = [rank + 1 + j for j in range(WORLD)]
    recv = [r + 1 + rank for r in range(WORLD)]
    out = torch.empty(sum(recv))
    inp = _data(rank, sum(send), 14)
    _wait(dist.all_to_all_single(out, inp, recv, send, group=g, async_op=a), a)
    return [out]


def op_all_to_all(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    out = [torch.empty(2) for _ in range(WORLD)]
    inp = [_data(rank, 2, 15 + j) for j in range(WORLD)]
    _wait(dist.all_to_all(out, inp, group=g, async_op=a), a)
    return out


def op_send_recv(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    # Rank 0 sends first and rank 1 receives first, then the other way round.
    mine, theirs = _data(rank, 5, 16), torch.empty(5)
    peer = 1 - rank
    order = [("send", mine), ("recv", theirs)]
    for what, t in order if rank == 0 else order[::-1]:
        if a:
            work = (
                dist.isend(t, group=g, group_dst=peer)
                if what == "send"
                else dist.irecv(t, group=g, group_src=peer)
            )
            assert work is not None
            work.wait()
        elif what == "send":
            dist.send(t, group=g, group_dst=peer)
        else:
            dist.recv(t, group=g, group_src=peer)
    return [theirs]


def op_barrier(g: dist.ProcessGroup, a: bool, rank: int) -> list[torch.Tensor]:
    _wait(dist.barrier(group=g, async_op=a), a)
    return []


# name -> (function, the latency op type it must be charged as)
OPS: dict[str, tuple[Op, str]] = {
    "all_reduce_sum": (op_all_reduce_sum, "all_reduce"),
    "all_reduce_max": (op_all_reduce_max, "all_reduce"),
    "all_reduce_coalesced": (op_all_reduce_coalesced, "all_reduce"),
    "broadcast": (op_broadcast, "broadcast"),
    "reduce": (op_reduce, "reduce"),
    "all_gather": (op_all_gather, "all_gather"),
    "all_gather_single": (op_all_gather_single, "all_gather"),
    "gather": (op_gather, "gather"),
    "scatter": (op_scatter, "scatter"),
    "reduce_scatter": (op_reduce_scatter, "reduce_scatter"),
    "reduce_scatter_single": (op_reduce_scatter_single, "reduce_scatter"),
    "all_to_all_single": (op_all_to_all_single, "all_to_all"),
    "all_to_all": (op_all_to_all, "all_to_all"),
    "send_recv": (op_send_recv, "p2p"),
    "barrier": (op_barrier, "barrier"),
}


def expected_latency(op_type: str) -> float:
    return LATENCY.get(op_type, LATENCY["default"])


def rank_ops() -> dict[str, Any]:
    rank = dist.get_rank()
    log = EventLog()
    net = register_latency_backend(NAME, latency=LATENCY, on_event=log)
    pg = dist.new_group(backend=NAME)
    assert pg is not None
    world = dist.group.WORLD
    assert world is not None
    out: dict[str, Any] = {"group_name": pg.group_name, "backend": dist.get_backend(pg)}

    # 1. every op: gloo's result, the caller's measured time, sync and async
    results, elapsed = {}, {}
    for name, (fn, _) in OPS.items():
        for async_op in (False, True):
            key = f"{name}/{'async' if async_op else 'sync'}"
            expected = fn(world, async_op, rank)
            t0 = time.perf_counter()
            got = fn(pg, async_op, rank)
            elapsed[key] = time.perf_counter() - t0
            results[key] = (expected, got)
    out["results"], out["elapsed"] = results, elapsed

    # 2. completion order: a slow op, then fast ones issued behind it
    net.set_latency(all_reduce=0.4, broadcast=0.0, barrier=0.0)
    slow = dist.all_reduce(torch.ones(2), group=pg, async_op=True)
    fast = dist.broadcast(torch.ones(2), src=0, group=pg, async_op=True)
    last = dist.barrier(group=pg, async_op=True)
    assert last is not None and fast is not None and slow is not None
    last.wait()
    out["order"] = {"slow_done_when_last_done": slow.is_completed(), "fast": fast.is_completed()}
    slow.wait()
    fast.wait()

    # 3. wait(timeout) gives up with gloo's error type, and the op still completes
    net.set_latency(all_reduce=1.0)
    t = torch.full((3,), float(rank + 1))
    work = dist.all_reduce(t, group=pg, async_op=True)
    assert work is not None
    try:
        work.wait(timedelta(milliseconds=50))
        out["timeout"] = None
    except dist.DistBackendError as e:
        out["timeout"] = str(e)
    out["timeout_completed_then"] = work.is_completed()
    out["timeout_wait_after"] = work.wait()
    out["timeout_result"] = t
    out["timeout_future"] = work.get_future().wait()

    # 4. a hook that fails at completion fails the op's wait, not the group
    net.set_latency(all_reduce=0.0)

    def failing(name: str, kind: str, t: float, **attrs: Any) -> None:
        if kind == "complete":
            raise RuntimeError("hook failed on purpose")

    net.on_event = failing
    work = dist.all_reduce(torch.ones(1), group=pg, async_op=True)
    assert work is not None
    try:
        work.wait()
        out["hook_error"] = None
    except RuntimeError as e:
        out["hook_error"] = str(e)
    net.on_event = log
    t = torch.ones(1)
    dist.all_reduce(t, group=pg)
    out["after_hook_error"] = t.item()
    # 5. callbacks on an op's future see its result; one that waits on a later op of the
    #    same group (it runs on the completion thread) gets an error instead of a hang
    net.set_latency(all_reduce=1.0)  # both issued and the callbacks attached long before
    first = dist.all_reduce(torch.full((2,), float(rank)), group=pg, async_op=True)
    second = dist.all_reduce(torch.ones(1), group=pg, async_op=True)
    assert first is not None and second is not None
    doubled = first.get_future().then(lambda f: f.value()[0] * 2)
    nested = first.get_future().then(lambda f: second.wait())
    out["callback_value"] = doubled.wait()
    try:
        nested.wait()
        out["nested_error"] = None
    except RuntimeError as e:
        out["nested_error"] = str(e)
    second.wait()
    out["events"] = [(e.name, e.kind, e.t, dict(e.attrs)) for e in log.events]
    return out


@pytest.fixture(scope="module")
def ops_run() -> list[dict[str, Any]]:
    return run_ranks(rank_ops, WORLD, timeout=180)


def test_the_group_is_a_latency_group(ops_run: list[dict[str, Any]]) -> None:
    for r in ops_run:
        assert r["backend"] == NAME
        assert r["group_name"]  # c10d's name, kept by the group (DeviceMesh needs it)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("op", list(OPS))
def test_every_op_gives_the_gloo_result(ops_run: list[dict[str, Any]], op: str, mode: str) -> None:
    for rank, r in enumerate(ops_run):
        expected, got = r["results"][f"{op}/{mode}"]
        assert len(got) == len(expected), (rank, op)
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g), (rank, op, e, g)
    if op == "broadcast":  # the test would pass if nothing moved: check that it did
        assert torch.equal(ops_run[0]["results"]["broadcast/sync"][1][0], _data(1, 6, 5))


@pytest.mark.parametrize("op", list(OPS))
def test_the_caller_waits_at_least_the_latency(ops_run: list[dict[str, Any]], op: str) -> None:
    """Measured around the call: sync and async, both see issue + L."""
    op_type = OPS[op][1]
    # send_recv is two ops in a row; reduce, gather and scatter take the default
    n = 2 if op == "send_recv" else 1
    for r in ops_run:
        for mode in ("sync", "async"):
            assert r["elapsed"][f"{op}/{mode}"] >= n * expected_latency(op_type), (op, mode)


def test_completion_no_earlier_than_issue_plus_latency(ops_run: list[dict[str, Any]]) -> None:
    """From the group's own events: each op's complete is at or after its issue + its
    type's L, and every op type was exercised."""
    for rank, r in enumerate(ops_run):
        issues: dict[tuple[str, int], tuple[str, float, dict[str, Any]]] = {}
        completes: dict[tuple[str, int], float] = {}
        for name, kind, t, attrs in r["events"]:
            key = (attrs["group"], attrs["seq"])
            assert attrs["rank"] == rank
            if kind == "issue":
                issues[key] = (name, t, attrs)
            elif kind == "complete":
                completes[key] = t
        assert set(issues) == set(completes)
        seen = set()
        for key, (name, t_issue, attrs) in issues.items():
            assert completes[key] >= t_issue + attrs["latency"], (name, key)
            seen.add(name)
        assert seen >= {*OP_TYPES} - {"default"} | {"reduce", "gather", "scatter"}
        # during the op-by-op pass each op carries its type's L
        op_pass = [e for e in r["events"] if e[1] == "issue"][: 2 * len(OPS) + 2]
        for name, _, _, attrs in op_pass:
            assert attrs["latency"] == expected_latency(name), (name, attrs)


def test_event_attrs(ops_run: list[dict[str, Any]]) -> None:
    events = ops_run[0]["events"]
    name, kind, _, attrs = events[0]  # the first op: all_reduce of 7 float32 on the group
    assert (name, kind) == ("all_reduce", "issue")
    assert attrs["method"] == "allreduce" and attrs["bytes"] == 7 * 4
    assert attrs["group"] == ops_run[0]["group_name"] and attrs["seq"] == 0
    peers = {a["peer"] for n, k, _, a in events if n == "p2p" and k == "issue"}
    assert peers == {1}


def test_ops_complete_in_issue_order(ops_run: list[dict[str, Any]]) -> None:
    for r in ops_run:
        assert r["order"] == {"slow_done_when_last_done": True, "fast": True}
        completes = [(a["seq"], t) for _, k, t, a in r["events"] if k == "complete"]
        assert [s for s, _ in completes] == sorted(s for s, _ in completes)
        times = [t for _, t in completes]
        assert times == sorted(times)


def test_wait_timeout_is_honoured(ops_run: list[dict[str, Any]]) -> None:
    for r in ops_run:
        assert r["timeout"] is not None and "within the wait timeout of 0.05 s" in r["timeout"]
        assert r["timeout_wait_after"] is True
        assert torch.equal(r["timeout_result"], torch.full((3,), 3.0))
        assert torch.equal(r["timeout_future"][0], torch.full((3,), 3.0))


def test_a_failing_hook_fails_the_wait_and_the_group_goes_on(
    ops_run: list[dict[str, Any]],
) -> None:
    for r in ops_run:
        assert r["hook_error"] is not None and "hook failed on purpose" in r["hook_error"]
        assert r["after_hook_error"] == 2.0


def rank_inner_error() -> dict[str, Any]:
    """Rank 0 all-reduces on a group with a 1 s timeout; rank 1 never joins in."""
    log = EventLog()
    register_latency_backend(NAME, latency=0.0, on_event=log)
    pg = dist.new_group(backend=NAME, timeout=timedelta(seconds=1))
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        work = dist.all_reduce(torch.ones(4), group=pg, async_op=True)
        assert work is not None
        try:
            work.wait()
            out["error"] = None
        except RuntimeError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        try:
            work.get_future().wait()
            out["future_error"] = None
        except RuntimeError as e:
            out["future_error"] = str(e)
        out["events"] = [(e.kind, dict(e.attrs)) for e in log.events]
    dist.barrier()  # on WORLD (plain gloo): rank 1 waits here meanwhile
    return out


def test_an_inner_error_reaches_the_waiter() -> None:
    r0, _ = run_ranks(rank_inner_error, WORLD, timeout=120)
    # gloo's own error and message (its recv timed out), raised by wait() and the future
    assert r0["error"] is not None and "Timed out" in r0["error"], r0
    assert r0["future_error"] is not None and "Timed out" in r0["future_error"]
    error_type = r0["error"].split(":")[0]
    kinds = [(k, a.get("error")) for k, a in r0["events"]]
    assert kinds == [("issue", None), ("complete", error_type)]


def rank_shutdown(destroy: bool) -> dict[str, Any]:
    """Issue ops without waiting for them, then destroy the group (or not at all)."""
    register_latency_backend(NAME, latency=0.3)
    pg = dist.new_group(backend=NAME)
    works = [dist.all_reduce(torch.ones(2), group=pg, async_op=True) for _ in range(3)]
    before = [t.name for t in threading.enumerate() if t.name.startswith("ms-latency")]
    if not destroy:
        return {"threads_before": before}
    dist.destroy_process_group(pg)
    after = [t.name for t in threading.enumerate() if t.name.startswith("ms-latency")]
    done = [w is not None and w.is_completed() for w in works]
    error = None
    try:
        dist.all_reduce(torch.ones(1), group=pg)
    except (RuntimeError, ValueError) as e:
        error = str(e)
    return {"threads_before": before, "threads_after": after, "done": done, "error": error}


def test_destroy_completes_pending_ops_and_stops_the_thread() -> None:
    for r in run_ranks(rank_shutdown, WORLD, args=(True,), timeout=120):
        assert len(r["threads_before"]) == 1
        assert r["threads_after"] == []
        assert r["done"] == [True, True, True]
        assert r["error"] is not None  # a destroyed group takes no more ops


def rank_never_destroyed() -> dict[str, Any]:
    """Latency as the default backend, a DeviceMesh on it, and no destroy at the end."""
    import os

    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from torch.distributed.device_mesh import init_device_mesh

    register_latency_backend(NAME, latency=0.05)
    store = TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(NAME, store=store, rank=int(os.environ["RANK"]), world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    group = mesh.get_group()
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    pending = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    return {"group": type(group).__name__, "sum": t.tolist(), "pending": pending is not None}


def test_latency_as_default_backend_and_a_process_that_never_destroys_exits() -> None:
    report = launch(rank_never_destroyed, WORLD, init_process_group=False, timeout=120)
    for outcome in report.outcomes:
        assert outcome.status == "ok", report.describe()
        assert outcome.value == {"group": "LatencyProcessGroup", "sum": [2.0, 2.0], "pending": True}
        # the completion thread is a daemon: the process exits on its own, code 0
        assert outcome.exitcode == 0, outcome


def test_future_callbacks_get_the_result_and_a_nested_wait_is_refused(
    ops_run: list[dict[str, Any]],
) -> None:
    for r in ops_run:
        assert torch.equal(r["callback_value"], torch.full((2,), 2.0))  # (0 + 1) * 2
        assert r["nested_error"] is not None
        assert "waited for inside a callback of an earlier op" in r["nested_error"]
