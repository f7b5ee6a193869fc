"""The GPT's tensor-parallel form: :func:`parallelize` swaps each of its modules for one
holding this rank's shards, under the same names.

Between modules the hidden states are ``(seq / tp, batch, d_model)``: split along the
sequence over the TP group (sequence parallelism), sequence first so that a shard is a
contiguous block of rows. Heads are split over the group (whole heads per rank: the QKV
rows are head-major), and so are the FFN's hidden units and the vocabulary.

- :class:`TPEmbedding`: a vocabulary-parallel lookup, one reduce-scatter to the sequence
  shard, the position embeddings of this rank's positions;
- :class:`TPBlock`, parallel form: ``LN(x)`` is gathered once for QKV and FC as one
  column-parallel GEMM, the attention and MLP projections are summed before one
  reduce-scatter; serial form: a gather and a reduce-scatter around each of attention and
  MLP (two of each);
- :class:`TPHead`: the final LayerNorm on the shard, the vocabulary-parallel projection
  and cross-entropy (the logits are never gathered for the loss).

Dropout draws the TP 1 model's mask of the whole ``(B, S, d_model)`` tensor on every TP
rank, from the generator they share (ms-train seeds a replica's TP ranks alike), and
each rank keeps its part: the masks of a sequence shard differ between the ranks (each
holds other positions), those of the parallel block's partial sums, which are
reduce-scattered, agree (every rank holds the whole sequence); and a TP run draws the
masks of the TP 1 run with the same generator state (on CPU, where ``nn.Dropout`` draws
the same Bernoulli stream). The price: each rank draws ``tp`` times the random numbers
of its shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ms_kernels import LayerNorm, bias_gelu, sliding_window_attention
from ms_parallel import ChunkTuner, TPComm
from ms_parallel.tensor_parallel import (
    Chunks,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_matmuls,
    gathered_matmuls,
    mark_replicated,
    row_parallel_matmuls,
    tp_spec,
    vocab_parallel_cross_entropy,
)
from ms_train.config import ConfigError, ModelConfig
from ms_train.model import (
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    Embedding,
    Head,
    serial_block_forward,
)

__all__ = ["TPBlock", "TPEmbedding", "TPHead", "check_tp", "parallelize"]


def check_tp(config: ModelConfig, tp: int) -> None:
    """Refuse a model that ``tp`` ranks cannot split, naming the numbers."""
    for what, size in (
        ("model.n_heads", config.n_heads),
        ("model.ffn_size", config.ffn_size),
        ("model.seq_len", config.seq_len),
    ):
        if size % tp:
            raise ConfigError(
                f"{what} ({size}) must divide by parallel.tp ({tp}): tensor parallelism "
                f"splits it over the TP ranks (a remainder of {size % tp})"
            )


def _whole_mask(drop: nn.Module, s: int, b: int, d: int, like: Tensor) -> Tensor | None:
    """The TP 1 model's dropout mask of a ``(b, s, d)`` tensor, scaled by ``1 / (1 - p)``,
    as ``(s, b, d)``; None when ``drop`` is off (eval, or p = 0)."""
    p = float(getattr(drop, "p", 0.0))
    if not drop.training or p == 0.0:
        return None
    keep = torch.empty((b, s, d), device=like.device, dtype=like.dtype)
    if p == 1.0:
        return keep.zero_().transpose(0, 1)
    return keep.bernoulli_(1.0 - p).div_(1.0 - p).transpose(0, 1)


def _shard_dropout(drop: nn.Module, x: Tensor, comm: TPComm) -> Tensor:
    """Dropout of this rank's sequence shard ``x`` ``(s / tp, B, d)``: its rows of the
    whole tensor's mask."""
    part, b, d = x.shape
    mask = _whole_mask(drop, part * comm.size, b, d, x)
    if mask is None:
        return x
    return x * mask[comm.rank * part : (comm.rank + 1) * part]


