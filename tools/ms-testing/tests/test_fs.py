"""The counting filesystem counts exactly the bytes read, in this process and in others."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import pytest

from ms_testing import COUNTER_ENV, CountingFileSystem, read_counts, reset_counts


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    return path


def test_ranged_reads_count_exactly_what_was_asked(tmp_path: Path, data_file: Path) -> None:
    counter = tmp_path / "reads"
    fs = CountingFileSystem(counter=counter)
    assert fs.cat_file(str(data_file), 10, 110) == (bytes(range(256)) * 40)[10:110]
    assert fs.cat_file(str(data_file), start=-16) == data_file.read_bytes()[-16:]
    with fs.open(str(data_file), "rb") as f:
        f.seek(5000)
        assert len(f.read(3)) == 3
    counts = read_counts(counter)
    # unbuffered: a 3-byte read costs 3 bytes, not an 8 KiB buffer fill
    assert (counts.total, counts.calls) == (100 + 16 + 3, 3)
    assert counts.by_path == {str(data_file): 119}
    assert counts.by_pid == {os.getpid(): 119}
    reset_counts(counter)
    assert read_counts(counter).total == 0
    assert fs.cat_file(str(data_file)) == data_file.read_bytes()
    assert read_counts(counter).total == 10_240


def test_readline_iteration_and_copies_are_counted(tmp_path: Path) -> None:
    text = tmp_path / "lines.txt"
    text.write_text("one\ntwo\nthree\n")
    counter = tmp_path / "reads"
    fs = CountingFileSystem(counter=counter)
    with fs.open(str(text), "rb") as f:
        assert f.readline() == b"one\n"
        assert list(f) == [b"two\n", b"three\n"]
    assert read_counts(counter).total == 14
    with fs.open(str(text), "r") as f:  # text mode wraps the same counted file
        assert f.read() == "one\ntwo\nthree\n"
    assert read_counts(counter).total == 28
    fs.cp_file(str(text), str(tmp_path / "copy.txt"))
    assert read_counts(counter).total == 42


def test_writes_are_not_counted_and_urls_resolve(tmp_path: Path) -> None:
    counter = tmp_path / "reads"
    fs, path = fsspec.core.url_to_fs(f"counting://{tmp_path}/w.bin", counter=str(counter))
    assert isinstance(fs, CountingFileSystem) and path == f"{tmp_path}/w.bin"
    assert fs.unstrip_protocol(path) == f"counting://{tmp_path}/w.bin"
    fs.pipe_file(path, b"x" * 50)
    assert read_counts(counter).total == 0
    assert fs.cat_file(f"counting://{tmp_path}/w.bin") == b"x" * 50
    assert read_counts(counter).total == 50


def test_a_read_without_a_counter_is_refused(
    tmp_path: Path, data_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(COUNTER_ENV, raising=False)
    with pytest.raises(
        ValueError, match=f"needs a counter file: pass counter= or set {COUNTER_ENV}"
    ):
        CountingFileSystem().cat_file(str(data_file), 0, 1)


def _read_ranges(path: str, ranges: list[tuple[int, int]], rounds: int) -> None:
    fs = fsspec.filesystem("counting")  # the counter comes from the inherited environment
    for _ in range(rounds):
        for start, end in ranges:
            fs.cat_file(path, start, end)


@pytest.mark.slow
def test_reads_in_two_processes_add_up(
    tmp_path: Path, data_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = tmp_path / "reads"
    monkeypatch.setenv(COUNTER_ENV, str(counter))
    ranges = [[(0, 1000), (1000, 1001)], [(5000, 10_240), (7, 4096)]]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_read_ranges, args=(str(data_file), r, 100)) for r in ranges]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    counts = read_counts(counter)
    assert counts.total == 100 * sum(b - a for r in ranges for a, b in r)
    assert counts.calls == 100 * 4  # no record lost or torn by concurrent appends
    assert counts.by_pid == {
        p.pid: 100 * sum(b - a for a, b in r) for p, r in zip(procs, ranges, strict=True)
    }


@pytest.mark.slow
def test_a_fresh_interpreter_finds_the_protocol_through_the_entry_point(
    tmp_path: Path, data_file: Path
) -> None:
    counter = tmp_path / "reads"
    script = textwrap.dedent(
        """
        import sys, fsspec
        assert "ms_testing" not in sys.modules
        print(len(fsspec.open(sys.argv[1], "rb", counter=sys.argv[2]).open().read()))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, f"counting://{data_file}", str(counter)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "10240"
    assert read_counts(counter).total == 10_240
