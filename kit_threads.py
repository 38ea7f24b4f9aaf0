"""kit_threads: workflow threads: the checkpoint savers they live in and the locks on them.

Owns: the checkpointers a deck's workflows are compiled with (``open_graphs``: durable workflows
on a SQLite file beside the log, ``checkpoint_path``, or in the Postgres schema of the log, the
others in memory, ``memory_saver``, where deleting a thread costs only its own entries), the fence
that holds a durable checkpoint write until the playing run's log holds what came before it
(``PLAYING``), the serializer every saver stores with (``checkpoint_serde``) and the user's
classes it rebuilds (``allow_types``: those a workflow's graph names, ``allow_named``, and those
an input or an answer holds, ``classes_in``), whether a checkpointer has a thread
(``holds_thread``, ``thread_config``) and the locks that keep two tickers off one thread
(``ThreadLocks``, ``PgThreadLocks``).

Must never: play a graph or read what its checkpoints mean (interrupts, sleeps: kit_workflows,
above, does), reach the event store or the Runtime, import a sibling but kit_core (its values),
kit_context (a node's own function) and kit_pgpool (its pool plumbing), or import LangGraph,
aiosqlite or psycopg at import (``import kit`` stays light).

Theory of operation
-------------------
A workflow's thread is a checkpointer's thread keyed ``<workflow>:<namespace>:<thread id>``
(``WorkflowEngine.key``). Durable workflows share one persistent saver per deck; every other
workflow has its own in-memory saver, where an ended run deletes its thread. A durable saver's
writes are fenced: ``WorkflowEngine.play`` sets ``PLAYING`` to its run while the graph plays
(LangGraph's tasks inherit it), and each ``aput``/``aput_writes`` first awaits that run's
``synced``, so a run another process reaped while this one stalled past its lease writes
nothing onto a thread a later run has taken since. A ticker resumes a thread that only the
checkpointer knows (no parked run in the log to fence it) under the thread's lock: this
process's set of keys, and with a Postgres log a session advisory lock that a replica that dies
frees with its connection, one of a pool of its own (``kit-locks:<schema>``), so locks never
take the connections their runs' checkpoints need. The Postgres checkpointer's pool
(``kit-checkpoints:<schema>`` in ``pg_stat_activity``) tests each connection when taken, so a
durable step after the server dropped them (a restart, a failover) reconnects instead of failing
its run; a checkpoint call or a lock's statement unanswered for ``CHECKPOINT_TIMEOUT`` (a
connection gone silent) is tried once more on another, as the log's reads are (``_bound``).
"""
from __future__ import annotations

import contextvars
import dataclasses
import enum
import functools
import logging
import os
import sys
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import anyio

from kit_context import node_function
from kit_core import InvocableSpec, RunHandle
from kit_pgpool import open_pool, pg_url, setup_lock

__all__ = ("open_graphs", "checkpoint_path", "memory_saver", "checkpoint_serde", "allow_types",
           "allow_named", "classes_in",
           "PLAYING", "thread_config", "holds_thread", "ThreadLocks", "PgThreadLocks",
           "CHECKPOINT_POOL", "LOCK_POOL", "CHECKPOINT_TIMEOUT")

#: Connections of the Postgres checkpointer's pool (per process): durable runs playing at once
#: share them.
CHECKPOINT_POOL = 4
#: Connections of the pool holding tickers' thread locks (per process): a ticker holds one per
#: thread it is resuming, while the thread's run plays. A pool apart from the checkpointer's:
#: in that one, four ticks at once held every connection, and their runs' checkpoints waited
#: for one until they failed. More resumes at once than this wait for a lock's connection.
LOCK_POOL = 8
#: How long a Postgres checkpoint call (its connection's check, its query) or a thread lock's
#: statement may go unanswered (seconds), as the log's reads (``kit_pg.READ_TIMEOUT``): past
#: it the connection has gone silent (a NAT or a firewall that forgot it, a frozen peer;
#: TCP gives up after ~15 min), psycopg closes it, and a checkpoint call is tried once more
#: on another (its queries are upserts, deletes and reads: safe twice). The saver takes its
#: calls one at a time, so a silent one held every durable run of the process.
CHECKPOINT_TIMEOUT = 60.0


