"""Communication bytes, counted where the collectives are issued."""

from __future__ import annotations

from collections import defaultdict

# What is counted: gradient averaging of unit parameters (all of them under DDP),
# of shared parameters under SDP, backward masking's refresh of non-held weights, and
# the weights and optimizer state that move when the mask is resampled, and FSDP's
# weight all-gathers and gradient reduce-scatters.
COMM_KINDS = ("grad_sync", "shared_sync", "weight_refresh", "resample", "param_all_gather", "grad_reduce_scatter")


class CommCounter:
    """Bytes of collective payload this rank sends, by kind, per optimizer step.

    The payload is the size of the tensor handed to the collective (an
    all-reduce of N bytes counts N), not the wire traffic of a particular
    algorithm (a ring all-reduce moves 2(K-1)/K * N per rank).
    """

    def __init__(self) -> None:
        self._current: dict[str, int] = defaultdict(int)
        self.total: dict[str, int] = defaultdict(int)
        self.steps = 0

    def add(self, kind: str, nbytes: int) -> None:
        if kind not in COMM_KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; known: {', '.join(COMM_KINDS)}")
        self._current[kind] += nbytes

    def end_step(self) -> dict[str, int]:
        """Close one optimizer step; returns its bytes by kind."""
        step = dict(self._current)
        for kind, nbytes in step.items():
            self.total[kind] += nbytes
        self._current.clear()
        self.steps += 1
        return step

    def per_step(self) -> dict[str, float]:
        """Mean bytes per step by kind."""
        return {kind: self.total[kind] / max(1, self.steps) for kind in COMM_KINDS}
