"""kit_runtime: the Runtime that plays runs and records them in the log.

Owns: runs (a ``_Run`` per run: its seqs, its live buffer for streams), the one write path of
events (``Runtime._put`` / ``Runtime._write``: the writer's group commit to the store, then the
observers, with the run's live readers fed on the way), session claims (through the store), run
control (pause, cancel, resume; parked runs), parked workflows (answer, pending, due, tick), child
runs, and the lifecycle of what a deck holds open: the store it built, the observers, the engines'
graphs and sessions, the MCP servers, the trio bridge.

Must never: speak HTTP or read argv; print, log or persist the application context; hand an
engine anything but a ``RunHandle`` (engines never see the Runtime or the store).

Theory of operation
-------------------
There are two sides. The *kit side* is the event loop that opened the deck (asyncio or trio): it
owns the store, the writer and the streams. The *engine side* is where SDK objects live: the same
loop under asyncio; under trio, one asyncio loop in a daemon thread (kit_bridge), because
openai-agents and LangGraph are asyncio-only (notes/ENGINES.md section 9).

An engine records a run through its handle: ``emit`` for an ordinary event, ``durable`` for one it
must see committed before it goes on (``tool.started``; every end of a run). The event gets its
``seq`` on the engine side, in the engine's own order, and reaches the kit side directly under
asyncio, or through the bridge's mailbox under trio (one wake-up per batch, never per event).
On the kit side every event takes one path, ``_put``: into the writer's buffer, and into the run's
live buffer when someone streams it. The writer group-commits: one ``store.append`` per batch
(``FLUSH_MAX`` events, or ``FLUSH_DELAY`` after the first), never one commit per token (PERF.md
section 3), and feeds the observers what each append committed. ``_write`` is ``_put`` plus a
commit now, raising what the store refused (a busy session, a fenced seq, a value it cannot
hold) for that run alone. A write the store may refuse for its seq (a caller's own run id, a
take-over of a parked run) is fenced here too (``_fence``): one per run id at a time in a deck,
so two callers racing for one run never share a batch, whose refusal would cost both. The ids
callers give are checked before anything is written (``check_id``); what kit reads back from
its own log is not checked again.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import socket
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import sniffio

import kit_observers
import kit_workflows
from kit_bridge import Bridge
from kit_core import (
    CheckpointMissingError, Claim, ConfigError, ControlRequest, ControlRequested, DeckStateError,
    Due, Event, InterruptResult, InvocableSpec, LogConflictError, ModelCompleted, Pending,
    RunCancelled, RunCompleted, RunInterrupted, RunNotWaitingError, RunPaused, RunHandle,
    RunResumed, RunSleeping, RunStarted, NewRunId, RunStatus, RunStoppedError, SessionBusyError,
    StoreUnavailableError, Ticked, TurnResult, UnknownNameError, UnknownRunError, as_blocks,
    as_history, check_id, check_name, check_text, count_setting, new_run_id,
)
from kit_pg import store_from_url
from kit_writer import BACKLOG_MAX, STORE_DOWN_LIMIT, Writer

if TYPE_CHECKING:
    import kit_sessions

__all__ = ("Runtime", "CONTROL_RETRY", "LIVE_MAX", "DEFAULT_LEASE_SECONDS", "CLOSE_TIMEOUT",
           "BACKOFF_MAX", "ACT_TRIES", "ORPHAN_SCAN")

#: The control-request watcher follows the store (``follow_requests``), so a pause or cancel
#: written anywhere reaches the run's next safe point as soon as the store hears of it; when
#: following fails (the store is down) it starts again after this long, backing off.
CONTROL_RETRY = 0.1
#: A stream's live buffer. A consumer that falls this far behind is not allowed to grow memory:
#: its buffer is dropped and it catches up from the log (which has every event) instead.
LIVE_MAX = 10_000
#: A live run's lease; renewed every third of it. A process that dies stops renewing, and after
#: this long its runs are recorded as abandoned and their sessions freed (DESIGN 4.5).
DEFAULT_LEASE_SECONDS = 30.0
#: How long closing the deck waits for cancelled runs to record their end; also how long a
#: cancelled run waits for its ``run.cancelled`` to commit before its caller goes on.
CLOSE_TIMEOUT = 10.0
#: A background loop (lease renewal, the control watcher) that fails backs off up to this long
#: between tries (seconds), logging once per burst; it never takes the deck down.
BACKOFF_MAX = 30.0
#: How many times in a row the deck tries to act on one control request recorded elsewhere (a
#: parked run's cancel, a resume) while the store fails: with the backoff above, half a minute
#: of a store gone for a moment is ridden out; then the request is logged and passed over, so
#: one that can never be acted on does not hold up the ones after it.
ACT_TRIES = 5
#: How often (seconds) ``tick`` scans the checkpointers whole for threads asleep that no run of
#: the log parks (a process died between a sleep's checkpoint and its ``run.sleeping``); every
#: other tick reads only the sleeping runs' threads, whatever the checkpointers' history.
ORPHAN_SCAN = 600.0
_PARKED = (RunStatus.PAUSED, RunStatus.WAITING_HUMAN, RunStatus.SLEEPING)
_SKIPPED = object()  # a due thread another ticker has
_log = logging.getLogger("kit.runtime")


# ======================================================================================= runs ====

class _Run(RunHandle):
    """One run being played: the engine's handle, plus the kit side's live buffer and end.

    ``feed`` and ``events`` are called on the kit side; the rest is the engine's (``RunHandle``).
    ``committed`` is the seq up to which the run's events are durable (kept for streamed runs);
    a reader that acknowledges events outside the process reads only up to it.
    """

    def __init__(self, spec: InvocableSpec, run_id: str, data: Any, session_id: str | None,
                 namespace: str | None, streaming: bool, *, deliver: Any, commit: Any, pace: Any,
                 read: Callable[[str, int], Any], writer: Writer) -> None:
        super().__init__(run_id, spec.name, data, deliver=deliver, commit=commit, pace=pace,
                         session_id=session_id, namespace=namespace, streaming=streaming)
        self.spec, self._read, self._writer = spec, read, writer
        self.parent: str | None = None  # a child run (workflow-as-tool) ends with its parent
        self.live: deque[Event] | None = deque() if streaming else None
        self.committed = -1
        self.wake = anyio.Event()
        self.lagged = False
        self.commit_reader = False  # its reader waits for commits, not for events
        self.done = anyio.Event()
        self.scope = anyio.CancelScope()
        # Under trio, a run played through ``Bridge.call``: its end (terminal or parking) is
        # posted without a round trip and committed by ``_played`` before its caller hears.
        self.ends_on_kit = False

    def feed(self, event: Event) -> None:
        if self.live is None:
            return
        if len(self.live) >= LIVE_MAX:  # the consumer stalled: it will catch up from the log
            self.live.clear()
            self.lagged = True
        self.live.append(event)
        if self.commit_reader:
            self._writer.hurry()  # the reader waits for this one: HURRY_DELAY, not FLUSH_DELAY
        else:
            self.wake.set()

    def on_commit(self, seq: int) -> None:
        self.committed = seq
        self.wake.set()

    async def events(self, after: int, committed: bool = False) -> AsyncIterator[Event]:
        """Kit side: this run's events after ``after``, live, until a terminal/parking one;
        with ``committed``, each only once it is durable."""
        last, self.commit_reader = after, committed

        def ready() -> int:
            live = self.live
            return len(live) if not committed else _count_upto(live, self.committed)  # type: ignore[arg-type]

        while True:
            if self.lagged:
                self.lagged = False
                backlog = await self._read(self.run_id, last)
            else:
                n = ready()
                if not n:
                    if self.done.is_set() and (not self.live or self.abort_error is not None
                                               or not self._writer.holds(self.run_id)):
                        # The run is over and what is left will not commit now: an aborted
                        # run's tail waits for the store; a refused one is not the log's.
                        return
                    if self.live:
                        self._writer.hurry()  # what is left waits for its commit: commit soon
                    self.wake = anyio.Event()
                    if not ready() and not (self.done.is_set() and not self.live):
                        await self.wake.wait()
                    continue
                backlog = [self.live.popleft() for _ in range(n)]  # type: ignore[union-attr]
            for ev in backlog:
                if ev.seq <= last:
                    continue
                last = ev.seq
                yield ev
                if ev.payload.ends:
                    return


class _OnEngine:
    """A session handed to a caller under trio: its coroutine methods run on the engine's
    asyncio loop, where the SDK's sessions and their connections live (the SDK's file session
    calls ``asyncio.to_thread``, which needs that loop); ``session`` is the SDK's object."""

    def __init__(self, session: Any, on_engine: Callable[..., Any]) -> None:
        self.session, self._on_engine = session, on_engine

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.session, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def on_engine(*args: Any, **kwargs: Any) -> Any:
            return await self._on_engine(functools.partial(attr, *args, **kwargs))
        return on_engine


