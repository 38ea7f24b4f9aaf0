"""kit_guard: which browser requests kit's HTTP surface answers, and its CORS answers.

Owns: the ``Host`` allowlist (against DNS rebinding), the ``Origin`` check (against cross-site
requests), the CORS headers and preflight answer for the origins an operator listed (``Guard``),
and reading ``KIT_ALLOWED_HOSTS`` / ``KIT_CORS_ORIGINS`` (``Guard.from_env``). It works on header
values only: kit_http asks it, raises what it says, and answers.

Must never: touch ASGI messages, sockets or the deck; refuse a request for lacking ``Origin``
(curl, SDKs and v1 clients send none, and only browsers forge nothing else); answer CORS for an
origin that was not listed (so a listed origin is a decision, never a default); send
``Access-Control-Allow-Credentials`` (kit has no credentials to share).

Theory of operation
-------------------
kit-serve has no authentication (SPEC), so two browser attacks are what it must stop
(notes/CONVENTIONS.md A11). *DNS rebinding*: a hostile page whose name resolves to 127.0.0.1 is
same-origin with a local kit-serve, but its requests carry ``Host: attacker.example``; only
names on the allowlist are served (421 otherwise; a request without ``Host`` cannot come from a
browser and passes). *Cross-site requests*: any page can send a "simple" POST (no preflight) to
a loopback port; browsers put ``Origin`` on every POST and on every cross-origin request, so a
request that carries an ``Origin`` other than the server's own or a listed one is refused (403)
before anything runs. Listed origins get CORS answers (RFC 9110 is silent here: the Fetch
standard's CORS protocol), so a front end elsewhere can call the API on purpose.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from kit_core import HTTP_TOKEN, ConfigError, KitError, quoted

__all__ = (
    "Guard", "HostNotAllowedError", "OriginNotAllowedError",
    "LOOPBACK_HOSTS", "ANY_HOST", "PREFLIGHT_HEADERS",
)

#: Served by default: names that resolve to this machine only, so a page on them is ours.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
#: In ``KIT_ALLOWED_HOSTS``, every host name (behind a proxy that checks ``Host`` itself): it
#: turns DNS-rebinding protection off.
ANY_HOST = "*"
#: A preflight answer (``OPTIONS`` with ``Access-Control-Request-Method``) to a listed origin,
#: beside ``Guard.cors_headers`` and the request headers it allows (``Guard.preflight_headers``):
#: every route is a GET or a POST; browsers may keep the answer 10 minutes (Chromium caps it at
#: 2 hours).
PREFLIGHT_HEADERS = ((b"access-control-allow-methods", b"GET, POST"),
                     (b"access-control-max-age", b"600"))
#: The request headers every preflight answer allows: ``content-type`` for JSON bodies,
#: ``last-event-id`` to resume a stream with ``fetch``, ``x-kit-session-id`` to name the
#: conversation on the Chat Completions wire, ``mcp-protocol-version`` for MCP clients.
_ALLOWED_HEADERS = ("content-type", "last-event-id", "x-kit-session-id", "mcp-protocol-version")
#: The headers a CORS response exposes to the page: the run a response belongs to, and whether
#: an OpenAI client may retry an error (a page cannot read a header not exposed, so its client
#: would retry a failed turn and play it again).
_EXPOSED = "x-kit-run-id, x-should-retry"
_DEFAULT_PORT = {"http": "80", "https": "443"}
#: A host name or address as ``_host_name`` leaves it (a port or a path does not fit).
_NAME = re.compile(r"\[[0-9a-f:.]+\]|[a-z0-9_-]+(\.[a-z0-9_-]+)*")


class HostNotAllowedError(KitError):
    """The request's ``Host`` is not on the allowlist: a DNS-rebinding page, or a name the
    operator has not listed in ``KIT_ALLOWED_HOSTS``. Contrast ``OriginNotAllowedError``: the
    server was reached by a name it serves, from a page it does not."""

    def __init__(self, host: str, allowed: Iterable[str]) -> None:
        self.host, self.allowed = host, tuple(allowed)
        super().__init__(f"this server does not answer for Host {quoted(host)}; it answers for "
                         f"{', '.join(self.allowed)} (set KIT_ALLOWED_HOSTS to add names)")


class OriginNotAllowedError(KitError):
    """The request comes from a web page of another origin that is not in ``KIT_CORS_ORIGINS``."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        super().__init__(f"requests from pages of origin {quoted(origin)} are refused; list it in "
                         "KIT_CORS_ORIGINS to allow it")


def _host_name(value: str) -> str:
    """The name part of a ``Host`` header or an allowlist entry: lower case, no port, no final
    dot; an IP address in its short form, IPv6 in brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        value = value[1:value.find("]")] if "]" in value else value
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    value = value.rstrip(".")
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return value
    return f"[{ip.compressed}]" if ip.version == 6 else ip.compressed


def _origin(value: str) -> str | None:
    """``scheme://host[:port]`` in lower case without a default port, or None if ``value`` is
    not a web origin (``null``, a path, another scheme)."""
    try:
        parts = urlsplit(value.strip().lower())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORT or not parts.hostname or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username is not None:
        return None
    host = _host_name(parts.hostname)
    keep = port is not None and str(port) != _DEFAULT_PORT[parts.scheme]
    return f"{parts.scheme}://{host}{f':{port}' if keep else ''}"


def _is_host(host: str) -> bool:
    return "/" not in host and bool(_NAME.fullmatch(_host_name(host)))


class Guard:
    """The browser-safety policy of one app: the host names it answers for and the origins
    (beside its own) whose pages may call it.

    ``allowed_hosts``: host names or addresses (a port is ignored; ``[::1]`` or ``::1``), or
    ``ANY_HOST`` (alone, or in the list).
    ``cors_origins``: ``scheme://host[:port]`` origins. Raises ``ConfigError`` for an entry that
    is neither, or for either given as one string rather than a list.
    """

    def __init__(self, allowed_hosts: Iterable[str] = LOOPBACK_HOSTS,
                 cors_origins: Iterable[str] = ()) -> None:
        if allowed_hosts == ANY_HOST:  # a string, but never a list's worth of letters
            allowed_hosts = (ANY_HOST,)
        for name, given in (("allowed_hosts", allowed_hosts), ("cors_origins", cors_origins)):
            if isinstance(given, str):  # its letters would each be a host: every request a 421
                raise ConfigError(f"Guard({name}=...) takes a list, got the string {given!r}: "
                                  f"wrap it in a list, {name}=[{given!r}]")
        hosts = [h.strip() for h in allowed_hosts if h.strip()]
        for host in hosts:
            if host != ANY_HOST and not _is_host(host):
                raise ConfigError(f"KIT_ALLOWED_HOSTS lists host names, got {host!r}")
        self.any_host = ANY_HOST in hosts
        self.hosts = tuple(dict.fromkeys(_host_name(h) for h in hosts if h != ANY_HOST))
        origins = []
        for raw in cors_origins:
            if raw.strip():
                origin = _origin(raw)
                if origin is None:
                    raise ConfigError(f"KIT_CORS_ORIGINS lists origins (scheme://host[:port]), "
                                      f"got {raw.strip()!r}")
                origins.append(origin)
        self.origins = frozenset(origins)

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, bind: str | None = None) -> Guard:
        """The policy from ``KIT_ALLOWED_HOSTS`` and ``KIT_CORS_ORIGINS`` (comma-separated).
        Without ``KIT_ALLOWED_HOSTS``: ``LOOPBACK_HOSTS``, plus ``bind`` when it is one address
        (a wildcard such as 0.0.0.0 adds nothing: the operator lists the names it is reached by).
        Raises ``ConfigError`` for a malformed entry, or a list of none (``,``)."""
        listed = env.get("KIT_ALLOWED_HOSTS", "").strip()
        if listed:
            hosts: list[str] = listed.split(",")
            if not any(h.strip() for h in hosts):  # it would answer for no host at all
                raise ConfigError(f"KIT_ALLOWED_HOSTS lists host names, got {listed!r}")
        else:
            hosts = list(LOOPBACK_HOSTS)
            if bind and bind.strip("[]") not in ("", "0.0.0.0", "::"):
                if not _is_host(bind.strip()):  # named as what the user gave, not as a list
                    raise ConfigError(f"the address to bind (--host or HOST) is a host name or "
                                      f"address, got {bind!r}")
                hosts.append(bind)
        return cls(hosts, env.get("KIT_CORS_ORIGINS", "").split(","))

    def describe(self) -> str:
        """One line for the startup banner: the hosts answered and the origins allowed."""
        hosts = "any host" if self.any_host else ", ".join(self.hosts)
        origins = ", ".join(sorted(self.origins)) or "none"
        return (f"answering Host {hosts} (KIT_ALLOWED_HOSTS); pages of other origins allowed: "
                f"{origins} (KIT_CORS_ORIGINS)")

    def check(self, *, host: str | None, origin: str | None, scheme: str) -> None:
        """Refuse a request by its ``Host`` and ``Origin`` headers (None when absent).
        Raises ``HostNotAllowedError`` or ``OriginNotAllowedError``."""
        if host is not None and not self.any_host and _host_name(host) not in self.hosts:
            raise HostNotAllowedError(host, self.hosts)
        if origin is not None and not self.allows_origin(origin):
            own = _origin(f"{scheme}://{host}") if host else None
            if own is None or _origin(origin) != own:
                raise OriginNotAllowedError(origin)

    def allows_origin(self, origin: str | None) -> bool:
        """Whether ``origin`` was listed (and so gets CORS answers)."""
        return origin is not None and _origin(origin) in self.origins

    def preflight_headers(self, requested: str | None) -> list[tuple[bytes, bytes]]:
        """A listed origin's preflight answer beside ``cors_headers``: ``PREFLIGHT_HEADERS``, and
        the request headers allowed: kit's own, and every other one the preflight asks for
        (``requested``, its ``Access-Control-Request-Headers``). The origin was listed, so its
        pages are trusted with the whole API, and a header grants nothing more; clients send
        their own (an OpenAI client in a browser: ``authorization``, ``x-stainless-*``), which
        the browser refuses to send unless named here (``*`` never covers ``authorization``)."""
        names = list(_ALLOWED_HEADERS)
        for name in (requested or "").lower().split(","):
            name = name.strip()
            if HTTP_TOKEN.fullmatch(name) and name not in names:
                names.append(name)
        return [*PREFLIGHT_HEADERS, (b"access-control-allow-headers", ", ".join(names).encode())]

    def cors_headers(self, origin: str | None) -> list[tuple[bytes, bytes]]:
        """The headers every response to a listed origin carries (a preflight adds
        ``preflight_headers``); none for any other origin."""
        if not self.allows_origin(origin):
            return []
        return [(b"access-control-allow-origin", origin.encode("latin-1")),
                (b"access-control-expose-headers", _EXPOSED.encode()), (b"vary", b"origin")]

