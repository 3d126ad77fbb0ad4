"""The online estimates ``--gamma auto`` decides from (see :mod:`starsd.hub.policy`).

Pure, like the policy: no torch, no threads, no clock. Per session, the acceptance of each draft
position (:class:`AcceptanceEstimate`) and the round trip outside the hub as a line in gamma
(:class:`LinearFit`); per hub, the service time S(B, g) of a batch (:class:`ServiceModel`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from starsd.service import ServiceCurve

# an outcome's variance in the shift test at least that of alpha 0.9: near alpha 1 a rejection
# is rare but not a shift (false alarms at a steady 0.95, gamma 14: 0.6 per 100 rounds with a
# floor of 0.05, 0.13 with 0.09)
_LEAST_VARIANCE = 0.09


class AcceptanceEstimate:
    """alpha_i for i = 1..G, estimated online from verdicts, with exponential forgetting.

    A verdict (g proposed, k accepted) observes position i when i <= g and every earlier
    position was accepted (i <= k + 1); position i was accepted iff k >= i. Every verdict
    discounts all counts by ``forget``, observed or not, so a position the session stopped
    reaching falls back to the position before it instead of keeping an old value (not to the
    pooled estimate of all positions together: after acceptance fell from 0.9 to 0.3 that
    still held the old rounds' many deep positions, and E[L(5)] with alpha_2..5 at the pooled
    0.7 kept a session at gamma 5 for 31 rounds); alpha_1, observed every round, falls back to
    the pooled estimate, and that to the prior.

    A shift: forgetting alone is slow after one, because the old rounds observed more positions
    each (at alpha 0.9 and gamma 11, ~7; at 0.3, ~1.4), so that the pooled estimate still read
    0.76 ten rounds after acceptance fell from 0.9 to 0.3, and a session took up to 107 rounds
    to settle. So every observed position's outcome is also checked against the alpha_i the
    estimate had before it: the sum of (outcome - alpha_i), discounted by ``shift_memory`` per
    verdict, has mean 0 while the estimate is right (each outcome has mean alpha_i given the
    earlier ones) and a known variance; once it leaves ``shift_z`` standard deviations, the
    counts are cut to ``shift_keep`` of themselves (default 0: forgotten, back to the prior),
    so the verdicts since the shift decide (0.9 -> 0.3 at gamma 10 is seen after a median of
    4 verdicts; at steady acceptance about one false alarm per 500 rounds).

    Owned by the drafting thread (it lives in :class:`SessionPacing`).
    """

    def __init__(
        self,
        max_gamma: int,
        prior: float = 0.6,
        weight: float = 2.0,
        forget: float = 0.97,
        shift_z: float = 3.5,
        shift_keep: float = 0.0,
        shift_memory: float = 0.7,
    ) -> None:
        self.max_gamma = max_gamma
        self.prior, self.weight, self.forget = prior, weight, forget
        self.shift_z, self.shift_keep, self.shift_memory = shift_z, shift_keep, shift_memory
        self.hits = [0.0] * max_gamma  # discounted accepted count per position
        self.seen = [0.0] * max_gamma  # discounted observed count per position
        self.total_hits = 0.0
        self.total_seen = 0.0
        self.rounds = 0  # verdicts observed
        self.shifts = 0  # shifts detected
        self._surprise = 0.0  # discounted sum of (outcome - alpha_i) over observed positions
        self._spread = 0.0  # its variance
        self._expected: list[float] | None = None

    def observe(self, proposed: int, accepted: int) -> None:
        """One verdict: ``accepted`` of ``proposed`` draft tokens were kept."""
        if proposed < 1 or not 0 <= accepted <= proposed:
            raise ValueError(f"bad verdict: {accepted} accepted of {proposed}")
        reached = min(proposed, accepted + 1, self.max_gamma)  # positions 1..reached observed
        kept = min(accepted, self.max_gamma)
        keep = self.shift_keep if self._shifted(reached, kept) else 1.0
        f = self.forget * keep
        hits = [h * f for h in self.hits]
        seen = [n * f for n in self.seen]
        for i in range(reached):
            seen[i] += 1.0
        for i in range(kept):
            hits[i] += 1.0
        self.hits, self.seen = hits, seen
        self.total_hits = self.total_hits * f + kept
        self.total_seen = self.total_seen * f + reached
        self.rounds += 1
        self._expected = None

    def _shifted(self, reached: int, kept: int) -> bool:
        """Add this verdict's positions to the surprise; whether it now says the acceptance
        shifted (then it starts again)."""
        alphas = self.alphas()[:reached]
        m = self.shift_memory
        self._surprise = self._surprise * m + kept - sum(alphas)
        self._spread = self._spread * m * m + sum(max(a * (1 - a), _LEAST_VARIANCE) for a in alphas)
        if self._surprise**2 <= self.shift_z**2 * self._spread:
            return False
        self._surprise = self._spread = 0.0
        self.shifts += 1
        return True

    def pooled(self) -> float:
        """All positions together, with the prior."""
        return (self.total_hits + self.weight * self.prior) / (self.total_seen + self.weight)

    def alphas(self) -> list[float]:
        """alpha_1 .. alpha_G: each position's counts shrunk toward the position before it
        (alpha_1 toward the pooled estimate), so one rarely reached looks like its neighbour."""
        out, last, w = [], self.pooled(), self.weight
        for h, n in zip(self.hits, self.seen, strict=True):
            last = (h + w * last) / (n + w)
            out.append(last)
        return out

    def expected_tokens(self) -> list[float]:
        """E[L(g)] for g = 0..G (E[L(0)] = 1: the target's own token)."""
        if self._expected is None:
            out, run = [1.0], 1.0
            for alpha in self.alphas():
                run *= alpha
                out.append(out[-1] + run)
            self._expected = out
        return self._expected


class LinearFit:
    """y = c0 + c1 x by least squares with exponential forgetting; the slope is shrunk toward
    ``slope_prior`` with weight ``ridge`` (in units of x squared), so a session that always
    shows the same x gets the prior's slope, not noise. The prior is 0 until x has varied by
    ``ridge``, then the last slope x's variation told: forgotten observations take their x's
    variation with them, and a session kept at one gamma (as the hysteresis keeps it) had its
    round trip's slope shrunk to 0, a verify of 16 tokens priced as one of 2, until a lucky
    verdict sent it to a long proposal (gamma 2 -> 5 at alpha 0.3, 90 rounds after a switch).
    """

    def __init__(self, forget: float, ridge: float) -> None:
        self.forget, self.ridge = forget, ridge
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.slope_prior = 0.0

    def observe(self, x: float, y: float) -> None:
        f = self.forget
        self.w = self.w * f + 1.0
        self.sx = self.sx * f + x
        self.sy = self.sy * f + y
        self.sxx = self.sxx * f + x * x
        self.sxy = self.sxy * f + x * y
        var, cov = self.spread()
        if var >= self.ridge:  # x varied enough to tell a slope: keep it for when it does not
            self.slope_prior = max((cov + self.ridge * self.slope_prior) / (var + self.ridge), 0.0)

    @property
    def known(self) -> bool:
        return self.w > 0.0

    def slope_told(self) -> bool:
        """Whether x has varied enough (now or before) for the slope to be the data's."""
        return self.spread()[0] >= self.ridge or self.slope_prior > 0.0

    def spread(self) -> tuple[float, float]:
        """(variance, covariance) sums of x and y about their means."""
        mx, my = self.sx / self.w, self.sy / self.w
        return max(self.sxx - self.w * mx * mx, 0.0), self.sxy - self.w * mx * my

    def coefficients(self) -> tuple[float, float]:
        """(c0, c1) with c1 >= 0 and c0 >= 0 (a cost never falls with x, nor below zero)."""
        var, cov = self.spread()
        slope = max((cov + self.ridge * self.slope_prior) / (var + self.ridge), 0.0)
        return max((self.sy - slope * self.sx) / self.w, 0.0), slope


class ServiceModel:
    """S(B, g) = a(B) + (g - 1) b(B), fitted from each batch drafted (B, longest g, seconds).

    Per B a :class:`LinearFit` of seconds against g - 1. Its slope b(B) is shrunk toward a line
    b0 + b1 B fitted to how the cost moved with g within every batch size (:meth:`step_line`,
    each size's own a(B) kept out, so that a(B) need not be linear): a size whose batches always
    have about the same longest g (the large ones, where the longest of many proposals varies
    little) cannot tell b(B) itself, and the small batches, whose longest g varies, can. Before
    any size saw g vary, the prior is the proportional model (every forward of the batch costs
    the same: b = a), all that a hub that always drafts one gamma can tell. (That prior alone,
    per size, priced a step at 2 ms at B = 7 where B = 1 measured 0.4 ms: the sessions of large
    batches chose short proposals and those alone in a batch long ones, gamma 1..16 at N = 8.)

    Robust to a stall: once anything is known, a batch counts as at most ``clip`` times the
    cost predicted for it (one 50 ms batch, the first of its size, priced every proposal of a
    batch of 8 at 50 ms for dozens of batches, and its sessions decoded alone; a lasting
    slow-down still comes through, by up to ``clip`` times per batch). Between measured sizes,
    below and above them: :class:`starsd.service.ServiceCurve`, the one model of S(B, g).

    Owned by the drafting thread (:class:`starsd.hub.pacing.Pacer` records each batch drafted).
    """

    def __init__(self, forget: float = 0.95, ridge: float = 8.0, clip: float = 2.0) -> None:
        self.forget, self.ridge, self.clip = forget, ridge, clip
        self.fits: dict[int, LinearFit] = {}
        self._sizes: list[int] = []  # sorted keys of fits
        self._memo: dict[tuple[int, int], list[float]] = {}  # costs() since the last observe
        self._line: tuple[float, float] | None = None  # _step_line() since the last observe
        self._curve: ServiceCurve | None = None  # curve() since the last observe

    def observe(self, batch: int, gamma: int, seconds: float) -> None:
        """A batch of ``batch`` jobs, the longest with ``gamma`` tokens, took ``seconds``."""
        if batch < 1 or gamma < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        predicted = self.costs(batch, gamma)
        if predicted is not None:
            seconds = min(seconds, self.clip * predicted[gamma])
        fit = self.fits.get(batch)
        if fit is None:
            fit = self.fits[batch] = LinearFit(self.forget, self.ridge)
            self._sizes = sorted(self.fits)
        fit.observe(gamma - 1, seconds)
        self._memo.clear()
        self._line = self._curve = None

    def step_line(self) -> tuple[float, float] | None:
        """(b0, b1): one more draft step costs b0 + b1 B, by least squares over the variation
        of g within each batch size; b1 >= 0 (a step never gets cheaper with more rows) and
        b0 + b1 >= 0. None while g varied by less than 1 (in x squared) altogether."""
        if self._line is None:
            self._line = _step_line([(b, *fit.spread()) for b, fit in self.fits.items()], 1.0)
        return None if self._line[0] < 0 else self._line

    def _ab(self, batch: int) -> tuple[float, float]:
        fit, line = self.fits[batch], self.step_line()
        prior = (
            fit.sy / (fit.w + fit.sx)
            if line is None  # proportional: S = (1 + x) a
            else line[0] + line[1] * batch
        )
        var, cov = fit.spread()
        slope = max((cov + self.ridge * prior) / (var + self.ridge), 0.0)
        return max((fit.sy - slope * fit.sx) / fit.w, 0.0), slope

    def costs(self, batch: int, max_gamma: int) -> list[float] | None:
        """[S(B, g) for g = 0..max_gamma] (index 0 is 0: no drafting), None before any data."""
        if not self._sizes:
            return None
        memo = self._memo.get((batch, max_gamma))
        if memo is None:
            memo = self._memo[(batch, max_gamma)] = self.curve().costs(batch, max_gamma)
        return memo

    def curve(self) -> ServiceCurve:
        """The fitted a(B), b(B) at every size drafted so far (needs one observed batch)."""
        if self._curve is None:
            ab = [self._ab(b) for b in self._sizes]
            self._curve = ServiceCurve(
                tuple(self._sizes), tuple(a for a, _ in ab), tuple(b for _, b in ab)
            )
        return self._curve


def _step_line(spreads: Sequence[tuple[int, float, float]], least: float) -> tuple[float, float]:
    """b0 + b1 B through per-size (B, variance of x, covariance of x and y) by weighted least
    squares (the within-size, or fixed-effects, estimator); (-1, 0) when the variances sum to
    less than ``least``. A falling line (b1 < 0) is refitted as a constant."""
    m0 = sum(v for _, v, _ in spreads)
    if m0 < least:
        return -1.0, 0.0
    m1, m2 = sum(v * b for b, v, _ in spreads), sum(v * b * b for b, v, _ in spreads)
    c0, c1 = sum(c for _, _, c in spreads), sum(c * b for b, _, c in spreads)
    det = m0 * m2 - m1 * m1
    b1 = (m0 * c1 - m1 * c0) / det if det > 1e-9 * m0 * m2 else 0.0
    if b1 <= 0.0:
        return max(c0 / m0, 0.0), 0.0
    return max((c0 - b1 * m1) / m0, -b1), b1
