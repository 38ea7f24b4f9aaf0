"""Tests of the tracing observer (kit_tracing) and its span export (kit_otlp) against a local
OTLP/HTTP receiver on 127.0.0.1."""
from __future__ import annotations

import base64
import gzip
import json
import logging
import os
import re
import shutil
import socket
import ssl
import time
import subprocess
import sys
import operator
import threading
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated, Any, TypedDict

import agents
import anyio
import httpx
import openai
import pytest
from langgraph.graph import END, START, StateGraph
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess, ExportTraceServiceRequest, ExportTraceServiceResponse,
)

from kit import (
    Agent, ConfigError, ControlRequested, Deck, Event, ModelCompleted, NodeUpdated, RunCancelled,
    RunCompleted, RunPaused, RunResumed, RunStarted, ScriptedModel, Workflow, interrupt,
)
from kit_bridge import on_asyncio
from kit_observers import ObserverHub
from kit_store import MemoryStore, SQLiteStore
import kit_otlp
from kit_tracing import OTLP_PATH, TracingObserver, TracingStats

pytestmark = pytest.mark.anyio
PK, SK = "pk-lf-test", "sk-lf-test"
ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


class Receiver:
    """An OTLP/HTTP collector stand-in: records each request's path, headers and decoded spans."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any, ExportTraceServiceRequest]] = []
        self.status = 200  # what it answers: 400 for a collector that refuses what it is sent
        self.answers: list[int] = []  # what it answers first, one status a request (a 503 says
        # Retry-After: 0), before ``status``
        self.reply = ExportTraceServiceResponse()  # a 2xx's body (a partial_success, say)
        self.reply_json: dict | None = None  # else this, as OTLP/JSON (as Langfuse answers)
        self.location: str | None = None  # a Location header to answer with (a redirect's)
        self.garbage = 0  # bytes of garbage to answer with instead, no length: until it closes
        self.garbage_sent = 0  # of those, what the client took
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.requests.append((self.path, self.headers,  # case-insensitive
                                          ExportTraceServiceRequest.FromString(body)))
                reply, content_type = receiver.reply.SerializeToString(), "application/x-protobuf"
                if receiver.reply_json is not None:
                    reply = json.dumps(receiver.reply_json).encode()
                    content_type = "application/json"
                status = receiver.answers.pop(0) if receiver.answers else receiver.status
                self.send_response(status)
                if status == 503:
                    self.send_header("Retry-After", "0")
                if receiver.garbage:
                    self.end_headers()
                    try:
                        while receiver.garbage_sent < receiver.garbage:
                            self.wfile.write(b"\xff" * 65536)
                            receiver.garbage_sent += 65536
                    except OSError:  # the client hung up
                        pass
                    return
                if receiver.location is not None:
                    self.send_header("Location", receiver.location)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def traces(self) -> dict[str, list]:
        """Spans by trace id (hex)."""
        out: dict[str, list] = defaultdict(list)
        for _, _, req in self.requests:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        out[span.trace_id.hex()].append(span)
        return dict(out)


@pytest.fixture
def receiver():
    r = Receiver()
    r.thread.start()
    yield r
    r.server.shutdown()
    r.server.server_close()
    r.thread.join()


def attrs(span) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def root_and_children(spans):
    [root] = [s for s in spans if not s.parent_span_id]
    children = sorted((s for s in spans if s.parent_span_id), key=lambda s: s.start_time_unix_nano)
    return root, children


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def play(observer: TracingObserver, logged: list[Event]) -> None:
    """Feed events through a hub into the observer, as the deck does, and close (flush) it."""
    hub = ObserverHub([observer])
    async with anyio.create_task_group() as tg:
        await hub.start(tg)
        for ev in logged:
            hub.emit(ev)
        await hub.close()


# ---------------------------------------------------------------------------- semantic layer ----

async def test_each_agent_turn_is_one_trace_with_genai_spans(receiver):
    calc = ScriptedModel([{"tool": "add", "args": {"a": 2, "b": 3}}, "The sum is 5."], name="gpt-4o")
    broken = ScriptedModel([RuntimeError("model down")], name="gpt-4o")
    with anyio.fail_after(10):
        async with MemoryStore() as store:
            async with Deck([Agent("calc", "Add.", tools=[add], model=calc),
                             Agent("broken", "Fail.", model=broken)], store=store) as deck:
                ok = await deck.run("calc", "what is 2 + 3?", session_id="s1")
                with pytest.raises(RuntimeError, match="model down"):
                    await deck.run("broken", "hello", run_id="run-failed")
            ok_events, failed_events = await store.read(ok.run_id), await store.read("run-failed")
        observer = TracingObserver(public_key=PK, secret_key=SK, host=receiver.host)
        await play(observer, ok_events + failed_events)

    assert receiver.requests
    for path, headers, _ in receiver.requests:
        assert path == OTLP_PATH
        assert headers["Authorization"] == "Basic " + base64.b64encode(f"{PK}:{SK}".encode()).decode()
        assert headers["x-langfuse-ingestion-version"] == "4"
        assert headers["Content-Type"] == "application/x-protobuf"
    traces = receiver.traces()
    assert set(traces) == {TracingObserver.trace_id(ok.run_id), TracingObserver.trace_id("run-failed")}

    root, children = root_and_children(traces[TracingObserver.trace_id(ok.run_id)])
    assert root.name == "invoke_agent calc" and root.status.code != ERROR
    a = attrs(root)
    assert a["session.id"] == "s1" and a["kit.run_id"] == ok.run_id and a["kit.name"] == "calc"
    assert a["gen_ai.agent.name"] == "calc" and a["kit.status"] == "COMPLETED"
    assert [c.name for c in children] == ["chat gpt-4o", "execute_tool add", "chat gpt-4o"]
    assert all(c.parent_span_id == root.span_id for c in children)
    models = [e.payload for e in ok_events if isinstance(e.payload, ModelCompleted)]
    for span, p in zip([children[0], children[2]], models):
        c = attrs(span)
        assert c["gen_ai.request.model"] == "gpt-4o" and c["langfuse.observation.type"] == "generation"
        assert (c["gen_ai.usage.input_tokens"], c["gen_ai.usage.output_tokens"]) == \
            (p.input_tokens, p.output_tokens) and p.input_tokens > 0
        assert p.usd is not None and f'"total":{p.usd}' in c["langfuse.observation.cost_details"]
    tool = attrs(children[1])
    assert tool["gen_ai.tool.name"] == "add" and tool["gen_ai.tool.call.id"]
    assert children[1].status.code != ERROR
    assert all(c.end_time_unix_nano <= root.end_time_unix_nano for c in children)
    everything = str([attrs(s) for s in traces[TracingObserver.trace_id(ok.run_id)]])
    assert "what is 2 + 3" not in everything and "The sum is 5" not in everything  # no content

    root, children = root_and_children(traces[TracingObserver.trace_id("run-failed")])
    assert root.name == "invoke_agent broken" and root.status.code == ERROR
    # The error's type, not its message, which may quote content (it used to be exported whole).
    assert root.status.message == "the run failed (RuntimeError); kit.run_id's log has why"
    assert attrs(root)["error.type"] == "RuntimeError" and "session.id" not in attrs(root)
    assert attrs(root)["kit.status"] == "FAILED"


async def test_the_same_session_id_in_two_namespaces_is_two_sessions(receiver):
    """Two tenants' conversations under one session id (namespaces keep them apart: each has
    its own history): both traces said session.id "s1", so Langfuse listed them as one session,
    one tenant's turns among the other's; the SDK's second trace (``sdk_spans``) still did."""
    model = ScriptedModel(["hello there"], name="gpt-4o", cycle=True)
    with anyio.fail_after(10):
        async with Deck([Agent("a", "Answer.", model=model)], observers=[TracingObserver(
                sdk_spans=True, public_key=PK, secret_key=SK, host=receiver.host)]) as deck:
            runs = [await deck.run("a", "hi", session_id="s1", namespace=ns)
                    for ns in ("tenant-a", "tenant-b", None)]
    traces = receiver.traces()
    roots = [root_and_children(traces.pop(TracingObserver.trace_id(r.run_id)))[0] for r in runs]
    # the session's own key (README: Sessions and claims), which no session id can reach
    assert [attrs(r)["session.id"] for r in roots] == ["tenant-a/s1", "tenant-b/s1", "s1"]
    assert [attrs(r).get("kit.namespace") for r in roots] == ["tenant-a", "tenant-b", None]
    assert attrs(roots[0])["gen_ai.conversation.id"] == "tenant-a/s1"
    # The SDK's own trace of each run (sdk_spans) says the same session: it said "s1" for both
    # tenants, so there their sessions were one.
    raw = {attrs(r)["kit.run_id"]: attrs(r)["session.id"]
           for r in (root_and_children(spans)[0] for spans in traces.values())}
    assert [raw[r.run_id] for r in runs] == ["tenant-a/s1", "tenant-b/s1", "s1"]


