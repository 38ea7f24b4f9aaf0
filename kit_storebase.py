"""kit_storebase: what every event store shares (DESIGN 4.4, 4.5).

Owns: ``StoreBase``, the shared surface of ``kit.EventStorePort``'s implementations
(``kit_store``'s SQLite and memory stores, ``kit_pg``'s Postgres store): the lifecycle
(``async with store:``), the port's argument checks, the back-off while the storage is busy
(``BUSY_WAIT``), the refusal of a value the storage cannot hold (``unstorable``), the wake-ups
of followers, ``follow``/``follow_requests`` and ``replay`` (a run's log a page at a time,
``READ_PAGE``, from any store of the port's); and ``masked``, a store's URL (or a session
store's) as errors and logs may show it. The storage itself is each store's hooks, at the end
of the class.

Must never: run engine code, read the environment at import, do I/O (a store's hooks do, when
it is open), or know which storage a store has.

Theory of operation: every public method checks its arguments and that the store is open, then
runs one storage hook through ``_call``: inline, retried with asynchronous back-off while the
storage is busy (another process holds SQLite's write lock), never waiting on a lock itself. A
follower registers its wake-up before it reads, so no commit slips between the read and the wait;
a commit through this object wakes the followers of its runs, and a store that cannot hear other
writers re-reads every ``_poll`` seconds. A replay (``follow``'s, ``replay``'s) reads
``READ_PAGE`` events at a time and yields each page before reading the next: however long the
log, a reader holds one page, and its first event goes out after one page's read.
"""
from __future__ import annotations

import functools
import inspect
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Self

import anyio

from kit_core import (Claim, ConfigError, ControlRequest, Event, KitError, LogConflictError,
                      RunInfo, RunStatus, UnknownRunError, check_limit, quoted)

__all__ = ("StoreBase", "unstorable", "NotJSONError", "masked", "replay", "pages", "READ_PAGE",
           "BUSY_WAIT", "BUSY_FIRST_SLEEP", "BUSY_MAX_SLEEP")

_NOT_OPEN = "event store is not open: use `async with store:`"
#: A writer in another process holds SQLite's write lock for one short transaction; waiting 5 s
#: for it rides out any burst, while a genuinely stuck file still fails instead of hanging (the
#: Runtime's writer then retries the batch on its own, longer schedule). The wait is
#: asynchronous: SQLite's own busy handler would sleep on the event loop, freezing every
#: stream and request of the process while another process holds the lock.
BUSY_WAIT = 5.0
#: The first back-off while the file is locked, doubled up to BUSY_MAX_SLEEP (seconds): a short
#: transaction elsewhere costs a millisecond or two, a long one a poll every 50 ms.
BUSY_FIRST_SLEEP = 0.001
BUSY_MAX_SLEEP = 0.05
#: Events a replay reads at a time (``StoreBase.follow``, ``replay``: ``GET /runs/{id}/events``,
#: ``kit runs events``): a reader holds one page, never the log, and its first event goes out
#: after one page's read. Read whole, a finished 100,000-event SQLite run cost each reader 2.2 s
#: and 31 MB (55 MB peak) before a stream's first byte; paged, its first event is read in ~7 ms
#: and the whole replay peaks at 0.5 MB (62.6 MB whole, measured under tracemalloc).
READ_PAGE = 500
#: What precedes the user info of a URL whose ``://`` is misspelt: a scheme, a colon, slashes.
_SCHEME_TYPO = re.compile(r"(?:[A-Za-z][A-Za-z0-9+.-]*:?/+)?")


def _check_unique(events: Sequence[Event]) -> None:
    """Raise ``LogConflictError`` at the first ``(run_id, seq)`` or ``run.started`` a batch repeats."""
    started = [e.run_id for e in events if e.payload.kind == "run.started"]
    if len({(e.run_id, e.seq) for e in events}) == len(events) and len(set(started)) == len(started):
        return  # (two comprehensions over a batch that repeats nothing; the loop finds the first)
    seen: set[tuple[str, int]] = set()
    for e in events:
        # -1 is no seq: it stands for the run's run.started, which a run has at most once.
        keys = ((e.run_id, e.seq), (e.run_id, -1)) if e.kind == "run.started" else ((e.run_id, e.seq),)
        if not seen.isdisjoint(keys):
            raise LogConflictError(e.run_id, e.seq)
        seen.update(keys)


