"""The trainer: data parallelism against one process, kill-and-resume, the swappable
engine, the CLI's training path and its reports."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch import nn

from ms_data import build_shards
from ms_data.build import BuildConfig
from ms_testing.dist import run_ranks
from ms_testing.train import write_train_config
from ms_train.config import Config, ConfigError, load_config
from ms_train.engine import DDPEngine, ZeroEngine, make_engine
from ms_train.report import MetricsLog, read_metrics
from ms_train.trainer import Trainer

# A model small enough to train 20 steps in a couple of seconds per rank.
SMALL = [
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
    "checkpoint.every=0",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-level shards of a few standard-library modules (about 300 KB)."""
    import argparse
    import json as json_mod
    import pathlib as pathlib_mod
    import textwrap

    out = tmp_path_factory.mktemp("corpus") / "shards"
    sources = [argparse.__file__, json_mod.__file__, pathlib_mod.__file__, textwrap.__file__]
    build_shards(sources, out, BuildConfig(tokenizer="bytes"), progress=False)
    return out


def _config(corpus: Path, out: Path, *extra: str) -> Config:
    return load_config(
        None,
        preset="tiny",
        overrides=[*SMALL, f"data.shards={corpus}", f"train.out_dir={out}", *extra],
    )


def _train(config: Config) -> dict[str, Any]:
    with Trainer(config, peak_flops=1e9, stream=io.StringIO()) as trainer:
        s = trainer.train()
        zero = getattr(trainer.engine, "zero", None)  # ZeroEngine's wrapper
        replicated = None if zero is None else sum(b.replicated for b in zero.buckets)
    return {
        "dp": s.dp,
        "accum": s.grad_accum,
        "losses": s.loss_history,
        "end": s.end_step,
        "replicated_buckets": replicated,
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["zero", "zero/replicated=2", "ddp"])
def test_two_ranks_match_one_process(corpus: Path, tmp_path: Path, engine: str) -> None:
    """20 steps of the same global batch: the engine over 2 gloo ranks (no accumulation)
    and one process (2 accumulated micro-batches) follow the same loss trajectory.
    ``zero/replicated=2``: ZeRO with the embeddings and the first block replicated."""
    name, _, replicated = engine.partition("/replicated=")
    steps = ["train.steps=20", "checkpoint.resume=false", f"parallel.engine={name}"]
    if replicated:
        steps.append(f"parallel.replicated_chunks={replicated}")
    env = {"OMP_NUM_THREADS": "1"}
    one = run_ranks(
        _train, 1, args=(_config(corpus, tmp_path / "one", *steps),), timeout=180, env=env
    )[0]
    two = run_ranks(
        _train, 2, args=(_config(corpus, tmp_path / "two", *steps),), timeout=180, env=env
    )
    assert (one["dp"], one["accum"]) == (1, 2)
    assert [(r["dp"], r["accum"]) for r in two] == [(2, 1), (2, 1)]
    # The config reached ZeRO: buckets of the replicated chunks on every rank.
    assert all(bool(r["replicated_buckets"]) == bool(replicated) for r in two)
    assert two[0]["losses"] == two[1]["losses"]  # the reported loss is the global mean
    single = torch.tensor([loss for _, loss in one["losses"]])
    parallel = torch.tensor([loss for _, loss in two[0]["losses"]])
    assert [s for s, _ in one["losses"]] == list(range(1, 21))
    assert single[-1] < single[0] - 1.0  # it trains
    # fp32: the ranks sum gradients in another order than accumulation does.
    torch.testing.assert_close(parallel, single, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_with_other_replicated_chunks_matches_an_uninterrupted_run(
    corpus: Path, tmp_path: Path
) -> None:
    """2 ranks: 10 steps all sharded, then resumed with 3 chunks replicated to step 20,
    against 20 uninterrupted steps all sharded. A flat learning rate after step 1, so
    that the two runs' schedules (set by train.steps) agree."""
    flat = ["optim.lr=0.003", "optim.min_lr=0.003", "optim.warmup_steps=1"]
    saves = [*flat, "checkpoint.every=5", "train.precision=fp32"]
    env = {"OMP_NUM_THREADS": "1"}
    resumed, plain = tmp_path / "resumed", tmp_path / "plain"

    def two_ranks(out: Path, *extra: str) -> dict[str, Any]:
        config = _config(corpus, out, *saves, *extra)
        return run_ranks(_train, 2, args=(config,), timeout=180, env=env)[0]

    first = two_ranks(resumed, "train.steps=10")
    then = two_ranks(resumed, "train.steps=20", "parallel.replicated_chunks=3")
    whole = two_ranks(plain, "train.steps=20")
    assert (first["replicated_buckets"], bool(then["replicated_buckets"])) == (0, True)
    assert [s for s, _ in then["losses"]] == list(range(11, 21))  # resumed at step 10
    after = torch.tensor([loss for _, loss in then["losses"]])
    want = torch.tensor([loss for s, loss in whole["losses"] if s > 10])
    # The same update, sharded or whole; fp32 tolerance for the order of the sums.
    torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-5)


