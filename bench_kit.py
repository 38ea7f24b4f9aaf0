"""bench_kit: kit's overhead as ratios against the raw engines, measured in one process and run.

Prints, with the same ScriptedModel and kit's default SQLite file store:
  (a) agent turns/s: ``Deck.run`` vs ``Runner.run`` (target ratio <= 1.5)
  (b) streamed tokens/s for a 500-token reply: ``Deck.stream`` vs ``Runner.run_streamed``
      (target ratio <= 2.0)
  (c) peak RSS of the process.
The two sides run interleaved (raw, kit, raw, kit, ...) and each ratio is the median of the
per-repeat ratios, so machine noise hits both sides alike (notes/PERF.md). ``--trio`` also plays
the kit side under trio (engines on kit's asyncio thread) against the same raw figures.

Usage: python bench_kit.py [--repeats N] [--turns N] [--streams N] [--trio] [--check]
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

import agents
import anyio

import kit
from kit_store import SQLiteStore

TURN_TARGET, STREAM_TARGET = 1.5, 2.0
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
    p.add_argument("--trio", action="store_true", help="also play the kit side under trio")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    a = p.parse_args(argv)
    backends = ["asyncio"] + (["trio"] if a.trio else [])
    rows: dict[str, list[float]] = {k: [] for k in ("raw_turn", "raw_stream")}
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
    med = statistics.median
    ok = True
    print(f"kit bench: {a.repeats} repeats, {a.turns} turns and {a.streams} x {REPLY_TOKENS}-token "
          "streams each, SQLite file store, ScriptedModel")
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
    print(f"  peak RSS              {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:>10,.1f} MiB")
    return 0 if ok or not a.check else 1


if __name__ == "__main__":
    sys.exit(main())
