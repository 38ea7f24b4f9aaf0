"""kit: the public surface of the runtime (the names users type).

Owns: the errors, the content blocks, the event envelope and its payload types, the results, the
ports (``EventSinkPort``, ``EventStorePort``), the catalog objects (``Agent``, ``Workflow``,
``Skills``, ``MCP``), ``ScriptedModel`` and ``Deck``, the composition root.

Must never: do I/O at import, start tasks, open sockets or files, or read the environment at import.
It imports no sibling module at module level; ``Deck`` reaches ``kit_runtime`` only when it builds.
``Skills`` and ``MCP`` read their files when constructed (never at import); MCP servers start
only when a deck opens.

Theory of operation: a ``Deck`` holds a catalog. ``build()`` checks every name and compiles each
agent into an ``InvocableSpec``; ``async with deck`` opens a ``kit_runtime.Runtime`` over one event
store. Every turn becomes a *run* whose events (``Event`` envelopes with typed payloads) are appended
to the store's log in order; ``TurnResult`` is read back from the run's own ``run.completed`` event.
"""
from __future__ import annotations

import base64
import importlib.util
import os
import binascii
import enum
import itertools
import json
import re
import sys
import time
import types
import typing
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = (
    # errors
    "KitError", "ConfigError", "ContextTypeError", "ContentError", "DeckStateError",
    "UnknownNameError", "UnknownRunError", "RunNotWaitingError", "RunStoppedError",
    "SessionBusyError",
    "LogConflictError",
    # content
    "TextBlock", "ImageBlock", "AudioBlock", "ResourceBlock", "DataBlock", "ContentBlock",
    "MAX_INLINE_BYTES", "as_blocks", "block_to_json", "block_from_json",
    # events
    "Event", "RunStarted", "TextDelta", "MessageCompleted", "ModelCompleted", "ToolStarted",
    "ToolCompleted", "SkillLoaded", "NodeUpdated", "ControlRequested", "RunInterrupted",
    "RunSleeping", "RunPaused", "RunResumed", "RunCompleted", "RunFailed", "RunCancelled",
    "UnknownEvent", "Payload", "fold_status",
    # results
    "RunStatus", "Usage", "TurnResult", "InterruptResult", "RunInfo", "Pending", "Due", "Ticked",
    # ports
    "EventSinkPort", "EventStorePort", "Claim", "ControlRequest",
    # catalog
    "Agent", "Workflow", "Skills", "Skill", "MAX_SKILL_BYTES", "MCP", "MCP_TIMEOUT", "interrupt",
    "sleep_until", "Context", "InvocableSpec", "ScriptedModel", "Deck",
)


# ===================================================================================== errors ====

class KitError(Exception):
    """Root of every error kit raises on purpose."""


class ConfigError(KitError):
    """The catalog, a setting or a call's arguments are wrong: *your* configuration, fix it.

    Contrast with ``DeckStateError`` (the configuration is fine, the deck is in the wrong state)
    and ``ContentError`` (one piece of input is malformed).
    """


class ContextTypeError(ConfigError):
    """A callable requires a context type that the deck's declared ``context=`` cannot satisfy."""

    def __init__(self, site: str, required: object, provided: object) -> None:
        self.site, self.required, self.provided = site, required, provided
        super().__init__(f"{site} requires a context of type {_type_name(required)}, "
                         f"but the deck provides {_type_name(provided)}")


class ContentError(KitError, ValueError):
    """A content block is malformed (bad base64, too large, wrong media type, not JSON)."""


class DeckStateError(KitError):
    """The deck cannot do that in its current state (not open yet, or already closed).

    Contrast with ``ConfigError``: nothing is wrong with the catalog; the call came at the wrong
    time in the deck's lifecycle (SPEC 3.1). A closed deck stays closed: build a new one.
    """

    def __init__(self, state: str, action: str) -> None:
        self.state, self.action = state, action
        hint = "a closed deck cannot be reopened; build a new Deck" if state == "CLOSED" else \
            "open it first with `async with deck:`"
        super().__init__(f"cannot {action}: the deck is {state} ({hint})")


class UnknownNameError(KitError, LookupError):
    """No agent (or workflow) of that name in the deck's catalog."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name, self.known = name, sorted(known)
        super().__init__(f"no agent or workflow named {name!r}; known: {', '.join(self.known) or '(none)'}")


class SessionBusyError(KitError):
    """Another run holds this session: one turn per ``(namespace, session_id)`` at a time.

    The holder may be running in this process or another one, or parked (waiting for a human,
    sleeping, paused); the claim is freed when that run ends (DESIGN 4.5).
    """

    def __init__(self, session_id: str, run_id: str, namespace: str | None = None) -> None:
        self.session_id, self.run_id, self.namespace = session_id, run_id, namespace
        where = f" in namespace {namespace!r}" if namespace else ""
        super().__init__(f"session {session_id!r}{where} is busy: run {run_id} holds it")


class LogConflictError(KitError):
    """The log already holds an event at that ``(run_id, seq)``: another writer owns the run.

    Raised instead of interleaving two writers' events; the run id may also be reused by mistake.
    """

    def __init__(self, run_id: str, seq: int) -> None:
        self.run_id, self.seq = run_id, seq
        super().__init__(f"run {run_id} already has an event at seq {seq}: another writer owns "
                         "this run, or the run id was reused")


class UnknownRunError(KitError, LookupError):
    """The log has no run with that id."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"the log has no run {run_id!r}")


class RunNotWaitingError(KitError):
    """The run is not waiting for what was asked of it: an interrupt is answered once.

    Contrast with ``UnknownRunError``: the run exists, but it is not (or no longer) in the state
    the call needs, typically because another caller answered or resumed it first.
    """

    def __init__(self, run_id: str, status: object, wanted: str) -> None:
        self.run_id, self.status, self.wanted = run_id, status, wanted
        super().__init__(f"run {run_id} is {getattr(status, 'value', status)}, not {wanted}: "
                         "it was answered or resumed already, or it never waited")


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


def _type_name(t: object) -> str:
    return t.__qualname__ if isinstance(t, type) else repr(t)


# ==================================================================================== content ====

#: Inline data (image, audio, data blocks) is capped because its base64 sits in the log forever.
#: Larger content goes in a ``ResourceBlock`` that references it (SPEC 8).
MAX_INLINE_BYTES = 1_000_000
_MEDIA_TYPE = re.compile(r"^[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*$")


def _check_media_type(block: str, media_type: object, family: str | None) -> None:
    if not isinstance(media_type, str) or not _MEDIA_TYPE.match(media_type):
        raise ContentError(f"{block}.media_type must look like 'type/subtype', got {media_type!r}")
    if family and not media_type.startswith(family + "/"):
        raise ContentError(f"{block}.media_type must be {family}/*, got {media_type!r}")


