"""The latency backend's registration and configuration, in this process (no group made).

Registration is process-wide (c10d's backend table), so every test uses its own name.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch.distributed as dist

from ms_parallel.events import EventLog
from ms_parallel.latency import OP_TYPES, LatencyBackend, register_latency_backend

_names = itertools.count()


def fresh_name() -> str:
    return f"mstest_latency_{next(_names)}"


def test_register_returns_a_handle_with_every_op_type() -> None:
    name = fresh_name()
    net = register_latency_backend(name, latency=0.25)
    assert isinstance(net, LatencyBackend)
    assert net.name == name and net.inner == "gloo"
    assert net.latencies() == dict.fromkeys(OP_TYPES, 0.25)
    assert name in dist.Backend.backend_list
    # gloo stays the default CPU backend: registering changes nothing for other users
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"


def test_per_op_latencies_fall_back_to_default() -> None:
    net = register_latency_backend(fresh_name(), latency={"all_gather": 0.5, "default": 0.1})
    assert net.latency("all_gather") == 0.5
    assert net.latency("p2p") == 0.1
    for op in ("reduce", "gather", "scatter"):  # no key of their own
        assert net.latency(op) == 0.1
    net.set_latency(default=0.2, p2p=0)
    assert net.latency("p2p") == 0.0 and net.latency("barrier") == 0.2
    assert net.latency("all_gather") == 0.5
    net.set_latency({"broadcast": 1})
    assert net.latency("broadcast") == 1.0 and isinstance(net.latency("broadcast"), float)
    net.set_latency(0.03)  # a number: one latency for every op type again
    assert net.latencies() == dict.fromkeys(OP_TYPES, 0.03)


def test_unknown_op_type_lists_the_valid_ones() -> None:
    net = register_latency_backend(fresh_name())
    with pytest.raises(ValueError, match="latency op type must be one of all_reduce, all_gather"):
        net.set_latency(allreduce=0.1)
    with pytest.raises(ValueError, match="p2p, barrier, default, got 'send'"):
        register_latency_backend(fresh_name(), latency={"send": 0.1})
    with pytest.raises(ValueError, match=r"op must be one of .*scatter, got 'bogus'"):
        net.latency("bogus")


@pytest.mark.parametrize("bad", [-0.001, math.nan, math.inf, -math.inf])
def test_latency_must_be_finite_and_non_negative(bad: float) -> None:
    net = register_latency_backend(fresh_name(), latency=0.5)
    with pytest.raises(ValueError, match=r"latency\['barrier'\] must be a finite number >= 0"):
        net.set_latency(barrier=bad)
    assert net.latency("barrier") == 0.5  # a refused update changes nothing


@pytest.mark.parametrize("bad", [True, "0.1", None, [0.1]])
def test_latency_must_be_a_number(bad: object) -> None:
    net = register_latency_backend(fresh_name())
    with pytest.raises(TypeError, match=r"latency\['default'\] must be a number of seconds"):
        net.set_latency({"default": bad})  # type: ignore[dict-item]


def test_a_refused_update_is_all_or_nothing() -> None:
    net = register_latency_backend(fresh_name(), latency=0.5)
    with pytest.raises(ValueError, match="p2p"):
        net.set_latency(all_reduce=0.1, p2p=-1.0)
    assert net.latency("all_reduce") == 0.5


@pytest.mark.parametrize("bad", ["", "Latency", "9lat", "lat-ency", "lat ency", 3])
def test_name_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="name must be lower case letters"):
        register_latency_backend(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("taken", ["gloo", "nccl", "mpi"])
def test_a_name_c10d_has_is_refused(taken: str) -> None:
    with pytest.raises(ValueError, match=f"name '{taken}' is already a c10d backend"):
        register_latency_backend(taken)


def test_inner_must_be_gloo() -> None:
    with pytest.raises(ValueError, match="inner must be one of gloo, got 'nccl'"):
        register_latency_backend(fresh_name(), inner="nccl")


def test_registering_again_updates_the_same_handle() -> None:
    name = fresh_name()
    first = register_latency_backend(name, latency={"p2p": 0.4})
    log = EventLog()
    second = register_latency_backend(name, latency=0.07, on_event=log)
    assert second is first
    assert first.latencies() == dict.fromkeys(OP_TYPES, 0.07)
    assert first.on_event is log
    assert dist.Backend.backend_list.count(name) == 1


def test_on_event_must_be_callable() -> None:
    with pytest.raises(TypeError, match="on_event must be a callable or None, got 3"):
        register_latency_backend(fresh_name(), on_event=3)  # type: ignore[arg-type]
    net = register_latency_backend(fresh_name(), on_event=EventLog())
    net.on_event = None
    assert net.on_event is None
