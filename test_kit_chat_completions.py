"""Tests of the Chat Completions surface (kit_openai through kit_http): the real ``openai`` client,
sync (in a worker thread) and async, streaming and not, against a real Hypercorn on loopback with
both workers; what each call leaves in the log; ``KIT_SURFACES`` in ``kit-serve``."""
from __future__ import annotations

import base64
import subprocess
import sys
import time

import anyio
import httpx
import openai
import pydantic
import pytest

import kit
import kit_http
import kit_openai
import kit_sse
from kit import Agent, Deck, ScriptedModel
from test_kit_control import Gate
from test_kit_http import HERE, catalog, gated, served
from test_kit_serve import kit_serve, stop

pytestmark = [
    pytest.mark.anyio,
    # openai 2.44's AsyncStream stops at [DONE] without closing its SSE generators; trio warns
    # when the GC finalizes them. Not kit's to fix.
    pytest.mark.filterwarnings("ignore:Exception ignored in. <async_generator object "
                               "(SSEDecoder|AsyncStream):pytest.PytestUnraisableExceptionWarning"),
]
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(16)).decode()


@pytest.fixture(autouse=True)
def memory_store(monkeypatch):
    monkeypatch.setenv("KIT_STORE", "memory")


def clients(client: httpx.AsyncClient) -> tuple[openai.OpenAI, openai.AsyncOpenAI]:
    """The real OpenAI clients, pointed at the served app with a dummy key and no retries."""
    base = f"{client.base_url}/v1"
    return (openai.OpenAI(base_url=base, api_key="sk-dummy", max_retries=0),
            openai.AsyncOpenAI(base_url=base, api_key="sk-dummy", max_retries=0))


async def kinds(deck: Deck, run_id: str) -> list[str]:
    return [e.kind for e in await deck.store.read(run_id)]


