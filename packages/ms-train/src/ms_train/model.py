"""The GPT decoder, built on ms-kernels' fused ops.

``GPT(config)`` is a decoder-only transformer described by a :class:`ModelConfig`, three
plain modules in a row: :class:`Embedding` (token + learned position embeddings, tokens
to hidden states), ``n_layers`` blocks (hidden to hidden) and :class:`Head` (the final
LayerNorm, the output projection, which is the token embedding itself when
``tie_embeddings``, and the loss). ``ms_train.parallelize`` turns the same GPT into its
tensor-parallel form (``ms_train._tp_model``).

Blocks are MegaScale's *parallel* form, ``y = x + MLP(LN(x)) + Attn(LN(x))`` with one
LayerNorm shared by both branches, or GPT-2's *serial* form,
``h = x + Attn(LN1(x)); y = h + MLP(LN2(h))`` (whose middle residual add and LayerNorm
run as one fused ``add_layer_norm``).

Kernels: LayerNorm, bias + GeLU and sliding-window attention come from ms-kernels
and get ``config.kernels`` as their ``backend`` (``"auto"``: Triton / flash-attn on
CUDA, the torch paths elsewhere).

* Attention: one fused QKV ``Linear(d_model, 3 * d_model)`` whose output is laid out
  head-major, ``(n_heads, 3, head_dim)`` (each head's q, k and v together), so that a
  tensor-parallel shard of whole heads is one block of rows; heads split to
  flash-attn's ``(batch, seq, heads, head_dim)``, causal, windowed to
  ``hf_window(config.window)`` (the current token and ``window - 1`` before it) when a
  window is set; output ``Linear(d_model, d_model)``.
* MLP: ``fc`` holds ``weight`` (ffn_size x d_model) and ``bias`` but the GEMM runs
  without the bias; ``bias_gelu(x @ W^T, bias)`` adds it inside the fused activation.
  The GeLU is the tanh approximation (:data:`GELU_APPROXIMATE`), as in GPT-2 and
  Megatron-LM's fused bias-GeLU. Then ``proj: Linear(ffn_size, d_model)``.
* Dropout (``config.dropout``) on the embeddings, the attention output and the MLP
  output; none inside attention (the fused kernels have no probability dropout).

Initialization (:func:`init_parameters`) is seeded per parameter by name: each
parameter is drawn, on CPU in float32, from a generator seeded by
``derive_seed(config.seed, name)``, then copied into place (``name`` as ms-train 0.4
named it, and the QKV weight drawn in 0.4's ``(3, n_heads, head_dim)`` order and then
permuted, so a GPT starts as 0.4's did).

Checkpoints of ms-train 0.4 (top-level ``tok_emb``, ``pos_emb``, ``ln_f``, ``head``; QKV
rows q-major) load: ``load_state_dict`` renames their keys and permutes their QKV rows
(:func:`upgrade_state_dict`). The weights depend only
on the config and the names, not on construction order, device, dtype or how the
model is later sharded (a shard draws the full tensor with :func:`initial_value`
and slices it). Modules are built on the meta device first, so constructing a GPT
neither runs torch's default initialization nor advances the global RNG.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from ms_kernels import LayerNorm, add_layer_norm, bias_gelu, hf_window, sliding_window_attention
from ms_train.config import ModelConfig

if TYPE_CHECKING:
    from ms_train._tp_model import TPEmbedding, TPHead

__all__ = [
    "GELU_APPROXIMATE",
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Embedding",
    "Head",
    "LinearBiasGeLU",
    "derive_seed",
    "init_parameters",
    "initial_value",
    "optimizer_state_upgrade",
    "qkv_head_major",
    "upgrade_state_dict",
]

GELU_APPROXIMATE: Final[Literal["none", "tanh"]] = "tanh"
"""The GeLU of the MLP: the tanh approximation (GPT-2, Megatron-LM's fused bias-GeLU)."""

# Names of the parameters initialized to ones (LayerNorm gains) and of the output
# projections whose std is scaled by 1 / sqrt(2 * n_layers).
_NORM_WEIGHT = re.compile(r"(^|\.)(ln|ln\d+|ln_f)\.weight$")
_OUTPUT_PROJECTION = re.compile(r"(^|\.)(attn|mlp)\.proj\.weight$")

_META = torch.device("meta")

# ms-train 0.4's names of the parameters outside the blocks: the seeds are drawn from
# them, and its checkpoints are read through them.
_RENAMED = (
    ("embed.tok_emb.", "tok_emb."),
    ("embed.pos_emb.", "pos_emb."),
    ("head.ln_f.", "ln_f."),
    ("head.proj.weight", "head.weight"),
)
_QKV = re.compile(r"(^|\.)attn\.qkv\.(weight|bias)$")


def _legacy_name(name: str) -> str:
    for new, old in _RENAMED:
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def qkv_head_major(t: torch.Tensor, n_heads: int, *, inverse: bool = False) -> torch.Tensor:
    """QKV rows (dim 0) from 0.4's ``(3, n_heads, head_dim)`` order to ``(n_heads, 3,
    head_dim)``; ``inverse`` goes back. Works on the weight, the bias and any per-element
    optimizer state of either."""
    rows = t.shape[0]
    head_dim = rows // (3 * n_heads)
    if rows != 3 * n_heads * head_dim:
        raise ValueError(
            f"a QKV tensor must have 3 * n_heads * head_dim rows (n_heads = {n_heads}), got "
            f"shape {tuple(t.shape)}"
        )
    src = (n_heads, 3) if inverse else (3, n_heads)
    grid = t.reshape(*src, head_dim, *t.shape[1:])
    return grid.transpose(0, 1).reshape(t.shape).contiguous()


def upgrade_state_dict(state: dict[str, Any], n_heads: int, prefix: str = "") -> bool:
    """Rewrite, in place, a GPT state dict saved by ms-train 0.4 (its keys under
    ``prefix``) into today's form: keys renamed, QKV rows permuted head-major. Returns
    whether it was one (a state with today's keys is left as it is)."""
    if prefix + "tok_emb.weight" not in state:
        return False
    for key in list(state):
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        new = next((n + name[len(o) :] for n, o in _RENAMED if name.startswith(o)), name)
        value = state.pop(key)
        if _QKV.search(name) and isinstance(value, torch.Tensor):
            value = qkv_head_major(value, n_heads)
        state[prefix + new] = value
    return True


def derive_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: a stable 63-bit hash of both.

    SHA-256 of ``"<seed>:<name>"`` (not Python's ``hash``, which is salted per process),
    so every process, rank and run derives the same seed.
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def initial_value(
    name: str, shape: tuple[int, ...] | torch.Size, config: ModelConfig
) -> torch.Tensor:
    """The initial value of parameter ``name`` (a ``GPT.named_parameters()`` name), full size.

    A CPU float32 tensor: zeros for biases, ones for LayerNorm weights, otherwise
    ``N(0, init_std)`` (``init_std / sqrt(2 * n_layers)`` for the output projections
    ``attn.proj`` and ``mlp.proj``) drawn from ``derive_seed(config.seed, name)``.
    """
    shape = tuple(shape)
    if name == "bias" or name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.float32)
    if _NORM_WEIGHT.search(name):
        return torch.ones(shape, dtype=torch.float32)
    std = config.init_std
    if _OUTPUT_PROJECTION.search(name):
        std /= math.sqrt(2 * config.n_layers)
    seed = derive_seed(config.seed, _legacy_name(name))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    value = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    if _QKV.search(name):  # drawn in 0.4's row order, so a GPT starts as 0.4's did
        value = qkv_head_major(value, config.n_heads)
    return value


@torch.no_grad()
def init_parameters(model: nn.Module, config: ModelConfig) -> None:
    """Set every parameter of ``model`` to :func:`initial_value` of its name.

    A parameter shared between modules (the tied embedding) is listed, and
    initialized, once, under its first name (``embed.tok_emb.weight``).
    """
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, param.shape, config))


