"""The spectral gap against convergence, from synthetic run dirs: DDP's half-budget target,
the steps each run takes to reach it, and the table."""

import json

import pytest
from test_collect import _run

from sdp.analysis.claims import FEW, HOLDS, UNCLEAR
from sdp.analysis.rho import RhoPoint, ddp_target, mixing_comparisons, rho_markdown, rho_plot, rho_points
from sdp.analysis.tables import find_runs


def _curve(run_dir, losses, every=2):
    records = [{"step": every * (i + 1), "eval_loss": loss} for i, loss in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _sdp(root, name, *, construction, rho, losses, seed=0, masking="backward"):
    # summary.json holds the strategy's description at its top level
    mask = {"spectral_gap": rho}
    d = _run(
        root, name, masking=masking, coverage=0.5, seed=seed, construction=construction, mask=mask, eval_loss=losses[-1]
    )
    _curve(d, losses)


@pytest.fixture
def runs(tmp_path):
    for seed, losses in enumerate([[2.0, 1.5, 1.2, 1.0, 0.9], [2.0, 1.5, 1.0, 1.0, 0.9]]):
        _curve(_run(tmp_path, f"ddp{seed}", seed=seed, eval_loss=0.9), losses)  # steps = 10: half is 5, eval at 4
    _sdp(tmp_path, "cyclic", construction="cyclic", rho=0.5, losses=[2.0, 1.6, 1.3, 1.2, 1.0])
    _sdp(tmp_path, "blocked", construction="blocked", rho=0.0, losses=[2.0, 1.9, 1.8, 1.7, 1.6])
    _sdp(tmp_path, "fwd", construction="cyclic", rho=0.5, losses=[1.9, 1.25, 1.1, 1.0, 0.95], masking="forward")
    return find_runs([tmp_path])


def test_the_target_is_ddps_mean_loss_at_half_its_budget(runs):
    ddp = [(d, s) for d, s in runs if s.masking == "none"]
    assert ddp_target(ddp) == (4, pytest.approx(1.5))


def test_each_run_reaches_the_target_at_its_first_evaluation_below_it_or_never(runs):
    points = rho_points(runs, 1.5)
    got = [(p.variant, p.construction, p.rho, p.steps_to_target, p.final_eval_loss) for p in points]
    assert got == [
        ("N-SDP backward", "cyclic", 0.5, 6, 1.0),
        ("N-SDP backward", "blocked", 0.0, None, 1.6),
        ("N-SDP forward", "cyclic", 0.5, 4, 0.95),
    ]


def test_the_table_and_plot(runs, tmp_path):
    points = rho_points(runs, 1.5)
    md = rho_markdown(points, target=(4, 1.5), ddp_final=[0.9, 0.9], command="c")
    assert "| N-SDP backward | blocked | 0.000 | 1 | 1.6000 | — |" in md
    assert "| N-SDP backward | cyclic | 0.500 | 1 | 1.0000 | 6 |" in md
    assert "DDP's final eval loss: 0.9000 ± 0.0000" in md
    assert rho_plot(points, tmp_path / "rho.png", budget=10).stat().st_size > 1000


def test_ddp_runs_without_a_common_half_budget_evaluation_are_one_error(tmp_path):
    _curve(_run(tmp_path, "ddp", eval_loss=1.0), [1.0], every=10)
    with pytest.raises(SystemExit, match="need one evaluation at the same step at or before step 5"):
        ddp_target(find_runs([tmp_path]))


def _points(construction, rho, losses):
    return [RhoPoint("N-SDP backward", construction, seed, rho, loss, None) for seed, loss in enumerate(losses)]


def test_each_construction_is_compared_with_the_blocked_mask_by_the_claims_rule():
    points = [
        *_points("blocked", 0.0, [1.60, 1.62, 1.58]),
        *_points("cyclic", 0.5, [1.00, 1.02, 0.98]),  # 0.6 lower, SE 0.02 * sqrt(2/3)
        *_points("random", 0.52, [1.59, 1.63, 1.58]),  # 0.0067 lower, SE > 0.0067 / 2
    ]
    cyclic, random = mixing_comparisons(points)
    assert (cyclic.first, cyclic.second, cyclic.runs) == ("N-SDP backward cyclic", "N-SDP backward blocked", (3, 3))
    assert cyclic.d == pytest.approx(0.6) and cyclic.se == pytest.approx(0.02 * (2 / 3) ** 0.5)
    assert (cyclic.verdict, random.verdict) == (HOLDS, UNCLEAR)
    md = rho_markdown(points, target=(4, 1.5), ddp_final=[0.9], command="c")
    assert "| N-SDP backward cyclic vs N-SDP backward blocked | +0.6000 | 0.0163 | 3, 3 | holds |" in md
    # One seed a row: too few runs to say; no blocked mask: nothing to compare with.
    assert mixing_comparisons([*_points("blocked", 0.0, [1.6]), *_points("cyclic", 0.5, [1.0])])[0].verdict == FEW
    assert mixing_comparisons(_points("cyclic", 0.5, [1.0, 1.1, 1.2])) == []
