"""The segments of a traced step, each with its own live peak (`LivePeak.mark`).

A step's peak is the largest of several moments: the end of a decoder stack's forward with
every layer's saved activations, the head and loss on top of them, the backward with the
gradients made so far, the optimizer step. Each moment's bytes are affine in the number of
layers, but not with one slope, so the moment that peaks in a short trace need not be the one
that peaks in the whole model (sdp.planning.layered). Naming the segments lets the planner
extend each segment's peak on its own and take the largest.

`StepSegments` is the trace's phase timer (the train step names its phases through it) and
names, per micro-step m: `m forward` (from the batch to the head), `m head` (the forward from
the module `head` on: LLaMA's final norm, its LM head and loss), `m head backward` (the
backward down to the head's input), `m backward` (the rest of the backward); then `sync` (the
gradients' averaging and clipping), `optimizer`, and `after step` (backward masking's weight
refresh issues every receive buffer there: they live into the next forward). Without `head`,
a micro-step's forward and backward are one segment each.
"""

from __future__ import annotations

import contextlib

import torch

from sdp.metrics.memory import LivePeak
from sdp.run.measure import PhaseTimer


class StepSegments(PhaseTimer):
    """A PhaseTimer that marks the segments of the step on a LivePeak while `tracking` it."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._live: LivePeak | None = None
        self._micro = -1
        self._split = self._stepped = False
        self.tape = None  # an OpTape (sdp.metrics.launches) told each phase, while tracking

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self._live is not None:
            self._live.mark(self._segment(phase))
        if self.tape is not None:
            self.tape.phase = phase
        with super().__call__(phase):
            yield

    def _segment(self, phase: str) -> str:
        """The segment a train-step phase begins (the head's module hook splits the forward and
        the backward further)."""
        if phase == "data":  # each micro-step begins with its batch
            self._micro += 1
        self._stepped |= phase == "optimizer"
        if phase in ("data", "forward"):
            return f"{self._micro} forward"
        if phase == "backward":
            return f"{self._micro} {'head backward' if self._split else 'backward'}"
        return "after step" if self._stepped and phase == "sync" else phase

    @contextlib.contextmanager
    def tracking(self, live: LivePeak, model: torch.nn.Module, head: str | None = None, tape=None):
        """Mark segments on `live` inside, and tell `tape` each phase; `head`: the qualified name
        of the module where the head begins (None: no head segments); AttributeError when `model`
        has no such module."""
        self._live, self._micro, self._split, self._stepped = live, -1, head is not None, False
        self.tape = tape
        handle = None if head is None else model.get_submodule(head).register_forward_pre_hook(self._head)
        try:
            yield self
        finally:
            self._live, self._split, self.tape = None, False, None
            if handle is not None:
                handle.remove()

    def _head(self, module: torch.nn.Module, args: tuple) -> None:
        live, micro = self._live, self._micro
        live.mark(f"{micro} head")
        hidden = args[0]
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: live.mark(f"{micro} backward"))
