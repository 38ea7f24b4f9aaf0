"""kit_scripted: ``ScriptedModel``, a deterministic offline model for tests, demos and benchmarks.

Owns: ``ScriptedModel``, an ``agents.Model`` that replies from a script (text streamed token by
token, tool calls, structured output, refusals, raised errors) with real usage counts.

Must never: touch the network, a store or the Runtime; import a kit module above ``kit_core``.

Theory of operation: each model call takes the next turn of the script and answers it in the exact
shapes a Responses-API provider would: ``get_response`` one ``ModelResponse``, ``stream_response``
the event sequence created, output_item.added, content_part.added, N text deltas, ..., completed
(notes/PERF.md section 1), so the SDK and kit's tapped model see what a real provider sends.
"""
from __future__ import annotations

import itertools
import json
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import agents as _sdk
from openai.types.responses import (
    Response, ResponseCompletedEvent, ResponseContentPartAddedEvent, ResponseContentPartDoneEvent,
    ResponseCreatedEvent, ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent, ResponseFunctionToolCall, ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent, ResponseOutputMessage, ResponseOutputRefusal, ResponseOutputText,
    ResponseRefusalDeltaEvent, ResponseRefusalDoneEvent, ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)
from openai.types.responses.response_usage import (
    InputTokensDetails, OutputTokensDetails, ResponseUsage,
)

from kit_core import ConfigError

__all__ = ("ScriptedModel", "DEFAULT_NAME")

#: The model name a ScriptedModel reports unless it is given one: no price table holds it, so
#: kit prices it at None without loading one.
DEFAULT_NAME = "scripted"


