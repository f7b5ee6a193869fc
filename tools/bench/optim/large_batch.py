"""Large-batch evidence for LAMB: 4x the batch, same samples, same loss as AdamW.

MegaScale uses LAMB so that the batch can grow (fewer pipeline bubbles) without
losing accuracy. This benchmark checks that claim at a scale this CPU trains in
minutes: a byte-level GPT on the Python standard library's source code.

- AdamW at batch B for N steps, and LAMB at batch 4B for N/4 steps: both see the
  same sequences in the same order, so the comparison is per sample.
- Each optimizer gets the same small learning-rate grid treatment (warm-up, then
  cosine decay to 10%); the best final validation loss of each is compared.
- A control, AdamW at the same 4x batch, shows what the large batch costs without
  LAMB (``--adamw4x-lr``; leave it empty to skip).
- Writes JSON (machine, versions, parameters, every curve) and a PNG of the curves.

    .venv/bin/python tools/bench/optim/large_batch.py --out bench-results/large_batch
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ms_optim import Lamb


@dataclass(frozen=True)
class Config:
    context: int = 64  # tokens per sequence
    width: int = 128  # model width
    layers: int = 2
    heads: int = 4
    base_batch: int = 4  # AdamW's batch; LAMB runs at 4x this
    base_steps: int = 6400  # AdamW's steps; LAMB runs a quarter of them
    warmup_fraction: float = 0.05
    weight_decay: float = 0.01
    eval_points: int = 16  # validation evaluations along the run
    eval_sequences: int = 512  # held-out sequences per evaluation
    seed: int = 0


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, cfg.width)
        self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.width))
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, 256, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def corpus() -> tuple[torch.Tensor, str]:
    """Bytes of the standard library's top-level modules, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py")))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), str(stdlib)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    # Biases, norms and the position table: no weight decay.
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and name != "pos" else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


# Each candidate: optimizer and the batch multiple it runs at (steps shrink to match).
CANDIDATES = {"adamw": ("adamw", 1), "lamb": ("lamb", 4), "adamw-4x": ("adamw", 4)}


def make_optimizer(kind: str, model: nn.Module, lr: float, cfg: Config) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    # Biases, norm gains and the position table skip the trust ratio too (the Apex /
    # NVIDIA practice); with it they trained worse here.
    groups[1]["layer_adaptation"] = False
    return Lamb(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_factor(step: int, steps: int, warmup_fraction: float) -> float:
    warmup = max(1, int(steps * warmup_fraction))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, cfg: Config) -> float:
    model.eval()
    losses = []
    for x in val.split(64):
        logits = model(x[:, :-1])
        losses.append(F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


def train(
    kind: str, lr: float, train_seqs: torch.Tensor, val: torch.Tensor, cfg: Config
) -> dict[str, Any]:
    optimizer, multiple = CANDIDATES[kind]
    batch = cfg.base_batch * multiple
    steps = cfg.base_steps // multiple
    torch.manual_seed(cfg.seed)
    model = TinyGPT(cfg)
    opt = make_optimizer(optimizer, model, lr, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, steps, cfg.warmup_fraction)
    )
    every = steps // cfg.eval_points
    curve = [(0, evaluate(model, val, cfg))]
    start = time.perf_counter()
    for step in range(steps):
        x = train_seqs[step * batch : (step + 1) * batch]
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % every == 0:
            curve.append(((step + 1) * batch, evaluate(model, val, cfg)))
    return {
        "optimizer": kind,
        "lr": lr,
        "batch": batch,
        "steps": steps,
        "seconds": time.perf_counter() - start,
        "curve": curve,  # (samples seen, validation loss)
        "final": curve[-1][1],
    }


