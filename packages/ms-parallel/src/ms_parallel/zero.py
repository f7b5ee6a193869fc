"""ZeRO-2 data parallelism whose communication overlaps compute (MegaScale section 3.3).

Full parameters stay in memory on every rank; gradients are reduce-scattered and each
rank's optimizer updates only its shard of every bucket. The step's communication:

- backward: a bucket's reduce-scatter is issued the moment its last gradient is
  accumulated, in the order compute produces them, and waited at the end of backward;
- optimizer step: each rank updates its shard in place; stepped through
  :meth:`ZeroDataParallel.step`, an element-wise optimizer steps chunk by chunk and
  each chunk's all-gather is issued as soon as its shard is updated, so the first one
  hides behind the rest of the optimizer step;
- forward of the next step: the all-gather of the updated shards is deferred to the
  chunks' forward and issued in the order forward consumes them. The first chunk's is
  issued when the optimizer step ends, or when its shard is updated (by chunk), so it
  overlaps the rest of the step and data loading, with the next
  ``prefetch_chunks`` ones; chunk k's forward issues those up to chunk
  k + ``prefetch_chunks`` before it waits for its own (chained prefetch), so every
  gather after the first hides behind compute. ZeRO-2 keeps the full parameters, so
  gathering further ahead costs no memory: the default issues them all at once, and
  each still completes in the order forward needs it.

The first ``replicated_chunks`` chunks may be kept replicated instead (DeepSpeed's
persistence of small parameters): their buckets' gradients are all-reduced where a
reduce-scatter would be issued, every rank's optimizer steps them whole, and they are
never gathered. What this buys: after the optimizer step the next forward starts at
once, with the later chunks' all-gathers in flight behind it, so the step's critical
path can be DDP's (the last reduction, then the optimizer) rather than that plus the
first chunk's all-gather. What it costs: those chunks' optimizer state and update on
every rank. Their bytes on the wire stay those of a reduce-scatter and an all-gather
(an all-reduce is the two), all of them now in backward.

The replicated chunks' all-reduces are the step's last reductions (backward produces
the first chunks' gradients last), and backward ends without waiting for them. A step
by chunk updates the sharded chunks and issues their all-gathers first, while those
all-reduces are in flight, then waits for them and steps the replicated chunks: the
step's critical path is the last all-reduce and the replicated chunks' update, shorter
than DDP's (the last all-reduce and the whole model's update), and the sharded chunks'
all-gathers hide behind the replicated chunks' forward. Everything that reads
gradients through the wrapper waits for them first (the optimizer's step hooks,
:meth:`~ZeroDataParallel.shard_grads`, :meth:`~ZeroDataParallel.grad_norm`, the next
forward).

Buffers are flat and bucketed, and a parameter's ``.data`` and ``.grad`` are views into
them, so nothing is copied on the way to a collective (the layout is in ``_layout``).
Under :meth:`no_sync` backward only accumulates: nothing is communicated until the
last micro-batch of an accumulation.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from ms_parallel import _zero_state
from ms_parallel._layout import BucketLayout, plan_buckets, shard_size
from ms_parallel._wait import wait_bounded
from ms_parallel.events import EventHook

__all__ = ["ZeroDataParallel", "default_chunks"]


# torch 2.13 renamed the flat collectives (the old names warn); older torch has only those.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Bucket states across a step. FRESH: the full parameters are valid. STALE: the
# optimizer updated this rank's shard and the others are behind. GATHERING: the
# all-gather is in flight; nobody may read the buffer until it is waited.
_FRESH, _STALE, _GATHERING = "fresh", "stale", "gathering"

# torch's optimizers whose update of an element reads only that element's gradient and
# state, and that count steps per parameter: stepping them chunk by chunk, one call per
# chunk on that chunk's views, is the same update as one call on all of them.
_ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
)


class _Bucket:
    """One bucket's buffers, local views and in-flight work."""

    def __init__(
        self,
        layout: BucketLayout,
        world: int,
        rank: int,
        device: torch.device,
        grad_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        solo: bool = False,
        replicated: bool = False,
    ) -> None:
        self.layout = layout
        # Replicated: every rank holds and steps the whole bucket, as one of one rank.
        self.replicated = replicated
        if replicated:
            world, rank = 1, 0
        n_pad = layout.padded(world)
        self.shard = shard_size(layout.numel, world)
        self.lo = rank * self.shard  # this rank's part of the padded buffer
        self.data = torch.zeros(n_pad, dtype=layout.dtype, device=device)
        self.grad = torch.zeros(n_pad, dtype=grad_dtype, device=device)
        # The reduce-scatter's input when it runs in another dtype than the gradients.
        self.send: torch.Tensor | None = None
        self.reduce_dtype = reduce_dtype
        # One process (``solo``, no group), or replicated: the shard is the whole
        # bucket, the gradient buffer itself (a replicated one is all-reduced in place).
        self.grad_shard = (
            self.grad
            if (solo or replicated) and reduce_dtype == grad_dtype
            else torch.zeros(self.shard, dtype=reduce_dtype, device=device)
        )
        # The optimizer's view of this rank's gradient shard, in the parameters' dtype.
        self.opt_grad = (
            self.grad_shard
            if reduce_dtype == layout.dtype
            else torch.zeros(self.shard, dtype=layout.dtype, device=device)
        )
        self.state = _FRESH
        self.gather: dist.Work | None = None
        self.reduce: dist.Work | None = None
        # The collective that reduces this bucket's gradients.
        self.reduce_op = "all_reduce" if replicated else "reduce_scatter"
        self.ready = 0  # gradients accumulated in the current backward
        self.reduced = False  # its reduction was issued in the current window
        # (slot, lo, hi, view of data, view of opt_grad): this rank's slices.
        self.local: list[tuple[Any, int, int, torch.Tensor, torch.Tensor]] = []


