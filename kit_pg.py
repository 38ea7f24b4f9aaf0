"""kit_pg: the log on PostgreSQL, shared by every replica (DESIGN 4.4, 4.5, 12); the store factory.

Owns: ``PostgresStore`` (the log, run index, claims and control requests in one schema of one
database, with LISTEN/NOTIFY wake-ups) and ``store_from_url``, the one factory of every store.
Its connections come from ``kit_pgpool`` (URLs, pools, setup locks, index builds), below it.

Must never: import psycopg at import (``import kit`` stays light; the ``postgres`` extra is
optional), put a password in an error, a log line or a ``repr`` (``kit_storebase.masked``), run
engine code, or touch asyncio except through ``kit_bridge``.

Why the factory lives here: ``store_from_url`` must build all three stores, and ``kit_store``
(below) cannot see this module, so the lowest module that sees them all owns it; kit_runtime and
kit_cli import it from here. A registry in kit_store that this module fills at import would make
the result depend on what happened to be imported. This module sits above ``kit_bridge``, not
right above ``kit_store``: under trio it plays its I/O on a ``Bridge``.

Theory of operation
-------------------
One ``PostgresStore`` holds two psycopg pools (autocommit, its schema as ``search_path``): one
for reads (``kit_pgpool.POOL_MAX`` connections), one for writes (``WRITE_POOL``: commits, lease
renewals and reaping, control requests), so however many readers wait, a commit or a renewal
never queues behind them; and one listening connection. A store that opens a log an older
release wrote builds what index it lacks in the background (``_BUILT_CONCURRENTLY``), on a
connection of its own, for as long as the build lasts or the store stays open. Every call is one round trip where it
matters: ``append`` is one call of the ``kit_append`` function, created with the schema, which
takes the claims, inserts the events, indexes the runs, frees or parks leases and sends one
``NOTIFY`` per run, in the single transaction of that statement (a round trip costs ~100-170 us
here, a client-side transaction of five statements five of them). The notification is
``e <seq> <run_id>`` (the run and its last committed seq; ``c <id>`` for a control request),
never an event: followers re-read the log. ``NOTIFY`` is delivered at commit, so what wakes a
follower is always readable.

A retried append is safe: when a commit's outcome is unknown (the connection died after
``COMMIT`` was sent), the writer retries the same batch; an event whose ``(run_id, seq)`` holds
the identical body is that earlier attempt, committed, and is skipped, so the retry neither
duplicates nor fails. A different body at a taken seq is a ``LogConflictError``; so is a new
event for a run that has ended (``kit_store.ENDED``), found by the run index's update, which
skips an ended run's row (no statement of its own). A retry that wrote nothing is taken as done
even when its earlier attempt ended the run.

The listener connection LISTENs on ``kit:<schema>`` and wakes this process's followers of the
run named, or its control-request watchers (``StoreBase._woken``). It pings the server every
``LISTEN_CHECK`` idle seconds; a lost connection (or one whose ping goes unanswered that long) is
reopened with backoff (``RECONNECT_MAX``) and then every follower re-reads, so a notification
lost while it was down costs nothing.

Leases are on the server's clock, not each replica's: a store measures how far its own is off at
open and at every renewal (``_skew``, a round trip's precision) and shifts the times it writes
and compares, so a replica whose clock runs behind another's is not reaped by it as dead, nor
one ahead the reaper of everyone else's live runs.

psycopg's async API is asyncio-only. Under asyncio the store runs on the caller's loop; under
trio it starts its own ``kit_bridge.Bridge`` (the store is opened before any Runtime, and users
open it themselves) and every call crosses to it (one thread crossing per call, not per event:
appends are group-committed). The listener's wake-ups cross back with ``Bridge.to_kit``.
"""
from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import sniffio

from kit_bridge import Bridge, spawn
from kit_core import (Claim, ConfigError, ControlRequest, Event, LogConflictError, RunInfo,
                      RunStarted, RunStatus, SessionBusyError)
from kit_store import (CONTROLS_INDEX, KIT_COLUMNS, LAST_EVENTS, RUN_COLUMNS, RUN_INDEXES,
                       MemoryStore, SQLiteStore, abandoned, by_run, event_of, event_row,
                       foreign_table, run_row, runs_query, status_after)
import kit_pgpool  # BUILD_WAIT is read there at each build: a test may shorten it
from kit_pgpool import bounded, build_concurrently, open_pool, pg_url, psycopg_module, setup_lock
from kit_storebase import StoreBase, masked

__all__ = ("PostgresStore", "store_from_url", "SCHEMA_VERSION", "WRITE_POOL", "WRITE_TIMEOUT",
           "READ_TIMEOUT", "LISTEN_CHECK", "RECONNECT_MAX")

#: The version of the tables this module creates (row ``schema_version`` of ``kit_meta``). A
#: later release migrates from it; a store refuses a schema newer than it knows. 2: the run
#: index's listing indexes (``kit_store.RUN_INDEXES``) replace ``runs_live``. 3: ``kit_append``
#: refuses events for a run that has ended. Every open replaces ``kit_append`` with its own, so
#: a schema at 2 gets the new one when first opened; the version keeps an older kit, whose open
#: would put back a function without that fence, from opening the schema at all.
SCHEMA_VERSION = 3
#: Connections per store for writes (commits, lease renewals and reaps, control requests), apart
#: from the readers': in one pool, 40 replays at once of a 50,000-event run held a renewal 10.3 s
#: and 100 failed it (measured), and another replica reaps the live runs not renewed.
WRITE_POOL = 2
#: How long a write may wait for its answer (seconds): past it, its connection is taken for one
#: gone silent (a NAT or a firewall that forgot it: TCP says so after ~15 min), the write fails
#: (``TimeoutError``) and the writer retries on another (a retried commit is safe: see above).
WRITE_TIMEOUT = 10.0
#: How long a read may wait for its answer (seconds): past it, its connection is taken for one
#: gone silent, as a write's, and the read is tried once more on another (then its reader gets
#: ``TimeoutError``). Longer than a write's: a replay of a long run is one read (a 50,000-event
#: run's takes ~1 s alone, and many at once share the server).
READ_TIMEOUT = 60.0
#: An idle listener pings the server this often (seconds), and a ping unanswered this long is a
#: dead connection, reopened (followers re-read then).
LISTEN_CHECK = 5.0
#: Reconnection backoff of the listener: doubles from 0.1 s up to this (seconds).
RECONNECT_MAX = 5.0
#: How long a close waits for an index build under way to stop (seconds): psycopg asks the server
#: to cancel it (a wait ends at once), then waits up to 5 s for the answer before it drops the
#: connection; a build that outlasts this ends on its own, its connection with it.
_BUILD_STOP = 10.0
#: While another store holds the build lock (it builds now), a store lacking the index tries the
#: lock again this often (seconds), in the background: if that build is cut short (its store
#: closed: a command's, say), this one builds; if it ended, this one finds the index valid.
_BUILD_RETRY = 5.0
#: Takeovers of lapsed sessions one append tries before calling the session busy.
_TAKEOVERS = 3
_CREATES = re.compile(r"IF NOT EXISTS (\w+)(?: ON (\w+))?")  # what a statement of _TABLES makes
_log = logging.getLogger("kit.pg")


# ===================================================================================== schema ====

_TABLES = (
    "CREATE TABLE IF NOT EXISTS kit_meta(key text PRIMARY KEY, value text NOT NULL)",
    "CREATE TABLE IF NOT EXISTS events(run_id text NOT NULL, seq integer NOT NULL, "
    "kind text NOT NULL, body text NOT NULL, PRIMARY KEY(run_id, seq))",
    "CREATE TABLE IF NOT EXISTS runs(run_id text PRIMARY KEY, name text NOT NULL, "
    "invocable text NOT NULL, session_id text, namespace text, parent_run_id text, "
    "status text NOT NULL, started_at text NOT NULL, last_seq integer NOT NULL)",
    # As in SQLite: lease_until NULL = parked; namespace None is '' (NULLs never collide).
    "CREATE TABLE IF NOT EXISTS leases(run_id text PRIMARY KEY, namespace text NOT NULL, "
    "session_id text, owner text NOT NULL, lease_until double precision)",
    "CREATE UNIQUE INDEX IF NOT EXISTS leases_session ON leases(namespace, session_id) "
    "WHERE session_id IS NOT NULL",
    *RUN_INDEXES,
    "CREATE TABLE IF NOT EXISTS controls(id bigserial PRIMARY KEY, run_id text NOT NULL, "
    "action text NOT NULL, reason text, source text, at double precision NOT NULL)",
    CONTROLS_INDEX,
)
#: Indexes of ``_TABLES`` added since version 3, which a schema an older release wrote lacks (an
#: older kit writing beside them keeps them up, so no version marks them). On an existing table
#: an open builds one CONCURRENTLY, after its transaction and after releasing the setup lock
#: (a build on 10M runs outlasts ``kit_pgpool.SETUP_WAIT``: other replicas' opens would fail),
#: in the background (its open returns at once), until the build ends or the store closes (which
#: cancels it), under a build lock (``kit:build:<schema>``) that it only tries (again every
#: ``_BUILD_RETRY``): one store builds, every other goes on, querying without the index (correct,
#: slower). The build holds no writer, where a plain CREATE INDEX holds them all for its length
#: (~0.5 s per 100k runs). Its waits (for the table's writers, then for every transaction of the
#: database holding an older snapshot: a session idle in a transaction would hold it for ever)
#: are bounded by ``kit_pgpool.BUILD_WAIT`` each, on a connection of its own
#: (``kit_pgpool.build_concurrently``). A build cut short leaves its index invalid: the next
#: store that gets the build lock drops it and builds it again; a build that fails is logged and
#: never fails the store.
_BUILT_CONCURRENTLY = frozenset({"runs_namespace"})
#: What opening an older schema does besides ``_TABLES`` (whose ``IF NOT EXISTS`` add what is
#: new), by the version it brings the schema to: removing what is gone.
_UPGRADES = {2: ("DROP INDEX IF EXISTS runs_live",)}  # runs_status covers it
# One statement per batch. Errors: KB001 a live or parked run holds claim HINT's session (MESSAGE:
# its run id); KB002 the holder's lease lapsed (the caller abandons it, then retries); KB003 the
# batch's event MESSAGE (1-based) conflicts with the log: its seq is taken, or (DETAIL: the run's
# status, one of kit_store.ENDED) its run has ended. A kit that reads no DETAIL still gets a
# LogConflictError out of it, so replicas still running an older kit take the new function.
_APPEND = """
CREATE OR REPLACE FUNCTION kit_append(
    e_runs text[], e_kinds text[], e_run_at text, e_seq_at text, e_kind_at text, e_body_at text,
    s_run text[], s_name text[], s_invocable text[], s_session text[], s_ns text[], s_parent text[],
    s_status text[], s_at text[], s_last int[], s_idx int[],
    u_run text[], u_last int[], u_status text[], free text[], park text[],
    c_run text[], c_owner text[], c_until float8[], c_session text[], c_ns text[],
    now float8, channel text, notes text[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    h_run text; h_until float8; bad bigint; n bigint; fresh_ids text[]; moved_ids text[];
    e_seq int[] := string_to_array(e_seq_at, ',')::int[];
    e_body text[] := string_to_array(e_body_at, chr(10));
BEGIN
    FOR i IN 1 .. coalesce(array_length(c_run, 1), 0) LOOP
        UPDATE leases SET owner = c_owner[i], lease_until = c_until[i] WHERE run_id = c_run[i];
        CONTINUE WHEN FOUND;  -- a resumer re-taking its own run
        IF c_session[i] IS NOT NULL THEN
            SELECT run_id, lease_until INTO h_run, h_until FROM leases
                WHERE namespace = c_ns[i] AND session_id = c_session[i] FOR UPDATE;
            IF FOUND THEN
                IF h_until IS NULL OR h_until >= now THEN
                    RAISE EXCEPTION USING ERRCODE = 'KB001', MESSAGE = h_run, HINT = i::text;
                END IF;
                RAISE EXCEPTION USING ERRCODE = 'KB002', MESSAGE = h_run, HINT = i::text;
            END IF;
        END IF;
        INSERT INTO leases VALUES (c_run[i], c_ns[i], c_session[i], c_owner[i], c_until[i]);
    END LOOP;
    IF array_length(s_run, 1) > 0 THEN
        WITH fresh AS (INSERT INTO runs SELECT * FROM unnest(s_run, s_name, s_invocable,
                s_session, s_ns, s_parent, s_status, s_at, s_last)
                ON CONFLICT (run_id) DO NOTHING RETURNING run_id)
            SELECT coalesce(array_agg(run_id), '{}') INTO fresh_ids FROM fresh;
        IF array_length(fresh_ids, 1) IS DISTINCT FROM array_length(s_run, 1) THEN
            -- runs indexed already: this batch, retried (its run.started is there, identical),
            -- or a reused run id
            SELECT x.idx INTO bad FROM unnest(s_run, s_idx) AS x(run_id, idx)
                WHERE x.run_id <> ALL(fresh_ids)
                  AND NOT EXISTS (SELECT 1 FROM events e WHERE e.run_id = x.run_id
                                  AND e.seq = e_seq[x.idx] AND e.body = e_body[x.idx])
                LIMIT 1;
            IF bad IS NOT NULL THEN
                RAISE EXCEPTION USING ERRCODE = 'KB003', MESSAGE = bad::text;
            END IF;
            UPDATE runs r SET status = CASE WHEN x.last > r.last_seq THEN x.status
                                            ELSE r.status END,
                              last_seq = GREATEST(r.last_seq, x.last)
                FROM unnest(s_run, s_status, s_last) AS x(run_id, status, last)
                WHERE r.run_id = x.run_id;
        END IF;
    END IF;
    INSERT INTO events SELECT e_runs[r], s, e_kinds[k], b FROM unnest(
        string_to_array(e_run_at, ',')::int[], e_seq, string_to_array(e_kind_at, ',')::int[],
        e_body) AS x(r, s, k, b) ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n < coalesce(array_length(e_seq, 1), 0) THEN  -- taken seqs: identical is a retry
        SELECT x.i INTO bad FROM unnest(string_to_array(e_run_at, ',')::int[], e_seq, e_body)
                WITH ORDINALITY AS x(r, seq, body, i)
            JOIN events e ON e.run_id = e_runs[x.r] AND e.seq = x.seq
            WHERE e.body <> x.body ORDER BY x.i LIMIT 1;
        IF bad IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'KB003', MESSAGE = bad::text;
        END IF;
    END IF;
    IF array_length(u_run, 1) > 0 THEN
        WITH moved AS (UPDATE runs r SET last_seq = GREATEST(r.last_seq, x.last),
                                         status = COALESCE(x.status, r.status)
                FROM unnest(u_run, u_last, u_status) AS x(run_id, last, status)
                WHERE r.run_id = x.run_id
                  AND r.status NOT IN ('COMPLETED', 'FAILED', 'CANCELLED')  -- kit_store.ENDED
                RETURNING r.run_id)
            SELECT coalesce(array_agg(run_id), '{}') INTO moved_ids FROM moved;
        -- A run not moved has ended, or is not indexed (events without a run.started). An ended
        -- run takes no event; a batch that wrote none (n = 0) is the retry of one that committed
        -- whole (perhaps ending the run), taken as done.
        IF array_length(moved_ids, 1) IS DISTINCT FROM array_length(u_run, 1) AND n > 0 THEN
            SELECT x.i, r.status INTO bad, h_run
                FROM unnest(string_to_array(e_run_at, ',')::int[]) WITH ORDINALITY AS x(r, i)
                JOIN runs r ON r.run_id = e_runs[x.r]
                WHERE r.run_id = ANY(u_run) AND r.run_id <> ALL(moved_ids) ORDER BY x.i LIMIT 1;
            IF bad IS NOT NULL THEN
                RAISE EXCEPTION USING ERRCODE = 'KB003', MESSAGE = bad::text, DETAIL = h_run;
            END IF;
        END IF;
    END IF;
    IF array_length(free, 1) > 0 THEN
        DELETE FROM leases WHERE run_id = ANY(free);
    END IF;
    IF array_length(park, 1) > 0 THEN
        UPDATE leases SET lease_until = NULL WHERE run_id = ANY(park);
    END IF;
    PERFORM pg_notify(channel, x) FROM unnest(notes) AS x;
END $$"""
_APPEND_CALL = ("SELECT kit_append(%s::text[], %s::text[], %s, %s, %s, %s, %s::text[], %s::text[], "
                "%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::int[], "
                "%s::int[], %s::text[], %s::int[], %s::text[], %s::text[], %s::text[], %s::text[], "
                "%s::text[], %s::float8[], %s::text[], %s::text[], %s::float8, %s, %s::text[])")


