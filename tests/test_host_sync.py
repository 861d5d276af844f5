"""A steady-state training step reads nothing back to the host: with a fused optimizer the
NaN/Inf guard decides on the device, so no step of DDP or any SDP variant calls
`aten._local_scalar_dense` (what `.item()`, `.tolist()`, `float(t)` and `if t:` dispatch to: on
CUDA, each one is a host-device synchronisation). Every variant trains dense tensors, so CUDA
gives every one the fused optimizer; a run whose optimizer is not fused takes the host's check,
one read a step."""

import dataclasses
import itertools

import pytest
import torch
from conftest import LLAMA_VARIANTS, ONE_RANK_LLAMA, TINY_MODELS
from torch.utils._python_dispatch import TorchDispatchMode

from sdp import dist
from sdp.errors import ConfigError
from sdp.metrics.comm import CommCounter
from sdp.optim import (
    OptimConfig,
    build_optimizer,
    build_scheduler,
    hyperparameters,
    is_dense,
    load_schedule,
    rebind,
    regrouped,
)
from sdp.planning.estimator import dummy_batch
from sdp.run.build import build_strategy
from sdp.run.config import load_config
from sdp.run.measure import PhaseTimer
from sdp.run.nonfinite import NonFiniteGuard
from sdp.run.trainer import train_step
from sdp.run.trainer_config import micro_batch_size

CPU = torch.device("cpu")
BASE, VARIANTS = ONE_RANK_LLAMA, LLAMA_VARIANTS
LOAD = {"offline": True, "check_data": False}


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _host_reads(overrides: list[str], *, on_device: bool = True) -> int:
    """Host reads in steps 2-3 of rank 1 of 2 (played in this process), fused AdamW, clipping and
    the NaN/Inf guard on: on the device, or (`on_device=False`) the host's check."""
    cfg = load_config([*BASE, *overrides, "optim.implementation=fused"], world_size=2, offline=True, check_data=False)
    micro = micro_batch_size(cfg.trainer, world_size=2)
    with dist.fake_process_group(1, 2):
        strategy = build_strategy(
            cfg, world=dist.World(rank=1, local_rank=0, world_size=2), device=CPU, comm=CommCounter()
        )
        optimizer = build_optimizer(strategy.trainable(), cfg.optim, device=CPU)
        guard = NonFiniteGuard("stop", max_skips=0, device=CPU) if on_device else None
        batches = itertools.repeat(dummy_batch(cfg, micro))
        trainer = dataclasses.replace(cfg.trainer, on_nonfinite="stop")

        def step():
            train_step(
                strategy, optimizer, batches, cfg=trainer, micro=micro, device=CPU, timer=PhaseTimer(CPU), guard=guard
            )

        step()  # the first step makes the optimizer state
        with _HostReads() as reads:
            step()
            step()
    return reads.count


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_step_with_a_fused_optimizer_reads_nothing_back(variant):
    assert _host_reads(VARIANTS[variant]) == 0


def test_the_host_check_reads_once_a_step():
    assert _host_reads(VARIANTS["DDP"], on_device=False) == 2  # the count sees reads where they are


def test_causal_attention_without_a_mask_is_transformers_sdpa_bit_for_bit():
    from conftest import tiny_model_cfg

    from sdp.models import build_model

    torch.manual_seed(0)
    model = build_model(tiny_model_cfg("llama"))
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1))
    ours = model(tokens).logits
    model.config._attn_implementation = "sdpa"  # transformers' own, which builds its mask first
    assert torch.equal(ours, model(tokens).logits)


@pytest.mark.parametrize("family", TINY_MODELS)
@pytest.mark.parametrize("mode", ["backward", "forward"])
@pytest.mark.parametrize("granularity", ["neuron", "block"])
def test_every_variant_trains_dense_tensors_and_gets_the_fused_optimizer_on_cuda(family, mode, granularity):
    # Seen on an H200 (torch 2.11): N-SDP backward with the fused AdamW failed its first step,
    # "params, grads, exp_avgs, and exp_avg_sqs must have same dtype, device, and layout": it
    # trained views of o_proj's and down_proj's columns. Every tensor a worker trains is dense now
    # (a weight cut along its columns keeps them outermost), and every piece it averages packs
    # as one contiguous block. Every rank of K = 4, C = 0.5 (ranks hold different runs).
    model, dataset = TINY_MODELS[family]
    line = [f"model={model}", f"dataset={dataset}", "trainer.global_batch_size=8", f"masking={mode}"]
    cfg = load_config([*line, f"masking.granularity={granularity}", "masking.coverage=0.5"], world_size=4, **LOAD)
    cuda = torch.device("cuda")  # AdamW(fused=True) is built on CPU tensors too: no GPU needed
    for rank in range(4):
        with dist.fake_process_group(rank, 4):
            strategy = build_strategy(cfg, world=dist.World(rank, 0, 4), device=CPU, comm=CommCounter())
            trained = strategy.trainable()
            assert all(is_dense(p) for p in trained)
            assert all(e.piece.wire().is_contiguous() for e in strategy.sync.entries)
            optimizer = build_optimizer(trained, OptimConfig(), device=cuda)
            assert optimizer.defaults["fused"]
            for p in trained:  # the CPU's fused kernel takes them too, and their state keeps their layout
                p.grad = torch.ones_like(p)
            optimizer.step()
            assert all(optimizer.state[p]["exp_avg"].stride() == p.stride() for p in trained)


