"""What a run did (:class:`RunSummary`) and rank 0's report of it at the end: the loss
plot, the sample, the summary table and ``summary.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from ms_train import report
from ms_train._peak import PeakSource

__all__ = ["RunSummary", "summary_rows", "write_report"]


@attrs.frozen(kw_only=True)
class RunSummary:
    """What a run did (every rank returns the same numbers but ``files`` and ``sample``,
    which rank 0 alone writes).

    Attributes:
        start_step: the step it started from (the checkpoint's, 0 for a fresh run).
        end_step: the step it reached.
        final_loss: the training loss of the last logged step of this run (the loss of
            ``loss_history[-1]``); NaN when this run trained no step.
        loss_history: ``(step, loss)`` of each logged step of this run: the loss
            averaged over the global batch and over the steps since the previous logged
            step.
        eval_loss: the held-out loss of this run's last evaluation (``train.eval_every``);
            NaN when it made none.
        eval_history: ``(step, held-out loss)`` of each evaluation of this run.
        tokens: tokens trained on by this run, all ranks.
        wall_s: seconds from the first step to the last, the first step excluded from
            the rates (start-up and warm-up), evaluations excluded.
        tokens_per_s, mfu, data_wait: whole-job throughput after the first step, its
            model FLOPs over ``world_size x peak_flops``, and rank 0's share of step
            time spent waiting for data.
        peak_flops: the per-rank FLOP/s MFU is measured against.
        peak_flops_source: where it came from: ``"given"`` (``peak_flops=``,
            ``--peak-tflops``), ``"table"`` (the datasheet value of a known GPU in bf16)
            or ``"measured"`` (the best of several matmul measurements at start); None
            when this run trained nothing and needed no peak.
        peak_flops_detail: how it was found (the device, or the measurements).
        health_cost: with heartbeats, what they cost this rank over ``wall_s``:
            ``loop_s`` in the heartbeat's calls on the training thread (steps and
            collective events), ``sender_cpu_s`` of its sender thread, and ``share``,
            their sum over ``wall_s`` (an upper bound on the tokens/s they take: as if
            the sender's CPU time were all taken from the loop); else None.
    """

    start_step: int
    end_step: int
    final_loss: float
    loss_history: list[tuple[int, float]]
    eval_loss: float
    eval_history: list[tuple[int, float]]
    tokens: int
    wall_s: float
    tokens_per_s: float
    mfu: float
    data_wait: float
    peak_flops: float
    peak_flops_source: PeakSource | None
    peak_flops_detail: str
    world_size: int
    dp: int
    grad_accum: int
    out_dir: str
    checkpoint_dir: str
    files: dict[str, str]
    sample: str | None
    health_cost: dict[str, float] | None = None


def write_report(
    summary: RunSummary,
    out_dir: Path,
    *,
    sample: Callable[[], str | None],
    say: Callable[[str], None],
) -> RunSummary:
    """Rank 0: the loss plot, the ``sample()`` and the summary table, written under
    ``out_dir`` and shown through ``say``; ``summary`` with its ``files`` and ``sample``."""
    files = {"metrics": str(out_dir / "metrics.jsonl")}
    records = report.read_metrics(files["metrics"])
    if report.plot_loss(records, out_dir / "loss.png"):
        files["loss_plot"] = str(out_dir / "loss.png")
    text = sample()
    if text is not None:
        files["sample"] = str(out_dir / "sample.txt")
        Path(files["sample"]).write_text(text + "\n")
        say("sample:\n" + "\n".join("  | " + line for line in text.splitlines()))
    files["summary"] = str(out_dir / "summary.json")
    summary = attrs.evolve(summary, files=files, sample=text)
    say(report.format_summary(summary_rows(summary, records)))
    Path(files["summary"]).write_text(
        json.dumps(attrs.asdict(summary), indent=2, default=str) + "\n"
    )
    return summary


def summary_rows(s: RunSummary, records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The summary table of ``s``, its losses from the run's ``metrics.jsonl`` records."""

    def num(x: float, fmt: str) -> str:
        return "n/a" if not math.isfinite(x) else format(x, fmt)

    first = records[0]["loss"] if records else math.nan
    last = records[-1]["loss"] if records else math.nan
    evals = [r for r in records if "eval_loss" in r]
    rows = [
        ("steps", f"{s.start_step} -> {s.end_step} (this run: {s.end_step - s.start_step})"),
        (
            "loss",
            f"{num(first, '.4f')} (step {records[0]['step']}) -> {num(last, '.4f')} "
            f"(step {records[-1]['step']})"
            if records
            else "n/a",
        ),
        *(
            [("held-out loss", f"{evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})")]
            if evals
            else []
        ),
        ("tokens (this run)", f"{s.tokens:,}"),
        ("wall time", report.format_duration(s.wall_s)),
        ("throughput", f"{num(s.tokens_per_s, ',.0f')} tokens/s"),
        ("MFU", report.format_mfu(s.mfu, s.peak_flops, s.peak_flops_source)),
        *([("peak", s.peak_flops_detail)] if s.peak_flops_source else []),
        ("data wait", f"{100 * s.data_wait:.1f}% of step time"),
        ("checkpoints", s.checkpoint_dir),
    ]
    rows += [(name.replace("_", " "), path) for name, path in s.files.items()]
    return rows
