"""Load-aware draft length (``--gamma auto``): what each session's next proposal should hold.

Pure: no torch, no threads, no clock of its own (every time is passed in), so each rule is
unit-tested directly (tests/test_policy.py). The drafting thread applies it through
:class:`starsd.hub.pacing.Pacer`; the choice itself is :func:`starsd.goodput.best_gamma`, shared
with the analytic model.

Terms (per session, times in seconds):

  alpha_i   acceptance of draft position i given positions 1..i-1 were accepted (i = 1..G);
  E[L(g)]   tokens a round with g draft tokens commits: 1 + sum_{k=1..g} prod_{i<=k} alpha_i;
  S(B, g)   the hub's service time for a batch of B jobs whose longest proposal has g tokens,
            fitted per B as a(B) + (g - 1) b(B) (one feed forward, then g - 1 decode steps),
            b(B) shrunk toward a line over B fitted to every size's data (ServiceModel);
  R(g)      the round trip outside the hub, from our proposal leaving to the target's next DRAFT
            arriving (its verify of g + 1 positions plus the link), less the time the target
            says it spent on forwards that did not carry the sequence meanwhile (other
            sequences' prefills, rows out of step: Draft.others_us; its gamma does not change
            it), as r0 + r1 g: once the target's own forwards (Draft.forward_us)
            against their gamma (its steps alone at 0) tell a slope, that line plus the time
            outside the forward (TargetPacing.round_trip_line), else a line fitted to the
            round trips; at a gamma whose forwards the rounds have shown, the forward
            measured there rather than the line's (TargetPacing.round_trips). A round
            trip's slope is the link's and the target's queues' noise more than its verify's:
            at one CPU target at --concurrency 8 it read 0 for a verify that costs 12 ms more
            per draft token, and auto drafted gamma 3-8 where 2 was best;
  W         how long the session's jobs wait in Q_in before their batch starts;
  T_alone   the target's own decoding step: measured from the spans it decodes alone
            (R over the span / its tokens; the link is spread over the span), and before the
            first span approximated by R(0), the link plus a verify of one position (a decode
            step), once gamma has varied enough to tell R's slope; by R(1) before (the
            intercept of a fit of one gamma is noise). Both err high (by the link; on a
            compute-bound target by far more, see the warm-up), so a guess switches
            speculation off only when it clearly does not pay, and the warm-up's span alone
            measures it.

Warm-up: the target's first ``warmup_rounds`` verdicts come from rounds of the start gamma;
then a span of ``explore_tokens`` alone times T_alone, once per target (until its first span is
timed, each of its sessions takes one, so the target decodes them alone together; its later
sessions share the figure). It is measured rather than guessed because no round trip tells
it: on a compute-bound target a verify of 5 positions costs ~1.8-2.2x a step, so R(1) of a
fit at one gamma (R(4), its slope 0) read 150 ms for a 65 ms step, and speculation at
acceptance 0.1 (0.54x the target alone) looked better than decoding alone. (Warm-up rounds
alternating the start gamma with 1, to fit R's slope, cost 14% against the best fixed gamma at
N = 8 emulated targets: two noisy points set a slope that the later rounds, at one gamma,
kept.)

Rule (:meth:`GammaPolicy.choose`), over g in 0..G:

  own(g) = E[L(g)] / (W + S(B, g) + R(g)) for g >= 1, own(0) = 1 / T_alone
           (the session's own tokens per second);
  under-loaded hub: g = argmax own(g);
  fully loaded hub (jobs were left waiting when the batch started, or the hub was busy >= 95%
  of the recent batches' time): among g >= 1 with own(g) >= own(0), g = argmax
  E[L(g)] / (S(B, g) / B), the tokens this session makes per second of hub time it takes (its
  share of the batch); 0 when no such g exists.

Then stability: while the best is within ``common_slack`` (10%) of the gamma the hub's auto
sessions favour most lately (:class:`CommonGamma`), that one is chosen (sessions on one gamma
come back together and are drafted in one batch), else while it is within ``hysteresis`` (5%)
of the session's last gamma, that stays. A gamma above the common one is judged by the whole
batch it would delay (:func:`starsd.goodput.deviation_rates`): one session drafting 7 where
its batch of 8 drafts 2 made every batch it joined take S(8, 7), and auto ran 0.83x the best
fixed gamma at N = 8. What moves the common gamma is the votes: each session votes for its
best gamma were its batch to draft alike, so the batch moves together or not at all.

The figures are per target, not per session: every auto session of one target learns into and
decides from one :class:`TargetPacing` (estimate, round trip, T_alone, W), live, and a target's
new session starts from it (:class:`OwnerMemory`), not from the prior. A target verifies its
sequences in one forward, so its sessions should all draft or all decode alone; on shared
figures they choose alike.

gamma 0: the target decodes ``alone`` tokens itself, then its DRAFT (accepted 0) carries them;
after that span the session drafts once more with a small gamma (a probe, to re-estimate), and
each consecutive span that the probe does not end doubles, up to ``max_alone``.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from starsd.goodput import deviation_rates, gamma_rates, pick_gamma
from starsd.hub.estimates import AcceptanceEstimate, LinearFit

_OUTSIDE_SMOOTHING = 0.1  # weight of the newest round in the time outside the target's forward
_FORWARD_AT_SMOOTHING = 0.2  # weight of the newest forward at its draft-token count
_FORWARD_AT_MIN = 2  # forwards at a count before R(g) takes them over the line


@dataclass(frozen=True)
class PolicyParams:
    """The knobs of the policy; the defaults are what ``--gamma auto`` uses."""

    max_gamma: int = 16
    start_gamma: int = 4  # the first rounds' gamma, until the estimate has data
    warmup_rounds: int = 3  # verdicts (with their round trips) before the policy decides
    prior_alpha: float = 0.6
    prior_weight: float = 2.0  # pseudo-observations behind the prior (per position, and pooled)
    forget: float = 0.97  # per verdict: an observation's weight after n more is forget**n
    # a shift of acceptance (AcceptanceEstimate): how far the recent verdicts may stray, in
    # standard deviations, before the old ones are cut to shift_keep of their weight
    shift_z: float = 3.5
    shift_keep: float = 0.0
    loaded_busy: float = 0.95  # busy fraction of recent batches that means fully loaded
    # keep the last gamma while the best one is at most this much better: the estimates are
    # noisy and the optimum is flat (alpha 0.7: gamma 3..5 within 1.5% of each other), so a
    # bare argmax flaps, and each flap to a short gamma or to decoding alone costs 7-40%
    hysteresis: float = 0.05
    # and the hub's common gamma while the best is at most this much better (see choose)
    common_slack: float = 0.10
    alone_tokens: int = 16  # the first span a session decodes alone
    # the span alone that measures T_alone, once per target after its warm-up (0: never)
    explore_tokens: int = 4
    max_alone: int = 256  # the longest span (consecutive spans double)

    def __post_init__(self) -> None:
        if self.max_gamma < 1 or not 1 <= self.start_gamma <= self.max_gamma:
            raise ValueError(
                f"need 1 <= start_gamma <= max_gamma, got {self.start_gamma}, {self.max_gamma}"
            )
        if not 0.0 < self.forget < 1.0 or not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError("forget must be in (0, 1) and prior_alpha in [0, 1]")
        if not 1 <= self.alone_tokens <= self.max_alone:
            raise ValueError("need 1 <= alone_tokens <= max_alone")
        if self.explore_tokens < 0:
            raise ValueError("need explore_tokens >= 0")
        if self.shift_z <= 0 or not 0.0 <= self.shift_keep <= 1.0:
            raise ValueError("need shift_z > 0 and shift_keep in [0, 1]")
        if self.hysteresis < 0 or self.common_slack < 0:
            raise ValueError("hysteresis and common_slack must be >= 0")


class LoadMeter:
    """Whether the hub is fully loaded: jobs left waiting when a batch starts, or busy for at
    least ``threshold`` of the recent batches' time (busy and idle seconds smoothed over the
    last few batches). Owned by the drafting thread."""

    def __init__(self, threshold: float = 0.95, smoothing: float = 0.2) -> None:
        self.threshold, self.smoothing = threshold, smoothing
        self.busy = 0.0  # smoothed seconds per batch spent drafting
        self.idle = 0.0  # smoothed seconds per batch spent waiting for jobs
        self.ended: float | None = None  # when the last batch finished

    def start(self, now: float, backlog: bool) -> bool:
        """A batch starts at ``now``; returns whether the hub is fully loaded."""
        if self.ended is not None:
            self.idle += self.smoothing * (max(now - self.ended, 0.0) - self.idle)
        return self.loaded(backlog)

    def loaded(self, backlog: bool) -> bool:
        """Whether the hub counts as fully loaded now, as of the last batch."""
        return backlog or self.busy_fraction() >= self.threshold

    def finish(self, now: float, seconds: float) -> None:
        """The batch took ``seconds`` and ended at ``now``."""
        self.busy += self.smoothing * (seconds - self.busy)
        self.ended = now

    def busy_fraction(self) -> float:
        total = self.busy + self.idle
        return self.busy / total if total > 0 else 0.0


@dataclass(frozen=True)
class Load:
    """What the drafting thread knows about the batch being formed."""

    batch: int  # B: jobs in this batch
    loaded: bool  # the hub is fully loaded (see LoadMeter)
    costs: Sequence[float]  # S(B, g) for g = 0..G (index 0 unused)
    common: int = 0  # the gamma the hub's auto sessions draft most lately (CommonGamma), 0: none
    # T_alone measured on the hub's sessions lately, for a session that has not measured its own
    # (R(1), the fallback, errs high by the link and a verify: at N = 64 a session that had not
    # decoded alone yet rarely started to, and auto read 0.91x or 1.07-1.22x the best fixed
    # gamma as 17% or 30% of the rounds happened to be alone)
    alone_s: float | None = None


class CommonGamma:
    """The gamma (>= 1) the hub's auto sessions favour most lately: each round a vote (the
    session's best gamma were its batch to draft alike, ``SessionPacing.vote``), every vote's
    weight ``decay`` times smaller after each later one. Owned by the drafting thread."""

    def __init__(self, max_gamma: int, decay: float = 0.98) -> None:
        self.decay = decay
        self.votes = [0.0] * (max_gamma + 1)

    def vote(self, gamma: int) -> None:
        """An auto session chose ``gamma`` (0, alone, is no vote: it drafts nothing)."""
        if 1 <= gamma < len(self.votes):
            self.votes = [v * self.decay for v in self.votes]
            self.votes[gamma] += 1.0

    def mode(self) -> int:
        """The gamma with the most weight, 0 before any vote."""
        best = max(range(len(self.votes)), key=self.votes.__getitem__)
        return best if self.votes[best] > 0 else 0


@dataclass
class Pending:
    """A verdict the proposer has not applied yet: it arrived with a job answered with gamma 0,
    and goes with the session's next drafted job (the tokens decoded alone appended to it)."""

    accepted: int
    appended: list[int]
    features: list = field(default_factory=list)  # EAGLE: each [n, H] array, in order


