"""Tests of kit's own MCP server (kit_mcp at ``/mcp`` through kit_http): the ``mcp`` package's
real streamable-HTTP client against a real Hypercorn on loopback with both workers; tools,
progress, interrupts and ``answer``, skills as resources, and what each call leaves in the log."""
from __future__ import annotations

import importlib.metadata
import json
import logging
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

import kit
import kit_mcp
from kit_sse import STOP_GRACE
from kit import Agent, ConfigError, Deck, RunStatus, ScriptedModel, Skills, Workflow
from test_kit_control import Gate
from test_kit_http import ask, catalog, echo, gated, graph, plan, served

pytestmark = [
    pytest.mark.anyio,
    # mcp 1.30's streamable-HTTP client stops reading an SSE response once its result is in,
    # leaving httpx's (and httpx-sse's) async generators to the GC; trio warns when it finalizes
    # them. Client-side and not kit's to fix; kit's own generators are closed (aclosing).
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <async_generator object (EventSource\.aiter_sse|Response\."
        r"aiter_|AsyncHTTP11Connection\.|HTTP11ConnectionByteStream\.|PoolByteStream\.|"
        r"AsyncResponseStream\.|BoundAsyncStream\.):pytest.PytestUnraisableExceptionWarning"),
]
SKILLS = Path(__file__).parent / ".kit" / "skills"


@pytest.fixture(autouse=True)
def memory_store(monkeypatch):
    monkeypatch.setenv("KIT_STORE", "memory")


@asynccontextmanager
async def mcp_served(deck: Deck):
    """The deck served with its MCP surface, and an initialized client session on ``/mcp``."""
    async with served(deck, surfaces=("mcp",)) as (client, app):
        async with streamable_http_client(f"{client.base_url}/mcp") as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session, client, app


async def kinds(deck: Deck, run_id: str) -> list[str]:
    return [e.kind for e in await deck.store.read(run_id)]


async def test_tools_are_the_agents_the_workflows_and_answer_and_skills_are_resources():
    durable = Workflow("release", graph(plan), durable=True)
    deck = Deck([Agent("echo", "Be brief.", model=ScriptedModel(["hi"]))],
                [Workflow("approve", graph(plan, ask)), durable], skills=Skills(SKILLS))
    async with mcp_served(deck) as (session, _, _):
        tools = {t.name: t for t in (await session.list_tools()).tools}
        assert list(tools) == ["echo", "approve", "release", "answer"]
        assert tools["echo"].inputSchema["required"] == ["message"] and "Be brief." in tools["echo"].description
        assert set(tools["approve"].inputSchema["properties"]) == {"input", "thread_id"}
        assert tools["approve"].inputSchema["required"] == [] and tools["release"].inputSchema["required"] == ["thread_id"]
        assert tools["answer"].inputSchema["required"] == ["run_id", "value"]
        [skill] = (await session.list_resources()).resources
        assert (str(skill.uri), skill.mimeType) == ("skill://release-notes", "text/markdown")
        [content] = (await session.read_resource(skill.uri)).contents
        assert content.text == deck.skills["release-notes"].body
        with pytest.raises(Exception, match="no resource skill://nope"):
            await session.read_resource("skill://nope")


async def test_the_handshake_names_kit_and_its_release():
    """``serverInfo`` told the ``mcp`` package's version (1.x) as kit's: a client logging or
    pinning the server it talks to saw a version kit never had."""
    async with served(Deck([echo()]), surfaces=("mcp",)) as (client, _):
        async with streamable_http_client(f"{client.base_url}/mcp") as (read, write, _):
            async with ClientSession(read, write) as session:
                info = (await session.initialize()).serverInfo
    assert (info.name, info.version) == ("kit", kit.__version__)
    assert kit.__version__ == importlib.metadata.version("kit")


async def test_a_client_browsing_resources_is_told_there_are_no_templates():
    """The server declares the resources capability, whose methods include
    ``resources/templates/list`` (VS Code and the MCP Inspector call it when they browse
    resources): it answered "Method not found", an error where the answer is an empty list."""
    async with mcp_served(Deck([echo()], skills=Skills(SKILLS))) as (session, _, _):
        assert (await session.list_resource_templates()).resourceTemplates == []
        assert [str(r.uri) for r in (await session.list_resources()).resources] == [
            "skill://release-notes"]


