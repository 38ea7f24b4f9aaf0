"""Tests of the HTTP surface (kit_http): a real Hypercorn on a loopback port with both workers,
httpx and httpx-sse as the client, the bytes on the wire; the ASGI app driven directly for the
lifespan and disconnects (``kit-serve``, the process: test_kit_serve.py)."""
from __future__ import annotations

import contextlib
import gc
import gzip
import json
import logging
import operator
import os
import re
import socket
import subprocess
import sys
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import Annotated, TypedDict
from urllib.parse import quote

import anyio
import httpx
import pytest
from httpx_sse import aconnect_sse
from langgraph.graph import END, START, StateGraph

import kit
import kit_core
import kit_http
import kit_request
import kit_runtime
import kit_sse
from kit import Agent, Deck, RunStatus, ScriptedModel, Workflow
from kit_http import App
from kit_pg import PostgresStore
from kit_store import SQLiteStore
from kit_storebase import READ_PAGE
from kit_sse import sse_frame
from test_kit_control import Gate
from test_kit_mcp import gone

pytestmark = pytest.mark.anyio
HERE = Path(__file__).parent
JSON = {"content-type": "application/json"}
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-store",
               "x-accel-buffering": "no"}


@pytest.fixture(autouse=True)
def memory_store(monkeypatch):
    monkeypatch.setenv("KIT_STORE", "memory")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def served(deck: Deck, **options):
    """A real Hypercorn (the worker of the test's backend) serving ``App(deck, **options)`` on
    loopback."""
    app, port, stop = App(deck, **options), free_port(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(kit_http.serve, app, host="127.0.0.1", port=port,
                              shutdown_trigger=stop.wait))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                with anyio.fail_after(10):
                    while True:
                        try:
                            if (await client.get("/health")).status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        await anyio.sleep(0.02)
                yield client, app
        finally:
            stop.set()


class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


async def plan(state: State) -> dict:
    return {"log": ["plan"]}


async def ask(state: State) -> dict:
    answer = kit.interrupt({"question": "ship it?"})
    return {"log": [f"answer={answer}"]}


def graph(*nodes) -> StateGraph:
    g = StateGraph(State)
    previous = START
    for fn in nodes:
        g.add_node(fn.__name__, fn)
        g.add_edge(previous, fn.__name__)
        previous = fn.__name__
    g.add_edge(previous, END)
    return g


def echo() -> Agent:
    return Agent("echo", "Be brief.", model=ScriptedModel(["hello there world"], cycle=True))


def gated(*after) -> tuple[Gate, Agent]:
    """An agent "worker" whose first model call waits in a tool for the gate, then replies ``after``."""
    gate = Gate()
    return gate, Agent("worker", tools=[gate.wait_tool()],
                       model=ScriptedModel([{"tool": "wait", "args": {"step": 1}}, *after]))


def catalog(*extra: Agent) -> Deck:
    return Deck([echo(), *extra], [Workflow("plain", graph(plan)), Workflow("approve", graph(plan, ask))])


async def wire(client: httpx.AsyncClient, method: str, url: str, **kw) -> tuple[httpx.Response, bytes]:
    async with client.stream(method, url, **kw) as response:
        body = b"".join([chunk async for chunk in response.aiter_raw()])
    return response, body


