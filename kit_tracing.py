"""kit_tracing: the tracing observer: each run, rendered from its events, as one OTLP trace.

Owns: ``TracingObserver`` (an ``EventSinkPort``): kit events (semantic layer) and the agents SDK's
own traces (raw layer, ``sdk_spans=True``) as OpenTelemetry spans named and attributed after the
GenAI semantic conventions and Langfuse's OTLP attributes (CONVENTIONS B4), handed to
``kit_otlp.SpanExport``, which exports them to ``{host}/api/public/otel/v1/traces``; the settings
(keys, host) and the headers the export sends.

Must never: import OpenTelemetry at import or construction (``start`` does: it is the
``observability`` extra); wait on the network in ``emit`` (spans leave through
``kit_otlp.SpanExport``, a bounded queue drained by a thread of its own); lose a span uncounted
(``stats``, and a warning on ``kit.observers``); write the application context or any content
(it renders event fields only: names, ids, counts, times, statuses; inputs, replies, tool
arguments and results stay out, as GenAI's opt-in content attributes do); touch OpenTelemetry's
global tracer provider (it owns a private one); take the application's settings for its own
OpenTelemetry: sample runs away (``OTEL_TRACES_SAMPLER``), or send Langfuse its headers, client
certificate or CA (``kit_otlp`` sends kit's requests, not OpenTelemetry's exporter).

Theory of operation
-------------------
Semantic layer (always on). ``emit`` gets each run's events in order (from ``ObserverHub``, in a
worker thread) and keeps a ``_Segment`` per open run. ``run.started`` opens the root span,
``invoke_agent <name>`` or ``invoke_workflow <name>`` (``kit.run_id``, ``session.id``: under a
namespace ``<namespace>/<session_id>``, one Langfuse session per tenant; the invocable's name; a
child run's own trace has ``kit.parent_run_id`` and its parent's session, and the parent's
``execute_tool`` span that played it names it, ``kit.child_run_id`` and ``kit.child_trace_id``,
and links to its root); each step becomes its child:

- ``model.completed`` -> ``chat <model>`` (CLIENT; ``gen_ai.request.model``, the model asked
  for; ``gen_ai.response.model``, the one the response says answered, else the one asked for;
  ``gen_ai.usage.*``, Langfuse ``usage_details``/``cost_details``; input read from the prompt
  cache as ``gen_ai.usage.cache_read.input_tokens`` and ``input_cached_tokens``, Langfuse's
  ``input`` then the rest, as its OpenAI integration counts them). The log records a model
  call's end only, so its span starts where the previous step ended (run start, last model
  call, tool or node).
- ``tool.started`` .. ``tool.completed`` -> ``execute_tool <tool>`` (ERROR when the tool erred).
  A step logged inside an open tool (its origin below the tool's: an SDK agent played as a tool
  logs its model's calls as ``<agent>/<tool>``) is that tool span's child, starting in it.
- ``node.updated`` -> ``node <node>``, starting where the previous step ended, as model calls.
- a terminal event ends the root with ``kit.status``: ERROR and ``error.type`` on ``run.failed``.

A run's trace id is derived from its run id (``TracingObserver.trace_id``), so a run stays one
trace when it parks and resumes, in this process or another. Parking (``run.interrupted``,
``run.sleeping``, ``run.paused``) ends the current *segment*: the root ends at the parking event
with ``kit.status`` (``WAITING_HUMAN``, ...) and ``kit.parked`` (the kind), since a run may stay
parked for days and an unended span is never exported. ``run.resumed`` opens a new root segment
in the same trace (``kit.resumed_by``); a parked run cancelled ends in a segment of its end
alone, with no ``kit.resumed_by``. A segment opened by a process that did not see the run park
(a replica, or after a restart) has what the deck tells ``run_info`` first: the run's index row
(name, kind, session, namespace, parent; its parent's session for a child). Told nothing (a
store that could not say), it reads the run's name off the event's origin, and its kind off the
event or the first step that tells it (a node update: a workflow's); until then its root has
the run's bare name and claims no kind. Open runs are capped (``MAX_OPEN_RUNS``).

Raw layer (``sdk_spans=True``): ``sdk_processor()`` is an ``agents.tracing.TracingProcessor``.
Each SDK trace becomes a second, separate OTLP trace (the SDK's trace id), its spans nested as
the SDK nests them, tagged ``kit.layer=sdk`` and ``kit.run_id`` from the trace metadata.

Export (``kit_otlp``): ended spans go to the provider's one span processor, ``SpanExport``, a
bounded queue sent in batches by a thread of its own, which counts the spans exported, failed and
dropped (``stats``) and says when exports start failing, at most once a minute while they do,
and when they recover; the total lost at close. Its settings (``QUEUE_SIZE``, ``FLUSH_TIMEOUT``,
...) are ``kit_otlp``'s, and are set there; this module re-exports them to read.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import threading
import time
import types
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any

from agents.tracing import TracingProcessor

from kit_core import (
    ConfigError, ControlRequested, Event, ModelCompleted, NodeUpdated, RunCancelled, RunCompleted,
    RunFailed, RunInterrupted, RunResumed, RunStarted, SkillLoaded, ToolCompleted, ToolStarted,
)

from kit_otlp import (  # re-exported to read; set in kit_otlp
    BATCH_SIZE, EXPORT_DELAY_MS, EXPORT_TIMEOUT, FLUSH_TIMEOUT, OTLP_PATH, QUEUE_SIZE,
    REPORT_EVERY, SpanExport, TracingStats,
)

__all__ = ("DEFAULT_HOST", "OTLP_PATH", "QUEUE_SIZE", "BATCH_SIZE", "EXPORT_DELAY_MS",
           "EXPORT_TIMEOUT", "FLUSH_TIMEOUT", "REPORT_EVERY", "MAX_OPEN_RUNS", "TracingObserver")

#: Langfuse cloud (EU); ``KIT_TRACING_HOST`` or ``host=`` selects another (CONVENTIONS B4).
DEFAULT_HOST = "https://cloud.langfuse.com"
#: Runs (and SDK traces) whose end has not arrived. Past it the oldest is ended where it stands
#: (``kit.unfinished``): an observer that misses runs' ends (dropped events) must not grow forever.
MAX_OPEN_RUNS = 10_000

_SDK_TRACE = re.compile(r"^trace_([0-9a-f]{32})\Z")
_CONTENT = frozenset({"input", "output", "type"})  # SDK span fields never exported as attributes
#: The model settings a generation span's ``model_config`` may export: the SDK fills it with all
#: of ``ModelSettings`` and the client's ``base_url``, where a gateway's key rides in
#: ``extra_headers``, content in ``extra_body`` or ``metadata``, credentials in the URL.
_MODEL_SETTINGS = frozenset({"temperature", "top_p", "frequency_penalty", "presence_penalty",
                             "tool_choice", "parallel_tool_calls", "truncation", "max_tokens",
                             "reasoning", "verbosity", "store", "top_logprobs"})
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _ns(at: datetime | str | None) -> int:
    """Nanoseconds since the epoch of an event's ``at`` (or an SDK ISO time); now for None."""
    if at is None:
        return time.time_ns()
    at = datetime.fromisoformat(at) if isinstance(at, str) else at
    delta = (at if at.tzinfo else at.replace(tzinfo=timezone.utc)) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000