def _check_b64(block: str, data_b64: object) -> None:
    if not isinstance(data_b64, str):
        raise ContentError(f"{block}.data_b64 must be a base64 str, got {type(data_b64).__name__}")
    # Cheap bound before decoding anything huge: 4 base64 chars carry 3 bytes.
    if len(data_b64) > (MAX_INLINE_BYTES + 2) // 3 * 4:
        raise ContentError(f"{block} carries more than {MAX_INLINE_BYTES} bytes inline; "
                           "use a ResourceBlock for larger content")
    try:
        size = len(base64.b64decode(data_b64, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise ContentError(f"{block}.data_b64 is not valid base64: {exc}") from None
    if size > MAX_INLINE_BYTES:
        raise ContentError(f"{block} carries {size} bytes inline, more than {MAX_INLINE_BYTES}; "
                           "use a ResourceBlock for larger content")


@dataclass(frozen=True, slots=True)
class TextBlock:
    """Plain text. A ``str`` agent input becomes one of these."""
    text: str
    type: ClassVar[str] = "text"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ContentError(f"TextBlock.text must be str, got {type(self.text).__name__}")


@dataclass(frozen=True, slots=True)
class _InlineBlock:
    """Bytes carried in the block: ``media_type`` of the block's family and strict base64."""
    media_type: str
    data_b64: str
    type: ClassVar[str]

    def __post_init__(self) -> None:
        _check_media_type(type(self).__name__, self.media_type, self.type)
        _check_b64(type(self).__name__, self.data_b64)


class ImageBlock(_InlineBlock):
    """An inline image: ``media_type`` (image/*) and strict base64 ``data_b64`` (<= 1 MB decoded)."""
    __slots__ = ()
    type: ClassVar[str] = "image"


class AudioBlock(_InlineBlock):
    """Inline audio: ``media_type`` (audio/*) and strict base64 ``data_b64`` (<= 1 MB decoded).

    The agents engine sends audio only on the chat-completions path (``KIT_OPENAI_API``).
    """
    __slots__ = ()
    type: ClassVar[str] = "audio"


@dataclass(frozen=True, slots=True)
class ResourceBlock:
    """A reference to bytes kept elsewhere (``uri``); recorded, not sent to the agents engine."""
    uri: str
    media_type: str
    type: ClassVar[str] = "resource"

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or not self.uri:
            raise ContentError(f"ResourceBlock.uri must be a non-empty str, got {self.uri!r}")
        _check_media_type("ResourceBlock", self.media_type, None)


@dataclass(frozen=True, slots=True)
class DataBlock:
    """JSON data (<= 1 MB encoded); recorded, not sent to the agents engine."""
    data: Any
    type: ClassVar[str] = "data"

    def __post_init__(self) -> None:
        try:
            size = len(json.dumps(self.data, allow_nan=False, separators=(",", ":")))
        except (TypeError, ValueError) as exc:
            raise ContentError(f"DataBlock.data must be JSON data: {exc}") from None
        if size > MAX_INLINE_BYTES:
            raise ContentError(f"DataBlock carries {size} bytes of JSON, more than "
                               f"{MAX_INLINE_BYTES}; use a ResourceBlock for larger content")


ContentBlock = TextBlock | ImageBlock | AudioBlock | ResourceBlock | DataBlock
_BLOCKS: dict[str, type] = {c.type: c for c in (TextBlock, ImageBlock, AudioBlock, ResourceBlock, DataBlock)}


_BLOCK_TYPES = tuple(_BLOCKS.values())
_BLOCK_FIELDS = {c: tuple(f.name for f in fields(c)) for c in _BLOCK_TYPES}


def block_to_json(block: ContentBlock) -> dict[str, Any]:
    """The JSON form of a block: ``{"type": ..., <fields>}``."""
    out = {"type": block.type}
    for name in _BLOCK_FIELDS[type(block)]:
        out[name] = getattr(block, name)
    return out


def block_from_json(obj: Mapping[str, Any]) -> ContentBlock:
    """Parse ``{"type": ..., ...}`` into a block; raises ``ContentError`` naming what is wrong."""
    if not isinstance(obj, Mapping):
        raise ContentError(f"a content block must be an object, got {type(obj).__name__}")
    cls = _BLOCKS.get(obj.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ContentError(f"unknown content block type {obj.get('type')!r}; "
                           f"expected one of {', '.join(_BLOCKS)}")
    names = _BLOCK_FIELDS[cls]
    missing = [n for n in names if n not in obj]
    if missing:
        raise ContentError(f"{cls.__name__} is missing {', '.join(missing)}")
    return cls(**{n: obj[n] for n in names})


def as_blocks(value: str | ContentBlock | Iterable[ContentBlock]) -> tuple[ContentBlock, ...]:
    """Coerce agent input: a ``str`` is one ``TextBlock``; otherwise every item must be a block."""
    if isinstance(value, str):
        return (TextBlock(value),)
    if isinstance(value, _BLOCK_TYPES):
        return (value,)  # type: ignore[return-value]
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise ContentError(f"agent input must be a str or a list of content blocks, "
                           f"got {type(value).__name__}")
    blocks = tuple(value)
    for i, b in enumerate(blocks):
        if not isinstance(b, _BLOCK_TYPES):
            raise ContentError(f"agent input item {i} is a {type(b).__name__}, not a content block")
    if not blocks:
        raise ContentError("agent input is empty")
    return blocks


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


@dataclass(frozen=True, slots=True)
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
        return {n: _jsonable(getattr(self, n)) for n in self._fields}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Payload:
        return cls(**{n: obj[n] for n in cls._fields if n in obj})


def _jsonable(v: Any) -> Any:
    if v is None or type(v) in (str, int, float, bool):
        return v
    if isinstance(v, enum.Enum):
        return _jsonable(v.value)
    if isinstance(v, (str, int, float)):
        return v
    if isinstance(v, Usage):
        return v.to_json()
    if isinstance(v, _BLOCK_TYPES):
        return block_to_json(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, datetime):
        return v.isoformat()
    dump = getattr(v, "model_dump", None)  # pydantic models (structured outputs)
    if callable(dump):
        return dump(mode="json")
    return str(v)


def _payload(kind: str, *, ends: str | None = None, status: RunStatus | None = None):
    def wrap(cls):
        cls.kind, cls.ends, cls.status = kind, ends, status
        cls._fields = tuple(f.name for f in fields(cls))
        _KINDS[kind] = cls
        return cls
    return wrap


_KINDS: dict[str, type[Payload]] = {}


@_payload("run.started", status=RunStatus.RUNNING)
@dataclass(frozen=True, slots=True)
class RunStarted(Payload):
    name: str
    invocable: str  # "agent" | "workflow"
    session_id: str | None = None
    namespace: str | None = None
    input: tuple[ContentBlock, ...] = ()
    parent_run_id: str | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RunStarted:
        return cls(obj["name"], obj["invocable"], obj.get("session_id"), obj.get("namespace"),
                   tuple(block_from_json(b) for b in obj.get("input") or ()), obj.get("parent_run_id"))


@_payload("text.delta")
@dataclass(frozen=True, slots=True)
class TextDelta(Payload):
    text: str


@_payload("message.completed")
@dataclass(frozen=True, slots=True)
class MessageCompleted(Payload):
    text: str
    output: Any = None  # the structured output, when the agent declares an output_type
    agent: str | None = None


@_payload("model.completed")
@dataclass(frozen=True, slots=True)
class ModelCompleted(Payload):
    model: str
    input_tokens: int = 0
    output_tokens: int = 0
    usd: float | None = None


@_payload("tool.started")
@dataclass(frozen=True, slots=True)
class ToolStarted(Payload):
    call_id: str
    tool: str
    arguments: str = ""


@_payload("tool.completed")
@dataclass(frozen=True, slots=True)
class ToolCompleted(Payload):
    call_id: str
    tool: str
    output: Any = None
    is_error: bool = False


@_payload("skill.loaded")
@dataclass(frozen=True, slots=True)
class SkillLoaded(Payload):
    name: str
    sha256: str


@_payload("node.updated")
@dataclass(frozen=True, slots=True)
class NodeUpdated(Payload):
    node: str
    update: Any = None


@_payload("control.requested")
@dataclass(frozen=True, slots=True)
class ControlRequested(Payload):
    action: str  # pause | cancel | resume
    reason: str | None = None
    source: str | None = None


@_payload("run.interrupted", ends="parking", status=RunStatus.WAITING_HUMAN)
@dataclass(frozen=True, slots=True)
class RunInterrupted(Payload):
    interrupt_id: str
    payload: Any = None
    thread_id: str | None = None


@_payload("run.sleeping", ends="parking", status=RunStatus.SLEEPING)
@dataclass(frozen=True, slots=True)
class RunSleeping(Payload):
    until: str
    thread_id: str | None = None
    interrupt_id: str | None = None


@_payload("run.paused", ends="parking", status=RunStatus.PAUSED)
@dataclass(frozen=True, slots=True)
class RunPaused(Payload):
    reason: str | None = None
    items: Any = None  # a sessionless agent run's conversation so far, to resume from


@_payload("run.resumed", status=RunStatus.RUNNING)
@dataclass(frozen=True, slots=True)
class RunResumed(Payload):
    by: str  # answer | resume | tick


@_payload("run.completed", ends="terminal", status=RunStatus.COMPLETED)
@dataclass(frozen=True, slots=True)
class RunCompleted(Payload):
    output: Any = None
    usage: Usage = field(default_factory=Usage)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RunCompleted:
        return cls(obj.get("output"), Usage.from_json(obj.get("usage")))


@_payload("run.failed", ends="terminal", status=RunStatus.FAILED)
@dataclass(frozen=True, slots=True)
class RunFailed(Payload):
    error: str  # the exception's type name
    message: str = ""


@_payload("run.cancelled", ends="terminal", status=RunStatus.CANCELLED)
@dataclass(frozen=True, slots=True)
class RunCancelled(Payload):
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class UnknownEvent(Payload):
    """The payload of a kind this version does not know; ``data`` is the raw JSON payload."""
    kind: str  # type: ignore[misc]
    data: Any = None

    def to_json(self) -> dict[str, Any]:
        return self.data if isinstance(self.data, dict) else {"data": self.data}


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True, slots=True)
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
    at: datetime = field(default_factory=_utcnow)

    @property
    def kind(self) -> str:
        return self.payload.kind

    def to_json(self) -> dict[str, Any]:
        """The JSON form used by log rows and the native wire (a JSON-ready dict)."""
        return {"run_id": self.run_id, "seq": self.seq, "kind": self.payload.kind,
                "at": self.at.isoformat(), "origin": self.origin, "message_id": self.message_id,
                "payload": self.payload.to_json()}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Event:
        """Parse ``to_json`` output; an unknown kind gives an ``UnknownEvent`` payload, never raises."""
        kind, data = obj["kind"], obj.get("payload")
        ptype = _KINDS.get(kind)
        payload = ptype.from_json(data or {}) if ptype else UnknownEvent(kind, data)
        at = obj.get("at")
        return cls(obj["run_id"], int(obj["seq"]), payload, obj.get("origin") or "",
                   obj.get("message_id"), datetime.fromisoformat(at) if at else _utcnow())


def fold_status(kinds: Iterable[str]) -> RunStatus | None:
    """The status after a sequence of event kinds (None if no kind sets one)."""
    status = None
    for k in kinds:
        p = _KINDS.get(k)
        if p is not None and p.status is not None:
            status = p.status
    return status


# ==================================================================================== results ====

@dataclass(frozen=True, slots=True)
class TurnResult:
    """What an agent turn returns, built from the run's own ``run.completed`` event."""
    output: Any
    usage: Usage
    run_id: str
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class InterruptResult:
    """A workflow run that parked on ``interrupt()``."""
    payload: Any
    thread_id: str
    type: str = "interrupt"


@dataclass(frozen=True, slots=True)
class Pending:
    """A workflow run waiting for a human (``deck.pending()``), read off the log."""
    run_id: str
    workflow: str
    thread_id: str
    session_id: str | None
    payload: Any
    since: datetime


@dataclass(frozen=True, slots=True)
class Due:
    """A sleeping workflow thread whose wake time has passed (``deck.due_resumes()``).

    ``run_id`` is the parked run in the log the thread belongs to, or None if there is none.
    """
    workflow: str
    thread_id: str
    until: datetime
    run_id: str | None = None


@dataclass(frozen=True, slots=True)
class Ticked:
    """One thread ``deck.tick()`` resumed, and what its run returned."""
    workflow: str
    thread_id: str
    result: Any


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One row of the store's run index (``EventStorePort.runs``)."""
    run_id: str
    name: str
    invocable: str
    session_id: str | None
    namespace: str | None
    status: RunStatus
    started_at: datetime
    parent_run_id: str | None = None


# ====================================================================================== ports ====

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

    Optional methods, called when present: ``start()`` once at deck open (raising refuses the
    open) and ``close()`` when the stream has ended (flush buffers there).
    """

    def emit(self, event: Event) -> None: ...


@runtime_checkable
class EventStorePort(Protocol):
    """The one way to the log: the Runtime writes through it, users read the full log through it.

    ``append`` is atomic per batch and durable when it returns. With ``claims`` it also takes those
    runs' leases (and session claims) in the same transaction, raising ``SessionBusyError`` and
    writing nothing when another live or parked run holds the session. A terminal event frees the
    claim; a parking event keeps it without a lease. ``follow`` replays, then yields live events,
    until the run's terminal or parking event.
    """

    async def append(self, events: Sequence[Event], *, claims: Sequence[Claim] = ()) -> None: ...
    async def read(self, run_id: str, after: int = -1) -> list[Event]: ...
    def follow(self, run_id: str, after: int = -1) -> AsyncIterator[Event]: ...
    async def runs(self, *, status: RunStatus | None = None, name: str | None = None,
                   session_id: str | None = None) -> list[RunInfo]: ...
    async def run_info(self, run_id: str) -> RunInfo | None: ...
    async def renew(self, owner: str, lease_seconds: float) -> None: ...
    async def reap(self) -> list[str]: ...
    async def request(self, run_id: str, action: str, reason: str | None = None,
                      source: str | None = None) -> int: ...
    async def requests(self, after: int = 0) -> list[ControlRequest]: ...


# ==================================================================================== catalog ====

import agents as _sdk  # noqa: E402  (the agents engine; imported here, next to what needs it)
from openai.types.responses import (  # noqa: E402
    Response, ResponseCompletedEvent, ResponseContentPartAddedEvent, ResponseContentPartDoneEvent,
    ResponseCreatedEvent, ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent, ResponseFunctionToolCall, ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent, ResponseOutputMessage, ResponseOutputText, ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)
from openai.types.responses.response_usage import (  # noqa: E402
    InputTokensDetails, OutputTokensDetails, ResponseUsage,
)

_SDK_TOOLS = tuple(typing.get_origin(t) or t for t in typing.get_args(_sdk.Tool))
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{what} name must be 1-128 characters of letters, digits, '_', '.' or '-' "
                          f"starting with a letter or digit (it appears in URLs), got {name!r}")
    return name


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


class Agent:
    """A conversational agent, played by the openai-agents engine.

    ``instructions`` is text or a callable ``(ctx: Context, agent) -> str`` (sync or async).
    ``tools`` are plain functions (kit builds their schema; a ``Context[...]`` parameter is hidden
    from the model and injected) or SDK tool objects (passed through as built). ``hooks`` is an
    object with any of the SDK's agent hook methods (``on_start``, ``on_end``, ``on_llm_start``,
    ``on_llm_end``, ``on_tool_start``, ``on_tool_end``, ``on_handoff``); each receives a
    ``Context`` in place of the SDK's context argument. ``model`` is a model name (resolved by the
    SDK; ``KIT_MODEL`` is the default) or an ``agents.Model`` instance such as ``ScriptedModel``.
    ``skills``, ``mcp_servers`` and ``workflows`` are names resolved against the deck at ``build()``.

    Raises ``ConfigError`` for a malformed name, a non-callable tool or a bad model.
    """

    def __init__(self, name: str, instructions: str | Callable[..., Any] | None = None,
                 tools: Sequence[Any] = (), hooks: Any = None, *, model: str | Any = None,
                 model_settings: Any = None, output_type: type | None = None,
                 skills: Sequence[str] = (), mcp_servers: Sequence[str] = (),
                 workflows: Sequence[str] = ()) -> None:
        self.name = _check_name("agent", name)
        if instructions is not None and not isinstance(instructions, str) and not callable(instructions):
            raise ConfigError(f"agent {name!r}: instructions must be a str or a callable, "
                              f"got {type(instructions).__name__}")
        for t in tools:
            if not isinstance(t, _SDK_TOOLS) and not callable(t):
                raise ConfigError(f"agent {name!r}: tool {t!r} is neither a function nor an SDK tool")
        if model is not None and not isinstance(model, (str, _sdk.Model)):
            raise ConfigError(f"agent {name!r}: model must be a model name or an agents.Model, "
                              f"got {type(model).__name__}")
        self.instructions, self.tools, self.hooks = instructions, tuple(tools), hooks
        self.model, self.model_settings, self.output_type = model, model_settings, output_type
        self.skills, self.mcp_servers = tuple(skills), tuple(mcp_servers)
        self.workflows = tuple(workflows)
        self._headless: Any = None

    def __repr__(self) -> str:
        return f"Agent({self.name!r})"

    async def run(self, input: str | Sequence[ContentBlock], *, session: Any = None,
                  max_turns: int | None = None) -> Any:
        """Play one turn headless: no deck, no log, no observers; returns the SDK's ``RunResult``.

        Tools that declare a ``Context[...]`` refuse when called (the run carries no context).
        Works under asyncio and trio (trio plays it on a temporary asyncio thread).
        """
        import kit_runtime
        return await kit_runtime.run_headless(self, input, session=session, max_turns=max_turns)


class Workflow:
    """A graph workflow, played by LangGraph: ``graph`` is an uncompiled ``StateGraph``.

    kit compiles it with the workflow's own checkpointer: a durable workflow (``durable=True``,
    or the class attribute ``durable`` of a subclass) keeps its checkpoints in the store's SQLite
    file, so a thread survives the process; otherwise they are in memory. A durable workflow's
    runs need a ``session_id``, which is the LangGraph thread id. Nodes may call
    ``kit.interrupt(payload)`` to wait for a human and ``kit.sleep_until(when)`` to sleep.

    ``run``, ``resume`` and ``as_tool`` are headless: no deck, no log, no observers; they use a
    private in-memory checkpointer kept by this object. Raises ``ConfigError`` for a bad name or
    a graph that is not an uncompiled ``StateGraph``.
    """
    durable: bool = False

    def __init__(self, name: str, graph: Any, *, durable: bool | None = None) -> None:
        from langgraph.graph import StateGraph
        self.name = _check_name("workflow", name)
        if not isinstance(graph, StateGraph):
            raise ConfigError(f"workflow {name!r}: graph must be an uncompiled langgraph StateGraph, "
                              f"got {type(graph).__name__}")
        self.graph = graph
        if durable is not None:
            self.durable = bool(durable)
        self._headless: Any = None

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, durable={self.durable})"

    async def run(self, input: Mapping[str, Any], *, thread_id: str | None = None) -> Any:
        """Play the graph headless; the final state, or an ``InterruptResult`` if it parked."""
        import kit_runtime
        return await kit_runtime.workflow_headless(self, input, thread_id)

    async def resume(self, thread_id: str, value: Any) -> Any:
        """Answer the thread's pending interrupt headless; final state or the next interrupt."""
        import kit_runtime
        return await kit_runtime.workflow_headless(self, None, thread_id, resume=value)

    def as_tool(self, *, description: str | None = None) -> Any:
        """An SDK ``FunctionTool`` that plays this workflow headless on the model's input."""
        import kit_runtime
        return kit_runtime.workflow_tool(self, description, child_runs=False)


