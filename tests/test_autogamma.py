"""--gamma auto through a real hub (in process, loopback): OPEN rules, gamma 0 on the wire, the
target's spans alone staying lossless, the stats line, and the command line.

Each test names the bug it catches.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from conftest import PROMPT, RawTarget
from test_eagle import eagle_state, write_head
from test_hub import _greedy_reference

from edge.backends.torch import TorchBackend
from edge.batcher import Batcher
from edge.client import HubClient
from edge.handshake import TargetInfo
from edge.speculate import generate_speculative
from edge.verifier import TargetSequence
from starsd import analytic, models, transport
from starsd import hub as hub_module
from starsd.hub.drafters.base import (
    ChainState,
    DraftJob,
    commit_verdict,
    make_proposal,
    new_chain_state,
)
from starsd.hub.engine import DraftingEngine
from starsd.hub.pacing import Pacer
from starsd.hub.policy import GammaPolicy, Load, Pending, PolicyParams, SessionPacing
from starsd.hub.scheduler import FairQueue
from starsd.hub.sessions import Limits, Session, SessionTable
from starsd.protocol import Draft, Error, Open, Opened, Proposal, SamplingParams
from starsd.stats import HubStats


@contextlib.asynccontextmanager
async def serving(
    config: hub_module.HubConfig, policy: GammaPolicy | None = None
) -> AsyncIterator[hub_module.Hub]:
    hub = hub_module.build_hub(config)
    if policy is not None:
        hub.pacer.policy = policy
    ctx = transport.new_context()
    task = asyncio.create_task(hub.serve(ctx))
    while not hub.endpoint:
        await asyncio.sleep(0.01)
    try:
        yield hub
    finally:
        hub.stop()
        await asyncio.wait_for(task, 10)
        ctx.term()


def _config(model: Path, **kw: object) -> hub_module.HubConfig:
    return hub_module.HubConfig(
        model=str(model), bind="tcp://127.0.0.1:*", stats_interval=3600, **kw
    )  # type: ignore[arg-type]


class Alternating(GammaPolicy):
    """Drafts and decodes alone by turns, whatever the estimate says: every round of a
    session alone follows a verdict, held, and a probe after it must merge it back."""

    CYCLE = (4, 0, 2, 0, 1, 0, 3, 0, 0)

    def __init__(self, span: int = 3) -> None:
        super().__init__(PolicyParams(max_gamma=16, alone_tokens=span, max_alone=span))
        self.turn: dict[int, int] = {}

    def next_round(self, s: SessionPacing, load: Load | None, probe: bool = False) -> int:
        turn = self.turn.get(id(s), 0)
        self.turn[id(s)] = turn + 1
        s.chosen = self.CYCLE[turn % len(self.CYCLE)]
        return s.chosen


async def _decode(
    endpoint: str,
    target: models.LoadedModel,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    features: bool = False,
) -> list[TargetSequence]:
    ctx = transport.new_context()
    width = models.hidden_size(target) if features else 0
    client = HubClient(
        ctx, endpoint, TargetInfo("t", target.vocab_size, target.tokenizer_fingerprint, width)
    )
    await client.connect()
    backend = TorchBackend(target)
    seqs = [TargetSequence(backend, p, params, n, taps=(-1,) if features else ()) for p in prompts]
    try:
        async with Batcher(backend) as batcher:  # gamma 0: the hub's choice
            await asyncio.gather(*(generate_speculative(client, s, 0, batcher) for s in seqs))
    finally:
        await client.aclose()
        ctx.term()
    return seqs


PROMPTS = [[5, 17, 33, 8], [1], list(range(40, 60))]


async def test_spans_alone_between_drafts_stay_lossless(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Catches a held verdict lost or applied twice when a span alone ends (the draft would
    continue from the wrong prefix: no effect on the output, but rounds would then reject
    nearly everything, and the hub's tokens would differ from the target's), a target that
    ignores ``alone`` or counts its span wrong (the output would differ from generate())."""
    async with serving(_config(llama_pair[1]), Alternating()) as hub:
        seqs = await _decode(hub.endpoint, llama_target, PROMPTS, 40, SamplingParams())
        with hub.lock:
            (peer,) = hub.table.peers.values()
            line = peer.stats.line()
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        assert seq.generated == _greedy_reference(llama_target, prompt, 40)
        assert seq.stats.alone_steps > 0 and seq.stats.standalone_steps == 0
    assert sum(s.stats.accepted for s in seqs) > 0 and sum(s.stats.rounds for s in seqs) > 6
    assert peer.stats.alone_rounds > 0 and "gamma0=0.000" not in line


