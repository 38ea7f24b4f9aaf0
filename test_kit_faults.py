"""Fault tests: the log stays the truth when the store fails, stalls or is locked, when callers
are cancelled, when observers get stuck, and when input cannot be stored (DESIGN 4.6).

Faults are injected at the edge kit does not own, the store port: ``FaultyStore`` is the real
SQLite store with a switch that makes appends (or background calls) raise, as a lost disk or
network would. Everything else is kit's real code.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import anyio
import anyio.lowlevel
import httpx
import pytest
from agents.memory import OpenAIConversationsSession
from langgraph.graph import END, START, StateGraph

import kit
import kit_bridge
import kit_runs
import kit_threads
import kit_writer
from kit import Agent, Deck, Event, RunStatus, ScriptedModel, StoreUnavailableError, TextDelta, Workflow
from kit_pg import store_from_url
from kit_store import SQLiteStore
from test_kit import CountingStore, kinds, said
from test_kit_control import Gate, multi_turn_agent, start_in_background
from test_kit_http import served
from test_kit_observers import Recorder
from test_kit_workflows import State, ask, durable_approval, graph, plan

pytestmark = pytest.mark.anyio
HERE = Path(__file__).parent
LONG = " ".join(f"w{i}" for i in range(300))


class FaultyStore(SQLiteStore):
    """The real SQLite store, with faults injected at the port.

    ``fail_appends`` appends raise ``OSError`` before writing anything (a disk or network gone
    for a moment); ``down`` makes every append raise until cleared; ``fail_background`` renewals
    and control-request reads raise that many times, ``fail_renewals`` renewals alone; ``fail_requests`` control-request reads
    alone, and ``fail_reads`` lookups of a run (``run_info``), raise that many times. While
    ``stall()`` holds, appends wait (a slow disk or network: the writer's batch in flight, the
    next one gathering); ``stalled`` is set once one waits.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fail_appends = 0
        self.down = False
        self.fail_background = 0
        self.fail_renewals = 0
        self.fail_reads = 0
        self.fail_requests = 0
        self.failures = 0
        self._stall: anyio.Event | None = None
        self.stalled: anyio.Event | None = None

    @contextlib.asynccontextmanager
    async def stall(self):
        self._stall, self.stalled = anyio.Event(), anyio.Event()
        try:
            yield
        finally:
            self._stall.set()
            self._stall = None

    async def held(self, release: anyio.Event, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """A task (``await tg.start(store.held, release)``): appends stall (``stalled`` is set
        once one does) until ``release`` is set."""
        async with self.stall():
            task_status.started()
            await release.wait()

    async def append(self, events, *, claims=()):
        if self._stall is not None:
            self.stalled.set()
            await self._stall.wait()
        if self.down or self.fail_appends > 0:
            self.fail_appends = max(0, self.fail_appends - 1)
            self.failures += 1
            raise OSError("injected: the disk is gone")
        return await super().append(events, claims=claims)

    def _fault(self, *knobs: str) -> None:
        """Raise, counting down the first of ``knobs`` (fault counts) that is set."""
        for knob in knobs:
            if getattr(self, knob) > 0:
                setattr(self, knob, getattr(self, knob) - 1)
                self.failures += 1
                raise OSError("injected: the store went away")

    async def renew(self, owner, lease_seconds, run_ids=None):
        self._fault("fail_renewals", "fail_background")
        await super().renew(owner, lease_seconds, run_ids)

    async def requests(self, after=0, run_ids=None):
        self._fault("fail_background", "fail_requests")
        return await super().requests(after, run_ids)

    async def run_info(self, run_id):
        self._fault("fail_reads")
        return await super().run_info(run_id)


def seqs(events) -> list[int]:
    return [e.seq for e in events]


async def until(predicate, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not await predicate():
            await anyio.sleep(0.01)


# ------------------------------------------------------------------------- never drop a batch ----

async def test_a_refused_batch_is_retried_and_what_was_acknowledged_is_the_log(tmp_path):
    rec = Recorder()
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck([Agent("a", model=ScriptedModel([LONG]))], store=store, observers=[rec]) as deck:
            store.fail_appends = 3  # the run's first batches: refused, then taken
            with anyio.fail_after(20):
                got = [e async for e in deck.stream("a", "hi", committed=True)]
        log = await store.read(got[0].run_id)
    assert store.failures == 3
    assert seqs(log) == list(range(len(log))) and log[-1].kind == "run.completed"
    assert [e.to_json() for e in got] == [e.to_json() for e in log]  # no hole, nothing extra
    # Observers saw what committed, in order, and nothing else.
    assert [(e.run_id, e.seq) for e in rec.seen] == [(e.run_id, e.seq) for e in log]


@pytest.mark.parametrize("session", [None, "s"])
async def test_a_store_down_past_the_bound_fails_the_run_visibly_and_frees_its_session(
        tmp_path, monkeypatch, session):
    monkeypatch.setenv("KIT_STORE_DOWN_SECONDS", "0.3")
    async with FaultyStore(tmp_path / "kit.db") as store:
        def outage() -> str:
            """The store goes away."""
            store.down = True
            return "ok"

        model = ScriptedModel([{"tool": "outage"}, LONG, "second turn"])
        async with Deck([Agent("a", tools=[outage], model=model)], store=store) as deck:
            got: list[Event] = []
            with anyio.fail_after(20), pytest.raises(StoreUnavailableError) as info:
                async for event in deck.stream("a", "hi", session_id=session, committed=True):
                    got.append(event)
            run_id = info.value.run_id
            assert got and got[0].run_id == run_id  # the stream acknowledged only what committed
            store.down = False  # back: the run's tail and its end are written

            async def ended() -> bool:
                return (await deck.status(run_id)) in (RunStatus.COMPLETED, RunStatus.FAILED)
            await until(ended)
            if session is None:
                # It had played to its end (its reply is shorter than the writer's backlog): the
                # caller was told so, and its run.completed is the log's, not a run.failed.
                assert info.value.outcome == "ended" and "do not play it again" in str(info.value)
                assert await deck.status(run_id) is RunStatus.COMPLETED
            else:
                # Its tool step waited for the log, so it stopped there, cut off before an end
                # of its own: nothing of the turn reaches the session (its input, saved as it
                # started, stayed: a question the log says nobody answered).
                assert info.value.outcome == "stopped"
                assert await deck.status(run_id) is RunStatus.FAILED
                assert await deck.session_for(session).get_items() == []
            log = await store.read(run_id)
            assert seqs(log) == list(range(len(log))) and log[-1].payload.ends == "terminal"
            assert [e.to_json() for e in got] == [e.to_json() for e in log[:len(got)]]
            # The session is free again: the next turn plays.
            result = await deck.run("a", "again", session_id=session)
            assert result.output == (LONG if session else "second turn")  # (where it stopped)


async def test_a_chat_completions_stream_an_outage_stops_ends_in_openais_error_shape(
        tmp_path, monkeypatch):
    """An OpenAI client reads only OpenAI's error shape: a stream that ended without its run's
    end (the store down past its bound) sent kit's ``event: error`` frame, which the client
    raised with no message ("An error occurred during streaming")."""
    import openai
    from test_kit_chat_completions import clients, hi
    monkeypatch.setenv("KIT_STORE_DOWN_SECONDS", "0.3")
    async with FaultyStore(tmp_path / "kit.db") as store:
        def outage() -> str:
            """The store goes away."""
            store.down = True
            return "ok"

        agent = Agent("a", tools=[outage], model=ScriptedModel([{"tool": "outage"}, LONG]))
        async with served(Deck([agent], store=store), surfaces=("openai",)) as (client, app):
            _, aio = clients(client)
            with anyio.fail_after(20), pytest.raises(openai.APIError) as failed:
                async for _ in await aio.chat.completions.create(model="a", messages=hi(),
                                                                 stream=True):
                    pass
            await aio.close()
            store.down = False
            assert failed.value.code == "StoreUnavailableError"
            [info] = await store.runs()
            assert failed.value.message == (
                f"the stream of run {info.run_id} ended before the run did "
                f"(StoreUnavailableError); its log has the rest: GET /runs/{info.run_id}/events")


async def test_a_stream_that_fell_behind_ends_with_an_error_frame_within_the_bound(tmp_path, monkeypatch):
    """A stream whose reader fell behind the run's live buffer catches up from the log, and
    committed what was buffered first: while the store took no writes, its SSE response hung
    until the store came back, long after the run was stopped."""
    monkeypatch.setenv("KIT_STORE_DOWN_SECONDS", "0.3")
    monkeypatch.setattr(kit_runs, "LIVE_MAX", 20)  # the run's reply overflows it
    async with FaultyStore(tmp_path / "kit.db") as store:
        def outage() -> str:
            """The store goes away."""
            store.down = True
            return "ok"

        agent = Agent("a", tools=[outage], model=ScriptedModel([{"tool": "outage"}, LONG]))
        async with served(Deck([agent], store=store)) as (client, app):
            with anyio.fail_after(20):
                async with client.stream("POST", "/agents/a/chat?stream=true",
                                         json={"message": "hi"}) as r:
                    body = b"".join([chunk async for chunk in r.aiter_raw()])
            assert body.endswith(b'event: error\ndata: {"error":"StoreUnavailableError"}\n\n')
            assert b"delta" not in body  # nothing the log does not hold yet
            store.down = False
            [info] = await store.runs()

            async def written() -> bool:  # it had played to its end: the log has all of it
                return await app.deck.status(info.run_id) is RunStatus.COMPLETED
            await until(written)


async def test_what_a_caller_stopped_by_an_outage_is_told_is_what_the_log_will_hold(tmp_path, monkeypatch):
    """A caller told "stopped" found run.completed in the log once the store was back (a retry
    played the turn twice); one refused at the start was told its end would be recorded, and
    the log never heard of it."""
    monkeypatch.setenv("KIT_STORE_DOWN_SECONDS", "0.3")

    def noop() -> str:
        """Do nothing."""
        return "ok"
    agent = Agent("a", tools=[noop], model=ScriptedModel([{"tool": "noop"}, "after"]))
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck([agent], store=store) as deck:  # its tool.started must commit first
            store.down = True
            with anyio.fail_after(20):
                with pytest.raises(StoreUnavailableError) as stopped:
                    await deck.run("a", "hi")
                with pytest.raises(StoreUnavailableError) as refused:
                    await deck.run("a", "then", session_id="s")
            assert stopped.value.outcome == "stopped" and refused.value.outcome == "not started"
            assert str(refused.value).startswith(f"run {refused.value.run_id} was not started")
            store.down = False

            async def written() -> bool:
                return await deck.status(stopped.value.run_id) is RunStatus.FAILED
            await until(written)
            assert await deck.status(refused.value.run_id) is None
            assert (await deck.run("a", "again", session_id="s")).output == "after"


async def test_the_background_loops_survive_store_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("KIT_LEASE_SECONDS", "0.15")  # renewals every 50 ms
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck([Agent("a", model=ScriptedModel(["ok"], cycle=True))], store=store) as deck:
            store.fail_background = 4  # both loops fail, back off, and carry on
            with anyio.fail_after(20):
                while store.fail_background:  # every failure lands while the deck works
                    assert (await deck.run("a", "hi", session_id="s")).output == "ok"
                    await anyio.sleep(0.02)
            assert (await deck.run("a", "still here", session_id="s")).output == "ok"


async def test_a_cancelled_flush_puts_its_batch_back(tmp_path):
    """Group commit takes the buffer before it awaits the store: a cancellation while it waits
    for the store to come back must leave the batch to the next flush, not lose it."""
    async with FaultyStore(tmp_path / "kit.db") as store:
        writer = kit_writer.Writer(store, lambda events: None, lambda *a: None)
        events = [Event("r1", 0, kit.RunStarted("a", "agent")),
                  *[Event("r1", i, TextDelta(f"t{i}")) for i in range(1, 50)]]
        for event in events:
            writer.put(event)
        store.down = True
        with anyio.move_on_after(0.2):
            await writer.flush()  # backing off, then cancelled
        store.down = False
        assert writer.pending == len(events)
        await writer.flush()
        assert seqs(await store.read("r1")) == list(range(50))


class RunDownStore(FaultyStore):
    """``down_run``'s appends alone fail (a batch of that run only, as the writer retries a
    refused batch run by run): one run's events meet an outage after another run was refused."""

    down_run: str | None = None

    async def append(self, events, *, claims=()):
        if self.down_run is not None and {e.run_id for e in events} == {self.down_run}:
            self.failures += 1
            raise OSError("injected: the disk is gone")
        return await super().append(events, claims=claims)


async def test_a_cancelled_flush_puts_back_only_the_claims_of_what_it_puts_back(tmp_path):
    """A batch one run's claim got refused is retried run by run; cancelled while another run
    waited out an outage, the flush put every claim back, the refused one's too: the next
    batch carried it, was refused for it, and cost the run alone in it all of its events."""
    async with RunDownStore(tmp_path / "kit.db") as store:
        await store.append([Event("holder", 0, kit.RunStarted("a", "agent", "s"))],
                           claims=[kit.Claim("holder", "other", 60.0, "s")])
        writer = kit_writer.Writer(store, lambda events: None, lambda *a: None)
        writer.put(Event("r1", 0, kit.RunStarted("a", "agent", "s")),
                   kit.Claim("r1", "me", 60.0, "s"))  # busy: "holder" has the session
        writer.put(Event("r2", 0, kit.RunStarted("a", "agent")), kit.Claim("r2", "me", 60.0))
        writer.put(Event("r2", 1, TextDelta("hi")))
        store.down_run = "r2"
        with anyio.move_on_after(0.2):
            await writer.flush()  # r1 refused, r2 backing off, then cancelled
        assert isinstance(writer.failed.get("r1"), kit.SessionBusyError)
        store.down_run = None
        await writer.flush()
        assert "r2" not in writer.failed
        assert seqs(await store.read("r2")) == [0, 1] and await store.read("r1") == []
        assert await store.session_holder("s") == "holder"


@contextlib.asynccontextmanager
async def hurried_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A writer playing on a CountingStore with the loop's timer (under asyncio; trio has
    none) and an hour's FLUSH_DELAY, so only a hurry commits a batch within a test's bound;
    yields the store, the writer and the events it committed."""
    monkeypatch.setattr(kit_writer, "FLUSH_DELAY", 3600.0)
    committed: list[Event] = []
    async with CountingStore(tmp_path / "kit.db") as store:
        writer = kit_writer.Writer(store, committed.extend, lambda *a: None,
                                   later=kit_bridge.later())
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.run)
            yield store, writer, committed
            tg.cancel_scope.cancel()


async def until_committed(committed: list[Event], n: int) -> None:
    with anyio.fail_after(5):
        while len(committed) < n:
            await anyio.sleep(0.001)


async def test_a_hurried_batch_takes_what_the_run_makes_meanwhile(tmp_path, monkeypatch):
    """A reader waiting for an event hurries the writer: the commit comes within HURRY_DELAY,
    not at the batch's FLUSH_DELAY (the loop's timer, under asyncio, is brought forward; the
    writer task's wait, under trio, is cut short), and the events the run makes in the loop
    passes before it ride along (a short streamed turn is one commit and one send, not one per
    token)."""
    async with hurried_writer(tmp_path, monkeypatch) as (store, writer, committed):
        for seq in range(6):
            if seq:
                await anyio.lowlevel.checkpoint()  # the engine's loop pass between tokens
            writer.put(Event("r1", seq, TextDelta(f"t{seq}") if seq else kit.RunStarted("a", "agent")))
            writer.hurry()
        await until_committed(committed, 6)
    assert store.batches == [["run.started"] + ["text.delta"] * 5]  # one commit, in order


async def test_a_batch_hurried_before_it_began_is_not_left_to_an_earlier_batchs_timer(
        tmp_path, monkeypatch):
    """A reader hurries the writer while nothing is buffered (what it waits for is being
    committed); the next batch is then due HURRY_DELAY after its first event, not when the timer
    an earlier batch armed (its FLUSH_DELAY) would fire."""
    async with hurried_writer(tmp_path, monkeypatch) as (store, writer, committed):
        writer.put(Event("r1", 0, kit.RunStarted("a", "agent")))  # arms the hour's timer
        await writer.flush()  # the run's own durable write: that timer is left armed
        writer.hurry()
        writer.put(Event("r1", 1, TextDelta("t1")))
        await until_committed(committed, 2)
    assert store.batches == [["run.started"], ["text.delta"]]


# ------------------------------------------------------------------- input, cancel, control ----

async def test_input_that_cannot_be_stored_is_refused_before_anything_is_written(tmp_path):
    async with FaultyStore(tmp_path / "kit.db") as store:
        agent, flow = Agent("a", model=ScriptedModel(["ok"], cycle=True)), Workflow("w", linear())
        async with Deck([agent], [flow], store=store) as deck:
            with pytest.raises(kit.ContentError, match="surrogate"):
                await deck.run("a", "bad \ud800 text")
            with pytest.raises(kit.ContentError, match="surrogate"):
                await deck.stream("a", "bad \udfff", session_id="s").__anext__()
            with pytest.raises(kit.ContentError, match="surrogate"):
                await deck.run("w", {"log": ["\ud800"]})
            assert await store.runs() == []
    async with served(deck_for_http()) as (client, app):
        for path in ("/agents/a/chat", "/agents/a/chat?stream=true"):
            r = await client.post(path, content=b'{"message": "x \\ud800"}',
                                  headers={"content-type": "application/json"})
            assert r.status_code == 400 and "surrogate" in r.json()["message"]
        assert await app.deck.store.runs() == []


#: Ids no store can hold or index, each with what its refusal says.
BAD_IDS = {"a\x00b": "must not hold a control character or a lone surrogate",
           "a\nb": "must not hold a control character or a lone surrogate",
           "a\ud800": "must not hold a control character or a lone surrogate",
           "x" * 257: "must be at most 256 characters",
           ".": "must not be '.': HTTP clients resolve it away",
           "..": "must not be '..': HTTP clients resolve it away"}


async def test_ids_a_store_cannot_hold_or_index_are_refused_before_anything_is_written(shared_url):
    """Postgres holds no NUL and indexes no value past ~2.7 kB, and no store holds a lone
    surrogate: such an id used to reach the writer, which took the store for down and retried
    that batch forever, every run's events behind it (the deck's next runs hung)."""
    async with store_from_url(shared_url) as store:
        async with Deck([Agent("a", model=ScriptedModel(["ok"], cycle=True))], store=store) as deck:
            for bad, says in BAD_IDS.items():
                for what, call in (
                        ("session_id", lambda: deck.run("a", "hi", session_id=bad)),
                        ("session_id", lambda: deck.stream("a", "hi", session_id=bad).__anext__()),
                        ("run_id", lambda: deck.run("a", "hi", run_id=bad)),
                        ("run_id", lambda: deck.status(bad)),
                        ("run_id", lambda: deck.cancel(bad)),
                        ("run_id", lambda: deck.answer(bad, "yes")),
                        ("run_id", lambda: deck.resume(bad))):
                    with anyio.fail_after(10), pytest.raises(kit.ConfigError, match=f"^{what} {says}"):
                        await call()
            with anyio.fail_after(10):
                ok = await deck.run("a", "hi", session_id="s")
            with pytest.raises(kit.ConfigError, match="^reason must not hold a NUL or a lone surrogate"):
                await deck.cancel(ok.run_id, reason="done\x00")
            assert [(r.run_id, r.status) for r in await store.runs()] == [(ok.run_id, RunStatus.COMPLETED)]
            assert await store.requests() == []
    async with served(deck_for_http()) as (client, app):
        r = await client.post("/agents/a/chat", json={"message": "hi", "session_id": "a\x00b"})
        assert (r.status_code, r.json()["error"]) == (400, "MalformedRequestError")
        assert r.json()["message"].startswith("'session_id' must not hold a control character")
        r = await client.post("/agents/a/chat", json={"message": "hi", "session_id": ".."})
        assert (r.status_code, r.json()["error"]) == (400, "MalformedRequestError")
        for method, path, says in (("GET", "/runs/a%00b/events", "run_id must not hold a control"),
                                   ("GET", "/runs/%2E%2E/events", "run_id must not be '..'"),
                                   ("POST", f"/runs/{'x' * 257}/cancel", "run_id must be at most 256"),
                                   ("POST", "/workflows/w/a%0Ab/resume", "thread_id must not hold")):
            r = await client.request(method, path, json={"value": 1} if "resume" in path else None)
            assert (r.status_code, r.json()["error"]) == (400, "MalformedRequestError"), path
            assert r.json()["message"].startswith(says), r.json()
        assert (await client.post("/agents/a/chat", json={"message": "hi", "session_id": "s"})).status_code == 200
        assert [r.session_id for r in await app.deck.store.runs()] == ["s"]


async def test_an_id_from_before_the_check_still_plays_from_the_log(tmp_path):
    """A log written before ``check_id`` may hold an id it refuses now: what kit takes from the
    log (a resume request written by ``kit runs signal``, a due thread) still plays that run;
    only the ids callers give are checked."""
    old = "paused\nrun"
    async with SQLiteStore(tmp_path / "kit.db") as store:
        await store.append([
            Event(old, 0, kit.RunStarted("a", "agent", None, None, (kit.TextBlock("hi"),)), "a"),
            Event(old, 1, kit.ControlRequested("pause", None, "api"), "a"),
            Event(old, 2, kit.RunPaused(None, [{"role": "user", "content": "hi"}]), "a")])
        async with Deck([Agent("a", model=ScriptedModel(["resumed"]))], store=store) as deck:
            with pytest.raises(kit.ConfigError, match="^run_id must not hold a control character"):
                await deck.resume(old)
            await store.request(old, "resume", None, "cli")  # as `kit runs signal` records it

            async def completed() -> bool:
                return (await store.run_info(old)).status is RunStatus.COMPLETED
            await until(completed)
        assert [e.kind for e in await store.read(old)][3:] == [
            "control.requested", "run.resumed", "text.delta", "message.completed",
            "model.completed", "run.completed"]


async def test_a_control_request_that_meets_a_store_blip_is_acted_on_once_it_passes(tmp_path):
    """A cancel recorded elsewhere (``kit runs signal``) for a parked run, met by a store that
    fails a read for a moment: the deck acts on it once the store answers again. It used to
    count the request as seen before acting, so the blip dropped it: the run stayed parked."""
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck(workflows=[durable_approval()], store=store) as deck:
            parked = await deck.run("approval", {"log": []}, session_id="t")
            store.fail_reads = 2  # the deck's next two looks at a run fail
            async with SQLiteStore(tmp_path / "kit.db") as cli:
                await cli.request(parked.run_id, "cancel", "not needed", "cli")

                async def cancelled() -> bool:
                    return (await cli.run_info(parked.run_id)).status is RunStatus.CANCELLED
                await until(cancelled, timeout=20)
            assert store.failures == 2
            assert [e.kind for e in await store.read(parked.run_id)][-2:] == [
                "control.requested", "run.cancelled"]


async def test_the_control_watch_starts_over_promptly_after_each_blip_it_recovered_from(tmp_path):
    """The watch follows the store for good, and each failure backs off before it starts over
    (doubling, up to BACKOFF_MAX). Its wait used to grow with every blip over a process's life,
    as the watch never returns: after four, a cancel from elsewhere waited 8 s to be seen."""
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck(workflows=[durable_approval()], store=store) as deck:
            parked = await deck.run("approval", {"log": []}, session_id="t")
            for blip in range(1, 5):
                store.fail_requests = 1

                async def failed() -> bool:
                    return store.failures == blip
                await until(failed)
                await anyio.sleep(2.5)  # back after 1 s, then working for longer than it waited
            async with SQLiteStore(tmp_path / "kit.db") as cli:
                await cli.request(parked.run_id, "cancel", None, "cli")
                asked = time.monotonic()

                async def cancelled() -> bool:
                    return (await cli.run_info(parked.run_id)).status is RunStatus.CANCELLED
                await until(cancelled, timeout=30)
                assert time.monotonic() - asked < 2.0


async def test_a_resume_request_that_meets_a_store_blip_is_taken_up_once_it_passes(tmp_path):
    run_id = kit.new_run_id()
    async with FaultyStore(tmp_path / "kit.db") as store:
        await store.append([  # a paused agent run, as another process left it
            Event(run_id, 0, kit.RunStarted("a", "agent", None, None, (kit.TextBlock("hi"),)), "a"),
            Event(run_id, 1, kit.ControlRequested("pause", None, "api"), "a"),
            Event(run_id, 2, kit.RunPaused(None, [{"role": "user", "content": "hi"}]), "a")])
        async with Deck([Agent("a", model=ScriptedModel(["resumed"]))], store=store) as deck:
            store.fail_reads = 1
            async with SQLiteStore(tmp_path / "kit.db") as cli:
                await cli.request(run_id, "resume", None, "cli")

                async def completed() -> bool:
                    return (await cli.run_info(run_id)).status is RunStatus.COMPLETED
                await until(completed, timeout=20)
            assert store.failures == 1 and await deck.status(run_id) is RunStatus.COMPLETED


class MetFirst(SQLiteStore):
    """Returns a control request's id only once a watch has read past it: the deck's watch meets
    the request before the caller that made it hears its id."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.read_past, self.moved = 0, anyio.Event()

    async def requests(self, after=0):
        if after > self.read_past:
            self.read_past = after
            self.moved.set()
        return await super().requests(after)

    async def request(self, run_id, action, reason=None, source=None):
        request_id = await super().request(run_id, action, reason, source)
        while self.read_past < request_id:
            self.moved = anyio.Event()
            await self.moved.wait()
        return request_id


async def test_requests_the_watch_met_before_their_maker_are_acted_on_once_and_not_kept(tmp_path):
    """The deck kept the id of each request made here until its watch met it, to pass over it
    then; one the watch had met already was kept for good, an id per cancel for the process's
    life."""
    run_ids = [kit.new_run_id() for _ in range(3)]
    async with MetFirst(tmp_path / "kit.db") as store:
        for run_id in run_ids:
            await store.append(paused_run(run_id))
        async with Deck([Agent("a", model=ScriptedModel(["x"]))], store=store) as deck:
            with anyio.fail_after(10):
                for run_id in run_ids:
                    await deck.cancel(run_id)
            for run_id in run_ids:
                assert kinds(await store.read(run_id))[3:] == ["control.requested", "run.cancelled"]
            assert deck._runtime._handled == set()


def paused_run(run_id: str, session_id: str | None = None) -> list[Event]:
    """A paused agent run, as another process left it."""
    return [Event(run_id, 0, kit.RunStarted("a", "agent", session_id, None, (kit.TextBlock("hi"),)), "a"),
            Event(run_id, 1, kit.ControlRequested("pause", None, "api"), "a"),
            Event(run_id, 2, kit.RunPaused(None, [{"role": "user", "content": "hi"}]), "a")]


async def test_a_resume_while_the_store_takes_no_writes_is_told_so_within_the_bound(tmp_path, monkeypatch):
    """A resume (an answer, a tick's wake-up) waited for its take-over for as long as the store
    took no writes, where a new run's caller is told after KIT_STORE_DOWN_SECONDS: an HTTP resume
    hung until the store came back. Once one is told, the next in the same outage is refused at
    once, writing nothing, even when the store's first refusal came late (its first write hung
    for most of the bound): it waited the bound again, and was recorded failed."""
    monkeypatch.setenv("KIT_STORE_DOWN_SECONDS", "1")
    first, second = kit.new_run_id(), kit.new_run_id()
    async with FaultyStore(tmp_path / "kit.db") as store:
        await store.append(paused_run(first, "s"), claims=[kit.Claim(first, "gone", 30, "s")])
        await store.append(paused_run(second))
        async with Deck([Agent("a", model=ScriptedModel(["resumed"], cycle=True))], store=store) as deck:
            store.down = True
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    release = anyio.Event()
                    await tg.start(store.held, release)
                    tg.start_soon(set_after, release, 0.9)  # the first refusal: 0.1 s before the bound
                    with pytest.raises(StoreUnavailableError) as stopped:
                        await deck.resume(first)  # its take-over waits in the writer's buffer
                with anyio.fail_after(0.5):
                    with pytest.raises(StoreUnavailableError) as refused:
                        await deck.resume(second)  # the outage was told: nothing is written
            assert (stopped.value.run_id, stopped.value.outcome) == (first, "stopped")
            assert (refused.value.run_id, refused.value.outcome) == (second, "not started")
            store.down = False

            async def written() -> bool:
                return await deck.status(first) is RunStatus.FAILED
            await until(written)
            log = await store.read(first)
            assert kinds(log)[3:] == ["control.requested", "run.resumed", "run.failed"]
            assert log[-1].payload.error == "StoreUnavailableError"
            assert await store.session_holder("s") is None  # its session is free again
            assert await deck.status(second) is RunStatus.PAUSED  # it can still be resumed
            assert (await deck.resume(second))[-1].payload.output == "resumed"


async def test_a_parked_runs_cancel_while_the_store_takes_no_writes_is_told_so_within_the_bound(
        tmp_path, monkeypatch):
    """A cancel of a parked run waited for its write for as long as the store took no writes
    (an HTTP cancel hung until the store came back); it is told after KIT_STORE_DOWN_SECONDS, and
    the cancel is written once, with the run's thread let go, when the store is back. A second
    cancel meanwhile is told the same (it returned at once, as if the run were cancelled)."""
    monkeypatch.setenv("KIT_STORE_DOWN_SECONDS", "0.3")
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck(workflows=[Workflow("approve", graph(plan, ask))], store=store) as deck:
            parked = await deck.run("approve", {"log": []})
            store.down = True
            with anyio.fail_after(10):
                with pytest.raises(StoreUnavailableError) as told:
                    await deck.cancel(parked.run_id)
                with pytest.raises(StoreUnavailableError) as again:  # the first is written, once
                    await deck.cancel(parked.run_id)
            assert told.value.run_id == again.value.run_id == parked.run_id
            store.down = False
            runtime = deck._runtime

            async def let_go() -> bool:  # a workflow's thread in memory: deleted with its run
                key = runtime.specs["approve"].engine.key(None, parked.thread_id)
                return not await runtime._on_engine(kit_threads.holds_thread,
                                                    runtime.graphs["approve"], key)
            await until(let_go)
            assert await deck.status(parked.run_id) is RunStatus.CANCELLED
            assert kinds(await store.read(parked.run_id))[-3:] == [
                "run.interrupted", "control.requested", "run.cancelled"]
            with pytest.raises(kit.RunNotWaitingError):
                await deck.answer(parked.run_id, "yes")


async def test_two_cancels_of_a_parked_run_during_a_blip_both_return_once_it_is_written(
        tmp_path, monkeypatch):
    """Two cancels of a parked run while the store takes no writes for a moment: both return
    once the one cancel is written (the second waits for the first's write, and has its
    outcome), and the log has it once."""
    monkeypatch.setenv("KIT_STORE_DOWN_SECONDS", "30")
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck(workflows=[Workflow("approve", graph(plan, ask))], store=store) as deck:
            parked = await deck.run("approve", {"log": []})
            store.down = True
            done: list[str] = []

            async def cancel(name: str) -> None:
                await deck.cancel(parked.run_id)
                done.append(name)
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel, "first")
                    while not store.failures:  # the first's write waits for the store
                        await anyio.sleep(0.01)
                    tg.start_soon(cancel, "second")
                    while len(await store.requests(run_ids=[parked.run_id])) < 2:
                        await anyio.sleep(0.01)
                    assert "first" not in done
                    store.down = False
            assert sorted(done) == ["first", "second"]
            assert await deck.status(parked.run_id) is RunStatus.CANCELLED
            assert kinds(await store.read(parked.run_id))[-3:] == [
                "run.interrupted", "control.requested", "run.cancelled"]


async def test_a_runs_status_asked_while_the_store_takes_no_writes_comes_within_the_bound(
        tmp_path, monkeypatch):
    """The status of a run played here (GET /runs/{id}, and the check before an HTTP pause or
    cancel) and a pause or cancel of it committed what was buffered first, waiting for as long
    as the store took no writes: they hung until the store came back, long after the run's own
    caller was told."""
    monkeypatch.setenv("KIT_STORE_DOWN_SECONDS", "0.3")
    async with FaultyStore(tmp_path / "kit.db") as store:
        def outage() -> str:
            """The store goes away."""
            store.down = True
            return "ok"

        agent = Agent("a", tools=[outage], model=ScriptedModel([{"tool": "outage"}, LONG]))
        async with Deck([agent], store=store) as deck:
            results: list = []
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    await start_in_background(tg, deck, results, "a", "hi", run_id="r1")
                    while not store.failures:  # a batch of the run waits for the store
                        await anyio.sleep(0.001)
                    statuses: list = []

                    async def status() -> None:
                        statuses.append(await deck.status("r1"))
                    tg.start_soon(status)
                    tg.start_soon(functools.partial(deck.cancel, "r1"))
            assert statuses == [RunStatus.RUNNING]  # its start committed, not its end
            assert isinstance(results[0], StoreUnavailableError)
            store.down = False


class FailingLogReads(FaultyStore):
    """``FaultyStore`` whose reads of runs' logs (``read``, ``last_events``) raise
    ``fail_log_reads`` times; ``log_reads`` notes the runs each read was of."""

    fail_log_reads = 0

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.log_reads: list[list[str]] = []

    async def read(self, run_id, after=-1, **limit):
        self.log_reads.append([run_id])
        self._fault("fail_log_reads")
        return await super().read(run_id, after, **limit)

    async def last_events(self, run_ids):
        self.log_reads.append(sorted(run_ids))
        self._fault("fail_log_reads")
        return await super().last_events(run_ids)


async def test_a_run_reaped_while_the_store_fails_a_read_still_reaches_the_observers(
        tmp_path, monkeypatch):
    """The reaper records a dead process's run abandoned, then reads its run.failed to give
    the observers: a store that failed that read (a blip) had them never see it (the next reap
    does not return the run again), so its trace stayed open until the deck closed."""
    monkeypatch.setenv("KIT_LEASE_SECONDS", "0.3")
    recorder, dead = Recorder(), kit.new_run_id()
    async with FailingLogReads(tmp_path / "kit.db") as store:
        async with Deck([Agent("a", model=ScriptedModel(["ok"]))], store=store,
                        observers=[recorder]) as deck:
            store.fail_log_reads = 1
            await store.append([Event(dead, 0, kit.RunStarted("a", "agent"), "a")],
                               claims=[kit.Claim(dead, "gone", 0.05)])
            with anyio.fail_after(10):
                while not any(e.run_id == dead and e.kind == "run.failed" for e in recorder.seen):
                    await anyio.sleep(0.02)
            assert store.failures == 1 and await deck.status(dead) is RunStatus.FAILED
            assert [e.kind for e in recorder.seen if e.run_id == dead] == ["run.failed"]


async def test_the_runs_a_reap_abandons_are_read_in_one_read_and_reach_the_observers(tmp_path):
    """The reaper read each abandoned run's end with a read (and an index lookup) of its own: a
    round trip each on Postgres, for every run a dead replica left. Their ends are read in one
    read (``last_events``) now, and each reaches the observers once."""
    recorder, dead = Recorder(), sorted(kit.new_run_id() for _ in range(3))
    async with FailingLogReads(tmp_path / "kit.db") as store:
        await store.append([Event(run_id, 0, kit.RunStarted("a", "agent"), "a") for run_id in dead],
                           claims=[kit.Claim(run_id, "gone", 0.05) for run_id in dead])
        await anyio.sleep(0.2)  # their process is gone: the leases lapse
        async with Deck([Agent("a", model=ScriptedModel(["ok"]))], store=store,
                        observers=[recorder]) as deck:  # (a deck reaps as it opens)
            with anyio.fail_after(10):
                while len([e for e in recorder.seen if e.run_id in dead]) < len(dead):
                    await anyio.sleep(0.02)
            assert [await deck.status(run_id) for run_id in dead] == [RunStatus.FAILED] * 3
    assert [(e.run_id, e.kind) for e in recorder.seen if e.run_id in dead] == [
        (run_id, "run.failed") for run_id in dead]
    assert [ids for ids in store.log_reads if set(ids) & set(dead)] == [dead]


async def test_a_renewal_that_fails_is_tried_again_within_the_lease(tmp_path, monkeypatch):
    """A renewal failed twice (a dropped connection, a locked file) backed off past the lease:
    the renewals came 1 s, then 2 s apart, and another process reaped the live run as abandoned
    (its caller got LogConflictError, the turn was lost)."""
    monkeypatch.setenv("KIT_LEASE_SECONDS", "1.5")
    gate = Gate()
    async with FaultyStore(tmp_path / "kit.db") as store, SQLiteStore(tmp_path / "kit.db") as other:
        async with Deck([multi_turn_agent(gate)], store=store) as deck:
            results: list = []
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    await start_in_background(tg, deck, results, "worker", "go", run_id="live")
                    await gate.until_entered()
                    store.fail_renewals = 2
                    reaped: list[str] = []
                    for _ in range(30):  # three leases of another process reaping
                        reaped += await other.reap()
                        await anyio.sleep(0.1)
                    gate.release.set()
            assert store.failures == 2 and reaped == []
            assert results[0].output == "all done", results


class Conversation(OpenAIConversationsSession):
    """The SDK's OpenAI Conversations session, its conversation kept here instead of on OpenAI's
    servers (the API's edge, as the OpenAI stub is the model's): items lose their ids, as there."""

    conversations: dict[str, list] = {}

    def __init__(self, key: str) -> None:
        super().__init__(conversation_id=key, openai_client=object())

    async def get_items(self, limit=None):
        items = self.conversations.setdefault(self.session_id, [])
        return [dict(i) for i in (items if limit is None else items[-limit:] if limit else [])]

    async def add_items(self, items):
        self.conversations.setdefault(self.session_id, []).extend(
            {k: v for k, v in i.items() if k != "id"} for i in items)

    async def pop_item(self):
        items = self.conversations.setdefault(self.session_id, [])
        return items.pop() if items else None

    async def clear_session(self):
        self.conversations.pop(self.session_id, None)


async def test_a_turn_stopped_while_its_end_waits_for_the_log_is_told_what_the_log_holds(
        tmp_path, monkeypatch):
    """A turn whose end waited for the log (its session's write goes first, once the log holds
    all before the end) when the store stayed down past its bound: its caller was told it had
    "played to its end ... do not play it again", while the log then recorded its run.failed
    and its conversation got nothing of it. What the caller hears is the log's end."""
    monkeypatch.setenv("KIT_STORE_DOWN_SECONDS", "0.3")
    monkeypatch.setattr(Conversation, "conversations", {})
    async with FaultyStore(tmp_path / "kit.db") as store:
        def outage() -> str:
            """The store goes away."""
            store.down = True
            return "ok"

        agent = Agent("a", tools=[outage], model=ScriptedModel([{"tool": "outage"}, "short"]))
        async with Deck([agent], store=store, session_factory=Conversation) as deck:
            with anyio.fail_after(20), pytest.raises(StoreUnavailableError) as info:
                await deck.run("a", "hi", session_id="s")
            store.down = False
            run_id = info.value.run_id

            async def ended() -> bool:
                return (await deck.status(run_id)) in (RunStatus.COMPLETED, RunStatus.FAILED)
            await until(ended)
            log = await store.read(run_id)
            assert seqs(log) == list(range(len(log)))
            assert (log[-1].kind, log[-1].payload.error) == ("run.failed", "StoreUnavailableError")
            assert info.value.outcome == "stopped", str(info.value)
            assert Conversation.conversations.get("s", []) == []  # nothing of the turn


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_dead_runs_end_written_at_a_new_turns_claim_reaches_the_observers(tmp_path, request, kind):
    """A turn whose process died (its lease lapsed, not reaped yet) was recorded abandoned by
    the next turn on its session, inside that turn's claim: the deck's observers never got its
    run.failed (no reap returns the run), so its trace stayed open for good."""
    url = (f"sqlite:///{tmp_path}/kit.db" if kind == "sqlite" else request.getfixturevalue("postgres_url"))
    rec = Recorder()
    async with store_from_url(url) as store:
        async with Deck([Agent("talk", model=ScriptedModel(["hello"]))], store=store, observers=[rec]) as deck:
            await store.append([Event("dead", 0, kit.RunStarted("talk", "agent", "s"))],
                               claims=[kit.Claim("dead", "gone", 0.05, session_id="s")])
            await anyio.sleep(0.3)  # its process is gone: the lease lapses
            with anyio.fail_after(20):
                assert (await deck.run("talk", "hi", session_id="s")).output == "hello"
        log = await store.read("dead")
    assert log[-1].kind == "run.failed" and log[-1].payload.error == "RunAbandoned"
    assert [(e.run_id, e.seq, e.kind) for e in rec.seen if e.run_id == "dead"] == [("dead", 1, "run.failed")]
    assert rec.seen[0].run_id == "dead"  # committed before the new turn's events


@pytest.mark.parametrize("conversations", [False, True])
async def test_a_run_reaped_while_its_process_stalled_writes_nothing_to_its_session(
        tmp_path, monkeypatch, anyio_backend, conversations):
    """A process that stalled past its lease (a GC pause, a frozen VM, a partition from the
    store) had its live run reaped by another process, whose next turn took the session; woken,
    the run wrote its tool step into that conversation after the other turn, though its log
    refused it (kit-serve replicas: the next turn's model saw a call no turn of its had made).
    The SDK's OpenAIConversationsSession was not fenced at all: it took the woken run's step."""
    monkeypatch.setenv("KIT_LEASE_SECONDS", "0.3")
    gate = Gate()
    worker = Agent("worker", tools=[gate.wait_tool()],
                   model=ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "too late"]))
    talk = Agent("talk", model=ScriptedModel(["hello"]))
    factory = (lambda key: Conversation(f"{tmp_path}/{key}")) if conversations else None
    async with FaultyStore(tmp_path / "kit.db") as store, SQLiteStore(tmp_path / "kit.db") as other:
        async with Deck([worker, talk], store=store, session_factory=factory) as deck:
            results: list = []
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    await start_in_background(tg, deck, results, "worker", "go", session_id="s")
                    await gate.until_entered()
                    store.fail_renewals = 10**6  # this process stalls: its lease lapses
                    while not (reaped := await other.reap()):  # another process reaps the run
                        await anyio.sleep(0.05)
                    store.fail_renewals = 0
                    assert (await deck.run("talk", "hi", session_id="s")).output == "hello"
                    gate.release.set()  # the stalled run wakes
            items = await deck.session_for("s").get_items()
            log = await store.read(reaped[0])
    assert isinstance(results[0], kit.LogConflictError), results
    assert log[-1].kind == "run.failed" and log[-1].payload.error == "RunAbandoned"
    # The other turn alone: nothing of the stalled one (its input, saved as it started,
    # stayed there too: a question the log says nobody answered).
    assert [(i.get("role"), i.get("content") if isinstance(i.get("content"), str) else None)
            for i in items] == [("user", "hi"), ("assistant", None)]


async def test_a_workflow_run_reaped_while_its_process_stalled_writes_no_checkpoint(
        tmp_path, monkeypatch, anyio_backend):
    """A durable workflow's run reaped while its process stalled past its lease: woken, it
    wrote its node's checkpoint onto the thread after the run another process had played on
    it since, so the thread's next run started from the dead run's state, without that run's
    answer."""
    import threading
    monkeypatch.setenv("KIT_LEASE_SECONDS", "0.3")
    entered, release = threading.Event(), threading.Event()

    def slow(state: State) -> dict:  # the first call stalls; a sync node plays on a thread
        if not entered.is_set():
            entered.set()
            release.wait(10)
        return {"log": ["slow"]}
    wf = Workflow("wf", graph(slow, ask), durable=True)
    async with FaultyStore(tmp_path / "kit.db") as store, SQLiteStore(tmp_path / "kit.db") as other:
        async with Deck(workflows=[wf], store=store) as deck:
            results: list = []
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    await start_in_background(tg, deck, results, "wf", {"log": ["one"]},
                                              session_id="t")
                    assert await anyio.to_thread.run_sync(entered.wait, 10)
                    store.fail_renewals = 10**6  # this process stalls: its lease lapses
                    while not await other.reap():  # another process reaps the run
                        await anyio.sleep(0.05)
                    store.fail_renewals = 0
                    parked = await deck.run("wf", {"log": ["two"]}, session_id="t")
                    second = await deck.answer(parked.run_id, "yes")
                    release.set()  # the stalled run wakes
                parked = await deck.run("wf", {"log": ["three"]}, session_id="t")
                third = await deck.answer(parked.run_id, "again")
    assert isinstance(results[0], kit.LogConflictError), results
    # The second run carried on from the dead one (its input was not applied); the third
    # started from where the second ended.
    assert second["log"] == ["one", "slow", "answer=yes"]
    assert third["log"] == second["log"] + ["three", "slow", "answer=again"]


KILLED = """
import sys, time, anyio, kit

def wait(step: int) -> str:
    \"\"\"Wait for the kill.\"\"\"
    print("entered", flush=True)
    time.sleep(60)
    return "never"

async def main():  # a turn killed -9 while its tool runs
    agent = kit.Agent("worker", tools=[wait], model=kit.ScriptedModel(
        ["noted", {"tool": "wait", "args": {"step": 1}}]))
    async with kit.Deck([agent]) as deck:
        await deck.run("worker", "remember 7", session_id="s")
        await deck.run("worker", "go", session_id="s")

anyio.run(main)
"""


async def test_a_turn_killed_mid_run_leaves_nothing_of_itself_in_its_session(tmp_path, monkeypatch):
    """kill -9 while a turn's tool ran (KIT_SESSION on a file, as a replica's would be on
    Redis): once the next process recorded the run abandoned, the session still held the
    killed turn's input, so the next turn's model was sent a question nobody had answered.
    The session holds the turns the log says ended, and nothing of the killed one."""
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{tmp_path / 'kit.db'}")
    monkeypatch.setenv("KIT_SESSION", f"sqlite:///{tmp_path / 'sessions.db'}")
    monkeypatch.setenv("KIT_LEASE_SECONDS", "0.5")
    child = subprocess.Popen([sys.executable, "-c", KILLED], cwd=HERE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(HERE)})
    try:
        line = await anyio.to_thread.run_sync(child.stdout.readline)
        assert line.strip() == "entered"
    finally:
        child.kill()  # SIGKILL
        child.wait()
        child.stdout.close()
    model = ScriptedModel(["hello"])
    async with Deck([Agent("worker", model=model)]) as deck:
        killed = [i for i in await deck._runtime.store.runs(session_id="s")
                  if i.status is not RunStatus.COMPLETED]
        assert len(killed) == 1
        with anyio.fail_after(20):  # recorded abandoned once the dead process's lease lapsed
            while await deck.status(killed[0].run_id) is RunStatus.RUNNING:
                await anyio.sleep(0.05)
        log = await deck._runtime.store.read(killed[0].run_id)
        assert log[-1].payload.error == "RunAbandoned"
        assert (await deck.run("worker", "hi", session_id="s")).output == "hello"
    assert said(model) == ["remember 7", "noted", "hi"]


class HeldReads(SQLiteStore):
    """The real SQLite store whose next read of a run's log waits while ``hold`` is set: a
    caller that read the run index, then lost the CPU before reading the log."""

    hold: anyio.Event | None = None
    holding: anyio.Event | None = None

    async def read(self, run_id, after=-1):
        if self.hold is not None:
            hold, self.hold = self.hold, None
            self.holding.set()
            await hold.wait()
        return await super().read(run_id, after)


RESUMER = """
import os, sys, time, anyio, kit
from kit_store import SQLiteStore

def wait(step: int) -> str:
    \"\"\"Wait for the test.\"\"\"
    print("entered", flush=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return f"step {step} done"

async def main():  # another replica resumes the paused run; its tool waits for the test
    agent = kit.Agent("worker", tools=[wait], model=kit.ScriptedModel(
        [{"tool": "wait", "args": {"step": 1}}, "all done"]))
    async with SQLiteStore(sys.argv[1]) as store:
        async with kit.Deck([agent], store=store) as deck:
            print(kit.RunStatus(await deck.status(sys.argv[2])).value
                  if not await deck.resume(sys.argv[2]) else "resumed", flush=True)

anyio.run(main)
"""


async def test_a_paused_run_resumed_meanwhile_elsewhere_is_not_taken_again(tmp_path):
    """A replica saw the run PAUSED in the index, then read its log after another replica had
    resumed it: it wrote its own resume after the other's events and played the run too (the
    tool ran in both processes, and the first player's next event was refused)."""
    run_id, release = kit.new_run_id(), tmp_path / "release"
    gate = Gate()
    async with HeldReads(tmp_path / "kit.db") as store:
        await store.append([  # a paused agent run, as another process left it
            Event(run_id, 0, kit.RunStarted("worker", "agent", None, None, (kit.TextBlock("go"),)),
                  "worker"),
            Event(run_id, 1, kit.ControlRequested("pause", None, "api"), "worker"),
            Event(run_id, 2, kit.RunPaused(None, [{"role": "user", "content": "go"}]), "worker")])
        async with Deck([multi_turn_agent(gate)], store=store) as deck:
            results: list = []
            child = subprocess.Popen([sys.executable, "-c", RESUMER, str(tmp_path / "kit.db"),
                                      run_id, str(release)], cwd=HERE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONPATH": str(HERE)})
            try:
                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tg:
                        store.hold, store.holding = anyio.Event(), anyio.Event()
                        hold = store.hold

                        async def resume() -> None:
                            results.append(await deck.resume(run_id))
                        tg.start_soon(resume)
                        await store.holding.wait()  # this deck saw PAUSED, and waits to read
                        line = await anyio.to_thread.run_sync(child.stdout.readline)
                        assert line.strip() == "entered"  # the other replica plays it
                        hold.set()
                    release.touch()
                    gate.release.set()
                    out = await anyio.to_thread.run_sync(child.communicate)
            finally:
                release.touch()
                gate.release.set()
                child.kill()
            assert out[0].strip() == "resumed" and child.returncode == 0
            log = await store.read(run_id)
            assert results == [[]] and not gate.entered.is_set()  # nothing played here
            assert kinds(log).count("run.resumed") == 1 and kinds(log)[-1] == "run.completed"
            assert [e.seq for e in log] == list(range(len(log)))


async def test_a_value_the_store_cannot_hold_costs_only_its_own_run(shared_url):
    """Were such a value to get past kit's checks, the store refuses it (``ConfigError``) rather
    than reporting an outage: the writer commits the batch's other runs and hands the refusal to
    the run it belongs to, where a retry, forever, would have held every run behind it."""
    unstorable = {"a lone surrogate": "s\ud800"}
    if shared_url.startswith("postgresql"):
        unstorable |= {"a NUL": "s\x00", "an unindexable id": secrets.token_urlsafe(3000)}
    deep: list = []
    for _ in range(5000):  # no JSON text: the serialiser's recursion gives out
        deep = [deep]
    bad_payloads = {label: kit.RunStarted("a", "agent", session_id)
                    for label, session_id in unstorable.items()}
    bad_payloads["data nested past the recursion limit"] = kit.NodeUpdated("n", deep)
    async with store_from_url(shared_url) as store:
        for label, payload in bad_payloads.items():
            session_id = unstorable.get(label)
            committed: list[Event] = []
            writer = kit_writer.Writer(store, committed.extend, lambda *args: None)
            good, bad = kit.new_run_id(), kit.new_run_id()
            writer.put(Event(good, 0, kit.RunStarted("a", "agent", "fine"), "a"))
            writer.put(Event(bad, 0, payload, "a"))
            with anyio.fail_after(10):
                await writer.flush()
            assert writer.pending == 0 and writer.down_since is None, label
            assert isinstance(writer.failed[bad], kit.ConfigError), label
            assert str(writer.failed[bad]).startswith("the event store cannot hold a value it was given")
            assert [e.run_id for e in committed] == [good], label
            assert await store.read(bad) == [] and len(await store.read(good)) == 1, label
            if session_id is not None and label != "an unindexable id":  # (only too long to index)
                with pytest.raises(kit.ConfigError, match="cannot hold a value"):
                    await store.runs(session_id=session_id)  # a read is refused alike


def deck_for_http() -> Deck:
    return Deck([Agent("a", model=ScriptedModel(["ok"], cycle=True))])


def linear() -> StateGraph:
    g = StateGraph(State)

    async def note(state: State) -> dict:
        return {"log": ["noted"]}
    g.add_node("note", note)
    g.add_edge(START, "note")
    g.add_edge("note", END)
    return g


# ------------------------------------------------------------- racing writers of one run ----

async def race_in_one_commit(store: FaultyStore, deck: Deck, stalled_call, *calls) -> list:
    """Play ``calls`` at once while ``stalled_call``'s commit stalls at the store: their writes
    gather in one group commit. Their results, or what each raised, in order."""
    results: list = [None] * len(calls)

    async def play(i: int, call) -> None:
        try:
            results[i] = await call()
        except kit.KitError as exc:
            results[i] = exc
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            async with store.stall():
                tg.start_soon(stalled_call)
                await store.stalled.wait()
                for i, call in enumerate(calls):
                    tg.start_soon(play, i, call)
                await anyio.sleep(0.2)  # each has read the log and put its write in the buffer
    return results


async def test_two_answers_racing_in_one_commit_one_wins_and_the_log_has_all_of_its_run(tmp_path):
    """Both callers' run.resumed at one seq in one batch: the store refused the batch, both
    writes were dropped, and the caller that heard no refusal played on without its first
    event (a gap in the log where its run.resumed belonged)."""
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck(workflows=[durable_approval()], store=store) as deck:
            x = await deck.run("approval", {"log": []}, session_id="x")
            other = await deck.run("approval", {"log": []}, session_id="other")
            results = await race_in_one_commit(
                store, deck, lambda: deck.answer(other.run_id, "fine"),
                lambda: deck.answer(x.run_id, "a"), lambda: deck.answer(x.run_id, "b"))
            [won] = [r for r in results if isinstance(r, dict)]
            assert [type(r) for r in results].count(kit.RunNotWaitingError) == 1, results
            log = await store.read(x.run_id)
            assert seqs(log) == list(range(len(log)))
            assert [e.kind for e in log].count("run.resumed") == 1 and log[-1].kind == "run.completed"
            assert log[-1].payload.output["answer"] == won["answer"]
            assert await deck.status(x.run_id) is RunStatus.COMPLETED


async def test_two_runs_given_one_run_id_at_once_one_plays_and_the_log_has_its_start(tmp_path):
    """Both starts at seq 0 in one batch: both were dropped, and the run that played had no
    run.started (invisible to runs() and status) and no claim."""
    agent = Agent("a", model=ScriptedModel(["hello there"], cycle=True))
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck([agent], store=store) as deck:
            results = await race_in_one_commit(
                store, deck, lambda: deck.run("a", "other", run_id="other"),
                lambda: deck.run("a", "hi", run_id="same"), lambda: deck.run("a", "hi", run_id="same"))
            assert sorted(type(r).__name__ for r in results) == ["LogConflictError", "TurnResult"]
            log = await store.read("same")
            assert log[0].kind == "run.started" and seqs(log) == list(range(len(log)))
            assert await deck.status("same") is RunStatus.COMPLETED


async def test_a_cancel_that_meets_an_answer_leaves_the_thread_to_the_answered_run(tmp_path):
    """The cancel of a parked run met the answer taking it over: its write was refused, and it
    went on to forget the workflow's thread, whose run was playing on from it. (It then
    dropped the cancel too: the answered run is the one to hear it, at its first safe point.)"""
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck(workflows=[durable_approval()], store=store) as deck:
            x = await deck.run("approval", {"log": []}, session_id="x")
            release, answered = anyio.Event(), []

            async def answer() -> None:
                answered.append(await deck.answer(x.run_id, "yes"))

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    await tg.start(store.held, release)
                    tg.start_soon(functools.partial(_raises, kit.RunStoppedError, answer))
                    await store.stalled.wait()  # the answer's take-over is in flight
                    tg.start_soon(set_after, release, 0.3)
                    await deck.cancel(x.run_id, reason="changed my mind")
            log = await store.read(x.run_id)
            assert kinds(log)[-3:] == ["run.resumed", "control.requested", "run.cancelled"]
            assert log[-1].payload.reason == "changed my mind" and seqs(log) == list(range(len(log)))
            again = await deck.run("approval", {"log": []}, session_id="x")  # the thread goes on
            assert isinstance(again, kit.InterruptResult) and again.payload == {"question": "approve?"}


async def set_after(event: anyio.Event, seconds: float) -> None:
    await anyio.sleep(seconds)
    event.set()


async def _raises(error: type[BaseException], fn) -> None:
    with pytest.raises(error):
        await fn()


async def test_a_stream_made_while_open_and_read_after_close_writes_nothing(tmp_path):
    """It wrote its run.started (or took a parked run over) and then failed with an
    AttributeError: the session stayed busy, the approval was lost."""
    agent = Agent("a", model=ScriptedModel(["hi"], cycle=True))
    async with SQLiteStore(tmp_path / "kit.db") as store:
        async with Deck([agent], [durable_approval()], store=store) as deck:
            parked = await deck.run("approval", {"log": []}, session_id="t")
            late = [deck.stream("a", "hi", session_id="s"), deck.stream_answer(parked.run_id, "yes")]
        for stream in late:
            with pytest.raises(kit.DeckStateError, match="CLOSED"):
                await stream.__anext__()
        assert [r.run_id for r in await store.runs()] == [parked.run_id]
        async with Deck([agent], [durable_approval()], store=store) as deck:
            assert (await deck.run("a", "again", session_id="s")).output == "hi"
            assert (await deck.answer(parked.run_id, "yes"))["answer"] == "yes"


async def test_closing_the_deck_records_the_end_of_a_child_run_in_flight(tmp_path):
    """The deck waited for its parents only; the SDK may let a cancelled tool (a child
    workflow run) finish after its agent: the child's end came after the last flush, and the
    child stayed RUNNING with its lease until another process reaped it."""
    gate = Gate()
    agent = Agent("a", workflows=["slow"], model=ScriptedModel([{"tool": "slow", "args": {}}, "done"]))
    async with SQLiteStore(tmp_path / "kit.db") as store:
        async with Deck([agent], [slow_flow(gate)], store=store) as deck:
            stream = deck.stream("a", "go", session_id="s")
            await stream.__anext__()
            await gate.until_entered()
        gate.release.set()
        with anyio.fail_after(10):
            assert [e.kind async for e in stream][-1] == "run.cancelled"
        runs = {r.name: r for r in await store.runs()}
        assert runs["a"].status is RunStatus.CANCELLED
        assert runs["slow"].status is RunStatus.CANCELLED, runs["slow"]
        child = await store.read(runs["slow"].run_id)
        assert child[-1].kind == "run.cancelled" and child[-1].payload.reason == "the deck closed"
        assert await store.session_holder("s") is None


async def test_a_cancelled_caller_goes_on_once_its_child_runs_end_is_in_the_log(tmp_path):
    """The SDK does not wait for a cancelled tool: the caller of an agent whose child workflow
    run was playing went on while the child's log still ended at run.started (RUNNING, its
    run.cancelled some milliseconds later)."""
    gate = Gate()
    agent = Agent("a", workflows=["slow"], model=ScriptedModel([{"tool": "slow", "args": {}}, "done"]))
    async with SQLiteStore(tmp_path / "kit.db") as store:
        async with Deck([agent], [slow_flow(gate)], store=store) as deck:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(functools.partial(deck.run, "a", "go", session_id="s"))
                    await gate.until_entered()
                    tg.cancel_scope.cancel()
            runs = {r.name: r.status for r in await store.runs()}  # read before anything else
            gate.release.set()
            assert runs == {"a": RunStatus.CANCELLED, "slow": RunStatus.CANCELLED}


class Trickle(ScriptedModel):
    """A ScriptedModel that streams its reply slowly, as a real model's long answer comes."""

    async def stream_response(self, *args, **kwargs):
        async for event in super().stream_response(*args, **kwargs):
            await anyio.sleep(0.01)  # the engine side: asyncio, under trio too
            yield event


async def test_a_run_reaped_while_its_process_lives_stops_and_writes_nothing_more(tmp_path, monkeypatch):
    """A process that cannot renew its lease for longer than the lease (frozen, or its file
    locked) has its run reaped as abandoned by another. It played on to its end: its next batch
    was refused, its later ones and a second end were written around the reaper's, the index
    said COMPLETED again, and its caller heard of it only once the reply was done."""
    monkeypatch.setenv("KIT_LEASE_SECONDS", "0.5")
    gate = Gate()
    agent = Agent("a", tools=[gate.wait_tool()],
                  model=Trickle([{"tool": "wait", "args": {"step": 1}}, LONG], cycle=True))
    async with FaultyStore(tmp_path / "kit.db") as store, SQLiteStore(tmp_path / "kit.db") as other:
        async with Deck([agent], store=store) as deck:
            seen: list = []

            async def play() -> None:
                try:
                    async for event in deck.stream("a", "go", session_id="s"):
                        seen.append(event)
                except kit.KitError as exc:
                    seen.append(exc)
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(play)
                    await gate.until_entered()
                    store.fail_background = 10_000  # its renewals fail: its lease lapses
                    await anyio.sleep(1.0)
                    [reaped] = await other.reap()
                    store.fail_background = 0
                    gate.release.set()
            assert isinstance(seen[-1], kit.LogConflictError), seen[-1]
            # Stopped at the refusal, not at the end of its 300-word reply.
            assert [e.kind for e in seen[:-1]].count("text.delta") < 100
            [info] = await store.runs()
            log = await store.read(reaped)
            assert info.run_id == reaped and info.status is RunStatus.FAILED
            assert seqs(log) == list(range(len(log)))
            assert [e.kind for e in log][-2:] == ["tool.started", "run.failed"], [e.kind for e in log]
            assert log[-1].payload.error == "RunAbandoned"
            assert (await deck.run("a", "again", session_id="s")).output == LONG


async def test_a_cancelled_callers_run_is_durably_cancelled_when_run_returns(tmp_path):
    gate = Gate()
    agent = Agent("a", tools=[gate.wait_tool()], model=ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "x"]))
    async with SQLiteStore(tmp_path / "kit.db") as store:
        async with Deck([agent], store=store) as deck:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    async def call() -> None:
                        await deck.run("a", "go", session_id="s")
                    tg.start_soon(call)
                    await gate.until_entered()
                    tg.cancel_scope.cancel()  # the caller gives up
                gate.release.set()
                [info] = await store.runs(session_id="s")
                # Read straight after the caller returned: the end is in the log already.
                log = await store.read(info.run_id)
                assert log[-1].kind == "run.cancelled" and info.status is RunStatus.CANCELLED


@pytest.mark.parametrize("play", ["start", "resume"])
async def test_a_caller_cancelled_while_its_first_write_waits_for_the_store_ends_its_run(tmp_path, play):
    """A run's start with a session (or a paused run's take-over) is committed before it
    plays; its caller, cancelled while that write waited behind a slow commit, left it to the
    writer, which committed it after all: the run had no end, and held its session until its
    lease lapsed (then recorded abandoned)."""
    gate = Gate()
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck([multi_turn_agent(gate), Agent("b", model=ScriptedModel(["ok"], cycle=True))],
                        store=store) as deck:
            run_id = "r1"
            if play == "resume":
                async with anyio.create_task_group() as tg:
                    await start_in_background(tg, deck, [], "worker", "go", session_id="s", run_id=run_id)
                    await gate.until_entered()
                    await deck.pause(run_id)
                    gate.release.set()
            release = anyio.Event()

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    await tg.start(store.held, release)
                    tg.start_soon(functools.partial(deck.run, "b", "x"))  # its commit stalls
                    await store.stalled.wait()
                    tg.start_soon(set_after, release, 0.5)
                    with anyio.move_on_after(0.2) as impatient:  # waits behind it, gives up
                        if play == "start":
                            await deck.run("worker", "go", session_id="s", run_id=run_id)
                        else:
                            await deck.resume(run_id)
                    assert impatient.cancelled_caught
                log = await store.read(run_id)
                assert log[-1].payload == kit.RunCancelled("the caller was cancelled"), kinds(log)
                assert seqs(log) == list(range(len(log)))
                assert await store.session_holder("s") is None
                assert (await deck.run("b", "next", session_id="s")).output == "ok"


async def test_a_cancel_that_meets_a_resumes_take_over_cancels_the_resumed_run(tmp_path):
    """A cancel asked while a paused run's resume was being committed found the run neither
    playing (not taken over yet) nor parked (the resume held its seq): it was dropped, and
    the run played on to its end."""
    gate = Gate()
    async with FaultyStore(tmp_path / "kit.db") as store:
        async with Deck([multi_turn_agent(gate)], store=store) as deck:
            async with anyio.create_task_group() as tg:
                await start_in_background(tg, deck, [], "worker", "go", session_id="s", run_id="r1")
                await gate.until_entered()
                await deck.pause("r1")
                gate.release.set()
            release, resumed = anyio.Event(), []

            async def resume() -> None:
                resumed.extend(await deck.resume("r1"))
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    await tg.start(store.held, release)
                    tg.start_soon(resume)
                    await store.stalled.wait()  # the resume is being committed
                    tg.start_soon(set_after, release, 0.3)
                    await deck.cancel("r1", reason="stop it")
            assert resumed[-1].payload == kit.RunCancelled("stop it"), kinds(resumed)
            assert "model.completed" not in kinds(resumed)
            log = await store.read("r1")
            assert seqs(log) == list(range(len(log)))
            assert await deck.status("r1") is RunStatus.CANCELLED


async def test_pause_and_cancel_act_from_the_moment_a_run_id_exists(tmp_path):
    async with SQLiteStore(tmp_path / "kit.db") as store:
        async with Deck([Agent("a", model=ScriptedModel(["never said"]))], store=store) as deck:
            stream = deck.stream("a", "hi")
            started = await stream.__anext__()  # sequenced, not committed yet
            await deck.cancel(started.run_id, reason="changed my mind")
            with anyio.fail_after(10):
                rest = [e async for e in stream]
            assert rest[-1].kind == "run.cancelled" and rest[-1].payload.reason == "changed my mind"
            assert "text.delta" not in [e.kind for e in rest]


def slow_flow(gate: Gate) -> Workflow:
    def wait(state: State) -> dict:  # sync: LangGraph runs it in a thread
        gate.entered.set()
        gate.release.wait(10)
        return {"log": ["waited"]}

    async def after(state: State) -> dict:
        return {"log": ["after"]}
    g = StateGraph(State)
    g.add_node("wait", wait)
    g.add_node("after", after)
    g.add_edge(START, "wait")
    g.add_edge("wait", "after")
    g.add_edge("after", END)
    return Workflow("slow", g)


async def test_a_child_workflow_run_can_be_cancelled(tmp_path):
    gate = Gate()
    agent = Agent("a", workflows=["slow"], model=ScriptedModel([{"tool": "slow", "args": {}}, "the parent goes on"]))
    async with SQLiteStore(tmp_path / "kit.db") as store:
        async with Deck([agent], [slow_flow(gate)], store=store) as deck:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    results: list = []

                    async def call() -> None:
                        results.append(await deck.run("a", "go"))
                    tg.start_soon(call)
                    await gate.until_entered()
                    [child] = await store.runs(name="slow")
                    assert child.parent_run_id is not None
                    await deck.cancel(child.run_id, reason="stop the child")
                    gate.release.set()
            log = await store.read(child.run_id)
            assert log[-1].kind == "run.cancelled" and "after" not in json.dumps([e.to_json() for e in log])
            assert results[0].output == "the parent goes on"


async def test_requests_that_cannot_act_are_refused_over_http_and_the_cli(tmp_path, monkeypatch):
    from test_kit_cli import kit_cli
    from test_kit_workflows import ask, graph, plan
    db = tmp_path / "kit.db"
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{db}")
    deck = Deck([Agent("a", model=ScriptedModel(["ok"], cycle=True))],
                [Workflow("approve", graph(plan, ask))])
    async with served(deck) as (client, app):
        parked = (await client.post("/workflows/approve", json={"input": {}})).json()["run_id"]
        done = (await client.post("/agents/a/chat", json={"message": "hi"})).headers["x-kit-run-id"]
        r = await client.post(f"/runs/{parked}/pause")
        assert (r.status_code, r.json()["error"]) == (409, "ControlRefusedError")
        assert "WAITING_HUMAN" in r.json()["message"]
        for action in ("pause", "cancel"):
            r = await client.post(f"/runs/{done}/{action}")
            assert (r.status_code, r.json()["error"]) == (409, "ControlRefusedError")
        for signal in ("pause", "cancel", "resume"):
            out = await anyio.to_thread.run_sync(kit_cli, "runs", "signal", done, signal, "--store", f"sqlite:///{db}")
            assert out.returncode == 1 and "COMPLETED" in out.stderr, out
        out = await anyio.to_thread.run_sync(kit_cli, "runs", "signal", parked, "pause", "--store", f"sqlite:///{db}")
        assert out.returncode == 1 and "WAITING_HUMAN" in out.stderr
        r = await client.post(f"/runs/{parked}/cancel")  # a parked run is cancelled at once
        assert r.status_code == 202 and await app.deck.status(parked) is RunStatus.CANCELLED


async def test_replay_goes_past_a_parking_the_run_went_on_from_and_bad_seqs_are_400(tmp_path, monkeypatch):
    from test_kit_workflows import ask, graph, plan
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{tmp_path / 'kit.db'}")
    deck = Deck(workflows=[Workflow("approve", graph(plan, ask))])
    async with served(deck) as (client, app):
        body = (await client.post("/workflows/approve", json={"input": {}, "thread_id": "t1"})).json()
        run_id = body["run_id"]
        r = await client.get(f"/runs/{run_id}/events")  # parked: the stream ends at the parking
        assert r.text.rstrip().split("\n")[-2] == "event: run.interrupted"
        r = await client.post("/workflows/approve/t1/resume", json={"value": "yes"})
        assert r.status_code == 200
        r = await client.get(f"/runs/{run_id}/events")  # went on: replayed to the end
        events = [line for line in r.text.split("\n") if line.startswith("event: ")]
        assert "event: run.interrupted" in events and events[-1] == "event: run.completed"
        for bad in ("-5", "99999999999999999999", "12345"):
            r = await client.get(f"/runs/{run_id}/events?after={bad}")
            assert r.status_code in (400, 204), bad
            assert r.status_code == (204 if bad == "12345" else 400), bad
        r = await client.get(f"/runs/{run_id}/events", headers={"Last-Event-ID": "-2"})
        assert r.status_code == 400 and r.json()["error"] == "MalformedRequestError"


# ---------------------------------------------------------------- observers and lifecycle ----

async def test_observers_never_see_what_the_log_refused(tmp_path):
    rec = Recorder()
    gate = Gate()
    agent = Agent("a", tools=[gate.wait_tool()], model=ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "x"]))
    async with SQLiteStore(tmp_path / "kit.db") as store:
        async with Deck([agent], store=store, observers=[rec]) as deck:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: deck.run("a", "first", session_id="s"))
                await gate.until_entered()
                with pytest.raises(kit.SessionBusyError):  # refused: its start is not the log's
                    await deck.run("a", "second", session_id="s")
                gate.release.set()
        runs = {i.run_id for i in await store.runs()}
    assert len(runs) == 1 and {e.run_id for e in rec.seen} == runs


STUCK_OBSERVER = """
import threading, time, anyio, kit, kit_observers
kit_observers.DRAIN_TIMEOUT = kit_observers.CLOSE_TIMEOUT = 0.2
class Stuck:
    def emit(self, event):
        threading.Event().wait()  # never returns
    def close(self):
        threading.Event().wait()
async def main():
    deck = kit.Deck([kit.Agent("a", model=kit.ScriptedModel(["ok"], cycle=True))], observers=[Stuck()])
    async with deck:
        for _ in range(5):
            await deck.run("a", "hi")
        hub = deck._runtime.hub
    [s] = hub.stats
    print(s.emitted, s.delivered, s.abandoned, flush=True)
anyio.run(main, backend=%r)
"""


async def test_a_stuck_observer_never_keeps_the_process_from_exiting(anyio_backend):
    started = time.monotonic()
    out = await anyio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-c", STUCK_OBSERVER % anyio_backend], cwd=HERE, capture_output=True,
        text=True, timeout=60))
    assert out.returncode == 0, out.stderr
    emitted, delivered, abandoned = map(int, out.stdout.split())
    assert emitted > 0 and delivered == 0 and abandoned == emitted  # counted, honestly
    assert time.monotonic() - started < 30


async def test_a_failed_open_frees_the_deck_slot_and_closing_from_another_task_is_refused(monkeypatch):
    monkeypatch.setenv("KIT_STORE", "mysql://nope")
    with pytest.raises(kit.ConfigError):
        async with Deck([Agent("a", model=ScriptedModel(["ok"]))]):
            pass
    monkeypatch.delenv("KIT_STORE")
    deck = Deck([Agent("a", model=ScriptedModel(["ok"]))])  # the slot is free
    async with deck:
        async with anyio.create_task_group() as tg:
            errors: list[BaseException] = []

            async def close_elsewhere() -> None:
                try:
                    await deck.aclose()
                except kit.DeckStateError as exc:
                    errors.append(exc)
            tg.start_soon(close_elsewhere)
        assert errors and "another task" in str(errors[0]) and "open it first" not in str(errors[0])
        assert (await deck.run("a", "still open")).output == "ok"


async def test_a_deck_called_from_another_threads_event_loop_is_refused_before_it_writes(tmp_path):
    """Under trio such a call wrote a run.started and its claim, then broke inside trio's
    scheduler (an AssertionError): the session stayed busy until the lease lapsed. Under asyncio
    it worked by luck, touching the deck's loop from another thread."""
    agent = Agent("a", model=ScriptedModel(["ok"], cycle=True))
    async with SQLiteStore(tmp_path / "kit.db") as store:
        async with Deck([agent], store=store) as deck:
            turn = functools.partial(deck.run, "a", "hi", session_id="s")
            for backend in ("asyncio", "trio"):
                with pytest.raises(kit.DeckStateError, match="another thread"):
                    await anyio.to_thread.run_sync(lambda: anyio.run(turn, backend=backend))
            assert await store.runs() == []
            assert (await anyio.to_thread.run_sync(anyio.from_thread.run, turn)).output == "ok"
            assert (await deck.run("a", "again", session_id="s")).output == "ok"


async def test_the_in_process_sessions_keep_a_bounded_number_of_conversations(monkeypatch):
    monkeypatch.setenv("KIT_SESSION_MAX", "3")
    async with Deck([Agent("a", model=ScriptedModel(["ok"], cycle=True))]) as deck:
        for i in range(10):
            await deck.run("a", f"turn {i}", session_id=f"s{i}")
        sessions = deck._runtime.sessions
        assert len(sessions) == 3
        db = sessions.memory.db
        kept = {r[0] for r in db.execute("SELECT DISTINCT session FROM items")}
        assert kept == {"s7", "s8", "s9"}  # least recently used dropped first
        assert await deck.session_for("s9").get_items()


# ------------------------------------------------------------------------- a locked file ----

LOCK_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
"""


async def test_a_file_locked_by_another_process_never_freezes_the_server(tmp_path, monkeypatch):
    """Another process holds the log's write lock for 20 s while a run streams: health answers
    within 1 s throughout, the run ends visibly, and its session takes a new turn afterwards."""
    db = tmp_path / "kit.db"
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{db}")
    gate = Gate()
    agent = Agent("a", tools=[gate.wait_tool()], model=ScriptedModel(
        [{"tool": "wait", "args": {"step": 1}}, LONG, "second turn"]))
    async with served(Deck([agent])) as (client, app):
        async with anyio.create_task_group() as tg:
            frames: list[str] = []

            async def stream() -> None:
                async with client.stream("POST", "/agents/a/chat?stream=true",
                                         json={"session_id": "s", "message": "go"},
                                         timeout=httpx.Timeout(60)) as r:
                    async for line in r.aiter_lines():
                        frames.append(line)
            tg.start_soon(stream)
            await gate.until_entered()
            holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(db), "20"],
                                      stdout=subprocess.PIPE, text=True)
            try:
                assert await anyio.to_thread.run_sync(holder.stdout.readline) == "locked\n"
                gate.release.set()  # the run goes on while the file is locked
                slowest = 0.0
                while holder.poll() is None:
                    began = time.monotonic()
                    r = await client.get("/health", timeout=5)
                    slowest = max(slowest, time.monotonic() - began)
                    assert r.status_code == 200
                    await anyio.sleep(0.2)
                assert slowest < 1.0, slowest
            finally:
                holder.kill()
                holder.wait()
                holder.stdout.close()
        # The stream ended visibly: the reply completed, or the run failed with its reason.
        assert any(line.startswith("event: done") or line.startswith("event: error") for line in frames)
        [info] = await app.deck.store.runs(session_id="s")
        with anyio.fail_after(30):
            while (await app.deck.status(info.run_id)) is RunStatus.RUNNING:
                await anyio.sleep(0.05)
        r = await client.post("/agents/a/chat", json={"session_id": "s", "message": "again"})
        assert (r.status_code, r.json()["output"]) == (200, "second turn")


# ---------------------------------------------------------------------------- kill -9 trials ----

@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_kill_9_loses_nothing_a_client_was_told(worker):
    """Real kit-serve, real SQLite file, clients streaming, SIGKILL, restart (faults_kit.py runs
    the same trials by the fifty): every frame a client got is in the log with the same kind and
    payload, no seq reused, every reconnect reaches the run's end, the file's integrity is ok."""
    import faults_kit
    counts = faults_kit.run_trials(2, clients=3, worker=worker, seed=7)
    assert counts.frames > 0 and counts.killed_mid_stream > 0
    assert (counts.missing, counts.mismatched, counts.integrity_failures) == (0, 0, 0), counts.problems
    # A client the kill cut before its headers was told nothing: nothing to pick up.
    assert counts.reconnects > 0 and counts.reached_end == counts.reconnects


async def test_more_ticks_at_once_than_checkpoint_connections_each_resume_a_thread(
        postgres_url, anyio_backend):
    """A ticker held a connection of the checkpointer's pool (``CHECKPOINT_POOL``, 4) for its
    thread's lock while the thread's run played, and that run's checkpoints wait for one too:
    four ticks at once took them all, and every resumed run waited ``POOL_TIMEOUT`` for a
    connection and failed (``deck.tick`` raised PoolTimeout). Locks have a pool of their own now
    (``LOCK_POOL``): more resumes at once than it holds wait for one, their runs unhindered."""
    from datetime import timedelta

    from kit_bridge import on_asyncio
    from test_kit_workflows import NOW, durable_sleeper
    threads = [f"t{i}" for i in range(max(kit_threads.CHECKPOINT_POOL,
                                          getattr(kit_threads, "LOCK_POOL", 0)) + 1)]
    ticked: list = []
    async with store_from_url(postgres_url) as store, \
            Deck(workflows=[durable_sleeper()], store=store) as deck:
        compiled = deck._runtime.graphs["sleeper"]
        wake_at = (NOW - timedelta(minutes=5)).isoformat()
        for thread in threads:  # asleep on threads only the checkpointer knows (no run parks them)
            await on_asyncio(functools.partial(compiled.ainvoke, {"log": [], "wake_at": wake_at},
                                               {"configurable": {"thread_id": f"sleeper::{thread}"}}))
        assert await deck.tick(NOW - timedelta(hours=1)) == []  # none due yet: the one scan

        async def tick() -> None:
            ticked.extend(await deck.tick(NOW))
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in threads:
                    tg.start_soon(tick)
        assert await deck.due_resumes(NOW) == []
    assert sorted(t.thread_id for t in ticked) == threads
    assert [t.result["log"][-1] for t in ticked] == ["done"] * len(threads)


# ------------------------------------------------------------------- the edges of a run's life ----

@pytest.mark.parametrize("call", ["run", "stream"])
async def test_a_run_starting_while_the_deck_closes_is_cancelled_with_it(tmp_path, call):
    """The deck closed while a turn's start (its claim and run.started) was being committed:
    the close did not see the run (not playing yet), and the turn played on after it (asyncio)
    or hung, then raised AttributeError (trio); the log kept it RUNNING with its session held
    until its lease lapsed. It is cancelled with the deck now, as a run playing at close is."""
    agent = Agent("a", model=ScriptedModel(["hello"], cycle=True))
    got: list = []
    async with FaultyStore(tmp_path / "kit.db") as store:
        release = anyio.Event()

        async def turn(deck: Deck) -> None:
            try:
                if call == "run":
                    got.append(await deck.run("a", "hi", session_id="s"))
                else:
                    got.extend([e async for e in deck.stream("a", "hi", session_id="s")])
            except kit.KitError as exc:
                got.append(exc)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                async with Deck([agent], store=store) as deck:
                    await tg.start(store.held, release)
                    tg.start_soon(turn, deck)
                    await store.stalled.wait()  # the turn's start is being committed
                    tg.start_soon(set_after, release, 0.2)
                # (the deck closes here, the start still in flight)
        [info] = await store.runs(session_id="s")
        log = await store.read(info.run_id)
        assert log[0].kind == "run.started" and "run.completed" not in kinds(log), kinds(log)
        assert log[-1].payload == kit.RunCancelled("the deck closed"), kinds(log)
        assert seqs(log) == list(range(len(log))) and info.status is RunStatus.CANCELLED
        if call == "run":
            [error] = got
            assert isinstance(error, kit.DeckStateError) and "CLOSED" in str(error), got
        else:
            assert kinds(got) == kinds(log), got
        assert await store.session_holder("s") is None
        async with Deck([agent], store=store) as deck:  # the session is free at once
            assert (await deck.run("a", "again", session_id="s")).output == "hello"


async def test_a_committed_stream_left_early_keeps_nothing_for_its_gone_reader(tmp_path):
    """A committed stream (what kit_http's SSE uses) left after its first event: the run played
    on, as it should, but went on filling its live buffer (up to LIVE_MAX events) for the reader
    that was gone, each event hurrying the writer for it."""
    gate = Gate()
    agent = Agent("a", tools=[gate.wait_tool()],
                  model=ScriptedModel([{"tool": "wait", "args": {"step": 1}}, LONG]))
    async with SQLiteStore(tmp_path / "kit.db") as store:
        async with Deck([agent], store=store) as deck:
            stream = deck.stream("a", "go", session_id="s", committed=True)
            first = await stream.__anext__()
            await stream.aclose()  # the reader leaves; the run goes on
            await gate.until_entered()
            run = deck._runtime.active[first.run_id]  # the run, as the deck holds it
            gate.release.set()
            with anyio.fail_after(10):
                while await deck.status(first.run_id) is RunStatus.RUNNING:
                    await anyio.sleep(0.01)
            assert not run.live, f"{len(run.live)} events kept for a reader that left"
            log = await store.read(first.run_id)
            assert seqs(log) == list(range(len(log))) and log[-1].kind == "run.completed"
            assert "".join(e.payload.text for e in log if e.kind == "text.delta") == LONG
            assert log[-1].payload.output == LONG
