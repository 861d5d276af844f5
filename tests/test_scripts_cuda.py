"""The GPU check script, rehearsed on the CPU: its overhead part runs the real SDP step under a
fake process group (what the H200 run measures at scale)."""

import argparse

import pytest
import torch
from conftest import script


def _script():
    return script("cuda_overlap_check")


def test_the_overhead_part_times_serial_and_overlapped_steps_on_the_cpu():
    script = _script()
    cpu = torch.device("cpu")
    variant = script.VARIANTS["N-SDP backward"]
    times = [
        script.overhead("llama_tiny", variant, overlap=o, steps=2, device=cpu, smoke=True)["step_s"]
        for o in (False, True)
    ]
    assert all(t > 0 for t in times)


@pytest.mark.slow  # end to end; make test runs it, make test-fast leaves it (docs/testing.md)
def test_the_gpu_speed_check_rehearses_on_the_cpu(tmp_path):
    # --smoke: the tiny LLaMA on CPU, DDP eager and compiled (inductor) and N-SDP forward eager, 2
    # steps each, each in a process of its own, as the H200 run would measure them (a fake process
    # group, the fused optimizer, the device-side guard), beside the estimate and the modelled step.
    gpu = script("gpu_speed_check")
    assert gpu.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = __import__("json").loads((tmp_path / "gpu_speed_cpu.json").read_text())["rows"]
    assert [(r["variant"], r["compile"]) for r in rows] == [("DDP", False), ("DDP", True), ("N-SDP forward", False)]
    assert all(r["measured"]["tokens_per_s"] > 0 and r["measured"]["mfu"] is None for r in rows)
    assert all(r["estimated_peak"] > 0 and r["modelled_step_s"] > 0 for r in rows)
    assert rows[0]["modelled_step_s"] != rows[1]["modelled_step_s"]  # compiled: a model of its own
    assert "| DDP | yes | 4 |" in (tmp_path / "gpu_speed_cpu.md").read_text()


def test_the_step_model_check_fits_on_ddp_and_predicts_the_rest(tmp_path):
    # Made-up measurements of the tiny LLaMA (the rows the GPU script writes): the fit reads only
    # DDP's, and every row gets its modelled step and ratio.
    check = script("step_model_check")
    phases = {"data": 0.0, "forward": 0.002, "backward": 0.004, "sync": 0.0005, "optimizer": 0.0005}
    rows = [
        {
            "model": "llama_tiny",
            "variant": v,
            "compile": c,
            "loss": "chunked",
            "measured": {"phases_s": phases, "step_s": 0.007},
        }
        for v, c in (("DDP", False), ("DDP", True), ("N-SDP forward", False))
    ]
    measured = tmp_path / "gpu_speed_test.json"
    measured.write_text(__import__("json").dumps({"device": "test", "rows": rows}))
    got = check.run(
        argparse.Namespace(
            measured=measured, cluster="h200_nvlink", world_size=2, out=tmp_path, smoke=True, argv=[], traced_with="x"
        )
    )
    assert [r["fitted"] for r in got] == ["eager: efficiency, memory_efficiency", "compiled: compiled_fusion", None]
    assert all(r["modelled"]["step"] > 0 and r["launches"] > 0 for r in got)
    text = (tmp_path / "step_model_test.md").read_text()
    assert "| llama_tiny | N-SDP forward | no | 7 |" in text
