"""``ms-train flops``: the paper's MFU from its own throughputs, through the preset."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ms_train.cli import main

# (GPUs, tokens/s, MFU reported) from the MegaScale paper, 175B, 312 TFLOP/s per GPU.
ROWS = [
    (3072, "433.6k", 48.7),
    (3072, "531.9k", 59.1),
    (6144, "851.6k", 47.8),
    (6144, "1030.9k", 57.3),
    (8192, "1027.9k", 43.3),
    (8192, "1315.6k", 54.9),
    (12288, "1466.8k", 41.2),
    (12288, "1984.0k", 55.2),
    (256, "39.3k", 53.0),
    (256, "49.0k", 65.3),
]


@pytest.mark.parametrize(("gpus", "rate", "paper"), ROWS)
def test_preset_175b_reproduces_the_papers_mfu(
    gpus: int, rate: str, paper: float, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["flops", "--preset", "gpt-175b", "--tokens-per-s", rate, "--gpus", str(gpus)]
    assert main([*argv, "--peak-tflops", "312", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["layers"] == 96 and report["model"]["hidden"] == 12288
    assert abs(report["throughput"]["mfu"] * 100 - paper) <= 1.0


def test_overrides_and_explicit_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["flops", "--preset", "gpt-175b", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["flops_per_token"]
    assert main(["flops", "--preset", "gpt-175b", "--set", "model.window=512", "--json"]) == 0
    windowed = json.loads(capsys.readouterr().out)["flops_per_token"]
    assert windowed["dense"] == full["dense"]
    assert windowed["attention"] == pytest.approx(full["attention"] * 512 / 2048)
    assert main(["flops", "--preset", "gpt-175b", "--layers", "48", "--json"]) == 0
    half = json.loads(capsys.readouterr().out)["flops_per_token"]
    assert half["dense"] == pytest.approx(full["dense"] / 2)


def test_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["flops", "--layers", "2"]) == 2
    assert "give --preset or --config" in capsys.readouterr().err
    assert main(["flops", "--preset", "gpt-175b", "--set", "model.n_layer=3"]) == 2
    assert "did you mean 'model.n_layers'" in capsys.readouterr().err
    assert main(["flops", "--preset", "nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert main(["--nproc", "0"]) == 2
    assert "--nproc" in capsys.readouterr().err


@pytest.mark.slow
def test_runs_as_a_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ms_train.cli", "flops", "--preset", "gpt-1b"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "total" in proc.stdout and "24 layers" in proc.stdout


def test_several_nodes_need_an_endpoint_and_an_id(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--nnodes", "2", "--rdzv-id", "job"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "ms-train: error: --nnodes 2 needs --rdzv-endpoint HOST:PORT and --rdzv-id ID, the "
        "same on every node\n"
    )
    assert main(["--max-restarts", "-1"]) == 2
    assert "--max-restarts: must be an int >= 0, got '-1'" in capsys.readouterr().err


def test_the_ranks_run_without_the_launchers_options() -> None:
    from ms_train.cli import _rank_argv

    argv = ["--nproc", "2", "--set", "a=1", "--nnodes=2", "--rdzv-endpoint", "h:1"]
    argv += ["--rdzv-id=x", "--max-restarts", "3", "--debug", "--health-diagnose"]
    argv += ["--health-min-gflops", "50", "--health-min-gbps=5", "--no-health"]
    assert _rank_argv(argv) == ["--set", "a=1", "--debug"]


def test_diagnostics_need_health(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--no-health", "--health-diagnose"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "ms-train: error: --health-diagnose needs --health (on by default with more than "
        "one rank)\n"
    )
    assert main(["--health-min-gflops", "50"]) == 2  # one rank: health is off by default
    assert "--health-min-gflops/-gbps needs --health" in capsys.readouterr().err
    assert main(["--health", "--health-min-gbps", "0"]) == 2
    assert "--health-min-gbps: must be a finite number > 0, got '0'" in capsys.readouterr().err


def test_the_command_and_a_config_error_import_neither_torch_nor_the_engines() -> None:
    """The launcher's module and a config error load no model, engine or torch: the
    package's public names load on first use."""
    probe = (
        "import sys, ms_train, ms_train.cli\n"
        "code = ms_train.cli.main(['--set', 'model.vocab_size=x'])\n"
        "heavy = [m for m in ('ms_parallel', 'ms_train.trainer', 'torch') if m in sys.modules]\n"
        "print(code, heavy)\n"
        "print(ms_train.Trainer.__module__, 'torch' in sys.modules)\n"
        "try:\n"
        "    ms_train.Trainr\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "2 []",
        "ms_train.trainer True",
        "module 'ms_train' has no attribute 'Trainr'",
    ], proc.stdout + proc.stderr
    assert "model.vocab_size must be an int >= 1, got 'x'" in proc.stderr
