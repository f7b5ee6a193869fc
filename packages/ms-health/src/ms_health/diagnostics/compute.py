"""Checks of one device: a matmul's correctness and throughput, and host memory bandwidth.

A GPU that computes wrong results (a bad SM, a flipped HBM bit) or slowly (a throttled
clock, a downgraded link) fails a node as surely as a dead NIC, and only a computation
shows it. Correctness is judged against a float64 product of the same (rounded) inputs,
with a tolerance per dtype; throughput is judged against a floor the caller sets from a
healthy node's figure, since a datasheet's peak is never reached.

torch is imported where a check runs: ``import ms_health`` must not import it.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ms_health.diagnostics.result import CheckResult

if TYPE_CHECKING:
    import torch

__all__ = [
    "MATMUL_TOLERANCE",
    "matmul_check",
    "matmul_error",
    "memory_bandwidth_check",
]

#: Largest ``max|out - ref| / max|ref|`` a healthy device reaches, per dtype, for the
#: uniform [-1, 1) inputs of :func:`matmul_check` with K up to ~16k. Rounding the result
#: to the dtype alone errs by half an ulp (2^-24 fp32, 2^-11 fp16, 2^-8 bf16); the rest
#: is headroom for the accumulation order, and far below a corrupted element's error.
MATMUL_TOLERANCE: dict[str, float] = {
    "float64": 1e-10,
    "float32": 1e-4,
    "float16": 5e-3,
    "bfloat16": 2e-2,
}
#: fp32 matmuls on CUDA with TF32 allowed keep a 10-bit mantissa, as fp16 does.
_TF32_TOLERANCE = 5e-3
_DEFAULT_SIZE = {"cpu": 1024, "cuda": 8192}

Matmul = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


def matmul_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """``max|out - reference| / max|reference|``, in float64 on the reference's device;
    ``inf`` when ``out`` holds a NaN or an infinity or its shape is not the reference's."""
    import torch

    if tuple(out.shape) != tuple(reference.shape):
        return math.inf
    diff = out.detach().to(device=reference.device, dtype=torch.float64) - reference
    err = float(diff.abs().max())  # NaN anywhere in out makes this NaN
    if not math.isfinite(err):
        return math.inf
    scale = float(reference.abs().max())
    return err / scale if scale > 0 else err


def matmul_check(
    device: str = "cpu",
    size: int | None = None,
    dtype: str | torch.dtype = "float32",
    *,
    min_flops: float | None = None,
    repeats: int = 3,
    tolerance: float | None = None,
    matmul: Matmul | None = None,
    seed: int = 0,
) -> CheckResult:
    """Multiply two ``size x size`` matrices on ``device`` and judge the result and speed.

    Every product (one warm-up and ``repeats`` timed ones) is compared with a float64
    product of the same inputs; the largest :func:`matmul_error` must stay within
    ``tolerance`` (default :data:`MATMUL_TOLERANCE` of the dtype). Throughput is
    ``2 * size**3`` over the fastest timed product, in FLOP/s; below ``min_flops`` the
    check fails. A device that raises (CUDA unavailable, a device error) fails it too.

    Args:
        device: ``cpu``, ``cuda`` or ``cuda:<index>``.
        size: the matrices' side; default 1024 on CPU, 8192 on CUDA.
        dtype: ``float32``, ``float16``, ``bfloat16`` or ``float64`` (or the torch dtype).
        min_flops: the throughput floor in FLOP/s, or None for none.
        repeats: timed products, >= 1.
        tolerance: the bound on :func:`matmul_error`; default by dtype.
        matmul: the product under test, ``torch.matmul`` by default (another kernel, or
            a wrong one to prove the check fails).
        seed: for the random inputs.
    """
    dev_type = _device_type(device)
    name = _dtype_name(dtype)
    side = _DEFAULT_SIZE[dev_type] if size is None else size
    _check_int("size", side, 1)
    _check_int("repeats", repeats, 1)
    _check_floor("min_flops", min_flops)
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"tolerance must be a finite number > 0, got {tolerance!r}")
    start = time.perf_counter()
    evidence: dict[str, Any] = {"device": device, "dtype": name, "size": side}
    try:
        return _matmul_check(
            device, side, name, min_flops, repeats, tolerance, matmul, seed, start, evidence
        )
    except Exception as e:  # a device error is a finding about the node, not a bug here
        evidence["traceback"] = traceback.format_exc(limit=8)
        return CheckResult(
            "matmul", False, time.perf_counter() - start, f"raised {e!r}"[:500], evidence
        )


