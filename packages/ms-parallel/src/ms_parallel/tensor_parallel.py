"""Tensor-parallel layers with sequence parallelism, on plain local parameter shards.

Between layers, activations are split along the sequence (dim 0 of ``(seq, batch,
hidden)``) over the TP group, so LayerNorm and dropout run on ``1/tp`` of the tokens.
:class:`ColumnParallelLinear` gathers the sequence inside its GEMM and splits its output
features; :class:`RowParallelLinear` splits its input features and reduce-scatters the
sequence inside its GEMM (both through :mod:`ms_parallel.collective_matmul`).
:class:`VocabParallelEmbedding` splits the vocabulary, and
:func:`vocab_parallel_cross_entropy` scores logits split the same way without ever
gathering them.

Each parameter is an ordinary ``nn.Parameter`` holding this rank's part (so ZeRO can keep
it in its flat buckets) and carries a :class:`TPSpec` saying how it is split. A module's
``state_dict`` gives every such parameter as a ``DTensor`` on the TP mesh with the
unsplit model's key and global shape; ``load_state_dict`` takes those, or whole tensors.
A vocabulary that does not divide by TP is padded in memory only: the padded rows are
zero, masked out of the loss, and absent from the state.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ms_parallel._tp_comm import TPComm
from ms_parallel.chunk_tuner import ChunkTuner, shape_key
from ms_parallel.collective_matmul import (
    all_gather_matmul,
    matmul_reduce_scatter,
    reduce_scatter_sequence,
)

__all__ = [
    "Chunks",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPSpec",
    "VocabParallelEmbedding",
    "column_parallel_matmuls",
    "gathered_matmuls",
    "mark_replicated",
    "resolve_chunks",
    "row_parallel_matmuls",
    "shard_range",
    "tp_spec",
    "vocab_parallel_cross_entropy",
]


def shard_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """Rank ``index``'s rows ``[lo, hi)`` of ``size`` split into ``parts``: ``torch.chunk``'s
    rule (``ceil(size / parts)`` each, the last ones shorter or empty), which is also
    ``DTensor``'s ``Shard``."""
    c = math.ceil(size / parts) if size else 0
    return min(index * c, size), min((index + 1) * c, size)


@dataclass(frozen=True)
class TPSpec:
    """How one parameter is split over the tensor-parallel group."""

    #: The group (and its mesh, for ``DTensor`` state).
    comm: TPComm
    #: The tensor dimension split over the group, ``torch.chunk`` style; ``None``: every
    #: rank holds the whole parameter.
    dim: int | None
    #: The unsplit parameter's shape (the TP 1 model's, without padding).
    global_shape: tuple[int, ...]
    #: The gradient on each rank is a partial sum over its share of the sequence
    #: (sequence-parallel LayerNorms, row-parallel biases, position embeddings): the
    #: engine sums it over the group.
    partial_grad: bool = False

    def local_range(self) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` along :attr:`dim` of the global shape."""
        if self.dim is None:
            return 0, self.global_shape[0] if self.global_shape else 1
        return shard_range(self.global_shape[self.dim], self.comm.size, self.comm.rank)

    def to_dtensor(self, local: Tensor) -> Any:
        """``local`` (this rank's padded part) as a ``DTensor`` of :attr:`global_shape`."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = self.comm.mesh(local.device.type)
        if self.dim is None:
            placement: Any = Replicate()
            real = local
        else:
            lo, hi = self.local_range()
            placement = Shard(self.dim)
            real = local.narrow(self.dim, 0, hi - lo)
        shape = torch.Size(self.global_shape)
        return DTensor.from_local(
            real, mesh, [placement], run_check=False, shape=shape, stride=contiguous_strides(shape)
        )

    def from_state(self, value: Tensor, like: Tensor, key: str) -> Tensor:
        """The padded local tensor for a saved ``value``: a ``DTensor`` (any placement on
        this group's mesh) or a whole tensor of :attr:`global_shape`."""
        from torch.distributed.tensor import DTensor, Shard

        if tuple(value.shape) != self.global_shape:
            raise ValueError(
                f"{key}: expected a tensor of global shape {self.global_shape} (the "
                f"unsplit model's), got {tuple(value.shape)}"
            )
        if isinstance(value, DTensor):
            if self.dim is not None and value.placements == (Shard(self.dim),):
                part = value.to_local()
            else:
                whole = value.full_tensor()
                part = self.narrow_local(whole)
        else:
            part = self.narrow_local(value)
        if part.shape == like.shape:
            return part
        out = torch.zeros_like(like)  # padded rows stay zero
        assert self.dim is not None
        out.narrow(self.dim, 0, part.shape[self.dim]).copy_(part)
        return out

    def narrow_local(self, whole: Tensor) -> Tensor:
        """This rank's part of the unsplit ``whole`` (all of it when not split)."""
        if self.dim is None:
            return whole
        lo, hi = self.local_range()
        return whole.narrow(self.dim, lo, hi - lo)


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (DTensor.from_local's ``stride=``)."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def tp_spec(param: Tensor) -> TPSpec | None:
    """The :class:`TPSpec` of a parameter made by this module, else ``None``."""
    spec = getattr(param, "_ms_tp", None)
    return spec if isinstance(spec, TPSpec) else None


def _attach(module: nn.Module, name: str, spec: TPSpec) -> None:
    param = getattr(module, name)
    param._ms_tp = spec  # survives ZeRO's move of .data into its buckets
    if id(module) not in _HOOKED:
        module.register_state_dict_post_hook(_to_dtensors)  # type: ignore[no-untyped-call]
        module.register_load_state_dict_pre_hook(_from_dtensors)  # type: ignore[no-untyped-call]
        key = id(module)
        _HOOKED[key] = weakref.ref(module, lambda _: _HOOKED.pop(key, None))


# Modules whose state-dict hooks are installed, by id (weakly: a module may go away).
_HOOKED: dict[int, weakref.ref[nn.Module]] = {}


def _to_dtensors(
    module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    for name, param in module.named_parameters(recurse=False):
        spec = tp_spec(param)
        key = prefix + name
        if spec is not None and key in state and spec.comm.size > 1:
            state[key] = spec.to_dtensor(state[key])


def _from_dtensors(
    module: nn.Module,
    state: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing: list[str],
    unexpected: list[str],
    errors: list[str],
) -> None:
    for name, param in module.named_parameters(recurse=False):
        spec = tp_spec(param)
        key = prefix + name
        if spec is not None and key in state:
            try:
                state[key] = spec.from_state(state[key], param.detach(), key)
            except ValueError as e:
                errors.append(str(e))


def mark_replicated(
    module: nn.Module, comm: TPComm, *, partial_grad: bool = True, names: Sequence[str] = ()
) -> None:
    """Mark ``module``'s own parameters (or those ``names``) as whole on every TP rank:
    ``state_dict`` gives them as ``Replicate()`` ``DTensor``s, and with ``partial_grad``
    (a sequence-parallel module: a LayerNorm, a position embedding) the engine sums their
    gradients over the group."""
    for name, param in module.named_parameters(recurse=False):
        if names and name not in names:
            continue
        _attach(module, name, TPSpec(comm, None, tuple(param.shape), partial_grad))


#: A layer's chunk count: fixed, or measured per shape by a shared tuner.
Chunks = int | ChunkTuner


def resolve_chunks(
    chunks: Chunks,
    kind: str,
    xs: Sequence[Tensor],
    weights: Sequence[Tensor],
    comm: TPComm,
    fused: Any,
) -> int:
    """``chunks`` itself, or the tuner's count for this shape (measured on first sight,
    with ``fused(xs, weights, comm, chunks)`` run forward and backward on detached copies
    of the inputs, so that nothing of the real step is touched, and without events)."""
    if not isinstance(chunks, ChunkTuner):
        return chunks
    key = shape_key(kind, xs[0], weights, comm.size)
    quiet = comm.quiet()

    def run(c: int) -> None:
        xx = [x.detach().clone().requires_grad_() for x in xs]
        ww = [w.detach().clone().requires_grad_() for w in weights]
        with torch.enable_grad():
            out = fused(xx, ww, quiet, c)
            outs = out if isinstance(out, list) else [out]
            sum(o.float().sum() for o in outs).backward()

    return chunks.choose(key, quiet, run)


def _divides(what: str, size: int, parts: int) -> int:
    if size % parts:
        raise ValueError(
            f"{what} ({size}) must divide by the tensor-parallel size {parts}, got a "
            f"remainder of {size % parts}"
        )
    return size // parts


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with its output features split over the TP group.

    Input: this rank's part of the sequence, ``(s, *batch, in_features)``; output: the
    whole sequence, this rank's ``out_features / tp`` features,
    ``(tp * s, *batch, out_features / tp)``. ``weight`` is ``(out_features / tp,
    in_features)`` here and ``(out_features, in_features)`` in the state.

    Args:
        comm: the TP group (:class:`~ms_parallel.TPComm`).
        chunks: pieces of the sequence gather overlapped with the GEMM.
        overlap: ``False``: gather, wait, then multiply (the unfused reference).
        pad: allow ``out_features`` that does not divide by TP (an output vocabulary):
            each rank holds ``ceil(out_features / tp)`` rows, the padded ones zero and
            absent from the state; otherwise such a size is refused.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: TPComm,
        *,
        bias: bool = True,
        chunks: Chunks = 2,
        overlap: bool = True,
        pad: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.chunks, self.overlap = comm, chunks, overlap
        if pad:
            local = math.ceil(out_features / comm.size)
        else:
            local = _divides("out_features", out_features, comm.size)
        self.out_start, self.out_end = shard_range(out_features, comm.size, comm.rank)
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        _attach(self, "weight", TPSpec(comm, 0, (out_features, in_features)))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype))
            _attach(self, "bias", TPSpec(comm, 0, (out_features,)))

    def matmul(self, x: Tensor) -> Tensor:
        """The gathered GEMM without the bias."""
        return column_parallel_matmuls(x, [self])[0]

    def forward(self, x: Tensor) -> Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_features // self.comm.size} here), chunks={self.chunks}, "
            f"overlap={self.overlap}"
        )


def _gather_mm(
    xs: Sequence[Tensor], ws: Sequence[Tensor], comm: TPComm, chunks: int
) -> list[Tensor]:
    out = all_gather_matmul(xs[0], list(ws), comm, chunks=chunks)
    assert isinstance(out, list)
    return out


def _mm_scatter(
    xs: Sequence[Tensor],
    ws: Sequence[Tensor],
    comm: TPComm,
    chunks: int,
    scales: Sequence[Tensor | None] | None = None,
) -> Tensor:
    return matmul_reduce_scatter(list(xs), list(ws), comm, chunks=chunks, scales=scales)


def gathered_matmuls(
    x: Tensor, weights: Sequence[Tensor], comm: TPComm, *, chunks: Chunks, overlap: bool = True
) -> list[Tensor]:
    """:func:`~ms_parallel.all_gather_matmul` of ``x`` with every weight, the chunk count
    fixed or measured per shape (a :class:`~ms_parallel.ChunkTuner`)."""
    ws = list(weights)
    if not overlap:
        outs = all_gather_matmul(x, ws, comm, overlap=False)
        assert isinstance(outs, list)
        return outs
    c = resolve_chunks(chunks, "all_gather_matmul", [x], ws, comm, _gather_mm)
    return _gather_mm([x], ws, comm, c)


def column_parallel_matmuls(x: Tensor, layers: Sequence[ColumnParallelLinear]) -> list[Tensor]:
    """The GEMMs of several column-parallel layers that read the same input, with one
    gather (the parallel block's QKV and FC); no biases."""
    first = layers[0]
    return gathered_matmuls(
        x, [m.weight for m in layers], first.comm, chunks=first.chunks, overlap=first.overlap
    )


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with its input features split over the TP group.

    Input: the whole sequence, this rank's ``in_features / tp`` features; output: this
    rank's part of the sequence, all features, summed over the group. ``weight`` is
    ``(out_features, in_features / tp)`` here; the bias is whole on every rank, added
    after the reduce-scatter, and its gradient (over this rank's tokens) is summed over
    the group by the engine.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: TPComm,
        *,
        bias: bool = True,
        chunks: Chunks = 2,
        overlap: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.chunks, self.overlap = comm, chunks, overlap
        local = _divides("in_features", in_features, comm.size)
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        _attach(self, "weight", TPSpec(comm, 1, (out_features, in_features)))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
            _attach(self, "bias", TPSpec(comm, None, (out_features,), partial_grad=True))

    def forward(self, x: Tensor) -> Tensor:
        return row_parallel_matmuls([x], [self])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_features // self.comm.size} here), "
            f"out_features={self.out_features}, chunks={self.chunks}, overlap={self.overlap}"
        )


def row_parallel_matmuls(
    xs: Sequence[Tensor],
    layers: Sequence[RowParallelLinear],
    scales: Sequence[Tensor | None] | None = None,
) -> Tensor:
    """The sum of several row-parallel layers' outputs with one reduce-scatter (the
    parallel block's attention and MLP projections); each layer's bias added once.

    ``scales`` (see :func:`~ms_parallel.matmul_reduce_scatter`): per layer, None or a
    constant of the whole output's shape multiplying that layer's output, bias included
    (``sum(scale * (x @ w.T + b))``): dropout masks on partial sums, alike on every rank.
    """
    first = layers[0]
    ws = [m.weight for m in layers]
    if not first.overlap:
        y = matmul_reduce_scatter(list(xs), ws, first.comm, overlap=False, scales=scales)
    else:
        chunks = resolve_chunks(
            first.chunks, "matmul_reduce_scatter", xs, ws, first.comm, _mm_scatter
        )
        y = _mm_scatter(xs, ws, first.comm, chunks, scales)
    comm = first.comm
    for i, m in enumerate(layers):
        if m.bias is None:
            continue
        sc = None if scales is None else scales[i]
        if sc is None:
            y = y + m.bias.to(y.dtype)
        else:  # this rank's rows of the scale
            part = sc.shape[0] // comm.size
            y = y + sc[comm.rank * part : (comm.rank + 1) * part] * m.bias.to(y.dtype)
    return y


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with its rows (the vocabulary) split over the TP group.

    ``forward(ids)`` takes the whole sequence's ids ``(seq, *batch)`` (the same on every
    TP rank) and returns this rank's part of the sequence, ``(seq / tp, *batch, dim)``:
    each rank looks up the ids it holds, and one reduce-scatter sums and splits. A
    vocabulary that does not divide by TP is padded to ``ceil(V / tp)`` rows per rank;
    the padded rows are zero and never looked up.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        comm: TPComm,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.comm = num_embeddings, embedding_dim, comm
        rows = math.ceil(num_embeddings / comm.size)
        self.vocab_start, self.vocab_end = shard_range(num_embeddings, comm.size, comm.rank)
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))
        _attach(self, "weight", TPSpec(comm, 0, (num_embeddings, embedding_dim)))

    def forward(self, ids: Tensor) -> Tensor:
        if self.comm.size == 1:
            return nn.functional.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        out = nn.functional.embedding(local, self.weight) * mine.unsqueeze(-1)
        return reduce_scatter_sequence(out, self.comm)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows "
            f"[{self.vocab_start}, {self.vocab_end}) here"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        comm: TPComm,
        vocab_start: int,
        vocab_size: int,
        ignore_index: int,
    ) -> Tensor:
        x = logits.float()
        cols = x.shape[-1]
        real = max(0, min(cols, vocab_size - vocab_start))
        if real < cols:  # padded vocabulary entries take no probability
            x = x.clone()
            x[:, real:] = -math.inf
        peak = x.max(dim=-1).values if real else torch.full_like(x[:, 0], -math.inf)
        comm.all_reduce(peak, "all_reduce", "forward", dist.ReduceOp.MAX)
        e = torch.exp(x - peak.unsqueeze(-1))
        mine = (targets >= vocab_start) & (targets < vocab_start + real)
        local_t = torch.where(mine, targets - vocab_start, torch.zeros_like(targets))
        picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        packed = torch.stack([e.sum(dim=-1), torch.where(mine, picked, 0.0)])
        comm.all_reduce(packed, "all_reduce", "forward")
        total, target_logit = packed[0], packed[1]
        loss = torch.log(total) + peak - target_logit
        valid = targets != ignore_index
        loss = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(e, total, local_t, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        e, total, local_t, mine, valid = ctx.saved_tensors
        g = e / total.unsqueeze(-1)
        g.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g *= (grad * valid).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    comm: TPComm,
    *,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int = -100,
) -> Tensor:
    """Mean cross-entropy of ``logits`` whose last dimension is this rank's columns
    ``[vocab_start, vocab_start + cols)`` of a vocabulary of ``vocab_size`` (columns past
    it are padding and take no probability), over every row of ``targets`` but those equal
    to ``ignore_index``. Three reductions over the group of one value per row; the logits
    are never gathered. The same value on every rank."""
    flat = logits.reshape(-1, logits.shape[-1])
    t = targets.reshape(-1).long()
    if flat.shape[0] != t.shape[0]:
        raise ValueError(
            f"targets must have one entry per row of logits ({flat.shape[0]}), got shape "
            f"{tuple(targets.shape)}"
        )
    if comm.size == 1:
        return nn.functional.cross_entropy(
            flat[:, :vocab_size].float(), t, ignore_index=ignore_index
        )
    per_row: Tensor = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        flat, t, comm, vocab_start, vocab_size, ignore_index
    )
    count = (t != ignore_index).sum().clamp(min=1)
    return per_row.sum() / count
