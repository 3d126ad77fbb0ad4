"""Pre-drafting: a branch hit answers exactly what drafting after that verdict would.

Each test drafts the same session twice, one copy with a pre-drafter (its verdict answered from
a branch) and one without (drafted after the verdict as usual), and compares every token, every
q row and the next round after it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from starsd import models, sampling
from starsd.hub.drafters.base import DraftJob
from starsd.hub.drafters.llm import LlmProposer, LlmState
from starsd.hub.predraft import Predrafter
from starsd.protocol import Proposal, SamplingParams

PROMPT = [5, 17, 33, 8, 9]


@pytest.fixture(scope="module")
def draft(llama_pair: tuple[Path, Path]) -> models.LoadedModel:
    return models.load_causal_lm(llama_pair[1])


def idle(predrafter: Predrafter, limit: int = 200) -> int:
    """Run pre-draft steps until there is no work; how many it took."""
    steps = 0
    while predrafter.has_work():
        predrafter.step()
        steps += 1
        assert steps < limit
    return steps


def first_round(
    proposer: LlmProposer,
    params: SamplingParams,
    gamma: int = 3,
    tag: bytes = b"s",
    history: tuple[int, int] = (0, 0),
) -> tuple[LlmState, Proposal]:
    """A session's first proposal; ``history`` (drafted, kept) sets its acceptance so far."""
    state = proposer.new_state(PROMPT, params, gamma)
    state.drafted, state.kept = history
    (proposal,) = proposer.propose([DraftJob(tag, 0, state, 0, ())])
    assert isinstance(proposal, Proposal)
    return state, proposal


def same(a: Proposal, b: Proposal) -> None:
    assert a.tokens.tolist() == b.tokens.tolist()
    if a.q_probs is None or b.q_probs is None:
        assert a.q_probs is None and b.q_probs is None
        return
    np.testing.assert_allclose(a.q_probs, b.q_probs, atol=1e-6)


@pytest.mark.parametrize("history", [(0, 0), (100, 95)], ids=["corrections", "bonus"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(0.8, seed=7), SamplingParams(1.0, top_k=6, seed=3)],
    ids=str,
)
def test_every_branch_hit_equals_drafting_after_the_verdict(
    draft: models.LoadedModel, params: SamplingParams, history: tuple[int, int]
) -> None:
    """Catches a branch drafted from the wrong prefix or position (k = gamma feeds d_gamma too),
    a branch that drew from the session's own generator (so a miss would see it advanced) or
    from a fresh one, and a hit that leaves the session's cache or generator where the usual
    path would not: the round after the hit must match too. A session that rarely has its
    drafts accepted gets corrections as branches; one whose drafts are accepted, bonus tokens."""
    with_branches = LlmProposer(draft)
    predrafter = Predrafter(with_branches, branches=4)
    state, _ = first_round(with_branches, params, history=history)
    predrafter.offer(b"s", state)
    idle(predrafter)
    keys = sorted(predrafter.waiting[b"s"].branches)
    expected_k = {0} if history == (0, 0) else {3}
    assert len(keys) == 4 and expected_k <= {k for k, _ in keys}, keys
    for k, token in keys:
        plain = LlmProposer(draft)
        twin, _ = first_round(plain, params, history=history)
        pre = Predrafter(with_branches := LlmProposer(draft), branches=4)
        copy, _ = first_round(with_branches, params, history=history)
        pre.offer(b"s", copy)
        idle(pre)
        verdict = DraftJob(b"s", 1, copy, k, (token,))
        hit = pre.answer(verdict)
        assert hit is not None, (k, token)
        (expected,) = plain.propose([DraftJob(b"s", 1, twin, k, (token,))])
        same(hit, expected)
        nxt = [
            p.propose([DraftJob(b"s", 2, s, 1, (11,))])[0]
            for p, s in ((with_branches, copy), (plain, twin))
        ]
        same(nxt[0], nxt[1])  # type: ignore[arg-type]
        assert copy.cache.length == twin.cache.length == len(twin.tokens) + 2


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, seed=7)], ids=str)
def test_a_verdict_for_a_branch_still_drafting_is_answered_from_it(
    draft: models.LoadedModel, params: SamplingParams
) -> None:
    """Catches a verdict that arrives while its branch is half drafted being counted a miss
    (the probe and the feed thrown away: with many branches and a fast target most hits are of
    this kind), and a branch finished early that differs from drafting after the verdict."""
    pre = Predrafter(with_branches := LlmProposer(draft), branches=4)
    state, _ = first_round(with_branches, params, gamma=4)
    pre.offer(b"s", state)
    pre.step()  # the probe
    pre.step()  # the branches' feed: the batch is running, not one branch finished
    assert pre.running is not None and not pre.waiting[b"s"].branches
    k, token = _key_of_first_running(pre)
    plain = LlmProposer(draft)
    twin, _ = first_round(plain, params, gamma=4)
    hit = pre.answer(DraftJob(b"s", 1, state, k, (token,)))
    assert hit is not None and pre.stats.late_hits == 1 and pre.running is None
    (expected,) = plain.propose([DraftJob(b"s", 1, twin, k, (token,))])
    same(hit, expected)


