"""Batched drafting: a session's proposal is the one it would get drafted alone.

Every test drafts the same sessions two ways, batched (one ``propose`` call per round for every
session with a job) and one at a time (a second proposer, ``propose([job])`` per job), and checks
both against an oracle that shares no code with the batch path: the draft LLM's greedy chain
recomputed from scratch, or the EAGLE head's single-sequence path.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from test_eagle import eagle_state, write_head

from starsd import models, sampling
from starsd.hub.drafters import eagle_head as eagle
from starsd.hub.drafters.base import ChainState, DraftJob, Proposer
from starsd.hub.drafters.eagle import EagleProposer
from starsd.hub.drafters.llm import LlmProposer
from starsd.protocol import Error, ErrorCode, Proposal, SamplingParams

PROMPTS = [[5, 17, 33, 8], [3, 4], [21, 22, 23, 24, 25, 26, 27, 28, 29], [40], [9, 10, 11]]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def draft(
    request: pytest.FixtureRequest, llama_pair: tuple[Path, Path], gpt2_pair: tuple[Path, Path]
) -> models.LoadedModel:
    pair = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    return models.load_causal_lm(pair[1])


def greedy_oracle(draft: models.LoadedModel, tokens: list[int], gamma: int) -> list[int]:
    """The draft's greedy chain, each token from a fresh forward of the whole prefix."""
    out: list[int] = []
    for _ in range(gamma):
        logits = models.forward(draft, [*tokens, *out], models.new_cache(draft))[-1]
        out.append(int(torch.argmax(logits)))
    return out


class Session:
    """One session drafted by two proposers: batched and alone."""

    def __init__(
        self,
        proposers: tuple[Proposer, Proposer],
        prompt: list[int],
        params: SamplingParams,
        gamma: int,
    ) -> None:
        self.states = [p.new_state(prompt, params, gamma) for p in proposers]
        self.seq, self.verdict = 0, (0, ())

    def jobs(self) -> list[DraftJob]:
        accepted, appended = self.verdict
        return [DraftJob(b"s%d" % id(self), self.seq, s, accepted, appended) for s in self.states]

    def next_verdict(self, proposal: Proposal, rng: random.Random) -> None:
        self.seq += 1
        self.verdict = (rng.randint(0, len(proposal.tokens)), (rng.randint(3, 60),))


def run_rounds(
    proposers: tuple[Proposer, Proposer], sessions: list[Session], rounds: int, rng: random.Random
) -> list[tuple[Session, Proposal, Proposal]]:
    """Each round a random subset of sessions has a job (joining, pausing, leaving)."""
    batched, alone = proposers
    seen = []
    for _ in range(rounds):
        active = [s for s in sessions if rng.random() < 0.7]
        if not active:
            continue
        jobs = [s.jobs() for s in active]
        together = batched.propose([j[0] for j in jobs])
        apart = [alone.propose([j[1]])[0] for j in jobs]
        for session, a, b in zip(active, together, apart, strict=True):
            assert isinstance(a, Proposal) and isinstance(b, Proposal), (a, b)
            seen.append((session, a, b))
            session.next_verdict(a, rng)
    return seen


def test_greedy_batched_drafts_equal_drafts_alone_and_the_oracle(draft: models.LoadedModel) -> None:
    """Catches a row reading another row's logits, a wrong position or mask for a ragged row,
    a verdict applied to the wrong cache columns, and a session that joins or leaves a batch
    disturbing the others (sessions come and go at random; gammas differ)."""
    proposers = (LlmProposer(draft), LlmProposer(draft))
    rng = random.Random(0)
    sessions = [
        Session(proposers, p, SamplingParams(), gamma)
        for p, gamma in zip(PROMPTS, [4, 1, 3, 5, 2], strict=True)
    ]
    seen = run_rounds(proposers, sessions, 8, rng)
    assert len(seen) > 20
    for _session, together, apart in seen:
        assert together.tokens.tolist() == apart.tokens.tolist()
    for session in sessions:  # the oracle for each session's last proposal
        state = session.states[0]
        expected = greedy_oracle(draft, state.tokens, len(state.proposed))
        assert state.proposed == expected


