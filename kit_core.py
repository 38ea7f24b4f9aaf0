"""kit_core: the values of kit: what users type and what the log holds (the ground floor).

Owns: the event envelope (``Event``) and its payload types, the results (``TurnResult``,
``Usage``, ``InterruptResult``, ``RunStatus``, ``RunInfo``, ...) and the seams the upper floors
meet at: ``Context`` (the per-run application context), ``InvocableSpec`` (a compiled agent or
workflow) and ``RunHandle`` (how an engine plays a run without holding the Runtime). The errors
(``kit_errors``), the content blocks (``kit_content``), the input checks every surface shares
(``kit_checks``: names, ids, limits) and the ports (``kit_ports``: ``EventStorePort``,
``EventSinkPort``, ``Claim``, ``ControlRequest``) live below it and are re-exported here, so this
module is the one place to import values from: ``kit.core`` and ``kit.core.ports`` are aliases of
it, and ``kit`` re-exports its ``__all__``.

Must never: import a sibling module other than ``kit_errors``, ``kit_content``, ``kit_checks``
and ``kit_ports``, or an engine SDK (openai-agents, LangGraph), do I/O, read the environment, or
keep state beyond the payload-kind table built at import. Every module above imports this one.

Theory of operation: everything here is a value. Events are frozen dataclasses; a payload class
carries its dotted ``kind`` (``"text.delta"``), what the kind does to a stream (``ends``: terminal,
parking or neither) and the run status after it, so folding a run's status and ending a stream
read the same table (``KINDS``). Names without an underscore that ``__all__`` leaves out
(``jsonable``, ``iso_time``, ``check_name``, ``check_id``, ``check_text``, ``check_limit``,
``count_setting``, ``switch_setting``, ``HTTP_TOKEN``, ``printable``, ``RunHandle``, ...) are
kit's internal API between its modules.
"""
from __future__ import annotations

import enum
import os
import time
import types
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from datetime import datetime, timezone
from typing import Any, ClassVar

import orjson

import kit_checks
from kit_content import (
    BLOCK_TYPES, HISTORY_ROLES, MAX_INLINE_BYTES, AudioBlock, ContentBlock, DataBlock,
    HistoryMessage, ImageBlock, ResourceBlock, TextBlock, as_blocks, as_history, block_from_json,
    block_to_json,
)
from kit_errors import (
    CheckpointMissingError, ConfigError, ContentError, ContextTypeError, CorruptEventError,
    DeckStateError, KitError, LogConflictError, MCPServerError, RunNotWaitingError,
    RunStoppedError, SessionBusyError, StoreUnavailableError, UnknownNameError, UnknownRunError,
    error_text, quoted,
)
from kit_ports import Claim, ControlRequest, EventSinkPort, EventStorePort

__all__ = (
    # errors
    "KitError", "ConfigError", "ContextTypeError", "ContentError", "DeckStateError",
    "UnknownNameError", "UnknownRunError", "RunNotWaitingError", "RunStoppedError",
    "SessionBusyError", "LogConflictError", "StoreUnavailableError", "MCPServerError",
    "CheckpointMissingError", "CorruptEventError",
    # content
    "TextBlock", "ImageBlock", "AudioBlock", "ResourceBlock", "DataBlock", "ContentBlock",
    "MAX_INLINE_BYTES", "as_blocks", "block_to_json", "block_from_json", "HistoryMessage",
    "HISTORY_ROLES", "as_history",
    # events
    "Event", "RunStarted", "TextDelta", "MessageCompleted", "ModelCompleted", "ToolStarted",
    "ToolCompleted", "SkillLoaded", "NodeUpdated", "ControlRequested", "RunInterrupted",
    "RunSleeping", "RunPaused", "RunResumed", "RunCompleted", "RunFailed", "RunCancelled",
    "UnknownEvent", "Payload", "KINDS", "fold_status",
    # results
    "RunStatus", "Usage", "TurnResult", "InterruptResult", "RunInfo", "Pending", "Due", "Ticked",
    # ports
    "EventSinkPort", "EventStorePort", "Claim", "ControlRequest",
    # runs
    "Context", "InvocableSpec", "NewRunId", "new_run_id",
)


