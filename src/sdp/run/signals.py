"""A stop asked of a run from outside: SIGTERM, SIGUSR1 (a scheduler's preemption notice) and
Ctrl-C, agreed on by every rank at a log step so that the run checkpoints and stops."""

from __future__ import annotations

import signal
import time

import torch

from sdp import dist


class StopSignals:
    """Signals that ask the run to checkpoint and stop after the current log step: SIGTERM and
    SIGUSR1 (a scheduler's preemption notice; torchrun passes SIGTERM on to its workers) and
    SIGINT (Ctrl-C). A second Ctrl-C stops at once (KeyboardInterrupt); under a launcher, whose
    agent passes the first one on as well, only one that comes `repeat_s` after the first.
    Installed for the training loop, then `close()` gives the handlers back."""

    def __init__(self, device: torch.device, *, launched: bool, repeat_s: float = 2.0):
        self.device, self.launched, self.repeat_s = device, launched, repeat_s
        self.reason: str | None = None
        self._first_sigint: float | None = None
        self._previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
        }

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_sigint is not None and not (self.launched and now - self._first_sigint < self.repeat_s):
                raise KeyboardInterrupt
            self._first_sigint = self._first_sigint or now
        self.reason = self.reason or signal.Signals(signum).name

    def __call__(self) -> bool:
        """Whether any rank was signalled (collective: every rank agrees)."""
        t = torch.tensor([float(self.reason is not None)], device=self.device)
        return dist.all_reduce_(t, op="max").item() > 0

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
