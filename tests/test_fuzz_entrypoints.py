"""Bad input on every entrypoint: train (and its --cfg job), the launcher, the estimator, the planner,
collect, export and sweeps, drawn from each value class: types, ranges, C-type limits, numbers that are not
finite, paths, damaged run-dir files, and settings that contradict each other or would be ignored.
Every case is wrong by construction, so each must be refused: exit code 2 and one `error:` line
naming a key or a path, never a traceback, a hang, or an acceptance (whatever would run next is
replaced by a sentinel, so an accepted case is caught before it trains). Seeded; each case has
a time limit. The default suite draws a sample of every (entrypoint, class) cell; `make fuzz`
(SDP_FUZZ=all) runs every case."""

import collections
import contextlib
import dataclasses
import enum
import io
import os
import random
import re
import signal
import types
import typing
from pathlib import Path

import pytest

import sdp.estimate
import sdp.launching.sweep
import sdp.launching.torchrun
import sdp.plan
import sdp.planning.planner
import sdp.run.runner
from sdp import collect, export, train

CASE_LIMIT_S = 10
SAMPLE_PER_CELL = 2
TEXT = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=8"]
IMAGE = ["model=resnet_tiny", "dataset=synthetic_image", "trainer.global_batch_size=8"]
HUGE = (2**63, 2**64, -(2**63) - 1, 10**30)
NOT_FINITE = ("nan", "inf", "-inf")
# One line: `error: KEY=VALUE: ...`, `error: --flag=...`, or `error: PATH: ...`.
ONE_LINE = re.compile(r"^error: (-{0,2}[A-Za-z_][\w.\[\]-]*=|/|\.{0,2}/?[\w.-]+/)[^\n]*\n$")

# Config values wrong whatever else is set: (key, values); the class is the table's name.
RANGES = [
    ("optim.lr", [0, -1, -1e-3]),
    ("optim.weight_decay", [-0.1, -1]),
    ("optim.eps", [-1e-8]),
    ("optim.betas", ["[0.9,1.0]", "[1.5,0.9]", "[-0.1,0.9]", "[0.9]"]),
    ("optim.min_lr_ratio", [-0.1, 1.5]),
    ("optim.warmup_steps", [-1]),
    ("masking.coverage", [0, -0.5, 1.5]),
    ("model.inner_width", [0, -1, 0.3, 1.5]),
    ("trainer.max_steps", [0, -5]),
    ("trainer.global_batch_size", [0, -8]),
    ("trainer.log_every", [0]),
    ("trainer.keep_checkpoints", [0]),
    ("trainer.grad_clip", [-1]),
    ("trainer.eval_every", [-1]),
    ("seed", [-1, -7]),
    ("masking.seed", [-1]),
    ("parallelism.timeout_s", [0, -1]),
    ("parallelism.bucket_cap_mb", [0, 1e20]),
    ("parallelism.comm_group_overhead_mb", [-1, 1e20]),
    ("model.hidden_size", [0, -64]),
    ("model.num_layers", [0, -1]),
    ("dataset.seq_len", [0, -1]),
    ("masking.resample_every", [-1]),
    ("masking.capacity", ["[0,1]", "[1.5,1]", "[-1,1]", "[]"]),
]
TYPES = [
    ("trainer.max_steps", ["many", "[1,2]", "1.5"]),
    ("optim.lr", ["fast", "[0.1]"]),
    ("masking.coverage", ["half"]),
    ("seed", ["abc", "0.5"]),
    ("optim.betas", ["0.9"]),
    ("model.hidden_size", ["[64]", "big"]),
    ("trainer.progress", ["maybe"]),
    ("parallelism.compile", ["sometimes"]),
    ("masking.granularity", ["layer"]),
    ("optim.schedule", ["exp"]),
    ("trainer.protocol", ["3"]),
    ("masking.capacity", ["half", "1", "[[1],[1]]", "[1,x]", "[true,1]"]),
]
INT_KEYS = ["trainer.max_steps", "trainer.global_batch_size", "seed", "model.hidden_size", "model.num_layers"]
INT_KEYS += [
    "dataset.seq_len",
    "optim.warmup_steps",
    "trainer.checkpoint_every",
    "masking.seed",
    "trainer.profile_step",
]
FLOAT_KEYS = ["optim.lr", "optim.weight_decay", "optim.eps", "optim.min_lr_ratio", "masking.coverage"]
FLOAT_KEYS += ["trainer.grad_clip", "parallelism.timeout_s", "logger.init_timeout_s", "optim.momentum"]
PATHS = [
    ["run_dir=/etc/passwd"],
    ["run_dir=/proc/sdp-fuzz"],
    ["output_root=/proc/sdp-fuzz"],
    ["name=../escape"],
    ["name=a/b"],
    ["dataset=local_text", "dataset.path=/nonexistent-corpus"],
    ["dataset=local_text", "dataset.cache_dir=/proc/sdp-fuzz"],
    ["--config-dir", "/nonexistent-configs"],
]
CONTRADICTIONS = [
    ["masking=backward", "masking.coverage=1", "masking.scale=none"],
    ["variant=n_sdp_forward", "masking=backward"],
    ["variant=b_sdp_forward", "masking.granularity=neuron"],
    ["trainer.save_model=false"],
    ["masking.coverage=0.5"],
    ["parallelism.fsdp_degree=2"],
    ["masking.resample_every=5"],
    ["masking=forward", "masking.capacity=[1,1]", "masking.coverage=0.5"],
    ["masking=forward", "masking.capacity=[0.25,0.25]"],
    ["masking=forward", "masking.capacity=[1,1,1,1,1,1,1,1,1]"],
    ["masking=forward", "masking.capacity=[1,0.5]", "masking.construction=random"],
    ["outer=diloco", "parallelism=fsdp"],
    ["outer=diloco", "masking=forward", "masking.coverage=0.5", "masking.resample_every=5"],
]