async def test_a_targets_drafts_tell_the_hub_its_forward_times(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Catches the target's own times lost on the way (not measured, not sent, or not put on
    the job the pacer learns from): its verifications and spans alone must reach the hub as
    the time of the forwards that carried them."""
    async with serving(_config(llama_pair[1]), Alternating()) as hub:
        learn, seen = hub.pacer._learn, []

        def record(job: DraftJob, pacing: SessionPacing, now: float) -> None:
            seen.append((job.proposed, len(job.appended), job.forward_s, job.others_s))
            learn(job, pacing, now)

        hub.pacer._learn = record  # type: ignore[method-assign]
        await _decode(hub.endpoint, llama_target, PROMPTS, 24, SamplingParams())
    verdicts = [s for s in seen if s[1] > 0]  # (the OPEN's job answers nothing)
    assert any(p > 0 for p, *_ in verdicts) and any(p == 0 for p, *_ in verdicts)
    assert all(0 < forward < 5 and 0 <= others < 5 for _, _, forward, others in verdicts)


# a torch tensor viewing the message's read-only features warns (and writing it is undefined)
@pytest.mark.filterwarnings("error:The given NumPy array is not writable")
async def test_spans_alone_with_eagle_carry_their_features(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel, tmp_path: Path
) -> None:
    """Catches feature rows of a span alone merged more than once or in the wrong shape: the
    EAGLE proposer refuses rows beyond its uncached tokens, so the session fails with INTERNAL
    and is re-opened (the output alone would not show it). Rows lost or out of order only
    make drafts worse: test_held_verdict_and_spans_reach_the_proposer_once_in_order."""
    head = write_head(tmp_path / "head", llama_pair[0], eagle_state(llama_pair[0]))
    config = _config(head, draft_kind="eagle", target=str(llama_pair[0]))
    async with serving(config, Alternating()) as hub:
        seqs = await _decode(
            hub.endpoint, llama_target, PROMPTS[:2], 30, SamplingParams(), features=True
        )
        with hub.lock:
            (peer,) = hub.table.peers.values()
            assert hub.stats.errors_sent == 0 and peer.stats.sessions == len(seqs)  # no re-open
    for prompt, seq in zip(PROMPTS, seqs, strict=False):
        assert seq.generated == _greedy_reference(llama_target, prompt, 30)
        assert seq.stats.alone_steps > 0 and seq.stats.standalone_steps == 0
        assert seq.stats.rounds > 3


async def test_gamma_0_hub_eos_inside_a_span_stops_exactly(llama_pair: tuple[Path, Path]) -> None:
    """Catches a span alone that runs past EOS (or stops short of it): every token here is
    decoded alone, in spans of 5, and the EOS falls in the middle of one."""
    target = models.load_causal_lm(llama_pair[0])
    prompt = [5, 17, 33, 8]
    eos = _greedy_reference(target, prompt, 30)[12]
    target = models.LoadedModel(**{**target.__dict__, "eos_token_ids": frozenset({eos})})
    expected = _greedy_reference(target, prompt, 30)
    assert expected[-1] == eos and len(expected) % 5 not in (0, 1)  # not a span's edge
    spans = GammaPolicy(PolicyParams(max_gamma=16, start_gamma=1, alone_tokens=5, max_alone=5))
    async with serving(_config(llama_pair[1], gamma=0), spans) as hub:
        (seq,) = await _decode(hub.endpoint, target, [prompt], 30, SamplingParams())
        with hub.lock:
            (peer,) = hub.table.peers.values()
            line = peer.stats.line()
    assert seq.generated == expected
    assert seq.stats.alone_steps == len(expected) and seq.stats.rounds == 0
    assert "gamma=0.00 gamma0=1.000" in line  # the stats line shows the choice


async def test_sampled_spans_alone_use_the_targets_own_generator(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Catches a sampled span alone that draws from anything but the target's own generator
    (a fresh one, the hub's seed): with every token decoded alone the output must equal the
    target alone with the same seed, draw for draw."""
    params = SamplingParams(temperature=0.9, top_k=50, seed=11)
    spans = GammaPolicy(PolicyParams(max_gamma=16, start_gamma=1, alone_tokens=7, max_alone=7))
    async with serving(_config(llama_pair[1], gamma=0), spans) as hub:
        (seq,) = await _decode(hub.endpoint, llama_target, [PROMPTS[0]], 30, params)
    alone = TargetSequence(TorchBackend(llama_target), PROMPTS[0], params, 30)
    while not alone.done:  # one forward per token, the target alone
        alone.step()
    assert seq.generated == alone.generated and seq.stats.alone_steps == 30


class Recorder:
    """A proposer that records the jobs it is given and proposes ``state.gamma`` tokens."""

    kind, feature_width, max_positions = "recorder", 0, None

    def __init__(self) -> None:
        self.jobs: list[tuple[int, int, tuple[int, ...], list[list[int]] | None]] = []

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> ChainState:
        return new_chain_state(prompt, params, gamma)

    def propose(self, jobs: list[DraftJob]) -> list[Proposal | Error]:
        for job in jobs:
            rows = None if job.features is None else job.features[:, 0].tolist()
            self.jobs.append((job.seq, job.accepted, job.appended, rows))
            commit_verdict(job.state, job.accepted, job.appended)
            job.state.proposed = [1] * job.state.gamma
        return [make_proposal(job, job.state.proposed, [], job.state.params) for job in jobs]


