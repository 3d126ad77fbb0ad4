"""What an emulation is told (:class:`EmulationConfig`) and when it measures (:class:`Phases`:
calibration slices alternating with the window's, after the warm-up)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from edge.hubs import parse_hub_endpoints
from scripts.emulate.acceptance import SIBLING_ALPHA
from starsd.profile import interpolate


@dataclass(frozen=True)
class EmulationConfig:
    """What ``python -m scripts.emulate.emulated`` is told."""

    hub: str
    targets: int = 8
    alpha: float = 0.7
    verify_ms: float = 5.0
    gamma: int = 4
    duration: float = 5.0
    warmup: float = 1.0  # at least; and until every target has had its first proposal
    calibration: float = 1.0
    slices: int = 4  # window slices, alternating with slices + 1 calibration slices
    max_new_tokens: int = 128  # then the sequence closes and a new one opens
    seed: int = 0
    model: str = ""  # whose tokenizer the targets claim (default: the default target)
    vocab_size: int = 0  # with ``tokenizer``: claim these instead of reading ``model``
    tokenizer: str = ""
    out: str | None = None
    verify_ms_per_token: float = 0.0  # verify of g draft tokens: verify_ms + this * g
    alone_step_ms: float = 0.0  # one token decoded alone (a span the hub asks for); 0: verify_ms
    alpha_switch: float | None = None  # the acceptance rate once switch_at of the run has passed
    switch_at: float = 0.5  # fraction of the run after the warm-up (window and calibration)
    trace_gamma: bool = False  # record every session's proposal lengths (gamma_trace)
    profile: str = ""  # a target profile: verify and alone times follow its V(1, g) and T(1)
    verify_points: tuple[tuple[int, float], ...] = ()  # its (gamma, V(1, gamma) seconds)
    tree_nodes: int = 0  # > 0: the targets verify token trees of up to this many nodes
    sibling_alpha: float = (
        SIBLING_ALPHA  # a tree's runner-up acceptance (scripts.emulate.acceptance)
    )
    # "poll": one ZeroMQ poller (scripts.emulate.poller, one hub); "asyncio": the target's own
    # hub clients (several hubs too); "auto": the poller for one hub
    driver: str = "auto"

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The hubs of ``hub`` (a comma list)."""
        return parse_hub_endpoints(self.hub)

    @property
    def polled(self) -> bool:
        """Whether the poller drives the targets (see ``driver``)."""
        return self.driver == "poll" or (self.driver == "auto" and len(self.endpoints) == 1)

    @property
    def step_alone_s(self) -> float:
        """Seconds per token a target decodes alone."""
        return (self.alone_step_ms or self.verify_ms) / 1e3

    def verify_s(self, gamma: int) -> float:
        """Seconds one verify of ``gamma`` draft tokens takes (a profile's V(1, gamma),
        interpolated between its gammas, when given one)."""
        if self.verify_points:
            return interpolate(self.verify_points, gamma)
        return (self.verify_ms + self.verify_ms_per_token * gamma) / 1e3

    @property
    def tracing(self) -> bool:
        return self.trace_gamma or self.alpha_switch is not None


@dataclass
class Phases:
    """The measurement schedule (perf_counter times); empty until the warm-up is over.

    ``bounds`` cut the run after the warm-up into slices that alternate calibration, window,
    calibration, ..., calibration, so that this machine's drifting speed hits the inputs and
    the measurement alike. ``first_proposals`` counts the targets that have had their first
    proposal, so the warm-up can wait out the burst of OPENs.
    """

    bounds: list[float] = field(default_factory=list)
    first_proposals: int = 0
    switch: float = math.inf  # when the acceptance rate switches (with --alpha-switch)

    @property
    def finish(self) -> float:
        """When the targets stop (the end of the last calibration slice)."""
        return self.bounds[-1] if self.bounds else math.inf

    def kind(self, t: float) -> str | None:
        """``"window"``, ``"calibration"`` or None (warm-up, or after the end) at time ``t``."""
        i = bisect.bisect_right(self.bounds, t) - 1
        if i < 0 or i >= len(self.bounds) - 1:
            return None
        return "window" if i % 2 else "calibration"

    def alpha(self, cfg: EmulationConfig, t: float) -> float:
        """The acceptance rate at time ``t``."""
        return cfg.alpha_switch if cfg.alpha_switch is not None and t >= self.switch else cfg.alpha


def switch_time(bounds: list[float], cfg: EmulationConfig) -> float:
    """When the acceptance rate switches: ``cfg.switch_at`` of the way through the schedule."""
    if cfg.alpha_switch is None or not bounds:
        return math.inf
    return bounds[0] + cfg.switch_at * (bounds[-1] - bounds[0])


def schedule(start: float, cfg: EmulationConfig) -> list[float]:
    """Bounds of ``cfg.slices`` window slices between ``cfg.slices + 1`` calibration slices."""
    bounds, t = [start], start
    for i in range(2 * cfg.slices + 1):
        t += cfg.duration / cfg.slices if i % 2 else cfg.calibration / (cfg.slices + 1)
        bounds.append(t)
    return bounds
