"""Tests for kit_store: the log, the run index and the claims, on both stores and both backends.

Real SQLite files and real child processes; no mocks.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import anyio
import pytest

import kit
import kit_pg
import kit_pgpool
import kit_store
import kit_storebase
from kit import Claim, Event, RunStatus
from kit_pg import SCHEMA_VERSION, PostgresStore, store_from_url
from kit_pgpool import pg_url
from kit_store import MemoryStore, SQLiteStore
from kit_storebase import READ_PAGE, replay

pytestmark = pytest.mark.anyio

HERE = Path(__file__).resolve().parent
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def ev(run_id: str, seq: int, payload: kit.Payload, at: int = 0) -> Event:
    return Event(run_id, seq, payload, origin="bot", at=T0 + timedelta(seconds=at, microseconds=seq))


def started(run_id: str, *, name: str = "bot", session_id: str | None = None,
            namespace: str | None = None, at: int = 0) -> Event:
    return ev(run_id, 0, kit.RunStarted(name, "agent", session_id, namespace,
                                        (kit.TextBlock("hi"),)), at)


def kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]


def make_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> kit_storebase.StoreBase:
    if kind == "postgres":
        return PostgresStore(request.getfixturevalue("postgres_url"))
    return MemoryStore() if kind == "memory" else SQLiteStore(tmp_path / "kit.db")


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(request, tmp_path, anyio_backend):
    async with make_store(request.param, tmp_path, request) as s:
        yield s



# ==================================================================================== the log ====

async def test_append_read_round_trip_in_order(store):
    events = [started("r1"), ev("r1", 1, kit.TextDelta("He")), ev("r1", 2, kit.TextDelta("llo")),
              ev("r1", 3, kit.MessageCompleted("Hello", {"k": [1, 2]}, "bot")),
              ev("r1", 4, kit.RunCompleted("Hello", kit.Usage(3, 5, 0.25)))]
    await store.append(events[:2])
    await store.append(events[2:])
    assert await store.read("r1") == events
    assert await store.read("r1", after=2) == events[3:]
    assert await store.read("r1", after=4) == []
    assert await store.read("unknown") == []


async def test_what_orjson_cannot_hold_reads_back_exactly(store):
    # A model or tool may produce a lone surrogate, a tool or a workflow an integer past 64
    # bits: the log keeps both (ASCII-escaped JSON) and reads them back as they were.
    big = {"n": 2 ** 70, "neg": -(2 ** 63) - 1, "u64": 2 ** 64 - 1, "digits": "1" * 25}
    events = [ev("r1", 0, kit.RunStarted("bot", "agent", input=(kit.DataBlock(big),))),
              ev("r1", 1, kit.MessageCompleted("odd \ud800 text", None, "bot")),
              ev("r1", 2, kit.RunCompleted({"total": 3 ** 50}))]
    await store.append(events)
    got = await store.read("r1")
    assert got == events
    assert type(got[0].payload.input[0].data["n"]) is int and got[2].payload.output["total"] == 3 ** 50
    unmarked = json.dumps(events[1].to_json(), separators=(",", ":"))  # as kit wrote it before
    assert kit_store.event_of(unmarked) == events[1]


async def test_duplicate_seq_raises_and_the_whole_batch_is_absent(store):
    await store.append([started("r1"), ev("r1", 1, kit.TextDelta("a"))])
    with pytest.raises(kit.LogConflictError) as info:
        await store.append([started("r2", session_id="s"), ev("r1", 2, kit.TextDelta("b")),
                            ev("r1", 1, kit.TextDelta("dup"))],
                           claims=[Claim("r2", "me", 30, session_id="s")])
    assert (info.value.run_id, info.value.seq) == ("r1", 1)
    assert kinds(await store.read("r1")) == ["run.started", "text.delta"]
    assert await store.read("r2") == [] and await store.run_info("r2") is None
    assert await store.session_holder("s") is None  # the claim rolled back too

    with pytest.raises(kit.LogConflictError) as info:  # a repeat inside one batch
        await store.append([ev("r3", 0, kit.TextDelta("x")), ev("r3", 0, kit.TextDelta("y"))])
    assert (info.value.run_id, info.value.seq) == ("r3", 0)
    assert await store.read("r3") == []

    with pytest.raises(kit.LogConflictError) as info:  # a run id reused by a second run.started
        await store.append([ev("r1", 7, kit.RunStarted("other", "agent"))])
    assert (info.value.run_id, info.value.seq) == ("r1", 7)
    with pytest.raises(kit.LogConflictError) as info:  # ... or twice in one batch
        await store.append([started("r4"), ev("r4", 1, kit.RunStarted("other", "agent"))])
    assert (info.value.run_id, info.value.seq) == ("r4", 1)
    assert await store.read("r4") == [] and await store.run_info("r4") is None
    assert len(await store.read("r1")) == 2


ENDS = {RunStatus.COMPLETED: kit.RunCompleted("ok"), RunStatus.FAILED: kit.RunFailed("E", "bad"),
        RunStatus.CANCELLED: kit.RunCancelled("user")}
PARKINGS = {RunStatus.WAITING_HUMAN: kit.RunInterrupted("i1", None, "t"),
            RunStatus.SLEEPING: kit.RunSleeping("2030-01-01T00:00:00+00:00"),
            RunStatus.PAUSED: kit.RunPaused("safe point")}


async def test_an_ended_run_takes_no_more_events_a_parked_one_its_resume(store):
    for status, end in ENDS.items():
        rid = status.value.lower()
        log = [started(rid, session_id=rid), ev(rid, 1, kit.TextDelta("a")), ev(rid, 2, end)]
        await store.append(log, claims=[Claim(rid, "me", 30, session_id=rid)])
        for late in ([ev(rid, 3, kit.TextDelta("late"))],  # the next seq, a later one, an end
                     [ev(rid, 9, kit.RunResumed("answer"))],
                     [ev(rid, 3, kit.MessageCompleted("late")), ev(rid, 4, kit.RunCompleted("x"))]):
            with pytest.raises(kit.LogConflictError,
                               match=rf"^run {rid} has ended \({status.value}\), so its event at "
                                     rf"seq {late[0].seq} was refused") as info:
                await store.append(late, claims=[Claim(rid, "late", 30, session_id=rid)])
            assert (info.value.run_id, info.value.seq, info.value.ended) == (rid, late[0].seq, status)
            assert await store.read(rid) == log
            assert (await store.run_info(rid)).status is status
            assert await store.session_holder(rid) is None  # the claim rolled back too
    for status, parking in PARKINGS.items():  # parked is not ended: the run goes on
        rid = status.value.lower()
        await store.append([started(rid, session_id=rid), ev(rid, 1, parking)],
                           claims=[Claim(rid, "me", 30, session_id=rid)])
        assert (await store.run_info(rid)).status is status
        await store.append([ev(rid, 2, kit.RunResumed("answer"))],
                           claims=[Claim(rid, "other", 30, session_id=rid)])
        await store.append([ev(rid, 3, kit.RunCompleted("ok"))])
        assert kinds(await store.read(rid))[2:] == ["run.resumed", "run.completed"]
        assert (await store.run_info(rid)).status is RunStatus.COMPLETED


async def test_a_writer_past_its_lapsed_lease_writes_nothing_after_the_abandoned_end(store):
    """A process stalled past its lease (a locked file, SIGSTOP) goes on writing its run after
    another process recorded it abandoned: the log keeps the end, and the run stays FAILED."""
    await store.append([started("r1", session_id="s"), ev("r1", 1, kit.TextDelta("a"))],
                       claims=[Claim("r1", "stalled", 0.05, session_id="s")])
    await anyio.sleep(0.1)
    assert await store.reap() == ["r1"]  # run.failed (RunAbandoned) at seq 2
    with pytest.raises(kit.LogConflictError) as info:  # its next batch: the end took seq 2
        await store.append([ev("r1", 2, kit.TextDelta("b")), ev("r1", 3, kit.TextDelta("c"))])
    assert info.value.seq == 2 and "already has an event at seq 2" in str(info.value)
    with pytest.raises(kit.LogConflictError) as info:  # the batches after: past the end
        await store.append([ev("r1", 4, kit.TextDelta("d")), ev("r1", 5, kit.RunCompleted("abcd"))])
    assert (info.value.seq, info.value.ended) == (4, RunStatus.FAILED)
    log = await store.read("r1")
    assert [e.seq for e in log] == [0, 1, 2] and log[-1].payload.error == "RunAbandoned"
    assert (await store.run_info("r1")).status is RunStatus.FAILED


async def test_a_claim_that_takes_over_a_lapsed_session_returns_the_abandoned_runs_end(store):
    """A new turn's claim that abandoned the run whose lease lapsed on its session wrote that
    run's run.failed and said nothing of it: no reap returns the run, so no observer saw it end."""
    await store.append([started("dead", session_id="s")], claims=[Claim("dead", "gone", 0.05, session_id="s")])
    assert await store.append([started("other", session_id="t")],
                              claims=[Claim("other", "me", 30, session_id="t")]) == []
    await anyio.sleep(0.1)
    took = await store.append([started("new", session_id="s")], claims=[Claim("new", "me", 30, session_id="s")])
    assert took == (await store.read("dead"))[-1:] and took[0].seq == 1
    assert (took[0].kind, took[0].payload.error) == ("run.failed", "RunAbandoned")
    assert await store.reap() == []  # reported once


async def test_a_batch_with_an_event_for_an_ended_run_is_refused_whole(store):
    await store.append([started("done"), ev("done", 1, kit.RunCompleted("ok"))])
    await store.append([started("live", session_id="s"), ev("live", 1, kit.TextDelta("a"))],
                       claims=[Claim("live", "me", 30, session_id="s")])
    with pytest.raises(kit.LogConflictError) as info:
        await store.append([ev("live", 2, kit.TextDelta("b")), started("new", session_id="t"),
                            ev("done", 2, kit.TextDelta("late")), ev("live", 3, kit.RunCompleted("ab"))],
                           claims=[Claim("new", "me", 30, session_id="t")])
    assert (info.value.run_id, info.value.seq, info.value.ended) == ("done", 2, RunStatus.COMPLETED)
    assert kinds(await store.read("done")) == ["run.started", "run.completed"]
    assert kinds(await store.read("live")) == ["run.started", "text.delta"]  # none of its own
    assert (await store.run_info("live")).status is RunStatus.RUNNING
    assert await store.session_holder("s") == "live"
    assert await store.read("new") == [] and await store.run_info("new") is None
    assert await store.session_holder("t") is None


async def test_lease_until_says_when_a_live_runs_claim_lapses_and_none_once_it_parks_or_ends(store):
    """``lease_until``: what ``kit runs events --follow`` asks to tell a run whose process died
    (its lease lapsed) from one still played."""
    before = time.time()
    await store.append([started("live")], claims=[Claim("live", "me", 30)])
    assert before + 30 <= await store.lease_until("live") <= time.time() + 30
    await store.renew("me", 60)
    assert await store.lease_until("live") >= before + 60
    await store.append([ev("live", 1, kit.RunInterrupted("i1", {"q": 1}, "t1"))])  # parks
    assert await store.lease_until("live") is None
    await store.append([started("done"), ev("done", 1, kit.RunCompleted("ok"))],
                       claims=[Claim("done", "me", 30)])
    assert await store.lease_until("done") is None and await store.lease_until("nope") is None


async def test_last_events_reads_the_end_of_many_runs_at_once(store):
    await store.append([started("a"), ev("a", 1, kit.TextDelta("x")), started("b"), started("c")])
    await store.append([ev("a", 2, kit.RunCompleted("x")), ev("c", 1, kit.RunPaused("wait"))])
    last = await store.last_events(["c", "a", "b", "unknown"])
    assert last == {"a": (await store.read("a"))[-1], "b": (await store.read("b"))[-1],
                    "c": (await store.read("c"))[-1]}
    assert [last[r].seq for r in "abc"] == [2, 0, 1] and await store.last_events([]) == {}

async def test_runs_listing_filters_and_status_folding(store):
    ends = {"done": kit.RunCompleted("ok"), "asked": kit.RunInterrupted("i1", {"q": 1}, "t1"),
            "asleep": kit.RunSleeping("2030-01-01T00:00:00+00:00"), "held": kit.RunPaused("safe"),
            "broke": kit.RunFailed("ValueError", "bad"), "stopped": kit.RunCancelled("user")}
    for i, (rid, payload) in enumerate(ends.items()):
        await store.append([started(rid, name="a" if i % 2 else "b", session_id=f"s{i % 2}", at=i)])
        assert (await store.run_info(rid)).status is RunStatus.RUNNING
        await store.append([ev(rid, 1, kit.TextDelta("x")), ev(rid, 2, payload)])
    await store.append([started("live", name="a", at=10), ev("live", 1, kit.TextDelta("x"))])

    status = {r.run_id: r.status for r in await store.runs()}
    assert status == {"done": RunStatus.COMPLETED, "asked": RunStatus.WAITING_HUMAN,
                      "asleep": RunStatus.SLEEPING, "held": RunStatus.PAUSED,
                      "broke": RunStatus.FAILED, "stopped": RunStatus.CANCELLED,
                      "live": RunStatus.RUNNING}
    assert [r.run_id for r in await store.runs()] == [*ends, "live"]  # by started_at
    assert [r.run_id for r in await store.runs(name="a")] == ["asked", "held", "stopped", "live"]
    assert [r.run_id for r in await store.runs(session_id="s0")] == ["done", "asleep", "broke"]
    assert [r.run_id for r in await store.runs(name="a", session_id="s1",
                                               status=RunStatus.PAUSED)] == ["held"]
    assert await store.runs(name="b", status=RunStatus.PAUSED) == []

    await store.append([ev("asked", 3, kit.RunResumed("answer"))])
    assert (await store.run_info("asked")).status is RunStatus.RUNNING
    info = await store.run_info("done")
    assert info == kit.RunInfo("done", "b", "agent", "s0", None, RunStatus.COMPLETED,
                               T0 + timedelta(seconds=0), None, 2)
    assert await store.run_info("nope") is None


