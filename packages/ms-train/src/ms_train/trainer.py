"""The training loop: the pieces composed.

One optimizer step on every rank:

1. the learning rate of the step (linear warm-up, cosine decay: ``ms_train.schedule``);
2. ``grad_accum`` micro-batches from the ms-data ``NodeLoader`` (one reader process per
   node fills a shared-memory ring ``data.prefetch`` steps ahead), forward under bf16
   autocast where enabled, backward of ``loss / grad_accum``; the step engine
   (``parallel.engine``, ms-parallel's ZeRO-2 by default) owns this loop and reduces
   gradients on the last micro-batch only;
3. the global gradient norm, over every parameter once, clipped to ``optim.clip_grad``;
   the ms-optim LAMB (or torch AdamW) step, on this rank's shards under ZeRO;
4. every ``checkpoint.every`` steps and at the end, an ms-ckpt two-stage checkpoint of
   the model, optimizer, loader position, RNG and step: training goes on while a
   separate process writes it.

**Batches.** Step ``s`` trains on global samples ``[s * GB, (s + 1) * GB)`` of the
packed stream (``GB = data.global_batch``), however the ranks split them: rank ``r`` of
``dp`` gets the samples ``g`` with ``g % dp == r``, ``micro_batch`` per loader step, and
``GB / (dp * micro_batch)`` loader steps make one optimizer step. The loss of a step is
the mean over its global batch, so one process and ``dp`` ranks train the same model.

**Resume.** With ``checkpoint.resume`` the newest committed checkpoint under
``checkpoint.dir`` is loaded (a damaged one falls back to the previous, with a warning)
and training continues to ``train.steps``; on CPU the continued run is bit-identical to
an uninterrupted one. ``metrics.jsonl`` keeps the lines up to the checkpoint's step.
The data-parallel size may differ from the saving job's: the model, optimizer and step
are replicated, the loader resumes at global sample ``step * GB`` whatever the split,
and each rank's RNG is the saved one at the same size, else seeded from ``train.seed``,
its rank and the step (``ms_train._rng``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ms_ckpt import Checkpointer
from ms_data import Corpus, NodeLoader, PackedDataset, get_tokenizer
from ms_optim import Lamb, ShardMap, lamb_param_groups
from ms_parallel import OptimizerFactory, ShardSpec, StepEngine
from ms_train import _health, _lock, _saves, _stop, report
from ms_train._data_errors import damaged_data
from ms_train._eval import HeldOutEval
from ms_train._launch import launched
from ms_train._peak import Peak, PeakSource, measured_peak, over_peak_warning, table_peak
from ms_train._preflight import preflight
from ms_train._rng import RankRNG, seed_rank
from ms_train._tensorboard import TensorBoardLog
from ms_train.config import Config, ConfigError, OptimConfig
from ms_train.demo import demo_corpus
from ms_train.engine import make_engine
from ms_train.flops import model_flops_per_token
from ms_train.model import GPT
from ms_train.schedule import lr_at

__all__ = ["RunSummary", "Trainer", "build_optimizer"]


@attrs.frozen(kw_only=True)
class RunSummary:
    """What a run did (every rank returns the same numbers but ``files`` and ``sample``,
    which rank 0 alone writes).

    Attributes:
        start_step: the step it started from (the checkpoint's, 0 for a fresh run).
        end_step: the step it reached.
        final_loss: the training loss of the last logged step of this run (the loss of
            ``loss_history[-1]``); NaN when this run trained no step.
        loss_history: ``(step, loss)`` of each logged step of this run: the loss
            averaged over the global batch and over the steps since the previous logged
            step.
        eval_loss: the held-out loss of this run's last evaluation (``train.eval_every``);
            NaN when it made none.
        eval_history: ``(step, held-out loss)`` of each evaluation of this run.
        tokens: tokens trained on by this run, all ranks.
        wall_s: seconds from the first step to the last, the first step excluded from
            the rates (start-up and warm-up), evaluations excluded.
        tokens_per_s, mfu, data_wait: whole-job throughput after the first step, its
            model FLOPs over ``world_size x peak_flops``, and rank 0's share of step
            time spent waiting for data.
        peak_flops: the per-rank FLOP/s MFU is measured against.
        peak_flops_source: where it came from: ``"given"`` (``peak_flops=``,
            ``--peak-tflops``), ``"table"`` (the datasheet value of a known GPU in bf16)
            or ``"measured"`` (the best of several matmul measurements at start); None
            when this run trained nothing and needed no peak.
        peak_flops_detail: how it was found (the device, or the measurements).
        health_cost: with heartbeats, what they cost this rank over ``wall_s``:
            ``loop_s`` in the heartbeat's calls on the training thread (steps and
            collective events), ``sender_cpu_s`` of its sender thread, and ``share``,
            their sum over ``wall_s`` (an upper bound on the tokens/s they take: as if
            the sender's CPU time were all taken from the loop); else None.
    """

    start_step: int
    end_step: int
    final_loss: float
    loss_history: list[tuple[int, float]]
    eval_loss: float
    eval_history: list[tuple[int, float]]
    tokens: int
    wall_s: float
    tokens_per_s: float
    mfu: float
    data_wait: float
    peak_flops: float
    peak_flops_source: PeakSource | None
    peak_flops_detail: str
    world_size: int
    dp: int
    grad_accum: int
    out_dir: str
    checkpoint_dir: str
    files: dict[str, str]
    sample: str | None
    health_cost: dict[str, float] | None = None


def _health_cost(
    before: dict[str, float], after: dict[str, float], wall_s: float
) -> dict[str, float]:
    """The heartbeat's cost between two ``Heartbeat.cost()`` readings ``wall_s`` apart."""
    cost = {k: after[k] - before[k] for k in ("loop_s", "loop_calls", "sender_cpu_s")}
    cost["heartbeats"] = after["heartbeats"] - before["heartbeats"]
    cost["wall_s"] = wall_s
    cost["share"] = (cost["loop_s"] + cost["sender_cpu_s"]) / wall_s
    return cost


def optimizer_groups(model: nn.Module, config: OptimConfig) -> list[dict[str, Any]]:
    """Two groups of ``model``'s parameters: weights with weight decay; biases, norm
    parameters and embeddings without (and, for LAMB, without layer adaptation)."""
    return lamb_param_groups(model, config.weight_decay, exclude_types=(nn.Embedding,))


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
                    ),
                    process_group=shards.group,
                )
            return Lamb(groups, lr=config.lr, betas=betas, eps=config.eps)
        plain = [{k: v for k, v in g.items() if k != "layer_adaptation"} for g in groups]
        return torch.optim.AdamW(plain, lr=config.lr, betas=betas, eps=config.eps)

    return make


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer of :func:`optimizer_factory` on ``model``'s own parameters."""
    return optimizer_factory(config)(optimizer_groups(model, config), None)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def _resolve_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device is 'cuda' but CUDA is not available here")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _resolve_precision(choice: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for fp32."""
    if choice == "fp32":
        return None
    if choice == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("train.precision is 'bf16' but this GPU does not support bf16")
        return torch.bfloat16
    # auto: bf16 where it is fast (CUDA with bf16 support); fp32 on CPU.
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


