"""The emulation's report: what each emulated target measured (:class:`TargetRecord`), and the
system, per-target, per-hub and calibration figures made of it and of the hubs' STATS."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

from scripts.emulate.config import EmulationConfig
from starsd.protocol import Stats
from starsd.stats import latency_summary


@dataclass
class TargetRecord:
    """What one emulated target measured inside the window (and in the calibration slices)."""

    tokens: int = 0
    rounds: int = 0  # verified proposals (spans alone not included)
    accepted: int = 0
    proposed: int = 0  # draft tokens in those proposals
    alone_spans: int = 0  # PROPOSALs with alone = K, honoured (in the window)
    alone_tokens: int = 0
    gammas: dict[int, int] = field(default_factory=dict)  # chain length -> rounds (0: alone)
    tree_rounds: int = 0  # verified token trees, and the tokens they committed
    tree_tokens: int = 0
    errors: int = 0  # sequences the hub ended with an ERROR (e.g. CONTEXT_FULL); reopened
    traces: list[dict] = field(default_factory=list)  # --trace-gamma: one per session
    bytes: int = 0
    round_s: float = 0.0
    verify_s: float = 0.0
    token_latency_s: list[float] = field(default_factory=list)
    proposal_wait_s: list[float] = field(default_factory=list)  # DRAFT sent -> PROPOSAL in
    had_proposal: bool = False
    calibration_rounds: int = 0
    calibration_verify_s: float = 0.0
    placed: dict[str, int] = field(default_factory=dict)  # hub endpoint -> sessions opened there
    hubs: dict[str, HubRounds] = field(default_factory=dict)  # hub endpoint -> window rounds

    def per_hub(self, endpoint: str) -> HubRounds:
        """This target's verified rounds on the hub at ``endpoint`` (in the window)."""
        return self.hubs.setdefault(endpoint, HubRounds())


@dataclass
class HubRounds:
    """One target's verified rounds on one hub inside the window (spans alone not counted)."""

    rounds: int = 0
    tokens: int = 0
    wait_s: float = 0.0  # request out -> proposal in, summed

    def add(self, tokens: int, wait_s: float) -> None:
        self.rounds += 1
        self.tokens += tokens
        self.wait_s += wait_s


Span = tuple[Stats, Stats]


def full_report(
    cfg: EmulationConfig,
    records: list[TargetRecord],
    snapshots: list[list[Stats]],
    cpu: list[tuple[float, float]],
    serial_ms: float | None = None,
) -> dict:
    """The report: :func:`report` over the window slices with every hub's counters pooled, the
    calibration slices', and with several hubs each hub's own figures (:func:`hubs_report`).
    ``serial_ms``: this process's time handling messages per round, where its driver measures
    it (the poller's; ``load_generator_ms_per_round``)."""
    per_hub = [list(itertools.pairwise(s)) for s in snapshots]
    window = [span for spans in per_hub for span in spans[1::2]]
    calibration = [span for spans in per_hub for span in spans[::2]]
    (wall0, cpu0), (wall1, cpu1) = cpu[0], cpu[-1]
    traced = {"gamma_trace": [t for r in records for t in r.traces]} if cfg.tracing else {}
    several = (
        hubs_report(cfg.endpoints, records, per_hub, cfg.duration) if len(snapshots) > 1 else {}
    )
    return {
        **report(cfg, records, window),
        "calibration": calibration_report(records, calibration),
        **traced,
        **several,
        # near 1: this process is the bottleneck, not the hub (split the targets)
        "emulator_cpu_fraction": (cpu1 - cpu0) / (wall1 - wall0),
        # the serial cost it adds to every round it handles (the last of a batch of B proposals
        # waits for B - 1 of these); None: not measured by this driver
        "load_generator_ms_per_round": serial_ms,
    }


