"""Tests of run control: pause, cancel and resume, in process and from the CLI in another
process, for agents (safe point: before a model call) and workflows (between supersteps)."""
from __future__ import annotations

import operator
import subprocess
import sys
import threading
from pathlib import Path
from typing import Annotated, TypedDict

import anyio
import pytest
from langgraph.graph import END, START, StateGraph

import kit
from kit import Agent, Deck, RunStatus, ScriptedModel, Workflow
import kit_sessions
from kit_pg import PostgresStore
from kit_store import SQLiteStore

pytestmark = pytest.mark.anyio
HERE = Path(__file__).parent


def kinds(events):
    return [e.kind for e in events]


class Gate:
    """A tool that blocks until released; tools play on the engine side (a thread under trio)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def wait_tool(self):
        def wait(step: int) -> str:
            """Wait for the gate."""
            self.entered.set()
            self.release.wait(10)
            return f"step {step} done"
        return wait

    async def until_entered(self) -> None:
        assert await anyio.to_thread.run_sync(self.entered.wait, 10)


def multi_turn_agent(gate: Gate) -> Agent:
    script = [{"tool": "wait", "args": {"step": 1}}, {"tool": "wait", "args": {"step": 2}}, "all done"]
    return Agent("worker", tools=[gate.wait_tool()], model=ScriptedModel(script))


async def start_in_background(tg, deck, results, *args, **kw):
    async def play():
        try:
            results.append(await deck.run(*args, **kw))
        except Exception as exc:
            results.append(exc)
    tg.start_soon(play)


async def running_run_id(store) -> str:
    with anyio.fail_after(10):
        while not (infos := await store.runs(status=RunStatus.RUNNING)):
            await anyio.sleep(0.01)
    return infos[0].run_id


async def test_pause_stops_before_the_next_model_call_keeps_the_session_and_resumes(store):
    gate = Gate()
    async with Deck([multi_turn_agent(gate)], store=store) as deck:
        results: list = []
        async with anyio.create_task_group() as tg:
            await start_in_background(tg, deck, results, "worker", "go", session_id="s1")
            await gate.until_entered()
            run_id = await running_run_id(store)
            await deck.pause(run_id, reason="operator")
            assert await deck.status(run_id) is RunStatus.RUNNING  # a request is not a status
            gate.release.set()
        [stopped] = results
        assert isinstance(stopped, kit.RunStoppedError) and stopped.status is RunStatus.PAUSED
        log = await store.read(run_id)
        assert kinds(log)[-4:] == ["tool.started", "tool.completed", "control.requested", "run.paused"]
        assert log[-2].payload == kit.ControlRequested("pause", "operator", "api")
        assert kinds(log).count("model.completed") == 1  # stopped before the second model call
        assert await deck.status(run_id) is RunStatus.PAUSED
        with pytest.raises(kit.SessionBusyError):
            await deck.run("worker", "me too", session_id="s1")
        produced = await deck.resume(run_id)
        assert kinds(produced)[:2] == ["control.requested", "run.resumed"]
        assert produced[-1].kind == "run.completed" and produced[-1].payload.output == "all done"
        full = await store.read(run_id)
        assert [e.seq for e in full] == list(range(len(full)))
        assert full[-len(produced):] == produced
        assert await deck.resume(run_id) == []  # nothing left to resume
        # run.completed totals the whole run, the model calls before the pause too (it used to
        # count only those after the resume)
        calls = [e.payload for e in full if e.kind == "model.completed"]
        assert len(calls) == 3
        assert (full[-1].payload.usage.input_tokens, full[-1].payload.usage.output_tokens) == (
            sum(c.input_tokens for c in calls), sum(c.output_tokens for c in calls))


async def test_a_paused_sessionless_run_resumes_from_its_recorded_conversation(store):
    gate = Gate()
    async with Deck([multi_turn_agent(gate)], store=store) as deck:
        results: list = []
        async with anyio.create_task_group() as tg:
            await start_in_background(tg, deck, results, "worker", "go", run_id="r-nosession")
            await gate.until_entered()
            await deck.pause("r-nosession")
            gate.release.set()
        produced = await deck.resume("r-nosession")
        assert produced[-1].payload.output == "all done"
        tool_outputs = [e.payload.output for e in await store.read("r-nosession")
                        if e.kind == "tool.completed"]
        assert tool_outputs == ["step 1 done", "step 2 done"]


async def test_a_resume_reads_the_paused_runs_log_a_page_at_a_time(shared_url, tmp_path):
    """A resume summed the paused run's usage (run.completed totals the whole run) off its
    whole log, read in one go: a long run's every event in memory at each resume. It reads
    the log a page (READ_PAGE) at a time now, and the total still counts every model call."""
    from kit_storebase import READ_PAGE
    from test_kit_store import counting
    base, arg = ((PostgresStore, shared_url) if shared_url.startswith("postgresql") else
                 (SQLiteStore, tmp_path / "kit.db"))
    run_id, n = "long-paused", 2 * READ_PAGE + 7
    log = [kit.Event(run_id, 0, kit.RunStarted("worker", "agent", None, None,
                                               (kit.TextBlock("go"),)), "worker")]
    for seq in range(1, n - 1):  # a model call every 100 events, text between them
        log.append(kit.Event(run_id, seq, kit.ModelCompleted("m", 3, 5) if seq % 100 == 0
                             else kit.TextDelta("x"), "worker"))
    log.append(kit.Event(run_id, n - 1, kit.RunPaused("safe point", [
        {"role": "user", "content": "go"}]), "worker"))
    async with counting(base)(arg) as store:
        await store.append(log)
        async with Deck([Agent("worker", model=ScriptedModel(["all done"]))], store=store) as deck:
            store.sizes.clear()
            with anyio.fail_after(20):
                produced = await deck.resume(run_id)
            sizes = list(store.sizes)
        whole = await store.read(run_id)
    assert produced[-1].payload.output == "all done" and whole[n:] == produced
    calls = [e.payload for e in whole if e.kind == "model.completed"]
    assert len(calls) == (n - 2) // 100 + 1
    assert produced[-1].payload.usage.input_tokens == sum(c.input_tokens for c in calls)
    assert produced[-1].payload.usage.output_tokens == sum(c.output_tokens for c in calls)
    assert sizes and max(sizes) <= READ_PAGE, sizes


async def test_cancel_a_running_and_a_paused_run(store):
    gate = Gate()
    async with Deck([multi_turn_agent(gate)], store=store) as deck:
        results: list = []
        async with anyio.create_task_group() as tg:
            await start_in_background(tg, deck, results, "worker", "go", session_id="s1")
            await gate.until_entered()
            run_id = await running_run_id(store)
            await deck.cancel(run_id, reason="no longer needed")
            gate.release.set()
        assert results[0].status is RunStatus.CANCELLED
        assert (await store.read(run_id))[-1].payload == kit.RunCancelled("no longer needed")
        gate.entered.clear()
        gate.release.clear()
        results.clear()
        async with anyio.create_task_group() as tg:  # the session was freed
            await start_in_background(tg, deck, results, "worker", "again", session_id="s1")
            await gate.until_entered()
            paused_id = await running_run_id(store)
            await deck.pause(paused_id)
            gate.release.set()
        await deck.cancel(paused_id, reason="never mind")  # no writer: this call writes it
        assert kinds(await store.read(paused_id))[-2:] == ["control.requested", "run.cancelled"]
        assert await deck.status(paused_id) is RunStatus.CANCELLED
        assert await deck.resume(paused_id) == []
        with pytest.raises(kit.UnknownRunError):
            await deck.pause("no-such-run")


async def test_resume_of_a_run_that_is_not_paused_returns_nothing(store):
    async with Deck([Agent("a", model=ScriptedModel(["hi"]))], store=store) as deck:
        result = await deck.run("a", "x")
        assert await deck.resume(result.run_id) == []
        assert await deck.resume("a-run-the-log-has-never-seen") == []  # SPEC 3.2, 4.1
        assert [e async for e in deck.stream_resume("a-run-the-log-has-never-seen")] == []


class BothAtOnce(SQLiteStore):
    """Once ``racing``, holds the first reader of a run's log until a second one has read it."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.racing, self.waiting, self.both = False, 0, anyio.Event()

    async def read(self, run_id, after=-1):
        events = await super().read(run_id, after)
        if self.racing and self.waiting < 2:
            self.waiting += 1
            if self.waiting == 2:
                self.both.set()
            await self.both.wait()
        return events


@pytest.mark.parametrize("committed", [False, True])
async def test_two_callers_racing_to_resume_one_run_stream_it_once(store, committed):
    """One of two streamed resumes of the same paused run wins and streams the rest of the run to
    its end; the other gets nothing, and leaves the winner's live stream alone."""
    gate = Gate()
    store = BothAtOnce(store.path)  # both callers see the run paused before either takes it
    async with store, Deck([multi_turn_agent(gate)], store=store) as deck:
        results: list = []
        async with anyio.create_task_group() as tg:
            await start_in_background(tg, deck, results, "worker", "go", run_id="r-race")
            await gate.until_entered()
            await deck.pause("r-race")
            gate.release.set()
        streams: list[list] = []

        async def resume() -> None:
            streams.append([e async for e in deck.stream_resume("r-race", committed=committed)])

        store.racing = True
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(resume)
                tg.start_soon(resume)
        won, lost = sorted(streams, key=len, reverse=True)
        assert lost == []
        assert kinds(won)[:2] == ["control.requested", "run.resumed"]
        assert won[-1].kind == "run.completed" and won[-1].payload.output == "all done"
        assert won == (await store.read("r-race"))[-len(won):]


class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


GATE = Gate()


def first(state: State) -> dict:
    GATE.entered.set()
    GATE.release.wait(10)
    return {"log": ["first"]}