def _load(dst: nn.Parameter, src: Tensor) -> None:
    """``dst`` (this rank's padded shard) from the whole parameter ``src``, by its spec."""
    if src.device.type == "meta" or dst.device.type == "meta":
        return
    spec = tp_spec(dst)
    with torch.no_grad():
        dst.copy_(src if spec is None else spec.from_state(src.detach(), dst.detach(), "init"))


class TPEmbedding(nn.Module):
    """Tokens ``(B, S)`` to this rank's sequence shard ``(S / tp, B, d_model)``."""

    def __init__(self, embed: Embedding, config: ModelConfig, comm: TPComm) -> None:
        super().__init__()
        src_tok, src_pos = embed.tok_emb, embed.pos_emb
        w = src_tok.weight
        self.comm = comm
        self.tok_emb = VocabParallelEmbedding(
            config.vocab_size, config.d_model, comm, device=w.device, dtype=w.dtype
        )
        _load(self.tok_emb.weight, w)
        self.pos_emb = src_pos  # whole on every rank; a shard of positions is looked up
        mark_replicated(self.pos_emb, comm)
        self.drop = embed.drop

    def forward(self, tokens: Tensor) -> Tensor:
        s = tokens.shape[1]
        if s % self.comm.size:
            raise ValueError(
                f"tokens' sequence length ({s}) must divide by the tensor-parallel size "
                f"{self.comm.size} (sequence parallelism splits it)"
            )
        x = self.tok_emb(tokens.t())  # (S / tp, B, d): summed over the group and split
        part = s // self.comm.size
        start = self.comm.rank * part
        positions = torch.arange(start, start + part, device=tokens.device)
        return _shard_dropout(self.drop, x + self.pos_emb(positions).unsqueeze(1), self.comm)


class _TPAttention(nn.Module):
    def __init__(
        self,
        attn: CausalSelfAttention,
        config: ModelConfig,
        comm: TPComm,
        chunks: Chunks,
        overlap: bool,
    ) -> None:
        super().__init__()
        d, tp = config.d_model, comm.size
        self.n_heads = config.n_heads // tp
        self.head_dim = config.head_dim
        self.window = attn.window
        self.backend = attn.backend
        w = attn.qkv.weight
        kw: dict[str, Any] = {
            "chunks": chunks,
            "overlap": overlap,
            "device": w.device,
            "dtype": w.dtype,
        }
        self.comm = comm
        self.qkv = ColumnParallelLinear(d, 3 * d, comm, **kw)
        self.proj = RowParallelLinear(d, d, comm, **kw)
        for name in ("weight", "bias"):
            _load(getattr(self.qkv, name), getattr(attn.qkv, name))
            _load(getattr(self.proj, name), getattr(attn.proj, name))
        self.drop = attn.drop

    def attend(self, qkv: Tensor) -> Tensor:
        """``(S, B, heads * 3 * head_dim)`` with the bias added -> ``(S, B, heads * head_dim)``."""
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.n_heads, 3, self.head_dim).unbind(3)
        out = sliding_window_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            window=self.window,
            causal=True,
            backend=self.backend,
        )
        return out.transpose(0, 1).reshape(s, b, self.n_heads * self.head_dim)

    def forward(self, x: Tensor) -> Tensor:
        a = self.attend(self.qkv(x))
        return _shard_dropout(self.drop, self.proj(a), self.comm)


class _TPMLP(nn.Module):
    def __init__(
        self, mlp: MLP, config: ModelConfig, comm: TPComm, chunks: Chunks, overlap: bool
    ) -> None:
        super().__init__()
        d, f = config.d_model, config.ffn_size
        w = mlp.fc.weight
        kw: dict[str, Any] = {
            "chunks": chunks,
            "overlap": overlap,
            "device": w.device,
            "dtype": w.dtype,
        }
        self.comm = comm
        self.fc = ColumnParallelLinear(d, f, comm, **kw)
        self.proj = RowParallelLinear(f, d, comm, **kw)
        for name in ("weight", "bias"):
            _load(getattr(self.fc, name), getattr(mlp.fc, name))
            _load(getattr(self.proj, name), getattr(mlp.proj, name))
        self.approximate = mlp.fc.approximate
        self.backend = mlp.fc.backend
        self.drop = mlp.drop

    def hidden(self, h: Tensor) -> Tensor:
        """``gelu(h_fc + bias)`` of the FC GEMM's output ``h_fc``."""
        bias = self.fc.bias
        assert bias is not None
        return bias_gelu(h, bias.to(h.dtype), self.approximate, backend=self.backend)

    def forward(self, x: Tensor) -> Tensor:
        return _shard_dropout(self.drop, self.proj(self.hidden(self.fc.matmul(x))), self.comm)