async def test_runs_of_one_namespace_one_session_id_under_two_is_two_conversations(store):
    """``runs(namespace=)`` lists one namespace's runs (``kit runs list --namespace``); a
    session id is per namespace, so ``session_id`` with ``namespace`` is one conversation."""
    for rid, namespace, at in (("a1", "tenant-a", 0), ("b1", "tenant-b", 1), ("n1", None, 2),
                               ("a2", "tenant-a", 3), ("b2", "tenant-b", 4)):
        await store.append([started(rid, session_id="s", namespace=namespace, at=at)])
    assert [r.run_id for r in await store.runs(namespace="tenant-a")] == ["a1", "a2"]
    assert [r.run_id for r in await store.runs(session_id="s")] == ["a1", "b1", "n1", "a2", "b2"]
    assert [r.run_id for r in await store.runs(session_id="s", namespace="tenant-b")] == ["b1", "b2"]
    assert [r.run_id for r in await store.runs(namespace="tenant-b", limit=1)] == ["b2"]
    assert [r.run_id for r in await store.runs(namespace="tenant-b", limit=1, before="b2")] == ["b1"]
    assert await store.runs(namespace="tenant-c") == []


async def test_the_run_index_keeps_the_seq_of_each_runs_last_event(store):
    """``RunInfo.last_seq`` is the seq of the last event the log holds for the run, in every
    store, whoever wrote it: a batch, a batch whose seqs come out of order, a parked run's
    resume, a reaper's or a claimant's ``run.failed``; a refused batch leaves it as it was."""
    async def last_seqs() -> dict[str, int | None]:
        listed = {r.run_id: r.last_seq for r in await store.runs()}
        for run_id, seq in listed.items():
            assert seq == (await store.read(run_id))[-1].seq
            assert (await store.run_info(run_id)).last_seq == seq
        return listed

    await store.append([started("one")])
    await store.append([started("wait"), ev("wait", 1, kit.RunInterrupted("i1", {"q": 1}, "t"))])
    await store.append([started("lapsed", session_id="s")], claims=[Claim("lapsed", "x", 0.05,
                                                                          session_id="s")])
    await store.append([started("reaped"), ev("reaped", 1, kit.TextDelta("a"))],
                       claims=[Claim("reaped", "x", 0.05)])
    assert await last_seqs() == {"one": 0, "wait": 1, "lapsed": 0, "reaped": 1}

    await store.append([ev("one", 2, kit.TextDelta("b")), ev("one", 1, kit.TextDelta("a"))])
    await store.append([ev("wait", 2, kit.RunResumed("yes")), ev("wait", 3, kit.RunCompleted({}))])
    with pytest.raises(kit.LogConflictError):  # an ended run takes no more: nothing changes
        await store.append([ev("one", 3, kit.TextDelta("c")), ev("wait", 4, kit.TextDelta("x"))])
    await anyio.sleep(0.1)
    await store.append([started("next", session_id="s")],  # takes over the lapsed lease
                       claims=[Claim("next", "me", 30, session_id="s")])
    assert await store.reap() == ["reaped"]  # each abandoned run's run.failed at its next seq
    assert await last_seqs() == {"one": 2, "wait": 3, "lapsed": 1, "reaped": 2, "next": 0}


async def many_runs(store) -> list[str]:
    """17 runs: names a/b, sessions s0-s2 or none, namespaces t0-t1 or none, statuses by
    position, run ids chosen by hand and NOT in time order, two pairs started at the same
    instant (ordered by run id). Returns their ids oldest first."""
    order = []
    for i in range(17):
        rid = f"{'zyxwvutsrqponmlkjihgfedcba'[i]}-run"  # later runs get smaller ids
        at = i - 1 if i in (5, 12) else i  # 5 ties with 4 and 12 with 11: smaller id first
        session_id = None if i % 4 == 3 else f"s{i % 3}"
        namespace = None if i % 5 == 2 else f"t{i % 2 if i % 3 else 1}"
        batch = [started(rid, name="ab"[i % 2], session_id=session_id, namespace=namespace, at=at)]
        if i % 3 == 0:
            end = kit.RunFailed("ValueError", "bad") if i % 2 else kit.RunCompleted("ok")
            batch.append(ev(rid, 1, end))
        await store.append(batch)
        order.append(rid)
    for i in (5, 12):
        order[i - 1], order[i] = order[i], order[i - 1]
    return order


async def walk(store, limit: int, **filters) -> list[list[str]]:
    """Every page of a listing, newest page first, each page oldest first."""
    pages, before = [], None
    while True:
        page = [r.run_id for r in await store.runs(limit=limit, before=before, **filters)]
        if not page:
            return pages
        assert len(page) <= limit
        pages.append(page)
        before = page[0]


async def test_runs_pages_walk_every_run_once_newest_page_first(store):
    order = await many_runs(store)
    assert [r.run_id for r in await store.runs()] == order  # by started_at, then run id
    assert await walk(store, 5) == [order[12:], order[7:12], order[2:7], order[:2]]
    assert await walk(store, 17) == [order]
    assert await walk(store, 100) == [order]
    assert [r.run_id for r in await store.runs(limit=1)] == [order[-1]]
    # before= alone: every run that sorts before the cursor, oldest first; the first has none
    assert [r.run_id for r in await store.runs(before=order[9])] == order[:9]
    assert await store.runs(before=order[0]) == []
    # a cursor tied on started_at with its neighbour: the run id breaks the tie
    tied = [r.run_id for r in await store.runs() if r.started_at == T0 + timedelta(seconds=4)]
    assert tied == sorted(tied) and len(tied) == 2
    assert [r.run_id for r in await store.runs(limit=1, before=tied[1])] == [tied[0]]


async def test_runs_pages_with_filters(store):
    order = await many_runs(store)
    everything = await store.runs()
    for filters in ({"name": "a"}, {"session_id": "s1"}, {"status": RunStatus.RUNNING},
                    {"status": RunStatus.FAILED}, {"status": RunStatus.COMPLETED},
                    {"name": "b", "status": RunStatus.RUNNING},
                    {"name": "a", "session_id": "s0", "status": RunStatus.COMPLETED},
                    {"namespace": "t1"}, {"namespace": "t0", "session_id": "s1"},
                    {"namespace": "t1", "status": RunStatus.FAILED}):
        expected = [r.run_id for r in everything if all(
            getattr(r, k) == v for k, v in filters.items())]
        assert [r.run_id for r in await store.runs(**filters)] == expected, filters
        assert len(expected) >= 2, filters
        pages = await walk(store, 2, **filters)
        assert [rid for page in reversed(pages) for rid in page] == expected, filters
        assert all(len(page) == 2 for page in pages[:-1]), filters
    # the cursor need not match the filters: it is a position in the listing
    cursor = order[9]
    assert (await store.run_info(cursor)).name == "b"
    older_a = [r.run_id for r in everything[:9] if r.name == "a"]
    assert [r.run_id for r in await store.runs(name="a", before=cursor)] == older_a
    assert [r.run_id for r in await store.runs(name="a", limit=2, before=cursor)] == older_a[-2:]
    assert await store.runs(name="nobody", limit=3, before=cursor) == []


async def test_runs_refuses_bad_arguments_naming_them(store):
    await many_runs(store)
    for bad in (0, -1, 2.5, True, "5"):
        with pytest.raises(kit.ConfigError, match=r"^limit must be a positive int, got "):
            await store.runs(limit=bad)
    for bad in ("", 7, b"a-run"):
        with pytest.raises(kit.ConfigError, match=r"^before must be a non-empty str"):
            await store.runs(before=bad)
    with pytest.raises(kit.ConfigError, match=r"^name must be a str, got 3"):
        await store.runs(name=3)
    with pytest.raises(kit.ConfigError, match=r"^session_id must be a str"):
        await store.runs(session_id=["s1"])
    with pytest.raises(kit.ConfigError, match=r"^namespace must be a str, got 7"):
        await store.runs(namespace=7)
    with pytest.raises(ValueError, match="BOGUS"):
        await store.runs(status="BOGUS")
    # runs are never removed from the log: an unknown cursor is a mistake, never an empty page
    for kwargs in ({}, {"limit": 3}, {"name": "a", "limit": 1}):
        with pytest.raises(kit.UnknownRunError, match="'no-such-run'") as info:
            await store.runs(before="no-such-run", **kwargs)
        assert info.value.run_id == "no-such-run"


LISTINGS = [  # the index each listing walks, with and without a cursor
    ("runs_started", {}), ("runs_status", {"status": RunStatus.FAILED}),
    ("runs_status", {"status": RunStatus.WAITING_HUMAN}), ("runs_name", {"name": "a"}),
    ("runs_session", {"session_id": "s1"}), ("runs_namespace", {"namespace": "t1"}),
    # COMPLETED runs skip runs_status (every turn would write it): their pages walk runs_started
    ("runs_started", {"status": RunStatus.COMPLETED})]


async def test_sqlite_listings_are_index_ranges_never_a_scan_and_sort(tmp_path):
    import sqlite3
    async with SQLiteStore(tmp_path / "kit.db") as store:
        await many_runs(store)
    db = sqlite3.connect(tmp_path / "kit.db")
    for index, filters in LISTINGS:
        for limit, before in ((None, None), (10, None), (10, "m-run"), (None, "m-run")):
            if limit is None and index == "runs_started":
                continue  # the whole log, asked for: one pass over runs_started, in order
            sql, args = kit_store.runs_query(filters.get("status"), filters.get("name"),
                                             filters.get("session_id"), limit, before, "?",
                                             namespace=filters.get("namespace"))
            plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + sql, args)]
            assert f"USING INDEX {index} " in plan[0] + " ", (filters, limit, before, plan)
            assert not any("TEMP B-TREE" in step for step in plan), plan
            assert not any(step.startswith("SCAN runs") and "INDEX" not in step
                           for step in plan), plan
            assert before is None or "(started_at,run_id)<" in plan[0], plan  # a range
    db.close()


async def test_sqlite_a_log_written_before_the_listing_indexes_gets_them_at_open(tmp_path):
    import sqlite3
    path = tmp_path / "kit.db"
    with sqlite3.connect(path) as db:  # the run index as kit wrote it before RUN_INDEXES
        db.execute("CREATE TABLE runs(run_id TEXT PRIMARY KEY, name TEXT NOT NULL, "
                   "invocable TEXT NOT NULL, session_id TEXT, namespace TEXT, parent_run_id TEXT, "
                   "status TEXT NOT NULL, started_at TEXT NOT NULL, last_seq INTEGER NOT NULL)")
        db.execute("CREATE INDEX runs_live ON runs(status) WHERE status IN "
                   "('RUNNING', 'WAITING_HUMAN', 'SLEEPING', 'PAUSED')")
        db.execute("INSERT INTO runs VALUES ('old', 'bot', 'agent', 's1', NULL, NULL, 'COMPLETED', "
                   "'2025-12-31T00:00:00+00:00', 1)")
    db.close()
    async with SQLiteStore(path) as store:
        await store.append([started("new", session_id="s1")])
        assert [r.run_id for r in await store.runs(session_id="s1", limit=5)] == ["old", "new"]
        assert [r.run_id for r in await store.runs(limit=1, before="new")] == ["old"]
    with sqlite3.connect(path) as db:
        indexes = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index' "
                                            "AND tbl_name = 'runs' AND sql IS NOT NULL")}
    db.close()
    assert indexes == {"runs_started", "runs_status", "runs_name", "runs_session", "runs_namespace"}
    with sqlite3.connect(path) as db:  # the log's own PRAGMA: the indexes are well formed
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    db.close()


async def test_postgres_listings_can_be_index_ranges(postgres_url):
    import psycopg
    async with store_from_url(postgres_url) as store:
        await many_runs(store)
    conninfo, schema = pg_url(postgres_url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {schema}")
        # Disabled plans are taken only when nothing else answers: a plan with a Sort or a Seq
        # Scan here means no index can give a page in order.
        for setting in ("seqscan", "sort", "bitmapscan"):
            conn.execute(f"SET enable_{setting} = off")
        for index, filters in LISTINGS:
            for before in (None, "m-run"):
                sql, args = kit_store.runs_query(filters.get("status"), filters.get("name"),
                                                 filters.get("session_id"), 10, before, "%s",
                                                 namespace=filters.get("namespace"))
                plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql, args))
                assert f"Index Scan Backward using {index} on runs" in plan, plan
                assert "Sort" not in plan and "Seq Scan" not in plan, plan


async def test_closed_store_raises_kit_error(tmp_path):
    for s in (MemoryStore(), SQLiteStore(tmp_path / "deep" / "dir" / "kit.db")):
        assert not s.opened
        with pytest.raises(kit.KitError, match="not open"):
            await s.append([started("r1")])
        async with s:
            assert s.opened
            await s.append([started("r1")])
        assert not s.opened
        with pytest.raises(kit.KitError, match="not open"):
            await s.read("r1")
        async with s:  # a store can be reopened; memory keeps its data for the object's life
            assert kinds(await s.read("r1")) == ["run.started"]


# ================================================================================== claims ====

async def test_second_claim_on_a_session_is_busy_and_writes_nothing(store):
    await store.append([started("r1", session_id="s", namespace="ns")],
                       claims=[Claim("r1", "me", 30, session_id="s", namespace="ns")])
    with pytest.raises(kit.SessionBusyError) as info:
        await store.append([started("r2", session_id="s", namespace="ns")],
                           claims=[Claim("r2", "you", 30, session_id="s", namespace="ns")])
    assert (info.value.session_id, info.value.run_id, info.value.namespace) == ("s", "r1", "ns")
    assert await store.read("r2") == [] and await store.run_info("r2") is None
    assert await store.session_holder("s", "ns") == "r1"
    # Same session id elsewhere is a different session.
    await store.append([started("r3", session_id="s")], claims=[Claim("r3", "you", 30, session_id="s")])
    assert await store.session_holder("s") == "r3"


async def test_two_claims_on_one_session_in_one_batch_are_busy_and_write_nothing(store):
    with pytest.raises(kit.SessionBusyError) as info:
        await store.append([started("r1", session_id="s"), started("r2", session_id="s")],
                           claims=[Claim("r1", "me", 30, session_id="s"),
                                   Claim("r2", "me", 30, session_id="s")])
    assert (info.value.session_id, info.value.run_id) == ("s", "r1")
    assert await store.runs() == [] and await store.session_holder("s") is None


async def test_terminal_frees_the_session(store):
    await store.append([started("r1", session_id="s")], claims=[Claim("r1", "me", 30, session_id="s")])
    await store.append([ev("r1", 1, kit.RunCompleted("ok"))])
    assert await store.session_holder("s") is None
    await store.append([started("r2", session_id="s")], claims=[Claim("r2", "me", 30, session_id="s")])
    assert await store.session_holder("s") == "r2"


async def test_parking_keeps_the_session_without_a_lease_to_lapse(store):
    await store.append([started("r1", session_id="s")], claims=[Claim("r1", "me", 0.05, session_id="s")])
    await store.append([ev("r1", 1, kit.RunInterrupted("i1", None, "t"))])
    await store.renew("me", 0.05)  # must not give the parked claim a lease again
    await anyio.sleep(0.1)
    assert await store.reap() == []
    with pytest.raises(kit.SessionBusyError):
        await store.append([started("r2", session_id="s")], claims=[Claim("r2", "you", 30, session_id="s")])
    # A resumer re-takes its own run's claim, then ends it.
    await store.append([ev("r1", 2, kit.RunResumed("answer"))],
                       claims=[Claim("r1", "other", 30, session_id="s")])
    assert await store.session_holder("s") == "r1"
    await store.append([ev("r1", 3, kit.RunCompleted("ok"))])
    assert await store.session_holder("s") is None
    assert (await store.run_info("r1")).status is RunStatus.COMPLETED


async def test_a_batch_that_parks_a_run_and_goes_on_leaves_it_a_lease_to_lapse(store):
    await store.append([started("r1", session_id="s")], claims=[Claim("r1", "me", 0.05, session_id="s")])
    await store.append([ev("r1", 1, kit.RunPaused("safe point")), ev("r1", 2, kit.RunResumed("resume"))])
    assert (await store.run_info("r1")).status is RunStatus.RUNNING
    await anyio.sleep(0.1)
    assert await store.reap() == ["r1"]  # playing, not parked: its session is not held forever
    assert await store.session_holder("s") is None


async def test_lapsed_lease_is_taken_over_and_the_old_run_is_abandoned(store):
    await store.append([started("old", name="olds", session_id="s"), ev("old", 1, kit.TextDelta("a"))],
                       claims=[Claim("old", "dead", 0.05, session_id="s")])
    await anyio.sleep(0.1)
    assert await store.session_holder("s") == "old"  # lapsed, but holds until overtaken
    await store.append([started("new", session_id="s")], claims=[Claim("new", "me", 30, session_id="s")])
    assert await store.session_holder("s") == "new"
    log = await store.read("old")
    assert kinds(log) == ["run.started", "text.delta", "run.failed"]
    assert log[-1].seq == 2 and log[-1].origin == "olds"
    assert log[-1].payload == kit.RunFailed("RunAbandoned", "the process playing this run stopped "
                                                            "renewing its lease")
    assert (await store.run_info("old")).status is RunStatus.FAILED
    assert await store.reap() == []


async def test_renew_keeps_a_lease_alive_past_its_first_expiry(store):
    await store.append([started("r1", session_id="s")], claims=[Claim("r1", "me", 0.2, session_id="s")])
    await store.append([started("r2")], claims=[Claim("r2", "other", 0.2)])
    await anyio.sleep(0.1)
    await store.renew("me", 1.0)
    await anyio.sleep(0.15)  # past r1's first expiry, and r2's
    with pytest.raises(kit.SessionBusyError):
        await store.append([started("r3", session_id="s")], claims=[Claim("r3", "x", 30, session_id="s")])
    assert await store.reap() == ["r2"]


async def test_reap_abandons_lapsed_runs_once(store):
    await store.append([started("a")], claims=[Claim("a", "dead", 0.05)])
    await store.append([started("b"), ev("b", 1, kit.TextDelta("x"))], claims=[Claim("b", "dead", 0.05)])
    await store.append([started("c")], claims=[Claim("c", "alive", 30)])
    await anyio.sleep(0.1)
    assert await store.reap() == ["a", "b"]
    assert await store.reap() == []
    assert kinds(await store.read("b")) == ["run.started", "text.delta", "run.failed"]
    assert [r.run_id for r in await store.runs(status=RunStatus.FAILED)] == ["a", "b"]
    assert (await store.run_info("c")).status is RunStatus.RUNNING


async def test_two_reapers_write_one_failure(shared_url):
    async with store_from_url(shared_url) as one, store_from_url(shared_url) as two:
        await one.append([started("r1")], claims=[Claim("r1", "dead", 0.05)])
        await anyio.sleep(0.1)
        async with anyio.create_task_group() as tg:
            for s in (one, two, one, two):
                tg.start_soon(s.reap)
        assert kinds(await two.read("r1")) == ["run.started", "run.failed"]


# ================================================================================== follow ====

async def test_requests_after_any_id_below_the_first_are_all_of_them(store):
    await store.append([started("r1")])
    ids = [await store.request("r1", action) for action in ("pause", "resume", "cancel")]
    for after in (-1, 0):  # -1, as read() takes it: from the start
        assert [r.id for r in await store.requests(after)] == ids
    assert [r.action for r in await store.requests(ids[0])] == ["resume", "cancel"]


async def test_requests_of_chosen_runs_and_the_last_request_id(store):
    assert await store.last_request_id() == 0
    runs = [f"r{i}" for i in range(700)]  # more than one of SQLite's statements takes
    await store.append([started(r) for r in runs])
    ids = [await store.request(r, "pause") for r in runs[:3]]
    ids += [await store.request(r, "cancel") for r in (runs[0], runs[650])]
    assert await store.last_request_id() == ids[-1]
    got = await store.requests(run_ids=[runs[650], "nowhere", *runs[:1], *runs[300:700]])
    assert [(r.id, r.run_id, r.action) for r in got] == [
        (ids[0], "r0", "pause"), (ids[3], "r0", "cancel"), (ids[4], "r650", "cancel")]
    assert [r.id for r in await store.requests(ids[0], run_ids=runs)] == ids[1:]
    assert await store.requests(run_ids=[]) == []


async def test_follow_replays_then_goes_live_and_stops_at_terminal(store):
    early: list[Event] = []
    late: list[Event] = []

    async def collect(into: list[Event]) -> None:
        async for e in store.follow("r1"):
            into.append(e)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, early)  # before the run exists: waits for it
            await anyio.sleep(0.01)
            await store.append([started("r1"), ev("r1", 1, kit.TextDelta("a"))])
            tg.start_soon(collect, late)
            while len(early) < 2 or len(late) < 2:
                await anyio.sleep(0.01)
            await store.append([ev("r1", 2, kit.TextDelta("b"))])
            await store.append([ev("r1", 3, kit.RunCompleted("ab"))])
    want = ["run.started", "text.delta", "text.delta", "run.completed"]
    assert kinds(early) == kinds(late) == want
    assert [e.seq for e in early] == [0, 1, 2, 3]


async def test_follow_after_a_parked_run_waits_for_new_events(store):
    await store.append([started("r1"), ev("r1", 1, kit.TextDelta("a")),
                        ev("r1", 2, kit.RunPaused("safe point"))])
    with anyio.fail_after(5):
        replay = [e async for e in store.follow("r1")]
        assert kinds(replay) == ["run.started", "text.delta", "run.paused"]  # stops at parking
        got: list[Event] = []

        async def collect() -> None:
            async for e in store.follow("r1", after=2):
                got.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(collect)
            await anyio.sleep(0.15)  # several SQLite polls
            assert got == []
            await store.append([ev("r1", 3, kit.RunResumed("resume")), ev("r1", 4, kit.TextDelta("b")),
                                ev("r1", 5, kit.RunCompleted("b"))])
    assert [e.seq for e in got] == [3, 4, 5]


async def test_a_follower_of_a_run_overtaken_for_its_session_gets_its_end(store):
    await store.append([started("old", session_id="s")], claims=[Claim("old", "dead", 0.05, session_id="s")])
    got: list[Event] = []

    async def collect() -> None:
        async for e in store.follow("old"):
            got.append(e)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect)
            while not got:
                await anyio.sleep(0.01)
            await anyio.sleep(0.1)  # the lease lapses while the follower waits
            await store.append([started("new", session_id="s")],
                               claims=[Claim("new", "me", 30, session_id="s")])
    assert kinds(got) == ["run.started", "run.failed"]


async def test_closing_the_store_ends_a_waiting_follow(store):
    async def follow() -> None:
        async for _ in store.follow("r1"):
            pass

    with anyio.fail_after(5), pytest.raises(Exception) as info:
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            await anyio.sleep(0.01)
            await store.aclose()
    assert info.group_contains(kit.KitError, match="not open")


# ================================================================================ the replays ====

def long_run(run_id: str, n: int, *, name: str = "bot", end: kit.Payload | None = None) -> list[Event]:
    """A run of ``n`` events: its start, text deltas, and ``end`` (its completion by default)."""
    return [started(run_id, name=name)] + [ev(run_id, s, kit.TextDelta(f"{s} ")) for s in
                                           range(1, n - 1)] + [ev(run_id, n - 1, end or kit.RunCompleted("done"))]


