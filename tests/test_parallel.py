"""FSDP2, activation checkpointing and bf16: equal numbers, real savings, clear errors."""

import pytest
import torch
from conftest import BF16_GRAD_REL, BF16_LOSS_REL, estimator_config, launch, load_model_pt, read_run, run_harness

from sdp.errors import ConfigError
from sdp.models import build_model
from sdp.parallel.checkpointing import apply_activation_checkpointing
from sdp.planning.estimator import estimate
from sdp.planning.ranks import planned_groups

FAMILIES = ("llama", "resnet", "swin")
TINY = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=16"]


@pytest.fixture(scope="module")
def harness_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("stacking")


@pytest.fixture(scope="module")
def stacking(harness_dir):
    return run_harness("stacking", 2, harness_dir / "stacking.json")


@pytest.fixture(scope="module")
def sharded(harness_dir, stacking):  # stacking wrote the plain-SDP reference parameters
    return run_harness("sharded", 4, harness_dir / "sharded.json")


@pytest.mark.dist
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_matches_ddp_and_holds_one_shard(stacking, family):
    res = stacking[family]  # K = 2, 3 AdamW steps, fp32
    assert res["fsdp_rel"] <= 1e-6
    for measured, predicted in res["fsdp_bytes"]:  # each rank: its padded dim-0 shard, not the model
        assert measured == predicted
    sent, padded_full = res["fsdp_reduce_scatter_per_step"]
    assert sent == padded_full  # counted at FSDP's own reduce-scatter
    assert res["fsdp_all_gather_per_step"] > 0


@pytest.mark.dist
@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_changes_no_numbers(stacking, family):
    res = stacking[family]
    assert res["ddp_ac_full"] == res["ddp_ac_selective"] == 0.0
    assert res["backward_ac_full"] == res["forward_ac_full"] == 0.0  # SDP at C = 0.5, K = 2


@pytest.mark.dist
@pytest.mark.parametrize("granularity", ["neuron", "block", "neuron-resample", "neuron-capacity"])
@pytest.mark.parametrize("family", ["llama", "swin"])
def test_sdp_x_fsdp_matches_sdp(harness_dir, sharded, family, granularity):
    # 2 SDP workers x 2 FSDP shards against plain SDP with 2 workers, each fed its two ranks'
    # batches: forward masking at C = 0.5, 3 SGD steps (with momentum; "neuron-resample" draws
    # a new mask after step 2, so weights and momentum move to new holders and shards).
    reference = torch.load(harness_dir / f"stacking.json.{family}.{granularity}.sdp.pt", weights_only=True)
    ours = torch.load(harness_dir / f"sharded.json.{family}.{granularity}.sharded.pt", weights_only=True)
    assert ours.keys() == reference.keys()
    scale = max(t.abs().max().item() for t in reference.values())
    assert max((ours[k] - reference[k]).abs().max().item() for k in ours) <= 1e-6 * scale


@pytest.mark.dist
@pytest.mark.parametrize("granularity", ["neuron", "block", "neuron-resample", "neuron-capacity"])
@pytest.mark.parametrize("family", ["llama", "swin"])
def test_sdp_x_fsdp_overlapped_averaging_equals_serial(sharded, family, granularity):
    # FSDP2 runs the post-accumulate-grad hooks on its gradient shards after its reduce-scatter:
    # the overlapped holder-set all-reduces of those shards give the serial path's bits.
    assert sharded[family][granularity]["overlap_vs_serial"] == 0.0


