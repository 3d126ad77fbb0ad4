"""One sequence decoded with the hub's proposals, and without them whenever the hub fails.

The target is the source of truth: its committed tokens decide everything, the hub's draft state
is soft. Each round it waits at most ``deadline_s`` for the proposal it asked for; past that it
decodes one token alone (a standalone step) and keeps doing so, without waiting, until the
proposal arrives. A proposal that arrives after such steps is not verified (it drafts from an
older prefix); the next DRAFT instead carries the tokens committed meanwhile (accepted = 0) so the
hub catches up. A proposal with no tokens and ``alone`` = K (the hub found that speculation does
not pay for this sequence now) is answered the same way after K tokens decoded alone. A session
silent for ``resync_s``, refused (UNKNOWN_SESSION, FORBIDDEN, ...), on a hub that went down
(lease, SHUTTING_DOWN) or from an older hub generation (the hub restarted) is dropped and
re-opened from the committed tokens, on the live hub holding the fewest sessions (edge.hubs): with
several hubs a sequence fails over without losing a token, and decodes alone only while none is
live. Proposals and errors are matched on (tag, seq): duplicates and stale ones are ignored, so
nothing is applied twice. With ``push`` (Open.push) the hub also sends its pre-drafted branches
for the next proposal while this one is verified: when the verdict matches one, it is verified
next at once, and the DRAFT says so (``taken``) instead of asking; a session keeps at most the
branches it asked for, and only those for its next proposal. A token tree (Proposal.parents) is
verified like a chain, cropped to the depth the sequence has room for; its DRAFT names the
accepted path (Draft.path). A tree is never a pushed branch.

A hub is trusted for drafts only. A proposal is checked where it enters (:func:`checked_draft`: its
length against the hub's max_gamma, token ids, q's shape, support and law; a token tree against
the connection's tree budget (HubClient.tree_nodes) and the tree rules), and one the target
refuses, an unexpected error or any other message no honest hub sends costs that hub its
session and a strike (HubClient.strike: no new sessions there for a while); the sequence moves
to another hub or decodes alone, as it does when a hub dies. Nothing a hub sends raises out of
:func:`generate_speculative`. Greedy output therefore equals the target alone token for token,
and sampled output keeps the target's distribution, whatever the hubs do (within what
speculative sampling trusts: that the drafts were drawn from the q sent with them).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from edge import verifier
from edge.batcher import Batcher
from edge.client import HubClient
from edge.handshake import HubError, HubUnavailable, push_for
from edge.hubs import HubPool
from edge.verifier import TargetSequence
from starsd import limits, protocol, sampling, tree
from starsd.logsafe import printable
from starsd.protocol import Error, ErrorCode, Proposal

log = logging.getLogger("edge.speculate")

# Errors about one session after which it is re-opened from the committed tokens.
_REOPEN = frozenset(
    {
        ErrorCode.UNKNOWN_SESSION,
        ErrorCode.FORBIDDEN,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.NOT_WELCOMED,
        ErrorCode.INTERNAL,
        ErrorCode.RESOURCE_EXHAUSTED,
    }
)
# Echoes of a duplicate or reordered request: the original is still being answered.
_IGNORE = frozenset({ErrorCode.BUSY, ErrorCode.OUT_OF_ORDER})


@dataclass(frozen=True)
class Fallback:
    """When the target stops waiting for the hub."""

    deadline_s: float = 0.5  # longest wait for a proposal before decoding a token alone
    resync_s: float = 5.0  # a session silent this long is re-opened
    open_timeout_s: float = 2.0


@dataclass
class HubSession:
    """The target's view of one hub session."""

    client: HubClient  # the hub it lives on
    tag: bytes
    inbox: asyncio.Queue[protocol.Message]
    generation: int
    synced: int  # committed tokens the hub knows about
    expected: int = 0  # seq of the proposal we wait for
    asked_at: float = field(default_factory=time.monotonic)
    replaces: HubClient | None = None  # the lost hub this session took over from, until it speaks
    # Pushed branches (Open.push) by (seq, accepted, appended token): collected while the
    # proposal before them is verified; the one its verdict matches is verified next, at once.
    # At most ``push`` of them, all for the next proposal (a hub cannot make a session hold more).
    branches: dict[tuple[int, int, int], Proposal] = field(default_factory=dict)
    push: int = 0  # branches per round this session asked for (Open.push)
    taken: Proposal | None = None


