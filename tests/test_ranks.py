"""The test suite's own machinery: ranks forked as torchrun would start them (tests/ranks.py),
and the count of torchrun launches against LAUNCH_BUDGET (tests/conftest.py)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

import pytest
from conftest import TORCHRUNS, job_env, process_report
from ranks import job_exit_code, run_ranks

WORLD_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS", "PROBE")


def show_world(argv: list[str]) -> int:
    """A rank that prints its environment, its cwd and its arguments, and returns argv[0]."""
    print(*(f"{k}={os.environ.get(k)}" for k in WORLD_KEYS), f"cwd={os.getcwd()}", *argv[1:])
    return int(argv[0])


def all_reduce_ranks(argv: list[str]) -> int:
    """Join the job's process group as the entrypoint does (env://) and sum the ranks."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    print(f"sum={int(total)} threads={torch.get_num_threads()}")
    dist.destroy_process_group()
    return 0


def fail_or_wait(argv: list[str]) -> int:
    """Rank 1 raises; every other rank waits far longer than the test (until stopped)."""
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 failed on purpose")
    time.sleep(120)
    return 0


def wait(argv: list[str]) -> int:
    time.sleep(120)
    return 0


def test_each_rank_gets_torchruns_environment_the_callers_env_and_cwd(tmp_path):
    proc = run_ranks("test_ranks:show_world", ["0", "a b"], nproc=3, cwd=tmp_path, env={**job_env(), "PROBE": "x"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3  # in rank order
    for rank, line in enumerate(lines):
        want = [f"RANK={rank}", f"LOCAL_RANK={rank}", "WORLD_SIZE=3", "LOCAL_WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1"]
        assert line.split(" ") == [*want, "OMP_NUM_THREADS=1", "PROBE=x", f"cwd={tmp_path}", "a", "b"]


def test_ranks_meet_in_a_fresh_store_per_job(tmp_path):
    for _ in range(2):  # a second job on a new port, after the first one's ranks are gone
        proc = run_ranks("test_ranks:all_reduce_ranks", [], nproc=3, cwd=tmp_path, env=job_env())
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == ["sum=6 threads=1"] * 3


def test_a_nonzero_return_fails_the_job_as_the_launcher_does(tmp_path):
    # (Whether the other rank printed first is a race: a failed rank gets the others stopped.)
    proc = run_ranks("test_ranks:show_world", ["2"], nproc=2, cwd=tmp_path, env=job_env())
    assert proc.returncode == 2
    assert [job_exit_code(c) for c in ([0, 0], [-15, 3], [1, -15], [-9, -15], [0, 130])] == [0, 3, 1, 137, 130]


def test_a_failed_rank_stops_the_others_and_its_traceback_is_kept(tmp_path):
    start = time.monotonic()
    proc = run_ranks("test_ranks:fail_or_wait", [], nproc=3, cwd=tmp_path, env=job_env(), timeout=100)
    assert time.monotonic() - start < 30  # SIGTERM to ranks 0 and 2, not their 120 s
    assert proc.returncode == 1
    assert proc.stderr.rstrip().endswith("ValueError: rank 1 failed on purpose")


def test_a_job_past_its_timeout_is_killed_with_its_output(tmp_path):
    with pytest.raises(TimeoutError, match="on 2 ranks: not done after 2 s"):
        run_ranks("test_ranks:wait", [], nproc=2, cwd=tmp_path, env=job_env(), timeout=2)


def test_torchrun_launches_are_counted_by_the_test_that_made_them():
    before = len(TORCHRUNS)
    # The hook reads the command line only: a process that merely names torchrun is counted.
    argv = [sys.executable, "-c", "pass", "-m", "torch.distributed.run", "--nproc_per_node=3"]
    subprocess.run(argv, check=True)
    try:
        assert TORCHRUNS[before:] == [(os.environ["PYTEST_CURRENT_TEST"].split(" ")[0], 3)]
    finally:
        del TORCHRUNS[before:]  # not a launch of the suite's


def test_the_session_fails_above_the_budget_naming_the_tests():
    runs = [("test_a.py::test_x", 2)] * 2 + [("test_b.py::test_y", 4)]
    others = collections.Counter({"test_c.py": 5, "test_a.py": 1})
    within = process_report(runs, others, budget=3)
    assert within[0].startswith("processes: 3 torchrun launches (budget 3) starting 11 processes, 6 other subprocesses")
    assert within[1] == "other subprocesses by file (most first): test_c.py 5, test_a.py 1"
    assert len(within) == 2
    over = process_report(runs, others, budget=2)
    assert over[2:] == [
        "error: 3 torchrun launches exceed LAUNCH_BUDGET=2:",
        "  2 test_a.py::test_x",
        "  1 test_b.py::test_y",
    ]