def counting(base: type[kit_storebase.StoreBase]) -> type:
    """``base``, keeping the number of events each read of a run's log returned (``sizes``)."""
    class Counting(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            self.sizes: list[int] = []

        async def read(self, run_id, after=-1, **limit):
            found = await super().read(run_id, after, **limit)
            self.sizes.append(len(found))
            return found
    return Counting


async def test_read_with_a_limit_is_a_page_of_at_most_limit_events(store):
    await store.append(long_run("r1", 10))
    assert [e.seq for e in await store.read("r1", limit=3)] == [0, 1, 2]
    assert [e.seq for e in await store.read("r1", 2, limit=3)] == [3, 4, 5]
    assert [e.seq for e in await store.read("r1", 7, limit=5)] == [8, 9]  # the end: a short page
    assert await store.read("r1", 9, limit=1) == [] and await store.read("nope", limit=1) == []
    assert [e.seq for e in await store.read("r1", 4)] == [5, 6, 7, 8, 9]  # no limit: the rest
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(kit.ConfigError, match="limit"):
            await store.read("r1", limit=bad)


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres"])
async def test_a_replay_longer_than_a_page_is_read_a_page_at_a_time_each_yielded_as_read(
        kind, tmp_path, request, anyio_backend):
    """follow() read a run's whole log before yielding its first event: a finished
    100,000-event run cost each reader 2.2 s and 31 MB first, and N readers held N copies."""
    base = {"memory": MemoryStore, "sqlite": SQLiteStore, "postgres": PostgresStore}[kind]
    args = {"memory": (), "sqlite": (tmp_path / "kit.db",),
            "postgres": (request.getfixturevalue("postgres_url"),)}[kind]
    n = 2 * READ_PAGE + 7
    async with counting(base)(*args) as store:
        await store.append(long_run("r1", n))
        store.sizes.clear()
        seqs, read_before_the_first = [], None
        async for e in store.follow("r1"):
            read_before_the_first = store.sizes[:] if not seqs else read_before_the_first
            seqs.append(e.seq)
        assert seqs == list(range(n))  # every event once, in order, across the pages
        assert read_before_the_first == [READ_PAGE]  # the first came after one page, not the log
        assert store.sizes == [READ_PAGE, READ_PAGE, 7]
        store.sizes.clear()  # a replay to the log's end (GET /runs/{id}/events of a finished run)
        assert [e.seq async for e in replay(store, "r1", 3)] == list(range(4, n))
        assert store.sizes == [READ_PAGE, READ_PAGE, 3]
        # A run parked at the last event of a full page: whether it is still parked is one
        # event's read, not the rest of the log.
        await store.append(long_run("p", READ_PAGE, end=kit.RunPaused("safe point")))
        store.sizes.clear()
        assert [e.seq async for e in store.follow("p")] == list(range(READ_PAGE))
        assert store.sizes == [READ_PAGE, 0]


async def test_a_store_whose_read_takes_no_limit_is_still_followed_and_replayed_whole(tmp_path):
    """The port's ``read`` had no ``limit``: a store of the user's own, or a subclass of kit's
    that overrides ``read(run_id, after)``, keeps working, read whole as before."""
    class OldRead(SQLiteStore):
        async def read(self, run_id, after=-1):
            return await super().read(run_id, after)

    class OwnStore:  # not kit's: only what a replay reads
        def __init__(self, events: list[Event]) -> None:
            self.events = events

        async def read(self, run_id, after=-1):
            return [e for e in self.events if e.run_id == run_id and e.seq > after]

    n = READ_PAGE + 2
    async with OldRead(tmp_path / "kit.db") as store:
        await store.append(long_run("r1", n))
        assert [e.seq async for e in store.follow("r1")] == list(range(n))
        assert [e.seq async for e in replay(store, "r1", 0)] == list(range(1, n))
    assert [e.seq async for e in replay(OwnStore(long_run("r1", n)), "r1")] == list(range(n))
    assert not kit_storebase.pages(OwnStore([])) and kit_storebase.pages(MemoryStore())


async def test_whether_a_stores_read_takes_a_limit_is_read_once_not_at_every_replay(
        tmp_path, monkeypatch):
    """``pages(store)`` read ``inspect.signature(store.read)`` at every follow and replay (every
    SSE reconnect, every lagged reader): it is read once per ``read`` function now, and a store
    whose ``read`` takes no ``limit`` is still read whole."""
    import inspect
    signature, seen = inspect.signature, []

    def counted(obj, *args, **kw):
        seen.append(getattr(obj, "__qualname__", repr(obj)))
        return signature(obj, *args, **kw)
    monkeypatch.setattr(inspect, "signature", counted)

    class OldRead(SQLiteStore):
        async def read(self, run_id, after=-1):
            return await super().read(run_id, after)

    n = READ_PAGE + 2
    async with SQLiteStore(tmp_path / "kit.db") as store, OldRead(tmp_path / "kit.db") as old:
        await store.append(long_run("r1", n))
        for _ in range(3):
            for s in (store, old):
                assert [e.seq async for e in s.follow("r1")] == list(range(n))
                assert [e.seq async for e in replay(s, "r1", 0)] == list(range(1, n))
    assert kit_storebase.pages(store) and not kit_storebase.pages(old)
    reads = [name for name in seen if name.endswith(".read")]
    assert len(reads) <= 2 and len(set(reads)) == len(reads), reads


# ===================================================================================== the WAL ====

def wal_size(path: Path) -> int:
    """The size of the SQLite file's -wal file (0 while there is none)."""
    wal = Path(f"{path}-wal")
    return wal.stat().st_size if wal.exists() else 0


def delta(seq: int) -> Event:
    """An 8 KB text.delta of run r1: appended one a commit, each writes ~29 KB of WAL pages, so a
    few thousand write ``WAL_LIMIT`` several times over."""
    return ev("r1", seq, kit.TextDelta(f"{seq:06d}" + "x" * 8000))


async def test_sqlite_wal_stays_under_its_limit_under_continuous_writes_and_followers(tmp_path):
    # Without the checkpointer's rewinds this WAL reaches ~200 MB: each PASSIVE checkpoint
    # overlaps the next commit, so no writer ever finds the WAL free to start again. The writer
    # pauses 1 ms every 16 commits (~90 MB/s of WAL, three times a busy deck's): a tight loop can
    # outwrite a loaded disk's checkpoints, and then nothing that never blocks writers bounds it.
    path, last = tmp_path / "kit.db", 7_000
    seen: dict[str, list[int]] = {"here": [], "there": []}
    sizes: list[int] = []

    async def follow(store: SQLiteStore, seqs: list[int]) -> None:
        async for e in store.follow("r1"):
            assert e.seq == len(seqs) and (e.seq in (0, last) or e == delta(e.seq))
            seqs.append(e.seq)

    with anyio.fail_after(30):
        async with SQLiteStore(path) as store, SQLiteStore(path) as other:
            async with anyio.create_task_group() as tg:
                tg.start_soon(follow, store, seen["here"])  # woken by each commit
                tg.start_soon(follow, other, seen["there"])  # another connection: it polls
                await store.append([started("r1")])
                for seq in range(1, last):
                    await store.append([delta(seq)])
                    if seq % 16 == 0:
                        sizes.append(wal_size(path))
                        await anyio.sleep(0.001)
                await store.append([ev("r1", last, kit.RunCompleted("ok"))])
            sizes.append(wal_size(path))
            assert [e.seq for e in await store.read("r1")] == list(range(last + 1))
    assert seen == {"here": list(range(last + 1)), "there": list(range(last + 1))}
    assert max(sizes) <= kit_store.WAL_LIMIT, f"the WAL reached {max(sizes) >> 20} MiB"


async def test_sqlite_wal_a_long_reader_holds_the_wal_and_letting_go_lets_it_shrink(tmp_path):
    import sqlite3
    path = tmp_path / "kit.db"
    with anyio.fail_after(30):
        async with SQLiteStore(path) as store:
            await store.append([started("r1")])
            reader = sqlite3.connect(path, isolation_level=None)
            try:
                reader.execute("BEGIN")  # its first read takes a snapshot, held to COMMIT
                assert reader.execute("SELECT count(*) FROM events").fetchone() == (1,)
                for seq in range(1, 20_000):
                    await store.append([delta(seq)])  # appends go on, the WAL grows
                    if wal_size(path) > kit_store.WAL_LIMIT:
                        break
                assert wal_size(path) > kit_store.WAL_LIMIT  # it could not rewind under the reader
                assert reader.execute("SELECT count(*) FROM events").fetchone() == (1,)
                reader.execute("COMMIT")  # lets go
            finally:
                reader.close()
            for seq in range(seq + 1, seq + 20_000):
                await store.append([delta(seq)])
                if wal_size(path) <= kit_store.WAL_LIMIT:
                    break
            assert wal_size(path) <= kit_store.WAL_LIMIT
            assert [e.seq for e in await store.read("r1")] == list(range(seq + 1))


# =========================================================================== cross-process ====

CHILD_RUN = """
import sys, anyio, kit, kit_pg
async def main():
    async with kit_pg.store_from_url(sys.argv[1]) as store:
        await store.append([kit.Event("r1", 0, kit.RunStarted("child", "agent"))])
        print("started", flush=True)
        if sys.argv[2] == "wait":
            sys.stdin.readline()
        for seq in range(1, 6):
            await store.append([kit.Event("r1", seq, kit.TextDelta(str(seq)))])
            await anyio.sleep(0.01)
        await store.append([kit.Event("r1", 6, kit.MessageCompleted("12345")),
                            kit.Event("r1", 7, kit.RunCompleted("12345"))])
anyio.run(main)
"""
CHILD_CLAIM = """
import sys, time, anyio, kit, kit_pg
async def main():
    async with kit_pg.store_from_url(sys.argv[1]) as store:
        await store.append([kit.Event("old", 0, kit.RunStarted("child", "agent", "s"))],
                           claims=[kit.Claim("old", "child", 0.3, session_id="s")])
        print(time.time() + 0.3, flush=True)
        await anyio.sleep(60)
anyio.run(main)
"""
CHILD_WRITER = """
import sys, anyio, kit, kit_pg
async def main():
    run_id = sys.argv[2]
    async with kit_pg.store_from_url(sys.argv[1]) as store:
        print("ready", flush=True)
        sys.stdin.readline()
        events = [kit.Event(run_id, 0, kit.RunStarted(run_id, "agent"))]
        events += [kit.Event(run_id, s, kit.TextDelta("x" * 200)) for s in range(1, 300)]
        for i in range(0, 300, 3):
            await store.append(events[i:i + 3])
anyio.run(main)
"""
RUN_KINDS = ["run.started"] + ["text.delta"] * 5 + ["message.completed", "run.completed"]


async def spawn(code: str, *args: str) -> anyio.abc.Process:
    return await anyio.open_process([sys.executable, "-c", code, *args], cwd=HERE,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)


async def readline(proc: anyio.abc.Process) -> str:
    line = b""
    while not line.endswith(b"\n"):
        line += await proc.stdout.receive(1)
    return line.decode().strip()


async def test_follow_sees_another_process_live(shared_url):
    got: list[Event] = []
    first = anyio.Event()

    async with store_from_url(shared_url) as store:
        async def collect() -> None:
            async for e in store.follow("r1"):
                got.append(e)
                first.set()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect)
                await anyio.sleep(0.01)
                async with await spawn(CHILD_RUN, shared_url, "wait") as proc:
                    await first.wait()  # the child is blocked on stdin: this arrived live
                    assert kinds(got) == ["run.started"]
                    await proc.stdin.send(b"go\n")
                    assert await proc.wait() == 0
        assert kinds(got) == RUN_KINDS
        log = await store.read("r1")  # what the child wrote, read back from the file
        assert kinds(log) == RUN_KINDS and [e.seq for e in log] == list(range(8))
        assert log[1:6] == got[1:6] and (await store.run_info("r1")).status is RunStatus.COMPLETED


async def test_a_killed_process_lease_lapses_and_its_session_is_taken_over(shared_url):
    async with store_from_url(shared_url) as store:
        with anyio.fail_after(20):
            async with await spawn(CHILD_CLAIM, shared_url) as proc:
                until = float(await readline(proc))
                proc.kill()  # SIGKILL: it never renews
                await proc.wait()
            assert await store.session_holder("s") == "old"
            if time.time() < until - 0.05:
                with pytest.raises(kit.SessionBusyError):
                    await store.append([started("new", session_id="s")],
                                       claims=[Claim("new", "me", 30, session_id="s")])
            await anyio.sleep(max(0.0, until - time.time()) + 0.05)
            await store.append([started("new", session_id="s")],
                               claims=[Claim("new", "me", 30, session_id="s")])
        assert await store.session_holder("s") == "new"
        log = await store.read("old")
        assert kinds(log) == ["run.started", "run.failed"] and log[-1].payload.error == "RunAbandoned"
        assert (await store.run_info("old")).status is RunStatus.FAILED


CHILD_BEHIND = """
import sys, time
_clock = time.time
time.time = lambda: _clock() - 60  # this machine's clock is a minute behind
import anyio, kit, kit_pg
async def main():
    async with kit_pg.store_from_url(sys.argv[1]) as store:
        await store.append([kit.Event("r1", 0, kit.RunStarted("child", "agent", "s"))],
                           claims=[kit.Claim("r1", "child", 1.5, session_id="s")])
        print("started", flush=True)
        while True:  # a live run: renewed every third of its lease
            await anyio.sleep(0.5)
            await store.renew("child", 1.5)
anyio.run(main)
"""


async def test_postgres_leases_hold_between_replicas_whose_clocks_disagree(postgres_url):
    """Leases were written and checked on each replica's own clock: a replica whose clock ran
    behind another's by more than a lease's remaining time had its live runs reaped as abandoned
    by the other (their turns lost, their sessions taken), and one ahead reaped everyone else's.
    They are on the database server's clock now."""
    async with store_from_url(postgres_url) as store:
        with anyio.fail_after(30):
            async with await spawn(CHILD_BEHIND, postgres_url) as proc:
                try:
                    assert await readline(proc) == "started"
                    for _ in range(10):  # three leases of reaping, while the child renews
                        assert await store.reap() == []
                        await anyio.sleep(0.3)
                    with pytest.raises(kit.SessionBusyError):
                        await store.append([started("new", session_id="s")],
                                           claims=[Claim("new", "me", 30, session_id="s")])
                    until = await store.lease_until("r1")
                    assert time.time() < until <= time.time() + 1.5  # on this process's clock
                finally:
                    proc.kill()  # SIGKILL: it never renews again
                    await proc.wait()
            while not await store.reap():  # its lease lapses: reaped
                await anyio.sleep(0.1)
        log = await store.read("r1")
        assert kinds(log) == ["run.started", "run.failed"] and log[-1].payload.error == "RunAbandoned"


async def test_two_processes_append_concurrently_without_lock_errors(shared_url):
    async with store_from_url(shared_url) as store:
        with anyio.fail_after(25):
            procs = [await spawn(CHILD_WRITER, shared_url, run_id) for run_id in ("p1", "p2")]
            try:
                for p in procs:
                    assert await readline(p) == "ready"
                for p in procs:  # release both at once so their commits interleave
                    await p.stdin.send(b"go\n")
                assert [await p.wait() for p in procs] == [0, 0]
            finally:
                for p in procs:
                    await p.aclose()
        for run_id in ("p1", "p2"):
            log = await store.read(run_id)
            assert [e.seq for e in log] == list(range(300))
        assert sorted(r.run_id for r in await store.runs(status=RunStatus.RUNNING)) == ["p1", "p2"]


# ================================================================================ postgres ====

async def test_postgres_wakes_other_stores_through_notify_not_a_poll(postgres_url):
    assert PostgresStore._poll is None  # nothing re-reads on a timer: only NOTIFY wakes
    got: list[Event] = []
    requests: list[kit.ControlRequest] = []
    async with store_from_url(postgres_url) as writer, store_from_url(postgres_url) as reader:
        async def collect() -> None:
            async for e in reader.follow("r1"):
                got.append(e)

        async def watch() -> None:
            async for req in reader.follow_requests():
                requests.append(req)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect)
                tg.start_soon(watch)
                await anyio.sleep(0.05)
                await writer.append([started("r1")])
                while not got:
                    await anyio.sleep(0.005)
                await writer.request("r1", "cancel", "enough", "test")
                while not requests:
                    await anyio.sleep(0.005)
                await writer.append([ev("r1", 1, kit.RunCancelled("enough"))])
                while len(got) < 2:
                    await anyio.sleep(0.005)
                tg.cancel_scope.cancel()
    assert kinds(got) == ["run.started", "run.cancelled"]
    assert [(r.run_id, r.action, r.reason) for r in requests] == [("r1", "cancel", "enough")]



async def test_postgres_a_request_that_commits_after_a_later_one_is_still_followed(postgres_url):
    """A request's id comes from a sequence, taken before its commit: one whose commit was slow
    (a busy server, a far replica) while a later request committed got an id below what a
    watcher had seen already, and was never followed (a cancel from the CLI, lost)."""
    import psycopg
    conninfo, schema = pg_url(postgres_url)
    seen: list[tuple[int, str]] = []
    async with store_from_url(postgres_url) as slow, store_from_url(postgres_url) as fast, \
            store_from_url(postgres_url) as watcher:
        await slow.append([started("r1")])
        with psycopg.connect(conninfo, autocommit=True) as conn:  # a slow commit, on demand
            conn.execute(f'SET search_path TO "{schema}"')
            conn.execute("CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                         "IF NEW.reason = 'slow' THEN PERFORM pg_sleep(0.5); END IF; "
                         "RETURN NEW; END $$")
            conn.execute("CREATE TRIGGER slow AFTER INSERT ON controls FOR EACH ROW "
                         "EXECUTE FUNCTION slow()")

        async def watch() -> None:
            async for req in watcher.follow_requests():
                seen.append((req.id, req.action))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                tg.start_soon(slow.request, "r1", "cancel", "slow")
                await anyio.sleep(0.1)  # the slow one holds its id, uncommitted
                await fast.request("r1", "pause", "fast")
                while len(seen) < 2:
                    await anyio.sleep(0.01)  # (the slow one's id used to be skipped: a hang)
                tg.cancel_scope.cancel()
        assert seen == [(r.id, r.action) for r in await watcher.requests()]
        assert sorted(action for _, action in seen) == ["cancel", "pause"]


