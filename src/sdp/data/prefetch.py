"""Batches copied to the accelerator one step ahead, from pinned memory, on a stream of their own.

A copy from pageable host memory is synchronous whatever `non_blocking` says; from pinned
memory it is a DMA that runs beside the compute. `to_device` pins each batch, issues its copy
on a side stream while the step before runs, and hands it over when the compute stream has
waited for that copy (never the host). On CPU the batches pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _pinned(batch: dict) -> dict:
    return {k: v if v.is_pinned() else v.pin_memory() for k, v in batch.items()}


class DevicePrefetcher:
    """An iterator of `batches` already on `device` (CUDA), the next one's copy in flight."""

    def __init__(self, batches: Iterator[dict], device: torch.device):
        self.batches, self.device = batches, device
        self.stream = torch.cuda.Stream(device)
        self._next: dict | None = None

    def _issue(self) -> dict:
        host = _pinned(next(self.batches))
        with torch.cuda.stream(self.stream):
            return {k: v.to(self.device, non_blocking=True) for k, v in host.items()}

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> dict:
        batch = self._next if self._next is not None else self._issue()
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)
        for t in batch.values():
            t.record_stream(compute)  # its memory is not reused before the compute is done with it
        self._next = self._issue()
        return batch


def to_device(batches: Iterator[dict], device: torch.device) -> Iterator[dict]:
    """`batches` prefetched onto `device` when it is CUDA; unchanged otherwise (the trainer's own
    `.to(device)` then copies, a no-op on CPU)."""
    return DevicePrefetcher(batches, device) if device.type == "cuda" else batches
