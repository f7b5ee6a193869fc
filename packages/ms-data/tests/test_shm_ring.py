"""The ring's publication protocol on a real /dev/shm segment, in one process.

x86 never shows another core a counter before the data stored ahead of it, so a test
here cannot make a weakly ordered CPU reorder anything. What it can check is that
every state such a CPU could show a reader is refused: the counter without the
payload, the counter with a stale digest, a payload partly old, a header or a
failure record partly written. Each state is written into the real segment exactly
as a reader on ARM could observe it, and the real reading code looks at it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from ms_data import _shm_ring as shm
from ms_data._shm_ring import RingSpec, ShmRing, check_platform


def make_spec(**kw: int) -> RingSpec:
    fields = {
        "depth": 2,
        "n_ranks": 2,
        "tp_size": 1,
        "micro_batch": 3,
        "row_len": 5,
        "dp_first": 0,
        "dp_size": 2,
        "start_step": 0,
    }
    fields.update(kw)
    return RingSpec(dtype="uint16", **fields)


@pytest.fixture
def ring() -> Iterator[ShmRing]:
    r = ShmRing.create(f"{shm.PREFIX}test_{uuid.uuid4().hex[:12]}", make_spec())
    try:
        yield r
    finally:
        r.unlink()
        r.close()


def fill(r: ShmRing, step: int) -> np.ndarray:
    """Write step ``step``'s payload (distinct per step) into its slot, unpublished."""
    data = (np.arange(r.slots[0].size, dtype=np.uint16) * 7 + step).reshape(r.slots[0].shape)
    r.slots[step % r.spec.depth] = data
    return data


def test_a_published_step_is_taken_whole(ring: ShmRing) -> None:
    data = fill(ring, 0)
    assert ring.take(0, 0) is None  # nothing published yet
    ring.publish(0)
    for i in range(ring.spec.dp_local):
        got = ring.take(0, i)
        assert got is not None
        np.testing.assert_array_equal(got, data[i])
    assert ring.take(1, 0) is None  # another step


def test_the_counter_seen_before_the_digest_or_the_payload_is_refused(ring: ShmRing) -> None:
    # The counter became visible, the digests not yet (still zero from creation).
    old = fill(ring, 0)
    ring.ready[0] = 0
    assert ring.take(0, 0) is None and ring.take(0, 1) is None
    ring.publish(0)
    assert ring.take(0, 0) is not None

    # Slot 0 again, two steps later: the counter is visible with the digests the slot
    # had for step 0 (its previous step), over step 2's payload.
    new = fill(ring, 2)
    ring.ready[0] = 2
    assert ring.take(2, 0) is None and ring.take(2, 1) is None
    # Counter and digests visible, the payload still step 0's.
    ring.publish(2)
    ring.slots[0] = old
    assert ring.take(2, 0) is None and ring.take(2, 1) is None
    ring.slots[0] = new
    np.testing.assert_array_equal(ring.take(2, 1), new[1])


def test_a_partly_visible_payload_is_refused(ring: ShmRing) -> None:
    data = fill(ring, 1)
    ring.publish(1)
    for index in [(0, 0, 0), (0, 2, 4), (1, 1, 2)]:
        ring.slots[1][index] ^= 1  # one element not yet visible (an older value)
        assert ring.take(1, index[0]) is None
        ring.slots[1][index] ^= 1
        np.testing.assert_array_equal(ring.take(1, index[0]), data[index[0]])


def test_a_header_partly_visible_is_not_attached_to(ring: ShmRing) -> None:
    spec = ring.spec
    attached = ShmRing.try_attach(ring.name, spec)
    assert attached is not None
    attached.close()
    # _INIT_DONE is visible but the start step is not yet: without the digest this
    # rank would refuse the segment as "made for a different NodeLoader".
    ring.header[shm._START_STEP] = 5
    assert ShmRing.try_attach(ring.name, spec) is None
    ring.header[shm._START_STEP] = 0
    attached = ShmRing.try_attach(ring.name, spec)
    assert attached is not None
    attached.close()
    # A real disagreement (a correct digest over other values) is still an error.
    ring.header[shm._MICRO_BATCH] = 4
    ring.header[shm._HEAD_SUM] = shm._header_digest(ring.header)
    with pytest.raises(ValueError, match="micro_batch: local rank 0 has 4, this rank 3"):
        ShmRing.try_attach(ring.name, spec)


def test_a_failure_record_partly_visible_is_not_read(ring: ShmRing) -> None:
    assert ring.failure() is None
    ring.fail(7, "ValueError: chunk 3 is corrupt", ValueError("chunk 3 is corrupt"))
    got = ring.failure()
    assert got is not None
    step, text, exc = got
    assert (step, text) == (7, "ValueError: chunk 3 is corrupt")
    assert isinstance(exc, ValueError) and str(exc) == "chunk 3 is corrupt"
    # The state says FAILED but a byte of the text, or the step, is not visible yet.
    ring._error_text[0] ^= 0xFF
    assert ring.failure() is None
    ring._error_text[0] ^= 0xFF
    ring.header[shm._ERROR_STEP] = -1
    assert ring.failure() is None
    ring.header[shm._ERROR_STEP] = 7
    again = ring.failure()
    assert again is not None and again[:2] == (7, text)


def test_a_segment_of_the_old_layout_is_refused_by_version(ring: ShmRing) -> None:
    ring.header[shm._VERSION] = 1
    with pytest.raises(ValueError, match="ring format version 1, this ms_data writes version 2"):
        ShmRing.try_attach(ring.name, ring.spec)


def test_machines_whose_counters_could_tear_are_refused() -> None:
    check_platform()  # this machine
    for machine in ("x86_64", "aarch64", "arm64", "ppc64le", "s390x", "riscv64"):
        check_platform(machine, 64)
    for machine, bits in (("armv7l", 32), ("i686", 32), ("aarch64", 32), ("mips", 64)):
        with pytest.raises(RuntimeError, match=f"got machine '{machine}' with {bits}-bit"):
            check_platform(machine, bits)
