"""What K workers in one process would cost: the replica tables' DDP step run serially, K times, in
one process, against the K-process runs' recorded step time (docs/experiments.md, "Fitting the
budget").

    python scripts/serial_workers_floor.py [--steps 40] [--threads 1 2]

For each table's experiment (replica_fmnist, replica_text) it builds the model and AdamW, and
times K forward-backward-update steps on one worker's micro-batch of random data, the compute
a K-workers-in-one-process mode would run between two averagings; no communication is timed,
so the figure is a floor. Run it on an idle machine: the ratio to the 4-process step time
(results/cpu_replica/budgets.json, `step_time_s`) is what such a mode could gain.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sdp.models import build_model
from sdp.run.config import typed_config
from sdp.run.trainer_config import micro_batch_size

K = 4
TABLES = {"vision": "replica_fmnist", "language": "replica_text"}


def worker_step_s(experiment: str, steps: int) -> float:
    """Seconds of one worker's step (forward, backward, AdamW) on its micro-batch."""
    cfg = typed_config([f"experiment={experiment}"])
    model, micro = build_model(cfg.model), micro_batch_size(cfg.trainer, world_size=K)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if cfg.model.family == "llama":
        x = torch.randint(0, cfg.model.vocab_size, (micro, cfg.dataset.seq_len))
        loss = lambda: F.cross_entropy(model(x).logits.flatten(0, 1), x.flatten())  # noqa: E731
    else:
        size = cfg.dataset.image_size
        x, y = torch.randn(micro, 3, size, size), torch.randint(0, cfg.model.num_classes, (micro,))
        loss = lambda: F.cross_entropy(model(x), y)  # noqa: E731
    for i in range(steps + 5):
        if i == 5:
            start = time.perf_counter()
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    budgets = json.loads(Path("results/cpu_replica/budgets.json").read_text())
    for table, experiment in TABLES.items():
        processes = budgets[table]["step_time_s"]
        for threads in args.threads:
            torch.set_num_threads(threads)
            serial = K * worker_step_s(experiment, args.steps)
            print(
                f"{table}: {K} workers serially in one process, {threads} thread(s): {serial:.3f} s a step; "
                f"{K} processes on this machine (the probe's DDP): {processes:.3f} s; ratio {serial / processes:.2f}"
            )


if __name__ == "__main__":
    main()
