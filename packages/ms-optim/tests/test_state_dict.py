"""state_dict / load_state_dict: resuming mid-training is bit-identical; bad state is refused."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import nn

from ms_optim import Lamb, lamb_param_groups


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)).to(dtype)


def train(model: nn.Module, opt: Lamb, steps: range) -> None:
    for s in steps:
        gen = torch.Generator().manual_seed(1000 + s)  # batches depend on the step only
        x = torch.randn(5, 6, generator=gen).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("impl", ["single", "foreach"])
@pytest.mark.parametrize(
    ("dtype", "master"),
    [(torch.float32, False), pytest.param(torch.bfloat16, True, marks=pytest.mark.slow)],
)
def test_resume_is_bit_identical(impl: str, dtype: torch.dtype, master: bool) -> None:
    kwargs: dict[str, Any] = {
        "lr": 0.01,
        "max_grad_norm": 1.0,
        "trust_ratio_bounds": (0.01, 10.0),
        "master_weights": master,
        "impl": impl,
    }
    model = make_model(dtype)
    opt = Lamb(lamb_param_groups(model, 0.01), **kwargs)
    train(model, opt, range(4))
    saved_model = roundtrip(model.state_dict())
    saved_opt = roundtrip(opt.state_dict())
    train(model, opt, range(4, 9))  # the uninterrupted run

    resumed = make_model(dtype)
    resumed.load_state_dict(saved_model)
    opt2 = Lamb(lamb_param_groups(resumed, 0.01), **kwargs)
    opt2.load_state_dict(saved_opt)
    for state in opt2.state.values():  # torch's default load would cast these to bf16
        assert state["exp_avg"].dtype == torch.float32
    train(resumed, opt2, range(4, 9))

    for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[q][key]), key


def test_state_dict_keeps_the_torch_layout() -> None:
    model = make_model(torch.float32)
    opt = Lamb(model.parameters())
    train(model, opt, range(1))
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups", "ms_optim_format"}
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["param_groups"][0]["params"] == list(range(len(list(model.parameters()))))


def _trained() -> tuple[nn.Module, Lamb, dict[str, Any]]:
    model = make_model(torch.float32)
    opt = Lamb(model.parameters())
    train(model, opt, range(2))
    return model, opt, copy.deepcopy(opt.state_dict())


def test_refuses_another_format() -> None:
    _, opt, sd = _trained()
    sd["ms_optim_format"] = 99
    with pytest.raises(ValueError, match=r"ms_optim_format.*must be one of \(1, 2\).*got 99"):
        opt.load_state_dict(sd)


def test_refuses_state_of_the_wrong_shape() -> None:
    _, opt, sd = _trained()
    sd["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(
        ValueError,
        match=r"\['state'\]\[0\]\['exp_avg'\] must be a tensor of .*\(8, 6\), got \(3,\)",
    ):
        opt.load_state_dict(sd)


def test_refuses_missing_master_weights() -> None:
    model = make_model(torch.bfloat16)
    opt = Lamb(model.parameters())
    train(model, opt, range(1))
    with_master = Lamb(make_model(torch.bfloat16).parameters(), master_weights=True)
    with pytest.raises(ValueError, match="master_weights differs"):
        with_master.load_state_dict(opt.state_dict())


def test_refuses_invalid_saved_hyperparameters() -> None:
    _, opt, sd = _trained()
    sd["param_groups"][0]["betas"] = (1.5, 0.999)
    with pytest.raises(
        ValueError, match=r"param_groups'\]\[0\]\['betas'\]\[0\] must be in \[0, 1\), got 1.5"
    ):
        opt.load_state_dict(sd)


def test_format_1_is_written_while_0_1_0_can_honour_it() -> None:
    _, opt, sd = _trained()
    assert sd["ms_optim_format"] == 1  # defaults: 0.1.0 loads and honours it
    opt.param_groups[0]["grad_averaging"] = False
    assert opt.state_dict()["ms_optim_format"] == 2  # 0.1.0 would ignore the switch


def test_state_of_0_1_0_loads_and_takes_the_new_switches_from_the_constructor() -> None:
    model, _, sd = _trained()
    for g in sd["param_groups"]:  # as 0.1.0 wrote it: no keys for the 0.2.0 switches
        for key in ("grad_averaging", "step_size_bias_correction", "decay_in_update", "step_count"):
            del g[key]
    resumed = Lamb(model.parameters(), step_count="group")
    resumed.load_state_dict(sd)
    assert resumed.param_groups[0]["step_count"] == "group"
    train(model, resumed, range(2, 3))
    # Group counting goes on from the parameters' 2 steps.
    assert resumed.param_groups[0]["group_step"] == 3
    assert all(int(s["step"].item()) == 3 for s in resumed.state.values())
