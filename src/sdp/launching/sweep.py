"""Sweeps: `python -m sdp.train -m KEY=A,B ...` (or `python -m sdp.launching.sweep ...`).

Hydra's sweep syntax (`a=1,2`, `range(...)`, `choice(...)`, `glob(...)`) expands
into the cross product of jobs, in Hydra's order. Every job is a full
`torchrun -m sdp.train` run with its own run dir `SWEEP_DIR/NNN-<overrides>`:

- every job's config is checked first, before anything is launched; a job whose
  config is refused is reported with its one-line error and not launched;
- jobs run one after the other, each in its own process group, so a failing
  job does not stop the ones after it;
- running the same sweep again with the same `sweep.dir=` skips completed jobs
  whose run dir holds the same config (a completed job with another config is
  refused, named with the first differing key, and never silently skipped)
  and resumes stopped or failed ones from their checkpoints; a failed job
  without a checkpoint is reported (its run dir is kept for inspection) and
  runs again once that dir is removed;
- `SWEEP_DIR/sweep.json` lists every job, its overrides, run dir and status
  (overrides and errors redacted there and on the console: `sdp.redact`).

Options, given as `sweep.KEY=VALUE` among the overrides:
`sweep.nproc` (processes per node and job; default: the visible GPUs, else 1),
`sweep.dir` (default `outputs/sweeps/<time>`), `sweep.name` (every job's W&B group,
unless `logger.group=` is given; default: the sweep dir's name; each job's W&B
job_type is its variant), `sweep.dry_run=true` (check and
list the jobs only; it writes nothing), `sweep.launcher`:

- `torchrun` (default): here, one job after the other;
- `slurm`: every job is a Slurm job of `sweep.nodes` nodes x `sweep.nproc`
  tasks, one task per GPU, submitted at once with submitit; each task takes
  its rank, world size and rendezvous address from the Slurm environment and
  runs the entrypoint (no torchrun). `sweep.partition`, `sweep.timeout_min`
  (default 4320), `sweep.cpus_per_task` (default 8) and `sweep.wait`
  (default true: wait for the jobs and report them; false: return after
  submitting) shape the submission; the submitit logs are in SWEEP_DIR/submitit;
- `submitit_local`: the same code path on this machine (submitit's local
  executor starts the tasks), which is how the Slurm path is tested.
"""

from __future__ import annotations

import json
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from sdp import dist
from sdp.errors import ConfigError
from sdp.launching.variants import launch
from sdp.paths import check_writable
from sdp.redact import redact, redact_text
from sdp.run import runner
from sdp.run.config import load_config
from sdp.run.preflight import check_run_dir
from sdp.run.resume import check_completed
from sdp.rundir import read_summary, run_status

SWEEP_KEYS = (
    "nproc",
    "dir",
    "dry_run",
    "launcher",
    "nodes",
    "partition",
    "timeout_min",
    "cpus_per_task",
    "wait",
    "name",
)
LAUNCHERS = ("torchrun", "slurm", "submitit_local")
# The typed sweep options: booleans (with their defaults) and whole numbers >= 1.
FLAGS = {"dry_run": False, "wait": True}
COUNTS = ("nproc", "nodes", "timeout_min", "cpus_per_task")
INTERRUPTED = 130  # a job's (and the sweep's) exit code after Ctrl-C
BOOLEAN_WORDS = {**dict.fromkeys(("true", "yes", "on", "1"), True), **dict.fromkeys(("false", "no", "off", "0"), False)}


@dataclass
class Job:
    index: int
    overrides: list[str]
    run_dir: str
    status: str  # invalid | planned | submitted | completed | stopped | interrupted | failed | skipped (done)
    error: str | None = None
    wall_s: float | None = None
    cluster_id: str | None = None  # the Slurm (or local submitit) job id
    exit_code: int | None = None  # torchrun's, for a job launched here


def split_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """`sweep.*` options apart from the run's overrides."""
    options, overrides = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key.startswith("sweep.") and sep:
            name = key.removeprefix("sweep.")
            if name not in SWEEP_KEYS:
                raise ConfigError(key, value, f"allowed: {', '.join('sweep.' + k for k in SWEEP_KEYS)}")
            options[name] = value
        else:
            overrides.append(arg)
    for name in FLAGS:  # every typed option is checked here, before anything is planned or run
        flag(options, name)
    for name in COUNTS:
        count(options, name, 1)
    return options, overrides


def flag(options: dict[str, str], name: str) -> bool:
    """sweep.NAME as a boolean: true/false, yes/no, on/off or 1/0 (any case); anything else is
    refused (a misspelt sweep.dry_run must not launch the whole sweep)."""
    value = options.get(name)
    if value is None:
        return FLAGS[name]
    word = BOOLEAN_WORDS.get(value.strip().lower())
    if word is None:
        raise ConfigError(f"sweep.{name}", value, "allowed: true, false (or yes/no, on/off, 1/0)")
    return word