def _hash_id(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "big") or 1


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


class _TraceIds:
    """The provider's id generator: random span ids; a root's trace id chosen by the caller
    (``next``, set under the observer's lock just before the root span starts)."""

    def __init__(self) -> None:
        self.next = 0

    def generate_span_id(self) -> int:
        return random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        trace_id, self.next = self.next, 0
        return trace_id or random.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:  # the W3C "random" flag: derived ids are not
        return False


class _Segment:
    """The open part of a run's trace: its root, open tool spans (with each one's origin and
    start), where the last step ended."""
    __slots__ = ("root", "ctx", "mark", "tools", "meta")

    def __init__(self, root: Any, ctx: Any, mark: int, meta: dict[str, Any]) -> None:
        self.root, self.ctx, self.mark, self.meta = root, ctx, mark, meta
        self.tools: dict[str, tuple[Any, str, int]] = {}

    def within(self, origin: str, *, same: bool) -> tuple[Any, int] | None:
        """The open tool span ``origin`` was logged inside (the latest opened), and its start."""
        for span, where, start in reversed(self.tools.values()):
            if (same and origin == where) or origin.startswith(where + "/"):
                return span, start
        return None


class TracingObserver:
    """Renders each run as one OpenTelemetry trace and exports it to Langfuse over OTLP/HTTP.

    ``public_key``, ``secret_key`` and ``host`` default to ``KIT_TRACING_PUBLIC_KEY``,
    ``KIT_TRACING_SECRET_KEY`` and ``KIT_TRACING_HOST`` (else ``DEFAULT_HOST``), read at
    ``start()``; requests carry ``Authorization: Basic base64(public:secret)``. With
    ``sdk_spans=True`` the deck also routes the agents SDK's own traces to ``sdk_processor()``.
    Constructing it reads nothing and imports nothing.
    """

    def __init__(self, *, sdk_spans: bool = False, public_key: str | None = None,
                 secret_key: str | None = None, host: str | None = None) -> None:
        self.sdk_spans = sdk_spans
        self._public_key, self._secret_key, self._host = public_key, secret_key, host
        self._lock = threading.Lock()  # emit (a hub thread) and the SDK processor (engine loop)
        self._ids = _TraceIds()
        self._provider: Any = None
        self._tracer: Any = None
        self._export: SpanExport | None = None
        self._o: Any = None  # the OpenTelemetry names used, bound at start()
        self._runs: OrderedDict[str, _Segment] = OrderedDict()
        self._parked: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._told: OrderedDict[str, Any] = OrderedDict()  # run id -> RunInfo (run_info)
        self._processor: _SdkProcessor | None = None

    def __repr__(self) -> str:
        return f"TracingObserver(sdk_spans={self.sdk_spans})"

    @property
    def stats(self) -> TracingStats:
        """A snapshot of the spans rendered, exported and lost (all zero before ``start``)."""
        if self._export is None:
            return TracingStats()
        return self._export.snapshot()

    @staticmethod
    def trace_id(run_id: str) -> str:
        """The 32-hex OTLP (and Langfuse) trace id of a run's semantic trace."""
        return f"{_hash_id('kit.run:' + run_id):032x}"

    # ------------------------------------------------------------------------- lifecycle --
    def start(self) -> None:
        """Read the settings, import OpenTelemetry, build the exporter; contacts nobody.

        Raises ``ConfigError`` when a key is missing, the host is not an http(s) URL, or the
        ``observability`` extra is not installed. Idempotent.
        """
        if self._provider is not None:
            return
        pk = self._public_key or os.environ.get("KIT_TRACING_PUBLIC_KEY")
        sk = self._secret_key or os.environ.get("KIT_TRACING_SECRET_KEY")
        host = (self._host or os.environ.get("KIT_TRACING_HOST") or DEFAULT_HOST).rstrip("/")
        missing = [n for n, v in (("KIT_TRACING_PUBLIC_KEY", pk), ("KIT_TRACING_SECRET_KEY", sk)) if not v]
        if missing:
            raise ConfigError(f"the tracing observer needs {' and '.join(missing)} "
                              "(or TracingObserver(public_key=..., secret_key=...))")
        if not host.startswith(("http://", "https://")):
            raise ConfigError(f"KIT_TRACING_HOST must be an http(s) URL, got {host!r}")
        try:
            from opentelemetry import context, trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON
        except ImportError as exc:
            raise ConfigError("the tracing observer needs the observability extra: "
                              f"pip install 'kit[observability]' ({exc})") from None
        auth = base64.b64encode(f"{pk}:{sk}".encode()).decode()
        headers = {"Authorization": f"Basic {auth}", "x-langfuse-ingestion-version": "4",
                   "x-langfuse-public-key": pk, "x-langfuse-sdk-name": "kit"}
        export = SpanExport(host + OTLP_PATH, headers)  # ConfigError without the extra
        provider = TracerProvider(resource=Resource.create({"service.name": "kit"}),
                                  sampler=ALWAYS_ON,  # every run, whatever OTEL_TRACES_SAMPLER says
                                  id_generator=self._ids, shutdown_on_exit=False)  # type: ignore[arg-type]
        self._export = export
        provider.add_span_processor(self._export)  # type: ignore[arg-type]
        self._o = types.SimpleNamespace(
            empty=context.Context(), in_context=trace.set_span_in_context,
            CLIENT=trace.SpanKind.CLIENT, INTERNAL=trace.SpanKind.INTERNAL,
            error=lambda text: trace.Status(trace.StatusCode.ERROR, text[:1000]))
        self._provider, self._tracer = provider, provider.get_tracer("kit")

    def close(self) -> None:
        """End what is still open (``kit.unfinished``), flush, shut the exporter down, and log
        how many spans were lost, if any (``stats``).

        Bounded by ``FLUSH_TIMEOUT``; idempotent; later events are ignored.
        """
        with self._lock:
            provider, self._provider, self._tracer = self._provider, None, None
            if provider is None:
                return
            now = time.time_ns()
            while self._runs:
                self._end(self._runs.popitem(last=False)[1], now, unfinished=True)
            if self._processor is not None:
                self._processor.end_all(now)
        provider.shutdown()  # SpanExport.shutdown: the flush, bounded

    def sdk_processor(self) -> TracingProcessor:
        """The raw layer: an ``agents.tracing.TracingProcessor`` writing each SDK trace as its own
        OTLP trace through this observer's exporter (it records nothing until ``start()``)."""
        if self._processor is None:
            self._processor = _SdkProcessor(self)
        return self._processor

    # ---------------------------------------------------------------------- semantic layer --
    def run_info(self, info: Any) -> None:
        """Take a run's index row (``RunInfo``), which the deck gives before the first event of
        a run this observer sees past its start (kit_observers), and a child's parent's before
        it: the segment that event opens names the run's session and parent, which the log's
        resume and cancel events do not carry. In-memory work only."""
        with self._lock:
            self._told[info.run_id] = info
            self._told.move_to_end(info.run_id)
            while len(self._told) > MAX_OPEN_RUNS:
                self._told.popitem(last=False)

    def emit(self, event: Event) -> None:
        """Render one event into its run's trace: in-memory work, the export happens elsewhere.

        Events before ``start()`` or after ``close()`` are ignored.
        """
        with self._lock:
            if self._tracer is not None:
                self._render(event)

    def _render(self, ev: Event) -> None:
        p, at, o = ev.payload, _ns(ev.at), self._o
        seg = self._runs.get(ev.run_id)
        if seg is None:
            if isinstance(p, ControlRequested):  # a parked run's resume (or cancel) requested:
                return  # the run.resumed next opens the segment, saying by whom
            seg = self._open(ev, at)
            if isinstance(p, (RunStarted, RunResumed)):
                return
        self._runs.move_to_end(ev.run_id)
        if seg.meta["invocable"] is None and _invocable(p) is not None:
            self._kind(seg, _invocable(p))
        if isinstance(p, ModelCompleted):
            cached = p.cached_input_tokens  # Langfuse's OpenAI keys: "input" is the rest
            usage = {"input": p.input_tokens - cached, "output": p.output_tokens,
                     "total": p.input_tokens + p.output_tokens}
            if cached:
                usage["input_cached_tokens"] = cached
            attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": p.model,
                     "gen_ai.response.model": p.response_model or p.model,
                     "gen_ai.usage.input_tokens": p.input_tokens,
                     "gen_ai.usage.output_tokens": p.output_tokens,
                     "langfuse.observation.type": "generation",
                     "langfuse.observation.model.name": p.model,
                     "langfuse.observation.usage_details": _json(usage)}
            if cached:
                attrs["gen_ai.usage.cache_read.input_tokens"] = cached
            if p.usd is not None:
                attrs["langfuse.observation.cost_details"] = _json({"total": p.usd})
            self._step(seg, f"chat {p.model}", o.CLIENT, at, attrs, ev.origin)
        elif isinstance(p, (ToolStarted, ToolCompleted)):
            self._tool(seg, ev, at)
        elif isinstance(p, NodeUpdated):
            self._step(seg, f"node {p.node}", o.INTERNAL, at,
                       {"kit.node": p.node, "langfuse.observation.type": "span"}, ev.origin)
        elif p.ends:
            self._run_ended(seg, ev, at)
        elif isinstance(p, SkillLoaded):
            seg.root.add_event("skill.loaded", {"kit.skill": p.name, "kit.sha256": p.sha256},
                               timestamp=at)
        # text.delta, message.completed, control.requested and unknown kinds: no span.

    def _tool(self, seg: _Segment, ev: Event, at: int) -> None:
        """A tool call's span: ``tool.started`` opens it, ``tool.completed`` ends it (a lone
        ``tool.completed`` makes one of zero length)."""
        p, o = ev.payload, self._o
        span = seg.tools.pop(p.call_id, (None,))[0]
        if span is None:
            outer = seg.within(ev.origin, same=False)  # an agent tool's own tool call
            span = self._tracer.start_span(
                f"execute_tool {p.tool}", kind=o.INTERNAL, start_time=at,
                context=o.in_context(outer[0]) if outer else seg.ctx,
                attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": p.tool,
                            "gen_ai.tool.call.id": p.call_id, "gen_ai.tool.type": "function",
                            "langfuse.observation.type": "tool", "kit.origin": ev.origin})
        if isinstance(p, ToolStarted):
            seg.tools[p.call_id] = (span, ev.origin, at)
            return
        if p.is_error:
            span.set_attribute("error.type", "ToolError")
            span.set_status(o.error("the tool reported an error"))
        span.end(end_time=at)
        seg.mark = max(seg.mark, at)

    def _run_ended(self, seg: _Segment, ev: Event, at: int) -> None:
        """A run's segment ends (the run ended or parked): its root span gets how, and closes;
        a parked run's metadata is kept for the segment its resume opens."""
        p, root = ev.payload, self._runs.pop(ev.run_id).root
        if p.ends == "parking":
            self._parked[ev.run_id] = seg.meta
            while len(self._parked) > MAX_OPEN_RUNS:
                self._parked.popitem(last=False)
            root.set_attribute("kit.parked", ev.kind)
            if isinstance(p, RunInterrupted):
                root.set_attribute("kit.interrupt_id", p.interrupt_id)
        elif isinstance(p, RunCompleted):
            root.set_attributes({"kit.usage.input_tokens": p.usage.input_tokens,
                                 "kit.usage.output_tokens": p.usage.output_tokens})
            if p.usage.usd is not None:
                root.set_attribute("kit.usage.usd", p.usage.usd)
        elif isinstance(p, RunFailed):
            root.set_attribute("error.type", p.error)
            # Its type only: a message may hold content (the SDK's refusal of a reply that
            # does not fit the output type quotes the whole reply); the log has the rest.
            root.set_status(self._o.error(f"the run failed ({p.error}); kit.run_id's log has why"))
        elif isinstance(p, RunCancelled) and p.reason:
            root.set_attribute("kit.cancel_reason", p.reason[:200])
        if p.status is not None:
            root.set_attribute("kit.status", p.status.value)
        self._end(seg, at)

    def _open(self, ev: Event, at: int) -> _Segment:
        p, parent = ev.payload, None
        if isinstance(p, RunStarted):
            meta = {"name": p.name, "invocable": p.invocable,
                    "session.id": _session(p.session_id, p.namespace),
                    "kit.namespace": p.namespace, "kit.parent_run_id": p.parent_run_id}
            parent = self._runs.get(p.parent_run_id or "")
            if parent is not None and not p.session_id:  # a child run (a workflow played as a
                # tool) claims no session, but is its parent's turn's: the session lists it
                meta["session.id"] = parent.meta.get("session.id")
        else:  # resumed, or first seen mid-run: what parking remembered, else the run's index
            # row (run_info: a run parked by another process, or before a restart), else what
            # the event tells; then its session stays unknown, and so does its kind until a
            # step tells (_kind): a resume or a cancel may be an agent's or a workflow's
            meta = (self._parked.pop(ev.run_id, None) or self._row(ev.run_id)
                    or {"name": _run_name(ev), "invocable": _invocable(p)})
            self._told.pop(ev.run_id, None)
        name = meta["name"]
        attrs: dict[str, Any] = {"kit.run_id": ev.run_id, "kit.name": name,
                                 "langfuse.trace.name": name, "langfuse.observation.type": "span",
                                 **_kind_attrs(name, meta["invocable"])}
        attrs.update({k: v for k, v in meta.items() if "." in k and v})
        if attrs.get("session.id"):
            attrs["gen_ai.conversation.id"] = attrs["session.id"]
        if isinstance(p, RunResumed):
            attrs["kit.resumed_by"] = p.by
        elif not isinstance(p, RunStarted) and p.ends != "terminal":
            attrs["kit.resumed_by"] = "unknown"  # first seen mid-run; a parked run cancelled
            # where it stood (seen park here or not) was not resumed: its segment is its end alone
        self._ids.next = _hash_id("kit.run:" + ev.run_id)
        root = self._tracer.start_span(_root_name(name, meta["invocable"]), context=self._o.empty,
                                       start_time=at, attributes=attrs)
        seg = self._runs[ev.run_id] = _Segment(root, self._o.in_context(root), at, meta)
        if parent is not None:  # a child run: named on the tool span that called it, the
            # earliest open one of its name not naming one yet (parallel calls start in order)
            for span, where, _ in parent.tools.values():
                if where.rsplit("/", 1)[-1] == name and "kit.child_run_id" not in span.attributes:
                    span.set_attributes({"kit.child_run_id": ev.run_id,
                                         "kit.child_trace_id": self.trace_id(ev.run_id)})
                    span.add_link(root.get_span_context())
                    break
        while len(self._runs) > MAX_OPEN_RUNS:
            self._end(self._runs.popitem(last=False)[1], at, unfinished=True)
        return seg

    def _row(self, run_id: str) -> dict[str, Any] | None:
        """A segment's metadata from the run's index row (``run_info``), if it was told; a
        child run claims no session, but is its parent's turn's (as ``_open`` says)."""
        info = self._told.get(run_id)
        if info is None:
            return None
        parent = self._told.get(info.parent_run_id or "")
        session = _session(info.session_id, info.namespace) or (
            parent and _session(parent.session_id, parent.namespace))
        return {"name": info.name, "invocable": info.invocable, "session.id": session,
                "kit.namespace": info.namespace, "kit.parent_run_id": info.parent_run_id}

    @staticmethod
    def _kind(seg: _Segment, invocable: str) -> None:
        """A segment whose run's kind its opening event did not tell learns it from a step."""
        seg.meta = {**seg.meta, "invocable": invocable}
        seg.root.update_name(_root_name(seg.meta["name"], invocable))
        seg.root.set_attributes(_kind_attrs(seg.meta["name"], invocable))

    def _step(self, seg: _Segment, name: str, kind: Any, at: int, attrs: dict[str, Any],
              origin: str) -> None:
        attrs["kit.origin"] = origin
        start, ctx, tool = min(seg.mark, at), seg.ctx, seg.within(origin, same=True)
        if tool is not None:  # logged inside an open tool: its child, not its elder sibling
            ctx, start = self._o.in_context(tool[0]), max(start, min(tool[1], at))
        self._tracer.start_span(name, context=ctx, kind=kind, start_time=start,
                                attributes=attrs).end(end_time=at)
        seg.mark = at

    def _end(self, seg: _Segment, at: int, *, unfinished: bool = False) -> None:
        for span, _, _ in seg.tools.values():
            span.set_attribute("kit.unfinished", True)
            span.end(end_time=at)
        if unfinished:
            seg.root.set_attribute("kit.unfinished", True)
        seg.root.end(end_time=at)


