"""kit_sse: a run's events as a server-sent-events response, from the frame bytes to the socket.

Owns: SSE framing (``sse_frame``), compact one-line JSON (``dumps``), the translation of a run's
events into frames (``native_frame`` for kit's own wire, ``v1_frame`` and ``v1_workflow_frame``
for the v1.2.1 wire, ``data_frames`` for bare ``data:`` frames such as the Chat Completions
chunks), kit's frame that ends a stream before its run ended (``ending_frame``: the server
stopping, or the run's events failing) and one open SSE response (``Stream``: its reader, writer
and disconnect watcher, which keeps its ping timer).

Must never: route, read a request body, answer with JSON or know a deck (kit_http does), hold a
frame it could send, or end the run it streams: a disconnect ends the stream, never the run.

Theory of operation
-------------------
A ``Stream`` is a *writer* (the only task that sends) and a *disconnect watcher* (Hypercorn
never raises on a send to a closed connection, only ``receive()`` tells: CONVENTIONS A8); the
writer is fed by a *reader* of the run's events, which appends their frames to the stream's
``ready`` list (at most ``STREAM_BUFFER``) and wakes the writer once it waits for the next event,
so the writer sends every frame that is ready in one ``http.response.body`` message (the per-send
cost dominates, not bytes: notes/PERF.md section 4). The reader is a task of its own because only
its waiting tells that no more frames are ready (events that come through generators have no
"what is ready" of their own), except at first: events that can tell (a ``ready()`` saying the
next comes without waiting: a deck's run streams, ``kit_runs.RunEvents``) are read by the
handler itself for as long as they are ready, and the reader and the watcher start only if the
stream would then wait, so a short run whose events are all committed is one task and one send
(which needs no watcher: nothing waits). The watcher also keeps the ping timer, so the writer's
waits carry none: once the writer sent nothing for ``PING_INTERVAL``, it tells the writer to send
``: ping``.
Whichever of writer and watcher ends first cancels the rest, except that the watcher ends
by itself after the body's end (``receive()`` then says ``http.disconnect``: ASGI), the writer
cancelling it only if it does not; the frames ready when the reader is done go out with the
body's end, in its last message. ``Stream.stop`` (the server
shutting down) ends it within ``STOP_GRACE`` with a closing frame naming the run, which the
client picks up with ``GET /runs/{id}/events`` and ``Last-Event-ID`` (every frame's ``id`` is its
event's seq; ``data_frames`` carry none). That frame is the wire's, as every other frame is
(``play``'s ``ending``), and so is the one that ends a stream whose events failed before the
run's end (the store down past its bound): kit's own wires send ``ending_frame`` (``event:
server.shutdown``, or ``event: error`` naming the error's type); a wire whose clients ignore event
names, such as OpenAI's, sends what its clients read as an ending, never a frame they would take
for one more chunk.
"""
from __future__ import annotations

import json
import re
from contextlib import nullcontext
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import anyio
import orjson

from kit_core import (
    Event, NodeUpdated, RunCancelled, RunCompleted, RunFailed, RunInterrupted, RunPaused,
    RunSleeping, RunStoppedError, TextDelta, stops,
)

__all__ = (
    "Stream", "sse_frame", "dumps", "native_frame", "v1_frame", "v1_workflow_frame", "data_frames",
    "ending_frame", "run_id_header", "PING_INTERVAL", "STREAM_BUFFER", "STOP_GRACE",
)

#: A comment line every 15 s keeps a quiet stream open through proxies (WHATWG HTML 9.2.7).
PING_INTERVAL = 15.0
#: Frames waiting for the writer. A full buffer makes the reader wait, never the run: the run
#: keeps its own live buffer and catches a lagging reader up from the log. 0 acts as 1: one
#: frame per send (no coalescing).
STREAM_BUFFER = 256
#: On shutdown: how long in-flight requests may take before they are cancelled, and how long a
#: stream's writer may take to hand its last frame to a slow client.
STOP_GRACE = 5.0

Message = MutableMapping[str, Any]  # the ASGI vocabulary, as Starlette spells it
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
FrameOf = Callable[[Event], "bytes | None"]
#: (the run id, the error or None) -> the frame that ends a stream before its run ended: the
#: server stopping it (None), or its events failing (the error, whose message may hold content).
Ending = Callable[[str, "Exception | None"], bytes]

