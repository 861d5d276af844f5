"""Measurement: live peaks and FLOPs on real runs, and the estimator against them."""

import pytest
import torch
from conftest import estimator_config, launch, read_run

from sdp.errors import ConfigError
from sdp.estimate import main
from sdp.planning.estimator import EstimateError, estimate
from sdp.planning.options import parse_estimate as parse_args
from sdp.run.trainer import forward_loss

EMPTY_KINDS = {"weights": 0, "grads": 0, "optimizer": 0, "activations": 0, "temporaries": 0}
TINY = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=16"]
VARIANTS = {
    "ddp": ["masking=none"],
    "forward-neuron": ["masking=forward", "masking.coverage=0.5"],
    "backward-block": ["masking=backward", "masking.coverage=0.5", "masking.granularity=block"],
    # The estimator's model of DDP's buckets under no_sync, against DDP's reducer.
    "ddp-accumulation": ["masking=none", "trainer.grad_accum_steps=2"],
    # An outer loop: theta_prev and momentum on the device (in the peaks), and the peak of a sync;
    # under backward masking with capacities each rank holds its own share of them.
    "ddp-diloco": ["masking=none", "outer=diloco", "outer.sync_every=2", "outer.backup_device=device"],
    "backward-diloco": ["masking=backward", "masking.capacity=[1,0.5]", "outer=diloco", "outer.sync_every=2"],
}
OUTER_KEYS = ("outer_backup_bytes", "outer_momentum_bytes")
LARGEST_TENSOR_BYTES = 4096 * 128 * 4  # llama_tiny's embedding and head (vocabulary x width, fp32)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """One 2-process CPU run per variant: 3 steps, step 2 profiled (summary.json, whose run_dir
    names the run's folder)."""
    runs = {}
    for name, masking in VARIANTS.items():
        tmp = tmp_path_factory.mktemp(name)
        overrides = TINY + masking + ["logger=none", "trainer.max_steps=3", "dataset.eval_batches=1"]
        proc = launch([*overrides, f"run_dir={tmp / 'run'}"], cwd=tmp)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = read_run(tmp / "run")[0]
    return runs


@pytest.fixture(scope="module")
def estimates():
    return {
        name: [estimate(estimator_config(TINY + masking), world_size=2, rank=r, target="cpu") for r in range(2)]
        for name, masking in VARIANTS.items()
    }


@pytest.mark.dist
@pytest.mark.parametrize("variant", VARIANTS)
def test_estimator_equals_the_real_run_per_rank(real_runs, estimates, variant):
    real = real_runs[variant]
    for rank, est in enumerate(estimates[variant]):
        measured = real["memory_per_rank"][rank]
        for key in ("params_bytes", "grads_bytes", "optim_bytes"):
            assert est.memory[key] == measured[key], (rank, key)
        # The same step under the same tracker, on fake instead of real tensors.
        assert est.memory["peak_bytes"] == pytest.approx(measured["peak_bytes"], rel=0.10)
        if "diloco" in variant:  # the outer loop's state exactly, and the peak of its sync after step 3
            for key in OUTER_KEYS:
                assert est.memory[key] == measured[key] > 0, (rank, key)
            # gloo's worker thread drops its reference to the bucket it sent a moment after wait()
            # returns: if the outer step's first temporary (the embedding's update) comes first, the
            # bucket is still counted then. Either the estimate exactly, or one such tensor above it.
            above = measured["sync_peak_bytes"] - est.memory["sync_peak_bytes"]
            assert above in (0, LARGEST_TENSOR_BYTES), (rank, above)
    assert max(e.flops_per_step for e in estimates[variant]) == real["flops_per_step_per_rank"]
    if variant == "backward-diloco":  # capacities 1 and 0.5: rank 1 holds less of everything
        assert real["memory_per_rank"][1]["outer_backup_bytes"] < real["memory_per_rank"][0]["outer_backup_bytes"]
    by_kind = real["comm_bytes_per_step_by_kind"]
    for kind in ("grad_sync", "shared_sync"):  # steady-state traffic (the estimator runs no evaluation)
        assert max(e.comm_bytes_per_step_by_kind[kind] for e in estimates[variant]) == by_kind[kind]


@pytest.mark.dist
def test_real_runs_report_a_live_peak_split_and_flops(real_runs):
    ddp = real_runs["ddp"]
    for run in real_runs.values():
        mem = run["memory"]
        parts = {k: v for k, v in mem["peak_breakdown"].items() if k != "total"}
        assert mem["peak_bytes"] == mem["peak_breakdown"]["total"] == sum(parts.values()) > 0
        assert parts["weights"] >= mem["params_bytes"] > 0 and parts["activations"] > 0
        assert mem["cuda_max_allocated_bytes"] is None  # CPU: no allocator peak, and it says so
        assert set(run["step_time_split_s"]) == {"data", "forward", "backward", "sync", "optimizer"}
        assert sum(run["step_time_split_s"].values()) <= run["step_time_s"] * 1.01
        assert run["tokens_or_samples_per_s_per_rank"] == pytest.approx(run["tokens_or_samples_per_s"] / 2)
    # DDP keeps its gradient buckets between steps: they are live at the peak.
    assert ddp["memory"]["peak_breakdown"]["grads"] == ddp["memory"]["grads_bytes"]
    # Forward masking runs a smaller network: less activation memory and fewer FLOPs.
    fwd = real_runs["forward-neuron"]
    assert fwd["memory"]["peak_breakdown"]["activations"] < ddp["memory"]["peak_breakdown"]["activations"]
    assert fwd["flops_per_step_per_rank"] < ddp["flops_per_step_per_rank"]


def test_backward_masking_computes_fewer_weight_gradient_flops():
    ddp = estimate(estimator_config(TINY + VARIANTS["ddp"], 4), world_size=4, rank=0)
    bwd = estimate(estimator_config(TINY + ["masking=backward", "masking.coverage=0.5"], 4), world_size=4, rank=0)
    # Same forward, same activation gradients; weight gradients only for held rows/columns.
    assert bwd.flops_per_step < ddp.flops_per_step
    assert bwd.memory["peak_bytes"] < ddp.memory["peak_bytes"]


def test_the_estimate_steps_the_optimizer_the_run_builds_on_its_device():
    """On CUDA a run's AdamW is fused over dense tensors (no temporaries: every variant's, backward
    masking's held ranges too) and torch's foreach where asked for (a square root of every second
    moment at once); on the CPU it is torch's per-tensor loop (one tensor's temporaries at a
    time). The estimate steps that one."""
    temporaries, optim_bytes = {}, {}
    cases = {
        "dense": [],
        "held": ["masking=backward", "masking.coverage=0.5"],
        "foreach": ["masking=backward", "masking.coverage=0.5", "optim.implementation=foreach"],
    }
    for name, masking in cases.items():
        cfg = estimator_config(TINY + masking, 2)
        for target in ("cuda", "cpu"):
            est = estimate(cfg, world_size=2, rank=0, target=target)
            temporaries[name, target] = est.peak_segments["optimizer"]["temporaries"]
            optim_bytes[name] = est.memory["optim_bytes"]
    largest = 128 * 4096 * 4  # the embedding, fp32: the per-tensor loop makes two of its size (sqrt, then / c)
    assert temporaries["dense", "cuda"] == temporaries["held", "cuda"] == 0
    assert 2 * largest <= temporaries["dense", "cpu"] == temporaries["held", "cpu"] < 2 * largest + 1024
    # foreach: every second moment's square root alive at once, half of the state but the steps' scalars
    moments = temporaries["foreach", "cuda"]
    assert 0 <= optim_bytes["foreach"] - 2 * moments < 4 * 64


def test_the_estimators_ddp_all_reduces_the_last_micro_batch_in_full_buckets():
    cfg = estimator_config([*TINY, *VARIANTS["ddp-accumulation"], "parallelism.bucket_cap_mb=0.25"])
    est = estimate(cfg, world_size=2, rank=1)
    grads, cap = est.memory["grads_bytes"], int(0.25 * 2**20)
    buckets = [r["bytes"] for r in est.timeline if r["kind"] == "grad_sync"]
    # One all-reduce a bucket of the synchronised micro-batch (none under no_sync), every bucket
    # but the last filled to the cap, in all the gradients' bytes, as counted.
    assert sum(buckets) == est.comm_bytes_per_step_by_kind["grad_sync"] == grads
    assert len(buckets) > 2 and all(b >= cap for b in buckets[:-1]) and 0 < buckets[-1]
    # The first micro-batch's gradients live outside the buckets until the last one's are copied in.
    assert est.memory["peak_breakdown"]["grads"] == 2 * grads


def test_untraceable_step_is_one_clear_error(monkeypatch):
    import sdp.run.trainer

    def data_dependent(model, batch, **kwargs):
        torch.nonzero(batch["targets"])  # output shape depends on values: a fake tensor cannot tell
        raise AssertionError("unreachable under FakeTensorMode")

    monkeypatch.setattr(sdp.run.trainer, "forward_loss", data_dependent)
    with pytest.raises(EstimateError, match=r"cannot trace a training step of model=llama_tiny masking=none "):
        estimate(estimator_config(TINY), world_size=2, rank=1)
    monkeypatch.undo()
    # The fake process group was torn down: the next estimate starts cleanly.
    assert estimate(estimator_config(TINY), world_size=2, rank=1).memory["peak_bytes"] > 0


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["model=llama_tiny"], "world_size=None: is required"),
        (["world_size=zero"], "world_size='zero': must be an integer in [1, 65536]"),
        (["world_size=4", "rank=4"], "rank='4': allowed: an integer in [0, 3], busiest, all"),
    ],
)
def test_estimator_arguments_are_checked(argv, fragment):
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    assert fragment in str(info.value)


def test_estimator_command_rejects_bad_config_and_writes_json(tmp_path, capsys):
    assert main([*TINY, "masking.coverage=0.5", "world_size=2"]) == 2
    assert "masking.coverage=0.5" in capsys.readouterr().err
    out = tmp_path / "est.json"
    assert main([*TINY, "masking=forward", "masking.coverage=0.5", "world_size=4", "rank=all", f"out={out}"]) == 0
    import json

    per_rank = json.loads(out.read_text())
    assert [e["rank"] for e in per_rank] == [0, 1, 2, 3]
    assert "GiB" in capsys.readouterr().out


def test_the_estimator_refuses_a_worker_without_a_block(capsys):
    # It used to trace worker 4 of 8 holding none of the 4 blocks, at a reported C = 0.125.
    assert main([*TINY, "masking=forward", "masking.granularity=block", "masking.coverage=0.125", "world_size=8"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: masking.coverage=0.125: leaves worker 4 of 8 no block (the model has 4, each held by 1 of 8 "
        "workers); raise the coverage, use fewer workers or masking.granularity=neuron"
    ]


def test_live_peak_counts_each_kind_and_keeps_nothing_alive():
    import gc
    import weakref

    from sdp.metrics.memory import LivePeak
    from sdp.models import build_model

    model = build_model(estimator_config(TINY).model)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = {"inputs": torch.randint(0, 100, (2, 32)), "targets": torch.randint(0, 100, (2, 32))}

    def step(model, optimizer):
        optimizer.zero_grad(set_to_none=True)
        forward_loss(model, batch)[0].backward()
        optimizer.step()

    step(model, optimizer)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    with LivePeak(model, optimizer) as peak:
        step(model, optimizer)
    parts = peak.breakdown()
    assert parts["weights"] == param_bytes + sum(b.numel() * b.element_size() for b in model.buffers())
    assert parts["optimizer"] == 2 * param_bytes + 4 * len(list(model.parameters()))  # AdamW moments + steps
    assert parts["activations"] > 0 and parts["total"] == sum(v for k, v in parts.items() if k != "total")
    alive = weakref.ref(next(model.parameters()))
    del model, optimizer, peak
    gc.collect()
    assert alive() is None  # the tracker leaves no hook behind that would keep a model alive


def test_live_peak_keeps_each_segments_own_peak():
    from sdp.metrics.memory import LivePeak

    model = torch.nn.Linear(4, 4, bias=False)  # 64 bytes of weights
    with LivePeak(model, torch.optim.SGD(model.parameters())) as live:
        first = torch.empty(100)  # unmarked: the segment "step"
        live.mark("a")
        second = torch.empty(1000)
        live.mark("b")  # 4,000 bytes of "a" are still live: b's first level
        del second
        third = torch.empty(250)
        live.mark("c")
        del first, third
    assert live.segments() == {
        "step": {**EMPTY_KINDS, "weights": 64, "activations": 400, "total": 464},
        "a": {**EMPTY_KINDS, "weights": 64, "activations": 4400, "total": 4464},
        "b": {**EMPTY_KINDS, "weights": 64, "activations": 4400, "total": 4464},
        "c": {**EMPTY_KINDS, "weights": 64, "activations": 1400, "total": 1464},
    }
    assert live.breakdown() == live.segments()["a"]


@pytest.mark.parametrize("family", ["llama", "resnet", "swin"])
@pytest.mark.parametrize("masking", [["masking=none"], ["masking=backward"], ["masking=forward"]])
def test_estimator_traces_every_family_and_mode(family, masking):
    from conftest import TINY_MODELS

    model, dataset = TINY_MODELS[family]
    overrides = [f"model={model}", f"dataset={dataset}", "trainer.global_batch_size=8", *masking]
    if masking != ["masking=none"]:
        overrides.append("masking.coverage=0.5")
    est = estimate(estimator_config(overrides), world_size=2, rank=1)
    mem = est.memory
    assert mem["peak_bytes"] > mem["params_bytes"] > 0 and est.flops_per_step > 0


def test_the_estimator_shows_every_rank_of_a_capacity_list_and_names_the_busiest(tmp_path, capsys):
    import json

    from sdp.models import build_on_meta
    from sdp.subnet import MaskingConfig
    from sdp.subnet.plan import SubnetPlan

    out = tmp_path / "est.json"
    argv = [*TINY, "masking=forward", "masking.capacity=[1,1,0.5,0.5]", "world_size=4", "rank=all", f"out={out}"]
    assert main(argv) == 0
    per_rank = json.loads(out.read_text())
    assert [e["capacity"] for e in per_rank] == [1, 1, 0.5, 0.5] and {e["coverage"] for e in per_rank} == {0.75}
    assert all(e["holders"] == {"min": 3, "mean": 3.0, "max": 3} for e in per_rank)
    # Each rank's parameters (forward masking) are exactly the shared tensors and its own units.
    cfg = estimator_config([*TINY, "masking=forward", "masking.capacity=[1,1,0.5,0.5]"], world_size=4)
    plan = SubnetPlan.build(
        build_on_meta(cfg.model), MaskingConfig(name="forward", capacity=[1, 1, 0.5, 0.5]), family="llama", workers=4
    )
    for est in per_rank:
        held = sum(
            plan.mask.held_units(est["rank"], g).size * group.unit_numel(plan.shapes)
            for g, group in enumerate(plan.spec.groups)
        )
        assert est["memory"]["params_bytes"] == 4 * (plan.shared_params + held)
    printed = capsys.readouterr().out.splitlines()
    assert "  holders  each unit held by 3..3 workers (mean 3)" in printed
    assert printed[-1].startswith("busiest: rank 0 of 4, peak ")
    assert printed[-3].split()[:2] == ["2", "0.5"]  # the table: rank, capacity, ...
    assert main([*TINY, "masking=backward", "masking.capacity=[0.5,1,1,0.5]", "world_size=4"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "busiest: rank 1 of 4 (it holds the most unit parameters)"


# ------------------------------------------------- sdp.estimate --against RUN_DIR


@pytest.mark.dist
@pytest.mark.parametrize("variant", ["ddp", "backward-diloco"])
def test_against_a_finished_run_sets_each_ranks_estimate_beside_its_measurement(
    real_runs, estimates, variant, tmp_path, capsys
):
    import json
    from pathlib import Path

    run_dir, out = Path(real_runs[variant]["run_dir"]), tmp_path / "against.json"
    assert main(["--against", str(run_dir), f"out={out}"]) == 0
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["total_by"] for r in ranks} == {"live-tensor tracker"}
    for r in ranks:
        measured = real_runs[variant]["memory_per_rank"][r["rank"]]["peak_breakdown"]
        figures = {f["category"]: f for f in r["figures"]}
        assert list(figures) == [
            "weights",
            "grads",
            "optimizer",
            "activations",
            "temporaries",
            "communicators",
            "total",
        ]
        assert {k: f["measured"] for k, f in figures.items() if k != "communicators"} == measured
        # The run's own config re-estimated: what the estimator gives for these overrides.
        estimated = estimates[variant][r["rank"]].memory["peak_breakdown"]
        assert {k: f["estimated"] for k, f in figures.items() if k != "communicators"} == estimated
        # The state the step holds is exact; the step's own tensors within the estimator's 10%.
        assert all(figures[k]["ratio"] == 1.0 for k in ("weights", "optimizer"))
        assert figures["total"]["ratio"] == pytest.approx(1.0, rel=0.10)
        assert figures["communicators"]["measured"] is None and figures["communicators"]["estimated"] > 0
    if variant == "backward-diloco":  # capacities [1, 0.5]: rank 1's estimate is its own, smaller
        assert ranks[1]["figures"][2]["estimated"] < ranks[0]["figures"][2]["estimated"]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "rank 0: estimate against measured (total measured by the live-tensor tracker)"
    assert printed[1].split() == ["category", "estimate", "GiB", "measured", "GiB", "estimate/measured"]
    assert printed[7].split()[:3] == ["communicators", f"{ranks[0]['figures'][5]['estimated'] / 2**30:.6f}", "not"]


@pytest.mark.parametrize(
    "argv,line",
    [
        (["--against"], "error: --against=None: needs a run dir: --against RUN_DIR"),
        (["--against", "{tmp}/nothing"], "error: --against='{tmp}/nothing': has no config.yaml: not a run dir"),
        (
            ["--against", "{tmp}/run", "masking=forward"],
            "error: masking='forward': is not taken with --against: the run's own config is estimated "
            "(allowed: rank=, out=)",
        ),
        (
            ["--against", "{tmp}/run"],
            "error: --against='{tmp}/run': is not a completed run (no summary.json): nothing was measured",
        ),
    ],
)
def test_against_refuses_what_is_not_a_finished_run_in_one_line(argv, line, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("seed: 0\n")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert capsys.readouterr().err.splitlines() == [line.format(tmp=tmp_path)]


@pytest.mark.dist
def test_against_names_the_ranks_a_run_has(real_runs, capsys):
    assert main(["--against", real_runs["ddp"]["run_dir"], "rank=2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: rank='2': allowed with --against: all, or an integer in [0, 1]"
    ]


def test_against_on_cuda_measures_the_total_by_the_allocator():
    from sdp.planning.against import ALLOCATOR, compare, format_against

    peak = {"weights": 100, "grads": 0, "optimizer": 200, "activations": 300, "temporaries": 400, "total": 1000}
    est = {"memory": {"peak_breakdown": {**peak, "activations": 330, "total": 1030}, "peak_bytes": 1030,
                      "comm_group_bytes": 2**30}}  # fmt: skip
    row = compare(3, est["memory"], peak, allocator_peak=1250)
    assert row.total_by == ALLOCATOR and row.figure("total").measured == 1250
    assert row.figure("total").ratio == 1030 / 1250 and row.figure("activations").ratio == 1.1
    assert row.figure("grads").ratio is None  # nothing measured: no ratio
    text = format_against([row]).splitlines()
    assert text[0] == f"rank 3: estimate against measured (total measured by the {ALLOCATOR})"
    assert text[7].split() == ["communicators", "1.000000", "not", "seen"]
    assert text[8].split() == ["total", "0.000001", "0.000001", "0.8240"]
