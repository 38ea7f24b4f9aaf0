"""kit_runtime: the Runtime that plays runs and records them in the log.

Owns: playing runs (sequencing their events, group-committing them to the event store, handing
them live to streams), session claims (through the store), conversation-memory sessions, the two
engine adapters (openai-agents for agents, with their skills' ``load_skill`` tool and their MCP
servers, connected while the deck is open; LangGraph for workflows, with their checkpointers,
interrupts, answers and timed wake-ups) and the asyncio engine thread that lets the engines run
under trio.

Must never: speak HTTP or read argv; print, log or persist the application context.

Theory of operation
-------------------
There are two sides. The *kit side* is the event loop that opened the deck (asyncio or trio): it
owns the store, the writer and the streams. The *engine side* is where SDK objects live: the same
loop under asyncio; under trio, one asyncio loop in a daemon thread (``EngineThread``), because
openai-agents and LangGraph are asyncio-only (notes/ENGINES.md section 9).

A run's events are created on the engine side by ``_Run.emit``, in the engine's own order: the
tapped model emits ``text.delta`` as the model produces each chunk, hooks emit tool events. The
event gets its ``seq`` there and goes to the kit side: directly under asyncio; under trio through
the engine thread's mailbox, whose consumer is woken once per batch, never once per event
(coalesced wake-ups, PERF.md section 5). The kit side puts it in the writer's buffer and, when
someone streams the run, in the run's live buffer.

The writer group-commits: one ``store.append`` per batch (``FLUSH_MAX`` events, or ``FLUSH_DELAY``
after the first), never one commit per token (PERF.md section 3). ``run.started`` is committed
with the run's claim before the engine starts; ``tool.started`` and every terminal event are
durable before the engine goes on (``_Run.durable``).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import inspect
import json
import os
import socket
import sqlite3
import threading
import time
import types
import typing
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from typing import Any

import agents as sdk
import anyio
import anyio.lowlevel
import sniffio
from agents.function_schema import function_schema
from agents.memory import SessionABC

import kit
import kit_observers
from kit import (
    AudioBlock, Claim, ConfigError, ContentError, Context, DataBlock, DeckStateError, Event,
    ImageBlock, InvocableSpec, MessageCompleted, ModelCompleted, NodeUpdated, ResourceBlock,
    RunCancelled, RunCompleted, RunFailed, RunResumed, RunStarted, SessionBusyError, TextBlock,
    TextDelta, ToolCompleted, ToolStarted, TurnResult, Usage,
)
from kit_store import store_from_url

__all__ = ("Runtime", "EngineThread", "compile_agent", "compile_workflow", "run_headless",
           "workflow_headless", "workflow_tool", "new_run_id", "store_from_url")

#: A batch is committed when this many events wait, or FLUSH_DELAY after the first one arrived:
#: a slow stream is visible to other processes within FLUSH_DELAY, a fast one pays one commit
#: per FLUSH_MAX events (~5 us/event instead of ~31 us with one commit each, PERF.md section 3).
FLUSH_MAX = 256
FLUSH_DELAY = 0.02
#: How often a deck looks for control requests written by other processes (the CLI, replicas):
#: a pause or cancel from elsewhere reaches the run's next safe point within about this long.
CONTROL_POLL = 0.1
#: A streaming model call lets the loop run other tasks at least every this many events.
YIELD_EVERY = 64
#: A stream's live buffer. A consumer that falls this far behind is not allowed to grow memory:
#: its buffer is dropped and it catches up from the log (which has every event) instead.
LIVE_MAX = 10_000
#: Under trio, ordinary events wait up to this long before waking the kit side, so one wake-up
#: carries many events (PERF.md section 5, strategy D); durable events wake it at once.
TRIO_WAKE_DELAY = 0.002
#: A live run's lease; renewed every third of it. A process that dies stops renewing, and after
#: this long its runs are recorded as abandoned and their sessions freed (DESIGN 4.5).
DEFAULT_LEASE_SECONDS = 30.0
#: How long closing the deck waits for cancelled runs to record their end.
CLOSE_TIMEOUT = 10.0
#: Error messages recorded in run.failed are cut to this length.
MAX_ERROR_CHARS = 2000


# ==================================================================== engine thread (trio) ====

class EngineThread:
    """One asyncio loop in a daemon thread, hosting every SDK object when the deck runs on trio.

    ``call`` runs a coroutine function there and waits for it from trio; cancelling the trio
    caller cancels the asyncio task and waits (bounded) for it to unwind. ``post`` hands items
    from the engine thread to the trio side through a mailbox drained by ``pump``.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="kit-engine", daemon=True)
        self._mail: deque[Any] = deque()
        self._lock = threading.Lock()
        self._armed = 0  # 0: no wake-up pending, 1: a delayed one, 2: an immediate one
        self._token: Any = None
        self._wake: anyio.Event | None = None

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def start(self) -> None:
        import trio
        self._token = trio.lowlevel.current_trio_token()
        self._wake = anyio.Event()
        self._thread.start()

    async def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            await anyio.to_thread.run_sync(self._thread.join)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        done, token, box = anyio.Event(), self._token, {}
        task: list[asyncio.Task[Any]] = []

        async def play() -> None:
            try:
                box["result"] = await fn(*args)
            except BaseException as exc:  # noqa: BLE001 - carried to the trio side
                box["error"] = exc
            finally:
                token.run_sync_soon(done.set)

        # A fresh context: the task must not inherit the trio thread's context variables
        # (sniffio's among them would make anyio believe the engine loop is trio).
        self.loop.call_soon_threadsafe(lambda: task.append(self.loop.create_task(play())),
                                       context=contextvars.Context())
        try:
            await done.wait()
        except BaseException:
            self.loop.call_soon_threadsafe(lambda: task[0].cancel())
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
                await done.wait()  # the engine side records how the run ended before we go on
            raise
        if "error" in box:
            if isinstance(box["error"], asyncio.CancelledError):
                raise DeckStateError("CLOSED", "finish the run") from None
            raise box["error"]
        return box["result"]

    def post(self, item: Any, urgent: bool) -> None:
        """Engine side: queue ``item`` for ``pump``; wake the trio side at most once per batch."""
        with self._lock:
            self._mail.append(item)
            armed, self._armed = self._armed, max(self._armed, 2 if urgent else 1)
        if urgent and armed < 2:
            self._token.run_sync_soon(self._set)
        elif not armed:
            self.loop.call_later(TRIO_WAKE_DELAY, self._token.run_sync_soon, self._set)

    def _set(self) -> None:
        self._wake.set()  # type: ignore[union-attr]

    def take(self) -> list[Any]:
        with self._lock:
            items = list(self._mail)
            self._mail.clear()
            self._armed = 0
            self._wake = anyio.Event()
        return items

    async def pump(self, handle: Callable[[Any], Any]) -> None:
        while True:
            await self._wake.wait()  # type: ignore[union-attr]
            for item in self.take():
                await handle(item)


# ===================================================================================== writer ====

class _Writer:
    """Group commit: events wait in one buffer and reach the store in batches.

    ``put`` never awaits. ``flush`` commits everything buffered, with the claims of runs whose
    ``run.started`` waits in the buffer (a claim whose run also ends in the batch is dropped: its
    lease would be deleted in the same transaction). A batch that fails is retried run by run, so
    one run's failure (a fencing conflict) never loses another run's events; the failing run's
    error is kept for its next durable write to raise.
    """

    def __init__(self, store: Any) -> None:
        self.store = store
        self._buf: list[Event] = []
        self._claims: dict[str, Claim] = {}
        self._lock = anyio.Lock(fast_acquire=True)  # uncontended: no loop pass per flush
        self._wake = anyio.Event()
        self.failed: dict[str, BaseException] = {}

    def put(self, event: Event, claim: Claim | None = None) -> None:
        self._buf.append(event)
        if claim is not None:
            self._claims[claim.run_id] = claim
        if len(self._buf) == 1 or len(self._buf) >= FLUSH_MAX:
            self._wake.set()

    async def flush(self) -> None:
        async with self._lock:
            batch, self._buf = self._buf, []
            if not batch:
                return
            claims, self._claims = self._claims, {}
            for ev in batch:
                if ev.payload.ends == "terminal":
                    claims.pop(ev.run_id, None)
            try:
                await self.store.append(batch, claims=list(claims.values()))
            except Exception:
                by_run: dict[str, list[Event]] = {}
                for ev in batch:
                    by_run.setdefault(ev.run_id, []).append(ev)
                for run_id, evs in by_run.items():
                    try:
                        await self.store.append(evs, claims=[c for c in (claims.get(run_id),) if c])
                    except Exception as exc:
                        self.failed[run_id] = exc

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            if len(self._buf) < FLUSH_MAX:
                await anyio.sleep(FLUSH_DELAY)  # let a batch gather
            await self.flush()


# ======================================================================================= runs ====

def new_run_id() -> str:
    """A 32-hex-digit run id that sorts by creation time (like a UUIDv7).

    Time-ordered keys make the log's b-trees grow at their right edge: measured on this machine,
    one turn's commit costs ~68 us with them against ~102 us with random UUIDs.
    """
    return f"{time.time_ns():016x}{os.urandom(8).hex()}"


