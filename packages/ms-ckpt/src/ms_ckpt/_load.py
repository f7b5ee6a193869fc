"""Load one committed step into the live state, on one rank or on every rank of a group.

In order, with every rank agreeing after each phase so that nobody waits in a
collective for a rank that gave up:

1. plan (no I/O): the layout can take the checkpoint (else which dimension changed), and
   every tensor of the live state matches the checkpoint's dtype and shape;
2. read and verify: each replicated record of this rank's part is read by one rank of
   its DP group (the split of ``_plan.assign``), per-rank records by their rank, and the
   pieces of a sharded tensor that overlap the slice this rank holds by this rank;
3. broadcast: each rank sends the replicated records it read to its DP group;
4. restore in place.

A checksum error in phase 2 raises ``CheckpointCorruptError`` on every rank, before
anything was restored.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import zstandard

from ms_ckpt import _layout as L
from ms_ckpt import _plan, _reader, _tree
from ms_ckpt._plan import Layout
from ms_ckpt.errors import CheckpointCorruptError, CheckpointError
from ms_ckpt.placement import Sharded

_BUCKET = 32 << 20  # bytes per broadcast (docs/design.md: why 32 MiB)


@dataclass
class _Plan:
    tree: dict[str, Any]
    per_rank: dict[str, dict[str, Any]]
    replicated: list[dict[str, Any]]
    owner: dict[str, int]  # replicated key -> DP rank that reads it
    own: list[dict[str, Any]]  # per-rank records of this rank
    pieces: dict[str, list[dict[str, Any]]]  # sharded key -> pieces this rank reads
    targets: dict[str, tuple[Sharded | None, dict[str, Any]]]  # sharded key -> live, info


def _plan_load(
    manifest: dict[str, Any],
    state: dict[str, Any],
    layout: Layout,
    broadcast: bool,
    keep_per_rank: bool,
) -> _Plan:
    """Phase 1 on this rank; raises CheckpointError (not yet agreed with the others)."""
    world = manifest["world"]
    parts = manifest["parts"]
    part = parts[layout.part] if len(parts) == layout.parts else None
    per_rank_keys = sorted(part["per_rank"]) if part else []
    err = _plan.layout_error(world, layout, [] if keep_per_rank else per_rank_keys)
    if err is not None or part is None:
        raise CheckpointError(err or "layout mismatch")
    # Under another DP size, DP rank i of this job is not DP rank i of the saving job:
    # its per-rank values stay out (the caller asked to keep its live ones).
    resized = world["dp_size"] != layout.dp_size
    records = [r for r in manifest["records"] if r["part"] == layout.part]
    replicated = [r for r in records if "dp_rank" not in r]
    own = [
        r
        for r in records
        if not resized and "shard" not in r and r.get("dp_rank") == layout.dp_rank
    ]
    shards: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if "shard" in r:
            shards.setdefault(r["key"], []).append(r)
    live: dict[str, Any] = {}
    _tree.walk_live(state, live.__setitem__)

    pieces: dict[str, list[dict[str, Any]]] = {}
    targets: dict[str, tuple[Sharded | None, dict[str, Any]]] = {}
    placeholders: dict[str, Any] = {}
    for key, recs in shards.items():
        info = recs[0]["shard"]
        gshape, dim = tuple(info["global_shape"]), info["dim"]
        target = live.get(key)
        if isinstance(target, Sharded):
            if target.global_shape != gshape or target.dim != dim:
                raise CheckpointError(
                    f"state[{key!r}]: the checkpoint holds a tensor of shape {gshape} "
                    f"sharded along dim {dim}; the live Sharded is a slice of "
                    f"{target.global_shape} along dim {target.dim}"
                )
            lo, hi = target.offset, target.offset + target.length
            shape = tuple(target.local.shape)
        else:
            target, lo, hi, shape = None, 0, gshape[dim], gshape
        pieces[key] = [
            r
            for r in recs
            if r["shard"]["offset"] < hi and lo < r["shard"]["offset"] + r["shape"][dim]
        ]
        targets[key] = (target, info | {"dtype": recs[0]["dtype"]})
        placeholders[key] = torch.empty(
            shape, dtype=_reader.dtype_of(recs[0]["dtype"]), device="meta"
        )
    for r in replicated + own:
        placeholders[r["key"]] = (
            torch.empty(r["shape"], dtype=_reader.dtype_of(r["dtype"]), device="meta")
            if r["kind"] == "tensor"
            else None
        )
    # An absent per-rank subtree leaves the live value as it is (_tree.restore).
    subtrees = {} if resized else {k: v[layout.dp_rank] for k, v in part["per_rank"].items()}
    placements = {k: t for k, (t, _) in targets.items() if t is not None}
    _tree.check(state, part["tree"], _tree.Values(placeholders, subtrees, placements))
    sizes = [(r["key"], r["raw_length"], r["kind"] == "tensor") for r in replicated]
    owner = (
        _plan.assign(sizes, layout.dp_size)
        if broadcast
        else {r["key"]: layout.dp_rank for r in replicated}
    )
    return _Plan(part["tree"], subtrees, replicated, owner, own, pieces, targets)


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
    """Phase 3: every replicated record, decoded (id(record) -> value), on every rank of
    the DP group: one copy out of the bucket it travelled in."""
    device = _plan.comm_device(layout.dp_group)
    got: dict[int, Any] = {}
    for j in range(layout.dp_size):
        recs = [r for r in plan.replicated if plan.owner[r["key"]] == j]
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
                if r["kind"] == "tensor":
                    # Its own memory: an optimizer keeps the tensors it is given, which as
                    # views would pin the whole bucket.
                    got[id(r)] = piece.view(_reader.dtype_of(r["dtype"])).view(r["shape"]).clone()
                else:
                    got[id(r)] = _reader.decode(r, piece.numpy().tobytes())
    return got


def _assemble(key: str, plan: _Plan, raw: dict[int, bytes]) -> torch.Tensor:
    """The slice a live Sharded asks for (or the whole tensor) from the pieces read."""
    target, info = plan.targets[key]
    got = [(r, _reader.decode(r, raw.pop(id(r)))) for r in plan.pieces[key]]
    if target is None:
        out = torch.empty(info["global_shape"], dtype=_reader.dtype_of(info["dtype"]))
        return _reader.assemble(out, 0, info["dim"], got)
    out = torch.empty_like(target.local, device="cpu")
    return _reader.assemble(out, target.offset, info["dim"], got)


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
        plan = _plan_load(manifest, state, layout, broadcast, keep_per_rank)
        error = None
    except CheckpointError as e:
        error = (False, str(e))
    except Exception as e:  # a malformed manifest: report it on every rank, do not hang
        error = (True, f"{type(e).__name__}: {e}")
    _raise_agreed(error, layout)
    assert plan is not None
    mine = [r for r in plan.replicated if plan.owner[r["key"]] == layout.dp_rank]
    mine += plan.own + [r for recs in plan.pieces.values() for r in recs]
    raw: dict[int, bytes] = {}
    try:
        raw = _read(fs, root, manifest, mine)
        error = None
    except CheckpointCorruptError as e:
        error = (True, str(e))
    except Exception as e:  # an I/O error: the others must not wait for this rank
        error = (False, f"{type(e).__name__}: {e}")
    _raise_agreed(error, layout)
    received = _broadcast(plan, raw, layout) if broadcast and layout.dp_size > 1 else {}
    values: dict[str, Any] = {}
    for r in plan.replicated + plan.own:
        values[r["key"]] = (
            received[id(r)] if id(r) in received else _reader.decode(r, raw.pop(id(r)))
        )
    for key in plan.pieces:
        values[key] = _assemble(key, plan, raw)
    placements = {k: t for k, (t, _) in plan.targets.items() if t is not None}
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
