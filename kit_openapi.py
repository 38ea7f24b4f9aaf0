"""kit_openapi: the OpenAPI 3.1 document of kit's HTTP surface (``GET /openapi.json``).

Owns: the description of every route kit_http serves (``OPERATIONS``, keyed by the very
``(method, path)`` pairs of kit_http's route table), the request, response and error schemas,
and ``document()``, which assembles the document for the routes one app serves.

Must never: route or answer anything (kit_http does; this module is data and one function),
describe a route kit_http does not serve or leave one it serves out (``document`` raises
``KeyError`` for a route without a description, and a test holds ``OPERATIONS`` equal to the
route table), or put a deck's secrets in the document (only agent and workflow names). The
HEAD kit_http answers on a GET route (not a stream's) is an operation of its own, made from
the GET's (``_head``), so a client generated from the document can send it.

The SSE routes are documented as ``text/event-stream``, with their frames in the operation text
and, as OpenAPI 3.1 tools read such a schema, one schema per frame (``_frame``), whose ``data``
is JSON of a named schema (JSON Schema's ``contentMediaType`` and ``contentSchema``).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from kit_core import MAX_ID_CHARS

__all__ = ("document", "OPERATIONS", "OPENAPI_VERSION", "API_VERSION")

#: The OpenAPI release the document follows (JSON Schema 2020-12 inside).
OPENAPI_VERSION = "3.1.0"
#: The version of the HTTP wire described (v1.2.1 of SPEC, plus kit's beyond-spec routes).
API_VERSION = "1.2.1"

_STR: dict[str, Any] = {"type": "string"}
_OPT_STR: dict[str, Any] = {"type": ["string", "null"]}
_NAMES: dict[str, Any] = {"type": "array", "items": _STR}
_SEQ: dict[str, Any] = {"type": "string", "pattern": "^(-1|[0-9]{1,18})?$",
                        "description": "an event seq; empty or -1: from the start"}
#: An id (``kit_core.check_id``): a session, thread or run id.
_ID: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS,
                       "pattern": "^[^\\u0000-\\u001f\\u007f-\\u009f]*$", "description":
                       f"an id: 1 to {MAX_ID_CHARS} characters, no control character"}
_SESSION: dict[str, Any] = {**_ID, "type": ["string", "null"],
                            "description": "the conversation; absent: a one-off turn"}
_THREAD: dict[str, Any] = {**_ID, "type": ["string", "null"], "description":
                           "the thread; absent: a new one (a durable workflow needs it: 400)"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(required: Iterable[str] = (), closed: bool = True, **properties: Any) -> dict[str, Any]:
    """An object schema; ``closed`` forbids fields the document does not name: a response never
    has one, and a request body with one is a 400 naming it (a misspelt key must not pass for an
    absent one). The Chat Completions request stays open: OpenAI clients send many fields."""
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required := list(required):
        schema["required"] = required
    if closed:
        schema["additionalProperties"] = False
    return schema


_SCHEMAS: dict[str, Any] = {
    "Error": _object(["error", "message"], error={"type": "string", "description":
                     "the exception type's name, e.g. UnknownNameError"}, message=_STR),
    "Status": _object(["status"], status={"enum": ["starting", "stopping"]}),
    "Health": _object(["status", "agents", "workflows", "skills"], status={"const": "ok"},
                      agents=_NAMES, workflows=_NAMES, skills=_NAMES),
    "ChatRequest": _object(["message"], message=_STR, session_id=_SESSION),
    "ChatReply": _object(["output"], output={"description": "the reply's text, or the JSON of "
                                             "the agent's structured output"}),
    "Usage": _object(["input_tokens", "output_tokens", "usd"], input_tokens={"type": "integer"},
                     output_tokens={"type": "integer"}, usd={"type": ["number", "null"]}),
    "WorkflowRequest": _object((), input={"type": ["object", "null"],
                               "description": "the initial state"}, thread_id=_THREAD),
    "WorkflowOutput": _object(["output", "thread_id", "run_id"], output={"description":
                              "the final state"}, thread_id=_STR, run_id=_STR),
    "Interrupt": _object(["type", "payload", "thread_id", "run_id"], type={"const": "interrupt"},
                         payload={"description": "what the workflow asks (or a sleep's until)"},
                         thread_id=_STR, run_id=_STR),
    "WorkflowReply": {"oneOf": [_ref("WorkflowOutput"), _ref("Interrupt")]},
    "Pending": _object(["pending"], pending={"type": "array", "items": _object(
        ["run_id", "workflow", "thread_id", "session_id", "payload", "since"], run_id=_STR,
        workflow=_STR, thread_id=_STR, session_id=_OPT_STR, payload={},
        since={"type": "string", "format": "date-time"})}),
    "ResumeRequest": _object(["value"], value={"description": "the answer: any JSON value"}),
    "ControlRequest": _object((), reason=_OPT_STR),
    "Empty": _object(()),
    "OpenAIRequest": _object(["model", "messages"], False, model={"type": "string", "minLength": 1},
                             messages={"type": "array", "items": {"type": "object"}, "minItems": 1},
                             stream={"type": ["boolean", "null"]},
                             n={"enum": [1, None], "description": "an agent answers once a turn"}),
    "OpenAIError": _object(["error"], error=_object(
        ["message", "type", "param", "code"], message=_STR, param={"type": "null"},
        type={"enum": ["invalid_request_error", "server_error"]},
        code={"type": "string", "description": "kit's exception type name"})),
    "ControlAccepted": _object(["run_id", "requested"], run_id=_STR,
                               requested={"enum": ["pause", "cancel"]}),
    "Event": _object(["run_id", "seq", "kind", "at", "origin", "message_id", "payload"],
                     run_id=_STR, seq={"type": "integer", "minimum": 0},
                     kind={"type": "string", "description": "run.started, text.delta, "
                           "tool.started, node.updated, run.completed, ..."},
                     at={"type": "string", "format": "date-time"}, origin=_STR,
                     message_id=_OPT_STR, payload={"type": "object"}),
    "Resumed": _object(["run_id", "events"], run_id=_STR,
                       events={"type": "array", "items": _ref("Event")}),
    # The data of SSE frames (see _frame)
    "Delta": _object(["delta"], delta=_STR),
    "ChatDone": _object(["output", "usage"], output={}, usage=_ref("Usage")),
    "NodeUpdate": _object(["node", "update"], node=_STR, update={}),
    "WorkflowDone": _object(["output"], output={}),
    "StreamError": _object(["error"], error={"type": "string", "description":
                           "the exception type's name (RunStoppedError: paused or cancelled)"}),
    "Shutdown": _object(["run_id"], run_id=_STR),
    "NativeChatRequest": _object((), session_id=_SESSION, input={
        "type": ["string", "array", "object", "null"],
        "description": "an agent's text or content blocks; a workflow's initial state"}),
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": _ref("Error")}}}


_RESPONSES: dict[str, Any] = {
    "400": _error("Malformed: not a JSON object of the expected shape (bad UTF-8, a lone "
                  "surrogate escape, nesting deeper than 64, a huge number, a key twice in one "
                  "object), a bad content block or a bad argument, or a path parameter that is "
                  "not UTF-8 once percent-decoded or (run_id, thread_id) not an id"),
    "403": _error("The request comes from a page of another origin that KIT_CORS_ORIGINS "
                  "does not list"),
    "404": _error("No such agent, workflow, run or waiting thread"),
    "409": _error("The session or thread is busy with another run, the run was stopped on "
                  "request, or it is not paused"),
    "408": _error("The body stopped arriving: nothing of it came for 30 s"),
    "413": _error("The body is over 2 MiB"),
    "415": _error("A body that is not application/json, or sent with a Content-Encoding"),
    "421": _error("The Host header names a host this server does not answer for "
                  "(KIT_ALLOWED_HOSTS)"),
    "500": _error("The run failed (error: its exception type; the log has the details), or "
                  "an internal error"),
    "503": {"description": "Starting (the deck is not open yet) or stopping", "content": {
        "application/json": {"schema": {"oneOf": [_ref("Status"), _ref("Error")]}}}},
}
_ALWAYS = ("403", "421", "500", "503")
_BODY = ("400", "408", "413", "415")
_RUN_ID = {"x-kit-run-id": {"description": "The run this response belongs to: pick a lost "
                            "stream up with GET /runs/{run_id}/events", "schema": _STR}}


def _json(schema: str, description: str, *, run: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description,
                           "content": {"application/json": {"schema": _ref(schema)}}}
    if run:
        out["headers"] = _RUN_ID
    return out


def _frame(data: str, event: str | None = None) -> dict[str, Any]:
    """One SSE frame as OpenAPI 3.1 tools read a ``text/event-stream`` schema (each event:
    ``event``, ``id``, ``data``; OpenAPI 3.2 calls it ``itemSchema``): ``data`` is one line of
    JSON of the schema ``data``; ``event`` the given name (None: any, the native kinds)."""
    return _object(["event", "data"], closed=False, event=_STR if event is None else {"const": event},
                   id={"type": "string", "pattern": "^[0-9]+$"},
                   data={"type": "string", "contentMediaType": "application/json",
                         "contentSchema": _ref(data)})


def _sse(*frames: dict[str, Any]) -> dict[str, Any]:
    return {"schema": {"oneOf": [*frames, _frame("Shutdown", "server.shutdown")]}}


_CHAT_SSE = _sse(_frame("Delta", "message"), _frame("ChatDone", "done"), _frame("StreamError", "error"))
_WORKFLOW_SSE = _sse(_frame("NodeUpdate", "message"), _frame("WorkflowDone", "done"),
                     _frame("Interrupt", "interrupt"), _frame("StreamError", "error"))
_NATIVE_SSE = _sse(_frame("Event"), _frame("StreamError", "error"))
#: A resumed run streams as the run that paused: an agent's frames or a workflow's (anyOf: both
#: have a ``message`` and a ``done`` frame).
_RESUME_SSE = {"schema": {"anyOf": [
    _frame("Delta", "message"), _frame("ChatDone", "done"), _frame("NodeUpdate", "message"),
    _frame("WorkflowDone", "done"), _frame("Interrupt", "interrupt"), _frame("StreamError", "error"),
    _frame("Shutdown", "server.shutdown")]}}


def _streams(json_schema: str, description: str, frames: dict[str, Any]) -> dict[str, Any]:
    """A 200 that is JSON, or SSE with ``stream=true``."""
    out = _json(json_schema, description, run=True)
    out["content"]["text/event-stream"] = frames
    return out


def _param(name: str, where: str = "path", schema: dict[str, Any] = _STR, **extra: Any) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "schema": schema, **extra}


#: A path parameter is percent-encoded, each on its own (OpenAPI's default ``simple`` style):
#: kit splits the path at a bare ``/`` only, so an id may hold one, sent as ``%2F``.
_IN_PATH = ("Percent-encoded, as every path parameter: a `/` in it is `%2F`, a `%` is `%25`; "
            "decoded, it must be UTF-8 (else 400). An id that is just `.` or `..` cannot be "
            "sent by a browser, which resolves dot segments even spelt `%2E`")
_RUN_ID_PARAM = _param("run_id", schema=_ID, description=_IN_PATH)
_STREAM = _param("stream", "query", description="`true` or `1`: answer with server-sent events "
                 "(any other value: JSON)", examples={"stream": {"value": "true"}})
_SSE_COMMON = ("Every frame carries `id: <seq>` (the event's seq in the run's log); `: ping` "
               "comes every 15 s while the run is quiet; a server that stops first ends the "
               "stream with `event: server.shutdown` `data: {\"run_id\"}`. A client that lost "
               "the stream picks the run up with `GET /runs/{run_id}/events` and "
               "`Last-Event-ID` (a streamed POST that carries one is a 400: it would play the "
               "turn again); a client disconnect never ends the run.")


def _op(op_id: str, summary: str, responses: dict[str, Any], errors: Iterable[str] = (), *,
        body: str | None = None, body_required: bool = True, params: Iterable[dict] = (),
        description: str = "", error_schema: str = "Error") -> dict[str, Any]:
    """One operation; its errors (403, 421, 500 and 503 for every route; ``errors`` and, with a
    ``body``, 400/408/413/415, or with a path parameter 400) as ``error_schema``: kit's
    ``Error``, or ``OpenAIError`` for a route of the Chat Completions wire, where kit_http
    answers every refusal in OpenAI's shape."""
    op: dict[str, Any] = {"operationId": op_id, "summary": summary}
    if description:
        op["description"] = description
    if params := list(params):
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {"required": body_required, "content": {"application/json": {
            "schema": _ref(body)}}}
        errors = (*_BODY, *errors)
    elif any(p["in"] == "path" for p in params):  # a parameter that is not UTF-8, decoded
        errors = ("400", *errors)
    refs: dict[str, Any] = {}
    for code in (*_ALWAYS, *errors):
        refs[code] = {"$ref": f"#/components/responses/{code}"} if error_schema == "Error" else {
            "description": _RESPONSES[code]["description"],
            "content": {"application/json": {"schema": _ref(error_schema)}}}
    op["responses"] = dict(sorted({**responses, **refs}.items()))
    return op


