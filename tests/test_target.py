"""Costs to a target (sdp.analysis.target): the steps, samples or tokens and bytes each row took
to first reach 99% of DDP's final quality, in the collected tables."""

import json

import yaml
from test_collect import _run

from sdp.analysis.tables import build_rows, collect, find_runs
from sdp.analysis.target import curve, first_reached, target_value


def _evals(run_dir, points, *, metric="eval_acc", batch=32):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, metric: v}) + "\n" for s, v in points))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**config, "trainer": {"global_batch_size": batch}}))


def test_each_row_costs_the_mean_of_its_runs_and_a_run_that_never_reaches_it_leaves_the_row_short(tmp_path):
    # DDP ends at 0.80 in both runs: the target is 0.792, first reached at steps 8 and 4.
    _evals(_run(tmp_path, "ddp-s0", acc=0.8), [(4, 0.70), (8, 0.795), (10, 0.80)])
    _evals(_run(tmp_path, "ddp-s1", seed=1, acc=0.8), [(4, 0.792), (10, 0.80)])
    # Backward masking reaches it at step 10 in both runs, its busiest rank sending 0.5 MiB a step.
    bwd = dict(masking="backward", coverage=0.5, comm_bytes_per_step_per_rank=[2**19, 2**18])
    for seed in range(2):
        _evals(_run(tmp_path, f"bwd-s{seed}", seed=seed, acc=0.79, **bwd), [(4, 0.6), (10, 0.793)])
    # Forward masking: one run of two never reaches it.
    _evals(_run(tmp_path, "fwd-s0", masking="forward", coverage=0.5, acc=0.8), [(4, 0.5), (10, 0.80)])
    _evals(_run(tmp_path, "fwd-s1", masking="forward", coverage=0.5, seed=1, acc=0.78), [(4, 0.5), (10, 0.78)])
    rows = {r["variant"]: r for r in build_rows(find_runs([tmp_path]))["resnet_tiny_fashion_mnist"]["rows"]}
    costs = {v: (r["target_steps"], r["target_samples"], r["target_mib"]) for v, r in rows.items()}
    assert rows["DDP"]["target"] == 0.99 * 0.8
    assert costs == {
        "DDP": (6, 6 * 32, 6.0),  # 1 MiB a step
        "N-SDP backward": (10, 10 * 32, 5.0),
        "N-SDP forward": (None, None, None),
    }
    collect([tmp_path], tmp_path / "out", command="c", make_plots=False)
    md = (tmp_path / "out" / "resnet_tiny_fashion_mnist.md").read_text()
    assert "Costs to a target (99% of DDP's final eval accuracy, 79.20%)" in md
    assert "| 6 | 192 | 6.0 |" in md and "| not reached | not reached | not reached |" in md


def test_a_language_target_is_a_loss_within_one_percent_of_ddps():
    target = target_value(3.96, "text")
    assert target == 3.96 / 0.99
    assert first_reached([(10, 4.5), (20, 4.01), (30, 3.99)], target, "text") == 30  # 4.01 > 4.0 = target
    assert first_reached([(10, 0.5), (20, 0.7)], target_value(0.8, "image"), "image") is None


def test_a_rows_curve_is_the_mean_of_its_runs_at_the_steps_all_evaluated(tmp_path):
    kw = dict(masking="forward", coverage=0.5, comm_bytes_per_step=2**21)
    _evals(_run(tmp_path, "fwd-s0", **kw), [(4, 0.5), (8, 0.7), (10, 0.8)], batch=16)
    _evals(_run(tmp_path, "fwd-s1", seed=1, **kw), [(4, 0.6), (10, 0.7)], batch=16)
    (row,) = build_rows(find_runs([tmp_path]))["resnet_tiny_fashion_mnist"]["rows"]
    assert curve(row, "image") == {
        "steps": [4, 10],  # step 8: one run only
        "values": [0.55, 0.75],
        "samples": [64, 160],
        "mib": [8.0, 20.0],  # 2 MiB a step
    }
