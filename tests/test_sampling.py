"""Sampling and verification: unit tests and distribution tests that a wrong sampler fails."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from starsd import params, sampling
from starsd.protocol import SamplingParams

# ------------------------------------------------------------------ logits processing


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(0.7),
        SamplingParams(1.3, top_k=5),
        SamplingParams(1.0, top_p=0.8),
        SamplingParams(0.5, top_k=10, top_p=0.6),
        SamplingParams(1.0, top_k=1000),
    ],
)
def test_process_logits_matches_transformers_warpers(params: SamplingParams) -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3
    expected = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        expected = TopKLogitsWarper(params.top_k)(None, expected)
    if params.top_p < 1.0:
        expected = TopPLogitsWarper(params.top_p)(None, expected)
    ours = sampling.process_logits(logits, params)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    finite = torch.isfinite(ours)
    torch.testing.assert_close(ours[finite], expected[finite])


def test_top_k_and_top_p_shrink_the_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert (sampling.probs_from_logits(logits, SamplingParams(1.0, top_k=2)) > 0).sum() == 2
    probs = sampling.probs_from_logits(logits, SamplingParams(1.0, top_p=0.5))
    assert (probs > 0).sum() == 1  # the top token alone already holds > 50% of the mass
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


# Extremes of what SamplingParams.validate accepts. probs_from_logits divided the raw logits by
# the temperature in float32: a large |logit| / temperature overflowed to inf and the softmax gave
# NaN (the drafter then failed every job). Now the row's max is subtracted first.
EXTREME_PARAMS = [
    SamplingParams(params.TEMPERATURE_MIN),
    SamplingParams(params.TEMPERATURE_MIN, top_p=5e-324),  # the smallest accepted top_p
    SamplingParams(params.TEMPERATURE_MIN, top_k=params.TOP_K_MAX, top_p=5e-324),
    SamplingParams(params.TEMPERATURE_MAX),
    SamplingParams(1.0, top_p=5e-324),
]
F32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("params", EXTREME_PARAMS, ids=repr)
@pytest.mark.parametrize("scale", [1e4, F32_MAX], ids=["realistic 1e4", "float32 max"])
def test_probs_stay_finite_and_normalised_at_the_extremes(
    params: SamplingParams, scale: float
) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = (torch.rand(8, 3000, generator=gen) * 2 - 1) * scale  # |logit| up to ``scale``
    logits[:, 0], logits[:, 1] = scale, -scale
    logits[1] = -scale  # a row of equal logits at the bottom of the range
    probs = sampling.probs_from_logits(logits, params)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))
    assert (probs.argmax(-1)[2:] == 0).all()  # the top logit keeps the most mass
    sampling.sample(probs, gen)  # multinomial accepts it


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(1.0),
        SamplingParams(0.7),
        SamplingParams(0.8, 50, 0.95),
        SamplingParams(1.3, 5),
    ],
    ids=repr,
)
def test_the_shift_leaves_ordinary_distributions_as_they_were(params: SamplingParams) -> None:
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(2)) * 4
    unshifted = sampling.process_logits(logits, params).softmax(dim=-1)
    probs = sampling.probs_from_logits(logits, params)
    if params.temperature == 1.0:  # softmax subtracts the same max itself: bit for bit
        assert torch.equal(probs, unshifted)
    torch.testing.assert_close(probs, unshifted, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ greedy verification


def _one_hot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize(
    ("draft", "target_argmax", "expected"),
    [
        ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted: bonus token
        ([1, 2, 3], [1, 5, 3, 4], (1, 5)),  # first mismatch at 1: the target's token replaces it
        ([1, 2, 3], [0, 2, 3, 4], (0, 0)),
        ([], [6], (0, 6)),  # nothing to verify: one plain decode step
    ],
)
def test_greedy_verify(draft: list[int], target_argmax: list[int], expected: tuple) -> None:
    got = sampling.greedy_verify(
        torch.tensor(draft, dtype=torch.long), _one_hot_logits(target_argmax)
    )
    assert got == expected


# ------------------------------------------------------------------ sparse q


def test_sparse_q_round_trips_to_dense() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    q = sampling.probs_from_logits(logits, SamplingParams(0.9, top_k=7, top_p=0.9))
    support, probs = sampling.sparse_q(q)
    assert support.shape[1] <= 7
    torch.testing.assert_close(sampling.dense_q(probs, support.long(), 40), q)


# ------------------------------------------------------------------ distribution tests
#
# A Markov "language": the next token depends only on the previous one, through transition
# matrices P (target) and Q (draft). Speculative decoding over it must emit sequences whose joint
# law is the target chain's. We check the joint law of the first two emitted tokens, which
# exercises acceptance, the residual, the bonus token and a second round.

VOCAB = 6
GAMMA = 3
TRIALS = 40_000


def _chains(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    p_logits = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    q_logits = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    return (
        sampling.probs_from_logits(p_logits, params),
        sampling.probs_from_logits(q_logits, params),
    )


def _speculative_round(
    P: torch.Tensor, Q: torch.Tensor, ctx: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One round for every trial: returns emitted [n, GAMMA + 1] and counts [n]."""
    prev, drafts, qs, ps = ctx, [], [], [P[ctx]]
    for _ in range(GAMMA):
        q = Q[prev]  # [n, V]
        d = sampling.sample(q, gen)
        drafts.append(d)
        qs.append(q)
        ps.append(P[d])
        prev = d
    draft = torch.stack(drafts, dim=1)  # [n, GAMMA]
    accepted, nxt = sampling.rejection_sample(
        draft, torch.stack(qs, dim=1), torch.stack(ps, dim=1), gen
    )
    emitted = torch.cat([draft, torch.zeros_like(draft[:, :1])], dim=1)
    emitted[torch.arange(len(ctx)), accepted] = nxt
    return emitted, accepted + 1


