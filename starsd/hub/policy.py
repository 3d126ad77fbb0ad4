"""Load-aware draft length (``--gamma auto``): what each session's next proposal should hold.

Pure: no torch, no threads, no clock of its own (every time is passed in), so each rule is
unit-tested directly (tests/test_policy.py). The hub's glue is :mod:`starsd.hub.pacing`; the
choice itself is :func:`starsd.analytic.best_gamma`, shared with the analytic model.

Terms (per session, times in seconds):

  alpha_i   acceptance of draft position i given positions 1..i-1 were accepted (i = 1..G);
  E[L(g)]   tokens a round with g draft tokens commits: 1 + sum_{k=1..g} prod_{i<=k} alpha_i;
  S(B, g)   the hub's service time for a batch of B jobs whose longest proposal has g tokens,
            fitted per B as a(B) + (g - 1) b(B) (one feed forward, then g - 1 decode steps);
  R(g)      the round trip outside the hub, from our proposal leaving to the target's next DRAFT
            arriving (its verify of g + 1 positions plus the link), fitted as r0 + r1 g;
  W         how long the session's jobs wait in Q_in before their batch starts;
  T_alone   the target's own decoding step: measured from the spans it decodes alone
            (R over the span / its tokens; the link is spread over the span), and before the
            first span approximated by R(1), the fitted round trip of a one-token proposal
            (link + a verify of two positions, near the data unlike the intercept R(0); it errs
            high, so speculation is switched off only when it clearly does not pay).

Rule (:meth:`GammaPolicy.choose`), over g in 0..G:

  own(g) = E[L(g)] / (W + S(B, g) + R(g)) for g >= 1, own(0) = 1 / T_alone
           (the session's own tokens per second);
  under-loaded hub: g = argmax own(g);
  fully loaded hub (jobs were left waiting when the batch started, or the hub was busy >= 95%
  of the recent batches' time): among g >= 1 with own(g) >= own(0), g = argmax
  E[L(g)] / (S(B, g) / B), the tokens this session makes per second of hub time it takes (its
  share of the batch); 0 when no such g exists.

gamma 0: the target decodes ``alone`` tokens itself, then its DRAFT (accepted 0) carries them;
after that span the session drafts once more with a small gamma (a probe, to re-estimate), and
each consecutive span that the probe does not end doubles, up to ``max_alone``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from starsd.analytic import gamma_rates, pick_gamma


@dataclass(frozen=True)
class PolicyParams:
    """The knobs of the policy; the defaults are what ``--gamma auto`` uses."""

    max_gamma: int = 16
    start_gamma: int = 4  # the first rounds' gamma, until the estimate has data
    warmup_rounds: int = 3  # verdicts (with their round trips) before the policy decides
    prior_alpha: float = 0.6
    prior_weight: float = 2.0  # pseudo-observations behind the prior (per position, and pooled)
    forget: float = 0.93  # per verdict: an observation's weight after n more is forget**n
    loaded_busy: float = 0.95  # busy fraction of recent batches that means fully loaded
    # keep the last gamma while the best one is at most this much better: the estimates are
    # noisy and the optimum is flat (alpha 0.7: gamma 3..5 within 1.5% of each other), so a
    # bare argmax flaps, and each flap to a short gamma or to decoding alone costs 7-40%
    hysteresis: float = 0.05
    alone_tokens: int = 16  # the first span a session decodes alone
    max_alone: int = 256  # the longest span (consecutive spans double)

    def __post_init__(self) -> None:
        if self.max_gamma < 1 or not 1 <= self.start_gamma <= self.max_gamma:
            raise ValueError(f"need 1 <= start_gamma <= max_gamma, got {self.start_gamma}, "
                             f"{self.max_gamma}")  # fmt: skip
        if not 0.0 < self.forget < 1.0 or not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError("forget must be in (0, 1) and prior_alpha in [0, 1]")
        if not 1 <= self.alone_tokens <= self.max_alone:
            raise ValueError("need 1 <= alone_tokens <= max_alone")
        if self.hysteresis < 0:
            raise ValueError(f"hysteresis must be >= 0, got {self.hysteresis}")


class AcceptanceEstimate:
    """alpha_i for i = 1..G, estimated online from verdicts, with exponential forgetting.

    A verdict (g proposed, k accepted) observes position i when i <= g and every earlier
    position was accepted (i <= k + 1); position i was accepted iff k >= i. Every verdict
    discounts all counts by ``forget``, observed or not, so a position the session stopped
    reaching falls back to the pooled estimate (all positions together) instead of keeping an
    old value; the pooled estimate itself falls back to the prior. After a shift in acceptance
    the old observations' weight is forget**n after n rounds (0.93**50 = 0.03).

    Owned by the drafting thread (it lives in :class:`SessionPacing`).
    """

    def __init__(self, max_gamma: int, prior: float = 0.6, weight: float = 2.0,
                 forget: float = 0.93) -> None:  # fmt: skip
        self.max_gamma = max_gamma
        self.prior, self.weight, self.forget = prior, weight, forget
        self.hits = [0.0] * max_gamma  # discounted accepted count per position
        self.seen = [0.0] * max_gamma  # discounted observed count per position
        self.total_hits = 0.0
        self.total_seen = 0.0
        self.rounds = 0  # verdicts observed
        self._expected: list[float] | None = None

    def observe(self, proposed: int, accepted: int) -> None:
        """One verdict: ``accepted`` of ``proposed`` draft tokens were kept."""
        if proposed < 1 or not 0 <= accepted <= proposed:
            raise ValueError(f"bad verdict: {accepted} accepted of {proposed}")
        f = self.forget
        hits = [h * f for h in self.hits]
        seen = [n * f for n in self.seen]
        reached = min(proposed, accepted + 1, self.max_gamma)  # positions 1..reached observed
        kept = min(accepted, self.max_gamma)
        for i in range(reached):
            seen[i] += 1.0
        for i in range(kept):
            hits[i] += 1.0
        self.hits, self.seen = hits, seen
        self.total_hits = self.total_hits * f + kept
        self.total_seen = self.total_seen * f + reached
        self.rounds += 1
        self._expected = None

    def pooled(self) -> float:
        """All positions together, with the prior."""
        return (self.total_hits + self.weight * self.prior) / (self.total_seen + self.weight)

    def alphas(self) -> list[float]:
        """alpha_1 .. alpha_G."""
        pooled, w = self.pooled(), self.weight
        return [(h + w * pooled) / (s + w) for h, s in zip(self.hits, self.seen, strict=True)]

    def expected_tokens(self) -> list[float]:
        """E[L(g)] for g = 0..G (E[L(0)] = 1: the target's own token)."""
        if self._expected is None:
            pooled, w = self.pooled(), self.weight
            prior = w * pooled
            out, run, total = [1.0], 1.0, 1.0
            for h, n in zip(self.hits, self.seen, strict=True):
                run *= (h + prior) / (n + w)  # alpha_i
                total += run
                out.append(total)
            self._expected = out
        return self._expected


class LinearFit:
    """y = c0 + c1 x by least squares with exponential forgetting; the slope is shrunk toward
    ``slope_prior(mean y, mean x)`` with weight ``ridge`` (in units of x squared), so a
    session or batch size that always shows the same x gets the prior's slope, not noise."""

    def __init__(self, forget: float, ridge: float) -> None:
        self.forget, self.ridge = forget, ridge
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, x: float, y: float) -> None:
        f = self.forget
        self.w = self.w * f + 1.0
        self.sx = self.sx * f + x
        self.sy = self.sy * f + y
        self.sxx = self.sxx * f + x * x
        self.sxy = self.sxy * f + x * y

    @property
    def known(self) -> bool:
        return self.w > 0.0

    def coefficients(self, slope_prior: float = 0.0) -> tuple[float, float]:
        """(c0, c1) with c1 >= 0 and c0 >= 0 (a cost never falls with x, nor below zero)."""
        mx, my = self.sx / self.w, self.sy / self.w
        var = max(self.sxx - self.w * mx * mx, 0.0)
        cov = self.sxy - self.w * mx * my
        slope = max((cov + self.ridge * slope_prior) / (var + self.ridge), 0.0)
        return max(my - slope * mx, 0.0), slope


