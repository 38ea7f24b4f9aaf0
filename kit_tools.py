"""kit_tools: the tools an agent gets, as the openai-agents SDK takes them.

Owns: a plain function compiled into an SDK ``FunctionTool`` (``compile_tool``: its schema the
SDK's own, its ``Context[...]`` parameters hidden from the model and injected), an SDK tool the
caller built, watched so its failures and refusals reach the log as a plain function's do and
its ``ctx.context`` (in its calls, guardrails and ``is_enabled``; an SDK agent's, played as a
tool) is the caller's object, as the SDK gives it (``watched``), the skills' catalog and the
generated ``load_skill`` tool (``skill_catalog``, ``skill_tool``), an MCP tool call's error for
the model (``mcp_tool_error``) and a tool call's origin in the log (``tool_origin``). kit_agents
compiles the agent around them.

Must never: reach the event store or the Runtime (a call is recorded through the ``RunHandle``
it carries as the SDK's run context), import kit_agents or anything above it, or write the
application context anywhere (a tool gets it by reference: ``Context(run.data)``, or an SDK
tool's ``ctx.context`` while it runs).

A tool's failure goes back to the model as an error string (cut to ``kit_core.MAX_ERROR_CHARS``,
saying so: ``clipped``), never a failed run, and its call's
``tool.completed`` says ``is_error`` (``failed``: the call's id, ``call_id``, is added to
``run.tool_errors``, which the hooks read, and clear, when they record the call). An SDK tool
built to fail the run instead (no failure error function, a timeout that raises) does; its call,
left open (``OPEN_CALLS``), gets its ``tool.completed`` (``is_error``) before ``run.failed``
(``end_open_calls``), as a call a cancel cuts short does before ``run.cancelled``.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import hashlib
import inspect
import json
import re
import typing
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import agents as sdk
import anyio
from agents.function_schema import function_schema

from kit_context import is_context
from kit_core import (
    ConfigError, Context, MCPServerError, RunFailed, RunHandle, SkillLoaded, ToolCompleted,
    ToolStarted, clipped, error_text, quoted,
)

if TYPE_CHECKING:
    from kit_catalog import Skill

__all__ = ("compile_tool", "watched", "skill_catalog", "skill_tool", "mcp_tool_error",
           "tool_origin", "call_id", "failed", "OPEN_CALLS", "end_open_calls")

#: The play's tool calls that started and did not complete, call id -> (tool, origin): set per
#: play (kit_agents), a call added when its ``tool.started`` is recorded and taken when its
#: ``tool.completed`` is; a run that fails ends those left, before its ``run.failed``.
OPEN_CALLS: contextvars.ContextVar[dict[str, tuple[str, str]]] = contextvars.ContextVar(
    "kit_open_calls")


def end_open_calls(run: RunHandle, end: Any) -> Any:
    """``end`` (a run's ``run.failed`` or ``run.cancelled``), after a ``tool.completed``
    (``is_error``, in the end's words) for each of the play's calls left open (``OPEN_CALLS``):
    the one that failed the run, those cut short with it; a reader sees every call end."""
    said = (f"error: {end.error}: {end.message}" if isinstance(end, RunFailed)
            else f"error: cancelled: {getattr(end, 'reason', None)}")
    for cid, (name, origin) in OPEN_CALLS.get({}).items():
        run.emit(ToolCompleted(cid, name, said, True), origin=origin)
    return end


#: A tool name every model API takes (OpenAI's rule; Anthropic's is the same, Gemini's wider).
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def call_id(tool_ctx: Any) -> str:
    """The id of the tool call ``tool_ctx`` (the SDK's ``ToolContext``) is for, as the log names
    it. The model's own, unless it gave none (some servers leave a parallel call's empty): then
    one kit makes, kept on the call's context, so the call's ``tool.started``, its error flag and
    its ``tool.completed`` all carry the same one."""
    cid = getattr(tool_ctx, "tool_call_id", None)
    if not cid:
        cid = f"kit-{uuid.uuid4().hex}"
        with contextlib.suppress(AttributeError):
            tool_ctx.tool_call_id = cid
    return cid


def failed(run: RunHandle, tool_ctx: Any) -> None:
    """Flag the call ``tool_ctx`` is for as failed: its ``tool.completed`` says ``is_error``."""
    run.tool_errors.add(call_id(tool_ctx))


def tool_origin(run: RunHandle, agent: Any, tool: Any) -> str:
    """A tool call's origin in the log: ``<run>[/<agent>]/<tool>`` (the agent named when it is
    not the run's own: a handoff's)."""
    base = run.origin if agent.name == run.origin else f"{run.origin}/{agent.name}"
    return f"{base}/{tool.name}"


def compile_tool(agent: str, fn: Callable[..., Any]) -> sdk.FunctionTool:
    """A plain function as an SDK ``FunctionTool``; ``Context[...]`` parameters are injected.

    The schema is the SDK's own (``function_schema``, docstring descriptions included) built
    over the function's signature without its context parameters, so the model never sees them.
    Annotations are resolved in the function's own module first (``from __future__ import
    annotations`` leaves them as strings, which the schema would look up in this module). A
    ``functools.partial`` is its function's tool, less the arguments it binds. The tool's
    exception goes back to the model as an error string, not a failed run. Raises
    ``ConfigError`` naming the tool when it has no name, one a model API refuses (a lambda's),
    or a schema that cannot be built.
    """
    schema, ctx_names = _schema(agent, fn)
    # What escapes the call (a cancellation of the tool's own, not the run's) the SDK tells the
    # model as a failure: flagged, as an exception the call catches is.
    return _flag_errors(sdk.FunctionTool(
        name=schema.name, description=schema.description or "",
        params_json_schema=schema.params_json_schema,
        on_invoke_tool=_invoker(fn, schema, ctx_names),
        strict_json_schema=schema.strict_json_schema))


def _schema(agent: str, fn: Callable[..., Any]) -> tuple[Any, list[str]]:
    """The SDK's ``FuncSchema`` of ``fn`` less its ``Context[...]`` parameters, and their names
    (``compile_tool``): built over a proxy that has the function's name, docs, module and
    signature without them. Raises ``ConfigError`` as ``compile_tool`` says."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__name__", None)
    if not isinstance(name, str):
        raise ConfigError(f"agent {agent!r}: tool {fn!r} has no __name__ to call it by; make it "
                          "a function (def), or an SDK FunctionTool")
    if not TOOL_NAME.fullmatch(name):  # a lambda's "<lambda>": the API's HTTP 400 every turn
        raise ConfigError(f"agent {agent!r}: tool {name} cannot be named to a model: a tool's "
                          "name is letters, digits, _ and -, at most 64 of them; make it a def "
                          "of such a name")
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # e.g. a Context[T] whose T is imported for type checkers only: the
        hints = {}  # schema reads the rest as written, and names one it cannot resolve
    params = [p.replace(annotation=hints.get(p.name, p.annotation))
              for p in sig.parameters.values()]
    ctx_names = [p.name for p in params if is_context(p.annotation)]
    if ctx_names and any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ConfigError(f"agent {agent!r}: tool {name} takes *args and a Context parameter")
    visible = [p for p in params if p.name not in ctx_names]

    def proxy(*a: Any, **k: Any) -> Any:  # only its signature and docs are read
        raise AssertionError

    proxy.__name__, proxy.__doc__ = name, target.__doc__
    proxy.__qualname__ = getattr(target, "__qualname__", name)
    proxy.__module__ = getattr(target, "__module__", None)
    proxy.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=visible, return_annotation=hints.get("return", sig.return_annotation))
    proxy.__annotations__ = {p.name: p.annotation for p in visible if p.annotation is not p.empty}
    try:
        schema = function_schema(proxy)
    except Exception as exc:
        raise ConfigError(f"agent {agent!r}: cannot build a schema for tool {name}: {exc}") from None
    if schema.takes_context:  # the schema hides it, and kit would pass nothing for it
        first = visible[0].annotation
        first = typing.get_origin(first) or first
        raise ConfigError(f"agent {agent!r}: tool {name} takes the SDK's "
                          f"{getattr(first, '__name__', first)} (its first parameter); "
                          "a kit tool takes the run's context as ctx: kit.Context[T] (ctx.data), "
                          "or build it as an SDK tool (agents.function_tool)")
    return schema, ctx_names


