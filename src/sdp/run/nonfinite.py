"""trainer.on_nonfinite: a step whose loss or gradient is NaN/Inf on any rank is never applied.

The check runs after the gradient sync and before the update, as one 2-element all-reduce
of every rank's flags. What happens next depends on the optimizer:

- a fused one (`optim.implementation=fused`, the default on CUDA) is handed the verdict as
  its `found_inf` tensor and skips the update on the device: the host never waits for it.
  The verdict is read where the host waits for the device anyway (`NonFiniteGuard.report`:
  log, eval and checkpoint steps, the end). Under `stop` the first non-finite step also
  latches every later update off until that read, so the run stops with the parameters
  and optimizer state of the step before it, as if it had stopped at once, up to
  `trainer.log_every - 1` steps later. Under `skip` only the non-finite steps are skipped,
  and the one past `max_nonfinite_skips` latches the rest off the same way.
- any other optimizer cannot skip on the device: the verdict is read at once (one host
  sync a step) and the step raises `NonFiniteStep` before the update.

Either way the diagnostic names every rank's loss and its non-finite gradient tensors.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from sdp import dist
from sdp.dist import local
from sdp.errors import RunFailed
from sdp.metrics.logger import RunLogger
from sdp.run.trainer_config import TrainerConfig
from sdp.rundir import nonfinite_record, write_json_atomic


class NonFiniteStep(RuntimeError):
    """A step whose loss or gradients are NaN/Inf on some rank; raised on every rank, and the
    update was not applied (the parameters and optimizer state are those of the step before)."""

    def __init__(self, diagnostic: dict):
        self.diagnostic = diagnostic
        ranks = diagnostic["ranks"]
        what = [
            f"rank {r['rank']}: loss {r['loss']}"
            + (f", non-finite gradients in {', '.join(r['nonfinite_grads'])}" if r["nonfinite_grads"] else "")
            for r in ranks
            if r["nonfinite_loss"] or r["nonfinite_grads"]
        ]
        norm = diagnostic["grad_norm"]
        super().__init__(f"non-finite loss or gradient ({'; '.join(what)}; gradient norm {norm})")


class Diverged(RunFailed):
    """The run stopped on a NaN/Inf step (trainer.on_nonfinite)."""


def json_float(t: torch.Tensor | float) -> float | str:
    """A scalar for strict JSON: a finite float, or 'nan' / 'inf' / '-inf'."""
    value = float(t)
    return value if math.isfinite(value) else str(value)


def _named_grads(strategy) -> list[tuple[str, torch.Tensor]]:
    return [(name, local(p.grad)) for name, p in strategy.model.named_parameters() if p.grad is not None]


def _grads_finite(strategy, norm: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Whether every rank's gradients are finite, from the global clipping norm when there is
    one (every rank has it), else from this rank's own gradients."""
    if norm is not None:
        return torch.isfinite(norm.float()).to(device)
    grads = [local(p.grad) for p in strategy.trainable() if p.grad is not None]
    if not grads:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.nn.utils.get_total_norm(grads).isfinite().to(device)


def _rank_record(loss, nonfinite_loss: bool, bad_names: list[str]) -> dict:
    return {
        "rank": dist.rank(),
        "loss": json_float(loss),
        "nonfinite_loss": nonfinite_loss,
        "nonfinite_grads": bad_names[:5] + ([f"... {len(bad_names) - 5} more"] if len(bad_names) > 5 else []),
    }


