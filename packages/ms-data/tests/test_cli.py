"""``ms-data build`` and ``ms-data inspect`` end to end, in subprocesses, with exit codes."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from ms_data.build import MANIFEST_NAME, shard_name
from ms_data.cli import main
from ms_data.shard import Corpus, ShardReader

STDLIB_JSON = Path(sysconfig.get_paths()["stdlib"]) / "json"
EOS = 256


def ms_data(*args: str, stderr: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ms_data.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("cli") / "json-shards"
    proc = ms_data(
        "build", STDLIB_JSON, "--glob", "*.py", "--out", out, "--workers", "2",
        "--docs-per-shard", "2", "--chunk-tokens", "4096",
    )  # fmt: skip
    return out, proc


def test_build_from_a_directory_of_the_standard_library(
    built: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, proc = built
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # not a terminal: no progress bar
    files = sorted(STDLIB_JSON.glob("*.py"))
    n_shards = -(-len(files) // 2)
    text = proc.stdout
    assert f"built {n_shards} shard(s) in {out}" in text
    raw = sum(f.stat().st_size for f in files)
    tokens = raw + len(files)
    shard_bytes = sum(p.stat().st_size for p in out.glob("*.mss"))
    for line in (
        f"documents     {len(files):,}",
        f"tokens        {tokens:,} (uint16, tokenizer bytes)",
        f"shards        {n_shards}",
        f"bytes         {shard_bytes:,}",
        f"compression   {2 * tokens / shard_bytes:.2f}x",
        "empty inputs  0 skipped",
    ):
        assert line in text, (line, text)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert (manifest["n_docs"], manifest["n_tokens"]) == (len(files), tokens)
    corpus = Corpus(out)
    assert corpus.urls == [str(out / shard_name(i)) for i in range(n_shards)]
    for d, f in enumerate(files):
        assert corpus.read_document(d).tolist() == [*f.read_bytes(), EOS]


def test_build_jsonl_with_field_and_no_eos(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text('{"body": "alpha"}\n{"body": ""}\n{"body": "beta"}\n')
    proc = ms_data("build", src, "--out", tmp_path / "out", "--jsonl-field", "body", "--no-eos")
    assert proc.returncode == 0, proc.stderr
    assert "empty inputs  1 skipped" in proc.stdout
    corpus = Corpus(tmp_path / "out")
    assert [bytes(corpus.read_document(d).tolist()) for d in range(2)] == [b"alpha", b"beta"]


def test_inspect_clean_and_damaged_shards(
    built: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    out, _ = built
    proc = ms_data("inspect", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = ShardReader(out / shard_name(0))
    lengths = first.doc_lengths()
    for line in (
        str(out / shard_name(0)),
        f"format      version 1, uint16 tokens, 4,096 tokens per chunk, {first.n_chunks} chunks",
        f"documents   2 (mean {lengths.mean():,.1f} tokens, max {lengths.max():,}, 0 empty)",
        f"tokens      {first.n_tokens:,}",
        f"chunks      all {first.n_chunks} verified",
    ):
        assert line in proc.stdout, (line, proc.stdout)
    assert "total:" in proc.stdout and "DAMAGED" not in proc.stdout

    # Damage a copy: one flipped bit in chunk 1 of one shard, and a truncated other shard.
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in out.glob("*.mss"):
        (bad / p.name).write_bytes(p.read_bytes())
    victim = bad / shard_name(0)
    chunk = first.chunk_table[1]
    data = bytearray(victim.read_bytes())
    data[int(chunk["offset"]) + 5] ^= 0x04
    victim.write_bytes(bytes(data))
    cut = bad / shard_name(1)
    cut.write_bytes(cut.read_bytes()[:-10])

    proc = ms_data("inspect", bad / "*.mss")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = proc.stdout
    assert f"chunks      1 of {first.n_chunks} DAMAGED:" in text
    assert f"chunk 1 at byte offset {int(chunk['offset'])}: chunk 1 is corrupt: crc32" in text
    assert "DAMAGED: 2 problem(s):" in text
    assert f"{victim}: chunk 1 is corrupt" in text
    assert f"{cut}: no footer magic" in text and "truncated" in text
    assert "Traceback" not in proc.stderr


def test_bad_arguments_and_inputs_exit_2_with_a_message(tmp_path: Path) -> None:
    proc = ms_data("build", tmp_path / "missing.txt", "--out", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"ms-data build: error: input '{tmp_path / 'missing.txt'}' does not exist"
    )
    proc = ms_data("inspect", tmp_path / "absent.mss")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "ms-data inspect: error:" in proc.stderr and "absent.mss" in proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["build", "x", "--out", "o", "--docs-per-shard", "1", "--tokens-per-shard", "2"],
         "not allowed with argument"),
        (["build", "x"], "the following arguments are required: --out"),
        (["build", "x", "--out", "o", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["build", "x", "--out", "o", "--workers", "two"], "invalid int value: 'two'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)  # fmt: skip
def test_argument_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "workers must be an int >= 1, got 0"),
        (["--tokenizer", "nope.json"], "tokenizer must be 'bytes' or the path"),
        (["--level", "40"], "level must be a zstd level"),
        (["--glob", "*.nothing"], "holds no files matching '*.nothing'"),
    ],
)
def test_option_errors_exit_2_naming_the_option(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text")
    code = main(["build", str(tmp_path / "src"), "--out", str(tmp_path / "out"), *args])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("ms-data build: error: ") and message in err, err


def test_progress_bar_only_on_a_terminal(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("hello " * 100)
    for quiet in (False, True):
        leader, follower = pty.openpty()
        try:
            args = ["build", src, "--out", tmp_path / f"out{quiet}"] + (
                ["--quiet"] if quiet else []
            )
            proc = ms_data(*args, stderr=follower)
            os.close(follower)
            bar = b""
            while True:
                # The build has exited: whatever it wrote is there, then EIO or EOF.
                ready, _, _ = select.select([leader], [], [], 30)
                assert ready, "the terminal neither delivers output nor reports its end"
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the terminal's other end is closed
                    break
                if not chunk:
                    break
                bar += chunk
        finally:
            os.close(leader)
        assert proc.returncode == 0
        if quiet:
            assert bar == b""
        else:
            assert bar.startswith(b"\r100% [") and b"1 docs" in bar and bar.endswith(b"\n"), bar


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("ms-data")
    proc = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: ms-data" in proc.stdout and "inspect" in proc.stdout, proc.stdout


def test_inspect_reports_empty_documents(tmp_path: Path) -> None:
    from ms_data.shard import ShardWriter

    with ShardWriter(tmp_path / "s.mss") as w:
        for d in ([], [1, 2, 3], []):
            w.add_document(np.array(d, np.uint16))
    proc = ms_data("inspect", tmp_path / "s.mss")
    assert proc.returncode == 0
    assert "documents   3 (mean 1.0 tokens, max 3, 2 empty)" in proc.stdout
