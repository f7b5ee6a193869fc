"""ms_train.model: the GPT against a plain-PyTorch reference, seeded init, tying, errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ms_train.config import ConfigError, ModelConfig
from ms_train.model import (
    GELU_APPROXIMATE,
    GPT,
    derive_seed,
    init_parameters,
    initial_value,
    qkv_head_major,
    upgrade_state_dict,
)

TINY: dict[str, Any] = {"vocab_size": 50, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16}


def tiny(**overrides: Any) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


# --- the reference: the same math in plain PyTorch, the same parameter names -------------


class RefAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h, hd = self.c.n_heads, self.c.head_dim
        q, k, v = self.qkv(x).split(d, dim=-1)  # q | k | v, each heads-major
        q, k, v = (t.reshape(b, s, h, hd).transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        i = torch.arange(s).unsqueeze(1)
        j = torch.arange(s).unsqueeze(0)
        allowed = j <= i
        if self.c.window is not None:
            allowed &= j > i - self.c.window  # W tokens, the current one included
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, s, d)
        return self.proj(out)  # type: ignore[no-any-return]


class RefMLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(c.d_model, c.ffn_size)
        self.proj = nn.Linear(c.ffn_size, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(x @ self.fc.weight.T + self.fc.bias, approximate=GELU_APPROXIMATE)
        return self.proj(hidden)  # type: ignore[no-any-return]


class RefBlock(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.parallel = c.block == "parallel"
        d = c.d_model
        if self.parallel:
            self.ln = nn.LayerNorm(d)
        else:
            self.ln1 = nn.LayerNorm(d)
            self.ln2 = nn.LayerNorm(d)
        self.attn = RefAttention(c)
        self.mlp = RefMLP(c)

    @staticmethod
    def _ln(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            h = self._ln(self.ln, x)
            return x + self.mlp(h) + self.attn(h)  # type: ignore[no-any-return]
        h = x + self.attn(self._ln(self.ln1, x))
        return h + self.mlp(self._ln(self.ln2, h))  # type: ignore[no-any-return]


class ReferenceGPT(nn.Module):
    """Plain PyTorch, explicit-softmax attention with a boolean mask; ms-train 0.4's
    state_dict keys and QKV row order (q | k | v), which a GPT loads."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(RefBlock(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        x = F.layer_norm(x, self.ln_f.normalized_shape, self.ln_f.weight, self.ln_f.bias)
        w = self.tok_emb.weight if self.head is None else self.head.weight
        return x @ w.T


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out[name] = p.grad
    return out


def _run(
    model: nn.Module, tokens: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    (logits * weights).sum().backward()
    return logits.detach(), _grads(model)


@pytest.mark.parametrize("block", ["parallel", "serial"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["f64", "f32"]
)
def test_matches_reference(
    block: str, window: int | None, tie: bool, dtype: torch.dtype, tol: float
) -> None:
    config = tiny(block=block, window=window, tie_embeddings=tie, seed=3)
    reference = ReferenceGPT(config).to(dtype)
    model = GPT(config, dtype=dtype)
    # A 0.4 state dict (the reference's) loads: keys renamed, QKV rows permuted.
    model.load_state_dict(reference.state_dict(), strict=True)
    assert len(dict(model.named_parameters())) == len(dict(reference.named_parameters()))

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (3, 8), generator=gen)
    weights = torch.randn(3, 8, config.vocab_size, generator=gen, dtype=dtype)
    logits, grads = _run(model, tokens, weights)
    ref_logits, ref_grads = _run(reference, tokens, weights)

    assert logits.shape == (3, 8, config.vocab_size) and logits.dtype == dtype
    torch.testing.assert_close(logits, ref_logits, rtol=tol, atol=tol)
    upgrade_state_dict(ref_grads, config.n_heads)  # the same names and row order
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=tol, atol=tol, msg=name)
        assert grad.abs().sum() > 0, name  # every parameter is used


def test_qkv_rows_are_head_major_and_the_permutation_inverts() -> None:
    c = tiny()
    d, h, hd = c.d_model, c.n_heads, c.head_dim
    legacy = torch.arange(3 * d, dtype=torch.float64).unsqueeze(1).expand(3 * d, 2)
    new = qkv_head_major(legacy, h)
    # row (head i, part j, e) of the new order is row (j, i, e) of 0.4's
    for i in range(h):
        for j in range(3):
            rows = new[(i * 3 + j) * hd : (i * 3 + j + 1) * hd, 0]
            start = j * d + i * hd
            assert torch.equal(rows, torch.arange(start, start + hd, dtype=torch.float64))
    assert torch.equal(qkv_head_major(new, h, inverse=True), legacy)
    with pytest.raises(ValueError, match=r"3 \* n_heads \* head_dim rows \(n_heads = 4\)"):
        qkv_head_major(torch.zeros(10), h)


