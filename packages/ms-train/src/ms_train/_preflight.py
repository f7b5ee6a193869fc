"""Preflight: what a run must have before any expensive work starts.

``preflight(config)`` runs before the model is built and, from the ``ms-train`` command,
in the launcher before any rank starts. It checks, in this order, and raises a one-line
``JobError`` naming the field, the path, what was expected and what was found:

1. the run is one this trainer can run (``parallel.pp``, ``train.device``);
2. ``train.out_dir`` and the checkpoint directory are writable directories, or can be
   created: a probe file is written and removed in the directory, or in its nearest
   existing parent when it does not exist yet (nothing is created);
3. ``data.tokenizer`` loads and fits ``model.vocab_size``;
4. ``data.shards`` exists and holds ms-data shards (headers, footers and indexes read);
   the embedded demo corpus is built when missing, and its cache verified chunk by chunk
   and rebuilt when damaged (``ms_train.demo.demo_corpus``);
5. a checkpoint that would be resumed holds the model this config builds: the same
   parameter names and shapes, read from the newest committed step's manifest (ms-ckpt
   docs/format.md) against the model built on the meta device. Other fields (the
   learning rate, the window, the batch) may change between a run and its resumption.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import attrs
import fsspec
from fsspec.implementations.local import LocalFileSystem

from ms_train._tensorboard import require_tensorboard
from ms_train.config import Config, ConfigError
from ms_train.errors import JobError

__all__ = ["Preflight", "preflight"]


@attrs.frozen(kw_only=True)
class Preflight:
    """What preflight found.

    Attributes:
        checkpoint_dir: the checkpoint root the run uses.
        data: the data in words (documents, tokens, source), or None when not checked.
        resume_step: the committed step a run would resume from, or None.
    """

    checkpoint_dir: str
    data: str | None
    resume_step: int | None


def preflight(config: Config, *, data: bool = True, build_demo: bool = True) -> Preflight:
    """Check ``config``'s paths, data, tokenizer and checkpoint; raise ``JobError``.

    Args:
        config: the run.
        data: check ``data.shards`` (off when the caller brings its own loader).
        build_demo: with ``data.shards = ""``, build the demo corpus when it is not cached
            and rebuild a damaged cache; off (``--dry-run``): only say what a run would do.
    """
    _runnable(config)
    if config.train.tensorboard:
        require_tensorboard()
    out_dir = config.train.out_dir
    checkpoint_dir = config.checkpoint.dir or str(Path(out_dir) / "ckpt")
    _writable_dir("train.out_dir", out_dir)
    _writable_dir(
        "checkpoint.dir" if config.checkpoint.dir else "checkpoint.dir (<train.out_dir>/ckpt)",
        checkpoint_dir,
    )
    _tokenizer(config)
    described = _data(config, build_demo) if data else None
    step = _resume_step(config, checkpoint_dir)
    return Preflight(checkpoint_dir=checkpoint_dir, data=described, resume_step=step)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ------------------------------------------------------------------------- the run


def _runnable(config: Config) -> None:
    p = config.parallel
    if p.pp > 1:
        raise ConfigError(
            f"parallel.pp = {p.pp}: this trainer runs data and tensor parallelism; the "
            "pipeline engine is not wired in yet; set parallel.pp = 1"
        )
    if config.train.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("train.device is 'cuda' but CUDA is not available here")


# ------------------------------------------------------------------------- directories


def _kind(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        return "broken symbolic link"
    if path.is_file():
        return "regular file"
    return "special file" if path.exists() else "missing path"


def _writable_dir(field: str, url: str) -> None:
    """``url`` is a directory this process can write in, or one it can create."""
    fs, path = fsspec.core.url_to_fs(url)
    if isinstance(fs, LocalFileSystem):
        _writable_local_dir(field, url, Path(path))
    else:
        _writable_remote_dir(field, url, fs, path)


def _writable_local_dir(field: str, url: str, path: Path) -> None:
    try:
        target = path
        while not target.exists() and not target.is_symlink() and target != target.parent:
            target = target.parent
        if not target.is_dir():
            if target == path:
                raise JobError(f"{field}: {url!r} is a {_kind(path)}, expected a directory")
            raise JobError(
                f"{field}: {url!r} cannot be created: {str(target)!r} is a {_kind(target)}, "
                "not a directory"
            )
        fd, probe = tempfile.mkstemp(prefix=".ms-train-probe-", dir=target)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = e.strerror or _one_line(e)
        if target == path:
            raise JobError(
                f"{field}: {url!r} is not a writable directory (creating a file in it "
                f"failed: {reason})"
            ) from e
        raise JobError(
            f"{field}: {url!r} cannot be created: its nearest existing parent "
            f"{str(target)!r} is not writable (creating a file in it failed: {reason})"
        ) from e


def _writable_remote_dir(field: str, url: str, fs: Any, path: str) -> None:
    try:
        if fs.exists(path) and not fs.isdir(path):
            raise JobError(f"{field}: {url!r} is a file, expected a directory")
        probe = f"{path.rstrip('/')}/.ms-train-probe-{uuid.uuid4().hex[:12]}"
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except JobError:
        raise
    except Exception as e:  # each fsspec backend has its own errors: all mean "cannot"
        raise JobError(
            f"{field}: cannot write under {url!r} ({type(e).__name__}: {_one_line(e)})"
        ) from e


# ------------------------------------------------------------------------- tokenizer, data


def _tokenizer(config: Config) -> None:
    from ms_data import get_tokenizer

    spec = config.data.tokenizer
    expected = "expected 'bytes' or the path of a Hugging Face tokenizer.json"
    if spec != "bytes":
        path = Path(spec)
        if not path.exists():
            raise JobError(f"data.tokenizer: {spec!r} does not exist ({expected})")
        if not path.is_file():
            raise JobError(f"data.tokenizer: {spec!r} is not a file ({expected})")
    try:
        tokenizer = get_tokenizer(spec)
    except ImportError as e:
        raise JobError(f"data.tokenizer: {_one_line(e)}") from e
    except Exception as e:  # `tokenizers` raises plain Exception on a malformed file
        raise JobError(f"data.tokenizer: cannot load {spec!r}: {_one_line(e)}") from e
    m = config.model
    if tokenizer.vocab_size > m.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({m.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}, data.tokenizer = {spec!r})"
        )


def _data(config: Config, build_demo: bool) -> str:
    from ms_data import Corpus, ShardError

    shards = config.data.shards
    if not shards:
        return _demo(build_demo)
    expected = "expected a directory of ms-data shards, a shard file or a glob"
    fs, path = fsspec.core.url_to_fs(shards)
    try:
        if not any(ch in path for ch in "*?[") and not fs.exists(path):
            raise JobError(f"data.shards: {shards!r} does not exist ({expected})")
        corpus = Corpus(shards)
    except JobError:
        raise
    except ShardError as e:
        raise JobError(f"data.shards: {_one_line(e)} (expected an ms-data shard)") from e
    except ValueError as e:  # no shards in a directory or glob
        raise JobError(f"data.shards: {_one_line(e)} ({expected}; `ms-data build`)") from e
    except OSError as e:
        raise JobError(f"data.shards: cannot read {shards!r}: {_one_line(e)}") from e
    if corpus.n_tokens == 0:
        raise JobError(f"data.shards: {shards!r} holds no tokens ({len(corpus.shards)} shards)")
    return (
        f"{corpus.n_docs} documents, {corpus.n_tokens:,} tokens in {len(corpus.shards)} "
        f"shard(s) ({shards})"
    )


def _demo(build: bool) -> str:
    from ms_train.demo import demo_cache_damage, demo_cache_dir, demo_corpus

    where = demo_cache_dir()
    if build:
        try:
            demo_corpus(progress=True)
        except OSError as e:
            raise JobError(
                f"the demo corpus cannot be built under {str(where.parent)!r} "
                f"({_one_line(e)}); set MS_TRAIN_CACHE to a writable directory"
            ) from e
        return f"embedded demo corpus, verified ({where})"
    if not (where / "manifest.json").is_file():
        return f"embedded demo corpus, not built yet: a run builds it first ({where})"
    damage = demo_cache_damage(where)
    if damage is not None:
        return f"embedded demo corpus, damaged ({damage}): a run rebuilds it ({where})"
    return f"embedded demo corpus, verified ({where})"


# ------------------------------------------------------------------------- checkpoint


def _resume_step(config: Config, checkpoint_dir: str) -> int | None:
    """The step a run would resume from, after checking it holds this config's model."""
    if not config.checkpoint.resume:
        return None
    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    if not fs.exists(root):
        return None
    from ms_ckpt import committed_steps

    # No Checkpointer: with a process group up, building one is a collective, and the
    # ranks may not agree on whether the directory exists yet (rank 0 may have locked,
    # and so created, it already).
    steps = committed_steps(root, fs=fs)
    if not steps:
        return None
    step = steps[-1]
    saved = _saved_model_shapes(fs, root, step)
    if saved is not None:
        _same_model(config, checkpoint_dir, step, saved)
    return step


