"""kit_observers: the fan-out from the log to the deck's observers (SPEC 4.6, DESIGN 7).

Owns: which observers a deck has (``resolve_observers``), the build-time check
(``check_observers``) and ``ObserverHub``, which hands every event to every observer through that
observer's own bounded queue and drain task.

Must never: block or fail the caller of ``ObserverHub.emit`` (that is a run's path); let one
observer slow, starve or break another; grow memory without bound; read ``os.environ`` (the
caller passes ``env``); print.

Theory of operation
-------------------
``emit`` puts the event in each observer's queue (an anyio memory stream of ``queue_size``) with
``send_nowait``: no await, no lock, no thread. A full queue drops the event *for that observer
only* and counts it, as OpenTelemetry's BatchSpanProcessor does (CONVENTIONS A9).

Each observer has one drain task, which takes what is queued (up to ``BATCH_MAX``) and calls
``observer.emit`` on each event, in order, **in a worker thread** under a limiter of one thread
for that observer, until the observer has proven fast: then on the loop (``FAST_PER_EVENT``). Why a thread: ``emit`` is synchronous and SPEC 4.6 asks it to do in-memory
work only, but kit cannot check that. On the event loop, one ``time.sleep`` (a lock, a DNS
lookup, a flush) in one observer would stall every run and every other observer; in its thread
it stalls only its own drain, whose queue fills and drops for it alone. The crossing (16-70 us,
PERF.md) is paid per batch, not per event: while one batch is in the thread the next one
accumulates. The limiter of one keeps a stuck observer to one thread (never the shared pool)
and its ``emit`` calls sequential and in order. Sync ``start()``/``close()`` run in a worker
thread too (the tracing observer imports OpenTelemetry and flushes over the network there);
async ones are awaited on the loop.

The price, measured: ~0.45 us per event per observer in ``emit``; and a worker thread runs only
when it gets the GIL. A waiting thread asks the holder for the GIL only after 5 ms without a
switch, but an event loop that is never idle releases and retakes it at every ``epoll``, which
counts as a switch: while the loop is saturated (a benchmark streaming flat out) the drains
barely run and observers drop, counted. Any idle time (waiting on a model, a socket) lets them through:
45k events/s to two observers, the loop idle 0.5 ms per 64 events, dropped nothing.

An ``emit`` that raises is counted; ``DISABLE_AFTER`` consecutive failures disable the observer:
its events are skipped (and counted) until the backoff has passed, then the next one is a trial.
A success resets the count and the backoff; a failed trial doubles it, up to ``RETRY_MAX``.

``close`` ends every queue and lets each drain deliver its backlog for up to ``DRAIN_TIMEOUT``;
then the stragglers are cancelled (a thread stuck in ``emit`` is abandoned, never waited for)
and each observer's ``close()`` runs, in reverse order, each bounded by ``CLOSE_TIMEOUT``.
"""
from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from kit_core import ConfigError, Event, EventSinkPort

__all__ = (
    "QUEUE_SIZE", "BATCH_MAX", "FAST_PER_EVENT", "LOOP_BATCH_MAX", "DISABLE_AFTER", "RETRY_MIN", "RETRY_MAX", "DRAIN_TIMEOUT",
    "CLOSE_TIMEOUT", "ObserverStats", "ObserverHub", "resolve_observers", "check_observers",
)

#: Events waiting for one observer: references to events the log holds anyway (~64 KiB). It
#: absorbs the burst of a fast reply while the observer's first, measuring batch crosses to its
#: thread (measured: ~2.5k events of a scripted 5k-token reply); past it, events are dropped for
#: that observer (and counted), never buffered without bound and never waited for.
QUEUE_SIZE = 8192
#: Events handed to one thread crossing (BatchSpanProcessor's export batch): bounds the time a
#: close waits on one batch and the events lost if that batch is abandoned.
BATCH_MAX = 512
#: An observer proven fast (under FAST_PER_EVENT per event, measured on its thread first) is
#: delivered on the event loop in batches of at most LOOP_BATCH_MAX: a thread is starved of the
#: GIL while the loop is saturated (see above), so a healthy observer would drop events there.
#: The loop then pays at most LOOP_BATCH_MAX * FAST_PER_EVENT (~0.6 ms) per batch, and an
#: observer that turns slow pays one slow batch on the loop before it goes back to its thread.
FAST_PER_EVENT = 10e-6
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
        raise ConfigError(f"observers= takes a sequence of observers; wrap it: observers=[{observers!r}]")
    if isinstance(observers, (str, bytes)) or not isinstance(observers, Sequence):
        raise ConfigError(f"observers= takes a sequence (list or tuple) of observers, "
                          f"got {type(observers).__name__}")
    for i, obs in enumerate(observers):
        where = f"observers[{i}] ({obs!r})"
        if isinstance(obs, type):
            raise ConfigError(f"{where} is a class; pass an instance: {obs.__name__}(...)")
        if not isinstance(obs, EventSinkPort) or not callable(obs.emit):
            raise ConfigError(f"{where} is not an observer: it needs an emit(event) method "
                              "(kit.EventSinkPort)")
        if inspect.iscoroutinefunction(obs.emit):
            raise ConfigError(f"{where} has an async emit(); emit must be a plain method that "
                              "does in-memory work only (SPEC 4.6)")


