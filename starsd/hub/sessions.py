"""The hub's session table and admission rules: who is welcomed, who may open, draft and close.

Pure bookkeeping: no sockets, no threads, no model, and an injectable clock, so every rule is
unit-tested directly (tests/test_sessions.py). The hub keeps one table and calls it with its lock
held; a session's draft ``state`` is created here by the proposer's ``new_state`` but belongs to
the drafting thread from then on.

Every check runs before anything changes: a refused request (:class:`Refused`) leaves the table
exactly as it was, so a duplicate or replayed DRAFT is never applied twice.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from starsd import protocol
from starsd.limits import MAX_APPENDED, MAX_PUSH, MAX_TIMING_US
from starsd.protocol import Draft, ErrorCode, Open, ProtocolError, SamplingParams
from starsd.stats import TargetStats

NewState = Callable[[list[int], SamplingParams, int], Any]  # a proposer's new_state


class Refused(ProtocolError):
    """A request the rules refuse; carries what the ERROR reply echoes (ref, or tag and seq)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        ref: int | None = None,
        tag: bytes | None = None,
        seq: int | None = None,
    ) -> None:
        super().__init__(code, message)
        self.ref, self.tag, self.seq = ref, tag, seq


@dataclass(frozen=True)
class Limits:
    """What the table admits: the hub's quotas and what its drafter can read."""

    max_sessions: int
    max_sessions_per_target: int
    default_gamma: int  # an OPEN with gamma 0 gets this (0..max_gamma; 0: decode alone)...
    max_gamma: int
    lease_s: float  # a target silent this long is presumed dead
    vocab_size: int
    max_positions: int | None
    feature_width: int = 0  # > 0: OPEN and DRAFT must carry features of this width...
    feature_dtype: str = "float16"  # ...and dtype
    auto_gamma: bool = False  # ...and then, with --gamma auto, only to start with


@dataclass
class Peer:
    """One welcomed target connection and the sessions bound to it."""

    routing_id: bytes
    key: bytes  # the CURVE public key when authenticated, else the routing id
    stats: TargetStats
    last_seen: float
    tags: set[bytes] = field(default_factory=set)
    tree_nodes: int = 0  # the most nodes of a token tree it verifies (0: chains only)


@dataclass
class Session:
    """Protocol state of one sequence; ``state`` belongs to the drafting thread."""

    tag: bytes
    owner: bytes  # Peer.key of the target that opened it
    routing_id: bytes  # where its proposals go (the owner's current connection)
    state: Any  # the proposer's per-session state
    length: int  # tokens committed so far (prompt + generated), as the verdicts say
    next_seq: int = 0
    in_flight: bool = True  # a job for it is queued or being drafted
    last_gamma: int = 0  # tokens in the proposal the next verdict refers to
    gamma_fixed: bool = True  # False: --gamma auto chooses each round's gamma
    push: int = 0  # pushed branches per round its target takes (Open.push; 0: none)
    tree_nodes: int = 0  # its target's token-tree budget (Peer.tree_nodes; 0: chains only)
    # the parents of the token tree the next verdict refers to (None: a chain)
    last_parents: tuple[int, ...] | None = None


