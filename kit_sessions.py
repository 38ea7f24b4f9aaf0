"""kit_sessions: the conversation memory of a deck's agent runs, one SDK session per conversation.

Owns: ``Sessions`` (the ``agents.memory.Session`` of each conversation key, chosen by
``KIT_SESSION``: in-process, a SQLite file, Postgres or Redis; at most ``KIT_SESSION_MAX`` kept),
``MemorySession`` (the in-process default: every conversation of the process in one in-memory
SQLite database, which outlives a deck), ``OnEngine`` (a session as a caller under trio holds
it: its coroutine methods played on the engines' asyncio loop) and ``MAX_SESSIONS``.

Must never: reach the event store, the Runtime or a run (the log is the record of every turn; a
session is only what the model is given to remember), touch asyncio directly (kit_bridge does),
or show a session URL's password (``kit_storebase.masked``).

Theory of operation
-------------------
The SDK reads a session's history before each turn (all of it, or what the agent's history
limit lets through) and appends the turn's items after it.
Its own session classes cost a connection or a private database per conversation, so kit shares
what they would each build: one in-memory database (``MemorySession``), one connection per
SQLite file, one set of SQLAlchemy table objects per Postgres deck. A deck keeps at most
``max_sessions`` objects, least recently used dropped first; only the in-process default loses a
conversation's history that way (the log still holds every turn), so a conversation held by a
run of the deck, live or parked (paused), is never dropped: the Runtime says when a run takes
one and when it ends (``hold``, ``release``; a run id is only a name here), and while every kept
one is held the bound is exceeded rather than a history a run still needs lost.
A run is given its conversation through a view (``peek``: ``_TurnSession``) that keeps what the
run adds until the Runtime writes it, just before the run's end is committed: a conversation
holds the turns whose runs recorded an end (completed, paused, failed, cancelled at a safe
point), never a question a killed or abandoned run left unanswered. The SDK's
``OpenAIConversationsSession`` gets a view of its own type (the SDK treats it by its type).
The Postgres sessions' pooled connections (``kit-session:<schema>`` in ``pg_stat_activity``) are
pinged when taken, so a turn after the server dropped them (a restart, a failover) reconnects
instead of failing. The Redis client's connections (``kit-session`` in ``CLIENT LIST``) are
pinged before a command when they sat idle past ``REDIS_CHECK``, and reopened when the ping
finds them dropped, or at once when the server's close has reached them already (one dropped
right after a turn); a command itself is never retried, so a write whose reply was lost is never
made twice (``_pinged``). A server of either that stops answering without closing its
connections fails the turn after ``REDIS_TIMEOUT`` / ``PG_TIMEOUT``, which frees its session.
"""
from __future__ import annotations

import copy
import functools
import inspect
import json
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import agents as sdk
import anyio
from agents.memory import SessionABC

from kit_core import ConfigError
from kit_pgpool import open_pool, pg_url, setup_lock
from kit_storebase import masked

__all__ = ("Sessions", "MemorySession", "OnEngine", "MAX_SESSIONS", "NAMESPACE_SEP",
           "REDIS_CHECK", "REDIS_TIMEOUT", "PG_TIMEOUT")

#: Between a namespace and a session id in a session's key: a control character, which no id
#: holds (``check_id``). With ``:``, a caller without a namespace (every HTTP caller) who named
#: session ``tenant:s1`` had namespace ``tenant``'s conversation ``s1``.
NAMESPACE_SEP = "\x1f"
#: Conversations the in-process session store keeps (``KIT_SESSION_MAX``), least recently used
#: dropped first: ~2 kB each measured, so ~20 MB at the default; bounded, unlike a process's life.
MAX_SESSIONS = 10_000
#: A Redis session connection idle longer than this (seconds) is pinged before its next command
#: (redis-py's ``health_check_interval``; a URL's ``?health_check_interval=`` overrides it): a
#: round trip at most once a second per connection, where a turn waits seconds on its model
#: anyway, instead of one before every command. A connection dropped less than this after its
#: last reply is not caught: its next command fails.
REDIS_CHECK = 1.0
#: How long a Redis session command, or a connect, may wait (seconds; a URL's
#: ``?socket_timeout=`` / ``?socket_connect_timeout=`` override it). redis-py waits forever: a
#: Redis that stops answering without closing its connections (a partition, a frozen server) held
#: the turn, and its session busy, until it came back. Now the turn fails, and frees its session.
REDIS_TIMEOUT = 10.0
#: How long one Postgres session call (a read or a write of a turn's items, with the checkout
#: and its ping, or a connect) may wait (seconds). SQLAlchemy and psycopg wait forever on a
#: server that stops answering without closing its connections (a partition, a frozen server):
#: the turn, and its session, were held until it came back. Now the turn fails, and frees its
#: session; the connection it was on is closed (psycopg closes one whose query was cut short).
PG_TIMEOUT = 10.0


