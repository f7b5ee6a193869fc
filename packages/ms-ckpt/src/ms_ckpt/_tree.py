"""Flatten a nested training state into a JSON skeleton plus records, and restore it in
place (docs/format.md, "The tree").

Every leaf that is not a JSON scalar becomes a record named by its path (``model/w``),
and the skeleton refers to it by that key:

``{"t": key}`` a tensor; ``{"h": key}`` a DP-sharded tensor (``Sharded``); ``{"x": key}`` a
``DTensor`` (its pieces are the records of ``key`` with a ``dtensor`` field); ``{"p": key}``
a pickled value; ``{"v": x}`` a JSON scalar; ``{"d": [[k, node], ...]}`` a dict with
str/int keys (``"m": key``: the pickle record of its ``_metadata``, which
``nn.Module.state_dict()`` carries); ``{"l": [...]}`` a list; ``{"u": [...]}`` a tuple;
``{"s": node}`` the ``state_dict()`` of a Stateful; ``{"r": key}`` a per-rank value,
whose subtree each DP rank stores separately (``per_rank``, ``rng_state()``).
"""

from __future__ import annotations

import math
import pickle
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ms_ckpt import _dtensor
from ms_ckpt.errors import CheckpointError
from ms_ckpt.placement import PerRank, Sharded
from ms_ckpt.stateful import RNGState, Stateful

Scope = Literal["replicated", "rank", "shard", "dtensor"]


@dataclass
class Item:
    """One record to write: ``value`` is a tensor or pickled bytes. A ``dtensor`` item is
    this rank's local shard; whether this rank writes it is the layout's to decide
    (``_plan.dtensor_scope``), from the mesh's ranks and ``replica_writer``."""

    key: str
    value: torch.Tensor | bytes
    scope: Scope
    shard: dict[str, Any] | None = None
    mesh_ranks: tuple[int, ...] = ()
    replica_writer: bool = True

    @property
    def nbytes(self) -> int:
        v = self.value
        return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else len(v)


@dataclass
class Flat:
    tree: dict[str, Any]
    items: list[Item] = field(default_factory=list)
    per_rank: dict[str, dict[str, Any]] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)

    def add(self, item: Item) -> str:
        if item.key in self.keys:
            raise ValueError(
                f"state[{item.key!r}]: two values flatten to this key (a str and an int "
                "dict key that print alike, or a '/' inside a key); rename one"
            )
        self.keys.add(item.key)
        self.items.append(item)
        return item.key


def _is_stateful(x: Any) -> bool:
    return not isinstance(x, (dict, type)) and isinstance(x, Stateful)


def _is_per_rank(x: Any) -> bool:
    return isinstance(x, (PerRank, RNGState))


def _join(path: str, k: Any) -> str:
    return f"{path}/{k}" if path else str(k)


def flatten(state: dict[str, Any]) -> Flat:
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    flat = Flat(tree={})
    flat.tree = _flatten(state, "", flat, "replicated")
    return flat


def _pickle(x: Any, path: str, flat: Flat, scope: Scope) -> str:
    try:
        blob = pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(f"state[{path!r}]: cannot pickle {type(x).__name__}: {e}") from e
    return flat.add(Item(path, blob, scope))


def _dense(x: torch.Tensor, path: str) -> torch.Tensor:
    if x.layout != torch.strided or x.is_quantized:
        raise TypeError(f"state[{path!r}]: only dense tensors are supported, got {x.layout}")
    return x.detach()


