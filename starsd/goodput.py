"""The rule that picks a session's draft length: the hub's ``--gamma auto`` and the analytic
model's auto gamma apply this one function, so a plan predicts what the hub will do.

Terms (index g = 0..G; index 0 is decoding alone): ``expected[g]`` E[L(g)], the tokens a round
with g draft tokens commits; ``costs[g]`` S(B, g), the hub's service time of the batch being
formed (:mod:`starsd.service`); ``outside[g]`` the rest of the session's cycle at g (its queue
wait and the round trip outside the hub R(g)); ``alone_s`` T_alone, the target's own step (None:
never alone); ``batch`` B. The session's own rate is own(g) = E[L(g)] / (S(B, g) + outside[g]),
alone 1 / T_alone.

  under-loaded: argmax own over 0..G;
  fully loaded: among g >= 1 with own(g) >= 1 / T_alone, argmax E[L(g)] / (S(B, g) / B), the
  session's tokens per second of hub time (its share of the batch); 0 if there is none.

Ties go to the shorter gamma, and to drafting over decoding alone.

A session whose batch drafts a common gamma c (:func:`deviation_rates`): the batch's drafting
takes as long as its longest proposal, so a session alone at g > c makes its B - 1 companions
wait S(B, g) instead of S(B, c). Such a g is judged by the whole batch: under-loaded, the mean
own rate of the B sessions (one at g, the others at c, all waiting S(B, g)); fully loaded, the
batch's tokens per hub second, (E[L(g)] + (B - 1) E[L(c)]) / S(B, g). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence


def best_gamma(
    expected: Sequence[float],
    costs: Sequence[float],
    outside: Sequence[float],
    alone_s: float | None,
    batch: int,
    loaded: bool,
) -> int:
    """The gamma in 0..G a session should draft next (the module docstring's rule)."""
    return pick_gamma(gamma_rates(expected, costs, outside, alone_s, batch, loaded))


def gamma_rates(
    expected: Sequence[float],
    costs: Sequence[float],
    outside: Sequence[float],
    alone_s: float | None,
    batch: int,
    loaded: bool,
) -> list[float]:
    """What :func:`best_gamma` ranks, for g = 0..G: under-loaded own(g) (index 0: 1 / T_alone,
    0 when never alone); fully loaded the tokens per hub second of each g that pays for the
    session, -1 for those that do not, and 0 at index 0 (alone: chosen when none pays)."""
    top = min(len(expected), len(costs), len(outside)) - 1
    alone = 1.0 / alone_s if alone_s else 0.0
    own = [expected[g] / (costs[g] + outside[g]) for g in range(1, top + 1)]
    if not loaded:
        return [alone, *own]
    share = max(batch, 1)
    return [
        0.0,
        *[
            expected[g] * share / max(costs[g], 1e-12) if own[g - 1] >= alone else -1.0
            for g in range(1, top + 1)
        ],
    ]


def pick_gamma(rates: Sequence[float]) -> int:
    """The best of :func:`gamma_rates`: the highest rate, the shorter gamma on a tie, and
    decoding alone (index 0) only when strictly ahead of every gamma."""
    best = max(range(1, len(rates)), key=lambda g: (rates[g], -g))
    return 0 if rates[0] > rates[best] else best


def deviation_rates(
    rates: Sequence[float],
    expected: Sequence[float],
    costs: Sequence[float],
    outside: Sequence[float],
    common: int,
    batch: int,
    loaded: bool,
) -> list[float]:
    """:func:`gamma_rates` ``rates`` with each gamma above ``common`` judged as one session of
    a batch of ``batch`` that drafts ``common`` (the module docstring); unchanged without a
    common gamma or a batch to share. A gamma that does not pay for the session (-1) stays."""
    judged = list(rates)
    if common < 1 or batch <= 1:
        return judged
    others = batch - 1
    for g in range(common + 1, len(rates)):
        if rates[g] < 0:
            continue
        if loaded:
            judged[g] = (expected[g] + others * expected[common]) / max(costs[g], 1e-12)
        else:
            own = expected[g] / (costs[g] + outside[g])
            theirs = expected[common] / (costs[g] + outside[common])
            judged[g] = (own + others * theirs) / batch
    return judged