# ----------------------------------------------------------------------------- raw layer ----

class _SdkProcessor(TracingProcessor):
    """The agents SDK's traces and spans as OTLP spans, each SDK trace its own OTLP trace.

    Called synchronously by the SDK (on the engine loop): in-memory work under the observer's
    lock only. Content (``input``/``output`` of the SDK's span data) is never exported.
    """

    def __init__(self, observer: TracingObserver) -> None:
        self._obs = observer
        self._roots: OrderedDict[str, Any] = OrderedDict()  # SDK trace id -> OTLP root span
        self._spans: dict[str, Any] = {}  # SDK span id -> OTLP span

    def on_trace_start(self, trace: Any) -> None:
        obs = self._obs
        with obs._lock:
            if obs._tracer is None:
                return
            meta = getattr(trace, "metadata", None) or {}
            attrs = {f"agents.metadata.{k}": v for k, v in meta.items() if _scalar(v)}
            attrs.update({"kit.layer": "sdk", "agents.trace_id": trace.trace_id,
                          "langfuse.trace.name": trace.name})
            if meta.get("kit.run_id") is not None:
                attrs["kit.run_id"] = str(meta["kit.run_id"])
            if getattr(trace, "group_id", None):
                attrs["session.id"] = trace.group_id
            m = _SDK_TRACE.match(trace.trace_id)  # keep the SDK's id when it is one
            obs._ids.next = int(m.group(1), 16) if m else _hash_id("agents:" + trace.trace_id)
            self._roots[trace.trace_id] = obs._tracer.start_span(
                trace.name, context=obs._o.empty, attributes=attrs)
            while len(self._roots) > MAX_OPEN_RUNS:
                self._roots.popitem(last=False)[1].end()

    def on_trace_end(self, trace: Any) -> None:
        with self._obs._lock:
            root = self._roots.pop(trace.trace_id, None)
            if root is not None:
                root.end()

    def on_span_start(self, span: Any) -> None:
        obs = self._obs
        with obs._lock:
            parent = self._spans.get(span.parent_id) or self._roots.get(span.trace_id)
            if obs._tracer is None or parent is None or len(self._spans) >= 10 * MAX_OPEN_RUNS:
                return
            name, client, _ = _sdk_span(span.span_data)
            self._spans[span.span_id] = obs._tracer.start_span(
                name, context=obs._o.in_context(parent), start_time=_ns(span.started_at),
                kind=obs._o.CLIENT if client else obs._o.INTERNAL)

    def on_span_end(self, span: Any) -> None:
        obs = self._obs
        with obs._lock:
            otel = self._spans.pop(span.span_id, None)
            if otel is None:
                return
            otel.set_attributes(_sdk_span(span.span_data)[2])
            if span.error:
                otel.set_attribute("error.type", "AgentsSpanError")
                otel.set_status(obs._o.error(str(span.error.get("message"))))
            otel.end(end_time=_ns(span.ended_at))

    def end_all(self, now: int) -> None:
        """Called by ``close`` (under the lock): end what the SDK left open."""
        for span in [*self._spans.values(), *self._roots.values()]:
            span.set_attribute("kit.unfinished", True)
            span.end(end_time=now)
        self._spans.clear()
        self._roots.clear()

    def shutdown(self) -> None:  # the observer's close() owns the exporter's lifetime
        pass

    def force_flush(self) -> None:  # (agents.flush_traces(), on the engine loop): never waits
        export = self._obs._export
        if export is not None:
            export.force_flush()


