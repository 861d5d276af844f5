"""Packing token streams into [B, seq_len + 1] rows and rows into next-token batches."""

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from sdp.data.core import DataBundle, DataConfig, Placement
from sdp.data.loaders import EpochDataset, map_style_bundle


def rows_to_batch(rows: np.ndarray) -> dict:
    """Next-token batch from rows of seq_len + 1 tokens: inputs row[:, :-1], targets row[:, 1:]."""
    rows = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    return {"inputs": rows[:, :-1].contiguous(), "targets": rows[:, 1:].contiguous()}


def as_rows(tokens: np.ndarray, *, seq_len: int) -> np.ndarray:
    """View a flat token array as whole rows of seq_len + 1 tokens (the tail is dropped)."""
    row_len = seq_len + 1
    num_rows = len(tokens) // row_len
    return tokens[: num_rows * row_len].reshape(num_rows, row_len)


class TokenRows(EpochDataset):
    """Map-style dataset over the packed rows of a (possibly memory-mapped) token array."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, corpus: bool = True):
        self.rows = as_rows(tokens, seq_len=seq_len)
        # A corpus has so many tokens whatever the seq_len (a batch that does not fit says which
        # seq_len would); synthetic rows are drawn seq_len + 1 tokens long, so do not count.
        self.tokens = len(tokens) if corpus else None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitems__(self, indices: list[int]) -> dict:
        return rows_to_batch(self.rows[np.asarray(indices)])


def packed_batches(chunks: Iterable[np.ndarray], *, seq_len: int, batch_size: int) -> Iterator[dict]:
    """Pack a stream of token chunks into full batches of seq_len + 1 token rows.

    Tokens left over when the stream ends (less than a batch) are dropped.
    """
    block = batch_size * (seq_len + 1)
    carry = np.empty(0, dtype=np.int64)
    for chunk in chunks:
        carry = np.concatenate([carry, chunk])
        full = len(carry) // block
        for i in range(full):
            yield rows_to_batch(carry[i * block : (i + 1) * block].reshape(batch_size, seq_len + 1))
        carry = carry[full * block :]


def token_bundle(
    cfg: DataConfig, train: np.ndarray, evaluation: np.ndarray, place: Placement, *, corpus: bool = True
) -> DataBundle:
    """The DataBundle of flat token arrays: rows of seq_len+1 tokens, sharded over ranks
    (`corpus`: the token count is the data's, not drawn for the seq_len)."""
    return map_style_bundle(
        cfg,
        train=TokenRows(train, seq_len=cfg.seq_len, corpus=corpus),
        evaluation=TokenRows(evaluation, seq_len=cfg.seq_len),
        place=place,
        vocab_size=cfg.vocab_size,
    )