#: SKILL.md limits of the Agent Skills spec (agentskills.io; notes/CONVENTIONS.md B2).
_SKILL_NAME = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_SKILL_NAME_MAX, _SKILL_DESCRIPTION_MAX, _SKILL_COMPATIBILITY_MAX = 64, 1024, 500
#: A SKILL.md is read whole and served to a model in one tool result; the spec recommends a body
#: under 5,000 tokens, so a file this large is a mistake, not a skill.
MAX_SKILL_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Skill:
    """One skill of a ``Skills`` catalog: its ``SKILL.md`` front matter and Markdown body.

    Prose for a model to read, served by an agent's ``load_skill`` tool; never executed.
    """
    name: str
    description: str
    path: Path  # the SKILL.md file
    body: str = field(repr=False)


class Skills(Mapping):
    """A skill catalog (name -> ``Skill``) read from ``SKILL.md`` files.

    ``paths`` is one path or a sequence of them; each is a skill directory (holding
    ``SKILL.md``) or a directory of skill directories (``<path>/*/SKILL.md``). Each ``SKILL.md``
    opens with YAML front matter between ``---`` lines: ``name`` (1-64 characters of lowercase
    letters, digits and single hyphens, not at either end, equal to the directory's name) and
    ``description`` (1-1024 characters: what the skill does and when to use it); the Markdown
    after it is the body ``load_skill`` serves. Files are read here, once.

    Raises ``ConfigError`` naming the file for a missing or malformed front matter, a bad name
    or description, a file over ``MAX_SKILL_BYTES``, or two skills of the same name; and for a
    path that is not a directory.
    """

    def __init__(self, paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] = ()) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self._skills: dict[str, Skill] = {}
        for p in paths:
            root = Path(p)
            if (root / "SKILL.md").is_file():
                files = [root / "SKILL.md"]
            elif root.is_dir():
                files = sorted(root.glob("*/SKILL.md"))
            else:
                raise ConfigError(f"no skills at {str(root)!r}: expected a skill directory (with "
                                  "SKILL.md) or a directory of them")
            for file in files:
                skill = _read_skill(file)
                if skill.name in self._skills:
                    raise ConfigError(f"two skills are named {skill.name!r}: "
                                      f"{self._skills[skill.name].path} and {file}")
                self._skills[skill.name] = skill

    def __getitem__(self, name: str) -> Skill:
        return self._skills[name]

    def __iter__(self) -> typing.Iterator[str]:
        return iter(self._skills)

    def __len__(self) -> int:
        return len(self._skills)

    def __repr__(self) -> str:
        return f"Skills({list(self._skills)})"


