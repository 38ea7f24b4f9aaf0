"""kit_ports: the ports of the log: how the Runtime and users reach an event store
(``EventStorePort``) and how observers are fed (``EventSinkPort``), with the values they exchange.

Owns: ``EventStorePort``, ``EventSinkPort``, ``Claim`` (a run's lease, taken with an append)
and ``ControlRequest`` (a pause, cancel or resume request recorded for a run). ``kit_core``
re-exports every name, so ``kit.EventStorePort``,
``kit.core.ports.EventStorePort`` and ``from kit_core import Claim`` are the ways in.

Must never: import a sibling module at run time (the values its signatures name, ``Event``,
``RunInfo`` and ``RunStatus``, are kit_core's, named under ``TYPE_CHECKING`` only), or an engine
SDK, do I/O, read the environment or keep state.

Theory of operation: a port is a ``Protocol`` (checkable at run time): a store or an observer is
anything with its methods, kit's own (kit_store, kit_pg) or a user's; the values are frozen
dataclasses. What each operation promises (atomic batches, claims, following a run) is in the
port's docstring, the one place the stores and the Runtime read it from.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kit_core import Event, RunInfo, RunStatus

__all__ = ("EventSinkPort", "EventStorePort", "Claim", "ControlRequest")


@dataclass(frozen=True, slots=True)
class Claim:
    """A run's lease, taken with ``EventStorePort.append(..., claims=[...])``.

    ``owner`` (one id per Runtime) renews it every few seconds; when ``lease_seconds`` pass
    without renewal the owner is presumed dead, the run is recorded as ``run.failed`` (error
    ``RunAbandoned``) and its session, if any, is free again (DESIGN 4.5).
    """
    run_id: str
    owner: str
    lease_seconds: float
    session_id: str | None = None
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class ControlRequest:
    """A pause, cancel or resume request recorded for a run (``EventStorePort.request``)."""
    id: int
    run_id: str
    action: str
    reason: str | None = None
    source: str | None = None


@runtime_checkable
class EventSinkPort(Protocol):
    """An observer of the log. ``emit`` does in-memory work only and never awaits a round trip.

    It gets each committed event once, in each run's order, on a daemon thread of its own (a
    slow ``emit`` costs that observer its own backlog, never a run); an observer whose class
    sets ``nonblocking = True`` promises ``emit`` only appends to memory, and is called on the
    event loop instead. Optional methods, called when present: ``start()`` once at deck open
    (raising refuses the open) and ``close()`` when the stream has ended (flush buffers there).
    """

    def emit(self, event: Event) -> None: ...


@runtime_checkable
class EventStorePort(Protocol):
    """The one way to the log: the Runtime writes through it, users read the full log through it.

    ``append`` is atomic per batch and durable when it returns. With ``claims`` it also takes those
    runs' leases (and session claims) in the same transaction, raising ``SessionBusyError`` and
    writing nothing when another live or parked run holds the session; a session whose holder's
    lease lapsed is taken over, and ``append`` returns that run's ``run.failed`` (RunAbandoned)
    for the Runtime's observers (None: a store that does not tell). A terminal event frees the
    claim; a parking event keeps it without a lease. ``follow`` replays, then yields live events,
    until the run's terminal or parking event; ``follow_requests`` does the same for control
    requests, forever (the owner of a run learns of a pause or cancel written anywhere).
    ``read(..., limit=N)`` returns the first N at most, a page of a replay
    (``kit_storebase.replay``); a store whose ``read`` takes no ``limit`` is read whole.
    ``last_events`` gives the last event of many runs in one read (``deck.pending()``, a tick's
    scan of sleeping runs).
    """

    async def append(self, events: Sequence[Event], *,
                     claims: Sequence[Claim] = ()) -> list[Event] | None: ...
    async def read(self, run_id: str, after: int = -1, *,
                   limit: int | None = None) -> list[Event]: ...
    def follow(self, run_id: str, after: int = -1) -> AsyncIterator[Event]: ...
    async def runs(self, *, status: RunStatus | None = None, name: str | None = None,
                   session_id: str | None = None, limit: int | None = None,
                   before: str | None = None, namespace: str | None = None) -> list[RunInfo]: ...
    async def run_info(self, run_id: str) -> RunInfo | None: ...
    async def renew(self, owner: str, lease_seconds: float,
                    run_ids: Sequence[str] | None = None) -> None: ...
    async def reap(self) -> list[str]: ...
    async def request(self, run_id: str, action: str, reason: str | None = None,
                      source: str | None = None) -> int: ...
    async def requests(self, after: int = 0) -> list[ControlRequest]: ...
    def follow_requests(self, after: int = 0) -> AsyncIterator[ControlRequest]: ...
    async def session_holder(self, session_id: str, namespace: str | None = None) -> str | None: ...
    async def lease_until(self, run_id: str) -> float | None: ...
    async def last_events(self, run_ids: Sequence[str]) -> dict[str, Event]: ...
