"""The GPU check script, rehearsed on the CPU: its overhead part runs the real SDP step under a
fake process group (what the H200 run measures at scale)."""

import importlib.util
from pathlib import Path

import torch


def _script():
    path = Path(__file__).parents[1] / "scripts" / "cuda_overlap_check.py"
    spec = importlib.util.spec_from_file_location("cuda_overlap_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_overhead_part_times_serial_and_overlapped_steps_on_the_cpu():
    script = _script()
    cpu = torch.device("cpu")
    variant = script.VARIANTS["N-SDP backward"]
    times = [
        script.overhead("llama_tiny", variant, overlap=o, steps=2, device=cpu, smoke=True)["step_s"]
        for o in (False, True)
    ]
    assert all(t > 0 for t in times)