# ================================================================================== savers ====

#: The classes besides LangGraph's own safe ones that a checkpoint rebuilds without a word, as
#: ``(module, name)``: the user's own, named by a workflow or handed to one (``allow_types``).
_USER_TYPES: set[tuple[str, ...]] = set()
_WARNED: set[tuple[str, str]] = set()  # the other classes met, each warned of once (at most 1000)
_log = logging.getLogger("kit.workflows")


def allow_types(classes: Iterable[type | tuple[str, ...]]) -> None:
    """Let checkpoints rebuild ``classes`` (the user's dataclasses, pydantic models, enums; or
    their ``(module, name)``) as LangGraph's allow-list (``allowed_msgpack_modules``) does: no
    warning, and not refused when LangGraph refuses every class it is not told of
    (``LANGGRAPH_STRICT_MSGPACK=true``, and its default to come). Named by the code only: no
    name read from a checkpoint is let in for being there."""
    _USER_TYPES.update(c if isinstance(c, tuple) else (c.__module__, c.__name__) for c in classes)


class _Allowed(set):  # type: ignore[type-arg]
    """The allow-list ``checkpoint_serde`` rebuilds by: ``_USER_TYPES``, else LangGraph's own
    rule for a class it was not told of, which it applies only to an allow-list of ``True``:
    rebuilt with a warning (and its serde event), or refused under its strict mode."""

    def __contains__(self, key: object) -> bool:
        if key in _USER_TYPES:
            return True
        from langgraph.checkpoint.serde import _msgpack
        from langgraph.checkpoint.serde.event_hooks import emit_serde_event
        if _msgpack.STRICT_MSGPACK_ENABLED or not isinstance(key, tuple) or len(key) != 2:
            return False  # LangGraph says it refused it
        emit_serde_event({"kind": "msgpack_unregistered_allowed", "module": key[0],
                          "name": key[1]})
        if key not in _WARNED and len(_WARNED) < 1000:
            _WARNED.add(key)
            _log.warning("a workflow checkpoint holds a %s.%s, a class no workflow names nor any "
                         "answer was: LangGraph rebuilds it now, and will refuse to "
                         "(LANGGRAPH_STRICT_MSGPACK=true refuses now); name it in the module of "
                         "a node that uses it, or in the state schema", *key)
        return True


_NAMED: weakref.WeakSet[Any] = weakref.WeakSet()  # the graphs whose classes are allowed


def _stored_by_name(cls: Any) -> bool:
    """Whether LangGraph's checkpoints store instances of ``cls`` by its module and name, to
    rebuild them from (a dataclass, a pydantic model, an enum, a named tuple), and can."""
    return (isinstance(cls, type) and getattr(sys.modules.get(cls.__module__), cls.__name__,
                                              None) is cls
            and (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)
                 or callable(getattr(cls, "model_dump", None))  # pydantic, as LangGraph tells it
                 or callable(getattr(cls, "dict", None)) and hasattr(cls, "__fields__")
                 or issubclass(cls, tuple) and hasattr(cls, "_asdict")))


def allow_named(graph: Any) -> None:
    """Let checkpoints rebuild the classes ``StateGraph`` ``graph`` names (once a graph)."""
    if graph not in _NAMED:
        _NAMED.add(graph)
        allow_types(_named_classes(graph, set()))


def _named_classes(graph: Any, seen: set[int]) -> set[Any]:
    """The user's own classes a checkpoint of ``graph`` may hold (``allow_types``):
    what LangGraph's strict mode allows it (the classes its schemas and channels name), and the
    classes stored by name (``_stored_by_name``) that the modules of its nodes and schemas name,
    so a process that was never handed one (it restarted) rebuilds a thread's; a compiled
    subgraph's too."""
    from langgraph._internal._serde import collect_allowlist_from_schemas
    from langgraph.graph.state import CompiledStateGraph
    if id(graph) in seen:
        return set()
    seen.add(id(graph))
    schemas = [graph.state_schema, graph.input_schema, graph.output_schema,
               *(node.input_schema for node in graph.nodes.values())]
    try:  # (it reads type hints: one that cannot be read names nothing, and fails no build)
        out: set[Any] = set(collect_allowlist_from_schemas(schemas=[s for s in schemas if s],
                                                           channels=graph.channels))
    except Exception:
        out = set()
    modules = {getattr(s, "__module__", None) for s in schemas}
    for node in graph.nodes.values():
        if isinstance(sub := node.runnable, CompiledStateGraph):
            out |= _named_classes(sub.builder, seen)
        modules.add(getattr(node_function(node), "__module__", None))
    for module in filter(None, map(sys.modules.get, filter(None, modules))):
        out.update(v for v in list(vars(module).values()) if _stored_by_name(v))
    return out


