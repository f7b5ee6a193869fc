"""Hosts that failed their diagnostics, kept out of the job until someone clears them.

The driver's recovery policy adds a host with the reason and the evidence (the failed
check); a launcher asks :meth:`Blocklist.blocked` before it joins a rendezvous and,
when its host is listed, refuses to start workers and says why (``ms-train --health``
does, and stops a running job gracefully when one of its hosts is listed). The list
persists to a JSON file (written atomically) so that a restarted driver, or a launcher
on another machine reading the same shared file, sees the same list.
``ms-health blocklist`` lists, checks and clears entries.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["BlockedNode", "Blocklist", "main"]

_FORMAT = 1


@attrs.frozen
class BlockedNode:
    node: str
    reason: str
    #: Wall-clock time (``time.time()``) it was listed.
    since: float
    evidence: Mapping[str, Any] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "reason": self.reason,
            "since": self.since,
            "evidence": dict(self.evidence),
        }


class Blocklist:
    """A set of blocked nodes, thread-safe, optionally persisted to ``path``.

    With a ``path``, every read of :meth:`blocked` / :meth:`entries` reloads the file
    when it changed, so that several processes share one list through it.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else Path(path)
        self._lock = threading.Lock()
        self._nodes: dict[str, BlockedNode] = {}
        self._mtime: int | None = None
        if self.path is not None and self.path.exists():
            self._reload()

    def add(self, node: str, reason: str, evidence: Mapping[str, Any] | None = None) -> BlockedNode:
        """List ``node`` (again: the newest reason wins)."""
        if not isinstance(node, str) or not node:
            raise ValueError(f"node must be a non-empty string, got {node!r}")
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason must be a non-empty string, got {reason!r}")
        entry = BlockedNode(node, reason, time.time(), dict(evidence or {}))
        json.dumps(entry.to_json())  # evidence must serialise: fail here, not at save
        with self._lock:
            self._reload_if_changed()
            self._nodes[node] = entry
            self._save()
        return entry

    def remove(self, node: str) -> bool:
        """Clear ``node``; False when it was not listed."""
        with self._lock:
            self._reload_if_changed()
            found = self._nodes.pop(node, None) is not None
            if found:
                self._save()
            return found

    def blocked(self, node: str) -> BlockedNode | None:
        with self._lock:
            self._reload_if_changed()
            return self._nodes.get(node)

    def entries(self) -> list[BlockedNode]:
        with self._lock:
            self._reload_if_changed()
            return sorted(self._nodes.values(), key=lambda e: e.since)

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            self._reload_if_changed()
            return {"format": _FORMAT, "nodes": [e.to_json() for e in self._nodes.values()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        nodes = _parse(state, "state")
        with self._lock:
            self._nodes = nodes
            self._save()

    # ----------------------------------------------------------------------- storage

    def _save(self) -> None:
        if self.path is None:
            return
        body = {"format": _FORMAT, "nodes": [e.to_json() for e in self._nodes.values()]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._mtime = self.path.stat().st_mtime_ns

    def _reload_if_changed(self) -> None:
        if self.path is None:
            return
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            self._nodes, self._mtime = {}, None
            return
        if mtime != self._mtime:
            self._reload()

    def _reload(self) -> None:
        assert self.path is not None
        try:
            state = json.loads(self.path.read_text())
        except ValueError as e:
            raise ValueError(f"blocklist {self.path} is not JSON: {e}") from e
        self._nodes = _parse(state, str(self.path))
        self._mtime = self.path.stat().st_mtime_ns


def _parse(state: Any, where: str) -> dict[str, BlockedNode]:
    if not isinstance(state, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(state).__name__}")
    if state.get("format") != _FORMAT:
        raise ValueError(f"{where}.format must be {_FORMAT}, got {state.get('format')!r}")
    nodes = state.get("nodes")
    if not isinstance(nodes, list):
        raise ValueError(f"{where}.nodes must be a list, got {type(nodes).__name__}")
    out: dict[str, BlockedNode] = {}
    for i, e in enumerate(nodes):
        ok = (
            isinstance(e, Mapping)
            and isinstance(e.get("node"), str)
            and e["node"]
            and isinstance(e.get("reason"), str)
            and isinstance(e.get("since"), (int, float))
            and isinstance(e.get("evidence", {}), Mapping)
        )
        if not ok:
            raise ValueError(
                f"{where}.nodes[{i}] must be {{node: str, reason: str, since: number, "
                f"evidence: object}}, got {e!r}"
            )
        out[e["node"]] = BlockedNode(
            e["node"], e["reason"], float(e["since"]), e.get("evidence", {})
        )
    return out


def main(argv: list[str] | None = None, prog: str = "ms-health blocklist") -> int:
    """``ms-health blocklist --file PATH {list, check [HOST], remove HOST}``.

    ``list`` prints every entry; ``check`` exits 1 when HOST (default: this host) is
    listed, with its entry, and 0 when it is not (for a scheduler's node prolog);
    ``remove`` clears HOST once it is repaired (exit 1 when it was not listed). A file
    that cannot be read is exit 2, naming it.
    """
    parser = argparse.ArgumentParser(
        prog=prog, description="Hosts that failed their diagnostics, kept out of jobs."
    )
    parser.add_argument("--file", required=True, type=Path, help="the blocklist's JSON file")
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="print every listed host")
    check = actions.add_parser("check", help="exit 1 when HOST is listed, 0 when not")
    check.add_argument("host", nargs="?", default=socket.gethostname())
    remove = actions.add_parser("remove", help="clear HOST from the list")
    remove.add_argument("host")
    args = parser.parse_args(argv)
    try:
        blocklist = Blocklist(args.file)
        if args.action == "list":
            for e in blocklist.entries():
                print(describe(e))
            return 0
        if args.action == "check":
            entry = blocklist.blocked(args.host)
            if entry is None:
                print(f"{args.host}: not on the blocklist {args.file}")
                return 0
            print(describe(entry))
            return 1
        if blocklist.remove(args.host):
            print(f"{args.host}: removed from the blocklist {args.file}")
            return 0
        print(f"{args.host}: not on the blocklist {args.file}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def describe(entry: BlockedNode) -> str:
    """One line: the host, since when (UTC), why."""
    since = datetime.datetime.fromtimestamp(entry.since, datetime.timezone.utc)
    return f"{entry.node}  since {since:%Y-%m-%d %H:%M:%S} UTC  {entry.reason}"
