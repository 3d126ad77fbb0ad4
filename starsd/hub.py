"""The StarSD draft hub: one ROUTER socket, many targets, one work-conserving drafting thread.

    python -m starsd.hub --model DIR --bind tcp://*:5555 [--gamma 4] [--device cpu|cuda]

The event loop owns the socket and all protocol state (peers, session ownership, sequence
numbers); it never runs the model. Draft requests go into the global queue Q_in; the drafting
thread takes every pending request at once, calls ``Drafter.propose`` and hands results to Q_out,
from which the loop sends them. The drafter therefore works whenever any target has work pending
and never waits for a particular target's verification.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import queue
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq.asyncio

from starsd import protocol, transport
from starsd.drafter import DRAFTERS, Drafter, DraftJob, DraftState
from starsd.protocol import (
    Close,
    Draft,
    Error,
    ErrorCode,
    Hello,
    Open,
    Opened,
    Ping,
    Pong,
    Proposal,
    ProtocolError,
    Stats,
    StatsRequest,
    Welcome,
)
from starsd.stats import HubStats, TargetStats

log = logging.getLogger("starsd.hub")

MAX_APPENDED = 1024  # tokens a target may commit between two rounds


@dataclass(frozen=True)
class HubConfig:
    """Everything ``python -m starsd.hub`` is told."""

    model: str
    bind: str = "tcp://*:5555"
    gamma: int = 4
    max_gamma: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    max_sessions: int = 256
    max_batch: int = 64
    threads: int = 1
    stats_interval: float = 10.0
    draft_kind: str = "llm"


@dataclass
class Peer:
    """One target connection (a ROUTER routing id) and what it told us at HELLO."""

    routing_id: bytes
    stats: TargetStats
    welcomed: bool = False
    tags: set[bytes] = field(default_factory=set)


@dataclass
class Session:
    """Protocol state of one sequence; ``state`` belongs to the drafting thread."""

    tag: bytes
    owner: bytes  # routing id of the connection that opened it
    state: DraftState
    next_seq: int = 0
    in_flight: bool = False
    last_gamma: int = 0  # tokens in the proposal the next verdict refers to


class Hub:
    """Protocol dispatcher plus the drafting thread; see the module docstring."""

    def __init__(self, config: HubConfig, drafter: Drafter, welcome: Welcome) -> None:
        self.config = config
        self.drafter = drafter
        self.welcome = welcome
        self.vocab_size = welcome.vocab_size
        self.max_positions = drafter.draft.max_positions
        self.peers: dict[bytes, Peer] = {}
        self.sessions: dict[bytes, Session] = {}
        self.stats = HubStats()
        self.q_in: queue.Queue[DraftJob | None] = queue.Queue()
        self.q_out: asyncio.Queue[tuple[list[DraftJob], list[Proposal | Error], float]]
        self.stopping = asyncio.Event()
        self.endpoint = ""

    # ------------------------------------------------------------------ lifecycle

    async def serve(self, ctx: zmq.asyncio.Context) -> None:
        """Bind, run until ``stop()``, then shut down cleanly and log the summary."""
        loop = asyncio.get_running_loop()
        self.q_out = asyncio.Queue()
        sock = transport.router(ctx, self.config.bind)
        self.endpoint = sock.endpoint
        worker = threading.Thread(target=self._drafting_loop, args=(loop,), name="drafter")
        worker.start()
        log.info("hub listening on %s (plain text; draft %s, epoch %s)",
                 self.endpoint, self.welcome.model, self.welcome.epoch.hex()[:8])  # fmt: skip
        tasks = [
            asyncio.create_task(self._receive_loop(sock)),
            asyncio.create_task(self._send_loop(sock)),
            asyncio.create_task(self._stats_loop()),
        ]
        try:
            await self.stopping.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.q_in.put(None)
            await asyncio.to_thread(worker.join)
            sock.close()
            self._log_summary()

    def stop(self) -> None:
        """Ask ``serve`` to finish (safe from signal handlers on the loop)."""
        self.stopping.set()

    # ------------------------------------------------------------------ drafting thread

    def _drafting_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        while (job := self.q_in.get()) is not None:
            batch = [job, *self._take_pending()]
            started, cpu_started = time.perf_counter(), time.thread_time()
            self.stats.batch_started = started
            results = self.drafter.propose(batch)
            self.stats.batch_started = None
            self.stats.busy_s += time.perf_counter() - started
            self.stats.busy_cpu_s += time.thread_time() - cpu_started
            self.stats.batches += 1
            self.stats.jobs += len(batch)
            loop.call_soon_threadsafe(self.q_out.put_nowait, (batch, results, started))

    def _take_pending(self) -> list[DraftJob]:
        jobs: list[DraftJob] = []
        while len(jobs) < self.config.max_batch - 1:
            try:
                job = self.q_in.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self.q_in.put(None)  # keep the stop signal for the outer loop
                break
            jobs.append(job)
        return jobs

    # ------------------------------------------------------------------ event loop

    async def _receive_loop(self, sock: transport.Router) -> None:
        while True:
            for received in await transport.drain_router(sock):
                self.stats.messages += 1
                for reply in self.handle(received.peer, received.frames):
                    self._send(sock, received.peer, reply)

    async def _send_loop(self, sock: transport.Router) -> None:
        while True:
            batch, results, started = await self.q_out.get()
            for job, result in zip(batch, results, strict=True):
                self._deliver(sock, job, result, started)

    async def _stats_loop(self) -> None:
        reported = 0
        while True:
            await asyncio.sleep(self.config.stats_interval)
            if self.stats.jobs != reported:  # only when something happened since the last line
                reported = self.stats.jobs
                self._log_stats()

    def _send(self, sock: transport.Router, peer: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, Error):
            self.stats.errors_sent += 1
            log.info("-> %s ERROR %s: %s", peer.hex()[:8], msg.code, msg.message)
        transport.send_to(sock, peer, msg)

    def _deliver(
        self, sock: transport.Router, job: DraftJob, result: Proposal | Error,
        started: float,
    ) -> None:  # fmt: skip
        session = self.sessions.get(job.tag)
        if session is None:  # closed while drafting: nothing to send, state is already dropped
            return
        session.in_flight = False
        peer = self.peers.get(session.owner)
        if peer is not None:
            peer.stats.jobs += 1
            peer.stats.queue_wait_s += started - job.enqueued_at
        if isinstance(result, Proposal):
            session.next_seq = job.seq + 1
            session.last_gamma = len(result.tokens)
        self._send(sock, session.owner, result)

    # ------------------------------------------------------------------ dispatch

    def handle(self, peer_id: bytes, frames: list) -> list[protocol.Message]:
        """Decode one message from ``peer_id`` and act on it; returns the immediate replies."""
        peer = self.peers.get(peer_id)
        if peer is None:
            peer = Peer(peer_id, TargetStats(name=peer_id.hex()[:8]))
            self.peers[peer_id] = peer
        try:
            msg = protocol.decode(frames)
            return self._dispatch(peer, msg)
        except ProtocolError as exc:
            peer.stats.errors += 1
            if isinstance(exc, _SessionError):
                return [Error(exc.code, exc.message, tag=exc.tag, seq=exc.seq)]
            return [Error(exc.code, exc.message)]
        except Exception as exc:  # a bug must cost one reply, never the receive loop
            log.exception("internal error handling a message from %s", peer.stats.name)
            return [Error(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")]

    def _dispatch(self, peer: Peer, msg: protocol.Message) -> list[protocol.Message]:
        match msg:
            case Hello():
                return [self._hello(peer, msg)]
            case Ping(nonce=nonce):
                return [Pong(nonce)]
            case StatsRequest(nonce=nonce):
                return [self.snapshot(nonce)]
            case Pong():
                return []
            case Error(code=code, message=text):
                log.info("<- %s ERROR %s: %s", peer.stats.name, code, text)
                return []
        if not peer.welcomed:
            raise ProtocolError(ErrorCode.NOT_WELCOMED, "send HELLO before anything else")
        match msg:
            case Open():
                return self._open(peer, msg)
            case Draft():
                return self._draft(peer, msg)
            case Close(tag=tag):
                self._close(self._owned(peer, tag, None))
                return []
        raise ProtocolError(ErrorCode.UNEXPECTED, f"{type(msg).__name__} is not sent to a hub")

    def _hello(self, peer: Peer, msg: Hello) -> Welcome | Error:
        if msg.version != protocol.PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"target speaks protocol {msg.version}, hub {protocol.PROTOCOL_VERSION}",
            )
        differences = protocol.compatibility_problems(self.welcome, msg)
        if differences:
            log.warning("refused target %s (%s): %s", peer.stats.name, msg.model, differences)
            return Error(ErrorCode.INCOMPATIBLE, f"target refused: {differences}")
        peer.welcomed = True
        peer.stats.name = f"{peer.routing_id.hex()}/{msg.model}"
        log.info("target %s connected (vocab %d)", peer.stats.name, msg.vocab_size)
        return self.welcome

    def _open(self, peer: Peer, msg: Open) -> list[protocol.Message]:
        refusal = self._open_refusal(msg)
        if refusal is not None:
            return [Error(refusal[0], refusal[1], ref=msg.ref)]
        tag = secrets.token_bytes(protocol.TAG_BYTES)
        gamma = msg.gamma or self.config.gamma
        state = self.drafter.new_state(msg.prompt.tolist(), msg.sampling, gamma)
        session = Session(tag=tag, owner=peer.routing_id, state=state)
        self.sessions[tag] = session
        peer.tags.add(tag)
        peer.stats.sessions += 1
        self._enqueue(session, DraftJob(tag, 0, state, 0, ()))
        return [Opened(ref=msg.ref, tag=tag)]

    def _open_refusal(self, msg: Open) -> tuple[str, str] | None:
        gamma = msg.gamma or self.config.gamma
        problem = self._token_problem(msg.prompt, allow_empty=False)
        if len(self.sessions) >= self.config.max_sessions:
            return ErrorCode.RESOURCE_EXHAUSTED, "hub is at --max-sessions"
        if not 1 <= gamma <= self.config.max_gamma:
            return ErrorCode.INVALID_ARGUMENT, f"gamma {gamma} outside 1..{self.config.max_gamma}"
        if problem:
            return ErrorCode.INVALID_ARGUMENT, f"prompt: {problem}"
        return None

    def _draft(self, peer: Peer, msg: Draft) -> list[protocol.Message]:
        session = self._owned(peer, msg.tag, msg.seq)
        refusal = self._draft_refusal(session, msg)
        if refusal is not None:
            return [Error(refusal[0], refusal[1], tag=msg.tag, seq=msg.seq)]
        peer.stats.record_verdict(session.last_gamma, msg.accepted)
        appended = tuple(int(t) for t in msg.appended)
        self._enqueue(session, DraftJob(msg.tag, msg.seq, session.state, msg.accepted, appended))
        return []

    def _draft_refusal(self, session: Session, msg: Draft) -> tuple[str, str] | None:
        # Nothing about the session changes unless every check passes.
        if session.in_flight:
            return ErrorCode.BUSY, "a proposal for this session is being drafted"
        if msg.seq != session.next_seq:
            return ErrorCode.OUT_OF_ORDER, f"expected seq {session.next_seq}, got {msg.seq}"
        if not 0 <= msg.accepted <= session.last_gamma:
            return ErrorCode.INVALID_ARGUMENT, (
                f"accepted {msg.accepted} outside 0..{session.last_gamma}"
            )
        problem = self._token_problem(msg.appended, allow_empty=True)
        if problem:
            return ErrorCode.INVALID_ARGUMENT, f"appended: {problem}"
        return None

    def _owned(self, peer: Peer, tag: bytes, seq: int | None) -> Session:
        session = self.sessions.get(tag)
        if session is None:
            raise _SessionError(ErrorCode.UNKNOWN_SESSION, "no such session", tag, seq)
        if session.owner != peer.routing_id:
            log.warning("target %s named a session it does not own", peer.stats.name)
            raise _SessionError(ErrorCode.FORBIDDEN, "session belongs to another target", tag, seq)
        return session

    def _close(self, session: Session) -> None:
        del self.sessions[session.tag]
        peer = self.peers.get(session.owner)
        if peer is not None:
            peer.tags.discard(session.tag)

    def _enqueue(self, session: Session, job: DraftJob) -> None:
        session.in_flight = True
        self.q_in.put(job)

    def _token_problem(self, ids: np.ndarray, allow_empty: bool) -> str | None:
        if ids.size == 0:
            return None if allow_empty else "empty"
        if ids.size > max(MAX_APPENDED, self.max_positions or 0):
            return f"{ids.size} tokens is too many"
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            return f"token id outside 0..{self.vocab_size - 1}"
        return None

    # ------------------------------------------------------------------ reporting

    def snapshot(self, nonce: int = 0) -> Stats:
        """Hub-wide counters since start, as sent in reply to STATS_REQUEST."""
        peers = [p.stats for p in self.peers.values()]
        return Stats(
            nonce=nonce,
            wall_s=time.perf_counter() - self.stats.started,
            busy_s=self.stats.busy_now(),
            jobs=self.stats.jobs,
            batches=self.stats.batches,
            sessions=len(self.sessions),
            targets=sum(p.welcomed for p in self.peers.values()),
            rounds=sum(s.rounds for s in peers),
            proposed=sum(s.proposed for s in peers),
            accepted=sum(s.accepted for s in peers),
            queue_wait_s=sum(s.queue_wait_s for s in peers),
        )

    def _log_stats(self) -> None:
        log.info(self.stats.line(len(self.sessions), sum(p.welcomed for p in self.peers.values())))
        for peer in self.peers.values():
            if peer.stats.jobs:
                log.info(peer.stats.line())

    def _log_summary(self) -> None:
        log.info("hub stopped after %.1f s; summary:", time.perf_counter() - self.stats.started)
        self._log_stats()


class _SessionError(ProtocolError):
    def __init__(self, code: str, message: str, tag: bytes, seq: int | None) -> None:
        super().__init__(code, message)
        self.tag = tag
        self.seq = seq


# ---------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> HubConfig:
    """argparse -> HubConfig."""
    from starsd.models import DEFAULT_DRAFT_DIR

    p = argparse.ArgumentParser(prog="python -m starsd.hub", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_DRAFT_DIR), help="draft model dir or hub id")
    p.add_argument("--bind", default=HubConfig.bind)
    p.add_argument("--gamma", type=int, default=HubConfig.gamma, help="default draft length")
    p.add_argument("--max-gamma", type=int, default=HubConfig.max_gamma)
    p.add_argument("--device", default=HubConfig.device, help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=HubConfig.dtype, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--max-sessions", type=int, default=HubConfig.max_sessions)
    p.add_argument("--max-batch", type=int, default=HubConfig.max_batch)
    p.add_argument("--threads", type=int, default=HubConfig.threads, help="torch threads")
    p.add_argument("--stats-interval", type=float, default=HubConfig.stats_interval)
    p.add_argument("--draft-kind", default=HubConfig.draft_kind, choices=sorted(DRAFTERS),
                   help="llm: a draft causal LM; null: no model work (overhead benchmarks)")
    return HubConfig(**{k: v for k, v in vars(p.parse_args(argv)).items()})


def build_hub(config: HubConfig) -> Hub:
    """Load the draft model and assemble a hub (no sockets yet)."""
    import torch

    from starsd import models

    torch.set_num_threads(config.threads)
    draft = models.load_causal_lm(config.model, config.device, config.dtype)
    welcome = Welcome(
        model=Path(config.model).name or config.model,
        vocab_size=draft.vocab_size,
        tokenizer=draft.tokenizer_fingerprint,
        epoch=secrets.token_bytes(8),
        default_gamma=config.gamma,
        max_gamma=config.max_gamma,
        draft_kind=config.draft_kind,
    )
    return Hub(config, DRAFTERS[config.draft_kind](draft), welcome)


async def run(config: HubConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    hub = build_hub(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, hub.stop)
    ctx = transport.new_context()
    try:
        await hub.serve(ctx)
    finally:
        ctx.term()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m starsd.hub``."""
    logging.basicConfig(
        level=os.environ.get("STARSD_LOG", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    config = parse_args(argv)
    transport.run_loop(run(config))


if __name__ == "__main__":
    main()
