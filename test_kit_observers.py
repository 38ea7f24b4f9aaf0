"""Tests of the observer fan-out (kit_observers): queues, failures, start/close, resolution rules."""
from __future__ import annotations

import logging
import threading

import anyio
import pytest

import kit
import kit_observers
from kit import Agent, ConfigError, Deck, Event, ScriptedModel, TextDelta
from kit_observers import DISABLE_AFTER, ObserverHub, check_observers, resolve_observers
from kit_store import MemoryStore
from kit_tracing import TracingObserver
from test_kit_tracing import play

pytestmark = pytest.mark.anyio
KEYS = {"KIT_TRACING_PUBLIC_KEY": "pk-lf-1", "KIT_TRACING_SECRET_KEY": "sk-lf-1"}


def events(n: int, run_id: str = "r1") -> list[Event]:
    return [Event(run_id, i, TextDelta(f"t{i}")) for i in range(n)]


class Recorder:
    """A healthy observer: records what it is given, and its lifecycle calls into ``log``."""

    def __init__(self, name: str = "rec", log: list[str] | None = None) -> None:
        self.name, self.log, self.seen = name, log if log is not None else [], []

    def __repr__(self) -> str:
        return self.name

    def emit(self, event: Event) -> None:
        self.seen.append(event)

    def start(self) -> None:
        self.log.append(f"start {self.name}")

    def close(self) -> None:
        self.log.append(f"close {self.name}")


class Raising:
    def __init__(self) -> None:
        self.calls = 0

    def emit(self, event: Event) -> None:
        self.calls += 1
        raise RuntimeError("broken observer")


class Blocked(Recorder):
    """A slow observer: every emit blocks until ``gate`` opens (a sync, thread-blocking emit)."""

    def __init__(self) -> None:
        super().__init__("blocked")
        self.gate, self.entered = threading.Event(), threading.Event()

    def emit(self, event: Event) -> None:
        self.entered.set()
        self.gate.wait(10)  # bounded: a bug must fail the test, not hang it
        self.seen.append(event)


async def until(predicate, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.001)


# -------------------------------------------------------------------------------- surface ----

def test_all_names_what_the_modules_define():
    for module in (kit_observers, __import__("kit_tracing")):
        assert isinstance(module.__all__, tuple)
        defined = {n for n, v in vars(module).items() if not n.startswith("_")
                   and (getattr(v, "__module__", None) == module.__name__ or n.isupper())}
        assert defined == set(module.__all__)


# ------------------------------------------------------------------------------ resolution ----

def test_resolve_observers_follows_the_spec_rules():
    assert resolve_observers(None, {}) == []
    assert resolve_observers(None, {"KIT_TRACING_PUBLIC_KEY": "pk"}) == []  # both keys, or none
    [tracer] = resolve_observers(None, {**KEYS, "KIT_TRACING_HOST": "http://127.0.0.1:1"})
    assert isinstance(tracer, TracingObserver) and tracer.sdk_spans is False
    assert resolve_observers((), KEYS) == []  # () means none, even with tracing configured
    a, b = Recorder("a"), Recorder("b")
    assert resolve_observers([a, b], KEYS) == [a, b]  # exactly those, in order: no tracer added
    with pytest.raises(ConfigError, match=r"observers\[1\]"):
        resolve_observers([a, object()], {})


def test_check_observers_names_the_bad_entry():
    check_observers(None)
    check_observers([Recorder(), TracingObserver()])

    class AsyncEmit:
        async def emit(self, event):
            pass

    class AsyncRunInfo(Recorder):
        async def run_info(self, info):
            pass

    for bad, message in [([Recorder(), 42], r"observers\[1\] \(int\) is not an observer"),
                         ([AsyncRunInfo()], r"async run_info"),
                         ([TracingObserver], r"is a class; pass an instance: TracingObserver"),
                         ([AsyncEmit()], r"async emit"),
                         (Recorder(), r"wrap it: observers=\[Recorder\(...\)\]"),
                         ("tracing", r"sequence"),
                         ({"a": Recorder()}, r"sequence")]:
        with pytest.raises(ConfigError, match=message):
            check_observers(bad)
    with pytest.raises(ConfigError, match="queue_size"):
        ObserverHub([], queue_size=0)


# ---------------------------------------------------------------------------------- fan-out ----

async def test_healthy_observer_gets_everything_in_order_beside_raising_and_blocked_ones():
    healthy, raising, blocked = Recorder(), Raising(), Blocked()
    hub = ObserverHub([raising, blocked, healthy], queue_size=16)
    sent = events(80)
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await hub.start(tg)
                for i in range(0, 80, 16):
                    # Emitting while `blocked` sits in a thread on its gate: if hub.emit (or the
                    # drain) ran an observer's emit on the loop, this would never return.
                    for ev in sent[i:i + 16]:
                        hub.emit(ev)
                    await until(lambda: len(healthy.seen) == i + 16
                                and hub.stats[0].errors + hub.stats[0].skipped == i + 16)
                assert blocked.entered.is_set() and not blocked.seen
                blocked.gate.set()
                await hub.close()
    finally:
        blocked.gate.set()
    r, b, h = hub.stats
    assert healthy.seen == sent and (h.emitted, h.delivered, h.dropped) == (80, 80, 0)
    # The blocked one cost its own backlog: one batch in its thread plus one full queue.
    assert b.emitted + b.dropped == 80 and b.dropped >= 80 - 2 * 16
    assert blocked.seen == sent[:b.emitted] and b.delivered == b.emitted
    # The raising one was counted, then disabled; its events were skipped, not retried each time.
    assert r.emitted == 80 and r.errors + r.skipped == 80 and r.disabled >= 1
    assert r.errors >= DISABLE_AFTER and raising.calls == r.errors


