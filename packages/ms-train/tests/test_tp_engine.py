"""ZeRO and DDP on a dp x tp mesh, the GPT tensor-parallel: the same losses, gradient
norms and weights as one process, step for step, with AdamW and LAMB."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from ms_parallel import DDPEngine, ZeroEngine, build_mesh
from ms_testing.dist import run_ranks
from ms_train import parallelize
from ms_train.config import ModelConfig, OptimConfig
from ms_train.model import GPT
from ms_train.trainer import optimizer_factory, optimizer_groups

BASE: dict[str, Any] = {
    "vocab_size": 37,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "seq_len": 16,
    "kernels": "torch",
    "seed": 3,
}
STEPS, GLOBAL_BATCH, ACCUM = 3, 4, 2


def _batches(steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 37, (GLOBAL_BATCH, 17), generator=g) for _ in range(steps)]


def _loss(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    _, loss = module(batch[:, :-1], batch[:, 1:])
    return loss  # type: ignore[no-any-return]


def _train(
    engine: Any, model: GPT, optim: OptimConfig, dp_rank: int, dp: int, steps: int = STEPS
) -> dict[str, Any]:
    engine.setup(model, optimizer_groups(model, optim), optimizer_factory(optim))
    per_rank = GLOBAL_BATCH // dp
    micro = per_rank // ACCUM
    losses, norms = [], []
    for batch in _batches(steps):
        mine = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        parts = iter(mine[i * micro : (i + 1) * micro] for i in range(ACCUM))
        out = engine.step(parts.__next__, _loss, grad_accum=ACCUM, max_norm=0.5)
        loss = out.loss.clone()
        group = engine.topology.dp_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        losses.append(loss.item())
        norms.append(out.grad_norm.item())
    state = engine.state()["model"].state_dict()
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()
    }
    return {"losses": losses, "norms": norms, "params": full}


def _reference(optim: OptimConfig, block: str, steps: int = STEPS) -> dict[str, Any]:
    model = GPT(ModelConfig(**BASE, block=block))
    return _train(ZeroEngine(), model, optim, 0, 1, steps)


def _ranks(
    engine_name: str, optim: OptimConfig, block: str, dp: int, tp: int, steps: int = STEPS
) -> dict[str, Any]:
    mesh = build_mesh(dp=dp, tp=tp)
    model = parallelize(GPT(ModelConfig(**BASE, block=block)), mesh["tp"], chunks=2)
    if engine_name == "zero":
        engine: Any = ZeroEngine(mesh=mesh, bucket_mb=0.01, replicated_chunks=1)
    else:
        engine = DDPEngine(mesh=mesh)
    return _train(engine, model, optim, mesh["dp"].get_local_rank(), dp, steps)


def _check(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    # Weights to 1e-3 of one step's learning rate: Adam still scales the rounding noise
    # of a near-zero gradient up to eps' size (seen: one element of 4,096 off by 3e-6).
    for name, value in ref["params"].items():
        torch.testing.assert_close(
            got["params"][name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


# Adam turns gradients that are zero in exact arithmetic but rounding noise in fp32
# (the key bias: softmax ignores it) into updates of +-lr, whose sign differs between
# summation orders; an eps above that noise keeps them small, as a real eps does at scale.
ADAMW = OptimConfig(name="adamw", lr=1e-2, eps=1e-6)
LAMB = OptimConfig(name="lamb", lr=1e-2, eps=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "dp", "tp", "block"),
    [
        ("zero", 1, 2, "parallel"),
        ("zero", 2, 2, "serial"),
        ("ddp", 2, 2, "parallel"),
    ],
)
def test_tp_engines_match_one_process_adamw(engine: str, dp: int, tp: int, block: str) -> None:
    ref = _reference(ADAMW, block)
    for got in run_ranks(_ranks, dp * tp, args=(engine, ADAMW, block, dp, tp), timeout=240):
        _check(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "dp", "tp"), [("zero", 2, 2), ("ddp", 1, 2)])
def test_tp_engines_match_one_process_lamb(engine: str, dp: int, tp: int) -> None:
    # LAMB's trust ratios need whole-parameter norms: over dp x tp with replica counts.
    ref = _reference(LAMB, "parallel")
    for got in run_ranks(_ranks, dp * tp, args=(engine, LAMB, "parallel", dp, tp), timeout=240):
        _check(got, ref)


# -- resume across tensor-parallel sizes through ms-ckpt ---------------------------------

TOTAL, DONE = 4, 2


def _save_or_resume(
    root: str, optim: OptimConfig, dp: int, tp: int, resume: bool
) -> dict[str, Any]:
    """Train steps [0, DONE) and save, or load and train [DONE, TOTAL), at dp x tp."""
    from ms_ckpt import Checkpointer

    model = GPT(ModelConfig(**{**BASE, "block": "parallel", "seed": 99 if resume else 3}))
    if dist.is_initialized():
        mesh = build_mesh(dp=dp, tp=tp)
        parallelize(model, mesh["tp"], chunks=2)
        engine: Any = ZeroEngine(mesh=mesh, bucket_mb=0.01)
        ckpt = Checkpointer(root, mesh=mesh, dp_dim="dp", stage2="inline")
        dp_rank = mesh["dp"].get_local_rank()
    else:
        engine, ckpt, dp_rank = ZeroEngine(), Checkpointer(root, stage2="inline"), 0
    engine.setup(model, optimizer_groups(model, optim), optimizer_factory(optim))
    state = engine.state()
    if resume:
        assert ckpt.load(state) == DONE
    batches = _batches(TOTAL)[DONE:] if resume else _batches(TOTAL)[:DONE]
    per_rank, micro = GLOBAL_BATCH // dp, GLOBAL_BATCH // dp // ACCUM
    losses, norms = [], []
    for batch in batches:
        mine = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        parts = iter(mine[i * micro : (i + 1) * micro] for i in range(ACCUM))
        out = engine.step(parts.__next__, _loss, grad_accum=ACCUM, max_norm=0.5)
        loss = out.loss.clone()
        group = engine.topology.dp_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        losses.append(loss.item())
        norms.append(out.grad_norm.item())
    if not resume:
        ckpt.save(DONE, state).wait()
    ckpt.finalize()
    return {"losses": losses, "norms": norms}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("before", "after"),
    [((1, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 2), (2, 1))],
    ids=lambda c: f"dp{c[0]}xtp{c[1]}",
)
def test_resume_at_another_tp_size(
    tmp_path: Any, before: tuple[int, int], after: tuple[int, int]
) -> None:
    # The uninterrupted run, in one process.
    whole = _reference(LAMB, "parallel", TOTAL)
    root = str(tmp_path / "ckpt")

    def run(dp: int, tp: int, resume: bool) -> dict[str, Any]:
        if dp * tp == 1:
            return _save_or_resume(root, LAMB, 1, 1, resume)
        return run_ranks(_save_or_resume, dp * tp, args=(root, LAMB, dp, tp, resume), timeout=240)[
            0
        ]

    first = run(*before, False)
    assert first["losses"] == pytest.approx(whole["losses"][:DONE], rel=1e-5)
    rest = run(*after, True)
    assert rest["losses"] == pytest.approx(whole["losses"][DONE:], rel=1e-5)
    assert rest["norms"] == pytest.approx(whole["norms"][DONE:], rel=1e-5)
