"""Checkpoint and resume: a stopped-and-resumed run equals an uninterrupted one, bit for bit."""

import json
import os
import re
import shutil
import signal

import pytest
import torch
from conftest import launch, read_run

from sdp.data import build_data
from sdp.errors import ConfigError
from sdp.run.checkpoint import complete_checkpoints
from sdp.run.config import record_yaml
from sdp.run.resume import check_resume, first_difference, resume_view
from sdp.rundir import truncate_metrics

TINY = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=16"]
COMMON = ["logger=none", "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=0", "dataset.eval_batches=1"]
VARIANTS = {
    "ddp": [],
    # A new mask after steps 2 and 4: the resumed launch must rebuild mask epoch 1's subnetwork.
    "sdp-forward-resampled": ["masking=forward", "masking.coverage=0.5", "masking.resample_every=2"],
    # Neuron-level backward masking checkpoints only its held ranges of a sliced weight: the
    # resumed launch must fetch the others from their holders before its first forward.
    "sdp-backward": ["masking=backward", "masking.coverage=0.5"],
}
TIMINGS = ("tokens_or_samples_per_s", "step_time_s")


def _trajectory(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


@pytest.mark.dist
@pytest.mark.parametrize("variant", VARIANTS)
def test_stop_and_resume_equals_one_run(tmp_path, variant):
    overrides = [*TINY, *COMMON, *VARIANTS[variant]]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    runs = [
        [*overrides, f"run_dir={straight}"],
        [*overrides, f"run_dir={resumed}", "trainer.stop_at_step=3"],  # ends after step 3, as a preemption would
        [*overrides, f"run_dir={resumed}"],  # the same command again: resumes from step 3
    ]
    warnings = []
    for i, argv in enumerate(runs):
        if i == 2 and variant == "ddp":  # config.yaml edited by hand: what it says changes nothing
            config = (resumed / "config.yaml").read_text()
            (resumed / "config.yaml").write_text(re.sub(r"\n  lr: .*\n", "\n  lr: 0.5\n", config) + "extra: 1\n")
        proc = launch(argv, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        warnings += [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == (
        [
            f"warning: {resumed / 'config.yaml'} was edited: it differs from the config this command resumes "
            "with (extra: 1 -> '<absent>'; optim.lr: 0.5 -> 0.001); it is rewritten with this command's: a run's "
            "config is set by its command line, not by config.yaml"
        ]
        if variant == "ddp"
        else []  # an untouched config.yaml reads back as the record it was written from
    )
    assert (resumed / "config.yaml").read_text() == (straight / "config.yaml").read_text().replace(
        str(straight), str(resumed)
    )
    a, b = (torch.load(d / "model.pt", weights_only=True) for d in (straight, resumed))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    (sa, ra), (sb, rb) = read_run(straight), read_run(resumed)
    assert _trajectory(ra) == _trajectory(rb)  # every logged loss, the evaluation too
    assert sb["status"] == "completed" and sb["resumed_from"] == 3 and sa["resumed_from"] is None
    # The resumed launch kept the first launch's memory and FLOP measurements (steps 2 and 3).
    assert sb["memory"] == sa["memory"] and sb["flops_per_step_per_rank"] == sa["flops_per_step_per_rank"]
    assert [c.step for c in complete_checkpoints(resumed)] == [3]
    if variant == "sdp-backward":  # the mask is published, and the resume trained the same one
        mask = json.loads((resumed / "mask.json").read_text())
        assert mask == json.loads((straight / "mask.json").read_text())
        assert mask["construction"] == "cyclic" and mask["workers"] == 2 and mask["holders_per_unit"] == 1
        assert all(sum(n for _, n, _ in g["holders"]) == g["units"] for g in mask["groups"])


def _fake_checkpoint(run_dir, *, step: int, config: dict, world_size: int = 2, complete: bool = True):
    d = run_dir / "checkpoints" / f"step_{step:08d}"
    d.mkdir(parents=True)
    if complete:
        meta = {"step": step, "format": 2, "world_size": world_size, "config": config}
        (d / "meta.json").write_text(json.dumps(meta))


def test_resume_checks_name_what_is_wrong(tmp_path):
    config = {"trainer": {"max_steps": 6, "lr": 1e-3}, "model": {"name": "llama_tiny"}}
    assert check_resume(tmp_path, config) is None  # nothing there: a new run
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="without a complete checkpoint"):
        check_resume(tmp_path, config)
    _fake_checkpoint(tmp_path, step=4, config=config)
    _fake_checkpoint(tmp_path, step=6, config=config, complete=False)  # a launch died while writing it
    assert [c.step for c in check_resume(tmp_path, config).candidates] == [4]
    changed = {**config, "trainer": {"max_steps": 6, "lr": 2e-3}}
    with pytest.raises(ConfigError) as info:
        check_resume(tmp_path, changed)
    assert str(info.value).startswith("run_dir") and "trainer.lr: 0.001 -> 0.002" in str(info.value)
    assert [c.step for c in check_resume(tmp_path, config).candidates] == [4]  # any world size: it is re-cut
    _fake_checkpoint(tmp_path, step=8, config=config)
    (tmp_path / "checkpoints" / "step_00000008" / "meta.json").write_text(json.dumps({"step": 8, "config": config}))
    with pytest.raises(ConfigError, match=r"holds checkpoints of format 1, this version reads format 2"):
        check_resume(tmp_path, config)
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000008")
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed"}))
    with pytest.raises(ConfigError, match="completed run"):
        check_resume(tmp_path, config)


def test_first_difference_and_metrics_truncation(tmp_path):
    assert first_difference({"a": {"b": 1}}, {"a": {"b": 1}}) is None
    assert first_difference({"a": {"b": 1}}, {"a": {"c": 1}}) == "a.b: 1 -> '<absent>'"
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train_loss": s}) + "\n" for s in range(1, 7)))
    truncate_metrics(tmp_path, 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_resume_may_change_logging_but_not_training(tmp_path):
    from sdp.run.config import load_config

    raw = load_config([*TINY, "logger=none"], world_size=2, offline=True, check_data=False).record
    other = load_config(
        [*TINY, "logger=wandb", "trainer.progress=false", "trainer.stop_at_step=2"],
        world_size=2,
        offline=True,
        check_data=False,
    ).record
    assert resume_view(raw) == resume_view(other)
    longer = load_config([*TINY, "trainer.max_steps=7"], world_size=2, offline=True, check_data=False).record
    diff = first_difference(resume_view(raw), resume_view(longer))
    assert diff == "trainer.max_steps: 1000 -> 7"


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=resnet_tiny", "dataset=synthetic_image", "dataset.augment=true"],
        ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16"],
    ],
)
def test_a_resumed_stream_continues_where_the_first_left_off(overrides):
    # Start positions inside the first epoch and past its end (the epoch wraps).
    from sdp.run.config import typed_config

    cfg = typed_config(overrides).dataset

    def stream(start: int):
        return build_data(cfg, rank=1, world_size=2, batch_size=8, eval_batch_size=8, seed=3, start_batch=start).train

    full = stream(0)
    reference = [next(full) for _ in range(40)]
    for start in (5, 33):
        resumed = stream(start)
        for want in reference[start:]:
            got = next(resumed)
            assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_signal_asks_every_rank_to_stop(tmp_path):
    import torch.distributed as tdist

    from sdp.run.signals import StopSignals

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        stop = StopSignals(torch.device("cpu"), launched=False)
        assert not stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop() and stop.reason == "SIGUSR1"
        stop.close()
    finally:
        tdist.destroy_process_group()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.dist
def test_a_run_dir_resumes_however_its_path_is_spelled(tmp_path, monkeypatch):
    # The config records run_dir as the first launch spelled it; the run dir is the run, so a
    # trailing slash, a relative path, a symlink or a moved directory all resume it.
    from sdp.dist import World
    from sdp.run.preflight import preflight

    monkeypatch.chdir(tmp_path)
    first = tmp_path / "first"
    argv = [*TINY, *COMMON, "trainer.stop_at_step=3"]
    proc = launch([*argv, f"run_dir={first}"], nproc=1, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp_path / "link").symlink_to(first)
    for spelling in (f"{first}/", "first", "./first/", "link", f"{tmp_path}/link/"):
        resume = preflight([*TINY, *COMMON, f"run_dir={spelling}"], World(0, 0, 1)).resume
        assert [c.step for c in resume.candidates] == [3], spelling
    first.rename(tmp_path / "moved")
    (tmp_path / "link").unlink()
    (tmp_path / "link").symlink_to(tmp_path / "moved")
    proc = launch([*TINY, *COMMON, "run_dir=link/"], nproc=1, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, _ = read_run(tmp_path / "moved")
    assert summary["status"] == "completed" and summary["resumed_from"] == 3


def test_a_run_recorded_before_a_key_was_added_is_the_same_run_at_the_keys_old_value(tmp_path):
    """A run dir from before model.base_width, model.inner_width and trainer.plateau_threshold
    existed ran with 64, 1 and 0.005: a sweep skips it, and a resume takes it, at those values,
    and refuses it at others."""
    import yaml

    from sdp.run.config import typed_config
    from sdp.run.resume import check_completed, config_edits

    def record(*overrides):
        return yaml.safe_load(record_yaml(typed_config(["model=resnet_tiny", "dataset=synthetic_image", *overrides])))

    old = record()
    for section, key in (("model", "base_width"), ("model", "inner_width"), ("trainer", "plateau_threshold")):
        del old[section][key]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    check_completed(tmp_path, record())  # no error: the same run
    assert config_edits(tmp_path / "config.yaml", record(), old) is None
    assert first_difference(resume_view(old), resume_view(record("model.base_width=32"))) == (
        "model.base_width: '<absent>' -> 32"
    )
    with pytest.raises(ConfigError, match=r"model.inner_width: '<absent>' -> 0.5"):
        check_completed(tmp_path, record("model.inner_width=0.5"))


def _plan(overrides: list[str]):
    from sdp.run.config import typed_config, validate

    return validate(typed_config([*TINY, *overrides]), world_size=2, offline=True)


def test_a_resume_checks_the_mask_it_builds_against_the_run_dirs_mask_json(tmp_path):
    from sdp.paths import DamagedFile
    from sdp.run.preflight import check_mask

    plan = _plan(["masking=forward", "masking.coverage=0.5"])
    path = tmp_path / "mask.json"
    record = plan.record(0)
    path.write_text(json.dumps(record))
    check_mask(plan, tmp_path, before=2, world_size=2)  # the same mask: resumes
    group = record["groups"][3]
    first, units, holders = group["holders"][0]
    group["holders"][0] = [first, units, [1 - holders[0]]]  # a run of units moved to the other worker
    path.write_text(json.dumps(record))
    with pytest.raises(ConfigError) as err:
        check_mask(plan, tmp_path, before=2, world_size=2)
    assert str(err.value) == (
        f"run_dir={str(tmp_path)!r}: trained another mask than this launch builds (the holders of "
        f"{group['name']}'s units differ from mask.json): resume it with the version of this code that "
        "started it, or start a new run_dir"
    )
    check_mask(plan, tmp_path, before=4, world_size=2)  # a resize builds a new mask: nothing to check
    check_mask(
        _plan(["masking=forward", "masking.coverage=0.5", "masking.resample_every=2"]), tmp_path, before=2, world_size=2
    )
    path.write_text("{")
    with pytest.raises(DamagedFile, match="mask.json: is not a mask record"):
        check_mask(plan, tmp_path, before=2, world_size=2)
