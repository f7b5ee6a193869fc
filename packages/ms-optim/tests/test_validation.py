"""Bad input raises ValueError / TypeError naming the field, what was expected, what came."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ms_optim import Lamb, ShardMap


def _p() -> list[torch.Tensor]:
    return [torch.zeros(3, requires_grad=True)]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lr": -1.0}, ValueError, r"lr must be a finite number >= 0, got -1.0"),
        ({"lr": float("nan")}, ValueError, r"lr must not be NaN"),
        ({"lr": True}, TypeError, r"lr must be a real number, got bool"),
        ({"betas": (1.5, 0.9)}, ValueError, r"betas\[0\] must be in \[0, 1\), got 1.5"),
        ({"betas": (0.9, -0.1)}, ValueError, r"betas\[1\] must be in \[0, 1\), got -0.1"),
        ({"betas": (0.9,)}, ValueError, r"betas must be a pair"),
        ({"eps": -1e-8}, ValueError, r"eps must be a finite number >= 0"),
        ({"weight_decay": float("inf")}, ValueError, r"weight_decay must be a finite number"),
        ({"bias_correction": 1}, TypeError, r"bias_correction must be a bool, got 1"),
        ({"layer_adaptation": None}, TypeError, r"layer_adaptation must be a bool"),
        ({"decoupled_weight_decay": "yes"}, TypeError, r"decoupled_weight_decay must be a bool"),
        (
            {"weight_norm_bounds": (2.0, 1.0)},
            ValueError,
            r"weight_norm_bounds must satisfy 0 <= lo <= hi, got \(2.0, 1.0\)",
        ),
        ({"trust_ratio_bounds": (-1.0, 1.0)}, ValueError, r"trust_ratio_bounds must satisfy"),
        ({"trust_ratio_bounds": 10.0}, ValueError, r"trust_ratio_bounds must be None or a pair"),
        ({"max_grad_norm": 0.0}, ValueError, r"max_grad_norm must be > 0 or None, got 0.0"),
        ({"grad_averaging": 0}, TypeError, r"grad_averaging must be a bool, got 0"),
        (
            {"step_size_bias_correction": "yes"},
            TypeError,
            r"step_size_bias_correction must be a bool, got 'yes'",
        ),
        (
            {"decay_in_update": False, "decoupled_weight_decay": False},
            ValueError,
            r"decay_in_update=False applies decoupled decay to the weights directly; it needs "
            r"decoupled_weight_decay=True, got False",
        ),
        (
            {"step_count": "tensor"},
            ValueError,
            r"step_count must be one of \('param', 'group'\), got 'tensor'",
        ),
        ({"impl": "fused"}, ValueError, r"impl must be one of .*got 'fused'"),
        ({"master_weights": 1}, TypeError, r"master_weights must be a bool"),
        ({"shards": ShardMap((0,), (3,))}, ValueError, r"shards and process_group go together"),
        ({"shards": [0]}, TypeError, r"shards must be a ms_optim.ShardMap"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Lamb(_p(), **kwargs)


def test_bad_param_group_names_the_group() -> None:
    with pytest.raises(
        ValueError, match=r"param_groups\[1\]\['lr'\] must be a finite number >= 0, got -0.5"
    ):
        Lamb([{"params": _p()}, {"params": _p(), "lr": -0.5}])


def test_bad_lr_set_after_construction_is_caught_at_step() -> None:
    opt = Lamb(_p())
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\]"):
        opt.step()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64])
def test_non_real_params_are_refused(dtype: torch.dtype) -> None:
    with pytest.raises(
        TypeError,
        match=(
            r"param_groups\[0\]\['params'\]\[1\] must be a dense, real floating-point "
            rf"tensor, got {dtype}"
        ),
    ):
        Lamb([torch.zeros(2), torch.zeros(2, dtype=dtype)])


def test_sparse_gradients_are_refused() -> None:
    emb = nn.Embedding(5, 3, sparse=True)
    opt = Lamb(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[0\].grad must be dense"):
        opt.step()


def test_shard_map_fields_are_checked() -> None:
    with pytest.raises(
        ValueError, match=r"ShardMap.param_ids\[1\] must be an int in \[0, 2\), got 2"
    ):
        ShardMap(param_ids=(0, 2), numels=(3, 4))
    with pytest.raises(ValueError, match=r"ShardMap.numels\[0\] must be an int >= 0, got -1"):
        ShardMap(param_ids=(), numels=(-1,))
    with pytest.raises(ValueError, match=r"flat range must satisfy"):
        ShardMap.from_flat_range([3, 4], 2, 9)


def test_flat_range_slices_parameters() -> None:
    shards, slices = ShardMap.from_flat_range([3, 4, 0, 5], 2, 8)
    assert shards.param_ids == (0, 1, 3)
    assert slices == [(0, 2, 1), (1, 0, 4), (3, 0, 1)]


def test_bad_group_step_counter_is_refused() -> None:
    opt = Lamb(_p(), step_count="group")
    opt.param_groups[0]["group_step"] = -3
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]\['group_step'\] must be an int >= 0.*got -3"
    ):
        opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["group_step"] = 1.5
    with pytest.raises(
        ValueError,
        match=r"state_dict\['param_groups'\]\[0\]\['group_step'\] must be an int >= 0, got 1.5",
    ):
        opt.load_state_dict(sd)