class Trainer:
    """Trains ``config`` on this process's rank; every rank of the job builds one.

    Under torchrun (``WORLD_SIZE`` > 1) the default process group is created here when
    it does not exist yet (gloo on CPU, NCCL on CUDA) and destroyed by :meth:`close`.

    Args:
        config: the run.
        engine: the data-parallel engine; default: ``parallel.engine`` from ``ENGINES``.
        stream: where rank 0 reports (default stdout); other ranks stay quiet.
        peak_flops: per-rank FLOP/s for MFU; default: the datasheet value of a known GPU
            computing in bf16, else the best of five 0.2 s matmul measurements at start
            on this device (``ms_train.flops.matmul_peak_flops``).
        job_id: names the node loader's shared memory; default: agreed among the ranks.
        loader: this rank's micro-batches instead of the ms-data ``NodeLoader`` over
            ``data.shards``: an iterator of int64 tensors of shape ``(data.micro_batch,
            model.seq_len + 1)``, step ``t`` of rank ``r`` holding the samples the global
            stream gives it (see the module docstring). With ``state_dict`` /
            ``load_state_dict`` it is checkpointed (one copy for all ranks) and resumed,
            at another data-parallel size too, where the same step must mean the same
            global samples; ``data_wait_s`` and ``wall_s`` counters, when it has them,
            feed the data-wait metric; ``close()`` is called by :meth:`close`.
    """

    #: Whether :meth:`train`'s SIGINT/SIGTERM handlers stay installed after it and
    #: :meth:`close` (False: they are put back, as a library should). The ``ms-train``
    #: rank process sets it: its process ends with the trainer, and a signal that comes
    #: while it ends (the elastic agent's SIGTERM once a peer has died) must let it end
    #: on its own and report, not kill it.
    keep_signal_handlers = False

    def __init__(
        self,
        config: Config,
        *,
        engine: StepEngine | None = None,
        stream: TextIO | None = None,
        peak_flops: float | None = None,
        job_id: str | None = None,
        loader: Any = None,
    ) -> None:
        try:
            self._build(
                config,
                engine=engine,
                stream=stream,
                peak_flops=peak_flops,
                job_id=job_id,
                loader=loader,
            )
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Undo what a failed constructor had started, at once rather than whenever the
        half-built object is collected: the run lock (a caller that catches the error
        and starts again in the same directory would meet it), the loader's reader, and
        the process group it created (a process that exits with a live gloo group dies
        in C++, "terminate called without an active exception")."""
        lock = getattr(self, "_run_lock", None)
        if lock is not None:
            lock.release()
        health = getattr(self, "health", None)
        if health is not None:
            health.stop()
        close = getattr(getattr(self, "loader", None), "close", None)
        if callable(close) and getattr(self, "_loader_owned", False):
            close()
        if getattr(self, "_owns_group", False) and dist.is_initialized():
            dist.destroy_process_group()

    def _build(
        self,
        config: Config,
        *,
        engine: StepEngine | None,
        stream: TextIO | None,
        peak_flops: float | None,
        job_id: str | None,
        loader: Any,
    ) -> None:
        if not isinstance(config, Config):
            raise TypeError(f"config must be a ms_train.Config, got {type(config).__name__}")
        self.config = config
        preflight(config, data=loader is None)  # before the process group and the model
        self._owns_group = False
        self._closed = False
        world = _env_int("WORLD_SIZE", 1)
        if world > 1 and not dist.is_initialized():
            backend = (
                "nccl" if torch.cuda.is_available() and config.train.device != "cpu" else "gloo"
            )
            # The group's own timeout bounds every collective, also those whose
            # wait(timeout) a backend ignores (gloo's emulated reduce-scatter).
            dist.init_process_group(
                backend, timeout=datetime.timedelta(seconds=config.parallel.collective_timeout_s)
            )
            self._owns_group = True
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        p = config.parallel
        self.dp, self.grad_accum = config.layout(self.world_size)
        self.local_rank = _env_int("LOCAL_RANK", self.rank)
        self.local_world_size = _env_int("LOCAL_WORLD_SIZE", self.world_size)
        self.device = _resolve_device(config.train.device, self.local_rank)
        self.autocast_dtype = _resolve_precision(config.train.precision, self.device)
        self.stream = sys.stdout if stream is None else stream
        self.out_dir = Path(config.train.out_dir)
        self.checkpoint_dir = config.checkpoint.dir or str(self.out_dir / "ckpt")
        # One run per directory: rank 0 locks both before anything of the run writes;
        # a refused run fails on every rank. Released by close().
        self._run_lock = _lock.lock_job(
            [("train.out_dir", str(self.out_dir)), ("checkpoint.dir", self.checkpoint_dir)],
            rank=self.rank,
            agree=self._agree,
            log=self._say,
        )
        seed_rank(config.train.seed, self.rank, 0)  # dropout; weights seed by name

        self.tokenizer = get_tokenizer(config.data.tokenizer)
        m = config.model
        if self.tokenizer.vocab_size > m.vocab_size:
            raise ConfigError(
                f"model.vocab_size ({m.vocab_size}) is smaller than the tokenizer's "
                f"vocabulary ({self.tokenizer.vocab_size}, data.tokenizer = "
                f"{config.data.tokenizer!r})"
            )
        self.dataset: PackedDataset | None = None
        self.loader: Any
        if loader is not None:
            if not callable(getattr(loader, "__next__", None)):
                raise TypeError(f"loader must be an iterator, got {type(loader).__name__}")
            if config.train.eval_every:
                raise ConfigError(
                    f"train.eval_every = {config.train.eval_every} evaluates on the held-out "
                    "split of data.shards, and a loader given to the Trainer has none; set "
                    "train.eval_every = 0"
                )
            self.loader = loader
        else:
            self.loader = self._node_loader(job_id)
            self._loader_owned = True  # a failed constructor closes it; a given one stays
        self.evaluator = self._held_out_eval() if config.train.eval_every else None

        self.model = GPT(m, device=self.device)
        # Heartbeats to an ms-health driver when the launcher named one (MS_HEALTH_URL).
        self.health = _health.start_heartbeat()
        on_event = None if self.health is None else self.health.on_event
        self.engine = engine if engine is not None else make_engine(p, self.device, on_event)
        self.engine.setup(
            self.model, optimizer_groups(self.model, config.optim), optimizer_factory(config.optim)
        )
        self.optimizer = self.engine.optimizer
        self.checkpointer = Checkpointer(self.checkpoint_dir, keep_last=config.checkpoint.keep_last)
        self.flops_per_token = model_flops_per_token(m).total
        self._peak: Peak | None = None
        if peak_flops is not None:
            self._peak = Peak(float(peak_flops), "given", "peak_flops= / --peak-tflops")
        self.step = 0
        self._rng_seeded = False  # a resume at another DP size seeded this rank's RNG
        self._stop: _stop.StopRequest | None = None

    # ------------------------------------------------------------------ helpers

    def _node_loader(self, job_id: str | None) -> NodeLoader:
        """The ms-data node loader over ``data.shards`` (or the demo corpus)."""
        c = self.config
        shards = c.data.shards or str(demo_corpus(progress=self.rank == 0))
        self.dataset = PackedDataset(
            Corpus(shards),
            c.model.seq_len,
            seed=c.data.seed,
            eos_id=self.tokenizer.eos_id,
            shuffle=c.data.shuffle,
            dp_rank=self.rank,
            dp_size=self.dp,
            held_out=c.data.eval_fraction,
        )
        no_torchrun = os.environ.get("TORCHELASTIC_RUN_ID") is None
        if job_id is None and no_torchrun and self.local_world_size > 1:
            job_id = self._agree(uuid.uuid4().hex)
        return NodeLoader(
            self.dataset,
            micro_batch=c.data.micro_batch,
            dp_rank=self.rank,
            dp_size=self.dp,
            local_rank=self.local_rank,
            local_world_size=self.local_world_size,
            depth=c.data.prefetch,
            job_id=job_id,
            # train() handles SIGINT and SIGTERM (finish the step, save) and closes the
            # loader; the reader must outlive the first signal to feed that step.
            signal_cleanup=False,
        )

    def _held_out_eval(self) -> HeldOutEval:
        c = self.config
        if self.dataset is None:
            raise ConfigError("train.eval_every needs the ms-data loader's held-out split")
        return HeldOutEval(
            self.dataset,
            batches=c.train.eval_batches,
            global_batch=c.data.global_batch,
            micro_batch=c.data.micro_batch,
            dp_rank=self.rank,
            dp_size=self.dp,
            device=self.device,
            group=dist.group.WORLD if dist.is_initialized() else None,
        )

    def _waits(self) -> tuple[float, float]:
        """The loader's (seconds waited for data, wall seconds between batches)."""
        return (
            float(getattr(self.loader, "data_wait_s", 0.0)),
            float(getattr(self.loader, "wall_s", 0.0)),
        )

    def _agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not dist.is_initialized() or self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _say(self, text: str) -> None:
        if self.rank == 0:
            self.stream.write(text + "\n")
            self.stream.flush()

    @contextlib.contextmanager
    def _waiting(self, name: str) -> Iterator[None]:
        """Report a collective of the trainer's own (the loss mean, the stop flag) as a
        wait to the heartbeat, as the engine reports its own: a fast rank waits there
        for a slow one, and that wait is what tells a straggler from its peers."""
        hb = self.health
        if hb is None or self.world_size == 1:
            yield
            return
        hb.on_event(name, "wait_begin", time.perf_counter())
        try:
            yield
        finally:
            hb.on_event(name, "wait_end", time.perf_counter())

    def _phase(self, name: str) -> contextlib.AbstractContextManager[object]:
        """The heartbeat's phase while a block runs (checkpoint, eval), if heartbeats are
        on: a long checkpoint is then no hang to the driver."""
        if self.health is None:
            return contextlib.nullcontext()
        return self.health.phase(name)  # type: ignore[no-any-return]

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _state(self) -> dict[str, Any]:
        state = {
            **self.engine.state(),  # model and optim, in the engine's form
            "rng": RankRNG(),
            "step": self.step,
        }
        if callable(getattr(self.loader, "state_dict", None)):
            state["loader"] = self.loader
        return state

    def data_wait_fraction(self) -> float:
        """The share of this rank's step time spent waiting for data, start-ups excluded."""
        waited, walled = self._waits()
        return waited / walled if walled > 0 else 0.0

    def peak(self) -> Peak:
        """The per-rank peak MFU is measured against, and its source (found once)."""
        peak = self._peak
        if peak is None:
            found = None
            if self.device.type == "cuda":
                found = table_peak(torch.cuda.get_device_name(self.device), self.autocast_dtype)
            if found is None and self.rank == 0:
                size = 1024 if self.device.type == "cpu" else 8192
                found = measured_peak(str(self.device), dtype=self.autocast_dtype, n=size)
            # Every rank uses the same figure: rank 0's.
            peak = self._peak = self._agree(found)
        return peak

    def peak_flops(self) -> float:
        """Per-rank FLOP/s MFU is measured against (:meth:`peak`)."""
        return self.peak().flops

    # ------------------------------------------------------------------ the loop

    def resume(self) -> int:
        """Load the newest committed checkpoint when resuming is on; the step to start at."""
        if not self.config.checkpoint.resume:
            return 0
        has = self._agree(self.checkpointer.latest_step() is not None if self.rank == 0 else None)
        if not has:
            return 0
        state = self._state()
        # Saved at another data-parallel size, the per-rank RNG states have no owner
        # here: the rest loads, and the rule of ms_train._rng seeds this rank's.
        self.step = self.checkpointer.load(state, fallback=True, per_rank="keep")
        if not state["rng"].restored:
            seed_rank(self.config.train.seed, self.rank, self.step)
            self._rng_seeded = True
        return self.step

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step (0-based ``step``): (loss on this rank, grad norm, lr)."""
        c = self.config
        lr = lr_at(
            step,
            lr=c.optim.lr,
            min_lr=c.optim.min_lr,
            warmup_steps=c.warmup_steps,
            total_steps=c.train.steps,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        out = self.engine.step(
            self._next_batch,
            self._loss,
            grad_accum=self.grad_accum,
            max_norm=c.optim.clip_grad if c.optim.clip_grad > 0 else None,
        )
        return out.loss, out.grad_norm, lr

    def _next_batch(self) -> torch.Tensor:
        try:
            return next(self.loader).to(self.device, non_blocking=True)  # type: ignore[no-any-return]
        except Exception as e:
            damaged = damaged_data(e, self.config.data.shards)
            if damaged is None:
                raise
            raise damaged from e

    def _loss(self, module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            _, loss = module(batch[:, :-1], batch[:, 1:])
        return loss  # type: ignore[no-any-return]

    def _global_mean(self, value: torch.Tensor) -> float:
        if self.world_size > 1:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.world_size
        return float(value.item())

    def train(self) -> RunSummary:
        """Resume if there is a checkpoint, train to ``train.steps``, checkpoint, report.

        When it runs in the main thread, SIGINT and SIGTERM finish the step, commit a
        checkpoint of it within ``checkpoint.grace_s`` and raise ``Stopped``; a second
        one ends the process at once (``ms_train._stop``).
        """
        c = self.config
        under = launched()
        self._stop = stop = _stop.StopRequest(
            c.checkpoint.grace_s,
            lambda first: _stop.stop_at_once(self, first),
            self.world_size,
            stop_file=None if under is None else under[1] / _stop.STOP_FILE,
        ).install()
        start = self.resume()
        total_steps = c.train.steps
        tokens_per_step = c.data.global_batch * c.model.seq_len
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(json.dumps(c.to_dict(), indent=2) + "\n")
        self._header(start)
        metrics = (
            report.MetricsLog(self.out_dir / "metrics.jsonl", resume_at=start)
            if self.rank == 0
            else None
        )
        progress = report.Progress(total_steps, start=start, stream=self.stream)
        peak_of = self.peak() if start < total_steps else self._peak
        peak = math.nan if peak_of is None else peak_of.flops
        tensorboard = (
            TensorBoardLog(self.out_dir / "tensorboard", purge_step=start)
            if c.train.tensorboard and self.rank == 0
            else None
        )
        warned = False  # an MFU over 100% is explained once, marked on every line

        losses: list[tuple[int, float]] = []
        evals: list[tuple[int, float]] = []
        cost0: dict[str, float] | None = None  # the heartbeat's cost when rates start
        window_loss = torch.zeros((), device=self.device)
        group = dist.group.WORLD if self.world_size > 1 else None
        self.saves = _saves.Saves(
            self.checkpointer, max_failures=c.checkpoint.max_failures, log=self._say, group=group
        )
        t_first = t_window = time.perf_counter()
        window_steps = 0
        wait0 = self._waits()
        hb = self.health
        if hb is not None:
            hb.set_phase("train")
            progress.health = hb.summary
        tokens_per_rank = tokens_per_step / self.world_size
        for step in range(start, total_steps):
            loss, grad_norm, lr = self.train_step(step)
            self.step = done = step + 1
            if hb is not None:  # no sync: the sender converts the loss on its thread
                hb.step(done, loss=loss, tokens=tokens_per_rank)
            window_steps += 1
            window_loss += loss
            logged = done == start + 1 or done % c.train.log_every == 0 or done == total_steps
            evaluating = bool(c.train.eval_every) and (
                done % c.train.eval_every == 0 or done == total_steps
            )
            logged = logged or evaluating
            record: dict[str, float] | None = None
            if logged:
                with self._waiting("loss_mean"):
                    mean_loss = self._global_mean(window_loss / window_steps)
                now = time.perf_counter()
                rate = window_steps * tokens_per_step / max(now - t_window, 1e-9)
                waits = self._waits()
                waited, walled = waits[0] - wait0[0], waits[1] - wait0[1]
                record = {
                    "step": done,
                    "loss": mean_loss,
                    "lr": lr,
                    "grad_norm": float(grad_norm.item()),
                    "tokens_per_s": rate,
                    "mfu": rate * self.flops_per_token / (self.world_size * peak),
                    "data_wait": waited / walled if walled > 0 else 0.0,
                    "tokens": done * tokens_per_step,
                }
                losses.append((done, mean_loss))
                if evaluating and self.evaluator is not None:
                    t_eval = time.perf_counter()
                    with self._phase("eval"):
                        record["eval_loss"] = self.evaluator.loss(
                            self.engine.eval_module, self._autocast
                        )
                    evals.append((done, record["eval_loss"]))
                    spent = time.perf_counter() - t_eval  # not training time
                    now += spent
                    t_first += spent
                if metrics is not None:
                    metrics.write(record)
                if tensorboard is not None:
                    tensorboard.write(record)
                warning = over_peak_warning(record["mfu"], peak_of) if peak_of else None
                if warning and not warned and self.rank == 0:
                    progress.note(warning)
                    warned = True
                if done == start + 1:  # rates from here on leave out start-up
                    t_first = now
                    cost0 = hb.cost() if hb is not None else None
                t_window, window_steps = now, 0
                window_loss.zero_()
                wait0 = self._waits()
            if (c.checkpoint.every and done % c.checkpoint.every == 0) or done == total_steps:
                self.step = done
                # The norm is global (every rank has the same): the ranks agree to skip.
                norm = float(grad_norm.item())
                if math.isfinite(norm):
                    with self._phase("checkpoint"):
                        self.saves.save(done, self._state())
                else:
                    self._say(
                        f"ms-train: warning: not saving step {done}: its gradient norm is "
                        f"{norm} (the model may be damaged); a resume starts from the "
                        "newest committed checkpoint before it"
                    )
            if self.rank == 0:
                elapsed = time.perf_counter() - t_first
                per_step = elapsed / (done - start - 1) if done > start + 1 else math.nan
                progress.update(done, per_step * (total_steps - done), record)
            with self._waiting("stop_flag"):
                stopping = stop.agreed()
            if stopping:
                progress.close()
                if metrics is not None:
                    metrics.close()
                with self._phase("checkpoint"):
                    stopped = _stop.finish(self, stop, done, self.saves.in_flight)
                raise stopped
        t_end = time.perf_counter()  # the final checkpoint's write is not training time
        health_cost = None
        if hb is not None and cost0 is not None and t_end > t_first:
            health_cost = _health_cost(cost0, hb.cost(), t_end - t_first)
        progress.close()
        with self._phase("checkpoint"):
            # A first signal now lets this save finish (the handlers stay until it has);
            # a second abandons it.
            self.saves.finish(self._state)
        if not self.keep_signal_handlers:
            stop.restore()
        if metrics is not None:
            metrics.close()
        if tensorboard is not None:
            tensorboard.close()

        trained = max(0, total_steps - start)
        timed_steps = max(0, trained - 1)
        wall = t_end - t_first if trained else 0.0
        rate = timed_steps * tokens_per_step / wall if timed_steps and wall > 0 else math.nan
        summary = RunSummary(
            start_step=start,
            end_step=max(start, total_steps),
            final_loss=losses[-1][1] if losses else math.nan,
            loss_history=losses,
            eval_loss=evals[-1][1] if evals else math.nan,
            eval_history=evals,
            tokens=trained * tokens_per_step,
            wall_s=wall,
            tokens_per_s=rate,
            mfu=rate * self.flops_per_token / (self.world_size * peak),
            data_wait=self.data_wait_fraction(),
            peak_flops=peak,
            peak_flops_source=peak_of.source if peak_of else None,
            peak_flops_detail=peak_of.detail if peak_of else "",
            world_size=self.world_size,
            dp=self.dp,
            grad_accum=self.grad_accum,
            out_dir=str(self.out_dir),
            checkpoint_dir=self.checkpoint_dir,
            files={},
            sample=None,
            health_cost=health_cost,
        )
        if self.rank == 0:
            summary = self._finish(summary)
        return summary

    # ------------------------------------------------------------------ reporting

    def _header(self, start: int) -> None:
        c = self.config
        m = c.model
        attention = f"sliding window {m.window}" if m.window else "full causal"
        precision = "fp32" if self.autocast_dtype is None else "bf16 autocast"
        lines = [
            f"ms-train: GPT {self.model.num_parameters() / 1e6:.2f}M parameters "
            f"({m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, {m.block} blocks, "
            f"{attention}), seq_len {m.seq_len}",
            f"  {self.world_size} rank(s) on {self.device.type} ({precision}): data-parallel "
            f"{self.dp} x micro-batch {c.data.micro_batch} x accumulation {self.grad_accum} "
            f"= global batch {c.data.global_batch}; engine {self.engine.name}; "
            f"optimizer {c.optim.name}",
            f"  data: {self._describe_data()}",
        ]
        if self.evaluator is not None:
            lines.append(
                f"  eval: every {c.train.eval_every} steps and at the end, on "
                f"{self.evaluator.describe()}"
            )
        if start >= c.train.steps:
            lines.append(
                f"  checkpoint: step {start} under {self.checkpoint_dir} already reaches "
                f"train.steps = {c.train.steps}; nothing to train (raise train.steps to go on)"
            )
        elif start:
            lines.append(
                f"  checkpoint: resumed from step {start} under {self.checkpoint_dir}; "
                f"training steps {start + 1}..{c.train.steps}"
            )
            if self._rng_seeded:
                lines.append(
                    "  rng: the checkpoint was saved at another data-parallel size; each "
                    "rank's RNG is seeded from train.seed, its rank and the step"
                )
        else:
            lines.append(
                f"  checkpoint: none found; starting fresh, saving to {self.checkpoint_dir}"
            )
        self._say("\n".join(lines))

    def _describe_data(self) -> str:
        if self.dataset is None:
            return f"a {type(self.loader).__name__} given to the trainer"
        corpus = self.dataset.corpus
        source = self.config.data.shards or "embedded demo corpus"
        return f"{corpus.n_docs} documents, {corpus.n_tokens:,} tokens ({source})"

    def sample(self) -> str | None:
        """A short continuation of ``train.sample_prompt`` from the current model."""
        c = self.config.train
        if c.sample_tokens == 0:
            return None
        prompt = self.tokenizer.encode(c.sample_prompt) or [self.tokenizer.eos_id or 0]
        generator = torch.Generator(device=self.device).manual_seed(c.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            with self._autocast():
                ids = self.model.generate(
                    torch.tensor([prompt], device=self.device),
                    c.sample_tokens,
                    temperature=0.8,
                    top_k=40,
                    generator=generator,
                )
        finally:
            self.model.train(was_training)
        decode = getattr(self.tokenizer, "decode", None)  # not every tokenizer has one
        if decode is None:
            return " ".join(str(i) for i in ids[0].tolist())
        return str(decode(ids[0].tolist()))

    def _finish(self, summary: RunSummary) -> RunSummary:
        """Rank 0: the loss plot, the sample and the summary table, written and shown."""
        files = {"metrics": str(self.out_dir / "metrics.jsonl")}
        records = report.read_metrics(files["metrics"])
        if report.plot_loss(records, self.out_dir / "loss.png"):
            files["loss_plot"] = str(self.out_dir / "loss.png")
        text = self.sample()
        if text is not None:
            files["sample"] = str(self.out_dir / "sample.txt")
            Path(files["sample"]).write_text(text + "\n")
            self._say("sample:\n" + "\n".join("  | " + line for line in text.splitlines()))
        files["summary"] = str(self.out_dir / "summary.json")
        summary = attrs.evolve(summary, files=files, sample=text)
        self._say(report.format_summary(self._rows(summary, records)))
        Path(files["summary"]).write_text(
            json.dumps(attrs.asdict(summary), indent=2, default=str) + "\n"
        )
        return summary

    def _rows(self, s: RunSummary, records: list[dict[str, Any]]) -> list[tuple[str, str]]:
        def num(x: float, fmt: str) -> str:
            return "n/a" if not math.isfinite(x) else format(x, fmt)

        first = records[0]["loss"] if records else math.nan
        last = records[-1]["loss"] if records else math.nan
        evals = [r for r in records if "eval_loss" in r]
        rows = [
            ("steps", f"{s.start_step} -> {s.end_step} (this run: {s.end_step - s.start_step})"),
            (
                "loss",
                f"{num(first, '.4f')} (step {records[0]['step']}) -> {num(last, '.4f')} "
                f"(step {records[-1]['step']})"
                if records
                else "n/a",
            ),
            *(
                [("held-out loss", f"{evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})")]
                if evals
                else []
            ),
            ("tokens (this run)", f"{s.tokens:,}"),
            ("wall time", report.format_duration(s.wall_s)),
            ("throughput", f"{num(s.tokens_per_s, ',.0f')} tokens/s"),
            ("MFU", report.format_mfu(s.mfu, s.peak_flops, s.peak_flops_source)),
            *([("peak", s.peak_flops_detail)] if s.peak_flops_source else []),
            ("data wait", f"{100 * s.data_wait:.1f}% of step time"),
            ("checkpoints", s.checkpoint_dir),
        ]
        rows += [(name.replace("_", " "), path) for name, path in s.files.items()]
        return rows

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Wait for the last checkpoint, stop the loader, leave the process group."""
        if self._closed:
            return
        self._closed = True
        try:
            with self._phase("shutdown"):
                self.checkpointer.finalize()  # under the stop handlers, as the save was
        finally:
            if self._stop is not None and not self.keep_signal_handlers:
                self._stop.restore()
            if self.health is not None:
                self.health.stop()
            close = getattr(self.loader, "close", None)
            if callable(close):
                close()
            self._run_lock.release()
            if self._owns_group and dist.is_initialized():
                dist.destroy_process_group()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if (
            kind is not None
            and not issubclass(kind, _stop.Stopped)
            and self.world_size > 1
            and not self._closed
        ):
            # A rank that fails mid-run must not wait at close for a save in flight: its
            # commit needs every rank's part, and a peer may be dead (the writer would
            # wait for checkpoint commit_timeout while the launcher wants the rank gone).
            # The save stays uncommitted; the committed steps are untouched.
            self.checkpointer.abort()
        self.close()
