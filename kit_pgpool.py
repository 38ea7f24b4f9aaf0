"""kit_pgpool: the Postgres plumbing every Postgres user of kit shares (DESIGN 4.4, 12).

Owns: ``pg_url`` (a kit ``postgresql://`` URL split into libpq's URL and kit's schema),
``open_pool`` (a named pool of autocommit connections on one schema, its connects bounded, its
connections tested when taken if asked), ``setup_lock`` (an advisory lock so replicas starting
at once create their tables one after the other) and ``build_concurrently`` (a caller's indexes
built CONCURRENTLY by one replica, on a connection of its own, each of its waits bounded by
``BUILD_WAIT``). Its users: the log (``kit_pg``), the checkpointer (``kit_threads``) and the
Postgres sessions (``kit_sessions``).

Must never: import psycopg at import (``import kit`` stays light; the ``postgres`` extra is
optional), put a password in an error or a log line (``kit_storebase.masked``), create a table
or an index of its own (its callers do, under ``setup_lock``, or pass their indexes to
``build_concurrently``), or touch trio: its coroutines run on asyncio (psycopg's
async API is asyncio-only; under trio its callers cross to a ``kit_bridge.Bridge``).
"""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import anyio

from kit_core import ConfigError
from kit_storebase import masked

__all__ = ("pg_url", "open_pool", "setup_lock", "unreachable", "DEFAULT_SCHEMA", "POOL_MAX", "POOL_TIMEOUT",
           "CONNECT_TIMEOUT", "CHECK_TIMEOUT", "SETUP_WAIT", "build_concurrently", "BUILD_WAIT")

#: The schema a ``postgresql://`` URL without ``?schema=`` uses.
DEFAULT_SCHEMA = "kit"
#: Connections per pool unless its opener says (the log's readers: three replicas of kit-serve
#: with their checkpointers stay far below Postgres's default ``max_connections`` of 100).
POOL_MAX = 8
#: How long a call waits for a pooled connection (seconds): past it, the database is down for
#: this call (the log's writer retries its batch; a reader gets the error).
POOL_TIMEOUT = 10.0
#: How long opening one connection may take (seconds; libpq's ``connect_timeout``, whole
#: seconds, at least 2) unless the URL's ``connect_timeout`` or ``PGCONNECT_TIMEOUT`` says: past
#: psycopg's own 130 s, a server that accepts and never answers would hold a command or a
#: starting replica that long.
CONNECT_TIMEOUT = 5
#: How long a pooled connection's check when taken (``open_pool(check=True)``: an empty query)
#: may go unanswered (seconds): past it the connection has gone silent (a NAT or a firewall
#: that forgot it, a frozen peer; TCP gives up after ~15 min), psycopg closes it and the pool
#: tries the next, as for one the server dropped.
CHECK_TIMEOUT = 10.0
#: How long an open waits for a setup lock another open holds (seconds) before it fails: another
#: replica creating or upgrading the tables holds it well under a second (the log's slow index
#: builds run after its release: ``kit_pg``), so a wait this long is a stuck opener.
SETUP_WAIT = 60.0
#: How long an index build (``build_concurrently``) waits for any one lock (seconds; its
#: session's ``lock_timeout``). CREATE INDEX CONCURRENTLY waits, with no bound of its own, for
#: every transaction writing the table, then for every transaction of the database that holds
#: a snapshot older than its own (another program's session left idle in a transaction, say:
#: the build would wait for as long as it stays open). Both are waits on each such
#: transaction's lock (its virtual xid), so this bounds each: past it the build fails, leaving
#: its index invalid, for the next build to drop and build again. kit's own transactions last
#: well under a second (a long replay's read: under ``kit_pg.READ_TIMEOUT``).
BUILD_WAIT = 60.0
#: A setup lock held by another is tried again every _LOCK_RETRY s, up to ``SETUP_WAIT``.
_LOCK_RETRY = 0.05
#: The most of libpq's reason an ``unreachable`` error quotes (one line; its own is a few lines).
_REASON_CHARS = 500
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,58}\Z")


def pg_url(url: str) -> tuple[str, str]:
    """Split a kit ``postgresql://`` URL into ``(libpq URL, schema)``: kit's own ``schema``
    query parameter (default ``DEFAULT_SCHEMA``) is removed, the rest goes to libpq as is.
    Raises ``ConfigError`` (the URL masked) for a URL ``urlsplit`` refuses (an unclosed ``[``),
    another scheme, user info that is ambiguous (an unencoded ``/``, ``?``, ``#`` or ``@`` in the
    password: ``urlsplit``, libpq and ``masked`` would each cut it elsewhere, and libpq's errors
    would show a piece of it as the host), or a schema name that is not lower-case letters,
    digits and ``_`` (at most 59: it also names the NOTIFY channel)."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL"
        raise ConfigError(f"{masked(url)!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("postgresql", "postgres"):
        raise ConfigError(f"not a postgresql:// URL: {masked(url)!r}")
    userinfo = url.partition("://")[2].rpartition("@")[0]
    if userinfo != parts.netloc.rpartition("@")[0] or "@" in userinfo:
        raise ConfigError(f"ambiguous user info in {masked(url)!r}: percent-encode the "
                          "password's '/', '?', '#' and '@' (%2F, %3F, %23, %40), and any '@' "
                          "after the host (%40)")
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = next((v for k, v in query if k == "schema"), DEFAULT_SCHEMA)
    if not _SCHEMA_NAME.match(schema):
        raise ConfigError(f"schema must be 1-59 lower-case letters, digits or '_', starting with a "
                          f"letter or '_', got {schema!r} in {masked(url)!r}")
    rest = urlencode([(k, v) for k, v in query if k != "schema"], quote_via=quote)  # libpq: %20
    return urlunsplit(parts._replace(query=rest)), schema


def psycopg_module() -> Any:
    """psycopg, imported now; ``ConfigError`` without the postgres extra."""
    try:
        import psycopg
        import psycopg_pool
    except ImportError:
        raise ConfigError("a postgresql:// URL needs the postgres extra: "
                          "pip install 'kit[postgres]'") from None
    del psycopg_pool  # (checked here, used by open_pool)
    return psycopg


def bounded(conninfo: str) -> dict[str, Any]:
    """The connection arguments that bound a connect to ``CONNECT_TIMEOUT`` seconds, or none
    when ``conninfo`` (or libpq's ``PGCONNECT_TIMEOUT``) sets its own bound."""
    from psycopg.conninfo import conninfo_to_dict
    if "connect_timeout" in conninfo_to_dict(conninfo) or os.environ.get("PGCONNECT_TIMEOUT"):
        return {}
    return {"connect_timeout": CONNECT_TIMEOUT}


async def open_pool(conninfo: str, schema: str, *, max_size: int = POOL_MAX, create: bool = True,
                    name: str = "kit", check: bool = False, setting: str | None = None,
                    **kwargs: Any) -> Any:
    """On asyncio: an open ``psycopg_pool.AsyncConnectionPool`` of autocommit connections whose
    ``search_path`` is ``schema`` (created if missing, unless ``create`` is false), named
    ``<name>:<schema>`` in ``pg_stat_activity`` (the log's pools are ``kit:<schema>`` and
    ``kit-write:<schema>``, the listener ``kit-listen:<schema>``).
    ``kwargs`` go to each connection; a connect is bounded (``CONNECT_TIMEOUT``) unless
    ``conninfo`` sets a bound. With ``check``, a connection is tested when taken (a round trip
    each time): one the server dropped while it sat idle (a restart, a failover, an idle timeout)
    is replaced, with every other dead one, instead of failing its caller (one whose check
    goes unanswered for ``CHECK_TIMEOUT``, silent, is replaced too). For callers with no
    retry of their own; the log's reads and writes retry instead, so they pay nothing until a
    connection fails.
    Raises ``ConfigError`` without the postgres extra, and when the server cannot be reached or
    refuses the connection (``unreachable``: named by ``setting``, where the URL came from, its
    host, port and database, never its password)."""
    psycopg = psycopg_module()
    from psycopg import sql
    from psycopg_pool import AsyncConnectionPool
    path = sql.SQL("SET search_path TO {}").format(sql.Identifier(schema))
    bound = bounded(conninfo)

    async def configure(conn: Any) -> None:
        await conn.execute(path)

    try:
        first = await psycopg.AsyncConnection.connect(conninfo, autocommit=True, **bound)
    except psycopg.OperationalError as exc:  # refused, timed out, no such database or role
        raise unreachable(conninfo, exc, setting) from None
    async with first as conn:
        if create:
            async with conn.transaction():  # locked: concurrent CREATE SCHEMA IF NOT EXISTS collide
                await _try_lock(conn, f"kit:schema:{schema}", "xact_")
                await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                    sql.Identifier(schema)))

    async def checked(conn: Any) -> None:
        try:
            with anyio.move_on_after(CHECK_TIMEOUT):
                return await AsyncConnectionPool.check_connection(conn)  # an empty query
            raise TimeoutError(f"a pooled connection did not answer its check in {CHECK_TIMEOUT:g} s")
        except psycopg.OperationalError:
            # After a restart every idle connection is dead, and the pool tries the next one
            # at once, then only after 1 s, 2 s, 4 s (measured: two dead held a step 1 s; four
            # would hold it about 7 s). Dropped all now, its next try is a new connection.
            await pool.check()
            raise

    pool = AsyncConnectionPool(conninfo, min_size=1, max_size=max_size, open=False,
                               configure=configure, timeout=POOL_TIMEOUT,
                               check=checked if check else None,
                               kwargs={"autocommit": True, **bound, **kwargs,
                                       "application_name": f"{name}:{schema}"[:63]})
    await pool.open(wait=True, timeout=POOL_TIMEOUT)
    return pool


