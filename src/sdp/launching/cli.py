"""The command line as a Hydra user expects it: overrides, `-m` (a sweep), `--help`,
`--cfg job|hydra|all` (print the composed config, start nothing) and `--config-dir DIR` (a dir
of the user's own `experiment/`, `model/`... files, as `hydra.searchpath=[...]` also adds).
Shared by `python -m sdp.train`, `torchrun -m sdp.train` and the `sdp-train` console script."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sdp.errors import ConfigError
from sdp.redact import redact
from sdp.run.config import CONF_DIR, GROUPS, SEARCHPATH, group_options, search_dirs, typed_config, with_config_dirs

CFG_KINDS = ("job", "hydra", "all")
HELP_FLAGS = ("-h", "--help")
FLAGS = "-m/--multirun, -h/--help, -c/--cfg job|hydra|all, --resolve, -cd/--config-dir DIR"

# The keys most runs set, shown by --help with their defaults.
COMMON_KEYS = (
    "seed",
    "run_dir",
    "output_root",
    "trainer.max_steps",
    "trainer.global_batch_size",
    "trainer.grad_accum_steps",
    "trainer.eval_every",
    "trainer.log_every",
    "trainer.checkpoint_every",
    "trainer.protocol",
    "masking.coverage",
    "masking.granularity",
    "masking.construction",
    "masking.resample_every",
    "parallelism.activation_checkpointing",
    "parallelism.mixed_precision",
    "parallelism.compile",
    "optim.lr",
    "dataset.seq_len",
    "logger.mode",
)


@dataclass
class CommandLine:
    overrides: list[str] = field(default_factory=list)
    multirun: bool = False
    help: bool = False
    cfg: str | None = None  # job | hydra | all: print that config and stop


def parse_command_line(argv: list[str]) -> CommandLine:
    """Flags apart from overrides; --config-dir becomes a hydra.searchpath override (which
    every job of a sweep then carries). Raises ConfigError on an unknown flag."""
    line, dirs, args = CommandLine(), [], iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if arg in HELP_FLAGS:
            line.help = True
        elif arg in ("-m", "--multirun"):
            line.multirun = True
        elif arg == "--resolve":
            pass  # --cfg always prints the config resolved, as the run sees it
        elif name in ("-c", "--cfg"):
            line.cfg = value if eq else next(args, None)
            if line.cfg not in CFG_KINDS:
                raise ConfigError("--cfg", line.cfg, f"allowed: {', '.join(CFG_KINDS)}")
        elif name in ("-cd", "--config-dir"):
            folder = value if eq else next(args, None)
            if not folder:
                raise ConfigError("--config-dir", folder, "needs a directory")
            dirs.append(folder)
        elif arg.startswith("-"):
            raise ConfigError("flags", arg, f"unknown flag; allowed: {FLAGS}")
        else:
            line.overrides.append(arg)
    line.overrides = with_config_dirs(line.overrides, dirs)
    search_dirs(line.overrides)  # a missing config dir is refused here, before anything runs
    return line


def show_config(overrides: list[str], kind: str) -> str:
    """The composed config as YAML, resolved and typed as the run would see it (secrets
    redacted); `hydra` / `all` add Hydra's own node, unresolved (sdp reads only its searchpath)."""
    job = typed_config(overrides).record
    if kind == "job":
        return OmegaConf.to_yaml(job)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            hydra = compose(config_name="config", overrides=overrides, return_hydra_config=True).hydra
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError("--cfg", kind, f"could not compose Hydra's node: {str(err).splitlines()[0]}") from None
    node = {"hydra": redact(OmegaConf.to_container(hydra, resolve=False))}
    return OmegaConf.to_yaml(node if kind == "hydra" else {**node, **job})


def help_text(overrides: list[str]) -> str:
    """--help: usage, every config group with its options (the user's config dirs included),
    the most-used keys with their defaults, the flags, and where to read more."""
    dirs = search_dirs(overrides)
    try:
        cfg, refused = typed_config(overrides), None
    except ConfigError as err:  # help is still help: the defaults' values, and why these were not shown
        cfg, refused = typed_config([o for o in overrides if o.lstrip("+~").startswith(SEARCHPATH)]), err
    lines = [
        "usage: torchrun --nproc_per_node=N -m sdp.train [group=option ...] [key=value ...]",
        "       python -m sdp.train -m key=a,b ...   (a sweep; sweep.KEY=VALUE options: docs/sweeps.md)",
        "",
        f"Config groups (group=option; the defaults: {CONF_DIR / 'config.yaml'}):",
    ]
    width = max(len(g) for g in GROUPS)
    lines += [f"  {g:<{width}}  {', '.join(group_options(g, dirs))}" for g in GROUPS]
    given = "the defaults' values: these overrides are refused" if refused else "the value these overrides give"
    lines += ["", f"Keys most runs set (key=value; {given}; any key of --cfg job works):"]
    if refused:
        lines.append(f"  (error: {refused})")
    width = max(len(k) for k in COMMON_KEYS)
    record = OmegaConf.create(cfg.record)
    lines += [f"  {k:<{width}}  {OmegaConf.select(record, k)}" for k in COMMON_KEYS]
    lines += [
        "",
        f"Flags: {FLAGS}",
        "  --cfg job prints the composed, resolved config and starts nothing (hydra, all: with Hydra's own node);",
        "  --config-dir DIR (or hydra.searchpath=[file://DIR]) adds DIR's experiment/, model/... options.",
        "",
        "Examples:",
        "  python -m sdp.train --nproc-per-node=4 experiment=demo_fmnist masking=forward masking.coverage=0.5",
        "  python -m sdp.train -m variant=ddp,n_sdp_backward seed=0,1 sweep.nproc=4   (a sweep of 4 runs)",
        "",
        "Read more: README.md (quick start) and docs/ (configuration.md, sdp.md, memory.md, speed.md,",
        "resuming.md, experiments.md, sweeps.md, bad-input.md, troubleshooting.md).",
    ]
    return "\n".join(lines)


@dataclass
class Usage:
    """A command's --help: its usage line(s), what it does, its own keys (name=DEFAULT, what it
    means), where the rest of its keys are described, and examples."""

    usage: str
    about: str
    keys: list[tuple[str, str]]
    more: str
    examples: list[str]

    def text(self) -> str:
        width = max(len(k) for k, _ in self.keys)
        lines = [f"usage: {self.usage}", "", self.about, "", "Keys of its own:"]
        lines += [f"  {k:<{width}}  {meaning}" for k, meaning in self.keys]
        lines += ["", self.more, "", "Examples:", *(f"  {e}" for e in self.examples)]
        return "\n".join(lines)


def wants_help(argv: list[str]) -> bool:
    """-h or --help anywhere on a command line (no override or path is spelt so)."""
    return any(arg in HELP_FLAGS for arg in argv)
