"""The embedded demo's corpus: the Python standard library's own source, as ms-data shards.

No download: every Python installation carries its standard library. The ``.py`` files
under ``sysconfig``'s ``stdlib`` directory (without ``site-packages`` and the
``test`` package) are tokenized as bytes by ``ms_data.build_shards`` on first use and
cached; later runs reuse the cache after checking it: every chunk's checksum is
verified (about 40 ms for the 12M-token corpus), and a damaged cache is rebuilt, with a
line saying so, rather than failing a run part-way through.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["CACHE_ENV", "demo_cache_damage", "demo_cache_dir", "demo_corpus", "stdlib_sources"]

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


def demo_cache_dir(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where the demo's shards are (or will be) cached, built or not."""
    root = Path(cache) if cache is not None else _cache_root()
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return root / f"stdlib-{py}-bytes-c{_CHUNK_TOKENS}"


def demo_cache_damage(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with the built cache at ``path`` (its manifest, a shard's header,
    index or any chunk's checksum), or None when it is intact."""
    from ms_data import ShardError, ShardReader

    out = Path(path)
    try:
        manifest = json.loads((out / "manifest.json").read_text())
        listed = {str(e["name"]): int(e["n_tokens"]) for e in manifest["shards"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{out / 'manifest.json'} is unreadable: {e}"
    found = {p.name for p in out.glob("*.mss")}
    if found != set(listed):
        return f"{out} holds shards {sorted(found)}, its manifest lists {sorted(listed)}"
    for name, n_tokens in sorted(listed.items()):
        try:
            reader = ShardReader(str(out / name))
            bad = reader.verify()
        except (OSError, ShardError) as e:
            return str(e)
        if bad:
            more = f" (and {len(bad) - 1} more damaged chunks)" if len(bad) > 1 else ""
            return f"{bad[0]}{more}"
        if reader.n_tokens != n_tokens:
            return f"{reader.path} holds {reader.n_tokens} tokens, its manifest says {n_tokens}"
    return None


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def demo_corpus(
    cache: str | os.PathLike[str] | None = None,
    *,
    progress: bool = False,
    verify: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The directory of the demo's shards, building it first if it is not cached.

    With ``verify`` a cached copy is checked first (``demo_cache_damage``) and rebuilt
    when damaged; ``log`` (default: stderr) gets a line saying so. Safe to call from
    several processes at once: one builds (into a temporary directory, renamed into
    place when complete), the others wait and reuse it.
    """
    out = demo_cache_dir(cache)
    root, name = out.parent, out.name
    say = _stderr if log is None else log
    built = (out / "manifest.json").is_file()
    if built and (not verify or demo_cache_damage(out) is None):
        return out
    with _locked(root / f".{name}.lock"):
        if (out / "manifest.json").is_file():  # another process may have built it meanwhile
            damage = demo_cache_damage(out) if verify else None
            if damage is None:
                return out
            say(f"ms-train: the demo corpus cache is damaged ({damage}); rebuilding {out}")
        from ms_data.build import BuildConfig, build_shards

        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            build_shards(
                [str(p) for p in stdlib_sources()],
                tmp / "shards",
                BuildConfig(tokenizer="bytes", chunk_tokens=_CHUNK_TOKENS),
                progress=progress,
            )
            if out.exists():  # a damaged cache, or the leftover of a crashed build
                # Moved aside first: a reader holding its files open keeps reading them.
                out.rename(tmp / "old")
            (tmp / "shards").rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
