"""The step-time model: its collective costs, its schedule, and the estimator's cluster= mode."""

from types import SimpleNamespace

import pytest
from conftest import estimator_config

from sdp.errors import ConfigError
from sdp.estimate import ddp_overrides, main
from sdp.planning.estimator import estimate
from sdp.planning.options import parse_estimate as parse_args
from sdp.planning.step_time import (
    Cluster,
    Collective,
    collective_seconds,
    compute_clock,
    load_cluster,
    outer_sync_times,
    place,
    simulate,
    step_times,
)

TINY = ["model=llama_tiny", "dataset=synthetic_text", "trainer.global_batch_size=16"]


def machine(**kw) -> Cluster:
    # 1 TFLOP/s of compute; 10 GB/s and 1 us per step within a node of 4, 1 GB/s and 10 us across.
    base = dict(name="test", devices_per_node=4, peak_tflops_bf16=2.0, peak_tflops_fp32=1.0, efficiency=1.0,
                memory_gbps=100.0, intra_node_gbps=10.0, intra_node_latency_us=1.0, inter_node_gbps=1.0,
                inter_node_latency_us=10.0)  # fmt: skip
    return Cluster(**{**base, **kw})


def c(op="all_reduce", nbytes=10**9, ranks=(0, 1), issue=0.0, need=0.0, kind="grad_sync"):
    return Collective(op, kind, nbytes, ranks, issue, need)


def test_ring_costs_follow_the_alpha_beta_model():
    m = machine()
    assert collective_seconds(c(ranks=(0, 1, 2, 3)), m) == pytest.approx(6e-6 + 1.5 * 0.1)  # 2(n-1) a + 2(n-1)/n B/b
    assert collective_seconds(c(op="broadcast", ranks=(0, 1, 2, 3)), m) == pytest.approx(3e-6 + 0.1)
    assert collective_seconds(c(op="all_gather", ranks=(0, 1)), m) == pytest.approx(1e-6 + 0.1)
    assert collective_seconds(c(op="reduce_scatter", ranks=(0, 1)), m) == pytest.approx(1e-6 + 0.05)
    # A group that spans two nodes runs at the slower link.
    assert collective_seconds(c(ranks=(3, 4)), m) == pytest.approx(2e-5 + 1.0)
    assert collective_seconds(c(ranks=(5,)), m) == 0.0


def tape(n: int = 2000, flops: int = 10**9, nbytes: int = 0, *, phase: str = "forward", optimizer: bool = False):
    """A traced step's ops (Estimate.ops): `n` alike ops in `phase`, one launch each; with
    `optimizer`, one more op in the optimizer phase that counts nothing (the FLOPs-alone model
    charges it the optimizer's bytes)."""
    ops = {"launches": [1] * n, "flops": [flops] * n, "bytes": [nbytes] * n, "phases": [[phase, 0]]}
    if optimizer:
        ops = {k: v + [0] if k != "phases" else v + [["optimizer", n]] for k, v in ops.items()}
        ops["launches"][-1] = 1
    return ops


def run(collectives, m, ops=None, *, optimizer_bytes=0.0, serial=False, precision="fp32"):
    compute = compute_clock(ops or tape(), m, precision=precision, optimizer_bytes=optimizer_bytes)
    return simulate(collectives, compute=compute, cluster=m, serial=serial)


def test_overlap_hides_what_finishes_before_it_is_needed():
    m = machine(intra_node_latency_us=0.0)
    # 2000 ops of 1 GFLOP (2 s). A 0.1 s all-reduce of 2 ranks issued after op 500 (0.5 s) and
    # needed at the end is hidden; one issued at 1.95 s is exposed for 0.05 s; serial exposes both.
    cs = [c(issue=500, need=2000), c(issue=1950, need=2000)]
    ops = tape(optimizer=True)
    over, serial = run(cs, m, ops, optimizer_bytes=1e9), run(cs, m, ops, optimizer_bytes=1e9, serial=True)
    assert over.compute_s == pytest.approx(2.0) and over.optimizer_s == pytest.approx(0.01)
    assert over.exposed_comm_s == pytest.approx(0.05) and serial.exposed_comm_s == pytest.approx(0.2)
    assert over.step_s == pytest.approx(2.06) and serial.step_s == pytest.approx(2.21)
    # One channel: a second collective waits for the first, then its own time.
    queued = [c(issue=1900, need=2000), c(issue=1900, need=2000)]
    assert run(queued, m).exposed_comm_s == pytest.approx(0.1)


