"""Per-target and hub-wide counters with their log lines (hub), and latency_summary (both sides).

Shared ground on purpose: the targets (edge/verifier.py) and the benchmark scripts import
:func:`latency_summary` from here. The hub's counter classes come along, but the module needs only
the standard library, so that costs the targets nothing; keep it free of hub imports.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class TargetStats:
    """Counters for one target connection."""

    name: str
    sessions: int = 0
    rounds: int = 0  # verdicts received (one per verified proposal)
    proposed: int = 0  # draft tokens in those proposals
    alone_rounds: int = 0  # verdicts after a span the target decoded alone (gamma 0)
    accepted: int = 0  # of which the target accepted
    queue_wait_s: float = 0.0  # summed time jobs waited in Q_in before drafting started
    jobs: int = 0
    predraft_hits: int = 0  # jobs answered from a pre-drafted branch (no model work)
    taken: int = 0  # of which the target had taken the pushed branch (no wait for the hub)
    errors: int = 0

    def record_verdict(self, proposed: int, accepted: int) -> None:
        """A verdict on a proposal of ``proposed`` tokens (0: the target decoded alone)."""
        if proposed == 0:
            self.alone_rounds += 1
            return
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted

    @property
    def mean_gamma(self) -> float:
        """Mean gamma chosen per round, rounds at gamma 0 included."""
        rounds = self.rounds + self.alone_rounds
        return self.proposed / rounds if rounds else 0.0

    @property
    def alone_fraction(self) -> float:
        """The fraction of rounds at gamma 0 (the target decoding alone)."""
        rounds = self.rounds + self.alone_rounds
        return self.alone_rounds / rounds if rounds else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per round (the target adds one more token itself)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def hit_rate(self) -> float:
        """Share of jobs answered from a pre-drafted branch."""
        return self.predraft_hits / self.jobs if self.jobs else 0.0

    @property
    def taken_rate(self) -> float:
        """Share of jobs whose target verified a pushed branch without waiting for the hub."""
        return self.taken / self.jobs if self.jobs else 0.0

    @property
    def mean_queue_wait_ms(self) -> float:
        return 1000.0 * self.queue_wait_s / self.jobs if self.jobs else 0.0

    def line(self) -> str:
        return (
            f"target {self.name}: sessions={self.sessions} rounds={self.rounds} "
            f"mean_accepted={self.mean_accepted:.2f} acceptance={self.acceptance_rate:.3f} "
            f"gamma={self.mean_gamma:.2f} gamma0={self.alone_fraction:.3f} "
            f"queue_wait_ms={self.mean_queue_wait_ms:.2f} predraft_hits={self.hit_rate:.2f} "
            f"taken={self.taken_rate:.2f} errors={self.errors}"
        )


@dataclass
class BusyWindow:
    """A busy fraction over about the last ``window_s`` seconds, from samples of a running busy
    total taken when asked (at most four per window, so no timer is needed; a long silence
    between asks widens the window to the silence)."""

    window_s: float = 2.0
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time, busy total)

    def fraction(self, now: float, busy_total: float) -> float:
        """Busy seconds per wall second since the oldest sample still in the window, in [0, 1]."""
        samples = self.samples
        if not samples or now - samples[-1][0] >= self.window_s / 4:
            samples.append((now, busy_total))
        while len(samples) > 1 and now - samples[1][0] >= self.window_s:
            samples.popleft()
        since, busy_then = samples[0]
        if now <= since:
            return 0.0
        return min(1.0, max(0.0, (busy_total - busy_then) / (now - since)))


@dataclass
class HubStats:
    """Hub-wide figures: drafting busy time against wall time since start, and S(B).

    Shared by the event loop and the drafting thread: every field is read and written under the
    hub's lock. ``by_size`` is the service curve's raw data: batch size -> (batches of that size,
    their summed wall seconds); it holds at most one entry per size, 1 .. the hub's max batch.
    """

    started: float = field(default_factory=time.perf_counter)
    busy_s: float = 0.0  # completed batches (drafted and delivered), wall time
    busy_cpu_s: float = 0.0  # the drafting thread's CPU time in those batches
    batch_started: float | None = None  # the batch being drafted or delivered now, if any
    batches: int = 0
    jobs: int = 0
    messages: int = 0
    errors_sent: int = 0
    sessions_expired: int = 0  # freed because their target's lease ran out
    sessions_dropped: int = 0  # freed because their proposal could not be delivered
    unauthenticated: int = 0  # messages refused for a key not (or no longer) allowed
    over_budget: int = 0  # messages dropped unread: their peer sent faster than its budget
    predraft_s: float = 0.0  # the drafting thread's time pre-drafting, while no job waited
    pushed: int = 0  # pre-drafted branches sent to their targets ahead of the verdict
    push_late: int = 0  # branches finished only after their verdict came (not pushed)
    rounds_failed: int = 0  # jobs whose round raised: their sessions ended with INTERNAL
    by_size: dict[int, tuple[int, float]] = field(default_factory=dict)  # B -> (count, seconds)
    errors_by_code: dict[str, int] = field(default_factory=dict)  # ERROR replies sent, by code
    recent: BusyWindow = field(default_factory=BusyWindow)  # busy fraction, last ~2 s

    def record_batch(self, jobs: int, busy_s: float, busy_cpu_s: float) -> None:
        """A batch was drafted and delivered in ``busy_s`` wall (``busy_cpu_s`` CPU) seconds."""
        self.batch_started = None
        self.busy_s += busy_s
        self.busy_cpu_s += busy_cpu_s
        self.batches += 1
        self.jobs += jobs
        count, seconds = self.by_size.get(jobs, (0, 0.0))
        self.by_size[jobs] = (count + 1, seconds + busy_s)

    def service_totals(self) -> list[tuple[int, int, float]]:
        """(batch size, batches, summed wall seconds) per size drafted so far, by size: what
        STATS carries (totals, so that a reader can subtract two snapshots)."""
        return [(size, *self.by_size[size]) for size in sorted(self.by_size)]

    def service_curve(self) -> list[tuple[int, int, float]]:
        """The measured S(B): (batch size, batches, mean wall seconds per batch), by size."""
        return [(size, count, seconds / count) for size, count, seconds in self.service_totals()]

    @property
    def mean_batch(self) -> float:
        """Mean jobs per batch (0 before the first batch)."""
        return self.jobs / self.batches if self.batches else 0.0

    def busy_now(self) -> float:
        """Busy seconds so far, counting the batch in progress up to now."""
        started = self.batch_started
        return self.busy_s + (time.perf_counter() - started if started is not None else 0.0)

    def busy_recent(self) -> float:
        """The drafting thread's busy fraction over about the last two seconds."""
        return self.recent.fraction(time.perf_counter(), self.busy_now())

    def busy_fraction(self) -> float:
        wall = time.perf_counter() - self.started
        return self.busy_now() / wall if wall > 0 else 0.0

    def line(self, sessions: int, targets: int) -> str:
        return (
            f"hub: targets={targets} sessions={sessions} jobs={self.jobs} "
            f"batches={self.batches} mean_batch={self.mean_batch:.2f} "
            f"S_ms={curve_summary(self.service_curve()) or '-'} "
            f"draft_busy={self.busy_fraction():.3f} "
            f"draft_ms_per_job={1e3 * self.busy_s / max(self.jobs, 1):.2f} "
            f"cpu_ms_per_job={1e3 * self.busy_cpu_s / max(self.jobs, 1):.2f} "
            f"messages={self.messages} errors_sent={self.errors_sent} "
            f"expired={self.sessions_expired} dropped={self.sessions_dropped} "
            f"unauthenticated={self.unauthenticated} over_budget={self.over_budget} "
            f"predraft_s={self.predraft_s:.2f} pushed={self.pushed} push_late={self.push_late} "
            f"failed={self.rounds_failed}"
        )


def curve_summary(curve: list[tuple[int, int, float]], points: int = 5) -> str:
    """At most ``points`` rows of a service curve, spread from its smallest batch size to its
    largest, as ``B:ms`` pairs: the format ``python -m starsd.analytic --curve`` reads."""
    if len(curve) > points:  # evenly spaced picks, both ends included
        step = (len(curve) - 1) / max(points - 1, 1)
        curve = [curve[round(i * step)] for i in range(points)]
    return ",".join(f"{size}:{1e3 * mean_s:.2f}" for size, _, mean_s in curve)


def latency_summary(latencies_s: list[float]) -> dict[str, float]:
    """mean, p50, p99 and std of per-token latencies, in milliseconds."""
    if not latencies_s:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "std": 0.0}
    ms = sorted(1e3 * x for x in latencies_s)
    return {
        "mean": statistics.fmean(ms),
        "p50": ms[len(ms) // 2],
        "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "std": statistics.pstdev(ms),
    }
