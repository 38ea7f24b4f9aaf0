"""kit_openai: the OpenAI Chat Completions wire over a deck's agents, as plain translation.

Owns: reading a ``POST /v1/chat/completions`` body into a turn (``read_request`` -> ``ChatTurn``:
the agent, the input blocks, the session or the one-off history, streamed or not), the
``chat.completion`` body (``completion``), the chunks of a streamed one (``Chunks``), the
``GET /v1/models`` list (``model_list``) and each model of it (``model_object``), and OpenAI's
error body (``error_body``).

Must never: speak ASGI or touch a socket (kit_http serves the routes, frames the chunks as SSE and
maps errors to statuses), reach a deck, the Runtime or the store, import an SDK, or accept a
request it cannot honour by quietly dropping part of it (a part, role or field it cannot carry,
in any message, is a ``ChatRequestError``, HTTP 400), or say one thing streamed and another not.

Theory of operation
-------------------
``model`` names an agent (a workflow is not a model). The last message must be the user's: its
content (a string, or ``text``, ``image_url`` with a ``data:`` URL and ``input_audio`` parts)
becomes the turn's input blocks. Every message is a role and its content, which is all a
``HistoryMessage`` holds: a ``tool`` or ``function`` message, or any other field with a value
(``tool_calls``, ``function_call``, ``name``, ``audio``, ``refusal``, ...), is refused naming the
message's index, never dropped (a field sent as null or empty carries nothing, and passes); so
is a content part's field its block cannot hold (an image's ``detail`` other than ``auto``, a
``cache_control``), or a part with no data, named by its index too (``messages[2].content[1]``).
kit's agents call their own tools, so a conversation holding another system's tool calls is not
one they can carry on faithfully.

The conversation is kit's session when the request names one: the ``x-kit-session-id`` header,
else ``metadata.session_id`` (the first one sent is checked, an empty one refused). ``user``
names an end user, not a conversation: clients send it with every chat of that user (LibreChat
does), so read as a session it would merge them all into one. The session
already holds what came before, so the earlier messages of the request are the client's copy of
it: checked like any (one kit could not carry is still a 400, so nothing passes silently) and
then not replayed; the session, not the client's copy, is what the model reads. Without a
session the turn is one-off and the earlier messages are its ``history``: ``HistoryMessage``s in
their roles, which the agent's model reads before the input and which ``run.started`` records
beside it. That keeps the log truthful: it holds the conversation the model was given, in its
roles, rather than a transcript flattened into the input or a session that no run in the log
ever wrote.

The answer's content is one rule in both modes, a fold of the run's events (``Chunks.text``):
the text of every message the run's models wrote, in order, a blank line between two messages
(a model often says something before it calls a tool, then answers once the tool is done), or,
for a run that wrote none (its output came from a tool), its output as text. A stream cannot
know which message will be the last while it plays, so it sends them all; the JSON answer folds
the run's log by the same rule, so it says exactly what its stream would have.

Sampling parameters (``temperature``, ``max_tokens``, ...) and the client's own ``tools`` are not
the client's to set: the agent's own model settings and tools apply (a text answer reads as one
where the model called no tool). A field that asks for an answer of another shape is refused,
never ignored, since the client would read what it did not ask for: a ``tool_choice`` that
demands a call, a ``response_format`` other than text (the agent's output type is the answer's
shape), ``logprobs``, audio out. ``n`` may be 1 only: an agent answers once a turn, and an
answer with fewer choices than asked would break a client that reads them. Usage comes from the
run's ``run.completed``
(the run's authoritative total), in the body or in the final chunk, which also carries
``finish_reason``; ``data: [DONE]`` ends a stream (``DONE``). A run that fails partway ends its
stream with one ``data: {"error": {...}}`` frame, which OpenAI clients raise as an ``APIError``;
so does a stream the server stops (kit_http builds that frame from ``error_body``: OpenAI clients
ignore event names and would read kit's ``event: server.shutdown`` frame as one more chunk).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kit_core import (
    HISTORY_ROLES, AudioBlock, ConfigError, ContentBlock, ContentError, Event, HistoryMessage,
    ImageBlock, KitError, RunCancelled, RunCompleted, RunFailed, RunPaused, RunStarted,
    RunStoppedError, TextBlock, TextDelta, Usage, check_id, jsonable, quoted,
)

__all__ = ("ChatTurn", "ChatRequestError", "Chunks", "DONE", "SESSION_HEADER", "MESSAGE_BREAK",
           "read_request", "completion", "model_list", "model_object", "error_body")

#: The header that names a request's session (kit's; OpenAI clients send extra headers as asked).
SESSION_HEADER = b"x-kit-session-id"
#: The data of a stream's last frame, as OpenAI sends it.
DONE = "[DONE]"
#: The fields of a message kit carries: a ``HistoryMessage`` is a role and its content. Any other
#: field with a value is one kit would drop, so it is refused (module docstring).
_CARRIED = frozenset({"role", "content"})
#: Between the text of two messages of one answer: a paragraph break, as a reader expects.
MESSAGE_BREAK = "\n\n"
_TOOLS = ("kit agents call their own tools and answer no tool calls; leave the choice to the "
          "model (auto) or send none")
#: Request fields that ask for an answer kit's agents cannot give, each with the values that ask
#: nothing kit does not give (besides null and empty) and why any other is refused: ignored, the
#: client would read an answer of another shape than it asked for (module docstring). A client's
#: own ``tools`` are ignored, not refused: coding assistants and chat front ends offer theirs
#: with every request and read a text answer as one where the model called none.
_UNHONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tool_choice": (("auto", "none"), _TOOLS), "function_call": (("auto", "none"), _TOOLS),
    "response_format": (({"type": "text"},), "the agent's output type is the answer's shape (an "
                        "agent with one answers its JSON); send none or {'type': 'text'}"),
    "logprobs": ((False,), "kit answers no log probabilities"),
    "top_logprobs": ((0,), "kit answers no log probabilities"),
    "modalities": ((["text"],), "kit agents answer text"), "audio": ((), "kit agents answer text"),
}


class ChatRequestError(KitError):
    """A Chat Completions request kit cannot honour as sent: malformed, a role, field or content
    part kit cannot carry (a ``tool`` message, ``tool_calls``, an image by URL), or no user
    message last. HTTP 400."""


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """What a Chat Completions request asks of the deck: one turn of agent ``model``."""
    model: str
    input: tuple[ContentBlock, ...]
    session_id: str | None
    history: tuple[HistoryMessage, ...]
    stream: bool


def _sent(fields: Mapping[str, Any], carried: Any) -> list[str]:
    """The names, sorted, of ``fields`` outside ``carried`` sent with a value: one sent as null
    or empty carries nothing (SDKs echo ``"refusal": null``, ``"tool_calls": []`` back)."""
    return sorted(k for k, v in fields.items() if k not in carried and v not in (None, "", [], {}))


def read_request(body: Mapping[str, Any], session_header: str | None = None) -> ChatTurn:
    """The turn a ``POST /v1/chat/completions`` body asks for (module docstring). Every message
    is checked, with a session too (where the earlier ones are then not replayed).

    Raises ``ChatRequestError`` for a malformed body, a role, field or part kit cannot carry (an
    image or audio part with no data too), a field asking for an answer kit cannot give
    (``tool_choice``, ...), or a last message that is not the user's; ``ContentError`` for a
    malformed image or audio payload. Either names the message at fault, and its part when a part
    is (``messages[2]: ...``, ``messages[2].content[1]: ...``).
    """
    model, messages, stream = body.get("model"), body.get("messages"), body.get("stream")
    if stream is None:  # absent or null: OpenAI's API reads both as not streamed
        stream = False
    if not isinstance(model, str) or not model:
        raise ChatRequestError("'model' must name an agent (GET /v1/models lists them)")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise ChatRequestError("'messages' must be a non-empty list of message objects")
    if not isinstance(stream, bool):
        raise ChatRequestError("'stream' must be true or false")
    if (n := body.get("n")) is not None and (type(n) is not int or n != 1):
        raise ChatRequestError(f"'n' must be 1: an agent answers once a turn, got {n!r}")
    for field in _sent(body, ()):
        if field in _UNHONOURED and body[field] not in _UNHONOURED[field][0]:
            raise ChatRequestError(f"kit cannot honour {field!r}: {_UNHONOURED[field][1]}")
    *earlier, last = messages
    if last.get("role") != "user":
        raise ChatRequestError(f"messages[{len(earlier)}]: the last message must be the user's: "
                               "it is the turn's input")
    metadata = body.get("metadata")
    named = (session_header, metadata.get("session_id") if isinstance(metadata, Mapping) else None)
    # The first one given: an empty one is refused (check_id), never passed over for a one-off turn.
    session_id = next((s for s in named if s is not None), None)
    if session_id is not None:
        try:
            check_id("a session id (x-kit-session-id or metadata.session_id)", session_id)
        except ConfigError as exc:
            raise ChatRequestError(str(exc)) from None
    carried = [_message(i, m) for i, m in enumerate(messages)]
    history = () if session_id else tuple(carried[:-1])  # with a session, the session is it
    return ChatTurn(model, carried[-1].content, session_id, history, stream)


def _message(index: int, message: Mapping[str, Any]) -> HistoryMessage:
    """Message ``index`` as kit carries it, or the error that names it (and its part) and why not."""
    at = f"messages[{index}]"
    try:
        role = message.get("role")
        if role not in HISTORY_ROLES:
            raise ChatRequestError(f"kit cannot carry a {quoted(role)} message: kit agents call their "
                                   "own tools; send system, developer, user and assistant messages")
        dropped = _sent(message, _CARRIED)  # (a field sent empty carries nothing)
        if dropped:
            raise ChatRequestError(
                f"kit cannot carry a message's {', '.join(map(repr, dropped))} (a message here "
                "is its role and its content; kit agents call their own tools)")
        content = message.get("content")  # a string, or a list of text, image and audio parts
        if isinstance(content, str):
            return HistoryMessage(role, (TextBlock(content),))
        if not isinstance(content, list) or not content:
            raise ChatRequestError("a message's content must be a string or a non-empty list of parts")
        blocks: list[ContentBlock] = []
        for j, part in enumerate(content):
            at = f"messages[{index}].content[{j}]"
            blocks.append(_block(part))
        return HistoryMessage(role, tuple(blocks))
    except ChatRequestError as exc:
        raise ChatRequestError(f"{at}: {exc}") from None
    except ContentError as exc:
        raise ContentError(f"{at}: {exc}") from None


def _block(part: Any) -> ContentBlock:
    if not isinstance(part, Mapping):
        raise ChatRequestError(f"a content part must be an object with a 'type', got "
                               f"{type(part).__name__}")
    kind = part.get("type")
    # As for a message's fields: one with a value that the block cannot hold is refused, never
    # dropped (a text part's cache_control, an image's detail other than the "auto" kit sends).
    image = part.get("image_url")
    dropped = _sent(part, ("type", kind))
    if kind == "image_url" and isinstance(image, Mapping):
        dropped += [f"image_url.{k}" for k in _sent(image, ("url",))
                    if (k, image[k]) != ("detail", "auto")]
    if dropped and kind in ("text", "image_url", "input_audio"):
        raise ChatRequestError(f"kit cannot carry a {kind} part's {', '.join(map(repr, dropped))}")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ChatRequestError("a text part needs a string 'text'")
        return TextBlock(part["text"])
    if kind == "image_url":
        url = image.get("url") if isinstance(image, Mapping) else image
        media_type, sep, data = (url[5:] if isinstance(url, str) and url.startswith("data:")
                                 else "").partition(";base64,")
        if not sep:
            raise ChatRequestError("an image_url part must carry a base64 data: URL; kit keeps "
                                   "what the model saw in its log and fetches nothing")
        if not data:  # valid base64 of nothing: the model would be sent an empty image
            raise ChatRequestError("an image_url part's data: URL carries no data")
        return ImageBlock(media_type, data)
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, Mapping) or not isinstance(audio.get("format"), str):
            raise ChatRequestError("an input_audio part needs input_audio.data and .format")
        if audio.get("data") == "":
            raise ChatRequestError("an input_audio part's input_audio.data carries no data")
        fmt = {"mp3": "mpeg"}.get(audio["format"], audio["format"])
        return AudioBlock(f"audio/{fmt}", audio.get("data"))
    raise ChatRequestError(f"kit cannot carry a content part of type {quoted(kind)}; "
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


def completion(run_id: str, model: str, events: Iterable[Event]) -> dict[str, Any]:
    """The ``chat.completion`` body of a finished turn (its ``id`` names the run) from its log's
    ``events``: the content its stream would have carried (``Chunks.text``), the usage of its
    ``run.completed``."""
    chunks, content, usage = Chunks(model), [], Usage()
    for event in events:
        content.append(chunks.text(event))
        if isinstance(event.payload, RunCompleted):
            usage = event.payload.usage
    return {"id": f"chatcmpl-{run_id}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": "".join(content),
                                     "refusal": None}}],
            "usage": _usage(usage)}


class Chunks:
    """The chunks of one streamed completion, built one event at a time.

    ``chunks(event)`` is what that event adds to the stream (a list of JSON objects and
    ``DONE``): ``run.started`` the first chunk (the assistant's role), each ``text.delta`` a chunk
    of content (``text``: the same fold ``completion`` makes), ``run.completed`` the final chunk
    (``finish_reason`` and usage) and ``DONE``, after the output as content when the run wrote
    no text; an ending without a result one error object; any other event nothing.
    """
    __slots__ = ("model", "id", "created", "message", "said")

    def __init__(self, model: str) -> None:
        self.model, self.id, self.created = model, "chatcmpl-", int(time.time())
        self.message: str | None = None  # the message_id of the last text sent
        self.said = False  # any text sent yet

    def text(self, event: Event) -> str:
        """What ``event`` adds to the answer's content: the one rule of both modes (module
        docstring). A delta of a new message starts with ``MESSAGE_BREAK``; ``run.completed``
        of a run that wrote no text adds its output as text."""
        p = event.payload
        if type(p) is TextDelta and p.text:
            fresh = self.said and event.message_id != self.message
            self.message, self.said = event.message_id, True
            return MESSAGE_BREAK + p.text if fresh else p.text
        if isinstance(p, RunCompleted) and not self.said and p.output is not None:
            self.said = True
            return _text(p.output)
        return ""

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                **extra}

    def __call__(self, event: Event) -> list[dict[str, Any] | str]:
        p = event.payload
        if type(p) is TextDelta:
            text = self.text(event)
            return [self._chunk({"content": text})] if text else []
        if type(p) is RunStarted:
            self.id = f"chatcmpl-{event.run_id}"
            return [self._chunk({"role": "assistant", "content": ""})]
        if isinstance(p, RunCompleted):
            text = self.text(event)
            content = [self._chunk({"content": text})] if text else []
            return [*content, self._chunk({}, "stop", usage=_usage(p.usage)), DONE]
        if isinstance(p, RunFailed):
            return [error_body(500, p.error, f"run {event.run_id} failed ({p.error}); its log "
                                             "has the details")]
        if isinstance(p, (RunCancelled, RunPaused)):  # what deck.run raises for them
            stopped = RunStoppedError(event.run_id, p.status, p.reason)
            return [error_body(409, type(stopped).__name__, str(stopped))]
        return []


def model_list(agents: Iterable[str], created: int) -> dict[str, Any]:
    """The ``GET /v1/models`` body: every agent is a model, ``created`` at that Unix time."""
    return {"object": "list", "data": [model_object(name, created) for name in sorted(agents)]}


def model_object(agent: str, created: int) -> dict[str, Any]:
    """The model that is agent ``agent``: the ``GET /v1/models/{model}`` body, an item of the
    list. ``created`` is the caller's (kit_http: when the deck opened), never the request's
    time, which would change on every call."""
    return {"id": agent, "object": "model", "created": created, "owned_by": "kit"}


def error_body(status: int, error: str, message: str) -> dict[str, Any]:
    """OpenAI's error shape; ``code`` is kit's exception type name (``SessionBusyError``, ...)."""
    return {"error": {"message": message, "param": None, "code": error,
                      "type": "invalid_request_error" if status < 500 else "server_error"}}