def count(options: dict[str, str], name: str, default: int) -> int:
    """sweep.NAME as a whole number >= 1 (`default` when it is not given)."""
    value = options.get(name)
    if value is None:
        return default
    if not re.fullmatch(r"[0-9]+", value.strip()) or int(value) < 1:
        raise ConfigError(f"sweep.{name}", value, "must be a whole number >= 1")
    return int(value)


def expand(overrides: list[str]) -> list[list[str]]:
    """The jobs of a sweep: Hydra's cross product of every sweep override, in Hydra's order."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise ConfigError("overrides", " ".join(overrides), str(err).splitlines()[0]) from None
    for o in parsed:  # the sweep places every run: a run_dir or output_root would be ignored
        if o.key_or_group in ("run_dir", "output_root"):
            value = o.value() if not o.is_sweep_override() else None
            raise ConfigError(
                o.key_or_group, value, "is not for a sweep: each job gets SWEEP_DIR/NNN-<overrides> (sweep.dir=)"
            )
    (batch,) = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for job in batch]


def job_dir(root: Path, index: int, job: list[str], swept: set[str]) -> Path:
    """NNN-<the job's values of the swept keys>, safe as a path and as an override value."""
    label = "-".join(o for o in job if o.split("=", 1)[0] in swept) or "job"
    return root / f"{index:03d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)[:120]}"


def plan(overrides: list[str], *, root: Path, nproc: int, start: int = 0, name: str | None = None) -> list[Job]:
    """Every job with its run dir, checked before anything runs (a refused job is `invalid`);
    numbered from `start` (to append the jobs of another sweep to a plan). Every job's W&B
    group is the sweep's `name` (default: the sweep dir's), unless the overrides set one."""
    jobs = expand(overrides)
    swept = {o.split("=", 1)[0] for o in overrides if "," in o or "(" in o}
    if not any(o.lstrip("+~").startswith("logger.group=") for o in overrides):
        jobs = [[*job, f"logger.group={name or root.name}"] for job in jobs]
    out = []
    for i, job in enumerate(jobs, start):
        run_dir = job_dir(root, i, job, swept)
        status, error = "planned", None
        try:
            cfg = load_config([*job, f"run_dir={run_dir}"], world_size=nproc, offline=dist.hub_offline())
            if run_status(run_dir) == "completed":
                check_completed(run_dir, cfg.record)
                status = "skipped"
            else:
                check_run_dir(cfg)
        except ConfigError as err:
            status, error = "invalid", str(err)
        out.append(Job(i, job, str(run_dir), status, error))
    return out


def _port(job_id: str) -> int:
    """A rendezvous port every task of one job derives alike from the job id."""
    return 20000 + zlib.crc32(job_id.encode()) % 20000


def cluster_task(overrides: list[str]) -> int:
    """One task of a Slurm (or submitit-local) job: rank and rendezvous from the job's
    environment, then the entrypoint in this process."""
    import submitit

    env = submitit.JobEnvironment()
    dist.export_world(
        rank=env.global_rank,
        local_rank=env.local_rank,
        world_size=env.num_tasks,
        local_world_size=env.num_tasks // env.num_nodes,
        addr=env.hostnames[0] if env.num_nodes > 1 else "127.0.0.1",
        port=_port(env.job_id),
    )

    return runner.main(list(overrides))


def _executor(launcher: str, options: dict[str, str], *, root: Path, nproc: int, nodes: int):
    import submitit

    cluster = "slurm" if launcher == "slurm" else "local"
    executor = submitit.AutoExecutor(folder=root / "submitit" / "%j", cluster=cluster)
    params = {"name": "sdp", "tasks_per_node": nproc, "timeout_min": count(options, "timeout_min", 4320)}
    if cluster == "slurm":
        params.update(nodes=nodes, gpus_per_node=nproc, cpus_per_task=count(options, "cpus_per_task", 8))
        if options.get("partition"):
            params["slurm_partition"] = options["partition"]
    executor.update_parameters(**params)
    return executor