def _invocable(p: Any) -> str | None:
    """The kind of run an event tells it belongs to, if it does: a node update is a workflow's,
    as is an answer or a tick (only a workflow waits or sleeps); a model or tool call is an
    agent's; a resume or an end may be either's."""
    if isinstance(p, NodeUpdated) or (isinstance(p, RunResumed) and p.by in ("answer", "tick")):
        return "workflow"
    if isinstance(p, (ModelCompleted, ToolStarted, ToolCompleted, SkillLoaded)):
        return "agent"
    return None


def _session(session_id: str | None, namespace: str | None) -> str | None:
    """A run's ``session.id``: two namespaces' "s1" are two conversations, so two Langfuse
    sessions; a namespace name holds no "/" (check_name), so the pair reads back one way only."""
    return session_id and (session_id if namespace is None else f"{namespace}/{session_id}")


def _root_name(name: str, invocable: str | None) -> str:
    """A root span's name: ``invoke_agent|invoke_workflow <name>``; the bare name while the
    run's kind is unknown."""
    return f"invoke_{invocable} {name}" if invocable else name


def _kind_attrs(name: str, invocable: str | None) -> dict[str, Any]:
    """A root's attributes that name its run's kind (none while it is unknown)."""
    if invocable is None:
        return {}
    return {"kit.invocable": invocable, "gen_ai.operation.name": f"invoke_{invocable}",
            f"gen_ai.{invocable}.name": name,
            "langfuse.observation.type": "chain" if invocable == "workflow" else "agent"}


