"""``python -m ms_health.diagnostics``: diagnose this node; exit 0 if it passes, 1 if not.

A usage or set-up error (a bad argument, an endpoint already taken) is one line on
stderr and exit 2, whatever the node's health.
"""

from __future__ import annotations

import argparse
import json
import sys

from ms_health.diagnostics.config import DiagnosticsConfig
from ms_health.diagnostics.runner import BACKENDS, diagnose_node

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ms_health.diagnostics",
        description="Diagnose this node: collectives, matmul, host memory bandwidth.",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) here (default 2)")
    p.add_argument("--timeout", type=float, default=120.0, help="bound on it all, seconds")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="default: nccl if CUDA")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes tested together (default 1)")
    p.add_argument("--endpoint", default=None, help="host:port of node 0's store")
    d = DiagnosticsConfig()
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=d.collective_timeout_s,
        help="bound on the rendezvous and each collective, seconds",
    )
    p.add_argument("--matmul-size", type=int, default=None, help="default 1024 CPU, 8192 CUDA")
    p.add_argument("--matmul-dtype", default=None, help="default float32 CPU, bfloat16 CUDA")
    p.add_argument("--min-tflops", type=float, default=None, help="matmul floor, TFLOP/s")
    p.add_argument("--memory-mb", type=float, default=d.memory_mb, help="MiB copied")
    p.add_argument("--min-gbps", type=float, default=None, help="memory floor, GB/s")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = DiagnosticsConfig(
            collective_timeout_s=args.collective_timeout,
            matmul_size=args.matmul_size,
            matmul_dtype=args.matmul_dtype,
            min_flops=None if args.min_tflops is None else args.min_tflops * 1e12,
            memory_mb=args.memory_mb,
            min_gbps=args.min_gbps,
        )
        report = diagnose_node(
            args.nproc,
            args.timeout,
            args.backend,
            node_rank=args.node_rank,
            nnodes=args.nnodes,
            endpoint=args.endpoint,
            config=config,
        )
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        # TCPStore reports a taken port as a RuntimeError (DistNetworkError).
        print(f"ms_health.diagnostics: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2) if args.json else report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