def test_a_04_state_dict_upgrades_and_todays_is_left_alone() -> None:
    model = GPT(tiny(tie_embeddings=False))
    today = model.state_dict()
    assert not upgrade_state_dict(dict(today), 4)
    old = ReferenceGPT(tiny(tie_embeddings=False)).state_dict()
    assert {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "head.weight"} <= set(old)
    assert upgrade_state_dict(old, 4)
    assert set(old) == set(today)
    assert "embed.tok_emb.weight" in old and "head.proj.weight" in old


def test_loss_is_mean_cross_entropy() -> None:
    config = tiny()
    model = GPT(config, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (2, 16), generator=gen)
    targets = torch.randint(0, 50, (2, 16), generator=gen)
    logits, loss = model(tokens, targets)
    expected = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(model(tokens), logits, rtol=0, atol=0)
    # int32 tokens work as int64 do
    torch.testing.assert_close(model(tokens.int()), logits, rtol=0, atol=0)


def test_block_layer_norms() -> None:
    parallel = set(GPT(tiny(block="parallel")).state_dict())
    serial = set(GPT(tiny(block="serial")).state_dict())
    assert {"blocks.0.ln.weight", "blocks.0.ln.bias"} <= parallel
    assert not any(".ln1." in k or ".ln2." in k for k in parallel)
    assert {"blocks.0.ln1.weight", "blocks.0.ln2.weight", "blocks.1.ln2.bias"} <= serial
    assert not any(".ln." in k for k in serial)
    assert len(serial) - len(parallel) == 2 * 2  # one more LayerNorm (weight, bias) per layer


def test_window_limits_attention() -> None:
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 50, (2, 8), generator=gen)
    full = GPT(tiny(), dtype=torch.float64)(tokens)
    windowed = GPT(tiny(window=2), dtype=torch.float64)(tokens)
    torch.testing.assert_close(windowed[:, :2], full[:, :2], rtol=1e-12, atol=1e-12)
    assert (windowed[:, 2:] - full[:, 2:]).abs().amax(dim=-1).min() > 1e-6
    # a window as long as the sequence is full attention
    wide = GPT(tiny(window=16), dtype=torch.float64)(tokens)
    torch.testing.assert_close(wide, full, rtol=1e-12, atol=1e-12)


def test_weight_tying() -> None:
    tied = GPT(tiny(tie_embeddings=True), dtype=torch.float64)
    assert tied.output_weight is tied.embed.tok_emb.weight
    assert tied.head.proj is None
    assert not any(k.startswith("head.proj") for k in tied.state_dict())
    names = [n for n, _ in tied.named_parameters()]
    assert names.count("embed.tok_emb.weight") == 1
    assert sum(p is tied.embed.tok_emb.weight for p in tied.parameters()) == 1

    # The tied gradient is the sum of the gradients of its two uses: compare with an
    # untied model holding the same values in both places.
    untied = GPT(tiny(tie_embeddings=False), dtype=torch.float64)
    state = tied.state_dict()
    state["head.proj.weight"] = state["embed.tok_emb.weight"].clone()
    untied.load_state_dict(state)
    assert untied.output_weight is not untied.embed.tok_emb.weight

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 10, (2, 8), generator=gen)  # ids >= 10 reach only the head
    weights = torch.randn(2, 8, 50, generator=gen, dtype=torch.float64)
    logits, grads = _run(tied, tokens, weights)
    untied_logits, untied_grads = _run(untied, tokens, weights)
    torch.testing.assert_close(logits, untied_logits, rtol=0, atol=0)
    emb_part = untied_grads["embed.tok_emb.weight"]
    head_part = untied_grads["head.proj.weight"]
    assert emb_part[:10].abs().sum() > 0 and emb_part[10:].abs().sum() == 0
    assert head_part.abs().sum() > 0
    torch.testing.assert_close(grads["embed.tok_emb.weight"], emb_part + head_part)


