"""The hub's service time S(B, g): one model, for the hub's policy and the analytic model alike.

A batch of B draft jobs whose longest proposal has g tokens costs one feed forward and g - 1
decode steps, delivery included: S(B, g) = a(B) + (g - 1) b(B). The hub measures a and b per
batch size online (:class:`starsd.hub.estimates.ServiceModel`); the analytic model takes them
from a benchmark's measured S(B) at one gamma, as proportional costs (every forward of the batch
costing the same: a = b = S / g), which is all one gamma can tell. Between measured sizes a and
b are linear in B; below the smallest they are its; above the largest they go on along the last
two sizes' line, never below the largest's (a batched forward never gets cheaper with more rows).
Pure: no torch, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceCurve:
    """S(B, g) from per-size costs: ``sizes`` B (sorted, distinct, >= 1), ``first`` a(B) (the
    feed forward of a batch), ``step`` b(B) (each further draft step), in seconds."""

    sizes: tuple[int, ...]
    first: tuple[float, ...]
    step: tuple[float, ...]

    def __post_init__(self) -> None:
        if (
            not self.sizes
            or len(self.sizes) != len(self.first)
            or len(self.first) != len(self.step)
        ):
            raise ValueError("a service curve needs one (a, b) per size, at least one size")
        if self.sizes[0] < 1 or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"batch sizes must be distinct, sorted and >= 1, got {self.sizes}")
        if not all(math.isfinite(v) and v >= 0 for v in (*self.first, *self.step)):
            raise ValueError(
                f"service times must be finite and >= 0, got {self.first}, {self.step}"
            )

    @classmethod
    def proportional(cls, points: Iterable[tuple[int, float]], gamma: int) -> ServiceCurve:
        """From measured (B, S(B)) of proposals of ``gamma`` tokens: a = b = S / gamma."""
        rows = sorted((int(b), float(s)) for b, s in points)
        if not rows or not all(math.isfinite(s) and s > 0 for _, s in rows):
            raise ValueError(f"service times must be positive, got {rows}")
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        per = tuple(s / gamma for _, s in rows)
        return cls(tuple(b for b, _ in rows), per, per)

    @classmethod
    def parse(cls, text: str, gamma: int) -> ServiceCurve:
        """From ``"B:ms,B:ms,..."`` (e.g. ``"1:4.3,8:4.7,32:6.5"``), S(B) at ``gamma``."""
        try:
            pairs = [item.split(":") for item in text.replace(" ", "").split(",") if item]
            return cls.proportional(((int(b), float(ms) / 1e3) for b, ms in pairs), gamma)
        except ValueError as exc:  # (a pair without ':' fails to unpack: ValueError too)
            raise ValueError(f"bad service curve {text!r} (want B:ms,B:ms,...): {exc}") from None

    @classmethod
    def from_totals(cls, totals: Iterable[tuple[int, int, float]], gamma: int) -> ServiceCurve:
        """From (batch size, batches, summed seconds) rows, as ``HubStats.service_totals()``
        and ``protocol.Stats.service_totals()`` give them (sizes never drafted are skipped),
        measured at ``gamma``."""
        return cls.proportional(((int(b), s / n) for b, n, s in totals if n > 0), gamma)

    def at(self, batch: int, gamma: int) -> float:
        """S(batch, gamma) in seconds."""
        a, b = self.costs_of(batch)
        return a + (gamma - 1) * b

    def tree_at(self, batch: int, width: int, depth: int) -> float:
        """A batch of ``batch`` token trees grown ``depth`` deep, ``width`` nodes expanded per
        depth: the feed forward of the batch, then one forward per further depth over its
        ``batch * width`` expanded nodes (as :mod:`starsd.hub.drafters.tree_draft` feeds
        them): a(B) + (depth - 1) b(B * width)."""
        return self.costs_of(batch)[0] + (depth - 1) * self.costs_of(batch * width)[1]

    def costs(self, batch: int, max_gamma: int) -> list[float]:
        """[S(B, g) for g = 0..max_gamma] (index 0 is 0: no drafting)."""
        a, b = self.costs_of(batch)
        return [0.0] + [a + (g - 1) * b for g in range(1, max_gamma + 1)]

    def table(self, gamma: int) -> tuple[tuple[int, float], ...]:
        """(B, S(B, gamma)) at each measured size."""
        return tuple((b, self.at(b, gamma)) for b in self.sizes)

    def costs_of(self, batch: int) -> tuple[float, float]:
        """(a, b) at ``batch`` (the module docstring's interpolation)."""
        sizes = self.sizes
        if len(sizes) == 1 or batch <= sizes[0]:
            return self.first[0], self.step[0]
        hi = next((i for i, s in enumerate(sizes) if s >= batch), len(sizes) - 1)
        lo = hi - 1
        t = (batch - sizes[lo]) / (sizes[hi] - sizes[lo])
        a, b = _between(self.first, lo, hi, t), _between(self.step, lo, hi, t)
        if batch > sizes[-1]:
            a, b = max(a, self.first[-1]), max(b, self.step[-1])
        return a, b


def _between(values: Sequence[float], lo: int, hi: int, t: float) -> float:
    return values[lo] + (values[hi] - values[lo]) * t
