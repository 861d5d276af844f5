"""sdp.plan's inputs and search space: the devices, the structures weighed, their commands."""

import shlex

import pytest

from sdp.errors import ConfigError
from sdp.planning.space import Structure, capacity_lists, command, coverages, parse_devices, structures
from sdp.run.config import load_config

FORMS = "must be NxGIB (8x80), a list of GiB per GPU ([80,80,24,24]), or parts joined by + (4x80+4x24)"


@pytest.mark.parametrize(
    "text,gib",
    [
        ("8x80", [80.0] * 8),
        ("[80,80,24,24]", [80, 80, 24, 24]),
        ("4x80+4x24", [80.0] * 4 + [24.0] * 4),
        ("1x40.5", [40.5]),
        ("4x80GiB+4x24gib", [80.0] * 4 + [24.0] * 4),  # the unit may be written, as GiB
        ("[80GiB,24]", [80.0, 24.0]),
    ],
)
def test_devices_are_gib_per_gpu_in_rank_order(text, gib):
    assert parse_devices(text) == gib


@pytest.mark.parametrize(
    "text,message",
    [
        ("8x", f"devices='8x': {FORMS}, at most 65536 GPUs"),
        ("[80,,80]", f"devices='[80,,80]': {FORMS}, at most 65536 GPUs"),
        ("0x80", "devices='0x80': has 0x80: no GPU; each part needs at least one device (1x80)"),
        ("4x80+0x24", "devices='4x80+0x24': has 0x24: no GPU; each part needs at least one device (1x80)"),
        ("[80,big]", f"devices='[80,big]': {FORMS}; 'big' is not a number of GiB"),
        ("[80,nan]", "devices='[80,nan]': has nan GiB: each GPU's memory must be a number in (0, 1e6]"),
        ("2x0", "devices='2x0': has 0 GiB: each GPU's memory must be a number in (0, 1e6]"),
        (
            "8x80GB",
            "devices='8x80GB': has 80GB: sizes are GiB (2**30 bytes): give 80 or 80GiB (a card sold as 80 GB "
            "holds about 80 GiB: nvidia-smi's MiB / 1024)",
        ),
        (
            "[80,24G]",
            "devices='[80,24G]': has 24G: sizes are GiB (2**30 bytes): give 24 or 24GiB (a card sold as 24 GB "
            "holds about 24 GiB: nvidia-smi's MiB / 1024)",
        ),
    ],
)
def test_an_unknown_device_string_is_one_line(text, message):
    with pytest.raises(ConfigError) as info:
        parse_devices(text)
    assert str(info.value) == message


def test_the_search_space_of_eight_equal_gpus():
    space = structures([80.0] * 8, min_coverage=0.25, granularities=("neuron", "block"))
    labels = [s.label for s in space]
    # per checkpointing: 34 structures in bf16, 26 in fp32 (SDP x FSDP in bf16 alone: the paper's stack)
    assert len(labels) == len(set(labels)) == 3 * 34 + 3 * 26
    assert coverages(8, min_coverage=0.25) == [0.875, 0.75, 0.625, 0.5, 0.375, 0.25]
    assert {"DDP", "FSDP", "N-SDP forward C=0.25 + AC + bf16", "B-SDP backward C=0.875 + AC(sel)"} <= set(labels)
    # FSDP inside each SDP worker: F = 2 (K = 4 workers) and F = 4 (K = 2).
    assert {s.fsdp_degree for s in space} == {1, 2, 4}
    assert "N-SDP forward C=0.25 x FSDP(2) + bf16" in labels and "N-SDP forward C=0.5 x FSDP(4) + AC + bf16" in labels
    assert not any("FSDP(" in label and "bf16" not in label for label in labels)
    fp32 = structures([80.0] * 8, min_coverage=0.25, granularities=("neuron",), precisions=("fp32",))
    assert "N-SDP forward C=0.25 x FSDP(2)" in {s.label for s in fp32}  # unless bf16 is not searched
    assert all(s.capacity is None for s in space)


def test_mixed_gpus_add_capacities_in_quarters_proportional_to_memory():
    devices = parse_devices("[80,80,24,24]")
    assert capacity_lists(devices, min_coverage=0.25) == [
        (1, 1, 0.25, 0.25),
        (0.75, 0.75, 0.25, 0.25),
        (0.5, 0.5, 0.25, 0.25),
    ]
    # The floor is the run's coverage, the capacities' mean (0.625, 0.5, 0.375 above).
    assert capacity_lists(devices, min_coverage=0.5) == [(1, 1, 0.25, 0.25), (0.75, 0.75, 0.25, 0.25)]
    space = structures(devices, min_coverage=0.25, granularities=("neuron",))
    assert "N-SDP forward capacity [1,1,0.25,0.25] + bf16" in {s.label for s in space}
    # SDP x FSDP only over shard groups of equal cards: (80, 80) and (24, 24), never (80, 24).
    assert {s.fsdp_degree for s in space} == {1, 2}
    assert {s.fsdp_degree for s in structures([80.0, 24.0] * 2, min_coverage=0.25, granularities=("neuron",))} == {1}


