"""What a language table's loss means: the eval loss of n-gram models of the same token streams.

A plateau is only a benchmark when it is well below what counting alone gives. This module
estimates, from the train split's tokens, a unigram model (add-one smoothing over the
vocabulary) and a bigram model (interpolated absolute discounting, d = 0.75, backing off to the
unigram: a Kneser-Ney-style estimate without the continuation counts), and returns their
cross-entropy in nats per token on the eval split: the unit of the runs' eval loss. The eval
split is scored as one stream (the runs score rows of seq_len + 1 tokens; the few tokens at
row starts barely move the figure).
"""

from __future__ import annotations

import math

import numpy as np

DISCOUNT = 0.75


def unigram_probs(train: np.ndarray, vocab: int) -> np.ndarray:
    """P(w) with add-one smoothing over `vocab` ids."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab).astype(np.float64)
    return (counts + 1.0) / (counts.sum() + vocab)


def ngram_losses(train: np.ndarray, evaluation: np.ndarray, vocab: int) -> dict[str, float]:
    """{"unigram": nats/token, "bigram": nats/token} on `evaluation`, both estimated on `train`."""
    train = np.asarray(train, dtype=np.int64)
    evaluation = np.asarray(evaluation, dtype=np.int64)
    if train.size < 2 or evaluation.size < 2:
        raise ValueError("n-gram references need at least 2 train and 2 eval tokens")
    if max(int(train.max()), int(evaluation.max())) >= vocab:
        raise ValueError(f"a token id is >= the vocabulary size {vocab}")
    uni = unigram_probs(train, vocab)
    unigram = -float(np.log(uni[evaluation]).mean())
    # Bigram counts c(a, b) as sorted pair codes a * vocab + b; c(a) and N1+(a .) per history a.
    codes, counts = np.unique(train[:-1] * vocab + train[1:], return_counts=True)
    history = np.bincount(codes // vocab, weights=counts, minlength=vocab)
    followers = np.bincount(codes // vocab, minlength=vocab).astype(np.float64)
    prev, nxt = evaluation[:-1], evaluation[1:]
    pair = prev * vocab + nxt
    at = np.clip(np.searchsorted(codes, pair), 0, codes.size - 1)
    seen = np.where(codes[at] == pair, counts[at], 0).astype(np.float64)
    h = history[prev]
    with np.errstate(divide="ignore", invalid="ignore"):
        discounted = np.where(h > 0, np.maximum(seen - DISCOUNT, 0.0) / h, 0.0)
        backoff = np.where(h > 0, DISCOUNT * followers[prev] / h, 1.0)
    p = discounted + backoff * uni[nxt]
    bigram = -float(np.log(p).mean())
    return {"unigram": unigram, "bigram": bigram}


def reference_words(losses: dict[str, float], ddp_loss: float | None) -> str:
    """The header line of a language table: DDP's eval loss against the references."""
    refs = f"unigram {losses['unigram']:.3f}, bigram {losses['bigram']:.3f} nats/token"
    if ddp_loss is None:
        return f"Reference losses on the eval split, estimated on the train split: {refs}."
    gap = losses["bigram"] - ddp_loss
    return (
        f"Reference losses on the eval split, estimated on the train split: {refs}. DDP's eval loss "
        f"{ddp_loss:.3f} is {abs(gap):.3f} nats {'below' if gap >= 0 else 'above'} the bigram's (perplexity "
        f"{math.exp(ddp_loss):.1f} against {math.exp(losses['bigram']):.1f})."
    )