def hub_counters(spans: list[Span]) -> dict[str, float]:
    """The hub's counters summed over ``spans`` (STATS snapshots at each one's start and end)."""
    return {
        name: sum(getattr(end, name) - getattr(begin, name) for begin, end in spans)
        for name in ("wall_s", "busy_s", "jobs", "batches", "queue_wait_s")
    }


def per_size_counters(stats: Stats) -> dict[int, tuple[int, float]] | None:
    """batch size -> (batches, summed service seconds) since the hub started, or None from a
    hub whose STATS do not carry the service curve."""
    if stats.batch_sizes is None:
        return None
    return {b: (count, seconds) for b, count, seconds in stats.service_totals()}


def service_curve(spans: list[Span]) -> list[dict] | None:
    """S(B) over ``spans``: one row per batch size the hub drafted (its batches and mean service
    time), or None when the hub does not count batch sizes."""
    totals: dict[int, list[float]] = {}
    for begin, end in spans:
        before, after = per_size_counters(begin), per_size_counters(end)
        if before is None or after is None:
            return None
        for size, (count, seconds) in after.items():
            count0, seconds0 = before.get(size, (0, 0.0))
            if count > count0:
                row = totals.setdefault(size, [0, 0.0])
                row[0] += count - count0
                row[1] += seconds - seconds0
    return [
        {"batch": b, "batches": int(c), "service_ms": 1e3 * s / c}
        for b, (c, s) in sorted(totals.items())
    ]


def _batch_fields(hub: dict[str, float], spans: list[Span]) -> dict:
    batches = hub["batches"]
    return {
        "hub_batches": batches,
        "mean_batch_size": hub["jobs"] / batches if batches else None,
        "batch_service_ms": 1e3 * hub["busy_s"] / batches if batches else None,
        "service_curve": service_curve(spans),
    }


def hubs_report(
    endpoints: tuple[str, ...],
    records: list[TargetRecord],
    per_hub: list[list[Span]],
    duration: float,
) -> dict:
    """Per hub (in ``--hub`` order): sessions placed there over the whole run (warm-up
    included), its open sessions at the window slices' bounds, its counters over the window,
    and the targets' verified rounds on it (``duration``: the window's seconds); and
    ``balance``, how evenly sessions, open sessions, jobs and tokens spread over the hubs."""
    hubs = [
        {
            **hub_figures(ep, sum(r.placed.get(ep, 0) for r in records), spans[1::2]),
            **rounds_on(ep, records, duration),
        }
        for ep, spans in zip(endpoints, per_hub, strict=True)
    ]
    return {
        "hubs": hubs,
        "balance": {
            key: balance([h[key] for h in hubs])
            for key in ("sessions_placed", "mean_open_sessions", "jobs", "tokens_per_s")
        },
    }


def rounds_on(endpoint: str, records: list[TargetRecord], duration: float) -> dict:
    """The targets' verified rounds on one hub in the window: tokens/s and the mean wait for a
    proposal (request out -> proposal in)."""
    rows = [r.hubs[endpoint] for r in records if endpoint in r.hubs]
    rounds = sum(h.rounds for h in rows)
    return {
        "tokens_per_s": sum(h.tokens for h in rows) / duration,
        "rounds": rounds,
        "proposal_wait_ms": 1e3 * sum(h.wait_s for h in rows) / max(rounds, 1),
    }


def hub_figures(endpoint: str, placed: int, window: list[Span]) -> dict:
    """One hub's figures over the window slices ``window``."""
    hub = hub_counters(window)
    open_sessions = [s.sessions for span in window for s in span]
    wall, jobs = hub["wall_s"], hub["jobs"]
    return {
        "endpoint": endpoint,
        "sessions_placed": placed,
        "mean_open_sessions": sum(open_sessions) / max(len(open_sessions), 1),
        "busy_fraction": hub["busy_s"] / wall if wall > 0 else 0.0,
        "jobs": jobs,
        "queue_wait_ms": 1e3 * hub["queue_wait_s"] / max(jobs, 1),
        **_batch_fields(hub, window),
    }


