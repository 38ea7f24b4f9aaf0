"""kit_writer: group commit: events reach the store in batches, nothing is dropped, memory is bounded.

Owns: ``Writer``, the one buffer between the runs and the event store: batching (``FLUSH_MAX`` /
``FLUSH_DELAY``, or ``HURRY_DELAY`` when a reader is waiting: ``hurry``), retrying a batch the
store fails to take (bounded backoff, forever: a batch is never dropped), telling the Runtime
when the store has been down too long (``give_up``), and backpressure (``room``: runs wait while
the backlog is full).

Must never: drop an event it was given (a batch the store *refuses* for a run, a busy session or a
fenced seq, is that run's refusal, not a loss: the run's caller gets the error), lose a batch to a
cancellation, block the event loop, or know what a run or an engine is.

Theory of operation
-------------------
``put`` appends to the buffer and never awaits; a batch's first event arms the loop's timer
(``kit_bridge.later``), which wakes the writer task only if the batch still waits FLUSH_DELAY
later (HURRY_DELAY once a reader waits for it: ``hurry`` brings the timer forward): a turn that
commits its own end first (every short one, streamed or not) costs the task no wake-up, where
two, a cancel scope and a timeout's cancellation were ~0.2 ms a turn between idle gaps (a loop
with no such timer, trio, has the task wait out the delay itself). ``flush`` takes the whole
buffer as one batch and appends it in one store transaction (PERF.md section 3: ~5 us per event
in batches against ~31 us per single-event commit), with the claims of the runs starting in it.
Then ``committed`` gets the batch: the observers and the live readers of the runs learn only
what is durable (DESIGN 4.6).

Two kinds of failure. A ``KitError`` from the store is a *refusal* (``SessionBusyError``,
``LogConflictError``): the batch is split by run and each run retried alone, so one run's refusal
never costs another run its events; the refused run's error waits in ``failed`` for its next
durable write to raise, and ``refused`` is told at once (a run that plays on would write around
the hole its refused events leave). Anything else is the store being *down* (a locked file, a lost
connection, a full disk): the same batch is retried with backoff (``RETRY_FIRST`` doubling to
``RETRY_MAX``), forever, while new events gather behind it. After ``STORE_DOWN_LIMIT`` seconds of
that, ``give_up`` is told which runs are stuck, once per outage, so their callers learn it (the
runs stop; their ends are written with the rest when the store returns).

The append itself is shielded from cancellation (a networked store's commit must not be
abandoned half-way), unless the store ``commits_inline`` (SQLite's, memory's: no pause within a
commit, so nothing to shield, and a scope less per commit); a cancellation while backing off
puts the batch back at the front of the buffer. ``room`` is how runs wait while ``pending``
(buffered plus in flight) is at ``BACKLOG_MAX``: a run never runs more than about a batch ahead
of its log.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import sniffio

from kit_core import Claim, Event, KitError

__all__ = ("Writer", "FLUSH_MAX", "FLUSH_DELAY", "HURRY_DELAY", "BACKLOG_MAX", "RETRY_FIRST",
           "RETRY_MAX", "STORE_DOWN_LIMIT")

#: A batch is committed when this many events wait, or FLUSH_DELAY after the first one arrived
#: (HURRY_DELAY when a reader waits for it): a slow stream is visible to other processes within
#: FLUSH_DELAY, a fast one pays one commit per FLUSH_MAX events.
FLUSH_MAX = 256
FLUSH_DELAY = 0.02
#: A hurried batch (a reader waits for it) is committed this long after its oldest event
#: arrived, not FLUSH_DELAY: the events a run makes meanwhile ride the same commit (a short
#: streamed turn is one commit and one send, not one per burst), at a bounded cost to latency.
#: 2 ms sufficed on a fast machine; on one three times slower a short turn outlasted it and
#: went out in two commits and two sends. Its first token came 0.2-0.5 ms later at 5 ms.
HURRY_DELAY = 0.005
#: Events buffered or being committed before runs must wait (``room``): one batch committing and
#: one gathering. Bounds the memory an outage of the store can cost, and how far a run can run
#: ahead of its log.
BACKLOG_MAX = 2 * FLUSH_MAX
#: Backoff while the store is down: first sleep, doubled up to RETRY_MAX (seconds).
RETRY_FIRST = 0.05
RETRY_MAX = 2.0
#: How long the store may take no writes before the stuck runs are stopped and their callers
#: told (``StoreUnavailableError``); the Runtime reads ``KIT_STORE_DOWN_SECONDS``.
STORE_DOWN_LIMIT = 30.0

_log = logging.getLogger("kit.writer")
#: What a store that ``commits_inline`` is appended in, in place of a shield (reusable).
_UNSHIELDED = contextlib.nullcontext()


def _cancel_scope() -> Callable[..., Any]:
    """The running backend's cancel-scope class, looked up once: anyio's looks the backend up
    through sniffio at each call (~2 us a scope), and every turn makes two scopes. Trio's own
    under trio (anyio's wraps it: the same scope underneath); under asyncio the class
    ``anyio.CancelScope()`` builds there, called directly (the same constructor and scope)."""
    if sniffio.current_async_library() == "trio":
        import trio
        return trio.CancelScope
    return type(anyio.CancelScope())


class Writer:
    """The group-commit buffer in front of an ``EventStorePort``.

    ``committed(events)`` is called with every batch once it is durable, in order (led by the
    ``run.failed`` of the runs its claims abandoned, which ``append`` returns); ``give_up(
    run_ids, error, seconds)`` once per outage that lasts ``down_limit``; ``refused(run_id,
    error)`` when the store refuses a run's events; ``clock`` (default: anyio's) is the
    running loop's clock (``kit_bridge.clock``), ``later`` its timer (``kit_bridge.later``;
    None: the writer task waits out FLUSH_DELAY itself). Kit side only.
    """

    def __init__(self, store: Any, committed: Callable[[Sequence[Event]], None],
                 give_up: Callable[[set[str], BaseException, float], None], *,
                 down_limit: float = STORE_DOWN_LIMIT,
                 refused: Callable[[str, BaseException], None] | None = None,
                 clock: Callable[[], float] | None = None,
                 later: Callable[[float, Callable[[], None]], Any] | None = None) -> None:
        self.store, self._committed, self._give_up = store, committed, give_up
        self._refused = refused
        self.down_limit = down_limit
        self._buf: list[Event] = []
        self._first_at = 0.0  # when the oldest buffered event arrived
        self._claims: dict[str, Claim] = {}
        self._in_flight: list[Event] = []
        # ``flush``'s, free as a rule, taken without a checkpoint: a semaphore of one, a lock
        # with no owner to look up (anyio's Lock looks the current task up to take it and again
        # to release it: ~1 us a commit, two getpid calls under asyncio).
        self._lock = anyio.Semaphore(1, max_value=1, fast_acquire=True)
        self._wake = anyio.Event()  # something to write
        self._hurry = anyio.Event()  # someone waits for it: write now
        self._drained = anyio.Event()  # the backlog went below BACKLOG_MAX
        self.failed: dict[str, BaseException] = {}
        # ``now()`` is the loop's clock (``clock``: anyio's looks the backend up at each read)
        # and ``cancel_scope`` its scope class (``_cancel_scope``): the commit's shield and each
        # run's scope (``kit_runs.Run.scope``) are entered every turn.
        self.now, self.cancel_scope = clock or anyio.current_time, _cancel_scope()
        self._shielded = not getattr(store, "commits_inline", False)  # (``_append``)
        # The loop's timer (``kit_bridge.later``), when it has one: the first event of a batch
        # arms it (``_due``), and the writer task wakes only when a batch is due, not for every
        # turn whose own durable write commits its events before FLUSH_DELAY.
        self._later, self._timer = later, None
        self.down_since: float | None = None  # when the store stopped taking writes
        self._told: set[str] = set()  # runs give_up was told of during this outage

    @property
    def pending(self) -> int:
        """Events given to the writer and not yet committed."""
        return len(self._buf) + len(self._in_flight)

    def pending_runs(self) -> set[str]:
        """The runs with events not yet committed."""
        return {e.run_id for e in self._buf} | {e.run_id for e in self._in_flight}

    def holds(self, run_id: str) -> bool:
        """Whether any of the run's events still waits to be committed."""
        return any(e.run_id == run_id for e in self._buf) or any(
            e.run_id == run_id for e in self._in_flight)

    def put(self, event: Event, claim: Claim | None = None) -> None:
        self._buf.append(event)
        if claim is not None:
            self._claims[claim.run_id] = claim
        n = len(self._buf)
        if n == 1:
            self._first_at = self.now()
            if self._later is None:
                self._wake.set()
            elif self._timer is None or self._hurry.is_set():  # (not a past batch's timer)
                self._arm(self._delay())
        elif n >= FLUSH_MAX:
            self._wake.set()

    def _arm(self, delay: float) -> None:
        """The loop's timer, to call ``_due`` ``delay`` from now (a timer armed before, off)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._later(delay, self._due)  # type: ignore[misc]

    def _delay(self) -> float:
        """How long after its oldest event the buffered batch is due."""
        return HURRY_DELAY if self._hurry.is_set() else FLUSH_DELAY

    def _due(self) -> None:
        """The timer: wake the writer task if the oldest buffered event is due (``_delay``), or
        run again when it will be; with nothing buffered (a run committed its own), nothing."""
        self._timer = None
        if self._buf:
            left = self._first_at + self._delay() - self.now()
            if left > 0:
                self._arm(left)
            else:
                self._wake.set()

    def hurry(self) -> None:
        """A reader waits for what is buffered: commit it HURRY_DELAY after its oldest event
        arrived, not at the next FLUSH_DELAY tick (events that arrive during that commit ride
        the next one: classic group commit). With the loop's timer, the timer is brought
        forward: a run that commits its own end sooner (a short streamed turn) costs the task no
        wake-up, where waking it to wait out the delay cost two."""
        if self._hurry.is_set():  # (once a batch: a stream hurries at every event)
            return
        self._hurry.set()
        if self._later is not None and self._buf:
            self._arm(max(0.0, self._first_at + HURRY_DELAY - self.now()))

    async def room(self) -> None:
        """Wait while the backlog is full (while the store is down, until it is back or the
        Runtime stops the waiting run through ``give_up``)."""
        while self.pending >= BACKLOG_MAX:
            if self._drained.is_set():
                self._drained = anyio.Event()
            await self._drained.wait()

    async def flush(self) -> None:
        """Commit everything buffered (and what arrives while an earlier flush runs). Returns
        once it is durable, or refused for its runs (``failed``); waits out an outage. One flush
        at a time: the lock, free as a rule, is taken without a checkpoint (an await of
        ``acquire`` costs a backend lookup and a cancellation check per commit); a cancellation
        lands in the backoff while the store is down, or at the caller's next checkpoint."""
        lock = self._lock
        try:
            lock.acquire_nowait()
        except anyio.WouldBlock:
            await lock.acquire()
        try:
            batch, self._buf = self._buf, []
            if not batch:
                return
            if self._hurry.is_set():  # the next batch is hurried only if a reader waits for it
                self._hurry = anyio.Event()
            claims, self._claims = self._claims, {}
            if claims:
                for ev in batch:
                    if ev.payload.ends == "terminal":  # its lease would be deleted in the batch
                        claims.pop(ev.run_id, None)
            self._in_flight = batch
            try:
                await self._append(batch, claims)
            except BaseException:  # cancelled while backing off: the batch goes back in front,
                self._buf[:0] = batch  # and the writer task takes over its retries
                self._claims = {**claims, **self._claims}
                if batch:
                    self._first_at = min(self._first_at, self.now() - FLUSH_DELAY)
                    self._wake.set()
                raise
            finally:
                self._in_flight = []
                if self.pending < BACKLOG_MAX:
                    self._drained.set()
        finally:
            lock.release()

    async def _append(self, batch: list[Event], claims: dict[str, Claim]) -> None:
        """Append ``batch`` for good, removing from it (and its runs' ``claims``) what is done
        (committed, or refused for its run), so a cancellation leaves in them exactly what still
        has to be written: a refused run's claim put back would be refused again with the next
        batch, costing the runs in it their events."""
        delay = RETRY_FIRST
        while True:
            try:
                with self.cancel_scope(shield=True) if self._shielded else _UNSHIELDED:
                    overtaken = await self.store.append(batch, claims=list(claims.values()))
            except KitError as exc:  # refused: split by run, so it costs only the refused run
                runs = sorted({e.run_id for e in batch})
                if len(runs) == 1:
                    self.failed[runs[0]] = exc
                    batch.clear()
                    if self._refused is not None:
                        self._refused(runs[0], exc)
                    return
                for run_id in runs:
                    part = [e for e in batch if e.run_id == run_id]
                    await self._append(part, {run_id: claims[run_id]} if run_id in claims else {})
                    batch[:] = [e for e in batch if e.run_id != run_id]
                    claims.pop(run_id, None)
                return
            except Exception as exc:  # the store is down: wait and try the same batch again
                self._outage(batch, exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                continue
            if self.down_since is not None:
                _log.warning("the event store takes writes again after %.1f s",
                             self.now() - self.down_since)
                self.down_since, self._told = None, set()
            done = [*(overtaken or ()), *batch]  # their ends committed first, observed too
            batch.clear()
            self._committed(done)
            return

    def _outage(self, batch: list[Event], exc: Exception) -> None:
        now = self.now()
        if self.down_since is None:
            self.down_since = now
            _log.warning("the event store refused a batch of %d events (%s: %s); retrying",
                         len(batch), type(exc).__name__, exc)
        if now - self.down_since >= self.down_limit:
            stuck = self.pending_runs() - self._told
            if stuck:
                self._told |= stuck
                self._give_up(stuck, exc, now - self.down_since)

    async def run(self) -> None:
        """The writer task: flush when FLUSH_MAX events wait, or FLUSH_DELAY (HURRY_DELAY when
        hurried) after the oldest buffered one arrived. A run's durable write (``flush``) that
        empties the buffer meanwhile restarts the clock: a short turn is not cut in two. With
        the loop's timer (``later``) the task is woken when a batch is due (``_due``; HURRY_DELAY
        once hurried), full, or put back by a cancelled flush."""
        try:
            await self._run()
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._later = None  # (the task is gone: a batch's first event wakes it no more)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._buf and len(self._buf) < FLUSH_MAX:
                hurried = self._hurry.is_set()
                delay = HURRY_DELAY if hurried else FLUSH_DELAY
                left = self._first_at + delay - self.now()
                if left <= 0:
                    break
                if hurried:  # let a batch gather
                    await anyio.sleep(left)
                else:
                    with anyio.move_on_after(left):
                        await self._hurry.wait()
            self._hurry = anyio.Event()
            if self._buf:
                await self.flush()
