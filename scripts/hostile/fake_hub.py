"""A hub that speaks StarSD's protocol as a hostile or broken one would, on loopback.

``FakeHub`` is a ROUTER in a thread of its own (blocking ZeroMQ, its own context), so what it does
to a target, in this process or in another, competes with the target's event loop the way a
remote hub would. Left alone it is a plausible hub: it welcomes every HELLO (echoing the target's
vocabulary and tokenizer), opens every session and answers every DRAFT with random draft tokens
(with an honest q when sampling: a one-hot row at the drawn token), so a target's output through
it must equal the target alone. An :class:`Attack` changes one thing. Every attack is bounded in
time (``Attack.seconds``, and the hub stops after ``max_s``) and loopback only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zmq

from starsd import protocol

ProposalHook = Callable[["Session", protocol.Proposal], protocol.Proposal]


@dataclass
class Session:
    """What the fake hub keeps per session."""

    peer: bytes
    tag: bytes
    params: protocol.SamplingParams
    gamma: int
    vocab: int
    push: int
    next_seq: int = 0
    rounds: int = 0


@dataclass
class Attack:
    """One way to misbehave (the defaults: none)."""

    name: str = "honest"
    welcome: dict[str, Any] = field(default_factory=dict)  # WELCOME fields to override
    flood: type | None = None  # Ping or Pong: sent as fast as the socket takes them
    seconds: float = 10.0  # how long a flood lasts
    push_junk: int = 0  # pushed branches for future rounds sent after every proposal
    junk_bytes: int = 64 * 1024  # size of each such branch's tokens
    proposal: ProposalHook | None = None  # rewrites every proposal before it is sent
    opened_twice: bool = False  # a second OPENED (another tag) for the same OPEN
    error_after_opened: str | None = None  # a session ERROR with this code instead of seq 0
    bad_rounds: int = 1 << 30  # proposal hooks apply to this many rounds of a session


def oov_tokens(session: Session, proposal: protocol.Proposal) -> protocol.Proposal:
    """Draft tokens outside the target's vocabulary."""
    tokens = np.full(len(proposal.tokens), session.vocab + 7, dtype=np.int32)
    return replace(proposal, tokens=tokens)


def support_out_of_range(session: Session, proposal: protocol.Proposal) -> protocol.Proposal:
    """q's support names token ids the target does not have."""
    if proposal.q_support is None:
        return proposal
    support = np.full_like(proposal.q_support, 99_999)
    return replace(proposal, q_support=support)


def negative_q(session: Session, proposal: protocol.Proposal) -> protocol.Proposal:
    """q = -1 at the proposed token: a rejection step that trusts q accepts it always."""
    if proposal.q_probs is None:
        return proposal
    return replace(proposal, q_probs=-np.ones_like(proposal.q_probs))


def eos_with_negative_q(eos: int) -> ProposalHook:
    """Propose the target's EOS with q = -1 (u * q < p holds for every u: always accepted)."""

    def hook(session: Session, proposal: protocol.Proposal) -> protocol.Proposal:
        tokens = np.full(len(proposal.tokens), eos, dtype=np.int32)
        q = proposal.q_probs
        if proposal.q_support is not None:
            support = tokens.reshape(-1, 1).copy()
            return replace(
                proposal,
                tokens=tokens,
                q_support=support,
                q_probs=-np.ones((len(tokens), 1), np.float32),
            )
        if q is not None:
            return replace(proposal, tokens=tokens, q_probs=-np.ones_like(q))
        return replace(proposal, tokens=tokens)

    return hook


ATTACKS: dict[str, Attack] = {
    a.name: a
    for a in (
        Attack(),
        Attack("ping-flood", flood=protocol.Ping),
        Attack("pong-flood", flood=protocol.Pong),
        Attack("push-junk", push_junk=32),
        Attack("oov-tokens", proposal=oov_tokens),
        Attack("opened-twice", opened_twice=True),
        Attack("support-out-of-range", proposal=support_out_of_range),
        Attack("error-after-opened", error_after_opened=protocol.ErrorCode.MALFORMED),
        Attack("negative-q", proposal=negative_q),
        Attack("heartbeat-0", welcome={"heartbeat_ms": 0}),
        Attack(
            "huge-numbers",
            welcome={
                "heartbeat_ms": 1 << 62,
                "max_gamma": -5,
                "default_gamma": 1 << 40,
                "push": 1 << 62,
                "sessions": -(1 << 63),
                "busy": float("nan"),
            },
        ),
    )
}