async def test_an_agent_call_sends_its_text_as_progress_and_logs_a_v1_stream():
    async with mcp_served(catalog()) as (session, client, app):
        progress: list[tuple[float, str | None]] = []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            progress.append((done, message))
        result = await session.call_tool("echo", {"message": "hi"}, progress_callback=on_progress)
        assert not result.isError and result.content[0].text == "hello there world"
        found = result.structuredContent
        assert found["output"] == "hello there world" and found["session_id"] is None
        assert found["usage"] == {"input_tokens": 3, "output_tokens": 3, "usd": None}
        assert progress == [(1, "hello"), (2, " there"), (3, " world")]
        async with client.stream("POST", "/agents/echo/chat?stream=true", json={"message": "hi"}) as v1:
            await v1.aread()
        assert await kinds(app.deck, found["run_id"]) == await kinds(app.deck, v1.headers["x-kit-run-id"])


async def test_a_session_id_keeps_the_conversation():
    model = ScriptedModel(["Nice to meet you.", "You are Ana."])
    async with mcp_served(Deck([Agent("a", model=model)])) as (session, _, app):
        await session.call_tool("a", {"message": "I am Ana", "session_id": "s1"})
        second = await session.call_tool("a", {"message": "Who am I?", "session_id": "s1"})
        assert second.structuredContent["session_id"] == "s1"
        assert "I am Ana" in str(model.calls[-1]["input"])


async def test_an_interrupt_names_its_run_and_payload_and_answer_resumes_it():
    async with mcp_served(catalog()) as (session, client, app):
        progress: list[str | None] = []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            progress.append(message)
        parked = await session.call_tool("approve", {"input": {"log": []}, "thread_id": "t1"},
                                         progress_callback=on_progress)
        found = parked.structuredContent
        assert not parked.isError and progress == ["node plan"]
        assert found == {"type": "interrupt", "payload": {"question": "ship it?"}, "thread_id": "t1",
                         "run_id": found["run_id"]}
        assert "call `answer`" in parked.content[0].text
        assert [p.run_id for p in await app.deck.pending()] == [found["run_id"]]
        done = await session.call_tool("answer", {"run_id": found["run_id"], "value": "yes"})
        assert done.structuredContent == {"output": {"log": ["plan", "answer=yes"]}, "thread_id": "t1",
                                          "run_id": found["run_id"]}
        again = await session.call_tool("answer", {"run_id": found["run_id"], "value": "no"})
        assert again.isError and again.structuredContent["error"] == "RunNotWaitingError"
        unknown = await session.call_tool("answer", {"run_id": "nope", "value": 1})
        assert unknown.isError and unknown.structuredContent["error"] == "UnknownRunError"
        v1 = (await client.post("/workflows/approve?stream=true", json={"input": {"log": []},
                                                                       "thread_id": "t2"}))
        await client.post("/workflows/approve/t2/resume", json={"value": "yes"})
        assert await kinds(app.deck, found["run_id"]) == await kinds(app.deck, v1.headers["x-kit-run-id"])


async def nap(state: dict) -> dict:
    kit.sleep_until(datetime(2999, 1, 1, tzinfo=timezone.utc))
    return {"log": ["woke"]}


async def test_a_sleeping_run_is_not_offered_to_answer():
    """A sleep has an interrupt's shape (as ``deck.run`` returns it), but no answer wakes it:
    the text says a tick does, never to call ``answer`` (which refuses it)."""
    async with mcp_served(Deck([echo()], [Workflow("nap", graph(plan, nap))])) as (session, _, _):
        parked = await session.call_tool("nap", {"input": {"log": []}})
        found = parked.structuredContent
        assert not parked.isError and found["type"] == "interrupt"
        assert found["payload"] == {"kind": "sleep", "until": "2999-01-01T00:00:00+00:00"}
        assert "tick" in parked.content[0].text and "call `answer`" not in parked.content[0].text
        refused = await session.call_tool("answer", {"run_id": found["run_id"], "value": 1})
        assert refused.isError and refused.structuredContent["error"] == "RunNotWaitingError"