async def first_frame_then_drop(client: httpx.AsyncClient, path: str, body: dict) -> tuple[str, bytes]:
    """POST over a raw socket, read up to the first SSE frame, then hang up (a lost client)."""
    data = json.dumps(body).encode()
    async with await anyio.connect_tcp("127.0.0.1", client.base_url.port) as conn:
        await conn.send(b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        reply = b""
        with anyio.fail_after(5):
            while b"\n\n" not in reply.partition(b"\r\n\r\n")[2]:
                reply += await conn.receive()
    head, _, rest = reply.partition(b"\r\n\r\n")
    run_id = re.search(rb"x-kit-run-id: (\w+)", head).group(1).decode()
    frame = rest.partition(b"\r\n")[2]  # after the chunk size line
    return run_id, frame[:frame.index(b"\n\n") + 2]


# ----------------------------------------------------------------------------- framing ----

def test_sse_frame_byte_for_byte():
    assert sse_frame('{"delta":"hi"}') == b'data: {"delta":"hi"}\n\n'
    assert sse_frame("{}", event="done", id="7") == b"id: 7\nevent: done\ndata: {}\n\n"
    assert sse_frame('"x"', id="") == b'id: \ndata: "x"\n\n'
    assert sse_frame('{"t":"\u00e9\u2028"}', event="e") == 'event: e\ndata: {"t":"\u00e9\u2028"}\n\n'.encode()
    # kit's own wires end a stream the server stops with this (the openai surface: its own)
    assert kit_sse.ending_frame("r1") == b'event: server.shutdown\ndata: {"run_id":"r1"}\n\n'
    assert kit_sse.ending_frame("r1", KeyError("secret")) == b'event: error\ndata: {"error":"KeyError"}\n\n'
    for bad in ("a\nb", "a\rb", "a\0b"):
        with pytest.raises(ValueError, match="CR, LF or NUL"):
            sse_frame("{}", event=bad)
        with pytest.raises(ValueError, match="CR, LF or NUL"):
            sse_frame("{}", id=bad)
    with pytest.raises(ValueError, match="single line"):
        sse_frame("{}\ndata: forged")
    # a delta's frame, made at once (the per-token path), is sse_frame's bytes, even for text
    # JSON escapes (CR, LF, quotes) and the lone surrogate only the stdlib encodes
    for text in ("hi", "", 'a\nb\r"c\\', "\u00e9\u2028", "\ud800x"):
        ev = kit_core.Event("r1", 12, kit_core.TextDelta(text))
        assert kit_sse.v1_frame(ev) == sse_frame(kit_sse.dumps({"delta": text}), id="12")


def test_public_surface_is_declared_and_hypercorn_is_not_imported():
    defined = {n for n, v in vars(kit_http).items() if not n.startswith("_")
               and getattr(v, "__module__", None) == "kit_http"}
    constants = {n for n in vars(kit_http) if n.isupper() and not n.startswith("_")}
    assert set(kit_http.__all__) == defined | constants
    out = subprocess.run([sys.executable, "-c", "import kit, sys; deck = kit.Deck(); app = deck.asgi(); "
                          "import kit_http; assert isinstance(app, kit_http.App) and app.deck is deck; "
                          "print('hypercorn' in sys.modules)"], cwd=HERE, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------ agents, JSON ----

async def test_health_chat_and_sessions_over_json():
    async with served(catalog()) as (client, app):
        health = await client.get("/health")
        assert health.json() == {"status": "ok", "agents": ["echo"], "workflows": ["approve", "plain"],
                                 "skills": []}
        r = await client.post("/agents/echo/chat", json={"message": "hi"})
        assert (r.status_code, r.json()) == (200, {"output": "hello there world"})
        assert r.headers["content-type"] == "application/json"
        run_id = r.headers["x-kit-run-id"]
        assert await app.deck.status(run_id) is RunStatus.COMPLETED
        r = await client.post("/agents/echo/chat", json={"session_id": "s1", "message": "again"})
        assert r.json() == {"output": "hello there world"}
        info = await app.deck.store.run_info(r.headers["x-kit-run-id"])
        assert (info.session_id, info.namespace) == ("s1", None)


async def test_unknown_names_routes_and_methods():
    async with served(catalog()) as (client, _):
        r = await client.post("/agents/nobody/chat", json={"message": "hi"})
        assert (r.status_code, r.json()["error"]) == (404, "UnknownNameError")
        r = await client.post("/agents/plain/chat", json={"message": "hi"})  # a workflow's name
        assert r.status_code == 404
        r = await client.post("/workflows/nobody", json={"input": {}})
        assert (r.status_code, r.json()["error"]) == (404, "UnknownNameError")
        r = await client.get("/nowhere")
        assert (r.status_code, r.json()["error"]) == (404, "RouteNotFoundError")
        r = await client.get("/agents/echo/chat")
        assert (r.status_code, r.json()["error"], r.headers["allow"]) == (405, "MethodNotAllowedError", "POST")
        r = await client.post("/v2/invocables/echo/chat", json={"input": "hi"})
        assert r.status_code == 404  # the native surface is not mounted by default
        r = await client.post("/runs/nope/pause", json={})
        assert (r.status_code, r.json()["error"]) == (404, "UnknownRunError")
        assert (await client.post("/runs/nope/resume")).status_code == 404
        assert (await client.get("/runs/nope/events")).status_code == 404


async def test_head_is_answered_as_get_without_the_body_but_on_streams():
    """RFC 9110 section 9.1: a server supports GET and HEAD (uptime monitors probe with HEAD;
    every GET route answered it 405)."""
    async with served(catalog()) as (client, _):
        for path in ("/health", "/openapi.json", "/workflows/pending", "/"):
            got, head = await client.get(path), await client.head(path)
            assert (head.status_code, head.content) == (200, b""), path
            assert head.headers["content-type"] == got.headers["content-type"], path
            assert head.headers["content-length"] == str(len(got.content)), path
        run_id = (await client.post("/agents/echo/chat", json={"message": "hi"})).headers["x-kit-run-id"]
        r = await client.head(f"/runs/{run_id}/events")  # a stream: its headers come with it
        assert (r.status_code, r.headers["allow"]) == (405, "GET")
        r = await client.head("/agents/echo/chat")
        assert (r.status_code, r.headers["allow"]) == (405, "POST")
        assert (await client.head("/nowhere")).status_code == 404
        r = await client.post("/health")  # the routes that take HEAD say so when refusing
        assert (r.status_code, r.headers["allow"]) == (405, "GET, HEAD")
        assert (await client.get("/health")).json()["status"] == "ok"  # the connection goes on


async def test_a_name_on_the_wrong_route_points_to_the_right_one():
    async with served(catalog()) as (client, _):
        r = await client.post("/agents/approve/chat", json={"message": "hi"})
        assert (r.status_code, r.json()["error"]) == (404, "UnknownNameError")
        assert "'approve' is a workflow: POST /workflows/approve" in r.json()["message"]
        r = await client.post("/workflows/echo", json={"input": {}})
        assert r.status_code == 404 and "'echo' is an agent: POST /agents/echo/chat" in r.json()["message"]
        r = await client.post("/workflows/echo/t1/resume", json={"value": 1})
        assert r.status_code == 404 and "POST /agents/echo/chat" in r.json()["message"]


async def test_every_post_route_refuses_unknown_and_missing_keys_naming_them():
    async with served(catalog()) as (client, app):
        r = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t1"})
        run_id = r.headers["x-kit-run-id"]
        refused = [  # (route, body, the key the 400 names)
            ("/workflows/approve/t1/resume", {"answer": "yes"}, "unknown key 'answer'"),
            ("/workflows/approve/t1/resume", {}, "needs 'value'"),
            ("/agents/echo/chat", {"message": "hi", "sesion_id": "s1"}, "unknown key 'sesion_id'"),
            ("/agents/echo/chat", {"session_id": "s1"}, "needs 'message'"),
            ("/workflows/plain", {"inputs": {"log": []}}, "unknown key 'inputs'"),
            ("/workflows/plain", {"thread_id": ""}, "'thread_id' must not be empty"),
            (f"/runs/{run_id}/pause", {"reasons": "lunch"}, "unknown key 'reasons'"),
            (f"/runs/{run_id}/cancel", {"why": "done"}, "unknown key 'why'"),
            (f"/runs/{run_id}/resume", {"value": 1}, "unknown key 'value'"),
        ]
        for route, body, named in refused:
            r = await client.post(route, json=body)
            assert (r.status_code, r.json()["error"]) == (400, "MalformedRequestError"), route
            assert named in r.json()["message"], (route, r.json())
        # Nothing was lost: the misspelt answer did not resume the thread, nor pause the run.
        assert await app.deck.status(run_id) is RunStatus.WAITING_HUMAN
        assert [p.run_id for p in await app.deck.pending()] == [run_id]
        # The v1 bodies that were valid stay valid.
        assert (await client.post("/agents/echo/chat", json={"message": "hi", "session_id": "s1"})).status_code == 200
        assert (await client.post("/workflows/plain", json={})).status_code == 200
        r = await client.post("/workflows/approve/t1/resume", json={"value": None})
        assert r.json()["output"] == {"log": ["plan", "answer=None"]}


async def test_an_integer_past_64_bits_is_a_400_that_writes_nothing_and_keeps_the_run_waiting():
    """LangGraph's checkpoints (msgpack) cannot store it: the run would fail at its first one,
    and an answer would turn a waiting run into a failed one."""
    big = b"18446744073709551616"  # 2**64
    async with served(catalog()) as (client, app):
        r = await client.post("/workflows/approve", content=b'{"input": {"n": %s}}' % big, headers=JSON)
        assert (r.status_code, r.json()["error"]) == (400, "ContentError")
        assert "beyond 64 bits" in r.json()["message"] and await app.deck.store.runs() == []
        r = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t1"})
        run_id = r.headers["x-kit-run-id"]
        for value in (big, b"[[-9223372036854775809]]", b'{"k": %s}' % big):
            r = await client.post("/workflows/approve/t1/resume", content=b'{"value": %s}' % value,
                                  headers=JSON)
            assert (r.status_code, r.json()["error"]) == (400, "ContentError"), value
        assert await app.deck.status(run_id) is RunStatus.WAITING_HUMAN
        assert [e.kind for e in await app.deck.store.read(run_id)][-1] == "run.interrupted"
        r = await client.post("/workflows/approve/t1/resume", json={"value": 2**64 - 1})
        assert r.json()["output"] == {"log": ["plan", f"answer={2**64 - 1}"]}


async def test_a_workflow_input_over_the_inline_cap_is_a_400_in_the_clients_terms():
    """The body is within MAX_BODY_BYTES, the input's JSON is over MAX_INLINE_BYTES: the answer
    names the workflow's input and what to do, not a Python class the client never sent."""
    async with served(catalog()) as (client, app):
        r = await client.post("/workflows/plain", json={"input": {"doc": "a" * kit.MAX_INLINE_BYTES}})
        assert (r.status_code, r.json()["error"]) == (400, "ContentError")
        message = r.json()["message"]
        assert message.startswith("the input of workflow 'plain' is 1000010 bytes of JSON"), message
        assert "a reference to it (a URI or an id) in the state" in message
        assert "Block" not in message and await app.deck.store.runs() == []


async def test_a_durable_workflow_without_thread_id_is_a_400_that_speaks_http():
    async with served(Deck(workflows=[Workflow("ship", graph(plan), durable=True)])) as (client, _):
        r = await client.post("/workflows/ship", json={"input": {}})
        assert (r.status_code, r.json()["error"]) == (400, "MalformedRequestError")
        assert "needs 'thread_id'" in r.json()["message"] and "session_id" not in r.json()["message"]
        r = await client.post("/workflows/ship", json={"input": {}, "thread_id": "t1"})
        assert r.json()["output"] == {"log": ["plan"]}


@pytest.mark.parametrize("body, headers, status, error", [
    (b'{"message": "\xff\xfe"}', JSON, 400, "MalformedRequestError"),  # invalid UTF-8
    (b'{"message": "hi", "session_id": "\\ud800"}', JSON, 400, "MalformedRequestError"),  # no text
    (b"[" * 100_000, JSON, 400, "MalformedRequestError"),  # RecursionError in the parser
    (b'{"message": ' + b"1" * 5000 + b"}", JSON, 400, "MalformedRequestError"),  # >4300 digits
    (b'{"a":' * 100 + b"1" + b"}" * 100, JSON, 400, "MalformedRequestError"),  # over MAX_JSON_DEPTH
    (b'{"message": NaN}', JSON, 400, "MalformedRequestError"),
    (b'["hi"]', JSON, 400, "MalformedRequestError"),  # not an object
    (b'{"message": 42}', JSON, 400, "MalformedRequestError"),
    (b"{}", JSON, 400, "MalformedRequestError"),  # no message
    (b'{"message": "hi"}', {"content-type": "text/plain"}, 415, "UnsupportedMediaTypeError"),
    (b'{"message": "hi"}', {}, 415, "UnsupportedMediaTypeError"),
    (gzip.compress(b'{"message": "hi"}'), {**JSON, "content-encoding": "gzip"}, 415,
     "UnsupportedMediaTypeError"),  # named, not "invalid start byte"
])
async def test_hostile_bodies_are_4xx_never_500(body, headers, status, error):
    async with served(catalog()) as (client, _):
        r = await client.post("/agents/echo/chat", content=body, headers=headers)
        assert (r.status_code, r.json()["error"]) == (status, error)
        assert set(r.json()) == {"error", "message"}
        assert (await client.post("/agents/echo/chat", json={"message": "hi"})).status_code == 200


async def test_a_key_given_twice_is_a_400_naming_it_never_its_last_value():
    """JSON leaves a repeated key's meaning open (RFC 8259 section 4), and parsers differ (the
    first value, the last, an error): a proxy or log reading the first would see another answer
    than the one kit played, which was the last."""
    async with served(catalog()) as (client, app):
        r = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t1"})
        run_id = r.headers["x-kit-run-id"]
        for route, body in (("/workflows/approve/t1/resume", b'{"value": "no", "value": "yes"}'),
                            ("/workflows/approve/t1/resume", b'{"value": {"ok": false, "ok": true}}'),
                            ("/agents/echo/chat", b'{"message": 5, "message": "hi"}')):
            r = await client.post(route, content=body, headers=JSON)
            assert (r.status_code, r.json()["error"]) == (400, "MalformedRequestError"), body
            assert "twice" in r.json()["message"] and "'" in r.json()["message"], r.json()
        assert await app.deck.status(run_id) is RunStatus.WAITING_HUMAN
        assert len(await app.deck.store.runs()) == 1
        r = await client.post("/workflows/approve/t1/resume", content=b'{"value": {"a": 1, "b": 1}}',
                              headers=JSON)
        assert r.status_code == 200


async def test_a_number_past_float_range_is_400_not_infinity():
    async with served(catalog()) as (client, _):
        r = await client.post("/workflows/approve", content=b'{"input": {"n": 1e999}}', headers=JSON)
        assert (r.status_code, r.json()["error"]) == (400, "MalformedRequestError")
        assert "the number 1e999 is out of range" in r.json()["message"]


async def test_a_request_refused_before_its_body_is_read_keeps_its_connection():
    """Refused by its path, method or host, the body still arriving: the connection stays
    usable for the client's next request (Hypercorn closed it, unannounced, when the body was
    unread at the response's end, so a pooled client's next request failed)."""
    body = b'{"message": "hi"}'
    async with served(catalog()) as (client, _):
        for head in (b"POST /nowhere HTTP/1.1\r\nhost: 127.0.0.1",
                     b"PUT /health HTTP/1.1\r\nhost: 127.0.0.1",
                     b"POST /agents/echo/chat HTTP/1.1\r\nhost: rebound.example"):
            async with await anyio.connect_tcp("127.0.0.1", client.base_url.port) as conn:
                await conn.send(head + b"\r\ncontent-type: application/json\r\n"
                                b"content-length: %d\r\n\r\n" % len(body))
                reply = b""
                with anyio.move_on_after(0.5):  # the refusal, if it comes before the body
                    reply += await conn.receive()
                await conn.send(body + b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                with anyio.fail_after(5):
                    while reply.count(b"HTTP/1.1 ") < 2 or not reply.endswith(b']}'):
                        try:
                            reply += await conn.receive()
                        except (anyio.EndOfStream, anyio.BrokenResourceError):
                            break
            statuses = re.findall(rb"HTTP/1.1 (\d+) ", reply)
            assert statuses[1:] == [b"200"], (head, reply)
            assert b"connection: close" not in reply.lower()


async def test_a_body_over_the_cap_is_413_before_it_is_read():
    async with served(catalog()) as (client, _):
        port = client.base_url.port
        async with await anyio.connect_tcp("127.0.0.1", port) as conn:  # httpx would send it all
            await conn.send(b"POST /agents/echo/chat HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
                            b"\r\ncontent-length: %d\r\n\r\n{" % (kit_request.MAX_BODY_BYTES + 1))
            reply = b""
            with anyio.fail_after(5):
                while b'"}' not in reply:
                    reply += await conn.receive()
        assert reply.startswith(b"HTTP/1.1 413 ") and b'{"error":"BodyTooLargeError"' in reply
        assert (await client.post("/agents/echo/chat", json={"message": "hi"})).status_code == 200


class Records(logging.Handler):
    """The records of one logger, kept (on that logger: whatever its parents propagate)."""

    def __init__(self, name: str, monkeypatch) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", [*logger.handlers, self])

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_refusal_before_the_body_ended_says_connection_close_and_logs_no_server_error(
        monkeypatch):
    """A 413 or 408 sent while the body is unfinished: the connection closes after it, so the
    answer says so, and ends with a chunk the client waits for. With a Content-Length answer an
    HTTP client had it all before its end-of-message went out; closing then, it raced that send
    against Hypercorn's trio worker's ``send_eof``, which logged ``BusyResourceError`` as an
    'Error in ASGI Framework' for about half of such refusals."""
    import h11
    monkeypatch.setattr(kit_request, "BODY_TIMEOUT", 0.05, raising=False)
    hypercorn = Records("kit_http.hypercorn", monkeypatch)
    async with served(catalog()) as (client, _):
        for length in [kit_request.MAX_BODY_BYTES + 1] * 10 + [100] * 10:  # 413s, then 408s
            peer = h11.Connection(h11.CLIENT)
            async with await anyio.connect_tcp("127.0.0.1", client.base_url.port) as conn:
                await conn.send(peer.send(h11.Request(method="POST", target="/agents/echo/chat", headers=[
                    ("host", "127.0.0.1"), ("content-type", "application/json"),
                    ("content-length", str(length))])) + peer.send(h11.Data(data=b"{")))
                got = []
                with anyio.fail_after(5):  # to the end of the answer, as an HTTP client reads it
                    while not got or type(got[-1]) is not h11.EndOfMessage:
                        event = peer.next_event()
                        if event is h11.NEED_DATA:
                            peer.receive_data(await conn.receive())
                        else:
                            got.append(event)
            assert got[0].status_code == (413 if length > 100 else 408)
            assert (b"connection", b"close") in got[0].headers
            assert json.loads(b"".join(e.data for e in got[1:-1]))["error"] in (
                "BodyTooLargeError", "RequestTimeoutError")
        await anyio.sleep(0.1)  # the server's side of the last connection has closed
    assert [(r.getMessage(), r.exc_info and r.exc_info[0].__name__) for r in hypercorn.records] == []


@pytest.mark.parametrize("head, sent", [
    (b"content-length: 100", b'{"message": '),  # the rest of its length never comes
    (b"transfer-encoding: chunked", b"c\r\n{\"message\": \r\n"),  # nor the next chunk
])
async def test_a_body_that_stops_arriving_is_a_408_not_a_request_held_for_good(monkeypatch, head, sent):
    """Hypercorn times out no read of an ASGI app's body (its read_timeout would end quiet SSE
    streams too): a client that sent its headers and stopped held its request, and a task,
    for good."""
    monkeypatch.setattr(kit_request, "BODY_TIMEOUT", 0.3, raising=False)
    async with served(catalog()) as (client, app):
        async with await anyio.connect_tcp("127.0.0.1", client.base_url.port) as conn:
            await conn.send(b"POST /agents/echo/chat HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                            b"content-type: application/json\r\n%s\r\n\r\n%s" % (head, sent))
            reply = b""
            with anyio.fail_after(5):  # the answer, then the server closes the connection
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                    while True:
                        reply += await conn.receive()
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        head, _, chunked = reply.partition(b"\r\n\r\n")  # one chunk, then the last
        assert b"\r\nconnection: close\r\n" in head and chunked.endswith(b"\r\n0\r\n\r\n")
        body = json.loads(chunked.split(b"\r\n")[1])
        assert body["error"] == "RequestTimeoutError" and "0.3 s" in body["message"], body
        with anyio.fail_after(5):  # the request's task has ended
            while app._inflight:
                await anyio.sleep(0.01)
        assert await app.deck.store.runs() == []
        assert (await client.post("/agents/echo/chat", json={"message": "hi"})).status_code == 200


async def test_a_failed_run_is_a_500_with_its_type_and_run_id():
    broken = Agent("broken", model=ScriptedModel([RuntimeError("secret-token-123")], cycle=True))
    async with served(catalog(broken)) as (client, app):
        r = await client.post("/agents/broken/chat", json={"message": "hi"})
        assert r.status_code == 500 and r.json()["error"] == "RuntimeError"
        assert "secret-token-123" not in r.text
        assert await app.deck.status(r.headers["x-kit-run-id"]) is RunStatus.FAILED
        r, body = await wire(client, "POST", "/agents/broken/chat?stream=true", json={"message": "hi"})
        assert body == b'id: 1\nevent: error\ndata: {"error":"RuntimeError"}\n\n'


class Abort(BaseException):
    """What a user's tool may raise that is no ``Exception``."""


def aborts(x: int) -> int:
    """Raise ``Abort``."""
    raise Abort("secret-token-456")


async def test_a_run_failed_by_a_base_exception_is_a_500_and_the_server_serves_on():
    """A tool raising a ``BaseException`` that is no ``Exception``: the exception left the
    handler into Hypercorn, which dropped the connection with no response (asyncio) or died
    with the whole server (trio's nursery). Now it is the run's failure, as any other."""
    model = ScriptedModel([{"tool": "aborts", "args": {"x": 1}}], cycle=True)
    async with served(catalog(Agent("aborting", tools=[aborts], model=model))) as (client, app):
        with anyio.fail_after(10):
            r = await client.post("/agents/aborting/chat", json={"message": "hi"})
            assert (r.status_code, r.json()["error"]) == (500, "Abort")
            assert "secret-token-456" not in r.text
            assert await app.deck.status(r.headers["x-kit-run-id"]) is RunStatus.FAILED
            r, body = await wire(client, "POST", "/agents/aborting/chat?stream=true",
                                 json={"message": "hi"})
            assert body.endswith(b'event: error\ndata: {"error":"Abort"}\n\n'), body
            assert (await client.get("/health")).status_code == 200


async def test_an_unexpected_error_is_a_generic_500_logged_without_its_message(monkeypatch, caplog):
    async with served(catalog()) as (client, app):
        secret = "-".join(("sk", "live", "123"))  # not in the source: the log shows source lines

        async def broken():
            raise ZeroDivisionError(f"the api key is {secret}")
        monkeypatch.setattr(app.deck, "pending", broken)
        r = await client.get("/workflows/pending")
        assert r.status_code == 500
        assert r.json() == {"error": "ZeroDivisionError",
                            "message": "internal error; the server log has the details"}
        assert (await client.get("/health")).status_code == 200
    err = "\n".join(r.getMessage() for r in caplog.records if r.name == "kit_http")
    assert "GET /workflows/pending failed with ZeroDivisionError" in err and "sk-live-123" not in err


async def test_a_busy_session_is_409():
    gate, worker = gated("done")
    async with served(catalog(worker)) as (client, _):
        async with anyio.create_task_group() as tg:
            first: list[httpx.Response] = []

            async def hold() -> None:
                first.append(await client.post("/agents/worker/chat", json={"session_id": "s", "message": "go"}))
            tg.start_soon(hold)
            await gate.until_entered()
            r = await client.post("/agents/worker/chat", json={"session_id": "s", "message": "too"})
            assert (r.status_code, r.json()["error"]) == (409, "SessionBusyError")
            assert "x-kit-run-id" not in r.headers  # a refused start writes nothing
            r = await client.post("/agents/worker/chat?stream=true", json={"session_id": "s", "message": "too"})
            assert (r.status_code, r.json()["error"]) == (409, "SessionBusyError")
            gate.release.set()
        assert first[0].json() == {"output": "done"}


async def test_refused_streamed_requests_leave_no_run_behind():
    """A streamed request refused before its run started (an input the workflow's checkpoints
    cannot store, a durable workflow without its thread) stayed listed among the deck's streamed
    runs for good: ~5 kB a request, memory any client could grow without bound."""
    deck = Deck(workflows=[Workflow("ship", graph(plan), durable=True)])
    def runs() -> set[int]:
        gc.collect()
        return {id(o) for o in gc.get_objects() if isinstance(o, kit_runtime.Run)}

    async with served(deck) as (client, _):
        before = runs()  # (another test's, not collected yet)
        for body in ({"input": {"n": 2**70}, "thread_id": "t1"}, {"input": {}}) * 5:
            r = await client.post("/workflows/ship?stream=true", json=body)
            assert r.status_code == 400 and "x-kit-run-id" not in r.headers
        assert runs() <= before


# -------------------------------------------------------------------------- agents, SSE ----

async def test_agent_stream_bytes_on_the_wire():
    async with served(catalog()) as (client, app):
        r, body = await wire(client, "POST", "/agents/echo/chat", params={"stream": "true"},
                             json={"message": "hi"})
        assert r.status_code == 200
        assert {k: r.headers[k] for k in SSE_HEADERS} == SSE_HEADERS
        assert body == (b'id: 1\ndata: {"delta":"hello"}\n\n'
                        b'id: 2\ndata: {"delta":" there"}\n\n'
                        b'id: 3\ndata: {"delta":" world"}\n\n'
                        b'id: 6\nevent: done\ndata: {"output":"hello there world",'
                        b'"usage":{"input_tokens":3,"output_tokens":3,"usd":null}}\n\n')
        assert await app.deck.status(r.headers["x-kit-run-id"]) is RunStatus.COMPLETED


async def test_a_retried_stream_post_is_refused_and_starts_no_second_run():
    """An SSE client that retries its POST after a network error sends Last-Event-ID: the turn
    would be played twice; the retry is a 400 that points to the run's events."""
    async with served(catalog()) as (client, app):
        for last in ("3", ""):
            r = await client.post("/agents/echo/chat", params={"stream": "true"},
                                  json={"message": "hi"}, headers={"Last-Event-ID": last})
            assert r.status_code == 400, r.text
            assert r.json()["error"] == "MalformedRequestError"
            assert "GET /runs/{run_id}/events" in r.json()["message"]
        assert await app.deck.store.runs() == []


async def test_reconnect_with_last_event_id_replays_the_rest_then_204(tmp_path, monkeypatch):
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{tmp_path / 'kit.db'}")
    async with served(catalog()) as (client, _):
        run_id, first = await first_frame_then_drop(client, "/agents/echo/chat?stream=true", {"message": "hi"})
        assert first == b'id: 1\ndata: {"delta":"hello"}\n\n'
        async with aconnect_sse(client, "GET", f"/runs/{run_id}/events",
                                headers={"Last-Event-ID": "1"}) as es:
            assert es.response.headers["x-kit-run-id"] == run_id
            got = [(s.id, s.event, json.loads(s.data)) async for s in es.aiter_sse()]
        assert [i for i, _, _ in got] == ["2", "3", "4", "5", "6"]
        assert [e for _, e, _ in got] == ["text.delta", "text.delta", "message.completed",
                                         "model.completed", "run.completed"]
        assert got[0][2]["payload"] == {"text": " there"} and got[-1][2]["seq"] == 6
        for headers in ({}, {"Last-Event-ID": ""}):  # an empty header is no id
            r, body = await wire(client, "GET", f"/runs/{run_id}/events?after=4", headers=headers)
            assert body.startswith(b"id: 5\nevent: model.completed\ndata: {")
            assert body.count(b"\n\n") == 2
        r = await client.get(f"/runs/{run_id}/events", headers={"Last-Event-ID": "6"})
        assert (r.status_code, r.content) == (204, b"")
        assert "content-length" not in r.headers  # RFC 9110 section 8.6: a 204 has none
        r = await client.get(f"/runs/{run_id}/events", headers={"Last-Event-ID": "x"})
        assert r.status_code == 400


class CountingReads(SQLiteStore):
    """The real SQLite store, counting the reads of each run's log: ``(run_id, after)``."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.reads: list[tuple[str, int]] = []

    async def read(self, run_id, after=-1):
        self.reads.append((run_id, after))
        return await super().read(run_id, after)


async def test_a_finished_run_longer_than_a_page_is_sent_whole_in_order_a_page_read_at_a_time(
        shared_url, tmp_path):
    """GET /runs/{id}/events of a finished run read its whole log before its first byte: 2.2 s
    and 31 MB per reader for 100,000 events. It reads a page (READ_PAGE) at a time now, each
    sent as read; every event still goes out once, in order, across the pages' seams."""
    from test_kit_store import counting, long_run
    base, arg = ((PostgresStore, shared_url) if shared_url.startswith("postgresql") else
                 (SQLiteStore, tmp_path / "kit.db"))
    n = 2 * READ_PAGE + 7
    async with counting(base)(arg) as store:
        log = long_run("long", n, name="echo")
        await store.append(log)
        async with served(Deck([echo()], store=store)) as (client, _):
            for headers, sent in (({}, log), ({"Last-Event-ID": "600"}, log[601:]),
                                  ({"Last-Event-ID": str(READ_PAGE - 1)}, log[READ_PAGE:])):
                store.sizes.clear()
                r, body = await wire(client, "GET", "/runs/long/events", headers=headers)
                assert r.status_code == 200
                assert body == b"".join(kit_sse.native_frame(e) for e in sent)
                assert store.sizes and max(store.sizes) <= READ_PAGE, store.sizes


async def test_the_events_of_a_finished_run_are_read_from_the_store_once_and_past_its_end_not_at_all(tmp_path):
    """GET /runs/{id}/events of a finished run read its log two or three times (to find it was
    not past the end, that the client's Last-Event-ID was an event, then to follow it); a
    client past its end is told so from the run's index row, reading no event."""
    async with CountingReads(tmp_path / "kit.db") as store:
        async with served(Deck([echo()], store=store)) as (client, _):
            r = await client.post("/agents/echo/chat", json={"message": "hi"})
            run_id = r.headers["x-kit-run-id"]
            log = await store.read(run_id)
            for headers, after, sent in (({}, -1, log), ({"Last-Event-ID": str(log[-3].seq)},
                                                          log[-3].seq, log[-2:])):
                store.reads.clear()
                r, body = await wire(client, "GET", f"/runs/{run_id}/events", headers=headers)
                assert r.status_code == 200
                assert body == b"".join(kit_sse.native_frame(e) for e in sent)
                assert store.reads == [(run_id, after)]
            for seq in (log[-1].seq, log[-1].seq + 5):
                store.reads.clear()
                r = await client.get(f"/runs/{run_id}/events", headers={"Last-Event-ID": str(seq)})
                assert (r.status_code, store.reads) == (204, [])


async def test_a_live_run_picked_up_after_n_sends_every_event_after_n_once_reading_no_earlier_one(tmp_path):
    """Last-Event-ID (or ?after=) N on a run still playing: the stream sends each event after N
    once, those committed while it opens included, and none up to N; whether event N exists
    was checked by reading the log from N - 1 (the whole tail of a long run, for one row)."""
    gate, worker = gated("finished")
    async with CountingReads(tmp_path / "kit.db") as store:
        async with served(Deck([echo(), worker], store=store)) as (client, _):
            async with client.stream("POST", "/agents/worker/chat?stream=true",
                                     json={"message": "go"}) as r:
                run_id = r.headers["x-kit-run-id"]
                await gate.until_entered()
            so_far = await store.read(run_id)
            n = so_far[-2].seq
            store.reads.clear()
            r = await client.get(f"/runs/{run_id}/events?after={so_far[-1].seq + 1}")
            assert (r.status_code, r.json()["error"]) == (400, "MalformedRequestError")
            for headers, query in (({"Last-Event-ID": str(n)}, ""), ({}, f"?after={n}")):
                async with aconnect_sse(client, "GET", f"/runs/{run_id}/events{query}",
                                        headers=headers) as es:
                    gate.release.set()  # the run goes on while the stream opens
                    got = [int(s.id) async for s in es.aiter_sse()]
                log = await store.read(run_id)
                assert got == [e.seq for e in log if e.seq > n], headers
                assert log[-1].kind == "run.completed"
            assert (run_id, n - 1) not in store.reads  # the check reads no event


async def test_a_client_disconnect_ends_the_stream_never_the_run():
    gate, worker = gated("finished")
    async with served(catalog(worker)) as (client, app):
        async with client.stream("POST", "/agents/worker/chat?stream=true", json={"message": "go"}) as r:
            run_id = r.headers["x-kit-run-id"]
            await gate.until_entered()
        with anyio.fail_after(5):  # the watcher saw the disconnect and ended the stream
            while app._streams:
                await anyio.sleep(0.01)
        gate.release.set()
        async with aconnect_sse(client, "GET", f"/runs/{run_id}/events") as es:
            kinds = [s.event async for s in es.aiter_sse()]
        assert kinds[0] == "run.started" and kinds[-1] == "run.completed"
        assert "run.cancelled" not in kinds


# --------------------------------------------------------------------------- workflows ----

async def test_workflow_json_interrupt_pending_resume_and_stale_resume():
    async with served(catalog()) as (client, app):
        r = await client.post("/workflows/plain", json={"input": {"log": []}})
        run_id = r.headers["x-kit-run-id"]
        assert r.json() == {"output": {"log": ["plan"]}, "thread_id": run_id, "run_id": run_id}
        r = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t1"})
        run_id = r.headers["x-kit-run-id"]
        assert r.json() == {"type": "interrupt", "payload": {"question": "ship it?"},
                            "thread_id": "t1", "run_id": run_id}
        r = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t1"})
        assert r.status_code == 409  # a waiting thread keeps its claim
        [waiting] = (await client.get("/workflows/pending")).json()["pending"]
        since = datetime.fromisoformat(waiting.pop("since"))
        assert waiting == {"run_id": run_id, "workflow": "approve", "thread_id": "t1",
                           "session_id": "t1", "payload": {"question": "ship it?"}}
        assert since == (await app.deck.store.read(run_id))[-1].at
        r = await client.post("/workflows/approve/t1/resume", json={"value": "yes"})
        assert r.json() == {"output": {"log": ["plan", "answer=yes"]}, "thread_id": "t1", "run_id": run_id}
        assert r.headers["x-kit-run-id"] == run_id
        r = await client.post("/workflows/approve/t1/resume", json={"value": "again"})
        assert (r.status_code, r.json()["error"]) == (404, "ThreadNotWaitingError")
        assert (await client.get("/workflows/pending")).json() == {"pending": []}


async def test_pending_lists_only_the_threads_its_resume_route_answers():
    """A run parked with a namespace (deck.run from Python, one tenant's) is no thread of the
    HTTP surface: its resume route refuses it, so the list must not offer it (it did, payload
    and all, and the playground's answer box then said no run waits on that thread)."""
    async with served(catalog()) as (client, app):
        theirs = await app.deck.run("approve", {}, session_id="t1", namespace="acme")
        assert isinstance(theirs, kit.InterruptResult)
        assert [p.namespace for p in await app.deck.pending()] == ["acme"]
        assert (await client.get("/workflows/pending")).json() == {"pending": []}
        r = await client.post("/workflows/approve/t1/resume", json={"value": "yes"})
        assert (r.status_code, r.json()["error"]) == (404, "ThreadNotWaitingError")
        r = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t1"})
        ours = r.headers["x-kit-run-id"]
        [waiting] = (await client.get("/workflows/pending")).json()["pending"]
        assert (waiting["run_id"], waiting["thread_id"]) == (ours, "t1")
        r = await client.post("/workflows/approve/t1/resume", json={"value": "yes"})
        assert (r.status_code, r.json()["run_id"]) == (200, ours)
        assert await app.deck.status(theirs.run_id) is RunStatus.WAITING_HUMAN


async def test_a_resume_of_a_sleeping_thread_says_it_sleeps():
    """A sleep answers in the interrupt shape, so a client POSTs its resume: the 404 says the
    run sleeps and what wakes it (it said no run waits on the thread, which one does)."""
    until = datetime.now(timezone.utc) + timedelta(hours=1)

    async def nap(state: State) -> dict:
        kit.sleep_until(until)
        return {"log": ["woke"]}
    deck = Deck(workflows=[Workflow("nap", graph(plan, nap), durable=True)])
    async with served(deck) as (client, app):
        r = await client.post("/workflows/nap", json={"input": {}, "thread_id": "t1"})
        run_id = r.headers["x-kit-run-id"]
        assert (r.json()["type"], r.json()["payload"]["kind"]) == ("interrupt", "sleep")
        r = await client.post("/workflows/nap/t1/resume", json={"value": "wake up"})
        assert (r.status_code, r.json()["error"]) == (404, "ThreadNotWaitingError")
        assert r.json()["message"] == (f"run {run_id} of workflow 'nap' sleeps on thread 't1': an "
                                       "answer cannot wake it, a tick does once its time has come "
                                       "(deck.tick())")
        assert await app.deck.status(run_id) is RunStatus.SLEEPING
        r = await client.post("/workflows/nap/t2/resume", json={"value": 1})
        assert r.json()["message"] == "no run of workflow 'nap' waits on thread 't2'"


async def test_workflow_stream_bytes_on_the_wire():
    async with served(catalog()) as (client, _):
        r, body = await wire(client, "POST", "/workflows/approve?stream=true",
                             json={"input": {}, "thread_id": "t2"})
        run_id = r.headers["x-kit-run-id"]
        assert {k: r.headers[k] for k in SSE_HEADERS} == SSE_HEADERS
        assert body == (b'id: 1\ndata: {"node":"plan","update":{"log":["plan"]}}\n\n'
                        b'id: 2\nevent: interrupt\ndata: {"type":"interrupt","payload":'
                        b'{"question":"ship it?"},"thread_id":"t2","run_id":"' + run_id.encode()
                        + b'"}\n\n')
        r, body = await wire(client, "POST", "/workflows/plain?stream=true", json={"input": {}})
        assert body == (b'id: 1\ndata: {"node":"plan","update":{"log":["plan"]}}\n\n'
                        b'id: 2\nevent: done\ndata: {"output":{"log":["plan"]}}\n\n')


async def test_resume_of_a_thread_streams_like_the_run_that_parked():
    async with served(catalog()) as (client, _):
        r = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t5"})
        run_id = r.headers["x-kit-run-id"]
        r, body = await wire(client, "POST", "/workflows/approve/t5/resume?stream=true", json={"value": "yes"})
        assert r.headers["x-kit-run-id"] == run_id
        assert {k: r.headers[k] for k in SSE_HEADERS} == SSE_HEADERS
        assert body == (b'id: 4\ndata: {"node":"ask","update":{"log":["answer=yes"]}}\n\n'
                        b'id: 5\nevent: done\ndata: {"output":{"log":["plan","answer=yes"]}}\n\n')
        r = await client.post("/workflows/approve/t5/resume?stream=true", json={"value": "again"})
        assert (r.status_code, r.json()["error"]) == (404, "ThreadNotWaitingError")


@pytest.mark.parametrize("thread_id", ["team/42", "a b/ü%", "%2F"])
async def test_a_thread_id_holding_a_slash_is_answered_at_its_percent_encoded_path(thread_id):
    """The path is split where the client split it: ``%2F`` is part of the id (as the
    playground's encodeURIComponent sends it), never a separator, and ``%25`` a ``%``."""
    deck = Deck(workflows=[Workflow("ship", graph(plan, ask), durable=True)])
    encoded = quote(thread_id, safe="")
    async with served(deck) as (client, app):
        r = await client.post("/workflows/ship", json={"input": {}, "thread_id": thread_id})
        run_id = r.headers["x-kit-run-id"]
        assert (r.json()["type"], r.json()["thread_id"]) == ("interrupt", thread_id)
        [waiting] = (await client.get("/workflows/pending")).json()["pending"]
        assert waiting["thread_id"] == thread_id
        r = await client.post(f"/workflows/ship/{encoded}/resume", json={"value": "yes"})
        assert r.status_code == 200, r.json()
        assert r.json() == {"output": {"log": ["plan", "answer=yes"]}, "thread_id": thread_id,
                            "run_id": run_id}
        assert await app.deck.status(run_id) is RunStatus.COMPLETED
        # The thread is free again, and its next run is answered the same way, streaming.
        r = await client.post("/workflows/ship", json={"input": {}, "thread_id": thread_id})
        assert r.json()["type"] == "interrupt"
        r, body = await wire(client, "POST", f"/workflows/ship/{encoded}/resume?stream=true",
                             json={"value": "again"})
        assert r.status_code == 200 and body.endswith(  # the thread carries its state on
            b'event: done\ndata: {"output":{"log":["plan","answer=yes","plan","answer=again"]}}\n\n')
        assert (await client.get("/workflows/pending")).json() == {"pending": []}


# ------------------------------------------------------------------------- run control ----

async def test_pause_resume_and_cancel_routes():
    gate, worker = gated("done", {"tool": "wait", "args": {"step": 2}}, "x")
    async with served(catalog(worker)) as (client, app):
        async with anyio.create_task_group() as tg:
            first: list[httpx.Response] = []

            async def play() -> None:
                first.append(await client.post("/agents/worker/chat", json={"session_id": "s", "message": "go"}))
            tg.start_soon(play)
            await gate.until_entered()
            [info] = await app.deck.store.runs(status=RunStatus.RUNNING)
            r = await client.post(f"/runs/{info.run_id}/pause", json={"reason": "lunch"})
            assert (r.status_code, r.json()) == (202, {"run_id": info.run_id, "requested": "pause"})
            gate.release.set()
        assert (first[0].status_code, first[0].json()["error"]) == (409, "RunStoppedError")
        assert first[0].headers["x-kit-run-id"] == info.run_id
        r = await client.post(f"/runs/{info.run_id}/resume")
        assert r.status_code == 200 and r.json()["run_id"] == info.run_id
        assert [e["kind"] for e in r.json()["events"]][-1] == "run.completed"
        r = await client.post(f"/runs/{info.run_id}/resume", json={})
        assert (r.status_code, r.json()["error"]) == (409, "NotResumableError")
        r = await client.post("/agents/worker/chat", json={"session_id": "s2", "message": "go"})
        assert r.status_code == 200
        r = await client.post(f"/runs/{r.headers['x-kit-run-id']}/cancel")  # finished: refused
        assert (r.status_code, r.json()["error"]) == (409, "ControlRefusedError")
        assert "COMPLETED" in r.json()["message"]


async def test_a_pause_after_a_cancel_does_not_undo_the_cancel():
    """Both are 202 while the run plays; at its safe point the run took only the last request,
    so it paused, kept its session busy and left no trace of the cancel in its log."""
    gate, worker = gated("done")
    async with served(catalog(worker)) as (client, app):
        async with anyio.create_task_group() as tg:
            first: list[httpx.Response] = []

            async def play() -> None:
                first.append(await client.post("/agents/worker/chat", json={"session_id": "s", "message": "go"}))
            tg.start_soon(play)
            await gate.until_entered()
            [info] = await app.deck.store.runs(status=RunStatus.RUNNING)
            for action, reason in (("cancel", "wrong question"), ("pause", "lunch")):
                r = await client.post(f"/runs/{info.run_id}/{action}", json={"reason": reason})
                assert r.status_code == 202, r.json()
            gate.release.set()
        assert (first[0].status_code, first[0].json()["error"]) == (409, "RunStoppedError")
        assert "cancelled" in first[0].json()["message"] and "wrong question" in first[0].json()["message"]
        assert await app.deck.status(info.run_id) is RunStatus.CANCELLED
        r = await client.post("/agents/worker/chat", json={"session_id": "s", "message": "again"})
        assert r.status_code == 200  # the session is free


async def test_resume_of_a_paused_run_streams_like_the_run_that_paused():
    gate, worker = gated("back at work")
    async with served(catalog(worker)) as (client, app):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(client.post, "/agents/worker/chat", json={"message": "go"}))
            await gate.until_entered()
            [info] = await app.deck.store.runs(status=RunStatus.RUNNING)
            await client.post(f"/runs/{info.run_id}/pause", json={})
            gate.release.set()
        assert await app.deck.status(info.run_id) is RunStatus.PAUSED
        # An SSE client retrying a resume stream (Last-Event-ID) is refused, as every streamed
        # POST is: the run stays paused (it was resumed, by the retry of a stream it had lost).
        r = await client.post(f"/runs/{info.run_id}/resume?stream=true", headers={"Last-Event-ID": "4"})
        assert (r.status_code, r.json()["error"]) == (400, "MalformedRequestError")
        assert "GET /runs/{run_id}/events" in r.json()["message"]
        assert await app.deck.status(info.run_id) is RunStatus.PAUSED
        r, body = await wire(client, "POST", f"/runs/{info.run_id}/resume?stream=true")
        assert r.headers["x-kit-run-id"] == info.run_id
        frames = [f for f in body.decode().split("\n\n") if f]
        assert [f.split("\n")[-1] for f in frames[:3]] == [
            'data: {"delta":"back"}', 'data: {"delta":" at"}', 'data: {"delta":" work"}']
        assert "\nevent: done\n" in frames[-1] and '"output":"back at work"' in frames[-1]
        r = await client.post(f"/runs/{info.run_id}/resume?stream=true")
        assert (r.status_code, r.json()["error"]) == (409, "NotResumableError")
        assert (await client.post("/runs/nope/resume?stream=true")).status_code == 404


async def test_a_run_id_holding_a_slash_is_followed_and_cancelled_at_its_percent_encoded_path():
    run_id = "batch/7%"  # a caller may name its own runs (deck.run(..., run_id=...))
    encoded = quote(run_id, safe="")
    async with served(catalog()) as (client, app):
        parked = await app.deck.run("approve", {}, session_id="t7", run_id=run_id)
        assert isinstance(parked, kit.InterruptResult)
        async with aconnect_sse(client, "GET", f"/runs/{encoded}/events") as es:
            assert es.response.headers["x-kit-run-id"] == run_id
            got = [json.loads(s.data) async for s in es.aiter_sse()]
        assert {e["run_id"] for e in got} == {run_id}
        assert (got[0]["kind"], got[-1]["kind"]) == ("run.started", "run.interrupted")
        r = await client.post(f"/runs/{encoded}/pause", json={})  # the advice fits a waiting run
        assert (r.status_code, r.json()["error"]) == (409, "ControlRefusedError")
        assert r.json()["message"].endswith("it is parked already (answer or cancel it instead)")
        r = await client.post(f"/runs/{encoded}/resume")  # which resume would refuse
        assert (r.status_code, r.json()["error"]) == (409, "NotResumableError")
        r = await client.post(f"/runs/{encoded}/cancel", json={"reason": "not today"})
        assert (r.status_code, r.json()) == (202, {"run_id": run_id, "requested": "cancel"})
        assert await app.deck.status(run_id) is RunStatus.CANCELLED
        r = await client.get(f"/runs/{encoded}/events", headers={"Last-Event-ID": str(len(got) - 1)})
        assert r.status_code == 200 and r.text.count("event: ") == 2 and "run.cancelled" in r.text
        r = await client.post(f"/runs/{encoded}/pause", json={})
        assert (r.status_code, r.json()["error"]) == (409, "ControlRefusedError")
        # A bare / still splits the path: that is another route, which does not exist.
        r = await client.get(f"/runs/{run_id}/events")
        assert (r.status_code, r.json()["error"]) == (404, "RouteNotFoundError")


async def test_a_path_whose_percent_decoding_is_not_utf8_is_a_400_and_the_paths_that_worked_still_do():
    async with served(catalog()) as (client, _):
        for method, path, key in (("GET", "/runs/%FF/events", "run_id"),
                                  ("POST", "/runs/ok%C3%28/cancel", "run_id"),
                                  ("POST", "/workflows/approve/%E2%82/resume", "thread_id"),
                                  ("POST", "/agents/%C0%AF/chat", "name")):  # overlong "/"
            r = await client.request(method, path, json={"value": 1} if "resume" in path else
                                     {"message": "hi"} if "chat" in path else None)
            assert (r.status_code, r.json()["error"]) == (400, "MalformedRequestError"), path
            assert r.json()["message"].startswith(f"{key} must be UTF-8 text once percent-decoded")
        for path, status in (("/health", 200), ("/h%65alth", 200), ("/health/", 404),
                             ("/health%2F", 404), ("/%2Fhealth", 404)):  # httpx sends no //
            assert (await client.get(path)).status_code == status, path
        r = await client.post("/agents/ec%68o/chat", json={"message": "hi"})  # an encoded name
        assert r.json() == {"output": "hello there world"}
        r = await client.post("/agents/echo%2Fchat", json={"message": "hi"})  # %2F: no separator
        assert (r.status_code, r.json()["error"]) == (404, "RouteNotFoundError")
        r = await client.post("/workflows/pend%69ng", json={})  # the concrete path still wins
        assert (r.status_code, r.headers["allow"]) == (405, "GET, HEAD")
        r = await client.get("/workflows/approve/a%2Fb/resume")
        assert (r.status_code, r.headers["allow"]) == (405, "POST")


# ------------------------------------------------------------------------------ native ----

async def test_native_routes_stream_raw_envelopes():
    async with served(catalog(), native=True) as (client, _):
        async with aconnect_sse(client, "POST", "/v2/invocables/echo/chat", json={"input": "hi"}) as es:
            got = [(s.id, s.event, json.loads(s.data)) async for s in es.aiter_sse()]
        assert [e for _, e, _ in got] == ["run.started", "text.delta", "text.delta", "text.delta",
                                         "message.completed", "model.completed", "run.completed"]
        assert all(i == str(d["seq"]) and e == d["kind"] for i, e, d in got)
        r, body = await wire(client, "POST", "/v2/invocables/plain/chat", json={"input": {}})
        assert body.count(b"\nevent: ") == 3 and body.endswith(b"}\n\n")


async def test_a_stream_sends_what_its_run_committed_while_the_run_waits():
    """What a run committed is on the wire while the run waits (here in a tool held by a gate),
    not held back for the frames after it: the handler sends what is ready before the stream
    starts waiting for the rest, then the rest as it comes."""
    gate, worker = gated("finished")
    async with served(catalog(worker), native=True) as (client, _):
        async with aconnect_sse(client, "POST", "/v2/invocables/worker/chat",
                                json={"input": "go"}) as es:
            frames, kinds = es.aiter_sse(), []
            with anyio.fail_after(5):  # the gate holds the tool for 10 s
                async for s in frames:
                    kinds.append(s.event)
                    if s.event == "tool.started":  # durable before the tool runs
                        break
            gate.release.set()
            kinds += [s.event async for s in frames]
        assert kinds[0] == "run.started" and kinds[-1] == "run.completed"
        assert kinds.index("tool.started") < kinds.index("tool.completed")


# ------------------------------------------------------------------------------ shutdown ----

async def test_shutdown_ends_open_streams_itself():
    async with served(catalog()) as (client, app):
        r = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t3"})
        run_id = r.headers["x-kit-run-id"]
        # After its parking event a stream waits for the run to go on: it never ends by itself.
        async with aconnect_sse(client, "GET", f"/runs/{run_id}/events",
                                headers={"Last-Event-ID": "2"}) as es:
            with anyio.fail_after(5):
                while not app._streams:
                    await anyio.sleep(0.01)
                await app.shutdown()
                got = [(s.event, s.data) async for s in es.aiter_sse()]
        assert got == [("server.shutdown", json.dumps({"run_id": run_id}, separators=(",", ":")))]
        r = await client.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "stopping"})


async def test_shutdown_answers_in_flight_requests_503_after_the_grace(monkeypatch):
    monkeypatch.setattr(kit_sse, "STOP_GRACE", 0.1)
    gate, worker = gated("done")
    async with served(catalog(worker)) as (client, app):
        async with anyio.create_task_group() as tg:
            got: list[httpx.Response] = []

            async def play() -> None:
                got.append(await client.post("/agents/worker/chat", json={"message": "go"}))
            tg.start_soon(play)
            await gate.until_entered()
            with anyio.fail_after(5):
                await app.shutdown()  # waits STOP_GRACE, cancels, waits STOP_GRACE
            gate.release.set()  # a tool in a worker thread finishes before its run can stop
        assert (got[0].status_code, got[0].json()["error"]) == (503, "ServerStoppingError")
        run_id = got[0].headers["x-kit-run-id"]  # the run it cancelled, named as every run's is
        assert run_id in got[0].json()["message"]
        assert await app.deck.status(run_id) is RunStatus.CANCELLED


async def test_a_stream_stopped_before_it_plays_still_ends_within_the_grace(monkeypatch):
    """The server may stop between letting a request in and its stream's ``play``: the grace
    must bound that stream too (it had no deadline: a client that never reads held its last
    write, and the shutdown, for good)."""
    monkeypatch.setattr(kit_sse, "STOP_GRACE", 0.1)
    stream = kit_sse.Stream()
    stream.stop()

    async def never_read(message) -> None:  # a client that never reads: every body write hangs
        if message["type"] == "http.response.body":
            await anyio.sleep_forever()

    async def events():
        yield  # never reached: the reader is stopped already
    with anyio.fail_after(5):
        await stream.play(never_read, anyio.sleep_forever, "r1", None, events(), lambda ev: b"")


# -------------------------------------------------------------------- ASGI, no server ----

class Scripted:
    """Scripted ASGI receive/send: hands out messages and records what the app sends."""

    def __init__(self, *messages) -> None:
        self.inbox, self.sent = list(messages), []
        self.more = anyio.Event()

    async def receive(self):
        while not self.inbox:
            await self.more.wait()
            self.more = anyio.Event()
        return self.inbox.pop(0)

    def push(self, message) -> None:
        self.inbox.append(message)
        self.more.set()

    async def send(self, message) -> None:
        self.sent.append(message)


def http_scope(method: str, path: str, headers=(), root_path: str = "") -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "path": path, "root_path": root_path, "query_string": b"", "headers": list(headers)}