def _append_args(events: list[Event], claims: Sequence[Claim], now: float,
                 channel: str) -> list[Any]:
    """The arguments of ``kit_append`` for a batch: what SQLite's ``_append`` does statement by
    statement, prepared as column arrays.

    The events' columns go as text joined by ``,`` (numbers: indexes into the batch's distinct
    run ids and kinds, seqs) and by a newline (the bodies: compact JSON never holds a raw
    newline): psycopg quotes a list of JSON strings element by element, ~25 us each (measured:
    6.5 ms for 256 bodies, 0.2 ms joined).
    """
    first: dict[str, int] = {}
    kinds: dict[str, int] = {}
    for i, e in enumerate(events):
        first.setdefault(e.run_id, i)
        kinds.setdefault(e.kind, len(kinds) + 1)
    runs = {run_id: n for n, run_id in enumerate(first, 1)}
    event_columns = [list(runs), list(kinds), ",".join(str(runs[e.run_id]) for e in events),
                     ",".join(str(e.seq) for e in events), ",".join(str(kinds[e.kind]) for e in events),
                     "\n".join(event_row(e)[3] for e in events)]
    claimed = {c.run_id for c in claims}
    started: list[list[Any]] = [[] for _ in range(10)]
    updated: list[list[Any]] = [[], [], []]
    free, park, notes = [], [], []
    for run_id, run_events in by_run(events).items():
        status = status_after(run_events)
        last = max(e.seq for e in run_events)
        head = run_events[0]
        if isinstance(p := head.payload, RunStarted):
            for column, value in zip(started, (
                    run_id, p.name, p.invocable, p.session_id, p.namespace, p.parent_run_id,
                    (status or RunStatus.RUNNING).value, head.at.isoformat(), last,
                    first[run_id] + 1)):
                column.append(value)
        else:
            for column, value in zip(updated, (run_id, last, status.value if status else None)):
                column.append(value)
        ends = run_events[-1].payload.ends
        if ends == "terminal" and (head.kind != "run.started" or run_id in claimed):
            free.append(run_id)
        elif ends == "parking":
            park.append(run_id)
        notes.append(f"e {last} {run_id}")
    claim_columns = [[c.run_id for c in claims], [c.owner for c in claims],
                     [now + c.lease_seconds for c in claims], [c.session_id for c in claims],
                     [c.namespace or "" for c in claims]]
    return [*event_columns, *started, *updated, free, park, *claim_columns, now, channel, notes]


# ====================================================================================== store ====

async def _answered(work: Any, write: bool = True) -> Any:
    """``await work``, or ``TimeoutError`` past ``WRITE_TIMEOUT`` (``READ_TIMEOUT`` for a read;
    psycopg then closes the connection, which the pool drops)."""
    bound = WRITE_TIMEOUT if write else READ_TIMEOUT
    with anyio.move_on_after(bound):
        return await work
    raise TimeoutError(f"the server did not answer a {'write' if write else 'read'} within {bound:g} s")