@dataclass
class TargetPacing:
    """What the auto sessions of one target learn, together and live: acceptance per position,
    the round trip outside the hub R(g), T_alone, the queue wait W and the gamma last chosen.
    Every auto session of the target (by its owner key) reads and updates this one object,
    and its next session starts from it (:class:`OwnerMemory`).

    Why shared, not per session: a target batches its sequences into one forward, so what one
    sequence's round costs depends on what the others do. Sessions deciding apart mixed alone
    steps and verifications in the target's forwards (every row padded to the longest, and the
    alone rows waiting for the others' proposals), which made decoding alone look slow and
    speculation look cheap: one target at ``--concurrency 4`` ran 0.74x the target alone. On
    shared figures its sessions choose alike, so its forwards are all steps or all
    verifications, and each figure is measured in the state it predicts. Owned by the drafting
    thread."""

    estimate: AcceptanceEstimate
    round_trip: LinearFit = field(default_factory=lambda: LinearFit(forget=0.9, ridge=0.5))
    # the target's own forwards (Draft.forward_us) against their draft tokens (0: steps alone):
    # slow to forget, for its sessions report one forward each and its cost shape is the
    # hardware's (at 0.9 the eight sessions of one forward erased the steps' points at once)
    forward: LinearFit = field(default_factory=lambda: LinearFit(forget=0.98, ridge=0.5))
    # the same forwards per draft-token count: (smoothed seconds, how many), for R(g) at the
    # counts its rounds have shown (see :meth:`round_trips`)
    forward_at: dict[int, tuple[float, int]] = field(default_factory=dict)
    outside: float | None = None  # smoothed R less the forward that carried it: link, queues
    alone_step: float | None = None  # measured T_alone (smoothed), None before any span
    wait: float = 0.0  # smoothed W
    chosen: int = 0  # the gamma its sessions chose last (a new session starts there)
    # the round shapes its figures found worth trying (Pacer._trees_worth), and for which
    # (ShapeChooser phase, tree node budget): worked out once per phase, not per job
    shapes_worth: tuple[tuple[int, int], frozenset[int]] | None = None
    # its sessions alive now (a session's pacing goes when its draft state does)
    sessions: weakref.WeakSet[SessionPacing] = field(default_factory=weakref.WeakSet)

    def round_trip_line(self) -> tuple[float, float]:
        """(r0, r1) of R(g) = r0 + r1 g: once the target's forwards tell a slope, their line
        plus the time outside them (what a round costs were all its sessions at g: a round
        drafted beside longer proposals waits for their forward, which the line prices at its
        own g); else the round trips' own line."""
        line = self._forward_line()
        return line if line is not None else self.round_trip.coefficients()

    def round_trips(self, top: int) -> list[float]:
        """R(x) for x = 0..top draft tokens (or tree nodes: a verify of as many positions): the
        forward measured at x, where the target's rounds have shown it at least twice, plus
        the time outside the forward; else the line (:meth:`round_trip_line`).

        Why not the line alone: a CPU target's verify cost is no line in its positions (MKL's
        small-M kernels: 2, 3 and 5 positions cost 1.10x, 1.16x and 1.79x a step), and a line
        through the warm-up's gamma 4 and the steps alone priced gamma 2 ~10 ms above what its
        own rounds had measured, so a session at one target settled at gamma 1 where gamma 2
        made 2-4% more (and its round trips never showed gamma 2 again)."""
        line = self._forward_line()
        r0, r1 = line if line is not None else self.round_trip.coefficients()
        rounds = [r0 + r1 * x for x in range(top + 1)]
        if line is not None:  # (then the time outside the forward is known)
            outside = self.outside or 0.0
            for x, (seconds, count) in self.forward_at.items():
                if x <= top and count >= _FORWARD_AT_MIN:
                    rounds[x] = outside + seconds
        return rounds

    def observe_forward(self, tokens: int, seconds: float) -> None:
        """The target's forward that carried a round of ``tokens`` draft tokens (0: its steps
        alone) took ``seconds``."""
        self.forward.observe(tokens, seconds)
        old, count = self.forward_at.get(tokens, (seconds, 0))
        self.forward_at[tokens] = (old + _FORWARD_AT_SMOOTHING * (seconds - old), count + 1)

    def _forward_line(self) -> tuple[float, float] | None:
        """R's line from the target's forwards and the time outside them; None until they
        tell a slope (or no round has reported its forward)."""
        if self.outside is None or not (self.forward.known and self.forward.slope_told()):
            return None
        f0, f1 = self.forward.coefficients()
        return self.outside + f0, f1

    def observe_round(self, gamma: int, seconds: float, forward_s: float) -> None:
        """A round of ``gamma`` draft tokens took ``seconds`` outside the hub, ``forward_s`` of
        them in the target's forward that verified it (0: not reported)."""
        self.round_trip.observe(gamma, seconds)
        if forward_s > 0:
            outside = max(seconds - forward_s, 0.0)
            old = self.outside
            self.outside = outside if old is None else old + _OUTSIDE_SMOOTHING * (outside - old)

    def slope_told(self) -> bool:
        """Whether the slope of :meth:`round_trip_line` is the data's, not a prior."""
        return self._forward_line() is not None or self.round_trip.slope_told()

    def batched(self, session: SessionPacing) -> bool:
        """Whether another of its sessions is open beside ``session`` (the target's forwards
        then carry other rows than this session's)."""
        return any(other is not session for other in self.sessions)


