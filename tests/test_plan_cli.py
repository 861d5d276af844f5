"""`python -m sdp.plan`: its refusals, a tiny plan checked against sdp.estimate, and its top row run."""

import dataclasses
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import job_env, read_run

from sdp.estimate import main as estimate_main
from sdp.plan import main
from sdp.planning.options import parse_plan as parse_args
from sdp.planning.planner import describe_devices, nothing_fits
from sdp.planning.report import CITED, caveat, sources
from sdp.planning.rows import Row
from sdp.planning.space import Structure

TINY = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=64", "trainer.global_batch_size=16"]
GLOO = "parallelism.comm_group_overhead_mb=0"  # gloo's process groups take no device memory


@pytest.mark.parametrize(
    "argv,error",
    [
        ([], "error: devices=None: is required: devices=8x80, [80,80,24,24] or 4x80+4x24 (GiB per GPU)"),
        (
            ["devices=8y80"],
            "error: devices='8y80': must be NxGIB (8x80), a list of GiB per GPU ([80,80,24,24]), or parts joined "
            "by + (4x80+4x24), at most 65536 GPUs",
        ),
        (["devices=4x80", "world_size=8"], "error: devices='4x80': lists 4 GPUs, but world_size=8"),
        (
            ["devices=4x80", "masking=forward"],
            "error: masking='forward': is the planner's to choose; narrow it with "
            "min_coverage=, coverages=, granularity=",
        ),
        (
            ["devices=4x80", "parallelism.mixed_precision=bf16"],
            "error: parallelism.mixed_precision='bf16': is the planner's to choose; narrow it with precision=",
        ),
        (["devices=4x80"], "error: cluster=None: is required for objective=speed (the step time); or objective=memory"),
        (
            ["devices=4x80", "cluster=h100_nvlink", "objective=fast"],
            "error: objective='fast': allowed: speed, memory, time_to_target",
        ),
        (
            ["devices=4x80", "cluster=h100_nvlink", "objective=time_to_target"],
            "error: quality=None: is required for objective=time_to_target: a pilot sweep's collect CSV or "
            "folder of run dirs",
        ),
        (
            ["devices=4x80", "cluster=h100_nvlink", "quality=pilot.csv"],
            "error: quality='pilot.csv': is read with objective=time_to_target only",
        ),
        (
            ["devices=4x80", "objective=time_to_target", "quality=pilot.csv"],
            "error: cluster=None: is required for objective=time_to_target (the step time); or objective=memory",
        ),
        (
            ["devices=4x80", "cluster=h100_nvlink", "objective=time_to_target", "quality=/nonexistent"],
            "error: quality='/nonexistent': is neither a collect CSV nor a folder of run dirs",
        ),
        (
            ["devices=4x80", "cluster=h100_nvlink", "objective=time_to_target", "quality=results/cpu_replica"],
            "error: quality='results/cpu_replica': holds 2 tables (llama_tiny_local_text, resnet_tiny_fashion_mnist): "
            "give one table's runs",
        ),
        (
            [
                "devices=4x80",
                "cluster=h100_nvlink",
                "objective=time_to_target",
                "quality=results/cpu_replica/resnet_tiny_fashion_mnist.csv",
            ],
            "error: quality='results/cpu_replica/resnet_tiny_fashion_mnist.csv': is a pilot on image data; "
            "this plan's is text",
        ),
        (
            ["devices=4x80", "cluster=h100_ib", "nodes=3"],
            "error: nodes=3: must divide world_size=4 (the same ranks on every node); allowed: [1, 2, 4]",
        ),
        (
            ["devices=4x80", "objective=memory", "precision=fp16"],
            "error: precision='fp16': must be a comma list of fp32, bf16",
        ),
        (
            ["devices=4x80", "objective=memory", "sync_every=10"],
            "error: sync_every='10': needs outer=diloco: the H it searches",
        ),
        (
            ["devices=4x80", "objective=memory", "outer=diloco", "sync_every=0,10"],
            "error: sync_every='0,10': must be a comma list of distinct integers >= 1 (outer=diloco's H)",
        ),
        (
            ["devices=4x80", "outer=diloco", "outer.sync_every=10"],
            "error: outer.sync_every='10': is the planner's to choose; narrow it with sync_every=",
        ),
        (
            ["devices=4x80", "objective=memory", "outer=diloco", "outer.lr=0"],
            "error: outer.lr=0.0: must be a finite number > 0 (DiLoCo's: 0.7)",
        ),
        (
            ["devices=3x80", "objective=memory"],
            "error: trainer.global_batch_size=16: must be divisible by world_size x grad_accum_steps = 3 x 1 = 3",
        ),
    ],
)
def test_bad_input_is_one_line_before_any_trace(argv, error, capsys, monkeypatch):
    monkeypatch.setattr("sdp.planning.planner.search", lambda *a, **k: pytest.fail("searched"))
    assert main([*TINY, *argv]) == 2
    assert capsys.readouterr().err.strip() == error


