"""kit_errors: the errors kit raises on purpose, one class per thing a caller can act on (the
ground floor, below every other module).

Owns: ``KitError`` and its subclasses, each naming what was wrong and, where it helps, what to do
next; ``type_name`` for messages that name a type, ``error_text`` for those that quote an
exception that may not be kit's, ``quoted`` for those that quote a value given from outside
(cut to ``MAX_QUOTED_CHARS``). ``kit_core`` re-exports all of it, so
``kit.ConfigError`` and ``from kit_core import ConfigError`` are the ways in.

Must never: import a sibling module or an engine SDK, do I/O or read the environment.

Theory of operation: an error's message is for the person who reads it (what went wrong, where,
what to do); its attributes are for the program that catches it (``run_id``, ``status``,
``outcome``, ...). Contrasts between neighbours (``ConfigError`` against ``DeckStateError`` against
``ContentError``) are spelled out in their docstrings, since callers choose by them.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kit_core import RunStatus

__all__ = (
    "KitError", "ConfigError", "ContextTypeError", "ContentError", "DeckStateError",
    "UnknownNameError", "UnknownRunError", "RunNotWaitingError", "RunStoppedError",
    "SessionBusyError", "LogConflictError", "StoreUnavailableError", "MCPServerError",
    "CheckpointMissingError", "CorruptEventError",
)

class KitError(Exception):
    """Root of every error kit raises on purpose.

    Pickles and copies with its message and facts as they are: BaseException's way calls the
    class again with ``args`` (the message alone), which a subclass that builds its message from
    its facts refuses (``SessionBusyError(session_id, run_id)``).
    """

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuilt, (type(self), self.args), self.__dict__


def _rebuilt(cls: type[KitError], args: tuple[object, ...]) -> KitError:
    """A pickled ``KitError``, its ``__init__`` not called (``__dict__`` restores its facts)."""
    return cls.__new__(cls, *args)


class ConfigError(KitError):
    """The catalog, a setting or a call's arguments are wrong: *your* configuration, fix it.

    Contrast with ``DeckStateError`` (the configuration is fine, the deck is in the wrong state)
    and ``ContentError`` (one piece of input is malformed).
    """


class ContextTypeError(ConfigError):
    """A callable requires a context type that the deck's declared ``context=`` cannot satisfy."""

    def __init__(self, site: str, required: object, provided: object) -> None:
        self.site, self.required, self.provided = site, required, provided
        super().__init__(f"{site} requires a context of type {type_name(required)}, "
                         f"but the deck provides {type_name(provided)}")


class ContentError(KitError, ValueError):
    """A content block is malformed (bad base64, too large, wrong media type, not JSON)."""


class DeckStateError(KitError):
    """The deck cannot do that in its current state (not open yet, or already closed).

    Contrast with ``ConfigError``: nothing is wrong with the catalog; the call came at the wrong
    time in the deck's lifecycle (SPEC 3.1). A closed deck stays closed: build a new one.
    """

    def __init__(self, state: str, action: str) -> None:
        self.state, self.action = state, action
        hint = {"CLOSED": "a closed deck cannot be reopened; build a new Deck",
                "OPENING": "another task is opening it: use it once its `async with deck:` has "
                           "entered",
                "OPEN": "an open deck is opened once, used on its event loop and closed by the "
                        "task that opened it"}.get(state, "open it first with `async with deck:`")
        super().__init__(f"cannot {action}: the deck is {state} ({hint})")


class UnknownNameError(KitError, LookupError):
    """No agent (or workflow) of that name in the deck's catalog.

    ``what`` says which kind was looked for; ``hint`` (optional) says where the name is instead.
    """

    def __init__(self, name: str, known: Iterable[str], *, what: str = "agent or workflow",
                 hint: str | None = None) -> None:
        self.name, self.known = name, sorted(known)
        super().__init__(f"no {what} named {quoted(name)}" + (f" ({hint})" if hint else "")
                         + f"; known: {', '.join(self.known) or '(none)'}")


class SessionBusyError(KitError):
    """Another run holds this session: one turn per ``(namespace, session_id)`` at a time.

    The holder may be running in this process or another one, or parked (waiting for a human,
    sleeping, paused); the claim is freed when that run ends (DESIGN 4.5).
    """

    def __init__(self, session_id: str, run_id: str, namespace: str | None = None) -> None:
        self.session_id, self.run_id, self.namespace = session_id, run_id, namespace
        where = f" in namespace {quoted(namespace)}" if namespace else ""
        super().__init__(f"session {quoted(session_id)}{where} is busy: run {run_id} holds it")


class LogConflictError(KitError):
    """The log refuses the event at ``(run_id, seq)``: it holds an event at that seq already
    (another writer owns the run, or the run id was reused by mistake), or, when ``ended`` is
    set (the run's status), it holds the run's end: another writer ended the run, or recorded
    it abandoned because this writer's lease lapsed (a stalled process that then went on).

    Raised instead of interleaving two writers' events, or writing past a run's end.
    """

    def __init__(self, run_id: str, seq: int, ended: RunStatus | None = None) -> None:
        self.run_id, self.seq, self.ended = run_id, seq, ended
        if ended is None:
            super().__init__(f"run {run_id} already has an event at seq {seq}: another writer "
                             "owns this run, or the run id was reused")
        else:
            super().__init__(f"run {run_id} has ended ({ended.value}), so its event at seq {seq} "
                             "was refused: another writer ended it, or recorded it abandoned "
                             "when this writer's lease lapsed")


class CorruptEventError(KitError, ValueError):
    """An event kit cannot read: the log holds a row of a kind this version knows whose payload
    lacks a field or holds one of the wrong shape (a row edited by hand, or written by another
    program), or one that is not an event at all. ``run_id``, ``seq``, ``kind`` and ``field``
    say where (each None when the row does not say it); ``problem`` says what is wrong.

    Contrast with ``ContentError`` (a caller's input is malformed: fix the call) and with a kind
    this version does not know, which is no error (it reads as ``UnknownEvent``): here the log
    itself holds what kit cannot read; fix or delete that row.
    """

    def __init__(self, run_id: object, seq: object, kind: object, field: str | None,
                 problem: str) -> None:
        self.run_id, self.seq, self.kind, self.field = run_id, seq, kind, field
        self.problem = problem
        where = ("an event" if seq is None else f"the event at seq {quoted(seq)}") + (
            "" if run_id is None else f" of run {quoted(run_id)}")
        what = f" ({quoted(kind)})" if kind is not None else ""
        super().__init__(f"{where}{what} cannot be read: {problem}")