def _invoker(fn: Callable[..., Any], schema: Any, ctx_names: list[str]
             ) -> Callable[[Any, str], Any]:
    """The SDK's ``on_invoke_tool`` for ``fn``: the model's arguments validated by ``schema``,
    a ``Context(run.data)`` for each of ``ctx_names``, a sync function run in a worker thread;
    its failure (and a refusal: a context tool on a run with no kit run context, SPEC 7) is
    returned as an error string, the call flagged."""
    name, names = schema.name, list(schema.signature.parameters)
    is_async = inspect.iscoroutinefunction(fn)

    async def invoke(tool_ctx: Any, args_json: str) -> Any:
        run = tool_ctx.context
        try:
            if ctx_names and not isinstance(run, RunHandle):  # SPEC 7: refused, the model is told
                raise ConfigError(f"tool {name} requires a kit run context, but the run "
                                  f"carries {type(run).__name__} rather than a run context "
                                  "(headless Agent.run?)")
            parsed = schema.params_pydantic_model(**json.loads(args_json or "{}"))
            args, kwargs = schema.to_call_args(parsed)
            call = dict(zip(names, args)) if ctx_names else None
            if call is not None:
                call.update(kwargs)
                call.update({n: Context(run.data) for n in ctx_names})
                args, kwargs = (), call
            if is_async:
                return await fn(*args, **kwargs)
            out = await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
            return await out if inspect.isawaitable(out) else out
        except Exception as exc:
            if isinstance(run, RunHandle):
                failed(run, tool_ctx)
            return clipped(f"error: {type(exc).__name__}: {error_text(exc)}")

    return invoke


