"""The planner's search: structures composed as the entrypoint composes them, grouped in families."""

import pytest
from conftest import estimator_config

from sdp.errors import ConfigError
from sdp.planning.estimator import estimate
from sdp.planning.fit import GIB, fit, fit_peak
from sdp.planning.report import ranked, row
from sdp.planning.rows import Row, RunFacts
from sdp.planning.search import Composer, families, search, verify
from sdp.planning.space import Structure, outer_free, structures
from sdp.planning.step_time import load_cluster, place
from sdp.planning.traces import TraceCache

TINY = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=64", "trainer.global_batch_size=16"]


@pytest.mark.slow  # end to end; make test runs it, make test-fast leaves it (docs/testing.md)
def test_a_composed_copy_is_the_config_the_entrypoint_loads():
    # Every structure kind on mixed GPUs (capacities, SDP x FSDP, block and neuron, both modes),
    # as a copy of one composed base per (masking, parallelism), against load_config of its
    # overrides: equal configs, or the same one-line refusal.
    overrides = [*TINY, "trainer.protocol=flop_matched", "trainer.max_steps=40", "optim.warmup_steps=8"]
    space = structures([80.0, 80.0, 24.0, 24.0], min_coverage=0.25, granularities=("neuron", "block"))
    compose, checked, refused = Composer(overrides, world=4), 0, 0
    sample = [s for s in space if (s.precision, s.checkpointing) in (("fp32", "none"), ("bf16", "full"))]
    for s in sample:  # every kind of structure (SDP x FSDP in bf16), with and without checkpointing
        try:
            expected = estimator_config([*overrides, *s.overrides()], 4)
        except ConfigError as err:
            with pytest.raises(ConfigError) as info:
                compose(s)
            assert str(info.value) == str(err)
            refused += 1
            continue
        got = compose(s)
        assert got == expected, s.label
        assert got.record == expected.record, s.label  # what config.yaml and W&B would show
        checked += 1
    assert (checked, refused) == (40, 14)
    # The protocol scales the steps from the budget, once (SDP at C = 0.5: twice DDP's steps).
    sdp, ddp = compose(Structure(masking="forward", coverage=0.5)), compose(Structure())
    assert (sdp.trainer.max_steps, sdp.optim.warmup_steps, ddp.trainer.max_steps) == (80, 16, 40)
    forward = Structure(masking="forward", coverage=0.5)
    plain = Composer([*TINY, "trainer.max_steps=40"], world=4)(forward)  # same_iteration: the budget itself
    assert plain == estimator_config([*TINY, "trainer.max_steps=40", *forward.overrides()], 4)


@pytest.mark.slow  # end to end; make test runs it, make test-fast leaves it (docs/testing.md)
def test_a_family_searched_from_the_least_memory_up_chooses_what_each_structure_alone_would(tmp_path):
    # 4 x 50 MiB, 16 sequences a rank: micro-batches 2 to 8 fit, by structure. A miss of a
    # structure that holds no more (lower coverage, more checkpointing) rules a micro-batch out
    # without a trace; each choice is still the one an independent search makes, trace for trace.
    overrides = [*TINY, "trainer.global_batch_size=64", "parallelism.comm_group_overhead_mb=1"]
    devices = [0.05] * 4
    space = [
        s
        for s in structures(devices, min_coverage=0.25, granularities=("neuron",), precisions=("fp32",))
        if s.masking == "backward" and s.checkpointing != "selective"
    ]
    compose, traces = Composer(overrides, world=4), TraceCache(tmp_path)
    outcomes = search(space, compose=compose, devices=devices, cluster=None, workers=1, traces=traces)
    alone = [fit(compose(o.structure), devices=devices, trace=traces) for o in outcomes]
    for o, f in zip(outcomes, alone, strict=True):
        assert (o.found.micro, o.found.accum, o.found.peaks) == (f.micro, f.accum, f.peaks), o.structure.label
    assert {o.found.micro for o in outcomes} == {2, 4, 8}
    # In order: C=0.25 + AC and C=0.25 search alone (3 probes each); the rest start below a
    # micro-batch a smaller structure missed at, and one trace at the next smaller settles three.
    assert [o.found.probes for o in outcomes] == [2, 1, 3, 1, 2, 3]  # C=0.75, 0.5, 0.25; then + AC
    assert sum(o.found.probes for o in outcomes) == 12 < sum(f.probes for f in alone)