def test_init_is_deterministic_and_by_name() -> None:
    config = tiny(tie_embeddings=False, seed=7)
    before = torch.get_rng_state()
    a, b = GPT(config), GPT(config)
    assert torch.equal(torch.get_rng_state(), before)  # construction draws nothing global
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa.dtype == torch.float32
        assert torch.equal(pa, pb), name
        # each parameter alone, through the helper, is what the full model holds
        assert torch.equal(initial_value(name, pa.shape, config), pa), name

    # another dtype holds the same (float32-drawn) values
    c = GPT(config, dtype=torch.float64)
    for (name, pa), (_, pc) in zip(a.named_parameters(), c.named_parameters(), strict=True):
        assert pc.dtype == torch.float64
        assert torch.equal(pa.double(), pc), name

    # re-initializing in place restores the same values; a different seed differs
    with torch.no_grad():
        for p in b.parameters():
            p.add_(1.0)
    init_parameters(b, config)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    other = GPT(tiny(tie_embeddings=False, seed=8))
    assert not torch.equal(a.embed.tok_emb.weight, other.embed.tok_emb.weight)
    assert not torch.equal(
        a.get_parameter("blocks.0.attn.qkv.weight"), other.get_parameter("blocks.0.attn.qkv.weight")
    )
    # same shape, different name: different draws
    assert not torch.equal(
        a.get_parameter("blocks.0.attn.qkv.weight"), a.get_parameter("blocks.1.attn.qkv.weight")
    )


def test_weights_start_as_04s_did() -> None:
    # Seeds come from 0.4's names and QKV is drawn in its order, then permuted.
    config = tiny(tie_embeddings=False, seed=5)
    model = GPT(config)
    assert torch.equal(
        model.embed.tok_emb.weight,
        initial_value("embed.tok_emb.weight", (50, 32), config),
    )
    g = torch.Generator().manual_seed(derive_seed(5, "tok_emb.weight"))
    drawn = torch.empty(50, 32).normal_(0.0, config.init_std, generator=g)
    assert torch.equal(model.embed.tok_emb.weight, drawn)
    g = torch.Generator().manual_seed(derive_seed(5, "blocks.1.attn.qkv.weight"))
    drawn = torch.empty(96, 32).normal_(0.0, config.init_std, generator=g)
    assert torch.equal(model.get_parameter("blocks.1.attn.qkv.weight"), qkv_head_major(drawn, 4))


def test_derive_seed_is_stable() -> None:
    assert derive_seed(0, "tok_emb.weight") == derive_seed(0, "tok_emb.weight")
    assert 0 <= derive_seed(-5, "x") < 2**63
    seeds = {derive_seed(s, n) for s in range(3) for n in ("a.weight", "b.weight", "a.bias")}
    assert len(seeds) == 9
    # a pinned value: the hash must never change (that would change every model's weights)
    assert derive_seed(0, "tok_emb.weight") == 3859575564340080146


def test_init_statistics() -> None:
    config = ModelConfig(vocab_size=64, d_model=256, n_layers=8, n_heads=4, seq_len=8, seed=1)
    model = GPT(config)
    std = config.init_std
    qkv = model.get_parameter("blocks.0.attn.qkv.weight")
    assert abs(qkv.std().item() - std) < 0.02 * std
    assert abs(qkv.mean().item()) < 0.01 * std
    scaled = std / math.sqrt(2 * config.n_layers)
    for name in ("attn.proj.weight", "mlp.proj.weight"):
        w = model.get_parameter(f"blocks.3.{name}")
        assert abs(w.std().item() - scaled) < 0.03 * scaled, name
    fc = model.get_parameter("blocks.0.mlp.fc.weight")
    assert abs(fc.std().item() - std) < 0.02 * std
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, name
        elif ".ln" in name:
            assert torch.all(p == 1), name
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            assert torch.all(module.weight == 1) and torch.all(module.bias == 0)


def test_num_parameters() -> None:
    d, v, s, f, n = 32, 50, 16, 128, 2
    per_block = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    parallel_body = n * (per_block + 2 * d) + 2 * d  # + block LayerNorm, final LayerNorm
    tied = GPT(tiny())
    assert tied.num_parameters(exclude_embeddings=True) == parallel_body
    assert tied.num_parameters() == parallel_body + v * d + s * d
    assert tied.num_parameters() == sum(p.numel() for p in tied.parameters())
    untied = GPT(tiny(tie_embeddings=False))
    assert untied.num_parameters() == parallel_body + 2 * v * d + s * d
    assert untied.num_parameters(exclude_embeddings=True) == parallel_body
    serial = GPT(tiny(block="serial"))
    assert serial.num_parameters(exclude_embeddings=True) == parallel_body + n * 2 * d


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        (torch.zeros(2, 8), r"tokens must be int64 or int32.*float32.*\(2, 8\)"),
        (torch.zeros(2, 8, dtype=torch.int16), r"tokens must be int64 or int32.*int16"),
        (torch.zeros(8, dtype=torch.long), r"tokens must have shape \(batch, seq\).*\(8,\)"),
        (torch.zeros(2, 17, dtype=torch.long), r"tokens .*seq_len=16.*\(2, 17\)"),
        (torch.zeros(2, 0, dtype=torch.long), r"tokens .*\(2, 0\)"),
    ],
)
def test_bad_tokens(tokens: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPT(tiny())(tokens)


def test_bad_targets() -> None:
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"targets .*\(2, 8\).*\(2, 7\)"):
        GPT(tiny())(tokens, tokens[:, :7])


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="n_heads"):
        tiny(n_heads=5)
    with pytest.raises(ConfigError, match=r"model\.window"):
        tiny(window=0)
    with pytest.raises(TypeError, match="ModelConfig"):
        GPT(TINY)  # type: ignore[arg-type]