#: The input checks (``kit_checks``), kit's internal API between its modules, as they were here.
check_name, check_id, check_text, check_limit = (kit_checks.check_name, kit_checks.check_id,
                                                 kit_checks.check_text, kit_checks.check_limit)
count_setting, switch_setting, printable = (kit_checks.count_setting, kit_checks.switch_setting,
                                            kit_checks.printable)
MAX_ID_CHARS, HTTP_TOKEN = kit_checks.MAX_ID_CHARS, kit_checks.HTTP_TOKEN


_UNSET: Any = object()  # a field with a default factory, not given


def _value(cls: type) -> type:
    """``cls`` as a frozen, slotted dataclass whose ``__init__`` (same parameters and defaults;
    a default factory is called when its field is not given) sets each field through its
    slot's setter: a frozen dataclass's own sets each with object.__setattr__, ~0.7k
    instructions a field more (callgrind), and each turn builds a dozen values."""
    cls = dataclass(frozen=True, slots=True)(cls)
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: a value's __init__ calls no __post_init__")
    names, params, sets = {"_UNSET": _UNSET}, [], []
    for f in fields(cls):
        names[f"set_{f.name}"], value = cls.__dict__[f.name].__set__, f.name
        if f.default is not MISSING:
            names[f"d_{f.name}"] = f.default
            params.append(f"{f.name}=d_{f.name}")
        elif f.default_factory is not MISSING:
            names[f"f_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_UNSET")
            value = f"f_{f.name}() if {f.name} is _UNSET else {f.name}"
        else:
            params.append(f.name)
        sets.append(f"\n    set_{f.name}(self, {value})")
    exec(f"def __init__(self, {', '.join(params)}):{''.join(sets) or ' pass'}", names)
    names["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"  # (its errors name it)
    cls.__init__ = names["__init__"]  # type: ignore[misc]
    return cls


# ===================================================================================== events ====

class RunStatus(str, enum.Enum):
    """A run's status, folded from its events (``deck.status``)."""
    RUNNING = "RUNNING"
    WAITING_HUMAN = "WAITING_HUMAN"
    SLEEPING = "SLEEPING"
    PAUSED = "PAUSED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


@_value
class Usage:
    """Tokens and estimated cost of a run or model call; ``usd`` is None when no price is known."""
    input_tokens: int = 0
    output_tokens: int = 0
    usd: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens, "usd": self.usd}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | None) -> Usage:
        obj = obj or {}
        return cls(int(obj.get("input_tokens") or 0), int(obj.get("output_tokens") or 0), obj.get("usd"))


class Payload:
    """Base of the typed payloads. ``kind`` is the dotted discriminator used everywhere.

    ``ends`` says what the kind does to a live stream: ``"terminal"`` ends the run, ``"parking"``
    ends the stream but not the run, ``None`` neither. ``status`` is the run status after it.
    """
    __slots__ = ()
    kind: ClassVar[str]
    ends: ClassVar[str | None] = None
    status: ClassVar[RunStatus | None] = None
    _fields: ClassVar[tuple[str, ...]] = ()

    def to_json(self) -> dict[str, Any]:
        out = {}
        for n in self._fields:  # (a loop, and a text as it is: ~40% fewer instructions a delta)
            v = getattr(self, n)
            out[n] = v if v is None or type(v) is str else jsonable(v)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Payload:
        return cls(**{n: obj[n] for n in cls._fields if n in obj})


#: kit's release: pyproject reads it (the package's version), and ``kit.__version__`` and the
#: MCP surface's ``serverInfo`` tell it.
VERSION = "3.0.0"

#: The longest integer the log takes (bits): Python writes no integer past 4,300 decimal digits
#: (about 14,280 bits) as JSON text, so one that long is refused where it is made.
MAX_INT_BITS = 14_000