async def test_refusals_and_failures_are_error_results():
    gate = Gate()
    worker = Agent("worker", tools=[gate.wait_tool()],
                   model=ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "done"]))
    boom = Agent("boom", model=ScriptedModel([RuntimeError("sk-secret")]))
    async with mcp_served(catalog(worker, boom)) as (session, _, app):
        async with anyio.create_task_group() as tg:
            tg.start_soon(session.call_tool, "worker", {"message": "go", "session_id": "s"})
            await gate.until_entered()
            busy = await session.call_tool("worker", {"message": "too", "session_id": "s"})
            assert busy.isError and busy.structuredContent["error"] == "SessionBusyError"
            gate.release.set()
        failed = await session.call_tool("boom", {"message": "hi"})
        assert failed.isError and failed.structuredContent["error"] == "RuntimeError"
        assert "sk-secret" not in failed.content[0].text and "its log has the details" in failed.content[0].text
        missing = await session.call_tool("nope", {})
        assert missing.isError and missing.structuredContent["error"] == "UnknownNameError"
        invalid = await session.call_tool("echo", {"text": "no message"})
        assert invalid.isError and "validation" in invalid.content[0].text
        assert [r.status for r in await app.deck.store.runs(name="boom")] == [RunStatus.FAILED]


async def test_a_run_failed_by_a_base_exception_is_an_error_result_and_the_server_serves_on():
    """A tool raising a ``BaseException`` that is no ``Exception``: it left the call into the
    MCP session manager's task group, which died with every session (the client timed out)."""
    from test_kit_http import aborts
    model = ScriptedModel([{"tool": "aborts", "args": {"x": 1}}], cycle=True)
    async with mcp_served(catalog(Agent("aborting", tools=[aborts], model=model))) as (
            session, client, app):
        with anyio.fail_after(10):
            failed = await session.call_tool("aborting", {"message": "hi"})
            assert failed.isError and failed.structuredContent["error"] == "Abort"
            assert "secret-token-456" not in failed.content[0].text
            said = await session.call_tool("echo", {"message": "hi"})
            assert not said.isError and said.structuredContent["output"] == "hello there world"
        assert [r.status for r in await app.deck.store.runs(name="aborting")] == [RunStatus.FAILED]


async def test_null_for_an_optional_argument_is_taken_as_absent():
    """Models often fill optional parameters with null: ``{"message": "hi", "session_id": null}``
    and ``"input": null`` were refused ("Input validation error: None is not of type 'string'"),
    where the v1 routes take both. A required argument given null stays an error, naming it."""
    durable = Workflow("ship", graph(plan), durable=True)
    async with mcp_served(Deck([echo()], [Workflow("plain", graph(plan)), durable])) as (
            session, _, app):
        said = await session.call_tool("echo", {"message": "hi", "session_id": None})
        assert not said.isError, said.content[0].text
        assert said.structuredContent["output"] == "hello there world"
        assert said.structuredContent["session_id"] is None
        ran = await session.call_tool("plain", {"input": None, "thread_id": None})
        assert not ran.isError, ran.content[0].text
        assert ran.structuredContent["output"] == {"log": ["plan"]}
        for tool, args, named in (("echo", {"message": None}, "message"),
                                  ("echo", {"message": "hi", "session_id": 3}, "session_id"),
                                  ("echo", {"message": "hi", "user": None}, "user"),
                                  ("ship", {"input": {"log": []}, "thread_id": None}, "thread_id"),
                                  ("answer", {"run_id": None, "value": 1}, "run_id")):
            refused = await session.call_tool(tool, args)
            assert refused.isError, (tool, args)
            assert "validation" in refused.content[0].text and repr(named) in refused.content[0].text, \
                refused.content[0].text
        assert [r.name for r in await app.deck.store.runs()] == ["echo", "plain"]


async def explode(state: dict) -> dict:
    raise ValueError("node exploded: sk-answered-123")


async def test_an_answered_run_that_then_fails_is_its_failure_naming_the_run(capsys):
    """The run fails after its answer: the run's failure, as a failed call reports it (not a
    broken call's "internal error"), with the answered node's progress on the way."""
    deck = Deck([echo()], [Workflow("doomed", graph(plan, ask, explode))])
    async with mcp_served(deck) as (session, _, app):
        progress: list[str | None] = []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            progress.append(message)
        parked = await session.call_tool("doomed", {"input": {"log": []}, "thread_id": "t1"})
        run_id = parked.structuredContent["run_id"]
        failed = await session.call_tool("answer", {"run_id": run_id, "value": "yes"},
                                         progress_callback=on_progress)
        assert failed.isError and failed.structuredContent == {
            "error": "ValueError",
            "message": f"run {run_id} failed (ValueError); its log has the details"}
        assert "sk-answered" not in failed.content[0].text and progress == ["node ask"]
        assert await app.deck.status(run_id) is RunStatus.FAILED
        again = await session.call_tool("answer", {"run_id": run_id, "value": "yes"})
        assert again.isError and again.structuredContent["error"] == "RunNotWaitingError"
    assert capsys.readouterr().err == ""


