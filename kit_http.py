"""kit_http: a deck over HTTP and SSE, as a raw ASGI 3 application, and ``serve`` under Hypercorn.

Owns: the ASGI app (``App``: lifespan, routing, the handlers, the error statuses, the open SSE
responses, whose frames and streams kit_sse makes; one exchange's body and JSON response are
kit_request's), serving the playground page (kit_playground)
and the OpenAPI document (kit_openapi), applying the browser-safety policy (kit_guard) at the top
of dispatch, and ``serve`` (an app under Hypercorn, whose configuration and shutdown trigger
are kit_hypercorn's).
``kit-serve``, the process, is kit_serve (``python -m kit_http`` runs it).

Must never: hold business logic (a handler passes plain arguments to the Deck: a name, a session
id, input; the Runtime makes the run's context, always ``None`` here), reach a deck by anything
but its public methods, import kit.py outside ``main()`` (it sits above this module: a deck makes
its app, ``deck.asgi()``), import a web framework,
import Hypercorn at module import (``deck.asgi()`` works without the ``serve`` extra), or put the
application context or secrets in a response or a log line. Every limit is a named constant.

Theory of operation
-------------------
One dispatcher sends each ASGI scope to the lifespan or to the router. The lifespan opens the
deck at startup and closes it at shutdown, both in the lifespan task (the deck's task group lives
there); until it is open every request gets 503 ``{"status": "starting"}``. Routes match the path
as the client spelt it (ASGI's ``raw_path``, each segment percent-decoded on its own), so an id
holding ``/``, sent as ``%2F``, is one path parameter, as it is in a body; a server without
``raw_path`` (it is optional) leaves only the decoded ``path``, where ``%2F`` and ``/`` look
alike. A body is read up to ``MAX_BODY_BYTES`` (Hypercorn has no limit for ASGI apps,
notes/CONVENTIONS.md A7) and parsed strictly: bad UTF-8, deep nesting, huge integers and NaN are
400s, never 500s. Errors are answered from one table, ``ERROR_STATUS``, as ``{"error": <exception
type name>, "message": ...}``.

An SSE response is a ``kit_sse.Stream`` (the handler, its writer, sends what is ready; a reader of
the run's events and a disconnect watcher join it once it waits for more) that the app keeps
while it is open. The run belongs to the deck: a disconnect ends the stream, never the run, and
the client picks the run up with ``GET /runs/{id}/events`` and ``Last-Event-ID`` (every frame's
``id`` is its event's seq; OpenAI's wire has no ``id``).

``App.shutdown()`` (``serve``'s trigger on SIGINT/SIGTERM, and the lifespan) ends every open stream
itself with its wire's closing frame (``event: server.shutdown`` on kit's own; OpenAI's error
shape on the Chat Completions wire, whose clients ignore event names), because Hypercorn's
graceful timeout does not end open streams on Python 3.12+ (CONVENTIONS A7); in-flight JSON
requests get ``kit_sse.STOP_GRACE`` seconds.

Everything kit_http says goes through the ``logging`` module (loggers ``kit_http``: an unexpected
error's type and stack, the address ``serve`` listens on; ``kit_http.access``: one line per request
with ``serve(access_log=True)``). ``kit-serve`` gives them its console; mounted in another
application, that application's logging decides.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
import typing
from typing import Any
from urllib.parse import quote

import anyio
import sniffio

import kit_openai
from kit_core import (
    CheckpointMissingError, ConfigError, ContentError, DeckStateError, Event, InterruptResult,
    LogConflictError, RunNotWaitingError, RunStatus, RunStoppedError, SessionBusyError,
    StoreUnavailableError, UnknownNameError, UnknownRunError, block_from_json, control_refusal,
    new_run_id, printable, quoted, stops, switch_setting,
)
from kit_guard import Guard, HostNotAllowedError, OriginNotAllowedError
from kit_hypercorn import hypercorn_config, until_stopped
from kit_playground import load as load_playground
from kit_request import MAX_BODY_BYTES as _MAX_BODY
from kit_request import (
    BodyTooLargeError, ClientGone, ControlRefusedError, MalformedRequestError, MethodNotAllowedError,
    NotResumableError, Request, RequestTimeoutError, RouteNotFoundError, Scope, ServerStoppingError,
    ThreadNotWaitingError, UnsupportedMediaTypeError, body_field, body_id, checked_id, param,
    parse_json, respond, route_path, with_headers,
)
import kit_sse  # STOP_GRACE is read there at each shutdown: one knob for streams and requests
from kit_sse import (
    Ending, FrameOf, Message, Receive, Send, Stream, data_frames, dumps, native_frame,
    ending_frame, sse_frame, v1_frame, v1_workflow_frame,
)
from kit_storebase import replay

if typing.TYPE_CHECKING:
    from kit import Deck

__all__ = ("App", "serve", "main", "SURFACES", "ERROR_STATUS")

#: What kit_http says (an unexpected error, ``serve``'s address); ``kit_http.access``: the access
#: log, with ``serve(access_log=True)``; ``kit_http.hypercorn``: Hypercorn's own messages (both
#: handed to Hypercorn by kit_hypercorn). Only ``kit-serve`` (kit_serve) gives them a handler.
_log = logging.getLogger("kit_http")

_TERMINAL = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)
_SEQ = re.compile(r"(-1|[0-9]{1,18})?")  # Last-Event-ID / ?after= (empty or -1: from the start)


# ===================================================================================== errors ====

class _RunFailed(Exception):
    """The run this request played failed; ``error`` is its exception type's name."""

    def __init__(self, run_id: str, error: BaseException) -> None:
        self.error = type(error).__name__
        super().__init__(f"run {run_id} failed ({self.error}); its log has the details: "
                         f"kit runs events {run_id}")


