"""Per-rank memory: bytes of what is actually allocated on this rank.

Two measurements, reported together on every run:

- static bytes (`static_bytes`): the weights, gradients and optimizer state
  this rank holds, counted from the tensors themselves (views of one storage
  count once);
- the live-tensor peak of one training step (`LivePeak`), split into weights,
  gradients, optimizer state, activations (made in the forward) and
  temporaries (made in the backward and in communication: activation
  gradients, flat all-reduce buckets, optimizer scratch). It is a dispatch mode that sees every
  tensor storage created during the step and is told by weak references when
  each one dies, so it works on the CPU, on CUDA and under FakeTensorMode (the
  memory estimator), and never reads a silent 0.

On CUDA the allocator's own peaks (`torch.cuda.max_memory_allocated` and
`max_memory_reserved`) are reported beside them.

(torch's MemTracker does the same and more, per module, but its module tracker
keeps every model it has seen alive through autograd hooks it cannot remove:
after a mask resample the old subnetwork would never be freed.)
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sdp.dist import dtensor_type, local

PEAK_KINDS = ("weights", "grads", "optimizer", "activations", "temporaries")
_ALLOCATING: list[str] = []  # kinds declared by `allocating`, innermost last


@contextlib.contextmanager
def allocating(kind: str):
    """Storages made inside count as `kind` in a LivePeak (e.g. gradients that a strategy
    writes back from its all-reduce buckets after the backward, which the tracker would
    otherwise take for activations)."""
    if kind not in PEAK_KINDS:
        raise ValueError(f"unknown memory kind {kind!r}; known: {', '.join(PEAK_KINDS)}")
    _ALLOCATING.append(kind)
    try:
        yield
    finally:
        _ALLOCATING.pop()


def outer_keys(memory: dict) -> list[str]:
    """An outer loop's byte counts in a memory dict, theta_prev's and its algorithm's state's
    (outer_backup_bytes, outer_momentum_bytes, ...: every outer_*_bytes)."""
    return [k for k in memory if k.startswith("outer_") and k.endswith("_bytes")]


def _nbytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (tied or aliased tensors count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = local(t).untyped_storage()
        # The storage's identity (views share it), valid for real, meta and fake tensors alike.
        if storage._cdata in seen:
            continue
        seen.add(storage._cdata)
        total += storage.nbytes()
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


class LivePeak(TorchDispatchMode):
    """The live-tensor peak of the code run inside `with LivePeak(model, optimizer):`.

    Create it just before the measured step, while the previous step's
    gradients and the optimizer state exist: everything alive then is
    registered, so persistent memory (weights, optimizer state, DDP's gradient
    buckets) is in the peak even though it was allocated earlier. Storages
    made inside are activations in the forward and temporaries in the backward
    and the optimizer step; a parameter's gradient becomes `grads` once it is
    accumulated, the state the optimizer keeps becomes `optimizer` after its
    step. Views share their storage and count once.

    `mark(name)` starts a named segment of the step (the planner's estimator names each
    micro-step's forward, backward and so on); `segments()` gives each segment's own peak, the
    largest total from its start to the next mark. Unmarked code is the segment "step".
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra_state=()):
        """`extra_state`: tensors kept beside the optimizer's state on the device (an outer loop's
        theta_prev and its algorithm's state under outer.backup_device=device), counted as optimizer state."""
        super().__init__()
        self._kind: dict[int, str] = {}
        self._size: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = dict.fromkeys(PEAK_KINDS, 0)
        self._peak = dict(self.current)
        self._segment = "step"
        self._segments: dict[str, dict[str, int]] = {}
        self._in_optimizer = False
        self._handles: list = []
        self._optimizer = optimizer
        self._params = [p for p in model.parameters() if p.requires_grad]
        for t in [*model.parameters(), *model.buffers()]:
            self._register(t, "weights")
        for p in model.parameters():
            self._register(p.grad, "grads")
        self._register_optimizer_state()
        for t in extra_state:
            self._register(t, "optimizer")

    def _register(self, t, kind: str, *, relabel: bool = False) -> None:
        """Count t's storage as `kind` from now until it is freed; a storage already counted
        keeps its kind unless `relabel` (a gradient made in the backward becomes `grads`)."""
        if not isinstance(t, torch.Tensor):
            return
        storage = local(t).untyped_storage()
        key = storage._cdata
        if key in self._kind:
            if relabel and self._kind[key] != kind:
                self.current[self._kind[key]] -= self._size[key]
                self.current[kind] += self._size[key]
                self._kind[key] = kind
            return
        self._kind[key], self._size[key] = kind, storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self.current[kind] += self._size[key]
        self._note()

    def _note(self) -> None:
        """Keep the current bytes if they are the step's or the segment's largest yet."""
        total = sum(self.current.values())
        if total > sum(self._peak.values()):
            self._peak = dict(self.current)
        seen = self._segments.get(self._segment)
        if seen is None or total > seen["total"]:
            self._segments[self._segment] = {**self.current, "total": total}

    def mark(self, segment: str) -> None:
        """From now on, peaks count for `segment` too (what is live now is its first level)."""
        self._segment = segment
        self._note()

    def _free(self, key: int) -> None:
        kind = self._kind.pop(key, None)
        if kind is not None:
            self.current[kind] -= self._size.pop(key)
            self._refs.pop(key, None)

    def _register_optimizer_state(self) -> None:
        for state in self._optimizer.state.values():
            for v in state.values():
                self._register(v, "optimizer", relabel=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (cls := dtensor_type()) is not None and cls in types:
            return NotImplemented  # let DTensor run its local ops, which come back through here
        out = func(*args, **(kwargs or {}))
        # The optimizer's scratch is temporary; the state it keeps is relabelled after its step.
        in_backward = torch._C._current_graph_task_id() != -1
        if _ALLOCATING:
            kind = _ALLOCATING[-1]
        else:
            kind = "temporaries" if self._in_optimizer or in_backward else "activations"
        for t in tree_flatten(out)[0]:
            self._register(t, kind)
        return out

    def __enter__(self) -> LivePeak:
        def before_step(optimizer, args, kwargs):
            self._in_optimizer = optimizer is self._optimizer

        def after_step(optimizer, args, kwargs):
            self._in_optimizer = False
            if optimizer is self._optimizer:
                self._register_optimizer_state()

        self._handles = [register_optimizer_step_pre_hook(before_step), register_optimizer_step_post_hook(after_step)]
        self._handles += [
            p.register_post_accumulate_grad_hook(lambda p: self._register(p.grad, "grads", relabel=True))
            for p in self._params
        ]
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        super().__exit__(*exc)

    def breakdown(self) -> dict[str, int]:
        """Bytes by kind at the moment of the peak, and their `total`."""
        return {**self._peak, "total": sum(self._peak.values())}

    def segments(self) -> dict[str, dict[str, int]]:
        """Each marked segment's peak: bytes by kind at its largest moment, and their `total`."""
        return {name: dict(peak) for name, peak in self._segments.items()}


def cuda_peaks(device: torch.device) -> dict[str, int | None]:
    """The CUDA allocator's peaks since the last reset; None off CUDA."""
    if device.type != "cuda":
        return {"cuda_max_allocated_bytes": None, "cuda_max_reserved_bytes": None}
    return {
        "cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }
