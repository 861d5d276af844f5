"""The outer loop (outer=diloco): its exactness anchors, the average over each unit's own
holders, one global order of its collectives with fragments, workers that start alike, and
resuming: bitwise mid-window, on another world size at a sync boundary only. The checks run on
forked ranks (tests/outer_harness.py and the entrypoint); the asserts are here."""

import json

import pytest
import torch
from collective_order import order_problems
from conftest import job_env, launch, read_run
from ranks import run_ranks

pytestmark = pytest.mark.dist  # every test here runs a multi-rank job


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
    sgd = dict(four["sgd"])
    wire = sgd.pop("llama-ddp-bf16-wire")
    assert len(sgd) == 9
    for case, rel in sgd.items():
        assert rel < 1e-5, case
    # outer.comm_dtype=bf16 rounds the pseudo-gradients (8 bits of mantissa), not the weights.
    assert sgd["llama-ddp"] < wire < 1e-3


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


LLAMA = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=16"]
RESNET = ["model=resnet_tiny", "dataset=synthetic_image", "trainer.global_batch_size=16"]
COMMON = ["logger=none", "trainer.max_steps=9", "trainer.log_every=1", "trainer.eval_every=4", "dataset.eval_batches=1"]
RESUMES = {
    "llama-ddp": LLAMA,
    # Backward masking: the non-held ranges hold theta_prev between syncs, the held ones each
    # rank's own; so are the BatchNorm statistics of the units a rank sends at evaluation.
    "resnet-sdp-backward": [*RESNET, "masking=backward", "masking.coverage=0.5"],
}


@pytest.mark.parametrize("variant", RESUMES)
def test_a_stop_mid_window_resumes_bitwise(tmp_path, variant):
    overrides = [*RESUMES[variant], *COMMON, "outer=diloco", "outer.sync_every=4", "trainer.progress=false"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for argv in (
        [*overrides, f"run_dir={straight}"],
        [*overrides, f"run_dir={resumed}", "trainer.stop_at_step=6"],  # steps 5 and 6 of the window 5..8
        [*overrides, f"run_dir={resumed}"],
    ):
        proc = launch(argv, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (torch.load(d / "model.pt", weights_only=True) for d in (straight, resumed))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    (sa, ra), (sb, rb) = read_run(straight), read_run(resumed)
    drop = ("tokens_or_samples_per_s", "step_time_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in ra] == [
        {k: v for k, v in r.items() if k not in drop} for r in rb
    ]
    assert sb["resumed_from"] == 6 and sb["outer"]["syncs"] == 2  # after steps 8 and 9 (the end)
    assert sa["outer"]["syncs"] == 3


def test_another_world_size_resumes_at_a_sync_boundary_only(tmp_path):
    overrides = [*RESNET, *COMMON, "outer=diloco", "outer.sync_every=4", "trainer.progress=false"]
    overrides.append(f"run_dir={tmp_path}")
    assert launch([*overrides, "trainer.stop_at_step=6"], cwd=tmp_path).returncode == 0
    proc = launch(overrides, nproc=1, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: run_dir='{tmp_path}': holds a checkpoint of step 6 written by 2 processes in the middle of an "
        "outer window: each worker's weights and inner optimizer state are its own until the next sync, so a "
        "resume on 1 process needs a sync boundary; the next is step 8 (outer.sync_every=4): resume on 2 "
        "processes with trainer.stop_at_step=8, then on 1"
    )
    assert launch([*overrides, "trainer.stop_at_step=8"], cwd=tmp_path).returncode == 0
    proc = launch(overrides, nproc=1, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, _ = read_run(tmp_path)
    assert summary["resumes"][-1] == {"step": 8, "world_size": 1, "checkpointed_with": 2}
    assert summary["status"] == "completed"
