"""Turning map-style datasets into a rank's infinite train stream and finite eval passes."""

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from sdp.data.core import DataBundle, DataConfig, Placement
from sdp.errors import ConfigError


class EpochDataset(Dataset):
    """A dataset whose augmentation depends on the epoch, fetched a batch at a time.

    Subclasses implement `__getitems__(indices) -> {"inputs", "targets"}`; DataLoader
    calls it with a whole batch of indices, so transforms run on batched tensors.
    """

    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentation draws of `epoch` (set before iterating)."""
        self.epoch = epoch

    def __getitem__(self, index: int) -> dict:
        return self.__getitems__([index])


def whole_batch(batch: dict) -> dict:
    """collate_fn for datasets whose `__getitems__` already returns the batch."""
    return batch


def augment_seed(*, aug_seed: int, epoch: int, key: int) -> int:
    """The seed of the augmentation draws of one batch or sample.

    Keyed by (seed + rank, epoch, first index) so the draws depend neither on
    num_workers nor on the global RNG the trainer uses.
    """
    state = np.random.SeedSequence([aug_seed % 2**63, epoch, key]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])


def augment_generator(*, aug_seed: int, epoch: int, key: int) -> torch.Generator:
    """A generator seeded with augment_seed."""
    return torch.Generator().manual_seed(augment_seed(aug_seed=aug_seed, epoch=epoch, key=key))


def repeat_epochs(make_epoch: Callable[[int], Iterable[dict]], *, start_epoch: int = 0) -> Iterator[dict]:
    """Chain epoch start_epoch, start_epoch + 1, ... forever; fail instead of spinning on an empty epoch."""
    for epoch in itertools.count(start_epoch):
        empty = True
        for batch in make_epoch(epoch):
            empty = False
            yield batch
        if empty:
            raise RuntimeError(f"epoch {epoch} of the training data produced no batch")


def check_shard_fits(cfg: DataConfig, *, per_rank: int, place: Placement, tokens: int | None = None) -> None:
    """Raise ConfigError when a rank's train shard cannot fill one batch; for text (`tokens`: the
    train split's), say which of dataset.seq_len and the batch to lower, and to what."""
    if per_rank >= place.batch_size:
        return
    batch, world = place.batch_size, place.world_size
    if tokens is None:
        raise ConfigError(
            "trainer.global_batch_size",
            f"{batch} per rank",
            f"must be <= {per_rank}, the train samples per rank of dataset.name={cfg.name!r}; "
            "use a smaller batch, fewer ranks or more data",
        )
    longest = tokens // (batch * world) - 1  # the seq_len at which every rank fills its batch
    ways = [f"dataset.seq_len to at most {longest}"] if longest >= 1 else []
    if per_rank > 0:
        ways.append(f"trainer.global_batch_size to at most {per_rank} per rank")
    raise ConfigError(
        "dataset.seq_len",
        cfg.seq_len,
        f"the train split of dataset.name={cfg.name!r} has {tokens} tokens: {per_rank} rows of seq_len + 1 "
        f"per rank for {world} rank(s), and a rank's batch takes {batch}; "
        + (f"lower {' or '.join(ways)}, or use more data" if ways else "use more data, or fewer ranks"),
    )


def train_stream(cfg: DataConfig, dataset: EpochDataset, *, place: Placement, collate_fn: Callable) -> Iterator[dict]:
    """An infinite stream of full batches from this rank's disjoint shard.

    DistributedSampler draws one permutation per epoch from the seed (the same on
    every rank) and hands each rank every world_size-th index of it.
    """
    sampler = DistributedSampler(
        dataset, num_replicas=place.world_size, rank=place.rank, shuffle=True, seed=place.seed, drop_last=True
    )
    check_shard_fits(cfg, per_rank=len(sampler), place=place, tokens=getattr(dataset, "tokens", None))

    def loader_over(indices) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=place.batch_size,
            sampler=indices,
            drop_last=True,
            num_workers=cfg.num_workers,
            collate_fn=collate_fn,
            # Worker seeds come from this generator, not from the trainer's global RNG.
            generator=torch.Generator().manual_seed(place.seed + place.rank),
        )

    loader = loader_over(sampler)
    # A resumed run starts inside an epoch: that epoch's first `skip` batches are left out by
    # index (nothing is loaded for them); the order and augmentation draws are the same.
    per_epoch = len(sampler) // place.batch_size
    start_epoch, skip = divmod(place.start_batch, per_epoch)

    def epoch_pass(epoch: int) -> Iterable[dict]:
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        if epoch == start_epoch and skip:
            return loader_over(list(sampler)[skip * place.batch_size :])
        return loader

    return repeat_epochs(epoch_pass, start_epoch=start_epoch)


def eval_shard(num_items: int, *, rank: int, world_size: int, limit: int = 0) -> Sequence[int]:
    """This rank's eval indices: every world_size-th, the same count on every rank.

    Equal counts give every rank the same number of eval batches, so collectives in
    the model's forward cannot hang; the price is dropping < world_size items.
    `limit` > 0 keeps only the first `limit` indices.
    """
    per_rank = num_items // world_size
    if limit > 0:
        per_rank = min(per_rank, limit)
    return range(rank, per_rank * world_size, world_size)


def eval_limit(cfg: DataConfig, place: Placement) -> int:
    """Eval items per rank allowed by cfg.eval_batches (0 = no limit)."""
    return cfg.eval_batches * place.eval_batch_size if cfg.eval_batches > 0 else 0


def eval_loader(cfg: DataConfig, dataset: Dataset, *, place: Placement, collate_fn: Callable) -> DataLoader:
    """A finite, unshuffled pass over this rank's eval shard (the last batch may be short)."""
    indices = eval_shard(len(dataset), rank=place.rank, world_size=place.world_size, limit=eval_limit(cfg, place))
    return DataLoader(
        dataset,
        batch_size=place.eval_batch_size,
        sampler=indices,
        drop_last=False,
        num_workers=cfg.num_workers,
        collate_fn=collate_fn,
    )


def map_style_bundle(
    cfg: DataConfig,
    *,
    train: EpochDataset,
    evaluation: Dataset,
    place: Placement,
    num_classes: int | None = None,
    vocab_size: int | None = None,
    collate_fn: Callable = whole_batch,
) -> DataBundle:
    """The DataBundle of a dataset with map-style train and eval splits."""
    stream = train_stream(cfg, train, place=place, collate_fn=collate_fn)

    def make_eval() -> DataLoader:
        return eval_loader(cfg, evaluation, place=place, collate_fn=collate_fn)

    return DataBundle(kind=cfg.kind, train=stream, make_eval=make_eval, num_classes=num_classes, vocab_size=vocab_size)