# ---------------------------------------------------------------------------- skills ----

def skill_catalog(skills: Sequence[Skill]) -> str:
    """Tier 1 of the Agent Skills progressive disclosure: each skill's name and description."""
    if not skills:
        return ""
    lines = ["", "", "## Skills",
             "A skill holds instructions for one kind of task. When a task matches a skill's "
             "description, call load_skill with its name first and follow what it says.", ""]
    lines += [f"- {s.name}: {' '.join(s.description.split())}" for s in skills]
    return "\n".join(lines)


def skill_tool(agent: str, skills: Sequence[Skill]) -> sdk.FunctionTool:
    """The generated ``load_skill(name)`` tool: returns the skill's body (prose, never run).

    Each load appends ``skill.loaded`` with the SHA-256 of the text served. Only the agent's
    own skills are served, looked up by exact name: a name carrying a path (``../x``) or any
    other name is refused with an error string to the model; no path is ever built from it.
    """
    by_name = {s.name: s for s in skills}
    schema = {"type": "object", "additionalProperties": False, "required": ["name"],
              "properties": {"name": {"type": "string", "enum": sorted(by_name),
                                      "description": "The skill's name, as listed under Skills."}}}

    async def invoke(tool_ctx: Any, args_json: str) -> str:
        run = tool_ctx.context
        try:
            name = json.loads(args_json or "{}").get("name")
        except (ValueError, AttributeError):
            name = None
        skill = by_name.get(name) if isinstance(name, str) else None
        if skill is None:
            if isinstance(run, RunHandle):
                failed(run, tool_ctx)
            why = "skill names never carry a path" if isinstance(name, str) and (
                "/" in name or "\\" in name or ".." in name) else "no such skill for this agent"
            return (f"error: refused {quoted(name)}: {why}; the skills are "
                    f"{', '.join(sorted(by_name))}")
        if isinstance(run, RunHandle):
            digest = hashlib.sha256(skill.body.encode("utf-8")).hexdigest()
            run.emit(SkillLoaded(skill.name, digest))
        return skill.body

    return sdk.FunctionTool(name="load_skill", description=(
        "Load a skill: returns its full instructions, to follow for the task at hand."),
        params_json_schema=schema, on_invoke_tool=invoke, strict_json_schema=True)


