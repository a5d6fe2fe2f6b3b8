"""ShmExchange: an all-gather among a fixed set of processes (or threads) through one shared-memory segment.

easyspec's draft ranks exchange attention outputs with it; it beat gloo on one host
(benchmarks/easyspec_exchange.py).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from paraspec.runtime.shm import Segment, futex_wait, futex_wake_all


class ShmExchange:
    """All-gather among `world` processes through one shared-memory segment.

    Layout: per rank a 64-byte header (its uint32 step word) and two payload buffers, used by step parity. A
    rank waits for every other rank to publish step s before it can publish s + 1, so a buffer is never
    overwritten while someone may still read it (a rank is at most one step ahead). Waiting sleeps on the step word
    (futex), checking `alive()` every half second so a dead peer raises instead of hanging.
    """

    HEADER = 64

    def __init__(self, segment, rank: int, world: int, max_bytes: int, alive=None):
        self.segment, self.rank, self.world, self.max_bytes = segment, rank, world, max_bytes
        self.alive = alive or (lambda: True)
        self.stride = self.HEADER + 2 * max_bytes
        self.steps = [np.ndarray((1,), np.uint32, buffer=segment.buf, offset=r * self.stride) for r in range(world)]
        self.addresses = [s.__array_interface__["data"][0] for s in self.steps]
        self.step = int(self.steps[rank][0])

    @classmethod
    def create(cls, world: int, max_bytes: int, tag: str = "exchange") -> ShmExchange:
        segment = Segment.create(tag, world * (cls.HEADER + 2 * max_bytes))
        np.ndarray((segment.size,), np.uint8, buffer=segment.buf)[:] = 0
        return cls(segment, 0, world, max_bytes)

    @classmethod
    def attach(cls, name: str, rank: int, world: int, max_bytes: int, alive=None) -> ShmExchange:
        return cls(Segment.attach(name), rank, world, max_bytes, alive)

    def _payload(self, rank: int, step: int, nbytes: int) -> np.ndarray:
        offset = rank * self.stride + self.HEADER + (step % 2) * self.max_bytes
        return np.ndarray((nbytes,), np.uint8, buffer=self.segment.buf, offset=offset)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
        if data.nbytes > self.max_bytes:
            raise ValueError(f"all_gather of {data.nbytes} bytes exceeds the exchange's {self.max_bytes}")
        step = self.step + 1
        self._payload(self.rank, step, data.nbytes)[:] = data
        self.steps[self.rank][0] = step & 0xFFFFFFFF
        futex_wake_all(self.addresses[self.rank])
        out = []
        for r in range(self.world):
            if r == self.rank:
                out.append(tensor)
                continue
            last_check = time.monotonic()
            # rank r is at step - 1 (not published yet) or at step (or already at step + 1, its next
            # all-gather: it read ours, and writes step + 1 into the other parity buffer)
            while (seen := int(self.steps[r][0])) == (step - 1) & 0xFFFFFFFF:
                futex_wait(self.addresses[r], seen, 0.5)
                if time.monotonic() - last_check > 0.5:
                    last_check = time.monotonic()
                    if not self.alive():
                        raise RuntimeError(f"all_gather: rank {r} stopped during an all-gather")
            raw = torch.from_numpy(self._payload(r, step, data.nbytes).copy())
            out.append(raw.view(tensor.dtype).reshape(tensor.shape))
        self.step = step
        return out

    def close(self) -> None:
        self.steps, self.addresses = [], []  # views of the segment: dropped before it is closed
        self.segment.close()
