"""Observers on a real Deck: every event in log order, isolation, start failure, settings rules,
and the tracing observer end to end (asyncio and trio)."""
from __future__ import annotations

import agents
import anyio
import pytest
from langgraph.graph import END, START, StateGraph

import kit
from kit import Agent, Deck, DeckStateError, ScriptedModel, Workflow
from kit_store import MemoryStore
from kit_tracing import TracingObserver
from test_kit_observers import Blocked, Raising, Recorder
from test_kit_tracing import PK, SK, receiver  # noqa: F401  (the OTLP receiver fixture)
from test_kit_workflows import State, done, plan

pytestmark = pytest.mark.anyio


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def catalog():
    model = ScriptedModel([{"tool": "add", "args": {"a": 1, "b": 2}}, "three words here"], cycle=True)
    graph = StateGraph(State).add_node("plan", plan).add_node("done", done)
    graph.add_edge(START, "plan").add_edge("plan", "done").add_edge("done", END)
    return [Agent("a", tools=[add], model=model)], [Workflow("w", graph)]


async def test_observers_see_every_event_in_log_order_beside_raising_and_slow_ones():
    healthy, raising, slow = Recorder("healthy"), Raising(), Blocked()
    agents_, workflows = catalog()
    async with MemoryStore() as store:
        async with Deck(agents_, workflows, store=store, observers=[raising, slow, healthy]) as deck:
            first = await deck.run("a", "1+2?")
            streamed = [e async for e in deck.stream("a", "again")]
            await deck.run("w", {"log": []})
            # the slow observer is still blocked in its first event: runs were not held up
            with anyio.fail_after(10):
                while not slow.entered.is_set():
                    await anyio.sleep(0.005)
            slow.gate.set()
            runs = await store.runs()
            logged = [e for info in runs for e in await store.read(info.run_id)]
        # closing the deck delivered every backlog
    by_run = {}
    for e in healthy.seen:
        by_run.setdefault(e.run_id, []).append(e)
    assert {r: evs for r, evs in by_run.items()} == {
        info.run_id: [e for e in logged if e.run_id == info.run_id] for info in runs}
    assert len(healthy.seen) == len(logged) and first.run_id in by_run
    assert streamed[-1] in healthy.seen
    assert raising.calls >= 3  # it kept failing, and was disabled; nobody else noticed
    assert len(slow.seen) == len(logged)  # once unblocked, it caught up in order
    assert [e.seq for e in slow.seen if e.run_id == first.run_id] == list(
        range(len(by_run[first.run_id])))


async def test_an_observer_whose_start_raises_refuses_the_open():
    log: list[str] = []

    class Broken(Recorder):
        def start(self) -> None:
            raise RuntimeError("cannot start")

    deck = Deck(observers=[Recorder("first", log), Broken("second", log)])
    with pytest.raises(RuntimeError, match="cannot start"):
        async with deck:
            pass
    assert log == ["start first", "close first"]
    with pytest.raises(DeckStateError):
        await deck.run("a", "x")
    await deck.aclose()


class Unwound(BaseException):
    """What an observer's close() may raise that is no ``Exception``."""


@pytest.mark.parametrize("asynchronous", [False, True], ids=["close", "async close"])
async def test_an_observer_whose_close_raises_a_base_exception_still_lets_the_deck_close(
        asynchronous, caplog):
    """The exception left the hub's close, so the deck's close never left the Runtime's task
    group: its lease and control watchers ran on over a closed store (trio: "Nursery stack
    corrupted"). Now it is logged as a close() that raised, and the next observer is closed."""
    log: list[str] = []

    class Breaking(Recorder):
        if asynchronous:
            async def close(self) -> None:
                raise Unwound("cannot close")
        else:
            def close(self) -> None:
                raise Unwound("cannot close")

    agents_, _ = catalog()
    async with MemoryStore() as store:
        async with Deck(agents_, store=store, observers=[Recorder("first", log), Breaking("second")]) as deck:
            await deck.run("a", "1+2?")
        assert log == ["start first", "close first"]
        async with Deck(agents_, store=store, observers=()) as deck:  # the slot is free
            assert (await deck.run("a", "1+2?")).output == "three words here"
    assert "close() raised" in caplog.text
    assert "failed" not in caplog.text  # no watcher of the closed deck's ran on


def test_build_checks_observers():
    deck = Deck(observers=[object()])
    with pytest.raises(kit.ConfigError, match="observers"):
        deck.build()
    anyio.run(deck.aclose)


async def test_tracing_from_settings_and_none_with_an_empty_tuple(receiver, monkeypatch):  # noqa: F811
    monkeypatch.setenv("KIT_TRACING_PUBLIC_KEY", PK)
    monkeypatch.setenv("KIT_TRACING_SECRET_KEY", SK)
    monkeypatch.setenv("KIT_TRACING_HOST", receiver.host)
    agents_, _ = catalog()
    async with Deck(agents_, observers=()) as deck:
        await deck.run("a", "1+2?")
    assert receiver.requests == []  # () means none, even with the keys set
    agents_, _ = catalog()
    async with Deck(agents_) as deck:  # None: settings decide
        result = await deck.run("a", "1+2?")
    traces = receiver.traces()
    assert list(traces) == [TracingObserver.trace_id(result.run_id)]
    names = sorted(s.name for s in traces[TracingObserver.trace_id(result.run_id)])
    assert names == sorted(["invoke_agent a", "chat scripted", "execute_tool add", "chat scripted"])