def check_finite(strategy, loss: torch.Tensor, norm: torch.Tensor | None) -> None:
    """Collective, read on the host at once: raise NonFiniteStep on every rank when any rank's
    loss or gradients are not finite. One 2-element all-reduce and one host sync."""
    flags = torch.stack([~torch.isfinite(loss), ~_grads_finite(strategy, norm, loss.device)]).float()
    if dist.all_reduce_(flags, op="max").sum().item() == 0:
        return
    # The slow path, once: which ranks, which tensors.
    bad = [name for name, g in _named_grads(strategy) if not torch.isfinite(g).all()]
    mine = _rank_record(loss, not bool(torch.isfinite(loss)), bad)
    raise NonFiniteStep({"ranks": dist.gather_objects(mine), "grad_norm": None if norm is None else json_float(norm)})


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` can skip an update on the device (`found_inf`: fused AdamW / SGD)."""
    return bool(optimizer.defaults.get("fused"))


class NonFiniteGuard:
    """The device-side check for a fused optimizer (see the module docstring): `check` in every
    step, before `optimizer.step()`; `report` where the host syncs anyway."""

    def __init__(self, policy: str, *, max_skips: int, device: torch.device, first_step: int = 1):
        self.policy, self.max_skips = policy, max_skips
        self.step = first_step  # the step the next check is of
        self.latched = torch.zeros((), device=device)  # 1.0: every update is skipped until read
        self.skipped = torch.zeros((), device=device)  # non-finite steps so far
        self.last_skip = torch.zeros((), device=device)  # 1.0: the last checked step was not applied
        self._steps: list[dict] = []  # what each step since the last report left on the device

    def check(self, strategy, optimizer, loss: torch.Tensor, norm: torch.Tensor | None) -> None:
        """Collective: decide on the device whether this step's update is applied, and hand
        the verdict to the fused optimizer as its `found_inf`; no host read."""
        named, clipped = _named_grads(strategy), norm
        # One norm per gradient tensor (a foreach reduction, no host sync): the diagnostic's
        # flags, read only for a bad step, and without clipping's global norm the check itself
        # (their norm is the one get_total_norm takes: the gradients are read once).
        norms = torch.stack(torch._foreach_norm([g for _, g in named])) if named else None
        if norm is None:
            norm = torch.zeros((), device=loss.device) if norms is None else torch.linalg.vector_norm(norms)
        # x * 0 is NaN exactly where x is not finite: both flags in three kernels.
        values = torch.stack([loss.detach().float(), norm.detach().float().to(loss.device)])
        flags = torch.isnan(values * 0).float()
        verdict = dist.all_reduce_(flags.clone(), op="max").amax()
        self.skipped += verdict
        skip = torch.maximum(verdict, self.latched)
        if self.policy == "stop":
            self.latched = skip
        else:  # skip: the step past max_nonfinite_skips stops the run, as the host check does
            self.latched = torch.maximum(self.latched, (self.skipped > self.max_skips).float())
        optimizer.found_inf = skip  # 0-d, like the step counts the fused kernel corrects with it
        self.last_skip = skip
        self._steps.append(
            {
                "step": self.step,
                "verdict": verdict,
                "loss": loss.detach(),
                "nonfinite_loss": flags[0],
                "names": [name for name, _ in named],
                "norms": norms,
                "norm": None if clipped is None else clipped.detach(),
            }
        )
        self.step += 1

    def forget(self) -> None:
        """Drop the records of the steps checked so far, unread (the estimator's traced steps)."""
        self._steps = []

    def report(self) -> list[tuple[int, NonFiniteStep]]:
        """Collective, reads the device: the non-finite steps since the last report, in order,
        each with its diagnostic (every rank's loss and non-finite gradient tensors)."""
        steps, self._steps = self._steps, []
        verdicts = torch.stack([s["verdict"] for s in steps]).tolist() if steps else []
        found = []
        for record, verdict in zip(steps, verdicts, strict=True):
            if not verdict:
                continue
            flags = [] if record["norms"] is None else (~torch.isfinite(record["norms"])).tolist()
            bad = [name for name, flag in zip(record["names"], flags, strict=True) if flag]
            mine = _rank_record(record["loss"], bool(record["nonfinite_loss"]), bad)
            norm = None if record["norm"] is None else json_float(record["norm"])
            found.append((record["step"], NonFiniteStep({"ranks": dist.gather_objects(mine), "grad_norm": norm})))
        return found


def handle_nonfinite(
    bad: NonFiniteStep,
    *,
    step: int,
    found_at: int,
    policy: str,
    max_skips: int,
    skipped: list[int],
    world: dist.World,
    logger: RunLogger,
    run_dir: Path | None,
    last_checkpoint: int | None,
) -> None:
    """A step with a NaN/Inf loss or gradient, found at step `found_at` (the same step when read
    on the host): record it as skipped (policy skip, up to `max_skips`), or write
    nonfinite_step_N.json and raise Diverged (stop)."""
    record = {"step": step, **bad.diagnostic}
    if policy == "skip" and len(skipped) < max_skips:
        skipped.append(step)
        logger.log({"step": step, "nonfinite_skipped": 1})
        dist.warn0(world, f"step {step} skipped ({len(skipped)} of at most {max_skips}): {bad}")
        return
    if world.is_main and run_dir is not None:
        write_json_atomic(nonfinite_record(run_dir, step), {**record, "skipped_before": skipped})
    why = f"after {len(skipped)} skipped steps, " if policy == "skip" else ""
    later = (
        f" (found at step {found_at}: the updates of steps {step}-{found_at} were skipped)" if found_at > step else ""
    )
    if last_checkpoint:
        then = (
            f"the last checkpoint, step {last_checkpoint}, is kept: resume it with trainer.on_nonfinite=skip "
            "to step over this one, or start again with a lower optim.lr"
        )
    else:
        then = "no checkpoint was written yet: start again with a lower optim.lr or trainer.on_nonfinite=skip"
    diagnostic = nonfinite_record(Path(), step).name
    raise Diverged(
        f"step {step}: {why}{bad}; the update was not applied{later} (diagnostic: {diagnostic}); {then}"
    ) from None


class NonFinitePolicy:
    """trainer.on_nonfinite for one run: the device-side guard when the optimizer can skip on
    the device (else the host check in `train_step`), the steps skipped so far, and what a
    non-finite step does (skip it, or stop the run: `handle_nonfinite`)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        start_step: int,
        world: dist.World,
        logger: RunLogger,
        run_dir: Path | None,
    ):
        """trainer.on_nonfinite and trainer.max_nonfinite_skips for this launch of the run."""
        self.policy, self.max_skips, self.device = cfg.on_nonfinite, cfg.max_nonfinite_skips, device
        self.world, self.logger, self.run_dir = world, logger, run_dir
        self.skipped: list[int] = []
        self.guard = None
        if self.policy != "off" and skips_on_device(optimizer):
            self.guard = NonFiniteGuard(self.policy, max_skips=self.max_skips, device=device, first_step=start_step + 1)

    def applied(self) -> torch.Tensor:
        """1 when the last step's update was applied, 0 when it was skipped (on the device)."""
        return torch.ones((), device=self.device) if self.guard is None else 1 - self.guard.last_skip

    def raised(self, bad: NonFiniteStep, *, step: int, last_checkpoint: int | None) -> None:
        """A step the host check found bad (before its update)."""
        self._handle(bad, step=step, found_at=step, last_checkpoint=last_checkpoint)

    def report(self, *, found_at: int, last_checkpoint: int | None) -> None:
        """Collective, where the host syncs anyway: the bad steps the device guard found since the last report."""
        for step, bad in self.guard.report() if self.guard is not None else []:
            self._handle(bad, step=step, found_at=found_at, last_checkpoint=last_checkpoint)

    def _handle(self, bad: NonFiniteStep, *, step: int, found_at: int, last_checkpoint: int | None) -> None:
        handle_nonfinite(
            bad,
            step=step,
            found_at=found_at,
            policy=self.policy,
            max_skips=self.max_skips,
            skipped=self.skipped,
            world=self.world,
            logger=self.logger,
            run_dir=self.run_dir,
            last_checkpoint=last_checkpoint,
        )

    def figures(self) -> dict:
        return {"nonfinite_skipped_steps": self.skipped}
