"""The command line a Hydra user expects: --help, --cfg job|hydra|all, --config-dir / hydra.searchpath,
under a plain `python -m sdp.train`, torchrun and sweeps."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed
from conftest import job_env, torchrun
from omegaconf import OmegaConf

from sdp.launching.cli import COMMON_KEYS
from sdp.run.config import GROUPS, group_options, typed_config
from sdp.train import main

RUN = ["model=resnet_tiny", "dataset=synthetic_image", "trainer.max_steps=3", "logger=none"]


@pytest.fixture
def user_dir(tmp_path):
    """A user's own config dir, outside the package: an experiment and a model."""
    root = tmp_path / "myconf"
    (root / "experiment").mkdir(parents=True)
    (root / "model").mkdir()
    (root / "experiment" / "short.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: wide_resnet\ntrainer:\n  max_steps: 7\n"
    )
    (root / "model" / "wide_resnet.yaml").write_text(
        "name: wide_resnet\nfamily: resnet\nlayers: [1, 2, 1, 1]\nnum_classes: ${dataset.num_classes}\n"
    )
    return root


def _main(argv, capsys, tmp_path) -> tuple[int, str, str]:
    out = tmp_path / "outputs"
    code = main([f"output_root={out}", *argv])
    captured = capsys.readouterr()
    assert not out.exists() and not torch.distributed.is_initialized()  # nothing started, nothing written
    return code, captured.out, captured.err


def test_help_lists_every_group_its_options_and_the_common_keys(capsys, tmp_path):
    code, out, err = _main(["--help"], capsys, tmp_path)
    assert code == 0 and err == ""
    for group in GROUPS:
        assert f"  {group} " in out and ", ".join(group_options(group)) in out, group
    for key in COMMON_KEYS:
        assert f"  {key} " in out, key
    assert "README.md" in out and "docs/" in out and "--config-dir DIR" in out
    # conf/ at the top of the repository: the file --help names exists, and is the one composed
    repo_conf = Path(__file__).parents[1] / "conf" / "config.yaml"
    assert f"the defaults: {repo_conf})" in out and repo_conf.is_file()


def test_cfg_job_prints_the_resolved_config_the_run_would_use(capsys, tmp_path):
    code, out, err = _main(["--cfg", "job", *RUN, "trainer.protocol=flop_matched"], capsys, tmp_path)
    cfg = typed_config([*RUN, "trainer.protocol=flop_matched", f"output_root={tmp_path / 'outputs'}"])
    assert code == 0 and err == ""
    assert OmegaConf.create(out) == OmegaConf.create(cfg.record)
    assert "${" not in out and "hydra" not in OmegaConf.create(out)


@pytest.mark.parametrize("kind", ["all", "hydra"])
def test_cfg_all_and_hydra_add_hydras_own_node(kind, capsys, tmp_path):
    code, out, _ = _main([f"--cfg={kind}", *RUN], capsys, tmp_path)
    printed = OmegaConf.create(out)
    assert code == 0 and "searchpath" in printed.hydra
    assert ("trainer" in printed) == (kind == "all")


@pytest.mark.parametrize(
    "argv,error",
    [
        (["--cfg", "yaml"], "error: --cfg='yaml': allowed: job, hydra, all"),
        (["--cfg"], "error: --cfg=None: allowed: job, hydra, all"),
        (["--verbose"], "error: flags='--verbose': unknown flag; allowed: -m/--multirun, -h/--help"),
        (["--config-dir", "/nonexistent/conf"], "error: hydra.searchpath='[file:///nonexistent/conf]': "),
        (["--cfg", "job", "modle=resnet_tiny"], "error: modle='resnet_tiny': no such key"),
    ],
)
def test_bad_flags_are_one_line(argv, error, capsys, tmp_path):
    code, out, err = _main(argv, capsys, tmp_path)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith(error), err


@pytest.mark.parametrize("how", ["config-dir", "searchpath"])
def test_a_users_config_dir_composes_like_the_builtin_groups(how, user_dir, capsys, tmp_path):
    extra = ["--config-dir", str(user_dir)] if how == "config-dir" else [f"hydra.searchpath=[file://{user_dir}]"]
    code, out, _ = _main([*extra, "--cfg", "job", *RUN[1:], "experiment=short"], capsys, tmp_path)
    printed = OmegaConf.create(out)
    assert code == 0 and printed.model.name == "wide_resnet" and printed.trainer.max_steps == 3
    # Its options are listed where the built-in ones are: in an unknown option's error and in --help.
    code, _, err = _main([*extra, "--cfg", "job", "model=wide_resnett"], capsys, tmp_path)
    assert code == 2 and err.startswith("error: model='wide_resnett': unknown option; allowed: ")
    assert "wide_resnet" in err.strip().split("allowed: ")[1].split(", ")
    code, out, _ = _main([*extra, "--help"], capsys, tmp_path)
    assert code == 0 and "short" in out.split("experiment", 1)[1].splitlines()[0]
    # And its keys are checked like any other.
    code, _, err = _main([*extra, "--cfg", "job", "experiment=short", "trainer.max_stepz=2"], capsys, tmp_path)
    assert code == 2 and "did you mean trainer.max_steps?" in err


def test_a_sweep_carries_the_users_config_dir_to_every_job(user_dir, capsys, tmp_path):
    sweep_dir = tmp_path / "sweep"
    argv = ["-m", "--config-dir", str(user_dir), *RUN[1:], "experiment=short", "seed=0,1", f"sweep.dir={sweep_dir}"]
    assert main([*argv, "sweep.dry_run=true"]) == 0
    planned = [line for line in capsys.readouterr().out.splitlines() if " planned " in line]
    assert len(planned) == 2 and all(f"hydra.searchpath=[file\\://{user_dir}]" in line for line in planned)


def test_a_plain_python_m_run_prints_help(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sdp.train", "--help"], cwd=tmp_path, env=job_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: torchrun") and not list(tmp_path.iterdir())


@pytest.mark.dist
def test_under_torchrun_one_rank_prints_the_config(user_dir, tmp_path):
    proc = torchrun(["--config-dir", str(user_dir), "--cfg", "job", *RUN[1:], "experiment=short"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("name: wide_resnet") == 1 and not (tmp_path / "outputs").exists()
