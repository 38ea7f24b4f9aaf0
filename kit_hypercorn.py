"""kit_hypercorn: what ``kit_http.serve`` hands Hypercorn: its configuration and its shutdown.

Owns: ``hypercorn_config`` (Hypercorn's ``Config`` for an address, probed by binding it once, so
a taken address is refused before the deck opens, and ``port=0`` tells the port the system
chose; its backlog; the access log ``kit_http.access`` with its format and its filter that makes
a logged path printable; Hypercorn's own messages on ``kit_http.hypercorn``) and
``until_stopped`` (``serve``'s shutdown trigger: the caller's, or SIGINT/SIGTERM, then the app's
own shutdown, a second signal hurrying it).

Must never: import Hypercorn at module import (``deck.asgi()`` works without the ``serve``
extra), import kit_http (above it: the app it serves is met through its ``shutdown`` and
``hurry``), or log a query string or a header.

Theory of operation: Hypercorn binds only after the app's lifespan has run, so a bind that
fails then leaves a half-open app: the address is bound once here first and closed again, and
Hypercorn binds it anew. Hypercorn's graceful timeout does not end open streams on Python 3.12+
(notes/CONVENTIONS.md A7), so the shutdown trigger ends them itself (``App.shutdown``) before
it returns; the signal receiver is held through that shutdown so that a second signal hurries it
(``App.hurry``) instead of raising ``KeyboardInterrupt`` in the middle of it.
"""
from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from kit_core import printable

if TYPE_CHECKING:
    from kit_http import App

__all__ = ("hypercorn_config", "until_stopped")

#: The access log (``serve(access_log=True)``) and Hypercorn's own messages, under kit_http's
#: logger: only ``kit-serve`` (kit_serve) gives them a handler.
_access_log = logging.getLogger("kit_http.access")
_hypercorn_log = logging.getLogger("kit_http.hypercorn")


class _PrintableAccess(logging.Filter):
    """The access log's path (Hypercorn's ``U`` atom, decoded) with control characters escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, dict) and isinstance(record.args.get("U"), str):
            record.args["U"] = printable(record.args["U"])
        return True


_PRINTABLE_ACCESS = _PrintableAccess()


def hypercorn_config(host: str, port: int, access_log: bool) -> tuple[Any, str, int]:
    """Hypercorn's ``Config`` for ``serve``, its address probed by binding it once: the config,
    the host as a URL writes it, and the port (the one the system chose for ``port=0``).
    Raises ``OSError`` naming the address when it cannot listen."""
    from hypercorn.config import Config
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address as a URL writes it
        host = host[1:-1]
    named = f"[{host}]" if ":" in host else host  # the host as a URL (and a bind) writes it
    config = Config()
    config.bind = [f"{named}:{port}"]
    config.backlog = 1024  # bursts of connections, such as 1,000 streams at once (CONVENTIONS A7)
    config.accesslog = _access_log if access_log else None
    _access_log.addFilter(_PRINTABLE_ACCESS)  # once: addFilter skips a filter it holds
    config.errorlog = _hypercorn_log
    config.access_log_format = '%(h)s "%(m)s %(U)s" %(s)s %(L)ss'  # no query, no headers
    try:  # Hypercorn binds only after the lifespan; a failed bind then leaves a half-open app
        probe = config.create_sockets()
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {named}:{port}: {exc.strerror}") from None
    for sock in probe.secure_sockets + probe.insecure_sockets + probe.quic_sockets:
        if port == 0:  # the port the system chose: the one served, and the one told
            port = sock.getsockname()[1]
            config.bind = [f"{named}:{port}"]
        sock.close()
    return config, named, port


async def until_stopped(app: App, shutdown_trigger: Callable[[], Awaitable[Any]] | None) -> None:
    """``serve``'s shutdown trigger: wait for ``shutdown_trigger`` (default: SIGINT or SIGTERM),
    then shut ``app`` down (``App.shutdown``), a second signal hurrying it (``App.hurry``)."""
    if shutdown_trigger is not None:
        await shutdown_trigger()
        await app.shutdown()
        return
    # Held through the shutdown: a second signal ends the grace at once, where Python's
    # default handler would raise KeyboardInterrupt in the middle of it.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            break
        async with anyio.create_task_group() as tg:
            async def hurry() -> None:
                async for _ in signals:
                    app.hurry()
            tg.start_soon(hurry)
            await app.shutdown()
            tg.cancel_scope.cancel()