def _flatten(x: Any, path: str, flat: Flat, scope: Scope) -> dict[str, Any]:
    if _dtensor.is_dtensor(x):  # before plain tensors: a DTensor is a torch.Tensor too
        if scope == "rank":
            raise TypeError(
                f"state[{path!r}]: a DTensor cannot be inside per_rank(); its placements "
                "already say which ranks hold what"
            )
        p = _dtensor.piece(x, path)
        box: dict[str, Any] = {"global_shape": list(p.global_shape), "offset": list(p.offset)}
        item = Item(path, _dense(p.local, path), "dtensor", box, p.mesh_ranks, p.replica_writer)
        return {"x": flat.add(item)}
    if isinstance(x, torch.Tensor):
        return {"t": flat.add(Item(path, _dense(x, path), scope))}
    if isinstance(x, Sharded):
        if scope == "rank":
            raise TypeError(f"state[{path!r}]: a Sharded tensor cannot be inside per_rank()")
        info = {"global_shape": list(x.global_shape), "dim": x.dim, "offset": x.offset}
        return {"h": flat.add(Item(path, _dense(x.local, path), "shard", info))}
    if _is_per_rank(x) and scope != "rank":
        inner = x.value if isinstance(x, PerRank) else x
        flat.per_rank[path] = _flatten(inner, path, flat, "rank")
        return {"r": path}
    if isinstance(x, PerRank):  # per_rank inside per_rank: already per rank
        return _flatten(x.value, path, flat, scope)
    if _is_stateful(x):
        return {"s": _flatten(x.state_dict(), path, flat, scope)}
    if isinstance(x, dict) and all(type(k) in (str, int) for k in x):
        node: dict[str, Any] = {
            "d": [[k, _flatten(v, _join(path, k), flat, scope)] for k, v in x.items()]
        }
        meta = getattr(x, "_metadata", None)
        if meta is not None:
            node["m"] = _pickle(meta, f"{path}/_metadata", flat, scope)
        return node
    if type(x) in (list, tuple):
        items = [_flatten(v, f"{path}/{i}", flat, scope) for i, v in enumerate(x)]
        return {"l": items} if type(x) is list else {"u": items}
    if x is None or type(x) in (bool, int, str) or (type(x) is float and math.isfinite(x)):
        return {"v": x}
    return {"p": _pickle(x, path, flat, scope)}


# ------------------------------------------------------------------------- loading


@dataclass
class Values:
    """What a skeleton's keys stand for on this rank: ``values[key]`` is a tensor or an
    unpickled value; ``per_rank[key]`` this rank's subtree of an ``{"r": key}`` node
    (absent: the per-rank value is not loaded, and the live one stays);
    ``placements[key]`` the live ``Sharded`` or ``DTensor`` whose region ``values[key]``
    holds, and which it is wrapped like (absent: the value as it is, a whole tensor)."""

    values: dict[str, Any]
    per_rank: dict[str, dict[str, Any]]
    placements: dict[str, Any] = field(default_factory=dict)


def _placed(value: Any, live: Any) -> Any:
    """``value``, this rank's region of a tensor, laid out like the live leaf it goes into."""
    if live is None:
        return value
    if isinstance(live, Sharded):
        return Sharded(value, live.global_shape, live.offset, live.dim)
    return _dtensor.like(value, live)


def materialize(node: dict[str, Any], v: Values) -> Any:
    """The value a skeleton node stands for."""
    if "p" in node:
        return v.values[node["p"]]
    for kind in ("t", "h", "x"):
        if kind in node:
            return _placed(v.values[node[kind]], v.placements.get(node[kind]))
    if "r" in node:
        sub = v.per_rank.get(node["r"])
        return None if sub is None else materialize(sub, v)
    if "v" in node:
        return node["v"]
    if "s" in node:
        return materialize(node["s"], v)
    if "d" in node:
        out: dict[Any, Any] = {k: materialize(c, v) for k, c in node["d"]}
        if "m" in node:
            od: Any = OrderedDict(out)
            od._metadata = v.values[node["m"]]
            return od
        return out
    if "l" in node:
        return [materialize(c, v) for c in node["l"]]
    return tuple(materialize(c, v) for c in node["u"])


def walk_live(state: Any, visit: Callable[[str, Any], None], path: str = "") -> None:
    """Call ``visit(path, leaf)`` for every tensor (DTensors too) and Sharded of the live
    state, looking through Stateful objects, per_rank wrappers, dicts, lists and tuples."""
    if isinstance(state, (torch.Tensor, Sharded)):
        visit(path, state)
    elif isinstance(state, PerRank):
        walk_live(state.value, visit, path)
    elif _is_stateful(state):
        walk_live(state.state_dict(), visit, path)
    elif isinstance(state, dict):
        for k, x in state.items():
            walk_live(x, visit, _join(path, k))
    elif type(state) in (list, tuple):
        for i, x in enumerate(state):
            walk_live(x, visit, f"{path}/{i}")


