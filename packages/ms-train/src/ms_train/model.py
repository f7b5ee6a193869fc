"""The GPT decoder, built on ms-kernels' fused ops.

``GPT(config)`` is a decoder-only transformer described by a :class:`ModelConfig`:
token + learned position embeddings, ``n_layers`` blocks, a final LayerNorm and the
output projection (the token embedding itself when ``tie_embeddings``).

Blocks are MegaScale's *parallel* form, ``y = x + MLP(LN(x)) + Attn(LN(x))`` with one
LayerNorm shared by both branches, or GPT-2's *serial* form,
``h = x + Attn(LN1(x)); y = h + MLP(LN2(h))`` (whose middle residual add and LayerNorm
run as one fused ``add_layer_norm``).

Kernels: LayerNorm, bias + GeLU and sliding-window attention come from ms-kernels
and get ``config.kernels`` as their ``backend`` (``"auto"``: Triton / flash-attn on
CUDA, the torch paths elsewhere).

* Attention: one fused QKV ``Linear(d_model, 3 * d_model)`` whose output is laid out
  ``(3, n_heads, head_dim)`` (q, then k, then v; GPT-2's ``c_attn`` order), heads split
  to flash-attn's ``(batch, seq, heads, head_dim)``, causal, windowed to
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
``derive_seed(config.seed, name)``, then copied into place. The weights depend only
on the config and the names, not on construction order, device, dtype or how the
model is later sharded (a shard draws the full tensor with :func:`initial_value`
and slices it). Modules are built on the meta device first, so constructing a GPT
neither runs torch's default initialization nor advances the global RNG.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Final, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from ms_kernels import LayerNorm, add_layer_norm, bias_gelu, hf_window, sliding_window_attention
from ms_train.config import ModelConfig

__all__ = [
    "GELU_APPROXIMATE",
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "LinearBiasGeLU",
    "derive_seed",
    "init_parameters",
    "initial_value",
]

GELU_APPROXIMATE: Final[Literal["none", "tanh"]] = "tanh"
"""The GeLU of the MLP: the tanh approximation (GPT-2, Megatron-LM's fused bias-GeLU)."""

# Names of the parameters initialized to ones (LayerNorm gains) and of the output
# projections whose std is scaled by 1 / sqrt(2 * n_layers).
_NORM_WEIGHT = re.compile(r"(^|\.)(ln|ln\d+|ln_f)\.weight$")
_OUTPUT_PROJECTION = re.compile(r"(^|\.)(attn|mlp)\.proj\.weight$")

_META = torch.device("meta")


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
    generator = torch.Generator(device="cpu").manual_seed(derive_seed(config.seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_parameters(model: nn.Module, config: ModelConfig) -> None:
    """Set every parameter of ``model`` to :func:`initial_value` of its name.

    A parameter shared between modules (the tied embedding) is listed, and
    initialized, once, under its first name (``tok_emb.weight``).
    """
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, param.shape, config))


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
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, self.head_dim).unbind(2)
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
        a = self.attn(self.ln1(x))
        ln2 = self.ln2
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
        return h + self.mlp(y)  # type: ignore[no-any-return]


class GPT(nn.Module):
    """A GPT decoder: ``forward(tokens (B, S)) -> logits (B, S, vocab_size)``.

    Parameter names: ``tok_emb.weight``, ``pos_emb.weight``,
    ``blocks.<i>.{ln | ln1, ln2}.{weight, bias}``, ``blocks.<i>.attn.{qkv, proj}.{weight,
    bias}``, ``blocks.<i>.mlp.{fc, proj}.{weight, bias}``, ``ln_f.{weight, bias}`` and,
    untied only, ``head.weight``. Tied, there is no ``head`` module: the logits are
    ``h @ tok_emb.weight^T`` and the state_dict holds the embedding once.

    ``device`` / ``dtype`` place the parameters; the values do not depend on them
    (see :func:`init_parameters`). On ``device="meta"`` the parameters have shapes only
    (nothing is drawn), for counting parameters and checking checkpoints.
    """

    head: nn.Linear | None

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
        d = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, d, device=meta, dtype=dtype)
        self.pos_emb = nn.Embedding(config.seq_len, d, device=meta, dtype=dtype)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(config, device=meta, dtype=dtype) for _ in range(config.n_layers)
        )
        self.ln_f = LayerNorm(d, backend=config.kernels, device=meta, dtype=dtype)
        if config.tie_embeddings:
            self.head = None
        else:
            self.head = nn.Linear(d, config.vocab_size, bias=False, device=meta, dtype=dtype)
        self.to_empty(device=torch.device("cpu") if device is None else device)
        # A meta model has shapes and no values (preflight, --dry-run): drawing the
        # initial values of a 175B model on CPU would take the host's memory.
        if self.tok_emb.weight.device.type != "meta":
            init_parameters(self, config)

    @property
    def output_weight(self) -> torch.Tensor:
        """The (vocab_size, d_model) output projection: ``tok_emb.weight`` when tied."""
        return self.tok_emb.weight if self.head is None else self.head.weight

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters, a shared one counted once.

        ``exclude_embeddings``: leave out the token and position embeddings and the
        untied output projection (Kaplan et al.'s non-embedding count: blocks and the
        final LayerNorm), which is the same tied or untied.
        """
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for p in (self.tok_emb.weight, self.pos_emb.weight, self.output_weight):
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
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.output_weight)
        if targets is None:
            return logits
        flat = logits.reshape(-1, logits.shape[-1])
        if flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()
        loss = F.cross_entropy(flat, targets.reshape(-1).long())
        return logits, loss

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
