"""The per-rank peak FLOP/s that MFU is measured against, and where it came from.

Three sources, in order: a value the user gives (``--peak-tflops``, ``peak_flops=``);
the datasheet's dense bf16 figure for a known GPU when the run computes in bf16; else
the best of several short matmul measurements on the device. One measurement taken on
a busy machine (other jobs on the same cores) comes out low, and every MFU against it
comes out high: the README's example once printed ``MFU 246.8%`` and an identical run
``MFU 1.3%``. The best of several tries is robust to a busy moment, not to a machine
busy throughout, hence the warning of :func:`over_peak_warning`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

import attrs

from ms_train.flops import matmul_peak_flops

if TYPE_CHECKING:
    import torch

__all__ = [
    "GPU_BF16_PEAKS",
    "Peak",
    "PeakSource",
    "measured_peak",
    "over_peak_warning",
    "table_peak",
]

PeakSource = Literal["given", "table", "measured"]

#: Dense (no sparsity) bf16 tensor-core FLOP/s per GPU from the vendors' datasheets, by
#: a pattern of ``torch.cuda.get_device_name()``; the first match wins, so a variant
#: comes before its family (H100 PCIe before H100, L40S before L4, A100 before A10).
GPU_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    (r"\bH200\b", 989e12),
    (r"\bGH200\b", 989e12),
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"\bA100\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bL4\b", 121e12),
    (r"\bA10\b", 125e12),
)


@attrs.frozen
class Peak:
    """A per-rank peak FLOP/s.

    Attributes:
        flops: FLOP/s of one rank.
        source: ``"given"`` (by the user), ``"table"`` (a datasheet value for the
            device, :data:`GPU_BF16_PEAKS`) or ``"measured"`` (matmuls timed at start).
        detail: how it was found, for the summary (the device and dtype, or the tries).
    """

    flops: float
    source: PeakSource
    detail: str

    def describe(self) -> str:
        return f"{self.flops / 1e9:,.1f} GFLOP/s per rank, {self.source}: {self.detail}"


def table_peak(device_name: str, dtype: torch.dtype | None) -> Peak | None:
    """The datasheet peak of a known GPU computing in bf16; None for anything else."""
    import torch

    if dtype != torch.bfloat16:
        return None  # the table holds bf16 figures; fp32 (or TF32) rates differ by GPU
    for pattern, flops in GPU_BF16_PEAKS:
        if re.search(pattern, device_name):
            return Peak(flops, "table", f"{device_name}, dense bf16 datasheet value")
    return None


def measured_peak(
    device: str, *, dtype: torch.dtype | None, n: int, tries: int = 5, seconds: float = 0.2
) -> Peak:
    """The best of ``tries`` matmul measurements of ``seconds`` each on ``device``.

    The best, not the mean: other work on the machine only ever slows a try down, so
    the fastest try is the closest to what the device can do.
    """
    if tries < 1:
        raise ValueError(f"tries must be >= 1, got {tries}")
    rates = [matmul_peak_flops(device, n=n, seconds=seconds, dtype=dtype) for _ in range(tries)]
    name = "fp32" if dtype is None else str(dtype).removeprefix("torch.")
    detail = (
        f"best of {tries} x {seconds:g} s of {n}x{n} {name} matmuls at start "
        f"(tries {min(rates) / 1e9:,.1f}-{max(rates) / 1e9:,.1f} GFLOP/s)"
    )
    return Peak(max(rates), "measured", detail)


def over_peak_warning(mfu: float, peak: Peak) -> str | None:
    """A warning for an MFU over 100%, saying why the peak is too low; None up to 100%."""
    if not mfu > 1.0:
        return None
    why = {
        "measured": "it was measured while the machine was busy, so it is too low",
        "given": "the value given (--peak-tflops, peak_flops=) is too low",
        "table": "the datasheet value for this device does not apply to it",
    }[peak.source]
    return (
        f"ms-train: warning: MFU {100 * mfu:.1f}% is over 100% of the peak "
        f"({peak.describe()}); {why}. Give the device's peak with --peak-tflops "
        "(Trainer(peak_flops=...)) for a meaningful MFU"
    )