def _read_skill(file: Path) -> Skill:
    """Parse and validate one ``SKILL.md`` (safe YAML front matter, then the body)."""
    import yaml
    try:
        if file.stat().st_size > MAX_SKILL_BYTES:
            raise ConfigError(f"{file} is larger than {MAX_SKILL_BYTES} bytes; keep SKILL.md short "
                              "and put long material in files it references")
        text = file.read_text(encoding="utf-8").removeprefix("\ufeff")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file} cannot be read: {exc}") from None
    lines = text.splitlines(keepends=True)
    end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None) \
        if lines and lines[0].strip() == "---" else None
    if end is None:
        raise ConfigError(f"{file} must open with YAML front matter between '---' lines "
                          "(name and description)")
    try:
        meta = yaml.safe_load("".join(lines[1:end]))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: the front matter is not valid YAML: {exc}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{file}: the front matter must be a mapping with name and description")
    name, description = meta.get("name"), meta.get("description")
    if not isinstance(name, str) or not 1 <= len(name) <= _SKILL_NAME_MAX \
            or not _SKILL_NAME.match(name):
        raise ConfigError(f"{file}: name must be 1-{_SKILL_NAME_MAX} characters of lowercase "
                          "letters, digits and single hyphens, not starting or ending with one; "
                          f"got {name!r}")
    if name != file.parent.name:
        raise ConfigError(f"{file}: name {name!r} must equal its directory's name "
                          f"{file.parent.name!r}")
    if not isinstance(description, str) or not description.strip() \
            or len(description) > _SKILL_DESCRIPTION_MAX:
        raise ConfigError(f"{file}: description is required: 1-{_SKILL_DESCRIPTION_MAX} characters "
                          "saying what the skill does and when to use it")
    compatibility = meta.get("compatibility")
    if compatibility is not None and (not isinstance(compatibility, str)
                                      or len(compatibility) > _SKILL_COMPATIBILITY_MAX):
        raise ConfigError(f"{file}: compatibility must be text of at most "
                          f"{_SKILL_COMPATIBILITY_MAX} characters")
    metadata = meta.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ConfigError(f"{file}: metadata must map strings to strings")
    return Skill(name, description.strip(), file, "".join(lines[end + 1:]).strip())