def _saved_model_shapes(fs: Any, root: str, step: int) -> dict[str, tuple[int, ...]] | None:
    """``model/...`` tensor shapes of a committed step, or None when the manifest cannot
    say (damaged, another format, a tensor/pipeline-parallel checkpoint): loading
    reports those itself, and falls back to an older step where it can."""
    try:
        manifest = json.loads(fs.cat_file(f"{root.rstrip('/')}/step-{step:08d}/manifest.json"))
        if manifest.get("format") != "ms-ckpt" or len(manifest["parts"]) != 1:
            return None
        shapes: dict[str, tuple[int, ...]] = {}
        for rec in manifest["records"]:
            key = rec["key"]
            if rec["kind"] == "tensor" and key.startswith("model/"):
                shape = rec["shard"]["global_shape"] if "shard" in rec else rec["shape"]
                shapes[key] = tuple(int(n) for n in shape)
        return shapes
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _model_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    from ms_train.model import GPT

    model = GPT(config.model, device="meta")
    return {f"model/{k}": tuple(v.shape) for k, v in model.state_dict().items()}


def _same_model(
    config: Config, checkpoint_dir: str, step: int, saved: dict[str, tuple[int, ...]]
) -> None:
    from ms_train.model import upgrade_state_dict

    expected = _model_shapes(config)
    saved = dict(saved)
    upgrade_state_dict(saved, config.model.n_heads, prefix="model/")  # 0.4's names
    changed = [k for k in expected if k in saved and saved[k] != expected[k]]
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    differences = [
        *(f"{k} is {list(saved[k])} there, {list(expected[k])} with this config" for k in changed),
        *(f"this config has {k}, the checkpoint does not" for k in missing),
        *(f"the checkpoint has {k}, this config does not" for k in extra),
    ]
    if not differences:
        return
    more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
    raise JobError(
        f"checkpoint.dir {checkpoint_dir!r}: step {step} holds another model than this "
        f"config builds: {differences[0]}{more}{_config_hint(config)}; resume with the "
        "model config it was saved with, or train into another train.out_dir or "
        "checkpoint.dir"
    )


def _config_hint(config: Config) -> str:
    """Which model fields differ from the config.json a run wrote in ``train.out_dir``."""
    path = Path(config.train.out_dir) / "config.json"
    try:
        before = json.loads(path.read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    now = attrs.asdict(config.model)
    fields = [k for k in now if k in before and before[k] != now[k]]
    if not fields:
        return ""
    said = ", ".join(f"model.{k} = {before[k]!r} there, {now[k]!r} here" for k in fields)
    return f"; {path} says {said}"
