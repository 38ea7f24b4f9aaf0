"""kit_store: the SQLite and in-memory event stores, on ``kit_storebase`` (DESIGN 4.4, 4.5).

Owns: ``SQLiteStore`` (one file, shared by every process that opens it; ``read_only_log`` opens
one to read only), ``MemoryStore`` (one process, no persistence), the rows and run-index queries
the SQL stores share with ``kit_pg`` (``event_row``, ``event_of``, ``runs_query``, ``run_row``,
``status_after``, ``RUN_INDEXES``), the shape of kit's tables that both check a database against
(``KIT_COLUMNS``, ``foreign_table``), ``ENDED`` (the statuses of a run that takes no more
events, in every store) and ``project_log_url`` (where a project's log lives); ``kit_pg`` holds the
Postgres store and ``store_from_url``. Every store keeps the same three things: the log (events
keyed by ``(run_id, seq)``), the run index (``runs``, folded from the log in the same
transaction) and the claims (``leases``: one row per live or parked run, unique per
``(namespace, session_id)``).

Must never: run engine code, read the environment at import, or do I/O at import. Files are opened
by ``async with store:`` only.

Theory of operation: ``append`` is the only writer of events and does everything a batch implies in
one transaction (claim, events, run index, leases), so a reader never sees a half-applied batch.
A run whose log holds its end (status in ``ENDED``) takes no more events: a writer that went on
past its lapsed lease finds the end another process recorded, and its batch is refused whole
(``LogConflictError``). The check rides on the run index's update that every batch makes anyway.
SQLite calls run inline on the event loop thread: an inline commit costs ~30 us where a thread hop
costs 80-190 us, and the Runtime group-commits, so ``append`` receives batches. Writers in other
processes cannot wake this one's followers (``StoreBase``), so the SQLite store also re-reads
every ``poll_interval`` seconds (the one poll kit allows; ``kit_pg``'s store hears them instead).
A thread of its own checkpoints the SQLite WAL, and rewinds it to keep it under ``WAL_LIMIT``.
``runs`` reads the run index a page at a time, each page one range of an index ordered as the
listing is (``RUN_INDEXES``, shared with ``kit_pg``), so a page costs the same in any log
(save COMPLETED pages after many runs of other statuses: see there).
"""
from __future__ import annotations

import bisect
import json
import operator
import os
import sqlite3
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from kit_core import (Claim, ConfigError, ControlRequest, CorruptEventError, Event,
                      LogConflictError, RunFailed, RunInfo, RunStarted, RunStatus,
                      SessionBusyError, iso_time)
from kit_storebase import NotJSONError, StoreBase

__all__ = ("SQLiteStore", "MemoryStore", "project_log_url", "read_only_log", "event_row",
           "event_of", "run_row", "runs_query", "abandoned", "by_run", "RUN_COLUMNS",
           "RUN_INDEXES", "CONTROLS_INDEX", "LAST_EVENTS", "WAL_LIMIT", "ENDED", "KIT_COLUMNS",
           "foreign_table", "status_after")

#: WAL checkpoints run on a thread of their own, after this many commits: on the event loop, a
#: checkpoint (page copies and an fsync) stalls every stream for milliseconds, and costs ~12 us
#: per turn amortised (measured).
_CHECKPOINT_EVERY = 256
#: The size (bytes) a SQLite file's WAL is kept under, while its readers let go of it and its disk
#: checkpoints as fast as writers write. A WAL rewinds to its start only when a writer finds it
#: wholly checkpointed with no reader in it, which PASSIVE checkpoints under continuous writes
#: never achieve (each overlaps the next commit: 778 MiB after 20k turns, measured). So once
#: ``_RESTART_AT`` bytes are in use, the checkpointer rewinds it: it holds writers off for a
#: RESTART checkpoint, which waits up to ``_RESTART_WAIT`` s for readers, and the next commit
#: starts the WAL again, truncated to this size (``journal_size_limit``). A reader that holds one
#: snapshot for longer holds the WAL: it grows until that reader lets go.
WAL_LIMIT = 64 * 1024 * 1024
_RESTART_AT = 16 * 1024 * 1024
_RESTART_WAIT = 0.1
_ABANDONED = "the process playing this run stopped renewing its lease"
#: The statuses of a run whose log holds its terminal event: every store refuses an event for
#: such a run (``LogConflictError`` with ``ended``), where the parked statuses take a resume.
ENDED = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)
#: A batch's update of a run's index row: it matches no row of a run that has ended.
_UPDATE_RUN = ("UPDATE runs SET last_seq = MAX(last_seq, ?), status = COALESCE(?, status) "
               "WHERE run_id = ? AND status NOT IN ("
               + ", ".join(f"'{s.value}'" for s in ENDED) + ")")
_seq = operator.attrgetter("seq")


def abandoned(run_id: str, seq: int, name: str) -> Event:
    """The ``run.failed`` event that records a run whose owner stopped renewing its lease."""
    return Event(run_id, seq, RunFailed(error="RunAbandoned", message=_ABANDONED), origin=name)


