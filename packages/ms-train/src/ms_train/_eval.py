"""Held-out evaluation: the loss on documents the training stream never contains.

The held-out split is ms-data's (``PackedDataset(held_out=..., split="held_out")``):
``data.eval_fraction`` of the documents, a fixed choice that the training stream leaves
out in every epoch. One evaluation reads the first ``train.eval_batches`` global
batches of that split's stream, the same sequences every time (so the curve compares
like with like) and however many ranks there are: rank ``r`` of ``dp`` takes the
samples ``g`` with ``g % dp == r``, as in training, and the mean over all ranks is
one all-reduce.

An evaluation must leave training exactly as it was: it runs the bare model (no
data-parallel hooks) in eval mode under ``no_grad``, so dropout draws nothing from the
RNG, no gradient or optimizer state is touched, and the model's mode is restored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ms_data import PackedDataset
from ms_train.config import ConfigError

__all__ = ["HeldOutEval"]


class HeldOutEval:
    """The held-out loss of a model, one rank's share of it computed here.

    Args:
        train_set: the training stream; the held-out one is built from its corpus and
            settings, with the same ``held_out`` fraction.
        batches: global batches per evaluation (``train.eval_batches``).
        global_batch, micro_batch: sequences per global batch, and per forward pass.
        dp_rank, dp_size: this rank's share.
        device: where the model is.
        group: the data-parallel process group the mean is taken over; None: no other
            rank (one process).
    """

    def __init__(
        self,
        train_set: PackedDataset,
        *,
        batches: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> None:
        try:
            self.dataset = PackedDataset(
                train_set.corpus,
                train_set.seq_len,
                seed=train_set.seed,
                boundary=train_set.boundary,
                eos_id=train_set.eos_id,
                pad_id=train_set.pad_id,
                shuffle=train_set.shuffle,
                held_out=train_set.held_out,
                split="held_out",
            )
        except ValueError as e:
            raise ConfigError(f"data.eval_fraction = {train_set.held_out}: {e}") from None
        self.total = batches * global_batch
        self.micro_batch = micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device = device
        self.group = group
        self._batches: list[torch.Tensor] | None = None

    def describe(self) -> str:
        stats = self.dataset.stats()
        text = (
            f"{stats['documents']} held-out documents, {stats['tokens']:,} tokens; "
            f"{self.total} sequences per evaluation"
        )
        held = self.dataset.samples_per_epoch
        if held is not None and held < self.total:
            # The stream goes on into its next epoch: a valid but repetitive estimate.
            text += f" (the split holds {held}: some are seen twice)"
        return text

    def _my_batches(self) -> list[torch.Tensor]:
        """This rank's micro-batches of the evaluation set, read once and kept."""
        if self._batches is None:
            mine = range(self.dp_rank, self.total, self.dp_size)
            samples = torch.stack([torch.from_numpy(self.dataset.sample(g)) for g in mine])
            self._batches = list(torch.split(samples, self.micro_batch))
        return self._batches

    def loss(
        self,
        model: nn.Module,
        autocast: Callable[[], contextlib.AbstractContextManager[object]],
    ) -> float:
        """The mean loss over the evaluation set, the same on every rank."""
        batches = self._my_batches()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for batch in batches:
                    batch = batch.to(self.device, non_blocking=True)
                    with autocast():
                        _, loss = model(batch[:, :-1], batch[:, 1:])
                    total += loss.double()
        finally:
            model.train(was_training)
        # Every rank holds the same number of equal micro-batches: the mean of the
        # ranks' means is the mean over the evaluation set.
        if self.group is not None and self.dp_size > 1:
            dist.all_reduce(total, group=self.group)
        return float(total.item()) / (len(batches) * self.dp_size)
