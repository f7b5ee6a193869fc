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
and each rank's RNG is the saved one at the same layout, else seeded from
``train.seed``, its data-parallel rank and the step (``ms_train._rng``).
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

import torch
import torch.distributed as dist
from torch import nn

from ms_ckpt import Checkpointer
from ms_data import Corpus, NodeLoader, PackedDataset, get_tokenizer
from ms_parallel import StepEngine, build_mesh
from ms_train import _health, _lock, _saves, _stop, report
from ms_train._data_errors import damaged_data
from ms_train._device import env_int, resolve_device, resolve_precision
from ms_train._eval import HeldOutEval
from ms_train._launcher_env import launched
from ms_train._optim import optimizer_factory, optimizer_groups
from ms_train._peak import Peak, measured_peak, table_peak
from ms_train._preflight import preflight
from ms_train._records import RunRecords
from ms_train._rng import RankRNG, seed_rank
from ms_train._summary import RunSummary, write_report
from ms_train._tp_model import parallelize
from ms_train._window import MetricWindow, RunRates
from ms_train.config import Config, ConfigError, OptimConfig
from ms_train.demo import demo_corpus
from ms_train.engine import make_engine
from ms_train.flops import model_flops_per_token
from ms_train.model import GPT
from ms_train.schedule import lr_at

__all__ = ["RunSummary", "Trainer", "build_optimizer"]

