"""Tensor-parallel step time under injected network latency: ms's chunked collective
matmuls, ms unfused, and torch's DTensor TP, side by side in one run.

    .venv/bin/python tools/bench/parallel/tp_overlap.py [--case mlp,block]
        [--layout 1x2,2x2] [--latency 0,chunk] [--chunks 1,2,4] [--rounds 3]
        [--steps 3] [--warmup 1] [--width 1024] [--tokens 2048] [--out PATH] [--smoke]

Every collective runs on ``ms_parallel.latency``'s backend: real gloo inside, each op
completing no earlier than its issue time + L (BENCH.md: overlap cannot show by wall
clock alone on 2 cores). ``--layout DPxTP`` sets the mesh (``build_mesh``); each DP
replica runs its own TP group on its own tokens (``--tokens`` per replica and step,
split along the sequence over TP), and a step is one forward and backward of the case,
with no DP gradient sync (that is ZeRO's, measured by ``overlap.py``):

- ``mlp``: ``fc2(gelu(fc(x)))``, width ``--width``, hidden 4x: a column-parallel GEMM
  after the sequence all-gather, a row-parallel one before the reduce-scatter;
- ``block``: ms-train's parallel transformer block (``y = x + MLP(LN(x)) +
  Attn(LN(x))``, 16 heads, full causal attention through ms-kernels' torch path);
- ``gpt``: ms-train's tiny preset (width 128, 4 parallel blocks of 4 heads, window
  64, vocabulary 257, here untied), one micro-batch of 8 x 128 tokens per replica
  (``--width``/``--tokens`` do not apply): ``ms_train.parallelize`` against the same
  math in plain torch modules under torch's plans (``RowwiseParallel`` embedding to a
  sequence shard, the blocks as above, ``SequenceParallel`` final norm,
  ``ColwiseParallel`` head into ``loss_parallel``).

Candidates: **ms fused, chunks=c** for each ``--chunks`` (``ms_parallel``'s
``all_gather_matmul`` / ``matmul_reduce_scatter``: for the block one gather of
``LN(x)`` feeds QKV and FC, one reduce-scatter takes both projections), **ms fused,
measured** (a ``ChunkTuner`` choosing per shape, measured on the first step, outside
the timing), **ms unfused** (the same layers with ``overlap=False``: each collective
waited, then its GEMMs), and **torch DTensor TP**: the same math as plain torch modules
under ``parallelize_module`` with ``SequenceParallel`` (LayerNorm), ``ColwiseParallel
(input_layouts=Shard(1))`` (QKV, FC) and ``RowwiseParallel(output_layouts=Shard(1))``
(the projections), torch's own sequence-parallel plan; its parallel block gathers
``LN(x)`` once per column layer and reduce-scatters once per row layer (two of each),
which is how its plans compose.

``--latency``: milliseconds, or ``chunk``: one chunk's GEMM at chunks=2 (the FC GEMM of
half this rank's share of the rows, measured at start, the slowest rank's median),
``<k>chunk`` for k of them. Per L and layout: ``--rounds`` rounds, candidates in a
rotating order, each round building each candidate afresh, ``--warmup`` untimed and
``--steps`` timed steps after a barrier; a repetition is the slowest rank's mean step.
Reported: median step (min-max), each candidate over torch's step in the same round
(median of the ratios), fused over unfused, the exposed communication (for ms: the
time its ranks spent waiting on collectives, per step, over the step), the best chunk
count, and the bytes each rank sent per step (the backend's ``wire_bytes``: ring
algorithm bytes) against ``2 (tp - 1) / tp * S * h * 4`` per all-gather and
reduce-scatter pair.

Prints tables and writes a JSON record (machine, versions, parameters, every
repetition) to ``--out`` (default ``bench-results/parallel_tp_overlap.json``).
``--smoke``: a tiny case, one round: a check that the script works.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ms_parallel
from ms_parallel import ChunkTuner, TPComm, build_mesh
from ms_parallel.events import EventLog
from ms_parallel.latency import register_latency_backend
from ms_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_matmuls,
    row_parallel_matmuls,
)
from ms_testing import launch
from ms_testing.bench import machine_info

BACKEND = "bench_tp_latency"
PEER = "torch DTensor TP"
UNFUSED = "ms unfused"


@dataclass(frozen=True)
class Case:
    name: str
    width: int
    heads: int
    #: Tokens of one DP replica per step: seq x batch, the sequence split over TP.
    seq: int
    batch: int
    #: ``gpt`` only: ms-train's tiny preset (untied), its vocabulary and depth.
    vocab: int = 257
    layers: int = 4


# -- the ms side ------------------------------------------------------------------------


class MsMLP(nn.Module):
    def __init__(self, h: int, comm: TPComm, chunks: int | ChunkTuner, overlap: bool) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(h, 4 * h, comm, chunks=chunks, overlap=overlap)
        self.fc2 = RowParallelLinear(4 * h, h, comm, chunks=chunks, overlap=overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (s, B, h) shard
        return self.fc2(nn.functional.gelu(self.fc(x), approximate="tanh"))  # type: ignore[no-any-return]


class MsBlock(nn.Module):
    """ms-train's parallel block, as its tensor-parallel form computes it."""

    def __init__(self, case: Case, comm: TPComm, chunks: int | ChunkTuner, overlap: bool) -> None:
        super().__init__()
        h, tp = case.width, comm.size
        self.heads, self.head_dim = case.heads // tp, h // case.heads
        self.ln = nn.LayerNorm(h)
        kw: dict[str, Any] = {"chunks": chunks, "overlap": overlap}
        self.qkv = ColumnParallelLinear(h, 3 * h, comm, **kw)
        self.fc = ColumnParallelLinear(h, 4 * h, comm, **kw)
        self.proj = RowParallelLinear(h, h, comm, **kw)
        self.fc2 = RowParallelLinear(4 * h, h, comm, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ms_kernels import sliding_window_attention

        hn = self.ln(x)
        qkv, fc = column_parallel_matmuls(hn, [self.qkv, self.fc])
        assert self.qkv.bias is not None and self.fc.bias is not None
        s, b, _ = qkv.shape
        q, k, v = (qkv + self.qkv.bias).view(s, b, self.heads, 3, self.head_dim).unbind(3)
        a = sliding_window_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True, backend="torch"
        )
        a = a.transpose(0, 1).reshape(s, b, -1)
        g = nn.functional.gelu(fc + self.fc.bias, approximate="tanh")
        return x + row_parallel_matmuls([a, g], [self.proj, self.fc2])


