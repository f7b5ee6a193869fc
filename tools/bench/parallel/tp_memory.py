"""Activation memory per rank with sequence parallelism: the hidden states between blocks
and everything autograd saves for backward, at TP 1 and under ms's TP with SP.

    .venv/bin/python tools/bench/parallel/tp_memory.py [--tp 2,4] [--width 512]
        [--layers 4] [--seq 512] [--batch 4] [--out PATH]

One forward of an ms-train GPT (parallel blocks, fp32, ms-kernels' torch paths) on
``--batch`` sequences of ``--seq`` tokens. Measured on every rank, from the tensors
themselves (each storage counted once): the bytes of each block's output (what sits
between blocks: the residual stream), with forward hooks; and the bytes autograd saves
for backward, through ``torch.autograd.graph.saved_tensors_hooks``, split into the
blocks' and the rest (embeddings, head, loss). Tensor parallelism without sequence
parallelism (Megatron's original) keeps the residual stream whole on every TP rank, as
TP 1 does: the TP 1 figures stand for it. Expected between blocks: 1 / tp.

Writes JSON to ``--out`` (default ``bench-results/parallel_tp_memory.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ms_parallel
from ms_testing import run_ranks
from ms_testing.bench import machine_info


def _measure(config: dict[str, Any], seq: int, batch: int, tp: int) -> dict[str, float]:
    from ms_train import parallelize
    from ms_train.config import ModelConfig
    from ms_train.model import GPT

    model = GPT(ModelConfig(**config))
    if tp > 1:
        parallelize(model, dist.group.WORLD, chunks=2)
    between: list[int] = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, i, o: between.append(o.numel() * o.element_size()))
    seen: set[int] = set()
    saved = {"blocks": 0, "other": 0}
    where = ["other"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            saved[where[0]] += t.untyped_storage().nbytes()
        return t

    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, i: where.__setitem__(0, "blocks"))
        block.register_forward_hook(lambda m, i, o: where.__setitem__(0, "other"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config["vocab_size"], (batch, seq + 1), generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return {
        "between_blocks_mib": between[0] / 2**20,
        "saved_blocks_mib": saved["blocks"] / 2**20,
        "saved_other_mib": saved["other"] / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="2,4")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default="bench-results/parallel_tp_memory.json")
    a = ap.parse_args()
    config = {
        "vocab_size": 512,
        "d_model": a.width,
        "n_layers": a.layers,
        "n_heads": 8,
        "seq_len": a.seq,
        "kernels": "torch",
    }
    rows = {"1": _measure(config, a.seq, a.batch, 1)}
    for tp in (int(t) for t in a.tp.split(",")):
        rows[str(tp)] = run_ranks(_measure, tp, args=(config, a.seq, a.batch, tp), timeout=600)[0]
    print(f"GPT width {a.width}, {a.layers} blocks, {a.batch} x {a.seq} tokens, fp32; per rank:")
    print(
        f"  {'TP':>3} {'between blocks MiB':>19} {'/TP 1':>6} {'saved, blocks MiB':>18} "
        f"{'/TP 1':>6} {'saved, rest MiB':>16}"
    )
    base = rows["1"]
    for tp, r in rows.items():
        print(
            f"  {tp:>3} {r['between_blocks_mib']:19.2f} "
            f"{r['between_blocks_mib'] / base['between_blocks_mib']:6.3f} "
            f"{r['saved_blocks_mib']:18.1f} {r['saved_blocks_mib'] / base['saved_blocks_mib']:6.3f}"
            f" {r['saved_other_mib']:16.1f}"
        )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": machine_info(ms_parallel=ms_parallel.__version__),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "args": vars(a),
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
