"""How many processes the planner traces in by default: the CPUs this process may use (its
affinity, capped by its cgroup's CPU quota), bounded by the memory a tracing worker needs.

A trace under fake tensors runs no kernels: it is bound by Python's dispatch, one core a
process, so the search scales with processes until memory runs out. A container on a 128-core
host that may use 8 of them (`docker --cpus=8`) sees 128 in `os.cpu_count()`; its affinity or
its quota says 8.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

# Peak resident memory of one tracing worker (llama_1b, the 8 x 24 GiB plan's largest traces;
# measured with /usr/bin/time -v, docs/plan.md "Runtime").
TRACE_WORKER_GIB = 1.2
GIB = 2**30
CGROUP = Path("/sys/fs/cgroup")


def affinity() -> int:
    """The CPUs the scheduler may run this process on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _own_cgroup(root: Path) -> Path:
    """This process's cgroup v2 folder (the unified hierarchy's "0::/path" line), else the root."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = root / line[3:].lstrip("/")
                return own if own.is_dir() else root
    except OSError:
        pass
    return root


def cpu_quota(root: Path = CGROUP) -> float | None:
    """The CPUs the cgroup's quota allows (v2 cpu.max, v1 cfs quota / period); None: no quota."""
    for path in (_own_cgroup(root) / "cpu.max", root / "cpu.max"):
        if path.is_file():
            quota, _, period = path.read_text().strip().partition(" ")
            return None if quota == "max" else int(quota) / int(period or 100000)
    for folder in (root / "cpu", root / "cpu,cpuacct"):
        quota, period = folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us"
        if quota.is_file() and period.is_file():
            q = int(quota.read_text())
            return None if q < 0 else q / int(period.read_text())
    return None


def cgroup_memory_left(root: Path = CGROUP) -> int | None:
    """Bytes the cgroup's memory limit leaves (v2 memory.max less memory.current, v1
    limit_in_bytes less usage_in_bytes); None: no limit."""
    own, v1 = _own_cgroup(root), root / "memory"
    pairs = ((own / "memory.max", own / "memory.current"), (v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes"))
    for limit, used in pairs:
        if limit.is_file() and used.is_file():
            text = limit.read_text().strip()
            if text == "max" or int(text) >= 2**60:  # v1 writes "no limit" as nearly 2**63
                return None
            return int(text) - int(used.read_text())
    return None


def available_bytes(root: Path = CGROUP) -> int | None:
    """Memory this process may still take: MemAvailable, capped by what its cgroup's limit leaves."""
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
    except OSError:
        pass
    left = cgroup_memory_left(root)
    if left is not None:
        found = left if found is None else min(found, left)
    return found


def default_workers(root: Path = CGROUP) -> int:
    """The processes a plan traces in by default: usable CPUs, at most one a TRACE_WORKER_GIB of
    available memory, at least 1."""
    cpus = affinity()
    quota = cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    memory = available_bytes(root)
    if memory is not None:
        cpus = min(cpus, max(1, int(memory // (TRACE_WORKER_GIB * GIB))))
    return max(1, cpus)
