"""kit_agents: the openai-agents engine: agents compiled for the SDK and played on a run handle.

Owns: compiling an ``Agent`` (``compile_agent``: its model tapped so every chunk reaches the log,
its tools, its hooks handed a ``Context``, its skills' catalog, its MCP servers), playing one
turn (``AgentEngine.play``, with the session history the agent's limit lets through:
``AgentEngine.limited``), the headless ``Agent.run`` (``run_headless``), and the SDK settings a
deck applies (default API, trace processors, run config). The tools themselves are kit_tools'
(plain functions compiled, SDK tools watched, ``load_skill``, an MCP call's error); the
conversation-memory sessions are kit_sessions'; the MCP servers the tools come from,
kit_mcp_servers'; a model call's price in USD, kit_prices' (``model_usd``).

Must never: reach the event store or the Runtime (a run is played through the ``RunHandle`` it is
given), import kit_runtime or anything above it, touch asyncio directly (kit_bridge does), or
write the application context anywhere (it reaches tools, instructions and hooks by reference).

Theory of operation
-------------------
Deck runs call the non-streamed ``Runner.run`` for both ``run`` and ``stream``: the tapped model
(``_TapModel``) emits ``text.delta`` per chunk itself when the run streams, consuming the inner
model's ``stream_response`` and building the same ``ModelResponse`` the runner would have. The
hooks (``_KitHooks``) make ``tool.started`` durable before a tool runs, record ``tool.completed``
after it, and hold the agents' safe point: before each model call a pause or cancel request
stops the run there with every finished turn kept in the session (notes/ENGINES.md 4); a turn's
items reach the session only as the run's end commits (kit_sessions); a run that fails, or is
cut short, ends its open tool calls first. The run handle travels as the SDK's run context
(``context=run``); the caller's object is ``run.data``.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import os
import typing
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import agents as sdk
import anyio
from agents.memory import OpenAIConversationsSession, SessionSettings
from agents.models import get_default_model
from agents.models._response_terminal import (
    response_error_event_failure_error, response_terminal_failure_error,
)
from openai.types.responses import Response

from kit_bridge import on_asyncio
from kit_context import HOOK_METHODS
from kit_core import (
    AudioBlock, ConfigError, ContentError, Context, ControlRequested, DataBlock, Event,
    HistoryMessage, ImageBlock, InvocableSpec, MessageCompleted, ModelCompleted, ResourceBlock,
    RunCancelled, RunCompleted, RunHandle, RunPaused, TextBlock, TextDelta, ToolCompleted,
    ToolStarted, as_blocks, check_limit, jsonable, quoted,
)
from kit_prices import model_usd
from kit_scripted import ScriptedModel
from kit_tools import (
    OPEN_CALLS, call_id, compile_tool, end_open_calls, mcp_tool_error, skill_catalog, skill_tool,
    tool_origin, watched,
)

if TYPE_CHECKING:
    from kit_catalog import Agent, Skill

__all__ = ("compile_agent", "run_headless", "warm_up", "no_default_exporter", "AgentEngine",
           "YIELD_EVERY")

#: A streaming model call lets the loop run other tasks at least every this many events.
YIELD_EVERY = 64
#: The SDK's tool classes: an agent's tool that is one of these passes through as built.
SDK_TOOLS = tuple(typing.get_origin(t) or t for t in typing.get_args(sdk.Tool))


# ========================================================================= recording a turn ====

#: The run a model call belongs to (set around Runner.run; the SDK's tasks inherit it).
_CURRENT_RUN: contextvars.ContextVar[RunHandle | None] = contextvars.ContextVar("kit_run", default=None)
#: This play of a run: its (input, output) tokens when the play began (the SDK's usage counts
#: the play's model calls only; a resumed run's earlier ones are in its log), how many of its
#: agent tools are running, and the cached input tokens of the calls kit recorded in it
#: (``_record_untapped``).
_PLAY: contextvars.ContextVar[list[int]] = contextvars.ContextVar("kit_play")


def _message_text(item: Any) -> str:
    return "".join(getattr(part, "text", "") or "" for part in getattr(item, "content", ()) or ())


def _reply(item: Any) -> bool:
    """Whether an output item is a reply: a message, unless a refusal (parts that refuse, none
    text), no completed message: the SDK fails the run (``ModelRefusalError``, which quotes it)."""
    parts = [getattr(p, "type", None) for p in getattr(item, "content", None) or ()]
    return getattr(item, "type", None) == "message" and ("refusal" not in parts
                                                          or "output_text" in parts)


#: Set on an exception of a model call whose streamed text reached the log before it failed.
_PARTIAL = "_kit_partial_reply"


class _TapModel(sdk.Model):
    """Wraps an agent's model so its output is recorded as it is produced.

    Deck runs use the non-streamed ``Runner.run`` for both ``run`` and ``stream``: when the run
    streams, ``get_response`` consumes the inner model's ``stream_response`` itself, emitting a
    ``text.delta`` per chunk in the engine's own order, and returns the same ``ModelResponse``
    the runner would have built. That skips the SDK's stream-event machinery (a queue hop and two
    wrapper objects per token) while keeping text, tools and usage exactly as the SDK sees them.

    With ``windowed`` (the agent has a history limit) the input loses the tool results whose
    call the window cut off (``_within_window``) before the inner model gets it.
    """

    def __init__(self, agent: str, model: str | sdk.Model | None, windowed: bool = False) -> None:
        self.agent, self.windowed, self._model = agent, windowed, model
        self._inner: sdk.Model | None = model if isinstance(model, sdk.Model) else None

    def inner(self) -> sdk.Model:
        if self._inner is None:  # resolved on first use: building the client needs settings
            self._inner = sdk.MultiProvider().get_model(self._model)  # type: ignore[arg-type]
        return self._inner

    def model_name(self) -> str:
        inner = self.inner()
        return str(getattr(inner, "model", None) or self._model or type(inner).__name__)

    def get_retry_advice(self, request: Any) -> Any:
        """The inner model's retry advice, unless the failed attempt streamed text to the log
        already: a retry would record the reply twice (the attempt's deltas, then the whole
        reply), so it is unsafe, as the SDK's own streaming path rules."""
        if getattr(request.error, _PARTIAL, False):
            from agents.retry import ModelRetryAdvice
            return ModelRetryAdvice(suggested=False, replay_safety="unsafe",
                                    reason="the failed attempt's text is in the log already")
        return self.inner().get_retry_advice(request)

    def known_name(self) -> str:
        """The model's name as far as it is known without building a client (which needs
        settings, an API key): the name it was given, its model object's own, or the SDK's
        default model."""
        if isinstance(self._model, str):
            return self._model
        if self._inner is not None:
            return str(getattr(self._inner, "model", None) or type(self._inner).__name__)
        return get_default_model()

    async def get_response(self, system_instructions, input, model_settings, tools, output_schema,
                           handoffs, tracing, *, previous_response_id=None, conversation_id=None,
                           prompt=None) -> Any:
        run, inner = _CURRENT_RUN.get(), self.inner()
        if self.windowed:
            input = _within_window(input)
        args = (system_instructions, input, model_settings, tools, output_schema, handoffs, tracing)
        kw = dict(previous_response_id=previous_response_id, conversation_id=conversation_id,
                  prompt=prompt)
        if run is None:
            return await inner.get_response(*args, **kw)
        ids: dict[int, str] = {}
        answered = None  # the model the response says answered (a streamed Responses reply's)
        if run.streaming:
            try:
                response, answered = await self._stream(run, inner.stream_response(*args, **kw), ids)
            except Exception as exc:
                if ids:  # this attempt's text is in the log: not to be retried (get_retry_advice)
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(exc, _PARTIAL, True)
                raise
        else:
            response = await inner.get_response(*args, **kw)
            for i, item in enumerate(response.output):
                if _reply(item):
                    ids[i] = run.message_id()
                    run.emit(TextDelta(_message_text(item)), origin=self._origin(run),
                             message_id=ids[i])
        self._record(run, response, output_schema, ids, answered)
        return response

    async def _stream(self, run: RunHandle, stream: AsyncIterator[Any], ids: dict[int, str]
                      ) -> tuple[Any, str | None]:
        """The stream's ``ModelResponse``, as the runner would build it, and the model its final
        response says answered (the SDK's ``ModelResponse`` has no field for it)."""
        origin, final, done_items = self._origin(run), None, []
        async for ev in stream:
            kind = getattr(ev, "type", None)
            if run.seq % YIELD_EVERY == 0:
                # A model whose stream never waits (a scripted one, a fast local one) would
                # otherwise hold the loop for a whole reply: streams, observers and other runs
                # get their turn every YIELD_EVERY events, and the run waits while the log is
                # behind (it never runs far ahead of what is committed).
                await run.pace()
            if kind == "response.output_text.delta" and ev.delta:  # (an empty chunk is no
                # text: Chat Completions streams open with one, which the SDK passes on)
                mid = ids.get(ev.output_index)
                if mid is None:
                    mid = ids[ev.output_index] = run.message_id()
                run.emit(TextDelta(ev.delta), origin=origin, message_id=mid)
            elif kind == "response.output_item.done":
                done_items.append(ev.item)
            elif kind == "response.completed":
                final = ev.response
            elif kind in ("response.failed", "response.incomplete"):
                # The SDK's own words, which say why (the response's status and error)
                response = getattr(ev, "response", None)
                raise response_terminal_failure_error(
                    kind, response if isinstance(response, Response) else None)
            elif kind in ("error", "response.error"):
                raise response_error_event_failure_error(kind, ev)
        if final is None:
            raise sdk.ModelBehaviorError("Model did not produce a final response!")
        output = final.output or done_items  # some backends leave the final output empty
        u = final.usage
        usage = sdk.Usage(requests=1, input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                          total_tokens=u.total_tokens, input_tokens_details=u.input_tokens_details,
                          output_tokens_details=u.output_tokens_details) if u else sdk.Usage()
        return (sdk.ModelResponse(output=output, usage=usage, response_id=final.id),
                getattr(final, "model", None) or None)

    def _origin(self, run: RunHandle) -> str:
        return run.origin if self.agent == run.origin else f"{run.origin}/{self.agent}"

    def _record(self, run: RunHandle, response: Any, output_schema: Any, ids: dict[int, str],
                answered: str | None = None) -> None:
        origin = self._origin(run)
        calls_tools = any(getattr(i, "type", None) == "function_call" for i in response.output)
        for i, item in enumerate(response.output):
            if not _reply(item):
                continue
            text, output = _message_text(item), None
            if output_schema is not None and not output_schema.is_plain_text() and not calls_tools:
                try:
                    output = jsonable(output_schema.validate_json(text))
                except Exception:  # the runner reports invalid output itself
                    output = None
            run.emit(MessageCompleted(text, output, self.agent), origin=origin,
                     message_id=ids.get(i) or run.message_id())  # (a reply streamed no text)
        model = self.model_name()
        u = response.usage
        # No tokens at all is a server that reported no usage (Chat Completions streamed from a
        # server other than OpenAI's, without ModelSettings(include_usage=True)): the cost is
        # unknown, not zero.
        reported = u.input_tokens or u.output_tokens
        cached = min(getattr(u.input_tokens_details, "cached_tokens", None) or 0, u.input_tokens)
        if (play := _PLAY.get(None)) is not None:
            play[3] += cached
        url = getattr(getattr(self.inner(), "_client", None), "base_url", None)
        usd = model_usd(model, u.input_tokens, u.output_tokens, cached,
                        str(url) if url else None) if reported else None
        run.add_usage(u.input_tokens, u.output_tokens, usd)
        run.emit(ModelCompleted(model, u.input_tokens, u.output_tokens, usd,
                                answered if answered != model else None, cached), origin=origin)

    async def stream_response(self, system_instructions: Any, input: Any, *args: Any,
                              **kw: Any) -> AsyncIterator[Any]:
        if self.windowed:
            input = _within_window(input)
        async for ev in self.inner().stream_response(system_instructions, input, *args, **kw):
            yield ev