class _MemoryDB:
    """Every conversation-memory session of the process in ONE in-memory SQLite database.

    The SDK's ``SQLiteSession(":memory:")`` costs ~64 KiB per session (a private database each,
    PERF.md section 1); here a session is a key into one shared table. Lost on process exit
    (SPEC 8), not when a deck closes: every deck of the process shares it (``_process_memory``).
    """

    def __init__(self) -> None:
        self.db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        self.db.execute("CREATE TABLE items(id INTEGER PRIMARY KEY AUTOINCREMENT, "
                        "session TEXT NOT NULL, data TEXT NOT NULL)")
        self.db.execute("CREATE INDEX items_session ON items(session, id)")
        self.lock = threading.Lock()  # the engine thread and the kit side may both call in

    def keys(self) -> list[str]:
        """The conversations it holds, least recently written first."""
        with self.lock:
            return [r[0] for r in self.db.execute(
                "SELECT session FROM items GROUP BY session ORDER BY MAX(id)")]


#: The process's in-process conversations, made by the first deck that needs them and kept by
#: every deck after it: a notebook's next ``async with Deck(...)`` has its history, and resumes
#: a run the last one paused with it. Each deck had its own, lost when the deck closed.
_memory: _MemoryDB | None = None


def _process_memory() -> _MemoryDB:
    global _memory
    if _memory is None:
        _memory = _MemoryDB()
    return _memory