#: POST /mcp's body (its own 400 is JSON-RPC's parse error, so not ``_op``'s ``body``).
_MCP_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "description": "one JSON-RPC 2.0 message: a request, notification or "
    "response"}}}}}

#: Every route kit_http can serve, by ``(method, path)`` exactly as its route table spells them.
OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("GET", "/"): _op("playground", "The playground page (off with kit-serve --no-playground)",
                      {"200": {"description": "One self-contained HTML page",
                               "content": {"text/html": {"schema": _STR}}}}),
    ("GET", "/openapi.json"): _op("openapi", "This document", {"200": {
        "description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}),
    ("GET", "/health"): _op("health", "Whether the deck is open, and its catalog",
                            {"200": _json("Health", "Open; the names it serves")}),
    ("POST", "/agents/{name}/chat"): _op(
        "agentChat", "One turn of an agent, on a session when session_id is given",
        {"200": _streams("ChatReply", "The reply (JSON), or its stream (SSE)", _CHAT_SSE)},
        ("404", "409"),
        body="ChatRequest", params=[_param("name"), _STREAM], description=(
            "With `stream=true` the answer is `text/event-stream`: `data: {\"delta\": str}` per "
            "chunk of the reply, then `event: done` `data: {\"output\", \"usage\": {\"input_tokens\", "
            "\"output_tokens\", \"usd\"}}`, or `event: error` `data: {\"error\": <exception type>}` "
            "(a failed run, or RunStoppedError for a paused or cancelled one). " + _SSE_COMMON)),
    ("GET", "/workflows/pending"): _op(
        "workflowsPending", "Every run waiting for a human that the resume route answers (none "
        "started with a namespace)", {"200": _json("Pending", "The waiting runs")}),
    ("POST", "/workflows/{name}"): _op(
        "workflowRun", "Run a workflow on a thread (a new one without thread_id)",
        {"200": _streams("WorkflowReply", "The final state, or the interrupt it parked at",
                         _WORKFLOW_SSE)},
        ("404", "409"), body="WorkflowRequest", params=[_param("name"), _STREAM], description=(
            "With `stream=true` the answer is `text/event-stream`: `data: {\"node\", \"update\"}` "
            "per completed node, then `event: done` `data: {\"output\"}`, `event: interrupt` "
            "`data: {\"type\": \"interrupt\", \"payload\", \"thread_id\", \"run_id\"}` or "
            "`event: error` `data: {\"error\"}`. " + _SSE_COMMON)),
    ("POST", "/workflows/{name}/{thread_id}/resume"): _op(
        "workflowAnswer", "Answer the run waiting on a thread",
        {"200": _streams("WorkflowReply", "The final state, or the next interrupt (JSON), or "
                         "the stream of the run going on (SSE)", _WORKFLOW_SSE)},
        ("404", "409"), body="ResumeRequest",
        params=[_param("name"), _param("thread_id", schema=_ID, description=_IN_PATH), _STREAM],
        description=("With `stream=true` the answer is `text/event-stream`, the frames of "
                     "`POST /workflows/{name}?stream=true` from the answered interrupt on. "
                     + _SSE_COMMON)),
    ("POST", "/runs/{run_id}/pause"): _op(
        "runPause", "Ask a running run to pause at its next safe point (409: it is parked or "
        "finished)",
        {"202": _json("ControlAccepted", "Recorded; the run stops at its next safe point", run=True)},
        ("404", "409"), body="ControlRequest", body_required=False, params=[_RUN_ID_PARAM]),
    ("POST", "/runs/{run_id}/cancel"): _op(
        "runCancel", "Ask a run to cancel at its next safe point (a parked run at once; 409: it "
        "has finished)",
        {"202": _json("ControlAccepted", "Recorded; the run stops at its next safe point", run=True)},
        ("404", "409"), body="ControlRequest", body_required=False, params=[_RUN_ID_PARAM]),
    ("POST", "/runs/{run_id}/resume"): _op(
        "runResume", "Continue a paused run here, to its end or next stop",
        {"200": _streams("Resumed", "The events the run produced (JSON), or its stream (SSE)",
                         _RESUME_SSE)}, ("404", "409"),
        body="Empty", body_required=False, params=[_RUN_ID_PARAM, _STREAM], description=(
            "With `stream=true` the answer is `text/event-stream`, the frames of the run that "
            "paused: an agent's as `POST /agents/{name}/chat?stream=true`, a workflow's as "
            "`POST /workflows/{name}?stream=true`. " + _SSE_COMMON)),
    ("GET", "/runs/{run_id}/events"): _op(
        "runEvents", "The run's log as server-sent events: replay, then live",
        {"200": {"description": "The events", "headers": _RUN_ID,
                 "content": {"text/event-stream": _NATIVE_SSE}},
         "204": {"description": "Nothing after the given seq: the run has ended"}},
        ("400", "404"), params=[
            _RUN_ID_PARAM,
            _param("after", "query", _SEQ, description="Resume after this seq"),
            _param("Last-Event-ID", "header", _SEQ,
                   description="Resume after this seq (EventSource sends it); wins over after "
                               "unless empty (no id seen yet)")],
        description=("Frames `id: <seq>`, `event: <kind>`, `data: <Event>` (the envelope, one "
                     "line of JSON), replayed from the log after the given seq, then live until "
                     "the run ends or parks (a run still parked stops at its parking event; ask "
                     "again after it to wait for the run to go on). Past the terminal event: "
                     "204, which stops EventSource reconnecting. " + _SSE_COMMON)),
    ("POST", "/v2/invocables/{name}/chat"): _op(
        "nativeChat", "Play an agent or workflow, streaming its raw event envelopes",
        {"200": {"description": "`id: <seq>`, `event: <kind>`, `data: <Event>` per event",
                 "headers": _RUN_ID, "content": {"text/event-stream": _NATIVE_SSE}}},
        ("404", "409"), body="NativeChatRequest", params=[_param("name")]),
    # The optional surfaces (KIT_SURFACES): their wires are OpenAI's and MCP's, documented there.
    ("POST", "/v1/chat/completions"): _op(
        "chatCompletions", "OpenAI Chat Completions: `model` names an agent (KIT_SURFACES=openai)",
        {"200": {"description": "A chat.completion object, or with `stream: true` "
                 "`chat.completion.chunk` frames then `data: [DONE]`; errors are OpenAI's "
                 "`{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`, also as "
                 "the last frame of a stream whose run fails or whose server stops first "
                 "(`code` `ServerStoppingError`)",
                 "headers": _RUN_ID, "content": {"application/json": {"schema": {"type": "object"}},
                                                 "text/event-stream": {"schema": _STR}}}},
        ("404", "409"), body="OpenAIRequest", error_schema="OpenAIError"),
    ("GET", "/v1/models"): _op("models", "OpenAI model list: the agents (KIT_SURFACES=openai)",
                               {"200": {"description": "A list object", "content": {
                                   "application/json": {"schema": {"type": "object"}}}}},
                               error_schema="OpenAIError"),
    ("GET", "/v1/models/{model}"): _op(
        "model", "OpenAI model: an agent (KIT_SURFACES=openai)",
        {"200": {"description": "A model object", "content": {
            "application/json": {"schema": {"type": "object"}}}}},
        ("404",), params=[_param("model")], error_schema="OpenAIError"),
    **{(method, "/mcp"): {**_op(
        f"mcp{method.title()}", "The MCP server, streamable HTTP transport (KIT_SURFACES=mcp)",
        {"200": {"description": "JSON-RPC, as MCP's streamable HTTP transport specifies",
                 "content": {"application/json": {"schema": {"type": "object"}},
                             "text/event-stream": {"schema": _STR}}},
         "202": {"description": "A notification or response, accepted"},
         "400": {"description": "Not JSON (a JSON-RPC parse error, -32700) or not a JSON-RPC "
                 "request the transport takes", "content": {"application/json": {"schema": {
                     "type": "object"}}, "text/plain": {"schema": _STR}}},
         "406": {"description": "The Accept header does not take both application/json and "
                 "text/event-stream"},
         **{code: _RESPONSES[code] for code in ("408", "413", "415") if method == "POST"}},
        description="Stateless: no MCP session lives between requests, so DELETE (ending one) "
                    "is a 405."), **(_MCP_BODY if method == "POST" else {})}
       for method in ("POST", "GET")},
}


def _head(get: dict[str, Any]) -> dict[str, Any]:
    """The HEAD operation of a GET route kit_http answers HEAD on: the GET's statuses and
    headers, no content (RFC 9110 section 9.3.2)."""
    responses = {}
    for code, response in get["responses"].items():
        if "$ref" in response:
            response = _RESPONSES[response["$ref"].rpartition("/")[2]]
        responses[code] = {k: v for k, v in response.items() if k != "content"}
    return {**get, "operationId": get["operationId"] + "Head",
            "summary": f"{get['summary']} (HEAD: the GET's headers, no body)",
            "responses": responses}


def document(routes: Iterable[tuple[str, str]], *, agents: Iterable[str] = (),
             workflows: Iterable[str] = (), root_path: str = "") -> dict[str, Any]:
    """The OpenAPI document of ``routes`` (``(method, path)`` pairs, as served; ``("HEAD",
    path)`` for a GET route answered on HEAD too), with the ``name`` parameters limited to the
    deck's ``agents`` and ``workflows`` when there are any, and ``root_path`` (an app mounted
    below one: ASGI's, decoded) as its server, which every path is below. Raises ``KeyError``
    for a route ``OPERATIONS`` does not describe (a HEAD: whose GET it does not)."""
    names = {"/agents/": sorted(agents), "/workflows/": sorted(workflows),
             "/v2/": sorted({*agents, *workflows})}
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes:
        op = (_head(OPERATIONS[("GET", path)]) if method == "HEAD"
              else dict(OPERATIONS[(method, path)]))
        known = next((v for k, v in names.items() if path.startswith(k)), [])
        if known and "{name}" in path:
            op["parameters"] = [_param("name", schema={"enum": known}) if p["name"] == "name"
                                else p for p in op["parameters"]]
        paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "kit", "version": API_VERSION, "description": (
            "A kit deck over HTTP and SSE: agents (OpenAI Agents SDK) and workflows (LangGraph) "
            "on one append-only event log. Unauthenticated. Errors are `{\"error\", \"message\"}`. "
            "Requests that carry an Origin must come from this server's own pages or an origin "
            "in KIT_CORS_ORIGINS, which also get CORS answers (OPTIONS preflight).")},
        # Without servers a client resolves the paths against the host's root (OpenAPI 3.1
        # section 4.8.1: the default server is "/"), beside the mount, not in it.
        **({"servers": [{"url": quote(root_path), "description": "this app's mount"}]}
           if root_path else {}),
        "paths": paths,
        "components": {"schemas": _SCHEMAS, "responses": _RESPONSES},
    }
