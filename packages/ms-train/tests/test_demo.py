"""The demo corpus: the standard library's sources built into shards once, then reused,
also when several processes ask for it at the same moment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ms_data import Corpus
from ms_train.demo import CACHE_ENV, demo_corpus, stdlib_sources

_CALL = "from ms_train.demo import demo_corpus; print(demo_corpus())"


def test_sources_skip_tests_and_site_packages(tmp_path: Path) -> None:
    for rel in ("a.py", "pkg/b.py", "test/t.py", "site-packages/x/y.py", "pkg/tests/c.py", "d.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert [p.relative_to(tmp_path).as_posix() for p in stdlib_sources(tmp_path)] == [
        "a.py",
        "pkg/b.py",
    ]
    real = stdlib_sources()
    assert len(real) > 100 and any(p.name == "os.py" for p in real)


@pytest.mark.slow
def test_built_once_by_concurrent_processes_then_reused(tmp_path: Path) -> None:
    env = {**os.environ, CACHE_ENV: str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CALL], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    out = Path(outs[0])
    assert out.parent == tmp_path
    # One build: no temporary directory left, one set of shards.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [out.name]
    corpus = Corpus(str(out))
    assert corpus.n_docs > 100 and corpus.n_tokens > 1_000_000
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert demo_corpus(tmp_path) == out  # a second call reuses the cache
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp
