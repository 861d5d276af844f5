"""The planner's traces kept between calls: read back equal, keyed by all that changes them, and a
second plan of the same run (other cluster, objective, rows) made from them alone."""

import dataclasses
import json
import re

import pytest
from conftest import estimator_config

from sdp.plan import main
from sdp.planning import traces
from sdp.planning.estimator import estimate
from sdp.planning.rows import Row, RunFacts
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


def test_a_second_plan_with_another_cluster_objective_and_rows_traces_nothing(tmp_path, capsys):
    argv = [*TINY, "parallelism.comm_group_overhead_mb=0", "devices=2x0.04", "precision=fp32", "workers=1"]
    argv += ["checkpointing=none", "granularity=neuron", f"cache={tmp_path}"]
    plans = []
    # A trace does not see the cluster: the step time is computed from its collectives per call.
    for own in (["cluster=h100_nvlink"], ["cluster=cpu_2core", "objective=memory", "top=2"]):
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
