"""Run outputs on rank 0: metrics.jsonl, summary.json and (optionally) W&B."""

from __future__ import annotations

import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sdp.errors import ConfigError

LOGGERS = ("wandb", "none")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    mode: str = "offline"  # offline | online | disabled
    project: str = "sdp"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


def validate_logger(cfg: LoggerConfig) -> None:
    if cfg.name not in LOGGERS:
        raise ConfigError("logger.name", cfg.name, f"allowed: {', '.join(LOGGERS)}")
    if cfg.mode not in WANDB_MODES:
        raise ConfigError("logger.mode", cfg.mode, f"allowed: {', '.join(WANDB_MODES)}")


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON through a temporary file so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class RunLogger:
    """Appends metric records to `metrics.jsonl` and mirrors them to W&B.

    Only rank 0 constructs one with `active=True`; other ranks get a logger
    that does nothing, so call sites need no rank checks. A W&B failure is
    reported once and never stops training.
    """

    def __init__(
        self,
        cfg: LoggerConfig,
        *,
        run_dir: Path,
        run_name: str,
        config: dict,
        active: bool,
        resume_id: str | None = None,
    ):
        """`resume_id`: the W&B run id of the run this launch resumes (it continues that W&B run)."""
        self.active = active
        self.run_dir = run_dir
        self._wandb_run = None
        self.wandb_id = resume_id
        if not active:
            return
        self._metrics = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if cfg.name == "wandb" and cfg.mode != "disabled":
            self._start_wandb(cfg, run_name, config)

    def _start_wandb(self, cfg: LoggerConfig, run_name: str, config: dict) -> None:
        try:
            import wandb

            self.wandb_id = self.wandb_id or secrets.token_hex(4)  # kept in checkpoints: a resume continues it
            self._wandb_run = wandb.init(
                id=self.wandb_id,
                resume="allow",
                project=cfg.project,
                entity=cfg.entity,
                group=cfg.group,
                tags=list(cfg.tags),
                name=run_name,
                mode=cfg.mode,
                dir=str(self.run_dir),
                config=config,
                settings=wandb.Settings(quiet=True),
            )
        except Exception as err:  # noqa: BLE001 - W&B must never stop a run
            self._wandb_failed("start", err)

    def _wandb_failed(self, what: str, err: Exception) -> None:
        print(f"warning: W&B {what} failed, logging to metrics.jsonl only: {err}", file=sys.stderr, flush=True)
        self._wandb_run = None

    def log(self, record: dict) -> None:
        """Append one record (must contain `step`)."""
        if not self.active:
            return
        self._metrics.write(json.dumps(record) + "\n")
        if self._wandb_run is not None:
            try:
                self._wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
            except Exception as err:  # noqa: BLE001
                self._wandb_failed("log", err)

    def summary(self, summary: dict) -> None:
        """Write `summary.json` (the contract the table scripts read) and the W&B summary."""
        if not self.active:
            return
        write_json_atomic(self.run_dir / "summary.json", summary)
        if self._wandb_run is not None:
            try:
                self._wandb_run.summary.update(_flatten(summary))
            except Exception as err:  # noqa: BLE001
                self._wandb_failed("summary", err)

    def close(self, *, exit_code: int = 0) -> None:
        if not self.active:
            return
        self._metrics.close()
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish(exit_code=exit_code)
            except Exception as err:  # noqa: BLE001
                self._wandb_failed("finish", err)


def _flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts as 'a/b' keys (W&B summary panels); lists (per-rank records) are left out."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif not isinstance(v, list):
            out[f"{prefix}{k}"] = v
    return out
