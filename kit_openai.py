"""kit_openai: the OpenAI Chat Completions wire over a deck's agents, as plain translation.

Owns: reading a ``POST /v1/chat/completions`` body into a turn (``read_request`` -> ``ChatTurn``:
the agent, the input blocks, the session or the one-off history, streamed or not), the
``chat.completion`` body (``completion``), the chunks of a streamed one (``Chunks``), the
``GET /v1/models`` list (``model_list``) and OpenAI's error body (``error_body``).

Must never: speak ASGI or touch a socket (kit_http serves the routes, frames the chunks as SSE and
maps errors to statuses), reach a deck, the Runtime or the store, import an SDK, or accept a
request it cannot honour by quietly dropping part of it (a part or role it cannot carry is a
``ChatRequestError``, HTTP 400).

Theory of operation
-------------------
``model`` names an agent (a workflow is not a model). The last message must be the user's: its
content (a string, or ``text``, ``image_url`` with a ``data:`` URL and ``input_audio`` parts)
becomes the turn's input blocks. The conversation is kit's session when the request names one:
the ``x-kit-session-id`` header, else ``metadata.session_id``, else ``user`` (so one end user is
one conversation). The session already holds what came before, so the earlier messages of the
request are the client's copy of it and are not replayed. Without a session the turn is one-off
and the earlier messages are its ``history``: ``HistoryMessage``s in their roles, which the
agent's model reads before the input and which ``run.started`` records beside it. That keeps the
log truthful: it holds the conversation the model was given, in its roles, rather than a
transcript flattened into the input or a session that no run in the log ever wrote.

Sampling parameters (``temperature``, ``max_tokens``, ``tools``, ...) are not the client's to set:
the agent's own model settings and tools apply. Usage comes from the run's ``run.completed``
(the run's authoritative total), in the body or in the final chunk, which also carries
``finish_reason``; ``data: [DONE]`` ends a stream (``DONE``). A run that fails partway ends its
stream with one ``data: {"error": {...}}`` frame, which OpenAI clients raise as an ``APIError``.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kit_core import (
    HISTORY_ROLES, AudioBlock, ConfigError, ContentBlock, Event, HistoryMessage, ImageBlock, KitError,
    RunCancelled, RunCompleted, RunFailed, RunPaused, RunStarted, RunStoppedError, TextBlock,
    TextDelta, Usage, check_id, jsonable,
)

__all__ = ("ChatTurn", "ChatRequestError", "Chunks", "DONE", "SESSION_HEADER", "read_request",
           "completion", "model_list", "error_body")

#: The header that names a request's session (kit's; OpenAI clients send extra headers as asked).
SESSION_HEADER = b"x-kit-session-id"
#: The data of a stream's last frame, as OpenAI sends it.
DONE = "[DONE]"


class ChatRequestError(KitError):
    """A Chat Completions request kit cannot honour as sent: malformed, a role or content part
    kit cannot carry (a ``tool`` message, an image by URL), or no user message last. HTTP 400."""


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """What a Chat Completions request asks of the deck: one turn of agent ``model``."""
    model: str
    input: tuple[ContentBlock, ...]
    session_id: str | None
    history: tuple[HistoryMessage, ...]
    stream: bool


def read_request(body: Mapping[str, Any], session_header: str | None = None) -> ChatTurn:
    """The turn a ``POST /v1/chat/completions`` body asks for (module docstring).

    Raises ``ChatRequestError`` for a malformed body, a role or part kit cannot carry, or a last
    message that is not the user's; ``ContentError`` for a malformed image or audio payload.
    """
    model, messages, stream = body.get("model"), body.get("messages"), body.get("stream", False)
    if not isinstance(model, str) or not model:
        raise ChatRequestError("'model' must name an agent (GET /v1/models lists them)")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise ChatRequestError("'messages' must be a non-empty list of message objects")
    if not isinstance(stream, bool):
        raise ChatRequestError("'stream' must be true or false")
    *earlier, last = messages
    if last.get("role") != "user":
        raise ChatRequestError("the last message must be the user's: it is the turn's input")
    metadata = body.get("metadata")
    session_id = session_header or (metadata.get("session_id") if isinstance(metadata, Mapping)
                                    else None) or body.get("user")
    if session_id is not None:
        try:
            check_id("a session id (x-kit-session-id, metadata.session_id or user)", session_id)
        except ConfigError as exc:
            raise ChatRequestError(str(exc)) from None
    history = () if session_id else tuple(_history_message(m) for m in earlier)
    return ChatTurn(model, _blocks(last.get("content")), session_id, history, stream)


def _history_message(message: Mapping[str, Any]) -> HistoryMessage:
    role = message.get("role")
    if role not in HISTORY_ROLES:
        raise ChatRequestError(f"a {role!r} message cannot be replayed: kit agents call their own "
                               "tools; send system, developer, user and assistant messages")
    return HistoryMessage(role, _blocks(message.get("content")))


def _blocks(content: Any) -> tuple[ContentBlock, ...]:
    """A message's content as blocks: a string, or a list of text, image and audio parts."""
    if isinstance(content, str):
        return (TextBlock(content),)
    if not isinstance(content, list) or not content:
        raise ChatRequestError("a message's content must be a string or a non-empty list of parts")
    return tuple(_block(part) for part in content)