class ServiceModel:
    """S(B, g) = a(B) + (g - 1) b(B), fitted per batch size from (B, longest g, seconds).

    Per B a :class:`LinearFit` of seconds against g - 1, its slope shrunk toward the
    proportional model (every forward of the batch costs the same: b = a), which is what a
    hub that always drafts one gamma can tell. Between measured sizes a and b are linear in B;
    below the smallest they are its; above the largest they go on along the last two sizes'
    line, never below the largest's (as :class:`starsd.analytic.ServiceCurve`).

    Owned by the drafting thread (the pacing glue records each batch it drafts).
    """

    def __init__(self, forget: float = 0.95, ridge: float = 1.0) -> None:
        self.forget, self.ridge = forget, ridge
        self.fits: dict[int, LinearFit] = {}
        self._sizes: list[int] = []  # sorted keys of fits
        self._memo: dict[tuple[int, int], list[float]] = {}  # costs() since the last observe

    def observe(self, batch: int, gamma: int, seconds: float) -> None:
        """A batch of ``batch`` jobs, the longest with ``gamma`` tokens, took ``seconds``."""
        if batch < 1 or gamma < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        fit = self.fits.get(batch)
        if fit is None:
            fit = self.fits[batch] = LinearFit(self.forget, self.ridge)
            self._sizes = sorted(self.fits)
        fit.observe(gamma - 1, seconds)
        self._memo.clear()

    def _ab(self, batch: int) -> tuple[float, float]:
        fit = self.fits[batch]
        mx, my = fit.sx / fit.w, fit.sy / fit.w
        return fit.coefficients(slope_prior=my / (1.0 + mx))  # proportional: S = (1 + x) a

    def costs(self, batch: int, max_gamma: int) -> list[float] | None:
        """[S(B, g) for g = 0..max_gamma] (index 0 is 0: no drafting), None before any data."""
        sizes = self._sizes
        if not sizes:
            return None
        memo = self._memo.get((batch, max_gamma))
        if memo is None:
            memo = self._memo[(batch, max_gamma)] = self._costs(batch, max_gamma)
        return memo

    def _costs(self, batch: int, max_gamma: int) -> list[float]:
        sizes = self._sizes
        if batch in self.fits or len(sizes) == 1 or batch <= sizes[0]:
            a, b = self._ab(batch if batch in self.fits else sizes[0])
        else:
            lo = max((s for s in sizes if s < batch), default=sizes[0])
            hi = min((s for s in sizes if s > batch), default=None)
            if hi is None:  # above the largest: the last two sizes' line, floored
                lo, hi = sizes[-2], sizes[-1]
            (a0, b0), (a1, b1) = self._ab(lo), self._ab(hi)
            t = (batch - lo) / (hi - lo)
            a, b = a0 + (a1 - a0) * t, b0 + (b1 - b0) * t
            if batch > sizes[-1]:
                a, b = max(a, a1), max(b, b1)
        return [0.0] + [a + (g - 1) * b for g in range(1, max_gamma + 1)]


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