def _run_name(ev: Event) -> str:
    """The name of the run an event belongs to, read off its origin, the path of invocables and
    steps down from the top run (``boss``, ``boss/release``, ``boss/release/approve``): the last
    part of a run-level event's (a child's is below its parent's: ``boss/release``), the part
    before a node's, the first of an agent's step (its tool's, or an agent tool's model call)."""
    path, p = ev.origin or "run", ev.payload
    if isinstance(p, NodeUpdated):
        path = path.rpartition("/")[0] or path
    elif not (isinstance(p, RunResumed) or p.ends):
        return path.split("/")[0]
    return path.rsplit("/", 1)[-1]


def _scalar(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool))


def _sdk_span(data: Any) -> tuple[str, bool, dict[str, Any]]:
    """An SDK span's GenAI name, whether it is a CLIENT span, and its attributes: the scalar
    fields of its exported data (two levels deep; content fields left out, and of the model
    settings only ``_MODEL_SETTINGS``) and GenAI ones."""
    attrs: dict[str, Any] = {}

    def flat(prefix: str, obj: dict[str, Any], depth: int) -> None:
        for k, v in obj.items():
            if k in _CONTENT or v is None:
                continue
            if _scalar(v):
                attrs[f"{prefix}.{k}"] = v
            elif isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v):
                attrs[f"{prefix}.{k}"] = tuple(v)
            elif isinstance(v, dict) and depth < 2:
                flat(f"{prefix}.{k}", v, depth + 1)

    try:
        exported = data.export() or {}
        if isinstance(exported.get("model_config"), dict):
            exported["model_config"] = {k: v for k, v in exported["model_config"].items()
                                        if k in _MODEL_SETTINGS}
        flat("agents", exported, 0)
    except Exception:  # a custom span whose data will not export: keep its name only
        pass
    t, name = data.type, getattr(data, "name", None)
    if t == "agent":
        attrs.update({"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": name,
                      "langfuse.observation.type": "agent"})
        return f"invoke_agent {name}", False, attrs
    if t == "function":
        attrs.update({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                      "langfuse.observation.type": "tool"})
        return f"execute_tool {name}", False, attrs
    if t in ("generation", "response"):
        model = data.model if t == "generation" else getattr(data.response, "model", None)
        attrs.update({"gen_ai.operation.name": "chat", "langfuse.observation.type": "generation"})
        if model:  # a generation's model is the one asked for; a response's, the one that answered
            attrs[f"gen_ai.{'request' if t == 'generation' else 'response'}.model"] = model
        usage = data.usage or {}
        for ours, theirs in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens")):
            value = usage.get(ours, usage.get(theirs))
            if isinstance(value, int):
                attrs[f"gen_ai.usage.{ours}"] = value
        return f"chat {model or 'model'}", True, attrs
    if t == "turn":
        return f"turn {data.turn}", False, attrs
    if t == "handoff":
        return f"handoff {data.from_agent} -> {data.to_agent}", False, attrs
    name = name or getattr(data, "server", None)
    return (f"{t} {name}" if name else t), False, attrs