async def second(state: State) -> dict:
    return {"log": ["second"]}


async def test_a_workflow_pauses_between_supersteps_and_resumes(store):
    GATE.entered.clear()
    GATE.release.clear()
    graph = StateGraph(State).add_node("first", first).add_node("second", second)
    graph.add_edge(START, "first").add_edge("first", "second").add_edge("second", END)
    async with Deck(workflows=[Workflow("steps", graph, durable=True)], store=store) as deck:
        results: list = []
        async with anyio.create_task_group() as tg:
            await start_in_background(tg, deck, results, "steps", {"log": []}, session_id="t1")
            await GATE.until_entered()
            run_id = await running_run_id(store)
            await deck.pause(run_id)
            GATE.release.set()
        assert results[0].status is RunStatus.PAUSED
        assert kinds(await store.read(run_id))[-3:] == ["node.updated", "control.requested", "run.paused"]
        produced = await deck.resume(run_id)
        assert [e.payload.node for e in produced if e.kind == "node.updated"] == ["second"]
        assert produced[-1].payload.output == {"log": ["first", "second"]}


async def test_requests_made_while_no_deck_was_open_are_acted_on_when_one_opens(tmp_path):
    """`kit runs signal` against a stopped service records its request; the next deck to open
    acts on it (a cancel of a parked run, a resume of a paused one no pause followed)."""
    gate, names, reads = Gate(), ("cancel", "resume", "kept"), []

    def agents(*script):
        return [Agent(name, tools=[gate.wait_tool()], model=ScriptedModel(list(script)))
                for name in names]

    class Reads(SQLiteStore):  # which requests a deck reads
        async def requests(self, after=0, run_ids=None):
            reads.append((after, run_ids))
            return await super().requests(after, run_ids)

    async with Reads(tmp_path / "kit.db") as store:
        async with Deck(agents({"tool": "wait", "args": {"step": 1}}, "all done"), store=store) as deck:
            for name in names:
                gate.entered.clear()
                gate.release.clear()
                async with anyio.create_task_group() as tg:
                    await start_in_background(tg, deck, [], name, "go", run_id=name)
                    await gate.until_entered()
                    await deck.pause(name)
                    gate.release.set()
        # No deck is open: the requests are only recorded (as `kit runs signal` records them).
        await store.request("cancel", "resume", None, "cli")
        await store.request("cancel", "cancel", "stop it", "cli")
        await store.request("resume", "resume", None, "cli")
        await store.request("kept", "resume", None, "cli")
        await store.request("kept", "pause", None, "cli")  # a later pause: the run stays
        last, reads = await store.last_request_id(), []
        async with Deck(agents("all done"), store=store):
            with anyio.fail_after(10):
                while (await store.run_info("cancel")).status is not RunStatus.CANCELLED or \
                        (await store.run_info("resume")).status is not RunStatus.COMPLETED:
                    await anyio.sleep(0.02)
        assert (await store.read("cancel"))[-1].payload == kit.RunCancelled("stop it")
        assert (await store.read("resume"))[-1].payload.output == "all done"
        assert (await store.run_info("kept")).status is RunStatus.PAUSED
        # The open read the parked runs' requests, not every one the log took (the watch goes
        # on from the newest).
        assert (0, sorted(names)) in [(a, sorted(ids or [])) for a, ids in reads]
        assert all(ids is not None or after >= last for after, ids in reads), reads