async def test_a_call_that_breaks_is_one_log_line_naming_the_tool_and_its_error_type(
        monkeypatch, caplog, capsys):
    """A bug, not a refusal: the result says "internal error" and the ``kit_mcp`` logger one
    line, the tool and the error type (the stack only at DEBUG); nothing of the exception's
    message or the call's arguments, and nothing printed."""
    caplog.set_level(logging.DEBUG, logger="kit_mcp")
    secret = "-".join(("sk", "live", "456"))  # not in the source: a stack quotes source lines
    async with mcp_served(catalog()) as (session, _, app):
        parked = await session.call_tool("approve", {"input": {"log": []}, "thread_id": "t1"})

        def broken(run_id, value, **options):
            raise ZeroDivisionError(f"the api key is {secret}")
        monkeypatch.setattr(app.deck, "stream_answer", broken)
        result = await session.call_tool("answer", {"run_id": parked.structuredContent["run_id"],
                                                    "value": f"zz-{secret}"})
        assert result.isError and result.structuredContent == {
            "error": "ZeroDivisionError", "message": "internal error; the server log has the details"}
    records = [r for r in caplog.records if r.name == "kit_mcp"]
    assert [(r.levelno, r.getMessage()) for r in records if r.levelno > logging.DEBUG] == [
        (logging.ERROR, "MCP tool answer failed with ZeroDivisionError")]
    [stack] = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
    assert "in broken" in stack and secret not in caplog.text and "zz-" not in caplog.text
    assert capsys.readouterr().err == ""


async def test_leaving_a_call_ends_its_stream_never_its_run(caplog):
    """A client that asked for progress leaves after the first notification: the next one
    failed, and that was logged as a broken tool ("MCP tool big failed with
    ClosedResourceError"), the line kept for bugs."""
    caplog.set_level(logging.INFO, logger="kit_mcp")
    big = Agent("big", model=ScriptedModel([" ".join(f"w{i}" for i in range(3000))]))
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "big", "arguments": {"message": "x"}, "_meta": {"progressToken": "p"}}}
    async with served(catalog(big), surfaces=("mcp",)) as (client, app):
        async with client.stream("POST", "/mcp", json=call, headers={
                "accept": "application/json, text/event-stream"}) as r:
            async for line in r.aiter_lines():
                if "notifications/progress" in line:
                    break  # the client goes away after the first notification
        with anyio.fail_after(10):
            while not (runs := await app.deck.store.runs(name="big")) or \
                    await app.deck.status(runs[0].run_id) is not RunStatus.COMPLETED:
                await anyio.sleep(0.02)
        await anyio.sleep(0.5)  # the call's end, after the run's
    assert [r.getMessage() for r in caplog.records if r.name == "kit_mcp"] == []


