"""kit with the REAL agents.OpenAIResponsesModel / OpenAIChatCompletionsModel, offline.

A loopback stub of the OpenAI API (stdlib http.server in a daemon thread) pops one scripted turn
per POST and records every request; the SDK's own models talk to it through a real AsyncOpenAI
client, on asyncio and on trio (where kit plays the SDK on its asyncio engine thread).
Wire formats: notes/ENGINES.md section 2, notes/engines/openai_stub.py.
"""
from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import agents
import anyio
import openai
import pytest

import kit
from kit_bridge import on_asyncio
from kit_store import SQLiteStore

pytestmark = pytest.mark.anyio

MODELS = [pytest.param(agents.OpenAIResponsesModel, id="responses"),
          pytest.param(agents.OpenAIChatCompletionsModel, id="chat")]
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(16)).decode()
WAV = base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(16)).decode()


# ================================================================================ the stub ====

def text(*deltas: str, usage: tuple[int, ...] = (11, 7)) -> dict:
    """A text reply, streamed as these deltas; ``usage`` is (input, output[, cached input])."""
    return {"text": list(deltas), "usage": usage}


def call(name: str, args: dict, usage: tuple[int, int] = (5, 3)) -> dict:
    """One function call."""
    return {"tool": name, "args": args, "usage": usage}


FAIL = {"status": 500}


def _resp_item(turn: dict, n: int) -> dict:
    if "text" in turn:
        return {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "".join(turn["text"]), "annotations": []}]}
    return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "status": "completed",
            "name": turn["tool"], "arguments": json.dumps(turn["args"])}


def _response(turn: dict, n: int, items: list, status: str = "completed") -> dict:
    i, o, cached = (*turn["usage"], 0)[:3]
    usage = {"input_tokens": i, "output_tokens": o, "total_tokens": i + o,
             "input_tokens_details": {"cached_tokens": cached},
             "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": f"resp_{n}", "object": "response", "created_at": int(time.time()), "model": "stub",
            "status": status, "output": items, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "usage": usage if status == "completed" else None}


def failed(*deltas: str, error: str) -> dict:
    """A streamed Responses reply that ends in ``response.failed`` after these deltas."""
    return {"text": list(deltas), "usage": (5, 1), "failed": error}


def responses_body(turn: dict, n: int, stream: bool) -> list[dict] | dict:
    item = _resp_item(turn, n)
    if "failed" in turn:  # the in-progress response, its deltas, then the failed response
        ev = [{"type": "response.created", "response": _response(turn, n, [], "in_progress")}]
        ev += [{"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0,
                "content_index": 0, "delta": d, "logprobs": []} for d in turn["text"]]
        ev.append({"type": "response.failed", "response": {**_response(turn, n, [], "failed"),
                   "error": {"code": "server_error", "message": turn["failed"]}}})
        return [{**e, "sequence_number": k} for k, e in enumerate(ev)]
    if not stream:
        return _response(turn, n, [item])
    ev = [{"type": "response.created", "response": _response(turn, n, [], "in_progress")}]
    if "text" in turn:
        ev.append({"type": "response.output_item.added", "output_index": 0,
                   "item": {**item, "content": [], "status": "in_progress"}})
        ev += [{"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0,
                "content_index": 0, "delta": d, "logprobs": []} for d in turn["text"]]
    else:
        ev.append({"type": "response.output_item.added", "output_index": 0,
                   "item": {**item, "arguments": ""}})
        ev.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                   "output_index": 0, "delta": item["arguments"]})
    ev.append({"type": "response.output_item.done", "output_index": 0, "item": item})
    ev.append({"type": "response.completed", "response": _response(turn, n, [item])})
    return [{**e, "sequence_number": k} for k, e in enumerate(ev)]