def served_at(url: str, name: str) -> agents.OpenAIChatCompletionsModel:
    """Model ``name`` through an OpenAI-compatible server at ``url``, answered in-process."""
    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={
            "id": "c1", "object": "chat.completion", "created": 0, "model": name,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "hello there"}}],
            "usage": {"prompt_tokens": 1200, "completion_tokens": 300, "total_tokens": 1500}})
    client = openai.AsyncOpenAI(base_url=url, api_key="k", http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(reply)))
    return agents.OpenAIChatCompletionsModel(name, client)


@pytest.mark.parametrize("name, url, provider", [
    ("anthropic/claude-sonnet-4-20250514", None, "anthropic"),  # LiteLLM's provider/model
    ("claude-sonnet-4-5", "https://api.anthropic.com/v1/", "anthropic"),
    ("gemini-2.5-flash", "https://generativelanguage.googleapis.com/v1beta/openai/", "google"),
    ("deepseek-r1:7b", "http://127.0.0.1:11434/v1/", None),  # served locally: no price
])
async def test_a_model_openai_does_not_serve_is_exported_with_its_providers_cost(
        receiver, name, url, provider):
    """Claude or Gemini through their OpenAI-compatible servers, or LiteLLM's provider/model:
    kit looked every model up in OpenAI's prices only, so these had no cost (usd None)."""
    from genai_prices import Usage as PriceUsage, calc_price
    model = ScriptedModel(["hello there"], name=name) if url is None else served_at(url, name)
    with anyio.fail_after(10):
        async with MemoryStore() as store:
            async with Deck([Agent("a", "Answer.", model=model)], store=store) as deck:
                done = await deck.run("a", "hi")
            logged = await store.read(done.run_id)
        await play(TracingObserver(public_key=PK, secret_key=SK, host=receiver.host), logged)
    root, [call] = root_and_children(receiver.traces()[TracingObserver.trace_id(done.run_id)])
    a = attrs(call)
    assert call.name == f"chat {name}" and a["gen_ai.usage.input_tokens"] > 0
    if provider is None:
        assert "langfuse.observation.cost_details" not in a and "kit.usage.usd" not in attrs(root)
        return
    price = calc_price(PriceUsage(input_tokens=a["gen_ai.usage.input_tokens"],
                                  output_tokens=a["gen_ai.usage.output_tokens"]),
                       model_ref=name.split("/")[-1], provider_id=provider).total_price
    assert price > 0
    assert json.loads(a["langfuse.observation.cost_details"]) == {"total": pytest.approx(float(price))}
    assert attrs(root)["kit.usage.usd"] == pytest.approx(float(price))


async def _stub_turns(receiver, replies: list, ways: list[str]) -> tuple[dict, list[str], list]:
    """Turns of one agent on the OpenAI stub answering ``replies``, each played as ``ways`` says
    ("run" or "stream"), then their logs played to a tracing observer: the traces ``receiver``
    got, the turns' run ids and their logged events."""
    from test_kit_openai import Stub
    stub = Stub()
    client = openai.AsyncOpenAI(base_url=stub.base_url, api_key="test", max_retries=0)
    stub.script += replies
    run_ids: list[str] = []
    try:
        with anyio.fail_after(10):
            async with MemoryStore() as store:
                agent = Agent("a", "Answer.", model=agents.OpenAIResponsesModel("gpt-4o", client))
                async with Deck([agent], store=store) as deck:
                    for way in ways:
                        run_ids.append([e async for e in deck.stream("a", "hi")][0].run_id
                                       if way == "stream" else (await deck.run("a", "hi")).run_id)
                    logged = [e for run_id in run_ids for e in await store.read(run_id)]
                    await on_asyncio(client.close)
            await play(TracingObserver(public_key=PK, secret_key=SK, host=receiver.host), logged)
    finally:
        stub.server.shutdown()
        stub.server.server_close()
    return receiver.traces(), run_ids, logged


