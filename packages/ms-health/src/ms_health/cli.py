"""The ``ms-health`` command: a dispatcher to subcommands, each a module's ``main``.

``ms-health driver ...`` runs the driver (:func:`ms_health.driver.main`). A subcommand's
module is imported only when that subcommand runs.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "main"]

#: name -> (module whose ``main(argv, prog)`` runs it, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "driver": ("ms_health.driver", "run the driver server that takes heartbeats"),
    "blocklist": ("ms_health.blocklist", "list, check or clear hosts that failed diagnostics"),
}


def _usage() -> str:
    lines = ["usage: ms-health COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "'ms-health COMMAND --help' describes one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(
            f"ms-health: error: unknown command {name!r}; expected one of {sorted(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    rc: int = module.main(rest, prog=f"ms-health {name}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
