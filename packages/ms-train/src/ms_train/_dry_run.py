"""``ms-train --dry-run``: what a run would do, after validation and preflight.

The layout, the model's parameter count (from the model built on the meta device, so
no weights are drawn, even for gpt-175b) and the model FLOPs of one optimizer step.
Nothing is trained, built or written.
"""

from __future__ import annotations

from ms_train._preflight import Preflight
from ms_train.config import Config
from ms_train.flops import model_flops_per_token

__all__ = ["dry_run_plan"]


def dry_run_plan(config: Config, world_size: int, checked: Preflight) -> str:
    """The plan of ``config`` on ``world_size`` ranks, as lines of text."""
    import torch

    from ms_train.model import GPT

    c, m = config, config.model
    dp, accum = c.layout(world_size)
    cuda = c.train.device == "cuda" or (c.train.device == "auto" and torch.cuda.is_available())
    bf16 = cuda and c.train.precision != "fp32" and torch.cuda.is_bf16_supported()
    precision = "bf16 autocast" if bf16 or c.train.precision == "bf16" else "fp32"
    params = GPT(m, device="meta").num_parameters()
    per_token = model_flops_per_token(m)
    tokens_per_step = c.data.global_batch * m.seq_len
    attention = f"sliding window {m.window}" if m.window else "full causal"
    warmup = (
        f"{c.warmup_steps}"
        if c.optim.warmup_steps is not None
        else f"{c.warmup_steps} (derived: 5% of train.steps, at most optim.max_warmup_steps "
        f"= {c.optim.max_warmup_steps})"
    )
    if checked.resume_step is None:
        resume = f"none to resume; a run starts fresh and saves to {checked.checkpoint_dir}"
    elif checked.resume_step >= c.train.steps:
        resume = (
            f"step {checked.resume_step} under {checked.checkpoint_dir} already reaches "
            f"train.steps = {c.train.steps}; a run trains nothing"
        )
    else:
        resume = (
            f"a run resumes from step {checked.resume_step} under {checked.checkpoint_dir} "
            f"(model checked against this config)"
        )
    lines = [
        "ms-train: dry run: the config is valid and preflight passed; nothing was trained "
        "or written",
        f"  model: GPT {params:,} parameters ({params / 1e6:.2f}M; {m.n_layers} layers, "
        f"d_model {m.d_model}, {m.n_heads} heads, {m.block} blocks, {attention}), "
        f"seq_len {m.seq_len}, vocabulary {m.vocab_size}",
        f"  layout: {world_size} rank(s) on {'cuda' if cuda else 'cpu'} ({precision}): "
        f"tensor-parallel {c.parallel.tp} x pipeline-parallel {c.parallel.pp} x "
        f"data-parallel {dp}; micro-batch {c.data.micro_batch} x accumulation {accum} x "
        f"dp {dp} = global batch {c.data.global_batch} ({tokens_per_step:,} tokens per step)",
        f"  FLOPs per step: {per_token.total * tokens_per_step:.4e} "
        f"({per_token.total:.4e} per token: dense {per_token.dense:.4e}, attention "
        f"{per_token.attention:.4e}, logits {per_token.logits:.4e})",
        f"  schedule: {c.train.steps} steps, {c.optim.name} at lr {c.optim.lr:g} -> "
        f"{c.optim.min_lr:g}, warm-up {warmup}",
        f"  data: {checked.data}",
        f"  checkpoint: {resume}",
        f"  output: {c.train.out_dir}",
    ]
    return "\n".join(lines)
