"""Tests of kit's public surface, the Deck lifecycle and agent turns on the log (asyncio and trio)."""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import enum
import functools
import importlib
import inspect
import json
import uuid
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Literal

import agents
import anyio
import pydantic
import pytest
from langgraph.graph import StateGraph

import kit
import kit_writer
from kit import (
    Agent, AudioBlock, ConfigError, ContentError, Context, DataBlock, Deck, DeckStateError, Event,
    ImageBlock, ResourceBlock, RunStatus, ScriptedModel, SessionBusyError, TextBlock,
)
import kit_pgpool
from kit_bridge import on_asyncio
from kit_pg import store_from_url
from kit_store import MemoryStore, SQLiteStore

pytestmark = pytest.mark.anyio
HERE = Path(__file__).parent
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()


def kinds(events):
    return [e.kind for e in events]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


# ------------------------------------------------------------------------------- surface ----

def test_all_is_a_tuple_naming_exactly_what_kit_defines():
    assert isinstance(kit.__all__, tuple)
    assert len(set(kit.__all__)) == len(kit.__all__)
    # kit defines Deck and re-exports the values (kit_core, with the errors, content blocks and
    # ports it re-exports) and the catalog (kit_catalog); ScriptedModel (kit_scripted) loads on
    # first use, so `import kit` need not import the SDK.
    home = ("kit", "kit_errors", "kit_content", "kit_ports", "kit_core", "kit_catalog",
            "kit_scripted")
    kit.ScriptedModel  # noqa: B018
    defined = {n for n, v in vars(kit).items() if not n.startswith("_")
               and (getattr(v, "__module__", None) in home or n.isupper() or n == "ContentBlock")
               and not inspect.ismodule(v)}
    assert defined == set(kit.__all__)
    for name in kit.__all__:
        assert hasattr(kit, name)


def test_core_import_paths():
    from kit.core import DataBlock as D, TextBlock as T
    from kit.core.ports import EventSinkPort, EventStorePort
    assert T is TextBlock and D is DataBlock
    assert EventSinkPort is kit.EventSinkPort and EventStorePort is kit.EventStorePort
    importlib.import_module("kit.core")  # `import kit.core`, then named through kit, as a
    assert kit.core.TextBlock is TextBlock  # package's module is (it was an AttributeError)
    importlib.import_module("kit.core.ports")
    assert kit.core.ports.EventStorePort is EventStorePort


def test_error_hierarchy_and_facts():
    assert issubclass(kit.ContextTypeError, ConfigError) and issubclass(ConfigError, kit.KitError)
    e = SessionBusyError("s1", "run9", "tenant")
    assert (e.session_id, e.run_id, e.namespace) == ("s1", "run9", "tenant")
    assert "s1" in str(e) and "run9" in str(e) and "tenant" in str(e)
    assert "CLOSED" in str(DeckStateError("CLOSED", "run")) and "new Deck" in str(DeckStateError("CLOSED", "run"))


@pytest.mark.parametrize("error", [
    kit.ContextTypeError("tool t", int, str), DeckStateError("CLOSED", "run"),
    kit.UnknownNameError("x", ["a"], what="agent", hint="a workflow"), kit.UnknownRunError("r1"),
    kit.RunNotWaitingError("r1", RunStatus.COMPLETED, "WAITING_HUMAN"),
    kit.RunStoppedError("r1", RunStatus.PAUSED, "lunch"), SessionBusyError("s1", "r1", "t"),
    kit.LogConflictError("r1", 3, RunStatus.FAILED), kit.MCPServerError("fs", "exited", "restarted"),
    kit.StoreUnavailableError("r1", 2.0, OSError("disk"), outcome="ended"),
    kit.CheckpointMissingError("r1", "flow", False),
], ids=lambda e: type(e).__name__)
def test_an_error_survives_pickle_and_copy_with_its_message_and_facts(error):
    """kit's errors build their message from their facts, so BaseException's pickling (the
    class called with ``args``, the message alone) raised TypeError: an error raised in a worker
    process (multiprocessing, ``anyio.to_process``) could not come back, nor be copied."""
    import copy
    import pickle
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(again) is type(error) and str(again) == str(error)
        assert again.args == error.args
        assert {k: str(v) for k, v in vars(again).items()} == {k: str(v) for k, v in vars(error).items()}


# ------------------------------------------------------------------------------- content ----

@pytest.mark.parametrize("bad", ["aGk= ", "!!!!", "aGk", "aGk===", "aG k="])
def test_base64_is_validated_strictly(bad):
    with pytest.raises(ContentError, match="base64"):
        ImageBlock("image/png", bad)


def test_inline_blocks_are_capped_at_construction():
    big = base64.b64encode(b"\0" * (kit.MAX_INLINE_BYTES + 1)).decode()
    with pytest.raises(ContentError, match="ResourceBlock"):
        AudioBlock("audio/wav", big)
    AudioBlock("audio/wav", base64.b64encode(b"\0" * kit.MAX_INLINE_BYTES).decode())
    with pytest.raises(ContentError, match="bytes of JSON"):
        DataBlock({"x": "a" * kit.MAX_INLINE_BYTES})


@pytest.mark.parametrize("make, match", [
    (lambda: ImageBlock("audio/wav", PNG), "image/"),
    (lambda: AudioBlock("image/png", PNG), "audio/"),
    (lambda: ImageBlock("png", PNG), "type/subtype"),
    (lambda: ImageBlock("image/png\n", PNG), "type/subtype"),  # ($ matched before a newline)
    (lambda: ResourceBlock("", "text/plain"), "uri"),
    (lambda: DataBlock({1: object()}), "JSON"),
    (lambda: DataBlock(float("nan")), "JSON"),
    (lambda: TextBlock(b"bytes"), "str"),
])
def test_malformed_blocks_name_what_is_wrong(make, match):
    with pytest.raises(ContentError, match=match):
        make()


@pytest.mark.parametrize("make", [
    lambda: Agent("calc\n"), lambda: kit.Workflow("flow\n", StateGraph(dict)),
    lambda: kit.MCP({"time\n": {"command": "x"}}),
    lambda: kit_pgpool.pg_url("postgresql://h/x?schema=kit%0A"),
])
def test_a_name_with_a_trailing_newline_is_refused(make):
    """The name patterns ended in ``$``, which also matches before a final newline: such names
    were accepted and recorded."""
    with pytest.raises(ConfigError):
        make()


def test_block_json_round_trip_and_input_coercion():
    blocks = (TextBlock("hi"), ImageBlock("image/png", PNG), AudioBlock("audio/wav", PNG),
              ResourceBlock("s3://b/k", "application/pdf"), DataBlock({"a": [1, 2]}))
    for b in blocks:
        assert kit.block_from_json(json.loads(json.dumps(kit.block_to_json(b)))) == b
    assert kit.as_blocks("hi") == (TextBlock("hi"),)
    with pytest.raises(ContentError, match="unknown content block type"):
        kit.block_from_json({"type": "video"})
    with pytest.raises(ContentError, match="missing"):
        kit.block_from_json({"type": "image", "media_type": "image/png"})
    with pytest.raises(ContentError, match="not a content block"):
        kit.as_blocks(["hi"])
    with pytest.raises(ContentError, match="empty"):
        kit.as_blocks([])
    # bytes were read as a list of ints: "agent input item 0 is a int, not a content block"
    for raw in (b"hi", bytearray(b"hi"), memoryview(b"hi")):
        with pytest.raises(ContentError, match=f"a str or a list of content blocks, got "
                                               f"{type(raw).__name__}.*decode"):
            kit.as_blocks(raw)
        with pytest.raises(ContentError, match=f"history must be a list of HistoryMessage, got "
                                               f"{type(raw).__name__}"):
            kit.as_history(raw)


# -------------------------------------------------------------------------------- events ----

SAMPLES = [
    kit.RunStarted("a", "agent", "s", "ns", (TextBlock("x"), DataBlock({"k": 1})), "parent"),
    kit.RunStarted("a", "agent", input=(TextBlock("and?"),), history=(
        kit.HistoryMessage("user", "hi"), kit.HistoryMessage("assistant", [TextBlock("hello")]))),
    kit.TextDelta("tok"), kit.MessageCompleted("hi", {"k": 1}, "a"),
    kit.ModelCompleted("gpt-4o", 3, 4, 0.5), kit.ToolStarted("c1", "add", '{"a":1}'),
    kit.ToolCompleted("c1", "add", 3, False), kit.SkillLoaded("s", "ab" * 32),
    kit.NodeUpdated("n", {"x": 1}), kit.ControlRequested("pause", "why", "cli"),
    kit.RunInterrupted("i1", {"q": 1}, "t1"), kit.RunSleeping("2026-01-01T00:00:00+00:00", "t1"),
    kit.RunPaused("r"), kit.RunResumed("answer"), kit.RunCompleted("out", kit.Usage(1, 2, 0.25)),
    kit.RunFailed("ValueError", "m"), kit.RunCancelled("r"),
]


def test_every_kind_has_a_sample():
    assert {p.kind for p in SAMPLES} == set(kit.KINDS)


@pytest.mark.parametrize("payload", SAMPLES, ids=lambda p: p.kind)
def test_event_json_round_trip(payload):
    ev = Event("run1", 3, payload, "root/tool", "m1")
    wire = json.loads(json.dumps(ev.to_json()))
    assert set(wire) == {"run_id", "seq", "kind", "at", "origin", "message_id", "payload"}
    back = Event.from_json(wire)
    assert type(back) is Event and back == ev and back.kind == payload.kind


@pytest.mark.parametrize("at", ["2026-11-25T03:37:00.123456+00:00", "2026-11-25T03:37:00+00:00",
                                "0001-01-01T00:00:00.000001+00:00", "2026-11-25T03:37:00.5+02:00",
                                "2026-11-25T03:37:00"])
def test_event_time_is_written_as_isoformat(at):
    from datetime import datetime
    when = datetime.fromisoformat(at)
    ev = Event("run1", 0, kit.TextDelta("tok"), at=when)
    assert ev.to_json()["at"] == when.isoformat()
    assert Event.from_json(ev.to_json()).at == when


def test_unknown_kind_parses_instead_of_raising():
    ev = Event.from_json({"run_id": "r", "seq": 0, "kind": "future.thing", "payload": {"z": 1}})
    assert type(ev) is Event and ev.kind == "future.thing"
    assert isinstance(ev.payload, kit.UnknownEvent) and ev.payload.data == {"z": 1}
    assert Event.from_json(ev.to_json()).payload == ev.payload


def test_status_folds_from_kinds():
    assert kit.fold_status(["run.started", "text.delta"]) is RunStatus.RUNNING
    assert kit.fold_status(["run.started", "run.interrupted"]) is RunStatus.WAITING_HUMAN
    assert kit.fold_status(["run.started", "run.interrupted", "run.resumed", "run.completed"]) is RunStatus.COMPLETED
    assert kit.fold_status(["text.delta"]) is None


# ------------------------------------------------------------------------------ lifecycle ----

async def test_lifecycle_rules():
    deck = Deck([Agent("a", model=ScriptedModel(["hi"]))])
    with pytest.raises(DeckStateError, match="NEW"):
        await deck.run("a", "x")
    assert deck.build() is deck and deck.build() is deck  # idempotent
    with pytest.raises(DeckStateError, match="BUILT"):
        await deck.run("a", "x")
    with pytest.raises(TypeError):
        deck.agents["b"] = Agent("b")  # type: ignore[index]
    assert list(deck.agents) == ["a"] and dict(deck.workflows) == {}
    async with deck:
        with pytest.raises(DeckStateError, match="OPEN"):
            async with deck:
                pass
        with pytest.raises(kit.UnknownNameError, match="known: a"):
            await deck.run("nope", "x")
    with pytest.raises(DeckStateError, match="CLOSED"):
        async with deck:
            pass
    with pytest.raises(DeckStateError, match="CLOSED"):
        await deck.run("a", "x")
    with pytest.raises(DeckStateError):
        deck.stream("a", "x")
    await deck.aclose()  # idempotent


async def test_a_name_that_is_no_str_is_an_unknown_name():
    """A list or a dict for a name is an UnknownNameError, as an int is; it raised TypeError
    (unhashable type) from the catalog's lookup."""
    async with Deck([Agent("a", model=ScriptedModel(["hi"]))]) as deck:
        for name in (["a"], {"a": 1}, 5):
            with pytest.raises(kit.UnknownNameError, match="known: a"):
                await deck.run(name, "x")  # type: ignore[arg-type]
            with pytest.raises(kit.UnknownNameError, match="known: a"):
                deck.stream(name, "x")  # type: ignore[arg-type]


async def test_a_deck_another_task_is_opening_is_not_opened_twice():
    """Two tasks entering `async with deck:` at once: the second is refused while the first
    opens it (DeckStateError), and the deck runs on one Runtime, closed by its opener. Both
    opened it: two Runtimes, the first never closed, and the first opener's close raised."""
    deck = Deck([Agent("a", model=ScriptedModel(["hi"], cycle=True))])
    outcomes: list = []

    async def open_it() -> None:
        try:
            async with deck:
                outcomes.append(("opened", deck._runtime))
                await anyio.sleep(0.2)
                assert (await deck.run("a", "x")).output == "hi"
        except DeckStateError as exc:
            outcomes.append(("refused", exc.state))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(open_it)
            tg.start_soon(open_it)
    assert sorted(o[0] for o in outcomes) == ["opened", "refused"]
    assert [o[1] for o in outcomes if o[0] == "refused"] == ["OPENING"]
    assert deck._state == "CLOSED"
    Deck().build()  # the live slot is free again


async def test_one_live_deck_per_process_naming_both():
    first = Deck()
    with pytest.raises(ConfigError) as err:
        Deck()
    assert str(err.value).count("test_kit.py:") == 2  # both projects named
    await first.aclose()
    second = Deck()  # sequential decks are fine
    await second.aclose()


def test_build_refuses_unknown_names_and_instances():
    for kw, what in (({"skills": ["s"]}, "skill"), ({"mcp_servers": ["m"]}, "MCP server"),
                     ({"workflows": ["w"]}, "workflow")):
        deck = Deck([Agent("a", **kw)])
        with pytest.raises(ConfigError, match=f"unknown {what}"):
            deck.build()
        anyio.run(deck.aclose)
    deck = Deck([Agent("a"), Agent("a")])
    with pytest.raises(ConfigError, match="unique"):
        deck.build()
    anyio.run(deck.aclose)
    with pytest.raises(ConfigError, match="not an instance|type, not an instance"):
        Deck(context=object())
    Deck(context=dict).build()
    with pytest.raises(ConfigError, match="name"):
        Agent("has space")
    with pytest.raises(ConfigError, match="neither"):
        Agent("a", tools=[42])
    with pytest.raises(ConfigError, match="model"):
        Agent("a", model=3)
    # Arguments of the wrong type are ConfigErrors saying what was expected, not bare
    # TypeErrors (or a store URL's AttributeError at open, a factory's TypeError every turn).
    for make, match in ((lambda: Agent("a", tools=None), "tools takes a list, got NoneType"),
                        (lambda: Agent("a", skills=None), "skills takes a list"),
                        (lambda: Deck(skills=123), "skills takes a path or a list of paths"),
                        (lambda: Deck(skills=[123]), "a skills path must be a str or a path"),
                        (lambda: Deck(store="sqlite:///kit.db"), "set KIT_STORE to a URL"),
                        (lambda: Deck(session_factory=1), "session_factory=.... takes a callable")):
        with pytest.raises(ConfigError, match=match):
            make()


def test_a_single_agent_or_workflow_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"got a single Agent 'a': wrap it in a list, Deck\(agents=\[\.\.\.\]\)"):
        Deck(Agent("a"))
    release = kit.Workflow("release", StateGraph(dict))
    with pytest.raises(ConfigError, match=r"Deck\(agents=\.\.\.\) takes a list, got a single Workflow "
                                          r"'release': wrap it in a list, Deck\(workflows=\[\.\.\.\]\)"):
        Deck(release)
    with pytest.raises(ConfigError, match="list of kit.Agent objects, got str"):
        Deck("a")


async def test_an_exhausted_scripted_model_says_how_to_repeat_it(store):
    async with Deck([Agent("a", model=ScriptedModel(["only once"]))], store=store) as deck:
        await deck.run("a", "x")
        with pytest.raises(ConfigError, match=r"exhausted after 1 turns .*cycle=True"):
            await deck.run("a", "x")


# --------------------------------------------------------------------------------- turns ----

async def test_turn_records_events_in_order_and_result_comes_from_the_log(store, tmp_path):
    seen = {}

    def lookup(key: str) -> str:
        """Look a key up."""
        # tool.started is durable before the tool runs: another connection sees it now.
        db = sqlite3.connect(tmp_path / "kit.db")
        seen["kinds"] = [r[0] for r in db.execute("SELECT kind FROM events ORDER BY seq")]
        db.close()
        return f"value-of-{key}"

    model = ScriptedModel([{"tool": "lookup", "args": {"key": "k"}}, "The value is value-of-k"])
    async with Deck([Agent("a", "Use tools.", tools=[lookup], model=model)], store=store) as deck:
        result = await deck.run("a", "find k")
        log = await store.read(result.run_id)
        assert kinds(log) == ["run.started", "model.completed", "tool.started", "tool.completed",
                              "text.delta", "message.completed", "model.completed", "run.completed"]
        assert [e.seq for e in log] == list(range(8))
        assert "tool.started" in seen["kinds"]
        assert log[2].payload == kit.ToolStarted("call_1_0", "lookup", '{"key": "k"}')
        assert log[3].payload.output == "value-of-k" and log[3].payload.is_error is False
        assert log[2].origin == "a/lookup" and log[0].origin == "a"
        assert log[4].message_id is not None and log[4].message_id == log[5].message_id
        done = log[-1].payload
        assert result == kit.TurnResult(done.output, done.usage, result.run_id, None)
        assert result.output == "The value is value-of-k"
        calls = [e.payload for e in log if e.kind == "model.completed"]
        assert result.usage.input_tokens == sum(c.input_tokens for c in calls) > 0
        assert result.usage.output_tokens == sum(c.output_tokens for c in calls) > 0
        assert result.usage.usd is None  # "scripted" has no known price
        assert await deck.status(result.run_id) is RunStatus.COMPLETED
        assert await deck.status("no-such-run") is None
        # the tool's output reached the model
        assert any(i.get("type") == "function_call_output" and i["output"] == "value-of-k"
                   for i in model.calls[-1]["input"])


async def test_stream_yields_deltas_live_then_terminal_last(store):
    model = ScriptedModel(["one two three four"])
    async with Deck([Agent("a", model=model)], store=store) as deck:
        with anyio.fail_after(10):
            events = [e async for e in deck.stream("a", "go")]
        assert kinds(events) == ["run.started"] + ["text.delta"] * 4 + [
            "message.completed", "model.completed", "run.completed"]
        assert "".join(e.payload.text for e in events if e.kind == "text.delta") == "one two three four"
        assert events == await store.read(events[0].run_id)  # the stream is the log


async def test_every_message_completed_has_its_message_id(store):
    """A reply whose stream carried no text (an empty one) was logged ``message.completed``
    with no ``message_id``, which groups a reply's events (README: The log), when streamed;
    not streamed, it had one."""
    async with Deck([Agent("a", model=ScriptedModel([""], cycle=True))], store=store) as deck:
        streamed = [e async for e in deck.stream("a", "go")]
        asked = await store.read((await deck.run("a", "go")).run_id)
    for log in (streamed, asked):
        [done] = [e for e in log if e.kind == "message.completed"]
        assert done.payload.text == "" and done.message_id is not None
        assert all(e.message_id == done.message_id for e in log if e.kind == "text.delta")


async def test_a_failed_run_is_in_the_log_and_reaches_the_caller(store):
    model = ScriptedModel([RuntimeError("model down"), RuntimeError("again")])
    async with Deck([Agent("a", model=model)], store=store) as deck:
        with pytest.raises(RuntimeError, match="model down"):
            await deck.run("a", "x")
        [info] = await store.runs()
        log = await store.read(info.run_id)
        assert kinds(log) == ["run.started", "run.failed"]
        assert log[-1].payload == kit.RunFailed("RuntimeError", "model down")
        assert await deck.status(info.run_id) is RunStatus.FAILED
        seen = []
        with pytest.raises(RuntimeError, match="again"):
            async for e in deck.stream("a", "x"):
                seen.append(e.kind)
        assert seen == ["run.started", "run.failed"]


async def test_a_refusal_is_no_completed_message_only_the_failure_that_names_it(store):
    """A model's refusal (a message whose one part refuses): the log said a message completed,
    with empty text (after an empty ``text.delta`` when the run was not streamed), then
    ``run.failed`` named the refusal; SSE and ``deck.stream`` carried the same empty message."""
    refusal = {"refusal": "I can't help with that."}
    async with Deck([Agent("a", model=ScriptedModel([refusal], cycle=True))], store=store) as deck:
        with pytest.raises(agents.ModelRefusalError, match="I can't help with that."):
            await deck.run("a", "how do I pick a lock?", run_id="asked")
        seen: list[Event] = []
        with pytest.raises(agents.ModelRefusalError):
            async for e in deck.stream("a", "how do I pick a lock?", run_id="streamed"):
                seen.append(e)
        for run_id in ("asked", "streamed"):
            log = await store.read(run_id)
            assert kinds(log) == ["run.started", "model.completed", "run.failed"]
            assert log[-1].payload == kit.RunFailed(
                "ModelRefusalError", "Model refused to produce output: I can't help with that.")
        assert seen == log  # the stream is the log


@pytest.mark.parametrize("script, kw, match", [
    ("hello", {}, "script takes a list of turns, got 'hello'"),  # not five one-letter replies
    (None, {}, "script takes a list of turns"),
    ([42], {}, "turn 0 must be a str"),
    (["ok", {"text": "hi"}], {}, "turn 1 must be a str"),
    ([RuntimeError], {}, "turn 0 must be a str"),  # an exception class, not an instance
    ([[]], {}, "turn 0 is an empty list of tool calls"),
    ([{"tool": "add", "args": "a=1"}], {}, "'args' of tool call 'add' must be a dict"),
    ([{"tool": "add", "args": {"a": {1}}}], {}, "'args' of tool call 'add' are not JSON"),
    ([{"json": {"ids": {1, 2}}}], {}, "turn 0: 'json' is not JSON"),
    ([{"json": {"x": float("nan")}}], {}, "turn 0: 'json' is not JSON"),  # it was, to json.dumps
    ([{"refusal": None}], {}, "turn 0 must be a str"),
    ([{"tool": "add", "args": {"a": float("inf")}}], {}, "'args' of tool call 'add' are not JSON"),
    ([], {"cycle": True}, "cycle=True needs a script of at least one turn"),
    # one turn for the script: it played as the replies "tool" and "args"
    ({"tool": "add", "args": {"a": 1}}, {}, r"one turn, not a list of them: wrap it, \[\{'tool'"),
    ({"json": {"a": 1}}, {}, "one turn, not a list of them"),
    (["ok"], {"cycle": "no"}, "cycle must be True or False, got 'no'"),  # bool("no") is True
    (["ok"], {"name": 5}, "name must be a non-empty str, got 5"),
    (["ok"], {"name": ""}, "name must be a non-empty str, got ''"),
])
def test_a_malformed_script_is_refused_when_the_model_is_made(script, kw, match):
    with pytest.raises(ConfigError, match=match):
        ScriptedModel(script, **kw)


class FlakyStream(ScriptedModel):
    """A model whose first stream drops after its second word (a connection cut mid-reply)."""
    failed = False

    async def stream_response(self, *args, **kw):
        async for ev in super().stream_response(*args, **kw):
            if not self.failed and getattr(ev, "delta", "").strip() == "world":
                self.failed = True
                raise ConnectionError("peer closed connection mid-stream")
            yield ev


async def test_a_streamed_reply_cut_after_its_text_is_logged_is_not_retried(store):
    """With the SDK's runner-managed retries, the cut attempt was retried: the stream and the
    log held its partial text, then the whole reply (a message with no message.completed)."""
    from agents.retry import ModelRetrySettings
    retry = agents.ModelSettings(retry=ModelRetrySettings(max_retries=2, policy=lambda ctx: True))
    agent = Agent("a", model=FlakyStream(["Hello world from the model"], cycle=True),
                  model_settings=retry)
    async with Deck([agent], store=store) as deck:
        seen: list[Event] = []
        with pytest.raises(ConnectionError):
            async for event in deck.stream("a", "hi"):
                seen.append(event)
        assert "".join(e.payload.text for e in seen if e.kind == "text.delta").strip() == "Hello"
        assert kinds(await store.read(seen[0].run_id))[-1] == "run.failed"
    agent = Agent("b", model=FlakyStream(["Hello world from the model"], cycle=True),
                  model_settings=retry)
    async with Deck([agent], store=store) as deck:  # not streamed: nothing logged, retried
        assert (await deck.run("b", "hi")).output == "Hello world from the model"


async def test_a_tool_error_goes_back_to_the_model(store):
    def boom(x: int) -> int:
        raise ValueError("bad x")

    model = ScriptedModel([{"tool": "boom", "args": {"x": 1}}, "sorry"])
    async with Deck([Agent("a", tools=[boom], model=model)], store=store) as deck:
        result = await deck.run("a", "x")
        [done] = [e for e in await store.read(result.run_id) if e.kind == "tool.completed"]
        assert done.payload.is_error is True and "ValueError: bad x" in done.payload.output
        assert result.output == "sorry"


class Abort(BaseException):
    """What a user's code may raise that is no ``Exception`` (a library's own control flow)."""


def aborts(x: int) -> int:
    """Raise ``Abort``."""
    raise Abort(f"stop at {x}")


def aborting_flow() -> kit.Workflow:
    graph = StateGraph(dict)
    graph.add_node("n", lambda state: aborts(1))
    graph.add_edge("__start__", "n")
    return kit.Workflow("flow", graph)


async def test_a_base_exception_from_user_code_fails_its_run_and_no_other(store):
    """A tool or a node raising a ``BaseException`` that is no ``Exception`` (nor a
    cancellation): ``run`` raised it with the run still RUNNING in the log and its session held
    (the next turn: SessionBusyError) until its lease lapsed and it was recorded abandoned; a
    ``stream`` of it let it into the deck's task group, which cancelled every run and call of
    the deck. Now it is the run's failure: ``run.failed`` naming it, then raised to its caller."""
    model = ScriptedModel([{"tool": "aborts", "args": {"x": 1}}] * 3 + ["ok"])
    async with Deck([Agent("a", tools=[aborts], model=model)], [aborting_flow()],
                    store=store) as deck:
        for name, input in (("a", "go"), ("flow", {})):
            with anyio.fail_after(10):
                with pytest.raises(Abort, match="stop at 1"):
                    await deck.run(name, input, session_id="s", run_id=f"{name}-run")
                seen = []
                with pytest.raises(Abort, match="stop at 1"):
                    async for event in deck.stream(name, input, session_id="s",
                                                   run_id=f"{name}-stream"):
                        seen.append(event)
            assert seen[-1].payload == kit.RunFailed("Abort", "stop at 1")
            for run_id in (f"{name}-run", f"{name}-stream"):
                assert (await store.read(run_id))[-1].payload == kit.RunFailed("Abort", "stop at 1")
                assert await deck.status(run_id) is RunStatus.FAILED
        with anyio.fail_after(10):  # the session is free, the deck plays on
            with pytest.raises(Abort):
                await deck.run("a", "again", session_id="s")
            assert (await deck.run("a", "again", session_id="s")).output == "ok"


class Unprintable(Exception):
    """An exception whose ``str()`` raises (a library's, formatting a field it lost)."""

    def __str__(self) -> str:
        raise RuntimeError("cannot format")


def unprintable(x: int) -> int:
    """Raise ``Unprintable``."""
    raise Unprintable()


class UnprintableHooks:
    async def on_start(self, ctx, agent):
        raise Unprintable()


async def test_an_exception_whose_str_raises_is_its_runs_failure_or_its_tools_error(store):
    """Recording the failure called ``str(exc)``, which raised: the run stayed RUNNING with
    its session held and its caller got that RuntimeError instead of its own exception; a
    tool's error, told to the model as text, failed its run instead."""
    graph = StateGraph(dict)
    graph.add_node("n", lambda state: unprintable(1))
    graph.add_edge("__start__", "n")
    model = ScriptedModel([{"tool": "unprintable", "args": {"x": 1}}, "sorry"])
    hooked = Agent("hooked", hooks=UnprintableHooks(), model=ScriptedModel(["ok"], cycle=True))
    async with Deck([Agent("a", tools=[unprintable], model=model), hooked],
                    [kit.Workflow("flow", graph)], store=store) as deck:
        with anyio.fail_after(10):
            result = await deck.run("a", "go", session_id="s")
            assert result.output == "sorry"
            [done] = [e for e in await store.read(result.run_id) if e.kind == "tool.completed"]
            assert done.payload.is_error and "Unprintable" in done.payload.output
            for name, input in (("flow", {}), ("hooked", "hi")):
                with pytest.raises(Unprintable):
                    await deck.run(name, input, session_id="s", run_id=f"{name}-run")
                with pytest.raises(Unprintable):
                    async for _ in deck.stream(name, input, session_id="s", run_id=f"{name}-stream"):
                        pass
                for run_id in (f"{name}-run", f"{name}-stream"):
                    end = (await store.read(run_id))[-1].payload
                    assert end == kit.RunFailed("Unprintable", "<exception str() failed>")