def jsonable(v: Any) -> Any:
    """``v`` as JSON-ready data: blocks, usage, enums, datetimes, pydantic models and dataclass
    instances converted, anything else unknown as its ``str``. Every payload field goes through
    it, when its event is made. Raises ``ContentError`` for what no JSON text the log could
    write holds: an integer past ``MAX_INT_BITS``, a NaN or an infinity (JSON has neither; the
    store's serialiser wrote them as null). The run that made it fails; the store never sees it."""
    if v is None or type(v) is str or type(v) is bool:
        return v
    if type(v) is float:
        if v - v == 0.0:  # finite
            return v
        raise ContentError(f"a float {v!r} cannot be written to the log as JSON (it has no NaN "
                           "nor infinity); return None or a string")
    if type(v) is int:
        if v.bit_length() > MAX_INT_BITS:
            raise ContentError(f"an integer of {v.bit_length():,} bits cannot be written to the "
                               f"log as JSON (at most {MAX_INT_BITS:,}); return it as a string")
        return v
    if type(v) is dict:  # plain containers before the checks below (Mapping's is an ABC's)
        return {str(k): jsonable(x) for k, x in v.items()}
    if type(v) is list or type(v) is tuple:
        return [jsonable(x) for x in v]
    if isinstance(v, enum.Enum):
        return jsonable(v.value)
    if isinstance(v, int):
        return jsonable(int(v))
    if isinstance(v, float):
        return jsonable(float(v))
    if isinstance(v, str):
        return v
    if isinstance(v, Usage):
        return v.to_json()
    if isinstance(v, BLOCK_TYPES):
        return block_to_json(v)
    if isinstance(v, HistoryMessage):
        return v.to_json()
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, datetime):
        return v.isoformat()
    dump = getattr(v, "model_dump", None)  # pydantic models (structured outputs)
    if callable(dump):  # its JSON mode leaves NaN, infinities and huge integers as they are
        return jsonable(dump(mode="json"))
    if is_dataclass(v) and not isinstance(v, type):  # dataclass outputs too
        return jsonable({f.name: getattr(v, f.name) for f in fields(v)})
    return str(v)


def _payload(kind: str, *, ends: str | None = None, status: RunStatus | None = None):
    """A frozen, slotted payload dataclass of ``kind``, registered in ``KINDS``."""
    def wrap(cls):
        cls = _value(cls)
        cls.kind, cls.ends, cls.status = kind, ends, status
        cls._fields = tuple(f.name for f in fields(cls))
        _KINDS[kind] = cls
        return cls
    return wrap


_KINDS: dict[str, type[Payload]] = {}
#: Every kind this version knows -> its payload class (read-only).
KINDS: Mapping[str, type[Payload]] = types.MappingProxyType(_KINDS)


@_payload("run.started", status=RunStatus.RUNNING)
class RunStarted(Payload):
    name: str
    invocable: str  # "agent" | "workflow"
    session_id: str | None = None
    namespace: str | None = None
    input: tuple[ContentBlock, ...] = ()
    parent_run_id: str | None = None
    history: tuple[HistoryMessage, ...] = ()  # a one-off agent turn's earlier messages

    def to_json(self) -> dict[str, Any]:
        out = Payload.to_json(self)
        if not self.history:  # most runs have none: their rows stay as they were
            del out["history"]
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RunStarted:
        return cls(obj["name"], obj["invocable"], obj.get("session_id"), obj.get("namespace"),
                   tuple(block_from_json(b) for b in obj.get("input") or ()), obj.get("parent_run_id"),
                   tuple(HistoryMessage.from_json(m) for m in obj.get("history") or ()))


@_payload("text.delta")
class TextDelta(Payload):
    text: str


@_payload("message.completed")
class MessageCompleted(Payload):
    text: str
    output: Any = None  # the structured output, when the agent declares an output_type
    agent: str | None = None