class _Stop(sdk.AgentsException):
    """Raised at a safe point to stop a run that was asked to pause or cancel."""

    def __init__(self, action: str, reason: str | None) -> None:
        super().__init__(f"{action} requested")
        self.action, self.reason = action, reason


class _FencedSession:
    """A run's session as the SDK sees it: each write waits till the log holds all before it
    (``RunHandle.synced``), so a run stops at its next step once the store is given up on. (The
    conversation's fence is the turn's view, kit_sessions' ``_TurnSession``, written only as the
    run's end commits: a reaped run adds nothing to it, an OpenAI Conversations one included.)"""

    def __init__(self, session: Any, run: RunHandle) -> None:
        self._session, self._run = session, run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    async def add_items(self, items: list[Any]) -> None:
        await self._run.synced()
        await self._session.add_items(items)


class _KitHooks(sdk.RunHooks):
    """Records tool calls (``tool.started`` durable before the tool runs, then
    ``tool.completed``) and holds the agents' safe point: before each model call, a run asked to
    pause or cancel stops there, with every finished turn kept (notes/ENGINES.md 4)."""

    async def on_llm_start(self, context: Any, agent: Any, system_prompt: Any, input_items: Any) -> None:
        run = context.context
        requested = run.take_request() if isinstance(run, RunHandle) else None
        if requested is not None:
            action, reason, source = requested
            run.emit(ControlRequested(action, reason, source))
            raise _Stop(action, reason)

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        run = context.context
        if isinstance(run, RunHandle):
            if getattr(tool, "_is_agent_tool", False):
                _PLAY.get()[2] += 1
            cid, origin = call_id(context), tool_origin(run, agent, tool)
            OPEN_CALLS.get({})[cid] = (tool.name, origin)
            await run.durable(ToolStarted(cid, tool.name, getattr(context, "tool_arguments", "")
                                          or ""), origin=origin)

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        run = context.context
        if isinstance(run, RunHandle):
            if getattr(tool, "_is_agent_tool", False):
                _record_untapped(run, context, agent, tool)
            cid = call_id(context)
            OPEN_CALLS.get({}).pop(cid, None)
            failed = cid in run.tool_errors
            run.tool_errors.discard(cid)  # a provider may use the id again (Kimi's: per turn)
            run.emit(ToolCompleted(cid, tool.name, jsonable(result), failed),
                     origin=tool_origin(run, agent, tool))