@pytest.mark.dist
@pytest.mark.parametrize("granularity", ["neuron", "block", "neuron-resample", "neuron-capacity"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sdp_x_fsdp_holds_c_over_f(sharded, family, granularity):
    res = sharded[family][granularity]
    per_rank = res["bytes"]  # each rank: its worker's units and the shared tensors, / F where shardable
    assert len(per_rank) == 4
    for measured, predicted in per_rank:
        assert measured == predicted
    # Neuron level: 1-D biases / BatchNorm weights of Swin and ResNet are replicated, LLaMA has none.
    assert (res["replicated"] > 0) == (granularity.startswith("neuron") and family != "llama")


def test_activation_checkpointing_saves_activation_memory():
    # Deep enough, long sequences and a small vocabulary: the activations and their
    # recomputation, not the logits, set the peak.
    overrides = [
        *TINY,
        "model.num_layers=8",
        "model.vocab_size=256",
        "dataset.vocab_size=256",
        "dataset.seq_len=512",
    ]
    mem = {
        mode: estimate(
            estimator_config([*overrides, f"parallelism.activation_checkpointing={mode}"]), world_size=2, rank=0
        ).memory
        for mode in ("none", "selective", "full")
    }
    acts = {mode: m["peak_breakdown"]["activations"] for mode, m in mem.items()}
    assert acts["full"] < acts["selective"] < acts["none"]
    # The whole peak falls too: recomputed tensors are freed block by block in the backward.
    assert mem["full"]["peak_bytes"] < mem["selective"]["peak_bytes"] < mem["none"]["peak_bytes"]


@pytest.mark.parametrize("family,blocks", [("llama", 4), ("resnet", 4), ("swin", 4)])
def test_checkpointing_wraps_every_block_and_keeps_names(family, blocks):
    from conftest import tiny_model_cfg

    model = build_model(tiny_model_cfg(family))
    names = [n for n, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model, family=family, mode="full") == blocks
    assert [n for n, _ in model.named_parameters()] == names  # state dicts load into the plain model


@pytest.mark.dist
def test_fsdp_bf16_with_selective_checkpointing_changes_no_numbers(stacking):
    # FSDP2 re-casts a block's inputs under a profiler range when the backward recomputes it
    # (torch >= 2.13); selective checkpointing stopped there: "profiler._record_function_enter_new
    # .default encountered during backward but not found in storage", in sdp.train and sdp.estimate.
    assert stacking["llama"]["fsdp_bf16_ac_selective"] == 0.0


def test_the_estimator_traces_fsdp_bf16_with_selective_checkpointing():
    cfg = estimator_config(
        [
            *TINY,
            "parallelism=fsdp",
            "parallelism.mixed_precision=bf16",
            "parallelism.activation_checkpointing=selective",
        ]
    )
    assert estimate(cfg, world_size=2, rank=0).memory["peak_bytes"] > 0


@pytest.mark.dist
def test_fsdp_bf16_checkpointed_run_through_the_entrypoint(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        "logger=none",
        "parallelism=fsdp",
        "parallelism.mixed_precision=bf16",
        "parallelism.activation_checkpointing=full",
        "trainer.max_steps=4",
        "trainer.grad_accum_steps=2",
        "dataset.eval_batches=1",
        f"run_dir={run_dir}",
    ]
    proc = launch(overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, _ = read_run(run_dir)
    assert summary["status"] == "completed" and summary["parallelism"] == "fsdp"
    n = summary["n_params"]
    assert summary["memory"]["params_bytes"] < 4 * n * 0.51  # a shard of the fp32 master weights
    kinds = summary["comm_bytes_per_step_by_kind"]
    assert kinds["grad_reduce_scatter"] >= 4 * n and kinds["param_all_gather"] > 0 and kinds["grad_sync"] == 0
    load_model_pt(run_dir, TINY)


@pytest.mark.dist
def test_sdp_x_fsdp_run_through_the_entrypoint(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        "logger=none",
        "parallelism=fsdp",
        "parallelism.fsdp_degree=2",
        "parallelism.activation_checkpointing=full",
        "masking=forward",
        "masking.coverage=0.5",
        "masking.resample_every=2",
        "trainer.max_steps=3",
        "dataset.eval_batches=1",
        f"run_dir={run_dir}",
    ]
    proc = launch(overrides, nproc=4, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, _ = read_run(run_dir)
    assert summary["status"] == "completed" and summary["fsdp_degree"] == 2 and summary["sdp_workers"] == 2
    # C = 0.5 of the neurons, then halved again by FSDP: well under half of the model's bytes.
    assert summary["memory"]["params_bytes"] < 4 * summary["n_params"] / 2
    kinds = summary["comm_bytes_per_step_by_kind"]
    assert kinds["grad_reduce_scatter"] > 0 and kinds["resample"] > 0  # a new mask after step 2
    load_model_pt(run_dir, TINY)
    # The memory table's SDP x FSDP rows come from the estimator: it predicts every rank's
    # static bytes exactly (both masks give every worker equal shares here).
    cfg = estimator_config(overrides, world_size=4)
    # The world and the mesh's two groups; the holder set of both workers at shard f is the
    # mesh's sdp-dimension group (at C = 0.5 of 2 workers every other set is one worker).
    assert summary["comm_groups_per_rank"] == max(planned_groups(cfg, world_size=4)) == 3
    # The real peak is at the root FSDP unit's reduce-scatter, where gloo (CPU) makes a copy of
    # its input, the unsharded gradient of the tensors outside the blocks (embeddings, head,
    # final norm); the estimator's fake process group, like NCCL, makes none.
    with torch.device("meta"):
        plain = build_model(cfg.model)
    gloo_copy = 4 * sum(p.numel() for n, p in plain.named_parameters() if not n.startswith("model.layers."))
    for rank, measured in enumerate(summary["memory_per_rank"]):
        est = estimate(cfg, world_size=4, rank=rank).memory
        for key in ("params_bytes", "grads_bytes", "optim_bytes"):
            assert est[key] == measured[key], (rank, key)
        assert est["peak_bytes"] <= measured["peak_bytes"] <= est["peak_bytes"] + 1.01 * gloo_copy


@pytest.mark.parametrize("family", FAMILIES)
def test_neuron_sdp_x_fsdp_bf16_traces_and_halves_the_static_bytes(family):
    # Under the estimator (fake process group, 4 ranks): each rank of 2 workers x F = 2 stores
    # about half of what a plain SDP rank of 2 workers does. Swin's and ResNet's neuron biases
    # and BatchNorm weights are replicated and stay fp32 next to FSDP's bf16 weights (autocast).
    from conftest import TINY_MODELS

    model, dataset = TINY_MODELS[family]
    base = [f"model={model}", f"dataset={dataset}", "trainer.global_batch_size=8", "masking=forward"]
    base += ["masking.coverage=0.5", "parallelism.mixed_precision=bf16"]
    plain = estimate(estimator_config(base, world_size=2), world_size=2, rank=0).memory
    cfg = estimator_config([*base, "parallelism=fsdp", "parallelism.fsdp_degree=2"], world_size=4)
    sharded = estimate(cfg, world_size=4, rank=0)
    assert sharded.flops_per_step > 0
    ratio = sharded.memory["params_bytes"] / plain["params_bytes"]
    assert 0.45 <= ratio <= 0.6, ratio


@pytest.mark.parametrize(
    "overrides,key,fragment",
    [
        (["parallelism=fsdp", "masking=backward", "masking.coverage=0.5"], "parallelism", "needs masking=forward"),
        (["parallelism=fsdp", "parallelism.fsdp_degree=0", "masking=forward"], "parallelism.fsdp_degree", ">= 1"),
        (
            ["parallelism=fsdp", "parallelism.fsdp_degree=3", "masking=forward", "masking.granularity=block"],
            "parallelism.fsdp_degree",
            "must divide the world size 2",
        ),
        (["parallelism.activation_checkpointing=some"], "parallelism.activation_checkpointing", "none, full"),
        (["parallelism.mixed_precision=fp16"], "parallelism.mixed_precision", "allowed: fp32, bf16"),
        (["parallelism.compile_backend=cudagraphs"], "parallelism.compile_backend", "allowed: inductor, aot_eager"),
        (["parallelism.max_comm_groups=0"], "parallelism.max_comm_groups", "must be in [1, 4096]"),
        (["parallelism.comm_group_overhead_mb=-1"], "parallelism.comm_group_overhead_mb", "must be >= 0"),
    ],
)
def test_bad_parallelism_is_one_clear_error(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        estimator_config([*TINY, *overrides])
    assert str(info.value).startswith(key) and fragment in str(info.value)


@pytest.mark.dist
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_chunked_loss_equals_full_under_fsdp(stacking, dtype):
    # K = 2, one step, 24 of each rank's 64 tokens a chunk: the root's LM head runs once per chunk
    # in the forward and again in the backward, on its gathered weight (bf16 under bf16's policy).
    # bf16: its resolution, whatever the CPU's kernels (tests/conftest.py).
    res = stacking["llama"]["fsdp_loss"][dtype]
    assert res["tensors"] > 1
    loss_tol, grad_tol = (1e-5, 1e-5) if dtype == "fp32" else (BF16_LOSS_REL, BF16_GRAD_REL)
    assert res["loss_rel"] <= loss_tol and res["grad_rel"] <= grad_tol and res["head_grad_rel"] <= grad_tol


@pytest.mark.dist
@pytest.mark.parametrize("granularity", ["neuron", "block", "neuron-resample", "neuron-capacity"])
def test_chunked_loss_equals_full_under_sdp_x_fsdp(sharded, granularity):
    res = sharded["llama"][granularity]["loss"]  # 2 workers x 2 shards, fp32, one step
    assert res["tensors"] > 1
    assert res["loss_rel"] <= 1e-5 and res["grad_rel"] <= 1e-5 and res["head_grad_rel"] <= 1e-5


@pytest.mark.dist
def test_compiled_blocks_equal_eager_under_sdp_x_fsdp(sharded):
    res = sharded["llama"]["neuron"]["compile"]  # 2 workers x 2 shards, fp32, dynamo + AOTAutograd
    assert res["tensors"] > 1
    assert res["loss_rel"] <= 1e-6 and res["grad_rel"] <= 1e-5