@dataclass(slots=True)
class ObserverStats:
    """One observer's counters (a snapshot from ``ObserverHub.stats``).

    ``emitted`` events entered its queue and ``dropped`` did not (queue full, or the hub closed).
    Of those emitted, ``delivered`` were taken by its ``emit``, ``errors`` made it raise and
    ``skipped`` arrived while it was disabled; the rest were still queued or abandoned at close.
    ``disabled`` counts the times it was disabled.
    """
    observer: str
    emitted: int = 0
    dropped: int = 0
    delivered: int = 0
    errors: int = 0
    skipped: int = 0
    disabled: int = 0


class _Slot:
    """One observer, its queue, its drain's cancel scope and its failure state."""

    def __init__(self, observer: EventSinkPort) -> None:
        self.observer = observer
        self.stats = ObserverStats(repr(observer))
        self.failures = 0
        self.backoff = RETRY_MIN
        self.retry_at: float | None = None  # set while disabled
        self.on_loop = False  # proven fast: deliver on the event loop, no thread crossing
        self.measured = False
        # Made by start(): a stream never closed warns when collected, and a hub built but
        # never opened must not.
        self.send: Any = None
        self.receive: Any = None
        self.limiter: Any = None
        self.scope: Any = None
        self.done: Any = None


class ObserverHub:
    """Fans events out to observers, each through its own bounded queue and drain task.

    ``clock`` is the time source of the backoff (seconds; tests pass a fake). Raises
    ``ConfigError`` as ``check_observers`` does, or for a ``queue_size`` below 1. ``emit`` must
    be called on the event loop's thread (the kit side), with each run's events in ``seq`` order.
    Call ``close()`` before cancelling the task group given to ``start``: a cancelled drain
    loses its backlog.
    """

    def __init__(self, observers: Sequence[EventSinkPort], *, queue_size: int = QUEUE_SIZE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_observers(observers)
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
        for slot in self._slots:
            slot.send, slot.receive = anyio.create_memory_object_stream[Event](self._queue_size)
            slot.limiter, slot.scope, slot.done = anyio.CapacityLimiter(1), anyio.CancelScope(), anyio.Event()
            task_group.start_soon(self._drain, slot, name=f"kit observer drain {slot.stats.observer}")

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
                if slot.stats.dropped == 1:
                    _log.warning("observer %s: queue full (or hub closed), dropping its events",
                                 slot.stats.observer)
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
                slot.scope.cancel()  # a drain stuck in emit: its thread is abandoned
            with anyio.move_on_after(CLOSE_TIMEOUT):
                for slot in self._slots:
                    await slot.done.wait()
            for slot in self._slots:
                slot.receive.close()
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
            # Not under the drain's limiter: trio holds an abandoned thread's token until that
            # thread ends, and close() must not wait for an emit stuck forever.
            await anyio.to_thread.run_sync(method, abandon_on_cancel=True)

    async def _close_observer(self, slot: _Slot) -> None:
        with anyio.move_on_after(CLOSE_TIMEOUT) as scope:
            try:
                await self._call(slot, "close")
            except Exception:
                _log.exception("observer %s: close() raised", slot.stats.observer)
        if scope.cancelled_caught:
            _log.warning("observer %s: close() took more than %s s; abandoned",
                         slot.stats.observer, CLOSE_TIMEOUT)

    async def _drain(self, slot: _Slot) -> None:
        try:
            with slot.scope:
                while True:
                    try:
                        batch = [await slot.receive.receive()]
                    except (anyio.EndOfStream, anyio.ClosedResourceError):
                        return
                    # A first batch of one event measures the observer within a thread crossing,
                    # before the queue can fill behind it.
                    limit = LOOP_BATCH_MAX if slot.on_loop else BATCH_MAX if slot.measured else 1
                    slot.measured = True
                    while len(batch) < limit:
                        try:
                            batch.append(slot.receive.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    if slot.on_loop:
                        took = self._deliver(slot, batch)
                    else:
                        took = await anyio.to_thread.run_sync(
                            self._deliver, slot, batch, limiter=slot.limiter, abandon_on_cancel=True)
                    # An observer whose batches take under FAST_PER_EVENT each is delivered on
                    # the loop from then on; one that turns slow goes back to its thread.
                    slot.on_loop = took / len(batch) < FAST_PER_EVENT
                    if slot.on_loop:
                        await anyio.lowlevel.checkpoint()  # let runs go between batches
        finally:
            slot.done.set()

    def _deliver(self, slot: _Slot, batch: list[Event]) -> float:
        """One batch, in order (worker thread, or the loop once proven fast); counts, disables
        and re-enables the observer. Returns the wall time it took (the crossing excluded)."""
        started = time.perf_counter()
        stats, emit = slot.stats, slot.observer.emit
        for event in batch:
            if slot.retry_at is not None:
                if self._clock() < slot.retry_at:
                    stats.skipped += 1
                    continue
                slot.retry_at = None  # this event is the trial
            try:
                emit(event)
            except Exception:
                stats.errors += 1
                slot.failures += 1
                if slot.failures >= DISABLE_AFTER:
                    slot.retry_at = self._clock() + slot.backoff
                    stats.disabled += 1
                    _log.warning("observer %s raised %d times in a row; disabled for %.0f s",
                                 stats.observer, slot.failures, slot.backoff, exc_info=True)
                    slot.backoff = min(slot.backoff * 2, RETRY_MAX)
            else:
                stats.delivered += 1
                if slot.failures:
                    slot.failures, slot.backoff = 0, RETRY_MIN
        return time.perf_counter() - started