async def test_a_tool_whose_own_task_was_cancelled_is_an_error_in_the_log(store):
    """A tool cut short by a cancellation of its own (a library's request cancelled by another
    of its tasks), not the run's: the SDK tells the model the call failed, which the log
    recorded as a successful call returning that message."""
    import asyncio  # the tool runs where the SDK does: on asyncio, under trio too

    async def fetch(url: str) -> str:
        """Fetch a page."""
        request = asyncio.ensure_future(asyncio.sleep(10))
        asyncio.get_running_loop().call_later(0.01, request.cancel)
        return await request

    model = ScriptedModel([{"tool": "fetch", "args": {"url": "x"}}, "sorry"])
    async with Deck([Agent("a", tools=[fetch], model=model)], store=store) as deck:
        with anyio.fail_after(10):
            result = await deck.run("a", "go")
        [done] = [e.payload for e in await store.read(result.run_id) if e.kind == "tool.completed"]
    assert done.is_error is True and "cancelled" in done.output
    assert result.output == "sorry"



async def test_a_calls_error_and_id_are_its_own_when_the_provider_reuses_or_omits_call_ids(store):
    """Some providers' call ids are scoped to a turn (Kimi's ``<tool>:<n>`` restarts at 0 each
    turn), some leave them empty (a second parallel call's, on some local servers). A call that
    succeeded was logged ``is_error`` because an earlier call of the run with its id failed, and
    a call with no id was logged under one id when it started and another (``""``) when it
    completed, so nothing paired them."""
    def boom(x: int) -> int:
        """Fail on zero."""
        if x == 0:
            raise ValueError("zero")
        return x

    ids = iter(["boom:0", "boom:0", "", ""])

    class TurnScopedIds(ScriptedModel):
        async def get_response(self, *args, **kwargs):
            response = await super().get_response(*args, **kwargs)
            response.output = [i.model_copy(update={"call_id": next(ids)})
                               if i.type == "function_call" else i for i in response.output]
            return response

    model = TurnScopedIds([{"tool": "boom", "args": {"x": 0}}, {"tool": "boom", "args": {"x": 5}},
                           [{"tool": "boom", "args": {"x": 0}}, {"tool": "boom", "args": {"x": 7}}],
                           "done"])
    async with Deck([Agent("a", tools=[boom], model=model)], store=store) as deck:
        result = await deck.run("a", "go")
        log = await store.read(result.run_id)
    calls = [e.payload for e in log if e.kind == "tool.started"]
    assert [c.call_id for c in calls][:2] == ["boom:0", "boom:0"] and len(calls) == 4
    started = {c.arguments: c.call_id for c in calls}  # the last call of each x
    done = {e.payload.call_id: e.payload for e in log if e.kind == "tool.completed"}
    assert started['{"x": 0}'] != started['{"x": 7}'] and "" not in started.values()
    assert (done[started['{"x": 5}']].output, done[started['{"x": 5}']].is_error) == (5, False)
    assert (done[started['{"x": 7}']].output, done[started['{"x": 7}']].is_error) == (7, False)
    assert done[started['{"x": 0}']].is_error is True
    assert result.output == "done"

async def test_an_sdk_tools_error_is_logged_as_one(store):
    """An SDK ``function_tool`` whose exception the SDK hands the model as text: its
    ``tool.completed`` said ``is_error=False``, unlike a plain function's."""
    @agents.function_tool
    def boom(x: int) -> int:
        """Explode."""
        raise ValueError("bad x")

    @agents.function_tool(failure_error_function=lambda ctx, error: f"no luck: {error}")
    async def told(x: int) -> int:
        """Explode, in words of its own."""
        raise ValueError("bad y")

    model = ScriptedModel([[{"tool": "boom", "args": {"x": 1}}, {"tool": "told", "args": {"x": 2}}],
                           {"tool": "double", "args": {"x": 3}}, "sorry"])
    async with Deck([Agent("a", tools=[boom, told, double], model=model)], store=store) as deck:
        result = await deck.run("a", "x")
        done = {e.payload.tool: e.payload for e in await store.read(result.run_id)
                if e.kind == "tool.completed"}
    assert done["boom"].is_error is True and "bad x" in done["boom"].output
    assert (done["told"].is_error, done["told"].output) == (True, "no luck: bad y")
    assert (done["double"].is_error, done["double"].output) == (False, 6)
    assert result.output == "sorry"


async def test_an_sdk_tool_that_times_out_is_logged_as_an_error(store):
    """An SDK tool whose ``timeout`` the SDK reports to the model as text: its
    ``tool.completed`` said ``is_error=False``."""
    @agents.function_tool(timeout=0.01)
    async def hang() -> str:
        """Never answers."""
        await anyio.sleep_forever()

    @agents.function_tool(timeout=0.01, timeout_error_function=lambda ctx, error: "gave up")
    async def stall() -> str:
        """Never answers either."""
        await anyio.sleep_forever()

    model = ScriptedModel([[{"tool": "hang", "args": {}}, {"tool": "stall", "args": {}}], "sorry"])
    async with Deck([Agent("a", tools=[hang, stall], model=model)], store=store) as deck:
        with anyio.fail_after(10):
            result = await deck.run("a", "x")
        done = {e.payload.tool: e.payload for e in await store.read(result.run_id)
                if e.kind == "tool.completed"}
    assert (done["hang"].is_error, done["hang"].output) == (True, "Tool 'hang' timed out after 0.01 seconds.")
    assert (done["stall"].is_error, done["stall"].output) == (True, "gave up")


async def test_an_sdk_tool_that_fails_its_run_ends_its_call_before_the_run(store):
    """An SDK tool whose failure fails the run (``failure_error_function=None``, a timeout set to
    raise): the log had its ``tool.started`` and then ``run.failed``, no ``tool.completed``, so
    SSE, the playground and traces showed the call running forever."""
    @agents.function_tool(failure_error_function=None)
    def boom(x: int) -> int:
        """Explode."""
        raise ValueError("bad x")

    @agents.function_tool(timeout=0.01, timeout_behavior="raise_exception")
    async def hang() -> str:
        """Never answers."""
        await anyio.sleep_forever()

    model = ScriptedModel([{"tool": "boom", "args": {"x": 1}}, {"tool": "hang", "args": {}}],
                          cycle=True)
    async with Deck([Agent("a", tools=[boom, hang], model=model)], store=store) as deck:
        with anyio.fail_after(10):
            with pytest.raises(Exception) as asked:
                await deck.run("a", "x", run_id="asked")
            streamed: list[Event] = []
            with pytest.raises(Exception) as timed:
                async for e in deck.stream("a", "x", run_id="streamed"):
                    streamed.append(e)
        for run_id, exc in (("asked", asked.value), ("streamed", timed.value)):
            log = await store.read(run_id)
            assert kinds(log) == ["run.started", "model.completed", "tool.started",
                                  "tool.completed", "run.failed"]
            started, done, end = log[2].payload, log[3].payload, log[4].payload
            assert (done.call_id, done.tool, done.is_error) == (started.call_id, started.tool, True)
            assert done.output == f"error: {end.error}: {end.message}"
            assert (end.error, end.message) == (type(exc).__name__, str(exc))
    assert streamed == log and log[2].payload.tool == "hang"


async def test_an_agent_played_as_a_tool_counts_in_the_runs_usage(store):
    """An SDK agent as a tool (``Agent.as_tool``) calls its own model, which kit does not wrap:
    its tokens and cost were missing from the run's usage, and no ``model.completed`` said
    they were spent, while the SDK's own usage counted them."""
    from genai_prices import Usage as PriceUsage, calc_price
    inner = agents.Agent("helper", instructions="Help.",
                         model=ScriptedModel(["an answer of five words"], name="gpt-4o"))
    model = ScriptedModel([{"tool": "helper", "args": {"input": "do it"}}, "done"], name="gpt-4o")
    agent = Agent("a", tools=[inner.as_tool("helper", "Helps.")], model=model)
    async with Deck([agent], store=store) as deck:
        result = await deck.run("a", "go")
        log = await store.read(result.run_id)
    calls = [e for e in log if e.kind == "model.completed"]
    assert [(e.origin, e.payload.model) for e in calls] == [
        ("a", "gpt-4o"), ("a/helper", "gpt-4o"), ("a", "gpt-4o")]
    assert kinds(log)[2:5] == ["tool.started", "model.completed", "tool.completed"]
    helper = calls[1].payload
    assert (helper.input_tokens, helper.output_tokens) == (len("Help. do it".split()), 5)
    price = calc_price(PriceUsage(input_tokens=helper.input_tokens, output_tokens=5),
                       model_ref="gpt-4o", provider_id="openai").total_price
    assert helper.usd == pytest.approx(float(price), rel=1e-9)
    usage = log[-1].payload.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        sum(e.payload.input_tokens for e in calls), sum(e.payload.output_tokens for e in calls))
    assert usage.usd == pytest.approx(sum(e.payload.usd for e in calls), rel=1e-9)
    assert result.usage == usage


async def test_a_tool_call_refused_by_its_input_guardrail_is_in_the_log(store):
    """A tool input guardrail that refuses a call: the SDK tells the model its message and never
    starts the tool, nor calls the hooks, so the log held no trace of the call the model made
    and the answer it was given; a tripwire left only the run's failure."""
    from agents import ToolGuardrailFunctionOutput, tool_input_guardrail

    @tool_input_guardrail
    def no_secrets(data):
        if "secret" in data.context.tool_arguments:
            return ToolGuardrailFunctionOutput.reject_content("no secrets here")
        return ToolGuardrailFunctionOutput.allow()

    @tool_input_guardrail
    def tripwire(data):
        return ToolGuardrailFunctionOutput.raise_exception()

    @agents.function_tool(tool_input_guardrails=[no_secrets])
    def look_up(q: str) -> str:
        """Look something up."""
        return f"found {q}"

    @agents.function_tool(tool_input_guardrails=[tripwire])
    def launch() -> str:
        """Never allowed."""
        return "launched"

    model = ScriptedModel([{"tool": "look_up", "args": {"q": "the secret"}},
                           {"tool": "look_up", "args": {"q": "cats"}}, {"tool": "launch"}])
    async with Deck([Agent("a", tools=[look_up, launch], model=model)], store=store) as deck:
        with pytest.raises(agents.ToolInputGuardrailTripwireTriggered):
            await deck.run("a", "go", run_id="guarded")
        log = await store.read("guarded")
    tools = [(e.kind, e.payload.call_id, e.payload.tool) for e in log if e.kind.startswith("tool.")]
    assert [k for k, _, _ in tools] == ["tool.started", "tool.completed"] * 3
    assert [t for _, _, t in tools] == ["look_up"] * 4 + ["launch"] * 2
    done = [e.payload for e in log if e.kind == "tool.completed"]
    assert [(d.output, d.is_error) for d in done] == [
        ("no secrets here", True), ("found cats", False), ("refused by guardrail tripwire", True)]
    assert log[-1].kind == "run.failed" and log[-1].payload.error == "ToolInputGuardrailTripwireTriggered"
    assert look_up.tool_input_guardrails[0] is no_secrets  # the caller's tool is left as built


async def test_an_sdk_tool_and_its_guardrail_see_the_callers_context_object(store):
    """An SDK ``function_tool`` taking a ``RunContextWrapper`` reads ``ctx.context`` as the SDK
    gives it: the object passed as ``context=``. It got kit's run handle, so a tool ported from
    the SDK (``ctx.context.user``) failed on every call; its failures are still flagged, and the
    object still reaches nothing kit writes."""
    from agents import ToolGuardrailFunctionOutput, tool_input_guardrail

    @dataclasses.dataclass
    class Deps:
        user: str
        token: str

    seen = []

    @tool_input_guardrail
    def only_alice(data):
        seen.append(data.context.context.user)
        return ToolGuardrailFunctionOutput.allow()

    @agents.function_tool(tool_input_guardrails=[only_alice])
    def whoami(ctx: agents.RunContextWrapper) -> str:
        """Who is asking."""
        return f"you are {ctx.context.user}"

    @agents.function_tool
    async def boom(ctx: agents.RunContextWrapper) -> str:
        """Explode."""
        raise ValueError(f"no {ctx.context.user}")

    model = ScriptedModel([[{"tool": "whoami"}, {"tool": "boom"}], "done"])
    deps = Deps("alice", "sk-secret-123")
    async with Deck([Agent("a", tools=[whoami, boom], model=model)], store=store) as deck:
        result = await deck.run("a", "who?", context=deps)
        log = await store.read(result.run_id)
    done = {e.payload.tool: e.payload for e in log if e.kind == "tool.completed"}
    assert (done["whoami"].output, done["whoami"].is_error) == ("you are alice", False)
    assert done["boom"].is_error is True and "no alice" in done["boom"].output
    assert seen == ["alice"] and result.output == "done"
    assert "sk-secret-123" not in json.dumps([e.to_json() for e in log])


async def test_an_sdk_tools_is_enabled_sees_the_callers_context_object(store):
    """An SDK ``function_tool``'s ``is_enabled`` callable reads ``ctx.context`` as the SDK gives
    it: the object passed as ``context=``, as the tool itself and its guardrails do. It got kit's
    run handle, so a tool ported from the SDK whose ``is_enabled`` read its app context
    (``ctx.context.admin``) failed every run with an AttributeError."""
    @dataclasses.dataclass
    class Deps:
        admin: bool

    seen = []

    def admins_only(ctx: agents.RunContextWrapper, agent: Any) -> bool:
        seen.append(type(ctx.context).__name__)
        return ctx.context.admin

    async def everyone(ctx: agents.RunContextWrapper, agent: Any) -> bool:
        seen.append(type(ctx.context).__name__)
        return ctx.context is not None

    @agents.function_tool(is_enabled=admins_only)
    def wipe() -> str:
        """Wipe the disk."""
        return "wiped"

    @agents.function_tool(is_enabled=everyone)
    def ping() -> str:
        """Ping."""
        return "pong"

    helper = agents.Agent(name="helper", model=ScriptedModel([]))
    audit = helper.as_tool("audit", "Audits.", is_enabled=admins_only)  # an agent as a tool
    model = ScriptedModel(["hi", "hi"])
    async with Deck([Agent("a", tools=[wipe, ping, audit], model=model)], store=store) as deck:
        for admin in (True, False):
            result = await deck.run("a", "go", context=Deps(admin))
            assert result.output == "hi"
            assert "ping" in model.calls[-1]["tools"]
            assert ("wipe" in model.calls[-1]["tools"]) is admin
            assert ("audit" in model.calls[-1]["tools"]) is admin
    assert set(seen) == {"Deps"}
    assert wipe.is_enabled is admins_only  # the caller's tool is left as built