def _block(part: Any) -> ContentBlock:
    if not isinstance(part, Mapping):
        raise ChatRequestError(f"a content part must be an object with a 'type', got "
                               f"{type(part).__name__}")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ChatRequestError("a text part needs a string 'text'")
        return TextBlock(part["text"])
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else image
        media_type, sep, data = (url[5:] if isinstance(url, str) and url.startswith("data:")
                                 else "").partition(";base64,")
        if not sep:
            raise ChatRequestError("an image_url part must carry a base64 data: URL; kit keeps "
                                   "what the model saw in its log and fetches nothing")
        return ImageBlock(media_type, data)
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, Mapping) or not isinstance(audio.get("format"), str):
            raise ChatRequestError("an input_audio part needs input_audio.data and .format")
        fmt = {"mp3": "mpeg"}.get(audio["format"], audio["format"])
        return AudioBlock(f"audio/{fmt}", audio.get("data"))
    raise ChatRequestError(f"kit cannot carry a content part of type {kind!r}; "
                           "send text, image_url (data: URL) or input_audio parts")


# ================================================================================== answers ====

def _usage(usage: Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens}


def _text(output: Any) -> str:
    """A turn's output as message content: its text, or its structured output as JSON."""
    if isinstance(output, str):
        return output
    return json.dumps(jsonable(output), ensure_ascii=False, separators=(",", ":"))


def completion(run_id: str, model: str, output: Any, usage: Usage) -> dict[str, Any]:
    """The ``chat.completion`` body of a finished turn (its ``id`` names the run)."""
    return {"id": f"chatcmpl-{run_id}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": _text(output), "refusal": None}}],
            "usage": _usage(usage)}


class Chunks:
    """The chunks of one streamed completion, built one event at a time.

    ``chunks(event)`` is what that event adds to the stream (a list of JSON objects and
    ``DONE``): ``run.started`` the first chunk (the assistant's role), each ``text.delta`` a chunk
    of content, ``run.completed`` the final chunk (``finish_reason`` and usage) and ``DONE``, an
    ending without a result one error object; any other event nothing.
    """
    __slots__ = ("model", "id", "created")

    def __init__(self, model: str) -> None:
        self.model, self.id, self.created = model, "chatcmpl-", int(time.time())

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                **extra}

    def __call__(self, event: Event) -> list[dict[str, Any] | str]:
        p = event.payload
        if type(p) is TextDelta:
            return [self._chunk({"content": p.text})]
        if type(p) is RunStarted:
            self.id = f"chatcmpl-{event.run_id}"
            return [self._chunk({"role": "assistant", "content": ""})]
        if isinstance(p, RunCompleted):
            return [self._chunk({}, "stop", usage=_usage(p.usage)), DONE]
        if isinstance(p, RunFailed):
            return [error_body(500, p.error, f"run {event.run_id} failed ({p.error}); its log "
                                             "has the details")]
        if isinstance(p, (RunCancelled, RunPaused)):  # what deck.run raises for them
            stopped = RunStoppedError(event.run_id, p.status, p.reason)
            return [error_body(409, type(stopped).__name__, str(stopped))]
        return []


def model_list(agents: Iterable[str]) -> dict[str, Any]:
    """The ``GET /v1/models`` body: every agent is a model."""
    now = int(time.time())
    return {"object": "list", "data": [{"id": name, "object": "model", "created": now,
                                        "owned_by": "kit"} for name in sorted(agents)]}


def error_body(status: int, error: str, message: str) -> dict[str, Any]:
    """OpenAI's error shape; ``code`` is kit's exception type name (``SessionBusyError``, ...)."""
    return {"error": {"message": message, "param": None, "code": error,
                      "type": "invalid_request_error" if status < 500 else "server_error"}}

