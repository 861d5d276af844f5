"""objective=time_to_target: the planner ranks by modelled step x a pilot's steps to its target."""

import csv
from pathlib import Path

import pytest

from sdp.errors import ConfigError
from sdp.planning.quality import NEEDED, load_pilot, target_ranking
from sdp.planning.rows import Row
from sdp.planning.space import Structure

SCALE = {"model": "resnet_tiny", "kind": "image", "inner_width": 1.0, "world_size": 4, "global_batch": 128}


def pilot_csv(tmp_path: Path, rows: list[dict], **scale) -> Path:
    """A collect CSV of `rows` (variant, masking, granularity, coverage, protocol, steps,
    target_steps; outer and H optional), all at one scale."""
    path = tmp_path / "pilot.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*NEEDED, "eval_acc"])
        writer.writeheader()
        for r in rows:
            full = {**SCALE, **scale, "target": 0.9, "outer": "", "sync_every": "", "seq_len": "", **r}
            writer.writerow({k: "" if full.get(k) is None else full.get(k) for k in writer.fieldnames})
    return path


def row(masking: str = "none", coverage: float | None = None, step: float = 1.0, **kw) -> Row:
    s = Structure(masking=masking, coverage=coverage, **kw)
    return Row(s, 0.0, fits=True, micro_batch=1, accum=1, peaks_bytes={0: 1}, devices_gib={0: 1.0}, step_s=step)


DDP = {"variant": "DDP", "masking": "none", "coverage": 1.0, "protocol": "same_iteration", "steps": 1600}


def sdp(mode: str, steps_to_target, *, protocol="same_iteration", budget=1600, gran="neuron", coverage=0.5):
    name = f"{gran[0].upper()}-SDP {mode}"
    return {
        "variant": name,
        "masking": mode,
        "granularity": gran,
        "coverage": coverage,
        "protocol": protocol,
        "steps": budget,
        "target_steps": steps_to_target,
    }


class Config:
    """The parts of a run's config the ranking reads."""

    def __init__(self, model="resnet_tiny", batch=128, kind="image"):
        self.model = type("M", (), {"name": model, "inner_width": 1.0})
        self.trainer = type("T", (), {"global_batch_size": batch})
        self.dataset = type("D", (), {"kind": kind, "seq_len": 64})


def ranking(path: Path, *, world: int = 4):
    return target_ranking(path, Config(), world=world, outer="diloco")


def test_a_slower_step_that_needs_fewer_steps_ranks_first(tmp_path):
    # Forward masking needs 2.5 x DDP's steps, backward masking 1.1 x: backward's step is slower
    # than forward's (0.9 s against 0.6 s) but it reaches the target first (990 s against 1500 s).
    path = pilot_csv(tmp_path, [{**DDP, "target_steps": 1000}, sdp("forward", 2500), sdp("backward", 1100)])
    fwd, bwd, ddp = row("forward", 0.5, 0.6), row("backward", 0.5, 0.9), row(step=1.0)
    rank = ranking(path)
    assert rank.seconds and "the plan's own: time to target in seconds" in rank.line()
    assert rank([fwd, ddp, bwd]) == [bwd, ddp, fwd]
    assert bwd.to_target == "1,100 steps (same_iteration, 1.10 x DDP's): 990.0 s" and bwd.to_target_s == 990.0
    assert fwd.to_target == "2,500 steps (same_iteration, 2.50 x DDP's): 1,500.0 s"


def test_a_censored_row_ranks_after_every_row_that_reached_the_target(tmp_path):
    # B-SDP forward never reached it in 1,600 steps: its bound (0.1 s x 1600 = 160 s) is below
    # every reached row's time, yet it ranks after them; rows the pilot did not run come last.
    rows = [{**DDP, "target_steps": 1000}, sdp("forward", 1500), sdp("forward", None, gran="block")]
    path = pilot_csv(tmp_path, rows)
    censored, fwd, ddp = row("forward", 0.5, 0.1, granularity="block"), row("forward", 0.5, 0.5), row(step=1.0)
    unknown = row("backward", 0.25, 0.05)
    assert ranking(path)([unknown, censored, ddp, fwd]) == [fwd, ddp, censored, unknown]
    assert censored.to_target == "not reached in 1,600 steps (same_iteration): >= 160.0 s, >= 1.60 x DDP's steps"
    assert unknown.to_target == "no pilot" and unknown.to_target_s is None