def _check_ids(session_id: Any, run_id: Any) -> None:
    """A new run's ids, as its caller gave them (``check_id``): refused before anything is
    written."""
    for what, value in (("session_id", session_id), ("run_id", run_id)):
        if value is not None:
            check_id(what, value)


def _seconds(env: Any, name: str, default: float) -> float:
    """A positive number of seconds from setting ``name``; ``ConfigError`` naming it otherwise."""
    raw = env.get(name)
    try:
        value = default if raw is None else float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ConfigError(f"{name} must be positive, got {raw!r}")
    return value


def _count_upto(live: deque[Event], seq: int) -> int:
    """How many events at the front of ``live`` have a seq at most ``seq``."""
    n = 0
    for ev in live:
        if ev.seq > seq:
            break
        n += 1
    return n


def _result(run: _Run, end: Event) -> Any:
    """What a run returns to its caller, from its last event."""
    p = end.payload
    if isinstance(p, RunCompleted):
        if run.spec.kind == "agent":
            return TurnResult(p.output, p.usage, run.run_id, run.session_id)
        return p.output
    if isinstance(p, (RunInterrupted, RunSleeping)):
        payload = p.payload if isinstance(p, RunInterrupted) else {"kind": "sleep", "until": p.until}
        thread_id = p.thread_id or run.thread_id
        return InterruptResult(payload, thread_id, run_id=run.run_id)  # type: ignore[arg-type]
    if isinstance(p, RunPaused):
        raise RunStoppedError(run.run_id, RunStatus.PAUSED, p.reason)
    raise RunStoppedError(run.run_id, RunStatus.CANCELLED, getattr(p, "reason", None))


# ==================================================================================== runtime ====