_PING = {"type": "http.response.body", "body": b": ping\n\n", "more_body": True}
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store"),
                (b"x-accel-buffering", b"no")]
_HEADER_SAFE = re.compile(r"[\x21-\x7e]{1,200}")  # a run id we echo in x-kit-run-id


def run_id_header(run_id: str | None) -> list[tuple[bytes, bytes]]:
    """The ``x-kit-run-id`` header naming ``run_id``; none for a run id a header cannot carry."""
    return [(b"x-kit-run-id", run_id.encode())] if run_id and _HEADER_SAFE.fullmatch(run_id) else []


# ====================================================================================== frames ====

def sse_frame(data: str, *, event: str | None = None, id: str | None = None) -> bytes:
    """One server-sent event: ``id:``, ``event:`` and ``data:`` lines, then a blank line.

    ``data`` is one line (kit sends compact JSON); ``id`` and ``event`` must not contain CR, LF or
    NUL, which would forge fields or events (WHATWG HTML 9.2.5; CONVENTIONS A11). Raises
    ``ValueError`` for any of those.
    """
    head = ""
    for name, value in (("id", id), ("event", event)):
        if value is not None:
            if "\n" in value or "\r" in value or "\0" in value:
                raise ValueError(f"an SSE {name} cannot contain CR, LF or NUL: {value!r}")
            head += f"{name}: {value}\n"
    if "\n" in data or "\r" in data:
        raise ValueError("SSE data must be a single line")
    return f"{head}data: {data}\n\n".encode()


def dumps(obj: Any) -> str:
    """Compact one-line JSON: orjson, or the stdlib for what orjson refuses (huge integers, lone
    surrogates)."""
    try:
        return orjson.dumps(obj).decode()
    except TypeError:  # ASCII escapes: a lone surrogate a model produced still encodes
        return json.dumps(obj, separators=(",", ":"), default=str)


def native_frame(ev: Event) -> bytes:
    return sse_frame(dumps(ev.to_json()), event=ev.kind, id=str(ev.seq))


def v1_frame(ev: Event, agent: bool = True) -> bytes | None:
    """The v1.2.1 wire: ``data:`` per delta or node, then ``done``, ``interrupt`` or ``error``."""
    p = ev.payload
    if type(p) is TextDelta:  # the frame per token: sse_frame's bytes, made at once
        try:  # orjson's JSON is one line (it escapes CR and LF) and a seq is digits
            return b'id: %d\ndata: {"delta":%s}\n\n' % (ev.seq, orjson.dumps(p.text))
        except TypeError:  # a lone surrogate: dumps' stdlib fallback
            return sse_frame(dumps({"delta": p.text}), id=str(ev.seq))
    seq = str(ev.seq)
    if type(p) is NodeUpdated:
        return sse_frame(dumps({"node": p.node, "update": p.update}), id=seq)
    if isinstance(p, RunCompleted):
        done = {"output": p.output, "usage": p.usage.to_json()} if agent else {"output": p.output}
        return sse_frame(dumps(done), event="done", id=seq)
    if isinstance(p, (RunInterrupted, RunSleeping)):
        payload = p.payload if isinstance(p, RunInterrupted) else {"kind": "sleep", "until": p.until}
        return sse_frame(dumps({"type": "interrupt", "payload": payload, "thread_id": p.thread_id,
                                "run_id": ev.run_id}), event="interrupt", id=seq)
    if isinstance(p, RunFailed):
        return sse_frame(dumps({"error": p.error}), event="error", id=seq)
    if isinstance(p, (RunCancelled, RunPaused)):  # what Deck.run raises for them
        return sse_frame(dumps({"error": RunStoppedError.__name__}), event="error", id=seq)
    return None


def v1_workflow_frame(ev: Event) -> bytes | None:
    return v1_frame(ev, agent=False)


def data_frames(items: list[Any]) -> bytes | None:
    """Bare ``data:`` frames (the Chat Completions wire names no events), JSON or ``[DONE]``.
    No ``id:`` either, as OpenAI sends none: the ``openai`` SDK keeps the last one and reads the
    blank line of each later ``: ping`` as an event with empty data, which it fails to parse."""
    return b"".join(sse_frame(i if isinstance(i, str) else dumps(i)) for i in items) or None