class ZeroDataParallel(nn.Module):
    """Wrap ``module`` for ZeRO-2 data parallelism over ``group``.

    Args:
        module: any ``nn.Module``; its parameters are moved into flat buffers (their
            ``.data`` becomes a view), so optimizers must be built on this wrapper's
            shard views (:meth:`optimizer_param_groups`), not on the parameters.
        group: the data-parallel group: a ``ProcessGroup`` or a 1-D ``DeviceMesh``;
            ``None`` for one process without ``torch.distributed`` (nothing is
            communicated; the state has the same form, so checkpoints move between
            one process and many).
        chunks: the units gathered before their forward, in the order forward runs
            them; each a module or a list of modules. Default: :func:`default_chunks`.
        bucket_mb: the cap of a flat bucket in MiB (a larger parameter gets its own).
        reduce_dtype: the dtype gradients are reduce-scattered in, e.g.
            ``torch.float32`` for bf16 parameters; default: the parameters' dtype.
            Another dtype than the parameters' also accumulates micro-batches in it.
        prefetch: gather ahead of compute (default); ``False`` waits each chunk's
            all-gather right after issuing it before its forward, and each
            reduce-scatter right after issuing it (the serialized baseline).
        prefetch_chunks: how many chunks ahead of the one about to compute are
            gathered; ``None`` (default): all, issued as the optimizer step ends (or,
            through :meth:`step` by chunk, each as its chunk's shard is updated); ``1``:
            the paper's chain, where chunk k + 1's is issued as chunk k starts. With an
            injected latency about one chunk's forward, 1 leaves each chunk's wait to
            jitter (see the README's measurements).
        timeout_s: every wait on a collective is bounded by this; a peer that stops
            participating raises :class:`ms_parallel.CollectiveTimeout`.
        on_event: ``on_event(name, kind, t, **attrs)`` called at each collective's
            issue and wait, each chunk's forward, and each chunk's part of a by-chunk
            optimizer step (name ``"optimizer"``; ``ms_parallel.events``).
        broadcast_from: the group rank whose initial parameters every rank starts from.
        replicated_chunks: how many chunks, from the first in forward order, are kept
            replicated instead of sharded (chunk 0 is the chunk of the parameters
            outside every chunk where the module has some; the ``chunk`` of the
            events counts the same way). Their buckets' gradients are all-reduced
            instead of reduce-scattered, the optimizer steps them whole on every rank
            and they are never all-gathered, so no all-gather stands between the
            optimizer step and the first chunk's forward. Their all-reduces are left
            in flight when backward ends (see the module's docstring): read their
            gradients through :meth:`shard_grads`, or after :meth:`shard_grads` has
            returned, not from a parameter's ``.grad`` right after backward. Default
            0: all sharded.
        state_mesh: with tensor parallelism, the 2-D ``("dp", "tp")`` mesh (``mesh["dp",
            "tp"]`` of ``build_mesh``) whose ``dp`` dimension is ``group``: the
            optimizer state's DTensors are placed on it, each parameter's along ``tp``
            as its ``ms_parallel.tensor_parallel`` spec says, so that the state reshards
            across TP sizes. Default: the DP mesh alone.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | DeviceMesh | None,
        *,
        chunks: Sequence[nn.Module | Sequence[nn.Module]] | None = None,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        prefetch: bool = True,
        prefetch_chunks: int | None = None,
        timeout_s: float = 600.0,
        on_event: EventHook | None = None,
        broadcast_from: int = 0,
        replicated_chunks: int = 0,
        state_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        self.mesh, self.group = _resolve_group(group)
        self.state_mesh = _check_state_mesh(state_mesh, self.group)
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        if reduce_dtype is not None and not isinstance(reduce_dtype, torch.dtype):
            raise TypeError(f"reduce_dtype must be a torch.dtype or None, got {reduce_dtype!r}")
        self.module = module
        self.world = 1 if self.group is None else dist.get_world_size(self.group)
        self.rank = 0 if self.group is None else dist.get_rank(self.group)
        if not 0 <= broadcast_from < self.world:
            raise ValueError(
                f"broadcast_from must be a rank in [0, {self.world}), got {broadcast_from!r}"
            )
        self.prefetch = bool(prefetch)
        if prefetch_chunks is not None and (
            isinstance(prefetch_chunks, bool)
            or not isinstance(prefetch_chunks, int)
            or prefetch_chunks < 1
        ):
            raise ValueError(
                f"prefetch_chunks must be an int >= 1 or None, got {prefetch_chunks!r}"
            )
        self.prefetch_chunks = prefetch_chunks
        self.timeout_s = float(timeout_s)
        self.on_event = on_event
        self._named = _unique_named_parameters(module)
        self._chunks = _resolve_chunks(module, chunks, self._named)
        if (
            isinstance(replicated_chunks, bool)
            or not isinstance(replicated_chunks, int)
            or not 0 <= replicated_chunks <= len(self._chunks)
        ):
            raise ValueError(
                f"replicated_chunks must be an int in [0, {len(self._chunks)}] (this "
                f"module has {len(self._chunks)} chunks), got {replicated_chunks!r}"
            )
        self.replicated_chunks = replicated_chunks
        layouts = plan_buckets(
            self._chunks, self._named, bucket_bytes=max(1, int(bucket_mb * 2**20))
        )
        params = [p for _, p in self._named]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"module's parameters must be on one device, found {devices}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.buckets = [
            _Bucket(
                lay,
                self.world,
                self.rank,
                self.device,
                grad_dtype=reduce_dtype or lay.dtype,
                reduce_dtype=reduce_dtype or lay.dtype,
                solo=self.group is None,
                replicated=lay.chunk < replicated_chunks,
            )
            for lay in layouts
        ]
        self._by_chunk: list[list[_Bucket]] = [[] for _ in self._chunks]
        for b in self.buckets:
            self._by_chunk[b.layout.chunk].append(b)
        self._params = params
        self._leftovers = bool(self._chunks) and isinstance(self._chunks[0][0], _Leftovers)
        self._bucket_of: dict[int, tuple[_Bucket, int, int]] = {}
        with torch.no_grad():
            for b in self.buckets:
                for s in b.layout.slots:
                    p = params[s.index]
                    view = b.data[s.offset : s.offset + s.numel].view(s.shape)
                    view.copy_(p.detach())
                    # Point the parameter at its bucket now, so that its old storage
                    # is freed before the next one is copied (no second model at peak).
                    p.data = view
                    self._bucket_of[id(p)] = (b, s.offset, s.numel)
            if self.group is not None:  # every rank starts from the same weights, as DDP does
                src = dist.get_global_rank(self.group, broadcast_from)
                for b in self.buckets:
                    dist.broadcast(b.data, src=src, group=self.group)
            for b in self.buckets:
                rank, world = (0, 1) if b.replicated else (self.rank, self.world)
                for s, lo, hi in b.layout.overlaps(rank, world):
                    a, z = s.offset + lo - b.lo, s.offset + hi - b.lo
                    view = b.data[b.lo + a : b.lo + z]
                    b.local.append((s, lo, hi, view, b.opt_grad[a:z]))
        # id() of every shard view an optimizer may hold (fixed once built).
        self._view_ids = frozenset(id(v) for b in self.buckets for *_, v, _ in b.local)
        self._sync = True  # False inside no_sync(): backward only accumulates
        self._window_open = False  # gradients accumulated since the last reduction
        self._backward_queued = False
        self._synced_since_step = False
        self._bare_step = False  # an optimizer step that only creates the state
        self._stepping: list[int] | None = None  # the chunks a by-chunk step() is on
        self._optimizers: list[RemovableHandle] = []
        self._attached: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._handles: list[RemovableHandle] = []
        # torch keeps a post-accumulate-grad hook where the garbage collector cannot see
        # it, so a hook holding the wrapper (which holds the parameter) would be a cycle
        # never collected: a dropped wrapper would keep its model and buffers alive.
        # The hooks hold it weakly.
        grad_ready = _weak_method(self._grad_ready)
        for p in params:
            if p.requires_grad:
                self._handles.append(
                    p.register_post_accumulate_grad_hook(grad_ready)  # type: ignore[no-untyped-call]
                )
        for k, modules in enumerate(self._chunks):
            if k == 0 and self._leftovers:
                continue
            for j, m in enumerate(modules):
                self._handles.append(m.register_forward_pre_hook(self._pre_forward(k, j)))
                if j == len(modules) - 1:
                    self._handles.append(m.register_forward_hook(self._post_forward(k)))

    # -- public surface ------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and not self._window_open:
            self._open_window()
        if self._chunks:
            self._issue_gather(0)
            if self._leftovers:  # no module of its own runs: the root's forward is its
                self._pre_forward(0, 0)(self, args)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients; the first backward
        outside reduces everything accumulated (DDP's ``no_sync``)."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def optimizer_param_groups(
        self, param_groups: Sequence[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """``param_groups`` (dicts whose ``"params"`` are the module's parameters; default:
        one group of all) with each parameter replaced by this rank's 1-D shard view of
        it (a parameter of a replicated chunk: a 1-D view of the whole of it, on every
        rank). Parameters of which this rank holds nothing are left out of its groups.
        Build the optimizer on the result and pass it to :meth:`attach_optimizer`."""
        if param_groups is None:
            param_groups = [{"params": [p for p in self._params if p.requires_grad]}]
        local = self._local_views()
        out, seen = [], set()
        for i, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError(f"param_groups[{i}] must be a dict with 'params', got {g!r}")
            views = []
            for p in g["params"]:
                if id(p) not in self._bucket_of:
                    raise ValueError(
                        f"param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that is "
                        "not a trainable parameter of the wrapped module"
                    )
                if id(p) in seen:
                    raise ValueError(f"param_groups[{i}] repeats a parameter of another group")
                seen.add(id(p))
                views.extend(local.get(id(p), []))
            out.append({**g, "params": views})
        missing = [n for n, p in self._named if p.requires_grad and id(p) not in seen]
        if missing:
            raise ValueError(
                f"param_groups must hold every trainable parameter; missing {missing[:3]}"
            )
        return out

    def group_param_ids(self, param_groups: Sequence[dict[str, Any]]) -> tuple[int, ...]:
        """For each shard view in ``param_groups`` (from :meth:`optimizer_param_groups`, or
        an optimizer's ``param_groups``), group after group, the index of the logical
        parameter it is a slice of (see :attr:`param_numels`): what a ZeRO-aware
        optimizer such as ms-optim's LAMB needs to complete its per-parameter norms."""
        slice_of = {id(v): s.index for b in self.buckets for s, _, _, v, _ in b.local}
        out = []
        for i, g in enumerate(param_groups):
            for t in g["params"]:
                if id(t) not in slice_of:
                    raise ValueError(
                        f"param_groups[{i}] holds a tensor that is not one of this wrapper's "
                        "shard views (use optimizer_param_groups)"
                    )
                out.append(slice_of[id(t)])
        return tuple(out)

    def group_replicated(self, param_groups: Sequence[dict[str, Any]]) -> tuple[int, ...]:
        """Positions, in :meth:`group_param_ids`'s order, of the views in ``param_groups``
        that are whole parameters of a replicated chunk: every rank holds and steps them
        in full, so a norm over the group must count them once (ms-optim's
        ``ShardMap.replicated``)."""
        whole = {id(v) for b in self.buckets if b.replicated for *_, v, _ in b.local}
        self.group_param_ids(param_groups)  # the same refusal of foreign tensors
        flat = [t for g in param_groups for t in g["params"]]
        return tuple(i for i, t in enumerate(flat) if id(t) in whole)

    @property
    def param_numels(self) -> tuple[int, ...]:
        """Element count of every parameter, in ``named_parameters()`` order."""
        return tuple(p.numel() for p in self._params)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self._named)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Hook ``optimizer`` so its step happens on reduced gradients and is followed by
        the deferred all-gather. Returns it. One optimizer steps a step's gradients
        (a second step before the next backward is refused), so attach one that holds
        every shard view."""
        for g in optimizer.param_groups:
            for t in g["params"]:
                if id(t) not in self._view_ids:
                    raise ValueError(
                        "optimizer holds a tensor that is not one of this "
                        "wrapper's shard views (build it on optimizer_param_groups)"
                    )
        self._attached.add(optimizer)
        self._optimizers.append(optimizer.register_step_pre_hook(self._before_step))
        self._optimizers.append(optimizer.register_step_post_hook(self._after_step))
        return optimizer

    def step(self, optimizer: torch.optim.Optimizer, *, by_chunk: bool | None = None) -> None:
        """Step ``optimizer`` (attached with :meth:`attach_optimizer`) on the reduced
        gradients, and issue the next step's all-gathers.

        ``by_chunk=True`` steps it chunk by chunk, in forward order, each call seeing
        only that chunk's shard views (the others' ``.grad`` set to ``None`` meanwhile),
        and issues each chunk's all-gather as soon as its shard is updated: the next
        step's first all-gather then hides behind the rest of the optimizer step instead
        of standing between the step and the first forward. With ``prefetch_chunks=p``
        the chunks after the first ``p + 1`` (whose gathers wait for forward anyway)
        are stepped in one last call. It is the same update only for an optimizer whose
        update of an element reads nothing but that element's gradient and state, and
        that counts steps per parameter; its step hooks run once per call. ``None``
        (default): by chunk for torch's element-wise optimizers (SGD, Adam, AdamW,
        Adagrad, Adamax, NAdam, RAdam, RMSprop, Adadelta; their exact classes), one
        ``optimizer.step()`` for any other (ms-optim's LAMB computes whole-parameter
        norms with one all-reduce per step). ``False``: one call, as
        ``optimizer.step()`` does. One process (no group: nothing to gather) and one
        chunk always take one call.

        The calls go sharded chunks first, in forward order, then every replicated
        chunk in one last call, after their all-reduces (still in flight when backward
        ended) are waited: the sharded chunks' updates and all-gathers overlap them."""
        if optimizer not in self._attached:
            raise ValueError(
                "optimizer must be attached to this wrapper first (attach_optimizer), "
                f"got an unattached {type(optimizer).__name__}"
            )
        mine = {id(t) for g in optimizer.param_groups for t in g["params"]}
        if not mine <= self._view_ids:
            raise ValueError(
                "optimizer holds a tensor that is not one of this wrapper's shard views "
                "(a param group added after attach_optimizer?)"
            )
        if by_chunk is None:
            by_chunk = type(optimizer) in _ELEMENTWISE_OPTIMIZERS
        n = len(self._chunks)
        if not by_chunk or self.group is None or n < 2 or self._bare_step:
            optimizer.step()
            return
        if not self._synced_since_step:  # the refusal a plain step gives
            self._before_step(optimizer, (), {})
        parts = self._step_parts()
        part_views = [
            [v for k in part for b in self._by_chunk[k] for *_, v, _ in b.local if id(v) in mine]
            for part in parts
        ]
        grads = {id(v): v.grad for vs in part_views for v in vs}
        try:
            for i, part in enumerate(parts):
                for j, vs in enumerate(part_views):
                    for v in vs:
                        v.grad = grads[id(v)] if j == i else None
                self._stepping = part
                optimizer.step()  # its hooks emit the part's events and issue its gathers
            self._synced_since_step = False  # every chunk stepped: the next needs backward
        except BaseException:
            # Some chunks stepped, others not: a second try would step the first twice.
            # The part that failed may be partly updated: gather it as it is, so that
            # the ranks at least agree (the optimizer state may not).
            for k in self._stepping or []:
                for b in self._by_chunk[k]:
                    if not b.replicated and b.state == _FRESH:
                        b.state = _STALE
            self._synced_since_step = False
            raise
        finally:
            self._stepping = None
            for vs in part_views:
                for v in vs:
                    v.grad = grads[id(v)]

    def _step_parts(self) -> list[list[int]]:
        """The chunks of each optimizer call of a by-chunk step, in call order.

        Sharded chunks first, in forward order, each on its own where its all-gather
        goes out at once (all of them; with ``prefetch_chunks=p`` those up to chunk
        ``p``, the rest in one call); then every replicated chunk in one call, since they
        have nothing to gather. Replicated chunks come last because their all-reduces
        are the step's last reductions (the first chunks' gradients are the last ones
        backward produces), still in flight when backward ends: the sharded chunks'
        updates and all-gathers run meanwhile, and their gathers hide behind the
        replicated chunks' forward."""
        n, p, r = len(self._chunks), self.prefetch_chunks, self.replicated_chunks
        alone = [k for k in range(r, n) if p is None or k <= p]
        rest = [k for k in range(r, n) if p is not None and k > p]
        return [[k] for k in alone] + [part for part in (rest, list(range(r))) if part]

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradients, one per bucket: its shard of a sharded bucket,
        the whole of a replicated one (the same on every rank). Waits for reductions
        still in flight (a replicated chunk's all-reduce may be, after backward)."""
        for b in self.buckets:
            self._wait_reduce(b)
        return [self._shard_grad(b) for b in self.buckets]

    def local_shards(self) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor, bool]]:
        """For each of this rank's shard views, in bucket order: the parameter it is a
        slice of, the view of its data, the view of its reduced gradient (what the
        optimizer reads) and whether its chunk is replicated (whole on every rank).
        Waits for reductions still in flight. What an engine composing ZeRO with tensor
        parallelism needs to sum partial gradients over another group and to weight a
        norm by how many ranks hold each element."""
        for b in self.buckets:
            self._wait_reduce(b)
        return [
            (self._params[s.index], view, grad, b.replicated)
            for b in self.buckets
            for s, _, _, view, grad in b.local
        ]

    @staticmethod
    def _shard_grad(b: _Bucket) -> torch.Tensor:
        return b.opt_grad[: max(0, min(b.shard, b.layout.numel - b.lo))]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the reduced gradients to a global norm of ``max_norm`` over the group,
        each element counted once; returns the norm before clipping."""
        norm = self.grad_norm()
        if max_norm < float("inf"):
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in self.shard_grads():
                g.mul_(scale.to(g.dtype))
        return norm

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the reduced gradients, each element counted once
        (collective over the group, bounded by ``timeout_s``). The sharded buckets'
        all-reduce of squares goes out before the replicated buckets' all-reduces are
        waited, so the two overlap."""
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for b in self.buckets:
            if not b.replicated:
                self._wait_reduce(b)
                sq.add_(self._shard_grad(b).float().pow(2).sum())
        work = None
        if self.group is not None:  # issued before the replicated all-reduces are waited
            work = dist.all_reduce(sq, group=self.group, async_op=True)
        # Replicated buckets are whole and equal on every rank: added after the
        # all-reduce, once, not once per rank.
        once = torch.zeros((), dtype=torch.float32, device=self.device)
        for b in self.buckets:
            if b.replicated:
                self._wait_reduce(b)
                once.add_(self._shard_grad(b).float().pow(2).sum())
        if work is not None:
            wait_bounded(
                work,
                op="all_reduce",
                group=self._comm_group(),
                where="gradient norm",
                timeout_s=self.timeout_s,
            )
        return (sq + once).sqrt()

    def device_mesh(self) -> DeviceMesh:
        """The 1-D data-parallel ``DeviceMesh``."""
        if self.group is None:
            raise RuntimeError("a ZeroDataParallel without a process group has no mesh")
        if self.mesh is None:
            self.mesh = DeviceMesh.from_group(self.group, self.device.type)
        return self.mesh

    def state_device_mesh(self) -> DeviceMesh:
        """The mesh the optimizer state's DTensors are placed on: ``state_mesh`` when
        given, else :meth:`device_mesh`."""
        return self.state_mesh if self.state_mesh is not None else self.device_mesh()

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state keyed by parameter name, every per-element entry a
        ``DTensor`` of the parameter's unsplit shape on :meth:`state_device_mesh`,
        loadable at any DP or TP size, bucket size and ``replicated_chunks``
        (``ms_parallel._zero_state``). Collective over the group. Before the first
        step the state is created as a step with zero gradients and learning rate 0
        would (what ``torch.distributed.checkpoint`` does), so that a checkpointer
        has every entry to load into."""
        if not any(optimizer.state.get(v) for b in self.buckets for *_, v, _ in b.local):
            self._init_optimizer_state(optimizer)
        return _zero_state.optimizer_state_dict(self, optimizer)

    def load_optimizer_state_dict(
        self,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        upgrade: _zero_state.StateUpgrade | None = None,
    ) -> None:
        """Load what :meth:`optimizer_state_dict` gave, saved at any DP or TP size, or
        0.3's per-bucket form (``upgrade`` renames its parameters where the model's
        names changed since)."""
        _zero_state.load_optimizer_state_dict(self, optimizer, state, upgrade)

    def _init_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        lrs = [g["lr"] for g in optimizer.param_groups]
        views = [v for b in self.buckets for *_, v, _ in b.local]
        grads = [v.grad for v in views]
        before = [v.clone() for v in views]
        self._bare_step = True
        try:
            for g in optimizer.param_groups:
                g["lr"] = 0.0
            for v in views:
                v.grad = torch.zeros_like(v)
            optimizer.step()
        finally:
            self._bare_step = False
            for g, lr in zip(optimizer.param_groups, lrs, strict=True):
                g["lr"] = lr
            with torch.no_grad():
                for v, old, grad in zip(views, before, grads, strict=True):
                    v.copy_(old)  # lr 0 changes nothing, but be exact
                    v.grad = grad

    def gather_params(self) -> None:
        """Make the full parameters valid now (blocking): before a checkpoint of the
        model, or an evaluation outside forward hooks."""
        for k in range(len(self._chunks)):
            self._issue_gather(k)
        for k in range(len(self._chunks)):
            self._wait_gather(k)

    # -- hooks ---------------------------------------------------------------------

    def _pre_forward(self, k: int, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if j == 0:
                self._issue_ahead(k)
            self._wait_gather(k)
            if j == 0:
                self._emit("chunk", "compute_begin", chunk=k)

        return hook

    def _post_forward(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._emit("chunk", "compute_end", chunk=k)

        return hook

    def _open_window(self) -> None:
        """Start accumulating a step's gradients: zero the buffers and point every
        parameter's ``.grad`` at them (a user's ``zero_grad(set_to_none=True)`` on the
        module dropped the views)."""
        for b in self.buckets:
            # Never reuse a buffer before its collective's wait: a replicated bucket's
            # all-reduce is still in flight when no optimizer stepped since backward.
            self._wait_reduce(b)
            b.grad.zero_()
            b.ready = 0
            b.reduced = False
            if b.grad.dtype == b.layout.dtype:
                for s in b.layout.slots:
                    self._params[s.index].grad = b.grad[s.offset : s.offset + s.numel].view(s.shape)
            else:
                for s in b.layout.slots:
                    self._params[s.index].grad = None
        self._window_open = True
        self._synced_since_step = False

    def _grad_ready(self, p: torch.Tensor) -> None:
        b, offset, n = self._bucket_of[id(p)]
        flat = b.grad[offset : offset + n]
        if b.grad.dtype != b.layout.dtype:
            flat.add_(p.grad.reshape(-1))  # type: ignore[union-attr]
            p.grad = None
        elif p.grad is None or p.grad.data_ptr() != flat.data_ptr():
            # The view was replaced (e.g. grad set to None mid-window): fold it back in.
            if p.grad is not None:
                flat.add_(p.grad.reshape(-1))
            p.grad = flat.view(p.shape)
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if not self._sync:
            return
        b.ready += 1
        if b.ready == len(b.layout.slots):
            self._issue_reduce(b)

    def _end_backward(self) -> None:
        self._backward_queued = False
        if not self._sync:
            return
        # Buckets with a parameter that got no gradient (unused in this step) go now.
        for b in reversed(self.buckets):
            if not b.reduced:
                self._issue_reduce(b)
        # A replicated bucket's all-reduce is left in flight: whatever reads its
        # gradients first waits for it (the optimizer's step hook, shard_grads,
        # grad_norm, the next forward), so that a by-chunk step updates the sharded
        # chunks and issues their gathers meanwhile.
        for b in self.buckets:
            if not b.replicated:
                self._wait_reduce(b)
        self._window_open = False
        self._synced_since_step = True
        for b in self.buckets:
            for *_, view, grad in b.local:
                view.grad = grad

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._bare_step:
            return
        if not self._synced_since_step:
            raise RuntimeError(
                "optimizer.step() before the gradients were reduced: run the last "
                "micro-batch's backward outside no_sync() first"
            )
        part = self._stepping
        for b in self.buckets if part is None else self._buckets_of(part):
            self._wait_reduce(b)  # a replicated bucket's all-reduce may be in flight
            if b.state == _GATHERING:  # the optimizer writes into the gathered buffer
                self._wait_bucket_gather(b)
        for k in part or []:
            self._emit("optimizer", "compute_begin", chunk=k)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._bare_step:
            return
        part = self._stepping
        for b in self.buckets if part is None else self._buckets_of(part):
            if not b.replicated:  # every rank stepped a replicated bucket whole
                b.state = _STALE
        if part is not None:  # step(by_chunk=True): these chunks' shards are final
            for k in part:
                self._emit("optimizer", "compute_end", chunk=k)
            for k in part:
                if self.prefetch_chunks is None or k <= self.prefetch_chunks:
                    self._issue_gather(k)  # the later chunks' steps hide it
            return
        self._synced_since_step = False
        if self._chunks:
            self._issue_gather(0)  # the next step's first gather overlaps data loading
            self._issue_ahead(0)

    def _buckets_of(self, chunks: list[int]) -> list[_Bucket]:
        return [b for k in chunks for b in self._by_chunk[k]]

    # -- collectives ---------------------------------------------------------------

    def _issue_gather(self, k: int) -> None:
        for b in self._by_chunk[k]:
            if b.state != _STALE:
                continue
            if self.group is None:  # one process: its buffer is the whole bucket
                b.state = _FRESH
                continue
            part = b.data[b.lo : b.lo + b.shard]
            self._emit("all_gather", "issue", chunk=k, bucket=b.layout.index)
            b.gather = _all_gather(b.data, part, group=self.group, async_op=True)
            b.state = _GATHERING
            if not self.prefetch:
                self._wait_bucket_gather(b)

    def _issue_ahead(self, k: int) -> None:
        """Issue the gathers of the chunks after ``k`` that prefetching covers."""
        if not self.prefetch:
            return
        n = len(self._chunks)
        last = n - 1 if self.prefetch_chunks is None else min(n - 1, k + self.prefetch_chunks)
        for j in range(k + 1, last + 1):
            self._issue_gather(j)

    def _wait_gather(self, k: int) -> None:
        for b in self._by_chunk[k]:
            if b.state == _STALE:
                self._issue_gather(k)
            if b.state == _GATHERING:
                self._wait_bucket_gather(b)

    def _wait_bucket_gather(self, b: _Bucket) -> None:
        assert b.gather is not None
        self._wait(b.gather, "all_gather", b)
        b.gather = None
        b.state = _FRESH

    def _issue_reduce(self, b: _Bucket) -> None:
        if b.replicated:  # all-reduced in place, in the reduce dtype
            if b.grad_shard is not b.grad:
                b.grad_shard.copy_(b.grad)
            send = b.grad_shard
        elif b.grad.dtype != b.reduce_dtype:
            if b.send is None:
                b.send = torch.empty_like(b.grad, dtype=b.reduce_dtype)
            b.send.copy_(b.grad)
            send = b.send
        else:
            send = b.grad
        if self.world > 1:
            send.div_(self.world)  # the mean over ranks; gloo has no AVG
        b.reduced = True
        if self.group is None:
            if b.grad_shard is not send:
                b.grad_shard.copy_(send)
            if b.opt_grad is not b.grad_shard:
                b.opt_grad.copy_(b.grad_shard)
            return
        self._emit(b.reduce_op, "issue", chunk=b.layout.chunk, bucket=b.layout.index)
        if b.replicated:
            b.reduce = dist.all_reduce(send, group=self.group, async_op=True)
        else:
            b.reduce = _reduce_scatter(b.grad_shard, send, group=self.group, async_op=True)
        if not self.prefetch:
            self._wait_reduce(b)

    def _wait_reduce(self, b: _Bucket) -> None:
        if b.reduce is None:
            return
        self._wait(b.reduce, b.reduce_op, b)
        b.reduce = None
        if b.opt_grad is not b.grad_shard:
            b.opt_grad.copy_(b.grad_shard)

    def _wait(self, work: dist.Work, op: str, b: _Bucket) -> None:
        """Wait for bucket ``b``'s collective ``op``, bounded, with its events."""
        chunk, bucket = b.layout.chunk, b.layout.index
        self._emit(op, "wait_begin", chunk=chunk, bucket=bucket)
        wait_bounded(
            work,
            op=op,
            group=self._comm_group(),
            where=f"chunk {chunk}, bucket {bucket}",
            timeout_s=self.timeout_s,
        )
        self._emit(op, "wait_end", chunk=chunk, bucket=bucket)

    def _comm_group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError("internal: a collective without a process group")
        return self.group

    def _emit(self, name: str, kind: str, **attrs: Any) -> None:
        if self.on_event is not None:
            self.on_event(name, kind, time.perf_counter(), rank=self.rank, **attrs)

    def _local_views(self) -> dict[int, list[torch.Tensor]]:
        out: dict[int, list[torch.Tensor]] = {}
        for b in self.buckets:
            for s, _, _, view, _ in b.local:
                out.setdefault(id(self._params[s.index]), []).append(view)
        return out