class Exiting:
    """An observer whose emit ends its program: ``sys.exit()`` in a library it calls."""

    def __init__(self, nonblocking: bool) -> None:
        self.nonblocking, self.calls = nonblocking, 0

    def emit(self, event: Event) -> None:
        self.calls += 1
        raise SystemExit(3)


async def test_an_observer_that_raises_systemexit_costs_no_run_and_no_other_observer():
    """A BaseException escaped the observer's delivery, ended the hub's drain task and with it
    the deck's task group: the runs in flight, the deck and every other observer went down."""
    rec, exiting = Recorder(), [Exiting(nonblocking=False), Exiting(nonblocking=True)]
    with anyio.fail_after(20):
        async with Deck([Agent("a", model=ScriptedModel(["ok"], cycle=True))],
                        observers=[*exiting, rec]) as deck:
            results = [await deck.run("a", "hi") for _ in range(3)]
            await until(lambda: [e.kind for e in rec.seen].count("run.completed") == 3)
    assert [r.output for r in results] == ["ok"] * 3
    assert all(e.calls >= 1 for e in exiting)


async def test_a_disabled_observer_is_retried_after_its_backoff():
    now = [0.0]

    class Flaky(Recorder):
        broken = True

        def emit(self, event):
            if self.broken:
                raise ValueError("down")
            super().emit(event)

    flaky = Flaky()
    hub = ObserverHub([flaky], clock=lambda: now[0])
    sent = events(20)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await hub.start(tg)
            for ev in sent[:5]:  # 3 failures disable it; 2 more are skipped
                hub.emit(ev)
            await until(lambda: hub.stats[0].errors + hub.stats[0].skipped == 5)
            s = hub.stats[0]
            assert (s.errors, s.skipped, s.disabled) == (DISABLE_AFTER, 5 - DISABLE_AFTER, 1)
            now[0] += kit_observers.RETRY_MIN  # the backoff passes: the next event is a trial
            hub.emit(sent[5])  # the trial fails: disabled again, for twice as long
            await until(lambda: hub.stats[0].disabled == 2)
            now[0] += kit_observers.RETRY_MIN
            hub.emit(sent[6])  # still within the doubled backoff: skipped
            await until(lambda: hub.stats[0].skipped == 3)
            flaky.broken = False
            now[0] += kit_observers.RETRY_MIN
            for ev in sent[7:]:
                hub.emit(ev)
            await until(lambda: len(flaky.seen) == 13)
            await hub.close()
    assert flaky.seen == sent[7:]
    s = hub.stats[0]
    assert (s.errors, s.skipped, s.disabled, s.delivered) == (DISABLE_AFTER + 1, 3, 2, 13)


async def test_drops_are_said_while_they_last_and_in_all_at_close(caplog):
    """A deck's user sees an observer's losses in the log only (SPEC 4.6 shows no queue): its
    first drop was logged, and no other, ever: a queue that overflowed once at start, then lost
    events for an hour, said nothing of the hour, and close said nothing of the total."""
    now, blocked = [0.0], Blocked()
    hub = ObserverHub([blocked], queue_size=1, clock=lambda: now[0])
    sent = events(30)
    try:
        with caplog.at_level(logging.WARNING, logger="kit.observers"), anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await hub.start(tg)
                hub.emit(sent[0])
                await until(blocked.entered.is_set)  # in its thread, on its gate
                for ev in sent[1:10]:  # one queued, eight dropped
                    hub.emit(ev)
                now[0] += kit_observers.REPORT_EVERY - 1
                hub.emit(sent[10])  # within the minute: counted, not said again
                now[0] += 1
                for ev in sent[11:]:  # a minute on, still dropping: said again
                    hub.emit(ev)
                blocked.gate.set()
                await hub.close()
    finally:
        blocked.gate.set()
    assert hub.stats[0].dropped == 28 and blocked.seen == sent[:2]
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(said) == 3, said
    assert "1 of its events dropped" in said[0] and "10 of its events dropped" in said[1]
    assert "28 of its events were dropped" in said[2]


async def test_start_failure_closes_the_started_observers_and_refuses_the_open():
    log: list[str] = []

    class BadStart(Recorder):
        async def start(self):  # an async start is awaited on the loop
            log.append("start bad")
            raise ConfigError("no keys")

    first, bad, third = Recorder("first", log), BadStart("bad", log), Recorder("third", log)
    hub = ObserverHub([first, bad, third])
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with pytest.raises(ConfigError, match="no keys"):
                await hub.start(tg)
    assert log == ["start first", "start bad", "close first"]
    hub.emit(events(1)[0])
    assert [s.dropped for s in hub.stats] == [1, 1, 1]
    await hub.close()  # idempotent after a refused start
    assert log == ["start first", "start bad", "close first"]


