"""kit_serve: ``kit-serve``, the process that serves a kit project over HTTP and SSE.

Owns: ``main()`` for ``kit-serve`` (and ``python -m kit_http``): its arguments and settings, the
extras it needs, the deck of ``KIT_PROJECT`` served by ``kit_http.serve`` under Hypercorn, and its
console: one ``kit-serve:`` line on stderr per message, from the ``logging`` module (the address it
listens on; one line per failed run, from the ``FailedRunLog`` observer it adds to the deck; one
per request with ``--access-log``; why it could not serve, then exit 1; what other code logs at
WARNING and above), each made one printable line by its handler's formatter (``_ConsoleLine``).

Must never: print a traceback (for a failure it can name: a taken address, a missing extra, a
broken project; in anyone's record: the exception's type only), let a logged value break a line
or carry a terminal escape, or log a request body, what the mcp package quotes of a request, the
application context or a setting's value (failure messages are masked, ``FailedRunLog.redact``);
import kit.py outside ``main()`` (it sits below the composition root), or Hypercorn at module
import.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import signal
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import anyio

from kit_core import ConfigError, Event, KitError, RunFailed, printable, switch_setting
from kit_guard import Guard
from kit_http import SURFACES, App, serve
from kit_observers import resolve_observers

__all__ = ("main", "FailedRunLog", "MAX_LOG_MESSAGE")

#: A failed run's message in its log line: enough for "why", short enough for one console line.
MAX_LOG_MESSAGE = 300

_log = logging.getLogger("kit_serve")
#: Settings whose values are secrets: masked wherever a failure message quotes them.
_SECRET_SETTING = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
#: Shapes of a secret a failure message may quote (the groups are kept, the rest masked): a
#: provider key (``sk-...``, ``pk-lf-...``), a token by its well-known prefix (GitHub ``ghp_``
#: and its kin, GitLab ``glpat-``, Slack ``xoxb-``, Google ``AIza``, AWS ``AKIA``, a JWT's
#: ``eyJ``), an Authorization value, a URL's ``user:password@``
#: (up to its last ``@``, as ``kit_storebase.masked`` reads it: a ``/`` in the password too) or
#: a token given as its user (``https://<token>@github.com``: 16 characters or more), and
#: ``api_key=...``-like pairs. A URL's short user alone is no secret: the hints' examples
#: (``postgresql://user@host/db``) stay readable.
_SECRET_SHAPES = re.compile(
    r"\b((?:sk|pk|rk)-)[\w*.-]{6,}|\b((?i:bearer|basic) )[\w.~+/=-]{6,}"
    r"|\b(gh[pousr]_|github_pat_|glpat-|xox[abprs]-|AIza|AKIA|eyJ)[\w.-]{12,}"
    r"|(://)(?:[^\s/@:]*:\S*|[^\s/@:]{16,})(?=@)"
    r"|\b((?i:api[_-]?key|token|secret|password)[\"']?\s*[:=]\s*[\"']?)[^\s,;'\"]+")

#: Loggers whose messages kit composes, quoting only what it has bounded and masked (the address,
#: the failed-run line, the access log's path): shown whole. Hypercorn's own messages
#: (``kit_http.hypercorn``) and everyone else's are capped at ``MAX_LOG_MESSAGE``.
_KIT_LOGGERS = ("kit", "kit_http", "kit_serve", "kit_mcp")
#: The mcp package logs a request that fails validation, quoted, through the root logger.
_MCP_SESSION = os.path.join("mcp", "shared", "session.py")


def _capped(text: str) -> str:
    return text if len(text) <= MAX_LOG_MESSAGE else text[:MAX_LOG_MESSAGE - 3] + "..."


class FailedRunLog:
    """An observer: one ``kit_serve`` log line per failed run (its id, name, error type and
    message), so a 500 or an ``event: error`` has its reason on the server's console.

    The message is the one in the log, made one line, capped at ``MAX_LOG_MESSAGE`` and masked
    (``redact``). The application context never reaches it: it is not in the log.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        secrets: Iterable[str] = (v for k, v in env.items() if len(v) >= 8 and _SECRET_SETTING.search(k))
        self._secrets = sorted(secrets, key=len, reverse=True)  # a longer value before its prefix

    def emit(self, event: Event) -> None:
        if isinstance(event.payload, RunFailed):
            _log.error("run %s (%s) failed: %s: %s", event.run_id, event.origin, event.payload.error,
                       self.redact(event.payload.message))

    def redact(self, message: str) -> str:
        """``message`` on one line (control characters escaped), at most ``MAX_LOG_MESSAGE``
        characters, with ``***`` for the values of secret-looking settings (``*KEY*``,
        ``*SECRET*``, ``*TOKEN*``, ``*PASSWORD*``) and for anything shaped like a key, a bearer
        token or a URL's credentials (a password, or a token as its user; ``_SECRET_SHAPES``)."""
        for value in self._secrets:
            message = message.replace(value, "***")
        message = _SECRET_SHAPES.sub(lambda m: "".join(g or "" for g in m.groups()) + "***", message)
        return _capped(printable(" ".join(message.split())))  # one line, no terminal control sequence