def _weak_method(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``method`` called through a weak reference to its object; a no-op once the
    object is gone."""
    ref = weakref.WeakMethod(method)

    def call(arg: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(arg)

    return call


def default_chunks(module: nn.Module) -> list[list[nn.Module]]:
    """The top-level blocks of ``module``: each entry of a ``ModuleList`` or
    ``Sequential`` child is a chunk; the other children before the first such list
    form one chunk, and those after it another (with the module's own parameters in
    the first). Small embeddings and heads are so gathered with one collective."""
    lists = [c for c in module.children() if isinstance(c, (nn.ModuleList, nn.Sequential))]
    if not lists:
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        return [[c] for c in children]
    before: list[nn.Module] = []
    after: list[nn.Module] = []
    blocks: list[list[nn.Module]] = []
    seen_list = False
    for c in module.children():
        if isinstance(c, (nn.ModuleList, nn.Sequential)):
            seen_list = True
            blocks.extend([m] for m in c)
        elif any(True for _ in c.parameters()):
            (after if seen_list else before).append(c)
    out = ([before] if before else []) + blocks + ([after] if after else [])
    return out


def _resolve_chunks(
    module: nn.Module,
    chunks: Sequence[nn.Module | Sequence[nn.Module]] | None,
    named: Sequence[tuple[str, nn.Parameter]],
) -> list[list[nn.Module]]:
    if chunks is None:
        resolved = default_chunks(module)
    else:
        resolved = []
        for i, c in enumerate(chunks):
            if isinstance(c, nn.Module):
                resolved.append([c])
            elif isinstance(c, Sequence) and all(isinstance(m, nn.Module) for m in c) and c:
                resolved.append(list(c))
            else:
                raise TypeError(
                    f"chunks[{i}] must be a module or a non-empty list of modules, got {c!r}"
                )
    # Parameters of no chunk (the module's own, or of children outside every chunk) are
    # gathered first, with the root's forward.
    inside = {id(p) for ms in resolved for m in ms for p in m.parameters()}
    rest = [p for _, p in named if p.requires_grad and id(p) not in inside]
    if rest:
        resolved.insert(0, [_Leftovers(rest)])
    return resolved


class _Leftovers(nn.Module):
    """Stands for the parameters outside every chunk, so the planner can see them; its
    forward hooks run from the wrapper's forward."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self._held = params

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return iter(self._held)


def _unique_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters())  # shared parameters appear once


def _check_state_mesh(
    mesh: DeviceMesh | None, group: dist.ProcessGroup | None
) -> DeviceMesh | None:
    if mesh is None:
        return None
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names != ("dp", "tp"):
        got = mesh.mesh_dim_names if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise ValueError(f"state_mesh must be a DeviceMesh with dims ('dp', 'tp'), got {got}")
    if group is None or dist.get_process_group_ranks(mesh["dp"].get_group()) != (
        dist.get_process_group_ranks(group)
    ):
        raise ValueError("state_mesh['dp'] must be the data-parallel group ZeRO shards over")
    return mesh


def _resolve_group(
    group: dist.ProcessGroup | DeviceMesh | None,
) -> tuple[DeviceMesh | None, dist.ProcessGroup | None]:
    if group is None:
        return None, None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ZeroDataParallel needs torch.distributed to be initialized "
            "(dist.init_process_group or torchrun)"
        )
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group must be a 1-D DeviceMesh (e.g. mesh['dp']), got a "
                f"{group.ndim}-D mesh with dims {group.mesh_dim_names}"
            )
        return group, group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return None, group
    raise TypeError(f"group must be a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")
