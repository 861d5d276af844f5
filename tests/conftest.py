"""Shared test setup: offline everywhere; multi-rank jobs forked from one pre-imported server
(tests/ranks.py), and real torchrun launches counted against LAUNCH_BUDGET."""

from __future__ import annotations

import collections
import copy
import functools
import json
import os
import subprocess
from pathlib import Path

import pytest
from ranks import STARTED, run_ranks

from sdp.launching.variants import torchrun_command
from sdp.rundir import read_summary

# Real torchrun launches the default suite may make (the CLI under torchrun, restarts, signals,
# the hung rank, resize, a sweep's jobs); every other multi-rank job forks its ranks
# (tests/ranks.py). Counted over the session; above it the session fails, naming the tests.
LAUNCH_BUDGET = 20

# The tiny model of each family and a dataset of its kind, shared by the SDP tests.
TINY_MODELS = {
    "llama": ("llama_tiny", "synthetic_text"),
    "resnet": ("resnet_tiny", "synthetic_image"),
    "swin": ("swin_tiny", "synthetic_image"),
}
# One rank of a tiny LLaMA job played in this process (tests/test_mfu.py, test_host_sync.py):
# its overrides, and DDP's and the four SDP variants' at C = 0.5.
ONE_RANK_LLAMA = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=8"]
LLAMA_VARIANTS = {
    "DDP": ["masking=none"],
    "N-SDP backward": ["masking=backward", "masking.coverage=0.5"],
    "N-SDP forward": ["masking=forward", "masking.coverage=0.5"],
    "B-SDP backward": ["masking=backward", "masking.granularity=block", "masking.coverage=0.5"],
    "B-SDP forward": ["masking=forward", "masking.granularity=block", "masking.coverage=0.5"],
}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
os.environ.update(OFFLINE_ENV)

# Two bf16 computations of one value that round in different places (the LM head chunked against
# full, compiled against eager) agree to bf16's resolution on any CPU, not to 1e-5: oneDNN's AMX,
# AVX512-BF16 and AVX2 kernels sum the same products in other orders (AMX differently at each
# chunk size). bf16 keeps 8 significant bits, so a result lies within 2^-8 of its exact value and
# two results may be one ulp, 2^-7, apart (relative). The loss is one such rounding deep (the
# head's logits; fp32 from there); a gradient rounds again over inputs each an ulp apart: two ulps
# (measured between kernel families, the tiny LLaMA's: 1.01 ulps). A bug's difference is larger: a
# chunk dropped or weighted as a chunk mean moves the gradients 0.24 or more, a 1.01 scale the loss
# 0.01; subtler ones are the fp32 checks' (1e-5) to catch.
BF16_LOSS_REL = 2**-7
BF16_GRAD_REL = 2**-6


@pytest.fixture
def group(tmp_path):
    """A gloo process group of one, in this process (collective code without torchrun)."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


def launch(overrides: list[str], *, nproc: int = 2, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """The entrypoint `sdp.train` on `nproc` ranks forked as torchrun would start them (see
    tests/ranks.py); returns what `torchrun --nproc_per_node=nproc -m sdp.train` would."""
    return run_ranks("sdp.train:main", overrides, nproc=nproc, cwd=cwd, env=job_env(), timeout=timeout)


def torchrun(overrides: list[str], *, nproc: int = 2, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """A real `torchrun --nproc_per_node=nproc -m sdp.train overrides` (counted against LAUNCH_BUDGET)."""
    cmd = torchrun_command(nproc, "-m", "sdp.train", *overrides)
    return subprocess.run(cmd, cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session", autouse=True)
def _trace_cache(tmp_path_factory):
    """The planner's traces (sdp.planning.traces) in the session's temporary folder, not the user's."""
    os.environ["SDP_CACHE_DIR"] = str(tmp_path_factory.mktemp("sdp-cache"))


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a launched test job: offline, one thread per process."""
    return {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """summary.json and the records of metrics.jsonl of a finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # What the run wrote is exactly the typed record (sdp.rundir.Summary), field for field.
    assert read_summary(run_dir).to_json() == summary
    return summary, records


def tiny_model_cfg(family: str):
    """The typed model config of the family's tiny model (a copy: composing costs ~0.1 s)."""
    return copy.deepcopy(_tiny_model_cfg(family))


@functools.cache
def _tiny_model_cfg(family: str):
    from sdp.run.config import typed_config

    model, dataset = TINY_MODELS[family]
    return typed_config([f"model={model}", f"dataset={dataset}"]).model


