"""kit_content: the content blocks a turn carries (text, image, audio, resource, data) and the
earlier messages of a one-off turn (``HistoryMessage``), with the checks that keep the log
storable (the ground floor's second storey: it imports only ``kit_errors``).

Owns: ``TextBlock``, ``ImageBlock``, ``AudioBlock``, ``ResourceBlock``, ``DataBlock``,
``ContentBlock``, ``MAX_INLINE_BYTES``, ``as_blocks``, ``block_to_json``/``block_from_json``,
``HistoryMessage``, ``HISTORY_ROLES``, ``as_history``; for sibling modules, ``BLOCK_TYPES``,
``check_inline_json`` and ``check_unicode``. ``kit_core`` re-exports the public names.

Must never: import another sibling module or an engine SDK, do I/O or read the environment.

Theory of operation: a block checks itself when it is built (``__post_init__``), so a malformed
block is a ``ContentError`` naming the field at the caller's line, before anything is written.
Inline data is capped at ``MAX_INLINE_BYTES`` because the log keeps it forever; larger content is
referenced (``ResourceBlock``). Text that UTF-8 cannot encode (a lone surrogate) is refused for
the same reason: the log could not store it.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from kit_errors import ContentError

__all__ = (
    "TextBlock", "ImageBlock", "AudioBlock", "ResourceBlock", "DataBlock", "ContentBlock",
    "MAX_INLINE_BYTES", "as_blocks", "block_to_json", "block_from_json", "HistoryMessage",
    "HISTORY_ROLES", "as_history",
)

#: Inline data (image, audio, data blocks) is capped because its base64 sits in the log forever.
#: Larger content goes in a ``ResourceBlock`` that references it (SPEC 8).
MAX_INLINE_BYTES = 1_000_000
_MEDIA_TYPE = re.compile(r"^[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*\Z")


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


def check_unicode(what: str, text: str) -> None:
    """Raise ``ContentError`` naming ``what`` for ``text`` with a lone surrogate (``"\\ud800"`` is
    valid JSON): it cannot be encoded as UTF-8, so the log, a session, a checkpoint or a
    response could not store it; it is refused before anything is written."""
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
        check_unicode("TextBlock.text", self.text)


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
    check_unicode(what, text)
    if len(text) > MAX_INLINE_BYTES:
        raise ContentError(f"{what} is {len(text)} bytes of JSON, more than {MAX_INLINE_BYTES} "
                           f"(the log holds data inline up to that); keep larger data elsewhere "
                           f"and pass a reference to it {reference}")


ContentBlock = TextBlock | ImageBlock | AudioBlock | ResourceBlock | DataBlock
_BLOCKS: dict[str, type] = {c.type: c for c in (TextBlock, ImageBlock, AudioBlock, ResourceBlock, DataBlock)}


BLOCK_TYPES = tuple(_BLOCKS.values())
_BLOCK_FIELDS = {c: tuple(f.name for f in fields(c)) for c in BLOCK_TYPES}


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


_BYTES = (bytes, bytearray, memoryview)  # iterable, but of ints


def as_blocks(value: str | ContentBlock | Iterable[ContentBlock]) -> tuple[ContentBlock, ...]:
    """Coerce agent input: a ``str`` is one ``TextBlock``; otherwise every item must be a block."""
    if isinstance(value, str):
        return (TextBlock(value),)
    if isinstance(value, BLOCK_TYPES):
        return (value,)  # type: ignore[return-value]
    if isinstance(value, _BYTES):  # not a list of blocks: of ints
        raise ContentError(f"agent input must be a str or a list of content blocks, got "
                           f"{type(value).__name__}: decode text; binary content is an "
                           "ImageBlock or AudioBlock of its base64")
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise ContentError(f"agent input must be a str or a list of content blocks, "
                           f"got {type(value).__name__}")
    blocks = tuple(value)
    for i, b in enumerate(blocks):
        if not isinstance(b, BLOCK_TYPES):
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
    if isinstance(value, (str, Mapping, *_BYTES)) or not isinstance(value, Iterable):
        raise ContentError(f"history must be a list of HistoryMessage, got {type(value).__name__}")
    history = tuple(value)
    for i, m in enumerate(history):
        if not isinstance(m, HistoryMessage):
            raise ContentError(f"history item {i} is a {type(m).__name__}, not a HistoryMessage")
    return history