def optimizer_state_upgrade(
    config: ModelConfig,
) -> Callable[[str, torch.Tensor | None], tuple[str, torch.Tensor | None]]:
    """For ms-parallel's ZeRO: a parameter's name and flattened optimizer state in an
    ms-train 0.4 checkpoint to today's (renamed, QKV rows head-major)."""
    d = config.d_model

    def upgrade(name: str, flat: torch.Tensor | None) -> tuple[str, torch.Tensor | None]:
        new = next((n + name[len(o) :] for n, o in _RENAMED if name.startswith(o)), name)
        if flat is not None and _QKV.search(new):
            rows = qkv_head_major(flat.reshape(3 * d, -1), config.n_heads)
            flat = rows.reshape(flat.shape)
        return new, flat

    return upgrade


class CausalSelfAttention(nn.Module):
    """Fused QKV projection, causal (optionally sliding-window) attention, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.window = hf_window(config.window) if config.window is not None else None
        self.backend = config.kernels
        self.qkv = nn.Linear(d, 3 * d, bias=True, device=device, dtype=dtype)
        self.proj = nn.Linear(d, d, bias=True, device=device, dtype=dtype)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, self.n_heads, 3, self.head_dim).unbind(3)
        out = sliding_window_attention(
            q, k, v, window=self.window, causal=True, backend=self.backend
        )
        return self.drop(self.proj(out.reshape(b, s, d)))  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, window={self.window}, backend={self.backend!r}"


class LinearBiasGeLU(nn.Module):
    """``gelu(x @ weight^T + bias)``: the GEMM without its bias, then ms-kernels' fused
    ``bias_gelu``. Parameters and state_dict keys as ``nn.Linear`` (``weight``, ``bias``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        approximate: Literal["none", "tanh"] = GELU_APPROXIMATE,
        backend: Literal["auto", "torch", "triton"] = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.approximate: Literal["none", "tanh"] = approximate
        self.backend: Literal["auto", "torch", "triton"] = backend
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype)
        )
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default initialization, for use outside ``GPT`` (which replaces it)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.weight)
        # Under autocast the GEMM comes out in the autocast dtype; the bias follows it.
        bias = self.bias if self.bias.dtype == h.dtype else self.bias.to(h.dtype)
        return bias_gelu(h, bias, self.approximate, backend=self.backend)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"approximate={self.approximate!r}, backend={self.backend!r}"
        )