#: The one map from exception type to HTTP status; the first class along the MRO wins, and
#: anything missing is a 500 with a generic message.
ERROR_STATUS: dict[type[BaseException], int] = {
    MalformedRequestError: 400, ContentError: 400, ConfigError: 400, kit_openai.ChatRequestError: 400,
    OriginNotAllowedError: 403,
    RouteNotFoundError: 404, UnknownNameError: 404, UnknownRunError: 404,
    RunNotWaitingError: 404, ThreadNotWaitingError: 404,
    MethodNotAllowedError: 405, RequestTimeoutError: 408,
    SessionBusyError: 409, RunStoppedError: 409, NotResumableError: 409, LogConflictError: 409,
    ControlRefusedError: 409, CheckpointMissingError: 409,
    BodyTooLargeError: 413, UnsupportedMediaTypeError: 415,
    HostNotAllowedError: 421,  # Misdirected Request: not a name this server answers for
    _RunFailed: 500,
    DeckStateError: 503, ServerStoppingError: 503, StoreUnavailableError: 503,
}


def _status_of(exc: BaseException) -> int:
    return next((ERROR_STATUS[c] for c in type(exc).__mro__ if c in ERROR_STATUS), 500)


def _workflow_body(result: Any, run_id: str, thread_id: str) -> dict[str, Any]:
    if isinstance(result, InterruptResult):
        return {"type": "interrupt", "payload": result.payload, "thread_id": result.thread_id,
                "run_id": run_id}
    return {"output": result, "thread_id": thread_id, "run_id": run_id}


# ===================================================================================== routes ====