def test_families_share_all_but_coverage_and_checkpointing():
    space = structures([80.0] * 4, min_coverage=0.25, granularities=("neuron",), every=False)
    groups = families(space)
    # fp32: DDP, FSDP, 2 modes; bf16 adds SDP x FSDP(2)
    assert sum(map(len, groups)) == len(space) and len(groups) == 4 + 5
    forward = next(g for g in groups if (g[0].masking, g[0].fsdp_degree, g[0].precision) == ("forward", 1, "fp32"))
    assert [s.label for s in forward[:4]] == [  # from the least memory up
        "N-SDP forward C=0.25 + AC",
        "N-SDP forward C=0.25 + AC(sel)",
        "N-SDP forward C=0.25",
        "N-SDP forward C=0.5 + AC",
    ]
    assert len(groups[0]) >= len(groups[-1])  # the longest tasks first


def test_verify_puts_whole_traces_in_place_of_the_lines_peaks():
    # 8 samples a rank at micro-batch 2: 4 accumulation steps, traced whole as 2 (the same peak).
    cfg = estimator_config([*TINY, "model.num_layers=6", "trainer.grad_accum_steps=4"], 2)
    method = "layers 3 and 4, extended to 6"
    row = Row(Structure(), 0.0, fits=True, micro_batch=2, peaks_bytes={0: 1}, devices_gib={0: 80.0}, method=method)
    whole = estimate(cfg, world_size=2, rank=0).memory["peak_with_comm_groups_bytes"]
    out = verify(row, cfg, devices=[80.0, 80.0])
    assert out.peaks_bytes == {0: whole} and out.line_peaks_bytes == {0: 1} and out.fits
    assert out.method == "traced whole (verified)"
    tight = verify(row, cfg, devices=[whole / GIB / 1.01] * 2)  # 1% too small
    assert not tight.fits and tight.headroom == pytest.approx(-0.01, abs=1e-4)
    assert tight.devices_gib == {0: whole / GIB / 1.01}


def test_an_outer_loops_copies_are_the_configs_the_entrypoint_loads():
    # The user's outer loop (here 2 fragments) on the outer rows, none on the plain ones; an H the
    # fragments do not divide is refused as sdp.train refuses it.
    overrides = [*TINY, "outer=diloco", "outer.lr=0.5", "outer.fragments=2"]
    compose = Composer(overrides, world=4)
    space = [Structure(), Structure(sync_every=1), Structure(sync_every=10)]
    space += [Structure(masking="backward", coverage=0.5, sync_every=10), Structure(parallelism="fsdp")]
    for s in space:
        own = overrides if s.sync_every is not None else outer_free(overrides)
        try:
            expected = estimator_config([*own, *s.overrides()], 4)
        except ConfigError as err:
            with pytest.raises(ConfigError) as info:
                compose(s)
            assert str(info.value) == str(err) and s.sync_every == 1
            assert str(err).startswith("outer.fragments=2: must divide outer.sync_every=1")
            continue
        got = compose(s)
        assert got == expected and got.record == expected.record, s.label
        assert got.outer.name == ("none" if s.sync_every is None else "diloco")


