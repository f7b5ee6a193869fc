"""``Lamb``: the optimizer object, its state, and the order of one step.

The arithmetic lives in the implementation modules (``_single``, ``_foreach``,
``_compiled``, ``_triton_lamb``); this module owns what they share: validation,
state layout, fp32 state for low-precision parameters, gradient clipping, and
the reduction of norms per logical parameter (one all-reduce when sharded).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch.optim.optimizer import Optimizer, ParamsT

from ms_optim._bucket import Bucket, LambImpl, trust_ratios
from ms_optim._comm import all_reduce_sum
from ms_optim._hyper import HYPER_DEFAULTS, NEW_IN_FORMAT_2, GroupHyper, read_group
from ms_optim._shards import ShardMap, check_shards_across_ranks

__all__ = ["Lamb"]

Impl = Literal["auto", "foreach", "single", "compiled", "triton"]
_IMPLS = ("auto", "foreach", "single", "compiled", "triton")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# Version of the state_dict layout. 1: ms-optim 0.1.0. 2: param groups may hold the
# switches of NEW_IN_FORMAT_2 at other values and a "group_step" counter, which
# 0.1.0 would silently ignore; so 2 is written only when a group needs it.
_FORMATS = (1, 2)
_FORMAT_KEY = "ms_optim_format"


class Lamb(Optimizer):
    """LAMB, Algorithm 2 of You et al. (arXiv 1904.00962), with variant switches.

    Per step and parameter (all per-group switches; see the README's variant table)::

        g = g * max_grad_norm / max(||all grads||, max_grad_norm)   # if max_grad_norm
        g = g + weight_decay * w                                    # if not decoupled
        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2             # m = b1 m + g if
                                                                    # not grad_averaging
        r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)        # no division if
                                                                    # not bias_correction
                                                                    # or step_size_bias_correction
        u = r + weight_decay * w                                    # if decoupled
                                                                    # and decay_in_update
        w = (1 - lr * weight_decay) w                               # if not decay_in_update
        ratio = clamp(phi(||w||) / ||u||, *trust_ratio_bounds)      # 1 if a norm is 0,
        phi(z) = clamp(z, *weight_norm_bounds)                      # or no adaptation
        c = sqrt(1 - b2^t) / (1 - b1^t)                             # if step_size_bias_correction,
                                                                    # else 1
        w = w - lr * c * ratio * u

    ``t`` counts the steps in which the parameter had a gradient, or with
    ``step_count="group"`` every ``step()`` call (Apex, timm).

    ``p.grad`` is never written. Moments (and the optional master copy) are fp32
    for fp16/bf16 parameters.

    Args:
        params: tensors or param-group dicts, as for any ``torch.optim.Optimizer``;
            :func:`ms_optim.lamb_param_groups` builds the usual groups for a model.
        lr, betas, eps, weight_decay, bias_correction, decoupled_weight_decay,
        layer_adaptation, weight_norm_bounds, trust_ratio_bounds, max_grad_norm,
        grad_averaging, step_size_bias_correction, decay_in_update, step_count:
            per-group defaults (see the formula above and the README's variant
            table, which maps each peer implementation onto them).
        master_weights: keep an fp32 copy of each fp16/bf16 parameter in the state,
            update it, and round it into the parameter. Without it the update is
            computed in fp32 from the rounded parameter.
        impl: ``"auto"`` (the default: per device, ``"triton"`` on CUDA when Triton
            imports, ``"compiled"`` on CPU when a C++ compiler is found, else
            ``"foreach"``), ``"foreach"`` (multi-tensor eager ops), ``"single"``
            (a loop over tensors, for testing), ``"compiled"`` (the update fused
            by ``torch.compile``; fastest on CPU; the first step of a model with
            tensors of 65,536+ elements compiles, about 10 s for 61M parameters
            on a shared 2-core CPU, cached on disk after),
            ``"triton"`` (fused multi-tensor Triton kernels; CUDA, or CPU under
            ``TRITON_INTERPRET=1``).
        shards: ZeRO mode: for every local tensor, the logical parameter it is a
            slice of, which local tensors are replicated (held whole by every
            rank, counted once), and how many ranks hold each one (``replicas``:
            each copy counts 1/replicas). Norms of logical parameters are completed
            with one packed all-reduce per step over ``process_group`` (one more for
            the global gradient norm when clipping). Construction is then collective
            too: it checks that the ranks' slices cover each parameter exactly once.
        process_group: the group the shards are spread over: the data-parallel
            group, or the data x tensor parallel group with ``shards.replicas``;
            required with ``shards`` and meaningless without.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        decoupled_weight_decay: bool = True,
        layer_adaptation: bool = True,
        weight_norm_bounds: tuple[float, float] | None = None,
        trust_ratio_bounds: tuple[float, float] | None = None,
        max_grad_norm: float | None = None,
        grad_averaging: bool = True,
        step_size_bias_correction: bool = False,
        decay_in_update: bool = True,
        step_count: Literal["param", "group"] = "param",
        master_weights: bool = False,
        impl: Impl = "auto",
        shards: ShardMap | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool, got {master_weights!r}")
        if shards is not None and not isinstance(shards, ShardMap):
            raise TypeError(f"shards must be a ms_optim.ShardMap or None, got {type(shards)}")
        if (shards is None) != (process_group is None):
            raise ValueError(
                "shards and process_group go together: the group is the one the shards "
                f"are spread over; got shards={'set' if shards else None}, "
                f"process_group={process_group!r}"
            )
        defaults = dict(HYPER_DEFAULTS)
        defaults.update(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            decoupled_weight_decay=decoupled_weight_decay,
            layer_adaptation=layer_adaptation,
            weight_norm_bounds=weight_norm_bounds,
            trust_ratio_bounds=trust_ratio_bounds,
            max_grad_norm=max_grad_norm,
            grad_averaging=grad_averaging,
            step_size_bias_correction=step_size_bias_correction,
            decay_in_update=decay_in_update,
            step_count=step_count,
        )
        read_group(defaults)
        self.impl: Impl = impl
        self.master_weights = master_weights
        self.shards = shards
        self.process_group = process_group
        self._constructing = True
        super().__init__(params, defaults)
        self._constructing = False
        self._impl: LambImpl = _make_impl(impl)
        if shards is not None and process_group is not None:
            check_shards_across_ranks(shards, self._flat_params(), process_group)

    # -- param groups -----------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "shards", None) is not None and not self._constructing:
            raise ValueError(
                "add_param_group is not supported with shards: the ShardMap given at "
                "construction lists every local tensor; build a new Lamb instead"
            )
        where = f"param_groups[{len(self.param_groups)}]"
        read_group({**self.defaults, **param_group}, where)
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if p.is_sparse or p.is_complex() or not p.is_floating_point():
                self.param_groups.pop()
                kind = "sparse" if p.is_sparse else str(p.dtype)
                raise TypeError(
                    f"{where}['params'][{i}] must be a dense, real floating-point tensor, "
                    f"got {kind}"
                )

    def _flat_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    # -- the step ---------------------------------------------------------------------

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LAMB update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hypers = [read_group(g, f"param_groups[{i}]") for i, g in enumerate(self.param_groups)]
        # Group counters advance on every call, whether or not a gradient came (Apex, timm).
        group_steps = self._advance_group_steps(hypers)
        flat = self._flat_params()
        if not flat:
            return loss
        norm_dtype = torch.float64 if any(p.dtype == torch.float64 for p in flat) else torch.float32
        device = flat[0].device
        picked = self._with_grads(hypers)
        if not any(picked) and self.shards is None:
            return loss
        scales = self._clip_scales(hypers, picked, norm_dtype, device)

        buckets: list[_Planned] = []
        for h, entries, scale, t in zip(hypers, picked, scales, group_steps, strict=True):
            buckets.extend(self._buckets(h, entries, scale, t))

        replicated = self._replicated()
        divisors = self._divisors()
        ids: list[int] = []
        w_sq: list[torch.Tensor] = []
        u_sq: list[torch.Tensor] = []
        carries = []
        for b, index, _, _, _ in buckets:
            carry, ws, us = self._impl.moments(b)
            if b.weight_scale != 1.0:  # ||w|| after w *= 1 - lr wd, without a pass over w
                ws = ws * b.weight_scale**2
            carries.append(carry)
            ids.extend(index)
            w_sq.append(ws.to(device=device, dtype=norm_dtype))
            u_sq.append(us.to(device=device, dtype=norm_dtype))

        # Sum squares per logical parameter: [||w||^2 ..., ||u||^2 ...], one all-reduce.
        n_logical = len(flat) if self.shards is None else len(self.shards.numels)
        logical = torch.tensor(
            ids if self.shards is None else [self.shards.param_ids[i] for i in ids],
            dtype=torch.int64,
            device=device,
        )
        squares = torch.zeros(2 * n_logical, dtype=norm_dtype, device=device)
        # Replicated tensors' squares, identical on every rank: added after the
        # all-reduce, so that they count once.
        once = torch.zeros_like(squares) if replicated else None
        if ids:
            w_all, u_all = torch.cat(w_sq), torch.cat(u_sq)
            if divisors is not None:
                # A tensor that r ranks hold adds 1/r of its squares on each of them.
                r = torch.tensor([divisors[i] for i in ids], dtype=norm_dtype, device=device)
                w_all, u_all = w_all / r, u_all / r
            if once is None:
                squares.index_add_(0, logical, w_all)
                squares.index_add_(0, logical + n_logical, u_all)
            else:
                rep = torch.tensor([i in replicated for i in ids], device=device)
                for into, sel in ((squares, ~rep), (once, rep)):
                    into.index_add_(0, logical[sel], w_all[sel])
                    into.index_add_(0, logical[sel] + n_logical, u_all[sel])
        if self.process_group is not None:
            self._all_reduce(squares)
        if once is not None:
            squares += once
        norms = squares.sqrt_()

        start = 0
        for (b, index, low, scratch, step_factors), carry in zip(buckets, carries, strict=True):
            sel = logical[start : start + len(index)]
            start += len(index)
            ratios = trust_ratios(norms[sel], norms[sel + n_logical], b.hyper)
            if step_factors is not None:
                ratios = ratios * torch.tensor(step_factors, dtype=ratios.dtype, device=device)
            self._impl.apply(b, carry, ratios.to(b.weights[0].device))
            for p, w in zip(low, scratch, strict=True):
                p.copy_(w)  # round the fp32 result into the fp16/bf16 parameter
        return loss

    def _advance_group_steps(self, hypers: list[GroupHyper]) -> list[int | None]:
        """Advance and return the counter of each group with ``step_count="group"``."""
        steps: list[int | None] = []
        for gi, (h, group) in enumerate(zip(hypers, self.param_groups, strict=True)):
            if h.step_count != "group":
                steps.append(None)
                continue
            t = group.get("group_step")
            if t is None:
                # A group switched to group counting (or loaded from format 1) goes
                # on from the most steps any of its parameters has taken.
                t = max(
                    (
                        int(self.state[p]["step"].item())
                        for p in group["params"]
                        if "step" in self.state.get(p, {})
                    ),
                    default=0,
                )
            elif isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(
                    f"param_groups[{gi}]['group_step'] must be an int >= 0 (steps taken), got {t!r}"
                )
            group["group_step"] = t + 1
            steps.append(t + 1)
        return steps

    def _with_grads(self, hypers: list[GroupHyper]) -> list[list[tuple[int, torch.Tensor]]]:
        picked: list[list[tuple[int, torch.Tensor]]] = []
        index = 0
        for gi, group in enumerate(self.param_groups):
            entries = []
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is not None:
                    if g.is_sparse:
                        raise TypeError(
                            f"param_groups[{gi}]['params'][{i}].grad must be dense; "
                            "Lamb does not support sparse gradients"
                        )
                    if g.is_complex() or (g.dtype != p.dtype and not g.is_floating_point()):
                        raise TypeError(
                            f"param_groups[{gi}]['params'][{i}].grad must be a real "
                            f"floating-point tensor, got {g.dtype}"
                        )
                    entries.append((index + i, p))
            index += len(group["params"])
            picked.append(entries)
        return picked

    def _clip_scales(
        self,
        hypers: list[GroupHyper],
        picked: list[list[tuple[int, torch.Tensor]]],
        norm_dtype: torch.dtype,
        device: torch.device,
    ) -> list[torch.Tensor | None]:
        """Per group, max_grad_norm / max(global grad norm, max_grad_norm), or None."""
        if all(h.max_grad_norm is None for h in hypers):
            return [None] * len(hypers)
        # The global norm covers every gradient of the optimizer, whichever group
        # clips (NVLAMB); raw gradients, before any L2 term. Replicated tensors'
        # squares are added after the all-reduce, once; those of a tensor that r
        # ranks hold are divided by r before it, as for the trust ratios.
        replicated = self._replicated()
        divisors = self._divisors()
        by_kind: dict[tuple[bool, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
        for entries in picked:
            for i, p in entries:
                assert p.grad is not None
                grads, counts = by_kind.setdefault((i in replicated, p.grad.dtype), ([], []))
                grads.append(p.grad)
                counts.append(1 if divisors is None else divisors[i])
        total = torch.zeros((), dtype=norm_dtype, device=device)
        once = torch.zeros((), dtype=norm_dtype, device=device)
        for (is_replicated, _), (grads, counts) in by_kind.items():
            squares = torch.stack(torch._foreach_norm(grads, 2, norm_dtype)).to(device).square()
            if divisors is not None:
                squares = squares / torch.tensor(counts, dtype=norm_dtype, device=device)
            (once if is_replicated else total).add_(squares.sum())
        if self.process_group is not None:
            self._all_reduce(total.view(1))
        grad_norm = (total + once).sqrt()
        return [
            None if h.max_grad_norm is None else h.max_grad_norm / grad_norm.clamp(h.max_grad_norm)
            for h in hypers
        ]

    def _replicated(self) -> frozenset[int]:
        """Flat indices of the tensors every rank holds whole (``shards.replicated``)."""
        return frozenset() if self.shards is None else frozenset(self.shards.replicated)

    def _divisors(self) -> tuple[int, ...] | None:
        """Per flat index, by how much to divide a tensor's squares before the
        all-reduce (``shards.replicas``; 1 for replicated tensors, which are added
        after it instead); None when every one is 1."""
        if self.shards is None or not self.shards.replicas:
            return None
        replicated = set(self.shards.replicated)
        divisors = tuple(1 if i in replicated else r for i, r in enumerate(self.shards.replicas))
        return None if all(r == 1 for r in divisors) else divisors

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        assert self.process_group is not None
        if tensor.is_cuda and dist.get_backend(self.process_group) != "nccl":
            tensor.copy_(all_reduce_sum(tensor.cpu(), self.process_group))
        else:
            all_reduce_sum(tensor, self.process_group)

    def _buckets(
        self,
        h: GroupHyper,
        entries: list[tuple[int, torch.Tensor]],
        scale: torch.Tensor | None,
        group_step: int | None,
    ) -> Iterable[_Planned]:
        """Split a group's tensors by (device, compute dtype); init and advance state.

        Yields (bucket, flat indices, low-precision params, their fp32 scratch
        weights to round back after the update, per-tensor step-size bias
        corrections or None).
        """
        # Decay on the weights directly: the implementations see no decay (u has no
        # decay term) and a weight scale instead.
        on_weights = not h.decay_in_update and h.weight_decay != 0.0
        inner = replace(h, weight_decay=0.0) if on_weights else h
        weight_scale = 1.0 - h.lr * h.weight_decay if on_weights else 1.0
        in_step_size = h.bias_correction and h.step_size_bias_correction
        split: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
        for index, p in entries:
            split.setdefault((p.device, _compute_dtype(p)), []).append((index, p))
        for (_, dtype), items in split.items():
            b = Bucket(
                inner,
                [],
                [],
                [],
                [],
                [],
                [],
                None if scale is None else scale.to(dtype),
                weight_scale,
            )
            index_list: list[int] = []
            low: list[torch.Tensor] = []
            scratch: list[torch.Tensor] = []
            step_factors: list[float] = []
            for index, p in items:
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                if group_step is None:
                    state["step"] += 1
                else:
                    state["step"].fill_(group_step)
                t = int(state["step"].item())
                bc1 = 1.0 - h.beta1**t if h.bias_correction else 1.0
                bc2 = 1.0 - h.beta2**t if h.bias_correction else 1.0
                if in_step_size:
                    step_factors.append(math.sqrt(bc2) / bc1)
                    bc1 = bc2 = 1.0  # u from the raw moments
                b.bias_corrections1.append(bc1)
                b.bias_corrections2.append(bc2)
                if p.dtype == dtype:
                    w = p
                elif "master" in state:
                    w = state["master"]
                    low.append(p)
                    scratch.append(w)
                else:
                    w = p.to(dtype)
                    low.append(p)
                    scratch.append(w)
                assert p.grad is not None
                b.weights.append(w)
                b.grads.append(p.grad.to(dtype))
                b.exp_avgs.append(state["exp_avg"])
                b.exp_avg_sqs.append(state["exp_avg_sq"])
                index_list.append(index)
            yield b, index_list, low, scratch, step_factors if in_step_size else None

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        dtype = _compute_dtype(p)
        # A CPU float step, as torch's own optimizers keep it: exact to 2^24 steps.
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if self.master_weights and dtype != p.dtype:
            state["master"] = p.detach().to(dtype, copy=True)

    # -- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        needs_2 = any(
            g.get(k, v) != v or "group_step" in g
            for g in sd["param_groups"]
            for k, v in NEW_IN_FORMAT_2.items()
        )
        sd[_FORMAT_KEY] = 2 if needs_2 else 1
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; moments stay fp32 for fp16/bf16 parameters.

        (``torch.optim.Optimizer`` would cast them to the parameter's dtype.)
        Refuses state of another format, or whose tensors do not fit the parameters.
        Groups saved by ms-optim 0.1.0 (format 1) lack the switches added in 0.2.0:
        they take this optimizer's constructor values.
        """
        fmt = state_dict.get(_FORMAT_KEY, 1)
        if fmt not in _FORMATS:
            raise ValueError(
                f"state_dict[{_FORMAT_KEY!r}] must be one of {_FORMATS} (the layouts this "
                f"ms-optim reads), got {fmt!r}: it was written by another version"
            )
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"state_dict must have a {key!r} entry; keys: {list(state_dict)}")
        saved_state = state_dict["state"]
        saved_groups = [
            {**{k: self.defaults[k] for k in NEW_IN_FORMAT_2}, **g}
            for g in state_dict["param_groups"]
        ]
        for i, g in enumerate(saved_groups):
            where = f"state_dict['param_groups'][{i}]"
            read_group({**self.defaults, **g}, where)
            t = g.get("group_step", 0)
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"{where}['group_step'] must be an int >= 0, got {t!r}")
        super().load_state_dict({"state": {}, "param_groups": saved_groups})
        ids = [k for g in saved_groups for k in g["params"]]
        by_id = dict(zip(ids, self._flat_params(), strict=True))
        state: dict[Any, Any] = {}
        for key, saved in saved_state.items():
            if key not in by_id:
                raise ValueError(f"state_dict['state'] has key {key!r}, which no param group lists")
            p = by_id[key]
            state[p] = self._load_param_state(p, saved, f"state_dict['state'][{key!r}]")
        self.state.clear()
        self.state.update(state)

    def _load_param_state(self, p: torch.Tensor, saved: Any, where: str) -> dict[str, Any]:
        dtype = _compute_dtype(p)
        wants_master = self.master_weights and dtype != p.dtype
        keys = {"step", "exp_avg", "exp_avg_sq"} | ({"master"} if wants_master else set())
        if not isinstance(saved, dict) or set(saved) != keys:
            got: object = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            why = (
                " (master_weights differs between the saved optimizer and this one)"
                if isinstance(saved, dict) and "master" in set(saved) ^ keys
                else ""
            )
            raise ValueError(f"{where} must have keys {sorted(keys)}, got {got}{why}")
        out: dict[str, Any] = {"step": torch.as_tensor(saved["step"], dtype=torch.float32).cpu()}
        for k in sorted(keys - {"step"}):
            t = saved[k]
            if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                shape: object = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{where}[{k!r}] must be a tensor of the parameter's shape "
                    f"{tuple(p.shape)}, got {shape}"
                )
            out[k] = t.to(device=p.device, dtype=dtype)
        return out


# (bucket, flat indices, low-precision params, their scratch, step-size factors)
_Planned = tuple[Bucket, list[int], list[torch.Tensor], list[torch.Tensor], list[float] | None]


def _compute_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if p.dtype in _LOW_PRECISION else p.dtype


def _make_impl(impl: Impl) -> LambImpl:
    # Optional back ends import lazily: torch.compile and triton cost seconds to load.
    if impl == "auto":
        from ms_optim._auto import AutoImpl

        return AutoImpl()
    if impl == "single":
        from ms_optim._single import SingleTensorImpl

        return SingleTensorImpl()
    if impl == "compiled":
        from ms_optim._compiled import CompiledImpl

        return CompiledImpl()
    if impl == "triton":
        from ms_optim._triton_lamb import TritonImpl

        return TritonImpl()
    from ms_optim._foreach import ForeachImpl

    return ForeachImpl()
