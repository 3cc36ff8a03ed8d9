"""The host ends of a round's two transfers: the slots upload and the readback.
Pinned on cuda/npu: a non_blocking copy from pageable memory is a hidden host sync on
torch_npu. ``finish_read`` waits for the copy's event only; the next round may launch
before it, queued behind the copy, so it cannot overwrite the rows being read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PendingRead:
    buffer: int
    size: int
    event: object | None  # a device event after the copy (None on CPU)
    uploads: int  # uploads enqueued before it: waiting for it covers those


class HostTransfers:
    def __init__(self, bufs):
        device = bufs.slots.device
        pinned = device.type in ("cuda", "npu")
        bmax = bufs.slots.shape[0]
        self.slots = torch.zeros(bmax, dtype=torch.int64, pin_memory=pinned)  # [Bmax]
        self._slots = self.slots.numpy()  # written in place on the host: no tensor per round
        # two readback buffers [Bmax * readout width]: one being read while the next fills
        self.out = [torch.zeros(bufs.readout.numel(), dtype=torch.int64, pin_memory=pinned)
                    for _ in range(2)]
        self._next = 0
        self._device = device
        self._module = torch.get_device_module(device) if device.type != "cpu" else None
        # one event per host buffer, made once (no event object per round)
        self._events = [self._module.Event() for _ in range(2)] if self._module else [None] * 2
        self._uploads = 0  # uploads enqueued so far
        self._uploading = False  # an upload that no finished read has waited for yet

    def _sync(self) -> None:
        if self._module is not None:
            self._module.current_stream(self._device).synchronize()

    def upload(self, slots: list[int], bucket: int, dst: torch.Tensor) -> None:
        """dst[:bucket] <- slots padded with slot 0, one non_blocking host->device copy."""
        if self._uploading:  # the last upload may still be reading the buffer this one
            self._sync()  # is about to rewrite (a failed round, or an overlapped one)
        b = len(slots)
        self._slots[:b] = slots
        self._slots[b:bucket] = 0
        dst[:bucket].copy_(self.slots[:bucket], non_blocking=True)
        self._uploads += 1
        self._uploading = True

    def start_read(self, rows: torch.Tensor) -> PendingRead:
        i, size = self._next, rows.numel()
        self._next = 1 - self._next
        self.out[i][:size].view(rows.shape).copy_(rows, non_blocking=True)
        event = self._events[i]
        if event is not None:
            event.record()
        return PendingRead(i, size, event, self._uploads)

    def finish_read(self, read: PendingRead) -> torch.Tensor:
        """Wait for that copy (the round's one host sync) -> the values, flat, as a view
        of the host buffer (the start_read after next overwrites it: read it before)."""
        if read.event is not None:
            read.event.synchronize()
        if read.uploads == self._uploads:  # no upload since that copy was enqueued
            self._uploading = False
        return self.out[read.buffer][:read.size]

    def readback(self, rows: torch.Tensor) -> list[int]:
        return self.finish_read(self.start_read(rows)).tolist()