def test_an_explicit_fused_optimizer_refuses_a_tensor_that_is_not_dense():
    w = torch.zeros(4, 6)
    assert [is_dense(t) for t in (w, w.t(), w.narrow(0, 1, 2), w.narrow(1, 0, 3), w.narrow(1, 0, 1))] == [
        True,
        True,
        True,
        False,
        False,
    ]
    columns = [torch.nn.Parameter(w.narrow(1, 0, 3)), torch.nn.Parameter(torch.zeros(3))]
    cuda = torch.device("cuda")
    assert not build_optimizer(columns, OptimConfig(), device=cuda).defaults["fused"]  # auto: torch's default
    assert build_optimizer(columns, OptimConfig(), device=CPU).defaults["fused"] is None
    with pytest.raises(ConfigError) as refused:
        build_optimizer(columns, OptimConfig(implementation="fused"), device=cuda)
    assert str(refused.value) == (
        "optim.implementation='fused': CUDA's fused kernels take dense tensors only, and this run trains a "
        "strided view (some columns of a matrix): use optim.implementation=auto or foreach"
    )


def test_dtensors_beside_plain_tensors_are_two_groups_each_in_one_call():
    # Neuron SDP x FSDP of a ResNet or Swin trains FSDP's sharded weights (DTensors) beside its
    # replicated biases and norms: in one call CUDA's fused AdamW and torch's foreach both stop at
    # the first step, "aten._fused_adamw_.default got mixed torch.Tensor and DTensor". Two
    # parameter groups, the same settings, each takes its fast path.
    from torch.distributed.tensor import Replicate, distribute_tensor

    with dist.fake_process_group(0, 2):
        mesh = dist.device_mesh("cpu", (2,), ("shard",))
        sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Replicate()]))
        plain = torch.nn.Parameter(torch.ones(3))
        cuda = torch.device("cuda")
        for implementation, kind in (("auto", "fused"), ("fused", "fused"), ("foreach", "foreach")):
            optimizer = build_optimizer([sharded, plain], OptimConfig(implementation=implementation), device=cuda)
            assert [g["params"] for g in optimizer.param_groups] == [[sharded], [plain]]
            assert all(g[kind] for g in optimizer.param_groups)
            sharded.grad, plain.grad = torch.ones_like(sharded), torch.ones_like(plain)
            if kind == "fused":
                optimizer.found_inf = torch.zeros(())  # as the device guard hands it over
            optimizer.step()  # each group in one call (the CPU's fused kernel takes both kinds of group)
        # A resample points the groups at new tensors, each kind to its own.
        other, bias = (
            torch.nn.Parameter(distribute_tensor(torch.ones(2, 3), mesh, [Replicate()])),
            torch.nn.Parameter(torch.ones(2)),
        )
        rebind(optimizer, [bias, other], {})
        assert [g["params"] for g in optimizer.param_groups] == [[other], [bias]]


def test_a_saved_optimizer_of_one_group_resumes_into_two_and_back():
    # A checkpoint's settings and its lr schedule, saved with one group (every run before the split,
    # or plain SDP), fit an optimizer of two (SDP x FSDP), and two alike fit one; unlike ones refuse.
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    one = build_optimizer(params, OptimConfig())
    two = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1e-3)
    saved = hyperparameters(one)
    assert regrouped(saved, 2) == [saved[0], saved[0]] and regrouped(saved * 2, 1) == saved
    with pytest.raises(ValueError, match="the saved optimizer has 2 parameter groups, this one 1"):
        regrouped([saved[0], {**saved[0], "lr": 1.0}], 1)
    schedule = build_scheduler(one, OptimConfig(warmup_steps=2), max_steps=10)
    one.step(), schedule.step()
    widened = build_scheduler(two, OptimConfig(warmup_steps=2), max_steps=10)
    load_schedule(widened, schedule.state_dict())
    widened.step()
    schedule.step()
    assert [g["lr"] for g in two.param_groups] == [one.param_groups[0]["lr"]] * 2  # both groups follow
