"""Resuming on another number of workers: a run checkpointed at K = 4 resumes at K = 2 and
then at K = 4 again. At each resume the state the new ranks hold, gathered back, equals the
checkpoint bitwise (tests/faults.py's `recut` probe); the loss goes on as an uninterrupted
run's does; an impossible K is refused before any process group, with the allowed ones."""

from pathlib import Path

import pytest
import torch
from conftest import job_env, launch, read_run
from ranks import run_ranks
from test_resume import COMMON, TINY

from sdp.errors import ConfigError
from sdp.models import build_on_meta
from sdp.run.checkpoint import complete_checkpoints
from sdp.run.config import load_config
from sdp.run.preflight import resize_refusal
from sdp.run.resume import read_portable

RUN = [*TINY, *COMMON, "trainer.checkpoint_every=0"]  # llama_tiny, 6 steps, a log record per step
MODES = {
    "ddp": [],
    # A new mask after steps 2 and 4: each resume re-cuts the state for the mask epoch of its
    # step at its own K (epoch 1 at K = 2, epoch 2 at K = 4).
    "sdp-forward-resampled": ["masking=forward", "masking.coverage=0.5", "masking.resample_every=2"],
}


def resume_probed(overrides: list[str], *, nproc: int, cwd: Path) -> dict:
    """Launch a resume with the recut probe armed (on forked ranks, as the other launches
    here); returns what the ranks held right after it."""
    proc = run_ranks("faults:main", ["recut", *overrides], nproc=nproc, cwd=cwd, env=job_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(cwd / "recut.pt", weights_only=True)


def assert_bitwise(held: dict, run_dir: Path, step: int) -> None:
    """What the resumed ranks hold is the checkpoint of `step`: every model tensor, every
    parameter's optimizer state (AdamW's moments), the step count and the group settings."""
    (ckpt,) = [c for c in complete_checkpoints(run_dir) if c.step == step]
    saved, _ = read_portable(ckpt)
    assert held["model"].keys() == saved.model.keys()
    for name, t in saved.model.items():
        assert torch.equal(held["model"][name], t), name
    assert held["optim"].keys() == saved.optim.keys() == {"exp_avg", "exp_avg_sq"}
    params = {n for n, _ in build_on_meta(load_config(RUN, world_size=1, offline=True).model).named_parameters()}
    for key, per_name in saved.optim.items():
        assert per_name.keys() == held["optim"][key].keys() == params  # every parameter's, every unit's
        for name, t in per_name.items():
            assert torch.equal(held["optim"][key][name], t), (key, name)
    assert {k: float(v) for k, v in held["scalars"].items()} == {"step": float(step)}
    assert held["groups"] == saved.groups


def train_losses(run_dir: Path) -> list[float]:
    return [r["train_loss"] for r in read_run(run_dir)[1] if "train_loss" in r]


@pytest.mark.dist
@pytest.mark.parametrize("mode", MODES)
def test_a_run_resumes_on_half_then_twice_the_workers(tmp_path, mode):
    base, run_dir = [*RUN, *MODES[mode]], tmp_path / "run"
    straight = [tmp_path / f"straight_seed{seed}" for seed in (0, 1)]
    for seed, ref in enumerate(straight if mode != "ddp" else straight[:1]):
        proc = launch([*base, f"seed={seed}", f"run_dir={ref}"], nproc=4, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    # K = 4 to step 3; K = 2 from 3 to 5; K = 4 again from 5 to the end.
    proc = launch([*base, f"run_dir={run_dir}", "trainer.stop_at_step=3"], nproc=4, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    held = resume_probed([*base, f"run_dir={run_dir}", "trainer.stop_at_step=5"], nproc=2, cwd=tmp_path)
    assert_bitwise(held, run_dir, 3)
    assert_bitwise(resume_probed([*base, f"run_dir={run_dir}"], nproc=4, cwd=tmp_path), run_dir, 5)
    summary, records = read_run(run_dir)
    assert summary["status"] == "completed" and summary["world_size"] == 4 and summary["resumed_from"] == 5
    assert summary["resumes"] == [
        {"step": 3, "world_size": 2, "checkpointed_with": 4},
        {"step": 5, "world_size": 4, "checkpointed_with": 2},
    ]
    assert [r["step"] for r in records if "train_loss" in r] == [1, 2, 3, 4, 5, 6]
    losses, ref = train_losses(run_dir), train_losses(straight[0])
    assert losses[:3] == ref[:3]  # the same launch as the reference, to step 3
    if mode == "ddp":
        # The same samples in every step at any K (the global order is split by rank): the
        # losses differ from the uninterrupted run's only by the order of float additions.
        assert losses == pytest.approx(ref, rel=1e-5)
    else:
        # Other K, other subnetworks: no jump larger than the difference two seeds make.
        noise = max(abs(a - b) for a, b in zip(ref, train_losses(straight[1]), strict=True))
        assert max(abs(a - b) for a, b in zip(losses[3:], ref[3:], strict=True)) <= noise


@pytest.mark.dist
def test_neuron_backward_masking_recuts_its_held_runs_exactly_on_another_world_size(tmp_path):
    # Backward masking trains one Parameter per contiguous run of held units, its columns kept
    # outermost (o_proj, down_proj): K = 4 to step 3, K = 2 to step 5, K = 4 to the end. What each
    # resume's ranks hold, gathered back, is the checkpoint bit for bit.
    base, run_dir = [*RUN, "masking=backward", "masking.coverage=0.5", f"run_dir={tmp_path / 'run'}"], tmp_path / "run"
    proc = launch([*base, "trainer.stop_at_step=3"], nproc=4, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_bitwise(resume_probed([*base, "trainer.stop_at_step=5"], nproc=2, cwd=tmp_path), run_dir, 3)
    assert_bitwise(resume_probed(base, nproc=4, cwd=tmp_path), run_dir, 5)
    summary, _ = read_run(run_dir)
    assert summary["status"] == "completed" and [r["world_size"] for r in summary["resumes"]] == [2, 4]


def test_an_impossible_world_size_is_refused_with_the_ones_that_resume(tmp_path):
    # Checkpointed at K = 4 with C = 0.5: K = 3 would give 1.5 holders per unit.
    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 3, "format": 2, "world_size": 4, "config": {}, "files": {}}')
    overrides = [*RUN, *MODES["sdp-forward-resampled"], f"run_dir={run_dir}"]
    with pytest.raises(ConfigError) as info:
        load_config(overrides, world_size=3, offline=True, check_data=False)
    refusal = resize_refusal(overrides, info.value, world_size=3)
    assert str(refusal) == (
        f"run_dir='{run_dir}': was checkpointed with 4 processes and cannot resume on 3 (masking.coverage=0.5: "
        "gives C x K = 0.5 x 3 = 1.5 holders per unit, which must be a whole number >= 1; allowed with K=3 "
        "workers: 0.333333, 0.666667, 1); it resumes on 2, 4, 8 processes (of 1 to 8)"
    )
    # The same launch at the checkpoint's K, or a config that is wrong at any K, is not a resize.
    assert resize_refusal(overrides, info.value, world_size=4) is None
    bad = [*overrides, "masking.coverage=0.3"]
    with pytest.raises(ConfigError) as other:
        load_config(bad, world_size=3, offline=True, check_data=False)
    assert resize_refusal(bad, other.value, world_size=3) is None


CAPACITY = {4: "masking.capacity=[1,1,0.5,0.5]", 2: "masking.capacity=[1,0.5]"}  # the same mean, 0.75


@pytest.mark.dist
def test_a_run_of_capacities_resumes_on_two_workers_with_their_list(tmp_path):
    # Four cards (two large, two small) to step 3, then one large and one small from step 3.
    base, run_dir = [*RUN, "masking=forward"], tmp_path / "run"
    proc = launch([*base, CAPACITY[4], f"run_dir={run_dir}", "trainer.stop_at_step=3"], nproc=4, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The four workers' list on two workers: refused in one line, before any process group.
    same = [*base, CAPACITY[4], f"run_dir={run_dir}"]
    with pytest.raises(ConfigError) as info:
        load_config(same, world_size=2, offline=True, check_data=False)
    assert str(resize_refusal(same, info.value, world_size=2)) == (
        f"run_dir='{run_dir}': was checkpointed with 4 processes and cannot resume on 2 (masking.capacity=[1.0, "
        "1.0, 0.5, 0.5]: has 4 entries for K=2 SDP workers (the world size); give one capacity per worker (a resume "
        "on another world size needs the list for the new K), for example masking.capacity=[1,1]); give "
        "masking.capacity for the new workers, with the same mean 0.75 (the run's coverage)"
    )
    held = resume_probed([*base, CAPACITY[2], f"run_dir={run_dir}"], nproc=2, cwd=tmp_path)
    assert_bitwise(held, run_dir, 3)
    summary, records = read_run(run_dir)
    assert summary["status"] == "completed" and summary["resumes"] == [
        {"step": 3, "world_size": 2, "checkpointed_with": 4}
    ]
    assert summary["mask"]["capacity"] == [1, 0.5] and summary["mask"]["coverage_per_worker"] == [1.0, 0.5]
    assert [r["step"] for r in records if "train_loss" in r] == [1, 2, 3, 4, 5, 6]