def run_sweep(argv: list[str]) -> int:
    """Plan, check and run a sweep; 0 when every valid job completed, 1 when one failed,
    2 when no job could run."""
    try:
        options, overrides = split_options(argv)
        nproc = count(options, "nproc", torch.cuda.device_count() or 1)
        nodes = count(options, "nodes", 1)
        launcher = options.get("launcher", "torchrun")
        if launcher not in LAUNCHERS:
            raise ConfigError("sweep.launcher", launcher, f"allowed: {', '.join(LAUNCHERS)}")
        if nodes > 1 and launcher != "slurm":
            raise ConfigError("sweep.nodes", nodes, "more than one node needs sweep.launcher=slurm")
        root = Path(options.get("dir") or f"outputs/sweeps/{time.strftime('%Y%m%d-%H%M%S')}")
        check_writable("sweep.dir", root)
        jobs = plan(overrides, root=root, nproc=nproc * nodes, name=options.get("name"))
    except (ConfigError, ValueError) as err:
        print(redact_text(f"error: {err}"), file=sys.stderr)
        return 2
    code = execute(jobs, root=root, nproc=nproc, nodes=nodes, launcher=launcher, options=options)
    if jobs and all(j.status == "invalid" for j in jobs):  # nothing could run: the first refusal, as the line
        print(redact_text(f"error: {jobs[0].error}"), file=sys.stderr)
    return code


def execute(
    jobs: list[Job], *, root: Path, nproc: int, nodes: int = 1, launcher: str = "torchrun", options=None
) -> int:
    """Run the planned jobs one after another (torchrun) or through submitit, a failure not
    stopping the others, recording each in ROOT/sweep.json; 0 when every valid job completed,
    1 when one failed, 2 when no job could run."""
    options = options or {}

    def record() -> None:
        (root / "sweep.json").write_text(json.dumps(redact([asdict(j) for j in jobs]), indent=2) + "\n")

    print(f"sweep: {len(jobs)} jobs x {nodes * nproc} processes ({launcher}) -> {root}", flush=True)
    for job in jobs:
        note = f"  ({job.error})" if job.error else ""
        print(redact_text(f"  [{job.index:03d}] {job.status:<8} {' '.join(job.overrides)}{note}"), flush=True)
    runnable = [j for j in jobs if j.status == "planned"]
    if flag(options, "dry_run"):  # lists the plan and writes nothing: sweep.json keeps what ran
        return 0 if runnable or any(j.status == "skipped" for j in jobs) else 2
    root.mkdir(parents=True, exist_ok=True)
    record()
    if launcher == "torchrun":
        for job in runnable:
            job.exit_code, job.wall_s = launch(job.overrides, run_dir=Path(job.run_dir), nproc=nproc)
            summary = read_summary(Path(job.run_dir))
            status = summary.status if summary else None
            if job.exit_code == INTERRUPTED:  # Ctrl-C: the job said where it stopped; so does the sweep
                job.status = status if status in ("stopped", "interrupted") else "interrupted"
                record()
                done = sum(j.status in ("completed", "skipped") for j in jobs)
                print(
                    f"sweep interrupted at job [{job.index:03d}] ({done} of {len(jobs)} jobs done); "
                    "the same command goes on from there",
                    flush=True,
                )
                return INTERRUPTED
            ok = job.exit_code == 0 and status in ("completed", "stopped")
            job.status = status if ok else "failed"
            if not ok:
                job.error = (summary and summary.error) or f"the launch exited with code {job.exit_code}"
            note = "" if ok else f" (exit code {job.exit_code}: {job.error})"
            print(redact_text(f"[{job.index:03d}] {job.status} in {job.wall_s:.0f} s: {job.run_dir}{note}"), flush=True)
            record()
    else:
        executor = _executor(launcher, options, root=root, nproc=nproc, nodes=nodes)
        submitted = []
        for job in runnable:
            handle = executor.submit(cluster_task, [*job.overrides, f"run_dir={job.run_dir}"])
            job.status, job.cluster_id = "submitted", str(handle.job_id)
            submitted.append((job, handle, time.perf_counter()))
            print(f"[{job.index:03d}] submitted as job {handle.job_id}", flush=True)
        record()
        if not flag(options, "wait"):
            return 0
        for job, handle, start in submitted:
            try:
                codes = handle.results()  # one exit code per task
                ok = all(code == 0 for code in codes)
            except Exception as err:  # noqa: BLE001 - a failed job is reported, the others go on
                ok = False
                job.error = str(err).strip().splitlines()[-1][:500] if str(err).strip() else type(err).__name__
            job.wall_s = time.perf_counter() - start
            status = run_status(Path(job.run_dir))
            job.status = status if ok and status in ("completed", "stopped") else "failed"
            print(f"[{job.index:03d}] {job.status}: {job.run_dir}", flush=True)
            record()
    counts = {s: sum(j.status == s for j in jobs) for s in ("completed", "skipped", "stopped", "failed", "invalid")}
    print("sweep done: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n), flush=True)
    if not runnable and not counts["skipped"]:
        return 2
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(run_sweep(sys.argv[1:]))