#: The per-request read timeout of an MCP server (seconds) unless its config says ``timeout``.
#: The SDK's own default, 5 s, fails ordinary slow tools (notes/ENGINES.md 7).
MCP_TIMEOUT = 30.0
_MCP_KINDS = {"stdio": "stdio", "http": "http", "streamable-http": "http",
              "streamableHttp": "http", "sse": "sse"}
_VAR = re.compile(r"\$\{([^}]*)\}")
_VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class MCP:
    """External tool servers (MCP): a ``.mcp.json`` file's path, or its content as a mapping.

    The formats of Claude Code and Cursor (top-level ``mcpServers``) and VS Code (``servers``)
    are read, or a mapping of server name -> config. A server with ``command`` (``args``,
    ``env``, ``cwd``) is stdio; with ``url`` (``headers``) streamable HTTP; SSE only when
    ``"type": "sse"``. ``${VAR}``, ``${env:VAR}`` and ``${VAR:-default}`` are expanded from the
    environment in command, args, env, url and headers, here, once. ``timeout`` (seconds,
    default ``MCP_TIMEOUT``) bounds each request to the server. A stdio server with ``env``
    gets the process environment plus those keys; without, the SDK's minimal one (HOME, PATH,
    ...). An agent's tools from server ``time`` are named ``mcp_time__<tool>``.

    Nothing starts here or at ``build()``: opening the deck connects every server, closing it
    tears them down. Raises ``ConfigError`` for an unreadable file, a malformed config, an
    unknown ``type``, a variable that is unset and has no default, or ``${input:...}``.
    """

    def __init__(self, config: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        if isinstance(config, (str, os.PathLike)):
            self.source = str(config)
            try:
                data = json.loads(Path(config).read_text(encoding="utf-8"))
            except OSError as exc:
                raise ConfigError(f"cannot read MCP config {self.source}: {exc}") from None
            except ValueError as exc:
                raise ConfigError(f"MCP config {self.source} is not valid JSON: {exc}") from None
        elif isinstance(config, Mapping):
            self.source, data = "MCP(...)", config
        else:
            raise ConfigError(f"MCP(...) takes a path to a .mcp.json or a mapping, "
                              f"got {type(config).__name__}")
        if not isinstance(data, Mapping):
            raise ConfigError(f"{self.source}: an MCP config is a JSON object")
        if "mcpServers" in data and "servers" in data:
            raise ConfigError(f"{self.source} has both 'mcpServers' and 'servers'; keep one")
        servers = data.get("mcpServers", data.get("servers", data))
        if not isinstance(servers, Mapping):
            raise ConfigError(f"{self.source}: the servers must be an object of name -> config")
        self.servers: Mapping[str, Mapping[str, Any]] = types.MappingProxyType({
            _check_name("MCP server", n): _mcp_server(self.source, n, s)
            for n, s in servers.items()})

    def __repr__(self) -> str:
        return f"MCP({list(self.servers)})"

    def _sdk_servers(self) -> dict[str, Any]:
        """One unconnected SDK server object per configured server (``Deck.build``)."""
        from agents.mcp import MCPServerSse, MCPServerStdio, MCPServerStreamableHttp
        out: dict[str, Any] = {}
        for name, s in self.servers.items():
            kw = {"name": name, "client_session_timeout_seconds": s["timeout"]}
            if s["type"] == "stdio":
                params: dict[str, Any] = {"command": s["command"], "args": list(s["args"])}
                if s["env"] is not None:  # the child inherits nothing unless given env
                    params["env"] = {**os.environ, **s["env"]}
                if s["cwd"] is not None:
                    params["cwd"] = s["cwd"]
                out[name] = MCPServerStdio(params=params, **kw)  # type: ignore[arg-type]
            else:
                cls = MCPServerSse if s["type"] == "sse" else MCPServerStreamableHttp
                out[name] = cls(params={"url": s["url"], "headers": dict(s["headers"]),
                                        "timeout": s["timeout"]}, **kw)  # type: ignore[arg-type]
        return out


def _expand(source: str, value: Any) -> Any:
    """``${VAR}``, ``${env:VAR}`` and ``${VAR:-default}`` (default when unset or empty)."""
    if isinstance(value, list):
        return [_expand(source, v) for v in value]
    if isinstance(value, dict):
        return {k: _expand(source, v) for k, v in value.items()}
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        expr = m.group(1).removeprefix("env:")
        if expr.startswith("input:"):
            raise ConfigError(f"{source}: {m.group(0)} asks for user input, which a server cannot "
                              "prompt for; use an environment variable")
        name, has_default, default = expr.partition(":-")
        if not _VAR_NAME.match(name):
            raise ConfigError(f"{source}: {m.group(0)} is not a variable reference")
        found = os.environ.get(name)
        if has_default:
            return found or default
        if found is None:
            raise ConfigError(f"{source}: environment variable {name} is not set and "
                              f"{m.group(0)} has no default (write ${{{name}:-default}})")
        return found

    return _VAR.sub(sub, value)


def _mcp_server(source: str, name: str, raw: Any) -> dict[str, Any]:
    where = f"{source}: MCP server {name!r}"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be an object")
    kind = raw.get("type") or ("stdio" if "command" in raw else "http" if "url" in raw else None)
    if kind is None:
        raise ConfigError(f"{where} needs a 'command' (stdio) or a 'url' (HTTP)")
    if kind not in _MCP_KINDS:
        raise ConfigError(f"{where} has unknown type {kind!r}; expected stdio, http or sse")
    timeout = raw.get("timeout", MCP_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"{where}: timeout must be a positive number of seconds, got {timeout!r}")
    out: dict[str, Any] = {"type": _MCP_KINDS[kind], "timeout": float(timeout)}

    def strings(key: str, shape: type) -> Any:
        value = raw.get(key)
        ok = (isinstance(value, list) and all(isinstance(v, str) for v in value)) if shape is list \
            else (isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in value.items()))
        if value is not None and not ok:
            raise ConfigError(f"{where}: {key} must be "
                              f"{'a list of strings' if shape is list else 'an object of strings'}")
        return None if value is None else _expand(where, value)

    if out["type"] == "stdio":
        command = raw.get("command")
        if not isinstance(command, str) or not command:
            raise ConfigError(f"{where}: a stdio server needs a 'command' string")
        cwd = raw.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise ConfigError(f"{where}: cwd must be a string")
        out.update(command=_expand(where, command), args=strings("args", list) or [],
                   env=strings("env", dict), cwd=cwd)
    else:
        url = raw.get("url")
        url = _expand(where, url) if isinstance(url, str) else url
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}: an {out['type']} server needs an http(s) 'url', got {url!r}")
        out.update(url=url, headers=strings("headers", dict) or {})
    return out


def interrupt(payload: Any) -> Any:
    """Inside a workflow node: park the run until a human answers; returns the answer.

    The node runs again from its first line when answered, so keep side effects after this call
    (or idempotent). Outside a workflow node LangGraph raises its own error.
    """
    from langgraph.types import interrupt as lg_interrupt
    return lg_interrupt(payload)


