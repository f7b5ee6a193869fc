"""Read and verify a committed checkpoint: the manifest, then every record of it.

Everything is verified before anything is restored, so a checksum error leaves the live
state untouched and a fallback to an older checkpoint starts from a clean slate.
"""

from __future__ import annotations

import json
import pickle
import zlib
from typing import Any

import torch
import zstandard

from ms_ckpt import _boxes
from ms_ckpt import _layout as L
from ms_ckpt._boxes import Box
from ms_ckpt._writer import FORMAT, READABLE
from ms_ckpt.errors import CheckpointCorruptError


def read_manifest(fs: Any, root: str, step: int) -> dict[str, Any]:
    path = L.join(root, L.step_dir(step), L.MANIFEST)
    try:
        raw = fs.cat_file(path)
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{path}: manifest is not valid JSON ({e})") from e
    expected = doc.pop("checksum", None)
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    if expected != zlib.crc32(canon.encode()):
        raise CheckpointCorruptError(f"{path}: manifest checksum mismatch")
    if doc.get("format") != FORMAT or doc.get("version") not in READABLE:
        raise CheckpointCorruptError(
            f"{path}: format must be {FORMAT!r} version {' or '.join(map(str, READABLE))}, "
            f"got {doc.get('format')!r} version {doc.get('version')!r}"
        )
    if doc.get("step") != step:
        raise CheckpointCorruptError(f"{path}: manifest is for step {doc.get('step')}")
    return doc


def read_part(fs: Any, root: str, manifest: dict[str, Any], part: int = 0, dp_rank: int = 0) -> Any:
    """One part of a step as plain values, every checksum verified: sharded and DTensor
    state whole, per-rank values those of ``dp_rank`` (for tools; training loads with
    ``load``)."""
    from ms_ckpt import _tree

    parts = manifest["parts"]
    if not 0 <= part < len(parts):
        raise ValueError(f"part must be in [0, {len(parts)}), got {part}")
    dp_size = manifest["world"]["dp_size"]
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    directory = L.join(root, L.step_dir(manifest["step"]))
    codec = manifest["compression"]["codec"]
    dctx = zstandard.ZstdDecompressor()
    sizes: dict[str, int] = {}
    values: dict[str, Any] = {}
    pieces: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for rec in manifest["records"]:
        if _boxes.is_piece(rec):
            if part not in _boxes.parts_of(rec):  # a DTensor's pieces may come from any part
                continue
        elif rec["part"] != part or rec.get("dp_rank", dp_rank) != dp_rank:
            continue  # another part's, or another rank's per-rank value
        value = decode(rec, verify_record(fs, directory, rec, codec, dctx, sizes))
        if _boxes.is_piece(rec):
            pieces.setdefault(rec["key"], []).append((_boxes.box_of(rec), value))
            shapes[rec["key"]] = (_boxes.global_shape_of(rec), value.dtype)
        else:
            values[rec["key"]] = value
    for key, got in pieces.items():
        shape, dtype = shapes[key]
        values[key] = assemble(torch.empty(shape, dtype=dtype), _boxes.whole(shape), got)
    subtrees = {k: v[dp_rank] for k, v in parts[part]["per_rank"].items()}
    return _tree.materialize(parts[part]["tree"], _tree.Values(values, subtrees))


def cut(t: torch.Tensor, at: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
    """The view of ``t`` starting at ``at`` with ``size`` in each dimension."""
    for d, (a, n) in enumerate(zip(at, size, strict=True)):
        t = t.narrow(d, a, n)
    return t


def assemble(out: torch.Tensor, box: Box, pieces: list[tuple[Box, torch.Tensor]]) -> torch.Tensor:
    """Fill ``out``, the region ``box`` of a global tensor, from the stored pieces (their
    box, their tensor) that overlap it. Returns ``out``."""
    for piece_box, piece in pieces:
        common = _boxes.intersect(box, piece_box)
        if common is None:
            continue
        lo, size = common
        dst = cut(out, tuple(a - b for a, b in zip(lo, box[0], strict=True)), size)
        dst.copy_(cut(piece, tuple(a - b for a, b in zip(lo, piece_box[0], strict=True)), size))
    return out


def verify_record(
    fs: Any,
    directory: str,
    rec: dict[str, Any],
    codec: str,
    dctx: zstandard.ZstdDecompressor,
    sizes: dict[str, int],
) -> bytes:
    """The raw bytes of one record after every check of docs/format.md passed.

    ``sizes`` caches shard file sizes across calls (path -> bytes).
    """
    path = L.join(directory, rec["file"])
    if path not in sizes:
        try:
            sizes[path] = fs.size(path)
        except FileNotFoundError as e:
            raise CheckpointCorruptError(f"{path}: shard file is missing") from e
    start, end = rec["offset"], rec["offset"] + rec["length"]
    where = f"{path}: record {rec['key']!r}"
    if end > sizes[path]:
        raise CheckpointCorruptError(
            f"{where} needs bytes [{start}, {end}), the file has {sizes[path]} (truncated)"
        )
    # Ranged reads: the reader holds one record at a time, never a whole shard.
    comp = fs.cat_file(path, start=start, end=end) if end > start else b""
    if zlib.crc32(comp) != rec["crc32"]:
        raise CheckpointCorruptError(f"{where}: crc32 of the stored bytes mismatch")
    try:
        raw = dctx.decompress(comp) if codec == "zstd" else bytes(comp)
    except zstandard.ZstdError as e:
        raise CheckpointCorruptError(f"{where}: cannot decompress ({e})") from e
    if len(raw) != rec["raw_length"] or zlib.crc32(raw) != rec["raw_crc32"]:
        raise CheckpointCorruptError(f"{where}: crc32 of the decompressed bytes mismatch")
    return raw


def decode(rec: dict[str, Any], raw: bytes) -> Any:
    """A verified record's value: a tensor, or the unpickled object."""
    if rec["kind"] == "pickle":
        return pickle.loads(raw)
    return _tensor(raw, rec["dtype"], rec["shape"])


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a record names (``"bfloat16"``); an unknown name is damage."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"unknown dtype {name!r}")
    return dtype


def _tensor(raw: bytes, dtype_name: str, shape: list[int]) -> torch.Tensor:
    dtype = dtype_of(dtype_name)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
