"""Per-rank memory: bytes of what is actually allocated on this rank."""

from __future__ import annotations

import torch


def _nbytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (tied or aliased tensors count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device) if t.device.type != "meta" else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes() if t.device.type != "meta" else t.numel() * t.element_size()
    return total


def static_bytes(weights, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Weights, gradients and optimizer state held by this rank, in bytes.

    `weights` are all tensors holding model weights on this rank (parameters
    and any weight storage that is not a Parameter); views of one storage count once.
    """
    params = list(weights)
    state = [v for s in optimizer.state.values() for v in s.values()]
    return {
        "params_bytes": _nbytes(params),
        "grads_bytes": _nbytes(getattr(p, "grad", None) for p in params),
        "optim_bytes": _nbytes(state),
    }


def peak_bytes(device: torch.device) -> int | None:
    """Allocator peak on CUDA; None on the CPU, where no allocator peak exists to read."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None
