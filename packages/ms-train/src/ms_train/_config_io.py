"""Config files in and out: reading TOML or JSON, writing the TOML that reads back.

``read_config_file`` turns a ``.json`` file (JSON) or any other file (TOML) into the
``{section: {field: value}}`` document that ``load_config`` merges; a syntax error is a
``ConfigError`` naming the file, line and column. ``config_to_toml`` writes a ``Config``
as TOML that ``load_config(path)`` turns back into an equal ``Config``.

TOML has no null. A field whose value is None is written as a comment and left out, so
that its default applies when the file is read back; that is only the same value when
the default is None, so the writer refuses a None that is not the field's default
instead of writing a file that would read back differently. A file read together with a
preset gets the preset's value for such a field, hence the writer's header: a written
config is complete, and is meant for ``--config`` alone.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import TYPE_CHECKING, Any

import attrs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

if TYPE_CHECKING:
    from ms_train.config import Config, ConfigError

__all__ = [
    "config_to_toml",
    "read_config_file",
    "section_to_toml",
    "toml_string",
    "toml_value",
]

_TOML_POSITION = re.compile(r"^(?P<msg>.*) \(at line (?P<line>\d+), column (?P<col>\d+)\)$", re.S)
_TOML_AT_END = " (at end of document)"


def _error(message: str) -> ConfigError:
    # config.py imports this module inside load_config; importing it here at the top
    # would make the two modules import each other at load time.
    from ms_train.config import ConfigError

    return ConfigError(message)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The document of a config file: JSON when the name ends in ``.json``, else TOML.

    Raises ConfigError naming the file (and the line and column of a syntax error).
    """
    name = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _error(f"cannot read the config file {name!r}: {e}") from e
    try:
        # Some editors on Windows start UTF-8 files with a byte-order mark; both parsers
        # would stop at it.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise _error(f"{name}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    if name.lower().endswith(".json"):
        doc = _loads_json(text, name)
        kind = "JSON object"
    else:
        doc = _loads_toml(text, name)
        kind = "TOML table"
    if not isinstance(doc, dict):
        raise _error(
            f"{name}: a config file holds one {kind} per section, got a {type(doc).__name__}"
        )
    return doc


def _loads_json(text: str, name: str) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # json keeps the last of two equal keys without a word; TOML refuses them, and
        # so do we: one of the two values is a mistake.
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise _error(f"{name}: the key {key!r} appears twice in one JSON object")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise _error(f"{name}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from e


def _loads_toml(text: str, name: str) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        message = str(e)
        # tomllib says where in its message; Python 3.14 also sets lineno and colno.
        line, col = getattr(e, "lineno", None), getattr(e, "colno", None)
        found = _TOML_POSITION.match(message)
        if found:
            message, line, col = found["msg"], int(found["line"]), int(found["col"])
        elif message.endswith(_TOML_AT_END):
            message = message[: -len(_TOML_AT_END)] + " at the end of the file"
            lines = text.split("\n")
            line, col = len(lines), len(lines[-1]) + 1
        elif line is not None:
            message = getattr(e, "msg", message)
        where = f"{name}:{line}:{col}" if line is not None else name
        raise _error(f"{where}: not valid TOML: {message}") from e
    return doc


# ------------------------------------------------------------------------- writing

# TOML basic strings must escape the quote, the backslash and the control characters
# other than tab; tab and the rest of these get their short escape for legibility.
_SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def toml_string(text: str, where: str = "a string") -> str:
    """``text`` as a TOML basic string (quoted). Characters that do not print (controls,
    separators other than the space, unassigned code points) are written as escapes."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        elif 0xD800 <= code <= 0xDFFF:
            raise _error(
                f"{where} holds a lone surrogate (U+{code:04X}), which no TOML (or UTF-8) "
                "file can hold"
            )
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04X}")
        else:
            out.append(f"\\U{code:08X}")
    out.append('"')
    return "".join(out)


def toml_value(value: Any, where: str = "a value") -> str:
    """A scalar (bool, int, float, str) or a list or tuple of them as TOML; ``where``
    names the field in the error for anything else."""
    if type(value) is bool:
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        # repr is the shortest text that reads back to the same float, and TOML reads
        # all of its forms: 0.1, 1e-08, 1e+16, inf, -inf, nan.
        return repr(float(value))
    if isinstance(value, str):
        return toml_string(value, where)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v, f"{where}[{i}]") for i, v in enumerate(value)) + "]"
    raise _error(
        f"{where} cannot be written as TOML: expected a bool, int, float, string or list, "
        f"got {type(value).__name__} {value!r}"
    )


def config_to_toml(config: Config, header: str = "") -> str:
    """``config`` as a complete TOML file: every field of every section, a None as a
    comment (the default applies). ``header``: comment lines put first."""
    from ms_train.config import _SECTIONS

    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for section in _SECTIONS:
        if lines:
            lines.append("")
        lines += section_to_toml(section, getattr(config, section))
    return "\n".join(lines) + "\n"


def section_to_toml(section: str, values: Any) -> list[str]:
    """The lines of the table ``[section]`` holding the attrs instance ``values``."""
    lines = [f"[{section}]"]
    for field in attrs.fields(type(values)):
        value = getattr(values, field.name)
        key = f"{section}.{field.name}"
        if value is None:
            if field.default is not None:
                has = (
                    "no default"
                    if field.default is attrs.NOTHING
                    else f"the default {field.default!r}"
                )
                raise _error(
                    f"{key} is None, which no TOML file holds (TOML has no null) and which "
                    f"leaving the key out does not give back ({key} has {has})"
                )
            lines.append(f"# {field.name}: none (left out: TOML has no null; none is the default)")
            continue
        lines.append(f"{field.name} = {toml_value(value, key)}")
    return lines
