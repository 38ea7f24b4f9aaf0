"""bench_kit: kit's overhead as ratios against the raw engines, measured in one process and run.

Prints, with the same ScriptedModel and kit's default SQLite file store:
  (a) agent turns/s: ``Deck.run`` vs ``Runner.run`` (target ratio <= 1.5)
  (b) streamed tokens/s for a 500-token reply: ``Deck.stream`` vs ``Runner.run_streamed``
      (target ratio <= 2.0)
  (c) workflow runs/s of a 3-node graph: ``Deck.run`` vs ``graph.ainvoke`` with the same kind of
      checkpointer (in memory: target ratio <= 1.5; durable SQLite: reported)
  (d) agent turns/s with a slow observer (each emit sleeps 1 ms) vs with none: a slow observer
      costs its own backlog (drops), never a run's time (target: ratio ~1.0, reported)
  (e) peak RSS of the process.
The two sides run interleaved (raw, kit, raw, kit, ...) and each ratio is the median of the
per-repeat ratios, so machine noise hits both sides alike (notes/PERF.md). ``--trio`` also plays
the kit side under trio (engines on kit's asyncio thread) against the same raw figures.

Usage: python bench_kit.py [--repeats N] [--turns N] [--streams N] [--workflows N] [--trio] [--check]
``--check`` exits 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import operator
import uuid
from typing import Annotated, TypedDict

import agents
import anyio
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

import kit
from kit_store import SQLiteStore

TURN_TARGET, STREAM_TARGET, WORKFLOW_TARGET = 1.5, 2.0, 1.5
REPLY_TOKENS = 500
RUN_CONFIG = agents.RunConfig(tracing_disabled=True)  # kit disables SDK tracing too


def _reply(tokens: int) -> str:
    return " ".join(f"w{i}" for i in range(tokens))


async def raw_turns(n: int) -> float:
    agent = agents.Agent(name="a", instructions="Be brief.",
                         model=kit.ScriptedModel(["hello there"], cycle=True))
    t = time.perf_counter()
    for _ in range(n):
        await agents.Runner.run(agent, "hi", run_config=RUN_CONFIG)
    return time.perf_counter() - t


async def raw_stream(n: int) -> float:
    agent = agents.Agent(name="a", instructions="Be brief.",
                         model=kit.ScriptedModel([_reply(REPLY_TOKENS)], cycle=True))
    t = time.perf_counter()
    for _ in range(n):
        rs = agents.Runner.run_streamed(agent, "hi", run_config=RUN_CONFIG)
        deltas = 0
        async for ev in rs.stream_events():
            if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta":
                deltas += 1
        assert deltas == REPLY_TOKENS, deltas
    return time.perf_counter() - t


class State(TypedDict):
    log: Annotated[list[str], operator.add]


async def _node(state: State) -> dict:
    return {"log": ["x"]}


def _graph() -> StateGraph:
    g = StateGraph(State)
    for name in ("a", "b", "c"):
        g.add_node(name, _node)
    g.add_edge(START, "a").add_edge("a", "b").add_edge("b", "c").add_edge("c", END)
    return g


async def raw_workflows(db: Path, n: int) -> tuple[float, float]:
    """graph.ainvoke with an InMemorySaver, then with kit's durable setup (AsyncSqliteSaver on
    a WAL file, synchronous=NORMAL, durability="sync"), a fresh thread per run."""
    import aiosqlite
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
    graph = _graph().compile(checkpointer=InMemorySaver())
    t = time.perf_counter()
    for _ in range(n):
        await graph.ainvoke({"log": []}, {"configurable": {"thread_id": uuid.uuid4().hex}})
    t_mem = time.perf_counter() - t
    async with aiosqlite.connect(db) as conn:
        await conn.execute("PRAGMA journal_mode=WAL")
        await conn.execute("PRAGMA synchronous=NORMAL")
        saver = AsyncSqliteSaver(conn)
        await saver.setup()
        graph = _graph().compile(checkpointer=saver)
        t = time.perf_counter()
        for _ in range(n):
            await graph.ainvoke({"log": []}, {"configurable": {"thread_id": uuid.uuid4().hex}},
                                durability="sync")
        t_sql = time.perf_counter() - t
    return t_mem, t_sql


async def kit_workflows(db: Path, n: int) -> tuple[float, float]:
    async with SQLiteStore(db) as store:
        deck = kit.Deck(workflows=[kit.Workflow("mem", _graph()),
                                   kit.Workflow("durable", _graph(), durable=True)], store=store)
        async with deck:
            t = time.perf_counter()
            for _ in range(n):
                await deck.run("mem", {"log": []})
            t_mem = time.perf_counter() - t
            t = time.perf_counter()
            for i in range(n):
                await deck.run("durable", {"log": []}, session_id=f"t{i}")
            t_sql = time.perf_counter() - t
    return t_mem, t_sql


class SlowObserver:
    """An observer that breaks the contract (emit is in-memory work only): 1 ms per event."""

    def emit(self, event: kit.Event) -> None:
        time.sleep(0.001)


async def kit_observed(db: Path, turns: int) -> tuple[float, float]:
    async with SQLiteStore(db) as store:
        out = []
        for observers in ((), (SlowObserver(),)):
            agent = kit.Agent("a", "Be brief.", model=kit.ScriptedModel(["hello there"], cycle=True))
            async with kit.Deck([agent], store=store, observers=observers) as deck:
                t = time.perf_counter()
                for _ in range(turns):
                    await deck.run("a", "hi")
                out.append(time.perf_counter() - t)
    return out[0], out[1]


async def kit_side(db: Path, turns: int, streams: int) -> tuple[float, float]:
    async with SQLiteStore(db) as store:
        deck = kit.Deck([
            kit.Agent("a", "Be brief.", model=kit.ScriptedModel(["hello there"], cycle=True)),
            kit.Agent("s", "Be brief.", model=kit.ScriptedModel([_reply(REPLY_TOKENS)], cycle=True)),
        ], store=store)
        async with deck:
            t = time.perf_counter()
            for _ in range(turns):
                await deck.run("a", "hi")
            t_turns = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(streams):
                deltas = 0
                async for ev in deck.stream("s", "hi"):
                    deltas += ev.kind == "text.delta"
                assert deltas == REPLY_TOKENS, deltas
            t_streams = time.perf_counter() - t
    return t_turns, t_streams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--turns", type=int, default=300)
    p.add_argument("--streams", type=int, default=20)
    p.add_argument("--workflows", type=int, default=200)
    p.add_argument("--trio", action="store_true", help="also play the kit side under trio")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    a = p.parse_args(argv)
    backends = ["asyncio"] + (["trio"] if a.trio else [])
    rows: dict[str, list[float]] = {k: [] for k in ("raw_turn", "raw_stream", "raw_wf_mem",
                                                     "raw_wf_sql", "kit_wf_mem", "kit_wf_sql",
                                                     "kit_unobserved", "kit_slow_observer")}
    for b in backends:
        rows[f"kit_turn_{b}"], rows[f"kit_stream_{b}"] = [], []
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(kit_side, Path(tmp) / "warm.db", 50, 2)  # warm imports and caches
        anyio.run(raw_turns, 50)
        for r in range(a.repeats):
            rows["raw_turn"].append(anyio.run(raw_turns, a.turns))
            rows["raw_stream"].append(anyio.run(raw_stream, a.streams))
            for b in backends:
                tt, ts = anyio.run(kit_side, Path(tmp) / f"{b}{r}.db", a.turns, a.streams, backend=b)
                rows[f"kit_turn_{b}"].append(tt)
                rows[f"kit_stream_{b}"].append(ts)
            plain, slow = anyio.run(kit_observed, Path(tmp) / f"obs{r}.db", a.turns)
            rows["kit_unobserved"].append(plain)
            rows["kit_slow_observer"].append(slow)
            for side, fn in (("raw", raw_workflows), ("kit", kit_workflows)):
                t_mem, t_sql = anyio.run(fn, Path(tmp) / f"wf-{side}{r}.db", a.workflows)
                rows[f"{side}_wf_mem"].append(t_mem)
                rows[f"{side}_wf_sql"].append(t_sql)
    med = statistics.median
    ok = True
    print(f"kit bench: {a.repeats} repeats, {a.turns} turns, {a.streams} x {REPLY_TOKENS}-token "
          f"streams and {a.workflows} 3-node workflow runs each, SQLite file store, ScriptedModel")
    print(f"  Runner.run            {a.turns / med(rows['raw_turn']):>10,.0f} turns/s")
    print(f"  Runner.run_streamed   {a.streams * REPLY_TOKENS / med(rows['raw_stream']):>10,.0f} tokens/s")
    for b in backends:
        turn_ratio = med(k / r for k, r in zip(rows[f"kit_turn_{b}"], rows["raw_turn"]))
        stream_ratio = med(k / r for k, r in zip(rows[f"kit_stream_{b}"], rows["raw_stream"]))
        # The targets are for the asyncio deck; trio figures are reported, not gated.
        gated = b == "asyncio"
        t_ok, s_ok = turn_ratio <= TURN_TARGET, stream_ratio <= STREAM_TARGET
        ok &= (t_ok and s_ok) or not gated
        mark = (lambda good: ("ok" if good else "MISSED") if gated else "info")
        print(f"  Deck.run ({b:7})     {a.turns / med(rows[f'kit_turn_{b}']):>10,.0f} turns/s   "
              f"ratio {turn_ratio:.2f} (target <= {TURN_TARGET}) {mark(t_ok)}")
        print(f"  Deck.stream ({b:7})  {a.streams * REPLY_TOKENS / med(rows[f'kit_stream_{b}']):>10,.0f} "
              f"tokens/s  ratio {stream_ratio:.2f} (target <= {STREAM_TARGET}) {mark(s_ok)}")
    for kind, label, gated in (("mem", "in memory", True), ("sql", "durable SQLite", False)):
        ratio = med(k / r for k, r in zip(rows[f"kit_wf_{kind}"], rows[f"raw_wf_{kind}"]))
        good = ratio <= WORKFLOW_TARGET
        ok &= good or not gated
        print(f"  graph.ainvoke ({label:14}) {a.workflows / med(rows[f'raw_wf_{kind}']):>8,.0f} runs/s")
        print(f"  Deck.run wf   ({label:14}) {a.workflows / med(rows[f'kit_wf_{kind}']):>8,.0f} runs/s   "
              f"ratio {ratio:.2f} (target <= {WORKFLOW_TARGET}) "
              f"{('ok' if good else 'MISSED') if gated else 'info'}")
    slow_ratio = med(s / p for s, p in zip(rows["kit_slow_observer"], rows["kit_unobserved"]))
    print(f"  Deck.run, slow observer  {a.turns / med(rows['kit_slow_observer']):>8,.0f} turns/s   "
          f"ratio to no observer {slow_ratio:.2f} (info)")
    print(f"  peak RSS              {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:>10,.1f} MiB")
    return 0 if ok or not a.check else 1


if __name__ == "__main__":
    sys.exit(main())
