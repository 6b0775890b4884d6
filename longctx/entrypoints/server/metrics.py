"""Prometheus metrics of one server: latency histograms, queue gauges, KV pages, counters.

Owns: the metric objects (in a registry of their own, so two servers in one process do not
collide) and their exposition text. Never: reading the engine; the engine thread reports.
prometheus-client's metrics are thread-safe, so the engine thread writes and the event loop
renders without a lock.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

# Prefill of a long document can take minutes on a CPU: the upper buckets reach that far.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)
DISK_STATES = ("ok", "degraded", "stalled")  # ``DiskKVStore.state()``


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "longctx_time_to_first_token_seconds",
            "Seconds from a request's arrival at the server to its first generated token.",
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "longctx_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a request (finished requests).",
            buckets=ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "longctx_e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token (finished requests).",
            buckets=E2E_BUCKETS, registry=r)
        self.num_running = Gauge("longctx_num_requests_running",
                                 "Requests in the engine's running batch.", registry=r)
        self.num_waiting = Gauge("longctx_num_requests_waiting",
                                 "Requests accepted and waiting for a running slot (or KV pages).",
                                 registry=r)
        self.kv_pages_used = Gauge("longctx_kv_pages_used",
                                   "KV pages in use by running requests.", ["tier"], registry=r)
        self.kv_pages_cached = Gauge("longctx_kv_pages_cached",
                                     "KV pages held only by the prefix store (evictable).",
                                     ["tier"], registry=r)
        self.kv_pages_free = Gauge("longctx_kv_pages_free", "KV pages free.", ["tier"], registry=r)
        self.prefix_hit_tokens = Gauge("longctx_prefix_cache_hit_tokens",
                                       "Prompt tokens served from the prefix store, by tier "
                                       "(cumulative).", ["tier"], registry=r)
        self.lookahead_tokens = Gauge("longctx_lookahead_tokens",
                                      "Lookahead draft tokens proposed and accepted (cumulative).",
                                      ["kind"], registry=r)
        self.lookahead_steps = Gauge("longctx_lookahead_verify_steps",
                                     "Decode steps that verified a draft (cumulative).", registry=r)
        self.prompt_tokens_computed = Gauge("longctx_prompt_tokens_computed",
                                            "Prompt tokens the model prefilled (cumulative).",
                                            registry=r)
        self.disk_state = Gauge("longctx_disk_tier_state",
                                "1 for the disk tier's state (ok, degraded: a timeout, quarantined page or "
                                "failed write this run; stalled: an I/O stuck past disk_timeout_s), else 0.",
                                ["state"], registry=r)
        self.disk_io_stuck = Gauge("longctx_disk_io_stuck",
                                   "Disk tier file operations still running past disk_timeout_s.", registry=r)
        self.disk_io_timeouts = Gauge("longctx_disk_io_timeouts",
                                      "Disk tier file operations that missed disk_timeout_s (cumulative).",
                                      registry=r)
        self.disk_pages_quarantined = Gauge("longctx_disk_pages_quarantined",
                                            "Disk tier pages taken out of use: bad files and the pages chained "
                                            "after them (cumulative).", registry=r)
        self.disk_failed_writes = Gauge("longctx_disk_failed_writes",
                                        "Disk tier pages that could not be written (cumulative).", registry=r)
        self.requests_finished = Counter(
            "longctx_requests_finished_total",
            "Requests that left the engine, by finish reason (stop, length, abort).",
            ["finish_reason"], registry=r)
        self.requests_rejected = Counter(
            "longctx_requests_rejected_total",
            "Requests refused with 429 because the queue was full.", registry=r)
        self.prompt_tokens = Counter("longctx_prompt_tokens_total",
                                     "Prompt tokens of requests added to the engine.", registry=r)
        self.generation_tokens = Counter("longctx_generation_tokens_total",
                                         "Tokens generated.", registry=r)

    def set_engine_state(self, num_running: int, num_waiting: int,
                         kv_usage: dict[str, dict[str, int]], cache_stats: Any,
                         lookahead: Any = None, disk: dict[str, Any] | None = None) -> None:
        """``lookahead``: the engine's overall ``LookaheadStats`` (None when it is off);
        ``disk``: ``LLMEngine.disk_state()`` (None without a disk tier: no disk metrics)."""
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        for tier, pages in kv_usage.items():
            self.kv_pages_used.labels(tier=tier).set(pages["in_use"])
            self.kv_pages_cached.labels(tier=tier).set(pages["cached"])
            self.kv_pages_free.labels(tier=tier).set(pages["free"])
        for tier, tokens in cache_stats.hit_tokens.items():
            self.prefix_hit_tokens.labels(tier=tier).set(tokens)
        self.prompt_tokens_computed.set(cache_stats.computed_prompt_tokens)
        if lookahead is not None:
            self.lookahead_tokens.labels(kind="drafted").set(lookahead.num_drafted)
            self.lookahead_tokens.labels(kind="accepted").set(lookahead.num_accepted)
            self.lookahead_steps.set(lookahead.num_steps)
        if disk is not None:
            for state in DISK_STATES:
                self.disk_state.labels(state=state).set(int(disk["state"] == state))
            self.disk_io_stuck.set(disk["stuck_io"])
            self.disk_io_timeouts.set(disk["timeouts"])
            self.disk_pages_quarantined.set(disk["quarantined"])
            self.disk_failed_writes.set(disk["failed_writes"])

    def observe_finished(self, finish_reason: str, e2e_seconds: float, inter_token: list[float]) -> None:
        self.requests_finished.labels(finish_reason=finish_reason).inc()
        self.e2e_latency.observe(e2e_seconds)
        for gap in inter_token:
            self.inter_token_latency.observe(gap)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
