"""kit_runtime: the Runtime that plays runs and records them in the log.

Owns: the runs it plays (a ``kit_runs.Run`` each: the engine's handle, the live buffer a
stream reads), the one write path of events (``Runtime._put`` / ``Runtime._write``: the
writer's group commit to the store, then the observers, with the run's live readers fed on the
way), session claims (through the store), child runs, run control, parked runs, fenced
writes and the lease loop (their half of the Runtime is ``kit_control.RunControl``, a mixin
that writes through this path), and the
lifecycle of what a deck holds open: the store it built, the observers, the engines' graphs and
sessions, the MCP servers, the trio bridge.

Must never: speak HTTP or read argv; print, log or persist the application context; hand an
engine anything but a ``RunHandle`` (engines never see the Runtime or the store).

Theory of operation
-------------------
There are two sides. The *kit side* is the event loop that opened the deck (asyncio or trio): it
owns the store, the writer and the streams. The *engine side* is where SDK objects live: the same
loop under asyncio; under trio, the trio run's asyncio loop in a daemon thread (kit_bridge's
``shared``: it outlives the deck, as the caller's loop does under asyncio), because
openai-agents and LangGraph are asyncio-only (notes/ENGINES.md section 9). A tool that calls the
deck under trio is on the engine side: its calls, its streams and its reads of the store are
played on the kit side (``_OnKit``), each the calling run's to cancel with it.

An engine records a run through its handle: ``emit`` for an ordinary event, ``durable`` for one it
must see committed before it goes on (``tool.started``; every end of a run, after what the run
added to its conversation: ``_to_session``, so a run cut off before its end adds nothing to it).
The event gets its ``seq`` on the engine side, in the engine's own order, and reaches the kit
side directly under asyncio, or through the bridge's mailbox under trio (one wake-up per batch).
On the kit side every event takes one path, ``_put``: into the writer's buffer, and into the run's
live buffer when someone streams it. The writer group-commits: one ``store.append`` per batch
(``FLUSH_MAX`` events, or ``FLUSH_DELAY`` after the first), never one commit per token (PERF.md
section 3), and feeds the observers what each append committed. ``_write`` is ``_put`` plus a
commit now, raising what the store refused (a busy session, a fenced seq, a value it cannot
hold) for that run alone; with nothing of the run's to commit and its lease maybe lapsed (no
renewal for half of it, or a stall past it), the store is asked whether another process ended
the run (what a session's or a checkpoint's write waits on: ``RunHandle.synced``). A write the
store may refuse for its seq (a caller's own run id, a take-over of a parked run) is fenced here
too (``_fence``): one per run id at a time in a deck, so two callers racing for one run never
share a batch, whose refusal would cost both. The ids callers give are checked before anything
is written (``check_id``); what kit reads back from its own log is not checked again.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import sniffio

import kit_observers
import kit_threads
from kit_bridge import Bridge, clock, later, shared
from kit_control import RunControl
from kit_core import (
    Claim, ConfigError, DeckStateError, Event, InvocableSpec, LogConflictError, NewRunId,
    RunCancelled, RunHandle, RunStarted, RunStatus, StoreUnavailableError, as_blocks, as_history,
    check_id, check_name, count_setting, new_run_id, stops,
)
from kit_pg import store_from_url
from kit_runs import Run, RunEvents, result_of
from kit_store import ENDED
from kit_storebase import READ_PAGE, pages
from kit_writer import BACKLOG_MAX, STORE_DOWN_LIMIT, Writer

if TYPE_CHECKING:
    import kit_sessions

__all__ = ("Runtime", "CONTROL_RETRY", "DEFAULT_LEASE_SECONDS", "CLOSE_TIMEOUT")

#: The control-request watcher follows the store (``follow_requests``), so a pause or cancel
#: written anywhere reaches the run's next safe point as soon as the store hears of it; when
#: following fails (the store is down) it starts again after this long, backing off.
CONTROL_RETRY = 0.1
#: A live run's lease; renewed every third of it. A process that dies stops renewing, and after
#: this long its runs are recorded as abandoned and their sessions freed (DESIGN 4.5).
DEFAULT_LEASE_SECONDS = 30.0
#: How long closing the deck waits for cancelled runs to record their end; also how long a
#: cancelled run waits for its ``run.cancelled`` to commit before its caller goes on.
CLOSE_TIMEOUT = 10.0
#: How a new run on a durable thread finds the run before it (``Runtime._abandoned``): pages of
#: the runs of its workflow and session, newest first, up to this many (runs of the same session
#: in other namespaces come between); past them it carries the thread on, as if none ended it.
PREVIOUS_PAGE, PREVIOUS_PAGES = 20, 5
_log = logging.getLogger("kit.runtime")


# ==================================================================================== helpers ====

#: Engine side, under trio: the run whose play the current asyncio task is part of (its tools'
#: tasks inherit it): the run a tool's call of the deck is made for (``_OnKit``).
_PLAYING: contextvars.ContextVar[Run | None] = contextvars.ContextVar("kit_playing", default=None)


async def _playing(run: Run, job: Callable[[], Any]) -> Any:
    """Engine side (trio): ``job()``, with ``run`` as the task's ``_PLAYING`` (``Bridge.call``
    gives each call a context of its own)."""
    _PLAYING.set(run)
    return await job()


class _OnKit:
    """The Runtime (or, as its ``store``, the deck's store) as a tool of one of its runs reaches
    it under trio (``Runtime.for_tool``): the tool plays on the engine's asyncio loop. Each
    coroutine method (``run``, ``status``, the store's ``runs``, ...) is awaited there while it
    runs on the kit side, in the deck's task group (``Bridge.call_trio``: a run it starts plays
    on that loop, never blocked meanwhile); each stream (``stream``, the store's ``follow``) is
    iterated in one task there, its items crossing a batch at a time (``Bridge.iter_trio``);
    either is the calling run's to cancel with it. The store's plain values pass as they are;
    anything else (a session, a store's other methods) lives on the kit side: refused."""

    _STREAMS = ("stream", "stream_answer", "stream_resume", "follow", "follow_requests")

    def __init__(self, runtime: Runtime, target: Any = None) -> None:
        self._runtime, self._target = runtime, runtime if target is None else target

    @property
    def store(self) -> _OnKit:
        return _OnKit(self._runtime, self._runtime.store)

    def __getattr__(self, name: str) -> Any:
        attr, runtime = getattr(self._target, name), self._runtime
        bridge, what = runtime.bridge, f"deck.{'' if self._target is runtime else 'store.'}{name}"
        cross = (bridge.call_trio if inspect.iscoroutinefunction(attr)  # type: ignore[union-attr]
                 else bridge.iter_trio if name in self._STREAMS  # type: ignore[union-attr]
                 or inspect.isasyncgenfunction(attr) else None)
        if cross is not None:
            def on_kit(*args: Any, **kwargs: Any) -> Any:  # (a coroutine, or an async iterator)
                return cross(functools.partial(attr, *args, **kwargs),
                             functools.partial(runtime._start_call, _PLAYING.get()))
            return on_kit
        if self._target is not runtime and not callable(attr):
            return attr
        raise DeckStateError("OPEN", f"use {what} from a tool under trio (a tool plays on the "
                             "engines' asyncio loop: it can await the deck's coroutine methods, "
                             "iterate its streams and read the log through deck.store; call "
                             f"{what} outside the tool, or pass what the tool needs in the run's "
                             "context)")


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


# ==================================================================================== runtime ====

class Runtime(RunControl):
    """Plays the deck's runs on one event store; created and opened by ``Deck``.

    Settings are read at ``open()``: ``KIT_STORE`` (when no store is passed in; unset or empty:
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
        self.active: dict[str, Run] = {}
        self._closing = False
        self._told_down: float | None = None  # the outage (its down_since) a start was told of
        self._streams: dict[str, Run] = {}  # streamed runs: their commits wake their readers
        self._calls: dict[str, list[Any]] = {}  # trio: run id -> its tools' deck calls (scope, done)
        self._tg: Any = None
        self.graphs: dict[str, Any] = {}  # workflow name -> graph compiled with its checkpointer
        self._close_graphs: Any = None
        self._thread_locks: Any = None  # kit_threads.ThreadLocks: one ticker per thread
        self._init_control()

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
                url = env.get("KIT_STORE", "").strip()  # exported but empty: unset
                self.store = store_from_url(url or self._default_store,
                                            sqlite_sync=env.get("KIT_SQLITE_SYNC"),
                                            setting="KIT_STORE" if url else None)
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
        self.hub = kit_observers.ObserverHub(observers, run_info=self.store.run_info)
        self.writer = Writer(self.store, self._committed, self._give_up, down_limit=self.down_limit,
                             refused=self._refused, clock=clock(), later=later())
        self._renewed, self._doubted = anyio.current_time(), set()  # leases, for _flushed
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        # Observers start in order before any run; one whose start() raises refuses the open.
        await self.hub.start(self._tg)
        await self._reap()  # runs a dead process left: abandoned, and observed as such
        processors = [o.sdk_processor() for o in observers if getattr(o, "sdk_spans", False)]
        if processors and self._agents is not None:  # the SDK's own spans, a second trace per run
            self._sdk_tracing = self._agents.use_trace_processors(processors)
        if sniffio.current_async_library() == "trio":
            self.bridge = Bridge(host=shared())
            self.bridge.start()
            self._tg.start_soon(self.bridge.pump, self._on_mail)
        self._tg.start_soon(self.writer.run)
        # A renewal that fails is tried again well within the lease (a backoff past it would
        # let another process reap this one's live runs as abandoned).
        self._tg.start_soon(self._every, self.lease / 3, self._keep_leases, "renewing leases",
                            self.lease / 6)
        # Older requests are history, but for those of the runs still parked (no deck heard them).
        self._seen_request = await self.store.last_request_id()
        self._tg.start_soon(self._missed_requests, self._seen_request)
        self._tg.start_soon(self._every, CONTROL_RETRY, self._watch_requests,
                            "following control requests")
        if self.sessions is not None:
            await self._on_engine(self.sessions.open)
        self.graphs, self._close_graphs, self._thread_locks = await self._on_engine(
            kit_threads.open_graphs, list(self.specs.values()), getattr(self.store, "url", None))
        await self._start_mcp()
        if any(spec.kind == "agent" for spec in self.specs.values()):
            await self._on_engine(self._agents.warm_up, list(self.specs.values()))

    async def close(self) -> None:
        """Cancel the runs still playing (they record ``run.cancelled``), flush, release all."""
        self._closing = True  # no run starts or is taken over from now on (``_new_run``)
        with anyio.CancelScope(shield=True):
            # ... and those whose start is being committed (``_fence``) are cancelled too: they
            # play into their cancelled scope once it commits, and end as the others do.
            runs = list({id(r): r for r in [*self.active.values(), *self._fenced.values()]
                         if r is not None}.values())
            for run in runs:
                run.closing = True  # each records that the deck closed, not that its caller left
                if run.parent is None:  # children end with their parents
                    run.scope.cancel()
            with anyio.move_on_after(CLOSE_TIMEOUT):
                for run in runs:  # children too: the flush below must find their ends buffered
                    # (the SDK may let a cancelled tool finish after its agent's run returned)
                    await (run.wait_done() if run.parent is None else self._on_engine(run.wait_done))
        await self._teardown()

    async def _teardown(self) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await self._stop_mcp()  # before the task group ends: the holder task lives there
                if getattr(self, "writer", None) is not None:
                    self._drain_mail()
                    with anyio.move_on_after(CLOSE_TIMEOUT):  # a store down: the lease tells
                        await self.writer.flush()
                if self.hub is not None:
                    await self.hub.close()  # before the task group: its drains deliver the backlog
        finally:  # The task group is left whatever that raised, from the scope it was entered
            # in, so outside any shield; leaving it raises the cancellation of a cancelled open
            # or lifespan: the rest still runs.
            try:
                if self._tg is not None:
                    tg, self._tg = self._tg, None
                    tg.cancel_scope.cancel()
                    await tg.__aexit__(None, None, None)
            finally:
                await self._release()

    async def _release(self) -> None:
        """What outlives the task group: sessions, graphs, the bridge, the store kit built."""
        with anyio.CancelScope(shield=True):
            for run in self.active.values():
                if run.parent is None:
                    run.finish()
            if self._sdk_tracing:
                self._agents.use_trace_processors([])
            if self.sessions is not None:
                await self._on_engine(self.sessions.aclose)
            if self._close_graphs is not None:
                await self._on_engine(self._close_graphs)
            if self.bridge is not None:  # (the loop is the trio run's: models' clients outlive us)
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

    def for_tool(self) -> _OnKit | None:
        """Under trio, called on the engines' loop (a tool that calls the deck): the Runtime as
        the tool may use it (``_OnKit``); elsewhere (another thread's loop) None."""
        return _OnKit(self) if self.bridge is not None and self.bridge.on_loop() else None

    def _start_call(self, parent: Run | None, fn: Callable[[], Any]) -> None:
        """Kit side (trio): start ``fn()``, a call of the deck by a tool of ``parent``
        (``_OnKit``), in the deck's task group. A cancelled caller of ``parent`` cancels it and
        waits for its end (``_play``), as under asyncio, where the call is the tool's own."""
        if self._tg is None:
            raise DeckStateError("CLOSED", "start or resume a run")
        scope, done = anyio.CancelScope(), anyio.Event()
        calls = self._calls.setdefault(parent.run_id, []) if parent is not None else []
        calls.append((scope, done))

        async def call() -> None:
            try:
                with scope:
                    await fn()
            finally:
                calls.remove((scope, done))
                if not calls and parent is not None and self._calls.get(parent.run_id) is calls:
                    del self._calls[parent.run_id]
                done.set()
        self._tg.start_soon(call)

    async def _on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Kit side: ``await fn(*args)`` on the engine side."""
        return await (self.bridge.call(fn, *args) if self.bridge else fn(*args))

    def _soon(self, fn: Callable[[], Any]) -> None:
        """Kit side: call ``fn()`` on the engine side, soon."""
        self.bridge.soon(fn) if self.bridge else fn()

    def _to_kit(self, fn: Callable[[], Any]) -> None:
        """Engine side: call ``fn()`` on the kit side, soon."""
        self.bridge.to_kit(fn) if self.bridge else fn()

    # ------------------------------------------------------------------ the write path --
    def _put(self, run: Run | None, event: Event, claim: Claim | None = None) -> None:
        """Kit side: the one way an event enters the log: the writer's next batch (observers and
        committed readers get it once it is durable), and the run's live buffer at once."""
        self.writer.put(event, claim)
        if run is not None and run.live is not None:  # (streamed)
            run.feed(event)
        # Its conversation is evictable again: only a run with a session id holds one (a parked
        # run's end comes with no Run: run None).
        if (run is None or run.session_id is not None) and self.sessions is not None and \
                event.payload.ends == "terminal":
            self.sessions.release(event.run_id)

    async def _write(self, run: Run | None, events: Sequence[Event], claim: Claim | None = None) -> None:
        """Kit side: ``_put`` the events (the claim with the first), then commit now. Raises what
        the store refused for this run (``SessionBusyError``, ``LogConflictError``): then none of
        its buffered events is in the log."""
        cancel = self._cancels.get(events[0].run_id) if run is None else None
        if cancel is not None:  # a parked run's cancel (``_fence``)
            if cancel.started:  # a second one while the first is written: the first's outcome
                return await cancel.outcome()
            cancel.started = True
        try:
            for i, event in enumerate(events):
                self._put(run, event, claim if i == 0 else None)
            await self._flushed(events[0].run_id, True)
        except BaseException as exc:
            if cancel is not None:
                cancel.error = exc
            raise
        finally:
            if cancel is not None:
                cancel.done.set()

    async def _flushed(self, run_id: str, held: bool = False) -> None:
        held = held or self.writer.holds(run_id)  # (held: the caller has just put some)
        await self.writer.flush()
        error = self.writer.failed.pop(run_id, None)
        # With nothing to commit, the log refuses nothing: while its lease may have lapsed,
        # ask whether another process has ended the run (what a checkpoint write waits on).
        if error is None and not held and (run_id in self._doubted or self.writer.now()
                                           - self._renewed > self.lease / 2):
            info = await self.store.run_info(run_id)
            if info is None or info.status not in ENDED:
                self._doubted.discard(run_id)
            else:  # doubted from now on: each later write is refused too, and the run stops
                self._doubted.add(run_id)
                error = LogConflictError(run_id, getattr(self.active.get(run_id), "seq", 0) + 1,
                                         info.status)
                self._refused(run_id, error)
        if error is not None:
            raise error

    async def _read_committed(self, run_id: str, after: int) -> list[Event]:
        """Kit side: commit what is buffered, then read a page (``READ_PAGE``) of the run's events
        after ``after``; ``StoreUnavailableError`` after the bound while the store is down."""
        with anyio.move_on_after(self.down_limit):
            await self.writer.flush()
            return await self.store.read(run_id, after,
                                         **({"limit": READ_PAGE} if pages(self.store) else {}))
        raise StoreUnavailableError(run_id, self.down_limit)

    def _committed(self, events: Sequence[Event]) -> None:
        """The writer committed ``events``: the observers get them, streamed runs' readers may
        send them."""
        self.hub.emit_all(events)
        if self._streams:  # each streamed run's last seq in the batch, as one wake-up
            for run_id, seq in {event.run_id: event.seq for event in events}.items():
                run = self._streams.get(run_id)
                if run is not None:
                    run.on_commit(seq)

    def _give_up(self, run_ids: set[str], error: BaseException, seconds: float) -> None:
        """The store took no writes for ``seconds``: stop the runs stuck behind it, visibly.
        Each records ``run.failed`` (written with the rest once the store is back) and its
        caller gets ``StoreUnavailableError``; a run whose end waits in the buffer already keeps
        it, and its caller is told so (``outcome="ended"``: a retry would play it twice)."""
        for run_id in run_ids:
            run = self.active.get(run_id)
            if run is not None and run.parent is None and run.abort_error is None:
                run.abort_error = StoreUnavailableError(run_id, seconds, error, outcome="ended" if (
                    run.ended and run.session is None) else "stopped")  # (see _to_session)
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

    def _drain_mail(self) -> None:
        """Kit side (trio): put what the engine side has posted and the pump has not taken yet
        (in order: the pump puts each batch it takes without yielding in between)."""
        if self.bridge is not None:
            for item in self.bridge.take():
                self._on_mail(item)

    def _deliver(self, run: RunHandle, event: Event) -> None:
        """Engine side: an ordinary event, to the kit side (no wait)."""
        if self.bridge is None:
            self._put(run, event)  # type: ignore[arg-type]
        else:
            self.bridge.post(((run, event, None), None))

    async def _commit(self, run: RunHandle, event: Event | None, claim: Claim | None = None) -> None:
        """Engine side: an event (with the run's claim, for a start; None: only what the run
        recorded before), committed before this returns; a run's end after what the run added
        to its conversation (``_to_session``)."""
        if event is not None and event.payload.ends and getattr(run, "session", None) is not None:
            event = await self._to_session(run, event)  # type: ignore[arg-type]
        if self.bridge is None:
            if event is not None:  # (``_write``, one await less: a run's own event)
                self._put(run, event, claim)  # type: ignore[arg-type]
            await self._flushed(run.run_id, event is not None)
        elif event and event.payload.ends is not None and getattr(run, "ends_on_kit", False):
            self.bridge.post(((run, event, claim), None))  # the engine returns next: _played
        else:
            await self.bridge.post_and_wait((run, event, claim))

    async def _to_session(self, run: Run, end: Event) -> Event:
        """Engine side: what ``run`` added to its conversation (``Run.session``) reaches it
        before ``end`` commits, once the log holds all before the end (a run reaped while it
        stalled is refused there). A kill between the two leaves the turn in the session and the
        run recorded abandoned. Cancelled meanwhile, the run ends as a cancelled play does; a
        failed write fails it (``run.failed`` at the end's seq) unless it failed or was
        cancelled already. Either way its items are dropped. While it waits ``run.session`` stays
        set: a caller stopped meanwhile (``_give_up``) hears "stopped", as the log then says."""
        session, failed = run.session, None
        try:
            await self._commit(run, None)  # raises what the store refused
            try:
                await session.flush()
            except Exception as exc:
                failed = exc
        except anyio.get_cancelled_exc_class():
            run.session, run.ended = None, False
            self._deliver(run, Event(run.run_id, end.seq, run.ending(), end.origin))  # type: ignore[arg-type]
            run.ended = True
            raise
        run.session = None  # its end (or the run.failed below) goes to the log from here
        if failed is None or end.kind in ("run.failed", "run.cancelled"):
            return end
        run.error = failed  # a stream's consumer raises it after run.failed
        await self._commit(run, Event(run.run_id, end.seq, run.failure(failed), end.origin))
        raise failed

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

    def _on_mail(self, item: tuple[tuple[Run, Event, Claim | None] | None, Any]) -> None:
        """Kit side (trio): one item from the bridge's mailbox: an event to put, and a reply to
        settle once it is committed (or, for ``None``, once the writer has room). Never waits
        itself, so the pump keeps every run's events flowing in order."""
        what, reply = item
        if what is not None:
            run, event, claim = what
            if event is not None:  # None: a run's ``synced``
                self._put(run, event, claim)
        if reply is not None:
            self._tg.start_soon(self._settle, None if what is None else what[0].run_id, reply)

    async def _settle(self, run_id: str | None, reply: Any) -> None:
        try:
            await (self.writer.room() if run_id is None else self._flushed(run_id))
        except Exception as exc:
            self.bridge.settle(reply, exc)  # type: ignore[union-attr]
        else:
            self.bridge.settle(reply, None)  # type: ignore[union-attr]

    def _new_run(self, spec: InvocableSpec, run_id: str, data: Any, session_id: str | None,
                 namespace: str | None, streaming: bool = False) -> Run:
        if self._closing:  # a stream made while open, iterated after: refused before any write
            raise DeckStateError("CLOSED", "start or resume a run")
        run = Run(spec, run_id, data, session_id, namespace, streaming,  # (no bridge: an emit is
                  deliver=self._put if self.bridge is None else self._deliver,  # a _put itself)
                  commit=self._commit, pace=self._pace, read=self._read_committed,
                  writer=self.writer)
        run.start_child = self._child
        if spec.kind == "workflow":
            run.thread_id = session_id or run_id
            run.thread_key = spec.engine.key(namespace, run.thread_id)
        if streaming:  # a racing caller of the same id may be here first: _hold settles it
            self._streams.setdefault(run_id, run)
        return run

    def _hold(self, run: Run, seq: int) -> None:
        """``run`` holds its id now (its fenced start or take-over committed at ``seq``): it is
        the run the id's commits wake, even if a caller that lost the race registered first."""
        self.active[run.run_id] = run
        if run.live is not None:
            self._streams[run.run_id] = run
            run.on_commit(seq)

    def _unstream(self, run: Run) -> None:
        """``run`` ended, or never got its id: its commits wake no reader any more."""
        if self._streams.get(run.run_id) is run:
            del self._streams[run.run_id]

    def _claim(self, run: Run) -> Claim:
        return Claim(run.run_id, self.owner, self.lease, run.session_id, run.namespace)

    # --------------------------------------------------------------------------- turns --
    async def _begin(self, spec: InvocableSpec, input: Any, context: Any, session_id: str | None,
                     namespace: str | None, run_id: str | None, streaming: bool,
                     command: Any = None, history: Any = None
                     ) -> tuple[Run, Callable[[], Any], Event]:
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
        abandoned = (spec.kind == "workflow" and spec.engine.durable and command is None
                     and session_id is not None
                     and await self._abandoned(spec.name, session_id, namespace))
        run = self._new_run(spec, str(run_id or new_run_id()), context, session_id, namespace,
                            streaming)
        session = None
        try:  # a streamed run is listed for its commits from here: a refused one was kept for good
            if spec.kind == "agent":
                blocks = as_blocks(input)
                items = spec.engine.to_input(blocks, history)  # refuses what it cannot express
                session = self.sessions.peek(session_id, namespace) if session_id else None  # type: ignore[union-attr]
                job = functools.partial(spec.engine.play, run, items, session,
                                        self._agents.run_config(self._sdk_tracing, run.run_id, session_id))
            else:
                block = spec.engine.to_input(input)
                if spec.engine.durable and session_id is None:
                    raise ConfigError(f"workflow {spec.name!r} is durable: pass session_id= (its thread id)")
                blocks = (block,)
                job = functools.partial(spec.engine.play, run, self.graphs[spec.name],
                                        block.data if command is None else command,
                                        abandoned=abandoned)
            started = Event(run.run_id, 0, RunStarted(spec.name, spec.kind, session_id, namespace,
                                                      blocks, history=history), spec.name)
            await self._start_run(run, [started], fenced)
        except BaseException:
            self._unstream(run)
            if session is not None:  # refused, at its claim or before: it evicts nothing
                self.sessions.unpeek(session_id, namespace)  # type: ignore[union-attr, arg-type]
            raise
        self.active[run.run_id] = run
        if session is not None:  # claimed: never evicted until its end (_put)
            self.sessions.hold(run.run_id, session_id, namespace, session)  # type: ignore[union-attr, arg-type]
        return run, job, started

    async def _abandoned(self, workflow: str, session_id: str, namespace: str | None) -> bool:
        """Kit side: whether the last run of durable ``workflow`` on thread ``session_id`` was
        abandoned (its process died: ``RunAbandoned``, or not ended yet, which a new run's claim
        then records), or the log has none, so a new run carries on whatever the thread stopped
        at. False when it completed, failed or was cancelled: the new run applies its input, and
        LangGraph discards the tasks it stopped at. Read before the new run's claim, so a
        failure here writes nothing."""
        before = None
        for _ in range(PREVIOUS_PAGES):  # the thread's runs, newest first
            page = await self.store.runs(name=workflow, session_id=session_id,
                                         limit=PREVIOUS_PAGE, before=before)
            for info in reversed(page):
                if info.namespace == namespace:
                    if info.status is RunStatus.FAILED:
                        last = (await self._last_event(info)).payload
                        return getattr(last, "error", None) == "RunAbandoned"
                    return info.status not in (RunStatus.COMPLETED, RunStatus.CANCELLED)
            if len(page) < PREVIOUS_PAGE:
                break
            before = page[0].run_id
        return True

    async def _start_run(self, run: Run, events: Sequence[Event], fenced: bool) -> None:
        """Write a run's start (its ``run.started``, or a parked run's resume: ``_take_over``),
        with its claim. A start that something could refuse (a session to hold, a caller's run
        id that is not a ``NewRunId``, a take-over) is committed now, so a refusal writes nothing
        and reaches the caller; any other rides in the run's first group commit (one transaction
        per short turn). While the store is down the start waits (``StoreUnavailableError``
        after the stated bound, with the run recorded as failed once the store is back); once
        a start was told so, later ones in that outage are refused at once, writing nothing."""
        first, last = events[0].seq, events[-1].seq
        down = self.writer.down_since
        if down is not None and (down == self._told_down or
                                 anyio.current_time() - down >= self.down_limit):
            raise StoreUnavailableError(run.run_id, anyio.current_time() - down,
                                        outcome="not started")
        if fenced or self.writer.pending >= BACKLOG_MAX:  # something to wait for: a bounded wait
            with anyio.move_on_after(self.down_limit) as waiting:
                await self.writer.room()
                if self._closing:  # the deck closed meanwhile: refused before any write
                    raise DeckStateError("CLOSED", "start or resume a run")
                if fenced:
                    with self._fence(run.run_id, first, run):  # a closing deck sees it here
                        try:
                            await self._write(run, events, self._claim(run))
                        except BaseException as exc:
                            try:
                                if isinstance(exc, anyio.get_cancelled_exc_class()) and not (
                                        waiting.cancel_called):  # its caller's (an outage: below)
                                    await self._end_unplayed(run, last)
                            finally:
                                run.finish()  # it never plays: a closing deck waits no more
                            raise
                        self._hold(run, last)
                    return
            if waiting.cancelled_caught:
                self._told_down = self.writer.down_since  # later starts in this outage: refused
                if not self.writer.holds(run.run_id):
                    raise StoreUnavailableError(run.run_id, self.down_limit, outcome="not started")
                error = StoreUnavailableError(run.run_id, self.down_limit)
                self._put(run, Event(run.run_id, last + 1, run.failure(error), run.origin))
                raise error  # will be written: so is its end
        self._put(run, events[0], self._claim(run))  # (unfenced: a new run's run.started alone)

    async def _end_unplayed(self, run: Run, seq: int) -> None:
        """Kit side: the caller of ``run`` was cancelled while the first events of its play
        (its start, a take-over, up to ``seq``) waited for the writer, which commits them
        after all: unless the store refused them, ``run.cancelled`` follows them, durable
        before the caller goes on (as ``_play`` does), or the run would hold its session until
        its lease lapsed, then be recorded abandoned. A workflow's thread goes, as after any
        cancelled play."""
        deadline = anyio.current_time() + CLOSE_TIMEOUT
        with anyio.CancelScope(shield=True):
            with anyio.CancelScope(deadline=deadline):
                await self.writer.flush()
            if self.writer.failed.pop(run.run_id, None) is not None:
                return  # refused: nothing of it is in the log
            run.seq, run.ended = seq + 1, True  # (a store still down: it commits after them)
            self._put(run, Event(run.run_id, seq + 1, RunCancelled("the caller was cancelled"),
                                 run.origin))
            with anyio.CancelScope(deadline=deadline):
                await self.writer.flush()
                self.writer.failed.pop(run.run_id, None)
                if run.spec.kind == "workflow":
                    await self._on_engine(run.spec.engine.forget, self.graphs[run.spec.name],
                                          run.thread_key, run.session_id is None)

    async def _play(self, run: Run, job: Callable[[], Any]) -> Event:
        if run.session_id is not None and self.sessions is not None:  # its items wait for its end
            run.session = self.sessions.turn(run.run_id)
        try:
            with run.scope:
                return await (job() if self.bridge is None else self._played(run, job))
            self._drain_mail()  # (trio) the end it posted as it stopped: its reader's too
            if run.abort_error is not None:  # the store was down too long
                raise run.abort_error
            raise DeckStateError("CLOSED", "finish the run")  # the deck's close cancelled it
        except anyio.get_cancelled_exc_class():
            # The caller was cancelled: the run's run.cancelled is durable before it goes on,
            # and its child runs' (the SDK does not wait for a cancelled tool to end).
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
                for child in [r for r in self.active.values() if r.parent == run.run_id]:
                    await self._on_engine(child.wait_done)  # it ends on the engine side
                for scope, done in list(self._calls.get(run.run_id, ())):  # (trio: _start_call)
                    scope.cancel()
                    await done.wait()
                self._drain_mail()
                await self.writer.flush()
            raise
        finally:
            self.active.pop(run.run_id, None)
            self.writer.failed.pop(run.run_id, None)  # a refusal its end met: raised already
            run.finish()

    async def _played(self, run: Run, job: Callable[[], Any]) -> Event:
        """Trio: play ``run`` on the bridge, then commit its end here before the caller hears
        of it. Its end needs no round trip of its own (the engine side returns right after
        posting it): two thread crossings per run instead of four. Raises what the engine
        raised (its ``run.failed`` committed first), or what the store refused for the run."""
        run.ends_on_kit = True
        failed: BaseException | None = None
        try:
            end = await self.bridge.call(_playing, run, job, takes=True)  # type: ignore[union-attr]
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:  # a user's BaseException too: its run.failed is posted
            failed = exc
        self._drain_mail()
        await self._flushed(run.run_id)
        if failed is not None:
            raise failed
        return end

    async def run(self, spec: InvocableSpec, input: Any, *, context: Any = None,
                  session_id: str | None = None, namespace: str | None = None,
                  run_id: str | None = None, history: Any = None) -> Any:
        if session_id is not None or run_id is not None:
            _check_ids(session_id, run_id)
        run, job, _ = await self._begin(spec, input, context, session_id, namespace, run_id, False,
                                        history=history)
        return result_of(run, await self._play(run, job))  # (``_finish``, one await less)

    async def _finish(self, run: Run, job: Callable[[], Any]) -> Any:
        """Play ``run`` to its end; what it returns to its caller."""
        return result_of(run, await self._play(run, job))

    def stream(self, spec: InvocableSpec, input: Any, *, context: Any = None,
               session_id: str | None = None, namespace: str | None = None,
               run_id: str | None = None, committed: bool = False,
               history: Any = None) -> RunEvents:
        async def begin() -> tuple[Run, Callable[[], Any], int]:
            _check_ids(session_id, run_id)
            run, job, _ = await self._begin(spec, input, context, session_id, namespace, run_id,
                                            True, history=history)
            return run, job, -1  # from its run.started on
        return self._streamed(begin, committed)

    async def _play_in_background(self, run: Run, job: Callable[[], Any]) -> None:
        try:
            await self._play(run, job)
        except stops():
            raise  # (the process is stopping: the deck's owner hears of it)
        except BaseException:  # a failure, of any type, reaches the stream's consumer
            pass  # (run.error), never the deck's task group: that would cancel every run

    def _streamed(self, take: Callable[[], Any], committed: bool) -> RunEvents:
        """Play the run ``take()`` started or took over in the deck's task group, yielding its
        events live after the seq it continues from (nothing when ``take()`` gives None); with
        ``committed``, each once it is durable. A failed run's error is raised after its
        ``run.failed``. Leaving early ends the stream, never the run."""
        return RunEvents(functools.partial(self._stream_events, take, committed))

    async def _stream_events(self, take: Callable[[], Any], committed: bool,
                             into: RunEvents) -> AsyncIterator[Event]:
        if (taken := await take()) is None:
            return
        run, job, after = taken
        into.run = run  # (its ``ready`` asks the run)
        try:
            self._tg.start_soon(self._play_in_background, run, job)
            async with contextlib.aclosing(run.events(after, committed)) as events:
                async for event in events:
                    yield event
            await run.wait_done()
            error = run.error if run.error is not None else run.abort_error  # (the first)
            if error is not None:
                raise error
        finally:
            self._unstream(run)

    async def status(self, run_id: str) -> RunStatus | None:
        check_id("run_id", run_id)
        if run_id in self.active:  # its start may still wait for the group commit, but no
            with anyio.move_on_after(self.down_limit):  # longer than a start waits for the store
                await self.writer.flush()
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
        self.active[run.run_id] = run  # pause and cancel reach it like any run,
        parent.children.add(run)  # ... and a cancel of its parent (RunHandle.request)
        if parent.requested is not None and parent.requested[0] == "cancel":
            run.request(*parent.requested)  # asked while it started
        try:
            return result_of(run, await spec.engine.play(run, self.graphs[name], block.data))
        finally:
            parent.children.discard(run)
            self.active.pop(run.run_id, None)
            run.finish()  # the deck's close waits for it (on the engine side)

    def session_for(self, session_id: str, namespace: str | None = None) -> Any:
        if self.sessions is None:
            raise ConfigError("this deck has no agent: sessions hold agents' conversations "
                              "(a workflow's thread is its session_id)")
        check_id("session_id", session_id)  # (an int would be another session than its str)
        if namespace is not None:
            check_name("namespace", namespace)
        session = self.sessions.get(session_id, namespace)
        if self.bridge is None:
            return session
        import kit_sessions  # (loaded already: this deck has sessions)
        return kit_sessions.OnEngine(session, self._on_engine)
