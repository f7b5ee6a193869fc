"""Stage 2: write one step's shard, commit its manifest, move ``latest``, apply retention.

Runs in the writer process (``_worker``) or, for filesystems the writer process cannot
see (memory://), in the caller. Pure I/O on bytes: no torch import is needed here.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import zstandard

from ms_ckpt import _layout as L
from ms_ckpt._layout import ParentGone

FORMAT = "ms-ckpt"
VERSION = 1
_CHUNK = 16 << 20  # bytes compressed per call: bounds the writer's extra memory


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


def write_step(
    fs: Any, root: str, job: dict[str, Any], buf: memoryview, alive: Callable[[], bool]
) -> None:
    step: int = job["step"]
    hooks: dict[str, float] = job["hooks"]
    codec: str = job["compression"]
    L.pause(hooks, "stage2", alive)
    directory = L.join(root, L.step_dir(step))
    if fs.exists(L.join(directory, L.MANIFEST)):
        raise FileExistsError(f"step {step} is already committed at {directory}")
    if fs.exists(directory):  # a partial left by a crash: start it over
        fs.rm(directory, recursive=True)
    fs.makedirs(directory, exist_ok=True)
    shard = L.shard_name(job["rank"])
    records: list[dict[str, Any]] = []
    offset = 0
    with fs.open(L.join(directory, shard), "wb") as f:
        items: list[tuple[dict[str, Any], memoryview]] = []
        for rec in job["tensors"]:
            start = rec["pool_offset"]
            items.append(
                (
                    {k: v for k, v in rec.items() if k != "pool_offset"} | {"kind": "tensor"},
                    buf[start : start + rec["raw_length"]],
                )
            )
        for key, blob in job["blobs"]:
            items.append(
                ({"key": key, "kind": "pickle", "raw_length": len(blob)}, memoryview(blob))
            )
        for meta, data in items:
            L.pause(hooks, "record", alive)
            if not alive():
                raise ParentGone
            length, raw_crc, crc = _write_record(f, data, codec, job["level"])
            records.append(
                meta
                | {
                    "file": shard,
                    "offset": offset,
                    "length": length,
                    "raw_crc32": raw_crc,
                    "crc32": crc,
                }
            )
            offset += length
        L.fsync_file(fs, f)
    body = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "world": {
            "world_size": 1,
            "dp_size": 1,
            "writers": [{"rank": job["rank"], "dp_rank": 0, "file": shard, "bytes": offset}],
        },
        "compression": {"codec": codec, "level": job["level"] if codec == "zstd" else None},
        "records": records,
        "tree": job["tree"],
    }
    if not alive():
        raise ParentGone
    L.commit_file(fs, L.join(directory, L.MANIFEST), manifest_bytes(body), hooks, alive)
    _move_latest(fs, root, step)
    if job["keep_last"] is not None:
        apply_retention(fs, root, job["keep_last"])


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