class SessionTable:
    """Peers by routing id, sessions by tag, and the rules for changing them.

    Not thread-safe by itself: the hub calls it only with its lock held.
    """

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.peers: dict[bytes, Peer] = {}
        self.sessions: dict[bytes, Session] = {}
        self.owned_by: dict[bytes, int] = {}  # sessions per owner key, over all its connections
        self.draining = False  # set once: no new sessions, no new rounds
        self.on_forget: Callable[[Peer], None] | None = None  # metrics keep a gone peer's totals

    # ------------------------------------------------------------------ peers

    def welcome(self, routing_id: bytes, key: bytes, name: str) -> Peer | None:
        """Admit a connection after an accepted HELLO; returns the new peer, None if known."""
        if routing_id in self.peers:
            return None
        peer = Peer(routing_id, key, TargetStats(name=name), last_seen=self.clock())
        self.peers[routing_id] = peer
        return peer

    def seen(self, peer: Peer) -> None:
        """Any message renews its sender's lease."""
        peer.last_seen = self.clock()

    def forget(self, peer: Peer) -> list[Session]:
        """Drop a peer and every session bound to it; returns the sessions that went."""
        if self.peers.pop(peer.routing_id, None) is not None and self.on_forget is not None:
            self.on_forget(peer)
        gone = [self.sessions[t] for t in peer.tags if t in self.sessions]
        for session in gone:
            self.drop(session)
        return gone

    def expired(self) -> list[Peer]:
        """Peers silent for longer than the lease (not yet forgotten)."""
        now = self.clock()
        return [p for p in self.peers.values() if now - p.last_seen > self.limits.lease_s]

    # ------------------------------------------------------------------ sessions

    def open(self, peer: Peer, msg: Open, new_state: NewState) -> Session:
        """A new session for ``msg`` with a fresh unguessable tag, its first job to queue.

        An OPEN naming a gamma (1..max_gamma) keeps it; gamma 0 is the hub's choice: the
        default, fixed, or under --gamma auto chosen each round (starting from the default).
        """
        gamma = msg.gamma or self.limits.default_gamma
        problem = self._open_problem(peer, msg, msg.gamma)
        if problem is not None:
            raise Refused(*problem, ref=msg.ref)
        tag = secrets.token_bytes(protocol.TAG_BYTES)
        state = new_state(msg.prompt.tolist(), msg.sampling, gamma)
        session = Session(
            tag=tag,
            owner=peer.key,
            routing_id=peer.routing_id,
            state=state,
            length=msg.prompt.size,
            push=msg.push,
            gamma_fixed=msg.gamma != 0 or not self.limits.auto_gamma,
            tree_nodes=peer.tree_nodes,
        )
        self.sessions[tag] = session
        self.owned_by[peer.key] = self.owned_by.get(peer.key, 0) + 1
        peer.tags.add(tag)
        peer.stats.sessions += 1
        return session

    def draft(self, peer: Peer, msg: Draft) -> tuple[Session, int]:
        """Accept a verdict (the next draft request) for one of ``peer``'s sessions; returns
        the session and the tokens of the proposal the verdict answers."""
        session = self.owned(peer, msg.tag, msg.seq)
        problem = self._draft_problem(session, msg)
        if problem is not None:
            raise Refused(*problem, tag=msg.tag, seq=msg.seq)
        answered = session.last_gamma
        peer.stats.record_verdict(session.last_gamma, msg.accepted)
        session.length += msg.accepted + msg.appended.size
        if session.routing_id != peer.routing_id:  # the owner reconnected (same CURVE key)
            self._move(session, peer)
        if msg.taken:  # its target holds proposal seq (a pushed branch) and verifies it now:
            # the next verdict may come before the drafting thread commits the branch, and
            # queues behind this job (one FIFO per target), so the session moves on at once
            session.next_seq, session.last_gamma = msg.seq + 1, msg.taken
        else:
            session.in_flight = True
        return session, answered

    def close(self, peer: Peer, tag: bytes) -> Session:
        """End one of ``peer``'s sessions; returns it."""
        session = self.owned(peer, tag, None)
        self.drop(session)
        return session

    def owned(self, peer: Peer, tag: bytes, seq: int | None) -> Session:
        """The session ``tag`` if ``peer``'s key owns it; UNKNOWN_SESSION or FORBIDDEN if not."""
        session = self.sessions.get(tag)
        if session is None:
            raise Refused(ErrorCode.UNKNOWN_SESSION, "no such session", tag=tag, seq=seq)
        if session.owner != peer.key:
            raise Refused(
                ErrorCode.FORBIDDEN, "session belongs to another target", tag=tag, seq=seq
            )
        return session

    def drop(self, session: Session) -> None:
        """Forget a session (closed, its target gone, its job failed or undeliverable)."""
        if self.sessions.pop(session.tag, None) is None:
            return
        left = self.owned_by.pop(session.owner) - 1
        if left:
            self.owned_by[session.owner] = left
        peer = self.peers.get(session.routing_id)
        if peer is not None:
            peer.tags.discard(session.tag)

    def delivered(
        self, tag: bytes, seq: int, proposed: int | None, parents: np.ndarray | None = None
    ) -> Session | None:
        """A job's result is going out; ``proposed`` is its token count, None for an error;
        ``parents`` its token tree's (None: a chain).

        Returns the session (dropped already after an error, whose reply still goes out), or
        None if it was closed while its job was drafted.
        """
        session = self.sessions.get(tag)
        if session is None:
            return None
        session.in_flight = False
        if proposed is None:  # the job failed: its state may be half-applied, so it goes
            self.drop(session)
        else:
            session.next_seq = seq + 1
            session.last_gamma = proposed
            session.last_parents = None if parents is None else tuple(parents.tolist())
        return session

    def in_flight(self) -> int:
        """Sessions with a job queued or being drafted."""
        return sum(s.in_flight for s in self.sessions.values())

    # ------------------------------------------------------------------ rules

    def _open_problem(self, peer: Peer, msg: Open, gamma: int) -> tuple[str, str] | None:
        limits = self.limits
        if self.draining:
            return ErrorCode.SHUTTING_DOWN, "hub is stopping; not opening sessions"
        if len(self.sessions) >= limits.max_sessions:
            return ErrorCode.RESOURCE_EXHAUSTED, "hub is at --max-sessions"
        held = self.owned_by.get(peer.key, 0)
        if held >= limits.max_sessions_per_target:
            return ErrorCode.RESOURCE_EXHAUSTED, (
                f"this target has {held} sessions (--max-sessions-per-target)"
            )
        if held >= self._share_when_scarce():
            return ErrorCode.RESOURCE_EXHAUSTED, (
                f"hub nearly full; this target already holds its share ({held} sessions)"
            )
        if gamma != 0 and not 1 <= gamma <= limits.max_gamma:  # (0: the hub's choice)
            return ErrorCode.INVALID_ARGUMENT, f"gamma {gamma} outside 1..{limits.max_gamma}"
        if not 0 <= msg.push <= MAX_PUSH:
            return ErrorCode.INVALID_ARGUMENT, f"push {msg.push} outside 0..{MAX_PUSH}"
        problem = self._token_problem(msg.prompt, allow_empty=False)
        if problem:
            return ErrorCode.INVALID_ARGUMENT, f"prompt: {problem}"
        if self._full(msg.prompt.size):
            return ErrorCode.CONTEXT_FULL, "the prompt leaves the draft no room"
        return self._feature_problem(msg.features, msg.prompt.size - 1)

    def _share_when_scarce(self) -> float:
        """How many sessions one key may hold now: unlimited while the hub has room to spare;
        once free sessions fall to the reserve (an eighth), an equal share of the hub among the
        keys holding sessions plus one newcomer, so a target arriving late still gets in."""
        limits = self.limits
        free = limits.max_sessions - len(self.sessions)
        if free > max(1, limits.max_sessions // 8):
            return float("inf")
        return limits.max_sessions // (len(self.owned_by) + 1)

    def _full(self, length: int) -> bool:
        """True when a sequence of ``length`` committed tokens leaves no room to draft one."""
        limit = self.limits.max_positions
        return limit is not None and length >= limit

    def _draft_problem(self, session: Session, msg: Draft) -> tuple[str, str] | None:
        if self.draining:
            return ErrorCode.SHUTTING_DOWN, "hub is stopping; continue without proposals"
        if session.in_flight:
            return ErrorCode.BUSY, "a proposal for this session is being drafted"
        if msg.seq != session.next_seq:
            return ErrorCode.OUT_OF_ORDER, f"expected seq {session.next_seq}, got {msg.seq}"
        if not 0 <= msg.accepted <= session.last_gamma:
            return ErrorCode.INVALID_ARGUMENT, (
                f"accepted {msg.accepted} outside 0..{session.last_gamma}"
            )
        problem = path_problem(session.last_parents, msg.path, msg.accepted)
        if problem:
            return ErrorCode.INVALID_ARGUMENT, problem
        problem = self._token_problem(msg.appended, allow_empty=True)
        if problem:
            return ErrorCode.INVALID_ARGUMENT, f"appended: {problem}"
        problem = self._taken_problem(session, msg)
        if problem:
            return ErrorCode.INVALID_ARGUMENT, problem
        for name, value in (("others_us", msg.others_us), ("forward_us", msg.forward_us)):
            if not 0 <= value <= MAX_TIMING_US:
                return ErrorCode.INVALID_ARGUMENT, f"{name} {value} outside 0..{MAX_TIMING_US}"
        if self._full(session.length + msg.accepted + msg.appended.size):
            return ErrorCode.CONTEXT_FULL, "draft context is full"
        return self._feature_problem(msg.features, msg.accepted + msg.appended.size)

    def _token_problem(self, ids: np.ndarray, allow_empty: bool) -> str | None:
        if ids.size == 0:
            return None if allow_empty else "empty"
        if ids.size > max(MAX_APPENDED, self.limits.max_positions or 0):
            return f"{ids.size} tokens is too many"
        values = ids.tolist()  # min/max of a list: numpy reductions cost more on a few tokens
        if min(values) < 0 or max(values) >= self.limits.vocab_size:
            return f"token id outside 0..{self.limits.vocab_size - 1}"
        return None

    def _taken_problem(self, session: Session, msg: Draft) -> str | None:
        """A DRAFT that took a pushed branch must fit one: the session asked for pushes, the
        verdict appends one token, and the branch's length is a gamma the hub could draft."""
        if not msg.taken:
            return None
        if not session.push:
            return "taken: this session was opened without push"
        if msg.appended.size != 1:
            return f"taken: a branch follows one appended token, not {msg.appended.size}"
        if not 1 <= msg.taken <= self.limits.max_gamma:
            return f"taken {msg.taken} outside 1..{self.limits.max_gamma}"
        return None

    def _feature_problem(self, features: np.ndarray | None, rows: int) -> tuple[str, str] | None:
        """Features must come exactly when the drafter uses them, with the announced shape and
        dtype and finite values; anything else is refused before state changes."""
        width, dtype = self.limits.feature_width, self.limits.feature_dtype
        if not width:
            if features is None:
                return None
            return ErrorCode.INVALID_ARGUMENT, "this hub does not take features"
        if features is None:
            return ErrorCode.INVALID_ARGUMENT, f"features [{rows}, {width}] are required"
        if features.shape != (rows, width) or features.dtype.name != dtype:
            return ErrorCode.INVALID_ARGUMENT, (
                f"features must be [{rows}, {width}] {dtype}, got "
                f"{list(features.shape)} {features.dtype.name}"
            )
        if not np.isfinite(features).all():
            return ErrorCode.INVALID_ARGUMENT, "features contain NaN or infinity"
        return None

    def _move(self, session: Session, peer: Peer) -> None:
        old = self.peers.get(session.routing_id)
        if old is not None:
            old.tags.discard(session.tag)
        session.routing_id = peer.routing_id
        peer.tags.add(session.tag)


def path_problem(
    parents: tuple[int, ...] | None, path: np.ndarray | None, accepted: int
) -> str | None:
    """Why a verdict's ``path`` does not fit the proposal it answers (None if it does): after a
    chain no path; after a token tree with ``parents`` a path of ``accepted`` nodes, each the
    child of the one before, from a child of the root."""
    if parents is None:
        return None if path is None else "path: the proposal it answers was a chain"
    nodes = [] if path is None else path.tolist()
    if len(nodes) != accepted:
        return f"path of {len(nodes)} nodes for accepted {accepted}"
    parent = -1
    for node in nodes:
        if not 0 <= node < len(parents) or parents[node] != parent:
            return f"path: node {node} is not a child of {parent} in the tree"
        parent = node
    return None