async def test_a_model_call_says_the_model_the_provider_says_answered(receiver):
    """``gen_ai.response.model`` was the model asked for, whatever the provider said answered
    (OpenAI answers ``gpt-4o`` with a dated snapshot; a gateway may route elsewhere). It is the
    response's ``model`` when the response carries it (a streamed Responses reply: the stub
    says "stub"), else the model asked for (the SDK keeps no model of a reply not streamed)."""
    from test_kit_openai import text
    traces, (streamed, asked), logged = await _stub_turns(
        receiver, [text("hi there"), text("hi there")], ["stream", "run"])
    for run_id, answered in ((streamed, "stub"), (asked, "gpt-4o")):
        _, [call] = root_and_children(traces[TracingObserver.trace_id(run_id)])
        assert call.name == "chat gpt-4o" and attrs(call)["gen_ai.request.model"] == "gpt-4o"
        assert attrs(call)["gen_ai.response.model"] == answered
    [p] = [e.payload for e in logged if e.run_id == streamed and e.kind == "model.completed"]
    assert (p.model, p.response_model) == ("gpt-4o", "stub")


async def test_an_agent_tools_model_calls_are_children_of_its_tool_span(receiver):
    """An SDK agent played as a tool logs its model's calls inside the tool: their span was the
    root's child, a sibling of the tool's, and started before the tool did."""
    inner = agents.Agent(name="inner", instructions="Help.",
                         model=ScriptedModel(["inner says"], name="gpt-4o-mini"))
    model = ScriptedModel([{"tool": "helper", "args": {"input": "q"}}, "done"], name="gpt-4o")
    with anyio.fail_after(10):
        async with MemoryStore() as store:
            async with Deck([Agent("calc", "Ask.", tools=[inner.as_tool("helper", "Helps.")],
                                   model=model)], store=store) as deck:
                done = await deck.run("calc", "hi")
            logged = await store.read(done.run_id)
        await play(TracingObserver(public_key=PK, secret_key=SK, host=receiver.host), logged)
    root, children = root_and_children(receiver.traces()[TracingObserver.trace_id(done.run_id)])
    [tool] = [s for s in children if s.name == "execute_tool helper"]
    [call] = [s for s in children if s.name == "chat gpt-4o-mini"]
    assert tool.parent_span_id == root.span_id and call.parent_span_id == tool.span_id
    assert tool.start_time_unix_nano <= call.start_time_unix_nano <= call.end_time_unix_nano \
        <= tool.end_time_unix_nano
    assert [s.parent_span_id for s in children if s.name == "chat gpt-4o"] == [root.span_id] * 2


class Count(TypedDict, total=False):
    n: int


async def bump(state: Count) -> dict:
    return {"n": state.get("n", 0) + 1}


async def test_a_child_runs_trace_carries_its_parents_session_and_its_tool_span_leads_there(
        receiver):
    """A workflow played as a tool is a child run with a trace of its own, which claims no
    session: its trace had no session.id, so the session's traces in Langfuse left it out; and
    the parent's execute_tool span carried nothing leading there."""
    graph = StateGraph(Count).add_node("bump", bump).add_edge(START, "bump").add_edge("bump", END)
    model = ScriptedModel([{"tool": "counter", "args": {"n": 1}}, "done"], name="gpt-4o")
    with anyio.fail_after(10):
        async with Deck([Agent("calc", "Count.", workflows=["counter"], model=model)],
                        workflows=[Workflow("counter", graph)], observers=[TracingObserver(
                            public_key=PK, secret_key=SK, host=receiver.host)]) as deck:
            done = await deck.run("calc", "count", session_id="s7")
    traces = receiver.traces()
    parent, children = root_and_children(traces.pop(TracingObserver.trace_id(done.run_id)))
    [child] = [s for spans in traces.values() for s in spans if not s.parent_span_id]
    assert child.name == "invoke_workflow counter" and attrs(child)["kit.status"] == "COMPLETED"
    assert attrs(child)["kit.parent_run_id"] == done.run_id
    assert attrs(child)["session.id"] == attrs(parent)["session.id"] == "s7"
    assert attrs(child)["gen_ai.conversation.id"] == "s7"
    [tool] = [s for s in children if s.name == "execute_tool counter"]
    child_run = attrs(child)["kit.run_id"]
    assert attrs(tool)["kit.child_run_id"] == child_run
    assert attrs(tool)["kit.child_trace_id"] == TracingObserver.trace_id(child_run) \
        == child.trace_id.hex()
    assert [(link.trace_id, link.span_id) for link in tool.links] == [(child.trace_id, child.span_id)]
    assert not any("kit.child_run_id" in attrs(s) for s in children if s is not tool)


async def test_a_parked_run_stays_one_trace_in_two_segments(receiver, monkeypatch):
    monkeypatch.setenv("KIT_TRACING_PUBLIC_KEY", PK)  # keys and host from the settings
    monkeypatch.setenv("KIT_TRACING_SECRET_KEY", SK)
    monkeypatch.setenv("KIT_TRACING_HOST", receiver.host)
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    # As the log holds them: a pause or resume is requested (control.requested), then done. The
    # resume's request opened the new segment, which said kit.resumed_by "unknown".
    payloads = [RunStarted("calc", "agent", "s9"), ModelCompleted("gpt-4o", 10, 2, None),
                ControlRequested("pause", "operator", "api"), RunPaused("operator"),
                ControlRequested("resume", None, "api"), RunResumed("resume"),
                ModelCompleted("gpt-4o", 12, 3, None), RunCompleted("done")]
    logged = [Event("r9", i, p, "calc", None, t0 + timedelta(seconds=i)) for i, p in enumerate(payloads)]
    with anyio.fail_after(10):
        await play(TracingObserver(), logged)
    [(trace_id, spans)] = receiver.traces().items()
    assert trace_id == TracingObserver.trace_id("r9")
    roots = sorted((s for s in spans if not s.parent_span_id), key=lambda s: s.start_time_unix_nano)
    assert [r.name for r in roots] == ["invoke_agent calc", "invoke_agent calc"]
    first, second = attrs(roots[0]), attrs(roots[1])
    assert first["kit.status"] == "PAUSED" and first["kit.parked"] == "run.paused"
    assert second["kit.resumed_by"] == "resume" and second["kit.status"] == "COMPLETED"
    assert first["session.id"] == second["session.id"] == "s9"
    assert roots[0].end_time_unix_nano == roots[0].start_time_unix_nano + 3 * 10**9
    assert roots[1].start_time_unix_nano == roots[0].start_time_unix_nano + 5 * 10**9
    chats = [s for s in spans if s.parent_span_id]
    assert [s.parent_span_id for s in chats] == [roots[0].span_id, roots[1].span_id]
    # A model call's span starts where the previous step ended (the log records its end only).
    assert chats[1].start_time_unix_nano == roots[1].start_time_unix_nano