def test_a_command_is_the_overrides_as_the_shell_gives_them_back():
    structure = Structure(masking="forward", capacity=(1.0, 1.0, 0.5, 0.5), checkpointing="full", precision="bf16")
    line = command(["model=llama_tiny", "dataset=synthetic_text"], structure, nproc=4, accum=2)
    assert line == (
        "python -m sdp.train --nproc-per-node=4 model=llama_tiny dataset=synthetic_text masking=forward "
        "masking.granularity=neuron 'masking.capacity=[1,1,0.5,0.5]' parallelism=ddp "
        "parallelism.activation_checkpointing=full parallelism.mixed_precision=bf16 trainer.grad_accum_steps=2"
    )
    args = shlex.split(line)[3:]
    assert args[0] == "--nproc-per-node=4" and "masking.capacity=[1,1,0.5,0.5]" in args
    two_nodes = command([], Structure(), nproc=8, accum=1, nnodes=2)
    assert two_nodes.startswith(
        "python -m sdp.train --nproc-per-node=4 --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29500 "
        "masking=none "
    )


def test_every_structure_is_a_config_the_entrypoint_checks():
    # Each structure's overrides compose and are checked as sdp.train checks them: accepted, or
    # refused in one line (the planner counts those); the tiny LLaMA's 2 heads refuse C = 0.25.
    base = ["model=llama_tiny", "dataset=synthetic_text", "trainer.global_batch_size=16"]
    space = structures(
        [80.0, 80.0, 24.0, 24.0], min_coverage=0.25, granularities=("neuron", "block"), checkpointing=("none",)
    )
    accepted, refused = 0, {}
    for s in [s for s in space if s.precision == "bf16"]:  # every kind of structure
        try:
            cfg = load_config([*base, *s.overrides()], world_size=4, offline=True, check_data=False)
        except ConfigError as err:
            refused[s.label] = str(err)
            continue
        accepted += 1
        assert cfg.masking.name == s.masking and cfg.parallelism.fsdp_degree == s.fsdp_degree
    assert accepted == 21 and len(refused) == 7
    assert refused["N-SDP forward C=0.25 + bf16"].startswith("masking.coverage=0.25: leaves worker 1 of 4 no unit of")
    # A quarter of 2 heads is half a head: every neuron-level capacity list with a 0.25 is refused.
    capacities = [label for label in refused if "capacity" in label]
    assert len(capacities) == 6 and all(label.startswith("N-SDP") for label in capacities)
    assert all("less than one" in refused[label] for label in capacities)


def test_an_outer_loop_is_weighed_at_each_h_beside_each_ddp_and_sdp_structure():
    space = structures(
        [80.0] * 4,
        min_coverage=0.5,
        granularities=("neuron",),
        precisions=("fp32",),
        checkpointing=("none",),
        sync_every=(10, 50),
    )
    local = [" + DiLoCo(H=10)", " + DiLoCo(H=50)"]
    sdp = [f"N-SDP {mode} C={c}" for mode in ("backward", "forward") for c in ("0.75", "0.5")]
    expected = ["DDP", *("DDP" + h for h in local), "FSDP"]  # FSDP refuses an outer loop: never weighed with one
    expected += [label + h for label in sdp for h in ("", *local)] + ["N-SDP forward C=0.5 x FSDP(2)"]
    assert [s.label for s in space] == expected


def test_an_outer_rows_command_keeps_the_users_outer_loop_and_a_plain_rows_drops_it():
    base = ["model=llama_tiny", "dataset=synthetic_text", "outer=diloco", "outer.lr=0.5", "trainer.max_steps=40"]
    outer = command(base, Structure(masking="forward", coverage=0.5, sync_every=10), nproc=4, accum=1)
    assert outer == (
        "python -m sdp.train --nproc-per-node=4 model=llama_tiny dataset=synthetic_text outer=diloco outer.lr=0.5 "
        "trainer.max_steps=40 masking=forward masking.granularity=neuron masking.coverage=0.5 parallelism=ddp "
        "outer.sync_every=10 trainer.grad_accum_steps=1"
    )
    cfg = load_config(shlex.split(outer)[4:], world_size=4, offline=True, check_data=False)
    assert (cfg.outer.name, cfg.outer.sync_every, cfg.outer.lr) == ("diloco", 10, 0.5)
    plain = command(base, Structure(), nproc=4, accum=1)
    assert plain == (
        "python -m sdp.train --nproc-per-node=4 model=llama_tiny dataset=synthetic_text trainer.max_steps=40 "
        "masking=none parallelism=ddp trainer.grad_accum_steps=1"
    )
    assert load_config(shlex.split(plain)[4:], world_size=4, offline=True, check_data=False).outer.name == "none"