@pytest.mark.slow  # end to end; make test runs it, make test-fast leaves it (docs/testing.md)
def test_nothing_fits_says_the_smallest_peak_and_what_would_fit(capsys):
    argv = [*TINY, GLOO, "devices=2x0.01", "objective=memory", "precision=fp32", "checkpointing=none", "workers=1"]
    assert main([*argv, "granularity=block"]) == 2
    out, err = capsys.readouterr()
    assert "0 fit, 4 do not, 0 refused" in out
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    # 10 MiB cannot hold the tiny LLaMA's weights, gradients and AdamW state (about 17 MiB on
    # the smallest rank), so fewer tokens would not do: more devices. C = 0.5 was searched, and
    # 2 GPUs give no lower coverage: none is suggested (it suggested min_coverage=0.5 once).
    pattern = (
        r"error: devices='2x0.01': nothing fits: the smallest peak is 0\.0\d+ GiB on a 0\.01 GiB GPU "
        r"\(B-SDP forward C=0\.5, micro-batch 1, rank [01]\); to fit, try more devices \(weights, "
        r"gradients, optimizer state and communicators alone take 0\.0\d+ GiB\)"
    )
    assert re.fullmatch(pattern, line), line


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """A tiny plan on 2 CPU ranks of 40 MiB each: fp32, no or full checkpointing, neuron units."""
    out = tmp_path_factory.mktemp("plan")
    argv = [*TINY, GLOO, "devices=2x0.04", "cluster=cpu_2core", "precision=fp32", "checkpointing=none,full"]
    argv += ["granularity=neuron", "workers=2"]
    # In a process of its own, as a user runs it: its families are fitted in 2 forked processes
    # (a fork after autograd has run, as in this pytest process, is refused by torch).
    proc = subprocess.run(
        [sys.executable, "-m", "sdp.plan", *argv, f"out={out}"], env=job_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "searched 8 structures" in proc.stdout and "(2 processes," in proc.stdout
    assert (out / "pareto.png").stat().st_size > 10_000
    return json.loads((out / "plan.json").read_text())


@pytest.mark.slow  # end to end; make test runs it, make test-fast leaves it (docs/testing.md)
def test_the_plan_ranks_what_fits_by_step_time(plan):
    rows = {r["run"]: r for r in plan["rows"]}
    ranked = [rows[name] for name in plan["ranked"]]
    assert len(plan["rows"]) == 8 and len(ranked) >= 4
    assert [r["step_s"] for r in ranked] == sorted(r["step_s"] for r in ranked)
    assert all(r["headroom"] >= 0 and r["micro_batch"] * r["accum"] == 8 for r in ranked)
    assert all(r["command"].startswith("python -m sdp.train --nproc-per-node=2 ") for r in ranked)
    sdp = [r for r in ranked if r["structure"]["masking"] != "none"]
    assert sdp and all("(4b" in r["caveat"] for r in sdp)


def _overrides(row: dict) -> list[str]:
    return shlex.split(row["command"])[4:]  # after python -m sdp.train --nproc-per-node=N


@pytest.mark.slow  # end to end; make test runs it, make test-fast leaves it (docs/testing.md)
def test_a_sample_of_peaks_is_sdp_estimates(plan, tmp_path):
    # The top row and the first row of each masking mode, through `python -m sdp.estimate` on
    # the row's own command line: the same peak (docs/plan.md asks for 3%).
    sample, seen = [], set()
    for name in plan["ranked"]:
        row = next(r for r in plan["rows"] if r["run"] == name)
        if not sample or row["structure"]["masking"] not in seen:
            sample.append(row)
            seen.add(row["structure"]["masking"])
    assert len(sample) >= 3
    for row in sample:
        for rank, predicted in row["peaks_bytes"].items():
            out = tmp_path / f"{len(seen)}-{rank}.json"
            assert estimate_main([*_overrides(row), "world_size=2", f"rank={rank}", f"out={out}"]) == 0
            est = json.loads(out.read_text())
            assert est["memory"]["peak_with_comm_groups_bytes"] == pytest.approx(predicted, rel=0.03), row["run"]


@pytest.mark.dist
def test_the_top_row_runs_as_printed_within_5_percent_of_its_peak(plan, tmp_path):
    top = next(r for r in plan["rows"] if r["run"] == plan["ranked"][0])
    args = shlex.split(top["command"])
    assert args[:3] == ["python", "-m", "sdp.train"]
    run = ["logger=none", "trainer.max_steps=3", "dataset.eval_batches=1", f"run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(
        [sys.executable, *args[1:], *run], cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, _ = read_run(tmp_path / "run")
    for rank, predicted in top["peaks_bytes"].items():
        measured = summary["memory_per_rank"][int(rank)]["peak_bytes"]
        assert measured == pytest.approx(predicted, rel=0.05), (top["run"], rank)


def test_caveats_cite_claims_the_report_has():
    # A regenerated claims report that renames or drops a claim breaks the citations: caught here.
    root = Path(__file__).parents[1]
    assert all(f"## {heading}" in (root / report).read_text() for report, heading in CITED.values())
    assert sources() == "1, 4a, 4b, 5 from results/cpu_replica/claims.md"
    cited = set()
    for masking, coverage in (("forward", 0.25), ("backward", 0.5)):
        for protocol in ("same_iteration", "flop_matched"):
            text = caveat(Structure(masking=masking, coverage=coverage), protocol=protocol)
            cited |= {n.strip() for part in re.findall(r"\(([^)]*)\)", text) for n in part.split(",")}
    assert cited == set(CITED) and caveat(Structure(), protocol="same_iteration") == ""


def test_devices_are_described_in_runs():
    assert describe_devices([80.0] * 4 + [24.0] * 4) == "4 x 80 + 4 x 24 GiB"
    assert describe_devices([80.0, 24.0, 80.0]) == "1 x 80 + 1 x 24 + 1 x 80 GiB"


def test_only_a_top_row_close_to_full_is_traced_whole(monkeypatch, capsys):
    from types import SimpleNamespace

    from sdp.planning import planner as plan

    def row(parallelism, headroom, step):  # a fitting row, its one rank that full of an 80 GiB GPU
        peak = round((1 - headroom) * 80 * 2**30)
        s = Structure(parallelism=parallelism)
        return Row(s, 0.0, fits=True, peaks_bytes={0: peak}, devices_gib={0: 80.0}, step_s=step, method="layers 3")

    def verify(top, cfg, *, devices, trace):  # a whole trace that finds the row over its GPU
        return dataclasses.replace(top, fits=False, method="traced whole (verified)", peaks_bytes={0: 81 * 2**30})

    monkeypatch.setattr(plan, "verify", verify)
    args = SimpleNamespace(objective="speed", devices=[80.0], ranking=None)
    roomy = [row("ddp", 0.5, 1.0), row("fsdp", 0.01, 2.0)]
    assert [r.run for r in plan.verified(roomy, lambda s: None, args)] == ["DDP", "FSDP"]
    close = [row("ddp", 0.025, 1.0), row("fsdp", 0.5, 2.0)]
    assert [r.run for r in plan.verified(close, lambda s: None, args)] == ["FSDP"]
    assert "top row traced whole: DDP, peak 81 GiB (the line's 78): it does not fit, next" in capsys.readouterr().out


def _miss(coverage: float, *, masking: str = "forward") -> Row:
    """A row that does not fit, as sdp.planning.report.row makes one: 16 GiB on a 10 GiB GPU."""
    breakdown = {"weights": 1.0, "grads": 1.0, "optimizer": 2.0, "activations": 10.0, "temporaries": 2.0, "total": 16.0}
    s = Structure(masking=masking, coverage=coverage)
    return Row(s, 0.0, peaks_bytes={0: 16 * 2**30}, devices_gib={0: 10.0}, breakdown_gib=breakdown)


@pytest.mark.parametrize(
    "coverages,hint",
    [
        ([0.5, 0.75], "a lower coverage (min_coverage=0.25 coverages=all: C = 1/4 is the lowest 4 GPUs give)"),
        ([0.25, 0.5], None),  # 1/4 was searched: no lower one to suggest
    ],
)
def test_nothing_fits_suggests_only_a_coverage_the_world_gives_and_was_not_searched(coverages, hint):
    args = parse_args(["devices=4x10", "objective=memory"])
    line = nothing_fits(args, [_miss(c) for c in coverages] + [_miss(1.0, masking="none")])
    assert line.startswith("devices='4x10': nothing fits: the smallest peak is 16 GiB on a 10 GiB GPU (N-SDP")
    assert line.endswith(f"or {hint}") if hint else "coverage" not in line.split("; to fit, try ")[1]


@pytest.mark.parametrize(
    ("command", "first"), [(main, ["devices=2x80", "objective=memory"]), (estimate_main, ["world_size=2"])]
)
@pytest.mark.parametrize("machine", ["nodes=2", "cluster.efficiency=0.5"])
def test_both_commands_read_the_machine_alike(command, first, machine, capsys):
    """sdp.plan and sdp.estimate share one parser (sdp.planning.options): the same refusal."""
    assert command([*TINY, *first, machine]) == 2
    key = machine.partition("=")[0]
    assert capsys.readouterr().err == f"error: cluster=None: is required with {key}=: name the machine (cluster=NAME)\n"


def test_a_partial_plan_check_replaces_its_rows_and_keeps_the_others(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("plan_check", Path(__file__).parents[1] / "scripts/plan_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    plan = tmp_path / "plan.json"
    rows = [{"run": name, "command": "python -m sdp.train x", "peaks_bytes": {}} for name in ("A", "B + AC", "C")]
    plan.write_text(json.dumps({"devices_gib": [80.0] * 2, "ranked": ["A", "B + AC", "C"], "rows": rows}))
    checked = []
    monkeypatch.setattr(check, "check_row", lambda row, world: checked.append(row["run"]) or len(checked) / 1000)
    out = tmp_path / "check.json"
    for argv in ([str(plan), "--out", str(out)], [str(plan), "--rows", "B *", "--out", str(out)]):
        monkeypatch.setattr(sys, "argv", ["plan_check.py", *argv])
        assert check.main() == 0
    assert checked == ["A", "B + AC", "C", "B + AC"]  # the second call checks the row that matches, alone
    result = json.loads(out.read_text())
    assert [(r["run"], r["relative_difference"]) for r in result["rows"]] == [
        ("A", 0.001),
        ("B + AC", 0.004),
        ("C", 0.003),
    ]
    assert result["worst"] == 0.004
