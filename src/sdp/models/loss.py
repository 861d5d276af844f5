"""The language-model loss, computed chunk by chunk over tokens.

A full-size loss makes the LM head's logits for every token of the batch, then
upcasts them to fp32 for the softmax: at a 32k vocabulary and 8 x 1024 tokens
that is 1 GiB of logits and 1 GiB of their gradient, alive together in the
backward. Here the head and the cross-entropy run `chunk` tokens at a time, each
chunk under non-reentrant activation checkpointing: the forward keeps only the
chunk's hidden states (a view of the head's input), and the backward recomputes
one chunk's logits at a time. The price is the head's matrix product once more
(2 * tokens * hidden * vocab FLOPs).
"""

from __future__ import annotations

from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Loss(StrEnum):
    """model.loss: full makes every token's logits at once; chunked loss_chunk_tokens at a time."""

    full = "full"
    chunked = "chunked"


def _chunk_loss_sum(head: nn.Module, hidden_CD: torch.Tensor, targets_C: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden_CD).float(), targets_C, reduction="sum")


def chunked_cross_entropy(
    head: nn.Module, hidden_ND: torch.Tensor, targets_N: torch.Tensor, *, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean cross-entropy of `head(hidden_ND)` against `targets_N`, `chunk` tokens at a time;
    with gradients off (evaluation), also the number of tokens whose argmax is the target.

    Equal to `F.cross_entropy(head(hidden_ND).float(), targets_N)` up to fp32 summation order.
    """
    total = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
    if torch.is_grad_enabled():
        for hidden_CD, targets_C in zip(hidden_ND.split(chunk), targets_N.split(chunk), strict=True):
            total = total + checkpoint(_chunk_loss_sum, head, hidden_CD, targets_C, use_reentrant=False)
        return total / targets_N.numel(), None
    correct = torch.zeros((), dtype=torch.int64, device=hidden_ND.device)
    for hidden_CD, targets_C in zip(hidden_ND.split(chunk), targets_N.split(chunk), strict=True):
        logits_CV = head(hidden_CD).float()
        total += F.cross_entropy(logits_CV, targets_C, reduction="sum")
        correct += (logits_CV.argmax(-1) == targets_C).sum()
    return total / targets_N.numel(), correct