async def test_naming_the_tracer_without_keys_is_a_config_error_at_open(monkeypatch):
    monkeypatch.delenv("KIT_TRACING_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("KIT_TRACING_SECRET_KEY", raising=False)
    deck = Deck(observers=[TracingObserver()]).build()  # build starts and contacts nothing
    with pytest.raises(kit.ConfigError):
        async with deck:
            pass
    await deck.aclose()


async def test_sdk_spans_through_a_deck_are_a_second_trace_per_run(receiver):  # noqa: F811
    observer = TracingObserver(sdk_spans=True, public_key=PK, secret_key=SK, host=receiver.host)
    agents_, _ = catalog()
    async with Deck(agents_, observers=[observer]) as deck:
        result = await deck.run("a", "1+2?", session_id="s1")
    traces = receiver.traces()
    semantic = traces.pop(TracingObserver.trace_id(result.run_id))
    assert {s.name for s in semantic} >= {"invoke_agent a", "execute_tool add"}
    [raw] = traces.values()  # the SDK's own spans, tagged with the kit run id
    [root] = [s for s in raw if not s.parent_span_id]
    tags = {a.key: a.value.string_value for a in root.attributes}
    assert (tags["kit.run_id"], tags["session.id"]) == (result.run_id, "s1")


class AppTraces(agents.TracingProcessor):
    """A trace processor of the application's own: the names of the traces it was given."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def on_trace_start(self, trace) -> None:
        self.names.append(trace.name)

    def on_trace_end(self, trace) -> None:
        pass

    def on_span_start(self, span) -> None:
        pass

    def on_span_end(self, span) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


async def test_sdk_spans_give_the_application_its_trace_processors_back_at_close(receiver):  # noqa: F811
    """A deck with sdk_spans=True takes the SDK's (process-wide) traces of its runs for its own;
    at close it left no trace processor: the SDK's default exporter and the application's own
    were gone for the rest of the process; while it was open, they got nothing."""
    from agents.tracing import get_trace_provider
    before = list(get_trace_provider()._multi_processor._processors)
    app = AppTraces()
    agents.set_trace_processors([app])
    try:
        observer = TracingObserver(sdk_spans=True, public_key=PK, secret_key=SK, host=receiver.host)
        async with Deck(catalog()[0], observers=[observer]) as deck:
            result = await deck.run("a", "1+2?")
            with agents.trace("the application's own, while the deck is open"):
                pass  # (it went to the deck's observer: lost to the application)
        assert app.names == ["the application's own, while the deck is open"]  # not the deck's
        with agents.trace("the application's own"):
            pass
        assert app.names[1:] == ["the application's own"]
        traces = receiver.traces()
        traces.pop(TracingObserver.trace_id(result.run_id))
        [raw] = traces.values()  # the deck's run's SDK trace only
        assert {a.key for s in raw for a in s.attributes} >= {"kit.run_id"}
    finally:
        agents.set_trace_processors(before)


class AppSpans(AppTraces):
    """The application's trace processor, recording the spans it is given too."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list = []

    def on_span_end(self, span) -> None:
        self.spans.append(span)


async def test_a_cancelled_tools_sdk_span_stays_the_decks(receiver):  # noqa: F811
    """A run cancelled while its tool runs: the SDK ends the tool's span once the tool has
    stopped, after the run's SDK trace ended, and that late span went to the application's trace
    processors (the SDK's default exporter sends it, the tool's input with it, to OpenAI), while
    the deck's tracer held it open until close and exported it as unfinished."""
    from agents.tracing import get_trace_provider
    before = list(get_trace_provider()._multi_processor._processors)
    app = AppSpans()

    async def slow(a: int) -> int:
        """Wait a little."""
        await anyio.sleep(0.3)
        return a

    agents.set_trace_processors([app])
    try:
        observer = TracingObserver(sdk_spans=True, public_key=PK, secret_key=SK, host=receiver.host)
        model = ScriptedModel([{"tool": "slow", "args": {"a": 1}}, "done"])
        async with Deck([Agent("a", tools=[slow], model=model)], observers=[observer]) as deck:
            with anyio.move_on_after(0.1):
                await deck.run("a", "go", run_id="r-cancelled")
            await anyio.sleep(0.6)  # the tool has stopped, and the SDK ended its span
        assert [s.span_data.type for s in app.spans] == []
        [raw] = [spans for spans in receiver.traces().values()
                 if any(a.key == "kit.layer" for s in spans for a in s.attributes)]
        [tool] = [s for s in raw if s.name == "execute_tool slow"]
        assert "kit.unfinished" not in {a.key for a in tool.attributes}
    finally:
        agents.set_trace_processors(before)


async def test_an_observer_whose_repr_raises_is_accepted_and_named_by_its_type(caplog):
    """kit named observers by their ``repr`` (the check at build, the stats, the log lines and
    thread names), so one whose ``__repr__`` raises (or ``__str__``) made the deck refuse to
    open with that error. Now it is named by its type: it gets every event, and its failures are
    logged naming its type, never its repr (which may raise, be huge, or show a key)."""

    class NoRepr(Recorder):
        def __repr__(self) -> str:
            raise RuntimeError("repr is broken")

        __str__ = __repr__

    class FailingNoRepr(NoRepr):
        def emit(self, event: kit.Event) -> None:
            raise ValueError("emit is broken")

    seen, failing = NoRepr(), FailingNoRepr()
    agents_, _ = catalog()
    with anyio.fail_after(30):
        async with MemoryStore() as store:
            async with Deck(agents_, store=store, observers=[seen, failing]) as deck:
                result = await deck.run("a", "1+2?")
            logged = [e.kind for e in await store.read(result.run_id)]
    assert [e.kind for e in seen.seen] == logged and logged[-1] == "run.completed"
    said = [r.getMessage() for r in caplog.records if r.name == "kit.observers"]
    assert any("FailingNoRepr" in m and "raised" in m for m in said), said
    assert all("repr is broken" not in m for m in said)
