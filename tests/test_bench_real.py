"""The real-pair benchmark's pure parts: the model's predictions and the proposal sizes."""

from __future__ import annotations

import pytest

from scripts.bench.real import predictions, proposal_bytes


def test_a_dense_q_at_the_real_vocabulary_costs_what_it_should_on_the_wire() -> None:
    """Catches q sent as float64, over the wrong axis, or for the bonus position too: 4 tokens
    of a dense float32 q over 49152 ids are 786,432 bytes, top-k 50 a few hundred more than
    the ids and their q, greedy only the ids."""
    sizes = proposal_bytes(4, 49152, 50)
    assert 4 * 49152 * 4 <= sizes["dense"] < 4 * 49152 * 4 + 512
    assert 4 * 50 * 8 <= sizes["top_k"] < 4 * 50 * 8 + 512
    assert sizes["greedy"] < 256


def test_the_model_predicts_auto_as_the_best_of_alone_and_every_gamma() -> None:
    """Catches a prediction that ignores decoding alone (auto below 1x where no gamma pays) or
    prices a round without its draft time."""
    step = 0.070
    runs = {
        "central-g1": {"mean_accepted": 0.4, "draft_s": 0.010, "verify_s": 0.120},
        "central-g2": {"mean_accepted": 0.6, "draft_s": 0.020, "verify_s": 0.150},
        "central-g4": {"mean_accepted": 0.7, "draft_s": 0.040, "verify_s": 0.160},
    }
    pred = predictions(runs, step)
    assert pred["g1"] == pytest.approx(1.4 * 0.070 / 0.130)
    assert pred["auto"] == 1.0
    runs["central-g1"]["verify_s"] = 0.050  # a memory-bound target: verify ~ a step
    assert predictions(runs, step)["auto"] == pytest.approx(1.4 * 0.070 / 0.060)