class TPBlock(nn.Module):
    """A transformer block on the sequence shard ``(S / tp, B, d_model)``."""

    ln: LayerNorm | None
    ln1: LayerNorm | None
    ln2: LayerNorm | None

    def __init__(
        self, block: Block, config: ModelConfig, comm: TPComm, *, chunks: Chunks, overlap: bool
    ) -> None:
        super().__init__()
        self.parallel = block.parallel
        self.comm = comm
        ln, ln1, ln2 = block.ln, block.ln1, block.ln2
        if ln is not None:
            self.ln, self.ln1, self.ln2 = ln, None, None
            mark_replicated(ln, comm)
        else:
            assert ln1 is not None and ln2 is not None
            self.ln, self.ln1, self.ln2 = None, ln1, None
            mark_replicated(ln1, comm)
        self.attn = _TPAttention(block.attn, config, comm, chunks, overlap)
        if ln2 is not None:  # registered after attn, as in Block: the serial order
            self.ln2 = ln2
            mark_replicated(ln2, comm)
        self.mlp = _TPMLP(block.mlp, config, comm, chunks, overlap)

    def forward(self, x: Tensor) -> Tensor:
        if self.ln is not None:
            h = self.ln(x)
            attn, mlp = self.attn, self.mlp
            qkv, fc = column_parallel_matmuls(h, [attn.qkv, mlp.fc])  # one gather
            qkv_bias = attn.qkv.bias
            assert qkv_bias is not None
            a = attn.attend(qkv + qkv_bias.to(qkv.dtype))
            hidden = mlp.hidden(fc)
            # The branches are summed before their one reduce-scatter: each one's dropout
            # mask multiplies its partial sums, the whole sequence's, alike on every
            # rank (drawn in the TP 1 block's order: the MLP's first).
            s, b = hidden.shape[:2]
            d = attn.proj.out_features
            m_mask = _whole_mask(mlp.drop, s, b, d, hidden)
            a_mask = _whole_mask(attn.drop, s, b, d, a)
            scales = None if a_mask is None and m_mask is None else [a_mask, m_mask]
            y = row_parallel_matmuls([a, hidden], [attn.proj, mlp.proj], scales)  # one RS
            return x + y
        assert self.ln1 is not None and self.ln2 is not None
        return serial_block_forward(x, self.ln1, self.attn, self.ln2, self.mlp)