# -- the torch DTensor side -------------------------------------------------------------


class TorchMLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, s, h) shard
        return self.fc2(nn.functional.gelu(self.fc(x), approximate="tanh"))  # type: ignore[no-any-return]


class TorchBlock(nn.Module):
    def __init__(self, case: Case, tp: int, window: Any = None) -> None:
        super().__init__()
        h = case.width
        self.window = window
        self.heads, self.head_dim = case.heads // tp, h // case.heads
        self.ln = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.fc = nn.Linear(h, 4 * h)
        self.proj = nn.Linear(h, h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ms_kernels import sliding_window_attention

        hn = self.ln(x)
        qkv = self.qkv(hn)  # local: (B, S, 3h / tp), the sequence gathered
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, self.heads, 3, self.head_dim).unbind(3)
        a = sliding_window_attention(
            q, k, v, window=self.window, causal=True, backend="torch"
        ).reshape(b, s, -1)
        g = nn.functional.gelu(self.fc(hn), approximate="tanh")
        return x + self.proj(a) + self.fc2(g)


def _gpt_config(case: Case) -> Any:
    from ms_train.config import ModelConfig

    return ModelConfig(
        vocab_size=case.vocab,
        d_model=case.width,
        n_layers=case.layers,
        n_heads=case.heads,
        seq_len=case.seq,
        block="parallel",
        window=64,
        tie_embeddings=False,
        kernels="torch",
    )


