"""Tokenizers for ``ms-data build``: a protocol, a byte-level default, and HF ``tokenizers``.

The byte tokenizer needs no download and no vocabulary file, so a corpus can be built
and a model trained on any machine (the demo and the tests use it). ``tokenizers`` is
an optional dependency, imported only when ``HFTokenizer`` is constructed.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "get_tokenizer"]

#: Tried in order when ``HFTokenizer`` is given no ``eos_token``: the end-of-text
#: tokens of GPT-2 style, Llama/SentencePiece style, BERT-style and generic vocabularies.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


@runtime_checkable
class Tokenizer(Protocol):
    """What the builder needs from a tokenizer."""

    #: Recorded in the shard manifest, so a corpus says how it was made.
    name: str
    #: Ids are in ``range(vocab_size)``; picks the shard dtype under ``dtype="auto"``.
    vocab_size: int
    #: Appended after each document (``--eos``); None if the vocabulary has none.
    eos_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, end of document 256; vocabulary 257, nothing to download."""

    name = "bytes"
    vocab_size = 257
    eos_id: int | None = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Any) -> str:
        """The text of byte ids; the end-of-document id and invalid UTF-8 become U+FFFD."""
        return bytes(i if 0 <= i < 256 else 0xFF for i in ids).decode("utf-8", "replace")

    def __reduce__(self) -> tuple[Any, ...]:
        return (ByteTokenizer, ())


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``.

    ``eos_token`` names the end-of-document token; by default the first of
    ``EOS_CANDIDATES`` in the vocabulary, or none. Picklable by path, so build workers
    load their own copy.
    """

    def __init__(self, path: str | os.PathLike[str], *, eos_token: str | None = None) -> None:
        try:
            # Optional dependency, imported by name: it is absent from most installs.
            hf = importlib.import_module("tokenizers")
        except ImportError as e:
            raise ImportError(
                "HFTokenizer needs the 'tokenizers' library: pip install 'ms-data[tokenizers]' "
                "(or use the byte tokenizer, --tokenizer bytes)"
            ) from e
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(self.path)!r} does not exist")
        self._tok = hf.Tokenizer.from_file(str(self.path))
        self.name = f"hf:{self.path.name}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self._eos_token = eos_token
        candidates = (eos_token,) if eos_token is not None else EOS_CANDIDATES
        self.eos_id: int | None = None
        for token in candidates:
            found = self._tok.token_to_id(token)
            if found is not None:
                self.eos_id = int(found)
                break
        if eos_token is not None and self.eos_id is None:
            raise ValueError(f"eos_token {eos_token!r} is not in the vocabulary of {self.path}")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Any) -> str:
        """The text of ``ids`` (any iterable of ints): the tokenizer's own decoder, with
        special tokens such as the end-of-document one left out."""
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_hf_tokenizer, (str(self.path), self._eos_token))


def _hf_tokenizer(path: str, eos_token: str | None) -> HFTokenizer:
    return HFTokenizer(path, eos_token=eos_token)


def get_tokenizer(spec: str | os.PathLike[str]) -> Tokenizer:
    """``"bytes"`` for ``ByteTokenizer``, or a path to a ``tokenizer.json`` for ``HFTokenizer``."""
    text = os.fspath(spec)
    if text == "bytes":
        return ByteTokenizer()
    if not Path(text).is_file():
        raise ValueError(
            f"tokenizer must be 'bytes' or the path of a tokenizer.json file, got {text!r} "
            f"(no such file)"
        )
    return HFTokenizer(text)