def by_run(events: Sequence[Event]) -> dict[str, list[Event]]:
    """A batch's events grouped by run, each group in batch order."""
    out: dict[str, list[Event]] = {}
    for e in events:
        out.setdefault(e.run_id, []).append(e)
    return out


def status_after(events: Sequence[Event]) -> RunStatus | None:
    """A run's status after ``events`` (``fold_status`` of their kinds, read off their payloads:
    the last that sets one), as every store indexes it."""
    for e in reversed(events):
        if (status := e.payload.status) is not None:
            return status
    return None


# ===================================================================================== SQLite ====

#: The run index's listing indexes (SQLite and Postgres): one per filter of ``runs()``, each
#: ordered as the listing is, so a page (with any ``before``) is one range of one index, never a
#: scan and sort; with several filters one index leads and the others filter its range. Each is
#: one more page written per commit, so what can skip one does: runs without a session skip
#: ``runs_session``, runs without a namespace (every HTTP run) ``runs_namespace``, and COMPLETED
#: runs (most of them: every turn ends so) skip ``runs_status`` (measured per SQLite turn, before
#: ``runs_namespace``: append CPU +2-4% and 21.5 WAL pages against 17.4 without these;
#: with COMPLETED runs in runs_status, +6-7% and 23.1). A COMPLETED page walks ``runs_started``
#: back from the cursor instead, past the runs of other statuses (after 20,000 failed runs in a
#: row: 8 ms at 100k runs, against 0.55 ms for any other page).
_SKIPS_STATUS = "status <> 'COMPLETED'"  # runs_status's own term: a query names it to use it
RUN_INDEXES = (
    "CREATE INDEX IF NOT EXISTS runs_started ON runs(started_at, run_id)",
    "CREATE INDEX IF NOT EXISTS runs_status ON runs(status, started_at, run_id) "
    f"WHERE {_SKIPS_STATUS}",
    "CREATE INDEX IF NOT EXISTS runs_name ON runs(name, started_at, run_id)",
    "CREATE INDEX IF NOT EXISTS runs_session ON runs(session_id, started_at, run_id) "
    "WHERE session_id IS NOT NULL",
    # Added after the others (kit_pg builds it on an existing table without locking writers out).
    "CREATE INDEX IF NOT EXISTS runs_namespace ON runs(namespace, started_at, run_id) "
    "WHERE namespace IS NOT NULL",
)
#: A run's control requests (``requests(run_ids=)``): a deck's open reads those of the parked runs
#: only, not every request the log ever took.
CONTROLS_INDEX = "CREATE INDEX IF NOT EXISTS controls_run ON controls(run_id, id)"
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS events(run_id TEXT NOT NULL, seq INTEGER NOT NULL, "
    "kind TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY(run_id, seq)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS runs(run_id TEXT PRIMARY KEY, name TEXT NOT NULL, "
    "invocable TEXT NOT NULL, session_id TEXT, namespace TEXT, parent_run_id TEXT, "
    "status TEXT NOT NULL, started_at TEXT NOT NULL, last_seq INTEGER NOT NULL)",
    # lease_until NULL = parked: the claim holds with no lease to lapse. namespace None is ''
    # here, because NULLs never collide in a unique index.
    "CREATE TABLE IF NOT EXISTS leases(run_id TEXT PRIMARY KEY, namespace TEXT NOT NULL, "
    "session_id TEXT, owner TEXT NOT NULL, lease_until REAL)",
    "CREATE UNIQUE INDEX IF NOT EXISTS leases_session ON leases(namespace, session_id) "
    "WHERE session_id IS NOT NULL",
    # Run ids made by kit are time-ordered, so the primary keys grow at their right edge.
    *RUN_INDEXES,
    "DROP INDEX IF EXISTS runs_live",  # a log written before RUN_INDEXES: runs_status covers it
    "CREATE TABLE IF NOT EXISTS controls(id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, "
    "action TEXT NOT NULL, reason TEXT, source TEXT, at REAL NOT NULL)",
    CONTROLS_INDEX,
)
#: The last events of chosen runs (``last_events``): the run index's ``last_seq`` of each is its
#: event's key (the caller adds which runs: ``IN (...)`` or ``= ANY(...)``).
LAST_EVENTS = ("SELECT e.body FROM runs r JOIN events e ON e.run_id = r.run_id "
               "AND e.seq = r.last_seq WHERE r.run_id")
RUN_COLUMNS = ("run_id, name, invocable, session_id, namespace, status, started_at, parent_run_id, "
               "last_seq")