def test_sampled_rows_draw_with_their_own_generator(draft: models.LoadedModel) -> None:
    """Catches a batch that shares randomness between sessions or draws from another row's q:
    a seeded session's tokens and q rows must not depend on who shares its batch."""
    proposers = (LlmProposer(draft), LlmProposer(draft))
    params = [
        SamplingParams(0.7, seed=1),
        SamplingParams(1.0, top_k=5, seed=2),
        SamplingParams(0.9, top_p=0.8, seed=3),
        SamplingParams(),
        SamplingParams(seed=4),
    ]
    sessions = [Session(proposers, p, sp, 3) for p, sp in zip(PROMPTS, params, strict=True)]
    for _session, together, apart in run_rounds(proposers, sessions, 6, random.Random(1)):
        assert together.tokens.tolist() == apart.tokens.tolist()
        for field in ("q_probs", "q_support"):
            a, b = getattr(together, field), getattr(apart, field)
            assert (a is None) == (b is None)
            if a is not None:
                # float32 rounding differs with the batch's shape (padding columns): ~1e-6
                np.testing.assert_allclose(a, b, atol=1e-5)


def test_sampled_tokens_follow_the_drafts_own_distribution(draft: models.LoadedModel) -> None:
    """Chi-square of the first draft token of 1600 seeded sessions, drafted 64 to a batch,
    against the draft's distribution from a plain forward. Two prompts alternate within each
    batch, so a row that draws from another row's logits fails (p < 1e-20 when rows are
    reversed), as does q computed from the wrong position."""
    proposer = LlmProposer(draft)
    prompts, params = (PROMPTS[0], PROMPTS[2]), SamplingParams(1.0, top_k=8)
    jobs = [
        DraftJob(
            b"%d" % i,
            0,
            proposer.new_state(prompts[i % 2], SamplingParams(1.0, top_k=8, seed=i), 1),
            0,
            (),
        )
        for i in range(1600)
    ]
    counts: list[Counter] = [Counter(), Counter()]
    for start in range(0, len(jobs), 64):
        for i, result in enumerate(proposer.propose(jobs[start : start + 64]), start):
            assert isinstance(result, Proposal)
            counts[i % 2][int(result.tokens[0])] += 1
    for prompt, seen in zip(prompts, counts, strict=True):
        logits = models.forward(draft, prompt, models.new_cache(draft))[-1]
        q = sampling.probs_from_logits(logits[None], params)[0]
        support = torch.nonzero(q).flatten().tolist()
        assert set(seen) <= set(support)
        expected = np.array([float(q[t]) for t in support])
        expected *= 800 / expected.sum()  # absorb float32 rounding of the total
        assert stats.chisquare([seen[t] for t in support], expected).pvalue > 1e-3


def test_a_failing_session_costs_only_its_own_job(draft: models.LoadedModel) -> None:
    """Catches one session's error failing its whole batch: a full context gets CONTEXT_FULL,
    a session whose cache is broken gets INTERNAL, and the others their usual proposals."""
    proposer = LlmProposer(draft)
    limit = draft.max_positions or 256
    full = proposer.new_state(list(range(3, 3 + limit)), SamplingParams(), 4)
    broken = proposer.new_state(PROMPTS[0], SamplingParams(), 4)
    good = [proposer.new_state(p, SamplingParams(), 4) for p in PROMPTS[1:3]]
    proposer.propose([DraftJob(b"b", 0, broken, 0, ())])  # give it a cache, then break it
    assert broken.cache.kv is not None
    broken.cache.kv = torch.cat([broken.cache.kv, broken.cache.kv[..., :1]], -1)  # head size + 1
    jobs = [
        DraftJob(b"f", 0, full, 0, ()),
        DraftJob(b"b", 1, broken, 0, (7,)),
        *[DraftJob(b"g%d" % i, 0, s, 0, ()) for i, s in enumerate(good)],
    ]
    results = proposer.propose(jobs)
    assert isinstance(results[0], Error) and results[0].code == ErrorCode.CONTEXT_FULL
    assert isinstance(results[1], Error) and results[1].code == ErrorCode.INTERNAL
    for state, result in zip(good, results[2:], strict=True):
        assert isinstance(result, Proposal)
        assert result.tokens.tolist() == greedy_oracle(draft, state.tokens, 4)


def test_a_sessions_cache_stays_compact_and_bounded(draft: models.LoadedModel) -> None:
    """Catches a session cache that keeps a view of the whole batch buffer (memory of every
    batch it was in) or that grows with rejected drafts: after each round it holds its committed
    tokens plus gamma - 1 drafted ones, in memory of its own."""
    proposer = LlmProposer(draft)
    states = [proposer.new_state(p, SamplingParams(), 4) for p in PROMPTS]
    rng = random.Random(2)
    verdicts = [(0, ())] * len(states)
    for seq in range(5):
        jobs = [DraftJob(b"%d" % i, seq, s, *verdicts[i]) for i, s in enumerate(states)]
        proposer.propose(jobs)
        verdicts = [(rng.randint(0, 4), (rng.randint(3, 60),)) for _ in states]
        for state in states:
            assert state.cache.length == len(state.tokens) + 3
            kv = state.cache.kv  # [layers, 2, heads, T, d]
            assert kv is not None and kv.untyped_storage().nbytes() == kv.nbytes


# ---------------------------------------------------------------------------------- EAGLE


@pytest.fixture(scope="module")
def head(
    llama_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> eagle.LoadedEagle:
    target_dir = llama_pair[0]
    head_dir = write_head(
        tmp_path_factory.mktemp("eagle-batch"), target_dir, eagle_state(target_dir)
    )
    return eagle.load_eagle_head(head_dir, target_dir)


def eagle_oracle(
    head: eagle.LoadedEagle, tokens: list[int], features: torch.Tensor, proposal: list[int]
) -> torch.Tensor:
    """The head's draft logits [gamma, V] along ``proposal``, with its single-sequence path
    (EagleCache) fed every real pair from scratch."""
    cache = head.new_cache()
    feature = head.forward(tokens[1:], features, cache)[-1]  # [H]
    rows = []
    for i, token in enumerate(proposal):
        rows.append(head.logits(feature[None])[0])
        if i < len(proposal) - 1:
            feature = head.forward([token], feature[None], cache)[-1]
    return torch.stack(rows)


def test_eagle_batched_drafts_equal_the_single_sequence_head(head: eagle.LoadedEagle) -> None:
    """Catches per-row rotary positions, feature rows or real-pair counts mixed up in the
    batched EAGLE path, including rows with no pair yet and rows of different gammas:
    greedy rows must draft the oracle's argmax chain, sampled rows send the oracle's q."""
    proposer = EagleProposer(head, 256)
    rng = torch.Generator().manual_seed(0)
    width = head.config.hidden_size
    states: list[ChainState] = []
    features: list[torch.Tensor] = []
    jobs = []
    for i, (prompt, gamma) in enumerate(zip(PROMPTS, [4, 1, 3, 5, 2], strict=True)):
        params = SamplingParams(1.0, seed=i) if i % 2 else SamplingParams()
        states.append(proposer.new_state(prompt, params, gamma))
        features.append(torch.randn(len(prompt) - 1, width, generator=rng).half().float())
        jobs.append(DraftJob(b"%d" % i, 0, states[-1], 0, (), features=features[-1].numpy()))
    for _round in range(3):
        results = proposer.propose(jobs)
        jobs = []
        for i, (state, result) in enumerate(zip(states, results, strict=True)):
            assert isinstance(result, Proposal)
            _check_eagle(head, state, features[i], result)
            accepted = min(1, len(result.tokens))
            new = torch.randn(accepted + 1, width, generator=rng).half().float()
            features[i] = torch.cat([features[i], new])
            jobs.append(
                DraftJob(b"%d" % i, _round + 1, state, accepted, (7,), features=new.numpy())
            )


def _check_eagle(
    head: eagle.LoadedEagle, state: ChainState, features: torch.Tensor, result: Proposal
) -> None:
    proposal = result.tokens.tolist()
    if len(state.tokens) == 1:  # nothing to extrapolate from yet
        assert proposal == []
        return
    logits = eagle_oracle(head, state.tokens, features, proposal)
    if state.params.greedy:
        assert proposal == logits.argmax(-1).tolist()
    else:
        q = sampling.probs_from_logits(logits, state.params)
        torch.testing.assert_close(torch.from_numpy(result.q_probs), q, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_batch_below_one_is_refused_at_start(value: str, capsys: pytest.CaptureFixture) -> None:
    """Catches a hub that starts with a batch size that would never take a job."""
    from starsd.hub.__main__ import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--max-batch", value])
    assert exited.value.code == 2
    assert f"--max-batch must be at least 1, got {value}" in capsys.readouterr().err


def test_the_hub_drafts_with_its_pairs_default_drafter_unless_told() -> None:
    """Catches a hub whose defaults ignore the pair's default drafter (the real pair's EAGLE-3
    head, 1.10x against its draft LLM's 0.98x through one hub), a --model alone taken for
    anything but a draft LLM (every script that names a draft directory relies on it), an
    EAGLE head started without its target, and a model-less kind (null) left without the
    tokenizer it reads."""
    from starsd.hub.__main__ import parse_args

    real = parse_args([])
    assert real.draft_kind == "eagle3" and real.model.endswith("smollm2-eagle3")
    assert real.target is not None and real.target.endswith("smollm2-135m-instruct")
    assert parse_args(["--pair", "toy"]).model.endswith("starsd-draft")
    named = parse_args(["--model", "models/smollm2-draft"])
    assert (named.draft_kind, named.target) == ("llm", None)
    assert parse_args(["--draft-kind", "llm"]).model.endswith("smollm2-draft")
    assert models.default_drafter("toy", "null", None) == ("null", str(models.TOY_DRAFT_DIR))