class BrokenObserver:
    def emit(self, event) -> None:
        pass

    def start(self) -> None:
        raise RuntimeError("tracing backend unreachable")


async def test_lifespan_opens_and_closes_the_deck_in_its_own_task():
    deck = catalog()
    app = App(deck)
    early = Scripted({"type": "http.request", "body": b""})
    await app(http_scope("GET", "/health"), early.receive, early.send)
    assert early.sent[0]["status"] == 503 and json.loads(early.sent[1]["body"]) == {"status": "starting"}
    life = Scripted({"type": "lifespan.startup"})
    state: dict = {}
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(app, {"type": "lifespan", "asgi": {"version": "3.0"}, "state": state},
                          life.receive, life.send)
            while not life.sent:
                await anyio.sleep(0.01)
            assert life.sent == [{"type": "lifespan.startup.complete"}] and state["kit.deck"] is deck
            mounted = Scripted({"type": "http.request", "body": b""})
            await app(http_scope("GET", "/kit/health", root_path="/kit"), mounted.receive, mounted.send)
            assert mounted.sent[0]["status"] == 200
            life.push({"type": "lifespan.shutdown"})
    assert life.sent[-1] == {"type": "lifespan.shutdown.complete"}
    assert deck._state == "CLOSED"


async def test_the_router_reads_raw_path_mounted_or_not_and_path_without_it():
    """Hypercorn gives ``path`` (decoded) and ``raw_path`` (as sent); a host app may mount kit
    below a ``root_path``, rewrite ``path`` alone, or (ASGI lets it) give no ``raw_path``."""
    deck = catalog()
    app = App(deck)
    life = Scripted({"type": "lifespan.startup"})

    async def ask(method: str, path: str, raw: bytes | None, root: str = "") -> tuple[int, bytes]:
        client = Scripted({"type": "http.request", "body": b""})
        scope = http_scope(method, path, root_path=root)
        if raw is not None:
            scope["raw_path"] = raw
        await app(scope, client.receive, client.send)
        return client.sent[0]["status"], client.sent[1]["body"]

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(app, {"type": "lifespan", "asgi": {"version": "3.0"}}, life.receive, life.send)
            while not life.sent:
                await anyio.sleep(0.01)
            await deck.run("approve", {}, session_id="t1", run_id="a/b%")  # parks: pause is a 409
            for path, raw, root in (
                    ("/runs/a/b%/pause", b"/runs/a%2Fb%25/pause", ""),  # Hypercorn, uvicorn
                    ("/kit/runs/a/b%/pause", b"/kit/runs/a%2Fb%25/pause", "/kit"),  # mounted
                    ("/runs/a/b%/pause", b"/kit/runs/a%2Fb%25/pause", "/kit"),  # path without root
                    ("/kit/runs/a/b%/pause", b"/k%69t/runs/a%2Fb%25/pause", "/kit"),
                    ("/runs/a/b%/pause", b"/runs/a%2Fb%25/pause?x=%20", "")):  # httpx's ASGITransport
                status, body = await ask("POST", path, raw, root)
                body = json.loads(body)
                assert (status, body["error"]) == (409, "ControlRefusedError"), (raw, body)
                assert body["message"].startswith("run a/b%: the run is WAITING_HUMAN"), body
            assert json.loads((await ask("GET", "/runs/x%41/events", None))[1]) == {
                "error": "UnknownRunError", "message": "the log has no run 'x%41'"}  # no raw_path
            assert (await ask("GET", "/health", b"/api/v1/stale%2F"))[0] == 200  # path rewritten
            for path, raw in (("//health", b"//health"), ("/health/", b"/health/"),
                              ("/kit/health", b"/kit/health")):
                assert (await ask("GET", path, raw))[0] == 404, path
            assert (await ask("GET", "/kit/health", b"/kit/health", "/kit"))[0] == 200
            status, page = await ask("GET", "/kit/", b"/kit/", "/kit")
            assert status == 200 and page.startswith(b"<!doctype html>")  # the playground
            # At /kit the page's relative URLs ("health") would leave the mount: sent to /kit/.
            client = Scripted({"type": "http.request", "body": b""})
            scope = {**http_scope("GET", "/kit", root_path="/kit"), "raw_path": b"/kit",
                     "query_string": b"a=1"}
            await app(scope, client.receive, client.send)
            assert client.sent[0]["status"] == 308
            assert dict(client.sent[0]["headers"])[b"location"] == b"/kit/?a=1"
            life.push({"type": "lifespan.shutdown"})


