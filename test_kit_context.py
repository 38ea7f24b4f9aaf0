"""Tests of the application context: delivered by reference everywhere, checked at build against
the declared type (one case per row of SPEC 4.2), never written anywhere (asyncio and trio)."""
from __future__ import annotations

import collections.abc
import functools
import operator
import sqlite3
from datetime import datetime, timezone
from typing import Annotated, Any, Optional, Protocol, TypedDict, TypeVar, runtime_checkable

import agents
import anyio
import pytest
from langgraph.graph import END, START, StateGraph

import kit
import kit_errors
from kit import Agent, Context, ContextTypeError, Deck, ScriptedModel, Workflow
from kit_store import SQLiteStore
from test_kit_workflows import graph

pytestmark = pytest.mark.anyio
T = TypeVar("T")
NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)


class Base:
    pass


class Deps(Base):
    def __init__(self, secret: str = "") -> None:
        self.secret = secret

    def name(self) -> str:
        return "deps"


class Other:
    pass


@runtime_checkable
class Named(Protocol):
    def name(self) -> str: ...


class Unchecked(Protocol):  # not runtime-checkable: the runtime will not rule on it
    def name(self) -> str: ...


@runtime_checkable
class WithData(Protocol):  # a data member: issubclass() refuses to rule
    secret: str


def tool_requiring(annotation: Any):
    def needs(ctx, x: int) -> int:
        """A tool that wants the context."""
        return x
    needs.__annotations__ = {"ctx": annotation, "x": int, "return": int}
    return needs


# One case per row of SPEC 4.2: (requirement, the deck's declared type, verdict).
ROWS = [
    ("exact type", Context[Deps], Deps, "compatible"),
    ("exact type, another class", Context[Other], Deps, "incompatible"),
    ("a supertype", Context[Base], Deps, "compatible"),
    ("a subtype is not enough", Context[Deps], Base, "incompatible"),
    ("Context[Any]", Context[Any], Other, "compatible"),
    ("bare Context", Context, Other, "compatible"),
    ("runtime ABC, parameters ignored", Context[collections.abc.Mapping[str, int]], dict[str, str], "compatible"),
    ("runtime ABC, not one", Context[collections.abc.Mapping[str, Any]], list, "incompatible"),
    ("method-only runtime protocol, structurally", Context[Named], Deps, "compatible"),
    ("method-only runtime protocol, missing method", Context[Named], Other, "incompatible"),
    ("union, one arm fits", Context[Other | Deps], Deps, "compatible"),
    ("union, no arm fits", Context[Other | int], Deps, "incompatible"),
    ("a declared union, its exact type", Context[Deps | None], Deps | None, "compatible"),
    ("a declared Optional, its exact type", Context[Optional[Deps]], Optional[Deps], "compatible"),
    ("a declared union, each arm fits", Context[Base | None], Deps | None, "compatible"),
    ("a declared union, an arm misfits", Context[Deps], Deps | None, "incompatible"),
    ("protocol the runtime refuses to rule on", Context[Unchecked], Other, "deferred"),
    ("protocol with a data member", Context[WithData], Other, "deferred"),
    ("a TypeVar", Context[T], Other, "deferred"),
    ("a declared Any", Context[Deps], Any, "deferred"),
    ("an annotation kit cannot read", "Context[NotDefinedAnywhere]", Other, "deferred"),
    ("inside Annotated", Annotated[Context[Other], "the run"], Deps, "incompatible"),
    ("an Optional Context", Optional[Context[Base]], Deps, "compatible"),
    ("an Optional Context that misfits", Context[Other] | None, Deps, "incompatible"),
]


@pytest.mark.parametrize("row, required, provided, verdict", ROWS, ids=[r[0] for r in ROWS])
def test_build_time_check_one_case_per_row(row, required, provided, verdict):
    deck = Deck([Agent("a", tools=[tool_requiring(required)])], context=provided)
    try:
        if verdict == "incompatible":
            with pytest.raises(ContextTypeError) as err:
                deck.build()
            assert isinstance(err.value, kit.ConfigError)
            message = str(err.value)
            assert "tool needs of agent 'a'" in message
            assert kit_errors.type_name(provided) in message
        else:
            deck.build()  # compatible, or deferred to invocation
    finally:
        anyio.run(deck.aclose)


def test_an_sdk_tool_object_is_deferred_and_no_context_means_no_check():
    @agents.function_tool
    def sdk_tool(x: int) -> int:
        """An SDK tool."""
        return x

    deck = Deck([Agent("a", tools=[sdk_tool])], context=Other).build()
    anyio.run(deck.aclose)
    deck = Deck([Agent("a", tools=[tool_requiring(Context[Deps])])]).build()  # no context=
    anyio.run(deck.aclose)