#: The columns of kit's tables, as ``_SCHEMA`` (and ``kit_pg``'s tables) make them. A database
#: whose table of one of these names has others is another program's: ``CREATE TABLE IF NOT
#: EXISTS`` would add kit's other tables beside it, then every append fail (an outage to the
#: writer, retried until the runs are stopped) or land in that program's table. Both stores
#: refuse it before writing anything to it (``foreign_table``).
KIT_COLUMNS = {
    "events": ("run_id", "seq", "kind", "body"),
    "runs": ("run_id", "name", "invocable", "session_id", "namespace", "parent_run_id", "status",
             "started_at", "last_seq"),
    "leases": ("run_id", "namespace", "session_id", "owner", "lease_until"),
    "controls": ("id", "run_id", "action", "reason", "source", "at"),
}


def foreign_table(found: Mapping[str, Sequence[str]]) -> str | None:
    """Why a database whose tables of ``KIT_COLUMNS``' names have the columns ``found`` (by
    table; none for a table it lacks) is not a kit log, or None when it may be one."""
    for table, columns in KIT_COLUMNS.items():
        have = tuple(found.get(table, ()))
        if have and have != columns:
            return (f"its table {table}({', '.join(have)}) is not kit's "
                    f"{table}({', '.join(columns)})")
    return None


