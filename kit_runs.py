"""kit_runs: a run being played, as the kit side holds it, and the live stream of its events.

Owns: ``Run`` (the engine's ``RunHandle`` for one run, plus what the kit side keeps of it: its
spec, its cancel scope and end, the parent it ends with, the view of its conversation whose
items wait for its end, and the live buffer a stream of it reads), the live reader
(``Run.events``), the iterator a stream of a run is (``RunEvents``: its events, and whether the
next is ready), ``LIVE_MAX`` (how far behind a reader may fall) and ``result_of`` (what a
run returns to its caller, from its last event).

Must never: write an event or a claim (every event reaches the log through the Runtime's one
write path, ``kit_runtime``), reach the store but through the ``read`` it is given, or know
what an engine is.

Theory of operation: the Runtime puts each event of a run into the writer's buffer and, when
someone streams the run, into the run's live buffer (``feed``); each commit moves the run's
``committed`` seq on (``on_commit``). ``events`` yields from the live buffer up to the run's
terminal or parking event: each event as it arrives, or, for a reader that acknowledges events
outside the process (``committed=True``), each once it is durable (such a reader hurries the
writer instead of waiting out its timer). A run has one reader, its stream: when it leaves (a
consumer that stops iterating, an HTTP client gone), the run plays on into the log alone,
neither buffering its events nor hurrying the writer for nobody. A reader that falls
``LIVE_MAX`` events behind costs no memory: its buffer is dropped and it reads the rest from the
log (``read``, which commits what is buffered first), which has every event: a page
(``READ_PAGE``) at a time, each yielded before the next is read, then the live buffer again
from where the last page ended. A committed reader can tell whether its next event is ready
(``Run.ready``: the run committed past what it read), so a consumer that coalesces its sends
(kit_sse) sends what it holds only before it would wait.
"""
from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from kit_core import (
    Event, InterruptResult, InvocableSpec, RunCompleted, RunHandle, RunInterrupted, RunPaused,
    RunSleeping, RunStatus, RunStoppedError, StoreUnavailableError, TurnResult,
)
from kit_storebase import READ_PAGE
from kit_writer import Writer

__all__ = ("Run", "RunEvents", "LIVE_MAX", "result_of")

#: A stream's live buffer. A consumer that falls this far behind is not allowed to grow memory:
#: its buffer is dropped and it catches up from the log (which has every event) instead.
LIVE_MAX = 10_000


class Run(RunHandle):
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
        # Its conversation, as kit_sessions gives it to a run: what the run adds is written
        # just before its end is committed (``Runtime._to_session``), never by a run cut off.
        self.session: Any = None
        self.live: deque[Event] | None = deque() if streaming else None
        self.committed = -1
        self.read_seq = -1  # the seq its reader yielded last (``events``) ...
        self.read_all = False  # ... and whether that was its last (terminal or parking)
        self.wake: Any = None  # made by the reader when it waits (``events``)
        self.lagged = False
        self.commit_reader = False  # its reader waits for commits, not for events
        self.over = False  # its play has returned (``finish``)
        self._done: Any = None  # made by the first to wait for it, on its side (``wait_done``)
        self.scope = writer.cancel_scope()  # (the backend's own: cheaper under trio)
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
        elif self.wake is not None:
            self.wake.set()

    def ready(self) -> bool:
        """Kit side: whether its committed reader's next step waits for nothing: its next
        event is committed and in hand (the live buffer, or the batch the reader took from it),
        or, after its last, the run's play has returned. False for any other reader, or one
        that catches up from the log."""
        return self.commit_reader and not self.lagged and (
            self.over if self.read_all else self.committed > self.read_seq)

    def on_commit(self, seq: int) -> None:
        self.committed = seq
        if self.wake is not None:
            self.wake.set()

    def finish(self) -> None:
        """Its play has returned: wake who waits for its end, and its reader. Called on the side
        the run was played on (the engine side for a child run)."""
        self.over = True
        if self._done is not None:
            self._done.set()
        if self.wake is not None:
            self.wake.set()

    async def wait_done(self) -> None:
        """Until ``finish``; awaited on the side that calls it. Its event is made only when
        someone waits before the end (most runs: nobody)."""
        if not self.over:
            if self._done is None:
                self._done = anyio.Event()
            await self._done.wait()

    async def events(self, after: int, committed: bool = False) -> AsyncIterator[Event]:
        """Kit side: this run's events after ``after``, live, until a terminal/parking one;
        with ``committed``, each only once it is durable. Once the reader leaves, the run keeps
        no live buffer (its events go to the log alone)."""
        last, self.commit_reader = after, committed
        self.read_seq = after

        def ready() -> int:
            live = self.live
            return len(live) if not committed else _count_upto(live, self.committed)  # type: ignore[arg-type]

        try:
            while True:
                if self.lagged:
                    self.lagged = False
                    try:
                        backlog = await self._read(self.run_id, last)
                    except StoreUnavailableError as exc:  # what its caller was told, if so
                        raise self.abort_error or exc from None
                    if len(backlog) >= READ_PAGE:  # a full page: the next one, once this is yielded
                        self.lagged = True
                else:
                    n = ready()
                    if not n:
                        if self.over and (not self.live or self.abort_error is not None
                                          or not self._writer.holds(self.run_id)):
                            # The run is over and what is left will not commit now: an aborted
                            # run's tail waits for the store; a refused one is not the log's.
                            return
                        if self.live:
                            self._writer.hurry()  # what is left waits for its commit: commit soon
                        self.wake = anyio.Event()
                        if not ready() and not (self.over and not self.live):
                            await self.wake.wait()
                        continue
                    backlog = [self.live.popleft() for _ in range(n)]  # type: ignore[union-attr]
                for ev in backlog:
                    if ev.seq <= last:
                        continue
                    last = self.read_seq = ev.seq
                    self.read_all = ev.payload.ends is not None
                    yield ev
                    if self.read_all:
                        return
        finally:  # its reader left, or read to the end: nothing is kept, nor hurried, for it
            self.live, self.commit_reader, self.wake = None, False, None


class RunEvents:
    """A stream of a run's events (what ``Deck.stream``, ``stream_answer`` and
    ``stream_resume`` return): an async iterator over ``events(self)``, which sets ``run`` once
    it started or took over its run; ``ready`` tells whether the next event comes without
    waiting (``Run.ready``), so a consumer that coalesces sends what it holds first."""
    __slots__ = ("run", "_events")

    def __init__(self, events: Callable[[RunEvents], AsyncIterator[Event]]) -> None:
        self.run: Run | None = None
        self._events = events(self)

    def __aiter__(self) -> RunEvents:
        return self

    def __anext__(self) -> Awaitable[Event]:
        return self._events.__anext__()

    def aclose(self) -> Awaitable[None]:
        return self._events.aclose()

    def ready(self) -> bool:
        return self.run is not None and self.run.ready()


def _count_upto(live: deque[Event], seq: int) -> int:
    """How many events at the front of ``live`` have a seq at most ``seq``."""
    n = 0
    for ev in live:
        if ev.seq > seq:
            break
        n += 1
    return n


def result_of(run: Run, end: Event) -> Any:
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