def test_communication_beside_the_compute_can_slow_it():
    # 0.1 s of all-reduce hidden behind 2 s of compute: free on separate engines, 0.05 s on
    # shared cores at share 0.5; the serial schedule hides nothing, so it is unchanged.
    cs = [c(issue=500, need=2000)]
    m = machine(intra_node_latency_us=0.0, comm_compute_share=0.5)
    over, serial = run(cs, m), run(cs, m, serial=True)
    assert over.exposed_comm_s == 0.0 and over.step_s == pytest.approx(2.05)
    assert serial.step_s == pytest.approx(2.1)


def test_a_stall_delays_everything_after_it():
    m = machine(intra_node_latency_us=0.0)
    # The first collective stalls the compute by 0.1 s at 0.5 s; the second, issued at 1 s of
    # compute, then starts at 1.1 s of wall time and ends at 1.2, needed at 1.5 s of compute (1.6 wall).
    t = run([c(issue=500, need=500), c(issue=1000, need=1500)], m)
    assert t.exposed_comm_s == pytest.approx(0.1) and t.step_s == pytest.approx(2.1)


def test_fsdp_all_gathers_start_one_block_ahead():
    m = machine(intra_node_latency_us=0.0)
    gathers = [c(op="all_gather", kind="param_all_gather", issue=p, need=p) for p in (0, 1000)]
    assert run(gathers, m).exposed_comm_s == pytest.approx(0.1)  # the first block's waits; the second was prefetched


def test_bf16_compute_uses_the_bf16_peak():
    assert run([], machine(), precision="bf16").compute_s == pytest.approx(1.0)


def test_a_step_of_small_ops_waits_on_the_host_and_large_ones_hide_it():
    # 1000 ops of 1 MFLOP (1 us each at 1 TFLOP/s) issued at 10 us each: the device waits on the host.
    m = machine(launch_us=10.0)
    small = compute_clock(tape(1000, 10**6), m, precision="fp32")
    assert small.clock[-1] == pytest.approx(1000 * 10e-6 + 1e-6)  # the last op starts when issued
    assert small.launch_s == pytest.approx(0.01) and small.flop_s == pytest.approx(1e-3)
    assert small.host_wait_s == pytest.approx(0.01 + 1e-6 - 1e-3)
    # 10 ops of 1 s: the host runs ahead, and only the first launch shows.
    large = compute_clock(tape(10, 10**12), m, precision="fp32")
    assert large.clock[-1] == pytest.approx(10 + 10e-6) and large.host_wait_s == pytest.approx(10e-6)


def test_a_small_matrix_product_is_bound_by_its_bytes():
    # 1 GFLOP over 1 GB: 1 ms of FLOPs, 10 ms of bytes at 100 GB/s (the roofline), unless bytes are not charged.
    ops = tape(1, 10**9, 10**9)
    assert compute_clock(ops, machine(memory_bound_ops=True), precision="fp32").clock == [pytest.approx(0.01)]
    assert compute_clock(ops, machine(), precision="fp32").clock == [pytest.approx(0.001)]


def test_the_other_ops_reach_a_share_of_the_bandwidth():
    # 1 GB at 100 GB/s x 0.25: 40 ms; a matrix product's FLOPs are not scaled by it.
    m = machine(memory_bound_ops=True, memory_efficiency=0.25)
    assert compute_clock(tape(1, 0, 10**9), m, precision="fp32").clock == [pytest.approx(0.04)]
    assert compute_clock(tape(1, 10**12, 0), m, precision="fp32").clock == [pytest.approx(1.0)]


