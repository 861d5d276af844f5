"""model.loss=chunked: the LM head and cross-entropy over a few tokens at a time equal the full-size
loss, and no logits tensor of every token exists (in one process; under DDP, FSDP and every SDP
masking mode, after the gradient sync, in test_subnet_dist.py and test_parallel.py)."""

import dataclasses

import pytest
import torch
from conftest import BF16_GRAD_REL, BF16_LOSS_REL, tiny_model_cfg
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sdp.metrics.memory import LivePeak
from sdp.models import build_model
from sdp.models.loss import chunked_cross_entropy
from sdp.run.trainer import forward_loss

VOCAB = 4096  # the tiny LLaMA's
TOKENS = 4 * 64
HIDDEN = 128


def _batch(seed: int = 0) -> dict:
    tokens = torch.randint(0, VOCAB, (4, 65), generator=torch.Generator().manual_seed(seed))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _model(loss: str, chunk: int = 1024):
    torch.manual_seed(0)
    return build_model(dataclasses.replace(tiny_model_cfg("llama"), loss=loss, loss_chunk_tokens=chunk)).train()


def _step(loss: str, chunk: int = 1024, dtype: torch.dtype | None = None, batch: dict | None = None):
    model = _model(loss, chunk)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        value, correct = forward_loss(model, batch or _batch(), in_model=True)
    value.backward()
    assert correct is None  # counted only without gradients (evaluation)
    return value.detach(), {n: p.grad for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("chunk", [16, 24, TOKENS])  # divides the 256 tokens, does not, one chunk
def test_chunked_loss_and_gradients_equal_full_in_fp32(chunk):
    loss_full, grads_full = _step("full")
    loss, grads = _step("chunked", chunk)
    assert abs(loss - loss_full) <= 1e-5 * loss_full
    assert grads.keys() == grads_full.keys()
    for name in grads:
        assert _rel(grads[name], grads_full[name]) <= 1e-5, name


def test_full_loss_in_the_model_is_the_trainer_loss_of_its_logits_bit_for_bit():
    loss, grads = _step("full")
    model = _model("full")
    reference, _ = forward_loss(model, _batch())  # the logits path: CE of model(inputs).logits
    reference.backward()
    assert torch.equal(loss, reference.detach())
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())


@pytest.mark.parametrize("chunk", [32, 100])
def test_chunked_loss_in_bf16(chunk):
    """The loss and every gradient equal full's to bf16's resolution (tests/conftest.py), not 1e-5:
    below the LM head they are the same bf16 products row by row, but a CPU's kernels may sum them
    in another order at each chunk size (oneDNN's AMX does). The head's weight gradient sums over
    tokens: full rounds that sum to bf16 once, chunked once per chunk, on any kernel; both stay as
    close to the fp32 gradient (within 1.5x of full's error)."""
    loss_full, grads_full = _step("full", dtype=torch.bfloat16)
    loss, grads = _step("chunked", chunk, dtype=torch.bfloat16)
    assert abs(loss - loss_full) <= BF16_LOSS_REL * loss_full
    for name in grads:
        assert _rel(grads[name], grads_full[name]) <= BF16_GRAD_REL, name
    _, fp32 = _step("full")
    exact = fp32["lm_head.weight"]

    def error(g: torch.Tensor) -> float:
        return ((g - exact).norm() / exact.norm()).item()

    assert error(grads["lm_head.weight"]) <= 1.5 * error(grads_full["lm_head.weight"])
    assert 1e-4 < error(grads_full["lm_head.weight"]) < 2**-6  # bf16's rounding, not a bug's


class _LargestLogits(TorchDispatchMode):
    """The largest float tensor with a vocabulary-sized last dim that any op makes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() and t.shape[-1] == VOCAB:
                if t.numel() != VOCAB * HIDDEN:  # the head's weight, its transpose and its gradient
                    self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("loss,chunk", [("full", 1024), ("chunked", 16)])
def test_no_logits_of_every_token_exist_in_forward_or_backward(loss, chunk):
    model = _model(loss, chunk)
    with _LargestLogits() as seen:
        value, _ = forward_loss(model, _batch(), in_model=True)
        value.backward()
    if loss == "full":
        assert seen.largest == TOKENS * VOCAB  # the check sees them when they are there
    else:
        assert seen.largest == chunk * VOCAB


def test_evaluation_counts_the_same_correct_predictions():
    batch = _batch(1)
    results = []
    for loss, chunk in (("full", 1024), ("chunked", 24)):
        model = _model(loss, chunk).eval()
        with torch.no_grad():
            results.append(forward_loss(model, batch, in_model=True))
        with torch.no_grad():
            logits = model(batch["inputs"]).logits  # without targets: transformers' output, as before
        assert int(results[-1][1]) == int((logits.argmax(-1) == batch["targets"]).sum())
    (loss_full, correct_full), (loss_chunked, correct_chunked) = results
    assert abs(loss_chunked - loss_full) <= 1e-5 * loss_full
    assert int(correct_chunked) == int(correct_full)


def _loss_peak(chunk: int | None) -> int:
    """The live peak of the LM head and loss alone, forward and backward, over 256 tokens."""
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    with LivePeak(head, torch.optim.SGD(head.parameters(), lr=0.0)) as peak:
        if chunk is None:
            value = torch.nn.functional.cross_entropy(head(hidden).float(), targets)
        else:
            value, _ = chunked_cross_entropy(head, hidden, targets, chunk=chunk)
        value.backward()
    return peak.breakdown()["total"]


def test_chunked_loss_keeps_one_chunk_of_logits_alive():
    """The full-size loss holds two fp32 tensors of every token's logits at its peak (the
    softmax kept for the backward and its gradient); chunked, one chunk's logits are made
    again in the backward instead of kept from the forward. What it adds instead is a chunk's
    partial weight gradient, summed into the head's: the size of the weight, which here (256
    tokens, hidden size 128) is as large as the logits; at llama_1b's 8192 tokens a rank and
    hidden size 2048 it is a quarter of them. Without the checkpoint, every chunk's softmax
    would stay alive until the backward (12.2 MB here, against 8.7 with it and 14.7 full)."""
    logits = 4 * TOKENS * VOCAB
    full, chunked = _loss_peak(None), _loss_peak(16)
    assert full >= 2 * logits
    assert chunked <= full - logits