class Runtime:
    """Plays the deck's runs on one event store; created and opened by ``Deck``.

    Settings are read at ``open()``: ``KIT_STORE`` (when no store is passed in; else
    ``default_store``), ``KIT_SESSION``, ``KIT_OPENAI_API``, ``KIT_LEASE_SECONDS``.
    """

    def __init__(self, specs: dict[str, InvocableSpec], *, store: Any = None,
                 session_factory: Callable[[str], Any] | None = None,
                 observers: Sequence[Any] | None = None, default_store: str = "memory",
                 mcp_servers: Sequence[Any] = ()) -> None:
        self.specs, self.store = specs, store
        # The agents engine (and with it the agents SDK: ~1.4 s and ~45 MB to import) only for
        # a deck with an agent or an MCP server: a workflow-only deck never loads it.
        self._agents: Any = None
        if mcp_servers or any(spec.kind == "agent" for spec in specs.values()):
            import kit_agents
            self._agents = kit_agents
        self._mcp: Any = None
        if mcp_servers:
            import kit_mcp_servers  # beside kit_agents: it imports the agents SDK too
            self._mcp = kit_mcp_servers.ServerHolder(mcp_servers, self._to_kit)
        self._mcp_done: anyio.Event | None = None
        self._default_store = default_store
        self._observers = observers
        self.hub: Any = None
        self._sdk_tracing = False
        self._own_store = store is None
        self._session_factory = session_factory
        self.sessions: kit_sessions.Sessions | None = None
        self.bridge: Bridge | None = None
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.active: dict[str, _Run] = {}
        self._fenced: set[str] = set()  # run ids a fenced write is in flight for (``_fence``)
        self._closing = False
        self._streams: dict[str, _Run] = {}  # streamed runs: their commits wake their readers
        self._tg: Any = None
        self.graphs: dict[str, Any] = {}  # workflow name -> graph compiled with its checkpointer
        self._close_graphs: Any = None
        self._thread_locks: Any = None  # kit_workflows.ThreadLocks: one ticker per thread
        self._seen_request = 0  # the newest control request this deck has acted on
        self._handled: set[int] = set()  # requests made here, acted on already
        self._failing = (0, 0)  # (request id, failed tries) of a request the store failed
        self._orphans: dict[str, str] = {}  # sleeping thread keys no log run parks -> workflow
        self._orphans_at = 0.0  # when tick next scans the checkpointers for them

    # ------------------------------------------------------------------------ lifecycle --
    async def open(self) -> None:
        env = os.environ
        self.lease = _seconds(env, "KIT_LEASE_SECONDS", DEFAULT_LEASE_SECONDS)
        self.down_limit = _seconds(env, "KIT_STORE_DOWN_SECONDS", STORE_DOWN_LIMIT)
        if self._agents is not None:
            import kit_sessions  # it imports the agents SDK too: only beside kit_agents
            self._agents.use_api(env.get("KIT_OPENAI_API"))
            kept = count_setting("KIT_SESSION_MAX", env.get("KIT_SESSION_MAX"))
            self.sessions = kit_sessions.Sessions(env.get("KIT_SESSION"), self._session_factory,
                                                  kept or kit_sessions.MAX_SESSIONS)
        try:
            if self._own_store:
                self.store = store_from_url(env.get("KIT_STORE", self._default_store),
                                            sqlite_sync=env.get("KIT_SQLITE_SYNC"))
                await self.store.__aenter__()
            elif not getattr(self.store, "opened", True):
                raise ConfigError("the store passed to Deck(store=...) is not open: open it with "
                                  "`async with store:` around the deck (the deck never closes it)")
            elif getattr(self.store, "read_only", False):
                raise ConfigError(f"the store passed to Deck(store=...), {self.store!r}, was "
                                  "opened read-only: a deck writes its runs to its store")
            await self._start(env)
        except BaseException:
            await self._teardown()
            raise

    async def _start(self, env: Any) -> None:
        observers = kit_observers.resolve_observers(self._observers, env)
        self.hub = kit_observers.ObserverHub(observers)
        self.writer = Writer(self.store, self._committed, self._give_up, down_limit=self.down_limit,
                             refused=self._refused)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        # Observers start in order before any run; one whose start() raises refuses the open.
        await self.hub.start(self._tg)
        await self._reap()  # runs a dead process left: abandoned, and observed as such
        processors = [o.sdk_processor() for o in observers if getattr(o, "sdk_spans", False)]
        if processors and self._agents is not None:  # the SDK's own spans, a second trace per run
            self._sdk_tracing = self._agents.use_trace_processors(processors)
        if sniffio.current_async_library() == "trio":
            self.bridge = Bridge()
            self.bridge.start()
            self._tg.start_soon(self.bridge.pump, self._on_mail)
        self._tg.start_soon(self.writer.run)
        # A renewal that fails is tried again well within the lease (a backoff past it would
        # let another process reap this one's live runs as abandoned).
        self._tg.start_soon(self._every, self.lease / 3, self._keep_leases, "renewing leases",
                            self.lease / 6)
        backlog = await self.store.requests()  # older requests are history, not orders
        self._seen_request = backlog[-1].id if backlog else 0
        self._tg.start_soon(self._every, CONTROL_RETRY, self._watch_requests,
                            "following control requests")
        if self.sessions is not None:
            await self._on_engine(self.sessions.open)
        self.graphs, self._close_graphs, self._thread_locks = await self._on_engine(
            kit_workflows.open_graphs, list(self.specs.values()), getattr(self.store, "url", None))
        await self._start_mcp()
        if any(spec.kind == "agent" for spec in self.specs.values()):
            await self._on_engine(self._agents.warm_up, list(self.specs.values()))

    async def close(self) -> None:
        """Cancel the runs still playing (they record ``run.cancelled``), flush, release all."""
        self._closing = True  # no run starts or is taken over from now on (``_new_run``)
        with anyio.CancelScope(shield=True):
            runs = list(self.active.values())
            for run in runs:
                run.closing = True  # each records that the deck closed, not that its caller left
                if run.parent is None:  # children end with their parents
                    run.scope.cancel()
            with anyio.move_on_after(CLOSE_TIMEOUT):
                for run in runs:  # children too: the flush below must find their ends buffered
                    # (the SDK may let a cancelled tool finish after its agent's run returned)
                    await (run.done.wait() if run.parent is None else self._on_engine(run.done.wait))
        await self._teardown()

    async def _teardown(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._stop_mcp()  # before the task group ends: the holder task lives there
            if getattr(self, "writer", None) is not None:
                await self._drain_mail()
                with anyio.move_on_after(CLOSE_TIMEOUT):  # a store that is down: the lease tells
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
                if run.parent is None:
                    run.done.set()
                    run.wake.set()
            if self._sdk_tracing:
                self._agents.use_trace_processors([])
            if self.sessions is not None:
                await self._on_engine(self.sessions.aclose)
            if self._close_graphs is not None:
                await self._on_engine(self._close_graphs)
            if self.bridge is not None:
                clients = self._agents.model_clients(list(self.specs.values())) if self._agents else []
                for client in clients:
                    with anyio.move_on_after(CLOSE_TIMEOUT):  # pooled connections of its loop
                        await self.bridge.call(client.close)
                await self.bridge.stop()
            if self._own_store and self.store is not None:
                await self.store.aclose()

    async def _start_mcp(self) -> None:
        """Connect every MCP server of the deck (``ServerHolder``, on the engine side); returns
        once all are connected. Raises ``ConfigError`` naming a server that fails to start (the
        ones already started are torn down)."""
        if self._mcp is None:
            return
        holder, done = self._mcp, anyio.Event()

        async def hold() -> None:
            try:
                await self._on_engine(holder.hold)
            finally:
                done.set()

        self._mcp_done = done
        self._tg.start_soon(hold)
        await holder.ready.wait()
        if holder.error is not None:
            raise ConfigError(f"MCP server {holder.failed!r} failed to start: "
                              f"{type(holder.error).__name__}: {holder.error}") from holder.error

    async def _stop_mcp(self) -> None:
        """Tear the MCP servers down (their child processes exit) and wait, bounded."""
        if self._mcp_done is None:
            return
        self._soon(self._mcp.stop)  # type: ignore[union-attr]
        with anyio.move_on_after(CLOSE_TIMEOUT):
            await self._mcp_done.wait()
        self._mcp_done = None

    async def _on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Kit side: ``await fn(*args)`` on the engine side."""
        return await (self.bridge.call(fn, *args) if self.bridge else fn(*args))

    def _soon(self, fn: Callable[[], Any]) -> None:
        """Kit side: call ``fn()`` on the engine side, soon."""
        self.bridge.soon(fn) if self.bridge else fn()

    def _to_kit(self, fn: Callable[[], Any]) -> None:
        """Engine side: call ``fn()`` on the kit side, soon."""
        self.bridge.to_kit(fn) if self.bridge else fn()

    async def _every(self, seconds: float, step: Callable[[], Any], what: str,
                     most: float = BACKOFF_MAX) -> None:
        """Call ``step`` every ``seconds``, forever. A failing step (a store that is down or
        locked) is logged once per burst and retried with backoff, up to ``most`` apart; it
        never ends the loop, and never the deck. A step that runs for good (the control watch)
        and fails after working for longer than it last waited starts a new burst: its backoff
        does not ratchet up to ``most`` over a process's life."""
        delay = seconds
        while True:
            await anyio.sleep(delay)
            started = anyio.current_time()
            try:
                await step()
            except Exception as exc:
                if anyio.current_time() - started > delay:  # it had been working again
                    delay = seconds
                if delay == seconds:
                    _log.warning("%s failed (%s: %s); retrying with backoff", what,
                                 type(exc).__name__, exc)
                delay = min(max(delay * 2, 1.0), most)
            else:
                if delay != seconds:
                    _log.warning("%s works again", what)
                delay = seconds

    async def _keep_leases(self) -> None:
        """Renew the leases of the runs still played here (or with events still to commit),
        and only those; reap runs whose owner stopped renewing."""
        live = set(self.active) | self.writer.pending_runs()
        await self.store.renew(self.owner, self.lease, sorted(live))
        await self._reap()

    async def _reap(self) -> None:
        """Record the runs whose owner stopped renewing as abandoned (the store writes their
        ``run.failed`` in the transaction that frees their claims); the observers get it too."""
        for run_id in await self.store.reap():
            self._committed((await self.store.read(run_id))[-1:])

    # ------------------------------------------------------------------ the write path --
    def _put(self, run: _Run | None, event: Event, claim: Claim | None = None) -> None:
        """Kit side: the one way an event enters the log: the writer's next batch (observers and
        committed readers get it once it is durable), and the run's live buffer at once."""
        self.writer.put(event, claim)
        if run is not None:
            run.feed(event)

    async def _write(self, run: _Run | None, events: Sequence[Event], claim: Claim | None = None) -> None:
        """Kit side: ``_put`` the events (the claim with the first), then commit now. Raises what
        the store refused for this run (``SessionBusyError``, ``LogConflictError``): then none of
        its buffered events is in the log."""
        for i, event in enumerate(events):
            self._put(run, event, claim if i == 0 else None)
        await self._flushed(events[0].run_id)

    async def _flushed(self, run_id: str) -> None:
        await self.writer.flush()
        error = self.writer.failed.pop(run_id, None)
        if error is not None:
            raise error

    async def _read_committed(self, run_id: str, after: int) -> list[Event]:
        """Kit side: commit what is buffered, then read the run's events after ``after``."""
        await self.writer.flush()
        return await self.store.read(run_id, after)

    def _committed(self, events: Sequence[Event]) -> None:
        """The writer committed ``events``: the observers get them, streamed runs' readers may
        send them."""
        for event in events:
            self.hub.emit(event)
        if self._streams:
            for event in events:
                run = self._streams.get(event.run_id)
                if run is not None:
                    run.on_commit(event.seq)

    def _give_up(self, run_ids: set[str], error: BaseException, seconds: float) -> None:
        """The store took no writes for ``seconds``: stop the runs stuck behind it, visibly.
        Each records ``run.failed`` (written with the rest once the store is back) and its
        caller gets ``StoreUnavailableError``; a run whose end waits in the buffer already keeps
        it, and its caller is told so (``outcome="ended"``: a retry would play it twice)."""
        for run_id in run_ids:
            run = self.active.get(run_id)
            if run is not None and run.parent is None and run.abort_error is None:
                run.abort_error = StoreUnavailableError(
                    run_id, seconds, error, outcome="ended" if run.ended else "stopped")
                run.scope.cancel()

    def _refused(self, run_id: str, error: BaseException) -> None:
        """The store refused events of ``run_id``. A run playing here stops now, its caller
        told why: another writer owns it (a process that reaped it as abandoned while this one
        could not renew its lease), or it made a value the store cannot hold; whatever it did
        next would be written around the hole its refused events left. (A fenced write's
        refusal goes to the caller waiting for it, ``_flushed``: that run is not playing yet.)"""
        run = self.active.get(run_id)
        if run is not None and run.parent is None and run.abort_error is None:
            run.abort_error = error
            run.scope.cancel()

    async def _drain_mail(self) -> None:
        """Kit side (trio): put what the engine side has posted and the pump has not taken yet
        (in order: the pump puts each batch it takes without yielding in between)."""
        if self.bridge is not None:
            for item in self.bridge.take():
                await self._on_mail(item)

    def _deliver(self, run: RunHandle, event: Event) -> None:
        """Engine side: an ordinary event, to the kit side (no wait)."""
        if self.bridge is None:
            self._put(run, event)  # type: ignore[arg-type]
        else:
            self.bridge.post(((run, event, None), None))

    async def _commit(self, run: RunHandle, event: Event, claim: Claim | None = None) -> None:
        """Engine side: an event (with the run's claim, for a start), committed before this
        returns."""
        if self.bridge is None:
            await self._write(run, [event], claim)  # type: ignore[arg-type]
        elif event.payload.ends is not None and getattr(run, "ends_on_kit", False):
            self.bridge.post(((run, event, claim), None))  # the engine returns next: _played
        else:
            await self.bridge.post_and_wait((run, event, claim))

    async def _pace(self) -> None:
        """Engine side: let others run; wait while the writer's backlog (and, under trio, the
        bridge's mailbox) is full, so a run stays about a batch ahead of its log at most."""
        if self.bridge is None:
            if self.writer.pending >= BACKLOG_MAX:
                await self.writer.room()
            else:
                await anyio.lowlevel.checkpoint()
        elif self.writer.pending + self.bridge.backlog >= BACKLOG_MAX:
            await self.bridge.post_and_wait(None)  # answered once the writer has room
        else:
            await anyio.lowlevel.checkpoint()

    async def _on_mail(self, item: tuple[tuple[_Run, Event, Claim | None] | None, Any]) -> None:
        """Kit side (trio): one item from the bridge's mailbox: an event to put, and a reply to
        settle once it is committed (or, for ``None``, once the writer has room). Never waits
        itself, so the pump keeps every run's events flowing in order."""
        what, reply = item
        if what is not None:
            run, event, claim = what
            self._put(run, event, claim)
        if reply is not None:
            self._tg.start_soon(self._settle, None if what is None else what[1].run_id, reply)

    async def _settle(self, run_id: str | None, reply: Any) -> None:
        try:
            await (self.writer.room() if run_id is None else self._flushed(run_id))
        except Exception as exc:
            self.bridge.settle(reply, exc)  # type: ignore[union-attr]
        else:
            self.bridge.settle(reply, None)  # type: ignore[union-attr]

    def _new_run(self, spec: InvocableSpec, run_id: str, data: Any, session_id: str | None,
                 namespace: str | None, streaming: bool = False) -> _Run:
        if self._closing:  # a stream made while open, iterated after: refused before any write
            raise DeckStateError("CLOSED", "start or resume a run")
        run = _Run(spec, run_id, data, session_id, namespace, streaming, deliver=self._deliver,
                   commit=self._commit, pace=self._pace, read=self._read_committed,
                   writer=self.writer)
        run.start_child = self._child
        if spec.kind == "workflow":
            run.thread_id = session_id or run_id
            run.thread_key = spec.engine.key(namespace, run.thread_id)
        if streaming:  # a racing caller of the same id may be here first: _hold settles it
            self._streams.setdefault(run_id, run)
        return run

    def _hold(self, run: _Run, seq: int) -> None:
        """``run`` holds its id now (its fenced start or take-over committed at ``seq``): it is
        the run the id's commits wake, even if a caller that lost the race registered first."""
        self.active[run.run_id] = run
        if run.live is not None:
            self._streams[run.run_id] = run
            run.on_commit(seq)

    def _unstream(self, run: _Run) -> None:
        """``run`` ended, or never got its id: its commits wake no reader any more."""
        if self._streams.get(run.run_id) is run:
            del self._streams[run.run_id]

    def _claim(self, run: _Run) -> Claim:
        return Claim(run.run_id, self.owner, self.lease, run.session_id, run.namespace)

    @contextlib.contextmanager
    def _fence(self, run_id: str, seq: int) -> Iterator[None]:
        """Around a fenced write (a caller's run id, a take-over, a parked run's cancel): one
        per run id at a time in this deck, and none for a run played here. A second caller
        racing for the id is refused (``LogConflictError``) before it writes anything, as the
        store refuses one from another process: in one group commit the store would refuse
        both writes, and the first caller would play on without its first event."""
        if run_id in self._fenced or run_id in self.active:
            raise LogConflictError(run_id, seq)
        self._fenced.add(run_id)
        try:
            yield
        finally:
            self._fenced.discard(run_id)

    # --------------------------------------------------------------------------- turns --
    async def _begin(self, spec: InvocableSpec, input: Any, context: Any, session_id: str | None,
                     namespace: str | None, run_id: str | None, streaming: bool,
                     command: Any = None, history: Any = None
                     ) -> tuple[_Run, Callable[[], Any], Event]:
        """Check a new run's arguments, write its start (with its claim) and return the run,
        the engine-side job that plays it and its ``run.started``. Refused runs write nothing.
        The caller's ids are checked by ``run``/``stream`` (``_check_ids``); a tick's thread id
        comes from the checkpointer, where an id from before ``check_id`` may still be."""
        history = as_history(history)
        if history and (spec.kind != "agent" or session_id is not None):
            raise ConfigError("history= is for a one-off agent turn: a session or a workflow's "
                              "thread holds its own history")
        if namespace is not None:
            check_name("namespace", namespace)
        fenced = session_id is not None or (run_id is not None and type(run_id) is not NewRunId)
        run = self._new_run(spec, str(run_id or new_run_id()), context, session_id, namespace,
                            streaming)
        if spec.kind == "agent":
            blocks = as_blocks(input)
            items = spec.engine.to_input(blocks, history)  # refuses what it cannot express
            session = self.sessions.get(session_id, namespace) if session_id else None  # type: ignore[union-attr]
            job = functools.partial(spec.engine.play, run, items, session,
                                    self._agents.run_config(self._sdk_tracing, run.run_id, session_id))
        else:
            block = spec.engine.to_input(input)
            if spec.engine.durable and session_id is None:
                raise ConfigError(f"workflow {spec.name!r} is durable: pass session_id= (its thread id)")
            blocks = (block,)
            job = functools.partial(spec.engine.play, run, self.graphs[spec.name],
                                    block.data if command is None else command)
        started = Event(run.run_id, 0, RunStarted(spec.name, spec.kind, session_id, namespace, blocks,
                                                  history=history), spec.name)
        try:
            await self._start_run(run, started, fenced)
        except BaseException:
            self._unstream(run)
            raise
        self.active[run.run_id] = run
        return run, job, started

    async def _start_run(self, run: _Run, started: Event, fenced: bool) -> None:
        """Write a run's start, with its claim. A start that something could refuse (a session
        to hold, a caller's run id that is not a ``NewRunId``) is committed now, so a refusal
        writes nothing and reaches the caller; any other rides in the run's first group commit
        (one transaction per short turn). While the store is down the start waits
        (``StoreUnavailableError`` after the stated bound, with the run recorded as failed once
        the store is back)."""
        down = self.writer.down_since
        if down is not None and anyio.current_time() - down >= self.down_limit:
            raise StoreUnavailableError(run.run_id, anyio.current_time() - down,
                                        outcome="not started")
        if fenced or self.writer.pending >= BACKLOG_MAX:  # something to wait for: a bounded wait
            with anyio.move_on_after(self.down_limit) as waiting:
                await self.writer.room()
                if fenced:
                    with self._fence(run.run_id, started.seq):
                        await self._write(run, [started], self._claim(run))
                        self._hold(run, started.seq)
                    return
            if waiting.cancelled_caught:
                if not self.writer.holds(run.run_id):
                    raise StoreUnavailableError(run.run_id, self.down_limit, outcome="not started")
                error = StoreUnavailableError(run.run_id, self.down_limit)
                self._put(run, Event(run.run_id, 1, run.failure(error), run.origin))  # its start
                raise error  # will be written: so is its end
        self._put(run, started, self._claim(run))

    async def _play(self, run: _Run, job: Callable[[], Any]) -> Event:
        try:
            with run.scope:
                return await (job() if self.bridge is None else self._played(run, job))
            if run.abort_error is not None:  # the store was down too long
                raise run.abort_error
            raise DeckStateError("CLOSED", "finish the run")  # the deck's close cancelled it
        except anyio.get_cancelled_exc_class():
            # The caller was cancelled: the run's run.cancelled is durable before it goes on.
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
                await self._drain_mail()
                await self.writer.flush()
            raise
        finally:
            self.active.pop(run.run_id, None)
            self.writer.failed.pop(run.run_id, None)  # a refusal its end met: raised already
            run.done.set()
            run.wake.set()

    async def _played(self, run: _Run, job: Callable[[], Any]) -> Event:
        """Trio: play ``run`` on the bridge, then commit its end here before the caller hears
        of it. Its end needs no round trip of its own (the engine side returns right after
        posting it): two thread crossings per run instead of four. Raises what the engine
        raised (its ``run.failed`` committed first), or what the store refused for the run."""
        run.ends_on_kit = True
        failed: Exception | None = None
        try:
            end = await self.bridge.call(job)  # type: ignore[union-attr]
        except Exception as exc:
            failed = exc
        await self._drain_mail()
        await self._flushed(run.run_id)
        if failed is not None:
            raise failed
        return end

    async def run(self, spec: InvocableSpec, input: Any, *, context: Any = None,
                  session_id: str | None = None, namespace: str | None = None,
                  run_id: str | None = None, history: Any = None) -> Any:
        _check_ids(session_id, run_id)
        run, job, _ = await self._begin(spec, input, context, session_id, namespace, run_id, False,
                                        history=history)
        return _result(run, await self._play(run, job))

    async def stream(self, spec: InvocableSpec, input: Any, *, context: Any = None,
                     session_id: str | None = None, namespace: str | None = None,
                     run_id: str | None = None, committed: bool = False,
                     history: Any = None) -> AsyncIterator[Event]:
        async def begin() -> tuple[_Run, Callable[[], Any], int]:
            _check_ids(session_id, run_id)
            run, job, _ = await self._begin(spec, input, context, session_id, namespace, run_id,
                                            True, history=history)
            return run, job, -1  # from its run.started on
        async with contextlib.aclosing(self._streamed(begin, committed)) as events:
            async for event in events:
                yield event

    async def _play_in_background(self, run: _Run, job: Callable[[], Any]) -> None:
        try:
            await self._play(run, job)
        except Exception:  # a failure reaches the stream's consumer (run.error), never the deck
            pass

    async def status(self, run_id: str) -> RunStatus | None:
        check_id("run_id", run_id)
        if run_id in self.active:
            await self.writer.flush()  # its start may still wait for the group commit
        info = await self.store.run_info(run_id)
        return info.status if info is not None else None

    async def _child(self, parent: RunHandle, name: str, args: dict[str, Any]) -> Any:
        """Engine side: play workflow ``name`` as a child run of ``parent`` (a tool call)."""
        spec = self.specs[name]
        block = spec.engine.to_input(args)  # a child's thread is its own run id
        run = self._new_run(spec, new_run_id(), parent.data, None, parent.namespace)
        run.origin = f"{parent.origin}/{name}"
        run.parent = parent.run_id
        started = Event(run.run_id, 0, RunStarted(name, "workflow", None, parent.namespace,
                                                  (block,), parent.run_id), run.origin)
        await self._commit(run, started, self._claim(run))
        self.active[run.run_id] = run  # pause and cancel reach it like any run
        try:
            return _result(run, await spec.engine.play(run, self.graphs[name], block.data))
        finally:
            self.active.pop(run.run_id, None)
            run.done.set()  # the deck's close waits for it (on the engine side, made there)

    # -------------------------------------------------------------------- run control --
    async def request(self, run_id: str, action: str, reason: str | None, source: str) -> None:
        """Record a pause/cancel request and return: a run played here is told at once (from
        the moment its id exists, child runs included), one played elsewhere sees it through its
        process's poll; a parked run is cancelled here."""
        check_id("run_id", run_id)
        check_text("reason", reason)
        run = self.active.get(run_id)
        if run is not None:
            run.request(action, reason, source)
            await self.writer.flush()  # its start may wait in the buffer: the store must know it
        request_id = await self.store.request(run_id, action, reason, source)
        self._handled.add(request_id)
        if run is None:
            await self._act(ControlRequest(request_id, run_id, action, reason, source))

    async def _act(self, req: ControlRequest) -> None:
        run = self.active.get(req.run_id)
        if run is not None:
            if req.action != "resume":
                run.request(req.action, req.reason, req.source)
        elif req.action == "cancel":
            await self._cancel_parked(req)

    async def _cancel_parked(self, req: ControlRequest) -> None:
        """A parked run has no writer: whoever handles its cancel becomes it (DESIGN 6); of two
        processes racing, the unique ``(run_id, seq)`` lets one write. A workflow's thread goes
        with it, in every deck that sees the cancel (a non-durable one's checkpoints live in the
        memory of the deck that parked it, which may not be the one that wrote the cancel)."""
        info = await self.store.run_info(req.run_id)
        if info is None or info.status not in (*_PARKED, RunStatus.CANCELLED):
            return
        if info.status is not RunStatus.CANCELLED:
            last = (await self.store.read(req.run_id))[-1]
            if last.payload.ends != "parking":  # resumed since: its player hears the request
                return
            try:
                with self._fence(req.run_id, last.seq + 1):
                    await self._write(None, [
                        Event(req.run_id, last.seq + 1,
                              ControlRequested("cancel", req.reason, req.source), info.name),
                        Event(req.run_id, last.seq + 2, RunCancelled(req.reason), info.name)])
            except LogConflictError:  # another caller got there first: a cancel, or a resume
                info = await self.store.run_info(req.run_id)
                if info is None or info.status is not RunStatus.CANCELLED:
                    return  # resumed: its thread is in use (a cancel elsewhere: forget ours too)
        spec = self.specs.get(info.name)
        if spec is None or spec.kind != "workflow":
            return
        key = spec.engine.key(info.namespace, info.session_id or req.run_id)  # _new_run's
        if info.session_id is not None and (  # the session's thread: only if no run took it since
                await self.store.session_holder(info.session_id, info.namespace) is not None
                or any(run.thread_key == key for run in self.active.values())):
            return
        await self._on_engine(spec.engine.forget, self.graphs[spec.name], key)

    async def _take_over(self, run: _Run, events: Sequence[Event]) -> None:
        """Become the writer of a parked run: append ``events`` (the resume) with its claim,
        fenced by seq (``LogConflictError`` when another caller got there first)."""
        run.seq = events[-1].seq
        try:
            with self._fence(run.run_id, events[0].seq):
                await self._write(run, events, self._claim(run))
                self._hold(run, run.seq)
        except BaseException:
            self._unstream(run)
            raise

    async def _take_paused(self, run_id: str, context: Any, streaming: bool
                           ) -> tuple[_Run, Callable[[], Any], int] | None:
        """Become the writer of a paused run: the run, its job and the seq it paused at, or None
        when there is nothing to resume here (unknown, not paused, playing, another caller
        resumed it first, or this deck lacks its invocable: SPEC 3.2)."""
        info = await self.store.run_info(run_id)
        spec = self.specs.get(info.name) if info is not None else None
        if info is None or spec is None or info.status is not RunStatus.PAUSED or run_id in self.active:
            return None
        log = await self.store.read(run_id)
        paused = log[-1]
        if paused.kind != "run.paused":  # resumed since the index was read: not ours to take
            return None
        run = self._new_run(spec, run_id, context, info.session_id, info.namespace, streaming)
        for event in log:  # its usage so far: run.completed totals the whole run
            if isinstance(event.payload, ModelCompleted):
                p = event.payload
                run.add_usage(p.input_tokens, p.output_tokens, p.usd)
        if spec.kind == "workflow":
            await self._check_thread(run)
        try:
            await self._take_over(run, [
                Event(run_id, paused.seq + 1, ControlRequested("resume", None, "api"), spec.name),
                Event(run_id, paused.seq + 2, RunResumed("resume"), spec.name)])
        except LogConflictError:
            return None  # another caller resumed it first
        if spec.kind == "agent":
            session = self.sessions.get(info.session_id, info.namespace) if info.session_id else None  # type: ignore[union-attr]
            items = [] if session is not None else (paused.payload.items or [])
            job = functools.partial(spec.engine.play, run, items, session,
                                    self._agents.run_config(self._sdk_tracing, run_id, info.session_id))
        else:
            job = functools.partial(spec.engine.play, run, self.graphs[spec.name], None)
        return run, job, paused.seq

    async def resume(self, run_id: str, context: Any) -> list[Event]:
        check_id("run_id", run_id)
        taken = await self._take_paused(run_id, context, False)
        if taken is None:
            return []
        run, job, after = taken
        await self._play(run, job)
        return await self.store.read(run_id, after=after)

    def stream_resume(self, run_id: str, context: Any, committed: bool = False) -> AsyncIterator[Event]:
        async def take() -> tuple[_Run, Callable[[], Any], int] | None:
            check_id("run_id", run_id)
            return await self._take_paused(run_id, context, True)
        return self._streamed(take, committed)

    async def _streamed(self, take: Callable[[], Any], committed: bool) -> AsyncIterator[Event]:
        """Play the run ``take()`` started or took over in the deck's task group, yielding its
        events live after the seq it continues from (nothing when ``take()`` gives None); with
        ``committed``, each once it is durable. A failed run's error is raised after its
        ``run.failed``. Leaving early ends the stream, never the run."""
        taken = await take()
        if taken is None:
            return
        run, job, after = taken
        try:
            self._tg.start_soon(self._play_in_background, run, job)
            async with contextlib.aclosing(run.events(after, committed)) as events:
                async for event in events:
                    yield event
            await run.done.wait()
            if run.error is not None:
                raise run.error
            if run.abort_error is not None:
                raise run.abort_error
        finally:
            self._unstream(run)

    async def _watch_requests(self) -> None:
        """Requests written by other processes (the CLI, replicas), as the store hears of them
        (``follow_requests``: NOTIFY on Postgres; SQLite's poll): pause/cancel reach the runs
        played here; a resume is taken up by any deck that has the run's invocable (the first
        to write wins); a parked run's cancel is written by whichever deck sees it first. A
        request is seen once it is acted on: one the store fails (``_act_or_raise``) is met
        again when the watch starts over."""
        requests = self.store.follow_requests(after=self._seen_request)
        async with contextlib.aclosing(requests):
            async for req in requests:
                if req.id in self._handled:
                    self._handled.discard(req.id)
                elif req.action == "resume" and req.run_id not in self.active:
                    self._tg.start_soon(self._resume_quietly, req.run_id)
                else:
                    await self._act_or_raise(req)
                self._seen_request = req.id

    async def _act_or_raise(self, req: ControlRequest) -> None:
        """``_act``; a failure is raised (``_every`` starts the watch over after its backoff),
        up to ``ACT_TRIES`` times in a row for one request, then logged and passed over."""
        try:
            await self._act(req)
        except Exception as exc:
            failing, tries = self._failing
            tries = tries + 1 if failing == req.id else 1
            self._failing = (req.id, tries)
            if tries < ACT_TRIES:
                raise
            _log.error("control request %d (%s of run %s) passed over after %d tries: %s: %s",
                       req.id, req.action, req.run_id, tries, type(exc).__name__, exc)

    async def _resume_quietly(self, run_id: str) -> None:
        """A resume request from the log (its run id, as old as the log, is not re-checked).
        Taking the run over is tried ``ACT_TRIES`` times while the store fails; the run's own
        failure is in its log (``run.failed``), with nobody here to tell."""
        for tries in range(1, ACT_TRIES + 1):
            try:
                taken = await self._take_paused(run_id, None, False)
                break
            except CheckpointMissingError:
                return  # a non-durable workflow's run: the process that parked it takes it up
            except Exception as exc:
                if tries == ACT_TRIES:
                    _log.error("resuming run %s passed over after %d tries: %s: %s", run_id,
                               tries, type(exc).__name__, exc)
                    return
                await anyio.sleep(min(2.0 ** tries, BACKOFF_MAX))
        if taken is not None:
            with contextlib.suppress(Exception):
                await self._play(taken[0], taken[1])

    # --------------------------------------------------------------- parked workflows --
    async def _unpark(self, run_id: str, wanted: str, value: Any, by: str, context: Any,
                      streaming: bool = False) -> tuple[_Run, Callable[[], Any], int]:
        """Become the writer of a parked workflow run (``wanted``: the parking kind it must end
        with): the run, the job that resumes it with ``value`` and the seq it parked at."""
        status = {"run.interrupted": "WAITING_HUMAN", "run.sleeping": "SLEEPING"}[wanted]
        info = await self.store.run_info(run_id)
        if info is None:
            raise UnknownRunError(run_id)
        last = (await self.store.read(run_id))[-1]
        if last.kind != wanted or run_id in self.active:
            raise RunNotWaitingError(run_id, info.status, status)
        spec = self.specs.get(info.name)
        if spec is None or spec.kind != "workflow":
            raise UnknownNameError(info.name, [n for n, s in self.specs.items() if s.kind == "workflow"])
        if wanted == "run.interrupted":  # an answer: refused now, not by the run's checkpoint
            spec.engine.check_answer(value)
        parked = last.payload
        run = self._new_run(spec, run_id, context, info.session_id, info.namespace, streaming)
        run.thread_id = parked.thread_id
        run.thread_key = spec.engine.key(info.namespace, parked.thread_id)
        await self._check_thread(run)
        try:  # (run_id, seq) is unique: of two callers racing to resume, one gets this conflict
            await self._take_over(run, [Event(run_id, last.seq + 1, RunResumed(by), spec.name)])
        except LogConflictError:
            raise RunNotWaitingError(run_id, "being resumed by another caller", status) from None
        command = kit_workflows.resume_command(parked.interrupt_id, value)
        return run, functools.partial(spec.engine.play, run, self.graphs[spec.name], command), last.seq

    async def _check_thread(self, run: _Run) -> None:
        """Raise ``CheckpointMissingError`` (the run stays parked) unless this deck's
        checkpointer holds the thread that parked workflow ``run`` goes on from: without it,
        LangGraph would start the graph over with an empty state and the answer would be lost."""
        spec = run.spec
        graph = self.graphs[spec.name]
        if not await self._on_engine(kit_workflows.holds_thread, graph, run.thread_key):
            self._unstream(run)
            raise CheckpointMissingError(run.run_id, spec.name, spec.engine.durable)

    async def _resume(self, run_id: str, wanted: str, value: Any, by: str, context: Any) -> Any:
        run, job, _ = await self._unpark(run_id, wanted, value, by, context)
        return _result(run, await self._play(run, job))

    async def answer(self, run_id: str, value: Any, context: Any) -> Any:
        check_id("run_id", run_id)
        return await self._resume(run_id, "run.interrupted", value, "answer", context)

    def stream_answer(self, run_id: str, value: Any, context: Any,
                      committed: bool = False) -> AsyncIterator[Event]:
        async def take() -> tuple[_Run, Callable[[], Any], int]:
            check_id("run_id", run_id)
            return await self._unpark(run_id, "run.interrupted", value, "answer", context, True)
        return self._streamed(take, committed)

    async def pending(self) -> list[Pending]:
        out = []
        for info in await self.store.runs(status=RunStatus.WAITING_HUMAN):
            last = (await self.store.read(info.run_id))[-1]
            if isinstance(last.payload, RunInterrupted):
                out.append(Pending(info.run_id, info.name, last.payload.thread_id or "",
                                   info.session_id, last.payload.payload, last.at))
        return out

    async def _due(self, now: datetime) -> list[tuple[Due, str, str | None]]:
        """Due threads, the longest overdue first, with the interrupt to wake and their
        namespace: each sleeping run of the log, checked on its thread's latest checkpoint, and
        the threads asleep that no run parks (``_orphans``), which the checkpointers are scanned
        whole for every ``ORPHAN_SCAN`` seconds (the scan reads every checkpoint of every
        thread ever played: seconds, once there are thousands)."""
        out: list[tuple[Due, str, str | None]] = []
        parked: set[str] = set()
        for info in await self.store.runs(status=RunStatus.SLEEPING):
            spec = self.specs.get(info.name)
            if spec is None or spec.kind != "workflow":
                continue
            last = (await self.store.read(info.run_id))[-1]
            if not isinstance(last.payload, RunSleeping):
                continue
            thread = last.payload.thread_id or ""
            key = spec.engine.key(info.namespace, thread)
            parked.add(key)
            found = await self._on_engine(kit_workflows.sleeping_until, self.graphs[spec.name], key)
            if found is not None and found[0] <= now:
                out.append((Due(info.name, thread, found[0], info.run_id), found[1], info.namespace))
        if anyio.current_time() >= self._orphans_at:
            self._orphans_at = anyio.current_time() + ORPHAN_SCAN
            self._orphans = dict(await self._on_engine(kit_workflows.sleeping_threads, self.graphs))
        for key, name in list(self._orphans.items()):
            found = None if key in parked else await self._on_engine(
                kit_workflows.sleeping_until, self.graphs[name], key)
            if found is None:  # woken, or parked by a run of the log now
                del self._orphans[key]
            elif found[0] <= now:
                _, namespace, thread = key.split(":", 2)
                out.append((Due(name, thread, found[0], None), found[1], namespace or None))
        return sorted(out, key=lambda due: due[0].until)  # the longest overdue first

    async def due_resumes(self, now: datetime) -> list[Due]:
        return [due for due, _, _ in await self._due(now)]

    async def tick(self, now: datetime) -> list[Ticked]:
        """Resume every due thread once. A thread whose parked run is in the log is resumed
        through that run (two tickers race on its next seq: one wins); one without (its run
        was never recorded) is resumed under the thread's lock (``ThreadLocks``: an advisory
        lock with Postgres) by a new run that claims the thread, once the lock holder has seen
        that the thread still waits, so a second ticker skips it, now or later. A thread whose
        run fails (its ``run.failed`` is in the log) does not hold up the others: they are all
        resumed, then the first failure is raised."""
        woke = {"woke_at": now.isoformat()}
        out, failed = [], []
        for due, interrupt_id, namespace in await self._due(now):
            try:
                if due.run_id is not None:
                    result = await self._resume(due.run_id, "run.sleeping", woke, "tick", None)
                else:
                    result = await self._tick_thread(due, interrupt_id, namespace, woke)
            except (RunNotWaitingError, SessionBusyError):
                continue  # another ticker (or a live run) has this thread
            except Exception as exc:
                failed.append(exc)
                continue
            if result is not _SKIPPED:
                out.append(Ticked(due.workflow, due.thread_id, result))
        if failed:
            if len(failed) > 1:
                failed[0].add_note(f"tick: {len(failed) - 1} more due thread(s) failed too (each "
                                   "run's log has its run.failed)")
            raise failed[0]
        return out

    async def _tick_thread(self, due: Due, interrupt_id: str, namespace: str | None,
                           woke: Any) -> Any:
        """Resume a thread only the checkpointer knows, holding its lock; ``_SKIPPED`` when
        another ticker holds it or has resumed it already."""
        spec = self.specs[due.workflow]
        key = spec.engine.key(namespace, due.thread_id)
        if not await self._on_engine(self._thread_locks.acquire, key):
            return _SKIPPED
        try:
            graph = self.graphs[due.workflow]
            asleep = await self._on_engine(kit_workflows.sleeping_until, graph, key)
            if asleep is None or asleep[1] != interrupt_id:  # another ticker woke it since
                return _SKIPPED
            run, job, _ = await self._begin(spec, {}, None, due.thread_id, namespace, None, False,
                                            command=kit_workflows.resume_command(interrupt_id, woke))
            return _result(run, await self._play(run, job))
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_engine(self._thread_locks.release, key)

    def session_for(self, session_id: str, namespace: str | None = None) -> Any:
        if self.sessions is None:
            raise ConfigError("this deck has no agent: sessions hold agents' conversations "
                              "(a workflow's thread is its session_id)")
        check_id("session_id", session_id)  # (an int would be another session than its str)
        if namespace is not None:
            check_name("namespace", namespace)
        session = self.sessions.get(session_id, namespace)
        return session if self.bridge is None else _OnEngine(session, self._on_engine)
