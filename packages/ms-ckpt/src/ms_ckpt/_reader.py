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

from ms_ckpt import _layout as L
from ms_ckpt._writer import FORMAT, VERSION
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
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{path}: format must be {FORMAT!r} version {VERSION}, "
            f"got {doc.get('format')!r} version {doc.get('version')!r}"
        )
    if doc.get("step") != step:
        raise CheckpointCorruptError(f"{path}: manifest is for step {doc.get('step')}")
    return doc


def read_part(fs: Any, root: str, manifest: dict[str, Any], part: int = 0, dp_rank: int = 0) -> Any:
    """One part of a step as plain values, every checksum verified: sharded tensors whole,
    per-rank values those of ``dp_rank`` (for tools; training loads with ``load``)."""
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
    pieces: dict[str, list[tuple[dict[str, Any], torch.Tensor]]] = {}
    for rec in manifest["records"]:
        if rec["part"] != part:
            continue
        if "shard" not in rec and rec.get("dp_rank", dp_rank) != dp_rank:
            continue  # another rank's per-rank value
        value = decode(rec, verify_record(fs, directory, rec, codec, dctx, sizes))
        if "shard" in rec:
            pieces.setdefault(rec["key"], []).append((rec, value))
        else:
            values[rec["key"]] = value
    for key, got in pieces.items():
        info = got[0][0]["shard"]
        out = torch.empty(info["global_shape"], dtype=got[0][1].dtype)  # empty pieces too
        values[key] = assemble(out, 0, info["dim"], got)
    subtrees = {k: v[dp_rank] for k, v in parts[part]["per_rank"].items()}
    return _tree.materialize(parts[part]["tree"], _tree.Values(values, subtrees))


def assemble(
    out: torch.Tensor, lo: int, dim: int, pieces: list[tuple[dict[str, Any], torch.Tensor]]
) -> torch.Tensor:
    """Fill ``out``, rows ``[lo, lo + out.shape[dim])`` along ``dim`` of a sharded tensor,
    from the stored pieces (record, tensor) that overlap it."""
    hi = lo + out.shape[dim]
    for rec, piece in pieces:
        p_lo = rec["shard"]["offset"]
        a, b = max(lo, p_lo), min(hi, p_lo + piece.shape[dim])
        if b > a:
            out.narrow(dim, a - lo, b - a).copy_(piece.narrow(dim, a - p_lo, b - a))
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
