"""One emulated sequence's rounds, apart from how its messages travel.

:class:`SequenceRounds` is what an emulated target does with each PROPOSAL of one sequence:
check it, draw the verdict (:func:`answer`: how long the target's forward would take, what it
accepts), and, once that time has passed, count the round where it ended (:func:`account`) and
say which DRAFT goes back. Both drivers use it: the asyncio one (:mod:`scripts.emulate.emulated`,
the target's real hub clients) and the poller (:mod:`scripts.emulate.poller`), so their reports
mean the same thing. Pure: no sockets, no event loop.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from scripts.emulate.acceptance import accepted_count, accepted_path
from scripts.emulate.config import EmulationConfig, Phases
from scripts.emulate.report import TargetRecord
from starsd import protocol
from starsd.protocol import Proposal


@dataclass(frozen=True)
class Answer:
    """A target's verdict on ``proposal``, and how long its forward takes (``wait_s``)."""

    proposal: Proposal
    wait_s: float
    accepted: int
    appended: list[int]
    path: list[int] | None  # the accepted path after a token tree; None after a chain
    wire_bytes: int | None = None  # the proposal's size as received (None: not known)

    @property
    def forward_s(self) -> float:
        """What a real target reports as its forwards' mean time (Draft.forward_us): the
        verification's, or one step's of a span alone."""
        return self.wait_s if len(self.proposal.tokens) else self.wait_s / len(self.appended)


def answer(
    cfg: EmulationConfig,
    rng: random.Random,
    vocab: int,
    msg: Proposal,
    phases: Phases,
    left: int,
    now: float,
    wire_bytes: int | None = None,
) -> Answer:
    """Verify the proposal (the verify time of its every node, the accepted count drawn), or
    decode the span alone (as far as the sequence goes) that it asks for. A span stops where
    the run does (its tokens after the end would never count)."""
    gamma = len(msg.tokens)
    if gamma:
        alpha, path = phases.alpha(cfg, now), None
        if msg.parents is None:  # (the draws in this order: the runs' seeds replay)
            accepted = accepted_count(rng, alpha, gamma)
        else:
            path = accepted_path(rng, alpha, cfg.sibling_alpha, msg.parents.tolist())
            accepted = len(path)
        bonus = [rng.randrange(vocab)]
        return Answer(msg, cfg.verify_s(gamma), accepted, bonus, path, wire_bytes)
    span = max(1, min(msg.alone, left))
    wait_s = min(span * cfg.step_alone_s, max(0.0, phases.finish - now))
    appended = [rng.randrange(vocab) for _ in range(span)]
    return Answer(msg, wait_s, 0, appended, None, wire_bytes)


def new_trace(target: int, phases: Phases) -> dict:
    """An empty ``--trace-gamma`` record for a session of ``target`` opened now."""
    return {"target": target, "opened_s": since(phases), "gammas": [], "switch_round": None}


def since(phases: Phases) -> float | None:
    """Seconds since the warm-up ended (None during the warm-up)."""
    return time.perf_counter() - phases.bounds[0] if phases.bounds else None


class SequenceRounds:
    """One sequence of one emulated target: its rounds' state and their accounting.

    Owned by whichever driver runs the target (one thread or one event loop): no lock.
    Per PROPOSAL: :meth:`take` (None: the sequence ends here), wait ``answer.wait_s``, then
    :meth:`settle`, which returns the DRAFT's seq.
    """

    def __init__(
        self,
        cfg: EmulationConfig,
        rng: random.Random,
        vocab: int,
        phases: Phases,
        record: TargetRecord,
        endpoint: str,
        trace: dict | None = None,
    ) -> None:
        self.cfg, self.rng, self.vocab = cfg, rng, vocab
        self.phases, self.record, self.endpoint, self.trace = phases, record, endpoint, trace
        self.seq, self.generated = 0, 0
        self.asked = time.perf_counter()  # when the OPEN (then each DRAFT) went out
        self.received = self.asked

    def wants_more(self) -> bool:
        """Whether the sequence goes on (tokens left and the run not over)."""
        return self.generated < self.cfg.max_new_tokens and time.perf_counter() < self.phases.finish

    def take(self, msg: protocol.Message, wire_bytes: int | None = None) -> Answer | None:
        """The answer to ``msg`` (``wire_bytes``: its size as received, if known), or None when
        the sequence ends here (an ERROR such as CONTEXT_FULL, or a proposal with nothing to
        verify nor decode). Raises on anything but a PROPOSAL or an ERROR."""
        self.received = time.perf_counter()
        if isinstance(msg, protocol.Error):
            self.record.errors += 1
            return None
        if not isinstance(msg, Proposal):
            raise RuntimeError(f"hub: {msg}")
        if not self.record.had_proposal:
            self.record.had_proposal = True
            self.phases.first_proposals += 1
        self._trace(msg)
        if not len(msg.tokens) and msg.alone <= 0:  # the hub cannot draft further (its
            return None  # context); a real target would finish alone
        left = self.cfg.max_new_tokens - self.generated
        now = self.received
        return answer(self.cfg, self.rng, self.vocab, msg, self.phases, left, now, wire_bytes)

    def _trace(self, msg: Proposal) -> None:
        trace = self.trace
        if trace is None:
            return
        if trace["switch_round"] is None and self.received >= self.phases.switch:
            trace["switch_round"] = len(trace["gammas"])
        trace["gammas"].append(len(msg.tokens))

    def settle(self, ans: Answer) -> int:
        """Count the round ``ans`` answered (its wait over) and return the next DRAFT's seq."""
        msg = ans.proposal
        times = (self.asked, self.received)
        step_s = self.cfg.step_alone_s
        in_window = account(self.record, self.phases, msg, ans, times, self.seq == 0, step_s)
        tokens = ans.accepted + len(ans.appended)
        if len(msg.tokens) and in_window:  # (the same clock reading as the totals: they add up)
            self.record.per_hub(self.endpoint).add(tokens, self.received - self.asked)
        self.generated += tokens
        self.seq += 1
        self.asked = time.perf_counter()
        return self.seq


