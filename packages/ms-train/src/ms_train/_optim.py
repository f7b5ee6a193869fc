"""The optimizer the step engines build: the parameter groups of a GPT and the factory
of LAMB (ms-optim, ZeRO-sharded when the engine shards) or AdamW (torch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ms_optim import Lamb, ShardMap, lamb_param_groups
from ms_parallel import OptimizerFactory, ShardSpec
from ms_parallel.tensor_parallel import VocabParallelEmbedding
from ms_train.config import OptimConfig

__all__ = ["optimizer_factory", "optimizer_groups"]


def optimizer_groups(model: nn.Module, config: OptimConfig) -> list[dict[str, Any]]:
    """Two groups of ``model``'s parameters: weights with weight decay; biases, norm
    parameters and embeddings (tensor-parallel ones too) without (and, for LAMB, without
    layer adaptation)."""
    return lamb_param_groups(
        model, config.weight_decay, exclude_types=(nn.Embedding, VocabParallelEmbedding)
    )


def optimizer_factory(config: OptimConfig) -> OptimizerFactory:
    """``make(param_groups, shards)``: LAMB (ms-optim) or AdamW (torch) on the groups an
    engine hands over; with ZeRO's ``shards`` LAMB completes its per-parameter norms
    over the data-parallel group (one packed all-reduce)."""
    betas = (config.beta1, config.beta2)

    def make(groups: list[dict[str, Any]], shards: ShardSpec | None) -> torch.optim.Optimizer:
        if config.name == "lamb":
            if shards is not None and shards.group is not None:
                return Lamb(
                    groups,
                    lr=config.lr,
                    betas=betas,
                    eps=config.eps,
                    shards=ShardMap(
                        param_ids=shards.param_ids,
                        numels=shards.numels,
                        replicated=shards.replicated,
                        replicas=shards.replicas,
                    ),
                    process_group=shards.group,
                )
            return Lamb(groups, lr=config.lr, betas=betas, eps=config.eps)
        plain = [{k: v for k, v in g.items() if k != "layer_adaptation"} for g in groups]
        return torch.optim.AdamW(plain, lr=config.lr, betas=betas, eps=config.eps)

    return make
