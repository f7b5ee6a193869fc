"""lamb_param_groups: weights decayed and adapted; biases and norm weights not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ms_optim import Lamb, lamb_param_groups


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.rms = nn.RMSNorm(4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: must appear once
        self.gain = nn.Parameter(torch.ones(4))  # a hand-written norm gain
        self.frozen = nn.Parameter(torch.ones(4, 4), requires_grad=False)


def test_groups_split_weights_from_biases_and_norms() -> None:
    model = Tiny()
    decay, plain = lamb_param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and "layer_adaptation" not in decay
    assert plain["weight_decay"] == 0.0 and plain["layer_adaptation"] is False
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(decay["params"]) == ids([model.emb.weight, model.proj.weight])
    assert ids(plain["params"]) == ids(
        [model.norm.weight, model.norm.bias, model.rms.weight, model.proj.bias, model.gain]
    )
    Lamb([decay, plain])  # the groups are valid Lamb groups


def test_excluded_types_and_bad_weight_decay() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Conv1d(2, 2, 3))
    groups = lamb_param_groups(model, exclude_types=(nn.Conv1d,))
    assert len(groups[1]["params"]) == 3  # linear bias, conv weight, conv bias
    with pytest.raises(ValueError, match=r"weight_decay must be >= 0, got -1"):
        lamb_param_groups(model, weight_decay=-1)