async def test_a_call_playing_when_the_server_stops_ends_with_a_result_naming_its_run():
    """Shutdown cut a playing call's stream after the grace with no result, and the MCP client
    waited for one forever; the call now ends at once with an error result naming the run."""
    gate, worker = gated("done")
    async with mcp_served(catalog(worker)) as (session, _, app):
        results = []

        async def call() -> None:
            results.append(await session.call_tool("worker", {"message": "go"}))
        with anyio.fail_after(3 * STOP_GRACE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await gate.until_entered()
                [run] = await app.deck.store.runs(name="worker")
                try:
                    await app.shutdown()  # returns once the call has answered
                finally:
                    gate.release.set()
        [stopped] = results
        assert stopped.isError and stopped.structuredContent == {
            "error": "ServerStoppingError",
            "message": f"the server is shutting down before run {run.run_id} ended; its log has "
                       f"the rest: GET /runs/{run.run_id}/events"}


def test_an_invocable_named_answer_refuses_the_mcp_surface():
    deck = Deck([Agent("answer", model=ScriptedModel(["hi"]))])
    with pytest.raises(ConfigError, match="clashes"):
        kit_mcp.MCPSurface(deck, max_body=1024)


async def test_shutdown_ends_an_idle_mcp_get_stream_at_once_and_cleanly():
    """GET /mcp is the transport's standalone stream, which carries nothing when stateless:
    shutdown ends it with the body's end, not by cutting it after STOP_GRACE."""
    async with served(catalog(), surfaces=("mcp",)) as (client, app):
        async with client.stream("GET", "/mcp", headers={"accept": "text/event-stream"}) as r:
            assert r.status_code == 200
            with anyio.fail_after(STOP_GRACE / 2):
                await app.shutdown()
                async for _ in r.aiter_raw():  # an incomplete chunked body would raise here
                    pass


async def test_the_mcp_route_speaks_streamable_http():
    async with served(catalog(), surfaces=("mcp",)) as (client, _):
        r = await client.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                              headers={"accept": "application/json, text/event-stream"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert '"name":"answer"' in r.text
        head = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
        nested = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":' + b"[" * 5000 + b"]" * 5000 + b"}"
        for bad, says in ((b"not json", "not valid JSON"), (b'{"method":"\xff"}', "not valid JSON"),
                          (nested, "nested deeper than"), (b'{"id":1e999}', "out of range")):
            r = await client.post("/mcp", content=bad, headers=head)  # the mcp package: 500s
            assert r.status_code == 400, (bad[:20], r.text)
            error = r.json()["error"]
            assert error["code"] == -32700 and says in error["message"]  # JSON-RPC parse error


async def test_a_message_json_rpc_refuses_is_answered_in_json_rpcs_terms():
    """The mcp package answered a method it does not know with -32602 "Invalid request
    parameters" (JSON-RPC 2.0 section 5.1: -32601), a request whose id is null or an object with
    202 and no answer ever (the client waits for good), a batch or a message that is no request
    with -32602 and the made-up id "server-error" (section 5: -32600, id null), and a known
    method's bad params with no word of what is wrong."""
    head = {"accept": "application/json, text/event-stream"}

    async def post(message) -> tuple[int, dict]:
        r = await client.post("/mcp", json=message, headers=head)
        if r.headers.get("content-type", "").startswith("text/event-stream"):  # one data: line
            return r.status_code, json.loads(r.text.partition("data: ")[2].partition("\n")[0])
        return r.status_code, (r.json() if r.status_code != 202 else {})

    async with served(catalog(), surfaces=("mcp",)) as (client, _):
        status, body = await post({"jsonrpc": "2.0", "id": 7, "method": "tools/frobnicate"})
        assert status == 200 and body["id"] == 7
        assert body["error"]["code"] == -32601 and "'tools/frobnicate'" in body["error"]["message"]
        status, body = await post({"jsonrpc": "2.0", "id": "c", "method": "tools/call",
                                   "params": {"arguments": {}}})
        assert status == 200 and body["id"] == "c" and body["error"]["code"] == -32602
        assert "tools/call" in body["error"]["message"] and "params.name" in body["error"]["message"]
        for bad, says in (
                ({"jsonrpc": "2.0", "id": None, "method": "tools/list"}, "'id'"),
                ({"jsonrpc": "2.0", "id": {"a": 1}, "method": "tools/list"}, "'id'"),
                ({"jsonrpc": "2.0", "id": 1.5, "method": "tools/list"}, "'id'"),
                ([{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}], "one message per request"),
                ({"jsonrpc": "1.0", "id": 1, "method": "tools/list"}, "'jsonrpc'"),
                ({"id": 1, "method": "tools/list"}, "'jsonrpc'"),
                ({"jsonrpc": "2.0", "id": 1, "method": 5}, "'method'"),
                ({}, "'jsonrpc'"), (5, "one message per request")):
            status, body = await post(bad)
            assert status == 400, (bad, body)
            assert body["id"] is None and body["error"]["code"] == -32600, (bad, body)
            assert says in body["error"]["message"], (bad, body)
        # a notification is never answered, whatever its method; requests go on as before
        assert (await post({"jsonrpc": "2.0", "method": "notifications/frobnicated"}))[0] == 202
        r = await client.post("/mcp", json={"jsonrpc": "2.0", "id": 3, "method": "tools/list"},
                              headers=head)
        assert r.status_code == 200 and '"name":"answer"' in r.text
