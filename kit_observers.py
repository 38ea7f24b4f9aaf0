"""kit_observers: the fan-out from the log to the deck's observers (SPEC 4.6, DESIGN 7).

Owns: which observers a deck has (``resolve_observers``), the build-time check
(``check_observers``) and ``ObserverHub``, which hands every event to every observer through that
observer's own bounded queue and drain task.

Must never: block or fail the caller of ``ObserverHub.emit`` (that is a run's path); let one
observer slow, starve or break another; grow memory without bound; read ``os.environ`` (the
caller passes ``env``); print.

Theory of operation
-------------------
The Runtime calls ``emit_all`` with each batch of events *after* the store committed it (observers
see only what the log holds, DESIGN 4.6), in each run's order. ``emit`` puts the event in each
observer's queue (an anyio memory stream of ``queue_size``) with ``send_nowait``: no await, no
lock, no thread. A full queue drops the event *for that observer only* and counts it, as
OpenTelemetry's BatchSpanProcessor does (CONVENTIONS A9), and says so: at once, then at most
once per ``REPORT_EVERY``, and the total at close.

Each observer has one drain task, which takes what is queued (up to ``BATCH_MAX``) and hands the
batch to that observer's own **daemon thread**, which calls ``observer.emit`` on each event in
order. Why a thread: ``emit`` is synchronous and SPEC 4.6 asks it to do in-memory work only, but
kit cannot check that. On the event loop, one ``time.sleep`` (a lock, a DNS lookup, a flush) in
one observer would stall every run; in its thread it stalls only its own drain, whose queue
fills and drops for it alone. Why a daemon thread of its own (not a worker pool's): an observer
stuck for good in ``emit`` is abandoned at close and never keeps the process from exiting. The
crossing (16-70 us, PERF.md) is paid per batch, not per event. An observer that declares
``nonblocking = True`` (its ``emit`` only appends to memory) is called on the loop instead, in
batches of at most ``LOOP_BATCH_MAX`` with a checkpoint between them: no crossing at all.
``start()`` and ``close()`` run in a daemon thread too when synchronous (the tracing observer
imports OpenTelemetry and flushes over the network there); async ones are awaited on the loop.

An observer that has a ``run_info(info)`` method is told, before the first event of a run it
sees past its start (one another process played before: resumed, answered, cancelled or reaped
here), that run's index row (``RunInfo``: name, kind, session, namespace, parent), and its
parent's before it: the events of a resume or a cancel do not carry them. The drain reads the
rows from the store (``run_info``, given by the Runtime; at most ``RUN_INFO_TIMEOUT``) on the
loop, so the observer's calls stay in-memory; a row the store cannot give is left out.

An ``emit`` that raises is counted; ``DISABLE_AFTER`` consecutive failures disable the observer:
its events are skipped (and counted) until the backoff has passed, then the next one is a trial.
A success resets the count and the backoff; a failed trial doubles it, up to ``RETRY_MAX``.

``close`` ends every queue and lets each drain deliver its backlog for up to ``DRAIN_TIMEOUT``;
then the stragglers are abandoned: what they had not delivered is counted ``abandoned``, and
no ``emit`` starts after that. Each observer's ``close()`` then runs, in reverse order, each
bounded by ``CLOSE_TIMEOUT``. Counts add up: ``emitted = delivered + errors + skipped +
abandoned`` once closed.
"""
from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from kit_core import ConfigError, Event, EventSinkPort, RunInfo, stops

__all__ = (
    "QUEUE_SIZE", "BATCH_MAX", "LOOP_BATCH_MAX", "DISABLE_AFTER", "RETRY_MIN", "RETRY_MAX",
    "DRAIN_TIMEOUT", "CLOSE_TIMEOUT", "SEEN_MAX", "RUN_INFO_TIMEOUT", "REPORT_EVERY",
    "ObserverStats", "ObserverHub", "resolve_observers",
    "check_observers", "observer_name",
)

