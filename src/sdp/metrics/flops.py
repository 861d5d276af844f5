"""FLOPs per step (counted, not modelled) and model FLOPs utilisation.

The count comes from torch's FLOP formulas (`torch.utils.flop_counter`'s registry) over one
real training step (forward, backward, and whatever the strategy runs): matmuls and
convolutions, which is where the FLOPs are. SDP's held-only weight-gradient kernels are
counted as what they compute, so backward masking's saving shows up here.

`FlopTally` applies those formulas to every op it sees and nothing else: unlike
FlopCounterMode it tracks no modules and decomposes no op, so a step runs the same ops and
keeps the same tensors alive under it. The estimator counts a step's FLOPs and its live peak
in one traced step (FlopCounterMode's module tracking kept a checkpointed block's recomputed
tensors alive: +1% of a tiny LLaMA's peak under full checkpointing). Its totals equal
FlopCounterMode's (tests/test_metrics.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from sdp.metrics.launches import OpTape

# Dense peak FLOP/s per device by compute dtype (vendor datasheets: SXM parts,
# no sparsity). fp32 is the non-tensor-core rate, used when TF32 is off (the default).
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
}


class FlopTally(TorchDispatchMode):
    """`with FlopTally() as tally: ...`, then `tally.get_total_flops()`: the FLOPs of the ops
    run inside, by torch's formulas (see the module doc). With `tape`, each op is also kept in
    order with its launches, FLOPs and bytes (`sdp.metrics.launches.OpTape`: the step-time
    model's input)."""

    def __init__(self, *, tape: bool = False):
        super().__init__()
        self.total = 0
        self.tape = OpTape() if tape else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        flops = 0 if formula is None else formula(*args, **kwargs, out_val=out)
        self.total += flops
        if self.tape is not None:
            self.tape.add(func, args, kwargs, out, flops)
        return out

    def get_total_flops(self) -> int:
        return self.total


def flop_counter(*, tape: bool = False) -> FlopTally:
    return FlopTally(tape=tape)


def peak_flops(device: torch.device, dtype: str = "fp32") -> float | None:
    """The device's dense peak for `dtype`, when it is a known GPU; None otherwise."""
    entry = peak_entry(device, dtype)
    return None if entry is None else entry["flops_per_s"]


def peak_entry(device: torch.device, dtype: str = "fp32") -> dict | None:
    """The peak-table entry used for `device` and `dtype` (summary.json's `mfu_peak`), or None:
    not a GPU, not in the table, or fp32 with TF32 on (an unlisted rate: no honest MFU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS.items():
        if key in name:
            if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
                return None
            flops = peaks.get(dtype)
            return None if flops is None else {"device": name, "entry": key, "dtype": dtype, "flops_per_s": flops}
    return None


def attention_heads(model: nn.Module) -> tuple[int, int]:
    """(query heads summed over the layers the model runs, head_dim): transformers' attention
    modules (a `q_proj` and a `head_dim`); (0, 0) for a model without them."""
    found = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "head_dim")]
    if not found:
        return 0, 0
    return sum(m.q_proj.weight.shape[0] // m.head_dim for m in found), found[0].head_dim


def model_flops_per_token(*, forward_params: int, trained_params: int, heads: int, head_dim: int, seq_len: int) -> int:
    """Model FLOPs per token of one rank's transformer training step, by torchtitan's formula:
    6 x non-embedding parameters + 12 x heads x head_dim x seq_len (attention's score and value
    products, `heads` summed over the layers), for what this rank runs: 2 FLOPs a parameter for
    the forward and 2 for the input gradients of every (non-embedding) parameter the forward
    uses (forward masking: its smaller subnetwork), 2 for the weight gradients of those it
    trains (backward masking: its held ranges only). Recomputation (activation checkpointing,
    the chunked loss's second LM-head product) is not counted, as MFU does not."""
    return 4 * forward_params + 2 * trained_params + 12 * heads * head_dim * seq_len
