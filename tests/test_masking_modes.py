"""Masking modes are plug-ins (sdp.subnet.modes): a mode registered only in this file is composed,
built, trained for two steps on forked ranks, assembled into the plain model, and planned, with
no other file edited. It is backward masking's behaviour under a name of its own, so its run must
equal backward masking's bit for bit."""

import json

import pytest
import torch
from conftest import job_env, read_run
from ranks import run_ranks

from sdp.errors import ConfigError
from sdp.subnet.modes import MODES, Backward, mode_of


class Mirror(Backward):
    """A mode of this test's own: backward masking's behaviour, its own name, caption and caveat."""

    name, caption, group = "mirror", "SDP mirror", "backward"

    def caveat(self, *, flop_matched: bool) -> str:
        return "a test's own mode"


def register_mirror() -> None:
    if "mirror" not in MODES:
        MODES["mirror"] = Mirror()


def train_main(argv: list[str]) -> int:
    """sdp.train's entrypoint on a forked rank, with this file's mode registered first."""
    from sdp import train

    register_mirror()
    return train.main(argv)


@pytest.fixture
def mirror(monkeypatch):
    monkeypatch.setitem(MODES, "mirror", Mirror())
    return MODES["mirror"]


RUN = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=8"]
RUN += ["trainer.max_steps=2", "trainer.eval_every=0", "logger=none", "trainer.progress=false", "masking.coverage=0.5"]


def test_a_mode_registered_in_a_test_is_composed_and_checked(mirror):
    from sdp.run.config import load_config

    cfg = load_config([*RUN, "masking=backward", "masking.name=mirror"], world_size=2, offline=True, check_data=False)
    assert cfg.masking.name == "mirror" and mode_of(cfg.masking.name) is mirror
    with pytest.raises(ConfigError) as err:
        load_config([*RUN, "masking=backward", "masking.name=bogus"], world_size=2, offline=True, check_data=False)
    assert str(err.value) == "masking.name='bogus': allowed: none, backward, forward, mirror, dropout, stochastic_depth"


@pytest.mark.dist
def test_a_mode_registered_in_a_test_trains_and_assembles_as_the_mode_it_copies(tmp_path):
    dirs = {}
    for name in ("backward", "mirror"):
        dirs[name] = tmp_path / name
        argv = [*RUN, "masking=backward", f"masking.name={name}", f"run_dir={dirs[name]}"]
        proc = run_ranks("test_masking_modes:train_main", argv, nproc=2, cwd=tmp_path, env=job_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
    summary, records = read_run(dirs["mirror"])
    assert summary["masking"] == "mirror" and summary["status"] == "completed" and summary["steps"] == 2
    a, b = (torch.load(d / "model.pt", weights_only=True) for d in dirs.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the assembled plain model


@pytest.mark.slow  # a whole plan search (its parts: tests/test_plan_*.py)
def test_a_mode_registered_in_a_test_is_planned(mirror, tmp_path, capsys):
    from sdp import plan

    out = tmp_path / "plan"
    argv = ["model=llama_tiny", "dataset=synthetic_text", "devices=2x24", "objective=memory", "precision=fp32"]
    argv += ["checkpointing=none", "granularity=neuron", "workers=1", "top=all", f"out={out}"]
    assert plan.main(argv) == 0
    rows = json.loads((out / "plan.json").read_text())["rows"]
    mine = [r for r in rows if r["structure"]["masking"] == "mirror"]
    assert [r["run"] for r in mine] == ["N-SDP mirror C=0.5"] and mine[0]["fits"]
    assert "masking=backward masking.name=mirror" in mine[0]["command"]
    assert mine[0]["caveat"] == "a test's own mode"