async def generate_speculative(
    hubs: HubPool | HubClient,
    seq: TargetSequence,
    gamma: int,
    batcher: Batcher,
    fallback: Fallback = Fallback(),
) -> TargetSequence:
    """Decode ``seq`` (prefilled) to the end with the hubs' help where one is available; every
    forward goes through ``batcher``, batched with the target's other sequences."""
    pool = hubs if isinstance(hubs, HubPool) else HubPool([hubs])
    hub_params = replace(seq.params, seed=draft_seed(seq.params.seed))
    session: HubSession | None = None
    closed_for_good = False  # CONTEXT_FULL: the hub cannot draft further for this sequence
    lost: HubClient | None = None  # the hub whose session this sequence lost, until it moves
    try:
        while not seq.done:
            if session is not None and not _alive(session):
                lost = _lost_hub(session, lost)
                session = None  # its hub went down or restarted: that session is gone
            if session is None and not closed_for_good:
                session = await _place(pool, seq, hub_params, gamma, fallback)
                if session is not None and lost is not None:
                    session.replaces = lost if session.client is not lost else None
                    lost = None
            if session is None:
                await standalone_step(seq, batcher)
                continue
            current = session
            session, closed_for_good = await _round(seq, session, batcher, fallback)
            if session is None:
                lost = _lost_hub(current, lost)
    finally:
        if session is not None:
            await session.client.close_session(session.tag)
    return seq


def _lost_hub(dropped: HubSession, lost: HubClient | None) -> HubClient | None:
    """The hub a dropped session was lost with (it is down), else the one lost before."""
    return dropped.client if not dropped.client.up else lost


def _alive(session: HubSession) -> bool:
    client = session.client
    return client.up and client.generation == session.generation


async def _place(
    pool: HubPool,
    seq: TargetSequence,
    params: protocol.SamplingParams,
    gamma: int,
    fallback: Fallback,
) -> HubSession | None:
    """A session on the live hub holding the fewest sessions, or None (decode a token alone). A hub
    that drafts from target features (EAGLE) is no place for a sequence that did not keep them."""
    await pool.refresh()
    client = pool.pick(seq.taps)
    if client is None:
        return None
    session = await _open(client, seq, params, gamma, fallback)
    if session is None:
        client.placement.placed -= 1  # not placed after all
    return session


async def standalone_step(seq: TargetSequence, batcher: Batcher) -> None:
    """One token from the target alone, off the event loop (the hub is late or gone)."""
    await batcher.step(seq)
    seq.stats.standalone_steps += 1


async def decode_alone(seq: TargetSequence, tokens: int, batcher: Batcher) -> None:
    """Up to ``tokens`` tokens from the target alone, as the hub asked (a proposal with
    ``alone``); stops where the target alone stops (EOS, max_new_tokens). One batched step per
    token, so this sequence's span rides along with the others' verifications."""
    for _ in range(tokens):
        if seq.done:
            return
        await batcher.step(seq)
        seq.stats.alone_steps += 1


async def _open(
    client: HubClient,
    seq: TargetSequence,
    params: protocol.SamplingParams,
    gamma: int,
    fallback: Fallback,
) -> HubSession | None:
    tokens = [*seq.prompt, *seq.generated]
    generation = client.generation
    features = seq.features(0, len(tokens) - 1, client.needed_taps) if client.needed_taps else None
    try:
        tag, inbox = await client.open(tokens, params, gamma, fallback.open_timeout_s, features)
    except HubUnavailable as exc:
        client.mark_down(str(exc))
        return None
    except HubError as exc:
        if exc.code not in _REOPEN:  # e.g. INVALID_ARGUMENT for an OPEN any hub accepts
            client.strike(f"it refused to open a session: {exc}")
            return None
        if exc.code == ErrorCode.RESOURCE_EXHAUSTED:
            client.mark_full()
        log.info("hub %s did not open a session (%s); a token alone", client.endpoint, exc)
        return None
    push = client_push(client, params)
    return HubSession(client, tag, inbox, generation, synced=len(tokens), push=push)


def client_push(client: HubClient, params: protocol.SamplingParams) -> int:
    """The pushed branches per round a session on ``client`` asked for."""
    offered = client.welcome.push if client.welcome is not None else 0
    return push_for(params, client.info.push, offered)


