"""The embedded demo's corpus: the Python standard library's own source, as ms-data shards.

No download: every Python installation carries its standard library. The ``.py`` files
under ``sysconfig``'s ``stdlib`` directory (without ``site-packages`` and the
``test`` package) are tokenized as bytes by ``ms_data.build_shards`` on first use and
cached; later runs reuse the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CACHE_ENV", "demo_corpus", "stdlib_sources"]

#: Overrides the cache directory (default: ``$XDG_CACHE_HOME/ms-train`` or
#: ``~/.cache/ms-train``).
CACHE_ENV = "MS_TRAIN_CACHE"

# Small chunks keep shuffled reads cheap: each sample decompresses one chunk, and at
# 64k tokens that was 55% of a sample's cost. In the cache's name, so a cache built
# with another chunk size is not reused.
_CHUNK_TOKENS = 8192

_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_sources(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted (so every build is the same)."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in base.rglob("*.py")
        if not _SKIP.intersection(p.relative_to(base).parts[:-1]) and p.is_file()
    ]
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library directory {base}")
    return sorted(files)


def _cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ms-train"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (other processes building the same cache wait)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def demo_corpus(cache: str | os.PathLike[str] | None = None, *, progress: bool = False) -> Path:
    """The directory of the demo's shards, building it first if it is not cached.

    Safe to call from several processes at once: one builds (into a temporary
    directory, renamed into place when complete), the others wait and reuse it.
    """
    root = Path(cache) if cache is not None else _cache_root()
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    name = f"stdlib-{py}-bytes-c{_CHUNK_TOKENS}"
    out = root / name
    if (out / "manifest.json").is_file():
        return out
    with _locked(root / f".{name}.lock"):
        if (out / "manifest.json").is_file():  # another process built it meanwhile
            return out
        from ms_data.build import BuildConfig, build_shards

        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            build_shards(
                [str(p) for p in stdlib_sources()],
                tmp / "shards",
                BuildConfig(tokenizer="bytes", chunk_tokens=_CHUNK_TOKENS),
                progress=progress,
            )
            if out.exists():  # an incomplete leftover of a crashed build
                shutil.rmtree(out)
            (tmp / "shards").rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