def _tokens(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+$", text) or ([text] if text else [])


def _check_turn(i: int, turn: Any) -> None:
    """Refuse a script entry the model could not answer, naming it (SPEC: ConfigError at build)."""
    if isinstance(turn, (str, BaseException)):
        return
    if isinstance(turn, Mapping) and isinstance(turn.get("refusal"), str):
        return
    if isinstance(turn, Mapping) and "json" in turn:
        try:  # NaN and infinities are not JSON (RFC 8259), though Python writes them
            json.dumps(turn["json"], allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"ScriptedModel: turn {i}: 'json' is not JSON ({e})") from None
        return
    calls = turn if isinstance(turn, (list, tuple)) else [turn]
    if not calls:
        raise ConfigError(f"ScriptedModel: turn {i} is an empty list of tool calls")
    for c in calls:
        if not (isinstance(c, Mapping) and isinstance(c.get("tool"), str)):
            raise ConfigError(
                f"ScriptedModel: turn {i} must be a str, {{'tool': name, 'args': {{...}}}} (or a "
                f"list of them), {{'json': obj}}, {{'refusal': str}} or an exception instance, "
                f"got {c!r:.80}")
        args = c.get("args", {})
        if not isinstance(args, Mapping):
            raise ConfigError(f"ScriptedModel: turn {i}: 'args' of tool call {c['tool']!r} must be "
                              f"a dict, got {type(args).__name__}")
        try:
            json.dumps(args, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"ScriptedModel: turn {i}: 'args' of tool call {c['tool']!r} "
                              f"are not JSON ({e})") from None


class ScriptedModel(_sdk.Model):
    """A deterministic, offline ``agents.Model`` for tests, benchmarks and demos.

    ``script`` is a list of turns, one per model call: a ``str`` is a text reply (streamed one
    token, a word with its leading space, per delta); ``{"tool": name, "args": {...}}`` (or a list
    of them) calls tools; ``{"json": obj}`` replies with structured output; ``{"refusal": text}``
    refuses (a message whose one part is a refusal, streamed as refusal deltas, as OpenAI's
    models refuse); an exception instance is raised. With ``cycle=True`` the script repeats
    forever. Usage counts are real: input tokens are the tokens of the instructions and input it
    was sent, output tokens those it produced.
    ``name`` is the model name reported (and priced). ``calls`` keeps the last 64 requests.

    Raises ``ConfigError`` for a malformed script (checked here, not at the call that reaches
    the bad entry; one turn not in a list is refused too), a ``cycle`` that is not a bool or a
    ``name`` that is not a non-empty str, and when the script is exhausted.
    """

    def __init__(self, script: Sequence[Any], *, name: str = DEFAULT_NAME, cycle: bool = False) -> None:
        if isinstance(script, Mapping):  # its keys would be the turns: replies "tool", "args"
            raise ConfigError(f"ScriptedModel: script takes a list of turns; {script!r:.60} is "
                              f"one turn, not a list of them: wrap it, [{script!r:.40}]")
        if isinstance(script, (str, bytes)) or not isinstance(script, Iterable):
            # a str would be taken for a script of one-character replies
            raise ConfigError(f"ScriptedModel: script takes a list of turns, got {script!r:.60}")
        if not isinstance(cycle, bool):  # bool("no") is True
            raise ConfigError(f"ScriptedModel: cycle must be True or False, got {cycle!r:.60}")
        if not isinstance(name, str) or not name:  # the model name recorded and priced
            raise ConfigError(f"ScriptedModel: name must be a non-empty str, got {name!r:.60}")
        self.script, self.model, self.cycle = list(script), name, cycle
        for i, turn in enumerate(self.script):
            _check_turn(i, turn)
        if cycle and not self.script:
            raise ConfigError("ScriptedModel: cycle=True needs a script of at least one turn")
        self._next = 0
        self._ids = itertools.count(1)
        self.calls: deque[dict[str, Any]] = deque(maxlen=64)

    def _turn(self, instructions: str | None, input: Any, tools: Sequence[Any]) -> Any:
        self.calls.append({"instructions": instructions, "input": input,
                           "tools": [t.name for t in tools]})
        if self._next >= len(self.script):
            if not (self.cycle and self.script):
                raise ConfigError(f"ScriptedModel script exhausted after {len(self.script)} turns "
                                  "(each model call takes one entry; pass cycle=True to repeat it)")
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
        if isinstance(turn, Mapping) and "refusal" in turn:
            msg = ResponseOutputMessage(
                id=f"msg_{n}", type="message", role="assistant", status="completed",
                content=[ResponseOutputRefusal(type="refusal", refusal=turn["refusal"])])
            return [msg], len(_tokens(turn["refusal"]))
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
            if item.type == "message":  # one part: text, or a refusal (streamed as OpenAI's)
                part = item.content[0]
                field, kind, extra, delta, done = (
                    ("refusal", "refusal", {}, ResponseRefusalDeltaEvent, ResponseRefusalDoneEvent)
                    if part.type == "refusal" else ("text", "output_text", {"logprobs": []},
                                                    ResponseTextDeltaEvent, ResponseTextDoneEvent))
                text = getattr(part, field)
                yield ResponseOutputItemAddedEvent(
                    type="response.output_item.added", output_index=idx, sequence_number=next(seq),
                    item=item.model_copy(update={"content": [], "status": "in_progress"}))
                yield ResponseContentPartAddedEvent(
                    type="response.content_part.added", item_id=item.id, output_index=idx,
                    content_index=0, sequence_number=next(seq),
                    part=part.model_copy(update={field: ""}))
                for tok in _tokens(text):
                    yield delta(type=f"response.{kind}.delta", item_id=item.id, output_index=idx,
                                content_index=0, delta=tok, sequence_number=next(seq), **extra)
                yield done(type=f"response.{kind}.done", item_id=item.id, output_index=idx,
                           content_index=0, sequence_number=next(seq), **{field: text}, **extra)
                yield ResponseContentPartDoneEvent(
                    type="response.content_part.done", item_id=item.id, output_index=idx,
                    content_index=0, part=part, sequence_number=next(seq))
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
