"""A NaN/Inf loss or gradient is caught after the gradient sync and before the update, in
one process (the multi-process stop/skip/resume path is in test_faults.py)."""

import dataclasses
import itertools

import pytest
import torch
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.parallel import DDPStrategy, ParallelConfig
from sdp.trainer import NonFiniteStep, PhaseTimer, TrainerConfig, train_step

CPU = torch.device("cpu")


def _setup():
    torch.manual_seed(0)
    strategy = DDPStrategy(nn.Linear(6, 3), ParallelConfig(), device=CPU, comm=CommCounter())
    optimizer = torch.optim.AdamW(strategy.trainable(), lr=1e-2)
    return strategy, optimizer


def _batches(poison: float | None = None):
    inputs = torch.randn(4, 6)
    if poison is not None:
        inputs[1, 2] = poison
    return itertools.repeat({"inputs": inputs, "targets": torch.tensor([0, 1, 2, 0])})


def _step(strategy, optimizer, batches, **cfg):
    cfg = dataclasses.replace(TrainerConfig(global_batch_size=4), **cfg)
    return train_step(strategy, optimizer, batches, cfg=cfg, micro=4, device=CPU, timer=PhaseTimer(CPU))


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])  # the clipping norm, or each gradient's own check
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_nonfinite_step_is_caught_before_the_update(group, grad_clip, poison):
    strategy, optimizer = _setup()
    _step(strategy, optimizer, _batches(), grad_clip=grad_clip)  # one good step: optimizer state exists
    before = [p.detach().clone() for p in strategy.trainable()]
    state = {k: v.clone() for k, v in optimizer.state[next(iter(strategy.trainable()))].items()}
    with pytest.raises(NonFiniteStep) as info:
        _step(strategy, optimizer, _batches(poison), grad_clip=grad_clip)
    assert all(torch.equal(a, b) for a, b in zip(before, strategy.trainable(), strict=True))
    after = optimizer.state[next(iter(strategy.trainable()))]
    assert all(torch.equal(state[k], after[k]) for k in state)
    (rank,) = info.value.diagnostic["ranks"]
    assert rank["nonfinite_loss"] and rank["nonfinite_grads"] == ["module.weight", "module.bias"]


def test_without_the_check_the_update_poisons_the_weights(group):
    strategy, optimizer = _setup()
    _step(strategy, optimizer, _batches(float("nan")), grad_clip=0.0, on_nonfinite="off")
    assert not torch.isfinite(next(iter(strategy.trainable()))).all()
