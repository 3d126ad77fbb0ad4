"""A hub is trusted for drafts only: what a hostile or broken one can and cannot do to a target.

Each test puts :class:`fake_hub.FakeHub` (a ROUTER in its own thread speaking StarSD's protocol)
in front of a target, alone or beside an honest in-process hub (``--hub fake,honest``), and
asserts that the target stays alive and responsive, keeps its memory bounded and produces
exactly the target alone's output (greedy; seeded sampling where the attack leaves nothing but
the target's own draws). Pure checks first (the q law, WELCOME clamps, what a proposal must
be), then in-process targets on loopback; real processes are in tests/test_hostile_hub_e2e.py.
Every attack is bounded in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from conftest import RunningHub
from test_hub import _greedy_reference

from edge import speculate
from edge.backends.torch import TorchBackend
from edge.batcher import Batcher
from edge.client import HubClient
from edge.engine import Engine
from edge.handshake import HubError, HubUnavailable, TargetInfo, checked_welcome
from edge.hubs import HubPool
from edge.speculate import Fallback, HubSession, ProposalRefused, checked_draft
from edge.verifier import TargetSequence
from scripts.hostile.fake_hub import ATTACKS, Attack, FakeHub, eos_with_negative_q
from starsd import limits, models, protocol, sampling, transport
from starsd.protocol import Proposal, SamplingParams, Welcome

GREEDY = SamplingParams()
TOP_K = SamplingParams(temperature=1.0, top_k=1, seed=3)  # the attack in the review
SAMPLED = SamplingParams(temperature=0.9, top_k=20, seed=5)
PROMPTS = [[5, 17, 33, 8], [1, 2], list(range(40, 50))]
FAST = Fallback(deadline_s=0.3, resync_s=2.0, open_timeout_s=1.0)

# ---------------------------------------------------------------------- pure: the q law


def _q(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize(
    ("q", "why"),
    [
        (_q([[float("nan"), 0.5, 0.5]]), "NaN"),
        (_q([[float("inf"), 0.0, 0.0]]), "NaN or infinite"),
        (_q([[-1.0, 1.0, 1.0]]), "outside [0, 1]"),
        (_q([[2.0, 0.0, 0.0]]), "outside [0, 1]"),
        (_q([[0.3, 0.3, 0.3]]), "sums to"),
        (_q([[1e-30, 0.0, 0.0]]), "sums to"),
        (_q([[0.0, 1.0, 0.0]]), "is 0 at draft token 0"),
    ],
)
def test_a_q_no_draw_can_come_from_is_refused(q: torch.Tensor, why: str) -> None:
    # Catches rejection sampling that trusts q: with q = -1 at the proposed token, u * q < p
    # holds for every u and the token is always accepted (a hub's EOS ended a sequence at 1
    # token in the review).
    drafts = torch.tensor([0])
    assert why in (sampling.q_problem(drafts, q) or "")
    p = torch.full((1, 2, 3), 1 / 3)
    with pytest.raises(ValueError, match="q "):
        sampling.rejection_sample(drafts[None], q[None], p, torch.Generator().manual_seed(0))


def test_an_honest_q_passes_float16_rounding_included() -> None:
    q = torch.softmax(torch.randn(4, 49152, generator=torch.Generator().manual_seed(0)), -1)
    drafts = q.argmax(-1)
    assert sampling.q_problem(drafts, q) is None
    assert sampling.q_problem(drafts, q.half().float()) is None  # a float16 q on the wire


# ---------------------------------------------------------------------- pure: WELCOME


def _welcome(**fields: object) -> Welcome:
    base = Welcome("d", 320, "fp", b"e" * protocol.EPOCH_BYTES, 4, 16)
    return replace(base, **fields)  # type: ignore[arg-type]


def test_every_number_a_welcome_carries_is_clamped() -> None:
    # Catches heartbeat_ms 0 turning the client's PING loop into a busy loop (an idle target
    # at 57% CPU in the review), and gammas / push counts a hub could inflate at will.
    fixed, changed = checked_welcome(
        _welcome(heartbeat_ms=0, max_gamma=-5, default_gamma=1 << 40, push=1 << 62)
    )
    assert (fixed.heartbeat_ms, fixed.max_gamma, fixed.default_gamma, fixed.push) == (
        100,
        1,
        1,
        limits.MAX_PUSH,
    )
    assert len(changed) == 4
    slow, _ = checked_welcome(_welcome(heartbeat_ms=1 << 62, max_gamma=1 << 20))
    assert (slow.heartbeat_ms, slow.max_gamma) == (60_000, limits.MAX_GAMMA)
    assert checked_welcome(_welcome()) == (_welcome(), [])  # an honest one is left as it is


@pytest.mark.parametrize(
    "fields", [{"epoch": b"x"}, {"version": 99}, {"feature_width": 64, "feature_dtype": "object"}]
)
def test_a_welcome_that_cannot_be_clamped_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(HubError, match="INCOMPATIBLE"):
        checked_welcome(_welcome(**fields))


# ---------------------------------------------------------------------- pure: proposals


class _Info:
    vocab_size, max_positions, hidden_size = 50, 256, 8
    eos_token_ids: frozenset[int] = frozenset()


class _Seq:
    """What :func:`checked_draft` reads of a TargetSequence."""

    def __init__(self, params: SamplingParams) -> None:
        self.info, self.params = _Info(), params
        self.max_new_tokens, self.generated, self.committed = 64, [], 4


def _proposal(tokens: list[int], **q: np.ndarray) -> Proposal:
    return Proposal(b"t" * 16, 0, np.array(tokens, np.int32), **q)


def _one_hot(tokens: list[int], vocab: int = 50) -> np.ndarray:
    dense = np.zeros((len(tokens), vocab), np.float32)
    dense[np.arange(len(tokens)), tokens] = 1
    return dense


@pytest.mark.parametrize(
    ("params", "proposal", "why"),
    [
        (GREEDY, _proposal([1] * 9), "over the hub's max_gamma 8"),
        (GREEDY, _proposal([1, 50]), "outside the vocabulary"),
        (GREEDY, _proposal([-1, 3]), "outside the vocabulary"),
        (SAMPLED, _proposal([1, 2]), "without q"),
        (SAMPLED, _proposal([1, 2], q_probs=_one_hot([1, 2], 49)), "dense q of shape"),
        (
            SAMPLED,
            _proposal(
                [1, 2],
                q_probs=np.ones((2, 1), np.float32),
                q_support=np.array([[1], [99_999]], np.int32),
            ),
            "support outside",
        ),
        (
            SAMPLED,
            _proposal(
                [1, 2], q_probs=np.ones((2, 1), np.float32), q_support=np.array([[1]], np.int32)
            ),
            "q support",
        ),
        (SAMPLED, _proposal([1, 2], q_probs=-_one_hot([1, 2])), "outside [0, 1]"),
        (SAMPLED, _proposal([1, 2], q_probs=_one_hot([2, 1])), "is 0 at draft token"),
    ],
)
def test_a_proposal_the_target_cannot_verify_is_refused_naming_why(
    params: SamplingParams, proposal: Proposal, why: str
) -> None:
    # Catches an out-of-vocabulary token or support id reaching the model thread (a ValueError
    # or an IndexError there failed the request: CLI exit 2, HTTP 500).
    with pytest.raises(ProposalRefused, match=re.escape(why)):
        checked_draft(_Seq(params), proposal, max_gamma=8)  # type: ignore[arg-type]


def test_an_honest_proposal_passes() -> None:
    tokens = [1, 2, 3]
    for params, q in (
        (GREEDY, {}),
        (SAMPLED, {"q_probs": _one_hot(tokens)}),
        (
            SAMPLED,
            {
                "q_probs": np.ones((3, 1), np.float32),
                "q_support": np.array([[1], [2], [3]], np.int32),
            },
        ),
    ):
        drafts, dense, parents = checked_draft(_Seq(params), _proposal(tokens, **q), 8)  # type: ignore[arg-type]
        assert drafts == tokens and (dense is None) == params.greedy and parents is None


def test_a_session_keeps_only_the_branches_it_asked_for_for_its_next_proposal() -> None:
    # Catches the review's 1.47 GB: branches with future seqs and distinct keys were all kept.
    session = HubSession(None, b"t" * 16, asyncio.Queue(), 1, 4, expected=3, push=2)  # type: ignore[arg-type]
    for seq in (4, 5, 9, 1 << 40):
        for accepted in range(6):
            branch = replace(_proposal([1]), seq=seq, if_accepted=accepted, if_appended=7)
            speculate._hold(session, branch, session.expected + 1)
    assert sorted(session.branches) == [(4, 0, 7), (4, 1, 7)]


# ---------------------------------------------------------------------- in-process targets


@dataclass
class Run:
    """What one in-process target run left: its sequences, hubs and the event loop's lag."""

    seqs: list[TargetSequence]
    clients: list[HubClient]
    max_lag_s: float
    wall_s: float


