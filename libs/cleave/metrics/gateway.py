"""The gateway's request metrics, named after vLLM's (`vllm:` -> `cleave:`).

One request, as the gateway sees it (`services.gateway.metered.MeteredBackend` drives this):

    arrival --queue--> routed to a worker --> first token --ITL--> ... --> last chunk
            \\______________ time_to_first_token ______/
            \\_________________________ e2e_request_latency ____________________/
    time_per_output_token = (e2e - ttft) / (generation tokens - 1)

`request_queue_time_seconds` is what the gateway adds before a worker has the request
(tokenization, placement); time in a worker's engine queue is part of TTFT. Inter-token
latency is observed per streamed chunk after the first (a chunk carries every token the
decode worker's step made for the request). Every request ends in exactly one of
`request_success_total{finished_reason}` and `request_failure_total{code}`.

`GatewayMetrics` is also the routing backend's `RouteObserver`: a request arrived and not
yet routed is remembered by id until its first start (or its end).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from cleave.metrics.labels import (
    PER_TOKEN_BUCKETS, PREFIX, REQUEST_SECONDS_BUCKETS, TTFT_BUCKETS, MetricLabels, one_two_five_buckets,
)
from cleave.metrics.step_histogram import RegisteredHistogram
from cleave.rpc.types import Usage


DecodeLoads = Callable[[], Iterable[tuple[str, int]]]  # (decode worker id, requests there) at scrape time


class _DecodeRequestsGauge:
    """`num_decode_worker_requests{decode_worker}`, read at scrape time: workers come and go."""

    NAME = f"{PREFIX}num_decode_worker_requests"
    DOC = "Requests this gateway has streaming from each decode worker (started and not ended)"

    def __init__(self, names: Sequence[str], values: Sequence[str], read: DecodeLoads) -> None:
        self._names, self._values, self._read = [*names, "decode_worker"], list(values), read

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.NAME, self.DOC, labels=self._names)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.NAME, self.DOC, labels=self._names)
        for worker_id, count in self._read():
            family.add_metric([*self._values, worker_id], count)
        yield family


@dataclass
class RequestClock:
    """The moments of one request (perf_counter seconds)."""

    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None


class TenantSeries:
    """Per-tenant (API key tag) counters: its finished requests, and the tokens of each of its
    requests that got as far as a computed prompt, however it ended."""

    def __init__(self, registry: CollectorRegistry, names: list[str], values: tuple[str, ...]) -> None:
        self._values = values
        self.requests = Counter(f"{PREFIX}tenant_requests", "Finished requests by tenant (API key tag)",
                                [*names, "tenant"], registry=registry)
        self.tokens = Counter(f"{PREFIX}tenant_tokens", "Tokens by tenant (API key tag) and kind: prompt, "
                              "cached_prompt (of the prompt), generation; requests that ended early (failed, "
                              "cancelled) count what they had", [*names, "tenant", "kind"], registry=registry)

    def count(self, tenant: str, usage: Usage, finished: bool) -> None:
        if finished:
            self.requests.labels(*self._values, tenant).inc()
        for kind, count in (("prompt", usage.prompt_tokens), ("cached_prompt", usage.cached_prompt_tokens),
                            ("generation", usage.completion_tokens)):
            self.tokens.labels(*self._values, tenant, kind).inc(count)


class GatewayMetrics:
    """Every gateway series, labelled with the served model and the gateway id.

    Args:
        registry: the process's registry (`ServiceMetrics.registry`).
        labels: model_name and worker_id (the gateway id).
        max_model_len: upper end of the token-count buckets.
        tenants: count each tenant's requests and tokens (`TenantSeries`); off, `finished`
            and `failed` ignore their `tenant` (whoever can read the metrics would learn every
            key's usage).
    """

    def __init__(self, registry: CollectorRegistry, labels: MetricLabels, max_model_len: int = 1 << 20,
                 tenants: bool = False) -> None:
        names, values = list(MetricLabels.NAMES), labels.values
        self._names, self._values = names, values
        self._registry = registry
        self._unrouted: dict[str, float] = {}  # request id -> arrival, until its first start
        self._ended: dict[str, Usage] = {}  # request id -> its usage as its stream ended, until it leaves

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"{PREFIX}{name}", doc, names, buckets=buckets, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, names, registry=registry).labels(*values)

        self.success = Counter(f"{PREFIX}request_success", "Requests that finished, by finish reason",
                               [*names, "finished_reason"], registry=registry)
        self.failure = Counter(f"{PREFIX}request_failure", "Requests that failed, by gRPC status code",
                               [*names, "code"], registry=registry)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first streamed token", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Per request: (e2e - TTFT) / (generation tokens - 1)", PER_TOKEN_BUCKETS)
        # once a chunk, on the event loop alone: no lock a sample
        self.itl = RegisteredHistogram(registry, f"{PREFIX}inter_token_latency_seconds",
                                       "Time between two streamed chunks of a request", dict(zip(names, values)),
                                       PER_TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last chunk", REQUEST_SECONDS_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to the request's start on a worker (tokenize, place)",
                                    REQUEST_SECONDS_BUCKETS)
        token_buckets = one_two_five_buckets(max(max_model_len, 1))
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of finished requests", token_buckets)
        self.generation_tokens = histogram("request_generation_tokens",
                                           "Generated tokens of finished requests (all samples)", token_buckets)
        self.reasoning_tokens = counter("reasoning_tokens", "Generated tokens inside the reasoning section")
        self.cached_prompt_tokens = counter("prompt_tokens_cached", "Prompt tokens whose KV came from a cache")
        self.migrations = counter("request_migrations", "Moves of a request to another decode worker")
        self.routing = Counter(f"{PREFIX}routing_decisions", "Where requests were started: prefill local to "
                               "the decode worker or remote, and which decode worker",
                               [*names, "prefill", "decode_worker"], registry=registry)
        self.scaling_samples = Counter(f"{PREFIX}test_time_scaling_samples", "Samples drawn for test-time scaling",
                                       [*names, "strategy"], registry=registry)
        # with several API keys and `tenants`: each key's (its tag's) requests and tokens
        self.tenants = TenantSeries(registry, names, values) if tenants else None
        self.running = Gauge(f"{PREFIX}num_requests_running", "Requests streaming tokens", names,
                             registry=registry).labels(*values)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests without a first token yet", names,
                             registry=registry).labels(*values)

    def track_in_flight(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Read the running and waiting gauges from these callbacks at scrape time."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)

    def track_decode_workers(self, loads: DecodeLoads) -> None:
        """Report each decode worker's requests (`num_decode_worker_requests`) from `loads`."""
        self._registry.register(_DecodeRequestsGauge(self._names, self._values, loads))

    def arrived(self, request_id: str, clock: RequestClock) -> None:
        """A request came in; its queue time ends at its first `routed`."""
        self._unrouted.setdefault(request_id, clock.arrival)  # a duplicate id keeps the first's time

    def left(self, request_id: str) -> None:
        """A request ended (forget it if it never started)."""
        self._unrouted.pop(request_id, None)
        self._ended.pop(request_id, None)

    def ended(self, request_id: str, usage: Usage) -> None:
        """RouteObserver: the request's stream ended with `usage` so far; `failed` counts a
        tenant's tokens from it (a finished request's come with its last chunk)."""
        if self.tenants is not None:
            self._ended[request_id] = usage

    def routed(self, request_id: str, remote_prefill: bool, decode_worker: str) -> None:
        """RouteObserver: the request starts on `decode_worker` (again, after a move)."""
        self.routing.labels(*self._values, "remote" if remote_prefill else "local", decode_worker).inc()
        arrival = self._unrouted.pop(request_id, None)
        if arrival is not None:
            self.queue_time.observe(time.perf_counter() - arrival)

    def migrated(self, request_id: str) -> None:
        """RouteObserver: the request moves to another decode worker."""
        self.migrations.inc()

    def scaled(self, strategy: str, num_samples: int) -> None:
        self.scaling_samples.labels(*self._values, strategy).inc(num_samples)

    def finished(self, clock: RequestClock, finished_reason: str, prompt_tokens: int, generation_tokens: int,
                 reasoning_tokens: int = 0, cached_prompt_tokens: int = 0, tenant: str = "") -> None:
        """A request that ended with its last chunk (the first-token time must be set);
        `tenant`: its API key's tag, with several keys ("": not counted per tenant; counted
        only with `tenants` on)."""
        now = time.perf_counter()
        first = clock.first_token if clock.first_token is not None else now
        e2e = now - clock.arrival
        self.success.labels(*self._values, finished_reason).inc()
        self.e2e.observe(e2e)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        if generation_tokens > 1:
            self.tpot.observe((now - first) / (generation_tokens - 1))
        if reasoning_tokens:
            self.reasoning_tokens.inc(reasoning_tokens)
        if cached_prompt_tokens:
            self.cached_prompt_tokens.inc(cached_prompt_tokens)
        if tenant and self.tenants is not None:
            usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=generation_tokens,
                          reasoning_tokens=reasoning_tokens, cached_prompt_tokens=cached_prompt_tokens)
            self.tenants.count(tenant, usage, finished=True)

    def failed(self, code: str, request_id: str = "", tenant: str = "") -> None:
        """A request that ended without its last chunk (an error, a deadline, a client that
        left); with `tenants` on, the tokens of `tenant`'s request up to then (reported by
        `ended`: none when it ended before its prompt was computed)."""
        self.failure.labels(*self._values, code).inc()
        usage = self._ended.pop(request_id, None)
        if tenant and usage is not None and self.tenants is not None:
            self.tenants.count(tenant, usage, finished=False)