def _matmul_check(
    device: str,
    side: int,
    name: str,
    min_flops: float | None,
    repeats: int,
    tolerance: float | None,
    matmul: Matmul | None,
    seed: int,
    start: float,
    evidence: dict[str, Any],
) -> CheckResult:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return CheckResult(
            "matmul", False, time.perf_counter() - start, "CUDA is not available", evidence
        )
    dt = getattr(torch, name)
    tf32 = dev.type == "cuda" and name == "float32" and torch.backends.cuda.matmul.allow_tf32
    tol = _TF32_TOLERANCE if tf32 else MATMUL_TOLERANCE[name]
    tol = tol if tolerance is None else tolerance
    evidence.update(tolerance=tol, tf32=tf32)
    mm = torch.matmul if matmul is None else matmul

    gen = torch.Generator(device=dev).manual_seed(seed)
    a = (torch.rand(side, side, generator=gen, device=dev) * 2 - 1).to(dt)
    b = (torch.rand(side, side, generator=gen, device=dev) * 2 - 1).to(dt)
    # The reference multiplies the inputs as rounded to the dtype, so that the tolerance
    # covers only what the product itself adds.
    reference = a.double() @ b.double()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    worst = matmul_error(mm(a, b), reference)  # warm-up: allocator, kernel selection
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = mm(a, b)
        sync()
        times.append(time.perf_counter() - t0)
        worst = max(worst, matmul_error(out, reference))
        del out
    best = min(times)
    flops = 2.0 * side**3 / best if best > 0 else math.inf
    evidence.update(
        max_rel_error=worst if math.isfinite(worst) else "inf",
        flops=flops,
        best_s=best,
        times_s=times,
        min_flops=min_flops,
    )
    seconds = time.perf_counter() - start
    what = f"{side}x{side} {name} matmul on {device}"
    rate = f"{flops / 1e12:.3g} TFLOP/s"
    if not worst <= tol:
        shown = "a non-finite or misshapen result" if math.isinf(worst) else f"{worst:.3g}"
        message = f"{what} is wrong: max relative error {shown} > tolerance {tol:g} ({rate})"
        return CheckResult("matmul", False, seconds, message, evidence)
    if min_flops is not None and flops < min_flops:
        message = f"{what} too slow: {rate} < floor {min_flops / 1e12:.3g} TFLOP/s"
        return CheckResult("matmul", False, seconds, message, evidence)
    message = f"{what}: {rate} (best of {repeats}), max relative error {worst:.2g} <= {tol:g}"
    return CheckResult("matmul", True, seconds, message, evidence)


def memory_bandwidth_check(
    size_mb: float = 256.0, min_gbps: float | None = None, *, repeats: int = 5
) -> CheckResult:
    """Host memory copy bandwidth: copy ``size_mb`` MiB between two host buffers.

    The rate counts bytes read plus bytes written, as STREAM's Copy does, over the
    fastest of ``repeats`` copies after a warm-up; the last copy is compared with its
    source. The check fails below ``min_gbps`` (GB/s, 10^9 bytes), or on a wrong copy.
    """
    if isinstance(size_mb, bool) or not isinstance(size_mb, (int, float)):
        raise TypeError(f"size_mb must be a number, got {size_mb!r}")
    if not (math.isfinite(size_mb) and size_mb > 0):
        raise ValueError(f"size_mb must be a finite number > 0, got {size_mb!r}")
    _check_int("repeats", repeats, 1)
    _check_floor("min_gbps", min_gbps)
    import torch

    start = time.perf_counter()
    words = max(1, int(size_mb * (1 << 20)) // 8)
    nbytes = words * 8
    # Not zeros: fresh zero pages can be mapped without touching memory. Writing both
    # buffers first also takes the page faults out of the timed copies.
    src = torch.arange(words, dtype=torch.int64).mul_(2654435761)
    dst = torch.empty_like(src).fill_(-1)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    intact = bool(torch.equal(dst, src))
    del src, dst
    best = min(times)
    gbps = 2.0 * nbytes / best / 1e9 if best > 0 else math.inf
    evidence = {
        "bytes": nbytes,
        "gbps": gbps,
        "best_s": best,
        "times_s": times,
        "min_gbps": min_gbps,
        "intact": intact,
    }
    seconds = time.perf_counter() - start
    what = f"host copy of {nbytes / (1 << 20):.0f} MiB"
    rate = f"{gbps:.3g} GB/s (read + write, best of {repeats})"
    if not intact:
        message = f"{what}: the copy differs from its source"
        return CheckResult("memory_bandwidth", False, seconds, message, evidence)
    if min_gbps is not None and gbps < min_gbps:
        message = f"{what} too slow: {rate} < floor {min_gbps:.3g} GB/s"
        return CheckResult("memory_bandwidth", False, seconds, message, evidence)
    return CheckResult("memory_bandwidth", True, seconds, f"{what}: {rate}", evidence)


def _device_type(device: str) -> str:
    kind = device.split(":", 1)[0] if isinstance(device, str) else None
    index = device.split(":", 1)[1] if isinstance(device, str) and ":" in device else "0"
    if kind not in _DEFAULT_SIZE or not index.isdigit() or (kind == "cpu" and ":" in device):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {device!r}")
    return kind


def _dtype_name(dtype: Any) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in MATMUL_TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(MATMUL_TOLERANCE)}, got {dtype!r}")
    return name


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_floor(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be None or a number >= 0, got {value!r}")
