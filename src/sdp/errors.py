"""Errors that reach the user as one line, before any process group starts."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value.

    The message always names the offending key, the value given and what is
    allowed, so that `train.py` can print it as a single line and exit.
    """

    def __init__(self, key: str, value: object, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r}: {allowed}")
