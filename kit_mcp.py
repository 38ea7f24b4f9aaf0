"""kit_mcp: a deck's agents and workflows as an MCP server, for kit_http to mount at ``/mcp``.

Owns: ``MCPSurface``: the ``mcp`` package's low-level ``Server`` carrying kit's tools (each agent,
each workflow, and ``answer``) and resources (each skill), served by that package's
``StreamableHTTPSessionManager`` (an ASGI handler); the progress notifications of a playing
turn; the structured results of tool calls; the ``kit_mcp`` log line of a call that broke;
the JSON-RPC error answering a message the package would misanswer (``refusal``).

Must never: speak the transport itself (the mcp package does; this module registers handlers,
and answers only a message the package would answer outside JSON-RPC's terms: ``refusal``),
reach a deck by anything but its public methods, be imported unless the MCP surface is served
(it imports ``mcp``, which imports Starlette: kit_http imports it in the lifespan, only when
asked), put the application context or an unexpected exception's message in a result, or
write to stderr itself (a call that broke is one ``kit_mcp`` log line, its tool and error type,
never its arguments; the stack only at DEBUG).

Theory of operation
-------------------
Each agent is a tool ``{message, session_id?}`` and each workflow a tool ``{input, thread_id?}``
(``thread_id`` required when the workflow is durable). A call plays one turn through
``deck.stream``, exactly as ``POST /agents/{name}/chat?stream=true`` or
``POST /workflows/{name}?stream=true`` would, so the log holds the same events; while it plays,
each ``text.delta`` (an agent's streamed text) or ``node.updated`` (a workflow's node) goes to the
caller as a progress notification when the call carries a progress token. The result is
structured (``structuredContent``) and also given as text:

- an agent's turn: ``{"output", "run_id", "session_id", "usage"}``;
- a workflow's end: ``{"output", "thread_id", "run_id"}``;
- a workflow waiting for a human: ``{"type": "interrupt", "payload", "thread_id", "run_id"}``; the
  ``answer`` tool (``{run_id, value}``) resumes it through ``deck.stream_answer``, played like any
  call (a node's progress, the same end handling), and returns the next of these shapes; a
  sleeping run has the same shape with the payload ``{"kind": "sleep", "until"}`` (as
  ``deck.run`` returns it), and its text says a tick wakes it, not ``answer``;
- a refusal (busy session, bad input) or a failed run, a resumed one too: ``isError`` with
  ``{"error": <type>, "message"}`` (a failed run's message names its run, whose log has the
  details).

Arguments are checked against the tool's schema by kit (``_arguments``), not by the package: an
optional argument given null is taken as absent first, as the v1 routes take a null
``session_id`` or ``input`` (models often fill optional parameters with null; the package's own
check refused it, "None is not of type 'string'"), and a refusal names the argument at fault (a
required one given null too). The schemas stay as clients' converters read them, nullable nowhere.

Leaving a call (the client cancels it, or goes away) ends its stream, never its run; so does
the server stopping (``stop``), whose call then ends with an ``isError`` result
``ServerStoppingError`` naming the run, since a client whose call's stream is cut without a
result waits for one forever. Skills are
resources ``skill://<name>`` (``text/markdown``: the body ``load_skill`` serves; no resource
templates, an empty list to a client that asks). The server is
stateless (``stateless=True``): no MCP session lives between requests, so any replica sharing
the deck's store can serve any call, and nothing is kept for idle clients.

Before the package sees a POST's message, ``refusal`` answers the ones it would answer outside
JSON-RPC 2.0's terms (section 5.1): a method it does not know is -32601 (the package says -32602
"Invalid request parameters"), a request whose ``id`` is null or not a string or an integer, a
batch, or an object that is no JSON-RPC message, -32600 with a null id (the package answers 202
and never again, or -32602 with the id ``"server-error"``), and a known method's bad params
-32602 naming the field at fault (the package says nothing of which). Notifications are never
answered, whatever their method.
"""
from __future__ import annotations