#: Events waiting for one observer: references to events the log holds anyway (~64 KiB). Past
#: it, events are dropped for that observer (and counted), never buffered without bound and
#: never waited for.
QUEUE_SIZE = 8192
#: Events handed to one thread crossing (BatchSpanProcessor's export batch): bounds the time a
#: close waits on one batch and the events lost if that batch is abandoned.
BATCH_MAX = 512
#: A ``nonblocking`` observer is called on the event loop in batches of at most this many, with
#: a checkpoint between them, so even a long backlog never holds the loop for long.
LOOP_BATCH_MAX = 64
#: Consecutive failing ``emit`` calls that disable an observer: one error may be a bad event,
#: three in a row a broken observer, which would otherwise cost a traceback per event.
DISABLE_AFTER = 3
#: First backoff of a disabled observer, doubled at each failed trial up to ``RETRY_MAX`` (seconds):
#: a collector restart is retried within a second, a dead one costs one trial per five minutes.
RETRY_MIN = 1.0
RETRY_MAX = 300.0
#: How long ``close`` lets the drains deliver their backlog before abandoning them (seconds).
DRAIN_TIMEOUT = 5.0
#: How long ``close`` waits for each observer's own ``close()`` (a flush over the network; the
#: tracing observer's export timeout is 10 s) before abandoning it (seconds).
CLOSE_TIMEOUT = 10.0

#: Runs an observer that takes ``run_info`` was handed events of (the latest): one past it that
#: comes back is looked up again, a read at most. Its tracer keeps as many open (MAX_OPEN_RUNS).
SEEN_MAX = 10_000
#: One read of a run's index row for such an observer (seconds): a stalled store delays that
#: observer's drain only (its queue drops past QUEUE_SIZE), never a run.
RUN_INFO_TIMEOUT = 2.0

#: While an observer's events are dropped, at most one warning per this many seconds, with the
#: count so far; ``close`` tells the total. A deck's user sees the losses nowhere else.
REPORT_EVERY = 60.0

_log = logging.getLogger("kit.observers")
_TRACING_KEYS = ("KIT_TRACING_PUBLIC_KEY", "KIT_TRACING_SECRET_KEY")


def resolve_observers(observers: Sequence[EventSinkPort] | None,
                      env: Mapping[str, str]) -> list[EventSinkPort]:
    """The observers a deck runs with (SPEC 4.6 rules 1-3).

    ``None``: a ``TracingObserver`` built from ``env`` when both ``KIT_TRACING_PUBLIC_KEY`` and
    ``KIT_TRACING_SECRET_KEY`` are set, otherwise none (no warning). A sequence: exactly those, in
    order (naming any suppresses the settings-derived tracer; ``()`` means none). Raises
    ``ConfigError`` as ``check_observers`` does. Starts nothing.
    """
    if observers is None:
        if all(env.get(k) for k in _TRACING_KEYS):
            from kit_tracing import TracingObserver
            return [TracingObserver(public_key=env[_TRACING_KEYS[0]], secret_key=env[_TRACING_KEYS[1]],
                                    host=env.get("KIT_TRACING_HOST") or None)]
        return []
    check_observers(observers)
    return list(observers)


def check_observers(observers: Sequence[EventSinkPort] | None) -> None:
    """Check at ``build()`` that each entry is an ``EventSinkPort`` instance (SPEC 4.6 rule 5).

    Raises ``ConfigError`` naming the first bad entry: not a sequence, a class instead of an
    instance, no callable ``emit``, or an ``async def emit`` (emit is synchronous). Starts
    nothing and contacts nothing.
    """
    if observers is None:
        return
    if isinstance(observers, EventSinkPort) and not isinstance(observers, type):
        raise ConfigError("observers= takes a sequence of observers; wrap it: "
                          f"observers=[{observer_name(observers)}(...)]")
    if isinstance(observers, (str, bytes)) or not isinstance(observers, Sequence):
        raise ConfigError(f"observers= takes a sequence (list or tuple) of observers, "
                          f"got {type(observers).__name__}")
    for i, obs in enumerate(observers):
        where = f"observers[{i}] ({observer_name(obs)})"
        if isinstance(obs, type):
            raise ConfigError(f"{where} is a class; pass an instance: {obs.__name__}(...)")
        if not isinstance(obs, EventSinkPort) or not callable(obs.emit):
            raise ConfigError(f"{where} is not an observer: it needs an emit(event) method "
                              "(kit.EventSinkPort)")
        for name in ("emit", "run_info"):
            if inspect.iscoroutinefunction(getattr(obs, name, None)):
                raise ConfigError(f"{where} has an async {name}(); {name} must be a plain method "
                                  "that does in-memory work only (SPEC 4.6)")


