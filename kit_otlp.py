"""kit_otlp: the tracing observer's span export: ended spans to an OTLP/HTTP collector (Langfuse).

Owns: ``SpanExport``, the tracer provider's one span processor: the span queue, the export thread,
the exporter (OpenTelemetry's OTLP/HTTP protobuf exporter, gzip: CONVENTIONS B4) and the session
it posts with, the counts of what was lost (``TracingStats``) and what is said about it; and the
export's settings (``OTLP_PATH`` .. ``REPORT_EVERY``).

Must never: import OpenTelemetry or ``requests`` at import (``SpanExport()`` does, at the
observer's ``start``); wait on the network in ``on_end`` (the export thread does); lose a span
uncounted; take the application's settings for its own OpenTelemetry (``OTEL_EXPORTER_OTLP_*``:
its collector's headers, client certificate, CA); log a request's headers (they carry the
collector's credentials).

Theory of operation
-------------------
Ended spans go to ``SpanExport``: OpenTelemetry's ``BatchSpanProcessor`` policy (a queue of
``QUEUE_SIZE`` that drops its oldest when full, batches of ``BATCH_SIZE`` sent by a daemon thread
every ``EXPORT_DELAY_MS`` or when a batch is ready), which also counts what it loses: the SDK's
processor counts nothing and logs "Queue full" once per 20 s, and its flush ignores its timeout.
``TracingStats`` counts spans exported, refused or unanswered (``failed``), and ``dropped``
(pushed out, or still queued when ``shutdown`` gives up after ``FLUSH_TIMEOUT``); the first loss
is logged when it happens, then at most once per ``REPORT_EVERY``, and ``shutdown`` logs the
total.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from kit_core import ConfigError

__all__ = ("OTLP_PATH", "QUEUE_SIZE", "BATCH_SIZE", "EXPORT_DELAY_MS", "EXPORT_TIMEOUT",
           "FLUSH_TIMEOUT", "REPORT_EVERY", "TracingStats", "SpanExport")

#: Langfuse's OTLP/HTTP traces endpoint, below the host.
OTLP_PATH = "/api/public/otel/v1/traces"
#: Spans waiting for export, and per request: OpenTelemetry's defaults (CONVENTIONS A9). A full
#: queue drops its oldest span (the SDK's policy, counted) rather than ever blocking ``on_end``.
QUEUE_SIZE = 2048
BATCH_SIZE = 512
#: Spans wait at most this long before their batch is sent (ms, the SDK's default).
EXPORT_DELAY_MS = 5000
#: One export request, retries included (seconds).
EXPORT_TIMEOUT = 10.0
#: How long ``close`` waits for the queued spans to leave (seconds); what is still queued then is
#: counted dropped. Below ``kit_observers.CLOSE_TIMEOUT``, so the loss is told before a deck's
#: close gives up on the observer.
FLUSH_TIMEOUT = 5.0
#: While spans are being lost, at most one warning per this many seconds (``close`` tells the
#: total).
REPORT_EVERY = 60.0

_log = logging.getLogger("kit.observers")
#: The most of a collector's answer read (bytes): OTLP's is a few bytes, and only its status counts.
_ANSWER_MAX = 65536


def _http_session(requests: Any, headers: dict[str, str]) -> Any:
    """The exporter's ``requests`` session, mending what OpenTelemetry's exporter does with it:
    it sends ``headers`` and the body's own only (the exporter adds the application's
    ``OTEL_EXPORTER_OTLP[_TRACES]_HEADERS``, its own collector's credentials); it reads at most
    ``_ANSWER_MAX`` of an answer (``requests`` would read one whole, however long); a redirect is
    an error naming where it points, without query or credentials (the exporter follows none and
    takes a 3xx for success: spans no collector took, counted exported)."""
    keep = {*map(str.lower, headers), "content-type", "content-encoding", "content-length",
            "user-agent", "accept", "accept-encoding", "connection"}

    class Session(requests.Session):  # type: ignore[misc, name-defined]
        def send(self, request: Any, **kwargs: Any) -> Any:
            for name in [n for n in request.headers if n.lower() not in keep]:
                del request.headers[name]
            response = super().send(request, **{**kwargs, "stream": True})
            if len(response.raw.read(_ANSWER_MAX + 1, decode_content=False)) > _ANSWER_MAX:
                response.close()  # (an answer read to its end frees its connection for reuse)
            if 300 <= response.status_code < 400:
                to = urlsplit(response.headers.get("Location", ""))
                raise requests.HTTPError(
                    f"the collector answered {response.status_code}, a redirect to {to.scheme}://"
                    f"{to.netloc.rpartition('@')[2]}{to.path}: point KIT_TRACING_HOST there")
            return response
    return Session()


def _exporter(url: str, headers: dict[str, str]) -> tuple[Any, Any]:
    """OpenTelemetry's OTLP/HTTP exporter to ``url`` with ``headers`` (through
    ``_http_session``), and its success value. Raises ``ConfigError`` without the extra."""
    try:
        import requests
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import SpanExportResult
    except ImportError as exc:
        raise ConfigError("the tracing observer needs the observability extra: "
                          f"pip install 'kit[observability]' ({exc})") from None
    session = _http_session(requests, headers)
    exporter = OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT, compression=Compression.Gzip,
                                session=session, headers=headers)
    # It set the application's OTEL_EXPORTER_OTLP_CERTIFICATE and _CLIENT_* (its collector's).
    session.verify, session.cert = True, None
    return exporter, SpanExportResult.SUCCESS


@dataclass(slots=True)
class TracingStats:
    """The tracing observer's spans (a snapshot from ``TracingObserver.stats``).

    ``spans`` were rendered and queued for export. Of those, the collector took ``exported``;
    ``failed`` were in requests it refused or never answered, retries included (a 4xx, a 5xx, a
    redirect, or no answer until ``EXPORT_TIMEOUT``, no connection); ``dropped`` never left:
    pushed out of the full queue (``QUEUE_SIZE``), or still queued when ``close`` gave up. The
    rest are queued or in flight.
    """
    spans: int = 0
    exported: int = 0
    failed: int = 0
    dropped: int = 0

    def _lost(self) -> str:
        return (f"dropped from a full queue or at close: {self.dropped}; refused or unanswered "
                f"by the collector: {self.failed}")


class SpanExport:
    """The provider's one span processor (OpenTelemetry's ``SpanProcessor`` interface, duck-typed:
    the SDK is imported at ``start`` only): a bounded queue, drained in batches by a daemon
    thread of its own, that counts what it loses. Every call but ``shutdown`` returns at once."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self._exporter, self._success = _exporter(url, headers)
        self.stats = TracingStats()
        self._queue: deque[Any] = deque()
        self._cond = threading.Condition()  # the queue, the counts, the batch in flight
        self._sending = 0
        self._flushing = False  # send every span queued, not only whole batches
        self._closed = False
        self._told: float | None = None  # when a loss was last logged
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kit tracing export", daemon=True)
        self._thread.start()

    def snapshot(self) -> TracingStats:
        """A copy of the counts now."""
        with self._cond:
            return replace(self.stats)

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        with self._cond:
            self.stats.spans += 1
            if self._closed:
                self.stats.dropped += 1
                return
            lost = len(self._queue) >= QUEUE_SIZE
            if lost:
                self._queue.popleft()
                self.stats.dropped += 1
            self._queue.append(span)
            if len(self._queue) >= BATCH_SIZE:
                self._wake.set()
        if lost:
            self._tell()

    def force_flush(self, timeout_millis: int = 0) -> bool:
        """Send what is queued now; wait at most ``timeout_millis`` (none by default: the agents
        SDK calls this on the engine loop, which must never wait on the collector)."""
        self._flushing = True
        self._wake.set()
        with self._cond:
            return self._cond.wait_for(self._idle, timeout_millis / 1000)

    def shutdown(self) -> None:
        """Send what is queued, for at most ``FLUSH_TIMEOUT``; count what is left dropped, stop
        the exporter (an export still in flight gives up its retries), log what was lost."""
        self._flushing = True
        self._wake.set()
        with self._cond:
            if self._closed:
                return
            self._cond.wait_for(self._idle, FLUSH_TIMEOUT)
            self._closed = True
            self.stats.dropped += len(self._queue)
            self._queue.clear()
            stats, sending = replace(self.stats), self._sending
        self._wake.set()
        try:
            self._exporter.shutdown()
        finally:
            if stats.spans > stats.exported:
                _log.warning("tracing: %d of %d spans were not exported (%s; in flight at "
                             "close: %d)", stats.spans - stats.exported, stats.spans,
                             stats._lost(), sending)

    def _idle(self) -> bool:
        return not self._queue and not self._sending

    def _run(self) -> None:
        while not self._closed:  # woken by a whole batch queued, a flush, or the delay's end
            delay_ended = not self._wake.wait(EXPORT_DELAY_MS / 1000)
            self._wake.clear()
            while self._send(whole=not delay_ended):
                pass

    def _send(self, whole: bool) -> bool:
        """Export one batch, if any is queued (only a whole one when ``whole``, unless a flush
        asks for everything); count how it went."""
        with self._cond:
            if not self._queue:
                self._flushing = False
            if self._closed or not self._queue or (
                    whole and not self._flushing and len(self._queue) < BATCH_SIZE):
                return False
            batch = [self._queue.popleft() for _ in range(min(BATCH_SIZE, len(self._queue)))]
            self._sending = len(batch)
        try:
            ok = self._exporter.export(batch) == self._success
        except Exception:  # the exporter logged it, or it is a bug of its: the batch is lost
            ok = False
        with self._cond:
            self._sending = 0
            if ok:
                self.stats.exported += len(batch)
            else:
                self.stats.failed += len(batch)
            self._cond.notify_all()
        if not ok:
            self._tell()
        return True

    def _tell(self) -> None:
        """Log the loss: at once the first time, then at most once per ``REPORT_EVERY``."""
        now = time.monotonic()
        with self._cond:
            if self._closed or (self._told is not None and now - self._told < REPORT_EVERY):
                return
            self._told, stats = now, replace(self.stats)
        _log.warning("tracing: spans are being lost: %d of %d so far (%s); "
                     "TracingObserver.stats counts them", stats.dropped + stats.failed,
                     stats.spans, stats._lost())