def event_row(e: Event) -> tuple[str, int, str, str]:
    """``(run_id, seq, kind, body)``: an event as the stores keep it, ``body`` its JSON text."""
    # orjson (a dependency of langgraph's): ~5x faster than json here, on every event written.
    try:
        try:
            body = orjson.dumps(e.to_json(orjson_time=True)).decode()
        except TypeError:  # a lone surrogate a model or tool produced, an integer past 64 bits:
            # ASCII-escaped JSON keeps them exactly, and a leading space tells ``event_of`` to
            # read it with the stdlib (orjson would refuse the one and make the other a float).
            body = " " + json.dumps(e.to_json(), separators=(",", ":"))
    except (ValueError, RecursionError) as exc:  # a huge integer; data nested too deep
        raise NotJSONError(f"{e.kind} of run {e.run_id} cannot be written as JSON: "
                           f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return e.run_id, e.seq, e.kind, body


def event_of(body: str) -> Event:
    """The event of a stored ``body`` (``event_row``'s JSON text): one with a leading space,
    which orjson would misread, is read by the stdlib; so is one orjson refuses (a lone surrogate
    written before bodies were marked, which would leave the whole run unreadable)."""
    if not body.startswith(" "):
        try:
            return Event.from_json(orjson.loads(body))
        except orjson.JSONDecodeError:
            pass
    try:
        obj = json.loads(body)
    except ValueError as exc:  # a row edited by hand, or written by another program
        raise CorruptEventError(None, None, None, None, f"its stored body is not JSON ({exc})") \
            from None
    return Event.from_json(obj)


def runs_query(status: RunStatus | None, name: str | None, session_id: str | None,
               limit: int | None, before: str | None, mark: str, *,
               namespace: str | None = None) -> tuple[str, list[Any]]:
    """The SQL of a ``runs()`` page and its arguments (``mark``: the driver's placeholder, ``?``
    or ``%s``). With ``limit``, the rows come newest first (the caller reverses them): an index
    walked backwards from the cursor stops after ``limit`` rows. An unknown ``before`` selects
    nothing (its start is NULL)."""
    terms, args = [], []
    for column, value in (("status", None if status is None else status.value), ("name", name),
                          ("session_id", session_id), ("namespace", namespace)):
        if value is not None:
            terms.append(f"{column} = {mark}")
            args.append(value)
    if status is not None and status is not RunStatus.COMPLETED:
        terms.append(_SKIPS_STATUS)
    if before is not None:
        # A row value: one range of an index on (..., started_at, run_id), in SQLite and Postgres.
        cursor = f"SELECT started_at FROM runs WHERE run_id = {mark}"
        terms.append(f"(started_at, run_id) < (({cursor}), {mark})")
        args += [before, before]
    sql = f"SELECT {RUN_COLUMNS} FROM runs" + (" WHERE " + " AND ".join(terms) if terms else "")
    if limit is None:
        return sql + " ORDER BY started_at, run_id", args
    return sql + f" ORDER BY started_at DESC, run_id DESC LIMIT {mark}", [*args, limit]


def run_row(r: tuple[Any, ...]) -> RunInfo:
    """A ``RunInfo`` from a row of ``RUN_COLUMNS`` (``started_at`` as ISO text)."""
    return RunInfo(r[0], r[1], r[2], r[3], r[4], RunStatus(r[5]), datetime.fromisoformat(r[6]), r[7],
                   r[8])


class _Checkpointer(threading.Thread):
    """Copies the WAL back into the database file on its own connection and thread, and
    rewinds the WAL once it holds ``_RESTART_AT`` bytes (see ``WAL_LIMIT``).

    PASSIVE checkpoints never block writers or readers. A rewind is a second PASSIVE (most of
    the copying, writers going on), then a RESTART, during which ``restarting`` is set and
    ``SQLiteStore._tx`` reports the file locked: the store's own writes back off and wait (a few
    ms, up to ``_RESTART_WAIT`` more for readers) while the RESTART takes the write lock at once.
    A RESTART that times out on a long reader is not tried again until the WAL has doubled, so a
    long reader costs a few waits, not a spin. sqlite3 releases the GIL while it does file I/O.
    """

    def __init__(self, path: str) -> None:
        super().__init__(name="kit-checkpoint", daemon=True)
        self.path, self._go, self._stopping = path, threading.Event(), False
        self.restarting = False  # read by the store's writer, on the event loop's thread
        self._restart_at = _RESTART_AT  # the WAL size (bytes) that calls for the next rewind
        self._rewound = -1  # the WAL's frame count at the last rewind, until a commit rewinds it

    def poke(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stopping = True
        self._go.set()
        self.join()

    def run(self) -> None:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            # Only RESTART waits (PASSIVE never calls the busy handler), and briefly: the writers
            # it holds off wait with it.
            db.execute(f"PRAGMA busy_timeout={int(_RESTART_WAIT * 1000)}")
            while True:
                self._go.wait()
                self._go.clear()
                if self._stopping:
                    return
                try:
                    self._checkpoint(db)
                except sqlite3.Error:
                    pass  # busy or interrupted: the next poke tries again
        finally:
            db.close()

    def _checkpoint(self, db: sqlite3.Connection) -> None:
        """A PASSIVE checkpoint, then a rewind if the WAL holds ``_restart_at`` bytes or more."""
        frames = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]
        in_use = frames * (db.execute("PRAGMA page_size").fetchone()[0] + 24)  # 24: frame header
        if in_use < self._restart_at or frames == self._rewound:  # (a poke from before a rewind)
            return
        db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        self.restarting = True
        try:
            busy, frames, _ = db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
        finally:
            self.restarting = False
        self._restart_at, self._rewound = (2 * in_use, -1) if busy else (_RESTART_AT, frames)


_HAS_EVENTS = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'events'"


def read_only_log(path: str) -> sqlite3.Connection:
    """A connection to read the kit log in the SQLite file ``path``, which kit writes nothing
    through (the store's writing methods refuse first), its schema least of all.

    A file this process may write (and its directory) is opened as a writer opens it (SQLite's
    ``mode=rw``, which never creates a file), so the ``-wal`` and ``-shm`` files it takes are
    removed when the last connection closes: a ``mode=ro`` reader would leave them behind, owned
    by whoever read, where the log's own user might not open them. Any other is opened
    ``mode=ro``, which takes the ``-shm`` index of a WAL-mode file if it is there; where it is
    not and cannot be created (a read-only mount, another user's directory) and no ``-wal`` file
    is there either (no process is writing the log: every commit is in the file), the file is
    opened ``immutable``, which needs no index. Raises ``ConfigError`` naming ``path`` when the
    file is a database without kit's ``events`` table, ``sqlite3.Error`` when it cannot be read
    (no such file, not a database, a ``-wal`` whose index it cannot take).
    """
    folder = os.path.dirname(os.path.abspath(path))
    writable = os.access(path, os.W_OK) and os.access(folder, os.W_OK)
    uri = Path(os.path.abspath(path)).as_uri() + ("?mode=rw" if writable else "?mode=ro")
    db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
    try:
        try:
            found = db.execute(_HAS_EVENTS).fetchone()
        except sqlite3.OperationalError as exc:  # (no index to take: raised by the first read)
            if writable or not os.path.isfile(path):
                raise
            if os.path.exists(path + "-wal"):  # a writer's, or one that crashed
                raise sqlite3.OperationalError(
                    f"{exc}: {path}-wal holds commits not yet in {path}, and reading them takes a "
                    f"{path}-shm index this process cannot create or open; read the log where it "
                    "may be written (or a copy of the files somewhere writable)") from None
            db.close()
            db = sqlite3.connect(uri + "&immutable=1", uri=True, check_same_thread=False,
                                 isolation_level=None)
            found = db.execute(_HAS_EVENTS).fetchone()
        if found is None:
            raise ConfigError(f"{path} is not a kit event log (it has no events table)")
    except BaseException:
        db.close()
        raise
    return db


class _Transaction:
    """A write transaction of a ``SQLiteStore`` (``with store._tx as db:``): BEGIN IMMEDIATE on
    entry, COMMIT on a clean exit, ROLLBACK on any exception, the body's or COMMIT's. IMMEDIATE
    takes the write lock up front: a deferred transaction that reads first and upgrades later
    can fail with "database is locked" without ever calling the busy handler. One per store,
    made with it: as a generator (``contextlib.contextmanager``), every commit paid ~6k more
    instructions for its context manager (callgrind, a turn's commit)."""

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        store = self.store
        if store._checkpointer is not None and store._checkpointer.restarting:
            raise sqlite3.OperationalError("database is locked")  # by the WAL's rewind: back off
        db = store._con
        db.execute("BEGIN IMMEDIATE")
        return db

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        store = self.store
        db = store._con
        try:
            if exc_type is None:
                db.execute("COMMIT")
        finally:
            if db.in_transaction:  # some errors (SQLITE_FULL, IOERR) have rolled back already
                db.execute("ROLLBACK")
        if exc_type is None:
            store._commits += 1
            if store._commits % _CHECKPOINT_EVERY == 0 and store._checkpointer is not None:
                store._checkpointer.poke()


class SQLiteStore(StoreBase):
    """The log in one SQLite file (WAL), shared by every process that opens the same path.

    ``poll_interval`` bounds how late a follower sees events written by another process; events
    written through this object wake followers at once. ``read_only=True`` opens an existing log
    to read it only (``read_only_log``), where this process may not write (a read-only mount,
    another user's file): its writing methods raise ``KitError``. Raises ``ConfigError`` for a
    non-positive ``poll_interval``; opening raises ``sqlite3.Error`` if the file cannot be
    opened, and read-only ``ConfigError`` for a database that is not a kit log.
    """

    def __init__(self, path: str | os.PathLike[str], *, poll_interval: float = 0.05,
                 synchronous: str = "NORMAL", read_only: bool = False) -> None:
        super().__init__()
        if not poll_interval > 0:
            raise ConfigError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        if synchronous not in ("NORMAL", "FULL"):
            raise ConfigError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.path, self._poll, self.synchronous = os.fspath(path), poll_interval, synchronous
        self.read_only = bool(read_only)
        self._db: sqlite3.Connection | None = None
        self._checkpointer: _Checkpointer | None = None
        self._tx = _Transaction(self)  # ``with self._tx as db:``, every write

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r}{', read_only=True' * self.read_only})"

    @property
    def url(self) -> str:
        """The ``KIT_STORE`` URL that names this store (its durable workflows checkpoint beside it)."""
        return f"sqlite:///{self.path}"

    @property
    def _con(self) -> sqlite3.Connection:
        assert self._db is not None  # the public methods checked that the store is open
        return self._db

    async def _opening(self) -> None:
        try:
            await super()._opening()
        except sqlite3.Error as exc:  # "file is not a database", "unable to open database file"
            raise type(exc)(f"cannot open {self.path} as an event log: {exc}") from None

    def _open(self) -> None:
        if self.read_only:  # no schema, no pragma that writes, no checkpointer
            db = read_only_log(self.path)
            db.execute("PRAGMA busy_timeout=0")  # as below: _retrying backs off
            self._db = db
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        # isolation_level=None: no implicit transactions; every write says BEGIN IMMEDIATE itself.
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            # No busy handler: a locked file raises at once and _retrying backs off asynchronously.
            db.execute("PRAGMA busy_timeout=0")
            found = {t: [row[1] for row in db.execute(f"PRAGMA table_info({t})").fetchall()]
                     for t in KIT_COLUMNS}
            if (foreign := foreign_table(found)) is not None:  # before WAL mode (it writes)
                raise ConfigError(f"{self.path} is not a kit event log: {foreign}; nothing was "
                                  "written to it (give kit a file of its own)")
            db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer, nor it them
            # NORMAL: a commit survives a crash of the process, not a power loss (the WAL is
            # synced at checkpoints only); FULL syncs it at every commit (KIT_SQLITE_SYNC).
            db.execute(f"PRAGMA synchronous={self.synchronous}")
            db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread does it
            db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT}")  # a rewound WAL is cut to it
            self._db, self._commits = db, 0
            with self._tx:
                for statement in _SCHEMA:
                    db.execute(statement)
        except BaseException:
            self._db = None
            db.close()
            raise
        self._checkpointer = _Checkpointer(self.path)
        self._checkpointer.start()

    def _close(self) -> None:
        db, self._db = self._db, None
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.stop()
        if db is not None:
            db.close()  # the last connection to close checkpoints and removes the WAL

    def _append(self, events: list[Event], claims: Sequence[Claim], now: float) -> None:
        rows = [event_row(e) for e in events]  # serialised before the write lock is taken
        overtaken: list[Event] = []
        try:
            with self._tx as db:
                for claim in claims:
                    self._claim(db, claim, now, overtaken)
                db.executemany("INSERT INTO events VALUES (?, ?, ?, ?)", rows)
                claimed = {c.run_id for c in claims}
                for run_id, run_events in by_run(events).items():
                    status = status_after(run_events)
                    last = max(map(_seq, run_events))
                    first = run_events[0]
                    if isinstance(p := first.payload, RunStarted):  # a new run, indexed as it is now
                        db.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                   (run_id, p.name, p.invocable, p.session_id, p.namespace,
                                    p.parent_run_id, (status or RunStatus.RUNNING).value,
                                    iso_time(first.at), last))
                    elif not db.execute(_UPDATE_RUN, (last, status.value if status else None,
                                                      run_id)).rowcount:
                        # Ended, or a run the index lacks (events with no run.started): only
                        # the first is refused, inside the transaction, which rolls back.
                        row = db.execute("SELECT status FROM runs WHERE run_id = ?",
                                         (run_id,)).fetchone()
                        if row is not None:
                            raise LogConflictError(run_id, first.seq, RunStatus(row[0]))
                    ends = run_events[-1].payload.ends
                    if ends == "terminal" and (first.kind != "run.started" or run_id in claimed):
                        # (a run that starts and ends in this batch unclaimed never had a lease)
                        db.execute("DELETE FROM leases WHERE run_id = ?", (run_id,))
                    elif ends == "parking":
                        db.execute("UPDATE leases SET lease_until = NULL WHERE run_id = ?", (run_id,))
        except sqlite3.IntegrityError:
            # Rolled back by now, so the table shows exactly what was there before this batch.
            raise self._conflict(events) from None
        self._overtaken += overtaken  # committed: reported by ``append``

    def _claim(self, db: sqlite3.Connection, claim: Claim, now: float,
               overtaken: list[Event]) -> None:
        until = now + claim.lease_seconds
        if db.execute("UPDATE leases SET owner = ?, lease_until = ? WHERE run_id = ?",
                      (claim.owner, until, claim.run_id)).rowcount:
            return  # a resumer re-taking its own run
        namespace = claim.namespace or ""
        if claim.session_id is not None:
            held = db.execute("SELECT run_id, lease_until FROM leases WHERE namespace = ? AND "
                              "session_id = ?", (namespace, claim.session_id)).fetchone()
            if held is not None:
                if held[1] is None or held[1] >= now:
                    raise SessionBusyError(claim.session_id, held[0], claim.namespace)
                overtaken.append(self._abandon(db, held[0]))
        db.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?)",
                   (claim.run_id, namespace, claim.session_id, claim.owner, until))

    def _abandon(self, db: sqlite3.Connection, run_id: str) -> Event:
        name, last = db.execute("SELECT (SELECT name FROM runs WHERE run_id = ?), "
                                "(SELECT MAX(seq) FROM events WHERE run_id = ?)",
                                (run_id, run_id)).fetchone()
        event = abandoned(run_id, 0 if last is None else last + 1, name or "")
        db.execute("INSERT INTO events VALUES (?, ?, ?, ?)", event_row(event))
        db.execute("UPDATE runs SET status = ?, last_seq = ? WHERE run_id = ?",
                   (RunStatus.FAILED.value, event.seq, run_id))
        db.execute("DELETE FROM leases WHERE run_id = ?", (run_id,))
        return event

    def _conflict(self, events: list[Event]) -> LogConflictError:
        db = self._con
        for e in events:
            if db.execute("SELECT 1 FROM events WHERE run_id = ? AND seq = ?",
                          (e.run_id, e.seq)).fetchone():
                return LogConflictError(e.run_id, e.seq)
        for e in events:  # no taken seq: a run.started reused a run id
            if e.kind == "run.started" and db.execute(
                    "SELECT 1 FROM runs WHERE run_id = ?", (e.run_id,)).fetchone():
                return LogConflictError(e.run_id, e.seq)
        return LogConflictError(events[0].run_id, events[0].seq)

    def _read(self, run_id: str, after: int, limit: int | None) -> list[Event]:
        # fetchall: an unfinished cursor would hold a read transaction open between polls.
        rows = self._con.execute("SELECT body FROM events WHERE run_id = ? AND seq > ? ORDER BY seq "
                                 "LIMIT ?", (run_id, after, -1 if limit is None else limit)).fetchall()
        return [event_of(body) for (body,) in rows]

    def _runs(self, status: RunStatus | None, name: str | None, session_id: str | None,
              limit: int | None, before: str | None, namespace: str | None) -> list[RunInfo]:
        sql, args = runs_query(status, name, session_id, limit, before, "?", namespace=namespace)
        rows = [run_row(r) for r in self._con.execute(sql, args).fetchall()]
        return rows if limit is None else rows[::-1]

    def _run_info(self, run_id: str) -> RunInfo | None:
        row = self._con.execute(f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?",
                                (run_id,)).fetchone()
        return None if row is None else run_row(row)

    def _busy(self, exc: Exception) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and (
            "locked" in str(exc) or "busy" in str(exc))

    def _unstorable(self, exc: Exception) -> bool:
        return super()._unstorable(exc) or isinstance(exc, sqlite3.DataError)  # (too big, too)

    def _renew(self, owner: str, until: float, run_ids: list[str] | None) -> None:
        sql = "UPDATE leases SET lease_until = ? WHERE owner = ? AND lease_until IS NOT NULL"
        with self._tx as db:
            if run_ids is None:
                db.execute(sql, (until, owner))
            else:
                db.execute(sql + " AND run_id IN (SELECT value FROM json_each(?))",
                           (until, owner, json.dumps(run_ids)))

    def _reap(self, now: float) -> list[str]:
        # Selected inside the write transaction: a concurrent reaper in another process has
        # either committed (and deleted the lease) or waits for us, so no run fails twice.
        with self._tx as db:
            lapsed = [r for (r,) in db.execute(
                "SELECT run_id FROM leases WHERE lease_until IS NOT NULL AND lease_until < ? "
                "ORDER BY run_id", (now,)).fetchall()]
            for run_id in lapsed:
                self._abandon(db, run_id)
        return lapsed

    def _holder(self, session_id: str, namespace: str) -> str | None:
        row = self._con.execute("SELECT run_id FROM leases WHERE namespace = ? AND session_id = ?",
                                (namespace, session_id)).fetchone()
        return None if row is None else row[0]

    def _lease_until(self, run_id: str) -> float | None:
        row = self._con.execute("SELECT lease_until FROM leases WHERE run_id = ?",
                                (run_id,)).fetchone()
        return None if row is None else row[0]

    def _request(self, run_id: str, action: str, reason: str | None, source: str | None, at: float) -> int:
        with self._tx as db:
            return db.execute("INSERT INTO controls(run_id, action, reason, source, at) "
                              "VALUES (?, ?, ?, ?, ?)", (run_id, action, reason, source, at)).lastrowid

    def _requests(self, after: int, run_ids: list[str] | None) -> list[ControlRequest]:
        query = "SELECT id, run_id, action, reason, source FROM controls WHERE id > ?"
        if run_ids is None:
            rows = self._con.execute(query + " ORDER BY id", (after,)).fetchall()
        else:  # a few hundred ids a query: SQLite caps a statement's parameters
            rows = sorted(row for i in range(0, len(run_ids), 500) for row in self._con.execute(
                f"{query} AND run_id IN ({','.join('?' * len(run_ids[i:i + 500]))})",
                (after, *run_ids[i:i + 500])))
        return [ControlRequest(*r) for r in rows]

    def _last_request(self) -> int:
        return self._con.execute("SELECT coalesce(max(id), 0) FROM controls").fetchone()[0]

    def _last_events(self, run_ids: list[str]) -> dict[str, Event]:
        out: dict[str, Event] = {}
        for i in range(0, len(run_ids), 500):  # a few hundred ids a query, as in _requests
            chunk = run_ids[i:i + 500]
            for (body,) in self._con.execute(f"{LAST_EVENTS} IN ({','.join('?' * len(chunk))})",
                                             chunk).fetchall():
                event = event_of(body)
                out[event.run_id] = event
        return out


