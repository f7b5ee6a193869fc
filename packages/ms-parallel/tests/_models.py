"""Small models and a reference loop shared by the ms-parallel tests."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm MLP block: x + W2 gelu(W1 norm(x))."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Embedding, blocks of uneven widths, a norm and an output head tied to the
    embedding (a parameter used by two chunks), plus a parameter of the root."""

    def __init__(self, vocab: int = 37, d: int = 24, hiddens: tuple[int, ...] = (40, 56, 24)):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h) for h in hiddens)
        self.norm = nn.LayerNorm(d)
        self.scale = nn.Parameter(torch.ones(()))  # the root's own

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        logits = self.norm(x) @ self.emb.weight.t() * self.scale
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_net(seed: int = 0, **kwargs: object) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)  # type: ignore[arg-type]


def batches(steps: int, global_batch: int, seq: int = 8, vocab: int = 37, seed: int = 1):
    """Per step, the global batch of (tokens, targets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def reference(steps: int, global_batch: int, make_opt, **net_kwargs: object):
    """One process, the whole global batch per step: (losses, final parameters)."""
    net = make_net(**net_kwargs)
    opt = make_opt(net)
    losses = []
    for tokens, targets in batches(steps, global_batch):
        loss = net(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-2, weight_decay=0.1)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


#: The optimizers the ZeRO tests train with, by name.
OPTIMIZERS = {"adamw": adamw, "sgd": sgd}


def accumulate(zero, tokens: torch.Tensor, targets: torch.Tensor, accum: int) -> torch.Tensor:
    """Forward and backward of (tokens, targets) in ``accum`` micro-batches through the
    ZeRO wrapper ``zero``, all but the last under ``no_sync()``; the mean loss, detached."""
    micro = tokens.shape[0] // accum
    total = torch.zeros(())
    for m in range(accum):
        part = slice(m * micro, (m + 1) * micro)
        if m < accum - 1:
            with zero.no_sync():
                loss = zero(tokens[part], targets[part])
                (loss / accum).backward()
        else:
            loss = zero(tokens[part], targets[part])
            (loss / accum).backward()
        total += loss.detach() / accum
    return total