# Every key of the typed config, drawn from its dataclasses (a new key is fuzzed without a line
# here): each whole number gets the C-type limits and wrong types, each float values that are not
# finite (1e309 reads as infinity) and wrong types, each bool, choice (enum) and list of numbers a
# value of another type, and each path key places that cannot be written. A model family's keys
# go with a base of that family; a dataset's path keys with the dataset that reads them.
SWIN = ["model=swin_tiny", "dataset=synthetic_image", "trainer.global_batch_size=8"]
FAMILY_BASES = {"llama": TEXT, "resnet": IMAGE, "swin": SWIN}
READS_DATASET_PATHS = [*TEXT, "dataset=local_text"]
PATH_NAMES = ("dir", "root", "path")
UNWRITABLE = ("/proc/sdp-fuzz/x", "/etc/passwd")


# The outer loop's keys exist under an algorithm (outer=none has only its name); each algorithm's
# keys are fuzzed on its own config group, those every algorithm has on outer=diloco's.
OUTER = ["outer=diloco"]
OUTER_RANGES = [
    ("outer.sync_every", [0, -1]),
    ("outer.lr", [0, -0.7]),
    ("outer.momentum", [1, 1.5, -0.1]),
    ("outer.fragments", [0, 3, 1000, "50 outer.sync_every=50"]),
    ("outer.comm_dtype", ["fp16"]),
    ("outer.backup_device", ["gpu"]),
]


def typed_keys() -> list[tuple[str, object, list[str]]]:
    """(dotted key, its type, the base it is fuzzed on) for every field of RunConfig, the model's
    fields once per family."""
    from sdp.models import FAMILIES
    from sdp.outer.algorithms import ALGORITHMS, OuterConfig
    from sdp.run.config import RunConfig

    out = []
    for family, schema in FAMILIES.items():
        out += [(f"model.{k}", t, FAMILY_BASES[family]) for k, t in _fields(schema)]
    shared = {k for k, _ in _fields(OuterConfig)}  # fuzzed once, on outer=diloco
    for name, algorithm in ALGORITHMS.items():
        own = [(k, t) for k, t in _fields(algorithm.schema) if k not in shared or name == "diloco"]
        out += [(f"outer.{k}", t, [*TEXT, f"outer={name}"]) for k, t in own]
    for key, kind in _fields(RunConfig):
        if not key.startswith(("model", "outer")):
            leaf = key.rsplit(".", 1)[-1]
            reads = key.startswith("dataset.") and leaf.endswith(PATH_NAMES)
            base = READS_DATASET_PATHS if reads else TEXT
            out.append((key, kind, base))
    return out


