"""Per-rank memory: bytes of what is actually allocated on this rank.

Two measurements, reported together on every run:

- static bytes (`static_bytes`): the weights, gradients and optimizer state
  this rank holds, counted from the tensors themselves (views of one storage
  count once);
- the live-tensor peak of one training step (`LivePeak`), split into weights,
  gradients, optimizer state, activations, temporaries (backward-pass
  intermediates such as activation gradients, and communication buffers) and
  other. It is tracked with torch's MemTracker, a dispatch mode that sees
  every tensor storage created or freed, so it works on the CPU, on CUDA and
  under FakeTensorMode (the memory estimator), and never reads a silent 0.

On CUDA the allocator's own peaks (`torch.cuda.max_memory_allocated` and
`max_memory_reserved`) are reported beside them.
"""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

# The live-peak breakdown's keys, and the MemTracker categories each one sums.
PEAK_KINDS = {
    "weights": (_MemRefType.PARAM, _MemRefType.BUFFER),
    "grads": (_MemRefType.GRAD,),
    "optimizer": (_MemRefType.OPT,),
    "activations": (_MemRefType.ACT,),
    "temporaries": (_MemRefType.TEMP,),
    "other": (_MemRefType.OTH,),
}


def _nbytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (tied or aliased tensors count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
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


class _NoHook:
    def remove(self) -> None:
        pass


class _StepTracker(MemTracker):
    """A MemTracker that lets the root module run once per micro-batch within one step, and
    accepts frozen parameters (backward masking's non-held weights).

    MemTracker keeps per-module snapshots and refuses a second root forward;
    only the global peak is used here, so the module stats are cleared instead.
    It also hooks every parameter's gradient, which a frozen one cannot take:
    those are marked as hooked already (they never get a gradient).
    """

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True):
        for p in module.parameters():
            if not p.requires_grad:
                self._param_to_grad_hook_handles.setdefault(p, (_NoHook(), _NoHook()))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        root_call = set(self._mod_tracker.parents) - {name} == {"Global"}
        if module in self.memory_tracking and root_call and not self._mod_tracker.is_bw:
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)


class LivePeak:
    """The live-tensor peak of the code run inside `with LivePeak(model, optimizer):`.

    Create it just before the measured step, while the previous step's
    gradients and the optimizer state exist: everything alive then is
    registered, so persistent memory (weights, optimizer state, DDP's gradient
    buckets) is in the peak even though it was allocated earlier.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *extra: torch.Tensor):
        self._tracker = _StepTracker()
        self._tracker.track_external(model, optimizer, *extra)

    def __enter__(self) -> LivePeak:
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)

    def breakdown(self) -> dict[str, int]:
        """Bytes by kind at the moment of the peak, and their `total`, summed over devices."""
        out = dict.fromkeys(PEAK_KINDS, 0)
        total = 0
        for snap in self._tracker.get_tracker_snapshot("peak").values():
            for kind, refs in PEAK_KINDS.items():
                out[kind] += sum(int(snap.get(ref, 0)) for ref in refs)
            total += int(snap["Total"])
        return {**out, "total": total}


def cuda_peaks(device: torch.device) -> dict[str, int | None]:
    """The CUDA allocator's peaks since the last reset; None off CUDA."""
    if device.type != "cuda":
        return {"cuda_max_allocated_bytes": None, "cuda_max_reserved_bytes": None}
    return {
        "cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }
