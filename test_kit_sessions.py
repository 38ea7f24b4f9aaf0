"""Tests of the in-process sessions' bound (``KIT_SESSION_MAX``): evicting a conversation forgets
it, so one a live or parked run still needs is never evicted, and a turn refused at its claim
evicts none; and of what a turn leaves in its session (its items, written with its end)."""
from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path

import anyio
import pytest
from agents.memory import SessionABC

import kit
from kit import Agent, Deck, RunStatus, ScriptedModel
from kit_store import SQLiteStore
from test_kit import kinds, said
from test_kit_control import Gate, running_run_id, start_in_background

pytestmark = pytest.mark.anyio
HERE = Path(__file__).parent


def kept(deck) -> set[str]:
    """The conversations whose history the in-process sessions still hold."""
    db = deck._runtime.sessions.memory.db
    return {r[0] for r in db.execute("SELECT DISTINCT session FROM items")}


async def pause_on(deck, store, gate: Gate, session_id: str) -> str:
    """Start a turn on ``session_id``, pause it while its tool runs; its run id."""
    results: list = []
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await start_in_background(tg, deck, results, "worker", "go", session_id=session_id)
            await gate.until_entered()
            run_id = await running_run_id(store)
            await deck.pause(run_id)
            gate.release.set()
    assert results[0].status is RunStatus.PAUSED
    return run_id


async def test_a_paused_run_keeps_its_conversation_while_others_push_it_out(monkeypatch, store):
    """KIT_SESSION_MAX=2: turns on b and c while a's run is paused leave a's history, so the
    resumed run's model is sent a's earlier turns (it was sent none: a had been forgotten);
    once the run ends, a is evicted like any other conversation."""
    monkeypatch.setenv("KIT_SESSION_MAX", "2")
    gate = Gate()
    model = ScriptedModel(["noted", {"tool": "wait", "args": {"step": 1}}, "ok b", "ok c",
                           "all done", "ok d", "ok e"])
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store) as deck:
        await deck.run("worker", "remember 7", session_id="a")
        run_id = await pause_on(deck, store, gate, "a")
        await deck.run("worker", "b", session_id="b")
        await deck.run("worker", "c", session_id="c")
        with anyio.fail_after(20):
            produced = await deck.resume(run_id)
        assert produced[-1].payload.output == "all done"
        assert said(model) == ["remember 7", "noted", "go", "call:wait", "result:step 1 done"]
        await deck.run("worker", "d", session_id="d")
        await deck.run("worker", "e", session_id="e")
        assert kept(deck) == {"d", "e"} and len(deck._runtime.sessions) == 2


async def test_a_turn_in_flight_keeps_its_conversation_while_others_push_it_out(monkeypatch,
                                                                                store):
    """KIT_SESSION_MAX=2: turns on b and c while a's turn waits for its tool leave a's
    history, so a's next turn sends the model all of it (it lost the first turn's message)."""
    monkeypatch.setenv("KIT_SESSION_MAX", "2")
    gate = Gate()
    model = ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "ok b", "ok c", "done a",
                           "again a"])
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store) as deck:
        results: list = []
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await start_in_background(tg, deck, results, "worker", "go", session_id="a")
                await gate.until_entered()
                await deck.run("worker", "b", session_id="b")
                await deck.run("worker", "c", session_id="c")
                gate.release.set()
        assert results[0].output == "done a"
        await deck.run("worker", "again", session_id="a")
        assert said(model) == ["go", "call:wait", "result:step 1 done", "done a", "again"]


async def test_a_cancelled_paused_run_lets_its_conversation_go(monkeypatch, store):
    """KIT_SESSION_MAX=2: a paused run's conversation outlives turns on b and c (it was
    forgotten); once the parked run is cancelled, it is evicted like any other."""
    monkeypatch.setenv("KIT_SESSION_MAX", "2")
    gate = Gate()
    worker = Agent("worker", tools=[gate.wait_tool()],
                   model=ScriptedModel([{"tool": "wait", "args": {"step": 1}}]))
    plain = Agent("plain", model=ScriptedModel(["ok"], cycle=True))
    async with Deck([worker, plain], store=store) as deck:
        run_id = await pause_on(deck, store, gate, "a")
        await deck.run("plain", "b", session_id="b")
        await deck.run("plain", "c", session_id="c")
        assert "a" in kept(deck)
        await deck.cancel(run_id)
        await deck.run("plain", "d", session_id="d")
        await deck.run("plain", "e", session_id="e")
        assert kept(deck) == {"d", "e"} and len(deck._runtime.sessions) == 2


async def test_a_turn_refused_at_its_claim_evicts_no_conversation(monkeypatch, store):
    """KIT_SESSION_MAX=2: a turn refused because its session is busy (a run parked by an
    earlier deck holds it) or its run id is taken forgets no other conversation; each used to
    evict the least recently used one, whose next turn the model saw without its history."""
    gate = Gate()
    model = ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "unused"])
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store) as deck:
        await pause_on(deck, store, gate, "held")
    monkeypatch.setenv("KIT_SESSION_MAX", "2")
    model = ScriptedModel(["ok 1", "ok 2", "again 1", "more 2"])
    async with Deck([Agent("worker", model=model)], store=store) as deck:
        await deck.run("worker", "first", session_id="s1")
        taken = (await deck.run("worker", "second", session_id="s2")).run_id
        with pytest.raises(kit.LogConflictError):
            await deck.run("worker", "same id", session_id="s3", run_id=taken)
        await deck.run("worker", "again", session_id="s1")
        assert said(model) == ["first", "ok 1", "again"]
        with pytest.raises(kit.SessionBusyError):
            await deck.run("worker", "me too", session_id="held")
        await deck.run("worker", "more", session_id="s2")
        assert said(model) == ["second", "ok 2", "more"]


class SlowClaims(SQLiteStore):
    """The SQLite store, whose write of a claim on session ``a``, once ``slow``, waits for
    ``go``."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.slow, self.waiting, self.go = False, anyio.Event(), anyio.Event()

    async def append(self, events, *, claims=()):
        if self.slow and any(claim.session_id == "a" for claim in claims):
            self.waiting.set()
            await self.go.wait()
        return await super().append(events, claims=claims)  # (the runs its claims abandoned)


async def test_a_turn_keeps_its_conversation_while_its_claim_is_written(monkeypatch, tmp_path):
    """KIT_SESSION_MAX=2: sessions taken (``session_for``) while a's turn writes its claim
    leave a's history, so the model is sent a's first turn (it was forgotten meanwhile)."""
    monkeypatch.setenv("KIT_SESSION_MAX", "2")
    model = ScriptedModel(["noted", "again a"])
    async with SlowClaims(tmp_path / "kit.db") as store:
        async with Deck([Agent("worker", model=model)], store=store) as deck:
            await deck.run("worker", "remember 7", session_id="a")
            store.slow = True
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(functools.partial(deck.run, "worker", "again", session_id="a"))
                    await store.waiting.wait()
                    deck.session_for("b")
                    deck.session_for("c")
                    store.go.set()
            assert said(model) == ["remember 7", "noted", "again"]


async def test_the_in_process_conversations_outlive_a_deck_as_they_do_the_process(store):
    """Without KIT_SESSION, a conversation is lost when the process exits (SPEC 8), not when
    its deck closes: the next deck of the process (a notebook's next `async with Deck(...)`)
    sends the model its history, and resumes a run the last one paused with it. Each deck
    had its own in-memory database, closed with it: the history was gone."""
    gate = Gate()
    model = ScriptedModel(["noted", {"tool": "wait", "args": {"step": 1}}, "you said 7",
                           "all done"])
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store) as deck:
        await deck.run("worker", "remember 7", session_id="a")
        run_id = await pause_on(deck, store, gate, "b")
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store) as deck:
        await deck.run("worker", "what did I say?", session_id="a")
        assert said(model) == ["remember 7", "noted", "what did I say?"]
        with anyio.fail_after(20):
            await deck.resume(run_id)
        assert said(model) == ["go", "call:wait", "result:step 1 done"]
    async with Deck([Agent("worker", model=model)], store=store) as deck:
        assert len(await deck.session_for("a").get_items()) == 4  # a's two turns


async def test_the_bound_on_in_process_conversations_holds_across_decks(monkeypatch, store):
    """KIT_SESSION_MAX bounds the process's conversations, those of the decks before this
    one too: least recently used forgotten first."""
    monkeypatch.setenv("KIT_SESSION_MAX", "2")
    model = ScriptedModel(["ok"], cycle=True)
    async with Deck([Agent("worker", model=model)], store=store) as deck:
        for name in ("a", "b"):
            await deck.run("worker", name, session_id=name)
    async with Deck([Agent("worker", model=model)], store=store) as deck:
        await deck.run("worker", "c", session_id="c")
        assert kept(deck) == {"b", "c"} and len(deck._runtime.sessions) == 2


class Backend(SessionABC):
    """A session store of the application's (``Deck(session_factory=)``) that can go away."""

    items: dict[str, list] = {}
    down = False

    def __init__(self, key: str) -> None:
        self.session_id, self.session_settings = key, None

    async def get_items(self, limit=None):
        items = self.items.get(self.session_id, [])
        return list(items if limit is None else items[-limit:])

    slow: threading.Event | None = None  # set: a write waits (and says so by setting it)

    async def add_items(self, items):
        if self.down:
            raise ConnectionError("the session store is gone")
        if self.slow is not None:
            self.slow.set()
            await anyio.sleep(30)
        self.items.setdefault(self.session_id, []).extend(items)

    async def pop_item(self):
        return self.items.get(self.session_id, [None]).pop()

    async def clear_session(self):
        self.items.pop(self.session_id, None)


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_turn_whose_session_fails_its_write_fails_with_nothing_of_it_kept(
        monkeypatch, store, streamed):
    """A turn's items reach its session just before its end is committed: a session that
    fails that write fails the turn (run.failed, its error to the caller), never a
    run.completed the conversation lacks; the next turn is sent none of it."""
    monkeypatch.setattr(Backend, "items", {})
    model = ScriptedModel(["lost", "hello"])
    async with Deck([Agent("a", model=model)], store=store, session_factory=Backend) as deck:
        Backend.down = True
        try:
            with pytest.raises(ConnectionError):
                if streamed:
                    async for _ in deck.stream("a", "first", session_id="s"):
                        pass
                else:
                    await deck.run("a", "first", session_id="s")
        finally:
            Backend.down = False
        [info] = await store.runs(session_id="s")
        log = await store.read(info.run_id)
        assert (log[-1].kind, log[-1].payload.error) == ("run.failed", "ConnectionError")
        assert (await deck.run("a", "again", session_id="s")).output == "hello"
        assert said(model) == ["again"]


async def test_a_turn_cancelled_at_its_safe_point_stays_cancelled_when_its_session_fails(
        monkeypatch, store):
    """A cancel that stops a turn at its safe point while the session store is gone: the turn
    is cancelled, as asked (its items dropped), not failed by a write nobody needs."""
    monkeypatch.setattr(Backend, "items", {})
    gate = Gate()
    model = ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "unused", "hello"])
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store,
                    session_factory=Backend) as deck:
        results: list = []
        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    await start_in_background(tg, deck, results, "worker", "go", session_id="s")
                    await gate.until_entered()
                    await deck.cancel(await running_run_id(store))
                    Backend.down = True
                    gate.release.set()
        finally:
            Backend.down = False
        assert isinstance(results[0], kit.RunStoppedError), results
        assert results[0].status is RunStatus.CANCELLED
        assert Backend.items == {}


