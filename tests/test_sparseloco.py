"""SparseLoCo (outer=sparseloco, sdp/outer/sparseloco.py): its payload byte for byte, its anchors
against DiLoCo, an error feedback that keeps exactly what was not sent, its state on a resume (on
the same world size bitwise, after a SIGKILL mid-window; on another, the holders' mean), its bytes
equal in the summary, the estimator and the planner, and a refusal for every knob. The multi-rank
checks run on forked ranks (tests/outer_harness.py); the asserts are here."""

import math

import pytest
import torch
from conftest import launch, read_run
from test_outer import LLAMA, _harness

from sdp.errors import ConfigError
from sdp.outer.sparseloco import Layout, compress, decode

CFG = {"density": 0.05, "value_bits": 2, "error_decay": 0.9, "chunk_size": 64}


def payload_bytes(numel: int, *, density: float, value_bits: int, chunk_size: int, **_) -> int:
    """A bucket's payload, from the format's description (sdp/outer/sparseloco.py's docstring)."""
    chunk = min(chunk_size, numel)
    chunks, k = -(-numel // chunk), math.ceil(density * chunk)
    pad = lambda n: -(-n // 4) * 4  # noqa: E731
    index = pad(chunks * k * (2 if chunk <= 32768 else 4))
    values = pad(-(-chunks * k * value_bits // 8))
    return index + values + (4 * chunks if value_bits < 32 else 0)


@pytest.mark.parametrize("bits", [2, 8, 32])
@pytest.mark.parametrize("numel,chunk,k", [(1000, 64, 4), (1000, 64, 64), (70000, 40000, 3)])
def test_the_payload_decodes_to_what_was_sent_and_the_rest_is_kept(bits, numel, chunk, k):
    layout = Layout(numel, chunk, k, bits)
    e = torch.zeros(layout.chunks * chunk)
    e[:numel] = torch.randn(numel, generator=torch.Generator().manual_seed(bits))
    acc = e.clone()
    payload = compress(layout, e)
    assert payload.dtype == torch.uint8 and payload.numel() == layout.payload
    assert layout.payload == payload_bytes(numel, density=k / chunk, value_bits=bits, chunk_size=chunk)
    index, values = decode(layout, payload)
    sent = torch.zeros(layout.chunks, chunk).scatter_(1, index, values).view(-1)[:numel]
    kept, acc = e[:numel], acc[:numel]
    # Each chunk sends its k largest magnitudes; the error feedback keeps exactly acc - sent.
    assert ((sent != 0).view(-1).sum() <= layout.chunks * k) and torch.equal(kept, acc - sent)
    top = acc.abs().max()
    assert sent.abs().max() == pytest.approx(top.item(), rel=1e-6)  # the largest is sent (an end of its grid)
    if bits == 32:
        assert torch.equal(sent + kept, acc)  # bit for bit
    else:  # within the rounding of acc - sent
        assert ((sent.double() + kept.double() - acc.double()).abs() <= 2**-24 * kept.double().abs()).all()
    assert not e[numel:].any()  # the padding keeps no error


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _harness("sparse_anchor+feedback+ef_resize", 4, tmp_path_factory)


@pytest.mark.dist
def test_at_density_1_and_32_bits_it_is_diloco_lr_1_bitwise_where_pieces_have_2_holders(four):
    for case, r in four["sparse_anchor"].items():
        # Against a reference summing the gathered pseudo-gradients in rank order: bit for bit.
        assert r["reference"] == 0.0, case
        # Against DiLoCo's all-reduce: bit for bit on pieces of 1 or 2 holders, rounding elsewhere.
        assert r["few_holders"] == 0.0, case
        assert r["many_holders_rel"] < 1e-5, case
        assert r["ops"] == {"diloco": ["all_reduce"], "sparseloco": ["all_gather"]}, case  # density 1 too
    assert four["sparse_anchor"]["llama-ddp"]["holder_counts"] == [4]
    assert four["sparse_anchor"]["resnet-forward-neuron"]["holder_counts"] == [1, 2, 4]


@pytest.mark.dist
def test_the_error_feedback_keeps_exactly_what_was_not_sent(four):
    r = four["feedback"]
    assert r["records"] == 2 * len(r["buckets"])  # every bucket of both syncs
    assert r["exact_acc"]  # acc = error_decay * e + Delta, bit for bit
    assert r["exact_kept"]  # kept = acc - sent (fp32)
    assert r["worst"] < 2**-23  # sent + kept = acc within the rounding of that subtraction


@pytest.mark.dist
def test_a_sync_sends_its_payload_and_the_estimator_and_planner_count_the_same_bytes(four):
    from sdp.planning.estimator import estimate
    from sdp.planning.report import _outer_sync
    from sdp.run.config import typed_config

    r = four["feedback"]
    assert all(holders == 4 for _, holders in r["buckets"])
    payload = sum(payload_bytes(numel, **CFG) for numel, _ in r["buckets"])
    assert r["bytes_per_sync"] == payload and r["sent"] == 2 * payload and r["syncs"] == 2
    assert r["wire_bytes_per_sync"] == 3 * payload  # an all-gather among 4 moves 3 times its input
    assert r["error_feedback_bytes"] == 4 * sum(-(-n // 64) * 64 for n, _ in r["buckets"])
    line = ["model=llama_tiny", "dataset=synthetic_text", "parallelism.bucket_cap_mb=1", "outer=sparseloco"]
    line += ["outer.sync_every=2", *[f"outer.{k}={v}" for k, v in CFG.items()]]
    est = estimate(typed_config(line), world_size=4, rank=0)
    assert est.outer["bytes_per_sync"]["outer_sync"] == payload
    assert est.outer["wire_bytes_per_sync"] == 3 * payload
    assert _outer_sync(est) == {"bytes": payload, "wire_bytes": 3 * payload}  # a plan row's


@pytest.mark.dist
def test_a_resume_on_another_world_size_starts_every_holder_from_their_mean(four):
    for case, r in four["ef_resize"].items():
        assert r["scale"] > 0, case  # an error feedback to keep
        assert r["saved"] <= 1e-6 * r["scale"], case  # the checkpoint holds the holders' mean
        assert r["restored"] <= 1e-6 * r["scale"] and r["spread"] == 0.0, case


@pytest.mark.dist
def test_a_sigkill_mid_window_resumes_bitwise(tmp_path):
    from test_faults import with_fault

    common = [*LLAMA, "logger=none", "trainer.max_steps=8", "trainer.log_every=1", "trainer.progress=false"]
    common += ["outer=sparseloco", "outer.sync_every=4", "trainer.checkpoint_every=2", "trainer.eval_every=0"]
    common += [f"outer.{k}={v}" for k, v in CFG.items()]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert launch([*common, f"run_dir={straight}"], cwd=tmp_path).returncode == 0
    # Rank 1 dies right after step 7, in the window 5..8 (the last); the newest checkpoint is step 6's.
    assert with_fault("kill:1:7", [*common, f"run_dir={killed}"], cwd=tmp_path).returncode != 0
    proc = launch([*common, f"run_dir={killed}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (torch.load(d / "model.pt", weights_only=True) for d in (straight, killed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (sa, ra), (sb, rb) = read_run(straight), read_run(killed)
    drop = ("tokens_or_samples_per_s", "step_time_s")
    assert [{k: v for k, v in x.items() if k not in drop} for x in ra] == [
        {k: v for k, v in x.items() if k not in drop} for x in rb
    ]
    assert sb["resumed_from"] == 6 and sa["outer"]["syncs"] == 2 and sb["outer"]["syncs"] == 1
    assert sa["outer"]["bytes_per_sync"] == sb["outer"]["bytes_per_sync"] > 0


BASE = ["model=llama_tiny", "dataset=synthetic_text", "outer=sparseloco"]
REFUSALS = {
    "outer.density=0": "outer.density=0.0: must be in (0, 1]: the share of each chunk sent",
    "outer.density=1.5": "outer.density=1.5: must be in (0, 1]: the share of each chunk sent",
    "outer.value_bits=4": "outer.value_bits=4: allowed: 2, 8 (a scale per chunk), 32 (fp32)",
    "outer.error_decay=1.1": "outer.error_decay=1.1: must be in [0, 1] (0: no error feedback)",
    "outer.chunk_size=0": "outer.chunk_size=0: must be in [1, 1048576] (entries a chunk)",
    "outer.lr=0": "outer.lr=0.0: must be a finite number > 0 (SparseLoCo's: 1)",
    "outer.sync_every=0": "outer.sync_every=0: must be >= 1 (1: a sync after every step)",
    "outer.fragments=3": "outer.fragments=3: must divide outer.sync_every=50: fragment p syncs every H steps, H / P "
    "steps after fragment p - 1",
    "outer.momentum=0.9": "outer.momentum='0.9': no such key; it is a key of outer=diloco (prefix '+' to add a new "
    "one)",
}


@pytest.mark.parametrize("override", REFUSALS)
def test_every_knob_is_refused_in_one_line(override):
    from sdp.run.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config([*BASE, override], world_size=2, offline=True, check_data=False)
    assert str(err.value) == REFUSALS[override]


def test_its_rows_name_their_density_and_bits():
    from sdp.analysis.tables import variant_label
    from sdp.rundir import Summary

    head = dict(status="completed", model="m", dataset="d", world_size=4, coverage=1.0, protocol="same_iteration",
                device="cpu", seed=0, activation_checkpointing="none", mixed_precision="fp32", masking="none",
                parallelism="ddp")  # fmt: skip
    outer = {"name": "sparseloco", "sync_every": 10, "fragments": 1, "density": 0.01, "value_bits": 2}
    assert variant_label(Summary.from_json({**head, "outer": outer})) == "DDP + SparseLoCo(H=10, 1%, 2-bit)"
    diloco = {"name": "diloco", "sync_every": 10, "fragments": 1, "lr": 0.7, "momentum": 0.9}
    assert variant_label(Summary.from_json({**head, "outer": diloco})) == "DDP + DiLoCo(H=10)"