# ------------------------------------------------------------------- SDK and MCP tools ----

def watched(tool: sdk.FunctionTool) -> sdk.FunctionTool:
    """An SDK ``FunctionTool`` as a deck plays it: given the caller's context object
    (``_with_callers_context``), its failures flagged (``_flag_errors``), its guardrails'
    refusals logged (``_log_refusals``); the caller's object is left as built."""
    return _with_callers_context(_log_refusals(_flag_errors(tool)))


#: The run whose SDK tool is running with the caller's object as its context (``_as_callers``):
#: the tool's own failure error function, called inside it, flags the call through it.
_PLAYING: contextvars.ContextVar[RunHandle | None] = contextvars.ContextVar("kit_tool_run",
                                                                           default=None)


@contextlib.contextmanager
def _as_callers(tool_ctx: Any) -> Any:
    """While an SDK tool (or its guardrail) runs, its ``ToolContext.context`` is the caller's
    ``context=`` object, as the SDK would give it, not the ``RunHandle`` kit plays the run
    through (its hooks and wrappers read it there again once the tool returns)."""
    run = getattr(tool_ctx, "context", None)
    if not isinstance(run, RunHandle):
        yield
        return
    token, tool_ctx.context = _PLAYING.set(run), run.data
    try:
        yield
    finally:
        tool_ctx.context = run
        _PLAYING.reset(token)


def _run_of(tool_ctx: Any) -> RunHandle | None:
    run = getattr(tool_ctx, "context", None)
    return run if isinstance(run, RunHandle) else _PLAYING.get()


def _with_callers_context(tool: sdk.FunctionTool) -> sdk.FunctionTool:
    """A copy of an SDK ``FunctionTool`` whose calls, and its ``is_enabled`` callable, see the
    caller's object as ``ctx.context`` (``_as_callers``). An SDK agent played as a tool runs
    with it too, so its tools and instructions read it as in the SDK (kit records that agent's
    model calls from the call's usage, after it: kit_agents)."""
    tool = copy.copy(tool)  # (last: the SDK binds a tool's invoker, its failure function, to it)
    if callable(tool.is_enabled):
        tool.is_enabled = _enabled_for_callers(tool.is_enabled)
    invoke = tool.on_invoke_tool

    async def on_invoke_tool(tool_ctx: Any, arguments: str) -> Any:
        with _as_callers(tool_ctx):
            return await invoke(tool_ctx, arguments)

    tool.on_invoke_tool = on_invoke_tool
    return tool


