"""kit_request: one HTTP exchange as kit_http reads and answers it: the request's facts and body,
parsed strictly, the JSON response, the path the route table matches, and the errors kit_http
refuses a request with before a deck sees it.

Owns: ``Request`` (headers, the query, the body read up to ``MAX_BODY_BYTES``, each piece within
``BODY_TIMEOUT`` of the last, and parsed as a JSON object of a route's keys), ``respond`` (a JSON
or raw response), ``parse_json`` and ``parse_object`` (the strict JSON parser),
``body_field``/``body_id``/``checked_id`` (a body's fields), ``route_path``/``param`` (the path
as the client spelt it), ``with_headers``, ``MAX_BODY_BYTES``, ``MAX_JSON_DEPTH``,
``BODY_TIMEOUT``, and ``HTTPError`` with its subclasses (their statuses are kit_http's
``ERROR_STATUS``).

Must never: know a deck, a route or a run; import a web framework; put a request's body in an
error message beyond the piece that is wrong.

Theory of operation: a body is read up to ``MAX_BODY_BYTES`` (Hypercorn has no limit for ASGI
apps, notes/CONVENTIONS.md A7; Content-Length is checked first, then the chunks are counted), a
body that stops arriving is refused after ``BODY_TIMEOUT`` (Hypercorn times out no body read:
its ``read_timeout`` would also end every quiet SSE stream, whose client sends nothing), and
parsed strictly: bad UTF-8, deep nesting, huge integers, NaN, infinity, lone surrogates and a key
given twice in one object are a ``MalformedRequestError`` naming what is wrong (a 400, never a
500). A misspelt key is refused, not taken for an absent one. Routes match the path as the
client spelt it (ASGI's ``raw_path``, each segment percent-decoded on its own), so an id holding
``/``, sent as ``%2F``, is one path parameter.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import MutableMapping
from typing import Any
from urllib.parse import parse_qs, quote_from_bytes, unquote, unquote_to_bytes

import anyio

from kit_core import ConfigError, KitError, check_id, quoted
from kit_sse import Message, Receive, Send, dumps, run_id_header

__all__ = (
    "Request", "respond", "parse_json", "parse_object", "body_field", "body_id", "checked_id",
    "route_path", "param", "with_headers", "Scope", "ClientGone",
    # errors (their statuses are in kit_http.ERROR_STATUS)
    "HTTPError", "RouteNotFoundError", "MethodNotAllowedError", "MalformedRequestError",
    "BodyTooLargeError", "RequestTimeoutError", "UnsupportedMediaTypeError",
    "ThreadNotWaitingError", "NotResumableError", "ControlRefusedError", "ServerStoppingError",
    # limits
    "MAX_BODY_BYTES", "MAX_JSON_DEPTH", "BODY_TIMEOUT",
)

#: Bodies over this are 413: json.loads multiplies a body's footprint several times. 2 MiB leaves
#: room for one maximal inline content block (1 MB decoded, 1.34 MB of base64) and its envelope.
MAX_BODY_BYTES = 2 * 1024 * 1024
#: Deeper JSON is a 400: the stdlib parser stops only at the recursion limit, and the deck walks
#: input recursively afterwards, so ~990 levels would parse and then fail as a 500.
MAX_JSON_DEPTH = 64
#: Seconds a body may pause between two of its pieces before it is a 408 (read at each body read,
#: so a test can shorten it). A slow link still sends something every few seconds; a client that
#: sent its headers and stopped would hold its request, and a task, for good.
BODY_TIMEOUT = 30.0

Scope = MutableMapping[str, Any]  # ASGI's vocabulary, as Starlette spells it (the rest: kit_sse)


# ===================================================================================== errors ====

class HTTPError(KitError):
    """A request refused by kit_http itself, before the deck saw it (status in kit_http's ``ERROR_STATUS``)."""


class RouteNotFoundError(HTTPError):
    """No route has this path. Contrast ``kit.UnknownNameError``: the route exists, the name not."""


class MethodNotAllowedError(HTTPError):
    """The path exists for other methods only; ``allowed`` lists them (the ``allow`` header)."""

    def __init__(self, method: str, allowed: list[str]) -> None:
        self.allowed = allowed
        super().__init__(f"{method} is not allowed here; allowed: {', '.join(allowed)}")


class MalformedRequestError(HTTPError):
    """The body is not a JSON object of the expected shape, or a header is malformed."""


class BodyTooLargeError(HTTPError):
    """The body is over ``MAX_BODY_BYTES``."""


class RequestTimeoutError(HTTPError):
    """The body stopped arriving: nothing of it came for ``BODY_TIMEOUT`` seconds."""


class UnsupportedMediaTypeError(HTTPError):
    """A POST body that is not ``application/json`` (which also keeps simple cross-site posts
    out), or is sent with a ``Content-Encoding``."""


class ThreadNotWaitingError(HTTPError):
    """No run of the workflow waits for a human on that thread: stale, or it never parked."""


class NotResumableError(HTTPError):
    """The run exists but is not paused: nothing to resume (or another caller resumed it)."""


class ControlRefusedError(HTTPError):
    """A pause or cancel request that cannot act: the run has finished, or (pause) is parked."""


class ServerStoppingError(HTTPError):
    """The server is shutting down: the request was refused, or cancelled after ``STOP_GRACE``."""


class ClientGone(Exception):
    """The client left while its body was being read: nobody to answer."""


# ===================================================================================== bodies ====

def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e999: valid JSON, but no number a log can write back
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


class _KeyTwice(ValueError):
    """A JSON object that names one key twice (``parse_json`` refuses it)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict; ``_KeyTwice`` for a key named twice, whose meaning RFC 8259
    (section 4) leaves open: parsers differ (the first value, the last, an error), so a proxy or
    a log could read another value than the one kit plays."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _KeyTwice(f"the key {key[:100]!r} is given twice in one object of the "
                                "JSON: send it once")
            seen.add(key)
    return obj


def parse_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object. Raises ``MalformedRequestError`` for anything else."""
    obj = parse_json(body)
    if not isinstance(obj, dict):
        raise MalformedRequestError(f"the body must be a JSON object, got {type(obj).__name__}")
    return obj


def parse_json(body: bytes) -> Any:
    """The body as JSON: UTF-8, at most ``MAX_JSON_DEPTH`` deep, no NaN, infinity or lone
    surrogate, no key twice in one object. Raises ``MalformedRequestError`` naming what is
    wrong."""
    too_deep = MalformedRequestError(f"the JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        text = body.decode("utf-8")
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite,
                         object_pairs_hook=_unique_keys)
    except RecursionError:
        raise too_deep from None
    except _KeyTwice as exc:
        raise MalformedRequestError(str(exc)) from None
    except ValueError as exc:  # UnicodeDecodeError, JSONDecodeError, a >4300-digit integer
        raise MalformedRequestError(f"the body is not valid JSON: {exc}") from None
    stack: list[tuple[Any, int]] = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:  # iterative: a recursive walk would hit the very limit it checks for
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise too_deep
        items = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    if "\\u" in text:  # only an escape spells a lone surrogate, which no log or response can encode
        try:
            json.dumps(obj, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise MalformedRequestError("the JSON has a lone surrogate escape (\\ud800-\\udfff), "
                                        "which is not Unicode text") from None
    return obj


def body_field(body: dict[str, Any], key: str, kind: type, *, required: bool = False) -> Any:
    value = body.get(key)
    if value is None and required:
        raise MalformedRequestError(f"the body needs {key!r}")
    if value is not None and not isinstance(value, kind):
        raise MalformedRequestError(f"{key!r} must be a {'string' if kind is str else 'JSON object'}")
    return value


def body_id(body: dict[str, Any], key: str) -> str | None:
    """An optional id of the body (``session_id``, ``thread_id``): absent, or an id."""
    value = body_field(body, key, str)
    if value == "":
        raise MalformedRequestError(f"{key!r} must not be empty")
    return value if value is None else checked_id(repr(key), value)


def checked_id(what: str, value: str) -> str:
    """``value`` if it is an id kit can store (``check_id``); ``MalformedRequestError`` if not."""
    try:
        return check_id(what, value)
    except ConfigError as exc:
        raise MalformedRequestError(str(exc)) from None


# ================================================================================== exchanges ====

#: A request target in absolute form (``http://host:port/path``), as Hypercorn passes it on.
_ABSOLUTE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)")
_ABSOLUTE_RAW = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")


class Request:
    """One HTTP exchange: the scope's facts, the body reader, and whether a response started."""
    __slots__ = ("scope", "receive", "send", "started", "run_id", "query", "surface", "reading",
                 "read", "authority")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope, self.receive, self.send = scope, receive, send
        self.authority: str | None = None  # the host an absolute-form target names
        target = _ABSOLUTE.match(scope.get("path", ""))
        if target is not None:  # ``GET http://host/health``: a server MUST take it (RFC 9112
            # 3.2.2), routing its path and answering for its host in place of the Host header's
            self.authority = target.group(1).rpartition("@")[2]
            raw = _ABSOLUTE_RAW.match(scope.get("raw_path") or b"")
            self.scope = {**scope, "path": scope["path"][target.end():] or "/"}
            if raw is not None:
                self.scope["raw_path"] = scope["raw_path"][raw.end():] or b"/"
        self.started = False
        self.reading = False  # body() was called: the body is read, or refused (413, gone)
        self.read = False  # the body was read to its end (else the connection cannot go on)
        self.surface: str | None = None  # the optional surface whose route matched
        self.run_id: str | None = None  # set once this request's run exists: x-kit-run-id
        self.query = parse_qs(scope.get("query_string", b"").decode("latin-1"))

    def header(self, name: bytes) -> str | None:
        """Header ``name`` (the first given) as latin-1, which never fails: for protocol fields
        whose grammar is ASCII (Host, Origin, Content-Type, Last-Event-ID's digits, ...)."""
        return next((v.decode("latin-1") for k, v in self.scope.get("headers", ()) if k == name), None)

    def text_header(self, name: bytes) -> str | None:
        """Header ``name`` as text a client chose (an id), decoded as UTF-8: read as latin-1,
        ``x-kit-session-id: café`` was 'cafÃ©', another session than the same id in a body.
        Raises ``MalformedRequestError`` naming the header when it is not UTF-8."""
        value = next((v for k, v in self.scope.get("headers", ()) if k == name), None)
        try:
            return None if value is None else value.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedRequestError(f"the {name.decode('latin-1')} header must be UTF-8 "
                                        "text") from None

    async def body(self) -> bytes:
        """The whole body, refused as soon as it is over ``MAX_BODY_BYTES`` (Content-Length
        first, then counting chunks), or once read when it has a ``Content-Encoding`` (gzip:
        RFC 9110 section 15.5.16 makes that a 415). Raises ``BodyTooLargeError``,
        ``RequestTimeoutError`` (no piece of it for ``BODY_TIMEOUT``),
        ``UnsupportedMediaTypeError``, ``ClientGone``."""
        self.reading = True
        too_large = BodyTooLargeError(f"the body is over {MAX_BODY_BYTES} bytes")
        length = self.header(b"content-length")
        if length is not None:
            length = length.strip()
            if not (length.isascii() and length.isdigit()):
                raise MalformedRequestError("Content-Length is not a number")
            if int(length) > MAX_BODY_BYTES:
                raise too_large
        chunks, size = [], 0
        while True:
            message = None
            with anyio.move_on_after(BODY_TIMEOUT):
                message = await self.receive()
            if message is None:
                raise RequestTimeoutError(f"the body stopped arriving: nothing of it came for "
                                          f"{BODY_TIMEOUT:g} s")
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY_BYTES:
                raise too_large
            if not message.get("more_body", False):
                self.read = True
                break
        coding = (self.header(b"content-encoding") or "identity").strip().lower()
        if coding != "identity":  # read first: the connection serves the client's next request
            raise UnsupportedMediaTypeError(f"kit reads bodies without a Content-Encoding, got "
                                            f"{quoted(coding)}: send the JSON as it is")
        return b"".join(chunks)

    async def drain(self) -> None:
        """Read and drop a body no handler read (a request refused by its path, method or
        headers), up to ``MAX_BODY_BYTES``: Hypercorn closes a keep-alive connection whose
        request body was still unread when the response ended, after a response that did not
        say ``connection: close``, so the client's next request on it fails. A body over the
        limit, or a client that left, is left alone (that connection closes)."""
        if self.reading:
            return
        try:
            await self.body()
        except (HTTPError, ClientGone):
            pass

    async def json(self, keys: tuple[str, ...] | None, required: tuple[str, ...] = (), *,
                   optional: bool = False) -> dict[str, Any]:
        """The body as a JSON object of the route's ``keys`` (None: a wire whose reader checks
        its own keys), with every key of ``required``; with ``optional``, an empty body is
        ``{}``. Raises ``MalformedRequestError`` naming an unknown or missing key (a misspelt key
        must not pass for an absent one)."""
        content_type = self.header(b"content-type") or ""
        body = await self.body()
        media = content_type.split(";", 1)[0].strip().lower()
        if optional and not body and media in ("", "application/json"):
            return {}
        if media != "application/json" and not (media.startswith("application/") and
                                                media.endswith("+json")):
            raise UnsupportedMediaTypeError(f"the body must be application/json, got {quoted(content_type)}")
        obj = parse_object(body)
        for key in obj if keys is not None else ():
            if key not in keys:  # type: ignore[operator]
                takes = ", ".join(repr(k) for k in keys) or "no keys"
                raise MalformedRequestError(f"unknown key {quoted(key)} in the body; this route takes {takes}")
        for key in required:
            if key not in obj:
                raise MalformedRequestError(f"the body needs {key!r}")
        return obj


async def respond(req: Request, status: int, obj: Any, headers: tuple[tuple[bytes, bytes], ...] = (),
                   content_type: bytes = b"application/json") -> None:
    """The JSON response helper (``obj`` None: no body, as for 204; bytes: sent as they are).
    A body the request still holds is read first (``Request.drain``); one refused before its
    end gets an answer that ends the connection (``connection: close``, chunked)."""
    await req.drain()
    body = b"" if obj is None else obj if isinstance(obj, bytes) else dumps(obj).encode()
    head = [(b"content-type", content_type)] if obj is not None else []
    if req.reading and not req.read:
        # Refused before the body ended (413, 408): Hypercorn closes the connection after the
        # answer, so it says so (RFC 9112 section 9.6), and it goes chunked: its end is then a
        # chunk the client waits for, not Content-Length's empty end-of-message, which a client
        # that had the whole answer raced by closing (Hypercorn's trio worker then ran its
        # send_eof, unlocked, into that send: BusyResourceError, logged as an ASGI error).
        head.append((b"connection", b"close"))
    elif status != 204:  # a 204 never carries Content-Length (RFC 9110 section 8.6)
        head.append((b"content-length", b"%d" % len(body)))
    head += run_id_header(req.run_id)
    req.started = True
    await req.send({"type": "http.response.start", "status": status, "headers": head + list(headers)})
    await req.send({"type": "http.response.body", "body": body})


def route_path(scope: Scope) -> str:
    """The path the route table matches: below ``root_path``, each segment percent-decoded on
    its own, with a ``%`` or ``/`` it decodes to escaped again (``%25``, ``%2F``). A ``%2F``
    stays inside its segment, as RFC 3986 (section 2.2) has it: an id holding ``/`` fills one
    parameter, and ``param`` gives the value back. A segment that does not decode as UTF-8
    stays fully percent-encoded, which ``param`` refuses."""
    path, root = scope["path"], scope.get("root_path", "")
    raw = scope.get("raw_path")  # optional in ASGI; ``path`` is decoded, so a %2F in it is a /
    if raw and b"%" in raw:  # else nothing was encoded: ``path`` splits where the client did
        decoded: list[str] = []  # as the server decoded ``path``, to tell it is this request's
        escaped: list[str] = []
        # httpx's ASGITransport leaves the query in raw_path (encode/httpx#2810); a bare ? can
        # only start the query.
        for segment in raw.partition(b"?")[0].split(b"/"):
            octets = unquote_to_bytes(segment)
            try:
                text = octets.decode("utf-8")
            except UnicodeDecodeError:
                decoded.append(octets.decode("utf-8", "replace"))  # as urllib's unquote does
                escaped.append(quote_from_bytes(octets, safe=""))
            else:
                decoded.append(text)
                escaped.append(text.replace("%", "%25").replace("/", "%2F"))
        # raw_path is this request's unless a middleware rewrote ``path`` (an old-style mount
        # strips ``root_path`` from ``path`` alone): then ``path`` is the truth, as before.
        ours = "/".join(decoded) in (path, root + path)
        path = "/".join(escaped) if ours else path.replace("%", "%25")
    elif "%" in path:  # no raw_path: a % in the decoded path was sent as %25, no escape
        path = path.replace("%", "%25")
    if root:
        root = root.replace("%", "%25")
        if path.startswith(root):
            path = path[len(root):] or "/"
    return path


def param(key: str, value: str) -> str:
    """A path parameter from ``route_path``'s escaped form. Raises ``MalformedRequestError``
    when its percent-decoding is not UTF-8 (no name or id is such bytes)."""
    try:
        return unquote(value, errors="strict")
    except UnicodeDecodeError:
        raise MalformedRequestError(f"{key} must be UTF-8 text once percent-decoded, got "
                                    f"{quoted(value)}") from None


def with_headers(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    """``send`` that adds ``headers`` to the response's start (CORS headers, whatever answers)."""
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)
    return sending
