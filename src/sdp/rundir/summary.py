"""summary.json: the typed record every writer fills and every reader (a resume, a sweep, the
comparison table, `sdp.collect`, the GPU checks) reads.

A run writes it when it starts (status `running`) and when it ends, however it ends; the
contract of its keys is the `Summary` fields. Strategy-specific entries (`Strategy.describe()`:
SDP's mask statistics, granularity, FSDP degree...) sit beside them in the file and in
`Summary.strategy` here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from sdp.outer.algorithms import outer_label
from sdp.paths import DamagedFile, describe
from sdp.redact import redact
from sdp.rundir.files import SUMMARY, write_json_atomic
from sdp.subnet.baselines import BASELINES
from sdp.subnet.capacity import listed

# running: started; completed; stopped: stopped early with a checkpoint (stop_at_step, a
# signal), resumable; failed; interrupted: Ctrl-C.
STATUSES = ("running", "completed", "stopped", "failed", "interrupted")


def variant_label(
    masking: str,
    *,
    granularity: str | None = None,
    parallelism: str = "ddp",
    fsdp_degree: int = 1,
    activation_checkpointing: str = "none",
    mixed_precision: str = "fp32",
    capacity: list[float] | None = None,
    outer: dict | None = None,
    inner_width: float = 1.0,
) -> str:
    """The paper's name of a run's variant, plus the memory-saving methods stacked on it, the
    workers' capacities when they differ and an outer loop (`outer`: summary.json's, with name,
    sync_every and fragments), and a model whose SDP-sliced widths are scaled (`model.inner_width`:
    "DDP (inner width 0.5)" is the dense control): the tables' rows (`sdp.collect`) and W&B's job_type."""
    if masking == "none":
        label = "FSDP" if parallelism == "fsdp" else "DDP"
    elif masking in BASELINES:
        label = BASELINES[masking].title
    else:
        label = f"{'N' if granularity == 'neuron' else 'B'}-SDP {masking}"
        if parallelism == "fsdp":
            label += f" x FSDP({fsdp_degree})"
        if capacity is not None and len(set(capacity)) > 1:
            label += f" capacity {listed(capacity)}"
    if inner_width != 1:
        label += f" (inner width {inner_width:g})"
    if outer and outer.get("name", "none") != "none":
        label += outer_label(
            outer["name"], sync_every=outer["sync_every"], fragments=outer.get("fragments", 1), knobs=outer
        )
    if activation_checkpointing != "none":
        label += " + AC"
    if mixed_precision == "bf16":
        label += " + bf16"
    return label


@dataclass
class Summary:
    """What one run did and measured. Memory and communication figures are the busiest rank's
    (max over ranks); throughput is the global batch's, and per rank."""

    # What ran.
    status: str
    model: str
    dataset: str
    world_size: int
    coverage: float
    masking: str
    parallelism: str
    activation_checkpointing: str
    mixed_precision: str
    protocol: str
    device: str
    seed: int
    run_dir: str | None = None
    error: str | None = None  # a failed run's "ExceptionType: message"
    n_params: int | None = None
    inner_width: float = 1.0  # model.inner_width (1: the model as configured; C: the dense control)
    throughput_unit: str | None = None  # tokens/s | samples/s
    strategy: dict = field(default_factory=dict)  # Strategy.describe()
    # The outer loop (outer=diloco; {} without one): its settings, its syncs and bytes per sync.
    outer: dict = field(default_factory=dict)
    # How far it got, and the loss (the last log window's mean over every rank).
    steps: int | None = None
    stopped_at: int | None = None
    stopped_by: str | None = None  # trainer.stop_at_step, SIGINT (Ctrl-C), SIGTERM or SIGUSR1
    resumed_from: int | None = None
    resumes_from: int | None = None  # a stopped or interrupted run: the step the same command resumes from
    # Every resume of the run so far, in order: {"step", "world_size", "checkpointed_with"}
    # (the world size of the launch that resumed, and of the one that wrote the checkpoint).
    resumes: list[dict] = field(default_factory=list)
    export: list[str] = field(default_factory=list)  # the files of RUN_DIR/hf/ (trainer.export)
    export_error: str | None = None  # why hf/ was not written (the run itself completed)
    train_loss: float | None = None
    eval_loss: float | None = None
    eval_acc: float | None = None  # image models
    eval_token_acc: float | None = None  # language models: next-token accuracy
    # The convergence gate of the eval metric (sdp.metrics.convergence.plateau; {} until the run ends).
    convergence: dict = field(default_factory=dict)
    nonfinite_skipped_steps: list[int] = field(default_factory=list)
    checkpoint_failures: int = 0
    checkpoints_written: int = 0
    checkpoint_time_s: float = 0.0  # this launch's checkpoints, outside the step times
    # Speed (timed steps only).
    tokens_or_samples_per_s: float | None = None
    tokens_or_samples_per_s_per_rank: float | None = None
    step_time_s: float | None = None
    step_time_split_s: dict = field(default_factory=dict)
    flops_per_step_per_rank: int | None = None
    mfu: float | None = None
    mfu_peak: dict | None = None
    mfu_flops: str | None = None
    mfu_flops_per_step: int | None = None
    # Memory: params_bytes, grads_bytes, optim_bytes, peak_bytes, peak_breakdown, cuda_*.
    memory: dict = field(default_factory=dict)
    memory_per_rank: list[dict] = field(default_factory=list)
    # Communication.
    comm_bytes_per_step: float | None = None
    comm_bytes_per_step_per_rank: list[float] = field(default_factory=list)
    comm_groups_per_rank: int | None = None
    comm_bytes_per_step_by_kind: dict = field(default_factory=dict)
    exposed_comm_s: float | None = None
    comm_wait_s: float | None = None

    def update(self, entries: dict) -> None:
        """Set fields from `entries` (a component's part of the summary). A key that is no field
        is refused (KeyError naming it): the fields are summary.json's contract, and only
        `Strategy.describe()`'s entries go beside them (into `strategy`)."""
        unknown = sorted(k for k in entries if k not in _field_names() or k == "strategy")
        if unknown:
            raise KeyError(f"summary.json has no field {unknown[0]!r}: add it to Summary, or to Strategy.describe()")
        for key, value in entries.items():
            setattr(self, key, value)

    def to_json(self) -> dict:
        """The summary.json object: the fields, with `strategy`'s entries beside them."""
        out = dataclasses.asdict(self)
        out.update(out.pop("strategy"))
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Summary:
        """The record of a summary.json object; raises TypeError, naming the key, when a required
        key is missing or a field holds a value of another type (a number written as "NaN")."""
        names = _field_names()
        known = {k: v for k, v in obj.items() if k in names and k != "strategy"}
        for key, value in known.items():
            _check_type(key, value)
        return cls(**known, strategy={k: v for k, v in obj.items() if k not in names})

    @property
    def static_bytes(self) -> int:
        """Parameters + gradients + optimizer state on the busiest rank."""
        return sum(self.memory[k] for k in ("params_bytes", "grads_bytes", "optim_bytes"))