# ===================================================================================== memory ====

@dataclass(slots=True)
class _Lease:
    namespace: str  # '' for None, as in SQLite
    session_id: str | None
    owner: str
    until: float | None  # None = parked


class MemoryStore(StoreBase):
    """The log in this process's memory: same semantics as ``SQLiteStore``, nothing persisted.

    Data survives ``aclose`` and reopening the same object, and nothing else.
    """

    url = "memory"  # the KIT_STORE URL that names it

    def __init__(self) -> None:
        super().__init__()
        self._logs: dict[str, list[Event]] = {}  # each sorted by seq
        self._keys: set[tuple[str, int]] = set()
        self._index: dict[str, RunInfo] = {}
        self._order: list[tuple[datetime, str]] = []  # (started_at, run_id) of each run, sorted
        self._leases: dict[str, _Lease] = {}
        self._controls: list[ControlRequest] = []

    def _append(self, events: list[Event], claims: Sequence[Claim], now: float) -> None:
        # Check everything before changing anything: a refused batch writes nothing. Taken seqs
        # first, then ended runs, as the SQL stores find them.
        for e in events:
            if (e.run_id, e.seq) in self._keys or (e.kind == "run.started" and e.run_id in self._index):
                raise LogConflictError(e.run_id, e.seq)
        for e in events:
            if (info := self._index.get(e.run_id)) is not None and info.status in ENDED:
                raise LogConflictError(e.run_id, e.seq, info.status)
        overtaken = []
        # Each claim meets the ones before it in the batch too, as the SQL stores insert them
        # one after another: a second claim of one session finds it busy.
        claiming: dict[tuple[str, str], str] = {}
        for claim in claims:
            if claim.run_id in self._leases or claim.session_id is None:
                continue
            key = (claim.namespace or "", claim.session_id)
            if key in claiming:
                raise SessionBusyError(claim.session_id, claiming[key], claim.namespace)
            claiming[key] = claim.run_id
            holder = self._holder(claim.session_id, claim.namespace or "")
            if holder is not None:
                until = self._leases[holder].until
                if until is None or until >= now:
                    raise SessionBusyError(claim.session_id, holder, claim.namespace)
                overtaken.append(holder)
        for holder in overtaken:
            self._overtaken.append(self._abandon(holder))  # (nothing below refuses the batch)
        for claim in claims:
            until = now + claim.lease_seconds
            if (lease := self._leases.get(claim.run_id)) is not None:
                lease.owner, lease.until = claim.owner, until
            else:
                self._leases[claim.run_id] = _Lease(claim.namespace or "", claim.session_id,
                                                    claim.owner, until)
        for e in events:
            self._insert(e)
            if isinstance(p := e.payload, RunStarted):
                self._index[e.run_id] = RunInfo(e.run_id, p.name, p.invocable, p.session_id,
                                                p.namespace, RunStatus.RUNNING, e.at,
                                                p.parent_run_id, e.seq)
                bisect.insort(self._order, (e.at, e.run_id))  # at the end, as a rule
        for run_id, run_events in by_run(events).items():
            status, info = status_after(run_events), self._index.get(run_id)
            if info is not None:  # (a batch's seqs may come in any order, as in SQL's MAX)
                last = max(info.last_seq or 0, *map(_seq, run_events))
                self._index[run_id] = replace(info, status=status or info.status, last_seq=last)
            ends = run_events[-1].payload.ends  # as it stands after the batch, as in SQLite
            if ends == "terminal":
                self._leases.pop(run_id, None)
            elif ends == "parking" and (lease := self._leases.get(run_id)):
                lease.until = None

    def _insert(self, event: Event) -> None:
        log = self._logs.setdefault(event.run_id, [])
        if not log or log[-1].seq < event.seq:
            log.append(event)  # the usual case: a run's events arrive in order
        else:
            bisect.insort(log, event, key=_seq)
        self._keys.add((event.run_id, event.seq))

    def _abandon(self, run_id: str) -> Event:
        log, info = self._logs.get(run_id), self._index.get(run_id)
        event = abandoned(run_id, log[-1].seq + 1 if log else 0, info.name if info else "")
        self._insert(event)
        if info is not None:
            self._index[run_id] = replace(info, status=RunStatus.FAILED, last_seq=event.seq)
        del self._leases[run_id]
        return event  # (its followers, with no poll to fall back on, are woken by the caller)

    def _read(self, run_id: str, after: int, limit: int | None) -> list[Event]:
        log = self._logs.get(run_id, [])
        start = bisect.bisect_right(log, after, key=_seq)
        return log[start:] if limit is None else log[start:start + limit]

    def _runs(self, status: RunStatus | None, name: str | None, session_id: str | None,
              limit: int | None, before: str | None, namespace: str | None) -> list[RunInfo]:
        end = len(self._order)
        if before is not None:
            if (cursor := self._index.get(before)) is None:
                return []
            end = bisect.bisect_left(self._order, (cursor.started_at, before))
        found = []
        for i in range(end - 1, -1, -1):  # newest first, so a page stops at its limit
            info = self._index[self._order[i][1]]
            if (status is None or info.status == status) and (name is None or info.name == name) \
                    and (session_id is None or info.session_id == session_id) \
                    and (namespace is None or info.namespace == namespace):
                found.append(info)
                if len(found) == limit:
                    break
        return found[::-1]

    def _run_info(self, run_id: str) -> RunInfo | None:
        return self._index.get(run_id)

    def _renew(self, owner: str, until: float, run_ids: list[str] | None) -> None:
        wanted = None if run_ids is None else set(run_ids)
        for run_id, lease in self._leases.items():
            if lease.owner == owner and lease.until is not None and (wanted is None or run_id in wanted):
                lease.until = until

    def _reap(self, now: float) -> list[str]:
        lapsed = sorted(r for r, lease in self._leases.items()
                        if lease.until is not None and lease.until < now)
        for run_id in lapsed:
            self._abandon(run_id)
        return lapsed

    def _request(self, run_id: str, action: str, reason: str | None, source: str | None, at: float) -> int:
        self._controls.append(ControlRequest(len(self._controls) + 1, run_id, action, reason, source))
        return len(self._controls)

    def _requests(self, after: int, run_ids: list[str] | None) -> list[ControlRequest]:
        found = self._controls[max(after, 0):]  # (ids are 1, 2, ...: a negative index is no id)
        if run_ids is None:
            return found
        wanted = set(run_ids)
        return [r for r in found if r.run_id in wanted]

    def _last_request(self) -> int:
        return len(self._controls)

    def _last_events(self, run_ids: list[str]) -> dict[str, Event]:
        return {run_id: self._logs[run_id][-1] for run_id in run_ids if self._logs.get(run_id)}

    def _holder(self, session_id: str, namespace: str) -> str | None:
        return next((r for r, lease in self._leases.items()
                     if lease.session_id == session_id and lease.namespace == namespace), None)

    def _lease_until(self, run_id: str) -> float | None:
        lease = self._leases.get(run_id)
        return None if lease is None else lease.until


# ================================================================================== locations ====

def project_log_url(project: str | os.PathLike[str]) -> str:
    """The store URL of a project's own log, ``<project>/.state/kit.db`` as an absolute
    ``sqlite:///`` URL: where ``Deck.from_project`` and ``kit-serve`` keep it without
    ``KIT_STORE``, and where the ``kit`` command looks for it."""
    return f"sqlite:///{(Path(project) / '.state' / 'kit.db').resolve()}"
