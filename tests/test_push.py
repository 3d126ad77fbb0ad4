"""Pushed branches: the hub sends its pre-drafted branches ahead of the verdict, the target
verifies the one its verdict matches at once and says so (``Draft.taken``).

Layers: the wire fields; the pre-drafter's pushes (each one exactly what answering that verdict
would send, and a taken one commits the session as drafting would); the session rules (a taken
DRAFT moves the session on at once, so the next verdict is not refused as BUSY); and end to end
over a real socket, greedy against ``generate()`` and seeded sampling against the same run
without pushes.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import RunningHub
from test_hub import _greedy_reference
from test_predraft import first_round, idle, same

from edge.backends.torch import TorchBackend
from edge.batcher import Batcher
from edge.client import HubClient
from edge.handshake import TargetInfo, push_for
from edge.speculate import generate_speculative
from edge.verifier import TargetSequence
from starsd import limits, models, protocol, transport
from starsd.hub.drafters.base import DraftJob
from starsd.hub.drafters.llm import LlmProposer
from starsd.hub.predraft import Predrafter
from starsd.hub.sessions import Limits, Refused, SessionTable
from starsd.protocol import Draft, ErrorCode, Open, Proposal, SamplingParams


@pytest.fixture(scope="module")
def draft(llama_pair: tuple[Path, Path]) -> models.LoadedModel:
    return models.load_causal_lm(llama_pair[1])


# ------------------------------------------------------------------------------ the wire


def test_push_fields_round_trip_and_stay_off_the_wire_at_their_defaults() -> None:
    """Catches a field missing from the schema (decode would refuse it) or sent at its default
    (an older peer, whose decoder refuses unknown keys, could no longer read any message)."""
    ids = np.array([3], dtype=np.int32)
    branch = Proposal(b"t" * 16, 2, ids, if_accepted=1, if_appended=7)
    taken = Draft(b"t" * 16, 2, 1, ids, taken=3)
    opened = Open(1, ids, SamplingParams(), 0, push=4)
    for msg in (branch, taken, opened):
        assert protocol.decode(protocol.encode(msg)) == msg
    assert protocol.decode(protocol.encode(branch)).branch == (1, 7)  # type: ignore[union-attr]
    plain = [
        Proposal(b"t" * 16, 2, ids),
        Draft(b"t" * 16, 2, 1, ids),
        Open(1, ids, SamplingParams(), 0),
    ]
    for msg in plain:
        header = bytes(protocol.encode(msg)[0])
        assert not any(key in header for key in (b"if_accepted", b"taken", b"push"))
    assert plain[0].branch is None


# ------------------------------------------------------------------------------ pre-drafter


def _pushing(
    draft: models.LoadedModel,
    params: SamplingParams,
    push: int = 4,
    history: tuple[int, int] = (0, 0),
) -> tuple[Predrafter, list[Proposal], object]:
    """A session's first round, offered with ``push``; every branch its pre-drafter pushed."""
    proposer = LlmProposer(draft)
    pre = Predrafter(proposer, branches=4)
    sent: list[Proposal] = []
    pre.connect_push(lambda tag, proposals: sent.extend(proposals) or len(proposals))
    state, _ = first_round(proposer, params, gamma=3, history=history)
    pre.offer(b"s", state, seq=1, push=push)
    idle(pre)
    return pre, sent, state


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(0.8, seed=7), SamplingParams(1.0, top_k=6, seed=3)],
    ids=str,
)
def test_a_pushed_branch_is_exactly_the_proposal_drafting_after_its_verdict_sends(
    draft: models.LoadedModel, params: SamplingParams
) -> None:
    """Catches a push with the wrong tokens or q rows (the target verifies what it was pushed:
    its output would then follow another q than the one the tokens were drawn from), with the
    wrong seq or verdict key, and a taken branch that leaves the session where plain drafting
    would not (the round after must match too)."""
    pre, sent, state = _pushing(draft, params)
    assert len(sent) == 4 and {p.seq for p in sent} == {1}
    for pushed in sent:
        assert pushed.branch is not None and len(pushed.tokens) == 3
        k, token = pushed.branch
        plain = LlmProposer(draft)
        twin, _ = first_round(plain, params, gamma=3)
        (expected,) = plain.propose([DraftJob(b"s", 1, twin, k, (token,))])
        same(pushed, expected)
    k, token = sent[0].branch  # type: ignore[misc]
    taken = pre.answer(DraftJob(b"s", 1, state, k, (token,), taken=3))  # type: ignore[arg-type]
    assert taken is not None and pre.stats.taken == 1
    same(taken, sent[0])
    plain = LlmProposer(draft)
    twin, _ = first_round(plain, params, gamma=3)
    plain.propose([DraftJob(b"s", 1, twin, k, (token,))])
    nxt = [
        p.propose([DraftJob(b"s", 2, s, 1, (11,))])[0]
        for p, s in ((pre.proposer, state), (plain, twin))
    ]
    same(nxt[0], nxt[1])  # type: ignore[arg-type]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, seed=7)], ids=str)