def _record_untapped(run: RunHandle, context: Any, agent: Any, tool: Any) -> None:
    """An agent played as a tool (``Agent.as_tool``) calls its own model, which kit does not
    wrap; the SDK counts those calls in the run's usage (the agent's run shares it). What it
    counted beyond the calls kit recorded in this play is theirs: one ``model.completed`` of
    that agent's model, so the run's usage holds them. They are priced as that model's only
    when they can be nothing else: when no other agent tool ran meanwhile and the agent has no
    agent tools of its own; else their cost is unknown (None)."""
    play, usage = _PLAY.get(), getattr(context, "usage", None)
    alone, play[2] = play[2] == 1, play[2] - 1
    if usage is None:
        return
    extra_in = max(usage.input_tokens - (run.input_tokens - play[0]), 0)
    extra_out = max(usage.output_tokens - (run.output_tokens - play[1]), 0)
    if not (extra_in or extra_out):
        return
    cached = getattr(usage.input_tokens_details, "cached_tokens", None) or 0
    extra_cached, play[3] = min(max(cached - play[3], 0), extra_in), max(cached, play[3])
    inner = getattr(tool, "_agent_instance", None)
    model = getattr(inner, "model", None)
    name = get_default_model() if model is None else model if isinstance(model, str) else str(
        getattr(model, "model", None) or type(model).__name__)
    nested = any(getattr(t, "_is_agent_tool", False) for t in getattr(inner, "tools", ()))
    usd = model_usd(name, extra_in, extra_out, extra_cached) if alone and not nested else None
    run.add_usage(extra_in, extra_out, usd)
    run.emit(ModelCompleted(name, extra_in, extra_out, usd, None, extra_cached),
             origin=tool_origin(run, agent, tool))


