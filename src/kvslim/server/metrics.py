"""Prometheus metrics of one server, in their own `CollectorRegistry` (never the process-global
one), so that two apps in one process (tests) do not collide.

HTTP-side numbers are recorded by `HTTPMetricsMiddleware`; engine-side numbers by the engine
thread after every step (prometheus_client's metrics are thread-safe)."""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from kvslim.engine.outputs import KVCacheStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# kv_cache/tier.py's TierStats fields -> help
OFFLOAD_COUNTERS = {"hits": "KV blocks served from the offload tier",
                    "misses": "KV blocks looked up in the offload tier and not found",
                    "bytes_read": "Bytes of KV blocks read from the offload tier",
                    "bytes_written": "Bytes of KV blocks written to the offload tier's disk",
                    "load_s": "Seconds spent reading KV blocks from the offload tier",
                    "rejected": "Offload files removed unread: another model's, torn or corrupt"}


# The series the HTTP side records (HTTPMetricsMiddleware) and the served model: every other
# series is the engine's, which data-parallel replicas report under an `engine` label.
SERVER_SERIES = ("kvslim_requests", "kvslim_model_info")


class ServerMetrics:
    def __init__(self, model_name: str, engine_series: bool = True):
        """`engine_series`: False for an API server in front of replicas (kvslim.scaleout),
        whose engine series come from the replicas, labelled by engine."""
        self.registry = CollectorRegistry()
        r, ns = self.registry, "kvslim"
        self.requests = Counter("requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], namespace=ns, registry=r)
        Gauge("model_info", "The served model", ["model_name"], namespace=ns,
              registry=r).labels(model_name).set(1)
        if engine_series:
            self._engine_metrics(ns, r)

    def _engine_metrics(self, ns: str, r: CollectorRegistry) -> None:
        """What the engine thread records (AsyncEngine), after every step."""
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens of requests that started "
                                     "generating", namespace=ns, registry=r)
        self.generation_tokens = Counter("generation_tokens", "Tokens generated", namespace=ns,
                                         registry=r)
        self.finished = Counter("completions_finished", "Completions finished, by reason",
                                ["finish_reason"], namespace=ns, registry=r)
        self.ttft = Histogram("time_to_first_token_seconds", "Arrival to first output token",
                              namespace=ns, registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Time between a request's outputs",
                             namespace=ns, registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Arrival to finish", namespace=ns,
                             registry=r, buckets=LATENCY_BUCKETS)
        self.aborted = Counter("requests_aborted", "Engine requests aborted (client went away)",
                               namespace=ns, registry=r)
        # Proof of batching: how many sequences each step ran together.
        self.batch = Histogram("running_sequences_per_step", "Sequences in one engine step",
                               namespace=ns, registry=r, buckets=BATCH_BUCKETS)
        self.peak_running = Gauge("num_running_peak", "Most sequences run in one step",
                                  namespace=ns, registry=r)
        self.steps = Counter("engine_steps", "Engine steps run", namespace=ns, registry=r)
        self.running = Gauge("num_requests_running", "Sequences running", namespace=ns,
                             registry=r)
        self.waiting = Gauge("num_requests_waiting", "Sequences waiting", namespace=ns,
                             registry=r)
        self.blocks_used = Gauge("kv_cache_blocks_used", "KV-cache blocks in use", namespace=ns,
                                 registry=r)
        self.blocks_total = Gauge("kv_cache_blocks_total", "KV-cache blocks in the pool",
                                  namespace=ns, registry=r)
        self.kv_usage = Gauge("kv_cache_usage_ratio", "Fraction of KV blocks in use",
                              namespace=ns, registry=r)
        self.hit_rate = Gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries (blocks)",
                              namespace=ns, registry=r)
        self.preemptions = Gauge("num_preemptions", "Preemptions since start", namespace=ns,
                                 registry=r)
        self.demoted = Gauge("num_demoted_blocks", "KV blocks demoted to int8 since start "
                             "(--kv-pressure demote)", namespace=ns, registry=r)
        self.engine_alive = Gauge("engine_alive", "1 while the engine loop runs", namespace=ns,
                                  registry=r)
        self._peak = 0
        self._speculation_metrics(ns, r)
        self._spec_seen = (0, 0, 0, [], [])
        # The KV offload tier (--kv-offload-dir / --kv-offload-memory), by TierStats' fields.
        self.offload = {name: Counter(f"kv_offload_{name}", help, namespace=ns, registry=r)
                        for name, help in OFFLOAD_COUNTERS.items()}
        self._offload_seen = dict.fromkeys(OFFLOAD_COUNTERS, 0)

    def _speculation_metrics(self, ns: str, r: CollectorRegistry) -> None:
        """Speculative decoding's (present, at zero, when the engine does not speculate)."""
        self.spec_draft = Counter("spec_decode_draft_tokens", "Draft tokens verified",
                                  namespace=ns, registry=r)
        self.spec_accepted = Counter("spec_decode_accepted_tokens", "Draft tokens accepted",
                                     namespace=ns, registry=r)
        self.spec_verifications = Counter("spec_decode_verifications", "Sequence-steps that "
                                          "verified drafts", namespace=ns, registry=r)
        # By position in the draft (a Medusa head, an EAGLE depth): their ratio is that
        # position's acceptance rate.
        self.spec_drafted_per_pos = Counter(
            "spec_decode_draft_tokens_per_position", "Draft tokens verified, by position in "
            "the draft", ["position"], namespace=ns, registry=r)
        self.spec_accepted_per_pos = Counter(
            "spec_decode_accepted_tokens_per_position", "Draft tokens accepted, by position in "
            "the draft", ["position"], namespace=ns, registry=r)
        self.spec_acceptance = Gauge("spec_decode_acceptance_rate", "Accepted / draft tokens",
                                     namespace=ns, registry=r)
        self.spec_mean_length = Gauge("spec_decode_mean_accepted_length", "Tokens per "
                                      "verification (accepted drafts + 1)", namespace=ns,
                                      registry=r)

    # ---- engine side (engine thread) -----------------------------------------------------
    def observe_engine(self, num_running: int, num_waiting: int, stats: KVCacheStats,
                       batch_size: int | None = None) -> None:
        """Engine state now; `batch_size` is given after a step (the sequences it ran)."""
        if batch_size is not None:
            self.steps.inc()
            self.batch.observe(batch_size)
            if batch_size > self._peak:
                self._peak = batch_size
                self.peak_running.set(batch_size)
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.blocks_used.set(stats.num_used_blocks)
        self.blocks_total.set(stats.num_blocks)
        self.kv_usage.set(stats.num_used_blocks / stats.num_blocks if stats.num_blocks else 0)
        self.hit_rate.set(stats.prefix_cache_hit_rate)
        self.preemptions.set(stats.num_preemptions)
        self.demoted.set(stats.num_demoted_blocks)

    def observe_speculation(self, stats) -> None:
        """Engine's SpecDecodeStats (running totals): counters advance by what is new."""
        drafts, accepted, verifications, drafted_at, accepted_at = self._spec_seen
        self.spec_draft.inc(stats.num_draft_tokens - drafts)
        self.spec_accepted.inc(stats.num_accepted_tokens - accepted)
        self.spec_verifications.inc(stats.num_verifications - verifications)
        for counter, totals, seen in ((self.spec_drafted_per_pos, stats.drafted_per_position,
                                       drafted_at),
                                      (self.spec_accepted_per_pos, stats.accepted_per_position,
                                       accepted_at)):
            for i, total in enumerate(totals):
                counter.labels(str(i)).inc(total - (seen[i] if i < len(seen) else 0))
        self.spec_acceptance.set(stats.acceptance_rate)
        self.spec_mean_length.set(stats.mean_accepted_length)
        self._spec_seen = (stats.num_draft_tokens, stats.num_accepted_tokens,
                           stats.num_verifications, list(stats.drafted_per_position),
                           list(stats.accepted_per_position))

    def observe_offload(self, stats) -> None:
        """The engine's TierStats (running totals): counters advance by what is new."""
        for name, counter in self.offload.items():
            total = getattr(stats, name)
            counter.inc(total - self._offload_seen[name])
            self._offload_seen[name] = total

    # ---- exposition ----------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST


class HTTPMetricsMiddleware:
    """Counts responses by endpoint and status. Plain ASGI (not BaseHTTPMiddleware), which
    would buffer streams and hide client disconnects from the route."""

    def __init__(self, app, metrics: ServerMetrics, endpoints: set[str]):
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            # Unknown paths share one label: a scanner must not create unbounded series.
            path = scope["path"] if scope["path"] in self.endpoints else "other"
            self.metrics.requests.labels(path, str(status["code"])).inc()
