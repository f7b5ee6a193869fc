"""The metrics of a run's logged steps and the run's clock.

Each logged step reports over the window of steps since the previous logged one: the
loss averaged over those steps and the global batch, the tokens/s and data wait over
the window's wall time, MFU against the run's peak. The clock leaves out what is not
training: the first step (start-up and warm-up), held-out evaluations and the final
checkpoint's write. The trainer's ``RunSummary`` takes its rates from here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ms_train._peak import Peak, over_peak_warning
from ms_train.config import TrainConfig

__all__ = ["MetricWindow", "RunRates", "health_cost"]


@attrs.frozen(kw_only=True)
class RunRates:
    """The whole run's rates after its first step (``RunSummary``'s fields of the name)."""

    wall_s: float
    tokens_per_s: float
    mfu: float
    health_cost: dict[str, float] | None


def health_cost(
    before: dict[str, float], after: dict[str, float], wall_s: float
) -> dict[str, float]:
    """The heartbeat's cost between two ``Heartbeat.cost()`` readings ``wall_s`` apart."""
    cost = {k: after[k] - before[k] for k in ("loop_s", "loop_calls", "sender_cpu_s")}
    cost["heartbeats"] = after["heartbeats"] - before["heartbeats"]
    cost["wall_s"] = wall_s
    cost["share"] = (cost["loop_s"] + cost["sender_cpu_s"]) / wall_s
    return cost


class MetricWindow:
    """Accounts each step of a run from ``start`` and makes the record of each logged one.

    A step is logged when it is the run's first, every ``train.log_every`` steps, at
    every evaluation (``train.eval_every``) and at the end.

    Args:
        start: the step the run starts from.
        train: ``steps``, ``log_every`` and ``eval_every`` are read.
        tokens_per_step: tokens of one global batch.
        flops_per_token: model FLOPs per token, for MFU.
        world_size: ranks of the job (MFU is over ``world_size x peak``).
        peak: the per-rank peak; None (MFU NaN) when the run needed none.
        device: where the losses are.
        mean: a loss tensor's mean over the ranks (collective with several ranks).
        waits: the loader's (seconds waited for data, wall seconds between batches).
        evaluate: the held-out loss (collective); None: no evaluation.
        cost: the heartbeat's ``cost()``; None without heartbeats.
        write: where each record goes (rank 0's files); None: nowhere.
        warn: where an MFU over 100% is explained, once (rank 0's progress); None:
            not on this rank.
    """

    def __init__(
        self,
        *,
        start: int,
        train: TrainConfig,
        tokens_per_step: int,
        flops_per_token: float,
        world_size: int,
        peak: Peak | None,
        device: torch.device,
        mean: Callable[[torch.Tensor], float],
        waits: Callable[[], tuple[float, float]],
        evaluate: Callable[[], float] | None = None,
        cost: Callable[[], dict[str, float]] | None = None,
        write: Callable[[dict[str, Any]], None] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.start = start
        self.total_steps = train.steps
        self.log_every = train.log_every
        self.eval_every = train.eval_every
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak = peak
        self.peak_flops = math.nan if peak is None else peak.flops
        self._mean, self._waits, self._evaluate = mean, waits, evaluate
        self._cost, self._write, self._warn = cost, write, warn
        #: ``(step, loss)`` of each logged step.
        self.losses: list[tuple[int, float]] = []
        #: ``(step, held-out loss)`` of each evaluation.
        self.evals: list[tuple[int, float]] = []
        self._warned = False
        self._cost0: dict[str, float] | None = None  # the heartbeat's cost when rates start
        self._loss = torch.zeros((), device=device)
        self._steps = 0
        self._t_first = self._t_window = time.perf_counter()
        self._wait0 = waits()

    def log(
        self, done: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float
    ) -> dict[str, float] | None:
        """Step ``done`` (1-based) trained to ``loss`` (this rank's) with ``grad_norm`` and
        ``lr``; its record when it is logged (collective then), else None."""
        self._steps += 1
        self._loss += loss
        evaluating = bool(self.eval_every) and (
            done % self.eval_every == 0 or done == self.total_steps
        )
        logged = (
            done == self.start + 1
            or done % self.log_every == 0
            or done == self.total_steps
            or evaluating
        )
        if not logged:
            return None
        mean_loss = self._mean(self._loss / self._steps)
        now = time.perf_counter()
        rate = self._steps * self.tokens_per_step / max(now - self._t_window, 1e-9)
        waits = self._waits()
        waited, walled = waits[0] - self._wait0[0], waits[1] - self._wait0[1]
        record = {
            "step": done,
            "loss": mean_loss,
            "lr": lr,
            "grad_norm": float(grad_norm.item()),
            "tokens_per_s": rate,
            "mfu": rate * self.flops_per_token / (self.world_size * self.peak_flops),
            "data_wait": waited / walled if walled > 0 else 0.0,
            "tokens": done * self.tokens_per_step,
        }
        self.losses.append((done, mean_loss))
        if evaluating and self._evaluate is not None:
            t_eval = time.perf_counter()
            record["eval_loss"] = self._evaluate()
            self.evals.append((done, record["eval_loss"]))
            spent = time.perf_counter() - t_eval  # not training time
            now += spent
            self._t_first += spent
        if self._write is not None:
            self._write(record)
        self._warn_once(record["mfu"])
        if done == self.start + 1:  # rates from here on leave out start-up
            self._t_first = now
            self._cost0 = self._cost() if self._cost is not None else None
        self._t_window, self._steps = now, 0
        self._loss.zero_()
        self._wait0 = self._waits()
        return record

    def _warn_once(self, mfu: float) -> None:
        if self._warn is None or self._warned or self.peak is None:
            return
        warning = over_peak_warning(mfu, self.peak)
        if warning:
            self._warn(warning)
            self._warned = True

    def eta(self, done: int) -> float:
        """Seconds left after step ``done``, at the rate since the first step (NaN until
        a second step has been timed)."""
        elapsed = time.perf_counter() - self._t_first
        per_step = elapsed / (done - self.start - 1) if done > self.start + 1 else math.nan
        return per_step * (self.total_steps - done)

    def finish(self) -> RunRates:
        """The run's rates, its clock stopped now (before the final checkpoint's write)."""
        t_end = time.perf_counter()
        cost = None
        if self._cost is not None and self._cost0 is not None and t_end > self._t_first:
            cost = health_cost(self._cost0, self._cost(), t_end - self._t_first)
        trained = max(0, self.total_steps - self.start)
        timed_steps = max(0, trained - 1)
        wall = t_end - self._t_first if trained else 0.0
        rate = timed_steps * self.tokens_per_step / wall if timed_steps and wall > 0 else math.nan
        return RunRates(
            wall_s=wall,
            tokens_per_s=rate,
            mfu=rate * self.flops_per_token / (self.world_size * self.peak_flops),
            health_cost=cost,
        )