_HOOKS = _KitHooks()


def _data(wrapper: Any) -> Any:
    """The caller's context object for an SDK context wrapper (None on headless runs)."""
    run = getattr(wrapper, "context", None)
    return run.data if isinstance(run, RunHandle) else None


def _instructions(agent: Agent, suffix: str = "") -> Any:
    """The agent's instructions for the SDK; ``suffix`` (the skill catalog) follows them,
    whether they are text or a callable."""
    fn = agent.instructions
    if fn is None or isinstance(fn, str):
        return f"{fn or ''}{suffix}".lstrip() if suffix else fn

    async def instructions(wrapper: Any, sdk_agent: Any) -> str:
        out = fn(Context(_data(wrapper)), sdk_agent)
        out = await out if inspect.isawaitable(out) else out
        return f"{out or ''}{suffix}" if suffix else out

    return instructions


class _UserHooks(sdk.AgentHooks):
    """The agent's own hooks object, called with a ``Context`` in place of the SDK's context."""

    def __init__(self, user: Any) -> None:
        self.user = user

    async def _call(self, name: str, wrapper: Any, *args: Any) -> None:
        method = getattr(self.user, name, None)
        if method is not None:
            out = method(Context(_data(wrapper)), *args)
            if inspect.isawaitable(out):
                await out


def _hook_method(name: str) -> Callable[..., Any]:
    async def method(self: _UserHooks, context: Any, *args: Any) -> None:
        await self._call(name, context, *args)
    method.__name__ = name
    return method


for _name in HOOK_METHODS:
    setattr(_UserHooks, _name, _hook_method(_name))


def _wants_chat(model: Any) -> bool:
    if isinstance(model, sdk.Model):
        return isinstance(model, sdk.OpenAIChatCompletionsModel)
    return os.environ.get("KIT_OPENAI_API", "responses") == "chat_completions"