class Scripted(GammaPolicy):
    def __init__(self, gammas: list[int]) -> None:
        super().__init__(PolicyParams(max_gamma=8, alone_tokens=4, max_alone=4))
        self.gammas = gammas

    def next_round(self, s: SessionPacing, load: Load | None, probe: bool = False) -> int:
        s.chosen = self.gammas.pop(0)
        return s.chosen


class Rounds:
    """Drafting rounds by hand: a :class:`DraftingEngine` over a session table, no sockets and
    no thread; each job is served as its own batch by ``serve`` (the engine's round)."""

    def __init__(
        self,
        proposer: object,
        policy: GammaPolicy,
        predrafter: object = None,
        vocab: int = 100,
        max_positions: int | None = None,
    ) -> None:
        limits = Limits(
            max_sessions=8,
            max_sessions_per_target=8,
            default_gamma=4,
            max_gamma=8,
            lease_s=3.0,
            vocab_size=vocab,
            max_positions=max_positions,
            auto_gamma=True,
        )
        self.table, self.proposer = SessionTable(limits), proposer
        self.engine = DraftingEngine(
            proposer,
            Pacer(policy, max_positions),
            FairQueue(),  # type: ignore[arg-type]
            self.table,
            threading.Lock(),
            lambda *_: True,
            HubStats(),
            8,
            predrafter,
            gather=False,
        )  # type: ignore[arg-type]

    def open(self, owner: bytes = b"p", ref: int = 1, gamma: int = 0) -> Session:
        peer = self.table.peers.get(owner) or self.table.welcome(owner, owner, "t")
        assert peer is not None
        return self.table.open(
            peer, Open(ref, PROMPT, SamplingParams(), gamma), self.proposer.new_state
        )  # type: ignore[attr-defined]

    def job(
        self,
        session: Session,
        seq: int,
        accepted: int = 0,
        appended: tuple = (),
        features: np.ndarray | None = None,
    ) -> DraftJob:
        """The job the hub queues for this DRAFT (as Hub._enqueue builds it)."""
        return DraftJob(
            session.tag,
            seq,
            session.state,
            accepted,
            tuple(appended),
            features=features,
            proposed=session.last_gamma,
            owner=session.owner,
            auto=not session.gamma_fixed,
        )

    def serve(self, job: DraftJob) -> Proposal | Error:
        return self.engine.serve([job])[0]


def test_held_verdict_and_spans_reach_the_proposer_once_in_order() -> None:
    """Catches the glue around gamma 0: a held verdict lost, applied twice or with its
    accepted count reset; a span's tokens or feature rows dropped or out of order (EAGLE would
    draft from the wrong features); a proposer asked to draft gamma 0; a PROPOSAL for gamma 0
    with tokens or without ``alone``."""
    inner = Recorder()
    rounds = Rounds(inner, Scripted([2, 0, 0, 3]))
    session = rounds.open()

    def job(seq: int, accepted: int, appended: list[int], rows: list[int]) -> DraftJob:
        features = np.array([[r, 0.0] for r in rows], np.float16).reshape(-1, 2)
        return rounds.job(session, seq, accepted, tuple(appended), features)

    replies = [
        rounds.serve(j)
        for j in (
            job(0, 0, [], [0, 1, 2]),
            job(1, 1, [9], [3, 4]),
            job(2, 0, [10, 11, 12], [5, 6, 7]),
            job(3, 0, [13], [8]),
        )
    ]
    assert [len(r.tokens) for r in replies if isinstance(r, Proposal)] == [2, 0, 0, 3]
    assert [r.alone for r in replies if isinstance(r, Proposal)] == [0, 4, 4, 0]
    assert inner.jobs == [(0, 0, (), [0, 1, 2]), (3, 1, (9, 10, 11, 12, 13), [3, 4, 5, 6, 7, 8])]
    assert session.state.tokens == [*PROMPT.tolist(), 1, 9, 10, 11, 12, 13]
    assert session.state.pacing is not None and session.state.pacing.pending is None


