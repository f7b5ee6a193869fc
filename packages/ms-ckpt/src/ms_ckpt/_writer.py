"""Stage 2: write one step's shard, commit its manifest, move ``latest``, apply retention.

Runs in the writer process (``_worker``) or, for filesystems the writer process cannot
see (memory://), in the caller. Pure I/O on bytes: nothing here imports torch, so that
starting a writer does not pay for it.

``hook(point, step)``, when the user gave one, is called at ``"stage2"`` (before
anything is written), ``"record"`` (before each record) and ``"manifest"`` (the manifest
is durable under its temporary name, the rename that commits it comes next). The
writer checks that its trainer is alive after each call, so a hook that holds stage 2
at a point never lets an orphan commit.
"""

from __future__ import annotations

import contextlib
import json
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

import zstandard

from ms_ckpt import _boxes
from ms_ckpt import _layout as L
from ms_ckpt._layout import ParentGone

FORMAT = "ms-ckpt"
# Version 2 added DTensor pieces (docs/format.md). A step without one is written as
# version 1, which readers before 0.4 still load.
VERSION = 2
READABLE = (1, 2)
_CHUNK = 16 << 20  # bytes compressed per call: bounds the writer's extra memory
# After a failed step rank 0 waits at most this long for the other ranks to finish with
# the step's directory before removing it; a rank still silent then leaves it to retention.
_CLEANUP_WAIT = 30.0


Hook = Callable[[str, int], None]


class StepRefused(Exception):
    """The coordinator will not commit this step: the ranks' parts do not fit together."""


class CommitTimeout(StepRefused):
    """Some rank's part did not arrive within ``commit_timeout``."""


def describe(e: BaseException) -> str:
    """A stage-2 failure for the error the trainer raises: our own refusals as they are
    worded, OS errors with their type, anything unexpected with its traceback."""
    if isinstance(e, StepRefused):
        return str(e)
    msg = f"{type(e).__name__}: {e}"
    if not isinstance(e, OSError):
        msg += "\n" + "".join(traceback.format_exception(e))
    return msg


def manifest_bytes(body: dict[str, Any]) -> bytes:
    """Serialize with a crc32 of the canonical body, so an edited manifest is detected."""
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
    out = dict(body, checksum=zlib.crc32(canon.encode()))
    return (json.dumps(out, indent=1, sort_keys=True) + "\n").encode()


def _write_record(f: Any, data: memoryview, codec: str, level: int) -> tuple[int, int, int]:
    """Write one record; return (compressed length, crc32 raw, crc32 compressed)."""
    raw_crc = comp_crc = 0
    length = 0
    cobj = (
        zstandard.ZstdCompressor(level=level).compressobj(size=len(data))
        if codec == "zstd"
        else None
    )
    for i in range(0, len(data), _CHUNK):
        piece = data[i : i + _CHUNK]
        raw_crc = zlib.crc32(piece, raw_crc)
        out = bytes(piece) if cobj is None else cobj.compress(piece)
        comp_crc = zlib.crc32(out, comp_crc)
        length += len(out)
        f.write(out)
    if cobj is not None:
        out = cobj.flush()
        comp_crc = zlib.crc32(out, comp_crc)
        length += len(out)
        f.write(out)
    return length, raw_crc, comp_crc


def run_job(
    fs: Any,
    root: str,
    job: dict[str, Any],
    buf: memoryview,
    alive: Callable[[], bool],
    hook: Hook | None = None,
) -> None:
    """Stage 2 of one save on this rank; on failure clean up what it may, then raise.

    With several ranks a failing rank leaves an error fragment, so that the coordinator
    fails the step at once instead of waiting for it; the coordinator removes the
    partial step once every rank is done with it.
    """
    try:
        write_step(fs, root, job, buf, alive, hook)
    except ParentGone:
        raise
    except Exception as e:
        if job["world"]["world_size"] == 1:
            remove_partial(fs, root, job["step"])
            _remove_own_shard(fs, L.join(root, L.step_dir(job["step"])), job)
        else:
            directory = L.join(root, L.step_dir(job["step"]))
            _remove_own_shard(fs, directory, job)
            write_error_fragment(fs, root, job, describe(e).split("\n", 1)[0])
            if job["coordinator"] and not isinstance(e, CommitTimeout):
                # Remove the partial step once no rank writes into it any more; while
                # some rank may still be writing, leave it to retention.
                done = _await_fragments(
                    fs, directory, job, alive, errors_ok=True, timeout=_CLEANUP_WAIT
                )
                if len(done) == job["world"]["world_size"] - 1:
                    remove_partial(fs, root, job["step"])
                    _remove_fragments(fs, directory)  # of a failed re-save
        raise


