"""What a GPU pays for per op: the kernel launches a step dispatches, counted on any device.

Every aten op that computes is at least one kernel launch on a GPU, each a few microseconds of
the host's time and of the device's, whatever its size: a step of thousands of small ops is
bound by them, not by its FLOPs. `LaunchCounter` (a TorchDispatchMode) counts the ops a piece of
code dispatches, as a GPU would launch them:

- views and allocations cost nothing (no kernel runs): ops whose result aliases an input
  (`narrow`, `view`, `t`, `detach`...), `_unsafe_view`, the `empty` family, and the profiler's
  markers (`record_function`);
- a `_foreach_` op (torch's multi-tensor kernels) is one launch when every tensor it takes is
  dense and its lists line up stride for stride, else one per tensor of its first list (the
  slow path loops over them);
- a fused optimizer op, a collective (`c10d`), any other op: one.

Reads of a value by the host (`.item()`, `bool(t)`: torch's `_local_scalar_dense`) are counted
apart: on a GPU each one blocks the host until the device has caught up. (`.tolist()` of a CPU
tensor reads it without a dispatch: it is not seen.)

It runs on real tensors and under FakeTensorMode (entered inside it, it sees each op before the
fake mode does: the ops a device would run). `phase` names where the counts go: set it, or use
`counting(phase)`.

`OpTape` keeps what the step-time model (`sdp.planning.step_time`) charges each op of a traced
step, in order: its launches, its FLOPs and the bytes of the tensors it reads and writes.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that allocate or describe a tensor without running a kernel.
FREE = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten._unsafe_view.default,
    aten.lift_fresh.default,
    aten.is_same_size.default,
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.record_stream.default,
}
HOST_READS = {aten._local_scalar_dense.default}


def is_dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill one block of memory without overlap, in any order of its
    dimensions (what CUDA's multi-tensor and fused kernels take); some columns of a matrix are not."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _tensor_lists(args, kwargs) -> list[list[torch.Tensor]]:
    values = [*args, *(kwargs or {}).values()]
    return [list(v) for v in values if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor)]


def foreach_launches(args, kwargs) -> int:
    """Launches of a `_foreach_` op: one on the multi-tensor path, else one per tensor."""
    lists = _tensor_lists(args, kwargs)
    if not lists:
        return 1
    fast = all(is_dense(t) for ts in lists for t in ts) and all(
        len({t.stride() for t in column}) == 1 for column in zip(*lists, strict=False)
    )
    return 1 if fast else len(lists[0])


def launches(func, args, kwargs) -> int:
    """Kernel launches one dispatch of `func` costs a GPU (see the module docstring)."""
    if func in FREE or func in HOST_READS or getattr(func, "is_view", False):
        return 0
    name = func.name()
    if name.startswith(("profiler::", "prim::")):  # record_function's markers; metadata (prim::device)
        return 0
    if name.startswith("aten::_foreach_"):
        return foreach_launches(args, kwargs)
    return 1


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def op_bytes(func, args, kwargs, out) -> int:
    """Bytes of the distinct tensors an op reads and writes (an output that is an input, as an
    in-place op returns it, counts once); a collective's are the links', not the device's: 0."""
    if func.name().startswith("c10d::"):
        return 0
    seen, total = set(), 0
    for t in (*_tensors(args), *_tensors(list((kwargs or {}).values())), *_tensors(out)):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class OpTape:
    """The ops of a traced step in order, as the step-time model charges them: each op's
    launches, FLOPs and bytes (`launches`, `flops`, `bytes`, one entry an op; views and
    allocations, which launch nothing, are left out), and the phase each op ran in (`phases`:
    [name, index of its first op] where the phase changes). `position()` is the number of ops so
    far: where a collective is issued or needed (`sdp.metrics.comm.CommCounter.position`)."""

    def __init__(self):
        self.phase = "step"
        self.launches: list[int] = []
        self.flops: list[int] = []
        self.bytes: list[int] = []
        self.phases: list[list] = []

    def add(self, func, args, kwargs, out, flops: int) -> None:
        n = launches(func, args, kwargs)
        if not n and not flops:
            return
        if not self.phases or self.phases[-1][0] != self.phase:
            self.phases.append([self.phase, len(self.launches)])
        self.launches.append(n)
        self.flops.append(int(flops))
        self.bytes.append(op_bytes(func, args, kwargs, out))

    def position(self) -> int:
        return len(self.launches)

    def to_json(self) -> dict:
        return {"launches": self.launches, "flops": self.flops, "bytes": self.bytes, "phases": self.phases}


class LaunchCounter(TorchDispatchMode):
    """Counts kernel launches by phase (`launches`), host reads apart, and each op's launches."""

    def __init__(self, phase: str = "other"):
        super().__init__()
        self.phase = phase
        self.counts: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.by_op: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = launches(func, args, kwargs)
        if n:
            self.counts[self.phase] += n
            self.by_op[(self.phase, func.name())] += n
        if func in HOST_READS:
            self.host_reads[self.phase] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self, phase: str):
        """Counts inside go to `phase` (the one before is restored after)."""
        before, self.phase = self.phase, phase
        try:
            yield self
        finally:
            self.phase = before

    def top(self, phase: str, n: int = 8) -> list[tuple[str, int]]:
        """The `n` ops that launched most in `phase`."""
        mine = Counter({op: k for (p, op), k in self.by_op.items() if p == phase})
        return mine.most_common(n)
