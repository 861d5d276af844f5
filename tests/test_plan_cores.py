"""The planner's default number of tracing processes: the CPUs this process may use, capped by
its cgroup's quota and by the memory a tracing worker needs (sdp.planning.cores)."""

from pathlib import Path

import pytest

from sdp.planning import cores

GIB = 2**30


def cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "files,cpus",
    [
        ({"cpu.max": "200000 100000\n"}, 2.0),  # cgroup v2: docker --cpus=2
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4.0),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_the_cgroup_cpu_quota_is_read_from_either_version(tmp_path, files, cpus):
    assert cores.cpu_quota(cgroup(tmp_path, files)) == cpus


def test_the_quota_and_the_memory_bound_the_default_below_the_affinity(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "affinity", lambda: 16)  # a 16-core GPU host
    monkeypatch.setattr(cores, "available_bytes", lambda root: 64 * GIB)
    assert cores.default_workers(cgroup(tmp_path / "a", {})) == 16
    assert cores.default_workers(cgroup(tmp_path / "b", {"cpu.max": "850000 100000"})) == 8  # 8.5 CPUs
    monkeypatch.setattr(cores, "available_bytes", lambda root: int(3.7 * GIB))  # 3 workers of 1.2 GiB
    assert cores.default_workers(cgroup(tmp_path / "c", {})) == 3
    monkeypatch.setattr(cores, "available_bytes", lambda root: GIB // 2)
    assert cores.default_workers(cgroup(tmp_path / "d", {})) == 1  # always one


def test_a_cgroup_memory_limit_caps_what_is_available(tmp_path):
    v2 = cgroup(tmp_path / "v2", {"memory.max": str(4 * GIB), "memory.current": str(GIB)})
    assert cores.cgroup_memory_left(v2) == 3 * GIB
    v1 = {"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "100"}
    assert cores.cgroup_memory_left(cgroup(tmp_path / "v1", v1)) is None  # v1's "no limit"
    assert cores.available_bytes(v2) <= 3 * GIB


class Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_progress_is_one_rewritten_line_on_a_terminal_and_silent_elsewhere(monkeypatch):
    from types import SimpleNamespace

    from sdp.planning import planner

    clock = iter([0.0, 0.0, 10.0, 30.0])  # both starts, then after each structure
    monkeypatch.setattr(planner.time, "perf_counter", lambda: next(clock))
    tty, log = planner.Progress(Stream(True)), planner.Progress(Stream(False))
    for done, made in ((1, 3), (2, 2)):
        outcome = SimpleNamespace(traces=(made, 0))
        tty(outcome, done, 2)
    assert tty.stream.text == (
        "\r\x1b[K[1/2] structures searched, 3 traces made, about 10 s left"
        "\r\x1b[K[2/2] structures searched, 5 traces made, about 0 s left\n"
    )
    log(SimpleNamespace(traces=(4, 0)), 1, 2)
    assert log.stream.text == "" and log.made == 4
