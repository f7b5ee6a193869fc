"""ChunkTuner: measures each shape once, every TP rank picks the same count, the real
step is untouched by the measuring, and a plan round-trips through its state."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ms_parallel import ChunkTuner, TPComm
from ms_parallel.events import EventLog
from ms_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ms_testing.dist import run_ranks


def _layers(chunks: object, log: EventLog | None = None) -> tuple[torch.nn.Module, ...]:
    comm = TPComm(dist.group.WORLD, on_event=log)
    torch.manual_seed(0)
    col = ColumnParallelLinear(16, 32, comm, chunks=chunks)  # type: ignore[arg-type]
    row = RowParallelLinear(32, 16, comm, chunks=chunks)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in (*col.parameters(), *row.parameters()):
            p.normal_()
    return col, row


def _step(col: torch.nn.Module, row: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    row(torch.tanh(col(x))).square().sum().backward()
    return [x.grad, *(p.grad for p in (*col.parameters(), *row.parameters()))]


def _rank() -> dict[str, object]:
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(6, 2, 16)
    tuner = ChunkTuner(candidates=(1, 2, 3), reps=2)
    log = EventLog()
    col, row = _layers(tuner, log)
    rng = torch.get_rng_state()
    tuned = _step(col, row, x)
    assert torch.equal(torch.get_rng_state(), rng)  # measuring draws nothing
    plan = dict(tuner.plan)
    # The step's own collectives are the only ones reported: measuring is quiet.
    issues = [e for e in log.events if e.kind == "issue"]
    chosen = plan[next(k for k in plan if k.startswith("all_gather_matmul"))]
    assert (
        len([e for e in issues if e.attrs["phase"] == "forward" and e.name == "all_gather"])
        == chosen
    )
    # The same counts, fixed, give the same bits.
    col_c = plan[next(k for k in plan if k.startswith("all_gather_matmul"))]
    row_c = plan[next(k for k in plan if k.startswith("matmul_reduce_scatter"))]
    col2, row2 = _layers(col_c)
    row2.chunks = row_c
    fixed = _step(col2, row2, x)
    assert all(torch.equal(a, b) for a, b in zip(tuned, fixed, strict=True))
    # A second step measures nothing more.
    _step(col, row, x)
    assert tuner.plan == plan and len(tuner.timings) == len(plan)
    # A plan loaded into another tuner is used as it is.
    other = ChunkTuner()
    other.load_state_dict(tuner.state_dict())
    col3, row3 = _layers(other)
    _step(col3, row3, x)
    assert other.timings == {} and other.plan == plan
    return plan


@pytest.mark.slow
def test_every_rank_picks_the_same_counts() -> None:
    plans = run_ranks(_rank, 2, timeout=120)
    assert plans[0] == plans[1]
    assert len(plans[0]) == 2 and all(v in (1, 2, 3) for v in plans[0].values())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": ()}, "candidates must be ints >= 1"),
        ({"candidates": (1, 0)}, "candidates must be ints >= 1"),
        ({"reps": 0}, "reps must be an int >= 1"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ChunkTuner(**kwargs)  # type: ignore[arg-type]


def test_bad_states_are_refused() -> None:
    with pytest.raises(ValueError, match="format 1, got 7"):
        ChunkTuner().load_state_dict({"format": 7})
    with pytest.raises(ValueError, match="maps shape keys to ints >= 1"):
        ChunkTuner().load_state_dict({"format": 1, "plan": {"k": 0}})