def test_a_targets_auto_sessions_share_its_figures() -> None:
    """Catches the glue of the shared figures: a target's new auto session starting from the
    prior (ignoring what its other sessions learnt), holding a copy instead of the target's
    figures (its verdicts then teach the others nothing, and they decide apart), another
    target's session joining them, or a fixed session (whose estimate never learns) taking
    the place of the target's figures."""
    rounds = Rounds(Recorder(), GammaPolicy(PolicyParams(max_gamma=8)))

    def first_job(owner: bytes, ref: int, gamma: int = 0) -> SessionPacing:
        session = rounds.open(owner, ref, gamma)
        rounds.serve(rounds.job(session, 0))
        assert isinstance(session.state.pacing, SessionPacing)
        return session.state.pacing

    old = first_job(b"p", 1)
    for _ in range(60):
        old.estimate.observe(8, 8)
    inherited, other, fixed = first_job(b"p", 2), first_job(b"q", 3), first_job(b"p", 4, gamma=3)
    assert inherited.shared is old.shared and inherited.estimate.alphas()[0] > 0.9
    assert other.shared is not old.shared
    assert other.estimate.alphas()[0] == pytest.approx(0.6)
    assert fixed.fixed == 3 and fixed.shared is not old.shared
    assert rounds.engine.pacer.owners.get(b"p") is old.shared


async def _rounds(
    raw: RawTarget,
    tag: bytes,
    first: Proposal,
    rounds: int,
) -> tuple[list[Proposal], list[int]]:
    """Reject every draft for ``rounds`` rounds (answering a span alone with its tokens);
    returns the proposals and every token committed."""
    proposals, committed, proposal = [first], [], first
    for seq in range(1, rounds + 1):
        appended = [7 + seq % 5] * (proposal.alone if proposal.alone else 1)
        committed += appended
        await raw.send(Draft(tag, seq, 0, np.array(appended, np.int32)))
        proposal = await raw.recv()
        assert isinstance(proposal, Proposal) and proposal.seq == seq, proposal
        proposals.append(proposal)
    return proposals, committed


