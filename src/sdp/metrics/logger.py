"""Metric records on rank 0: the run's metrics.jsonl and (optionally) W&B."""

from __future__ import annotations

import json
import secrets
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from sdp.errors import ConfigError
from sdp.redact import redact, redact_text, secret_values


class Logger(StrEnum):
    wandb = "wandb"
    none = "none"


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class LoggerConfig:
    name: Logger = Logger.wandb
    mode: WandbMode = WandbMode.offline
    project: str = "sdp"
    entity: str | None = None
    group: str | None = None  # null: the sweep's name in a sweep (sweep.name), else none
    job_type: str | None = None  # null: the run's variant, as the tables name it (e.g. "B-SDP forward")
    tags: list[str] = field(default_factory=list)
    init_timeout_s: float = 60.0  # online: an unreachable W&B server costs the run about this long, then W&B is off
    # At the run's end, stop waiting for uploads after this long (a server gone mid-run would
    # otherwise hold the finished run forever); what was not uploaded stays in RUN_DIR/wandb
    # for `wandb sync`.
    finish_timeout_s: float = 300.0


def validate_logger(cfg: LoggerConfig) -> None:
    for key in ("init_timeout_s", "finish_timeout_s"):
        if not getattr(cfg, key) > 0:
            raise ConfigError(f"logger.{key}", getattr(cfg, key), "must be > 0 (seconds)")


class RunLogger:
    """Appends metric records to the run's metrics file (`sdp.rundir.METRICS`) and mirrors them,
    and the end-of-run summary, to W&B.

    Only rank 0 constructs one with `active=True`; other ranks get a logger
    that does nothing, so call sites need no rank checks. A W&B failure (an
    unreachable server, no API key) is reported once, on one line, and never
    stops training. Everything written here and sent to W&B is redacted
    (`sdp.redact`): no credential of the config or the environment leaves.
    """

    def __init__(
        self,
        cfg: LoggerConfig,
        *,
        run_dir: Path,
        metrics: Path,
        run_name: str,
        config: dict,
        active: bool,
        resume_id: str | None = None,
        job_type: str | None = None,
    ):
        """`metrics`: the JSON-lines file records are appended to; `run_dir`: where W&B keeps its
        files; `resume_id`: the W&B run id of the run this launch resumes (it continues that W&B run);
        `job_type`: W&B's, when logger.job_type is null."""
        self.active = active
        self.run_dir = run_dir
        self._wandb_run = None
        self.wandb_id = resume_id
        if not active:
            return
        self._secrets = secret_values()
        self._metrics = open(metrics, "a", buffering=1)
        if cfg.name == "wandb" and cfg.mode != "disabled":
            self._start_wandb(cfg, run_name, config, job_type=cfg.job_type or job_type)

    def _start_wandb(self, cfg: LoggerConfig, run_name: str, config: dict, *, job_type: str | None) -> None:
        try:
            import wandb

            if cfg.mode == "online":
                _check_credentials(wandb)
            self.wandb_id = self.wandb_id or secrets.token_hex(4)  # kept in checkpoints: a resume continues it
            command_line = " ".join(sys.argv)
            self._wandb_run = wandb.init(
                id=self.wandb_id,
                resume="allow",
                project=cfg.project,
                entity=cfg.entity,
                group=cfg.group,
                job_type=job_type,
                tags=list(cfg.tags),
                name=run_name,
                mode=cfg.mode,
                dir=str(self.run_dir),
                config=redact(config, self._secrets),
                settings=wandb.Settings(
                    quiet=True,
                    init_timeout=cfg.init_timeout_s,
                    finish_timeout=cfg.finish_timeout_s,
                    finish_timeout_raises=True,  # reported once by close(), like any W&B failure
                    # W&B's system metadata records the command line: leave it all out when an
                    # override there holds a secret.
                    x_disable_meta=redact_text(command_line, self._secrets) != command_line,
                ),
            )
        except Exception as err:  # noqa: BLE001 - W&B must never stop a run
            self._wandb_failed("start", err)

    def _wandb_failed(self, what: str, err: Exception) -> None:
        """Warn once, on one line, and stop using W&B (later calls skip it, so no second warning)."""
        reason = (str(err).strip().splitlines() or [""])[0]
        then = (
            f"what was not uploaded stays in {self.run_dir / 'wandb'} (wandb sync it)"
            if what == "finish"
            else "logging to metrics.jsonl only"
        )
        message = f"warning: W&B {what} failed, {then}: {type(err).__name__}: {reason}"
        print(redact_text(message, self._secrets), file=sys.stderr, flush=True)
        self._wandb_run = None

    def log(self, record: dict) -> None:
        """Append one record (must contain `step`)."""
        if not self.active:
            return
        record = redact(record, self._secrets)
        self._metrics.write(json.dumps(record) + "\n")
        if self._wandb_run is not None:
            try:
                self._wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
            except Exception as err:  # noqa: BLE001
                self._wandb_failed("log", err)

    def summary(self, summary: dict) -> None:
        """Mirror the run's summary (summary.json's object) to W&B's run summary."""
        if not self.active or self._wandb_run is None:
            return
        summary = redact(summary, self._secrets)  # a failed run's `error` may quote a secret
        try:
            self._wandb_run.summary.update(_flatten(summary))
        except Exception as err:  # noqa: BLE001
            self._wandb_failed("summary", err)

    def save(self, path: Path) -> None:
        """Upload a file of the run dir with the W&B run (its files tab), now."""
        if not self.active or self._wandb_run is None:
            return
        try:
            self._wandb_run.save(str(path), base_path=str(path.parent), policy="now")
        except Exception as err:  # noqa: BLE001
            self._wandb_failed("save", err)

    def close(self, *, exit_code: int = 0) -> None:
        if not self.active:
            return
        self._metrics.close()
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish(exit_code=exit_code)
            except Exception as err:  # noqa: BLE001
                self._wandb_failed("finish", err)


def _check_credentials(wandb) -> None:
    """Refuse an online run without W&B credentials up front: on a terminal `wandb.init`
    would instead ask for an API key and wait for an answer, stalling the run."""
    from wandb.sdk.lib import wbauth  # wandb's own lookup (env, settings, .netrc), without its prompt

    host = wandb.setup().settings.base_url
    if wbauth.authenticate_session(host=host, source="sdp", prompt=False, update_session=False) is None:
        raise RuntimeError(f"no API key for {host} (set WANDB_API_KEY or run `wandb login`)")


def _flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts as 'a/b' keys (W&B summary panels); lists (per-rank records) are left out."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif not isinstance(v, list):
            out[f"{prefix}{k}"] = v
    return out
