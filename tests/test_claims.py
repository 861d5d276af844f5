"""The claims report (`sdp.collect --claims`) on synthetic run dirs: the rule's three verdicts and
its refusal to judge from too few seeds, the memory claims, and the convergence check."""

import json
import math

import pytest
from test_collect import _run

from sdp.analysis.claims import (
    FAILS,
    FEW,
    HOLDS,
    NOT_CONVERGED,
    UNCLEAR,
    points_from_cuda,
    points_from_memory_table,
    quality_claims,
)
from sdp.analysis.tables import build_rows, collect, find_runs


def _seeds(root, name, accs, **kw):
    for seed, acc in enumerate(accs):
        _run(root, f"{name}-s{seed}", seed=seed, acc=acc, **kw)


def _claims(root) -> dict:
    return {c.number: c for c in quality_claims(build_rows(find_runs([root])))}


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    matched = dict(coverage=0.5, protocol="flop_matched", steps=20)
    _seeds(root, "ddp", [0.80, 0.81, 0.79], peak=4.0)
    # Clearly better than DDP: +5 points, SE = hypot(1, 1) / sqrt(3) = 0.816.
    _seeds(root, "bf", [0.85, 0.86, 0.84], masking="forward", gran="block", peak=2.0, **matched)
    # The same as DDP: no difference to see.
    _seeds(root, "nf", [0.80, 0.81, 0.79], masking="forward", peak=2.5, **matched)
    # Two seeds only.
    _seeds(root, "bb", [0.90, 0.91], masking="backward", gran="block", peak=3.0, **matched)
    # Clearly worse than DDP at DDP's steps.
    _seeds(root, "nf-same", [0.70, 0.71, 0.69], masking="forward", coverage=0.5, peak=2.5)
    return root


def test_a_clear_difference_holds_and_its_standard_error_is_over_seeds(runs):
    claims = _claims(runs)
    better = next(c for c in claims["1"].comparisons if c.first == "B-SDP forward C=0.5 (flop_matched)")
    assert better.second == "DDP" and better.runs == (3, 3)
    assert better.d == pytest.approx(5.0) and better.se == pytest.approx(math.sqrt(2 / 3))
    assert better.verdict == HOLDS
    assert [c.verdict for c in claims["3"].comparisons] == [HOLDS, UNCLEAR]  # vision: forward only


def test_no_difference_is_not_distinguishable_and_a_clear_loss_does_not_hold(runs):
    claims = _claims(runs)
    same = next(c for c in claims["1"].comparisons if c.first == "N-SDP forward C=0.5 (flop_matched)")
    assert same.d == pytest.approx(0.0, abs=1e-9) and same.verdict == UNCLEAR
    (worse,) = claims["4b"].comparisons
    assert worse.first == "N-SDP forward C=0.5" and worse.d == pytest.approx(-10.0) and worse.verdict == FAILS


def test_too_few_seeds_are_not_judged_and_a_mixed_claim_counts_its_verdicts(runs):
    claims = _claims(runs)
    few = next(c for c in claims["1"].comparisons if c.first.startswith("B-SDP backward"))
    assert few.runs == (2, 3) and few.d == pytest.approx(10.5) and few.verdict == FEW
    assert claims["1"].verdict == f"{HOLDS} in 1, {UNCLEAR} in 1, {FEW} in 1"
    # B-SDP against N-SDP, forward, flop_matched: +5 points.
    assert [(c.first, c.second, c.verdict) for c in claims["2"].comparisons] == [
        ("B-SDP forward C=0.5 (flop_matched)", "N-SDP forward C=0.5 (flop_matched)", HOLDS)
    ]


def test_claims_md_has_a_verdict_per_claim_and_checks_memory_against_every_source(runs, tmp_path):
    table = tmp_path / "memory_estimates.csv"
    table.write_text(
        "model,variant,coverage,peak_vs_ddp\n"
        "llama_500m,DDP,1.0,+0.0%\n"
        "llama_500m,B-SDP forward x FSDP(F=4) + AC,0.5,-86.5%\n"
        "llama_500m,FSDP + AC,1.0,-82.3%\n"
        "llama_500m,N-SDP backward,0.5,-13.0%\n"
    )
    cuda = tmp_path / "cuda.json"
    measured = [("DDP", 10), ("N-SDP forward", 9)]
    cuda.write_text(
        json.dumps({"rows": [{"model": "m", "variant": v, "measured": {"cuda_max_allocated": b}} for v, b in measured]})
    )
    assert [(p.variant, round(p.reduction, 3)) for p in points_from_cuda([cuda])] == [("N-SDP forward", 0.1)]
    assert len(points_from_memory_table(table)) == 3
    written = collect(
        [runs], tmp_path / "out", command="c", make_plots=False, claims=True, memory_table=table, cuda=(cuda,)
    )
    md = (tmp_path / "out" / "claims.md").read_text()
    assert written[-1].name == "claims.md"
    for number in ("1", "2", "3", "4a", "4b", "5"):
        assert f"## Claim {number}:" in md
    assert "**Verdict: holds in 1, not distinguishable at this scale in 1, too few runs in 1.**" in md
    assert (
        "| resnet_tiny_fashion_mnist | B-SDP forward C=0.5 (flop_matched) | DDP | +5.00 points | 0.82 points "
        "| +6.1 | 3, 3 | holds |" in md
    )
    assert (
        "| M1 | run dirs (live-tensor peak) | resnet_tiny_fashion_mnist | -25.0% to -50.0% "
        "(best: B-SDP forward C=0.5 (flop_matched)) | holds |" in md
    )
    assert f"| M1 | {table} | llama_500m | -13.0% to -13.0% (best: N-SDP backward C=0.5) | does not hold |" in md
    assert (
        f"| M2 | {table} | llama_500m | -86.5% (B-SDP forward x FSDP(F=4) + AC C=0.5); "
        "without SDP, FSDP + AC C=1: -82.3% | holds |"
    ) in md
    assert f"| M1 | {cuda} | m | -10.0% to -10.0% (best: N-SDP forward) | does not hold |" in md