async def test_an_sdk_agent_played_as_a_tool_sees_the_callers_context_object(store):
    """An SDK agent played as a tool (``Agent.as_tool``) runs with the tool call's context: its
    tools and its instructions read ``ctx.context`` as in the SDK, the object passed as
    ``context=``. They got kit's run handle, so an agent ported from the SDK whose tool read
    its app context (``ctx.context.user``) failed there on every call (the model was told an
    AttributeError); its use still counts in the run's usage."""
    @dataclasses.dataclass
    class Deps:
        user: str

    @agents.function_tool
    def whoami(ctx: agents.RunContextWrapper) -> str:
        """Who is asking."""
        return f"you are {ctx.context.user}"

    inner_model = ScriptedModel([{"tool": "whoami"}, "helped"])
    inner = agents.Agent("helper", model=inner_model, tools=[whoami],
                         instructions=lambda ctx, agent: f"Help {ctx.context.user}.")
    model = ScriptedModel([{"tool": "helper", "args": {"input": "do it"}}, "done"])
    async with Deck([Agent("a", tools=[inner.as_tool("helper", "Helps.")], model=model)],
                    store=store) as deck:
        result = await deck.run("a", "go", context=Deps("alice"))
        log = await store.read(result.run_id)
    assert inner_model.calls[0]["instructions"] == "Help alice."
    outputs = [i["output"] for i in inner_model.calls[1]["input"]
               if isinstance(i, dict) and i.get("type") == "function_call_output"]
    assert outputs == ["you are alice"]
    [done] = [e.payload for e in log if e.kind == "tool.completed"]
    assert (done.tool, done.output, done.is_error) == ("helper", "helped", False)
    assert [e.origin for e in log if e.kind == "model.completed"] == ["a", "a/helper", "a"]
    assert result.output == "done"


async def test_a_tool_output_refused_by_its_output_guardrail_is_an_error_in_the_log(store):
    """A tool output guardrail that withholds a call's output: the model is told the guardrail's
    message, which the log recorded as the call's successful output; one whose tripwire fails
    the run left the call started and never completed (the SDK calls no hook for it)."""
    from agents import ToolGuardrailFunctionOutput, tool_output_guardrail

    @tool_output_guardrail
    def no_leaks(data):
        if "secret" in str(data.output):
            return ToolGuardrailFunctionOutput.reject_content("output withheld")
        return ToolGuardrailFunctionOutput.allow()

    @tool_output_guardrail
    def tripwire(data):
        return ToolGuardrailFunctionOutput.raise_exception()

    @agents.function_tool(tool_output_guardrails=[no_leaks])
    def read(path: str) -> str:
        """Read a file."""
        return f"the secret of {path}" if path == "vault" else f"contents of {path}"

    @agents.function_tool(tool_output_guardrails=[tripwire])
    def launch() -> str:
        """Launch, then regret it."""
        return "launched"

    model = ScriptedModel([[{"tool": "read", "args": {"path": "vault"}},
                            {"tool": "read", "args": {"path": "notes"}}], {"tool": "launch"}])
    async with Deck([Agent("a", tools=[read, launch], model=model)], store=store) as deck:
        with pytest.raises(agents.ToolOutputGuardrailTripwireTriggered):
            await deck.run("a", "go", run_id="guarded")
        log = await store.read("guarded")
    started = [e.payload.call_id for e in log if e.kind == "tool.started"]
    done = {e.payload.call_id: e.payload for e in log if e.kind == "tool.completed"}
    assert len(started) == 3 and sorted(started) == sorted(done)
    assert kinds(log).count("tool.completed") == 3  # the tripwire's call ended once, not again
    assert [(done[c].tool, done[c].output, done[c].is_error) for c in started] == [
        ("read", "output withheld", True), ("read", "contents of notes", False),
        ("launch", "refused by guardrail tripwire", True)]
    assert log[-1].kind == "run.failed" and log[-1].payload.error == "ToolOutputGuardrailTripwireTriggered"
    assert "output withheld" in json.dumps(model.calls[1]["input"])
    assert read.tool_output_guardrails[0] is no_leaks  # the caller's tool is left as built


@agents.function_tool
def double(x: int) -> int:
    """Double x."""
    return 2 * x


@pytest.mark.parametrize("value, says", [
    (10 ** 5000, "an integer of 16,610 bits cannot be written to the log as JSON"),
    (float("nan"), "a float nan cannot be written to the log as JSON"),
    (float("-inf"), "a float -inf cannot be written to the log as JSON")],
    ids=["huge-int", "nan", "infinity"])
async def test_a_tool_result_no_json_can_carry_fails_its_run_and_no_other(store, value, says):
    """An integer past 4,300 digits: the store's serialiser failed on it, which the writer took
    for an outage, so every run of the deck waited behind it and then failed. A NaN or an
    infinity: the log held null where the tool returned a number."""
    def huge() -> Any:
        """A number no JSON can carry."""
        return value

    bad = Agent("bad", tools=[huge], model=ScriptedModel([{"tool": "huge", "args": {}}, "done"]))
    good = Agent("good", model=ScriptedModel(["hello"], cycle=True))
    async with Deck([bad, good], store=store) as deck:
        with anyio.fail_after(10):
            with pytest.raises(Exception, match=says):
                await deck.run("bad", "go", run_id="bad-run")
            assert (await deck.run("good", "hi")).output == "hello"
        log = await store.read("bad-run")
        assert log[-1].kind == "run.failed" and says in log[-1].payload.message
        assert [e.seq for e in log] == list(range(len(log)))


class Answer(pydantic.BaseModel):
    city: str
    temp: int


@dataclasses.dataclass
class AnswerData:
    city: str
    temp: int


@pytest.mark.parametrize("output_type", [Answer, AnswerData])
async def test_structured_output(store, output_type):
    """A pydantic model or a dataclass: JSON data in the result and the log (a dataclass used
    to be its repr string)."""
    data = {"city": "Oslo", "temp": 3}  # the SDK wraps a type that is not a pydantic model
    model = ScriptedModel([{"json": data if output_type is Answer else {"response": data}}])
    async with Deck([Agent("a", model=model, output_type=output_type)], store=store) as deck:
        result = await deck.run("a", "weather?")
        assert result.output == {"city": "Oslo", "temp": 3}
        [msg] = [e for e in await store.read(result.run_id) if e.kind == "message.completed"]
        assert msg.payload.output == {"city": "Oslo", "temp": 3}


class Reading(pydantic.BaseModel):
    value: float


@dataclasses.dataclass
class ReadingData:
    value: float


@pytest.mark.parametrize("output_type", [Reading, ReadingData])
async def test_a_structured_output_no_json_can_carry_fails_its_run(store, output_type):
    """A NaN in a structured output: a dataclass's raised past the run's end, a pydantic
    model's reached the store, which refused the run's last batch; either way the caller got
    an error while the log kept the run RUNNING, with no end."""
    data = {"value": "NaN"}  # JSON, which the output type reads as a float NaN
    model = ScriptedModel([{"json": data if output_type is Reading else {"response": data}}])
    async with Deck([Agent("a", model=model, output_type=output_type)], store=store) as deck:
        with anyio.fail_after(10):
            with pytest.raises(ContentError, match="a float nan cannot be written to the log"):
                await deck.run("a", "read it", run_id="nan-run")
        log = await store.read("nan-run")
        assert log[-1].kind == "run.failed" and log[-1].payload.error == "ContentError"
        assert (await store.run_info("nan-run")).status is RunStatus.FAILED
        assert [e.seq for e in log] == list(range(len(log)))


class Opaque:  # a plain class: no JSON schema describes it
    pass


@pytest.mark.parametrize("output_type, says", [
    (dict[str, int], "Strict JSON schema is enabled"),
    (Opaque, "Unable to generate pydantic-core schema")], ids=["not-strict", "no-schema"])
async def test_an_output_type_no_schema_can_describe_is_refused_when_the_deck_builds(
        output_type, says):
    """The SDK builds an output type's schema when a run starts: a deck whose agent no turn
    could play opened fine, and each run failed with the SDK's (or pydantic's) error."""
    agent = Agent("a", model=ScriptedModel(["{}"]), output_type=output_type)
    deck = Deck([agent])
    with pytest.raises(ConfigError, match=f"agent 'a': output_type .*: .*{says}"):
        deck.build()
    await deck.aclose()
    with pytest.raises(ConfigError, match=f"agent 'a': output_type .*: .*{says}"):
        await agent.run("hi")
    if output_type is not Opaque:  # the SDK's way to a type strict mode cannot describe
        deck = Deck([Agent("a", model=ScriptedModel(["{}"]), output_type=agents.AgentOutputSchema(
            output_type, strict_json_schema=False))])
        deck.build()
        await deck.aclose()


async def test_context_reaches_instructions_hooks_and_tools_by_reference(store):
    deps, got = {"user": "ana"}, []

    async def instructions(ctx: Context, agent) -> str:
        got.append(("instructions", ctx.data))
        return f"Help {ctx.data['user']}."

    def whoami(ctx: Context[dict], shout: bool) -> str:
        got.append(("tool", ctx.data))
        return ctx.data["user"].upper() if shout else ctx.data["user"]

    class Hooks:
        async def on_start(self, ctx, agent):
            got.append(("hook", ctx.data))

    model = ScriptedModel([{"tool": "whoami", "args": {"shout": True}}, "ANA"])
    agent = Agent("a", instructions, tools=[whoami], hooks=Hooks(), model=model)
    async with Deck([agent], store=store, context=dict) as deck:
        await deck.run("a", "who?", context=deps)
    assert [k for k, _ in got] == ["hook", "instructions", "tool", "instructions"]
    assert all(d is deps for _, d in got)
    for bad, what in ((Hooks, "the class Hooks"), ("audit", "str"), (object(), "object")):
        # a class's methods would be called unbound mid-run; an object with no hook does nothing
        with pytest.raises(ConfigError, match=f"agent 'a': hooks must be an object with any of on_start, .*, got {what}"):
            Agent("a", hooks=bad)
    assert model.calls[0]["instructions"] == "Help ana."
    [schema_tools] = [c["tools"] for c in list(model.calls)[:1]]
    assert schema_tools == ["whoami"]
    compiled = deck._specs["a"].engine.sdk_agent.tools[0]
    assert set(compiled.params_json_schema["properties"]) == {"shout"}  # ctx hidden


async def test_sdk_tool_objects_pass_through(store):
    @agents.function_tool
    def double(x: int) -> int:
        """Double x."""
        return 2 * x

    model = ScriptedModel([{"tool": "double", "args": {"x": 21}}, "42"])
    async with Deck([Agent("a", tools=[double], model=model)], store=store) as deck:
        result = await deck.run("a", "x")
        [done] = [e for e in await store.read(result.run_id) if e.kind == "tool.completed"]
        assert done.payload.output == 42


class Finish(enum.Enum):
    MATTE = "matte"
    GLOSS = "gloss"


def paint(color: Literal["red", "blue"], finish: Finish = Finish.MATTE) -> str:
    """Paint something."""
    return f"{color} {finish.value}"


def scale(factor: int, x: int) -> int:
    """Scale x."""
    return factor * x


async def test_tools_of_postponed_annotations_and_partials_build_and_play(store):
    """This module has ``from __future__ import annotations``: a tool naming its own module's
    types (an Enum, a Literal) failed to build ("name 'Finish' is not defined"), and a
    ``functools.partial`` failed with a bare AttributeError."""
    model = ScriptedModel([{"tool": "paint", "args": {"color": "red", "finish": "gloss"}},
                           {"tool": "scale", "args": {"x": 21}}, "done"])
    agent = Agent("a", tools=[paint, functools.partial(scale, 2)], model=model)
    async with Deck([agent], store=store) as deck:
        result = await deck.run("a", "go")
        done = [e.payload for e in await store.read(result.run_id) if e.kind == "tool.completed"]
        assert [(d.tool, d.output, d.is_error) for d in done] == [
            ("paint", "red gloss", False), ("scale", 42, False)]

    class Doubler:
        def __call__(self, x: int) -> int:
            return 2 * x

    with pytest.raises(ConfigError, match="has no __name__"):
        async with Deck([Agent("b", tools=[Doubler()], model=ScriptedModel(["x"]))], store=store):
            pass


async def test_a_plain_tool_taking_the_sdks_context_is_refused_naming_kits(store):
    """A plain function written as the SDK's tools are, its first parameter a
    ``RunContextWrapper``: the schema left that parameter out, kit passed nothing for it, and
    every call failed with a TypeError (the model's first argument bound to the wrapper)."""
    def whoami(wrapper: agents.RunContextWrapper, shout: bool) -> str:
        """Who is asking."""
        return "ana"

    with pytest.raises(ConfigError, match=r"agent 'b': tool whoami takes the SDK's "
                       r"RunContextWrapper.*ctx: kit\.Context\[T\]"):
        async with Deck([Agent("b", tools=[whoami], model=ScriptedModel(["x"]))], store=store):
            pass


async def test_a_tool_whose_name_no_model_api_takes_is_refused_when_the_deck_opens(store):
    """A lambda is a tool named ``<lambda>``, which model APIs refuse (OpenAI's: letters,
    digits, ``_`` and ``-``, at most 64): the deck opened fine and every turn failed with the
    API's HTTP 400 about ``tools[0].name``."""
    def a_function_whose_name_runs_on_well_past_the_limit_model_apis_set_on_it() -> str:
        """Too long a name."""
        return "x"

    for tool, name in ((lambda x: x, "<lambda>"), (functools.partial(lambda x, y: x, 1), "<lambda>"),
                       (a_function_whose_name_runs_on_well_past_the_limit_model_apis_set_on_it,
                        a_function_whose_name_runs_on_well_past_the_limit_model_apis_set_on_it.__name__)):
        with pytest.raises(ConfigError, match=f"agent 'b': tool {name} cannot be named to a model"):
            async with Deck([Agent("b", tools=[tool], model=ScriptedModel(["x"]))], store=store):
                pass


async def test_an_sdk_tool_that_needs_approval_is_refused_when_the_deck_opens(store):
    """The SDK stopped the turn for an approval nobody could grant: the run was recorded
    COMPLETED with output None, no tool event, and the unmade call left in the session."""
    @agents.function_tool(needs_approval=True)
    def delete_all(table: str) -> str:
        """Delete every row."""
        return "deleted"

    with pytest.raises(ConfigError, match="tool 'delete_all' needs approval"):
        async with Deck([Agent("b", tools=[delete_all], model=ScriptedModel(["x"]))], store=store):
            pass


async def test_two_tools_of_one_name_are_refused_when_the_deck_opens(store):
    """The model was sent both, and every call reached only one of them."""
    def lookup(q: str) -> str:
        """Look up."""
        return q

    with pytest.raises(ConfigError, match="more than one tool named 'lookup'"):
        async with Deck([Agent("b", tools=[lookup, agents.function_tool(lookup)],
                               model=ScriptedModel(["x"]))], store=store):
            pass


