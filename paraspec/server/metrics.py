"""Prometheus metrics of one server, named as vLLM names its own (`vllm:` -> `paraspec:`) where one exists.

paraspec:num_requests_total{endpoint,status}            every answered request by HTTP status
paraspec:request_success_total{finished_reason}         finished generations: stop, length, cancelled, timeout
paraspec:num_requests_running / _waiting                 the generations in progress / the FIFO queue depth
paraspec:batch_rows_per_step, _batch_forwards, _batch_mean_rows   batched requests (Engine max_num_seqs)
paraspec:prompt_tokens_total, paraspec:generation_tokens_total
paraspec:spec_decode_num_drafts_total                    verification rounds
paraspec:spec_decode_num_draft_tokens_total / _num_accepted_tokens_total
paraspec:spec_decode_num_accepted_tokens_per_pos_total{position}   accepted drafts by their position in the draft
paraspec:spec_decode_draft_acceptance_rate               accepted / drafted, over the server's life
paraspec:spec_decode_mean_accepted_length                tokens gained per verification (bonus included)
paraspec:time_to_first_token_seconds, paraspec:time_per_output_token_seconds,
paraspec:e2e_request_latency_seconds, paraspec:request_queue_time_seconds   histograms
paraspec:worker_restarts_total                           restart_workers() after a worker fault
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
LATENCY_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class ServerMetrics:
    """One registry per server (two servers in one process do not share counters)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, strategy: str):
        disable_created_metrics()  # no `_created` series (as vLLM): counters read as plain totals
        self.registry = registry = CollectorRegistry()
        labels = dict(model_name=model_name, strategy=strategy)
        names = list(labels)

        def counter(name, doc, extra=()):
            return Counter(f"paraspec:{name}", doc, names + list(extra), registry=registry)

        def gauge(name, doc):
            return Gauge(f"paraspec:{name}", doc, names, registry=registry).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(f"paraspec:{name}", doc, names, buckets=buckets, registry=registry).labels(**labels)

        self._labels = labels
        self._requests = counter(
            "num_requests", "Requests answered, by endpoint and HTTP status", ("endpoint", "status")
        )
        self._success = counter("request_success", "Generations finished, by finish reason", ("finished_reason",))
        self.running = gauge("num_requests_running", "Generations running (at most the engine's max_num_seqs)")
        self.batch_rows = gauge("batch_rows_per_step", "Rows of the last step's forwards, every running request's")
        self.batch_forwards = gauge("batch_forwards", "Forwards run for batched requests, server lifetime")
        self.batch_mean_rows = gauge("batch_mean_rows", "Rows per forward shared by several requests, lifetime")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the FIFO queue")
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens processed").labels(**labels)
        self._generation_tokens = counter("generation_tokens", "Tokens generated").labels(**labels)
        self._drafts = counter("spec_decode_num_drafts", "Verification rounds").labels(**labels)
        self._draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed").labels(**labels)
        self._accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted").labels(**labels)
        self._accepted_per_position = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft", ("position",)
        )
        self._acceptance = gauge("spec_decode_draft_acceptance_rate", "Accepted / drafted tokens, server lifetime")
        self._mean_accepted = gauge(
            "spec_decode_mean_accepted_length", "Tokens gained per verification round (bonus included), server lifetime"
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token (prefill included)", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token after the first", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, queue included", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting in the queue", LATENCY_BUCKETS)
        self.restarts = counter("worker_restarts", "Worker restarts after a worker fault").labels(**labels)
        self._restarts_seen = 0
        self._lock = threading.Lock()
        self._totals = dict(drafted=0, accepted=0, rounds=0, verified=0)

    def request(self, endpoint: str, status: int) -> None:
        self._requests.labels(**self._labels, endpoint=endpoint, status=str(status)).inc()

    def generation(self, result, finished_reason: str) -> None:
        """Count one finished (or cancelled) generation from its GenerationResult."""
        stats = result.stats
        self._success.labels(**self._labels, finished_reason=finished_reason).inc()
        self._prompt_tokens.inc(stats.prompt_tokens)
        self._generation_tokens.inc(stats.new_tokens)
        if finished_reason in ("stop", "length") and stats.new_tokens:
            self.ttft.observe(stats.ttft_s)
            if stats.new_tokens > 1:
                self.tpot.observe(stats.tpot_ms / 1000)
        if stats.acceptance_rate is None:
            return
        self._drafts.inc(stats.rounds)
        self._draft_tokens.inc(stats.drafted)
        self._accepted_tokens.inc(stats.accepted)
        for position, accepted in enumerate(stats.accepted_per_position):
            self._accepted_per_position.labels(**self._labels, position=str(position)).inc(accepted)
        with self._lock:
            t = self._totals
            t["drafted"] += stats.drafted
            t["accepted"] += stats.accepted
            t["rounds"] += stats.rounds
            t["verified"] += round((stats.mean_accepted_length or 0) * stats.rounds)
            if t["drafted"]:
                self._acceptance.set(t["accepted"] / t["drafted"])
            if t["rounds"]:
                self._mean_accepted.set(t["verified"] / t["rounds"])

    def engine(self, engine) -> None:
        """What the Engine counts, read when /metrics is rendered: its generations running and in line, its worker
        restarts, its Scheduler's counters (scheduler.BatchStats)."""
        self.running.set(engine.running)
        self.waiting.set(engine.waiting)
        self.restarts.inc(engine.restarts - self._restarts_seen)
        self._restarts_seen = engine.restarts
        if engine.batch_stats is not None:
            self.batching(engine.batch_stats)

    def batching(self, stats) -> None:
        """The Scheduler's counters (scheduler.BatchStats)."""
        self.batch_rows.set(stats.last_rows)
        self.batch_forwards.set(stats.steps)
        shared = sum(stats.widths.values())
        self.batch_mean_rows.set(stats.shared_rows / shared if shared else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