def _model_input(blocks: Sequence[Any], chat: bool,
                 history: Sequence[HistoryMessage] = ()) -> str | list[dict[str, Any]]:
    """Content blocks as one user message of the Responses input format, after the messages of
    ``history`` (a one-off turn's earlier conversation), each in its own role.

    Resource and data blocks are recorded in the log but not sent (SPEC 8). Raises
    ``ConfigError`` naming a block this engine path cannot express (audio off the
    chat-completions path; anything but text in an assistant message; an image or audio in a
    system or developer message on the chat-completions path), ``ContentError`` when nothing is
    left to send.
    """
    if not history and len(blocks) == 1 and isinstance(blocks[0], TextBlock):
        return blocks[0].text
    items = [_history_item(m, chat) for m in history]
    return items + [{"role": "user", "content": _parts(blocks, chat)}]


def _history_item(message: HistoryMessage, chat: bool) -> dict[str, Any]:
    if message.role != "assistant":
        if chat and message.role in ("system", "developer"):
            for b in message.content:  # the SDK's Chat Completions converter drops them unsaid
                if isinstance(b, (ImageBlock, AudioBlock)):
                    raise ConfigError(f"a {message.role} message in the history carries a "
                                      f"{type(b).__name__}; the Chat Completions API takes only "
                                      f"text in a {message.role} message: send it in a user "
                                      "message")
        return {"role": message.role, "content": _parts(message.content, chat)}
    for b in message.content:
        if not isinstance(b, TextBlock):
            raise ConfigError(f"an assistant message in the history carries a {type(b).__name__}; "
                              "the agents engine replays only the text of its own replies")
    return {"role": "assistant", "content": "".join(b.text for b in message.content)}


def _parts(blocks: Sequence[Any], chat: bool) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for b in blocks:
        if isinstance(b, TextBlock):
            parts.append({"type": "input_text", "text": b.text})
        elif isinstance(b, ImageBlock):
            parts.append({"type": "input_image", "detail": "auto",
                          "image_url": f"data:{b.media_type};base64,{b.data_b64}"})
        elif isinstance(b, AudioBlock):
            if not chat:
                raise ConfigError("AudioBlock cannot be sent on the Responses API path: set "
                                  "KIT_OPENAI_API=chat_completions or give the agent an "
                                  "OpenAIChatCompletionsModel")
            fmt = b.media_type.split("/", 1)[1].removeprefix("x-")
            parts.append({"type": "input_audio", "input_audio": {
                "data": b.data_b64, "format": {"mpeg": "mp3"}.get(fmt, fmt)}})
        elif not isinstance(b, (ResourceBlock, DataBlock)):
            raise ConfigError(f"the agents engine cannot express a {type(b).__name__}")
    if not parts:
        raise ContentError("nothing to send to the model: resource and data blocks are recorded "
                           "but not sent; add a TextBlock")
    return parts


def _sdk_agent(agent: Agent, model: Any, extra_tools: Sequence[Any] = (), *,
               skills: Sequence[Skill] = (), mcp_servers: Sequence[Any] = ()) -> sdk.Agent:
    tools = [(watched(t) if isinstance(t, sdk.FunctionTool) else t)
             if isinstance(t, SDK_TOOLS) else compile_tool(agent.name, t) for t in agent.tools]
    if skills:
        tools.append(skill_tool(agent.name, skills))
    tools += extra_tools
    for t in tools:  # the SDK would end the turn "completed", the call unmade, nothing said
        if getattr(t, "needs_approval", False) is not False:
            raise ConfigError(f"agent {agent.name!r}: tool {getattr(t, 'name', t)!r} needs "
                              "approval (needs_approval), which a kit run cannot grant; for a "
                              "human's approval, play a workflow that asks with kit.interrupt")
    names = [getattr(t, "name", None) for t in tools]
    twice = sorted({n for n in names if n is not None and names.count(n) > 1})
    if twice:  # the model would see both, and every call would reach one of them
        raise ConfigError(f"agent {agent.name!r} has more than one tool named "
                          f"{', '.join(map(repr, twice))} (its tools, its workflows' tools and "
                          "load_skill share one namespace); rename one")
    _check_output_type(agent)
    try:
        return sdk.Agent(
            name=agent.name, instructions=_instructions(agent, skill_catalog(skills)),
            tools=tools,
            hooks=_UserHooks(agent.hooks) if agent.hooks is not None else None, model=model,
            model_settings=agent.model_settings or sdk.ModelSettings(),
            output_type=agent.output_type,
            # Tool names qualified by server (mcp_<server>__<tool>): two servers may share a
            # name. Without servers the SDK's default config: qualifying costs a tool scan per turn.
            mcp_servers=list(mcp_servers), mcp_config={
                "include_server_in_tool_names": True, "failure_error_function": mcp_tool_error,
            } if mcp_servers else {})
    except (TypeError, ValueError) as exc:  # the SDK's checks: model_settings, output_type, ...
        raise ConfigError(f"agent {agent.name!r}: {exc}") from None