def _fields(schema: type, prefix: str = ""):
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        a_family = typing.get_origin(kind) in (typing.Union, types.UnionType)  # `model`: the families' (above)
        if f.name == "record" or (a_family and any(dataclasses.is_dataclass(a) for a in typing.get_args(kind))):
            continue  # the record is no key
        if dataclasses.is_dataclass(kind):
            yield from _fields(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", kind


# Strings whose values a registry lists, fuzzed as an enum is (outer.name: sdp.outer.algorithms;
# masking.name: sdp.subnet.modes and the baselines).
REGISTERED = ("outer.name", "masking.name")


def typed_values(key: str, kind) -> dict[str, list[str]]:
    """The bad values of one key, by value class."""
    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    base = next(a for a in typing.get_args(kind) if a is not type(None)) if union else kind
    origin = typing.get_origin(base)
    if origin is list:
        item = typing.get_args(base)[0]
        return {"types": ["[[1],[2]]", "{a: 1}"]} | ({"not finite": ["[nan]", "[1e309]"]} if item is float else {})
    if base is bool:
        return {"types": ["maybe", "[true]"]}
    if base is int:
        return {"C-type limits": [str(v) for v in HUGE], "types": ["abc", "1.5", "[1]"]}
    if base is float:
        return {"not finite": [*NOT_FINITE, "1e309", "-1e309"], "types": ["abc", "[1.0]"]}
    if (isinstance(base, type) and issubclass(base, enum.Enum)) or key in REGISTERED:
        return {"types": ["bogus", "[1]"]}
    if base is str and key.rsplit(".", 1)[-1].endswith(PATH_NAMES):
        return {"paths": list(UNWRITABLE)}
    return {}  # a free string: any value is one


def typed_cases() -> dict[str, list[list[str]]]:
    """Every typed key's bad values on its base, by value class."""
    out = collections.defaultdict(list)
    for key, kind, base in typed_keys():
        for cls, values in typed_values(key, kind).items():
            out[cls] += [[*base, f"{key}={v}"] for v in values]
    return out


def config_cases() -> dict[str, list[list[str]]]:
    """The training config's bad overrides, by value class."""
    return {
        "ranges": [[f"{k}={v}"] for k, values in RANGES for v in values]
        + [[*OUTER, *f"{k}={v}".split()] for k, values in OUTER_RANGES for v in values],
        "types": [[f"{k}={v}"] for k, values in TYPES for v in values],
        "C-type limits": [[f"{k}={v}"] for k in INT_KEYS for v in HUGE],
        "not finite": [[f"{k}={v}"] for k in FLOAT_KEYS for v in NOT_FINITE],
        "paths": PATHS,
        "contradictions": CONTRADICTIONS,
    }


class Accepted(BaseException):
    """Raised where an accepted case would go on to run: a silent acceptance."""


def _accepted(*args, **kwargs):
    raise Accepted


@pytest.fixture
def sentinels(monkeypatch, tmp_path):
    """Whatever runs after the checks is replaced: an accepted case raises Accepted there."""
    monkeypatch.setattr(sdp.run.runner, "run", _accepted)
    monkeypatch.setattr(sdp.launching.torchrun, "_run_agent", _accepted)
    monkeypatch.setattr(sdp.estimate, "estimate", _accepted)
    monkeypatch.setattr(sdp.planning.planner, "search", _accepted)
    monkeypatch.setattr(sdp.launching.sweep, "launch", _accepted)
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def _runs(root: Path) -> dict[str, Path]:
    """A finished tiny run dir per family (config.yaml, model.pt, summary.json, metrics.jsonl),
    made by the test fixtures of test_export and test_collect."""
    from test_collect import _run
    from test_export import fake_run

    (root / "image").mkdir(parents=True)
    image, _ = fake_run(root / "image", IMAGE[:2])
    _run(root / "table", "ddp")
    return {"export": image, "collect": root / "table"}


DAMAGED_TEXT = {
    "binary": "\x00\x01\x02",
    "truncated": '{"status": "comp',
    "a list": "- 1\n- 2\n",
    "a number": "3\n",
    "half a line": '{"step": 1}\n{"step": 2, "train_',
}


def file_cases(root: Path) -> list[tuple[str, str, list[str], Path, str]]:
    """(entrypoint, class, argv, file to damage, damage) for collect and export."""
    runs = _runs(root)
    out = []
    for damage in DAMAGED_TEXT:
        for name in ("summary.json", "config.yaml", "metrics.jsonl"):
            if damage == "a list" and name == "metrics.jsonl":
                continue  # "- 1" lines are not JSON: the same as binary there
            out.append(("collect", "damaged files", [str(runs["collect"]), "--out", "OUT"], Path(name), damage))
        for name in ("config.yaml", "model.pt"):
            out.append(("export", "damaged files", [str(runs["export"])], Path(name), damage))
    return out


def entrypoint_cases(root: Path) -> list[tuple[str, str, object]]:
    """(entrypoint, class, call) for every case; a call returns the exit code."""
    cases = []
    for cls, items in config_cases().items():
        for extra in items:
            for base in (TEXT, IMAGE):
                if any(e.startswith(("dataset=local_text", "variant=b_")) for e in extra) and base is IMAGE:
                    continue
                cases.append(("train", cls, lambda a=[*base, *extra]: train.main(a)))
                cases.append(("train --cfg job", cls, lambda a=[*base, *extra]: train.main(["--cfg", "job", *a])))
            if not any(e.startswith(("--config-dir", "run_dir", "output_root", "name", "dataset.")) for e in extra):
                cases.append(("estimate", cls, lambda a=[*TEXT, *extra]: sdp.estimate.main(["world_size=2", *a])))
            cases.append(("sweep", cls, lambda a=[*TEXT, *extra]: train.main(["-m", *a, "sweep.dry_run=true"])))
    for cls, items in typed_cases().items():  # every key of the typed config, through train's checks
        for argv in items:
            cases.append(("train (every key)", cls, lambda a=argv: train.main(a)))
            cases.append(("train --cfg job (every key)", cls, lambda a=argv: train.main(["--cfg", "job", *a])))
    for flag in ("--nproc-per-node=0", "--nproc-per-node=-1", "--nproc-per-node=x", "--nproc-per-node=1.5"):
        cases.append(("launcher", "ranges" if flag[-1].isdigit() else "types", lambda f=flag: train.main([f, *TEXT])))
    cases.append(("launcher", "C-type limits", lambda: train.main([f"--nproc-per-node={2**64}", *TEXT])))
    for flag in ("--nnodes=0", "--nnodes=3:2", "--nnodes=a", "--max-restarts=-1", "--shutdown-timeout=x"):
        cases.append(("launcher", "ranges", lambda f=flag: train.main(["--nproc-per-node=2", f, *TEXT])))
    for cls, items in config_cases().items():
        for extra in items[:4]:
            cases.append(("launcher", cls, lambda a=[*TEXT, *extra]: train.main(["--nproc-per-node=2", *a])))
    estimator = {
        "ranges": [["world_size=0"], ["world_size=2", "rank=2"], ["world_size=2", "nodes=2"], ["world_size=65537"]],
        "types": [["world_size=x"], ["world_size=1.5"], ["world_size=2", "rank=x"], ["cluster=nope"]],
        "C-type limits": [[f"world_size={2**64}"], ["world_size=2", f"rank={2**63}"]],
        "not finite": [["world_size=2", "cluster=h100_ib", "cluster.efficiency=nan"]],
        "paths": [["world_size=2", "out=/etc"], ["world_size=2", "out=/dev/full"], ["world_size=2", "out=/proc/x/e"]],
        "contradictions": [["cluster=h100_ib", "nodes=3", "world_size=8"], ["world_size=2", "cluster.efficiency=0.5"]],
    }
    for cls, items in estimator.items():
        for extra in items:
            cases.append(("estimate", cls, lambda a=[*TEXT, *extra]: sdp.estimate.main(a)))
    cases += plan_cases()
    sweep_options = {
        "types": ["sweep.dry_run=maybe", "sweep.nproc=x", "sweep.wait=perhaps", "sweep.launcher=pbs"],
        "ranges": ["sweep.nproc=0", "sweep.timeout_min=0", "sweep.cpus_per_task=-1"],
        "C-type limits": [f"sweep.nproc={2**64}"],
        "contradictions": ["sweep.nodes=2", "run_dir=a,b"],
        "paths": ["sweep.bogus=1"],
    }
    for cls, options in sweep_options.items():
        for option in options:
            dry = [] if option.startswith("sweep.dry_run") else ["sweep.dry_run=true"]  # the last one given wins
            cases.append(("sweep", cls, lambda o=option, d=dry: train.main(["-m", *TEXT, o, *d])))
    out = root / "out-file"
    out.write_text("a file")
    for argv, cls in (
        ([str(root / "none")], "paths"),
        ([str(root), "--out", str(out)], "paths"),
        ([str(root), "--out", "/proc/x"], "paths"),
        ([str(root), "--out", str(root / "o"), "--claims", "--cuda", str(out)], "damaged files"),
        ([str(root), "--out", str(root / "o"), "--claims", "--memory-table", str(root / "no.csv")], "paths"),
    ):
        cases.append(("collect", cls, lambda a=argv: collect.main(a)))
    for argv in ([str(root / "none")], [str(out)], ["/proc"]):
        cases.append(("export", "paths", lambda a=argv: export.main(a)))
    return cases


PLAN = ["devices=2x80", "objective=memory"]  # a plan that needs no cluster


def plan_cases() -> list[tuple[str, str, object]]:
    """The planner: the run's config cases on top of a good plan, and its own options."""
    cases = []
    for cls, items in config_cases().items():
        for extra in items:
            if not any(e.startswith(("--config-dir", "run_dir", "output_root", "name", "dataset.")) for e in extra):
                cases.append(("plan", cls, lambda a=[*TEXT, *PLAN, *extra]: sdp.plan.main(a)))
    own = {
        "ranges": [
            ["devices=0x80"], ["devices=2x0"], ["min_coverage=0"], ["min_coverage=2"], ["top=0"], ["workers=0"],
            ["outer=diloco", "sync_every=0"],
        ],
        "types": [
            ["devices=abc"], ["devices=[80,x]"], ["objective=fast"], ["coverages=some"], ["granularity=atom"],
            ["precision=fp16"], ["checkpointing=some"], ["min_coverage=x"], ["top=x"], ["outer=diloco", "sync_every=x"],
        ],
        "C-type limits": [[f"devices={2**64}x80"], [f"devices=2x{2**64}"], [f"top={2**64}"], [f"workers={2**63}"]],
        "not finite": [
            ["devices=[nan,80]"], ["devices=2xinf"], ["min_coverage=nan"],
            ["cluster=h100_ib", "cluster.efficiency=nan"],
        ],
        "paths": [["out=/etc/passwd"], ["out=/proc/x"]],
        "contradictions": [
            ["world_size=8"], ["masking=forward"], ["trainer.grad_accum_steps=2"], ["cluster.efficiency=0.5"],
            ["cluster=h100_ib", "nodes=3"], ["nodes=2"], ["devices=3x80"], ["sync_every=10"],
            ["outer=diloco", "outer.sync_every=10"],
        ],
    }  # fmt: skip
    for cls, items in own.items():
        for extra in items:
            cases.append(("plan", cls, lambda a=[*TEXT, *PLAN, *extra]: sdp.plan.main(a)))
    return cases


class Hung(BaseException):
    pass


def _hung(signum, frame):
    raise Hung(f"no verdict within {CASE_LIMIT_S} s")


def verdict(call) -> tuple[str, str]:
    """Run one case: ('refused' | 'accepted' | 'traceback' | 'hung' | 'not one line', detail)."""
    err, out = io.StringIO(), io.StringIO()
    signal.alarm(CASE_LIMIT_S)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = call()
    except Accepted:
        return "accepted", ""
    except Hung as h:
        return "hung", str(h)
    except BaseException as e:  # noqa: BLE001 - the failure this test exists to find
        return "traceback", f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
    if code != 2:
        return ("accepted" if code == 0 else "not one line"), f"exit {code}: {err.getvalue()[-300:]}"
    text = err.getvalue()
    lines = [line for line in text.splitlines(keepends=True) if line.startswith("error: ")]
    return ("refused", text) if len(lines) == 1 and ONE_LINE.match(lines[0]) else ("not one line", text[-400:])


def damage_case(entry: str, argv: list[str], name: Path, damage: str, root: Path):
    """A call that damages `name` in the case's run dir, runs the entrypoint, and puts it back."""
    run_dir = Path(argv[0]) / "ddp" if entry == "collect" else Path(argv[0])
    argv = [str(root / "out") if a == "OUT" else a for a in argv]

    def call():
        path = run_dir / name
        before = path.read_bytes() if path.exists() else None
        path.write_text(DAMAGED_TEXT[damage])
        try:
            return (collect.main if entry == "collect" else export.main)(argv)
        finally:
            path.write_bytes(before) if before is not None else path.unlink()

    return call


def run_fuzz(root: Path, *, sample: int | None) -> collections.Counter:
    cases = entrypoint_cases(root)
    cases += [(e, c, damage_case(e, a, n, d, root)) for e, c, a, n, d in file_cases(root / "runs")]
    if sample is not None:  # a seeded sample of every cell
        rng, cells = random.Random(27), collections.defaultdict(list)
        for case in cases:
            cells[case[:2]].append(case)
        cases = [c for cell in cells.values() for c in rng.sample(cell, min(sample, len(cell)))]
    previous = signal.signal(signal.SIGALRM, _hung)
    counts, failures = collections.Counter(), []
    try:
        for entry, cls, call in cases:
            outcome, detail = verdict(call)
            counts[(entry, cls, outcome)] += 1
            if outcome != "refused":
                failures.append(f"{entry} / {cls}: {outcome}: {detail}")
    finally:
        signal.signal(signal.SIGALRM, previous)
    print(count_table(counts))
    assert not failures, "\n".join(failures[:20])
    assert not (root / "outputs").exists() and not (root / "out").exists()  # nothing written
    return counts


def count_table(counts: collections.Counter) -> str:
    """The cases per entrypoint (rows) and value class (columns), every one refused."""
    entries = sorted({e for e, _, _ in counts})
    classes = sorted({c for _, c, _ in counts})
    lines = ["| entrypoint | " + " | ".join(classes) + " |", "|---" * (len(classes) + 1) + "|"]
    for e in entries:
        cells = [str(sum(n for (e2, c2, _), n in counts.items() if (e2, c2) == (e, c)) or "") for c in classes]
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_a_sample_of_every_entrypoint_and_value_class_is_refused_in_one_line(tmp_path, sentinels):
    counts = run_fuzz(tmp_path, sample=SAMPLE_PER_CELL)
    cells = {(e, c) for e, c, _ in counts}
    entrypoints = {"train", "train --cfg job", "launcher", "estimate", "plan", "sweep", "collect", "export"}
    entrypoints |= {"train (every key)", "train --cfg job (every key)"}
    assert {e for e, _ in cells} == entrypoints
    assert len(cells) >= 38 and sum(counts.values()) == 96, (sorted(cells), sum(counts.values()))


def test_every_key_of_the_typed_config_is_fuzzed():
    # 140 keys (a family's model keys once per family, an outer algorithm's own once per algorithm:
    # 116 names, outer.lr in two), of which 21 free strings take any value;
    # the hand-written lists fuzzed 10 whole-number and 9 float keys for C-type limits and NaN.
    keys = typed_keys()
    fuzzed = {k for k, kind, _ in keys if typed_values(k, kind)}
    assert (len(keys), len(fuzzed)) == (140, 116)
    assert {"parallelism.timeout_s", "trainer.max_nonfinite_skips", "model.window_size", "run_dir"} <= fuzzed
    assert {"outer.sync_every", "outer.lr", "outer.momentum", "outer.fragments", "outer.comm_dtype"} <= fuzzed
    assert {"outer.density", "outer.value_bits", "outer.error_decay", "outer.chunk_size"} <= fuzzed
    assert sum(map(len, typed_cases().values())) == 636


@pytest.mark.skipif(os.environ.get("SDP_FUZZ") != "all", reason="every case: make fuzz (SDP_FUZZ=all), 5 min")
def test_every_case_of_every_entrypoint_is_refused_in_one_line(tmp_path, sentinels):
    assert sum(run_fuzz(tmp_path, sample=None).values()) == 1257 + 2 * 636  # every case, each refused
