"""The planner's traces kept between calls: read back equal, keyed by all that changes them, and a
second plan of the same run (other cluster, objective, rows) made from them alone."""

import dataclasses
import json
import re

import pytest
from conftest import estimator_config

import sdp.models
from sdp.errors import ConfigError
from sdp.plan import main
from sdp.planning import checks, estimator, traces
from sdp.planning.checks import CheckCache, Checked
from sdp.planning.estimator import estimate
from sdp.planning.fit import short_run
from sdp.planning.layered import extends, layer_spread
from sdp.planning.ranks import busiest_rank, planned_groups
from sdp.planning.rows import Row, RunFacts
from sdp.planning.search import Composer
from sdp.planning.space import structures
from sdp.planning.traces import TraceCache

TINY = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=64", "trainer.global_batch_size=16"]
OUTER = ["masking=backward", "masking.coverage=0.5", "outer=diloco", "outer.sync_every=10"]


@pytest.mark.parametrize("overrides,rank", [([], 0), (OUTER, 1)])
def test_a_trace_read_back_is_the_trace(overrides, rank, tmp_path):
    cfg = estimator_config([*TINY, *overrides], 2)
    cache = TraceCache(tmp_path)
    made = cache(cfg, world_size=2, rank=rank)
    read = cache(cfg, world_size=2, rank=rank)
    assert (cache.made, cache.read) == (1, 1) and len(list(tmp_path.iterdir())) == 1
    assert read == made  # through JSON and back, every figure and the collectives' timeline
    fresh = estimate(cfg, world_size=2, rank=rank)
    assert read == dataclasses.replace(fresh, trace_s=read.trace_s)


def test_a_trace_is_keyed_by_all_that_changes_it(tmp_path, monkeypatch):
    cfg = estimator_config(TINY, 2)
    cache = TraceCache(tmp_path)
    cache(cfg, world_size=2, rank=0)
    cache(cfg, world_size=2, rank=1)  # another rank
    cache(cfg, world_size=2, rank=0, head="model.norm")  # the head's segments apart
    cache(estimator_config([*TINY, "dataset.seq_len=32"], 2), world_size=2, rank=0)  # another config
    cache(estimator_config(TINY, 4), world_size=4, rank=0)  # another world
    assert (cache.made, cache.read) == (5, 0)
    monkeypatch.setattr(traces, "code_version", lambda: "another version of the code")
    cache(cfg, world_size=2, rank=0)
    assert (cache.made, cache.read) == (6, 0) and len(list(tmp_path.glob("*.json"))) == 6


def test_a_file_that_is_not_the_trace_is_traced_anew(tmp_path):
    cfg = estimator_config(TINY, 2)
    cache = TraceCache(tmp_path)
    made = cache(cfg, world_size=2, rank=0)
    (path,) = tmp_path.glob("*.json")
    for text in ("{not json", json.dumps({"key": "another run", "estimate": {}})):
        path.write_text(text)
        assert cache(cfg, world_size=2, rank=0).memory == made.memory
    assert (cache.made, cache.read) == (3, 0)
    assert cache(cfg, world_size=2, rank=0).memory == made.memory and cache.read == 1  # rewritten whole


SLOW = pytest.mark.slow  # make test-fast keeps one case of each family below
STEADY = [
    pytest.param(TINY, 2, id="ddp"),
    pytest.param(
        [*TINY, "masking=backward", "masking.coverage=0.5", "parallelism.mixed_precision=bf16"],
        2,
        id="backward_bf16",
        marks=SLOW,
    ),
    pytest.param(
        [*TINY, "masking=forward", "masking.coverage=0.5", "parallelism=fsdp", "parallelism.fsdp_degree=2"],
        4,
        id="forward_x_fsdp",
        marks=SLOW,
    ),
    pytest.param([*TINY, *OUTER], 2, id="outer", marks=SLOW),
]


@pytest.mark.parametrize("overrides,world", STEADY)
def test_a_run_measured_again_at_another_batch_is_a_fresh_trace(overrides, world, monkeypatch):
    """SteadyRuns measures a run it holds again at another micro-batch (accumulation 1, then 2):
    every figure, segment and the collectives' timeline equal a fresh trace's (backward masking's
    refresh is issued in the step before and needed in the next); one run is built for all, but
    under an outer loop, whose runs are not kept."""
    cfg = estimator_config(overrides, world)
    built = []
    monkeypatch.setattr(estimator._Run, "_build", _counting(estimator._Run._build, built))
    configs = [short_run(cfg, world=world, micro=m)[0] for m in (16 // world, 1)]  # 1 accumulation step, then 2
    with estimator.SteadyRuns() as trace:
        steady = [trace(c, world_size=world, rank=world - 1, head="model.norm") for c in configs]
    assert len(built) == (len(configs) if overrides[-1] == OUTER[-1] else 1)
    for c, kept in zip(configs, steady, strict=True):
        fresh = estimate(c, world_size=world, rank=world - 1, head="model.norm")
        assert kept == dataclasses.replace(fresh, trace_s=kept.trace_s)
    assert [e.micro_batch for e in steady] == [16 // world, 1]


def _counting(method, calls: list):
    def counted(self, *args, **kwargs):
        calls.append(args)
        return method(self, *args, **kwargs)

    return counted


def test_a_check_tells_the_search_what_it_would_work_out_from_the_model():
    # Structures of a random mask on equal GPUs and of capacities on mixed ones, neurons and
    # blocks, SDP x FSDP too: the busiest rank and each rank's process groups, from the plan
    # the checks built, are what the search computed from a model of its own.
    busy = varied = spread = 0
    deep = ["model.num_layers=6", "model.num_heads=6", "model.num_kv_heads=6", "model.hidden_size=96"]
    for extra, devices in ((["masking.construction=random"], [8.0] * 4), (deep, [4.0, 4.0, 8.0, 8.0])):
        compose = Composer([*TINY, "trainer.global_batch_size=32", *extra], world=4)
        for s in structures(devices, min_coverage=0.25, granularities=("neuron", "block")):
            try:
                cfg, checked = compose.checked(s)
            except ConfigError:
                continue
            spreads = tuple(layer_spread(cfg, world_size=4, rank=r) for r in range(4)) if extends(cfg) else None
            groups = tuple(planned_groups(cfg, world_size=4))
            assert checked == Checked(busiest_rank(cfg, world_size=4), groups, spreads), s.label
            busy, varied = busy + (checked.busiest_rank > 0), varied + (len(set(checked.groups)) > 1)
            spread += spreads is not None and max(spreads) > 0
    assert busy >= 10 and varied >= 10 and spread >= 5  # not only DDP's answers (rank 0, one group each, 0)


def test_a_check_is_answered_from_disk_for_the_same_config_world_and_code(tmp_path, monkeypatch):
    sdp_cfg = estimator_config([*TINY, "masking=forward", "masking.coverage=0.5"], 4)
    refused = estimator_config([*TINY, "masking=forward", "masking.capacity=[1,1,0.5,0.5]"], 4)
    refused.masking.capacity = [1.0, 0.5]  # a length the check refuses after typing
    cache = CheckCache(tmp_path)
    first = cache(sdp_cfg, world_size=4)
    with pytest.raises(ConfigError) as err:
        cache(refused, world_size=4)
    assert (cache.checked, cache.read) == (2, 0) and len(list((tmp_path / "checks").glob("*.json"))) == 2

    def never(*args, **kwargs):
        raise AssertionError("checked again")

    monkeypatch.setattr(checks, "validate", never)
    assert cache(sdp_cfg, world_size=4) == first
    with pytest.raises(ConfigError) as again:
        cache(refused, world_size=4)
    assert str(again.value) == str(err.value) and (cache.checked, cache.read) == (2, 2)
    monkeypatch.undo()
    cache(sdp_cfg, world_size=2)  # another world
    monkeypatch.setattr(checks, "code_version", lambda: "another version of the code")
    assert cache(sdp_cfg, world_size=4) == first
    (path,) = [p for p in (tmp_path / "checks").glob("*.json") if "another version" in p.read_text()]
    path.write_text("{half a fi")  # a writer that died: checked anew, rewritten whole
    assert cache(sdp_cfg, world_size=4) == first and json.loads(path.read_text())["busiest_rank"] == 0
    assert (cache.checked, cache.read) == (5, 2)


@pytest.mark.slow  # end to end; make test runs it, make test-fast leaves it (docs/testing.md)
def test_a_second_plan_with_another_cluster_objective_and_rows_traces_nothing(tmp_path, capsys, monkeypatch):
    argv = [*TINY, "parallelism.comm_group_overhead_mb=0", "devices=2x0.04", "precision=fp32", "workers=1"]
    argv += ["checkpointing=none", "granularity=neuron", "model.num_layers=6", f"cache={tmp_path}"]
    plans = []
    # A trace does not see the cluster: the step time is computed from its collectives per call.
    for own in (["cluster=h100_nvlink"], ["cluster=cpu_2core", "objective=memory", "top=2"]):
        if plans:  # nothing checks a config or builds a model again: the first call's answers
            monkeypatch.setattr(checks, "validate", lambda *a, **k: pytest.fail("checked again"))
            monkeypatch.setattr(sdp.models, "_META", {})  # the meta models this process built
            monkeypatch.setattr(sdp.models, "_build_on_meta", lambda *a, **k: pytest.fail("a model built again"))
        out_dir = tmp_path / own[0]
        assert main([*argv, *own, f"out={out_dir}"]) == 0
        counts = re.search(r"traces: (\d+) made, (\d+) read", capsys.readouterr().out).groups()
        plans.append(([int(c) for c in counts], json.loads((out_dir / "plan.json").read_text())))
    ([made, read], first), ([made_again, read_again], second) = plans
    assert made > 0 and read == 0 and made_again == 0 and read_again == made
    assert (first["traces"], second["traces"]) == ({"made": made, "read": 0}, {"made": 0, "read": made})
    assert [r["run"] for r in first["rows"]] == [r["run"] for r in second["rows"]]
    for a, b in zip(first["rows"], second["rows"], strict=True):
        assert (a.get("micro_batch"), a.get("peaks_bytes")) == (b.get("micro_batch"), b.get("peaks_bytes")), a["run"]
    # plan.json's rows are the typed rows written out: read back, they write the same file.
    unit = first["run"]["unit"]
    again = [Row.from_json(r, unit).to_json(unit) for r in first["rows"]]
    assert json.loads(json.dumps(again)) == first["rows"] and any("step_s" in r for r in first["rows"])
    assert RunFacts.from_json(first["run"]).to_json() == first["run"]
