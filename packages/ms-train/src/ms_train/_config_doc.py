"""Every config key with its type, default and help, read from the config classes.

The help of a field is its entry in the ``Attributes:`` block of its class's docstring
(Google style, as every section class in ``ms_train.config`` has; ``a, b: text`` documents
several fields at once). The docstring is the one source: Python's ``help()`` and API
docs show it, and ``ms-train config`` lists it through ``config_fields``, so a field added
to a class with its docstring entry shows up here without being written twice.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
import types
import typing
from typing import Any

import attrs

__all__ = ["FieldDoc", "attribute_docs", "config_fields", "fields_json", "format_fields"]

_HELP = " " * 6  # the indent of a field's help under its key
_ENTRY = re.compile(r"^(?P<names>[A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*:\s*(?P<text>.*)$")


@attrs.frozen
class FieldDoc:
    """One config key.

    Attributes:
        key: ``section.field``, as ``--set`` takes it.
        type: the field's type as users write values (``int | none``, ``"a" | "b"``).
        required: the field has no default (a preset or the file must give it).
        default: the default value (None also when ``required``).
        help: the docstring entry, on one line ("" when the docstring has none).
    """

    key: str
    type: str
    required: bool
    default: Any
    help: str


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: help}`` from the ``Attributes:`` block of ``cls``'s docstring, each help
    on one line with reStructuredText's double backquotes taken off."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    indent = None
    docs: dict[str, list[str]] = {}
    current: list[str] = []
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent or indent == 0:
            break  # the next block (or unindented prose): the attributes are over
        entry = _ENTRY.match(line.strip()) if depth == indent else None
        if entry:
            names = re.split(r"\s*,\s*", entry["names"])
            # One entry for several fields: each field's help says which it shares with.
            current = [f"{', '.join(names)}:"] if len(names) > 1 else []
            current.append(entry["text"])
            for name in names:
                docs[name] = current
        else:
            current.append(line.strip())
    return {name: " ".join(" ".join(text).replace("``", "").split()) for name, text in docs.items()}


def _type_text(hint: Any) -> str:
    if hint is type(None):
        return "none"
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(json.dumps(v) for v in typing.get_args(hint))
    args = typing.get_args(hint)
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    return getattr(hint, "__name__", str(hint))


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation naming something only a type checker imports
        return {f.name: f.type for f in attrs.fields(cls)}


def config_fields(sections: list[str] | None = None) -> dict[str, tuple[str, list[FieldDoc]]]:
    """``{section: (the class's one-line summary, [FieldDoc per field])}`` for every
    section of ``Config`` (or those named), in the order ``--print-config`` writes them."""
    from ms_train.config import _SECTIONS

    out: dict[str, tuple[str, list[FieldDoc]]] = {}
    for section, cls in _SECTIONS.items():
        if sections and section not in sections:
            continue
        docs, hints = attribute_docs(cls), _hints(cls)
        summary = " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())
        fields = []
        for f in attrs.fields(cls):
            required = f.default is attrs.NOTHING
            factory = getattr(f.default, "factory", None)  # an attrs.Factory default
            default = None if required else factory() if callable(factory) else f.default
            hint = hints.get(f.name, f.type)
            fields.append(
                FieldDoc(
                    key=f"{section}.{f.name}",
                    type=hint if isinstance(hint, str) else _type_text(hint),
                    required=required,
                    default=default,
                    help=docs.get(f.name, ""),
                )
            )
        out[section] = (summary.replace("``", ""), fields)
    return out


def _default_text(field: FieldDoc) -> str:
    from ms_train._config_io import toml_value

    if field.required:
        return "(required)"
    if field.default is None:
        return "= none"
    return f"= {toml_value(field.default, field.key)}"


def format_fields(sections: dict[str, tuple[str, list[FieldDoc]]], width: int = 88) -> str:
    """The listing of ``ms-train config``: per section its summary, then per field
    ``key: type = default`` and the help below it."""
    out: list[str] = []
    for section, (summary, fields) in sections.items():
        if out:
            out.append("")
        out.extend(textwrap.wrap(f"[{section}]  {summary}", width, subsequent_indent=" " * 2))
        for f in fields:
            out.append(f"  {f.key}: {f.type} {_default_text(f)}")
            help_text = f.help or "(no help: the class docstring has no entry for this field)"
            out.extend(
                textwrap.wrap(help_text, width, initial_indent=_HELP, subsequent_indent=_HELP)
            )
    return "\n".join(out) + "\n"


def fields_json(sections: dict[str, tuple[str, list[FieldDoc]]]) -> str:
    """The listing as JSON: ``{section: {"summary": ..., "fields": [FieldDoc as dict]}}``."""
    doc = {
        section: {"summary": summary, "fields": [attrs.asdict(f) for f in fields]}
        for section, (summary, fields) in sections.items()
    }
    return json.dumps(doc, indent=2, default=repr)