async def test_the_cli_pauses_a_run_playing_in_another_process(tmp_path):
    db = tmp_path / "kit.db"
    gate = Gate()
    async with SQLiteStore(db) as store:
        async with Deck([multi_turn_agent(gate)], store=store) as deck:
            results: list = []
            async with anyio.create_task_group() as tg:
                await start_in_background(tg, deck, results, "worker", "go", session_id="s1")
                await gate.until_entered()
                run_id = await running_run_id(store)
                out = await anyio.to_thread.run_sync(lambda: subprocess.run(
                    [sys.executable, "-m", "kit_cli", "runs", "signal", run_id, "pause",
                     "--store", f"sqlite:///{db}", "--reason", "from the cli"],
                    cwd=HERE, capture_output=True, text=True, timeout=60))
                assert out.returncode == 0, out.stderr
                with anyio.fail_after(10):  # this deck's poll picks the request up
                    while deck._runtime.active[run_id].requested is None:
                        await anyio.sleep(0.01)
                gate.release.set()
            assert results[0].status is RunStatus.PAUSED
            paused = await store.read(run_id)
            assert paused[-2].payload == kit.ControlRequested("pause", "from the cli", "cli")
            out = await anyio.to_thread.run_sync(lambda: subprocess.run(
                [sys.executable, "-m", "kit_cli", "runs", "signal", "nope", "cancel",
                 "--store", f"sqlite:///{db}"], cwd=HERE, capture_output=True, text=True, timeout=60))
            assert out.returncode == 1 and "nope" in out.stderr
            out = await anyio.to_thread.run_sync(lambda: subprocess.run(
                [sys.executable, "-m", "kit_cli", "runs", "signal", run_id, "resume",
                 "--store", f"sqlite:///{db}"], cwd=HERE, capture_output=True, text=True, timeout=60))
            assert out.returncode == 0
            with anyio.fail_after(10):  # a resume request is taken up by a deck that has the agent
                while await deck.status(run_id) is not RunStatus.COMPLETED:
                    await anyio.sleep(0.02)


async def test_a_resume_whose_session_cannot_be_made_leaves_the_run_paused(store):
    """A session factory that fails (its backend down) when a paused run is resumed: the
    resume raises and writes nothing, the run stays PAUSED (a later resume plays it, a cancel
    ends it). It was taken over first: RUNNING, played by nobody and held by this deck, so a
    cancel never reached it and its lease was renewed until the deck closed."""
    gate = Gate()
    model = ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "all done"], cycle=True)
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store) as deck:
        results: list = []
        async with anyio.create_task_group() as tg:
            await start_in_background(tg, deck, results, "worker", "go", session_id="s1")
            await gate.until_entered()
            run_id = await running_run_id(store)
            await deck.pause(run_id)
            gate.release.set()
    paused = await store.read(run_id)
    down = [True]

    def factory(key):
        if down[0]:
            raise ConnectionError("the session backend is down")
        return kit_sessions.MemorySession(memory, key)

    memory = kit_sessions._MemoryDB()
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store,
                    session_factory=factory) as deck:
        with pytest.raises(ConnectionError):
            await deck.resume(run_id)
        assert await store.read(run_id) == paused and await deck.status(run_id) is RunStatus.PAUSED
        with pytest.raises(ConnectionError):
            [e async for e in deck.stream_resume(run_id)]
        assert await store.read(run_id) == paused
        assert run_id not in deck._runtime._streams  # no stream left listed for its commits
        down[0] = False
        produced = await deck.resume(run_id)
        assert produced[-1].kind == "run.completed"


async def test_a_resume_requested_elsewhere_is_logged_with_its_reason_and_source(store):
    """`kit runs signal <id> resume --reason ...` (a request in the store): the run's
    control.requested says who asked and why, as a pause's does, whether a deck hears it live
    or at its next open; it said ("resume", None, "api") whoever asked."""
    gate = Gate()
    call = {"tool": "wait", "args": {"step": 1}}
    model = ScriptedModel([call, call, "all done", "all done", call, "all done"])

    async def paused(deck, run_id):
        gate.entered.clear()
        gate.release.clear()
        async with anyio.create_task_group() as tg:
            await start_in_background(tg, deck, [], "worker", "go", run_id=run_id)
            await gate.until_entered()
            await deck.pause(run_id)
            gate.release.set()

    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store) as deck:
        await paused(deck, "live")
        await paused(deck, "later")
        await store.request("live", "resume", "the operator says go", "cli")
        with anyio.fail_after(10):
            while await deck.status("live") is not RunStatus.COMPLETED:
                await anyio.sleep(0.02)
    await store.request("later", "resume", "after the restart", "cli")
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store) as deck:
        with anyio.fail_after(10):
            while await deck.status("later") is not RunStatus.COMPLETED:
                await anyio.sleep(0.02)
    for run_id, reason in (("live", "the operator says go"), ("later", "after the restart")):
        asked = [e.payload for e in await store.read(run_id) if e.kind == "control.requested"]
        assert asked[-1] == kit.ControlRequested("resume", reason, "cli")
    # deck.resume is the API's, with no reason
    async with Deck([Agent("worker", tools=[gate.wait_tool()], model=model)], store=store) as deck:
        await paused(deck, "here")
        await deck.resume("here")
    asked = [e.payload for e in await store.read("here") if e.kind == "control.requested"]
    assert asked[-1] == kit.ControlRequested("resume", None, "api")