async def _round(
    seq: TargetSequence, session: HubSession, batcher: Batcher, fallback: Fallback
) -> tuple[HubSession | None, bool]:
    """Handle the next message of ``session`` (or a standalone step if none is due in time)."""
    client = session.client
    taken, session.taken = session.taken, None
    msg = taken or await _next(session, fallback.deadline_s)
    if msg is None:
        await standalone_step(seq, batcher)
        if time.monotonic() - session.asked_at > fallback.resync_s:
            log.info(
                "session %s silent for %.1f s: re-opening", session.tag.hex()[:8], fallback.resync_s
            )
            await client.close_session(session.tag)
            return None, False
        return session, False
    if isinstance(msg, Error):
        return await _session_error(client, session, msg)
    if not isinstance(msg, Proposal):  # e.g. a second OPENED: no honest hub sends one
        return await _drop(session, f"an unexpected {type(msg).__name__}")
    if msg is not taken and msg.branch is not None:
        if msg.parents is not None:
            return await _drop(session, f"a proposal the target refuses: {TREE_BRANCH}")
        _hold(session, msg, session.expected + 1)  # (proposal ``expected`` was asked for)
        return session, False
    if msg.seq != session.expected:
        return session, False  # a duplicate or a stale proposal: never applied twice
    try:
        draft = checked_draft(seq, msg, client.max_gamma, client.tree_nodes)
    except ProposalRefused as exc:
        return await _drop(session, f"a proposal the target refuses: {exc}")
    if session.replaces is not None:
        _resumed(seq, session)
    try:
        keep = await _answer(client, seq, session, msg, draft, batcher)
    except ValueError as exc:  # refused in the model thread (checked there once more)
        if seq.done:  # ended meanwhile (cancelled): the caller's loop ends and closes the session
            return session, False
        return await _drop(session, f"a proposal the verifier refused: {exc}")
    return (session if keep else None), False


async def _drop(session: HubSession, why: str) -> tuple[HubSession | None, bool]:
    """End a session whose hub sent what no honest hub sends, and set that hub aside; the
    sequence goes on from its committed tokens (another hub, or alone)."""
    session.client.strike(why)
    await session.client.close_session(session.tag)
    return None, False


def _resumed(seq: TargetSequence, session: HubSession) -> None:
    """The first proposal from the hub a sequence moved to after its hub was lost."""
    lost, session.replaces = session.replaces, None
    assert lost is not None
    stats = seq.stats
    took = time.monotonic() - lost.down_since
    stats.moves += 1
    stats.resume_s = max(stats.resume_s, took)
    stats.standalone_at_resume = stats.standalone_steps
    log.info(
        "sequence moved from hub %s to %s: speculating again %.3f s after the loss was detected",
        lost.endpoint,
        session.client.endpoint,
        took,
    )


async def _next(session: HubSession, deadline_s: float) -> protocol.Message | None:
    """The next message for the session, waiting only what is left of the deadline."""
    wait = session.asked_at + deadline_s - time.monotonic()
    try:
        if wait <= 0:
            return session.inbox.get_nowait()
        return await asyncio.wait_for(session.inbox.get(), wait)
    except (asyncio.QueueEmpty, asyncio.TimeoutError):
        return None


async def _session_error(
    client: HubClient, session: HubSession, msg: Error
) -> tuple[HubSession | None, bool]:
    if msg.code in _IGNORE:
        return session, False
    if msg.code == ErrorCode.CONTEXT_FULL:
        log.info("hub cannot draft further for this sequence: finishing alone")
        await client.close_session(session.tag)
        return None, True
    if msg.code == ErrorCode.SHUTTING_DOWN:  # the whole hub drains, not just this session: it
        # is lost now (its hub-wide ERROR may come later), so this and its other sequences
        # move, counted as moves, and none is placed there again meanwhile
        client.mark_down(f"{msg.code}: {msg.message}")
    if msg.code in _REOPEN:
        log.info(
            "session %s: %s (%s); re-opening",
            session.tag.hex()[:8],
            msg.code,
            printable(msg.message),
        )
        return None, False
    return await _drop(session, f"error {printable(msg.code)}: {printable(msg.message)}")