@pytest.mark.parametrize(("before", "verdict"), [(0.797, "passes"), (0.79, "fails")])
def test_the_table_header_states_whether_ddp_had_converged(tmp_path, before, verdict):
    # Run dirs from before the gate (no `convergence` in summary.json): computed from metrics.jsonl.
    for seed in range(2):
        d = _run(tmp_path, f"ddp-s{seed}", seed=seed, acc=0.8, convergence={})
        evals = [{"step": 8, "eval_acc": before}, {"step": 10, "eval_acc": 0.8}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    info = build_rows(find_runs([tmp_path]))["resnet_tiny_fashion_mnist"]
    change = f"{abs(0.8 - before) / 0.8:.2%}"
    condition = "(< 0.5% in every run)" if verdict == "passes" else "(>= 0.5% in 2 of its 2 runs)"
    assert info["convergence"] == (
        f"DDP's smoothed eval acc moved by {change}, {change} (its 2 runs) over steps 8-10: {verdict} {condition}"
    )
    assert info["not_converged"] == ([] if verdict == "passes" else ["DDP"])


def test_a_row_that_did_not_converge_gets_no_verdict_and_neither_does_a_comparison_with_ddp(runs):
    gate = {"metric": "eval_acc", "from_step": 8, "to_step": 10, "threshold": 0.005, "change": 0.02}
    for d in (runs / "nf-same-s1", runs / "ddp-s2"):  # one run of a row, then one of DDP
        summary = json.loads((d / "summary.json").read_text())
        (d / "summary.json").write_text(json.dumps({**summary, "convergence": {**gate, "plateaued": False}}))
        claims = _claims(runs)
        (worse,) = claims["4b"].comparisons
        assert worse.d == pytest.approx(-10.0) and worse.verdict == NOT_CONVERGED  # was FAILS
    # DDP not converged: every comparison that reads DDP's quality is withheld, not B-SDP against N-SDP.
    assert {c.verdict for c in claims["1"].comparisons} == {NOT_CONVERGED}
    assert [c.verdict for c in claims["2"].comparisons] == [HOLDS]
    md = (collect([runs], runs.parent / "out", command="c", make_plots=False, claims=True)[-1]).read_text()
    assert f"**Verdict: {NOT_CONVERGED}.**" in md
    table = (runs.parent / "out" / "resnet_tiny_fashion_mnist.md").read_text()
    assert "| DDP | 1 | same_iteration | 10 | 3 | 0.1 | **no** |" in table  # lr 0.1: the runs' optim.lr


def test_n_sdp_is_compared_with_the_dense_model_of_its_subnetworks_size(runs):
    # DDP of the model at model.inner_width=0.5: the dense control of N-SDP at C = 0.5.
    _seeds(runs, "dense", [0.75, 0.76, 0.74], inner_width=0.5)
    _seeds(runs, "dense-wide", [0.75, 0.76, 0.74], inner_width=0.75)  # no N-SDP row at C = 0.75
    rows = build_rows(find_runs([runs]))["resnet_tiny_fashion_mnist"]["rows"]
    assert [r["variant"] for r in rows][:3] == ["DDP", "DDP (inner width 0.5)", "DDP (inner width 0.75)"]
    claims = _claims(runs)
    # Against the same-iteration N-SDP row only (flop_matched trains other steps); -5 points.
    (control,) = claims["6"].comparisons
    assert (control.first, control.second) == ("N-SDP forward C=0.5", "DDP (inner width 0.5)")
    assert control.d == pytest.approx(-5.0) and control.verdict == FAILS
    # The controls are not DDP, nor SDP: claim 4b still reads the one same-iteration SDP row.
    assert [(c.first, c.second) for c in claims["4b"].comparisons] == [("N-SDP forward C=0.5", "DDP")]
