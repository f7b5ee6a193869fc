"""Which part of a checkpoint each part of a loading job takes its state from.

With as many parts as the checkpoint, part i loads part i. With another number (a
changed tensor- or pipeline-parallel size) every part loads part 0, which is right
only for state that every saved part holds alike: a DTensor whose mesh spans the parts
(one global tensor), or a value each part saved the same (equal trees, equal records by
dtype, shape, length and CRC-32). Anything else is refused by key; docs/design.md,
"Across a changed number of parts".
"""

from __future__ import annotations

from typing import Any

from ms_ckpt import _boxes
from ms_ckpt._plan import Layout, parts_changed
from ms_ckpt._writer import first_difference

# Keys named in a refusal beside the first one, which is described in full.
_MORE = 5


def source(manifest: dict[str, Any], parts_now: int, part: int) -> int:
    """The saved part that this job's ``part`` (of ``parts_now``) loads."""
    return part if len(manifest["parts"]) == parts_now else 0


def _fingerprint(rec: dict[str, Any]) -> tuple[Any, ...]:
    """What tells two saved copies of a value apart without reading them: a CRC-32 of
    different bytes matches by chance once in 2**32."""
    shape = tuple(rec.get("shape", ()))
    return (rec["kind"], rec.get("dtype") or "", shape, rec["raw_length"], rec["raw_crc32"])


def _holdings(manifest: dict[str, Any]) -> dict[str, dict[int, list[tuple[Any, ...]]]]:
    """key -> saved part -> the fingerprints of what that part's state reads for it:
    its replicated record, or the non-empty pieces of its global tensor (a DTensor
    whose mesh spans several parts lists the same pieces under each). Per-rank records
    are left out: they never follow a layout change."""
    held: dict[str, dict[int, list[tuple[Any, ...]]]] = {}
    for rec in manifest["records"]:
        if _boxes.is_piece(rec):
            box = _boxes.box_of(rec)
            if _boxes.volume(box) == 0:  # an empty shard: where it sits depends on the mesh
                continue
            fp = (box, _boxes.global_shape_of(rec), *_fingerprint(rec))
            for p in _boxes.parts_of(rec):
                held.setdefault(rec["key"], {}).setdefault(p, []).append(fp)
        elif "dp_rank" not in rec:
            held.setdefault(rec["key"], {}).setdefault(rec["part"], []).append(_fingerprint(rec))
    return held


def _how_saved(manifest: dict[str, Any], key: str) -> str:
    rec = next(r for r in manifest["records"] if r["key"] == key)
    if "dtensor" in rec:
        return (
            "each part saved a DTensor of its own (on a mesh inside the part, as ZeRO state "
            "on the data-parallel dimension is), and the pieces of"
        )
    if "shard" in rec:
        return "each part saved Sharded slices of its own, and the slices of"
    return "each part saved a copy of its own, and the bytes of"


def reshard_error(manifest: dict[str, Any], layout: Layout) -> str | None:
    """Why a checkpoint's state cannot load into ``layout``'s parts, or None.

    Pure manifest arithmetic, no I/O: every rank computes the same answer."""
    parts = manifest["parts"]
    n = len(parts)
    if n in (layout.parts, 1):  # part i loads part i; or one saved part, alike with itself
        return None
    head = parts_changed(manifest["world"], layout)
    advice = (
        "only state that every part of the checkpoint holds alike (a value replicated "
        "across the parts, or a DTensor whose mesh spans them) loads into another number "
        f"of parts; load it with {n} parts"
    )
    for p in range(1, n):
        where = first_difference(parts[0]["tree"], parts[p]["tree"])
        if where is not None:
            at = "the root" if where == "''" else f"state[{where}]"
            return (
                f"{head}, and parts 0 and {p} of the checkpoint saved differently "
                f"structured state or different plain values at {at} (a pipeline-parallel "
                f"split, say, whose parts hold different keys); {advice}"
            )
    differing: list[tuple[str, int]] = []
    for key, by_part in _holdings(manifest).items():
        first = sorted(by_part.get(0, []))
        for p in range(1, n):
            if sorted(by_part.get(p, [])) != first:
                differing.append((key, p))
                break
    if not differing:
        return None
    key, p = differing[0]
    more = ""
    if len(differing) > 1:
        names = ", ".join(repr(k) for k, _ in differing[1 : 1 + _MORE])
        rest = len(differing) - 1 - _MORE
        more = f" (also {names}{f' and {rest} more' if rest > 0 else ''})"
    return (
        f"{head}, and state[{key!r}]{more} cannot follow it: {_how_saved(manifest, key)} "
        f"parts 0 and {p} differ; {advice}"
    )