def test_dropout_train_and_eval() -> None:
    model = GPT(tiny(dropout=0.5))
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(4))
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens), rtol=0, atol=0)
    model.train()
    assert not torch.equal(model(tokens), model(tokens))


def test_explicit_torch_kernels_match_auto() -> None:
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(5))
    auto = GPT(tiny(window=3))(tokens)
    explicit = GPT(tiny(window=3, kernels="torch"))(tokens)
    torch.testing.assert_close(auto, explicit, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_triton_kernels_match_torch_kernels(block: str) -> None:
    """The composed Triton path of the model (LayerNorm, residual add + LayerNorm, bias +
    GeLU, sliding-window attention; the interpreter on CPU) against the torch path, with
    the same weights: logits and every parameter's gradient. An explicit ``"triton"``
    backend raises rather than falling back, so the Triton kernels are what ran."""
    fields: dict[str, Any] = {**TINY, "n_heads": 2, "window": 5, "block": block, "seed": 3}
    reference = GPT(ModelConfig(**fields, kernels="torch"))
    fused = GPT(ModelConfig(**fields, kernels="triton"))
    fused.load_state_dict(reference.state_dict())
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, fields["vocab_size"], (2, fields["seq_len"]), generator=gen)
    weights = torch.randn(2, fields["seq_len"], fields["vocab_size"], generator=gen)
    logits, grads = _run(reference, tokens, weights)
    fused_logits, fused_grads = _run(fused, tokens, weights)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-4, atol=1e-5)
    assert fused_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_overfits_a_tiny_batch() -> None:
    torch.manual_seed(0)
    config = tiny(block="parallel", window=4)
    model = GPT(config)
    gen = torch.Generator().manual_seed(6)
    data = torch.randint(0, config.vocab_size, (4, 17), generator=gen)
    tokens, targets = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(30):
        _, loss = model(tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(config.vocab_size)) < 0.1  # small init: near uniform
    assert losses[-1] < 0.25 * losses[0], losses


@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_bf16_autocast_matches_fp32(block: str) -> None:
    """Under CPU bf16 autocast the GEMMs run in bf16 and the residual stream stays fp32;
    the logits and gradients stay within bf16 error of the fp32 model's (relative norm
    error; bf16 keeps 8 bits of mantissa, 0.4% per rounding)."""
    config = tiny(block=block, window=3, seed=5)
    model = GPT(config)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2, 8), generator=gen)
    weights = torch.randn(2, 8, config.vocab_size, generator=gen)
    logits, grads = _run(model, tokens, weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low_logits, low_grads = _run(model, tokens, weights)
    assert low_logits.dtype == torch.bfloat16
    assert (low_logits.float() - logits).norm() / logits.norm() < 0.01
    for name, grad in grads.items():
        assert low_grads[name].dtype == torch.float32, name
        error = (low_grads[name] - grad).norm() / grad.norm()
        assert error < 0.02, (name, float(error))


@pytest.mark.slow
def test_generate() -> None:
    config = tiny(seed=2)
    model = GPT(config).eval()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = model.generate(prompt, 5, temperature=0)
    assert greedy.shape == (1, 8) and torch.equal(greedy[:, :3], prompt)
    # Greedy decoding step by step by hand, the window sliding past seq_len.
    tokens = prompt
    for _ in range(5):
        nxt = model(tokens[:, -config.seq_len :])[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    assert torch.equal(greedy, tokens)
    assert torch.equal(model.generate(prompt, 5, top_k=1), greedy)  # top-1 sampling is greedy
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    a = model.generate(prompt, 20, temperature=1.5, generator=gen())
    assert torch.equal(a, model.generate(prompt, 20, temperature=1.5, generator=gen()))
    assert int(a.max()) < config.vocab_size
    assert model.generate(prompt, 0).shape == (1, 3)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        model.generate(prompt, -1)
    with pytest.raises(ValueError, match=r"temperature must be a number >= 0, got -0\.5"):
        model.generate(prompt, 1, temperature=-0.5)
    with pytest.raises(ValueError, match="top_k must be None or an int >= 1, got 0"):
        model.generate(prompt, 1, top_k=0)