def _cli(config_file: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "ms_train.cli", "--config", str(config_file), *args]


def _write_toml(path: Path, corpus: Path, out: Path, steps: int, every: int, tp: int = 1) -> None:
    write_train_config(path, shards=corpus, out_dir=out, steps=steps, every=every, tp=tp)


def _train_2_ranks(config_file: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``ms-train --config FILE --nproc 2`` to the end."""
    return subprocess.run(
        _cli(config_file, "--nproc", "2"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _losses(out: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(out / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_sigkill_and_resume_matches_an_uninterrupted_run(
    corpus: Path, tmp_path: Path, tp: int
) -> None:
    """2 ranks through torchrun, data- or tensor-parallel; the whole job (launcher and
    ranks) is SIGKILLed mid-run once a checkpoint has committed; the rerun resumes from
    the newest committed one and every loss equals the uninterrupted run's, bit for bit
    (under TP with the checkpoint's chunk plan)."""
    steps, every, kill_after = 30, 5, 12
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for out in (whole, cut):
        _write_toml(tmp_path / f"{out.name}.toml", corpus, out, steps, every, tp)

    done = _train_2_ranks(tmp_path / "whole.toml", env)
    assert done.returncode == 0, done.stdout + done.stderr
    reference = _losses(whole)
    assert [s for s, _, _ in reference] == list(range(1, steps + 1))

    job = subprocess.Popen(
        _cli(tmp_path / "cut.toml", "--nproc", "2"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and job.poll() is None:
            if _committed(cut) and any(s >= kill_after for s, _, _ in _losses(cut)):
                break
            time.sleep(0.005)
        assert job.poll() is None, "the job ended before it could be killed mid-run"
        _kill_tree(job.pid)
    finally:
        if job.poll() is None:
            _kill_tree(job.pid)
        job.wait(timeout=30)
    reached = max(s for s, _, _ in _losses(cut))
    assert kill_after <= reached < steps
    resumed_from = max(_committed(cut))
    assert resumed_from < steps

    again = _train_2_ranks(tmp_path / "cut.toml", env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from step {resumed_from}" in again.stdout, again.stdout[:600]
    assert _losses(cut) == reference  # every step, before and after the kill, exactly


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant at once (torchrun starts each rank in a
    session of its own, so the process group alone would miss the ranks)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in reversed(tree):  # the ranks (and their helpers) before the launcher
        with suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _committed(out: Path) -> list[int]:
    """Steps with a manifest (ms-ckpt's commit) under ``out/ckpt``."""
    return [int(p.parent.name[5:]) for p in (out / "ckpt").glob("step-*/manifest.json")]


class RecordingEngine(DDPEngine):
    """DDP's step engine (one rank: the model as it is), recording what the trainer
    hands it."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__("cpu")
        self.models: list[nn.Module] = []
        self.steps: list[tuple[int, float | None]] = []

    def setup(self, model, param_groups, make_optimizer) -> None:  # type: ignore[no-untyped-def]
        self.models.append(model)
        super().setup(model, param_groups, make_optimizer)

    def step(self, next_batch, loss_fn, *, grad_accum, max_norm):  # type: ignore[no-untyped-def]
        self.steps.append((grad_accum, max_norm))
        return super().step(next_batch, loss_fn, grad_accum=grad_accum, max_norm=max_norm)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_engine_is_swappable_and_reports_are_written(corpus: Path, tmp_path: Path) -> None:
    config = _config(
        corpus, tmp_path / "run", "train.steps=4", "train.sample_tokens=12", "data.global_batch=12"
    )
    engine = RecordingEngine()
    stream = io.StringIO()
    with Trainer(config, engine=engine, peak_flops=1e9, stream=stream) as trainer:
        summary = trainer.train()
    assert engine.models == [trainer.model] and trainer.optimizer is engine.optimizer
    assert summary.grad_accum == 3
    assert engine.steps == [(3, config.optim.clip_grad)] * 4
    out = tmp_path / "run"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sample = (out / "sample.txt").read_text()
    assert sample.startswith("def ") and summary.sample is not None
    saved = json.loads((out / "summary.json").read_text())
    assert saved["end_step"] == 4 and saved["tokens"] == 4 * 12 * 32
    assert saved["health_cost"] is None  # no heartbeats in this run
    text = stream.getvalue()
    for expected in ("checkpoint: none found", "tok/s", "MFU", "data-wait", "ETA", "summary"):
        assert expected in text, expected
    assert (out / "ckpt" / "step-00000004").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_bf16_autocast_on_cpu(corpus: Path, tmp_path: Path, block: str) -> None:
    config = _config(
        corpus, tmp_path, "train.steps=3", "train.precision=bf16", f"model.block={block}"
    )
    with Trainer(config, peak_flops=1e9, stream=io.StringIO()) as trainer:
        assert trainer.autocast_dtype == torch.bfloat16
        losses = [loss for _, loss in trainer.train().loss_history]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


class MemoryLoader:
    """The samples of the global stream, read up front: one process, no accumulation
    split, ``micro`` samples per batch, checkpointable by position."""

    def __init__(self, corpus: Path, config: Config) -> None:
        from ms_data import Corpus, PackedDataset

        dataset = PackedDataset(Corpus(str(corpus)), config.model.seq_len, seed=0, eos_id=256)
        self.micro = config.data.micro_batch
        self.samples = torch.stack(
            [torch.from_numpy(dataset.sample(g)) for g in range(self.micro * 64)]
        )
        self.position = 0

    def __next__(self) -> torch.Tensor:
        batch = self.samples[self.position : self.position + self.micro]
        self.position += self.micro
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_given_loader_replaces_the_node_loader(corpus: Path, tmp_path: Path) -> None:
    """The same samples through a loader given to the trainer train exactly the same
    model as the node loader; its state goes into the checkpoint and comes back."""
    config = _config(corpus, tmp_path / "node", "train.steps=6")
    reference = [loss for _, loss in _train(config)["losses"]]
    given = _config(corpus, tmp_path / "given", "train.steps=4")
    with Trainer(
        given, peak_flops=1e9, stream=io.StringIO(), loader=MemoryLoader(corpus, given)
    ) as t:
        first = [loss for _, loss in t.train().loss_history]
    longer = attrs.evolve(given, train=attrs.evolve(given.train, steps=6))
    loader = MemoryLoader(corpus, longer)
    stream = io.StringIO()
    with Trainer(longer, peak_flops=1e9, stream=stream, loader=loader) as t:
        rest = [loss for _, loss in t.train().loss_history]
    assert "data: a MemoryLoader given to the trainer" in stream.getvalue()
    assert "resumed from step 4" in stream.getvalue()
    assert loader.position == 6 * 8  # restored to 4 steps, then 2 more
    assert first + rest == reference


def test_trainer_refuses_what_it_cannot_run(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"parallel.pp = 2: this trainer runs data and tensor"):
        Trainer(_config(corpus, tmp_path, "parallel.pp=2"))
    with pytest.raises(ConfigError, match=r"world size \(1\) must be a multiple of parallel.tp"):
        Trainer(_config(corpus, tmp_path, "parallel.tp=2"))
    with pytest.raises(ConfigError, match=r"model.vocab_size \(100\) is smaller"):
        Trainer(_config(corpus, tmp_path, "model.vocab_size=100"))
    with pytest.raises(TypeError, match=r"config must be a ms_train\.Config"):
        Trainer({"model": {}})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="loader must be an iterator, got list"):
        Trainer(_config(corpus, tmp_path), loader=[1, 2])


def test_engines() -> None:
    parallel = load_config(None, preset="tiny").parallel
    zero = attrs.evolve(parallel, engine="zero")
    assert isinstance(make_engine(zero, torch.device("cpu")), ZeroEngine)
    ddp = attrs.evolve(parallel, engine="ddp")
    assert isinstance(make_engine(ddp, torch.device("cpu")), DDPEngine)
    with pytest.raises(ConfigError, match=r"parallel.engine must be one of"):
        attrs.evolve(parallel, engine="fsdp")


def test_metrics_log_keeps_the_steps_up_to_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(1, 8):
        log.write({"step": step, "loss": 1.0 / step})
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 8, "lo')  # torn by a kill
    assert [r["step"] for r in read_metrics(path)] == list(range(1, 8))
    MetricsLog(path, resume_at=5).close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    MetricsLog(path).close()
    assert read_metrics(path) == []


@pytest.mark.slow
def test_cli_trains_and_a_second_run_reuses_the_checkpoint(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ms_train.cli import main

    args = ["--preset", "tiny", *(a for o in SMALL for a in ("--set", o))]
    args += ["--set", f"data.shards={corpus}", "--set", f"train.out_dir={tmp_path}"]
    args += ["--peak-tflops", "0.1"]
    assert main([*args, "--set", "train.steps=3"]) == 0
    first = capsys.readouterr().out
    assert "starting fresh" in first and "3 -> " not in first
    assert main([*args, "--set", "train.steps=3"]) == 0
    assert "already reaches train.steps = 3; nothing to train" in capsys.readouterr().out
    assert main([*args, "--set", "train.steps=5"]) == 0
    assert "resumed from step 3" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert main([*args, "--set", "model.n_heads=3"]) == 2
    assert "model.n_heads must divide model.d_model" in capsys.readouterr().err
    assert main([*args, "--nproc", "3"]) == 2
    assert "data.global_batch (8) must be a multiple of" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