async def test_blocks_map_to_model_input_and_unsendable_ones_are_recorded(store):
    model = ScriptedModel(["ok", "ok"])
    async with Deck([Agent("a", model=model)], store=store) as deck:
        blocks = [TextBlock("look"), ImageBlock("image/png", PNG), DataBlock({"k": 1}),
                  ResourceBlock("file:///x.pdf", "application/pdf")]
        result = await deck.run("a", blocks)
        [msg] = model.calls[-1]["input"]
        assert msg["content"] == [{"type": "input_text", "text": "look"}, {
            "type": "input_image", "detail": "auto", "image_url": f"data:image/png;base64,{PNG}"}]
        started = (await store.read(result.run_id))[0].payload
        assert started.input == tuple(blocks)
        with pytest.raises(ConfigError, match="AudioBlock"):
            await deck.run("a", [TextBlock("hear"), AudioBlock("audio/wav", PNG)])
        with pytest.raises(ContentError, match="nothing to send"):
            await deck.run("a", [DataBlock({"k": 1})])
        assert len(await store.runs()) == 1  # refused runs wrote nothing


@pytest.mark.parametrize("name", ["gpt-4o", "gpt-5.5", "o3"])  # a flat rate, tiers, dated prices
async def test_usd_from_genai_prices(store, name):
    from genai_prices import Usage as PriceUsage, calc_price
    model = ScriptedModel(["hello world", "a longer reply, of a few more words"], name=name)
    async with Deck([Agent("a", model=model)], store=store) as deck:
        for message in ("hi", "tell me more, at some length, in many more words than before"):
            result = await deck.run("a", message)
            [call] = [e.payload for e in await store.read(result.run_id) if e.kind == "model.completed"]
            # Exactly genai-prices' own answer, on the first call of a model and on later ones
            # (which a flat rate answers from its cached rates).
            price = calc_price(PriceUsage(input_tokens=call.input_tokens,
                                          output_tokens=call.output_tokens),
                               model_ref=name, provider_id="openai")
            assert call.model == name and call.usd == float(price.total_price) > 0
            assert result.usage.usd == pytest.approx(call.usd)


# ------------------------------------------------------------------------------ sessions ----

async def test_session_keeps_history_across_turns(store):
    model = ScriptedModel(["Nice to meet you, Ana.", "You are Ana."])
    async with Deck([Agent("a", model=model)], store=store) as deck:
        first = await deck.run("a", "I am Ana", session_id="s1")
        second = await deck.run("a", "Who am I?", session_id="s1")
        assert first.session_id == second.session_id == "s1"
        sent = json.dumps(model.calls[-1]["input"])
        assert "I am Ana" in sent and "Nice to meet you, Ana." in sent
        items = await deck.session_for("s1").get_items()
        assert [i.get("role") for i in items] == ["user", "assistant", "user", "assistant"]
        assert (await deck.session_for("s1").get_items(limit=1))[0]["role"] == "assistant"
        for bad in (1, "", None, b"s1"):  # an int would be a session apart from its str
            with pytest.raises(kit.ConfigError, match="session_id must be a non-empty str"):
                deck.session_for(bad)
        with pytest.raises(kit.ConfigError, match="namespace name"):
            deck.session_for("s1", namespace="a b")


async def test_a_one_off_turn_gets_its_history_recorded_and_sent_in_roles(store):
    model = ScriptedModel(["You are Ana."])
    history = [kit.HistoryMessage("system", "Answer in one line."),
               kit.HistoryMessage("user", [TextBlock("I am Ana"), ImageBlock("image/png", PNG)]),
               kit.HistoryMessage("assistant", "Nice to meet you, Ana.")]
    async with Deck([Agent("a", model=model)], store=store) as deck:
        result = await deck.run("a", "Who am I?", history=history)
        assert [(i["role"], i["content"] if i["role"] == "assistant" else len(i["content"]))
                for i in model.calls[-1]["input"]] == [
            ("system", 1), ("user", 2), ("assistant", "Nice to meet you, Ana."), ("user", 1)]
        started = (await store.read(result.run_id))[0].payload
        assert started.history == tuple(history) and started.input == (TextBlock("Who am I?"),)
        with pytest.raises(ConfigError, match="one-off"):
            await deck.run("a", "hi", history=history, session_id="s1")
        with pytest.raises(ConfigError, match="only the text"):
            await deck.run("a", "hi", history=[kit.HistoryMessage("assistant", [ImageBlock("image/png", PNG)])])
        assert len(await store.runs()) == 1  # refused runs wrote nothing
    with pytest.raises(ContentError, match="role"):
        kit.HistoryMessage("tool", "42")


async def test_second_concurrent_turn_on_a_session_is_refused(store):
    release = threading.Event()  # tools play on the engine side: under trio, another thread

    def wait() -> str:
        release.wait(10)
        return "done"

    model = ScriptedModel([{"tool": "wait", "args": {}}, "finished", "again"])
    async with Deck([Agent("a", tools=[wait], model=model)], store=store) as deck:
        async with anyio.create_task_group() as tg:
            results = []

            async def first():
                results.append(await deck.run("a", "go", session_id="s"))

            tg.start_soon(first)
            with anyio.fail_after(10):
                while not await store.runs():
                    await anyio.sleep(0.01)
            [holder] = await store.runs()
            with pytest.raises(SessionBusyError) as busy:
                await deck.run("a", "me too", session_id="s")
            assert (busy.value.session_id, busy.value.run_id) == ("s", holder.run_id)
            release.set()
        assert len(await store.runs()) == 1
        again = await deck.run("a", "now", session_id="s")  # freed at the end of the first run
        assert again.output == "again"


async def test_namespaces_separate_sessions_and_factory_overrides(store):
    made = []

    def factory(session_id: str):
        made.append(session_id)
        return agents.SQLiteSession(session_id)

    model = ScriptedModel(["a", "b"])
    async with Deck([Agent("a", model=model)], store=store, session_factory=factory) as deck:
        await deck.run("a", "x", session_id="s", namespace="t1")
        await deck.run("a", "y", session_id="s", namespace="t2")
        assert made == ["t1\x1fs", "t2\x1fs"]
        assert "x" not in json.dumps(model.calls[-1]["input"])


async def test_a_session_factory_that_returns_no_session_is_refused_before_the_turn(store):
    """A factory that forgot its ``return`` had every turn run without a session, the
    conversation forgotten silently; an ``async def`` one failed each turn on its coroutine."""
    def forgot(session_id: str):
        agents.SQLiteSession(session_id)

    async def made_async(session_id: str):
        return agents.SQLiteSession(session_id)

    for factory, says in ((forgot, "returned NoneType, not a session"),
                          (made_async, "returned a coroutine")):
        model = ScriptedModel(["Hi Ana.", "You are Ana."])
        async with Deck([Agent("a", model=model)], store=store, session_factory=factory) as deck:
            for text in ("I am Ana", "Who am I?"):
                with pytest.raises(ConfigError, match=rf"session_factory\('s1'\) {says}"):
                    await deck.run("a", text, session_id="s1")
            with pytest.raises(ConfigError, match=says):
                deck.session_for("s1")
            assert not model.calls  # no model call either
    assert await store.runs() == []  # refused turns wrote nothing


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
async def test_no_session_id_reaches_a_namespaced_conversation(monkeypatch, store, tmp_path,
                                                                request, kind):
    """A namespaced session's key was ``<namespace>:<session_id>``: a caller without one (every
    HTTP caller) naming ``tenant-a:s1`` read and wrote tenant-a's conversation s1, and two turns
    could play on it at once (claims are per namespace and id)."""
    if kind != "memory":
        prefix = f"t{uuid.uuid4().hex[:8]}"
        monkeypatch.setenv("KIT_SESSION", f"sqlite:///{tmp_path / 's.db'}" if kind == "sqlite"
                           else request.getfixturevalue("redis_url"))
    else:
        prefix = "tenant"
    model = ScriptedModel(["noted", "who?"])
    async with Deck([Agent("a", model=model)], store=store) as deck:
        await deck.run("a", "my PIN is 4321", session_id="s1", namespace=prefix)
        await deck.run("a", "what is my PIN?", session_id=f"{prefix}:s1")
        assert "4321" not in json.dumps(model.calls[-1]["input"])
        assert len(await deck.session_for("s1", namespace=prefix).get_items()) == 2
        assert len(await deck.session_for(f"{prefix}:s1").get_items()) == 2


async def test_redis_session(monkeypatch, store, redis_url):
    import redis
    r = redis.Redis.from_url(redis_url)
    for key in r.scan_iter("kit:session:*"):
        r.delete(key)
    monkeypatch.setenv("KIT_SESSION", redis_url)
    model = ScriptedModel(["Hi Ana.", "You are Ana."])
    async with Deck([Agent("a", model=model)], store=store) as deck:
        await deck.run("a", "I am Ana", session_id="conv-1")
        await deck.run("a", "Who am I?", session_id="conv-1")
        session = deck.session_for("conv-1")  # under trio, its methods play on the engine loop
        assert type(getattr(session, "session", session)).__name__ == "RedisSession"
        assert len(await session.get_items()) == 4
        assert "I am Ana" in json.dumps(model.calls[-1]["input"])
    stored = [json.loads(x) for x in r.lrange("kit:session:conv-1:messages", 0, -1)]
    assert [i.get("role") for i in stored] == ["user", "assistant", "user", "assistant"]
    r.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_durable_sessions_outlive_the_deck(monkeypatch, store, tmp_path, request, kind):
    """KIT_SESSION=sqlite:///path (the SDK's SQLiteSession) and postgresql:// (its
    SQLAlchemySession, in the URL's schema): a conversation goes on in a deck opened later."""
    url = (f"sqlite:///{tmp_path / 'sessions.db'}" if kind == "sqlite"
           else request.getfixturevalue("postgres_url"))
    monkeypatch.setenv("KIT_SESSION", url)
    model = ScriptedModel(["Hi Ana.", "You are Ana."])
    async with Deck([Agent("a", model=model)], store=store) as deck:
        await deck.run("a", "I am Ana", session_id="conv-1")
        from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
        session = deck.session_for("conv-1")  # under trio, its methods play on the engine loop
        assert isinstance(getattr(session, "session", session), {
            "sqlite": agents.SQLiteSession, "postgres": SQLAlchemySession}[kind])
        # (under trio this raised "no running event loop": the SDK's sessions need asyncio's)
        assert [i.get("role") for i in await session.get_items()] == ["user", "assistant"]
    async with Deck([Agent("a", model=model)], store=store) as deck:
        await deck.run("a", "Who am I?", session_id="conv-1")
    said = [(i.get("role"), str(i.get("content"))) for i in model.calls[-1]["input"]]
    assert [r for r, _ in said] == ["user", "assistant", "user"] and "I am Ana" in said[0][1]


async def test_a_session_setting_that_cannot_work_is_named_when_the_deck_opens(
        monkeypatch, store, tmp_path):
    """A sqlite:/// file in a missing directory failed every session turn with a bare
    OperationalError (a 500), and a Redis URL with a bad port the open with a bare ValueError."""
    monkeypatch.setenv("KIT_SESSION", f"sqlite:///{tmp_path / 'new' / 'dir' / 'sessions.db'}")
    async with Deck([Agent("a", model=ScriptedModel(["ok"], cycle=True))], store=store) as deck:
        await deck.run("a", "hi", session_id="s")  # its directory is made, as KIT_STORE's
    assert (tmp_path / "new" / "dir" / "sessions.db").is_file()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KIT_SESSION", f"sqlite:///{tmp_path / 'file' / 'sessions.db'}")
    with pytest.raises(ConfigError, match="KIT_SESSION=sqlite:///.*cannot open the file"):
        async with Deck([Agent("a", model=ScriptedModel(["ok"]))], store=store):
            pass
    monkeypatch.setenv("KIT_SESSION", "redis://:PW1@127.0.0.1:notaport/0")
    with pytest.raises(ConfigError, match="not a Redis URL") as info:
        async with Deck([Agent("a", model=ScriptedModel(["ok"]))], store=store):
            pass
    assert "PW1" not in str(info.value)


async def test_a_session_file_takes_no_descriptor_per_conversation(monkeypatch, store, tmp_path):
    """KIT_SESSION=sqlite:///path: every conversation shares one connection to the file (the
    SDK's SQLiteSession alone opens one per conversation per worker thread)."""
    monkeypatch.setenv("KIT_SESSION", f"sqlite:///{tmp_path / 'sessions.db'}")
    monkeypatch.setenv("KIT_SESSION_MAX", "5")
    model = ScriptedModel(["ok"], cycle=True)
    async with Deck([Agent("a", model=model)], store=store) as deck:
        await deck.run("a", "first", session_id="s0")
        before = len(os.listdir("/proc/self/fd"))
        for n in range(1, 41):
            await deck.run("a", f"hi {n}", session_id=f"s{n}")
        assert len(os.listdir("/proc/self/fd")) <= before + 2
        await deck.run("a", "again", session_id="s0")  # long evicted: the file kept it
        assert said(model) == ["first", "ok", "again"]


async def test_postgres_sessions_share_their_tables_objects(monkeypatch, store, postgres_url):
    """KIT_SESSION=postgresql://: a conversation's session object is small (the SDK builds
    its tables' SQLAlchemy objects per session, ~31 kB each)."""
    import tracemalloc
    monkeypatch.setenv("KIT_SESSION", postgres_url)
    async with Deck([Agent("a", model=ScriptedModel(["ok"], cycle=True))], store=store) as deck:
        kept = [deck.session_for("s0")]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            kept += [deck.session_for(f"s{n}") for n in range(1, 201)]
            per_session = (tracemalloc.get_traced_memory()[0] - before) / 200
        finally:
            tracemalloc.stop()
        assert per_session < 4_000
        await deck.run("a", "hi", session_id="s7")
        assert [i.get("role") for i in await kept[7].get_items()] == ["user", "assistant"]


def test_a_session_url_of_another_kind_is_refused_with_its_password_masked(monkeypatch):
    import kit_sessions
    with pytest.raises(ConfigError, match=r"KIT_SESSION must be") as info:
        kit_sessions.Sessions("mysql://u:s3cret@h/db", None)
    assert "s3cret" not in str(info.value)


async def test_a_run_outlives_postgres_dropping_its_connections(postgres_url, anyio_backend):
    """The writer retries a batch whose connection died (its commit may or may not have
    happened): the run completes and its log has every seq once."""
    from test_kit_store import kill_connections
    reply = " ".join(f"w{i}" for i in range(400))
    async with store_from_url(postgres_url) as store:
        async with Deck([Agent("a", model=ScriptedModel([reply]))], store=store) as deck:
            kills = 0
            with anyio.fail_after(60):
                async for event in deck.stream("a", "go", committed=True):
                    if event.kind == "text.delta" and event.seq % 50 == 0:  # the writers' pool
                        kills += await anyio.to_thread.run_sync(kill_connections, postgres_url,
                                                                "kit-write")
            log = await store.read(event.run_id)
    assert kills and event.kind == "run.completed"
    assert [e.seq for e in log] == list(range(len(log))) and log[-1].kind == "run.completed"
    assert sum(e.kind == "text.delta" for e in log) == 400