@_payload("model.completed")
class ModelCompleted(Payload):
    model: str  # the model asked for (and priced)
    input_tokens: int = 0
    output_tokens: int = 0
    usd: float | None = None
    response_model: str | None = None  # the one the response says answered, when another
    cached_input_tokens: int = 0  # of input_tokens, those read from the provider's prompt cache

    def to_json(self) -> dict[str, Any]:
        # Spelled out (a model call's path): Payload.to_json's keys, in its order, less the two
        # most calls leave unset, so their rows stay as they were and rows before them read.
        m = self.model
        out = {"model": m if type(m) is str else jsonable(m),
               "input_tokens": jsonable(self.input_tokens),
               "output_tokens": jsonable(self.output_tokens), "usd": jsonable(self.usd)}
        if (r := self.response_model) is not None:
            out["response_model"] = r if type(r) is str else jsonable(r)
        if self.cached_input_tokens:
            out["cached_input_tokens"] = jsonable(self.cached_input_tokens)
        return out


@_payload("tool.started")
class ToolStarted(Payload):
    call_id: str
    tool: str
    arguments: str = ""


@_payload("tool.completed")
class ToolCompleted(Payload):
    call_id: str
    tool: str
    output: Any = None
    is_error: bool = False


@_payload("skill.loaded")
class SkillLoaded(Payload):
    name: str
    sha256: str


@_payload("node.updated")
class NodeUpdated(Payload):
    node: str
    update: Any = None


@_payload("control.requested")
class ControlRequested(Payload):
    action: str  # pause | cancel | resume
    reason: str | None = None
    source: str | None = None


@_payload("run.interrupted", ends="parking", status=RunStatus.WAITING_HUMAN)
class RunInterrupted(Payload):
    interrupt_id: str
    payload: Any = None
    thread_id: str | None = None


@_payload("run.sleeping", ends="parking", status=RunStatus.SLEEPING)
class RunSleeping(Payload):
    until: str
    thread_id: str | None = None
    interrupt_id: str | None = None


@_payload("run.paused", ends="parking", status=RunStatus.PAUSED)
class RunPaused(Payload):
    reason: str | None = None
    items: Any = None  # a sessionless agent run's conversation so far, to resume from


@_payload("run.resumed", status=RunStatus.RUNNING)
class RunResumed(Payload):
    by: str  # answer | resume | tick


@_payload("run.completed", ends="terminal", status=RunStatus.COMPLETED)
class RunCompleted(Payload):
    output: Any = None
    usage: Usage = field(default_factory=Usage)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RunCompleted:
        return cls(obj.get("output"), Usage.from_json(obj.get("usage")))


@_payload("run.failed", ends="terminal", status=RunStatus.FAILED)
class RunFailed(Payload):
    error: str  # the exception's type name
    message: str = ""


@_payload("run.cancelled", ends="terminal", status=RunStatus.CANCELLED)
class RunCancelled(Payload):
    reason: str | None = None


@_value
class UnknownEvent(Payload):
    """The payload of a kind this version does not know; ``data`` is the raw JSON payload, any
    JSON value (a newer kit's, or a hand-written row's), written back exactly as it was read."""
    kind: str  # type: ignore[misc]
    data: Any = None

    def to_json(self) -> Any:  # type: ignore[override]
        return self.data


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def iso_time(at: datetime) -> str:
    """``at.isoformat()``: the same text, for a UTC time (every event's, as ``utcnow`` makes it
    and ``Event.from_json`` reads it back) written by orjson, in a third of the instructions
    (~3.8k against ~11.6k, callgrind; every event written pays it)."""
    if at.tzinfo is timezone.utc:
        return orjson.dumps(at).decode()[1:-1]
    return at.isoformat()