def test_the_traced_step_keeps_its_ops_in_order_with_their_phases():
    est = estimate(estimator_config([*TINY, "masking=forward", "masking.coverage=0.5"], 4), world_size=4, rank=0)
    ops = est.ops
    assert sum(ops["flops"]) == est.flops_per_step and len(ops["launches"]) == len(ops["bytes"])
    # Before the first phase, the step's loss is zeroed ("step"); forward masking refreshes nothing after it.
    assert [p for p, _ in ops["phases"]] == ["step", "forward", "backward", "sync", "optimizer"]
    assert all(b >= 0 for b in ops["bytes"]) and min(ops["launches"]) >= 1
    # The fused optimizer is a few ops over every trained tensor.
    assert sum(ops["launches"][ops["phases"][4][1] :]) <= 3


def test_a_compiled_run_fuses_its_forward_and_backward_elementwise_ops():
    # 100 elementwise ops (0 FLOPs, 1 MB each: 10 us at 100 GB/s) and one 1 GFLOP product, forward;
    # compiled at fusion 0.25, the elementwise ops launch and move a quarter of it, the product as much.
    m = machine(memory_bound_ops=True, launch_us=1.0, compiled_fusion=0.25)
    ops = tape(100, 0, 10**6)
    ops = {
        k: v + ([10**9] if k == "flops" else [0] if k == "bytes" else [1]) if k != "phases" else v
        for k, v in ops.items()
    }
    eager = compute_clock(ops, m, precision="fp32")
    compiled = compute_clock(ops, m, precision="fp32", compiled=True)
    assert eager.launches == 101 and compiled.launches == pytest.approx(26)
    assert eager.memory_s == pytest.approx(1e-3) and compiled.memory_s == pytest.approx(0.25e-3)
    assert compiled.flop_s == eager.flop_s == pytest.approx(1e-3)
    # Sync and optimizer phases run eager either way.
    sync = tape(100, 0, 10**6, phase="sync")
    assert compute_clock(sync, m, precision="fp32", compiled=True).launches == 100


def test_clusters_load_with_overrides_and_refuse_bad_keys():
    cluster = load_cluster("h100_ib", {"efficiency": "0.5"})
    assert cluster.efficiency == 0.5 and cluster.devices_per_node == 8
    with pytest.raises(ConfigError, match=r"^cluster='dgx': unknown cluster; allowed: .*h100_ib, h100_nvlink"):
        load_cluster("dgx")
    with pytest.raises(ConfigError, match=r"^cluster.speed='1': no such key"):
        load_cluster("h100_ib", {"speed": "1"})
    with pytest.raises(ConfigError, match=r"^cluster.efficiency=1.5: must be in \(0, 1\]"):
        load_cluster("h100_ib", {"efficiency": "1.5"})
    with pytest.raises(ConfigError, match=r"^cluster.memory_bound_ops='yes': must be true or false$"):
        load_cluster("h100_ib", {"memory_bound_ops": "yes"})
    with pytest.raises(ConfigError, match=r"^cluster.launch_us=-1.0: must be >= 0$"):
        load_cluster("h100_ib", {"launch_us": "-1"})
    assert load_cluster("h100_ib", {"memory_bound_ops": "false"}).memory_bound_ops is False


def test_nodes_spread_the_ranks():
    cluster = load_cluster("h100_ib")
    place(cluster, world_size=8, nodes=2)
    assert cluster.ranks_per_node == 4
    with pytest.raises(ConfigError, match=r"^nodes=1: puts 16 ranks on a node of 8 devices .*allowed: 2 nodes"):
        place(cluster, world_size=16, nodes=1)
    assert parse_args(["cluster=h100_ib", "nodes=2"]).world_size == 16  # every device of the nodes
    machine = r"^cluster=None: is required with nodes=: name the machine \(cluster=NAME\)$"
    with pytest.raises(ConfigError, match=machine):
        parse_args(["world_size=4", "nodes=2"])
    # Before: 8 ranks on 3 nodes were placed 3, 3, 2; torchrun starts the same number on each.
    with pytest.raises(ConfigError, match=r"^nodes=3: must divide world_size=8 .*allowed: \[1, 2, 4, 8\]$"):
        parse_args(["cluster=h100_ib", "nodes=3", "world_size=8"])


def test_the_ddp_baseline_keeps_precision_and_drops_the_masking():
    overrides = ["model=llama_1b", "masking=forward", "masking.coverage=0.5", "variant=n_sdp_forward",
                 "parallelism=fsdp", "parallelism.fsdp_degree=2", "parallelism.mixed_precision=bf16"]  # fmt: skip
    assert ddp_overrides(overrides) == ["model=llama_1b", "parallelism.mixed_precision=bf16", "masking=none"]