def kill_connections(url: str, name: str = "kit-listen") -> int:
    """Terminate the store's Postgres connections named ``<name>:<schema>`` (``kit-listen``:
    the listeners; ``kit``: the readers' pools; ``kit-write``: the writers'; ``kit-session``:
    ``KIT_SESSION``'s); how many there were."""
    import psycopg
    conninfo, schema = pg_url(url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return len(conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE application_name = %s", (f"{name}:{schema}",)).fetchall())


async def test_lease_renewal_and_reaping_survive_dropped_pool_connections(postgres_url):
    """A pool whose connections the server dropped (a failover, an idle timeout) failed the
    next renewal on a dead one: with the deck's backoff, another replica then reaped this one's
    live runs as abandoned (their callers got LogConflictError, the turns were lost)."""
    async with PostgresStore(postgres_url) as store:
        await store.renew("owner", 5.0)  # the writers' pool's connection sits idle
        for call in (lambda: store.renew("owner", 5.0), store.reap):
            assert await anyio.to_thread.run_sync(kill_connections, postgres_url, "kit-write") >= 1
            await call()  # used to raise AdminShutdown


def count_connections(url: str, name: str = "kit") -> int:
    """How many of the store's Postgres connections named ``<name>:<schema>`` there are."""
    import psycopg
    conninfo, schema = pg_url(url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                            (f"{name}:{schema}",)).fetchone()[0]


async def test_an_append_after_the_server_dropped_the_pool_fails_once_not_once_per_connection(
        postgres_url):
    """After a restart or a failover every idle pooled connection is dead, and each append
    failed on the next one: the writer's retries, backing off each time, took seconds to get a
    live connection (one per pooled connection) while every run's events waited."""
    import psycopg
    async with PostgresStore(postgres_url) as store:
        with anyio.fail_after(20):
            while await anyio.to_thread.run_sync(count_connections, postgres_url,
                                                 "kit-write") < kit_pg.WRITE_POOL:
                async with anyio.create_task_group() as tg:  # writes at once: the pool grows
                    for _ in range(4):
                        tg.start_soon(store.renew, "owner", 5.0)
        assert await anyio.to_thread.run_sync(kill_connections, postgres_url,
                                              "kit-write") == kit_pg.WRITE_POOL
        with pytest.raises(psycopg.OperationalError):  # its outcome unknown: the writer retries
            await store.append([started("r1")])
        await store.append([started("r1")])  # the retry: on a live connection
        assert kinds(await store.read("r1")) == ["run.started"]


async def test_postgres_a_renewal_never_queues_behind_readers(postgres_url, monkeypatch):
    """Reads, the writer's commits and lease renewals shared one pool, first come first served:
    40 replays of a 50,000-event run at once held a renewal 10.3 s (measured), 100 of them
    past POOL_TIMEOUT (PoolTimeout): the renewal failed, so another replica would reap this
    one's live runs as abandoned; the writer's commits queued behind the same readers."""
    import psycopg
    monkeypatch.setattr(kit_pgpool, "POOL_TIMEOUT", 1.0)  # (the readers' wait: they give up)
    conninfo, schema = pg_url(postgres_url)

    def stuck() -> int:  # the store's readers waiting on the lock, each holding a connection
        with psycopg.connect(conninfo, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name "
                                "= %s AND wait_event_type = 'Lock'", (f"kit:{schema}",)).fetchone()[0]

    async def read_quietly() -> None:
        with contextlib.suppress(Exception):  # those that find no connection give up
            await store.read("r1")

    async with store_from_url(postgres_url) as store:
        await store.append([started("r1")], claims=[Claim("r1", "me", 30)])
        locker = psycopg.connect(conninfo, autocommit=True)  # every read of the log waits
        locker.execute("BEGIN")
        locker.execute(f'LOCK TABLE "{schema}".events IN ACCESS EXCLUSIVE MODE')
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for _ in range(kit_pgpool.POOL_MAX + 4):
                        tg.start_soon(read_quietly)
                    while await anyio.to_thread.run_sync(stuck) < kit_pgpool.POOL_MAX:
                        await anyio.sleep(0.02)
                    before = time.time()
                    await store.renew("me", 30)  # used to raise PoolTimeout
                    assert await store.reap() == []
                    locker.execute("ROLLBACK")
        finally:
            locker.close()
        assert await store.lease_until("r1") >= before + 29


async def test_a_thread_lock_whose_connection_the_server_dropped_is_released_quietly(postgres_url):
    """A ticker's advisory lock on a thread goes with its connection: a release on a connection
    the server dropped mid-run used to raise, which failed the tick of a run that had
    completed."""
    from kit_bridge import on_asyncio
    from kit_threads import PgThreadLocks
    conninfo, schema = pg_url(postgres_url)

    async def trial() -> None:
        from psycopg.rows import dict_row  # as the durable checkpointer's pool has it
        mine, theirs = [await kit_pgpool.open_pool(conninfo, schema, max_size=1, name=name, check=True,
                                               row_factory=dict_row)
                        for name in ("kit-locks", "kit-other")]
        try:
            here, there = PgThreadLocks(mine), PgThreadLocks(theirs)
            assert await here.acquire("w::t") and not await there.acquire("w::t")
            assert await anyio.to_thread.run_sync(kill_connections, postgres_url, "kit-locks") == 1
            await here.release("w::t")  # used to raise AdminShutdown
            assert await there.acquire("w::t")  # the lock went with its connection
            await there.release("w::t")
            assert await here.acquire("w::t")  # and the pool lends a live connection again
            await here.release("w::t")
        finally:
            await mine.close()
            await theirs.close()
    with anyio.fail_after(20):
        await on_asyncio(trial)


async def test_a_lost_listener_reconnects_and_its_followers_miss_nothing(postgres_url):
    got: list[Event] = []
    async with store_from_url(postgres_url) as writer, store_from_url(postgres_url) as reader:
        async def collect() -> None:
            async for e in reader.follow("r1"):
                got.append(e)

        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect)
                await anyio.sleep(0.05)
                assert await anyio.to_thread.run_sync(kill_connections, postgres_url) == 2
                # Committed while the listeners are down: their NOTIFY reaches nobody.
                await writer.append([started("r1"), ev("r1", 1, kit.TextDelta("a"))])
                await writer.append([ev("r1", 2, kit.RunCompleted("a"))])
    assert [e.seq for e in got] == [0, 1, 2]


class Deafening:
    """A TCP proxy in front of Postgres that, once ``deaf`` is set, stops passing bytes either
    way on the connections named ``name`` open then (in their startup: ``kit-listen``, the
    listeners), without closing them: connections a NAT or a firewall forgot, whose peer never
    answers again."""

    def __init__(self, name: bytes = b"kit-listen") -> None:
        self.deaf, self.name = anyio.Event(), name

    async def serve(self, listener: anyio.abc.Listener, upstream_port: int) -> None:
        async def handle(client: anyio.abc.ByteStream) -> None:
            async with client, await anyio.connect_tcp("127.0.0.1", upstream_port) as server:
                listening, old = False, not self.deaf.is_set()

                async def pipe(a: anyio.abc.ByteStream, b: anyio.abc.ByteStream, up: bool) -> None:
                    nonlocal listening
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        async for chunk in a:
                            listening = listening or (up and self.name in chunk)
                            if listening and old and self.deaf.is_set():
                                await anyio.sleep_forever()  # held: never passed, never closed
                            await b.send(chunk)
                    tg.cancel_scope.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(pipe, client, server, True)
                    tg.start_soon(pipe, server, client, False)

        await listener.serve(handle)


@contextlib.asynccontextmanager
async def through(proxy: Any, postgres_url: str) -> AsyncIterator[str]:
    """``postgres_url`` by way of ``proxy`` (``Deafening``, or one that serves as it does) on
    a loopback port of its own, for as long as the block lasts."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, \
            anyio.create_task_group() as outer:
        outer.start_soon(proxy.serve, listener, 5432)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        yield postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{port}")
        outer.cancel_scope.cancel()


async def test_a_listener_whose_connection_stops_answering_is_replaced(postgres_url, monkeypatch):
    """A listener whose connection went silent (a NAT or a firewall that forgot it, a peer gone
    without a reset) waited on its ping for as long as TCP took to give up (~15 min): every
    commit of another replica went unheard meanwhile (its followers' streams stalled, a cancel
    sent there for a run played here never reached it)."""
    monkeypatch.setattr(kit_pg, "LISTEN_CHECK", 0.2)
    proxy = Deafening()
    got: list[Event] = []
    async with through(proxy, postgres_url) as url:
        async with store_from_url(url) as reader, store_from_url(postgres_url) as writer:
            async def collect() -> None:
                async for e in reader.follow("r1"):
                    got.append(e)

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(collect)
                    await anyio.sleep(0.05)
                    proxy.deaf.set()
                    await anyio.sleep(0.5)  # its ping is held now
                    await writer.append([started("r1"), ev("r1", 1, kit.RunCompleted("a"))])
    assert [e.seq for e in got] == [0, 1]



async def test_a_commit_whose_connection_stops_answering_is_retried_on_another(postgres_url,
                                                                                monkeypatch):
    """A commit sent on a connection gone silent waited for as long as TCP took to give up
    (~15 min; forever behind a frozen peer), the writer with it: every run of the replica
    stalled, though the server took new connections. It gives up after WRITE_TIMEOUT, and
    the writer's retry commits it on another connection, once."""
    monkeypatch.setattr(kit_pg, "WRITE_TIMEOUT", 0.5)
    proxy = Deafening(b"kit-write")
    async with through(proxy, postgres_url) as url:
        async with store_from_url(url) as store:
            with anyio.fail_after(20):
                await store.append([started("r1")])
                proxy.deaf.set()
                with pytest.raises(TimeoutError):  # its outcome unknown: the writer retries
                    await store.append([ev("r1", 1, kit.RunCompleted("a"))])
                await store.append([ev("r1", 1, kit.RunCompleted("a"))])
                assert kinds(await store.read("r1")) == ["run.started", "run.completed"]

async def test_a_read_whose_connection_stops_answering_is_retried_on_another(postgres_url,
                                                                            monkeypatch):
    """A read sent on a connection gone silent (a NAT or a firewall that forgot it) waited for
    as long as TCP took to give up (~15 min; forever behind a frozen peer): a replay, a run's
    status, a follower's re-read hung that long. It gives up after READ_TIMEOUT and is read
    again on another connection."""
    monkeypatch.setattr(kit_pg, "READ_TIMEOUT", 0.5)
    proxy = Deafening(b"kit:test_")  # the readers' pool (``kit:<schema>``)
    async with through(proxy, postgres_url) as url:
        async with store_from_url(url) as store:
            with anyio.fail_after(15):
                await store.append([started("r1"), ev("r1", 1, kit.RunCompleted("a"))])
                assert kinds(await store.read("r1")) == ["run.started", "run.completed"]
                proxy.deaf.set()  # the reader's pooled connection goes silent
                assert kinds(await store.read("r1")) == ["run.started", "run.completed"]
                assert (await store.run_info("r1")).status is RunStatus.COMPLETED


async def test_postgres_a_retried_batch_that_committed_is_not_written_twice(postgres_url):
    """The writer retries a batch whose commit it could not confirm (the connection died after
    COMMIT was sent): the identical events found in the log are that commit, not a conflict."""
    batch = [started("r1", session_id="s"), ev("r1", 1, kit.TextDelta("a"))]
    claim = Claim("r1", "me", 30, session_id="s")
    async with store_from_url(postgres_url) as store:
        await store.append(batch, claims=[claim])
        await store.append(batch, claims=[claim])  # the retry: nothing new, no error
        assert await store.read("r1") == batch and await store.session_holder("s") == "r1"
        more = [ev("r1", 2, kit.TextDelta("b")), ev("r1", 3, kit.RunCompleted("ab"))]
        await store.append(batch + more, claims=[claim])  # put back in front of newer events
        assert await store.read("r1") == batch + more
        assert (await store.run_info("r1")).status is RunStatus.COMPLETED
        assert await store.session_holder("s") is None
        await store.append(batch + more, claims=[claim])  # retried after it ended the run: done
        await store.append(more)
        assert await store.read("r1") == batch + more and await store.session_holder("s") is None
        with pytest.raises(kit.LogConflictError) as info:  # another writer's event: a conflict
            await store.append([ev("r1", 4, kit.TextDelta("x")), ev("r1", 1, kit.TextDelta("z"))])
        assert (info.value.run_id, info.value.seq) == ("r1", 1)
        assert len(await store.read("r1")) == 4


class CommitThenCut:
    """A TCP proxy in front of Postgres that, once armed, lets the next ``kit_append`` call
    reach the server and commit, then cuts the connection before the client hears of it: the
    commit whose outcome the writer cannot know."""

    def __init__(self) -> None:
        self.armed, self.cuts = False, 0

    async def serve(self, listener: anyio.abc.Listener, upstream_port: int) -> None:
        async def handle(client: anyio.abc.ByteStream) -> None:
            async with client, await anyio.connect_tcp("127.0.0.1", upstream_port) as server:
                cut = anyio.Event()

                async def up() -> None:
                    # A client's reset is its end too (a socket closed with data unread: seen
                    # once at the store's close, on a busy machine).
                    with contextlib.suppress(anyio.BrokenResourceError):
                        async for chunk in client:
                            await server.send(chunk)
                            if self.armed and b"kit_append" in chunk:
                                self.armed = False
                                cut.set()
                    tg.cancel_scope.cancel()

                async def down() -> None:
                    seen = b""
                    async for chunk in server:
                        if cut.is_set():
                            seen += chunk
                            if b"Z\x00\x00\x00\x05" in seen:  # ReadyForQuery: it committed
                                self.cuts += 1
                                tg.cancel_scope.cancel()  # closes both sides unanswered
                                return
                            continue
                        await client.send(chunk)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(up)
                    tg.start_soon(down)

        await listener.serve(handle)


async def test_postgres_a_commit_whose_answer_was_lost_is_retried_once(postgres_url):
    import psycopg
    proxy = CommitThenCut()
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, \
            anyio.create_task_group() as tg:
        tg.start_soon(proxy.serve, listener, 5432)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        url = postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{port}")
        batch = [started("r1", session_id="s"), ev("r1", 1, kit.TextDelta("a"))]
        claim = Claim("r1", "me", 30, session_id="s")
        with anyio.fail_after(20):
            async with store_from_url(url) as store:
                proxy.armed = True
                with pytest.raises(psycopg.OperationalError):  # the writer would retry it
                    await store.append(batch, claims=[claim])
                assert proxy.cuts == 1 and await store.read("r1") == batch  # committed though
                await store.append(batch, claims=[claim])  # the retry: taken as done
                assert await store.read("r1") == batch and await store.session_holder("s") == "r1"
        tg.cancel_scope.cancel()


async def test_postgres_schema_is_versioned_and_a_newer_one_refused(postgres_url):
    import psycopg
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1")])
    async with store_from_url(postgres_url) as store:  # opened again: nothing recreated
        assert kinds(await store.read("r1")) == ["run.started"]
    conninfo, schema = pg_url(postgres_url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        assert conn.execute(f"SELECT value FROM {schema}.kit_meta").fetchall() == [(str(SCHEMA_VERSION),)]
        conn.execute(f"UPDATE {schema}.kit_meta SET value = '99'")
    with pytest.raises(kit.ConfigError, match="version 99, newer"):
        async with store_from_url(postgres_url):
            pass


async def open_into(postgres_url: str, opened: list) -> None:
    """Open a store on ``postgres_url`` and close it; ``opened`` gets None, or what it raised."""
    try:
        async with store_from_url(postgres_url):
            opened.append(None)
    except Exception as exc:
        opened.append(exc)


async def test_a_replica_opening_while_another_commits_takes_no_lock_of_its_tables(postgres_url):
    """Every open ran CREATE INDEX IF NOT EXISTS on the log's tables, which locks a table
    against writers (SHARE) until the open commits even when the index is there: a replica
    starting while others committed waited for their commits and held their next ones, and
    one whose locks crossed a commit's (a run's end locks runs, then leases) deadlocked with it;
    Postgres failed the open (DeadlockDetected), and the replica did not start."""
    import psycopg
    conninfo, schema = pg_url(postgres_url)
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1")], claims=[Claim("r1", "me", 30)])
    other = psycopg.connect(conninfo, autocommit=True)  # another replica's commit, held half-way
    look = psycopg.connect(conninfo, autocommit=True)
    opened: list[BaseException | None] = []

    def waiting() -> bool:  # the opening store waits for a lock
        return look.execute("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                            "WHERE NOT l.granted AND a.application_name = %s",
                            (f"kit:{schema}",)).fetchone()[0] > 0
    try:
        other.execute(f'SET search_path TO "{schema}"')
        other.execute("SET deadlock_timeout = '60s'")  # (the open, waiting first, finds it)
        other.execute("BEGIN")
        other.execute("UPDATE runs SET status = 'COMPLETED' WHERE run_id = 'r1'")  # as kit_append
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(open_into, postgres_url, opened)
                while not opened and not await anyio.to_thread.run_sync(waiting):
                    await anyio.sleep(0.02)
                await anyio.to_thread.run_sync(other.execute, "DELETE FROM leases WHERE run_id = 'r1'")
                await anyio.to_thread.run_sync(other.execute, "COMMIT")
    finally:
        other.close()
        look.close()
    assert opened == [None]


async def test_postgres_a_version_1_schema_is_upgraded_once_at_open(postgres_url):
    import psycopg
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1", session_id="s1")])
    conninfo, schema = pg_url(postgres_url)

    def indexes() -> set[str]:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            return {n for (n,) in conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname "
                                               "= %s AND tablename = 'runs'", (schema,))}

    with psycopg.connect(conninfo, autocommit=True) as conn:  # back to what version 1 made
        for index in ("runs_started", "runs_status", "runs_name", "runs_session", "runs_namespace"):
            conn.execute(f"DROP INDEX {schema}.{index}")
        conn.execute(f"CREATE INDEX runs_live ON {schema}.runs(status) WHERE status IN "
                     "('RUNNING', 'WAITING_HUMAN', 'SLEEPING', 'PAUSED')")
        conn.execute(f"UPDATE {schema}.kit_meta SET value = '1'")
    assert indexes() == {"runs_pkey", "runs_live"}
    async with store_from_url(postgres_url) as store:
        assert [r.run_id for r in await store.runs(session_id="s1", limit=1)] == ["r1"]
        await namespace_index_built(conninfo, schema)  # (built CONCURRENTLY, after the open)
    assert indexes() == {"runs_pkey", "runs_started", "runs_status", "runs_name", "runs_session",
                         "runs_namespace"}
    with psycopg.connect(conninfo, autocommit=True) as conn:
        assert conn.execute(f"SELECT value FROM {schema}.kit_meta").fetchall() == [
            (str(SCHEMA_VERSION),)]


def namespace_index_valid(conninfo: str, schema: str) -> list[bool]:
    """Whether ``schema``'s runs_namespace index is valid: ``[]`` when there is none."""
    import psycopg
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return [v for (v,) in conn.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = 'runs_namespace' AND c.relnamespace = %s::regnamespace",
            (schema,))]


