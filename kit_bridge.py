"""kit_bridge: the asyncio loop that plays the engines when kit runs under trio.

Owns: ``Bridge`` (one asyncio loop in a daemon thread, or another bridge's, the calls into it,
the mailbox out of it, and the calls and iterators the loop has played on the trio side),
``shared`` (the bridge whose loop a trio run's callers share),
``on_asyncio`` (await an engine coroutine from asyncio or trio alike; under trio on that shared
loop), ``clock`` (the running loop's own clock, read without a backend lookup), ``later`` (a
timer no task waits on, where the loop has one) and ``spawn`` (a background asyncio task that
outlives the call that starts it). This is the only kit module that touches asyncio directly.

Must never: know what a run, an event or a store is (it carries opaque items), block the trio
side, or wake the trio side once per item.

Theory of operation
-------------------
openai-agents and LangGraph are asyncio-only (notes/ENGINES.md section 9). Under trio the Runtime
starts a ``Bridge`` of its own (its mailbox) on the loop of the trio run's ``shared`` bridge, and
every SDK object lives on that loop: what a caller keeps from one deck to the next (a model's
client and its pooled connections) stays bound to a loop that lives as long as the trio run.
``call`` runs a coroutine function there and waits for it from trio; cancelling the trio caller
cancels the asyncio task and waits, bounded by ``CANCEL_TIMEOUT``, for it to unwind (so a run
records how it ended before its caller goes on). Items travel the other way through a
mailbox: ``post`` (engine side) appends and wakes the trio side at most once per batch: an
ordinary item waits up to ``WAKE_DELAY`` so one wake-up carries many (about 0.4 us per item
instead of 16-70 us per crossing, notes/PERF.md section 5); an urgent one wakes it at once,
and none is needed for what a ``call``'s caller takes itself as the call ends.
``pump`` (trio side) hands each item to its handler in order. ``post_and_wait`` is ``post`` for
an item whose handler must finish before the engine goes on. ``call_trio`` is ``call`` the other
way (a tool on the loop that calls the deck): the loop awaits a future the trio side resolves.
``iter_trio`` is ``call_trio`` for an async iterator (a tool reading a stream of the deck): one
trio task iterates it into a buffer of ``CROSS_BATCH`` items, and each crossing takes what is
there, up to that many: bounded, and never one crossing per item while items are waiting.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import math
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import sniffio

from kit_core import DeckStateError

__all__ = ("Bridge", "shared", "on_asyncio", "clock", "later", "spawn", "WAKE_DELAY",
           "CANCEL_TIMEOUT", "STOP_TIMEOUT", "CROSS_BATCH")

#: Ordinary items wait up to this long before waking the trio side, so one wake-up carries many
#: (PERF.md section 5, strategy D); urgent items wake it at once.
WAKE_DELAY = 0.002
#: How long a cancelled ``call`` waits for its asyncio task to unwind (a run recording its end).
CANCEL_TIMEOUT = 10.0
#: Items an async iterator crossing to the loop (``Bridge.iter_trio``) carries per crossing, and
#: how far its trio side reads ahead of the loop's reader at most: a crossing costs two thread
#: wake-ups, so a streamed reply's deltas cross a batch at a time, never an unbounded buffer.
CROSS_BATCH = 32
#: How long ``stop`` waits for the loop's thread to finish its tasks before abandoning it (a
#: daemon thread: it never keeps the process from exiting).
STOP_TIMEOUT = 10.0


class Bridge:
    """One asyncio loop in a daemon thread, hosting every SDK object while kit runs on trio; or,
    given ``host``, that bridge's loop, with a mailbox of its own (``stop`` leaves the loop).

    Make it and ``start()`` it on trio; ``call`` and ``pump`` from trio; ``post``,
    ``post_and_wait``, ``call_trio``, ``iter_trio`` and ``to_kit`` from the loop's thread;
    ``soon`` from trio.
    """

    def __init__(self, host: Bridge | None = None) -> None:
        self.loop = host.loop if host is not None else asyncio.new_event_loop()
        self._thread = host._thread if host is not None else threading.Thread(
            target=self._main, name="kit-bridge", daemon=True)
        self._hosted = host is not None
        self._mail: deque[Any] = deque()
        self._lock = threading.Lock()
        self._armed = 0  # 0: no wake-up pending, 1: a delayed one, 2: an immediate one
        self._taken = 0  # how many times ``take`` emptied the mailbox: a delayed wake-up's batch
        self._timer: asyncio.TimerHandle | None = None  # the delayed wake-up (loop side)
        self._token: Any = None
        self._wake: Any = None  # a trio.Event: what ``pump`` waits on

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
        self._wake = trio.Event()
        if not self._hosted:
            self._thread.start()

    async def stop(self) -> None:
        """Stop the loop (its tasks are cancelled) and wait for its thread, at most
        ``STOP_TIMEOUT``; a thread that will not end is left behind (it is a daemon). A hosted
        bridge's loop is its host's: left running."""
        if not self._hosted and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            with anyio.move_on_after(STOP_TIMEOUT):
                await anyio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)

    async def call(self, fn: Callable[..., Awaitable[Any]], *args: Any, takes: bool = False) -> Any:
        """Trio side: ``await fn(*args)`` on the loop; its result, or its exception re-raised.
        ``takes``: the caller ``take``s the mailbox once the call returns or raises (a run's
        play, whose end it commits), so a delayed wake-up pending as ``fn`` ends is cancelled
        (``_unarm``), unless the caller has left already (``CANCEL_TIMEOUT``).

        An asyncio cancellation that did not come from this caller (the loop stopping) is a
        ``DeckStateError``: the deck closed under the call. (trio's own primitives, not anyio's:
        this side is trio only, and anyio's find their backend through sniffio each time.)
        """
        import trio
        done, token, box = trio.Event(), self._token, {}
        task: list[asyncio.Task[Any]] = []

        async def play() -> None:
            try:
                box["result"] = await fn(*args)
            except BaseException as exc:  # noqa: BLE001 - carried to the trio side
                box["error"] = exc
            finally:
                if takes and not box.get("left"):
                    self._unarm()
                token.run_sync_soon(done.set)

        # A caller cancelled already has its task's cancel sent with its start: sent after it,
        # the cancel came once this thread had the GIL back, which the loop's thread, woken
        # by the start, often held until ``fn`` had run to its end (a run whose caller was
        # cancelled before it began then played to its end, its end recorded as completed).
        # (A deadline of inf, the usual one, needs no clock read.)
        deadline = trio.current_effective_deadline()
        cancelled = deadline != math.inf and deadline <= trio.current_time()

        def start() -> None:
            task.append(self.loop.create_task(play()))
            if cancelled:
                self.loop.call_soon(task[0].cancel)

        # A fresh context: the task must not inherit the trio thread's context variables
        # (sniffio's among them would make anyio believe the loop is trio).
        self.loop.call_soon_threadsafe(start, context=contextvars.Context())
        try:
            await done.wait()
        except BaseException:
            # The cancel is queued behind the task's first step: a task cancelled before it
            # starts never runs its coroutine, so ``fn`` would record nothing (a run no end)
            # and ``done`` would wait out CANCEL_TIMEOUT.
            if not cancelled:
                self.loop.call_soon_threadsafe(lambda: self.loop.call_soon(task[0].cancel))
            with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_TIMEOUT):
                await done.wait()  # the engine side records how the run ended before we go on
            box["left"] = not done.is_set()
            raise
        if "error" in box:
            if isinstance(box["error"], asyncio.CancelledError):
                raise DeckStateError("CLOSED", "finish the run") from None
            raise box["error"]
        return box["result"]

    def on_loop(self) -> bool:
        """Whether the caller runs on the loop's thread."""
        return threading.get_ident() == self._thread.ident

    async def call_trio(self, fn: Callable[[], Awaitable[Any]],
                        start_soon: Callable[[Callable[[], Awaitable[None]]], None]) -> Any:
        """Loop side: ``await fn()`` on the trio side, in a task ``start_soon`` starts there;
        its result, or its exception re-raised. The loop is never blocked: what ``fn`` does may
        need it (a blocking ``from_thread.run`` would deadlock a call that plays on this loop).
        Cancelling the awaiting task cancels ``fn``'s and waits for it to end, bounded by
        ``CANCEL_TIMEOUT``; ``fn`` cancelled on the trio side cancels the awaiting task."""
        future: asyncio.Future[Any] = self.loop.create_future()
        box: dict[str, Any] = {}

        def reply(result: Any, error: BaseException | None) -> None:
            self.loop.call_soon_threadsafe(_resolve, future, result, error)

        async def play() -> None:  # trio side
            with anyio.CancelScope() as scope:
                box["scope"] = scope
                if box.get("cancelled"):
                    scope.cancel()
                try:
                    result = await fn()
                except anyio.get_cancelled_exc_class():
                    self.loop.call_soon_threadsafe(future.cancel)
                    raise
                except BaseException as exc:  # noqa: BLE001 - the caller's, carried to the loop
                    reply(None, exc)
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                else:
                    reply(result, None)

        def start() -> None:  # trio side
            try:
                start_soon(play)
            except BaseException as exc:  # noqa: BLE001 - (the task group has ended)
                reply(None, exc)

        def cancel() -> None:  # trio side
            if "scope" in box:
                box["scope"].cancel()
            box["cancelled"] = True

        self._token.run_sync_soon(start)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                self._token.run_sync_soon(cancel)
                await asyncio.wait({future}, timeout=CANCEL_TIMEOUT)
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: asyncio logs one nobody retrieves
            raise

    async def iter_trio(self, fn: Callable[[], AsyncIterator[Any]],
                        start_soon: Callable[[Callable[[], Awaitable[None]]], None]
                        ) -> AsyncIterator[Any]:
        """Loop side: the items of ``fn()``, an async iterator made and iterated on the trio
        side in one task ``start_soon`` starts there (``_Feed``: its cancel scopes stay in one
        task), ``CROSS_BATCH`` at most per crossing (``call_trio``) and read at most that far
        ahead; its exception is raised here after the items before it. Nothing starts before
        the first item is asked for. Left early (``aclose``, or a ``break`` once the generator
        is collected) or cancelled, it closes ``fn()``'s iterator there and waits, bounded by
        ``CANCEL_TIMEOUT``, for it to end. An iterator stopped from the trio side (its deck
        closing) is a ``DeckStateError``."""
        fed: list[_Feed] = []

        async def start() -> None:  # trio side, where anyio's scopes and events must be made
            fed.append(_Feed(fn))
            try:
                start_soon(fed[0].run)
            except BaseException:
                fed[0].close()
                raise

        await self.call_trio(start, start_soon)
        feed = fed[0]
        try:
            while items := await self.call_trio(feed.take, start_soon):
                for item in items:
                    if isinstance(item, _Raised):
                        raise item.error
                    yield item
            if not feed.ended:
                raise DeckStateError("CLOSED", "read the stream")
        finally:
            with contextlib.suppress(DeckStateError):  # (its deck closed: so did the iterator)
                await self.call_trio(feed.stop, start_soon)

    def soon(self, fn: Callable[[], Any]) -> None:
        """Trio side: call ``fn()`` on the loop's thread, soon."""
        self.loop.call_soon_threadsafe(fn)

    def to_kit(self, fn: Callable[[], Any]) -> None:
        """Loop side: call ``fn()`` on the trio thread, soon."""
        self._token.run_sync_soon(fn)

    def post(self, item: Any, urgent: bool = False) -> None:
        """Loop side: queue ``item`` for ``pump``; wake the trio side at most once per batch."""
        with self._lock:
            self._mail.append(item)
            armed = self._armed
            if armed == 2 or (armed and not urgent):
                return  # a wake-up is on its way already: the common case, per item
            self._armed, batch = 2 if urgent else 1, self._taken
        if urgent:
            self._token.run_sync_soon(self._set)
        else:
            self._timer = self.loop.call_later(WAKE_DELAY, self._wake_later, batch)

    def _unarm(self) -> None:
        """Loop side: cancel the delayed wake-up pending, if any, as a ``call`` whose caller
        takes the mailbox ends: left to fire, it woke this thread 2 ms later for nothing, in
        the middle of the next short turn. A post after this arms another, which the caller's
        ``take`` makes a no-op."""
        with self._lock:
            if self._armed != 1:
                return  # none, or an immediate one on its way
            self._armed, timer, self._timer = 0, self._timer, None
        if timer is not None:
            timer.cancel()

    def _wake_later(self, batch: int) -> None:
        """Loop side: the delayed wake-up of the batch that began at ``take`` number ``batch``,
        unless an urgent one came first or that batch was taken already: a crossing costs the
        trio side a thread wake-up, so none is spent on an empty mailbox, nor on a later batch
        WAKE_DELAY early (a run played through ``call`` is taken at its end: under trio, each
        short run's timer fired in the run after it, taking that one's first events mid-run)."""
        with self._lock:
            if self._armed != 1 or batch != self._taken:
                return
            self._armed = 2
        self._token.run_sync_soon(self._set)

    async def post_and_wait(self, item: Any) -> None:
        """Loop side: ``post`` ``(item, reply)`` urgently and wait until the trio side settles
        ``reply`` (``settle(reply, error)``); raises the error it was settled with."""
        reply = self.loop.create_future()
        self.post((item, reply), urgent=True)
        await reply

    def settle(self, reply: Any, error: BaseException | None) -> None:
        """Trio side: answer a ``post_and_wait`` (``error`` None: it succeeded)."""
        self.loop.call_soon_threadsafe(_settle, reply, error)

    @property
    def backlog(self) -> int:
        """Items posted and not yet taken (read from either side: a racy snapshot)."""
        return len(self._mail)

    def _set(self) -> None:
        self._wake.set()  # type: ignore[union-attr]

    def take(self) -> list[Any]:
        """Trio side: everything in the mailbox, oldest first."""
        import trio
        with self._lock:
            items = list(self._mail)
            self._mail.clear()
            self._armed, self._taken = 0, self._taken + 1
            if self._wake.is_set():  # an unset one may be what ``pump`` waits on: keep it
                self._wake = trio.Event()
        return items

    async def pump(self, handle: Callable[[Any], None]) -> None:
        """Trio side, forever: hand each mailbox item to ``handle``, in order. ``handle`` is
        synchronous: a batch is handed over without yielding (and without a coroutine per
        item, hundreds a streamed reply)."""
        while True:
            await self._wake.wait()  # type: ignore[union-attr]
            for item in self.take():
                handle(item)


class _Feed:
    """Trio side: what ``Bridge.iter_trio`` iterates there: ``fn()``'s items, sent by one task
    (``run``) into a buffer of ``CROSS_BATCH``, taken by the loop side a batch at a time
    (``take``: ``[]`` at the end); ``stop`` ends it. ``ended``: ``fn()``'s iterator ran to its
    end, or raised (``_Raised``, its last item), rather than being stopped."""

    def __init__(self, fn: Callable[[], AsyncIterator[Any]]) -> None:
        self.fn, self.ended = fn, False
        self.send, self.receive = anyio.create_memory_object_stream[Any](CROSS_BATCH)
        self.scope, self.done = anyio.CancelScope(), anyio.Event()

    async def run(self) -> None:
        try:
            with self.scope:
                await self._iterate()
        except anyio.BrokenResourceError:
            pass  # the reader left
        finally:
            self.send.close()
            if not self.ended:  # stopped: a reader waiting hears of it
                self.receive.close()
            self.done.set()

    async def _iterate(self) -> None:
        iterator = None
        try:
            iterator = self.fn()
            async for item in iterator:
                await self.send.send(item)
            self.ended = True
        except anyio.BrokenResourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - the reader's, after the items before it
            self.ended = True
            await self.send.send(_Raised(exc))
        finally:
            if getattr(iterator, "aclose", None) is not None:
                await iterator.aclose()  # type: ignore[union-attr]

    async def take(self) -> list[Any]:
        ends = (anyio.EndOfStream, anyio.ClosedResourceError)
        try:
            items = [await self.receive.receive()]
        except ends:
            return []
        with contextlib.suppress(anyio.WouldBlock, *ends):
            while len(items) < CROSS_BATCH:
                items.append(self.receive.receive_nowait())
        return items

    async def stop(self) -> None:
        self.scope.cancel()
        with anyio.move_on_after(CANCEL_TIMEOUT):
            await self.done.wait()
        self.close()

    def close(self) -> None:
        self.send.close()
        self.receive.close()


class _Raised:
    """What an iterator crossing to the loop (``Bridge.iter_trio``) raised, sent after its items."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def _settle(reply: asyncio.Future[Any], error: BaseException | None) -> None:
    if not reply.done():
        if error is None:
            reply.set_result(None)
        else:
            reply.set_exception(error)


#: Under trio, the ``Bridge`` whose loop ``on_asyncio`` calls and decks share, per trio run (by
#: its token): what a caller keeps between calls (an OpenAI client's pooled connections, a Redis
#: session's lock) is bound to the asyncio loop that first used it, so every call plays on that
#: one loop. A loop of its own per call (or per deck) closed after it, and the next call over a
#: connection pooled there failed (``APIConnectionError``).
_SHARED: dict[Any, Bridge] = {}


def shared() -> Bridge:
    """Trio side: the ``Bridge`` this trio run's callers share (started by the first, stopped
    when the trio run ends)."""
    import trio
    token = trio.lowlevel.current_trio_token()
    bridge = _SHARED.get(token)
    if bridge is None:
        bridge = _SHARED[token] = Bridge()
        bridge.start()
        trio.lowlevel.spawn_system_task(_hold, token, bridge)
    return bridge


async def on_asyncio(fn: Callable[[], Awaitable[Any]]) -> Any:
    """Await ``fn()`` on an asyncio loop: this one, or under trio the ``shared`` bridge's."""
    if sniffio.current_async_library() == "asyncio":
        return await fn()
    return await shared().call(fn)