async def test_lifespan_startup_failure_is_reported_and_frees_the_deck():
    app = App(Deck([echo()], observers=[BrokenObserver()]))
    life = Scripted({"type": "lifespan.startup"})
    with anyio.fail_after(10):
        await app({"type": "lifespan", "asgi": {"version": "3.0"}}, life.receive, life.send)
    [failed] = life.sent
    assert failed["type"] == "lifespan.startup.failed" and "tracing backend unreachable" in failed["message"]
    Deck([echo()]).build()  # the failed deck does not hold the one live-deck slot


async def test_a_lifespan_given_a_deck_open_elsewhere_fails_its_startup_and_leaves_it_open():
    """An app whose deck the caller opened already (``async with deck:`` around the server): the
    lifespan's open is refused, so its startup fails naming why, and the deck stays open for its
    opener. The lifespan then closed the deck it had not opened (its opener's runs cut off)."""
    deck = catalog()
    async with deck:
        life = Scripted({"type": "lifespan.startup"})
        with anyio.fail_after(10):
            await App(deck)({"type": "lifespan", "asgi": {"version": "3.0"}}, life.receive, life.send)
        [failed] = life.sent
        assert failed["type"] == "lifespan.startup.failed"
        assert failed["message"].startswith("DeckStateError: cannot open the deck: the deck is OPEN")
        assert deck._state == "OPEN" and (await deck.run("echo", "still here")).output