async def namespace_index_built(conninfo: str, schema: str) -> None:
    """Wait until ``schema``'s runs_namespace index is valid (an open builds it in the
    background: its build goes on after the open returns, until the store closes)."""
    with anyio.fail_after(30):
        while await anyio.to_thread.run_sync(namespace_index_valid, conninfo, schema) != [True]:
            await anyio.sleep(0.05)


async def test_postgres_a_schema_without_runs_namespace_gets_it_holding_no_writer(postgres_url):
    """A log the previous release wrote (version 3, no ``runs_namespace``) gets the index when
    this release first opens it, built CONCURRENTLY: another replica's writes go on while it
    builds (a plain CREATE INDEX would queue them behind it until the build ended), and a build
    an earlier open left unfinished (an invalid index) is built again."""
    import psycopg
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1", namespace="t")], claims=[Claim("r1", "me", 30)])
        await store.append([started("r2", namespace="t")])
    conninfo, schema = pg_url(postgres_url)

    valid = functools.partial(namespace_index_valid, conninfo, schema)

    other = psycopg.connect(conninfo, autocommit=True)  # another replica's commit, held half-way
    writer = psycopg.connect(conninfo, autocommit=True)  # and one more replica's, after it
    look = psycopg.connect(conninfo, autocommit=True)
    opened: list[BaseException | None] = []

    async def open_one() -> None:
        try:
            async with store_from_url(postgres_url) as store:
                assert [r.run_id for r in await store.runs(namespace="t", limit=5)] == ["r1", "r2"]
                opened.append(None)
                await namespace_index_built(conninfo, schema)  # (the store builds it meanwhile)
        except Exception as exc:
            opened.append(exc)

    def waiting() -> bool:  # the opening store's build waits (for the held commit)
        return look.execute("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                            "WHERE NOT l.granted AND a.application_name = %s",
                            (f"kit-build:{schema}",)).fetchone()[0] > 0
    try:
        for conn in (other, writer, look):
            conn.execute(f'SET search_path TO "{schema}"')
        other.execute("DROP INDEX runs_namespace")  # the schema as the previous release left it
        assert valid() == []
        writer.execute("SET lock_timeout = '20s'")  # (a plain CREATE INDEX held it: it fails)
        other.execute("BEGIN")
        other.execute("UPDATE runs SET status = 'COMPLETED' WHERE run_id = 'r1'")  # as kit_append
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(open_one)
                while not await anyio.to_thread.run_sync(waiting):  # the build waits
                    await anyio.sleep(0.02)
                await anyio.to_thread.run_sync(
                    writer.execute, "UPDATE runs SET last_seq = 0 WHERE run_id = 'r2'")
                await anyio.to_thread.run_sync(other.execute, "DELETE FROM leases WHERE run_id = 'r1'")
                await anyio.to_thread.run_sync(other.execute, "COMMIT")
        assert opened == [None] and valid() == [True]
        # A build cut short leaves an invalid index of that name, which the next open rebuilds.
        other.execute("DROP INDEX runs_namespace")
        with pytest.raises(psycopg.errors.UniqueViolation):  # two runs share a namespace
            other.execute("CREATE UNIQUE INDEX CONCURRENTLY runs_namespace ON runs(namespace)")
        assert valid() == [False]
        opened.clear()
        with anyio.fail_after(30):
            await open_one()
        assert opened == [None] and valid() == [True]
    finally:
        for conn in (other, writer, look):
            conn.close()


async def test_postgres_a_version_2_schema_gets_the_fence_of_ended_runs_at_open(postgres_url):
    """Every open replaces ``kit_append``: a schema an older kit wrote (version 2, its own
    function) refuses events for an ended run once this kit opens it, and is at version 3."""
    import psycopg
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1"), ev("r1", 1, kit.RunCompleted("ok"))])
    conninfo, schema = pg_url(postgres_url)
    with psycopg.connect(conninfo, autocommit=True) as conn:  # the function an older kit left
        conn.execute(f"SET search_path TO {schema}")
        args = conn.execute("SELECT pg_get_function_arguments('kit_append'::regproc)").fetchone()[0]
        conn.execute(f"CREATE OR REPLACE FUNCTION kit_append({args}) RETURNS void LANGUAGE plpgsql "
                     "AS $$ BEGIN RAISE EXCEPTION 'an older kit_append'; END $$")
        conn.execute("UPDATE kit_meta SET value = '2'")
    async with store_from_url(postgres_url) as store:
        with pytest.raises(kit.LogConflictError) as info:
            await store.append([ev("r1", 2, kit.TextDelta("late"))])
        assert info.value.ended is RunStatus.COMPLETED
        await store.append([started("r2"), ev("r2", 1, kit.RunCompleted("ok"))])
        assert len(await store.read("r1")) == 2 and len(await store.read("r2")) == 2
    with psycopg.connect(conninfo, autocommit=True) as conn:
        assert conn.execute(f"SELECT value FROM {schema}.kit_meta").fetchall() == [("3",)]


async def test_postgres_that_cannot_be_reached_fails_the_open_without_the_password(anyio_backend):
    store = store_from_url("postgresql://kit:s3cret@127.0.0.1:9/test?schema=nowhere")
    with anyio.fail_after(20), pytest.raises(Exception) as info:
        async with store:
            pass
    assert not store.opened and "s3cret" not in str(info.value) and "s3cret" not in repr(store)


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A loopback port whose server accepts connections and never answers (a hung database or
    a wrong port behind a proxy); yields the port."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listening socket was shut: done
            while True:
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(5)
        for conn in held:
            conn.close()


async def test_postgres_that_never_answers_fails_the_open_in_bounded_time_naming_it(anyio_backend):
    pytest.importorskip("psycopg", reason="the postgres extra is not installed")
    with silent_server() as port:
        for query, bound in (("", kit_pgpool.CONNECT_TIMEOUT), ("&connect_timeout=2", 2)):
            store = store_from_url(f"postgresql://kit:s3cret@127.0.0.1:{port}/test?schema=s{query}")
            started = time.monotonic()
            with anyio.fail_after(kit_pgpool.CONNECT_TIMEOUT + 5), \
                    pytest.raises(kit.ConfigError, match="timeout") as info:
                async with store:
                    pass
            took = time.monotonic() - started
            assert f"127.0.0.1:{port}" in str(info.value) and "s3cret" not in str(info.value)
            assert bound - 0.5 < took < bound + 3 and not store.opened  # the URL's own bound wins


# ============================================================================== read-only ====

async def test_a_read_only_store_reads_a_live_log_and_writes_nothing(shared_url):
    async with store_from_url(shared_url) as writer:
        await writer.append([started("r1", session_id="s1")],
                            claims=[Claim("r1", "w", 30, session_id="s1")])
        async with store_from_url(shared_url, read_only=True) as reader:
            assert reader.read_only and repr(reader).endswith(", read_only=True)")
            assert [r.run_id for r in await reader.runs()] == ["r1"]
            assert await reader.session_holder("s1") == "r1"
            got: list[str] = []

            async def follow() -> None:
                async for e in reader.follow("r1"):
                    got.append(e.kind)

            with anyio.fail_after(10):  # live: what the writer commits later reaches the reader
                async with anyio.create_task_group() as tg:
                    tg.start_soon(follow)
                    await anyio.sleep(0.05)
                    await writer.append([ev("r1", 1, kit.RunCompleted("ok"))])
            assert got == ["run.started", "run.completed"]
            for write in (lambda: reader.append([ev("r1", 2, kit.RunCompleted("again"))]),
                          lambda: reader.renew("w", 30), reader.reap,
                          lambda: reader.request("r1", "cancel")):
                with pytest.raises(kit.KitError, match="opened read-only: it cannot"):
                    await write()
            deck = kit.Deck([kit.Agent("a", model=kit.ScriptedModel(["x"]))], store=reader)
            with pytest.raises(kit.ConfigError, match="opened read-only: a deck writes"):
                async with deck:
                    pass
        assert kinds(await writer.read("r1")) == ["run.started", "run.completed"]
        assert await writer.requests() == [] and await writer.session_holder("s1") is None


