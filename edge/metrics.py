"""The target's Prometheus metrics (``GET /metrics`` of ``edge.target --serve``).

Names follow vLLM's where they mean the same, under ``starsd:`` (a colon is legal in Prometheus
names; vLLM uses it too), so its dashboards and PromQL carry over:

- ``starsd:spec_decode_num_drafts`` (rounds verified), ``_num_draft_tokens``,
  ``_num_accepted_tokens``, ``_num_accepted_tokens_per_pos{position}``: acceptance rate is
  ``rate(accepted) / rate(draft_tokens)``, mean acceptance length
  ``1 + rate(accepted) / rate(num_drafts)``.
- ``starsd:tokens_decoded_alone{reason}``: tokens the target decoded without a proposal,
  ``fallback`` (the hub was late or away) or ``hub_asked`` (the hub found speculation does not
  pay now): when these grow, speculation has stopped paying.
- ``starsd:num_requests_running`` / ``_waiting``, ``starsd:time_to_first_token_seconds``,
  ``starsd:inter_token_latency_seconds`` (per token after the first round: a round's gap spread
  over the tokens it committed), ``starsd:e2e_request_latency_seconds``, prompt and generation
  token counters,
  ``starsd:request_success{finished_reason}`` (stop, length; abort: decoding cancelled, the
  client went away or a stop string ended it), ``starsd:requests_rejected{status}``.

Its own registry (not prometheus_client's global one), so several servers in one process (tests)
keep their figures apart. Counters are thread-safe; the server updates them on its event loop.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

MAX_POSITIONS = 32  # label values of ..._per_pos: draft positions past this share the last one
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
_REQUEST_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)


class TargetMetrics:
    """Every metric the target exports, in one registry."""

    def __init__(self, model: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model}
        self.labels = labels

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(f"starsd:{name}", doc, ["model_name", *extra], registry=r)

        self.num_drafts = counter("spec_decode_num_drafts", "Speculation rounds verified")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.num_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft",
            "position",
        )
        self.alone = counter("tokens_decoded_alone", "Tokens decoded without a proposal", "reason")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.success = counter("request_success", "Requests finished", "finished_reason")
        self.rejected = counter("requests_rejected", "Requests refused, by HTTP status", "status")
        self.running = Gauge(
            "starsd:num_requests_running", "Sequences being decoded", ["model_name"], registry=r
        )
        self.waiting = Gauge(
            "starsd:num_requests_waiting",
            "Requests admitted, not yet decoding",
            ["model_name"],
            registry=r,
        )
        self.hub_up = Gauge(
            "starsd:hub_connected",
            "Hubs serving this target now (--hub A,B: up to 2)",
            ["model_name"],
            registry=r,
        )
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Time per output token after the first (a round's gap over its tokens)",
            _LATENCY_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "Arrival to last token", _REQUEST_BUCKETS
        )
        for metric in (
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted,
            self.prompt_tokens,
            self.generation_tokens,
        ):
            metric.labels(**labels)  # exported as 0 from the start, not from first use

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(
            f"starsd:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry
        )

    def record_round(self, proposed: int, accepted: int) -> None:
        """One verification: ``proposed`` draft tokens, the first ``accepted`` of them kept."""
        m = self.labels
        self.num_drafts.labels(**m).inc()
        self.num_draft_tokens.labels(**m).inc(proposed)
        self.num_accepted.labels(**m).inc(accepted)
        for position in range(accepted):
            label = str(min(position, MAX_POSITIONS - 1))
            self.accepted_per_pos.labels(**m, position=label).inc()

    def record_tokens(self, tokens: int, gap_s: float, first: bool) -> None:
        """``tokens`` committed ``gap_s`` after the previous ones (after arrival if ``first``)."""
        m = self.labels
        self.generation_tokens.labels(**m).inc(tokens)
        if first:  # the tokens that came with the first one have no gap of their own
            self.ttft.labels(**m).observe(gap_s)
            return
        for _ in range(tokens):
            self.itl.labels(**m).observe(gap_s / tokens)

    def record_finish(self, reason: str, e2e_s: float, fallback: int, hub_asked: int) -> None:
        """A request finished normally (``reason``: stop or length)."""
        m = self.labels
        self.success.labels(**m, finished_reason=reason).inc()
        self.e2e.labels(**m).observe(e2e_s)
        self.alone.labels(**m, reason="fallback").inc(fallback)
        self.alone.labels(**m, reason="hub_asked").inc(hub_asked)

    def record_abort(self) -> None:
        """A request's decoding was cancelled before its end (client gone, stop string)."""
        self.success.labels(**self.labels, finished_reason="abort").inc()

    def set_queue(self, running: int, waiting: int, hubs_up: int) -> None:
        self.running.labels(**self.labels).set(running)
        self.waiting.labels(**self.labels).set(waiting)
        self.hub_up.labels(**self.labels).set(hubs_up)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
