"""Every config in conf/ composes; bad input fails with one line naming the key."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sdp.errors import ConfigError
from sdp.models import FAMILY_KIND
from sdp.run.config import CONF_DIR, GROUPS, group_options, load_config, typed_config

TINY_MODEL = {"text": "llama_tiny", "image": "resnet_tiny"}
TINY_DATA = {"text": "synthetic_text", "image": "synthetic_image"}


def _yaml(group: str, option: str):
    return OmegaConf.load(CONF_DIR / group / f"{option}.yaml")


def _overrides_for(group: str, option: str) -> list[str]:
    """`group=option` plus a partner of the right kind (a model needs a matching dataset)."""
    chosen = [f"{group}={option}"]
    if group == "model":
        chosen.append(f"dataset={TINY_DATA[FAMILY_KIND[_yaml('model', option).family]]}")
    elif group == "dataset":
        chosen.append(f"model={TINY_MODEL[_yaml('dataset', option).kind]}")
    return chosen


def test_conf_tree_has_the_documented_groups():
    for group in GROUPS:
        assert (CONF_DIR / group).is_dir(), group
        assert group_options(group), f"conf/{group}/ is empty"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_option_composes_to_a_typed_config(group, option):
    cfg = typed_config(_overrides_for(group, option))
    assert FAMILY_KIND[cfg.model.family] == cfg.dataset.kind
    if group in ("model", "dataset", "masking", "parallelism", "optim", "logger"):
        assert cfg.record[group]["name"] == _yaml(group, option).name


def test_defaults_are_the_offline_demo():
    cfg = typed_config([])
    assert (cfg.model.name, cfg.dataset.name, cfg.masking.name, cfg.parallelism.name) == (
        "resnet_tiny",
        "fashion_mnist",
        "none",
        "ddp",
    )
    assert cfg.logger.name == "wandb" and cfg.logger.mode == "offline"


def _error(overrides, *, world_size=1, offline=True) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, world_size=world_size, offline=offline)
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    return message


def test_unknown_group_option_lists_the_allowed_ones():
    message = _error(["model=llama_7b"])
    assert message.startswith("model='llama_7b'")
    assert "llama_134m" in message and "resnet18" in message


def test_unknown_key_is_named():
    assert _error(["trainer.max_stpes=3"]).startswith("trainer.max_stpes='3'")


def test_wrong_type_is_named():
    assert "trainer.max_steps" in _error(["trainer.max_steps=many"])


def test_batch_not_divisible_by_world_size():
    message = _error(["dataset=synthetic_image", "trainer.global_batch_size=10"], world_size=4)
    assert message.startswith("trainer.global_batch_size=10") and "4 x 1 = 4" in message


def test_seq_len_beyond_positions():
    message = _error(["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=4096"])
    assert message.startswith("dataset.seq_len=4096") and "max_seq_len=512" in message


def test_model_and_dataset_kinds_must_match():
    message = _error(["model=llama_tiny", "dataset=fashion_mnist"])
    assert message.startswith("dataset='fashion_mnist'") and "local_text" in message


def test_missing_data_path():
    assert _error(["model=resnet18", "dataset=cifar10", "dataset.path=/nonexistent/cifar"]).startswith("dataset.path=")


def test_hub_access_while_offline():
    message = _error(["model=llama_134m", "dataset=fineweb"], offline=True)
    assert message.startswith("dataset.") and "HF_HUB_OFFLINE" in message


@pytest.mark.parametrize(
    "override,key",
    [
        ("optim.schedule=exp", "optim.schedule"),
        ("optim.lr=-1", "optim.lr"),
        ("logger.mode=cloud", "logger.mode"),
        ("trainer.device=tpu", "trainer.device"),
        ("masking.coverage=0.5", "masking.coverage"),
        ("masking.resample_every=10", "masking.resample_every"),
        ("masking=forward masking.resample_every=-1", "masking.resample_every"),
    ],
)
def test_bad_values_name_their_key(override, key):
    assert _error(["dataset=synthetic_image", *override.split()]).startswith(key)


def _readme_error_table() -> list[tuple[str, list[str], int, str]]:
    """The rows of the 'Bad input' table in docs/bad-input.md: (what, overrides, processes, error start)."""
    section = (Path(__file__).parents[1] / "docs" / "bad-input.md").read_text()
    row = re.compile(r"^\| (.+?) \| `([^`]+)` \((\d+)\) \| `(.+)` \|$")
    rows = [m.groups() for m in map(row.match, section.splitlines()) if m]
    return [(what, overrides.split(), int(n), error) for what, overrides, n, error in rows]


README_ERRORS = _readme_error_table()


def test_the_readme_lists_the_errors_the_issue_asks_for():
    listed = " ".join(what for what, *_ in README_ERRORS)
    for case in ("coverage outside", "holder per unit", "FSDP degree", "unknown model", "unknown dataset",
                 "unknown masking", "seq_len", "batch not divisible", "missing data path", "offline",
                 "FSDP that contradicts the masking"):  # fmt: skip
        assert case in listed, case


@pytest.mark.parametrize("what,overrides,nproc,error", README_ERRORS, ids=[r[0] for r in README_ERRORS])
def test_every_readme_error_is_what_the_entrypoint_says(what, overrides, nproc, error, tmp_path, monkeypatch, capsys):
    # Rank 0 of an `nproc`-process launch, in this process: the error comes before any
    # process group, so nothing needs the other ranks.
    import torch.distributed

    from sdp.train import main

    if "without CUDA" in what and torch.cuda.is_available():
        pytest.skip("a refusal of a machine without CUDA")
    monkeypatch.setenv("WORLD_SIZE", str(nproc))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    out = tmp_path / "outputs"
    assert main([*overrides, f"output_root={out}"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {error}"), captured.err
    assert captured.out == ""
    assert not out.exists() and not torch.distributed.is_initialized()
