"""Multi-tensor LAMB with ``torch._foreach_*``: the default on every device.

The update is written in the fewest fused ops that keep Algorithm 2's value::

    m = lerp(m, g, 1 - b1)                         (m read, g read, m written)
    v = b2 v;  v += (1 - b2) g g                   (mul_, addcmul_)
    d = sqrt(v) + eps sqrt(bc2)
    u = wd w + (sqrt(bc2) / bc1) m / d             (addcdiv_)

which is (m / bc1) / (sqrt(v / bc2) + eps) + wd w rearranged, as torch's Adam does.

On CUDA each foreach op is a handful of kernel launches for the whole list; the
updates u are kept between the two phases. On CPU foreach ops run one tensor
after another, and what costs is memory: every op is a pass over DRAM, and a
fresh model-sized temporary costs more again (the kernel faults in and zeroes
its pages on every step). So on CPU the tensors are cut into tiles of flat
slices (a few MiB of each operand, small tensors packed together) and every op
of a phase runs on one tile before the next, while it is still in cache; the
temporaries are tile-sized and reused. Phase 2 recomputes u per tile from the
new m and v (the same ops on the same values, so the same u) instead of keeping
a model-sized u: reading m and v again costs what writing and reading u would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ms_optim._bucket import Bucket

__all__ = ["ForeachImpl"]

#: Elements per CPU tile: each operand's slice is 4 MiB in fp32, so the live
#: operands of a tile stay in a 32 MiB L3 and temporaries stay under glibc's mmap
#: threshold (reused, not faulted in again). Smaller tiles mean more ops, hence
#: more per-op overhead and more OpenMP regions (costly on a contended machine).
CPU_TILE = 1 << 20


@dataclass
class _Tiled:
    """Carry of the CPU path: the tiles and per-piece factors for phase 2."""

    #: Per tile, the pieces: (tensor index, start, stop) of the flat tensor.
    tiles: list[list[tuple[int, int, int]]]
    #: Per tensor: added to sqrt(v) (eps, times sqrt(bc2) with bias correction),
    #: and the factor of m / d (sqrt(bc2) / bc1, or 1).
    eps: list[float]
    scales: list[float]


def _factors(b: Bucket) -> tuple[list[float], list[float]]:
    h = b.hyper
    if not h.bias_correction:
        return [h.eps] * len(b.weights), [1.0] * len(b.weights)
    roots = [math.sqrt(c) for c in b.bias_corrections2]
    eps = [h.eps * r for r in roots]
    scales = [r / c for r, c in zip(roots, b.bias_corrections1, strict=True)]
    return eps, scales


def _advance_moments(
    b: Bucket,
    weights: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
) -> None:
    """m and v of Algorithm 2, in place, from (possibly clipped, L2-decayed) g."""
    h = b.hyper
    l2 = not h.decoupled_weight_decay and h.weight_decay != 0.0
    if b.grad_scale is not None:
        grads = list(torch._foreach_mul(grads, b.grad_scale))  # new tensors: p.grad kept
        if l2:
            torch._foreach_add_(grads, weights, alpha=h.weight_decay)
    elif l2:
        grads = list(torch._foreach_add(grads, weights, alpha=h.weight_decay))
    if h.grad_averaging:
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - h.beta1)
    else:
        torch._foreach_mul_(exp_avgs, h.beta1)
        torch._foreach_add_(exp_avgs, grads)
    torch._foreach_mul_(exp_avg_sqs, h.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - h.beta2)


def _direction(
    b: Bucket,
    weights: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    eps: list[float],
    scales: list[float],
) -> list[torch.Tensor]:
    """u = wd w + scale m / (sqrt(v) + eps) per tensor, as new tensors."""
    h = b.hyper
    denom = list(torch._foreach_sqrt(exp_avg_sqs))
    torch._foreach_add_(denom, eps)
    if h.decoupled_weight_decay and h.weight_decay != 0.0:
        updates = list(torch._foreach_mul(weights, h.weight_decay))
        torch._foreach_addcdiv_(updates, exp_avgs, denom, scales)
    else:
        updates = list(torch._foreach_div(exp_avgs, denom))
        if h.bias_correction:
            torch._foreach_mul_(updates, scales)
    return updates


class ForeachImpl:
    """``impl="foreach"``; ``cpu_tile`` elements per tile on CPU (None: no tiling)."""

    def __init__(self, cpu_tile: int | None = CPU_TILE) -> None:
        self.cpu_tile = cpu_tile

    def moments(self, b: Bucket) -> tuple[object, torch.Tensor, torch.Tensor]:
        if not b.weights:
            empty = torch.zeros(0)
            return None, empty, empty
        if b.weights[0].device.type == "cpu" and self.cpu_tile is not None:
            return self._moments_tiled(b, self.cpu_tile)
        eps, scales = _factors(b)
        _advance_moments(b, b.weights, b.grads, b.exp_avgs, b.exp_avg_sqs)
        updates = _direction(b, b.weights, b.exp_avgs, b.exp_avg_sqs, eps, scales)
        w_sq = torch.stack(torch._foreach_norm(b.weights)).square_()
        u_sq = torch.stack(torch._foreach_norm(updates)).square_()
        return updates, w_sq, u_sq

    def apply(self, b: Bucket, carry: object, ratios: torch.Tensor) -> None:
        if carry is None:
            return
        steps = ratios * -b.hyper.lr
        if isinstance(carry, _Tiled):
            self._apply_tiled(b, carry, steps.tolist())
            return
        assert isinstance(carry, list)
        torch._foreach_mul_(carry, list(steps.unbind()))
        if b.weight_scale != 1.0:
            torch._foreach_mul_(b.weights, b.weight_scale)
        torch._foreach_add_(b.weights, carry)

    # -- CPU: tiles that stay in cache ------------------------------------------------

    def _moments_tiled(self, b: Bucket, tile: int) -> tuple[_Tiled, torch.Tensor, torch.Tensor]:
        eps, scales = _factors(b)
        tiles = _cut(b, tile)
        owners: list[int] = []
        w_norms: list[torch.Tensor] = []
        u_norms: list[torch.Tensor] = []
        for pieces in tiles:
            w, g, m, v = _slices(b, pieces)
            _advance_moments(b, w, g, m, v)
            picked_eps = [eps[i] for i, _, _ in pieces]
            picked_scales = [scales[i] for i, _, _ in pieces]
            u = _direction(b, w, m, v, picked_eps, picked_scales)
            w_norms.extend(torch._foreach_norm(w))
            u_norms.extend(torch._foreach_norm(u))
            owners.extend(i for i, _, _ in pieces)
        n = len(b.weights)
        dtype, device = b.weights[0].dtype, b.weights[0].device
        index = torch.tensor(owners, dtype=torch.int64, device=device)
        w_sq = torch.zeros(n, dtype=dtype, device=device)
        u_sq = torch.zeros(n, dtype=dtype, device=device)
        w_sq.index_add_(0, index, torch.stack(w_norms).square_())
        u_sq.index_add_(0, index, torch.stack(u_norms).square_())
        return _Tiled(tiles, eps, scales), w_sq, u_sq

    def _apply_tiled(self, b: Bucket, carry: _Tiled, steps: list[float]) -> None:
        for pieces in carry.tiles:
            w, _, m, v = _slices(b, pieces, grads=False)
            picked_eps = [carry.eps[i] for i, _, _ in pieces]
            picked_scales = [carry.scales[i] for i, _, _ in pieces]
            u = _direction(b, w, m, v, picked_eps, picked_scales)
            if b.weight_scale != 1.0:
                torch._foreach_mul_(w, b.weight_scale)
            for wi, ui, (i, _, _) in zip(w, u, pieces, strict=True):
                wi.add_(ui, alpha=steps[i])


def _cut(b: Bucket, tile: int) -> list[list[tuple[int, int, int]]]:
    """Pieces of at most ``tile`` elements, packed into tiles of about ``tile``."""
    tiles: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    size = 0
    for i, (w, g, m, v) in enumerate(
        zip(b.weights, b.grads, b.exp_avgs, b.exp_avg_sqs, strict=True)
    ):
        n = w.numel()
        flat = all(t.is_contiguous() for t in (w, g, m, v))
        step = tile if flat else max(n, 1)  # a strided tensor stays whole
        for start in range(0, max(n, 1), step):
            stop = min(start + step, n)
            if current and size + (stop - start) > tile:
                tiles.append(current)
                current, size = [], 0
            current.append((i, start, stop))
            size += stop - start
    if current:
        tiles.append(current)
    return tiles


def _slices(
    b: Bucket, pieces: list[tuple[int, int, int]], grads: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    lists: tuple[list[torch.Tensor], ...] = ([], [], [], [])
    sources = (b.weights, b.grads if grads else b.weights, b.exp_avgs, b.exp_avg_sqs)
    for i, start, stop in pieces:
        whole = start == 0 and stop == sources[0][i].numel()
        for out, src in zip(lists, sources, strict=True):
            t = src[i]
            out.append(t if whole else t.view(-1)[start:stop])
    w, g, m, v = lists
    return w, g, m, v
