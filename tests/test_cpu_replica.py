"""`make tables`' path (scripts/cpu_replica.py) with the sweeps played by a fake that writes run
dirs as a run does (its real config.yaml, a summary.json and metrics.jsonl): the probe's budget,
each row's learning-rate grid and choice, the seeds each row gets at its chosen rate, and the
tables and claims built from the chosen runs only. A real run of every row is `make tables`."""

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from sdp.launching.sweep import expand, job_dir
from sdp.run.config import record_yaml, typed_config

SCRIPTS = Path(__file__).parents[1] / "scripts"


def _script():
    sys.path.insert(0, str(SCRIPTS))  # lowcomm.py and rho_convergence.py import it by name
    try:
        spec = importlib.util.spec_from_file_location("cpu_replica_under_test", SCRIPTS / "cpu_replica.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


# The best lr factor of each row in the fake, and its accuracy there.
# DDP's is inside the grid, the dense control's on its lower edge (one extension, to x0.25, finds
# it), N-SDP forward's beyond its upper edge even after the two extensions, to x4 and x8.
BEST = {("none", 1.0): (1.0, 0.90), ("none", 0.5): (0.5, 0.86), ("forward", 1.0): (16.0, 0.88)}
DEFAULT_LR = {"resnet": 2e-3, "llama": 3e-3}  # replica_fmnist's, replica_text's


def _accuracy(cfg) -> float:
    factor, top = BEST[cfg.masking.name, cfg.model.inner_width]
    return top - 0.02 * math.log2(cfg.optim.lr / (DEFAULT_LR[cfg.model.family] * factor)) ** 2 + 0.002 * (cfg.seed % 3)


def _fake_run(run_dir: Path, job: list[str]) -> None:
    cfg = typed_config(job)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(record_yaml(cfg))
    steps, every, acc = cfg.trainer.max_steps, cfg.trainer.eval_every, _accuracy(cfg)
    text = cfg.model.family == "llama"
    # Rising to its final accuracy at 40% of the steps, flat after.
    evals = [(s, acc * min(1.0, s / (0.4 * steps))) for s in range(every, steps + 1, every)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval_acc": v}) + "\n" for s, v in evals))
    gate = {"metric": "eval_acc", "from_step": int(0.8 * steps), "to_step": steps, "threshold": 0.005}
    summary = {
        "status": "completed",
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "world_size": 4,
        "coverage": cfg.masking.coverage,
        "masking": cfg.masking.name,
        "parallelism": "ddp",
        "activation_checkpointing": "none",
        "mixed_precision": "fp32",
        "protocol": str(cfg.trainer.protocol),
        "device": "cpu",
        "seed": cfg.seed,
        "inner_width": cfg.model.inner_width,
        "granularity": cfg.masking.granularity,  # Strategy.describe()'s, beside the fields
        "steps": steps,
        "eval_acc": None if text else acc,
        "eval_loss": 1 - acc,
        "throughput_unit": "tokens/s" if text else "samples/s",
        "eval_token_acc": acc if text else None,
        "memory": {"params_bytes": 2**28, "grads_bytes": 2**28, "optim_bytes": 2**29, "peak_bytes": 2**30},
        "comm_bytes_per_step": 2**20,
        "step_time_s": 0.5,
        "convergence": {**gate, "change": 0.0, "plateaued": True, "reason": ""},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))


def _play(root: Path, table: str, names: tuple[str, ...], extra: list[str], out: Path | None = None):
    """One call of the script over the named rows of `table`, 3 seeds for the full rows and 2 for
    the rest, its sweeps played by the fake (which, like a sweep, skips a completed run dir);
    returns (exit code, runs dir, out dir, sweeps: (dir, the jobs it ran))."""
    module, sweeps = _script(), []

    def fake_sweep(argv: list[str]) -> int:
        options = dict(a.split("=", 1) for a in argv if a.startswith("sweep."))
        overrides = [a for a in argv if not a.startswith("sweep.")]
        swept = {o.split("=", 1)[0] for o in overrides if "," in o}
        jobs = [(job_dir(Path(options["sweep.dir"]), i, job, swept), job) for i, job in enumerate(expand(overrides))]
        jobs = [(run_dir, job) for run_dir, job in jobs if not (run_dir / "summary.json").is_file()]
        sweeps.append((options["sweep.dir"], [job for _, job in jobs]))
        for run_dir, job in jobs:
            _fake_run(run_dir, job)
        return 0

    module.run_sweep = fake_sweep
    module.MEMORY_TABLE = SCRIPTS.parent / module.MEMORY_TABLE  # the committed one
    module.CUDA = root / "none" / "*.json"
    runs, out = root / "runs", out or root / "out"
    args = ["--tables", table, "--runs", str(runs), "--out", str(out), "--seed-counts", "3", "2", "--rows", *names]
    args += extra
    return module.main(args), runs, out, sweeps


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """The vision table: DDP, the dense control at 0.5 and N-SDP forward at C = 0.25."""
    names = ("ddp", "dense-w0.5", "n_sdp_forward-c0.25")
    return _play(tmp_path_factory.mktemp("replica"), "vision", names, [])


def test_the_probe_measures_the_budget_and_the_header_states_it(replica):
    rc, runs, out, sweeps = replica
    assert rc == 0
    # The probe: DDP, 1000 steps, 20 evaluations, flat from step 400; smoothed over (m - 100, m],
    # it is on its final value from step 450, so the budget is 900.
    probe_dir, (probe,) = sweeps[0]
    assert probe_dir.endswith("vision/probe") and "trainer.max_steps=1000" in probe
    assert "trainer.eval_every=50" in probe and "variant=ddp" in probe
    budget = json.loads((out / "budgets.json").read_text())["vision"]
    assert (budget["settled_step"], budget["budget"]) == (450, 900)
    table = (out / "resnet_tiny_fashion_mnist.md").read_text()
    assert "Step budget: 900 steps, twice the step (450)" in table
    # Every later run takes the budget, evaluated 5 times.
    assert all(
        "trainer.max_steps=900" in job and "trainer.eval_every=180" in job for _, jobs in sweeps[1:] for job in jobs
    )


def test_every_row_runs_its_grid_on_seed_0_and_its_seeds_at_the_best_rate(replica):
    _, runs, out, sweeps = replica
    grids = {}
    for d, jobs in sweeps:  # a grid extended past its edge is a second sweep of the same dir
        if "/grid/" in d:
            grids.setdefault(Path(d).name, []).extend(jobs)
    lrs = {name: [next(o for o in j if o.startswith("optim.lr=")) for j in jobs] for name, jobs in grids.items()}
    assert lrs == {
        "ddp": ["optim.lr=0.001", "optim.lr=0.002", "optim.lr=0.004"],
        "dense-w0.5": ["optim.lr=0.001", "optim.lr=0.002", "optim.lr=0.004", "optim.lr=0.0005"],  # x0.25 last
        "n_sdp_forward-c0.25": [f"optim.lr={r:g}" for r in (0.001, 0.002, 0.004, 0.008, 0.016)],
    }
    assert all("seed=0" in j for jobs in grids.values() for j in jobs)
    # A row's seeds sit in a folder of their rate.
    seeds = {Path(d).parent.name: jobs for d, jobs in sweeps if "/seeds/" in d}
    assert sorted(Path(d).name for d, _ in sweeps if "/seeds/" in d) == ["lr_0.001", "lr_0.002", "lr_0.016"]
    # DDP and the dense control: 3 seeds (seed 0 is the grid's run); C = 0.25: 2.
    lr_of = {name: {o for j in jobs for o in j if o.startswith(("optim.lr=", "seed="))} for name, jobs in seeds.items()}
    assert lr_of == {
        "ddp": {"optim.lr=0.002", "seed=1", "seed=2"},
        "dense-w0.5": {"optim.lr=0.001", "seed=1", "seed=2"},
        "n_sdp_forward-c0.25": {"optim.lr=0.016", "seed=1"},
    }
    grid_md = (out / "vision_lr_grid.md").read_text()
    assert "| row | x0.25 | x0.5 | x1 | x2 | x4 | x8 | chosen lr | on the edge |" in grid_md
    assert "| ddp | not run | 0.8800 | 0.9000 | 0.8800 | not run | not run | 0.002 (x1) | no |" in grid_md
    assert "| dense-w0.5 | 0.8400 | 0.8600 | 0.8400 | 0.7800 | not run | not run | 0.001 (x0.5) | no |" in grid_md
    row = "| n_sdp_forward-c0.25 | not run | 0.3800 | 0.5600 | 0.7000 | 0.8000 | 0.8600 | 0.016 (x8) | yes |"
    assert row in grid_md


def test_a_grid_given_fewer_factors_than_it_ran_keeps_its_runs_and_adds_the_new_one(replica, tmp_path):
    """`--grid 0.5 1 2 16` on a row extended to x8: the five points run keep their job dirs, only
    x16 runs (the factors given first would renumber x4 and x8 and run them again). The rows the
    call does not run, which never ran x16, stay in the table: their grids are complete under the
    default factors."""
    shutil.copytree(replica[1], tmp_path / "runs")
    _, _, out, sweeps = _play(tmp_path, "vision", ("n_sdp_forward-c0.25",), ["--grid", "0.5", "1", "2", "16"])
    grid = [jobs for d, jobs in sweeps if "/grid/" in d]
    assert [[o for o in job if o.startswith("optim.lr=")] for jobs in grid for job in jobs] == [["optim.lr=0.032"]]
    csv = (out / "resnet_tiny_fashion_mnist.csv").read_text().splitlines()
    assert sorted(r.split(",")[0] for r in csv[1:]) == ["DDP", "DDP (inner width 0.5)", "N-SDP forward"]


def test_the_tables_hold_the_chosen_runs_only(replica):
    _, _, out, _ = replica
    csv = (out / "resnet_tiny_fashion_mnist.csv").read_text().splitlines()
    head = csv[0].split(",")
    rows = {r.split(",")[0]: dict(zip(head, r.split(","), strict=True)) for r in csv[1:]}
    assert sorted(rows) == ["DDP", "DDP (inner width 0.5)", "N-SDP forward"]
    assert [(rows[v]["runs"], rows[v]["lr"]) for v in sorted(rows)] == [("3", "0.002"), ("3", "0.001"), ("2", "0.016")]
    # The grid's other points are not in the table: DDP's mean is over its chosen-rate seeds.
    assert float(rows["DDP"]["eval_acc"]) == pytest.approx(0.90 + 0.002)
    assert (
        "Learning rates: chosen on a grid, [vision_lr_grid.md](vision_lr_grid.md)."
        in (out / "resnet_tiny_fashion_mnist.md").read_text()
    )
    assert (out / "claims.md").is_file()


def test_out_keeps_every_completed_run_and_a_call_with_empty_runs_reruns_none(replica, tmp_path):
    _, runs, out, sweeps = replica
    ran = sorted({Path(d, p.name).relative_to(runs) for d, _ in sweeps for p in Path(d).iterdir() if p.is_dir()})
    kept = sorted(p.parent.relative_to(out / "runs") for p in (out / "runs").glob("**/summary.json"))
    assert kept == ran and len(kept) == 1 + 3 + 4 + 5 + 2 + 2 + 1  # the probe, 3 grids, the seeds
    recorded = sorted(f.name for f in (out / "runs" / kept[0]).iterdir())
    assert recorded == ["config.yaml", "metrics.jsonl", "summary.json"]
    table = (out / "resnet_tiny_fashion_mnist.md").read_text()
    # Another machine: no --runs, the committed OUT. Every run is restored and none runs again.
    again = tmp_path / "out"
    shutil.copytree(out, again)
    rc, _, _, replayed = _play(tmp_path, "vision", ("ddp", "dense-w0.5", "n_sdp_forward-c0.25"), [], out=again)
    assert rc == 0 and [jobs for _, jobs in replayed] == [[]] * len(replayed) and replayed
    assert (again / "resnet_tiny_fashion_mnist.md").read_text() == table


@pytest.mark.slow  # end to end; make test runs it, make test-fast leaves it (docs/testing.md)
def test_calls_over_other_rows_build_one_table_and_a_moved_choice_is_seeded_anew(tmp_path, monkeypatch):
    from sdp.analysis import lrgrid

    def table(out: Path) -> dict:
        csv = (out / "resnet_tiny_fashion_mnist.csv").read_text().splitlines()
        head = csv[0].split(",")
        return {r.split(",")[0]: dict(zip(head, r.split(","), strict=True))["lr"] for r in csv[1:]}

    out = tmp_path / "out"
    # A first call, under one extension: N-SDP forward (best at x16) is chosen at x4 and seeded.
    monkeypatch.setattr(lrgrid, "EXTENSIONS", 1)
    assert _play(tmp_path, "vision", ("n_sdp_forward-c0.25",), [], out=out)[0] == 0
    assert table(out) == {"N-SDP forward": "0.008"}
    # Under two, a call over DDP alone: the forward row's grid would extend, so it is not complete
    # and is left out; DDP's is tabulated.
    monkeypatch.setattr(lrgrid, "EXTENSIONS", 2)
    rc, runs, _, sweeps = _play(tmp_path, "vision", ("ddp",), [], out=out)
    assert rc == 0 and all("/n_sdp_forward" not in d for d, _ in sweeps)
    assert table(out) == {"DDP": "0.002"}
    # The forward row again: its grid adds x8, and its seed runs at the new rate, beside the old.
    rc, _, _, sweeps = _play(tmp_path, "vision", ("n_sdp_forward-c0.25",), [], out=out)
    rates = [
        (Path(d).relative_to(runs).as_posix(), [o for j in jobs for o in j if o.startswith("optim.lr=")])
        for d, jobs in sweeps
    ]
    assert rc == 0 and [r for r in rates if r[1]] == [
        ("vision/grid/n_sdp_forward-c0.25", ["optim.lr=0.016"]),
        ("vision/seeds/n_sdp_forward-c0.25/lr_0.016", ["optim.lr=0.016"]),
    ]
    assert table(out) == {"DDP": "0.002", "N-SDP forward": "0.016"}  # DDP from the earlier call
    old = runs / "vision/seeds/n_sdp_forward-c0.25/lr_0.008"
    (kept,) = [p for p in old.iterdir() if p.is_dir()]
    assert "lr: 0.008" in (kept / "config.yaml").read_text() and (kept / "summary.json").is_file()


def test_the_grid_chooses_the_best_point_a_tie_goes_to_x1_and_a_failed_run_never_wins():
    from sdp.analysis.lrgrid import GridPoint, choose, on_edge

    def p(factor, quality, status="completed", plateaued=True):
        return GridPoint(factor, 1e-3 * factor, Path("r"), status, quality, plateaued)

    tie = [p(0.5, 4.2), p(1.0, 4.2), p(2.0, 4.5)]
    assert choose(tie, "text").factor == 1.0 and not on_edge(tie, choose(tie, "text"))
    failed = [p(0.5, 4.4), p(1.0, 4.3), p(2.0, None, "failed")]
    assert choose(failed, "text").factor == 1.0
    assert choose([p(2.0, None, "failed")], "text") is None
    assert choose([p(0.5, 0.9), p(1.0, 0.8)], "image").factor == 0.5
    # The gate does not tune: a point still moving at its end wins when its value is the best
    # (the row then gets no verdict), as B-SDP forward's x2 beats its converged x0.5.
    moving = [p(0.5, 0.8818), p(1.0, 0.8980, plateaued=False), p(2.0, 0.9031, plateaued=False)]
    assert choose(moving, "image").factor == 2.0
    assert choose([p(1.0, 0.91, plateaued=None), p(2.0, 0.90)], "image").factor == 1.0


def test_a_probe_that_fails_its_gate_records_how_far_its_metric_moved():
    module = _script()
    gate = {"metric": "eval_loss", "change": 0.015665, "plateaued": False, "threshold": 0.005}
    moved = "the probe did not settle: its smoothed eval loss moved 1.57% over its last fifth, against 0.5%"
    assert module._unsettled(gate) == moved
    assert module._unsettled({**gate, "change": None}) == "the probe did not settle"


@pytest.mark.slow  # end to end; make test runs it, make test-fast leaves it (docs/testing.md)
def test_the_language_table_states_its_loss_against_n_gram_models_and_an_unmeasured_budget(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j}\n\n" for j in range(30)))
    extra = [f"dataset.path={corpus}", "dataset.eval_every=2", "dataset.vocab_size=300", "dataset.seq_len=32"]
    rc, _, out, sweeps = _play(tmp_path, "language", ("ddp", "b_sdp_*-c0.5"), extra)
    assert rc == 0
    # replica_text's 2 blocks leave a worker without one under B-SDP at C = 0.5: not run, and said.
    assert [Path(d).name for d, _ in sweeps] == ["probe", "ddp", "lr_0.003"]
    # The fake's probe logs no eval loss: no budget, and the runs take the default 1080 steps.
    assert json.loads((out / "budgets.json").read_text())["language"]["budget"] is None
    assert all("trainer.max_steps=1080" in job for _, jobs in sweeps[1:] for job in jobs)
    header = (out / "llama_tiny_local_text.md").read_text()
    assert "Step budget: **not measured** (the probe did not settle); the runs take the default 1080" in header
    refused = (
        "Rows this model does not admit at K = 4, so not run: b_sdp_backward-c0.5, b_sdp_forward-c0.5, "
        "b_sdp_backward-c0.5-flop_matched, b_sdp_forward-c0.5-flop_matched (`masking.coverage=0.5: leaves "
        "worker 2 of 4 no block (the model has 2, each held by 2 of 4 workers); raise the coverage, use fewer "
        "workers or masking.granularity=neuron`); b_sdp_forward-c0.25 (`masking.coverage=0.25: leaves worker "
        "2 of 4 no block (the model has 2, each held by 1 of 4 workers); raise the coverage, use fewer workers "
        "or masking.granularity=neuron`)."
    )
    assert refused in header
    # DDP's loss over its 3 seeds: 1 - (0.90, 0.902, 0.904) -> 0.098.
    line = next(line for line in header.splitlines() if line.startswith("Reference losses on the eval split"))
    assert "nats/token. DDP's eval loss 0.098 is" in line and "nats below the bigram's" in line


def test_the_plan_projects_the_runs_left_from_the_probes_step_time_and_runs_nothing(replica, capsys, tmp_path):
    _, runs, out, _ = replica
    # Another session's copy: its records and runs, less DDP's seed 2 (gone from both).
    runs, out = shutil.copytree(runs, tmp_path / "runs"), shutil.copytree(out, tmp_path / "out")
    for root in (runs, out / "runs"):
        (gone,) = (root / "vision/seeds/ddp/lr_0.002").glob("*seed_2")
        shutil.rmtree(gone)
    module = _script()
    module.run_sweep = lambda argv: pytest.fail(f"--plan ran a sweep: {argv}")
    args = ["--plan", "--tables", "vision", "--runs", str(runs), "--out", str(out), "--seed-counts", "3", "2"]
    args += ["--rows", "ddp", "dense-w0.5", "n_sdp_forward-c0.2*", "b_sdp_backward-c0.5"]  # fnmatch patterns
    assert module.main(args) == 0
    # 3 grid points + 2 more seeds for DDP, the control and B-SDP, + 1 for C = 0.25: 19 runs of 900
    # steps. Left: DDP's seed 2 and all 5 of B-SDP's: (5400 x 0.5 s + 6 x 20 s) / 3600 s = 0.78 h.
    assert capsys.readouterr().out == (
        "cpu_replica: vision: 4 rows, 19 runs of 900 steps; 6 runs left, 5400 steps: 0.8 h at DDP's 0.500 s "
        "a step and 20 s a run\n"
    )


def test_the_serial_workers_floor_times_a_workers_step_of_each_table():
    spec = importlib.util.spec_from_file_location("serial_workers_floor", SCRIPTS / "serial_workers_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Every table's experiment, as make tables runs it.
    assert module.TABLES == {table: spec[0] for table, spec in _script().TABLES.items()}
    assert all(module.worker_step_s(experiment, steps=1) > 0 for experiment in module.TABLES.values())