@dataclass(eq=False)  # by identity: its target keeps a weak set of its sessions
class SessionPacing:
    """One session's policy state. Made by :class:`starsd.hub.pacing.Pacer` on the session's
    first job and kept on its draft state (``ChainState.pacing``): the drafting thread's only,
    like the rest of that state. The estimates live on ``shared`` (its target's, for an auto
    session; its own, for a fixed one); the session keeps its own round in flight."""

    fixed: int | None  # a gamma the session keeps (OPEN named it, or --gamma N); None: auto
    shared: TargetPacing
    sent_at: float | None = None  # when it left the drafting thread
    pending: Pending | None = None
    alone_span: int = 16  # tokens of the next span alone
    chosen: int = 0  # the last gamma chosen
    # its vote for the hub's common gamma: the best gamma were its batch to draft alike (the
    # choice itself may differ: it follows the common gamma while near, never leads alone)
    vote: int = 0
    probing: bool = False  # the proposal in flight is the probe after a span alone
    explored: bool = False  # it decoded alone to time its target's T_alone
    shape: int = 0  # the proposal in flight: 0 a chain, k the hub's k-th tree shape (shapes.py)
    # the ShapeChooser phases of the proposal in flight and of the one before (-1: none)
    shape_phases: tuple[int, int] = (-1, -1)
    asked_at: float | None = None  # when the job that asked for it was queued
    # the proposal in flight is a chain drafted while another session of its target had a tree
    # in flight: the target may verify it beside their nodes, so its round says nothing of a
    # chain's R(g)
    beside_trees: bool = False

    @property
    def estimate(self) -> AcceptanceEstimate:
        """Acceptance per position (the target's, shared)."""
        return self.shared.estimate

    @property
    def round_trip(self) -> LinearFit:
        """R(g), the round trip outside the hub (the target's, shared)."""
        return self.shared.round_trip

    @property
    def alone_step(self) -> float | None:
        """Measured T_alone (the target's, shared), None before any span."""
        return self.shared.alone_step

    @alone_step.setter
    def alone_step(self, step: float | None) -> None:
        self.shared.alone_step = step

    @property
    def wait(self) -> float:
        """Smoothed W (the target's, shared)."""
        return self.shared.wait

    @wait.setter
    def wait(self, seconds: float) -> None:
        self.shared.wait = seconds

    def choose(self, gamma: int, vote: int | None = None) -> int:
        """Record ``gamma`` as this round's choice (the session's and its target's), and
        ``vote`` (default: ``gamma``) as its vote for the common gamma."""
        self.chosen = self.shared.chosen = gamma
        self.vote = gamma if vote is None else vote
        return gamma

    def step_alone(self, hub: float | None = None) -> float | None:
        """T_alone: measured, else ``hub`` (the hub's other sessions' lately), else R(0) once
        the round trip's slope is told, R(1) before (see the module docstring), None while
        unknown."""
        if self.alone_step is not None:
            return self.alone_step
        if hub is not None:
            return hub
        if not self.round_trip.known:
            return None
        r0, r1 = self.shared.round_trip_line()
        # (an intercept clamped to 0, a fit bent by one slow round, is no step: R(1) then)
        step = r0 if self.shared.slope_told() and r0 > 0 else r0 + r1
        return step if step > 0 else None