# The checkpoint's entry for the tensor-parallel chunk plan (absent before 0.5 and at TP 1).
_TP_CHUNKS = "tp_chunks"


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer of :func:`optimizer_factory` on ``model``'s own parameters."""
    return optimizer_factory(config)(optimizer_groups(model, config), None)


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
        keep_signal_handlers: whether :meth:`train`'s SIGINT/SIGTERM handlers stay
            installed after it and :meth:`close` (default False: they are put back, as
            a library should). The ``ms-train`` rank process keeps them: it ends with
            the trainer, and a signal that comes while it ends (the elastic agent's
            SIGTERM once a peer has died) must let it end on its own and report, not
            kill it.
    """

    def __init__(
        self,
        config: Config,
        *,
        engine: StepEngine | None = None,
        stream: TextIO | None = None,
        peak_flops: float | None = None,
        job_id: str | None = None,
        loader: Any = None,
        keep_signal_handlers: bool = False,
    ) -> None:
        self._keep_signal_handlers = keep_signal_handlers
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
        world = env_int("WORLD_SIZE", 1)
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
        m = config.model
        self.local_rank = env_int("LOCAL_RANK", self.rank)
        self.local_world_size = env_int("LOCAL_WORLD_SIZE", self.world_size)
        self.device = resolve_device(config.train.device, self.local_rank)
        self.autocast_dtype = resolve_precision(config.train.precision, self.device)
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
        # The mesh and this rank's place in it are the engine's: the loader, the
        # held-out eval, the loss mean, the checkpointer and the heartbeats take them
        # from engine.topology, never from the global rank.
        mesh = build_mesh(dp=self.dp, tp=p.tp) if dist.is_initialized() else None
        # Heartbeats to an ms-health driver when the launcher named one (MS_HEALTH_URL).
        self.health = _health.start_heartbeat()
        on_event = None if self.health is None else self.health.on_event
        self.engine = (
            engine if engine is not None else make_engine(p, self.device, on_event, mesh, m)
        )
        self.topology = self.engine.topology
        # Dropout's generators, by the DP rank: a replica's TP ranks draw alike (the
        # masks of the tensors they share agree; ms_train._tp_model). Weights seed by name.
        seed_rank(config.train.seed, self.topology.dp_rank, 0)
        if self.health is not None and self.topology.tp_size > 1:
            self.health.set_mesh({"dp": self.topology.dp_rank, "tp": self.topology.tp_rank})

        self.tokenizer = get_tokenizer(config.data.tokenizer)
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
        if self.topology.tp_size > 1:
            assert mesh is not None
            parallelize(
                self.model,
                mesh["tp"],
                chunks=p.tp_chunks or None,  # 0: measured per shape (a ChunkTuner)
                timeout_s=p.collective_timeout_s,
                on_event=on_event,
            )
        self.engine.setup(
            self.model, optimizer_groups(self.model, config.optim), optimizer_factory(config.optim)
        )
        self.optimizer = self.engine.optimizer
        # One part per TP rank: the DP group of the mesh holds the replicas.
        self.checkpointer = Checkpointer(
            self.checkpoint_dir, keep_last=config.checkpoint.keep_last, mesh=mesh, dp_dim="dp"
        )
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
            dp_rank=self.topology.dp_rank,
            dp_size=self.dp,
            held_out=c.data.eval_fraction,
        )
        no_torchrun = os.environ.get("TORCHELASTIC_RUN_ID") is None
        if job_id is None and no_torchrun and self.local_world_size > 1:
            job_id = self._agree(uuid.uuid4().hex)
        return NodeLoader(
            self.dataset,
            micro_batch=c.data.micro_batch,
            # TP peers read the same samples: one reader per node feeds them all.
            tp_size=self.topology.tp_size,
            dp_rank=self.topology.dp_rank,
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
            dp_rank=self.topology.dp_rank,
            dp_size=self.dp,
            device=self.device,
            group=self.topology.dp_group,
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

    def _state(self, step: int) -> dict[str, Any]:
        """What a checkpoint of ``step`` holds (and what a resume loads into)."""
        state = {
            **self.engine.state(),  # model and optim, in the engine's form
            "rng": RankRNG(),
            "step": step,
        }
        if callable(getattr(self.loader, "state_dict", None)):
            state["loader"] = self.loader
        if self.model.chunk_tuner is not None:
            state[_TP_CHUNKS] = self.model.chunk_tuner  # the resumed run's chunk counts
        return state

    def _close_loader(self) -> None:
        close = getattr(self.loader, "close", None)
        if callable(close):
            close()

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
        state = self._state(self.step)
        # Saved at another data-parallel size, the per-rank RNG states have no owner
        # here: the rest loads, and the rule of ms_train._rng seeds this rank's.
        self.step = self.checkpointer.load(
            state, fallback=True, per_rank="keep", optional=(_TP_CHUNKS,)
        )
        if not state["rng"].restored:
            seed_rank(self.config.train.seed, self.topology.dp_rank, self.step)
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

    def _loss_mean(self, loss: torch.Tensor) -> float:
        """``loss``'s mean over the data-parallel ranks (collective with several); the
        TP peers of a replica hold the same loss."""
        group = self.topology.dp_group
        with self._waiting("loss_mean"):
            if group is not None and self.topology.dp_size > 1:
                loss = loss.clone()
                dist.all_reduce(loss, group=group)
                loss /= self.topology.dp_size
            return float(loss.item())

    def train(self) -> RunSummary:
        """Resume if there is a checkpoint, train to ``train.steps``, checkpoint, report.

        When it runs in the main thread, SIGINT and SIGTERM finish the step, commit a
        checkpoint of it within ``checkpoint.grace_s`` and raise ``Stopped``; a second
        one ends the process at once (``ms_train._stop``).
        """
        c = self.config
        stop = self._take_signals()
        start = self.resume()
        total_steps = c.train.steps
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(json.dumps(c.to_dict(), indent=2) + "\n")
        self._header(start)
        records = (
            RunRecords(self.out_dir, start=start, tensorboard=c.train.tensorboard)
            if self.rank == 0
            else None
        )
        progress = report.Progress(total_steps, start=start, stream=self.stream)
        peak = self.peak() if start < total_steps else self._peak
        group = dist.group.WORLD if self.world_size > 1 else None
        self.saves = _saves.Saves(
            self.checkpointer, max_failures=c.checkpoint.max_failures, log=self._say, group=group
        )
        window = self._window(start, peak, records, progress)
        hb = self.health
        if hb is not None:
            hb.set_phase("train")
            progress.health = hb.summary
        tokens_per_rank = window.tokens_per_step / self.world_size
        for step in range(start, total_steps):
            loss, grad_norm, lr = self.train_step(step)
            self.step = done = step + 1
            if hb is not None:  # no sync: the sender converts the loss on its thread
                hb.step(done, loss=loss, tokens=tokens_per_rank)
            record = window.log(done, loss, grad_norm, lr)
            self._checkpoint(done, grad_norm)
            if self.rank == 0:
                progress.update(done, window.eta(done), record)
            with self._waiting("stop_flag"):
                stopping = stop.agreed()
            if stopping:
                progress.close()
                if records is not None:
                    records.close()
                raise self._final_save(stop, done)
        rates = window.finish()  # the final checkpoint's write is not training time
        progress.close()
        with self._phase("checkpoint"):
            # A first signal now lets this save finish (the handlers stay until it has);
            # a second abandons it.
            self.saves.finish(lambda: self._state(self.step))
        if not self._keep_signal_handlers:
            stop.restore()
        if records is not None:
            records.close()
        summary = self._summary(start, window, rates)
        # The sample's forward is collective over the TP group: the first replica's TP
        # ranks all run it, rank 0 writes it.
        # Its own phase for the driver: a sample of many tokens is no stalled step.
        with self._phase("sample"):
            sample = None
            if self.topology.dp_rank == 0 and (self.rank == 0 or self.topology.tp_size > 1):
                sample = self.sample()
            if self.rank == 0:
                summary = write_report(summary, self.out_dir, sample=lambda: sample, say=self._say)
        return summary

    def _take_signals(self) -> _stop.StopRequest:
        """SIGINT and SIGTERM handlers for :meth:`train`, and under the ``ms-train``
        launcher its stop file (``ms_train._stop``)."""
        under = launched()

        def at_once(first: int) -> None:
            _stop.stop_at_once(
                first,
                checkpointer=self.checkpointer,
                close_loader=self._close_loader,
                checkpoint_dir=self.checkpoint_dir,
                stream=self.stream if self.rank == 0 else None,
                under_launcher=under is not None,
            )

        self._stop = _stop.StopRequest(
            self.config.checkpoint.grace_s,
            at_once,
            self.world_size,
            stop_file=None if under is None else under[1] / _stop.STOP_FILE,
        ).install()
        return self._stop

    def _window(
        self,
        start: int,
        peak: Peak | None,
        records: RunRecords | None,
        progress: report.Progress,
    ) -> MetricWindow:
        """The metric window of a run from ``start``; rank 0 writes and warns."""
        c = self.config
        evaluate = None
        evaluator = self.evaluator
        if evaluator is not None:

            def evaluate() -> float:
                with self._phase("eval"):
                    return evaluator.loss(self.engine.eval_module, self._autocast)

        return MetricWindow(
            start=start,
            train=c.train,
            tokens_per_step=c.data.global_batch * c.model.seq_len,
            flops_per_token=self.flops_per_token,
            world_size=self.world_size,
            peak=peak,
            device=self.device,
            mean=self._loss_mean,
            waits=self._waits,
            evaluate=evaluate,
            cost=None if self.health is None else self.health.cost,
            write=None if records is None else records.write,
            warn=progress.note if self.rank == 0 else None,
        )

    def _checkpoint(self, done: int, grad_norm: torch.Tensor) -> None:
        """Save step ``done`` every ``checkpoint.every`` steps and at the last."""
        every = self.config.checkpoint.every
        if not ((every and done % every == 0) or done == self.config.train.steps):
            return
        # The norm is global (every rank has the same): the ranks agree to skip.
        norm = float(grad_norm.item())
        if math.isfinite(norm):
            with self._phase("checkpoint"):
                self.saves.save(done, self._state(done))
        else:
            self._say(
                f"ms-train: warning: not saving step {done}: its gradient norm is "
                f"{norm} (the model may be damaged); a resume starts from the "
                "newest committed checkpoint before it"
            )

    def _final_save(self, stop: _stop.StopRequest, done: int) -> _stop.Stopped:
        """The stop's save of step ``done`` and its account."""
        with self._phase("checkpoint"):
            return _stop.finish(
                stop,
                done,
                state=self._state,
                checkpointer=self.checkpointer,
                in_flight=self.saves.in_flight,
                checkpoint_dir=self.checkpoint_dir,
            )

    def _summary(self, start: int, window: MetricWindow, rates: RunRates) -> RunSummary:
        """What the run did, the same on every rank (rank 0 adds its files)."""
        peak = window.peak
        trained = max(0, window.total_steps - start)
        return RunSummary(
            start_step=start,
            end_step=max(start, window.total_steps),
            final_loss=window.losses[-1][1] if window.losses else math.nan,
            loss_history=window.losses,
            eval_loss=window.evals[-1][1] if window.evals else math.nan,
            eval_history=window.evals,
            tokens=trained * window.tokens_per_step,
            wall_s=rates.wall_s,
            tokens_per_s=rates.tokens_per_s,
            mfu=rates.mfu,
            data_wait=self.data_wait_fraction(),
            peak_flops=window.peak_flops,
            peak_flops_source=None if peak is None else peak.source,
            peak_flops_detail="" if peak is None else peak.detail,
            world_size=self.world_size,
            dp=self.dp,
            grad_accum=self.grad_accum,
            out_dir=str(self.out_dir),
            checkpoint_dir=self.checkpoint_dir,
            files={},
            sample=None,
            health_cost=rates.health_cost,
        )

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
            *(
                [
                    f"  tensor-parallel {self.topology.tp_size} with sequence parallelism; "
                    f"chunks {c.parallel.tp_chunks or 'measured per shape'}"
                ]
                if self.topology.tp_size > 1
                else []
            ),
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
                    "  rng: the checkpoint was saved at another data- or tensor-parallel "
                    "size; each rank's RNG is seeded from train.seed, its DP rank and the step"
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
            if self._stop is not None and not self._keep_signal_handlers:
                self._stop.restore()
            if self.health is not None:
                self.health.stop()
            self._close_loader()
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
