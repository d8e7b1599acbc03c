"""The node worker's metrics, exported through Ray's metrics agent (Prometheus format).

Counters give rates (samples/s, tokens/s, bytes/s) once scraped; histograms give the time each
stage takes per sample: the request (prefill + dump publish), verification, the store write.
"""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Counter, Histogram

_STAGE_BOUNDARIES = [0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class WorkerMetrics:
    def __init__(self, worker: str) -> None:
        tags = {"worker": worker}

        def counter(name: str, description: str) -> Counter:
            metric = Counter(name, description=description, tag_keys=("worker",))
            metric.set_default_tags(tags)
            return metric

        self.samples = counter("hsx_samples_total", "samples written to the store")
        self.tokens = counter("hsx_tokens_total", "prompt tokens captured")
        self.bytes = counter("hsx_bytes_total", "hidden-state bytes handed to the store writer")
        self.failed = counter("hsx_failed_samples_total", "samples recorded as failed")
        self.restarts = counter("hsx_server_restarts_total", "SGLang server restarts")
        self.shards = counter("hsx_shards_total", "shards committed")
        self.throttled = counter(
            "hsx_throttled_requests_total",
            "store PUTs the store throttled (503 SlowDown), retried, of committed shards",
        )
        self.stage_seconds = Histogram(
            "hsx_stage_seconds",
            description="seconds per sample in each stage",
            boundaries=_STAGE_BOUNDARIES,
            tag_keys=("worker", "stage"),
        )
        self.stage_seconds.set_default_tags(tags)

    def record_request(self, tokens: int, seconds: float) -> None:
        self.tokens.inc(tokens)
        self.stage_seconds.observe(seconds, tags={"stage": "request"})

    def record_verify(self, seconds: float) -> None:
        self.stage_seconds.observe(seconds, tags={"stage": "verify"})

    def record_shard(self, summary: dict[str, Any]) -> None:
        """A committed shard, as its stored summary tells (actors/shard_writer.py)."""
        self.shards.inc()
        if throttled := summary.get("throttled_requests", 0):
            self.throttled.inc(throttled)

    def record_write(self, seconds: float, nbytes: int) -> None:
        self.samples.inc()
        self.bytes.inc(nbytes)
        self.stage_seconds.observe(seconds, tags={"stage": "write"})