import json
import logging
import traceback
import typing
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
import jsonschema  # (the mcp package's own dependency, and its validator)
import mcp.types as types
import pydantic
from mcp.server.lowlevel import Server
from mcp.server.lowlevel.helper_types import ReadResourceContents
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import McpError

from kit_core import (
    VERSION, ConfigError, Event, InterruptResult, KitError, NodeUpdated, RunCancelled,
    RunCompleted, RunFailed, RunInterrupted, RunPaused, RunSleeping, RunStoppedError, TextDelta,
    UnknownNameError, UnknownRunError, jsonable, quoted, stops,
)

if typing.TYPE_CHECKING:
    from kit import Deck

__all__ = ("MCPSurface", "ANSWER", "SKILL_SCHEME", "refusal")

#: A tool call that broke (a bug, not a refusal): one line naming the tool and the error type.
_log = logging.getLogger("kit_mcp")

#: The tool that answers a workflow run waiting for a human.
ANSWER = "answer"
#: Skills are resources ``skill://<name>``.
SKILL_SCHEME = "skill"
_INSTRUCTIONS = (
    "kit: each tool plays one turn of a kit agent (message, optional session_id to keep a "
    "conversation) or one run of a kit workflow (input state, optional thread_id). A workflow may "
    "stop for a human: its result names the run and the question; call `answer` with that run_id "
    "and the value to resume it. Skills are resources (skill://<name>).")
_AGENT_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["message"],
                 "properties": {"message": {"type": "string", "description": "The user's message."},
                                "session_id": {"type": "string", "description":
                                               "A conversation to continue (or start)."}}}
_ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["run_id", "value"],
                  "properties": {"run_id": {"type": "string", "description":
                                            "The run_id of an interrupt result."},
                                 "value": {"description": "The human's answer (any JSON)."}}}


#: Each method a client may call, with the mcp package's model of its request (``refusal``).
_REQUESTS: dict[str, Any] = {
    method: model for model in typing.get_args(types.ClientRequest.model_fields["root"].annotation)
    for method in typing.get_args(model.model_fields["method"].annotation)}


def _rpc_error(request_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}


def refusal(message: Any) -> dict[str, Any] | None:
    """The JSON-RPC error response to ``message`` (a POST's body, parsed) when the mcp package
    would answer it outside JSON-RPC's terms (module docstring), else None: the package serves it.
    Its ``id`` is None when the message is no valid request (an HTTP 400 then)."""
    if not isinstance(message, dict):
        return _rpc_error(None, types.INVALID_REQUEST, "Invalid Request: a JSON-RPC message is "
                          "one object (no batches: one message per request)")
    if message.get("jsonrpc") != "2.0":
        return _rpc_error(None, types.INVALID_REQUEST, "Invalid Request: 'jsonrpc' must be \"2.0\"")
    if "method" not in message:
        return None  # a response to the server (a result or an error): the package's
    method = message["method"]
    if not isinstance(method, str):
        return _rpc_error(None, types.INVALID_REQUEST, "Invalid Request: 'method' must be a string")
    if "id" not in message:
        return None  # a notification: never answered (JSON-RPC 2.0 section 4.1)
    request_id = message["id"]
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        return _rpc_error(None, types.INVALID_REQUEST, "Invalid Request: 'id' must be a string or "
                          "an integer (never null)")
    model = _REQUESTS.get(method)
    if model is None:
        return _rpc_error(request_id, types.METHOD_NOT_FOUND, f"Method not found: {quoted(method)}")
    try:  # validated as the package validates it (mcp.shared.session), to say what is wrong
        request = types.JSONRPCRequest.model_validate(message)
        model.model_validate(request.model_dump(by_alias=True, mode="json", exclude_none=True))
    except pydantic.ValidationError as exc:  # its locations and words, never the input
        faults = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                           for e in exc.errors(include_input=False, include_url=False)[:3])
        return _rpc_error(request_id, types.INVALID_PARAMS,
                          f"Invalid params for {method}: {faults}")
    return None