def _check_output_type(agent: Agent) -> None:
    """Build the agent's output schema as a run would (the SDK builds it when a run starts), so
    a type no JSON schema describes (a plain class; a ``dict[str, int]`` in strict mode) is a
    ``ConfigError`` when the deck builds, not the failure of every run."""
    from agents.agent_output import AgentOutputSchema, AgentOutputSchemaBase
    output_type = agent.output_type
    if output_type is None or output_type is str or isinstance(output_type, AgentOutputSchemaBase):
        return
    try:
        AgentOutputSchema(output_type)
    except Exception as exc:  # the SDK's UserError, pydantic's schema errors
        raise ConfigError(f"agent {agent.name!r}: output_type {output_type!r}: {exc}") from None


# ================================================================================ compiling ====

class AgentEngine:
    """A compiled agent: the SDK agent, how content blocks become its input, and how it plays.

    ``history_limit`` (None: the whole history) is how many of a session's latest items a turn
    sends the model before its input (``limited``); ``max_turns`` (None: the SDK's default) caps
    a run's model calls.
    """

    def __init__(self, sdk_agent: sdk.Agent, chat: bool, history_limit: int | None = None,
                 max_turns: int | None = None) -> None:
        self.sdk_agent, self.chat, self.history_limit = sdk_agent, chat, history_limit
        self.turns = {} if max_turns is None else {"max_turns": max_turns}  # Runner.run's

    def limited(self, run_config: Any, session: Any) -> Any:
        """``run_config`` with the agent's history limit for a turn on ``session``: the SDK's own
        ``SessionSettings(limit=)``, which reads only the latest items off the session (every
        session kit opens honours it). The session still stores every item; the agent's model
        is tapped with ``windowed`` to leave out a tool result whose call the window cut off."""
        if session is None or self.history_limit is None:
            return run_config
        return dataclasses.replace(run_config,
                                   session_settings=SessionSettings(limit=self.history_limit))

    def to_input(self, blocks: Sequence[Any],
                 history: Sequence[HistoryMessage] = ()) -> str | list[dict[str, Any]]:
        """The model input for ``blocks`` after ``history``; raises ``ConfigError`` /
        ``ContentError`` as ``_model_input`` does (before anything is written)."""
        return _model_input(blocks, self.chat, history)

    async def play(self, run: RunHandle, items: Any, session: Any, run_config: Any) -> Event:
        """Engine side: play one turn on ``run``, ending it with its terminal or parking event
        (durable when this returns). A run's failure is recorded, then re-raised."""
        token, calls = _CURRENT_RUN.set(run), OPEN_CALLS.set({})
        base = _PLAY.set([run.input_tokens, run.output_tokens, 0, 0])
        try:
            if session is not None and not isinstance(session, OpenAIConversationsSession):
                session = _FencedSession(session, run)  # (the SDK treats that one by its type)
            config = self.limited(run_config, session)
            if config.group_id is not None and run.namespace is not None:  # as kit's trace says
                config = dataclasses.replace(config, group_id=f"{run.namespace}/{config.group_id}")
            result = await sdk.Runner.run(self.sdk_agent, items, context=run, hooks=_HOOKS,
                                          run_config=config, session=session, **self.turns)
            output = jsonable(result.final_output)  # ContentError: one no JSON can carry fails
        except _Stop as stop:
            if stop.action == "cancel":
                return await run.durable(RunCancelled(stop.reason))
            kept = None
            if session is None and stop.run_data is not None:  # the conversation to resume from
                data = stop.run_data
                kept = ([{"role": "user", "content": data.input}] if isinstance(data.input, str)
                        else list(data.input)) + [i.to_input_item() for i in data.new_items]
            return await run.durable(RunPaused(stop.reason, jsonable(kept)))
        except anyio.get_cancelled_exc_class():
            if (end := run.ending()) is not None:
                run.emit(end_open_calls(run, end))
            raise
        except BaseException as exc:  # (not a cancellation: above) a user's BaseException too
            run.error = exc  # a stream's consumer raises it after run.failed
            await run.durable(end_open_calls(run, run.failure(exc)))
            raise
        finally:
            OPEN_CALLS.reset(calls)
            _CURRENT_RUN.reset(token)
            _PLAY.reset(base)
        if result.interruptions:  # a tool approval the SDK waits for (a tool kit did not build)
            run.error = ConfigError(f"the turn stopped for a tool approval kit cannot grant: "
                                    f"{', '.join(i.name or '?' for i in result.interruptions)}")
            await run.durable(run.failure(run.error))
            raise run.error
        return await run.durable(RunCompleted(output, run.usage()))


