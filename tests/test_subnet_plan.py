"""SDP's plan without a process group, and the plan against what the strategy installs."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed
from conftest import job_env, tiny_model_cfg
from ranks import run_ranks

from sdp import dist
from sdp.errors import ConfigError
from sdp.metrics.comm import CommCounter
from sdp.models import build_model, build_on_meta
from sdp.parallel import ParallelConfig
from sdp.subnet import MaskingConfig
from sdp.subnet.plan import SubnetPlan, planned_comm_groups, validate_plan
from sdp.subnet.sharded import ShardedSDPStrategy
from sdp.subnet.strategy import SDPStrategy
from sdp.train import main

CPU = torch.device("cpu")
K = 4
# Cyclic, K = 4, r = 2: worker k holds chunks k and k + 1 of every group.
WINDOWS = [(0, 1), (0, 3), (1, 2), (2, 3)]


def plan_of(family: str, masking: MaskingConfig, *, workers: int = K) -> SubnetPlan:
    return SubnetPlan.build(build_on_meta(tiny_model_cfg(family)), masking, family=family, workers=workers)


def installed(family: str, masking: MaskingConfig, rank: int, plan: SubnetPlan | None) -> SDPStrategy:
    """The strategy rank `rank` of K builds (a fake process group: no collective moves data)."""
    cfg = tiny_model_cfg(family)
    with dist.fake_process_group(rank, K):
        torch.manual_seed(0)
        return SDPStrategy(
            build_model(cfg),
            masking,
            family=family,
            rank=rank,
            world_size=K,
            device=CPU,
            comm=CommCounter(),
            bucket_cap_mb=1,
            make_plain=lambda: build_model(cfg),
            plan=plan,
        )


def test_the_plan_of_a_tiny_model_needs_no_process_group():
    plan = plan_of("llama", MaskingConfig(name="forward", coverage=0.5))
    assert not torch.distributed.is_initialized()
    assert plan.mask.holders == 2 and plan.mask.holder_sets() == WINDOWS
    # Every rank: the world, and the groups of the two windows it is in.
    assert plan.comm_groups() == [3, 3, 3, 3]
    assert plan.full_params == sum(s.numel() for s in plan.shapes.values()) > plan.shared_params > 0
    assert [plan.worker_of(r) for r in range(K)] == [0, 1, 2, 3]
    # Units: 4 decoder layers, each an MLP (neurons) and an attention (heads) group.
    assert [g.kind for g in plan.spec.groups] == ["ffn", "heads"] * 4
    assert plan.block_paths == tuple(f"model.layers.{i}" for i in range(4))
    assert plan.block_of["model.layers.1.mlp.up_proj.weight"] == 1 and plan.block_of["lm_head.weight"] == -1
    # The stats summary.json reports, and a later epoch's mask, which keeps r holders.
    assert plan.stats["holders_min"] == plan.stats["holders_max"] == 2
    assert plan.mask_at(0) is plan.mask and plan.mask_at(1).holders == 2


def test_sdp_x_fsdp_plan_is_what_the_sharded_strategy_installs():
    # K = 2 workers of F = 2 ranks, C = 0.5 (r = 1): a unit's shard needs no group, but the
    # BatchNorm weights of held channels are replicated on the worker's ranks and averaged
    # over both; with the world and the mesh's two groups, 4 per rank.
    masking, parallel = MaskingConfig(name="forward", coverage=0.5), ParallelConfig(name="fsdp", fsdp_degree=2)
    cfg = tiny_model_cfg("resnet")
    plan = SubnetPlan.build(build_on_meta(cfg), masking, family="resnet", workers=2, fsdp_degree=2)
    assert [plan.worker_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert plan.replicated and all(plan.shard_dims[n] is None for n in plan.replicated)
    assert plan.comm_groups() == [4, 4, 4, 4]
    assert planned_comm_groups(build_on_meta(cfg), masking, family="resnet", workers=2, fsdp_degree=2) == [4] * 4
    for rank in range(4):
        with dist.fake_process_group(rank, 4):
            sdp = ShardedSDPStrategy(
                build_model(cfg),
                masking,
                family="resnet",
                rank=rank,
                world_size=4,
                parallel=parallel,
                device=CPU,
                comm=CommCounter(),
                bucket_cap_mb=1,
                make_plain=lambda: build_model(cfg),
                plan=plan,
            )
            assert sdp.comm_groups() == plan.comm_groups()[rank] and sdp.worker == plan.worker_of(rank)
            assert sdp.describe()["replicated_params"] == sum(plan.shapes[n].numel() for n in plan.replicated)


def test_resampling_a_random_mask_adds_holder_sets():
    # K = 8, r = 2, 4 blocks: an epoch uses 4 holder sets; a rank can be in 7 pairs.
    masking = MaskingConfig(name="forward", granularity="block", coverage=0.25, construction="random", resample_every=1)
    plan = plan_of("llama", masking, workers=8)
    once, over_run = max(plan.comm_groups()), max(plan.comm_groups(steps=50))
    assert once <= 1 + 4 < over_run <= 1 + 7
    cyclic = plan_of("llama", dataclasses.replace(masking, construction="cyclic"), workers=8)
    assert cyclic.comm_groups(steps=50) == cyclic.comm_groups()  # only the chunks move


@pytest.mark.parametrize("family", ["llama", "resnet"])
@pytest.mark.parametrize(
    "name,granularity,capacity",
    [("forward", "neuron", None), ("backward", "block", None), ("forward", "neuron", [1, 1, 0.5, 0.5])],
)
def test_the_plan_is_what_the_strategy_installs(family, name, granularity, capacity):
    masking = MaskingConfig(name=name, granularity=granularity, coverage=0.5, capacity=capacity)
    plan = plan_of(family, masking)
    holder_sets = set()
    for rank in range(K):
        sdp = installed(family, masking, rank, plan)
        assert sdp.plan is plan and sdp.mask is plan.mask
        assert sdp.comm_groups() == plan.comm_groups()[rank]
        units = {e.holders for e in sdp.subnet.grad_entries if e.kind == "grad_sync"}
        assert all(rank in hs for hs in units)
        holder_sets |= units
        # The tensors it trains: the shared ones and its held units, predicted from the plan alone.
        held = sum(
            plan.mask.held_units(rank, g).size * group.unit_numel(plan.shapes)
            for g, group in enumerate(plan.spec.groups)
        )
        assert sum(p.numel() for p in sdp.trainable()) == plan.shared_params + held
        # Without a plan handed over, the strategy makes the same one from the real model.
        own = installed(family, masking, rank, None).plan
        assert own.shapes == plan.shapes and own.block_paths == plan.block_paths
        assert (own.mask.matrix() == plan.mask.matrix()).all() and own.comm_groups() == plan.comm_groups()
    assert holder_sets == set(plan.mask.holder_sets())


def test_validate_plan_returns_the_plan_it_checked():
    masking = MaskingConfig(name="forward", coverage=0.5)
    plan = validate_plan(tiny_model_cfg("llama"), masking, world_size=K, parallel=ParallelConfig(), steps=10)
    assert isinstance(plan, SubnetPlan) and plan.workers == K and plan.fsdp_degree == 1
    assert plan.mask.holder_sets() == WINDOWS
    sharded = ParallelConfig(name="fsdp", fsdp_degree=2)
    assert validate_plan(tiny_model_cfg("llama"), masking, world_size=2, parallel=sharded).fsdp_degree == 2
    with pytest.raises(ConfigError, match="parallelism.max_comm_groups=2"):
        validate_plan(tiny_model_cfg("llama"), masking, world_size=K, parallel=ParallelConfig(max_comm_groups=2))
    blocks = MaskingConfig(name="forward", granularity="block", coverage=0.125)
    with pytest.raises(ConfigError, match="no block"):  # K = 8 workers, 4 blocks of r = 1 holder
        plan_of("llama", blocks, workers=8).check(ParallelConfig())


def test_a_plan_of_another_run_is_refused():
    plan = plan_of("llama", MaskingConfig(name="forward", coverage=0.5))
    with pytest.raises(ValueError, match="is not this strategy's"):
        installed("llama", MaskingConfig(name="forward", coverage=1.0), 0, plan)


def count_plans(argv: list[str]) -> int:
    """One forked rank (tests/ranks.py) of the run below: `sdp.train.main(argv)` with every
    plan built and every plan a strategy was handed counted, into ./plans_RANK.json."""
    built, handed = [], []
    real_build, real_init = SubnetPlan.build.__func__, SDPStrategy.__init__

    def build(cls, *args, **kwargs):
        built.append(real_build(cls, *args, **kwargs))
        return built[-1]

    def init(self, *args, plan=None, **kwargs):
        handed.append(plan)
        real_init(self, *args, plan=plan, **kwargs)

    SubnetPlan.build, SDPStrategy.__init__ = classmethod(build), init
    code = main(argv)
    same = [any(p is b for b in built) for p in handed]
    Path(f"plans_{os.environ['RANK']}.json").write_text(json.dumps({"built": len(built), "handed": same}))
    return code


@pytest.mark.dist
def test_a_run_builds_its_plan_once_and_hands_it_to_the_strategy(tmp_path):
    """The preflight's checks build the plan (the model on the meta device, the mask, the holder
    sets); the run hands that plan to the strategy instead of building it again."""
    argv = ["model=llama_tiny", "dataset=synthetic_text", "masking=backward", "masking.coverage=0.5"]
    argv += ["trainer.max_steps=2", "trainer.global_batch_size=4", "logger=none", "trainer.progress=false"]
    argv += ["trainer.save_model=false", "trainer.export=none", "trainer.eval_every=0", f"run_dir={tmp_path / 'run'}"]
    proc = run_ranks("test_subnet_plan:count_plans", argv, nproc=2, cwd=tmp_path, env=job_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert json.loads((tmp_path / f"plans_{rank}.json").read_text()) == {"built": 1, "handed": [True]}


def test_the_capacity_list_is_checked_once_per_plan_and_not_per_mask_epoch(monkeypatch):
    import sdp.subnet.plan

    calls = []
    monkeypatch.setattr(sdp.subnet.plan, "check_length", lambda capacity, **kw: calls.append(kw))
    masking = MaskingConfig(name="forward", coverage=0.75, capacity=[1.0, 0.5], resample_every=2)
    plan = plan_of("resnet", masking, workers=2)
    plan.mask_at(1), plan.mask_at(2)
    assert calls == [{"workers": 2, "fsdp_degree": 1}]  # it ran twice per build, and once per new epoch