class _Run:
    """One run being played: sequences its events and carries them to the kit side.

    ``emit`` and ``durable`` are called on the engine side; ``feed`` and ``events`` on the kit
    side. ``data`` is the caller's context object: handed to callables, never written anywhere.
    """

    def __init__(self, runtime: Runtime, spec: InvocableSpec, run_id: str, data: Any,
                 session_id: str | None, namespace: str | None, streaming: bool) -> None:
        self.runtime, self.spec, self.run_id, self.data = runtime, spec, run_id, data
        self.session_id, self.namespace, self.streaming = session_id, namespace, streaming
        self.origin = spec.name
        self.seq = 0
        self.tool_errors: set[str] = set()
        self.input_tokens = self.output_tokens = 0
        self.usd: float | None = 0.0
        self.live: deque[Event] | None = deque() if streaming else None
        self.wake = anyio.Event()
        self.lagged = False
        self.done = anyio.Event()
        self.error: BaseException | None = None
        self.scope = anyio.CancelScope()
        self.closing = False
        self.requested: tuple[str, str | None, str | None] | None = None  # (action, reason, source)
        self.control: Any = None  # a workflow run's LangGraph RunControl
        self.thread_id: str | None = None  # workflow runs: the thread id callers see,
        self.thread_key = ""  # ... and the checkpointer's key for it

    def message_id(self) -> str:
        """An id for the reply that starts at the next event: unique within the run."""
        return f"m{self.seq + 1}"

    def _event(self, payload: Any, origin: str | None, message_id: str | None) -> Event:
        self.seq += 1
        return Event(self.run_id, self.seq, payload, origin or self.origin, message_id)

    def emit(self, payload: Any, *, origin: str | None = None, message_id: str | None = None) -> Event:
        event = self._event(payload, origin, message_id)
        self.runtime._deliver(self, event)
        return event

    async def durable(self, payload: Any, *, origin: str | None = None) -> Event:
        event = self._event(payload, origin, None)
        await self.runtime._deliver_durable(self, event)
        return event

    def add_usage(self, input_tokens: int, output_tokens: int, usd: float | None) -> None:
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.usd = None if usd is None or self.usd is None else self.usd + usd

    def usage(self) -> Usage:
        return Usage(self.input_tokens, self.output_tokens,
                     None if self.usd is None else round(self.usd, 10))

    # kit side ---------------------------------------------------------------------------
    def feed(self, event: Event) -> None:
        if self.live is None:
            return
        if len(self.live) >= LIVE_MAX:  # the consumer stalled: it will catch up from the log
            self.live.clear()
            self.lagged = True
        self.live.append(event)
        self.wake.set()

    async def events(self, after: int) -> AsyncIterator[Event]:
        """Kit side: this run's events after ``after``, live, until a terminal/parking one."""
        last = after
        while True:
            if self.lagged:
                self.lagged = False
                await self.runtime.writer.flush()
                backlog = await self.runtime.store.read(self.run_id, after=last)
            else:
                if not self.live:
                    if self.done.is_set():
                        return
                    self.wake = anyio.Event()
                    if not self.live and not self.done.is_set():
                        await self.wake.wait()
                    continue
                backlog = list(self.live)
                self.live.clear()
            for ev in backlog:
                if ev.seq <= last:
                    continue
                last = ev.seq
                yield ev
                if ev.payload.ends:
                    return


# ============================================================================ agents adapter ====

#: The run a model call belongs to (set around Runner.run; the SDK's tasks inherit it).
_CURRENT_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("kit_run", default=None)
_UNPRICED: set[str] = set()


def _price(model: str, input_tokens: int, output_tokens: int) -> float | None:
    """Estimated USD from genai-prices' bundled data (offline); None for an unknown model."""
    if model in _UNPRICED:
        return None
    from genai_prices import Usage as PriceUsage, calc_price
    try:
        price = calc_price(PriceUsage(input_tokens=input_tokens, output_tokens=output_tokens),
                           model_ref=model, provider_id="openai")
    except LookupError:
        _UNPRICED.add(model)
        return None
    return float(price.total_price)


def _message_text(item: Any) -> str:
    return "".join(getattr(part, "text", "") or "" for part in getattr(item, "content", ()) or ())


