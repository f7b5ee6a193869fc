"""Model-FLOPs accounting for GPT training, and model FLOPs utilization (MFU).

The count is the one of Megatron-LM (Narayanan et al. 2021) and the MegaScale paper
(arXiv 2402.15627): only the matrix multiplications of the model, forward plus backward
(the backward pass costs twice the forward), with no activation recomputation counted. Per
token and per layer the forward pass costs

* QKV projection ``2 * 3 * h**2``, attention output projection ``2 * h**2``,
  MLP ``2 * 2 * h * d_ff`` (the *dense* term, parameter GEMMs);
* ``Q @ K^T`` and ``softmax(.) @ V``: ``2 * 2 * h * keys_per_query`` (the *attention* term);

and the output projection to the vocabulary costs ``2 * h * V`` once per token (the *logits*
term). With ``d_ff = 4h`` and ``keys_per_query = s`` three times this sum is Megatron's
``72 * l * h**2 * (1 + s / (6h) + V / (12 * l * h))``.

Sliding-window attention changes only the attention term, through ``keys_per_query``; see
:func:`keys_per_query` for the two conventions. ``flops_per_token`` is pure Python and does
not import torch; only :func:`matmul_peak_flops` does. ``main`` / ``add_arguments`` /
``run`` implement the ``flops`` command line.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    import torch

    from ms_train.config import ModelConfig

__all__ = [
    "AttentionConvention",
    "FlopsPerToken",
    "add_arguments",
    "flops_per_token",
    "keys_per_query",
    "main",
    "matmul_peak_flops",
    "mfu",
    "model_flops_per_token",
    "parse_rate",
    "run",
]

AttentionConvention = Literal["megatron", "exact"]
_CONVENTIONS: tuple[str, ...] = get_args(AttentionConvention)

# Training = forward + backward, and the backward pass costs twice the forward.
_TRAIN_FACTOR = 3


@dataclass(frozen=True)
class FlopsPerToken:
    """Model FLOPs per token of one training pass (forward + backward, no recomputation).

    ``dense``: the parameter GEMMs of all layers (QKV, attention output projection, MLP).
    ``attention``: ``Q @ K^T`` and attention-times-``V`` of all layers.
    ``logits``: the output projection to the vocabulary.
    """

    dense: float
    attention: float
    logits: float

    @property
    def total(self) -> float:
        """All model FLOPs per token of one training pass."""
        return self.dense + self.attention + self.logits

    @property
    def forward(self) -> float:
        """The forward pass alone (a third of ``total``)."""
        return self.total / _TRAIN_FACTOR


def _check_int(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _check_positive(name: str, value: object) -> float:
    if (
        type(value) not in (int, float)
        or not math.isfinite(value)  # type: ignore[arg-type]
        or value <= 0  # type: ignore[operator]
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _check_window(value: object) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise ValueError(f"window must be None or an int >= 1, got {value!r}")
    return value


def _check_convention(value: object) -> AttentionConvention:
    if value not in _CONVENTIONS:
        raise ValueError(f"attention must be one of {list(_CONVENTIONS)}, got {value!r}")
    return value  # type: ignore[return-value]


def _attended_pairs(seq_len: int, window: int | None) -> int:
    """(query, key) pairs under the causal mask, optionally limited to ``window`` keys.

    Query ``i`` (0-based) sees keys ``max(0, i - W + 1) .. i``, that is ``min(i + 1, W)``
    keys. With ``w = min(W, s)`` the sum over ``i`` is ``w (w + 1) / 2 + (s - w) w``: a
    ramp for the first ``w`` queries, then ``w`` keys each.
    """
    w = seq_len if window is None else min(window, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w


def keys_per_query(
    *, seq_len: int, window: int | None = None, attention: AttentionConvention = "megatron"
) -> float:
    """Keys each query is counted against, averaged over the ``seq_len`` positions.

    ``"megatron"`` counts the whole computed block, masked half included (the convention of
    Megatron-LM and the MegaScale paper): ``s`` for full causal attention, ``min(W, s)`` for
    a sliding window of ``W`` tokens (current token included). ``"exact"`` counts only the
    pairs the causal mask lets through: ``(s + 1) / 2`` for full causal attention,
    ``sum(min(i + 1, W) for i in range(s)) / s`` with a window.
    """
    s = _check_int("seq_len", seq_len)
    w = _check_window(window)
    convention = _check_convention(attention)
    if convention == "megatron":
        return float(s if w is None else min(w, s))
    return _attended_pairs(s, w) / s


def flops_per_token(
    *,
    n_layers: int,
    d_model: int,
    seq_len: int,
    vocab_size: int,
    d_ff: int | None = None,
    window: int | None = None,
    attention: AttentionConvention = "megatron",
) -> FlopsPerToken:
    """Model FLOPs per token of one training pass of a GPT (see the module docstring).

    ``d_ff`` defaults to ``4 * d_model``; ``window`` is the sliding-window size in tokens
    (``None``: full causal attention); ``attention`` picks the convention of
    :func:`keys_per_query`. Every argument is validated and a ``ValueError`` names it.
    """
    n_layers = _check_int("n_layers", n_layers)
    h = _check_int("d_model", d_model)
    s = _check_int("seq_len", seq_len)
    vocab = _check_int("vocab_size", vocab_size)
    ff = 4 * h if d_ff is None else _check_int("d_ff", d_ff)
    keys = keys_per_query(seq_len=s, window=window, attention=attention)

    # Forward FLOPs per token; integers where exact, so d_ff = 4h matches Megatron exactly.
    dense_layer = 2 * 3 * h * h + 2 * h * h + 2 * 2 * h * ff
    attention_layer = 2 * 2 * h * keys
    logits = 2 * h * vocab
    return FlopsPerToken(
        dense=float(_TRAIN_FACTOR * n_layers * dense_layer),
        attention=_TRAIN_FACTOR * n_layers * attention_layer,
        logits=float(_TRAIN_FACTOR * logits),
    )


def model_flops_per_token(
    model: ModelConfig, *, attention: AttentionConvention = "megatron"
) -> FlopsPerToken:
    """:func:`flops_per_token` of a :class:`~ms_train.config.ModelConfig`."""
    return flops_per_token(
        n_layers=model.n_layers,
        d_model=model.d_model,
        seq_len=model.seq_len,
        vocab_size=model.vocab_size,
        d_ff=model.d_ff,
        window=model.window,
        attention=attention,
    )


def mfu(
    *, tokens_per_s: float, flops_per_token: float, n_gpus: int, peak_flops_per_gpu: float
) -> float:
    """Model FLOPs utilization as a fraction (0.552 means 55.2%).

    ``tokens_per_s`` is the whole job's throughput, ``flops_per_token`` the training FLOPs
    per token (``FlopsPerToken.total``), ``peak_flops_per_gpu`` in FLOP/s (312e12 for an
    A100 in bf16).
    """
    rate = _check_positive("tokens_per_s", tokens_per_s)
    per_token = _check_positive("flops_per_token", flops_per_token)
    gpus = _check_int("n_gpus", n_gpus)
    peak = _check_positive("peak_flops_per_gpu", peak_flops_per_gpu)
    return rate * per_token / (gpus * peak)


def matmul_peak_flops(
    device: str = "cpu",
    *,
    n: int = 2048,
    seconds: float = 1.0,
    dtype: torch.dtype | None = None,
) -> float:
    """Achieved FLOP/s of back-to-back ``n x n`` matmuls on ``device`` (``dtype`` default fp32).

    A practical stand-in for the peak in :func:`mfu` where no datasheet number applies
    (a CPU). One untimed warm-up matmul, then batches of doubling size until ``seconds``
    have passed; on CUDA the device is synchronized before the clock starts and after each
    batch, so queued kernels are not mistaken for finished ones.
    """
    import torch

    size = _check_int("n", n)
    budget = _check_positive("seconds", seconds)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"matmul_peak_flops: device {device!r} requested but CUDA is unavailable"
        )
    dt = torch.float32 if dtype is None else dtype

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with torch.no_grad():
        a = torch.randn(size, size, device=dev, dtype=dt)
        b = torch.randn(size, size, device=dev, dtype=dt)
        out = torch.empty(size, size, device=dev, dtype=dt)
        torch.matmul(a, b, out=out)  # warm-up: kernel selection, allocator, threads
        sync()
        done, batch = 0, 1
        start = time.perf_counter()
        elapsed = 0.0
        while elapsed < budget:
            for _ in range(batch):
                torch.matmul(a, b, out=out)
            sync()
            done += batch
            batch *= 2
            elapsed = time.perf_counter() - start
    return 2.0 * size**3 * done / elapsed


# ---------------------------------------------------------------------------------------
# Command line: ``flops`` (reused by ``ms-train flops`` through add_arguments + run).

_SUFFIXES = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKMG]?)\s*$")


def parse_rate(text: str) -> float:
    """Parse a positive rate such as ``"1984.0k"``, ``"1.98M"``, ``"433600"`` or ``"4e5"``."""
    match = _RATE.match(text)
    if match is None:
        raise ValueError(f"expected a positive number with an optional k/M/G suffix, got {text!r}")
    value = float(match.group(1)) * _SUFFIXES[match.group(2)]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return value


def _int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def _rate_arg(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """Add the ``flops`` options to ``parser`` (a top-level parser or a subcommand's).

    ``required=False`` leaves the model dimensions optional, for a caller that fills
    the missing ones (``ms-train flops --preset``) before calling :func:`run`.
    """
    dims = parser.add_argument_group("model dimensions")
    dims.add_argument("--layers", type=_int_arg, required=required, help="number of layers")
    dims.add_argument("--hidden", type=_int_arg, required=required, help="model width h")
    dims.add_argument(
        "--heads", type=_int_arg, required=required, help="attention heads (must divide --hidden)"
    )
    dims.add_argument("--seq", type=_int_arg, required=required, help="sequence length s")
    dims.add_argument("--vocab", type=_int_arg, required=required, help="vocabulary size V")
    dims.add_argument("--ffn", type=_int_arg, default=None, help="MLP width (default 4*hidden)")
    dims.add_argument(
        "--window",
        type=_int_arg,
        default=None,
        help="sliding-window attention size in tokens (default: full causal)",
    )
    dims.add_argument(
        "--attention",
        choices=_CONVENTIONS,
        default="megatron",
        help="megatron: count the full s x s block (paper convention); "
        "exact: count only attended pairs",
    )
    tput = parser.add_argument_group("throughput (all three give the MFU)")
    tput.add_argument(
        "--tokens-per-s",
        type=_rate_arg,
        default=None,
        metavar="RATE",
        help="job throughput, e.g. 1984.0k, 1.98M or 1984000",
    )
    tput.add_argument("--gpus", type=_int_arg, default=None, help="number of GPUs")
    tput.add_argument(
        "--peak-tflops",
        type=_positive_float_arg,
        default=None,
        help="peak TFLOP/s per GPU (312 for A100 bf16)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object")


class _OptionError(Exception):
    pass


def _opt_int(args: argparse.Namespace, dest: str, option: str, *, optional: bool) -> int | None:
    value = getattr(args, dest, None)
    if value is None and optional:
        return None
    if type(value) is not int or value < 1:
        raise _OptionError(f"{option} must be an int >= 1, got {value!r}")
    return value


def _opt_positive(args: argparse.Namespace, dest: str, option: str) -> float | None:
    value = getattr(args, dest, None)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise _OptionError(f"{option} must be a finite number > 0, got {value!r}")
    return float(value)


def _report(args: argparse.Namespace) -> dict[str, Any]:
    layers = _opt_int(args, "layers", "--layers", optional=False)
    hidden = _opt_int(args, "hidden", "--hidden", optional=False)
    heads = _opt_int(args, "heads", "--heads", optional=False)
    seq = _opt_int(args, "seq", "--seq", optional=False)
    vocab = _opt_int(args, "vocab", "--vocab", optional=False)
    ffn = _opt_int(args, "ffn", "--ffn", optional=True)
    window = _opt_int(args, "window", "--window", optional=True)
    gpus = _opt_int(args, "gpus", "--gpus", optional=True)
    assert layers and hidden and heads and seq and vocab  # not optional: checked above
    if hidden % heads:
        raise _OptionError(f"--heads must divide --hidden ({hidden}), got {heads}")
    try:
        attention = _check_convention(getattr(args, "attention", "megatron"))
    except ValueError as exc:
        raise _OptionError(f"--{exc}") from None
    rate = _opt_positive(args, "tokens_per_s", "--tokens-per-s")
    peak_tflops = _opt_positive(args, "peak_tflops", "--peak-tflops")
    throughput = {"--tokens-per-s": rate, "--gpus": gpus, "--peak-tflops": peak_tflops}
    missing = [name for name, value in throughput.items() if value is None]
    if 0 < len(missing) < len(throughput):
        given = [name for name in throughput if name not in missing]
        raise _OptionError(f"{', '.join(missing)} required with {', '.join(given)} for the MFU")

    flops = flops_per_token(
        n_layers=layers,
        d_model=hidden,
        seq_len=seq,
        vocab_size=vocab,
        d_ff=ffn,
        window=window,
        attention=attention,
    )
    report: dict[str, Any] = {
        "model": {
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "seq": seq,
            "vocab": vocab,
            "ffn": 4 * hidden if ffn is None else ffn,
            "window": window,
            "attention": attention,
            "keys_per_query": keys_per_query(seq_len=seq, window=window, attention=attention),
        },
        "flops_per_token": {
            "dense": flops.dense,
            "attention": flops.attention,
            "logits": flops.logits,
            "total": flops.total,
            "forward": flops.forward,
        },
        "flops_per_sequence": flops.total * seq,
        "attention_share": flops.attention / flops.total,
        "throughput": None,
    }
    if rate is not None and gpus is not None and peak_tflops is not None:
        value = mfu(
            tokens_per_s=rate,
            flops_per_token=flops.total,
            n_gpus=gpus,
            peak_flops_per_gpu=peak_tflops * 1e12,
        )
        report["throughput"] = {
            "tokens_per_s": rate,
            "gpus": gpus,
            "peak_tflops": peak_tflops,
            "achieved_tflops_per_gpu": rate * flops.total / gpus / 1e12,
            "mfu": value,
        }
    return report


def _format(report: dict[str, Any]) -> str:
    m, f = report["model"], report["flops_per_token"]
    total = f["total"]
    window = m["window"]
    attn = "full causal" if window is None else f"sliding window {window}"
    lines = [
        f"model: {m['layers']} layers, hidden {m['hidden']}, heads {m['heads']}, "
        f"ffn {m['ffn']}, seq {m['seq']}, vocab {m['vocab']}",
        f"attention: {attn}, {m['attention']} convention, {m['keys_per_query']:g} keys per query",
        "training FLOPs per token (forward + backward = 3x forward, no recomputation):",
    ]
    for name in ("dense", "attention", "logits"):
        lines.append(f"  {name:<10} {f[name]:12.4e}  {100 * f[name] / total:6.2f}%")
    lines.append(f"  {'total':<10} {total:12.4e}")
    lines.append(f"  {'forward':<10} {f['forward']:12.4e}  (total / 3)")
    lines.append(
        f"training FLOPs per sequence ({m['seq']} tokens): {report['flops_per_sequence']:.4e}"
    )
    lines.append(f"attention share: {100 * report['attention_share']:.2f}%")
    t = report["throughput"]
    if t is not None:
        lines.append(
            f"throughput: {t['tokens_per_s']:.6g} tokens/s on {t['gpus']} GPUs, "
            f"{t['achieved_tflops_per_gpu']:.1f} TFLOP/s per GPU of {t['peak_tflops']:g} peak"
        )
        lines.append(f"MFU: {100 * t['mfu']:.2f}%")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the ``flops`` command on parsed ``args``; 0 on success, 2 on a bad option value."""
    try:
        report = _report(args)
    except (_OptionError, ValueError) as exc:
        print(f"flops: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2))
    else:
        print(_format(report))
    return 0


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``flops`` command line; returns the exit status (2 for a bad option) instead of exiting."""
    parser = _OneLineParser(
        prog="flops",
        description="Model FLOPs per token of GPT training, and the MFU for a throughput.",
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad option (2)
        return exc.code if isinstance(exc.code, int) else 2
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