def ending_frame(run_id: str, error: Exception | None = None) -> bytes:
    """kit's frame that ends a stream before its run ended (no ``id``: it is no event of the
    log): ``event: server.shutdown`` naming the run when the server stops it; ``event: error``
    naming the error's type when its events failed (a failed run's ``run.failed`` came first)."""
    if error is not None:
        return sse_frame(dumps({"error": type(error).__name__}), event="error")
    return sse_frame(dumps({"run_id": run_id}), event="server.shutdown")


# ====================================================================================== stream ====

class Stream:
    """One open SSE response: ``play`` it once; ``stop`` it from outside (the server stopping).
    The handler that plays it is its writer; its reader and watcher are tasks of their own once
    it has to wait for events.

    Between its reader and its writer, ``ready`` holds the frames made and not yet sent (at most
    ``STREAM_BUFFER``); ``wake`` is set when the writer waits for frames, ``room`` when the
    reader waits for the writer to take them, and ``read`` tells the writer nothing more comes
    (``drained``: the events ran to their end).
    ``sent_at`` is when the writer last sent; the watcher raises ``ping`` once it is
    ``PING_INTERVAL`` ago (so the writer's waits carry no timer). ``over``: the writer sent the
    body's end; ``left``: the watcher heard ``http.disconnect``.
    """
    __slots__ = ("reader", "scope", "stopping", "finished", "ready", "wake", "room", "read",
                 "drained", "sent_at", "ping", "over", "left")

    def __init__(self) -> None:
        self.reader: anyio.CancelScope | None = None  # the reader task's, once it reads
        self.scope: anyio.CancelScope | None = None  # the whole stream
        self.stopping = self.finished = self.read = self.ping = self.over = self.left = False
        self.drained = False
        self.sent_at = 0.0
        self.ready: list[bytes] = []
        self.wake: anyio.Event | None = None
        self.room: anyio.Event | None = None

    def nudge(self) -> None:
        """Wake the writer if it waits for frames (its ``wake``)."""
        if self.wake is not None:
            self.wake.set()
            self.wake = None

    def stop(self) -> None:
        self.stopping = True
        if self.reader is not None:
            self.reader.cancel()
        if self.scope is not None:
            self.scope.deadline = anyio.current_time() + STOP_GRACE

    async def play(self, send: Send, receive: Receive, run_id: str, first: Event | None,
                   events: AsyncIterator[Event], frame_of: FrameOf,
                   ending: Ending = ending_frame) -> None:
        """Send the headers, then the frames of ``first`` and ``events`` (``frame_of`` makes
        them; None skips an event) until the run ends or parks, the client leaves or ``stop``,
        which ends it with ``ending(run_id, None)`` unless the run had ended; events that fail
        before the run's end end it with ``ending(run_id, error)``. Closes ``events``
        (which ends the stream, never the run)."""
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": _SSE_HEADERS + run_id_header(run_id)})
            ready = getattr(events, "ready", None)  # (Deck.stream's: kit_runs.RunEvents)
            if ready is not None:  # what is ready first, in this task (it never waits)
                await _read(first, events, frame_of, self, run_id, ending, ready)
                first = None
            with anyio.CancelScope() as self.scope:
                if self.stopping:  # stopped before it played: the grace bounds it all the same
                    self.scope.deadline = anyio.current_time() + STOP_GRACE
                self.sent_at = anyio.current_time()
                if self.read:  # all of it was ready: no task
                    return await _write(send, self, run_id, ending)
                async with anyio.create_task_group() as tg:  # the rest comes later
                    tg.start_soon(_watch, receive, self)
                    tg.start_soon(_read, first, events, frame_of, self, run_id, ending)
                    await _write(send, self, run_id, ending)
                    if not self.left:
                        # The response is complete, so receive() says http.disconnect now (ASGI;
                        # Hypercorn queues it within the last send): one pass lets the watcher
                        # take it and end, which costs less than cancelling its wait, the fallback.
                        await anyio.lowlevel.checkpoint()
                        if not self.left:
                            tg.cancel_scope.cancel()
        finally:
            if not self.drained:  # (events that ran to their end need no shielded aclose)
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()