def unreachable(conninfo: str, exc: BaseException, setting: str | None = None) -> ConfigError:
    """The error for a Postgres server that ``conninfo`` names and a connect could not use
    (``exc``, psycopg's): ``setting`` (where the URL came from: ``KIT_STORE``, ``--store``), the
    server's host, port and database, the URL masked and libpq's reason on one line, the
    password in none of them. Raised ``from None``: psycopg's own error, printed below it by
    default, would repeat the reason on several lines."""
    from psycopg.conninfo import conninfo_to_dict
    try:
        parts = conninfo_to_dict(conninfo)
    except Exception:  # (pg_url has read it already; never fail the explanation)
        parts = {}
    host = parts.get("host") or os.environ.get("PGHOST") or "localhost"
    port = parts.get("port") or os.environ.get("PGPORT") or "5432"
    database = parts.get("dbname") or os.environ.get("PGDATABASE") or parts.get("user") or "?"
    reason = " ".join(str(exc).split())[:_REASON_CHARS]
    if password := parts.get("password"):
        reason = reason.replace(str(password), "***")
    return ConfigError(f"{setting + ': ' if setting else ''}cannot connect to the Postgres "
                       f"server at {host}:{port}, database {database!r} ({masked(conninfo)!r}): "
                       f"{reason}; check that the server runs there and the database exists")