@_value
class Event:
    """The one envelope of the log. ``payload`` is typed; ``kind`` is its string discriminator.

    ``(run_id, seq)`` is unique; ``seq`` counts 0, 1, 2... within a run. ``origin`` names who
    produced it (the root invocable, then the path below it); ``message_id`` groups the deltas and
    the completed message of one reply. Consumers must keep a default case: an unfamiliar kind
    parses as ``UnknownEvent``.
    """
    run_id: str
    seq: int
    payload: Payload
    origin: str = ""
    message_id: str | None = None
    at: datetime = field(default_factory=utcnow)

    @property
    def kind(self) -> str:
        return self.payload.kind

    def to_json(self, *, orjson_time: bool = False) -> dict[str, Any]:
        """The JSON form used by log rows and the native wire (a JSON-ready dict). With
        ``orjson_time``, a UTC ``at`` stays a datetime, which orjson writes as ``iso_time``
        would: the text of a row (``kit_store.event_row``) costs one orjson call, not two."""
        at = self.at
        return {"run_id": self.run_id, "seq": self.seq, "kind": self.payload.kind,
                "at": at if orjson_time and at.tzinfo is timezone.utc else iso_time(at),
                "origin": self.origin, "message_id": self.message_id,
                "payload": self.payload.to_json()}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Event:
        """Parse ``to_json`` output; an unknown kind gives an ``UnknownEvent`` payload, never
        raises for it. Raises ``CorruptEventError`` naming the run, seq, kind and field for what
        is not an event of its kind (a known kind's payload without a field it needs, or with
        one of the wrong shape; no run id, seq or kind)."""
        try:
            kind, data = obj["kind"], obj.get("payload")
            ptype = KINDS.get(kind)
            payload = ptype.from_json(data or {}) if ptype else UnknownEvent(kind, data)
            at = obj.get("at")
            return cls(obj["run_id"], int(obj["seq"]), payload, obj.get("origin") or "",
                       obj.get("message_id"), datetime.fromisoformat(at) if at else utcnow())
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            # Explained here, on the failure path: the valid path checks nothing more.
            raise unreadable(obj, exc) from None


def unreadable(obj: Any, exc: Exception) -> CorruptEventError:
    """Why ``obj`` is not an event ``Event.from_json`` can read (``exc``, what it raised)."""
    if not isinstance(obj, Mapping):
        return CorruptEventError(None, None, None, None,
                                 f"it is a JSON {type(obj).__name__}, not an object")
    run_id, seq, kind = obj.get("run_id"), obj.get("seq"), obj.get("kind")
    for name, value in (("run_id", run_id), ("seq", seq), ("kind", kind)):
        if value is None:
            return CorruptEventError(run_id, seq, kind, name, f"it has no {name}")
    envelope = _envelope_fault(obj)
    if envelope is not None:
        return CorruptEventError(run_id, seq, kind, *envelope)
    data, ptype = obj.get("payload") or {}, KINDS.get(kind)
    if ptype is None:
        return CorruptEventError(run_id, seq, kind, None,
                                 clipped(f"it is malformed ({type(exc).__name__}: {exc})"))
    if not isinstance(data, Mapping):
        return CorruptEventError(run_id, seq, kind, "payload",
                                 f"its payload is a JSON {type(data).__name__}, not an object")
    required = [f.name for f in fields(ptype) if f.default is f.default_factory is MISSING]
    for name in required:
        if name not in data:
            return CorruptEventError(run_id, seq, kind, name, f"its payload has no {name!r}")
    base = {n: data[n] for n in required}
    for name in ptype._fields:  # the first field that fails the payload's own parsing
        if name in data and name not in base:
            try:
                ptype.from_json({**base, name: data[name]})
            except (TypeError, KeyError, ValueError, AttributeError) as err:
                problem = f"its payload's {name!r} is malformed ({type(err).__name__}: {err})"
                return CorruptEventError(run_id, seq, kind, name, clipped(problem))
    return CorruptEventError(run_id, seq, kind, None,
                             clipped(f"it is malformed ({type(exc).__name__}: {exc})"))


