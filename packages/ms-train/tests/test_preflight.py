"""Preflight through the ``ms-train`` command: each expected failure found before any
work is one line on stderr and exit status 2, with no model built and nothing trained;
``--debug`` adds the traceback; ``--dry-run`` prints the plan and stops.

"Not writable" is tested with what root also meets, since the tests run as root: a
regular file where a directory is expected, a path under a regular file, and a path
under ``/proc``, where nobody can create a file. A directory without write permission
(mode 0o555) is not tested: root writes there anyway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from ms_data import ShardReader, build_shards
from ms_data.build import BuildConfig
from ms_train.cli import main
from ms_train.config import ConfigError, load_config
from ms_train.errors import JobError
from ms_train.flops import model_flops_per_token
from ms_train.model import GPT

# A model small enough that a test that did get past preflight would finish quickly.
SMALL = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.seq_len=32",
    "model.window=16",
    "data.micro_batch=4",
    "data.global_batch=8",
    "train.steps=2",
    "train.sample_tokens=0",
    "checkpoint.every=0",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import argparse
    import textwrap

    out = tmp_path_factory.mktemp("corpus") / "shards"
    build_shards([argparse.__file__, textwrap.__file__], out, BuildConfig(tokenizer="bytes"))
    return out


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MS_TRAIN_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    # Whatever a test does, it never reads or rebuilds the user's demo cache.
    monkeypatch.setenv("MS_TRAIN_CACHE", str(tmp_path / "demo-cache"))


def _args(corpus: Path, out: Path, *extra: str) -> list[str]:
    sets = [*SMALL, f"data.shards={corpus}", f"train.out_dir={out}", *extra]
    return ["--peak-tflops", "0.1", *(a for s in sets for a in ("--set", s))]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *expected: str) -> str:
    """Run the command; it must fail with one ``ms-train: error:`` line naming
    ``expected``, before the trainer printed its header (the model is built first)."""
    code = main(argv)
    got = capsys.readouterr()
    assert code == 2, got.out + got.err
    lines = got.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ms-train: error: "), got.err
    for text in expected:
        assert text in lines[0]
    assert "ms-train: GPT" not in got.out and "step 1/" not in got.out
    return lines[0]


def _proc_is_unwritable() -> bool:
    try:
        Path("/proc", f".ms-train-test-{uuid.uuid4().hex}").write_bytes(b"")
    except OSError:
        return True
    return False


# ------------------------------------------------------------------ paths, one by one


@pytest.mark.parametrize("under", [False, True], ids=["the-file", "under-the-file"])
def test_out_dir_that_is_a_file(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], under: bool
) -> None:
    (tmp_path / "taken").write_text("not a directory\n")
    out = tmp_path / "taken" / "run" if under else tmp_path / "taken"
    expected = "cannot be created" if under else "is a regular file, expected a directory"
    _refused(capsys, _args(corpus, out), "train.out_dir", str(out), expected)
    assert (tmp_path / "taken").read_text() == "not a directory\n"


def test_checkpoint_dir_not_writable(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ckpt-file").write_bytes(b"")
    line = _refused(
        capsys,
        _args(corpus, tmp_path / "run", f"checkpoint.dir={tmp_path / 'ckpt-file'}"),
        "checkpoint.dir",
        "expected a directory",
    )
    assert str(tmp_path / "ckpt-file") in line
    # Found before the first save, i.e. before any training: no metrics were written.
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    if not _proc_is_unwritable():
        pytest.skip("a file could be created in /proc here")
    ckpt = f"/proc/ms-train-test-{uuid.uuid4().hex}/ckpt"
    _refused(
        capsys,
        _args(corpus, tmp_path / "run", f"checkpoint.dir={ckpt}"),
        "checkpoint.dir",
        ckpt,
        "'/proc' is not writable",
    )


def test_default_checkpoint_dir_is_checked(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt").write_text("")
    _refused(
        capsys,
        _args(corpus, tmp_path / "run"),
        "checkpoint.dir (<train.out_dir>/ckpt)",
        "is a regular file",
    )


def test_data_path_missing(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-shards"
    _refused(
        capsys,
        _args(corpus, tmp_path / "run", f"data.shards={missing}"),
        "data.shards",
        str(missing),
        "does not exist",
    )
    assert not (tmp_path / "run").exists()  # the probe created nothing


def test_data_dir_without_shards(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "texts"
    text.mkdir()
    (text / "a.txt").write_text("plain text, not shards\n")
    _refused(
        capsys,
        _args(corpus, tmp_path / "run", f"data.shards={text}"),
        "data.shards",
        str(text),
        "holds no *.mss shards",
    )
    not_a_shard = text / "fake.mss"
    not_a_shard.write_bytes(b"x" * 200)
    _refused(
        capsys,
        _args(corpus, tmp_path / "run", f"data.shards={not_a_shard}"),
        "data.shards",
        "not an ms-data shard",
    )


def test_tokenizer_file_missing(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "tokenizer.json"
    _refused(
        capsys,
        _args(corpus, tmp_path / "run", f"data.tokenizer={missing}"),
        "data.tokenizer",
        str(missing),
        "does not exist",
    )


def test_debug_shows_the_traceback(
    corpus: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = _args(corpus, tmp_path / "run", f"data.shards={tmp_path / 'none'}")
    for how in ("flag", "env"):
        if how == "env":
            monkeypatch.setenv("MS_TRAIN_DEBUG", "1")
        assert main([*argv, "--debug"] if how == "flag" else argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0] == "Traceback (most recent call last):"
        assert any("_preflight.py" in line for line in err)
        assert err[-1].startswith("ms-train: error: data.shards")
    monkeypatch.setenv("MS_TRAIN_DEBUG", "0")
    _refused(capsys, argv, "data.shards")


def test_library_use_raises_job_error(corpus: Path, tmp_path: Path) -> None:
    from ms_train.trainer import Trainer

    (tmp_path / "taken").write_text("")
    config = load_config(None, preset="tiny", overrides=[*SMALL, f"train.out_dir={tmp_path}/taken"])
    with pytest.raises(JobError, match=r"train.out_dir: .*taken' is a regular file"):
        Trainer(config)


# ------------------------------------------------------------------ values that make no sense


def test_window_longer_than_the_sequence_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"model.window \(256\) must not exceed model.seq_len"):
        load_config(None, preset="tiny", overrides=["model.window=256"])
    assert load_config(None, overrides=["model.window=128"]).model.window == 128
    _refused(capsys, ["--set", "model.window=129", "--dry-run"], "model.window (129)", "none")


def test_warmup_is_derived_from_the_run_length() -> None:
    def warmup(preset: str, *sets: str) -> int:
        return load_config(None, preset=preset, overrides=list(sets)).warmup_steps

    assert warmup("tiny") == 30  # 5% of 600, the demo's warm-up as before
    assert warmup("tiny", "train.steps=3") == 1
    assert warmup("tiny", "train.steps=100") == 5
    assert warmup("tiny", "train.steps=1200") == 30  # capped: a longer run keeps 30
    assert warmup("gpt-1b") == 2000
    assert warmup("tiny", "train.steps=3", "optim.warmup_steps=0") == 0
    assert warmup("tiny", "optim.warmup_steps=45") == 45
    with pytest.raises(ConfigError, match=r"optim.warmup_steps \(5\) must not exceed train.steps"):
        load_config(None, overrides=["train.steps=3", "optim.warmup_steps=5"])


# ------------------------------------------------------------------ --dry-run


def test_dry_run_prints_the_plan_and_stops(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main([*_args(corpus, out), "--nproc", "2", "--dry-run"]) == 0
    text = capsys.readouterr().out
    config = load_config(None, preset="tiny", overrides=[*SMALL, f"data.shards={corpus}"])
    params = GPT(config.model).num_parameters()
    per_step = model_flops_per_token(config.model).total * 8 * 32
    assert f"GPT {params:,} parameters" in text
    assert "2 rank(s)" in text and "data-parallel 2; micro-batch 4 x accumulation 1" in text
    assert f"FLOPs per step: {per_step:.4e}" in text
    assert "warm-up 1 (derived" in text and "none to resume" in text
    assert "ms-train: GPT" not in text  # the trainer never started
    assert not out.exists()


def test_dry_run_of_the_demo_builds_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["--set", f"train.out_dir={out}", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "embedded demo corpus, not built yet" in text
    assert not (tmp_path / "demo-cache").exists() and not out.exists()


# ------------------------------------------------------------------ runs (slow)


@pytest.mark.slow
def test_a_resumed_checkpoint_of_another_model_is_refused(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    # The tiny preset's model for 3 steps, without a warm-up override.
    tiny = [
        "--peak-tflops",
        "0.1",
        "--set",
        f"data.shards={corpus}",
        "--set",
        f"train.out_dir={out}",
    ]
    tiny += ["--set", "train.sample_tokens=0", "--set", "checkpoint.every=0"]
    tiny += ["--set", "optim.name=adamw"]  # LAMB's compiled first step takes a minute here
    assert main([*tiny, "--set", "train.steps=3"]) == 0
    assert "starting fresh" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["lr"] == pytest.approx(1e-2)  # warm-up 1: the peak rate at once
    steps = sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000003"]
    metrics = (out / "metrics.jsonl").read_bytes()

    line = _refused(
        capsys,
        [*tiny, "--set", "train.steps=6", "--set", "model.d_model=64"],
        f"checkpoint.dir '{out / 'ckpt'}'",
        "step 3 holds another model",
        "model/embed.tok_emb.weight is [257, 128] there, [257, 64] with this config",
        "model.d_model = 128 there, 64 here",
    )
    assert "\n" not in line
    _refused(
        capsys,
        [*tiny, "--set", "train.steps=6", "--set", "model.block=serial"],
        "this config has model/blocks.0.ln1.weight, the checkpoint does not",
    )
    assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("step-")) == steps
    assert (out / "metrics.jsonl").read_bytes() == metrics

    # What may change on resume does: the learning rate, the length.
    assert main([*tiny, "--set", "train.steps=5", "--set", "optim.lr=5e-3", "--dry-run"]) == 0
    assert "a run resumes from step 3" in capsys.readouterr().out


@pytest.mark.slow
def test_a_damaged_demo_cache_is_rebuilt_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ms_train.demo import demo_cache_damage, demo_corpus

    cache = demo_corpus()  # under the test's MS_TRAIN_CACHE
    shard = next(cache.glob("*.mss"))
    reader = ShardReader(str(shard))
    chunk = reader.n_chunks // 2
    at = int(reader.chunk_table[chunk]["offset"]) + int(reader.chunk_table[chunk]["length"]) // 2
    with open(shard, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert f"chunk {chunk} is corrupt" in str(demo_cache_damage(cache))

    out = tmp_path / "run"
    argv = ["--peak-tflops", "0.1", *(a for s in SMALL for a in ("--set", s))]
    assert main([*argv, "--set", f"train.out_dir={out}"]) == 0
    got = capsys.readouterr()
    assert "the demo corpus cache is damaged" in got.err and f"chunk {chunk}" in got.err
    assert f"rebuilding {cache}" in got.err
    assert "step 2/2" in got.out
    assert demo_cache_damage(cache) is None


@pytest.mark.slow
def test_a_shard_damaged_after_preflight_ends_the_run_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    shards = tmp_path / "shards"
    build_shards([argparse.__file__], shards, BuildConfig(tokenizer="bytes", chunk_tokens=1024))
    shard = next(shards.glob("*.mss"))
    reader = ShardReader(str(shard))
    # Every chunk's payload damaged, the index intact: preflight opens the shard fine,
    # the first batch meets a damaged chunk.
    with open(shard, "r+b") as f:
        for entry in reader.chunk_table:
            f.seek(int(entry["offset"]) + int(entry["length"]) // 2)
            f.write(b"\x00\xff\x00\xff")
    code = main(_args(shards, tmp_path / "run"))
    got = capsys.readouterr()
    assert code == 2, got.err
    lines = got.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ms-train: error: data.shards"), got.err
    assert "a shard is damaged" in lines[0] and "is corrupt" in lines[0]


@pytest.mark.slow
def test_preflight_error_on_two_ranks_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("")
    cmd = [sys.executable, "-m", "ms_train.cli", "--nproc", "2"]
    cmd += ["--set", f"train.out_dir={tmp_path / 'taken'}", "--set", "train.steps=2"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"ms-train: error: train.out_dir: '{tmp_path / 'taken'}' is a regular file, expected "
        "a directory"
    ]
    assert proc.stdout == ""  # no rank started: no header, no torchrun output


def _preflight_rank(configs: list[Any]) -> int | None:
    import torch.distributed as dist

    from ms_train._preflight import preflight

    resume = preflight(configs[dist.get_rank()]).resume_step
    dist.barrier()  # both ranks got here: neither waits in a collective of preflight's
    return resume


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_preflight_under_a_process_group_enters_no_collective(corpus: Path, tmp_path: Path) -> None:
    """Ranks whose process group is already up (a library user's, or a test's) may see
    the checkpoint directory differently at preflight: rank 0 locks, and so creates, it
    before a slower rank checks it. Preflight must then not build a Checkpointer (a
    collective). Here rank 1's directory holds a committed step, rank 0's does not exist:
    before the fix rank 1 waited in ms-ckpt's all-gather until the deadline."""
    from ms_ckpt import Checkpointer
    from ms_testing.dist import run_ranks

    configs = [
        load_config(overrides=[*SMALL, f"data.shards={corpus}", f"train.out_dir={tmp_path / d}"])
        for d in ("fresh", "resumed")
    ]
    ckpt = Checkpointer(str(tmp_path / "resumed" / "ckpt"), stage2="inline")
    ckpt.save(3, {"model": GPT(configs[1].model).state_dict()})
    ckpt.finalize()
    assert run_ranks(_preflight_rank, 2, args=(configs,), timeout=90) == [None, 3]
