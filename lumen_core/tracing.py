"""OpenTelemetry tracing (the optional ``[otel]`` extra: ``opentelemetry-api``, ``-sdk``).

Off unless ``[server] tracing = true`` or ``LUMEN_TRACING=1``; then the dispatcher's
``trace`` (``Runtime.tracing``) holds a :class:`Tracing` and the rest of the package calls it
at four points, each behind one ``is not None`` check (nothing else is paid when tracing is
off, and OpenTelemetry is only imported here, lazily, so the package works without it):

* the transports (``serve/http.py``, ``serve/grpc.py``) open a SERVER span per call, the
  parent taken from the W3C ``traceparent`` header / metadata (``server_span``);
* ``Runtime.infer`` (both dispatch twins) and ``infer_many`` open a ``lumen.request`` span per
  admitted request, a child of the current (transport) span, when it enters the queue
  (``admitted``); it ends when the request is answered, with ``lumen.dispatched`` (queue wait
  over: its batch formed) and ``lumen.computed`` events at the entry's own timestamps;
* ``AdmissionQueue.deliver_batch`` (``scheduler.py``; on the loop, once per finished batch) makes a
  ``lumen.batch`` span from the batch's formation time and compute duration, LINKED to the
  request spans of the entries it ran (``batch``), those answered while it ran (expired,
  cancelled) included.  Worker threads do no OpenTelemetry work at all.  The request spans are
  the tracer's own (``Tracing.spans``, ``Tracing.awaiting``, keyed by entry): the entry carries
  none.

Export: the global tracer provider when one is set; else, when tracing is switched on by
config or environment, an SDK provider whose exporter follows the standard ``OTEL_*``
variables (``OTEL_TRACES_EXPORTER=otlp`` -- the default -- needs
``opentelemetry-exporter-otlp`` installed; ``console`` prints; ``none`` exports nothing).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping, Optional

log = logging.getLogger("lumen.tracing")

#: the environment switch (``1``/``true``/``yes``/``on``)
ENV = "LUMEN_TRACING"
#: instrumentation scope name
SCOPE = "lumen_core"
#: W3C limits a server may hold a client's trace context to (OpenTelemetry's propagator
#: checks the same ones, but logs a WARNING per request: a client could fill the log)
TRACEPARENT_MAX_CHARS = 512
TRACESTATE_MAX_CHARS = 512
#: an oversized trace context is logged at most once per this many seconds, with the count of
#: those not logged since (``Tracing.dropped_context`` counts them all)
OVERSIZE_LOG_EVERY_S = 60.0
#: request spans kept (ended) for the batch their request was answered before
#: (``Tracing.awaiting``): a batch finishes within seconds, so this bounds only a leak
AWAITING_MAX = 4096


def requested(config: Any = None) -> bool:
    """Whether tracing is asked for, by ``[server] tracing`` or ``LUMEN_TRACING``."""
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    server = getattr(config, "server", None)
    return bool(getattr(server, "tracing", False))


def available() -> bool:
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        return False
    return True


def from_config(config: Any = None) -> Optional["Tracing"]:
    """A :class:`Tracing` when tracing is requested (and OpenTelemetry installed), else None."""
    if not requested(config):
        return None
    if not available():
        log.warning("tracing requested but OpenTelemetry is not installed "
                    "(pip install 'lumen-core[otel]'); tracing stays off")
        return None
    _configure_sdk()
    return Tracing()


def _configure_sdk() -> None:
    """Install an SDK tracer provider from the ``OTEL_*`` variables unless one is set."""
    from opentelemetry import trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return  # the application configured its own
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning("opentelemetry-sdk is not installed: spans are made but not exported")
        return
    provider = TracerProvider(resource=Resource.create({"service.name": "lumen"}))
    kinds = [k.strip() for k in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    for kind in kinds:
        if kind == "otlp":
            exporter = _otlp_exporter()
            if exporter is not None:
                provider.add_span_processor(BatchSpanProcessor(exporter))
        elif kind == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif kind and kind != "none":
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported here (otlp, console, none)",
                        kind)
    trace.set_tracer_provider(provider)


def _otlp_exporter() -> Any:
    proto = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                           os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
    try:
        if proto == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("OTLP export needs opentelemetry-exporter-otlp (not installed); "
                    "spans are made but not exported")
        return None
    return OTLPSpanExporter()  # endpoint, headers, timeouts: the OTEL_EXPORTER_OTLP_* variables


def _first(value: Any) -> Optional[str]:
    """A header's value as a string: the first of a list (OTel's getter reads it so)."""
    if value is None or isinstance(value, str):
        return value
    return value[0] if value else None


def _wall_offset() -> int:
    """Add to a ``time.monotonic_ns()`` reading to get epoch ns (what OTel timestamps are)."""
    return time.time_ns() - time.monotonic_ns()


class Tracing:
    """The runtime's tracer: span making for the transports, the scheduler and the policy."""

    def __init__(self, tracer_provider: Any = None):
        from opentelemetry import context as otel_context
        from opentelemetry import trace
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = (tracer_provider.get_tracer(SCOPE) if tracer_provider is not None
                        else trace.get_tracer(SCOPE))
        self._context = otel_context
        self._Link = Link
        self._SERVER = SpanKind.SERVER
        self._Status = Status
        self._ERROR = StatusCode.ERROR
        self._propagator = TraceContextTextMapPropagator()
        #: task name -> model version (``Runtime`` fills it as it loads tasks)
        self.versions: dict = {}
        #: the tracer's own bookkeeping: entry -> its open request span, from admission until
        #: the entry's caller is answered (``finish`` ends it) ...
        self.spans: dict = {}
        #: ... or, for a request answered while its batch still ran (expired, cancelled), until
        #: that batch finishes and links it (``batch``); the oldest go past ``AWAITING_MAX``
        self.awaiting: dict = {}
        #: trace contexts ignored for their size (``extract``), and the log's rate limit
        self.dropped_context = 0
        self._unlogged = 0
        self._logged_at = -OVERSIZE_LOG_EVERY_S
        self._clock = time.monotonic

    # -- transports -------------------------------------------------------------------------
    def extract(self, carrier: Mapping) -> Any:
        """The OTel context of a W3C ``traceparent`` (and ``tracestate``) in ``carrier``.

        An oversized ``traceparent`` is ignored (the span starts a new trace) and an
        oversized ``tracestate`` dropped, here, before OpenTelemetry's propagator sees them:
        it would log a WARNING for every such request.  They are counted and logged at most
        once per ``OVERSIZE_LOG_EVERY_S`` with the number not logged since."""
        tp = _first(carrier.get("traceparent"))
        ts = carrier.get("tracestate")
        if tp is not None and len(tp) > TRACEPARENT_MAX_CHARS:
            self._oversize("traceparent", len(tp), TRACEPARENT_MAX_CHARS)
            return self._propagator.extract({})
        if ts is not None:
            n = len(ts) if isinstance(ts, str) else sum(len(x) + 1 for x in ts) - 1
            if n > TRACESTATE_MAX_CHARS:
                self._oversize("tracestate", n, TRACESTATE_MAX_CHARS)
                carrier = {"traceparent": tp} if tp is not None else {}
        return self._propagator.extract(carrier)

    def _oversize(self, header: str, size: int, limit: int) -> None:
        self.dropped_context += 1
        now = self._clock()
        if now - self._logged_at < OVERSIZE_LOG_EVERY_S:
            self._unlogged += 1
            return
        more = (f" ({self._unlogged} more since the last such line)" if self._unlogged
                else "")
        self._logged_at = now
        self._unlogged = 0
        log.warning("a request's %s header of %d characters is over the W3C limit of %d: "
                    "ignored, its span starts a new trace%s; logged at most once per %d s",
                    header, size, limit, more, OVERSIZE_LOG_EVERY_S)

    def server_span(self, name: str, carrier: Optional[Mapping], attributes: dict) -> Any:
        """A context manager: the transport's SERVER span, current while it is open."""
        ctx = self.extract(carrier) if carrier else None
        return self._tracer.start_as_current_span(name, context=ctx, kind=self._SERVER,
                                                  attributes=attributes)

    def rpc_span(self, service: str, method: str, carrier: Optional[Mapping]) -> Any:
        """The SERVER span of one gRPC call (or one message of a stream) of ``service``."""
        return self.server_span(f"{service}/{method}", carrier,
                                {"rpc.system": "grpc", "rpc.service": service,
                                 "rpc.method": method, "lumen.transport": "grpc"})

    def set_error(self, span: Any, code: str, message: str = "") -> None:
        span.set_attribute("lumen.error.code", code)
        span.set_status(self._Status(self._ERROR, message or code))

    # -- requests (loop thread) ---------------------------------------------------------------
    def admitted(self, task: Any, route: str, entry: Any) -> None:
        """``entry`` (a single request) entered ``task``'s queue: open its request span."""
        self._request_span(task.name, route, entry)
        entry.waiter.add_done_callback(lambda f: self.finish(entry, f.cancelled()))

    def admitted_group(self, task: Any, routes: list, entries: list, group: Any) -> None:
        """``infer_many``'s entries for one task: one request span each."""
        for route, e in zip(routes, entries, strict=True):
            self._request_span(task.name, route, e)

        def done(f: Any) -> None:
            for e in entries:
                self.finish(e, f.cancelled())

        group.future.add_done_callback(done)

    def _request_span(self, task: str, route: str, entry: Any) -> Any:
        span = self._tracer.start_span(
            "lumen.request", start_time=entry.arrival_ns + _wall_offset(),
            attributes={"lumen.task": task, "lumen.route": route,
                        "lumen.model_version": self.versions.get(task, "")})
        self.spans[entry] = span
        return span

    def finish(self, entry: Any, cancelled: bool = False) -> None:
        """``entry`` was answered (or cancelled): events for the end of its queue wait and of
        its batch's compute, the batch size, the outcome; end its request span."""
        span = self.spans.pop(entry, None)
        if span is None or not span.is_recording():
            return
        outcome = entry.outcome
        # few attributes: cleaning them is most of an SDK span's cost (compute time: the event)
        attrs = {"lumen.batch_size": entry.batch_size}
        if entry.dispatch_ns:
            # events, not child spans: an SDK span costs several events on the loop thread
            # (bench/HISTORY.md, "Tracing")
            t_disp = entry.dispatch_ns + _wall_offset()
            span.add_event("lumen.dispatched", timestamp=t_disp)  # queue wait over
            if entry.batch_size:
                span.add_event("lumen.computed", timestamp=t_disp + entry.compute_us * 1000)
            attrs["lumen.queue_us"] = (entry.dispatch_ns - entry.arrival_ns) // 1000
        span.set_attributes(attrs)
        code = getattr(outcome, "code", None) if isinstance(outcome, Exception) else None
        if code is not None:
            self.set_error(span, code, getattr(outcome, "message", ""))
        elif cancelled:
            self.set_error(span, "cancelled")
        span.end()
        if entry.dispatch_ns and not entry.batch_size:  # its batch runs on: it will link it
            awaiting = self.awaiting
            awaiting[entry] = span
            if len(awaiting) > AWAITING_MAX:
                del awaiting[next(iter(awaiting))]

    # -- batches (loop thread, AdmissionQueue.deliver_batch) -------------------------------------
    def batch(self, task: str, entries: Any, compute_us: int) -> None:
        """One finished batch: a span over its compute, linked to its requests' spans."""
        if not entries:
            return
        off = _wall_offset()
        start_mono = min(e.dispatch_ns for e in entries) or entries[0].arrival_ns
        start = start_mono + off
        spans = self.spans
        awaiting = self.awaiting
        links = []
        for e in entries:  # its requests' spans, those answered before it too
            span = spans.get(e)
            if span is None and awaiting:
                span = awaiting.pop(e, None)
            if span is not None:
                links.append(self._Link(span.get_span_context()))
        span = self._tracer.start_span(
            "lumen.batch", context=self._context.Context(), links=links, start_time=start,
            attributes={"lumen.task": task, "lumen.batch_size": len(entries),
                        "lumen.model_version": self.versions.get(task, ""),
                        "lumen.compute_us": compute_us})
        span.end(end_time=start + compute_us * 1000)