@pytest.fixture(scope="module")
def slow_and_fast():
    """DDP without and with an outer loop (H = 10, 100) searched on one NVLink node of 8 and on
    2 nodes of 8 over 1 Gb/s: each outer loop fitted once, its other H derived."""
    space = [Structure(), Structure(sync_every=10), Structure(sync_every=100)]
    out = {}
    for name, world in (("h100_nvlink", 8), ("h100_eth1g", 16)):
        cluster = load_cluster(name)
        place(cluster, world_size=world, nodes=world // 8)
        # 4096 tokens a rank: the step's compute, not the links' latency, is most of it on NVLink.
        batch = ["dataset.seq_len=256", f"trainer.global_batch_size={16 * world}"]
        compose = Composer([*TINY, *batch, "outer=diloco"], world=world)
        outcomes = search(space, compose=compose, devices=[80.0] * world, cluster=cluster, workers=1)
        out[name] = (outcomes, compose, cluster)
    return out


def test_an_outer_loop_at_another_h_is_derived_from_one_fit(slow_and_fast):
    outcomes, compose, cluster = slow_and_fast["h100_eth1g"]
    plain, h10, h100 = outcomes
    assert h100.lead == h10.structure and h100.found.probes == 0 and h10.lead is None
    direct = fit(compose(h100.structure), devices=[80.0] * 16, cluster=cluster)  # fitted as a lead would be
    got = h100.found
    assert (got.micro, got.accum, got.peaks) == (direct.micro, direct.accum, direct.peaks)
    for key in ("step_overlapped_s", "step_serial_s", "outer_sync_per_step_s", "outer_sync_window_s"):
        assert got.step[key] == pytest.approx(direct.step[key], rel=1e-12), key
    (rank,) = got.estimates
    a, b = got.estimates[rank], direct.estimates[rank]
    assert a.comm_bytes_per_step == pytest.approx(b.comm_bytes_per_step, rel=1e-12)
    assert a.outer == b.outer and a.outer["sync_every"] == 100
    # A window's bytes over its H steps: H = 100 sends a tenth of H = 10's per step.
    assert h10.found.estimates[rank].comm_bytes_per_step == pytest.approx(10 * a.comm_bytes_per_step)
    assert got.peaks[rank] == fit_peak(b.memory)
    # A GPU must hold the step's peak or a sync's (every pseudo-gradient and its buckets alive),
    # whichever is higher, with the communicators.
    sync = {"peak_bytes": 10, "sync_peak_bytes": 30, "peak_with_comm_groups_bytes": 15}
    assert fit_peak(sync) == 35 and fit_peak({**sync, "sync_peak_bytes": 3}) == 15


def test_on_a_slow_link_the_top_row_communicates_less_and_on_nvlink_the_usual_one(slow_and_fast):
    tops = {}
    for name, (outcomes, _, _) in slow_and_fast.items():
        facts = RunFacts(TINY, world=16, protocol="same_iteration", unit="tokens", per_step=1)
        rows = [row(o, run=facts, cluster_nodes=1) for o in outcomes]
        tops[name] = [r.run for r in ranked(rows, objective="speed")]
        sent = {r.run: r.comm_bytes_per_step for r in rows}
        # Each row states its bytes per step: a sync sends what a DDP step does, once a window.
        assert sent["DDP"] == 10 * sent["DDP + DiLoCo(H=10)"] > 0  # H = 10: fitted
        assert sent["DDP + DiLoCo(H=100)"] == pytest.approx(sent["DDP"] / 100, rel=1e-12)  # derived
    assert tops["h100_nvlink"][0] == "DDP"
    assert tops["h100_eth1g"] == ["DDP + DiLoCo(H=100)", "DDP + DiLoCo(H=10)", "DDP"]


def _row(step: float, sync_every: int | None) -> Row:
    """A DDP row that fits, half its 80 GiB GPU free, with an outer loop's H (None: none)."""
    s = Structure(sync_every=sync_every)
    return Row(s, 0.0, fits=True, peaks_bytes={0: 40 * 2**30}, devices_gib={0: 80.0}, step_s=step)


def _names(rows: list[Row]) -> list[str]:
    return [f"H={r.sync_every}" if r.sync_every else "plain" for r in rows]


@pytest.mark.parametrize(
    "steps,order",
    [
        ((1.00, 0.97, 0.95), ["plain", "H=10", "H=100"]),  # within 10%: fewer local steps first
        ((1.00, 0.85, 0.80), ["H=10", "H=100", "plain"]),  # H=10 saves 15%; H=100 not 10% more
        ((3.00, 1.30, 1.05), ["H=100", "H=10", "plain"]),
    ],
)
def test_more_local_steps_rank_first_only_where_they_save_a_tenth_of_the_step(steps, order):
    rows = [_row(step, h) for step, h in zip(steps, (None, 10, 100), strict=True)]
    assert _names(ranked(rows, objective="speed")) == order
    same = [_row(1.0, 10), _row(1.0, None)]
    assert _names(ranked(same, objective="memory")) == ["plain", "H=10"]
