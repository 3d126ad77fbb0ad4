"""Synthetic sessions that drive a proposer as the hub does: jobs built from OPEN and DRAFT.

Each session starts from a random prompt and gets realistic verdicts (``ACCEPTED`` drafts kept
and one token of the target's appended per round, so its context grows as a real one does);
EAGLE jobs carry random target features of the right shape. Used to time ``propose`` outside a
running hub (``starsd profile draft``, the service and scale benchmarks).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

ACCEPTED = 2  # drafts kept per round; then the target appends one token of its own


@dataclass
class Session:
    """One fake session: the proposer's state and what it proposed last."""

    state: Any
    proposed: tuple[int, ...] = ()
    rounds: int = 0


class FakeSessions:
    """Sessions of one proposer, with jobs built as the hub builds them from OPEN and DRAFT."""

    def __init__(self, proposer: Any, vocab_size: int, gamma: int, seed: int = 0) -> None:
        from starsd.protocol import SamplingParams

        self.proposer = proposer
        self.vocab_size = vocab_size
        self.gamma = gamma
        self.params = SamplingParams()  # greedy
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)

    def open(self, count: int, prompt_tokens: int) -> list[Session]:
        """``count`` sessions with random prompts, their first proposal drafted (prefill)."""
        sessions = []
        for _ in range(count):
            prompt = [self.rng.randrange(self.vocab_size) for _ in range(prompt_tokens)]
            sessions.append(Session(self.proposer.new_state(prompt, self.params, self.gamma)))
        for start in range(0, count, 16):
            self.propose(sessions[start : start + 16], first=True)
        return sessions

    def propose(self, sessions: list[Session], first: bool = False) -> float:
        """One round for every session in one ``propose`` call; its wall time in seconds."""
        from starsd.protocol import Proposal

        jobs = [self._job(s, first) for s in sessions]
        started = time.perf_counter()
        results = self.proposer.propose(jobs)
        elapsed = time.perf_counter() - started
        for session, result in zip(sessions, results, strict=True):
            if not isinstance(result, Proposal):
                raise RuntimeError(f"{self.proposer.kind}: {result}")
            session.proposed = tuple(int(t) for t in result.tokens)
            session.rounds += 1
        return elapsed

    def _job(self, session: Session, first: bool) -> Any:
        from starsd.hub.drafters.base import DraftJob

        appended: tuple[int, ...] = ()
        if first:  # OPEN: the prompt's features, all positions but the last
            accepted = 0
            n_features = len(session.state.tokens) - 1
        else:  # DRAFT: accept a prefix, append the target's own token
            accepted = min(ACCEPTED, len(session.proposed))
            appended = (self.rng.randrange(self.vocab_size),)
            n_features = accepted + len(appended)
        features = None
        if self.proposer.feature_width:
            features = self.np_rng.standard_normal(
                (n_features, self.proposer.feature_width)
            ).astype(np.float16)
        return DraftJob(
            b"%08d" % id(session),
            session.rounds,
            session.state,
            accepted,
            appended,
            features=features,
        )