def _remove_own_shard(fs: Any, directory: str, job: dict[str, Any]) -> None:
    """Best effort after a failed attempt: this rank's shard of it, never a shard that a
    committed manifest names (a failed re-save leaves the committed step as it was)."""
    names = [L.resave_shard_name(job["rank"], job["nonce"], job["seq"])]
    with contextlib.suppress(Exception):
        if not fs.exists(L.join(directory, L.MANIFEST)):
            names.append(L.shard_name(job["rank"]))
    for name in names:
        with contextlib.suppress(Exception):
            if fs.exists(L.join(directory, name)):
                fs.rm(L.join(directory, name))


def write_error_fragment(fs: Any, root: str, job: dict[str, Any], message: str) -> None:
    """Best effort: tell the coordinator this rank's part of the step failed."""
    directory = L.join(root, L.step_dir(job["step"]))
    body = {"nonce": job["nonce"], "seq": job["seq"], "rank": job["rank"], "error": message}
    with contextlib.suppress(Exception):
        fs.makedirs(directory, exist_ok=True)
        L.commit_file(fs, L.join(directory, L.fragment_name(job["rank"])), _json(body))


def _json(body: dict[str, Any]) -> bytes:
    return (json.dumps(body, sort_keys=True) + "\n").encode()


def write_step(
    fs: Any,
    root: str,
    job: dict[str, Any],
    buf: memoryview,
    alive: Callable[[], bool],
    hook: Hook | None = None,
) -> None:
    step: int = job["step"]
    codec: str = job["compression"]

    def at(point: str) -> None:
        if hook is not None:
            hook(point, step)
        if not alive():
            raise ParentGone

    at("stage2")
    directory = L.join(root, L.step_dir(step))
    # Saving a committed step again replaces it (a run resumed from an older step, or
    # from the fallback past a damaged one, saves the state it trained): the new shards
    # take names of their own, the manifest's rename swaps old for new, so the step is
    # always one whole checkpoint or the other.
    resave = fs.exists(L.join(directory, L.MANIFEST))
    fs.makedirs(directory, exist_ok=True)
    if resave:
        shard = L.resave_shard_name(job["rank"], job["nonce"], job["seq"])
    else:
        shard = L.shard_name(job["rank"])
    frag = L.fragment_name(job["rank"])
    for name in (frag, shard):  # left by an earlier attempt at this step: start over
        if fs.exists(L.join(directory, name)):
            fs.rm(L.join(directory, name))
    records: list[dict[str, Any]] = []
    offset = 0
    with fs.open(L.join(directory, shard), "wb") as f:
        items: list[tuple[dict[str, Any], memoryview]] = []
        for rec in job["tensors"]:
            start = rec["pool_offset"]
            meta = {k: v for k, v in rec.items() if k != "pool_offset"}
            items.append((meta | {"kind": "tensor"}, buf[start : start + rec["raw_length"]]))
        for meta, blob in job["blobs"]:
            items.append((meta | {"kind": "pickle", "raw_length": len(blob)}, memoryview(blob)))
        for meta, data in items:
            at("record")
            length, raw_crc, crc = _write_record(f, data, codec, job["level"])
            records.append(
                meta
                | {
                    "part": job["part"],
                    "file": shard,
                    "offset": offset,
                    "length": length,
                    "raw_crc32": raw_crc,
                    "crc32": crc,
                }
            )
            offset += length
        L.fsync_file(fs, f)
    mine = {
        "nonce": job["nonce"],
        "seq": job["seq"],
        "rank": job["rank"],
        "part": job["part"],
        "dp_rank": job["dp_rank"],
        "file": shard,
        "bytes": offset,
        "tree": job["tree"],
        "per_rank": job["per_rank"],
        "records": records,
        "error": None,
    }
    if job["world"]["world_size"] > 1:
        L.commit_file(fs, L.join(directory, frag), _json(mine))
        if not job["coordinator"]:
            return
        fragments = _await_fragments(fs, directory, job, alive, errors_ok=False)
    else:
        fragments = {}
    fragments[job["rank"]] = mine
    merged = merge(fragments, job["world"])
    body = {
        "format": FORMAT,
        "version": VERSION if any("dtensor" in r for r in merged["records"]) else 1,
        "step": step,
        "compression": {"codec": codec, "level": job["level"] if codec == "zstd" else None},
    } | merged
    if not alive():
        raise ParentGone
    for name in fs.ls(directory, detail=False):  # temporaries of a crashed attempt
        if name.rsplit("/", 1)[-1].startswith(L.MANIFEST + ".tmp-"):
            fs.rm(name)
    L.commit_file(
        fs,
        L.join(directory, L.MANIFEST),
        manifest_bytes(body),
        before_commit=lambda: at("manifest"),
    )
    for r in fragments:
        if r != job["rank"] or job["world"]["world_size"] > 1:
            with contextlib.suppress(Exception):
                fs.rm(L.join(directory, L.fragment_name(r)))
    _remove_replaced_shards(fs, directory, {str(f["file"]) for f in fragments.values()})
    _move_latest(fs, root, step)
    if job["keep_last"] is not None:
        apply_retention(fs, root, job["keep_last"])


