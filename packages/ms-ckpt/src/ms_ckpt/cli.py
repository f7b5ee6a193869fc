"""The ``ms-ckpt`` command: ``ls`` the steps of a checkpoint root, ``inspect`` and verify
one step, ``convert`` it to a plain ``torch.save`` file or to torch.distributed.checkpoint.

Exit codes: 0 success; 1 the checkpoint is damaged (``inspect`` lists every damaged
record, ``ls`` flags a damaged manifest, ``convert`` stops at the first damage); 2 bad
arguments or inputs (no such step, no committed checkpoint), reported as one message
rather than a traceback.
Pickle records are unpickled by ``convert`` (never by ``ls`` or ``inspect``), so only
convert checkpoints you trust, as with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import fsspec
import zstandard

from ms_ckpt import _layout as L
from ms_ckpt import _reader
from ms_ckpt.errors import CheckpointCorruptError, CheckpointError

__all__ = ["main"]


class _UsageError(Exception):
    """Bad input: exit code 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ms-ckpt", description="List, verify and convert ms-ckpt checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ls = sub.add_parser(
        "ls",
        help="list the steps under a checkpoint root",
        description="One line per step directory: step, committed or partial, bytes on "
        "storage (sum of its files), number of records, and which step 'latest' names.",
    )
    ls.add_argument("url", metavar="URL", help="checkpoint root (path or fsspec URL)")
    ls.set_defaults(func=_cmd_ls)

    ins = sub.add_parser(
        "inspect",
        help="summarize one step and verify every checksum",
        description="Print the manifest summary and every record, read each record and "
        "verify its checksums. Exit 1 if anything is damaged.",
    )
    ins.add_argument("url", metavar="URL", help="checkpoint root (path or fsspec URL)")
    ins.add_argument("--step", type=int, metavar="N", help="default: newest committed step")
    ins.set_defaults(func=_cmd_inspect)

    conv = sub.add_parser(
        "convert",
        help="write one step as torch.save or torch.distributed.checkpoint",
        description="Read and verify one step and write its state as stored: tensors and "
        "unpickled values, nested as saved (modules and optimizers as their state_dicts). "
        "--to torch: one torch.save file; --to dcp: a torch.distributed.checkpoint "
        "directory, loadable with torch.distributed.checkpoint.load into a matching "
        "plain state dict.",
    )
    conv.add_argument("url", metavar="URL", help="checkpoint root (path or fsspec URL)")
    conv.add_argument("out", metavar="OUT", help="output file (torch) or directory (dcp)")
    conv.add_argument("--step", type=int, metavar="N", help="default: newest committed step")
    conv.add_argument("--to", choices=("torch", "dcp"), default="torch", help="default: torch")
    conv.add_argument(
        "--part",
        type=int,
        default=0,
        metavar="P",
        help="which model-parallel part (a DP group's state) to write; default 0",
    )
    conv.add_argument(
        "--dp-rank",
        type=int,
        default=0,
        metavar="R",
        help="whose per-rank values to write (RNG, per_rank state); default 0. Sharded "
        "tensors are written whole",
    )
    conv.set_defaults(func=_cmd_convert)
    return parser


def _open_root(url: str) -> tuple[Any, str]:
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def _pick_step(fs: Any, root: str, url: str, step: int | None) -> int:
    steps = L.list_steps(fs, root)
    committed = sorted(s for s, ok in steps.items() if ok)
    if step is None:
        if not committed:
            raise _UsageError(f"no committed checkpoint under {url}")
        return committed[-1]
    if step not in committed:
        what = "is partial (no manifest)" if step in steps else "does not exist"
        raise _UsageError(f"step {step} {what} under {url} (committed: {committed})")
    return step