def compile_agent(agent: Agent, *, tools: Sequence[Any] = (), skills: Sequence[Skill] = (),
                  mcp_servers: Sequence[Any] = (), history_limit: int | None = None
                  ) -> InvocableSpec:
    """Compile an ``Agent`` for Deck runs: its model tapped so its output reaches the log.

    ``tools`` are added to the agent's own (its workflows as child-run tools); ``skills`` give it
    the catalog in its instructions and ``load_skill``; ``mcp_servers`` (the SDK's server
    objects, connected when the deck opens) give it their tools; ``history_limit`` is the
    deck's, for an agent that sets none. Raises ``ConfigError`` for a tool or an output type
    whose schema cannot be built.
    """
    model = agent.model or os.environ.get("KIT_MODEL") or None
    limit = agent.history_limit if agent.history_limit is not None else history_limit
    return InvocableSpec(agent.name, "agent", agent, AgentEngine(
        _sdk_agent(agent, _TapModel(agent.name, model, limit is not None), tools, skills=skills,
                   mcp_servers=mcp_servers), _wants_chat(model), limit, agent.max_turns))


def compile_headless(agent: Agent) -> AgentEngine:
    """The agent as ``Agent.run`` plays it: its own model (tapped only to keep its history
    window whole when it has a history limit); no log."""
    model = agent.model or os.environ.get("KIT_MODEL") or None
    limit = agent.history_limit
    tapped = model if limit is None else _TapModel(agent.name, model, windowed=True)
    return AgentEngine(_sdk_agent(agent, tapped), _wants_chat(model), limit, agent.max_turns)


async def run_headless(engine: AgentEngine, input: Any, *, session: Any = None,
                       max_turns: int | None = None) -> Any:
    """``Agent.run``: the SDK's own run of the agent, no log, no deck; returns its RunResult.
    Raises ``ConfigError`` for a ``max_turns`` that is not a positive int (as ``Agent`` does)."""
    items = engine.to_input(as_blocks(input))
    kw: dict[str, Any] = {"session": session, **engine.turns}
    if check_limit(f"agent {engine.sdk_agent.name!r}: max_turns", max_turns) is not None:
        kw["max_turns"] = max_turns  # this call's, over the agent's
    if session is not None and engine.history_limit is not None:
        kw["run_config"] = engine.limited(sdk.RunConfig(), session)
    return await on_asyncio(functools.partial(sdk.Runner.run, engine.sdk_agent, items, **kw))


def _within_window(items: Any) -> Any:
    """A limited turn's model input less the tool results whose call it lacks: the history
    window may start between a call and its result, and a model API refuses a result whose
    call it was not sent. (Nothing else leaves a result without its call.)"""
    if isinstance(items, str):
        return items
    calls = {i.get("call_id") for i in items
             if isinstance(i, dict) and not str(i.get("type", "")).endswith("_output")}
    return [i for i in items if not (isinstance(i, dict) and i.get("call_id") is not None
                                     and str(i.get("type", "")).endswith("_output")
                                     and i["call_id"] not in calls)]


# ====================================================================== the SDK, per deck ====

def use_api(api: str | None) -> None:
    """Apply ``KIT_OPENAI_API`` (``responses`` or ``chat_completions``); raises ``ConfigError``."""
    if api is not None and api not in ("responses", "chat_completions"):
        raise ConfigError("KIT_OPENAI_API must be 'responses' or 'chat_completions', got "
                          f"{quoted(api)}")
    if api is not None:
        sdk.set_default_openai_api(api)  # type: ignore[arg-type]


#: The SDK's trace processors before a deck's tracing observer took its spans (the SDK's default
#: exporter, one the application added), given back when the deck closes; None when not taken.
_APP_PROCESSORS: list[Any] | None = None
#: Ended deck-run traces ``_Routed`` still routes late spans of (the latest first kept).
_ENDED_MAX = 10_000


