"""No secrets leave a run: config.yaml, metrics, summary, W&B files, errors and sweep.json are redacted."""

import json
import os
import sys

import pytest
from omegaconf import OmegaConf
from test_config import _overrides_for
from test_sweep import BASE

from sdp.errors import ConfigError
from sdp.launching.sweep import run_sweep
from sdp.metrics.logger import LoggerConfig, RunLogger
from sdp.redact import REDACTED, is_secret_name, redact, redact_text, secret_values
from sdp.run.config import GROUPS, compose_config, group_options, load_config, record_yaml, typed_config
from sdp.rundir import Summary, write_summary

# Distinctive fakes: 40 hex digits like a W&B key, `hf_` and 34 letters like a Hugging Face token.
WANDB_KEY = "5ec7e7c0ffee5ec7e7c0ffee5ec7e7c0ffee5ec7"
HF_TOKEN = "hf_FakeFakeFakeTokenForTestsOnly0123456"
SUMMARY_HEAD = dict(
    model="m", dataset="d", world_size=1, coverage=1.0, masking="none", parallelism="ddp",
    activation_checkpointing="none", mixed_precision="fp32", protocol="same_iteration", device="cpu", seed=0,
)  # fmt: skip


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)


@pytest.mark.parametrize(
    "name",
    [
        "WANDB_API_KEY",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "GITHUB_TOKEN",
        "DB_PASSWORD",
        "PASSWD",
        "OPENAI_APIKEY",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "hf_token",
        "api_key",
        "apiKey",
        "password",
        "secret",
        "token",
        "+logger.api_key",
    ],
)
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    ["tokenizer", "tokens_or_samples_per_s", "max_tokens", "eos_token", "keep_checkpoints", "HF_TOKEN_PATH", "PWD"],
)
def test_ordinary_names(name):
    assert not is_secret_name(name)


def test_secret_values_are_long_values_of_secret_named_variables():
    environ = {
        "WANDB_API_KEY": WANDB_KEY,
        "HF_TOKEN": HF_TOKEN,
        "DEBUG_TOKEN": "1",  # too short to be a secret: "1" must never be redacted
        "USE_AUTH": "true",
        "PATH": "/usr/local/bin:/usr/bin",
        "HF_TOKEN_PATH": "/root/.cache/huggingface/token",
    }
    assert secret_values(environ) == {WANDB_KEY, HF_TOKEN}


def test_redact_hides_secret_keys_and_secret_values_anywhere():
    config = {
        "logger": {"api_key": "typed-in-key", "entity": None, "tags": ["a", f"run-{WANDB_KEY}"]},
        "dataset": {"hf_token": None, "path": f"/data/{WANDB_KEY}/x", "use_auth_token": True},
        "credentials": {"user": "me", "retries": 3},
        "blank_token": "",
    }
    redacted = redact(config, {WANDB_KEY})
    assert redacted == {
        "logger": {"api_key": REDACTED, "entity": None, "tags": ["a", f"run-{REDACTED}"]},
        "dataset": {"hf_token": None, "path": f"/data/{REDACTED}/x", "use_auth_token": True},
        "credentials": {"user": REDACTED, "retries": 3},
        "blank_token": "",
    }
    assert config["logger"]["api_key"] == "typed-in-key", "a copy: the input is left alone"


def test_redact_text_hides_env_values_assignments_and_hf_tokens():
    secrets = {WANDB_KEY}
    assert redact_text(f"key {WANDB_KEY} used", secrets) == f"key {REDACTED} used"
    assert redact_text(f"Authorization failed for {HF_TOKEN}", set()) == f"Authorization failed for {REDACTED}"
    assert redact_text("WANDB_API_KEY=abc123 python train.py", set()) == f"WANDB_API_KEY={REDACTED} python train.py"
    assert redact_text("+logger.api_key='sk-1' x", set()) == f"+logger.api_key='{REDACTED}' x"
    assert redact_text("{'password': 'hunter22'}", set()) == f"{{'password': '{REDACTED}'}}"
    ordinary = "trainer.max_steps=10 tokenizer=bpe eos_token=<|endoftext|> https://host:443/path tokens/s: 12.5"
    assert redact_text(ordinary, secrets) == ordinary


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_repo_config_is_left_unchanged(group, option):
    config = OmegaConf.to_container(compose_config(_overrides_for(group, option)), resolve=True)
    assert redact(config, set()) == config
    assert REDACTED not in record_yaml(typed_config(_overrides_for(group, option)))


def test_the_record_resolves_env_interpolations_before_redacting(secret_env):
    """config.yaml (`record_yaml`) holds the resolved config: an `${oc.env:...}` of a secret is
    resolved, then redacted, never written."""
    text = record_yaml(typed_config(["logger.group=${oc.env:HF_TOKEN}", "logger.project=${oc.env:WANDB_API_KEY}"]))
    assert HF_TOKEN not in text and WANDB_KEY not in text
    assert f"group: {REDACTED}" in text and f"project: {REDACTED}" in text