class _ConsoleLine(logging.Formatter):
    """The formatter of kit-serve's console handler: every record it prints, from whichever
    logger it propagated, is one ``kit-serve:`` line. A handler's formatter, not a logger's
    filter: a logger's filters see only the records logged at that very logger, never those
    its children (``mcp.server.*``) propagate to it.

    - The mcp package quotes the request it refuses (a tool's name, a header, the body), through
      its ``mcp.*`` loggers or the root one (``mcp/shared/session.py``): its line says which part
      of the package spoke and how loudly, never what it said.
    - Any other message is made printable (``kit_core.printable``: no line break, no terminal
      escape), so a value it quotes cannot forge a line, and capped unless kit composed it.
    - A traceback never: the exception's type only (its message may quote input or a secret).
    """

    def format(self, record: logging.LogRecord) -> str:
        if record.name == "mcp" or record.name.startswith("mcp.") or (
                record.pathname.endswith(_MCP_SESSION)):
            return f"kit-serve: {_mcp_line(record)}"
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # arguments that do not fit the format: the format alone
            message = str(record.msg)
        if record.exc_info and record.exc_info[0] is not None:
            message += f" ({record.exc_info[0].__name__})"
        message = printable(message)
        if record.name.split(".")[0] not in _KIT_LOGGERS or record.name == "kit_http.hypercorn":
            message = _capped(message)
        return f"kit-serve: {message}"


def _mcp_line(record: logging.LogRecord) -> str:
    """What the console says for a record of the mcp package: who and how loudly, not what."""
    if record.levelno == logging.WARNING and record.pathname.endswith(_MCP_SESSION):
        return "mcp: a request failed validation (its body is not logged)"
    source = record.name if record.name.startswith("mcp") else "mcp.shared.session"
    what = "an error" if record.levelno >= logging.ERROR else "a warning"
    if record.exc_info and record.exc_info[0] is not None:
        what += f" ({record.exc_info[0].__name__})"
    return (f"mcp: {printable(source)}: {what} about a request (its text is not logged: it may "
            "quote the request)")


def _console() -> None:
    """kit_http's, kit_mcp's and kit_serve's loggers onto stderr, one ``kit-serve:`` line per
    message (``_ConsoleLine``); so is what else logs through the root logger (the mcp package,
    the project's own code) at WARNING and above, rather than through ``logging.basicConfig``'s
    handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ConsoleLine())
    for name in ("kit_http", "kit_mcp", "kit_serve"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
    logging.getLogger("kit_http.hypercorn").setLevel(logging.WARNING)  # "Running on" repeats ours
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    """``kit-serve``: serve the project at ``KIT_PROJECT`` (unset or empty: ``.kit``) on
    ``HOST``:``PORT`` (unset or empty: 0.0.0.0:8000) with the ``KIT_WORKER`` worker (asyncio, the
    default, or trio), the surfaces ``KIT_SURFACES`` names, the playground at ``/`` unless
    ``--no-playground`` or ``KIT_PLAYGROUND=0``, and the ``Host``/``Origin`` policy of
    ``KIT_ALLOWED_HOSTS`` / ``KIT_CORS_ORIGINS`` (kit_guard); ``--access-log`` (or
    ``KIT_ACCESS_LOG=1``) logs every request. Returns 0 after SIGINT/SIGTERM, 1 when the project
    cannot be served (a missing extra, a broken project, a taken address), 2 on usage, 130 on
    Ctrl-C before it serves (while the project loads or the deck opens; no traceback), 143 on
    SIGTERM then (128 + its number, as a shell reports it; the deck is closed)."""
    env = os.environ
    parser = argparse.ArgumentParser(prog="kit-serve", description="Serve a kit project over HTTP "
                                     "and SSE. The API is unauthenticated.")
    # An exported empty setting (an env file's `PORT=`) is unset, as every kit setting's is.
    parser.add_argument("--host", default=env.get("HOST", "").strip() or "0.0.0.0",
                        help="bind address (HOST)")
    parser.add_argument("--port", default=env.get("PORT", "").strip() or "8000",
                        help="bind port (PORT)")
    parser.add_argument("--worker", default=env.get("KIT_WORKER", "").strip() or "asyncio",
                        help="asyncio or trio (KIT_WORKER)")
    parser.add_argument("--surfaces", default=env.get("KIT_SURFACES", ""),
                        help="optional surfaces to serve too, comma-separated: openai (POST "
                        "/v1/chat/completions, GET /v1/models) and mcp (/mcp) (KIT_SURFACES)")
    parser.add_argument("--no-playground", dest="playground", action="store_const", const=False,
                        help="do not serve the playground page at / (KIT_PLAYGROUND=0)")
    try:
        access_log = switch_setting("KIT_ACCESS_LOG", env.get("KIT_ACCESS_LOG"), False)
    except ConfigError as exc:
        parser.error(str(exc))
    parser.add_argument("--access-log", action="store_true", default=access_log,
                        help="one line per request (KIT_ACCESS_LOG=1)")
    args = parser.parse_args(argv)
    if args.worker not in ("asyncio", "trio"):
        parser.error(f"the worker is asyncio or trio, got {args.worker!r}")
    if not str(args.port).isdecimal() or int(args.port) > 65535:
        parser.error(f"the port must be a number from 0 to 65535, got {args.port!r}")
    surfaces = [name.strip() for name in args.surfaces.split(",") if name.strip()]
    if set(surfaces) - set(SURFACES):
        parser.error(f"the surfaces are {', '.join(SURFACES)}, got {args.surfaces!r}")
    _console()
    for module, extra in (("hypercorn", "serve"), ("trio", "trio")):
        if (extra == "serve" or args.worker == "trio") and importlib.util.find_spec(module) is None:
            _log.error("%s is missing: pip install 'kit[%s]'", module, extra)
            return 1
    terminated: list[int] = []  # SIGTERM while it starts takes Ctrl-C's path: the deck is closed

    def terminate(signum: int, frame: Any) -> None:
        terminated.append(signum)
        held = signal.getsignal(signal.SIGINT)  # trio's, asyncio's runner's or Python's own
        (held if callable(held) else signal.default_int_handler)(signal.SIGINT, frame)
    signal.signal(signal.SIGTERM, terminate)
    try:
        import kit  # the composition root: only the console entry point builds a deck itself
        return _serve(kit, args, surfaces, env)
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:  # before Hypercorn took SIGINT (trio's
        if isinstance(exc, BaseExceptionGroup) and exc.split(KeyboardInterrupt)[1] is not None:
            raise  # nursery wraps it): a user who gave up waiting
        return 143 if terminated else 130


def _serve(kit: Any, args: argparse.Namespace, surfaces: list[str], env: Mapping[str, str]) -> int:
    """``main`` once its arguments are good: build the deck (``kit``: the module, which ``main``
    imports) and serve it until a signal."""
    failed = FailedRunLog(env)
    try:  # the observers the settings ask for, then the failed-run lines
        guard = Guard.from_env(env, bind=args.host)
        deck = kit.Deck.from_project(env.get("KIT_PROJECT") or ".kit",  # empty: unset
                                     observers=[*resolve_observers(None, env), failed])
        app = App(deck, surfaces=surfaces, playground=args.playground, guard=guard)
    except KitError as exc:  # a bundle that failed to import: what it raised may quote secrets
        _log.error("%s", failed.redact(str(exc)))
        return 1
    if deck.agents:  # this process is kit's: no exporter to OpenAI's tracing
        import kit_agents
        kit_agents.no_default_exporter()
    try:
        anyio.run(lambda: serve(app, host=args.host, port=int(args.port),
                                access_log=args.access_log), backend=args.worker)
    except OSError as exc:  # the address is taken or not ours: serve() named it
        _log.error("%s", exc.strerror or exc)
        return 1
    except Exception as exc:  # the deck did not open: the app kept why, said on one line, masked
        cause = app.open_error or exc
        _log.error("%s: %s", type(cause).__name__, failed.redact(str(cause)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
