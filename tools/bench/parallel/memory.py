"""Memory per rank: ms-parallel ZeRO-2 against torch DDP, same model, same AdamW.

Each candidate runs in fresh gloo ranks (``--world``, default 2) that build a model of
about ``--params`` parameters (pre-norm MLP blocks), take ``--steps`` optimizer steps
and report, per rank:

- tensor bytes by role, counted exactly from the tensors (each storage once):
  parameters, gradient buffers (for ZeRO: the flat full-size accumulation buffer and
  the reduced shard; for DDP: ``.grad`` plus DDP's own bucket buffers, which are not
  reachable from Python and so appear only in the resident memory), and optimizer state;
- the resident high-water mark of the rank process (``VmHWM``, reset after the model is
  built, so it covers wrapping and training) and the resident set after the steps.

Expected from the design: ZeRO-2's optimizer state is about 1/world of DDP's; its
gradients cost one full-size fp32 buffer (accumulation across micro-batches needs the
whole gradient until the reduce-scatter) plus a 1/world shard; parameters are whole on
every rank in both.

    python tools/bench/parallel/memory.py              # ~100M parameters, 2 ranks
    python tools/bench/parallel/memory.py --smoke      # tiny, checks the script
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ms_testing.bench import machine_info, reset_peak, vm_bytes
from ms_testing.dist import run_ranks

CANDIDATES = ("ddp", "zero2")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def width_for(params: int, layers: int) -> int:
    """The width d whose ``layers`` blocks hold about ``params`` parameters (8 d^2 + 7 d)."""
    return max(8, int(math.sqrt(params / layers / 8)))


def storage_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not counted yet (views share one)."""
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def rank_main(candidate: str, d: int, layers: int, tokens: int, steps: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from ms_parallel import ZeroDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(d) for _ in range(layers)])
    n_params = sum(p.numel() for p in model.parameters())
    base = reset_peak()
    if candidate == "ddp":
        wrapped: nn.Module = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        zero = ZeroDataParallel(model, dist.group.WORLD)
        wrapped = zero
        opt = zero.attach_optimizer(torch.optim.AdamW(zero.optimizer_param_groups(), lr=1e-4))
    x = torch.randn(tokens, d)
    for _ in range(steps):  # gradients kept after the last step: they are measured
        opt.zero_grad(set_to_none=True)
        wrapped(x).square().mean().backward()
        opt.step()
    seen: set[int] = set()
    parts = {"parameters": storage_bytes(list(model.parameters()), seen)}
    if candidate == "ddp":
        parts["gradients"] = storage_bytes(
            [p.grad for p in model.parameters() if p.grad is not None], seen
        )
    else:
        parts["gradients"] = storage_bytes(
            [b.grad for b in zero.buckets] + [b.grad_shard for b in zero.buckets], seen
        )
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    parts["optimizer state"] = storage_bytes(state, seen)
    return {
        "params": n_params,
        "bytes": parts,
        "peak_rss_over_model": vm_bytes("VmHWM") - base,
        "rss_after": vm_bytes("VmRSS"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=100e6, help="about this many parameters")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench-results/parallel_memory.json"))
    ap.add_argument("--smoke", action="store_true", help="a tiny model: checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.params, args.layers, args.tokens = 2e5, 2, 16
        print("smoke: not a measurement")
    d = width_for(int(args.params), args.layers)
    results: dict[str, list[dict[str, Any]]] = {}
    for name in CANDIDATES:
        results[name] = run_ranks(
            rank_main,
            args.world,
            args=(name, d, args.layers, args.tokens, args.steps),
            timeout=900,
            env={"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"},
        )
    n = results["ddp"][0]["params"]
    print(
        f"\n### Memory per rank, {n / 1e6:.1f}M fp32 parameters, {args.world} gloo ranks, AdamW\n"
    )
    print("| | " + " | ".join(CANDIDATES) + " | zero2 / ddp |")
    print("|---|" + "---:|" * (len(CANDIDATES) + 1))
    rows = ["parameters", "gradients", "optimizer state"]
    for row in rows:
        vals = [max(r["bytes"][row] for r in results[c]) for c in CANDIDATES]
        print(
            f"| {row} (MiB, max over ranks) | "
            + " | ".join(f"{v / 2**20:,.0f}" for v in vals)
            + f" | {vals[1] / max(vals[0], 1):.2f} |"
        )
    for key, label in (
        ("peak_rss_over_model", "peak resident over the built model"),
        ("rss_after", "resident after the steps"),
    ):
        vals = [max(r[key] for r in results[c]) for c in CANDIDATES]
        print(
            f"| {label} (MiB) | "
            + " | ".join(f"{v / 2**20:,.0f}" for v in vals)
            + f" | {vals[1] / max(vals[0], 1):.2f} |"
        )
    print(
        "\nDDP's gradient buckets live inside its C++ reducer: they are in the resident "
        "figures, not in the gradients row."
    )
    record = {
        "machine": machine_info(),
        "parameters": {**vars(args), "out": str(args.out), "width": d},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
