"""Prometheus metrics for a served runtime (SPEC section 6).

:class:`PrometheusObserver` implements :class:`lumen_core.runtime.Observer`, so the runtime
reports every finished request and batch through two plain method calls and knows nothing of
Prometheus.  Each server owns its own ``CollectorRegistry`` (never the process-global one), so
two servers in one process -- the test suite starts several -- never share or clash on series.

Gauges that describe *current* state (pending requests, in-flight batches, active sequences,
padding ratio) are read from the runtime at scrape time by :class:`RuntimeCollector` instead of
being pushed on every request: a scrape every few seconds costs less than an update per
request, and the values can never drift from the batcher's own counters.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from typing import TYPE_CHECKING, Any, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from ..runtime import Observer

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .runtime_api import RuntimeQueries

#: seconds; spans a sub-millisecond tensor request up to a request that waited out a long queue
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
#: powers of two: batch sizes are usually bounded by a power-of-two max_batch_size
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
NAMESPACE = "lumen"
CONTENT_TYPE = CONTENT_TYPE_LATEST
_US = 1e-6
CREATED_SUFFIX = "_created"


class Histogram:
    """A histogram of one label set, counted in plain Python: the bucket found by bisection,
    no lock.  The observer is called on the runtime's event loop only (dispatch and batch
    completion both run there), so nothing races; prometheus_client's ``Histogram.observe``
    takes a lock and walks every bucket in a Python loop (4 us for a request's three
    observations, more than the runtime's whole request path)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list:
        """(le, cumulative count) pairs as the exposition writes them."""
        out = []
        acc = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            acc += n
            out.append((floatToGoString(bound), acc))
        return out


#: (metric name, help) of the per-task histograms, in the order a task's tuple holds them
_HISTOGRAMS = (
    ("queue_seconds", "Time a successful request waited in its batch queue.", LATENCY_BUCKETS),
    ("compute_seconds", "Model run time of the batch a successful request was part of.",
     LATENCY_BUCKETS),
    ("request_seconds", "End-to-end time in the runtime (validation, preprocessing, queue, "
     "compute, postprocess), every outcome.", LATENCY_BUCKETS),
    ("batch_size", "Requests per executed batch.", BATCH_SIZE_BUCKETS),
)
_REQUESTS_HELP = ("Finished inference requests by task, input route (raw/tensor), outcome code "
                  "(ok or an error code) and the task version that served it (empty when the "
                  "request failed before one was chosen).")


class PrometheusObserver(Observer):
    """Per-task request/batch metrics plus transport-level counters, in one registry.

    The runtime's per-request and per-batch figures are counted in plain dicts and lists
    (:class:`Histogram`) and written out at scrape time (:class:`_RequestCollector`); the
    transport counter is prometheus_client's, its HTTP increments folded in at scrape time."""

    def __init__(self, runtime: RuntimeQueries, registry: Optional[CollectorRegistry] = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        #: (task, route, code, version) -> finished requests
        self.request_counts: dict = {}
        #: task -> its (queue, compute, request, batch size) histograms
        self.histograms: dict = {}
        r.register(_RequestCollector(self))
        self.transport = Counter(
            "transport_requests", "Requests per transport endpoint and status (HTTP status "
            "code or gRPC status name).", ["transport", "endpoint", "status"],
            namespace=NAMESPACE, registry=r)
        r.register(RuntimeCollector(runtime))
        # HTTP requests counted as plain ints per (route template, status) and added to
        # ``transport`` when scraped: a dict increment per request, not a labelled child's lock
        self._http: dict = {}

    def _children(self, task: str) -> tuple:
        h = self.histograms.get(task)
        if h is None:
            h = self.histograms[task] = tuple(Histogram(b) for _n, _h, b in _HISTOGRAMS)
        return h

    # -- runtime.Observer ----------------------------------------------------------------
    def request(self, task: str, route: str, code: str, e2e_us: int,
                queue_us: int = 0, compute_us: int = 0, version: str = "") -> None:
        queue, compute, e2e, _ = self._children(task)
        key = (task, route, code, version)
        counts = self.request_counts
        counts[key] = counts.get(key, 0) + 1
        e2e.observe(e2e_us * _US)
        if code == "ok":
            queue.observe(queue_us * _US)
            compute.observe(compute_us * _US)

    def batch(self, task: str, size: int, compute_us: int) -> None:
        self._children(task)[3].observe(size)

    # -- transports ----------------------------------------------------------------------
    def transport_request(self, transport: str, endpoint: str, status: str) -> None:
        """One finished HTTP or gRPC call (``endpoint`` is the route template, never the path,
        so a scan of random URLs cannot blow up the series count)."""
        self.transport.labels(transport, endpoint, status).inc()

    def http_request(self, endpoint: str, status: int) -> None:
        """One finished HTTP request (``endpoint``: the route template), counted cheaply; it
        reaches ``lumen_transport_requests_total`` at the next :meth:`exposition`."""
        key = (endpoint, status)
        counts = self._http
        counts[key] = counts.get(key, 0) + 1

    def flush(self) -> None:
        """Add the HTTP requests counted since the last flush to the transport counter."""
        counts = self._http
        if counts:
            self._http = {}
            for (endpoint, status), n in counts.items():
                self.transport.labels("http", endpoint, str(status)).inc(n)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format, without prometheus_client's
        ``*_created`` series (a creation timestamp per label set that doubles the series count
        and that no Lumen dashboard reads)."""
        self.flush()
        return generate_latest(_NoCreated(self.registry))


class _NoCreated:
    """A registry view whose families leave out their ``*_created`` samples (process-local:
    ``prometheus_client.disable_created_metrics`` would change every registry in the process)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Any]:
        for fam in self.registry.collect():
            if any(s.name.endswith(CREATED_SUFFIX) for s in fam.samples):
                fam.samples = [s for s in fam.samples if not s.name.endswith(CREATED_SUFFIX)]
            yield fam


class _RequestCollector:
    """The runtime's request counter and per-task histograms of an observer, at scrape time."""

    def __init__(self, observer: PrometheusObserver):
        self.observer = observer

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        obs = self.observer
        requests = CounterMetricFamily(f"{NAMESPACE}_requests", _REQUESTS_HELP,
                                       labels=["task", "route", "code", "version"])
        for labels, n in list(obs.request_counts.items()):
            requests.add_metric(list(labels), float(n))
        yield requests
        hists = list(obs.histograms.items())
        for k, (name, doc, _bounds) in enumerate(_HISTOGRAMS):
            fam = HistogramMetricFamily(f"{NAMESPACE}_{name}", doc, labels=["task"])
            for task, h in hists:
                fam.add_metric([task], h[k].buckets(), sum_value=h[k].total)
            yield fam


class RuntimeCollector:
    """Scrape-time gauges read through the runtime's ``load()`` query."""

    def __init__(self, runtime: RuntimeQueries):
        self.runtime = runtime

    def describe(self) -> list:
        # an empty description keeps registration from calling collect() on a cold runtime
        return []

    def collect(self) -> Iterator[Metric]:
        pending = GaugeMetricFamily(f"{NAMESPACE}_pending_requests",
                                    "Requests queued and not yet in a batch.", labels=["task"])
        in_flight = GaugeMetricFamily(f"{NAMESPACE}_inflight_batches",
                                      "Batches running on an engine instance.", labels=["task"])
        padding = GaugeMetricFamily(
            f"{NAMESPACE}_padding_ratio", "Padded / all token slots over the task's life "
            "(0 for tasks without ragged inputs).", labels=["task"])
        active = GaugeMetricFamily(f"{NAMESPACE}_active_sequences",
                                   "Open sequences of a stateful task.", labels=["task"])
        ready = GaugeMetricFamily(f"{NAMESPACE}_ready",
                                  "1 when every task is loaded and warmed up.")
        ready.add_metric([], 1.0 if getattr(self.runtime, "ready", False) else 0.0)
        step_queue = CounterMetricFamily(
            f"{NAMESPACE}_step_queue_seconds", "Time requests waited in an ensemble step's queue "
            "(per request, its slowest item's wait), summed; divide by "
            f"{NAMESPACE}_step_requests_total for the mean per request.", labels=["task", "step"])
        step_requests = CounterMetricFamily(
            f"{NAMESPACE}_step_requests", "Requests that ran through an ensemble step.",
            labels=["task", "step"])
        cost = GaugeMetricFamily(
            f"{NAMESPACE}_batch_cost_seconds", "The task's learnt compute time per batch "
            "(a + b n + c tokens, fitted online over its batches): term 'fixed' (a batch's "
            "intercept), 'item' (per item, tokens at their mean per item), 'token' (per "
            "padded token slot).", labels=["task", "term"])
        target = GaugeMetricFamily(f"{NAMESPACE}_latency_target_seconds",
                                   "The task's [tasks.batching] latency_target_ms (0: none).",
                                   labels=["task"])
        on_loop = GaugeMetricFamily(
            f"{NAMESPACE}_loop_execution", "1 while the task's batches run on the event loop "
            "(a model cheaper than handing a batch to a worker thread: [tasks.batching] "
            "loop_execution_us), 0 while its engine workers run them.", labels=["task"])
        for name, load in self.runtime.load().items():
            pending.add_metric([name], float(load["pending"]))
            c = load.get("cost")
            if c is not None:
                cost.add_metric([name, "fixed"], c["batch_fixed_us"] / 1e6)
                cost.add_metric([name, "item"], c["batch_item_us"] / 1e6)
                cost.add_metric([name, "token"], c["per_token_us"] / 1e6)
                target.add_metric([name], c["latency_target_ms"] / 1e3)
                if "loop_execution" in c:  # a dynamic batcher's
                    on_loop.add_metric([name], float(c["loop_execution"]))
            in_flight.add_metric([name], float(load["in_flight"]))
            padding.add_metric([name], float(load["padding_ratio"]))
            if "active_sequences" in load:  # a stateful task
                active.add_metric([name], float(load["active_sequences"]))
            for step, st in load.get("steps", {}).items():  # an ensemble (batching/pipeline.py)
                step_queue.add_metric([name, step], st["queue_us"] / 1e6)
                step_requests.add_metric([name, step], float(st["requests"]))
        yield from (ready, pending, in_flight, padding, active, step_queue, step_requests, cost,
                    on_loop, target)
        caches = self.runtime.cache_stats() if hasattr(self.runtime, "cache_stats") else {}
        if caches:
            yield from _cache_families(caches)

        yield from self._lifecycle()

    def _lifecycle(self) -> Iterator[Any]:
        """Version states and failed loads (``Runtime.lifecycle``, versions.py)."""
        describe = getattr(self.runtime, "lifecycle", None)
        if describe is None:
            return
        states = GaugeMetricFamily(f"{NAMESPACE}_model_versions",
                                   "Instances of a task version by state (loading, ready, "
                                   "draining, failed).", labels=["task", "version", "state"])
        failures = CounterMetricFamily(f"{NAMESPACE}_model_load_failures",
                                       "Failed loads of a task version (missing file, corrupt "
                                       "model, wrong contract); what served kept serving.",
                                       labels=["task", "version"])
        weight = GaugeMetricFamily(f"{NAMESPACE}_traffic_weight",
                                   "Share of a task's traffic a version receives (0..1).",
                                   labels=["task", "version"])
        for name, d in describe().items():
            counts: dict = {}
            for v in d["versions"]:
                counts[(v["version"], v["state"])] = counts.get((v["version"], v["state"]), 0) + 1
            for (version, state), n in sorted(counts.items()):
                states.add_metric([name, version, state], float(n))
            for version, n in sorted(d["load_failures"].items()):
                failures.add_metric([name, version], float(n))
            total = sum(d["traffic"].values()) or 1.0
            for version, w in sorted(d["traffic"].items()):
                weight.add_metric([name, version], w / total)
        yield from (states, failures, weight)

#: (metric name, stats key, help) of the response cache counters (lumen_core/cache.py)
_CACHE_COUNTERS = (
    ("cache_hits", "hits", "Requests answered from the task's response cache."),
    ("cache_misses", "misses", "Requests that computed (and then stored) their response."),
    ("cache_coalesced", "coalesced", "Requests that waited for an identical running "
     "computation instead of starting their own."),
    ("cache_evictions", "evictions", "Entries evicted to keep the cache within max_bytes."),
    ("cache_expired", "expired", "Entries dropped because they were older than ttl_s."),
)


def _cache_families(caches: dict) -> Iterator[Any]:
    for name, key, doc in _CACHE_COUNTERS:
        fam = CounterMetricFamily(f"{NAMESPACE}_{name}", doc, labels=["task"])
        for task, st in caches.items():
            fam.add_metric([task], float(st[key]))
        yield fam
    size = GaugeMetricFamily(f"{NAMESPACE}_cache_bytes", "Bytes held by the task's response "
                             "cache (arrays plus a per-entry estimate).", labels=["task"])
    entries = GaugeMetricFamily(f"{NAMESPACE}_cache_entries", "Responses held by the task's "
                                "response cache.", labels=["task"])
    for task, st in caches.items():
        size.add_metric([task], float(st["bytes"]))
        entries.add_metric([task], float(st["entries"]))
    yield size
    yield entries