@dataclass
class Pending:
    """A verdict the proposer has not applied yet: it arrived with a job answered with gamma 0,
    and goes with the session's next drafted job (the tokens decoded alone appended to it)."""

    accepted: int
    appended: list[int]
    features: list = field(default_factory=list)  # EAGLE: each [n, H] array, in order


@dataclass
class SessionPacing:
    """One session's policy state. Created by the pacing glue on the session's first job and
    kept on the table's ``Session.pacing``; from then on read and written by the drafting
    thread only (like the proposer's own state)."""

    fixed: int | None  # a gamma the session keeps (OPEN named it, or --gamma N); None: auto
    estimate: AcceptanceEstimate
    round_trip: LinearFit = field(default_factory=lambda: LinearFit(forget=0.9, ridge=0.5))
    alone_step: float | None = None  # measured T_alone (smoothed), None before any span
    wait: float = 0.0  # smoothed W
    last_gamma: int = -1  # tokens in the proposal in flight (0: a span alone; -1: none yet)
    sent_at: float | None = None  # when it left the drafting thread
    pending: Pending | None = None
    alone_span: int = 16  # tokens of the next span alone
    chosen: int = 0  # the last gamma chosen
    probing: bool = False  # the proposal in flight is the probe after a span alone
    decision: tuple[int, int, int] | None = None  # (seq, gamma, span) decided, not yet sent

    def step_alone(self) -> float | None:
        """T_alone: measured, else R(1) (see the module docstring), None while unknown."""
        if self.alone_step is not None:
            return self.alone_step
        if not self.round_trip.known:
            return None
        r0, r1 = self.round_trip.coefficients()
        return r0 + r1 if r0 + r1 > 0 else None