def _key_of_first_running(pre: Predrafter) -> tuple[int, int]:
    assert pre.running is not None
    row = pre.running[1][0][1]
    return row.job.accepted, row.job.appended[0]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, seed=7)], ids=str)
@pytest.mark.parametrize("round_gamma", [2, 3, 4])
def test_a_branch_answers_any_round_gamma_up_to_its_own(
    draft: models.LoadedModel, params: SamplingParams, round_gamma: int
) -> None:
    """Catches a hit at a shorter gamma that keeps the branch's extra tokens, KV positions or
    generator draws (the round after would then differ from plain drafting), and a branch of
    ``reach`` 1 not drafted one token longer than its session's gamma 3."""
    pre = Predrafter(with_branches := LlmProposer(draft), branches=2, reach=1)
    state, _ = first_round(with_branches, params, gamma=3, history=(100, 95))
    pre.offer(b"s", state)
    idle(pre)
    (k, token), row = next(iter(pre.waiting[b"s"].branches.items()))
    assert row.gamma == 4 and len(row.tokens) == 4
    plain = LlmProposer(draft)
    twin, _ = first_round(plain, params, gamma=3, history=(100, 95))
    state.gamma = twin.gamma = round_gamma  # what the policy chose for this round
    hit = pre.answer(DraftJob(b"s", 1, state, k, (token,)))
    assert hit is not None and len(hit.tokens) == round_gamma
    (expected,) = plain.propose([DraftJob(b"s", 1, twin, k, (token,))])
    same(hit, expected)
    nxt = [
        p.propose([DraftJob(b"s", 2, s, 1, (11,))])[0]
        for p, s in ((with_branches, state), (plain, twin))
    ]
    same(nxt[0], nxt[1])  # type: ignore[arg-type]
    assert state.cache.length == twin.cache.length


def test_a_miss_drafts_from_untouched_state(draft: models.LoadedModel) -> None:
    """Catches pre-drafting that changes the session (tokens, cache, generator) before its
    verdict: a verdict no branch matches must draft exactly as with no pre-drafting."""
    params = SamplingParams(0.9, seed=5)
    with_branches, plain = LlmProposer(draft), LlmProposer(draft)
    predrafter = Predrafter(with_branches, branches=3)
    state, _ = first_round(with_branches, params)
    twin, _ = first_round(plain, params)
    predrafter.offer(b"s", state)
    idle(predrafter)
    verdict = (1, (1999 % draft.vocab_size,))  # a correction no branch expects
    assert (verdict[0], verdict[1][0]) not in predrafter.waiting[b"s"].branches
    assert predrafter.answer(DraftJob(b"s", 1, state, *verdict)) is None
    (a,) = with_branches.propose([DraftJob(b"s", 1, state, *verdict)])
    (b,) = plain.propose([DraftJob(b"s", 1, twin, *verdict)])
    same(a, b)  # type: ignore[arg-type]


