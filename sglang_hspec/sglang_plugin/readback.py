"""Host copies of small device sums that never wait for the device (no SGLang import).

Under overlap scheduling the scheduler must not read a device value on the host while the step that
produces it may still run (SGLang's no-sync rule). `AsyncSums` sums a tensor on its device, copies the
sum into a pinned host buffer behind an event, and hands it over only once that event has completed;
a CPU tensor's sum is ready at once. Used by the speculation switch's realized-rate guard
(speculation_switch.py) for the tokens a drafting step committed.
"""

from __future__ import annotations

from collections import deque

import torch


class AsyncSums:
    """Sums of tensors, each with a key, returned by `ready` in push order once they can be read without a
    wait. At most `capacity` copies are in flight: pushing more drops the oldest (its key never comes back),
    and a pinned buffer is reused only after `capacity` later pushes."""

    def __init__(self, *, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._in_flight: deque = deque()  # (key, host buffer [1] or int, event or None)
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def push(self, key, values: torch.Tensor) -> None:
        total = values.sum()
        if total.device.type == "cpu":
            self._in_flight.append((key, int(total), None))
        else:
            if len(self._buffers) < self.capacity + 1:  # one spare: a dropped copy's buffer may still be written
                self._buffers.append(torch.empty(1, dtype=total.dtype, pin_memory=True))
            buffer = self._buffers[self._next % len(self._buffers)]
            self._next += 1
            buffer.copy_(total.view(1), non_blocking=True)
            event = torch.get_device_module(total.device).Event()
            event.record()
            self._in_flight.append((key, buffer, event))
        while len(self._in_flight) > self.capacity:
            self._in_flight.popleft()

    def ready(self) -> list[tuple[object, int]]:
        """(key, sum) of the oldest pushes whose copies have landed, in push order; the rest stay."""
        out = []
        while self._in_flight:
            key, value, event = self._in_flight[0]
            if event is not None and not event.query():
                break
            self._in_flight.popleft()
            out.append((key, value if event is None else int(value.item())))
        return out


__all__ = ["AsyncSums"]
