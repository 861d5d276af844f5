"""torch.compile per block, applied from outside the model (`parallelism.compile`).

Each block (the family's decoder layers / BasicBlocks / Swin blocks: the modules activation
checkpointing and FSDP wrap) has its `forward` compiled in place. The module, its parameter
names and its hooks stay as they are: activation checkpointing's hooks run the compiled
forward inside their checkpoint, FSDP's hooks gather the block's weights around it, and unit
specs, state dicts and checkpoints are the same compiled or not. It is applied after
activation checkpointing and before FSDP, as torchtitan does, and, under SDP, to every
subnetwork a rank trains (forward masking's physically smaller blocks compile as they are;
after a mask resample again).

`fullgraph=True` (one graph per block, an error on anything dynamo cannot trace) wherever the
block's forward is plain tensor code: DDP, FSDP, forward masking. Backward masking's held
ranges are not: its held-weight kernels run eagerly inside the compiled block (their ranges
are Python constants a graph would specialise on, one graph per layer and mask epoch), and
its views of held biases and norm scales are made in forward pre-hooks; the block compiles
with graph breaks there (`fullgraph=False`, see `needs_graph_breaks`).
"""

from __future__ import annotations

import torch
from torch import nn

from sdp.models import blocks

# Dynamo keeps one cache of compiled graphs per code object: every block of a family shares
# one (`BasicBlock.forward`), and each block that differs in shape or structure (ResNet's
# stages, forward masking's widths, a new subnetwork after a resample) is one more entry.
# Past torch's default of 8, dynamo stops compiling that code (under fullgraph: an error).
# Automatic dynamic shapes turn a dimension symbolic once it has changed, so resamples add
# no entry after the first; tests/test_compile.py counts them.
RECOMPILE_LIMIT = 64


def apply_compile(model: nn.Module, *, family: str, fullgraph: bool = True, backend: str = "inductor") -> int:
    """Compile the forward of every block of `model` in place; returns how many were compiled."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # Dynamo's DDP optimizer splits a graph compiled inside DDP's forward at bucket boundaries,
    # so that one huge graph does not hold back every all-reduce. Compiled per block there is no
    # such graph: each block's gradients are ready when its own backward ends. (The splitting
    # also refuses bucket_cap_mb below DDP's 1 MiB first bucket.)
    torch._dynamo.config.optimize_ddp = False
    found = blocks(model, family=family)
    for _, block in found:
        block.forward = torch.compile(block.forward, fullgraph=fullgraph, backend=backend)
    return len(found)


def needs_graph_breaks(model: nn.Module, *, family: str) -> bool:
    """Whether a module inside some block has forward pre-hooks or a forward of its own instance
    (backward masking's held ranges: see sdp.subnet.held), which the block's graph breaks at."""
    return any(
        m._forward_pre_hooks or "forward" in vars(m)
        for _, block in blocks(model, family=family)
        for m in block.modules()
        if m is not block
    )