def said(model: ScriptedModel) -> list[str]:
    """The text of each item the model was sent on its last call (a tool call: ``call:<name>``,
    its result: ``result:<output>``)."""
    out = []
    for item in model.calls[-1]["input"]:
        if item.get("type") == "function_call":
            out.append(f"call:{item['name']}")
        elif item.get("type") == "function_call_output":
            out.append(f"result:{item['output']}")
        else:
            content = item["content"]
            out.append(content if isinstance(content, str) else content[0]["text"])
    return out


async def test_history_limit_sends_the_latest_items_and_the_session_keeps_them_all(store):
    replies = ["r1", "r2", "r3", "r4"]
    own, inherits, whole = (ScriptedModel(replies) for _ in range(3))
    deck = Deck([Agent("own", model=own, history_limit=2),  # the agent's own beats the deck's
                 Agent("inherits", model=inherits)], store=store, history_limit=3)
    async with deck:
        for n in (1, 2, 3):
            await deck.run("own", f"t{n}", session_id="s-own")
            await deck.run("inherits", f"t{n}", session_id="s-inherits")
        # the fourth turn streams: every surface plays the same limited turn
        assert [e async for e in deck.stream("own", "t4", session_id="s-own")][-1].kind == "run.completed"
        await deck.run("inherits", "t4", session_id="s-inherits")
        assert said(own) == ["t3", "r3", "t4"]  # the last 2 items, then the new input
        assert said(inherits) == ["r2", "t3", "r3", "t4"]  # the deck's 3
        for session in ("s-own", "s-inherits"):  # the session still stores every item
            items = await deck.session_for(session).get_items()
            assert [i.get("role") for i in items] == ["user", "assistant"] * 4
    async with Deck([Agent("whole", model=whole)], store=store) as deck:  # no limit: all of it
        for n in (1, 2, 3, 4):
            await deck.run("whole", f"t{n}", session_id="s-whole")
        assert said(whole) == ["t1", "r1", "t2", "r2", "t3", "r3", "t4"]


async def test_a_history_limit_never_sends_a_tool_result_without_its_call(store):
    script = [{"tool": "add", "args": {"a": 1, "b": 2}}, "r1", "r2"]
    cut, whole = ScriptedModel(script), ScriptedModel(script)
    async with Deck([Agent("cut", tools=[add], model=cut, history_limit=2),
                     Agent("whole", tools=[add], model=whole, history_limit=3)], store=store) as deck:
        for name in ("cut", "whole"):
            await deck.run(name, "t1", session_id=name)  # stores: t1, call, result, r1
            await deck.run(name, "t2", session_id=name)
        assert said(cut) == ["r1", "t2"]  # the window [result, r1] lost the call: result left out
        assert said(whole) == ["call:add", "result:3", "r1", "t2"]
        assert len(await deck.session_for("cut").get_items()) == 6


async def test_a_headless_run_with_a_session_honours_the_agents_history_limit(tmp_path):
    model = ScriptedModel(["r1", "r2", "r3"])
    agent = Agent("a", model=model, history_limit=2)
    session = agents.SQLiteSession("conv", tmp_path / "sessions.db")
    for n in (1, 2, 3):
        await agent.run(f"t{n}", session=session)
    assert said(model) == ["t2", "r2", "t3"]
    assert len(await on_asyncio(session.get_items)) == 6  # the SDK's session: asyncio only
    session.close()


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True])
def test_a_history_limit_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match=rf"agent 'a': history_limit must be a positive int or None, got {bad!r}"):
        Agent("a", history_limit=bad)
    with pytest.raises(ConfigError, match=rf"Deck\(history_limit=...\) must be a positive int or None, got {bad!r}"):
        Deck(history_limit=bad)
    assert Agent("a", history_limit=1).history_limit == 1 and Agent("a").history_limit is None
    with pytest.raises(ConfigError, match=rf"agent 'a': max_turns must be a positive int or None, got {bad!r}"):
        Agent("a", max_turns=bad)


async def test_max_turns_caps_a_runs_model_calls(store):
    """The SDK's default is 10 model calls a run; ``Agent(max_turns=)`` moves it, on deck runs
    and headless ones (whose own ``max_turns=`` wins)."""
    loop = [{"tool": "add", "args": {"a": 1, "b": 2}}] * 11 + ["done"]
    long, short = Agent("long", tools=[add], model=ScriptedModel(loop), max_turns=12), \
        Agent("short", tools=[add], model=ScriptedModel(loop), max_turns=2)
    async with Deck([long, short], store=store) as deck:
        assert (await deck.run("long", "go")).output == "done"
        with pytest.raises(agents.MaxTurnsExceeded):
            await deck.run("short", "go")
    [failed] = [e for e in await store.read((await store.runs(name="short"))[-1].run_id)
                if e.kind == "run.failed"]
    assert failed.payload.error == "MaxTurnsExceeded"
    assert len([e for e in await store.read((await store.runs(name="short"))[-1].run_id)
                if e.kind == "model.completed"]) == 2
    headless = Agent("h", tools=[add], model=ScriptedModel(loop, cycle=True), max_turns=2)
    with pytest.raises(agents.MaxTurnsExceeded):
        await headless.run("go")
    assert (await headless.run("go", max_turns=20)).final_output == "done"
    # A headless run's own max_turns is checked as the agent's is: 0 failed every run with
    # MaxTurnsExceeded, True ran one of 1, "3" broke in the SDK with a TypeError.
    for bad in (0, -1, True, "3"):
        with pytest.raises(ConfigError, match=f"max_turns must be a positive int or None, got {bad!r}"):
            await headless.run("go", max_turns=bad)


# --------------------------------------------------------------------------- run endings ----

async def test_leaving_a_stream_early_never_ends_the_run(store):
    async with Deck([Agent("a", model=ScriptedModel(["w " * 50]))], store=store) as deck:
        stream = deck.stream("a", "go")
        first = await stream.__anext__()
        await stream.aclose()
        with anyio.fail_after(10):
            while await deck.status(first.run_id) is RunStatus.RUNNING:
                await anyio.sleep(0.01)
        assert kinds(await store.read(first.run_id))[-1] == "run.completed"


async def test_closing_the_deck_cancels_running_turns(store):
    started = threading.Event()

    async def forever() -> str:
        started.set()
        await anyio.sleep_forever()

    deck = Deck([Agent("a", tools=[forever], model=ScriptedModel([{"tool": "forever"}]))], store=store)
    async with deck:
        stream = deck.stream("a", "go")
        run_id = (await stream.__anext__()).run_id
        assert await anyio.to_thread.run_sync(started.wait, 10)
    with anyio.fail_after(10):
        rest = [e.kind async for e in stream]
    assert rest[-1] == "run.cancelled"
    log = await store.read(run_id)
    assert log[-1].payload == kit.RunCancelled("the deck closed")


async def test_a_cancelled_caller_cancels_its_run(store):
    async def slow() -> str:
        await anyio.sleep(30)
        return "late"

    async with Deck([Agent("a", tools=[slow], model=ScriptedModel([{"tool": "slow"}]))],
                    store=store) as deck:
        with anyio.move_on_after(0.5):
            await deck.run("a", "go", run_id="r-cancel")
        with anyio.fail_after(10):
            while await deck.status("r-cancel") is RunStatus.RUNNING:
                await anyio.sleep(0.01)
        assert (await store.read("r-cancel"))[-1].payload == kit.RunCancelled("the caller was cancelled")


async def test_a_run_cut_short_mid_tool_ends_its_call_before_its_own_end(store):
    """A run whose caller was cancelled while its tool ran: the log had the call's
    ``tool.started``, then ``run.cancelled``, and never a ``tool.completed``."""
    entered = threading.Event()

    async def slow() -> str:
        entered.set()
        await anyio.sleep_forever()
        return "late"

    async with Deck([Agent("a", tools=[slow], model=ScriptedModel([{"tool": "slow"}, "x"]))],
                    store=store) as deck:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(deck.run, "a", "go", run_id="cut"))
                assert await anyio.to_thread.run_sync(entered.wait, 10)
                tg.cancel_scope.cancel()
            while await deck.status("cut") is RunStatus.RUNNING:
                await anyio.sleep(0.01)
        log = await store.read("cut")
    assert kinds(log) == ["run.started", "model.completed", "tool.started", "tool.completed",
                          "run.cancelled"]
    assert log[3].payload == kit.ToolCompleted(
        log[2].payload.call_id, "slow", "error: cancelled: the caller was cancelled", True)
    assert log[4].payload == kit.RunCancelled("the caller was cancelled")


async def test_a_caller_cancelled_before_its_run_reaches_the_engine_ends_it_at_once(store):
    """Under trio, a run whose caller was cancelled before its engine task started (a task
    group cancelled right after ``start_soon``) had its asyncio task cancelled unstarted: the
    engine recorded no end (the run stayed RUNNING until its lease lapsed) and the caller
    waited out the bridge's CANCEL_TIMEOUT (10 s). The run's tool never returns: under trio the
    engine plays on another thread, where a run that could finish might beat the cancel."""
    async def wait() -> str:
        await anyio.sleep_forever()
        return "never"

    model = ScriptedModel([{"tool": "wait"}, "x"])
    async with Deck([Agent("a", tools=[wait], model=model),
                     Agent("b", model=ScriptedModel(["x"]))], store=store) as deck:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(deck.run, "a", "go")
                tg.cancel_scope.cancel()
            [info] = await store.runs()
            assert (await store.read(info.run_id))[-1].payload == kit.RunCancelled(
                "the caller was cancelled")
            assert (await deck.run("b", "next")).output == "x"


async def test_a_reused_run_id_is_refused(store):
    async with Deck([Agent("a", model=ScriptedModel(["x", "y"]))], store=store) as deck:
        await deck.run("a", "go", run_id="same")
        with pytest.raises(kit.LogConflictError):
            await deck.run("a", "go", run_id="same")
        assert kinds(await store.read("same")) == ["run.started", "text.delta", "message.completed",
                                                   "model.completed", "run.completed"]


