"""Subnetwork Data Parallelism: units, masks, apply, holder-group sync.

Only `masking=none` (every worker holds every unit, i.e. plain data
parallelism) exists so far.
"""

from __future__ import annotations

from dataclasses import dataclass

from sdp.errors import ConfigError

MASKINGS = ("none",)


@dataclass
class MaskingConfig:
    name: str = "none"
    coverage: float = 1.0  # fraction of units each worker holds


def validate_masking(cfg: MaskingConfig) -> None:
    if cfg.name not in MASKINGS:
        raise ConfigError("masking.name", cfg.name, f"allowed: {', '.join(MASKINGS)}")
    if not 0.0 < cfg.coverage <= 1.0:
        raise ConfigError("masking.coverage", cfg.coverage, "must be in (0, 1]")
    if cfg.name == "none" and cfg.coverage != 1.0:
        raise ConfigError("masking.coverage", cfg.coverage, "masking=none holds every unit: coverage must be 1.0")