async def _answer(
    client: HubClient,
    seq: TargetSequence,
    session: HubSession,
    proposal: Proposal,
    draft: Verifiable,
    batcher: Batcher,
) -> bool:
    """Verify the proposal, or decode the ``alone`` tokens it asks for (or, if we decoded alone
    meanwhile, just catch the hub up).

    Returns False when the session should be re-opened instead (too far behind for one DRAFT).
    """
    accepted = 0
    # the proposal is here: what the target spends from now on is part of the hub's round trip
    mark = batcher.mark(seq)
    if session.synced == seq.committed:
        if len(proposal.tokens) or proposal.alone <= 0:
            accepted, _ = await batcher.verify(seq, *draft)
        else:  # gamma 0: speculation does not pay now; the hub hears from us after the span
            await decode_alone(seq, min(proposal.alone, limits.MAX_APPENDED - 1), batcher)
    # Everything committed since the hub last heard from us, but the drafts it proposed: the
    # verify's own token, the tokens decoded alone (asked for, or past the deadline).
    start = session.synced - len(seq.prompt)
    kept, appended = seq.generated[start : start + accepted], seq.generated[start + accepted :]
    synced, session.synced = session.synced, seq.committed
    session.expected += 1
    session.asked_at = time.monotonic()
    if seq.done:
        return True
    if len(appended) > limits.MAX_APPENDED:
        await client.close_session(session.tag)
        return False
    taps = client.needed_taps
    features = seq.features(synced - 1, seq.committed - 1, taps) if taps else None
    session.taken = _branch_for(session, accepted, appended)
    taken = len(session.taken.tokens) if session.taken is not None else 0
    path = _path(proposal, kept)
    others_s, forward_s = batcher.forwards_since(seq, mark)
    await client.draft(
        session.tag,
        session.expected,
        accepted,
        appended,
        features,
        taken,
        path,
        others_s,
        forward_s,
    )
    return True


def _path(proposal: Proposal, kept: list[int]) -> list[int] | None:
    """Draft.path for a verdict that kept the draft tokens ``kept`` of ``proposal``: the
    accepted path's nodes in the tree as the hub sent it (empty when nothing was accepted);
    None after a chain.

    The path is found again from the committed tokens rather than carried out of the verifier:
    verification keeps one result shape for chains, trees and steps through the model thread,
    and the walk is unique because checked_draft refused trees with repeated siblings. Walking
    the tree as sent also names nodes in the hub's numbering even when the target verified it
    cropped to its room (tree.crop_depth renumbers)."""
    if proposal.parents is None:
        return None
    return tree.accepted_path(proposal.tokens.tolist(), proposal.parents.tolist(), kept)


def _hold(session: HubSession, branch: Proposal, wanted: int) -> None:
    """Keep a pushed branch for proposal ``wanted`` (the next one), up to the session's push
    count; any other (too late, too early, one too many, a token tree) is dropped."""
    assert branch.branch is not None
    key = (branch.seq, *branch.branch)
    if branch.parents is not None:  # a tree is never a branch: verifying one as taken is refused
        return
    if branch.seq == wanted and (key in session.branches or len(session.branches) < session.push):
        session.branches[key] = branch


def _branch_for(session: HubSession, accepted: int, appended: list[int]) -> Proposal | None:
    """The pushed branch for proposal ``session.expected`` that holds after this verdict
    (``accepted`` drafts kept, then ``appended``), or None; the others are dropped."""
    inbox, others = session.inbox, []
    while not inbox.empty():  # (no await in here: nothing else reads or writes the inbox)
        msg = inbox.get_nowait()
        if isinstance(msg, Proposal) and msg.branch is not None:
            _hold(session, msg, session.expected)
        else:
            others.append(msg)
    for msg in others:  # errors and the rest go back, in their order
        inbox.put_nowait(msg)
    key = (session.expected, accepted, appended[0]) if len(appended) == 1 else None
    branch = session.branches.get(key) if key is not None else None
    session.branches = {}  # the rest held for verdicts that did not happen
    return branch


class ProposalRefused(ValueError):
    """A proposal the target does not verify; the message says why."""


TREE_BRANCH = "a token tree sent as a pushed branch"


class Verifiable(NamedTuple):
    """A proposal as the target verifies it (what :func:`checked_draft` returns)."""

    drafts: list[int]  # the draft tokens (a tree's nodes) worth verifying
    q: torch.Tensor | None  # dense [len(drafts), V]; None when greedy
    parents: list[int] | None  # a token tree's, renumbered after cropping; None: a chain


