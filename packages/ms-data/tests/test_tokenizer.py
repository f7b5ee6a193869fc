"""Tokenizers: the byte default, the optional Hugging Face one, and choosing by spec."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch

from ms_data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, get_tokenizer


def test_byte_tokenizer_is_utf8_bytes_with_eos_past_them() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("bytes", 257, 256)
    text = "héllo, 世界 🎉\n\x00"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids) and len(ids) > len(text)
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id]) == text + "\ufffd"
    assert tok.encode("") == []
    assert isinstance(pickle.loads(pickle.dumps(tok)), ByteTokenizer)


def test_get_tokenizer_by_spec(tmp_path: Path) -> None:
    assert isinstance(get_tokenizer("bytes"), ByteTokenizer)
    missing = tmp_path / "tokenizer.json"
    with pytest.raises(ValueError, match=f"'bytes' or the path of a tokenizer.json.*{missing}"):
        get_tokenizer(missing)
    with pytest.raises(ValueError, match="got 'byte'"):
        get_tokenizer("byte")


def test_hf_tokenizer_without_the_library_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    # None in sys.modules makes `import tokenizers` fail as if it were not installed.
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    for make in (lambda: HFTokenizer(path), lambda: get_tokenizer(path)):
        with pytest.raises(ImportError, match=r"pip install 'ms-data\[tokenizers\]'"):
            make()


def test_hf_tokenizer_with_the_library(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tok = get_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("hf:tokenizer.json", 4, 3)
    assert tok.encode("hello world zebra") == [1, 2, 0]
    again = pickle.loads(pickle.dumps(tok))
    assert again.encode("world") == [2]
    with pytest.raises(ValueError, match="eos_token '<eos>' is not in the vocabulary"):
        HFTokenizer(path, eos_token="<eos>")


def test_hf_tokenizer_decodes_what_it_encodes(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    # A byte-level BPE (GPT-2's scheme) trained here on a few lines: any text round-trips.
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"] * 20
    hf.train_from_iterator(lines, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tok = get_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and tok.eos_id == 0
    text = "def sub(a, b):\n    return a - b  # é 世界\n"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode("utf-8"))  # merges learned, not bytes alone
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id]) == text  # the end-of-document token is special
    assert tok.decode(torch.tensor(ids)) == text  # the trainer's sample is a tensor's ids
    assert pickle.loads(pickle.dumps(tok)).decode(ids) == text