def _enabled_for_callers(enabled: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A tool's ``is_enabled(ctx, agent)`` asked with the caller's object as ``ctx.context``:
    on a copy of the SDK's context wrapper, which is the run's one (the SDK asks every tool at
    once, and its hooks read kit's run handle there)."""
    async def is_enabled(wrapper: Any, agent: Any) -> bool:
        run = getattr(wrapper, "context", None)
        if isinstance(run, RunHandle):
            wrapper = copy.copy(wrapper)
            wrapper.context = run.data
        out = enabled(wrapper, agent)
        return bool(await out if inspect.isawaitable(out) else out)
    return is_enabled


def _flag_errors(tool: sdk.FunctionTool) -> sdk.FunctionTool:
    """An SDK ``FunctionTool`` whose exception or timeout the SDK hands the model as an error
    string (its failure or timeout error function): a copy (the caller's object is left as
    built) whose calls that failed say ``is_error`` in their ``tool.completed``, as a plain
    function's do. One that fails the run instead (no failure error function, a timeout that
    raises) is left as it is: kit_agents ends its call, open still, when the run fails."""
    from agents.tool import (
        default_tool_timeout_error_message, resolve_function_tool_failure_error_function,
        set_function_tool_failure_error_function,
    )
    told = resolve_function_tool_failure_error_function(tool)
    timed = tool.timeout_seconds is not None and tool.timeout_behavior == "error_as_result"
    if told is None and not timed:
        return tool

    def flagged(say: Callable[[Any, Exception], Any]) -> Callable[[Any, Exception], Any]:
        def flag(ctx: Any, error: Exception) -> Any:
            run = _run_of(ctx)  # (a failure's function runs inside the tool: _as_callers)
            if run is not None:
                failed(run, ctx)
            said = say(ctx, error)  # the SDK awaits an awaitable answer
            return clipped(said) if isinstance(said, str) else said
        return flag

    tool = copy.copy(tool)
    if timed:
        tool.timeout_error_function = flagged(tool.timeout_error_function or (
            lambda ctx, error: default_tool_timeout_error_message(
                tool_name=tool.name, timeout_seconds=tool.timeout_seconds)))
    return tool if told is None else set_function_tool_failure_error_function(tool, flagged(told))


def _log_refusals(tool: sdk.FunctionTool) -> sdk.FunctionTool:
    """An SDK ``FunctionTool`` with guardrails: a copy whose guardrails record a call they
    refuse, as ``tool.completed`` with ``is_error`` and what the model is told instead (or the
    guardrail's name, when its tripwire fails the run). An input guardrail's refusal is never
    handed to the hooks (the tool never starts), so it records the call's ``tool.started``
    too; an output guardrail's rejection is (the hooks record the message, flagged), its
    tripwire is not (the call that started gets its ``tool.completed`` here)."""
    if not (tool.tool_input_guardrails or tool.tool_output_guardrails):
        return tool

    def logged(guardrail: Any, after: bool) -> Any:
        async def check(data: Any) -> Any:
            with _as_callers(data.context):
                out = guardrail.guardrail_function(data)
                out = await out if inspect.isawaitable(out) else out
            ctx = data.context
            run, behavior = getattr(ctx, "context", None), getattr(out, "behavior", None) or {}
            refusal = behavior.get("type", "allow")
            if isinstance(run, RunHandle) and refusal != "allow":
                cid, origin = call_id(ctx), tool_origin(run, data.agent, tool)
                if not after:
                    await run.durable(ToolStarted(cid, tool.name, ctx.tool_arguments or ""),
                                      origin=origin)
                if after and refusal == "reject_content":
                    failed(run, ctx)
                else:
                    said = behavior.get("message") or f"refused by guardrail {guardrail.get_name()}"
                    run.emit(ToolCompleted(cid, tool.name, said, True), origin=origin)
                    OPEN_CALLS.get({}).pop(cid, None)  # (an output tripwire's call had started)
            return out
        return dataclasses.replace(guardrail, guardrail_function=check, name=guardrail.get_name())

    tool = copy.copy(tool)
    tool.tool_input_guardrails = [logged(g, False) for g in tool.tool_input_guardrails or ()]
    tool.tool_output_guardrails = [logged(g, True) for g in tool.tool_output_guardrails or ()]
    return tool


def mcp_tool_error(ctx: Any, error: Exception) -> str:
    """An MCP tool call that failed (timed out, refused by the server, cut short by the server's
    death): its error text goes to the model, and the call's ``tool.completed`` says
    ``is_error``. A death is told in kit's words (``MCPServerError``: which server, what
    happened), which the SDK wraps in its own exception."""
    run = getattr(ctx, "context", None)
    if isinstance(run, RunHandle):
        failed(run, ctx)
    died = next((e for e in (error, error.__cause__) if isinstance(e, MCPServerError)), None)
    return clipped(f"error: {died}" if died is not None else
                   sdk.default_tool_error_function(ctx, error))