def checked_draft(
    seq: TargetSequence, proposal: Proposal, max_gamma: int, tree_nodes: int = 0
) -> Verifiable:
    """The draft worth verifying (:class:`Verifiable`), or ProposalRefused naming why the
    target refuses ``proposal``: more tokens than the hub's max_gamma, token ids or q support
    outside the vocabulary, q of the wrong shape, or a q that cannot be the law its tokens were
    drawn from (``sampling.q_problem``). A token tree (``proposal.parents``) is held to
    ``tree_nodes`` (the connection's budget, 0: chains only) instead of max_gamma, and to the
    tree rules (:func:`verifier.check_tree`); it may not be a pushed branch."""
    gamma, vocab = len(proposal.tokens), seq.info.vocab_size
    if proposal.parents is not None:
        why = _tree_refusal(proposal, tree_nodes)
        if why is not None:
            raise ProposalRefused(why)
    elif gamma > max_gamma:
        raise ProposalRefused(f"{gamma} draft tokens, over the hub's max_gamma {max_gamma}")
    if gamma and not (int(proposal.tokens.min()) >= 0 and int(proposal.tokens.max()) < vocab):
        raise ProposalRefused(f"a draft token outside the vocabulary of {vocab}")
    why = None if seq.params.greedy or gamma == 0 else _q_shape_refusal(proposal, gamma, vocab)
    if why is not None:
        raise ProposalRefused(why)
    draft = usable_draft(seq, proposal)
    drafts, q, parents = draft
    why = sampling.q_problem(torch.tensor(drafts), q) if drafts and q is not None else None
    if why is None and parents is not None and q is not None:
        why = _refusal(verifier.check_tree, drafts, q, parents)  # siblings' q rows agree
    if why is not None:
        raise ProposalRefused(why)
    return draft


def _tree_refusal(proposal: Proposal, budget: int) -> str | None:
    """Why a token tree is refused before its tokens and q are read (None: it may be)."""
    assert proposal.parents is not None
    nodes, parents = len(proposal.tokens), proposal.parents
    if budget <= 0:
        return "a token tree, but this connection verifies chains only"
    if proposal.branch is not None:
        return TREE_BRANCH
    if nodes > budget:
        return f"{nodes} tree nodes, over this connection's budget of {budget}"
    if parents.shape != proposal.tokens.shape:
        return f"{len(parents)} parents for {nodes} tree nodes"
    return _refusal(verifier.check_tree, proposal.tokens.tolist(), None, parents.tolist())


def _refusal(check: Callable[..., None], *args: object) -> str | None:
    """The ValueError message of ``check(*args)``, or None when it passes."""
    try:
        check(*args)
    except ValueError as exc:
        return str(exc)
    return None


def _q_shape_refusal(proposal: Proposal, gamma: int, vocab: int) -> str | None:
    q, support = proposal.q_probs, proposal.q_support
    if q is None:
        return "a sampled proposal without q"
    if support is None:
        return None if q.shape == (gamma, vocab) else f"dense q of shape {q.shape}"
    if support.shape != q.shape or q.shape[0] != gamma or not 0 < q.shape[1] <= vocab:
        return f"q support {support.shape} and probabilities {q.shape} for {gamma} tokens"
    if int(support.min()) < 0 or int(support.max()) >= vocab:
        return f"q support outside the vocabulary of {vocab}"
    return None


def usable_draft(seq: TargetSequence, proposal: Proposal) -> Verifiable:
    """Draft tokens worth verifying (never past max_new_tokens or the context) and dense q;
    a token tree keeps its nodes of depth <= that room (parents renumbered, q rows in step).
    The proposal passed :func:`checked_draft`'s shape checks."""
    room = seq.max_new_tokens - len(seq.generated) - 1
    if seq.info.max_positions is not None:
        room = min(room, seq.info.max_positions - seq.committed)
    room = max(0, room)
    rows: slice | list[int] = slice(0, min(len(proposal.tokens), room))  # a chain: a prefix
    parents = None
    if proposal.parents is not None:
        rows, parents = tree.crop_depth(proposal.parents.tolist(), room)
    drafts = [int(t) for t in proposal.tokens[rows]]
    if seq.params.greedy or not drafts or proposal.q_probs is None:
        return Verifiable(drafts, None, parents)
    q_probs = torch.from_numpy(proposal.q_probs[rows].astype("float32"))
    support = (
        None
        if proposal.q_support is None
        else torch.from_numpy(proposal.q_support[rows].astype("int64"))
    )
    return Verifiable(drafts, sampling.dense_q(q_probs, support, seq.info.vocab_size), parents)


def draft_seed(seed: int | None) -> int | None:
    """The hub's seed for a sequence: derived, so q's draws never share a stream with p's."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"starsd-q:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