SLOW_MCP = """
import os, subprocess, sys, time
helper = subprocess.Popen(["sleep", "300"])  # outlives this server unless its group is ended
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {helper.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)  # never answers the handshake: the deck is still opening
"""


def open_files(path: Path) -> list[str]:
    """This process's open descriptors on ``path`` or its WAL (a store's live connections)."""
    fds = [os.path.join("/proc/self/fd", fd) for fd in os.listdir("/proc/self/fd")]
    links = []
    for fd in fds:
        with contextlib.suppress(OSError):
            links.append(os.readlink(fd))
    return [link for link in links if link.startswith(str(path))]


async def test_a_lifespan_cancelled_while_the_deck_opens_closes_it(tmp_path, monkeypatch):
    """Ctrl-C while ``kit-serve`` starts cancels the lifespan in the middle of the deck's open
    (an MCP server that takes its time): the server, the helper it spawned and the store's
    connection are closed and the deck frees its slot. Under trio the store stayed open."""
    db, pids, script = tmp_path / "kit.db", tmp_path / "pids", tmp_path / "slow.py"
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{db}")
    script.write_text(SLOW_MCP)
    server = {"command": sys.executable, "args": [str(script), str(pids)], "timeout": 120}
    deck = Deck([Agent("a", model=ScriptedModel(["hi"]), mcp_servers=["slow"])], mcp={"slow": server})
    life = Scripted({"type": "lifespan.startup"})
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(App(deck, surfaces=["mcp"]), {"type": "lifespan", "asgi": {"version": "3.0"}},
                          life.receive, life.send)
            while not pids.exists():
                await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        assert life.sent == []
        for pid in map(int, pids.read_text().split()):
            assert await gone(pid), pid
    assert open_files(db) == []
    Deck([echo()]).build()  # the slot is free