class TPHead(nn.Module):
    """This rank's sequence shard to the loss (vocabulary-parallel cross-entropy), or,
    without targets, to the whole logits ``(B, S, vocab_size)`` (gathered; for sampling)."""

    proj: ColumnParallelLinear | None

    def __init__(
        self, head: Head, config: ModelConfig, comm: TPComm, *, chunks: Chunks, overlap: bool
    ) -> None:
        super().__init__()
        self.comm, self.chunks, self.overlap = comm, chunks, overlap
        self.vocab_size = config.vocab_size
        self.ln_f = head.ln_f
        mark_replicated(self.ln_f, comm)
        self.proj = None
        if head.proj is not None:
            w = head.proj.weight
            self.proj = ColumnParallelLinear(
                config.d_model,
                config.vocab_size,
                comm,
                bias=False,
                chunks=chunks,
                overlap=overlap,
                pad=True,
                device=w.device,
                dtype=w.dtype,
            )
            _load(self.proj.weight, w)

    def forward(
        self, x: Tensor, targets: Tensor | None = None, *, weight: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        w = self.proj.weight if self.proj is not None else weight
        if w is None:
            raise ValueError("a TPHead with tied embeddings needs weight=, the token embedding's")
        (logits,) = gathered_matmuls(
            self.ln_f(x), [w], self.comm, chunks=self.chunks, overlap=self.overlap
        )
        logits = logits.transpose(0, 1)  # (B, S, this rank's vocabulary columns)
        start = self.comm.rank * w.shape[0]
        if targets is None:
            return _gather_vocab(logits, self.comm, self.vocab_size)
        loss = vocab_parallel_cross_entropy(
            logits, targets, self.comm, vocab_start=start, vocab_size=self.vocab_size
        )
        return logits, loss


def _gather_vocab(logits: Tensor, comm: TPComm, vocab_size: int) -> Tensor:
    """Every rank's vocabulary columns side by side, padding dropped (forward only)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        raise RuntimeError(
            "the whole logits of a tensor-parallel GPT are gathered for sampling only "
            "(no gradient); train with targets, which use the vocabulary-parallel loss"
        )
    local = logits.contiguous()
    cols = comm.wait(
        comm.gather(local.permute(2, 0, 1).contiguous(), "all_gather", 0, 1, "forward"), "forward"
    )
    # (tp, cols, B, S) -> (B, S, tp * cols)
    whole = cols.permute(2, 3, 0, 1).reshape(*local.shape[:2], -1)
    return whole[..., :vocab_size]


def parallelize(
    model: nn.Module,
    tp_mesh: Any,
    *,
    chunks: int | ChunkTuner | None = None,
    overlap: bool = True,
    timeout_s: float = 600.0,
    on_event: Any = None,
) -> nn.Module:
    """Turn ``model`` (an ``ms_train.GPT``) into its tensor-parallel form over ``tp_mesh``
    (``mesh["tp"]``, or a process group), in place, and return it.

    Each rank keeps its shards of the current weights (from a meta model, nothing is
    copied). The state dict keeps the TP 1 model's keys and global shapes, as
    ``DTensor``s on the mesh.

    Args:
        chunks: pieces of every collective matmul: a count, or a
            :class:`~ms_parallel.ChunkTuner` that measures the best count of each shape
            on first sight; None (default): a new tuner agreeing over the default group
            (every rank must run the model's layers in lockstep, as data-parallel
            replicas do), kept as ``model.chunk_tuner`` (checkpoint it: its plan keeps
            a resumed run's counts, and so its sums).
        overlap: False runs the unfused reference path (one collective, waited, then
            the GEMMs).
        timeout_s: the bound of every TP wait.
        on_event: gets every TP collective's issue and wait and every chunk's GEMM.
    """

    if not isinstance(model, GPT):
        raise TypeError(f"model must be an ms_train.GPT, got {type(model).__name__}")
    comm = TPComm(tp_mesh, timeout_s=timeout_s, on_event=on_event)
    config = model.config
    check_tp(config, comm.size)
    if chunks is None:
        # Every replica's TP group meets the same shapes: they all agree on the counts,
        # which go into one checkpoint.
        chunks = ChunkTuner(group=dist.group.WORLD if dist.is_initialized() else None)
    if comm.size == 1:
        return model
    embed, head, blocks = model.embed, model.head, list(model.blocks)
    if not (
        isinstance(embed, Embedding)
        and isinstance(head, Head)
        and all(isinstance(b, Block) for b in blocks)
    ):
        raise ValueError("model is tensor-parallel already (parallelize it once)")
    model.embed = TPEmbedding(embed, config, comm.with_label("embedding"))
    model.blocks = nn.ModuleList(
        TPBlock(b, config, comm.with_label(f"block {i}"), chunks=chunks, overlap=overlap)
        for i, b in enumerate(blocks)
        if isinstance(b, Block)
    )
    model.head = TPHead(head, config, comm.with_label("head"), chunks=chunks, overlap=overlap)
    model.seq_multiple = comm.size
    if isinstance(chunks, ChunkTuner):
        model.chunk_tuner = chunks
    return model