def sleep_until(when: datetime) -> Any:
    """Inside a durable workflow node: park the thread until ``when`` (timezone-aware).

    ``deck.tick()`` wakes it once that time has passed; returns ``{"woke_at": <iso time>}``. The
    node re-runs on wake, so compute ``when`` once (in state, or in an earlier node), never as
    ``now() + delta`` inside this node. Raises ``ConfigError`` for a naive datetime.
    """
    if not isinstance(when, datetime) or when.tzinfo is None or when.utcoffset() is None:
        raise ConfigError(f"sleep_until needs a timezone-aware datetime, got {when!r}")
    return interrupt({"kind": "sleep", "until": when.astimezone(timezone.utc).isoformat()})


@dataclass(frozen=True, slots=True)
class InvocableSpec:
    """The compiled form of an agent or workflow, produced by ``Deck.build()``."""
    name: str
    kind: str  # "agent" | "workflow"
    source: Any = field(repr=False, compare=False)
    engine: Any = field(default=None, repr=False, compare=False)


def _tokens(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+$", text) or ([text] if text else [])


class ScriptedModel(_sdk.Model):
    """A deterministic, offline ``agents.Model`` for tests, benchmarks and demos.

    ``script`` is a list of turns, one per model call: a ``str`` is a text reply (streamed one
    token, a word with its leading space, per delta); ``{"tool": name, "args": {...}}`` (or a list
    of them) calls tools; ``{"json": obj}`` replies with structured output; an exception instance
    is raised. With ``cycle=True`` the script repeats forever. Usage counts are real: input tokens
    are the tokens of the instructions and input it was sent, output tokens those it produced.
    ``name`` is the model name reported (and priced). ``calls`` keeps the last 64 requests.

    Raises ``ConfigError`` when the script is exhausted.
    """

    def __init__(self, script: Sequence[Any], *, name: str = "scripted", cycle: bool = False) -> None:
        self.script, self.model, self.cycle = list(script), name, cycle
        self._next = 0
        self._ids = itertools.count(1)
        self.calls: deque[dict[str, Any]] = deque(maxlen=64)

    def _turn(self, instructions: str | None, input: Any, tools: Sequence[Any]) -> Any:
        self.calls.append({"instructions": instructions, "input": input,
                           "tools": [t.name for t in tools]})
        if self._next >= len(self.script):
            if not (self.cycle and self.script):
                raise ConfigError(f"ScriptedModel script exhausted after {len(self.script)} turns")
            self._next = 0
        turn = self.script[self._next]
        self._next += 1
        if isinstance(turn, BaseException):
            raise turn
        return turn

    def _input_tokens(self, instructions: str | None, input: Any) -> int:
        text = instructions or ""
        for item in [input] if isinstance(input, str) else input:
            content = item.get("content") if isinstance(item, dict) else None
            text += " " + (content if isinstance(content, str) else json.dumps(item, default=str))
        return len(text.split())

    def _items(self, turn: Any) -> tuple[list[Any], int]:
        n = next(self._ids)
        if isinstance(turn, str) or (isinstance(turn, Mapping) and "json" in turn):
            text = turn if isinstance(turn, str) else json.dumps(turn["json"])
            msg = ResponseOutputMessage(
                id=f"msg_{n}", type="message", role="assistant", status="completed",
                content=[ResponseOutputText(type="output_text", text=text, annotations=[])])
            return [msg], len(_tokens(text))
        calls = turn if isinstance(turn, (list, tuple)) else [turn]
        items = [ResponseFunctionToolCall(
            id=f"fc_{n}_{i}", call_id=f"call_{n}_{i}", type="function_call", name=c["tool"],
            arguments=json.dumps(c.get("args", {})), status="completed") for i, c in enumerate(calls)]
        return items, sum(len(_tokens(i.arguments)) for i in items)

    async def get_response(self, system_instructions, input, model_settings, tools, output_schema,
                           handoffs, tracing, *, previous_response_id=None, conversation_id=None,
                           prompt=None) -> Any:
        turn = self._turn(system_instructions, input, tools)
        items, out = self._items(turn)
        inp = self._input_tokens(system_instructions, input)
        return _sdk.ModelResponse(output=items, response_id=f"resp_{next(self._ids)}", usage=_sdk.Usage(
            requests=1, input_tokens=inp, output_tokens=out, total_tokens=inp + out,
            input_tokens_details=InputTokensDetails(cached_tokens=0),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0)))

    async def stream_response(self, system_instructions, input, model_settings, tools,
                              output_schema, handoffs, tracing, *, previous_response_id=None,
                              conversation_id=None, prompt=None) -> AsyncIterator[Any]:
        turn = self._turn(system_instructions, input, tools)
        items, out = self._items(turn)
        inp = self._input_tokens(system_instructions, input)
        final = Response(
            id=f"resp_{next(self._ids)}", object="response", created_at=time.time(), model=self.model,
            output=items, tool_choice="auto", tools=[], parallel_tool_calls=True, status="completed",
            usage=ResponseUsage(input_tokens=inp, output_tokens=out, total_tokens=inp + out,
                                input_tokens_details=InputTokensDetails(cached_tokens=0),
                                output_tokens_details=OutputTokensDetails(reasoning_tokens=0)))
        seq = itertools.count()
        yield ResponseCreatedEvent(type="response.created", sequence_number=next(seq),
                                   response=final.model_copy(update={"output": [], "status": "in_progress"}))
        for idx, item in enumerate(items):
            if item.type == "message":
                text = item.content[0].text
                yield ResponseOutputItemAddedEvent(
                    type="response.output_item.added", output_index=idx, sequence_number=next(seq),
                    item=item.model_copy(update={"content": [], "status": "in_progress"}))
                yield ResponseContentPartAddedEvent(
                    type="response.content_part.added", item_id=item.id, output_index=idx,
                    content_index=0, sequence_number=next(seq),
                    part=ResponseOutputText(type="output_text", text="", annotations=[]))
                for tok in _tokens(text):
                    yield ResponseTextDeltaEvent(
                        type="response.output_text.delta", item_id=item.id, output_index=idx,
                        content_index=0, delta=tok, logprobs=[], sequence_number=next(seq))
                yield ResponseTextDoneEvent(
                    type="response.output_text.done", item_id=item.id, output_index=idx,
                    content_index=0, text=text, logprobs=[], sequence_number=next(seq))
                yield ResponseContentPartDoneEvent(
                    type="response.content_part.done", item_id=item.id, output_index=idx,
                    content_index=0, part=item.content[0], sequence_number=next(seq))
            else:
                yield ResponseOutputItemAddedEvent(
                    type="response.output_item.added", output_index=idx, sequence_number=next(seq),
                    item=item.model_copy(update={"arguments": "", "status": "in_progress"}))
                yield ResponseFunctionCallArgumentsDeltaEvent(
                    type="response.function_call_arguments.delta", item_id=item.id,
                    output_index=idx, delta=item.arguments, sequence_number=next(seq))
                yield ResponseFunctionCallArgumentsDoneEvent(
                    type="response.function_call_arguments.done", item_id=item.id,
                    output_index=idx, arguments=item.arguments, name=item.name,
                    sequence_number=next(seq))
            yield ResponseOutputItemDoneEvent(type="response.output_item.done", item=item,
                                              output_index=idx, sequence_number=next(seq))
        # The runner builds its ModelResponse (output and usage) only from this event.
        yield ResponseCompletedEvent(type="response.completed", response=final,
                                     sequence_number=next(seq))


# ======================================================================================= Deck ====

_live_deck: weakref.ref[Deck] | None = None  # SPEC 4.1 rule 6: one live deck per process


