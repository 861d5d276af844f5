"""Communication, counted where the collectives are issued: bytes sent, and the time the
compute spends waiting for communication to finish (exposed communication)."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

# What is counted: gradient averaging of unit parameters (all of them under DDP),
# of shared parameters under SDP, backward masking's refresh of non-held weights, and
# the weights and optimizer state that move when the mask is resampled, and FSDP's
# weight all-gathers and gradient reduce-scatters, and an outer loop's pseudo-gradient averaging
# (sdp.outer: every H steps, counted in the step that syncs).
COMM_KINDS = (
    "grad_sync",
    "shared_sync",
    "weight_refresh",
    "resample",
    "param_all_gather",
    "grad_reduce_scatter",
    "outer_sync",
)


def wire_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends on the wire for a collective of `nbytes` payload per rank among `n`
    ranks, by NCCL's ring algorithms: an all-reduce moves 2(n-1)/n of it, a reduce-scatter
    (n-1)/n, an all-gather (n-1) times its input (it forwards every other rank's), a broadcast
    the buffer once; nothing alone."""
    if n < 2:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1, "broadcast": 1}
    if op not in factor:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(factor)}")
    return factor[op] * nbytes


class CommCounter:
    """Bytes of collective payload this rank sends, by kind, per optimizer step, and the
    time per step the compute waits for gradient averaging and weight refresh.

    The payload is the size of the tensor handed to the collective (an
    all-reduce of N bytes counts N), not the wire traffic of a particular
    algorithm (a ring all-reduce moves 2(K-1)/K * N per rank).

    Waiting is measured where a strategy blocks on communication (`start` ... `stop`, or
    `waiting()`): host time on the CPU; on CUDA, the time between two events on the
    compute stream around the wait, read once they have completed, so that measuring
    never blocks the host.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self._current: dict[str, int] = defaultdict(int)
        self.total: dict[str, int] = defaultdict(int)
        self.steps = 0
        self.device = device
        self._waits: list = []  # this step's waits: seconds (CPU) or CUDA event pairs
        self._pending: list = []  # (timed step, CUDA event pair) not read yet
        self.step_waits: list[float] = []  # seconds waited in each timed step
        self.measured = False  # whether the strategy measures its waits (track_waits)
        # The memory estimator's record of every collective (see `event`), and where the compute
        # stands: a callable giving the FLOPs done so far in the traced step (None: outside it).
        self.timeline: list[dict] | None = None
        self.position = None

    def add(self, kind: str, nbytes: int) -> None:
        if kind not in COMM_KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; known: {', '.join(COMM_KINDS)}")
        self._current[kind] += nbytes

    def event(self, op: str, kind: str, nbytes: int, ranks: tuple[int, ...]) -> int | None:
        """A collective this rank takes part in is issued (op: all_reduce, broadcast, all_gather,
        reduce_scatter; `nbytes` its payload on this rank; `ranks` its group). Recorded only
        when a timeline is kept (the estimator's step-time model); returns its handle."""
        if self.timeline is None:
            return None
        self.timeline.append(
            {"op": op, "kind": kind, "bytes": int(nbytes), "ranks": list(ranks), "issue": self._at(), "need": None}
        )
        return len(self.timeline) - 1

    def need(self, handle: int | None) -> None:
        """The compute needs the result of collective `handle` now (it waits for it here)."""
        if handle is not None and self.timeline is not None and self.timeline[handle]["need"] is None:
            at = self._at()
            self.timeline[handle]["need"] = -1.0 if at is None else at  # -1: needed outside the traced step

    def need_pending(self, kinds: tuple[str, ...]) -> None:
        """Every recorded collective of these kinds not needed yet is needed now (DDP's and FSDP's
        reductions, which their own hooks wait for at the end of the backward)."""
        for i, rec in enumerate(self.timeline or ()):
            if rec["need"] is None and rec["kind"] in kinds:
                self.need(i)

    def _at(self) -> float | None:
        return None if self.position is None else float(self.position())

    def track_waits(self) -> None:
        """Called by a strategy that measures its waits: exposed_s() is then a number (0 when
        nothing was waited for), not None."""
        self.measured = True

    def start(self):
        """A mark on the compute timeline: where a wait for communication begins."""
        if self.device is not None and self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, mark) -> None:
        """The wait that began at `mark` (from `start`) is over: count it in this step."""
        if isinstance(mark, float):
            self._waits.append(time.perf_counter() - mark)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._waits.append((mark, end))

    def waiting(self):
        """`with comm.waiting(): work.wait()`: the wait counts as exposed communication."""
        return _Waiting(self)

    def end_step(self, *, timed: bool = True) -> dict[str, int]:
        """Close one optimizer step; returns its bytes by kind. The waits of a step that is
        not `timed` (a profiled one, slowed down by the counters) are dropped."""
        step = dict(self._current)
        for kind, nbytes in step.items():
            self.total[kind] += nbytes
        self._current.clear()
        self.steps += 1
        if timed:
            self.step_waits.append(sum(w for w in self._waits if isinstance(w, float)))
            self._pending += [(len(self.step_waits) - 1, w) for w in self._waits if not isinstance(w, float)]
        self._waits = []
        self._read_events(block=False)
        return step

    def _read_events(self, *, block: bool) -> None:
        keep = []
        for step, (begin, end) in self._pending:
            if block or end.query():
                end.synchronize()
                self.step_waits[step] += begin.elapsed_time(end) / 1000
            else:
                keep.append((step, (begin, end)))
        self._pending = keep

    def discard_step(self) -> dict[str, int]:
        """Forget the bytes of the step under way (the estimator's warm-up step, which is
        shorter than the steps it counts); returns them by kind."""
        dropped = dict(self._current)
        self._current.clear()
        self._waits.clear()
        return dropped

    def per_step(self) -> dict[str, float]:
        """Mean bytes per step by kind."""
        return {kind: self.total[kind] / max(1, self.steps) for kind in COMM_KINDS}

    def waits(self) -> list[float] | None:
        """Seconds this rank waited for communication in each timed step; None when the
        strategy does not measure it (FSDP's waits are inside its own hooks)."""
        if not self.measured:
            return None
        self._read_events(block=True)
        return list(self.step_waits)


def exposed_comm(waits_per_rank: list[list[float] | None]) -> tuple[float | None, float | None]:
    """(exposed communication, the busiest rank's wait), mean seconds per step, from every
    rank's `CommCounter.waits()`.

    A rank waits for two things after its compute: communication still in flight, and
    peers still computing (ranks drift apart; on a shared CPU by tens of ms within a step).
    Each step, the rank that finishes its compute last waits for communication alone, so
    the smallest wait over the ranks is the communication the step could not hide (the
    exposed part); the largest rank's mean wait includes the drift."""
    if any(w is None for w in waits_per_rank) or not waits_per_rank or not waits_per_rank[0]:
        return None, None
    steps = list(zip(*waits_per_rank, strict=True))
    exposed = sum(min(step) for step in steps) / len(steps)
    busiest = max(sum(w) / len(w) for w in waits_per_rank)
    return exposed, busiest


class _Waiting:
    def __init__(self, comm: CommCounter):
        self.comm = comm

    def __enter__(self):
        self.mark = self.comm.start()

    def __exit__(self, *exc) -> None:
        self.comm.stop(self.mark)
