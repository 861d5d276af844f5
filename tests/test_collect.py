"""Tables from run dirs: rows, seeds averaged, reductions against DDP, plots."""

import csv
import json

import pytest
import yaml
from wandb_records import offline_run

from sdp.analysis import lowcomm
from sdp.analysis.tables import _quality, build_rows, ci95, collect, find_runs, variant_label
from sdp.collect import main
from sdp.paths import DamagedFile
from sdp.rundir import Summary

GIB = 2**30


def _run(root, name, *, masking="none", gran="neuron", coverage=1.0, seed=0, acc=0.8, peak=4.0, lr=0.1, **extra):
    d = root / name
    d.mkdir(parents=True)
    summary = {
        "status": "completed",
        "model": "resnet_tiny",
        "dataset": "fashion_mnist",
        "masking": masking,
        "granularity": gran,
        "coverage": coverage,
        "protocol": "same_iteration",
        "seed": seed,
        "steps": 10,
        "eval_loss": 1.0 - acc,
        "eval_acc": acc,
        "throughput_unit": "samples/s",
        "memory": {
            "params_bytes": GIB,
            "grads_bytes": GIB,
            "optim_bytes": 2 * GIB * coverage,
            "peak_bytes": peak * GIB,
            "cuda_max_allocated_bytes": None,
        },
        "tokens_or_samples_per_s_per_rank": 100.0,
        "comm_bytes_per_step": 2**20,
        "step_time_s": 0.5,
        "parallelism": "ddp",
        "activation_checkpointing": "none",
        "mixed_precision": "fp32",
        "world_size": 4,
        "device": "cpu",
        # Converged unless a test says otherwise (its gate, as a run writes it).
        "convergence": {
            "metric": "eval_acc",
            "from_step": 8,
            "to_step": 10,
            "threshold": 0.005,
            "change": 0.001,
            "plateaued": True,
            "reason": "",
        },
        **extra,
    }
    (d / "summary.json").write_text(json.dumps(summary))
    config = {"seed": seed, "run_dir": str(d), "masking": {"name": masking, "coverage": coverage}, "optim": {"lr": lr}}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train_loss": 2.0 / s}) + "\n" for s in (1, 5, 10)))
    return d


def test_rows_average_seeds_and_compare_with_ddp(tmp_path):
    _run(tmp_path, "ddp", acc=0.8, peak=4.0)
    _run(tmp_path, "fwd-s0", masking="forward", coverage=0.5, acc=0.70, peak=2.0)
    _run(tmp_path, "fwd-s1", masking="forward", coverage=0.5, seed=1, acc=0.74, peak=2.0)
    _run(tmp_path, "fwd-lr", masking="forward", coverage=0.5, acc=0.6, peak=2.0, lr=0.2)  # another setting
    _run(tmp_path, "failed", masking="forward", coverage=0.5, status="failed")
    tables = build_rows(find_runs([tmp_path]))
    info = tables["resnet_tiny_fashion_mnist"]
    assert info["incomplete"] == 1 and info["kind"] == "image"
    rows = {r["variant"]: r for r in info["rows"]}
    assert list(rows)[0] == "DDP"
    sdp = rows["N-SDP forward [optim.lr=0.1]"]
    assert (
        sdp["runs"] == 2
        and sdp["eval_acc"] == pytest.approx(0.72)
        and sdp["eval_acc_std"] == pytest.approx(0.0283, abs=1e-4)
    )
    # 95% CI of a mean of 2 runs: t(0.975, 1) = 12.706 times sd / sqrt(2); none for one run.
    assert sdp["eval_acc_ci95"] == pytest.approx(12.706 * sdp["eval_acc_std"] / 2**0.5)
    assert rows["DDP"]["eval_acc_ci95"] is None
    assert sdp["peak_gib_vs_ddp"] == pytest.approx(-0.5)
    assert sdp["static_gib_vs_ddp"] == pytest.approx(3 / 4 - 1)
    assert rows["N-SDP forward [optim.lr=0.2]"]["eval_acc"] == pytest.approx(0.6)


def test_collect_reads_each_rows_rho_from_its_mask_json(tmp_path):
    _run(tmp_path, "ddp")
    fwd = _run(tmp_path, "fwd", masking="forward", coverage=0.5)
    (fwd / "mask.json").write_text(json.dumps({"spectral_gap": 0.25, "groups": []}))
    rows = {r["variant"]: r for r in build_rows(find_runs([tmp_path]))["resnet_tiny_fashion_mnist"]["rows"]}
    assert rows["N-SDP forward"]["spectral_gap"] == 0.25 and rows["DDP"]["spectral_gap"] is None
    (fwd / "mask.json").write_text("{")
    with pytest.raises(DamagedFile, match=r"mask.json: is not a mask record"):
        build_rows(find_runs([tmp_path]))