async def test_open_with_a_gamma_keeps_it_and_open_0_gets_the_policy(
    llama_pair: tuple[Path, Path],
    llama_target: models.LoadedModel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Catches --gamma auto overriding a gamma the OPEN named (all its drafts are rejected,
    which would switch an auto session off), an auto session that never switches off when
    nothing is accepted, an empty proposal without ``alone``, a held verdict not merged back
    (the hub's tokens would miss the span), and a stats line without the choice."""
    # The default policy but for short spans alone: 20 rounds of doubling spans from 16 would
    # fill the tiny draft's 256 positions (CONTEXT_FULL, rightly).
    short_spans = GammaPolicy(PolicyParams(alone_tokens=4, max_alone=8))
    async with serving(_config(llama_pair[1]), short_spans) as hub:
        fixed, auto = RawTarget(hub.endpoint), RawTarget(hub.endpoint)
        try:
            assert (await fixed.hello(llama_target)).default_gamma == 4
            await auto.hello(llama_target)
            await fixed.send(Open(1, PROMPT, SamplingParams(), 3))
            await auto.send(Open(1, PROMPT, SamplingParams(), 0))
            (f_opened, f_first), (a_opened, a_first) = [
                (await t.recv(), await t.recv()) for t in (fixed, auto)
            ]
            assert isinstance(f_opened, Opened) and isinstance(a_opened, Opened)
            assert isinstance(f_first, Proposal) and isinstance(a_first, Proposal)
            f_props, _ = await _rounds(fixed, f_opened.tag, f_first, 12)
            a_props, committed = await _rounds(auto, a_opened.tag, a_first, 20)
            with hub.lock:
                tokens = list(hub.sessions[a_opened.tag].state.tokens)
                lines = {p.routing_id: p.stats.line() for p in hub.table.peers.values()}
            with caplog.at_level(logging.INFO, logger="starsd.hub"):
                hub._log_stats()
        finally:
            fixed.close()
            auto.close()
    assert [len(p.tokens) for p in f_props] == [3] * 13 and not any(p.alone for p in f_props)
    assert len(a_first.tokens) == 4  # the starting gamma, before any data
    spans = [i for i, p in enumerate(a_props) if p.alone]
    assert spans, [len(p.tokens) for p in a_props]
    assert all(len(a_props[i].tokens) == 0 for i in spans)
    assert all(len(a_props[i + 1].tokens) >= 1 for i in spans if i + 1 < len(a_props))  # probe
    last_drafted = max(i for i, p in enumerate(a_props) if len(p.tokens))
    expected = PROMPT.tolist() + committed[: sum(p.alone or 1 for p in a_props[:last_drafted])]
    assert tokens == expected  # every span's tokens reached the draft state, once
    fixed_line, auto_line = sorted(lines.values(), key=lambda line: "gamma=3.00" not in line)
    assert "gamma=3.00 gamma0=0.000" in fixed_line
    assert "gamma0=0.000" not in auto_line
    assert "gamma=3.00 gamma0=0.000" in caplog.text  # the periodic stats line


def test_gamma_outside_its_range_or_not_auto_is_refused_at_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches --gamma accepted outside 0..--max-gamma or as any word but auto (the hub would
    start and refuse, or crash on, every OPEN), and auto no longer the default."""
    from starsd.hub.__main__ import parse_args

    assert parse_args([]).gamma == "auto" and parse_args([]).default_gamma == 4
    assert parse_args(["--gamma", "0"]).gamma == 0
    assert parse_args(["--gamma", "8", "--max-gamma", "8"]).gamma == 8
    assert parse_args(["--gamma", "auto", "--max-gamma", "2"]).default_gamma == 2
    for argv in (
        ["--gamma", "17"],
        ["--gamma", "-1"],
        ["--gamma", "fast"],
        ["--gamma", "4.5"],
        ["--gamma", "9", "--max-gamma", "8"],
        ["--max-gamma", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2, argv
    assert "--gamma must be auto or in 0..16" in capsys.readouterr().err
    for bad in (17, -1, "fast", True):
        with pytest.raises(ValueError):
            hub_module.HubConfig(model="m", gamma=bad)  # type: ignore[arg-type]


def _predrafting_side(
    draft: models.LoadedModel, gammas: list[int], predrafting: bool
) -> tuple[Rounds, Session, object]:
    """One auto session whose policy says ``gammas`` in turn (spans alone of one token), over
    a draft LLM proposer, with or without a pre-drafter: (rounds, session, pre-drafter)."""
    from starsd.hub.drafters.llm import LlmProposer
    from starsd.hub.predraft import Predrafter

    inner = LlmProposer(draft)
    policy = Scripted(list(gammas))
    policy.params = PolicyParams(max_gamma=8, alone_tokens=1, max_alone=1)
    pre = Predrafter(inner, branches=4) if predrafting else None
    rounds = Rounds(inner, policy, pre, draft.vocab_size, draft.max_positions)
    return rounds, rounds.open(), pre


def test_pre_drafting_follows_the_policy_and_never_answers_a_held_verdict(
    llama_pair: tuple[Path, Path],
) -> None:
    """Catches pre-drafting and --gamma auto stepping on each other, through the engine's round
    with the idle steps run by hand: a branch answering a round the policy gave a longer gamma
    than its own (or gamma 0), a session offered while its verdict is held (a 1-token span
    would then match a branch of the old proposal and commit the wrong verdict), and a hit the
    table does not count as the proposal out (the policy learns from the next verdict by it).
    The same session drafted without a pre-drafter must get the same proposal every round."""
    # drafted, hit, hit at a shorter gamma (the branch's first tokens), alone, probe, hit, hit
    gammas = [3, 3, 2, 0, 2, 2, 2]
    draft = models.load_causal_lm(llama_pair[1])
    sides = [_predrafting_side(draft, gammas, predrafting) for predrafting in (True, False)]

    def answer(side: tuple, seq: int, verdict: tuple) -> tuple[Proposal, bool]:
        rounds, session, pre = side
        before = _hits(rounds)
        reply = rounds.serve(rounds.job(session, seq, *verdict))
        assert isinstance(reply, Proposal), reply
        while pre is not None and pre.has_work():
            pre.step()
        return reply, _hits(rounds) > before

    def branch_keys() -> list[tuple[int, int]]:
        _, session, pre = sides[0]
        waiting = pre.waiting.get(session.tag)
        return sorted(waiting.branches) if waiting is not None else []

    verdict: tuple[int, tuple[int, ...]] = (0, ())
    hits, seen_alone = [], False
    for seq in range(len(gammas)):
        held_keys = branch_keys()  # the branches of the proposal this verdict answers
        (a, hit), (b, _) = [answer(side, seq, verdict) for side in sides]
        assert a.tokens.tolist() == b.tokens.tolist() and a.alone == b.alone, seq
        hits.append(hit)
        if hit:  # the table counts the hit as the proposal out: the next verdict answers it
            assert sides[0][1].last_gamma == len(a.tokens)
        if a.alone:  # the span: a token a branch of the held proposal was drafted for
            assert sides[0][1].tag not in sides[0][2].waiting  # not even its probe
            seen_alone = True
            verdict = (0, (next(c for k, c in held_keys if k == 0),))
        else:  # a verdict a branch was drafted for
            k, c = branch_keys()[-1]
            verdict = (min(k, len(a.tokens)), (c,))
    assert seen_alone and hits == [False, True, True, False, False, True, True]
    assert sides[0][1].state.tokens == sides[1][1].state.tokens
    pacing = sides[0][1].state.pacing
    assert pacing is not None and sides[0][1].last_gamma == 2 and pacing.pending is None


def _hits(rounds: Rounds) -> int:
    peer = next(iter(rounds.table.peers.values()))
    return peer.stats.predraft_hits


def test_a_probes_round_trip_at_a_batching_target_teaches_acceptance_only() -> None:
    """Catches probes feeding R(g) at a target with other sessions open: a probe's
    verification rides in a forward of the others' steps, far cheaper than a round in which
    they all draft, so its short round trip made drafting look ahead and switched every session
    of a batching target back and forth (--concurrency 4: 113 rounds at 0.33 accepted, 0.83x
    alone); and a lone session's probe left out (its round trip is a plain round's)."""
    pacer = Pacer(GammaPolicy(PolicyParams(max_gamma=8)), None)
    state = new_chain_state(list(PROMPT), SamplingParams(), 4)

    def verdict(at: float) -> DraftJob:
        return DraftJob(b"s", 1, state, 0, (5,), enqueued_at=at, proposed=1, owner=b"p", auto=True)

    pacing = pacer.pacing_of(verdict(0.0))
    pacing.probing, pacing.sent_at = True, 0.0
    pacer._learn(verdict(0.010), pacing, 0.010)  # alone at its target: a plain round
    assert pacing.estimate.rounds == 1 and pacing.round_trip.w == pytest.approx(1.0)
    sibling = pacer.policy.new_session(None, like=pacing.shared)
    pacer._learn(verdict(0.010), pacing, 0.010)  # beside a sibling: acceptance only
    assert pacing.estimate.rounds == 2 and pacing.round_trip.w == pytest.approx(1.0)
    pacing.probing = False
    pacer._learn(verdict(0.010), pacing, 0.010)
    assert pacing.estimate.rounds == 3 and pacing.round_trip.w > 1.0
    del sibling
    assert not pacing.shared.batched(pacing)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_fixed_gamma_session_drafts_chains_under_tree_auto(mode: str) -> None:
    """Catches --tree auto drafting trees for a session whose target fixed its gamma (a shape
    chosen by timing changed a seeded sampled output from run to run; the chooser's second
    phase tries trees); --tree on still drafts its trees there (the operator's choice)."""
    from starsd.hub.pacing import TreePlan
    from starsd.tree_shapes import TreeShape

    pacer = Pacer(GammaPolicy(), None, trees=TreePlan(mode, (TreeShape(2, 4, 8),)))
    state = new_chain_state(list(PROMPT), SamplingParams(), 4)
    shapes = set()
    for i in range(200):
        job = DraftJob(b"s", i, state, 0, (5,), enqueued_at=0.01 * i, proposed=4, tree_nodes=8)
        pacer.plan(job, None, 0.01 * i)
        shapes.add(state.tree)
    assert shapes == ({TreeShape(2, 4, 8)} if mode == "on" else {None})


def test_the_pacer_votes_each_sessions_best_not_its_choice() -> None:
    """Catches the common gamma fed the choices: a session that follows its batch's common
    gamma while its figures say the batch should draft longer would vote for the common gamma,
    and a batch kept from moving up one session at a time could never move up at all."""
    pacer = Pacer(GammaPolicy(PolicyParams(max_gamma=8, hysteresis=0.0)), None)
    state = new_chain_state(list(PROMPT), SamplingParams(), 4)
    job = DraftJob(b"s", 1, state, 0, (5,), enqueued_at=0.0, proposed=0, owner=b"p", auto=True)
    pacing = pacer.pacing_of(job)
    pacing.explored, pacing.chosen = True, 2
    for _ in range(50):
        pacing.estimate.observe(8, 8)  # every draft accepted
        pacing.round_trip.observe(8, 0.020)
    votes: list[int] = []
    pacer.common.vote = votes.append  # type: ignore[method-assign]
    costs = [0.0, *(0.002 + 0.001 * g for g in range(8))]
    plan = pacer.policy.next_round(pacing, Load(8, False, costs, common=2))
    assert plan == 2 and pacing.vote == 8  # it follows its batch, and votes for 8
    pacer.plan(job, Load(8, False, costs, common=2), 0.0)
    assert votes == [8]


def test_the_targets_other_forwards_are_left_out_of_its_round_trip_and_its_span_alone() -> None:
    """Catches the target's forwards that did not carry the session priced as its gamma's
    cost (Draft.others_us ignored). Other sequences' prefills stall the rounds they overlap,
    alone or drafting alike, but a span alone is timed rarely, so the stalls landed in R(g)
    only and one target at --concurrency 8 decoded half its tokens alone (0.93x the target
    alone, gamma 1 1.06x); rows out of step doubled a round, and the sessions went alone."""
    pacer = Pacer(GammaPolicy(PolicyParams(max_gamma=8)), None)
    state = new_chain_state(list(PROMPT), SamplingParams(), 4)

    def verdict(at: float, others_s: float, appended: tuple = (5,), proposed: int = 2) -> DraftJob:
        return DraftJob(
            b"s", 1, state, 0, appended, at, proposed=proposed, owner=b"p", auto=True,
            others_s=others_s,
        )  # fmt: skip

    pacing = pacer.pacing_of(verdict(0.0, 0.0))
    pacing.sent_at = 0.0
    pacer._learn(verdict(0.300, 0.150), pacing, 0.300)
    fit = pacing.round_trip
    assert fit.sy / fit.w == pytest.approx(0.150)
    pacing.pending, pacing.sent_at = Pending(0, [7]), 1.0  # then a span of 4 tokens alone
    pacer._learn(verdict(1.0 + 4 * 0.100 + 0.200, 0.200, (1, 2, 3, 4), 0), pacing, 1.6)
    assert pacing.alone_step == pytest.approx(0.100)


def test_the_targets_forwards_set_the_round_trips_line() -> None:
    """Catches R(g) read from round trips alone (Draft.forward_us ignored): rounds at one gamma
    tell no slope and a stream's queues drown it, so a verify that costs 12 ms more per draft
    token looked free and auto drafted gamma 3-8 where 2 was best (one CPU target at
    --concurrency 8, 0.81-0.87x gamma 2); a slope taken from forwards that have not varied
    their gamma; and a round drafted beside longer proposals priced at their forward (it waits
    for it) instead of at its own gamma's, which sent the target's sessions alone."""
    policy = GammaPolicy(PolicyParams(max_gamma=8))
    s = policy.new_session(None)
    shared = s.shared
    for k in [0, 1] * 15:  # acceptance about one in two
        s.estimate.observe(4, k)
    for _ in range(6):
        shared.observe_round(4, 0.200, 0.0)  # every round at gamma 4, no forward reported
    s.alone_step = 0.300
    costs = [0.0] + [0.011 + 0.005 * g for g in range(8)]  # S(8, g)
    load = Load(batch=8, loaded=False, costs=costs)

    def fresh_choice() -> int:
        s.chosen = 0
        return policy.choose(s, load)

    assert shared.round_trip_line() == pytest.approx((0.200, 0.0))
    flat = fresh_choice()
    shared.observe_round(4, 0.200, 0.167)  # its forward: 33 ms of the round were outside it
    shared.forward.observe(4, 0.167)
    assert shared.round_trip_line()[1] == 0.0 and fresh_choice() == flat  # one gamma: no slope
    for _ in range(3):
        shared.forward.observe(0, 0.119)  # its steps alone
    r0, r1 = shared.round_trip_line()
    assert r1 == pytest.approx(0.012, rel=0.2) and r0 + 4 * r1 == pytest.approx(0.200, abs=0.005)
    assert 1 <= fresh_choice() < flat
    shared.observe_round(2, 0.400, 0.367)  # verified beside longer proposals: a long forward
    assert shared.round_trip_line() == pytest.approx((r0, r1))  # priced at its own gamma


def test_trees_are_tried_only_where_the_model_says_they_could_pay() -> None:
    """Catches trees tried whatever the target's verification costs (on a CPU target at
    --concurrency 8, ~12 ms a node on ~165 ms, 8-node trees read half the chains' rate and
    their trials took 10-18% of a stream's rounds), and a gate that keeps them from a target whose
    verification is flat (a GPU's), where their longer accepted path pays."""
    from starsd.hub.shapes import CHAIN, trees_worth_trying
    from starsd.tree_shapes import TreeShape

    expected = [analytic.expected_tokens_per_round(0.7, g) for g in range(9)]
    costs = [0.0] + [0.002 + 0.0005 * g for g in range(8)]
    trees = [TreeShape(2, 4, 8), TreeShape(2, 3, 4)]

    def flat(x: int) -> float:
        return 0.010

    def steep(x: int) -> float:
        return 0.165 + 0.012 * x

    assert trees_worth_trying(expected, 4, trees, costs, flat) >= {CHAIN, 1}
    assert CHAIN in trees_worth_trying(expected, 2, trees, costs, steep)
    assert 1 not in trees_worth_trying(expected, 2, trees, costs, steep)


def test_a_chain_beside_tree_rounds_is_left_out_of_the_round_trip() -> None:
    """Catches a chain drafted while the hub's sessions draft trees feeding R(g): its target
    may verify it beside their nodes, and those rounds priced every chain at a tree's cost
    (the target's sessions then went alone); its acceptance still counts, and a chain drafted
    in a chain phase feeds R as before. Also: a session whose target the model says trees do
    not pay for drafts its chain, outside the tree phase."""
    from starsd.hub.pacing import TreePlan
    from starsd.tree_shapes import TreeShape

    pacer = Pacer(GammaPolicy(PolicyParams(max_gamma=8)), None, trees=TreePlan("auto", ()))
    state = new_chain_state(list(PROMPT), SamplingParams(), 4)
    job = DraftJob(b"s", 1, state, 0, (5,), enqueued_at=0.2, proposed=2, owner=b"p", auto=True)
    pacing = pacer.pacing_of(job)
    pacing.sent_at, pacing.beside_trees = 0.0, True
    pacer._learn(job, pacing, 0.2)
    assert pacing.estimate.rounds == 1 and not pacing.round_trip.known
    pacing.beside_trees = False
    pacer._learn(job, pacing, 0.2)
    assert pacing.estimate.rounds == 2 and pacing.round_trip.known

    steep = Pacer(
        GammaPolicy(PolicyParams(max_gamma=8)), None, trees=TreePlan("auto", (TreeShape(2, 4, 8),))
    )
    steep.shapes.tried.add(0)  # chains measured: the next phase is the tree's trial
    pacing = steep.pacing_of(job)
    pacing.explored, pacing.alone_step, pacing.chosen = True, 0.200, 2
    for k in [0, 1] * 10:
        pacing.estimate.observe(4, k)
    for g in (0, 2, 4) * 4:
        pacing.shared.forward.observe(g, 0.165 + 0.012 * g)
        pacing.shared.observe_round(g or 1, 0.180 + 0.012 * g, 0.165 + 0.012 * g)
    costs = [0.0] + [0.011 + 0.005 * g for g in range(8)]
    asking = dataclasses.replace(job, tree_nodes=8)
    option, phase = steep._shape(asking, pacing, Load(8, False, costs), 1.0)
    assert (option, phase) == (0, 1) and steep.shapes.current == 0  # a chain phase, not a trial


@pytest.mark.parametrize("tree_nodes", [0, 8])
def test_a_new_target_warms_up_while_the_hub_is_in_a_tree_phase(tree_nodes: int) -> None:
    """Catches a chain counted as drafted beside trees because the hub's chooser was in a tree
    phase, though no session of its own target drafted one: a hub whose last settled sessions
    left in a tree phase froze every later auto target at its start gamma (its round trips
    never fed R, so it never settled, and the phase, which only settled sessions advance,
    never ended). A bench's --concurrency 8 stream ran at gamma 4 in one repeat and 3 in the
    other, 0.96x the target alone where gamma 2 made 1.15x; a target that verifies no trees
    at all (tree_nodes 0) froze the same way."""
    from starsd.hub.pacing import TreePlan
    from starsd.tree_shapes import TreeShape

    pacer = Pacer(
        GammaPolicy(PolicyParams(max_gamma=8)), None, trees=TreePlan("auto", (TreeShape(2, 4, 8),))
    )
    pacer.shapes.tried.add(0)
    pacer.shapes._next_phase(0.0)  # another target's sessions left the hub in a tree trial
    assert pacer.shapes.current == 1
    pacer.drafted(1, 4, 0.005)
    state = new_chain_state(list(PROMPT), SamplingParams(), 4)
    now, proposed, plans = 1.0, 0, []
    for _ in range(8):  # each round answered 0.2 s after its proposal left, one token appended
        job = DraftJob(
            b"s", len(plans), state, 0, (5,), enqueued_at=now, proposed=proposed, owner=b"q",
            auto=True, tree_nodes=tree_nodes,
        )  # fmt: skip
        plan = pacer.plan(pacer.with_held(job), pacer.load(1, False, now), now)
        pacer.sent(job, now)
        plans.append(plan)
        proposed, now = plan.gamma, now + 0.2
    assert state.pacing.round_trip.known
    assert any(plan.alone for plan in plans)  # warmed up: it timed its target's step alone


def test_a_targets_tree_gate_is_worked_out_once_a_phase() -> None:
    """Catches the model's tree gate worked out on every job of an auto session (~25 us each,
    on the drafting thread) or never again after its first (a target whose figures moved kept
    the old answer for good): within one ShapeChooser phase the target's answer stands, and
    the next phase asks anew."""
    from starsd.hub.pacing import TreePlan
    from starsd.tree_shapes import TreeShape

    pacer = Pacer(
        GammaPolicy(PolicyParams(max_gamma=8)), None, trees=TreePlan("auto", (TreeShape(2, 4, 8),))
    )
    state = new_chain_state(list(PROMPT), SamplingParams(), 4)
    job = DraftJob(b"s", 1, state, 0, (5,), enqueued_at=0.2, proposed=2, owner=b"p", auto=True)
    pacing = pacer.pacing_of(job)
    pacing.chosen = 2
    costs = [0.0] + [0.002 + 0.0005 * g for g in range(8)]
    for _ in range(20):
        pacing.estimate.observe(4, 4)  # every draft accepted: the tree pays on a flat R
        pacing.shared.observe_round(4, 0.010, 0.0)
    load = Load(8, False, costs)
    assert 1 in pacer._trees_worth(pacing, load, 8)
    for _ in range(40):  # then R grows ~0.1 s a node: no tree pays
        for g in (1, 4):
            pacing.shared.observe_round(g, 0.010 + 0.1 * g, 0.0)
    assert 1 in pacer._trees_worth(pacing, load, 8)  # the same phase: its answer stands
    pacer.shapes.phase += 1
    assert 1 not in pacer._trees_worth(pacing, load, 8)