async def test_a_parked_run_cancelled_ends_in_a_segment_that_says_no_resume(receiver):
    """A paused run cancelled where it stood: its last segment said kit.resumed_by "unknown", as
    if some resume the log does not hold had played it."""
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    payloads = [RunStarted("calc", "agent", "s9"), ModelCompleted("gpt-4o", 10, 2, None),
                RunPaused("operator"), ControlRequested("cancel", "done with it", "api"),
                RunCancelled("done with it")]
    logged = [Event("r8", i, p, "calc", None, t0 + timedelta(seconds=i)) for i, p in enumerate(payloads)]
    with anyio.fail_after(10):
        await play(TracingObserver(public_key=PK, secret_key=SK, host=receiver.host), logged)
    [spans] = receiver.traces().values()
    roots = sorted((s for s in spans if not s.parent_span_id), key=lambda s: s.start_time_unix_nano)
    assert [attrs(r)["kit.status"] for r in roots] == ["PAUSED", "CANCELLED"]
    last = attrs(roots[1])
    assert "kit.resumed_by" not in last and last["kit.cancel_reason"] == "done with it"
    assert last["session.id"] == "s9" and roots[1].name == "invoke_agent calc"
    assert roots[1].start_time_unix_nano == roots[1].end_time_unix_nano == \
        roots[0].start_time_unix_nano + 4 * 10**9