_PLAIN = {str, bytes, int, float, bool, type(None)}


def classes_in(value: Any) -> set[type]:
    """The classes stored by name (``_stored_by_name``) of the objects ``value`` holds, at any
    depth (in containers, and in one another's fields)."""
    out: set[type] = set()
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if type(v) in _PLAIN or id(v) in seen:
            continue
        seen.add(id(v))
        if _stored_by_name(type(v)):  # (an IntEnum's member is an int too)
            out.add(type(v))
            if dataclasses.is_dataclass(v):
                stack += [getattr(v, f.name, None) for f in dataclasses.fields(v)]
            elif not isinstance(v, enum.Enum):  # a named tuple's items, a pydantic model's fields
                stack += v if isinstance(v, tuple) else list(getattr(v, "__dict__", {}).values())
        elif isinstance(v, Mapping):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack += v
    return out


@functools.cache
def checkpoint_serde() -> Any:
    """The serializer every checkpointer ``open_graphs`` makes stores with: LangGraph's own,
    whose allow-list of the classes it rebuilds holds the user's (``allow_types``). Made on
    first use: kit imports LangGraph late."""
    from langgraph.checkpoint.serde import jsonplus
    hook = getattr(jsonplus, "_create_msgpack_ext_hook", None)
    if hook is None:  # a LangGraph without it: its own allow-list, and its warnings
        return jsonplus.JsonPlusSerializer()
    return jsonplus.JsonPlusSerializer(__unpack_ext_hook__=hook(_Allowed()))


#: The run whose graph plays here (set by ``WorkflowEngine.play``; LangGraph's tasks inherit it):
#: a durable checkpoint write waits until its log holds what came before (``_fence``).
PLAYING: contextvars.ContextVar[RunHandle | None] = contextvars.ContextVar("kit_playing",
                                                                           default=None)


def _fence(saver: Any) -> None:
    """A durable saver's writes wait on the playing run's ``synced``: a run another process
    reaped while this one stalled past its lease writes no checkpoint onto the thread that a
    later run, on any replica, has taken since (its log refuses it; so is the write)."""
    for name in ("aput", "aput_writes"):
        async def fenced(*args: Any, _write: Any = getattr(saver, name), **kw: Any) -> Any:
            if (run := PLAYING.get()) is not None:
                await run.synced()
            return await _write(*args, **kw)
        setattr(saver, name, fenced)


def _bound(saver: Any) -> None:
    """A Postgres saver's calls answer within ``CHECKPOINT_TIMEOUT``, or are tried once more
    (on another connection: psycopg closed the silent one); then ``TimeoutError``."""
    for name in ("aget_tuple", "aput", "aput_writes", "adelete_thread"):
        async def bounded(*args: Any, _call: Any = getattr(saver, name), _name: str = name,
                          **kw: Any) -> Any:
            for _ in range(2):
                with anyio.move_on_after(CHECKPOINT_TIMEOUT):
                    return await _call(*args, **kw)
            raise TimeoutError(f"the checkpointer's Postgres did not answer {_name} within "
                               f"{CHECKPOINT_TIMEOUT:g} s, twice")
        setattr(saver, name, bounded)


def checkpoint_path(store_path: str) -> str:
    """The durable workflows' checkpoint file for a log file: ``kit.db`` -> ``kit.checkpoints.db``.

    Not the log's own file: under asyncio the log commits inline on the loop thread, and the
    checkpointer (aiosqlite) keeps a transaction open across an ``await`` until its commit,
    which needs that loop; a log commit waiting for that lock would stall the loop for the
    whole busy timeout and fail with "database is locked" (seen in bench_kit.py).
    """
    root, ext = os.path.splitext(store_path)
    return f"{root}.checkpoints{ext or '.db'}"