def test_a_branch_goes_out_once_its_gamma_is_drawn_and_is_taken_while_still_drafting(
    draft: models.LoadedModel, params: SamplingParams
) -> None:
    """Under --gamma auto a branch drafts one token past the round's gamma; its push must not
    wait for that token. Catches a push held back to the end of the batch, a push of the extra
    token, and a taken verdict whose branch is still being drafted counted lost (the hub would
    end a healthy session) or committed half-drafted (the next round would differ)."""
    proposer = LlmProposer(draft)
    pre = Predrafter(proposer, branches=2, reach=1)
    sent: list[Proposal] = []
    pre.connect_push(lambda tag, proposals: sent.extend(proposals) or len(proposals))
    state, _ = first_round(proposer, params, gamma=3)
    pre.offer(b"s", state, seq=1, push=2)
    while not sent:
        pre.step()
    assert pre.running is not None and [len(p.tokens) for p in sent] == [3, 3]
    k, token = sent[0].branch  # type: ignore[misc]
    taken = pre.answer(DraftJob(b"s", 1, state, k, (token,), taken=3))
    assert taken is not None and pre.running is None
    same(taken, sent[0])
    plain = LlmProposer(draft)
    twin, _ = first_round(plain, params, gamma=3)
    (expected,) = plain.propose([DraftJob(b"s", 1, twin, k, (token,))])
    same(taken, expected)
    nxt = [
        p.propose([DraftJob(b"s", 2, s, 1, (11,))])[0]
        for p, s in ((proposer, state), (plain, twin))
    ]
    same(nxt[0], nxt[1])  # type: ignore[arg-type]


def test_only_as_many_branches_as_the_target_takes_are_pushed(
    draft: models.LoadedModel,
) -> None:
    """Catches pushes beyond ``Open.push`` (bandwidth and target work for nothing) and pushes
    to a session whose target never asked (an older target would take them for proposals)."""
    _, sent, _ = _pushing(draft, SamplingParams(), push=2)
    assert len(sent) == 2
    _, none, _ = _pushing(draft, SamplingParams(), push=0)
    assert none == []


def test_a_taken_verdict_is_answered_only_by_the_branch_pushed_for_it(
    draft: models.LoadedModel,
) -> None:
    """Catches a taken DRAFT answered by a branch that was drafted but never pushed, or pushed
    at another length: the hub would commit tokens other than those its target verifies and
    draft from a wrong prefix for the rest of the session (the engine ends such a session)."""
    pre, sent, state = _pushing(draft, SamplingParams(), push=1)
    pushed = {p.branch for p in sent}
    other = next(key for key in pre.waiting[b"s"].branches if key not in pushed)
    assert pre.answer(DraftJob(b"s", 1, state, other[0], (other[1],), taken=3)) is None
    pre, sent, state = _pushing(draft, SamplingParams(), push=1)
    k, token = sent[0].branch  # type: ignore[misc]
    assert pre.answer(DraftJob(b"s", 1, state, k, (token,), taken=2)) is None


# ------------------------------------------------------------------------------ session rules


def _table(push: int) -> tuple[SessionTable, object, bytes]:
    limits = Limits(
        max_sessions=8,
        max_sessions_per_target=8,
        default_gamma=4,
        max_gamma=8,
        lease_s=10.0,
        vocab_size=64,
        max_positions=None,
    )
    table = SessionTable(limits)
    peer = table.welcome(b"r", b"k", "t")
    prompt = np.array([1, 2, 3], dtype=np.int32)
    session = table.open(peer, Open(1, prompt, SamplingParams(), 4, push=push), lambda *_: object())
    table.delivered(session.tag, 0, 4)  # proposal 0 (4 tokens) went out
    return table, peer, session.tag


def test_a_taken_draft_moves_the_session_on_so_the_next_verdict_is_not_busy() -> None:
    """Catches the race the first version lost: the target verifies the taken branch and sends
    its next verdict before the drafting thread has committed the branch; refused as BUSY (a
    duplicate, to the target), that verdict was dropped and the sequence stalled."""
    table, peer, tag = _table(push=4)
    one = np.array([9], dtype=np.int32)
    _, answered = table.draft(peer, Draft(tag, 1, 2, one, taken=3))  # type: ignore[arg-type]
    session = table.sessions[tag]
    assert session.next_seq == 2 and session.last_gamma == 3 and not session.in_flight
    assert answered == 4  # proposal 0's tokens; the next verdict answers the branch's 3
    assert table.draft(peer, Draft(tag, 2, 3, one))[1] == 3  # type: ignore[arg-type]
    assert session.in_flight


@pytest.mark.parametrize(
    ("push", "appended", "taken", "why"),
    [
        (0, [9], 3, "opened without push"),
        (4, [9, 10], 3, "one appended token"),
        (4, [9], 9, "outside 1..8"),
    ],
)
def test_a_taken_draft_that_cannot_fit_a_push_is_refused(
    push: int, appended: list[int], taken: int, why: str
) -> None:
    """Catches a hub that trusts ``taken`` blindly: a target cannot make the hub commit a branch
    it never pushed (no push asked), after a verdict no branch follows, or of any length."""
    table, peer, tag = _table(push)
    with pytest.raises(Refused) as refused:
        table.draft(
            peer,
            Draft(
                tag,
                1,
                0,
                np.array(appended, dtype=np.int32),  # type: ignore[arg-type]
                taken=taken,
            ),
        )
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT and why in refused.value.message
    assert table.sessions[tag].next_seq == 1  # nothing moved