class _TapModel(sdk.Model):
    """Wraps an agent's model so its output is recorded as it is produced.

    Deck runs use the non-streamed ``Runner.run`` for both ``run`` and ``stream``: when the run
    streams, ``get_response`` consumes the inner model's ``stream_response`` itself, emitting a
    ``text.delta`` per chunk in the engine's own order, and returns the same ``ModelResponse``
    the runner would have built. That skips the SDK's stream-event machinery (a queue hop and two
    wrapper objects per token) while keeping text, tools and usage exactly as the SDK sees them.
    """

    def __init__(self, agent: str, model: str | sdk.Model | None) -> None:
        self.agent = agent
        self._model = model
        self._inner: sdk.Model | None = model if isinstance(model, sdk.Model) else None

    def inner(self) -> sdk.Model:
        if self._inner is None:  # resolved on first use: building the client needs settings
            self._inner = sdk.MultiProvider().get_model(self._model)  # type: ignore[arg-type]
        return self._inner

    def model_name(self) -> str:
        inner = self.inner()
        return str(getattr(inner, "model", None) or self._model or type(inner).__name__)

    async def get_response(self, system_instructions, input, model_settings, tools, output_schema,
                           handoffs, tracing, *, previous_response_id=None, conversation_id=None,
                           prompt=None) -> Any:
        run: _Run | None = _CURRENT_RUN.get()
        inner = self.inner()
        args = (system_instructions, input, model_settings, tools, output_schema, handoffs, tracing)
        kw = dict(previous_response_id=previous_response_id, conversation_id=conversation_id,
                  prompt=prompt)
        if run is None:
            return await inner.get_response(*args, **kw)
        ids: dict[int, str] = {}
        if run.streaming:
            response = await self._stream(run, inner.stream_response(*args, **kw), ids)
        else:
            response = await inner.get_response(*args, **kw)
            for i, item in enumerate(response.output):
                if getattr(item, "type", None) == "message":
                    ids[i] = run.message_id()
                    run.emit(TextDelta(_message_text(item)), origin=self._origin(run),
                             message_id=ids[i])
        self._record(run, response, output_schema, ids)
        return response

    async def _stream(self, run: _Run, stream: AsyncIterator[Any], ids: dict[int, str]) -> Any:
        origin, final, done_items = self._origin(run), None, []
        async for ev in stream:
            kind = getattr(ev, "type", None)
            if run.seq % YIELD_EVERY == 0:
                # A model whose stream never waits (a scripted one, a fast local one) would
                # otherwise hold the loop for a whole reply: streams, observers and other runs
                # get their turn every YIELD_EVERY events.
                await anyio.lowlevel.checkpoint()
            if kind == "response.output_text.delta":
                mid = ids.get(ev.output_index)
                if mid is None:
                    mid = ids[ev.output_index] = run.message_id()
                run.emit(TextDelta(ev.delta), origin=origin, message_id=mid)
            elif kind == "response.output_item.done":
                done_items.append(ev.item)
            elif kind == "response.completed":
                final = ev.response
            elif kind in ("response.failed", "response.incomplete", "error", "response.error"):
                raise sdk.ModelBehaviorError(f"the model stream ended with {kind}")
        if final is None:
            raise sdk.ModelBehaviorError("Model did not produce a final response!")
        output = final.output or done_items  # some backends leave the final output empty
        u = final.usage
        usage = sdk.Usage(requests=1, input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                          total_tokens=u.total_tokens, input_tokens_details=u.input_tokens_details,
                          output_tokens_details=u.output_tokens_details) if u else sdk.Usage()
        return sdk.ModelResponse(output=output, usage=usage, response_id=final.id)

    def _origin(self, run: _Run) -> str:
        return run.origin if self.agent == run.origin else f"{run.origin}/{self.agent}"

    def _record(self, run: _Run, response: Any, output_schema: Any, ids: dict[int, str]) -> None:
        origin = self._origin(run)
        calls_tools = any(getattr(i, "type", None) == "function_call" for i in response.output)
        for i, item in enumerate(response.output):
            if getattr(item, "type", None) != "message":
                continue
            text, output = _message_text(item), None
            if output_schema is not None and not output_schema.is_plain_text() and not calls_tools:
                try:
                    output = kit._jsonable(output_schema.validate_json(text))
                except Exception:  # the runner reports invalid output itself
                    output = None
            run.emit(MessageCompleted(text, output, self.agent), origin=origin,
                     message_id=ids.get(i))
        model = self.model_name()
        u = response.usage
        usd = _price(model, u.input_tokens, u.output_tokens)
        run.add_usage(u.input_tokens, u.output_tokens, usd)
        run.emit(ModelCompleted(model, u.input_tokens, u.output_tokens, usd), origin=origin)

    async def stream_response(self, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        async for ev in self.inner().stream_response(*args, **kw):
            yield ev


class _Stop(sdk.AgentsException):
    """Raised at a safe point to stop a run that was asked to pause or cancel."""

    def __init__(self, action: str, reason: str | None) -> None:
        super().__init__(f"{action} requested")
        self.action, self.reason = action, reason


class _KitHooks(sdk.RunHooks):
    """Records tool calls (``tool.started`` durable before the tool runs, then
    ``tool.completed``) and holds the agents' safe point: before each model call, a run asked to
    pause or cancel stops there, with every finished turn kept (notes/ENGINES.md 4)."""

    async def on_llm_start(self, context: Any, agent: Any, system_prompt: Any, input_items: Any) -> None:
        run = context.context
        if isinstance(run, _Run) and run.requested is not None:
            action, reason, source = run.requested
            run.requested = None
            run.emit(kit.ControlRequested(action, reason, source))
            raise _Stop(action, reason)

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        run = context.context
        if isinstance(run, _Run):
            call_id = getattr(context, "tool_call_id", None) or uuid.uuid4().hex
            await run.durable(ToolStarted(call_id, tool.name, getattr(context, "tool_arguments", "") or ""),
                              origin=_tool_origin(run, agent, tool))

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        run = context.context
        if isinstance(run, _Run):
            call_id = getattr(context, "tool_call_id", None) or ""
            run.emit(ToolCompleted(call_id, tool.name, kit._jsonable(result), call_id in run.tool_errors),
                     origin=_tool_origin(run, agent, tool))


def _tool_origin(run: _Run, agent: Any, tool: Any) -> str:
    base = run.origin if agent.name == run.origin else f"{run.origin}/{agent.name}"
    return f"{base}/{tool.name}"


_HOOKS = _KitHooks()


def _data(wrapper: Any) -> Any:
    """The caller's context object for an SDK context wrapper (None on headless runs)."""
    run = getattr(wrapper, "context", None)
    return run.data if isinstance(run, _Run) else None


#: A ``Context[...]`` requirement kit cannot resolve (a string annotation that does not evaluate):
#: deferred to invocation, like the other cases the build-time check cannot rule on (SPEC 4.2).
_UNREADABLE = object()


def _context_params(fn: Any) -> dict[str, Any]:
    """The parameters of ``fn`` annotated ``Context[...]``, each with the type it requires
    (``Any`` for a bare ``Context``, ``_UNREADABLE`` when its annotation cannot be evaluated)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}
    found = {n: p.annotation for n, p in sig.parameters.items() if _is_context(p.annotation)}
    if not found:
        return {}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation naming something not importable here
        hints = {}
    out = {}
    for name, annotation in found.items():
        annotation = hints.get(name, annotation)
        if isinstance(annotation, str):
            out[name] = _UNREADABLE
        else:
            out[name] = typing.get_args(annotation)[0] if typing.get_args(annotation) else Any
    return out


def context_fits(required: Any, provided: Any) -> bool | None:
    """SPEC 4.2: may a callable requiring ``Context[required]`` run with a ``provided`` object?

    True or False, or None when the runtime cannot rule (deferred to invocation): ``Any`` and
    a bare ``Context`` fit anything; a class fits its subclasses (exact type or supertype); a
    parameterised ABC such as ``Mapping[str, Any]`` is checked as the ABC, parameters ignored; a
    runtime-checkable protocol with only methods is checked structurally; a union fits when an
    arm does; a TypeVar, another protocol, or an annotation kit cannot read is deferred.
    """
    if required is Any:
        return True
    if required is _UNREADABLE or isinstance(required, typing.TypeVar):
        return None
    origin = typing.get_origin(required)
    if origin in (typing.Union, types.UnionType):
        verdicts = [context_fits(arm, provided) for arm in typing.get_args(required)]
        return True if True in verdicts else None if None in verdicts else False
    if origin is not None:
        required = origin  # the ABC (or class) of a parameterised type; parameters ignored
    if not isinstance(required, type):
        return None
    if getattr(required, "_is_protocol", False) and not getattr(required, "_is_runtime_protocol", False):
        return None
    try:
        return issubclass(typing.get_origin(provided) or provided, required)
    except TypeError:  # a protocol with data members: the runtime refuses to rule
        return None


def check_context(specs: Sequence[InvocableSpec], provided: Any) -> None:
    """Walk every injection site of the catalog and refuse an incompatible requirement.

    Sites: an agent's tools (SDK tool objects are deferred), its instructions callable, its
    hook methods, and every workflow node. Raises ``ContextTypeError`` naming the site, what it
    requires and what the deck provides.
    """
    for spec in specs:
        if spec.kind == "agent":
            agent = spec.source
            sites = [(f"tool {getattr(t, '__name__', t)!s} of agent {agent.name!r}", t)
                     for t in agent.tools if not isinstance(t, kit._SDK_TOOLS)]
            if callable(agent.instructions):
                sites.append((f"the instructions of agent {agent.name!r}", agent.instructions))
            for method in _HOOK_METHODS:
                fn = getattr(agent.hooks, method, None) if agent.hooks is not None else None
                if fn is not None:
                    sites.append((f"hook {method} of agent {agent.name!r}", fn))
        else:
            sites = [(f"node {name} of workflow {spec.name!r}", _node_function(node))
                     for name, node in spec.source.graph.nodes.items()]
        for site, fn in sites:
            for required in _context_params(fn).values():
                if context_fits(required, provided) is False:
                    raise kit.ContextTypeError(site, required, provided)


def _is_context(annotation: Any) -> bool:
    if isinstance(annotation, str):  # postponed annotations: `from __future__ import annotations`
        return annotation == "Context" or annotation.startswith(("Context[", "kit.Context"))
    return annotation is Context or typing.get_origin(annotation) is Context


def _compile_tool(agent: str, fn: Callable[..., Any]) -> sdk.FunctionTool:
    """A plain function as an SDK ``FunctionTool``; ``Context[...]`` parameters are injected.

    The schema is the SDK's own (``function_schema``, docstring descriptions included) built
    over the function's signature without its context parameters, so the model never sees them.
    The tool's exception goes back to the model as an error string, not a failed run.
    """
    sig = inspect.signature(fn)
    ctx_names = [p.name for p in sig.parameters.values() if _is_context(p.annotation)]
    if ctx_names and any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
        raise ConfigError(f"agent {agent!r}: tool {fn.__name__} takes *args and a Context parameter")
    visible = [p for p in sig.parameters.values() if p.name not in ctx_names]

    def proxy(*a: Any, **k: Any) -> Any:  # only its signature and docs are read
        raise AssertionError

    proxy.__name__, proxy.__qualname__, proxy.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    proxy.__module__ = fn.__module__
    proxy.__signature__ = sig.replace(parameters=visible)  # type: ignore[attr-defined]
    proxy.__annotations__ = {k: v for k, v in getattr(fn, "__annotations__", {}).items()
                             if k not in ctx_names}
    try:
        schema = function_schema(proxy)
    except Exception as exc:
        raise ConfigError(f"agent {agent!r}: cannot build a schema for tool {fn.__name__}: {exc}") from None
    names = [p.name for p in visible]
    is_async = inspect.iscoroutinefunction(fn)

    async def invoke(tool_ctx: Any, args_json: str) -> Any:
        run = tool_ctx.context
        if ctx_names and not isinstance(run, _Run):
            raise ConfigError(f"tool {fn.__name__} requires a kit run context, but the run carries "
                              f"{type(run).__name__} rather than a run context (headless Agent.run?)")
        try:
            parsed = schema.params_pydantic_model(**json.loads(args_json or "{}"))
            args, kwargs = schema.to_call_args(parsed)
            call = dict(zip(names, args)) if ctx_names else None
            if call is not None:
                call.update(kwargs)
                call.update({n: Context(run.data) for n in ctx_names})
                args, kwargs = (), call
            if is_async:
                return await fn(*args, **kwargs)
            out = await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
            return await out if inspect.isawaitable(out) else out
        except Exception as exc:
            if isinstance(run, _Run):
                run.tool_errors.add(getattr(tool_ctx, "tool_call_id", ""))
            return f"error: {type(exc).__name__}: {exc}"

    return sdk.FunctionTool(name=schema.name, description=schema.description or "",
                            params_json_schema=schema.params_json_schema, on_invoke_tool=invoke,
                            strict_json_schema=schema.strict_json_schema)


def _instructions(agent: kit.Agent, suffix: str = "") -> Any:
    """The agent's instructions for the SDK; ``suffix`` (the skill catalog) follows them,
    whether they are text or a callable."""
    fn = agent.instructions
    if fn is None or isinstance(fn, str):
        return f"{fn or ''}{suffix}".lstrip() if suffix else fn

    async def instructions(wrapper: Any, sdk_agent: Any) -> str:
        out = fn(Context(_data(wrapper)), sdk_agent)
        out = await out if inspect.isawaitable(out) else out
        return f"{out or ''}{suffix}" if suffix else out

    return instructions


# ---------------------------------------------------------------------------- skills ----

def _skill_catalog(skills: Sequence[kit.Skill]) -> str:
    """Tier 1 of the Agent Skills progressive disclosure: each skill's name and description."""
    if not skills:
        return ""
    lines = ["", "", "## Skills",
             "A skill holds instructions for one kind of task. When a task matches a skill's "
             "description, call load_skill with its name first and follow what it says.", ""]
    lines += [f"- {s.name}: {' '.join(s.description.split())}" for s in skills]
    return "\n".join(lines)


def _skill_tool(agent: str, skills: Sequence[kit.Skill]) -> sdk.FunctionTool:
    """The generated ``load_skill(name)`` tool: returns the skill's body (prose, never run).

    Each load appends ``skill.loaded`` with the SHA-256 of the text served. Only the agent's
    own skills are served, looked up by exact name: a name carrying a path (``../x``) or any
    other name is refused with an error string to the model; no path is ever built from it.
    """
    by_name = {s.name: s for s in skills}
    schema = {"type": "object", "additionalProperties": False, "required": ["name"],
              "properties": {"name": {"type": "string", "enum": sorted(by_name),
                                      "description": "The skill's name, as listed under Skills."}}}

    async def invoke(tool_ctx: Any, args_json: str) -> str:
        run = tool_ctx.context
        try:
            name = json.loads(args_json or "{}").get("name")
        except (ValueError, AttributeError):
            name = None
        skill = by_name.get(name) if isinstance(name, str) else None
        if skill is None:
            if isinstance(run, _Run):
                run.tool_errors.add(getattr(tool_ctx, "tool_call_id", ""))
            why = "skill names never carry a path" if isinstance(name, str) and (
                "/" in name or "\\" in name or ".." in name) else "no such skill for this agent"
            return f"error: refused {name!r}: {why}; the skills are {', '.join(sorted(by_name))}"
        if isinstance(run, _Run):
            digest = hashlib.sha256(skill.body.encode("utf-8")).hexdigest()
            run.emit(kit.SkillLoaded(skill.name, digest))
        return skill.body

    return sdk.FunctionTool(name="load_skill", description=(
        "Load a skill: returns its full instructions, to follow for the task at hand."),
        params_json_schema=schema, on_invoke_tool=invoke, strict_json_schema=True)


_HOOK_METHODS = ("on_start", "on_end", "on_handoff", "on_tool_start", "on_tool_end",
                 "on_llm_start", "on_llm_end")


class _UserHooks(sdk.AgentHooks):
    """The agent's own hooks object, called with a ``Context`` in place of the SDK's context."""

    def __init__(self, user: Any) -> None:
        self.user = user

    async def _call(self, name: str, wrapper: Any, *args: Any) -> None:
        method = getattr(self.user, name, None)
        if method is not None:
            out = method(Context(_data(wrapper)), *args)
            if inspect.isawaitable(out):
                await out


def _hook_method(name: str) -> Callable[..., Any]:
    async def method(self: _UserHooks, context: Any, *args: Any) -> None:
        await self._call(name, context, *args)
    method.__name__ = name
    return method


for _name in _HOOK_METHODS:
    setattr(_UserHooks, _name, _hook_method(_name))


class _AgentEngine:
    """What ``compile_agent`` produces: the SDK agent and how to turn blocks into its input."""

    def __init__(self, sdk_agent: sdk.Agent, chat: bool) -> None:
        self.sdk_agent, self.chat = sdk_agent, chat

    def to_input(self, blocks: Sequence[Any]) -> str | list[dict[str, Any]]:
        return _model_input(blocks, self.chat)


def _wants_chat(model: Any) -> bool:
    if isinstance(model, sdk.Model):
        return isinstance(model, sdk.OpenAIChatCompletionsModel)
    return os.environ.get("KIT_OPENAI_API", "responses") == "chat_completions"


def _model_input(blocks: Sequence[Any], chat: bool) -> str | list[dict[str, Any]]:
    """Content blocks as one user message of the Responses input format.

    Resource and data blocks are recorded in the log but not sent (SPEC 8). Raises
    ``ConfigError`` naming a block this engine path cannot express (audio off the
    chat-completions path), ``ContentError`` when nothing is left to send.
    """
    if len(blocks) == 1 and isinstance(blocks[0], TextBlock):
        return blocks[0].text
    parts: list[dict[str, Any]] = []
    for b in blocks:
        if isinstance(b, TextBlock):
            parts.append({"type": "input_text", "text": b.text})
        elif isinstance(b, ImageBlock):
            parts.append({"type": "input_image", "detail": "auto",
                          "image_url": f"data:{b.media_type};base64,{b.data_b64}"})
        elif isinstance(b, AudioBlock):
            if not chat:
                raise ConfigError("AudioBlock cannot be sent on the Responses API path: set "
                                  "KIT_OPENAI_API=chat_completions or give the agent an "
                                  "OpenAIChatCompletionsModel")
            fmt = b.media_type.split("/", 1)[1].removeprefix("x-")
            parts.append({"type": "input_audio", "input_audio": {
                "data": b.data_b64, "format": {"mpeg": "mp3"}.get(fmt, fmt)}})
        elif not isinstance(b, (ResourceBlock, DataBlock)):
            raise ConfigError(f"the agents engine cannot express a {type(b).__name__}")
    if not parts:
        raise ContentError("nothing to send to the model: resource and data blocks are recorded "
                           "but not sent; add a TextBlock")
    return [{"role": "user", "content": parts}]


def _sdk_agent(agent: kit.Agent, model: Any, extra_tools: Sequence[Any] = (), *,
               skills: Sequence[kit.Skill] = (), mcp_servers: Sequence[Any] = ()) -> sdk.Agent:
    tools = [t if isinstance(t, kit._SDK_TOOLS) else _compile_tool(agent.name, t) for t in agent.tools]
    if skills:
        tools.append(_skill_tool(agent.name, skills))
    return sdk.Agent(
        name=agent.name, instructions=_instructions(agent, _skill_catalog(skills)),
        tools=tools + list(extra_tools),
        hooks=_UserHooks(agent.hooks) if agent.hooks is not None else None, model=model,
        model_settings=agent.model_settings or sdk.ModelSettings(), output_type=agent.output_type,
        # Tool names qualified by server (mcp_<server>__<tool>): two servers may share a name.
        # Without servers the SDK's default config: qualifying costs a tool scan per turn.
        mcp_servers=list(mcp_servers), mcp_config={
            "include_server_in_tool_names": True, "failure_error_function": _mcp_tool_error,
        } if mcp_servers else {})


def _mcp_tool_error(ctx: Any, error: Exception) -> str:
    """An MCP tool call that failed (timed out, refused by the server): the SDK's error text
    goes to the model, and the call's ``tool.completed`` says ``is_error``."""
    run = getattr(ctx, "context", None)
    if isinstance(run, _Run):
        run.tool_errors.add(getattr(ctx, "tool_call_id", None) or "")
    return sdk.default_tool_error_function(ctx, error)


def compile_agent(agent: kit.Agent, workflows: Sequence[InvocableSpec] = (), *,
                  skills: Sequence[kit.Skill] = (), mcp_servers: Sequence[Any] = ()) -> InvocableSpec:
    """Compile an ``Agent`` for Deck runs (its model tapped so its output reaches the log);
    each of ``workflows`` becomes a tool that plays it as a child run; ``skills`` give it the
    catalog in its instructions and ``load_skill``; ``mcp_servers`` (the SDK's server objects,
    connected when the deck opens) give it their tools."""
    model = agent.model or os.environ.get("KIT_MODEL") or None
    tools = [workflow_tool(w.source, None, child_runs=True) for w in workflows]
    return InvocableSpec(agent.name, "agent", agent, _AgentEngine(
        _sdk_agent(agent, _TapModel(agent.name, model), tools, skills=skills,
                   mcp_servers=mcp_servers), _wants_chat(model)))


async def run_headless(agent: kit.Agent, input: Any, *, session: Any = None,
                       max_turns: int | None = None) -> Any:
    """``Agent.run``: the SDK's own run of the agent, no log, no deck; returns its RunResult."""
    if agent._headless is None:
        model = agent.model or os.environ.get("KIT_MODEL") or None
        agent._headless = _AgentEngine(_sdk_agent(agent, model), _wants_chat(model))
    engine = agent._headless
    items = engine.to_input(kit.as_blocks(input))
    kw: dict[str, Any] = {"session": session}
    if max_turns is not None:
        kw["max_turns"] = max_turns

    return await _on_asyncio(functools.partial(sdk.Runner.run, engine.sdk_agent, items, **kw))


async def _play_agent(run: _Run, items: Any, session: Any, run_config: Any) -> Event:
    """Engine side: play an agent turn, ending the run with its terminal event."""
    token = _CURRENT_RUN.set(run)
    try:
        result = await sdk.Runner.run(run.spec.engine.sdk_agent, items, context=run, hooks=_HOOKS,
                                      run_config=run_config, session=session)
    except _Stop as stop:
        if stop.action == "cancel":
            return await run.durable(RunCancelled(stop.reason))
        items = None
        if session is None and stop.run_data is not None:  # keep the conversation to resume from
            data = stop.run_data
            items = ([{"role": "user", "content": data.input}] if isinstance(data.input, str)
                     else list(data.input)) + [i.to_input_item() for i in data.new_items]
        return await run.durable(kit.RunPaused(stop.reason, kit._jsonable(items)))
    except anyio.get_cancelled_exc_class():
        run.emit(RunCancelled("the deck closed" if run.closing else "the caller was cancelled"))
        raise
    except Exception as exc:
        run.error = exc  # a stream's consumer raises it after run.failed
        await run.durable(RunFailed(type(exc).__name__, str(exc)[:MAX_ERROR_CHARS]))
        raise
    finally:
        _CURRENT_RUN.reset(token)
    return await run.durable(RunCompleted(kit._jsonable(result.final_output), run.usage()))


# ========================================================================== workflow adapter ====

_CONTROL_WRITES = {"__interrupt__", "__resume__", "__error__", "__error_source_node__"}
_NULL_TASK = "00000000-0000-0000-0000-000000000000"


class _WorkflowEngine:
    """What ``compile_workflow`` produces: the deck's graph (nodes that take a ``Context`` bound
    to LangGraph's run context), input checks and the thread key scheme.

    The graph is compiled when the deck opens, with the checkpointer that lives there.
    Checkpoint threads are keyed ``<workflow>:<namespace>:<thread id>`` so workflows and
    namespaces never share a thread, and a checkpointer scan can tell whose thread it sees.
    """

    def __init__(self, workflow: kit.Workflow, graph: Any) -> None:
        self.workflow, self.graph = workflow, graph

    def to_input(self, input: Any) -> dict[str, Any]:
        if not isinstance(input, typing.Mapping):
            raise ContentError(f"workflow {self.workflow.name!r} takes a mapping (its initial "
                               f"state) as input, got {type(input).__name__}")
        DataBlock(dict(input))  # JSON data, within the inline cap: ContentError otherwise
        return dict(input)

    def key(self, namespace: str | None, thread_id: str) -> str:
        return f"{self.workflow.name}:{namespace or ''}:{thread_id}"


def checkpoint_path(store_path: str) -> str:
    """The durable workflows' checkpoint file for a log file: ``kit.db`` -> ``kit.checkpoints.db``.

    Not the log's own file: under asyncio the log commits inline on the loop thread, and the
    checkpointer (aiosqlite) keeps a transaction open across an ``await`` until its commit,
    which needs that loop; a log commit waiting for that lock would stall the loop for the
    whole busy timeout and fail with "database is locked" (seen in bench_kit.py).
    """
    root, ext = os.path.splitext(store_path)
    return f"{root}.checkpoints{ext or '.db'}"


def _config(key: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": key}}


def _node_function(node: Any) -> Any:
    """The function a ``StateGraph`` node was added with (None when it is not a plain one)."""
    runnable = node.runnable
    return getattr(runnable, "func", None) or getattr(runnable, "afunc", None)


#: What LangGraph injects into a node by parameter name, read off its ``Runtime`` instead.
_FROM_RUNTIME = {"runtime": lambda r: r, "writer": lambda r: r.stream_writer,
                 "store": lambda r: r.store, "previous": lambda r: r.previous}


def _bind_context(workflow: str, name: str, fn: Callable[..., Any], ctx_names: list[str]) -> Any:
    """A node that hands ``fn`` the run's context as ``Context(runtime.context)``.

    The context travels in LangGraph's run context (``astream(context=)``), never in state or
    config, so it never reaches a checkpoint (notes/ENGINES.md 12). The raw ``fn`` stays in the
    workflow's own graph: headless runs call it without a context and fail with Python's own
    ``TypeError`` for the missing argument (SPEC 7).
    """
    params = inspect.signature(fn).parameters
    if "config" in params:
        raise ConfigError(f"node {name} of workflow {workflow!r} takes both a Context and config; "
                          "read what you need from the Context instead")
    injected = [n for n in _FROM_RUNTIME if n in params]

    def kwargs(runtime: Any) -> dict[str, Any]:
        out = {n: _FROM_RUNTIME[n](runtime) for n in injected}
        out.update({n: Context(runtime.context) for n in ctx_names})
        return out

    if inspect.iscoroutinefunction(fn):
        async def node(state: Any, runtime: Any) -> Any:
            return await fn(state, **kwargs(runtime))
    else:
        def node(state: Any, runtime: Any) -> Any:
            return fn(state, **kwargs(runtime))
    node.__name__ = getattr(fn, "__name__", name)
    return node


def compile_workflow(workflow: kit.Workflow) -> InvocableSpec:
    """Check a ``Workflow`` for Deck runs and make the deck's copy of its graph, whose nodes
    that declare a ``Context`` receive the run's; compiled at open, with its checkpointer."""
    import copy
    import dataclasses
    from langgraph._internal._runnable import coerce_to_runnable
    graph = copy.copy(workflow.graph)
    graph.nodes = dict(graph.nodes)
    for name, node in graph.nodes.items():
        fn = _node_function(node)
        ctx_names = list(_context_params(fn)) if fn is not None else []
        if ctx_names:
            graph.nodes[name] = dataclasses.replace(node, runnable=coerce_to_runnable(
                _bind_context(workflow.name, name, fn, ctx_names), name=name, trace=False))
    try:
        graph.compile()  # a graph that cannot compile is a configuration error now
    except Exception as exc:
        raise ConfigError(f"workflow {workflow.name!r} does not compile: {exc}") from None
    return InvocableSpec(workflow.name, "workflow", workflow, _WorkflowEngine(workflow, graph))


def _parked(run: _Run, interrupts: Sequence[Any]) -> Any:
    intr = interrupts[0]
    value = intr.value
    if isinstance(value, dict) and value.get("kind") == "sleep" and "until" in value:
        return kit.RunSleeping(str(value["until"]), run.thread_id, intr.id)
    return kit.RunInterrupted(intr.id, kit._jsonable(value), run.thread_id)


async def _play_workflow(run: _Run, graph: Any, inp: Any, durable: bool) -> Event:
    """Engine side: play (or resume) a workflow run, ending it with a terminal or parking event.

    ``inp`` is the initial state, or a LangGraph ``Command`` to resume. On a durable thread
    that stopped mid-run (its process died), a new run carries on from the last checkpoint and
    the new input is not applied.
    """
    from langgraph.errors import GraphDrained
    from langgraph.runtime import RunControl
    config = _config(run.thread_key)
    interrupts: Any = ()
    final: Any = None
    run.control = RunControl()
    if run.requested is not None:  # asked before the graph started
        run.control.request_drain(run.requested[0])
    try:
        if durable and isinstance(inp, dict):
            snapshot = await graph.aget_state(config)
            if snapshot.next and not snapshot.interrupts:
                inp = None
        async for mode, chunk in graph.astream(inp, config, context=run.data, control=run.control,
                                               stream_mode=["updates", "values"],
                                               durability="sync" if durable else "async"):
            if mode == "values":
                final = chunk
                continue
            for node, update in chunk.items():
                if node == "__interrupt__":
                    interrupts = update
                else:
                    run.emit(NodeUpdated(node, kit._jsonable(update)), origin=f"{run.origin}/{node}")
    except GraphDrained:  # stopped at a superstep boundary, as asked; the checkpoint is saved
        action, reason, source = run.requested or ("pause", None, None)
        run.requested = None
        run.emit(kit.ControlRequested(action, reason, source))
        return await run.durable(RunCancelled(reason) if action == "cancel" else kit.RunPaused(reason))
    except anyio.get_cancelled_exc_class():
        run.emit(RunCancelled("the deck closed" if run.closing else "the caller was cancelled"))
        raise
    except Exception as exc:
        run.error = exc
        await run.durable(RunFailed(type(exc).__name__, str(exc)[:MAX_ERROR_CHARS]))
        raise
    if interrupts:
        return await run.durable(_parked(run, interrupts))
    return await run.durable(RunCompleted(kit._jsonable(final), Usage()))


def _result(run: _Run, end: Event) -> Any:
    """What a run returns to its caller, from its last event."""
    p = end.payload
    if isinstance(p, RunCompleted):
        if run.spec.kind == "agent":
            return TurnResult(p.output, p.usage, run.run_id, run.session_id)
        return p.output
    if isinstance(p, kit.RunInterrupted):
        return kit.InterruptResult(p.payload, p.thread_id or run.thread_id)
    if isinstance(p, kit.RunSleeping):
        return kit.InterruptResult({"kind": "sleep", "until": p.until}, p.thread_id or run.thread_id)
    if isinstance(p, kit.RunPaused):
        raise kit.RunStoppedError(run.run_id, kit.RunStatus.PAUSED, p.reason)
    raise kit.RunStoppedError(run.run_id, kit.RunStatus.CANCELLED, getattr(p, "reason", None))


def _pending_interrupts(ct: Any) -> list[Any]:
    """Interrupts still waiting in a checkpoint (LangGraph's own rule, notes/ENGINES.md 10):
    a task's INTERRUPT slot holds its latest question; it is pending while the task has no
    output write. (A ``__resume__`` write does not mean the question was answered.)"""
    asked: dict[str, list[Any]] = {}
    finished: set[str] = set()
    for task_id, channel, value in ct.pending_writes or ():
        if task_id == _NULL_TASK:
            continue
        if channel == "__interrupt__":
            asked[task_id] = list(value) if isinstance(value, (list, tuple)) else [value]
        elif channel not in _CONTROL_WRITES:
            finished.add(task_id)
    return [i for t, found in asked.items() if t not in finished for i in found]


async def _sleeping(saver: Any) -> list[tuple[str, Any]]:
    """Every thread of a checkpointer whose latest root checkpoint sleeps: (key, interrupt)."""
    seen: set[str] = set()
    out = []
    async for ct in saver.alist(None):  # newest first, per thread
        conf = ct.config["configurable"]
        key = conf["thread_id"]
        if conf.get("checkpoint_ns", "") or key in seen:
            continue
        seen.add(key)
        for intr in _pending_interrupts(ct):
            if isinstance(intr.value, dict) and intr.value.get("kind") == "sleep":
                out.append((key, intr))
    return out


def _headless_graph(workflow: kit.Workflow) -> Any:
    if workflow._headless is None:
        from langgraph.checkpoint.memory import InMemorySaver
        workflow._headless = workflow.graph.compile(checkpointer=InMemorySaver())
    return workflow._headless


async def _on_asyncio(fn: Callable[[], Any]) -> Any:
    """Await ``fn()`` on an asyncio loop: this one, or under trio a temporary engine thread."""
    if sniffio.current_async_library() == "asyncio":
        return await fn()
    thread = EngineThread()
    thread.start()
    try:
        return await thread.call(fn)
    finally:
        await thread.stop()


_NO_VALUE = object()


async def workflow_headless(workflow: kit.Workflow, input: Any, thread_id: str | None,
                            resume: Any = _NO_VALUE) -> Any:
    """``Workflow.run`` / ``resume``: LangGraph's own run, no log; final state or interrupt."""
    from langgraph.types import Command
    thread = thread_id or new_run_id()
    if resume is _NO_VALUE and not isinstance(input, typing.Mapping):
        raise ContentError(f"workflow {workflow.name!r} takes a mapping as input, "
                           f"got {type(input).__name__}")
    inp = dict(input) if resume is _NO_VALUE else Command(resume=resume)

    async def play() -> Any:
        graph = _headless_graph(workflow)
        out = await graph.ainvoke(inp, _config(thread))
        found = out.get("__interrupt__") if isinstance(out, dict) else None
        if found:
            return kit.InterruptResult(found[0].value, thread)
        return out

    return await _on_asyncio(play)


def workflow_tool(workflow: kit.Workflow, description: str | None, *, child_runs: bool) -> Any:
    """A ``FunctionTool`` whose arguments are the workflow's input state.

    With ``child_runs`` (an agent's ``workflows=``) it plays the workflow through the Runtime
    as a child run of the calling run (own run id, ``parent_run_id`` set, events in the log);
    otherwise (``Workflow.as_tool``) headless. The model gets the final state as JSON, or word
    that the workflow is waiting and for what.
    """
    try:
        schema = workflow.graph.compile().get_input_jsonschema()
    except Exception:  # e.g. pydantic refuses typing.TypedDict before Python 3.12: name the keys
        keys = typing.get_type_hints(workflow.graph.input_schema)
        schema = {"type": "object", "properties": {k: {} for k in keys}}

    async def invoke(tool_ctx: Any, args_json: str) -> str:
        args = json.loads(args_json or "{}")
        parent = tool_ctx.context
        if child_runs and isinstance(parent, _Run):
            out = await parent.runtime.child_workflow(parent, workflow.name, args)
        else:
            out = await workflow_headless(workflow, args, None)
        if isinstance(out, kit.InterruptResult):
            return (f"workflow {workflow.name} is waiting (thread {out.thread_id}): "
                    f"{json.dumps(kit._jsonable(out.payload))}")
        return json.dumps(kit._jsonable(out))

    return sdk.FunctionTool(name=workflow.name,
                            description=description or workflow.graph.__doc__ or f"Run the {workflow.name} workflow.",
                            params_json_schema=schema, on_invoke_tool=invoke, strict_json_schema=False)


# =================================================================================== sessions ====

class _MemorySessions:
    """Every conversation-memory session of the process in ONE in-memory SQLite database.

    The SDK's ``SQLiteSession(":memory:")`` costs ~64 KiB per session (a private database each,
    PERF.md section 1); here a session is a key into one shared table. Lost on process exit.
    """

    def __init__(self) -> None:
        self.db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        self.db.execute("CREATE TABLE items(id INTEGER PRIMARY KEY AUTOINCREMENT, "
                        "session TEXT NOT NULL, data TEXT NOT NULL)")
        self.db.execute("CREATE INDEX items_session ON items(session, id)")
        self.lock = threading.Lock()  # the engine thread and the kit side may both call in

    def close(self) -> None:
        self.db.close()


class MemorySession(SessionABC):
    """An ``agents.memory.Session`` over the shared in-memory database."""

    def __init__(self, store: _MemorySessions, session_id: str) -> None:
        self.session_id, self.session_settings, self._s = session_id, None, store

    async def get_items(self, limit: int | None = None) -> list[Any]:
        with self._s.lock:
            if limit is None:
                rows = self._s.db.execute("SELECT data FROM items WHERE session=? ORDER BY id",
                                          (self.session_id,)).fetchall()
            else:
                rows = self._s.db.execute(
                    "SELECT data FROM (SELECT id, data FROM items WHERE session=? ORDER BY id DESC "
                    "LIMIT ?) ORDER BY id", (self.session_id, limit)).fetchall()
        return [json.loads(r[0]) for r in rows]

    async def add_items(self, items: list[Any]) -> None:
        rows = [(self.session_id, json.dumps(i, default=str)) for i in items]
        with self._s.lock:
            self._s.db.executemany("INSERT INTO items(session, data) VALUES (?, ?)", rows)

    async def pop_item(self) -> Any:
        with self._s.lock:
            row = self._s.db.execute("SELECT id, data FROM items WHERE session=? ORDER BY id DESC "
                                     "LIMIT 1", (self.session_id,)).fetchone()
            if row is None:
                return None
            self._s.db.execute("DELETE FROM items WHERE id=?", (row[0],))
        return json.loads(row[1])

    async def clear_session(self) -> None:
        with self._s.lock:
            self._s.db.execute("DELETE FROM items WHERE session=?", (self.session_id,))


# ==================================================================================== runtime ====

class Runtime:
    """Plays the deck's runs on one event store; created and opened by ``Deck``.

    Settings are read at ``open()``: ``KIT_STORE`` (when no store is passed in; else
    ``default_store``), ``KIT_SESSION``,
    ``KIT_OPENAI_API``, ``KIT_LEASE_SECONDS``.
    """

    def __init__(self, specs: dict[str, InvocableSpec], *, store: Any = None,
                 session_factory: Callable[[str], Any] | None = None,
                 observers: Sequence[Any] | None = None, default_store: str = "memory",
                 mcp_servers: Sequence[Any] = ()) -> None:
        self.specs, self.store = specs, store
        self._mcp = list(mcp_servers)
        self._mcp_stop: Any = None  # engine side: set to tear the MCP servers down
        self._mcp_done: anyio.Event | None = None
        self._default_store = default_store
        self._observers = observers
        self.hub: Any = None
        self._sdk_tracing = False
        self._own_store = store is None
        self._session_factory = session_factory
        self._sessions: dict[str, Any] = {}
        self._memory: _MemorySessions | None = None
        self._redis: Any = None
        self.engine: EngineThread | None = None
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.active: dict[str, _Run] = {}
        self._tg: Any = None
        self._run_config = sdk.RunConfig(tracing_disabled=True)
        self.graphs: dict[str, Any] = {}  # workflow name -> graph compiled with its checkpointer
        self._seen_request = 0  # the newest control request this deck has looked at
        self._handled: set[int] = set()  # requests made here, acted on already
        self._checkpoint_db: Any = None

    # ------------------------------------------------------------------------ lifecycle --
    async def open(self) -> None:
        env = os.environ
        api = env.get("KIT_OPENAI_API")
        if api is not None and api not in ("responses", "chat_completions"):
            raise ConfigError(f"KIT_OPENAI_API must be 'responses' or 'chat_completions', got {api!r}")
        try:
            self.lease = float(env.get("KIT_LEASE_SECONDS", DEFAULT_LEASE_SECONDS))
        except ValueError:
            raise ConfigError(f"KIT_LEASE_SECONDS must be a number, got {env['KIT_LEASE_SECONDS']!r}") from None
        if not self.lease > 0:
            raise ConfigError(f"KIT_LEASE_SECONDS must be positive, got {self.lease}")
        session_url = env.get("KIT_SESSION")
        if session_url and not session_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"KIT_SESSION must be a redis:// URL, got {session_url!r}")
        if self._own_store:
            self.store = store_from_url(env.get("KIT_STORE", self._default_store))
            await self.store.__aenter__()
        elif not getattr(self.store, "opened", True):
            raise ConfigError("the store passed to Deck(store=...) is not open: open it with "
                              "`async with store:` around the deck (the deck never closes it)")
        try:
            if api is not None:
                sdk.set_default_openai_api(api)  # type: ignore[arg-type]
            if session_url:
                import redis.asyncio
                self._redis = redis.asyncio.from_url(session_url)
            elif self._session_factory is None:
                self._memory = _MemorySessions()
            self.writer = _Writer(self.store)
            await self.store.reap()
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            # Observers start in order before any run; one whose start() raises refuses the open.
            observers = kit_observers.resolve_observers(self._observers, env)
            self.hub = kit_observers.ObserverHub(observers)
            await self.hub.start(self._tg)
            processors = [o.sdk_processor() for o in observers if getattr(o, "sdk_spans", False)]
            if processors:  # the SDK's own spans, as a second trace per run (kit_tracing)
                sdk.set_trace_processors(processors)
                self._sdk_tracing = True
            if sniffio.current_async_library() == "trio":
                self.engine = EngineThread()
                self.engine.start()
                self._tg.start_soon(self.engine.pump, self._on_mail)
            self._tg.start_soon(self.writer.run)
            self._tg.start_soon(self._keep_leases)
            backlog = await self.store.requests()  # older requests are history, not orders
            self._seen_request = backlog[-1].id if backlog else 0
            self._tg.start_soon(self._watch_requests)
            await self._on_engine(self._compile_graphs)
            await self._start_mcp()
        except BaseException:
            await self._teardown()
            raise

    async def close(self) -> None:
        """Cancel the runs still playing (they record ``run.cancelled``), flush, release all."""
        with anyio.CancelScope(shield=True):
            for run in list(self.active.values()):
                run.closing = True
                run.scope.cancel()
            with anyio.move_on_after(CLOSE_TIMEOUT):
                for run in list(self.active.values()):
                    await run.done.wait()
        await self._teardown()

    async def _teardown(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._stop_mcp()  # before the task group ends: the holder task lives there
            if self.engine is not None:
                for item in self.engine.take():
                    await self._on_mail(item)
            if getattr(self, "writer", None) is not None:
                await self.writer.flush()
            if self.hub is not None:
                await self.hub.close()  # before the task group: its drains deliver the backlog
        # The task group must be left from the scope it was entered in, so outside any shield.
        if self._tg is not None:
            tg, self._tg = self._tg, None
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            for run in self.active.values():
                run.done.set()
                run.wake.set()
            if self._sdk_tracing:
                sdk.set_trace_processors([])
            if self._redis is not None:
                await self._on_engine(self._redis.aclose)
            if self._checkpoint_db is not None:
                await self._on_engine(self._checkpoint_db.close)
            if self.engine is not None:
                await self._close_model_clients()
                await self.engine.stop()
            if self._memory is not None:
                self._memory.close()
            if self._own_store and self.store is not None:
                await self.store.aclose()

    async def _compile_graphs(self) -> None:
        """Engine side: compile each workflow with its checkpointer.

        Durable workflows share one ``AsyncSqliteSaver`` on a file beside the log
        (``checkpoint_path``), with ``synchronous=NORMAL`` like the log; with a store that has
        no file, and for the others, each has an in-memory saver.
        """
        from langgraph.checkpoint.memory import InMemorySaver
        path, durable = getattr(self.store, "path", None), None
        path = checkpoint_path(path) if path else None
        for spec in self.specs.values():
            if spec.kind != "workflow":
                continue
            if spec.source.durable and path:
                if durable is None:
                    import aiosqlite
                    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
                    self._checkpoint_db = await aiosqlite.connect(path)
                    await self._checkpoint_db.execute("PRAGMA busy_timeout=5000")
                    await self._checkpoint_db.execute("PRAGMA synchronous=NORMAL")
                    durable = AsyncSqliteSaver(self._checkpoint_db)
                    await durable.setup()
                saver = durable
            else:
                saver = InMemorySaver()
            self.graphs[spec.name] = spec.engine.graph.compile(checkpointer=saver)

    async def _start_mcp(self) -> None:
        """Connect every MCP server of the deck; returns once all are connected.

        One holder task on the engine side connects them and, when ``_stop_mcp`` says so,
        cleans them up: the MCP client's task groups must be left from the task that entered
        them, or the child process may outlive the deck. Raises ``ConfigError`` naming a
        server that fails to start (the ones already started are torn down).
        """
        if not self._mcp:
            return
        ready, done, box = anyio.Event(), anyio.Event(), {}
        engine = self.engine
        to_kit = (lambda fn: engine._token.run_sync_soon(fn)) if engine else (lambda fn: fn())

        async def hold() -> None:  # engine side
            self._mcp_stop = stop = asyncio.Event()
            try:
                async with contextlib.AsyncExitStack() as stack:
                    for server in self._mcp:
                        box["server"] = server.name
                        await server.connect()
                        stack.push_async_callback(server.cleanup)
                    to_kit(ready.set)
                    await stop.wait()
            except Exception as exc:  # reported by _start_mcp, not left to crash the group
                box["error"] = exc
            finally:
                to_kit(ready.set)

        async def holder() -> None:
            try:
                await self._on_engine(hold)
            finally:
                done.set()

        self._mcp_done = done
        self._tg.start_soon(holder)
        await ready.wait()
        if "error" in box:
            exc = box["error"]
            raise ConfigError(f"MCP server {box['server']!r} failed to start: "
                              f"{type(exc).__name__}: {exc}") from exc

    async def _stop_mcp(self) -> None:
        """Tear the MCP servers down (their child processes exit) and wait, bounded."""
        if self._mcp_done is None:
            return
        stop = self._mcp_stop
        if stop is not None:
            if self.engine is not None:
                self.engine.loop.call_soon_threadsafe(stop.set)
            else:
                stop.set()
        with anyio.move_on_after(CLOSE_TIMEOUT):
            await self._mcp_done.wait()
        self._mcp_done = None

    async def _close_model_clients(self) -> None:
        """Under trio, close the deck's model clients on the engine loop before it stops.

        Their pooled connections belong to that loop: once it is gone nothing can close them,
        and the client could not be used on another loop anyway.
        """
        for spec in self.specs.values():
            if spec.kind != "agent":
                continue
            inner = getattr(spec.engine.sdk_agent.model, "_inner", None)
            client = getattr(inner, "_client", None)
            if client is not None and callable(getattr(client, "close", None)):
                with anyio.move_on_after(CLOSE_TIMEOUT):
                    await self.engine.call(client.close)  # type: ignore[union-attr]

    async def _on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await (self.engine.call(fn, *args) if self.engine else fn(*args))

    async def _keep_leases(self) -> None:
        while True:
            await anyio.sleep(self.lease / 3)
            await self.store.renew(self.owner, self.lease)
            await self.store.reap()

    # ----------------------------------------------------------------- event delivery --
    def _record(self, event: Event, claim: Claim | None = None) -> None:
        """Kit side: an event joins the log's next batch and goes to the observers."""
        self.writer.put(event, claim)
        self.hub.emit(event)

    def _deliver(self, run: _Run, event: Event) -> None:
        """Engine side: hand an ordinary event to the kit side (no wait)."""
        if self.engine is None:
            self._record(event)
            run.feed(event)
        else:
            self.engine.post((run, event, None, None), urgent=False)

    async def _deliver_durable(self, run: _Run, event: Event, claim: Claim | None = None) -> None:
        """Engine side: hand an event over (with the run's claim, for a start) and wait until
        it is committed."""
        if self.engine is None:
            await self._commit(run, event, claim)
        else:
            fut = asyncio.get_running_loop().create_future()
            self.engine.post((run, event, fut, claim), urgent=True)
            await fut

    async def _commit(self, run: _Run, event: Event, claim: Claim | None = None) -> None:
        self._record(event, claim)
        await self.writer.flush()
        error = self.writer.failed.pop(run.run_id, None)
        if error is not None:
            raise error
        run.feed(event)

    async def _on_mail(self, item: tuple[_Run, Event, Any, Claim | None]) -> None:
        """Kit side (trio): one item from the engine thread's mailbox."""
        run, event, fut, claim = item
        if fut is None:
            self._record(event)
            run.feed(event)
            return
        try:
            await self._commit(run, event, claim)
        except Exception as exc:
            self.engine.loop.call_soon_threadsafe(_settle, fut, exc)  # type: ignore[union-attr]
        else:
            self.engine.loop.call_soon_threadsafe(_settle, fut, None)  # type: ignore[union-attr]

    # --------------------------------------------------------------------------- turns --
    async def _begin(self, spec: InvocableSpec, input: Any, context: Any, session_id: str | None,
                     namespace: str | None, run_id: str | None, streaming: bool,
                     command: Any = None) -> tuple[_Run, Callable[[], Any], Event]:
        """Check a new run's arguments, write its start (with its claim) and return the run,
        the engine-side job that plays it and its ``run.started``. Refused runs write nothing."""
        for what, value in (("session_id", session_id), ("run_id", run_id)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{what} must be a non-empty str, got {value!r}")
        if namespace is not None:
            kit._check_name("namespace", namespace)
        run = _Run(self, spec, run_id or new_run_id(), context, session_id, namespace, streaming)
        if spec.kind == "agent":
            blocks = kit.as_blocks(input)
            items = spec.engine.to_input(blocks)  # refuses what the engine cannot express
            session = self.session_for(session_id, namespace) if session_id else None
            run_config = self._run_config if not self._sdk_tracing else sdk.RunConfig(
                trace_metadata={"kit.run_id": run.run_id}, group_id=session_id)
            job = functools.partial(_play_agent, run, items, session, run_config)
        else:
            state = spec.engine.to_input(input)
            if spec.source.durable and session_id is None:
                raise ConfigError(f"workflow {spec.name!r} is durable: pass session_id= (its thread id)")
            blocks = (DataBlock(state),)
            run.thread_id = session_id or run.run_id
            run.thread_key = spec.engine.key(namespace, run.thread_id)
            job = functools.partial(_play_workflow, run, self.graphs[spec.name],
                                    state if command is None else command, spec.source.durable)
        started = Event(run.run_id, 0, RunStarted(spec.name, spec.kind, session_id, namespace, blocks),
                        spec.name)
        claim = Claim(run.run_id, self.owner, self.lease, session_id, namespace)
        if session_id is None and run_id is None:
            # Nothing can refuse this start (no session to hold, a fresh id), so it rides in
            # the run's first group commit: a short turn costs one transaction, not two.
            self._record(started, claim)
        else:
            await self.store.append([started], claims=[claim])
            self.hub.emit(started)
        self.active[run.run_id] = run
        return run, job, started

    async def _play(self, run: _Run, job: Callable[[], Any]) -> Event:
        try:
            with run.scope:
                return await (job() if self.engine is None else self.engine.call(job))
            raise DeckStateError("CLOSED", "finish the run")  # the deck's close cancelled it
        finally:
            self.active.pop(run.run_id, None)
            run.done.set()
            run.wake.set()

    async def run(self, spec: InvocableSpec, input: Any, *, context: Any = None,
                  session_id: str | None = None, namespace: str | None = None,
                  run_id: str | None = None) -> Any:
        run, job, _ = await self._begin(spec, input, context, session_id, namespace, run_id, False)
        return _result(run, await self._play(run, job))

    async def stream(self, spec: InvocableSpec, input: Any, *, context: Any = None,
                     session_id: str | None = None, namespace: str | None = None,
                     run_id: str | None = None) -> AsyncIterator[Event]:
        run, job, started = await self._begin(spec, input, context, session_id, namespace, run_id, True)
        self._tg.start_soon(self._play_in_background, run, job)
        yield started
        async with contextlib.aclosing(run.events(after=0)) as events:
            async for event in events:
                yield event
        await run.done.wait()
        if run.error is not None:
            raise run.error

    async def _play_in_background(self, run: _Run, job: Callable[[], Any]) -> None:
        try:
            await self._play(run, job)
        except Exception:  # a failure reaches the stream's consumer (run.error), never the deck
            pass

    async def status(self, run_id: str) -> kit.RunStatus | None:
        if run_id in self.active:
            await self.writer.flush()  # its start may still wait for the group commit
        info = await self.store.run_info(run_id)
        return info.status if info is not None else None

    # -------------------------------------------------------------------- run control --
    async def request(self, run_id: str, action: str, reason: str | None, source: str) -> None:
        """Record a pause/cancel request and return: a run played here is told at once, one
        played elsewhere sees it through its process's poll; a parked run is cancelled here."""
        request_id = await self.store.request(run_id, action, reason, source)
        self._handled.add(request_id)
        await self._act(kit.ControlRequest(request_id, run_id, action, reason, source))

    async def _act(self, req: kit.ControlRequest) -> None:
        run = self.active.get(req.run_id)
        if run is not None:
            if req.action != "resume":
                run.requested = (req.action, req.reason, req.source)
                if run.control is not None:  # a workflow: drain at the next superstep
                    run.control.request_drain(req.action)
        elif req.action == "cancel":
            await self._cancel_parked(req)

    async def _cancel_parked(self, req: kit.ControlRequest) -> None:
        """A parked run has no writer: whoever handles its cancel becomes it (DESIGN 6); of two
        processes racing, the unique ``(run_id, seq)`` lets one write."""
        info = await self.store.run_info(req.run_id)
        if info is None or info.status not in (kit.RunStatus.PAUSED, kit.RunStatus.WAITING_HUMAN,
                                                kit.RunStatus.SLEEPING):
            return
        last = (await self.store.read(req.run_id))[-1]
        events = [Event(req.run_id, last.seq + 1, kit.ControlRequested("cancel", req.reason, req.source),
                        info.name),
                  Event(req.run_id, last.seq + 2, RunCancelled(req.reason), info.name)]
        try:
            await self.store.append(events)
        except kit.LogConflictError:
            return
        for event in events:
            self.hub.emit(event)

    async def resume(self, run_id: str, context: Any) -> list[Event]:
        info = await self.store.run_info(run_id)
        if info is None:
            raise kit.UnknownRunError(run_id)
        spec = self.specs.get(info.name)
        if info.status is not kit.RunStatus.PAUSED or run_id in self.active or spec is None:
            return []
        paused = (await self.store.read(run_id))[-1]
        run = _Run(self, spec, run_id, context, info.session_id, info.namespace, False)
        run.seq = paused.seq + 2
        resumed = [Event(run_id, paused.seq + 1, kit.ControlRequested("resume", None, "api"), spec.name),
                   Event(run_id, paused.seq + 2, RunResumed("resume"), spec.name)]
        try:
            await self.store.append(resumed, claims=[Claim(run_id, self.owner, self.lease,
                                                           info.session_id, info.namespace)])
        except kit.LogConflictError:
            return []  # another caller resumed it first
        for event in resumed:
            self.hub.emit(event)
        self.active[run_id] = run
        if spec.kind == "agent":
            session = self.session_for(info.session_id, info.namespace) if info.session_id else None
            items = [] if session is not None else (paused.payload.items or [])
            job = functools.partial(_play_agent, run, items, session, self._run_config)
        else:
            run.thread_id = info.session_id or run_id
            run.thread_key = spec.engine.key(info.namespace, run.thread_id)
            job = functools.partial(_play_workflow, run, self.graphs[spec.name], None,
                                    spec.source.durable)
        await self._play(run, job)
        return await self.store.read(run_id, after=paused.seq)

    async def _watch_requests(self) -> None:
        """Requests written by other processes (the CLI, replicas): pause/cancel reach the runs
        played here; a resume is taken up by any deck that has the run's invocable (the first
        to write wins); a parked run's cancel is written by whichever deck sees it first."""
        while True:
            await anyio.sleep(CONTROL_POLL)
            for req in await self.store.requests(after=self._seen_request):
                self._seen_request = req.id
                if req.id in self._handled:
                    self._handled.discard(req.id)
                elif req.action == "resume" and req.run_id not in self.active:
                    self._tg.start_soon(self._resume_quietly, req.run_id)
                else:
                    await self._act(req)

    async def _resume_quietly(self, run_id: str) -> None:
        try:
            await self.resume(run_id, None)
        except Exception:  # recorded in the run's log (run.failed); nobody here to tell
            pass

    # --------------------------------------------------------------- parked workflows --
    async def _parked_event(self, run_id: str) -> tuple[kit.RunInfo, Event]:
        info = await self.store.run_info(run_id)
        if info is None:
            raise kit.UnknownRunError(run_id)
        events = await self.store.read(run_id)
        return info, events[-1]

    async def _resume(self, run_id: str, wanted: str, value: Any, by: str, context: Any) -> Any:
        """Resume a parked workflow run (``wanted``: the parking kind it must end with)."""
        status = {"run.interrupted": "WAITING_HUMAN", "run.sleeping": "SLEEPING"}[wanted]
        info, last = await self._parked_event(run_id)
        if last.kind != wanted or run_id in self.active:
            raise kit.RunNotWaitingError(run_id, info.status, status)
        spec = self.specs.get(info.name)
        if spec is None or spec.kind != "workflow":
            raise kit.UnknownNameError(info.name, [n for n, s in self.specs.items() if s.kind == "workflow"])
        from langgraph.types import Command
        parked = last.payload
        run = _Run(self, spec, run_id, context, info.session_id, info.namespace, False)
        run.thread_id = parked.thread_id
        run.thread_key = spec.engine.key(info.namespace, parked.thread_id)
        run.seq = last.seq + 1
        resumed = Event(run_id, run.seq, RunResumed(by), spec.name)
        try:  # (run_id, seq) is unique: of two callers racing to resume, one gets this conflict
            await self.store.append([resumed], claims=[Claim(run_id, self.owner, self.lease,
                                                              info.session_id, info.namespace)])
        except kit.LogConflictError:
            raise kit.RunNotWaitingError(run_id, "being resumed by another caller", status) from None
        self.hub.emit(resumed)
        self.active[run_id] = run
        job = functools.partial(_play_workflow, run, self.graphs[spec.name],
                                Command(resume={parked.interrupt_id: value}), spec.source.durable)
        return _result(run, await self._play(run, job))

    async def answer(self, run_id: str, value: Any, context: Any) -> Any:
        return await self._resume(run_id, "run.interrupted", value, "answer", context)

    async def pending(self) -> list[kit.Pending]:
        out = []
        for info in await self.store.runs(status=kit.RunStatus.WAITING_HUMAN):
            last = (await self.store.read(info.run_id))[-1]
            if isinstance(last.payload, kit.RunInterrupted):
                out.append(kit.Pending(info.run_id, info.name, last.payload.thread_id or "",
                                       info.session_id, last.payload.payload, last.at))
        return out

    async def _due(self, now: datetime) -> list[tuple[kit.Due, str, str | None]]:
        """Due threads with the interrupt to resume and their namespace, read from each
        workflow's checkpointer, matched with the parked runs of the log."""
        parked: dict[str, str] = {}
        for info in await self.store.runs(status=kit.RunStatus.SLEEPING):
            last = (await self.store.read(info.run_id))[-1]
            spec = self.specs.get(info.name)
            if spec is not None and isinstance(last.payload, kit.RunSleeping):
                parked[spec.engine.key(info.namespace, last.payload.thread_id or "")] = info.run_id
        savers = {id(g.checkpointer): g.checkpointer for g in self.graphs.values()}
        found = []
        for saver in savers.values():
            found += await self._on_engine(_sleeping, saver)
        out = []
        for key, intr in found:
            name, namespace, thread_id = key.split(":", 2)
            until = datetime.fromisoformat(intr.value["until"])
            if name in self.graphs and until <= now:
                out.append((kit.Due(name, thread_id, until, parked.get(key)), intr.id, namespace or None))
        return out

    async def due_resumes(self, now: datetime) -> list[kit.Due]:
        return [due for due, _, _ in await self._due(now)]

    async def tick(self, now: datetime) -> list[kit.Ticked]:
        """Resume every due thread once. A thread whose parked run is in the log is resumed
        through that run (two tickers race on its next seq: one wins); one without (its run
        was never recorded) gets a new run that claims the thread, so a second ticker gets
        ``SessionBusyError`` and skips it."""
        from langgraph.types import Command
        woke = {"woke_at": now.isoformat()}
        out = []
        for due, interrupt_id, namespace in await self._due(now):
            try:
                if due.run_id is not None:
                    result = await self._resume(due.run_id, "run.sleeping", woke, "tick", None)
                else:
                    run, job, _ = await self._begin(
                        self.specs[due.workflow], {}, None, due.thread_id, namespace, None, False,
                        command=Command(resume={interrupt_id: woke}))
                    result = _result(run, await self._play(run, job))
            except (kit.RunNotWaitingError, SessionBusyError):
                continue  # another ticker (or a live run) has this thread
            out.append(kit.Ticked(due.workflow, due.thread_id, result))
        return out

    async def child_workflow(self, parent: _Run, name: str, args: dict[str, Any]) -> Any:
        """Engine side: play workflow ``name`` as a child run of ``parent`` (a tool call)."""
        spec = self.specs[name]
        state = spec.engine.to_input(args)  # a child's thread is its own run id
        run = _Run(self, spec, new_run_id(), parent.data, None, parent.namespace, False)
        run.origin = f"{parent.origin}/{name}"
        run.thread_id = run.run_id
        run.thread_key = spec.engine.key(parent.namespace, run.run_id)
        started = Event(run.run_id, 0, RunStarted(name, "workflow", None, parent.namespace,
                                                  (DataBlock(state),), parent.run_id), run.origin)
        await self._deliver_durable(run, started, Claim(run.run_id, self.owner, self.lease))
        return _result(run, await _play_workflow(run, self.graphs[name], state, spec.source.durable))

    def session_for(self, session_id: str, namespace: str | None = None) -> Any:
        key = session_id if namespace is None else f"{namespace}:{session_id}"
        session = self._sessions.get(key)
        if session is None:
            if self._session_factory is not None:
                session = self._session_factory(key)
            elif self._redis is not None:
                from agents.extensions.memory.redis_session import RedisSession
                session = RedisSession(key, redis_client=self._redis, key_prefix="kit:session")
            else:
                session = MemorySession(self._memory, key)  # type: ignore[arg-type]
            self._sessions[key] = session
        return session


def _settle(fut: asyncio.Future[Any], exc: BaseException | None) -> None:
    if not fut.done():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
