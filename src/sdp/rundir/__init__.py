"""The run dir: every file a run writes there, named once, and the one way each is written.

```
RUN_DIR/config.yaml      the resolved config (secrets redacted)          train's runner
        metrics.jsonl    one JSON record per log and eval step           RunLogger
        summary.json     the run's typed summary (`Summary`)             write_summary
        model.pt         the final evaluated model, a plain state dict   the trainer's evaluation
        hf/              model.pt in the family's standard format        export_model (trainer.export)
        launch.json      the torchrun job that made the dir (restarts)   record_launch
        nonfinite_step_N.json  the diagnosis of a NaN/Inf step           sdp.run.nonfinite
        checkpoints/step_N/    resumable state                           sdp.run.checkpoint
        wandb/           W&B's offline files                             RunLogger
```

JSON files are written atomically (`write_json_atomic`): a reader (a sweep, `sdp.collect`, a
resume) never sees half a file. The run dir is decided once, by rank 0, and passed to every rank.
"""

from sdp.paths import check_writable
from sdp.rundir.files import (
    CHECKPOINTS,
    CONFIG,
    LAUNCH,
    MASK,
    METRICS,
    MODEL,
    SUMMARY,
    choose_run_dir,
    disk_full,
    elastic_run_dir,
    evaluations,
    nonfinite_record,
    record_launch,
    restarted_job,
    truncate_metrics,
    write_error,
    write_json_atomic,
    write_text_atomic,
)
from sdp.rundir.summary import (
    STATUSES,
    Summary,
    load_summary,
    read_summary,
    run_status,
    variant_label,
    write_summary,
)

__all__ = [
    "CHECKPOINTS",
    "CONFIG",
    "MASK",
    "LAUNCH",
    "METRICS",
    "MODEL",
    "STATUSES",
    "SUMMARY",
    "Summary",
    "check_writable",
    "choose_run_dir",
    "disk_full",
    "elastic_run_dir",
    "evaluations",
    "nonfinite_record",
    "load_summary",
    "read_summary",
    "record_launch",
    "restarted_job",
    "run_status",
    "truncate_metrics",
    "variant_label",
    "write_error",
    "write_json_atomic",
    "write_text_atomic",
    "write_summary",
]