def chat_body(turn: dict, n: int, stream: bool, include_usage: bool) -> list[dict] | dict:
    i, o, cached = (*turn["usage"], 0)[:3]
    usage = {"prompt_tokens": i, "completion_tokens": o, "total_tokens": i + o,
             "prompt_tokens_details": {"cached_tokens": cached}}
    base = {"id": f"chatcmpl-{n}", "created": int(time.time()), "model": "stub"}
    call_ = None if "text" in turn else {"id": f"call_{n}", "type": "function", "function": {
        "name": turn["tool"], "arguments": json.dumps(turn["args"])}}
    finish = "stop" if call_ is None else "tool_calls"
    if not stream:
        msg = ({"role": "assistant", "content": "".join(turn["text"])} if call_ is None else
               {"role": "assistant", "content": None, "tool_calls": [call_]})
        return {**base, "object": "chat.completion", "usage": usage,
                "choices": [{"index": 0, "message": msg, "finish_reason": finish}]}
    if call_ is None:
        deltas = [{"role": "assistant", "content": d} if k == 0 else {"content": d}
                  for k, d in enumerate(turn["text"])]
    else:
        deltas = [{"role": "assistant", "tool_calls": [
            {"index": 0, **call_, "function": {"name": turn["tool"], "arguments": ""}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": call_["function"]["arguments"]}}]}]
    chunk = {**base, "object": "chat.completion.chunk"}
    out = [{**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    out.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    if include_usage:  # sent only when the request asked for it, as the real API does
        out.append({**chunk, "choices": [], "usage": usage})
    return out


class Stub:
    """Serves POST /v1/responses and /v1/chat/completions, one scripted turn per request."""

    def __init__(self) -> None:
        self.script: list[dict] = []
        self.requests: list[tuple[str, dict]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((self.path, body))
                n, turn = len(stub.requests), stub.script.pop(0)
                stream = bool(body.get("stream"))
                if "status" in turn:
                    self._send(turn["status"], False,
                               {"error": {"message": "stub failure", "type": "server_error"}})
                elif self.path == "/v1/responses":
                    self._send(200, stream, responses_body(turn, n, stream))
                elif self.path == "/v1/chat/completions":
                    inc = bool((body.get("stream_options") or {}).get("include_usage"))
                    self._send(200, stream, chat_body(turn, n, stream, inc), done=True)
                else:
                    self._send(404, False, {"error": {"message": self.path}})

            def _send(self, status: int, stream: bool, payload: Any, done: bool = False) -> None:
                if stream:  # SSE: one `data:` line per event; the chat API ends with [DONE]
                    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in payload)
                    data = (sse + ("data: [DONE]\n\n" if done else "")).encode()
                else:
                    data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def bodies(self) -> list[dict]:
        return [body for _, body in self.requests]


@pytest.fixture
def stub():
    s = Stub()
    yield s
    s.server.shutdown()
    s.server.server_close()
    s.thread.join(5)


@contextlib.asynccontextmanager
async def open_deck(stub: Stub, model_cls: type, store: SQLiteStore, tools=()):
    client = openai.AsyncOpenAI(base_url=stub.base_url, api_key="test", max_retries=0)
    chat = model_cls is agents.OpenAIChatCompletionsModel
    agent = kit.Agent("bot", "Be brief.", tools=tools, model=model_cls("gpt-4o", client),
                      model_settings=agents.ModelSettings(include_usage=True) if chat else None)
    try:
        async with kit.Deck([agent], store=store) as deck:
            yield deck
    finally:
        await on_asyncio(client.close)  # where its connections live (trio: the run's asyncio loop)


def kinds(events) -> list[str]:
    return [e.kind for e in events]


# =================================================================================== tests ====

@pytest.mark.parametrize("model_cls", MODELS)
async def test_run_with_tool_call_then_text(stub, store, model_cls):
    seen = []

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        seen.append((a, b))
        return a + b

    stub.script += [call("add", {"a": 2, "b": 3}, usage=(5, 3)), text("The sum ", "is 5.", usage=(13, 6))]
    with anyio.fail_after(10):
        async with open_deck(stub, model_cls, store, tools=[add]) as deck:
            result = await deck.run("bot", "What is 2 + 3?")
    assert seen == [(2, 3)]
    assert result.output == "The sum is 5."
    assert (result.usage.input_tokens, result.usage.output_tokens) == (5 + 13, 3 + 6)
    log = await store.read(result.run_id)
    assert kinds(log) == ["run.started", "model.completed", "tool.started", "tool.completed",
                          "text.delta", "message.completed", "model.completed", "run.completed"]
    assert [e.seq for e in log] == list(range(len(log)))
    assert log[2].payload.tool == "add" and json.loads(log[2].payload.arguments) == {"a": 2, "b": 3}
    assert log[3].payload.output == 5 and log[4].payload.text == "The sum is 5."
    assert [(e.payload.input_tokens, e.payload.output_tokens) for e in log
            if e.kind == "model.completed"] == [(5, 3), (13, 6)]
    assert len(stub.requests) == 2 and not any(b.get("stream") for b in stub.bodies())
    second = stub.bodies()[1]
    if model_cls is agents.OpenAIResponsesModel:
        assert stub.requests[1][0] == "/v1/responses"
        outputs = [i for i in second["input"] if i.get("type") == "function_call_output"]
        assert outputs == [{"type": "function_call_output", "call_id": "call_1", "output": "5"}]
    else:
        assert stub.requests[1][0] == "/v1/chat/completions"
        tool_msgs = [m for m in second["messages"] if m["role"] == "tool"]
        assert tool_msgs == [{"role": "tool", "tool_call_id": "call_1", "content": "5"}]


@pytest.mark.parametrize("model_cls", MODELS)
async def test_stream_text_deltas_and_usage(stub, store, model_cls):
    deltas = ["Hel", "lo, ", "wor", "ld!"]
    stub.script.append(text(*deltas, usage=(17, 4)))
    with anyio.fail_after(10):
        async with open_deck(stub, model_cls, store) as deck:
            events = [e async for e in deck.stream("bot", "Say hello")]
    assert [e.payload.text for e in events if e.kind == "text.delta"] == deltas
    assert events[0].kind == "run.started" and events[-1].kind == "run.completed"
    done = events[-1].payload
    assert done.output == "Hello, world!"
    assert (done.usage.input_tokens, done.usage.output_tokens) == (17, 4)
    assert stub.bodies()[0]["stream"] is True
    assert kinds(await store.read(events[0].run_id)) == kinds(events)


@pytest.mark.parametrize("model_cls", MODELS)
async def test_an_empty_chunk_is_no_text_delta(stub, store, model_cls):
    """OpenAI's Chat Completions stream opens with a chunk of empty content (``{"role":
    "assistant", "content": ""}``), which the SDK passes on as a text delta: every streamed
    reply's log began with a ``text.delta`` of no text (and SSE with ``data: {"delta":""}``)."""
    stub.script.append(text("", "Hel", "", "lo", usage=(17, 4)))
    with anyio.fail_after(10):
        async with open_deck(stub, model_cls, store) as deck:
            events = [e async for e in deck.stream("bot", "Say hello")]
    assert [e.payload.text for e in events if e.kind == "text.delta"] == ["Hel", "lo"]
    [done] = [e for e in events if e.kind == "message.completed"]
    assert done.payload.text == "Hello"
    assert {e.message_id for e in events if e.kind in ("text.delta", "message.completed")} == {
        done.message_id}


def shout(word: str) -> str:
    """Shout a word."""
    return word.upper()


@pytest.mark.parametrize("model_cls", MODELS)
async def test_usd_is_priced_and_sums_model_calls(stub, store, model_cls):
    stub.script += [call("shout", {"word": "hi"}, usage=(1200, 40)), text("HI", usage=(1500, 300))]
    with anyio.fail_after(10):
        async with open_deck(stub, model_cls, store, tools=[shout]) as deck:
            events = [e async for e in deck.stream("bot", "Shout hi")]
    usage = events[-1].payload.usage
    costs = [e.payload.usd for e in events if e.kind == "model.completed"]
    assert len(costs) == 2 and all(isinstance(c, float) and c > 0 for c in costs)
    assert isinstance(usage.usd, float) and usage.usd > 0
    assert usage.usd == pytest.approx(sum(costs), rel=1e-9)
    assert (usage.input_tokens, usage.output_tokens) == (2700, 340)


@pytest.mark.parametrize("model_cls", MODELS)
async def test_input_read_from_the_prompt_cache_is_priced_at_its_own_rate(stub, store, model_cls):
    """OpenAI bills the input tokens it read from its prompt cache at a fraction of the rest (a
    tenth for gpt-5); a long conversation's turns are mostly cached. Every input token was
    priced at the uncached rate: 90% cached cost five times what the call did."""
    from genai_prices import Usage as PriceUsage, calc_price
    stub.script += [text("Hi.", usage=(100_000, 100, 90_000)), text("Hi.", usage=(20_000, 10, 5_000))]
    with anyio.fail_after(10):
        async with open_deck(stub, model_cls, store) as deck:
            # Twice: the first call of a model, and one priced from its cached flat rates.
            results = [await deck.run("bot", "hi"), await deck.run("bot", "hi")]
    for result, (i, o, cached) in zip(results, [(100_000, 100, 90_000), (20_000, 10, 5_000)]):
        [call_] = [e.payload for e in await store.read(result.run_id) if e.kind == "model.completed"]
        price = calc_price(PriceUsage(input_tokens=i, output_tokens=o, cache_read_tokens=cached),
                           model_ref="gpt-4o", provider_id="openai").total_price
        assert call_.input_tokens == i and call_.usd == pytest.approx(float(price), rel=1e-9)
        assert result.usage.usd == pytest.approx(float(price), rel=1e-9)


async def test_an_agent_tools_cached_input_is_priced_at_its_own_rate(stub, store):
    """An SDK agent played as a tool calls its own model, which kit prices from what the SDK
    counted beyond kit's own calls: its cached input tokens were priced at the uncached rate
    (90% cached: five times what the call cost); and its ``model.completed`` row says how much
    of its input was cached, as a call of the agent's own model does."""
    from genai_prices import Usage as PriceUsage, calc_price
    stub.script += [call("helper", {"input": "q"}, usage=(50, 5)),
                    text("inner says", usage=(100_000, 100, 90_000)), text("done.", usage=(60, 4))]
    client = openai.AsyncOpenAI(base_url=stub.base_url, api_key="test", max_retries=0)
    inner = agents.Agent(name="helper", instructions="Help.",
                         model=agents.OpenAIResponsesModel("gpt-4o", client))
    agent = kit.Agent("bot", "Ask.", tools=[inner.as_tool("helper", "Helps.")],
                      model=agents.OpenAIResponsesModel("gpt-4o", client))
    try:
        with anyio.fail_after(10):
            async with kit.Deck([agent], store=store) as deck:
                result = await deck.run("bot", "hi")
    finally:
        await on_asyncio(client.close)
    calls = [e for e in await store.read(result.run_id) if e.kind == "model.completed"]
    assert [(e.origin, e.payload.cached_input_tokens) for e in calls] == \
        [("bot", 0), ("bot/helper", 90_000), ("bot", 0)]
    helper = calls[1]
    price = calc_price(PriceUsage(input_tokens=100_000, output_tokens=100, cache_read_tokens=90_000),
                       model_ref="gpt-4o", provider_id="openai").total_price
    assert helper.origin == "bot/helper" and helper.payload.input_tokens == 100_000
    assert helper.payload.usd == pytest.approx(float(price), rel=1e-9)


async def test_a_server_that_reports_no_usage_costs_unknown_not_zero(stub, store):
    """Chat Completions streamed from a server other than OpenAI's URL: the SDK asks for usage
    only on OpenAI's own (stream_options.include_usage), so none comes back. The call was
    logged as 0 tokens costing $0.0, a paid call recorded as free."""
    stub.script.append(text("Hello.", usage=(1200, 300)))
    client = openai.AsyncOpenAI(base_url=stub.base_url, api_key="test", max_retries=0)
    agent = kit.Agent("bot", "Be brief.", model=agents.OpenAIChatCompletionsModel("gpt-4o", client))
    try:
        with anyio.fail_after(10):
            async with kit.Deck([agent], store=store) as deck:
                events = [e async for e in deck.stream("bot", "hi")]
    finally:
        await on_asyncio(client.close)
    [call_] = [e.payload for e in events if e.kind == "model.completed"]
    assert (call_.input_tokens, call_.output_tokens, call_.usd) == (0, 0, None)
    assert events[-1].payload.usage.usd is None


@pytest.mark.parametrize("model_cls", MODELS)
async def test_image_block_reaches_the_api(stub, store, model_cls):
    stub.script.append(text("A tiny image."))
    with anyio.fail_after(10):
        async with open_deck(stub, model_cls, store) as deck:
            result = await deck.run("bot", [kit.TextBlock("What is this?"),
                                            kit.ImageBlock("image/png", PNG)])
    assert result.output == "A tiny image."
    url = f"data:image/png;base64,{PNG}"
    body = stub.bodies()[0]
    if model_cls is agents.OpenAIResponsesModel:
        parts = body["input"][0]["content"]
        assert {"type": "input_text", "text": "What is this?"} in parts
        assert [p["image_url"] for p in parts if p["type"] == "input_image"] == [url]
    else:
        user = [m for m in body["messages"] if m["role"] == "user"]
        parts = user[0]["content"]
        assert [p["image_url"]["url"] for p in parts if p["type"] == "image_url"] == [url]


@pytest.mark.parametrize("model_cls", MODELS)
async def test_audio_block_chat_only(stub, store, model_cls):
    stub.script.append(text("Sounds like silence."))
    blocks = [kit.TextBlock("Transcribe"), kit.AudioBlock("audio/wav", WAV)]
    with anyio.fail_after(10):
        async with open_deck(stub, model_cls, store) as deck:
            if model_cls is agents.OpenAIResponsesModel:
                with pytest.raises(kit.ConfigError, match="AudioBlock"):
                    await deck.run("bot", blocks)
                assert await store.runs() == [] and stub.requests == []
                return
            result = await deck.run("bot", blocks)
    assert result.output == "Sounds like silence."
    user = [m for m in stub.bodies()[0]["messages"] if m["role"] == "user"]
    audio = [p for p in user[0]["content"] if p["type"] == "input_audio"]
    assert audio == [{"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}]


@pytest.mark.parametrize("model_cls", MODELS)
async def test_http_500_fails_the_run(stub, store, model_cls):
    stub.script.append(FAIL)
    with anyio.fail_after(10):
        async with open_deck(stub, model_cls, store) as deck:
            with pytest.raises(openai.InternalServerError):
                await deck.run("bot", "hi", run_id="run-500")
    log = await store.read("run-500")
    assert kinds(log) == ["run.started", "run.failed"]
    assert log[-1].payload.error == "InternalServerError"
    assert len(stub.requests) == 1  # max_retries=0: no retry


async def test_a_streamed_reply_that_fails_says_why_in_the_log(stub, store):
    """A Responses stream that ends in ``response.failed``: its run.failed said only "the model
    stream ended with response.failed", where the SDK's own stream (and the error it carries)
    says what the server gave as the reason."""
    stub.script.append(failed("Par", "tial", error="The model is overloaded"))
    with anyio.fail_after(10):
        async with open_deck(stub, agents.OpenAIResponsesModel, store) as deck:
            events = []
            with pytest.raises(agents.ModelBehaviorError, match="The model is overloaded"):
                async for event in deck.stream("bot", "hi", run_id="run-failed"):
                    events.append(event)
    log = await store.read("run-failed")
    assert kinds(log) == kinds(events) == ["run.started", "text.delta", "text.delta", "run.failed"]
    assert log[-1].payload.error == "ModelBehaviorError"
    assert "response.failed" in log[-1].payload.message
    assert "server_error" in log[-1].payload.message and "The model is overloaded" in log[-1].payload.message


async def test_headless_runs_reuse_the_models_client_one_after_another(stub):
    """``Agent.run`` (no deck) under trio played each call on an asyncio loop of its own, closed
    after it: the next call over the client's pooled (keep-alive) connection failed with
    ``APIConnectionError``, every other call."""
    stub.script += [text("one"), text("two"), text("three")]
    client = openai.AsyncOpenAI(base_url=stub.base_url, api_key="test", max_retries=0)
    agent = kit.Agent("bot", "Be brief.", model=agents.OpenAIResponsesModel("gpt-4o", client))
    try:
        with anyio.fail_after(10):
            outputs = [(await agent.run("hi")).final_output for _ in range(3)]
    finally:
        await on_asyncio(client.close)  # where its connections live (trio: that asyncio loop)
    assert outputs == ["one", "two", "three"] and len(stub.requests) == 3


async def test_an_image_in_a_system_message_of_the_history_is_refused_on_the_chat_path(stub, store):
    """The SDK's Chat Completions converter keeps only the text of a system or developer
    message: an image in one was dropped unsaid (the model never saw it, the log said it was
    given). It is refused before anything is written, as an assistant's image is."""
    history = [kit.HistoryMessage(role, [kit.TextBlock("Look:"), kit.ImageBlock("image/png", PNG)])
               for role in ("system", "developer")]
    with anyio.fail_after(10):
        async with open_deck(stub, agents.OpenAIChatCompletionsModel, store) as deck:
            for message in history:
                with pytest.raises(kit.ConfigError, match=f"a {message.role} message in the "
                                   "history carries a ImageBlock"):
                    await deck.run("bot", "hi", history=[message])
            stub.script.append(text("Seen."))  # in a user message it reaches the model
            result = await deck.run("bot", "hi", history=[
                kit.HistoryMessage("system", "Be brief."),
                kit.HistoryMessage("user", [kit.TextBlock("Look:"), kit.ImageBlock("image/png", PNG)])])
    assert result.output == "Seen." and [r.run_id for r in await store.runs()] == [result.run_id]
    [body] = stub.bodies()
    parts = [p for m in body["messages"] if m["role"] == "user" for p in m["content"]]
    assert [p["image_url"]["url"] for p in parts if p["type"] == "image_url"] == [
        f"data:image/png;base64,{PNG}"]


async def test_a_models_client_serves_one_deck_after_another(stub, tmp_path):
    """SPEC 4.1 rule 6 allows sequential decks: the same model (its client, its pooled
    connections) serves each in turn. Under trio each deck played the SDK on an asyncio loop of
    its own and closed the user's client with it, so the second deck's turn failed with
    ``APIConnectionError``."""
    stub.script += [text("one"), text("two")]
    client = openai.AsyncOpenAI(base_url=stub.base_url, api_key="test", max_retries=0)
    agent = kit.Agent("bot", "Be brief.", model=agents.OpenAIResponsesModel("gpt-4o", client))
    outputs = []
    try:
        with anyio.fail_after(20):
            for n in range(2):
                async with SQLiteStore(tmp_path / f"{n}.db") as store:
                    async with kit.Deck([agent], store=store) as deck:
                        outputs.append((await deck.run("bot", "hi")).output)
                assert not client.is_closed()  # the caller's, to close when the caller is done
    finally:
        await on_asyncio(client.close)
    assert outputs == ["one", "two"] and len(stub.requests) == 2


def model_rows(db) -> list[dict]:
    """The ``model.completed`` rows of an SQLite log, their payloads as the log holds them."""
    import sqlite3
    with contextlib.closing(sqlite3.connect(db)) as con:
        bodies = [b for (b,) in con.execute(
            "SELECT body FROM events WHERE kind = 'model.completed' ORDER BY run_id, seq")]
    return [json.loads(b)["payload"] for b in bodies]


@pytest.mark.parametrize("model_cls", MODELS)
async def test_a_model_calls_cached_input_is_recorded_in_its_row(stub, store, model_cls, tmp_path):
    """The input tokens OpenAI read from its prompt cache were priced at the cached rate and
    then forgotten: ``model.completed`` could not say how much of the input was cached. Its row
    now says so (``cached_input_tokens``, part of ``input_tokens``); a call with none cached
    writes the row it always did, no new key."""
    from genai_prices import Usage as PriceUsage, calc_price
    stub.script += [text("Hi.", usage=(100_000, 100, 90_000)), text("Hi.", usage=(1200, 40))]
    with anyio.fail_after(10):
        async with open_deck(stub, model_cls, store) as deck:
            results = [await deck.run("bot", "hi"), await deck.run("bot", "hi")]
    [cached] = [e.payload for e in await store.read(results[0].run_id) if e.kind == "model.completed"]
    [plain] = [e.payload for e in await store.read(results[1].run_id) if e.kind == "model.completed"]
    price = calc_price(PriceUsage(input_tokens=100_000, output_tokens=100, cache_read_tokens=90_000),
                       model_ref="gpt-4o", provider_id="openai").total_price
    assert (cached.input_tokens, cached.cached_input_tokens) == (100_000, 90_000)
    assert cached.usd == pytest.approx(float(price), rel=1e-9)
    assert plain.cached_input_tokens == 0
    # Usage (and so the wire's done frame) keeps its three fields.
    assert results[0].usage == kit.Usage(100_000, 100, cached.usd)
    rows = {row["input_tokens"]: row for row in model_rows(tmp_path / "kit.db")}
    assert rows[100_000]["cached_input_tokens"] == 90_000
    assert list(rows[1200]) == ["model", "input_tokens", "output_tokens", "usd"]
    assert json.dumps(rows[1200]) == json.dumps({"model": "gpt-4o", "input_tokens": 1200,
                                                 "output_tokens": 40, "usd": plain.usd})


def test_a_model_completed_row_without_cached_input_reads_as_none_cached():
    """A row written before ``cached_input_tokens`` (none in it) reads back as 0 cached, and
    writes back the same; one with it round-trips."""
    old = {"run_id": "r1", "seq": 2, "kind": "model.completed", "at": "2026-01-01T00:00:00+00:00",
           "origin": "bot", "message_id": None,
           "payload": {"model": "gpt-4o", "input_tokens": 10, "output_tokens": 2, "usd": 0.5}}
    event = kit.Event.from_json(old)
    assert event.payload.cached_input_tokens == 0 and event.to_json() == old
    new = {**old, "payload": {**old["payload"], "response_model": "gpt-4o-2024-08-06",
                              "cached_input_tokens": 8}}
    assert kit.Event.from_json(new).payload.cached_input_tokens == 8
    assert kit.Event.from_json(new).to_json() == new
