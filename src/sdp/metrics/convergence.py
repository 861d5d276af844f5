"""Whether a run's eval metric has stopped moving: the convergence gate.

A run of T steps passes when the relative change of its smoothed eval metric over the last
20% of its steps is below a threshold (`trainer.plateau_threshold`, 0.5% by default):

    change = |S(T) - S(0.8 T)| / |S(T)|

S(m), the smoothed value at step m, is the mean of the evaluations in the last 10% of the
steps up to m, that is with steps in (m - 0.1 T, m]; where no evaluation falls there, the
last one at or before m. The gate is undecided (None, with the reason) when the run has no
evaluation at T or none at or before 0.8 T. The metric is eval accuracy for image models and
eval loss for language models. summary.json records the gate (`convergence`), and
`sdp.collect --claims` gives a verdict only on rows whose runs all pass it.
"""

from __future__ import annotations

WINDOW = 0.2  # the last fifth of the steps
SMOOTH = 0.1  # the span each smoothed value averages over
THRESHOLD = 0.005


def gate_metric(kind: str) -> str:
    """The eval metric the gate watches for a dataset kind (`image` or `text`)."""
    return "eval_acc" if kind == "image" else "eval_loss"


def smoothed(evals: list[tuple[int, float]], at: int, *, steps: int) -> float | None:
    """S(at): the mean of the evaluations in (at - SMOOTH * steps, at], else the last one at or
    before `at`; None when there is none."""
    window = [v for s, v in evals if at - SMOOTH * steps < s <= at]
    if window:
        return sum(window) / len(window)
    earlier = [v for s, v in evals if s <= at]
    return earlier[-1] if earlier else None


def plateau(evals: list[tuple[int, float]], *, steps: int, metric: str, threshold: float = THRESHOLD) -> dict:
    """The gate of a run of `steps` steps whose evaluations of `metric` are `evals` ((step,
    value) in order): summary.json's `convergence` entry."""
    start = int((1 - WINDOW) * steps)
    out = {"metric": metric, "from_step": start, "to_step": steps, "threshold": threshold}
    if not evals or evals[-1][0] != steps:
        return {**out, "change": None, "plateaued": None, "reason": f"no evaluation at step {steps}"}
    before, after = smoothed(evals, start, steps=steps), smoothed(evals, steps, steps=steps)
    if before is None:
        return {**out, "change": None, "plateaued": None, "reason": f"no evaluation at or before step {start}"}
    change = abs(after - before) / abs(after) if after else float("inf")
    return {**out, "change": change, "plateaued": change < threshold, "reason": ""}


def settled_step(evals: list[tuple[int, float]], *, steps: int, threshold: float = THRESHOLD) -> int | None:
    """The step at which a run's metric stops improving: the earliest evaluated step m from which
    every later smoothed value S(m') lies within `threshold` (relative) of the final S(steps).
    None when the run itself did not pass its gate (a run still moving at its end settled
    nowhere it can show). A table's step budget is at least twice a long DDP run's."""
    if plateau(evals, steps=steps, metric="", threshold=threshold)["plateaued"] is not True:
        return None
    final = smoothed(evals, steps, steps=steps)
    settled = steps
    for step, _ in reversed(evals):
        if abs(smoothed(evals, step, steps=steps) - final) >= threshold * abs(final):
            break
        settled = step
    return settled