class GammaPolicy:
    """Chooses each round's gamma from a session's estimate and the hub's load (module
    docstring). Stateless apart from its parameters: one instance serves every session."""

    def __init__(self, params: PolicyParams = PolicyParams()) -> None:
        self.params = params

    def new_session(self, fixed: int | None, start: int | None = None) -> SessionPacing:
        """A session's state; ``fixed`` None for auto (its first rounds draft ``start``)."""
        p = self.params
        pacing = SessionPacing(fixed=fixed, alone_span=p.alone_tokens,
                               estimate=AcceptanceEstimate(p.max_gamma, p.prior_alpha,
                                                           p.prior_weight, p.forget))  # fmt: skip
        pacing.chosen = fixed if fixed is not None else (start or p.start_gamma)
        if fixed == 0:  # --gamma 0: never drafts, so the longest spans cost fewest round trips
            pacing.alone_span = p.max_alone
        return pacing

    def next_round(self, s: SessionPacing, load: Load | None, probe: bool = False) -> int:
        """This round's gamma for session ``s``; 0: decode alone for ``s.alone_span`` tokens.

        ``probe``: the last round was a span alone, so this one drafts (g >= 1) to re-estimate.
        The round after a probe decides the back-off: alone again doubles the span (up to
        ``max_alone``), drafting resets it to ``alone_tokens``.
        """
        p = self.params
        if s.fixed is not None:
            s.chosen = s.fixed
            return s.chosen
        if load is None or s.estimate.rounds < p.warmup_rounds or not s.round_trip.known:
            s.chosen = s.chosen or p.start_gamma  # warming up (or no costs measured yet)
            return s.chosen
        g = self.choose(s, load, allow_alone=not probe)
        if probe:
            s.probing = True
        elif s.probing:
            s.probing = False
            s.alone_span = min(2 * s.alone_span, p.max_alone) if g == 0 else p.alone_tokens
        s.chosen = g
        return g

    def choose(self, s: SessionPacing, load: Load, allow_alone: bool = True) -> int:
        """The rule of the module docstring (:func:`starsd.analytic.best_gamma`, which the
        analytic model's auto gamma applies too) on this session's figures, with hysteresis:
        the last gamma stays while the best is within ``hysteresis`` of it."""
        r0, r1 = s.round_trip.coefficients()
        top = min(self.params.max_gamma, len(load.costs) - 1)
        outside = [s.wait + r0 + r1 * g for g in range(top + 1)]
        expected = s.estimate.expected_tokens()
        rates = gamma_rates(expected, load.costs, outside,
                            s.step_alone() if allow_alone else None, load.batch,
                            load.loaded)  # fmt: skip
        best, last = pick_gamma(rates), s.chosen
        near = 0 <= last < len(rates) and rates[last] > 0
        if near and rates[last] * (1.0 + self.params.hysteresis) >= rates[best]:
            return last
        return best
