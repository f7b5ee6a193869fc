"""A ``torch.distributed.Store`` that records every request it passes to a real store.

Wrap a rank's ``TCPStore`` client in :class:`CountingStore` and give it to
``init_process_group(store=...)``: every group torch then creates reaches the store
through it (``new_group`` prefixes the default group's store), so the requests each
rank makes while it creates groups, and the keys they touch, can be counted and
attributed (a world-wide ``_store_based_barrier`` is an ``add`` on an unprefixed
``store_based_barrier_key:<group>`` key). Each request crosses into Python, so time
counted runs apart from timed ones.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from torch._C._distributed_c10d import Store

__all__ = ["CountingStore"]


class CountingStore(Store):
    """Forwards every request to ``inner`` and appends ``(op, key)`` to :attr:`requests`."""

    def __init__(self, inner: Store) -> None:
        super().__init__()
        self.inner = inner
        #: Every request in order, ``wait`` and ``check`` once per key.
        self.requests: list[tuple[str, str]] = []

    def clear(self) -> None:
        self.requests.clear()

    def counts(self) -> Counter[str]:
        """Requests per operation."""
        return Counter(op for op, _ in self.requests)

    def keys(self) -> set[str]:
        return {key for _, key in self.requests}

    def _note(self, op: str, key: str | bytes) -> None:
        self.requests.append((op, key.decode() if isinstance(key, bytes) else key))

    def set(self, key: str, value: str) -> None:
        self._note("set", key)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._note("get", key)
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        self._note("add", key)
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        self._note("compare_set", key)
        return self.inner.compare_set(key, expected_value, desired_value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        for key in keys:
            self._note("wait", key)
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        for key in keys:
            self._note("check", key)
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self._note("delete_key", key)
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