class FakeHub:
    """A hostile (or, with the default attack, plausible) hub on a random loopback port.

    Use as a context manager: the thread starts on enter and is stopped and joined on exit.
    ``stats`` counts what it received and sent.
    """

    def __init__(
        self, attack: Attack | str = "honest", max_s: float = 120.0, seed: int = 0
    ) -> None:
        self.attack = ATTACKS[attack] if isinstance(attack, str) else attack
        self.max_s = max_s
        self.rng = np.random.default_rng(seed)
        self.epoch = os.urandom(protocol.EPOCH_BYTES)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sessions: dict[bytes, Session] = {}
        self.vocab: dict[bytes, int] = {}  # peer -> the vocabulary its HELLO named
        self.stats = {"received": 0, "sent": 0, "flooded": 0, "opened": 0, "drafts": 0}
        self._flood_from: dict[bytes, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"fake-hub-{self.attack.name}", daemon=True
        )

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        deadline = time.monotonic() + self.max_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            flooding = self._flood()
            if poller.poll(0 if flooding else 10):
                self._drain()

    def _drain(self) -> None:
        for _ in range(1000):
            try:
                peer, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats["received"] += 1
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError:
                continue
            self._handle(peer, msg)

    def _send(self, peer: bytes, msg: protocol.Message) -> bool:
        try:
            self.sock.send_multipart([peer, *protocol.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:  # EAGAIN (the peer does not read) or gone
            return False
        self.stats["sent"] += 1
        return True

    def _flood(self) -> bool:
        """One burst of the flood to every welcomed peer; whether a flood is still on."""
        kind, now = self.attack.flood, time.monotonic()
        live = [p for p, t in self._flood_from.items() if now - t < self.attack.seconds]
        if kind is None or not live:
            return False
        msg = protocol.Ping(1) if kind is protocol.Ping else protocol.Pong(1, self.epoch)
        for peer in live:
            for _ in range(200):
                if not self._send(peer, msg):
                    break
                self.stats["flooded"] += 1
        return True

    # ------------------------------------------------------------------ answers

    def _handle(self, peer: bytes, msg: protocol.Message) -> None:
        match msg:
            case protocol.Hello():
                self._welcome(peer, msg)
            case protocol.Open():
                self._open(peer, msg)
            case protocol.Draft():
                self._draft(peer, msg)
            case protocol.Ping(nonce=nonce):
                self._send(peer, protocol.Pong(nonce, self.epoch))
            case protocol.Close(tag=tag):
                self.sessions.pop(tag, None)
            case _:
                pass

    def _welcome(self, peer: bytes, hello: protocol.Hello) -> None:
        fields: dict[str, Any] = dict(
            model="fake-draft",
            vocab_size=hello.vocab_size,
            tokenizer=hello.tokenizer,
            epoch=self.epoch,
            default_gamma=4,
            max_gamma=16,
            push=4,
        )
        fields.update(self.attack.welcome)
        self._send(peer, protocol.Welcome(**fields))
        self.vocab[peer] = hello.vocab_size
        if self.attack.flood is not None and peer not in self._flood_from:
            self._flood_from[peer] = time.monotonic()

    def _open(self, peer: bytes, msg: protocol.Open) -> None:
        vocab = self.vocab.get(peer, int(msg.prompt.max()) + 1)
        session = Session(
            peer, os.urandom(protocol.TAG_BYTES), msg.sampling, msg.gamma or 4, vocab, msg.push
        )
        self.sessions[session.tag] = session
        self.stats["opened"] += 1
        self._send(peer, protocol.Opened(msg.ref, session.tag, self.epoch))
        if self.attack.opened_twice:
            self._send(peer, protocol.Opened(msg.ref, os.urandom(protocol.TAG_BYTES), self.epoch))
        if self.attack.error_after_opened is not None:
            self._send(
                peer,
                protocol.Error(
                    self.attack.error_after_opened, "fake", tag=session.tag, seq=0, epoch=self.epoch
                ),
            )
            return
        self._propose(session)

    def _draft(self, peer: bytes, msg: protocol.Draft) -> None:
        session = self.sessions.get(msg.tag)
        self.stats["drafts"] += 1
        if session is None or session.peer != peer:
            unknown = protocol.Error(
                protocol.ErrorCode.UNKNOWN_SESSION,
                "no such session",
                tag=msg.tag,
                seq=msg.seq,
                epoch=self.epoch,
            )
            self._send(peer, unknown)
            return
        session.next_seq = msg.seq
        if msg.taken:
            session.next_seq += 1
            return
        self._propose(session)

    def _propose(self, session: Session) -> None:
        proposal = self.proposal(session, session.next_seq)
        if self.attack.proposal is not None and session.rounds < self.attack.bad_rounds:
            proposal = self.attack.proposal(session, proposal)
        session.rounds += 1
        self._send(session.peer, proposal)
        for n in range(self.attack.push_junk):
            self._send(session.peer, self._junk_branch(session, n))

    def proposal(self, session: Session, seq: int) -> protocol.Proposal:
        """Random draft tokens with an honest q (one-hot at each drawn token)."""
        gamma = session.gamma
        tokens = self.rng.integers(0, session.vocab, gamma).astype(np.int32)
        params = session.params
        if params.greedy:
            return protocol.Proposal(session.tag, seq, tokens, epoch=self.epoch)
        if params.truncated:
            support = tokens.reshape(-1, 1).copy()
            ones = np.ones((gamma, 1), np.float32)
            return protocol.Proposal(session.tag, seq, tokens, ones, support, epoch=self.epoch)
        dense = np.zeros((gamma, session.vocab), np.float32)
        dense[np.arange(gamma), tokens] = 1.0
        return protocol.Proposal(session.tag, seq, tokens, dense, epoch=self.epoch)

    def _junk_branch(self, session: Session, n: int) -> protocol.Proposal:
        """A pushed branch for a round far ahead, with its own key and a large token array."""
        count = max(1, self.attack.junk_bytes // 4)
        tokens = self.rng.integers(0, session.vocab, count).astype(np.int32)
        seq = session.next_seq + 2 + int(self.rng.integers(0, 1 << 30))
        return protocol.Proposal(
            session.tag,
            seq,
            tokens,
            epoch=self.epoch,
            if_accepted=n % 5,
            if_appended=int(self.rng.integers(0, session.vocab)),
        )
