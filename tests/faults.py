"""The entrypoint `sdp.train` with one fault armed, for tests/test_faults.py.

    torchrun [--max-restarts=N] ... tests/faults.py FAULT [override ...]

or `main([FAULT, override, ...])` on ranks forked by tests/ranks.py (faults without restarts).

FAULT is one of
    none           no fault;
    kill:R:S       rank R sends itself SIGKILL right after its S-th optimizer step, in the
                   job's first attempt only (TORCHELASTIC_RESTART_COUNT=0), as a dead node would;
    stop:R:S       rank R sends itself SIGSTOP right after its S-th optimizer step (first attempt
                   only), as a hung rank would, after writing the time and its pid into
                   ./stopped_at (torchrun's worker is in a session of its own: the test
                   kills it by that pid);
    enospc:R:S     rank R's part of the checkpoint of step S fails with 'No space left on
                   device' after part of the file reached the disk;
    nan:R:S        rank R's training loss is NaN in its S-th optimizer step;
    recut          not a fault, a probe: right after a resume's load, the state the ranks now
                   hold is gathered back into plain coordinates and saved (rank 0) to
                   ./recut.pt, to be compared with the checkpoint it was cut from.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import sys
import time
from pathlib import Path

import torch

import sdp.run.runner
import sdp.run.trainer
from sdp import train


def arm(fault: str) -> None:
    if fault == "none":
        return
    if fault == "recut":
        real_load = sdp.run.runner.load_checkpoint

        def load_then_gather(ckpt, *, strategy, optimizer, world, **kwargs):
            loaded = real_load(ckpt, strategy=strategy, optimizer=optimizer, world=world, **kwargs)
            state = strategy.portable_state(optimizer)  # collective
            if world.is_main:
                torch.save(dataclasses.asdict(state), "recut.pt")
            return loaded

        sdp.run.runner.load_checkpoint = load_then_gather
        return
    kind, rank, step = fault.split(":")
    if int(os.environ["RANK"]) != int(rank):
        return
    step = int(step)
    if kind in ("kill", "stop"):
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return  # the restarted attempt runs clean
        real_step, calls = sdp.run.trainer.train_step, [0]

        def step_then_die(*args, **kwargs):
            loss = real_step(*args, **kwargs)
            calls[0] += 1
            if calls[0] == step:
                if kind == "stop":
                    Path("stopped_at").write_text(f"{time.time()!r} {os.getpid()}")
                os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            return loss

        sdp.run.trainer.train_step = step_then_die
    elif kind == "enospc":
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if f"step_{step:08d}" in str(getattr(f, "name", f)):
                real_save(obj, f, *args, **kwargs)
                f.truncate(64)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
    elif kind == "nan":
        real_loss, calls = sdp.run.trainer.forward_loss, [0]

        def loss_with_a_nan(model, batch, **kwargs):
            loss, correct = real_loss(model, batch, **kwargs)
            if model.training:
                calls[0] += 1
                if calls[0] == step:
                    loss = loss * float("nan")
            return loss, correct

        sdp.run.trainer.forward_loss = loss_with_a_nan
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def main(argv: list[str]) -> int:
    """`FAULT [override ...]`: the entrypoint with FAULT armed (tests/ranks.py forks it)."""
    arm(argv[0])
    return train.main(argv[1:])


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
