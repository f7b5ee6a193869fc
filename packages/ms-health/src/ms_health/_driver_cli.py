"""``ms-health driver`` / ``python -m ms_health.driver``: run a driver until SIGTERM or
SIGINT, then save its state and exit 0.

The token is read from a file (never from the command line, where ``ps`` shows it) and
never printed. Detectors are named as ``MODULE:CALLABLE``; the callable returns one
detector or an iterable of them. Exit 2, with one line on stderr, for bad arguments: an
unreadable or empty token file, a state file that cannot be loaded, a port in use.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from ms_health.findings import Detector

__all__ = ["load_detectors", "run"]


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the ms-health driver: it takes heartbeats, runs detectors and "
        "records events until SIGTERM or SIGINT.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=0, help="port to bind (default: any free one)")
    p.add_argument(
        "--token-file",
        required=True,
        type=Path,
        help="file holding the shared token (surrounding whitespace ignored)",
    )
    p.add_argument("--state", type=Path, help="state file: loaded if present, kept up to date")
    p.add_argument("--events", type=Path, help="JSON-lines file every event is appended to")
    p.add_argument(
        "--observe-only",
        action="store_true",
        help="record findings as 'would act' and never act on them",
    )
    p.add_argument("--job", help="the job's id (default: taken from the first heartbeat)")
    p.add_argument(
        "--world-size", type=int, help="ranks in the job (default: taken from the first heartbeat)"
    )
    p.add_argument("--tick", type=float, default=0.25, help="seconds between detector checks")
    p.add_argument(
        "--detectors",
        action="append",
        default=[],
        metavar="MODULE:CALLABLE",
        help="a callable returning the detectors to run (repeatable); 'default': "
        "ms_health.detectors.default_detectors for --heartbeat-interval",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=0.5,
        metavar="S",
        help="the senders' interval the default detectors are tuned to (default 0.5)",
    )
    p.add_argument(
        "--recovery",
        action="store_true",
        help="act on findings with ms_health.recovery.Recovery (dump, escalate through the "
        "node agents, let the elastic agents restart); without it findings are only recorded",
    )
    p.add_argument(
        "--diagnose", action="store_true", help="with --recovery: run diagnostics on suspect nodes"
    )
    p.add_argument(
        "--blocklist", type=Path, help="with --recovery: the blocklist file for failed nodes"
    )
    return p


def load_detectors(spec: str) -> list[Detector]:
    """The detectors ``MODULE:CALLABLE`` returns."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--detectors must be MODULE:CALLABLE, got {spec!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    made: Any = factory()
    found = [made] if isinstance(made, Detector) else list(made)
    for det in found:
        if not isinstance(det, Detector):
            raise TypeError(f"{spec} returned {det!r}, which is not a findings.Detector")
    return found


def run(argv: list[str] | None, prog: str) -> int:
    args = _parser(prog).parse_args(argv)
    from ms_health.driver import Driver

    try:
        token = args.token_file.read_text().strip()
    except OSError as e:
        return _fail(prog, f"--token-file {str(args.token_file)!r} cannot be read: {e.strerror}")
    if not token:
        return _fail(prog, f"--token-file {str(args.token_file)!r} is empty")
    try:
        detectors: list[Detector] = []
        for spec in args.detectors:
            if spec == "default":
                from ms_health.detectors import default_detectors

                detectors.extend(
                    default_detectors(args.heartbeat_interval, world_size=args.world_size)
                )
            else:
                detectors.extend(load_detectors(spec))
        driver = Driver(
            token,
            host=args.host,
            port=args.port,
            detectors=detectors,
            world_size=args.world_size,
            job=args.job,
            tick_s=args.tick,
            observe_only=args.observe_only,
            state_path=args.state,
            events_path=args.events,
        )
        if args.recovery:
            from ms_health.blocklist import Blocklist
            from ms_health.recovery import Recovery

            blocklist = None if args.blocklist is None else Blocklist(args.blocklist)
            driver.on_finding = Recovery(driver, diagnose=args.diagnose, blocklist=blocklist)
        driver.start()
    except (ValueError, TypeError, ImportError, AttributeError, OSError) as e:
        return _fail(prog, str(e))

    done = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        print(
            f"ms-health driver: job {driver.job or '(from the first heartbeat)'}, "
            f"listening on {driver.url}" + (" (observe-only)" if args.observe_only else ""),
            flush=True,
        )
        while not done.wait(1.0):
            pass
    finally:
        driver.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("ms-health driver: stopped", flush=True)
    return 0


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