async def _lag_probe(lags: list[float], period: float = 0.01) -> None:
    """How late a 10 ms sleep wakes up: what an HTTP handler on the same loop would wait."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - start - period)


async def _run_target(
    endpoints: list[str],
    target: models.LoadedModel,
    params: SamplingParams = GREEDY,
    n: int = 30,
    push: int = 4,
    linger_s: float = 0.0,
) -> Run:
    """Decode PROMPTS through the hubs (an edge.engine.Engine, as the CLI and the server run
    it); ``linger_s`` keeps the loop running after the sequences finish (a flood goes on)."""
    ctx = transport.new_context()
    info = TargetInfo("t", target.vocab_size, target.tokenizer_fingerprint, 0, push)
    pool = HubPool.create(ctx, tuple(endpoints), info)
    clients = list(pool.clients)
    backend = TorchBackend(target)
    lags: list[float] = []
    started = time.perf_counter()
    probe = asyncio.create_task(_lag_probe(lags))
    try:
        async with Batcher(backend) as batcher:
            engine = Engine(backend, batcher, pool, 0, FAST)
            with contextlib.suppress(HubUnavailable):  # (the fake may be slow to answer)
                await pool.connect(timeout=3.0)
            seqs = [engine.new_sequence(p, _seeded(params, i), n) for i, p in enumerate(PROMPTS)]
            await asyncio.wait_for(asyncio.gather(*(engine.run(s) for s in seqs)), 90)
            await asyncio.sleep(linger_s)
        wall = time.perf_counter() - started
    finally:
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
        await pool.aclose()
        ctx.term()
    return Run(seqs, clients, max(lags, default=0.0), wall)


def _seeded(params: SamplingParams, index: int) -> SamplingParams:
    return params if params.seed is None else replace(params, seed=params.seed + index)


async def _alone(
    target: models.LoadedModel, params: SamplingParams, n: int = 30
) -> list[list[int]]:
    """The target alone (no hub), the same sequences and seeds."""
    backend = TorchBackend(target)
    async with Batcher(backend) as batcher:
        engine = Engine(backend, batcher, None)
        seqs = [engine.new_sequence(p, _seeded(params, i), n) for i, p in enumerate(PROMPTS)]
        await asyncio.gather(*(engine.run(s) for s in seqs))
    return [s.generated for s in seqs]


def _assert_exact(run: Run, target: models.LoadedModel, n: int = 30) -> None:
    for prompt, seq in zip(PROMPTS, run.seqs, strict=True):
        assert seq.generated == _greedy_reference(target, prompt, n)


@pytest.mark.parametrize(
    "attack", ["oov-tokens", "opened-twice", "error-after-opened", "huge-numbers", "push-junk"]
)
async def test_a_broken_hub_alone_leaves_greedy_output_exact(
    attack: str, llama_target: models.LoadedModel
) -> None:
    # Catches a bad proposal or an unexpected message ending the request (the review: CLI exit 2
    # or AssertionError, HTTP 500) instead of the sequence decoding alone.
    with FakeHub(attack) as fake:
        run = await _run_target([fake.endpoint], llama_target)
    _assert_exact(run, llama_target)
    assert fake.stats["opened"] > 0  # it was asked, so the attack happened


@pytest.mark.parametrize("attack", ["support-out-of-range", "negative-q"])
async def test_a_hub_that_sends_a_bad_q_changes_no_sampled_token(
    attack: str, llama_target: models.LoadedModel
) -> None:
    # Every proposal of this hub is refused, so every token is the target's own draw from its
    # own seeded generator: exactly the target alone's.
    with FakeHub(attack) as fake:
        run = await _run_target([fake.endpoint], llama_target, TOP_K)
    assert [s.generated for s in run.seqs] == await _alone(llama_target, TOP_K)
    assert fake.stats["opened"] > 0 and sum(s.stats.rounds for s in run.seqs) == 0


async def test_a_hub_proposing_eos_with_q_minus_one_cannot_end_a_sequence(
    llama_target: models.LoadedModel,
) -> None:
    # The review's attack, as sent: top-k 1, temperature 1, the hub proposes EOS with q = -1.
    # Unchecked, EOS is accepted at once and the sequence ends after 1 token.
    eos = min(llama_target.eos_token_ids)
    attack = Attack("eos", proposal=eos_with_negative_q(eos))
    with FakeHub(attack) as fake:
        run = await _run_target([fake.endpoint], llama_target, TOP_K)
    assert [s.generated for s in run.seqs] == await _alone(llama_target, TOP_K)
    assert fake.stats["opened"] > 0 and sum(s.stats.rounds for s in run.seqs) == 0


@pytest.mark.parametrize(
    "attack", ["oov-tokens", "opened-twice", "error-after-opened", "negative-q"]
)
async def test_beside_a_broken_hub_the_honest_one_serves(
    attack: str, running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    # --hub fake,honest: the fake is set aside after its first refusal and the sequences move
    # to the honest hub (before: requests failed with HTTP 500 / exit 2).
    with FakeHub(attack) as fake:
        run = await _run_target([fake.endpoint, running_hub.endpoint], llama_target, n=40)
    for prompt, seq in zip(PROMPTS, run.seqs, strict=True):
        assert seq.generated == _greedy_reference(llama_target, prompt, 40)
    assert sum(s.stats.rounds for s in run.seqs) > 0  # the honest hub's proposals verified
    fake_client, honest_client = run.clients
    assert fake_client.placement.placed > 0 and honest_client.placement.placed > 0


async def test_pushed_junk_is_dropped_before_it_is_held(
    llama_target: models.LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 32 branches of 64 KB for future rounds after every proposal: a session holds at most the
    # branches it asked for (push 4), only for its next proposal.
    held: list[int] = []
    hold = speculate._hold

    def spy(session: HubSession, branch: Proposal, wanted: int) -> None:
        hold(session, branch, wanted)
        held.append(len(session.branches))

    monkeypatch.setattr(speculate, "_hold", spy)
    with FakeHub("push-junk") as fake:
        run = await _run_target([fake.endpoint], llama_target, push=4)
    _assert_exact(run, llama_target)
    assert max(held, default=0) <= 4
    assert run.clients[0].dropped > 0  # past the session's credit, dropped undecoded


@pytest.mark.parametrize("attack", ["ping-flood", "pong-flood"])
async def test_a_flooding_hub_gets_a_bounded_share_of_the_event_loop(
    attack: str, running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    # Catches a read loop that never yields while messages wait (zmq.asyncio returns receives
    # that are ready): 0 of 4 HTTP requests completed in 66 s beside a PONG flood in the review.
    # The probe is a 10 ms sleep on the same loop, as an HTTP handler would be.
    flood = replace(ATTACKS[attack], seconds=4.0)
    with FakeHub(flood) as fake:
        run = await _run_target(
            [fake.endpoint, running_hub.endpoint], llama_target, n=40, linger_s=1.0
        )
    for prompt, seq in zip(PROMPTS, run.seqs, strict=True):
        assert seq.generated == _greedy_reference(llama_target, prompt, 40)
    assert fake.stats["flooded"] > 10_000
    assert run.max_lag_s < 0.5, run.max_lag_s
    fake_client = run.clients[0]
    assert fake_client.dropped > fake.stats["flooded"] // 4  # mostly dropped, undecoded
    if attack == "ping-flood":  # answered within the budget only
        assert fake.stats["received"] < 2_000


async def test_a_zero_heartbeat_does_not_become_a_busy_loop(
    llama_target: models.LoadedModel,
) -> None:
    # Catches WELCOME heartbeat_ms 0 making the client PING without pause (57% CPU idle).
    with FakeHub("heartbeat-0") as fake:
        ctx = transport.new_context()
        info = TargetInfo("t", llama_target.vocab_size, llama_target.tokenizer_fingerprint)
        client = HubClient(ctx, fake.endpoint, info)
        try:
            welcome = await client.connect(timeout=3.0)
            before = fake.stats["received"]
            await asyncio.sleep(1.0)
            pings = fake.stats["received"] - before
        finally:
            await client.aclose()
            ctx.term()
    assert welcome.heartbeat_ms == 100
    assert pings <= 12, pings  # one per 100 ms at most