def hi(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


def lookup() -> str:
    """Look it up."""
    return "42"


class Mixed(ScriptedModel):
    """A model that says something and calls a tool in one response, as GPT-4o and Claude often
    do: a turn ``{"say": text, "tool": name}``. A fake of the model, which kit does not own."""

    def _items(self, turn):
        if isinstance(turn, dict) and "say" in turn:
            said, n = super()._items(turn["say"])
            calls, m = super()._items({"tool": turn["tool"]})
            return said + calls, n + m
        return super()._items(turn)


def mixed() -> Agent:
    return Agent("mixed", tools=[lookup], model=Mixed(
        [{"say": "Let me look that up.", "tool": "lookup"}, "The answer is 42."], cycle=True))


# -------------------------------------------------------------------------------- models ----

async def test_models_are_the_agents():
    async with served(catalog(), surfaces=("openai",)) as (client, _):
        sync, aio = clients(client)
        listed = await anyio.to_thread.run_sync(sync.models.list)
        assert [m.id for m in listed.data] == ["echo"]  # workflows are not models
        assert [m.id async for m in aio.models.list()] == ["echo"]
        # models.retrieve of a listed model was a 404 "no route"
        model = await aio.models.retrieve("echo")
        assert (model.id, model.object, model.owned_by) == ("echo", "model", "kit")
        for name in ("plain", "nope"):  # a workflow is no model
            with pytest.raises(openai.NotFoundError) as missing:
                await aio.models.retrieve(name)
            assert missing.value.code == "UnknownNameError" and "echo" in missing.value.message
        await aio.close()


async def test_a_models_created_is_when_the_server_opened_not_the_request():
    """``created`` of ``GET /v1/models`` was the request's time, so it changed with every call
    (a client that caches the list by it saw new models each second). It is when the server
    opened the deck: the same in the list and for each model, call after call."""
    before = int(time.time())
    async with served(catalog(), surfaces=("openai",)) as (client, _):
        opened = int(time.time())
        with anyio.fail_after(5):  # a second boundary after the open, so a request's time differs
            while int(time.time()) <= opened:
                await anyio.sleep(0.05)
        [listed] = (await client.get("/v1/models")).json()["data"]
        assert before <= listed["created"] <= opened
        assert (await client.get("/v1/models/echo")).json() == listed
        assert (await client.get("/v1/models")).json()["data"] == [listed]


# ------------------------------------------------------------------------------- answers ----

async def test_a_completion_is_the_turn_and_its_log_is_a_v1_turn():
    async with served(catalog(), surfaces=("openai",)) as (client, app):
        sync, aio = clients(client)
        raw = await anyio.to_thread.run_sync(lambda: sync.chat.completions.with_raw_response.create(
            model="echo", messages=hi()))
        done = raw.parse()
        run_id = raw.headers["x-kit-run-id"]
        assert done.id == f"chatcmpl-{run_id}" and done.model == "echo"
        assert done.choices[0].message.content == "hello there world"
        assert done.choices[0].finish_reason == "stop"
        [end] = [e.payload for e in await app.deck.store.read(run_id) if e.kind == "run.completed"]
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (
            end.usage.input_tokens, end.usage.output_tokens)
        again = await aio.chat.completions.create(model="echo", messages=hi())
        assert again.choices[0].message.content == "hello there world"
        v1 = await client.post("/agents/echo/chat", json={"message": "hi"})
        want = await kinds(app.deck, v1.headers["x-kit-run-id"])
        assert await kinds(app.deck, run_id) == want
        assert await kinds(app.deck, again.id.removeprefix("chatcmpl-")) == want
        # "stream": null is "not streamed", as OpenAI's API and kit's OpenAPI document read it
        r = await client.post("/v1/chat/completions", json={"model": "echo", "messages": hi(),
                                                             "stream": None})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == \
            "hello there world"
        await aio.close()


async def test_a_streamed_completion_is_chunks_then_usage_and_its_log_is_a_v1_stream():
    async with served(catalog(), surfaces=("openai",)) as (client, app):
        sync, aio = clients(client)

        def read() -> tuple[str, list]:
            with sync.chat.completions.with_streaming_response.create(
                    model="echo", messages=hi(), stream=True) as r:
                return r.headers["x-kit-run-id"], list(r.parse())
        run_id, chunks = await anyio.to_thread.run_sync(read)
        assert {c.id for c in chunks} == {f"chatcmpl-{run_id}"}
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "hello there world"
        last = chunks[-1]
        assert last.choices[0].finish_reason == "stop" and last.usage.completion_tokens == 3
        assert all(c.usage is None for c in chunks[:-1])
        streamed = [c async for c in await aio.chat.completions.create(
            model="echo", messages=hi(), stream=True)]
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == "hello there world"
        async with client.stream("POST", "/agents/echo/chat?stream=true", json={"message": "hi"}) as v1:
            await v1.aread()
        want = await kinds(app.deck, v1.headers["x-kit-run-id"])
        assert await kinds(app.deck, run_id) == want
        assert await kinds(app.deck, streamed[0].id.removeprefix("chatcmpl-")) == want
        body = (await client.post("/v1/chat/completions", json={
            "model": "echo", "messages": hi(), "stream": True})).text
        assert body.endswith("\ndata: [DONE]\n\n") and "event:" not in body
        await aio.close()


async def test_streamed_or_not_the_answer_is_every_message_of_the_run():
    async with served(catalog(mixed()), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        done = await aio.chat.completions.create(model="mixed", messages=hi())
        chunks = [c async for c in await aio.chat.completions.create(
            model="mixed", messages=hi(), stream=True)]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
        both = "Let me look that up.\n\nThe answer is 42."
        assert (done.choices[0].message.content, streamed) == (both, both)
        for run_id in (done.id, chunks[0].id):  # the tool was called between the two messages
            log = await kinds(app.deck, run_id.removeprefix("chatcmpl-"))
            assert log.count("message.completed") == 2 and "tool.completed" in log
        await aio.close()


async def test_a_stream_quiet_long_enough_to_ping_reads_on_in_the_sdk(monkeypatch):
    """A turn quiet for PING_INTERVAL (a slow tool, a slow first token) is pinged with
    ``: ping``; its chunks carried an SSE ``id:``, which the Python SDK keeps, so it read the
    ping's blank line as an event with empty data and raised JSONDecodeError mid-answer."""
    monkeypatch.setattr(kit_sse, "PING_INTERVAL", 0.05)
    gate, worker = gated("done")
    async with served(catalog(worker), surfaces=("openai",)) as (client, _):
        _, aio = clients(client)
        with anyio.fail_after(10):
            stream = await aio.chat.completions.create(model="worker", messages=hi(), stream=True)
            chunks = [await anext(aiter(stream))]
            await gate.until_entered()
            await anyio.sleep(0.2)  # pinged while the tool waits
            gate.release.set()
            chunks += [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "done"
        assert chunks[-1].choices[0].finish_reason == "stop"
        body = (await client.post("/v1/chat/completions", json={
            "model": "echo", "messages": hi(), "stream": True})).text
        assert "\nid:" not in body and not body.startswith("id:")  # OpenAI's chunks carry none
        await aio.close()


def test_a_run_that_writes_no_text_answers_its_output_in_both_modes():
    chunks, events = kit_openai.Chunks("a"), [
        kit.Event("r1", 0, kit.RunStarted("a", "agent")),
        kit.Event("r1", 1, kit.RunCompleted({"answer": 42}, kit.Usage(3, 0)))]
    streamed = [c for e in events for c in chunks(e) if isinstance(c, dict)]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed) == '{"answer":42}'
    body = kit_openai.completion("r1", "a", events)
    assert body["choices"][0]["message"]["content"] == '{"answer":42}'
    assert body["usage"] == streamed[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


async def test_earlier_messages_are_a_one_off_turns_history_in_run_started():
    model = ScriptedModel(["You are Ana."])
    async with served(Deck([Agent("a", model=model)]), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        messages = [{"role": "system", "content": "Answer in one line."},
                    {"role": "user", "content": [{"type": "text", "text": "I am Ana"}, {
                        "type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]},
                    {"role": "assistant", "content": "Nice to meet you, Ana."},
                    {"role": "user", "content": "Who am I?"}]
        done = await aio.chat.completions.create(model="a", messages=messages)
        started = (await app.deck.store.read(done.id.removeprefix("chatcmpl-")))[0].payload
        assert started.session_id is None and started.input == (kit.TextBlock("Who am I?"),)
        assert started.history == (
            kit.HistoryMessage("system", "Answer in one line."),
            kit.HistoryMessage("user", [kit.TextBlock("I am Ana"), kit.ImageBlock("image/png", PNG)]),
            kit.HistoryMessage("assistant", "Nice to meet you, Ana."))
        assert [i["role"] for i in model.calls[-1]["input"]] == ["system", "user", "assistant", "user"]
        await aio.close()


async def test_a_named_session_is_the_conversation():
    model = ScriptedModel(["one", "two", "three", "four"])
    async with served(Deck([Agent("a", model=model)]), surfaces=("openai",)) as (client, app):
        sync, aio = clients(client)
        await aio.chat.completions.create(model="a", messages=hi("I am Ana"),
                                          extra_headers={"x-kit-session-id": "conv-1"})
        done = await aio.chat.completions.create(
            model="a", extra_headers={"x-kit-session-id": "conv-1"},
            messages=[{"role": "user", "content": "ignored: the session has it"},
                      {"role": "user", "content": "Who am I?"}])
        started = (await app.deck.store.read(done.id.removeprefix("chatcmpl-")))[0].payload
        assert started.session_id == "conv-1" and started.history == ()
        assert "I am Ana" in str(model.calls[-1]["input"]) and "ignored" not in str(model.calls[-1]["input"])
        by_metadata = await anyio.to_thread.run_sync(lambda: sync.chat.completions.create(
            model="a", messages=hi(), metadata={"session_id": "conv-2"}))
        info = await app.deck.store.run_info(by_metadata.id.removeprefix("chatcmpl-"))
        assert info.session_id == "conv-2"
        await aio.close()


async def test_an_end_user_is_not_a_conversation():
    """``user`` names an end user, whose every chat carries it (LibreChat sends it): read as
    the session, a user's new chat went on with their other one, and two at once were a 409."""
    model = ScriptedModel(["Nice to meet you, Ana.", "I do not know you yet."])
    async with served(Deck([Agent("a", model=model)]), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        await aio.chat.completions.create(model="a", messages=hi("I am Ana"), user="ana@example")
        done = await aio.chat.completions.create(model="a", messages=hi("Who am I?"),
                                                 user="ana@example")  # a new chat
        assert done.choices[0].message.content == "I do not know you yet."
        assert "I am Ana" not in str(model.calls[-1]["input"])
        started = (await app.deck.store.read(done.id.removeprefix("chatcmpl-")))[0].payload
        assert started.session_id is None
        await aio.close()


async def test_a_history_limit_holds_on_the_http_surfaces():
    model = ScriptedModel(["r1", "r2", "r3", "r4"])
    async with served(Deck([Agent("a", model=model)], history_limit=2),
                      surfaces=("openai",)) as (client, app):
        sync, aio = clients(client)
        for n in (1, 2):
            reply = await client.post("/agents/a/chat", json={"session_id": "conv", "message": f"t{n}"})
            assert reply.json() == {"output": f"r{n}"}
        await aio.chat.completions.create(model="a", messages=hi("t3"),
                                          extra_headers={"x-kit-session-id": "conv"})
        sent = model.calls[-1]["input"]  # the last 2 items of the session, then the input
        assert [i["role"] for i in sent] == ["user", "assistant", "user"]
        assert (sent[0]["content"], sent[1]["content"][0]["text"], sent[2]["content"]) == (
            "t2", "r2", "t3")
        await aio.close()
        assert len(await app.deck.session_for("conv").get_items()) == 6


# -------------------------------------------------------------------------------- errors ----

async def test_a_busy_session_is_409_and_an_unknown_model_404_in_openais_shape():
    gate = Gate()
    worker = Agent("worker", tools=[gate.wait_tool()],
                   model=ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "done"]))
    async with served(catalog(worker), surfaces=("openai",)) as (client, _):
        _, aio = clients(client)
        session = {"x-kit-session-id": "s"}
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: aio.chat.completions.create(model="worker", messages=hi(),
                                                              extra_headers=session))
            await gate.until_entered()
            for stream in (False, True):
                with pytest.raises(openai.ConflictError) as busy:
                    await aio.chat.completions.create(model="worker", messages=hi(), stream=stream,
                                                      extra_headers=session)
                assert busy.value.code == "SessionBusyError" and busy.value.type == "invalid_request_error"
                assert "x-kit-run-id" not in busy.value.response.headers  # a refused start wrote nothing
                assert "x-should-retry" not in busy.value.response.headers  # so a retry may pass
            gate.release.set()
        with pytest.raises(openai.NotFoundError) as missing:
            await aio.chat.completions.create(model="plain", messages=hi())  # a workflow
        assert missing.value.code == "UnknownNameError" and "echo" in missing.value.message
        r = await client.get("/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == "MethodNotAllowedError"
        await aio.close()


@pytest.mark.parametrize("messages, why", [
    ([{"role": "tool", "tool_call_id": "c", "content": "42"}, *hi()], "'tool' message"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
     "data: URL"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "last message"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,!!"}}]}], "base64"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "a text part needs a string"),
    ([{"role": "user", "content": [{"type": "text"}]}], "a text part needs a string 'text'"),
    ([{"role": "user", "content": ["hi"]}], "a content part must be an object with a 'type', got str"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": f"data:image/png;base64,{PNG}", "detail": "low"}}]}], "'image_url.detail'"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {
        "type": "ephemeral"}}]}], "a text part's 'cache_control'"),
], ids=["tool-role", "image-by-url", "assistant-last", "bad-base64", "text-not-str", "text-missing",
        "part-not-object", "image-detail", "part-field"])
async def test_what_kit_cannot_carry_is_a_400_and_writes_nothing(messages, why):
    async with served(catalog(), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        with pytest.raises(openai.BadRequestError) as bad:
            await aio.chat.completions.create(model="echo", messages=messages)
        assert why in bad.value.message
        assert await app.deck.store.runs() == []
        await aio.close()


async def test_more_than_one_choice_is_a_400_and_writes_nothing():
    """An agent answers once a turn: ``n`` above 1 was passed over, and the client that read
    ``choices[1]`` failed on an answer with one."""
    async with served(catalog(), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
                await aio.chat.completions.create(model="echo", messages=hi(), n=2, stream=stream)
        assert await app.deck.store.runs() == []
        done = await aio.chat.completions.create(model="echo", messages=hi(), n=1)
        assert len(done.choices) == 1
        await aio.close()


class City(pydantic.BaseModel):
    name: str


async def test_a_field_asking_for_an_answer_kit_cannot_give_is_a_400_and_writes_nothing():
    """A demanded tool call, a JSON response format and log probabilities were ignored: the
    client read a text answer where it asked for a tool call, JSON of its schema (``parse``
    failed on the text as invalid JSON) or log probabilities (None). The client's own tools
    alone ask for nothing: they are ignored, as coding assistants send theirs every time."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    asks = {"tool_choice": "required", "function_call": {"name": "f"},
            "response_format": {"type": "json_object"},
            "logprobs": True, "top_logprobs": 2, "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "wav"}}
    async with served(catalog(), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        for field, value in asks.items():
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as bad:
                    await aio.chat.completions.create(model="echo", messages=hi(), stream=stream,
                                                      extra_body={field: value})
                assert bad.value.body["message"].startswith(f"kit cannot honour {field!r}: ")
        with pytest.raises(openai.BadRequestError, match="'response_format'"):
            await aio.chat.completions.parse(model="echo", messages=hi(), response_format=City)
        assert await app.deck.store.runs() == []
        # What asks nothing kit does not give passes.
        done = await aio.chat.completions.create(
            model="echo", messages=hi(), tool_choice="auto", response_format={"type": "text"},
            logprobs=False, modalities=["text"], parallel_tool_calls=False, temperature=0.2,
            extra_body={"tools": tools, "functions": [{"name": "f"}], "top_logprobs": 0})
        assert done.choices[0].message.content == "hello there world"
        await aio.close()


CALLS = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
ASKED, THANKS = {"role": "user", "content": "what is it?"}, {"role": "user", "content": "thanks"}


@pytest.mark.parametrize("session", [None, "conv"], ids=["one-off", "session"])
@pytest.mark.parametrize("messages, at, why", [
    ([ASKED, {"role": "assistant", "content": "let me check", "tool_calls": CALLS}, THANKS],
     1, "'tool_calls'"),
    ([ASKED, {"role": "assistant", "content": None, "tool_calls": CALLS},
      {"role": "tool", "tool_call_id": "c1", "content": "42"}, THANKS], 1, "'tool_calls'"),
    ([ASKED, {"role": "assistant", "content": "42"},
      {"role": "tool", "tool_call_id": "c1", "content": "42"}, THANKS], 2, "'tool' message"),
    ([ASKED, {"role": "function", "name": "lookup", "content": "42"}, THANKS], 1,
     "'function' message"),
    ([ASKED, {"role": "assistant", "content": "x", "function_call": {
        "name": "lookup", "arguments": "{}"}}, THANKS], 1, "'function_call'"),
    ([ASKED, {"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}, THANKS], 1,
     "'audio'"),
    ([ASKED, {"role": "assistant", "content": "x", "refusal": "I can't"}, THANKS], 1, "'refusal'"),
    ([{**ASKED, "name": "ana"}, {"role": "assistant", "content": "42"}, THANKS], 0, "'name'"),
    ([{**ASKED, "name": "ana"}], 0, "'name'"),  # the input itself
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
      {"role": "assistant", "content": "a cat"}, THANKS], "0].content[0", "data: URL"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,!!"}}]}, {"role": "assistant", "content": "a cat"}, THANKS],
     "0].content[0", "base64"),
], ids=["tool-calls", "tool-calls-no-content", "tool-role", "function-role", "function-call",
        "audio", "refusal", "name", "name-on-input", "image-by-url", "bad-base64"])
async def test_no_message_kit_cannot_carry_passes_with_a_session_or_without(messages, at, why, session):
    async with served(catalog(), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        with pytest.raises(openai.BadRequestError) as bad:
            await aio.chat.completions.create(model="echo", messages=messages,
                                              **({} if session is None else {"metadata": {"session_id": session}}))
        message = bad.value.body["message"]  # the SDK's own .message prefixes the status
        assert message.startswith(f"messages[{at}]: ") and why in message
        assert await app.deck.store.runs() == []
        await aio.close()


@pytest.mark.parametrize("part, why", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}, "no data"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "no data"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}, "base64"),
    ({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, "data: URL"),
    ({"type": "text", "text": 5}, "a text part needs a string"),
], ids=["empty-image", "empty-audio", "bad-base64", "image-by-url", "text-not-str"])
async def test_a_part_kit_cannot_carry_is_a_400_naming_its_message_and_part(part, why):
    """An image whose data: URL held no data passed (the model was sent an empty image); a
    part's error named its message only, not which of its parts."""
    messages = [ASKED, {"role": "assistant", "content": "42"},
                {"role": "user", "content": [{"type": "text", "text": "and this?"}, part]}]
    async with served(catalog(), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        with pytest.raises(openai.BadRequestError) as bad:
            await aio.chat.completions.create(model="echo", messages=messages)
        message = bad.value.body["message"]
        assert message.startswith("messages[2].content[1]: ") and why in message
        assert await app.deck.store.runs() == []
        await aio.close()


@pytest.mark.parametrize("session", [None, "conv"], ids=["one-off", "session"])
async def test_a_conversation_resent_as_the_sdk_returned_it_goes_on(session):
    model = ScriptedModel(["Nice to meet you, Ana.", "You are Ana."])
    async with served(Deck([Agent("a", model=model)]), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        named = {} if session is None else {"metadata": {"session_id": session}}
        messages = [{"role": "system", "content": "Be brief."}, hi("I am Ana")[0]]
        first = await aio.chat.completions.create(model="a", messages=messages, **named)
        # The message as the SDK returned it, every field it has: those kit never sets are null.
        echoed = first.choices[0].message.model_dump()
        assert echoed["tool_calls"] is None and echoed["refusal"] is None
        messages += [echoed, hi("Who am I?")[0]]
        done = await aio.chat.completions.create(model="a", messages=messages, **named)
        assert done.choices[0].message.content == "You are Ana."
        started = (await app.deck.store.read(done.id.removeprefix("chatcmpl-")))[0].payload
        assert started.session_id == session
        if session is None:  # the earlier messages are the turn's history
            assert started.history == (kit.HistoryMessage("system", "Be brief."),
                                       kit.HistoryMessage("user", "I am Ana"),
                                       kit.HistoryMessage("assistant", "Nice to meet you, Ana."))
        else:  # checked, not replayed: the session holds them (the system message is not its)
            assert started.history == ()
        sent = [i.get("role") for i in model.calls[-1]["input"]]
        assert sent == (["system", "user", "assistant", "user"] if session is None else
                        ["user", "assistant", "user"])
        await aio.close()


async def test_a_session_header_is_utf8_as_the_same_id_in_metadata():
    """``x-kit-session-id: café`` (sent as UTF-8) was read as latin-1, 'cafÃ©': a session other
    than ``metadata.session_id`` "café", so the conversation forked. A header that is not UTF-8
    is a 400 naming it, and writes nothing."""
    model = ScriptedModel(["Hi Ana.", "You are Ana."])
    async with served(Deck([Agent("a", model=model)]), surfaces=("openai",)) as (client, app):
        url = "/v1/chat/completions"
        first = await client.post(url, json={"model": "a", "messages": hi("I am Ana")},
                                  headers={"x-kit-session-id": "café".encode()})
        assert first.status_code == 200, first.text
        second = await client.post(url, json={"model": "a", "messages": hi("Who am I?"),
                                              "metadata": {"session_id": "café"}})
        assert second.status_code == 200, second.text
        assert [r.session_id for r in await app.deck.store.runs()] == ["café", "café"]
        assert "I am Ana" in str(model.calls[-1]["input"])  # one conversation
        bad = await client.post(url, json={"model": "a", "messages": hi()},
                                headers={"x-kit-session-id": b"caf\xe9"})
        assert bad.status_code == 400 and "x-kit-session-id" in bad.json()["error"]["message"]
        assert "UTF-8" in bad.json()["error"]["message"]
        assert len(await app.deck.store.runs()) == 2


async def test_a_session_id_no_store_can_hold_is_a_400_and_writes_nothing():
    async with served(catalog(), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        for session, why in (("ana\x00", "must not hold a control character or a lone surrogate"),
                             ("a" * 257, "must be at most 256 characters")):
            with pytest.raises(openai.BadRequestError) as bad:
                await aio.chat.completions.create(model="echo", messages=hi(),
                                                  metadata={"session_id": session})
            assert f"a session id (x-kit-session-id or metadata.session_id) {why}" in bad.value.message
        # An empty one is refused wherever it comes from: it used to pass, from the header or
        # the metadata, for a one-off turn that forgot the conversation without a word.
        for named in ({"metadata": {"session_id": ""}}, {"extra_headers": {"x-kit-session-id": ""}},
                      {"extra_headers": {"x-kit-session-id": ""}, "metadata": {"session_id": "ana"}}):
            with pytest.raises(openai.BadRequestError, match="must be a non-empty str"):
                await aio.chat.completions.create(model="echo", messages=hi(), **named)
        assert await app.deck.store.runs() == []
        await aio.close()


async def test_a_failed_run_is_a_500_or_an_error_chunk():
    boom = Agent("boom", model=ScriptedModel([RuntimeError("sk-secret"), RuntimeError("sk-secret")]))
    async with served(catalog(boom), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        with pytest.raises(openai.InternalServerError) as failed:
            await aio.chat.completions.create(model="boom", messages=hi())
        assert failed.value.code == "RuntimeError" and "sk-secret" not in failed.value.message
        assert failed.value.response.headers["x-kit-run-id"]
        with pytest.raises(openai.APIError, match="failed"):
            async for _ in await aio.chat.completions.create(model="boom", messages=hi(), stream=True):
                pass
        assert {r.status.value for r in await app.deck.store.runs()} == {"FAILED"}
        await aio.close()


async def test_a_client_that_retries_does_not_play_a_failed_turn_again():
    """OpenAI clients retry a 5xx or a 409 (twice by default): a failed run's 500 was retried,
    and each retry played the turn again (three failed runs, tools called three times)."""
    boom = Agent("boom", model=ScriptedModel([RuntimeError("x")] * 3))
    async with served(catalog(boom), surfaces=("openai",)) as (client, app):
        aio = openai.AsyncOpenAI(base_url=f"{client.base_url}/v1", api_key="sk-dummy", max_retries=1)
        with pytest.raises(openai.InternalServerError) as failed:
            await aio.chat.completions.create(model="boom", messages=hi())
        assert failed.value.response.headers["x-should-retry"] == "false"
        assert [r.status.value for r in await app.deck.store.runs()] == ["FAILED"]
        await aio.close()


async def test_a_server_stopping_mid_stream_ends_it_with_an_error_the_sdk_raises():
    gate, worker = gated("done")
    async with served(catalog(worker), surfaces=("openai",)) as (client, app):
        _, aio = clients(client)
        roles = []
        try:
            with anyio.fail_after(10):
                stream = await aio.chat.completions.create(model="worker", messages=hi(), stream=True)
                with pytest.raises(openai.APIError) as stopped:
                    async for chunk in stream:
                        roles.append(chunk.choices[0].delta.role)  # what client code reads
                        await gate.until_entered()
                        await app.shutdown()
        finally:
            gate.release.set()
        assert roles == ["assistant"]  # one chunk, then the error: never a chunk without choices
        run_id = chunk.id.removeprefix("chatcmpl-")
        assert (stopped.value.code, stopped.value.type) == ("ServerStoppingError", "server_error")
        assert f"GET /runs/{run_id}/events" in stopped.value.message
        with anyio.fail_after(10):  # the stream ended, never the run
            log = [e.kind async for e in app.deck.store.follow(run_id)]
        assert log[-1] == "run.completed" and "tool.completed" in log
        await aio.close()


async def test_an_unknown_v1_path_answers_in_openais_shape():
    async with served(catalog(), surfaces=("openai",)) as (client, _):
        _, aio = clients(client)
        with pytest.raises(openai.NotFoundError) as missing:
            await aio.embeddings.create(model="echo", input="hi")
        assert missing.value.code == "RouteNotFoundError" and "/v1/embeddings" in missing.value.message
        r = await client.delete("/v1/models")
        assert (r.status_code, r.json()["error"]["code"]) == (405, "MethodNotAllowedError")
        r = await client.get("/v2/models")  # outside /v1/ kit's own shape stays
        assert r.json() == {"error": "RouteNotFoundError", "message": "no route '/v2/models'"}
        # The guard's refusals under /v1/ too (they came in kit's shape, which OpenAI clients
        # cannot read)
        r = await client.get("/v1/models", headers={"origin": "https://elsewhere.example"})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "OriginNotAllowedError")
        r = await client.get("/v1/models", headers={"host": "rebound.example"})
        assert (r.status_code, r.json()["error"]["code"]) == (421, "HostNotAllowedError")
        r = await client.get("/models", headers={"origin": "https://elsewhere.example"})
        assert r.json()["error"] == "OriginNotAllowedError"
        await aio.close()


# ------------------------------------------------------------------------------ settings ----

async def test_the_surfaces_are_off_unless_asked():
    async with served(catalog()) as (client, _):
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/mcp")):
            r = await client.request(method, path, json={})
            assert (r.status_code, r.json()["error"]) == (404, "RouteNotFoundError")
    with pytest.raises(kit.ConfigError, match="unknown surface"):
        kit_http.App(Deck(), surfaces=["grpc"])
    with pytest.raises(kit.ConfigError, match="surfaces takes a list of names, got the string "
                       "'openai': wrap it in a list"):  # not "unknown surface a, e, i, n, o, p"
        kit_http.App(Deck(), surfaces="openai")


def test_mcp_is_imported_only_when_served():
    code = ("import sys, kit, kit_http; kit_http.App(kit.Deck(), surfaces=['openai']); "
            "print('mcp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("how", ["env", "flag"])
def test_kit_serve_serves_the_surfaces_it_is_asked_for(how):
    env = {"KIT_SURFACES": "openai,mcp" if how == "env" else ""}
    args = [] if how == "env" else ["--surfaces", "openai, mcp"]
    proc, base = kit_serve(HERE / ".kit", *args, **env)
    try:
        sync = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-dummy", max_retries=0)
        assert [m.id for m in sync.models.list()] == ["chat"]
        reply = sync.chat.completions.create(model="chat", messages=hi("what time is it?"))
        assert "clock tool" in reply.choices[0].message.content
        r = httpx.post(f"{base}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                       headers={"accept": "application/json, text/event-stream"})
        assert r.status_code == 200 and '"name":"approval"' in r.text.replace(" ", "")
    finally:
        stderr = stop(proc)
    assert "with openai and mcp" in stderr
    bad = subprocess.run([sys.executable, "-m", "kit_http", "--surfaces", "grpc"], cwd=HERE,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "the surfaces are openai, mcp" in bad.stderr
