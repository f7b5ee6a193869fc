"""The benchmarks' confidence interval for a median (``ms_testing.bench.median_ci``):
the sign test's order statistics, checked against the binomial tables and by simulation."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ms_testing.bench import median_ci


@pytest.mark.parametrize(
    ("n", "k", "coverage"),
    [
        # k from the tables of the sign test: [x(k), x(n+1-k)] at >= 95%
        (21, 6, 1 - 2 * 0.01330185),  # P(B <= 5), B ~ Binomial(21, 1/2)
        (9, 2, 1 - 2 * 10 / 512),
        (7, 1, 1 - 2 / 128),  # [x(2), x(6)] would cover only 87.5%
        (5, 1, 1 - 2 / 32),  # too few for 95%: the whole range, and what it covers
    ],
)
def test_the_order_statistics_of_the_tables(n: int, k: int, coverage: float) -> None:
    values = [float(v) for v in range(n, 0, -1)]  # any order
    low, high, covered = median_ci(values)
    assert (low, high) == (float(k), float(n + 1 - k))
    assert covered == pytest.approx(coverage, abs=1e-6)


def test_it_covers_the_true_median_as_often_as_it_says() -> None:
    rng = random.Random(7)
    hits, trials = 0, 4000
    for _ in range(trials):
        # skewed, like ratios of run times: the true median of lognormal(0, 0.05) is 1
        sample = [rng.lognormvariate(0.0, 0.05) for _ in range(21)]
        low, high, coverage = median_ci(sample)
        hits += low <= 1.0 <= high
    assert hits / trials == pytest.approx(coverage, abs=0.015)  # 0.973 said


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60), st.floats(0.5, 0.99))
def test_the_interval_holds_the_sample_median_and_lies_in_the_sample(
    values: list[float], level: float
) -> None:
    low, high, coverage = median_ci(values, level)
    assert min(values) <= low <= statistics.median(values) <= high <= max(values)
    assert low in values and high in values
    whole = 1 - 2 / 2 ** len(values)
    assert coverage >= level or (low, high, coverage) == (min(values), max(values), whole)


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="values must not be empty"):
        median_ci([])
    with pytest.raises(ValueError, match=r"level must be in \(0, 1\), got 1"):
        median_ci([1.0], level=1)
    with pytest.raises(ValueError, match=r"level must be in \(0, 1\), got '95%'"):
        median_ci([1.0], level="95%")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="values must be finite numbers, got nan at index 2"):
        median_ci([1.0, 2.0, float("nan")])
    with pytest.raises(ValueError, match="values must be finite numbers, got 'x' at index 0"):
        median_ci(["x"])  # type: ignore[list-item]
