"""The ``ms-train`` options about the configuration and the installation.

``--version``: the versions of ms-train, of every ms package installed, and of torch.
``--print-config``: the resolved configuration as TOML that ``--config`` reads back.
``ms-train config [SECTION ...] [--json]``: every config key with its type, default and
help, read from the config classes (``ms_train._config_doc``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
import re
import sys
from typing import Any

from ms_train import _config_doc
from ms_train._version import __version__
from ms_train.config import _SECTIONS, ConfigError, _unknown, load_config
from ms_train.errors import EXIT_USAGE

__all__ = ["add_arguments", "print_config", "print_versions", "run_config", "stack_versions"]

# Runtime libraries whose version matters to a bug report when they are installed.
_OPTIONAL = ("triton", "flash-attn")


def add_arguments(
    parser: argparse.ArgumentParser,
    train: argparse._ArgumentGroup,
    commands: argparse._SubParsersAction[Any],
) -> None:
    """``--version`` on ``parser``, ``--print-config`` in the training options ``train``,
    and the ``config`` command among ``commands``."""
    parser.add_argument(
        "--version",
        action="store_true",
        help="print the versions of ms-train, the ms packages, torch and Python, and exit",
    )
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (preset, then --config, then --set) as TOML that "
        "--config reads back, and exit",
    )
    config = commands.add_parser(
        "config",
        help="every config key with its type, default and help",
        description="Every key of the configuration (section.field, as --set and the "
        "TOML/JSON file take it) with its type, its default and its help, read from the "
        "config classes in ms_train.config.",
    )
    config.add_argument(
        "sections",
        nargs="*",
        metavar="SECTION",
        help=f"only these sections ({', '.join(_SECTIONS)})",
    )
    config.add_argument("--json", action="store_true", help="the listing as JSON")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _siblings() -> list[str]:
    """The ms packages: those ms-train requires (installed or not), then any other
    installed ``ms-<x>`` distribution that provides the module ``ms_<x>``."""
    try:
        requires = importlib.metadata.requires("ms-train") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        requires = []
    names: list[str] = []
    for requirement in requires:
        found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        name = _normalize(found.group()) if found else ""
        if name.startswith("ms-") and name != "ms-train" and name not in names:
            names.append(name)
    # The module check leaves out unrelated projects that happen to be called ms-...
    installed = {_normalize(d.metadata["Name"] or "") for d in importlib.metadata.distributions()}
    for name in sorted(installed):
        module = name.replace("-", "_")
        fresh = name.startswith("ms-") and name != "ms-train" and name not in names
        if fresh and importlib.util.find_spec(module) is not None:
            names.append(name)
    return names


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def stack_versions() -> list[tuple[str, str | None]]:
    """``(name, version)`` of ms-train, each ms package (``_siblings``), torch, the optional
    kernels libraries that are installed, and Python; version None: not installed."""
    import torch

    rows: list[tuple[str, str | None]] = [("ms-train", __version__)]
    rows += [(name, _installed(name)) for name in _siblings()]
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    rows.append(("torch", f"{torch.__version__}{cuda}"))
    rows += [(name, v) for name in _OPTIONAL if (v := _installed(name)) is not None]
    rows.append(("Python", platform.python_version()))
    return rows


def print_versions() -> int:
    rows = stack_versions()
    width = max(len(name) for name, _ in rows)
    for name, version in rows:
        print(f"{name:<{width}}  {version or 'not installed'}")
    return 0


def print_config(args: argparse.Namespace) -> int:
    """Print the config that ``args`` (``--preset``, ``--config``, ``--set``) resolve to."""
    from ms_train._config_io import config_to_toml

    header = (
        f"The configuration ms-train {__version__} resolved. It is complete: train it with\n"
        "`ms-train --config FILE`, without --preset (a preset would give back its own\n"
        "value to a field left out below as none)."
    )
    try:
        text = config_to_toml(
            load_config(args.config, preset=args.preset, overrides=args.set), header
        )
    except ConfigError as e:
        print(f"ms-train: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(text)
    return 0


def run_config(args: argparse.Namespace) -> int:
    """``ms-train config``: the listing of every key (or of the named sections)."""
    for name in args.sections:
        if name not in _SECTIONS:
            print(
                f"ms-train config: error: {_unknown('section', name, list(_SECTIONS))}",
                file=sys.stderr,
            )
            return EXIT_USAGE
    fields = _config_doc.config_fields(args.sections or None)
    sys.stdout.write(
        _config_doc.fields_json(fields) + "\n" if args.json else _config_doc.format_fields(fields)
    )
    return 0