def test_config_errors_do_not_echo_secrets(secret_env):
    assert str(ConfigError("trainer.max_steps", "many", "must be an integer")) == (
        "trainer.max_steps='many': must be an integer"
    )
    assert str(ConfigError("logger.api_key", "typed-in", "unknown key")) == f"logger.api_key={REDACTED}: unknown key"
    assert (
        str(ConfigError("logger.mode", WANDB_KEY, "allowed: offline")) == f"logger.mode='{REDACTED}': allowed: offline"
    )
    # Through the config loader: a secret under an unknown key, and one in a checked value.
    for override in ("+dataset.hf_token=${oc.env:HF_TOKEN}", "logger.mode=${oc.env:WANDB_API_KEY}"):
        with pytest.raises(ConfigError) as info:
            load_config(["dataset=synthetic_image", override], world_size=1, offline=True)
        message = str(info.value)
        assert REDACTED in message and HF_TOKEN not in message and WANDB_KEY not in message


def test_sweep_json_and_console_hold_no_secrets(tmp_path, capsys, secret_env):
    argv = [*BASE, f"name={WANDB_KEY}", "+logger.api_key=typed-in-key", f"sweep.dir={tmp_path}"]
    assert run_sweep(argv) == 2  # every job refused: nothing launched, sweep.json and one error line written
    jobs = json.loads((tmp_path / "sweep.json").read_text())
    assert jobs[0]["status"] == "invalid" and jobs[0]["error"].startswith(f"logger.api_key={REDACTED}")
    assert f"name={REDACTED}" in jobs[0]["overrides"]
    out = capsys.readouterr()
    for text in ((tmp_path / "sweep.json").read_text(), out.out, out.err):
        assert WANDB_KEY not in text and "typed-in-key" not in text


def _files_holding(root, secrets: list[str]) -> list[str]:
    """Every regular file under `root` (W&B's binary ones too) that holds one of `secrets`, as bytes."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and not os.path.islink(path):
                data = open(path, "rb").read()
                found += [f"{path}: {s[:6]}..." for s in secrets if s.encode() in data]
    return found


def test_no_secret_reaches_any_file_of_the_run_dir(tmp_path, monkeypatch, secret_env):
    import wandb

    # An override on the command line carries one too: W&B's metadata would record it.
    monkeypatch.setattr(sys, "argv", ["sdp.train", f"logger.group={WANDB_KEY}"])
    config = {
        "dataset": {"name": "fineweb", "hf_token": HF_TOKEN, "hub_config": HF_TOKEN},  # by key name, by value
        "logger": {"api_key": WANDB_KEY, "group": WANDB_KEY, "tags": [f"key={WANDB_KEY}"]},
        "note": f"started with WANDB_API_KEY={WANDB_KEY} and {HF_TOKEN}",
    }
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(redact(config)))
    try:
        logger = RunLogger(
            LoggerConfig(mode="offline", project="sdp-test"),
            run_dir=tmp_path,
            metrics=tmp_path / "metrics.jsonl",
            run_name="r",
            config=config,
            active=True,
        )
        for step in (1, 2, 3):
            logger.log({"step": step, "train_loss": 1.0 / step, "note": f"token {HF_TOKEN}"})
        failed = Summary(**SUMMARY_HEAD, status="failed", error=f"HTTPError: 401 for token {HF_TOKEN} / {WANDB_KEY}")
        write_summary(tmp_path, failed)
        logger.summary(failed.to_json())
        logger.close(exit_code=1)
    finally:
        wandb.teardown()
    assert list((tmp_path / "wandb").rglob("*.wandb")), "W&B wrote its offline run"
    assert _files_holding(tmp_path, [WANDB_KEY, HF_TOKEN]) == []


@pytest.mark.dist
def test_a_launched_run_writes_no_secret_anywhere(tmp_path, secret_env):
    """The whole path: torchrun, config.yaml, checkpoints' meta.json, metrics, summary, W&B's
    offline files and the console, with the secrets in the environment and in the config."""
    from conftest import launch

    run_dir = tmp_path / "run"
    overrides = [*BASE, "logger=wandb", "trainer.checkpoint_every=1", "trainer.max_steps=3", f"run_dir={run_dir}"]
    # A top-level key is kept in config.yaml as given: the way a secret reaches a saved config.
    proc = launch([*overrides, "+hf_token=${oc.env:HF_TOKEN}", "+note=${oc.env:WANDB_API_KEY}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "<redacted>" in (run_dir / "config.yaml").read_text()
    assert list((run_dir / "wandb").glob("offline-run-*")) and list((run_dir / "checkpoints").glob("step_*"))
    secrets = [os.environ["HF_TOKEN"], os.environ["WANDB_API_KEY"]]
    for path in [p for p in run_dir.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        assert not any(s.encode() in data for s in secrets), path
    assert not any(s in proc.stdout + proc.stderr for s in secrets)