def balance(counts: list[float]) -> dict:
    """How evenly ``counts`` (one per hub) spread: each hub's share of the total, and the
    largest share over an even one (1.0: even; the number of hubs: all on one hub; None when
    there is nothing to share)."""
    total = sum(counts)
    if total <= 0:
        return {"shares": [0.0 for _ in counts], "max_over_even": None}
    shares = [c / total for c in counts]
    return {"shares": shares, "max_over_even": max(shares) * len(counts)}


def calibration_report(records: list[TargetRecord], spans: list[Span]) -> dict:
    """S(d), the batch sizes and the verify time over the calibration slices."""
    hub = hub_counters(spans)
    rounds = sum(r.calibration_rounds for r in records)
    verify_s = sum(r.calibration_verify_s for r in records)
    return {
        "jobs": hub["jobs"],
        "draft_service_s": hub["busy_s"] / hub["jobs"] if hub["jobs"] else None,
        "verify_ms": 1e3 * verify_s / rounds if rounds else None,
        **_batch_fields(hub, spans),
    }


def report(cfg: EmulationConfig, records: list[TargetRecord], spans: list[Span]) -> dict:
    """Aggregate the per-target records and the hub's counters over the window slices."""
    latencies = sorted(x for r in records for x in r.token_latency_s)
    tokens = sum(r.tokens for r in records)
    rounds = sum(r.rounds for r in records)
    trees = sum(r.tree_rounds for r in records)
    chains = rounds - trees
    proposed = sum(r.proposed for r in records)
    alone_spans = sum(r.alone_spans for r in records)
    gammas: dict[int, int] = {}
    for r in records:
        for g, count in r.gammas.items():
            gammas[g] = gammas.get(g, 0) + count
    hub = hub_counters(spans)
    wall, jobs = hub["wall_s"], max(hub["jobs"], 1)
    return {
        "config": asdict(cfg),
        "n_targets": cfg.targets,
        "system_tokens_per_s": tokens / cfg.duration,
        "per_target_tokens_per_s": tokens / cfg.duration / cfg.targets,
        "hub_busy_fraction": hub["busy_s"] / wall if wall > 0 else 0.0,
        "draft_service_s": hub["busy_s"] / jobs,
        "hub_busy_s": hub["busy_s"],
        "hub_jobs": hub["jobs"],
        "queue_wait_ms": 1e3 * hub["queue_wait_s"] / jobs,
        "acceptance_rate": sum(r.accepted for r in records) / max(proposed, 1),
        "mean_accepted": sum(r.accepted for r in records) / max(chains, 1),  # per chain
        "tree_rounds": trees,
        "tree_fraction": trees / max(rounds, 1),
        "tokens_per_tree_round": sum(r.tree_tokens for r in records) / max(trees, 1),
        # the gammas the hub chose (fixed: the OPEN's), 0 for spans decoded alone
        "gamma_counts": {str(g): c for g, c in sorted(gammas.items())},
        "mean_gamma": proposed / max(chains + alone_spans, 1),  # (chains and spans)
        "alone_spans": alone_spans,
        "alone_tokens": sum(r.alone_tokens for r in records),
        "sequence_errors": sum(r.errors for r in records),
        "bytes_per_round": sum(r.bytes for r in records) / max(rounds, 1),
        "rounds": rounds,
        "tokens_in_window": tokens,
        "round_ms": 1e3 * sum(r.round_s for r in records) / max(rounds, 1),
        "verify_ms": 1e3 * sum(r.verify_s for r in records) / max(rounds, 1),
        "latency_ms": latency_summary(latencies),
        "proposal_wait_ms": latency_summary([x for r in records for x in r.proposal_wait_s]),
        **_batch_fields(hub, spans),
        "token_latency_ms": [round(1e3 * x, 4) for x in latencies],  # for pooling across runs
    }
