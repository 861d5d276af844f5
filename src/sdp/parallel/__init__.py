"""Data parallelism applied from outside the model.

The trainer talks to a `Strategy`: DDP (the baseline, `masking=none`) or SDP
(`sdp.subnet.SDPStrategy`). A strategy owns the model the trainer runs, the
tensors the optimizer updates, gradient synchronisation, clipping by the
global norm, what happens after an optimizer step, the full model used for
evaluation, and the per-rank byte counts.
"""

from __future__ import annotations

from sdp.parallel.config import (
    MAX_COMM_GROUPS,
    Backend,
    Checkpointing,
    CompileBackend,
    ParallelConfig,
    Parallelism,
    Precision,
    validate_parallel,
)
from sdp.parallel.strategy import PortableState, Strategy, host, move_to, rank0_buffers

__all__ = [
    "MAX_COMM_GROUPS",
    "Backend",
    "Checkpointing",
    "CompileBackend",
    "ParallelConfig",
    "Parallelism",
    "PortableState",
    "Precision",
    "Strategy",
    "host",
    "move_to",
    "rank0_buffers",
    "validate_parallel",
]
