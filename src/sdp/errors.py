"""Errors that reach the user as one line, before any process group starts."""

from __future__ import annotations

from enum import Enum

from sdp.redact import REDACTED, is_secret_name, redact_text


class ConfigError(ValueError):
    """A bad configuration value.

    The message always names the offending key, the value given and what is
    allowed, so that `train.py` can print it as a single line and exit. A value
    under a secret-named key, or one holding a secret of the environment, is
    shown as `<redacted>` (see `sdp.redact`).
    """

    def __init__(self, key: str, value: object, allowed: str):
        value = value.value if isinstance(value, Enum) else value  # a choice (StrEnum) as the user typed it
        self.key, self.value, self.allowed = key, value, allowed
        shown = REDACTED if is_secret_name(key) and value not in (None, "") else repr(value)
        super().__init__(redact_text(f"{key}={shown}: {allowed}"))


class RunFailed(RuntimeError):
    """A failure after launch that the run has diagnosed (a NaN step, no intact checkpoint):
    every rank raises it, and the entrypoint reports it as one line with exit code 3."""


class WriteFailed(RunFailed):
    """A file the run needs (its final model) could not be written, a full disk say: every rank
    raises it, with one line naming the path (`sdp.rundir.write_error`)."""


class PeerLost(RunFailed):
    """A collective that timed out or lost a peer (a hung or dead rank). Every rank that is
    still responding raises it; the lowest of them (`reporter`) prints it and writes summary.json."""

    def __init__(self, message: str, *, reporter: bool):
        super().__init__(message)
        self.reporter = reporter


class Interrupted(KeyboardInterrupt):
    """Ctrl-C that stopped a run at once (a second one, or one before the loop could stop it
    at a step): the last step done, and the step the same command resumes from (None: the start)."""

    def __init__(self, step: int, resumes_from: int | None):
        super().__init__(step, resumes_from)
        self.step, self.resumes_from = step, resumes_from
