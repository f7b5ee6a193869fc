"""Names under the checkpoint root and the commit primitives (docs/format.md).

The manifest is the commit record. On a local filesystem it is written to a temporary
name, fsynced, renamed over ``manifest.json`` and the directory is fsynced, so a crash
leaves either no manifest or the whole one. On other fsspec filesystems (object stores,
memory://) a single put is atomic, and it is issued only after every shard is written.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Callable
from typing import Any

from fsspec.implementations.local import LocalFileSystem

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def resave_shard_name(rank: int, nonce: str, seq: int) -> str:
    """A shard of a step saved again after it was committed: a name of its own, so the
    committed checkpoint's shards stay intact until the new manifest replaces the old."""
    return f"rank-{rank:05d}.{nonce[:12]}-{seq}.bin"


def fragment_name(rank: int) -> str:
    """A writing rank's list of its records, which the coordinator merges into the
    manifest; removed after the commit."""
    return f"rank-{rank:05d}.json"


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)


def is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def list_steps(fs: Any, root: str) -> dict[int, bool]:
    """Step -> committed (has a manifest) for every ``step-*`` directory under ``root``."""
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return {}
    steps: dict[int, bool] = {}
    for entry in entries:
        m = _STEP_RE.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if m is not None:
            steps[int(m.group(1))] = fs.exists(join(root, m.group(0), MANIFEST))
    return steps


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ParentGone(Exception):
    """The training process died; the writer stops without committing."""


def always() -> bool:
    return True


def commit_file(
    fs: Any, path: str, data: bytes, before_commit: Callable[[], None] | None = None
) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or all of the new one.

    ``before_commit`` runs once the new bytes are durable but not yet visible under
    ``path`` (it may raise to abandon the commit).
    """
    if not is_local(fs):
        if before_commit is not None:
            before_commit()
        fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if before_commit is not None:
        try:
            before_commit()
        except BaseException:
            # Abandoned: in a committed step (a failed re-save) nothing else removes it.
            with contextlib.suppress(OSError):
                os.remove(fs._strip_protocol(tmp))
            raise
    fs.mv(tmp, path)
    _fsync_dir(os.path.dirname(fs._strip_protocol(path)))


def fsync_file(fs: Any, f: Any) -> None:
    """Make a written shard durable before the manifest names it (local filesystems)."""
    if is_local(fs):
        f.flush()
        os.fsync(f.fileno())
