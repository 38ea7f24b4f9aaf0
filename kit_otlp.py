"""kit_otlp: the tracing observer's span export: ended spans to an OTLP/HTTP collector (Langfuse).

Owns: ``SpanExport``, the tracer provider's one span processor: the span queue, the export thread,
the export requests (OTLP/HTTP protobuf, gzip: CONVENTIONS B4), the collector's answers, retries
with backoff, the counts of what was lost (``TracingStats``) and what is said about it; and the
export's settings (``QUEUE_SIZE`` .. ``REPORT_EVERY``).

Must never: import OpenTelemetry or ``requests`` at import (``SpanExport()`` does, at the
observer's ``start``); wait on the network in ``on_end`` (the export thread does); lose a span
uncounted; count a span exported that the collector did not take (a redirect, a
``partial_success`` rejecting it); take the application's settings for its own OpenTelemetry
(``OTEL_EXPORTER_OTLP_*``: its collector's headers, client certificate, CA, endpoint: the
requests are kit's own, not OpenTelemetry's exporter's); log a request's headers (they carry the
collector's credentials), or a line per failed export.

Theory of operation
-------------------
Ended spans go to ``SpanExport``: OpenTelemetry's ``BatchSpanProcessor`` policy (a queue of
``QUEUE_SIZE`` that drops its oldest when full, batches of ``BATCH_SIZE`` sent by a daemon thread
every ``EXPORT_DELAY_MS`` or when a batch is ready), which also counts what it loses: the SDK's
processor counts nothing and logs "Queue full" once per 20 s, and its flush ignores its timeout.

A batch is one request: its spans encoded as an ``ExportTraceServiceRequest`` (OpenTelemetry's
encoder), gzipped, POSTed with the headers the observer gives (and ``requests``' defaults:
``User-Agent``, ``Accept``, ...), never the application's OTLP headers. A 429, 502, 503,
504 or no connection is retried after 1, 2, 4, ... s (20% jitter; a ``Retry-After`` wins) while
``EXPORT_TIMEOUT`` allows; other answers are final. A 2xx is read (at most ``_ANSWER_MAX``) for
its ``partial_success`` (protobuf, or OTLP/JSON when the answer says JSON, as Langfuse's does):
the spans it says it rejected are counted ``failed`` and its
``error_message`` is logged (at most ``MESSAGE_MAX`` characters). A 3xx is a failure naming where
it points (OpenTelemetry's exporter took one for success).

What is said, on ``kit.observers``, as ``kit_observers`` says an observer's drops: when exports
start failing (and why), then at most once per ``REPORT_EVERY`` with the running count of failed
exports and spans lost, once when they recover; spans pushed out of the full queue, and spans a
collector rejected, likewise at once, then at most once per ``REPORT_EVERY``; and ``shutdown``
logs the total. A collector down for an hour is a few dozen lines, not one per export.
"""
from __future__ import annotations

import gzip
import json
import logging
import random
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from kit_core import ConfigError

__all__ = ("OTLP_PATH", "QUEUE_SIZE", "BATCH_SIZE", "EXPORT_DELAY_MS", "EXPORT_TIMEOUT",
           "FLUSH_TIMEOUT", "REPORT_EVERY", "MESSAGE_MAX", "TracingStats", "SpanExport")

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
#: How long ``shutdown`` waits for the queued spans to leave (seconds); what is still queued then
#: is counted dropped. Below ``kit_observers.CLOSE_TIMEOUT``, so the loss is told before a deck's
#: close gives up on the observer.
FLUSH_TIMEOUT = 5.0
#: While exports fail or spans are lost, at most one warning per this many seconds, with the
#: counts so far (``kit_observers.REPORT_EVERY``'s rule); ``shutdown`` tells the total.
REPORT_EVERY = 60.0
#: The most of a collector's ``partial_success.error_message`` logged (characters): it is the
#: collector's text, of any length.
MESSAGE_MAX = 300

_log = logging.getLogger("kit.observers")
#: The most of a collector's answer read (bytes): OTLP's is a few bytes, and only its status and
#: ``partial_success`` count.
_ANSWER_MAX = 65536
#: Answers worth another try (OTLP/HTTP's retryable statuses), and the most tries per request.
_RETRY_STATUSES = frozenset({429, 502, 503, 504})
_TRIES = 6


@dataclass(slots=True)
class TracingStats:
    """The tracing observer's spans (a snapshot from ``TracingObserver.stats``).

    ``spans`` were rendered and queued for export. Of those, the collector took ``exported``;
    ``failed`` were in requests it refused or never answered, retries included (a 4xx, a 5xx, a
    redirect, or no answer until ``EXPORT_TIMEOUT``, no connection), or ones its 2xx answer
    rejected (``partial_success``); ``dropped`` never left: pushed out of the full queue
    (``QUEUE_SIZE``), or still queued when ``close`` gave up. The rest are queued or in flight.
    """
    spans: int = 0
    exported: int = 0
    failed: int = 0
    dropped: int = 0

    def _lost(self) -> str:
        return (f"dropped from a full queue or at close: {self.dropped}; refused, rejected or "
                f"unanswered by the collector: {self.failed}")