async def test_tracing_observer_without_keys_refuses_the_open(monkeypatch):
    monkeypatch.delenv("KIT_TRACING_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("KIT_TRACING_SECRET_KEY", raising=False)
    rec = Recorder()
    hub = ObserverHub([rec, TracingObserver()])
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with pytest.raises(ConfigError, match="KIT_TRACING_PUBLIC_KEY and KIT_TRACING_SECRET_KEY"):
                await hub.start(tg)
    assert rec.log == ["start rec", "close rec"]


async def test_close_delivers_the_backlog_then_closes_each_observer_once():
    log: list[str] = []

    class AsyncClose(Recorder):
        async def close(self):
            log.append(f"aclose {self.name}")
            raise RuntimeError("close failed")  # logged, never raised by hub.close

    a, b = Recorder("a", log), AsyncClose("b", log)
    hub = ObserverHub([a, b])
    sent = events(1000)
    hub.emit(sent[0])  # before start (no run exists yet): dropped and counted
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await hub.start(tg)
            for ev in sent:
                hub.emit(ev)
            await hub.close()
            await hub.close()
    assert a.seen == sent and b.seen == sent
    assert log == ["start a", "start b", "aclose b", "close a"]
    hub.emit(sent[0])  # after close: dropped and counted, never raised
    assert [(s.delivered, s.dropped) for s in hub.stats] == [(1000, 2), (1000, 2)]


async def test_close_abandons_an_observer_stuck_in_emit(monkeypatch):
    monkeypatch.setattr(kit_observers, "DRAIN_TIMEOUT", 0.05)
    stuck, rec = Blocked(), Recorder()
    hub = ObserverHub([stuck, rec])
    sent = events(3)
    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                await hub.start(tg)
                for ev in sent:
                    hub.emit(ev)
                await until(lambda: stuck.entered.is_set() and len(rec.seen) == 3)
                await hub.close()  # returns although stuck's emit never does
    finally:
        stuck.gate.set()
    assert stuck.log == ["start blocked", "close blocked"] and rec.seen == sent


async def test_a_real_deck_run_flows_through_the_hub_in_log_order():
    model = ScriptedModel([{"tool": "add", "args": {"a": 2, "b": 3}}, "The sum is 5."])

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    rec = Recorder()
    with anyio.fail_after(10):
        async with MemoryStore() as store:
            async with Deck([Agent("calc", "Add.", tools=[add], model=model)], store=store) as deck:
                result = await deck.run("calc", "what is 2 + 3?", session_id="s1")
            logged = await store.read(result.run_id)
            await play(rec, logged)
    assert rec.seen == logged
    assert [e.kind for e in rec.seen][:1] == ["run.started"] and rec.seen[-1].kind == "run.completed"
    assert {"model.completed", "tool.started", "tool.completed"} <= {e.kind for e in rec.seen}
    assert isinstance(rec.seen[-1].payload, kit.RunCompleted)


class Told(Recorder):
    """An observer that takes runs' index rows: what it was given, rows and events, in order."""

    def run_info(self, info) -> None:
        self.seen.append(info)


async def test_an_observer_is_told_the_index_row_of_a_run_another_process_played_before(tmp_path):
    """A run parked by one deck (a process) and answered by another: the second deck's
    observers saw its resume and end only, with nothing saying the run's name, kind, session,
    namespace or parent. One that has ``run_info`` is told the run's index row (``RunInfo``)
    first, then gets the events; one without it gets the events as before."""
    from langgraph.graph import END, START, StateGraph
    from kit import Workflow
    from kit_store import SQLiteStore
    from test_kit_tracing import Release, approve

    def release() -> Workflow:
        graph = StateGraph(Release).add_node("approve", approve)
        return Workflow("release", graph.add_edge(START, "approve").add_edge("approve", END),
                        durable=True)

    parked, told, plain = [], Told(), Recorder()
    with anyio.fail_after(30):
        for observers in ([], [told, plain]):  # a deck per process
            async with SQLiteStore(str(tmp_path / "kit.db")) as store:
                async with Deck(workflows=[release()], store=store, observers=observers) as deck:
                    if parked:
                        await deck.answer(parked[0].run_id, "yes")
                    else:
                        parked.append(await deck.run("release", {"log": []}, session_id="t1",
                                                     namespace="ns"))
                        await deck.run("release", {"log": []}, session_id="t2")  # parks too
    [info] = [i for i in told.seen if isinstance(i, kit.RunInfo)]
    assert told.seen[0] is info and told.seen[1:] == plain.seen
    assert (info.run_id, info.name, info.invocable, info.session_id, info.namespace) == (
        parked[0].run_id, "release", "workflow", "t1", "ns")
    assert [e.kind for e in plain.seen][-1] == "run.completed"