def test_flop_matched_is_the_same_variant_with_a_longer_budget(tmp_path):
    rows = [
        {**DDP, "target_steps": 1000},
        sdp("forward", None),  # not reached in its 1,600 steps
        sdp("forward", 2240, protocol="flop_matched", budget=3200),  # reached with twice the budget
        sdp("backward", None),
        sdp("backward", None, protocol="flop_matched", budget=3200),
    ]
    fwd, bwd, ddp = row("forward", 0.5, 0.5), row("backward", 0.5, 0.5), row(step=1.0)
    assert ranking(pilot_csv(tmp_path, rows))([bwd, fwd, ddp]) == [ddp, fwd, bwd]
    assert fwd.to_target.startswith("2,240 steps (flop_matched, 2.24 x DDP's)")
    assert bwd.to_target.startswith("not reached in 3,200 steps (flop_matched)")


def test_at_another_scale_only_ratios_to_ddp_are_printed(tmp_path):
    # The pilot ran K = 4; the plan has 8 GPUs: seconds would not carry over, ratios do.
    path = pilot_csv(tmp_path, [{**DDP, "target_steps": 1000}, sdp("forward", 2000)])
    rank = ranking(path, world=8)
    assert not rank.seconds
    assert rank.line().endswith(
        "ran resnet_tiny, K = 4, global batch 128 (not the plan's: time to target relative to DDP's "
        "(step ratio x steps ratio), not in seconds)"
    )
    fwd, ddp, ddp_bf16 = row("forward", 0.5, 0.4), row(step=1.0), row(step=0.8, precision="bf16")
    assert rank([fwd, ddp, ddp_bf16]) == [fwd, ddp_bf16, ddp]
    # Relative to the plan's fastest DDP row: 0.4 / 0.8 x 2000 / 1000 = 1.0.
    assert fwd.to_target == "2,000 steps (same_iteration, 2.00 x DDP's): 1.00 x DDP's"
    assert ddp.to_target.endswith(": 1.25 x DDP's") and not fwd.to_target.endswith(" s")


def test_outer_loop_rows_match_on_the_algorithm_and_h(tmp_path):
    looped = {**DDP, "variant": "DDP + DiLoCo(H=10)", "outer": "diloco", "sync_every": 10, "target_steps": 1200}
    path = pilot_csv(tmp_path, [{**DDP, "target_steps": 1000}, looped])
    h10, h50 = row(step=0.5, sync_every=10), row(step=0.4, sync_every=50)
    assert ranking(path)([h50, h10]) == [h10, h50]
    assert h10.to_target.endswith(": 600.0 s") and h50.to_target == "no pilot"


@pytest.mark.parametrize(
    "rows,error",
    [
        ([sdp("forward", 100)], "has no DDP row: time to target is measured against DDP's"),
        ([{**DDP, "target_steps": None}], "has no target DDP reached (its DDP row has no target_steps)"),
    ],
)
def test_a_pilot_without_a_ddp_that_reached_its_target_is_refused(tmp_path, rows, error):
    with pytest.raises(ConfigError) as err:
        load_pilot(pilot_csv(tmp_path, rows), kind="image")
    assert str(err.value) == f"quality={str(tmp_path / 'pilot.csv')!r}: {error}"


def test_a_csv_from_before_the_pilot_columns_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text("variant,coverage,protocol,steps,target,target_steps\nDDP,1.0,same_iteration,10,0.9,5\n")
    with pytest.raises(ConfigError) as err:
        load_pilot(path, kind="image")
    assert str(err.value).endswith(
        ": lacks the columns kind, masking, model, inner_width, world_size, global_batch, seq_len, granularity, "
        "outer, sync_every (run sdp.collect on its run dirs again)"
    )


def test_a_folder_of_run_dirs_is_the_pilot_its_csv_is(tmp_path):
    from sdp.analysis.tables import collect

    runs = Path("results/cpu_replica/runs/vision/seeds")
    collect([runs], tmp_path, command="test", make_plots=False)
    from_csv = load_pilot(tmp_path / "resnet_tiny_fashion_mnist.csv", kind="image")
    from_dirs = load_pilot(runs, kind="image")
    assert from_dirs.reach == from_csv.reach and from_dirs.scale == from_csv.scale
    assert from_dirs.target == pytest.approx(from_csv.target, rel=1e-12)
    assert len(from_dirs.reach) == 12  # 21 rows less 5 controls, the two protocols of 4 variants as one