class Deck:
    """The composition root: a catalog of agents and workflows played on one Runtime over one
    event log.

    Lifecycle (SPEC 3.1): NEW -> ``build()`` -> BUILT -> ``async with deck`` -> OPEN ->
    ``aclose()`` -> CLOSED, which is terminal. Only one deck may be live (not CLOSED) per process.

    ``skills`` is a path, a sequence of paths or a ``Skills`` catalog; ``mcp`` a path to a
    ``.mcp.json``, a mapping or an ``MCP``: the skills and tool servers agents name in
    ``skills=`` and ``mcp_servers=``. The deck holds the MCP servers: opening it connects every
    one, closing it tears them down.
    ``context`` declares the type of the per-run context (a type, never an instance).
    ``session_factory(session_id) -> Session`` replaces the conversation-memory sessions;
    ``store`` is an open ``EventStorePort`` (the deck never closes a store passed in); without one
    the deck builds it from ``KIT_STORE`` (default: in memory) and closes it at ``aclose()``.
    ``observers``: None (settings decide: the tracing observer when both ``KIT_TRACING_*`` keys
    are set), a sequence (exactly those, in order) or ``()`` (none); see ``kit_observers``.

    Raises ``ConfigError`` when another deck is live or ``context`` is an instance, and as
    ``Skills`` and ``MCP`` do for files or configs they refuse.
    """

    def __init__(self, agents: Sequence[Agent] = (), workflows: Sequence[Workflow] = (), *,
                 skills: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Skills | None = (),
                 mcp: str | os.PathLike[str] | Mapping[str, Any] | MCP | None = None,
                 context: type | None = None, session_factory: Callable[[str], Any] | None = None,
                 store: EventStorePort | None = None,
                 observers: Sequence[EventSinkPort] | None = None) -> None:
        global _live_deck
        self._project = self._where()
        other = _live_deck() if _live_deck is not None else None
        if other is not None and other._state != "CLOSED":
            raise ConfigError(f"another Deck is live in this process ({other._project}); close it "
                              f"with `await deck.aclose()` before creating {self._project} "
                              "(one live deck per process)")
        if context is not None and not isinstance(context, type) and typing.get_origin(context) is None:
            raise ConfigError(f"Deck(context=...) takes the context's type, not an instance "
                              f"(got a {type(context).__name__}); pass the object per run: "
                              "deck.run(..., context=obj)")
        for a in agents:
            if not isinstance(a, Agent):
                raise ConfigError(f"Deck(agents=...) takes kit.Agent objects, got {a!r}")
        for w in workflows:
            if not isinstance(w, Workflow):
                raise ConfigError(f"Deck(workflows=...) takes kit.Workflow objects, got {w!r}")
        self._agents, self._workflows = tuple(agents), tuple(workflows)
        self._skills = skills if isinstance(skills, Skills) else Skills(skills or ())
        self._mcp = mcp if isinstance(mcp, MCP) or mcp is None else MCP(mcp)
        self._observers = observers
        self._default_store = "memory"  # from_project: a SQLite file inside the project
        self.context_type = context
        self._session_factory, self._store = session_factory, store
        self._specs: dict[str, InvocableSpec] = {}
        self._mcp_servers: dict[str, Any] = {}
        self._state = "NEW"
        self._runtime: Any = None
        _live_deck = weakref.ref(self)

    @classmethod
    def from_project(cls, path: str | os.PathLike[str] = ".kit", **kwargs: Any) -> Deck:
        """A deck of the project at ``path``: ``agents/<bundle>/agent.py`` (each defines a
        module-level ``agent``), ``workflows/<bundle>/workflow.py`` (``workflow``),
        ``skills/<name>/SKILL.md``, and the MCP servers of ``.mcp.json`` beside the project
        directory (in its parent), when there is one.

        Bundles load from their files, in name order, with no ``sys.path`` change. Without
        ``KIT_STORE`` the log is the SQLite file ``<path>/.state/kit.db``. Other keyword
        arguments go to the constructor (``skills=`` or ``mcp=`` replace what was found).
        Raises ``ConfigError`` for a missing directory, naming the file of a bundle that fails
        to import or lacks its object, and as ``Skills`` and ``MCP`` do.
        """
        root = Path(path)
        if not root.is_dir():
            raise ConfigError(f"no kit project at {str(root)!r} (a directory with agents/ and "
                              "workflows/ bundles); set KIT_PROJECT or pass path=")
        agents = [_load_bundle(f, "agent", Agent) for f in sorted(root.glob("agents/*/agent.py"))]
        workflows = [_load_bundle(f, "workflow", Workflow)
                     for f in sorted(root.glob("workflows/*/workflow.py"))]
        if "skills" not in kwargs and (root / "skills").is_dir():
            kwargs["skills"] = Skills(root / "skills")
        mcp_json = root.resolve().parent / ".mcp.json"
        if "mcp" not in kwargs and mcp_json.is_file():
            kwargs["mcp"] = MCP(mcp_json)
        deck = cls(agents, workflows, **kwargs)
        deck._project = f"project {str(root.resolve())!r}"
        deck._default_store = f"sqlite:///{(root / '.state' / 'kit.db').resolve()}"
        return deck

    def asgi(self) -> Any:
        """The ASGI application serving this deck over HTTP (kit_http): its lifespan opens the
        deck and closes it. Needs the ``serve`` extra only to run under Hypercorn."""
        import kit_http
        return kit_http.App(self)

    @staticmethod
    def _where() -> str:
        frame = sys._getframe(2)
        return f"Deck created at {frame.f_code.co_filename}:{frame.f_lineno}"

    def __repr__(self) -> str:
        return (f"<Deck {self._state} agents={[a.name for a in self._agents]} "
                f"workflows={[w.name for w in self._workflows]}>")

    @property
    def agents(self) -> Mapping[str, Agent]:
        """The agents by name (read-only)."""
        return types.MappingProxyType({a.name: a for a in self._agents})

    @property
    def workflows(self) -> Mapping[str, Any]:
        """The workflows by name (read-only)."""
        return types.MappingProxyType({w.name: w for w in self._workflows})

    @property
    def skills(self) -> Mapping[str, Skill]:
        """The skills by name (read-only)."""
        return types.MappingProxyType(dict(self._skills))

    @property
    def mcp(self) -> MCP | None:
        """The deck's MCP servers (``MCP.servers`` maps name -> config), or None."""
        return self._mcp

    # -------------------------------------------------------------------------- lifecycle --
    def build(self) -> Deck:
        """Check every name and compile the catalog; reads local files only, starts nothing.

        Idempotent. Raises ``ConfigError`` for a duplicate name, an agent and a workflow sharing
        a root name, or an unknown skill, MCP server or workflow-as-tool name;
        ``ContextTypeError`` when a tool, instructions callable, hook or node requires a context
        the declared ``context=`` type cannot satisfy (SPEC 4.2; no check without ``context=``);
        ``DeckStateError`` on a closed deck.
        """
        if self._state == "CLOSED":
            raise DeckStateError("CLOSED", "build")
        if self._state != "NEW":
            return self
        import kit_observers
        import kit_runtime
        kit_observers.check_observers(self._observers)
        names: dict[str, str] = {}
        for kind, name in [("agent", a.name) for a in self._agents] + [
                ("workflow", w.name) for w in self._workflows]:
            if name in names:
                raise ConfigError(f"two invocables are named {name!r} ({names[name]} and {kind}); "
                                  "names must be unique across agents and workflows")
            names[name] = kind
        workflows = {w.name: w for w in self._workflows}
        servers = self._mcp.servers if self._mcp is not None else {}
        catalogs: dict[str, Mapping[str, Any]] = {"skill": self._skills, "MCP server": servers,
                                                  "workflow": workflows}
        for a in self._agents:
            for what, wanted in (("skill", a.skills), ("MCP server", a.mcp_servers),
                                 ("workflow", a.workflows)):
                for n in wanted:
                    if n not in catalogs[what]:
                        known = ", ".join(catalogs[what]) or "none"
                        raise ConfigError(f"agent {a.name!r} names unknown {what} {n!r} "
                                          f"(the deck has: {known})")
        # The SDK's server objects are made here, unconnected: opening the deck connects them.
        self._mcp_servers = self._mcp._sdk_servers() if self._mcp is not None else {}
        self._specs = {w.name: kit_runtime.compile_workflow(w) for w in self._workflows}
        self._specs.update({a.name: kit_runtime.compile_agent(
            a, [self._specs[n] for n in a.workflows], skills=[self._skills[n] for n in a.skills],
            mcp_servers=[self._mcp_servers[n] for n in a.mcp_servers]) for a in self._agents})
        if self.context_type is not None:
            kit_runtime.check_context(list(self._specs.values()), self.context_type)
        self._state = "BUILT"
        return self

    async def __aenter__(self) -> Deck:
        if self._state in ("OPEN", "CLOSED"):
            raise DeckStateError(self._state, "open the deck")
        self.build()
        import kit_runtime
        runtime = kit_runtime.Runtime(self._specs, store=self._store,
                                      session_factory=self._session_factory,
                                      observers=self._observers, default_store=self._default_store,
                                      mcp_servers=list(self._mcp_servers.values()))
        await runtime.open()
        self._runtime, self._state = runtime, "OPEN"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the deck for good: stop the Runtime, tear down its MCP servers (no child process
        is left), close the store it built. Idempotent."""
        global _live_deck
        if self._state == "OPEN":
            self._state = "CLOSED"
            await self._runtime.close()
        self._state = "CLOSED"
        if _live_deck is not None and _live_deck() is self:
            _live_deck = None

    # ------------------------------------------------------------------------------ turns --
    def _open(self, action: str) -> Any:
        """The Runtime, for an action that needs an open deck (``DeckStateError`` otherwise)."""
        if self._state != "OPEN":
            raise DeckStateError(self._state, action)
        return self._runtime

    def _spec(self, action: str, name: str) -> InvocableSpec:
        self._open(action)
        spec = self._specs.get(name)
        if spec is None:
            raise UnknownNameError(name, self._specs)
        return spec

    async def run(self, name: str, input: Any, *, context: Any = None, session_id: str | None = None,
                  namespace: str | None = None, run_id: str | None = None) -> TurnResult:
        """Play one turn to its end and return what it produced.

        For an agent, a ``TurnResult`` built from ``run.completed``. For a workflow, ``input`` is
        a mapping (the initial state) and the result is the final state mapping, or an
        ``InterruptResult`` when the run parked (waiting for a human, or sleeping);
        ``session_id`` is the thread id (required for a durable workflow) and a later call on
        the same thread carries on from where it stopped.

        Raises ``DeckStateError`` unless open, ``UnknownNameError``, ``ContentError`` for bad
        input, ``ConfigError`` for a block the engine cannot express, ``SessionBusyError`` when
        another run holds the session (nothing is written then), and whatever made the run fail
        (after ``run.failed`` is in the log).
        """
        spec = self._spec("run", name)
        return await self._runtime.run(spec, input, context=context, session_id=session_id,
                                       namespace=namespace, run_id=run_id)

    def stream(self, name: str, input: Any, *, context: Any = None, session_id: str | None = None,
               namespace: str | None = None, run_id: str | None = None) -> AsyncIterator[Event]:
        """Play one turn, yielding its events live: ``run.started``, ``text.delta`` per chunk, ...,
        the terminal event last (yielded once durable).

        The run belongs to the deck, not to the iterator: leaving the loop early ends the stream,
        never the run. Errors as for ``run``; a failed run yields ``run.failed`` and then raises.
        """
        spec = self._spec("stream", name)
        return self._runtime.stream(spec, input, context=context, session_id=session_id,
                                    namespace=namespace, run_id=run_id)

    async def status(self, run_id: str) -> RunStatus | None:
        """The run's status folded from its events, or None when the log has no such run."""
        return await self._open("read a status").status(run_id)

    def session_for(self, session_id: str, *, namespace: str | None = None) -> Any:
        """The conversation-memory session (an ``agents.memory.Session``) that turns on
        ``session_id`` use. Raises ``DeckStateError`` unless the deck is open."""
        return self._open("get a session").session_for(session_id, namespace)


    # ---------------------------------------------------------------- parked workflows --
    async def pending(self) -> list[Pending]:
        """Every run waiting for a human, across all workflows, read off the log."""
        return await self._open("list pending runs").pending()

    async def answer(self, run_id: str, value: Any, *, context: Any = None) -> Any:
        """Answer a waiting run: its interrupted node re-runs from its start with ``value``.

        Finds the workflow, thread and session itself. Returns the final state (the run is
        closed, its session freed) or the next ``InterruptResult``. ``context`` is not kept from
        the first call: pass it again. Raises ``UnknownRunError``, ``RunNotWaitingError`` (an
        interrupt is answered once), ``UnknownNameError`` when this deck lacks the workflow.
        """
        return await self._open("answer").answer(run_id, value, context)

    async def pause(self, run_id: str, *, reason: str | None = None) -> None:
        """Ask a run to pause at its next safe point (before a model call; between a workflow's
        supersteps); returns at once. The request is recorded, in the store, so the process
        playing the run sees it wherever it runs. Raises ``UnknownRunError``."""
        await self._open("pause").request(run_id, "pause", reason, "api")

    async def cancel(self, run_id: str, *, reason: str | None = None) -> None:
        """Ask a run to end at its next safe point (``run.cancelled``; its session is freed);
        returns at once. A parked run (paused, waiting, sleeping) is cancelled right away.
        Raises ``UnknownRunError``."""
        await self._open("cancel").request(run_id, "cancel", reason, "api")

    async def resume(self, run_id: str, *, context: Any = None) -> list[Event]:
        """Continue a paused run here; returns the events it produced (``[]`` when there is
        nothing to resume: the run is not paused, or another caller resumed it first)."""
        return await self._open("resume").resume(run_id, context)

    async def due_resumes(self, now: datetime | None = None) -> list[Due]:
        """Sleeping threads whose wake time is at or before ``now`` (default: current UTC),
        read from each workflow's own checkpointer. Raises ``ConfigError`` for a naive ``now``."""
        return await self._open("list due threads").due_resumes(_aware(now))

    async def tick(self, now: datetime | None = None) -> list[Ticked]:
        """Resume every due thread (through its parked run when the log has one); no context.

        Safe to run from several processes at once: a thread is resumed by one of them only.
        Raises ``ConfigError`` for a naive ``now``.
        """
        return await self._open("tick").tick(_aware(now))


def _load_bundle(file: Path, attr: str, kind: type) -> Any:
    """Import a project bundle from its file (no ``sys.path`` change) and return its object."""
    name = f"kit_project_{file.parent.parent.name}_{file.parent.name}"
    try:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as exc:
        raise ConfigError(f"{file} failed to import: {type(exc).__name__}: {exc}") from exc
    found = getattr(module, attr, None)
    if not isinstance(found, kind):
        raise ConfigError(f"{file} must define a module-level {attr!r} (a kit.{kind.__name__}), "
                          f"found {type(found).__name__}")
    return found


def _aware(now: datetime | None) -> datetime:
    if now is None:
        return _utcnow()
    if not isinstance(now, datetime) or now.tzinfo is None or now.utcoffset() is None:
        raise ConfigError(f"now must be a timezone-aware datetime, got {now!r}")
    return now


def _alias_core() -> None:
    # SPEC documents `kit.core` and `kit.core.ports` as import paths; they are this module.
    this = sys.modules[__name__]
    sys.modules.setdefault(f"{__name__}.core", this)
    sys.modules.setdefault(f"{__name__}.core.ports", this)


_alias_core()