class MemorySession(SessionABC):
    """An ``agents.memory.Session`` over the shared in-memory database."""

    def __init__(self, store: _MemoryDB, session_id: str) -> None:
        self.session_id, self.session_settings, self._s = session_id, None, store

    async def get_items(self, limit: int | None = None) -> list[Any]:
        with self._s.lock:
            if limit is None:
                rows = self._s.db.execute("SELECT data FROM items WHERE session=? ORDER BY id",
                                          (self.session_id,)).fetchall()
            else:
                rows = self._s.db.execute(
                    "SELECT data FROM (SELECT id, data FROM items WHERE session=? ORDER BY id DESC "
                    "LIMIT ?) ORDER BY id", (self.session_id, limit)).fetchall()
        return [json.loads(r[0]) for r in rows]

    async def add_items(self, items: list[Any]) -> None:
        rows = [(self.session_id, json.dumps(i, default=str)) for i in items]
        with self._s.lock:
            self._s.db.executemany("INSERT INTO items(session, data) VALUES (?, ?)", rows)

    async def pop_item(self) -> Any:
        with self._s.lock:
            row = self._s.db.execute("SELECT id, data FROM items WHERE session=? ORDER BY id DESC "
                                     "LIMIT 1", (self.session_id,)).fetchone()
            if row is None:
                return None
            self._s.db.execute("DELETE FROM items WHERE id=?", (row[0],))
        return json.loads(row[1])

    async def clear_session(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Delete this conversation's items (synchronously: eviction happens on the kit side)."""
        with self._s.lock:
            self._s.db.execute("DELETE FROM items WHERE session=?", (self.session_id,))


class _FileSession(sdk.SQLiteSession):
    """The SDK's ``SQLiteSession`` on a file (``KIT_SESSION=sqlite:///path``), its queries
    unchanged, on one connection that every session of the file shares.

    The SDK's own opens a connection per session object per worker thread, each with its file
    descriptors and page cache (measured: ~4 descriptors and ~240 kB per conversation), so the
    ``KIT_SESSION_MAX`` conversations a deck keeps would exhaust the process's descriptors. The
    SDK already serializes every query on one lock per file (``_locked_connection``), which is
    what makes one shared connection safe.
    """

    def __init__(self, session_id: str, path: str, conn: sqlite3.Connection) -> None:
        super().__init__(session_id, path)
        self._conn = conn

    def _get_connection(self) -> sqlite3.Connection:
        if self._closed:
            raise RuntimeError("SQLiteSession is closed")
        return self._conn


@functools.cache
def _pinged(connection_class: type) -> type:
    """redis-py's ``connection_class`` (the URL scheme's) whose failed health check reconnects.

    redis-py pings a connection idle past ``health_check_interval`` before its next command
    (``check_health``), under the connection's ``retry``, which ``from_url`` leaves at none: the
    failed ping closes the connection and raises, and the command fails all the same ("Connection
    closed by server"). A ``retry`` would make the ping reconnect, but it retries every command
    too: a command whose reply was lost after the server ran it (the ``RPUSH`` of a turn's
    items, in a failover) would run twice. So the connection holds a one-retry policy for its
    health check only: a failed ping is sent again on a new connection (its handshake unchecked,
    so this never recurses), and raises if that fails too; commands stay unretried. A connection
    whose reader has met the server's close (redis-py's ``_reader`` at EOF) is reopened before any
    command, pinged or not: within ``health_check_interval`` of its last use nothing else looks.
    """
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    ping_retry = Retry(NoBackoff(), 1)  # stateless between calls: shared by every connection

    class Pinged(connection_class):  # type: ignore[misc, valid-type]
        async def check_health(self) -> None:
            reader = self._reader
            if reader is not None and reader.at_eof():  # the server closed it since its last use
                await self.disconnect()  # (no command was sent on it yet: nothing runs twice)
                await self.connect()
            # A pooled connection serves one command at a time, so the swap is its own.
            commands, self.retry = self.retry, ping_retry
            try:
                await super().check_health()
            finally:
                self.retry = commands

    Pinged.__name__ = Pinged.__qualname__ = f"Pinged{connection_class.__name__}"
    return Pinged


@functools.cache
def _pg_session_class() -> type:
    """The SDK's ``SQLAlchemySession`` (``KIT_SESSION=postgresql://...``), its queries
    unchanged, with the SQLAlchemy objects of its tables shared by every session of a deck.

    The SDK builds a ``MetaData``, two ``Table``s and a session maker per session object
    (~31 kB each, measured): ~300 MB for the ``KIT_SESSION_MAX`` conversations a deck keeps.
    They describe the same tables on the same engine, so the first session's serve them all.
    Made on first use: the SDK's extension imports SQLAlchemy.
    """
    from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession

    class PgSession(SQLAlchemySession):
        def __init__(self, session_id: str, engine: Any, shared: list[tuple[Any, ...]],
                     where: str) -> None:
            super().__init__(session_id, engine=engine)
            if not shared:
                shared.append((self._metadata, self._sessions, self._messages,
                               self._session_factory))
            self._metadata, self._sessions, self._messages, self._session_factory = shared[0]
            self._where = where  # the URL, masked

        async def _answered(self, call: Any) -> Any:
            with anyio.move_on_after(PG_TIMEOUT):
                return await call
            raise TimeoutError(f"KIT_SESSION={self._where!r} did not answer within "
                               f"{PG_TIMEOUT:g} s")

        async def get_items(self, limit: int | None = None) -> list[Any]:
            return await self._answered(super().get_items(limit))

        async def add_items(self, items: list[Any]) -> None:
            await self._answered(super().add_items(items))

        async def pop_item(self) -> Any:
            return await self._answered(super().pop_item())

        async def clear_session(self) -> None:
            await self._answered(super().clear_session())

    return PgSession


def _made(session: Any, key: str) -> Any:
    """What ``session_factory(key)`` returned, if it can be a turn's session. The SDK runs a
    turn given ``session=None`` without one, so a factory that forgot its ``return`` had every
    turn forget the conversation, silently; an ``async def`` one failed each turn on its
    coroutine. Raises ``ConfigError`` saying what it returned (before the turn writes anything).
    """
    if all(callable(getattr(session, m, None)) for m in ("get_items", "add_items")):
        return session
    if inspect.iscoroutine(session):
        session.close()  # never awaited: no RuntimeWarning at its collection
        raise ConfigError(f"session_factory({key!r}) returned a coroutine: it must be a plain "
                          "function returning the session (an agents.memory.Session)")
    raise ConfigError(f"session_factory({key!r}) returned {type(session).__name__}, not a "
                      "session: it must return an agents.memory.Session (get_items, add_items)")


class _TurnSession:
    """A run's conversation as the run sees it: what the run adds waits here, and reaches the
    session (``flush``) only once the run records its end, just before that end is committed
    (the Runtime's write path). A run cut off before its end (its process killed, or reaped as
    abandoned while it stalled; its caller cancelled, its deck closed, its store down too long)
    leaves nothing of itself in the conversation: the next turn, on any replica, is sent no
    question nobody answered and no half turn. Reads and pops see the run's own items after the
    session's (the SDK reads the history, and pops what a retried call added). The items kept
    are the run's alone, which the SDK holds for the run anyway."""

    def __init__(self, session: Any) -> None:
        self.session, self._added = session, []
        self.session_settings = getattr(session, "session_settings", None)  # (a class default)

    def __getattr__(self, name: str) -> Any:  # session_id, ...
        if name == "session":
            raise AttributeError(name)
        return getattr(self.session, name)

    async def get_items(self, limit: int | None = None) -> list[Any]:
        added = _copied(self._added)
        if limit is not None and limit <= len(added):
            return added[len(added) - limit:]
        rest = None if limit is None else limit - len(added)
        return [*await self.session.get_items(rest), *added]

    async def add_items(self, items: list[Any]) -> None:
        self._added += _copied(items)

    async def pop_item(self) -> Any:
        return self._added.pop() if self._added else await self.session.pop_item()

    async def clear_session(self) -> None:
        self._added.clear()
        await self.session.clear_session()

    async def flush(self) -> None:
        """Write what the run added (engine side; raises what the session raises)."""
        items, self._added = self._added, []
        if items:
            await self.session.add_items(items)


@functools.cache
def _turn_conversation_class() -> type:
    """``_TurnSession`` for the SDK's ``OpenAIConversationsSession``, of its type: the SDK tells
    that one by its type (it strips the ids the Conversations API gave the items)."""
    from agents.memory import OpenAIConversationsSession

    class TurnConversation(_TurnSession, OpenAIConversationsSession):
        __init__ = _TurnSession.__init__
        session_id = property(lambda self: self.session.session_id)  # type: ignore[assignment]

    return TurnConversation


def _copied(value: Any) -> Any:
    """A deep copy of a turn's items, kept apart from the SDK's objects: the JSON shapes the SDK
    gives (dicts, lists, strings, numbers) copied directly, anything else by ``copy.deepcopy``
    (measured on a one-turn pair of items: 1.9 us against deepcopy's 5.8)."""
    kind = type(value)
    if kind is dict:
        return {k: _copied(v) for k, v in value.items()}
    if kind is list:
        return [_copied(v) for v in value]
    if kind in _SCALARS:
        return value
    return copy.deepcopy(value)


_SCALARS = (str, int, float, bool, type(None))


def _turn(session: Any) -> _TurnSession:
    from agents.memory import OpenAIConversationsSession
    if isinstance(session, OpenAIConversationsSession):
        return _turn_conversation_class()(session)  # type: ignore[no-any-return]
    return _TurnSession(session)


def _key(session_id: str, namespace: str | None) -> str:
    return session_id if namespace is None else f"{namespace}{NAMESPACE_SEP}{session_id}"


class OnEngine:
    """A session handed to a caller under trio: its coroutine methods run on the engine's
    asyncio loop, where the SDK's sessions and their connections live (the SDK's file session
    calls ``asyncio.to_thread``, which needs that loop); ``session`` is the SDK's object."""

    def __init__(self, session: Any, on_engine: Callable[..., Any]) -> None:
        self.session, self._on_engine = session, on_engine

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.session, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def on_engine(*args: Any, **kwargs: Any) -> Any:
            return await self._on_engine(functools.partial(attr, *args, **kwargs))
        return on_engine


class Sessions:
    """The conversation-memory sessions (``agents.memory.Session``) of a deck's agent runs.

    ``factory(key)`` when given; else, by ``url`` (``KIT_SESSION``), one of the SDK's own
    durable sessions: ``RedisSession`` (``redis://``, ``rediss://``, ``unix://``: replicas on
    several machines), ``SQLiteSession`` on a file (``sqlite:///path``: processes of one
    machine) or ``SQLAlchemySession`` on psycopg (``postgresql://...[?schema=name]``: replicas,
    beside a Postgres log); else ``MemorySession``s in the process's one in-memory database,
    which outlives the deck (lost when the process exits).
    One object per key (``<namespace>\x1f<session_id>``, or the session id). The SQLite file's
    sessions share one connection (``_FileSession``), the Postgres ones their table objects
    (``_pg_session_class``): a conversation costs a small object, not a connection or ~31 kB.

    At most ``max_sessions`` are kept (``KIT_SESSION_MAX``), least recently used dropped first:
    for the in-process default that *forgets the conversation* (its history is deleted; the log
    keeps every turn), the conversations of the process's earlier decks counted too; for the
    others only the cached object goes (the data stays where it lives). A conversation held by
    a live or parked run of the deck (``hold``, from the run's claim to its terminal end,
    ``release``) is never dropped: its run would play on without its history (a paused run's
    resume, a turn waiting for its tool). While every kept one is
    held the bound is exceeded; nothing else grows past it. A turn takes its session before
    its claim (``peek``), so one refused at the claim evicts nothing. Raises ``ConfigError``
    for another URL scheme (the URL masked), a missing extra, or a bound below 1; ``get``
    raises it for what the factory returned when that is no session (``_made``).
    """

    def __init__(self, url: str | None, factory: Callable[[str], Any] | None,
                 max_sessions: int = MAX_SESSIONS) -> None:
        if not isinstance(max_sessions, int) or max_sessions < 1:
            raise ConfigError(f"KIT_SESSION_MAX must be a positive integer, got {max_sessions!r}")
        self._factory, self._url, self.max_sessions = factory, url, max_sessions
        self._sessions: OrderedDict[str, Any] = OrderedDict()  # unheld, least recently used first
        self._held: dict[str, tuple[str, Any]] = {}  # key -> (run id, session): never evicted
        self._holders: dict[str, str] = {}  # run id -> the key it holds
        self._turns: dict[str, _TurnSession] = {}  # run id -> its view, until it plays (turn)
        self._claiming: dict[str, int] = {}  # key -> turns peeked, not held or refused yet
        self._redis: Any = None
        self._sqlite: str | None = None
        self._sqlite_conn: sqlite3.Connection | None = None  # every session of that file's
        self._postgres: tuple[str, str] | None = None
        self._engine: Any = None  # SQLAlchemy's, made on the engine side by open()
        self._pg_tables: list[tuple[Any, ...]] = []  # its sessions' shared table objects
        self.memory: _MemoryDB | None = None
        if not url:
            if factory is None:
                self.memory = _process_memory()
                for key in self.memory.keys():  # earlier decks' conversations: bounded too
                    self._sessions[key] = MemorySession(self.memory, key)
                self._evict()
        elif url.startswith(("redis://", "rediss://", "unix://")):
            try:
                import redis.asyncio
            except ImportError:
                raise ConfigError(f"KIT_SESSION={url.split('://')[0]}://... needs the redis extra: "
                                  "pip install 'kit[redis]'") from None
            try:
                self._redis = redis.asyncio.from_url(url, client_name="kit-session",
                                                     health_check_interval=REDIS_CHECK,
                                                     socket_timeout=REDIS_TIMEOUT,
                                                     socket_connect_timeout=REDIS_TIMEOUT)
            except ValueError as exc:  # a port that is not a number, an unknown option, ...
                raise ConfigError(f"KIT_SESSION={masked(url)!r} is not a Redis URL redis-py "
                                  f"can use: {exc}") from None
            # The URL's scheme picks the connection class (TCP, TLS, Unix socket), so it is
            # wrapped once the pool has it; no connection exists before the first command.
            pool = self._redis.connection_pool
            pool.connection_class = _pinged(pool.connection_class)
        elif url.startswith("sqlite:///") and len(url) > len("sqlite:///"):
            self._sqlite = url[len("sqlite:///"):]
        elif url.startswith(("postgresql://", "postgres://")):
            self._postgres = pg_url(url)
        else:
            raise ConfigError("KIT_SESSION must be a redis://, sqlite:///path or postgresql:// "
                              f"URL, got {masked(url)!r}")

    async def open(self) -> None:
        """Engine side: with ``sqlite:///path``, the file's connection (its directory made, as
        ``KIT_STORE``'s); with ``postgresql://``, the SQLAlchemy engine, and the SDK's tables in
        the URL's schema, created once even when replicas open together. Raises ``ConfigError``
        naming ``KIT_SESSION`` for a file that cannot be opened."""
        if self._sqlite is not None:  # the SDK's settings for its connections
            try:
                Path(self._sqlite).parent.mkdir(parents=True, exist_ok=True)
                self._sqlite_conn = sqlite3.connect(self._sqlite, check_same_thread=False)
                self._sqlite_conn.execute("PRAGMA journal_mode=WAL")
            except (OSError, sqlite3.Error) as exc:
                raise ConfigError(f"KIT_SESSION=sqlite:///{self._sqlite}: cannot open the file "
                                  f"({type(exc).__name__}: {exc})") from None
        if self._postgres is None:
            return
        try:
            from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
            from psycopg.conninfo import conninfo_to_dict
            from sqlalchemy.ext.asyncio import create_async_engine
        except ImportError:  # SQLAlchemy installed on its own does not make the extra
            raise ConfigError("KIT_SESSION=postgresql://... needs the postgres extra: "
                              "pip install 'kit[postgres]'") from None
        conninfo, schema = self._postgres
        # The URL's own ``options`` (``-c synchronous_commit=off``, say) with the schema's path:
        # connect_args would otherwise replace them.
        options = f"{conninfo_to_dict(conninfo).get('options', '')} -c search_path={schema}"
        pool = await open_pool(conninfo, schema, max_size=1)  # creates the schema
        try:
            async with setup_lock(pool, f"kit:sessions:{schema}"):
                self._engine = create_async_engine(
                    "postgresql+psycopg://" + conninfo.split("://", 1)[1],
                    # A pooled connection the server dropped while it sat idle (a restart, a
                    # failover, an idle timeout) is found dead when taken, and replaced with
                    # every older one, instead of failing the turn that takes it; the price is
                    # a ``SELECT 1`` round trip per checkout (about two a turn).
                    pool_pre_ping=True,
                    connect_args={"options": options.strip(),
                                  "application_name": f"kit-session:{schema}"[:63]})
                await SQLAlchemySession("kit:setup", engine=self._engine,
                                        create_tables=True).get_items(limit=1)
        finally:
            await pool.close()

    def get(self, session_id: str, namespace: str | None = None) -> Any:
        """The session of a conversation, kept (the least recently used unheld one dropped
        past the bound). Raises ``ConfigError`` for what the factory returned (``_made``)."""
        key = _key(session_id, namespace)
        session = self._kept(key)
        if session is None:
            session = self._sessions[key] = self._make(key)
            self._evict()
        return session

    def peek(self, session_id: str, namespace: str | None = None) -> Any:
        """``get`` for a turn whose claim is not written yet: a new session is made but not
        kept, so a turn refused at its claim (a busy session, a taken run id) evicts nothing,
        and a kept one is not evicted while the claim is written. ``hold`` (the claim written)
        or ``unpeek`` (refused) follows. Returns the turn's view of the session
        (``_TurnSession``: what the run adds waits for its end). Raises as ``get`` does."""
        key = _key(session_id, namespace)
        session = self._kept(key)
        if session is None:
            session = self._make(key)
        self._claiming[key] = self._claiming.get(key, 0) + 1
        return _turn(session)

    def unpeek(self, session_id: str, namespace: str | None = None) -> None:
        """The turn ``peek`` was for was refused at its claim, or never reached it."""
        self._unclaim(_key(session_id, namespace))
        self._evict()

    def hold(self, run_id: str, session_id: str, namespace: str | None,
             session: Any = None) -> Any:
        """The conversation's session (``session``, ``peek``'s, when given), held
        for run ``run_id``, whose claim is written, and never evicted until ``release``: a run
        waiting for its tool or parked still needs the conversation. A run id is only a name
        here. Raises as ``get`` does."""
        key = _key(session_id, namespace)
        if session is not None:
            self._unclaim(key)
        if isinstance(session, _TurnSession):  # the run's view: the Runtime takes it (``turn``)
            self._turns[run_id], session = session, session.session
        held = self._held.get(key)
        if held is not None:  # the claim just written says the run before it is over
            self._holders.pop(held[0], None)  # (resumed in another process: never seen ending)
            kept = held[1]
        else:
            kept = self._sessions.pop(key, None)
        if session is None:
            session = self._make(key) if kept is None else kept
        self._held[key] = (run_id, session)
        self._holders[run_id] = key
        self._evict()
        return session

    def release(self, run_id: str) -> None:
        """Run ``run_id`` ended (terminally, not parked): its conversation may be evicted again,
        the most recently used. Does nothing for a run that holds none."""
        self._turns.pop(run_id, None)
        key = self._holders.pop(run_id, None)
        if key is not None:
            self._sessions[key] = self._held.pop(key)[1]
            self._evict()

    def holding(self) -> list[str]:
        """The run ids that hold a conversation (``hold``), oldest first."""
        return list(self._holders)

    def turn(self, run_id: str) -> Any:
        """The view ``peek`` gave run ``run_id`` (held since): what the run adds to its
        conversation waits there until the run records its end (``_TurnSession.flush``).
        Taken once; None for a run that holds no conversation."""
        return self._turns.pop(run_id, None)

    def _unclaim(self, key: str) -> None:
        n = self._claiming.pop(key)
        if n > 1:
            self._claiming[key] = n - 1

    def _kept(self, key: str) -> Any:
        held = self._held.get(key)
        if held is not None:
            return held[1]
        session = self._sessions.get(key)
        if session is not None:
            self._sessions.move_to_end(key)
        return session

    def _make(self, key: str) -> Any:
        if self._factory is not None:
            return _made(self._factory(key), key)
        if self._redis is not None:
            from agents.extensions.memory.redis_session import RedisSession
            return RedisSession(key, redis_client=self._redis, key_prefix="kit:session")
        if self._sqlite_conn is not None:
            return _FileSession(key, self._sqlite, self._sqlite_conn)
        if self._engine is not None:
            return _pg_session_class()(key, self._engine, self._pg_tables,
                                       masked(self._url))  # type: ignore[arg-type]
        return MemorySession(self.memory, key)  # type: ignore[arg-type]

    def _evict(self) -> None:
        """Drop the least recently used unheld sessions past the bound (forgetting an
        in-process one's history); held ones, and those a turn's claim is being written for,
        may keep it exceeded. Those are few and were used last: the scan skips few."""
        while len(self._sessions) + len(self._held) > self.max_sessions:
            key = next((k for k in self._sessions if k not in self._claiming), None)
            if key is None:
                return
            dropped = self._sessions.pop(key)
            if isinstance(dropped, MemorySession):
                dropped.forget()

    def __len__(self) -> int:
        return len(self._sessions) + len(self._held)

    async def aclose(self) -> None:
        """Engine side: close the Redis client or the SQLAlchemy engine (their connections
        belong to the engine's loop). The in-process conversations stay, for the process's
        next deck."""
        if self._redis is not None:
            await self._redis.aclose()
        if self._engine is not None:
            await self._engine.dispose()
        if self._sqlite_conn is not None:
            self._sqlite_conn.close()