class NotJSONError(ValueError):
    """An event no JSON text can carry (an integer past Python's 4,300 digits, data nested past
    the recursion limit): raised by a store's serialiser, refused like any value the storage
    cannot hold (``unstorable``)."""


def unstorable(exc: Exception) -> ConfigError:
    """The error for a value the storage cannot hold (``exc``, the storage's own): a refusal of
    the call, never an outage. The writer retries a batch the store fails to take for as long
    as the store is down; a value no retry can store would hold every run's events behind it.
    (kit checks the ids it is given, ``check_id``, before they reach a store.)"""
    return ConfigError(f"the event store cannot hold a value it was given ({type(exc).__name__}: "
                       f"{exc})")


def masked(url: str) -> str:
    """``url`` with its password replaced by ``***``: what errors and logs may show. Never raises.

    The password is everything from the first ``:`` of the user info up to the URL's *last*
    ``@``, whatever ``urlsplit`` makes of it: an unencoded ``/``, ``?`` or ``#`` in a password
    ends ``urlsplit``'s host early (it then sees no user info at all), and an ``@`` in it is
    libpq's end of the user info, so a narrower cut would show a fragment. A user name that
    holds such a character is hidden too (``scheme://***@host``). A URL whose ``://`` is
    misspelt (``postgresql:/``, ``redis//``) is masked the same way after its scheme and
    slashes, which stay as typed: the reader must see the typo, never the password."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        prefix = _SCHEME_TYPO.match(url)
        scheme, sep, rest = "", url[:prefix.end()], url[prefix.end():]
    else:
        sep = f"{scheme}://"
    userinfo, at, host = rest.rpartition("@")
    if not (at and ":" in userinfo):
        return url
    user = userinfo.partition(":")[0]
    shown = "" if set(user) & set("/?#@[") else f"{user}:"
    return f"{sep}{shown}***@{host}"


async def replay(store: Any, run_id: str, after: int = -1) -> AsyncIterator[Event]:
    """Yield the run's committed events with ``seq > after``, in seq order, to the end of its log
    as it is read (never waiting for more: that is ``follow``), ``READ_PAGE`` at a time, each page
    yielded before the next is read. ``store`` is any ``kit.EventStorePort``: one whose ``read``
    takes no ``limit`` (``pages``) is read whole, in one read, as it always was."""
    if not pages(store):
        for event in await store.read(run_id, after):
            yield event
        return
    while True:
        page = await store.read(run_id, after, limit=READ_PAGE)
        for event in page:
            yield event
        if len(page) < READ_PAGE:
            return
        after = page[-1].seq


def pages(store: Any) -> bool:
    """Whether ``store.read`` takes ``limit=``. kit's stores do; a store of the user's own
    written to the port before it had ``limit`` may not, nor a subclass of kit's that overrides
    ``read(run_id, after)``: kit then reads such a store's log whole, as before. A method's
    signature is read once per function (its class's), not at every follow or replay."""
    read = store.read
    read = getattr(read, "__func__", read)  # a method: its function, the same for every store
    try:
        return _takes_limit(read)
    except TypeError:  # a callable that cannot be a key: read its signature each time
        return _takes_limit.__wrapped__(read)


@functools.lru_cache(maxsize=64)  # (the stores of a process have a read function or two)
def _takes_limit(read: Any) -> bool:
    try:
        params = inspect.signature(read).parameters.values()
    except (TypeError, ValueError):  # no signature to read: take it for the old port's
        return False
    return any(p.name == "limit" or p.kind is p.VAR_KEYWORD for p in params)


class StoreBase:
    """The shared surface of kit's stores: lifecycle, checks, wake-ups, ``follow`` and
    ``follow_requests``. Subclasses (``kit_store``'s ``SQLiteStore`` and ``MemoryStore``,
    ``kit_pg``'s ``PostgresStore``) implement the storage hooks at the end of the class.

    The hooks run through ``_call``: here they are synchronous and run inline (``_retrying``);
    a store whose I/O is asynchronous points ``_run_hook`` at its own (and overrides
    ``_opening``/``_closing``) and makes them coroutine functions. Followers wait per run: ``_woken(run_id, seq)`` wakes the
    followers of ``run_id`` that have not seen ``seq``; a store whose other writers can tell it
    of their commits (Postgres: LISTEN/NOTIFY) calls it for them, one that cannot re-reads every
    ``_poll`` seconds.
    """

    #: Seconds between re-reads while following; None when every writer is heard of.
    _poll: float | None = None
    #: True for a store opened to read only (``read_only=True``): it never creates or writes
    #: anything, and its writing methods raise ``KitError`` before touching the storage.
    read_only = False

    def __init__(self) -> None:
        # Followers waiting, per run (None: control requests): [what they have, event].
        # Created by ``__aenter__`` (the events need the running backend), so one store object
        # can be opened under asyncio and later under trio; None while closed.
        self._followers: dict[str | None, list[tuple[int, anyio.Event]]] | None = None
        # The ``run.failed`` of runs abandoned taking over their sessions, committed and not yet
        # reported: the hooks add them, the next ``append`` (or ``reap``) returns them.
        self._overtaken: list[Event] = []

    @property
    def commits_inline(self) -> bool:
        """True when ``append`` never pauses inside a commit: kit's own ``append``, its hooks
        run inline (``_retrying``: a cancellation lands between two attempts, never within
        one). False for a store whose hooks await their I/O (``kit_pg``'s) or whose ``append``
        is its own; the writer shields only such a store's commits (``kit_writer``)."""
        cls = type(self)
        return cls._run_hook is StoreBase._retrying and cls.append is StoreBase.append

    @property
    def opened(self) -> bool:
        """True between ``async with store:`` (or ``__aenter__``) and ``aclose``."""
        return self._followers is not None

    async def __aenter__(self) -> Self:
        """Open the store; raises ``KitError`` if it is open already."""
        if self._followers is not None:
            raise KitError("event store is already open")
        await self._opening()
        self._followers = {}
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the store (idempotent). Followers waiting on it wake and raise ``KitError``."""
        if self._followers is None:
            return
        self._wake_all()
        self._followers = None
        await self._closing()

    async def _opening(self) -> None:
        await self._retrying(self._open)

    async def _closing(self) -> None:
        self._close()

    def _check(self) -> None:
        if self._followers is None:
            raise KitError(_NOT_OPEN)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a storage hook on the open store (``_run_hook``). A value the storage cannot hold
        (``_unstorable``) is refused with ``unstorable``'s error, never raised as the storage's
        own (which the writer would take for an outage)."""
        self._check()
        try:
            return await self._run_hook(fn, *args)
        except Exception as exc:
            if self._unstorable(exc):
                raise unstorable(exc) from None
            raise

    def _check_writable(self, what: str) -> None:
        self._check()
        if self.read_only:
            raise KitError(f"{self!r} was opened read-only: it cannot {what}")

    async def _retrying(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, retried with asynchronous backoff while the storage is busy (another
        process holds SQLite's write lock), for up to ``BUSY_WAIT``; then the busy error
        propagates. The hook itself never waits for a lock: the event loop stays free.

        A cancellation lands between attempts (in the back-off's sleep), never inside a write;
        a call that succeeds at once is no checkpoint, and a cancellation pending meanwhile lands
        at the caller's next one (a checkpoint per call, even one that never yields, cost a
        backend lookup and a task lookup per commit; yielding, a loop pass).
        """
        delay, deadline = BUSY_FIRST_SLEEP, None
        while True:
            try:
                return fn(*args)
            except Exception as exc:
                if not self._busy(exc):
                    raise
                now = anyio.current_time()
                deadline = now + BUSY_WAIT if deadline is None else deadline
                if now >= deadline:
                    raise
            await anyio.sleep(delay)
            delay = min(delay * 2, BUSY_MAX_SLEEP)

    #: How ``_call`` runs a hook: inline, backing off while the storage is busy (``_retrying``).
    _run_hook = _retrying

    def _busy(self, exc: Exception) -> bool:
        """Whether ``exc`` means "locked by someone else, try again" (storage-specific)."""
        return False

    def _unstorable(self, exc: Exception) -> bool:
        """Whether ``exc`` means "the storage cannot hold a value it was given" (storage-specific;
        text that is not UTF-8, a lone surrogate, an event no JSON can carry, for every
        store): ``unstorable``."""
        return isinstance(exc, (UnicodeEncodeError, NotJSONError))

    # ---------------------------------------------------------------------- wake-ups --
    def _woken(self, run_id: str | None, seq: int | None) -> None:
        """Wake the followers of ``run_id`` (None: of control requests) that have not seen
        ``seq`` (None: all of them)."""
        waiting = self._followers.get(run_id) if self._followers is not None else None
        if waiting:
            for after, event in waiting:
                if seq is None or after < seq:
                    event.set()

    def _wake_all(self) -> None:
        """Wake every follower: each re-reads (or finds the store closed)."""
        for waiting in (self._followers or {}).values():
            for _, event in waiting:
                event.set()

    def _committed(self, events: Sequence[Event]) -> None:
        """Wake the followers of the runs in a committed batch (each once, its last seq)."""
        followers, last = self._followers, {}
        if not followers:
            return
        for e in events:  # (most runs have no follower: their events cost a lookup)
            if e.run_id in followers and e.seq > last.get(e.run_id, -1):
                last[e.run_id] = e.seq
        for run_id, seq in last.items():
            self._woken(run_id, seq)

    async def _read_or_wait(self, key: str | None, after: int,
                            read: Callable[[int], Awaitable[list[Any]]]) -> list[Any]:
        """``read(after)``; when that finds nothing, wait for a wake-up of ``key`` (or
        ``_poll`` seconds) and return []. The waiter is registered before reading, so no commit
        can slip between the read and the wait. Raises ``KitError`` if the store is closed."""
        self._check()
        entry = (after, anyio.Event())
        waiting = self._followers.setdefault(key, [])  # type: ignore[union-attr]
        waiting.append(entry)
        try:
            found = await read(after)
            if not found:
                with anyio.move_on_after(self._poll):
                    await entry[1].wait()
            return found
        finally:
            waiting.remove(entry)
            if not waiting and self._followers is not None and self._followers.get(key) is waiting:
                del self._followers[key]

    # ------------------------------------------------------------------------- the port --
    async def append(self, events: Sequence[Event], *, claims: Sequence[Claim] = ()) -> list[Event]:
        """Append a batch atomically; durable when this returns.

        With ``claims``, also take each run's lease in the same transaction: re-taking a run's own
        lease renews it; a session held by another run whose lease has lapsed is taken over (that
        run gets ``run.failed`` RunAbandoned, which this returns, in commit order, so the caller's
        observers see it: no ``reap`` returns that run; [] when none was). A ``run.started``
        event indexes the run; a terminal event frees the claim; a parking event keeps it with no
        lease to lapse.

        Raises ``SessionBusyError`` when a live or parked run holds a claim's session and
        ``LogConflictError`` for the first event whose ``(run_id, seq)`` is taken (or whose
        ``run.started`` reuses a run id), or else for the first event of a run whose log holds
        its end (``ended``: its status; a parked run takes its resume); either way nothing of
        the batch is written. Raises ``KitError`` if the store is not open (so do all the
        methods below), or was opened read-only (so do ``renew``, ``reap`` and ``request``).
        """
        self._check_writable("append")
        events = list(events)
        _check_unique(events)
        if events or claims:
            await self._call(lambda: self._append(events, claims, time.time()))
        overtaken, self._overtaken = self._overtaken, []
        self._committed([*overtaken, *events])  # (wakes the overtaken runs' followers too)
        return overtaken

    async def read(self, run_id: str, after: int = -1, *, limit: int | None = None) -> list[Event]:
        """The run's committed events with ``seq > after``, in seq order ([] for an unknown run);
        with ``limit``, the first ``limit`` of them at most (a page: the next one is read
        ``after=page[-1].seq``, and a page shorter than ``limit`` was the log's end). Raises
        ``ConfigError`` for a ``limit`` that is not a positive int."""
        return await self._call(self._read, run_id, after, check_limit("limit", limit))

    async def follow(self, run_id: str, after: int = -1) -> AsyncIterator[Event]:
        """Yield the run's events with ``seq > after``: replay, then live, in seq order.

        Returns right after yielding a terminal event, or a parking event while the run is still
        parked (a run that parked and went on replays past it, to its end). An unknown run is
        waited for like a live one (a follower may start before the run). Raises ``KitError`` if
        the store is not open or is closed while following. The replay is read a page
        (``READ_PAGE``) at a time, each yielded before the next is read; a full page is followed
        by the next without waiting.
        """
        paged = pages(self)  # (a subclass may override ``read`` without ``limit``: ``pages``)
        more = functools.partial(self.read, run_id, **({"limit": READ_PAGE} if paged else {}))
        while True:
            batch = await self._read_or_wait(run_id, after, more)
            for i, event in enumerate(batch):
                yield event
                after = event.seq
                if event.payload.ends == "terminal":
                    return
                if event.payload.ends == "parking" and i == len(batch) - 1 and not await \
                        self.read(run_id, after, **({"limit": 1} if paged else {})):
                    return  # parked now: a stream ends here, the run does not

    async def follow_requests(self, after: int = 0) -> AsyncIterator[ControlRequest]:
        """Yield the control requests with an id above ``after``, oldest first: those recorded
        already, then each new one (from this process or another) as it is recorded, forever.
        Raises ``KitError`` if the store is not open or is closed while following."""
        while True:
            for req in await self._read_or_wait(None, after, self.requests):
                yield req
                after = req.id

    async def runs(self, *, status: RunStatus | None = None, name: str | None = None,
                   session_id: str | None = None, limit: int | None = None,
                   before: str | None = None, namespace: str | None = None) -> list[RunInfo]:
        """The run index, filtered (filters combine with AND), oldest first: by ``started_at``,
        then run id (caller-chosen run ids need not sort by time, so the id alone cannot order).
        ``namespace``: that namespace's runs (a session id is per namespace: with
        ``session_id``, one conversation); None: every run, with a namespace or without.

        ``limit=N``: the N most recent matches. ``before=<run id>``: the runs that sort before
        that run (which need not match), so the next older page is ``before=page[0].run_id``.
        Runs never leave the log: a cursor stays valid. Raises ``ConfigError`` naming a bad
        ``limit`` (not a positive int), ``before`` (not a non-empty str), ``name``,
        ``session_id`` or ``namespace`` (not a str); ``ValueError`` for an unknown ``status``;
        ``UnknownRunError`` when the log has no run ``before``.
        """
        if limit is not None and (type(limit) is not int or limit < 1):  # (True is an int)
            raise ConfigError(f"limit must be a positive int, got {quoted(limit)}")
        if before is not None and (not isinstance(before, str) or not before):
            raise ConfigError(f"before must be a non-empty str (a run id), got {quoted(before)}")
        for what, value in (("name", name), ("session_id", session_id), ("namespace", namespace)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{what} must be a str, got {quoted(value)}")
        found = await self._call(self._runs, None if status is None else RunStatus(status), name,
                                 session_id, limit, before, namespace)
        # An empty page is also what an unknown cursor gives: only then is it looked up.
        if before is not None and not found and await self._call(self._run_info, before) is None:
            raise UnknownRunError(before)
        return found

    async def run_info(self, run_id: str) -> RunInfo | None:
        """The run's index row, or None for an unknown run."""
        return await self._call(self._run_info, run_id)

    async def renew(self, owner: str, lease_seconds: float, run_ids: Sequence[str] | None = None) -> None:
        """Extend the leases of ``owner`` to ``now + lease_seconds``: those of ``run_ids`` only
        (the runs its process still plays), or all of them. Parked claims stay parked."""
        self._check_writable("renew leases")
        ids = None if run_ids is None else list(run_ids)
        await self._call(lambda: self._renew(owner, time.time() + lease_seconds, ids))

    async def reap(self) -> list[str]:
        """Abandon every run whose lease has lapsed; return their run ids (each reaped once).

        Each gets ``run.failed`` (error ``RunAbandoned``) at its next seq and status FAILED, and
        its claim is freed. Runs abandoned at a claim that no ``append`` returned (it failed
        after the takeover committed) are returned too.
        """
        self._check_writable("reap runs")
        reaped = await self._call(lambda: self._reap(time.time()))
        overtaken, self._overtaken = self._overtaken, []
        reaped = sorted({*reaped, *(e.run_id for e in overtaken)})
        for run_id in reaped:
            self._woken(run_id, None)
        return reaped

    async def request(self, run_id: str, action: str, reason: str | None = None,
                      source: str | None = None) -> int:
        """Record a control request (pause, cancel, resume) for a run; returns its id.

        A request is not a status change: the run's writer acts on it at its next safe point.
        Raises ``UnknownRunError`` when the log has no such run, ``ConfigError`` for another
        action.
        """
        if action not in ("pause", "cancel", "resume"):
            raise ConfigError(f"a control request is pause, cancel or resume, got {quoted(action)}")
        self._check_writable("record a control request")
        if await self._call(self._run_info, run_id) is None:
            raise UnknownRunError(run_id)
        request_id = await self._call(lambda: self._request(run_id, action, reason, source, time.time()))
        self._woken(None, request_id)
        return request_id

    async def requests(self, after: int = 0, run_ids: Sequence[str] | None = None
                       ) -> list[ControlRequest]:
        """Control requests with an id above ``after``, oldest first; only those of ``run_ids``
        when given (a read of an index, not of every request)."""
        return await self._call(self._requests, after, None if run_ids is None else list(run_ids))

    async def last_events(self, run_ids: Sequence[str]) -> dict[str, Event]:
        """The last event of each run of ``run_ids`` in the log, by run id, in one read (a run
        the log does not have is left out): the ends of many runs, where ``read(run_id,
        after=info.last_seq - 1)`` is a read each (a round trip each, on Postgres)."""
        return await self._call(self._last_events, list(run_ids))

    async def last_request_id(self) -> int:
        """The id of the newest control request (0: none yet)."""
        return await self._call(self._last_request)

    async def session_holder(self, session_id: str, namespace: str | None = None) -> str | None:
        """The run id holding ``(namespace, session_id)``, or None.

        A lapsed lease still holds until it is reaped or overtaken.
        """
        return await self._call(self._holder, session_id, namespace or "")

    async def lease_until(self, run_id: str) -> float | None:
        """When the lease on ``run_id`` lapses (seconds since the epoch, as ``time.time()``), or
        None when no process holds one (a run that ended, parked, or that nothing claimed). A
        lapsed lease belongs to a process that stopped renewing it (it died, or lost the store)
        and stands until a deck reaps the run."""
        return await self._call(self._lease_until, run_id)

    # Storage hooks: synchronous, so nothing can interleave with a transaction.
    def _open(self) -> None: ...
    def _close(self) -> None: ...
    def _append(self, events: list[Event], claims: Sequence[Claim], now: float) -> None: ...
    # (a run it abandons taking over its session: its run.failed to ``_overtaken``, once committed)
    def _read(self, run_id: str, after: int, limit: int | None) -> list[Event]: ...
    def _runs(self, status: RunStatus | None, name: str | None, session_id: str | None,
              limit: int | None, before: str | None, namespace: str | None) -> list[RunInfo]: ...
    def _run_info(self, run_id: str) -> RunInfo | None: ...
    def _renew(self, owner: str, until: float, run_ids: list[str] | None) -> None: ...
    def _reap(self, now: float) -> list[str]: ...
    def _holder(self, session_id: str, namespace: str) -> str | None: ...
    def _lease_until(self, run_id: str) -> float | None: ...
    def _request(self, run_id: str, action: str, reason: str | None, source: str | None, at: float) -> int: ...
    def _requests(self, after: int, run_ids: list[str] | None) -> list[ControlRequest]: ...
    def _last_events(self, run_ids: list[str]) -> dict[str, Event]: ...
    def _last_request(self) -> int: ...