async def test_a_read_only_sqlite_store_creates_nothing(tmp_path):
    missing = tmp_path / "none" / "kit.db"
    with pytest.raises(Exception, match="unable to open"):
        async with SQLiteStore(missing, read_only=True):
            pass
    assert not missing.parent.exists()  # no file, no folder
    other = tmp_path / "other.db"  # someone else's database
    with contextlib.closing(sqlite3.connect(other)) as db:
        db.execute("CREATE TABLE users(name TEXT)")
        db.commit()
    before = other.read_bytes()
    with pytest.raises(kit.ConfigError, match=f"{other} is not a kit event log"):
        async with SQLiteStore(other, read_only=True):
            pass
    assert other.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["other.db"]
    log = tmp_path / "kit.db"
    async with SQLiteStore(log) as store:
        await store.append([started("r1")])
    async with SQLiteStore(log, read_only=True) as reader:
        assert [r.run_id for r in await reader.runs()] == ["r1"]
    # A reader in a directory it may write leaves no -wal or -shm behind, owned by it, which
    # the log's own user might not be able to open.
    assert sorted(os.listdir(tmp_path)) == ["kit.db", "other.db"]


async def test_another_programs_database_is_refused_naming_it_and_left_as_it_is(tmp_path):
    """A file whose ``events`` (or ``runs``...) table is another program's was opened: kit added
    its other tables to it, then every append failed as an outage (the run stalled until the
    store-down bound) or failed at open with "no such column", naming no file."""
    for table in ("events(id INTEGER PRIMARY KEY, x TEXT)", "runs(id INTEGER, started_at TEXT)"):
        other = tmp_path / "other.db"
        other.unlink(missing_ok=True)
        with contextlib.closing(sqlite3.connect(other)) as db:
            db.execute(f"CREATE TABLE {table}")
            db.commit()
        before = other.read_bytes()
        with pytest.raises(kit.ConfigError, match=f"{other} is not a kit event log: its table "
                                                  f"{table.partition('(')[0]}"):
            async with SQLiteStore(other):
                pass
        assert other.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["other.db"]
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database, " * 512)
    with pytest.raises(sqlite3.DatabaseError, match=f"{garbage} .*not a database"):
        async with SQLiteStore(garbage):
            pass


async def test_postgres_another_programs_schema_is_refused_and_left_as_it_is(postgres_url):
    """As in SQLite: ``?schema=public`` where an application keeps its own ``events`` table got
    kit's tables (and a kit_meta that made it kit's from then on) beside it, then every append
    failed as an outage ("INSERT has more expressions than target columns")."""
    import psycopg
    conninfo, schema = pg_url(postgres_url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f'CREATE TABLE "{schema}".events(id serial PRIMARY KEY, title text)')
    with pytest.raises(kit.ConfigError, match=f"schema '{schema}' holds no kit event log: its "
                                              r"table events\(id, title\)"):
        async with PostgresStore(postgres_url):
            pass
    with psycopg.connect(conninfo, autocommit=True) as conn:
        assert [r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
            (schema,))] == ["events"]


async def test_a_read_only_postgres_store_creates_nothing_and_reads_an_older_schema(postgres_url):
    import psycopg
    conninfo, schema = pg_url(postgres_url)

    def schemas() -> set[str]:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            return {n for (n,) in conn.execute("SELECT nspname FROM pg_namespace")}

    with pytest.raises(kit.ConfigError, match=f"schema '{schema}' holds no kit event log"):
        async with store_from_url(postgres_url, read_only=True):
            pass
    assert schema not in schemas()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")  # an empty schema stays empty
    with pytest.raises(kit.ConfigError, match="holds no kit event log"):
        async with store_from_url(postgres_url, read_only=True):
            pass
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1")])
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"UPDATE {schema}.kit_meta SET value = '1'")  # as an older kit left it
    async with store_from_url(postgres_url, read_only=True) as reader:
        assert [r.run_id for r in await reader.runs(limit=5)] == ["r1"]
    with psycopg.connect(conninfo, autocommit=True) as conn:  # not upgraded: read as it is
        assert conn.execute(f"SELECT value FROM {schema}.kit_meta").fetchall() == [("1",)]
        conn.execute(f"UPDATE {schema}.kit_meta SET value = '99'")
    with pytest.raises(kit.ConfigError, match="version 99, newer"):
        async with store_from_url(postgres_url, read_only=True):
            pass


# ================================================================================= factory ====

async def test_store_from_url_forms():
    assert isinstance(store_from_url("memory"), MemoryStore)
    rel = store_from_url("sqlite:///relative/path.db")
    assert isinstance(rel, SQLiteStore) and rel.path == "relative/path.db" and not rel.opened
    assert store_from_url("sqlite:////abs/path.db").path == "/abs/path.db"
    pg = store_from_url("postgresql://u:s3cret@h:5433/db?schema=app_1&sslmode=disable")
    assert isinstance(pg, PostgresStore) and pg.schema == "app_1" and not pg.opened
    assert pg.url == "postgresql://u:s3cret@h:5433/db?schema=app_1&sslmode=disable"
    assert "s3cret" not in repr(pg) and "u:***@h:5433" in repr(pg)
    assert store_from_url("postgres://h/db").schema == "kit"
    assert pg_url("postgresql://h/db?options=-c%20synchronous_commit%3Doff&schema=s") == (
        "postgresql://h/db?options=-c%20synchronous_commit%3Doff", "s")  # libpq decodes %20 only
    for bad in ("sqlite://", "sqlite:///", "redis://x", ""):
        with pytest.raises(kit.ConfigError, match="unsupported store URL") as info:
            store_from_url(bad)
        assert repr(bad) in str(info.value)
    for bad in ("redis://u:s3cret@h/0", "postgresql://u:s3cret@h/db?schema=No-Caps"):
        with pytest.raises(kit.ConfigError) as info:  # the password never reaches an error
            store_from_url(bad)
        assert "s3cret" not in str(info.value) and "u:***@h" in str(info.value)
    with pytest.raises(kit.ConfigError):
        SQLiteStore("x.db", poll_interval=0)


#: URLs whose password holds an unencoded '/', '?', '#' or '@' (every piece of it is "PW..."):
#: ``urlsplit`` sees no password in most of them, libpq cuts the last one at its first '@'.
AMBIGUOUS = ("postgresql://bob:PW1/PW2@127.0.0.1:1/x",
             "postgres://bob:PW1?schema=BAD&x=PW2@127.0.0.1:1/x",
             "postgresql://bob:PW1?PW2@127.0.0.1:1/x", "postgresql://bob:PW1#PW2@127.0.0.1:1/x",
             "postgresql://bob:PW1@PW2@127.0.0.1:1/x")


async def kit_runs_list(url: str) -> tuple[int, str]:
    """``kit runs list --store url`` as a user runs it: (exit code, stderr)."""
    ran = await anyio.run_process([sys.executable, "-m", "kit_cli", "runs", "list", "--store", url],
                                  cwd=HERE, check=False)
    return ran.returncode, ran.stderr.decode()


async def test_a_password_with_unencoded_url_characters_never_reaches_an_error():
    for url in ("mysql://bob:PW1/PW2@h/x", "redis://bob:PW1?PW2@h/0", *AMBIGUOUS):
        shown = kit_storebase.masked(url)
        assert "PW" not in shown and "bob:***@" in shown, url
        with pytest.raises(kit.ConfigError) as info:
            store_from_url(url)
        assert "PW" not in str(info.value) and "bob:***@" in str(info.value), url
    for url in AMBIGUOUS:  # kit refuses it before libpq reads it otherwise
        with pytest.raises(kit.ConfigError, match="ambiguous user info.*percent-encode") as info:
            pg_url(url)
        assert "PW" not in str(info.value)
    for url in ("mysql://bob:PW1/PW2@h/x", AMBIGUOUS[1], AMBIGUOUS[2]):  # the audit's three
        code, err = await kit_runs_list(url)
        assert code == 2 and "PW" not in err and len(err.splitlines()) == 1, err
    # Percent-encoded, the same password is unambiguous and reaches libpq as it was typed.
    encoded = "postgresql://bob:PW1%2FPW2%40@h/x"
    assert pg_url(encoded) == (encoded, "kit")
    assert kit_storebase.masked("postgresql://bob:PW1%2FPW2@h/x") == "postgresql://bob:***@h/x"


async def test_a_url_whose_scheme_separator_is_misspelt_shows_the_typo_never_the_password(
        monkeypatch):
    typos = {"postgresql:/bob:PW1@h/x": "postgresql:/bob:***@h/x",
             "postgresql//bob:PW1@h/x": "postgresql//bob:***@h/x",
             "redis//:PW1@h:6379/0": "redis//:***@h:6379/0",
             "postgresql:bob:PW1@h/x": "postgresql:***@h/x", "bob:PW1@h/x": "bob:***@h/x"}
    for url, shown in typos.items():
        assert kit_storebase.masked(url) == shown
        with pytest.raises(kit.ConfigError) as info:
            store_from_url(url)
        assert "PW" not in str(info.value) and shown in str(info.value), url
    code, err = await kit_runs_list("postgresql:/bob:PW1@h/x")
    assert code == 2 and "PW" not in err and "postgresql:/bob:***@h/x" in err, err
    monkeypatch.setenv("KIT_SESSION", "redis//:PW1@h:6379/0")
    with pytest.raises(kit.ConfigError) as info:
        async with kit.Deck([kit.Agent("a", model=kit.ScriptedModel(["hi"]))]):
            pass
    assert "PW" not in str(info.value) and "redis//:***@h" in str(info.value)


async def test_a_malformed_url_is_a_config_error_never_a_traceback():
    for url in ("foo://[x", "postgresql://[::1/x", "postgresql://u:PW1@[::1", "sqlite://[x"):
        assert "PW" not in kit_storebase.masked(url)  # never raises either
        with pytest.raises(kit.ConfigError, match="store URL") as info:
            store_from_url(url)
        assert "PW" not in str(info.value)
    with pytest.raises(kit.ConfigError, match=r"'postgresql://u:\*\*\*@\[::1' is not a valid URL"):
        pg_url("postgresql://u:PW1@[::1")
    for url in ("foo://[x", "postgresql://[::1/x", "postgresql://u:PW1@[::1"):
        code, err = await kit_runs_list(url)
        assert code == 2 and "PW" not in err and "Traceback" not in err, err
        assert len(err.splitlines()) == 1 and "kit: --store: " in err, err  # whose URL


async def test_all_names_the_public_surface():
    public = {n for n, v in vars(kit_store).items()
              if not n.startswith("_") and (getattr(v, "__module__", None) == "kit_store" or n.isupper())}
    assert set(kit_store.__all__) == public
    assert isinstance(MemoryStore(), kit.EventStorePort)
    assert isinstance(SQLiteStore(os.devnull), kit.EventStorePort)
# appended to test_kit_store.py for probing


async def test_an_unknown_kinds_payload_of_any_json_value_survives_the_store(store):
    # A newer kit's row (or a hand-written one) whose payload is a list, a string or a number
    # came back wrapped as {"data": ...}: the log no longer held what was written.
    values = [[1, 2], "text", 3, None, {"data": 1}]
    unknown = [Event.from_json({"run_id": "r1", "seq": i + 1, "kind": "x.new", "payload": v,
                                "at": (T0 + timedelta(seconds=i)).isoformat()})
               for i, v in enumerate(values)]
    await store.append([started("r1"), *unknown])
    read = await store.read("r1")
    assert [e.payload for e in read[1:]] == [kit.UnknownEvent("x.new", v) for v in values]
    assert [e.to_json()["payload"] for e in read[1:]] == values


async def test_a_hand_edited_row_names_its_run_seq_and_field(tmp_path, anyio_backend):
    # A row edited by hand: reading the run raised a bare TypeError from TextDelta's
    # constructor (or json's decoder for a body that is not JSON), naming no run nor seq.
    path = tmp_path / "kit.db"
    async with SQLiteStore(path) as store:
        await store.append([started("r1"), ev("r1", 1, kit.TextDelta("He")),
                            ev("r1", 2, kit.RunCompleted("He"))])
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("UPDATE events SET body = replace(body, '\"text\"', '\"txt\"') "
                   "WHERE run_id = 'r1' AND seq = 1")
    async with SQLiteStore(path) as store:
        deck = kit.Deck([kit.Agent("bot", model=kit.ScriptedModel(["x"]))], store=store)
        async with deck:
            with pytest.raises(kit.CorruptEventError) as info:
                await deck.store.read("r1")
            assert (info.value.run_id, info.value.seq, info.value.field) == ("r1", 1, "text")
            assert str(info.value) == ("the event at seq 1 of run 'r1' ('text.delta') cannot be "
                                       "read: its payload has no 'text'")
            assert [r.run_id for r in await deck.store.runs()] == ["r1"]  # the index is intact
            assert await deck.status("r1") is RunStatus.COMPLETED
            with contextlib.closing(sqlite3.connect(path)) as db, db:
                db.execute("UPDATE events SET body = 'not json' WHERE run_id = 'r1' AND seq = 2")
            with pytest.raises(kit.CorruptEventError, match="its stored body is not JSON"):
                await deck.store.read("r1", after=1)