def account(
    record: TargetRecord,
    phases: Phases,
    msg: Proposal,
    ans: Answer,
    times: tuple[float, float],
    first: bool,
    step_s: float = 0.0,
) -> bool:
    """Count the round where it ended: in a window slice, a calibration slice, or neither;
    True when a verified round was counted in the window.
    ``times``: when the request went out (the DRAFT or OPEN) and when the proposal came in.

    A span decoded alone (gamma 0, ``step_s`` per token) is counted token by token, each where
    it was decoded: spans last far longer than a verify (up to 256 steps), and counting a whole
    span where it ended would credit its tokens to the wrong slices and lose the span in
    progress when the run ends.
    """
    asked, received = times
    now = time.perf_counter()
    appended = ans.appended
    if not len(msg.tokens):
        decoded = [received + (i + 1) * step_s for i in range(len(appended))]
        counted = sum(1 for t in decoded if t <= now and phases.kind(t) == "window")
        if counted:  # (latency: the span's time spread over all its tokens)
            share = (now - asked) * counted / len(appended)
            record_round(record, msg, 0, appended[:counted], share, ans.wire_bytes)
        return False
    kind = phases.kind(now)  # by when the round ends; rounds after the end do not count
    if kind == "window":
        record_round(record, msg, ans.accepted, appended, now - asked, ans.wire_bytes)
        record.verify_s += now - received  # the timer overshoots the nominal time
        if not first:  # after a DRAFT (the first proposal answers the OPEN, prefill included)
            record.proposal_wait_s.append(received - asked)
    elif kind == "calibration":
        record.calibration_rounds += 1
        record.calibration_verify_s += now - received
    return kind == "window"


# A DRAFT's bytes besides its appended tokens: header and framing
DRAFT_OVERHEAD_BYTES = 60


def record_round(
    record: TargetRecord,
    msg: Proposal,
    accepted: int,
    appended: list[int],
    round_s: float,
    wire_bytes: int | None = None,
) -> None:
    """One round in the window: a verify (gamma >= 1), or a span decoded alone (gamma 0);
    ``wire_bytes``: the proposal's size as received (None: encoded again to count it)."""
    gamma = len(msg.tokens)
    tokens = accepted + len(appended)
    if msg.parents is not None:  # a token tree: its nodes are no chain's draft positions
        record.tree_rounds += 1
        record.tree_tokens += tokens
    else:
        record.gammas[gamma] = record.gammas.get(gamma, 0) + 1
        record.proposed += gamma
        record.accepted += accepted
    if gamma:
        record.rounds += 1
        record.round_s += round_s
    else:
        record.alone_spans += 1
        record.alone_tokens += tokens
    record.tokens += tokens
    sent = proposal_bytes(msg) if wire_bytes is None else wire_bytes
    record.bytes += sent + DRAFT_OVERHEAD_BYTES + 4 * len(appended)
    record.token_latency_s.extend([round_s / tokens] * tokens)


def proposal_bytes(msg: Proposal) -> int:
    """The PROPOSAL's size on the wire (its frames' bytes)."""
    return sum(len(bytes(f)) for f in protocol.encode(msg))