def clock() -> Callable[[], float]:
    """The running event loop's clock, the one ``anyio.current_time`` reads, as a plain callable
    (the asyncio loop's ``time``, trio's ``current_time``): anyio's looks the backend up through
    sniffio at each call, about 1 us, and the write path reads the clock every turn."""
    if sniffio.current_async_library() == "trio":
        import trio
        return trio.current_time
    return asyncio.get_running_loop().time


def later() -> Callable[[float, Callable[[], None]], Any] | None:
    """The running asyncio loop's ``call_later``: ``later(seconds, fn)`` calls ``fn()`` on the
    loop that long after, and returns a handle whose ``cancel()`` stops it. No task waits for it:
    a timer that finds nothing to do costs no task's wake-up (the writer's timer, armed for every
    turn's first event). None under trio, which has no such call."""
    if sniffio.current_async_library() == "trio":
        return None
    return asyncio.get_running_loop().call_later


async def _hold(token: Any, bridge: Bridge) -> None:
    """A trio system task: keeps the run's shared bridge until the run ends (its system tasks
    are cancelled then), then stops it."""
    try:
        await anyio.sleep_forever()
    finally:
        del _SHARED[token]
        with anyio.CancelScope(shield=True):
            await bridge.stop()


def spawn(fn: Callable[[], Awaitable[Any]], bridge: Bridge | None = None
          ) -> Callable[[], Awaitable[None]]:
    """Start ``fn()`` as an asyncio task: on this loop (asyncio), or on ``bridge``'s (called from
    trio). Returns ``stop``: awaited from where ``spawn`` was called, it cancels the task and
    waits for it to end. Unlike a task group, the task may be stopped from any task, not only
    from the one that started it (a store opened in one task and closed in another)."""
    if bridge is None:
        task = asyncio.get_running_loop().create_task(fn())
        return functools.partial(_stop_task, task)
    box: list[asyncio.Task[Any]] = []
    bridge.loop.call_soon_threadsafe(lambda: box.append(bridge.loop.create_task(fn())),
                                     context=contextvars.Context())

    async def stop() -> None:
        await bridge.call(lambda: _stop_task(box[0]))  # queued after the create: box is filled

    return stop


async def _stop_task(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