def _field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(Summary)}


# What each annotation of a field accepts from JSON: a float field takes a whole number too.
_JSON_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "dict": (dict,), "list": (list,)}
_NAMES = {str: "a string", int: "an integer", dict: "a mapping", list: "a list"}


def _check_type(key: str, value: object) -> None:
    """TypeError `KEY=VALUE: must be ...` when `value` is not what Summary's field `key` holds;
    the memory figures (`*_bytes`) are checked one level down."""
    kinds = [k.strip().split("[")[0] for k in str(Summary.__dataclass_fields__[key].type).split("|")]
    allowed = tuple(t for k in kinds for t in _JSON_TYPES.get(k, ()))
    if allowed:
        _check_type_of(key, value, allowed, nullable="None" in kinds)
    if key == "memory":
        for name, figure in value.items():
            if name.endswith("_bytes"):
                _check_type_of(f"memory.{name}", figure, (int, float), nullable=True)


def _check_type_of(key: str, value: object, allowed: tuple[type, ...], *, nullable: bool) -> None:
    if (value is None and nullable) or (isinstance(value, allowed) and not isinstance(value, bool)):
        return
    what = "a number" if float in allowed else _NAMES[allowed[0]]
    raise TypeError(f"{key}={value!r}: must be {what}{' or null' if nullable else ''}")


def write_summary(run_dir: Path, summary: Summary) -> None:
    """Write RUN_DIR/summary.json atomically, secrets redacted (a failed run's `error` may quote one)."""
    write_json_atomic(run_dir / SUMMARY, redact(summary.to_json()))


def load_summary(run_dir: Path) -> Summary:
    """The run's summary for a reader that must not skip a run silently (`sdp.collect`):
    DamagedFile, naming summary.json and what is wrong, when it cannot be read."""
    path = run_dir / SUMMARY
    try:
        obj = json.loads(path.read_text())
        return Summary.from_json(obj)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DamagedFile(path, f"cannot be read as JSON ({describe(err)})") from None
    except (TypeError, AttributeError) as err:
        raise DamagedFile(path, f"is not a run's summary: {err}") from None


def read_summary(run_dir: Path) -> Summary | None:
    """The run's summary, or None when it has none or it cannot be read (half a file cannot
    occur: it is written atomically; a damaged or foreign one reads as None)."""
    try:
        return Summary.from_json(json.loads((run_dir / SUMMARY).read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def run_status(run_dir: Path) -> str | None:
    """The run's status (None: no readable summary). Read on its own, so a summary that lacks
    other fields (written by hand, or by an older version) still marks a completed run as one."""
    try:
        status = json.loads((run_dir / SUMMARY).read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None
    return status if isinstance(status, str) else None