class MLP(nn.Module):
    """``proj(gelu(fc(x)))`` with the bias + GeLU fused, then dropout."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.fc = LinearBiasGeLU(
            config.d_model, config.ffn_size, backend=config.kernels, device=device, dtype=dtype
        )
        self.proj = nn.Linear(config.ffn_size, config.d_model, device=device, dtype=dtype)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.fc(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    """A transformer block, parallel (one shared ``ln``) or serial (``ln1``, ``ln2``)."""

    ln: LayerNorm | None
    ln1: LayerNorm | None
    ln2: LayerNorm | None

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.parallel = config.block == "parallel"

        def norm() -> LayerNorm:
            return LayerNorm(config.d_model, backend=config.kernels, device=device, dtype=dtype)

        if self.parallel:
            self.ln, self.ln1, self.ln2 = norm(), None, None
        else:
            self.ln, self.ln1, self.ln2 = None, norm(), None
        self.attn = CausalSelfAttention(config, device=device, dtype=dtype)
        if not self.parallel:
            self.ln2 = norm()  # registered after attn: the serial order, ln1, attn, ln2, mlp
        self.mlp = MLP(config, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ln is not None:
            h = self.ln(x)
            return x + self.mlp(h) + self.attn(h)  # type: ignore[no-any-return]
        assert self.ln1 is not None and self.ln2 is not None
        return serial_block_forward(x, self.ln1, self.attn, self.ln2, self.mlp)


def serial_block_forward(
    x: torch.Tensor, ln1: LayerNorm, attn: nn.Module, ln2: LayerNorm, mlp: nn.Module
) -> torch.Tensor:
    """``h = x + attn(ln1(x))``, then ``h + mlp(ln2(h))``: the serial block, whole or
    on a sequence shard (ms_train._tp_model's TP block)."""
    a = attn(ln1(x))
    # h = x + a and LN2(h) in one fused op.
    # Under autocast ``a`` is in the autocast dtype; the residual stream keeps x's.
    y, h = add_layer_norm(
        a.to(x.dtype),
        x,
        ln2.normalized_shape,
        ln2.weight,
        ln2.bias,
        ln2.eps,
        backend=ln2.backend,
    )
    return h + mlp(y)  # type: ignore[no-any-return]


class Embedding(nn.Module):
    """Tokens ``(B, S)`` to hidden states ``(B, S, d_model)``: token plus learned position
    embeddings, then dropout."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        d = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, d, device=device, dtype=dtype)
        self.pos_emb = nn.Embedding(config.seq_len, d, device=device, dtype=dtype)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tok_emb(tokens) + self.pos_emb(positions))  # type: ignore[no-any-return]


class Head(nn.Module):
    """Hidden states to logits, and with targets the mean cross-entropy: the final
    LayerNorm, then the output projection (``proj``, or with tied embeddings the token
    embedding's weight, which the caller passes as ``weight``)."""

    proj: nn.Linear | None

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        d = config.d_model
        self.ln_f = LayerNorm(d, backend=config.kernels, device=device, dtype=dtype)
        if config.tie_embeddings:
            self.proj = None
        else:
            self.proj = nn.Linear(d, config.vocab_size, bias=False, device=device, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        weight: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        w = self.proj.weight if self.proj is not None else weight
        if w is None:
            raise ValueError("a Head with tied embeddings needs weight=, the token embedding's")
        logits = F.linear(self.ln_f(x), w)
        if targets is None:
            return logits
        flat = logits.reshape(-1, logits.shape[-1])
        if flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()
        return logits, F.cross_entropy(flat, targets.reshape(-1).long())


class GPT(nn.Module):
    """A GPT decoder: ``forward(tokens (B, S)) -> logits (B, S, vocab_size)``.

    Three modules in a row: ``embed`` (:class:`Embedding`), ``blocks`` and ``head``
    (:class:`Head`). Parameter names: ``embed.tok_emb.weight``, ``embed.pos_emb.weight``,
    ``blocks.<i>.{ln | ln1, ln2}.{weight, bias}``, ``blocks.<i>.attn.{qkv, proj}.{weight,
    bias}``, ``blocks.<i>.mlp.{fc, proj}.{weight, bias}``, ``head.ln_f.{weight, bias}`` and,
    untied only, ``head.proj.weight``. Tied, the logits are ``h @ tok_emb.weight^T`` and
    the state_dict holds the embedding once.

    ``device`` / ``dtype`` place the parameters; the values do not depend on them
    (see :func:`init_parameters`). On ``device="meta"`` the parameters have shapes only
    (nothing is drawn), for counting parameters and checking checkpoints.
    """

    # ms_train.parallelize swaps these for their tensor-parallel forms, in the same roles.
    embed: Embedding | TPEmbedding
    head: Head | TPHead

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        # Built on the meta device: no default initialization, no global RNG draws.
        meta = _META
        self.embed = Embedding(config, device=meta, dtype=dtype)
        self.blocks = nn.ModuleList(
            Block(config, device=meta, dtype=dtype) for _ in range(config.n_layers)
        )
        self.head = Head(config, device=meta, dtype=dtype)
        # Sequence lengths the modules need: parallelize() sets the TP size (sequence
        # parallelism splits the sequence); logits-only calls are padded up to it.
        self.seq_multiple = 1
        #: The tensor-parallel chunk plan (``ms_parallel.ChunkTuner``), set by parallelize().
        self.chunk_tuner: Any = None
        self.to_empty(device=torch.device("cpu") if device is None else device)
        # A meta model has shapes and no values (preflight, --dry-run): drawing the
        # initial values of a 175B model on CPU would take the host's memory.
        if self.embed.tok_emb.weight.device.type != "meta":
            init_parameters(self, config)
        # 0.4's checkpoints: renamed keys, QKV rows in the old order.
        self.register_load_state_dict_pre_hook(self._upgrade)  # type: ignore[no-untyped-call]

    def _upgrade(self, module: nn.Module, state: dict[str, Any], prefix: str, *rest: Any) -> None:
        upgrade_state_dict(state, self.config.n_heads, prefix)

    @property
    def output_weight(self) -> torch.Tensor:
        """The (vocab_size, d_model) output projection: ``embed.tok_emb.weight`` when tied."""
        proj = self.head.proj
        return self.embed.tok_emb.weight if proj is None else proj.weight

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters, a shared one counted once.

        ``exclude_embeddings``: leave out the token and position embeddings and the
        untied output projection (Kaplan et al.'s non-embedding count: blocks and the
        final LayerNorm), which is the same tied or untied.
        """
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for p in (self.embed.tok_emb.weight, self.embed.pos_emb.weight, self.output_weight):
                params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    def _check_inputs(self, tokens: torch.Tensor, targets: torch.Tensor | None) -> None:
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"tokens must be int64 or int32 token ids, got dtype {tokens.dtype} "
                f"(shape {tuple(tokens.shape)})"
            )
        if tokens.dim() != 2 or not 1 <= tokens.shape[1] <= self.config.seq_len:
            raise ValueError(
                f"tokens must have shape (batch, seq) with 1 <= seq <= seq_len="
                f"{self.config.seq_len}, got shape {tuple(tokens.shape)}"
            )
        if targets is None:
            return
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
        if targets.dtype not in (torch.int64, torch.int32) or targets.shape != tokens.shape:
            raise ValueError(
                f"targets must be int64 or int32 with the shape of tokens {tuple(tokens.shape)}, "
                f"got dtype {targets.dtype} and shape {tuple(targets.shape)}"
            )

    @overload
    def forward(self, tokens: torch.Tensor, targets: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, S, vocab_size); with ``targets`` (B, S), also the mean cross-entropy.

        Target ``-100`` is ignored (``F.cross_entropy``'s ``ignore_index``). Token ids
        are not range-checked here (that would synchronize with the GPU): an id outside
        ``[0, vocab_size)`` fails inside the embedding lookup.
        """
        self._check_inputs(tokens, targets)
        length = tokens.shape[1]
        pad = -length % self.seq_multiple
        if targets is None and pad:
            # Causal: tokens appended after the last change no logit before them.
            tokens = F.pad(tokens, (0, pad))
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        out = self.head(x, targets, weight=self.output_weight)
        if targets is None and pad:
            return out[:, :length]  # type: ignore[no-any-return]
        return out  # type: ignore[no-any-return]

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``prompt`` (B, P) followed by ``max_new_tokens`` sampled tokens, (B, P + n).

        Each step runs the model on the last ``seq_len`` tokens (no KV cache: meant for
        short samples) and samples the next token from ``softmax(logits / temperature)``
        restricted to the ``top_k`` most likely; ``temperature=0`` takes the argmax.
        """
        self._check_inputs(prompt, None)
        if type(max_new_tokens) is not int or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not (isinstance(temperature, (int, float)) and temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        if top_k is not None and (type(top_k) is not int or top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
        tokens = prompt
        for _ in range(max_new_tokens):
            logits = self(tokens[:, -self.config.seq_len :])[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat([tokens, nxt.to(tokens.dtype)], dim=1)
        return tokens
