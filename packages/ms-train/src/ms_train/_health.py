"""ms-health inside a rank: heartbeats to the driver, and stacks on SIGUSR1.

Both are on when the rank's environment names a driver (``MS_HEALTH_URL``, set by
``ms-train --health``'s launcher, or by the user for a driver of their own); otherwise
nothing starts and ms-health is not imported. ``MS_HEALTH_DUMP_DIR`` names where
faulthandler writes this rank's stacks on SIGUSR1, the file the node agent reads when
it escalates the rank; without it the stacks go to stderr (``kill -USR1 <pid>``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from typing import IO, Any

__all__ = ["INTERVAL_ENV", "install_dump_handler", "start_heartbeat"]

# Dump files stay open for the process's life: faulthandler writes to their descriptors.
_OPEN: list[IO[str]] = []

#: Seconds between heartbeats (default 0.5), for the launcher to pass to the ranks.
INTERVAL_ENV = "MS_HEALTH_INTERVAL"


def start_heartbeat(on: bool = True) -> Any:
    """A started ``ms_health.Heartbeat`` when ``MS_HEALTH_URL`` is set, else None."""
    if not on or not os.environ.get("MS_HEALTH_URL"):
        return None
    from ms_health import Heartbeat

    interval = float(os.environ.get(INTERVAL_ENV, "0.5"))
    hb = Heartbeat.from_env(interval_s=interval)
    return None if hb is None else hb.start()


def install_dump_handler(rank: int) -> None:
    """faulthandler on SIGUSR1 into ``MS_HEALTH_DUMP_DIR``'s file for ``rank``, or to
    stderr without that variable."""
    folder = os.environ.get("MS_HEALTH_DUMP_DIR")
    if not folder:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        return
    from ms_health.agent import dump_file
    from ms_health.escalate import install_dump_handler as install

    os.makedirs(folder, exist_ok=True)
    _OPEN.append(install(dump_file(folder, rank)))