class _Post:
    """One batch's request to the collector, retried; never logs (``SpanExport`` tells)."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        try:
            import requests
            from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                ExportTraceServiceResponse,
            )
        except ImportError as exc:
            raise ConfigError("the tracing observer needs the observability extra: "
                              f"pip install 'kit[observability]' ({exc})") from None
        self._url, self._encode, self._answer = url, encode_spans, ExportTraceServiceResponse
        self._headers = {**headers, "Content-Type": "application/x-protobuf",
                         "Content-Encoding": "gzip"}
        self._requests = requests
        self._session = requests.Session()
        self._stop = threading.Event()  # shutdown: no retry starts after it

    def export(self, spans: list[Any]) -> tuple[bool, int, str | None]:
        """Send ``spans``: whether the collector answered 2xx, how many it did not take, why.

        Returns ``(False, len(spans), why)`` once a failure is final (an answer not worth
        retrying, ``EXPORT_TIMEOUT`` spent, or ``shutdown``)."""
        body = gzip.compress(self._encode(spans).SerializeToString())
        deadline = time.monotonic() + EXPORT_TIMEOUT
        why = "no attempt"
        for attempt in range(_TRIES):
            left, wait = deadline - time.monotonic(), 2 ** attempt * random.uniform(0.8, 1.2)
            if left <= 0:
                break
            try:
                status, headers, answer = self._post(body, left)
            except self._requests.RequestException as exc:  # no connection, or no answer in time
                why, again = _no_answer(exc), isinstance(exc, self._requests.ConnectionError)
            else:
                if 200 <= status < 300:
                    return (True, *self._rejected(answer, headers, len(spans)))
                why, again = _refused(status, headers), status in _RETRY_STATUSES
                asked = _retry_after(headers.get("Retry-After"))
                wait = wait if asked is None else asked
            if not again or time.monotonic() + wait > deadline or self._stop.wait(wait):
                break
        return False, len(spans), why

    def shutdown(self) -> None:
        self._stop.set()
        self._session.close()

    def _post(self, body: bytes, timeout: float) -> tuple[int, Any, bytes]:
        """One request: its status, headers and at most ``_ANSWER_MAX`` of its answer (none of
        a longer one: ``requests`` would read one whole, however long)."""
        response = self._session.post(self._url, data=body, headers=self._headers,
                                      timeout=timeout, stream=True, allow_redirects=False)
        answer = response.raw.read(_ANSWER_MAX + 1, decode_content=False)
        if len(answer) > _ANSWER_MAX:
            response.close()  # (an answer read to its end frees its connection for reuse)
            answer = b""
        return response.status_code, response.headers, answer

    def _rejected(self, answer: bytes, headers: Any, sent: int) -> tuple[int, str | None]:
        """How many spans a 2xx answer's ``partial_success`` rejected, and its message; none
        of an answer that is not an ``ExportTraceServiceResponse`` (the 2xx took them). The
        answer is protobuf, or OTLP/JSON when it says so (Langfuse answers JSON whatever it
        was sent; JSON's int64 is a string)."""
        try:
            if "gzip" in headers.get("Content-Encoding", ""):
                answer = zlib.decompressobj(wbits=31).decompress(answer, _ANSWER_MAX)
            if "json" in headers.get("Content-Type", ""):
                obj = json.loads(answer)
                part = obj.get("partialSuccess", obj.get("partial_success")) or {}
                rejected = int(part.get("rejectedSpans", part.get("rejected_spans")) or 0)
                message = str(part.get("errorMessage", part.get("error_message")) or "")
            else:
                part = self._answer.FromString(answer).partial_success
                rejected, message = part.rejected_spans, part.error_message
        except Exception:  # garbage, a DecodeError, JSON of another shape: nothing against them
            return 0, None
        rejected = min(max(rejected, 0), sent)
        if not rejected:
            return 0, None
        return rejected, (f"the collector rejected {rejected} of {sent} spans: "
                          f"{message[:MESSAGE_MAX]!r}")


def _no_answer(exc: Exception) -> str:
    """Why a request got no answer, in a few words: its innermost reason (``[Errno 111]
    Connection refused``, ``Read timed out.``), not ``requests``' nest of wrappers."""
    reason = getattr(exc.args[0], "reason", None) if exc.args else None  # urllib3's MaxRetryError
    return f"no answer: {type(exc).__name__}, {str(reason or exc).rpartition(': ')[2][:200]}"


def _refused(status: int, headers: Any) -> str:
    """Why a non-2xx answer failed an export; a redirect names where it points, without query
    or credentials (the export follows none)."""
    if 300 <= status < 400:
        to = urlsplit(headers.get("Location", ""))
        return (f"the collector answered {status}, a redirect to {to.scheme}://"
                f"{to.netloc.rpartition('@')[2]}{to.path}: point KIT_TRACING_HOST there")
    return f"the collector answered {status}"


def _retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` in seconds (RFC 9110 10.2.3; its date form is taken as absent)."""
    try:
        seconds = float(value or "")
    except ValueError:
        return None
    return seconds if 0 <= seconds < 3600 else None


class SpanExport:
    """The provider's one span processor (OpenTelemetry's ``SpanProcessor`` interface, duck-typed:
    the SDK is imported at ``start`` only): a bounded queue, drained in batches by a daemon
    thread of its own, that counts what it loses. Every call but ``shutdown`` returns at once.

    ``url`` is the collector's traces endpoint and ``headers`` all the headers its requests
    carry besides the body's own. Raises ``ConfigError`` when the ``observability`` extra is
    not installed.
    """

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self._post = _Post(url, headers)
        self.stats = TracingStats()
        self._queue: deque[Any] = deque()
        self._cond = threading.Condition()  # the queue, the counts, the batch in flight
        self._sending = 0
        self._flushing = False  # send every span queued, not only whole batches
        self._closed = False
        self._failing = 0  # exports failed in a row (0: they go through)
        self._down_told = False  # this outage was told (so its end will be; export thread only)
        self._told: dict[str, float] = {}  # what was last logged when: "down", "queue", "rejected"
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
            self._tell("queue", "spans are being lost")

    def force_flush(self, timeout_millis: int = 0) -> bool:
        """Send what is queued now; wait at most ``timeout_millis`` (none by default: the agents
        SDK calls this on the engine loop, which must never wait on the collector)."""
        self._flushing = True
        self._wake.set()
        with self._cond:
            return self._cond.wait_for(self._idle, timeout_millis / 1000)

    def shutdown(self) -> None:
        """Send what is queued, for at most ``FLUSH_TIMEOUT``; count what is left dropped, stop
        the requests (an export still in flight gives up its retries), log what was lost."""
        self._flushing = True
        self._wake.set()
        with self._cond:
            if self._closed:
                return
            self._cond.wait_for(self._idle, FLUSH_TIMEOUT)
            self._closed = True
            self.stats.dropped += len(self._queue)
            self._queue.clear()
            stats, sending, failing = replace(self.stats), self._sending, self._failing
        self._wake.set()
        try:
            self._post.shutdown()
        finally:
            if stats.spans > stats.exported:
                _log.warning("tracing: %d of %d spans were not exported (%s; in flight at "
                             "close: %d)%s", stats.spans - stats.exported, stats.spans,
                             stats._lost(), sending,
                             f"; exports were failing: {failing} in a row" if failing else "")

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
        asks for everything); count how it went, and tell it."""
        with self._cond:
            if not self._queue:
                self._flushing = False
            if self._closed or not self._queue or (
                    whole and not self._flushing and len(self._queue) < BATCH_SIZE):
                return False
            batch = [self._queue.popleft() for _ in range(min(BATCH_SIZE, len(self._queue)))]
            self._sending = len(batch)
        try:
            answered, lost, why = self._post.export(batch)
        except Exception as exc:  # a span the encoder will not take, or a bug: the batch is lost
            answered, lost, why = False, len(batch), f"the export failed ({type(exc).__name__})"
        with self._cond:
            self._sending = 0
            self.stats.exported += len(batch) - lost
            self.stats.failed += lost
            failing, self._failing = self._failing, 0 if answered else self._failing + 1
            self._cond.notify_all()
        if not answered:  # an outage told when it begins, unless one was told this minute
            # (a collector that flaps): then with the running count, once per REPORT_EVERY
            self._down_told |= self._tell("down", f"exports to the collector are failing "
                                                  f"({why}): {failing + 1} failed in a row")
        elif failing and self._down_told:
            self._down_told = False
            self._tell("up", f"exports to the collector recovered after {failing} failed in a "
                             "row", first=True)
        if answered and lost:
            self._tell("rejected", why or "")
        return True

    def _tell(self, what: str, said: str, *, first: bool = False) -> bool:
        """Log ``said`` with the counts so far: at once when ``first`` or the first time of its
        kind, then at most once per ``REPORT_EVERY``. Whether it did."""
        now = time.monotonic()
        with self._cond:
            told = self._told.get(what)
            if self._closed or not (first or told is None or now - told >= REPORT_EVERY):
                return False
            self._told[what], stats = now, replace(self.stats)
        _log.warning("tracing: %s; spans lost so far: %d of %d (%s); TracingObserver.stats "
                     "counts them", said, stats.dropped + stats.failed, stats.spans,
                     stats._lost())
        return True