class OwnerMemory:
    """The shared pacing of each target (by its owner key, a CURVE key or a routing id) that
    :meth:`GammaPolicy.new_session` gives its auto sessions; at most ``limit`` targets, the
    least recently seen forgotten first. A target's entry outlives its sessions, so its next
    session starts from what the last ones learnt. Owned by the drafting thread."""

    def __init__(self, limit: int = 1024) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._latest: OrderedDict[bytes, TargetPacing] = OrderedDict()

    def get(self, owner: bytes) -> TargetPacing | None:
        """The target's shared pacing, None if none is remembered."""
        return self._latest.get(owner)

    def put(self, owner: bytes, pacing: TargetPacing) -> None:
        """``pacing`` is the target's shared pacing (and the target the most recently seen)."""
        self._latest[owner] = pacing
        self._latest.move_to_end(owner)
        while len(self._latest) > self.limit:
            self._latest.popitem(last=False)


class GammaPolicy:
    """Chooses each round's gamma from a session's estimate and the hub's load (module
    docstring). Stateless apart from its parameters: one instance serves every session."""

    def __init__(self, params: PolicyParams = PolicyParams()) -> None:
        self.params = params

    def new_session(
        self, fixed: int | None, start: int | None = None, like: TargetPacing | None = None
    ) -> SessionPacing:
        """A session's state; ``fixed`` None for auto (its first rounds draft ``start``).

        ``like``: its target's shared pacing (:class:`OwnerMemory`). An auto session then
        learns into it and decides from it, with the target's other sessions (see
        :class:`TargetPacing`), and starts from its latest choice instead of the prior and a
        warm-up: a session lasts only a few dozen rounds (128 tokens at alpha 0.7: ~46), and
        started from the prior (0.6, below the emulated 0.7) and from noisy first verdicts
        its first ~15 rounds chose gamma 1..16. What it inherits is forgotten like new
        verdicts, so a target whose acceptance changed is followed as fast as before.
        """
        p = self.params
        if fixed is None and like is not None:
            chosen = like.chosen or p.start_gamma
            joined = SessionPacing(
                fixed=None, shared=like, alone_span=p.alone_tokens, chosen=chosen
            )
            like.sessions.add(joined)
            return joined
        estimate = AcceptanceEstimate(
            p.max_gamma, p.prior_alpha, p.prior_weight, p.forget, p.shift_z, p.shift_keep
        )
        pacing = SessionPacing(
            fixed=fixed, shared=TargetPacing(estimate), alone_span=p.alone_tokens
        )
        pacing.shared.sessions.add(pacing)
        pacing.choose(fixed if fixed is not None else (start or p.start_gamma))
        if fixed == 0:  # --gamma 0: never drafts, so the longest spans cost fewest round trips
            pacing.alone_span = p.max_alone
        return pacing

    def settled(self, s: SessionPacing) -> bool:
        """Whether the session's rounds are past the warm-up: a fixed gamma, or its target's
        estimate has its warm-up verdicts and T_alone is timed (when timing it is on). What
        is measured before (rounds at the start gamma, spans alone) says little of a round
        after: ``--tree auto`` compares shapes only from here."""
        p = self.params
        if s.fixed is not None:
            return True
        timed = s.alone_step is not None or not p.explore_tokens
        return s.estimate.rounds >= p.warmup_rounds and timed

    def next_round(self, s: SessionPacing, load: Load | None, probe: bool = False) -> int:
        """This round's gamma for session ``s``; 0: decode alone for ``s.alone_span`` tokens.

        ``probe``: the last round was a span alone, so this one drafts (g >= 1) to re-estimate.
        The round after a probe decides the back-off: alone again doubles the span (up to
        ``max_alone``), drafting resets it to ``alone_tokens``.
        """
        p = self.params
        if s.fixed is not None:
            return s.choose(s.fixed)
        if load is None or s.estimate.rounds < p.warmup_rounds or not s.round_trip.known:
            return s.choose(s.chosen or p.start_gamma)  # warming up (or no costs measured yet)
        if p.explore_tokens and not s.explored and s.alone_step is None and not probe:
            # Time T_alone: a guess of it decides whether speculation pays at all. Until the
            # target's first span is timed, each of its sessions takes one span (so the target
            # decodes its sequences alone together and the span is timed in that state).
            s.explored, s.alone_span = True, min(p.explore_tokens, p.max_alone)
            return s.choose(0)
        g = self.choose(s, load, allow_alone=not probe)
        if probe:
            s.probing = True
        elif s.probing:
            s.probing = False
            s.alone_span = min(2 * s.alone_span, p.max_alone) if g == 0 else p.alone_tokens
        return s.choose(g, vote=s.vote)

    def choose(self, s: SessionPacing, load: Load, allow_alone: bool = True) -> int:
        """The rule of the module docstring (:func:`starsd.goodput.best_gamma`, which the
        analytic model's auto gamma applies too) on this session's figures, with hysteresis:
        while the best is within ``common_slack`` of the hub's common gamma (``load.common``),
        that is chosen (unless the session decodes alone or would), else while it is within
        ``hysteresis`` of the last gamma, that stays; a gamma above the common one is judged
        by the batch it would delay. Sets ``s.vote`` to the best before either.

        Why the common gamma first: sessions that draft the same gamma verify for the same time
        and come back together, so the hub drafts them in one batch; sessions spread over
        gamma 3..7 (each a few percent from its own noisy optimum) came back apart, the hub
        drafted batches of 4.2 instead of 6.0 whose longest proposal set everybody's wait, and
        auto lost 11% to a fixed gamma 4 at N = 8 while choosing 4 on average.
        """
        top = min(self.params.max_gamma, len(load.costs) - 1)
        outside = [s.wait + r for r in s.shared.round_trips(top)]
        expected = s.estimate.expected_tokens()
        rates = gamma_rates(
            expected,
            load.costs,
            outside,
            s.step_alone(load.alone_s) if allow_alone else None,
            load.batch,
            load.loaded,
        )
        best, p = pick_gamma(rates), self.params
        s.vote = best
        # (0: no common gamma yet.) It aligns drafting sessions only: neither calls one back
        # from decoding alone nor keeps one from it (sessions flapped between alone and a
        # common gamma 2 at alpha 0.3, both within 10%, and one at 8, the common gamma of its
        # own votes, stayed there for 38 rounds after acceptance fell to 0.3)
        common = (
            load.common if 1 <= load.common < len(rates) and s.chosen != 0 and best != 0 else -1
        )
        if common >= 1:  # a longer proposal than the batch's delays the whole batch
            rates = deviation_rates(
                rates, expected, load.costs, outside, common, load.batch, load.loaded
            )
            best = pick_gamma(rates)
        for keep, slack in ((common, p.common_slack), (s.chosen, p.hysteresis)):
            near = 0 <= keep < len(rates) and rates[keep] > 0
            if near and rates[keep] * (1.0 + slack) >= rates[best]:
                return keep
        return best
