"""Tokenizing a build's inputs: files to tasks, tasks to token arrays, in a process pool.

A task is a text file, or the lines of a JSONL file that start in a byte range (a
line belongs to the piece its first byte lies in, as in Hadoop's input splits), so a
large JSONL file still keeps every worker busy. Results come back in task order,
whatever order the workers finish in.
"""

from __future__ import annotations

import fnmatch
import json
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ms_data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer

__all__ = ["BuildError", "Result", "Task", "input_files", "make_tasks", "results"]

_JSONL_SUFFIXES = (".jsonl", ".ndjson")


class BuildError(ValueError):
    """The inputs or options cannot be built; the message names the input and position."""


@dataclass(frozen=True)
class Task:
    """Tokenize one text file, or the JSONL lines that start in ``[start, end)``."""

    path: str
    jsonl: bool
    start: int
    end: int
    tokenizer: str
    dtype: str
    field: str
    eos: bool


@dataclass(frozen=True)
class Result:
    """What one task produced, as two arrays: cheap to send back from a worker."""

    tokens: np.ndarray  # every document of the task, concatenated, end-of-document ids included
    lengths: np.ndarray  # int64 tokens per document
    n_empty: int
    nbytes: int


def input_files(inputs: Sequence[str | os.PathLike[str]], pattern: str | None) -> list[Path]:
    """Files in input order; directories walked in sorted order, hidden entries skipped."""
    files: list[Path] = []
    if not inputs:
        raise BuildError("no inputs given: name text files, directories or JSONL files")
    for item in inputs:
        path = Path(item)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    if name.startswith(".") or (pattern and not fnmatch.fnmatch(name, pattern)):
                        continue
                    found.append(Path(root) / name)
            if not found:
                what = f"files matching {pattern!r}" if pattern else "files"
                raise BuildError(f"input directory {str(path)!r} holds no {what}")
            files += found
        else:
            raise BuildError(f"input {str(path)!r} does not exist")
    return files


def make_tasks(
    files: list[Path], *, tokenizer: str, dtype: str, field: str, eos: bool, piece_bytes: int
) -> list[Task]:
    """One task per text file; JSONL files cut into pieces of about ``piece_bytes``."""
    tasks = []
    for path in files:
        size = path.stat().st_size
        jsonl = path.name.endswith(_JSONL_SUFFIXES)
        step = piece_bytes if jsonl else max(size, 1)
        for start in range(0, max(size, 1), step):
            end = min(start + step, size)
            tasks.append(
                Task(
                    str(path),
                    jsonl,
                    start,
                    end,
                    tokenizer,
                    dtype,
                    field,
                    eos,
                )
            )
    return tasks


_TOKENIZERS: dict[str, Tokenizer] = {}  # per process: workers load each tokenizer once


def _encode(tok: Tokenizer, text: str, task: Task, where: str) -> np.ndarray:
    if isinstance(tok, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), np.uint8)  # skips a list of ints
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    hi = int(np.iinfo(task.dtype).max)
    if ids.size and (ids.min() < 0 or ids.max() > hi):
        bad = int(ids[np.argmax((ids < 0) | (ids > hi))])
        raise BuildError(f"{where}: token id {bad} does not fit {task.dtype} (0..{hi})")
    return ids


def _run_task(task: Task) -> Result:
    """Tokenize one task; runs in a pool worker (or in the main process for workers=1)."""
    tok = _TOKENIZERS.get(task.tokenizer)
    if tok is None:
        tok = _TOKENIZERS[task.tokenizer] = get_tokenizer(task.tokenizer)
    eos = np.array([tok.eos_id if tok.eos_id is not None else 0], task.dtype)
    docs: list[np.ndarray] = []
    lengths: list[int] = []
    n_empty = 0

    def add(ids: np.ndarray) -> None:
        nonlocal n_empty
        if ids.size == 0:
            n_empty += 1
            return
        docs.append(ids.astype(task.dtype, copy=False))
        if task.eos:
            docs.append(eos)
        lengths.append(ids.size + int(task.eos))

    if not task.jsonl:
        data = Path(task.path).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BuildError(
                f"{task.path}: not UTF-8 text ({e.reason} at byte {e.start}); choose text "
                f"files with --glob"
            ) from None
        add(_encode(tok, text, task, task.path))
        nbytes = len(data)
    else:
        nbytes = 0
        for pos, line in _jsonl_lines(task.path, task.start, task.end):
            nbytes += len(line)
            where = f"{task.path}, line at byte {pos}"
            add(_encode(tok, _jsonl_text(line, task.field, where), task, where))
    tokens = np.concatenate(docs) if docs else np.empty(0, task.dtype)
    return Result(tokens, np.array(lengths, np.int64), n_empty, nbytes)


def _jsonl_lines(path: str, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) for each line of the file that starts in ``[start, end)``."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line in progress at start belongs to the previous piece
        pos = f.tell()
        while pos < end:
            line = f.readline()
            if not line:
                break
            yield pos, line
            pos += len(line)


def _jsonl_text(line: bytes, key: str, where: str) -> str:
    if not line.strip():
        return ""
    try:
        record = json.loads(line)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise BuildError(f"{where}: not a JSON record ({e})") from None
    if not isinstance(record, dict) or key not in record:
        raise BuildError(f"{where}: the record has no field {key!r} (choose it with --jsonl-field)")
    text = record[key]
    if not isinstance(text, str):
        raise BuildError(f"{where}: field {key!r} is {type(text).__name__}, expected a string")
    return text


def results(tasks: list[Task], workers: int) -> Iterator[Result]:
    """Task results in task order; at most a few tasks ahead of the consumer per worker."""
    if workers == 1 or len(tasks) <= 1:
        for task in tasks:
            yield _run_task(task)
        return
    # spawn, not fork: the caller may hold threads (torch, fsspec's event loop), and a
    # forked child of a threaded parent can deadlock on a lock held at fork time.
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending: deque[Any] = deque()
        queue = iter(tasks)
        for task in queue:
            pending.append(pool.apply_async(_run_task, (task,)))
            if len(pending) >= 2 * workers:
                break
        while pending:
            result = pending.popleft().get()
            nxt = next(queue, None)
            if nxt is not None:
                pending.append(pool.apply_async(_run_task, (nxt,)))
            yield result