def _latest(fs: Any, root: str) -> int | None:
    try:
        text = fs.cat_file(L.join(root, L.LATEST)).decode().strip()
        return int(text.removeprefix("step-"))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _cmd_ls(args: argparse.Namespace) -> int:
    fs, root = _open_root(args.url)
    if not fs.isdir(root):
        raise _UsageError(f"{args.url} is not a directory")
    latest = _latest(fs, root)
    rows = [["STEP", "STATE", "BYTES", "RECORDS", ""]]
    notes: list[str] = []
    for step, committed in sorted(L.list_steps(fs, root).items()):
        files = fs.find(L.join(root, L.step_dir(step)), detail=True)
        size = sum(int(info.get("size") or 0) for info in files.values())
        records = "-"
        if committed:
            try:
                records = str(len(_reader.read_manifest(fs, root, step)["records"]))
            except CheckpointCorruptError as e:
                records = "?"
                notes.append(str(e))
        rows.append(
            [
                str(step),
                "committed" if committed else "partial",
                str(size),
                records,
                "latest" if step == latest else "",
            ]
        )
    if len(rows) == 1:
        print(f"no steps under {args.url}")
        return 0
    for line in _table(rows, right={0, 2, 3}):
        print(line)
    for note in notes:
        print(f"damaged manifest: {note}")
    return 1 if notes else 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    fs, root = _open_root(args.url)
    step = _pick_step(fs, root, args.url, args.step)
    directory = L.join(root, L.step_dir(step))
    print(f"checkpoint: {directory}")
    try:
        manifest = _reader.read_manifest(fs, root, step)
    except CheckpointCorruptError as e:
        print(f"DAMAGED: {e}")
        print(f"ms-ckpt inspect: step {step} is damaged", file=sys.stderr)
        return 1
    world, comp = manifest["world"], manifest["compression"]
    records: list[dict[str, Any]] = manifest["records"]
    print(f"format: {manifest['format']} version {manifest['version']}, step {step}")
    print(
        f"world: world_size {world['world_size']}, dp_size {world['dp_size']}, "
        f"parts {world['parts']}"
    )
    for w in world["writers"]:
        print(
            f"  writer rank {w['rank']} (part {w['part']}, dp rank {w['dp_rank']}): "
            f"{w['file']}, {w['bytes']} B"
        )
    level = "" if comp.get("level") is None else f" level {comp['level']}"
    print(f"compression: {comp['codec']}{level}")
    stored = sum(r["length"] for r in records)
    raw = sum(r["raw_length"] for r in records)
    n_t = sum(r["kind"] == "tensor" for r in records)
    print(
        f"records: {len(records)} ({n_t} tensor, {len(records) - n_t} pickle), "
        f"stored {stored} B, raw {raw} B"
    )
    pieces = [r for r in records if "dtensor" in r]
    if pieces:
        n_keys = len({(tuple(r["dtensor"]["parts"]), r["key"]) for r in pieces})
        print(f"dtensors: {n_keys} global tensors in {len(pieces)} pieces (each piece once)")

    dctx = zstandard.ZstdDecompressor()
    sizes: dict[str, int] = {}
    rows = [["PART", "KEY", "KIND", "DTYPE", "SHAPE", "PLACE", "STORED", "RAW", "CHECK"]]
    damage: list[str] = []
    for rec in records:
        try:
            _reader.verify_record(fs, directory, rec, comp["codec"], dctx, sizes)
            check = "OK"
        except CheckpointCorruptError as e:
            check = "DAMAGED"
            damage.append(str(e))
        tensor = rec["kind"] == "tensor"
        rows.append(
            [
                str(rec["part"]),
                rec["key"],
                rec["kind"],
                rec["dtype"] if tensor else "-",
                str(tuple(rec["shape"])) if tensor else "-",
                _place(rec),
                str(rec["length"]),
                str(rec["raw_length"]),
                check,
            ]
        )
    for line in _table(rows, right={0, 6, 7}):
        print(line)
    if damage:
        for msg in damage:
            print(f"DAMAGED: {msg}")
        print(
            f"ms-ckpt inspect: {len(damage)} of {len(records)} records of step {step} damaged",
            file=sys.stderr,
        )
        return 1
    print(f"verified: all {len(records)} records OK")
    return 0


def _place(rec: dict[str, Any]) -> str:
    """replicated, a DP rank's own value, a DP rank's slice [a, b) of dim d, or the box of
    a DTensor's global tensor that a piece holds (and the parts its mesh spans, when it
    spans more than the writer's)."""
    if "dtensor" in rec:
        d = rec["dtensor"]
        box = ", ".join(f"{o}:{o + n}" for o, n in zip(d["offset"], rec["shape"], strict=True))
        parts = "" if d["parts"] == [rec["part"]] else f", parts {d['parts']}"
        return f"dtensor [{box}] of {tuple(d['global_shape'])}{parts}, by dp {rec['dp_rank']}"
    if "shard" in rec:
        s = rec["shard"]
        a = s["offset"]
        b = a + rec["shape"][s["dim"]]
        return f"dp {rec['dp_rank']} [{a}:{b}] of dim {s['dim']}"
    if "dp_rank" in rec:
        return f"dp {rec['dp_rank']}"
    return "replicated"


def _cmd_convert(args: argparse.Namespace) -> int:
    fs, root = _open_root(args.url)
    step = _pick_step(fs, root, args.url, args.step)
    manifest = _reader.read_manifest(fs, root, step)
    state = _reader.read_part(fs, root, manifest, args.part, args.dp_rank)
    records = [r for r in manifest["records"] if r["part"] == args.part]
    n_tensors = sum(r["kind"] == "tensor" for r in records)
    if args.to == "torch":
        import torch

        with fsspec.open(args.out, "wb") as f:
            torch.save(state, f)
    else:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        # One process, no process group: no_dist saves without collectives.
        no_dist = not (dist.is_available() and dist.is_initialized())
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_save(state, checkpoint_id=args.out, no_dist=no_dist)
    parts = len(manifest["parts"])
    which = f" part {args.part} of {parts}" if parts > 1 else ""
    print(
        f"wrote step {step}{which} ({n_tensors} tensor and {len(records) - n_tensors} "
        f"pickle records) to {args.out}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except CheckpointCorruptError as e:
        print(f"ms-ckpt {args.command}: damaged: {e}", file=sys.stderr)
        return 1
    except (_UsageError, CheckpointError, ValueError, OSError) as e:
        print(f"ms-ckpt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ms-ckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