def _remove_fragments(fs: Any, directory: str) -> None:
    """Best effort: the ranks' fragments in a step directory that outlives a failed save."""
    with contextlib.suppress(Exception):
        for path in fs.ls(directory, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("rank-") and name.endswith(".json"):
                with contextlib.suppress(Exception):
                    fs.rm(path)


def _remove_replaced_shards(fs: Any, directory: str, current: set[str]) -> None:
    """After a commit, the shards no manifest names any more (those of the checkpoint a
    re-save replaced, or of a crashed attempt); best effort, retention removes the rest."""
    with contextlib.suppress(Exception):
        for path in fs.ls(directory, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("rank-") and name.endswith(".bin") and name not in current:
                with contextlib.suppress(Exception):
                    fs.rm(path)


def _await_fragments(
    fs: Any,
    directory: str,
    job: dict[str, Any],
    alive: Callable[[], bool],
    *,
    errors_ok: bool,
    timeout: float | None = None,
) -> dict[int, dict[str, Any]]:
    """The coordinator waits for every other rank's fragment of this save (same nonce and
    sequence number: a fragment an earlier attempt left is not taken)."""
    world = job["world"]["world_size"]
    want = set(range(world)) - {job["rank"]}
    got: dict[int, dict[str, Any]] = {}
    if timeout is None:
        timeout = float(job["commit_timeout"])
    else:
        timeout = min(timeout, float(job["commit_timeout"]))
    deadline = time.monotonic() + timeout
    delay = 0.01
    while want:
        with contextlib.suppress(Exception):
            fs.invalidate_cache(directory)
        try:
            present = {n.rsplit("/", 1)[-1] for n in fs.ls(directory, detail=False)}
        except FileNotFoundError:
            present = set()
        for r in sorted(want):
            name = L.fragment_name(r)
            if name not in present:
                continue
            try:
                doc = json.loads(fs.cat_file(L.join(directory, name)))
            except (FileNotFoundError, ValueError):
                continue
            if doc.get("nonce") != job["nonce"] or doc.get("seq") != job["seq"]:
                continue  # stale: an earlier attempt's
            if doc.get("error") and not errors_ok:
                raise StepRefused(f"rank {r} failed to write its part: {doc['error']}")
            got[r] = doc
            want.discard(r)
        if not want:
            break
        if not alive():
            raise ParentGone
        if time.monotonic() > deadline:
            if errors_ok:
                return got
            raise CommitTimeout(
                f"ranks {sorted(want)} did not finish writing step {job['step']} within "
                f"commit_timeout={timeout} s (their writer died or is stuck)"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
    return got


def merge(fragments: dict[int, dict[str, Any]], world: dict[str, int]) -> dict[str, Any]:
    """The manifest's ``world``, ``records`` and ``parts`` from every rank's fragment;
    refuses structures that differ within a DP group and shards that do not tile."""
    dp_size, n_parts = world["dp_size"], world["parts"]
    parts: list[dict[str, Any]] = [{"tree": None, "per_rank": {}} for _ in range(n_parts)]
    first: dict[int, int] = {}
    writers: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    for r in sorted(fragments):
        frag = fragments[r]
        p = frag["part"]
        writers.append(
            {
                "rank": r,
                "part": p,
                "dp_rank": frag["dp_rank"],
                "file": frag["file"],
                "bytes": frag["bytes"],
            }
        )
        if parts[p]["tree"] is None:
            parts[p]["tree"], first[p] = frag["tree"], r
        elif parts[p]["tree"] != frag["tree"]:
            where = first_difference(parts[p]["tree"], frag["tree"]) or "the root"
            raise StepRefused(
                f"ranks {first[p]} and {r} of one data-parallel group saved differently "
                f"structured state (first difference at {where}); state that differs "
                "across data-parallel ranks must be wrapped in ms_ckpt.per_rank()"
            )
        for path, sub in frag["per_rank"].items():
            parts[p]["per_rank"].setdefault(path, [None] * dp_size)[frag["dp_rank"]] = sub
        records.extend(frag["records"])
    _check_records(records, n_parts)
    return {"world": dict(world, writers=writers), "records": records, "parts": parts}


def _check_records(records: list[dict[str, Any]], n_parts: int) -> None:
    """Each replicated key once per part; each sharded key's pieces tile its tensor."""
    seen: set[tuple[int, str, int | None]] = set()
    pieces: dict[tuple[int, str], list[dict[str, Any]]] = {}
    dtensors: dict[str, dict[tuple[int, ...], list[dict[str, Any]]]] = {}
    for rec in records:
        ident = (rec["part"], rec["key"], rec.get("dp_rank"))
        if "dtensor" in rec:
            scope = tuple(rec["dtensor"]["parts"])
            dtensors.setdefault(rec["key"], {}).setdefault(scope, []).append(rec)
        elif "shard" in rec:
            pieces.setdefault((rec["part"], rec["key"]), []).append(rec)
        elif ident in seen:
            raise StepRefused(f"part {rec['part']}: key {rec['key']!r} was written twice")
        seen.add(ident)
    for (part, key), recs in pieces.items():
        g = recs[0]["shard"]
        dim, size = g["dim"], g["global_shape"][g["dim"]]
        covered = 0
        for rec in sorted(recs, key=lambda x: x["shard"]["offset"]):
            s = rec["shard"]
            if (s["global_shape"], s["dim"], rec["dtype"]) != (
                g["global_shape"],
                dim,
                recs[0]["dtype"],
            ):
                raise StepRefused(
                    f"part {part}: the DP ranks' slices of {key!r} disagree on the global "
                    f"tensor ({s['global_shape']} dim {s['dim']} {rec['dtype']} vs "
                    f"{g['global_shape']} dim {dim} {recs[0]['dtype']})"
                )
            if s["offset"] != covered:
                raise StepRefused(
                    f"part {part}: the DP ranks' slices of {key!r} must tile it along dim "
                    f"{dim}; after [0, {covered}) comes a slice at offset {s['offset']}"
                )
            covered += rec["shape"][dim]
        if covered != size:
            raise StepRefused(
                f"part {part}: the DP ranks' slices of {key!r} cover [0, {covered}) of "
                f"{size} along dim {dim}"
            )
    for key, scopes in dtensors.items():
        _check_dtensor(key, scopes)


def _check_dtensor(key: str, scopes: dict[tuple[int, ...], list[dict[str, Any]]]) -> None:
    """The pieces of one DTensor: each part in one global tensor (scope), and each scope's
    pieces agree on the global tensor and tile it once."""
    claimed: dict[int, tuple[int, ...]] = {}
    for scope, recs in scopes.items():
        for p in scope:
            if p in claimed:
                raise StepRefused(
                    f"DTensor {key!r}: part {p} holds pieces of two global tensors, on meshes "
                    f"over parts {list(claimed[p])} and {list(scope)}"
                )
            claimed[p] = scope
        shape, dtype = _boxes.global_shape_of(recs[0]), recs[0]["dtype"]
        for rec in recs:
            if (_boxes.global_shape_of(rec), rec["dtype"]) != (shape, dtype):
                raise StepRefused(
                    f"DTensor {key!r} (parts {list(scope)}): the ranks' pieces disagree on "
                    f"the global tensor ({list(_boxes.global_shape_of(rec))} {rec['dtype']} "
                    f"vs {list(shape)} {dtype})"
                )
        why = _boxes.tiling_error(shape, [_boxes.box_of(r) for r in recs])
        if why is not None:
            raise StepRefused(
                f"DTensor {key!r} (parts {list(scope)}): the saved pieces must tile its "
                f"global shape {list(shape)} once: {why}"
            )


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The first path at which two skeletons differ, or None when equal."""
    if a == b:
        return None
    if isinstance(a, dict) and isinstance(b, dict) and "d" in a and "d" in b:
        ka, kb = [k for k, _ in a["d"]], [k for k, _ in b["d"]]
        if ka != kb:
            extra = sorted(map(str, set(ka) ^ set(kb))) or ka
            return repr(f"{path}/{extra[0]}" if path else str(extra[0]))
        for (k, x), (_, y) in zip(a["d"], b["d"], strict=True):
            found = first_difference(x, y, f"{path}/{k}" if path else str(k))
            if found:
                return found
    for kind in ("s", "l", "u"):
        if isinstance(a, dict) and isinstance(b, dict) and kind in a and kind in b:
            xs = [a[kind]] if kind == "s" else a[kind]
            ys = [b[kind]] if kind == "s" else b[kind]
            for i, (x, y) in enumerate(zip(xs, ys, strict=False)):
                found = first_difference(x, y, path if kind == "s" else f"{path}/{i}")
                if found:
                    return found
    return repr(path)


def _move_latest(fs: Any, root: str, step: int) -> None:
    path = L.join(root, L.LATEST)
    try:
        current = fs.cat_file(path).decode().strip()
        cur_step = int(current.removeprefix("step-"))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        cur_step = -1
    if cur_step <= step:  # never backwards, e.g. when an older step is re-saved
        L.commit_file(fs, path, (L.step_dir(step) + "\n").encode())


def apply_retention(fs: Any, root: str, keep_last: int) -> None:
    """Keep the ``keep_last`` newest committed steps; drop partials older than the newest
    commit. The newest committed step is never deleted."""
    steps = L.list_steps(fs, root)
    committed = sorted((s for s, ok in steps.items() if ok), reverse=True)
    if not committed:
        return
    doomed = committed[max(1, keep_last) :]
    doomed += [s for s, ok in steps.items() if not ok and s < committed[0]]
    for s in doomed:
        directory = L.join(root, L.step_dir(s))
        if s in committed:
            # Manifest first: a crash mid-delete leaves a partial, never a committed
            # checkpoint with missing shards.
            fs.rm(L.join(directory, L.MANIFEST))
        fs.rm(directory, recursive=True)


def remove_partial(fs: Any, root: str, step: int) -> None:
    """Best effort after a failed stage 2: free the space of the step's partial directory
    (never of a committed one)."""
    directory = L.join(root, L.step_dir(step))
    try:
        if not fs.exists(L.join(directory, L.MANIFEST)):
            fs.rm(directory, recursive=True)
    except Exception:
        pass  # the failure being reported matters more; retention retries later