def test_every_kind_of_site_is_named():
    def instructions(ctx: Context[Deps], agent) -> str:
        return "hi"

    class Hooks:
        async def on_start(self, ctx: Context[Deps], agent) -> None: ...

    async def node(state: dict, ctx: Context[Deps]) -> dict:
        return {}

    graph = StateGraph(dict).add_node("approve", node)
    graph.add_edge(START, "approve").add_edge("approve", END)
    outer = StateGraph(dict).add_node("inner", graph.compile())  # a compiled subgraph's node
    outer.add_edge(START, "inner").add_edge("inner", END)
    for catalog, site in (
            (dict(agents=[Agent("a", instructions)]),
             "instructions callable test_every_kind_of_site_is_named.<locals>.instructions of agent 'a'"),
            (dict(agents=[Agent("a", hooks=Hooks())]), "hook on_start of agent 'a'"),
            (dict(workflows=[Workflow("w", graph)]), "node approve of workflow 'w'"),
            (dict(workflows=[Workflow("w", outer)]), "node inner/approve of workflow 'w'")):
        deck = Deck(**catalog, context=Other)
        with pytest.raises(ContextTypeError, match=site) as err:
            deck.build()
        assert "requires a context of type Deps" in str(err.value)
        assert "provides Other" in str(err.value)
        anyio.run(deck.aclose)


def test_a_partial_is_checked_as_its_function_and_named_without_its_bound_arguments():
    # this module's annotations are strings (`from __future__ import annotations`): a partial's
    # are read from its function, as its tool schema reads them
    def fetch(ctx: Context[Deps], token: str, url: str) -> str:
        """Fetch a URL."""
        return url

    async def instructions(ctx: Context[Deps], agent) -> str:
        return "hi"

    for agent, site in ((Agent("a", tools=[functools.partial(fetch, token="sk-SECRET")]),
                         "tool fetch of agent 'a'"),
                        (Agent("a", functools.partial(instructions)),
                         "instructions callable .*instructions of agent 'a'")):
        deck = Deck([agent], context=Other)
        with pytest.raises(ContextTypeError, match=site) as err:
            deck.build()
        assert "sk-SECRET" not in str(err.value) and "functools" not in str(err.value)
        anyio.run(deck.aclose)


def test_a_callable_object_is_checked_by_its_call_method():
    class Approve:  # a node kept as an object (this module's annotations are strings)
        async def __call__(self, state: dict, ctx: Context[Deps]) -> dict:
            return {}

    graph = StateGraph(dict).add_node("approve", Approve())
    graph.add_edge(START, "approve").add_edge("approve", END)
    deck = Deck(workflows=[Workflow("w", graph)], context=Other)
    with pytest.raises(ContextTypeError, match="node approve of workflow 'w' requires a context "
                                               "of type Deps, but the deck provides Other"):
        deck.build()
    anyio.run(deck.aclose)


# -------------------------------------------------------------------------------- delivery ----

class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    wake_at: str


SEEN: list[Any] = []


async def review(state: State, ctx: Context[Deps]) -> dict:
    SEEN.append(ctx.data)
    verdict = kit.interrupt({"question": "ok?"})
    return {"log": [f"reviewed: {verdict}"]}


def sync_note(state: State, ctx: Context[Deps]) -> dict:  # a sync node: LangGraph runs it in a thread
    SEEN.append(ctx.data)
    return {"log": ["noted"]}


async def nap(state: State, ctx: Context) -> dict:
    SEEN.append(ctx.data)
    kit.sleep_until(datetime.fromisoformat(state["wake_at"]))
    return {"log": ["woke"]}


def flow(*nodes) -> StateGraph:
    return graph(*nodes, state=State)


async def test_nodes_get_the_context_by_reference_and_resumes_take_it_again(tmp_path):
    SEEN.clear()
    deps, later = Deps("first"), Deps("second")
    async with SQLiteStore(tmp_path / "kit.db") as store:
        wf = Workflow("review", flow(sync_note, review), durable=True)
        async with Deck(workflows=[wf], store=store, context=Deps) as deck:
            await deck.run("review", {"log": []}, session_id="t1", context=deps)
            assert SEEN == [deps, deps] and all(s is deps for s in SEEN)
            [p] = await deck.pending()
            await deck.answer(p.run_id, "yes", context=later)
            assert SEEN[-1] is later  # the interrupted node re-ran with the new context
            await deck.run("review", {"log": []}, session_id="t2", context=deps)
            [p] = await deck.pending()
            await deck.answer(p.run_id, "yes")  # omitted: None in the resumed run
            assert SEEN[-1] is None


async def test_a_context_inside_annotated_or_optional_is_given_the_run_context():
    def whoami(ctx: Annotated[Context[Deps], "the run"], x: int) -> str:
        return ctx.data.secret

    def node(state: State, ctx: Optional[Context[Deps]] = None) -> dict:
        return {"log": [ctx.data.secret]}

    model = ScriptedModel([{"tool": "whoami", "args": {"x": 1}}, "done"])
    agent = Agent("a", tools=[whoami], model=model)
    async with Deck([agent], [Workflow("w", flow(node))], context=Deps) as deck:
        run = await deck.run("a", "hi", context=Deps("s1"))
        [done] = [e.payload for e in await deck.store.read(run.run_id) if e.kind == "tool.completed"]
        assert (done.output, done.is_error) == ("s1", False)
        assert await deck.run("w", {"log": []}, context=Deps("s2")) == {"log": ["s2"]}


