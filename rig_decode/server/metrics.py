"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.engine import RigEngine
from ..engine.sequence import SequenceStatus
from ..trace import Trace

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, engine: RigEngine):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("rig_requests", "Requests by endpoint, HTTP status and API key name",
                                ["endpoint", "status", "key"], registry=r)
        self.tokens = Counter("rig_tokens", "Tokens by kind: prompt, completion (sampled), evidence (spliced)",
                              ["kind"], registry=r)
        self.hops = Counter("rig_hops", "Retrieval hops", registry=r)
        self.retrieval = Histogram("rig_retrieval_latency_seconds", "Search (and rerank) time per hop",
                                   buckets=_LATENCY, registry=r)
        self.splice = Histogram("rig_splice_latency_seconds", "Forward step that spliced a hop's evidence",
                                buckets=_LATENCY, registry=r)
        self.latency = Histogram("rig_request_latency_seconds", "Request time, arrival to last token",
                                 buckets=_LATENCY, registry=r)
        self.finished = Counter("rig_finished", "Finished requests by finish reason", ["reason"], registry=r)
        Gauge("rig_queue_depth", "Requests waiting for a batch slot", registry=r).set_function(
            lambda: len(engine.waiting))
        Gauge("rig_running_sequences", "Sequences in the batch", registry=r).set_function(
            lambda: len(engine.running))
        health = engine.retrieval_health
        Gauge("rig_retrieval_degraded", "1 while retrieval is degraded (too many hung searches; see /health)",
              registry=r).set_function(lambda: float(health()["status"] == "degraded"))
        Gauge("rig_retrieval_hung_searches", "Abandoned searches still running", registry=r).set_function(
            lambda: health()["hung_searches"])
        Gauge("rig_retrieval_abandoned_searches", "Searches abandoned past the timeout since start",
              registry=r).set_function(lambda: health()["abandoned_searches"])
        Gauge("rig_retrieval_restarts", "Retrieval threads that died and were replaced", registry=r).set_function(
            lambda: health()["restarts"])
        self.hop_errors = Counter("rig_hop_errors", "Hops that got no evidence because of an error", registry=r)
        self.dropped_hits = Counter("rig_dropped_hits", "Malformed hits a retriever returned, dropped", registry=r)
        Gauge("rig_parked_sequences", "Sequences parked waiting for evidence", registry=r).set_function(
            lambda: sum(s.status is SequenceStatus.RETRIEVING for s in list(engine.running)))

    def observe(self, trace: Trace) -> None:
        """Count a finished request."""
        self.tokens.labels("prompt").inc(trace.prompt_tokens)
        self.tokens.labels("completion").inc(trace.generated_tokens)
        self.tokens.labels("evidence").inc(trace.evidence_tokens)
        self.hops.inc(trace.num_hops)
        for step in trace.retrieval_steps:
            self.retrieval.observe(step.latency_ms / 1e3)
            if step.error:
                self.hop_errors.inc()
            self.dropped_hits.inc(step.info.get("dropped_hits", 0))
            if step.splice_ms:
                self.splice.observe(step.splice_ms / 1e3)
        self.latency.observe(trace.total_ms / 1e3)
        self.finished.labels(trace.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