@pytest.mark.parametrize("overrides", [["masking=forward", "masking.coverage=0.5"], ["masking=backward",
                         "masking.coverage=0.5"], ["parallelism=fsdp"], ["masking=none"]])  # fmt: skip
def test_every_traced_collective_is_issued_before_it_is_needed(overrides):
    est = estimate(estimator_config([*TINY, *overrides], 4), world_size=4, rank=0)
    timeline = est.timeline
    assert timeline and all(0 <= (r["issue"] or 0) <= r["need"] <= len(est.ops["launches"]) for r in timeline)
    # The traced payloads are the bytes the rank takes part in; SDP's gradient buckets add up to
    # the counted gradient traffic.
    kinds = est.comm_bytes_per_step_by_kind
    traced = sum(r["bytes"] for r in timeline if r["kind"] in ("grad_sync", "shared_sync"))
    assert traced == kinds["grad_sync"] + kinds["shared_sync"]
    t = step_times(est, load_cluster("h100_nvlink"))
    assert t["exposed_overlapped_s"] <= t["exposed_serial_s"] <= t["comm_s"] + 1e-12


def test_the_estimator_prints_the_step_on_a_cluster(capsys):
    assert main([*TINY, "masking=forward", "masking.coverage=0.5", "world_size=8", "cluster=h100_ib", "nodes=2"]) == 0
    out = capsys.readouterr().out
    assert "step time on h100_ib: 8 ranks on 2 node(s) of 4" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("  DDP ", "  N-SDP forward C=0.5 "))]
    assert len(rows) == 2 and rows[0][-1] == "1.00"


def test_an_outer_loop_spreads_each_windows_syncs_over_its_steps():
    m = machine(inter_node_latency_us=0.0)
    # Two fragments, each one 1 GB all-reduce across 2 nodes (1 s at 1 GB/s); H = 10, P = 2: a
    # fragment's sync every 5 steps. 1 s of compute a step: beside the next 5 steps each sync hides.
    sync = {"op": "all_reduce", "kind": "outer_sync", "bytes": 10**9, "ranks": [3, 4], "issue": 0.0, "need": -1.0}
    est = SimpleNamespace(outer={"sync_every": 10, "fragments": 2}, sync_timelines=[[sync], [sync]])  # its fields read
    times = outer_sync_times(est, m, compute_s=1.0)
    assert times["outer_sync_window_s"] == pytest.approx(2.0)
    assert times["outer_sync_per_step_s"] == pytest.approx(0.2)
    assert times["outer_sync_overlapped_per_step_s"] == 0.0
    # 0.1 s of compute a step: 0.5 s beside each sync leaves 0.5 s of each exposed.
    assert outer_sync_times(est, m, compute_s=0.1)["outer_sync_overlapped_per_step_s"] == pytest.approx(0.1)


def test_diloco_steps_faster_than_ddp_where_the_network_is_slow():
    # The same 16 ranks on 2 nodes, DDP's all-reduce every step against DiLoCo's every 50 steps.
    ddp = estimate(estimator_config(TINY, 16), world_size=16, rank=0)
    diloco = estimate(estimator_config([*TINY, "outer=diloco", "outer.sync_every=50"], 16), world_size=16, rank=0)
    # A window's pseudo-gradients: every parameter once, in fp32, spread over its 50 steps.
    assert diloco.comm_bytes_per_step_by_kind["outer_sync"] * 50 == pytest.approx(4 * diloco.n_params)
    assert diloco.comm_bytes_per_step_by_kind["grad_sync"] == 0
    ratios = {}
    for name in ("h100_nvlink", "h100_eth10g", "h100_eth1g"):
        cluster = load_cluster(name)
        place(cluster, world_size=16, nodes=2)
        ratios[name] = step_times(diloco, cluster)["step_overlapped_s"] / step_times(ddp, cluster)["step_overlapped_s"]
    # The slower the link, the larger DiLoCo's gain (a tiny model: DDP's latency shows on NVLink too).
    assert ratios["h100_eth1g"] < ratios["h100_eth10g"] < ratios["h100_nvlink"] < 1
