"""Load one committed step into the live state, on one rank or on every rank of a group.

In order, with every rank agreeing after each phase so that nobody waits in a
collective for a rank that gave up:

1. plan (no I/O): the layout can take the checkpoint (per-rank values, and under another
   number of parts what the saved parts do not hold alike, are refused by key), every
   tensor of the live state matches the checkpoint's dtype and (global) shape, and each
   sharded or DTensor value's region on this rank picks the saved pieces it needs;
2. split the reads over the DP group: every replicated record and every piece that two
   or more ranks of the group need is read by one of them (``_plan.assign_readers``),
   a piece one rank needs by that rank, per-rank records by their rank;
3. read and verify;
4. broadcast: each rank sends the shared records it read to its DP group;
5. restore in place: a live ``Sharded`` or ``DTensor`` gets its region, assembled from
   the pieces that overlap it, a plain tensor the whole tensor.

A checksum error in phase 3 raises ``CheckpointCorruptError`` on every rank, before
anything was restored.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import zstandard

from ms_ckpt import _boxes, _dtensor, _parts, _plan, _reader, _tree
from ms_ckpt import _layout as L
from ms_ckpt._boxes import Box
from ms_ckpt._plan import Layout
from ms_ckpt.errors import CheckpointCorruptError, CheckpointError
from ms_ckpt.placement import Sharded

_BUCKET = 32 << 20  # bytes per broadcast (docs/design.md: why 32 MiB)


@dataclass
class _Target:
    """Where a tensor record's value goes on this rank: the region of the global tensor
    it asks for, and the live ``Sharded`` or ``DTensor`` the value is wrapped like (None:
    a plain tensor, or nothing live: the whole tensor)."""

    live: Any
    box: Box
    dtype: str


@dataclass
class _Plan:
    source: int  # the saved part this rank's part loads (``_parts.source``)
    tree: dict[str, Any]
    per_rank: dict[str, dict[str, Any]]
    replicated: list[dict[str, Any]]
    own: list[dict[str, Any]]  # per-rank records of this rank
    pieces: dict[str, list[dict[str, Any]]]  # sharded/DTensor key -> pieces this rank needs
    targets: dict[str, _Target]  # every sharded/DTensor key; replicated keys cut to a region
    # Filled after the ranks agreed on the plan (``_split_reads``): the records read by one
    # rank of the DP group and broadcast to it, in the same order on every rank of it, and
    # who reads each (by id(record)).
    shared: list[dict[str, Any]] = field(default_factory=list)
    owner: dict[int, int] = field(default_factory=dict)


def _target(key: str, live: Any, shape: tuple[int, ...], dtype: str, what: str) -> _Target:
    """The region ``live`` asks for of a saved tensor of global ``shape`` and ``dtype``
    (``what``: "a DTensor", "a tensor"...); refuses a different global shape or dtype."""
    if isinstance(live, Sharded):
        kind, live_shape, live_dtype = "Sharded", live.global_shape, live.local.dtype
    elif _dtensor.is_dtensor(live):
        kind, live_shape, live_dtype = "DTensor", tuple(live.shape), live.dtype
    elif isinstance(live, torch.Tensor):
        kind, live_shape, live_dtype = "tensor", tuple(live.shape), live.dtype
    else:  # not in the live state, or not a tensor there: the whole tensor
        return _Target(None, _boxes.whole(shape), dtype)
    if live_shape != shape or live_dtype != _reader.dtype_of(dtype):
        raise CheckpointError(
            f"state[{key!r}]: checkpoint holds {what} of {dtype} with global shape {shape}, "
            f"the live {kind} is {str(live_dtype).removeprefix('torch.')} with global shape "
            f"{live_shape}"
        )
    if kind == "tensor":
        return _Target(None, _boxes.whole(shape), dtype)
    if isinstance(live, Sharded):
        lo = [0] * len(shape)
        lo[live.dim] = live.offset
        return _Target(live, (tuple(lo), tuple(live.local.shape)), dtype)
    try:
        return _Target(live, _dtensor.region(live, key), dtype)
    except (TypeError, ValueError) as e:
        raise CheckpointError(str(e)) from e


def _plan_load(
    manifest: dict[str, Any],
    state: dict[str, Any],
    layout: Layout,
    keep_per_rank: bool,
) -> _Plan:
    """Phase 1 on this rank; raises CheckpointError (not yet agreed with the others)."""
    world = manifest["world"]
    parts = manifest["parts"]
    moved = len(parts) != layout.parts  # another tensor- or pipeline-parallel size
    source = _parts.source(manifest, layout.parts, layout.part)
    part = parts[source]
    per_rank_keys = sorted({k for p in parts for k in p["per_rank"]} if moved else part["per_rank"])
    err = _plan.layout_error(world, layout, [] if keep_per_rank else per_rank_keys)
    err = err or _parts.reshard_error(manifest, layout)
    if err is not None:
        raise CheckpointError(err)
    # Under another layout, DP rank i of this job is not DP rank i of the saving job's
    # part: its per-rank values stay out (the caller asked to keep its live ones).
    resized = moved or world["dp_size"] != layout.dp_size
    records = [r for r in manifest["records"] if r["part"] == source]
    replicated = [r for r in records if "dp_rank" not in r]
    own = [
        r
        for r in records
        if not resized and not _boxes.is_piece(r) and r.get("dp_rank") == layout.dp_rank
    ]
    # A DTensor's pieces may come from any part its mesh spans (tensor parallelism).
    boxed: dict[str, list[dict[str, Any]]] = {}
    for r in manifest["records"]:
        if _boxes.is_piece(r) and source in _boxes.parts_of(r):
            boxed.setdefault(r["key"], []).append(r)
    live: dict[str, Any] = {}
    _tree.walk_live(state, live.__setitem__)

    pieces: dict[str, list[dict[str, Any]]] = {}
    targets: dict[str, _Target] = {}
    placeholders: dict[str, Any] = {}
    for key, recs in boxed.items():
        shape, dtype = _boxes.global_shape_of(recs[0]), recs[0]["dtype"]
        what = "a DTensor" if "dtensor" in recs[0] else "a sharded tensor"
        target = targets[key] = _target(key, live.get(key), shape, dtype, what)
        pieces[key] = [r for r in recs if _boxes.intersect(target.box, _boxes.box_of(r))]
        # Global shapes and dtypes are checked: the live leaf stands for itself.
        placeholders[key] = live[key] if key in live else _meta(shape, dtype)
    for r in replicated + own:
        key = r["key"]
        if r["kind"] != "tensor":
            placeholders[key] = None
        elif isinstance(live.get(key), Sharded) or _dtensor.is_dtensor(live.get(key)):
            # A plain saved tensor into a DTensor or Sharded: this rank's region of it.
            targets[key] = _target(key, live[key], tuple(r["shape"]), r["dtype"], "a tensor")
            placeholders[key] = live[key]
        else:
            placeholders[key] = _meta(tuple(r["shape"]), r["dtype"])
    # An absent per-rank subtree leaves the live value as it is (_tree.restore).
    subtrees = {} if resized else {k: v[layout.dp_rank] for k, v in part["per_rank"].items()}
    _tree.check(state, part["tree"], _tree.Values(placeholders, subtrees))
    return _Plan(source, part["tree"], subtrees, replicated, own, pieces, targets)


def _meta(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    return torch.empty(shape, dtype=_reader.dtype_of(dtype), device="meta")


def _split_reads(plan: _Plan, manifest: dict[str, Any], layout: Layout, broadcast: bool) -> None:
    """Collective over the DP group when it broadcasts: who reads which record.

    Every replicated record is needed by the whole DP group; a sharded or DTensor piece
    by the ranks whose live region overlaps it, which the ranks tell each other here.
    A record that two or more ranks of the group need is read by one of them (the
    largest first, onto the least loaded) and broadcast; one that a single rank needs is
    read by that rank. So a DP group reads each record it needs from storage once."""
    me = layout.dp_rank
    mine = sorted({id(r) for recs in plan.pieces.values() for r in recs})
    if not broadcast or layout.dp_size == 1:
        plan.shared = []
        plan.owner = {id(r): me for r in plan.replicated}
        return
    index = {id(r): i for i, r in enumerate(manifest["records"])}
    # Every rank of the DP group has the same part, so the same source and the same pieces
    # in scope: skip the exchange together when there are none.
    scoped = any(
        _boxes.is_piece(r) and plan.source in _boxes.parts_of(r) for r in manifest["records"]
    )
    needs: list[Any] = [[index[i] for i in mine]]
    if scoped:
        needs = [None] * layout.dp_size
        dist.all_gather_object(needs, [index[i] for i in mine], group=layout.dp_group)
    needers: dict[int, list[int]] = {}
    for j, wanted in enumerate(needs):
        for i in wanted:
            needers.setdefault(i, []).append(j)
    everyone = tuple(range(layout.dp_size))
    shared = [(r, everyone) for r in plan.replicated]
    shared += [
        (manifest["records"][i], tuple(js)) for i, js in sorted(needers.items()) if len(js) > 1
    ]
    readers = _plan.assign_readers(
        [(r["key"], r["raw_length"], r["kind"] == "tensor", js) for r, js in shared],
        layout.dp_size,
    )
    plan.shared = [r for r, _ in shared]
    plan.owner = {id(r): j for (r, _), j in zip(shared, readers, strict=True)}


def _read(
    fs: Any, root: str, manifest: dict[str, Any], recs: list[dict[str, Any]]
) -> dict[int, bytes]:
    """Phase 2: raw bytes of ``recs`` by ``id(record)``, every checksum verified."""
    directory = L.join(root, L.step_dir(manifest["step"]))
    codec = manifest["compression"]["codec"]
    dctx = zstandard.ZstdDecompressor()
    sizes: dict[str, int] = {}
    return {id(r): _reader.verify_record(fs, directory, r, codec, dctx, sizes) for r in recs}


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64  # every record starts where any dtype can view it


def _broadcast(plan: _Plan, raw: dict[int, bytes], layout: Layout) -> dict[int, Any]:
    """Phase 3: every shared record this rank needs, decoded (id(record) -> value), on
    every rank of the DP group that needs it: one copy out of the bucket it travelled in.
    Every rank takes part in every bucket; a rank drops the pieces it does not need."""
    device = _plan.comm_device(layout.dp_group)
    wanted = {id(r) for r in plan.replicated}
    wanted |= {id(r) for recs in plan.pieces.values() for r in recs}
    got: dict[int, Any] = {}
    for j in range(layout.dp_size):
        recs = [r for r in plan.shared if plan.owner[id(r)] == j]
        start = 0
        while start < len(recs):
            end, total = start, 0
            while end < len(recs) and (
                end == start or total + _aligned(recs[end]["raw_length"]) <= _BUCKET
            ):
                total += _aligned(recs[end]["raw_length"])
                end += 1
            bucket = recs[start:end]
            start = end
            if total == 0:  # only empty tensors: nothing to send
                for r in bucket:
                    if id(r) in wanted:
                        got[id(r)] = _reader.decode(r, b"")
                    raw.pop(id(r), None)
                continue
            buf = torch.empty(total, dtype=torch.uint8)
            at = 0
            if j == layout.dp_rank:
                for r in bucket:
                    ctypes.memmove(buf.data_ptr() + at, raw.pop(id(r)), r["raw_length"])
                    at += _aligned(r["raw_length"])
            sent = buf.to(device)
            dist.broadcast(sent, src=layout.dp_ranks[j], group=layout.dp_group)
            if j != layout.dp_rank:
                buf = sent.cpu()
            at = 0
            for r in bucket:  # the sender too: its values are views of the bucket it built
                piece = buf[at : at + r["raw_length"]]
                at += _aligned(r["raw_length"])
                if id(r) not in wanted:
                    continue
                if r["kind"] == "tensor":
                    # Its own memory: an optimizer keeps the tensors it is given, which as
                    # views would pin the whole bucket.
                    got[id(r)] = piece.view(_reader.dtype_of(r["dtype"])).view(r["shape"]).clone()
                else:
                    got[id(r)] = _reader.decode(r, piece.numpy().tobytes())
    return got


def _value(r: dict[str, Any], received: dict[int, Any], raw: dict[int, bytes]) -> Any:
    return received.pop(id(r)) if id(r) in received else _reader.decode(r, raw.pop(id(r)))


def load_step(
    fs: Any,
    root: str,
    manifest: dict[str, Any],
    state: dict[str, Any],
    layout: Layout,
    *,
    broadcast: bool,
    keep_per_rank: bool = False,
) -> None:
    """Collective over the layout's group. Raises CheckpointError (the layout or the live
    state cannot take this checkpoint) or CheckpointCorruptError, on every rank alike."""
    plan: _Plan | None = None
    try:
        plan = _plan_load(manifest, state, layout, keep_per_rank)
        error = None
    except CheckpointError as e:
        error = (False, str(e))
    except Exception as e:  # a malformed manifest: report it on every rank, do not hang
        error = (True, f"{type(e).__name__}: {e}")
    _raise_agreed(error, layout)
    assert plan is not None
    _split_reads(plan, manifest, layout, broadcast)
    shared = {id(r) for r in plan.shared}
    mine = [r for r in plan.shared if plan.owner[id(r)] == layout.dp_rank]
    mine += [r for r in plan.replicated if id(r) not in shared]
    mine += plan.own
    mine += [r for recs in plan.pieces.values() for r in recs if id(r) not in shared]
    raw: dict[int, bytes] = {}
    try:
        raw = _read(fs, root, manifest, mine)
        error = None
    except CheckpointCorruptError as e:
        error = (True, str(e))
    except Exception as e:  # an I/O error: the others must not wait for this rank
        error = (False, f"{type(e).__name__}: {e}")
    _raise_agreed(error, layout)
    received = _broadcast(plan, raw, layout) if plan.shared else {}
    values: dict[str, Any] = {}
    for r in plan.replicated + plan.own:
        value = _value(r, received, raw)
        target = plan.targets.get(r["key"])
        if target is not None:  # a plain saved tensor into a DTensor: this rank's region
            value = _reader.cut(value, *target.box).clone()
        values[r["key"]] = value
    for key, recs in plan.pieces.items():
        target = plan.targets[key]
        out = torch.empty(target.box[1], dtype=_reader.dtype_of(target.dtype))
        got = [(_boxes.box_of(r), _value(r, received, raw)) for r in recs]
        values[key] = _reader.assemble(out, target.box, got)
    placements = {k: t.live for k, t in plan.targets.items() if t.live is not None}
    _tree.restore(state, plan.tree, _tree.Values(values, plan.per_rank, placements))


def _raise_agreed(error: tuple[bool, str] | None, layout: Layout) -> None:
    """Collective: raise on every rank if any rank failed. ``error``: (is the checkpoint
    damaged, message); damage on any rank raises CheckpointCorruptError."""
    errors = _plan.agree(error, layout)
    if not errors:
        return
    cls = CheckpointCorruptError if any(e[0] for _, e in errors) else CheckpointError
    if not layout.distributed:
        raise cls(errors[0][1][1])
    raise cls("; ".join(f"rank {r}: {e[1]}" for r, e in errors))