def script(name: str):
    """The module of scripts/NAME.py, loaded as the test's own (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# CPU kernels that round the same on any x86-64 CPU with AVX2: MKL's reproducible AVX2 path
# and oneDNN's AVX2 kernels. Bits compared with a file (tests/data/bits_k4.json) are made and
# checked under them; a CPU's own kernels (AVX-512, AMX) sum in other orders.
PINNED_KERNELS = {"MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def run_harness(scenario: str, nproc: int, out: Path, **env: str) -> dict:
    """Run one scenario of tests/dist_harness.py on `nproc` forked ranks (`env` added to theirs);
    returns what rank 0 wrote to `out`."""
    proc = run_ranks(
        "dist_harness:main", [scenario, str(out)], nproc=nproc, cwd=out.parent, env=job_env(**env), timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def estimator_config(overrides: list[str], world_size: int = 2):
    """A typed, validated run config as the memory estimator loads it (no data checks)."""
    from sdp.run.config import load_config

    return load_config(overrides, world_size=world_size, offline=True, check_data=False)


def load_model_pt(run_dir: Path, overrides: list[str]):
    """A run's model.pt loaded, strictly, into a freshly built plain model, in eval mode."""
    import torch

    from sdp.models import build_model
    from sdp.run.config import typed_config

    model = build_model(typed_config(overrides).model)
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True), strict=True)
    return model.eval()


# Every process the tests start: torchrun launches (agent and workers) by the test that made
# them, other subprocesses, and forked ranks (tests/ranks.py); printed at the end of the session.
TORCHRUNS: list[tuple[str, int]] = []
OTHER_PROCESSES: collections.Counter[str] = collections.Counter()
_popen_init = subprocess.Popen.__init__


def _counting_init(self, args, *rest, **kwargs):
    argv = [str(a) for a in args] if isinstance(args, list | tuple) else [str(args)]
    test = os.environ.get("PYTEST_CURRENT_TEST", "(outside any test)").split(" ")[0]
    flags = (
        "--nproc_per_node=",
        "--nproc-per-node=",
    )  # torchrun's, or the entrypoint as launcher (sdp.launching.torchrun)
    if "torch.distributed.run" in argv or any(a.startswith(flags) for a in argv):
        nproc = next((int(a.split("=")[1]) for a in argv if a.startswith(flags)), 1)
        TORCHRUNS.append((test, nproc))
    else:
        OTHER_PROCESSES[test.split("::")[0]] += 1
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _counting_init


def process_report(torchruns: list[tuple[str, int]], others: collections.Counter, *, budget: int) -> list[str]:
    """The end-of-session lines: what the tests started and, above the budget, which tests
    launched torchrun (an "error:" line, then one line per test)."""
    workers = sum(n for _, n in torchruns)
    lines = [
        f"processes: {len(torchruns)} torchrun launches (budget {budget}) starting {len(torchruns) + workers} "
        f"processes, {others.total()} other subprocesses, {STARTED['ranks']} forked ranks in {STARTED['jobs']} jobs"
    ]
    if others:
        lines.append(
            "other subprocesses by file (most first): " + ", ".join(f"{f} {n}" for f, n in others.most_common(5))
        )
    if len(torchruns) > budget:
        lines.append(f"error: {len(torchruns)} torchrun launches exceed LAUNCH_BUDGET={budget}:")
        by_test = collections.Counter(test for test, _ in torchruns)
        lines += [f"  {n} {test}" for test, n in sorted(by_test.items())]
    return lines


def _counted(config) -> bool:
    """Whether this process holds the session's whole count: without pytest-xdist, or its
    controller, to which each worker hands its share when it ends (`pytest_testnodedown`)."""
    return not hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
    """Files with a multi-rank job first (a stable sort): under make test's `--dist loadfile`
    the longest files start at once, not one of them last on a worker while the other idles."""
    multi_rank = {item.path for item in items if item.get_closest_marker("dist")}
    items.sort(key=lambda item: item.path not in multi_rank)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: add a finished worker's processes to the session's count."""
    share = getattr(node, "workeroutput", {}).get("processes")
    if share:
        TORCHRUNS.extend(tuple(t) for t in share["torchruns"])
        OTHER_PROCESSES.update(share["others"])
        for key, n in share["started"].items():
            STARTED[key] += n


def pytest_terminal_summary(terminalreporter):
    if _counted(terminalreporter.config):
        for line in process_report(TORCHRUNS, OTHER_PROCESSES, budget=LAUNCH_BUDGET):
            terminalreporter.write_line(line)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its share, to the controller
        share = {"torchruns": TORCHRUNS, "others": dict(OTHER_PROCESSES), "started": dict(STARTED)}
        session.config.workeroutput["processes"] = share
    if _counted(session.config) and len(TORCHRUNS) > LAUNCH_BUDGET:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