def _first_two_tokens(P: torch.Tensor, Q: torch.Tensor, start: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    rows = torch.arange(TRIALS)
    out = torch.full((TRIALS, 2), -1)
    filled = torch.zeros(TRIALS, dtype=torch.long)
    ctx = torch.full((TRIALS,), start)
    for _ in range(2):  # every round emits >= 1 token, so two rounds always suffice
        emitted, count = _speculative_round(P, Q, ctx, gen)
        for j in range(GAMMA + 1):
            take = (j < count) & (filled < 2)
            out[rows[take], filled[take]] = emitted[take, j]
            filled += take.long()
        ctx = emitted[rows, count - 1]
    return out


def _chi_square_p_value(P: torch.Tensor, samples: torch.Tensor, start: int) -> float:
    expected = (P[start][:, None] * P).flatten() * TRIALS  # joint law of (x1, x2)
    observed = torch.bincount(samples[:, 0] * VOCAB + samples[:, 1], minlength=VOCAB * VOCAB)
    assert observed[expected == 0].sum() == 0, "a token outside the target's support appeared"
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum(dim=0, keepdim=True)]).double()
    exp = torch.cat([expected[big], expected[~big].sum(dim=0, keepdim=True)]).double()
    keep = exp > 0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()  # absorb float rounding of the total
    return float(stats.chisquare(obs[keep].numpy(), exp.numpy()).pvalue)


PARAMS = [
    SamplingParams(0.7),
    SamplingParams(1.0),
    SamplingParams(1.0, top_k=3),
    SamplingParams(0.8, top_p=0.8),
    SamplingParams(0.7, top_k=4, top_p=0.9),
]


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_speculative_sampling_reproduces_target_distribution(params: SamplingParams) -> None:
    P, Q = _chains(params)
    samples = _first_two_tokens(P, Q, start=2)
    assert _chi_square_p_value(P, samples, start=2) > 1e-3


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_p=0.8)], ids=str)
def test_a_sampler_without_the_residual_fails(
    params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound is tight enough to catch the classic bug: resampling from p, not p - q."""
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)
    P, Q = _chains(params)
    samples = _first_two_tokens(P, Q, start=2)
    assert _chi_square_p_value(P, samples, start=2) < 1e-6


def test_draft_equal_to_target_accepts_everything() -> None:
    P, _ = _chains(SamplingParams(1.0))
    gen = torch.Generator().manual_seed(0)
    _, count = _speculative_round(P, P, torch.zeros(2000, dtype=torch.long), gen)
    assert bool((count == GAMMA + 1).all())
