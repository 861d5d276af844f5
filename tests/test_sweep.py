"""Sweeps: Hydra's sweep syntax expanded into one torchrun run per job, checked before launch."""

import json
import re
from pathlib import Path

import pytest
from wandb_records import offline_run

from sdp.errors import ConfigError
from sdp.launching.sweep import COUNTS, FLAGS, expand, plan, run_sweep, split_options

BASE = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=8"]
BASE += ["trainer.max_steps=2", "logger=none", "dataset.eval_batches=1", "trainer.progress=false"]


def test_the_cross_product_in_hydras_order():
    jobs = expand(["a=1", "variant=ddp,n_sdp_forward", "masking.coverage=0.5,1.0"])
    assert [[o.split("=")[1] for o in job[1:]] for job in jobs] == [
        ["ddp", "0.5"],
        ["ddp", "1.0"],
        ["n_sdp_forward", "0.5"],
        ["n_sdp_forward", "1.0"],
    ]
    assert len(expand(["optim.lr=range(1,4)", "seed=0,1"])) == 6


def test_sweep_options_and_bad_sweeps_are_one_error():
    options, overrides = split_options(["sweep.nproc=4", "a=1", "sweep.dir=/x"])
    assert options == {"nproc": "4", "dir": "/x"} and overrides == ["a=1"]
    with pytest.raises(ConfigError, match="sweep.nprocs='4': allowed: sweep.nproc, sweep.dir, sweep.dry_run"):
        split_options(["sweep.nprocs=4"])
    with pytest.raises(ConfigError, match="run_dir"):
        expand(["run_dir=a,b"])


def _sweep_option_rows() -> list[tuple[str, str, str]]:
    """The rows of docs/bad-input.md's 'Sweep options' table: (what, option, error)."""
    text = (Path(__file__).parents[1] / "docs" / "bad-input.md").read_text().split("## Sweep options")[1]
    row = re.compile(r"^\| (.+?) \| `([^`]*)` \| `(.+)` \|$")
    return [m.groups() for m in map(row.match, text.splitlines()) if m]


SWEEP_OPTION_ROWS = _sweep_option_rows()


def test_the_sweep_option_table_covers_every_typed_option():
    named = {option.split("=")[0].removeprefix("sweep.") for _, option, _ in SWEEP_OPTION_ROWS}
    assert set(FLAGS) | set(COUNTS) <= named and len(SWEEP_OPTION_ROWS) >= 8


