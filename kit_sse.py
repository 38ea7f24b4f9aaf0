"""kit_sse: a run's events as a server-sent-events response, from the frame bytes to the socket.

Owns: SSE framing (``sse_frame``), compact one-line JSON (``dumps``), the translation of a run's
events into frames (``native_frame`` for kit's own wire, ``v1_frame`` and ``v1_workflow_frame``
for the v1.2.1 wire, ``data_frames`` for bare ``data:`` frames such as the Chat Completions
chunks), kit's frame that ends a stream before its run ended (``ending_frame``: the server
stopping, or the run's events failing) and one open SSE response (``Stream``: its reader, writer and disconnect watcher).

Must never: route, read a request body, answer with JSON or know a deck (kit_http does), hold a
frame it could send, or end the run it streams: a disconnect ends the stream, never the run.

Theory of operation
-------------------
A ``Stream`` is a *writer* (the only task that sends) and a *disconnect watcher* (Hypercorn
never raises on a send to a closed connection, only ``receive()`` tells: CONVENTIONS A8); the
writer is fed by a *reader* of the run's events through a bounded channel (``STREAM_BUFFER``), so
it sends every frame that is ready in one ``http.response.body`` message (the per-send cost
dominates, not bytes: notes/PERF.md section 4) and pings every ``PING_INTERVAL`` while a run is
quiet. Whichever of writer and watcher ends first cancels the rest. ``Stream.stop`` (the server
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

import functools
import json
import re
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
#: Frames waiting for the writer. A full channel makes the reader wait, never the run: the run
#: keeps its own live buffer and catches a lagging reader up from the log.
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
            return b"id: %d\ndata: %s\n\n" % (ev.seq, orjson.dumps({"delta": p.text}))
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
    """One open SSE response: ``play`` it once; ``stop`` it from outside (the server stopping)."""
    __slots__ = ("reader", "scope", "stopping", "finished")

    def __init__(self) -> None:
        self.reader = anyio.CancelScope()  # the reader of the run's events
        self.scope: anyio.CancelScope | None = None  # the whole stream
        self.stopping = self.finished = False

    def stop(self) -> None:
        self.stopping = True
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
        send_frames, frames = anyio.create_memory_object_stream[bytes](STREAM_BUFFER)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": _SSE_HEADERS + run_id_header(run_id)})
            async with anyio.create_task_group() as tg:
                self.scope = tg.cancel_scope
                if self.stopping:  # stopped before it played: the grace bounds it all the same
                    self.scope.deadline = anyio.current_time() + STOP_GRACE
                tg.start_soon(_watch, receive, tg.cancel_scope)
                tg.start_soon(_read, first, events, frame_of, send_frames, self,
                              functools.partial(ending, run_id))
                await _write(send, frames, self, functools.partial(ending, run_id, None))
                tg.cancel_scope.cancel()
        finally:
            frames.close()
            send_frames.close()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def _watch(receive: Receive, scope: anyio.CancelScope) -> None:
    """The disconnect watcher: Hypercorn says a client left only through ``receive()``."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _read(first: Event | None, events: AsyncIterator[Event], frame_of: FrameOf, out: Any,
                stream: Stream, failed: Callable[[Exception], bytes]) -> None:
    """The reader: the frames of the run's events into the writer's channel, until the run ends
    or parks; closing the channel tells the writer. An error before the run's end becomes the
    wire's frame for it (``failed``)."""
    with out, stream.reader:
        try:
            if first is not None and (frame := frame_of(first)) is not None:
                await out.send(frame)
            async for ev in events:  # left to end by itself: a generator it holds is closed
                if (frame := frame_of(ev)) is not None:
                    try:  # no loop pass per frame: the writer wakes once a burst is in
                        out.send_nowait(frame)
                    except anyio.WouldBlock:
                        await out.send(frame)
                stream.finished = stream.finished or ev.payload.ends is not None
            stream.finished = True
        except stops():
            raise
        except BaseException as exc:  # a user's BaseException that failed the run, too
            if not stream.finished:  # Deck.stream raises a failed run's error after run.failed
                stream.finished = True
                await out.send(failed(exc))


async def _write(send: Send, frames: Any, stream: Stream, closing: Callable[[], bytes]) -> None:
    """The writer: every frame that is ready goes out in one body message; a ping when quiet;
    ``closing()`` last if ``stop`` ended the stream before the run ended."""
    ended = False
    while not ended:
        batch: list[bytes] = []
        with anyio.move_on_after(PING_INTERVAL):
            try:
                batch.append(await frames.receive())
            except anyio.EndOfStream:
                break
        if not batch:
            await _send(send, _PING, stream)
            continue
        while True:
            try:
                batch.append(frames.receive_nowait())
            except anyio.WouldBlock:
                break
            except anyio.EndOfStream:
                ended = True
                break
        await _send(send, {"type": "http.response.body", "body": b"".join(batch), "more_body": True},
                    stream)
    tail = b""
    if stream.stopping and not stream.finished:  # the client picks the run up later
        tail = closing()
    await _send(send, {"type": "http.response.body", "body": tail, "more_body": False}, stream)


async def _send(send: Send, message: Message, stream: Stream) -> None:
    try:
        await send(message)
    except OSError:  # servers that follow ASGI 2.4 raise on a closed connection: a disconnect
        if stream.scope is not None:
            stream.scope.cancel()
        await anyio.lowlevel.checkpoint()
