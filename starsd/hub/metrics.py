"""The hub's Prometheus metrics: ``python -m starsd.hub --metrics-port PORT`` (off by default).

Read at scrape time from the counters the hub keeps anyway (:class:`starsd.stats.HubStats`, each
peer's :class:`starsd.stats.TargetStats`, the session table, Q_in), under the hub's lock: nothing
is added to the message path. Served over HTTP by a small threaded server of the standard
library (:class:`MetricsServer`), bounded as prometheus_client's ``start_http_server`` is not:
at most ``MAX_SCRAPERS`` connections at once (one more is closed unanswered), and a connection
that does not send its request within ``SCRAPE_TIMEOUT_S`` is closed (before, 400 idle
connections held 398 threads).

Names, under ``starsd:`` like the target's (:mod:`edge.metrics`):

- ``starsd:hub_sessions``, ``_targets``, ``_queue_depth`` (jobs waiting in Q_in),
  ``_busy_fraction`` (drafting busy time over wall time since start) gauges;
  ``starsd:hub_busy_seconds``, ``_batches``, ``_jobs`` counters; ``starsd:hub_batch_size``
  histogram (jobs per drafted batch); ``starsd:hub_errors{code}`` (ERROR replies sent).
- Per target, label ``target``: ``starsd:spec_decode_num_drafts``, ``_num_draft_tokens``,
  ``_num_accepted_tokens`` (verdicts the hub received: a sequence's last round, which ends it,
  has no verdict), ``starsd:hub_proposals``, ``starsd:hub_sessions_opened``,
  ``starsd:hub_target_errors`` (its messages refused).

The ``target`` label has bounded cardinality: the allow-listed key's name under CURVE (set by the
operator), else ``t-`` and a short hash of the connection's identity; at most ``max_labels``
values, later targets share ``other``. A target that goes away keeps its totals (folded in when
the hub forgets it), so every counter only grows.
"""

from __future__ import annotations

import hashlib
import logging
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from starsd.hub.server import Hub
    from starsd.hub.sessions import Peer

log = logging.getLogger("starsd.hub")

MAX_LABELS = 32
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Totals:
    """One ``target`` label's counters."""

    sessions: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    jobs: int = 0
    errors: int = 0

    def add(self, other: Totals) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class HubCollector(Collector):
    """A prometheus_client collector over a running hub."""

    def __init__(self, hub: Hub, max_labels: int = MAX_LABELS) -> None:
        self.hub = hub
        self.max_labels = max_labels
        self.names: dict[bytes, str] = {}  # peer key -> label (at most max_labels entries)
        self.retired: dict[str, Totals] = {}  # totals of peers the hub has forgotten
        hub.table.on_forget = self._retire  # called with the hub's lock held

    def label(self, peer: Peer) -> str:
        """The bounded ``target`` label of ``peer``."""
        name = self.names.get(peer.key)
        if name is not None:
            return name
        if len(self.names) >= self.max_labels:
            return "other"
        allowed = self.hub.allow.name_of(peer.key.decode()) if self.hub.allow else None
        name = (
            re.sub(r"[^A-Za-z0-9_.-]", "_", allowed)[:40]
            if allowed
            else "t-" + hashlib.blake2b(peer.key, digest_size=4).hexdigest()
        )
        self.names[peer.key] = name
        return name

    def _retire(self, peer: Peer) -> None:
        self.retired.setdefault(self.label(peer), Totals()).add(_totals(peer))

    def collect(self) -> Iterator[Metric]:
        hub = self.hub
        with hub.lock:
            per_target = {k: Totals(**vars(v)) for k, v in self.retired.items()}
            for peer in hub.table.peers.values():
                per_target.setdefault(self.label(peer), Totals()).add(_totals(peer))
            stats = hub.stats
            gauges = {
                "sessions": len(hub.table.sessions),
                "targets": len(hub.table.peers),
                "queue_depth": len(hub.q_in),
                "busy_fraction": stats.busy_fraction(),
            }
            counters = {
                "busy_seconds": stats.busy_now(),
                "batches": stats.batches,
                "jobs": stats.jobs,
            }
            by_size = dict(stats.by_size)
            errors = dict(stats.errors_by_code)
        for name, value in gauges.items():
            yield GaugeMetricFamily(f"starsd:hub_{name}", f"hub {name}", value=value)
        for name, value in counters.items():
            yield CounterMetricFamily(f"starsd:hub_{name}", f"hub {name}", value=value)
        yield _batch_histogram(by_size, counters["jobs"])
        codes = CounterMetricFamily("starsd:hub_errors", "ERROR replies sent", labels=["code"])
        for code, count in sorted(errors.items()):
            codes.add_metric([code], count)
        yield codes
        yield from _per_target(per_target)


