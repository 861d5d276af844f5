"""A NaN/Inf loss or gradient is caught after the gradient sync and before the update, in
one process (the multi-process stop/skip/resume path is in test_faults.py)."""

import dataclasses
import itertools

import pytest
import torch
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.optim import OptimConfig, build_optimizer
from sdp.parallel import ParallelConfig
from sdp.parallel.ddp import DDPStrategy
from sdp.run.measure import PhaseTimer
from sdp.run.nonfinite import NonFiniteGuard, NonFiniteStep, skips_on_device
from sdp.run.trainer import train_step
from sdp.run.trainer_config import TrainerConfig

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


# The device-side guard: a fused optimizer skips a non-finite update through its found_inf, and
# the verdict is read at the next report (a log step), not in the step.


def _fused_setup(name: str = "adamw"):
    torch.manual_seed(0)
    strategy = DDPStrategy(nn.Linear(6, 3), ParallelConfig(), device=CPU, comm=CommCounter())
    cfg = OptimConfig(name=name, lr=1e-2, implementation="fused")
    optimizer = build_optimizer(strategy.trainable(), cfg, device=CPU)
    assert skips_on_device(optimizer)
    return strategy, optimizer


def _run(strategy, optimizer, guard, poisons, *, grad_clip=1.0):
    """One step per entry of `poisons` (None: a clean batch), batches drawn from one stream."""
    torch.manual_seed(1)
    for poison in poisons:
        inputs = torch.randn(4, 6)
        if poison is not None:
            inputs[1, 2] = poison
        batch = itertools.repeat({"inputs": inputs, "targets": torch.tensor([0, 1, 2, 0])})
        cfg = dataclasses.replace(TrainerConfig(global_batch_size=4), grad_clip=grad_clip)
        train_step(strategy, optimizer, batch, cfg=cfg, micro=4, device=CPU, timer=PhaseTimer(CPU), guard=guard)


def _params(strategy):
    return [p.detach().clone() for p in strategy.trainable()]


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_stop_latches_every_update_off_from_the_first_nonfinite_step(group, grad_clip):
    # Steps 1-2 clean, step 3 NaN, steps 4-5 clean, read at step 5 (a log step): the parameters
    # and optimizer state are those after step 2, as if the run had stopped at step 3.
    strategy, optimizer = _fused_setup()
    guard = NonFiniteGuard("stop", max_skips=10, device=CPU)
    _run(strategy, optimizer, guard, [None, None], grad_clip=grad_clip)
    before, state = _params(strategy), {k: v.clone() for k, v in optimizer.state[strategy.trainable()[0]].items()}
    _run(strategy, optimizer, guard, [float("nan"), None, None], grad_clip=grad_clip)
    assert all(torch.equal(a, b) for a, b in zip(before, strategy.trainable(), strict=True))
    after = optimizer.state[strategy.trainable()[0]]
    assert all(torch.equal(state[k], after[k]) for k in state)  # the step count too
    ((step, bad),) = guard.report()
    assert step == 3
    (rank,) = bad.diagnostic["ranks"]
    assert rank["nonfinite_loss"] and rank["nonfinite_grads"] == ["module.weight", "module.bias"]
    assert guard.report() == []  # each verdict is reported once


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_skip_drops_only_the_nonfinite_updates(group, name):
    # Clean, NaN, clean, Inf, clean under skip: the same bits as the three clean steps alone.
    strategy, optimizer = _fused_setup(name)
    guard = NonFiniteGuard("skip", max_skips=10, device=CPU)
    _run(strategy, optimizer, guard, [None, float("nan"), None, float("inf"), None])
    reference, ref_optimizer = _fused_setup(name)
    torch.manual_seed(1)
    clean = []
    for poison in [None, float("nan"), None, float("inf"), None]:  # the same batches, poisoned ones left out
        inputs = torch.randn(4, 6)
        if poison is None:
            clean.append(inputs)
    for inputs in clean:
        batch = itertools.repeat({"inputs": inputs, "targets": torch.tensor([0, 1, 2, 0])})
        cfg = TrainerConfig(global_batch_size=4)
        train_step(reference, ref_optimizer, batch, cfg=cfg, micro=4, device=CPU, timer=PhaseTimer(CPU))
    assert all(torch.equal(a, b) for a, b in zip(reference.trainable(), strategy.trainable(), strict=True))
    assert [step for step, _ in guard.report()] == [2, 4]


def test_skip_past_its_limit_latches_the_rest_off(group):
    # max_nonfinite_skips=1: step 2 is skipped, step 3 is the second non-finite one, so step 4
    # (clean) is not applied either: the run stops with the parameters after step 1.
    strategy, optimizer = _fused_setup()
    guard = NonFiniteGuard("skip", max_skips=1, device=CPU)
    _run(strategy, optimizer, guard, [None])
    before = _params(strategy)
    _run(strategy, optimizer, guard, [float("nan"), float("nan"), None])
    assert all(torch.equal(a, b) for a, b in zip(before, strategy.trainable(), strict=True))
    assert [step for step, _ in guard.report()] == [2, 3]


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_optimizer_equals_the_default_one_within_float_rounding(group, name):
    # 5 steps of the tiny linear model: fused against torch's default CPU implementation (the
    # for-loop one): the same update, computed in another order (measured: <= 2e-7 relative).
    runs = []
    for implementation in ("fused", "auto"):
        torch.manual_seed(0)
        strategy = DDPStrategy(nn.Linear(6, 3), ParallelConfig(), device=CPU, comm=CommCounter())
        cfg = OptimConfig(name=name, lr=1e-2, weight_decay=0.1, implementation=implementation)
        optimizer = build_optimizer(strategy.trainable(), cfg, device=CPU)
        assert skips_on_device(optimizer) == (implementation == "fused")
        _run(strategy, optimizer, None, [None] * 5)
        runs.append(_params(strategy))
    for fused, default in zip(*runs, strict=True):
        torch.testing.assert_close(fused, default, rtol=1e-6, atol=1e-7)


def test_the_step_clock_leaves_untimed_steps_out():
    import time

    from sdp.run.measure import StepClock

    clock = StepClock(CPU)
    for timed, seconds in ((False, 0.2), (True, 0.01), (True, 0.01), (False, 0.2), (True, 0.01)):
        clock.begin(timed=timed)
        time.sleep(seconds)
        clock.end(timed=timed)
    clock.stop()  # a log step
    assert clock.steps == 3
    assert 0.03 <= clock.seconds < 0.15  # the timed steps' 30 ms (and the loop's own), not the 400 ms