def closed_port() -> int:
    """A loopback port nothing listens on (one just bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_an_unreachable_postgres_or_missing_database_is_a_config_error_naming_where(
        monkeypatch, postgres_url, anyio_backend):
    """A deck opening on KIT_STORE=postgresql://... whose server refuses the connection, or
    whose database does not exist, failed with psycopg's raw OperationalError (libpq's message
    over several lines, naming no setting). Now: a ConfigError naming KIT_STORE, the host, port
    and database, on one line, the password nowhere, not even in what a traceback prints."""
    import traceback
    port = closed_port()
    missing_db = postgres_url.replace("postgresql://postgres@", "postgresql://postgres:secret@") \
        .replace("/test?", "/kit_no_such_database?")
    cases = [(f"postgresql://bob:secret@127.0.0.1:{port}/test", f"127.0.0.1:{port}",
              "'test'", "refused"),
             (missing_db, "127.0.0.1:5432", "'kit_no_such_database'", "does not exist")]
    for url, where, database, reason in cases:
        monkeypatch.setenv("KIT_STORE", url)
        with anyio.fail_after(30), pytest.raises(kit.ConfigError) as info:
            async with kit.Deck([kit.Agent("a", model=kit.ScriptedModel(["hi"]))]):
                pass
        said = str(info.value)
        assert said.startswith(f"KIT_STORE: cannot connect to the Postgres server at {where}, "
                               f"database {database}"), said
        assert reason in said and "\n" not in said and ":***@" in said, said
        printed = "".join(traceback.format_exception(info.value))
        assert "secret" not in printed and "OperationalError" not in printed, printed
        store = store_from_url(url)  # opened by its user: named by its host, not a setting
        with anyio.fail_after(30), pytest.raises(kit.ConfigError, match=f"^cannot connect .*{where}"):
            async with store:
                pass
        assert not store.opened
    monkeypatch.delenv("KIT_STORE")
    code, err = await kit_runs_list(cases[0][0])
    assert code == 1 and f"--store: cannot connect to the Postgres server at {cases[0][1]}" in err
    assert "secret" not in err and "Traceback" not in err, err


def waiting_builds(conninfo: str, schema: str) -> list[int]:
    """The backends of ``schema``'s index builds (``kit-build:<schema>``) that wait for a lock."""
    import psycopg
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return [p for (p,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE 'CREATE INDEX CONCURRENTLY%%' "
            "AND wait_event_type = 'Lock' AND application_name = %s", (f"kit-build:{schema}",))]


@contextlib.contextmanager
def a_build_blocked(conninfo: str, schema: str):
    """A slow build, simulated: another session (yielded; ``ROLLBACK`` lets the build go on)
    holding a lock on ``schema``'s runs table that a build of ``runs_namespace``, dropped first,
    waits for (the table's writers do not)."""
    import psycopg
    blocker = psycopg.connect(conninfo, autocommit=True)
    try:
        blocker.execute(f'SET search_path TO "{schema}"')
        blocker.execute("DROP INDEX runs_namespace")
        blocker.execute("BEGIN")
        blocker.execute("LOCK TABLE runs IN SHARE UPDATE EXCLUSIVE MODE")
        yield blocker
    finally:
        blocker.close()


@contextlib.contextmanager
def a_snapshot_held_without_the_index(conninfo: str, schema: str):
    """Another program's session (yielded; ``ROLLBACK`` ends its transaction) holding a
    snapshot of ``schema``'s runs table, whose ``runs_namespace`` index is dropped first: a
    build of that index waits for the session (CONCURRENTLY waits for older snapshots)."""
    import psycopg
    idle = psycopg.connect(conninfo, autocommit=True)
    try:
        idle.execute(f'DROP INDEX "{schema}".runs_namespace')
        idle.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        idle.execute(f'SELECT count(*) FROM "{schema}".runs')
        yield idle
    finally:
        idle.close()


async def until_a_build_waits(conninfo: str, schema: str) -> list[int]:
    """Wait until an index build of ``schema`` waits for a lock; its backends' pids."""
    with anyio.fail_after(30):
        while not (pids := await anyio.to_thread.run_sync(waiting_builds, conninfo, schema)):
            await anyio.sleep(0.02)
    return pids


async def test_postgres_an_open_never_waits_on_another_opens_index_build(postgres_url, caplog):
    """A log without ``runs_namespace`` (as the previous release left it) gets it built at an
    open. That build ran under the setup lock, so on a big log another replica's open waited
    for it past the setup lock's wait (60 s) and failed. Now the build runs after the lock's
    release, under a build lock only one store takes: another open completes at once, appends,
    and lists a namespace correctly without the index; a build that fails is logged naming the
    index and why, fails no store, and a later open builds it, as it rebuilds an invalid one."""
    import psycopg
    conninfo, schema = pg_url(postgres_url)
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1", namespace="t")])
        await store.append([started("r2", namespace="u")])

    valid = functools.partial(namespace_index_valid, conninfo, schema)
    with a_build_blocked(conninfo, schema) as blocker:
        caplog.set_level("WARNING", logger="kit.pg")

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "runs_namespace" in r.getMessage()]

        with anyio.fail_after(60):
            async with store_from_url(postgres_url) as first:
                pids = await until_a_build_waits(conninfo, schema)  # the first store builds
                assert len(pids) == 1
                with anyio.fail_after(15):  # the setup lock is free: no wait for the build
                    async with store_from_url(postgres_url) as other:
                        await other.append([started("r3", namespace="t")])
                        assert [r.run_id for r in await other.runs(namespace="t")] == ["r1", "r3"]
                        assert [r.run_id for r in await other.runs(namespace="u", limit=5)] == ["r2"]
                        assert [r.run_id for r in await other.runs(namespace="t", limit=1)] == ["r3"]
                assert valid() == [] and await anyio.to_thread.run_sync(
                    waiting_builds, conninfo, schema) == pids  # (the other built nothing)
                with psycopg.connect(conninfo, autocommit=True) as conn:  # the build fails
                    conn.execute("SELECT pg_cancel_backend(%s)", (pids[0],))
                while not said():
                    await anyio.sleep(0.02)
                assert [r.run_id for r in await first.runs(namespace="u")] == ["r2"]  # it works
        assert len(said()) == 1 and "not built" in said()[0], said()
        assert "QueryCanceled" in said()[0] and schema in said()[0], said()
        blocker.execute("ROLLBACK")
        with anyio.fail_after(30):
            async with store_from_url(postgres_url) as store:  # a later open builds it
                assert [r.run_id for r in await store.runs(namespace="t")] == ["r1", "r3"]
                await namespace_index_built(conninfo, schema)
        blocker.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = "
                        "'runs_namespace'::regclass")  # a build killed midway leaves one so
        assert valid() == [False]
        with anyio.fail_after(30):
            async with store_from_url(postgres_url) as store:
                assert [r.run_id for r in await store.runs(namespace="u")] == ["r2"]
                await namespace_index_built(conninfo, schema)


def build_session(conninfo: str, schema: str) -> tuple[list[str], list[str]]:
    """The backends of ``schema``'s store that hold an advisory lock (by application name), and
    the build connections (``kit-build:<schema>``) still open."""
    import psycopg
    with psycopg.connect(conninfo, autocommit=True) as conn:
        holders = [n for (n,) in conn.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.locktype = 'advisory' AND a.application_name LIKE %s", (f"%:{schema}",))]
        builders = [n for (n,) in conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE application_name = %s",
            (f"kit-build:{schema}",))]
    return holders, builders


async def test_postgres_an_index_build_waits_for_no_transaction_past_build_wait(
        postgres_url, monkeypatch, caplog):
    """CREATE INDEX CONCURRENTLY waits, with no bound of its own, for every transaction of the
    database that holds a snapshot older than its own: another program's session idle in a
    transaction held the open that built ``runs_namespace`` forever. Now each wait of the build
    is bounded (``kit_pgpool.BUILD_WAIT``, the build session's lock_timeout): the build gives up,
    is logged once naming the index and why, the store works without the index, the invalid
    index it leaves is built again by the next open, and nothing of the build (its lock, its
    setting) stays on a connection of the store."""
    conninfo, schema = pg_url(postgres_url)
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1", namespace="t")])
        await store.append([started("r2", namespace="u")])
    valid = functools.partial(namespace_index_valid, conninfo, schema)
    monkeypatch.setattr(kit_pgpool, "BUILD_WAIT", 0.5)
    caplog.set_level("WARNING", logger="kit.pg")
    with a_snapshot_held_without_the_index(conninfo, schema) as idle:
        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "runs_namespace" in r.getMessage()]

        with anyio.fail_after(30):  # (it waited for ever)
            async with store_from_url(postgres_url) as store:
                while not said():  # (the build runs in the background)
                    await anyio.sleep(0.02)
                assert valid() == [False]  # the build gave up halfway (its index invalid)
                await store.append([started("r3", namespace="t")])
                assert [r.run_id for r in await store.runs(namespace="t")] == ["r1", "r3"]
                assert [r.run_id for r in await store.runs(namespace="t", limit=1)] == ["r3"]
                while await anyio.to_thread.run_sync(build_session, conninfo, schema) != ([], []):
                    await anyio.sleep(0.02)  # (the build's connection closes after its log line)
        assert len(said()) == 1 and "not built" in said()[0] and schema in said()[0], said()
        assert "LockNotAvailable" in said()[0], said()
        assert "kit_pgpool.BUILD_WAIT = 0.5 s" in said()[0], said()
        idle.execute("ROLLBACK")
        monkeypatch.undo()
        with anyio.fail_after(30):
            async with store_from_url(postgres_url) as store:  # the next open builds it
                assert [r.run_id for r in await store.runs(namespace="u")] == ["r2"]
                await namespace_index_built(conninfo, schema)


async def test_postgres_an_open_does_not_wait_for_its_own_index_build(postgres_url):
    """The open that built ``runs_namespace`` returned only once its build ended (on 10M runs,
    minutes: the deck unusable meanwhile). Now the store builds it in the background, holding
    the build lock: the open returns while the build waits, the store reads and writes
    meanwhile (listing a namespace correctly without the index), and the index becomes valid
    once what the build waits for is gone."""
    conninfo, schema = pg_url(postgres_url)
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1", namespace="t")])
        await store.append([started("r2", namespace="u")])
    with a_build_blocked(conninfo, schema) as blocker:
        with anyio.fail_after(30):  # (it waited for the lock, up to kit_pgpool.BUILD_WAIT)
            async with store_from_url(postgres_url) as store:
                assert len(await until_a_build_waits(conninfo, schema)) == 1
                await store.append([started("r3", namespace="t")])
                assert [r.run_id for r in await store.runs(namespace="t")] == ["r1", "r3"]
                assert [r.run_id for r in await store.runs(namespace="t", limit=1)] == ["r3"]
                assert namespace_index_valid(conninfo, schema) == []
                blocker.execute("ROLLBACK")
                await namespace_index_built(conninfo, schema)
                assert [r.run_id for r in await store.runs(namespace="u", limit=5)] == ["r2"]
                assert await anyio.to_thread.run_sync(build_session, conninfo, schema) == ([], [])


async def test_postgres_a_close_during_an_index_build_stops_it(postgres_url):
    """A store closed while its index build waits (here for another session's snapshot) stops
    the build and returns at once: the build's connection is gone, its invalid index stays,
    and the next open drops it and builds it again."""
    conninfo, schema = pg_url(postgres_url)
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1", namespace="t")])
    with a_snapshot_held_without_the_index(conninfo, schema) as idle:
        store = store_from_url(postgres_url)
        with anyio.fail_after(30):
            await store.__aenter__()
            try:
                await until_a_build_waits(conninfo, schema)
                assert namespace_index_valid(conninfo, schema) == [False]  # built, not valid yet
            finally:
                with anyio.fail_after(15):  # (a bound on a hang: it waited up to BUILD_WAIT)
                    await store.aclose()
        assert await anyio.to_thread.run_sync(build_session, conninfo, schema) == ([], [])
        assert namespace_index_valid(conninfo, schema) == [False]
        idle.execute("ROLLBACK")
        with anyio.fail_after(30):
            async with store_from_url(postgres_url) as store:  # the next open builds it
                await namespace_index_built(conninfo, schema)
                assert [r.run_id for r in await store.runs(namespace="t")] == ["r1"]


async def test_postgres_a_store_builds_the_index_another_stopped_building(postgres_url):
    """A store that finds another building the index (it holds the build lock) skipped the
    build: when that other store closed first (a CLI command's, say), cutting its build short,
    the index stayed unbuilt until an open, however long the replicas ran. Now the store tries
    the build lock again in the background, and builds the index once the lock is free."""
    conninfo, schema = pg_url(postgres_url)
    async with store_from_url(postgres_url) as store:
        await store.append([started("r1", namespace="t")])
    with a_snapshot_held_without_the_index(conninfo, schema) as idle:
        command, replica = store_from_url(postgres_url), store_from_url(postgres_url)
        with anyio.fail_after(60):
            try:
                async with command:  # a command's store: it builds, then closes
                    await until_a_build_waits(conninfo, schema)
                    await replica.__aenter__()  # it finds the command building
                assert namespace_index_valid(conninfo, schema) == [False]  # cut short
                idle.execute("ROLLBACK")
                await namespace_index_built(conninfo, schema)  # the replica built it
                assert [r.run_id for r in await replica.runs(namespace="t")] == ["r1"]
            finally:
                await replica.aclose()


async def test_postgres_an_open_that_outwaits_the_setup_lock_says_who_holds_it_and_what_bounds_it(
        postgres_url, monkeypatch):
    """An open whose schema's setup lock another open held past the wait failed with "advisory
    lock 'kit:setup:...' was held by another process for 60 s", naming no setting. Now it says
    another open holds the schema's setup lock, and that kit_pgpool.SETUP_WAIT bounds the wait."""
    import psycopg
    conninfo, schema = pg_url(postgres_url)
    async with store_from_url(postgres_url):
        pass
    monkeypatch.setattr(kit_pgpool, "SETUP_WAIT", 0.3)
    with psycopg.connect(conninfo, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (f"kit:setup:{schema}",))
        with anyio.fail_after(30), pytest.raises(TimeoutError) as info:
            async with store_from_url(postgres_url):
                pass
    said = str(info.value)
    assert f"setup lock 'kit:setup:{schema}' is held by another open" in said, said
    assert "kit_pgpool.SETUP_WAIT = 0.3 s" in said, said
    async with store_from_url(postgres_url) as store:  # free again: opens
        assert await store.runs() == []
