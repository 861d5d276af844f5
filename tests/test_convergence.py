"""The convergence gate (sdp.metrics.convergence): the smoothed eval metric's relative change over
the last 20% of the steps, against the threshold."""

import pytest

from sdp.metrics.convergence import plateau, settled_step, smoothed


def test_the_smoothed_value_averages_the_last_tenth_of_the_steps_up_to_a_step():
    evals = [(10, 1.0), (60, 2.0), (70, 4.0), (80, 6.0), (100, 3.0)]
    assert smoothed(evals, 80, steps=100) == 6.0  # (70, 80]: step 80 alone
    assert smoothed([*evals[:3], (75, 2.0), *evals[3:]], 80, steps=100) == 4.0  # steps 75 and 80: the mean
    assert smoothed(evals, 75, steps=100) == 4.0  # (65, 75]: step 70
    assert smoothed(evals, 65, steps=100) == 2.0  # (55, 65]: step 60
    assert smoothed(evals, 50, steps=100) == 1.0  # nothing in (40, 50]: the last at or before, step 10
    assert smoothed(evals, 5, steps=100) is None


def test_a_run_passes_when_its_smoothed_metric_moved_less_than_the_threshold():
    evals = [(s, 2.0 - 0.001 * s) for s in range(10, 101, 10)]  # a loss still falling: 1.92 -> 1.90
    gate = plateau(evals, steps=100, metric="eval_loss")
    assert (gate["from_step"], gate["to_step"], gate["threshold"]) == (80, 100, 0.005)
    assert gate["change"] == pytest.approx(0.02 / 1.9) and gate["plateaued"] is False  # 1.05% >= 0.5%
    assert plateau(evals, steps=100, metric="eval_loss", threshold=0.011)["plateaued"] is True
    flat = [(s, 0.9 + (0.001 if s % 20 else 0.0)) for s in range(10, 101, 10)]  # noise of 0.1%
    assert plateau(flat, steps=100, metric="eval_acc") == {
        "metric": "eval_acc",
        "from_step": 80,
        "to_step": 100,
        "threshold": 0.005,
        "change": pytest.approx(0.0),
        "plateaued": True,
        "reason": "",
    }


def test_a_run_without_the_evaluations_it_needs_is_undecided():
    assert plateau([(50, 1.0)], steps=100, metric="eval_loss")["reason"] == "no evaluation at step 100"
    late = plateau([(90, 1.0), (100, 1.0)], steps=100, metric="eval_loss")
    assert late["plateaued"] is None and late["reason"] == "no evaluation at or before step 80"
    assert plateau([], steps=100, metric="eval_loss")["plateaued"] is None


def test_the_settled_step_is_where_the_smoothed_metric_last_entered_the_final_band():
    # Rising to 0.9 at step 100, flat after; S averages the evaluations in (m - 20, m].
    evals = [(s, 0.9 * min(s, 100) / 100) for s in range(10, 201, 10)]
    # S(100) = (0.81 + 0.9) / 2 is 5% off the final 0.9; S(110) = 0.9 is on it.
    assert settled_step(evals, steps=200) == 110
    # A later excursion of 1% (steps 130 and 140, before the gate's last fifth) moves the settled
    # step past it: S(150) = (0.891 + 0.9) / 2 is still 0.5% off, S(160) is on.
    bumped = [(s, v * 0.99 if s in (130, 140) else v) for s, v in evals]
    assert settled_step(bumped, steps=200) == 160
    # A run still moving at its end settled nowhere it can show.
    rising = [(s, 0.9 * s / 200) for s in range(10, 201, 10)]
    assert settled_step(rising, steps=200) is None


def test_the_n_gram_references_are_exact_on_a_tiny_stream():
    import math

    import numpy as np

    from sdp.analysis.reference import ngram_losses, reference_words

    train, evaluation = np.array([0, 1, 0, 2, 0, 1]), np.array([0, 1, 2])
    got = ngram_losses(train, evaluation, vocab=3)
    # Unigram, add-one: counts 3, 2, 1 over 6 tokens -> 4/9, 3/9, 2/9.
    assert got["unigram"] == pytest.approx(-(math.log(4 / 9) + math.log(3 / 9) + math.log(2 / 9)) / 3, rel=1e-12)
    # Bigram, d = 0.75: 0 is followed 3 times by 2 distinct tokens, 1 once by 1:
    # P(1|0) = (2 - 0.75) / 3 + 0.75 * 2 / 3 * 3/9; P(2|1) = 0 + 0.75 * 1 / 1 * 2/9.
    p01, p12 = 1.25 / 3 + 0.5 * 3 / 9, 0.75 * 2 / 9
    assert got["bigram"] == pytest.approx(-(math.log(p01) + math.log(p12)) / 2, rel=1e-12)
    words = reference_words({"unigram": 5.0, "bigram": 4.0}, 3.5)
    assert words.endswith("DDP's eval loss 3.500 is 0.500 nats below the bigram's (perplexity 33.1 against 54.6).")
