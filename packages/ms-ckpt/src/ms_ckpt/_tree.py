"""Flatten a nested training state into a JSON skeleton plus tensors and pickled blobs,
and restore it in place (docs/format.md, "The tree").

Node encodings: ``{"t": i}`` tensor record i; ``{"p": i}`` pickle record i; ``{"v": x}``
a JSON scalar; ``{"d": [[key, node], ...]}`` a dict with str/int keys (``"m"``: a pickle
record of its ``_metadata``, which ``nn.Module.state_dict()`` carries); ``{"l": [...]}``
a list; ``{"u": [...]}`` a tuple; ``{"s": node}`` the ``state_dict()`` of a Stateful.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from ms_ckpt.errors import CheckpointError
from ms_ckpt.stateful import Stateful


@dataclass
class Flat:
    tree: dict[str, Any]
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    blobs: list[tuple[str, bytes]] = field(default_factory=list)


def _is_stateful(x: Any) -> bool:
    return not isinstance(x, (dict, type)) and isinstance(x, Stateful)


def flatten(state: dict[str, Any]) -> Flat:
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    flat = Flat(tree={})
    flat.tree = _flatten(state, "", flat)
    return flat


def _pickle(x: Any, path: str, flat: Flat) -> dict[str, Any]:
    try:
        blob = pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(f"state[{path!r}]: cannot pickle {type(x).__name__}: {e}") from e
    flat.blobs.append((path, blob))
    return {"p": len(flat.blobs) - 1}


def _flatten(x: Any, path: str, flat: Flat) -> dict[str, Any]:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.is_quantized:
            raise TypeError(f"state[{path!r}]: only dense tensors are supported, got {x.layout}")
        flat.tensors.append((path, x.detach()))
        return {"t": len(flat.tensors) - 1}
    if _is_stateful(x):
        return {"s": _flatten(x.state_dict(), path, flat)}
    if isinstance(x, dict) and all(type(k) in (str, int) for k in x):
        node: dict[str, Any] = {
            "d": [[k, _flatten(v, f"{path}/{k}" if path else str(k), flat)] for k, v in x.items()]
        }
        meta = getattr(x, "_metadata", None)
        if meta is not None:
            node["m"] = _pickle(meta, f"{path}/_metadata", flat)["p"]
        return node
    if type(x) in (list, tuple):
        items = [_flatten(v, f"{path}/{i}", flat) for i, v in enumerate(x)]
        return {"l": items} if type(x) is list else {"u": items}
    if x is None or type(x) in (bool, int, str) or (type(x) is float and math.isfinite(x)):
        return {"v": x}
    return _pickle(x, path, flat)


def materialize(node: dict[str, Any], tensors: list[torch.Tensor], blobs: list[Any]) -> Any:
    """The value a skeleton node stands for, built from loaded records."""
    if "t" in node:
        return tensors[node["t"]]
    if "p" in node:
        return blobs[node["p"]]
    if "v" in node:
        return node["v"]
    if "s" in node:
        return materialize(node["s"], tensors, blobs)
    if "d" in node:
        out: dict[Any, Any] = {k: materialize(v, tensors, blobs) for k, v in node["d"]}
        if "m" in node:
            from collections import OrderedDict

            od: Any = OrderedDict(out)
            od._metadata = blobs[node["m"]]
            return od
        return out
    if "l" in node:
        return [materialize(v, tensors, blobs) for v in node["l"]]
    return tuple(materialize(v, tensors, blobs) for v in node["u"])


def _check_tensor(path: str, live: torch.Tensor, saved: torch.Tensor) -> None:
    if live.dtype != saved.dtype or live.shape != saved.shape:
        raise CheckpointError(
            f"state[{path!r}]: checkpoint holds {saved.dtype} {tuple(saved.shape)}, "
            f"the live tensor is {live.dtype} {tuple(live.shape)}"
        )


def _check_against(path: str, live: Any, saved: Any) -> None:
    """Every tensor the live state has at a path the checkpoint also has must match it."""
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        _check_tensor(path, live, saved)
    elif isinstance(live, dict) and isinstance(saved, dict):
        for k, v in live.items():
            if k in saved:
                _check_against(f"{path}/{k}" if path else str(k), v, saved[k])
    elif isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)):
        for i, (a, b) in enumerate(zip(live, saved, strict=False)):
            _check_against(f"{path}/{i}", a, b)


def check(
    live: Any, node: dict[str, Any], tensors: list[torch.Tensor], blobs: list[Any], path: str = ""
) -> None:
    """Raise before anything is modified if ``live`` cannot take the checkpoint."""
    if "s" in node:
        if not _is_stateful(live):
            raise CheckpointError(
                f"state[{path!r}]: checkpoint holds a Stateful's state_dict, "
                f"the live state has {type(live).__name__}"
            )
        _check_against(path, live.state_dict(), materialize(node, tensors, blobs))
    elif "t" in node and isinstance(live, torch.Tensor):
        _check_tensor(path, live, tensors[node["t"]])
    elif "d" in node and isinstance(live, dict):
        saved = {k: v for k, v in node["d"]}
        for k in live:
            if k not in saved:
                where = f"{path}/{k}" if path else str(k)
                raise CheckpointError(f"state[{where!r}]: not in the checkpoint")
        for k, v in node["d"]:
            if k in live:
                check(live[k], v, tensors, blobs, f"{path}/{k}" if path else str(k))


def restore(live: Any, node: dict[str, Any], tensors: list[torch.Tensor], blobs: list[Any]) -> Any:
    """Load ``node`` into ``live`` in place; return the value the parent should hold."""
    if "s" in node:
        live.load_state_dict(materialize(node, tensors, blobs))
        return live
    if "t" in node and isinstance(live, torch.Tensor):
        with torch.no_grad():
            live.copy_(tensors[node["t"]])
        return live
    if "d" in node and isinstance(live, dict):
        for k, v in node["d"]:
            live[k] = (
                restore(live[k], v, tensors, blobs) if k in live else materialize(v, tensors, blobs)
            )
        return live
    return materialize(node, tensors, blobs)
