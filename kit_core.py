"""kit_core: the values of kit: what users type and what the log holds (the ground floor).

Owns: the errors, the content blocks, the event envelope (``Event``) and its payload types, the
results (``TurnResult``, ``Usage``, ``InterruptResult``, ``RunStatus``, ``RunInfo``, ...), the
ports (``EventSinkPort``, ``EventStorePort``) and the seams the upper floors meet at: ``Context``
(the per-run application context), ``InvocableSpec`` (a compiled agent or workflow) and
``RunHandle`` (how an engine plays a run without holding the Runtime). ``kit.core`` and
``kit.core.ports`` are aliases of this module; ``kit`` re-exports its ``__all__``.

Must never: import a sibling module or an engine SDK (openai-agents, LangGraph), do I/O, read the
environment, or keep state beyond the payload-kind table built at import. Every other kit module
imports this one; it imports none of them.

Theory of operation: everything here is a value. Events are frozen dataclasses; a payload class
carries its dotted ``kind`` (``"text.delta"``), what the kind does to a stream (``ends``: terminal,
parking or neither) and the run status after it, so folding a run's status and ending a stream
read the same table (``KINDS``). Names without an underscore that ``__all__`` leaves out
(``jsonable``, ``check_name``, ``check_id``, ``check_text``, ``check_limit``,
``check_inline_json``, ``count_setting``, ``printable``, ``RunHandle``, ...) are kit's internal
API between its modules.
"""
from __future__ import annotations

import base64
import binascii
import enum
import json
import os
import re
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = (
    # errors
    "KitError", "ConfigError", "ContextTypeError", "ContentError", "DeckStateError",
    "UnknownNameError", "UnknownRunError", "RunNotWaitingError", "RunStoppedError",
    "SessionBusyError", "LogConflictError", "StoreUnavailableError", "MCPServerError",
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
        super().__init__(f"no {what} named {name!r}" + (f" ({hint})" if hint else "")
                         + f"; known: {', '.join(self.known) or '(none)'}")


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


def type_name(t: object) -> str:
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


def _check_unicode(what: str, text: str) -> None:
    # A lone surrogate ("\ud800" is valid JSON) cannot be encoded as UTF-8: the log, a session
    # or a response could not store it, so it is refused before anything is written.
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ContentError(f"{what} is not valid Unicode: a lone surrogate "
                               f"{text[exc.start]!r} at character {exc.start}") from None


@dataclass(frozen=True, slots=True)
class TextBlock:
    """Plain text. A ``str`` agent input becomes one of these."""
    text: str
    type: ClassVar[str] = "text"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ContentError(f"TextBlock.text must be str, got {type(self.text).__name__}")
        _check_unicode("TextBlock.text", self.text)


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
        check_inline_json("DataBlock.data", self.data, "in a ResourceBlock")


def check_inline_json(what: str, data: Any, reference: str) -> None:
    """Raise ``ContentError`` naming ``what`` unless ``data`` is JSON data of at most
    ``MAX_INLINE_BYTES`` encoded; ``reference`` says where a larger one's reference goes."""
    try:
        text = json.dumps(data, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ContentError(f"{what} must be JSON data: {exc}") from None
    except RecursionError:
        raise ContentError(f"{what} is nested too deep to be JSON data") from None
    _check_unicode(what, text)
    if len(text) > MAX_INLINE_BYTES:
        raise ContentError(f"{what} is {len(text)} bytes of JSON, more than {MAX_INLINE_BYTES} "
                           f"(the log holds data inline up to that); keep larger data elsewhere "
                           f"and pass a reference to it {reference}")


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


#: The roles an earlier message of a one-off turn may have (``HistoryMessage.role``).
HISTORY_ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True, slots=True)
class HistoryMessage:
    """One earlier message of a one-off agent turn (``Deck.run(..., history=[...])``).

    ``role`` is one of ``HISTORY_ROLES``; ``content`` a ``str`` or content blocks, kept as a
    tuple of blocks. The history is recorded in the turn's ``run.started`` and sent to the model
    before the input, so the log holds the whole conversation the turn was given. Raises
    ``ContentError`` for another role or content that is not blocks.
    """
    role: str
    content: tuple[ContentBlock, ...]

    def __post_init__(self) -> None:
        if self.role not in HISTORY_ROLES:
            raise ContentError(f"a history message's role is one of {', '.join(HISTORY_ROLES)}, "
                               f"got {self.role!r}")
        object.__setattr__(self, "content", as_blocks(self.content))

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "content": [block_to_json(b) for b in self.content]}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> HistoryMessage:
        return cls(obj["role"], tuple(block_from_json(b) for b in obj["content"]))


