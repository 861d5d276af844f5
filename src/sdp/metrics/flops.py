"""FLOPs per step (counted, not modelled) and model FLOPs utilisation.

The count comes from torch's FlopCounterMode over one real training step
(forward, backward, and whatever the strategy runs): matmuls and convolutions,
which is where the FLOPs are. SDP's held-only weight-gradient kernels are
counted as what they compute, so backward masking's saving shows up here.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

# Dense peak FLOP/s per device by compute dtype (vendor datasheets: SXM parts,
# no sparsity). fp32 is the non-tensor-core rate, used when TF32 is off (the default).
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
}


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False)


def peak_flops(device: torch.device, dtype: str = "fp32") -> float | None:
    """The device's dense peak for `dtype`, when it is a known GPU; None otherwise."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS.items():
        if key in name:
            if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
                return None  # TF32 runs at an unlisted rate: no honest MFU
            return peaks.get(dtype)
    return None