class _Routed(sdk.TracingProcessor):
    """The SDK's one trace processor while a deck takes the spans of its runs: a trace tagged
    ``kit.run_id`` (``run_config``) and its spans go to the deck's processors, every other one
    (the application's own SDK runs and traces) to the ones the SDK had (``app``)."""

    def __init__(self, kit: Sequence[Any], app: Sequence[Any]) -> None:
        self._kit, self._app = tuple(kit), tuple(app)
        self._traces: set[str] = set()  # the open traces of deck runs (set ops: one per call)
        # Deck runs' traces that ended lately: a span may end after its trace (a cancelled tool's,
        # which the SDK ends once the tool has stopped), and is the deck's all the same.
        self._ended: OrderedDict[str, None] = OrderedDict()

    def _of(self, trace_id: str) -> tuple[Any, ...]:
        return self._kit if trace_id in self._traces or trace_id in self._ended else self._app

    def on_trace_start(self, trace: Any) -> None:
        if (getattr(trace, "metadata", None) or {}).get("kit.run_id") is not None:
            self._traces.add(trace.trace_id)
        for processor in self._of(trace.trace_id):
            processor.on_trace_start(trace)

    def on_trace_end(self, trace: Any) -> None:
        for processor in self._of(trace.trace_id):
            processor.on_trace_end(trace)
        if trace.trace_id in self._traces:
            self._traces.discard(trace.trace_id)
            self._ended[trace.trace_id] = None
            if len(self._ended) > _ENDED_MAX:
                self._ended.popitem(last=False)

    def on_span_start(self, span: Any) -> None:
        for processor in self._of(span.trace_id):
            processor.on_span_start(span)

    def on_span_end(self, span: Any) -> None:
        for processor in self._of(span.trace_id):
            processor.on_span_end(span)

    def shutdown(self) -> None:
        for processor in (*self._kit, *self._app):
            processor.shutdown()

    def force_flush(self) -> None:
        for processor in (*self._kit, *self._app):
            processor.force_flush()


def use_trace_processors(processors: Sequence[Any]) -> bool:
    """Send the SDK's spans of deck runs to ``processors`` (a tracing observer's ``sdk_spans``),
    every other trace to the SDK's current processors (``_Routed``); or give those back (``[]``,
    at close): they were dropped for the rest of the process, and got nothing while the deck
    was open. Returns whether any are set."""
    global _APP_PROCESSORS
    if processors:
        if _APP_PROCESSORS is None:  # the SDK has no getter: its provider's list, if it has one
            from agents.tracing import get_trace_provider
            multi = getattr(get_trace_provider(), "_multi_processor", None)
            _APP_PROCESSORS = list(getattr(multi, "_processors", ()))
        sdk.set_trace_processors([_Routed(processors, _APP_PROCESSORS)])
    else:
        sdk.set_trace_processors(_APP_PROCESSORS or [])
        _APP_PROCESSORS = None
    return bool(processors)


def run_config(traced: bool, run_id: str | None = None, session_id: str | None = None) -> Any:
    """The SDK run config of a deck run: SDK tracing off (the log is the record) unless a
    tracing observer asked for the SDK's spans, then tagged with the run id and grouped by
    session (``AgentEngine.play`` puts a run's namespace before it)."""
    if not traced:
        return _UNTRACED
    return sdk.RunConfig(trace_metadata={"kit.run_id": run_id}, group_id=session_id)


_UNTRACED = sdk.RunConfig(tracing_disabled=True)


def no_default_exporter() -> None:
    """For a process kit owns (``kit-serve``): give the SDK a trace provider without its default
    exporter (an HTTP client to OpenAI's tracing backend: ~0.3 s and ~9 MiB to build on the first
    run). Deck runs are untraced anyway unless a tracing observer asks for the SDK's spans, which
    ``use_trace_processors`` then hands to this provider. A provider already set is kept."""
    from agents.tracing import setup
    from agents.tracing.provider import DefaultTraceProvider
    if setup.GLOBAL_TRACE_PROVIDER is None:
        sdk.set_trace_provider(DefaultTraceProvider())


async def warm_up(specs: Sequence[InvocableSpec]) -> None:
    """Engine side: pay at open what the first turn of the deck's agents (``specs``) would: one
    throwaway SDK run of a scripted agent calling a function tool (on its first run the SDK
    builds its trace provider, ~0.2 s with its default exporter, and schemas), then a price of
    each agent's model, which loads genai-prices' table (~0.1 s) unless every model is one no
    table holds (a ScriptedModel's default name). Nothing reaches the log, a session or an
    observer."""
    model = ScriptedModel([{"tool": "ready", "args": {}}, "ok"])
    agent = sdk.Agent(name="kit_warm_up", model=model,
                      tools=[sdk.function_tool(lambda: "ok", name_override="ready")])
    await sdk.Runner.run(agent, "hi", run_config=_UNTRACED)
    for spec in specs:
        if spec.kind == "agent":
            model_usd(spec.engine.sdk_agent.model.known_name(), 1, 1)