def as_history(value: Iterable[HistoryMessage] | None) -> tuple[HistoryMessage, ...]:
    """Coerce ``history=``: None or an iterable of ``HistoryMessage`` (``ContentError`` else)."""
    if value is None:
        return ()
    if isinstance(value, (str, Mapping)) or not isinstance(value, Iterable):
        raise ContentError(f"history must be a list of HistoryMessage, got {type(value).__name__}")
    history = tuple(value)
    for i, m in enumerate(history):
        if not isinstance(m, HistoryMessage):
            raise ContentError(f"history item {i} is a {type(m).__name__}, not a HistoryMessage")
    return history


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
        return {n: jsonable(getattr(self, n)) for n in self._fields}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Payload:
        return cls(**{n: obj[n] for n in cls._fields if n in obj})


def jsonable(v: Any) -> Any:
    """``v`` as JSON-ready data: blocks, usage, enums, datetimes and pydantic models converted,
    anything else unknown as its ``str``. Every payload field goes through it."""
    if v is None or type(v) in (str, int, float, bool):
        return v
    if isinstance(v, enum.Enum):
        return jsonable(v.value)
    if isinstance(v, (str, int, float)):
        return v
    if isinstance(v, Usage):
        return v.to_json()
    if isinstance(v, _BLOCK_TYPES):
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
    if callable(dump):
        return dump(mode="json")
    return str(v)


def _payload(kind: str, *, ends: str | None = None, status: RunStatus | None = None):
    """A frozen, slotted payload dataclass of ``kind``, registered in ``KINDS``."""
    def wrap(cls):
        cls = dataclass(frozen=True, slots=True)(cls)
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
    model: str
    input_tokens: int = 0
    output_tokens: int = 0
    usd: float | None = None


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


@dataclass(frozen=True, slots=True)
class UnknownEvent(Payload):
    """The payload of a kind this version does not know; ``data`` is the raw JSON payload."""
    kind: str  # type: ignore[misc]
    data: Any = None

    def to_json(self) -> dict[str, Any]:
        return self.data if isinstance(self.data, dict) else {"data": self.data}


def utcnow() -> datetime:
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
    at: datetime = field(default_factory=utcnow)

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
        ptype = KINDS.get(kind)
        payload = ptype.from_json(data or {}) if ptype else UnknownEvent(kind, data)
        at = obj.get("at")
        return cls(obj["run_id"], int(obj["seq"]), payload, obj.get("origin") or "",
                   obj.get("message_id"), datetime.fromisoformat(at) if at else utcnow())


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
        return f"the run is {status.value}: it is parked already (cancel or resume it instead)"
    if action == "resume" and status is not RunStatus.PAUSED:
        return f"the run is {status.value}, not PAUSED: there is nothing to resume"
    return None


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
    """A workflow run that parked on ``interrupt()`` (or ``sleep_until``).

    ``run_id`` is the parked run in the log (``deck.answer(result.run_id, value)``); None from a
    headless ``Workflow.run``, which has no log.
    """
    payload: Any
    thread_id: str
    type: str = "interrupt"
    run_id: str | None = None


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
    writing nothing when another live or parked run holds the session. A terminal event frees the
    claim; a parking event keeps it without a lease. ``follow`` replays, then yields live events,
    until the run's terminal or parking event; ``follow_requests`` does the same for control
    requests, forever (the owner of a run learns of a pause or cancel written anywhere).
    """

    async def append(self, events: Sequence[Event], *, claims: Sequence[Claim] = ()) -> None: ...
    async def read(self, run_id: str, after: int = -1) -> list[Event]: ...
    def follow(self, run_id: str, after: int = -1) -> AsyncIterator[Event]: ...
    async def runs(self, *, status: RunStatus | None = None, name: str | None = None,
                   session_id: str | None = None, limit: int | None = None,
                   before: str | None = None) -> list[RunInfo]: ...
    async def run_info(self, run_id: str) -> RunInfo | None: ...
    async def renew(self, owner: str, lease_seconds: float,
                    run_ids: Sequence[str] | None = None) -> None: ...
    async def reap(self) -> list[str]: ...
    async def request(self, run_id: str, action: str, reason: str | None = None,
                      source: str | None = None) -> int: ...
    async def requests(self, after: int = 0) -> list[ControlRequest]: ...
    def follow_requests(self, after: int = 0) -> AsyncIterator[ControlRequest]: ...
    async def session_holder(self, session_id: str, namespace: str | None = None) -> str | None: ...




# ======================================================================================= runs ====

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_name(what: str, name: object) -> str:
    """``name`` if it is a valid agent, workflow, server or namespace name (it appears in URLs);
    raises ``ConfigError`` naming ``what`` otherwise."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{what} name must be 1-128 characters of letters, digits, '_', '.' or '-' "
                          f"starting with a letter or digit (it appears in URLs), got {name!r}")
    return name