def _envelope_fault(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(field, problem)`` for an event whose envelope (not its payload) is malformed."""
    try:
        int(obj["seq"])
    except (TypeError, ValueError):
        return "seq", "its seq is not an integer"
    at = obj.get("at")
    try:
        if at:
            datetime.fromisoformat(at)
    except (TypeError, ValueError):
        return "at", "its time is not an ISO 8601 time"
    if not isinstance(obj["kind"], str):
        return "kind", "its kind is not a string"
    return None


def fold_status(kinds: Iterable[str]) -> RunStatus | None:
    """The status after a sequence of event kinds (None if no kind sets one)."""
    status = None
    for k in kinds:
        p = KINDS.get(k)
        if p is not None and p.status is not None:
            status = p.status
    return status


def control_refusal(action: str, status: RunStatus) -> str | None:
    """Why a ``pause``, ``cancel`` or ``resume`` request cannot act on a run in ``status``, or
    None when it can (HTTP answers 409 with the reason, the CLI exits 1 with it)."""
    if status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        return f"the run is {status.value}: a finished run takes no {action} request"
    if action == "pause" and status is not RunStatus.RUNNING:
        instead = {RunStatus.WAITING_HUMAN: "answer or cancel it instead",  # no resume: not paused
                   RunStatus.SLEEPING: "a tick wakes it; cancel it instead"}
        return (f"the run is {status.value}: it is parked already "
                f"({instead.get(status, 'resume or cancel it instead')})")
    if action == "resume" and status is not RunStatus.PAUSED:
        return f"the run is {status.value}, not PAUSED: there is nothing to resume"
    return None


# ==================================================================================== results ====

@_value
class TurnResult:
    """What an agent turn returns, built from the run's own ``run.completed`` event."""
    output: Any
    usage: Usage
    run_id: str
    session_id: str | None = None


@_value
class InterruptResult:
    """A workflow run that parked on ``interrupt()`` (or ``sleep_until``).

    ``run_id`` is the parked run in the log (``deck.answer(result.run_id, value)``); None from a
    headless ``Workflow.run``, which has no log.
    """
    payload: Any
    thread_id: str
    type: str = "interrupt"
    run_id: str | None = None


@_value
class Pending:
    """A workflow run waiting for a human (``deck.pending()``), read off the log."""
    run_id: str
    workflow: str
    thread_id: str
    session_id: str | None
    payload: Any
    since: datetime
    namespace: str | None = None  # the tenant's whose run it is (``run(namespace=)``)


@_value
class Due:
    """A sleeping workflow thread whose wake time has passed (``deck.due_resumes()``).

    ``run_id`` is the parked run in the log the thread belongs to, or None if there is none.
    """
    workflow: str
    thread_id: str
    until: datetime
    run_id: str | None = None


@_value
class Ticked:
    """One thread ``deck.tick()`` resumed, and what its run returned."""
    workflow: str
    thread_id: str
    result: Any


@_value
class RunInfo:
    """One row of the store's run index (``EventStorePort.runs``). ``last_seq`` is the seq of
    the run's last event in the log (its end, for a run that ended; its parking event, for a
    parked one), kept by the index: a reader after the last event reads one row, not the log
    (None from a store that does not keep it)."""
    run_id: str
    name: str
    invocable: str
    session_id: str | None
    namespace: str | None
    status: RunStatus
    started_at: datetime
    parent_run_id: str | None = None
    last_seq: int | None = None


# ======================================================================================= runs ====

def aware(now: datetime | None) -> datetime:
    """``now`` (default: the current UTC time); raises ``ConfigError`` for a naive datetime."""
    if now is None:
        return utcnow()
    if not isinstance(now, datetime) or now.tzinfo is None or now.utcoffset() is None:
        raise ConfigError(f"now must be a timezone-aware datetime, got {quoted(now)}")
    return now


class NewRunId(str):
    """A run id made by ``new_run_id``: unique by construction (a clock in nanoseconds and 64
    random bits), so a run started with one is not first checked against the log the way a
    caller's own id is; its start rides in the run's first commit."""
    __slots__ = ()


def new_run_id() -> str:
    """A 32-hex-digit run id that sorts by creation time (like a UUIDv7), a ``NewRunId``.

    Time-ordered keys make the log's b-trees grow at their right edge: measured on this machine,
    one turn's commit costs ~68 us with them against ~102 us with random UUIDs. Pass one to
    ``Deck.run(run_id=)`` to know a run's id before it starts at no extra commit.
    """
    return NewRunId(f"{time.time_ns():016x}{os.urandom(8).hex()}")


class Context:
    """The per-run application context, delivered to a parameter annotated ``Context[...]``.

    ``ctx.data`` is the very object the caller passed as ``run(..., context=)`` (or None). It is
    handed over by reference and never written anywhere: not to the log, a session or a trace.
    """
    __slots__ = ("data",)

    def __init__(self, data: Any = None) -> None:
        self.data = data

    def __class_getitem__(cls, item: Any) -> Any:
        return types.GenericAlias(cls, item if isinstance(item, tuple) else (item,))

    def __repr__(self) -> str:  # never show the data: it may hold secrets
        return f"Context(data=<{type(self.data).__name__}>)"


@_value
class InvocableSpec:
    """The compiled form of an agent or workflow, produced by ``Deck.build()``.

    ``engine`` is the engine's compiled object (kit_agents' ``AgentEngine``, kit_workflows'
    ``WorkflowEngine``); ``source`` the catalog object it was compiled from.
    """
    name: str
    kind: str  # "agent" | "workflow"
    source: Any = field(repr=False, compare=False)
    engine: Any = field(default=None, repr=False, compare=False)


#: Error messages recorded in run.failed, and a tool's error text for the model and its
#: tool.completed (``clipped``), are cut to this length.
MAX_ERROR_CHARS = 2000


def clipped(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how many more were cut: a tool's error
    text, which the model reads and the log keeps, need not be the megabytes an exception
    may carry."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters cut)"


def stops() -> tuple[type[BaseException], ...]:
    """What stops a task or the process rather than failing a run: the backend's cancellation,
    ``KeyboardInterrupt`` and ``SystemExit``. Anything else a run raises is its failure, a
    user's ``BaseException`` too, recorded as ``run.failed`` and answered as one by the surfaces
    (``except stops(): raise`` before ``except BaseException``)."""
    import anyio  # (not at import: `import kit` stays light)
    return anyio.get_cancelled_exc_class(), KeyboardInterrupt, SystemExit
#: What a run handle hands its events to: ``deliver(handle, event)`` returns at once,
#: ``commit(handle, event)`` once the event (None: all the handle recorded) is durable (raising
#: what refused it).
Deliver = Callable[["RunHandle", Event], None]
Commit = Callable[["RunHandle", "Event | None"], Awaitable[None]]


class RunHandle:
    """How an engine plays one run: the only part of the Runtime an engine ever holds.

    The Runtime makes one per run and passes it to the engine, which records the run through it:
    ``emit`` hands on an ordinary event at once; ``durable`` returns once the event is committed
    (``tool.started`` before the tool runs; every end of a run), ``synced`` once all it recorded
    is (a session's items wait on it); ``add_usage`` sums tokens and cost for ``run.completed``;
    ``take_request`` reads a pause or cancel request at a safe point, and ``on_request`` (set by
    the engine) is told of one the moment it arrives; ``start_child`` (set by the Runtime) plays
    a workflow as a child run of this one (an agent's workflow tool), which a cancel of this run
    reaches too (``children``).

    Seqs are assigned here, in the engine's own order: ``run.started`` is seq 0. ``data`` is the
    caller's context object: handed to the engine's callables, never written anywhere.
    """

    def __init__(self, run_id: str, origin: str, data: Any, *, deliver: Deliver, commit: Commit,
                 pace: Callable[[], Awaitable[None]], session_id: str | None = None,
                 namespace: str | None = None, streaming: bool = False) -> None:
        self.run_id, self.origin, self.data = run_id, origin, data
        self.session_id, self.namespace, self.streaming = session_id, namespace, streaming
        self._deliver, self._commit, self._pace = deliver, commit, pace
        self.seq = 0
        self.ended = False  # a terminal or parking event is sequenced: this play is over
        self.abort_error: BaseException | None = None  # set by the Runtime: end as run.failed
        self.tool_errors: set[str] = set()  # call ids of tool calls that failed
        self.input_tokens = self.output_tokens = 0
        self.usd: float | None = 0.0
        self.requested: tuple[str, str | None, str | None] | None = None  # (action, reason, source)
        self.on_request: Callable[[str], Any] | None = None
        self.start_child: Callable[[RunHandle, str, dict[str, Any]], Awaitable[Any]] | None = None
        self.children: set[RunHandle] = set()  # the child runs its tools are playing now
        self.error: BaseException | None = None  # what made the run fail, for its caller
        self.closing = False  # the deck is closing: a cancellation is the deck's, not the caller's
        self.thread_id: str | None = None  # workflow runs: the thread id callers see,
        self.thread_key = ""  # ... and the checkpointer's key for it

    def message_id(self) -> str:
        """An id for the reply that starts at the next event: unique within the run."""
        return f"m{self.seq + 1}"

    def _event(self, payload: Payload, origin: str | None, message_id: str | None) -> Event:
        self.seq += 1
        if payload.ends is not None:
            self.ended = True
        return Event(self.run_id, self.seq, payload, origin or self.origin, message_id)

    def emit(self, payload: Payload, *, origin: str | None = None,
             message_id: str | None = None) -> Event:
        """Record an ordinary event; never waits. Returns the event."""
        event = self._event(payload, origin, message_id)
        self._deliver(self, event)
        return event

    async def durable(self, payload: Payload, *, origin: str | None = None) -> Event:
        """Record an event and wait until it is committed; raises what the store refused."""
        event = self._event(payload, origin, None)
        await self._commit(self, event)
        return event

    async def synced(self) -> None:
        """Wait until every event recorded so far is committed; raises what the store refused
        (``LogConflictError`` once another process reaped the run while this one stalled past
        its lease). What outlives the run beside its log, a session's items, waits on this."""
        await self._commit(self, None)

    async def pace(self) -> None:
        """Let other tasks run, and wait while the log is behind: a run never runs far ahead
        of what is committed (the writer's backlog is bounded). Engines call it between chunks."""
        await self._pace()

    def failure(self, exc: BaseException) -> RunFailed:
        """The ``run.failed`` payload that records ``exc``."""
        return RunFailed(type(exc).__name__, clipped(error_text(exc)))

    def ending(self) -> Payload | None:
        """What a run that was cancelled mid-play records as its end: ``run.failed`` when the
        Runtime aborted it (``abort_error``), else ``run.cancelled``; None when it has its end."""
        if self.ended:
            return None
        if self.abort_error is not None:
            return self.failure(self.abort_error)
        return RunCancelled("the deck closed" if self.closing else "the caller was cancelled")

    def add_usage(self, input_tokens: int, output_tokens: int, usd: float | None) -> None:
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.usd = None if usd is None or self.usd is None else self.usd + usd

    def usage(self) -> Usage:
        return Usage(self.input_tokens, self.output_tokens,
                     None if self.usd is None else round(self.usd, 10))

    def request(self, action: str, reason: str | None, source: str | None) -> None:
        """The Runtime's side: ask the run to ``pause`` or ``cancel`` at its next safe point.
        A cancel pending there stays: a later pause does not undo it (a parked run's first
        cancel wins too, ``RunControl._missed_requests``). A cancel reaches the child runs its
        tools are playing, which stop at their next safe point instead of playing on to their
        end; a pause does not (this run pauses once its tool has returned, and its resume gives
        the model the tool's output)."""
        if self.requested is not None and self.requested[0] == "cancel":
            return
        self.requested = (action, reason, source)
        if self.on_request is not None:
            self.on_request(action)
        if action == "cancel":
            for child in list(self.children):
                child.request(action, reason, source)

    def take_request(self) -> tuple[str, str | None, str | None] | None:
        """The engine's side, at a safe point: the pending request (consumed), or None."""
        requested, self.requested = self.requested, None
        return requested