def _totals(peer: Peer) -> Totals:
    s = peer.stats
    return Totals(s.sessions, s.rounds, s.proposed, s.accepted, s.jobs, s.errors)


def _batch_histogram(by_size: dict[int, tuple[int, float]], jobs: float) -> Metric:
    buckets = []
    for bound in BATCH_BUCKETS:
        seen = sum(count for size, (count, _) in by_size.items() if size <= bound)
        buckets.append((str(bound), seen))
    total = sum(count for count, _ in by_size.values())
    buckets.append(("+Inf", total))
    return HistogramMetricFamily(
        "starsd:hub_batch_size", "Jobs per drafted batch", buckets=buckets, sum_value=jobs
    )


def _per_target(per_target: dict[str, Totals]) -> Iterator[Metric]:
    names = {
        "spec_decode_num_drafts": ("rounds", "Verdicts received (rounds verified)"),
        "spec_decode_num_draft_tokens": ("proposed", "Draft tokens in those rounds"),
        "spec_decode_num_accepted_tokens": ("accepted", "Draft tokens accepted"),
        "hub_proposals": ("jobs", "Proposals drafted"),
        "hub_sessions_opened": ("sessions", "Sessions opened"),
        "hub_target_errors": ("errors", "Messages refused"),
    }
    for name, (attr, doc) in names.items():
        family = CounterMetricFamily(f"starsd:{name}", doc, labels=["target"])
        for label, totals in sorted(per_target.items()):
            family.add_metric([label], getattr(totals, attr))
        yield family


MAX_SCRAPERS = 16  # connections served at once
SCRAPE_TIMEOUT_S = 5.0  # to send a request, and to read the answer


class _ScrapeHandler(BaseHTTPRequestHandler):
    """GET /metrics (or /) in Prometheus' text format; one request per connection."""

    timeout = SCRAPE_TIMEOUT_S  # socket timeout: a silent connection is closed
    server: MetricsServer

    def do_GET(self) -> None:
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a scraper every few seconds is not worth a log line


class MetricsServer(ThreadingHTTPServer):
    """A thread per scrape, at most ``MAX_SCRAPERS`` at once."""

    daemon_threads = True
    request_queue_size = 64  # the listen backlog (socketserver's 5 stalls scrapers' connects)

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry) -> None:
        self.registry = registry
        self._slots = threading.BoundedSemaphore(MAX_SCRAPERS)
        super().__init__(address, _ScrapeHandler)

    def process_request(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: object
    ) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed unanswered
            return
        try:
            super().process_request(request, client_address)  # type: ignore[arg-type]
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: object
    ) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[arg-type]
        finally:
            self._slots.release()


class Exporter:
    """The metrics HTTP server of one hub, in its own thread; ``close`` stops it."""

    def __init__(self, hub: Hub, host: str, port: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(HubCollector(hub))
        self.httpd = MetricsServer((host, port), self.registry)
        self.port = int(self.httpd.server_port)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_metrics(hub: Hub, host: str, port: int) -> Exporter:
    """Start serving ``hub``'s metrics on http://host:port/metrics (port 0: any free one)."""
    exporter = Exporter(hub, host, port)
    log.info("metrics on http://%s:%d/metrics", host, exporter.port)
    return exporter
