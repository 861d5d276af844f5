"""Activation checkpointing per block, applied from outside the model.

`parallelism.activation_checkpointing`:
- `none`;
- `full`: a block keeps only its input; everything inside is recomputed in the backward;
- `selective`: inside a block, the outputs of the expensive operations (matrix
  products, attention, convolutions) are kept and only the cheap ones (norms,
  activations, elementwise arithmetic) are recomputed.

Blocks are the family's decoder layers / BasicBlocks / Swin blocks, the same
modules block-level SDP treats as units. torch's composable `checkpoint` is a
pair of module hooks: parameter names do not change, so unit specs, state
dicts and checkpoints are the same with and without it. Under SDP it is
applied to each rank's subnetwork (a block forward masking dropped is a skip
module, with nothing to checkpoint), and again after every mask resample.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils import checkpoint as _torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from sdp.models import blocks

_aten = torch.ops.aten
# Operations whose outputs selective checkpointing keeps.
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}


# FSDP2 (torch >= 2.13) casts a block's inputs to its mixed-precision dtype again when the
# backward recomputes the block, under a profiler range (`record_function`) that the original
# forward ran outside the checkpointed region. Selective checkpointing replays the region's
# operations one for one and stops at the range it never saw ("encountered during backward but
# not found in storage"): profiler ranges are markers, not computation, so it skips them, as it
# skips `detach`.
_torch_checkpoint.SAC_IGNORED_OPS.update(
    {
        torch.ops.profiler._record_function_enter.default,
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    }
)


def _keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_expensive)


def apply_activation_checkpointing(model: nn.Module, *, family: str, mode: str) -> int:
    """Checkpoint every block of `model` in place; returns how many blocks were wrapped."""
    if mode == "none":
        return 0
    found = blocks(model, family=family)
    for _, block in found:
        if mode == "full":
            checkpoint(block)
        else:
            checkpoint(block, context_fn=_selective_contexts)
    return len(found)