def plot(runs: list[dict[str, Any]], best: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no PNG (pip install -r requirements/dev.txt)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        is_best = best[run["optimizer"]] is run
        xs, ys = zip(*run["curve"][1:], strict=True)
        ax.plot(
            xs,
            ys,
            color={"adamw": "tab:blue", "lamb": "tab:red", "adamw-4x": "tab:gray"}[
                run["optimizer"]
            ],
            alpha=1.0 if is_best else 0.3,
            linewidth=2 if is_best else 1,
            label=f"{run['optimizer']} batch {run['batch']} lr {run['lr']:g}",
        )
    ax.set_xlabel("training sequences seen")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("LAMB at 4x batch vs AdamW at 1x, same samples")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/large_batch"))
    parser.add_argument("--adamw-lr", type=float, nargs="+", default=[1e-3, 2e-3])
    parser.add_argument("--lamb-lr", type=float, nargs="+", default=[1e-2, 2e-2])
    parser.add_argument("--adamw4x-lr", type=float, nargs="*", default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--base-steps", type=int, default=Config.base_steps)
    parser.add_argument("--base-batch", type=int, default=Config.base_batch)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    cfg = Config(base_steps=args.base_steps, base_batch=args.base_batch)
    if cfg.base_steps % (4 * cfg.eval_points):
        parser.error(f"--base-steps must be a multiple of {4 * cfg.eval_points}")
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    data, source = corpus()
    n_seq = data.numel() // (cfg.context + 1)
    seqs = data[: n_seq * (cfg.context + 1)].view(n_seq, cfg.context + 1)
    gen = torch.Generator().manual_seed(cfg.seed)
    seqs = seqs[torch.randperm(n_seq, generator=gen)]
    val = seqs[: cfg.eval_sequences]
    train_seqs = seqs[val.shape[0] :]
    needed = cfg.base_batch * cfg.base_steps
    if needed > train_seqs.shape[0]:
        parser.error(f"--base-steps needs {needed} sequences; the corpus has {train_seqs.shape[0]}")
    print(f"corpus: {data.numel() / 1e6:.1f} MB from {source}; {needed} training sequences per run")

    runs = []
    for kind, lrs in (
        ("adamw", args.adamw_lr),
        ("lamb", args.lamb_lr),
        ("adamw-4x", args.adamw4x_lr),
    ):
        for lr in lrs:
            run = train(kind, lr, train_seqs, val, cfg)
            runs.append(run)
            print(
                f"{kind:6s} lr {lr:<8g} batch {run['batch']:3d} steps {run['steps']:5d} "
                f"final val loss {run['final']:.4f}  ({run['seconds']:.0f}s)"
            )
    kinds = [k for k in CANDIDATES if any(r["optimizer"] == k for r in runs)]
    best = {
        k: min((r for r in runs if r["optimizer"] == k), key=lambda r: r["final"]) for k in kinds
    }
    print()
    for k in kinds:
        r = best[k]
        print(f"best {k:8s} (batch {r['batch']:3d}, lr {r['lr']:g}): {r['final']:.4f}")
    gap = best["lamb"]["final"] / best["adamw"]["final"] - 1
    verdict = "within" if gap <= 0.02 else "outside"
    print(f"LAMB at 4x batch / AdamW at 1x - 1 = {gap:+.2%} ({verdict} the 2% target)")
    if "adamw-4x" in best:
        control = best["adamw-4x"]["final"] / best["adamw"]["final"] - 1
        print(f"AdamW at 4x batch / AdamW at 1x - 1 = {control:+.2%} (the control)")
    result = {
        "benchmark": "lamb_large_batch",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "threads": args.threads,
        },
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "config": asdict(cfg),
        "corpus": {"source": source, "bytes": data.numel()},
        "runs": runs,
        "best": {k: {"lr": v["lr"], "final": v["final"]} for k, v in best.items()},
        "lamb_over_adamw_minus_1": gap,
        "adamw4x_over_adamw_minus_1": (
            best["adamw-4x"]["final"] / best["adamw"]["final"] - 1 if "adamw-4x" in best else None
        ),
    }
    (args.out / "large_batch.json").write_text(json.dumps(result, indent=1))
    plot(runs, best, args.out / "large_batch.png")
    print(f"wrote {args.out / 'large_batch.json'} and {args.out / 'large_batch.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