class PostgresStore(StoreBase):
    """The log in one schema of a PostgreSQL database, shared by every replica that opens it.

    ``url`` is ``postgresql://[user[:password]@]host[:port]/database[?schema=name&...]``: libpq's
    URL, plus kit's ``schema`` (default ``kit``). The schema and its tables are created on open,
    idempotently and once when replicas open together; a schema created by a newer kit is
    refused. ``read_only=True`` opens an existing log to read it only (a role that may only
    ``SELECT`` will do): nothing is created or upgraded, a schema without kit's tables is a
    ``ConfigError``, and the writing methods raise ``KitError``. Other processes' commits wake
    this one's followers through LISTEN/NOTIFY, never a poll. Raises ``ConfigError`` for a
    malformed URL, or on open without the postgres extra or for a newer schema, and when the
    server cannot be reached, refuses the connection or has no such database, or does not
    answer (``kit_pgpool.CONNECT_TIMEOUT``): naming ``setting`` (where the URL came from, as
    ``store_from_url`` passes it), the host, port and database, never the password.
    """

    def __init__(self, url: str, *, read_only: bool = False, setting: str | None = None) -> None:
        super().__init__()
        self._conninfo, self.schema = pg_url(url)
        self.url, self.read_only, self.setting = url, bool(read_only), setting
        self.channel = f"kit:{self.schema}"
        self._pool: Any = None  # the readers'
        self._writes: Any = None  # the writers' (``WRITE_POOL``)
        self._bridge: Bridge | None = None
        self._stop_listening: Callable[[], Any] | None = None
        self._stop_building: Callable[[], Any] | None = None  # an index build under way: ``_build``
        self._skew = 0.0  # the server's clock less this process's (seconds): ``_clock``

    def __repr__(self) -> str:
        return f"PostgresStore({masked(self.url)!r}{', read_only=True' * self.read_only})"

    # ---------------------------------------------------------------------- lifecycle --
    async def _opening(self) -> None:
        psycopg_module()
        if sniffio.current_async_library() == "trio":
            self._bridge = Bridge()
            self._bridge.start()
        try:
            self._pool, unbuilt = await self._io(self._connect)
            listening, failed = anyio.Event(), []

            def ready(error: BaseException | None) -> None:
                failed.extend([error] if error is not None else [])
                listening.set()

            self._stop_listening = spawn(lambda: self._keep_listening(ready), self._bridge)
            await listening.wait()
            if failed:
                raise failed[0]
            if unbuilt:  # in the background: no open waits for a build (minutes on 10M runs)
                self._stop_building = spawn(lambda: self._build(unbuilt), self._bridge)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._closing()
            raise

    async def _closing(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._stop_building is not None:  # cut short: the next open builds it again
                stop, self._stop_building = self._stop_building, None
                with anyio.move_on_after(_BUILD_STOP):
                    await stop()
            if self._stop_listening is not None:
                stop, self._stop_listening = self._stop_listening, None
                await stop()
            for name in ("_writes", "_pool"):
                if (pool := getattr(self, name)) is not None:
                    setattr(self, name, None)
                    await self._io(pool.close)
            if self._bridge is not None:
                bridge, self._bridge = self._bridge, None
                await bridge.stop()

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``await fn(*args)`` where psycopg lives: here, or on the bridge under trio."""
        return await (self._bridge.call(fn, *args) if self._bridge else fn(*args))

    def _to_kit(self, fn: Callable[[], Any]) -> None:
        """Asyncio side: call ``fn()`` on the caller's side (the same thread under asyncio)."""
        self._bridge.to_kit(fn) if self._bridge else fn()

    _run_hook = _io  # (``_call``'s: no busy back-off, the server's locks wait on their own)

    def _unstorable(self, exc: Exception) -> bool:
        """Text that is not UTF-8, a NUL or another value out of a type's range (class 22), or
        one too big to index (past ~2.7 kB: "index row size exceeds btree maximum")."""
        errors = psycopg_module().errors
        return super()._unstorable(exc) or isinstance(exc, (errors.DataError,
                                                            errors.ProgramLimitExceeded))

    async def _connect(self) -> tuple[Any, list[str]]:
        """The readers' pool, the tables set up, and the statements of the indexes to build
        CONCURRENTLY (``_BUILT_CONCURRENTLY``) once the open is done."""
        pool = await open_pool(self._conninfo, self.schema, create=not self.read_only,
                               setting=self.setting)
        try:
            async with pool.connection() as conn:
                await self._clock(conn, "")
            if self.read_only:  # an older schema reads as it is: its upgrades only add indexes
                async with pool.connection() as conn:
                    if await self._version(conn) is None:
                        raise ConfigError(f"schema {self.schema!r} holds no kit event log (no "
                                          "kit_meta table); a read-only store creates none")
                return pool, []
            async with setup_lock(pool, f"kit:setup:{self.schema}") as conn:
                version = await self._version(conn)
                if version is None:  # no kit log here yet: is any table of kit's names another's?
                    await self._refuse_foreign(conn)
                version = version or SCHEMA_VERSION
                # One transaction: replicas see the old schema or the new one. CREATE INDEX on
                # an existing runs table holds its writers for the build (~0.5 s per 100k runs).
                # Only what is missing: CREATE INDEX IF NOT EXISTS locks its table against
                # writers (SHARE, to the commit) even when the index is there, so an open while
                # other replicas commit held their commits, and deadlocked with one whose locks
                # crossed its own (a run's end: runs, then leases), failing the open.
                found = dict(await (await conn.execute(
                    "SELECT c.relname::text, i.indisvalid IS NOT FALSE FROM pg_class c LEFT JOIN "
                    "pg_index i ON i.indexrelid = c.oid WHERE c.relnamespace = %s::regnamespace",
                    (self.schema,))).fetchall())
                have = {name for name, valid in found.items() if valid}
                later = [s for s in _TABLES if (m := _CREATES.search(s))[1] not in have
                         and m[1] in _BUILT_CONCURRENTLY and m[2] in have]
                async with conn.transaction():
                    for statement in _TABLES:
                        if _CREATES.search(statement)[1] not in have and statement not in later:
                            await conn.execute(statement)
                    await conn.execute(_APPEND)  # (a function: it locks no table)
                    for to, statements in _UPGRADES.items():
                        for statement in statements if version < to else ():
                            await conn.execute(statement)
                    await conn.execute("INSERT INTO kit_meta VALUES ('schema_version', %s) "
                                       "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                                       (str(SCHEMA_VERSION),))
            self._writes = await open_pool(self._conninfo, self.schema, max_size=WRITE_POOL,
                                           create=False, name="kit-write")
        except BaseException:
            await pool.close()
            raise
        return pool, later  # (built after the setup lock's release: no other open waits for it)

    async def _build(self, statements: list[str]) -> None:
        """Asyncio side, in the background from open to close: build the indexes of
        ``statements`` (of ``_BUILT_CONCURRENTLY``) with ``kit_pgpool.build_concurrently``, each
        of its waits bounded by ``kit_pgpool.BUILD_WAIT``, once the build lock is free (tried
        every ``_BUILD_RETRY``: its holder may close mid-build). Never fails the store: an index
        not built is logged, once, naming it and the reason; queries work without it, only slower,
        and the next open builds it. A close cancels it (``_BUILD_STOP``)."""
        psycopg = psycopg_module()
        named = [(_CREATES.search(s)[1], s) for s in statements]
        try:
            while (failed := await build_concurrently(self._conninfo, self.schema, named)) is None:
                await anyio.sleep(_BUILD_RETRY)  # another builds: should it stop short, this does
        except Exception as exc:  # its connection failed (the lock went with it), or worse
            _log.warning("the indexes %s of schema %r were not built (%s); the next open builds "
                         "them", ", ".join(n for n, _ in named), self.schema, type(exc).__name__)
            return
        for name, exc in failed or ():
            waited = (f"; a lock or a transaction it waits for was held past kit_pgpool."
                      f"BUILD_WAIT = {kit_pgpool.BUILD_WAIT:g} s"
                      if isinstance(exc, psycopg.errors.LockNotAvailable) else "")
            _log.warning("index %s of schema %r was not built (%s: %s%s); queries work without "
                         "it, slower, and the next open builds it", name, self.schema,
                         type(exc).__name__, " ".join(str(exc).split())[:500], waited)

    async def _clock(self, conn: Any, statement: str, args: Sequence[Any] = ()) -> None:
        """Run ``statement`` (a CTE, or nothing) on ``conn`` and measure ``_skew`` by the same
        round trip: the server's clock less this process's, at the middle of the trip."""
        before = time.time()
        row = await (await conn.execute(
            statement + "SELECT extract(epoch FROM clock_timestamp())::float8", args)).fetchone()
        self._skew = row[0] - (before + time.time()) / 2

    async def _refuse_foreign(self, conn: Any) -> None:
        """Raise ``ConfigError`` when the schema has a table of one of kit's tables' names with
        other columns (another program's, ``kit_store.KIT_COLUMNS``), before anything is created
        beside it."""
        rows = await (await conn.execute(
            "SELECT table_name::text, array_agg(column_name::text ORDER BY ordinal_position) "
            "FROM information_schema.columns WHERE table_schema = %s AND table_name = ANY(%s) "
            "GROUP BY table_name", (self.schema, list(KIT_COLUMNS)))).fetchall()
        if (foreign := foreign_table(dict(rows))) is not None:
            raise ConfigError(f"schema {self.schema!r} holds no kit event log: {foreign}; nothing "
                              "was created in it (give kit a schema of its own: ?schema=name)")

    async def _version(self, conn: Any) -> int | None:
        """The version of the schema's tables (None: it has none); raises ``ConfigError`` for one
        newer than this kit's."""
        if not (await (await conn.execute(
                "SELECT to_regclass('kit_meta') IS NOT NULL")).fetchone())[0]:
            return None
        row = await (await conn.execute(
            "SELECT value FROM kit_meta WHERE key = 'schema_version'")).fetchone()
        if row is not None and int(row[0]) > SCHEMA_VERSION:
            raise ConfigError(f"schema {self.schema!r} is at version {row[0]}, newer than this "
                              f"kit's {SCHEMA_VERSION}: upgrade kit")
        return SCHEMA_VERSION if row is None else int(row[0])

    # ----------------------------------------------------------------------- listening --
    async def _keep_listening(self, ready: Callable[[BaseException | None], None]) -> None:
        """Asyncio side, for the store's life: keep one LISTEN connection open (reopened with
        backoff when lost, then every follower re-reads). ``ready`` is told, on the caller's
        side, once the first one listens, or why it failed (opening fails then)."""
        delay, first = 0.1, True

        def listening() -> None:
            nonlocal first, delay
            delay = 0.1
            if first:
                first = False
                self._to_kit(functools.partial(ready, None))
            else:
                _log.warning("the listener is back: every follower re-reads")
                self._to_kit(self._wake_all)  # what was committed while it was away

        while True:
            try:
                await self._listen(listening)
            except Exception as exc:
                if first:
                    self._to_kit(functools.partial(ready, exc))  # (``exc`` is unbound after)
                    return
                _log.warning("the listener lost its connection (%s); reconnecting in %.1f s",
                             type(exc).__name__, delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX)

    async def _listen(self, ready: Callable[[], None]) -> None:
        """Asyncio side: LISTEN on the store's channel and fan each notification out."""
        psycopg = psycopg_module()
        from psycopg import sql

        async def answered(statement: Any) -> None:
            # An answer that does not come in time is a connection gone silent (a NAT or a
            # firewall that forgot it, a peer gone without a reset): TCP would take ~15 min to
            # say so, every other replica's commit unheard meanwhile. Reconnected instead.
            with anyio.move_on_after(LISTEN_CHECK):
                return await conn.execute(statement)
            raise TimeoutError(f"the server did not answer the listener within {LISTEN_CHECK:g} s")

        async with await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, **bounded(self._conninfo),
                application_name=f"kit-listen:{self.schema}"[:63]) as conn:
            await answered(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            ready()
            while True:
                async for note in conn.notifies(timeout=LISTEN_CHECK):
                    self._to_kit(self._heard(note.payload))
                await answered("SELECT 1")  # idle: is the connection still there?

    def _heard(self, payload: str) -> Callable[[], None]:
        """What a notification wakes: ``e <seq> <run_id>`` that run's followers, ``c <id>`` the
        request watchers; anything else (not kit's) everyone, who re-read and find nothing."""
        what, _, rest = payload.partition(" ")
        seq, _, run_id = rest.partition(" ")
        if what in ("c", "e") and seq.isdecimal():
            return functools.partial(self._woken, run_id if what == "e" else None, int(seq))
        return self._wake_all

    # --------------------------------------------------------------------------- hooks --
    async def _append(self, events: list[Event], claims: Sequence[Claim], now: float) -> None:
        psycopg = psycopg_module()
        now += self._skew  # (the server's clock: leases compare across replicas)
        args = _append_args(events, claims, now, self.channel)
        for attempt in range(_TAKEOVERS + 1):
            try:
                async with self._writes.connection() as conn:
                    await _answered(conn.execute(_APPEND_CALL, args))
                return
            except psycopg.Error as exc:
                code, diag = exc.sqlstate, exc.diag
                if code == "KB003":
                    e, ended = events[int(diag.message_primary) - 1], diag.message_detail
                    raise LogConflictError(e.run_id, e.seq,
                                           RunStatus(ended) if ended else None) from None
                if code in ("KB001", "KB002"):
                    claim = claims[int(diag.message_hint) - 1]
                    if code == "KB002" and attempt < _TAKEOVERS:
                        await self._take_over(diag.message_primary, now)
                        continue
                    raise SessionBusyError(claim.session_id, diag.message_primary,
                                           claim.namespace) from None
                if code == "23505":  # a claim raced another's insert of the same session
                    await self._busy_session(claims)
                if isinstance(exc, psycopg.OperationalError):
                    # A dead connection (a restart, a failover): so is every idle one, each
                    # a retry and backoff of the writer's. Dropped now (``_on_live``), the
                    # writer's retry gets a live one.
                    await self._writes.check()
                raise

    async def _busy_session(self, claims: Sequence[Claim]) -> None:
        """After a lost race for a session: raise ``SessionBusyError`` naming its holder."""
        for claim in claims:
            if claim.session_id is not None:
                holder = await self._holder(claim.session_id, claim.namespace or "")
                if holder not in (None, claim.run_id):
                    raise SessionBusyError(claim.session_id, holder, claim.namespace) from None

    async def _take_over(self, run_id: str, now: float) -> None:
        """Abandon ``run_id`` if its lease has still lapsed (another claimant may be at it): in a
        transaction of its own, so its run.failed is reported (``_overtaken``) once committed,
        whatever becomes of the claim."""
        event = None
        async with self._writes.connection() as conn, conn.transaction():
            if await (await conn.execute(
                    "SELECT 1 FROM leases WHERE run_id = %s AND lease_until < %s "
                    "FOR UPDATE SKIP LOCKED", (run_id, now))).fetchone():
                event = await self._abandon(conn, run_id)
        if event is not None:
            self._overtaken.append(event)

    async def _abandon(self, conn: Any, run_id: str) -> Event:
        name, last = await (await conn.execute(
            "SELECT (SELECT name FROM runs WHERE run_id = %s), "
            "(SELECT max(seq) FROM events WHERE run_id = %s)", (run_id, run_id))).fetchone()
        event = abandoned(run_id, 0 if last is None else last + 1, name or "")
        await conn.execute("INSERT INTO events VALUES (%s, %s, %s, %s)", event_row(event))
        await conn.execute("UPDATE runs SET status = %s, last_seq = %s WHERE run_id = %s",
                           (RunStatus.FAILED.value, event.seq, run_id))
        await conn.execute("DELETE FROM leases WHERE run_id = %s", (run_id,))
        await conn.execute("SELECT pg_notify(%s, %s)", (self.channel, f"e {event.seq} {run_id}"))
        return event

    async def _fetch(self, query: str, args: Sequence[Any] = (), *, again: bool = True,
                     write: bool = False) -> list[tuple[Any, ...]]:
        """Rows of ``query``; with ``again`` (a read), once more on a live connection when the
        first turns out dead (``_on_live``); ``write``: on a connection of the writers' pool."""
        async def fetch(conn: Any) -> list[tuple[Any, ...]]:
            return await (await conn.execute(query, args)).fetchall()
        return await self._on_live(fetch, again=again, write=write)

    async def _on_live(self, work: Callable[[Any], Any], *, again: bool = True,
                       write: bool = False, bound: bool = True) -> Any:
        """``await work(conn)`` on a pooled connection (the writers' pool with ``write``), its
        answer within ``WRITE_TIMEOUT`` (a read's ``READ_TIMEOUT``) unless ``bound`` is false,
        for work that bounds its own steps; with ``again`` (work that may run twice: a read, an
        idempotent write, a transaction that rolls back when its connection dies), once more
        when that connection turns out dead, after the pool has dropped every dead one (after a
        server restart or a failover, all are), or a read's once more when it went silent (not
        checking the pool's others first: a silent one would hold the check as long)."""
        pool = self._writes if write else self._pool
        try:
            async with pool.connection() as conn:
                return await (_answered(work(conn), write) if bound else work(conn))
        except psycopg_module().OperationalError:
            if not again:
                raise
        except TimeoutError:
            if not again or write:
                raise
            return await self._on_live(work, again=False, write=write, bound=bound)
        await pool.check()
        return await self._on_live(work, again=False, write=write, bound=bound)

    async def _read(self, run_id: str, after: int, limit: int | None) -> list[Event]:
        rows = await self._fetch("SELECT body FROM events WHERE run_id = %s AND seq > %s "
                                 "ORDER BY seq LIMIT %s", (run_id, after, limit))  # NULL: all
        return [event_of(body) for (body,) in rows]

    async def _runs(self, status: RunStatus | None, name: str | None, session_id: str | None,
                    limit: int | None, before: str | None, namespace: str | None) -> list[RunInfo]:
        sql, args = runs_query(status, name, session_id, limit, before, "%s", namespace=namespace)
        rows = [run_row(r) for r in await self._fetch(sql, args)]
        return rows if limit is None else rows[::-1]

    async def _run_info(self, run_id: str) -> RunInfo | None:
        rows = await self._fetch(f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = %s", (run_id,))
        return run_row(rows[0]) if rows else None

    async def _renew(self, owner: str, until: float, run_ids: list[str] | None) -> None:
        # On a live connection: a pool whose connections were dropped (a failover, an idle
        # timeout) must not cost a renewal, or another replica reaps this one's live runs.
        # The same round trip measures the clock again (``_clock``).
        sql = ("WITH renewed AS (UPDATE leases SET lease_until = %s WHERE owner = %s "
               "AND lease_until IS NOT NULL{}) ")

        async def renew(conn: Any) -> None:
            if run_ids is None:
                await self._clock(conn, sql.format(""), (until + self._skew, owner))
            else:
                await self._clock(conn, sql.format(" AND run_id = ANY(%s::text[])"),
                                  (until + self._skew, owner, run_ids))
        await self._on_live(renew, write=True)

    async def _reap(self, now: float) -> list[str]:
        # Locked and skipped: two reapers (two replicas) never abandon the same run twice.
        now += self._skew

        async def reap(conn: Any) -> list[str]:
            async with conn.transaction():
                lapsed = [r for (r,) in await (await _answered(conn.execute(
                    "SELECT run_id FROM leases WHERE lease_until IS NOT NULL AND lease_until < %s "
                    "ORDER BY run_id FOR UPDATE SKIP LOCKED", (now,)))).fetchall()]
                for run_id in lapsed:  # each run's answer bounded, not the whole: a dead
                    await _answered(self._abandon(conn, run_id))  # replica's thousand runs
            return lapsed
        return await self._on_live(reap, write=True, bound=False)

    async def _holder(self, session_id: str, namespace: str) -> str | None:
        rows = await self._fetch("SELECT run_id FROM leases WHERE namespace = %s AND "
                                 "session_id = %s", (namespace, session_id))
        return rows[0][0] if rows else None

    async def _lease_until(self, run_id: str) -> float | None:
        rows = await self._fetch("SELECT lease_until FROM leases WHERE run_id = %s", (run_id,))
        return rows[0][0] - self._skew if rows and rows[0][0] is not None else None

    async def _request(self, run_id: str, action: str, reason: str | None, source: str | None,
                       at: float) -> int:
        # Ids must commit in their order: a watcher goes on from the last id it saw
        # (``follow_requests``), so an id taken before another's and committed after it would
        # never be seen (a CLI's cancel lost behind a replica's pause). The lock, held to the
        # commit, is taken before the row's id (its row comes from the lock's): one round trip.
        rows = await self._fetch(
            "WITH l AS MATERIALIZED (SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))), "
            "r AS (INSERT INTO controls(run_id, action, reason, source, at) "
            "SELECT %s, %s, %s, %s, %s FROM l RETURNING id) "
            "SELECT id, pg_notify(%s, 'c ' || id) FROM r",
            (f"kit:controls:{self.schema}", run_id, action, reason, source, at, self.channel),
            again=False, write=True)  # not twice
        return rows[0][0]

    async def _requests(self, after: int, run_ids: list[str] | None) -> list[ControlRequest]:
        rows = await self._fetch("SELECT id, run_id, action, reason, source FROM controls "
                                 "WHERE id > %s AND (%s::text[] IS NULL OR run_id = ANY(%s)) "
                                 "ORDER BY id", (after, run_ids, run_ids))
        return [ControlRequest(*r) for r in rows]

    async def _last_request(self) -> int:
        return (await self._fetch("SELECT coalesce(max(id), 0) FROM controls"))[0][0]

    async def _last_events(self, run_ids: list[str]) -> dict[str, Event]:
        rows = await self._fetch(LAST_EVENTS + " = ANY(%s::text[])", (run_ids,))
        return {(event := event_of(body)).run_id: event for (body,) in rows}


# ==================================================================================== factory ====

def store_from_url(url: str, *, sqlite_sync: str | None = None, read_only: bool = False,
                   setting: str | None = None) -> StoreBase:
    """Build (not open) the store a ``KIT_STORE``-style URL names.

    ``memory``, ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db`` or
    ``postgresql://...[?schema=name]`` (``PostgresStore``); ``sqlite_sync`` (``KIT_SQLITE_SYNC``:
    ``NORMAL``, the default, or ``FULL``) is SQLite's ``synchronous``; ``read_only`` opens a
    SQLite or Postgres log that exists to read it only (see their classes; a memory store is
    always writable). Raises ``ConfigError`` naming ``setting`` (where the URL came from:
    ``KIT_STORE``, ``--store``) and the URL (its password masked) for anything else or a
    ``postgresql://`` URL that ``pg_url`` refuses, or naming ``KIT_SQLITE_SYNC`` for a
    ``sqlite_sync`` that is neither.
    """
    if url == "memory":
        return MemoryStore()
    if url.startswith("sqlite:///") and len(url) > len("sqlite:///"):
        synchronous = (sqlite_sync or "NORMAL").upper()
        if synchronous not in ("NORMAL", "FULL"):  # the setting's name, as it was written
            raise ConfigError(f"KIT_SQLITE_SYNC must be NORMAL or FULL, got {sqlite_sync!r}")
        return SQLiteStore(url[len("sqlite:///"):], synchronous=synchronous, read_only=read_only)
    if url.startswith(("postgresql://", "postgres://")):
        try:
            return PostgresStore(url, read_only=read_only, setting=setting)
        except ConfigError as exc:  # which setting's URL it is (a session URL may be one too)
            raise ConfigError(f"{setting or 'store URL'}: {exc}") from None
    raise ConfigError(f"{setting + ': ' if setting else ''}unsupported store URL {masked(url)!r}: "
                      "use 'memory', "
                      "'sqlite:///relative/path.db', 'sqlite:////absolute/path.db' or "
                      "'postgresql://user@host/database[?schema=name]'")