def test_labels_name_the_paper_variants_and_stacked_methods():
    head = dict(status="completed", model="m", dataset="d", world_size=8, coverage=0.5, protocol="same_iteration",
                device="cpu", seed=0, activation_checkpointing="none", mixed_precision="fp32")  # fmt: skip

    def label(**entries) -> str:
        return variant_label(Summary.from_json({**head, "parallelism": "ddp", **entries}))

    base = {"masking": "forward", "granularity": "block", "parallelism": "fsdp", "fsdp_degree": 4}
    assert label(**base, activation_checkpointing="full", mixed_precision="bf16") == (
        "B-SDP forward x FSDP(4) + AC + bf16"
    )
    assert label(masking="none", parallelism="fsdp") == "FSDP"
    assert label(masking="stochastic_depth") == "Stochastic depth"
    # Workers of different capacities are their own row; equal ones are the uniform mask's.
    mixed = {"masking": "forward", "granularity": "neuron", "mask": {"capacity": [1.0, 1.0, 0.5, 0.5]}}
    assert label(**mixed) == "N-SDP forward capacity [1,1,0.5,0.5]"
    assert label(**{**mixed, "mask": {"capacity": [0.5] * 4}}) == "N-SDP forward"
    # An outer loop is its own row, with its H (and P where the model syncs in fragments).
    diloco = {"name": "diloco", "sync_every": 10, "fragments": 1}
    assert label(masking="none", outer=diloco) == "DDP + DiLoCo(H=10)"
    assert (
        label(**mixed, outer={**diloco, "fragments": 2}) == "N-SDP forward capacity [1,1,0.5,0.5] + DiLoCo(H=10, P=2)"
    )
    assert label(masking="none", outer={"name": "none"}) == "DDP"