async def test_a_node_kept_as_an_object_gets_the_context(store):
    """A node that is an object with an ``async def __call__`` (LangGraph awaits those) was
    called without awaiting: every run failed with LangGraph's "Expected dict, got <coroutine>"."""
    class Review:
        async def __call__(self, state: State, ctx: Context[Deps]) -> dict:
            return {"log": [f"async {ctx.data.secret}"]}

    class Note:
        def __call__(self, state: State, ctx: Context[Deps]) -> dict:
            return {"log": [f"sync {ctx.data.secret}"]}

    g = StateGraph(State).add_node("review", Review()).add_node("note", Note())
    g.add_edge(START, "review").add_edge("review", "note").add_edge("note", END)
    async with Deck(workflows=[Workflow("w", g)], store=store, context=Deps) as deck:
        assert await deck.run("w", {"log": []}, context=Deps("s")) == {"log": ["async s", "sync s"]}


async def test_a_node_inside_a_compiled_subgraph_gets_the_context(store):
    """Nodes of a compiled subgraph (two levels down here) take the run's context, a resumed
    one the resume's; they failed with Python's TypeError for the missing ``ctx``."""
    async def greet(state: State, ctx: Context[Deps]) -> dict:
        return {"log": [f"hi {ctx.data.secret}"]}

    inner = StateGraph(State).add_node("greet", greet).add_node("review", review)
    inner.add_edge(START, "greet").add_edge("greet", "review").add_edge("review", END)
    middle = StateGraph(State).add_node("inner", inner.compile())
    middle.add_edge(START, "inner").add_edge("inner", END)
    outer = StateGraph(State).add_node("middle", middle.compile()).add_node("note", sync_note)
    outer.add_edge(START, "middle").add_edge("middle", "note").add_edge("note", END)
    SEEN.clear()
    async with Deck(workflows=[Workflow("w", outer, durable=True)], store=store,
                    context=Deps) as deck:
        parked = await deck.run("w", {"log": []}, session_id="t", context=Deps("a"))
        assert parked.payload == {"question": "ok?"}
        state = await deck.answer(parked.run_id, "yes", context=Deps("b"))
        assert state == {"log": ["hi a", "reviewed: yes", "noted"]}
    assert [deps.secret for deps in SEEN] == ["a", "b", "b"]


async def test_headless_workflow_reaching_a_context_node_raises_the_engines_type_error():
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'ctx'"):
        await Workflow("review", flow(review)).run({"log": []})


# --------------------------------------------------------------------------- never stored ----

MARKER = "kit-secret-7f3a9c1e-context-marker"


async def test_the_context_is_never_written_anywhere(tmp_path):
    SEEN.clear()
    deps = Deps(MARKER)
    seen_by: dict[str, Any] = {}

    def lookup(ctx: Context[Deps], key: str) -> str:
        """Look a key up."""
        seen_by["tool"] = ctx.data
        return f"value of {key}"

    async def instructions(ctx: Context[Deps], agent) -> str:
        seen_by["instructions"] = ctx.data
        return "Be brief."

    class Hooks:
        async def on_tool_end(self, ctx: Context[Deps], agent, tool, result) -> None:
            seen_by["hook"] = ctx.data

    model = ScriptedModel([{"tool": "lookup", "args": {"key": "k"}}, "done"])
    agent = Agent("a", instructions, tools=[lookup], hooks=Hooks(), model=model)
    db = tmp_path / "kit.db"
    async with SQLiteStore(db) as store:
        deck = Deck([agent], [Workflow("review", flow(review), durable=True),
                              Workflow("sleepy", flow(nap), durable=True)], store=store, context=Deps)
        async with deck:
            await deck.run("a", "find k", session_id="s1", context=deps)
            await deck.run("review", {"log": []}, session_id="r1", context=deps)
            [p] = await deck.pending()
            await deck.answer(p.run_id, "yes", context=deps)
            await deck.run("sleepy", {"log": [], "wake_at": NOW.isoformat()}, session_id="n1", context=deps)
            assert [t.thread_id for t in await deck.tick(NOW)] == ["n1"]
            assert SEEN[-2:] == [deps, None]  # tick carries no context
            sessions = deck._runtime.sessions.memory.db.iterdump()
            session_dump = "\n".join(sessions)
        assert all(v is deps for v in seen_by.values()) and set(seen_by) == {"tool", "instructions", "hook"}
        assert deps in SEEN
    assert "value of k" in session_dump  # the session store was written...
    assert MARKER not in session_dump  # ...and never with the context
    import kit_threads
    with sqlite3.connect(kit_threads.checkpoint_path(str(db))) as con:  # after the last close
        assert con.execute("SELECT COUNT(*) FROM checkpoints").fetchone()[0] > 0
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT COUNT(*) FROM events").fetchone()[0] > 0
    for f in tmp_path.iterdir():
        assert MARKER.encode() not in f.read_bytes(), f.name