def observer_name(observer: object) -> str:
    """How messages and log lines name an observer: its type's name (a class's own name). Never
    the observer's ``repr``/``str``: a user's may raise, be megabytes long, or show what it
    holds (a key, a client)."""
    t = observer if isinstance(observer, type) else type(observer)
    return getattr(t, "__qualname__", None) or t.__name__


@dataclass(slots=True)
class ObserverStats:
    """One observer's counters (a snapshot from ``ObserverHub.stats``).

    ``observer`` is its name in log lines (``observer_name``: its type's). ``emitted`` events
    entered its queue and ``dropped`` did not (queue full, or the hub closed). Of those emitted, ``delivered`` were taken by its ``emit``, ``errors`` made it raise,
    ``skipped`` arrived while it was disabled, and ``abandoned`` were still queued or in flight
    when close gave up on it (an observer stuck in ``emit``); until close, the rest are queued.
    ``disabled`` counts the times it was disabled.
    """
    observer: str
    emitted: int = 0
    dropped: int = 0
    delivered: int = 0
    errors: int = 0
    skipped: int = 0
    abandoned: int = 0
    disabled: int = 0


class _Slot:
    """One observer, its queue, its drain's cancel scope, its thread and its failure state."""

    def __init__(self, observer: EventSinkPort) -> None:
        self.observer = observer
        self.stats = ObserverStats(observer_name(observer))
        self.failures = 0
        self.backoff = RETRY_MIN
        self.retry_at: float | None = None  # set while disabled
        self.on_loop = bool(getattr(observer, "nonblocking", False))
        # The runs it was handed events of, when it takes their index rows (run_info).
        self.seen: OrderedDict[str, None] | None = (
            OrderedDict() if callable(getattr(observer, "run_info", None)) else None)
        self.closed = False  # set by close: no emit starts after it
        self.told: float | None = None  # when a drop was last logged (the hub's clock)
        # Made by start(): a stream never closed warns when collected, and a hub built but
        # never opened must not.
        self.send: Any = None
        self.receive: Any = None
        self.thread: _Courier | None = None
        self.scope: Any = None
        self.done: Any = None