class Release(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


async def approve(state: Release) -> dict:
    return {"log": [f"approved: {interrupt({'question': 'ship it?'})}"]}


async def test_a_workflow_answered_after_a_restart_stays_a_workflow_in_its_trace(receiver, tmp_path):
    """A durable workflow parked by one process (here a deck before a restart) and answered by
    another: its resumed segment was rendered as an agent's, ``invoke_agent release``; and it
    had no session (nor namespace): the log's resume does not say them, so the session's traces
    in Langfuse left the segment out. The tracer is told the run's index row (RunInfo)."""
    def release() -> Workflow:
        graph = StateGraph(Release).add_node("approve", approve)
        return Workflow("release", graph.add_edge(START, "approve").add_edge("approve", END),
                        durable=True)

    parked: list = []
    with anyio.fail_after(30):
        for answer in (False, True):  # a deck, and its tracer, per process
            async with SQLiteStore(str(tmp_path / "kit.db")) as store:
                async with Deck(workflows=[release()], store=store, observers=[TracingObserver(
                        public_key=PK, secret_key=SK, host=receiver.host)]) as deck:
                    if answer:
                        assert await deck.answer(parked[0].run_id, "yes") == {"log": ["approved: yes"]}
                    else:
                        parked.append(await deck.run("release", {"log": []}, session_id="rel-42",
                                                     namespace="tenant-a"))
    [spans] = receiver.traces().values()
    roots = sorted((s for s in spans if not s.parent_span_id), key=lambda s: s.start_time_unix_nano)
    assert [(r.name, attrs(r)["langfuse.observation.type"], attrs(r)["kit.status"]) for r in roots] == [
        ("invoke_workflow release", "chain", "WAITING_HUMAN"),
        ("invoke_workflow release", "chain", "COMPLETED")]
    assert attrs(roots[1])["kit.resumed_by"] == "answer"
    for root in roots:
        a = attrs(root)
        assert a["session.id"] == a["gen_ai.conversation.id"] == "tenant-a/rel-42"
        assert a["kit.namespace"] == "tenant-a"


async def test_a_child_workflow_answered_by_another_process_keeps_its_name(receiver, tmp_path):
    """A workflow played as a tool parks; another process answers it. Its resumed segment was
    named after the parent agent, ``invoke_workflow boss`` (its origin is ``boss/release``), and
    its langfuse.trace.name renamed the child's trace to the parent's; and it had neither its
    parent (``kit.parent_run_id``) nor its parent's session."""
    def catalog() -> tuple[list[Agent], list[Workflow]]:
        graph = StateGraph(Release).add_node("approve", approve)
        model = ScriptedModel([{"tool": "release", "args": {}}, "asked"], name="gpt-4o")
        return [Agent("boss", "Ask.", workflows=["release"], model=model)], [Workflow(
            "release", graph.add_edge(START, "approve").add_edge("approve", END), durable=True)]

    parked: list = []
    with anyio.fail_after(30):
        for answer in (False, True):  # a deck, and its tracer, per process
            async with SQLiteStore(str(tmp_path / "kit.db")) as store:
                async with Deck(*catalog(), store=store, observers=[TracingObserver(
                        public_key=PK, secret_key=SK, host=receiver.host)]) as deck:
                    if answer:
                        await deck.answer(parked[0].run_id, "yes")
                    else:
                        await deck.run("boss", "ship it", session_id="s-42")
                        parked.extend(await deck.pending())
    spans = receiver.traces()[TracingObserver.trace_id(parked[0].run_id)]
    roots = sorted((s for s in spans if not s.parent_span_id), key=lambda s: s.start_time_unix_nano)
    assert [(r.name, attrs(r)["kit.name"], attrs(r)["langfuse.trace.name"], attrs(r)["kit.status"])
            for r in roots] == [("invoke_workflow release", "release", "release", "WAITING_HUMAN"),
                                ("invoke_workflow release", "release", "release", "COMPLETED")]
    assert attrs(roots[1])["gen_ai.workflow.name"] == "release"
    for root in roots:
        assert attrs(root)["session.id"] == "s-42"
        assert attrs(root)["kit.parent_run_id"] == attrs(roots[0])["kit.parent_run_id"] != ""


async def test_a_paused_workflow_resumed_by_another_process_stays_a_workflow(receiver):
    """A paused workflow resumed by another process (a replica, or after a restart): its resumed
    segment was rendered as an agent's, ``invoke_agent flow`` of observation type agent, since
    a resume (unlike an answer or a tick) may be an agent's."""
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    before = [RunStarted("flow", "workflow", "t1"), NodeUpdated("a"),
              ControlRequested("pause", None, "api"), RunPaused(None)]
    after = [ControlRequested("resume", None, "api"), RunResumed("resume"), NodeUpdated("b"),
             RunCompleted({"log": []})]
    origins = ["flow", "flow/a", "flow", "flow", "flow", "flow", "flow/b", "flow"]
    logged = [Event("r5", i, p, o, None, t0 + timedelta(seconds=i))
              for i, (p, o) in enumerate(zip(before + after, origins))]
    with anyio.fail_after(10):
        for part in (logged[:4], logged[4:]):  # a tracer per process
            await play(TracingObserver(public_key=PK, secret_key=SK, host=receiver.host), part)
    [spans] = receiver.traces().values()
    roots = sorted((s for s in spans if not s.parent_span_id), key=lambda s: s.start_time_unix_nano)
    assert [(r.name, attrs(r)["kit.invocable"], attrs(r)["langfuse.observation.type"])
            for r in roots] == [("invoke_workflow flow", "workflow", "chain")] * 2
    assert attrs(roots[1])["gen_ai.workflow.name"] == "flow"
    assert "gen_ai.agent.name" not in attrs(roots[1])
    assert attrs(roots[1])["kit.resumed_by"] == "resume"


async def test_a_parked_run_cancelled_by_another_process_says_no_resume(receiver):
    """A paused run cancelled where it stood by another process: its last segment said
    kit.resumed_by "unknown" (only a cancel in the process that saw it park said nothing) and
    claimed the run was an agent's, which the cancel does not tell."""
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    payloads = [RunStarted("flow", "workflow", "t1"), NodeUpdated("a"), RunPaused(None),
                ControlRequested("cancel", "done with it", "api"), RunCancelled("done with it")]
    origins = ["flow", "flow/a", "flow", "flow", "flow"]
    logged = [Event("r6", i, p, o, None, t0 + timedelta(seconds=i))
              for i, (p, o) in enumerate(zip(payloads, origins))]
    with anyio.fail_after(10):
        for part in (logged[:3], logged[3:]):  # a tracer per process
            await play(TracingObserver(public_key=PK, secret_key=SK, host=receiver.host), part)
    [spans] = receiver.traces().values()
    roots = sorted((s for s in spans if not s.parent_span_id), key=lambda s: s.start_time_unix_nano)
    last = attrs(roots[1])
    assert last["kit.status"] == "CANCELLED" and last["kit.cancel_reason"] == "done with it"
    assert "kit.resumed_by" not in last
    assert last["kit.name"] == last["langfuse.trace.name"] == "flow"
    assert "kit.invocable" not in last and "gen_ai.agent.name" not in last  # not known here
    assert roots[1].name == "flow"


def turn(run_id: str, calls: int) -> list[Event]:
    """An agent run's events as the log holds them: ``calls`` model calls (``calls + 1`` spans)."""
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    payloads = [RunStarted("calc", "agent"), *[ModelCompleted("gpt-4o", 10, 2, None)] * calls,
                RunCompleted("done")]
    return [Event(run_id, i, p, "calc", None, t0 + timedelta(seconds=i))
            for i, p in enumerate(payloads)]


def losses(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kit.observers"]


async def test_spans_the_collector_refuses_are_counted_and_reported(receiver, caplog):
    """A collector that refuses what it is sent (a 400: a wrong key, a body it will not take):
    every span was lost, and nothing said how many. The hub's ObserverStats counts the events
    the observer took, all of them; OpenTelemetry's export log counts nothing."""
    receiver.status = 400
    observer = TracingObserver(public_key=PK, secret_key=SK, host=receiver.host)
    with caplog.at_level(logging.WARNING, logger="kit.observers"), anyio.fail_after(10):
        await play(observer, turn("r1", calls=3))
    assert receiver.requests  # sent, and refused
    assert observer.stats == TracingStats(spans=4, exported=0, failed=4, dropped=0)
    assert any("4 of 4 spans were not exported" in m for m in losses(caplog))


async def test_spans_a_collector_answers_with_a_redirect_are_counted_lost(receiver, caplog):
    """A host that redirects (``KIT_TRACING_HOST=http://...`` of a collector served over https,
    or a proxy sending to a login page): OpenTelemetry's exporter follows no redirect and takes
    any 3xx for success, so every span was counted exported, and nothing said any was lost."""
    receiver.status = 308
    receiver.location = "https://collector.example/api/public/otel/v1/traces"
    observer = TracingObserver(public_key=PK, secret_key=SK, host=receiver.host)
    with caplog.at_level(logging.WARNING), anyio.fail_after(10):
        await play(observer, turn("r1", calls=3))
    assert len(receiver.requests) == 1  # sent once: a redirect is no transient error
    assert observer.stats == TracingStats(spans=4, exported=0, failed=4, dropped=0)
    assert any("4 of 4 spans were not exported" in m for m in losses(caplog))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "308" in said and "https://collector.example" in said  # why, and where it points
    assert SK not in said and base64.b64encode(f"{PK}:{SK}".encode()).decode() not in said


async def test_the_applications_otlp_headers_never_reach_the_tracing_collector(
        receiver, monkeypatch):
    """An application exporting its own telemetry sets OpenTelemetry's exporter settings, whose
    headers carry its collector's credentials (``x-honeycomb-team=...``). kit's exporter took
    them too, and sent them to Langfuse with every request (kit's own Authorization won only
    because it was set after them)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-honeycomb-team=HONEY-SECRET,"
                       "authorization=Bearer APP-SECRET")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "dd-api-key=DD-SECRET")
    observer = TracingObserver(public_key=PK, secret_key=SK, host=receiver.host)
    with anyio.fail_after(10):
        await play(observer, turn("r1", calls=1))
    assert observer.stats.exported == 2
    [(_, headers, _)] = receiver.requests
    assert "SECRET" not in str(headers.items())
    assert headers["Authorization"] == "Basic " + base64.b64encode(f"{PK}:{SK}".encode()).decode()
    assert headers["x-langfuse-ingestion-version"] == "4"


def _certificates(where) -> dict[str, str]:
    """A test CA, a certificate of 127.0.0.1 and a client's, made by the openssl command."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (where / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    subprocess.run(["openssl", "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem",
                    "-days", "1", "-subj", "/CN=kit-test-ca"], cwd=where, check=True,
                   capture_output=True, timeout=60)
    for name, ext in (("srv", ["-extfile", "san.ext"]), ("cli", [])):
        subprocess.run(["openssl", "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                        "-subj", f"/CN={name}"], cwd=where, check=True, capture_output=True,
                       timeout=60)
        subprocess.run(["openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey",
                        "ca.key", "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", *ext],
                       cwd=where, check=True, capture_output=True, timeout=60)
    return {name: str(where / name) for name in ("ca.pem", "srv.pem", "srv.key", "cli.pem",
                                                 "cli.key")}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_the_applications_otlp_client_certificate_never_reaches_the_collector(
        monkeypatch, tmp_path):
    """OpenTelemetry's exporter also takes the application's TLS settings for its own collector
    (``OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE``/``_KEY``, ``OTEL_EXPORTER_OTLP_CERTIFICATE``):
    kit's presented the application's client certificate to Langfuse (and checked Langfuse's
    against the application's CA)."""
    files = _certificates(tmp_path)
    receiver = Receiver()
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(files["srv.pem"], files["srv.key"])
    tls.load_verify_locations(files["ca.pem"])
    tls.verify_mode = ssl.CERT_OPTIONAL  # records a client certificate, if one is presented
    receiver.server.socket = tls.wrap_socket(receiver.server.socket, server_side=True)
    peers: list = []
    handler = receiver.server.RequestHandlerClass
    post = handler.do_POST
    handler.do_POST = lambda self: (peers.append(self.connection.getpeercert()), post(self))[1]
    receiver.thread.start()
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", files["ca.pem"])  # requests' own: trusts the stub
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", files["cli.pem"])
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", files["cli.key"])
    try:
        observer = TracingObserver(public_key=PK, secret_key=SK,
                                   host=receiver.host.replace("http:", "https:"))
        with anyio.fail_after(20):
            await play(observer, turn("r1", calls=1))
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
        receiver.thread.join()
    assert observer.stats.exported == 2 and peers == [None]  # no client certificate


async def test_the_applications_otel_sampler_samples_no_run_away(receiver, monkeypatch):
    """An application that samples its own traces (``OTEL_TRACES_SAMPLER``): kit's private
    tracer provider read the same setting, so runs went untraced, uncounted, unsaid (a span
    not sampled never reaches the exporter)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    observer = TracingObserver(public_key=PK, secret_key=SK, host=receiver.host)
    with anyio.fail_after(10):
        await play(observer, turn("r1", calls=1))
    assert observer.stats == TracingStats(spans=2, exported=2, failed=0, dropped=0)
    assert [s.name for s in receiver.traces()[TracingObserver.trace_id("r1")]] == [
        "chat gpt-4o", "invoke_agent calc"]


async def test_a_collector_answering_without_end_costs_no_memory(receiver):
    """A host that answers an export with an endless body (garbage, a stream, the wrong server):
    the exporter read the whole answer into memory before looking at its status, so the process
    grew with it, without bound (64 MiB here, all of it taken)."""
    receiver.garbage = 64 * 2**20
    observer = TracingObserver(public_key=PK, secret_key=SK, host=receiver.host)
    with anyio.fail_after(20):
        await play(observer, turn("r1", calls=1))
    assert observer.stats == TracingStats(spans=2, exported=2, failed=0, dropped=0)  # a 200
    assert receiver.garbage_sent < receiver.garbage // 2  # it hung up: at most socket buffers


async def test_spans_pushed_out_of_the_full_queue_are_counted_and_reported(
        receiver, monkeypatch, caplog):
    """Runs faster than the collector fill the span queue, which drops its oldest: OpenTelemetry
    logged "Queue full, dropping Span." at most once per 20 s and counted nothing."""
    monkeypatch.setattr(kit_otlp, "QUEUE_SIZE", 4)
    observer = TracingObserver(public_key=PK, secret_key=SK, host=receiver.host)
    with caplog.at_level(logging.WARNING, logger="kit.observers"), anyio.fail_after(10):
        await play(observer, turn("r1", calls=9))  # within the export delay: nothing left yet
    assert observer.stats == TracingStats(spans=10, exported=4, failed=0, dropped=6)
    assert sum(len(spans) for spans in receiver.traces().values()) == 4
    assert any("6 of 10 spans were not exported" in m for m in losses(caplog))
    assert any("spans are being lost" in m for m in losses(caplog))  # said when it began


async def test_close_gives_up_on_a_collector_that_never_answers_and_says_so(monkeypatch, caplog):
    """A collector that takes the connection and never answers: close waited on each batch's
    export for EXPORT_TIMEOUT, retries included (OpenTelemetry's flush ignores its timeout), so
    the hub abandoned it at CLOSE_TIMEOUT before anything was told of the spans lost."""
    monkeypatch.setattr(kit_otlp, "FLUSH_TIMEOUT", 0.5)
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts nor answers
    host = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        observer = TracingObserver(public_key=PK, secret_key=SK, host=host)
        observer.start()
        for ev in turn("r1", calls=1):
            observer.emit(ev)
        observer.sdk_processor().force_flush()  # the application's agents.flush_traces(): at once
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kit.observers"):
            await anyio.to_thread.run_sync(observer.close)
        assert time.monotonic() - began < 3
        assert observer.stats.spans == 2 and observer.stats.exported == 0
        assert any("2 of 2 spans were not exported" in m for m in losses(caplog))
    finally:
        silent.close()  # the request in flight fails now: the export thread ends within the test
        if observer._export is not None:
            observer._export._thread.join(5)


@pytest.mark.parametrize("answer", ["protobuf", "json"])
async def test_spans_a_collectors_partial_success_rejects_are_counted_failed_and_its_message_logged(
        receiver, caplog, answer):
    """A collector that takes the request (a 200) but says in its OTLP answer that it rejected
    some of its spans (``partial_success.rejected_spans``, with why in ``error_message``): every
    span was counted exported, and the collector's reason was never read. Its answer is
    protobuf, as kit's request, or OTLP/JSON (Langfuse answers JSON; int64 as a string)."""
    message = "span attribute value too long" + "!" * 5000
    if answer == "json":
        receiver.reply_json = {"partialSuccess": {"rejectedSpans": "2", "errorMessage": message}}
    else:
        receiver.reply = ExportTraceServiceResponse(partial_success=ExportTracePartialSuccess(
            rejected_spans=2, error_message=message))
    observer = TracingObserver(public_key=PK, secret_key=SK, host=receiver.host)
    with caplog.at_level(logging.WARNING), anyio.fail_after(10):
        await play(observer, turn("r1", calls=3))
    assert len(receiver.requests) == 1  # (protobuf, as kit sends) no retry of a 200
    assert observer.stats == TracingStats(spans=4, exported=2, failed=2, dropped=0)
    said = losses(caplog)
    assert any("rejected 2 of 4 spans" in m and "span attribute value too long" in m
               for m in said)
    assert not any("!" * (kit_otlp.MESSAGE_MAX + 1) in m for m in said)  # its length capped
    assert any("2 of 4 spans were not exported" in m for m in said)


def refused_host() -> str:
    """A loopback URL where nothing listens: every connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_a_collector_that_is_down_is_told_once_not_once_per_export(monkeypatch, caplog):
    """While the collector was down, every export said so, OpenTelemetry's exporter up to
    three lines each (its retries, then its failure): some 2,000 lines an hour. Now: one line
    when exports start failing (and why), the count at close, and nothing from OpenTelemetry."""
    monkeypatch.setattr(kit_otlp, "BATCH_SIZE", 1)  # one export per span
    monkeypatch.setattr(kit_otlp, "EXPORT_TIMEOUT", 0.5)  # no time to retry: fails at once
    observer = TracingObserver(public_key=PK, secret_key=SK, host=refused_host())
    with caplog.at_level(logging.WARNING), anyio.fail_after(10):
        await play(observer, turn("r1", calls=5))
    assert observer.stats == TracingStats(spans=6, exported=0, failed=6, dropped=0)
    said = [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert len(said) == 2  # when it began, and the total at close: no line per export
    assert "exports to the collector are failing" in said[0] and "1 failed in a row" in said[0]
    assert "Connection refused" in said[0]  # why
    assert "6 of 6 spans were not exported" in said[1] and "6 in a row" in said[1]


async def test_while_exports_fail_each_report_tells_the_running_count(monkeypatch, caplog):
    """Past ``REPORT_EVERY`` (here at once) a failing collector is told again, with the count."""
    monkeypatch.setattr(kit_otlp, "BATCH_SIZE", 1)
    monkeypatch.setattr(kit_otlp, "EXPORT_TIMEOUT", 0.5)
    monkeypatch.setattr(kit_otlp, "REPORT_EVERY", 0.0)
    observer = TracingObserver(public_key=PK, secret_key=SK, host=refused_host())
    with caplog.at_level(logging.WARNING, logger="kit.observers"), anyio.fail_after(10):
        await play(observer, turn("r1", calls=2))
    failing = [m for m in losses(caplog) if "exports to the collector are failing" in m]
    assert [re.search(r"(\d+) failed in a row", m)[1] for m in failing] == ["1", "2", "3"]
    assert "spans lost so far: 3 of 3" in failing[-1]


async def test_a_collector_that_recovers_is_told_once_when_it_does(receiver, monkeypatch, caplog):
    """A collector that refuses two exports, then takes the rest: one line when exports start
    failing, one when they recover (with how many failed), none for the exports between."""
    monkeypatch.setattr(kit_otlp, "BATCH_SIZE", 1)
    receiver.answers = [400, 400]
    observer = TracingObserver(public_key=PK, secret_key=SK, host=receiver.host)
    with caplog.at_level(logging.WARNING), anyio.fail_after(10):
        await play(observer, turn("r1", calls=4))
    assert len(receiver.requests) == 5
    assert observer.stats == TracingStats(spans=5, exported=3, failed=2, dropped=0)
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "exports to the collector are failing" in m]) == 1
    [back] = [m for m in said if "recovered" in m]
    assert "recovered after 2 failed in a row" in back and "spans lost so far: 2 of" in back
    assert len(said) == 3  # failing, recovered, the total at close


async def test_a_busy_collectors_503_is_retried_and_its_spans_exported(receiver, caplog):
    """A 503 (with ``Retry-After``) is retried within ``EXPORT_TIMEOUT``: the spans arrive, and
    nothing is said of a failure."""
    receiver.answers = [503, 503]
    observer = TracingObserver(public_key=PK, secret_key=SK, host=receiver.host)
    with caplog.at_level(logging.WARNING), anyio.fail_after(10):
        await play(observer, turn("r1", calls=1))
    assert len(receiver.requests) == 3  # the same request, thrice
    assert observer.stats == TracingStats(spans=2, exported=2, failed=0, dropped=0)
    assert not caplog.records


def test_start_refuses_missing_keys_and_a_bad_host(monkeypatch):
    monkeypatch.delenv("KIT_TRACING_PUBLIC_KEY", raising=False)
    monkeypatch.setenv("KIT_TRACING_SECRET_KEY", SK)
    with pytest.raises(ConfigError, match="needs KIT_TRACING_PUBLIC_KEY"):
        TracingObserver().start()
    with pytest.raises(ConfigError, match="http"):
        TracingObserver(public_key=PK, host="cloud.langfuse.com").start()


def test_opentelemetry_is_imported_at_start_not_at_import_or_construction():
    code = ("import sys, kit_observers, kit_tracing; kit_tracing.TracingObserver(sdk_spans=True)"
            ".sdk_processor(); assert not [m for m in sys.modules if m.startswith('opentelemetry')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   cwd=os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------- raw layer ----

# asyncio only: this test drives agents.Runner directly, and the agents SDK is asyncio-only (under
# trio the deck hosts it on its engine thread, which is not what this test exercises).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sdk_spans_arrive_as_a_second_separate_trace(receiver, anyio_backend):
    observer = TracingObserver(sdk_spans=True, public_key=PK, secret_key=SK, host=receiver.host)
    observer.start()
    model = ScriptedModel([{"tool": "add", "args": {"a": 2, "b": 3}}, "5"], name="gpt-4o")
    agent = agents.Agent(name="calc", instructions="Add.", tools=[agents.function_tool(add)],
                         model=model)
    agents.set_trace_processors([observer.sdk_processor()])
    try:
        with anyio.fail_after(10):
            await agents.Runner.run(agent, "what is 2 + 3?", run_config=agents.RunConfig(
                trace_metadata={"kit.run_id": "r1"}, group_id="s1"))
    finally:
        agents.set_trace_processors([])
    observer.emit(Event("r1", 0, RunStarted("calc", "agent", "s1")))
    observer.emit(Event("r1", 1, RunCompleted("5")))
    await anyio.to_thread.run_sync(observer.close)

    traces = receiver.traces()
    semantic = traces.pop(TracingObserver.trace_id("r1"))
    assert [s.name for s in semantic] == ["invoke_agent calc"]
    [raw] = traces.values()  # a second trace, not nested under the semantic one
    root, _ = root_and_children(raw)
    assert attrs(root)["kit.run_id"] == "r1" and attrs(root)["kit.layer"] == "sdk"
    assert attrs(root)["session.id"] == "s1"
    by_id = {s.span_id: s for s in raw}
    names = {s.name for s in raw}
    assert {"invoke_agent calc", "execute_tool add"} <= names
    [tool] = [s for s in raw if s.name == "execute_tool add"]
    ancestors, span = [], tool
    while span.parent_span_id:
        span = by_id[span.parent_span_id]
        ancestors.append(span.name)
    # nested as the SDK nests it: trace > task > agent > turn > tool
    assert ancestors == ["turn 1", "invoke_agent calc", "task Agent workflow", "Agent workflow"]
    assert attrs(tool)["gen_ai.tool.name"] == "add"
    assert "what is 2 + 3" not in str([attrs(s) for s in raw])  # content stays out


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sdk_spans_never_export_what_model_settings_carry_besides_settings(receiver, anyio_backend):
    """The SDK's generation span holds every ModelSettings field and the client's base_url: a
    gateway's key in extra_headers, content in extra_body or metadata, a URL's credentials were
    all exported as span attributes."""
    observer = TracingObserver(sdk_spans=True, public_key=PK, secret_key=SK, host=receiver.host)
    observer.start()
    settings = agents.ModelSettings(temperature=0.2, max_tokens=50, metadata={"note": "META-SECRET"},
                                    extra_headers={"x-portkey-api-key": "HEADER-SECRET"},
                                    extra_body={"user_note": "BODY-SECRET"},
                                    extra_query={"key": "QUERY-SECRET"}, extra_args={"a": "ARGS-SECRET"})
    agents.set_trace_processors([observer.sdk_processor()])
    try:
        with agents.trace("t", metadata={"kit.run_id": "r2"}):  # as the SDK's OpenAI models make it
            with agents.generation_span(model="gpt-4o", model_config=settings.to_json_dict() | {
                    "base_url": "https://user:URL-SECRET@gateway.example/v1"}):
                pass
    finally:
        agents.set_trace_processors([])
    await anyio.to_thread.run_sync(observer.close)
    [raw] = receiver.traces().values()
    [generation] = [s for s in raw if s.name == "chat gpt-4o"]
    assert attrs(generation)["agents.model_config.temperature"] == 0.2
    assert attrs(generation)["agents.model_config.max_tokens"] == 50
    assert "SECRET" not in str([attrs(s) for s in raw])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sdk_spans_tell_the_model_asked_for_from_the_one_that_answered(receiver, anyio_backend):
    """The SDK's response span (the Responses API's) holds the response, which names the model
    that answered: it was exported as ``gen_ai.request.model``, the model asked for; a
    generation span's (Chat Completions') model is the one asked for."""
    from agents.tracing import response_span
    from openai.types.responses import Response
    observer = TracingObserver(sdk_spans=True, public_key=PK, secret_key=SK, host=receiver.host)
    observer.start()
    response = Response(id="resp_1", object="response", created_at=0, model="gpt-4o-2024-08-06",
                        output=[], tool_choice="auto", tools=[], parallel_tool_calls=True)
    agents.set_trace_processors([observer.sdk_processor()])
    try:
        with agents.trace("t", metadata={"kit.run_id": "r3"}):
            with response_span(response=response):
                pass
            with agents.generation_span(model="gpt-4o-mini"):
                pass
    finally:
        agents.set_trace_processors([])
    await anyio.to_thread.run_sync(observer.close)
    [raw] = receiver.traces().values()
    [answered] = [attrs(s) for s in raw if s.name == "chat gpt-4o-2024-08-06"]
    assert answered["gen_ai.response.model"] == "gpt-4o-2024-08-06"
    assert "gen_ai.request.model" not in answered
    [asked] = [attrs(s) for s in raw if s.name == "chat gpt-4o-mini"]
    assert asked["gen_ai.request.model"] == "gpt-4o-mini" and "gen_ai.response.model" not in asked


async def test_a_model_calls_cached_input_reaches_its_generation_span(receiver):
    """A model call's input read from the prompt cache showed nowhere in the trace: Langfuse
    counted all of it as uncached input. Its generation span now carries
    ``gen_ai.usage.cache_read.input_tokens`` and Langfuse's ``input_cached_tokens`` (its
    ``input`` the uncached rest); a call with none cached has neither."""
    from test_kit_openai import text
    traces, (cached, plain), _ = await _stub_turns(
        receiver, [text("hi there", usage=(100_000, 100, 90_000)), text("hi there", usage=(1200, 40))],
        ["run", "run"])
    _, [call] = root_and_children(traces[TracingObserver.trace_id(cached)])
    a = attrs(call)
    assert a["gen_ai.usage.cache_read.input_tokens"] == 90_000
    assert a["gen_ai.usage.input_tokens"] == 100_000
    assert json.loads(a["langfuse.observation.usage_details"]) == {
        "input": 10_000, "input_cached_tokens": 90_000, "output": 100, "total": 100_100}
    _, [call] = root_and_children(traces[TracingObserver.trace_id(plain)])
    a = attrs(call)
    assert "gen_ai.usage.cache_read.input_tokens" not in a
    assert json.loads(a["langfuse.observation.usage_details"]) == {
        "input": 1200, "output": 40, "total": 1240}