async def _watch(receive: Receive, stream: Stream) -> None:
    """The disconnect watcher: Hypercorn says a client left only through ``receive()``, which
    says so too once the response is complete (then it ends the watcher, not the stream). It
    also tells the writer to ping once the writer sent nothing for ``PING_INTERVAL``, cancelling
    the ``receive()`` it waits in: Hypercorn's is a queue's get (asyncio.Queue, a trio memory
    channel), which a cancel leaves the message in."""
    since = stream.sent_at  # quiet since then, as far as the watcher knows
    while True:
        with anyio.CancelScope(deadline=since + PING_INTERVAL) as quiet:
            if (await receive())["type"] == "http.disconnect":
                break
        if not quiet.cancelled_caught:
            continue
        if stream.sent_at > since:  # the writer sent meanwhile: quiet since its last send
            since = stream.sent_at
            continue
        stream.ping, since = True, anyio.current_time()
        stream.nudge()
    stream.left = True
    if not stream.over:  # the client left
        stream.scope.cancel()  # type: ignore[union-attr]


async def _read(ev: Event | None, events: AsyncIterator[Event], frame_of: FrameOf,
                stream: Stream, run_id: str, ending: Ending,
                ready: Callable[[], bool] | None = None) -> None:
    """The reader: the frames of ``ev`` and the run's events into ``stream.ready``, until the
    run ends or parks; ``stream.read`` then tells the writer. An error before the run's end
    becomes the wire's frame for it (``ending(run_id, error)``). A frame waits while
    ``STREAM_BUFFER`` wait for the writer (never the run: the run keeps its own live buffer). No
    loop pass per frame: the writer wakes once a burst is in, when the reader waits for the next
    event. With ``ready`` (the handler, before the stream's tasks start) it reads only while
    ``ready()`` says the next event comes without waiting and the buffer has room, leaving
    ``stream.read`` unset if it stops short (its task reads on)."""
    limit, short = max(STREAM_BUFFER, 1), False
    try:
        if stream.stopping:  # stopped before it read
            return
        # (the handler's reading never waits: nothing for ``stop`` to cancel)
        with anyio.CancelScope() if ready is None else nullcontext() as stream.reader:
            try:
                while True:
                    if ev is not None:
                        if (frame := frame_of(ev)) is not None:
                            if len(frames := stream.ready) < limit:  # (_put, with no coroutine)
                                frames.append(frame)
                                if stream.wake is not None:
                                    stream.nudge()
                            else:
                                await _put(stream, frame, limit)
                        if ev.payload.ends is not None:
                            stream.finished = True
                    if ready is not None and (len(stream.ready) >= limit or not ready()):
                        short = True
                        return
                    try:  # left to end by itself: a generator it holds is closed
                        ev = await events.__anext__()
                    except StopAsyncIteration:
                        stream.drained = True
                        break
                stream.finished = True
            except stops():
                raise
            except BaseException as exc:  # a user's BaseException that failed the run, too
                if not stream.finished:  # Deck.stream raises a failed run's error after run.failed
                    stream.finished = True
                    await _put(stream, ending(run_id, exc), limit)
    finally:
        if not short:
            stream.read = True
            stream.nudge()


async def _put(stream: Stream, frame: bytes, limit: int) -> None:
    """``frame`` for the writer, once fewer than ``limit`` frames wait for it."""
    while len(stream.ready) >= limit:
        stream.room = room = anyio.Event()
        await room.wait()
    stream.ready.append(frame)
    stream.nudge()


async def _write(send: Send, stream: Stream, run_id: str, ending: Ending) -> None:
    """The writer: every frame that is ready goes out in one body message; a ping when quiet;
    ``ending(run_id, None)`` last if ``stop`` ended the stream before the run ended."""
    tail = b""
    while True:
        if stream.ready:
            batch, stream.ready = stream.ready, []
            if stream.room is not None:
                stream.room.set()
                stream.room = None
            if stream.read:  # the last frames: they end the body (one send less)
                tail = b"".join(batch)
                break
            message = {"type": "http.response.body", "body": b"".join(batch), "more_body": True}
        elif stream.read:
            break
        elif stream.ping:
            message = _PING
        else:
            stream.wake = wake = anyio.Event()
            await wake.wait()
            continue
        await _send(send, message, stream)
        stream.ping, stream.sent_at = False, anyio.current_time()  # (a ping due meanwhile is not)
    if stream.stopping and not stream.finished:  # the client picks the run up later
        tail += ending(run_id, None)
    stream.over = True
    await _send(send, {"type": "http.response.body", "body": tail, "more_body": False}, stream)


async def _send(send: Send, message: Message, stream: Stream) -> None:
    try:
        await send(message)
    except OSError:  # servers that follow ASGI 2.4 raise on a closed connection: a disconnect
        if stream.scope is not None:
            stream.scope.cancel()
        await anyio.lowlevel.checkpoint()
