"""The fault detectors the driver runs, and :func:`default_detectors`, the usual set.

Each detector implements :class:`ms_health.findings.Detector`: the driver calls
``observe(record, now)`` for every accepted heartbeat and ``check(now)`` on its tick,
both with its own monotonic clock, so the detectors are plain logic (no threads, no
I/O) that tests drive with a virtual clock. A finding's ``at`` is the driver time it
was found: the check's time for the time-based detectors (missing heartbeat, hang),
the receipt time of the heartbeat that showed it for the others. A condition is
reported on every check while it holds, and at least once even if it clears before
the next check. ``state_dict`` holds only what was learned (timeouts, baselines,
strikes), never driver-clock times, and ``reset(ranks)`` forgets the ranks' live
state after a restart while keeping it. A detector is not thread-safe: the driver
makes one call at a time (heartbeats arrive on server threads, checks on a tick).
Evidence lists at most 64 ranks one by one, so that findings of a large job stay
small.

========================  =============  ===========================================
detector                  kind           finds
========================  =============  ===========================================
:class:`MissingHeartbeat` ``crash``      a rank silent for longer than its timeout
:class:`Hang`             ``hang``       no step progress beyond a learned per-phase
                                         timeout
:class:`NonFiniteLoss`    ``nonfinite``  a NaN or infinite loss, at its step
:class:`LossSpike`        ``loss_spike`` a loss far above its recent median
:class:`ThroughputDrop`   ``throughput`` tokens/s below a fraction of its baseline
:class:`Straggler`        ``straggler``  a rank busier than its peers, window after
                                         window
========================  =============  ===========================================
"""

from __future__ import annotations

from ms_health.detectors._common import number
from ms_health.detectors.crash import MissingHeartbeat
from ms_health.detectors.hang import START_TIMEOUTS_S, Hang
from ms_health.detectors.loss import LossSpike, NonFiniteLoss
from ms_health.detectors.straggler import Straggler
from ms_health.detectors.throughput import ThroughputDrop
from ms_health.findings import Detector

__all__ = [
    "START_TIMEOUTS_S",
    "Hang",
    "LossSpike",
    "MissingHeartbeat",
    "NonFiniteLoss",
    "Straggler",
    "ThroughputDrop",
    "default_detectors",
]


def default_detectors(interval_s: float, *, world_size: int | None = None) -> list[Detector]:
    """One of each detector, tuned to a sender that beats every ``interval_s`` seconds.

    - :class:`MissingHeartbeat`: timeout 3 intervals, at least 1.5 s (a crash is
      seen within 2 s at 0.5 s and a 0.25 s check tick); with ``world_size``, a rank
      never heard from is missing after 60 s.
    - :class:`Hang`: 5 x the longest interval between progress marks per phase, at
      least 4 intervals and 2 s (so steps faster than the heartbeats, which see a new
      step at every beat, still leave room for one late beat); start values
      :data:`START_TIMEOUTS_S` (10 minutes for ``init`` and ``checkpoint``).
    - :class:`NonFiniteLoss`.
    - :class:`LossSpike`: 6 robust deviations above the median of the last 50 steps,
      after 20.
    - :class:`ThroughputDrop`: below 0.7 x the median of the last 50 normal steps for
      5 consecutive steps and 30 s, after 10 (4 ranks sharing 2 cores with two busy
      processes dipped to 0.69x for 5 steps, a few seconds, in a 10-minute soak).
    - :class:`Straggler`: busy time above 1.35 x the peers' median, and at least 10%
      of the step time above it (25% for CPU time, counted in the wall time it
      costs), in 3 consecutive windows of 3 steps: a rank that makes the job's steps
      1.5x as long is flagged within 10 steps, while a rank that shares its cores
      with other processes, whose CPU time per step cost under 20% of the step over
      3 windows in a row in the recorded runs, is not (``Straggler``).
    """
    interval = number("interval_s", interval_s, low=0.0)
    return [
        MissingHeartbeat.for_interval(interval, expected_ranks=world_size),
        Hang(min_timeout_s=max(2.0, 4 * interval)),
        NonFiniteLoss(),
        LossSpike(),
        ThroughputDrop(min_duration_s=30.0),
        Straggler(threshold=1.35, windows=3, min_slowdown=0.1, min_cpu_slowdown=0.25),
    ]
