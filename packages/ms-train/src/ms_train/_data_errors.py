"""Data found damaged during a run, as the one-line ``JobError`` a user acts on.

Preflight opens every shard (headers, footers, indexes) but verifies chunk checksums
only for the demo corpus: a corpus of terabytes is read once per epoch, not before it.
A damaged chunk met later arrives from the loader as ms-data's ``ShardError`` (possibly
the cause of a ``NodeLoaderError`` from its reader process).
"""

from __future__ import annotations

from ms_train.errors import JobError

__all__ = ["damaged_data"]


def damaged_data(error: BaseException, shards: str) -> JobError | None:
    """The ``JobError`` for a loader failure caused by a damaged shard, else None."""
    from ms_data import ShardError

    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, ShardError):
        cause = cause.__cause__
    if cause is None:
        return None
    reason = " ".join(str(cause).split())
    if not shards:
        return JobError(
            f"the demo corpus cache is damaged: {reason}; the next run verifies the cache "
            "and rebuilds it"
        )
    return JobError(
        f"data.shards {shards!r}: a shard is damaged: {reason}; check every shard with "
        f"`ms-data inspect {cause.path}` and rebuild the damaged ones"
    )