async def open_graphs(specs: Sequence[InvocableSpec], store_url: str | None
                      ) -> tuple[dict[str, Any], Callable[[], Awaitable[None]] | None, ThreadLocks]:
    """Engine side: each workflow compiled with its checkpointer, how to close them, and the
    locks that keep two tickers off one thread.

    Durable workflows share one persistent saver where the log is: an ``AsyncSqliteSaver`` on
    ``checkpoint_path`` beside a ``sqlite:///`` log (``synchronous=NORMAL`` like the log), an
    ``AsyncPostgresSaver`` in the schema of a ``postgresql://`` log (its tables created once when
    replicas open together); with any other store, and for the others, each has an in-memory
    saver. Returns ``(graphs by name, close, locks)`` where ``close`` (engine side) closes the
    file or the pools (the checkpointer's and the locks'), or is None when there is none.
    """
    durable, close, locks = None, None, ThreadLocks()
    if store_url and any(s.kind == "workflow" and s.engine.durable for s in specs):
        if store_url.startswith("sqlite:///"):
            import aiosqlite
            from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
            db = await aiosqlite.connect(checkpoint_path(store_url[len("sqlite:///"):]))
            await db.execute("PRAGMA busy_timeout=5000")
            await db.execute("PRAGMA synchronous=NORMAL")
            durable, close = AsyncSqliteSaver(db, serde=checkpoint_serde()), db.close
            await durable.setup()
        elif store_url.startswith(("postgresql://", "postgres://")):
            from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
            from psycopg.rows import dict_row
            conninfo, schema = pg_url(store_url)
            # The saver's own connection settings (AsyncPostgresSaver.from_conn_string's).
            # Checked when taken: the saver has no retry, so a connection the server dropped
            # while idle would fail the durable step that took it (an answered run FAILED, its
            # question gone). The price is an empty query's round trip per checkout, two or
            # three a superstep (measured: 8 for a run of two nodes up to its interrupt).
            pool = await open_pool(conninfo, schema, max_size=CHECKPOINT_POOL,
                                   name="kit-checkpoints", check=True, prepare_threshold=0,
                                   row_factory=dict_row)
            pools = [pool]
            try:
                pools.append(await open_pool(conninfo, schema, max_size=LOCK_POOL, create=False,
                                             name="kit-locks", check=True, row_factory=dict_row))
                durable, locks = AsyncPostgresSaver(pool, serde=checkpoint_serde()), PgThreadLocks(pools[1])
                _bound(durable)  # (under the fence: a write waits for its log unbounded)
                async with setup_lock(pool, f"kit:checkpoints:{schema}"):
                    await durable.setup()
            except BaseException:
                for each in pools:
                    await each.close()
                raise

            async def close_pools() -> None:
                try:
                    await pools[1].close()
                finally:
                    await pool.close()
            close = close_pools
    if durable is not None:
        _fence(durable)
    graphs = {}
    for spec in specs:
        if spec.kind == "workflow":
            saver = durable if spec.engine.durable and durable is not None else memory_saver()
            graphs[spec.name] = spec.engine.graph.compile(checkpointer=saver)
    return graphs, close, locks


def memory_saver() -> Any:
    """An in-memory checkpointer whose ``delete_thread`` costs the thread's own entries."""
    return _run_saver_class()(serde=checkpoint_serde())