class TorchGPT(nn.Module):
    """ms-train's tiny GPT (untied) in plain torch modules, for torch's TP plans: token
    and position embeddings, parallel blocks, final LayerNorm, projection; the loss
    under ``loss_parallel``."""

    def __init__(self, case: Case, tp: int, window: Any) -> None:
        super().__init__()
        h = case.width
        self.tp, self.seq = tp, case.seq
        self.tok = nn.Embedding(case.vocab, h)
        self.pos = nn.Embedding(case.seq, h)
        self.blocks = nn.ModuleList(TorchBlock(case, tp, window) for _ in range(case.layers))
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, case.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        x = self.tok(tokens)  # (B, S / tp, h): reduce-scattered along the sequence
        part = self.seq // self.tp
        start = dist.get_rank() % self.tp * part  # the TP rank: tp is the inner dim
        x = x + self.pos(torch.arange(start, start + part))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # DTensor (B, S, V), sharded over the vocabulary
        with loss_parallel():
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            loss.backward()
        return loss.detach()  # type: ignore[no-any-return]


def torch_tp(module: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {
        "fc": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }
    block: dict[str, Any] = {
        "ln": SequenceParallel(),
        "qkv": ColwiseParallel(input_layouts=Shard(1)),
        "proj": RowwiseParallel(output_layouts=Shard(1)),
        **plan,
    }
    if isinstance(module, TorchBlock):
        plan = block
    if isinstance(module, TorchGPT):
        from torch.distributed.tensor import Replicate

        plan = {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            **{f"blocks.{i}.{k}": v for i in range(len(module.blocks)) for k, v in block.items()},
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        }
    return parallelize_module(module, mesh, plan)


# -- running ----------------------------------------------------------------------------


Step = Callable[[], None]


def _build(
    name: str, case: Case, mesh: Any, log: EventLog, tuner: ChunkTuner
) -> tuple[Step, nn.Module]:
    """A candidate's step (forward and backward on this rank's shard of the tokens)."""
    tp = mesh["tp"].size()
    torch.manual_seed(0)
    s_local = case.seq // tp
    if case.name == "gpt":
        return _build_gpt(name, case, mesh, log, tuner)
    if name == PEER:
        module: nn.Module = TorchMLP(case.width) if case.name == "mlp" else TorchBlock(case, tp)
        module = torch_tp(module, mesh["tp"])
        x = torch.randn(case.batch, s_local, case.width, requires_grad=True)
    else:
        comm = TPComm(mesh["tp"], on_event=log)
        overlap = name != UNFUSED
        chunks: int | ChunkTuner = 1
        if name.endswith("measured"):
            chunks = tuner
        elif "chunks=" in name:
            chunks = int(name.split("chunks=")[1])
        if case.name == "mlp":
            module = MsMLP(case.width, comm, chunks, overlap)
        else:
            module = MsBlock(case, comm, chunks, overlap)
        x = torch.randn(s_local, case.batch, case.width, requires_grad=True)

    def step() -> None:
        module(x).float().sum().backward()

    return step, module


def _chunks_of(name: str, tuner: ChunkTuner) -> int | ChunkTuner:
    if name.endswith("measured"):
        return tuner
    if "chunks=" in name:
        return int(name.split("chunks=")[1])
    return 1


def _build_gpt(
    name: str, case: Case, mesh: Any, log: EventLog, tuner: ChunkTuner
) -> tuple[Step, nn.Module]:
    """ms-train's GPT under ``ms_train.parallelize``, or the same math under torch's
    plans; a step is one micro-batch's forward, loss and backward."""
    from ms_train import parallelize
    from ms_train.model import GPT

    tp = mesh["tp"].size()
    g = torch.Generator().manual_seed(1 + mesh["dp"].get_local_rank())
    tokens = torch.randint(0, case.vocab, (case.batch, case.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ms = GPT(_gpt_config(case))
    if name == PEER:
        module: nn.Module = torch_tp(TorchGPT(case, tp, ms.blocks[0].attn.window), mesh["tp"])

        def step() -> None:
            module(x, y)

        return step, module
    module = parallelize(
        ms, mesh["tp"], chunks=_chunks_of(name, tuner), overlap=name != UNFUSED, on_event=log
    )

    def ms_step() -> None:
        module(x, y)[1].backward()

    return ms_step, module


def _waited(log: EventLog, since: int) -> float:
    """Seconds this rank spent inside waits on collectives, from event ``since`` on."""
    total, begun = 0.0, {}
    for e in log.events[since:]:
        key = (e.name, e.attrs.get("layer"), e.attrs.get("chunk"), e.attrs.get("phase"))
        if e.kind == "wait_begin":
            begun[key] = e.t
        elif e.kind == "wait_end" and key in begun:
            total += e.t - begun.pop(key)
    return total


def _gemm_chunk_s(case: Case, tp: int) -> float:
    """One chunk's FC GEMM at chunks=2: half of this rank's rows times h x 4h/tp."""
    rows = case.seq * case.batch // tp // 2
    a = torch.randn(rows, case.width)
    w = torch.randn(4 * case.width // tp, case.width)
    times = []
    for i in range(9):
        t0 = time.perf_counter()
        a @ w.t()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(args: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    torch.set_num_threads(1)
    log = EventLog()
    net = register_latency_backend(BACKEND, latency=0.0, on_event=log)
    store = TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(60)
    )
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(BACKEND, store=store, rank=int(os.environ["RANK"]), world_size=world)
    mesh = build_mesh(dp=args["dp"], tp=args["tp"])
    case = Case(**args["case"])
    gemm = torch.tensor([_gemm_chunk_s(case, args["tp"])])
    dist.all_reduce(gemm, op=dist.ReduceOp.MAX)
    chunk_s = float(gemm.item())
    latencies = [
        chunk_s * float(v[:-5] or 1) if v.endswith("chunk") else float(v) / 1e3
        for v in args["latency"]
    ]
    names = [
        *(f"ms fused, chunks={c}" for c in args["chunks"]),
        "ms fused, measured",
        UNFUSED,
        PEER,
    ]
    out: dict[str, Any] = {"chunk_gemm_s": chunk_s, "latencies": {}}
    for latency in latencies:
        net.set_latency(latency)
        tuner = ChunkTuner(candidates=tuple(args["chunks"]))
        reps: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for r in range(args["rounds"]):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                step, module = _build(name, case, mesh, log, tuner)
                for _ in range(args["warmup"]):
                    step()
                dist.barrier()
                since = len(log.events)
                t0 = time.perf_counter()
                for _ in range(args["steps"]):
                    step()
                elapsed = (time.perf_counter() - t0) / args["steps"]
                events = log.events[since:]
                wire = (
                    sum(
                        e.attrs.get("wire_bytes", 0)
                        for e in events
                        if e.kind == "issue"
                        and "wire_bytes" in e.attrs
                        and e.attrs.get("group") == mesh["tp"].get_group().group_name
                    )
                    / args["steps"]
                )
                waited = _waited(log, since) / args["steps"]
                both = torch.tensor([elapsed, waited, wire], dtype=torch.float64)
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
                reps[name].append(
                    {
                        "step_s": both[0].item(),
                        "waited_s": both[1].item(),
                        "wire_bytes": both[2].item(),
                    }
                )
                del step, module
                gc.collect()
        out["latencies"][f"{latency:.6f}"] = {
            "latency_s": latency,
            "reps": reps,
            "tuned": dict(tuner.plan),
        }
    dist.barrier()
    dist.destroy_process_group()
    return out


def _summary(name: str, reps: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    steps = [r["step_s"] for r in reps[name]]
    ratio = [a["step_s"] / b["step_s"] for a, b in zip(reps[name], reps[PEER], strict=True)]
    unfused = [a["step_s"] / b["step_s"] for a, b in zip(reps[name], reps[UNFUSED], strict=True)]
    return {
        "step_ms": 1e3 * statistics.median(steps),
        "min_ms": 1e3 * min(steps),
        "max_ms": 1e3 * max(steps),
        "over_torch": statistics.median(ratio),
        "over_unfused": statistics.median(unfused),
        # torch's collectives are not in the event log: their waits are not seen
        "exposed": (
            math.nan
            if name == PEER
            else statistics.median(r["waited_s"] / r["step_s"] for r in reps[name])
        ),
        "wire_mb": statistics.median(r["wire_bytes"] for r in reps[name]) / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="mlp,block,gpt")
    ap.add_argument("--layout", default="1x2,2x2", help="DPxTP, comma separated")
    ap.add_argument("--latency", default="0,chunk")
    ap.add_argument("--chunks", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default="bench-results/parallel_tp_overlap.json")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.width, a.tokens, a.rounds, a.steps, a.warmup = 64, 64, 1, 1, 1
        a.layout = "1x2"
        print("smoke: not a measurement")
    chunks = [int(c) for c in a.chunks.split(",")]
    record: dict[str, Any] = {
        "machine": machine_info(ms_parallel=ms_parallel.__version__),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": vars(a),
        "smoke": a.smoke,
        "results": [],
    }
    for layout in a.layout.split(","):
        dp, tp = (int(v) for v in layout.split("x"))
        for case_name in a.case.split(","):
            if case_name == "gpt":  # the tiny preset: micro-batch 8 of 128 tokens
                case = Case("gpt", 64 if a.smoke else 128, heads=4, seq=128, batch=8)
                if a.smoke:
                    case = Case("gpt", 64, heads=4, seq=64, batch=2, layers=2)
            else:
                case = Case(
                    case_name,
                    a.width,
                    heads=16 if a.width >= 256 else 4,
                    seq=a.tokens // 2,
                    batch=2,
                )
            args = {
                "dp": dp,
                "tp": tp,
                "case": asdict(case),
                "chunks": chunks,
                "latency": a.latency.split(","),
                "rounds": a.rounds,
                "steps": a.steps,
                "warmup": a.warmup,
            }
            report = launch(_rank, dp * tp, args=(args,), init_process_group=False, timeout=3600)
            if not report.ok:
                raise SystemExit(report.describe())
            got = report.outcomes[0].value
            tokens = case.seq * case.batch
            pair = 2 * (tp - 1) / tp * tokens * case.width * 4 / 2**20
            print(
                f"\n{case_name}, width {case.width}, DP {dp} x TP {tp}, {tokens} tokens "
                f"per replica; one chunk's GEMM {1e3 * got['chunk_gemm_s']:.1f} ms; one "
                f"AG + RS pair {pair:.1f} MiB per rank"
            )
            for res in got["latencies"].values():
                print(f"  L = {1e3 * res['latency_s']:.1f} ms (tuned: {res['tuned']})")
                print(
                    f"    {'candidate':28} {'step ms (min-max)':>22} {'/torch':>7} "
                    f"{'/unfused':>8} {'exposed':>8} {'MiB sent':>9}"
                )
                for name in res["reps"]:
                    s = _summary(name, res["reps"])
                    exposed = "-" if math.isnan(s["exposed"]) else f"{100 * s['exposed']:.1f}%"
                    print(
                        f"    {name:28} {s['step_ms']:8.1f} ({s['min_ms']:.1f}-"
                        f"{s['max_ms']:.1f}) {s['over_torch']:7.3f} {s['over_unfused']:8.3f}"
                        f" {exposed:>8} {s['wire_mb']:9.2f}"
                    )
                    res.setdefault("summary", {})[name] = {
                        k: None if isinstance(v, float) and math.isnan(v) else v
                        for k, v in s.items()
                    }
            record["results"].append(
                {"layout": layout, "case": asdict(case), **got, "pair_mib": pair}
            )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