def test_the_lowcomm_table_counts_each_workers_bytes_over_the_run_and_the_outer_state(tmp_path):
    outer = {"name": "diloco", "sync_every": 10, "fragments": 1, "backup_device": "cpu", "syncs": 1}
    _run(tmp_path, "ddp", comm_bytes_per_step_per_rank=[2.0**20, 3 * 2.0**20])
    memory = {"params_bytes": GIB, "grads_bytes": GIB, "optim_bytes": GIB, "outer_backup_bytes": GIB // 2,
              "outer_momentum_bytes": GIB // 2, "peak_bytes": GIB}  # fmt: skip
    for seed, acc in ((0, 0.6), (1, 0.7)):
        _run(tmp_path, f"diloco{seed}", seed=seed, acc=acc, outer=outer, memory=memory,
             comm_bytes_per_step_per_rank=[2.0**20 / 8] * 4)  # fmt: skip
    written = lowcomm.write(tmp_path, tmp_path / "out", command="test")
    assert [p.name for p in written] == [
        "resnet_tiny_fashion_mnist.md",
        "resnet_tiny_fashion_mnist.csv",
        "resnet_tiny_fashion_mnist_bytes.png",
    ]
    rows = {r["variant"]: r for r in csv.DictReader(open(written[1]))}
    assert list(rows) == ["DDP", "DDP + DiLoCo(H=10)"]
    assert float(rows["DDP"]["sent_mib_per_worker"]) == 30.0  # the busiest rank: 3 MiB a step, 10 steps
    assert float(rows["DDP + DiLoCo(H=10)"]["sent_mib_per_worker"]) == 1.25
    assert float(rows["DDP + DiLoCo(H=10)"]["outer_mib_per_rank"]) == 1024.0
    assert float(rows["DDP + DiLoCo(H=10)"]["quality"]) == pytest.approx(0.65)
    assert rows["DDP + DiLoCo(H=10)"]["seeds"] == "[0, 1]"
    assert "| DDP + DiLoCo(H=10) | 0, 1 | 10 | 0.6500 ± 0.0707 | 1.2 | 3072.0 | 1024.0 | cpu | 5 | 1 |" in (
        written[0].read_text()
    )


def test_collect_writes_markdown_csv_and_plots(tmp_path):
    runs = tmp_path / "runs"
    _run(runs, "ddp")
    _run(runs, "b-bwd", masking="backward", gran="block", coverage=0.5, acc=0.78, peak=3.0)
    written = collect([runs], tmp_path / "out", command="python -m sdp.collect runs")
    names = sorted(p.name for p in written)
    assert names == sorted(
        f"resnet_tiny_fashion_mnist{s}"
        for s in (".md", ".csv", "_loss.png", "_memory.png", "_quality.png", "_curves.png")
    )
    md = (tmp_path / "out" / "resnet_tiny_fashion_mnist.md").read_text()
    assert "| B-SDP backward | 0.5 |" in md and "-25.0%" in md and "78.00" in md
    rows = list(csv.DictReader((tmp_path / "out" / "resnet_tiny_fashion_mnist.csv").open()))
    assert [r["variant"] for r in rows] == ["DDP", "B-SDP backward"]
    assert all((tmp_path / "out" / n).stat().st_size > 1000 for n in names if n.endswith(".png"))


def test_the_quality_plot_has_error_bars_of_one_std_over_seeds(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _run(tmp_path, "ddp-s0", acc=0.80)
    _run(tmp_path, "ddp-s1", seed=1, acc=0.84)
    _run(tmp_path, "fwd-s0", masking="forward", coverage=0.5, acc=0.70)
    _run(tmp_path, "fwd-s1", masking="forward", coverage=0.5, seed=1, acc=0.74)
    info = build_rows(find_runs([tmp_path]))["resnet_tiny_fashion_mnist"]
    fig, ax = plt.subplots()
    _quality(ax, info["rows"], info["kind"])
    (bars,) = ax.containers  # one series beside DDP: N-SDP forward
    (segments,) = [c.get_segments() for c in bars.lines[2]]
    (low, high) = sorted(y for _, y in segments[0])
    std = 0.02 * 2**0.5  # of 0.70 and 0.74
    assert (low, high) == (pytest.approx(0.72 - std), pytest.approx(0.72 + std))
    (band,) = ax.patches  # DDP's mean ± std
    assert band.get_extents().height > 0 and ax.get_ylabel() == "eval accuracy (mean ± std over seeds)"
    plt.close(fig)


DAMAGE = {  # what is written over a run's file -> the start of the error after its path
    "summary.json": ('{"status": "completed"', "cannot be read as JSON (JSONDecodeError"),
    "config.yaml": ("\x00\x01", "cannot be read as YAML (ReaderError"),
    "metrics.jsonl": ('{"step": 1}\n{"step": 2, "train_', "line 2 is not JSON (JSONDecodeError"),
}


@pytest.mark.parametrize("name", DAMAGE)
def test_a_damaged_run_is_one_line_not_a_run_left_out(name, tmp_path, capsys):
    # Before: a damaged summary.json made collect leave the run out while saying none failed;
    # a damaged config.yaml or metrics line ended in a traceback.
    runs, out = tmp_path / "runs", tmp_path / "out"
    _run(runs, "ddp")
    _run(runs, "b-bwd", masking="backward", gran="block", coverage=0.5, acc=0.78, peak=3.0)
    text, error = DAMAGE[name]
    (runs / "b-bwd" / name).write_text(text)
    assert main([str(runs), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {runs / 'b-bwd' / name}: {error}") and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, error",
    [
        (["{runs}", "--out", "{file}"], "error: --out='{file}': is a file, not a directory\n"),
        (
            ["{empty}", "--out", "{out}"],
            "error: roots='{empty}': hold no completed run (a run dir with summary.json)\n",
        ),
        (["{tmp}/none", "--out", "{out}"], "error: roots='{tmp}/none': is not a directory of run dirs\n"),
        (
            ["{runs}", "--out", "{out}", "--claims", "--cuda", "{file}"],
            "error: {file}: cannot be read (JSONDecodeError",
        ),
    ],
)
def test_bad_collect_input_is_one_line_and_nothing_is_written(argv, error, tmp_path, capsys):
    places = {
        "runs": tmp_path / "runs",
        "file": tmp_path / "file",
        "empty": tmp_path / "empty",
        "out": tmp_path / "out",
    }
    _run(places["runs"], "ddp")
    places["file"].write_text("not json")
    places["empty"].mkdir()
    fill = {**{k: str(v) for k, v in places.items()}, "tmp": str(tmp_path)}
    assert main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(error.format(**fill)) and err.count("\n") == 1, err
    assert not places["out"].exists()


def test_collect_logs_its_tables_plots_and_claims_to_one_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    runs = tmp_path / "runs"
    _run(runs, "ddp")
    _run(runs, "b-bwd", masking="backward", gran="block", coverage=0.5, acc=0.78, peak=3.0)
    assert main([str(runs), "--out", str(tmp_path / "out"), "--claims", "--wandb", "--wandb-project", "p"]) == 0
    import wandb

    wandb.teardown()  # W&B's service process writes the run's file: let it end, as the command's exit does
    run = offline_run(tmp_path / "out")
    assert run["job_type"] == "tables" and run["config"]["command"].startswith("python -m sdp.collect ")
    table = "resnet_tiny_fashion_mnist"
    for key in (f"{table}/rows", "claims", *(f"{table}/{plot}" for plot in ("loss", "memory", "quality"))):
        assert f"{key}/_type" in run["logged"], key
    (rows,) = (run["dir"] / "files" / "media" / "table" / table).glob("rows_0_*.table.json")
    logged = json.loads(rows.read_text())
    assert logged["columns"][:3] == ["variant", "coverage", "protocol"]
    assert [r[0] for r in logged["data"]] == ["DDP", "B-SDP backward"]
    (claims,) = (run["dir"] / "files" / "media" / "table").glob("claims_0_*.table.json")
    rows = json.loads(claims.read_text())["data"]
    assert [(r[0], r[2], r[3], r[-1]) for r in rows] == [("4b", "B-SDP backward C=0.5", "DDP", "too few runs")]


def test_the_confidence_interval_uses_students_t_and_the_normal_beyond_30_runs():
    assert ci95(1.0, 5) == pytest.approx(2.776 / 5**0.5)  # t(0.975, 4)
    assert ci95(1.0, 31) == pytest.approx(2.042 / 31**0.5)  # t(0.975, 30)
    assert ci95(1.0, 32) == pytest.approx(1.96 / 32**0.5)
    assert ci95(None, 5) is None and ci95(1.0, 1) is None