def _tensor_of(x: Any) -> Any:
    """The tensor a load writes into: a Sharded's slice, a DTensor's local shard."""
    if isinstance(x, Sharded):
        return x.local
    return _dtensor.local(x) if _dtensor.is_dtensor(x) else x


def _check_tensor(path: str, live: torch.Tensor, saved: torch.Tensor) -> None:
    if live.dtype != saved.dtype or live.shape != saved.shape:
        raise CheckpointError(
            f"state[{path!r}]: checkpoint holds {saved.dtype} {tuple(saved.shape)}, "
            f"the live tensor is {live.dtype} {tuple(live.shape)}"
        )


def _check_against(path: str, live: Any, saved: Any) -> None:
    """Every tensor the live state has at a path the checkpoint also has must match it."""
    live, saved = _tensor_of(live), _tensor_of(saved)
    if isinstance(live, PerRank):
        live = live.value
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        _check_tensor(path, live, saved)
    elif isinstance(live, dict) and isinstance(saved, dict):
        for k, x in live.items():
            if k in saved:
                _check_against(_join(path, k), x, saved[k])
    elif isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)):
        for i, (a, b) in enumerate(zip(live, saved, strict=False)):
            _check_against(f"{path}/{i}", a, b)


def check(live: Any, node: dict[str, Any], v: Values, path: str = "") -> None:
    """Raise before anything is modified if ``live`` cannot take the checkpoint. ``v`` may
    hold placeholders: meta tensors of the saved dtype and shape, or the live leaf itself
    where the loader compared global shapes already (sharded and DTensor state)."""
    if isinstance(live, PerRank):
        live = live.value
    if "r" in node:
        if node["r"] in v.per_rank:
            check(live, v.per_rank[node["r"]], v, path)
    elif "s" in node and isinstance(live, dict):  # a saved Stateful into a plain dict
        check(live, node["s"], v, path)
    elif "s" in node:
        if not _is_stateful(live):
            raise CheckpointError(
                f"state[{path!r}]: checkpoint holds a Stateful's state_dict, "
                f"the live state has {type(live).__name__}"
            )
        _check_against(path, live.state_dict(), materialize(node, v))
    elif ("t" in node or "h" in node or "x" in node) and isinstance(live, (torch.Tensor, Sharded)):
        _check_tensor(path, _tensor_of(live), _tensor_of(materialize(node, v)))
    elif "d" in node and isinstance(live, dict):
        saved = {k: c for k, c in node["d"]}
        for k in live:
            if k not in saved:
                raise CheckpointError(f"state[{_join(path, k)!r}]: not in the checkpoint")
        for k, c in node["d"]:
            if k in live:
                check(live[k], c, v, _join(path, k))


def restore(live: Any, node: dict[str, Any], v: Values) -> Any:
    """Load ``node`` into ``live`` in place; return the value the parent should hold."""
    if isinstance(live, PerRank):
        live.value = restore(live.value, node, v)
        return live
    if "r" in node:
        sub = v.per_rank.get(node["r"])
        return live if sub is None else restore(live, sub, v)
    if "s" in node:
        if not _is_stateful(live):
            return restore(live, node["s"], v)
        live.load_state_dict(materialize(node, v))
        return live
    if ("t" in node or "h" in node or "x" in node) and isinstance(live, (torch.Tensor, Sharded)):
        with torch.no_grad():
            _tensor_of(live).copy_(_tensor_of(materialize(node, v)))
        return live
    if "d" in node and isinstance(live, dict):
        for k, c in node["d"]:
            if k in live:
                live[k] = restore(live[k], c, v)
            elif "r" not in c or c["r"] in v.per_rank:  # no per-rank value left out
                live[k] = materialize(c, v)
        return live
    return materialize(node, v)
