"""Typed, validated configuration (attrs). Every check names the field it rejects.

``Config`` has one section per concern (``model``, ``data``, ``optim``, ``parallel``,
``train``, ``checkpoint``); ``load_config`` builds it from a preset, a TOML or JSON file
and ``--set section.field=value`` overrides, in that order. Each class's docstring entry
for a field is that field's help (``ms-train config`` lists them).
"""

from __future__ import annotations

import difflib
import math
import os
import sys
from typing import Any, Literal

import attrs

from ms_train.errors import JobError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

__all__ = [
    "PRESETS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "load_config",
]


class ConfigError(JobError, ValueError):
    """A configuration value is invalid; the message names the field."""


def _positive_int(name: str) -> Any:
    def check(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if type(value) is not int or value < 1:
            raise ConfigError(f"{name}.{attr.name} must be an int >= 1, got {value!r}")

    return check


def _choice(name: str, options: tuple[str, ...]) -> Any:
    def check(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value not in options:
            raise ConfigError(f"{name}.{attr.name} must be one of {list(options)}, got {value!r}")

    return check


def _unit_float(name: str) -> Any:
    def check(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if type(value) not in (int, float) or not 0.0 <= value < 1.0:
            raise ConfigError(f"{name}.{attr.name} must be a float in [0, 1), got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class ModelConfig:
    """A GPT decoder.

    Attributes:
        vocab_size: tokens in the vocabulary.
        d_model: hidden size.
        n_layers: transformer blocks.
        n_heads: attention heads; must divide ``d_model``.
        d_ff: MLP hidden size (default ``4 * d_model``).
        seq_len: the longest sequence (positions of the learned position embedding).
        block: ``"parallel"`` (MegaScale: ``y = x + MLP(LN(x)) + Attn(LN(x))``, one
            LayerNorm shared by both branches) or ``"serial"`` (GPT-2:
            ``h = x + Attn(LN1(x)); y = h + MLP(LN2(h))``).
        window: sliding-window attention over this many tokens, the current one
            included (Hugging Face's convention; flash-attn's ``(window - 1, 0)``);
            ``None``: full causal attention.
        tie_embeddings: the output projection reuses the token embedding.
        dropout: dropout probability on the attention output, MLP output and embeddings.
        init_std: standard deviation of the normal initialization; output projections
            of each block are scaled by ``1 / sqrt(2 * n_layers)`` (GPT-2).
        seed: initialization seed. Each parameter is drawn from a generator seeded by
            this and the parameter's name, so any parallel layout gets the same weights.
        kernels: ``"auto"`` (ms-kernels picks Triton/flash on CUDA, torch on CPU),
            ``"torch"`` or ``"triton"``: the ``backend`` passed to every ms-kernels op.
    """

    vocab_size: int = attrs.field(validator=_positive_int("model"))
    d_model: int = attrs.field(validator=_positive_int("model"))
    n_layers: int = attrs.field(validator=_positive_int("model"))
    n_heads: int = attrs.field(validator=_positive_int("model"))
    d_ff: int | None = attrs.field(default=None)
    seq_len: int = attrs.field(validator=_positive_int("model"))
    block: Literal["parallel", "serial"] = attrs.field(
        default="parallel", validator=_choice("model", ("parallel", "serial"))
    )
    window: int | None = attrs.field(default=None)
    tie_embeddings: bool = attrs.field(default=True)
    dropout: float = attrs.field(default=0.0, validator=_unit_float("model"))
    init_std: float = attrs.field(default=0.02)
    seed: int = attrs.field(default=0)
    kernels: Literal["auto", "torch", "triton"] = attrs.field(
        default="auto", validator=_choice("model", ("auto", "torch", "triton"))
    )

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.n_heads must divide model.d_model: {self.d_model} is not a multiple "
                f"of {self.n_heads}"
            )
        if self.d_ff is not None and (type(self.d_ff) is not int or self.d_ff < 1):
            raise ConfigError(f"model.d_ff must be None or an int >= 1, got {self.d_ff!r}")
        if self.window is not None and (type(self.window) is not int or self.window < 1):
            raise ConfigError(
                f"model.window must be None (full causal attention) or an int >= 1 "
                f"(tokens seen, the current one included), got {self.window!r}"
            )
        if self.window is not None and self.window > self.seq_len:
            # Refused rather than read as full attention: the config is the run's record,
            # and a window no sequence can fill says something the model does not do.
            raise ConfigError(
                f"model.window ({self.window}) must not exceed model.seq_len "
                f"({self.seq_len}): a window that long is full causal attention; set "
                f"model.window=none for that, or a window <= {self.seq_len}"
            )
        if type(self.tie_embeddings) is not bool:
            raise ConfigError(f"model.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if type(self.init_std) not in (int, float) or not self.init_std > 0:
            raise ConfigError(f"model.init_std must be a float > 0, got {self.init_std!r}")
        if type(self.seed) is not int:
            raise ConfigError(f"model.seed must be an int, got {self.seed!r}")

    @property
    def ffn_size(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _float(name: str, *, low: float | None = None, low_open: bool = False) -> Any:
    def check(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        ok = type(value) in (int, float) and math.isfinite(value)
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if not ok:
            bound = "" if low is None else f" {'>' if low_open else '>='} {low}"
            raise ConfigError(f"{name}.{attr.name} must be a number{bound}, got {value!r}")

    return check


def _bool(name: str) -> Any:
    def check(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if type(value) is not bool:
            raise ConfigError(f"{name}.{attr.name} must be true or false, got {value!r}")

    return check


def _str(name: str) -> Any:
    def check(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if type(value) is not str:
            raise ConfigError(f"{name}.{attr.name} must be a string, got {value!r}")

    return check


def _nonneg_int(name: str) -> Any:
    def check(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if type(value) is not int or value < 0:
            raise ConfigError(f"{name}.{attr.name} must be an int >= 0, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class DataConfig:
    """Training data: ms-data shards read through a NodeLoader.

    Attributes:
        shards: a directory of ms-data shards; ``""``: the embedded demo corpus (the
            Python standard library's source, built into shards on first use).
        tokenizer: ``"bytes"`` or the path of a Hugging Face tokenizer.json.
        micro_batch: sequences per rank per forward/backward.
        global_batch: sequences per optimizer step over all data-parallel ranks; must be
            a multiple of ``micro_batch * dp`` (the quotient is the accumulation count).
        shuffle: visit sequences in a seeded random order.
        prefetch: micro-batches the node loader keeps ready ahead of the trainer.
        seed: the data order's seed.
        eval_fraction: the fraction of documents held out of training for evaluation
            (``train.eval_every``), at least one document when > 0; a fixed choice, the
            same for any seed or number of ranks. 0: no held-out split, and the training
            stream of earlier versions.
    """

    shards: str = attrs.field(default="", validator=_str("data"))
    tokenizer: str = attrs.field(default="bytes", validator=_str("data"))
    micro_batch: int = attrs.field(default=4, validator=_positive_int("data"))
    global_batch: int = attrs.field(default=8, validator=_positive_int("data"))
    shuffle: bool = attrs.field(default=True, validator=_bool("data"))
    prefetch: int = attrs.field(default=4, validator=_positive_int("data"))
    seed: int = attrs.field(default=0, validator=_nonneg_int("data"))
    eval_fraction: float = attrs.field(default=0.0, validator=_unit_float("data"))


@attrs.frozen(kw_only=True)
class OptimConfig:
    """Optimizer and learning-rate schedule (linear warm-up, then cosine to ``min_lr``).

    Attributes:
        name: ``"lamb"`` (ms-optim) or ``"adamw"`` (torch).
        lr: peak learning rate, reached after ``warmup_steps``.
        min_lr: the cosine schedule's floor at the last step.
        warmup_steps: linear warm-up steps from 0, at most ``train.steps``; ``None``
            (the default): derived from the run's length, 5% of ``train.steps``
            (rounded up) but at most ``max_warmup_steps`` (``Config.warmup_steps``).
        max_warmup_steps: the derived warm-up's ceiling: a long run warms up for this
            many steps (what the optimizer needs to settle does not grow with the run),
            a short one for 5% of its steps, so a smoke run still reaches the peak rate.
        weight_decay: decoupled weight decay; biases, norms and embeddings get none.
        beta1, beta2, eps: the moment coefficients and the denominator's epsilon.
        clip_grad: clip the global gradient norm to this (0: no clipping).
    """

    name: Literal["lamb", "adamw"] = attrs.field(
        default="lamb", validator=_choice("optim", ("lamb", "adamw"))
    )
    lr: float = attrs.field(default=3e-3, validator=_float("optim", low=0.0, low_open=True))
    min_lr: float = attrs.field(default=3e-4, validator=_float("optim", low=0.0))
    warmup_steps: int | None = attrs.field(default=None)
    max_warmup_steps: int = attrs.field(default=2000, validator=_nonneg_int("optim"))
    weight_decay: float = attrs.field(default=0.01, validator=_float("optim", low=0.0))
    beta1: float = attrs.field(default=0.9, validator=_unit_float("optim"))
    beta2: float = attrs.field(default=0.95, validator=_unit_float("optim"))
    eps: float = attrs.field(default=1e-8, validator=_float("optim", low=0.0, low_open=True))
    clip_grad: float = attrs.field(default=1.0, validator=_float("optim", low=0.0))

    def __attrs_post_init__(self) -> None:
        if self.warmup_steps is not None and (
            type(self.warmup_steps) is not int or self.warmup_steps < 0
        ):
            raise ConfigError(
                f"optim.warmup_steps must be None (derived from train.steps) or an int >= 0, "
                f"got {self.warmup_steps!r}"
            )
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr ({self.min_lr}) must not exceed optim.lr ({self.lr})")


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """How the ranks split the work. ``dp`` is what is left of the world after
    ``tp * pp``; it is checked against the world size at launch.

    Attributes:
        tp: tensor-parallel size, with sequence parallelism (must divide the heads, the
            FFN size and the sequence length).
        pp: pipeline-parallel size (stages).
        virtual_stages: model chunks per pipeline rank (interleaved 1F1B); the layers
            must split evenly into ``pp * virtual_stages`` chunks.
        engine: the step engine (``ms_parallel.engine``): ``"zero"`` (ZeRO-2: gradients
            reduce-scattered per bucket during backward, optimizer state sharded, the
            updated parameters all-gathered chunk by chunk ahead of the next forward) or
            ``"ddp"`` (torch DistributedDataParallel). Checkpoints of one do not load
            into the other.
        bucket_mb: the size cap of a gradient bucket in MiB (both engines).
        collective_timeout_s: ZeRO bounds every wait on a collective by this many
            seconds; a rank that stops participating then fails the others with an
            error naming the collective, the group and the chunk.
        replicated_chunks: ZeRO only: how many of the model's chunks, from the first
            (the embeddings, then each block, then the final norm and head: ``n_layers
            + 2`` in all), are kept whole on every rank instead of sharded. Their
            gradients are all-reduced and every rank steps them, so no all-gather
            stands between the optimizer step and the next forward; the cost is
            their optimizer state on every rank. 2 (the embeddings and the first
            block) suits a network whose collective latency is up to about one
            block's forward and backward; the embeddings' own compute hides nothing
            (ms-parallel's ``docs/zero-critical-path.md``). Checkpoints load across
            values.
        tp_chunks: tensor parallelism's chunk count: how many pieces each collective
            matmul's all-gather or reduce-scatter is split into, each overlapped with
            GEMMs. 0 (default): measured per shape on the first step (ms-parallel's
            ``ChunkTuner``) and kept in the checkpoints, so that a resumed run uses the
            same counts (they set the order of floating-point sums).
    """

    tp: int = attrs.field(default=1, validator=_positive_int("parallel"))
    pp: int = attrs.field(default=1, validator=_positive_int("parallel"))
    virtual_stages: int = attrs.field(default=1, validator=_positive_int("parallel"))
    engine: Literal["zero", "ddp"] = attrs.field(
        default="zero", validator=_choice("parallel", ("zero", "ddp"))
    )
    bucket_mb: float = attrs.field(
        default=25.0, validator=_float("parallel", low=0.0, low_open=True)
    )
    collective_timeout_s: float = attrs.field(
        default=600.0, validator=_float("parallel", low=0.0, low_open=True)
    )
    replicated_chunks: int = attrs.field(default=0, validator=_nonneg_int("parallel"))
    tp_chunks: int = attrs.field(default=0, validator=_nonneg_int("parallel"))


@attrs.frozen(kw_only=True)
class TrainConfig:
    """The loop.

    Attributes:
        steps: optimizer steps in all (a resumed run continues to the same total).
        precision: ``"auto"`` (bf16 autocast where the device supports it fast, i.e.
            CUDA with bf16; fp32 on CPU), ``"bf16"`` or ``"fp32"``.
        device: ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda"``.
        seed: seed of everything not seeded elsewhere (dropout).
        log_every: steps between metric lines.
        out_dir: where metrics, the loss plot, the sample and the summary go.
        sample_tokens: tokens generated at the end (0: no sample).
        sample_prompt: the text the sample continues.
        eval_every: steps between evaluations of the loss on the held-out split
            (``data.eval_fraction``), also run at the last step; 0: none.
        eval_batches: global batches (``data.global_batch`` sequences each) of the
            held-out split in one evaluation: the same sequences every time, however
            many ranks share them.
        tensorboard: also write the metrics as TensorBoard event files under
            ``out_dir/tensorboard`` (needs the ``tensorboard`` extra).
    """

    steps: int = attrs.field(default=100, validator=_positive_int("train"))
    precision: Literal["auto", "bf16", "fp32"] = attrs.field(
        default="auto", validator=_choice("train", ("auto", "bf16", "fp32"))
    )
    device: Literal["auto", "cpu", "cuda"] = attrs.field(
        default="auto", validator=_choice("train", ("auto", "cpu", "cuda"))
    )
    seed: int = attrs.field(default=0, validator=_nonneg_int("train"))
    log_every: int = attrs.field(default=1, validator=_positive_int("train"))
    out_dir: str = attrs.field(default="runs/default", validator=_str("train"))
    sample_tokens: int = attrs.field(default=200, validator=_nonneg_int("train"))
    sample_prompt: str = attrs.field(default="def ", validator=_str("train"))
    eval_every: int = attrs.field(default=0, validator=_nonneg_int("train"))
    eval_batches: int = attrs.field(default=2, validator=_positive_int("train"))
    tensorboard: bool = attrs.field(default=False, validator=_bool("train"))


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """ms-ckpt two-stage checkpoints.

    Attributes:
        dir: the checkpoint root (path or fsspec URL); ``""``: ``<train.out_dir>/ckpt``.
        every: save every this many steps, and at the end (0: only at the end).
        keep_last: committed checkpoints kept.
        resume: start from the newest committed checkpoint when there is one.
        max_failures: failed saves in a row that end the run. A failed save (a full
            disk, a dead writer) is logged and counted and training goes on, since the
            committed checkpoints are untouched; a save that commits resets the count.
            A failed final save is tried again until this many in a row have failed.
            1: the first failure ends the run.
        grace_s: after SIGTERM or a first Ctrl-C, the seconds the run has to finish its
            step and commit a checkpoint of it (a scheduler's notice before it preempts
            the job is often 30-60 s); a save still running then is abandoned and the
            newest committed step is reported. The launcher kills ranks that are not
            gone 15 s after it.
    """

    dir: str = attrs.field(default="", validator=_str("checkpoint"))
    every: int = attrs.field(default=50, validator=_nonneg_int("checkpoint"))
    keep_last: int = attrs.field(default=2, validator=_positive_int("checkpoint"))
    resume: bool = attrs.field(default=True, validator=_bool("checkpoint"))
    max_failures: int = attrs.field(default=3, validator=_positive_int("checkpoint"))
    grace_s: float = attrs.field(
        default=60.0, validator=_float("checkpoint", low=0.0, low_open=True)
    )


_SECTIONS: dict[str, type[Any]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
}


@attrs.frozen(kw_only=True)
class Config:
    """Every section; cross-section rules are checked here."""

    model: ModelConfig
    data: DataConfig = attrs.field(factory=DataConfig)
    optim: OptimConfig = attrs.field(factory=OptimConfig)
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig)
    train: TrainConfig = attrs.field(factory=TrainConfig)
    checkpoint: CheckpointConfig = attrs.field(factory=CheckpointConfig)

    def __attrs_post_init__(self) -> None:
        m, p = self.model, self.parallel
        if m.n_heads % p.tp:
            raise ConfigError(
                f"parallel.tp ({p.tp}) must divide model.n_heads ({m.n_heads}): each "
                "tensor-parallel rank holds whole heads"
            )
        if m.ffn_size % p.tp:
            raise ConfigError(
                f"parallel.tp ({p.tp}) must divide the FFN size ({m.ffn_size}, model.d_ff)"
            )
        if m.seq_len % p.tp:
            raise ConfigError(
                f"parallel.tp ({p.tp}) must divide model.seq_len ({m.seq_len}): sequence "
                "parallelism splits each sequence over the tensor-parallel ranks"
            )
        if p.replicated_chunks and p.engine != "zero":
            raise ConfigError(
                f"parallel.replicated_chunks ({p.replicated_chunks}) applies to the zero "
                f"engine only, got parallel.engine = {p.engine!r}"
            )
        if p.replicated_chunks > m.n_layers + 2:
            raise ConfigError(
                f"parallel.replicated_chunks ({p.replicated_chunks}) must not exceed the "
                f"model's {m.n_layers + 2} ZeRO chunks (model.n_layers + 2: the "
                "embeddings, each block, the final norm and head)"
            )
        chunks = p.pp * p.virtual_stages
        if m.n_layers % chunks:
            raise ConfigError(
                f"model.n_layers ({m.n_layers}) must split evenly into parallel.pp x "
                f"parallel.virtual_stages = {p.pp} x {p.virtual_stages} = {chunks} chunks"
            )
        if self.data.global_batch % self.data.micro_batch:
            raise ConfigError(
                f"data.global_batch ({self.data.global_batch}) must be a multiple of "
                f"data.micro_batch ({self.data.micro_batch})"
            )
        if self.train.eval_every and not self.data.eval_fraction:
            raise ConfigError(
                f"train.eval_every = {self.train.eval_every} needs a held-out split to "
                "evaluate on: set data.eval_fraction > 0 (e.g. 0.01)"
            )
        if self.optim.warmup_steps is not None and self.optim.warmup_steps > self.train.steps:
            raise ConfigError(
                f"optim.warmup_steps ({self.optim.warmup_steps}) must not exceed "
                f"train.steps ({self.train.steps}); leave it unset to derive it from "
                "train.steps"
            )

    @property
    def warmup_steps(self) -> int:
        """The run's warm-up: ``optim.warmup_steps``, or 5% of ``train.steps`` (rounded
        up) capped by ``optim.max_warmup_steps`` when that is None."""
        if self.optim.warmup_steps is not None:
            return self.optim.warmup_steps
        return min(self.optim.max_warmup_steps, -(-self.train.steps // 20))

    def layout(self, world_size: int) -> tuple[int, int]:
        """(dp, gradient-accumulation steps) for ``world_size`` ranks, or ConfigError."""
        p = self.parallel
        model_parallel = p.tp * p.pp
        if type(world_size) is not int or world_size < 1 or world_size % model_parallel:
            raise ConfigError(
                f"the world size ({world_size}) must be a multiple of parallel.tp x "
                f"parallel.pp = {p.tp} x {p.pp} = {model_parallel}"
            )
        dp = world_size // model_parallel
        per_step = self.data.micro_batch * dp
        if self.data.global_batch % per_step:
            raise ConfigError(
                f"data.global_batch ({self.data.global_batch}) must be a multiple of "
                f"data.micro_batch x dp = {self.data.micro_batch} x {dp} = {per_step}"
            )
        return dp, self.data.global_batch // per_step

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: attrs.asdict(getattr(self, name)) for name in _SECTIONS}

    def to_toml(self) -> str:
        """Every field as TOML that ``load_config(path)`` reads back to an equal Config
        (a None is left out, so its default, None, applies; see ``_config_io``)."""
        from ms_train._config_io import config_to_toml  # it imports this module

        return config_to_toml(self)


# ------------------------------------------------------------------------- presets

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # The CPU demo: 2 data-parallel ranks on the embedded corpus (bytes tokenizer).
    "tiny": {
        "model": {
            "vocab_size": 257,
            "d_model": 128,
            "n_layers": 4,
            "n_heads": 4,
            "seq_len": 128,
            "window": 64,
            "block": "parallel",
        },
        "data": {"micro_batch": 8, "global_batch": 16},
        # 5% of 600 steps is 30; the cap keeps 30 when a resumed run goes on further.
        "optim": {"name": "lamb", "lr": 1e-2, "min_lr": 1e-3, "max_warmup_steps": 30},
        "train": {"steps": 600, "out_dir": "runs/tiny", "log_every": 10},
        "checkpoint": {"every": 100},
    },
    # GPT-3 XL-like, 1.3B parameters.
    "gpt-1b": {
        "model": {
            "vocab_size": 64000,
            "d_model": 2048,
            "n_layers": 24,
            "n_heads": 16,
            "seq_len": 2048,
        },
        "data": {"micro_batch": 4, "global_batch": 512},
        "optim": {"lr": 2e-3, "min_lr": 2e-4, "max_warmup_steps": 2000},
        "train": {"steps": 100_000, "out_dir": "runs/gpt-1b"},
        "checkpoint": {"every": 1000},
    },
    "gpt-13b": {
        "model": {
            "vocab_size": 64000,
            "d_model": 5120,
            "n_layers": 40,
            "n_heads": 40,
            "seq_len": 2048,
        },
        "data": {"micro_batch": 2, "global_batch": 1024},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "max_warmup_steps": 2000},
        "parallel": {"tp": 8, "pp": 2},
        "train": {"steps": 100_000, "out_dir": "runs/gpt-13b"},
        "checkpoint": {"every": 1000},
    },
    # The MegaScale paper's 175B model and 3D layout (Tables 1 and 2): TP 8, PP 8 with
    # 6 interleaved stages, batch 6144 sequences of 2048; 12,288 GPUs give DP 192.
    "gpt-175b": {
        "model": {
            "vocab_size": 64000,
            "d_model": 12288,
            "n_layers": 96,
            "n_heads": 128,
            "seq_len": 2048,
        },
        "data": {"micro_batch": 1, "global_batch": 6144},
        "optim": {"name": "lamb", "lr": 6e-4, "min_lr": 6e-5, "max_warmup_steps": 2000},
        "parallel": {"tp": 8, "pp": 8, "virtual_stages": 6},
        "train": {"steps": 100_000, "out_dir": "runs/gpt-175b"},
        "checkpoint": {"every": 500},
    },
}


# ------------------------------------------------------------------------- loading


def _field_names(section: str) -> list[str]:
    return [f.name for f in attrs.fields(_SECTIONS[section])]


def _unknown(what: str, name: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {what} {name!r}{hint} (known: {', '.join(known)})")


def _merge(base: dict[str, dict[str, Any]], extra: dict[str, Any], source: str) -> None:
    for section, values in extra.items():
        if section not in _SECTIONS:
            raise _unknown(f"section in {source}:", section, list(_SECTIONS))
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table, got {values!r}")
        known = _field_names(section)
        for key, value in values.items():
            if key not in known:
                raise _unknown(
                    f"key in {source}:", f"{section}.{key}", [f"{section}.{k}" for k in known]
                )
            base.setdefault(section, {})[key] = value


def _parse_value(text: str) -> Any:
    """A --set value: TOML syntax (``8``, ``3e-4``, ``true``, ``"x"``), a bare word as a
    string, ``none``/``null`` as None."""
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    preset: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> Config:
    """The preset's values, then the file's (JSON when ``path`` ends in ``.json``, else
    TOML), then ``overrides`` (``"model.n_layers=8"``).

    Without a preset or a file, ``tiny``. Raises ConfigError naming the field.
    """
    if preset is not None and preset not in PRESETS:
        raise _unknown("preset", preset, list(PRESETS))
    values: dict[str, dict[str, Any]] = {}
    start = preset if preset is not None else ("tiny" if path is None else None)
    if start is not None:
        _merge(values, PRESETS[start], f"preset {start}")
    if path is not None:
        from ms_train._config_io import read_config_file  # it imports this module

        _merge(values, read_config_file(path), os.fspath(path))
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--set takes section.field=value, got {item!r}")
        _merge(values, {section: {name: _parse_value(text.strip())}}, "--set")
    if "model" not in values:
        raise ConfigError("the [model] section is required (or use a preset)")
    sections: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        kwargs = values.get(section, {})
        missing = [
            f"{section}.{f.name}"
            for f in attrs.fields(cls)
            if f.default is attrs.NOTHING and f.name not in kwargs
        ]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} must be given (no default): in the file's [{section}] "
                "table, with --set, or by a --preset"
            )
        sections[section] = cls(**kwargs)
    return Config(**sections)