@functools.cache
def _run_saver_class() -> type:
    """``memory_saver``'s class (made once, on first use: LangGraph's checkpointer module
    takes about a second to import).

    LangGraph's ``InMemorySaver.delete_thread`` scans the writes and blobs of every thread it
    holds: with every ended run deleting its thread (``WorkflowEngine.play``), that would make
    each run's end cost O(threads parked in the process). This one remembers which entries each
    thread wrote (``put``/``put_writes``; the async methods call these, and ``adelete_thread``
    calls ``delete_thread``) and deletes those.
    """
    from langgraph.checkpoint.memory import InMemorySaver

    class RunSaver(InMemorySaver):
        def __init__(self, serde: Any = None) -> None:
            super().__init__(serde=serde)
            self._entries: dict[str, set[tuple[Any, ...]]] = {}  # thread -> its blob/write keys

        def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
            conf = config["configurable"]
            thread, ns = conf["thread_id"], conf["checkpoint_ns"]
            self._entries.setdefault(thread, set()).update(
                (thread, ns, channel, version) for channel, version in new_versions.items())
            return super().put(config, checkpoint, metadata, new_versions)

        def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
            conf = config["configurable"]
            thread = conf["thread_id"]
            self._entries.setdefault(thread, set()).add(
                (thread, conf.get("checkpoint_ns", ""), conf["checkpoint_id"]))
            super().put_writes(config, writes, task_id, task_path)

        def delete_thread(self, thread_id: str) -> None:
            self.storage.pop(thread_id, None)
            for key in self._entries.pop(thread_id, ()):
                self.blobs.pop(key, None)  # a 4-tuple is a blob's key, a 3-tuple a write's
                self.writes.pop(key, None)

    return RunSaver


# =================================================================================== threads ====

def thread_config(key: str) -> dict[str, Any]:
    """The LangGraph config that names checkpoint thread ``key``."""
    return {"configurable": {"thread_id": key}}


async def holds_thread(graph: Any, key: str) -> bool:
    """Engine side: whether ``graph``'s checkpointer has thread ``key`` (a parked run's thread
    lives in the memory of the process that parked it when its workflow is not durable)."""
    return await graph.checkpointer.aget_tuple(thread_config(key)) is not None


class ThreadLocks:
    """Engine side: which checkpoint threads a ticker of this process is resuming, so a thread
    that only the checkpointer knows (no parked run in the log to fence it) is resumed once.

    ``acquire(key)`` is False when another ticker holds ``key``. Here the holders are this
    process's; ``PgThreadLocks`` makes them every replica's.
    """

    def __init__(self) -> None:
        self._held: set[str] = set()

    async def acquire(self, key: str) -> bool:
        if key in self._held:
            return False
        self._held.add(key)
        return True

    async def release(self, key: str) -> None:
        self._held.discard(key)


class PgThreadLocks(ThreadLocks):
    """``ThreadLocks`` as Postgres session advisory locks, on a pooled connection held while
    locked: two replicas ticking at once resume a thread once, and a replica that dies mid-way
    frees its locks with its connections (notes/CONVENTIONS.md A5)."""

    def __init__(self, pool: Any) -> None:
        super().__init__()
        self._pool, self._conns = pool, {}

    async def acquire(self, key: str) -> bool:
        """Raises ``TimeoutError`` when two connections in a row leave the lock unanswered
        for ``CHECKPOINT_TIMEOUT`` (psycopg closes each: a lock it took goes with it)."""
        if not await super().acquire(key):
            return False
        row = None
        for _ in range(2):  # a silent connection: once more, on another
            conn = await self._pool.getconn()
            try:
                with anyio.move_on_after(CHECKPOINT_TIMEOUT):
                    row = await (await conn.execute(
                        "SELECT pg_try_advisory_lock(hashtextextended(%s, 0)) AS got",
                        (f"kit:thread:{key}",))).fetchone()
            except BaseException:
                await self._pool.putconn(conn)
                await super().release(key)
                raise
            if row is not None:
                break
            await self._pool.putconn(conn)
        else:
            await super().release(key)
            raise TimeoutError(f"the thread lock's Postgres did not answer within "
                               f"{CHECKPOINT_TIMEOUT:g} s, twice")
        if not row["got"]:
            await self._pool.putconn(conn)
            await super().release(key)
            return False
        self._conns[key] = conn
        return True

    async def release(self, key: str) -> None:
        """Never raises for the unlock: a connection that fails it (the server dropped it while
        the thread's run played) or leaves it unanswered for ``CHECKPOINT_TIMEOUT`` is
        closed, and the lock goes with it."""
        conn = self._conns.pop(key, None)
        await super().release(key)
        if conn is not None:
            try:
                with anyio.move_on_after(CHECKPOINT_TIMEOUT) as silent:
                    await conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))",
                                       (f"kit:thread:{key}",))
                if silent.cancelled_caught:
                    await conn.close()
            except Exception:  # the pool then drops it, instead of lending a locked one out
                await conn.close()
            finally:
                await self._pool.putconn(conn)
