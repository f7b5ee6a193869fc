"""The ``ms-train`` command.

``ms-train [--config FILE | --preset NAME] [--nproc N] [--set k=v ...]`` trains (the
``tiny`` preset when neither is given). With ``--nproc N > 1`` outside torchrun it
re-launches itself through ``torchrun --standalone --nproc-per-node N``; under torchrun
(``WORLD_SIZE`` set) every worker trains its rank.

``ms-train flops`` prints model FLOPs per token and the MFU of a throughput, for a
preset, a config file or explicit dimensions (``ms_train.flops``; docs/flops.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

from ms_train import flops
from ms_train._tensorboard import require_tensorboard
from ms_train.config import PRESETS, ConfigError, load_config
from ms_train.errors import JobError

__all__ = ["main"]

# flops option -> the ModelConfig field it defaults to when a preset or file is given
_FROM_MODEL = {
    "layers": "n_layers",
    "hidden": "d_model",
    "heads": "n_heads",
    "seq": "seq_len",
    "vocab": "vocab_size",
    "ffn": "d_ff",
    "window": "window",
}


def _parser() -> argparse.ArgumentParser:
    parser = flops._OneLineParser(
        prog="ms-train", description="Train GPT models with the ms stack."
    )
    train = parser.add_argument_group("training (no COMMAND)")
    _source_options(train, default_note=" (default: tiny, when no --config either)")
    train.add_argument(
        "--nproc",
        type=flops._int_arg,
        default=1,
        metavar="N",
        help="ranks on this machine; N > 1 launches through torchrun (default 1)",
    )
    train.add_argument(
        "--peak-tflops",
        type=flops._positive_float_arg,
        default=None,
        metavar="P",
        help="per-rank peak TFLOP/s for MFU (default: a measured matmul rate)",
    )
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=flops._OneLineParser
    )
    fl = sub.add_parser(
        "flops",
        help="model FLOPs per token and MFU",
        description="Model FLOPs per token of GPT training (attention included, sliding-"
        "window aware) and the MFU of a throughput. Dimensions come from --preset or "
        "--config (with --set overrides); explicit dimension options override them.",
    )
    _source_options(fl.add_argument_group("model source"))
    flops.add_arguments(fl, required=False)
    return parser


def _source_options(group: argparse._ArgumentGroup, default_note: str = "") -> None:
    group.add_argument(
        "--preset", choices=sorted(PRESETS), help=f"a built-in configuration{default_note}"
    )
    group.add_argument("--config", metavar="FILE", help="a TOML configuration file")
    group.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. model.n_layers=8 (repeatable)",
    )


def _flops(args: argparse.Namespace) -> int:
    missing = [opt for opt in _FROM_MODEL if getattr(args, opt) is None]
    if args.preset is None and args.config is None:
        required = [f"--{opt}" for opt in ("layers", "hidden", "heads", "seq", "vocab")]
        absent = [o for o in required if getattr(args, o[2:]) is None]
        if absent:
            print(
                f"ms-train flops: error: give --preset or --config, or all of {' '.join(required)}"
                f" (missing {' '.join(absent)})",
                file=sys.stderr,
            )
            return 2
    elif missing:
        try:
            model = load_config(args.config, preset=args.preset, overrides=args.set).model
        except ConfigError as e:
            print(f"ms-train flops: error: {e}", file=sys.stderr)
            return 2
        for opt in missing:
            setattr(args, opt, getattr(model, _FROM_MODEL[opt]))
    return flops.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ms-train``; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad option (2)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "flops":
        return _flops(args)
    return _train(args, list(sys.argv[1:] if argv is None else argv))


def _without_nproc(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    preset = args.preset if args.preset or args.config else "tiny"
    try:
        config = load_config(args.config, preset=preset, overrides=args.set)
        under_torchrun = "WORLD_SIZE" in os.environ
        config.layout(int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc)
        if config.train.tensorboard:
            require_tensorboard()  # before torchrun starts ranks that would each fail
    except (JobError, OSError) as e:
        print(f"ms-train: error: {e}", file=sys.stderr)
        return 2
    if args.nproc > 1 and not under_torchrun:
        env = dict(os.environ)
        # One share of the cores per rank (torchrun would otherwise force 1, with a warning).
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            "-m",
            "ms_train.cli",
            *_without_nproc(argv),
        ]
        try:
            return subprocess.call(cmd, env=env)
        except KeyboardInterrupt:
            return 130
    from ms_train.trainer import Trainer

    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    try:
        with Trainer(config, peak_flops=peak) as trainer:
            trainer.train()
    except JobError as e:
        print(f"ms-train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
