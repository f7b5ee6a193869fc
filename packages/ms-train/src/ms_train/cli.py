"""The ``ms-train`` command.

``ms-train flops`` prints model FLOPs per token and the MFU of a throughput, for a
preset, a config file or explicit dimensions (``ms_train.flops``; docs/flops.md).
Training from the command line is not built yet (issue 7): ``ms-train`` without a
subcommand says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ms_train import flops
from ms_train.config import PRESETS, ConfigError, load_config

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
    src = fl.add_argument_group("model source")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in configuration")
    src.add_argument("--config", metavar="FILE", help="a TOML configuration file")
    src.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. model.window=1024 (repeatable)",
    )
    flops.add_arguments(fl, required=False)
    return parser


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
    print(
        "ms-train: training from the command line is not built yet (issue 7); "
        "available now: ms-train flops",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
