"""The data layer's entry points; each dispatches to the dataset named by `cfg.name`."""

from pathlib import Path

from sdp.data import cifar, fashion_mnist, fineweb, imagenet, local_text, synthetic
from sdp.data.core import KINDS, DataBundle, DataConfig, DatasetSpec, Placement, require_at_least
from sdp.errors import ConfigError

DATASETS: dict[str, DatasetSpec] = {
    "fineweb": fineweb.SPEC,
    "local_text": local_text.SPEC,
    "cifar10": cifar.SPEC,
    "cifar100": cifar.SPEC,
    "imagenet": imagenet.SPEC,
    "fashion_mnist": fashion_mnist.SPEC,
    "synthetic_text": synthetic.TEXT_SPEC,
    "synthetic_image": synthetic.IMAGE_SPEC,
}


def _spec(cfg: DataConfig) -> DatasetSpec:
    """The dataset's hooks, after checking that name and kind agree."""
    if cfg.kind not in KINDS:
        raise ConfigError("dataset.kind", cfg.kind, f"allowed: {', '.join(KINDS)}")
    spec = DATASETS.get(cfg.name)
    if spec is None:
        raise ConfigError("dataset.name", cfg.name, f"allowed: {', '.join(DATASETS)}")
    if spec.kind != cfg.kind:
        raise ConfigError("dataset.kind", cfg.kind, f"dataset.name={cfg.name!r} is {spec.kind!r} data")
    return spec


def validate_data(cfg: DataConfig, *, offline: bool) -> None:
    """Cheap checks to run before any process group starts; raises ConfigError.

    `offline` (HF_HUB_OFFLINE is set) turns hub datasets and uncached hub
    tokenizers into errors instead of network accesses.
    """
    spec = _spec(cfg)
    require_at_least(cfg, "num_workers", "eval_batches", minimum=0)
    spec.validate(cfg, offline=offline)


def prepare_data(cfg: DataConfig) -> None:
    """Build the dataset's local caches (idempotent, atomic writes); run on rank 0 before a barrier."""
    _spec(cfg).prepare(cfg)


def build_data(
    cfg: DataConfig,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    eval_batch_size: int,
    seed: int,
    start_batch: int = 0,
) -> DataBundle:
    """This rank's infinite train batches and finite eval passes; `batch_size` is per rank.

    The train stream starts after its first `start_batch` batches, exactly where a run
    that consumed them left off (a resumed run)."""
    place = Placement(
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        seed=seed,
        start_batch=start_batch,
    )
    return _spec(cfg).build(cfg, place)


def data_tokenizer_file(cfg: DataConfig) -> Path | None:
    """The tokenizer.json the dataset's text is encoded with, where there is one on this machine."""
    return _spec(cfg).tokenizer_file(cfg)


def data_vocab_size(cfg: DataConfig) -> int | None:
    """How many token ids the text pipeline can emit (every id is below it); None for images."""
    return _spec(cfg).vocab_size(cfg)