class CountingStore(SQLiteStore):
    """The real SQLite store, noting what each append (one transaction) held."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.batches: list[list[str]] = []

    async def append(self, events, *, claims=()):
        self.batches.append([e.kind for e in events])
        return await super().append(events, claims=claims)


async def test_a_run_id_from_new_run_id_costs_no_extra_commit_and_a_callers_own_is_checked_first(
        tmp_path, monkeypatch):
    # No background commit mid-turn (a loaded machine's turn can outlast FLUSH_DELAY): the
    # batches are the ones kit asks for, a turn's end committing at once.
    monkeypatch.setattr(kit_writer, "FLUSH_DELAY", 30.0)
    async with CountingStore(tmp_path / "count.db") as store, Deck(
            [Agent("a", model=ScriptedModel(["x"], cycle=True))], store=store) as deck:
        run_id = kit.new_run_id()
        await deck.run("a", "go", run_id=run_id)
        assert store.batches == [["run.started", "text.delta", "message.completed",
                                  "model.completed", "run.completed"]]
        store.batches.clear()
        await deck.run("a", "go", run_id="mine")  # a caller's id may be taken: its start first
        assert store.batches == [["run.started"], ["text.delta", "message.completed",
                                                   "model.completed", "run.completed"]]
        with pytest.raises(kit.LogConflictError):  # refused before the model is called
            await deck.run("a", "go", run_id=str(run_id))
        assert kinds(await store.read(run_id)) == ["run.started", "text.delta", "message.completed",
                                                   "model.completed", "run.completed"]


class GatedModel(ScriptedModel):
    """A model whose call waits until ``gate`` is set (a threading.Event: under trio the model
    plays on the bridge's asyncio loop)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()

    async def get_response(self, *args, **kw):
        while not self.gate.is_set():
            await anyio.sleep(0.005)
        return await super().get_response(*args, **kw)


async def test_a_runs_buffered_start_commits_within_flush_delay_while_it_plays(store):
    """A new run's run.started rides in its first group commit; while its model call lasts,
    the writer commits it on its own FLUSH_DELAY after it was buffered (the loop's timer under
    asyncio, the writer task's wait under trio), not only at the run's end."""
    model = GatedModel(["done"])
    async with Deck([Agent("a", model=model)], store=store) as deck:
        run_id = kit.new_run_id()  # (no caller's id to check first: the start is buffered)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(deck.run, "a", "go", run_id=run_id))
            with anyio.fail_after(10):
                while not await store.read(run_id):
                    await anyio.sleep(0.005)
            assert kinds(await store.read(run_id)) == ["run.started"]
            assert await deck.status(run_id) is kit.RunStatus.RUNNING
            model.gate.set()
        assert kinds(await store.read(run_id))[-1] == "run.completed"


async def test_the_warm_up_at_open_leaves_nothing_in_the_log_or_with_observers(tmp_path):
    from test_kit_observers import Recorder
    seen = Recorder()
    async with CountingStore(tmp_path / "warm.db") as store, Deck(
            [Agent("a", model=ScriptedModel(["x"]))], store=store, observers=[seen]):
        pass  # open ran kit_agents.warm_up: a throwaway SDK run with a tool call
        assert await store.runs() == []
    assert store.batches == [] and seen.seen == []


_PRICES_AT_OPEN = """
import sys, anyio, kit
async def main():
    async with kit.Deck([kit.Agent("a", model={model})]) as deck:
        loaded = "genai_prices.data" in sys.modules
        priced = (await deck.run("a", "hi")).usage.usd is not None if {plays} else "-"
    print(loaded, priced)
anyio.run(main)
"""


@pytest.mark.parametrize("model, plays, expected", [
    ("kit.ScriptedModel(['hi'])", True, "False False"),  # no table holds 'scripted'
    ("kit.ScriptedModel(['hi'], name='gpt-4o-mini')", True, "True True"),
    ("'gpt-4o-mini'", False, "True -"),  # a name: priced at open without building a client
], ids=["scripted-default", "scripted-named", "named-model-no-key"])
def test_the_warm_up_loads_the_price_table_only_for_a_model_it_may_hold(model, plays, expected):
    """genai-prices' table takes ~0.1 s to load: a deck whose models no table holds (a
    ScriptedModel's default name) never loads it; one with a priced model loads it at open,
    not on its first turn."""
    code = _PRICES_AT_OPEN.format(model=model, plays=plays)
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "KIT_MODEL")}
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True,
                         timeout=120, env={**env, "KIT_STORE": "memory"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == expected.split()


async def test_settings_store_is_built_and_closed_by_the_deck(tmp_path, monkeypatch):
    db = tmp_path / "from-settings.db"
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{db}")
    async with Deck([Agent("a", model=ScriptedModel(["hi"]))]) as deck:
        result = await deck.run("a", "x")
    script = ("import anyio, sys; from kit_store import SQLiteStore\n"
              "async def main():\n"
              f"    async with SQLiteStore({str(db)!r}) as s:\n"
              f"        print(' '.join(str(e.seq) + ':' + e.kind for e in await s.read({result.run_id!r})))\n"
              "anyio.run(main)")
    out = subprocess.run([sys.executable, "-c", script], cwd=HERE, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["0:run.started", "1:text.delta", "2:message.completed", "3:model.completed",
                   "4:run.completed"]


async def test_bad_settings_are_config_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("KIT_STORE", "mysql://x")
    with pytest.raises(ConfigError, match="mysql"):
        async with Deck():
            pass
    monkeypatch.setenv("KIT_STORE", "memory")
    monkeypatch.setenv("KIT_OPENAI_API", "grpc")  # read by a deck with an agent
    with pytest.raises(ConfigError, match="KIT_OPENAI_API"):
        async with Deck([Agent("a", model=ScriptedModel(["x"]))]):
            pass
    monkeypatch.delenv("KIT_OPENAI_API")
    for name, bad, says in (("KIT_SESSION_MAX", "0", "a positive integer"),
                            ("KIT_SESSION_MAX", "1e3", "a positive integer"),
                            ("KIT_SESSION_MAX", "²", "a positive integer"),
                            ("KIT_LEASE_SECONDS", "soon", "a number of seconds"),
                            ("KIT_STORE_DOWN_SECONDS", "-5", "positive")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match=rf"{name} must be {says}, got '{bad}'"):
            async with Deck([Agent("a", model=ScriptedModel(["x"]))]):
                pass
        monkeypatch.delenv(name)
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{tmp_path / 'kit.db'}")  # read for a SQLite log
    monkeypatch.setenv("KIT_SQLITE_SYNC", "sometimes")
    with pytest.raises(ConfigError, match=r"KIT_SQLITE_SYNC must be NORMAL or FULL, got 'sometimes'"):
        async with Deck([Agent("a", model=ScriptedModel(["x"]))]):
            pass
    monkeypatch.setenv("KIT_STORE", "memory")
    monkeypatch.delenv("KIT_SQLITE_SYNC")
    monkeypatch.setenv("KIT_SESSION_MAX", " ")  # exported but empty: unset, like KIT_HISTORY_LIMIT
    async with Deck([Agent("a", model=ScriptedModel(["x"]))]) as deck:
        assert (await deck.run("a", "hi", session_id="s")).output == "x"


async def test_an_empty_kit_store_is_unset_and_a_bad_one_is_named(monkeypatch, tmp_path):
    """``KIT_STORE=`` (exported but empty, as a compose file or a .env template leaves it) is the
    default store, as unset is; a URL kit cannot use is refused naming the setting."""
    for empty in ("", " "):
        monkeypatch.setenv("KIT_STORE", empty)
        async with Deck([Agent("a", model=ScriptedModel(["x"]))]) as deck:
            assert (await deck.run("a", "hi")).output == "x"
    bundle = tmp_path / "proj" / "agents" / "a" / "agent.py"
    bundle.parent.mkdir(parents=True)
    bundle.write_text("import kit\nagent = kit.Agent('a', model=kit.ScriptedModel(['x']))\n")
    async with Deck.from_project(tmp_path / "proj") as deck:  # the project's own log
        await deck.run("a", "hi")
    assert (tmp_path / "proj" / ".state" / "kit.db").exists()
    for bad in ("mysql://x", "sqlite:///", "postgresql://u:hunter2@h/db?schema=a-b"):
        monkeypatch.setenv("KIT_STORE", bad)
        with pytest.raises(ConfigError, match="^KIT_STORE: ") as info:
            async with Deck():
                pass
        assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("url, modules, extra", [
    ("redis://127.0.0.1:6379/15", ["redis"], "redis"),
    # SQLAlchemy without psycopg (installed for something else): a ModuleNotFoundError once
    ("postgresql://127.0.0.1/test?schema=kit_missing_extra", ["psycopg", "psycopg.conninfo"],
     "postgres")])
async def test_a_missing_extra_is_named(monkeypatch, url, modules, extra):
    monkeypatch.setenv("KIT_STORE", "memory")
    monkeypatch.setenv("KIT_SESSION", url)
    for module in modules:  # as if the extra were not installed
        monkeypatch.setitem(sys.modules, module, None)
    scheme = url.split(":")[0]
    with pytest.raises(ConfigError, match=rf"KIT_SESSION={scheme}://\.\.\. needs the {extra} "
                                          rf"extra: pip install 'kit\[{extra}\]'"):
        async with Deck([Agent("a")]):
            pass


async def test_memory_store_is_the_default(monkeypatch):
    monkeypatch.delenv("KIT_STORE", raising=False)
    async with Deck([Agent("a", model=ScriptedModel(["hi"]))]) as deck:
        result = await deck.run("a", "x")
        assert isinstance(deck.store, MemoryStore)
        assert await deck.status(result.run_id) is RunStatus.COMPLETED


# ------------------------------------------------------------------------------ headless ----

async def test_headless_agent_run_returns_the_sdk_result():
    agent = Agent("a", tools=[add], model=ScriptedModel([{"tool": "add", "args": {"a": 1, "b": 2}}, "3"]))
    result = await agent.run("1+2?")
    assert isinstance(result, agents.RunResult) and result.final_output == "3"


async def test_headless_context_tool_refuses_and_the_model_is_told():
    def needs(ctx: Context[dict]) -> str:
        return "never"

    agent = Agent("a", tools=[needs], model=ScriptedModel([{"tool": "needs"}, "carried on"]))
    result = await agent.run("go")  # SPEC 7: the tool refuses, the run goes on
    assert result.final_output == "carried on"
    [told] = [i.output for i in result.new_items if isinstance(i, agents.ToolCallOutputItem)]
    assert "the run carries NoneType rather than a run context" in told


# ------------------------------------------------------------------------- across processes ----

CHILD = """
import os, sys, threading, anyio, kit
from kit_store import SQLiteStore

def block() -> str:
    threading.Event().wait()  # until the process is killed

async def main():
    async with SQLiteStore(sys.argv[1]) as store:
        deck = kit.Deck([kit.Agent("a", tools=[block], model=kit.ScriptedModel([{"tool": "block"}]))],
                        store=store)
        async with deck:
            async for ev in deck.stream("a", "go", session_id="s"):
                if ev.kind == "tool.started":
                    print(ev.run_id, flush=True)

anyio.run(main)
"""


async def test_a_session_claim_holds_across_processes_and_lapses_when_its_owner_dies(tmp_path, monkeypatch):
    db = tmp_path / "shared.db"
    env = {**os.environ, "KIT_LEASE_SECONDS": "0.6", "PYTHONPATH": str(HERE)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(db)], stdout=subprocess.PIPE,
                             text=True, env=env, cwd=HERE)
    try:
        with anyio.fail_after(30):
            child_run = (await anyio.to_thread.run_sync(child.stdout.readline)).strip()
        assert child_run
        monkeypatch.setenv("KIT_LEASE_SECONDS", "0.6")
        async with SQLiteStore(db) as store:
            async with Deck([Agent("a", model=ScriptedModel(["mine now"]))], store=store) as deck:
                await anyio.sleep(1.0)  # longer than the lease: the live owner keeps renewing it
                with pytest.raises(SessionBusyError) as busy:
                    await deck.run("a", "me too", session_id="s")
                assert busy.value.run_id == child_run
                child.kill()
                child.wait(10)
                await anyio.sleep(0.8)  # the dead owner's lease lapses
                result = await deck.run("a", "me too", session_id="s")
                assert result.output == "mine now"
                log = await store.read(child_run)
                assert log[-1].payload == kit.RunFailed(
                    "RunAbandoned", "the process playing this run stopped renewing its lease")
                assert await deck.status(child_run) is RunStatus.FAILED
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()


async def test_a_stalled_stream_catches_up_from_the_log(store, monkeypatch):
    import kit_runs
    monkeypatch.setattr(kit_runs, "LIVE_MAX", 4)  # a tiny live buffer: the consumer lags
    words = " ".join(f"w{i}" for i in range(40))
    async with Deck([Agent("a", model=ScriptedModel([words]))], store=store) as deck:
        stream = deck.stream("a", "go")
        first = await stream.__anext__()
        with anyio.fail_after(10):  # do not read while the run plays to its end
            while await deck.status(first.run_id) is RunStatus.RUNNING:
                await anyio.sleep(0.01)
        rest = [e async for e in stream]
    events = [first] + rest
    assert [e.seq for e in events] == list(range(len(events)))
    assert events == await store.read(first.run_id)
    assert "".join(e.payload.text for e in events if e.kind == "text.delta") == words


async def test_a_stalled_stream_catches_up_a_page_at_a_time(shared_url, tmp_path, monkeypatch):
    """A stream that fell LIVE_MAX events behind caught up by reading the rest of the run's
    log in one read: the backlog of a long run, whole in memory (one per lagging reader). It
    reads a page (READ_PAGE) at a time now, each yielded before the next is read; every event
    still comes once, in order, across the pages' seams."""
    import kit_runs
    from kit_pg import PostgresStore
    from kit_storebase import READ_PAGE
    from test_kit_store import counting
    monkeypatch.setattr(kit_runs, "LIVE_MAX", 4)  # a tiny live buffer: the consumer lags
    base, arg = ((PostgresStore, shared_url) if shared_url.startswith("postgresql") else
                 (SQLiteStore, tmp_path / "kit.db"))
    words = " ".join(f"w{i}" for i in range(2 * READ_PAGE + 50))
    async with counting(base)(arg) as store, Deck([Agent("a", model=ScriptedModel([words]))],
                                                  store=store) as deck:
        stream = deck.stream("a", "go")
        first = await stream.__anext__()
        with anyio.fail_after(20):  # do not read while the run plays to its end
            while await deck.status(first.run_id) is RunStatus.RUNNING:
                await anyio.sleep(0.01)
            store.sizes.clear()
            rest = [e async for e in stream]
        sizes = list(store.sizes)
        log = await store.read(first.run_id)
    events = [first] + rest
    assert len(log) > 2 * READ_PAGE and events == log
    assert len(sizes) >= 3 and max(sizes) <= READ_PAGE, sizes


async def test_a_stalled_stream_of_a_store_whose_read_takes_no_limit_catches_up_whole(
        tmp_path, monkeypatch):
    """A store whose ``read`` takes no ``limit`` (the user's own, written to the old port) is
    read whole by a lagged reader, as before: every event still comes once, in order."""
    import kit_runs
    from kit_storebase import READ_PAGE

    class OldRead(SQLiteStore):
        async def read(self, run_id, after=-1):
            return await super().read(run_id, after)
    monkeypatch.setattr(kit_runs, "LIVE_MAX", 4)
    words = " ".join(f"w{i}" for i in range(READ_PAGE + 50))
    async with OldRead(tmp_path / "kit.db") as store, Deck(
            [Agent("a", model=ScriptedModel([words]))], store=store) as deck:
        stream = deck.stream("a", "go")
        first = await stream.__anext__()
        with anyio.fail_after(20):
            while await deck.status(first.run_id) is RunStatus.RUNNING:
                await anyio.sleep(0.01)
            rest = [e async for e in stream]
        assert [first] + rest == await store.read(first.run_id)


# ----------------------------------------------------------------------------- the bridge ----

@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_mailbox_batch_taken_before_its_wake_up_leaves_the_next_batch_its_own(monkeypatch):
    """Under trio a short run's events are taken at its end (``Runtime._played``), before the
    delayed wake-up its first event armed. That wake-up was its batch's: the next run's first
    event waits for its own, a whole WAKE_DELAY (the old one took it mid-run, early, and woke
    the trio side once more per run for it)."""
    import kit_bridge
    monkeypatch.setattr(kit_bridge, "WAKE_DELAY", 0.2)
    bridge, delivered = kit_bridge.Bridge(), []

    def handle(item: str) -> None:
        delivered.append((item, anyio.current_time()))

    bridge.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(bridge.pump, handle)
            bridge.loop.call_soon_threadsafe(bridge.post, "a")  # a run's first event ...
            await anyio.sleep(0.1)
            assert bridge.take() == ["a"]  # ... taken at its end, 0.1 s before its wake-up
            posted = anyio.current_time()
            bridge.loop.call_soon_threadsafe(bridge.post, "b")  # the next run's first event
            with anyio.fail_after(10):
                while not delivered:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    finally:
        await bridge.stop()
    [(item, at)] = delivered
    assert item == "b" and at - posted >= 0.15  # its own wake-up, not a's (0.1 s after posted)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_call_whose_caller_is_cancelled_already_cancels_its_task_after_its_first_step():
    """A caller cancelled before its ``Bridge.call`` starts gets its asyncio task cancelled
    right after the task's first step. The cancel was sent by a second crossing, once the trio
    thread had the GIL back: the loop's thread, woken by the start, held it through the first
    step (here 50 ms of work; an SDK turn is a few ms), and the job went on to its end: a run
    whose caller was cancelled before it began played on and was recorded as completed."""
    import asyncio
    import time

    import kit_bridge
    bridge, seen = kit_bridge.Bridge(), []

    async def job() -> None:
        began = time.perf_counter()
        while time.perf_counter() - began < 0.05:  # its first step holds the loop's thread
            pass
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        seen.append("finished")

    bridge.start()
    try:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await bridge.call(job)
    finally:
        await bridge.stop()
    assert seen == ["cancelled"]


@pytest.mark.parametrize("data", [[1, 2], "text", 3, None, {"data": [1]}, {"z": {"y": [None]}}])
def test_an_unknown_kinds_payload_of_any_json_value_round_trips_unchanged(data):
    # A row of a newer kit's kind (or a hand-written one) holds whatever JSON its writer chose:
    # a list or a string came back wrapped as {"data": ...}.
    ev = Event.from_json({"run_id": "r", "seq": 3, "kind": "x.new", "payload": data})
    assert ev.payload == kit.UnknownEvent("x.new", data)
    again = Event.from_json(json.loads(json.dumps(ev.to_json())))
    assert again.payload == ev.payload and again.to_json()["payload"] == data


@pytest.mark.parametrize("obj, field, says", [
    ({"kind": "text.delta", "payload": {}}, "text", "its payload has no 'text'"),
    ({"kind": "text.delta", "payload": {"txt": "a"}}, "text", "its payload has no 'text'"),
    ({"kind": "text.delta", "payload": [1, 2]}, "payload", "its payload is a JSON list"),
    ({"kind": "tool.started", "payload": "call"}, "payload", "its payload is a JSON str"),
    ({"kind": "run.completed", "payload": {"usage": {"input_tokens": "many"}}}, "usage",
     "its payload's 'usage' is malformed"),
    ({"kind": "run.completed", "payload": {"usage": [1]}}, "usage", "'usage' is malformed"),
    ({"kind": "run.started", "payload": {"name": "a", "invocable": "agent", "input": [5]}},
     "input", "its payload's 'input' is malformed"),
    ({"kind": "text.delta", "payload": {"text": "a"}, "at": "yesterday"}, "at", "its time"),
    ({"kind": "text.delta", "payload": {"text": "a"}, "seq": "first"}, "seq", "its seq"),
])
def test_a_known_kind_with_a_missing_or_mistyped_field_names_run_seq_kind_and_field(obj, field, says):
    # Was a bare TypeError ("TextDelta.__init__() missing 1 required positional argument"),
    # a ValueError or an AttributeError from deep inside the payload's constructor.
    with pytest.raises(kit.CorruptEventError) as info:
        Event.from_json({"run_id": "run-7", "seq": 4, **obj})
    err = info.value
    assert isinstance(err, kit.KitError) and isinstance(err, ValueError)
    assert (err.run_id, err.kind, err.field) == ("run-7", obj["kind"], field)
    assert "run 'run-7'" in str(err) and obj["kind"] in str(err) and says in str(err), str(err)
    if field != "seq":
        assert "the event at seq 4 " in str(err)


def test_an_event_without_its_envelope_says_what_it_lacks():
    with pytest.raises(kit.CorruptEventError, match="it has no kind"):
        Event.from_json({"run_id": "r", "seq": 0, "payload": {}})
    with pytest.raises(kit.CorruptEventError, match="of run 'r' .* it has no seq"):
        Event.from_json({"run_id": "r", "kind": "text.delta", "payload": {"text": "a"}})
    with pytest.raises(kit.CorruptEventError, match="it is a JSON list, not an object"):
        Event.from_json([1])


async def test_an_error_quoting_a_megabyte_name_stays_short_and_names_its_start():
    # The unknown name (or setting, or id) was quoted whole: a 1 MB name made a 1 MB message,
    # log line and HTTP answer.
    big = "agent-" + "x" * 1_000_000
    async with Deck([Agent("a", model=ScriptedModel(["hi"]))]) as deck:
        with pytest.raises(kit.UnknownNameError) as unknown:
            await deck.run(big, "hi")
        with pytest.raises(ConfigError) as session:
            await deck.run("a", "hi", session_id=[big])
    with pytest.raises(ConfigError) as name:
        Agent(big)
    with pytest.raises(ConfigError) as limit:
        Deck([Agent("a")], history_limit=big)
    with pytest.raises(ConfigError) as count:
        kit.core.count_setting("KIT_SESSION_MAX", big)
    for info in (unknown, session, name, limit, count):
        said = str(info.value)
        assert len(said) < 4000 and "'agent-xxxx" in said, said[:300]
        assert "more characters)" in said, said[-300:]
    assert unknown.value.name == big  # the fact itself, for a program, is whole
    assert len(str(kit.SessionBusyError(big, "r1", big))) < 4000
    assert len(str(kit.UnknownRunError(big))) < 4000


async def test_a_tools_megabyte_error_is_cut_for_the_model_and_its_tool_completed_row():
    # A tool's exception message went whole to the model and into the log's tool.completed.
    def explode() -> str:
        """Fail with a huge message."""
        raise ValueError("boom " + "y" * 1_000_000)

    model = ScriptedModel([{"tool": "explode", "args": {}}, "it failed"])
    async with MemoryStore() as store:
        async with Deck([Agent("a", tools=[explode], model=model)], store=store) as deck:
            with anyio.fail_after(30):
                result = await deck.run("a", "go")
        [done] = [e for e in await store.read(result.run_id) if e.kind == "tool.completed"]
    assert result.output == "it failed" and done.payload.is_error
    said = done.payload.output
    assert said.startswith("error: ValueError: boom yyyy") and len(said) < 2100, said[:100]
    assert said.endswith(f"... ({len('error: ValueError: boom ') + 1_000_000 - 2000:,} more "
                         "characters cut)"), said[-100:]


async def test_a_runs_megabyte_failure_is_recorded_cut_saying_so():
    # run.failed kept the first 2,000 characters of a huge message without saying it was cut.
    model = ScriptedModel([SystemError("boom " + "z" * 1_000_000)])
    async with MemoryStore() as store:
        async with Deck([Agent("a", model=model)], store=store) as deck:
            with anyio.fail_after(30), pytest.raises(SystemError):  # the caller's, whole
                await deck.run("a", "go", run_id="r-huge")
        failed = (await store.read("r-huge"))[-1]
    assert failed.kind == "run.failed" and failed.payload.error == "SystemError"
    said = failed.payload.message
    assert said.startswith("boom zzz") and len(said) < 2100, said[:100]
    assert said.endswith(f"... ({len('boom ') + 1_000_000 - 2000:,} more characters cut)"), said[-100:]


async def test_a_tool_can_run_another_invocable_through_the_deck(store, anyio_backend):
    """Under trio a tool plays on the engines' asyncio loop: its ``await deck.run(...)`` was
    refused (DeckStateError) with a hint that it came from another thread's loop and should
    call ``anyio.from_thread.run``, which would have deadlocked that loop. It runs the other
    agent now, as under asyncio; what a tool cannot reach (a session, whose object lives on the
    kit side) is refused, saying what to do."""
    deck: Deck
    refused: list[str] = []

    async def ask_helper(question: str) -> str:
        """Ask the helper agent."""
        try:
            deck.session_for("h")
        except kit.DeckStateError as exc:  # (under asyncio a tool may: same loop)
            refused.append(str(exc))
        result = await deck.run("helper", question, session_id="h")
        return f"helper says: {result.output}"

    main = Agent("main", tools=[ask_helper],
                 model=ScriptedModel([{"tool": "ask_helper", "args": {"question": "hi"}}, "done"]))
    helper = Agent("helper", model=ScriptedModel(["glad to help"], cycle=True))
    async with Deck([main, helper], store=store) as deck:
        with anyio.fail_after(20):
            result = await deck.run("main", "go")
        assert result.output == "done"
        log = await store.read(result.run_id)
        [done] = [e for e in log if e.kind == "tool.completed"]
        assert done.payload.output == "helper says: glad to help"
        [info] = await store.runs(name="helper")
        assert info.session_id == "h" and info.status is RunStatus.COMPLETED
        assert kinds(await store.read(info.run_id))[-1] == "run.completed"
        assert (await deck.run("helper", "again", session_id="h")).output == "glad to help"
    if anyio_backend == "trio":
        [message] = refused
        assert "use deck.session_for from a tool under trio" in message, message
        assert "call deck.session_for outside the tool" in message, message
    else:
        assert refused == []


async def test_a_tool_can_stream_another_agent_through_the_deck(store):
    """Under trio a tool's ``deck.stream(...)`` was refused (DeckStateError: "stream or read the
    log outside the tool"). It streams now, as under asyncio: the tool sees the child run's
    events live, the same as the log holds them, and returns its deltas."""
    deck: Deck
    seen: list[list[Event]] = []

    async def ask_helper(question: str) -> str:
        """Ask the helper agent."""
        events = [event async for event in deck.stream("helper", question)]
        seen.append(events)
        return "".join(e.payload.text for e in events if e.kind == "text.delta")

    main = Agent("main", tools=[ask_helper],
                 model=ScriptedModel([{"tool": "ask_helper", "args": {"question": "hi"}}, "done"]))
    helper = Agent("helper", model=ScriptedModel(["glad to help you today"]))
    async with Deck([main, helper], store=store) as deck:
        with anyio.fail_after(20):
            result = await deck.run("main", "go")
        assert result.output == "done"
        [done] = [e for e in await store.read(result.run_id) if e.kind == "tool.completed"]
        assert done.payload.output == "glad to help you today"
        [events] = seen
        [info] = await store.runs(name="helper")
        assert info.status is RunStatus.COMPLETED
        assert events == await store.read(info.run_id)
        assert kinds(events)[0] == "run.started" and kinds(events)[-1] == "run.completed"


async def test_a_tool_streaming_a_failed_run_gets_its_run_failed_then_its_error(store):
    """A run that fails, streamed by a tool, yields ``run.failed`` and then raises its error in
    the tool, under trio as under asyncio (the error crosses after the events before it)."""
    deck: Deck

    async def ask_broken(question: str) -> str:
        """Ask the broken agent."""
        seen = []
        try:
            async for event in deck.stream("broken", question):
                seen.append(event.kind)
        except ValueError as exc:
            return f"{seen[-1]} then {type(exc).__name__}: {exc}"
        return "no error"

    main = Agent("main", tools=[ask_broken],
                 model=ScriptedModel([{"tool": "ask_broken", "args": {"question": "hi"}}, "done"]))
    broken = Agent("broken", model=ScriptedModel([ValueError("the model broke")]))
    async with Deck([main, broken], store=store) as deck:
        with anyio.fail_after(20):
            result = await deck.run("main", "go")
        [done] = [e for e in await store.read(result.run_id) if e.kind == "tool.completed"]
        assert done.payload.output == "run.failed then ValueError: the model broke"


async def test_a_tool_that_leaves_a_stream_early_leaves_the_run_to_play_on(store):
    """A tool that breaks out of ``deck.stream(...)`` after the first delta (or closes it) ends
    its stream, not the run: the child run completes in the log, under asyncio and trio."""
    deck: Deck
    got: list[str] = []

    async def ask_helper(question: str, close: bool) -> str:
        """Ask the helper agent."""
        stream = deck.stream("helper", question)
        if close:
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    if event.kind == "text.delta":
                        break
        else:
            async for event in stream:
                if event.kind == "text.delta":
                    break
        got.append(event.payload.text)
        return "left early"

    calls = [{"tool": "ask_helper", "args": {"question": "hi", "close": close}}
             for close in (False, True)]
    main = Agent("main", tools=[ask_helper], model=ScriptedModel([calls[0], "done", calls[1], "done"]))
    helper = Agent("helper", model=ScriptedModel(["one two three four"], cycle=True))
    async with Deck([main, helper], store=store) as deck:
        with anyio.fail_after(20):
            for _ in calls:
                assert (await deck.run("main", "go")).output == "done"
            assert got == ["one", "one"]
            for info in await store.runs(name="helper"):
                ends = [e async for e in store.follow(info.run_id)]
                assert ends[-1].kind == "run.completed", kinds(ends)
                assert ends[-1].payload.output == "one two three four"
        assert len(await store.runs(name="helper")) == 2


async def test_a_tool_answers_a_waiting_workflow_through_a_stream(store):
    """``deck.stream_answer(...)`` in a tool streams the answered run's events, under trio as
    under asyncio (it takes the path ``deck.stream`` does)."""
    deck: Deck

    async def ask(state: dict) -> dict:
        return {"answer": kit.interrupt("approve?")}

    graph = StateGraph(dict)
    graph.add_node("ask", ask)
    graph.add_edge("__start__", "ask")

    async def approve(run_id: str) -> str:
        """Approve a waiting run."""
        return " ".join(e.kind for e in [e async for e in deck.stream_answer(run_id, "yes")])

    main = Agent("main", tools=[approve], model=ScriptedModel([{"tool": "approve",
                                                                 "args": {"run_id": "w-run"}}, "ok"]))
    async with Deck([main], [kit.Workflow("w", graph)], store=store) as deck:
        with anyio.fail_after(20):
            parked = await deck.run("w", {}, run_id="w-run")
            assert isinstance(parked, kit.InterruptResult)
            result = await deck.run("main", "go")
        [done] = [e for e in await store.read(result.run_id) if e.kind == "tool.completed"]
        assert done.payload.output == "run.resumed node.updated run.completed", done.payload.output
        assert (await store.read("w-run"))[-1].payload.output == {"answer": "yes"}


async def test_a_tool_can_read_the_log_through_the_deck_store(store):
    """Under trio ``deck.store`` was refused in a tool (DeckStateError). A tool lists runs, reads
    and follows a run's events through it, as under asyncio."""
    deck: Deck

    async def last_helper_run() -> str:
        """Describe the helper's last run."""
        [info] = await deck.store.runs(name="helper", limit=1)
        read = await deck.store.read(info.run_id)
        followed = [e async for e in deck.store.follow(info.run_id, after=0)]
        assert followed == read[1:]
        return f"{info.status.value} {read[-1].payload.output} {len(read)}"

    main = Agent("main", tools=[last_helper_run],
                 model=ScriptedModel([{"tool": "last_helper_run"}, "done"]))
    helper = Agent("helper", model=ScriptedModel(["glad to help"]))
    async with Deck([main, helper], store=store) as deck:
        with anyio.fail_after(20):
            helped = await deck.run("helper", "hi")
            result = await deck.run("main", "go")
        n = len(await store.read(helped.run_id))
        [done] = [e for e in await store.read(result.run_id) if e.kind == "tool.completed"]
        assert done.payload.output == f"COMPLETED glad to help {n}", done.payload.output


@pytest.mark.parametrize("call", ["run", "stream"])
async def test_a_cancelled_caller_goes_on_once_what_its_tool_called_is_settled(store, call):
    """A caller cancelled while its run's tool calls the deck: a run the tool started
    (``deck.run``) ends with the tool's run, its run.cancelled in the log before the caller
    goes on; a run the tool streams (``deck.stream``) plays on to its end, only the stream
    ends (under trio the call, or the stream, plays on the kit side, for the tool's run)."""
    entered, release = threading.Event(), threading.Event()
    deck: Deck

    def wait() -> str:
        """Wait for the test."""
        entered.set()
        release.wait(10)
        return "waited"

    async def ask_helper(question: str) -> str:
        """Ask the helper agent."""
        if call == "run":
            return (await deck.run("helper", question)).output
        return "".join([str(e.seq) async for e in deck.stream("helper", question)])

    main = Agent("main", tools=[ask_helper],
                 model=ScriptedModel([{"tool": "ask_helper", "args": {"question": "hi"}}, "done"]))
    helper = Agent("helper", tools=[wait], model=ScriptedModel([{"tool": "wait"}, "helped"]))
    try:
        async with Deck([main, helper], store=store) as deck:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(functools.partial(deck.run, "main", "go", session_id="m"))
                    assert await anyio.to_thread.run_sync(entered.wait, 10)
                    tg.cancel_scope.cancel()
                runs = {r.name: r.status for r in await store.runs()}  # read before anything else
                release.set()
                if call == "run":
                    assert runs == {"main": RunStatus.CANCELLED, "helper": RunStatus.CANCELLED}, runs
                    assert (await deck.run("helper", "again")).output == "helped"
                else:
                    assert runs["main"] is RunStatus.CANCELLED, runs
                    [helped] = await store.runs(name="helper")
                    ends = [e async for e in store.follow(helped.run_id)]
                    assert ends[-1].kind == "run.completed" and ends[-1].payload.output == "helped"
    finally:
        release.set()