async def _try_lock(conn: Any, what: str, xact: str = "") -> None:
    """Take advisory lock ``what`` (``xact="xact_"``: until the transaction ends) on ``conn``,
    trying again every ``_LOCK_RETRY`` s for up to ``SETUP_WAIT`` s, then ``TimeoutError``
    saying another open holds it and that ``SETUP_WAIT`` bounds the wait.

    Tried, never waited for: a statement blocked on a lock holds a snapshot, and langgraph's
    setup builds an index CONCURRENTLY, which waits for every such snapshot: the holder would
    wait for the waiter (seen with three replicas starting at once)."""
    from psycopg.rows import tuple_row
    cur = conn.cursor(row_factory=tuple_row)  # whatever rows the pool's connections make
    wait = SETUP_WAIT
    for _ in range(max(1, int(wait / _LOCK_RETRY))):
        await cur.execute(f"SELECT pg_try_advisory_{xact}lock(hashtextextended(%s, 0))", (what,))
        if (await cur.fetchone())[0]:
            return
        await anyio.sleep(_LOCK_RETRY)
    raise TimeoutError(f"the setup lock {what!r} is held by another open (another replica or "
                       f"process setting up this schema's tables) for longer than this open "
                       f"waits, kit_pgpool.SETUP_WAIT = {wait:g} s; retry once it is done, or "
                       "look for a stuck opener in pg_stat_activity")


@contextlib.asynccontextmanager
async def setup_lock(pool: Any, what: str) -> AsyncIterator[Any]:
    """``async with setup_lock(pool, what) as conn:`` (on asyncio): hold a Postgres advisory
    lock named ``what`` on a connection of ``pool``, so replicas starting at once create their
    tables one after the other (``CREATE ... IF NOT EXISTS`` is not safe against a concurrent
    twin). The lock is the session's: a process that dies frees it at once (CONVENTIONS A5)."""
    async with pool.connection() as conn:
        await _try_lock(conn, what)
        try:
            yield conn
        finally:
            await conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (what,))


async def build_concurrently(conninfo: str, schema: str, indexes: Sequence[tuple[str, str]]
                             ) -> list[tuple[str, Exception]] | None:
    """On asyncio: build each index ``(name, statement)`` of ``indexes`` (a ``CREATE INDEX``
    statement, run CONCURRENTLY: the table's writers go on) in ``schema``, unless another holds
    the schema's build lock (``kit:build:<schema>``: another replica builds them now), which it
    only tries: then it returns None at once. An invalid index of that name (a build cut short:
    a killed replica, a cancel, a wait past ``BUILD_WAIT``) is dropped and built again; a valid
    one is left. Every lock the build waits for is waited for ``BUILD_WAIT`` at most (its
    ``lock_timeout``). It runs on a connection of its own (``kit-build:<schema>`` in
    ``pg_stat_activity``), closed after, with the lock and the setting: no pooled connection
    keeps either. Returns the indexes that failed, each with psycopg's error
    (``LockNotAvailable`` past ``BUILD_WAIT``); raises ``psycopg.OperationalError`` when its
    connection cannot be opened or dies (the lock goes with it)."""
    psycopg = psycopg_module()
    from psycopg import sql
    failed: list[tuple[str, Exception]] = []
    async with await psycopg.AsyncConnection.connect(
            conninfo, autocommit=True, **bounded(conninfo),  # (CONCURRENTLY: in no transaction)
            application_name=f"kit-build:{schema}"[:63]) as conn:
        await conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        await conn.execute(f"SET lock_timeout = {max(1, round(BUILD_WAIT * 1000))}")  # (ms)
        if not (await (await conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))",
                                          (f"kit:build:{schema}",))).fetchone())[0]:
            return None
        for name, statement in indexes:
            try:
                row = await (await conn.execute(
                    "SELECT i.indisvalid FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid "
                    "WHERE c.relname = %s AND c.relnamespace = %s::regnamespace",
                    (name, schema))).fetchone()
                if row is not None and row[0]:
                    continue
                if row is not None:  # invalid: cut short (no other builds: the lock is ours)
                    await conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(
                        sql.Identifier(name)))
                await conn.execute(statement.replace("CREATE INDEX", "CREATE INDEX CONCURRENTLY"))
            except psycopg.Error as exc:
                if conn.closed:  # dead: so is every build after it
                    raise
                failed.append((name, exc))
    return failed