async def test_a_lifespan_cancelled_once_the_deck_is_open_closes_it(tmp_path, monkeypatch):
    """A lifespan cancelled (not shut down) while it serves closed the deck inside a shield,
    where its task group cannot be left: a RuntimeError, and the store stayed open."""
    db = tmp_path / "kit.db"
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{db}")
    deck = catalog()
    life = Scripted({"type": "lifespan.startup"})
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(App(deck, surfaces=["mcp"]), {"type": "lifespan", "asgi": {"version": "3.0"}},
                          life.receive, life.send)
            while not life.sent:
                await anyio.sleep(0.01)
            assert await deck.run("echo", "hi")
            tg.cancel_scope.cancel()
    assert life.sent == [{"type": "lifespan.startup.complete"}]
    assert deck._state == "CLOSED" and open_files(db) == []


async def test_a_quiet_stream_pings_a_disconnect_ends_it_and_a_body_is_counted_and_measured(monkeypatch):
    monkeypatch.setattr(kit_sse, "PING_INTERVAL", 0.05)
    deck = catalog()
    app = App(deck)
    life = Scripted({"type": "lifespan.startup"})
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(app, {"type": "lifespan", "asgi": {"version": "3.0"}}, life.receive, life.send)
            while not life.sent:
                await anyio.sleep(0.01)
            parked = await deck.run("approve", {}, session_id="t9", run_id="run-t9")
            assert isinstance(parked, kit.InterruptResult)
            client = Scripted({"type": "http.request", "body": b""})
            async with anyio.create_task_group() as inner:
                inner.start_soon(app, http_scope("GET", "/runs/run-t9/events",
                                                 [(b"last-event-id", b"2")]), client.receive, client.send)
                while len(client.sent) < 2:
                    await anyio.sleep(0.01)
                assert client.sent[0]["status"] == 200
                assert client.sent[1] == {"type": "http.response.body", "body": b": ping\n\n",
                                          "more_body": True}
                client.push({"type": "http.disconnect"})  # the app must return by itself
            assert not app._streams and await deck.status("run-t9") is RunStatus.WAITING_HUMAN
            chunk = b" " * (kit_request.MAX_BODY_BYTES // 4)
            big = Scripted(*[{"type": "http.request", "body": chunk, "more_body": True}] * 5)
            await app(http_scope("POST", "/agents/echo/chat", [(b"content-type", b"application/json")]),
                      big.receive, big.send)
            assert big.sent[0]["status"] == 413 and len(big.inbox) == 0
            # Superscript digits pass str.isdigit, not int(): a 400 under a server that lets
            # them through (Hypercorn's parsers refuse them first).
            odd = Scripted({"type": "http.request", "body": b'{"message": "hi"}'})
            await app(http_scope("POST", "/agents/echo/chat", [(b"content-type", b"application/json"),
                                                               (b"content-length", b"\xb9\xb3")]),
                      odd.receive, odd.send)
            assert odd.sent[0]["status"] == 400 and b"Content-Length" in odd.sent[1]["body"]
            life.push({"type": "lifespan.shutdown"})


async def test_a_megabyte_value_a_client_sent_is_quoted_short_in_the_error():
    """A 400 quoted what the client sent whole: a 1 MB unknown key, role, content part type or
    MCP method made a 1 MB error message (and as much in any log line that showed it)."""
    big = "k" * 1_000_000
    head = {"accept": "application/json, text/event-stream"}
    async with served(catalog(), surfaces=("openai", "mcp")) as (client, _):
        r = await client.post("/agents/echo/chat", json={"message": "hi", big: 1})
        said = [(r.status_code, r.json()["message"])]
        r = await client.post("/v1/chat/completions", json={"model": "echo", "messages": [
            {"role": big, "content": "hi"}, {"role": "user", "content": "hi"}]})
        said.append((r.status_code, r.json()["error"]["message"]))
        r = await client.post("/v1/chat/completions", json={
            "model": "echo", "messages": [{"role": "user", "content": [{"type": big}]}]})
        said.append((r.status_code, r.json()["error"]["message"]))
        r = await client.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": big}, headers=head)
        rpc = json.loads(r.text.partition("data: ")[2].partition("\n")[0]) if (
            r.headers.get("content-type", "").startswith("text/event-stream")) else r.json()
        said.append((rpc["error"]["code"], rpc["error"]["message"]))
    for status, message in said:
        assert status in (400, -32601) and len(message) < 1000, (status, message[:200])
        assert "'kkkk" in message and "more characters)" in message, message