class _Courier(threading.Thread):
    """An observer's own daemon thread: runs what the drain hands it, in order, and tells the
    loop when each piece is done. A daemon, so one stuck forever never keeps the process alive."""

    def __init__(self, name: str, token: Any) -> None:
        super().__init__(name=f"kit observer {name}", daemon=True)
        self._token, self._jobs = token, queue.SimpleQueue()

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done, box = job
            try:
                box.append(fn())
            except BaseException as exc:  # noqa: BLE001 - carried back to the loop
                box.append(exc)
            try:
                anyio.from_thread.run_sync(done.set, token=self._token)
            except RuntimeError:  # the loop is gone: nobody is waiting any more
                return

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on this thread; its result (or exception). Cancelling the caller
        abandons the call, never waits for it."""
        done, box = anyio.Event(), []
        self._jobs.put((fn, done, box))
        await done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def stop(self) -> None:
        self._jobs.put(None)


async def _in_daemon(fn: Callable[[], Any], name: str) -> Any:
    """Run ``fn()`` on a fresh daemon thread (an observer's start or close)."""
    courier = _Courier(name, anyio.lowlevel.current_token())
    courier.start()
    try:
        return await courier.call(fn)
    finally:
        courier.stop()


class ObserverHub:
    """Fans events out to observers, each through its own bounded queue and drain task.

    ``clock`` is the time source of the backoff (seconds; tests pass a fake); ``run_info`` reads
    a run's index row for observers that take them (the store's; None: they are told none). Raises
    ``ConfigError`` as ``check_observers`` does, or for a ``queue_size`` below 1. ``emit`` must
    be called on the event loop's thread (the kit side), with each run's events in ``seq`` order.
    Call ``close()`` before cancelling the task group given to ``start``: a cancelled drain
    loses its backlog.
    """

    def __init__(self, observers: Sequence[EventSinkPort], *, queue_size: int = QUEUE_SIZE,
                 clock: Callable[[], float] = time.monotonic,
                 run_info: Callable[[str], Awaitable[RunInfo | None]] | None = None) -> None:
        check_observers(observers)
        self._run_info = run_info  # the store's: a run's index row, for observers that take it
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError(f"queue_size must be a positive int, got {queue_size!r}")
        self._slots = [_Slot(o) for o in observers]
        self._queue_size, self._clock = queue_size, clock
        self._state = "NEW"  # NEW -> STARTED -> CLOSED

    @property
    def stats(self) -> tuple[ObserverStats, ...]:
        """A snapshot of each observer's counters, in observer order."""
        return tuple(replace(s.stats) for s in self._slots)

    async def start(self, task_group: TaskGroup) -> None:
        """Start each observer in order (its optional ``start()``), then its drain task.

        An observer whose ``start()`` raises refuses the open: the ones already started are
        closed (errors logged) and its exception propagates. Raises ``RuntimeError`` when called
        twice or after ``close``.
        """
        if self._state != "NEW":
            raise RuntimeError(f"ObserverHub.start() called on a {self._state} hub")
        started: list[_Slot] = []
        try:
            for slot in self._slots:
                await self._call(slot, "start")
                started.append(slot)
        except BaseException:
            self._state = "CLOSED"
            with anyio.CancelScope(shield=True):
                for slot in reversed(started):
                    await self._close_observer(slot)
            raise
        self._state = "STARTED"
        token = anyio.lowlevel.current_token()
        for slot in self._slots:
            slot.send, slot.receive = anyio.create_memory_object_stream[Event](self._queue_size)
            slot.scope, slot.done = anyio.CancelScope(), anyio.Event()
            if not slot.on_loop:
                slot.thread = _Courier(slot.stats.observer, token)
                slot.thread.start()
            task_group.start_soon(self._drain, slot, name=f"kit observer drain {slot.stats.observer}")

    def emit_all(self, events: Sequence[Event]) -> None:
        """``emit`` each of ``events`` in order: a committed batch (nothing per event for a
        deck with no observer)."""
        if self._slots:
            for event in events:
                self.emit(event)

    def emit(self, event: Event) -> None:
        """Queue ``event`` for every observer. Never blocks, never raises: a full queue drops the
        event for that observer and counts it in ``dropped``, as does a hub not (or no longer)
        started."""
        for slot in self._slots:
            if slot.send is None:
                slot.stats.dropped += 1
                continue
            try:
                slot.send.send_nowait(event)
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                slot.stats.dropped += 1
                now = self._clock()
                if slot.told is None or now - slot.told >= REPORT_EVERY:
                    slot.told = now
                    _log.warning("observer %s: queue full (or hub closed): %d of its events "
                                 "dropped so far", slot.stats.observer, slot.stats.dropped)
            else:
                slot.stats.emitted += 1

    async def close(self) -> None:
        """Deliver each backlog (at most ``DRAIN_TIMEOUT``), then close each observer in reverse
        order (each at most ``CLOSE_TIMEOUT``). Idempotent; never raises (errors are logged);
        shielded, so a cancelled caller still flushes, within those bounds."""
        was, self._state = self._state, "CLOSED"
        if was != "STARTED":
            return
        with anyio.CancelScope(shield=True):
            for slot in self._slots:
                slot.send.close()
            with anyio.move_on_after(DRAIN_TIMEOUT):
                for slot in self._slots:
                    await slot.done.wait()
            for slot in self._slots:
                slot.closed = True  # no emit starts after this, on any thread
                slot.scope.cancel()  # a drain stuck in emit: its thread is abandoned
            with anyio.move_on_after(CLOSE_TIMEOUT):
                for slot in self._slots:
                    await slot.done.wait()
            for slot in self._slots:
                slot.receive.close()
                if slot.thread is not None:
                    slot.thread.stop()
                s = slot.stats
                s.abandoned = s.emitted - s.delivered - s.errors - s.skipped
                if s.abandoned:
                    _log.warning("observer %s: abandoned %d undelivered events at close",
                                 s.observer, s.abandoned)
                if s.dropped:
                    _log.warning("observer %s: %d of its events were dropped in all (a full "
                                 "queue)", s.observer, s.dropped)
            for slot in reversed(self._slots):
                await self._close_observer(slot)

    # ------------------------------------------------------------------------- internals --
    async def _call(self, slot: _Slot, name: str) -> None:
        method = getattr(slot.observer, name, None)
        if method is None:
            return
        if inspect.iscoroutinefunction(method):
            await method()
        else:
            # Not on the drain's thread: close() must not queue behind an emit stuck forever.
            await _in_daemon(method, f"{slot.stats.observer} {name}")

    async def _close_observer(self, slot: _Slot) -> None:
        with anyio.move_on_after(CLOSE_TIMEOUT) as scope:
            try:
                await self._call(slot, "close")
            except stops():
                raise
            except BaseException:  # a user's BaseException too: it costs this observer alone
                _log.exception("observer %s: close() raised", slot.stats.observer)
        if scope.cancelled_caught:
            _log.warning("observer %s: close() took more than %s s; abandoned",
                         slot.stats.observer, CLOSE_TIMEOUT)

    async def _drain(self, slot: _Slot) -> None:
        try:
            with slot.scope:
                limit = LOOP_BATCH_MAX if slot.on_loop else BATCH_MAX
                while True:
                    try:
                        batch = [await slot.receive.receive()]
                    except (anyio.EndOfStream, anyio.ClosedResourceError):
                        return
                    while len(batch) < limit:
                        try:
                            batch.append(slot.receive.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    if slot.seen is not None and self._run_info is not None:
                        batch = await self._told(slot, batch)
                    if slot.on_loop:
                        self._deliver(slot, batch)
                        await anyio.lowlevel.checkpoint()  # let runs go between batches
                    else:
                        await slot.thread.call(lambda b=batch: self._deliver(slot, b))  # type: ignore[union-attr]
        finally:
            slot.done.set()

    async def _told(self, slot: _Slot, batch: list[Any]) -> list[Any]:
        """``batch`` with the index row of each run first seen past its start (and its
        parent's) before that run's first event, for an observer that takes them."""
        out: list[Any] = []
        seen: OrderedDict[str, None] = slot.seen  # type: ignore[assignment]
        for event in batch:
            if event.run_id in seen:
                seen.move_to_end(event.run_id)
            else:
                seen[event.run_id] = None
                if len(seen) > SEEN_MAX:
                    seen.popitem(last=False)
                info = await self._info(event.run_id) if event.seq > 0 else None
                if info is not None:
                    parent = info.parent_run_id and await self._info(info.parent_run_id)
                    out += [parent, info] if parent else [info]
            out.append(event)
        return out

    async def _info(self, run_id: str) -> RunInfo | None:
        with anyio.move_on_after(RUN_INFO_TIMEOUT):
            try:
                return await self._run_info(run_id)  # type: ignore[misc]
            except Exception:  # the store is down or refused: the observer goes without
                _log.debug("observers: no index row for run %s", run_id, exc_info=True)
        return None

    def _deliver(self, slot: _Slot, batch: list[Any]) -> None:
        """One batch, in order (the observer's thread, or the loop when it is nonblocking);
        counts, disables and re-enables the observer. Stops at close. A run's index row
        (``RunInfo``, ``_told``) goes to its ``run_info``, uncounted; skipped while disabled."""
        stats, emit = slot.stats, slot.observer.emit
        for event in batch:
            if slot.closed:
                return  # what is left is counted abandoned by close
            if isinstance(event, RunInfo):
                if slot.retry_at is None:
                    try:
                        slot.observer.run_info(event)  # type: ignore[attr-defined]
                    except Exception:
                        _log.warning("observer %s: run_info() raised", stats.observer,
                                     exc_info=True)
                continue
            if slot.retry_at is not None:
                if self._clock() < slot.retry_at:
                    stats.skipped += 1
                    continue
                slot.retry_at = None  # this event is the trial
            try:
                emit(event)
            except BaseException:  # SystemExit too: a sync call, where no cancellation lands
                if slot.closed:
                    return
                stats.errors += 1
                slot.failures += 1
                if slot.failures >= DISABLE_AFTER:
                    slot.retry_at = self._clock() + slot.backoff
                    stats.disabled += 1
                    _log.warning("observer %s raised %d times in a row; disabled for %.0f s",
                                 stats.observer, slot.failures, slot.backoff, exc_info=True)
                    slot.backoff = min(slot.backoff * 2, RETRY_MAX)
            else:
                if slot.closed:
                    return  # an emit that was stuck past close: counted abandoned
                stats.delivered += 1
                if slot.failures:
                    slot.failures, slot.backoff = 0, RETRY_MIN
