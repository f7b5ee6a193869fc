"""What a run shows and leaves behind: the progress line, JSONL metrics, the loss plot
and the summary table. Only rank 0 reports; nothing here talks to other ranks.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "MetricsLog",
    "Progress",
    "format_duration",
    "format_mfu",
    "format_summary",
    "plot_loss",
    "read_metrics",
]


def format_duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"``, ``"2h07m"``; ``"?"`` for a value not yet known."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _rate(tokens_per_s: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit}"
    return f"{tokens_per_s:.0f}"


def format_mfu(mfu: float, peak_flops: float, source: str | None) -> str:
    """``"26.6% of 190.0 GFLOP/s per rank (measured)"``; an MFU over 100% says so."""
    if not math.isfinite(mfu):
        return "n/a"
    text = f"{100 * mfu:.1f}% of {peak_flops / 1e9:,.1f} GFLOP/s per rank ({source})"
    if mfu > 1.0:
        text += ": over 100%, the peak is too low (give it with --peak-tflops)"
    return text


class Progress:
    """One status line: step, bar, loss (and held-out loss), tokens/s, MFU, data-wait %
    and ETA. An MFU over 100% is marked ``(!)``: its peak is too low.

    On a terminal the line is redrawn in place every step; elsewhere (CI, a log file)
    a line is printed at every logged step only, so logs stay short.
    """

    def __init__(
        self, total: int, *, start: int = 0, stream: TextIO | None = None, width: int = 20
    ) -> None:
        self.total = total
        self.start = start
        self.stream = sys.stdout if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.last: dict[str, float] = {}
        self._drawn = False
        #: Returns the job's health in a few words (ms-health's heartbeat summary), shown
        #: on every line when set.
        self.health: Callable[[], str] | None = None

    def line(self, step: int, metrics: Mapping[str, float], eta_s: float) -> str:
        done = (step - self.start) / max(1, self.total - self.start)
        filled = round(done * self.width)
        bar = "=" * filled + " " * (self.width - filled)
        parts = [f"step {step:>{len(str(self.total))}}/{self.total} [{bar}]"]
        if "loss" in metrics:
            parts.append(f"loss {metrics['loss']:.4f}")
        if "eval_loss" in metrics:
            parts.append(f"eval {metrics['eval_loss']:.4f}")
        if "tokens_per_s" in metrics:
            parts.append(f"{_rate(metrics['tokens_per_s'])} tok/s")
        if "mfu" in metrics:
            over = " (!)" if metrics["mfu"] > 1.0 else ""
            parts.append(f"MFU {100 * metrics['mfu']:.1f}%{over}")
        if "data_wait" in metrics:
            parts.append(f"data-wait {100 * metrics['data_wait']:.1f}%")
        if self.health is not None:
            parts.append(f"health {self.health()}")
        parts.append(f"ETA {format_duration(eta_s)}")
        return " | ".join(parts)

    def update(self, step: int, eta_s: float, metrics: Mapping[str, float] | None = None) -> None:
        """Step ``step`` is done; ``metrics`` is given on logged steps."""
        if metrics is not None:
            self.last = dict(metrics)
        if self.tty:
            self.stream.write("\r\033[K" + self.line(step, self.last, eta_s))
            self._drawn = True
            self.stream.flush()
        elif metrics is not None:
            self.stream.write(self.line(step, self.last, eta_s) + "\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (a warning), below the status line when one is drawn."""
        if self._drawn:
            self.stream.write("\n")
            self._drawn = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step, appended and flushed.

    ``resume_at`` keeps the lines of steps up to it (a resumed run continues the file
    where its checkpoint was taken) and drops the rest: steps an interrupted run logged
    after that checkpoint are trained again.
    """

    def __init__(self, path: str | os.PathLike[str], *, resume_at: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_at]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            for record in kept:
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed by close()

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(dict(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a torn last line (a killed run) is skipped."""
    records: list[dict[str, Any]] = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return records


def plot_loss(records: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> bool:
    """Draw the training loss, and the held-out loss where there is one, against step
    into ``path`` (PNG); False when there is nothing to draw."""
    points = [(r["step"], r["loss"]) for r in records if "loss" in r and "step" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r and "step" in r]
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    steps, losses = zip(*points, strict=True)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, losses, lw=1.5, label="training")
    if evals:
        eval_steps, eval_losses = zip(*evals, strict=True)
        ax.plot(eval_steps, eval_losses, "o-", lw=1.5, ms=4, label="held-out")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def format_summary(rows: Iterable[tuple[str, str]], title: str = "summary") -> str:
    """A two-column table."""
    rows = list(rows)
    width = max((len(k) for k, _ in rows), default=0)
    lines = [title, "-" * max(len(title), 40)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)
