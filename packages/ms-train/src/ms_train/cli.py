"""The ``ms-train`` command.

``ms-train [--config FILE | --preset NAME] [--nproc N] [--set k=v ...]`` trains (the
``tiny`` preset when neither is given), after the preflight checks (``_preflight``);
``--dry-run`` stops after them with the plan. An expected failure (``JobError``) is one
line and exit status 2; ``--debug`` (or ``MS_TRAIN_DEBUG=1``) adds its traceback.
With ``--nproc N > 1`` outside torchrun it launches N ranks through torch's elastic
agent, as ``torchrun --standalone`` does, and owns them (``ms_train._launch``); under
torchrun (``WORLD_SIZE`` set) every worker
trains its rank.

``ms-train flops`` prints model FLOPs per token and the MFU of a throughput, for a
preset, a config file or explicit dimensions (``ms_train.flops``; docs/flops.md).

``ms-train --version``, ``ms-train --print-config`` and ``ms-train config`` (every config
key with its type, default and help) are in ``ms_train._cli_config``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ms_train import _cli_config, flops
from ms_train._dry_run import dry_run_plan
from ms_train._fail import debug_wanted, report_failure
from ms_train._nodes import Nodes
from ms_train._preflight import preflight
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


def _count_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


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
        "--nnodes",
        type=flops._int_arg,
        default=1,
        metavar="N",
        help="machines in the job, each running this command with the same --rdzv-endpoint "
        "and --rdzv-id (default 1)",
    )
    train.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="where the nodes meet (torch's c10d rendezvous; the first node to bind it "
        "hosts it); required with --nnodes > 1",
    )
    train.add_argument(
        "--rdzv-id",
        default=None,
        metavar="ID",
        help="the job's rendezvous id, the same on every node; required with --nnodes > 1",
    )
    train.add_argument(
        "--max-restarts",
        type=_count_arg,
        default=None,
        metavar="R",
        help="restart the ranks of every node up to R times after a rank fails; they "
        "resume from the newest committed checkpoint (default 3 with --health, else 0)",
    )
    train.add_argument(
        "--health",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ms-health: heartbeats to a driver that detects crashes, hangs, NaN and "
        "stragglers and recovers (default: on with more than one rank)",
    )
    train.add_argument(
        "--health-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="with --nnodes > 1: where the health driver listens (the launcher that binds "
        "it hosts it)",
    )
    train.add_argument(
        "--health-diagnose",
        action="store_true",
        default=None,
        help="after a crash or hang, test the suspect ranks' node (collectives, matmul, "
        "memory bandwidth); a host that fails goes on <train.out_dir>/health/"
        "blocklist.json, the job stops with a checkpoint, and no launch starts there until "
        "`ms-health blocklist remove` clears it",
    )
    train.add_argument(
        "--health-min-gflops",
        type=flops._positive_float_arg,
        default=None,
        metavar="G",
        help="with --health-diagnose: the matmul GFLOP/s per process a healthy node reaches",
    )
    train.add_argument(
        "--health-min-gbps",
        type=flops._positive_float_arg,
        default=None,
        metavar="B",
        help="with --health-diagnose: the memory copy GB/s a healthy node reaches",
    )
    train.add_argument(
        "--peak-tflops",
        type=flops._positive_float_arg,
        default=None,
        metavar="P",
        help="per-rank peak TFLOP/s for MFU (default: a measured matmul rate)",
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, run the preflight checks, print the layout, parameters and FLOPs "
        "per step, and stop",
    )
    train.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an expected failure too (or set MS_TRAIN_DEBUG=1)",
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
    _cli_config.add_arguments(parser, train, sub)
    return parser


def _source_options(group: argparse._ArgumentGroup, default_note: str = "") -> None:
    group.add_argument(
        "--preset", choices=sorted(PRESETS), help=f"a built-in configuration{default_note}"
    )
    group.add_argument(
        "--config", metavar="FILE", help="a TOML configuration file (JSON when named *.json)"
    )
    group.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. model.n_layers=8 (repeatable; `ms-train config` "
        "lists the fields)",
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
    if args.command == "config":
        return _cli_config.run_config(args)
    if args.version:
        return _cli_config.print_versions()
    if args.print_config:
        return _cli_config.print_config(args)
    return _train(args, list(sys.argv[1:] if argv is None else argv))


#: Options for the launcher only: the ranks it starts run without them.
_LAUNCHER_OPTIONS = (
    "--nproc",
    "--nnodes",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--max-restarts",
    "--health-endpoint",
    "--health-min-gflops",
    "--health-min-gbps",
)
#: Flags without a value that only the launcher takes.
_LAUNCHER_FLAGS = ("--health", "--no-health", "--health-diagnose")


def _rank_argv(argv: list[str]) -> list[str]:
    """``argv`` without the launcher's own options (each ``--opt V`` or ``--opt=V``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in _LAUNCHER_FLAGS:
            continue
        elif a in _LAUNCHER_OPTIONS:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in _LAUNCHER_OPTIONS)):
            out.append(a)
    return out


def _nodes(args: argparse.Namespace) -> Nodes:
    """The launch's nodes and restarts, checked; JobError names the option."""
    if args.nnodes > 1 and (not args.rdzv_endpoint or not args.rdzv_id):
        raise JobError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT and --rdzv-id ID, the "
            "same on every node"
        )
    health = args.health if args.health is not None else args.nproc * args.nnodes > 1
    floors = args.health_min_gflops is not None or args.health_min_gbps is not None
    diagnose = bool(args.health_diagnose) or floors
    if diagnose and not health:
        given = "--health-diagnose" if args.health_diagnose else "--health-min-gflops/-gbps"
        raise JobError(f"{given} needs --health (on by default with more than one rank)")
    default_restarts = 3 if health else 0
    restarts = default_restarts if args.max_restarts is None else args.max_restarts
    return Nodes(
        nnodes=args.nnodes,
        endpoint=args.rdzv_endpoint,
        run_id=args.rdzv_id,
        max_restarts=restarts,
        health=health,
        health_endpoint=args.health_endpoint,
        health_diagnose=diagnose,
        health_min_flops=None if args.health_min_gflops is None else args.health_min_gflops * 1e9,
        health_min_gbps=args.health_min_gbps,
    )


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    preset = args.preset if args.preset or args.config else "tiny"
    debug = debug_wanted(args.debug)
    try:
        config = load_config(args.config, preset=preset, overrides=args.set)
        under_torchrun = "WORLD_SIZE" in os.environ
        nodes = _nodes(args)
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc * nodes.nnodes
        config.layout(world)
        # In the launcher, before any rank starts; under torchrun, Trainer checks.
        if args.dry_run or not under_torchrun:
            checked = preflight(config, build_demo=not args.dry_run)
    except (JobError, OSError) as e:
        return report_failure(e, debug=debug)
    if args.dry_run:
        if os.environ.get("RANK", "0") == "0":
            print(dry_run_plan(config, world, checked), flush=True)
        return 0
    if (args.nproc > 1 or nodes.nnodes > 1 or nodes.max_restarts or nodes.health) and (
        not under_torchrun
    ):
        from ms_train._launch import launch

        try:
            return launch(args.nproc, _rank_argv(argv), config, nodes=nodes)
        except JobError as e:  # the launcher's own set-up (the health side): one line
            return report_failure(e, debug=debug)
    from ms_train._launch import run_rank

    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    return run_rank(config, peak, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
