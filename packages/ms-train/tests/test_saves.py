"""Checkpoint saves that fail softly: a failed save is logged and counted and training
goes on, a committed save resets the count, a failed final save is tried again, and
``checkpoint.max_failures`` failures in a row end the run with a JobError. Failures are
real stage-2 errors raised in the real writer process by a ``Checkpointer(hook=...)``."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest

from ms_ckpt import Checkpointer
from ms_data import build_shards
from ms_data.build import BuildConfig
from ms_testing.dist import run_ranks
from ms_train._saves import SaveFailuresError
from ms_train.config import Config, load_config
from ms_train.errors import JobError
from ms_train.report import read_metrics
from ms_train.trainer import Trainer

HERE = Path(__file__).parent
if str(HERE) not in sys.path:  # the checkpoint writer imports the hook by module name
    sys.path.insert(0, str(HERE))
from _save_faults import FailSaves  # noqa: E402

pytestmark = pytest.mark.slow  # each test trains with a loader and a writer process

ENOSPC = "OSError: [Errno 28] No space left on device"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import argparse
    import json
    import textwrap

    out = tmp_path_factory.mktemp("corpus") / "shards"
    sources = [argparse.__file__, json.__file__, textwrap.__file__]
    build_shards(sources, out, BuildConfig(tokenizer="bytes"), progress=False)
    return out


def _config(corpus: Path, out: Path, *extra: str) -> Config:
    small = [
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.seq_len=32",
        "model.window=16",
        "data.micro_batch=4",
        "data.global_batch=8",
        "optim.warmup_steps=3",
        "train.log_every=1",
        "train.sample_tokens=0",
        "train.steps=12",
        "checkpoint.every=2",
    ]
    overrides = [*small, f"data.shards={corpus}", f"train.out_dir={out}", *extra]
    return load_config(None, preset="tiny", overrides=overrides)


class FaultyTrainer(Trainer):
    """The trainer, its checkpointer given a stage-2 hook (None: none)."""

    def __init__(self, config: Config, hook: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.checkpointer.finalize()  # never saved: no writer to stop
        self.checkpointer = Checkpointer(
            self.checkpoint_dir, keep_last=config.checkpoint.keep_last, hook=hook
        )


def _committed(out: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in (out / "ckpt").glob("step-*/manifest.json"))


def test_failed_saves_are_logged_and_counted_and_training_goes_on(
    corpus: Path, tmp_path: Path
) -> None:
    """Saves every 2 steps; those of steps 4, 6, 10 and the first of 12 fail. Never 3 in a
    row (step 8 commits in between), so the run trains to the end and the final save,
    tried again, commits."""
    out = tmp_path / "run"
    config = _config(corpus, out, "checkpoint.max_failures=3")
    stream = io.StringIO()
    hook = FailSaves({4: 1, 6: 1, 10: 1, 12: 1})
    with FaultyTrainer(config, hook, peak_flops=1e9, stream=stream) as trainer:
        summary = trainer.train()
        assert trainer.saves.failures == 4 and trainer.saves.failed_in_a_row == []
    log = stream.getvalue()
    assert summary.end_step == 12
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 13))
    warnings = [line for line in log.splitlines() if line.startswith("ms-train: warning: saving")]
    assert len(warnings) == 4, log
    assert warnings[0].startswith(f"ms-train: warning: saving step 4 failed in stage 2: {ENOSPC}")
    assert (
        "(1 failed save(s) in a row; the run stops at checkpoint.max_failures = 3;" in (warnings[0])
    )
    assert "the newest committed is step 2 under" in warnings[0]
    assert "(2 failed save(s) in a row" in warnings[1] and "saving step 6 failed" in warnings[1]
    assert "(1 failed save(s) in a row" in warnings[2]  # step 8 committed: the count restarted
    assert "saving step 12 failed" in warnings[3]
    assert "ms-train: saving the final checkpoint of step 12 again" in log
    assert _committed(out) == [8, 12]  # keep_last = 2


def test_max_failures_in_a_row_end_the_run_with_a_job_error(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = _config(corpus, out, "checkpoint.max_failures=2")
    stream = io.StringIO()
    with (
        FaultyTrainer(config, FailSaves({4: 1, 6: 1}), peak_flops=1e9, stream=stream) as trainer,
        pytest.raises(SaveFailuresError) as e,
    ):
        trainer.train()
    assert isinstance(e.value, JobError)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(
        "2 checkpoint saves in a row failed (steps 4, 6; checkpoint.max_failures = 2), the "
        f"last with: saving step 6 failed in stage 2: {ENOSPC}"
    )
    assert message.endswith(
        f"Of the checkpoints, the newest committed is step 2 under {out / 'ckpt'}; fix the "
        "cause and rerun to resume from it"
    )
    # Found out at the next save (step 8), which the run did not start.
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 9))
    assert _committed(out) == [2]


def test_a_final_save_failing_max_failures_times_ends_the_run(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = _config(corpus, out, "checkpoint.max_failures=3", "train.steps=4")
    stream = io.StringIO()
    with (
        FaultyTrainer(config, FailSaves({4: 5}), peak_flops=1e9, stream=stream) as trainer,
        pytest.raises(
            SaveFailuresError, match=r"^3 checkpoint saves in a row failed \(steps 4, 4, 4;"
        ),
    ):
        trainer.train()
    assert stream.getvalue().count("saving the final checkpoint of step 4 again") == 2
    assert _committed(out) == [2]


def _train_rank(config: Config) -> tuple[int, str]:
    import torch.distributed as dist

    # Rank 1's writer fails its part of the step-4 save; rank 0 then refuses the step.
    hook = FailSaves({4: 1}) if dist.get_rank() == 1 else None
    stream = io.StringIO()
    with FaultyTrainer(config, hook, peak_flops=1e9, stream=stream) as trainer:
        trainer.train()
        return trainer.saves.failures, stream.getvalue()


@pytest.mark.timeout(200)
def test_every_rank_counts_a_save_that_failed_on_one_rank(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = _config(corpus, out, "checkpoint.max_failures=2", "data.micro_batch=4")
    results = run_ranks(_train_rank, 2, args=(config,), timeout=150, env={"OMP_NUM_THREADS": "1"})
    assert [failures for failures, _ in results] == [1, 1]
    lines = results[0][1].splitlines()
    (warning,) = [s for s in lines if s.startswith("ms-train: warning: saving")]
    assert "saving step 4 failed in stage 2: rank 1 failed to write its part" in warning
    assert results[1][1] == ""  # rank 1 reports nothing itself
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 13))
    assert _committed(out) == [10, 12]


class PoisonedTrainer(Trainer):
    """Sets a weight to NaN before step ``at`` (0-based) trains: the model is damaged
    from there on, as after an overflow or a bad batch."""

    def __init__(self, config: Config, at: int, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.at = at

    def train_step(self, step: int) -> Any:
        if step == self.at:
            import torch

            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        return super().train_step(step)


def test_a_step_whose_gradient_norm_is_not_finite_is_not_saved(
    corpus: Path, tmp_path: Path
) -> None:
    """Saves every 2 steps; NaN from step 5 on: steps 2 and 4 commit, 6 to 12 (the final
    one included) are refused with a warning, so a restart rolls back to step 4."""
    out = tmp_path / "run"
    config = _config(corpus, out)
    stream = io.StringIO()
    with PoisonedTrainer(config, 4, peak_flops=1e9, stream=stream) as trainer:
        summary = trainer.train()
    assert summary.end_step == 12
    assert _committed(out) == [2, 4]
    refused = [s for s in stream.getvalue().splitlines() if "not saving step" in s]
    assert len(refused) == 4, stream.getvalue()
    assert refused[0].startswith("ms-train: warning: not saving step 6: its gradient norm is nan")
