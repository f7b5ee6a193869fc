"""The stage-1 host buffer: one reusable shared-memory segment the stage-2 process maps.

Stage 1 copies every tensor into it and returns; the writer process reads the same
pages by the segment's name, so no byte goes through a pipe. The segment grows (by a
quarter more than asked, to avoid regrowing on small changes) only between saves, when
no writer reads it. When the state holds CUDA tensors the segment is page-locked with
``cudaHostRegister`` once, so device-to-host copies run at full PCIe speed.

Segments are named after their owner (``_shm``); before creating one, segments left by
dead owners (a SIGKILLed process tree) are unlinked.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import torch

from ms_ckpt._shm import segment_name, sweep_stale

ALIGN = 64  # every tensor starts on a cache line, so any dtype can view it


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostPool:
    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        self._buf: torch.Tensor | None = None
        self._pinned = False

    @property
    def name(self) -> str:
        if self._shm is None:
            raise RuntimeError("the host pool has no segment yet")
        return self._shm.name

    def reserve(self, nbytes: int, *, pin: bool) -> torch.Tensor:
        """A uint8 view of at least ``nbytes`` (the caller ensures no writer reads it)."""
        if self._shm is None or self._buf is None or self._shm.size < nbytes:
            self.close()
            sweep_stale()  # before taking more of /dev/shm, free what dead owners left
            self._shm = shared_memory.SharedMemory(
                name=segment_name(), create=True, size=max(ALIGN, nbytes * 5 // 4)
            )
            self._buf = torch.frombuffer(self.view(), dtype=torch.uint8)
        if pin and not self._pinned and torch.cuda.is_available():
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            rc = cudart.cudaHostRegister(self._buf.data_ptr(), self._buf.numel(), 0)
            self._pinned = int(rc) == 0
        return self._buf

    def view(self) -> memoryview:
        """The segment's bytes, for a writer in this process."""
        buf = None if self._shm is None else self._shm.buf
        if buf is None:
            raise RuntimeError("the host pool has no segment yet")
        return buf

    def close(self) -> None:
        if self._shm is None:
            return
        if self._pinned and self._buf is not None:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(self._buf.data_ptr())
            self._pinned = False
        self._buf = None
        self._shm.close()
        self._shm.unlink()
        self._shm = None


def stage1_copy(pool: HostPool, tensors: list[tuple[str, torch.Tensor]]) -> list[dict[str, object]]:
    """Copy every tensor into the pool; return one record per tensor (key, dtype, shape,
    the byte range in the pool)."""
    records: list[dict[str, object]] = []
    offset = 0
    for key, t in tensors:
        nbytes = t.numel() * t.element_size()
        records.append(
            {
                "key": key,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "pool_offset": offset,
                "raw_length": nbytes,
            }
        )
        offset = align(offset + nbytes)
    devices = {t.device for _, t in tensors if t.is_cuda}
    buf = pool.reserve(offset, pin=bool(devices))
    for (_, t), rec in zip(tensors, records, strict=True):
        start, n = int(rec["pool_offset"]), int(rec["raw_length"])  # type: ignore[call-overload]
        if n:
            dst = buf[start : start + n].view(t.dtype).view(t.shape)
            dst.copy_(t, non_blocking=t.is_cuda)
    # The non-blocking copies were queued on each device's current stream, behind the
    # work that produced the state; wait for those streams only, not for other streams'
    # work (a global synchronize would also wait for, e.g., a prefetch or a collective).
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return records
