"""The run dir's owner: summary.json through one typed record, atomic JSON, the run dir's choice."""

import dataclasses
import json

import pytest

from sdp.errors import ConfigError
from sdp.rundir import (
    SUMMARY,
    Summary,
    check_writable,
    choose_run_dir,
    read_summary,
    run_status,
    write_json_atomic,
    write_summary,
)

HEAD = dict(
    status="completed", model="llama_tiny", dataset="synthetic_text", world_size=2, coverage=0.5, masking="forward",
    parallelism="ddp", activation_checkpointing="none", mixed_precision="fp32", protocol="same_iteration",
    device="cpu", seed=0,
)  # fmt: skip


def test_a_summary_round_trips_with_the_strategy_entries_beside_the_fields(tmp_path):
    summary = Summary(**HEAD, steps=8, memory={"params_bytes": 4}, strategy={"granularity": "neuron", "mask": {"K": 2}})
    obj = summary.to_json()
    assert obj["granularity"] == "neuron" and obj["mask"] == {"K": 2} and "strategy" not in obj
    assert set(obj) == {f.name for f in dataclasses.fields(Summary)} - {"strategy"} | {"granularity", "mask"}
    write_summary(tmp_path, summary)
    assert json.loads((tmp_path / SUMMARY).read_text()) == obj
    assert read_summary(tmp_path) == summary
    assert [p.name for p in tmp_path.iterdir()] == [SUMMARY]  # no temporary file left


def test_update_sets_fields_and_refuses_a_key_it_does_not_know():
    summary = Summary(**HEAD)
    summary.update({"eval_loss": 1.5, "steps": 3})
    assert (summary.eval_loss, summary.steps, summary.strategy) == (1.5, 3, {})
    for key in ("fsdp_degree", "strategy"):  # fsdp_degree went silently into summary.json
        with pytest.raises(KeyError, match=f"summary.json has no field '{key}'"):
            summary.update({"eval_acc": 0.5, key: 4})
    assert summary.eval_acc is None and summary.strategy == {}  # nothing set on a refusal


def test_unreadable_summaries_read_as_none_but_a_completed_status_still_counts(tmp_path):
    assert read_summary(tmp_path) is None and run_status(tmp_path) is None
    (tmp_path / SUMMARY).write_text('{"status": "compl')  # not JSON
    assert read_summary(tmp_path) is None and run_status(tmp_path) is None
    (tmp_path / SUMMARY).write_text(json.dumps({"status": "completed"}))  # by hand: no other field
    assert read_summary(tmp_path) is None and run_status(tmp_path) == "completed"
    (tmp_path / SUMMARY).write_text("[1, 2]")
    assert read_summary(tmp_path) is None and run_status(tmp_path) is None


def test_the_summary_keeps_no_secret(tmp_path, monkeypatch):
    secret = "5ec7e7c0ffee5ec7e7c0ffee5ec7e7c0ffee5ec7"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    write_summary(tmp_path, Summary(**{**HEAD, "status": "failed"}, error=f"HTTPError: 401 with key {secret}"))
    assert secret not in (tmp_path / SUMMARY).read_text()
    assert read_summary(tmp_path).error == "HTTPError: 401 with key <redacted>"


def test_a_new_run_dir_never_reuses_one(tmp_path):
    first = choose_run_dir(run_dir=None, output_root=str(tmp_path), name="r")
    first.mkdir()
    second = choose_run_dir(run_dir=None, output_root=str(tmp_path), name="r")
    assert second != first and second.name.startswith(first.name) and first.name.endswith("-r")
    assert choose_run_dir(run_dir=str(tmp_path / "mine"), output_root="x", name="r") == tmp_path / "mine"


def test_json_is_replaced_whole(tmp_path):
    path = tmp_path / "a.json"
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    write_json_atomic(path, {"c": 2})
    assert json.loads(path.read_text()) == {"c": 2} and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_run_dir_is_checked_writable_without_leaving_anything(tmp_path):
    (tmp_path / "file").write_text("x")
    check_writable("run_dir", tmp_path)  # an existing dir
    check_writable("run_dir", tmp_path / "a" / "b")  # one to create
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probes are gone, nothing was made
    with pytest.raises(ConfigError, match=r"^run_dir='.*/file': is a file, not a directory$"):
        check_writable("run_dir", tmp_path / "file")
    with pytest.raises(ConfigError, match=r"^output_root='.*/file/x': cannot be created: .*/file is a file$"):
        check_writable("output_root", tmp_path / "file" / "x")
