"""The outer loop (outer=diloco): its exactness anchors, the average over each unit's own
holders, one global order of its collectives with fragments, and workers that start alike.
The checks run on forked ranks (tests/outer_harness.py); the asserts are here."""

import json

import pytest
from collective_order import order_problems
from conftest import job_env
from ranks import run_ranks


def _harness(scenario: str, nproc: int, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("outer") / f"{scenario}.json"
    args = [scenario, str(out)]
    proc = run_ranks("outer_harness:main", args, nproc=nproc, cwd=out.parent, env=job_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return _harness("k1", 1, tmp_path_factory)["k1"]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _harness("sgd+average+order+start", 4, tmp_path_factory)


def test_one_worker_with_lr_1_and_no_momentum_is_the_plain_run_bitwise(one):
    assert len(one) == 9
    assert one == dict.fromkeys(one, 0.0)


def test_h1_sgd_with_lr_1_and_no_momentum_is_the_plain_run_within_rounding(four):
    sgd = four["sgd"]
    assert len(sgd) == 7
    for case, rel in sgd.items():
        assert rel < 1e-5, case


def test_each_unit_averages_its_pseudo_gradient_over_its_own_holders(four):
    cases = four["average"]
    for case, res in cases.items():
        assert res["rel_err"] < 1e-4, case
    assert cases["llama-ddp"]["holder_counts"] == [4]
    # Uneven holder counts in one sync: units of one and of two holders beside the shared tensors
    # (all four), and units of three.
    for mode in ("backward", "forward"):
        assert cases[f"resnet-{mode}-neuron"]["holder_counts"] == [1, 2, 4]
        assert cases[f"llama-{mode}-neuron"]["holder_counts"] == [3, 4]
    assert cases["llama-forward-block-lr1"]["holder_counts"] == [2, 4]


def _traces(raw) -> list:
    return [[(g, k, tuple(i)) for g, k, i in trace] for trace in raw]


@pytest.mark.parametrize("case", ["llama-backward-neuron", "resnet-forward-neuron", "llama-forward-block"])
def test_fragments_issue_their_collectives_in_one_global_order(four, case):
    traces = _traces(four["order"][case])
    kinds = {k for trace in traces for _, k, _ in trace}
    assert kinds == {"outer_start", "outer_sync", "outer_refresh"}
    fragments = {i[0] for trace in traces for _, k, i in trace if k == "outer_sync"}
    assert fragments == {0, 1}
    assert order_problems(traces, world_size=4) == []


def test_a_rank_syncing_fragments_out_of_order_is_caught(four):
    """The end's two fragment syncs swapped on rank 1 (gloo aborts on the sizes; NCCL could hang)."""
    traces = _traces(four["order"]["llama-backward-neuron"])
    end = [i for i, (_, k, where) in enumerate(traces[1]) if k == "outer_sync" and where[0] == 0][-1]
    mine = traces[1]
    swapped = [c for c in mine[end + 1 :] if c[2][0] == 1] + [c for c in mine[: end + 1] if c[2][0] == 0][-2:]
    assert order_problems([traces[0], mine[: end - 1] + swapped, *traces[2:]], world_size=4) != []


@pytest.mark.parametrize("case", ["llama-ddp", "llama-backward-neuron", "resnet-forward-neuron"])
def test_holders_start_alike_and_evaluation_sees_the_synced_weights(four, case):
    res = four["start"][case]
    assert res["holder_spread"] == 0.0
    assert res.get("full_spread", 0.0) == 0.0
    assert res["synced_is_start"] == 0.0
    assert res["outside_moved"] > 0.0