#: The longest id (a session, thread or run id) kit takes. Ids are indexed, and Postgres cannot
#: index a value past ~2.7 kB: 256 characters are at most 1 kB of UTF-8, two of them in one row.
MAX_ID_CHARS = 256
#: What no store can hold: NUL (Postgres text) and lone surrogates (not UTF-8).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
#: What no id may hold: those, and control characters (a newline, an escape sequence).
_NOT_IN_ID = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def check_id(what: str, value: object) -> str:
    """``value`` if it is an id kit can store, index and show (a session, thread or run id): a
    non-empty str of at most ``MAX_ID_CHARS`` characters with no control character and no lone
    surrogate. Raises ``ConfigError`` naming ``what`` otherwise, before anything is written."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what} must be a non-empty str, got {value!r}")
    if len(value) > MAX_ID_CHARS:
        raise ConfigError(f"{what} must be at most {MAX_ID_CHARS} characters, got {len(value)}")
    _refuse(what, value, _NOT_IN_ID, "a control character or a lone surrogate")
    return value


def check_text(what: str, value: object) -> str | None:
    """``value`` if it is None or a str every store can hold (no NUL, no lone surrogate), such
    as a control request's reason. Raises ``ConfigError`` naming ``what`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a str or None, got {type(value).__name__}")
    _refuse(what, value, _UNSTORABLE, "a NUL or a lone surrogate")
    return value


def _refuse(what: str, value: str, pattern: re.Pattern[str], kind: str) -> None:
    bad = pattern.search(value)
    if bad is not None:
        raise ConfigError(f"{what} must not hold {kind}, got {bad.group()!r} at character "
                          f"{bad.start()}")


def printable(text: str) -> str:
    """``text`` as a terminal or a log line should show text a client wrote: each character
    ``repr`` escapes (control characters, line separators, bidi overrides) as ``repr`` escapes
    it (``\\x1b``, ``\\n``, ``\\u202e``), printable Unicode as is. One line, no control sequence."""
    return text if text.isprintable() else "".join(
        c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_limit(what: str, value: object) -> int | None:
    """``value`` if it is None or a positive int (a bool is not one); raises ``ConfigError``
    naming ``what`` and the value otherwise."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value  # type: ignore[return-value]
    raise ConfigError(f"{what} must be a positive int or None, got {value!r}")


def count_setting(name: str, raw: str | None) -> int | None:
    """The positive integer a setting ``name`` holds as text ``raw``; None when it is unset or
    blank (an exported empty variable means unset). Raises ``ConfigError`` naming it otherwise."""
    text = "" if raw is None else raw.strip()
    if not text:
        return None
    if not text.isdecimal() or int(text) < 1:  # isdigit takes '²', which int() refuses
        raise ConfigError(f"{name} must be a positive integer, got {raw!r}")
    return int(text)


def aware(now: datetime | None) -> datetime:
    """``now`` (default: the current UTC time); raises ``ConfigError`` for a naive datetime."""
    if now is None:
        return utcnow()
    if not isinstance(now, datetime) or now.tzinfo is None or now.utcoffset() is None:
        raise ConfigError(f"now must be a timezone-aware datetime, got {now!r}")
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


@dataclass(frozen=True, slots=True)
class InvocableSpec:
    """The compiled form of an agent or workflow, produced by ``Deck.build()``.

    ``engine`` is the engine's compiled object (kit_agents' ``AgentEngine``, kit_workflows'
    ``WorkflowEngine``); ``source`` the catalog object it was compiled from.
    """
    name: str
    kind: str  # "agent" | "workflow"
    source: Any = field(repr=False, compare=False)
    engine: Any = field(default=None, repr=False, compare=False)


#: Error messages recorded in run.failed are cut to this length.
MAX_ERROR_CHARS = 2000
#: What a run handle hands its events to: ``deliver(handle, event)`` returns at once,
#: ``commit(handle, event)`` once the event is durable (raising what refused it).
Deliver = Callable[["RunHandle", Event], None]
Commit = Callable[["RunHandle", Event], Awaitable[None]]


class RunHandle:
    """How an engine plays one run: the only part of the Runtime an engine ever holds.

    The Runtime makes one per run and passes it to the engine, which records the run through it:
    ``emit`` hands on an ordinary event at once; ``durable`` returns once the event is committed
    (``tool.started`` before the tool runs; every end of a run); ``add_usage`` sums tokens and
    cost for ``run.completed``; ``take_request`` reads a pause or cancel request at a safe point,
    and ``on_request`` (set by the engine) is told of one the moment it arrives; ``start_child``
    (set by the Runtime) plays a workflow as a child run of this one (an agent's workflow tool).

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

    async def pace(self) -> None:
        """Let other tasks run, and wait while the log is behind: a run never runs far ahead
        of what is committed (the writer's backlog is bounded). Engines call it between chunks."""
        await self._pace()

    def failure(self, exc: BaseException) -> RunFailed:
        """The ``run.failed`` payload that records ``exc``."""
        return RunFailed(type(exc).__name__, str(exc)[:MAX_ERROR_CHARS])

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
        """The Runtime's side: ask the run to ``pause`` or ``cancel`` at its next safe point."""
        self.requested = (action, reason, source)
        if self.on_request is not None:
            self.on_request(action)

    def take_request(self) -> tuple[str, str | None, str | None] | None:
        """The engine's side, at a safe point: the pending request (consumed), or None."""
        requested, self.requested = self.requested, None
        return requested