#: The route table: method, path (an OpenAPI path template, the very key kit_openapi describes
#: the route by), handler, and the switch that mounts it (None: always). A concrete path comes
#: before the templated ones it also matches (``POST /workflows/pending`` is a 405, not a run).
_ROUTES = [(method, path, re.compile(re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", path)), handler, mount)
           for method, path, handler, mount in (
    ("GET", "/", "_playground", "playground"),
    ("GET", "/openapi.json", "_openapi", None),
    ("GET", "/health", "_health", None),
    ("POST", "/agents/{name}/chat", "_agent_chat", None),
    ("GET", "/workflows/pending", "_pending", None),
    ("POST", "/workflows/{name}", "_workflow", None),
    ("POST", "/workflows/{name}/{thread_id}/resume", "_workflow_resume", None),
    ("POST", "/runs/{run_id}/pause", "_pause", None),
    ("POST", "/runs/{run_id}/cancel", "_cancel", None),
    ("POST", "/runs/{run_id}/resume", "_resume_run", None),
    ("GET", "/runs/{run_id}/events", "_events", None),
    ("POST", "/v2/invocables/{name}/chat", "_native_chat", "native"),
    ("POST", "/v1/chat/completions", "_chat_completions", "openai"),
    ("GET", "/v1/models", "_models", "openai"),
    ("GET", "/v1/models/{model}", "_model", "openai"),
    ("POST", "/mcp", "_mcp", "mcp"),
    ("GET", "/mcp", "_mcp", "mcp"),  # stateless: no session for DELETE to end (405)
)]
#: The GET handlers that answer with a stream: no HEAD for them (RFC 9110 section 9.3.2 asks the
#: headers a GET would get, and a stream's come only once it is open, to stay open).
_STREAMING_GETS = frozenset({"_events", "_mcp"})
#: The path parameters that are ids, checked (``check_id``) before any route sees them.
_PATH_IDS = frozenset({"run_id", "thread_id"})
#: The optional surfaces ``kit-serve`` turns on when ``KIT_SURFACES`` (or ``--surfaces``) names
#: them: the Chat Completions wire (kit_openai) and the MCP server (kit_mcp).
SURFACES = ("openai", "mcp")


# ======================================================================================== App ====

class App:
    """The deck's HTTP surface, an ASGI 3 application (``deck.asgi()`` returns one).

    Its lifespan opens the deck at startup and closes it at shutdown; it may be mounted inside
    another ASGI app (paths are matched below ``scope["root_path"]``). ``native=True`` adds the
    native routes ``POST /v2/invocables/{name}/chat``, which ``kit-serve`` never mounts (SPEC 1).
    ``surfaces`` names optional surfaces to serve too (``SURFACES``; none by default):
    ``"openai"`` adds ``POST /v1/chat/completions`` and ``GET /v1/models[/{model}]``
    (kit_openai), ``"mcp"`` an MCP server at ``/mcp`` (kit_mcp, started by the lifespan once
    the deck is open).
    ``playground`` serves the playground page at ``GET /`` (default: unless ``KIT_PLAYGROUND``
    is ``0``; off, ``/`` is a 404 as before). ``guard`` says which ``Host`` and ``Origin`` headers
    are answered (default: ``Guard.from_env``, which answers loopback names only unless
    ``KIT_ALLOWED_HOSTS`` says otherwise). Raises ``ConfigError`` for an unknown surface, a string
    for ``surfaces`` (a list of names), or a malformed setting. HTTP runs never carry a namespace
    or a context (SPEC 4.3). When the deck does not open, ``open_error`` holds why (the server's
    own error only says the lifespan failed).
    """

    def __init__(self, deck: Deck, *, native: bool = False, surfaces: typing.Iterable[str] = (),
                 playground: bool | None = None, guard: Guard | None = None) -> None:
        if isinstance(surfaces, str):  # its letters would each be named an unknown surface
            raise ConfigError(f"surfaces takes a list of names, got the string {surfaces!r}: "
                              f"wrap it in a list, surfaces=[{surfaces!r}]")
        self.deck, self.native, self.surfaces = deck, native, frozenset(surfaces)
        unknown = sorted(self.surfaces - set(SURFACES))
        if unknown:
            raise ConfigError(f"unknown surface {', '.join(unknown)}; the surfaces are "
                              f"{', '.join(SURFACES)}")
        self._mcp_server: Any = None  # kit_mcp.MCPSurface while the lifespan holds it open
        self.open_error: Exception | None = None
        self.guard = Guard.from_env(os.environ) if guard is None else guard
        if playground is None:
            playground = switch_setting("KIT_PLAYGROUND", os.environ.get("KIT_PLAYGROUND"), True)
        self._page = load_playground() if playground else None
        self.playground = self._page is not None  # GET / is served
        mounted = {None: True, "native": native, "playground": self.playground,
                   **{s: s in self.surfaces for s in SURFACES}}
        self._routes = [r for r in _ROUTES if mounted[r[-1]]]
        self._document: tuple[str, bytes] | None = None  # (root_path, the document)
        self._open = self._stopping = False
        self._agents: frozenset[str] = frozenset()
        self._workflows: frozenset[str] = frozenset()
        self._durable: frozenset[str] = frozenset()  # workflows whose runs need a thread_id
        self._skills: list[str] = []
        self._created = 0  # the models' created (GET /v1/models): when the deck opened
        self._streams: set[Stream] = set()
        self._mcp_streams: set[anyio.CancelScope] = set()  # GET /mcp: idle until the client leaves
        self._inflight: set[anyio.CancelScope] = set()
        self._idle: anyio.Event | None = None
        self._grace: anyio.CancelScope | None = None  # shutdown's wait for in-flight requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(Request(scope, receive, send))
        elif scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        elif scope["type"] == "websocket":  # a close before accepting is a 403 (ASGI www spec)
            await send({"type": "websocket.close", "code": 1008})
        else:
            raise RuntimeError(f"kit_http serves http and lifespan scopes, not {scope['type']!r}")

    # ------------------------------------------------------------------------ lifecycle --
    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Open the deck on ``lifespan.startup``, close it on ``lifespan.shutdown``, both in this
        task: the deck's task group is entered here and must be left here."""
        entered = False
        try:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    try:
                        entered = True
                        try:
                            await self.deck.__aenter__()
                        except DeckStateError:
                            entered = False  # open (opening, closed) by another: theirs to close
                            raise
                        await self._open_mcp()
                    except Exception as exc:
                        self.open_error = exc
                        # A failed open frees the live-deck slot. Unshielded: the deck leaves its
                        # task group from the scope it entered it in (its close shields the rest).
                        if entered:
                            await self.deck.aclose()
                        await send({"type": "lifespan.startup.failed",
                                    "message": f"{type(exc).__name__}: {exc}"})
                        return
                    self._agents, self._workflows = frozenset(self.deck.agents), frozenset(self.deck.workflows)
                    self._durable = frozenset(n for n, w in self.deck.workflows.items() if w.durable)
                    self._skills, self._created = sorted(self.deck.skills), int(time.time())
                    if isinstance(scope.get("state"), dict):
                        scope["state"]["kit.deck"] = self.deck
                    self._open = True
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.shutdown()
                    self._open = False
                    await self._close_mcp()
                    await self.deck.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        finally:  # cancelled or broke, opening or open: still close the deck (idempotent)
            if entered:  # unshielded: each task group is left from the scope it was entered in
                self._open = False
                try:
                    await self._close_mcp()
                finally:
                    await self.deck.aclose()

    async def _open_mcp(self) -> None:
        """Start the MCP server over the open deck (its sessions' task group lives in the
        lifespan task, like the deck's). ``mcp`` is imported here, only when it is served."""
        if "mcp" in self.surfaces:
            import kit_mcp
            surface = kit_mcp.MCPSurface(self.deck, max_body=_MAX_BODY)
            await surface.__aenter__()
            self._mcp_server = surface

    async def _close_mcp(self) -> None:
        surface, self._mcp_server = self._mcp_server, None
        if surface is not None:
            await surface.__aexit__(None, None, None)

    async def shutdown(self) -> None:
        """Stop serving: new requests get 503, every open stream ends now with its wire's
        closing frame (``event: server.shutdown``; on the Chat Completions wire an error
        object), and in-flight requests get ``kit_sse.STOP_GRACE`` seconds before they are
        cancelled (answered 503). Idempotent; the deck stays open."""
        self._stopping = True
        for stream in list(self._streams):
            stream.stop()
        for scope in list(self._mcp_streams):  # they carry nothing to wait for
            scope.cancel()
        if self._mcp_server is not None:  # its calls end with a result the client reads
            self._mcp_server.stop()
        if self._inflight:
            self._idle = anyio.Event()
            with anyio.move_on_after(kit_sse.STOP_GRACE) as self._grace:
                await self._idle.wait()
            for scope in list(self._inflight):
                scope.cancel()
            with anyio.move_on_after(kit_sse.STOP_GRACE):
                await self._idle.wait()

    def hurry(self) -> None:
        """End ``shutdown``'s grace now: in-flight requests are cancelled (a second signal)."""
        if self._grace is not None:
            self._grace.cancel()

    # ----------------------------------------------------------------------------- http --
    async def _http(self, req: Request) -> None:
        with anyio.CancelScope() as scope:
            self._inflight.add(scope)
            try:
                await self._dispatch(req)
            except ClientGone:
                return
            except Exception as exc:
                await self._fail(req, exc)
            finally:
                self._inflight.discard(scope)
                if self._idle is not None and not self._inflight:
                    self._idle.set()
        if scope.cancelled_caught and not req.started:  # cancelled by shutdown()
            run = f"; run {req.run_id} was cancelled (its log has it)" if req.run_id else ""
            await self._fail(req, ServerStoppingError(f"the server is shutting down{run}"))

    async def _dispatch(self, req: Request) -> None:
        path = route_path(req.scope)
        # Under /v1/ an OpenAI client is asking: it reads OpenAI's error shape only, so every
        # refusal (the guard's, the lifecycle's, an endpoint kit lacks: /v1/embeddings) comes in
        # that shape when the surface is served.
        if "openai" in self.surfaces and (path == "/v1" or path.startswith("/v1/")):
            req.surface = "openai"
        origin = req.header(b"origin")
        self.guard.check(host=req.authority or req.header(b"host"), origin=origin,
                         scheme=req.scope.get("scheme", "http"))
        if cors := self.guard.cors_headers(origin):
            req.send = with_headers(req.send, cors)
            if req.scope["method"] == "OPTIONS" and req.header(b"access-control-request-method"):
                preflight = self.guard.preflight_headers(req.header(b"access-control-request-headers"))
                return await respond(req, 204, None, tuple(preflight))
        if not self._open or self._stopping:
            state = "stopping" if self._stopping else "starting"
            await respond(req, 503, kit_openai.error_body(
                503, "ServerStoppingError" if self._stopping else "DeckStateError",
                f"the server is {state}") if req.surface == "openai" else {"status": state})
            return
        method, allowed, concrete = req.scope["method"], [], False
        root = req.scope.get("root_path", "")
        if root and req.scope["path"] == root and method in ("GET", "HEAD"):
            # Mounted at /kit, the page at /kit would resolve its URLs (relative: "health")
            # beside the mount, not in it (RFC 3986 section 5.2.3): its place is /kit/.
            raw = (req.scope.get("raw_path") or quote(root).encode()).partition(b"?")[0]
            query = req.scope.get("query_string", b"")
            location = raw + b"/" + (b"?" + query if query else b"")
            return await respond(req, 308, None, ((b"location", location),))
        for route_method, template, pattern, handler, mount in self._routes:
            match = pattern.fullmatch(path)
            if match is None or (concrete and "{" in template):
                continue  # a concrete path is matched before templated ones (OpenAPI's Paths Object)
            concrete = "{" not in template
            req.surface = mount if mount in SURFACES else None
            # HEAD is a GET whose body the server drops (h11 does; RFC 9110 section 9.1: every
            # server supports both): monitors probe /health with it.
            head = method == "HEAD" and route_method == "GET" and handler not in _STREAMING_GETS
            if route_method == method or head:
                params = match.groupdict()
                if "%" in path:  # only then can a parameter hold an escape
                    params = {key: param(key, value) for key, value in params.items()}
                for key in params.keys() & _PATH_IDS:
                    checked_id(key, params[key])
                return await getattr(self, handler)(req, **params)
            allowed.append(route_method)
            if route_method == "GET" and handler not in _STREAMING_GETS:
                allowed.append("HEAD")  # answered as a GET, above
        if allowed:
            raise MethodNotAllowedError(method, allowed)
        raise RouteNotFoundError(f"no route {quoted(path)}")

    async def _fail(self, req: Request, exc: Exception) -> None:
        """Answer an exception from the table; log what the table does not know."""
        status, message = _status_of(exc), str(exc)
        if status == 500 and not isinstance(exc, _RunFailed):
            # Its type and stack only: a message may quote input, tool output or a secret.
            path = printable(req.scope["path"])
            _log.error("%s %s failed with %s\n%s", req.scope["method"], path,
                       type(exc).__name__, "".join(traceback.format_tb(exc.__traceback__)).rstrip())
            message = "internal error; the server log has the details"
        if req.started:  # a stream broke after its headers: end the body, nothing else fits
            await req.send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        name = exc.error if isinstance(exc, _RunFailed) else type(exc).__name__
        headers = ((b"allow", ", ".join(exc.allowed).encode()),) if isinstance(exc, MethodNotAllowedError) else ()
        if req.surface == "openai" and req.run_id is not None:
            # OpenAI clients retry a 409 or a 5xx (twice by default) unless told not to: a
            # retry of a request whose run the log holds (failed, cancelled, stopped) would
            # play the turn again. A refusal that wrote nothing (a busy session) stays retryable.
            headers += ((b"x-should-retry", b"false"),)
        body = kit_openai.error_body(status, name, message) if req.surface == "openai" else {
            "error": name, "message": message}
        await respond(req, status, body, headers)

    def _check(self, name: str, kind: str) -> None:
        """Refuse a name that is not one of the deck's agents (``kind`` "agent") or workflows:
        404 ``UnknownNameError``, pointing to the other route when the name is of the other kind."""
        names, other = self._agents, self._workflows
        if kind == "workflow":
            names, other = other, names
        if name not in names:
            hint = None
            if name in other:
                route = f"/workflows/{name}" if kind == "agent" else f"/agents/{name}/chat"
                hint = f"{name!r} is {'a workflow' if kind == 'agent' else 'an agent'}: POST {route}"
            raise UnknownNameError(name, names, what=kind, hint=hint)

    async def _run(self, req: Request, run_id: str, call: Awaitable[Any]) -> Any:
        """Await a deck call that plays run ``run_id``. Its failure becomes ``_RunFailed`` (500);
        a refusal keeps its own type (a refused start wrote nothing: no x-kit-run-id then)."""
        try:
            result = await call
        except anyio.get_cancelled_exc_class():  # by shutdown(): its 503 names the run
            with anyio.CancelScope(shield=True):
                req.run_id = None if await self.deck.status(run_id) is None else run_id
            raise
        except stops():
            raise
        except BaseException as exc:  # a user's BaseException that failed the run, too
            status = await self.deck.status(run_id)
            req.run_id = None if status is None else run_id
            if status is RunStatus.FAILED:
                raise _RunFailed(run_id, exc) from None
            raise
        req.run_id = run_id
        return result

    # ------------------------------------------------------------------------- handlers --
    async def _playground(self, req: Request) -> None:
        page, headers = self._page
        await respond(req, 200, page, headers, b"text/html; charset=utf-8")

    async def _openapi(self, req: Request) -> None:
        root = req.scope.get("root_path", "")
        if self._document is None or self._document[0] != root:  # built when the deck's names
            from kit_openapi import document  # are known, per mount (one kept); imported then:
            routes = [(m, p) for m, p, *_ in self._routes] + [  # ~0.17 MiB a server may never need
                ("HEAD", p) for m, p, _, handler, _ in self._routes
                if m == "GET" and handler not in _STREAMING_GETS]
            self._document = root, dumps(document(
                routes, agents=self._agents, workflows=self._workflows, root_path=root)).encode()
        await respond(req, 200, self._document[1])

    async def _health(self, req: Request) -> None:
        await respond(req, 200, {"status": "ok", "agents": sorted(self._agents),
                                  "workflows": sorted(self._workflows), "skills": self._skills})

    async def _agent_chat(self, req: Request, name: str) -> None:
        body = await req.json(("message", "session_id"), ("message",))
        message = body_field(body, "message", str, required=True)
        session_id = body_id(body, "session_id")
        self._check(name, "agent")
        if _flag(req, "stream"):
            events = self.deck.stream(name, message, session_id=session_id, committed=True)
            return await self._stream_run(req, events, v1_frame)
        run_id = new_run_id()  # known before the run ends, for x-kit-run-id
        result = await self._run(req, run_id, self.deck.run(name, message, session_id=session_id,
                                                              run_id=run_id))
        await respond(req, 200, {"output": result.output})

    async def _workflow(self, req: Request, name: str) -> None:
        body = await req.json(("input", "thread_id"))
        state, thread_id = body_field(body, "input", dict) or {}, body_id(body, "thread_id")
        self._check(name, "workflow")
        if thread_id is None and name in self._durable:
            raise MalformedRequestError(f"workflow {name!r} is durable: the body needs 'thread_id' "
                                        "(the thread it runs on; the same id carries it on)")
        if _flag(req, "stream"):
            events = self.deck.stream(name, state, session_id=thread_id, committed=True)
            return await self._stream_run(req, events, v1_workflow_frame)
        run_id = new_run_id()
        result = await self._run(req, run_id, self.deck.run(name, state, session_id=thread_id,
                                                            run_id=run_id))
        await respond(req, 200, _workflow_body(result, run_id, thread_id or run_id))

    async def _pending(self, req: Request) -> None:
        # Only HTTP's threads (no namespace): the resume route answers no other, and a
        # namespaced run is one tenant's, payload and all.
        pending = [p for p in await self.deck.pending() if p.namespace is None]
        await respond(req, 200, {"pending": [
            {"run_id": p.run_id, "workflow": p.workflow, "thread_id": p.thread_id,
             "session_id": p.session_id, "payload": p.payload, "since": p.since.isoformat()}
            for p in pending]})

    async def _workflow_resume(self, req: Request, name: str, thread_id: str) -> None:
        value = (await req.json(("value",), ("value",)))["value"]
        self._check(name, "workflow")
        for p in await self.deck.pending():
            if p.workflow == name and p.thread_id == thread_id:
                info = await self.deck.store.run_info(p.run_id)
                if info is not None and info.namespace is None:  # HTTP threads have none
                    if _flag(req, "stream"):
                        events = self.deck.stream_answer(p.run_id, value, committed=True)
                        return await self._stream_run(req, events, v1_workflow_frame)
                    result = await self._run(req, p.run_id, self.deck.answer(p.run_id, value))
                    return await respond(req, 200, _workflow_body(result, p.run_id, thread_id))
        # A sleep parks in the interrupt shape too, which a client naturally answers here.
        asleep = [i for i in await self.deck.store.runs(status=RunStatus.SLEEPING, name=name,
                                                        session_id=thread_id) if i.namespace is None]
        if asleep:
            raise ThreadNotWaitingError(f"run {asleep[-1].run_id} of workflow {name!r} sleeps on "
                                        f"thread {thread_id!r}: an answer cannot wake it, a tick "
                                        "does once its time has come (deck.tick())")
        raise ThreadNotWaitingError(f"no run of workflow {name!r} waits on thread {thread_id!r}")

    async def _control(self, req: Request, run_id: str, action: str) -> None:
        reason = body_field(await req.json(("reason",), optional=True), "reason", str)
        status = await self.deck.status(run_id)
        if status is None:
            raise UnknownRunError(run_id)
        refusal = control_refusal(action, status)
        if refusal is not None:
            raise ControlRefusedError(f"run {run_id}: {refusal}")
        await (self.deck.pause if action == "pause" else self.deck.cancel)(run_id, reason=reason)
        req.run_id = run_id
        await respond(req, 202, {"run_id": run_id, "requested": action})

    _pause = functools.partialmethod(_control, action="pause")
    _cancel = functools.partialmethod(_control, action="cancel")

    async def _resume_run(self, req: Request, run_id: str) -> None:
        await req.json((), optional=True)
        info = await self.deck.store.run_info(run_id)
        if info is None:
            raise UnknownRunError(run_id)
        not_paused = NotResumableError(f"run {run_id} is not paused: nothing to resume")
        if _flag(req, "stream"):  # the frames of the run that paused: an agent's or a workflow's
            _no_retry(req)  # a retry would resume the run again, were it paused again since
            events = self.deck.stream_resume(run_id, committed=True)
            first = await anext(events, None)
            if first is None:
                raise not_paused
            req.run_id = run_id
            frame_of = v1_frame if info.invocable == "agent" else v1_workflow_frame
            return await self._sse(req, run_id, first, events, frame_of)
        events = await self._run(req, run_id, self.deck.resume(run_id))
        if not events:
            raise not_paused
        await respond(req, 200, {"run_id": run_id, "events": [e.to_json() for e in events]})

    async def _events(self, req: Request, run_id: str) -> None:
        header, query = req.header(b"last-event-id"), (req.query.get("after") or [""])[-1]
        for raw in (header or "", query):  # strictly what kit_openapi documents, not all int() takes
            if not _SEQ.fullmatch(raw):
                raise MalformedRequestError(f"Last-Event-ID / after must be an event seq, got {quoted(raw)}")
        raw = header or query  # an empty Last-Event-ID (no id seen yet) leaves ?after= its say
        after = int(raw) if raw else -1
        status = await self.deck.status(run_id)
        if status is None:
            raise UnknownRunError(run_id)
        store, req.run_id = self.deck.store, run_id
        # The seq of the run's last event, from its index row (every kit store keeps it, in the
        # transaction of each batch): whether event `after` exists, or nothing follows it, is
        # one row, not the log's tail. None: a store of the port's that keeps none.
        info = await store.run_info(run_id) if after >= 0 else None
        last = None if info is None else info.last_seq
        if status in _TERMINAL:  # its log is whole: read a page at a time, each sent as read
            events = replay(store, run_id, after)
            first = None if last is not None and after >= last else await anext(events, None)
            if first is None:
                await events.aclose()
                return await respond(req, 204, None)  # past the end: 204 stops EventSource retrying
            return await self._sse(req, run_id, first, events, native_frame)
        if after >= 0 and (after > last if last is not None else  # no event `after` (yet)
                           not await store.read(run_id, after - 1)):
            raise MalformedRequestError(f"run {run_id} has no event {after}: a client only ever "
                                        "receives events the log holds")
        await self._sse(req, run_id, None, store.follow(run_id, after), native_frame)

    async def _native_chat(self, req: Request, name: str) -> None:
        body = await req.json(("input", "session_id"))
        value, session_id = body.get("input"), body_id(body, "session_id")
        if name in self._agents:
            if isinstance(value, list):
                value = [block_from_json(b) for b in value]  # ContentError: 400
            elif not isinstance(value, str):
                raise MalformedRequestError("'input' must be a string or a list of content blocks")
        elif name in self._workflows:
            value = {} if value is None else value
            if not isinstance(value, dict):
                raise MalformedRequestError("'input' must be a JSON object for a workflow")
        else:
            raise UnknownNameError(name, self._agents | self._workflows)
        events = self.deck.stream(name, value, session_id=session_id, committed=True)
        await self._stream_run(req, events, native_frame)

    # ------------------------------------------------------------------ optional surfaces --
    async def _chat_completions(self, req: Request) -> None:
        # OpenAI clients send many optional fields; kit_openai reads the ones it serves.
        turn = kit_openai.read_request(await req.json(None),
                                       req.text_header(kit_openai.SESSION_HEADER))
        self._check(turn.model, "agent")
        args: dict[str, Any] = {"session_id": turn.session_id, "history": turn.history}
        if turn.stream:
            chunks = kit_openai.Chunks(turn.model)
            events = self.deck.stream(turn.model, turn.input, committed=True, **args)
            return await self._stream_run(req, events, lambda ev: data_frames(chunks(ev)),
                                          _openai_ending)
        run_id = new_run_id()
        await self._run(req, run_id, self.deck.run(turn.model, turn.input, run_id=run_id, **args))
        # The content is a fold of the run's events, the very one its stream would have sent
        # (kit_openai: streamed or not, a client reads the same answer), so it is read back.
        events = await self.deck.store.read(run_id)
        await respond(req, 200, kit_openai.completion(run_id, turn.model, events))

    async def _models(self, req: Request) -> None:
        await respond(req, 200, kit_openai.model_list(self._agents, self._created))

    async def _model(self, req: Request, model: str) -> None:
        self._check(model, "agent")  # OpenAI's answer to a model it lacks is a 404 too
        await respond(req, 200, kit_openai.model_object(model, self._created))

    async def _mcp(self, req: Request) -> None:
        async def send(message: Message) -> None:  # the MCP server answers for itself
            req.started = True
            await req.send(message)
        receive = req.receive
        if req.scope["method"] == "POST":  # read as strictly as kit's own routes first: the mcp
            body = await req.body()  # package answers 500 to bad UTF-8 or deep nesting
            try:
                message = parse_json(body)
            except MalformedRequestError as exc:  # JSON-RPC's parse error, with no id to answer
                return await respond(req, 400, {"jsonrpc": "2.0", "id": None, "error": {
                    "code": -32700, "message": f"Parse error: {exc}"}})
            import kit_mcp  # (imported by the lifespan already) the ones the package misanswers
            if (refused := kit_mcp.refusal(message)) is not None:
                return await respond(req, 400 if refused["id"] is None else 200, refused)
            receive = _replay(body, req.receive)
        if req.scope["method"] != "GET":
            return await self._mcp_server(req.scope, receive, send)
        # GET is the transport's standalone stream; stateless, it carries nothing but pings.
        # Shutdown ends it at once, and cleanly, rather than cutting it after STOP_GRACE.
        with anyio.CancelScope() as scope:
            self._mcp_streams.add(scope)
            try:
                await self._mcp_server(req.scope, receive, send)
            finally:
                self._mcp_streams.discard(scope)
        if scope.cancelled_caught and req.started:
            await req.send({"type": "http.response.body", "body": b"", "more_body": False})

    # ---------------------------------------------------------------------------- streams --
    async def _stream_run(self, req: Request, events: AsyncIterator[Event], frame_of: FrameOf,
                          ending: Ending = ending_frame) -> None:
        _no_retry(req)
        # The first event (run.started) gives the run id before the headers go out; a start
        # the deck refuses (409 busy session, 400 bad input) is still a JSON answer.
        first = await events.__anext__()
        req.run_id = first.run_id
        await self._sse(req, first.run_id, first, events, frame_of, ending)

    async def _sse(self, req: Request, run_id: str, first: Event | None,
                   events: AsyncIterator[Event], frame_of: FrameOf,
                   ending: Ending = ending_frame) -> None:
        """The SSE response helper: headers, then the frames of ``first`` and ``events``, kept
        among the open streams that ``shutdown`` ends (with ``ending``, the wire's frame)."""
        stream = Stream()
        self._streams.add(stream)
        if self._stopping:  # shutdown() began after this request was let in
            stream.stop()
        try:
            req.started = True
            await stream.play(req.send, req.receive, run_id, first, events, frame_of, ending)
        finally:
            self._streams.discard(stream)


def _openai_ending(run_id: str, error: Exception | None) -> bytes:
    """The Chat Completions wire's frame that ends a stream before its run ended: OpenAI's error
    shape, which its clients raise as ``APIError``. They ignore event names, so kit's
    ``event: server.shutdown`` frame would reach them as one more chunk, one without
    ``choices``, and its ``event: error`` as an error with no message."""
    if error is None:
        error = ServerStoppingError(f"the server is shutting down before run {run_id} ended; "
                                    f"its log has the rest: GET /runs/{run_id}/events")
        return sse_frame(dumps(kit_openai.error_body(503, type(error).__name__, str(error))))
    kind = type(error).__name__  # its type only: a message may hold content
    return sse_frame(dumps(kit_openai.error_body(
        503 if isinstance(error, StoreUnavailableError) else 500, kind,
        f"the stream of run {run_id} ended before the run did ({kind}); its log has the rest: "
        f"GET /runs/{run_id}/events")))


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for a request whose body was read already: the body once, then ``receive``
    (which tells of the client leaving)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()
    return replayed


def _no_retry(req: Request) -> None:
    """Refuse a streamed POST that carries ``Last-Event-ID``: an SSE client retrying the stream
    after a network error (fetch-event-source does) would play the turn (or the resume) again."""
    if req.header(b"last-event-id") is not None:
        raise MalformedRequestError(
            "Last-Event-ID on a POST: a retried POST would play its turn (or resume) again; "
            "pick the run up with GET /runs/{run_id}/events and Last-Event-ID (the run id is "
            "the x-kit-run-id header of the first response)")


def _flag(req: Request, name: str) -> bool:
    return (req.query.get(name) or [""])[-1].lower() in ("true", "1")


# ====================================================================================== serve ====

async def serve(app: App, *, host: str = "127.0.0.1", port: int = 8000, access_log: bool = False,
                shutdown_trigger: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Serve ``app`` under Hypercorn on the running backend (asyncio or trio) until
    ``shutdown_trigger`` returns (default: SIGINT or SIGTERM), then end its streams itself.

    The address is bound before the app's lifespan opens the deck, so a taken one is refused
    at once; ``port=0`` takes a free port, the one logged. ``access_log``: one
    ``kit_http.access`` log line per request (client, method, path, status, seconds). Needs the
    ``serve`` extra. Raises ``OSError`` (naming the address) when it cannot listen, Hypercorn's
    ``LifespanFailureError`` when the deck does not open (``app.open_error`` says why).
    """
    config, named, port = hypercorn_config(host, port, access_log)
    backend = sniffio.current_async_library()
    if backend == "trio":
        from hypercorn.trio import serve as hypercorn_serve
    else:
        from hypercorn.asyncio import serve as hypercorn_serve
    surfaces = [s for s in SURFACES if s in app.surfaces]
    served = f", with {' and '.join(surfaces)}" if surfaces else ""
    local = "127.0.0.1" if named in ("0.0.0.0", "[::]", "") else named  # any address: say one
    page = f"playground at http://{local}:{port}/" if app.playground else "no playground"
    _log.info("listening on http://%s:%s (%s worker%s); %s; %s. The API is unauthenticated: anyone "
              "who can reach this address can start, read, answer and cancel runs.", named, port,
              backend, served, page, app.guard.describe())
    await hypercorn_serve(app, config, shutdown_trigger=functools.partial(
        until_stopped, app, shutdown_trigger))


def main(argv: list[str] | None = None) -> int:
    """``python -m kit_http``: ``kit-serve`` (``kit_serve.main``), the process serving a project."""
    import kit_serve  # the process sits above the app it serves
    return kit_serve.main(argv)


if __name__ == "__main__":
    sys.exit(main())
