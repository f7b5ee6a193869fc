"""CountingStore forwards every request to the real store and records it."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from ms_testing.store import CountingStore


def test_requests_reach_the_inner_store_and_are_recorded() -> None:
    inner = dist.HashStore()
    store = CountingStore(inner)
    store.set("a", "1")
    assert inner.get("a") == b"1" and store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    store.wait(["a", "n"])
    store.wait(["a"], timedelta(seconds=1))
    assert store.check(["a"]) and not store.check(["missing"])
    assert store.compare_set("a", "1", "2") == b"2"
    assert store.delete_key("a") and not inner.check(["a"])
    assert store.num_keys() == inner.num_keys()
    assert store.requests == [
        ("set", "a"),
        ("get", "a"),
        ("add", "n"),
        ("add", "n"),
        ("wait", "a"),
        ("wait", "n"),
        ("wait", "a"),
        ("check", "a"),
        ("check", "missing"),
        ("compare_set", "a"),
        ("delete_key", "a"),
    ]
    assert store.counts()["add"] == 2 and store.keys() == {"a", "n", "missing"}
    store.clear()
    assert store.requests == []


def test_a_prefix_store_above_it_shows_the_full_key() -> None:
    store = CountingStore(dist.HashStore())
    prefixed = dist.PrefixStore("group0", store)
    prefixed.set("k", "v")
    assert store.requests == [("set", "group0/k")]
    store.set_timeout(timedelta(milliseconds=50))
    with pytest.raises(dist.DistStoreError):
        prefixed.wait(["never"])