def _workflow_schema(durable: bool) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False,
            "required": ["thread_id"] if durable else [],
            "properties": {"input": {"type": "object", "description": "The initial state."},
                           "thread_id": {"type": "string", "description":
                                         "The thread to run on (a later run carries its state on)."}}}


def _arguments(args: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``args`` as a tool with ``schema`` takes them: an optional argument given null is dropped
    (absent), then the rest checked (an argument the tool has not, null or not, is refused).
    Raises ``jsonschema.ValidationError`` whose message names the argument at fault."""
    optional = set(schema["properties"]) - set(schema.get("required", ()))
    args = {k: v for k, v in args.items() if v is not None or k not in optional}
    try:
        jsonschema.validate(args, schema)
    except jsonschema.ValidationError as exc:
        if exc.path:  # the package's message names the value, not where it is
            exc.message = f"argument {quoted(exc.path[0])}: {exc.message}"
        raise
    return args


def _result(structured: dict[str, Any], text: str, *, error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                structuredContent=jsonable(structured), isError=error)


def _error(name: str, message: str) -> types.CallToolResult:
    return _result({"error": name, "message": message}, f"{name}: {message}", error=True)


def _workflow_result(result: Any, run_id: str, thread_id: str) -> types.CallToolResult:
    if isinstance(result, InterruptResult):
        payload = jsonable(result.payload)
        return _result({"type": "interrupt", "payload": payload, "thread_id": result.thread_id,
                        "run_id": run_id},
                       f"run {run_id} waits for a human: {json.dumps(payload)}; call `{ANSWER}` "
                       "with this run_id and a value to resume it")
    output = jsonable(result)
    return _result({"output": output, "thread_id": thread_id, "run_id": run_id}, json.dumps(output))


def _progress(ev: Event) -> str | None:
    """The progress message an event gives a caller: streamed text, or a finished node."""
    p = ev.payload
    if type(p) is TextDelta:
        return p.text
    if type(p) is NodeUpdated:
        return f"node {p.node}"
    return None


class MCPSurface:
    """The deck as an MCP server (streamable HTTP): an ASGI handler once entered.

    ``async with MCPSurface(deck, max_body=...)`` starts the session manager's task group (the
    caller's task must also be the one that leaves it); calling the surface with an ASGI scope
    serves one request. The deck must be open. Raises ``ConfigError`` when an agent or workflow
    is named ``answer`` (it would hide the tool that answers interrupts).
    """

    def __init__(self, deck: Deck, *, max_body: int) -> None:
        if ANSWER in deck.agents or ANSWER in deck.workflows:
            raise ConfigError(f"an invocable named {ANSWER!r} clashes with the MCP server's "
                              f"{ANSWER!r} tool; rename it to serve MCP")
        self.deck = deck
        server: Server[Any, Any] = Server("kit", VERSION, instructions=_INSTRUCTIONS)
        server.list_tools()(self._tools)
        server.call_tool(validate_input=False)(self._call)  # _arguments checks them
        server.list_resources()(self._resources)
        # Part of the resources capability, which clients that browse resources call too:
        # kit's skills are plain resources, so it has none (never "Method not found").
        server.list_resource_templates()(self._templates)
        server.read_resource()(self._read)
        self.server = server
        self.manager = StreamableHTTPSessionManager(server, stateless=True,
                                                    max_request_body_size=max_body)
        self._running: Any = None
        self._playing: set[anyio.CancelScope] = set()  # the calls reading their run's events
        self._stopping = False

    async def __aenter__(self) -> MCPSurface:
        self._running = self.manager.run()
        await self._running.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._running.__aexit__(*exc)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.manager.handle_request(scope, receive, send)

    def stop(self) -> None:
        """The server is stopping: every call still playing ends now with an ``isError`` result
        ``ServerStoppingError`` naming its run (its log has the rest), while its response can
        still carry it. An MCP client waits for a call's result forever once its stream is cut
        without one, so leaving it to shutdown's cut would hang the caller."""
        self._stopping = True
        for scope in list(self._playing):
            scope.cancel()

    # ------------------------------------------------------------------------------ tools --
    def _schema(self, name: str) -> dict[str, Any]:
        """The input schema of tool ``name``; raises ``UnknownNameError`` for no tool of kit's."""
        if name == ANSWER:
            return _ANSWER_SCHEMA
        if name in self.deck.agents:
            return _AGENT_SCHEMA
        if name in self.deck.workflows:
            return _workflow_schema(bool(self.deck.workflows[name].durable))
        raise UnknownNameError(name, [*self.deck.agents, *self.deck.workflows])

    async def _tools(self) -> list[types.Tool]:
        tools = [types.Tool(name=name, inputSchema=_AGENT_SCHEMA, description=(
            f"One turn of the kit agent {name!r}" + (f": {a.instructions}" if isinstance(
                a.instructions, str) else ".")))
            for name, a in sorted(self.deck.agents.items())]
        tools += [types.Tool(name=name, inputSchema=_workflow_schema(bool(w.durable)), description=(
            f"One run of the kit workflow {name!r} from an input state; it may stop for a "
            f"human, who answers with `{ANSWER}`."))
            for name, w in sorted(self.deck.workflows.items())]
        tools.append(types.Tool(name=ANSWER, inputSchema=_ANSWER_SCHEMA, description=(
            "Answer a workflow run waiting for a human (an interrupt result names its run_id "
            "and payload); returns the run's output, or its next interrupt.")))
        return tools

    async def _call(self, name: str, args: dict[str, Any]) -> types.CallToolResult:
        """One tool call; every refusal and failure is an ``isError`` result, never a raise."""
        try:
            try:
                args = _arguments(args, self._schema(name))
            except jsonschema.ValidationError as exc:
                return _result({"error": "ValidationError", "message": exc.message},
                               f"Input validation error: {exc.message}", error=True)
            if name == ANSWER:
                return await self._answer(args["run_id"], args["value"])
            if name in self.deck.agents:
                session_id = args.get("session_id")
                return await self._play(name, session_id, self.deck.stream(
                    name, args["message"], session_id=session_id, committed=True))
            if name in self.deck.workflows:
                thread_id = args.get("thread_id")
                return await self._play(name, thread_id, self.deck.stream(
                    name, args.get("input", {}), session_id=thread_id, committed=True))
            raise AssertionError(name)  # (_schema refused any other name)
        except KitError as exc:
            return _error(type(exc).__name__, str(exc))
        except Exception as exc:
            # A bug, not a refusal: its message may quote input or a secret, so the log gets the
            # tool (a catalog name or `answer`: an unknown one was refused above) and the type;
            # the stack only at DEBUG, and never the call's arguments.
            _log.error("MCP tool %s failed with %s", name, type(exc).__name__)
            _log.debug("MCP tool %s failed with %s\n%s", name, type(exc).__name__,
                       "".join(traceback.format_tb(exc.__traceback__)).rstrip())
            return _error(type(exc).__name__, "internal error; the server log has the details")

    async def _play(self, name: str, session_id: str | None,
                    stream: AsyncIterator[Event]) -> types.CallToolResult:
        """Play ``stream`` (the events of invocable ``name``'s run on ``session_id``, its thread
        for a workflow) to its end, sending progress on the way; its end is the result: a
        failed, cancelled or paused run is an ``isError`` one naming the run."""
        ctx = self.server.request_context
        token = ctx.meta.progressToken if ctx.meta is not None else None
        end, sent, run_id = None, 0, None
        reading = anyio.CancelScope()  # stop() cancels it: the events stop, never the run
        if self._stopping:
            reading.cancel()
        try:
            async with aclosing(stream) as events:
                with reading:
                    self._playing.add(reading)
                    try:
                        async for ev in events:
                            run_id = ev.run_id
                            if ev.payload.ends is not None:
                                end = ev
                            elif token is not None and (message := _progress(ev)) is not None:
                                sent += 1
                                try:
                                    await ctx.session.send_progress_notification(
                                        token, sent, message=message,
                                        related_request_id=ctx.request_id)
                                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                                    token = None  # the client left: the run plays on to its end
                    finally:
                        self._playing.discard(reading)
        except stops():
            raise
        except BaseException:  # a user's BaseException that failed the run, too
            if end is None or not isinstance(end.payload, RunFailed):
                raise  # refused before it started, or broke: _call answers it
        if end is None and reading.cancelled_caught:  # stop(): the server is shutting down
            where = (f" before run {run_id} ended; its log has the rest: GET /runs/{run_id}/events"
                     if run_id is not None else "")
            return _error("ServerStoppingError", f"the server is shutting down{where}")
        assert end is not None
        p, run_id = end.payload, end.run_id
        if isinstance(p, RunFailed):
            return _error(p.error, f"run {run_id} failed ({p.error}); its log has the details")
        if isinstance(p, (RunCancelled, RunPaused)):  # what deck.run raises for them
            return _error(RunStoppedError.__name__, str(RunStoppedError(run_id, p.status, p.reason)))
        if name in self.deck.agents:
            assert isinstance(p, RunCompleted)
            text = p.output if isinstance(p.output, str) else json.dumps(jsonable(p.output))
            return _result({"output": p.output, "run_id": run_id, "session_id": session_id,
                            "usage": p.usage.to_json()}, text)
        thread_id = session_id or run_id
        if isinstance(p, RunInterrupted):
            return _workflow_result(InterruptResult(p.payload, p.thread_id or thread_id), run_id, thread_id)
        if isinstance(p, RunSleeping):  # the shape of an interrupt, but no human wakes it
            sleep = {"kind": "sleep", "until": p.until}
            return _result({"type": "interrupt", "payload": sleep,
                            "thread_id": p.thread_id or thread_id, "run_id": run_id},
                           f"run {run_id} sleeps until {p.until}: a tick (deck.tick()) wakes it "
                           f"then; `{ANSWER}` cannot")
        return _workflow_result(p.output, run_id, thread_id)  # type: ignore[union-attr]

    async def _answer(self, run_id: str, value: Any) -> types.CallToolResult:
        """Resume a waiting run with ``value``, played as a call plays a turn: a run that fails
        after its answer is that run's failure, reported as ``_play`` reports any."""
        info = await self.deck.store.run_info(run_id)
        if info is None or info.namespace is not None:  # runs started over HTTP have none
            raise UnknownRunError(run_id)
        return await self._play(info.name, info.session_id,
                                self.deck.stream_answer(run_id, value, committed=True))

    # -------------------------------------------------------------------------- resources --
    async def _resources(self) -> list[types.Resource]:
        return [types.Resource(uri=f"{SKILL_SCHEME}://{name}", name=name, mimeType="text/markdown",
                               description=skill.description)
                for name, skill in sorted(self.deck.skills.items())]

    async def _templates(self) -> list[types.ResourceTemplate]:
        return []

    async def _read(self, uri: Any) -> list[ReadResourceContents]:
        url = str(uri)
        skill = self.deck.skills.get(url.removeprefix(f"{SKILL_SCHEME}://"))
        if not url.startswith(f"{SKILL_SCHEME}://") or skill is None:
            raise McpError(types.ErrorData(code=types.INVALID_PARAMS, message=f"no resource {url}"))
        return [ReadResourceContents(content=skill.body, mime_type="text/markdown")]
