"""Warm-up + cosine schedule: endpoints, monotonicity, argument errors."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ms_train.schedule import lr_at


def test_endpoints() -> None:
    kw = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, "total_steps": 13}
    assert [lr_at(i, **kw) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == 1.0  # the cosine starts at the peak
    # Steps 4..12 decay: half way (step 8) is the mean of lr and min_lr.
    assert math.isclose(lr_at(8, **kw), 0.55)
    assert lr_at(12, **kw) == pytest.approx(0.1)  # the last step reaches the floor
    assert lr_at(100, **kw) == pytest.approx(0.1)


@given(
    st.integers(0, 50),
    st.integers(1, 200),
    st.floats(1e-6, 10.0),
    st.floats(0.0, 1.0),
)
def test_rises_then_falls_within_bounds(warmup: int, extra: int, lr: float, frac: float) -> None:
    total = warmup + extra
    kw = {"lr": lr, "min_lr": lr * frac, "warmup_steps": warmup, "total_steps": total}
    values = [lr_at(i, **kw) for i in range(total + 3)]
    rising, falling = values[:warmup], values[warmup:]
    assert all(a < b for a, b in itertools.pairwise(rising))
    assert all(a >= b - 1e-12 * lr for a, b in itertools.pairwise(falling))
    assert all(0 < v <= lr * (1 + 1e-12) for v in rising)
    assert all(lr * frac * (1 - 1e-12) <= v <= lr * (1 + 1e-12) for v in falling)
    assert max(values) == pytest.approx(lr)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": -1}, "step must be an int >= 0, got -1"),
        ({"warmup_steps": 20}, r"warmup_steps \(20\) must not exceed total_steps \(10\)"),
        ({"total_steps": 0, "warmup_steps": 0}, "total_steps must be an int >= 1, got 0"),
        ({"lr": 0.0}, "lr must be a finite number > 0, got 0.0"),
        ({"min_lr": 2.0}, r"min_lr must be a number in \[0, lr=1.0\], got 2.0"),
    ],
)
def test_errors_name_the_argument(kwargs: dict[str, float], message: str) -> None:
    args = {"step": 0, "lr": 1.0, "min_lr": 0.0, "warmup_steps": 2, "total_steps": 10} | kwargs
    with pytest.raises(ValueError, match=message):
        lr_at(**args)  # type: ignore[arg-type]