def test_an_open_asking_for_too_many_pushes_is_refused() -> None:
    """Catches an unbounded ``push``: each pushed branch costs the hub a send per round."""
    with pytest.raises(Refused) as refused:
        _table(push=limits.MAX_PUSH + 1)
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT


def test_plain_sampling_asks_for_no_pushes() -> None:
    """Catches pushes asked for dense-q sessions: each branch would carry gamma x V float32 of
    q (2 MB a round at V = 32000 and 4 branches), more than the round trip saves on a slow link;
    greedy and truncated sampling (q as its support only) keep them."""
    assert push_for(SamplingParams(), 4, 4) == 4
    assert push_for(SamplingParams(1.0, top_k=6), 4, 4) == 4
    assert push_for(SamplingParams(0.8, top_p=0.9), 4, 4) == 4
    assert push_for(SamplingParams(0.8), 4, 4) == 0


def test_a_target_asks_only_for_the_pushes_its_hub_offers() -> None:
    """Catches a target that sends ``push`` to a hub whose WELCOME offered none: a hub that
    predates pushes refuses an OPEN with an unknown field, so every sequence would decode
    alone; and one that asks for more branches than the hub drafts."""
    assert push_for(SamplingParams(), 4, 0) == 0
    assert push_for(SamplingParams(), 8, 4) == 4


async def test_the_hub_offers_its_pre_drafted_branches_in_welcome(
    running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    """Catches a hub that pre-drafts but offers no pushes (targets would never ask), and a
    WELCOME whose ``push`` an older target could not read (it is sparse: absent at 0)."""
    assert running_hub.hub.welcome.push == 4
    assert b"push" not in bytes(
        protocol.encode(dataclasses.replace(running_hub.hub.welcome, push=0))[0]
    )


# ------------------------------------------------------------------------------ end to end


class LargeTargetBackend(TorchBackend):
    """The tiny target, made to verify as slowly as a large one would (a forward costs several
    draft steps): pushed branches then arrive in time to be taken, on any machine; with the
    tiny model's own ~1 ms forward whether any is taken depends on scheduling."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.015)
        return super().forward(*args, **kwargs)


async def _speculate(
    endpoint: str,
    target: models.LoadedModel,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    push: int,
) -> list[TargetSequence]:
    ctx = transport.new_context()
    info = TargetInfo("t", target.vocab_size, target.tokenizer_fingerprint, push=push)
    client = HubClient(ctx, endpoint, info)
    await client.connect()
    backend = LargeTargetBackend(target)
    batcher = Batcher(backend)
    seqs = [TargetSequence(backend, p, params, n) for p in prompts]
    try:  # one at a time: pre-drafting stops while more than 2 proposals are out
        for seq in seqs:
            await generate_speculative(client, seq, 3, batcher)
    finally:
        await client.aclose()
        await batcher.aclose()
        ctx.term()
    return seqs


def _taken(running_hub: RunningHub) -> int:
    return sum(peer.stats.taken for peer in running_hub.hub.table.peers.values())


PROMPTS = [[5, 17, 33, 8], [1], list(range(40, 60))]


async def test_greedy_with_pushed_branches_equals_generate(
    running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    """Catches a taken branch verified against the wrong verdict or committed out of step with
    the hub (every later proposal would be drafted from another prefix); the hub must really
    have had branches taken, or the test proves nothing."""
    seqs = await _speculate(
        running_hub.endpoint, llama_target, PROMPTS, 40, SamplingParams(), push=4
    )
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        assert seq.generated == _greedy_reference(llama_target, prompt, 40)
    assert _taken(running_hub) > 0
    assert all(s.stats.standalone_steps == 0 for s in seqs)  # no stall (the BUSY race)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(0.8, top_k=2, seed=11), SamplingParams(0.3, top_p=0.9, seed=5)],
    ids=str,
)
async def test_seeded_sampling_with_pushes_equals_the_same_run_without(
    running_hub: RunningHub, llama_target: models.LoadedModel, params: SamplingParams
) -> None:
    """At a fixed gamma a seeded sampled run is reproducible, and a pushed branch is exactly
    the proposal the hub would draft after that verdict (tokens, q, generator): so the output
    through taken branches must equal the output without pushes, token for token. Catches a
    branch drawn from the wrong generator state or sent with other q rows, which would shift
    the target's draws (the sampling chi-square of test_predraft covers the branches' q)."""
    with_push = await _speculate(running_hub.endpoint, llama_target, PROMPTS, 40, params, 4)
    assert _taken(running_hub) > 0
    without = await _speculate(running_hub.endpoint, llama_target, PROMPTS, 40, params, 0)
    assert [s.generated for s in with_push] == [s.generated for s in without]