@pytest.mark.parametrize("what,option,error", SWEEP_OPTION_ROWS, ids=[r[0] for r in SWEEP_OPTION_ROWS])
def test_a_bad_sweep_option_is_one_line_and_nothing_runs(what, option, error, tmp_path, capsys):
    from sdp.train import main

    sweep_dir = tmp_path / "sweep"
    argv = ["-m", *BASE, "variant=ddp,n_sdp_forward", "masking.coverage=1.0", f"sweep.dir={sweep_dir}"]
    assert main([*argv, option]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {error}"]
    assert not sweep_dir.exists()


@pytest.mark.parametrize("word", ["on", "YES", "1", "True"])
def test_every_spelling_of_true_makes_a_dry_run(word, tmp_path):
    # Before: anything but 1/true/yes (sweep.dry_run=on) launched every job.
    from sdp.train import main

    argv = ["-m", *BASE, "variant=ddp,n_sdp_forward", "masking.coverage=1.0", f"sweep.dir={tmp_path}"]
    sweep_dir = tmp_path / "sweep"
    assert main([*argv, f"sweep.dir={sweep_dir}", f"sweep.dry_run={word}"]) == 0
    assert not sweep_dir.exists()  # no job ran, and a dry run writes nothing


def test_every_job_is_checked_before_anything_runs(tmp_path, capsys):
    jobs = plan([*BASE, "variant=ddp,n_sdp_forward", "masking.coverage=0.5,1.0"], root=tmp_path, nproc=2)
    assert [j.status for j in jobs] == ["invalid", "planned", "planned", "planned"]
    assert jobs[0].error.startswith("masking.coverage=0.5: masking=none holds every unit")
    assert jobs[2].run_dir == str(tmp_path / "002-variant_n_sdp_forward-masking.coverage_0.5")
    # A dry run lists the jobs; nothing is launched or written.
    argv = [*BASE, "variant=ddp", "masking.coverage=0.5", f"sweep.dir={tmp_path / 's'}", "sweep.dry_run=true"]
    assert run_sweep(argv) == 2
    assert "invalid" in capsys.readouterr().out
    assert not (tmp_path / "s").exists()


def test_every_job_of_a_sweep_shares_its_wandb_group(tmp_path):
    jobs = plan([*BASE, "variant=ddp,n_sdp_forward"], root=tmp_path / "s", nproc=2)
    assert [j.overrides[-1] for j in jobs] == ["logger.group=s", "logger.group=s"]
    jobs = plan([*BASE, "variant=ddp,n_sdp_forward"], root=tmp_path / "s", nproc=2, name="table1")
    assert {j.overrides[-1] for j in jobs} == {"logger.group=table1"}
    jobs = plan([*BASE, "variant=ddp", "logger.group=mine"], root=tmp_path / "s", nproc=2, name="table1")
    assert [o for o in jobs[0].overrides if o.startswith("logger.group")] == ["logger.group=mine"]


@pytest.mark.dist
def test_a_sweep_runs_each_job_once_and_a_rerun_skips_finished_ones(tmp_path, capsys):
    # W&B (offline): every job in the sweep's group, its variant as job_type and top-level config keys.
    argv = [o for o in BASE if o != "logger=none"] + ["logger=wandb", "logger.mode=offline", "sweep.name=paper"]
    argv += ["variant=ddp,n_sdp_forward", "masking.coverage=1.0", "sweep.nproc=2", f"sweep.dir={tmp_path}"]
    assert run_sweep(argv) == 0
    jobs = json.loads((tmp_path / "sweep.json").read_text())
    assert [j["status"] for j in jobs] == ["completed", "completed"]
    for job, variant in zip(jobs, ["DDP", "N-SDP forward"], strict=True):
        summary = json.loads((tmp_path / job["run_dir"].split("/")[-1] / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 2
        wandb = offline_run(job["run_dir"])
        assert (wandb["group"], wandb["job_type"]) == ("paper", variant)
        pivot = {k: wandb["config"][k] for k in ("variant", "coverage", "protocol")}
        assert pivot == {"variant": variant, "coverage": 1.0, "protocol": "same_iteration"}
        assert wandb["config"]["model"]["name"] == "llama_tiny" and "train_loss" in wandb["logged"]
    assert json.loads((tmp_path / jobs[1]["run_dir"].split("/")[-1] / "summary.json").read_text())["masking"] == (
        "forward"
    )
    assert run_sweep(argv) == 0  # the same sweep again: nothing left to run
    record = (tmp_path / "sweep.json").read_text()
    assert [j["status"] for j in json.loads(record)] == ["skipped", "skipped"]
    # The same sweep with another setting: a completed job with another config is refused
    # (before: skipped silently); a dry run of it writes nothing, sweep.json keeps what ran.
    changed = [a.replace("trainer.max_steps=2", "trainer.max_steps=3") for a in argv]
    assert run_sweep([*changed, "sweep.dry_run=true"]) == 2
    assert (tmp_path / "sweep.json").read_text() == record
    capsys.readouterr()
    assert run_sweep(changed) == 2
    out = capsys.readouterr().out
    assert out.count("holds a completed run with another config (trainer.max_steps: 2 -> 3)") == 2
    assert [j["status"] for j in json.loads((tmp_path / "sweep.json").read_text())] == ["invalid", "invalid"]


@pytest.mark.dist
def test_a_failed_job_is_marked_and_the_others_complete(tmp_path):
    # The second job diverges at step 2 (NaN loss): it fails alone, with its reason.
    argv = [*BASE, "optim.lr=1e30,2e-3", "optim.warmup_steps=0", "sweep.nproc=2", f"sweep.dir={tmp_path}"]
    assert run_sweep(argv) == 1
    jobs = json.loads((tmp_path / "sweep.json").read_text())
    assert [j["status"] for j in jobs] == ["failed", "completed"]
    assert jobs[0]["exit_code"] != 0 and "step 2: non-finite loss or gradient" in jobs[0]["error"]
    assert jobs[1]["exit_code"] == 0 and jobs[1]["error"] is None


def test_the_entrypoint_takes_minus_m_as_a_sweep(tmp_path, capsys):
    from sdp.train import main

    argv = ["-m", *BASE, "variant=ddp,n_sdp_forward", "masking.coverage=1.0", f"sweep.dir={tmp_path}"]
    assert main([*argv, "sweep.dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"sweep: 2 jobs x 1 processes (torchrun) -> {tmp_path}\n")
    assert re.findall(r"\[(\d+)\] planned .* variant=(\w+)", out) == [("000", "ddp"), ("001", "n_sdp_forward")]
    assert not (tmp_path / "sweep.json").exists()


@pytest.mark.dist
def test_the_slurm_path_runs_on_submitits_local_executor(tmp_path):
    # The code path of sweep.launcher=slurm: one task per process, rank and rendezvous from
    # the job's environment, the entrypoint in each task; submitit's local executor stands
    # in for Slurm. One job: the sweep around it is the torchrun launcher's, tested above.
    argv = [*BASE, "variant=n_sdp_forward", "masking.coverage=1.0", "sweep.nproc=2", f"sweep.dir={tmp_path}"]
    assert run_sweep([*argv, "sweep.launcher=submitit_local", "sweep.timeout_min=10"]) == 0
    jobs = json.loads((tmp_path / "sweep.json").read_text())
    assert [j["status"] for j in jobs] == ["completed"] and all(j["cluster_id"] for j in jobs)
    for job in jobs:
        summary = json.loads((tmp_path / job["run_dir"].split("/")[-1] / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["world_size"] == 2


def test_bad_launchers_are_refused_before_anything_runs(tmp_path):
    assert run_sweep([*BASE, "sweep.launcher=pbs", f"sweep.dir={tmp_path}"]) == 2
    assert run_sweep([*BASE, "sweep.nodes=2", f"sweep.dir={tmp_path}"]) == 2
    assert not (tmp_path / "sweep.json").exists()
