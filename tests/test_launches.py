"""The launch counter: what a GPU pays for per op (sdp.metrics.launches), and the overhead
benchmark that reports it (scripts/bench_overhead.py)."""

import pytest
import torch
from conftest import script
from torch._subclasses.fake_tensor import FakeTensorMode

from sdp.metrics.launches import LaunchCounter, is_dense


def _count(fn) -> LaunchCounter:
    with LaunchCounter("x") as counter:
        fn()
    return counter


def test_views_and_allocations_are_free_and_every_computing_op_is_one_launch():
    x = torch.randn(4, 6)
    counter = _count(lambda: (x.narrow(1, 2, 3), x.t(), x.view(-1), x.detach(), torch.empty(3), torch.empty_like(x)))
    assert counter.counts["x"] == 0
    counter = _count(lambda: (x + 1, x.sum(), x.clone(), torch.zeros(3)))
    assert counter.counts["x"] == 4
    assert dict(counter.by_op) == {
        ("x", "aten::add.Tensor"): 1,
        ("x", "aten::sum"): 1,
        ("x", "aten::clone"): 1,
        ("x", "aten::zeros"): 1,
    }


def test_a_foreach_op_is_one_launch_over_dense_tensors_and_one_a_tensor_otherwise():
    a, b, w = torch.zeros(5), torch.zeros(2, 3), torch.zeros(4, 6)
    assert _count(lambda: torch._foreach_add_([a, b, w.narrow(0, 1, 2)], 1.0)).counts["x"] == 1
    columns = w.narrow(1, 2, 3)  # some columns of a matrix: not dense
    assert not is_dense(columns) and is_dense(w.t()) and is_dense(w.narrow(0, 1, 2))
    assert _count(lambda: torch._foreach_add_([a, b, columns], 1.0)).counts["x"] == 3
    # Dense, but the lists do not line up stride for stride: the slow path too.
    t, a2, wt = torch.zeros(6, 4).t(), a.clone(), w.t().contiguous().t()
    assert _count(lambda: torch._foreach_copy_([a, t], [a2, w])).counts["x"] == 2
    assert _count(lambda: torch._foreach_copy_([a, t], [a2, wt])).counts["x"] == 1


def test_host_reads_are_counted_apart_and_phases_split_the_counts():
    x = torch.ones(3)
    with LaunchCounter("a") as counter:
        x.mul(2)
        with counter.counting("b"):
            x.sum().item()
            bool(x.add(1).all())
        x.neg()
    assert dict(counter.counts) == {"a": 2, "b": 3}
    assert dict(counter.host_reads) == {"b": 2}  # item and bool
    assert counter.top("b") == [("aten::sum", 1), ("aten::add.Tensor", 1), ("aten::all", 1)]


def test_a_fused_optimizer_step_is_a_few_launches_whatever_the_tensor_count():
    params = [torch.nn.Parameter(torch.randn(3, 3)) for _ in range(20)]
    for p in params:
        p.grad = torch.randn_like(p)
    fused = torch.optim.AdamW(params, fused=True)
    loop = torch.optim.AdamW(params, foreach=False)
    fused.step(), loop.step()  # state made
    assert _count(fused.step).counts["x"] <= 3  # the step count, the update (and its found_inf handling)
    assert _count(loop.step).counts["x"] > 20 * 5


def test_fake_tensors_count_as_real_ones():
    def step():
        w = torch.randn(8, 4, requires_grad=True)
        y = (torch.randn(2, 8) @ w).relu().sum()
        y.backward()
        torch._foreach_mul_([w.grad], 0.5)

    real = _count(step)
    with FakeTensorMode():
        with LaunchCounter("x") as fake:
            step()
    assert dict(fake.by_op) == dict(real.by_op) and real.counts["x"] >= 6


def _bench():
    return script("bench_overhead")


def _row(variant, forward, backward, sync, **extra):
    launches = {"forward": forward, "backward": backward, "sync": sync, "optimizer": 1, **extra.pop("launches", {})}
    return {"model": "m", "variant": variant, "launches": launches, "dense": True, **extra}


def test_the_benchmark_judges_each_sdp_row_against_its_baseline_and_its_buckets():
    bench = _bench()
    rows = [
        _row("DDP", 100, 200, 10),
        _row("N-SDP forward C=0.5", 100, 240, 35, buckets=4),  # 375 / 310 = 1.21; 35 <= 36
        _row("B-SDP forward C=0.5", 100, 250, 37, buckets=4, dense=False),  # 387 / 310 = 1.248; 37 > 36
        _row("DDP + DiLoCo", 100, 200, 20, launches={"outer sync": 50}),
        _row("N-SDP forward C=0.5 + DiLoCo", 120, 250, 20, buckets=4, outer_buckets=2, launches={"outer sync": 29}),
    ]
    got = {v["variant"]: v for v in bench.verdicts(rows)}
    assert set(got) == {"N-SDP forward C=0.5", "B-SDP forward C=0.5", "N-SDP forward C=0.5 + DiLoCo"}
    assert (got["N-SDP forward C=0.5"]["sync_ok"], got["N-SDP forward C=0.5"]["ratio_ok"]) == (True, True)
    assert (got["B-SDP forward C=0.5"]["sync_ok"], got["B-SDP forward C=0.5"]["ratio_ok"]) == (False, True)
    outer = got["N-SDP forward C=0.5 + DiLoCo"]  # against DDP: 390 / 310 = 1.258; against DDP + DiLoCo 1.22
    assert outer["vs_ddp"] == pytest.approx(390 / 310) and not outer["ratio_ok"]
    assert outer["vs_like"] == pytest.approx(390 / 320) and outer["outer_budget"] == 28 and not outer["outer_ok"]
    assert bench.baseline_of("N-SDP forward C=0.5 x FSDP 2") == "FSDP"


@pytest.mark.slow  # end to end (about 10 s); its parts have the quicker tests above
def test_the_overhead_benchmark_rehearses_on_the_tiny_models(tmp_path):
    bench = _bench()
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "overhead_cpu.md").read_text()
    for model in ("llama_tiny", "resnet_tiny"):
        for variant in bench.SMOKE_VARIANTS:
            assert f"| {model} | {variant} |" in text
    rows = __import__("json").loads((tmp_path / "overhead_cpu.json").read_text())["rows"]
    sdp = [r for r in rows if r["variant"].startswith("N-SDP")]
    assert all(r["buckets"] > 0 and r["pieces"] >= r["buckets"] for r in sdp)
    assert all(r["launches"][p] > 0 for r in rows for p in ("forward", "backward", "sync", "optimizer"))
    assert all("outer sync" in r["launches"] for r in rows if r["variant"].endswith("DiLoCo"))