async def ask_with_context(state: State, ctx: kit.Context[dict]) -> dict:
    answer = kit.interrupt({"question": "ok?"})
    return {"log": [f"{answer} for {ctx.data['who']}"]}


async def test_the_control_methods_take_their_arguments_by_position_as_spec_writes_them(store):
    """SPEC 4.1 writes pause and cancel as (run_id, reason=...), resume as (run_id,
    context=None) and answer as (run_id, value, context=None): each takes them by position
    too. They were keyword-only: deck.answer(run_id, "yes", ctx) raised TypeError."""
    graph = StateGraph(State).add_node("ask", ask_with_context)
    graph.add_edge(START, "ask").add_edge("ask", END)
    gate = Gate()
    async with Deck([multi_turn_agent(gate)], [Workflow("asks", graph)], store=store) as deck:
        parked = await deck.run("asks", {"log": []}, context={"who": "ann"})
        assert await deck.answer(parked.run_id, "yes", {"who": "bob"}) == {"log": ["yes for bob"]}
        results: list = []
        async with anyio.create_task_group() as tg:
            await start_in_background(tg, deck, results, "worker", "go", run_id="r-pos")
            await gate.until_entered()
            await deck.pause("r-pos", "by position")
            gate.release.set()
        assert results[0].reason == "by position"
        assert (await deck.resume("r-pos", None))[-1].kind == "run.completed"
        parked = await deck.run("asks", {"log": []})
        await deck.cancel(parked.run_id, "no longer")
        assert (await store.read(parked.run_id))[-1].payload == kit.RunCancelled("no longer")


async def test_a_pause_after_a_cancel_does_not_undo_it(store):
    """Cancel, then pause, before the run's next safe point: the run is cancelled, as the next
    deck to open would have cancelled it (a parked run's first cancel wins there). The later
    pause replaced the cancel: the run paused, its session kept, the cancel never in its log."""
    gate = Gate()
    async with Deck([multi_turn_agent(gate)], store=store) as deck:
        results: list = []
        async with anyio.create_task_group() as tg:
            await start_in_background(tg, deck, results, "worker", "go", session_id="s1")
            await gate.until_entered()
            run_id = await running_run_id(store)
            await deck.cancel(run_id, reason="stop it")
            await deck.pause(run_id, reason="hold on")
            gate.release.set()
        assert results[0].status is RunStatus.CANCELLED
        log = await store.read(run_id)
        assert [e.payload for e in log[-2:]] == [
            kit.ControlRequested("cancel", "stop it", "api"), kit.RunCancelled("stop it")]
        assert (await deck.run("worker", "again", session_id="s1")).output  # the session is free



async def test_pending_reads_the_waiting_runs_questions_in_one_read_not_one_each(postgres_url):
    """deck.pending() (GET /workflows/pending) read each waiting run's question with a read
    of its own: a round trip per run on Postgres (5,000 waiting runs: 0.5-3.4 s a listing,
    measured, against ~25 ms for one read of them all)."""
    graph = StateGraph(State).add_node("ask", ask_with_context)
    graph.add_edge(START, "ask").add_edge("ask", END)
    reads: list[str] = []

    class Reads(PostgresStore):  # which runs' logs are read
        async def read(self, run_id, after=-1):
            reads.append(run_id)
            return await super().read(run_id, after)

    async with Reads(postgres_url) as store, \
            Deck(workflows=[Workflow("asks", graph)], store=store) as deck:
        parked = [await deck.run("asks", {"log": []}, context={"who": "ann"}) for _ in range(3)]
        await deck.answer(parked[1].run_id, "yes", {"who": "bob"})  # no longer waiting
        reads.clear()
        pending = await deck.pending()
    assert [(p.run_id, p.payload) for p in pending] == [
        (parked[0].run_id, {"question": "ok?"}), (parked[2].run_id, {"question": "ok?"})]
    assert reads == []
