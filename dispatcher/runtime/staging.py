"""Host <-> device traffic of a step: one host-to-device copy in, one device-to-host copy out.

``Upload`` packs every host-side column a step needs (int64; floats travel as their float64 bit patterns) into a
pinned buffer and copies it to the device at once; the device gets views. Two pinned buffers take turns, each
reused only once its previous copy has run, so the host never waits for the device here. ``Download`` copies a
step's results into pinned memory behind an event: waiting for that event is the step's one synchronization.
On the CPU both are plain copies.
"""

from __future__ import annotations

import numpy as np
import torch


class Upload:
    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.cuda = device.type == "cuda"
        self._capacity = 0
        self._turn = 0
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        if self.cuda:
            if self._capacity:  # the old buffers may still be in flight
                for done in self._done:
                    done.synchronize()
            self._pinned = [torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._done = [torch.cuda.Event(), torch.cuda.Event()]
            self._device_buf = [torch.empty(capacity, dtype=torch.int64, device=self.device) for _ in range(2)]
        self._capacity = capacity

    def __call__(self, *columns: np.ndarray) -> list[torch.Tensor]:
        """Device int64 tensors holding ``columns`` (each 1-D, int or float64 viewed as int64), in one copy."""
        sizes = [len(c) for c in columns]
        total = sum(sizes)
        if not self.cuda:
            flat = torch.from_numpy(np.concatenate([np.asarray(c).view(np.int64) if c.dtype == np.float64 else
                                                    np.asarray(c, np.int64) for c in columns]) if total else
                                    np.zeros(0, np.int64))
            return list(flat.split(sizes))
        if total > self._capacity:
            self._grow(max(total, 2 * self._capacity))
        self._turn ^= 1
        self._done[self._turn].synchronize()  # its previous copy has run (long ago, in the steady state)
        host = self._pinned[self._turn].numpy()
        at = 0
        for c in columns:
            host[at : at + len(c)] = c.view(np.int64) if c.dtype == np.float64 else c
            at += len(c)
        dev = self._device_buf[self._turn][:total]
        dev.copy_(self._pinned[self._turn][:total], non_blocking=True)
        self._done[self._turn].record()
        return list(dev.split(sizes))


def as_float(column: torch.Tensor) -> torch.Tensor:
    """A column uploaded from float64 values, as float32."""
    return column.view(torch.float64).float()


def f32_words(values) -> np.ndarray:
    """Float values as float32, two to an int64 word (an upload column; ``as_f32`` reads them on the device without a
    conversion)."""
    f32 = np.asarray(values, np.float32)
    return np.concatenate([f32, np.zeros(len(f32) % 2, np.float32)]).view(np.int64)


def as_f32(column: torch.Tensor) -> torch.Tensor:
    """The float32 values of a ``f32_words`` column (one more, 0, for an odd count)."""
    return column.view(torch.float32)


class Download:
    """The results of one step, copied back once. ``start`` queues the copy; ``wait`` synchronizes and returns the
    host array (a view of pinned memory, valid until the buffer's next use ``buffers`` steps later). ``buffers``:
    the steps the engine keeps submitted at once (at least 2): a buffer is taken again only for a step the engine
    scheduled after it had the result the buffer last held, so that result has been read."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16, buffers: int = 2):
        self.device = device
        self.cuda = device.type == "cuda"
        self.buffers = buffers
        self._turn = 0
        self._capacity = 0
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        if self.cuda:
            if self._capacity:
                for done in self._done:
                    done.synchronize()
            self._pinned = [torch.empty(capacity, dtype=torch.int32, pin_memory=True) for _ in range(self.buffers)]
            self._done = [torch.cuda.Event() for _ in range(self.buffers)]
        self._capacity = capacity

    def start(self, values: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        """Queue the copy of a flat int32 device tensor; returns a ticket for ``wait``."""
        n = values.numel()
        if not self.cuda:
            return -1, n, values.clone()
        if n > self._capacity:
            self._grow(max(n, 2 * self._capacity))
        self._turn = (self._turn + 1) % self.buffers
        self._done[self._turn].synchronize()  # the buffer's previous result has been read (``buffers`` steps ago)
        self._pinned[self._turn][:n].copy_(values, non_blocking=True)
        self._done[self._turn].record()
        return self._turn, n, self._pinned[self._turn]

    def wait(self, ticket: tuple[int, int, torch.Tensor]) -> np.ndarray:
        turn, n, buf = ticket
        if turn >= 0:
            self._done[turn].synchronize()
        return buf[:n].numpy()