class UnknownRunError(KitError, LookupError):
    """The log has no run with that id."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"the log has no run {quoted(run_id)}")


class RunNotWaitingError(KitError):
    """The run is not waiting for what was asked of it: an interrupt is answered once.

    Contrast with ``UnknownRunError``: the run exists, but it is not (or no longer) in the state
    the call needs, typically because another caller answered or resumed it first.
    """

    def __init__(self, run_id: str, status: object, wanted: str) -> None:
        self.run_id, self.status, self.wanted = run_id, status, wanted
        super().__init__(f"run {run_id} is {getattr(status, 'value', status)}, not {wanted}: "
                         "it was answered or resumed already, or it never waited")


class CheckpointMissingError(KitError):
    """A parked workflow run cannot be answered or resumed here: its thread's checkpoint is not
    in this deck's checkpointer. A non-durable workflow keeps its checkpoints in the memory of
    the process that parked the run, so only that process can go on with it, and none can once
    it has stopped; a durable one's checkpointer has lost the thread.

    Contrast with ``RunNotWaitingError`` (the run does not wait): this one waits, and keeps
    waiting. ``cancel`` it to end it and free its thread; a durable workflow
    (``Workflow(..., durable=True)``) can be answered by any process, after a restart too.
    """

    def __init__(self, run_id: str, workflow: str, durable: bool) -> None:
        self.run_id, self.workflow, self.durable = run_id, workflow, durable
        where = ("its durable checkpointer has no such thread" if durable else
                 f"workflow {workflow!r} is not durable, so its checkpoints live in the memory "
                 "of the process that parked the run (another replica, or one that has stopped "
                 "since)")
        super().__init__(f"run {run_id} of workflow {workflow!r} cannot go on here: {where}; it "
                         "stays parked: cancel it to end it and free its thread")


class RunStoppedError(KitError):
    """The run stopped at a safe point because someone asked: paused, or cancelled.

    Contrast with a cancelled *caller* (anyio's cancellation) and a closed deck
    (``DeckStateError``): here a ``pause``/``cancel`` request, from this process or another,
    ended the call. A paused run keeps its session and can be ``resume``d.
    """

    def __init__(self, run_id: str, status: object, reason: str | None) -> None:
        self.run_id, self.status, self.reason = run_id, status, reason
        why = f": {reason}" if reason else ""
        super().__init__(f"run {run_id} was {getattr(status, 'value', status).lower()} on request{why}")


class MCPServerError(KitError):
    """An MCP server stopped answering a run: its process exited (``what`` names the exit
    code), it closed the connection, it did not answer ``list_tools`` within its ``timeout``,
    or it failed one. ``then`` says what kit does about it (restarts it; or it stays down
    because restarting failed, until the deck is reopened).

    Contrast with ``ConfigError``, a server that cannot start when the deck opens, and with a
    tool call the server refuses or that times out: that is an error string to the model, and
    the run goes on.
    """

    def __init__(self, server: str, what: str, then: str | None = None) -> None:
        self.server, self.what, self.then = server, what, then
        super().__init__(f"MCP server {server!r} {what}" + (f"; {then}" if then else ""))


class StoreUnavailableError(KitError):
    """The event store took no writes for ``seconds``, so the run's caller stops waiting.

    Contrast with ``RunStoppedError`` (someone asked the run to stop) and with the run's own
    failure: here the *log* could not keep up. Nothing is lost: the run's events wait in memory
    and are written as soon as the store takes writes again (by this process, or by another once
    the run's lease lapses). ``outcome`` says what the log will hold: ``"stopped"``, the run was
    stopped where it stood and ends as ``run.failed``; ``"ended"``, it had played to its end
    already, which is written as it is (do not play it again); ``"not started"``, nothing.
    """

    def __init__(self, run_id: str, seconds: float, cause: BaseException | None = None, *,
                 outcome: str = "stopped") -> None:
        self.run_id, self.seconds, self.cause, self.outcome = run_id, seconds, cause, outcome
        why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        down = f"the event store took no writes for {seconds:g} s{why}"
        super().__init__({
            "stopped": f"run {run_id} was stopped: {down}; its end is recorded when the store "
                       "recovers",
            "ended": f"run {run_id} played to its end, but {down}; its end is recorded when the "
                     "store recovers (do not play it again)",
            "not started": f"run {run_id} was not started: {down}; nothing of it is recorded",
        }[outcome])


#: The most characters of a value given from outside (a name, an id, a header) an error message
#: quotes: enough to recognise it, while a megabyte-long one does not make a megabyte message
#: (nor a log line, nor an HTTP answer).
MAX_QUOTED_CHARS = 200


def quoted(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """``repr(value)`` for an error message, its first ``limit`` characters and how many more
    were cut when longer. Never raises: a value whose ``repr`` does is shown by its type."""
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__}>"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def type_name(t: object) -> str:
    return t.__qualname__ if isinstance(t, type) else repr(t)


def error_text(exc: BaseException) -> str:
    """``str(exc)`` for a message or the log; Python's own stand-in (as its tracebacks print)
    when the exception's ``__str__`` raises, as a user's exception may: recording a run's
    failure must not fail in turn."""
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"