def test_sampled_tokens_through_branch_hits_follow_q(draft: models.LoadedModel) -> None:
    """Chi-square of the first token of 1200 proposals answered from branches (each session
    seeded differently, its verdict a correction at position 1) against the draft's q after
    that verdict from a plain forward: catches a branch conditioned on the wrong prefix."""
    params = SamplingParams(1.0, top_k=6)
    proposer = LlmProposer(draft)
    predrafter = Predrafter(proposer, branches=2, max_sessions=2000)
    states = [
        proposer.new_state(PROMPT, SamplingParams(1.0, top_k=6, seed=i), 2) for i in range(1200)
    ]
    for start in range(0, len(states), 64):
        chunk = states[start : start + 64]
        proposer.propose([DraftJob(b"%d" % (start + i), 0, s, 0, ()) for i, s in enumerate(chunk)])
    for i, s in enumerate(states):
        predrafter.offer(b"%d" % i, s)
    idle(predrafter, limit=10_000)
    counts: dict[int, Counter] = {}
    for i, s in enumerate(states):
        tag = b"%d" % i
        keys = [key for key in predrafter.waiting[tag].branches if key[0] == 0]
        if not keys:
            continue
        correction = keys[0][1]
        hit = predrafter.answer(DraftJob(tag, 1, s, 0, (correction,)))
        assert hit is not None
        counts.setdefault(correction, Counter())[int(hit.tokens[0])] += 1
    checked = 0
    for correction, seen in counts.items():
        total = sum(seen.values())
        if total < 200:
            continue
        logits = models.forward(draft, [*PROMPT, correction], models.new_cache(draft))[-1]
        q = sampling.probs_from_logits(logits[None], params)[0]
        support = torch.nonzero(q).flatten().tolist()
        assert set(seen) <= set(support)
        expected = np.array([float(q[t]) for t in support])
        expected *= total / expected.sum()
        assert stats.chisquare([seen[t] for t in support], expected).pvalue > 1e-3
        checked += total
    assert checked >= 600


def test_one_step_is_one_small_forward_and_memory_is_bounded(
    draft: models.LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a pre-draft step that runs a whole branch batch (a waiting job would wait for
    gamma forwards), batches wider than ``rows``, more than ``branches`` per session, sessions
    beyond ``max_sessions``, and branches that copy the session's whole cache."""
    proposer = LlmProposer(draft)
    predrafter = Predrafter(proposer, branches=3, rows=4, max_sessions=5)
    states = [first_round(proposer, SamplingParams(), 3, b"%d" % i)[0] for i in range(7)]
    for i, s in enumerate(states):
        predrafter.offer(b"%d" % i, s)
    assert len(predrafter.waiting) == 5  # the two oldest were let go
    widths: list[int] = []
    forward = models.forward_batch

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        widths.append(int(args[1].shape[0]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(models, "forward_batch", counted)
    while predrafter.has_work():
        before = len(widths)
        predrafter.step()
        assert len(widths) - before <= 1
    assert max(widths) <= 4
    for waiting in predrafter.waiting.values():
        assert len(waiting.branches) <= 3
        for row in waiting.branches.values():
            assert row.cache is not None and row.cache.length == len(row.feed) + row.gamma - 1


def test_no_predrafting_while_more_proposals_than_the_limit_are_out(
    draft: models.LoadedModel,
) -> None:
    """Catches a hub that pre-drafts under load (where each step delays the real jobs that
    arrive meanwhile), and one that stops pre-drafting for good once load was high."""
    proposer = LlmProposer(draft)
    predrafter = Predrafter(proposer, branches=2, max_in_flight=2)
    states = [proposer.new_state(PROMPT, SamplingParams(), 2) for _ in range(3)]
    proposer.propose([DraftJob(b"%d" % i, 0, s, 0, ()) for i, s in enumerate(states)])
    for i, s in enumerate(states):
        predrafter.offer(b"%d" % i, s)
    assert not predrafter.has_work()  # three out: over the limit
    assert predrafter.answer(DraftJob(b"0", 1, states[0], 0, (7,))) is None  # one verdict back
    assert predrafter.has_work() and idle(predrafter) > 0  # two out: pre-draft again
    # A session that closes with its proposal out no longer counts once pruned.
    predrafter.offer(b"0", states[0])
    assert not predrafter.has_work()
    predrafter.prune(lambda tag: tag != b"2")
    assert predrafter.has_work()