async def test_a_caller_cancelled_while_its_turns_items_are_written_ends_it_cancelled(
        monkeypatch, store):
    """A caller cancelled while its turn's items are being written, just before the turn's
    end: the run ends run.cancelled (durable before the caller goes on), the conversation
    holds nothing of it, and the session takes the next turn."""
    monkeypatch.setattr(Backend, "items", {})
    monkeypatch.setattr(Backend, "slow", threading.Event())
    model = ScriptedModel(["lost", "hello"])
    async with Deck([Agent("a", model=model)], store=store, session_factory=Backend) as deck:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(deck.run, "a", "first", session_id="s"))
                assert await anyio.to_thread.run_sync(Backend.slow.wait, 10)
                tg.cancel_scope.cancel()
        Backend.slow = None
        [info] = await store.runs(session_id="s")
        log = await store.read(info.run_id)
        assert kinds(log)[-1] == "run.cancelled" and "run.completed" not in kinds(log)
        assert [e.seq for e in log] == list(range(len(log)))
        assert Backend.items == {}
        assert (await deck.run("a", "again", session_id="s")).output == "hello"
        assert said(model) == ["again"]


REPLICA = """
import sys, anyio, kit
from kit_store import SQLiteStore

async def main():  # another replica resumes the paused run to its end
    agent = kit.Agent("worker", model=kit.ScriptedModel(["all done"]))
    async with SQLiteStore(sys.argv[1]) as store, kit.Deck([agent], store=store) as deck:
        print((await deck.resume(sys.argv[2]))[-1].payload.output, flush=True)

anyio.run(main)
"""


async def test_a_paused_run_resumed_by_another_replica_lets_its_conversation_go(
        monkeypatch, tmp_path, store):
    """KIT_SESSION_MAX=2: a run paused by this deck and resumed to its end by another replica
    (through the store) no longer keeps its conversation here once the store shows it moved
    on: turns on d and e push it out. It was held until the next turn on it here (never, for
    a conversation done with), taking one of the kept places for good."""
    monkeypatch.setenv("KIT_SESSION_MAX", "2")
    monkeypatch.setenv("KIT_LEASE_SECONDS", "0.3")
    gate = Gate()
    model = ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "ok"], cycle=True)
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store) as deck:
        run_id = await pause_on(deck, store, gate, "a")
        sessions = deck._runtime.sessions
        with anyio.fail_after(20):
            out = await anyio.run_process(
                [sys.executable, "-c", REPLICA, str(tmp_path / "kit.db"), run_id],
                cwd=HERE, env={**os.environ, "PYTHONPATH": str(HERE)})
            assert out.stdout.decode().strip() == "all done"
            while sessions.holding():  # within a lease renewal (a third of KIT_LEASE_SECONDS)
                await anyio.sleep(0.02)
        for name in ("d", "e"):
            await deck.run("worker", name, session_id=name)
        assert kept(deck) == {"d", "e"} and len(sessions) == 2
